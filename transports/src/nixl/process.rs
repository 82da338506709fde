//! This process's agent: made, drained of notifications, closed at exit; the
//! process's UCX set-up and [`stats()`].

use super::*;

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

/// UCX's setting for its memory hooks ...
pub(super) const UCX_MEM_EVENTS: &str = "UCX_MEM_EVENTS";
/// ... and what rdt sets it to where the process did not.
pub(super) const UCX_MEM_EVENTS_DEFAULT: &str = "no";

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
    match ucx_default(crate::env::ucx_mem_events().as_deref()) {
        Some(v) => {
            std::env::set_var(UCX_MEM_EVENTS, v);
            true
        }
        None => false,
    }
}

/// The value rdt gives `UCX_MEM_EVENTS` where it is `current`: none where
/// the process set it (even to nothing).
pub(super) fn ucx_default(current: Option<&std::ffi::OsStr>) -> Option<&'static str> {
    current.is_none().then_some(UCX_MEM_EVENTS_DEFAULT)
}

/// Is NIXL usable in this process? The error says how to install it.
pub fn available() -> Result<(), NixlError> {
    api::api().map(|_| ())
}

/// The agent of this process, once made.
pub(super) static STARTED_AGENT: OnceLock<Result<Arc<Agent>, NixlError>> = OnceLock::new();

/// Makes this process's agent, timed (`agent_make_nanos`), and has it
/// closed when the process exits ([`close_agent_at_exit`]).
pub(super) fn make_agent(name: &str) -> Result<Arc<Agent>, NixlError> {
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
pub(super) const CLOSE_AT_EXIT_WAIT: std::time::Duration = std::time::Duration::from_millis(500);

/// Run by `exit` (registered once the agent exists), before the C
/// library's teardown of its libraries: the handlers registered last run
/// first, and the libraries' destructors, CUDA's among them, run after
/// every handler. It closes the agent then ([`Agent::close_for_exit`]),
/// on a thread of its own so that the exit waits for it at most twice
/// [`CLOSE_AT_EXIT_WAIT`] (the lock, then the teardown). A process
/// killed, or ended by `_exit`, skips it.
pub(super) extern "C" fn close_agent_at_exit() {
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
pub(super) fn drain_notifications(agent: &Agent) {
    if let Ok(n) = agent.take_notifications() {
        let reads: u64 = n.iter().map(|(_, msg)| reads_in(msg)).sum();
        bump(&COUNTERS.reads_served, reads);
    }
}

/// The number of reads a notice reports (see [`drain_notifications`]).
pub(super) fn reads_in(notice: &[u8]) -> u64 {
    <[u8; 8]>::try_from(notice)
        .map(u64::from_le_bytes)
        .unwrap_or(1)
}

/// Sends each producer the number of its reads that ended here since the
/// last notice (the poller's PL-3), then lets UCX send them now: a notice
/// left in UCX's queue would go out inside this process's next read.
pub(super) fn send_notices(agent: &Agent, reads: HashMap<String, u64>) {
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
