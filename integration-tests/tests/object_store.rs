//! The object-store path streams large blobs into pooled host buffers
//! (`rdt::data::host_pool`) at both receiving ends, the driver and the
//! consumer, and reuses them pass after pass: the tests prove it from the
//! pool counters of both processes and from where the received bytes lie.

use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::{deadline, spin_until};

const DL: u64 = 120;

#[tokio::test]
async fn large_blobs_land_in_pool_buffers_that_later_passes_reuse() {
    deadline(DL, async {
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        // 4 MiB per pass: far over the pool's 256 KiB threshold.
        let n = 1 << 20;
        let driver_before = rdt::data::host_pool::stats();
        let mut last = (0, 0);
        for i in 0..6u32 {
            let r = p
                .make(i as f32, n)
                .transport(Transport::ObjectStore)
                .remote();
            let (sum, aligned, hits, misses) = rt.get(c.sum_pooled(&r).remote()).await.unwrap();
            assert_eq!(
                sum,
                i as f64 * n as f64,
                "pass {i}: the bytes arrived whole"
            );
            assert!(
                aligned,
                "pass {i}: the consumer read the blob into a pool buffer"
            );
            last = (hits, misses);
            // The driver's copy goes back to its pool once the ref is gone.
            drop(r);
        }
        let (hits, misses) = last;
        assert!(
            hits + misses >= 6,
            "the consumer took a pool buffer for every pass ({hits} hits, {misses} misses)"
        );
        assert!(
            hits >= 1,
            "later passes reuse the consumer's buffers ({hits} hits, {misses} misses)"
        );
        // The driver received each result into its own pool (this test
        // process's counters: other tests add to them, never take away).
        let driver = rdt::data::host_pool::stats();
        assert!(
            driver.hits + driver.misses >= driver_before.hits + driver_before.misses + 6,
            "the driver streamed every result into a pool buffer: {driver_before:?} -> {driver:?}"
        );
        rt.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn the_driver_forwards_a_large_value_while_it_still_arrives() {
    deadline(DL, async {
        rdt_integration_tests::logs();
        // The driver's path: no value goes straight to its consumer.
        let rt = Runtime::builder()
            .peer_delivery(false)
            .start()
            .await
            .unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        let n = 16 << 20; // 64 MiB of f32
        let bytes = 4 * n as u64;
        for i in 1..=3u32 {
            // The consumer's call waits in the driver for the result, so
            // the driver passes the result on as its bytes come in.
            let r = p
                .make(i as f32, n)
                .transport(Transport::ObjectStore)
                .remote();
            let sum = c.sum(&r).remote();
            assert_eq!(
                rt.get(&sum).await.unwrap(),
                i as f64 * n as f64,
                "pass {i}: every byte arrived, in order"
            );
            // The driver's own copy is whole too.
            let back = rt.get(&r).await.unwrap();
            assert_eq!(back.nbytes(), bytes as usize);
            let (forwarded, early) = rt.forwarded_bytes();
            assert!(
                forwarded >= i as u64 * bytes,
                "pass {i}: the driver sent the value on while it arrived \
                 ({forwarded} B forwarded that way, {early} B before whole)"
            );
        }
        assert_eq!(rt.live_objects(), 0, "every pass's objects are freed");
        rt.shutdown().await;
    })
    .await;
}

/// A producer stopped (SIGSTOP) while the driver forwards its large value
/// to a consumer holds that consumer's connection for at most the transfer
/// deadline: the consumer's call fails and says why, the consumer takes
/// its next call, and the value is whole in the driver once its producer
/// goes on.
#[tokio::test]
async fn a_producer_stopped_mid_value_costs_its_consumer_the_deadline_not_a_hang() {
    stopped_mid_value(Path::ThroughDriver).await;
}

/// OW-9, PD-2: a large value through the driver, still pending when its
/// consumer's call comes, goes straight from its producer to the
/// consumer (one crossing, not two), and the driver keeps a whole copy of
/// its own (OW-11): it forwarded nothing, and its `get` reads that copy.
#[tokio::test]
async fn a_pending_value_goes_straight_and_the_driver_keeps_its_copy() {
    deadline(DL, async {
        rdt_integration_tests::logs();
        // Large values go straight on this machine whatever its cores.
        let rt = Runtime::builder()
            .straight_large_values(true)
            .start()
            .await
            .unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        // 64 MiB of f32.
        let n = 16 << 20;
        // The first pass makes the link between the two (PD-3: it may go
        // through the driver).
        let r = p.make(1.0, n).transport(Transport::ObjectStore).remote();
        assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), n as f64);
        drop(r);
        let straight = rt.get(c.straight().remote()).await.unwrap();
        let (forwarded, _) = rt.forwarded_bytes();
        for i in 2..=4u32 {
            let r = p
                .make(i as f32, n)
                .transport(Transport::ObjectStore)
                .remote();
            assert_eq!(
                rt.get(c.sum(&r).remote()).await.unwrap(),
                i as f64 * n as f64,
                "pass {i}: every byte arrived"
            );
            let back = rt.get(&r).await.unwrap();
            assert_eq!(
                back.sum().unwrap(),
                i as f64 * n as f64,
                "the driver's copy"
            );
        }
        assert_eq!(rt.get(c.straight().remote()).await.unwrap(), straight + 3);
        assert_eq!(
            rt.forwarded_bytes().0,
            forwarded,
            "the driver forwarded none of the straight values"
        );
        rt.transfers_settled().await;
        assert_eq!(rt.live_objects(), 0, "every pass's objects are freed");
        rt.shutdown().await;
    })
    .await;
}

/// A producer stopped (SIGSTOP) while its large value goes straight to a
/// consumer costs that consumer's call the transfer deadline, not a hang:
/// the call fails and says so, the consumer takes its next call, and the
/// driver's copy is whole once the producer goes on.
#[tokio::test]
async fn a_producer_stopped_mid_straight_value_costs_its_consumer_the_deadline() {
    stopped_mid_value(Path::Straight).await;
}

/// How a large value reaches its consumer in [`stopped_mid_value`].
#[derive(Clone, Copy, PartialEq)]
enum Path {
    /// Forwarded by the driver as it arrives (peer delivery off).
    ThroughDriver,
    /// Straight from the producer, over a link a first pass made.
    Straight,
}

/// Stops the producer of a 512 MiB value while it is on its way to a
/// consumer along `path`, and checks that the consumer's call fails within
/// the transfer deadline (saying why), that the consumer takes its next
/// call while the producer is still stopped, and that the driver's copy is
/// whole once the producer goes on.
async fn stopped_mid_value(path: Path) {
    deadline(DL, async {
        rdt_integration_tests::logs();
        let limit = std::time::Duration::from_secs(2);
        let rt = Runtime::builder()
            .transfer_timeout(limit)
            .peer_delivery(path == Path::Straight)
            .straight_large_values(true)
            .start()
            .await
            .unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        if path == Path::Straight {
            // The link between the two, made by a first pass.
            let r = p.make(1.0, 4).transport(Transport::ObjectStore).remote();
            assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 4.0);
        }
        let n = 128 << 20; // 512 MiB of f32
        let pid = p.pid().expect("a local worker") as i32;
        // The stop must land while the value is still on its way. Under
        // load it can arrive whole before the stop (then nothing stalls,
        // and the call simply succeeds): try again, a few times.
        let mut stopped_mid_value = false;
        for attempt in 1..=5 {
            let straight = rt.get(c.straight().remote()).await.unwrap();
            let r = p.make(1.0, n).transport(Transport::ObjectStore).remote();
            let sum = c.sum(&r).remote();
            match path {
                // Stop the producer once the driver forwards its value.
                Path::ThroughDriver => {
                    let (sent, _) = rt.forwarded_bytes();
                    spin_until("the value forwarded", 60, || rt.forwarded_bytes().0 > sent).await;
                }
                // The producer's reply has begun (its value is ready in
                // the driver while its bytes still come): it is sending.
                Path::Straight => rt.wait(&r).await.unwrap(),
            }
            // SAFETY: stopping (and later continuing) a worker of this test.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            let stopped = std::time::Instant::now();
            let got = rt.get(&sum).await;
            if let Ok(v) = got {
                assert_eq!(
                    v, n as f64,
                    "attempt {attempt}: if it finished, it is whole"
                );
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGCONT) };
                continue;
            }
            let e = got.unwrap_err().to_string();
            let why = match path {
                Path::ThroughDriver => "stopped coming",
                Path::Straight => "deadline",
            };
            assert!(e.contains(why), "{e}");
            assert!(
                stopped.elapsed() < limit + std::time::Duration::from_secs(10),
                "failed {:?} after the stop",
                stopped.elapsed()
            );
            if path == Path::Straight {
                assert_eq!(
                    rt.get(c.straight().remote()).await.unwrap(),
                    straight + 1,
                    "it went straight"
                );
            }
            // The consumer is free: its next call runs while the producer
            // is still stopped.
            assert_eq!(
                rt.get(c.sum(Tensor::full(1.0f32, &[4])).remote())
                    .await
                    .unwrap(),
                4.0
            );
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGCONT) };
            let whole = rt.get(&r).await.unwrap();
            assert_eq!(whole.nbytes(), 4 * n);
            assert_eq!(whole.sum().unwrap(), n as f64);
            stopped_mid_value = true;
            break;
        }
        assert!(stopped_mid_value, "no stop landed mid-value in 5 attempts");
        rt.shutdown().await;
    })
    .await;
}

/// Without `straight_large_values`, a large value through the driver
/// takes the driver's path (forwarded as it arrives) even with a link up,
/// and a small one still goes straight.
#[tokio::test]
async fn large_values_go_straight_only_where_asked() {
    deadline(DL, async {
        rdt_integration_tests::logs();
        let rt = Runtime::builder()
            .straight_large_values(false)
            .start()
            .await
            .unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        // The link between the two comes up beside the first passes (on
        // a loaded machine, after a few of them): pass until a small value
        // went straight.
        let mut passes = 0u32;
        let small = loop {
            passes += 1;
            let r = p
                .make(passes as f32, 4)
                .transport(Transport::ObjectStore)
                .remote();
            assert_eq!(
                rt.get(c.sum(&r).remote()).await.unwrap(),
                4.0 * passes as f64
            );
            let straight = rt.get(c.straight().remote()).await.unwrap();
            if straight >= 1 {
                break straight;
            }
            assert!(
                passes < 1000,
                "small values never went straight in {passes} passes"
            );
        };
        let n = 16 << 20; // 64 MiB of f32
        let (forwarded, _) = rt.forwarded_bytes();
        let r = p.make(2.0, n).transport(Transport::ObjectStore).remote();
        assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 2.0 * n as f64);
        assert_eq!(rt.get(c.straight().remote()).await.unwrap(), small);
        assert!(rt.forwarded_bytes().0 >= forwarded + 4 * n as u64);
        rt.shutdown().await;
    })
    .await;
}
