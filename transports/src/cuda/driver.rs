//! The driver API: [`CudaError`], the driver symbols rdt calls, and
//! whether CUDA is usable here ([`available`], [`device_count`]).

use super::*;

/// A CUDA operation failed, or CUDA is not usable in this process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CUDA: {0}")]
pub struct CudaError(pub String);

impl CudaError {
    pub(crate) fn call(what: &str, e: cu::DriverError) -> Self {
        let name = e
            .error_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0));
        let text = e
            .error_string()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        CudaError(format!("{what} failed: {name} ({text})"))
    }
}

/// Driver symbols this crate calls. All are checked before first use.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetUuid",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuCtxEnablePeerAccess",
    "cuStreamCreate",
    "cuStreamCreateWithPriority",
    "cuCtxGetStreamPriorityRange",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuEventSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemGetInfo_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyPeerAsync",
    "cuMemsetD8Async",
    "cuMemsetD16Async",
    "cuMemsetD32Async",
    "cuMemsetD2D32Async",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuIpcGetEventHandle",
    "cuIpcOpenEventHandle",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// Is CUDA usable here? Checks, once per process, that `libcuda` loads, that
/// it has every symbol rdt uses, that `cuInit` succeeds and that a device is
/// visible. The error says which of these failed.
pub fn available() -> Result<(), CudaError> {
    static STATE: OnceLock<Result<(), CudaError>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            // SAFETY: only tries to load the library (no symbol is called).
            if !unsafe { sys::is_culib_present() } {
                return Err(CudaError(
                    "libcuda (the NVIDIA driver library) was not found on the loader path: \
                     this machine has no NVIDIA driver, or LD_LIBRARY_PATH misses it"
                        .into(),
                ));
            }
            // SAFETY: the library is present (checked above); looking a
            // symbol up calls nothing.
            let lib = unsafe { sys::culib() };
            for s in SYMBOLS {
                // SAFETY: a lookup only; the pointer is never called here.
                if unsafe { lib.get::<*const ()>(s.as_bytes()) }.is_err() {
                    return Err(CudaError(format!(
                        "libcuda lacks the symbol {s}: the NVIDIA driver is too old for rdt (CUDA 12 or newer needed)"
                    )));
                }
            }
            cu::init().map_err(|e| CudaError::call("cuInit", e))?;
            let n = cu::device::get_count().map_err(|e| CudaError::call("cuDeviceGetCount", e))?;
            if n <= 0 {
                return Err(CudaError(format!(
                    "no CUDA device is visible (CUDA_VISIBLE_DEVICES={})",
                    crate::env::cuda_visible_devices()
                )));
            }
            Ok(())
        })
        .clone()
}

/// Number of CUDA devices visible to this process (0 if CUDA is not usable).
pub fn device_count() -> usize {
    if available().is_err() {
        return 0;
    }
    cu::device::get_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}
