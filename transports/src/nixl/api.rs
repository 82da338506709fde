//! NIXL's C API (`libnixl_capi.so`), opened at run time with our own
//! declarations: no bindgen, so nothing about NIXL is needed to build rdt
//! (the book's NIXL chapter says why this and not `nixl-sys`).
//!
//! The library is looked up by an explicit path (`RDT_NIXL_LIBRARY`), then
//! in a folder `pip install --no-deps --target DIR nixl-cu13` filled
//! (`RDT_NIXL_DIR`, then the folder `scripts/install-nixl.sh` fills by
//! default), then by its bare name on the loader path. The wheel's
//! libraries find one another, the UCX plugin and their private UCX through
//! their own `$ORIGIN` paths, so no `LD_LIBRARY_PATH` is needed.
//!
//! The declarations follow `wrapper.h` of NIXL 1.5 (the functions rdt
//! calls, with `int` results: the enum may grow, and a Rust enum must never
//! hold a value it does not list). Nothing here panics on a missing library
//! or symbol: `api()` says what is missing and how to install it.

use std::ffi::{c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

/// Environment variable naming `libnixl_capi.so` itself.
pub const LIBRARY_VAR: &str = "RDT_NIXL_LIBRARY";
/// Environment variable naming the folder `pip install --no-deps --target`
/// installed `nixl-cu13` into.
pub const DIR_VAR: &str = "RDT_NIXL_DIR";
/// The `nixl-cu13` release these declarations are written against (its C
/// API is that of `nixl-sys` 1.5).
pub const PINNED_RELEASE: &str = "1.5.1";

/// Where, inside a `pip --target` folder, the wheel puts its libraries.
const WHEEL_LIBS: &str = ".nixl_cu13.mesonpy.libs";

/// `nixl_capi_status_t` values rdt looks at.
pub(crate) mod status {
    pub const SUCCESS: i32 = 0;
    pub const IN_PROG: i32 = 1;

    /// The status's name in `wrapper.h`, for error messages.
    pub fn name(s: i32) -> &'static str {
        match s {
            0 => "NIXL_CAPI_SUCCESS",
            1 => "NIXL_CAPI_IN_PROG",
            -1 => "NIXL_CAPI_ERROR_INVALID_PARAM",
            -2 => "NIXL_CAPI_ERROR_BACKEND",
            -3 => "NIXL_CAPI_ERROR_INVALID_STATE",
            -4 => "NIXL_CAPI_ERROR_EXCEPTION",
            -5 => "NIXL_CAPI_ERROR_NO_TELEMETRY",
            -6 => "NIXL_CAPI_ERROR_NOT_FOUND",
            _ => "an unknown NIXL status",
        }
    }
}

/// `nixl_capi_mem_type_t`.
pub(crate) mod mem {
    pub const DRAM: i32 = 0;
    pub const VRAM: i32 = 1;
}

/// `nixl_capi_xfer_op_t`.
pub(crate) const XFER_OP_READ: i32 = 0;

/// Opaque handles of the C API (pointers to its structs).
pub(crate) type Agent = *mut c_void;
pub(crate) type Params = *mut c_void;
pub(crate) type MemList = *mut c_void;
pub(crate) type Backend = *mut c_void;
pub(crate) type OptArgs = *mut c_void;
pub(crate) type XferDlist = *mut c_void;
pub(crate) type RegDlist = *mut c_void;
pub(crate) type XferReq = *mut c_void;
pub(crate) type NotifMap = *mut c_void;

type St = c_int;

/// `nixl_capi_agent_config_t` of NIXL 1.5 (`listen_port` became an `int`
/// in May 2026, before 1.5.0; `num_workers` is not read by the C API).
#[repr(C)]
pub(crate) struct AgentConfig {
    pub enable_prog_thread: bool,
    pub enable_listen_thread: bool,
    pub listen_port: c_int,
    /// `nixl_capi_thread_sync_t`: 0 is none (rdt serializes its calls).
    pub thread_sync: c_int,
    pub num_workers: std::ffi::c_uint,
    pub pthr_delay_us: u64,
    pub lthr_delay_us: u64,
    pub capture_telemetry: bool,
}

/// The NIXL functions rdt calls.
pub(crate) struct Api {
    _lib: libloading::Library,
    /// Where the library was found (for logs and errors).
    pub path: String,
    pub create_configured_agent:
        unsafe extern "C" fn(*const c_char, *const AgentConfig, *mut Agent) -> St,
    pub destroy_agent: unsafe extern "C" fn(Agent) -> St,
    pub get_plugin_params:
        unsafe extern "C" fn(Agent, *const c_char, *mut MemList, *mut Params) -> St,
    pub destroy_mem_list: unsafe extern "C" fn(MemList) -> St,
    pub destroy_params: unsafe extern "C" fn(Params) -> St,
    pub create_backend: unsafe extern "C" fn(Agent, *const c_char, Params, *mut Backend) -> St,
    pub destroy_backend: unsafe extern "C" fn(Backend) -> St,
    pub get_local_partial_md:
        unsafe extern "C" fn(Agent, RegDlist, *mut *mut c_void, *mut usize, OptArgs) -> St,
    pub load_remote_md: unsafe extern "C" fn(Agent, *const c_void, usize, *mut *mut c_char) -> St,
    pub invalidate_remote_md: unsafe extern "C" fn(Agent, *const c_char) -> St,
    pub create_opt_args: unsafe extern "C" fn(*mut OptArgs) -> St,
    pub destroy_opt_args: unsafe extern "C" fn(OptArgs) -> St,
    pub opt_args_add_backend: unsafe extern "C" fn(OptArgs, Backend) -> St,
    pub opt_args_set_notif_msg: unsafe extern "C" fn(OptArgs, *const c_void, usize) -> St,
    pub opt_args_set_has_notif: unsafe extern "C" fn(OptArgs, bool) -> St,
    pub create_reg_dlist: unsafe extern "C" fn(c_int, *mut RegDlist) -> St,
    pub destroy_reg_dlist: unsafe extern "C" fn(RegDlist) -> St,
    pub reg_dlist_add_desc:
        unsafe extern "C" fn(RegDlist, usize, usize, u64, *const c_void, usize) -> St,
    pub register_mem: unsafe extern "C" fn(Agent, RegDlist, OptArgs) -> St,
    pub deregister_mem: unsafe extern "C" fn(Agent, RegDlist, OptArgs) -> St,
    pub create_xfer_dlist: unsafe extern "C" fn(c_int, *mut XferDlist) -> St,
    pub destroy_xfer_dlist: unsafe extern "C" fn(XferDlist) -> St,
    pub xfer_dlist_add_desc: unsafe extern "C" fn(XferDlist, usize, usize, u64) -> St,
    pub create_xfer_req: unsafe extern "C" fn(
        Agent,
        c_int,
        XferDlist,
        XferDlist,
        *const c_char,
        *mut XferReq,
        OptArgs,
    ) -> St,
    pub post_xfer_req: unsafe extern "C" fn(Agent, XferReq, OptArgs) -> St,
    pub get_xfer_status: unsafe extern "C" fn(Agent, XferReq) -> St,
    pub release_xfer_req: unsafe extern "C" fn(Agent, XferReq) -> St,
    pub destroy_xfer_req: unsafe extern "C" fn(XferReq) -> St,
    pub create_notif_map: unsafe extern "C" fn(*mut NotifMap) -> St,
    pub destroy_notif_map: unsafe extern "C" fn(NotifMap) -> St,
    pub get_notifs: unsafe extern "C" fn(Agent, NotifMap, OptArgs) -> St,
    pub gen_notif: unsafe extern "C" fn(Agent, *const c_char, *const c_void, usize, OptArgs) -> St,
    pub notif_map_size: unsafe extern "C" fn(NotifMap, *mut usize) -> St,
    pub notif_map_get_agent_at: unsafe extern "C" fn(NotifMap, usize, *mut *const c_char) -> St,
    pub notif_map_get_notifs_size: unsafe extern "C" fn(NotifMap, *const c_char, *mut usize) -> St,
    pub notif_map_get_notif:
        unsafe extern "C" fn(NotifMap, *const c_char, usize, *mut *const c_void, *mut usize) -> St,
    pub notif_map_clear: unsafe extern "C" fn(NotifMap) -> St,
}

/// The folder `scripts/install-nixl.sh` installs into when given none:
/// `$XDG_CACHE_HOME/rdt/nixl-cu13-<release>` (or under `~/.cache`).
pub fn default_dir() -> Option<PathBuf> {
    let cache = crate::env::cache_home()?;
    Some(
        cache
            .join("rdt")
            .join(format!("nixl-cu13-{PINNED_RELEASE}")),
    )
}

/// The library paths tried, in order.
fn candidates() -> Vec<String> {
    let mut c = Vec::new();
    let mut push = |p: String| {
        if !p.is_empty() && !c.contains(&p) {
            c.push(p);
        }
    };
    if let Some(p) = crate::env::nixl_library() {
        push(p);
    }
    let dirs = crate::env::nixl_dir()
        .map(PathBuf::from)
        .into_iter()
        .chain(default_dir());
    for d in dirs {
        push(
            d.join(WHEEL_LIBS)
                .join("libnixl_capi.so")
                .display()
                .to_string(),
        );
        push(d.join("libnixl_capi.so").display().to_string());
    }
    push("libnixl_capi.so".into());
    c
}

/// Why NIXL cannot be used, with how to install it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("NIXL: {0}")]
pub struct NixlError(pub String);

/// NIXL, loaded once per process.
pub(crate) fn api() -> Result<&'static Api, NixlError> {
    static API: OnceLock<Result<Api, NixlError>> = OnceLock::new();
    API.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<Api, NixlError> {
    let tried = candidates();
    // SAFETY: loading NIXL runs its (well-behaved) initializers.
    let (lib, path) = unsafe { crate::rt::dynlib::open_first(&tried) }.map_err(|errors| {
        NixlError(format!(
            "libnixl_capi.so was not found ({}). Install NIXL with \
                 `scripts/install-nixl.sh` (it runs `pip install --no-deps --target DIR \
                 nixl-cu13=={PINNED_RELEASE}`), or point {DIR_VAR} at such a folder, or \
                 {LIBRARY_VAR} at the library itself",
            errors.join("; ")
        ))
    })?;
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: the symbol is declared with the signature of NIXL 1.5's
            // wrapper.h (the field's type), which this library exports.
            let s = unsafe { lib.get(concat!($name, "\0").as_bytes()) }.map_err(|e| {
                NixlError(format!(
                    "{path} has no {}: {e}; rdt needs the C API of nixl-cu13 {PINNED_RELEASE}",
                    $name
                ))
            })?;
            *s
        }};
    }
    Ok(Api {
        create_configured_agent: sym!("nixl_capi_create_configured_agent"),
        destroy_agent: sym!("nixl_capi_destroy_agent"),
        get_plugin_params: sym!("nixl_capi_get_plugin_params"),
        destroy_mem_list: sym!("nixl_capi_destroy_mem_list"),
        destroy_params: sym!("nixl_capi_destroy_params"),
        create_backend: sym!("nixl_capi_create_backend"),
        destroy_backend: sym!("nixl_capi_destroy_backend"),
        get_local_partial_md: sym!("nixl_capi_get_local_partial_md"),
        load_remote_md: sym!("nixl_capi_load_remote_md"),
        invalidate_remote_md: sym!("nixl_capi_invalidate_remote_md"),
        create_opt_args: sym!("nixl_capi_create_opt_args"),
        destroy_opt_args: sym!("nixl_capi_destroy_opt_args"),
        opt_args_add_backend: sym!("nixl_capi_opt_args_add_backend"),
        opt_args_set_notif_msg: sym!("nixl_capi_opt_args_set_notif_msg"),
        opt_args_set_has_notif: sym!("nixl_capi_opt_args_set_has_notif"),
        create_reg_dlist: sym!("nixl_capi_create_reg_dlist"),
        destroy_reg_dlist: sym!("nixl_capi_destroy_reg_dlist"),
        reg_dlist_add_desc: sym!("nixl_capi_reg_dlist_add_desc"),
        register_mem: sym!("nixl_capi_register_mem"),
        deregister_mem: sym!("nixl_capi_deregister_mem"),
        create_xfer_dlist: sym!("nixl_capi_create_xfer_dlist"),
        destroy_xfer_dlist: sym!("nixl_capi_destroy_xfer_dlist"),
        xfer_dlist_add_desc: sym!("nixl_capi_xfer_dlist_add_desc"),
        create_xfer_req: sym!("nixl_capi_create_xfer_req"),
        post_xfer_req: sym!("nixl_capi_post_xfer_req"),
        get_xfer_status: sym!("nixl_capi_get_xfer_status"),
        release_xfer_req: sym!("nixl_capi_release_xfer_req"),
        destroy_xfer_req: sym!("nixl_capi_destroy_xfer_req"),
        create_notif_map: sym!("nixl_capi_create_notif_map"),
        destroy_notif_map: sym!("nixl_capi_destroy_notif_map"),
        get_notifs: sym!("nixl_capi_get_notifs"),
        gen_notif: sym!("nixl_capi_gen_notif"),
        notif_map_size: sym!("nixl_capi_notif_map_size"),
        notif_map_get_agent_at: sym!("nixl_capi_notif_map_get_agent_at"),
        notif_map_get_notifs_size: sym!("nixl_capi_notif_map_get_notifs_size"),
        notif_map_get_notif: sym!("nixl_capi_notif_map_get_notif"),
        notif_map_clear: sym!("nixl_capi_notif_map_clear"),
        path: path.clone(),
        _lib: lib,
    })
}

/// Turns a status into `Ok` or an error naming the call.
pub(crate) fn check(what: &str, s: St) -> Result<(), NixlError> {
    if s == status::SUCCESS {
        Ok(())
    } else {
        Err(NixlError(format!(
            "{what} failed: {} ({s})",
            status::name(s)
        )))
    }
}
