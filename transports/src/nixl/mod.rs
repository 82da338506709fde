//! The `nixl` transport: one-sided reads of CPU and CUDA tensors through
//! NIXL (UCX underneath: shared memory, CUDA IPC, RDMA or TCP, whichever
//! UCX finds between the two processes), between any two processes that
//! use it, the driver included, with no collective group.
//!
//! # Protocol
//! 1. **Export (producer).** Every tensor of the object must lie in memory
//!    registered with this process's agent:
//!    - a CUDA tensor in one of rdt's slabs ([`crate::cuda::alloc`]) is
//!      published where it is; its slab is registered once, on its first
//!      export, and stays registered until the slab is freed;
//!    - a CPU tensor in plain memory is moved into one fresh registered
//!      host region per export (its bytes are copied once, and from then on
//!      it and all its clones live there, as with `shm`); one already in
//!      such a region (exported or received over `nixl` before) is
//!      published where it is, with no copy and no registration;
//!    - memory of another transport is copied (CPU into a region, CUDA into
//!      a slab), since it cannot be moved.
//!
//!    The handles carry the agent's name and connection metadata, one
//!    entry per registration used (its generation, range and the partial
//!    metadata a peer loads to read it) and per tensor its registration,
//!    offset and length. CUDA tensors are exported once the GPU has passed
//!    every write to them.
//! 2. **Receive (consumer).** The consumer loads the producer's connection
//!    once per agent and each registration once per (agent, generation);
//!    it takes memory for the tensors (a registered host region laid out
//!    like the producer's, CUDA slabs on its device, or the target
//!    tensors), pairs each tensor's remote and local range, coalesces
//!    neighbours into one descriptor, and posts one READ per pair of
//!    memory types (one for an object of one kind). Reads that end within
//!    the hot window end on the receiving task; the poller (one thread per
//!    process) resolves the rest. Then a notification tells the producer
//!    (sent on its own: one attached to the READ holds the read's end back
//!    by a flush round trip to the producer).
//! 3. **Release (producer).** The transport drops what it kept for the
//!    object. A host region is deregistered and unmapped when its last
//!    tensor is gone; a slab's registration is undone just before the slab
//!    is freed.
//!
//! # Invariants
//! - **NX-1 (no stale registration):** a registration is named by its
//!   generation, never reused; a consumer that is handed a generation
//!   whose range overlaps one it loaded before from the same agent forgets
//!   that agent in NIXL (its memory and connection) and loads it afresh,
//!   so a recycled address never reads through an old registration
//!   (ray#65701).
//! - **NX-2 (registration before use, deregistration before free):** memory
//!   is registered before its handles leave the process, and deregistered
//!   while it is still mapped or allocated.
//! - **NX-3 (one registration per slab or region):** tensors are described
//!   as (registration, offset, length): 10 000 tensors in one slab cost one
//!   registration and, when they are neighbours, one descriptor.
//! - **NX-4 (reads own their memory):** see the poller's PL-1 and PL-2: the
//!   memory a read writes into lives until NIXL released the read.
//! - **NX-5 (release after the read):** the engine frees an object only
//!   after every consumer acknowledged its receive (DESIGN §6.5), so the
//!   producer never deregisters memory a read still uses; the producer
//!   also learns of each finished read from NIXL's notification
//!   ([`stats()`]'s `reads_served`), sent after the read ended; release
//!   never waits for it.
//! - **NX-7 (plans by content):** a receive into fresh memory works out
//!   its read once per layout: decoded and checked handles, where each
//!   tensor lands, and the coalesced descriptors with local addresses as
//!   offsets in the memory it will take. A plan is found again only for
//!   byte-identical handles, equal metadata and the same target (the
//!   handles name no object, so a weight sync's every step finds the
//!   first step's plan); the content is compared once per layout the
//!   framework names ([`TransferCtx::layout`]: the same id, the same
//!   bytes), and by that id after. It holds no memory and no registration of
//!   either side, so each receive still takes fresh memory, loads what
//!   NX-1 says, and posts its own READ.
//! - **NX-9 (no write under rdt's stream):** UCX writes device memory on
//!   streams of its own. A READ into CUDA target tensors waits until rdt's
//!   stream on their GPUs passed the work queued before it (which may
//!   still read the old values), and a READ into fresh device memory takes
//!   clean memory where the allocator has some and otherwise waits the
//!   same way (`cuda::alloc`, invariant 5). An idle stream costs one query.
//! - **NX-11 (a small read's next destination made ahead):** after a
//!   receive into fresh memory of at most 64 KiB (fewer than 64 tensors,
//!   device or host memory) was acknowledged, the transport makes the
//!   next destination of the same plan (`TensorTransport::after_receive`,
//!   on the thread that ran the receive, while the call that took the
//!   value runs): its memory, the tensors over it and the descriptor
//!   lists. The next receive of that plan takes it and only posts. A
//!   destination belongs to one plan, is taken by one receive (under the
//!   transport's lock), holds its memory until then (at most 8 of them,
//!   the oldest dropped first, and those of a dead producer's plans at
//!   `peer_gone`), and keeps NX-9: memory that was not clean when it was
//!   made makes its receive wait for rdt's stream, as a fresh one does.
//!   Its host bytes count as `host_bytes_ready` until a receive takes it,
//!   then as `host_bytes_in_use`.
//! - **NX-13 (registered host memory is never behind a reference):** a
//!   READ writes host memory outside its storage's lock, so that memory
//!   says it is shared with other processes and the safe accessors copy
//!   it out ([`ExternalMemory::shared_with_other_processes`]).

mod agent;
pub mod api;
mod contract;
mod export;
mod handles;
mod memory;
mod plan;
mod poller;
mod process;
/// NIXL through rdt's binding with nothing of rdt around it: an agent,
/// registrations and one READ at a time, waited for by polling its status
/// on the calling thread (as NIXL's own examples do). For baselines: the
/// benchmarks measure rdt's `nixl` passes against this between two plain
/// processes.
pub mod raw;
mod ready;
mod receive;
mod stats;
#[cfg(test)]
mod tests;
mod transport;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use futures::future::BoxFuture;
use memmap2::MmapMut;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::cuda::alloc::{Slab, SlabRange};
use crate::registry::ProcessContext;
use crate::rt::free_list::FreeList;
use crate::transport::{
    check_received, ObjectKey, Peer, Sidedness, Target, TensorTransport, TransferCtx,
    TransportError,
};
use crate::{
    device::Device, tensor::ExternalMemory, tensor::MakeTensors, tensor::Tensor,
    tensor::TensorList, tensor::TensorMeta, transport::Exported,
};

use agent::{Agent, Desc, Mem};
pub use api::NixlError;
use poller::Poller;

use handles::*;
use memory::*;
use plan::*;
use process::*;
use ready::*;
use receive::*;
use stats::*;
use transport::*;

pub use memory::trim;
pub use process::{available, prepare_process, stats};
pub use stats::{set_read_spin, NixlStats, DEFAULT_READ_SPIN};
pub use transport::{NixlTransport, NAME};

crate::register_transport!(crate::registry::Registration {
    name: NAME,
    sidedness: Sidedness::OneSided,
    collective: false,
    devices: "CPU, CUDA",
    same_host_only: false,
    start: |cx| Ok(Arc::new(NixlTransport::new(cx))),
});
