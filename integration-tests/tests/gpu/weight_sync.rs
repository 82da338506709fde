//! Weight sync on one GPU (included by `gpu.rs`): a trainer and two
//! rollouts colocated on GPU 0 over `cuda_ipc`, versions received into
//! each rollout's own GPU parameters and checked by checksum, stale
//! versions refused, and the fan-out of one export to both.

use super::*;
use rdt_integration_tests::weight_sync::*;

async fn colocated(rt: &Runtime, n: usize) -> (SyncTrainerHandle, Vec<SyncRolloutHandle>) {
    let layout = test_layout(64);
    let trainer = rt
        .spawn::<SyncTrainer>((layout.clone(), "cuda_ipc".to_string()))
        .gpus(1)
        .await
        .unwrap();
    let mut rollouts = Vec::new();
    for _ in 0..n {
        let r = rt
            .spawn::<SyncRollout>((layout.clone(), false, true))
            .gpus(1)
            .await
            .unwrap();
        rt.get(r.subscribe(layout.clone()).remote()).await.unwrap();
        rollouts.push(r);
    }
    (trainer, rollouts)
}

gpu_test!(
    ws_gpu_versions_land_whole_in_each_colocated_rollout_over_cuda_ipc,
    async {
        require_gpu();
        let rt = Runtime::start().await.unwrap();
        let (t, rs) = colocated(&rt, 2).await;
        for v in 1..=8 {
            publish_to_all(&rt, &t, &rs, v).await;
        }
        // One export per version, whatever the rollouts.
        assert_eq!(rt.get(t.exports().remote()).await.unwrap(), 8);
        rt.shutdown().await;
    }
);

gpu_test!(ws_gpu_a_stale_version_is_refused_on_the_gpu_too, async {
    require_gpu();
    let rt = Runtime::start().await.unwrap();
    let (t, rs) = colocated(&rt, 1).await;
    let v1: rdt::weights::Published = rt.get(t.publish(1).remote()).await.unwrap();
    let v2: rdt::weights::Published = rt.get(t.publish(2).remote()).await.unwrap();
    assert_eq!(rt.get(rs[0].receive(v2).remote()).await.unwrap(), (2, true));
    let e = rt.get(rs[0].receive(v1).remote()).await.unwrap_err();
    assert!(
        matches!(
            e.application_error::<rdt::Error>(),
            Some(rdt::Error::StaleVersion {
                version: 1,
                current: 2
            })
        ),
        "{e}"
    );
    assert_eq!(
        rt.get(rs[0].live().remote()).await.unwrap(),
        (Some(2), true)
    );
    rt.shutdown().await;
});
