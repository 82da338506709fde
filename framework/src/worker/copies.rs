//! WK-6/WK-13: the uses of stored values by calls, and their drops; transfers registered; targets.

use super::*;

impl WorkerShared {
    /// WK-4: registers transfer `xfer`, whose abort handle `AbortTransfer`
    /// fires; run its work with [`until_aborted`].
    pub(super) fn register_transfer(&self, xfer: u64) -> oneshot::Receiver<Error> {
        let (abort_tx, abort_rx) = oneshot::channel();
        self.transfers.lock().insert(xfer, abort_tx);
        abort_rx
    }

    /// The targets a `get_into` registered for `object`, taken (not
    /// cloned: 10 000 parameters are 10 000 clones); the getter keeps its
    /// own and copies into them if the receive does not take them.
    pub(super) fn take_targets(&self, object: u64) -> Option<crate::refs::targets::Registered> {
        self.targets.lock().remove(&object)
    }

    /// Where the receive of `object` puts its tensors (WK-7): the
    /// targets a `get_into` registered (`registered`), in the order the
    /// value (`data`) holds its tensors (TG-1), if they fit `metas` (of
    /// `layout`, as the head decoded here names it) and `transport` takes
    /// them.
    pub(super) fn target_for(
        &self,
        object: u64,
        registered: crate::refs::targets::Registered,
        data: &[u8],
        metas: &[rdt_transport::TensorMeta],
        layout: Option<u64>,
        transport: (Transport, &dyn rdt_transport::TensorTransport),
    ) -> Target {
        // TG-2: targets that do not match by key are received into
        // nothing of theirs; the getter reports why, with the key.
        let ts = match registered.resolve(object, data, metas.len(), &|i| metas.get(i).cloned()) {
            Ok(ts) => ts,
            Err(why) => {
                tracing::debug!(object, "received anywhere, the targets do not match: {why}");
                return Target::Any;
            }
        };
        let fitted = FittedTargets::of(&ts, layout, transport.0);
        if fitted.is_some() && *self.fitted.lock() == fitted {
            return Target::Tensors(ts);
        }
        let fit = crate::refs::wait::check_targets(object, metas, &ts)
            .map_err(|e| e.to_string())
            .and_then(|()| transport.1.receives_into(&ts));
        match fit {
            Ok(()) => {
                if fitted.is_some() {
                    *self.fitted.lock() = fitted;
                }
                Target::Tensors(ts)
            }
            Err(why) => {
                tracing::debug!(
                    object,
                    "received anywhere, then copied into the targets: {why}"
                );
                Target::Any
            }
        }
    }

    /// WK-13: a call that takes `refs` was received (counted before it is
    /// handed on).
    pub(super) fn uses_begin(&self, refs: impl Iterator<Item = u64>) {
        let mut uses = self.arg_uses.lock();
        for r in refs {
            *uses.entry(r).or_default() += 1;
        }
    }

    /// WK-13: a call that took `refs` ended; the copies of `release` that
    /// no other call takes now come out of the store, to be dropped after
    /// the call's `CallDone` ([`drop_released`](Self::drop_released)).
    pub(super) fn uses_end(&self, refs: &[u64], release: &[u64]) -> Vec<(u64, StoredValue)> {
        let mut uses = self.arg_uses.lock();
        for r in refs {
            if let std::collections::hash_map::Entry::Occupied(mut e) = uses.entry(*r) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
        let mut out = Vec::new();
        for &r in release {
            if uses.contains_key(&r) || out.iter().any(|(id, _)| *id == r) {
                continue;
            }
            if let Some(v) = self.store.take_received(r) {
                out.push((r, v));
            }
        }
        out
    }

    /// Drops a value taken out of the store (a `Free`, or a call's
    /// release, WK-13). Dropping thousands of tensors, or unmapping tens
    /// of MiB, takes 0.2-1 ms, and every frame behind a `Free` waited (on
    /// the 2xH200 host a weights pass's delivery waited ~1 ms for the
    /// previous pass's free): large values go to the blocking pool,
    /// counted for WK-6; small ones are dropped here.
    pub(super) fn drop_freed(&self, v: StoredValue) {
        if v.tensors.len() >= DROP_ASIDE_MIN || v.tensors.nbytes() >= DROP_ASIDE_BYTES {
            self.drops.drop_aside(v);
        }
    }

    /// Drops the values a call released (WK-13), as a `Free` would.
    pub(super) fn drop_released(&self, released: Vec<(u64, StoredValue)>) {
        for (_, v) in released {
            self.drop_freed(v);
        }
    }

    /// A value received over `t`, counted, as it goes into the store.
    pub(super) fn received_value(&self, t: Transport, data: Bytes, tensors: TensorList) -> Slot {
        *self.received.lock().entry(t).or_default() += 1;
        Slot::Ready(StoredValue {
            data,
            tensors: Arc::new(tensors),
            transport: t,
            produced: false,
        })
    }
}
