//! `nixl` on CUDA tensors (included by `gpu.rs`): GPU to GPU on one GPU
//! and across two, GPU to the driver's host and GPU memory, CPU and CUDA
//! tensors in one object, a CUDA slab freed and allocated again at the
//! same address with another size, a producer that died.

use super::*;

const NIXL: Transport = Transport::Nixl;

/// Passes `[0, 1, ..., n-1]` over nixl and checks the values and where
/// the consumer's tensor lives; returns that device's UUID.
async fn check_iota(rt: &Runtime, p: &GpuProducerHandle, c: &GpuConsumerHandle) -> String {
    let mut at = String::new();
    for n in [1usize, 1000, 3 << 20] {
        let r = p.iota(n).transport(NIXL).remote();
        let (uuid, v) = rt.get(c.inspect(&r).remote()).await.unwrap();
        assert_eq!(v.len(), n);
        assert!(
            v.iter().enumerate().all(|(i, &x)| x == i as f32),
            "{n} elements read back in order"
        );
        at = uuid;
    }
    let r = p.make(2.0, 1 << 20).transport(NIXL).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        ((2u64 << 20) as f64, true)
    );
    // The direct path ran: every object came over nixl, and the consumer's
    // agent posted the reads.
    assert_eq!(
        rt.get(c.received("nixl".to_string()).remote())
            .await
            .unwrap(),
        4
    );
    assert_eq!(
        rt.get(c.nixl_stats().remote()).await.unwrap().reads_posted,
        4
    );
    at
}

gpu_test!(
    nixl_a_small_read_again_finds_its_destination_made_ahead,
    async {
        require_gpu();
        let (rt, p, c) = setup_on(&[0], &[0]).await;
        // One object of 4 KiB passed again and again, its values changed
        // in place between passes: the same read plan each time.
        let n = 1024;
        let r = p.make_kept(0.0, n).transport(NIXL).remote();
        rt.wait(&r).await.unwrap();
        let s0 = rt.get(c.nixl_stats().remote()).await.unwrap();
        for k in 1..=6u32 {
            rt.get(p.fill_kept(0, k as f32).remote()).await.unwrap();
            // Read back: the fill has landed before the next READ.
            assert_eq!(rt.get(p.read_kept(0).remote()).await.unwrap(), k as f32);
            let (sum, _) = rt.get(c.sum(&r).remote()).await.unwrap();
            assert_eq!(sum, f64::from(k) * n as f64, "pass {k} read its bytes");
        }
        let s1 = rt.get(c.nixl_stats().remote()).await.unwrap();
        // NX-11: after each receive the next destination was made ahead,
        // and every pass after the first posted its READ into one.
        rdt_integration_tests::assert_destinations_made_ahead(&s0, &s1, 6);
    }
);

gpu_test!(nixl_same_gpu, async {
    require_gpu();
    let (rt, p, c) = setup_on(&[0], &[0]).await;
    let producer = rt.get(p.uuid().remote()).await.unwrap();
    assert_eq!(
        check_iota(&rt, &p, &c).await,
        producer,
        "read into the same GPU"
    );
});

gpu_test2!(nixl_cross_gpu, async {
    require_two_gpus();
    let (rt, p, c) = setup_on(&[0], &[1]).await;
    let producer = rt.get(p.uuid().remote()).await.unwrap();
    let consumer = rt.get(c.uuids().remote()).await.unwrap();
    let at = check_iota(&rt, &p, &c).await;
    assert_ne!(at, producer, "read across GPUs, into the consumer's own");
    assert_eq!(vec![at], consumer);
});

gpu_test!(nixl_gpu_to_the_drivers_host_and_gpu, async {
    require_gpu();
    let (rt, p, _c) = setup_on(&[0], &[0]).await;
    let producer = rt.get(p.uuid().remote()).await.unwrap();
    // The counter is this test process's: other tests read over nixl in
    // the driver too.
    let before = rdt::data::nixl::stats().reads_posted;
    let r = p.iota(1 << 20).transport(NIXL).remote();
    let host: Tensor = rt.get_on_host(&r).await.unwrap();
    assert!(!host.is_cuda());
    let v = host.to_vec::<f32>().unwrap();
    assert!(v.iter().enumerate().all(|(i, &x)| x == i as f32));
    let gpu: Tensor = rt.get(&r).await.unwrap();
    match gpu.device() {
        Device::Cuda { uuid, .. } => {
            assert_eq!(uuid.to_string(), producer, "the same GPU, in the driver")
        }
        d => panic!("expected a CUDA tensor, got one on {d}"),
    }
    assert_eq!(gpu.sum().unwrap(), (0..1u64 << 20).sum::<u64>() as f64);
    assert_eq!(rdt::data::nixl::stats().reads_posted - before, 2);
});

gpu_test!(nixl_cpu_and_cuda_tensors_in_one_object, async {
    require_gpu();
    let (rt, p, c) = setup().await;
    let r = p.mixed(1.5, 1 << 16).transport(NIXL).remote();
    let (a, a_cuda, b, b_cuda) = rt.get(c.sum_mixed(&r).remote()).await.unwrap();
    assert_eq!((a, a_cuda), (1.5 * 65536.0, true));
    assert_eq!((b, b_cuda), (3.0 * 65536.0, false));
    // One READ per pair of memory types.
    assert_eq!(
        rt.get(c.nixl_stats().remote()).await.unwrap().reads_posted,
        2
    );
    // And a CPU tensor alone, from a GPU actor to a GPU actor.
    let r = p.make_cpu(1000).transport(NIXL).remote();
    assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), (1000.0, false));
});

gpu_test!(
    nixl_a_recycled_slab_never_reads_through_an_old_registration,
    async {
        require_gpu();
        let (rt, p, c) = setup().await;
        // Tensors above the slab size get a slab of their own; trimmed after
        // each pass, the next (smaller) one is allocated where the last was.
        let mut forgot = false;
        for k in 0..8usize {
            let n = (80 << 18) - k * (2 << 18);
            let r = p.make((k + 1) as f32, n).transport(NIXL).remote();
            let (s, _) = rt.get(c.sum(&r).remote()).await.unwrap();
            assert_eq!(s, (k + 1) as f64 * n as f64, "pass {k}");
            drop(r);
            rt.transfers_settled().await;
            rt.get(p.forget().remote()).await.unwrap();
            rt.get(p.trim().remote()).await.unwrap();
            if rt
                .get(c.nixl_stats().remote())
                .await
                .unwrap()
                .remote_forgets
                > 0
            {
                forgot = true;
                break;
            }
        }
        assert!(forgot, "no slab was allocated over an old one in 8 passes");
    }
);

gpu_test!(
    nixl_a_dead_producer_fails_the_call_and_the_consumer_lives,
    async {
        require_gpu();
        let (rt, p, c) = setup().await;
        let r = p.make(1.0, 1 << 20).transport(NIXL).remote();
        rt.wait(&r).await.unwrap();
        let _ = rt.get(p.die().remote()).await;
        let e = rt.get(c.sum(&r).remote()).await.unwrap_err();
        assert_producer_died(&e, &p);
        let p2 = rt.spawn::<GpuProducer>(()).on_gpus([0]).await.unwrap();
        let r2 = p2.make(3.0, 1000).transport(NIXL).remote();
        assert_eq!(rt.get(c.sum(&r2).remote()).await.unwrap(), (3000.0, true));
    }
);

gpu_test!(nixl_update_waits_for_work_queued_on_the_targets, async {
    require_gpu();
    let (rt, p, c) = setup_on(&[0], &[0]).await;
    let (n, len) = (4usize, 1usize << 20);
    let want = |first: f64| (0..n).map(|i| (first + i as f64) * len as f64).sum::<f64>();
    let r = p.version(n, len, 1.0).transport(NIXL).remote();
    rt.get(c.update_params(&r, n, len).remote()).await.unwrap();
    // A copy of the parameters is queued on rdt's stream behind long
    // fills; the update then reads the next version into them. UCX writes
    // on a stream of its own: the READ waits for rdt's stream first
    // (NX-9), so the copy sees the old values, never the new ones.
    let r = p.version(n, len, 100.0).transport(NIXL).remote();
    rt.wait(&r).await.unwrap();
    let (before, after) = rt
        .get(c.copy_then_update(&r, n, len).remote())
        .await
        .unwrap();
    assert_eq!(
        before,
        want(1.0),
        "work queued before the update saw the old weights"
    );
    assert_eq!(after, want(100.0), "the update landed in place");
    assert_eq!(
        rt.get(c.in_place().remote()).await.unwrap(),
        2,
        "both updates were read into the parameters"
    );
});

/// Runs `spawn` with this process's standard output and error going to
/// the file `path`, so that the workers it starts (which inherit both)
/// write theirs there (UCX logs to standard output); this process's own
/// come back after.
async fn with_workers_output_in<T>(
    path: &std::path::Path,
    spawn: impl std::future::Future<Output = T>,
) -> T {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let file = std::fs::File::create(path).unwrap();
    let _ = std::io::stdout().flush();
    let mut saved = Vec::new();
    for fd in [1, 2] {
        // SAFETY: plain descriptor calls on descriptors this test owns; the
        // GPU tests run one at a time (`--test-threads=1`).
        let copy = unsafe { libc::dup(fd) };
        assert!(copy >= 0, "dup({fd}): {}", std::io::Error::last_os_error());
        // SAFETY: as above.
        assert!(unsafe { libc::dup2(file.as_raw_fd(), fd) } >= 0);
        saved.push((fd, copy));
    }
    let out = spawn.await;
    for (fd, copy) in saved {
        // SAFETY: as above.
        unsafe {
            assert!(libc::dup2(copy, fd) >= 0);
            libc::close(copy);
        }
    }
    out
}

gpu_test!(nixl_host_memory_readers_exit_without_ucx_errors, async {
    require_gpu();
    // Two CPU actors on a GPU host: UCX loads its CUDA support in both.
    // Before the agent was closed at exit, the reader printed
    // `UCX  ERROR cuPointerGetAttributes(...) failed: unrecognized error
    // code 4` (CUDA deinitialized) at every exit.
    let log = std::env::temp_dir().join(format!("rdt-nixl-exit-{}.log", std::process::id()));
    let (rt, p, c) = with_workers_output_in(&log, async {
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        (rt, p, c)
    })
    .await;
    for k in 1..=4u32 {
        let r = p.make(k as f32, 1024).transport(NIXL).remote();
        assert_eq!(
            rt.get(c.sum(&r).remote()).await.unwrap(),
            f64::from(k) * 1024.0
        );
    }
    // The direct path ran: the consumer's agent read all four.
    assert_eq!(
        rt.get(c.nixl_stats().remote()).await.unwrap().reads_posted,
        4
    );
    // Waits for both workers to exit (their `exit` runs the teardown).
    rt.shutdown().await;
    let text = std::fs::read_to_string(&log).unwrap();
    let _ = std::fs::remove_file(&log);
    assert!(
        !text.contains("UCX  ERROR"),
        "the workers printed UCX errors at exit:\n{text}"
    );
});
