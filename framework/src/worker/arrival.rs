//! WK-8: waiting for an object to arrive, as its first reader; waiting for a tensor to be freed.

use super::*;

/// Inside an actor: waits until the local object store holds no reference
/// to `tensor`'s storage, i.e. until the owner table freed every object
/// that contained it (no driver ref and no pending call needs it). Returns
/// at once for tensors the store never held (values sent through the object
/// store are not kept by their producer).
pub async fn wait_tensor_freed(tensor: &Tensor) -> Result<()> {
    let Some(w) = WORKER.get() else {
        return Err(Error::Protocol(
            "wait_tensor_freed works inside an actor method; the driver holds no tensors in a store".into(),
        ));
    };
    w.store
        .wait_until(|s| (!s.holds_storage(tensor)).then_some(()))
        .await;
    Ok(())
}

/// [`wait_tensor_freed`] with a deadline.
pub async fn wait_tensor_freed_timeout(tensor: &Tensor, deadline: Duration) -> Result<()> {
    tokio::time::timeout(deadline, wait_tensor_freed(tensor))
        .await
        .map_err(|_| Error::Timeout {
            what: "the tensor to be freed".into(),
            after_ms: deadline.as_millis() as u64,
        })?
}

impl WorkerShared {
    /// WK-8: waits for object `id` in the store, as its first reader if
    /// it is not there yet: a large receive of it hands its list over while
    /// the bytes still move, and its tensors are made here, on the
    /// caller's thread (an actor's, which uses them next).
    pub(super) async fn arrival(&self, id: u64) -> Slot {
        if let Some(slot) = self.store.get(id) {
            return slot;
        }
        let (tx, offered) = oneshot::channel();
        let token = self
            .next_req
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let registered = match self.readers.lock().entry(id) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert((token, tx));
                true
            }
        };
        let _unregister = registered.then_some(Unregister {
            readers: &self.readers,
            object: id,
            token,
        });
        let stored = self.store.wait_for(id);
        tokio::pin!(stored);
        if registered {
            match futures::future::select(stored.as_mut(), offered).await {
                futures::future::Either::Left((slot, _)) => return slot,
                futures::future::Either::Right((Ok(list), _)) => {
                    list.premake();
                    rdt_transport::trace::timeline("views made on the reader's thread", id);
                }
                // The receive ended without offering it.
                futures::future::Either::Right((Err(_), _)) => {}
            }
        }
        stored.await
    }

    /// WK-8: the reader registered for `object`, which takes a receive's
    /// list once.
    pub(super) fn first_reader(self: &Arc<Self>, object: u64) -> rdt_transport::FirstReader {
        let shared = self.clone();
        rdt_transport::FirstReader::new(move |list| {
            let reader = shared.readers.lock().remove(&object);
            reader.is_some_and(|(_, tx)| tx.send(list.clone()).is_ok())
        })
    }
}

/// Does this worker's store hold an object with `tensor`'s storage (a
/// value not yet freed)? `false` outside an actor.
pub(crate) fn tensor_held(tensor: &Tensor) -> bool {
    WORKER.get().is_some_and(|w| w.store.holds_storage(tensor))
}
