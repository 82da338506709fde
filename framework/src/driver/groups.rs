//! Collective groups: created and destroyed step by step, checked against calls, broken when a member dies.

use super::*;
use tracing::Instrument;

impl Runtime {
    /// Creates a collective group of `backend` (a collective transport:
    /// `tcp`, `nccl`) over `actors`. Refs on that transport may then be
    /// passed between members. An actor may belong to groups of different
    /// backends; a group can be destroyed and created again.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before the members answer leaves the group being
    /// made: the members that join keep it until
    /// [`destroy_collective_group`](Self::destroy_collective_group) or
    /// shutdown; nothing waits on it.
    pub async fn create_collective_group(
        &self,
        actors: &[ActorId],
        backend: Transport,
    ) -> Result<GroupId> {
        let span = tracing::info_span!(
            parent: None,
            "group",
            op = "create",
            backend = backend.name(),
            members = actors.len(),
            group = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        let done = self
            .create_group(actors, backend)
            .instrument(span.clone())
            .await;
        match &done {
            Ok(g) => {
                span.record("group", g.0);
                span.record("outcome", "ok");
            }
            Err(_) => {
                span.record("outcome", "failed");
            }
        }
        done
    }

    /// [`create_collective_group`](Self::create_collective_group), within its span.
    async fn create_group(&self, actors: &[ActorId], backend: Transport) -> Result<GroupId> {
        if !backend.is_collective() {
            return Err(Error::Group(format!(
                "{backend} is not a collective transport (collective: tcp, nccl); one-sided transports need no group"
            )));
        }
        if !backend.is_implemented() {
            return Err(Error::TransportUnavailable {
                name: backend.name().into(),
                reason: "this build of rdt does not implement it yet".into(),
            });
        }
        if actors.is_empty() {
            return Err(Error::Group(
                "a collective group needs at least one actor".into(),
            ));
        }
        let deadline = self.inner.config.spawn_timeout;
        let (id, peers, ranks, prepared) = {
            let mut st = self.inner.lock();
            let st = &mut *st;
            let mut members = std::collections::HashSet::new();
            for a in actors {
                let info = st
                    .actors
                    .get(&a.0)
                    .ok_or_else(|| Error::Group(format!("no actor with id {}", a.0)))?;
                if let Some(d) = &info.dead {
                    return Err(Error::ActorDied {
                        actor: info.name.clone(),
                        detail: d.clone(),
                    });
                }
                if !members.insert(a.0) {
                    return Err(Error::Group(format!("actor {} is listed twice", info.name)));
                }
            }
            if backend == Transport::Nccl {
                refuse_shared_gpus(&st.actors, actors)?;
            }
            let id = self.inner.next_id();
            let ranks: Vec<u64> = actors.iter().map(|a| a.0).collect();
            let peers: Vec<rdt_transport::Peer> = ranks
                .iter()
                .map(|a| st.actors[a].peer(*a, backend.name()))
                .collect();
            // XF-2, first step: rank 0 makes what every member joins with
            // (NCCL: the unique id; its process runs the bootstrap root).
            let order = ToWorker::PrepareGroup {
                backend: backend.name().to_string(),
                spec: rdt_transport::GroupSpec {
                    id,
                    ranks: peers.clone(),
                    my_rank: 0,
                    bootstrap: Vec::new(),
                },
            };
            st.table.outbox.send_small(ranks[0], &order);
            let (tx, rx) = oneshot::channel();
            st.group_ops.insert(
                id,
                GroupOp {
                    waiting: [ranks[0]].into_iter().collect(),
                    tx,
                },
            );
            st.groups.insert(
                id,
                Group {
                    backend,
                    members,
                    ranks: ranks.clone(),
                    ready: false,
                    broken: None,
                },
            );
            (id, peers, ranks, rx)
        };
        let joined = match self
            .group_step(id, backend, prepared, deadline, "prepare")
            .await
        {
            // Second step: every member joins (NCCL: with rank 0's unique
            // id) and acknowledges; the group is usable once all did.
            Ok(bootstrap) => {
                let rx = {
                    let mut st = self.inner.lock();
                    let st = &mut *st;
                    for (rank, a) in ranks.iter().enumerate() {
                        let order = ToWorker::CreateGroup {
                            backend: backend.name().to_string(),
                            spec: rdt_transport::GroupSpec {
                                id,
                                ranks: peers.clone(),
                                my_rank: rank as u32,
                                bootstrap: bootstrap.clone(),
                            },
                        };
                        st.table.outbox.send_small(*a, &order);
                    }
                    let (tx, rx) = oneshot::channel();
                    st.group_ops.insert(
                        id,
                        GroupOp {
                            waiting: ranks.iter().copied().collect(),
                            tx,
                        },
                    );
                    // A member that died since is not waited for.
                    let dead: Vec<(u64, Error)> = ranks
                        .iter()
                        .filter_map(|a| {
                            let i = st.actors.get(a)?;
                            i.dead.as_ref().map(|d| {
                                (
                                    *a,
                                    Error::ActorDied {
                                        actor: i.name.clone(),
                                        detail: d.clone(),
                                    },
                                )
                            })
                        })
                        .collect();
                    for (a, e) in dead {
                        GroupOp::answered(&mut st.group_ops, id, a, Err(e));
                    }
                    rx
                };
                self.group_step(id, backend, rx, deadline, "join").await
            }
            Err(e) => Err(e),
        };
        let mut st = self.inner.lock();
        match joined {
            Ok(_) => {
                if let Some(g) = st.groups.get_mut(&id) {
                    if let Some(why) = &g.broken {
                        let e = Error::Group(format!(
                            "{backend} group {id} broke while it was created: {why}"
                        ));
                        st.groups.remove(&id);
                        return Err(e);
                    }
                    g.ready = true;
                }
                Ok(GroupId(id))
            }
            Err(e) => {
                st.group_ops.remove(&id);
                if let Some(g) = st.groups.remove(&id) {
                    for a in g.ranks {
                        st.table
                            .outbox
                            .send_small(a, &ToWorker::DestroyGroup { group: id });
                    }
                }
                Err(e)
            }
        }
    }

    /// Waits for one step of a group's creation (every answer, or the
    /// first error), within `deadline`.
    pub(super) async fn group_step(
        &self,
        id: u64,
        backend: Transport,
        rx: oneshot::Receiver<Result<Vec<u8>>>,
        deadline: Duration,
        step: &str,
    ) -> Result<Vec<u8>> {
        match tokio::time::timeout(deadline, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Error::Shutdown),
            Err(_) => Err(Error::Group(format!(
                "the members of {backend} group {id} did not all {step} within {deadline:?} (RuntimeBuilder::spawn_timeout)"
            ))),
        }
    }

    /// Destroys a collective group: no transfer starts in it from now on
    /// (a delivery still waiting for its object fails with `NotInGroup`),
    /// and every live member tears its part down and acknowledges. Objects
    /// already moved stay where they are; later passes between its actors
    /// need a new group.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future does not stop the teardown once ordered.
    pub async fn destroy_collective_group(&self, group: GroupId) -> Result<()> {
        let span = tracing::info_span!(
            parent: None,
            "group",
            op = "destroy",
            group = group.0,
            outcome = tracing::field::Empty,
        );
        let done = self.destroy_group(group).instrument(span.clone()).await;
        match &done {
            Ok(()) => {
                span.record("outcome", "ok");
            }
            Err(_) => {
                span.record("outcome", "failed");
            }
        }
        done
    }

    /// [`destroy_collective_group`](Self::destroy_collective_group), within its span.
    async fn destroy_group(&self, group: GroupId) -> Result<()> {
        let rx = {
            let mut st = self.inner.lock();
            let st = &mut *st;
            let Some(g) = st.groups.remove(&group.0) else {
                return Err(Error::Group(format!(
                    "no collective group {group} (already destroyed?)"
                )));
            };
            let live: std::collections::HashSet<u64> = g
                .ranks
                .iter()
                .copied()
                .filter(|a| st.actors.get(a).is_some_and(|i| i.dead.is_none()))
                .collect();
            // OW-15: sends held in the group go ahead of the leave order.
            st.table.send_held_in_group(group.0);
            for a in &live {
                st.table
                    .outbox
                    .send_small(*a, &ToWorker::DestroyGroup { group: group.0 });
            }
            let (tx, rx) = oneshot::channel();
            if live.is_empty() {
                let _ = tx.send(Ok(Vec::new()));
            } else {
                st.group_ops.insert(group.0, GroupOp { waiting: live, tx });
            }
            rx
        };
        let deadline = self.inner.config.spawn_timeout;
        match tokio::time::timeout(deadline, rx).await {
            Ok(Ok(r)) => r.map(|_| ()),
            Ok(Err(_)) => Err(Error::Shutdown),
            Err(_) => {
                self.inner.lock().group_ops.remove(&group.0);
                Err(Error::Group(format!(
                    "the members of group {group} did not all leave it within {deadline:?}"
                )))
            }
        }
    }
}

/// A ref on a collective transport may only go to an actor that shares a
/// live group of that backend with its producer.
pub(super) fn check_groups(st: &State, consumer: u64, args: &[u64]) -> Option<Error> {
    for &id in args {
        let e = st.table.objects.get(&id)?;
        let Some(producer) = e.producer else { continue };
        if matches!(e.state, ObjState::Failed(_)) {
            continue;
        }
        let lookup = GroupView {
            groups: &st.groups,
            actors: &st.actors,
        };
        if let Err(err) = lookup.group_for(e.transport.name(), id, producer, consumer) {
            return Some(err);
        }
    }
    None
}

/// A member's failure to take part in a group, naming the member.
pub(super) fn group_error(actors: &Actors, actor: u64, group: u64, e: Error) -> Error {
    Error::Group(format!(
        "{} could not take part in group {group}: {e}",
        actor_name(actors, actor)
    ))
}

/// A failed transfer on a collective transport tears down the group its
/// ends share (its communicator may be in any state now).
pub(super) fn break_groups(st: &mut State, t: &crate::owner::InFlight, reason: &str) {
    let Some(p) = t.producer else { return };
    break_groups_where(
        st,
        |g| g.backend == t.transport && g.members.contains(&p) && g.members.contains(&t.consumer),
        reason,
    );
}

/// Tears down every live group `which` selects: later passes in it fail
/// at once with `GroupBroken`, and every live member's backend stops what
/// is in flight in it (`AbortGroup`, XF-2/XF-6).
pub(super) fn break_groups_where(st: &mut State, which: impl Fn(&Group) -> bool, reason: &str) {
    for (id, g) in st.groups.iter_mut() {
        if g.broken.is_some() || !which(g) {
            continue;
        }
        tracing::warn!("tearing down collective group {id}: {reason}");
        g.broken = Some(reason.to_string());
        for a in &g.ranks {
            st.table.outbox.send_small(
                *a,
                &ToWorker::AbortGroup {
                    group: *id,
                    reason: reason.to_string(),
                },
            );
        }
    }
}
