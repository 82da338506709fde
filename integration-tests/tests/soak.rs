//! Soak: 10 000 passes of mixed sizes over every CPU transport, with the
//! failure paths mixed in (calls that fail on another argument while this
//! one is still arriving, refs dropped while their receive runs, producers
//! killed with objects on the way); afterwards the owner table and the
//! workers' stores are empty, no transfer is in flight, and the workers'
//! memory and open descriptors are back to where they started (within
//! 5 s: an `shm` consumer lets go of the mappings it keeps within about
//! 200 ms of their producer's free, shm invariant 7).

use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::deadline;

const PASSES: usize = 10_000;
/// Passes in flight at once (refs submitted before the first is awaited).
const WINDOW: usize = 32;

/// Resident memory (KiB) and open descriptors of a process.
fn usage(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap();
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    (rss, fds)
}

fn size_of_pass(i: usize) -> usize {
    // 16 B .. 256 KiB f32 elements, in a fixed mixed pattern.
    [4, 256, 16 << 10, 64, 64 << 10, 1 << 10][i % 6]
}

async fn soak(t: Transport) {
    rdt_integration_tests::logs();
    let rt = Runtime::start().await.unwrap();
    let p = rt.spawn::<Producer>(()).await.unwrap();
    let c = rt.spawn::<Consumer>(()).await.unwrap();
    if t.is_collective() {
        rt.create_collective_group(&[p.id(), c.id()], t)
            .await
            .unwrap();
    }
    let run = |from: usize, to: usize| {
        let (rt, p, c) = (rt.clone(), p.clone(), c.clone());
        async move {
            let mut inflight = std::collections::VecDeque::new();
            for i in from..to {
                let n = size_of_pass(i);
                let r = p.make(1.0, n).transport(t).remote();
                if i % 10 == 7 {
                    // Fails on its first argument while the second may
                    // still be arriving (XF-5).
                    let bad = p.fail(format!("pass {i}")).remote();
                    let e = rt.get(c.sum2(&bad, &r).remote()).await.unwrap_err();
                    assert!(e.to_string().contains(&format!("pass {i}")), "{e}");
                    continue;
                }
                inflight.push_back((n, c.sum(&r).remote()));
                // The ref is dropped while its receive may be running.
                drop(r);
                if inflight.len() >= WINDOW {
                    let (n, s) = inflight.pop_front().unwrap();
                    assert_eq!(rt.get(&s).await.unwrap(), n as f64);
                }
            }
            for (n, s) in inflight {
                assert_eq!(rt.get(&s).await.unwrap(), n as f64);
            }
        }
    };
    // Warm up allocators and connections, then take the baseline.
    run(0, 600).await;
    // A pass whose value went straight to the consumer (OW-9) is freed
    // once the producer's answer reached the driver, which may come after
    // the consumer's.
    rt.transfers_settled().await;
    assert_eq!(rt.live_objects(), 0);
    let (pp, cp) = (p.pid().unwrap(), c.pid().unwrap());
    let base = (usage(pp), usage(cp));
    run(600, PASSES).await;
    // Producers killed with an object on the way (DR-3, OW-5).
    for _ in 0..3 {
        let q = rt.spawn::<Producer>(()).await.unwrap();
        let group = if t.is_collective() {
            Some(
                rt.create_collective_group(&[q.id(), c.id()], t)
                    .await
                    .unwrap(),
            )
        } else {
            None
        };
        let r = q.make(1.0, 64 << 10).transport(t).remote();
        rt.wait(&r).await.unwrap();
        q.kill();
        let e = rt.get(c.sum(&r).remote()).await;
        if t == Transport::ObjectStore {
            assert_eq!(e.unwrap(), (64 << 10) as f64, "the driver holds the value");
        } else {
            let e = e.unwrap_err();
            assert!(
                matches!(e.root_cause(), Error::ActorDied { actor, .. } if actor == q.name()),
                "{e}"
            );
        }
        // A group does not outlive a member: destroy it, as its error says.
        if let Some(g) = group {
            rt.destroy_collective_group(g).await.unwrap();
        }
    }
    rt.transfers_settled().await;
    assert_eq!(rt.transfers_in_flight(), 0);
    assert_eq!(rt.live_objects(), 0, "the owner table is empty");
    assert_eq!(
        rt.get(p.stored().remote()).await.unwrap(),
        0,
        "the producer's store is empty"
    );
    assert_eq!(
        rt.get(c.stored().remote()).await.unwrap(),
        0,
        "the consumer's store is empty"
    );
    // A consumer keeps its `shm` mappings while their producer publishes
    // the memfd, and lets go of them within about 200 ms of the producer's
    // free (shm invariant 7): wait that long, not forever, for them.
    let back = |(b_rss, b_fds): (u64, usize), pid: u32| {
        let (e_rss, e_fds) = usage(pid);
        e_rss <= b_rss + 32 * 1024 && e_fds <= b_fds + 4
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !(back(base.0, pp) && back(base.1, cp)) && std::time::Instant::now() < until {
        tokio::task::yield_now().await;
    }
    let end = (usage(pp), usage(cp));
    for ((b_rss, b_fds), (e_rss, e_fds), who) in
        [(base.0, end.0, "producer"), (base.1, end.1, "consumer")]
    {
        assert!(
            e_rss <= b_rss + 32 * 1024,
            "{t}: {who} memory grew from {b_rss} KiB to {e_rss} KiB over {PASSES} passes"
        );
        assert!(
            e_fds <= b_fds + 4,
            "{t}: {who} descriptors grew from {b_fds} to {e_fds}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_object_store() {
    deadline(240, soak(Transport::ObjectStore)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_tcp() {
    deadline(240, soak(Transport::Tcp)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_shm() {
    deadline(240, soak(Transport::Shm)).await;
}
