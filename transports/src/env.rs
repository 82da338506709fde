//! The only reads of the environment in `rdt-transport` (the layout check
//! and review keep it so): every variable the crate reads is listed here.
//!
//! | variable | read by | what |
//! | --- | --- | --- |
//! | `RDT_NCCL_LIBRARY` | `nccl::api` | the NCCL library to load |
//! | `RDT_NIXL_LIBRARY`, `RDT_NIXL_DIR` | `nixl::api` | the NIXL C API library, or the folder `scripts/install-nixl.sh` filled |
//! | `XDG_CACHE_HOME`, `HOME` | `nixl::api` | where that folder is by default |
//! | `UCX_MEM_EVENTS` | `nixl` | left as the user set it; rdt sets its own default only where it is unset |
//! | `RDT_NIXL_READ_SPIN_US`, `RDT_HOT_WINDOW_US` | `hot` | tuning of the hot waits (see the book's Configuration page) |
//! | `CUDA_VISIBLE_DEVICES` | `cuda` | named in errors about devices |
//! | `RDT_SHM_TEST_CHILD` | `shm` tests | a test's child process |

use std::ffi::OsString;

fn get(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

fn get_os(name: &str) -> Option<OsString> {
    std::env::var_os(name).filter(|v| !v.is_empty())
}

/// `RDT_NCCL_LIBRARY`: the NCCL library to load, if set.
pub(crate) fn nccl_library() -> Option<String> {
    get("RDT_NCCL_LIBRARY").filter(|p| !p.is_empty())
}

/// `RDT_NIXL_LIBRARY`: the NIXL C API library to load, if set.
pub(crate) fn nixl_library() -> Option<String> {
    get("RDT_NIXL_LIBRARY")
}

/// `RDT_NIXL_DIR`: the folder `scripts/install-nixl.sh` filled, if set.
pub(crate) fn nixl_dir() -> Option<OsString> {
    get_os("RDT_NIXL_DIR")
}

/// The user's cache folder: `XDG_CACHE_HOME`, else `HOME/.cache`.
pub(crate) fn cache_home() -> Option<std::path::PathBuf> {
    get_os("XDG_CACHE_HOME")
        .map(std::path::PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| std::path::PathBuf::from(h).join(".cache")))
}

/// `UCX_MEM_EVENTS`, as the user set it.
pub(crate) fn ucx_mem_events() -> Option<OsString> {
    std::env::var_os("UCX_MEM_EVENTS")
}

/// One of the hot waits' tuning variables (`RDT_HOT_WINDOW_US`,
/// `RDT_NIXL_READ_SPIN_US`), as written.
pub(crate) fn hot_tuning(name: &'static str) -> Option<String> {
    debug_assert!(matches!(
        name,
        "RDT_HOT_WINDOW_US" | "RDT_NIXL_READ_SPIN_US"
    ));
    get(name)
}

/// `CUDA_VISIBLE_DEVICES`, for errors about devices.
pub(crate) fn cuda_visible_devices() -> String {
    get("CUDA_VISIBLE_DEVICES").unwrap_or_else(|| "<unset>".into())
}

/// Whether this process is a test's child (`RDT_SHM_TEST_CHILD`).
#[cfg(test)]
pub(crate) fn test_child(name: &'static str) -> bool {
    std::env::var_os(name).is_some()
}
