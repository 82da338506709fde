//! Deaths and shutdown: a worker's death fails what it had (invariant 3); kills go through the pidfd.

use super::*;

impl Runtime {
    /// Asks every worker to exit, waits up to the grace period, then kills
    /// the rest.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves the shutdown under way.
    pub async fn shutdown(&self) {
        let exits: Vec<watch::Receiver<Option<String>>> = {
            let mut guard = self.inner.lock();
            let st = &mut *guard;
            st.shutting_down = true;
            for (id, a) in &st.actors {
                if a.dead.is_none() {
                    st.table.outbox.send_small(*id, &ToWorker::Shutdown);
                }
            }
            st.processes.values().map(|p| p.exit.clone()).collect()
        };
        let wait_all = async {
            for mut e in exits {
                let _ = e.wait_for(|s| s.is_some()).await;
            }
        };
        let _ = tokio::time::timeout(self.inner.config.shutdown_grace, wait_all).await;
        let procs: Vec<Process> = self
            .inner
            .state
            .lock()
            .processes
            .drain()
            .map(|(_, p)| p)
            .collect();
        drop(procs); // ChildGuard kills what is left
    }
}

impl Inner {
    pub(crate) fn actor_pid(&self, actor: u64) -> Option<u32> {
        self.lock().processes.get(&actor).map(|p| p.pid)
    }

    /// The exit notice of the actor's worker process, if this runtime
    /// started it.
    pub(crate) fn exit_notice(&self, actor: u64) -> Option<watch::Receiver<Option<String>>> {
        self.state
            .lock()
            .processes
            .get(&actor)
            .map(|p| p.exit.clone())
    }

    /// Kills an actor's process through its pidfd (DR-2) and marks it
    /// dead at once (DR-3): a call or pass submitted after `kill` returns
    /// sees the death, whatever the process is still doing while it dies.
    pub(crate) fn kill_actor(&self, actor: u64) {
        let pidfd = self
            .state
            .lock()
            .processes
            .get(&actor)
            .map(|p| p.pidfd.clone());
        match pidfd {
            // Dead already: nothing to signal.
            Some(None) => {}
            Some(Some(fd)) => {
                if pidfd_kill(&fd).is_ok() {
                    self.on_death(
                        actor,
                        "its process was killed by signal 9 (SIGKILL, by RawHandle::kill)".into(),
                    );
                }
            }
            // A worker that joined by hand: ask it to exit.
            None => self
                .lock()
                .table
                .outbox
                .send_small(actor, &ToWorker::Shutdown),
        }
    }

    pub(super) fn on_death(&self, actor: u64, detail: String) {
        let span = tracing::info_span!(parent: None, "death", actor, cause = %detail);
        let _in = span.enter();
        if !self.mark_dead(actor, detail) {
            return;
        }
        // The driver's own transports drop what they keep for it (a NIXL
        // agent forgets its metadata): off the state lock, since that may
        // block (UCX disconnects). Actor ids are never reused.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("rdt::peer_gone");
        for t in Transport::registered() {
            if let Some(inst) = t.existing_instance() {
                inst.peer_gone(actor);
            }
        }
    }

    /// The death of `actor`, under the state lock: everything it held or
    /// waited for ends. False if it was dead or unknown already.
    pub(super) fn mark_dead(&self, actor: u64, detail: String) -> bool {
        let mut st = self.lock();
        let st = &mut *st;
        let Some(info) = st.actors.get_mut(&actor) else {
            return false;
        };
        if info.dead.is_some() {
            return false;
        }
        info.dead = Some(detail.clone());
        st.conns.remove(&actor);
        // A dead worker keeps its name and cause of death (for errors), not
        // its pidfd: the guard's kill is a no-op or finishes a dying
        // process, and the descriptor is closed.
        if let Some(p) = st.processes.get_mut(&actor) {
            p.pidfd = None;
            p._guard = None;
        }
        let err = Error::ActorDied {
            actor: info.name.clone(),
            detail,
        };
        if st.shutting_down {
            // Stopped by `shutdown`, as asked: not news.
            tracing::debug!("{err}");
        } else {
            tracing::warn!("{err}");
        }
        if let Some(tx) = st.spawning.remove(&actor) {
            let _ = tx.send(Err(err.clone()));
        }
        let failed = st.calls.of(actor);
        for c in failed {
            let pc = st.calls.remove(&c).expect("listed above");
            end_call(st, pc, Err(err.clone()), false, &[], &[]);
        }
        // CL-4: what it borrowed and was getting, it holds no more.
        let gets: Vec<(u64, usize)> = st
            .gets
            .iter()
            .filter(|((a, _), _)| *a == actor)
            .map(|((_, o), n)| (*o, *n))
            .collect();
        for (object, n) in gets {
            st.gets.remove(&(actor, object));
            st.table.unneed(&vec![object; n], actor);
        }
        if let Some(borrowed) = st.borrows.remove(&actor) {
            for (object, n) in borrowed {
                st.table.unhold(&vec![object; n]);
            }
        }
        let fetches: Vec<u64> = st
            .fetches
            .iter()
            .filter(|(_, (a, _))| *a == actor)
            .map(|(k, _)| *k)
            .collect();
        for f in fetches {
            if let Some((_, tx)) = st.fetches.remove(&f) {
                let _ = tx.send(Err(err.clone()));
            }
        }
        st.table.actor_died(actor, &err, &st.actors);
        self.sync_transfers(st);
        // Group creates and destroys waiting for it end now.
        let ops: Vec<u64> = st
            .group_ops
            .iter()
            .filter(|(_, op)| op.waiting.contains(&actor))
            .map(|(g, _)| *g)
            .collect();
        for g in ops {
            GroupOp::answered(&mut st.group_ops, g, actor, Err(err.clone()));
        }
        // Transports in the other workers drop what they keep for it.
        for (id, a) in st.actors.iter() {
            if *id != actor && a.dead.is_none() {
                st.table
                    .outbox
                    .send_small(*id, &ToWorker::PeerGone { actor });
            }
        }
        // A collective group cannot go on without a member (as in Ray):
        // tear down every group it was in, so later passes fail at once.
        let reason = format!("its member {} died", err_actor(&err));
        break_groups_where(st, |g| g.members.contains(&actor), &reason);
        true
    }
}
