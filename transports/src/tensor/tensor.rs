//! [`Tensor`] and [`TensorMeta`]: constructors, views and accessors
//! (invariants 1 and 2).

use super::*;

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
    pub(super) dtype: DType,
    pub(super) shape: Shape,
    pub(super) storage: Arc<Storage>,
    /// Where the tensor's bytes start in the storage (invariant 1).
    pub(super) offset: usize,
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
pub(super) fn shape_bytes(dtype: DType, shape: &[usize]) -> usize {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
        .unwrap_or(usize::MAX)
}

pub(super) fn check_size(dtype: DType, shape: &[usize], actual: usize) -> Result<(), TensorError> {
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

    pub(super) fn with_storage(dtype: DType, shape: &[usize], storage: Arc<Storage>) -> Self {
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
    pub(super) fn range(&self) -> std::ops::Range<usize> {
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
}
