//! Where received CUDA tensors land (included by `gpu.rs`; the CPU cases
//! are `tests/device_maps.rs`): a CUDA value asked onto the host over each
//! transport that can carry it, in the driver, in an actor and per
//! argument; an actor whose device map sends its producer's GPU to host
//! memory; and, on two GPUs, a value from GPU 0 landing on GPU 1.

use super::*;

/// The transports a CUDA value travels over to a reader on the host.
const FROM_GPU: [&str; 3] = ["cuda_ipc", "nixl", "object_store"];

const ELEMS: usize = 1 << 20;

async fn on_gpu0(rt: &Runtime) -> (GpuProducerHandle, rdt::GpuUuid) {
    let p = rt.spawn::<GpuProducer>(()).on_gpus([0]).await.unwrap();
    let uuid = rt.get(p.uuid().remote()).await.unwrap().parse().unwrap();
    (p, uuid)
}

gpu_test!(
    dm_gpu_a_cuda_value_lands_on_the_host_over_each_transport,
    async {
        require_gpu();
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let (p, _) = on_gpu0(&rt).await;
        let c = rt.spawn::<Consumer>(()).on_gpus([0]).await.unwrap();
        for t in FROM_GPU {
            let r = p.make(3.0, ELEMS).tensor_transport(t).unwrap().remote();
            let want = 3.0 * ELEMS as f64;
            // In the driver.
            let v: Tensor = rt.get_on(&r, Place::Host).await.unwrap();
            assert!(v.device().is_cpu(), "over {t}: {}", v.device());
            assert_eq!(v.sum().unwrap(), want, "over {t}");
            // In an actor, by get_on and per argument.
            let (sum, device) = rt
                .get(c.sum_on(r.clone(), Place::Host).remote())
                .await
                .unwrap();
            assert_eq!((sum, device.as_str()), (want, "cpu"), "get_on over {t}");
            let (sum, device) = rt
                .get(c.sum_where(r.to_device(Place::Host)).remote())
                .await
                .unwrap();
            assert_eq!((sum, device.as_str()), (want, "cpu"), "to_device over {t}");
            // Without a place, it stays on a GPU.
            let (sum, device) = rt.get(c.sum_where(&r).remote()).await.unwrap();
            assert_eq!(sum, want);
            assert!(device.starts_with("cuda:"), "over {t}: {device}");
        }
        rt.shutdown().await;
    }
);

gpu_test!(
    dm_gpu_a_device_map_sends_the_producers_gpu_to_host_memory,
    async {
        require_gpu();
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let (p, gpu0) = on_gpu0(&rt).await;
        let c = rt
            .spawn::<Consumer>(())
            .on_gpus([0])
            .device_map(rdt::DeviceMap::new().map(gpu0, Place::Host))
            .await
            .unwrap();
        for t in FROM_GPU {
            let r = p.make(4.0, ELEMS).tensor_transport(t).unwrap().remote();
            let (sum, device) = rt.get(c.sum_where(&r).remote()).await.unwrap();
            assert_eq!(
                (sum, device.as_str()),
                (4.0 * ELEMS as f64, "cpu"),
                "over {t}"
            );
        }
        rt.shutdown().await;
    }
);

gpu_test!(dm_gpu_a_device_beyond_the_callees_gpus_is_refused, async {
    let n = require_gpu() as u32;
    let rt = Runtime::start().await.unwrap();
    let (p, _) = on_gpu0(&rt).await;
    let c = rt.spawn::<Consumer>(()).on_gpus([0]).await.unwrap();
    let r = p.make(1.0, 64).transport(IPC).remote();
    // The consumer sees one GPU: its cuda:1 does not exist.
    let e = rt
        .get(c.sum_where(r.to_device(Place::Cuda(1))).remote())
        .await
        .unwrap_err();
    assert!(matches!(e, Error::NoSuchDevice { .. }), "{e}");
    assert_eq!(rt.get(c.received("cuda_ipc").remote()).await.unwrap(), 0);
    let e = rt.get_on(&r, Place::Cuda(n)).await.unwrap_err();
    assert!(matches!(e, Error::NoSuchDevice { .. }), "{e}");
    rt.shutdown().await;
});

gpu_test2!(dm_gpu_a_value_from_gpu_0_lands_on_gpu_1, async {
    require_two_gpus();
    rdt_integration_tests::logs();
    let rt = Runtime::start().await.unwrap();
    let (p, gpu0) = on_gpu0(&rt).await;
    let probe = rt.spawn::<GpuProducer>(()).on_gpus([1]).await.unwrap();
    let gpu1 = rt.get(probe.uuid().remote()).await.unwrap();
    // The consumer sees GPU 1 only (its cuda:0); the map sends GPU 0's
    // tensors there, instead of reading them over peer access.
    let c = rt
        .spawn::<Consumer>(())
        .on_gpus([1])
        .device_map(rdt::DeviceMap::new().map(gpu0, Place::Cuda(0)))
        .await
        .unwrap();
    for t in ["cuda_ipc", "nixl"] {
        let r = p.make(5.0, ELEMS).tensor_transport(t).unwrap().remote();
        let (sum, device) = rt.get(c.sum_where(&r).remote()).await.unwrap();
        assert_eq!(sum, 5.0 * ELEMS as f64, "over {t}");
        assert!(
            device.contains(&gpu1),
            "over {t}: landed on {device}, not {gpu1}"
        );
    }
    // The driver, asked for its GPU 1, gets it there.
    let r = p.make(6.0, ELEMS).transport(Transport::Nixl).remote();
    let v: Tensor = rt.get_on(&r, Place::Cuda(1)).await.unwrap();
    assert!(v.device().to_string().contains(&gpu1), "{}", v.device());
    assert_eq!(v.sum().unwrap(), 6.0 * ELEMS as f64);
    rt.shutdown().await;
});
