//! The only reads of the environment in `rdt` (review keeps it so): every
//! variable the crate reads is listed here; the book's Configuration page
//! documents them.
//!
//! | variable | read by | what |
//! | --- | --- | --- |
//! | `RDT_GPUS`, `CUDA_VISIBLE_DEVICES` | the driver | the pool of devices actors are placed on |
//! | `RDT_TOKEN`, `RDT_TLS_CA` | a worker started by hand | its join token; the CA it trusts for the driver's TLS |
//! | `RDT_WORKER_SOCKET`, `RDT_WORKER_SECRET`, `RDT_WORKER_ID`, `RDT_WORKER_PARENT_PID` | a worker the driver started | set by the driver at spawn |
//! | `RDT_PEER_DELIVERY`, `RDT_LARGE_TRANSFER_BYTES` | the driver | defaults of `RuntimeBuilder::peer_delivery` and `large_transfer_bytes` |
//! | `RDT_STRAIGHT_LARGE` | workers | default of `RuntimeBuilder::straight_large_values` |
//! | `RDT_CONTROL_THREADS` | workers | threads of a worker's control runtime |
//! | `RDT_STREAM_MIN` | both | the smallest blob streamed apart from its frame |
//! | `RDT_HEAP_DEFAULTS`, `GLIBC_TUNABLES` | workers | leave glibc's heap settings as they are |

use std::ffi::OsString;

/// The value of `name`, as [`std::env::var`].
pub(crate) fn var(name: &str) -> Result<String, std::env::VarError> {
    std::env::var(name)
}

/// The value of `name`, as [`std::env::var_os`].
pub(crate) fn var_os(name: &str) -> Option<OsString> {
    std::env::var_os(name)
}
