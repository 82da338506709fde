//! Bring your own CUDA tensors: a cudarc `CudaSlice` goes through rdt to
//! another actor on the same GPU and back into cudarc there, its values
//! checked. `cargo run --example interop_cudarc`; on a machine without a
//! CUDA GPU it says so and exits 0.
//!
//! In, the slice is a DLPack tensor over cudarc's own memory (no copy)
//! with the stream cudarc wrote it on (`Tensor::from_dlpack_on`). It
//! leaves the producer over `cuda_ipc`. Out, the consumer hands the
//! received tensor to cudarc through DLPack with its own stream
//! (`Tensor::to_dlpack_on`) and copies it into a slice of its own.
//!
//! cudarc allocates from the device's stream-ordered pool where the device
//! has one, and `cuIpcGetMemHandle` cannot export pool memory: `cuda_ipc`
//! then copies the tensor once at export, and counts it
//! (`cuda_ipc::stats().export_copies`), which this example prints. Memory
//! from `cuMemAlloc` crosses with no copy.

use std::sync::Arc;

use rdt::data::cudarc::driver::{result, CudaContext, CudaSlice, CudaStream, DevicePtr};
use rdt::data::dlpark::ffi::{DataType, Device as DlDevice};
use rdt::data::dlpark::prelude::TensorView;
use rdt::data::dlpark::traits::{RowMajorCompactLayout, TensorLike};
use rdt::data::DlpackTensor;
use rdt::prelude::*;

const N: usize = 1 << 20;

fn cu(e: result::DriverError) -> Error {
    Error::Tensor(format!("cudarc: {e:?}"))
}

/// Device 0's primary context (the one rdt uses) and its default stream.
fn stream() -> rdt::Result<Arc<CudaStream>> {
    Ok(CudaContext::new(0).map_err(cu)?.default_stream())
}

// ANCHOR: cudarc_in
/// A cudarc slice of f32 as DLPack sees it: it owns the slice, so cudarc's
/// memory lives as long as the managed tensor does.
struct SliceF32 {
    slice: CudaSlice<f32>,
    ptr: u64,
}

impl TensorLike<RowMajorCompactLayout> for SliceF32 {
    type Error = Error;
    fn data_ptr(&self) -> *mut std::ffi::c_void {
        self.ptr as *mut std::ffi::c_void
    }
    fn memory_layout(&self) -> RowMajorCompactLayout {
        RowMajorCompactLayout::new(vec![self.slice.len() as i64])
    }
    fn device(&self) -> rdt::Result<DlDevice> {
        Ok(DlDevice::cuda(0))
    }
    fn data_type(&self) -> rdt::Result<DataType> {
        Ok(DataType::F32)
    }
    fn byte_offset(&self) -> u64 {
        0
    }
}

/// A cudarc slice, written on `stream`, as an rdt tensor (no copy).
fn cudarc_in(slice: CudaSlice<f32>, stream: &Arc<CudaStream>) -> rdt::Result<Tensor> {
    let ptr = slice.device_ptr(stream).0;
    let managed = DlpackTensor::new(SliceF32 { slice, ptr })?;
    // SAFETY: `stream` is cudarc's live stream of device 0's primary
    // context, which the slice's memory belongs to.
    Ok(unsafe { Tensor::from_dlpack_on(managed, stream.cu_stream()) }?)
}
// ANCHOR_END: cudarc_in

// ANCHOR: cudarc_out
/// An rdt CUDA tensor of f32 copied into a cudarc slice of its own, on
/// `stream` (ordered after rdt's work on the tensor).
fn cudarc_out(t: &Tensor, stream: &Arc<CudaStream>) -> rdt::Result<CudaSlice<f32>> {
    // SAFETY: `stream` is cudarc's live stream of the tensor's device
    // context (device 0's primary one).
    let managed = unsafe { t.to_dlpack_on(stream.cu_stream()) }?;
    let mut own = stream.alloc_zeros::<f32>(t.numel()).map_err(cu)?;
    {
        let (dst, _written) =
            rdt::data::cudarc::driver::DevicePtrMut::device_ptr_mut(&mut own, stream);
        // SAFETY: both ranges hold `nbytes` bytes of device 0; the copy is
        // on `stream`, which waits for rdt's work on the source and
        // cudarc's on the destination.
        unsafe {
            result::memcpy_dtod_async(
                dst,
                managed.data_ptr() as u64,
                t.nbytes(),
                stream.cu_stream(),
            )
        }
        .map_err(cu)?;
    }
    // The managed tensor (and with it the rdt tensor's storage) lives
    // until the copy is done.
    stream.synchronize().map_err(cu)?;
    drop(managed);
    Ok(own)
}
// ANCHOR_END: cudarc_out

/// Makes values with cudarc and hands them out through rdt.
#[rdt::actor]
pub struct Maker;

#[rdt::actor]
impl Maker {
    fn new() -> Self {
        Maker
    }

    /// `0, 1, ..., n-1` in a cudarc slice, over `cuda_ipc`.
    #[rdt::method(tensor_transport = "cuda_ipc")]
    async fn iota(&mut self, n: usize) -> rdt::Result<Tensor> {
        let stream = stream()?;
        let host: Vec<f32> = (0..n).map(|i| i as f32).collect();
        let slice = stream.clone_htod(&host).map_err(cu)?;
        cudarc_in(slice, &stream)
    }

    /// Tensors this process exported over `cuda_ipc` by a device copy.
    async fn export_copies(&mut self) -> u64 {
        rdt::data::cuda_ipc::stats().export_copies
    }
}

/// Takes values from rdt into cudarc.
#[rdt::actor]
pub struct Checker;

#[rdt::actor]
impl Checker {
    fn new() -> Self {
        Checker
    }

    /// `t` in a cudarc slice of its own, read back: how many elements
    /// hold their own index.
    async fn in_order(&mut self, t: Tensor) -> rdt::Result<usize> {
        let stream = stream()?;
        let mine = cudarc_out(&t, &stream)?;
        let host = stream.clone_dtoh(&mine).map_err(cu)?;
        Ok(host
            .iter()
            .enumerate()
            .filter(|&(i, &x)| x == i as f32)
            .count())
    }
}

#[rdt::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    if let Err(e) = rdt::data::cuda::available() {
        println!("interop_cudarc needs a CUDA GPU, and this machine has none usable ({e}): nothing to run");
        return Ok(());
    }
    let rt = Runtime::start().await?;
    let maker = rt.spawn::<Maker>(()).on_gpus([0]).await?;
    let checker = rt.spawn::<Checker>(()).on_gpus([0]).await?;
    let t = maker.iota(N).remote();
    let in_order = rt.get(checker.in_order(&t).remote()).await?;
    assert_eq!(in_order, N, "every value came through in order");
    let copies = rt.get(maker.export_copies().remote()).await?;
    println!(
        "cudarc CudaSlice of {N} f32 on GPU 0 -> rdt -> cuda_ipc -> {} -> cudarc: every value came \
         through in order; device copies at export: {copies} (cudarc's pool memory is copied once, \
         cuMemAlloc memory is not)",
        checker.raw().name()
    );
    rt.shutdown().await;
    Ok(())
}
