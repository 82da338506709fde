//! [`Tensor`]: a typed, shaped view of shared storage.
//!
//! # Invariants
//! 1. A tensor is contiguous and row-major: its bytes are the
//!    `shape.product() * dtype.size()` bytes at its byte offset in its
//!    storage, and they lie within the storage. A tensor made by a
//!    constructor covers its whole storage at offset 0; a *view*
//!    ([`Tensor::view`]) covers part of another tensor's bytes. A receive
//!    of many tensors makes them views of one allocation, so each costs a
//!    reference count, not an allocation.
//! 2. Cloning a tensor shares its storage (tensors are mutable and shared, as
//!    in Ray Direct Transport): a write through one clone, or through a
//!    view of the same bytes, is seen by all.
//! 3. Access to host bytes goes through the storage's lock, so concurrent
//!    readers and writers in one process are serialized (no data race); the
//!    order of writes between actors is the user's business, as in RDT.
//!    Memory that other processes may write
//!    ([`ExternalMemory::shared_with_other_processes`]) is never behind a
//!    Rust reference: the safe accessors copy it with raw-pointer copies
//!    (see [`Tensor`]'s "Shared memory" section).
//! 4. Storage received from the wire ([`bytes::Bytes`]) is shared read-only
//!    until the first write, which copies it once (copy on write).

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};

use crate::cuda::{self, DeviceBuffer};
use crate::{DType, Device, Element, Shape};

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

enum Memory {
    Owned(Vec<u8>),
    Shared(Bytes),
    External(Box<dyn ExternalMemory>),
    /// Device memory (CUDA tensors).
    Cuda(Box<dyn DeviceBuffer>),
}

/// The bytes behind one or more tensors.
pub struct Storage {
    device: Device,
    mem: RwLock<Memory>,
    /// CUDA: the event after which the contents are valid, when they were
    /// written on a stream other than rdt's (see
    /// [`Tensor::produced_on_stream`]); rdt's stream waits on it before its
    /// next use of the memory.
    ready: parking_lot::Mutex<Option<Arc<cuda::StreamEvent>>>,
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
    fn host(mem: Memory) -> Arc<Self> {
        Arc::new(Storage {
            device: Device::Cpu,
            mem: RwLock::new(mem),
            ready: parking_lot::Mutex::new(None),
        })
    }

    fn len(&self) -> usize {
        match &*self.mem.read() {
            Memory::Owned(v) => v.len(),
            Memory::Shared(b) => b.len(),
            Memory::External(e) => e.len(),
            Memory::Cuda(d) => d.len(),
        }
    }
}

/// Metadata of a tensor: everything but its bytes. This is what travels
/// through the driver for direct transports.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TensorMeta {
    /// Element type.
    pub dtype: DType,
    /// Shape (row-major, contiguous).
    pub shape: Shape,
    /// Where the storage is.
    pub device: Device,
}

impl TensorMeta {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .unwrap_or(usize::MAX)
    }
    /// Number of bytes (`usize::MAX` if a malformed shape overflows).
    pub fn nbytes(&self) -> usize {
        shape_bytes(self.dtype, &self.shape)
    }
}

/// A contiguous tensor on a device, sharing its storage with its clones.
///
/// # Shared memory
/// A tensor's host bytes may live in memory that other processes map and
/// write too: a tensor received over the `shm` transport, or exported over
/// it (see [`ExternalMemory::shared_with_other_processes`]). For such
/// memory:
/// - [`with_bytes`](Self::with_bytes) (and everything built on it:
///   [`to_vec`](Self::to_vec), [`sum`](Self::sum), [`equal`](Self::equal),
///   [`to_bytes`](Self::to_bytes), [`deep_copy`](Self::deep_copy), sends
///   over `tcp`) reads a *snapshot*: the bytes are copied out with
///   raw-pointer copies and the closure sees the private copy, never the
///   mapping. If another process writes while the copy is made, the
///   snapshot may be torn (part old, part new bytes).
/// - [`with_bytes_mut`](Self::with_bytes_mut) copies the bytes out, lets
///   the closure change the copy and copies all of it back, again with
///   raw-pointer copies. A concurrent write by another process to the same
///   range may be lost or mixed with this one.
/// - Ordering writes between processes (so that a reader sees a whole
///   update) is the user's business, as in Ray Direct Transport: the
///   storage's lock orders accesses within this process only.
///
/// Plain host memory (owned or received bytes) is read and written in
/// place, with no copy. A caller that knows that no other process touches
/// the memory for the duration can skip the copy with the `unsafe`
/// [`with_bytes_unchecked`](Self::with_bytes_unchecked) and
/// [`with_bytes_mut_unchecked`](Self::with_bytes_mut_unchecked).
#[derive(Clone)]
pub struct Tensor {
    dtype: DType,
    shape: Shape,
    storage: Arc<Storage>,
    /// Where the tensor's bytes start in the storage (invariant 1).
    offset: usize,
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tensor")
            .field("dtype", &self.dtype)
            .field("shape", &self.shape)
            .field("offset", &self.offset)
            .field("storage", &self.storage)
            .finish()
    }
}

/// Bytes a shape needs, or `usize::MAX` if that overflows (a shape from the
/// wire may be anything; it must fail the size check, not panic).
fn shape_bytes(dtype: DType, shape: &[usize]) -> usize {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .unwrap_or(usize::MAX)
}

fn check_size(dtype: DType, shape: &[usize], actual: usize) -> Result<(), TensorError> {
    let expected = shape_bytes(dtype, shape);
    if expected != actual {
        return Err(TensorError::SizeMismatch {
            dtype,
            shape: shape.to_vec(),
            expected,
            actual,
        });
    }
    Ok(())
}

impl Tensor {
    /// A CPU tensor that takes ownership of `bytes`.
    pub fn from_bytes(dtype: DType, shape: &[usize], bytes: Vec<u8>) -> Result<Self, TensorError> {
        check_size(dtype, shape, bytes.len())?;
        Ok(Self::with_storage(
            dtype,
            shape,
            Storage::host(Memory::Owned(bytes)),
        ))
    }

    /// A CPU tensor sharing `bytes` read-only until its first write
    /// (invariant 4). No copy is made here.
    pub fn from_shared_bytes(
        dtype: DType,
        shape: &[usize],
        bytes: Bytes,
    ) -> Result<Self, TensorError> {
        check_size(dtype, shape, bytes.len())?;
        Ok(Self::with_storage(
            dtype,
            shape,
            Storage::host(Memory::Shared(bytes)),
        ))
    }

    /// A tensor over external memory (a shared-memory mapping, say). The
    /// memory is released when the last tensor sharing it is dropped.
    pub fn from_external(
        dtype: DType,
        shape: &[usize],
        device: Device,
        mem: Box<dyn ExternalMemory>,
    ) -> Result<Self, TensorError> {
        check_size(dtype, shape, mem.len())?;
        let storage = Arc::new(Storage {
            device,
            mem: RwLock::new(Memory::External(mem)),
            ready: parking_lot::Mutex::new(None),
        });
        Ok(Self::with_storage(dtype, shape, storage))
    }

    fn with_storage(dtype: DType, shape: &[usize], storage: Arc<Storage>) -> Self {
        Tensor {
            dtype,
            shape: shape.into(),
            storage,
            offset: 0,
        }
    }

    /// A view of part of this tensor's bytes: `nbytes(dtype, shape)` bytes
    /// starting `byte_offset` bytes into this tensor, read as `dtype` and
    /// `shape`. No byte is copied: the view shares this tensor's storage,
    /// so a write through either is seen by both, and the storage lives as
    /// long as any view of it.
    ///
    /// This is how a flat buffer holds many tensors (the parameters of a
    /// model packed into one allocation, say): a transport moves views of
    /// one storage that lie next to each other as one range, and a receive
    /// of many tensors gives back views of one allocation.
    ///
    /// Errors if the view does not lie within this tensor, or if
    /// `byte_offset` is not a multiple of `dtype`'s size.
    ///
    /// ```
    /// use rdt_transport::{DType, Tensor};
    /// let flat = Tensor::arange::<f32>(6);
    /// let tail = flat.view(8, DType::F32, &[2, 2]).unwrap();
    /// assert_eq!(tail.to_vec::<f32>().unwrap(), [2.0, 3.0, 4.0, 5.0]);
    /// tail.fill_(7.0f32).unwrap();
    /// assert_eq!(flat.to_vec::<f32>().unwrap(), [0.0, 1.0, 7.0, 7.0, 7.0, 7.0]);
    /// ```
    pub fn view(
        &self,
        byte_offset: usize,
        dtype: DType,
        shape: &[usize],
    ) -> Result<Self, TensorError> {
        let len = shape_bytes(dtype, shape);
        let within = self.nbytes();
        let fits = byte_offset
            .checked_add(len)
            .is_some_and(|end| end <= within);
        if !fits || byte_offset % dtype.size() != 0 {
            return Err(TensorError::View {
                offset: byte_offset,
                len,
                within,
                align: dtype.size(),
            });
        }
        Ok(Tensor {
            dtype,
            shape: shape.into(),
            storage: self.storage.clone(),
            offset: self.offset + byte_offset,
        })
    }

    /// A view at `offset` of `storage` (the caller checked that it fits).
    /// The shape is taken whole: a copy of an inline one is a copy of its
    /// 40 bytes, where building it from a slice went dimension by
    /// dimension (10 000 tensors a pass, made as a call decodes them).
    pub(crate) fn view_of_storage(
        dtype: DType,
        shape: Shape,
        storage: &Arc<Storage>,
        offset: usize,
    ) -> Self {
        debug_assert!(offset + shape_bytes(dtype, &shape) <= storage.len());
        Tensor {
            dtype,
            shape,
            storage: storage.clone(),
            offset,
        }
    }

    /// Where this tensor's bytes start in its storage: 0 for a tensor made
    /// by a constructor, the view's offset for a [`view`](Self::view).
    #[inline]
    pub fn byte_offset(&self) -> usize {
        self.offset
    }

    /// The number of bytes of the whole storage this tensor is a view of
    /// (its own [`nbytes`](Self::nbytes) unless it is a view of a part).
    pub fn storage_nbytes(&self) -> usize {
        self.storage.len()
    }

    /// Does this tensor cover its whole storage (not a view of a part)?
    pub fn covers_storage(&self) -> bool {
        self.offset == 0 && self.nbytes() == self.storage.len()
    }

    /// The storage, for a receive that makes many views of one allocation.
    pub(crate) fn storage(&self) -> &Arc<Storage> {
        &self.storage
    }

    /// The byte range of this tensor in its storage.
    fn range(&self) -> std::ops::Range<usize> {
        self.offset..self.offset + self.nbytes()
    }

    /// Another tensor over this one's storage, as `dtype` and `shape` of
    /// the same number of bytes (tests of code that tells views apart).
    #[cfg(test)]
    pub(crate) fn view_as(&self, dtype: DType, shape: &[usize]) -> Self {
        check_size(dtype, shape, self.nbytes()).expect("a view of the same bytes");
        Self::with_storage(dtype, shape, self.storage.clone())
    }

    /// A CPU tensor holding a copy of `data`.
    pub fn from_slice<T: Element>(data: &[T], shape: &[usize]) -> Result<Self, TensorError> {
        Self::from_bytes(T::DTYPE, shape, bytemuck::cast_slice(data).to_vec())
    }

    /// A CPU tensor of zeros.
    pub fn zeros(dtype: DType, shape: &[usize]) -> Self {
        let n = shape.iter().product::<usize>() * dtype.size();
        Self::from_bytes(dtype, shape, vec![0u8; n]).expect("size computed from shape")
    }

    /// A CPU tensor with every element equal to `value`.
    pub fn full<T: Element>(value: T, shape: &[usize]) -> Self {
        let n: usize = shape.iter().product();
        Self::from_slice(&vec![value; n], shape).expect("size computed from shape")
    }

    /// A CPU tensor `0, 1, 2, ...` of `n` elements.
    pub fn arange<T: Element>(n: usize) -> Self {
        let v: Vec<T> = (0..n).map(|i| T::from_f64(i as f64)).collect();
        Self::from_slice(&v, &[n]).expect("size computed from shape")
    }

    // The accessors are `#[inline]`: a method that walks the 10 000
    // tensors of a weights object calls them once per tensor, from another
    // crate, where a call each cost more than the work (dev VM: summing
    // 10 000 `nbytes` took 20 µs through calls, 14 µs inlined).

    /// Element type.
    #[inline]
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    /// Shape.
    #[inline]
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    /// Number of elements.
    #[inline]
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
    /// Number of bytes.
    #[inline]
    pub fn nbytes(&self) -> usize {
        self.numel() * self.dtype.size()
    }
    /// Device of the storage.
    #[inline]
    pub fn device(&self) -> &Device {
        &self.storage.device
    }
    /// Everything but the bytes.
    pub fn meta(&self) -> TensorMeta {
        TensorMeta {
            dtype: self.dtype,
            shape: self.shape.clone(),
            device: self.storage.device,
        }
    }

    /// An identifier of the storage, equal for tensors that share bytes in
    /// this process. Used to check that a hand-over made no copy.
    pub fn storage_id(&self) -> usize {
        Arc::as_ptr(&self.storage) as usize
    }

    /// Do the two tensors share storage?
    pub fn shares_storage(&self, other: &Tensor) -> bool {
        Arc::ptr_eq(&self.storage, &other.storage)
    }

    /// How many tensors (clones) share this storage right now, this one
    /// included. Stores use it to tell whether anyone else still holds it.
    pub fn storage_refs(&self) -> usize {
        Arc::strong_count(&self.storage)
    }

    /// Calls `f` with this tensor's bytes in the storage's external
    /// memory, or `None` if the storage is not external, under the
    /// storage's read lock. A transport uses it to recognize memory it made
    /// itself ([`ExternalBytes::memory`] and [`ExternalMemory::as_any`]).
    pub fn with_external<R>(&self, f: impl FnOnce(Option<ExternalBytes<'_>>) -> R) -> R {
        match &*self.storage.mem.read() {
            Memory::External(e) => f(Some(ExternalBytes {
                mem: e.as_ref(),
                offset: self.offset,
                len: self.nbytes(),
            })),
            Memory::Owned(_) | Memory::Shared(_) | Memory::Cuda(_) => f(None),
        }
    }

    /// Moves a host storage into `mem`: under the storage's write lock, the
    /// current bytes are copied into `mem`, which then becomes the storage's
    /// memory. Every clone of this tensor, and every view of its storage,
    /// shares the storage, so all of them live in `mem` afterwards (a
    /// transport uses this to put a producer's tensors into memory that
    /// consumers map). `mem` has the whole storage's length
    /// ([`storage_nbytes`](Self::storage_nbytes)), and this tensor's bytes
    /// are at its [`byte_offset`](Self::byte_offset) in it.
    ///
    /// Returns `Ok(true)` if the storage moved, and `Ok(false)`, leaving it
    /// as it is, if it already is external memory: whoever made that memory
    /// may have published it, and dropping it would pull it from under them.
    /// Errors if the tensor is not on the host or `mem` has the wrong size.
    pub fn migrate_storage(&self, mem: Box<dyn ExternalMemory>) -> Result<bool, TensorError> {
        self.require_host()?;
        if mem.len() != self.storage.len() {
            return Err(TensorError::Mismatch(format!(
                "moving a storage of {} bytes into memory of {} bytes",
                self.storage.len(),
                mem.len()
            )));
        }
        let mut guard = self.storage.mem.write();
        let src: &[u8] = match &*guard {
            Memory::Owned(v) => v,
            Memory::Shared(b) => b,
            Memory::External(_) | Memory::Cuda(_) => return Ok(false),
        };
        // An empty memory may have a dangling (even null) pointer: nothing to
        // copy, and no slice may be made of it.
        if !src.is_empty() {
            // SAFETY: `mem` is valid for `mem.len()` bytes while it lives (the
            // `ExternalMemory` contract), and the size check above makes `src`
            // and `mem` the same length; `src` is private memory
            // of this storage, so the two do not overlap. A raw copy forms no
            // reference over `mem`, which may be shared with other processes.
            unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), mem.as_ptr(), src.len()) };
        }
        *guard = Memory::External(mem);
        Ok(true)
    }

    /// Calls `f` with the host bytes.
    ///
    /// Private memory is read in place, under the storage's read lock (no
    /// copy). Memory shared with other processes is read as a snapshot:
    /// copied out with raw-pointer copies into a private buffer, which is
    /// what `f` sees; it may be torn if another process writes meanwhile
    /// (see the type's "Shared memory" section).
    pub fn with_bytes<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R, TensorError> {
        self.require_host()?;
        let range = self.range();
        let mem = self.storage.mem.read();
        match &*mem {
            Memory::Owned(v) => Ok(f(&v[range])),
            Memory::Shared(b) => Ok(f(&b[range])),
            Memory::External(e) if !e.shared_with_other_processes() => {
                // SAFETY: the memory is valid for `len` bytes while it lives,
                // and it lives while `mem` (the read guard) is held; it is not
                // shared with other processes (the `ExternalMemory` contract),
                // and the read guard excludes writers in this process.
                Ok(f(unsafe { external_slice(e.as_ref(), range) }))
            }
            Memory::External(e) => {
                let snapshot = copy_out(e.as_ref(), range);
                drop(mem);
                Ok(f(&snapshot))
            }
            Memory::Cuda(_) => unreachable!("require_host rejects CUDA storage"),
        }
    }

    /// Calls `f` with the host bytes to change them, under the storage's
    /// write lock (copying shared wire bytes first, invariant 4). Every
    /// clone sees the write.
    ///
    /// Private memory is written in place. Memory shared with other
    /// processes is copied out with raw-pointer copies, `f` changes the
    /// private copy, and all of it is copied back the same way (see the
    /// type's "Shared memory" section).
    pub fn with_bytes_mut<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> Result<R, TensorError> {
        self.require_host()?;
        let range = self.range();
        let mut mem = self.storage.mem.write();
        if let Memory::External(e) = &*mem {
            if e.shared_with_other_processes() {
                let mut staged = copy_out(e.as_ref(), range.clone());
                let r = f(&mut staged);
                copy_in(e.as_ref(), range.start, &staged);
                return Ok(r);
            }
        }
        // SAFETY: the memory is private (just checked), and the write guard
        // excludes every other access through this storage.
        Ok(f(&mut unsafe { private_slice_mut(&mut mem) }[range]))
    }

    /// Calls `f` with the host bytes in place, with no copy, whatever the
    /// memory: the zero-copy form of [`with_bytes`](Self::with_bytes).
    ///
    /// # Safety
    /// If the storage is memory shared with other processes
    /// ([`ExternalMemory::shared_with_other_processes`]), the caller
    /// guarantees that for as long as `f` runs no other process (nor
    /// another storage over the same memory in this process) writes any of
    /// the tensor's bytes: `f` gets a `&[u8]` over them, and a concurrent
    /// write under a shared reference is undefined behavior. For private
    /// memory this is always true, and the call is as safe as
    /// [`with_bytes`](Self::with_bytes).
    pub unsafe fn with_bytes_unchecked<R>(
        &self,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, TensorError> {
        self.require_host()?;
        let range = self.range();
        let mem = self.storage.mem.read();
        let bytes: &[u8] = match &*mem {
            Memory::Owned(v) => &v[range],
            Memory::Shared(b) => &b[range],
            // SAFETY: valid while `mem` is held; no concurrent writer by the
            // caller's guarantee.
            Memory::External(e) => unsafe { external_slice(e.as_ref(), range) },
            Memory::Cuda(_) => unreachable!("require_host rejects CUDA storage"),
        };
        Ok(f(bytes))
    }

    /// Calls `f` with the host bytes in place to change them, with no copy,
    /// whatever the memory: the zero-copy form of
    /// [`with_bytes_mut`](Self::with_bytes_mut).
    ///
    /// # Safety
    /// If the storage is memory shared with other processes
    /// ([`ExternalMemory::shared_with_other_processes`]), the caller
    /// guarantees that for as long as `f` runs no other process (nor
    /// another storage over the same memory in this process) reads or
    /// writes any of the tensor's bytes: `f` gets a `&mut [u8]` over them,
    /// which must be the only access. For private memory this is always
    /// true, and the call is as safe as
    /// [`with_bytes_mut`](Self::with_bytes_mut).
    pub unsafe fn with_bytes_mut_unchecked<R>(
        &self,
        f: impl FnOnce(&mut [u8]) -> R,
    ) -> Result<R, TensorError> {
        self.require_host()?;
        let range = self.range();
        let mut mem = self.storage.mem.write();
        if let Memory::External(e) = &*mem {
            // SAFETY: valid while the write guard is held, which excludes
            // every access through this storage; no other access by the
            // caller's guarantee.
            return Ok(f(unsafe { external_slice_mut(e.as_ref(), range) }));
        }
        // SAFETY: not external, so private.
        Ok(f(&mut unsafe { private_slice_mut(&mut mem) }[range]))
    }

    /// A private copy of the host bytes: one copy whatever the memory (a
    /// raw-pointer copy for memory shared with other processes).
    pub(crate) fn copy_bytes(&self) -> Result<Vec<u8>, TensorError> {
        self.require_host()?;
        if let Memory::External(e) = &*self.storage.mem.read() {
            if e.shared_with_other_processes() {
                return Ok(copy_out(e.as_ref(), self.range()));
            }
        }
        self.with_bytes(<[u8]>::to_vec)
    }

    /// The bytes as an immutable [`Bytes`] (a snapshot: later writes to
    /// the tensor do not change it). No copy for private host memory:
    /// wire bytes are shared as they are, and owned bytes become wire
    /// bytes in place, so the storage turns copy-on-write (invariant 4:
    /// the next write through any clone copies them once, or not at all if
    /// nothing else holds the `Bytes` by then). Memory shared with other
    /// processes is copied.
    pub fn to_bytes(&self) -> Result<Bytes, TensorError> {
        self.require_host()?;
        let range = self.range();
        if let Memory::Shared(b) = &*self.storage.mem.read() {
            return Ok(b.slice(range));
        }
        {
            let mut mem = self.storage.mem.write();
            match &mut *mem {
                // Raced with another `to_bytes`.
                Memory::Shared(b) => return Ok(b.slice(range)),
                Memory::Owned(v) => {
                    let b = Bytes::from(std::mem::take(v));
                    *mem = Memory::Shared(b.clone());
                    return Ok(b.slice(range));
                }
                Memory::External(_) | Memory::Cuda(_) => {}
            }
        }
        self.copy_bytes().map(Bytes::from)
    }

    fn require_host(&self) -> Result<(), TensorError> {
        if !self.storage.device.is_cpu() {
            return Err(TensorError::NotHost(self.storage.device));
        }
        debug_assert!(self.offset + self.nbytes() <= self.storage.len());
        Ok(())
    }

    fn require_dtype<T: Element>(&self) -> Result<(), TensorError> {
        if T::DTYPE != self.dtype {
            return Err(TensorError::DType {
                expected: T::DTYPE,
                actual: self.dtype,
            });
        }
        Ok(())
    }

    /// Copies the elements out.
    pub fn to_vec<T: Element>(&self) -> Result<Vec<T>, TensorError> {
        self.require_dtype::<T>()?;
        self.with_bytes(|b| bytemuck::pod_collect_to_vec::<u8, T>(b))
    }

    /// Sets every element to `value`.
    pub fn fill_<T: Element>(&self, value: T) -> Result<(), TensorError> {
        self.require_dtype::<T>()?;
        if self.is_cuda() {
            // Enqueued on the GPU's stream: ordered before later ops, copies
            // and transfers of this process.
            return Ok(self.with_device_buffer(|d| {
                d.gpu()
                    .fill(d.device_ptr(), d.len(), bytemuck::bytes_of(&value))
            })??);
        }
        self.with_bytes_mut(|b| {
            let one = bytemuck::bytes_of(&value);
            for chunk in b.chunks_exact_mut(one.len()) {
                chunk.copy_from_slice(one);
            }
        })
    }

    /// Adds `value` to every element.
    pub fn add_scalar_<T: Element>(&self, value: T) -> Result<(), TensorError> {
        self.require_dtype::<T>()?;
        self.with_bytes_mut(|b| {
            let size = std::mem::size_of::<T>();
            for chunk in b.chunks_exact_mut(size) {
                let x: T = bytemuck::pod_read_unaligned(chunk);
                let y = T::from_f64(x.to_f64() + value.to_f64());
                chunk.copy_from_slice(bytemuck::bytes_of(&y));
            }
        })
    }

    /// Sum of all elements, as `f64`, for any numeric element type (`F16`
    /// and `BF16`: the raw 16-bit words, a checksum).
    ///
    /// A CUDA tensor is summed on its device by an NVRTC-compiled kernel
    /// (see [`cuda::ops`]; blocks until the result is back; the order of
    /// additions differs from the host's, so a floating-point sum may
    /// differ in its last bits). Without NVRTC it is copied to the host
    /// first; [`cuda::ops::nvrtc_available`] says which.
    pub fn sum(&self) -> Result<f64, TensorError> {
        if self.is_cuda() {
            if cuda::ops::nvrtc_available().is_ok() {
                let n = self.numel();
                let dtype = self.dtype;
                return Ok(self.with_device_buffer(|d| {
                    cuda::ops::sum(d.gpu(), dtype, d.device_ptr(), n)
                })??);
            }
            return self.to_cpu()?.sum();
        }
        macro_rules! sum_as {
            ($t:ty, $b:expr) => {
                // Aligned storage (the usual case) is read in place.
                match bytemuck::try_cast_slice::<u8, $t>($b) {
                    Ok(v) => v.iter().map(|&x| x as f64).sum::<f64>(),
                    Err(_) => $b
                        .chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| bytemuck::pod_read_unaligned::<$t>(c) as f64)
                        .sum::<f64>(),
                }
            };
        }
        let dtype = self.dtype;
        self.with_bytes(|b| match dtype {
            DType::F32 => sum_as!(f32, b),
            DType::F64 => sum_as!(f64, b),
            DType::I8 => sum_as!(i8, b),
            DType::I16 => sum_as!(i16, b),
            DType::I32 => sum_as!(i32, b),
            DType::I64 => sum_as!(i64, b),
            DType::U8 | DType::Bool => sum_as!(u8, b),
            DType::U32 => sum_as!(u32, b),
            DType::U64 => sum_as!(u64, b),
            // Storage-only types: sum the raw 16-bit words; good enough for
            // checksums, documented as such.
            DType::F16 | DType::BF16 => sum_as!(u16, b),
        })
    }

    /// Are dtype, shape and bytes identical?
    pub fn equal(&self, other: &Tensor) -> Result<bool, TensorError> {
        if self.dtype != other.dtype || self.shape != other.shape {
            return Ok(false);
        }
        if self.shares_storage(other) && self.offset == other.offset {
            return Ok(true);
        }
        if self.is_cuda() && other.is_cuda() && cuda::ops::nvrtc_available().is_ok() {
            // On the device: `other` is brought to `self`'s GPU first when
            // it lives on another one.
            let here = self.with_device_buffer(|d| d.gpu().clone())?;
            let there = other.with_device_buffer(|d| d.gpu().clone())?;
            let other = if Arc::ptr_eq(&here, &there) {
                other.clone()
            } else {
                other.to_device(here.ordinal())?
            };
            let b = other.with_device_buffer(|d| d.device_ptr())?;
            let diff = self.with_device_buffer(|d| {
                cuda::ops::count_differences(d.gpu(), d.device_ptr(), b, d.len())
            })??;
            return Ok(diff == 0);
        }
        if self.is_cuda() || other.is_cuda() {
            let a = if self.is_cuda() {
                self.to_cpu()?
            } else {
                self.clone()
            };
            let b = if other.is_cuda() {
                other.to_cpu()?
            } else {
                other.clone()
            };
            return a.equal(&b);
        }
        let a = self.to_bytes()?;
        other.with_bytes(|b| a[..] == b[..])
    }

    /// Is the storage CUDA device memory?
    pub fn is_cuda(&self) -> bool {
        matches!(self.storage.device, Device::Cuda { .. })
    }

    /// A tensor over device memory. `device` names where the memory lives
    /// (the producer's device for memory mapped from another process).
    pub fn from_device_buffer(
        dtype: DType,
        shape: &[usize],
        device: Device,
        buf: Box<dyn DeviceBuffer>,
    ) -> Result<Self, TensorError> {
        if device.is_cpu() {
            return Err(TensorError::Cuda(
                "device memory needs a CUDA device, not cpu".into(),
            ));
        }
        check_size(dtype, shape, buf.len())?;
        let storage = Arc::new(Storage {
            device,
            mem: RwLock::new(Memory::Cuda(buf)),
            ready: parking_lot::Mutex::new(None),
        });
        Ok(Self::with_storage(dtype, shape, storage))
    }

    /// Calls `f` with the storage's device memory; errors on host tensors.
    /// Every rdt use of a CUDA tensor's memory goes through here: if the
    /// contents were produced on another stream
    /// ([`produced_on_stream`](Self::produced_on_stream)), rdt's stream is
    /// made to wait for that first (on the GPU, no host sync).
    pub fn with_device_buffer<R>(
        &self,
        f: impl FnOnce(&DeviceBytes<'_>) -> R,
    ) -> Result<R, TensorError> {
        match &*self.storage.mem.read() {
            Memory::Cuda(d) => {
                if let Some(ev) = self.storage.ready.lock().take() {
                    // Passed already (a transfer that landed): nothing to
                    // wait for, and rdt's stream stays idle.
                    if !ev.passed().unwrap_or(false) {
                        d.gpu().wait_stream_event(&ev)?;
                    }
                }
                Ok(f(&DeviceBytes {
                    buf: d.as_ref(),
                    offset: self.offset,
                    len: self.nbytes(),
                }))
            }
            _ => Err(TensorError::Cuda(format!(
                "tensor is on {}, not on a CUDA device",
                self.storage.device
            ))),
        }
    }

    /// The tensor's contents become valid when the work enqueued so far on
    /// `stream` completes (a stream of another library: the tensor was
    /// written there). The tensor carries that point as an event; rdt's
    /// next use of it (an export to another actor, a transfer, an op) waits
    /// for it on the GPU, without a host sync.
    ///
    /// # Safety
    /// `stream` must be a live CUDA stream of this process, in the context
    /// of this tensor's device (its primary context, which rdt uses too).
    pub unsafe fn produced_on_stream(
        &self,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), TensorError> {
        let ev = {
            let mem = self.storage.mem.read();
            let Memory::Cuda(d) = &*mem else {
                return Err(TensorError::NotHost(self.storage.device));
            };
            // SAFETY: forwarded from the caller.
            unsafe { d.gpu().record_on_stream(stream) }?
        };
        // A newer point replaces an older one: it comes later on the same
        // stream, or the caller says this one is what counts.
        *self.storage.ready.lock() = Some(Arc::new(ev));
        Ok(())
    }

    /// The tensor's contents become valid when the GPU passes `ev` (a
    /// transport's done event, shared by every tensor of one transfer).
    /// Like [`produced_on_stream`](Self::produced_on_stream), but with an
    /// event recorded already.
    pub(crate) fn set_ready_event(&self, ev: Arc<cuda::StreamEvent>) {
        *self.storage.ready.lock() = Some(ev);
    }

    /// Has the GPU passed the point after which the contents are valid, as
    /// far as this tensor records one (an event of another stream: a
    /// transfer that is still writing it, or a library's kernel)? True for
    /// CPU tensors and for tensors with no such point pending. Work
    /// enqueued on rdt's stream is not looked at: use
    /// [`cuda_ready`](Self::cuda_ready) to wait for everything.
    pub fn ready_event_passed(&self) -> Result<bool, TensorError> {
        match &*self.storage.ready.lock() {
            Some(ev) => Ok(ev.passed()?),
            None => Ok(true),
        }
    }

    /// Orders `stream` (another library's) after every rdt operation on
    /// this tensor so far, a transfer that received it included: work
    /// enqueued on `stream` afterwards sees the contents. On the GPU, no
    /// host sync; nothing is enqueued when rdt's stream is idle.
    ///
    /// # Safety
    /// `stream` must be a live CUDA stream of this process, in the context
    /// of this tensor's device.
    pub unsafe fn ready_on_stream(
        &self,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), TensorError> {
        self.with_device_buffer(|d| {
            // SAFETY: forwarded from the caller.
            unsafe { d.gpu().order_stream_after_rdt(stream) }
        })??;
        Ok(())
    }

    /// An uninitialized CUDA tensor on local device `ordinal`, in
    /// exportable memory (see [`cuda::alloc`]).
    pub fn cuda_empty(dtype: DType, shape: &[usize], ordinal: usize) -> Result<Self, TensorError> {
        let n = Self::byte_size(dtype, shape)?;
        let gpu = cuda::gpu(ordinal)?;
        let range = cuda::alloc::alloc(&gpu, n)?;
        Self::from_device_buffer(dtype, shape, gpu.device(), Box::new(range))
    }

    /// Like [`cuda_empty`](Self::cuda_empty), for a transfer's stream to
    /// write: also whether the memory is clean (rdt's stream passed every
    /// earlier use of it), so that the stream need not wait for rdt's
    /// (`cuda::alloc`, invariant 5).
    pub(crate) fn cuda_empty_for_other_stream(
        dtype: DType,
        shape: &[usize],
        ordinal: usize,
    ) -> Result<(Self, bool), TensorError> {
        let n = Self::byte_size(dtype, shape)?;
        let gpu = cuda::gpu(ordinal)?;
        let (range, clean) = cuda::alloc::alloc_for_other_stream(&gpu, n)?;
        let t = Self::from_device_buffer(dtype, shape, gpu.device(), Box::new(range))?;
        Ok((t, clean))
    }

    /// Bytes of a contiguous tensor of `dtype` and `shape`.
    fn byte_size(dtype: DType, shape: &[usize]) -> Result<usize, TensorError> {
        match shape_bytes(dtype, shape) {
            usize::MAX => Err(TensorError::Cuda(format!("shape {shape:?} is too large"))),
            n => Ok(n),
        }
    }

    /// A CUDA tensor of zeros on local device `ordinal`.
    pub fn cuda_zeros(dtype: DType, shape: &[usize], ordinal: usize) -> Result<Self, TensorError> {
        let t = Self::cuda_empty(dtype, shape, ordinal)?;
        t.with_device_buffer(|d| d.gpu().fill(d.device_ptr(), d.len(), &[0]))??;
        Ok(t)
    }

    /// A CUDA tensor with every element equal to `value`, on local device
    /// `ordinal`.
    pub fn cuda_full<T: Element>(
        value: T,
        shape: &[usize],
        ordinal: usize,
    ) -> Result<Self, TensorError> {
        let t = Self::cuda_empty(T::DTYPE, shape, ordinal)?;
        t.fill_(value)?;
        Ok(t)
    }

    /// A CUDA tensor of random values from `seed` on local device
    /// `ordinal` (see [`uniform_`](Self::uniform_)).
    pub fn cuda_rand(
        dtype: DType,
        shape: &[usize],
        ordinal: usize,
        seed: u64,
    ) -> Result<Self, TensorError> {
        let t = Self::cuda_empty(dtype, shape, ordinal)?;
        t.uniform_(seed)?;
        Ok(t)
    }

    /// Fills a CUDA tensor with random values from `seed` with cuRAND, on
    /// its device's stream: uniform in (0, 1] for `F32` and `F64`, random
    /// bits for every other type. The same seed gives the same values. CPU
    /// tensors are refused (fill them through
    /// [`with_bytes_mut`](Self::with_bytes_mut)).
    pub fn uniform_(&self, seed: u64) -> Result<(), TensorError> {
        if !self.is_cuda() {
            return Err(TensorError::Cuda(format!(
                "uniform_ fills CUDA tensors with cuRAND; this tensor is on {}: \
                 fill a CPU tensor through with_bytes_mut",
                self.storage.device
            )));
        }
        let dtype = self.dtype;
        Ok(self.with_device_buffer(|d| {
            cuda::ops::random_fill(d.gpu(), dtype, d.device_ptr(), d.len(), seed)
        })??)
    }

    /// A copy of this tensor on local CUDA device `ordinal` (host to device
    /// or device to device; the copy is enqueued on the destination's
    /// stream).
    pub fn to_device(&self, ordinal: usize) -> Result<Tensor, TensorError> {
        let out = Self::cuda_empty(self.dtype, &self.shape, ordinal)?;
        out.copy_from(self)?;
        Ok(out)
    }

    /// A CPU copy of this tensor (waits for the GPU: blocking, meant for
    /// tests and the object-store path). A CPU tensor is returned as is.
    pub fn to_cpu(&self) -> Result<Tensor, TensorError> {
        if !self.is_cuda() {
            return Ok(self.clone());
        }
        let mut bytes = vec![0u8; self.nbytes()];
        self.with_device_buffer(|d| d.gpu().copy_dtoh(&mut bytes, d.device_ptr()))??;
        Tensor::from_bytes(self.dtype, &self.shape, bytes)
    }

    /// Resolves when every GPU op enqueued so far on this tensor's stream
    /// (by this process) is done, without blocking the executor. Immediate
    /// for CPU tensors.
    pub async fn cuda_ready(&self) -> Result<(), TensorError> {
        if !self.is_cuda() {
            return Ok(());
        }
        // The point the contents became valid at, if one is pending (a
        // transfer's done event), is waited for itself, not through rdt's
        // stream: a wait enqueued there and an event recorded after it are
        // passed by the GPU microseconds after the transfer (a 4 KiB NCCL
        // receive on the 2xH200 host was seen ready 6.8 µs after its
        // transfer thread saw it land). rdt's stream is waited for beside
        // it, up to what it has now.
        let pending = self.storage.ready.lock().clone();
        let rdt_stream = match &*self.storage.mem.read() {
            Memory::Cuda(d) => d.gpu().completion()?,
            _ => return Ok(()),
        };
        if let Some(ev) = pending {
            ev.clone().wait().await?;
            // Passed: rdt's next use of the memory has nothing to wait for.
            let mut ready = self.storage.ready.lock();
            if ready.as_ref().is_some_and(|now| Arc::ptr_eq(now, &ev)) {
                *ready = None;
            }
        }
        rdt_stream.wait().await?;
        Ok(())
    }

    /// Copies `src`'s bytes into this tensor's storage, across devices as
    /// needed (receive into a target: contract point 7). Shapes and dtypes
    /// must match. A copy into a CUDA tensor is enqueued on its stream
    /// (ordered after the source's pending work); a copy out of a CUDA
    /// tensor waits for it.
    pub fn copy_from(&self, src: &Tensor) -> Result<(), TensorError> {
        if self.dtype != src.dtype || self.shape != src.shape {
            return Err(TensorError::Mismatch(format!(
                "cannot copy a {} {:?} tensor into a {} {:?} one",
                src.dtype, src.shape, self.dtype, self.shape
            )));
        }
        match (self.is_cuda(), src.is_cuda()) {
            (false, false) => {
                // Copied out first: `src` may share this storage, whose
                // write lock the copy in takes.
                let bytes = src.copy_bytes()?;
                self.with_bytes_mut(|b| b.copy_from_slice(&bytes))
            }
            // `to_cpu` gives fresh private memory: read in place.
            (false, true) => src
                .to_cpu()?
                .with_bytes(|s| self.with_bytes_mut(|b| b.copy_from_slice(s)))?,
            (true, false) => {
                src.with_bytes(|b| {
                    self.with_device_buffer(|dst| dst.gpu().copy_htod(dst.device_ptr(), b))
                })???;
                Ok(())
            }
            // Ordered after the source's pending work, then copied.
            (true, true) => self.with_device_buffer(|dst| -> Result<(), TensorError> {
                src.with_device_buffer(|s| -> Result<(), TensorError> {
                    if !Arc::ptr_eq(s.gpu(), dst.gpu()) {
                        s.gpu().synchronize()?;
                    }
                    dst.gpu()
                        .copy_dtod(dst.device_ptr(), s.device_ptr(), dst.len())?;
                    Ok(())
                })?
            })?,
        }
    }

    /// A new tensor with a copy of the bytes in storage of its own, on the
    /// same device. A CPU tensor is copied on the host. A CUDA tensor gets
    /// fresh exportable memory on the local device its memory is used from
    /// (for a `cuda_ipc` import: the consumer's device), filled by a
    /// device-to-device copy enqueued on that device's stream, hence
    /// ordered after everything the stream waits for (the producer's event
    /// of a `cuda_ipc` receive) and before every later rdt op on it. This is
    /// `cuda_ipc`'s copy mode: the copy does not share the producer's
    /// memory. Await [`cuda_ready`](Self::cuda_ready) to know the copy is
    /// done.
    pub fn deep_copy(&self) -> Result<Tensor, TensorError> {
        if self.is_cuda() {
            let ordinal = self.with_device_buffer(|d| d.gpu().ordinal())?;
            return self.to_device(ordinal);
        }
        let bytes = self.copy_bytes()?;
        Tensor::from_bytes(self.dtype, &self.shape, bytes)
    }
}

/// The bytes of external memory as a slice.
///
/// # Safety
/// `e` must outlive the slice, and nothing may write the bytes while the
/// slice lives (no other process, no other storage over the same memory,
/// no writer through this storage).
unsafe fn external_slice(e: &dyn ExternalMemory, range: std::ops::Range<usize>) -> &[u8] {
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
unsafe fn external_slice_mut(e: &dyn ExternalMemory, range: std::ops::Range<usize>) -> &mut [u8] {
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

/// The bytes of a host memory as a mutable slice, turning shared wire bytes
/// into owned ones first (invariant 4).
///
/// # Safety
/// If `mem` is external memory, nothing else may read or write it while the
/// slice lives (for memory that is not shared with other processes, holding
/// the storage's write lock, as `mem` suggests, guarantees that).
unsafe fn private_slice_mut(mem: &mut Memory) -> &mut [u8] {
    if let Memory::Shared(b) = mem {
        // Copy on write, unless these are the only holders of the bytes.
        *mem = Memory::Owned(match std::mem::take(b).try_into_mut() {
            Ok(unique) => Vec::from(unique),
            Err(shared) => shared.to_vec(),
        });
    }
    match mem {
        Memory::Owned(v) => v,
        Memory::Shared(_) => unreachable!("converted above"),
        // SAFETY: by the caller's guarantee.
        Memory::External(e) => unsafe { external_slice_mut(&**e, 0..e.len()) },
        Memory::Cuda(_) => unreachable!("host memory only"),
    }
}

/// A private copy of external memory, made with a raw-pointer copy: no
/// reference to the memory is formed, so a concurrent writer in another
/// process makes the copy torn, not undefined.
fn copy_out(e: &dyn ExternalMemory, range: std::ops::Range<usize>) -> Vec<u8> {
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
fn copy_in(e: &dyn ExternalMemory, at: usize, src: &[u8]) {
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
    mem: &'a dyn ExternalMemory,
    offset: usize,
    len: usize,
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

/// A tensor's bytes in device memory (what
/// [`Tensor::with_device_buffer`] gives): the buffer, and where in it the
/// tensor's bytes are.
#[derive(Clone, Copy)]
pub struct DeviceBytes<'a> {
    buf: &'a dyn DeviceBuffer,
    offset: usize,
    len: usize,
}

impl<'a> DeviceBytes<'a> {
    /// The whole buffer of the storage (a transport downcasts it with
    /// [`DeviceBuffer::as_any`] to recognize its own).
    pub fn buffer(&self) -> &'a dyn DeviceBuffer {
        self.buf
    }
    /// Where the tensor's bytes start in [`buffer`](Self::buffer).
    pub fn offset(&self) -> usize {
        self.offset
    }
    /// Device address of the tensor's first byte.
    pub fn device_ptr(&self) -> u64 {
        self.buf.device_ptr() + self.offset as u64
    }
    /// The tensor's number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }
    /// Does the tensor have no bytes?
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The GPU (context and stream) ops on this memory run on.
    pub fn gpu(&self) -> &'a Arc<cuda::Gpu> {
        self.buf.gpu()
    }
}

#[cfg(test)]
mod tests {
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
}
