//! NCCL's C API, opened at run time: the library is looked up by an
//! explicit path (`RDT_NCCL_LIBRARY`), then by the names it is installed
//! under (`libnccl.so.2`, which cudarc 0.19 never tries, then cudarc's own
//! candidates). Types and constants come from cudarc's `nccl::sys`; the
//! functions are ours, declared with `int` results (NCCL's enum may grow,
//! and a Rust enum must never hold a value it does not list).
//!
//! Nothing here panics on a missing library or symbol: `api()` says what is
//! missing and how to get it.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys::CUstream;
use cudarc::nccl::sys::{ncclComm_t, ncclConfig_t, ncclDataType_t, ncclUniqueId};

/// An NCCL call failed, or NCCL cannot be used in this process. The text
/// is NCCL's own (`ncclGetErrorString`, and `ncclGetLastError` where the
/// library had more to say).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("NCCL: {0}")]
pub struct NcclError(pub String);

/// `ncclResult_t` values rdt looks at.
pub(crate) mod result {
    pub const SUCCESS: i32 = 0;
    pub const IN_PROGRESS: i32 = 7;
}

/// The oldest NCCL rdt drives: non-blocking communicators, configs,
/// `ncclCommFinalize` and `ncclGetLastError` are there from 2.14,
/// `ncclCommSplit` with a config (and `splitShare`) from 2.18.
const MIN_VERSION: i32 = 21800;

/// Environment variable naming the NCCL library to load.
pub const LIBRARY_VAR: &str = "RDT_NCCL_LIBRARY";

type Res = c_int;

/// The NCCL functions rdt calls.
pub(crate) struct Api {
    _lib: libloading::Library,
    /// Where the library was found (for logs and errors).
    pub path: String,
    /// `ncclGetVersion`'s code (e.g. 22803).
    pub version: i32,
    pub get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> Res,
    pub comm_init_rank_config:
        unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int, *mut ncclConfig_t) -> Res,
    pub comm_get_async_error: unsafe extern "C" fn(ncclComm_t, *mut c_int) -> Res,
    pub comm_abort: unsafe extern "C" fn(ncclComm_t) -> Res,
    pub comm_split:
        unsafe extern "C" fn(ncclComm_t, c_int, c_int, *mut ncclComm_t, *mut ncclConfig_t) -> Res,
    pub comm_finalize: unsafe extern "C" fn(ncclComm_t) -> Res,
    pub comm_destroy: unsafe extern "C" fn(ncclComm_t) -> Res,
    pub group_start: unsafe extern "C" fn() -> Res,
    pub group_end: unsafe extern "C" fn() -> Res,
    pub send: unsafe extern "C" fn(
        *const c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        CUstream,
    ) -> Res,
    pub recv: unsafe extern "C" fn(
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        CUstream,
    ) -> Res,
    get_error_string: unsafe extern "C" fn(Res) -> *const c_char,
    get_last_error: unsafe extern "C" fn(ncclComm_t) -> *const c_char,
}

/// The library names tried, in order.
fn candidates() -> Vec<String> {
    let mut c = Vec::new();
    if let Some(p) = crate::env::nccl_library() {
        c.push(p);
    }
    c.push("libnccl.so.2".into());
    for n in cudarc::get_lib_name_candidates("nccl") {
        if !c.contains(&n) {
            c.push(n);
        }
    }
    c
}

/// NCCL, loaded once per process; the error says what is missing and how
/// to provide it.
pub(crate) fn api() -> Result<&'static Api, NcclError> {
    static API: OnceLock<Result<Api, NcclError>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Api, NcclError> {
    let tried = candidates();
    // SAFETY: loading NCCL runs its (well-behaved) initializers.
    let (lib, path) = unsafe { crate::rt::dynlib::open_first(&tried) }.map_err(|_| {
        NcclError(format!(
            "the NCCL library was not found (tried {}); install NCCL 2.18 or newer \
                 (the libnccl2 package, or `pip install nvidia-nccl-cu13`) and put it on \
                 the loader path, or set {LIBRARY_VAR} to the file's path",
            tried.join(", ")
        ))
    })?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the declared type is the function's C signature
            // (nccl.h), with `int` for `ncclResult_t`.
            *unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                NcclError(format!(
                    "{path} lacks {}: NCCL 2.18 or newer is needed ({e})",
                    $name
                ))
            })?
        };
    }
    let get_version: unsafe extern "C" fn(*mut c_int) -> Res = sym!("ncclGetVersion");
    let mut version = 0;
    // SAFETY: valid out-pointer.
    unsafe { get_version(&mut version) };
    if version < MIN_VERSION {
        return Err(NcclError(format!(
            "{path} is NCCL {}, rdt needs 2.18 or newer",
            version_string(version)
        )));
    }
    let api = Api {
        path: path.clone(),
        version,
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank_config: sym!("ncclCommInitRankConfig"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        comm_abort: sym!("ncclCommAbort"),
        comm_split: sym!("ncclCommSplit"),
        comm_finalize: sym!("ncclCommFinalize"),
        comm_destroy: sym!("ncclCommDestroy"),
        group_start: sym!("ncclGroupStart"),
        group_end: sym!("ncclGroupEnd"),
        send: sym!("ncclSend"),
        recv: sym!("ncclRecv"),
        get_error_string: sym!("ncclGetErrorString"),
        get_last_error: sym!("ncclGetLastError"),
        _lib: lib,
    };
    tracing::debug!("NCCL {} from {path}", version_string(version));
    Ok(api)
}

/// `22803` as `2.28.3`.
pub(crate) fn version_string(code: i32) -> String {
    let (major, rest) = (code / 10000, code % 10000);
    format!("{major}.{}.{}", rest / 100, rest % 100)
}

impl Api {
    /// NCCL's name for result `r`.
    fn result_name(r: Res) -> &'static str {
        match r {
            0 => "ncclSuccess",
            1 => "ncclUnhandledCudaError",
            2 => "ncclSystemError",
            3 => "ncclInternalError",
            4 => "ncclInvalidArgument",
            5 => "ncclInvalidUsage",
            6 => "ncclRemoteError",
            7 => "ncclInProgress",
            _ => "unknown ncclResult_t",
        }
    }

    /// The error of call `what`, which returned `r`, in NCCL's words:
    /// the result's name and text, and what NCCL last logged for `comm`
    /// (or for the process, when `comm` is null).
    pub(crate) fn error(&self, what: &str, r: Res, comm: ncclComm_t) -> NcclError {
        // SAFETY: NCCL returns static (or thread-local) strings, or null.
        let text = unsafe { cstr((self.get_error_string)(r)) };
        // SAFETY: as above; a null comm asks for the process's last error.
        let last = unsafe { cstr((self.get_last_error)(comm)) };
        let mut m = format!("{what} failed: {} ({text})", Self::result_name(r));
        if !last.is_empty() && last != text {
            m.push_str(": ");
            m.push_str(&last);
        }
        NcclError(m)
    }

    /// A config for the blocking communicator transfers run on, split from
    /// the joined one and sharing its resources (`splitShare`).
    pub(crate) fn blocking_split_config() -> ncclConfig_t {
        let mut c = Self::nonblocking_config();
        c.blocking = 1;
        c.splitShare = 1;
        c
    }

    /// A config for a non-blocking communicator: NCCL_CONFIG_INITIALIZER
    /// (every field left to NCCL) with `blocking = 0`.
    pub(crate) fn nonblocking_config() -> ncclConfig_t {
        // SAFETY: a plain C struct of integers and pointers; every field is
        // set below, as NCCL_CONFIG_INITIALIZER does.
        let mut c: ncclConfig_t = unsafe { std::mem::zeroed() };
        c.size = std::mem::size_of::<ncclConfig_t>();
        c.magic = 0xcafe_beef;
        // The layout cudarc's bindings describe (NCCL 2.30); an older
        // library copies the prefix it knows (it reads `size`).
        c.version = 23000;
        c.blocking = 0;
        c.cgaClusterSize = i32::MIN;
        c.minCTAs = i32::MIN;
        c.maxCTAs = i32::MIN;
        c.netName = std::ptr::null();
        c.splitShare = i32::MIN;
        c.trafficClass = i32::MIN;
        c.commName = std::ptr::null();
        c.collnetEnable = i32::MIN;
        c.CTAPolicy = i32::MIN;
        c.shrinkShare = i32::MIN;
        c.nvlsCTAs = i32::MIN;
        c.nChannelsPerNetPeer = i32::MIN;
        c.nvlinkCentricSched = i32::MIN;
        c.graphUsageMode = i32::MIN;
        c.numRmaCtx = i32::MIN;
        c.maxP2pPeers = i32::MIN;
        c
    }
}

/// # Safety
/// `p` is null or a NUL-terminated string.
unsafe fn cstr(p: *const c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the caller's promise.
    unsafe { CStr::from_ptr(p) }
        .to_string_lossy()
        .trim()
        .to_string()
}

/// Is NCCL loadable here? `Ok` with its version and path, or why not.
pub fn available() -> Result<String, NcclError> {
    let a = api()?;
    Ok(format!("NCCL {} ({})", version_string(a.version), a.path))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_read_as_people_write_them() {
        assert_eq!(version_string(22803), "2.28.3");
        assert_eq!(version_string(21403), "2.14.3");
    }

    #[test]
    fn a_missing_library_is_an_error_that_says_what_to_do() {
        // Where NCCL is installed this checks nothing more than that it
        // loads; where it is not, the error must name the fix.
        match available() {
            Ok(v) => assert!(v.starts_with("NCCL 2."), "{v}"),
            Err(e) => {
                assert!(e.0.contains(LIBRARY_VAR), "{e}");
                assert!(e.0.contains("libnccl.so.2"), "{e}");
            }
        }
    }

    #[test]
    fn the_config_is_nccls_initializer_with_blocking_off() {
        let c = Api::nonblocking_config();
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.size, std::mem::size_of::<ncclConfig_t>());
        assert_eq!(c.minCTAs, i32::MIN, "left to NCCL");
    }
}
