//! The driver's state: `Runtime`, `Inner`, the one lock over `State` (invariant 2), pending calls, groups as the owner table sees them, and the driver's side of the client API.

use super::*;

/// The driver's handle on an rdt runtime: spawns actors, gets and puts
/// values. Cheap to clone.
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// This runtime, weakly (DR: background tasks never keep it alive).
    pub(super) me: Weak<Inner>,
    /// Where the driver's background tasks run (settle watches, kills),
    /// since messages and calls may come from any thread.
    pub(super) tokio: tokio::runtime::Handle,
    pub(super) config: Config,
    pub(super) secret: [u8; 32],
    pub(super) _dir: tempfile::TempDir,
    pub(super) sock: PathBuf,
    pub(crate) state: Mutex<State>,
    pub(super) next: AtomicU64,
    /// The next actor id space (`protocol::actor_id_space`).
    pub(super) id_spaces: AtomicU64,
    pub(super) control_addr: Option<std::net::SocketAddr>,
    pub(super) volunteer_joined: tokio::sync::Notify,
    /// Woken whenever transfers end (see `Runtime::transfers_settled`).
    pub(super) settled: tokio::sync::Notify,
    /// Wakes the deadline keeper (DL-1).
    pub(super) deadline_wake: Arc<tokio::sync::Notify>,
    /// Calls whose transfer orders were written before them (for tests
    /// and benchmarks).
    pub(super) orders_first: AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The deadline keeper holds the runtime weakly: woken, it sees it
        // gone and ends.
        self.deadline_wake.notify_one();
    }
}

/// The driver's state, locked (see [`Inner::lock`]).
pub(crate) struct StateGuard<'a> {
    pub(super) guard: Option<parking_lot::MutexGuard<'a, State>>,
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.guard.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.guard.as_mut().expect("held until drop")
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        let wake = |getters: Vec<crate::owner::Woken>| {
            for g in getters {
                g.wake();
            }
        };
        let woken = (self.guard.as_mut())
            .map(|st| st.table.take_woken())
            .unwrap_or_default();
        // OW-1: released after the unlock (a transport's release may take
        // its time, or ask the runtime).
        let freed_held = (self.guard.as_mut())
            .map(|st| st.table.take_freed_held())
            .unwrap_or_default();
        // The outbox goes onto the connections first, still under the
        // lock, in the order it was decided (OW-7), queued, not written.
        // Then unlock, then wake the getters whose values settled (a
        // getter's first step is to take the lock: woken under it, it
        // waited there, parked, while this thread finished the message;
        // 4 µs of a 4 KiB pass in the 2×H200 timelines), then write what
        // was queued (invariant 2: a getter's own frames queue behind
        // them) and wake the readers of the actors called.
        let mut deferred = protocol::Deferred::default();
        if let Some(st) = self.guard.as_deref_mut() {
            deferred = std::mem::take(&mut st.after_unlock);
            write_outbox(&mut st.table.outbox, &st.conns, &mut deferred);
        }
        rdt_transport::trace::timeline("driver unlocking", woken.len() as u64);
        drop(self.guard.take());
        rdt_transport::trace::timeline("driver unlocked", 0);
        wake(woken);
        drop(freed_held);
        rdt_transport::trace::timeline("driver getters woken", 0);
        deferred.flush();
    }
}

impl Inner {
    /// Locks the driver's state. Messages sent while it is held are queued
    /// on their connections in the order they were decided and written
    /// once it is released (invariant 2): no thread waits on this lock for a
    /// socket write.
    pub(crate) fn lock(&self) -> StateGuard<'_> {
        StateGuard {
            guard: Some(self.state.lock()),
        }
    }
}

pub(super) struct PendingCall {
    pub(super) actor: u64,
    pub(super) result: u64,
    pub(super) args: Vec<u64>,
    /// Objects whose refs are in the arguments passed by value: held until
    /// the call ends (CL-2).
    pub(super) nested: Vec<u64>,
    /// Its `call` span in the driver, from its submission to its end
    /// (`outcome`).
    pub(super) span: tracing::Span,
}

/// Calls in flight, by call id, and how many each actor has (its reader
/// keeps its thread awake while it has some: `read_worker`).
#[derive(Default)]
pub(super) struct PendingCalls {
    pub(super) by_id: HashMap<u64, PendingCall>,
    pub(super) per_actor: HashMap<u64, usize>,
}

impl PendingCalls {
    pub(super) fn insert(&mut self, call: u64, pc: PendingCall) {
        *self.per_actor.entry(pc.actor).or_default() += 1;
        self.by_id.insert(call, pc);
    }

    pub(super) fn remove(&mut self, call: &u64) -> Option<PendingCall> {
        let pc = self.by_id.remove(call)?;
        if let Some(n) = self.per_actor.get_mut(&pc.actor) {
            *n -= 1;
            if *n == 0 {
                self.per_actor.remove(&pc.actor);
            }
        }
        Some(pc)
    }

    /// The calls `actor` is running or has queued.
    pub(super) fn of(&self, actor: u64) -> Vec<u64> {
        if !self.any_for(actor) {
            return Vec::new();
        }
        self.by_id
            .iter()
            .filter(|(_, c)| c.actor == actor)
            .map(|(k, _)| *k)
            .collect()
    }

    pub(super) fn any_for(&self, actor: u64) -> bool {
        self.per_actor.contains_key(&actor)
    }
}

pub(super) struct Joined {
    pub(super) conn: protocol::Sender,
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) table: OwnerTable,
    pub(super) actors: Actors,
    /// The control connection of each actor that joined and has not died:
    /// where the table's outbox is written (`conn.rs`).
    pub(super) conns: HashMap<u64, protocol::Sender>,
    pub(super) processes: HashMap<u64, Process>,
    pub(super) calls: PendingCalls,
    /// Wakes a worker's reader into its hot read when a call is submitted
    /// to it (`read_worker`).
    pub(super) readers: HashMap<u64, Arc<tokio::sync::Notify>>,
    /// What waits for the lock's release: the readers to wake after the
    /// outbox is written (`send_call`).
    pub(super) after_unlock: protocol::Deferred,
    pub(super) joining: HashMap<u64, oneshot::Sender<Joined>>,
    pub(super) spawning: HashMap<u64, oneshot::Sender<Result<()>>>,
    pub(super) fetches: HashMap<u64, (u64, oneshot::Sender<Result<WireValue>>)>,
    pub(super) groups: HashMap<u64, Group>,
    pub(super) volunteers: std::collections::VecDeque<Volunteer>,
    /// Deadlines of transfers in flight (XF-6).
    pub(super) deadlines: crate::deadlines::Deadlines,
    /// Group creates and destroys waiting for acknowledgements.
    pub(super) group_ops: HashMap<u64, GroupOp>,
    /// `shutdown` asked every worker to stop: their exits are expected,
    /// not deaths to warn about.
    pub(super) shutting_down: bool,
    /// Counts each actor holds (CL-1), by actor, then object: given back
    /// when it dies (CL-4).
    pub(super) borrows: HashMap<u64, HashMap<u64, usize>>,
    /// Gets in flight inside actors, by (actor, object): each needs the
    /// object as a call would.
    pub(super) gets: HashMap<(u64, u64), usize>,
}

/// A collective group: actors that may move objects of its backend between
/// each other.
pub(super) struct Group {
    pub(super) backend: Transport,
    pub(super) members: std::collections::HashSet<u64>,
    /// The members by rank.
    pub(super) ranks: Vec<u64>,
    /// Every member acknowledged joining.
    pub(super) ready: bool,
    pub(super) broken: Option<String>,
}

/// A group prepare, create or destroy waiting for its members'
/// acknowledgements (a prepare's answer carries rank 0's bootstrap bytes).
pub(super) struct GroupOp {
    pub(super) waiting: std::collections::HashSet<u64>,
    pub(super) tx: oneshot::Sender<Result<Vec<u8>>>,
}

impl GroupOp {
    /// `actor` answered: the op ends at the first error or the last answer.
    pub(super) fn answered(
        ops: &mut HashMap<u64, GroupOp>,
        group: u64,
        actor: u64,
        r: Result<Vec<u8>>,
    ) {
        let Some(op) = ops.get_mut(&group) else {
            return;
        };
        op.waiting.remove(&actor);
        if r.is_err() || op.waiting.is_empty() {
            let op = ops.remove(&group).expect("looked up above");
            let _ = op.tx.send(r);
        }
    }
}

/// The driver's side of the one client API: counts are owner-table
/// counts (CL-1); calls are staged here; kills go through the pidfd.
impl Client for Inner {
    fn clone_ref(&self, id: u64) {
        self.lock().table.inc(id)
    }
    fn release_ref(&self, id: u64) {
        Inner::release_ref(self, id)
    }
    fn adopt_from_wire(&self, id: u64) {
        self.lock().table.inc(id)
    }
    fn submit(
        &self,
        actor: u64,
        method: u32,
        method_name: &'static str,
        args: Vec<ArgOut>,
        transport: Transport,
    ) -> u64 {
        Inner::submit(self, actor, method, method_name, args, transport)
    }
    fn kill(&self, actor: u64) {
        self.kill_actor(actor)
    }
    fn pid(&self, actor: u64) -> Option<u32> {
        self.actor_pid(actor)
    }
    fn exit_notice(&self, actor: u64, name: &str) -> Result<watch::Receiver<Option<String>>> {
        Inner::exit_notice(self, actor).ok_or_else(|| {
            Error::Protocol(format!(
                "{name} runs in a worker that joined by hand: its exit cannot be observed here"
            ))
        })
    }
}

/// Whether object `id` is finished: `Some(Ok)` ready, `Some(Err)` failed
/// or gone, `None` pending.
pub(super) fn settled(st: &State, id: u64) -> Option<Result<()>> {
    match st.table.objects.get(&id).map(|e| &e.state) {
        None => Some(Err(Error::Freed { object: id })),
        Some(ObjState::Ready(_)) => Some(Ok(())),
        Some(ObjState::Failed(e)) => Some(Err(e.clone())),
        Some(ObjState::Pending) => None,
    }
}

/// The driver's groups as the owner table sees them (OW-8).
pub(super) struct GroupView<'a> {
    pub(super) groups: &'a HashMap<u64, Group>,
    pub(super) actors: &'a Actors,
}

impl GroupLookup for GroupView<'_> {
    fn group_for(
        &self,
        transport: &str,
        object: u64,
        producer: u64,
        consumer: u64,
    ) -> Result<Option<(u64, u32, u32)>> {
        let Ok(t) = transport.parse::<Transport>() else {
            return Ok(None);
        };
        if !t.is_collective() || producer == consumer {
            return Ok(None);
        }
        let shared: Vec<(&u64, &Group)> = self
            .groups
            .iter()
            .filter(|(_, g)| {
                g.backend == t
                    && g.ready
                    && g.members.contains(&producer)
                    && g.members.contains(&consumer)
            })
            .collect();
        if let Some((id, g)) = shared.iter().find(|(_, g)| g.broken.is_none()) {
            let rank = |a: u64| g.ranks.iter().position(|r| *r == a).unwrap_or(0) as u32;
            return Ok(Some((**id, rank(producer), rank(consumer))));
        }
        Err(match shared.first() {
            Some((gid, g)) => Error::GroupBroken {
                group: **gid,
                transport: t.name().into(),
                reason: g.broken.clone().unwrap_or_default(),
            },
            None => Error::NotInGroup {
                object,
                transport: t.name().into(),
                backend: t.rust_expr(),
                producer: actor_name(self.actors, producer),
                consumer: actor_name(self.actors, consumer),
            },
        })
    }
}

/// A worker that joined by hand and waits for an actor to host.
pub(crate) struct Volunteer {
    pub(super) conn: protocol::Sender,
    pub(super) rx: protocol::Receiver<protocol::ReadHalf>,
    pub(super) host: String,
}

impl Inner {
    pub(crate) fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn release_ref(&self, id: u64) {
        let mut st = self.lock();
        let st = &mut *st;
        st.table.dec(id);
    }
}
