//! The test ops: fill, add, sum, compare and random fill, on the host or
//! on the GPU.

use super::*;

use crate::cuda;

impl Tensor {
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

    /// Sum of all elements, as `f64`, for any element type (`F16` and
    /// `BF16` as their numbers; [`raw_word_sum`](Self::raw_word_sum) is the
    /// checksum of their bits).
    ///
    /// A CUDA tensor is summed on its device by an NVRTC-compiled kernel
    /// (see [`cuda::ops`]; blocks until the result is back; the order of
    /// additions differs from the host's, so a floating-point sum may
    /// differ in its last bits). Without NVRTC it is copied to the host
    /// first; [`cuda::ops::nvrtc_available`] says which.
    pub fn sum(&self) -> Result<f64, TensorError> {
        if self.is_cuda() {
            // The device kernel of the 16-bit floats sums raw words: their
            // numbers are summed on the host.
            let half = matches!(self.dtype, DType::F16 | DType::BF16);
            if !half {
                if let Some(s) = self.sum_on_device() {
                    return s;
                }
            }
            return self.to_cpu()?.sum();
        }
        macro_rules! sum_as {
            ($t:ty, $b:expr) => {
                // Aligned storage (the usual case) is read in place.
                match bytemuck::try_cast_slice::<u8, $t>($b) {
                    Ok(v) => v.iter().map(|&x| Element::to_f64(x)).sum::<f64>(),
                    Err(_) => $b
                        .chunks_exact(std::mem::size_of::<$t>())
                        .map(|c| Element::to_f64(bytemuck::pod_read_unaligned::<$t>(c)))
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
            DType::F16 => sum_as!(half::f16, b),
            DType::BF16 => sum_as!(half::bf16, b),
        })
    }

    /// The sum of an `F16` or `BF16` tensor's raw 16-bit words, as `f64`: a
    /// checksum exact for any bits (NaNs included), the same on the host
    /// and on a device (summed there by a kernel where NVRTC is present).
    ///
    /// # Errors
    /// Another dtype (its [`sum`](Self::sum) is exact enough), or a failed
    /// CUDA step.
    pub fn raw_word_sum(&self) -> Result<f64, TensorError> {
        if !matches!(self.dtype, DType::F16 | DType::BF16) {
            return Err(TensorError::Mismatch(format!(
                "raw_word_sum is the checksum of 16-bit floats; this tensor is {}",
                self.dtype
            )));
        }
        if self.is_cuda() {
            if let Some(s) = self.sum_on_device() {
                return s;
            }
            return self.to_cpu()?.raw_word_sum();
        }
        self.with_bytes(|b| {
            b.chunks_exact(2)
                .map(|c| u16::from_ne_bytes([c[0], c[1]]) as f64)
                .sum::<f64>()
        })
    }

    /// The sum of a CUDA tensor by the device kernel of its dtype (the
    /// 16-bit floats' sums their raw words), or `None` without NVRTC.
    fn sum_on_device(&self) -> Option<Result<f64, TensorError>> {
        cuda::ops::nvrtc_available().ok()?;
        let (n, dtype) = (self.numel(), self.dtype);
        Some(
            self.with_device_buffer(|d| cuda::ops::sum(d.gpu(), dtype, d.device_ptr(), n))
                .and_then(|r| r.map_err(Into::into)),
        )
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
}
