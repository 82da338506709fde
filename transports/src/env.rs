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
//! | `RDT_TIMELINE`, `RDT_CUDA_TRACE` | `cuda` | diagnostics printed to stderr |
//! | `CUDA_VISIBLE_DEVICES` | `cuda` | named in errors about devices |
//! | `RDT_SHM_TEST_CHILD` | `shm` tests | a test's child process |

use std::ffi::OsString;

/// The value of `name`, as [`std::env::var`].
pub(crate) fn var(name: &str) -> Result<String, std::env::VarError> {
    std::env::var(name)
}

/// The value of `name`, as [`std::env::var_os`].
pub(crate) fn var_os(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}
