//! Destinations of small reads made ahead (NX-11).

use super::*;

/// The largest object whose next destination is made ahead (NX-11).
pub(super) const READY_MAX_BYTES: usize = 64 << 10;

/// Where a READ lands: the tensors it fills, its (local, remote)
/// descriptor lists, what keeps that memory registered and alive, and the
/// GPUs whose memory was not clean (NX-9).
pub(super) struct Destination {
    pub(super) out: TensorList,
    pub(super) lists: Vec<(Vec<Desc>, Vec<Desc>)>,
    pub(super) keep: Vec<Kept>,
    pub(super) not_clean: Vec<usize>,
}

impl Destination {
    /// The host bytes it holds (its region, where the plan reads into
    /// host memory).
    pub(super) fn host_bytes(&self) -> u64 {
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
pub(super) struct ReadyDest {
    pub(super) plan: Arc<ReadPlan>,
    /// `None` once a receive took it.
    pub(super) dest: Option<Destination>,
}

impl ReadyDest {
    pub(super) fn new(plan: Arc<ReadPlan>, dest: Destination) -> ReadyDest {
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
    pub(super) fn take(mut self) -> Destination {
        self.unready();
        self.dest.take().expect("a destination is taken once")
    }

    /// Its host bytes back in use (before it is taken, or dropped).
    pub(super) fn unready(&self) {
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
    pub(super) fn made_ahead(&self) -> bool {
        (self.host_len > 0 || !self.lanes.is_empty())
            && self.nbytes <= READY_MAX_BYTES
            && self.at.len() < PLAN_MIN_TENSORS
    }
}
