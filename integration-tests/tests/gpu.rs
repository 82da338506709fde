//! GPU tests: `cuda_ipc` and the object-store path on CUDA tensors, with
//! real worker processes. Behind the `gpu` feature; without a CUDA device
//! they fail (never skip). Two-GPU tests run when two devices are visible,
//! and `RDT_EXPECT_GPUS=2` makes fewer a failure.
#![cfg(feature = "gpu")]

use rdt::prelude::*;
use rdt_integration_tests::actors::*;

const DL: u64 = 120;
const IPC: Transport = Transport::CudaIpc;

fn require_gpu() -> usize {
    if let Err(e) = rdt::data::cuda::available() {
        panic!("the gpu tests need a CUDA device: {e}");
    }
    let n = rdt::data::cuda::device_count();
    if let Ok(want) = std::env::var("RDT_EXPECT_GPUS") {
        let want: usize = want.parse().expect("RDT_EXPECT_GPUS is a number");
        assert!(
            n >= want,
            "RDT_EXPECT_GPUS={want} but {n} device(s) visible"
        );
    }
    n
}

async fn setup() -> (Runtime, GpuProducerHandle, GpuConsumerHandle) {
    require_gpu();
    rdt_integration_tests::logs();
    let rt = Runtime::start().await.unwrap();
    let p = rt.spawn::<GpuProducer>(()).gpus(1).await.unwrap();
    let c = rt.spawn::<GpuConsumer>(()).gpus(1).await.unwrap();
    (rt, p, c)
}

macro_rules! gpu_test {
    ($name:ident, $body:expr) => {
        #[tokio::test]
        async fn $name() {
            rdt_integration_tests::deadline(DL, $body).await;
        }
    };
}

gpu_test!(device_present, async {
    assert!(require_gpu() >= 1);
    let t = Tensor::cuda_full(1.5f32, &[1024], 0).unwrap();
    assert!(t.is_cuda());
    assert_eq!(t.sum().unwrap(), 1536.0);
    assert!(
        t.to_vec::<f32>().is_err(),
        "host accessors refuse CUDA tensors"
    );
    let h = t.to_cpu().unwrap();
    assert!(t.equal(&h).unwrap());
    let u = Tensor::arange::<i64>(100).to_device(0).unwrap();
    assert_eq!(u.sum().unwrap(), 4950.0);
    u.fill_(-2i64).unwrap();
    u.cuda_ready().await.unwrap();
    assert_eq!(u.sum().unwrap(), -200.0);
    let z = Tensor::cuda_zeros(DType::F64, &[7], 0).unwrap();
    assert_eq!(z.to_cpu().unwrap().to_vec::<f64>().unwrap(), vec![0.0; 7]);
});

gpu_test!(point_to_point, async {
    let (rt, p, c) = setup().await;
    let r = p.make(2.0, 1000).transport(IPC).remote();
    assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), (2000.0, true));
    let r = p.make(0.5, 3 << 20).transport(IPC).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (0.5 * (3 << 20) as f64, true)
    );
    // Both tensors live in the producer's first slab: one new mapping, then
    // the cache.
    let (opened, cached, events) = rt.get(c.ipc_stats().remote()).await.unwrap();
    assert_eq!((opened, cached, events), (1, 1, 1));
});

gpu_test!(nested_values, async {
    let (rt, p, c) = setup().await;
    let b = p.batch(7).transport(IPC).remote();
    let (step, label, s, all_cuda) = rt.get(c.batch_sum(&b).remote()).await.unwrap();
    assert_eq!(step, 7);
    assert_eq!(label, "batch-7");
    assert_eq!(s, 64.0 + 120.0 + 6.0 + 15.0 + 4.0);
    assert!(all_cuda);
});

gpu_test!(same_ref_twice, async {
    let (rt, p, c) = setup().await;
    let r = p.make(3.0, 10).transport(IPC).remote();
    let (s, shared) = rt.get(c.sum2(&r, &r).remote()).await.unwrap();
    assert_eq!(s, 60.0);
    assert!(shared, "one ref twice in a call is one tensor");
});

gpu_test!(colocated_write_is_visible_at_the_source, async {
    let (rt, p, c) = setup().await;
    let r = p.make_kept(1.0, 4096).transport(IPC).remote();
    rt.get(c.fill(&r, 5.0).remote()).await.unwrap();
    assert_eq!(
        rt.get(p.read_kept(0).remote()).await.unwrap(),
        5.0,
        "zero copy: the consumer wrote the producer's memory"
    );
});

gpu_test!(ref_freed, async {
    let (rt, p, c) = setup().await;
    for i in 0..20 {
        let r = p.make(1.0, 1 << 20).transport(IPC).remote();
        assert_eq!(
            rt.get(c.sum(&r).remote()).await.unwrap(),
            ((1 << 20) as f64, true),
            "pass {i}"
        );
        drop(r);
    }
    assert_eq!(rt.live_objects(), 0);
    assert_eq!(rt.get(p.stored().remote()).await.unwrap(), 0);
    // A consumer that holds a tensor keeps its memory after the free.
    let r = p.make(4.0, 256).transport(IPC).remote();
    rt.get(c.hold(&r).remote()).await.unwrap();
    drop(r);
    assert_eq!(rt.get(p.stored().remote()).await.unwrap(), 0);
    let r2 = p.make(9.0, 256).transport(IPC).remote();
    assert_eq!(rt.get(c.sum(&r2).remote()).await.unwrap(), (2304.0, true));
    assert_eq!(
        rt.get(c.sum_held(0).remote()).await.unwrap(),
        1024.0,
        "the held range was not reused"
    );
    rt.get(c.drop_held().remote()).await.unwrap();
});

gpu_test!(source_dies_before_the_transfer, async {
    let (rt, p, c) = setup().await;
    let r = p.make(1.0, 16).transport(IPC).remote();
    rt.wait(&r).await.unwrap();
    p.kill();
    let e = rt.get(p.echo(1).remote()).await.unwrap_err();
    assert!(matches!(e, Error::ActorDied { .. }), "{e}");
    let e = rt.get(c.sum(&r).remote()).await.unwrap_err();
    eprintln!("expected error: {e}");
    // The consumer lives on.
    assert_eq!(rt.get(c.devices().remote()).await.unwrap(), 1);
});

gpu_test!(source_dies_after_the_transfer, async {
    let (rt, p, c) = setup().await;
    let r = p.make(2.0, 16).transport(IPC).remote();
    assert_eq!(rt.get(c.hold(&r).remote()).await.unwrap(), 1);
    p.kill();
    let _ = rt.get(p.echo(1).remote()).await.unwrap_err();
    // Reading memory of a dead producer: whatever CUDA says, no hang.
    match rt.get(c.sum_held(0).remote()).await {
        Ok(s) => eprintln!("held tensor after the producer died: sum {s}"),
        Err(e) => eprintln!("held tensor after the producer died: {e}"),
    }
    // A new pass from a dead producer is an error.
    let r2 = p.make(2.0, 16).transport(IPC).remote();
    assert!(rt.get(c.sum(&r2).remote()).await.is_err());
});

gpu_test!(object_store_on_cuda_tensors, async {
    let (rt, p, c) = setup().await;
    let r = p.make(3.0, 1000).transport(Transport::ObjectStore).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (3000.0, true),
        "GPU -> host -> GPU"
    );
    // The driver sees a GPU here too: it gets a CUDA tensor.
    let t: Tensor = rt.get(&r).await.unwrap();
    assert_eq!(t.sum().unwrap(), 3000.0);
    let put = rt
        .put(&Tensor::cuda_full(1.0f32, &[10], 0).unwrap())
        .unwrap();
    assert_eq!(rt.get(c.sum(&put).remote()).await.unwrap(), (10.0, true));
});

gpu_test!(two_gpus, async {
    let n = require_gpu();
    if n < 2 {
        eprintln!("two_gpus: only {n} device visible; nothing to test");
        return;
    }
    rdt_integration_tests::logs();
    let rt = Runtime::start().await.unwrap();
    let p = rt.spawn::<GpuProducer>(()).gpus(1).await.unwrap();
    // The consumer sees both devices (its first is another one than the
    // producer's), so it maps the producer's memory through peer access.
    let c = rt.spawn::<GpuConsumer>(()).gpus(2).await.unwrap();
    assert_eq!(rt.get(c.devices().remote()).await.unwrap(), 2);
    let r = p.make(2.0, 1 << 20).transport(IPC).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        ((2u64 << 20) as f64, true)
    );
    let r = p.make_kept(1.0, 64).transport(IPC).remote();
    rt.get(c.fill(&r, 7.0).remote()).await.unwrap();
    assert_eq!(rt.get(p.read_kept(0).remote()).await.unwrap(), 7.0);
});
