//! A killed actor's frames (CL-4), alone in its binary: it slows the
//! driver's reading down for the whole process.

use std::time::{Duration, Instant};

use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::deadline;

/// CL-4: the frames a killed actor wrote before it died (still in its
/// socket, or read and not yet handled) are not applied: they take no
/// counts and start nothing. At e05be92 its last `Put`s were applied
/// after its death was handled, and their objects stayed for good (65 093
/// in one run; here, with the driver slowed down, about 10 000 of the
/// frames queued when it died were applied after).
#[tokio::test(flavor = "multi_thread")]
async fn cl_4_frames_of_a_killed_actor_are_not_applied() {
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let a = rt.spawn::<Relay>(()).await.unwrap();
        let before = rt.live_objects();
        // The driver reads slowly: the actor's frames queue up in its
        // socket, as they do when it floods a busy driver.
        rdt::__private::fail::cfg("rdt::driver_read", "sleep(1)").unwrap();
        let flood = a.put_forever().remote();
        rdt_integration_tests::spin_until("2000 puts", 30, || rt.live_objects() >= before + 2000)
            .await;
        a.kill();
        rdt::__private::fail::remove("rdt::driver_read");
        let e = rt.get(&flood).await.unwrap_err();
        assert!(matches!(e, Error::ActorDied { .. }), "{e}");
        drop(flood);
        a.raw().exited().await.unwrap();
        // Its connection reaches its end once every frame in it was read:
        // none may leave anything behind.
        let t0 = Instant::now();
        while rt.live_objects() != before {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "{} objects of a dead actor left",
                rt.live_objects() - before
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        rt.shutdown().await;
    })
    .await
}
