//! The bytes behind tensors: [`Storage`] and its memory, [`ExternalMemory`]
//! with raw-pointer copies of it, [`ExternalBytes`], and [`TensorError`].

use super::*;

use crate::cuda;

/// Errors of tensor construction and access.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum TensorError {
    /// The shape and the number of bytes disagree.
    #[error("tensor of dtype {dtype} and shape {shape:?} needs {expected} bytes, but {actual} were given")]
    SizeMismatch {
        /// Element type.
        dtype: DType,
        /// Shape.
        shape: Vec<usize>,
        /// Bytes the shape needs.
        expected: usize,
        /// Bytes present.
        actual: usize,
    },
    /// The element type asked for is not the tensor's.
    #[error("tensor has dtype {actual}, not {expected}")]
    DType {
        /// Asked for.
        expected: DType,
        /// The tensor's.
        actual: DType,
    },
    /// The operation needs host memory.
    #[error("tensor is on {0}; this operation needs a CPU tensor (copy it to the host first)")]
    NotHost(Device),
    /// Two tensors that must agree do not.
    #[error("tensors disagree: {0}")]
    Mismatch(String),
    /// A view asked for bytes outside the tensor it is a view of.
    #[error(
        "a view of {len} bytes at byte offset {offset} does not fit in a tensor of {within} \
         bytes; offsets count from the tensor's first byte and must be a multiple of the \
         view's element size ({align})"
    )]
    View {
        /// The view's offset into the tensor, in bytes.
        offset: usize,
        /// The view's length in bytes.
        len: usize,
        /// The tensor's length in bytes.
        within: usize,
        /// The view's element size.
        align: usize,
    },
    /// A CUDA operation failed or CUDA is not usable here.
    #[error("{0}")]
    Cuda(String),
    /// A tensor cannot go to DLPack, or a DLPack tensor cannot come in.
    #[error("DLPack: {0}")]
    Dlpack(String),
}

impl From<crate::cuda::CudaError> for TensorError {
    fn from(e: crate::cuda::CudaError) -> Self {
        TensorError::Cuda(e.to_string())
    }
}

/// Memory that lives outside the Rust allocator (a shared-memory mapping, a
/// registered buffer). Dropping it releases the memory (unmaps, closes the
/// import, notifies the exporter).
///
/// # Safety
///
/// [`Tensor`]'s safe accessors read and write these bytes through the
/// pointer this gives, so an implementation must make sure that:
/// - [`as_ptr`](Self::as_ptr) and [`len`](Self::len) describe one range of
///   `len` bytes, valid for reads and writes and never moved, from the
///   value's creation until it is dropped (both return the same every
///   time);
/// - the bytes are initialized (any byte pattern is fine: tensors are
///   plain data);
/// - [`shared_with_other_processes`](Self::shared_with_other_processes)
///   returns `true` whenever anything but this process's code under the
///   tensor's storage lock may read or write the bytes (another process, a
///   NIC, a DMA engine, a library's thread): the accessors then copy the
///   bytes out and back with raw copies instead of forming `&[u8]` or
///   `&mut [u8]` over them.
pub unsafe trait ExternalMemory: Send + Sync + 'static {
    /// Start of the bytes.
    fn as_ptr(&self) -> *mut u8;
    /// Number of bytes.
    fn len(&self) -> usize;
    /// Is it empty?
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A short description for debugging (`"shm memfd 3"`).
    fn describe(&self) -> String;
    /// The concrete memory, so that the transport that made it can recognize
    /// its own memory in a tensor (and publish it again without a copy).
    fn as_any(&self) -> &dyn std::any::Any;
    /// May another process read or write these bytes while this process
    /// uses them (a `MAP_SHARED` mapping, say)? Then the safe accessors
    /// ([`Tensor::with_bytes`], [`Tensor::with_bytes_mut`]) never put the
    /// bytes behind a Rust reference, which would be undefined behavior
    /// under a concurrent writer: they copy them with raw-pointer copies.
    ///
    /// The default is `true`, the sound answer for memory of unknown
    /// origin. Return `false` only for memory that nothing outside this
    /// process's storage lock reads or writes.
    fn shared_with_other_processes(&self) -> bool {
        true
    }
}

pub(super) enum Memory {
    Owned(Vec<u8>),
    Shared(Bytes),
    External(Box<dyn ExternalMemory>),
    /// Device memory (CUDA tensors).
    Cuda(Box<dyn DeviceBuffer>),
}

/// The bytes behind one or more tensors.
pub struct Storage {
    pub(super) device: Device,
    pub(super) mem: RwLock<Memory>,
    /// CUDA: the event after which the contents are valid, when they were
    /// written on a stream other than rdt's (see
    /// [`Tensor::produced_on_stream`]); rdt's stream waits on it before its
    /// next use of the memory.
    pub(super) ready: parking_lot::Mutex<Option<Arc<cuda::StreamEvent>>>,
}

impl std::fmt::Debug for Storage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match &*self.mem.read() {
            Memory::Owned(v) => format!("owned {} B", v.len()),
            Memory::Shared(b) => format!("shared {} B", b.len()),
            Memory::External(e) => e.describe(),
            Memory::Cuda(d) => d.describe(),
        };
        write!(f, "Storage({}, {kind})", self.device)
    }
}

impl Storage {
    pub(super) fn host(mem: Memory) -> Arc<Self> {
        Arc::new(Storage {
            device: Device::Cpu,
            mem: RwLock::new(mem),
            ready: parking_lot::Mutex::new(None),
        })
    }

    pub(super) fn len(&self) -> usize {
        match &*self.mem.read() {
            Memory::Owned(v) => v.len(),
            Memory::Shared(b) => b.len(),
            Memory::External(e) => e.len(),
            Memory::Cuda(d) => d.len(),
        }
    }
}

/// The bytes of external memory as a slice.
///
/// # Safety
/// `e` must outlive the slice, and nothing may write the bytes while the
/// slice lives (no other process, no other storage over the same memory,
/// no writer through this storage).
pub(super) unsafe fn external_slice(
    e: &dyn ExternalMemory,
    range: std::ops::Range<usize>,
) -> &[u8] {
    assert!(
        range.end <= e.len(),
        "a tensor's bytes lie within its storage"
    );
    if range.is_empty() {
        // An empty memory may have a dangling (even null) pointer.
        return &[];
    }
    // SAFETY: valid for `len` bytes (the `ExternalMemory` contract), and the
    // range lies within them (asserted); no writer by the caller's
    // guarantee.
    unsafe { std::slice::from_raw_parts(e.as_ptr().add(range.start), range.len()) }
}

/// The bytes of external memory as a mutable slice.
///
/// # Safety
/// `e` must outlive the slice, and nothing else may read or write the bytes
/// while the slice lives.
#[allow(clippy::mut_from_ref)]
pub(super) unsafe fn external_slice_mut(
    e: &dyn ExternalMemory,
    range: std::ops::Range<usize>,
) -> &mut [u8] {
    assert!(
        range.end <= e.len(),
        "a tensor's bytes lie within its storage"
    );
    if range.is_empty() {
        return &mut [];
    }
    // SAFETY: valid for `len` bytes (the `ExternalMemory` contract), and the
    // range lies within them (asserted); the only access by the caller's
    // guarantee.
    unsafe { std::slice::from_raw_parts_mut(e.as_ptr().add(range.start), range.len()) }
}

/// A private copy of external memory, made with a raw-pointer copy: no
/// reference to the memory is formed, so a concurrent writer in another
/// process makes the copy torn, not undefined.
pub(super) fn copy_out(e: &dyn ExternalMemory, range: std::ops::Range<usize>) -> Vec<u8> {
    assert!(
        range.end <= e.len(),
        "a tensor's bytes lie within its storage"
    );
    let len = range.len();
    let mut out = Vec::<u8>::with_capacity(len);
    if len > 0 {
        // SAFETY: the source range lies within the `e.len()` bytes valid
        // while `e` lives (the `ExternalMemory` contract; asserted), the
        // destination has `len` bytes of capacity, and the two do not
        // overlap (`out` is fresh). All `len` bytes are initialized by the
        // copy before `set_len`.
        unsafe {
            let src = e.as_ptr().cast_const().add(range.start);
            std::ptr::copy_nonoverlapping(src, out.as_mut_ptr(), len);
            out.set_len(len);
        }
    }
    out
}

/// Writes `src` over external memory `e` of the same length with a
/// raw-pointer copy (no reference to the memory is formed).
pub(super) fn copy_in(e: &dyn ExternalMemory, at: usize, src: &[u8]) {
    assert!(
        at + src.len() <= e.len(),
        "a staged copy lies within the memory"
    );
    if !src.is_empty() {
        // SAFETY: `e` is valid for `len` bytes while it lives, and
        // `at + src.len()` lies within them (asserted); `src` is private
        // memory, so they do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), e.as_ptr().add(at), src.len()) };
    }
}

/// A tensor's bytes in external memory (what
/// [`Tensor::with_external`] gives): the memory, and where in it the
/// tensor's bytes are.
#[derive(Clone, Copy)]
pub struct ExternalBytes<'a> {
    pub(super) mem: &'a dyn ExternalMemory,
    pub(super) offset: usize,
    pub(super) len: usize,
}

impl<'a> ExternalBytes<'a> {
    /// The whole memory of the storage (a transport downcasts it with
    /// [`ExternalMemory::as_any`] to recognize its own).
    pub fn memory(&self) -> &'a dyn ExternalMemory {
        self.mem
    }
    /// Where the tensor's bytes start in [`memory`](Self::memory).
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// The tensor's first byte.
    pub fn as_ptr(&self) -> *mut u8 {
        self.mem.as_ptr().wrapping_add(self.offset)
    }
    /// The tensor's number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Does the tensor have no bytes?
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// Does the tensor cover the whole memory (not a view of a part)?
    pub fn is_whole(&self) -> bool {
        self.offset == 0 && self.len == self.mem.len()
    }
}
