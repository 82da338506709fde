//! CUDA tensors of another library through DLPack (included by `gpu.rs`;
//! the host cases are `tests/interop.rs`): memory from `cuMemAlloc`
//! brought in with its producer's stream crosses `cuda_ipc` and `nixl`
//! with no device copy and goes back out through DLPack at its own
//! address; pool memory, which `cuIpcGetMemHandle` refuses, is copied once
//! at a `cuda_ipc` export and counted; every deleter runs once, after the
//! last use.

use super::*;

const ELEMS: usize = 1 << 20;

async fn pair(rt: &Runtime) -> (GpuProducerHandle, GpuConsumerHandle) {
    let p = rt.spawn::<GpuProducer>(()).on_gpus([0]).await.unwrap();
    let c = rt.spawn::<GpuConsumer>(()).on_gpus([0]).await.unwrap();
    (p, c)
}

/// Polls until the producer ran `want` deleters of foreign memory (the
/// consumer closes the mappings the producer retired meanwhile).
async fn deleters_reach(rt: &Runtime, p: &GpuProducerHandle, c: &GpuConsumerHandle, want: u64) {
    loop {
        let ran = rt.get(p.dlpack_deleters().remote()).await.unwrap();
        assert!(ran <= want, "{ran} deleters ran, {want} expected");
        if ran == want {
            return;
        }
        rt.get(c.close_retired().remote()).await.unwrap();
    }
}

gpu_test!(
    interop_gpu_a_dlpack_cuda_tensor_crosses_cuda_ipc_and_nixl_with_no_device_copy,
    async {
        require_gpu();
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let (p, c) = pair(&rt).await;
        let want = 2.0 * ELEMS as f64;
        // ANCHOR: cuda_ipc
        let r = p.dlpack_make(2.0, ELEMS, false).remote();
        assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), (want, true));
        // ANCHOR_END: cuda_ipc
        assert_eq!(
            rt.get(p.export_copies().remote()).await.unwrap(),
            0,
            "the adopted allocation went out by its IPC handle"
        );
        // Back out through DLPack in the consumer: its own address, no copy.
        let (same, sum) = rt.get(c.dlpack_read(&r).remote()).await.unwrap();
        assert!(same, "the DLPack tensor points at the received memory");
        assert_eq!(sum, want);
        // Over nixl: the allocation is registered as it is.
        let n = p
            .dlpack_make(3.0, ELEMS, false)
            .transport(Transport::Nixl)
            .remote();
        assert_eq!(
            rt.get(c.sum(&n).remote()).await.unwrap(),
            (3.0 * ELEMS as f64, true)
        );
        assert_eq!(rt.get(p.export_copies().remote()).await.unwrap(), 0);
        // Every deleter runs once, after the last use of its memory.
        drop((r, n));
        deleters_reach(&rt, &p, &c, 2).await;
        rt.shutdown().await;
    }
);

gpu_test!(
    interop_gpu_pool_memory_is_copied_once_at_a_cuda_ipc_export_and_counted,
    async {
        require_gpu();
        let rt = Runtime::start().await.unwrap();
        let (p, c) = pair(&rt).await;
        let r = p.dlpack_make(4.0, ELEMS, true).remote();
        assert_eq!(
            rt.get(c.sum(&r).remote()).await.unwrap(),
            (4.0 * ELEMS as f64, true)
        );
        assert_eq!(rt.get(p.export_copies().remote()).await.unwrap(), 1);
        drop(r);
        deleters_reach(&rt, &p, &c, 1).await;
        rt.shutdown().await;
    }
);

gpu_test!(
    interop_gpu_a_kept_import_outlives_the_consumers_copy_and_frees_after_both,
    async {
        require_gpu();
        let rt = Runtime::start().await.unwrap();
        let (p, c) = pair(&rt).await;
        let r = p.dlpack_make_kept(5.0, ELEMS).remote();
        assert_eq!(
            rt.get(c.sum(&r).remote()).await.unwrap(),
            (5.0 * ELEMS as f64, true)
        );
        drop(r);
        // The producer still holds a clone: nothing is freed.
        rt.get(c.close_retired().remote()).await.unwrap();
        assert_eq!(rt.get(p.dlpack_deleters().remote()).await.unwrap(), 0);
        rt.get(p.forget().remote()).await.unwrap();
        deleters_reach(&rt, &p, &c, 1).await;
        rt.shutdown().await;
    }
);

gpu_test!(
    interop_gpu_an_rdt_cuda_tensor_goes_out_through_dlpack_at_its_own_address,
    async {
        require_gpu();
        let rt = Runtime::start().await.unwrap();
        let (p, c) = pair(&rt).await;
        let r = p.make(6.0, ELEMS).transport(IPC).remote();
        let (same, sum) = rt.get(c.dlpack_read(&r).remote()).await.unwrap();
        assert!(same);
        assert_eq!(sum, 6.0 * ELEMS as f64);
        rt.shutdown().await;
    }
);
