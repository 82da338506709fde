//! Memory: host memory pinned for copies ([`pin_host`], [`unpin_host`],
//! [`is_pinned`]), device allocation, fills and copies on rdt's stream,
//! and the [`DeviceBuffer`] behind a CUDA tensor.

use super::gpu::any_gpu_made;
use super::*;

/// Page-locks `len` bytes of host memory at `ptr` for every context of
/// the process (`CU_MEMHOSTREGISTER_PORTABLE`): device copies to and from
/// it run at copy-engine speed, where pageable memory is staged by the
/// driver. Returns whether it pinned: a process that has set up no device
/// yet pins nothing (registering needs a current context, and making one
/// only for this would cost a CPU-only process a device context). Undo
/// with [`unpin_host`] before the memory is unmapped.
///
/// # Safety
/// `ptr..ptr+len` is mapped host memory that stays mapped until
/// [`unpin_host`] is called on `ptr`.
pub unsafe fn pin_host(ptr: *mut u8, len: usize) -> Result<bool, CudaError> {
    available()?;
    let Some(g) = any_gpu_made() else {
        return Ok(false);
    };
    // Without a current context on this thread the call fails with
    // CUDA_ERROR_INVALID_CONTEXT (seen on a driver thread, H200).
    g.bind()?;
    // SAFETY: the caller's promise.
    unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, 0x01) }
        .result()
        .map(|()| true)
        .map_err(|e| CudaError::call(&format!("cuMemHostRegister of {len} B"), e))
}

/// Undoes [`pin_host`].
///
/// # Safety
/// `ptr` was pinned with [`pin_host`] and is still mapped.
pub unsafe fn unpin_host(ptr: *mut u8) {
    // Needs a current context too; `pin_host` made sure one exists.
    if let Some(g) = any_gpu_made() {
        let _ = g.bind();
    }
    // SAFETY: the caller's promise.
    let _ = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
}

/// Address ranges of pinned host buffers ([`host_pool`]'s, in the pool or
/// out): a copy from one may still read it after the call that enqueued
/// it returned (HP-4).
static PINNED: Mutex<Vec<(usize, usize)>> = Mutex::new(Vec::new());

/// Is `ptr` inside a pinned pool buffer (HP-4)?
pub fn is_pinned(ptr: *const u8) -> bool {
    let a = ptr as usize;
    PINNED.lock().iter().any(|&(s, l)| a >= s && a < s + l)
}

/// `len` bytes at `start` were pinned for the host pool (HP-4).
pub(super) fn add_pinned(start: usize, len: usize) {
    PINNED.lock().push((start, len));
}

/// The pinned buffer at `start` leaves the pool to be unmapped.
pub(super) fn forget_pinned(start: usize) {
    PINNED.lock().retain(|&(a, _)| a != start);
}

/// Bytes of pinned host buffers now, idle or in use.
pub(super) fn pinned_bytes() -> usize {
    PINNED.lock().iter().map(|&(_, l)| l).sum()
}

impl Gpu {
    /// Bytes of device memory free now (`cuMemGetInfo`).
    pub(crate) fn free_bytes(&self) -> Result<usize, CudaError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the context is bound.
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }
            .result()
            .map_err(|e| CudaError::call("cuMemGetInfo", e))?;
        Ok(free)
    }

    /// Allocates `len` bytes with `cuMemAlloc` (IPC-capable).
    pub(crate) fn malloc(&self, len: usize) -> Result<u64, CudaError> {
        self.bind()?;
        // SAFETY: plain allocation in the bound context.
        unsafe { cu::malloc_sync(len.max(1)) }
            .map_err(|e| CudaError::call(&format!("cuMemAlloc of {len} bytes on {}", self.uuid), e))
    }

    /// Enqueues a fill of `[ptr, ptr+len)` with the repeated `pattern`
    /// (1, 2, 4 or 8 bytes).
    pub(crate) fn fill(&self, ptr: u64, len: usize, pattern: &[u8]) -> Result<(), CudaError> {
        self.bind()?;
        let s = self.stream.0;
        // SAFETY: the caller owns `[ptr, ptr+len)` on this device; sizes are
        // whole elements of the pattern's size.
        let r = unsafe {
            match pattern.len() {
                1 => sys::cuMemsetD8Async(ptr, pattern[0], len, s),
                2 => sys::cuMemsetD16Async(
                    ptr,
                    u16::from_ne_bytes([pattern[0], pattern[1]]),
                    len / 2,
                    s,
                ),
                4 => sys::cuMemsetD32Async(
                    ptr,
                    u32::from_ne_bytes(pattern.try_into().expect("4 bytes")),
                    len / 4,
                    s,
                ),
                8 => {
                    let lo = u32::from_ne_bytes(pattern[..4].try_into().expect("4 bytes"));
                    let hi = u32::from_ne_bytes(pattern[4..].try_into().expect("4 bytes"));
                    let n = len / 8;
                    if n == 0 {
                        sys::CUresult::CUDA_SUCCESS
                    } else {
                        // Two strided fills: the low words, then the high.
                        let r = sys::cuMemsetD2D32Async(ptr, 8, lo, 1, n, s);
                        if r != sys::CUresult::CUDA_SUCCESS {
                            r
                        } else {
                            sys::cuMemsetD2D32Async(ptr + 4, 8, hi, 1, n, s)
                        }
                    }
                }
                n => return Err(CudaError(format!("no fill for {n}-byte elements"))),
            }
        };
        r.result().map_err(|e| CudaError::call("cuMemset", e))?;
        self.enqueued();
        Ok(())
    }

    /// Enqueues a host-to-device copy. Returns once `src` may be reused
    /// (CUDA stages pageable memory before returning).
    pub(crate) fn copy_htod(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` holds `src.len()` bytes on this device; pageable
        // sources are staged before the call returns, pinned pool buffers
        // are waited for below.
        unsafe { cu::memcpy_htod_async(dst, src, self.stream.0) }
            .map_err(|e| CudaError::call("cuMemcpyHtoDAsync", e))?;
        self.enqueued();
        // host_pool HP-4: the copy may still read a pinned buffer, which the
        // caller may hand back to the pool as soon as this returns.
        if is_pinned(src.as_ptr()) {
            self.synchronize()?;
        }
        Ok(())
    }

    /// Copies device bytes to the host, waiting for the copy (and for
    /// everything enqueued before it).
    pub(crate) fn copy_dtoh(&self, dst: &mut [u8], src: u64) -> Result<(), CudaError> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `src` holds `dst.len()` bytes; the sync below finishes the
        // copy before `dst` is used.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.stream.0) }
            .map_err(|e| CudaError::call("cuMemcpyDtoHAsync", e))?;
        self.enqueued();
        self.synchronize()
    }

    /// Enqueues a copy of `len` device bytes at `src` to host memory at
    /// `dst`; [`synchronize`](Self::synchronize) waits for it. Pinned `dst`
    /// ([`pin_host`]) runs at copy-engine speed.
    ///
    /// # Safety
    /// `dst` is valid for `len` bytes of writes, and nothing else touches
    /// them until the copy is waited for.
    pub(crate) unsafe fn enqueue_dtoh(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<(), CudaError> {
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller's promise for `dst`; `src` holds `len` bytes.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.stream.0) }
            .result()
            .map_err(|e| CudaError::call("cuMemcpyDtoHAsync", e))?;
        self.enqueued();
        Ok(())
    }

    /// Enqueues a device-to-device copy (any devices this context can reach
    /// through unified addressing).
    pub fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller guarantees both ranges.
        unsafe { cu::memcpy_dtod_async(dst, src, len, self.stream.0) }
            .map_err(|e| CudaError::call("cuMemcpyDtoDAsync", e))?;
        self.enqueued();
        Ok(())
    }
}

/// Device memory behind a CUDA tensor's storage: a range of an rdt slab
/// ([`alloc`]) or of a mapping another process exported
/// ([`cuda_ipc`](crate::cuda_ipc)).
///
/// # Safety
///
/// [`Tensor`](crate::Tensor)'s safe operations (copies, fills, transfers)
/// launch work on this memory through the address this gives, so an
/// implementation must make sure that:
/// - [`device_ptr`](Self::device_ptr) and [`len`](Self::len) describe one
///   range of `len` bytes of device memory, usable in the context of
///   [`gpu`](Self::gpu) (allocated in it, or mapped into it), from the
///   value's creation until it is dropped (both return the same every
///   time);
/// - the memory stays allocated until the value is dropped, and dropping
///   it frees the memory only after the work queued on it (on `gpu()`'s
///   stream) has finished.
pub unsafe trait DeviceBuffer: Send + Sync + 'static {
    /// Device address of the first byte.
    fn device_ptr(&self) -> u64;
    /// Number of bytes.
    fn len(&self) -> usize;
    /// Is it empty?
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The GPU (context and stream) ops on this memory run on.
    fn gpu(&self) -> &Arc<Gpu>;
    /// A short description for debugging.
    fn describe(&self) -> String;
    /// The concrete buffer, so that a transport can recognize its own.
    fn as_any(&self) -> &dyn std::any::Any;
}
