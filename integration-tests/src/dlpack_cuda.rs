//! Another library's CUDA memory, as a DLPack tensor: `cuMemAlloc` or
//! stream-ordered pool memory of f32s, freed by the managed tensor's
//! deleter, which counts its runs. The CUDA interop tests hand it to rdt
//! (`Tensor::from_dlpack_on`) and read rdt tensors back through DLPack.

use std::sync::atomic::{AtomicU64, Ordering};

use rdt::data::cudarc::driver::{result, sys};
use rdt::data::dlpark::ffi::{DataType, Device as DlDevice};
use rdt::data::dlpark::prelude::TensorView;
use rdt::data::dlpark::traits::{RowMajorCompactLayout, TensorLike};
use rdt::data::dlpark::SafeManagedTensorVersioned;
use rdt::prelude::*;

/// Deleters of [`Foreign`] memory that ran in this process.
pub static DELETERS_RUN: AtomicU64 = AtomicU64::new(0);

/// How the foreign library allocated.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Alloc {
    /// `cuMemAlloc`: exportable by its IPC handle.
    Plain,
    /// `cuMemAllocAsync` from the device's default pool: not exportable
    /// by `cuIpcGetMemHandle`.
    Pooled,
}

/// f32 device memory of another library on local device 0.
pub struct Foreign {
    ptr: u64,
    len: usize,
    alloc: Alloc,
}

impl Drop for Foreign {
    fn drop(&mut self) {
        // SAFETY: allocated by `make`, freed once, here; rdt waited for
        // its own work on it before dropping the managed tensor.
        unsafe {
            match self.alloc {
                Alloc::Plain => result::free_sync(self.ptr).expect("cuMemFree"),
                Alloc::Pooled => {
                    result::free_async(self.ptr, std::ptr::null_mut()).expect("cuMemFreeAsync");
                    result::stream::synchronize(std::ptr::null_mut()).expect("sync");
                }
            }
        }
        DELETERS_RUN.fetch_add(1, Ordering::SeqCst);
    }
}

impl TensorLike<RowMajorCompactLayout> for Foreign {
    type Error = rdt::TensorError;
    fn data_ptr(&self) -> *mut std::ffi::c_void {
        self.ptr as *mut std::ffi::c_void
    }
    fn memory_layout(&self) -> RowMajorCompactLayout {
        RowMajorCompactLayout::new(vec![(self.len / 4) as i64])
    }
    fn device(&self) -> Result<DlDevice, rdt::TensorError> {
        Ok(DlDevice::cuda(0))
    }
    fn data_type(&self) -> Result<DataType, rdt::TensorError> {
        Ok(DataType::F32)
    }
    fn byte_offset(&self) -> u64 {
        0
    }
}

/// `n` f32 equal to `v` in another library's memory on local device 0, as
/// an rdt tensor (through DLPack, written on the legacy default stream).
pub fn make(v: f32, n: usize, alloc: Alloc) -> rdt::Result<Tensor> {
    rdt::data::cuda::gpu(0)?.bind()?;
    let host = vec![v; n];
    let len = n * 4;
    let cu = |e: result::DriverError| Error::Tensor(format!("{e:?}"));
    // SAFETY: a fresh allocation of `len` bytes, filled whole before use.
    let ptr = unsafe {
        let ptr = match alloc {
            Alloc::Plain => result::malloc_sync(len).map_err(cu)?,
            Alloc::Pooled => result::malloc_async(std::ptr::null_mut(), len).map_err(cu)?,
        };
        result::memcpy_htod_sync(ptr, &host).map_err(cu)?;
        ptr
    };
    let managed = SafeManagedTensorVersioned::new(Foreign { ptr, len, alloc })?;
    // SAFETY: the legacy default stream, in device 0's primary context,
    // which the memory belongs to.
    Ok(unsafe { Tensor::from_dlpack_on(managed, std::ptr::null_mut()) }?)
}

/// `t` read through DLPack: whether the managed tensor is CUDA memory
/// at `t`'s own address (no copy), and the sum of its f32s read from
/// there.
pub fn read_out(t: &Tensor) -> rdt::Result<(bool, f64)> {
    let at = t.with_device_buffer(|d| d.device_ptr())?;
    // SAFETY: the legacy default stream, in the tensor's device context
    // (rdt binds its primary context).
    let out = unsafe { t.to_dlpack_on(std::ptr::null_mut()) }?;
    let same = out.device().device_type == rdt::data::dlpark::ffi::DeviceType::Cuda
        && out.data_ptr() as u64 == at;
    let mut host = vec![0f32; t.numel()];
    // SAFETY: the managed tensor's memory, as many bytes as it holds; the
    // default stream was ordered after rdt's work on it.
    unsafe { result::memcpy_dtoh_sync(&mut host, out.data_ptr() as sys::CUdeviceptr) }
        .map_err(|e| Error::Tensor(format!("{e:?}")))?;
    Ok((same, host.iter().map(|&x| x as f64).sum()))
}
