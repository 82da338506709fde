//! DLPack in and out, through `dlpark`: an rdt tensor handed to another
//! library (candle, tch, numpy through pyo3, a C program) as a managed
//! DLPack tensor, and one from another library taken in, with no copy of
//! the bytes either way.
//!
//! # Ownership
//! - Out: the managed tensor holds the tensor's bytes (a `Bytes`, the same
//!   allocation): they stay alive until its deleter runs, whatever rdt does
//!   meanwhile. It is flagged read-only: the bytes are shared, and a write
//!   through any rdt clone of the tensor copies them first (copy-on-write),
//!   so the other library never sees them change.
//! - In: the rdt tensor owns the managed tensor; its deleter runs once the
//!   last clone of the tensor, and every transfer of it, is gone. rdt never
//!   writes into the imported bytes: a write through the tensor copies them
//!   first.
//!
//! # CUDA
//! DLPack's struct carries no stream, so a CUDA tensor crosses with an
//! explicit one, as Python's `__dlpack__(stream=...)` does:
//! [`Tensor::to_dlpack_on`] orders the consumer's stream after every rdt
//! operation on the tensor, and [`Tensor::from_dlpack_on`] records rdt's
//! ready point after the work the producer enqueued on its stream. The
//! plain `to_dlpack` and `from_dlpack` refuse device memory. An imported
//! allocation from `cuMemAlloc` is adopted as rdt memory (`cuda::alloc`'s
//! `adopt`), so `cuda_ipc` and `nixl` move it with no device copy; other
//! device memory (a stream-ordered pool, virtual memory) is used as it is
//! here, and `cuda_ipc` copies it once at export (counted in
//! `cuda_ipc::stats().export_copies`).
//!
//! dlpark's own `cuda` feature is not used: it builds cudarc against the
//! toolkit found at build time, where rdt loads the driver at run time
//! (no toolkit needed to build).
//!
//! # Limits
//! Imported tensors must be row-major and contiguous (DLPack's strides
//! absent or compact) with one lane per element, of a dtype rdt has.

use bytes::Bytes;
use dlpark::ffi::{DataType, DataTypeCode, Device as DlDevice, DeviceType, Flags};
use dlpark::prelude::TensorView;
use dlpark::traits::{RowMajorCompactLayout, TensorLike};
use dlpark::{SafeManagedTensor, SafeManagedTensorVersioned};

use super::*;

/// A managed DLPack tensor of the current ABI (versioned, DLPack 1.x), as
/// `dlpark` holds it: hand it on, or take its raw pointer for C
/// (`into_raw`).
pub type DlpackTensor = SafeManagedTensorVersioned;

/// A managed DLPack tensor of the legacy ABI (`DLManagedTensor`, before
/// DLPack 1.0), for consumers that only take that.
pub type DlpackTensorLegacy = SafeManagedTensor;

/// What a managed tensor made by [`Tensor::to_dlpack`] keeps: the bytes
/// (alive until its deleter runs) and their layout.
struct Shared {
    bytes: Bytes,
    shape: Vec<i64>,
    dtype: DataType,
}

impl TensorLike<RowMajorCompactLayout> for Shared {
    type Error = TensorError;

    fn data_ptr(&self) -> *mut std::ffi::c_void {
        // Read-only (flagged so): the pointer is mutable only because the
        // C struct's field is.
        self.bytes.as_ptr() as *mut std::ffi::c_void
    }

    fn memory_layout(&self) -> RowMajorCompactLayout {
        RowMajorCompactLayout::new(self.shape.clone())
    }

    fn device(&self) -> Result<DlDevice, TensorError> {
        Ok(DlDevice::CPU)
    }

    fn data_type(&self) -> Result<DataType, TensorError> {
        Ok(self.dtype)
    }

    fn byte_offset(&self) -> u64 {
        0
    }
}

/// DLPack's name for an rdt dtype.
fn to_dl(dtype: DType) -> DataType {
    match dtype {
        DType::F32 => DataType::F32,
        DType::F64 => DataType::F64,
        DType::F16 => DataType::F16,
        DType::BF16 => DataType::BF16,
        DType::I8 => DataType::I8,
        DType::I16 => DataType::I16,
        DType::I32 => DataType::I32,
        DType::I64 => DataType::I64,
        DType::U8 => DataType::U8,
        DType::U32 => DataType::U32,
        DType::U64 => DataType::U64,
        DType::Bool => DataType::BOOL,
    }
}

/// The rdt dtype of a DLPack one, if rdt has it.
fn from_dl(dt: &DataType) -> Result<DType, TensorError> {
    let unsupported = || {
        TensorError::Dlpack(format!(
            "DLPack dtype {:?} of {} bits with {} lanes has no rdt dtype",
            dt.code, dt.bits, dt.lanes
        ))
    };
    if dt.lanes != 1 {
        return Err(unsupported());
    }
    Ok(match (dt.code, dt.bits) {
        (DataTypeCode::Float, 32) => DType::F32,
        (DataTypeCode::Float, 64) => DType::F64,
        (DataTypeCode::Float, 16) => DType::F16,
        (DataTypeCode::Bfloat, 16) => DType::BF16,
        (DataTypeCode::Int, 8) => DType::I8,
        (DataTypeCode::Int, 16) => DType::I16,
        (DataTypeCode::Int, 32) => DType::I32,
        (DataTypeCode::Int, 64) => DType::I64,
        (DataTypeCode::UInt, 8) => DType::U8,
        (DataTypeCode::UInt, 32) => DType::U32,
        (DataTypeCode::UInt, 64) => DType::U64,
        (DataTypeCode::Bool, 8) => DType::Bool,
        _ => return Err(unsupported()),
    })
}

/// An imported managed tensor, as the owner of the bytes of the rdt tensor
/// made of it.
struct Imported<T>(T);

// SAFETY: a managed DLPack tensor is a pointer to memory its producer
// handed over, and a deleter; DLPack lets the consumer use it, and call
// the deleter, from any thread. rdt only reads the bytes (`AsRef`) and
// calls the deleter once (`Drop`).
unsafe impl<T> Send for Imported<T> {}
// SAFETY: shared references only read the bytes (`AsRef`), which nothing
// writes while rdt holds them (module docs); the deleter runs on drop,
// which takes the value by itself.
unsafe impl<T> Sync for Imported<T> {}

impl<T: TensorView> AsRef<[u8]> for Imported<T> {
    fn as_ref(&self) -> &[u8] {
        if self.0.num_bytes() == 0 {
            // An empty tensor may carry a dangling or null pointer.
            return &[];
        }
        self.0.as_slice_untyped()
    }
}

/// What a managed tensor made by [`Tensor::to_dlpack_on`] of a CUDA
/// tensor keeps: the tensor (its storage alive until the deleter runs) and
/// where its bytes are.
struct SharedDevice {
    _tensor: Tensor,
    ptr: u64,
    ordinal: usize,
    shape: Vec<i64>,
    dtype: DataType,
}

impl TensorLike<RowMajorCompactLayout> for SharedDevice {
    type Error = TensorError;

    fn data_ptr(&self) -> *mut std::ffi::c_void {
        self.ptr as *mut std::ffi::c_void
    }

    fn memory_layout(&self) -> RowMajorCompactLayout {
        RowMajorCompactLayout::new(self.shape.clone())
    }

    fn device(&self) -> Result<DlDevice, TensorError> {
        Ok(DlDevice::cuda(self.ordinal))
    }

    fn data_type(&self) -> Result<DataType, TensorError> {
        Ok(self.dtype)
    }

    fn byte_offset(&self) -> u64 {
        0
    }
}

/// Device memory of another library that rdt could not adopt (see the
/// module docs): used where it is, kept alive by the imported managed
/// tensor.
struct ForeignDevice {
    gpu: Arc<crate::cuda::Gpu>,
    ptr: u64,
    len: usize,
    owner: Option<Box<dyn Send + Sync>>,
}

// SAFETY: the range is the managed tensor's (its producer vouched for it
// when it handed it over, and `from_dlpack_on`'s caller for its context),
// alive while `owner` is; `Drop` waits for rdt's stream before letting
// the owner go.
unsafe impl crate::cuda::DeviceBuffer for ForeignDevice {
    fn device_ptr(&self) -> u64 {
        self.ptr
    }
    fn len(&self) -> usize {
        self.len
    }
    fn gpu(&self) -> &Arc<crate::cuda::Gpu> {
        &self.gpu
    }
    fn describe(&self) -> String {
        format!(
            "another library's device memory ({} B) on {}",
            self.len,
            self.gpu.uuid()
        )
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl Drop for ForeignDevice {
    fn drop(&mut self) {
        // The library may reuse the memory at once: rdt's work on it ends
        // first.
        if let Err(e) = self.gpu.synchronize() {
            tracing::warn!("imported device memory: waiting for rdt's stream: {e}");
        }
        drop(self.owner.take());
    }
}

/// An imported tensor's dtype and shape, checked: one lane per element of
/// a dtype rdt has, row-major contiguous.
fn checked_layout<T: TensorView>(t: &T) -> Result<(DType, Vec<usize>), TensorError> {
    let dtype = from_dl(t.data_type())?;
    let shape: Vec<usize> = (t.shape().iter())
        .map(|&d| usize::try_from(d))
        .collect::<Result<_, _>>()
        .map_err(|_| TensorError::Dlpack(format!("a negative dimension in {:?}", t.shape())))?;
    if let Some(strides) = t.strides() {
        let mut want = 1i64;
        for (&dim, &stride) in shape.iter().zip(strides).rev() {
            // A dimension of size 1 may have any stride.
            if dim != 1 && stride != want {
                return Err(TensorError::Dlpack(format!(
                    "a DLPack tensor of shape {shape:?} with strides {strides:?} is not \
                     row-major contiguous: make it contiguous first"
                )));
            }
            want *= dim as i64;
        }
    }
    Ok((dtype, shape))
}

impl Tensor {
    /// This tensor as a managed DLPack tensor for a consumer that reads
    /// it on `stream` (a stream of the consumer's library, in this
    /// process): host tensors as [`to_dlpack`](Self::to_dlpack) makes
    /// them (`stream` unused), CUDA tensors with no copy, `stream` made to
    /// wait (on the GPU, no host sync) for every rdt operation on the
    /// tensor so far, a transfer that received it included.
    ///
    /// The managed tensor keeps the storage alive until its deleter runs.
    /// Device memory is shared, not copied on write: the consumer's writes
    /// are seen by this tensor and its clones; order them before rdt's
    /// next use with [`produced_on_stream`](Self::produced_on_stream).
    ///
    /// # Safety
    /// `stream` must be a live CUDA stream of this process, in the context
    /// of the tensor's device (its primary context, which rdt uses too),
    /// or null (the legacy default stream).
    pub unsafe fn to_dlpack_on(
        &self,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<DlpackTensor, TensorError> {
        if !self.is_cuda() {
            return self.to_dlpack();
        }
        // SAFETY: forwarded from the caller.
        unsafe { self.ready_on_stream(stream) }?;
        let (ptr, ordinal) = self.with_device_buffer(|d| (d.device_ptr(), d.gpu().ordinal()))?;
        let shared = SharedDevice {
            _tensor: self.clone(),
            ptr,
            ordinal,
            shape: self.shape.iter().map(|&d| d as i64).collect(),
            dtype: to_dl(self.dtype),
        };
        DlpackTensor::new(shared)
    }

    /// A tensor over a managed DLPack tensor's memory, with no copy,
    /// whose contents become valid when the work enqueued so far on
    /// `stream` (the producer library's, in this process) completes: host
    /// memory as [`from_dlpack`](Self::from_dlpack) takes it (`stream`
    /// unused), CUDA memory of local device `device_id`, rdt's next use of
    /// it (an op, a transfer) ordered after that work on the GPU.
    ///
    /// The tensor owns the managed tensor: its deleter runs once the last
    /// clone of the tensor and every transfer of it are gone (for memory
    /// other processes mapped, once they closed their mappings: at the
    /// worker's housekeeping, or [`cuda::alloc::trim`](crate::cuda::alloc::trim)).
    /// Memory from `cuMemAlloc` travels over `cuda_ipc` and `nixl` with no
    /// device copy; other device memory is copied once at a `cuda_ipc`
    /// export (see the module docs).
    ///
    /// # Safety
    /// `stream` must be a live CUDA stream of this process, in the context
    /// of the tensor's device, or null (the legacy default stream); the
    /// managed tensor's memory must be device memory of that device, as
    /// DLPack says it is.
    ///
    /// # Errors
    /// As [`from_dlpack`](Self::from_dlpack) for the layout; a device
    /// other than the host and CUDA, or a CUDA device this process does
    /// not see. The managed tensor is dropped then (its deleter runs).
    pub unsafe fn from_dlpack_on(
        t: DlpackTensor,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<Tensor, TensorError> {
        let dev = t.device();
        if dev.device_type != DeviceType::Cuda {
            return Self::from_dlpack(t);
        }
        let (dtype, shape) = checked_layout(&t)?;
        let gpu = crate::cuda::gpu(dev.device_id as usize)?;
        let ptr = t.data_ptr() as u64 + t.byte_offset() as u64;
        let len = t.num_bytes();
        let owner: Box<dyn Send + Sync> = Box::new(Imported(t));
        // SAFETY: the managed tensor's memory, alive while `owner` is (the
        // caller vouches for its device).
        let buf: Box<dyn crate::cuda::DeviceBuffer> =
            match unsafe { crate::cuda::alloc::adopt(&gpu, ptr, len, owner) } {
                Ok(range) => Box::new(range),
                Err(owner) => Box::new(ForeignDevice {
                    gpu: gpu.clone(),
                    ptr,
                    len,
                    owner: Some(owner),
                }),
            };
        let tensor = Self::from_device_buffer(dtype, &shape, gpu.device(), buf)?;
        // SAFETY: forwarded from the caller.
        unsafe { tensor.produced_on_stream(stream) }?;
        Ok(tensor)
    }

    /// This tensor as a managed DLPack tensor (DLPack 1.x, versioned),
    /// with no copy: the bytes stay alive until the other library runs the
    /// deleter, and they are shared read-only (flagged so); a later write
    /// through this tensor or any clone copies them first.
    ///
    /// A tensor in memory shared with other processes (`shm`) or other
    /// external memory is copied once into private memory, and the managed
    /// tensor is flagged as a copy (`IS_COPIED`).
    ///
    /// # Errors
    /// A CUDA tensor: DLPack's struct carries no stream, and this exchange
    /// is host memory only for now.
    pub fn to_dlpack(&self) -> Result<DlpackTensor, TensorError> {
        let (shared, copied) = self.shared_for_dlpack()?;
        let flags = if copied {
            Flags::READ_ONLY | Flags::IS_COPIED
        } else {
            Flags::READ_ONLY
        };
        DlpackTensor::with_flags(shared, flags)
    }

    /// [`to_dlpack`](Self::to_dlpack) in the legacy ABI (no flags: the
    /// consumer must not write into it).
    ///
    /// # Errors
    /// As [`to_dlpack`](Self::to_dlpack).
    pub fn to_dlpack_legacy(&self) -> Result<DlpackTensorLegacy, TensorError> {
        let (shared, _) = self.shared_for_dlpack()?;
        DlpackTensorLegacy::new(shared)
    }

    fn shared_for_dlpack(&self) -> Result<(Shared, bool), TensorError> {
        if self.is_cuda() {
            return Err(TensorError::Dlpack(
                "a CUDA tensor goes to DLPack with the consumer's stream: use \
                 Tensor::to_dlpack_on(stream) (or to_cpu first)"
                    .into(),
            ));
        }
        let copied = matches!(&*self.storage.mem.read(), Memory::External(_));
        let bytes = self.to_bytes()?;
        let shape = self.shape.iter().map(|&d| d as i64).collect();
        Ok((
            Shared {
                bytes,
                shape,
                dtype: to_dl(self.dtype),
            },
            copied,
        ))
    }

    /// A CPU tensor over a managed DLPack tensor's bytes, with no copy. The
    /// tensor owns the managed tensor: its deleter runs when the last clone
    /// of the tensor and every transfer of it are gone. rdt never writes
    /// into those bytes; a write through the tensor copies them first.
    ///
    /// # Errors
    /// Memory that is not the host's (a CUDA device), strides that are not
    /// row-major contiguous, several lanes per element, or a dtype rdt does
    /// not have. The managed tensor is dropped then (its deleter runs).
    pub fn from_dlpack(t: DlpackTensor) -> Result<Tensor, TensorError> {
        Self::from_dlpack_view(t)
    }

    /// [`from_dlpack`](Self::from_dlpack) of the legacy ABI.
    ///
    /// # Errors
    /// As [`from_dlpack`](Self::from_dlpack).
    pub fn from_dlpack_legacy(t: DlpackTensorLegacy) -> Result<Tensor, TensorError> {
        Self::from_dlpack_view(t)
    }

    fn from_dlpack_view<T: TensorView + 'static>(t: T) -> Result<Tensor, TensorError> {
        match t.device().device_type {
            DeviceType::Cpu | DeviceType::CudaHost => {}
            other => {
                return Err(TensorError::Dlpack(format!(
                    "a DLPack tensor on {other:?} {}: from_dlpack takes host memory; a CUDA \
                     tensor comes in with its producer's stream (Tensor::from_dlpack_on)",
                    t.device().device_id
                )))
            }
        }
        let (dtype, shape) = checked_layout(&t)?;
        let bytes = Bytes::from_owner(Imported(t));
        Tensor::from_shared_bytes(dtype, &shape, bytes)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use dlpark::ffi::{DataType, Device as DlDevice};
    use dlpark::prelude::TensorView;
    use dlpark::traits::{RowMajorCompactLayout, StridedLayout, TensorLike};

    use super::*;

    /// Another library's tensor: f32s with a shape, where it lives, and a
    /// count of the times it was dropped (its deleter ran).
    struct Foreign {
        data: Vec<f32>,
        shape: Vec<i64>,
        strides: Option<Vec<i64>>,
        device: DlDevice,
        drops: Arc<AtomicUsize>,
    }

    impl Drop for Foreign {
        fn drop(&mut self) {
            self.drops.fetch_add(1, Ordering::SeqCst);
        }
    }

    impl TensorLike<RowMajorCompactLayout> for Foreign {
        type Error = TensorError;
        fn data_ptr(&self) -> *mut std::ffi::c_void {
            self.data.as_ptr() as *mut std::ffi::c_void
        }
        fn memory_layout(&self) -> RowMajorCompactLayout {
            RowMajorCompactLayout::new(self.shape.clone())
        }
        fn device(&self) -> Result<DlDevice, TensorError> {
            Ok(self.device)
        }
        fn data_type(&self) -> Result<DataType, TensorError> {
            Ok(DataType::F32)
        }
        fn byte_offset(&self) -> u64 {
            0
        }
    }

    impl TensorLike<StridedLayout> for Foreign {
        type Error = TensorError;
        fn data_ptr(&self) -> *mut std::ffi::c_void {
            self.data.as_ptr() as *mut std::ffi::c_void
        }
        fn memory_layout(&self) -> StridedLayout {
            let mut both = self.shape.clone();
            both.extend(self.strides.clone().expect("a strided one"));
            StridedLayout::new(both)
        }
        fn device(&self) -> Result<DlDevice, TensorError> {
            Ok(self.device)
        }
        fn data_type(&self) -> Result<DataType, TensorError> {
            Ok(DataType::F32)
        }
        fn byte_offset(&self) -> u64 {
            0
        }
    }

    fn foreign(n: usize, shape: &[i64]) -> (Foreign, Arc<AtomicUsize>) {
        let drops = Arc::new(AtomicUsize::new(0));
        let f = Foreign {
            data: (0..n).map(|i| i as f32).collect(),
            shape: shape.to_vec(),
            strides: None,
            device: DlDevice::CPU,
            drops: drops.clone(),
        };
        (f, drops)
    }

    #[test]
    fn a_foreign_tensor_comes_in_without_a_copy_and_its_deleter_runs_once_after_the_last_clone() {
        let (f, drops) = foreign(6, &[2, 3]);
        let at = f.data.as_ptr() as usize;
        let managed = DlpackTensor::new::<_, RowMajorCompactLayout>(f).unwrap();
        let t = Tensor::from_dlpack(managed).unwrap();
        assert_eq!((t.dtype(), t.shape()), (DType::F32, &[2usize, 3][..]));
        let same_bytes = t.with_bytes(|b| b.as_ptr() as usize).unwrap();
        assert_eq!(same_bytes, at, "no copy");
        let c = t.clone();
        let v = t.view(4, DType::F32, &[2]).unwrap();
        for (i, held) in [t, c].into_iter().enumerate() {
            drop(held);
            assert_eq!(
                drops.load(Ordering::SeqCst),
                0,
                "dropped {} of three",
                i + 1
            );
        }
        assert_eq!(
            v.to_vec::<f32>().unwrap(),
            [1.0, 2.0],
            "the view still reads"
        );
        drop(v);
        assert_eq!(drops.load(Ordering::SeqCst), 1, "the deleter ran once");
    }

    #[test]
    fn a_write_through_an_imported_tensor_copies_first_and_lets_the_foreign_bytes_go() {
        let (f, drops) = foreign(4, &[4]);
        let t =
            Tensor::from_dlpack(DlpackTensor::new::<_, RowMajorCompactLayout>(f).unwrap()).unwrap();
        t.with_bytes_mut(|b| b.fill(0)).unwrap();
        assert_eq!(t.to_vec::<f32>().unwrap(), [0.0; 4]);
        assert_eq!(
            drops.load(Ordering::SeqCst),
            1,
            "rdt wrote into its own copy and released the foreign bytes"
        );
    }

    #[test]
    fn an_rdt_tensor_goes_out_read_only_without_a_copy_and_outlives_its_tensor() {
        let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], &[3, 2]).unwrap();
        let at = t.with_bytes(|b| b.as_ptr() as usize).unwrap();
        let out = t.to_dlpack().unwrap();
        assert!(out.read_only() && !out.is_copied(), "{:?}", out.flags());
        assert_eq!(out.shape(), &[3, 2]);
        assert_eq!(*out.data_type(), DataType::F32);
        assert_eq!(out.data_ptr() as usize, at, "no copy");
        // A write through rdt after the export copies: the export keeps
        // what it was given.
        t.with_bytes_mut(|b| b.fill(0)).unwrap();
        drop(t);
        let s: &[f32] = out.as_slice_contiguous().unwrap();
        assert_eq!(s, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        // And back in: the same bytes again.
        let back = Tensor::from_dlpack(out).unwrap();
        assert_eq!(back.shape(), &[3, 2]);
        assert_eq!(
            back.to_vec::<f32>().unwrap(),
            [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
        );
        assert_eq!(back.with_bytes(|b| b.as_ptr() as usize).unwrap(), at);
    }

    #[test]
    fn every_dtype_and_a_view_round_trip_and_so_does_the_legacy_abi() {
        let base = Tensor::from_slice(&[7u8; 64], &[64]).unwrap();
        for dtype in DType::ALL {
            let n = 16 / dtype.size();
            let v = base.view(16, dtype, &[n]).unwrap();
            let back = Tensor::from_dlpack(v.to_dlpack().unwrap()).unwrap();
            assert_eq!((back.dtype(), back.shape()), (dtype, &[n][..]));
            assert_eq!(back.to_bytes().unwrap(), v.to_bytes().unwrap());
            let legacy = Tensor::from_dlpack_legacy(v.to_dlpack_legacy().unwrap()).unwrap();
            assert_eq!(legacy.to_bytes().unwrap(), v.to_bytes().unwrap());
        }
    }

    #[test]
    fn host_tensors_cross_with_a_stream_as_without_one() {
        let null = std::ptr::null_mut();
        let t = Tensor::from_slice(&[1.0f32, 2.0, 3.0], &[3]).unwrap();
        // SAFETY: a host tensor: the stream is not used.
        let out = unsafe { t.to_dlpack_on(null) }.unwrap();
        assert!(out.read_only());
        let (f, drops) = foreign(3, &[3]);
        let managed = DlpackTensor::new::<_, RowMajorCompactLayout>(f).unwrap();
        // SAFETY: host memory: the stream is not used.
        let back = unsafe { Tensor::from_dlpack_on(managed, null) }.unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), [0.0, 1.0, 2.0]);
        drop(back);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        drop(out);
    }

    #[test]
    fn what_cannot_come_in_is_refused_and_still_deleted() {
        // Device memory.
        let (mut f, drops) = foreign(4, &[4]);
        f.device = DlDevice {
            device_type: dlpark::ffi::DeviceType::Cuda,
            device_id: 0,
        };
        let e = Tensor::from_dlpack(DlpackTensor::new::<_, RowMajorCompactLayout>(f).unwrap())
            .unwrap_err();
        assert!(e.to_string().contains("from_dlpack_on"), "{e}");
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        // Column-major strides.
        let (mut f, drops) = foreign(6, &[2, 3]);
        f.strides = Some(vec![1, 2]);
        let managed = DlpackTensor::new::<_, StridedLayout>(f).unwrap();
        let e = Tensor::from_dlpack(managed).unwrap_err();
        assert!(e.to_string().contains("not row-major contiguous"), "{e}");
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        // Compact strides are fine, and so is any stride of a dimension of 1.
        let (mut f, _) = foreign(6, &[1, 2, 3]);
        f.strides = Some(vec![99, 3, 1]);
        let t = Tensor::from_dlpack(DlpackTensor::new::<_, StridedLayout>(f).unwrap()).unwrap();
        assert_eq!(t.shape(), &[1, 2, 3]);
    }
}
