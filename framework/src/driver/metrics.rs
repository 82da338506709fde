//! The driver's counters, read by tests and `Runtime::metrics`.

use super::*;

impl Runtime {
    /// What the driver sent on to its live actors of blobs it was still
    /// receiving (large values on the object-store path, forwarded as they
    /// arrive instead of after the whole value is in): `(bytes, of which
    /// sent before their blob was whole)`. For benchmarks and tests.
    pub fn forwarded_bytes(&self) -> (u64, u64) {
        let st = self.inner.lock();
        st.conns
            .values()
            .map(|c| c.forwarded())
            .fold((0, 0), |(a, b), (x, y)| (a + x, b + y))
    }

    /// How many calls of the driver's had the orders of the transfers they
    /// need written before them: two-sided transfers (a delivery to the
    /// callee and a send order to the producer) start while the call
    /// itself is still being encoded. For tests and benchmarks.
    pub fn calls_with_orders_first(&self) -> u64 {
        self.inner.orders_first.load(Ordering::Relaxed)
    }

    /// How many of the driver's `get`s were handed their value as the
    /// call's reply stored it, and went on without waiting for the rest of
    /// the reply's handling (OW-14). For tests and benchmarks.
    pub fn gets_handed_values(&self) -> u64 {
        self.inner.lock().table.handed_values
    }

    /// How many sends of large two-sided transfers (128 MiB or more, or
    /// `RDT_LARGE_TRANSFER_BYTES`) waited in the driver for the large
    /// transfers to the same consumer ahead of them to end, so that
    /// they land one at a time, in order. For tests and benchmarks.
    pub fn sends_held(&self) -> u64 {
        self.inner.lock().table.sends_held
    }

    /// How many argument copies callees dropped themselves when their
    /// call ended (OW-12: no `Free` from the driver), and how many of
    /// those a call submitted meanwhile needed, so that they were
    /// delivered again. For tests and benchmarks.
    pub fn copies_released_by_callees(&self) -> (u64, u64) {
        let st = self.inner.lock();
        (st.table.released_by_callees, st.table.delivered_again)
    }

    /// What the driver has counted since it started: transfers, their
    /// bytes and outcomes per transport, and calls (see [`crate::metrics`],
    /// which also names what goes to a `metrics` recorder).
    pub fn metrics(&self) -> crate::metrics::DriverMetrics {
        self.inner.lock().table.counts.snapshot()
    }

    /// Number of objects the owner table holds (for tests and leak checks).
    pub fn live_objects(&self) -> usize {
        self.inner.lock().table.len()
    }

    /// The counts the owner table holds on object `id` (`None` once it
    /// is freed). A ref and all its clones hold one (for tests).
    #[doc(hidden)]
    pub fn ref_count(&self, id: u64) -> Option<usize> {
        self.inner.lock().table.objects.get(&id).map(|e| e.refs)
    }
}
