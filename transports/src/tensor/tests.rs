//! Unit tests of tensors: layout, views, and access to private and shared
//! memory.

use super::*;

/// A tensor is one cache line, its shape 40 bytes of it: a list of
/// 10 000 tensors is 640 KB, written, walked and dropped every pass.
#[test]
fn a_tensor_is_one_cache_line() {
    assert_eq!(std::mem::size_of::<Shape>(), 40);
    assert_eq!(std::mem::size_of::<Tensor>(), 64);
}

/// Not a test: times asking whether an idle CUDA tensor is ready, the
/// stream query under it, and binding the context (needs a GPU;
/// `cargo test --release -- --ignored cuda_ready_timing --nocapture`).
#[test]
#[ignore]
fn cuda_ready_timing() {
    if crate::cuda::available().is_err() {
        println!("no GPU: skipped");
        return;
    }
    let t = Tensor::cuda_zeros(DType::U8, &[4096], 0).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(t.cuda_ready()).unwrap();
    let g = crate::cuda::gpu(0).unwrap();
    let n = 2000;
    let time = |what: &str, f: &mut dyn FnMut()| {
        let t0 = std::time::Instant::now();
        for _ in 0..n {
            f();
        }
        println!(
            "{what}: {:.2} us each",
            t0.elapsed().as_secs_f64() * 1e6 / n as f64
        );
    };
    time("cuda_ready on an idle tensor", &mut || {
        rt.block_on(t.cuda_ready()).unwrap()
    });
    time("stream_idle", &mut || assert!(g.stream_idle().unwrap()));
    time("bind", &mut || g.bind().unwrap());
    // EP-1: what the event pool saves per record.
    time("cuEventCreate + cuEventDestroy", &mut || {
        let e = cudarc::driver::result::event::create(
            cudarc::driver::sys::CUevent_flags::CU_EVENT_DISABLE_TIMING,
        )
        .unwrap();
        // SAFETY: our event, unused.
        unsafe { cudarc::driver::result::event::destroy(e).unwrap() };
    });
    let busy = Tensor::cuda_zeros(DType::U8, &[1 << 20], 0).unwrap();
    time("fill 1 MiB + completion + wait", &mut || {
        busy.fill_(1u8).unwrap();
        let c = g.completion().unwrap();
        rt.block_on(c.wait()).unwrap();
    });
}

/// Not a test: times making 10 000 views of one storage, as a
/// receive's read plan does (`cargo test --release -- --ignored
/// views_timing --nocapture`).
#[test]
#[ignore]
fn views_timing() {
    let flat = Tensor::zeros(DType::U8, &[10_000 * 4096]);
    let kinds: Vec<(DType, Shape)> = vec![(DType::U8, Shape::from(&[4096usize][..]))];
    let at: Vec<usize> = (0..10_000).map(|i| i * 4096).collect();
    let kind_of: Vec<u32> = vec![0; 10_000];
    let (mut best, mut best_clone) = (f64::MAX, f64::MAX);
    for _ in 0..300 {
        let t = std::time::Instant::now();
        let v: Vec<Tensor> = at
            .iter()
            .zip(&kind_of)
            .map(|(&o, &k)| {
                let (d, s) = &kinds[k as usize];
                Tensor::view_of_storage(*d, s.clone(), flat.storage(), o)
            })
            .collect();
        let took = t.elapsed().as_secs_f64() * 1e6;
        std::hint::black_box(&v);
        let t = std::time::Instant::now();
        let c = v.clone();
        let cloned = t.elapsed().as_secs_f64() * 1e6;
        std::hint::black_box(&c);
        drop((v, c));
        best = best.min(took);
        best_clone = best_clone.min(cloned);
    }
    println!("10 000 views: best {best:.1} us; cloned: best {best_clone:.1} us");
}

/// Heap memory posing as external memory, shared or not.
struct TestMemory {
    ptr: *mut u8,
    len: usize,
    shared: Option<bool>,
}
// SAFETY: owned heap memory, accessed as the `ExternalMemory` contract says.
unsafe impl Send for TestMemory {}
// SAFETY: as above.
unsafe impl Sync for TestMemory {}

impl TestMemory {
    fn new(bytes: Vec<u8>, shared: Option<bool>) -> Self {
        let len = bytes.len();
        let ptr = Box::into_raw(bytes.into_boxed_slice()).cast::<u8>();
        TestMemory { ptr, len, shared }
    }
}

impl Drop for TestMemory {
    fn drop(&mut self) {
        // SAFETY: made from a boxed slice of `len` bytes in `new`.
        drop(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(self.ptr, self.len)) });
    }
}

// SAFETY: the test's own heap bytes, alive while it is.
unsafe impl ExternalMemory for TestMemory {
    fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn describe(&self) -> String {
        "test memory".into()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    fn shared_with_other_processes(&self) -> bool {
        // `None`: the trait's default.
        match self.shared {
            Some(s) => s,
            None => ExternalMemory::shared_with_other_processes(&Plain),
        }
    }
}

/// Leaves every provided method of the trait as it is.
struct Plain;
// SAFETY: the test's own heap bytes, alive while it is.
unsafe impl ExternalMemory for Plain {
    fn as_ptr(&self) -> *mut u8 {
        std::ptr::null_mut()
    }
    fn len(&self) -> usize {
        0
    }
    fn describe(&self) -> String {
        String::new()
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

fn external(shared: Option<bool>) -> (Tensor, usize) {
    let mem = TestMemory::new(vec![1, 2, 3, 4], shared);
    let at = mem.ptr as usize;
    let t = Tensor::from_external(DType::U8, &[4], Device::Cpu, Box::new(mem)).unwrap();
    (t, at)
}

#[test]
fn private_memory_is_accessed_in_place() {
    let t = Tensor::from_slice(&[1u8, 2, 3], &[3]).unwrap();
    let a = t.with_bytes(|b| b.as_ptr() as usize).unwrap();
    let b = t.with_bytes_mut(|b| b.as_ptr() as usize).unwrap();
    assert_eq!(a, b, "owned bytes: no copy");

    let (t, at) = external(Some(false));
    assert_eq!(t.with_bytes(|b| b.as_ptr() as usize).unwrap(), at);
    t.with_bytes_mut(|b| {
        assert_eq!(b.as_ptr() as usize, at);
        b[0] = 9;
    })
    .unwrap();
    assert_eq!(t.to_vec::<u8>().unwrap(), vec![9, 2, 3, 4]);
}

#[test]
fn shared_external_memory_is_copied_never_borrowed() {
    // Unknown external memory counts as shared (the sound default).
    for shared in [Some(true), None] {
        let (t, at) = external(shared);
        t.with_bytes(|b| {
            assert_ne!(b.as_ptr() as usize, at, "a snapshot");
            assert_eq!(b, &[1, 2, 3, 4]);
        })
        .unwrap();
        t.with_bytes_mut(|b| {
            assert_ne!(b.as_ptr() as usize, at, "a staged copy");
            b[3] = 40;
        })
        .unwrap();
        t.fill_(7u8).unwrap();
        t.add_scalar_(1u8).unwrap();
        assert_eq!(t.sum().unwrap(), 32.0);
        // The memory itself holds the writes.
        t.with_external(|m| {
            let m = m.unwrap();
            let mut out = [0u8; 4];
            // SAFETY: 4 valid bytes that nothing else touches.
            unsafe { std::ptr::copy_nonoverlapping(m.as_ptr(), out.as_mut_ptr(), 4) };
            assert_eq!(out, [8; 4]);
        });
        assert_eq!(&t.to_bytes().unwrap()[..], &[8; 4]);
        assert!(t.deep_copy().unwrap().equal(&t).unwrap());
        // SAFETY: this thread is the only user of the memory.
        let p = unsafe { t.with_bytes_unchecked(|b| b.as_ptr() as usize) }.unwrap();
        assert_eq!(p, at, "the unchecked form is zero-copy");
    }
}

#[test]
fn to_bytes_of_owned_bytes_is_a_snapshot_without_a_copy() {
    let t = Tensor::full(3u8, &[1 << 16]);
    let at = t.with_bytes(|b| b.as_ptr() as usize).unwrap();
    let b = t.to_bytes().unwrap();
    assert_eq!(
        b.as_ptr() as usize,
        at,
        "owned bytes are handed over, not copied"
    );
    // A write while the snapshot lives copies the storage once and
    // leaves the snapshot as it was.
    t.fill_(4u8).unwrap();
    assert!(b.iter().all(|x| *x == 3));
    assert_eq!(t.to_vec::<u8>().unwrap()[0], 4);
    let moved = t.with_bytes(|b| b.as_ptr() as usize).unwrap();
    assert_ne!(moved, at);
    // Once nothing else holds the bytes, a write takes them back in
    // place.
    let b2 = t.to_bytes().unwrap();
    assert_eq!(b2.as_ptr() as usize, moved);
    drop(b2);
    t.fill_(5u8).unwrap();
    assert_eq!(t.with_bytes(|b| b.as_ptr() as usize).unwrap(), moved);
    assert_eq!(t.sum().unwrap(), 5.0 * (1 << 16) as f64);
}

#[test]
fn a_view_reads_and_writes_its_own_bytes_of_the_storage() {
    let flat = Tensor::arange::<f32>(8);
    let mid = flat.view(8, DType::F32, &[2, 2]).unwrap();
    assert_eq!(mid.byte_offset(), 8);
    assert_eq!(mid.storage_nbytes(), 32);
    assert!(!mid.covers_storage() && flat.covers_storage());
    assert!(mid.shares_storage(&flat));
    assert_eq!(mid.to_vec::<f32>().unwrap(), [2.0, 3.0, 4.0, 5.0]);
    // A view of a view counts from the view's first byte.
    let inner = mid.view(4, DType::F32, &[2]).unwrap();
    assert_eq!(inner.byte_offset(), 12);
    inner.fill_(9.0f32).unwrap();
    assert_eq!(
        flat.to_vec::<f32>().unwrap(),
        [0.0, 1.0, 2.0, 9.0, 9.0, 5.0, 6.0, 7.0]
    );
    // Another dtype over the same bytes.
    let bits = flat.view(12, DType::U32, &[1]).unwrap();
    assert_eq!(bits.to_vec::<u32>().unwrap(), [9.0f32.to_bits()]);
    assert_eq!(mid.sum().unwrap(), 2.0 + 9.0 + 9.0 + 5.0);
    // Same storage, other bytes: not equal without a look at them.
    let a = flat.view(0, DType::F32, &[2]).unwrap();
    let b = flat.view(8, DType::F32, &[2]).unwrap();
    assert!(!a.equal(&b).unwrap());
    assert!(a.equal(&flat.view(0, DType::F32, &[2]).unwrap()).unwrap());
    // A snapshot of a view is its bytes only, and copy-on-write holds.
    let snap = mid.to_bytes().unwrap();
    assert_eq!(snap.len(), 16);
    mid.fill_(0.0f32).unwrap();
    assert_eq!(
        bytemuck::pod_collect_to_vec::<u8, f32>(&snap),
        [2.0, 9.0, 9.0, 5.0]
    );
    assert_eq!(flat.to_vec::<f32>().unwrap()[..3], [0.0, 1.0, 0.0]);
    let copy = mid.deep_copy().unwrap();
    assert!(copy.covers_storage() && copy.nbytes() == 16);
}

#[test]
fn a_view_outside_its_tensor_or_misaligned_is_an_error() {
    let flat = Tensor::arange::<f32>(4);
    let mid = flat.view(4, DType::F32, &[2]).unwrap();
    for (at, shape) in [(0usize, 3usize), (8, 1), (usize::MAX, 1)] {
        let e = mid.view(at, DType::F32, &[shape]).unwrap_err();
        assert!(matches!(e, TensorError::View { .. }), "{e}");
        assert!(e.to_string().contains("does not fit"), "{e}");
    }
    let e = flat.view(2, DType::F32, &[1]).unwrap_err();
    assert!(
        e.to_string()
            .contains("multiple of the view's element size (4)"),
        "{e}"
    );
    // Empty views fit anywhere up to the end.
    assert_eq!(mid.view(8, DType::F32, &[0]).unwrap().nbytes(), 0);
}

#[test]
fn views_of_shared_memory_are_copied_at_their_offset() {
    let (flat, _) = external(Some(true));
    let v = flat.view(1, DType::U8, &[2]).unwrap();
    assert_eq!(v.copy_bytes().unwrap(), [2, 3]);
    assert_eq!(v.with_bytes(<[u8]>::to_vec).unwrap(), [2, 3]);
    v.with_bytes_mut(|b| b.copy_from_slice(&[0xaa, 0xbb]))
        .unwrap();
    assert_eq!(flat.copy_bytes().unwrap(), [1, 0xaa, 0xbb, 4]);
    assert_eq!(
        v.with_external(|e| e.map(|e| (e.offset(), e.len(), e.is_whole()))),
        Some((1, 2, false))
    );
}

#[test]
fn migrating_a_view_moves_its_whole_storage() {
    let flat = Tensor::arange::<u8>(16);
    let v = flat.view(8, DType::U8, &[4]).unwrap();
    let wrong = TestMemory::new(vec![0; 4], Some(false));
    assert!(
        v.migrate_storage(Box::new(wrong)).is_err(),
        "the storage's length, not the view's"
    );
    let mem = TestMemory::new(vec![0; 16], Some(false));
    assert!(v.migrate_storage(Box::new(mem)).unwrap());
    assert_eq!(v.to_vec::<u8>().unwrap(), [8, 9, 10, 11]);
    assert_eq!(flat.to_vec::<u8>().unwrap(), (0..16).collect::<Vec<u8>>());
}

#[test]
fn empty_external_memory_is_fine() {
    let mem = TestMemory::new(Vec::new(), Some(true));
    let t = Tensor::from_external(DType::F32, &[0, 2], Device::Cpu, Box::new(mem)).unwrap();
    assert_eq!(t.with_bytes(<[u8]>::len).unwrap(), 0);
    t.with_bytes_mut(|b| assert!(b.is_empty())).unwrap();
    assert_eq!(t.sum().unwrap(), 0.0);
}

/// `f16` and `bf16` are elements: `full`, `to_vec` and `add_scalar_` take
/// them, and `sum` adds their numbers; `raw_word_sum` is the checksum of
/// their bits.
#[test]
fn half_precision_tensors_hold_numbers_and_sum_them() {
    use half::{bf16, f16};
    let h = Tensor::full(f16::from_f32(1.5), &[4]);
    assert_eq!(h.dtype(), DType::F16);
    assert_eq!(h.to_vec::<f16>().unwrap(), [f16::from_f32(1.5); 4]);
    assert_eq!(h.sum().unwrap(), 6.0, "numbers, not raw words");
    let b = Tensor::full(bf16::from_f32(-2.0), &[3]);
    b.add_scalar_(bf16::from_f32(0.5)).unwrap();
    assert_eq!(b.to_vec::<bf16>().unwrap(), [bf16::from_f32(-1.5); 3]);
    assert_eq!(b.sum().unwrap(), -4.5);
    // The bits: 0xbfc0 is bf16's -1.5.
    assert_eq!(b.raw_word_sum().unwrap(), 3.0 * f64::from(0xbfc0u16));
    let nan = Tensor::full(bf16::NAN, &[2]);
    assert!(nan.sum().unwrap().is_nan());
    assert_eq!(
        nan.raw_word_sum().unwrap(),
        2.0 * f64::from(bf16::NAN.to_bits()),
        "a checksum exact for any bits"
    );
    let e = Tensor::full(1.0f32, &[2]).raw_word_sum().unwrap_err();
    assert!(e.to_string().contains("16-bit floats"), "{e}");
}

#[test]
fn copy_from_copies_once_between_any_host_memories_and_views() {
    // Shared external memory into owned memory and back, at view offsets.
    for shared in [Some(true), Some(false), None] {
        let (ext, _) = external(shared);
        let owned = Tensor::from_slice(&[0u8; 8], &[8]).unwrap();
        let dst = owned.view(2, DType::U8, &[4]).unwrap();
        dst.copy_from(&ext).unwrap();
        assert_eq!(owned.to_vec::<u8>().unwrap(), [0, 0, 1, 2, 3, 4, 0, 0]);
        let src = Tensor::from_slice(&[9u8, 8, 7, 6], &[4]).unwrap();
        ext.copy_from(&src).unwrap();
        assert_eq!(ext.to_vec::<u8>().unwrap(), [9, 8, 7, 6]);
    }
    // Wire bytes (copy on write): the source's other holders keep theirs.
    let wire =
        Tensor::from_shared_bytes(DType::U8, &[3], bytes::Bytes::from_static(&[5, 5, 5])).unwrap();
    let keep = wire.clone();
    wire.copy_from(&Tensor::from_slice(&[1u8, 2, 3], &[3]).unwrap())
        .unwrap();
    assert_eq!(
        keep.to_vec::<u8>().unwrap(),
        [1, 2, 3],
        "clones share the storage"
    );
    // Two views of one storage, overlapping or not.
    let flat = Tensor::arange::<u8>(8);
    let head = flat.view(0, DType::U8, &[4]).unwrap();
    let tail = flat.view(4, DType::U8, &[4]).unwrap();
    tail.copy_from(&head).unwrap();
    assert_eq!(flat.to_vec::<u8>().unwrap(), [0, 1, 2, 3, 0, 1, 2, 3]);
}

#[test]
fn copies_in_opposite_directions_at_once_do_not_deadlock() {
    let a = Tensor::full(1.0f32, &[1024]);
    let b = Tensor::full(2.0f32, &[1024]);
    let (done, finished) = std::sync::mpsc::channel();
    for (dst, src) in [(a.clone(), b.clone()), (b.clone(), a.clone())] {
        let done = done.clone();
        std::thread::spawn(move || {
            for _ in 0..20_000 {
                dst.copy_from(&src).unwrap();
            }
            done.send(()).unwrap();
        });
    }
    for _ in 0..2 {
        finished
            .recv_timeout(std::time::Duration::from_secs(60))
            .expect("both copies end");
    }
}
