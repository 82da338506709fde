//! Transfer deadlines (XF-6): armed when a transfer starts, expired by one task.

use super::*;

/// The one task that watches every transfer deadline (XF-6; the
/// `deadlines` module says why not a timer per transfer). It sleeps until
/// the earliest deadline, or until woken for an earlier one (DL-1), and
/// ends with the runtime.
pub(super) async fn deadline_keeper(rt: Weak<Inner>, wake: Arc<tokio::sync::Notify>) {
    loop {
        let next = match rt.upgrade() {
            Some(inner) => inner.lock().deadlines.next(),
            None => return,
        };
        // A wake sent since `next` was read is kept as a permit.
        match next {
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at) => {}
                    _ = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
        match rt.upgrade() {
            Some(inner) => inner.expire_due(),
            None => return,
        }
    }
}

impl Runtime {
    /// Number of direct transfers delivered to a consumer and not yet
    /// acknowledged by it (or aborted), and of deliveries ordered straight
    /// from a producer whose call has not finished yet
    /// ([`RuntimeBuilder::peer_delivery`]).
    pub fn transfers_in_flight(&self) -> usize {
        self.inner.lock().table.transfers_unsettled()
    }

    /// Waits until no direct transfer is in flight: every receive was
    /// acknowledged or aborted, every producer asked to deliver a value
    /// straight has answered, and the frees they held back went out.
    /// Each transfer has a deadline (`RuntimeBuilder::transfer_timeout`),
    /// and an order ends with the producer's call, so this ends once the
    /// calls involved do.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future loses nothing.
    pub async fn transfers_settled(&self) {
        loop {
            let notified = self.inner.settled.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.transfers_in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }
}

impl Inner {
    /// Follows the owner table's transfers (XF-6), after every change to
    /// it: arms a deadline for each transfer that started (when one passes,
    /// both ends are aborted and the calls involved fail with a timeout),
    /// and wakes `transfers_settled` when any ended. An ended transfer's
    /// deadline needs no cancelling (DL-2).
    pub(super) fn sync_transfers(&self, st: &mut State) {
        let (started, ended) = st.table.take_transfer_changes();
        // A timeout too long to add to now (`Duration::MAX`) arms nothing:
        // it is never reached. The clock is read only when a transfer
        // started (this runs after every message).
        let at = (!started.is_empty())
            .then(|| tokio::time::Instant::now().checked_add(self.config.transfer_timeout))
            .flatten();
        if let Some(at) = at {
            let mut wake = false;
            for xfer in started {
                wake |= st.deadlines.arm(xfer, at);
            }
            let table = &st.table;
            st.deadlines
                .prune(table.transfers_in_flight(), |x| table.transfer(x).is_some());
            if wake {
                self.deadline_wake.notify_one();
            }
        }
        if !ended.is_empty() {
            self.settled.notify_waiters();
        }
    }

    /// Expires the transfers whose deadlines have passed (the keeper's
    /// work; DL-2: ended ones are skipped by `transfer_expired`).
    pub(super) fn expire_due(&self) {
        let due = self.lock().deadlines.due(tokio::time::Instant::now());
        for xfer in due {
            self.transfer_expired(xfer);
        }
    }

    pub(super) fn transfer_expired(&self, xfer: u64) {
        let mut st = self.lock();
        let st = &mut *st;
        let Some(t) = st.table.transfer(xfer).cloned() else {
            return;
        };
        let err = Error::Timeout {
            what: format!(
                "the {} transfer of object {} from {} to {} (the transfer deadline, RuntimeBuilder::transfer_timeout; both ends were aborted)",
                t.transport,
                t.object,
                t.producer
                    .map(|p| actor_name(&st.actors, p))
                    .unwrap_or_else(|| "the driver".into()),
                actor_name(&st.actors, t.consumer)
            ),
            after_ms: self.config.transfer_timeout.as_millis() as u64,
        };
        tracing::warn!(xfer, object = t.object, "{err}; aborting both ends");
        st.table.abort(xfer, err.clone(), &st.actors);
        break_groups(st, &t, &err.to_string());
        self.sync_transfers(st);
    }
}
