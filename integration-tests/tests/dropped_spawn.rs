//! SP-1: a spawn whose future is dropped leaves no process behind; SP-2:
//! starting a worker blocks no executor thread. In their own binary: one
//! counts this process's children, the other slows the driver's process
//! starts down (a fail point, process-wide); they run one at a time.

use std::future::IntoFuture;
use std::time::{Duration, Instant};

use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::{children, deadline};

/// One test at a time in this binary (see the top).
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[tokio::test(flavor = "multi_thread")]
async fn sp_1_a_dropped_spawn_leaves_no_process() {
    let _one = ONE_AT_A_TIME.lock().await;
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let base = children();
        // Dropped while the worker constructs a slow actor (30 s).
        let slow = tokio::time::timeout(
            Duration::from_secs(2),
            rt.spawn::<SlowStart>(30_000).into_future(),
        )
        .await;
        assert!(slow.is_err(), "the constructor takes 30 s");
        // Dropped at its first poll's end: while the worker starts.
        {
            let mut early = rt.spawn::<Producer>(()).into_future();
            assert!(futures::poll!(&mut early).is_pending());
        }
        // The kills are asynchronous: the processes go within a bound.
        let t0 = Instant::now();
        while children() != base {
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "left running: {:?} (before: {base:?})",
                children()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let p = rt.spawn::<Producer>(()).await.unwrap();
        assert_eq!(rt.get(p.echo(1).remote()).await.unwrap(), 1);
        rt.shutdown().await;
    })
    .await
}

/// SP-2: a worker's process starts on the reaper's thread while the spawn
/// waits without blocking its executor thread: on a runtime of one thread,
/// other tasks run meanwhile. At e05be92 the spawn blocked that thread in
/// a channel's `recv` for as long as the start took (here slowed down to
/// 500 ms by a fail point).
#[tokio::test]
async fn sp_2_starting_a_worker_blocks_no_executor_thread() {
    let _one = ONE_AT_A_TIME.lock().await;
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        rdt::__private::fail::cfg("rdt::reaper_spawn", "1*sleep(500)").unwrap();
        // From before the spawn is first polled: a poll that blocks the
        // thread delays the sleep's start too.
        let t0 = Instant::now();
        let (spawned, slept) = tokio::join!(rt.spawn::<Producer>(()).into_future(), async {
            tokio::time::sleep(Duration::from_millis(10)).await;
            t0.elapsed()
        });
        rdt::__private::fail::remove("rdt::reaper_spawn");
        let p = spawned.unwrap();
        assert!(
            slept < Duration::from_millis(300),
            "a 10 ms sleep beside the spawn took {slept:?}"
        );
        assert_eq!(rt.get(p.echo(1).remote()).await.unwrap(), 1);
        rt.shutdown().await;
    })
    .await
}
