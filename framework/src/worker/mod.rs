//! Worker processes: boot, the actix host of the user's actor, the local
//! object store.
//!
//! # Invariants
//! 1. A worker is the driver's binary re-executed with the `RDT_WORKER_*`
//!    environment. It becomes a worker before `main` (a constructor emitted
//!    by `#[rdt::actor]`) or at `rdt::init()`, whichever comes first, and
//!    never returns to user code.
//! 2. Calls reach the actor as actix messages; when each runs (arguments
//!    first, then its turn, one at a time or concurrently) is `host`'s
//!    business (HO-1 … HO-5).
//! 3. The control loop never waits for a method: deliveries, sends, frees
//!    and fetches are served while a method runs.
//! 4. A method's panic is caught and becomes the call's error (HO-5).
//! 5. The worker exits when the driver's connection ends (and the kernel
//!    kills it if the driver dies first).
//! 6. **WK-6** A `Free` has taken effect before any call behind it starts: a freed
//!    value that the control loop drops on the blocking pool (large ones,
//!    so that the frames behind the `Free` are not held up) is counted
//!    in [`AsideDrops`], and a call waits for the count to reach zero
//!    before its method runs. So memory the driver freed is gone by the
//!    time a later call looks (`trim`, `wait_tensor_freed`, a slab count).
//! 7. **WK-7** A delivery's receive puts the tensors into the target tensors an
//!    actor's `get_into` registered for that object (in [`WorkerShared`]'s
//!    `targets`, before its `Get` is sent), when they fit the object's
//!    metadata; else anywhere (`get_into` then copies, or fails with
//!    `Error::Targets` and the received value stays stored). A target that
//!    does not fit never fails the receive: bad targets lose nothing.
//!    The same registered list with the same layout over the same
//!    transport as the last fit is not checked again ([`FittedTargets`]).
//! 8. **WK-8** The tensors of a large receive are made on the thread that
//!    waits to use them. A call's argument (or an actor's `get`) that
//!    waits for an object still being received registers as its first
//!    reader (`readers`); a receive that makes its tensors while its bytes
//!    move hands the list to that reader (`TransferCtx::first_reader`),
//!    which makes them on the actor's thread, where the method walks them
//!    next. With no reader registered, the receive makes them itself.
//! 9. **WK-9** A stream-ordered receive (its bytes still landing when it
//!    returns, WK-5) is acknowledged exactly once, by whoever takes it on
//!    first ([`Landed::take_ack`]): its task once the bytes landed, or a
//!    call that took the value before that. Such a call's `CallDone`
//!    settles the receive in the driver (XF-5: it got past its
//!    arguments), so no `Received` goes out, unless the call fails on the
//!    landing itself (`Dependency`): then it sends each `Received` it
//!    took on, with how that landing ended, before its `CallDone`.
//! 10. **WK-13** The consumer drops its own argument copies (OW-12). The
//!     control loop counts, per object, the calls it received that take it
//!     as a ref and have not ended (`arg_uses`), before it hands a call on.
//!     A call that ended past its arguments takes each of its `release`
//!     objects that no other counted call takes out of the store (a
//!     received copy only, never a value produced here) before it writes
//!     its `CallDone`, which names them; it drops them after the write
//!     (large ones on the blocking pool, counted for WK-6), off the path
//!     of the reply and of the next call's frames. A call counted late (its
//!     frame read after the drop) finds no copy and waits for the delivery
//!     the driver then sends again.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use actix::prelude::*;
use bytes::Bytes;
use futures::FutureExt;
use parking_lot::Mutex;
use rdt_transport::hot::{self, hot};
use rdt_transport::{object_store, Peer, ReceiveStart, Sidedness, Target, Tensor, TensorList};
use tokio::net::UnixStream;
use tokio::sync::{oneshot, Notify};
use tracing::Instrument;

use crate::actor::{Actor as RdtActor, ACTOR_TYPES};

mod boot;
mod client;
mod control;
mod handoff;
mod host;
mod peer;
mod receive;
mod start;
use crate::error::{Error, Result};
use crate::protocol::boot::env;
pub use crate::protocol::boot::WorkerStart;
use crate::protocol::inline_value;
use crate::protocol::{self, Delivery, ToDriver, ToWorker};
use crate::transport::Transport;
pub use boot::{boot_before_main, init};
pub use client::{runtime, try_runtime, ActorRuntime};
use host::Host;
pub use start::run_worker;
use {boot::*, control::*, receive::*};

/// Binaries whose `main` is `#[rdt::main]` register here: their workers
/// boot from `main`, after Rust's own start-up.
#[doc(hidden)]
#[linkme::distributed_slice]
pub static RDT_MAIN: [u8];

/// A value in the worker's store.
#[derive(Clone)]
struct StoredValue {
    data: Bytes,
    /// Shared: a call that takes the value, or a `get` of it in the actor,
    /// clones the list's handle, not each of its (thousands of) tensors.
    /// A lazy list (a planned `nixl` receive) makes each tensor when a
    /// decode wants it.
    tensors: Arc<TensorList>,
    transport: Transport,
    /// Produced here (released through the transport on free).
    produced: bool,
}

#[derive(Clone)]
enum Slot {
    Ready(StoredValue),
    Failed(Error),
}

/// Objects this worker produced (direct transports) or received.
#[derive(Default)]
struct Store {
    map: Mutex<HashMap<u64, Slot>>,
    changed: Notify,
}

impl Store {
    fn insert(&self, id: u64, slot: Slot) {
        let mut m = self.map.lock();
        // Never replace received data by a late error (owner invariant 4).
        if matches!(slot, Slot::Failed(_)) && matches!(m.get(&id), Some(Slot::Ready(_))) {
            return;
        }
        m.insert(id, slot);
        drop(m);
        self.changed.notify_waiters();
    }

    fn remove(&self, id: u64) -> Option<Slot> {
        let s = self.map.lock().remove(&id);
        self.changed.notify_waiters();
        s
    }

    /// A received value whose bytes never all arrived (a stream-ordered
    /// receive failed after it returned) becomes that error.
    fn fail_received(&self, id: u64, e: Error) {
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

    fn get(&self, id: u64) -> Option<Slot> {
        self.map.lock().get(&id).cloned()
    }

    /// Takes `id` out if it is a value received here (WK-13).
    fn take_received(&self, id: u64) -> Option<StoredValue> {
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
    async fn wait_until<T>(&self, ready: impl Fn(&Store) -> Option<T>) -> T {
        loop {
            // Polled hot (an actor's call waiting for its argument): look,
            // and register nothing, so the thread that stores the value
            // need not wake this one (`rdt_transport::hot::polled_hot`).
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

    async fn wait_for(&self, id: u64) -> Slot {
        self.wait_until(|s| s.get(id)).await
    }

    fn holds_storage(&self, t: &Tensor) -> bool {
        self.map.lock().values().any(|s| match s {
            Slot::Ready(v) => v.tensors.iter().any(|x| x.shares_storage(t)),
            Slot::Failed(_) => false,
        })
    }
}

impl WorkerShared {
    /// WK-8: waits for object `id` in the store, as its first reader if
    /// it is not there yet: a large receive of it hands its list over while
    /// the bytes still move, and its tensors are made here, on the
    /// caller's thread (an actor's, which uses them next).
    async fn arrival(&self, id: u64) -> Slot {
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
                    rdt_transport::cuda::timeline("views made on the reader's thread", id);
                }
                // The receive ended without offering it.
                futures::future::Either::Right((Err(_), _)) => {}
            }
        }
        stored.await
    }

    /// WK-8: the reader registered for `object`, which takes a receive's
    /// list once.
    fn first_reader(self: &Arc<Self>, object: u64) -> rdt_transport::FirstReader {
        let shared = self.clone();
        rdt_transport::FirstReader::new(move |list| {
            let reader = shared.readers.lock().remove(&object);
            reader.is_some_and(|(_, tx)| tx.send(list.clone()).is_ok())
        })
    }
}

/// Removes a reader's registration when its wait ends, unless the receive
/// took it (or another reader registered since: its token differs).
struct Unregister<'a> {
    readers: &'a Mutex<HashMap<u64, (u64, oneshot::Sender<TensorList>)>>,
    object: u64,
    token: u64,
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

/// What the worker's threads share: the store, the control link, the
/// transfers, and the actor's side of the runtime (`client`).
pub(crate) struct WorkerShared {
    name: Arc<str>,
    store: Store,
    tx: protocol::Sender,
    /// Transfers this worker takes part in, by id: the sender aborts the
    /// receive or send (WK-4).
    transfers: Mutex<HashMap<u64, oneshot::Sender<Error>>>,
    /// Objects being received, and whether they were freed meanwhile
    /// (a tombstone: the receive drops what it got instead of storing it).
    receiving: Mutex<HashMap<u64, bool>>,
    /// Objects received, per transport: tests and logs see which path a
    /// value took.
    received: Mutex<HashMap<Transport, u64>>,
    /// The collective groups this worker is in (XF-3).
    groups: Mutex<HashMap<u64, WorkerGroup>>,
    /// Received objects whose bytes are still landing (stream-ordered
    /// receives, WK-5): a call that used one reports its result only once
    /// they landed, and fails if they did not.
    landing: Mutex<HashMap<u64, Landed>>,
    /// Calls on their way to the actor's thread while it listens after a
    /// call (`handoff.rs`, HF-1..3).
    handoff: handoff::HandOff,
    /// Freed values still being dropped on the blocking pool (WK-6).
    drops: Arc<AsideDrops>,
    /// The refs this actor holds, counted locally (CL-1).
    local_refs: client::LocalRefs,
    /// The next id of this actor's own id space (AC-1).
    next_object: std::sync::atomic::AtomicU64,
    /// `wait` inside the actor: answers the driver owes, by request.
    watches: Mutex<HashMap<u64, oneshot::Sender<Result<()>>>>,
    /// Answers the driver owes to `Probe`s, by request (HO-6).
    probes: Mutex<HashMap<u64, oneshot::Sender<Option<Result<()>>>>>,
    next_req: std::sync::atomic::AtomicU64,
    /// This actor's id.
    actor: u64,
    /// Results of calls this actor made to itself that have not run yet
    /// (HO-6).
    self_calls: Mutex<std::collections::HashSet<u64>>,
    /// Target tensors `get_into` waits to fill, by object (WK-7).
    targets: Mutex<HashMap<u64, crate::refs::targets::Registered>>,
    /// The first thread waiting for each object still being received, by
    /// object: a token (its registration's) and where to hand the
    /// receive's list (WK-8).
    readers: Mutex<HashMap<u64, (u64, oneshot::Sender<TensorList>)>>,
    /// The targets last found to fit (WK-7).
    fitted: Mutex<Option<FittedTargets>>,
    /// `get_into` calls whose receive wrote into the targets itself.
    in_place: std::sync::atomic::AtomicU64,
    /// Receives the control loop started after the frames in hand
    /// (`ReceiveStart::AfterFramesInHand`).
    started_after_frames: std::sync::atomic::AtomicU64,
    /// Receives a call acknowledged with its `CallDone` (WK-9).
    acks_by_calls: std::sync::atomic::AtomicU64,
    /// How long a receive leaves its acknowledgement to a call that took
    /// it on, after the landing (`ack_wait`).
    ack_wait: Duration,
    /// The control loop's runtime: where a receive's bounded wait for its
    /// call's end runs (WK-12).
    control: tokio::runtime::Handle,
    /// Deliveries straight from producers to consumers (OW-9).
    peer: peer::PeerDelivery,
    /// Calls received and not ended, per object they take as a ref
    /// (WK-13).
    arg_uses: Mutex<HashMap<u64, u32>>,
}

/// A collective group this worker is in: its backend, its members, and its
/// ordered queue of two-sided transfers (XF-3), served by a thread of its
/// own (which can also host a backend's `!Send` handles).
struct WorkerGroup {
    backend: Transport,
    spec: rdt_transport::GroupSpec,
    queue: tokio::sync::mpsc::UnboundedSender<Job>,
    broken: Option<String>,
}

/// The landing of a stream-ordered receive (WK-5), awaited by the
/// receive's acknowledgement and by every call that took the value (the
/// first to ask drives it; each is woken directly when it resolves).
type Landing = futures::future::Shared<
    futures::future::BoxFuture<'static, std::result::Result<(), rdt_transport::TransportError>>,
>;

/// A stream-ordered receive whose bytes are still landing (WK-5): the
/// landing, the transfer, and who acknowledges it (WK-9).
#[derive(Clone)]
pub(crate) struct Landed {
    pub(crate) landing: Landing,
    pub(crate) xfer: u64,
    /// Who acknowledges it, and whether the call that did has ended.
    pub(crate) ack: Arc<AckState>,
}

/// The acknowledgement of a stream-ordered receive (WK-9).
#[derive(Default)]
pub(crate) struct AckState {
    /// Set by whoever took the acknowledgement on: the receive's task
    /// once the bytes landed, or a call that took the value first (its
    /// `CallDone` settles the receive in the driver, XF-5).
    taken: std::sync::atomic::AtomicBool,
    /// Set when the call that took it on has ended (its `CallDone`, or
    /// its own `Received` messages, follow at once).
    call_ended: std::sync::atomic::AtomicBool,
}

impl Landed {
    /// Takes the acknowledgement on; false if someone else has.
    pub(crate) fn take_ack(&self) -> bool {
        !self
            .ack
            .taken
            .swap(true, std::sync::atomic::Ordering::AcqRel)
    }

    /// The call that took the acknowledgement on has ended.
    pub(crate) fn end_call(&self) {
        self.ack
            .call_ended
            .store(true, std::sync::atomic::Ordering::Release);
    }

    fn call_ended(&self) -> bool {
        self.ack
            .call_ended
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

/// How long the receive's task leaves the acknowledgement to a call that
/// took it on, once the bytes landed, before it sends one itself (WK-9):
/// an eighth of the transfer deadline, at most 10 ms. A method that runs
/// on must not hold it until the driver's deadline for the transfer,
/// which would abort a finished transfer and break its group.
fn ack_wait(transfer_timeout: Duration) -> Duration {
    (transfer_timeout / 8).min(Duration::from_millis(10))
}

/// A transfer waiting its turn in a group's queue.
type Job = futures::future::BoxFuture<'static, ()>;

/// Starts the thread that runs a group's transfers one after the other, in
/// the order the control loop queued them (the driver's order). It ends
/// when the group is dropped and its queue has drained.
fn start_group_queue(group: u64) -> std::io::Result<tokio::sync::mpsc::UnboundedSender<Job>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
    // Timers only: no transport's group transfer does tokio I/O (`tcp`
    // moves bytes on threads of its own, NCCL on the GPU), and with an I/O
    // driver every yield of this thread's hot waits (its next transfer, a
    // landing) was an `epoll_wait` system call, so each round of those
    // waits saw what it waited for microseconds late.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    std::thread::Builder::new()
        .name(format!("rdt-group-{group}"))
        .spawn(move || {
            rt.block_on(async move {
                // Hot (rdt_transport::hot): the next transfer of a pass
                // often comes within the window, and waking this thread
                // after it slept costs more than the spin.
                while let Some(job) = next_job(&mut rx, hot::window()).await {
                    job.await;
                }
            })
        })?;
    Ok(tx)
}

/// How long the group's thread asks its queue in a tight loop between
/// yields while it has nothing else to run (GQ-2).
const PICKUP_SPIN: Duration = Duration::from_micros(20);

/// The group's next job (GQ-2), asked for with `try_recv` (tens of
/// nanoseconds) for up to the hot window, then awaited plainly. While
/// the group's runtime has no task of its own to run (the last job's
/// landing watch and acknowledgement have ended), the asks go on in a
/// tight loop for [`PICKUP_SPIN`] between yields; otherwise one ask per
/// yield, as the hot wait did. The hot wait's yield to the runtime after
/// every ask (its timer driver, its queues) left a job the control loop
/// queued 1.4-2.1 us before this thread took it, on both ends of every
/// small transfer (2xH100 and 2xH200 timelines). `window` is the hot
/// window (zero: a plain wait).
async fn next_job(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Job>,
    window: Duration,
) -> Option<Job> {
    use tokio::sync::mpsc::error::TryRecvError;
    if window.is_zero() {
        return hot(rx.recv()).await;
    }
    let metrics = tokio::runtime::Handle::current().metrics();
    let t0 = std::time::Instant::now();
    while t0.elapsed() < window {
        let spin_until =
            (metrics.num_alive_tasks() == 0).then(|| std::time::Instant::now() + PICKUP_SPIN);
        loop {
            match rx.try_recv() {
                Ok(job) => return Some(job),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) => {}
            }
            match spin_until {
                Some(until) if std::time::Instant::now() < until => std::hint::spin_loop(),
                _ => break,
            }
        }
        tokio::task::yield_now().await;
    }
    rx.recv().await
}

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
fn group_memberships(w: &WorkerShared) -> Vec<GroupMembership> {
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
fn queue_in_group(
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

impl WorkerShared {
    /// WK-4: registers transfer `xfer`, whose abort handle `AbortTransfer`
    /// fires; run its work with [`until_aborted`].
    fn register_transfer(&self, xfer: u64) -> oneshot::Receiver<Error> {
        let (abort_tx, abort_rx) = oneshot::channel();
        self.transfers.lock().insert(xfer, abort_tx);
        abort_rx
    }

    /// The targets a `get_into` registered for `object`, taken (not
    /// cloned: 10 000 parameters are 10 000 clones); the getter keeps its
    /// own and copies into them if the receive does not take them.
    fn take_targets(&self, object: u64) -> Option<crate::refs::targets::Registered> {
        self.targets.lock().remove(&object)
    }

    /// Where the receive of `object` puts its tensors (WK-7): the
    /// targets a `get_into` registered (`registered`), in the order the
    /// value (`data`) holds its tensors (TG-1), if they fit `metas` (of
    /// `layout`, as the head decoded here names it) and `transport` takes
    /// them.
    fn target_for(
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
    fn uses_begin(&self, refs: impl Iterator<Item = u64>) {
        let mut uses = self.arg_uses.lock();
        for r in refs {
            *uses.entry(r).or_default() += 1;
        }
    }

    /// WK-13: a call that took `refs` ended; the copies of `release` that
    /// no other call takes now come out of the store, to be dropped after
    /// the call's `CallDone` ([`drop_released`](Self::drop_released)).
    fn uses_end(&self, refs: &[u64], release: &[u64]) -> Vec<(u64, StoredValue)> {
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
    fn drop_freed(&self, v: StoredValue) {
        if v.tensors.len() >= DROP_ASIDE_MIN || v.tensors.nbytes() >= DROP_ASIDE_BYTES {
            self.drops.drop_aside(v);
        }
    }

    /// Drops the values a call released (WK-13), as a `Free` would.
    fn drop_released(&self, released: Vec<(u64, StoredValue)>) {
        for (_, v) in released {
            self.drop_freed(v);
        }
    }

    /// A value received over `t`, counted, as it goes into the store.
    fn received_value(&self, t: Transport, data: Bytes, tensors: TensorList) -> Slot {
        *self.received.lock().entry(t).or_default() += 1;
        Slot::Ready(StoredValue {
            data,
            tensors: Arc::new(tensors),
            transport: t,
            produced: false,
        })
    }
}

static WORKER: OnceLock<Arc<WorkerShared>> = OnceLock::new();

/// A freed value with at least this many tensors is dropped on the
/// blocking pool, not in the control loop (a hand-off costs more than
/// dropping a few tensors).
const DROP_ASIDE_MIN: usize = 64;

/// ... or at least this many bytes.
const DROP_ASIDE_BYTES: usize = 1 << 20;

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
struct FittedTargets {
    targets: std::sync::Weak<[Tensor]>,
    layout: u64,
    transport: Transport,
}

impl FittedTargets {
    /// `None` for a head with no layout id (not decoded through
    /// `WireExported::get`).
    fn of(ts: &Arc<[Tensor]>, layout: Option<u64>, transport: Transport) -> Option<Self> {
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
    pending: std::sync::atomic::AtomicUsize,
    settled: Notify,
}

impl AsideDrops {
    /// Drops `v` on the blocking pool, counted until it is gone.
    fn drop_aside<T: Send + 'static>(self: &Arc<Self>, v: T) {
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

/// This worker's shared state; `None` outside a worker.
pub(crate) fn shared() -> Option<Arc<WorkerShared>> {
    WORKER.get().cloned()
}

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

impl WorkerShared {
    /// What this worker has counted (see [`ActorRuntime::metrics`]).
    fn metrics(&self) -> crate::metrics::WorkerMetrics {
        use std::sync::atomic::Ordering::Relaxed;
        crate::metrics::WorkerMetrics {
            local_objects: self.store.map.lock().len(),
            received: (self.received.lock().iter())
                .map(|(t, n)| (t.name().to_string(), *n))
                .collect(),
            straight_deliveries: self.peer.received(),
            received_in_place: self.in_place.load(Relaxed),
            receives_started_after_frames: self.started_after_frames.load(Relaxed),
            calls_handed_to_listener: self.handoff.queued(),
            receives_acknowledged_by_calls: self.acks_by_calls.load(Relaxed),
        }
    }
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

/// Rank 0 of a new group (XF-2): the backend makes what every member joins
/// with (NCCL: the unique id), and the driver hears back either way.
fn on_prepare_group(shared: &Arc<WorkerShared>, backend: String, spec: rdt_transport::GroupSpec) {
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
fn on_create_group(shared: &Arc<WorkerShared>, backend: String, spec: rdt_transport::GroupSpec) {
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

/// A send order: the tensors are taken from the store here, in the
/// control loop's order (WK-2: a `Free` processed after this order cannot
/// pull them away; one processed before it makes the send fail at once,
/// and the driver aborts the receive).
fn on_send(
    shared: &Arc<WorkerShared>,
    object: u64,
    xfer: u64,
    to: Peer,
    group: Option<rdt_transport::GroupRef>,
) {
    let captured = match shared.store.get(object) {
        Some(Slot::Ready(v)) => v.transport.instance().map(|t| (t, v)),
        Some(Slot::Failed(e)) => Err(e),
        None => Err(Error::Freed { object }),
    };
    let (t, v) = match captured {
        Ok(c) => c,
        Err(e) => {
            let _ = shared.tx.send(&ToDriver::TransferFailed {
                object,
                xfer,
                peer: to.actor,
                transport: None,
                message: format!("the producer cannot send object {object}: {e}"),
            });
            return;
        }
    };
    let abort = shared.register_transfer(xfer);
    let worker = shared.clone();
    let span = tracing::debug_span!(
        "transfer",
        xfer,
        object,
        transport = v.transport.name(),
        peer = %to.name,
        side = "send",
    );
    let job = Box::pin(
        async move {
            let cx = rdt_transport::TransferCtx {
                group,
                ..rdt_transport::TransferCtx::new(xfer)
            };
            #[cfg(feature = "failpoints")]
            let injected = fail::eval("rdt::send", |m| m.unwrap_or_else(|| "injected".into()));
            #[cfg(not(feature = "failpoints"))]
            let injected: Option<String> = None;
            let shared = worker;
            let send = async {
                match injected {
                    Some(m) => Err(Error::Protocol(format!("failpoint rdt::send: {m}"))),
                    None => t.send(&to, &cx, &v.tensors).await.map_err(Error::from),
                }
            };
            if let Err(e) = until_aborted(&shared, xfer, abort, send).await {
                tracing::debug!("send failed: {e}");
                let _ = shared.tx.send(&ToDriver::TransferFailed {
                    object,
                    xfer,
                    peer: to.actor,
                    transport: Some(v.transport),
                    message: e.to_string(),
                });
            }
        }
        .instrument(span),
    );
    run_transfer(shared, group, job, xfer);
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

#[cfg(test)]
mod tests;
