//! CUDA tensors: device memory, the ready events of other streams, copies
//! across devices, and [`DeviceBytes`].

use super::*;

use crate::cuda;

impl Tensor {
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
            // One copy, straight from the source's memory.
            (false, false) => self.copy_host_from(src),
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
