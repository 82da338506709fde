//! The collective groups this worker is in: prepared, created, queued into.

use super::*;

/// A collective group as an actor sees it (see [`group_memberships`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupMembership {
    /// The group.
    pub group: crate::ids::GroupId,
    /// Its backend.
    pub backend: Transport,
    /// This actor's rank in it.
    pub rank: u32,
    /// How many members it has.
    pub size: usize,
}

/// The collective groups this worker's actor is a member of (see
/// [`ActorRuntime::group_memberships`]).
pub(super) fn group_memberships(w: &WorkerShared) -> Vec<GroupMembership> {
    let mut v: Vec<GroupMembership> = w
        .groups
        .lock()
        .values()
        .map(|g| GroupMembership {
            group: crate::ids::GroupId(g.spec.id),
            backend: g.backend,
            rank: g.spec.my_rank,
            size: g.spec.ranks.len(),
        })
        .collect();
    v.sort_by_key(|m| m.group.0);
    v
}

/// Runs `job` in `group`'s queue (XF-3), or returns why it cannot run
/// there (not a member: destroyed or never created; broken).
pub(super) fn queue_in_group(
    shared: &WorkerShared,
    group: u64,
    job: Job,
) -> std::result::Result<(), (String, Job)> {
    let groups = shared.groups.lock();
    let Some(g) = groups.get(&group) else {
        return Err((
            format!("this worker is not in collective group {group} (destroyed, or never created)"),
            job,
        ));
    };
    if let Some(why) = &g.broken {
        return Err((format!("collective group {group} was aborted: {why}"), job));
    }
    g.queue.send(job).map_err(|e| {
        (
            format!("the queue of collective group {group} is closed"),
            e.0,
        )
    })
}

/// Rank 0 of a new group (XF-2): the backend makes what every member joins
/// with (NCCL: the unique id), and the driver hears back either way.
pub(super) fn on_prepare_group(
    shared: &Arc<WorkerShared>,
    backend: String,
    spec: rdt_transport::GroupSpec,
) {
    let tx = shared.tx.clone();
    tokio::spawn(async move {
        let made = async {
            let t: Transport = backend.parse()?;
            Ok::<_, Error>(t.instance()?.group_bootstrap(&spec).await?)
        };
        let result = made.await;
        let _ = tx.send(&ToDriver::GroupPrepared {
            group: spec.id,
            result,
        });
    });
}

/// Joins a collective group (XF-2): the backend sets up its part, the
/// group's queue starts, and the driver hears back either way.
pub(super) fn on_create_group(
    shared: &Arc<WorkerShared>,
    backend: String,
    spec: rdt_transport::GroupSpec,
) {
    let shared = shared.clone();
    tokio::spawn(async move {
        let group = spec.id;
        let joined = async {
            let t: Transport = backend.parse()?;
            let inst = t.instance()?;
            inst.create_group(&spec).await?;
            let queue = start_group_queue(group)?;
            shared.groups.lock().insert(
                group,
                WorkerGroup {
                    backend: t,
                    spec: spec.clone(),
                    queue,
                    broken: None,
                },
            );
            Ok::<(), Error>(())
        };
        let result = joined.await;
        let _ = shared.tx.send(&ToDriver::GroupReady { group, result });
    });
}
