//! Messages from workers, handled under the lock.

use super::*;

impl Inner {
    pub(super) fn on_message(&self, actor: u64, msg: ToDriver) {
        let mut st = self.lock();
        let st = &mut *st;
        // CL-4: a dead actor holds nothing. Its death ended everything its
        // frames could end (calls, transfers, borrows, gets), and a frame
        // takes its counts only when applied: the frames it wrote before
        // it died (still in its socket, or read and waiting for this lock)
        // are dropped, and leave nothing behind.
        if st.actors.get(&actor).is_none_or(|a| a.dead.is_some()) {
            tracing::trace!(actor, "a frame of a dead actor dropped");
            return;
        }
        match msg {
            ToDriver::Spawned(r) => {
                let r = r.map(|spawned| {
                    if let Some(a) = st.actors.get_mut(&actor) {
                        a.endpoints = spawned.endpoints.into_iter().collect();
                        a.cuda_devices = Some(spawned.cuda_devices);
                    }
                });
                if let Some(tx) = st.spawning.remove(&actor) {
                    let _ = tx.send(r);
                }
            }
            ToDriver::Pong => {}
            ToDriver::CallDone {
                call,
                result,
                delivered,
                released,
                resolved,
            } => {
                let Some(pc) = st.calls.remove(&call) else {
                    tracing::warn!("actor {actor} finished unknown call {call}; ignored");
                    return;
                };
                end_call(st, pc, result, resolved, &delivered, &released);
                rdt_transport::trace::timeline("driver call ended", call);
                self.sync_transfers(st);
            }
            ToDriver::Received {
                object,
                xfer,
                result,
            } => {
                let groups = GroupView {
                    groups: &st.groups,
                    actors: &st.actors,
                };
                let done = st.table.received(xfer, actor, &result, &st.actors, &groups);
                match (done, result) {
                    (Some(t), Err(e)) => {
                        tracing::warn!(xfer, object, "receive failed: {e}");
                        break_groups(st, &t, &e.to_string());
                    }
                    (Some(_), Ok(())) => tracing::trace!(xfer, object, "transfer done"),
                    (None, _) => {}
                }
                self.sync_transfers(st);
            }
            ToDriver::Fetched { req, result } => {
                if let Some((_, tx)) = st.fetches.remove(&req) {
                    let _ = tx.send(result);
                }
            }
            ToDriver::TransferFailed {
                object,
                xfer,
                peer,
                transport,
                message,
            } => {
                let reason = format!(
                    "{} send of object {object} from {} to {} failed: {message}",
                    transport.map_or("the", |t| t.name()),
                    actor_name(&st.actors, actor),
                    actor_name(&st.actors, peer)
                );
                tracing::warn!(xfer, object, "{reason}");
                let err = Error::Transport(rdt_transport::TransportError {
                    transport: transport.map_or_else(String::new, |t| t.to_string()),
                    peer: Some(actor_name(&st.actors, actor)),
                    message: format!("the producer's send failed: {message}"),
                });
                // XF-6: the consumer's receive stops now, not at its
                // deadline.
                if let Some(t) = st.table.send_failed(xfer, err) {
                    break_groups(st, &t, &reason);
                }
            }
            ToDriver::GroupReady { group, result } | ToDriver::GroupDestroyed { group, result } => {
                let result = result.map(|()| Vec::new());
                let result = result.map_err(|e| group_error(&st.actors, actor, group, e));
                GroupOp::answered(&mut st.group_ops, group, actor, result);
            }
            ToDriver::GroupPrepared { group, result } => {
                let result = result.map_err(|e| group_error(&st.actors, actor, group, e));
                GroupOp::answered(&mut st.group_ops, group, actor, result);
            }
            ToDriver::Hello { .. } => tracing::warn!("actor {actor} said hello twice; ignored"),
            ToDriver::Submit(mut msg) => {
                if !self.new_actor_object(st, actor, msg.result) {
                    return;
                }
                let method_name = std::mem::take(&mut msg.method_name);
                self.submit_locked(st, msg, &method_name);
            }
            ToDriver::Put { object, value } => {
                if !self.new_actor_object(st, actor, object) {
                    return;
                }
                let through_driver = value.transport == Transport::ObjectStore;
                let producer = (!through_driver).then_some(actor);
                st.table.insert_put(object, producer, value);
            }
            ToDriver::Borrow(ids) => {
                for id in ids {
                    if !st.table.objects.contains_key(&id) {
                        // CL-3 makes this impossible; say so if it happens.
                        tracing::error!(
                            "actor {actor} borrowed object {id}, which the owner table no longer has"
                        );
                        continue;
                    }
                    st.table.inc(id);
                    *st.borrows.entry(actor).or_default().entry(id).or_default() += 1;
                }
            }
            ToDriver::Release(ids) => {
                for id in ids {
                    let held = st.borrows.get_mut(&actor).and_then(|b| {
                        let n = b.get_mut(&id)?;
                        *n -= 1;
                        if *n == 0 {
                            b.remove(&id);
                        }
                        Some(())
                    });
                    match held {
                        Some(()) => st.table.dec(id),
                        None => tracing::warn!(
                            "actor {actor} released object {id}, which it did not borrow; ignored"
                        ),
                    }
                }
                self.sync_transfers(st);
            }
            ToDriver::Get { object } => {
                *st.gets.entry((actor, object)).or_default() += 1;
                let groups = GroupView {
                    groups: &st.groups,
                    actors: &st.actors,
                };
                st.table.need(object, actor, None, &st.actors, &groups);
                self.sync_transfers(st);
            }
            ToDriver::GetDone { object } => {
                let Some(n) = st.gets.get_mut(&(actor, object)) else {
                    tracing::warn!("actor {actor} ended a get of object {object} it never began");
                    return;
                };
                *n -= 1;
                if *n == 0 {
                    st.gets.remove(&(actor, object));
                }
                st.table.unneed(&[object], actor);
                self.sync_transfers(st);
            }
            ToDriver::Watch { req, object } => match settled(st, object) {
                Some(result) => st
                    .table
                    .outbox
                    .send_small(actor, &ToWorker::Settled { req, result }),
                None => {
                    let (tx, rx) = oneshot::channel();
                    if let Some(e) = st.table.objects.get_mut(&object) {
                        e.getters.push(crate::owner::Getter::Signal(tx));
                    }
                    let me = self.me.clone();
                    self.tokio.spawn(async move {
                        let _ = rx.await;
                        let Some(inner) = me.upgrade() else { return };
                        let mut st = inner.lock();
                        let result = settled(&st, object).unwrap_or(Err(Error::Shutdown));
                        st.table
                            .outbox
                            .send_small(actor, &ToWorker::Settled { req, result });
                    });
                }
            },
            ToDriver::Probe { req, object } => {
                let state = settled(st, object);
                st.table
                    .outbox
                    .send_small(actor, &ToWorker::Probed { req, state });
            }
            ToDriver::Kill { actor: target } => {
                // Off this lock: killing takes it.
                let me = self.me.clone();
                self.tokio.spawn(async move {
                    if let Some(inner) = me.upgrade() {
                        inner.kill_actor(target);
                    }
                });
            }
        }
    }

    /// An actor made object `id` (a call's result or a put value): it must
    /// be from an actor's id space and new; the actor borrows it (CL-1).
    pub(super) fn new_actor_object(&self, st: &mut State, actor: u64, id: u64) -> bool {
        if id >> 63 == 0 || st.table.objects.contains_key(&id) {
            tracing::error!(
                "actor {actor} made object {id}, which is not a new id of an actor's id space; ignored"
            );
            return false;
        }
        *st.borrows.entry(actor).or_default().entry(id).or_default() += 1;
        true
    }
}

/// One message of worker `worker`, handled (with its timeline points).
pub(super) fn handle_from_worker(inner: &Inner, worker: u64, msg: ToDriver) {
    let (got, handled, id) = match &msg {
        ToDriver::CallDone { call, .. } => {
            ("driver got call done", "driver handled call done", *call)
        }
        ToDriver::Received { xfer, .. } => {
            ("driver got received", "driver handled received", *xfer)
        }
        _ => ("driver got message", "driver handled message", 0),
    };
    rdt_transport::trace::timeline(got, id);
    inner.on_message(worker, msg);
    rdt_transport::trace::timeline(handled, id);
}
