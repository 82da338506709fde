//! Unit tests of the `cuda_ipc` transport that need no GPU: refusals,
//! malformed handles, and the producer caches.

use super::*;

fn peer() -> Peer {
    Peer {
        actor: 1,
        name: "producer".into(),
        host: "here".into(),
        endpoint: String::new(),
    }
}

#[test]
fn cpu_tensors_are_refused() {
    let t = CudaIpcTransport::new();
    let e = t.check_device(&Device::Cpu).unwrap_err();
    assert!(e.message.contains("shm"), "{e}");
    let x = Tensor::full(1f32, &[4]);
    let e = futures::executor::block_on(t.export(1, &[x])).unwrap_err();
    assert!(e.message.contains("CUDA tensors"), "{e}");
}

/// Handles from a producer on this host (this process), with `tensors`.
fn handles_here(tensors: Vec<TensorHandle>) -> Handles {
    Handles {
        boot_id: host_id().unwrap().boot_id.clone(),
        pid_ns: host_id().unwrap().pid_ns,
        pid: std::process::id(),
        counters_fd: 0,
        counters_id: (0, 0),
        events: vec![],
        slabs: vec![SlabHandle {
            id: 1,
            handle: vec![0; 64],
            len: 1024,
            record: 0,
        }],
        tensors,
    }
}

/// What a fresh transport's `receive` of `h` with `metas` fails with.
fn receive_error(h: &Handles, metas: Vec<crate::TensorMeta>) -> TransportError {
    let ex = Exported {
        metas,
        handles: postcard::to_allocvec(h).unwrap(),
        inline: vec![],
    };
    futures::executor::block_on(CudaIpcTransport::new().receive(&peer(), &TransferCtx::new(0), &ex))
        .unwrap_err()
}

#[test]
fn another_host_is_a_clear_error() {
    let h = Handles {
        boot_id: "another-boot".into(),
        pid_ns: None,
        pid: 1,
        ..handles_here(vec![])
    };
    let e = receive_error(&h, vec![]);
    assert!(e.message.contains("another host"), "{e}");
}

#[test]
fn out_of_range_record_indices_are_refused() {
    let mut h = handles_here(vec![TensorHandle {
        slab: 0,
        offset: 0,
        len: 16,
        slot: alloc::COUNTER_SLOTS as u32,
    }]);
    let meta = Tensor::zeros(crate::DType::F32, &[4]).meta();
    let e = receive_error(&h, vec![meta.clone()]);
    assert!(e.message.contains("out of range"), "{e}");
    h.tensors[0].slot = 0;
    h.tensors[0].slab = 1; // one slab only
    let e = receive_error(&h, vec![meta.clone()]);
    assert!(e.message.contains("out of range"), "{e}");
    h.tensors[0].slab = 0;
    h.slabs[0].record = u32::MAX;
    let e = receive_error(&h, vec![meta.clone()]);
    assert!(e.message.contains("out of range"), "{e}");
    h.slabs[0].record = 0;
    h.slabs[0].handle = vec![0; 3];
    let e = receive_error(&h, vec![meta]);
    assert!(e.message.contains("3-byte memory handle"), "{e}");
}

/// Defect 8: the caches of producers' records, events and mappings
/// were never pruned when a producer died.
#[test]
fn peer_gone_forgets_the_producers_caches() {
    // This process's own import records stand in for a producer's
    // (no GPU needed); a second key stands in for another producer.
    let mine = alloc::counters().unwrap();
    let key = (std::process::id(), mine.id);
    let other = (u32::MAX, (u64::MAX, u64::MAX));
    for k in [key, other] {
        let c = Counters::open(key.0, mine.fd(), mine.id).unwrap();
        let p = ProducerProcess {
            counters: Arc::new(c),
            watch: None,
        };
        counters_cache().lock().insert(k, Arc::new(p));
    }
    let cached = |k: &ProducerKey| counters_cache().lock().contains_key(k);

    let t = CudaIpcTransport::new();
    // Actors 7 and 8 run in one process; 9 in another.
    for (actor, k) in [(7, key), (8, key), (9, other)] {
        t.producers.lock().entry(actor).or_default().insert(k);
    }
    t.peer_gone(7);
    assert!(cached(&key), "actor 8 still sends from that process");
    t.peer_gone(8);
    assert!(!cached(&key) && cached(&other));
    t.peer_gone(9);
    assert!(!cached(&other));
    assert!(t.producers.lock().is_empty());
    t.peer_gone(10); // unknown: nothing to do
}

/// After the first receive from a producer process, its liveness is
/// its pidfd's: a producer that exited is a clear error, and leaves
/// the cache.
#[test]
fn a_cached_producer_that_exited_is_an_error() {
    let mine = alloc::counters().unwrap();
    let mut h = handles_here(vec![]);
    h.counters_fd = mine.fd();
    h.counters_id = mine.id;
    // This process as its own producer: alive, cached, watched.
    open_counters(&h).unwrap();
    let key = (h.pid, h.counters_id);
    let p = counters_cache().lock().get(&key).cloned().expect("cached");
    let Some(w) = &p.watch else {
        eprintln!("skipped: no pidfd on this kernel");
        return;
    };
    assert!(!w.exited());
    open_counters(&h).expect("alive, from the cache");

    // A process that has exited, cached as if it had sent tensors.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    let watch = crate::rt::process_watch::watch(pid);
    child.wait().unwrap();
    let Some(watch) = watch else {
        return; // it was reaped before the watch: nothing to check
    };
    let dead = (pid, h.counters_id);
    counters_cache().lock().insert(
        dead,
        Arc::new(ProducerProcess {
            counters: p.counters.clone(),
            watch: Some(watch),
        }),
    );
    h.pid = pid;
    let e = open_counters(&h).err().expect("a dead producer");
    assert!(e.contains("has exited"), "{e}");
    assert!(!counters_cache().lock().contains_key(&dead));
}

#[test]
fn without_cuda_receive_says_why() {
    if crate::cuda::available().is_ok() {
        return;
    }
    let e = receive_error(&handles_here(vec![]), vec![]);
    assert!(e.message.contains("cannot use CUDA"), "{e}");
    let e = Tensor::cuda_zeros(crate::DType::F32, &[4], 0).unwrap_err();
    assert!(e.to_string().contains("CUDA"), "{e}");
}
