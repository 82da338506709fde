//! What this worker counted, behind `ActorRuntime::metrics`.

use super::*;

impl WorkerShared {
    /// What this worker has counted (see [`ActorRuntime::metrics`]).
    pub(super) fn metrics(&self) -> crate::metrics::WorkerMetrics {
        use std::sync::atomic::Ordering::Relaxed;
        crate::metrics::WorkerMetrics {
            local_objects: self.store.map.lock().len(),
            received: (self.received.lock().iter())
                .map(|(t, n)| (t.name().to_string(), *n))
                .collect(),
            straight_deliveries: self.straight.received(),
            received_in_place: self.in_place.load(Relaxed),
            receives_started_after_frames: self.started_after_frames.load(Relaxed),
            calls_handed_to_listener: self.handoff.queued(),
            receives_acknowledged_by_calls: self.acks_by_calls.load(Relaxed),
        }
    }
}
