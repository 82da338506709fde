//! The `shm` transport's tests: regions, handles, stale and malformed
//! input, kept mappings.

use futures::executor::block_on;

use super::*;

fn peer() -> Peer {
    Peer {
        actor: 1,
        name: "producer".into(),
        host: "here".into(),
        endpoint: String::new(),
    }
}

fn decode(e: &Exported) -> Handles {
    postcard::from_bytes(&e.handles).expect("handles we made decode")
}

fn with_handles(e: &Exported, f: impl FnOnce(&mut Handles)) -> Exported {
    let mut h = decode(e);
    f(&mut h);
    Exported {
        handles: postcard::to_stdvec(&h).expect("encodes"),
        ..e.clone()
    }
}

/// Where `t`'s bytes are in this process (an shm tensor's mapping).
fn ptr(t: &Tensor) -> usize {
    t.with_external(|m| m.expect("shm tensor").as_ptr() as usize)
}

/// The address range of the whole mapping `t`'s bytes live in.
fn mapping_of(t: &Tensor) -> std::ops::Range<usize> {
    let (region, _) = shm_place(t).expect("shm tensor");
    let start = region.map.as_mut_ptr() as usize;
    start..start + region.map.len()
}

/// Does the slice `b` overlap the address range `r`?
fn overlaps(b: &[u8], r: &std::ops::Range<usize>) -> bool {
    let start = b.as_ptr() as usize;
    start < r.end && r.start < start + b.len().max(1)
}

fn receive(shm: &ShmTransport, e: &Exported) -> Result<Vec<Tensor>, TransportError> {
    block_on(shm.receive(&peer(), &TransferCtx::new(0), e))
}

fn sample() -> Vec<Tensor> {
    vec![
        Tensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0, 5.0, 6.5], &[2, 3]).unwrap(),
        Tensor::arange::<i64>(5),
        // 7 bytes: the next tensor must still start 64-byte aligned.
        Tensor::from_slice(&[1u8, 2, 3, 4, 5, 6, 7], &[7]).unwrap(),
        Tensor::zeros(DType::F64, &[0]),
        Tensor::from_bytes(DType::Bool, &[3, 1], vec![1, 0, 1]).unwrap(),
        Tensor::full(7u32, &[2, 2, 2]),
    ]
}

#[test]
fn bytes_round_trip_in_one_memfd() {
    let shm = ShmTransport::new();
    let tensors = sample();
    let copies: Vec<Tensor> = tensors.iter().map(|t| t.deep_copy().unwrap()).collect();
    let exported = block_on(shm.export(1, &tensors)).unwrap();
    assert_eq!(exported.metas.len(), tensors.len());
    assert!(exported.inline.is_empty());

    let h = decode(&exported);
    assert_eq!(h.files.len(), 1, "one object, one memfd");
    assert!(h
        .tensors
        .iter()
        .all(|s| s.file == 0 && s.offset % ALIGN as u64 == 0));

    let got = receive(&shm, &exported).unwrap();
    for (i, ((g, c), p)) in got.iter().zip(&copies).zip(&tensors).enumerate() {
        assert!(
            g.equal(c).unwrap(),
            "tensor #{i} differs from the original bytes"
        );
        assert!(
            p.equal(c).unwrap(),
            "producer tensor #{i} changed when migrated"
        );
        assert!(ShmTransport::is_shm(g) && ShmTransport::is_shm(p));
        assert_eq!(ptr(g) % ALIGN, 0);
    }
}

#[test]
fn writes_are_shared_both_ways() {
    let shm = ShmTransport::new();
    let producer = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
    let clone = producer.clone();
    let exported = block_on(shm.export(1, std::slice::from_ref(&producer))).unwrap();
    let consumer = receive(&shm, &exported).unwrap().remove(0);
    assert!(
        !consumer.shares_storage(&producer),
        "another storage over the same memory"
    );

    consumer.fill_(9.0f32).unwrap();
    assert_eq!(producer.to_vec::<f32>().unwrap(), vec![9.0; 4]);
    assert_eq!(
        clone.to_vec::<f32>().unwrap(),
        vec![9.0; 4],
        "every clone migrated"
    );

    producer.add_scalar_(1.0f32).unwrap();
    assert_eq!(consumer.to_vec::<f32>().unwrap(), vec![10.0; 4]);

    // A second consumer maps the same memory too.
    let second = receive(&shm, &exported).unwrap().remove(0);
    second.fill_(-1.0f32).unwrap();
    assert_eq!(consumer.to_vec::<f32>().unwrap(), vec![-1.0; 4]);
}

#[test]
fn shm_tensors_are_exported_without_a_copy() {
    let shm = ShmTransport::new();
    let a = ShmTransport::alloc(DType::F32, &[4, 4]).unwrap();
    assert!(ShmTransport::is_shm(&a));
    assert_eq!(
        a.to_vec::<f32>().unwrap(),
        vec![0.0; 16],
        "alloc gives zeros"
    );
    a.fill_(3.0f32).unwrap();
    let (id, at) = (a.storage_id(), ptr(&a));
    let (region, _) = shm_place(&a).unwrap();

    let e1 = block_on(shm.export(1, std::slice::from_ref(&a))).unwrap();
    let e2 = block_on(shm.export(2, std::slice::from_ref(&a))).unwrap();
    assert_eq!((a.storage_id(), ptr(&a)), (id, at), "no migration");
    for e in [&e1, &e2] {
        assert_eq!(
            decode(e).files,
            vec![region.handle()],
            "published where it lives"
        );
    }

    // A plain tensor is copied once, on its first export, and never again.
    let b = Tensor::arange::<f64>(10);
    let e3 = block_on(shm.export(3, std::slice::from_ref(&b))).unwrap();
    let after_first = ptr(&b);
    let e4 = block_on(shm.export(4, std::slice::from_ref(&b))).unwrap();
    assert_eq!(ptr(&b), after_first);
    assert_eq!(decode(&e3).files, decode(&e4).files);

    // Mixed: the shm tensor stays where it is, the plain one gets a memfd.
    let c = Tensor::full(1i32, &[3]);
    let e5 = block_on(shm.export(5, &[a.clone(), c.clone(), a.clone()])).unwrap();
    let h5 = decode(&e5);
    assert_eq!(h5.files.len(), 2);
    assert_eq!(h5.files[0], region.handle());
    assert_eq!(
        h5.tensors[0], h5.tensors[2],
        "the same tensor twice is one place"
    );
    let got = receive(&shm, &e5).unwrap();
    assert_eq!(got[0].to_vec::<f32>().unwrap(), vec![3.0; 16]);
    assert_eq!(got[1].to_vec::<i32>().unwrap(), vec![1; 3]);

    // A received tensor is re-exported from the consumer's own mapping.
    let e6 = block_on(shm.export(6, &got[1..2])).unwrap();
    assert_eq!(decode(&e6).files[0].ino, h5.files[1].ino, "same memfd");
    assert_eq!(ptr(&receive(&shm, &e6).unwrap()[0]) % ALIGN, 0);
}

/// Defect 5: `with_bytes`/`with_bytes_mut` put a Rust reference over a
/// mapping that other processes write. They must hand out a private
/// copy instead, and still read and write the shared bytes.
#[test]
fn safe_byte_access_to_shm_never_points_into_the_mapping() {
    let shm = ShmTransport::new();
    let producer = Tensor::from_slice(&[1u32, 2, 3, 4, 5, 6, 7, 8], &[8]).unwrap();
    let e = block_on(shm.export(1, std::slice::from_ref(&producer))).unwrap();
    // Received in this process: another mapping of the same memfd.
    let consumer = receive(&shm, &e).unwrap().remove(0);
    let (theirs, ours) = (mapping_of(&producer), mapping_of(&consumer));
    assert_ne!(theirs, ours, "two mappings");

    // Reads give the bytes, from a copy outside both mappings.
    let want: Vec<u8> = bytemuck::cast_slice(&[1u32, 2, 3, 4, 5, 6, 7, 8]).to_vec();
    for t in [&producer, &consumer] {
        t.with_bytes(|b| {
            assert_eq!(b, &want[..]);
            assert!(!overlaps(b, &theirs) && !overlaps(b, &ours), "a snapshot");
        })
        .unwrap();
    }

    // Writes through a private copy reach the memory: the other mapping
    // sees them.
    consumer
        .with_bytes_mut(|b| {
            assert!(
                !overlaps(b, &theirs) && !overlaps(b, &ours),
                "a staged copy"
            );
            assert_eq!(b, &want[..], "the copy starts as the memory's bytes");
            b[4..8].copy_from_slice(&42u32.to_le_bytes());
        })
        .unwrap();
    assert_eq!(
        producer.to_vec::<u32>().unwrap(),
        vec![1, 42, 3, 4, 5, 6, 7, 8]
    );
    producer
        .with_bytes_mut(|b| b[28..].copy_from_slice(&9u32.to_le_bytes()))
        .unwrap();
    assert_eq!(
        consumer.to_vec::<u32>().unwrap(),
        vec![1, 42, 3, 4, 5, 6, 7, 9]
    );

    // Everything built on the accessors sees the shared bytes too.
    assert_eq!(consumer.sum().unwrap(), 77.0);
    assert!(consumer.equal(&producer).unwrap());
    let copy = consumer.deep_copy().unwrap();
    assert!(!ShmTransport::is_shm(&copy) && copy.equal(&producer).unwrap());
    assert_eq!(consumer.to_bytes().unwrap(), producer.to_bytes().unwrap());

    // The unchecked forms are zero-copy: the caller vouches that no one
    // writes meanwhile (true here: this thread is the only user).
    let (at_consumer, at_producer) = (ptr(&consumer), ptr(&producer));
    // SAFETY: nothing else touches the memfd during these calls.
    unsafe {
        consumer
            .with_bytes_unchecked(|b| {
                assert_eq!(b.as_ptr() as usize, at_consumer);
                assert!(overlaps(b, &ours));
            })
            .unwrap();
        producer
            .with_bytes_mut_unchecked(|b| {
                assert_eq!(b.as_ptr() as usize, at_producer);
                b[..4].copy_from_slice(&0u32.to_le_bytes());
            })
            .unwrap();
    }
    assert_eq!(consumer.to_vec::<u32>().unwrap()[0], 0);
}

#[test]
fn the_same_plain_tensor_twice_is_migrated_once() {
    let shm = ShmTransport::new();
    let t = Tensor::arange::<u64>(3);
    let e = block_on(shm.export(1, &[t.clone(), t.clone()])).unwrap();
    let h = decode(&e);
    assert_eq!(h.tensors[0], h.tensors[1]);
    let got = receive(&shm, &e).unwrap();
    got[1].fill_(5u64).unwrap();
    assert_eq!(t.to_vec::<u64>().unwrap(), vec![5; 3]);
    assert_eq!(got[0].to_vec::<u64>().unwrap(), vec![5; 3]);
}

#[test]
fn malformed_handles_are_errors() {
    let shm = ShmTransport::new();
    let tensors = vec![Tensor::arange::<f32>(8), Tensor::arange::<i16>(3)];
    let e = block_on(shm.export(1, &tensors)).unwrap();
    receive(&shm, &e).unwrap();

    let fails = |e: &Exported, needle: &str| {
        let err = receive(&shm, e).expect_err(needle);
        assert_eq!(err.transport, NAME);
        assert_eq!(err.peer.as_deref(), Some("producer"));
        assert!(err.message.contains(needle), "{err}");
    };
    fails(
        &with_handles(&e, |h| h.tensors[1].offset = 1 << 40),
        "outside",
    );
    fails(&with_handles(&e, |h| h.tensors[1].offset = u64::MAX), "out");
    fails(
        &with_handles(&e, |h| h.tensors[0].len = 4),
        "handle says 4 bytes",
    );
    fails(&with_handles(&e, |h| h.tensors[0].file = 7), "memfd #7");
    fails(
        &with_handles(&e, |h| h.tensors.truncate(1)),
        "handles describe 1",
    );
    fails(
        &with_handles(&e, |h| h.boot_id = "another-kernel".into()),
        "another host",
    );
    if decode(&e).pid_ns.is_some() {
        fails(
            &with_handles(&e, |h| h.pid_ns = h.pid_ns.map(|n| n + 1)),
            "pid namespace",
        );
    }
    fails(&with_handles(&e, |h| h.pid = u32::MAX), "is gone");
    fails(
        &with_handles(&e, |h| h.files[0].ino ^= 1),
        "no longer is the memfd",
    );
    // A descriptor that is not the memfd (stdin, whatever it is under
    // the test harness, or not open at all) is refused before opening.
    let not_ours = with_handles(&e, |h| h.files[0].fd = 0);
    assert!(receive(&shm, &not_ours).is_err());
    fails(
        &Exported {
            handles: vec![0xff; 3],
            ..e.clone()
        },
        "malformed shm handles",
    );

    let mut huge = e.clone();
    huge.metas[0].shape = vec![usize::MAX, 2].into();
    fails(&huge, "more bytes than fit");
    let mut wrong = e.clone();
    wrong.metas[1].dtype = DType::I32;
    fails(&wrong, "handle says 6 bytes");
}

#[test]
fn release_leaves_consumers_their_memory() {
    let shm = ShmTransport::new();
    let mut producer = vec![Tensor::arange::<f32>(1000), Tensor::full(2u8, &[10])];
    let e = block_on(shm.export(1, &producer)).unwrap();
    let got = receive(&shm, &e).unwrap();
    let pinned = decode(&e).files[0].clone();

    block_on(shm.release(1)).unwrap();
    block_on(shm.release(1)).unwrap(); // idempotent
    assert!(shm.exports.lock().is_empty());
    producer.clear(); // the owner's free: its tensors go

    assert_eq!(
        got[0].to_vec::<f32>().unwrap(),
        (0..1000).map(|i| i as f32).collect::<Vec<_>>()
    );
    got[1].fill_(4u8).unwrap();
    assert_eq!(got[1].sum().unwrap(), 40.0);

    // The consumer's tensors still hold the memfd (its own descriptor);
    // the producer's published descriptor is closed, or names another
    // file by now: a late receive fails instead of mapping anything.
    assert_eq!(shm_place(&got[0]).unwrap().0.ino, pinned.ino);
    assert!(receive(&shm, &e).is_err());
    drop(got);
}

/// Invariant 7: the weights-sync pattern (the producer keeps its
/// tensors and passes them again) maps the memfd once per consumer.
#[test]
fn a_kept_tensor_passed_again_reuses_the_consumers_mapping() {
    let shm = ShmTransport::new();
    let mut producer = vec![Tensor::full(3u8, &[1 << 20]), Tensor::arange::<f32>(100)];
    let e1 = block_on(shm.export(1, &producer)).unwrap();
    let first = receive(&shm, &e1).unwrap();
    let mapping = mapping_of(&first[0]);
    assert_ne!(
        mapping,
        mapping_of(&producer[0]),
        "the consumer's own mapping"
    );
    drop(first);
    block_on(shm.release(1)).unwrap();
    assert_eq!(shm.cached_mappings(), 1);

    // Passed again: same memfd, and the consumer's same mapping.
    let e2 = block_on(shm.export(2, &producer)).unwrap();
    assert_eq!(decode(&e2).files, decode(&e1).files);
    assert_eq!(shm.mapping_stats(), (1, 0));
    let second = receive(&shm, &e2).unwrap();
    assert_eq!(shm.mapping_stats(), (1, 1), "no new mapping");
    assert_eq!(mapping_of(&second[0]), mapping);
    assert_eq!(second[0].sum().unwrap(), 3.0 * (1 << 20) as f64);
    second[1].fill_(1.0f32).unwrap();
    assert_eq!(producer[1].sum().unwrap(), 100.0, "still shared memory");

    // Kept while the producer publishes the memfd, even with no
    // tensor here.
    drop(second);
    block_on(shm.release(2)).unwrap();
    shm.housekeeping();
    assert_eq!(shm.cached_mappings(), 1, "the producer still has it");

    // The producer's free: its tensors go, its descriptor closes, and
    // the consumer lets go of the mapping at the next sweep.
    producer.clear();
    shm.housekeeping();
    assert_eq!(shm.cached_mappings(), 0, "nothing publishes it any more");
    assert!(receive(&shm, &e2).is_err(), "a stale handle still fails");
}

#[test]
fn a_mapping_in_use_is_kept_and_a_gone_producers_mappings_are_dropped() {
    let shm = ShmTransport::new();
    let producer = vec![Tensor::full(5u8, &[4096])];
    let e = block_on(shm.export(1, &producer)).unwrap();
    let got = receive(&shm, &e).unwrap();
    block_on(shm.release(1)).unwrap();
    drop(producer);
    // Nothing publishes the memfd now, but a tensor here uses it.
    shm.housekeeping();
    assert_eq!(shm.cached_mappings(), 1);
    assert_eq!(got[0].sum().unwrap(), 5.0 * 4096.0);

    let p2 = vec![Tensor::full(6u8, &[4096])];
    let e2 = block_on(shm.export(2, &p2)).unwrap();
    let got2 = receive(&shm, &e2).unwrap();
    assert_eq!(shm.cached_mappings(), 2);
    shm.peer_gone(peer().actor);
    assert_eq!(shm.cached_mappings(), 0, "the producer's actor is gone");
    assert_eq!(
        got2[0].sum().unwrap(),
        6.0 * 4096.0,
        "tensors keep their mapping"
    );
    assert_eq!(got[0].sum().unwrap(), 5.0 * 4096.0);
}

#[test]
fn cuda_tensors_are_refused() {
    let shm = ShmTransport::new();
    let cuda = Device::Cuda {
        uuid: crate::GpuUuid::from_bytes([0; 16]),
        ordinal: 0,
    };
    let err = shm.check_device(&cuda).unwrap_err();
    assert!(
        err.message.contains("cuda_ipc") && err.message.contains("nixl"),
        "{err}"
    );
    assert_eq!(shm.sidedness(), Sidedness::OneSided);
    assert_eq!(shm.name(), "shm");
}

#[test]
fn an_object_of_no_bytes_round_trips() {
    let shm = ShmTransport::new();
    let e = block_on(shm.export(1, &[Tensor::zeros(DType::F32, &[0, 3])])).unwrap();
    let got = receive(&shm, &e).unwrap();
    assert_eq!(got[0].shape(), &[0, 3]);
    let e = block_on(shm.export(2, &[])).unwrap();
    assert!(receive(&shm, &e).unwrap().is_empty());
}

/// Set in the environment of the child that
/// `another_process_maps_the_producers_memory` starts.
const CHILD: &str = "RDT_SHM_TEST_CHILD";

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
        .collect()
}

/// The producer half of `another_process_maps_the_producers_memory`;
/// does nothing unless that test started it.
#[test]
fn child_producer() {
    if !crate::env::test_child(CHILD) {
        return;
    }
    // Never outlive a parent that failed: our exit ends its wait on
    // our output, and so the test, instead of hanging it.
    std::thread::spawn(|| {
        std::thread::sleep(std::time::Duration::from_secs(60));
        std::process::exit(2);
    });
    let shm = ShmTransport::new();
    let t = Tensor::arange::<f32>(16);
    let e = block_on(shm.export(1, std::slice::from_ref(&t))).unwrap();
    println!("EXPORTED {}", hex(&postcard::to_stdvec(&e).unwrap()));
    // The consumer writes, then says so on our stdin.
    let mut line = String::new();
    std::io::stdin().read_line(&mut line).unwrap();
    println!("SEEN {}", t.sum().unwrap());
}

#[test]
fn another_process_maps_the_producers_memory() {
    use std::io::{BufRead, BufReader, Write};
    use std::process::{Command, Stdio};

    let exe = std::env::current_exe().unwrap();
    let mut child = Command::new(exe)
        .args(["--exact", "shm::tests::child_producer", "--nocapture"])
        .args(["--test-threads", "1"])
        .env(CHILD, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut line_with = |prefix: &str| loop {
        let line = out.next().expect("child output ended").unwrap();
        // The harness may print the test's name on the same line.
        if let Some(at) = line.find(prefix) {
            return line[at + prefix.len()..].to_string();
        }
    };
    let e: Exported = postcard::from_bytes(&unhex(&line_with("EXPORTED "))).unwrap();
    assert_eq!(decode(&e).pid, child.id());

    let shm = ShmTransport::new();
    let got = receive(&shm, &e).unwrap().remove(0);
    assert_eq!(got.sum().unwrap(), (0..16).sum::<i32>() as f64);
    got.fill_(7.0f32).unwrap();
    writeln!(child.stdin.take().unwrap(), "written").unwrap();
    assert_eq!(line_with("SEEN "), "112", "the producer sees our write");
    assert!(child.wait().unwrap().success());

    // The producer is gone; our mapping is not (invariant 5).
    assert_eq!(got.to_vec::<f32>().unwrap(), vec![7.0; 16]);
    let err = receive(&shm, &e).unwrap_err();
    assert!(err.message.contains("is gone"), "{err}");
}
