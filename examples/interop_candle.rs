//! Bring your own tensors: a candle tensor goes through rdt to another
//! actor and comes back to candle, its values checked.
//! `cargo run --example interop_candle` (CPU; candle's CUDA build needs
//! nvcc, so CUDA interop goes through cudarc and DLPack instead).
//!
//! Out of candle, the tensor is a DLPack tensor over candle's own buffer
//! (no copy; candle has no DLPack of its own, so the conversion is here).
//! It enters rdt with `Tensor::from_dlpack`, goes to the actor as an
//! argument, and the actor's result leaves rdt with `Tensor::to_dlpack`.
//! Candle builds a tensor from a slice by copying it, which costs the one
//! copy on the way back.

use candle_core::{CpuStorage, Device, Storage, Tensor as Candle};
use rdt::data::dlpark::ffi::{DataType, Device as DlDevice};
use rdt::data::dlpark::prelude::TensorView;
use rdt::data::dlpark::traits::{RowMajorCompactLayout, TensorLike};
use rdt::data::DlpackTensor;
use rdt::prelude::*;

/// An actor that computes on what it is sent.
#[rdt::actor]
pub struct Shifter;

#[rdt::actor]
impl Shifter {
    fn new() -> Self {
        Shifter
    }

    /// `t` with 1 added to every element.
    async fn add_one(&mut self, t: Tensor) -> rdt::Result<Tensor> {
        t.add_scalar_(1.0f32)?;
        Ok(t)
    }
}

// ANCHOR: candle_out
/// A contiguous f32 candle tensor as DLPack sees it. It holds a clone of
/// the candle tensor, so candle's buffer lives as long as the managed
/// tensor does.
struct CandleF32 {
    tensor: Candle,
    data: *mut std::ffi::c_void,
}

impl TensorLike<RowMajorCompactLayout> for CandleF32 {
    type Error = candle_core::Error;
    fn data_ptr(&self) -> *mut std::ffi::c_void {
        self.data
    }
    fn memory_layout(&self) -> RowMajorCompactLayout {
        RowMajorCompactLayout::new(self.tensor.dims().iter().map(|&d| d as i64).collect())
    }
    fn device(&self) -> candle_core::Result<DlDevice> {
        Ok(DlDevice::CPU)
    }
    fn data_type(&self) -> candle_core::Result<DataType> {
        Ok(DataType::F32)
    }
    fn byte_offset(&self) -> u64 {
        0
    }
}

/// A candle CPU tensor of f32 as a managed DLPack tensor, with no copy of
/// a contiguous one.
fn candle_to_dlpack(t: &Candle) -> candle_core::Result<DlpackTensor> {
    let tensor = t.contiguous()?;
    let data = {
        let (storage, layout) = tensor.storage_and_layout();
        match &*storage {
            Storage::Cpu(CpuStorage::F32(v)) => {
                // Candle never moves or reallocates a storage's vector while
                // a tensor over it lives (the clone above keeps it), and it
                // does not write into it here.
                v[layout.start_offset()..].as_ptr() as *mut std::ffi::c_void
            }
            _ => candle_core::bail!("this example moves CPU f32 tensors"),
        }
    };
    DlpackTensor::new(CandleF32 { tensor, data })
}
// ANCHOR_END: candle_out

/// A managed DLPack tensor of f32 as a candle tensor (candle copies it).
fn dlpack_to_candle(t: &DlpackTensor) -> candle_core::Result<Candle> {
    let shape: Vec<usize> = t.shape().iter().map(|&d| d as usize).collect();
    let values: &[f32] = t
        .as_slice_contiguous()
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    Candle::from_slice(values, shape, &Device::Cpu)
}

#[rdt::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rt = Runtime::start().await?;
    let shifter = rt.spawn::<Shifter>(()).await?;

    // ANCHOR: round_trip
    let weights = Candle::arange(0f32, 12f32, &Device::Cpu)?.reshape((3, 4))?;
    let t = Tensor::from_dlpack(candle_to_dlpack(&weights)?)?;
    let shifted: Tensor = rt.get(shifter.add_one(t).remote()).await?;
    let back = dlpack_to_candle(&shifted.to_dlpack()?)?;
    // ANCHOR_END: round_trip

    let want = (&weights + 1.0)?;
    let off = (&back - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert_eq!(back.dims(), weights.dims(), "the shape came back");
    assert_eq!(off, 0.0, "every value came back, plus one");
    println!(
        "candle {:?} -> rdt -> {} -> rdt -> candle: every value came back plus one",
        weights.dims(),
        shifter.raw().name()
    );
    rt.shutdown().await;
    Ok(())
}
