//! The worker's object store: values by id, their slots, and the drops and targets kept beside them.

use super::*;

/// A value in the worker's store.
#[derive(Clone)]
pub(super) struct StoredValue {
    pub(super) data: Bytes,
    /// Shared: a call that takes the value, or a `get` of it in the actor,
    /// clones the list's handle, not each of its (thousands of) tensors.
    /// A lazy list (a planned `nixl` receive) makes each tensor when a
    /// decode wants it.
    pub(super) tensors: Arc<TensorList>,
    pub(super) transport: Transport,
    /// Produced here (released through the transport on free).
    pub(super) produced: bool,
}

#[derive(Clone)]
pub(super) enum Slot {
    Ready(StoredValue),
    Failed(Error),
}

/// Objects this worker produced (direct transports) or received.
#[derive(Default)]
pub(super) struct Store {
    pub(super) map: Mutex<HashMap<u64, Slot>>,
    pub(super) changed: Notify,
}

impl Store {
    pub(super) fn insert(&self, id: u64, slot: Slot) {
        let mut m = self.map.lock();
        // Never replace received data by a late error (owner invariant 4).
        if matches!(slot, Slot::Failed(_)) && matches!(m.get(&id), Some(Slot::Ready(_))) {
            return;
        }
        m.insert(id, slot);
        drop(m);
        self.changed.notify_waiters();
    }

    pub(super) fn remove(&self, id: u64) -> Option<Slot> {
        let s = self.map.lock().remove(&id);
        self.changed.notify_waiters();
        s
    }

    /// A received value whose bytes never all arrived (a stream-ordered
    /// receive failed after it returned) becomes that error.
    pub(super) fn fail_received(&self, id: u64, e: Error) {
        let mut m = self.map.lock();
        if let Some(
            slot @ Slot::Ready(StoredValue {
                produced: false, ..
            }),
        ) = m.get_mut(&id)
        {
            *slot = Slot::Failed(e);
        }
        drop(m);
        self.changed.notify_waiters();
    }

    pub(super) fn get(&self, id: u64) -> Option<Slot> {
        self.map.lock().get(&id).cloned()
    }

    /// Takes `id` out if it is a value received here (WK-13).
    pub(super) fn take_received(&self, id: u64) -> Option<StoredValue> {
        let mut m = self.map.lock();
        if !matches!(m.get(&id), Some(Slot::Ready(v)) if !v.produced) {
            return None;
        }
        let Some(Slot::Ready(v)) = m.remove(&id) else {
            unreachable!("looked up above")
        };
        drop(m);
        self.changed.notify_waiters();
        Some(v)
    }

    /// Waits until `ready` returns a value, checking again after every
    /// change of the store (registered before the check: no lost wake-up).
    pub(super) async fn wait_until<T>(&self, ready: impl Fn(&Store) -> Option<T>) -> T {
        loop {
            // Polled hot (an actor's call waiting for its argument): look,
            // and register nothing, so the thread that stores the value
            // need not wake this one (`rdt_transport::rt::hot::polled_hot`).
            if hot::polled_hot() {
                if let Some(v) = ready(self) {
                    return v;
                }
                hot::pending_once().await;
                continue;
            }
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(v) = ready(self) {
                return v;
            }
            notified.await;
        }
    }

    pub(super) async fn wait_for(&self, id: u64) -> Slot {
        self.wait_until(|s| s.get(id)).await
    }

    pub(super) fn holds_storage(&self, t: &Tensor) -> bool {
        self.map.lock().values().any(|s| match s {
            Slot::Ready(v) => v.tensors.iter().any(|x| x.shares_storage(t)),
            Slot::Failed(_) => false,
        })
    }
}

/// Removes a reader's registration when its wait ends, unless the receive
/// took it (or another reader registered since: its token differs).
pub(super) struct Unregister<'a> {
    pub(super) readers: &'a Mutex<HashMap<u64, (u64, oneshot::Sender<TensorList>)>>,
    pub(super) object: u64,
    pub(super) token: u64,
}

impl Drop for Unregister<'_> {
    fn drop(&mut self) {
        let mut readers = self.readers.lock();
        if readers
            .get(&self.object)
            .is_some_and(|(t, _)| *t == self.token)
        {
            readers.remove(&self.object);
        }
    }
}

/// A freed value with at least this many tensors is dropped on the
/// blocking pool, not in the control loop (a hand-off costs more than
/// dropping a few tensors).
pub(super) const DROP_ASIDE_MIN: usize = 64;

/// ... or at least this many bytes.
pub(super) const DROP_ASIDE_BYTES: usize = 1 << 20;

/// A registered target list found to fit a layout over a transport
/// (WK-7). A weight update registers the same list (a
/// [`Targets`](crate::Targets) the actor keeps) at every step, with a head
/// found among the recent ones (the same layout id: byte-identical
/// metadata). Nothing the check read can have changed: the list is shared
/// and never written, a tensor's dtype, shape and storage are fixed, and
/// the metadata is the same bytes. So the answer is the last one, and
/// 10 000 targets are not compared again. The weak reference keeps the
/// list's address from being taken by another list while this is kept.
#[derive(Debug)]
pub(super) struct FittedTargets {
    pub(super) targets: std::sync::Weak<[Tensor]>,
    pub(super) layout: u64,
    pub(super) transport: Transport,
}

impl FittedTargets {
    /// `None` for a head with no layout id (not decoded through
    /// `WireExported::get`).
    pub(super) fn of(
        ts: &Arc<[Tensor]>,
        layout: Option<u64>,
        transport: Transport,
    ) -> Option<Self> {
        Some(FittedTargets {
            targets: Arc::downgrade(ts),
            layout: layout?,
            transport,
        })
    }
}

impl PartialEq for FittedTargets {
    fn eq(&self, other: &Self) -> bool {
        self.targets.ptr_eq(&other.targets)
            && self.layout == other.layout
            && self.transport == other.transport
    }
}

/// Freed values being dropped on the blocking pool (WK-6).
#[derive(Default)]
pub(crate) struct AsideDrops {
    pub(super) pending: std::sync::atomic::AtomicUsize,
    pub(super) settled: Notify,
}

impl AsideDrops {
    /// Drops `v` on the blocking pool, counted until it is gone.
    pub(super) fn drop_aside<T: Send + 'static>(self: &Arc<Self>, v: T) {
        use std::sync::atomic::Ordering;
        self.pending.fetch_add(1, Ordering::AcqRel);
        let me = self.clone();
        drop(tokio::task::spawn_blocking(move || {
            drop(v);
            if me.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
                me.settled.notify_waiters();
            }
        }));
    }

    /// Resolves once every value counted so far is dropped (at once when
    /// none is pending: one atomic load). A drop always ends, so this
    /// needs no deadline of its own.
    pub(crate) async fn settled(&self) {
        use std::sync::atomic::Ordering;
        loop {
            let notified = self.settled.notified();
            tokio::pin!(notified);
            // Registered before the check, so a notification between the
            // check and the await is not lost.
            notified.as_mut().enable();
            if self.pending.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// The actor's refs, counted locally (CL-1).
#[derive(Default)]
pub(crate) struct LocalRefs {
    pub(super) counts: Mutex<HashMap<u64, usize>>,
}
