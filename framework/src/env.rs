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
//! | `RDT_TIMELINE` | workers | record the timeline (`rdt::timeline`) |

/// Names of the environment variables a local worker is started with,
/// and the two a worker started by hand reads.
pub(crate) mod worker_names {
    pub const SOCKET: &str = "RDT_WORKER_SOCKET";
    pub const SECRET: &str = "RDT_WORKER_SECRET";
    pub const WORKER_ID: &str = "RDT_WORKER_ID";
    pub const PARENT_PID: &str = "RDT_WORKER_PARENT_PID";
    pub const ALL: [&str; 4] = [SOCKET, SECRET, WORKER_ID, PARENT_PID];
    /// The secret of a worker started by hand (`--rdt-token` puts it in
    /// the process's argument list, visible to other users; prefer this).
    pub const TOKEN: &str = "RDT_TOKEN";
    /// PEM file of the certificate(s) to trust for a TLS control link
    /// (or `--rdt-tls-ca PATH`); without it the link is plain TCP.
    pub const TLS_CA: &str = "RDT_TLS_CA";
}

use worker_names as worker_env;

fn get(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// `RDT_GPUS`: the device pool, as the user listed it.
pub(crate) fn gpus() -> Option<String> {
    get("RDT_GPUS")
}

/// `CUDA_VISIBLE_DEVICES`: the device pool when `RDT_GPUS` is unset.
pub(crate) fn cuda_visible_devices() -> Option<String> {
    get("CUDA_VISIBLE_DEVICES")
}

/// Whether the driver started this process as a worker
/// (`RDT_WORKER_SOCKET` is set).
pub(crate) fn is_spawned_worker() -> bool {
    std::env::var_os(worker_env::SOCKET).is_some()
}

/// One of the variables the driver sets for a worker it spawns
/// (`protocol::boot::env`).
pub(crate) fn spawned_worker(name: &'static str) -> Option<String> {
    debug_assert!(worker_env::ALL.contains(&name));
    get(name)
}

/// Forgets the variables the driver set for this worker, so that its
/// children do not think they are workers.
pub(crate) fn forget_spawned_worker() {
    for k in worker_env::ALL {
        std::env::remove_var(k);
    }
}

/// `RDT_TOKEN`: the join token of a worker started by hand.
pub(crate) fn token() -> Option<String> {
    get(worker_env::TOKEN)
}

/// `RDT_TLS_CA`: the CA file a worker started by hand trusts.
pub(crate) fn tls_ca() -> Option<String> {
    get(worker_env::TLS_CA)
}

/// `RDT_PEER_DELIVERY`: the default of `RuntimeBuilder::peer_delivery`
/// (`0` turns it off).
pub(crate) fn peer_delivery() -> Option<bool> {
    get("RDT_PEER_DELIVERY").map(|v| v.trim() != "0")
}

/// `RDT_LARGE_TRANSFER_BYTES`: the default of
/// `RuntimeBuilder::large_transfer_bytes`.
pub(crate) fn large_transfer_bytes() -> Option<usize> {
    get("RDT_LARGE_TRANSFER_BYTES").and_then(|v| v.trim().parse().ok())
}

/// `RDT_STRAIGHT_LARGE`: the default of
/// `RuntimeBuilder::straight_large_values` (`0` or `1`).
pub(crate) fn straight_large() -> Option<bool> {
    match get("RDT_STRAIGHT_LARGE").as_deref().map(str::trim) {
        Some("0") => Some(false),
        Some("1") => Some(true),
        _ => None,
    }
}

/// `RDT_CONTROL_THREADS`, as written.
pub(crate) fn control_threads() -> Option<String> {
    get("RDT_CONTROL_THREADS")
}

/// `RDT_STREAM_MIN`, as written.
pub(crate) fn stream_min() -> Option<String> {
    get("RDT_STREAM_MIN")
}

/// `RDT_HEAP_DEFAULTS=1`: leave glibc's heap settings alone.
pub(crate) fn heap_defaults() -> bool {
    std::env::var_os("RDT_HEAP_DEFAULTS").is_some_and(|v| v == "1")
}

/// `RDT_TIMELINE`: whether a worker records the timeline (set, not empty,
/// not `0`).
pub(crate) fn timeline() -> bool {
    get("RDT_TIMELINE").is_some_and(|v| !v.is_empty() && v != "0")
}

/// `GLIBC_TUNABLES`, as written (empty when unset).
pub(crate) fn glibc_tunables() -> String {
    get("GLIBC_TUNABLES").unwrap_or_default()
}
