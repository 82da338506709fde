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
//!   ([`stats`]'s `reads_served`), sent after the read ended; release
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
//!   then as `host_bytes_in_use`. `RDT_NIXL_READY_DEST=0` turns it off.
//! - **NX-13 (registered host memory is never behind a reference):** a
//!   READ writes host memory outside its storage's lock, so that memory
//!   says it is shared with other processes and the safe accessors copy
//!   it out ([`ExternalMemory::shared_with_other_processes`]).

mod agent;
pub mod api;
mod poller;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use futures::future::BoxFuture;
use memmap2::MmapMut;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::cuda::alloc::{Slab, SlabRange};
use crate::free_list::FreeList;
use crate::registry::ProcessContext;
use crate::transport::{
    check_received, ObjectKey, Peer, Sidedness, Target, TensorTransport, TransferCtx,
    TransportError,
};
use crate::{Device, Exported, ExternalMemory, MakeTensors, Tensor, TensorList, TensorMeta};

use agent::{Agent, Desc, Mem};
pub use api::NixlError;
use poller::Poller;

/// Name of this transport in attributes and errors.
pub const NAME: &str = "nixl";

crate::register_transport!(crate::registry::Registration {
    name: NAME,
    sidedness: Sidedness::OneSided,
    collective: false,
    devices: "CPU, CUDA",
    same_host_only: false,
    start: |cx| Ok(Arc::new(NixlTransport::new(cx))),
});

/// Alignment of tensors in a host region: a cache line.
const ALIGN: usize = 64;
/// Two neighbouring tensors whose gap is at most this many bytes (on both
/// sides alike) are read as one descriptor, gap included: reading a little
/// padding costs less than another descriptor.
const MERGE_GAP: usize = 4096;

static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

/// Counters of this process's NIXL activity (for tests and benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NixlStats {
    /// Memory registrations made.
    pub registrations: u64,
    /// Registrations undone.
    pub deregistrations: u64,
    /// READ requests posted.
    pub reads_posted: u64,
    /// Descriptors in those requests (after coalescing).
    pub descriptors_posted: u64,
    /// Reads of this process's memory that peers finished (NIXL
    /// notifications received).
    pub reads_served: u64,
    /// Remote metadata blobs loaded (connections and registrations).
    pub remote_loads: u64,
    /// Times a peer agent was forgotten (stale registration, death).
    pub remote_forgets: u64,
    /// Host slabs alive (pooled or dedicated).
    pub host_slabs: u64,
    /// Host bytes handed out from them and not given back (those of
    /// destinations made ahead are `host_bytes_ready`, not these).
    pub host_bytes_in_use: u64,
    /// Host bytes of the destinations made ahead for small reads and not
    /// taken yet (NX-11): at most a few of at most 64 KiB each.
    pub host_bytes_ready: u64,
    /// Nanoseconds spent posting READs (descriptor lists, request, post):
    /// the sum of the three below.
    pub post_nanos: u64,
    /// Of `post_nanos`: waiting for the agent's lock.
    pub post_lock_nanos: u64,
    /// Of `post_nanos`: making the descriptor lists and the request
    /// (`nixl_capi_create_xfer_req`).
    pub post_create_nanos: u64,
    /// Of `post_nanos`: `nixl_capi_post_xfer_req` itself.
    pub post_submit_nanos: u64,
    /// Nanoseconds from a receive's first post to its last READ's end.
    pub read_nanos: u64,
    /// READs that ended on the receiving task itself (at post, or polled
    /// within the hot window), without the poller thread.
    pub reads_done_inline: u64,
    /// READs posted with a request kept from an earlier READ of the same
    /// ranges (small objects read again: no request made).
    pub reads_reposted: u64,
    /// Times the receiving task asked NIXL how its READs stood (each ask
    /// progresses UCX); with `reads_posted`, how many asks a read took.
    pub read_asks: u64,
    /// Of those asks, the ones made after a yield to the executor (the
    /// others were made at once, within [`set_read_spin`]'s budget).
    pub read_asks_after_yield: u64,
    /// Receives into fresh memory that found their read plan made by an
    /// earlier receive of the same layout (NX-7).
    pub read_plans_reused: u64,
    /// Read plans made (decoded handles, layout, coalesced descriptors).
    pub read_plans_made: u64,
    /// Receives into target tensors that found the plan an earlier receive
    /// of the same layout into the same targets made (NX-8).
    pub target_plans_reused: u64,
    /// Of those, the receives into the very target list the plan was made
    /// for (a list the caller kept): neither places nor metadata compared.
    pub target_lists_reused: u64,
    /// Receives whose tensors were made while the READ ran: by the thread
    /// waiting to use them (`TransferCtx::first_reader`) ...
    pub lists_made_by_reader: u64,
    /// ... or, with no reader waiting, by the receive itself.
    pub lists_premade: u64,
    /// Destinations of small reads made ahead, after a receive of the
    /// same plan (NX-11) ...
    pub dests_made_ahead: u64,
    /// ... and the receives that found one ready (no allocation, views or
    /// descriptor lists before their post).
    pub dests_taken_ready: u64,
    /// Nanoseconds that making this process's agent took (0 before it is
    /// made): UCX's start, the backend, the connection metadata.
    pub agent_make_nanos: u64,
    /// Nanoseconds transfers of this process spent waiting for its agent
    /// to be made (a first transfer soon after the worker started, while
    /// the agent is still being made in the background, or one that makes
    /// it).
    pub agent_wait_nanos: u64,
    /// Nanoseconds spent loading remote metadata (`remote_loads`): peers'
    /// connections and registrations, once per agent and generation.
    pub remote_load_nanos: u64,
}

#[derive(Default)]
struct Counters {
    registrations: AtomicU64,
    deregistrations: AtomicU64,
    reads_posted: AtomicU64,
    descriptors_posted: AtomicU64,
    reads_served: AtomicU64,
    remote_loads: AtomicU64,
    remote_forgets: AtomicU64,
    host_slabs: AtomicU64,
    host_bytes_in_use: AtomicU64,
    host_bytes_ready: AtomicU64,
    post_lock_nanos: AtomicU64,
    post_create_nanos: AtomicU64,
    post_submit_nanos: AtomicU64,
    read_nanos: AtomicU64,
    reads_done_inline: AtomicU64,
    reads_reposted: AtomicU64,
    read_asks: AtomicU64,
    read_asks_after_yield: AtomicU64,
    read_plans_reused: AtomicU64,
    read_plans_made: AtomicU64,
    target_plans_reused: AtomicU64,
    target_lists_reused: AtomicU64,
    lists_made_by_reader: AtomicU64,
    lists_premade: AtomicU64,
    dests_made_ahead: AtomicU64,
    dests_taken_ready: AtomicU64,
    agent_make_nanos: AtomicU64,
    agent_wait_nanos: AtomicU64,
    remote_load_nanos: AtomicU64,
}

static COUNTERS: std::sync::LazyLock<Counters> = std::sync::LazyLock::new(Counters::default);

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// This process's NIXL counters. Drains the notifications that arrived,
/// so `reads_served` is current.
pub fn stats() -> NixlStats {
    if let Some(Ok(a)) = STARTED_AGENT.get() {
        drain_notifications(a);
    }
    let c = &*COUNTERS;
    let post_lock = c.post_lock_nanos.load(Ordering::Relaxed);
    let post_create = c.post_create_nanos.load(Ordering::Relaxed);
    let post_submit = c.post_submit_nanos.load(Ordering::Relaxed);
    NixlStats {
        registrations: c.registrations.load(Ordering::Relaxed),
        deregistrations: c.deregistrations.load(Ordering::Relaxed),
        reads_posted: c.reads_posted.load(Ordering::Relaxed),
        descriptors_posted: c.descriptors_posted.load(Ordering::Relaxed),
        reads_served: c.reads_served.load(Ordering::Relaxed),
        remote_loads: c.remote_loads.load(Ordering::Relaxed),
        remote_forgets: c.remote_forgets.load(Ordering::Relaxed),
        host_slabs: c.host_slabs.load(Ordering::Relaxed),
        host_bytes_in_use: c.host_bytes_in_use.load(Ordering::Relaxed),
        host_bytes_ready: c.host_bytes_ready.load(Ordering::Relaxed),
        post_nanos: post_lock + post_create + post_submit,
        post_lock_nanos: post_lock,
        post_create_nanos: post_create,
        post_submit_nanos: post_submit,
        read_nanos: c.read_nanos.load(Ordering::Relaxed),
        reads_done_inline: c.reads_done_inline.load(Ordering::Relaxed),
        reads_reposted: c.reads_reposted.load(Ordering::Relaxed),
        read_asks: c.read_asks.load(Ordering::Relaxed),
        read_asks_after_yield: c.read_asks_after_yield.load(Ordering::Relaxed),
        read_plans_reused: c.read_plans_reused.load(Ordering::Relaxed),
        read_plans_made: c.read_plans_made.load(Ordering::Relaxed),
        target_plans_reused: c.target_plans_reused.load(Ordering::Relaxed),
        target_lists_reused: c.target_lists_reused.load(Ordering::Relaxed),
        lists_made_by_reader: c.lists_made_by_reader.load(Ordering::Relaxed),
        lists_premade: c.lists_premade.load(Ordering::Relaxed),
        dests_made_ahead: c.dests_made_ahead.load(Ordering::Relaxed),
        dests_taken_ready: c.dests_taken_ready.load(Ordering::Relaxed),
        agent_make_nanos: c.agent_make_nanos.load(Ordering::Relaxed),
        agent_wait_nanos: c.agent_wait_nanos.load(Ordering::Relaxed),
        remote_load_nanos: c.remote_load_nanos.load(Ordering::Relaxed),
    }
}

/// [`set_read_spin`]'s default.
pub const DEFAULT_READ_SPIN: std::time::Duration = std::time::Duration::from_micros(30);

static READ_SPIN: crate::hot::MicrosSetting =
    crate::hot::MicrosSetting::new("RDT_NIXL_READ_SPIN_US");

/// How long a receive asks NIXL for its READs again at once, without
/// yielding to the executor, after posting them (within the hot window
/// only; past the budget it yields between asks, past the window the
/// poller thread takes over). Default: `RDT_NIXL_READ_SPIN_US`, else
/// [`DEFAULT_READ_SPIN`].
///
/// Yielding between asks let other tasks of the executor run, and each
/// round cost several microseconds: on one H100 host (2026-11-24,
/// `bench_nixl --small-passes`) a 4 KiB device pass took 84–89 µs with
/// 30 µs of spin and 91–101 µs without. A host READ ends at the first ask
/// either way.
pub fn set_read_spin(d: std::time::Duration) {
    READ_SPIN.set(d);
}

fn read_spin() -> std::time::Duration {
    READ_SPIN.get(|| DEFAULT_READ_SPIN)
}

/// UCX's setting for its memory hooks ...
const UCX_MEM_EVENTS: &str = "UCX_MEM_EVENTS";
/// ... and what rdt sets it to where the process did not.
const UCX_MEM_EVENTS_DEFAULT: &str = "no";

/// Gives this process rdt's default for UCX's memory hooks
/// (`UCX_MEM_EVENTS=no`) unless it set `UCX_MEM_EVENTS` itself; returns
/// whether it did. rdt's start-up calls it (the pre-`main` hook of a
/// binary with actors, and `rdt::init`), before the process has threads
/// (`setenv` is not safe beside other threads) and before NIXL's
/// libraries are loaded (UCX reads the setting then).
///
/// Why: with the hooks on, UCX patches the code of `mmap`, `munmap` and
/// their kin (and CUDA's allocation calls) when an agent starts, and waits
/// its grace period (`UCX_MEM_BISTRO_GRACE_DURATION`, 50 ms) after each
/// patch: making an agent took 0.46 s on the 2-core dev VM, 0.06 s
/// without (the book's NIXL chapter, "The first transfer"). The hooks tell
/// UCX's registration cache that memory went away; rdt needs no such
/// cache: it registers the memory it exposes or reads into itself, once
/// per slab or region, and deregisters it before freeing it (NX-2), so
/// nothing of UCX's can outlive the memory. Set `UCX_MEM_EVENTS=yes` to
/// keep UCX's hooks.
pub fn prepare_process() -> bool {
    match ucx_default(crate::env::var_os(UCX_MEM_EVENTS).as_deref()) {
        Some(v) => {
            std::env::set_var(UCX_MEM_EVENTS, v);
            true
        }
        None => false,
    }
}

/// The value rdt gives `UCX_MEM_EVENTS` where it is `current`: none where
/// the process set it (even to nothing).
fn ucx_default(current: Option<&std::ffi::OsStr>) -> Option<&'static str> {
    current.is_none().then_some(UCX_MEM_EVENTS_DEFAULT)
}

/// Is NIXL usable in this process? The error says how to install it.
pub fn available() -> Result<(), NixlError> {
    api::api().map(|_| ())
}

/// The agent of this process, once made.
static STARTED_AGENT: OnceLock<Result<Arc<Agent>, NixlError>> = OnceLock::new();

/// Makes this process's agent, timed (`agent_make_nanos`), and has it
/// closed when the process exits ([`close_agent_at_exit`]).
fn make_agent(name: &str) -> Result<Arc<Agent>, NixlError> {
    let t0 = std::time::Instant::now();
    let made = Agent::new(name).map(Arc::new);
    bump(&COUNTERS.agent_make_nanos, t0.elapsed().as_nanos() as u64);
    if made.is_ok() {
        static AT_EXIT: std::sync::Once = std::sync::Once::new();
        // SAFETY: registers a plain function; it runs once, at `exit`.
        AT_EXIT.call_once(|| unsafe {
            libc::atexit(close_agent_at_exit);
        });
    }
    made
}

/// How long the exit waits for the agent's lock, then for its teardown,
/// before it goes on without it (a worker's exit must not hang on a
/// peer).
const CLOSE_AT_EXIT_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Run by `exit` (registered once the agent exists), before the C
/// library's teardown of its libraries: the handlers registered last run
/// first, and the libraries' destructors, CUDA's among them, run after
/// every handler. It closes the agent then ([`Agent::close_for_exit`]),
/// on a thread of its own so that the exit waits for it at most twice
/// [`CLOSE_AT_EXIT_WAIT`] (the lock, then the teardown). A process
/// killed, or ended by `_exit`, skips it.
extern "C" fn close_agent_at_exit() {
    let Some(Ok(agent)) = STARTED_AGENT.get() else {
        return;
    };
    let agent = agent.clone();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    let closing = std::thread::Builder::new()
        .name("rdt-nixl-exit".into())
        .spawn(move || {
            let closed = agent.close_for_exit(CLOSE_AT_EXIT_WAIT);
            let _ = done_tx.send(closed);
        });
    if closing.is_ok() {
        let _ = done_rx.recv_timeout(2 * CLOSE_AT_EXIT_WAIT);
    }
}

/// Counts the notices that arrived: each carries the number of reads its
/// sender finished (PL-3), as 8 bytes little-endian; anything else counts
/// one.
fn drain_notifications(agent: &Agent) {
    if let Ok(n) = agent.take_notifications() {
        let reads: u64 = n.iter().map(|(_, msg)| reads_in(msg)).sum();
        bump(&COUNTERS.reads_served, reads);
    }
}

/// The number of reads a notice reports (see [`drain_notifications`]).
fn reads_in(notice: &[u8]) -> u64 {
    <[u8; 8]>::try_from(notice)
        .map(u64::from_le_bytes)
        .unwrap_or(1)
}

/// Sends each producer the number of its reads that ended here since the
/// last notice (the poller's PL-3), then lets UCX send them now: a notice
/// left in UCX's queue would go out inside this process's next read.
fn send_notices(agent: &Agent, reads: HashMap<String, u64>) {
    for (producer, n) in reads {
        if let Err(e) = agent.gen_notif(&producer, &n.to_le_bytes()) {
            tracing::debug!(
                "nixl: notifying {producer} of {n} finished reads failed: {}",
                e.0
            );
        }
    }
    // Progresses the worker (and counts what this process served).
    drain_notifications(agent);
}

/// A registration with this process's agent, undone on drop (NX-2).
struct Registered {
    agent: Arc<Agent>,
    generation: u64,
    desc: Desc,
    /// What a peer loads to read it.
    md: Vec<u8>,
    done: std::sync::atomic::AtomicBool,
}

impl Registered {
    fn new(agent: &Arc<Agent>, desc: Desc) -> Result<Registered, NixlError> {
        let md = agent.register(desc)?;
        bump(&COUNTERS.registrations, 1);
        Ok(Registered {
            agent: agent.clone(),
            generation: NEXT_GENERATION.fetch_add(1, Ordering::Relaxed),
            desc,
            md,
            done: Default::default(),
        })
    }

    fn deregister(&self) {
        if !self.done.swap(true, Ordering::AcqRel) {
            if let Err(e) = self.agent.deregister(self.desc) {
                tracing::warn!("deregistering {:?}: {e}", self.desc);
            }
            bump(&COUNTERS.deregistrations, 1);
        }
    }

    fn handle(&self) -> RegionHandle {
        RegionHandle {
            generation: self.generation,
            mem: self.desc.mem,
            base: self.desc.addr as u64,
            len: self.desc.len as u64,
            dev: self.desc.dev,
            md: self.md.clone(),
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.deregister();
    }
}

/// A slab of anonymous host memory, registered once with an agent (NX-3),
/// and page-locked where CUDA is present (so device copies to and from it
/// run at copy-engine speed).
struct HostSlab {
    /// Shared with the exports that name it; deregistered when the slab is
    /// dropped, before the mapping goes (NX-2).
    reg: Arc<Registered>,
    ptr: *mut u8,
    len: usize,
    /// Freed when its one range is given back (large requests), instead of
    /// staying in the pool.
    dedicated: bool,
    free: FreeList,
    pinned: bool,
    _map: MmapMut,
}

// SAFETY: the pointer is into `_map`, which the slab owns; its bytes are
// handed out as disjoint ranges, accessed through tensor storages.
unsafe impl Send for HostSlab {}
// SAFETY: as above.
unsafe impl Sync for HostSlab {}

/// Size of a pooled host slab.
const HOST_SLAB_BYTES: usize = 64 << 20;
/// Requests above this get a slab of their own (kept for a later request
/// of about the same size, see [`LARGE_IDLE_CAP`]).
const DEDICATED_ABOVE: usize = HOST_SLAB_BYTES / 4;
/// Dedicated slabs are rounded up to this.
const DEDICATED_ROUND: usize = 2 << 20;
/// Idle dedicated slabs kept per agent, in bytes: making a large slab
/// costs far more than its transfer (mapping, page-locking and
/// registering 1 GiB takes hundreds of milliseconds), and repeated large
/// receives of one size are the common case (weight sync). Beyond this,
/// idle ones are freed when a new one is made; [`trim`] frees them all.
const LARGE_IDLE_CAP: usize = 2 << 30;

type Pools = std::sync::LazyLock<Mutex<HashMap<String, Vec<Arc<HostSlab>>>>>;
/// Pooled host slabs, per agent (one agent per process, but unit tests
/// make two).
static HOST_POOLS: Pools = std::sync::LazyLock::new(Default::default);
/// Dedicated (large) host slabs, per agent, in use or idle.
static LARGE_POOLS: Pools = std::sync::LazyLock::new(Default::default);

/// A slab in a pool that nothing uses.
fn idle(s: &Arc<HostSlab>) -> bool {
    s.free.all_free() && Arc::strong_count(s) == 1
}

impl HostSlab {
    fn new(agent: &Arc<Agent>, len: usize, dedicated: bool) -> Result<HostSlab, NixlError> {
        let mut map = MmapMut::map_anon(len)
            .map_err(|e| NixlError(format!("mapping {len} B of host memory: {e}")))?;
        let ptr = map.as_mut_ptr();
        // SAFETY: the mapping lives in the slab, which unpins before it
        // drops the mapping.
        let pinned = crate::cuda::available().is_ok()
            && unsafe { crate::cuda::pin_host(ptr, len) }
                .map_err(|e| tracing::warn!("nixl host slab left pageable: {e}"))
                .unwrap_or(false);
        let reg = Registered::new(
            agent,
            Desc {
                mem: Mem::Dram,
                addr: ptr as usize,
                len,
                dev: 0,
            },
        );
        let reg = match reg {
            Ok(r) => r,
            Err(e) => {
                if pinned {
                    // SAFETY: pinned above, still mapped.
                    unsafe { crate::cuda::unpin_host(ptr) };
                }
                return Err(e);
            }
        };
        bump(&COUNTERS.host_slabs, 1);
        Ok(HostSlab {
            reg: Arc::new(reg),
            ptr,
            len,
            dedicated,
            free: FreeList::new(len),
            pinned,
            _map: map,
        })
    }
}

impl Drop for HostSlab {
    fn drop(&mut self) {
        // NX-2: while the mapping (dropped after this body) still exists.
        self.reg.deregister();
        if self.pinned {
            // SAFETY: pinned when made; the mapping goes after this body.
            unsafe { crate::cuda::unpin_host(self.ptr) };
        }
        COUNTERS.host_slabs.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A range of a host slab: the memory of one export's or one receive's
/// host tensors. Given back to its slab on drop.
struct HostRegion {
    slab: Arc<HostSlab>,
    /// Offset in the slab.
    offset: usize,
    /// Bytes reserved.
    len: usize,
}

impl HostRegion {
    /// `len` bytes from this agent's pool (or a slab of their own).
    fn new(agent: &Arc<Agent>, len: usize) -> Result<Arc<HostRegion>, NixlError> {
        let want = len.max(1).next_multiple_of(ALIGN);
        let (slab, offset) = if want > DEDICATED_ABOVE {
            let mut pools = LARGE_POOLS.lock();
            let pool = pools.entry(agent.name().to_string()).or_default();
            // An idle one of about this size (at most twice as large).
            let found = pool
                .iter()
                .filter(|s| idle(s) && s.len >= want && s.len / 2 <= want)
                .find_map(|s| s.free.take(want).map(|o| (s.clone(), o)));
            match found {
                Some(found) => found,
                None => {
                    let mut idle_bytes: usize =
                        pool.iter().filter(|s| idle(s)).map(|s| s.len).sum();
                    pool.retain(|s| {
                        if idle_bytes > LARGE_IDLE_CAP && idle(s) {
                            idle_bytes -= s.len;
                            false
                        } else {
                            true
                        }
                    });
                    let len = want.next_multiple_of(DEDICATED_ROUND);
                    let slab = Arc::new(HostSlab::new(agent, len, true)?);
                    pool.push(slab.clone());
                    let off = slab.free.take(want).expect("a fresh slab fits");
                    (slab, off)
                }
            }
        } else {
            let mut pools = HOST_POOLS.lock();
            let pool = pools.entry(agent.name().to_string()).or_default();
            match pool
                .iter()
                .find_map(|s| s.free.take(want).map(|o| (s.clone(), o)))
            {
                Some(found) => found,
                None => {
                    let slab = Arc::new(HostSlab::new(agent, HOST_SLAB_BYTES, false)?);
                    pool.push(slab.clone());
                    let off = slab.free.take(want).expect("a fresh slab fits");
                    (slab, off)
                }
            }
        };
        COUNTERS
            .host_bytes_in_use
            .fetch_add(want as u64, Ordering::Relaxed);
        Ok(Arc::new(HostRegion {
            slab,
            offset,
            len: want,
        }))
    }

    fn ptr(&self) -> *mut u8 {
        // SAFETY: offset lies within the slab.
        unsafe { self.slab.ptr.add(self.offset) }
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        self.slab.free.give(self.offset, self.len);
        COUNTERS
            .host_bytes_in_use
            .fetch_sub(self.len as u64, Ordering::Relaxed);
        // A dedicated slab stays in its pool, idle, for a later request of
        // about its size (LARGE_IDLE_CAP).
        debug_assert!(!self.slab.dedicated || self.slab.len >= self.len);
    }
}

/// Gives every pooled host slab with no range in use back to the system
/// (deregistered, then unmapped). Consumers that read from them before
/// notice the new generation of whatever is mapped there later (NX-1).
pub fn trim() -> usize {
    let mut freed = 0;
    for pools in [&HOST_POOLS, &LARGE_POOLS] {
        for pool in pools.lock().values_mut() {
            pool.retain(|s| {
                if idle(s) {
                    freed += s.len;
                    false
                } else {
                    true
                }
            });
        }
    }
    freed
}

/// A tensor's bytes in a [`HostRegion`].
struct NixlHostMem {
    region: Arc<HostRegion>,
    offset: usize,
    len: usize,
}

// SAFETY: a range of a registered host region the value keeps alive;
// written by READs outside the storage lock, so it says it is shared
// (NX-13).
unsafe impl ExternalMemory for NixlHostMem {
    fn as_ptr(&self) -> *mut u8 {
        // SAFETY: offset + len lies within the region (made so).
        unsafe { self.region.ptr().add(self.offset) }
    }
    fn len(&self) -> usize {
        self.len
    }
    fn describe(&self) -> String {
        format!(
            "nixl host slab {} +{} ({} B)",
            self.region.slab.reg.generation,
            self.region.offset + self.offset,
            self.len
        )
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    /// NX-13: a READ of this process writes into it outside the storage's
    /// lock (a receive into a tensor that lives here: a weight update
    /// into its targets, while a clone of them may be read), and UCX or a
    /// NIC reads it for peers: never behind a Rust reference.
    fn shared_with_other_processes(&self) -> bool {
        true
    }
}

/// One registration in the handles.
#[derive(Clone, Debug, Serialize, Deserialize)]
struct RegionHandle {
    generation: u64,
    mem: Mem,
    base: u64,
    len: u64,
    dev: u64,
    #[serde(with = "serde_bytes")]
    md: Vec<u8>,
}

/// One tensor in the handles.
#[derive(Clone, Copy, Debug)]
struct Piece {
    region: u32,
    offset: u64,
    /// The tensor's bytes: not on the wire, its metadata says it.
    len: u64,
}

/// What [`Exported::handles`] holds ([`HandlesWire`] on the wire).
#[derive(Clone, Debug)]
struct Handles {
    agent: String,
    conn: Vec<u8>,
    regions: Vec<RegionHandle>,
    tensors: Vec<Piece>,
}

/// The handles as they travel. A tensor's registration comes from runs of
/// tensors in one registration, its length from its metadata, and its
/// offset from the previous tensor's end: each tensor is the gap after
/// the one before it in its run (the first one's after 0), zigzag
/// varints written as runs of equal gaps (`metas_wire::put_run`) in one
/// run of bytes. Tensors of one flat buffer, or allocated one after
/// another from a slab, are gaps of 0, one run: the handles of 10 000 of
/// them went from 80 KB (an 8-byte offset each) to 10 KB (a byte each),
/// then to a few bytes, bytes that every pass encodes, forwards through
/// the driver and reads. Nothing in it names
/// the object: the same tensors exported again (a weight sync's
/// parameters, every step) encode to the same bytes, so a consumer finds
/// its decoded metadata and its read plan again (NX-7).
#[derive(Serialize, Deserialize)]
struct HandlesWire {
    agent: String,
    #[serde(with = "serde_bytes")]
    conn: Vec<u8>,
    regions: Vec<RegionHandle>,
    /// (registration index, tensors in a row in it), in tensor order.
    runs: Vec<(u32, u32)>,
    /// Each tensor's offset in its registration, less the end of the
    /// tensor before it in its run (0 for a run's first): zigzag varints,
    /// as runs of equal values (`metas_wire::put_run`).
    #[serde(with = "serde_bytes")]
    gaps: Vec<u8>,
}

impl HandlesWire {
    /// The producer's agent named by encoded handles, read without
    /// decoding the rest (`agent` is their first field); `None` if
    /// malformed.
    fn agent_of(handles: &[u8]) -> Option<&str> {
        postcard::take_from_bytes::<&str>(handles)
            .ok()
            .map(|(a, _)| a)
    }
}

/// A signed gap as an unsigned varint's value (zigzag: small of either
/// sign stays small).
fn zigzag(v: i128) -> u64 {
    ((v << 1) ^ (v >> 127)) as u64
}

fn unzigzag(v: u64) -> i128 {
    ((v >> 1) as i128) ^ -((v & 1) as i128)
}

impl Handles {
    /// Piece `p`'s remote range (its registration checked by
    /// [`check_handles`]) paired with `local`, in local registration
    /// `local_reg`.
    fn pair(&self, p: &Piece, local: Desc, local_reg: u64) -> Pair {
        let r = &self.regions[p.region as usize];
        Pair {
            remote: Desc {
                mem: r.mem,
                addr: (r.base + p.offset) as usize,
                len: p.len as usize,
                dev: r.dev,
            },
            remote_reg: r.generation,
            local,
            local_reg,
        }
    }

    fn encode(&self) -> Result<Vec<u8>, String> {
        let mut runs: Vec<(u32, u32)> = Vec::new();
        let mut gaps = Vec::new();
        let mut gap_runs = crate::metas_wire::RunWriter::new(&mut gaps);
        let mut end = 0u64;
        for p in &self.tensors {
            match runs.last_mut() {
                Some((r, n)) if *r == p.region => *n += 1,
                _ => {
                    runs.push((p.region, 1));
                    end = 0;
                }
            }
            let gap = p.offset as i128 - end as i128;
            // Runs hold values below 2^63 (`put_run`).
            if gap.unsigned_abs() >= 1 << 61 {
                return Err(format!(
                    "a tensor at offset {} of its registration",
                    p.offset
                ));
            }
            gap_runs.push(zigzag(gap));
            end = p.offset + p.len;
        }
        gap_runs.finish();
        postcard::to_allocvec(&HandlesWire {
            agent: self.agent.clone(),
            conn: self.conn.clone(),
            regions: self.regions.clone(),
            runs,
            gaps,
        })
        .map_err(|e| e.to_string())
    }

    /// Decodes handles sent with `metas` (each piece's length is its
    /// tensor's); [`check_handles`] checks them against the rest.
    fn decode(bytes: &[u8], metas: &[TensorMeta]) -> Result<Handles, String> {
        let w: HandlesWire =
            postcard::from_bytes(bytes).map_err(|e| format!("malformed nixl handles: {e}"))?;
        let n = metas.len();
        let in_runs = w
            .runs
            .iter()
            .try_fold(0usize, |a, &(_, k)| a.checked_add(k as usize));
        let malformed = |what: &str| {
            format!(
                "malformed nixl handles: {what} ({:?} tensors in runs, {} gap bytes, for {n} \
                 tensors)",
                in_runs,
                w.gaps.len()
            )
        };
        if in_runs != Some(n) {
            return Err(malformed("the runs do not cover the tensors"));
        }
        let mut tensors = Vec::with_capacity(n);
        let mut gaps = &w.gaps[..];
        // The gap being repeated, and how many more times.
        let (mut g, mut left) = (0u64, 0u64);
        let mut metas = metas.iter();
        for &(region, k) in &w.runs {
            let mut end = 0u64;
            for m in metas.by_ref().take(k as usize) {
                if left == 0 {
                    let (v, count, rest) = crate::metas_wire::take_run(gaps)
                        .ok_or_else(|| malformed("gaps cut short"))?;
                    (g, left, gaps) = (v, count, rest);
                }
                left -= 1;
                let offset = u64::try_from(end as i128 + unzigzag(g))
                    .map_err(|_| malformed("an offset out of range"))?;
                let len = m.nbytes() as u64;
                end = offset
                    .checked_add(len)
                    .ok_or_else(|| malformed("an offset out of range"))?;
                tensors.push(Piece {
                    region,
                    offset,
                    len,
                });
            }
        }
        if !gaps.is_empty() || left != 0 {
            return Err(malformed("gaps left over"));
        }
        Ok(Handles {
            agent: w.agent,
            conn: w.conn,
            regions: w.regions,
            tensors,
        })
    }
}

/// What this process loaded of one peer agent.
#[derive(Default)]
struct RemoteAgent {
    /// Loaded registrations: generation -> (mem, dev, base, len).
    loaded: HashMap<u64, (Mem, u64, u64, u64)>,
}

/// Moves CPU and CUDA tensors with one-sided NIXL reads (see the module
/// docs).
pub struct NixlTransport {
    name: String,
    /// Memory kept per exported object until release.
    exports: Mutex<HashMap<ObjectKey, Vec<Kept>>>,
    /// Registrations of rdt's CUDA slabs, by slab id.
    slabs: Arc<Mutex<HashMap<u64, Arc<Registered>>>>,
    /// Peer agents loaded, by name.
    remotes: Mutex<HashMap<String, RemoteAgent>>,
    /// Read plans of recent layouts, the last used first (NX-7).
    plans: crate::recent::Recent<Arc<ReadPlan>>,
    /// The same for small objects (fewer than [`PLAN_MIN_TENSORS`]), kept
    /// apart so that they never push out a large object's plan.
    small_plans: crate::recent::Recent<Arc<ReadPlan>>,
    /// Plans of recent receives into target tensors (NX-8).
    target_plans: crate::recent::Recent<Arc<TargetPlan>>,
    /// Destinations made ahead for small device reads (NX-11), at most
    /// one per plan and [`SMALL_PLANS_KEPT`] in all.
    ready: Mutex<Vec<ReadyDest>>,
    /// Plans whose next destination is to be made ahead, at the next
    /// [`TensorTransport::after_receive`].
    wanted: Mutex<Vec<Arc<ReadPlan>>>,
}

/// What an export keeps alive.
enum Kept {
    Host(Arc<HostRegion>),
    Tensor(#[allow(dead_code)] Tensor),
    /// Target tensors of a receive, one per storage.
    Tensors(#[allow(dead_code)] Vec<Tensor>),
    /// The device range a receive's new tensors are slices of.
    Range(#[allow(dead_code)] Arc<crate::cuda::alloc::SlabRange>),
    Slab(#[allow(dead_code)] Arc<Registered>),
    /// The receive as a writer of its targets (TG-4).
    Writing(#[allow(dead_code)] crate::Writing),
}

impl std::fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransport")
            .field("agent", &self.name)
            .finish()
    }
}

/// One tensor's remote range and where it lands, with the registration
/// each lies in.
struct Pair {
    remote: Desc,
    remote_reg: u64,
    local: Desc,
    local_reg: u64,
}

/// The slab registrations an export or a receive into target tensors met,
/// each once: an object's tensors share a few slabs, so a short scan from
/// the most recent finds one, not a lookup in the transport's table per
/// tensor.
#[derive(Default)]
struct SlabRegistrations {
    /// (slab id, its registration).
    kept: Vec<(u64, Arc<Registered>)>,
}

impl SlabRegistrations {
    /// `slab`'s registration (from `nixl`'s table at its first use here).
    fn of(
        &mut self,
        nixl: &NixlTransport,
        agent: &Arc<Agent>,
        slab: &Arc<Slab>,
    ) -> Result<&Arc<Registered>, NixlError> {
        let at = match self.kept.iter().rposition(|(id, _)| *id == slab.id) {
            Some(at) => at,
            None => {
                self.kept
                    .push((slab.id, nixl.slab_registration(agent, slab)?));
                self.kept.len() - 1
            }
        };
        Ok(&self.kept[at].1)
    }

    /// What keeps them registered while the export or the read lasts.
    fn into_kept(self) -> impl Iterator<Item = Kept> {
        self.kept.into_iter().map(|(_, r)| Kept::Slab(r))
    }
}

/// Where one tensor goes on the consumer.
struct Dest {
    desc: Desc,
    /// The local registration it lies in (descriptors never span two).
    local_reg: u64,
}

impl NixlTransport {
    /// The transport of a process: its agent is made on first use.
    pub fn new(cx: &ProcessContext) -> NixlTransport {
        let nonce: u32 = rand_u32();
        let name = match cx.actor {
            Some(a) => format!("rdt-a{a}-{}-{nonce:08x}", std::process::id()),
            None => format!("rdt-driver-{}-{nonce:08x}", std::process::id()),
        };
        let name2 = name.clone();
        // On a GPU host, making the agent (UCX with its CUDA transports)
        // takes about a second: a worker starts it in the background at
        // boot, so that its first transfer does not pay it.
        if cx.actor.is_some() && crate::cuda::available().is_ok() {
            let _ = std::thread::Builder::new()
                .name("rdt-nixl-start".into())
                .spawn(move || {
                    let _ = STARTED_AGENT.get_or_init(|| make_agent(&name2));
                });
        }
        NixlTransport {
            name,
            exports: Default::default(),
            slabs: Default::default(),
            remotes: Default::default(),
            plans: crate::recent::Recent::new(PLANS_KEPT),
            small_plans: crate::recent::Recent::new(SMALL_PLANS_KEPT),
            target_plans: crate::recent::Recent::new(PLANS_KEPT),
            ready: Default::default(),
            wanted: Default::default(),
        }
    }

    fn agent(&self) -> Result<Arc<Agent>, TransportError> {
        let made = match STARTED_AGENT.get() {
            Some(made) => made,
            None => {
                // Made here, or by the background start still at it.
                let t0 = std::time::Instant::now();
                let made = STARTED_AGENT.get_or_init(|| make_agent(&self.name));
                bump(&COUNTERS.agent_wait_nanos, t0.elapsed().as_nanos() as u64);
                made
            }
        };
        made.clone().map_err(|e| TransportError::new(NAME, e.0))
    }

    /// The registration of `slab`, made on first use (NX-3).
    fn slab_registration(
        &self,
        agent: &Arc<Agent>,
        slab: &Arc<Slab>,
    ) -> Result<Arc<Registered>, NixlError> {
        let mut slabs = self.slabs.lock();
        if let Some(r) = slabs.get(&slab.id) {
            return Ok(r.clone());
        }
        // UCX tells device memory from host memory by asking CUDA in the
        // calling thread: the slab's context must be current.
        slab.gpu.bind().map_err(|e| NixlError(e.to_string()))?;
        let reg = Arc::new(Registered::new(
            agent,
            Desc {
                mem: Mem::Vram,
                addr: slab.base as usize,
                len: slab.len,
                dev: slab.gpu.ordinal() as u64,
            },
        )?);
        slabs.insert(slab.id, reg.clone());
        let table = Arc::downgrade(&self.slabs);
        let id = slab.id;
        // NX-2: undone while the slab still exists.
        slab.before_free(Box::new(move || {
            if let Some(t) = table.upgrade() {
                if let Some(r) = t.lock().remove(&id) {
                    r.deregister();
                }
            }
        }));
        Ok(reg)
    }

    /// Loads what `h` needs of its agent (NX-1).
    fn load_remote(&self, agent: &Agent, h: &Handles) -> Result<(), NixlError> {
        let mut remotes = self.remotes.lock();
        let stale = remotes.get(&h.agent).is_some_and(|r| {
            h.regions.iter().any(|n| {
                !r.loaded.contains_key(&n.generation)
                    && r.loaded.iter().any(|(_, &(mem, dev, base, len))| {
                        mem == n.mem && dev == n.dev && base < n.base + n.len && n.base < base + len
                    })
            })
        });
        if stale {
            agent.forget_remote(&h.agent)?;
            bump(&COUNTERS.remote_forgets, 1);
            remotes.remove(&h.agent);
        }
        // Timed, and counted once loaded (`remote_loads`).
        let load = |md: &[u8]| {
            let t0 = std::time::Instant::now();
            let name = agent.load_remote(md);
            bump(&COUNTERS.remote_load_nanos, t0.elapsed().as_nanos() as u64);
            bump(&COUNTERS.remote_loads, u64::from(name.is_ok()));
            name
        };
        if !remotes.contains_key(&h.agent) {
            let name = load(&h.conn)?;
            if name != h.agent {
                return Err(NixlError(format!(
                    "the handles name agent {} but carry the metadata of {name}",
                    h.agent
                )));
            }
            remotes.insert(h.agent.clone(), RemoteAgent::default());
        }
        let r = remotes.get_mut(&h.agent).expect("inserted above");
        for n in &h.regions {
            if r.loaded.contains_key(&n.generation) {
                continue;
            }
            load(&n.md)?;
            r.loaded.insert(n.generation, (n.mem, n.dev, n.base, n.len));
        }
        Ok(())
    }

    async fn export_inner(
        &self,
        key: ObjectKey,
        tensors: &[Tensor],
    ) -> Result<Exported, TransportError> {
        let agent = self.agent()?;
        drain_notifications(&agent);
        let err = |m: String| TransportError::new(NAME, m);
        let mut kept: Vec<Kept> = Vec::new();
        // The registrations the tensors lie in, each once, and where each
        // tensor is: (index in `regs`, offset).
        let mut regs: Vec<Arc<Registered>> = Vec::new();
        let mut slab_regs = SlabRegistrations::default();
        let mut at: Vec<Option<(u32, usize)>> = vec![None; tensors.len()];
        fn reg_index(regs: &mut Vec<Arc<Registered>>, reg: &Arc<Registered>) -> u32 {
            match regs.iter().rposition(|r| Arc::ptr_eq(r, reg)) {
                Some(i) => i as u32,
                None => {
                    regs.push(reg.clone());
                    (regs.len() - 1) as u32
                }
            }
        }
        // Host tensors that need a region: plain memory moves in, foreign
        // memory is copied in.
        let mut to_place: Vec<usize> = Vec::new();
        let mut seen_storage: rustc_hash::FxHashMap<usize, usize> = Default::default();
        let mut dups: Vec<(usize, usize)> = Vec::new();
        let mut gpus: Vec<Arc<crate::cuda::Gpu>> = Vec::new();
        let mut last_region: Option<Arc<HostRegion>> = None;
        for (i, t) in tensors.iter().enumerate() {
            if t.is_cuda() {
                let found = t
                    .with_device_buffer(|d| {
                        if !gpus.iter().any(|g| Arc::ptr_eq(g, d.gpu())) {
                            gpus.push(d.gpu().clone());
                        }
                        slab_of(d)
                    })
                    .map_err(|e| err(e.to_string()))?;
                let (slab, offset, owner) = match found {
                    Some((s, o)) => (s, o, None),
                    None => {
                        // Foreign device memory (a cuda_ipc import): copied
                        // into a slab of this process.
                        let copy = t.deep_copy().map_err(|e| err(e.to_string()))?;
                        let (s, o) = copy
                            .with_device_buffer(slab_of)
                            .map_err(|e| err(e.to_string()))?
                            .ok_or_else(|| err("a CUDA copy is not in an rdt slab".into()))?;
                        (s, o, Some(copy))
                    }
                };
                let reg = slab_regs.of(self, &agent, &slab).map_err(|e| err(e.0))?;
                let r = reg_index(&mut regs, reg);
                kept.extend(owner.map(Kept::Tensor));
                at[i] = Some((r, offset));
                continue;
            }
            if let Some(&j) = seen_storage.get(&t.storage_id()) {
                // The same storage twice (a clone, or another view of it):
                // published once, at the first.
                dups.push((i, j));
                continue;
            }
            seen_storage.insert(t.storage_id(), i);
            let ours = t.with_external(|e| {
                let e = e?;
                let m = e.memory().as_any().downcast_ref::<NixlHostMem>()?;
                let same = last_region
                    .as_ref()
                    .is_some_and(|r| Arc::ptr_eq(r, &m.region));
                Some((
                    (!same).then(|| m.region.clone()),
                    m.region.offset + m.offset + e.offset(),
                ))
            });
            match ours {
                Some((new_region, offset)) => {
                    // Registered already (exported or received before): no
                    // copy, no registration.
                    if let Some(region) = new_region {
                        kept.push(Kept::Host(region.clone()));
                        last_region = Some(region);
                    }
                    let region = last_region.as_ref().expect("set above");
                    at[i] = Some((reg_index(&mut regs, &region.slab.reg), offset));
                }
                None => to_place.push(i),
            }
        }
        if !to_place.is_empty() {
            // One region for every host tensor that needs one (NX-3).
            let mut offsets = Vec::with_capacity(to_place.len());
            let mut len = 0usize;
            for &i in &to_place {
                // Room for the whole storage: a view's storage moves whole.
                offsets.push(len);
                len = (len + tensors[i].storage_nbytes()).next_multiple_of(ALIGN);
            }
            let region = HostRegion::new(&agent, len).map_err(|e| err(e.0))?;
            let r = reg_index(&mut regs, &region.slab.reg);
            for (&i, &offset) in to_place.iter().zip(&offsets) {
                let t = &tensors[i];
                let mem = Box::new(NixlHostMem {
                    region: region.clone(),
                    offset,
                    len: t.storage_nbytes(),
                });
                // Where the tensor's bytes are once its storage is in.
                let at_tensor = offset + t.byte_offset();
                if !t.migrate_storage(mem).map_err(|e| err(e.to_string()))? {
                    // Foreign external memory: copied into the region.
                    let bytes = t.to_bytes().map_err(|e| err(e.to_string()))?;
                    // SAFETY: a view's bytes lie within its storage, and
                    // the storage's length lies within the region at
                    // `offset`, which nothing else uses yet.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            bytes.as_ptr(),
                            region.ptr().add(at_tensor),
                            bytes.len(),
                        )
                    };
                }
                at[i] = Some((r, region.offset + at_tensor));
            }
            kept.push(Kept::Host(region));
        }
        for (i, j) in dups {
            // The first one's storage starts its own offset before it.
            at[i] =
                at[j].map(|(r, o)| (r, o - tensors[j].byte_offset() + tensors[i].byte_offset()));
        }
        // CUDA tensors: the GPU must have passed every write to them before
        // a peer reads.
        for g in gpus {
            g.completion()
                .map_err(|e| err(e.to_string()))?
                .wait()
                .await
                .map_err(|e| err(e.to_string()))?;
        }
        let conn = agent.connection_md().to_vec();
        let regions: Vec<RegionHandle> = regs.iter().map(|r| r.handle()).collect();
        let mut pieces = Vec::with_capacity(tensors.len());
        for (t, a) in tensors.iter().zip(at) {
            let (region, offset) = a.expect("every tensor is placed above");
            pieces.push(Piece {
                region,
                offset: offset as u64,
                len: t.nbytes() as u64,
            });
        }
        // Device slabs' registrations live as long as the export (host
        // ones go with their regions, kept above).
        kept.extend(slab_regs.into_kept());
        let handles = Handles {
            agent: agent.name().to_string(),
            conn,
            regions,
            tensors: pieces,
        };
        self.exports.lock().entry(key).or_default().extend(kept);
        Ok(Exported {
            metas: tensors.iter().map(Tensor::meta).collect(),
            handles: handles.encode().map_err(err)?,
            inline: Vec::new(),
        })
    }

    async fn receive_inner(
        &self,
        from: &Peer,
        cx: &TransferCtx,
        exported: &Exported,
    ) -> Result<TensorList, TransportError> {
        let err = |m: String| TransportError::with_peer(NAME, from, m);
        crate::cuda::timeline("nixl receive start", cx.xfer);
        let agent = self.agent()?;
        // Into fresh memory: through the layout's plan, made once (NX-7).
        // Into the caller's tensors: through the plan of the same layout
        // and targets (NX-8), worked out now if there is none.
        enum Into<'t> {
            Targets(&'t Arc<[Tensor]>, Arc<TargetPlan>),
            Fresh(Arc<ReadPlan>),
        }
        let (into, mut target_keep) = match &cx.target {
            Target::Tensors(ts) => {
                let (plan, mut keep) = self.target_plan(&agent, exported, ts, cx.layout, from)?;
                // TG-4: a READ posted into the targets writes them until it
                // ends, also after this receive was dropped (the poller
                // cancels it later): counted as their writer until then.
                keep.extend(cx.gate.as_ref().map(|g| Kept::Writing(g.writing())));
                (Into::Targets(ts, plan), keep)
            }
            t => (
                Into::Fresh(
                    self.read_plan(exported, PlanTarget::of(t), cx.layout)
                        .map_err(err)?,
                ),
                Vec::new(),
            ),
        };
        let h: &Handles = match &into {
            Into::Targets(_, plan) => &plan.h,
            Into::Fresh(plan) => &plan.h,
        };
        if h.agent == agent.name() {
            return Err(err(
                "the object's tensors are in this process already; nothing to read".into(),
            ));
        }
        // NIXL's statuses say little; say what was being done, and to whom.
        let reading = |e: String| {
            err(format!(
                "reading from {} (NIXL agent {}) failed: {e}; the producer may have died or \
                 the link to it may be down",
                from.name, h.agent
            ))
        };
        self.load_remote(&agent, h).map_err(|e| reading(e.0))?;
        crate::cuda::timeline("nixl remote loaded", cx.xfer);
        let Destination {
            out,
            lists,
            keep,
            not_clean,
        } = match &into {
            Into::Targets(ts, plan) => Destination {
                out: TensorList::shared(Arc::clone(ts)),
                lists: plan.lists.clone(),
                keep: std::mem::take(&mut target_keep),
                not_clean: Vec::new(),
            },
            Into::Fresh(plan) => match self.take_ready(plan) {
                Some(dest) => dest,
                None => self.take_planned(&agent, plan, &err)?,
            },
        };
        if let Into::Fresh(plan) = &into {
            self.want_ready(plan);
        }
        crate::cuda::timeline("nixl destinations ready", cx.xfer);
        // The tensors of a large object are made while the bytes move
        // (`TensorList::premake`). A thread waiting to use them (WK-8)
        // gets the list now, before the post (tens of µs for a large READ
        // across GPUs), so that it makes them meanwhile too; with none,
        // this thread makes them once the READ is posted.
        let offered = out.is_lazy() && cx.first_reader.as_ref().is_some_and(|r| r.offer(&out));
        if offered {
            bump(&COUNTERS.lists_made_by_reader, 1);
            crate::cuda::timeline("nixl views offered", cx.xfer);
        }
        // NX-9: UCX writes device memory on streams of its own. Work still
        // queued on rdt's stream may read what the READ overwrites: the
        // old values of target tensors, or memory freed while in use and
        // not clean yet. The READ waits until rdt's stream passed it on
        // those GPUs (nothing to wait for on an idle stream).
        let wait_on: Vec<usize> = match &into {
            Into::Targets(..) => {
                let mut gpus: Vec<usize> = lists
                    .iter()
                    .flat_map(|(local, _)| local)
                    .filter(|d| d.mem == Mem::Vram)
                    .map(|d| d.dev as usize)
                    .collect();
                gpus.sort_unstable();
                gpus.dedup();
                gpus
            }
            Into::Fresh(_) => not_clean,
        };
        for o in wait_on {
            let g = crate::cuda::gpu(o).map_err(|e| err(e.to_string()))?;
            g.completion()
                .map_err(|e| err(e.to_string()))?
                .wait()
                .await
                .map_err(|e| err(e.to_string()))?;
        }
        let poller = Poller::get(&agent);
        let keep = Arc::new(keep);
        // UCX's CUDA transports work in the calling thread's context: bind
        // the GPU the read lands on (or, reading device memory into the
        // host, this process's first GPU).
        let vram_local = lists
            .iter()
            .flat_map(|(local, _)| local)
            .find(|d| d.mem == Mem::Vram)
            .map(|d| d.dev as usize);
        let vram_remote = h.regions.iter().any(|r| r.mem == Mem::Vram);
        if let Some(o) = vram_local.or(vram_remote.then_some(0)) {
            if let Ok(g) = crate::cuda::gpu(o) {
                let _ = g.bind();
            }
        }
        crate::cuda::timeline("nixl bound", cx.xfer);
        let started = std::time::Instant::now();
        let mut posted = Posted {
            agent: &agent,
            poller,
            reqs: Vec::new(),
            keep: keep.clone(),
        };
        for (local, remote) in lists {
            let n = local.len() as u64;
            // No notification rides on the READ: NIXL then ends the read
            // only after a flush round trip to the producer (4 KiB across
            // GPUs, raw: 9 µs without, 21 µs with). It follows the read.
            let (req, done) = agent
                .post_read(&local, &remote, &h.agent, &[], true)
                .map_err(|e| reading(e.0))?;
            bump(&COUNTERS.reads_posted, 1);
            bump(&COUNTERS.descriptors_posted, n);
            posted.reqs.push((req, done));
        }
        crate::cuda::timeline("nixl posted", cx.xfer);
        // The READ moves the bytes without this thread: it makes the
        // tensors meanwhile if no reader took them.
        if out.is_lazy() && !offered {
            out.premake();
            bump(&COUNTERS.lists_premade, 1);
            crate::cuda::timeline("nixl views premade", cx.xfer);
        }
        // Small reads end within microseconds of their post: ask for them
        // here, within the hot window (yielding to the executor between
        // asks), and hand the rest to the poller. Waking the poller and
        // being woken by it cost more than such a read on a busy host.
        let window = crate::hot::window();
        let spin = read_spin().min(window);
        let posted_at = std::time::Instant::now();
        let mut yielded = false;
        loop {
            posted.settle().map_err(|e| reading(e.0))?;
            bump(&COUNTERS.read_asks, 1);
            if yielded {
                bump(&COUNTERS.read_asks_after_yield, 1);
            }
            if posted.reqs.is_empty() || started.elapsed() >= window {
                break;
            }
            if posted_at.elapsed() < spin {
                std::hint::spin_loop();
                yielded = false;
                continue;
            }
            tokio::task::yield_now().await;
            yielded = true;
        }
        let waits = posted.hand_to_poller();
        for w in waits {
            match w.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(reading(e)),
                Err(_) => return Err(err("the NIXL poller stopped".into())),
            }
        }
        bump(&COUNTERS.read_nanos, started.elapsed().as_nanos() as u64);
        crate::cuda::timeline("nixl read done", cx.xfer);
        // The producer hears that the read ended (its `reads_served`),
        // later and in one message per producer (PL-3): a notice sent now
        // would go out inside this process's next read. Release does not
        // wait for it (NX-5): a lost notice loses a count, nothing else.
        poller.notice(&h.agent);
        crate::cuda::timeline("nixl notice queued", cx.xfer);
        Ok(out)
    }

    /// Another process's device memory into this process's host memory.
    /// UCX read that at 0.5 GB/s on the 2xH200 host (no CUDA IPC into host
    /// memory), while a read onto this process's GPU (CUDA IPC) and one
    /// copy into
    /// page-locked host memory (the nixl host slabs are pinned where CUDA
    /// is present) run at NVLink and copy-engine speed.
    async fn receive_to_host_through_gpu(
        &self,
        from: &Peer,
        cx: &TransferCtx,
        exported: &Exported,
    ) -> Result<Vec<Tensor>, TransportError> {
        let err = |m: String| TransportError::with_peer(NAME, from, m);
        let on_gpu = TransferCtx {
            target: Target::Any,
            ..cx.clone()
        };
        let received = self
            .receive_inner(from, &on_gpu, exported)
            .await?
            .into_vec();
        let agent = self.agent()?;
        let len = received
            .iter()
            .filter(|t| t.is_cuda())
            .fold(0usize, |a, t| (a + t.nbytes()).next_multiple_of(ALIGN));
        let region = HostRegion::new(&agent, len).map_err(|e| err(e.0))?;
        // The host tensors are views of one tensor over the region.
        let whole = Tensor::from_external(
            crate::DType::U8,
            &[region.len],
            Device::Cpu,
            Box::new(NixlHostMem {
                region: region.clone(),
                offset: 0,
                len: region.len,
            }),
        )
        .map_err(|e| err(e.to_string()))?;
        // (GPU ordinal, device address, offset in the region, bytes)
        let mut copies: Vec<(usize, u64, usize, usize)> = Vec::new();
        let mut out = Vec::with_capacity(received.len());
        let mut off = 0usize;
        for t in &received {
            let Device::Cuda { uuid, .. } = t.device() else {
                out.push(t.clone());
                continue;
            };
            let n = t.nbytes();
            let gpu = crate::cuda::ordinal_of(uuid).unwrap_or(0);
            let src = t
                .with_device_buffer(|d| d.device_ptr())
                .map_err(|e| err(e.to_string()))?;
            copies.push((gpu, src, off, n));
            // Laid out within the region's length (`len` above).
            out.push(Tensor::view_of_storage(
                t.dtype(),
                t.shape().into(),
                whole.storage(),
                off,
            ));
            off = (off + n).next_multiple_of(ALIGN);
        }
        // The copies block on the GPU: off the executor.
        tokio::task::spawn_blocking(move || -> Result<(), String> {
            let mut gpus: Vec<Arc<crate::cuda::Gpu>> = Vec::new();
            let mut outcome = Ok(());
            for (o, src, off, n) in copies {
                let gpu = match crate::cuda::gpu(o) {
                    Ok(g) => g,
                    Err(e) => {
                        outcome = Err(e.to_string());
                        break;
                    }
                };
                if !gpus.iter().any(|g| g.ordinal() == o) {
                    gpus.push(gpu.clone());
                }
                // SAFETY: `off + n` lies within the region, which this
                // closure holds until the copies are waited for below, as
                // `received` holds the device memory.
                if let Err(e) = unsafe { gpu.enqueue_dtoh(region.ptr().add(off), src, n) } {
                    outcome = Err(e.to_string());
                    break;
                }
            }
            // Every enqueued copy ends before its memory can go.
            for g in gpus {
                if let Err(e) = g.synchronize() {
                    outcome = outcome.and(Err(e.to_string()));
                }
            }
            drop((received, region));
            outcome
        })
        .await
        .map_err(|e| err(format!("the copy to the host panicked: {e}")))?
        .map_err(|e| err(format!("copying to the host: {e}")))?;
        Ok(out)
    }

    /// The tensors a receive fills and where each one's bytes go (`None`
    /// for empty tensors), plus what must live while the read runs.
    #[allow(clippy::type_complexity)]
    /// Where the target tensors `ts` take each tensor's bytes (contract
    /// point 7), moving plain host targets into registered memory first.
    fn target_destinations(
        &self,
        agent: &Arc<Agent>,
        metas: &[TensorMeta],
        ts: &[Tensor],
        from: &Peer,
    ) -> Result<TargetDests, TransportError> {
        let err = |m: String| TransportError::with_peer(NAME, from, m);
        let mut keep = Vec::new();
        let mut dests: Vec<Option<Dest>> = Vec::with_capacity(metas.len());
        check_received(NAME, metas, ts).map_err(|e| err(e.message))?;
        // Plain host targets move into one registered region first
        // (once: the next receive into them is in place).
        // Views of one storage move it once, whole.
        let mut seen = rustc_hash::FxHashSet::default();
        let plain: Vec<&Tensor> = ts
            .iter()
            .filter(|t| {
                !t.is_cuda()
                    && t.nbytes() > 0
                    && !t.with_external(|e| {
                        e.is_some_and(|e| e.memory().as_any().is::<NixlHostMem>())
                    })
                    && seen.insert(t.storage_id())
            })
            .collect();
        if !plain.is_empty() {
            let len = plain.iter().fold(0usize, |a, t| {
                (a + t.storage_nbytes()).next_multiple_of(ALIGN)
            });
            let region = HostRegion::new(agent, len).map_err(|e| err(e.0))?;
            let mut off = 0usize;
            for t in plain {
                let mem = Box::new(NixlHostMem {
                    region: region.clone(),
                    offset: off,
                    len: t.storage_nbytes(),
                });
                if !t.migrate_storage(mem).map_err(|e| err(e.to_string()))? {
                    return Err(err(format!(
                        "target tensor {:?} lives in memory of another transport; \
                         receive into rdt host tensors (Tensor::zeros) or tensors \
                         received over nixl",
                        t.meta()
                    )));
                }
                off = (off + t.storage_nbytes()).next_multiple_of(ALIGN);
            }
        }
        keep.push(one_per_storage(ts));
        let mut regs = SlabRegistrations::default();
        let mut runs = Vec::new();
        // Views of one storage (a flat buffer of parameters) share
        // its lookup: each lies at the storage's base plus its
        // offset. (The lookup also orders rdt's stream after the
        // storage's last writer, once per storage.)
        let mut last: Option<(usize, Desc, u64)> = None; // storage, its base, registration
        for (i, t) in ts.iter().enumerate() {
            let dest = match &last {
                Some((id, base, reg)) if *id == t.storage_id() && t.nbytes() > 0 => Some(Dest {
                    desc: Desc {
                        addr: base.addr + t.byte_offset(),
                        len: t.nbytes(),
                        ..*base
                    },
                    local_reg: *reg,
                }),
                _ => {
                    let d = self.local_dest(agent, t, &mut regs).map_err(err)?;
                    if let Some(d) = &d {
                        let base = Desc {
                            addr: d.desc.addr - t.byte_offset(),
                            ..d.desc
                        };
                        last = Some((t.storage_id(), base, d.local_reg));
                        runs.push(Run {
                            first: i,
                            storage: Arc::downgrade(t.storage()),
                            base,
                            reg: d.local_reg,
                        });
                    }
                    d
                }
            };
            dests.push(dest);
        }
        keep.extend(regs.into_kept());
        Ok(TargetDests { dests, keep, runs })
    }

    /// The plan of a receive into `ts` (NX-8): a kept one made for the
    /// same content and the same targets whose memory has not moved, or
    /// one worked out now (and kept, for a large object). With it, what
    /// the read keeps alive: a tensor per target storage and the slab
    /// registrations (PL-1).
    fn target_plan(
        &self,
        agent: &Arc<Agent>,
        exported: &Exported,
        ts: &Arc<[Tensor]>,
        layout: Option<u64>,
        from: &Peer,
    ) -> Result<(Arc<TargetPlan>, Vec<Kept>), TransportError> {
        let err = |m: String| TransportError::with_peer(NAME, from, m);
        let metas = &exported.metas;
        let kept = metas.len() >= PLAN_MIN_TENSORS;
        if kept {
            if let Some(p) = self
                .target_plans
                .find(|p| p.content.fits(exported, layout) && (p.made_for(ts) || p.same_places(ts)))
            {
                // Contract point 2: the targets are what the metadata says
                // (as they were when the plan was made, if they are its
                // own list: nothing in it changes).
                let own = p.made_for(ts);
                if !own {
                    check_received(NAME, metas, ts).map_err(|e| err(e.message))?;
                }
                if let Some(keep) = self.target_memory_unmoved(agent, &p, ts) {
                    bump(&COUNTERS.target_plans_reused, 1);
                    bump(&COUNTERS.target_lists_reused, u64::from(own));
                    return Ok((p, keep));
                }
            }
        }
        let h = Handles::decode(&exported.handles, metas).map_err(err)?;
        check_handles(&h, metas).map_err(err)?;
        let TargetDests { dests, keep, runs } = self.target_destinations(agent, metas, ts, from)?;
        // Pair remote and local ranges (one pair per tensor, in order: no
        // map on a path that 10 000 tensors take).
        let mut pairs: Vec<Pair> = Vec::with_capacity(h.tensors.len());
        for (p, d) in h.tensors.iter().zip(&dests) {
            let Some(d) = d else { continue };
            pairs.push(h.pair(p, d.desc, d.local_reg));
        }
        let lists = coalesce(pairs);
        let content = if kept {
            PlanContent {
                handles: exported.handles.clone(),
                metas: metas.clone(),
                layout: AtomicU64::new(layout.unwrap_or(0)),
            }
        } else {
            PlanContent::default()
        };
        let plan = Arc::new(TargetPlan {
            content,
            targets: Arc::downgrade(ts),
            h,
            places: ts
                .iter()
                .map(|t| (t.storage_id(), t.byte_offset()))
                .collect(),
            runs,
            lists,
        });
        if kept {
            self.target_plans.keep(plan.clone());
        }
        Ok((plan, keep))
    }

    /// Whether each target storage of `plan` is still where it was, in the
    /// same registration (NX-8): looked up once per storage, as a receive
    /// without a plan does. Then what the read keeps alive.
    fn target_memory_unmoved(
        &self,
        agent: &Arc<Agent>,
        plan: &TargetPlan,
        ts: &[Tensor],
    ) -> Option<Vec<Kept>> {
        let mut regs = SlabRegistrations::default();
        for run in &plan.runs {
            let t = &ts[run.first];
            let d = self.local_dest(agent, t, &mut regs).ok()??;
            let base = Desc {
                addr: d.desc.addr - t.byte_offset(),
                ..d.desc
            };
            if base != run.base || d.local_reg != run.reg {
                return None;
            }
        }
        let mut keep = vec![one_per_storage(plan.runs.iter().map(|r| &ts[r.first]))];
        keep.extend(regs.into_kept());
        Some(keep)
    }

    /// Where `t`'s bytes are in registered memory of this process.
    fn local_dest(
        &self,
        agent: &Arc<Agent>,
        t: &Tensor,
        regs: &mut SlabRegistrations,
    ) -> Result<Option<Dest>, String> {
        if t.nbytes() == 0 {
            return Ok(None);
        }
        if t.is_cuda() {
            let found = t
                .with_device_buffer(|d| slab_of(d).map(|(s, o)| (s, o, d.device_ptr())))
                .map_err(|e| e.to_string())?;
            let Some((slab, _, ptr)) = found else {
                return Err(format!(
                    "target tensor {:?} is not in memory rdt allocated on this GPU (a cuda_ipc \
                     import?); receive into tensors made with Tensor::cuda_empty",
                    t.meta()
                ));
            };
            let g = regs.of(self, agent, &slab).map_err(|e| e.0)?.generation;
            let d = Desc {
                mem: Mem::Vram,
                addr: ptr as usize,
                len: t.nbytes(),
                dev: slab.gpu.ordinal() as u64,
            };
            return Ok(Some(Dest {
                desc: d,
                local_reg: g,
            }));
        }
        let found = t.with_external(|e| {
            let e = e?;
            let m = e.memory().as_any().downcast_ref::<NixlHostMem>()?;
            Some((m.region.clone(), e.as_ptr() as usize))
        });
        let (region, addr) = found.ok_or_else(|| {
            format!(
                "tensor {:?} is not in registered memory (internal error)",
                t.meta()
            )
        })?;
        let g = region.slab.reg.generation;
        Ok(Some(Dest {
            desc: Desc {
                mem: Mem::Dram,
                addr,
                len: t.nbytes(),
                dev: 0,
            },
            local_reg: g,
        }))
    }
}

/// One tensor per storage of `ts` (neighbours of one storage count once:
/// a flat buffer's views are one), which keeps their memory alive.
fn one_per_storage<'a>(ts: impl IntoIterator<Item = &'a Tensor>) -> Kept {
    let mut storages: Vec<Tensor> = Vec::new();
    for t in ts {
        if storages.last().is_none_or(|l| !l.shares_storage(t)) {
            storages.push(t.clone());
        }
    }
    Kept::Tensors(storages)
}

/// What [`NixlTransport::target_destinations`] worked out.
struct TargetDests {
    /// Where each target's bytes are (`None`: it has none).
    dests: Vec<Option<Dest>>,
    /// What the read keeps alive.
    keep: Vec<Kept>,
    /// Where each run of targets in one storage started.
    runs: Vec<Run>,
}

/// Targets in a row in one storage, as a [`TargetPlan`] found them.
struct Run {
    /// The first of them.
    first: usize,
    /// Their storage, held, never read. Weak: a plan does not keep a
    /// caller's memory alive, yet the storage's address is not reused
    /// while this lives, so a target at that address is that storage.
    #[allow(dead_code)]
    storage: std::sync::Weak<crate::tensor::Storage>,
    /// Where the storage's bytes started (its descriptor at offset 0).
    base: Desc,
    /// The registration they were in.
    reg: u64,
}

/// The content a plan was made for: the handles' bytes and the metadata,
/// compared once per layout and found by the layout's id after.
#[derive(Default)]
struct PlanContent {
    handles: Vec<u8>,
    metas: Vec<TensorMeta>,
    /// The last layout ([`TransferCtx::layout`]) found to be that content
    /// (0: none yet).
    layout: AtomicU64,
}

impl PlanContent {
    /// Made for `exported`'s content. A layout seen before answers at
    /// once; otherwise the content is compared, and the layout of a match
    /// remembered.
    fn fits(&self, exported: &Exported, layout: Option<u64>) -> bool {
        if layout.is_some_and(|l| self.layout.load(Ordering::Relaxed) == l) {
            return true;
        }
        let same = self.handles == exported.handles && self.metas == exported.metas;
        if let (true, Some(l)) = (same, layout) {
            self.layout.store(l, Ordering::Relaxed);
        }
        same
    }
}

/// A receive into target tensors, worked out once per layout and targets
/// (NX-8): a weight update reads the same layout into the same parameters
/// at every step, and working out its 10 000 destinations, pairs and
/// coalesced descriptors each time cost most of its pass.
struct TargetPlan {
    content: PlanContent,
    /// The target list it was made for. A receive into that list again
    /// (a [`Target::Tensors`] the caller kept) has the same places and
    /// passes the same check, since a list is never written; the weak
    /// reference keeps its address from being taken by another list.
    targets: std::sync::Weak<[Tensor]>,
    /// The handles, decoded and checked against the metadata.
    h: Handles,
    /// Each target's storage and byte offset.
    places: Vec<(usize, usize)>,
    /// Each run of targets in one storage: checked on every receive.
    runs: Vec<Run>,
    /// The coalesced (local, remote) descriptor lists.
    lists: Vec<(Vec<Desc>, Vec<Desc>)>,
}

impl TargetPlan {
    /// Whether `ts` is the very list this plan was made for.
    fn made_for(&self, ts: &Arc<[Tensor]>) -> bool {
        std::ptr::addr_eq(self.targets.as_ptr(), Arc::as_ptr(ts))
    }

    /// Whether `ts` are the targets this plan was made for: the same
    /// storages at the same offsets. An equal address is the same storage:
    /// each storage with bytes among the targets starts a run, whose weak
    /// reference keeps its address from being reused ([`Run::storage`]).
    /// Their memory is checked apart.
    fn same_places(&self, ts: &[Tensor]) -> bool {
        ts.len() == self.places.len()
            && ts
                .iter()
                .zip(&self.places)
                .all(|(t, &(s, o))| t.storage_id() == s && t.byte_offset() == o)
    }
}

/// The target of a receive into fresh memory, as a read plan keys it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PlanTarget {
    Any,
    Device(usize),
    Host,
}

impl PlanTarget {
    fn of(t: &Target) -> PlanTarget {
        match t {
            Target::Device(o) => PlanTarget::Device(*o),
            Target::Host => PlanTarget::Host,
            Target::Any | Target::Tensors(_) => PlanTarget::Any,
        }
    }
}

/// Where a tensor received into fresh memory lands.
#[derive(Clone, Copy, Debug)]
enum At {
    /// At this offset of the range taken on GPU lane `.0` (the lane's index
    /// in [`ReadPlan::lanes`]).
    Lane(u32, usize),
    /// At this offset of the host region.
    Host(usize),
    /// Nowhere: a host tensor of no bytes.
    Empty,
}

/// A receive into fresh memory, worked out once per layout (NX-7).
struct ReadPlan {
    target: PlanTarget,
    /// The handles' bytes and the metadata it was made for (its key,
    /// with the target).
    content: PlanContent,
    /// The handles, decoded and checked against the metadata.
    h: Handles,
    /// Bytes taken on each GPU, one range per GPU: (ordinal, length).
    lanes: Vec<(usize, usize)>,
    /// Bytes of the host region (laid out like the producer's memory, so
    /// neighbours stay neighbours); 0: none.
    host_len: usize,
    /// Where each tensor lands.
    at: Vec<At>,
    /// Each distinct (dtype, shape) of the object, once.
    kinds: Vec<(crate::DType, crate::Shape)>,
    /// Each tensor's index in `kinds`: making 10 000 views reads 4 bytes
    /// of this and a few kinds, not 10 000 metadata entries of 72 bytes.
    kind_of: Vec<u32>,
    /// The bytes of all tensors.
    nbytes: usize,
    /// The coalesced (local, remote) descriptor lists, each local address
    /// an offset in its lane (`dev` is the lane's GPU) or in the host
    /// region.
    lists: Vec<(Vec<Desc>, Vec<Desc>)>,
}

/// Read plans kept (the last used first).
const PLANS_KEPT: usize = 4;

/// Objects with at least this many tensors come back as lazy lists, and
/// their plans are kept in [`NixlTransport::plans`]; smaller ones in
/// [`NixlTransport::small_plans`].
const PLAN_MIN_TENSORS: usize = 64;

/// Small objects' read plans kept. Since every head of 64 bytes or more
/// gets a layout id (`RecentHeads`), a small object passed again finds
/// its plan by that id, one comparison; planning it again (decoding and
/// checking its handles) took about 2.5 µs of a 4 KiB pass on the 2×H200
/// host.
const SMALL_PLANS_KEPT: usize = 8;

/// The distinct (dtype, shape) pairs of `metas` in order of first use,
/// and each tensor's index among them (a model's parameters have a few
/// hundred shapes at most).
fn kinds_of(metas: &[TensorMeta]) -> (Vec<(crate::DType, crate::Shape)>, Vec<u32>) {
    let mut index: rustc_hash::FxHashMap<(crate::DType, &[usize]), u32> = Default::default();
    let mut kinds = Vec::new();
    let kind_of = metas
        .iter()
        .map(|m| {
            *index.entry((m.dtype, &m.shape[..])).or_insert_with(|| {
                kinds.push((m.dtype, m.shape.clone()));
                (kinds.len() - 1) as u32
            })
        })
        .collect();
    (kinds, kind_of)
}

impl ReadPlan {
    fn new(exported: &Exported, target: PlanTarget) -> Result<ReadPlan, String> {
        let metas = &exported.metas;
        let h = Handles::decode(&exported.handles, metas)?;
        check_handles(&h, metas)?;
        // CUDA tensors land on the same GPU where this process sees it,
        // else on its first GPU; on the host if it has none.
        let cuda_here = crate::cuda::available().is_ok();
        let gpu_of: Vec<Option<usize>> = metas
            .iter()
            .map(|m| match (&m.device, target) {
                (Device::Cpu, _) | (_, PlanTarget::Host) => None,
                (Device::Cuda { .. }, PlanTarget::Any) if !cuda_here => None,
                (Device::Cuda { .. }, PlanTarget::Device(o)) => Some(o),
                (Device::Cuda { uuid, .. }, _) => Some(crate::cuda::ordinal_of(uuid).unwrap_or(0)),
            })
            .collect();
        let mut at = vec![At::Empty; metas.len()];
        // Host tensors: one region laid out like the producer's, so
        // neighbours stay neighbours (one descriptor).
        let mut order: Vec<usize> = (0..metas.len())
            .filter(|&i| gpu_of[i].is_none() && metas[i].nbytes() > 0)
            .collect();
        order.sort_by_key(|&i| (h.tensors[i].region, h.tensors[i].offset));
        let mut host_len = 0usize;
        let mut run: Option<(u32, u64, u64, usize)> = None; // region, start, end, local base
        for &i in &order {
            let p = h.tensors[i];
            let end = p.offset + p.len;
            match &mut run {
                Some((r, start, rend, base))
                    if *r == p.region && p.offset <= *rend + MERGE_GAP as u64 =>
                {
                    at[i] = At::Host(*base + (p.offset - *start) as usize);
                    *rend = (*rend).max(end);
                    host_len = host_len.max(*base + (*rend - *start) as usize);
                }
                _ => {
                    let base = host_len.next_multiple_of(ALIGN);
                    at[i] = At::Host(base);
                    run = Some((p.region, p.offset, end, base));
                    host_len = base + p.len as usize;
                }
            }
        }
        // CUDA tensors: one range per GPU for the whole object, laid out
        // back to back (one allocation, and neighbours for the coalescer).
        let mut lanes: Vec<(usize, usize)> = Vec::new();
        for (i, m) in metas.iter().enumerate() {
            if let Some(o) = gpu_of[i] {
                let lane = match lanes.iter().position(|&(n, _)| n == o) {
                    Some(l) => l,
                    None => {
                        lanes.push((o, 0));
                        lanes.len() - 1
                    }
                };
                let len = &mut lanes[lane].1;
                at[i] = At::Lane(lane as u32, *len);
                *len = (*len + m.nbytes()).next_multiple_of(crate::cuda::alloc::ALIGN);
            }
        }
        // Pair remote and local ranges, local ones as offsets: a lane is
        // one range of one slab (one registration) and the host region is
        // one registration, so (memory type, GPU) tells them apart.
        let mut pairs: Vec<Pair> = Vec::with_capacity(metas.len());
        for (p, a) in h.tensors.iter().zip(&at) {
            let len = p.len as usize;
            let local = match *a {
                _ if len == 0 => continue,
                At::Lane(l, offset) => Desc {
                    mem: Mem::Vram,
                    addr: offset,
                    len,
                    dev: lanes[l as usize].0 as u64,
                },
                At::Host(offset) => Desc {
                    mem: Mem::Dram,
                    addr: offset,
                    len,
                    dev: 0,
                },
                At::Empty => continue,
            };
            pairs.push(h.pair(p, local, 0));
        }
        let lists = coalesce(pairs);
        let (kinds, kind_of) = kinds_of(metas);
        bump(&COUNTERS.read_plans_made, 1);
        Ok(ReadPlan {
            target,
            content: PlanContent {
                handles: exported.handles.clone(),
                metas: metas.clone(),
                layout: AtomicU64::new(0),
            },
            h,
            lanes,
            host_len,
            nbytes: metas.iter().map(TensorMeta::nbytes).sum(),
            at,
            kinds,
            kind_of,
            lists,
        })
    }

    /// Made for this content and target.
    fn fits(&self, exported: &Exported, target: PlanTarget, layout: Option<u64>) -> bool {
        self.target == target && self.content.fits(exported, layout)
    }
}

impl NixlTransport {
    /// The read plan for `exported` into fresh memory: a recent one made
    /// for the same bytes, metadata and target, or a new one (NX-7).
    fn read_plan(
        &self,
        exported: &Exported,
        target: PlanTarget,
        layout: Option<u64>,
    ) -> Result<Arc<ReadPlan>, String> {
        let plans = if exported.metas.len() >= PLAN_MIN_TENSORS {
            &self.plans
        } else {
            &self.small_plans
        };
        if let Some(p) = plans.find(|p| p.fits(exported, target, layout)) {
            bump(&COUNTERS.read_plans_reused, 1);
            return Ok(p);
        }
        let p = Arc::new(ReadPlan::new(exported, target)?);
        if let Some(l) = layout {
            p.content.layout.store(l, Ordering::Relaxed);
        }
        plans.keep(p.clone());
        Ok(p)
    }

    /// Takes the memory `plan` lays out (one range per GPU, one host
    /// region), makes each tensor a view of it, and turns the plan's
    /// descriptor offsets into addresses in it.
    ///
    /// The tensors of a kept plan (a large object) come back as a lazy list
    /// ([`PlannedViews`]): each view is made when a call's decode wants it.
    /// Also says which GPUs' ranges are not clean (`cuda::alloc`,
    /// invariant 5): the read waits for rdt's stream there first.
    fn take_planned(
        &self,
        agent: &Arc<Agent>,
        plan: &Arc<ReadPlan>,
        err: &dyn Fn(String) -> TransportError,
    ) -> Result<Destination, TransportError> {
        let mut keep = Vec::new();
        // Each GPU's range and registration are found once, not per
        // tensor; each tensor is a view of it (a reference count, not an
        // allocation).
        struct Lane {
            base: u64,
            /// A tensor over the whole range, whose storage the received
            /// tensors are views of.
            whole: Tensor,
        }
        let mut lanes: Vec<Lane> = Vec::with_capacity(plan.lanes.len());
        let mut not_clean = Vec::new();
        for &(o, len) in &plan.lanes {
            let gpu = crate::cuda::gpu(o).map_err(|e| err(format!("CUDA device {o}: {e}")))?;
            let (r, clean) = crate::cuda::alloc::alloc_for_other_stream(&gpu, len.max(1))
                .map_err(|e| err(format!("allocating {len} B on CUDA device {o}: {e}")))?;
            if !clean {
                not_clean.push(o);
            }
            // The id is the lane's address: whether destinations repeat
            // (their READ requests are kept per address) shows here.
            crate::cuda::timeline(
                "nixl lane allocated",
                crate::cuda::DeviceBuffer::device_ptr(&r),
            );
            let reg = self
                .slab_registration(agent, &r.slab)
                .map_err(|e| err(e.0))?;
            crate::cuda::timeline("nixl lane registration found", 0);
            let range = Arc::new(r);
            let range_len = crate::cuda::DeviceBuffer::len(&*range);
            let whole = Tensor::from_device_buffer(
                crate::DType::U8,
                &[range_len],
                range.slab.gpu.device(),
                Box::new(crate::cuda::alloc::SlabSlice::new(
                    range.clone(),
                    0,
                    range_len,
                )),
            )
            .map_err(|e| err(e.to_string()))?;
            lanes.push(Lane {
                base: crate::cuda::DeviceBuffer::device_ptr(&*range),
                whole,
            });
            keep.push(Kept::Slab(reg));
            keep.push(Kept::Range(range));
        }
        crate::cuda::timeline("nixl lanes ready", 0);
        let host = if plan.host_len == 0 {
            None
        } else {
            let region = HostRegion::new(agent, plan.host_len).map_err(|e| err(e.0))?;
            keep.push(Kept::Host(region.clone()));
            let len = region.len;
            let whole = Tensor::from_external(
                crate::DType::U8,
                &[len],
                Device::Cpu,
                Box::new(NixlHostMem {
                    region: region.clone(),
                    offset: 0,
                    len,
                }),
            )
            .map_err(|e| err(e.to_string()))?;
            Some((region, whole))
        };
        let bases: Vec<u64> = lanes.iter().map(|l| l.base).collect();
        let host_ptr = host.as_ref().map(|(r, _)| r.ptr() as usize);
        let views = PlannedViews {
            plan: plan.clone(),
            lanes: lanes.into_iter().map(|l| l.whole).collect(),
            host: host.map(|(_, whole)| whole),
        };
        crate::cuda::timeline("nixl lanes and host ready", 0);
        let out = if plan.at.len() >= PLAN_MIN_TENSORS {
            TensorList::lazy(Arc::new(views))
        } else {
            TensorList::from(
                (0..plan.at.len())
                    .map(|i| views.make(i))
                    .collect::<Vec<_>>(),
            )
        };
        crate::cuda::timeline("nixl views made", 0);
        let lists = plan
            .lists
            .iter()
            .map(|(local, remote)| {
                let local = local
                    .iter()
                    .map(|d| {
                        let base = match d.mem {
                            Mem::Vram => plan
                                .lanes
                                .iter()
                                .position(|&(o, _)| o as u64 == d.dev)
                                .map(|l| bases[l] as usize),
                            _ => host_ptr,
                        }
                        .expect("the plan's descriptors lie in its lanes and region");
                        Desc {
                            addr: base + d.addr,
                            ..*d
                        }
                    })
                    .collect();
                (local, remote.clone())
            })
            .collect();
        Ok(Destination {
            out,
            lists,
            keep,
            not_clean,
        })
    }
}

/// The largest object whose next destination is made ahead (NX-11).
const READY_MAX_BYTES: usize = 64 << 10;

/// Where a READ lands: the tensors it fills, its (local, remote)
/// descriptor lists, what keeps that memory registered and alive, and the
/// GPUs whose memory was not clean (NX-9).
struct Destination {
    out: TensorList,
    lists: Vec<(Vec<Desc>, Vec<Desc>)>,
    keep: Vec<Kept>,
    not_clean: Vec<usize>,
}

impl Destination {
    /// The host bytes it holds (its region, where the plan reads into
    /// host memory).
    fn host_bytes(&self) -> u64 {
        self.keep
            .iter()
            .map(|k| match k {
                Kept::Host(r) => r.len as u64,
                _ => 0,
            })
            .sum()
    }
}

/// A small read's destination made ahead of its receive (NX-11), for its
/// plan. While it waits, its host bytes count as ready, not in use: a
/// consumer with every object freed has no host bytes in use, whatever it
/// made ahead.
struct ReadyDest {
    plan: Arc<ReadPlan>,
    /// `None` once a receive took it.
    dest: Option<Destination>,
}

impl ReadyDest {
    fn new(plan: Arc<ReadPlan>, dest: Destination) -> ReadyDest {
        let host_bytes = dest.host_bytes();
        COUNTERS
            .host_bytes_in_use
            .fetch_sub(host_bytes, Ordering::Relaxed);
        bump(&COUNTERS.host_bytes_ready, host_bytes);
        ReadyDest {
            plan,
            dest: Some(dest),
        }
    }

    /// Its destination, for the receive that takes it: its host bytes in
    /// use from now on.
    fn take(mut self) -> Destination {
        self.unready();
        self.dest.take().expect("a destination is taken once")
    }

    /// Its host bytes back in use (before it is taken, or dropped).
    fn unready(&self) {
        let host_bytes = self.dest.as_ref().map_or(0, Destination::host_bytes);
        COUNTERS
            .host_bytes_ready
            .fetch_sub(host_bytes, Ordering::Relaxed);
        bump(&COUNTERS.host_bytes_in_use, host_bytes);
    }
}

impl Drop for ReadyDest {
    /// Not taken (evicted, its producer gone): back in use for the moment
    /// its region takes to go back to its pool.
    fn drop(&mut self) {
        self.unready();
    }
}

impl ReadPlan {
    /// Is its next destination made ahead (NX-11)? Small objects only:
    /// their set-up is a large share of their pass, and what is made ahead
    /// stays small (at most `SMALL_PLANS_KEPT` of at most
    /// [`READY_MAX_BYTES`]). Host memory too: on one H200, 4 KiB passes
    /// of a host tensor took 0.8-1.7 µs less with it (book: NIXL, "Read
    /// plans").
    fn made_ahead(&self) -> bool {
        (self.host_len > 0 || !self.lanes.is_empty())
            && self.nbytes <= READY_MAX_BYTES
            && self.at.len() < PLAN_MIN_TENSORS
    }
}

impl NixlTransport {
    /// The destination made ahead for `plan`, if there is one (NX-11).
    fn take_ready(&self, plan: &Arc<ReadPlan>) -> Option<Destination> {
        let mut ready = self.ready.lock();
        let at = ready.iter().position(|r| Arc::ptr_eq(&r.plan, plan))?;
        bump(&COUNTERS.dests_taken_ready, 1);
        Some(ready.remove(at).take())
    }

    /// Notes that `plan`'s next destination is to be made ahead. A
    /// process whose receives are not followed by `after_receive` (the
    /// driver's reads) keeps the last few wanted, not all.
    fn want_ready(&self, plan: &Arc<ReadPlan>) {
        if !plan.made_ahead() {
            return;
        }
        let mut wanted = self.wanted.lock();
        if !wanted.iter().any(|p| Arc::ptr_eq(p, plan)) {
            if wanted.len() >= SMALL_PLANS_KEPT {
                wanted.remove(0);
            }
            wanted.push(plan.clone());
        }
    }

    /// Makes the destinations wanted (NX-11): the memory, its
    /// registration, the tensors and the descriptor lists of the next
    /// receive of each plan, so that it posts its READ without them.
    fn make_ready(&self) {
        let wanted = std::mem::take(&mut *self.wanted.lock());
        if wanted.is_empty() {
            return;
        }
        let Ok(agent) = self.agent() else { return };
        let err = |m: String| TransportError::new(NAME, m);
        for plan in wanted {
            if self
                .ready
                .lock()
                .iter()
                .any(|r| Arc::ptr_eq(&r.plan, &plan))
            {
                continue;
            }
            // A failure here is not the receive's: it makes its own.
            let Ok(dest) = self.take_planned(&agent, &plan, &err) else {
                continue;
            };
            bump(&COUNTERS.dests_made_ahead, 1);
            crate::cuda::timeline("nixl destination made ahead", 0);
            let made = ReadyDest::new(plan, dest);
            let mut ready = self.ready.lock();
            if ready.iter().any(|r| Arc::ptr_eq(&r.plan, &made.plan)) {
                continue;
            }
            if ready.len() >= SMALL_PLANS_KEPT {
                ready.remove(0);
            }
            ready.push(made);
        }
    }
}

/// Device memory read into this process's host memory: through its GPU
/// ([`NixlTransport::receive_to_host_through_gpu`]).
fn to_host_through_gpu(cx: &TransferCtx, exported: &Exported) -> bool {
    matches!(cx.target, Target::Host)
        && crate::cuda::available().is_ok()
        && exported.metas.iter().any(|m| !m.device.is_cpu())
}

/// The tensors of a receive through a read plan, made on demand: views of
/// the ranges the receive took (one per GPU) and of its host region, where
/// the plan lays each tensor out (within the range's or the region's
/// length, by construction).
struct PlannedViews {
    plan: Arc<ReadPlan>,
    /// A tensor over each GPU's range, in the plan's lane order.
    lanes: Vec<Tensor>,
    /// A tensor over the host region, if the plan has one.
    host: Option<Tensor>,
}

impl MakeTensors for PlannedViews {
    fn len(&self) -> usize {
        self.plan.at.len()
    }

    fn make(&self, i: usize) -> Tensor {
        self.view(self.plan.at[i], self.plan.kind_of[i])
    }

    fn make_all(&self) -> Vec<Tensor> {
        // One pass over the two compact columns, in order.
        self.plan
            .at
            .iter()
            .zip(&self.plan.kind_of)
            .map(|(&at, &kind)| self.view(at, kind))
            .collect()
    }

    fn nbytes(&self) -> usize {
        self.plan.nbytes
    }
}

impl PlannedViews {
    /// The tensor of kind `kind` the plan put `at`. The plan's metadata is
    /// the receive's (its key: equal content, or the same layout).
    #[inline]
    fn view(&self, at: At, kind: u32) -> Tensor {
        let (dtype, shape) = &self.plan.kinds[kind as usize];
        match (at, &self.host) {
            (At::Lane(l, offset), _) => Tensor::view_of_storage(
                *dtype,
                shape.clone(),
                self.lanes[l as usize].storage(),
                offset,
            ),
            (At::Host(offset), Some(whole)) => {
                Tensor::view_of_storage(*dtype, shape.clone(), whole.storage(), offset)
            }
            // `At::Empty`: a host tensor of no bytes (the plan gives every
            // host tensor with bytes a place in the region).
            _ => Tensor::from_bytes(*dtype, shape, Vec::new())
                .expect("a tensor the plan placed nowhere has no bytes"),
        }
    }
}

/// READs a receive posted and still drives itself (before handing them to
/// the poller). Dropped with some left (its task was cancelled, or one
/// failed), it gives them to the poller, which cancels and releases them
/// while it holds their memory (PL-1, PL-2).
struct Posted<'a> {
    agent: &'a Agent,
    poller: &'static Poller,
    /// Each request, and whether it has already ended.
    reqs: Vec<(agent::Request, bool)>,
    keep: Arc<Vec<Kept>>,
}

impl Posted<'_> {
    /// Asks each READ once; releases those that ended. An error is the
    /// first READ that failed (the others go to the poller on drop).
    fn settle(&mut self) -> Result<(), NixlError> {
        // Ended but not releasable now: kept for a later round (or the
        // poller), and not asked again in this one.
        let mut unreleased = Vec::new();
        let mut i = 0;
        let outcome = loop {
            if i == self.reqs.len() {
                break Ok(());
            }
            let done = self.reqs[i].1
                || match self.agent.progress(&self.reqs[i].0) {
                    agent::Progress::Running => false,
                    agent::Progress::Done => true,
                    agent::Progress::Failed(e) => break Err(e),
                };
            if !done {
                i += 1;
                continue;
            }
            let (req, _) = self.reqs.swap_remove(i);
            match self.agent.finish(req) {
                Ok(()) => bump(&COUNTERS.reads_done_inline, 1),
                Err(req) => unreleased.push((req, false)),
            }
        };
        self.reqs.extend(unreleased);
        outcome
    }

    /// Hands what is left to the poller.
    fn hand_to_poller(mut self) -> Vec<tokio::sync::oneshot::Receiver<Result<(), String>>> {
        let reqs = std::mem::take(&mut self.reqs);
        reqs.into_iter()
            .map(|(r, _)| self.poller.watch(r, Box::new(self.keep.clone())))
            .collect()
    }
}

impl Drop for Posted<'_> {
    fn drop(&mut self) {
        for (r, _) in self.reqs.drain(..) {
            // Nobody waits: the poller cancels and releases it (PL-2).
            drop(self.poller.watch(r, Box::new(self.keep.clone())));
        }
    }
}

/// The rdt slab a tensor's device bytes lie in, and their offset there (a
/// range made by rdt's allocator, or a slice of one; a view adds its own
/// offset).
fn slab_of(d: &crate::DeviceBytes<'_>) -> Option<(Arc<Slab>, usize)> {
    let any = d.buffer().as_any();
    if let Some(r) = any.downcast_ref::<SlabRange>() {
        return Some((r.slab.clone(), r.offset + d.offset()));
    }
    any.downcast_ref::<crate::cuda::alloc::SlabSlice>()
        .map(|s| {
            (
                s.range().slab.clone(),
                s.range().offset + s.offset() + d.offset(),
            )
        })
}

/// Checks the handles against the metadata (malformed input is an error,
/// never a panic or an out-of-range read).
fn check_handles(h: &Handles, metas: &[TensorMeta]) -> Result<(), String> {
    if h.tensors.len() != metas.len() {
        return Err(format!(
            "the handles describe {} tensors, the metadata {}",
            h.tensors.len(),
            metas.len()
        ));
    }
    for (i, (p, m)) in h.tensors.iter().zip(metas).enumerate() {
        let r = h.regions.get(p.region as usize).ok_or_else(|| {
            format!(
                "tensor #{i} names registration {} of {}",
                p.region,
                h.regions.len()
            )
        })?;
        if p.len as usize != m.nbytes() {
            return Err(format!(
                "tensor #{i}: {} B in the handles, {} B by its metadata",
                p.len,
                m.nbytes()
            ));
        }
        if p.offset.checked_add(p.len).is_none_or(|e| e > r.len) {
            return Err(format!(
                "tensor #{i} reaches past its registration ({}+{} of {} B)",
                p.offset, p.len, r.len
            ));
        }
        let cuda = matches!(m.device, Device::Cuda { .. });
        if cuda != (r.mem == Mem::Vram) {
            return Err(format!(
                "tensor #{i} is on {} but its registration is {:?} memory",
                m.device, r.mem
            ));
        }
    }
    Ok(())
}

/// Orders the pairs by memory types and remote address and merges
/// neighbours whose gap is at most [`MERGE_GAP`] on both sides (the gap is
/// read too: cheaper than a descriptor); one (local, remote) list per pair
/// of memory types, since one READ moves between two types only.
///
/// A receive lays its new tensors out in the producer's order, so the pairs
/// usually come sorted: checking that is one pass, and then they are not
/// moved at all.
fn coalesce(mut pairs: Vec<Pair>) -> Vec<(Vec<Desc>, Vec<Desc>)> {
    let key = |p: &Pair| {
        (
            p.local.mem == Mem::Vram,
            p.remote.mem == Mem::Vram,
            p.remote_reg,
            p.remote.addr,
        )
    };
    if !pairs.is_sorted_by_key(key) {
        pairs.sort_by_key(key);
    }
    let mut out: Vec<(Vec<Desc>, Vec<Desc>)> = Vec::new();
    let mut last: Option<(u64, u64)> = None;
    for Pair {
        remote: r,
        remote_reg: rg,
        local: l,
        local_reg: lg,
    } in pairs
    {
        let open = out
            .last_mut()
            .filter(|(lo, re)| lo[0].mem == l.mem && re[0].mem == r.mem);
        let Some((local, remote)) = open else {
            out.push((vec![l], vec![r]));
            last = Some((rg, lg));
            continue;
        };
        if let (Some(pl), Some(pr), Some((prg, plg))) = (local.last_mut(), remote.last_mut(), last)
        {
            let rend = pr.addr + pr.len;
            let lend = pl.addr + pl.len;
            let same = prg == rg && plg == lg && pr.dev == r.dev && pl.dev == l.dev;
            if same && r.addr >= rend && l.addr >= lend {
                let gap = r.addr - rend;
                if gap == l.addr - lend && gap <= MERGE_GAP {
                    pr.len += gap + r.len;
                    pl.len += gap + l.len;
                    continue;
                }
            }
        }
        local.push(l);
        remote.push(r);
        last = Some((rg, lg));
    }
    out
}

fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    if getrandom::getrandom(&mut b).is_err() {
        return std::process::id().rotate_left(16);
    }
    u32::from_le_bytes(b)
}

impl TensorTransport for NixlTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn sidedness(&self) -> Sidedness {
        Sidedness::OneSided
    }

    fn check_device(&self, _device: &Device) -> Result<(), TransportError> {
        // CPU and CUDA alike; whether NIXL itself is installed shows at the
        // first export, with how to install it.
        Ok(())
    }

    fn serves_driver(&self) -> bool {
        true
    }

    /// A small object from a producer this process has read from before
    /// starts on the worker's control loop once the call behind its
    /// delivery is in the actor's mailbox: the READ is posted while the
    /// actor's thread wakes, and waited for in place (it ends within
    /// microseconds; [`set_read_spin`]). Not a large object (its views are
    /// offered to the call's thread, WK-8, and making them holds the loop),
    /// and not a first read from a producer (loading its metadata and
    /// connecting take milliseconds that would hold the loop).
    fn receive_start(&self, exported: &Exported) -> crate::ReceiveStart {
        let small_from_known = || {
            exported.metas.len() < PLAN_MIN_TENSORS
                && HandlesWire::agent_of(&exported.handles)
                    .is_some_and(|a| self.remotes.lock().contains_key(a))
        };
        if small_from_known() {
            crate::ReceiveStart::AfterFramesInHand
        } else {
            crate::ReceiveStart::Task
        }
    }

    fn receives_into(&self, targets: &[Tensor]) -> Result<(), String> {
        // What `destinations` and `local_dest` refuse, checked once per
        // storage (a flat buffer's views are one check).
        let mut last = None;
        for t in targets {
            if t.nbytes() == 0 || last == Some(t.storage_id()) {
                continue;
            }
            last = Some(t.storage_id());
            let ok = if t.is_cuda() {
                t.with_device_buffer(|d| slab_of(d).is_some())
                    .unwrap_or(false)
            } else {
                t.with_external(|e| e.is_none_or(|e| e.memory().as_any().is::<NixlHostMem>()))
            };
            if !ok {
                return Err(format!(
                    "target tensor {:?} is in memory nixl cannot read into (not made by rdt: \
                     a cuda_ipc import, another transport's memory)",
                    t.meta()
                ));
            }
        }
        Ok(())
    }

    fn export<'a>(
        &'a self,
        key: ObjectKey,
        tensors: &'a [Tensor],
    ) -> BoxFuture<'a, Result<Exported, TransportError>> {
        Box::pin(self.export_inner(key, tensors))
    }

    fn receive<'a>(
        &'a self,
        from: &'a Peer,
        cx: &'a TransferCtx,
        exported: &'a Exported,
    ) -> BoxFuture<'a, Result<Vec<Tensor>, TransportError>> {
        if to_host_through_gpu(cx, exported) {
            Box::pin(self.receive_to_host_through_gpu(from, cx, exported))
        } else {
            Box::pin(async move {
                self.receive_inner(from, cx, exported)
                    .await
                    .map(TensorList::into_vec)
            })
        }
    }

    fn receive_list<'a>(
        &'a self,
        from: &'a Peer,
        cx: &'a TransferCtx,
        exported: &'a Exported,
    ) -> BoxFuture<'a, Result<TensorList, TransportError>> {
        Box::pin(async move {
            if to_host_through_gpu(cx, exported) {
                self.receive_to_host_through_gpu(from, cx, exported)
                    .await
                    .map(TensorList::from)
            } else {
                self.receive_inner(from, cx, exported).await
            }
        })
    }

    fn release(&self, key: ObjectKey) -> BoxFuture<'_, Result<(), TransportError>> {
        let kept = self.exports.lock().remove(&key);
        drop(kept);
        if let Some(Ok(a)) = STARTED_AGENT.get() {
            drain_notifications(a);
        }
        Box::pin(async { Ok(()) })
    }

    fn after_receive(&self) {
        self.make_ready();
    }

    fn peer_gone(&self, actor: u64) {
        // Their plans read its memory: the destinations made for them go.
        let prefix = format!("rdt-a{actor}-");
        self.ready
            .lock()
            .retain(|r| !r.plan.h.agent.starts_with(&prefix));
        let Some(Ok(agent)) = STARTED_AGENT.get() else {
            return;
        };
        let mut remotes = self.remotes.lock();
        let gone: Vec<String> = remotes
            .keys()
            .filter(|n| n.starts_with(&prefix))
            .cloned()
            .collect();
        for n in gone {
            remotes.remove(&n);
            if agent.forget_remote(&n).is_ok() {
                bump(&COUNTERS.remote_forgets, 1);
            }
        }
    }
}

/// NIXL through rdt's binding with nothing of rdt around it: an agent,
/// registrations and one READ at a time, waited for by polling its status
/// on the calling thread (as NIXL's own examples do). For baselines: the
/// benchmarks measure rdt's `nixl` passes against this between two plain
/// processes.
pub mod raw {
    use std::sync::Arc;

    use super::agent::{self, Agent, Progress};
    pub use super::api::NixlError;

    /// Where memory is: the host, or a CUDA device (ordinal in this
    /// process).
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    pub enum Memory {
        /// Host memory.
        Host,
        /// CUDA device memory, by ordinal.
        Cuda(u32),
    }

    /// UCX's CUDA transports work in the calling thread's context.
    fn bind(m: Memory) -> Result<(), NixlError> {
        if let Memory::Cuda(o) = m {
            crate::cuda::gpu(o as usize)
                .and_then(|g| g.bind())
                .map_err(|e| NixlError(e.to_string()))?;
        }
        Ok(())
    }

    fn desc(m: Memory, addr: u64, len: usize) -> agent::Desc {
        match m {
            Memory::Host => agent::Desc {
                mem: agent::Mem::Dram,
                addr: addr as usize,
                len,
                dev: 0,
            },
            Memory::Cuda(o) => agent::Desc {
                mem: agent::Mem::Vram,
                addr: addr as usize,
                len,
                dev: o as u64,
            },
        }
    }

    /// One NIXL agent with a UCX backend.
    pub struct RawAgent(Arc<Agent>);

    impl RawAgent {
        /// Makes the agent `name`.
        pub fn new(name: &str) -> Result<RawAgent, NixlError> {
            Agent::new(name).map(|a| RawAgent(Arc::new(a)))
        }

        /// What a peer loads to connect.
        pub fn connection_md(&self) -> Result<Vec<u8>, NixlError> {
            Ok(self.0.connection_md().to_vec())
        }

        /// Registers `len` bytes at `addr`; returns what a peer loads to
        /// read them. Stays registered until [`deregister`](Self::deregister).
        pub fn register(&self, m: Memory, addr: u64, len: usize) -> Result<Vec<u8>, NixlError> {
            bind(m)?;
            self.0.register(desc(m, addr, len))
        }

        /// Undoes [`register`](Self::register).
        pub fn deregister(&self, m: Memory, addr: u64, len: usize) -> Result<(), NixlError> {
            self.0.deregister(desc(m, addr, len))
        }

        /// Loads a peer's metadata; returns its agent name.
        pub fn load_remote(&self, md: &[u8]) -> Result<String, NixlError> {
            self.0.load_remote(md)
        }

        /// Reads `remote` ranges of `peer` into `local` ranges (pairwise,
        /// same lengths) with one READ, and waits for it by polling.
        /// A non-empty `notif` rides on the READ (NIXL's notification
        /// attached to a transfer; rdt sends its own after the read, and
        /// `bench_nixl` times what an attached one costs).
        pub fn read(
            &self,
            local: (Memory, &[(u64, usize)]),
            remote: (Memory, &[(u64, usize)]),
            peer: &str,
            notif: &[u8],
        ) -> Result<(), NixlError> {
            bind(remote.0)?;
            bind(local.0)?;
            let l: Vec<_> = local.1.iter().map(|&(a, n)| desc(local.0, a, n)).collect();
            let r: Vec<_> = remote
                .1
                .iter()
                .map(|&(a, n)| desc(remote.0, a, n))
                .collect();
            // A new request each time, as a plain user of NIXL posts one.
            let (req, _) = self.0.post_read(&l, &r, peer, notif, false)?;
            let outcome = loop {
                match self.0.progress(&req) {
                    Progress::Running => std::hint::spin_loop(),
                    Progress::Done => break Ok(()),
                    Progress::Failed(e) => break Err(e),
                }
            };
            if self.0.release(req).is_err() {
                return Err(NixlError("NIXL would not release a finished READ".into()));
            }
            outcome
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    fn desc(addr: usize, len: usize) -> Desc {
        Desc {
            mem: Mem::Dram,
            addr,
            len,
            dev: 0,
        }
    }

    fn pair(r: usize, l: usize, len: usize) -> Pair {
        Pair {
            remote: desc(r, len),
            remote_reg: 1,
            local: desc(l, len),
            local_reg: 2,
        }
    }

    #[test]
    fn ucx_memory_hooks_are_off_unless_the_process_chose() {
        use std::ffi::OsStr;
        assert_eq!(ucx_default(None), Some("no"));
        for chosen in ["yes", "no", "y", ""] {
            assert_eq!(ucx_default(Some(OsStr::new(chosen))), None, "{chosen:?}");
        }
    }

    #[test]
    fn neighbours_become_one_descriptor_and_others_stay_apart() {
        // Three neighbours with the same 64-byte gap on both sides, given
        // out of order; then one whose local gap differs.
        let pairs = vec![
            pair(1128, 5128, 1000),
            pair(0, 4000, 1000),
            pair(2192, 6192, 100),
            pair(3000, 9000, 10),
        ];
        let lists = coalesce(pairs);
        assert_eq!(lists.len(), 1, "one pair of memory types");
        let (local, remote) = &lists[0];
        assert_eq!(remote, &vec![desc(0, 2292), desc(3000, 10)]);
        assert_eq!(local, &vec![desc(4000, 2292), desc(9000, 10)]);
    }

    #[test]
    fn each_pair_of_memory_types_gets_its_own_list() {
        // Host and device neighbours never merge, and each list is one
        // type on each side, whatever order the tensors came in.
        let mut on_gpu = pair(1000, 2000, 1000);
        on_gpu.local.mem = Mem::Vram;
        let lists = coalesce(vec![pair(2000, 1000, 1000), on_gpu, pair(0, 0, 1000)]);
        assert_eq!(lists.len(), 2);
        for (local, remote) in &lists {
            assert!(local.iter().all(|d| d.mem == local[0].mem));
            assert!(remote.iter().all(|d| d.mem == remote[0].mem));
        }
        let host = lists.iter().find(|(l, _)| l[0].mem == Mem::Dram).unwrap();
        assert_eq!(host.1, vec![desc(0, 1000), desc(2000, 1000)]);
        let gpu = lists.iter().find(|(l, _)| l[0].mem == Mem::Vram).unwrap();
        assert_eq!(gpu.1, vec![desc(1000, 1000)]);
    }

    #[test]
    fn descriptors_never_span_two_registrations() {
        let mut b = pair(1000, 2000, 10);
        b.remote_reg = 7;
        let lists = coalesce(vec![pair(0, 1000, 1000), b]);
        assert_eq!(lists[0].1.len(), 2);
    }

    /// Handles of `tensors` in one host registration of `len` bytes at
    /// `base`.
    fn in_one_dram_region(base: u64, len: u64, tensors: Vec<Piece>) -> Handles {
        Handles {
            agent: "a".into(),
            conn: vec![1],
            regions: vec![RegionHandle {
                generation: 1,
                mem: Mem::Dram,
                base,
                len,
                dev: 0,
                md: vec![1],
            }],
            tensors,
        }
    }

    #[test]
    fn a_plan_is_found_by_its_layout_without_reading_the_content_again() {
        // 100 host tensors of 64 B, neighbours in one registration (only
        // metadata: no tensor, so the process-wide host pool, which
        // another test counts, is left alone).
        let metas: Vec<TensorMeta> = (0..100)
            .map(|_| TensorMeta {
                dtype: crate::DType::U8,
                shape: [64usize][..].into(),
                device: Device::Cpu,
            })
            .collect();
        let h = in_one_dram_region(
            1 << 20,
            1 << 20,
            (0..100)
                .map(|i| Piece {
                    region: 0,
                    offset: i * 64,
                    len: 64,
                })
                .collect(),
        );
        let ex = Exported {
            metas,
            handles: h.encode().unwrap(),
            inline: Vec::new(),
        };
        let plan = ReadPlan::new(&ex, PlanTarget::Host).unwrap();
        assert_eq!(plan.lists.len(), 1, "one coalesced list");
        // Unknown layout: the content decides.
        assert!(plan.fits(&ex, PlanTarget::Host, None));
        let mut other = ex.clone();
        other.metas[0].shape = [32usize, 2][..].into();
        assert!(!plan.fits(&other, PlanTarget::Host, None));
        // A layout is taken on once its content matched...
        assert!(!plan.fits(&other, PlanTarget::Host, Some(6)));
        assert!(plan.fits(&ex, PlanTarget::Host, Some(5)));
        // ... and from then on answers without reading the content (the
        // framework's promise: the same layout, the same bytes; the other
        // content here shows nothing was compared).
        assert!(plan.fits(&other, PlanTarget::Host, Some(5)));
        assert!(!plan.fits(&other, PlanTarget::Host, Some(6)));
        // The target is always checked.
        assert!(!plan.fits(&ex, PlanTarget::Any, Some(5)));
    }

    #[test]
    fn handles_travel_as_runs_and_offsets() {
        let metas: Vec<TensorMeta> = [4usize, 8, 0, 2]
            .iter()
            .map(|&n| Tensor::zeros(crate::DType::F32, &[n]).meta())
            .collect();
        let region = |g| RegionHandle {
            generation: g,
            mem: Mem::Dram,
            base: 4096 * g,
            len: 1 << 20,
            dev: 0,
            md: vec![g as u8],
        };
        let h = Handles {
            agent: "a".into(),
            conn: vec![1, 2],
            regions: vec![region(1), region(2)],
            tensors: [(0u32, 0u64), (0, 512), (1, 7 << 40), (0, 1024)]
                .iter()
                .zip(&metas)
                .map(|(&(region, offset), m)| Piece {
                    region,
                    offset,
                    len: m.nbytes() as u64,
                })
                .collect(),
        };
        let bytes = h.encode().unwrap();
        let back = Handles::decode(&bytes, &metas).unwrap();
        assert_eq!((back.agent.as_str(), &back.conn[..]), ("a", &[1u8, 2][..]));
        assert_eq!(back.regions.len(), 2);
        let got: Vec<(u32, u64, u64)> = back
            .tensors
            .iter()
            .map(|p| (p.region, p.offset, p.len))
            .collect();
        let want: Vec<(u32, u64, u64)> = h
            .tensors
            .iter()
            .map(|p| (p.region, p.offset, p.len))
            .collect();
        assert_eq!(got, want);
        // Three runs: two tensors in registration 0, one in 1, one in 0.
        let w: HandlesWire = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(w.runs, [(0, 2), (1, 1), (0, 1)]);
        // The gaps, one per tensor, and back as runs.
        let zigzags = crate::metas_wire::expand_runs(&w.gaps).unwrap();
        assert_eq!(zigzags.len(), 4);
        let runs_of = |v: &[u64]| {
            let mut b = Vec::new();
            crate::metas_wire::put_runs(&mut b, v.iter().copied());
            b
        };
        // Neighbours (a flat buffer's views) are a byte each.
        let flat: Vec<TensorMeta> = (0..1000)
            .map(|_| Tensor::zeros(crate::DType::U8, &[4096]).meta())
            .collect();
        let packed = Handles {
            tensors: (0..1000)
                .map(|i| Piece {
                    region: 0,
                    offset: 8192 + 4096 * i,
                    len: 4096,
                })
                .collect(),
            ..h.clone()
        };
        let pb = packed.encode().unwrap();
        let pw: HandlesWire = postcard::from_bytes(&pb).unwrap();
        assert!(
            pw.gaps.len() <= 6,
            "the first gap (8192) and one run of 999 zeros: {} bytes",
            pw.gaps.len()
        );
        let offsets: Vec<u64> = Handles::decode(&pb, &flat)
            .unwrap()
            .tensors
            .iter()
            .map(|p| p.offset)
            .collect();
        assert_eq!(
            offsets,
            (0..1000).map(|i| 8192 + 4096 * i).collect::<Vec<_>>()
        );
        // Fewer metadata than tensors, runs that do not add up, and cut
        // offsets are errors, never a panic.
        assert!(Handles::decode(&bytes, &metas[..3])
            .unwrap_err()
            .contains("malformed"));
        for bad in [
            HandlesWire {
                runs: vec![(0, 5)],
                ..postcard::from_bytes(&bytes).unwrap()
            },
            // Cut short, one too many, a first offset below 0, and a run
            // without its count.
            HandlesWire {
                gaps: runs_of(&zigzags[..zigzags.len() - 1]),
                ..postcard::from_bytes(&bytes).unwrap()
            },
            HandlesWire {
                gaps: runs_of(&[&zigzags[..], &[0]].concat()),
                ..postcard::from_bytes(&bytes).unwrap()
            },
            HandlesWire {
                gaps: runs_of(&[&[zigzag(-1)][..], &zigzags[1..]].concat()),
                ..postcard::from_bytes(&bytes).unwrap()
            },
            HandlesWire {
                gaps: vec![1],
                ..postcard::from_bytes(&bytes).unwrap()
            },
        ] {
            let b = postcard::to_allocvec(&bad).unwrap();
            assert!(Handles::decode(&b, &metas)
                .unwrap_err()
                .contains("malformed"));
        }
        assert!(Handles::decode(&[1, 2, 3], &metas).is_err());
    }

    #[test]
    fn malformed_handles_are_errors() {
        let meta = Tensor::zeros(crate::DType::F32, &[4]).meta();
        let h = in_one_dram_region(
            0,
            8,
            vec![Piece {
                region: 0,
                offset: 0,
                len: 16,
            }],
        );
        let e = check_handles(&h, std::slice::from_ref(&meta)).unwrap_err();
        assert!(e.contains("reaches past its registration"), "{e}");
        let mut bad = h.clone();
        bad.tensors[0].region = 3;
        assert!(check_handles(&bad, std::slice::from_ref(&meta))
            .unwrap_err()
            .contains("names registration 3"));
        assert!(check_handles(&h, &[])
            .unwrap_err()
            .contains("describe 1 tensors"));
    }

    /// Two agents of this process read each other's memory through UCX:
    /// the binding, registration, metadata exchange, the READ, the poller
    /// and the notification, for real (needs NIXL: scripts/install-nixl.sh).
    #[test]
    fn an_agent_reads_another_agents_memory() {
        let a = Arc::new(Agent::new("rdt-unit-a").expect("NIXL is installed"));
        let b = Arc::new(Agent::new("rdt-unit-b").unwrap());
        let len = 1 << 20;
        let src = HostRegion::new(&a, len).unwrap();
        let dst = HostRegion::new(&b, len).unwrap();
        for i in 0..len {
            // SAFETY: within the region, which nothing else uses.
            unsafe { *src.ptr().add(i) = (i % 251) as u8 };
        }
        assert_eq!(b.load_remote(a.connection_md()).unwrap(), "rdt-unit-a");
        assert_eq!(b.load_remote(&src.slab.reg.md).unwrap(), "rdt-unit-a");
        let at = |r: &HostRegion| desc(r.ptr() as usize, len);
        let (req, _) = b
            .post_read(
                &[at(&dst)],
                &[at(&src)],
                "rdt-unit-a",
                &42u64.to_le_bytes(),
                false,
            )
            .unwrap();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let done = Poller::get(&b).watch(req, Box::new(()));
        let r = rt
            .block_on(async { tokio::time::timeout(Duration::from_secs(20), done).await })
            .expect("the read ends within 20 s")
            .unwrap();
        r.unwrap();
        // SAFETY: the read is released; nothing writes the region.
        let got = unsafe { std::slice::from_raw_parts(dst.ptr(), len) };
        assert!(got.iter().enumerate().all(|(i, &v)| v == (i % 251) as u8));
        expect_notification(&a, "rdt-unit-b", &42u64.to_le_bytes());
        // A notification on its own (rdt's reads send theirs so): the
        // count of reads since the last one, to each producer.
        send_notices(&b, HashMap::from([("rdt-unit-a".to_string(), 7)]));
        expect_notification(&a, "rdt-unit-b", &7u64.to_le_bytes());
    }

    #[test]
    fn a_notice_reports_its_count_of_reads() {
        assert_eq!(reads_in(&7u64.to_le_bytes()), 7);
        assert_eq!(reads_in(&1u64.to_le_bytes()), 1);
        // Not rdt's: one read.
        assert_eq!(reads_in(b"hello"), 1);
        assert_eq!(reads_in(&[]), 1);
    }

    /// Waits (20 s at most) for `agent`'s next notifications: exactly one,
    /// `msg` from `from`.
    fn expect_notification(agent: &Agent, from: &str, msg: &[u8]) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let n = agent.take_notifications().unwrap();
            if !n.is_empty() {
                assert_eq!(n, vec![(from.to_string(), msg.to_vec())]);
                return;
            }
            assert!(
                Instant::now() < deadline,
                "no notification from {from} within 20 s"
            );
            std::thread::yield_now();
        }
    }
}
