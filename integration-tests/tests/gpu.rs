//! GPU tests: `cuda_ipc` and the object-store path on CUDA tensors, with
//! real worker processes. Behind the `gpu` feature; without a CUDA device
//! they fail (never skip).
//!
//! The tests that need two GPUs (`gpu_test2!`: `cross_gpu`, `two_gpus`,
//! `device_ops_across_gpus`) are `#[ignore]`d, so a plain run lists them as
//! ignored (skipped), never as passed. Run them with `--ignored` (or
//! `--include-ignored`) where two devices are visible; with fewer they fail.
//! `RDT_EXPECT_GPUS=N` makes fewer than `N` visible devices a failure of
//! every test. `scripts/gpu-bundle.sh`'s `run.sh` runs the ignored tests
//! when it sees two GPUs (or `RDT_EXPECT_GPUS` asks for two), and counts
//! them as skipped otherwise.
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

/// [`require_gpu`], and at least two devices: the two-GPU tests fail (never
/// pass trivially) with fewer.
fn require_two_gpus() -> usize {
    let n = require_gpu();
    assert!(
        n >= 2,
        "this test needs two GPUs but {n} device(s) visible: run the ignored \
         tests (--ignored) only where two are visible"
    );
    n
}

/// Asserts that `e` is, at its root, the death of the producer `p`.
fn assert_producer_died(e: &Error, p: &GpuProducerHandle) {
    assert!(
        matches!(e.root_cause(), Error::ActorDied { actor, .. } if actor == p.name()),
        "expected ActorDied of the producer {}, got: {e}",
        p.name()
    );
}

/// A producer on GPU 0 and a consumer on the last GPU: the same device on
/// a one-GPU host, another device (seeing only its own) on a two-GPU host.
async fn setup() -> (Runtime, GpuProducerHandle, GpuConsumerHandle) {
    let n = require_gpu() as u32;
    setup_on(&[0], &[n - 1]).await
}

async fn setup_on(p: &[u32], c: &[u32]) -> (Runtime, GpuProducerHandle, GpuConsumerHandle) {
    rdt_integration_tests::logs();
    let rt = Runtime::start().await.unwrap();
    let p = rt
        .spawn::<GpuProducer>(())
        .on_gpus(p.iter().copied())
        .await
        .unwrap();
    let c = rt
        .spawn::<GpuConsumer>(())
        .on_gpus(c.iter().copied())
        .await
        .unwrap();
    (rt, p, c)
}

/// Passes `[0, 1, ..., n-1]` from `p` to `c` over cuda_ipc and checks what
/// the consumer reads (through a copy on its own device), where the tensor
/// lives, and that a write by the consumer reaches the producer.
async fn check_pass(rt: &Runtime, p: &GpuProducerHandle, c: &GpuConsumerHandle) {
    let producer_uuid = rt.get(p.uuid().remote()).await.unwrap();
    for n in [1usize, 1000, 3 << 20] {
        let r = p.iota(n).transport(IPC).remote();
        let (uuid, v) = rt.get(c.inspect(&r).remote()).await.unwrap();
        assert_eq!(
            uuid, producer_uuid,
            "the tensor lives on the producer's GPU"
        );
        assert_eq!(v.len(), n);
        assert!(
            v.iter().enumerate().all(|(i, &x)| x == i as f32),
            "{n} elements read back in order"
        );
    }
    let r = p.make(2.0, 1 << 20).transport(IPC).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        ((2u64 << 20) as f64, true)
    );
    // The producer's GPU is still busy at export: the consumer's stream
    // waits on the producer's event (cuStreamWaitEvent on an IPC event).
    let n = 64 << 20;
    let r = p.make_busy(5.0, n, 20).transport(IPC).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (5.0 * n as f64, true)
    );
    let (_, _, events) = rt.get(c.ipc_stats().remote()).await.unwrap();
    // One event per export with work in flight, pooled: at least the busy
    // one was opened, never more than the five exports above.
    assert!((1..=5).contains(&events), "{events} producer events opened");
    rt.get(p.forget().remote()).await.unwrap();
    let r = p.make_kept(1.0, 64).transport(IPC).remote();
    rt.get(c.fill(&r, 7.0).remote()).await.unwrap();
    assert_eq!(rt.get(p.read_kept(0).remote()).await.unwrap(), 7.0);
}

macro_rules! gpu_test {
    ($name:ident, $body:expr) => {
        #[tokio::test]
        async fn $name() {
            rdt_integration_tests::deadline(DL, $body).await;
        }
    };
}

/// A test that needs two GPUs: ignored by default (libtest reports it as
/// ignored, not passed); `--ignored` runs it. Its body must start with
/// [`require_two_gpus`], so that it fails where fewer are visible.
macro_rules! gpu_test2 {
    ($name:ident, $body:expr) => {
        #[tokio::test]
        #[ignore = "needs two GPUs: run with --ignored where two are visible"]
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

// DLPack is host memory only for now: a CUDA tensor is refused with the
// reason (the consumer's stream), and nothing is exported.
gpu_test!(a_cuda_tensor_is_refused_by_dlpack_with_the_reason, async {
    assert!(require_gpu() >= 1);
    let t = Tensor::cuda_zeros(DType::F32, &[4], 0).unwrap();
    let Err(e) = t.to_dlpack() else {
        panic!("a CUDA tensor went to DLPack");
    };
    assert!(e.to_string().contains("stream"), "{e}");
});

// Views of one flat CUDA buffer (overlapping ones, one of another dtype,
// and the buffer itself) pass as one object over `cuda_ipc`, `nixl` and
// the object store, each with its own bytes.
// "Known idle" (IK-1..3): a stream seen idle, with nothing enqueued
// since, is idle without asking CUDA; an enqueue of rdt's, or the stream
// lent out, makes it asked again. Last, in one test: lending the stream
// turns this off for the whole process.
gpu_test!(a_stream_known_idle_is_asked_again_after_an_enqueue, async {
    require_gpu();
    let g = rdt::data::cuda::gpu(0).unwrap();
    let t = Tensor::cuda_zeros(DType::U8, &[4096], 0).unwrap();
    // Known idle: a second question finds the answer without CUDA. Other
    // tests of this process may enqueue in between; one quiet moment
    // out of many is enough.
    let mut known = false;
    for _ in 0..1000 {
        t.cuda_ready().await.unwrap();
        let before = rdt::data::cuda::idle_known_count();
        t.cuda_ready().await.unwrap();
        if rdt::data::cuda::idle_known_count() > before {
            known = true;
            break;
        }
    }
    assert!(known, "the stream was never known idle without asking CUDA");
    // An enqueue after it was seen idle: the next question sees it busy
    // (a 1 GiB fill takes hundreds of microseconds), and cuda_ready waits.
    let big = Tensor::cuda_zeros(DType::U8, &[1 << 30], 0).unwrap();
    big.cuda_ready().await.unwrap();
    g.synchronize().unwrap();
    big.fill_(7u8).unwrap();
    assert!(
        !g.stream_idle().unwrap(),
        "a stream with a 1 GiB fill just enqueued was reported idle"
    );
    big.cuda_ready().await.unwrap();
    assert!(g.stream_idle().unwrap());
    assert_eq!(big.sum().unwrap(), 7.0 * (1u64 << 30) as f64);
    // Lent out: work that rdt did not enqueue is seen too.
    g.synchronize().unwrap();
    let raw = g.raw_stream();
    let ptr = big.with_device_buffer(|d| d.device_ptr()).unwrap();
    // SAFETY: the tensor's own 1 GiB, on rdt's stream of GPU 0's context.
    unsafe {
        g.bind().unwrap();
        cudarc::driver::sys::cuMemsetD8Async(ptr, 9, 1 << 30, raw)
            .result()
            .unwrap();
    }
    assert!(
        !g.stream_idle().unwrap(),
        "work enqueued on the lent stream was not seen"
    );
    big.cuda_ready().await.unwrap();
    assert_eq!(big.sum().unwrap(), 9.0 * (1u64 << 30) as f64);
});

// EP-1, EP-2: an event whose last holder dropped it is recorded again
// for the next completion instead of a new one being created; a wait on
// each still sees its own fill. With the pool off (`RDT_EVENT_POOL`),
// every completion of a busy stream creates one.
gpu_test!(cuda_events_are_reused_once_dropped, async {
    require_gpu();
    let g = rdt::data::cuda::gpu(0).unwrap();
    let t = Tensor::cuda_zeros(DType::U8, &[256 << 20], 0).unwrap();
    let busy_completions = |n: u8| {
        let g = g.clone();
        let t = t.clone();
        async move {
            let mut busy = 0;
            for v in 1..=n {
                t.fill_(v).unwrap();
                // A 256 MiB fill just enqueued: the stream is busy, so
                // the completion records an event.
                busy += u64::from(!g.stream_idle().unwrap());
                g.completion().unwrap().wait().await.unwrap();
                assert_eq!(t.sum().unwrap(), f64::from(v) * (256u64 << 20) as f64);
            }
            busy
        }
    };
    busy_completions(2).await;
    let before = rdt::data::cuda::events_created();
    let busy = busy_completions(40).await;
    let pooled = rdt::data::cuda::events_created() - before;
    assert!(busy >= 20, "the stream was seldom busy ({busy} of 40)");
    // Other tests of this process may make a few at the same time.
    assert!(
        pooled <= 4,
        "{pooled} events created for {busy} busy completions"
    );
});

gpu_test!(views_of_one_cuda_storage, async {
    let (rt, p, c) = setup().await;
    let want: Vec<f64> = flat_views(Tensor::arange::<f32>(1000))
        .iter()
        .map(|t| t.sum().unwrap())
        .collect();
    for t in [IPC, Transport::Nixl, Transport::ObjectStore] {
        let r = p.views().transport(t).remote();
        assert_eq!(rt.get(c.sums(&r).remote()).await.unwrap(), want, "over {t}");
        assert_eq!(
            rt.get(c.received(t.name().to_string()).remote())
                .await
                .unwrap(),
            1,
            "one object over {t}"
        );
    }
});

// A weight update on the GPU: the consumer receives each version into
// views of its own flat CUDA buffer (`get_into`) over `cuda_ipc` (one
// copy from the producer's mapped memory), `nixl` (the read lands in the
// views) and the object store; the driver receives into its own CUDA
// tensors over `nixl`.
gpu_test!(receive_into_cuda_targets, async {
    let (rt, p, c) = setup().await;
    let (n, len) = (4usize, 1000usize);
    let want = |first: f32| -> Vec<f64> {
        (0..n)
            .map(|i| f64::from(first + i as f32) * len as f64)
            .collect()
    };
    let mut first = 1.0f32;
    for t in [IPC, Transport::Nixl, Transport::ObjectStore] {
        for _ in 0..2 {
            let r = p.version(n, len, first).transport(t).remote();
            let (sums, same, one_buffer) =
                rt.get(c.update_params(&r, n, len).remote()).await.unwrap();
            assert_eq!(sums, want(first), "version {first} over {t}");
            assert!(same, "the value got back holds the parameters (over {t})");
            assert!(
                one_buffer,
                "the parameters are still views of one buffer (over {t})"
            );
            first += 10.0;
        }
        assert_eq!(
            rt.get(c.received(t.name().to_string()).remote())
                .await
                .unwrap(),
            2,
            "two objects over {t}"
        );
    }
    // nixl read straight into the views and cuda_ipc copied into them as
    // it received (two versions each); the object store's were copied in
    // after.
    assert_eq!(rt.get(c.in_place().remote()).await.unwrap(), 4);
    let mine: Vec<Tensor> = (0..n)
        .map(|_| Tensor::cuda_empty(DType::F32, &[len], 0).unwrap())
        .collect();
    let r = p.version(n, len, 7.0).transport(Transport::Nixl).remote();
    let got = rt.get_into(&r, &mine).await.unwrap();
    assert!(got.iter().zip(&mine).all(|(g, m)| g.shares_storage(m)));
    let sums: Vec<f64> = mine.iter().map(|t| t.sum().unwrap()).collect();
    assert_eq!(sums, want(7.0), "the driver's own CUDA tensors");
});

// Weight updates in place on the GPU, step after step: the trainer's same
// tensors (host, updated in place) in a new object at each step, read over
// `nixl` into views of one flat CUDA buffer. The later steps read through
// the first step's plan (NX-8), and each lands its own values.
gpu_test!(updates_into_cuda_targets_read_through_one_plan, async {
    require_gpu();
    rdt_integration_tests::logs();
    let rt = Runtime::start().await.unwrap();
    let p = rt.spawn::<Producer>(()).await.unwrap();
    let c = rt.spawn::<GpuConsumer>(()).on_gpus([0]).await.unwrap();
    let (n, len) = (200usize, 256usize);
    let at = rt.get(p.keep_many(n, len, 0.0).remote()).await.unwrap();
    let s0 = rt.get(c.nixl_stats().remote()).await.unwrap();
    for step in 0..3 {
        let first = 100.0 * step as f32;
        rt.get(p.step_kept(at, n, first).remote()).await.unwrap();
        let r = p.kept_range(at, n).transport(Transport::Nixl).remote();
        let (sums, same, one_buffer) = rt.get(c.update_params(&r, n, len).remote()).await.unwrap();
        let want: Vec<f64> = (0..n)
            .map(|i| f64::from(first + i as f32) * len as f64)
            .collect();
        assert_eq!(
            sums, want,
            "step {step}: every parameter holds its new value"
        );
        assert!(same && one_buffer, "step {step}: in place, in one buffer");
    }
    let s1 = rt.get(c.nixl_stats().remote()).await.unwrap();
    assert_eq!(s1.reads_posted - s0.reads_posted, 3, "one READ per step");
    assert_eq!(
        s1.target_plans_reused - s0.target_plans_reused,
        2,
        "the later steps found the first step's plan"
    );
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
    // the cache. A producer event is opened at most once per export (not
    // at all when its stream was idle at every export: nothing to wait
    // for).
    let (opened, cached, events) = rt.get(c.ipc_stats().remote()).await.unwrap();
    assert_eq!((opened, cached), (1, 1));
    assert!(events <= 2, "{events}");
});

/// Actors are clients too, on the GPU: a relay (no GPU of its own) passes
/// the driver's `cuda_ipc` ref to the consumer, which maps the producer's
/// memory directly; an actor puts a CUDA tensor over `cuda_ipc` and another
/// actor reads it.
async fn actor_to_actor_ipc(rt: Runtime, p: GpuProducerHandle, c: GpuConsumerHandle) {
    let relay = rt.spawn::<Relay>(()).await.unwrap();
    let before = rt.get(c.received("cuda_ipc").remote()).await.unwrap();
    let r = p.make(2.0, 1 << 20).transport(IPC).remote();
    assert_eq!(
        rt.get(relay.gpu_sum_via(c.clone(), &r).remote())
            .await
            .unwrap(),
        ((2u64 << 20) as f64, true)
    );
    let after = rt.get(c.received("cuda_ipc").remote()).await.unwrap();
    assert_eq!(after, before + 1, "the consumer received over cuda_ipc");
    assert_eq!(
        rt.get(relay.received("cuda_ipc").remote()).await.unwrap(),
        0,
        "the relay moved no tensor"
    );
    // A CUDA tensor put inside an actor (on the producer's GPU), read by
    // the consumer over cuda_ipc and by the driver.
    let n = rdt::data::cuda::device_count() as u32;
    let maker = rt.spawn::<Relay>(()).on_gpus([0]).await.unwrap();
    let taker = rt.spawn::<Relay>(()).on_gpus([n - 1]).await.unwrap();
    let put: ObjectRef<Tensor> = rt
        .get(maker.put_cuda(3.0, 1000, "cuda_ipc").remote())
        .await
        .unwrap();
    assert_eq!(
        rt.get(relay.gpu_sum_via(c.clone(), &put).remote())
            .await
            .unwrap(),
        (3000.0, true)
    );
    assert_eq!(rt.get(taker.get_sum(&put).remote()).await.unwrap(), 3000.0);
    assert_eq!(
        rt.get(taker.received("cuda_ipc").remote()).await.unwrap(),
        1
    );
    let t = rt.get(&put).await.unwrap();
    assert_eq!(
        t.to_cpu().unwrap().to_vec::<f32>().unwrap(),
        vec![3.0; 1000]
    );
    drop((r, put));
    rt.transfers_settled().await;
    assert_eq!(rt.live_objects(), 0);
    rt.shutdown().await;
}

gpu_test!(actor_passes_a_cuda_ipc_ref_to_actor, async {
    let (rt, p, c) = setup().await;
    actor_to_actor_ipc(rt, p, c).await
});

gpu_test2!(actor_passes_a_cuda_ipc_ref_to_actor_across_gpus, async {
    require_two_gpus();
    let (rt, p, c) = setup_on(&[0], &[1]).await;
    actor_to_actor_ipc(rt, p, c).await
});

/// OW-9 on the GPU: CUDA tensors still being produced when their
/// consumer's call comes go from the producer to the consumer straight
/// (the consumer counts them) over `cuda_ipc` and `nixl`, and land whole.
async fn straight_deliveries_of_cuda_tensors(
    rt: Runtime,
    p: GpuProducerHandle,
    c: GpuConsumerHandle,
) {
    for (i, t) in [IPC, Transport::Nixl, IPC].into_iter().enumerate() {
        let b = p.block(200).remote();
        let v = 1.0 + i as f32;
        let r = p.make(v, 1 << 20).transport(t).remote();
        assert_eq!(
            rt.get(c.sum(&r).remote()).await.unwrap(),
            (f64::from(v) * (1u64 << 20) as f64, true),
            "over {t}"
        );
        drop((b, r));
    }
    assert_eq!(rt.get(c.straight().remote()).await.unwrap(), 3);
    assert_eq!(rt.get(c.received("cuda_ipc").remote()).await.unwrap(), 2);
    assert_eq!(rt.get(c.received("nixl").remote()).await.unwrap(), 1);
    rt.transfers_settled().await;
    assert_eq!(rt.live_objects(), 0);
    rt.shutdown().await;
}

gpu_test!(straight_deliveries_same_gpu, async {
    require_gpu();
    let (rt, p, c) = setup_on(&[0], &[0]).await;
    straight_deliveries_of_cuda_tensors(rt, p, c).await
});

gpu_test2!(straight_deliveries_across_gpus, async {
    require_two_gpus();
    let (rt, p, c) = setup_on(&[0], &[1]).await;
    straight_deliveries_of_cuda_tensors(rt, p, c).await
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

gpu_test!(copy_mode_gives_the_consumer_its_own_memory, async {
    let (rt, p, c) = setup().await;
    // The producer's stream is busy at export: the copy (enqueued on the
    // consumer's stream after the event wait) must see the finished bytes.
    let n = 64 << 20;
    let r = p.make_busy(3.0, n, 20).transport(IPC).remote();
    let (taken, filled, source, shared, uuid, mine) =
        rt.get(c.fill_own_copy(&r, 9.0).remote()).await.unwrap();
    assert_eq!(taken, 3.0 * n as f64, "the copy holds the producer's bytes");
    assert_eq!(filled, 9.0 * n as f64);
    assert_eq!(source, 3.0 * n as f64, "the producer's memory is untouched");
    assert!(!shared);
    assert_eq!(uuid, mine, "the copy lives on the consumer's own device");
    // A write to the copy never reaches the producer.
    let r = p.make_kept(1.0, 4096).transport(IPC).remote();
    rt.get(c.fill_own_copy(&r, 5.0).remote()).await.unwrap();
    assert_eq!(rt.get(p.read_kept(0).remote()).await.unwrap(), 1.0);
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
    assert_producer_died(&e, &p);
    // The tensor was ready before the kill, but its memory died with the
    // producer: the consumer's call fails with the producer's death.
    let e = rt.get(c.sum(&r).remote()).await.unwrap_err();
    assert_producer_died(&e, &p);
    // The consumer lives on.
    assert_eq!(rt.get(c.devices().remote()).await.unwrap(), 1);
});

gpu_test!(source_dies_after_the_transfer, async {
    let (rt, p, c) = setup().await;
    let r = p.make(2.0, 16).transport(IPC).remote();
    assert_eq!(rt.get(c.hold(&r).remote()).await.unwrap(), 1);
    p.kill();
    let e = rt.get(p.echo(1).remote()).await.unwrap_err();
    assert_producer_died(&e, &p);
    // Reading memory of a dead producer: whatever CUDA says, no hang.
    match rt.get(c.sum_held(0).remote()).await {
        Ok(s) => eprintln!("held tensor after the producer died: sum {s}"),
        Err(e) => eprintln!("held tensor after the producer died: {e}"),
    }
    // A new pass from the dead producer fails with its death.
    let r2 = p.make(2.0, 16).transport(IPC).remote();
    let e = rt.get(c.sum(&r2).remote()).await.unwrap_err();
    assert_producer_died(&e, &p);
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

// The object-store path with CUDA tensors large enough for the host pool:
// the producer stages them through pinned buffers, the consumer reads them
// from the socket into pinned buffers and copies them to its GPU from
// there, pass after pass, with new values every pass (a buffer recycled
// while a copy still read it would show as a wrong sum: HP-4).
gpu_test!(object_store_cuda_passes_reuse_pinned_pool_buffers, async {
    let (rt, p, c) = setup().await;
    let n = 1 << 20; // 4 MiB of f32
    for i in 0..6u32 {
        let r = p
            .make(i as f32, n)
            .transport(Transport::ObjectStore)
            .remote();
        assert_eq!(
            rt.get(c.sum(&r).remote()).await.unwrap(),
            (i as f64 * n as f64, true),
            "pass {i}: GPU -> pinned host -> driver -> pinned host -> GPU"
        );
    }
    let (hits, misses, pinned) = rt.get(c.pool_stats().remote()).await.unwrap();
    assert!(
        hits + misses >= 6,
        "a pool buffer per pass: {hits} hits, {misses} misses"
    );
    assert!(
        hits >= 1,
        "later passes reuse buffers: {hits} hits, {misses} misses"
    );
    assert!(
        pinned >= 4 << 20,
        "the consumer's buffers are pinned: {pinned} B"
    );
});

// A CUDA tensor of several copy steps over the object store goes to the
// socket while its copy to the host runs, and the bytes that travel are
// those of the moment it was returned: a fill the producer queues right
// after (its next call) is ordered after the copies. Random bytes arrive
// bit-exact.
gpu_test!(
    object_store_large_cuda_tensor_travels_as_it_was_returned,
    async {
        let (rt, p, c) = setup().await;
        let n = 24 << 20; // 96 MiB of f32: six copy steps
        for i in 0..3u32 {
            let r = p
                .make_kept(i as f32, n)
                .transport(Transport::ObjectStore)
                .remote();
            let fill = p.fill_kept(i as usize, 100.0).remote();
            assert_eq!(
                rt.get(c.sum(&r).remote()).await.unwrap(),
                (i as f64 * n as f64, true),
                "pass {i}: the bytes as returned, not as filled after"
            );
            rt.get(fill).await.unwrap();
            assert_eq!(
                rt.get(p.read_kept(i as usize).remote()).await.unwrap(),
                100.0
            );
        }
        let r = p.make_rand(7, n).transport(Transport::ObjectStore).remote();
        let expect = Tensor::cuda_rand(DType::F32, &[n], 0, 7).unwrap();
        let got: Tensor = rt.get(c.copy_of(&r).remote()).await.unwrap();
        assert!(got.equal(&expect.to_cpu().unwrap()).unwrap());
    }
);

// Several small CUDA tensors over the object store share chunk blobs on
// the host (object_store::SMALL); each comes back whole, on a device.
gpu_test!(object_store_small_cuda_tensors_travel_in_chunks, async {
    let (rt, p, c) = setup().await;
    let r = p.many(300, 100).transport(Transport::ObjectStore).remote();
    let sums = rt.get(c.sums(&r).remote()).await.unwrap();
    let want: Vec<f64> = (0..300).map(|i| i as f64 * 100.0).collect();
    assert_eq!(sums, want);
});

// A tensor written on another library's stream carries the event after
// which it is valid (`produced_on_stream`): the export waits for it on the
// GPU, so the consumer reads the final values, not the memory before.
gpu_test!(tensors_carry_their_ready_event, async {
    let (rt, p, c) = setup().await;
    let n = 256 << 20;
    for _ in 0..2 {
        let r = p.make_on_own_stream(7.0, n, 40).transport(IPC).remote();
        assert_eq!(
            rt.get(c.sum(&r).remote()).await.unwrap(),
            (7.0 * n as f64, true)
        );
    }
});

gpu_test!(waits_for_the_producers_gpu_work, async {
    let (rt, p, c) = setup().await;
    // 1 GiB filled 20 times: the producer's stream is busy at export, so
    // the consumer's stream must wait on the producer's event.
    let n = 256 << 20;
    for _ in 0..2 {
        let r = p.make_busy(3.0, n, 20).transport(IPC).remote();
        assert_eq!(
            rt.get(c.sum(&r).remote()).await.unwrap(),
            (3.0 * n as f64, true)
        );
    }
    let (_, _, events) = rt.get(c.ipc_stats().remote()).await.unwrap();
    // Each export records an event of its own, from a pool the producer
    // refills at release: opened at least once (the stream waited), at
    // most once per export (handles of pooled events are cached).
    assert!((1..=2).contains(&events), "{events} producer events opened");
});

gpu_test!(same_gpu, async {
    require_gpu();
    let (rt, p, c) = setup_on(&[0], &[0]).await;
    let mine = rt.get(c.uuids().remote()).await.unwrap();
    assert_eq!(mine, vec![rt.get(p.uuid().remote()).await.unwrap()]);
    check_pass(&rt, &p, &c).await;
});

// Producer on GPU 0, consumer on GPU 1 seeing only GPU 1: CUDA IPC opens
// the producer's memory in the consumer's context with peer access (the
// exporting device need not be visible to the importer).
gpu_test2!(cross_gpu, async {
    require_two_gpus();
    let (rt, p, c) = setup_on(&[0], &[1]).await;
    let mine = rt.get(c.uuids().remote()).await.unwrap();
    let theirs = rt.get(p.uuid().remote()).await.unwrap();
    assert_eq!(mine.len(), 1);
    assert_ne!(mine[0], theirs, "the consumer is on another GPU");
    check_pass(&rt, &p, &c).await;
    // Mappings are cached across passes to another GPU too.
    let (opened, cached, events) = rt.get(c.ipc_stats().remote()).await.unwrap();
    // At most one producer event per export with work in flight (five).
    assert!(
        opened >= 1 && cached >= 1 && events <= 5,
        "{opened} {cached} {events}"
    );
});

// Consumers that see both GPUs: the producer's device is visible to them,
// so its memory is mapped in that device's own context.
gpu_test2!(two_gpus, async {
    require_two_gpus();
    rdt_integration_tests::logs();
    let rt = Runtime::start().await.unwrap();
    let p = rt.spawn::<GpuProducer>(()).on_gpus([0]).await.unwrap();
    // Round-robin placement of two GPUs, then explicit orders.
    let c = rt.spawn::<GpuConsumer>(()).gpus(2).await.unwrap();
    assert_eq!(rt.get(c.devices().remote()).await.unwrap(), 2);
    check_pass(&rt, &p, &c).await;
    for order in [[1u32, 0], [0, 1]] {
        let c = rt.spawn::<GpuConsumer>(()).on_gpus(order).await.unwrap();
        assert_eq!(rt.get(c.devices().remote()).await.unwrap(), 2);
        check_pass(&rt, &p, &c).await;
    }
    // A bad placement is a spawn error, not a worker that cannot start.
    let e = rt.spawn::<GpuConsumer>(()).on_gpus([9]).await.unwrap_err();
    assert!(e.to_string().contains("no GPU 9"), "{e}");
});

gpu_test!(device_ops, async {
    require_gpu();
    use rdt::data::cuda::ops;
    ops::nvrtc_available().expect("NVRTC (on-device sum and compare)");
    ops::curand_available().expect("cuRAND (random fill)");
    // cuRAND: uniform in (0, 1], reproducible from the seed.
    let n = 16 << 20;
    let a = Tensor::cuda_rand(DType::F32, &[n], 0, 7).unwrap();
    let host = a.to_cpu().unwrap();
    let v = host.to_vec::<f32>().unwrap();
    assert!(v.iter().all(|&x| x > 0.0 && x <= 1.0));
    let mean = v.iter().map(|&x| x as f64).sum::<f64>() / n as f64;
    assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
    // The NVRTC sum agrees with the host's.
    let (dev, hs) = (a.sum().unwrap(), host.sum().unwrap());
    assert!((dev - hs).abs() <= 1e-9 * hs.abs(), "{dev} vs {hs}");
    let b = Tensor::cuda_rand(DType::F32, &[n], 0, 7).unwrap();
    assert!(a.equal(&b).unwrap(), "same seed, same values");
    let c = Tensor::cuda_rand(DType::F32, &[n], 0, 8).unwrap();
    assert!(!a.equal(&c).unwrap(), "another seed, other values");
    // The on-device compare finds one changed element.
    let mut w = v.clone();
    w[n - 3] = 2.0;
    let d = Tensor::from_slice(&w, &[n]).unwrap().to_device(0).unwrap();
    assert!(!a.equal(&d).unwrap());
    let diffs = a
        .with_device_buffer(|x| {
            d.with_device_buffer(|y| {
                ops::count_differences(x.gpu(), x.device_ptr(), y.device_ptr(), x.len())
            })
        })
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(diffs, 1);
    // Other types, odd byte lengths (the byte-wise tail of the compare).
    for (dt, len, exact) in [
        (DType::U8, 3usize, true),
        (DType::U8, 1001, true),
        (DType::I16, 4097, true),
        (DType::BF16, 333, true),
        (DType::F64, 1 << 20, false),
        (DType::I64, 1000, false),
    ] {
        let t = Tensor::cuda_rand(dt, &[len], 0, 42).unwrap();
        let h = t.to_cpu().unwrap();
        // Random bits of a 16-bit float may be NaNs: its checksum is the
        // raw words' (on the device by its kernel).
        let sum = |x: &Tensor| match dt {
            DType::BF16 | DType::F16 => x.raw_word_sum().unwrap(),
            _ => x.sum().unwrap(),
        };
        let (ds, hs) = (sum(&t), sum(&h));
        if exact {
            assert_eq!(ds, hs, "{dt:?}");
        } else {
            assert!(
                (ds - hs).abs() <= 1e-9 * hs.abs().max(1.0),
                "{dt:?}: {ds} vs {hs}"
            );
        }
        assert!(t.equal(&h.to_device(0).unwrap()).unwrap(), "{dt:?}");
        let other = Tensor::cuda_rand(dt, &[len], 0, 43).unwrap();
        assert!(!t.equal(&other).unwrap(), "{dt:?}");
    }
    let e = Tensor::zeros(DType::F32, &[4]).uniform_(1).unwrap_err();
    assert!(e.to_string().contains("CUDA tensors"), "{e}");
});

gpu_test2!(device_ops_across_gpus, async {
    require_two_gpus();
    let n = 16 << 20;
    let a = Tensor::cuda_rand(DType::F32, &[n], 0, 7).unwrap();
    let dev = a.sum().unwrap();
    // Compare across devices (the other one is copied over first).
    let e = a.to_device(1).unwrap();
    assert!(e.equal(&a).unwrap() && a.equal(&e).unwrap());
    // Atomic accumulation: the order of additions varies from run to
    // run, so a floating sum may differ in its last bits.
    let s1 = e.sum().unwrap();
    assert!((s1 - dev).abs() <= 1e-9 * dev.abs(), "{s1} vs {dev}");
});

gpu_test!(random_tensors_pass_bit_exact, async {
    let (rt, p, c) = setup().await;
    let r = p.make_rand(11, 1 << 20).transport(IPC).remote();
    let expect = Tensor::cuda_rand(DType::F32, &[1 << 20], 0, 11).unwrap();
    let got: Tensor = rt.get(c.copy_of(&r).remote()).await.unwrap();
    assert!(got.equal(&expect.to_cpu().unwrap()).unwrap());
});

/// Bytes of the slab a tensor of `n` f32 gets when it is larger than a
/// shared slab (rounded to 2 MiB).
fn own_slab(n: usize) -> usize {
    (n * 4).div_ceil(2 << 20) * (2 << 20)
}

gpu_test!(slabs_are_freed_only_after_importers_close_them, async {
    let (rt, p, c) = setup().await;
    let n = 32 << 20; // 128 MiB: a slab of its own
    let r = p.make(1.0, n).transport(IPC).remote();
    assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), (n as f64, true));
    drop(r);
    // The free reached both (calls are ordered after it on each link).
    assert_eq!(rt.get(p.stored().remote()).await.unwrap(), 0);
    assert_eq!(rt.get(c.close_retired().remote()).await.unwrap(), (0, 0));
    // Freed object, cached slab: the consumer still maps it, so trimming
    // cannot free it yet.
    assert_eq!(
        rt.get(p.trim().remote()).await.unwrap(),
        (0, own_slab(n)),
        "a slab an importer maps is not freed"
    );
    // The importer closes it (this call, or its housekeeping before it).
    let (_, closed) = rt.get(c.close_retired().remote()).await.unwrap();
    assert_eq!(closed, 1);
    assert_eq!(rt.get(p.trim().remote()).await.unwrap().1, 0);
    assert_eq!(rt.get(p.slab_bytes().remote()).await.unwrap(), 0);
    // Passing works on: a new slab, a new mapping.
    let r = p.make(2.0, n).transport(IPC).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (2.0 * n as f64, true)
    );
    let (opened, _, _) = rt.get(c.ipc_stats().remote()).await.unwrap();
    assert_eq!(opened, 2);
    // Without a trim the slab stays cached: the next tensor of that size
    // reuses it, and the consumer its mapping. The consumer drops its
    // 128 MiB view beside its control loop (`drop_aside`); a call of it
    // runs only after that drop, so the range is free again when the
    // producer allocates (else the producer may take a new slab first).
    drop(r);
    rt.get(c.ipc_stats().remote()).await.unwrap();
    let r = p.make(3.0, n).transport(IPC).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (3.0 * n as f64, true)
    );
    let (opened, _, _) = rt.get(c.ipc_stats().remote()).await.unwrap();
    assert_eq!(opened, 2, "the cached mapping was reused");
});

gpu_test!(a_dead_importer_keeps_no_memory, async {
    let (rt, p, c) = setup().await;
    let n = 32 << 20;
    let r = p.make(1.0, n).transport(IPC).remote();
    // The consumer holds a tensor over the range, and maps the slab.
    assert_eq!(rt.get(c.hold(&r).remote()).await.unwrap(), 1);
    drop(r);
    assert_eq!(rt.get(p.stored().remote()).await.unwrap(), 0);
    assert_eq!(rt.get(p.trim().remote()).await.unwrap(), (0, 0), "held");
    assert_eq!(rt.get(p.slab_bytes().remote()).await.unwrap(), own_slab(n));
    c.kill();
    c.raw().exited().await.unwrap();
    // Its share of the range and its mapping died with it.
    assert_eq!(rt.get(p.trim().remote()).await.unwrap(), (own_slab(n), 0));
    assert_eq!(rt.get(p.slab_bytes().remote()).await.unwrap(), 0);
});

#[path = "gpu/device_maps.rs"]
mod device_maps;

#[path = "gpu/interop.rs"]
mod interop;

#[path = "gpu/nccl.rs"]
mod nccl;

#[path = "gpu/nixl.rs"]
mod nixl;

#[path = "gpu/weight_sync.rs"]
mod weight_sync;
