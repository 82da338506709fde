//! The [`TensorTransport`] contract of [`NixlTransport`].

use super::*;

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
    fn receive_start(&self, exported: &Exported) -> crate::transport::ReceiveStart {
        let small_from_known = || {
            exported.metas.len() < PLAN_MIN_TENSORS
                && HandlesWire::agent_of(&exported.handles)
                    .is_some_and(|a| self.remotes.lock().contains_key(a))
        };
        if small_from_known() {
            crate::transport::ReceiveStart::AfterFramesInHand
        } else {
            crate::transport::ReceiveStart::Task
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
