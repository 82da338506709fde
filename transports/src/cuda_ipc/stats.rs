//! What this process did as a consumer: mappings opened, found cached and
//! closed, and producer events opened ([`stats`]).

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

pub(super) static OPENED: AtomicU64 = AtomicU64::new(0);
pub(super) static CACHED: AtomicU64 = AtomicU64::new(0);
pub(super) static EVENTS_OPENED: AtomicU64 = AtomicU64::new(0);
pub(super) static CLOSED: AtomicU64 = AtomicU64::new(0);
pub(super) static EXPORT_COPIES: AtomicU64 = AtomicU64::new(0);

/// How often this process, as a consumer, had to open a new mapping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcStats {
    /// Tensors whose slab had to be mapped (`cuIpcOpenMemHandle`).
    pub opened: u64,
    /// Tensors whose slab was already mapped.
    pub cached: u64,
    /// Producer events opened (`cuIpcOpenEventHandle`).
    pub events_opened: u64,
    /// Mappings closed (`cuIpcCloseMemHandle`).
    pub closed: u64,
    /// Producer side: tensors this process exported by a device copy,
    /// because their memory was not exportable as it was (another
    /// library's allocation that `cuIpcGetMemHandle` refuses). Memory rdt
    /// made, and memory imported through DLPack from `cuMemAlloc`, never
    /// counts here.
    #[serde(default)]
    pub export_copies: u64,
}

/// This process's counts (consumer side).
pub fn stats() -> IpcStats {
    IpcStats {
        opened: OPENED.load(Ordering::Relaxed),
        cached: CACHED.load(Ordering::Relaxed),
        events_opened: EVENTS_OPENED.load(Ordering::Relaxed),
        closed: CLOSED.load(Ordering::Relaxed),
        export_copies: EXPORT_COPIES.load(Ordering::Relaxed),
    }
}
