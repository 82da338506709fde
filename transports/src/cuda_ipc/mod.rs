//! The `cuda_ipc` transport: zero-copy hand-over of CUDA tensors between
//! processes of one host, through CUDA IPC.
//!
//! # Protocol
//! 1. **Export (producer).** Every CUDA tensor rdt allocates lives in a
//!    range of a `cuMemAlloc` slab ([`crate::cuda::alloc`]). Export
//!    publishes a table of the slabs the tensors lie in (each slab's
//!    `cuIpcGetMemHandle`, made once per slab, its id, length and record),
//!    and per tensor its slab's index in that table, the range's offset and
//!    length, and the range's import record slot; and, per device, the handle of an interprocess
//!    event of this export's own (from a pool, given back at release),
//!    recorded on rdt's stream at export, so it completes when the work
//!    that produced the tensors does and never covers work the producer
//!    enqueues later (no handle when that stream is idle: the tensors are
//!    ready, and a pass of ready tensors puts no work on either GPU). The handles
//!    also carry the host's boot id and pid namespace, the producer's pid
//!    and the descriptor and inode of its import-record memfd. A tensor in
//!    memory the producer did not allocate (one it received itself) is
//!    copied into a fresh range first, kept until [`release`].
//! 2. **Receive (consumer).** The consumer checks it runs on the same host,
//!    checks the producer is alive (its import-record memfd is still at
//!    `/proc/<pid>/fd/<fd>` with the same inode at the first receive from
//!    a process; after it, a pidfd of that process: a dead producer is a
//!    clear error, never a hang), makes its stream wait on the producer's event
//!    unless it has already passed (`cuStreamWaitEvent`: no host sync; each
//!    event handle is opened once per process, in the context of the device
//!    whose stream waits on it), and maps each slab **once** (`cuIpcOpenMemHandle` with
//!    lazy peer access), caching the mapping for every later tensor in that
//!    slab (gpu.md pitfall 2). [`stats`] counts new mappings vs cache hits.
//!    The tensors it returns share the producer's memory: a write by the
//!    consumer is seen by the producer (Ray's semantics). Each tensor counts
//!    itself in the range's shared import record while it lives.
//! 3. **Release.** A consumer's dropped tensor counts itself out of its
//!    range's import record once this process's stream passed every use
//!    enqueued before the drop ([`crate::cuda::ordered_drop`]: queued, released
//!    in batches behind one stream mark). The producer's release drops the
//!    copies made at export. The
//!    producer's own tensors give their ranges back to the slab when they
//!    are dropped, but a range that a live importer still holds waits until
//!    every importer dropped its tensors (see `alloc` for the lifetime
//!    rules).
//! 4. **Mappings and freeing.** An importer keeps each slab mapping cached
//!    while the slab lives, so later tensors in it cost no new mapping, and
//!    registers its pid in the slab's shared record. The producer frees a
//!    slab only once it is unused and every registered importer has closed
//!    its mapping or died ([`alloc::trim`], invariant 3 of `alloc`). An
//!    importer closes a mapping of a slab the producer retires as soon as
//!    its last tensor in that slab is dropped (the owner table freed the
//!    object), or, if it had none left, at its next receive or at the
//!    worker's periodic [`housekeeping`].
//! 5. **Peer death.** An importer caches, per producer process, the
//!    producer's import records, opened events and slab mappings. When the
//!    producer's actor is gone ([`TensorTransport::peer_gone`]), they are
//!    dropped from the caches: events are destroyed, and mappings are closed
//!    at once or, if tensors still use them, when the last of those goes.
//!
//! Devices are matched by UUID: a consumer that sees the producer's device
//! maps it there; otherwise it maps it in its first device's context with
//! peer access (both devices must be visible to the consumer). Another host
//! is an error naming the transports that cross hosts.
//!
//! [`release`]: TensorTransport::release

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::cuda::alloc::{self, Counters, Region, SlabRange};
use crate::cuda::{CudaError, DeviceBuffer, Event, Gpu, IpcEvent};
use crate::rt::process_watch::ProcessWatch;
use crate::transport::{
    check_received, ObjectKey, Peer, Sidedness, TensorTransport, TransferCtx, TransportError,
};
use crate::{device::Device, device::GpuUuid, tensor::Tensor, transport::Exported};

mod handles;
mod mappings;
mod stats;
mod transport;

use handles::*;
use mappings::*;
use stats::*;

pub use handles::NAME;
pub use mappings::{close_retired_mappings, close_unused_mappings, housekeeping, housekeeping_due};
pub use stats::{stats, IpcStats};
pub use transport::CudaIpcTransport;

/// How often the rdt worker runs [`housekeeping`].
pub use crate::transport::HOUSEKEEPING_PERIOD;

#[cfg(test)]
mod tests;
