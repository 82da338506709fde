//! Weight sync (`rdt::weights`): versions only increase, a late
//! subscriber gets the current version, a layout mismatch is refused
//! before any byte moves, readers never see a mixed version, a slow
//! reader never blocks the trainer, and a subscriber that dies leaves the
//! others and the trainer unaffected.

use rdt::prelude::*;
use rdt::weights::Published;
use rdt_integration_tests::deadline;
use rdt_integration_tests::weight_sync::*;

/// A trainer over `transport` and `n` double-buffered rollouts,
/// subscribed (a `tcp` group made of all of them).
async fn setup(
    rt: &Runtime,
    transport: &str,
    n: usize,
) -> (SyncTrainerHandle, Vec<SyncRolloutHandle>) {
    setup_with(rt, transport, n, false).await
}

/// [`setup`], the rollouts receiving in place if `in_place`.
async fn setup_with(
    rt: &Runtime,
    transport: &str,
    n: usize,
    in_place: bool,
) -> (SyncTrainerHandle, Vec<SyncRolloutHandle>) {
    let layout = test_layout(4);
    let trainer = rt
        .spawn::<SyncTrainer>((layout.clone(), transport.to_string()))
        .await
        .unwrap();
    let mut rollouts = Vec::new();
    for _ in 0..n {
        rollouts.push(
            rt.spawn::<SyncRollout>((layout.clone(), in_place, false))
                .await
                .unwrap(),
        );
    }
    if transport == "tcp" {
        let mut members = vec![trainer.id()];
        members.extend(rollouts.iter().map(|r| r.id()));
        rt.create_collective_group(&members, Transport::Tcp)
            .await
            .unwrap();
    }
    let published = rt.get(trainer.layout().remote()).await.unwrap();
    for r in &rollouts {
        rt.get(r.subscribe(published.clone()).remote())
            .await
            .unwrap();
    }
    (trainer, rollouts)
}

async fn publish(rt: &Runtime, t: &SyncTrainerHandle, v: u64) -> Published {
    rt.get(t.publish(v).remote()).await.unwrap()
}

#[tokio::test]
async fn ws_5_a_stale_or_repeated_version_is_refused_and_the_live_one_stays() {
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let (t, rs) = setup(&rt, "shm", 1).await;
        let r = &rs[0];
        let v1 = publish(&rt, &t, 1).await;
        let v2 = publish(&rt, &t, 2).await;
        assert_eq!(
            rt.get(r.receive(v2.clone()).remote()).await.unwrap(),
            (2, true)
        );
        for stale in [v1, v2] {
            let e = rt.get(r.receive(stale.clone()).remote()).await.unwrap_err();
            match e.application_error::<rdt::Error>() {
                Some(rdt::Error::StaleVersion { version, current }) => {
                    assert_eq!((version, current), (stale.version, 2));
                }
                other => panic!("not a StaleVersion: {other:?} ({e})"),
            }
        }
        assert_eq!(rt.get(r.live().remote()).await.unwrap(), (Some(2), true));
        // The trainer refuses to publish an old number too.
        let e = rt.get(t.publish(2).remote()).await.unwrap_err();
        assert!(e.to_string().contains("not newer than version 2"), "{e}");
        rt.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn ws_1_a_layout_mismatch_is_refused_before_any_byte_moves() {
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let (t, _) = setup(&rt, "shm", 0).await;
        // The rollout's up_proj is [32, 65], the trainer's [32, 64].
        let mut theirs: Vec<_> = test_layout(4)
            .params()
            .iter()
            .map(|p| (p.name.clone(), p.dtype, p.shape.clone()))
            .collect();
        theirs[1].2 = vec![32, 65];
        let wrong = rdt::weights::Layout::new(theirs).unwrap();
        let r = rt
            .spawn::<SyncRollout>((wrong, false, false))
            .await
            .unwrap();
        let layout = rt.get(t.layout().remote()).await.unwrap();
        let e = rt.get(r.subscribe(layout).remote()).await.unwrap_err();
        match e.application_error::<rdt::Error>() {
            Some(rdt::Error::LayoutMismatch { difference }) => assert!(
                difference.starts_with(
                    "model.layers.0.mlp.up_proj.weight: f32 [32, 65] here, f32 [32, 64] there"
                ),
                "{difference}"
            ),
            other => panic!("not a LayoutMismatch: {other:?} ({e})"),
        }
        // A version sent anyway is refused by its digest, and nothing
        // was received.
        let v1 = publish(&rt, &t, 1).await;
        let e = rt.get(r.receive(v1).remote()).await.unwrap_err();
        assert!(
            matches!(
                e.application_error::<rdt::Error>(),
                Some(rdt::Error::LayoutMismatch { .. })
            ),
            "{e}"
        );
        assert_eq!(rt.get(r.received().remote()).await.unwrap(), 0);
        assert_eq!(rt.get(r.live().remote()).await.unwrap(), (None, true));
        rt.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_late_subscriber_gets_the_current_version_and_then_the_next() {
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let (t, rs) = setup(&rt, "shm", 1).await;
        let mut latest = None;
        for v in 1..=3 {
            let p = publish(&rt, &t, v).await;
            assert_eq!(
                rt.get(rs[0].receive(p.clone()).remote()).await.unwrap(),
                (v, true)
            );
            latest = Some(p);
        }
        // The driver kept the newest version for late joiners.
        let late = rt
            .spawn::<SyncRollout>((test_layout(4), false, false))
            .await
            .unwrap();
        let layout = rt.get(t.layout().remote()).await.unwrap();
        rt.get(late.subscribe(layout).remote()).await.unwrap();
        let current = latest.take().unwrap();
        assert_eq!(
            rt.get(late.receive(current).remote()).await.unwrap(),
            (3, true)
        );
        let p4 = publish(&rt, &t, 4).await;
        for r in [&rs[0], &late] {
            assert_eq!(
                rt.get(r.receive(p4.clone()).remote()).await.unwrap(),
                (4, true)
            );
        }
        rt.shutdown().await;
    })
    .await;
}

/// WS-4, WS-6: the trainer publishes version after version while two
/// rollouts receive them and a reader thread in each reads its live
/// parameters all along; no step sees bytes of two versions.
async fn no_reader_sees_a_mixed_version(transport: &str) {
    no_reader_sees_a_mixed_version_in(transport, false).await
}

async fn no_reader_sees_a_mixed_version_in(transport: &str, in_place: bool) {
    let rt = Runtime::start().await.unwrap();
    let (t, rs) = setup_with(&rt, transport, 2, in_place).await;
    for r in &rs {
        rt.get(r.start_reading(50).remote()).await.unwrap();
    }
    const VERSIONS: u64 = 40;
    let mut pending = Vec::new();
    for v in 1..=VERSIONS {
        let p = publish(&rt, &t, v).await;
        // Receives of v run while the trainer writes v + 1.
        pending.extend(rs.iter().map(|r| r.receive(p.clone()).remote()));
        if pending.len() > 4 {
            for call in pending.drain(..2) {
                assert!(rt.get(call).await.unwrap().1, "a version landed whole");
            }
        }
    }
    for call in pending {
        assert!(rt.get(call).await.unwrap().1, "a version landed whole");
    }
    for r in &rs {
        let stats = rt.get(r.stop_reading().remote()).await.unwrap();
        assert_eq!(stats.mixed, 0, "{transport}: {stats:?}");
        assert!(stats.steps > 0);
        assert!(stats.versions.windows(2).all(|w| w[0] < w[1]), "{stats:?}");
        assert_eq!(stats.versions.last(), Some(&VERSIONS), "{stats:?}");
    }
    assert_eq!(rt.get(t.exports().remote()).await.unwrap(), VERSIONS);
    rt.shutdown().await;
}

#[tokio::test]
async fn ws_4_no_reader_sees_a_mixed_version_over_shm() {
    deadline(120, no_reader_sees_a_mixed_version("shm")).await;
}

#[tokio::test]
async fn ws_4_no_reader_sees_a_mixed_version_over_nixl() {
    deadline(120, no_reader_sees_a_mixed_version("nixl")).await;
}

#[tokio::test]
async fn ws_4_no_reader_sees_a_mixed_version_over_tcp() {
    deadline(120, no_reader_sees_a_mixed_version("tcp")).await;
}

/// Received straight into the live parameters, readers wait for the
/// receive instead: still no mixed step.
#[tokio::test]
async fn ws_4_in_place_no_reader_sees_a_mixed_version_over_shm() {
    deadline(120, no_reader_sees_a_mixed_version_in("shm", true)).await;
}

#[tokio::test]
async fn ws_3_a_slow_reader_never_blocks_the_trainer_and_keeps_its_snapshot() {
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let (t, rs) = setup(&rt, "shm", 2).await;
        let v1 = publish(&rt, &t, 1).await;
        // One rollout takes version 1's own tensors (the trainer's memory,
        // over shm) and keeps them until the end: a reader slower than
        // every later version.
        assert!(rt.get(rs[0].take(v1.clone()).remote()).await.unwrap());
        drop(v1);
        // Ten versions are published and received meanwhile: were the
        // trainer to wait for the slow reader, this would never end.
        for v in 2..=11 {
            let p = publish(&rt, &t, v).await;
            assert_eq!(rt.get(rs[1].receive(p).remote()).await.unwrap(), (v, true));
        }
        // Version 1's buffer was never written again (WS-4)...
        assert!(
            rt.get(rs[0].release().remote()).await.unwrap(),
            "the slow reader saw bytes of a later version"
        );
        // ...which cost the trainer a buffer more, not a wait.
        assert!(rt.get(t.buffers().remote()).await.unwrap() >= 2);
        rt.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn a_subscriber_that_dies_mid_version_leaves_the_others_and_the_trainer_unaffected() {
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let (t, rs) = setup(&rt, "shm", 3).await;
        let p1 = publish(&rt, &t, 1).await;
        let doomed = rs[0].receive(p1.clone()).remote();
        rs[0].kill();
        for r in &rs[1..] {
            assert_eq!(
                rt.get(r.receive(p1.clone()).remote()).await.unwrap(),
                (1, true)
            );
        }
        assert!(rt.get(doomed).await.is_err());
        drop(p1);
        for v in 2..=6 {
            let p = publish(&rt, &t, v).await;
            for r in &rs[1..] {
                assert_eq!(
                    rt.get(r.receive(p.clone()).remote()).await.unwrap(),
                    (v, true)
                );
            }
        }
        // Version 1's buffer came back: the dead subscriber held nothing.
        assert!(rt.get(t.buffers().remote()).await.unwrap() <= 3);
        rt.shutdown().await;
    })
    .await;
}

/// The publish call's ref passed straight to every rollout (the driver
/// never decodes the `Published`, the rollouts borrow the version's ref
/// nested in it). A rollout once met that ref before the driver knew it
/// (its value came straight from the trainer, ahead of the trainer's
/// `Put`) and failed with `Freed` (PD-2).
async fn fan_out_on_the_publish_ref(transport: &str) {
    let rt = Runtime::start().await.unwrap();
    let (t, rs) = setup(&rt, transport, 3).await;
    for v in 1..=150 {
        publish_to_all(&rt, &t, &rs, v).await;
    }
    rt.shutdown().await;
}

#[tokio::test]
async fn a_version_fans_out_on_the_publish_ref_over_shm() {
    deadline(60, fan_out_on_the_publish_ref("shm")).await;
}

#[tokio::test]
async fn a_version_fans_out_on_the_publish_ref_over_tcp() {
    deadline(60, fan_out_on_the_publish_ref("tcp")).await;
}

#[tokio::test]
async fn publish_copy_publishes_a_snapshot_the_trainer_may_overwrite_at_once() {
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let (t, rs) = setup(&rt, "shm", 2).await;
        for v in 1..=5 {
            let p: Published = rt.get(t.publish_copy(v).remote()).await.unwrap();
            // The trainer has zeroed its own parameters since: the
            // version's bytes are the copy's.
            for r in &rs {
                assert_eq!(
                    rt.get(r.receive(p.clone()).remote()).await.unwrap(),
                    (v, true)
                );
            }
        }
        assert_eq!(rt.get(t.exports().remote()).await.unwrap(), 5);
        rt.shutdown().await;
    })
    .await;
}
