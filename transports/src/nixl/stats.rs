//! Counters of this process's NIXL activity ([`NixlStats`]) and the read spin.

use super::*;

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
pub(super) struct Counters {
    pub(super) registrations: AtomicU64,
    pub(super) deregistrations: AtomicU64,
    pub(super) reads_posted: AtomicU64,
    pub(super) descriptors_posted: AtomicU64,
    pub(super) reads_served: AtomicU64,
    pub(super) remote_loads: AtomicU64,
    pub(super) remote_forgets: AtomicU64,
    pub(super) host_slabs: AtomicU64,
    pub(super) host_bytes_in_use: AtomicU64,
    pub(super) host_bytes_ready: AtomicU64,
    pub(super) post_lock_nanos: AtomicU64,
    pub(super) post_create_nanos: AtomicU64,
    pub(super) post_submit_nanos: AtomicU64,
    pub(super) read_nanos: AtomicU64,
    pub(super) reads_done_inline: AtomicU64,
    pub(super) reads_reposted: AtomicU64,
    pub(super) read_asks: AtomicU64,
    pub(super) read_asks_after_yield: AtomicU64,
    pub(super) read_plans_reused: AtomicU64,
    pub(super) read_plans_made: AtomicU64,
    pub(super) target_plans_reused: AtomicU64,
    pub(super) target_lists_reused: AtomicU64,
    pub(super) lists_made_by_reader: AtomicU64,
    pub(super) lists_premade: AtomicU64,
    pub(super) dests_made_ahead: AtomicU64,
    pub(super) dests_taken_ready: AtomicU64,
    pub(super) agent_make_nanos: AtomicU64,
    pub(super) agent_wait_nanos: AtomicU64,
    pub(super) remote_load_nanos: AtomicU64,
}

pub(super) static COUNTERS: std::sync::LazyLock<Counters> =
    std::sync::LazyLock::new(Counters::default);

pub(super) fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// [`set_read_spin`]'s default.
pub const DEFAULT_READ_SPIN: std::time::Duration = std::time::Duration::from_micros(30);

pub(super) static READ_SPIN: crate::rt::hot::MicrosSetting =
    crate::rt::hot::MicrosSetting::new("RDT_NIXL_READ_SPIN_US");

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

pub(super) fn read_spin() -> std::time::Duration {
    READ_SPIN.get(|| DEFAULT_READ_SPIN)
}
