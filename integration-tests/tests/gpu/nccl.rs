//! The `nccl` transport between real worker processes on two GPUs (NCCL
//! refuses two ranks on one GPU in one communicator): the semantic suite,
//! groups, stream order and failures that leave actors usable. Every test
//! is a two-GPU test (`gpu_test2!`: skipped, never passed, with fewer).

use super::*;

const NCCL: Transport = Transport::Nccl;

/// A producer on GPU 0 and a consumer on GPU 1, in one nccl group.
async fn nccl_pair() -> (Runtime, GpuProducerHandle, GpuConsumerHandle, rdt::GroupId) {
    require_two_gpus();
    let (rt, p, c) = setup_on(&[0], &[1]).await;
    let g = rt
        .create_collective_group(&[p.id(), c.id()], NCCL)
        .await
        .expect("an nccl group of two actors on two GPUs");
    (rt, p, c, g)
}

/// [`nccl_pair`] under a transfer deadline of `secs` seconds, warmed up.
async fn warm_pair_with_deadline(secs: u64) -> (Runtime, GpuProducerHandle, GpuConsumerHandle) {
    require_two_gpus();
    rdt_integration_tests::logs();
    let rt = Runtime::builder()
        .transfer_timeout(std::time::Duration::from_secs(secs))
        .start()
        .await
        .unwrap();
    let p = rt.spawn::<GpuProducer>(()).on_gpus([0]).await.unwrap();
    let c = rt.spawn::<GpuConsumer>(()).on_gpus([1]).await.unwrap();
    rt.create_collective_group(&[p.id(), c.id()], NCCL)
        .await
        .expect("an nccl group of two actors on two GPUs");
    warm_up(&rt, &p, &c).await;
    (rt, p, c)
}

/// One small pass, so that NCCL's connection between the two is set up
/// (it is made on first use) and later timing-sensitive passes do not
/// include it.
async fn warm_up(rt: &Runtime, p: &GpuProducerHandle, c: &GpuConsumerHandle) {
    warm_up_with(rt, p, c).await
}

async fn warm_up_with(rt: &Runtime, p: &GpuProducerHandle, c: &GpuConsumerHandle) {
    let r = p.make(1.0, 4).transport(NCCL).remote();
    assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), (4.0, true));
}

/// The consumer received `n` objects over nccl and none over anything
/// else: a pass that fell back to another path fails here.
async fn assert_nccl_path(rt: &Runtime, c: &GpuConsumerHandle, n: u64) {
    for t in Transport::registered() {
        let got = rt
            .get(c.received(t.name().to_string()).remote())
            .await
            .unwrap();
        assert_eq!(
            got,
            if t == NCCL { n } else { 0 },
            "objects received over {t}"
        );
    }
}

gpu_test2!(nccl_point_to_point, async {
    let (rt, p, c, _) = nccl_pair().await;
    let producer_uuid = rt.get(p.uuid().remote()).await.unwrap();
    for n in [1usize, 1000, 3 << 20] {
        let r = p.iota(n).transport(NCCL).remote();
        let (uuid, v) = rt.get(c.inspect(&r).remote()).await.unwrap();
        assert_ne!(uuid, producer_uuid, "received into the consumer's own GPU");
        assert!(
            v.iter().enumerate().all(|(i, &x)| x == i as f32) && v.len() == n,
            "{n} elements arrive in order"
        );
    }
    let r = p.make(0.5, 64 << 20).transport(NCCL).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (0.5 * (64 << 20) as f64, true)
    );
    assert_nccl_path(&rt, &c, 4).await;
});

gpu_test2!(nccl_waits_for_the_producers_stream, async {
    let (rt, p, c, _) = nccl_pair().await;
    // Still being written on rdt's stream when returned, then written on a
    // stream of the producer's own: the send waits for both on the GPU.
    let n = 64 << 20;
    let r = p.make_busy(5.0, n, 50).transport(NCCL).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (5.0 * n as f64, true)
    );
    let r = p.make_on_own_stream(3.0, n, 50).transport(NCCL).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (3.0 * n as f64, true)
    );
});

gpu_test2!(nccl_method_starts_before_the_bytes_land, async {
    let (rt, p, c, _) = nccl_pair().await;
    // The producer's GPU is busy for a long while with the tensor: the
    // bytes land long after the consumer's receive was enqueued. The
    // method starts then, launches its kernel at once, and that kernel
    // waits for the transfer on the GPU (no host sync on the path).
    warm_up(&rt, &p, &c).await;
    let n = 256 << 20;
    let r = p.make_busy(7.0, n, 1000).transport(NCCL).remote();
    let (early, s) = rt.get(c.early_sum(&r).remote()).await.unwrap();
    assert!(
        early,
        "the method ran before the transfer's done event passed"
    );
    assert_eq!(s, 7.0 * n as f64, "its kernel saw every byte");
    // WK-9: the call took the value before it landed, so its CallDone
    // acknowledges the receive, and that settles the transfer in the
    // driver (a transfer this large also sends its Received at landing,
    // OW-15, whichever comes first settles it).
    assert!(
        rt.get(c.acks_by_calls().remote()).await.unwrap() >= 1,
        "the call acknowledged the receive it took before the landing"
    );
    rt.transfers_settled().await;
    assert_eq!(rt.transfers_in_flight(), 0);
});

gpu_test2!(
    xf_5_a_method_that_panics_before_its_bytes_land_replies_after_them,
    async {
        // XF-5, WK-5: a `CallDone` past argument resolution settles the call's
        // receives in the driver, so it must come after their landing, also
        // when the method panicked: before, the panic's reply went out at once
        // and the driver freed memory the receive was still writing.
        let (rt, p, c, _) = nccl_pair().await;
        warm_up(&rt, &p, &c).await;
        let n = 256 << 20;
        // How long the same value takes to land, read by a method that waits
        // for it on the GPU.
        let t0 = std::time::Instant::now();
        let r = p.make_busy(7.0, n, 1000).transport(NCCL).remote();
        let (early, s) = rt.get(c.early_sum(&r).remote()).await.unwrap();
        let landing = t0.elapsed();
        assert!(early && s == 7.0 * n as f64);
        let t0 = std::time::Instant::now();
        let r = p.make_busy(7.0, n, 1000).transport(NCCL).remote();
        let e = rt.get(c.early_panic(&r).remote()).await.unwrap_err();
        let replied = t0.elapsed();
        assert!(matches!(e, Error::Panic { .. }), "{e}");
        assert!(
            e.to_string().contains("still on their way: true"),
            "the method panicked before the landing: {e}"
        );
        // Before the fix the panic's reply came in a few ms, long before the
        // hundreds of ms the bytes take.
        assert!(
            replied * 2 >= landing,
            "the reply ({replied:?}) waited for the landing ({landing:?})"
        );
        rt.transfers_settled().await;
        assert_eq!(rt.transfers_in_flight(), 0);
    }
);

gpu_test2!(
    nccl_a_long_method_on_an_early_value_outlives_the_transfer_deadline,
    async {
        // WK-9 bound: a call that took its value before the bytes landed
        // acknowledges the receive with its `CallDone`, but a method that runs
        // on past the landing must not hold the acknowledgement until the
        // transfer deadline: the driver would abort a finished transfer and
        // break the group under a call that is doing nothing wrong.
        let (rt, p, c) = warm_pair_with_deadline(2).await;
        let n = 256 << 20;
        let r = p.make_busy(7.0, n, 1000).transport(NCCL).remote();
        let (early, s) = rt.get(c.early_sum_after(&r, 3000).remote()).await.expect(
            "a method that runs past the transfer deadline after its bytes landed succeeds",
        );
        assert!(early, "the method took the value before it landed");
        assert_eq!(s, 7.0 * n as f64, "its kernel saw every byte");
        rt.transfers_settled().await;
        assert_eq!(rt.transfers_in_flight(), 0);
        // The group is whole: the transfer was acknowledged, not expired.
        let r = p.make(1.0, 4).transport(NCCL).remote();
        assert_eq!(
            rt.get(c.sum(&r).remote())
                .await
                .expect("the group still works after the long method"),
            (4.0, true)
        );
        assert_nccl_path(&rt, &c, 3).await;
    }
);

gpu_test2!(nccl_several_tensors_and_nested_values, async {
    let (rt, p, c, _) = nccl_pair().await;
    let b = p.batch(3).transport(NCCL).remote();
    let (step, label, s, all_cuda) = rt.get(c.batch_sum(&b).remote()).await.unwrap();
    assert_eq!((step, label.as_str(), all_cuda), (3, "batch-3", true));
    assert_eq!(s, 64.0 + 120.0 + 6.0 + 15.0 + 4.0);
    let m = p.many(100, 4096).transport(NCCL).remote();
    let sums = rt.get(c.sums(&m).remote()).await.unwrap();
    assert_eq!(
        sums,
        (0..100).map(|i| (i * 4096) as f64).collect::<Vec<_>>(),
        "100 tensors in one object, in order"
    );
    assert_nccl_path(&rt, &c, 2).await;
});

gpu_test2!(nccl_same_ref_twice_and_to_two_actors, async {
    let (rt, p, c, _) = nccl_pair().await;
    let c2 = rt.spawn::<GpuConsumer>(()).on_gpus([1]).await.unwrap();
    // The producer is in two groups, the consumers each in one.
    rt.create_collective_group(&[p.id(), c2.id()], NCCL)
        .await
        .unwrap();
    let r = p.make(3.0, 10).transport(NCCL).remote();
    let (s, shared) = rt.get(c.sum2(&r, &r).remote()).await.unwrap();
    assert_eq!(
        (s, shared),
        (60.0, true),
        "one ref twice in a call is one tensor"
    );
    let a = c.sum(&r).remote();
    let b = c2.sum(&r).remote();
    assert_eq!(rt.get(a).await.unwrap(), (30.0, true));
    assert_eq!(rt.get(b).await.unwrap(), (30.0, true));
    // The same consumer again: a new transfer (its copy was dropped).
    assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), (30.0, true));
    assert_nccl_path(&rt, &c, 3).await;
});

gpu_test2!(nccl_frees_everything_after_the_last_ref, async {
    let (rt, p, c, _) = nccl_pair().await;
    for _ in 0..20 {
        let r = p.make(1.0, 1 << 20).transport(NCCL).remote();
        assert_eq!(
            rt.get(c.sum(&r).remote()).await.unwrap().0,
            (1 << 20) as f64
        );
    }
    rt.transfers_settled().await;
    assert_eq!(rt.live_objects(), 0);
    assert_eq!(rt.get(p.stored().remote()).await.unwrap(), 0);
    assert_eq!(rt.get(c.stored().remote()).await.unwrap(), 0);
});

gpu_test2!(nccl_errors_and_dependencies, async {
    let (rt, p, c, _) = nccl_pair().await;
    // An application error reaches the consumer's call as its cause.
    let r = p.fail("no weights".to_string()).transport(NCCL).remote();
    let e = rt.get(c.sum(&r).remote()).await.unwrap_err();
    assert!(e.to_string().contains("no weights"), "{e}");
    // A CPU tensor under nccl: the producer's call fails, naming the
    // tensor and its device.
    let r = p.make_cpu(4).transport(NCCL).remote();
    let e = rt.get(&r).await.unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains("tensor #0") && m.contains("cpu") && m.contains("nccl"),
        "{m}"
    );
    // The driver cannot take part in a collective transfer: the error says
    // what to use instead.
    let r = p.make(1.0, 8).transport(NCCL).remote();
    let e = rt.get(&r).await.unwrap_err();
    assert!(e.to_string().contains("get_via_object_store"), "{e}");
    let t: Tensor = rt.get_via_object_store(&r).await.unwrap();
    assert_eq!(t.sum().unwrap(), 8.0, "the object-store path works");
    // Both actors are fine.
    assert_eq!(rt.get(p.echo(1).remote()).await.unwrap(), 1);
    assert_eq!(rt.get(c.echo(2).remote()).await.unwrap(), 2);
});

gpu_test2!(nccl_needs_a_group, async {
    require_two_gpus();
    let (rt, p, c) = setup_on(&[0], &[1]).await;
    // Before any group: refused at submit, never a hang (ray#66264).
    let r = p.make(1.0, 8).transport(NCCL).remote();
    let e = rt.get(c.sum(&r).remote()).await.unwrap_err();
    assert!(
        matches!(e.root_cause(), Error::NotInGroup { .. }),
        "expected NotInGroup, got {e}"
    );
    assert!(e.to_string().contains("create_collective_group"), "{e}");
    // In a group with the producer: the outsider is refused, the member
    // gets the object.
    let outsider = rt.spawn::<GpuConsumer>(()).on_gpus([1]).await.unwrap();
    rt.create_collective_group(&[p.id(), c.id()], NCCL)
        .await
        .unwrap();
    let e = rt.get(outsider.sum(&r).remote()).await.unwrap_err();
    assert!(
        matches!(e.root_cause(), Error::NotInGroup { .. }),
        "expected NotInGroup, got {e}"
    );
    assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), (8.0, true));
    // A group of a CPU transport and one of nccl on the same actors.
    rt.create_collective_group(&[p.id(), c.id()], Transport::Tcp)
        .await
        .unwrap();
    assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), (8.0, true));
});

gpu_test2!(nccl_destroy_and_create_again, async {
    let (rt, p, c, g) = nccl_pair().await;
    let r = p.make(2.0, 16).transport(NCCL).remote();
    assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), (32.0, true));
    rt.destroy_collective_group(g).await.unwrap();
    let e = rt.get(c.sum(&r).remote()).await.unwrap_err();
    assert!(matches!(e.root_cause(), Error::NotInGroup { .. }), "{e}");
    rt.create_collective_group(&[p.id(), c.id()], NCCL)
        .await
        .unwrap();
    assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), (32.0, true));
    assert_nccl_path(&rt, &c, 2).await;
});

/// After a failure in its group: the actor answers, computes on its GPU,
/// and passes over nccl in a new group with a new peer on the other GPU.
async fn assert_usable_producer(rt: &Runtime, p: &GpuProducerHandle) {
    assert_eq!(rt.get(p.echo(5).remote()).await.unwrap(), 5);
    let c = rt.spawn::<GpuConsumer>(()).on_gpus([1]).await.unwrap();
    rt.create_collective_group(&[p.id(), c.id()], NCCL)
        .await
        .expect("the actor joins a new group after the failure");
    let r = p.make(4.0, 1 << 20).transport(NCCL).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (4.0 * (1 << 20) as f64, true)
    );
}

gpu_test2!(nccl_receiver_dies_mid_transfer, async {
    let (rt, p, c, g) = nccl_pair().await;
    // The producer's stream is busy with the tensor: the consumer's
    // receive is enqueued (the method starts) but cannot land; the
    // producer's send waits in NCCL. The consumer dies then.
    warm_up(&rt, &p, &c).await;
    let r = p.make_busy(1.0, 64 << 20, 2000).transport(NCCL).remote();
    let e = rt.get(c.die_mid_transfer(&r).remote()).await.unwrap_err();
    assert!(
        matches!(e.root_cause(), Error::ActorDied { .. }),
        "the consumer died mid-transfer: {e}"
    );
    // The group is broken, with a reason, for later passes.
    let c2 = rt.spawn::<GpuConsumer>(()).on_gpus([1]).await.unwrap();
    let e = rt.get(c2.sum(&r).remote()).await.unwrap_err();
    assert!(matches!(e.root_cause(), Error::NotInGroup { .. }), "{e}");
    let _ = g;
    assert_usable_producer(&rt, &p).await;
    // The producer's object is still there for a new peer.
    let c3 = rt.spawn::<GpuConsumer>(()).on_gpus([1]).await.unwrap();
    rt.create_collective_group(&[p.id(), c3.id()], NCCL)
        .await
        .unwrap();
    assert_eq!(
        rt.get(c3.sum(&r).remote()).await.unwrap(),
        ((64 << 20) as f64, true)
    );
});

gpu_test2!(nccl_sender_dies_before_and_while_sending, async {
    let (rt, p, c, _) = nccl_pair().await;
    // Before sending: the object died with its producer.
    let r = p.make(1.0, 8).transport(NCCL).remote();
    rt.wait(&r).await.unwrap();
    p.kill();
    let e = rt.get(c.sum(&r).remote()).await.unwrap_err();
    assert_producer_died(&e, &p);
    assert_eq!(rt.get(c.echo(1).remote()).await.unwrap(), 1);
    // While the consumer waits in NCCL for the bytes: the producer's GPU
    // is busy with the tensor, the consumer's receive is enqueued, the
    // producer dies. The consumer's call fails with the death, its
    // communicator is aborted, and it goes on.
    let p2 = rt.spawn::<GpuProducer>(()).on_gpus([0]).await.unwrap();
    rt.create_collective_group(&[p2.id(), c.id()], NCCL)
        .await
        .unwrap();
    warm_up_with(&rt, &p2, &c).await;
    let r = p2.make_busy(1.0, 1 << 30, 1000).transport(NCCL).remote();
    rt.wait(&r).await.unwrap();
    let call = c.early_sum(&r).remote();
    p2.kill();
    // The method may have run (its kernel waited on the GPU until the
    // abort), but its result waits for the bytes, which never all came.
    let e = rt.get(call).await.unwrap_err();
    let m = e.to_string();
    assert!(
        m.contains(p2.name()) && m.contains("died"),
        "the producer's death: {m}"
    );
    assert_eq!(rt.get(c.echo(2).remote()).await.unwrap(), 2);
    let p3 = rt.spawn::<GpuProducer>(()).on_gpus([0]).await.unwrap();
    rt.create_collective_group(&[p3.id(), c.id()], NCCL)
        .await
        .expect("the consumer joins a new group");
    let r = p3.make(2.0, 1 << 20).transport(NCCL).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        (2.0 * (1 << 20) as f64, true)
    );
});

gpu_test2!(nccl_transfer_deadline_aborts_the_communicator, async {
    let (rt, p, c) = warm_pair_with_deadline(2).await;
    // The producer stops (SIGSTOP: alive, silent) before it sends: the
    // consumer waits in NCCL until the deadline aborts both ends; the
    // call fails with the timeout, both actors go on.
    let r = p.make(1.0, 1 << 20).transport(NCCL).remote();
    rt.wait(&r).await.unwrap();
    let pid = p.pid().expect("a local worker") as i32;
    // SAFETY: a plain signal to our own worker.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let e = rt.get(c.sum(&r).remote()).await.unwrap_err();
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGCONT) };
    // The receive had returned (the method may start early); its bytes
    // never landed, so the call fails with the abort the deadline caused.
    let m = e.to_string();
    assert!(
        m.contains("transfer deadline") && m.contains("aborted"),
        "the transfer deadline: {m}"
    );
    assert_eq!(rt.get(c.echo(3).remote()).await.unwrap(), 3);
    assert_usable_producer(&rt, &p).await;
});

// A weight update over nccl: the consumer receives each version into
// views of its own flat CUDA buffer (`get_into`), in place on its GPU.
gpu_test2!(nccl_receive_into_target_tensors, async {
    let (rt, p, c, _) = nccl_pair().await;
    let (n, len) = (4usize, 1000usize);
    for first in [1.0f32, 100.0] {
        let r = p.version(n, len, first).transport(NCCL).remote();
        let (sums, same, one_buffer) = rt.get(c.update_params(&r, n, len).remote()).await.unwrap();
        let want: Vec<f64> = (0..n)
            .map(|i| f64::from(first + i as f32) * len as f64)
            .collect();
        assert_eq!(sums, want, "version {first}");
        assert!(same, "the value got back holds the parameters");
        assert!(one_buffer, "the parameters are still views of one buffer");
    }
    assert_eq!(
        rt.get(c.in_place().remote()).await.unwrap(),
        2,
        "both versions received in place"
    );
    assert_nccl_path(&rt, &c, 2).await;
});

gpu_test2!(nccl_receive_into_clean_memory_overlaps_compute, async {
    let (rt, p, c, _) = nccl_pair().await;
    warm_up(&rt, &p, &c).await;
    // The warm-up's memory is freed, and rdt's stream seen done after:
    // it is clean for the next receive.
    rt.transfers_settled().await;
    assert_eq!(rt.get(c.stored().remote()).await.unwrap(), 0);
    rt.get(c.gpu_settled().remote()).await.unwrap();
    // Compute that has nothing to do with the transfer keeps the
    // consumer's stream busy for a long while; the receive lands under it
    // (NC-6), and the method's kernel still sees every byte.
    rt.get(c.busy(1 << 30, 1000).remote()).await.unwrap();
    let s0 = rt.get(c.nccl_stats().remote()).await.unwrap();
    let n = 1 << 18;
    let r = p.make(3.0, n).transport(NCCL).remote();
    let (busy, s) = rt.get(c.landed_while_busy(&r).remote()).await.unwrap();
    assert!(
        busy,
        "the receive landed while unrelated compute queued before it still ran"
    );
    assert_eq!(s, 3.0 * n as f64);
    let s1 = rt.get(c.nccl_stats().remote()).await.unwrap();
    assert_eq!(
        (
            s1.receives - s0.receives,
            s1.receives_clean - s0.receives_clean
        ),
        (1, 1),
        "one receive, into clean memory"
    );
    assert_nccl_path(&rt, &c, 2).await;
});
