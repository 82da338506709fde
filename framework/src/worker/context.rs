//! Inside an actor: the runtime as a client of the driver (DESIGN §3,
//! "Actors are clients too"). A method calls other actors through their
//! handles, puts values, gets and waits for objects; the driver stays the
//! owner of every object, the actor borrows what it holds (`client`
//! CL-1 … CL-4).
//!
//! Why a type of its own ([`ActorRuntime`], from [`runtime()`]) and not
//! the driver's [`Runtime`](crate::Runtime): an actor is a client, not the
//! owner. It cannot spawn actors, make groups or shut the runtime down,
//! and with a type of its own the compiler says so, instead of a call
//! that fails at run time. What it can do has the same names and
//! signatures as on `Runtime`, so code reads the same in both places.
//!
//! # Invariants
//! - **AC-1 Ids without a round trip.** The results of calls an actor
//!   submits and the values it puts get ids from the actor's own id space
//!   (given in its spawn order), so `remote()` and `put` return at once.
//! - **AC-2 A get is a delivery.** An actor's `get` asks the driver to
//!   deliver the object to this worker's store, exactly as for a call that
//!   takes it (same transports, acknowledgements, deadlines and death
//!   notices), and ends with `GetDone` however it ends (dropped futures
//!   included), so its copy is dropped once nothing needs it (OW-2).
//! - **AC-3 A `get_into` lands in its targets.** Its targets are
//!   registered for the object before the `Get` goes out, so the
//!   delivery's receive writes into them (WK-7); a value
//!   that was here already, or received elsewhere, is copied in once.
//!   `load_into` lands the same way (`land_in`) and decodes nothing.

use std::borrow::Borrow;
use std::cell::RefCell;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{shared, Slot, StoredValue, WorkerShared};
use crate::error::{Error, Result};
use crate::protocol::inline_value;
use crate::protocol::{SubmitMsg, ToDriver, WireExported, WireValue};
use crate::refs::client::ArgOut;
use crate::refs::client::{Client, Encoded, SharedClient};
use crate::refs::object_ref::ObjectRef;
use crate::refs::targets::{Registered, Targets};
use crate::transport::Transport;
use rdt_transport::{Blob, Sidedness, Tensor};

thread_local! {
    /// Borrows met while decoding on this thread, sent as one message when
    /// decoding ends (`None`: not decoding).
    static BATCH: RefCell<Option<Vec<u64>>> = const { RefCell::new(None) };
}

impl WorkerShared {
    /// A ref was cloned (so one existed already).
    pub(crate) fn clone_ref(&self, id: u64) {
        *self.local_refs.counts.lock().entry(id).or_default() += 1;
    }

    /// A ref was read out of a value: the first local one borrows from
    /// the driver (CL-1, CL-3).
    pub(crate) fn adopt_from_wire(&self, id: u64) {
        let first = {
            let mut c = self.local_refs.counts.lock();
            let n = c.entry(id).or_default();
            *n += 1;
            *n == 1
        };
        if !first {
            return;
        }
        let batched = BATCH.with(|b| match b.borrow_mut().as_mut() {
            Some(ids) => {
                ids.push(id);
                true
            }
            None => false,
        });
        if !batched {
            let _ = self.tx.send(&ToDriver::Borrow(vec![id]));
        }
    }

    /// A ref was dropped: the last local one gives the borrow back.
    pub(crate) fn release_ref(&self, id: u64) {
        let last = {
            let mut c = self.local_refs.counts.lock();
            match c.get_mut(&id) {
                Some(n) if *n > 1 => {
                    *n -= 1;
                    false
                }
                Some(_) => {
                    c.remove(&id);
                    true
                }
                None => false,
            }
        };
        if !last {
            return;
        }
        // HO-6: nobody here can wait for it any more.
        self.self_calls.lock().remove(&id);
        // Borrowed and dropped within one decode: the driver never hears
        // of either.
        let unsent = BATCH.with(|b| match b.borrow_mut().as_mut() {
            Some(ids) => match ids.iter().position(|x| *x == id) {
                Some(i) => {
                    ids.swap_remove(i);
                    true
                }
                None => false,
            },
            None => false,
        });
        if !unsent {
            let _ = self.tx.send(&ToDriver::Release(vec![id]));
        }
    }

    /// AC-1: a new id of this actor's space, held by one local ref (the
    /// driver counts it when the message making it arrives).
    fn new_object(&self) -> u64 {
        let id = self.next_object.fetch_add(1, Ordering::Relaxed);
        self.local_refs.counts.lock().insert(id, 1);
        id
    }

    /// Forgets an id whose making message could not be sent.
    fn forget_object(&self, id: u64) {
        self.local_refs.counts.lock().remove(&id);
    }

    /// `Call::remote` inside an actor: the call goes to the driver, which
    /// runs it as one of its own (refs among the arguments move over their
    /// transports, collective ones included).
    pub(crate) fn submit(
        &self,
        actor: u64,
        method: u32,
        method_name: &str,
        args: Vec<ArgOut>,
        transport: Transport,
    ) -> u64 {
        let id = self.new_object();
        let (wire_args, error) = crate::refs::object_ref::wire_args(&args);
        // HO-6: a call to itself that will run (not one failed at
        // submission); a wait for it inside a method that runs alone fails.
        let own = actor == self.actor && error.is_none();
        if own {
            self.self_calls.lock().insert(id);
        }
        let context = super::host::current_call();
        let msg = |args, error| {
            ToDriver::Submit(SubmitMsg {
                actor,
                method,
                method_name: method_name.to_string(),
                args,
                result: id,
                transport,
                error,
                context,
            })
        };
        if let Err(e) = self.tx.send(&msg(wire_args, error)) {
            // Too large for a frame: the call fails instead (OW-6).
            tracing::debug!(method = method_name, "submit failed: {e}");
            let _ = self.tx.send(&msg(Vec::new(), Some(e)));
            if own {
                self.self_calls.lock().remove(&id);
            }
        }
        // CL-2: the refs in the arguments are released after the message.
        drop(args);
        id
    }

    /// `kill()` on a handle inside an actor.
    pub(crate) fn ask_kill(&self, actor: u64) {
        let _ = self.tx.send(&ToDriver::Kill { actor });
    }
}

/// An actor's side of the one client API: counts are local, borrowed from
/// the driver (CL-1); calls and kills go to the driver.
impl Client for WorkerShared {
    fn clone_ref(&self, id: u64) {
        WorkerShared::clone_ref(self, id)
    }
    fn release_ref(&self, id: u64) {
        WorkerShared::release_ref(self, id)
    }
    fn adopt_from_wire(&self, id: u64) {
        WorkerShared::adopt_from_wire(self, id)
    }
    fn submit(
        &self,
        actor: u64,
        method: u32,
        method_name: &'static str,
        args: Vec<ArgOut>,
        transport: Transport,
    ) -> u64 {
        WorkerShared::submit(self, actor, method, method_name, args, transport)
    }
    fn kill(&self, actor: u64) {
        self.ask_kill(actor)
    }
    fn pid(&self, _actor: u64) -> Option<u32> {
        None
    }
    fn exit_notice(
        &self,
        _actor: u64,
        name: &str,
    ) -> Result<tokio::sync::watch::Receiver<Option<String>>> {
        Err(Error::Protocol(format!(
            "the exit of {name} is observed in the driver only, not inside an actor"
        )))
    }
    fn decode_begins(&self) -> bool {
        BATCH.with(|b| {
            let mut b = b.borrow_mut();
            if b.is_some() {
                return false;
            }
            *b = Some(Vec::new());
            true
        })
    }
    fn decode_ends(&self) {
        let ids = BATCH.with(|b| b.borrow_mut().take()).unwrap_or_default();
        if !ids.is_empty() {
            let _ = self.tx.send(&ToDriver::Borrow(ids));
        }
    }
}

/// Inside an actor method: the runtime, as a client of the driver. Get it
/// with [`runtime()`].
///
/// ```no_run
/// use rdt::{ObjectRef, Tensor};
/// # struct Trainer;
/// # impl Trainer {
/// async fn step(&self, batches: Vec<ObjectRef<Tensor>>) -> rdt::Result<f32> {
///     let rt = rdt::runtime();
///     let tensors = rt.get_all(&batches).await?;
///     Ok(tensors.iter().map(|t| t.numel() as f32).sum())
/// }
/// # }
/// ```
#[derive(Clone)]
pub struct ActorRuntime {
    w: Arc<WorkerShared>,
}

/// Inside an actor method: the runtime, to `get`, `put` and `wait` (calls
/// to other actors go through their handles, which work inside actors as
/// in the driver). Panics outside an actor, like
/// `tokio::runtime::Handle::current` outside tokio; see [`try_runtime`].
pub fn runtime() -> ActorRuntime {
    try_runtime().expect(
        "rdt::runtime() is for use inside an actor method; in the driver, use the Runtime that \
         Runtime::start returned",
    )
}

/// [`runtime()`], or `None` outside an actor.
pub fn try_runtime() -> Option<ActorRuntime> {
    shared().map(|w| ActorRuntime { w })
}

/// Ends an actor's get however it ends (AC-2).
struct GetGuard<'a> {
    w: &'a WorkerShared,
    object: u64,
}

impl Drop for GetGuard<'_> {
    fn drop(&mut self) {
        let _ = self.w.tx.send(&ToDriver::GetDone {
            object: self.object,
        });
    }
}

/// The targets of one `get_into`, registered for the object's delivery
/// while the get lasts (WK-7).
struct TargetsGuard<'a> {
    w: &'a WorkerShared,
    object: u64,
    landing: Arc<crate::refs::targets::Landing>,
}

impl<'a> TargetsGuard<'a> {
    /// `None` when another `get_into` of the object in this actor
    /// registered its own first (this one then copies).
    fn register(w: &'a WorkerShared, object: u64, targets: Registered) -> Option<Self> {
        use std::collections::hash_map::Entry;
        match w.targets.lock().entry(object) {
            Entry::Occupied(_) => None,
            Entry::Vacant(e) => {
                let landing = targets.landing.clone();
                e.insert(targets);
                Some(TargetsGuard { w, object, landing })
            }
        }
    }
}

impl Drop for TargetsGuard<'_> {
    /// TG-4: however the `get_into` ends (done, failed or dropped), its
    /// receive writes nothing into the targets after this: a copy under
    /// way ends first, a later one lands elsewhere, and an in-place
    /// receive still running is aborted.
    fn drop(&mut self) {
        self.w.targets.lock().remove(&self.object);
        self.landing.gate.close();
        if let Some(xfer) = self.landing.in_place.lock().take() {
            if let Some(abort) = self.w.transfers.lock().remove(&xfer) {
                let _ = abort.send(Error::Cancelled {
                    object: self.object,
                });
            }
        }
    }
}

impl ActorRuntime {
    /// What this actor's worker has counted since it started: objects in
    /// its store, received per transport, straight, in place (see
    /// [`WorkerMetrics`](crate::metrics::WorkerMetrics)).
    pub fn metrics(&self) -> crate::metrics::WorkerMetrics {
        self.w.metrics()
    }

    /// The collective groups this actor is a member of, as its worker
    /// knows them (every member joins before `create_collective_group`
    /// returns, and leaves before `destroy_collective_group` returns).
    pub fn group_memberships(&self) -> Vec<super::GroupMembership> {
        super::group_memberships(&self.w)
    }

    /// Waits for an object and returns its value. Its tensors come over
    /// the object's transport, straight from the actor that holds them
    /// (a collective transport needs a group with that actor, as for a
    /// call). Waits until the producer replies or dies; see
    /// [`ActorRuntime::get_timeout`] for a deadline.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes loses nothing: the object stays
    /// readable by a later call, and a receive it started is given up (its copy
    /// freed when nothing else here needs it).
    pub async fn get<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
    ) -> Result<T> {
        crate::refs::api::get(self, r).await
    }

    /// Like [`ActorRuntime::get`], with the value's tensors put in `place`
    /// of this actor's process: host memory ([`Place::Host`](crate::Place))
    /// or one of its GPUs, whatever device they were on at their producer.
    /// Each tensor not in `place` already is copied there once, from
    /// where it landed (over `cuda_ipc`, straight from the producer's
    /// memory). A `place` this process does not have fails with
    /// [`Error::NoSuchDevice`] before any byte moves, and the object stays
    /// readable.
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get).
    pub async fn get_on<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
        place: crate::Place,
    ) -> Result<T> {
        crate::refs::api::get_on(self, r, place).await
    }

    /// Like [`ActorRuntime::get`], with the object's tensors received into
    /// `targets`: one per tensor of the value, in the order the value
    /// holds them (a tensor held twice counts once), each of the same
    /// dtype and shape. The value returned holds `targets` themselves.
    ///
    /// This is the receive of a weight update: the actor's parameters stay
    /// where they are and the transport writes into them (DESIGN §6 point
    /// 7) — `nccl` into CUDA targets on its GPU, `nixl` into rdt's
    /// memory (CUDA tensors made with `Tensor::cuda_empty`, host tensors
    /// made by rdt), with no staging and no allocation. Where the
    /// transport cannot (the object store, `shm` and `cuda_ipc`, which
    /// hand over the producer's memory, or targets it refuses), or the
    /// object is here already, the tensors are copied in once.
    ///
    /// Targets that do not fit fail with [`Error::Targets`] and lose
    /// nothing: the object stays readable.
    ///
    /// `targets` is a slice (its tensors are cloned to register them) or
    /// a [`Targets`] kept from one update to the next (registered as it
    /// is, and checked once per layout: see there).
    ///
    /// ```no_run
    /// # use rdt::prelude::*;
    /// # async fn f(weights: ObjectRef<Vec<Tensor>>, params: &[Tensor]) -> rdt::Result<()> {
    /// // Inside an actor method that got a ref to the new weights:
    /// rdt::runtime().get_into(&weights, params).await?;
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes writes nothing more into
    /// `targets` over `tcp`, `shm`, `cuda_ipc` (nothing more is queued on the
    /// stream) and the object store: their copy into the targets runs under a
    /// gate the drop closes (a copy under way ends first), or in this future
    /// itself. Over `nixl` and `nccl`, which write into the targets as the
    /// bytes come, the drop aborts the receive (over `nccl`, like any failed
    /// transfer, that aborts the group); a NIXL READ already posted ends or
    /// is cancelled a moment after the drop, and writes into the targets
    /// until then: [`Targets::idle`](crate::Targets::idle) waits for it.
    /// Either way the object stays readable.
    pub async fn get_into<T: Serialize + DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
        targets: impl Into<Targets>,
    ) -> Result<T> {
        crate::refs::api::get_into(self, r, targets).await
    }

    /// [`get_into`](Self::get_into) without the value: the object's
    /// tensors written into `targets`, and nothing decoded. This is the
    /// receive of a weight update whose caller keeps its parameters and
    /// needs nothing else from the object: once it returns, `targets`
    /// hold the new values (CUDA targets: once their
    /// [`cuda_ready`](Tensor::cuda_ready) returns, as for any received
    /// tensor).
    ///
    /// It saves what the value costs: a `Vec<Tensor>` of 10 000
    /// parameters is 10 000 handles made and dropped per update, each
    /// a reference count taken and given back (about 9 ns apiece on the
    /// H200 hosts), which `get_into` pays to hand back tensors the caller
    /// holds already. Same targets, same errors as `get_into`.
    ///
    /// ```no_run
    /// # use rdt::prelude::*;
    /// # async fn f(weights: ObjectRef<Vec<Tensor>>, params: &rdt::Targets) -> rdt::Result<()> {
    /// // Inside an actor method that got a ref to the new weights:
    /// rdt::runtime().load_into(&weights, params).await?;
    /// // `params` hold the new weights.
    /// # Ok(()) }
    /// ```
    ///
    /// # Cancel safety
    ///
    /// As [`get_into`](Self::get_into).
    pub async fn load_into<T: Serialize + DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
        targets: impl Into<Targets>,
    ) -> Result<()> {
        crate::refs::api::load_into(self, r, targets).await
    }

    /// Object `id` received into `targets` (AC-3): the stored value, and
    /// the targets as the value's tensors where they were copied in
    /// (`None`: the receive wrote into them itself, counted in
    /// [`WorkerMetrics::received_in_place`](crate::metrics::WorkerMetrics::received_in_place)).
    async fn land_in<T: Serialize + DeserializeOwned + 'static>(
        &self,
        id: u64,
        targets: &Targets,
    ) -> Result<(StoredValue, Option<Vec<Tensor>>)> {
        let v = self.stored(id, Some(Registered::of::<T>(targets))).await?;
        // TG-1: the targets in the order the value holds its tensors (the
        // receive ordered them so too, from the same bytes: TG-3).
        let ordered = targets.resolve::<T>(id, &v.data, v.tensors.len(), &|i| {
            v.tensors.tensor(i).map(|t| t.meta())
        })?;
        // The receive returned the very list registered (the targets'
        // own, which nothing changes): in place, with nothing to compare.
        let copied = if v.tensors.is_shared(&ordered) {
            None
        } else {
            crate::refs::wait::into_targets(id, &ordered, &v.tensors)?
        };
        if copied.is_none() {
            self.w.in_place.fetch_add(1, Ordering::Relaxed);
        }
        Ok((v, copied))
    }

    /// Object `id` as this worker stores it, delivered first if it is not
    /// here (AC-2); `targets` are where that delivery's receive puts the
    /// tensors (WK-7).
    async fn stored(&self, id: u64, targets: Option<Registered>) -> Result<StoredValue> {
        if let Some(Slot::Ready(v)) = self.w.store.get(id) {
            // Produced here, or a copy held: no message at all.
            if !self.w.landing.lock().contains_key(&id) {
                return Ok(v);
            }
        }
        self.refuse_endless_wait(id).await?;
        // Registered before the `Get` goes out, so that its delivery finds
        // them; gone when this get ends, however it ends.
        let _targets = targets.and_then(|ts| TargetsGuard::register(&self.w, id, ts));
        self.w.tx.send(&ToDriver::Get { object: id })?;
        let _done = GetGuard {
            w: &self.w,
            object: id,
        };
        let v = match self.w.arrival(id).await {
            Slot::Ready(v) => v,
            Slot::Failed(e) => return Err(e),
        };
        // WK-5: a stream-ordered receive returns before its bytes land.
        let landing = self.w.landing.lock().get(&id).cloned();
        if let Some(l) = landing {
            l.landing.await.map_err(Error::from)?;
        }
        Ok(v)
    }

    /// HO-6: inside a method that runs alone, a wait for the result of a
    /// call this actor made to itself (not run yet) would never end: that
    /// call starts only after the method returns. (While such a method
    /// runs, no call of this actor runs beside it, so every entry of
    /// `self_calls` is a call that has not run: no store lookup needed.)
    ///
    /// The driver may have refused that call at submission (a check only
    /// it can make, such as a group for a collective argument): then the
    /// call never runs, its result is already failed, and the wait ends
    /// with the driver's error. The driver's answer to a probe, sent after
    /// the call's `Submit` on the same connection, says which.
    async fn refuse_endless_wait(&self, id: u64) -> Result<()> {
        if !super::host::in_method_that_runs_alone() || !self.w.self_calls.lock().contains(&id) {
            return Ok(());
        }
        let state = self.probe(id).await?;
        if state.is_some() {
            // Refused at submission: it will never run.
            self.w.self_calls.lock().remove(&id);
        }
        match state {
            None => Err(Error::WouldDeadlock {
                actor: self.w.name.to_string(),
                object: id,
            }),
            Some(result) => result,
        }
    }

    /// The driver's view of object `id` now (`None`: pending).
    async fn probe(&self, id: u64) -> Result<Option<Result<()>>> {
        self.ask(&self.w.probes, |req| ToDriver::Probe { req, object: id })
            .await
    }

    /// Sends the driver the request `msg(req)` and waits for its answer,
    /// which the control loop hands over through `pending` by `req`.
    async fn ask<R>(
        &self,
        pending: &Mutex<HashMap<u64, tokio::sync::oneshot::Sender<R>>>,
        msg: impl FnOnce(u64) -> ToDriver,
    ) -> Result<R> {
        let req = self.w.next_req.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = tokio::sync::oneshot::channel();
        pending.lock().insert(req, tx);
        if let Err(e) = self.w.tx.send(&msg(req)) {
            pending.lock().remove(&req);
            return Err(e);
        }
        // The driver's death ends this worker, so the answer comes.
        rx.await.map_err(|_| Error::Shutdown)
    }

    /// [`ActorRuntime::get`] with a deadline.
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get): a deadline that passes drops nothing but the
    /// wait.
    pub async fn get_timeout<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
        deadline: Duration,
    ) -> Result<T> {
        crate::refs::api::get_timeout(self, r, deadline).await
    }

    /// Gets several objects: every transfer starts before any is awaited.
    /// Fails with the first error.
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get), for each object.
    pub async fn get_all<T: DeserializeOwned + 'static>(
        &self,
        refs: &[ObjectRef<T>],
    ) -> Result<Vec<T>> {
        crate::refs::api::get_all(self, refs).await
    }

    /// Waits until an object is ready (`Ok`) or failed (its error),
    /// without moving its value.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes loses nothing: it moves no
    /// value.
    pub async fn wait<T>(&self, r: impl Borrow<ObjectRef<T>>) -> Result<()> {
        crate::refs::api::wait(self, r).await
    }

    async fn wait_id(&self, id: u64) -> Result<()> {
        if let Some(Slot::Ready(_)) = self.w.store.get(id) {
            return Ok(());
        }
        self.ask(&self.w.watches, |req| ToDriver::Watch { req, object: id })
            .await?
    }

    /// Ray's `wait`, as [`Runtime::wait_many`](crate::Runtime::wait_many):
    /// `(finished, pending)` once `num_returns` of `refs` are ready or
    /// failed, or `timeout` passed.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes loses nothing: it moves no
    /// value.
    pub async fn wait_many<T>(
        &self,
        refs: &[ObjectRef<T>],
        num_returns: usize,
        timeout: Option<Duration>,
    ) -> Result<(Vec<ObjectRef<T>>, Vec<ObjectRef<T>>)> {
        crate::refs::api::wait_many(self, refs, num_returns, timeout).await
    }

    /// Puts `value` through the object store (its bytes go to the driver)
    /// and returns a ref to pass to any actor or to the driver. See
    /// [`ActorRuntime::put_with`] to keep its tensors here.
    pub fn put<T: Serialize>(&self, value: &T) -> Result<ObjectRef<T>> {
        crate::refs::api::put(self, value)
    }

    /// Puts `value` with its tensors kept in this worker over `transport`
    /// (`shm`, `cuda_ipc`, `nixl`, or a collective one for the members of
    /// a group), as a method's return value would be: each consumer,
    /// another actor or the driver where the transport serves it, takes
    /// them directly. With [`Transport::ObjectStore`] this is
    /// [`ActorRuntime::put`].
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while the tensors are exported (`nixl` registers
    /// them) returns no ref; what the export registered stays until the
    /// transport is dropped. Drop it only once it returned.
    pub async fn put_with<T: Serialize>(
        &self,
        value: &T,
        transport: Transport,
    ) -> Result<ObjectRef<T>> {
        crate::refs::api::put_with(self, value, transport).await
    }

    fn send_put<T>(&self, wv: WireValue, encoded: Encoded) -> Result<ObjectRef<T>> {
        let id = self.w.new_object();
        if let Err(e) = self.w.tx.send(&ToDriver::Put {
            object: id,
            value: wv,
        }) {
            self.w.forget_object(id);
            return Err(e);
        }
        // CL-2: released after the message that carries them.
        drop(encoded);
        Ok(ObjectRef::adopt(id, self.w.clone() as SharedClient))
    }
}

/// An actor's side of the one client API (`refs::api`): objects read from
/// this worker's store, received here, or asked of the driver.
impl crate::refs::api::Objects for ActorRuntime {
    fn client(&self) -> Option<SharedClient> {
        None
    }

    async fn read(&self, id: u64) -> Result<crate::refs::api::Read> {
        let v = self.stored(id, None).await?;
        Ok(crate::refs::api::Read {
            data: v.data,
            tensors: crate::refs::api::ReadTensors::Stored(v.tensors),
        })
    }

    async fn read_into<T: Serialize + DeserializeOwned + 'static>(
        &self,
        id: u64,
        targets: &Targets,
    ) -> Result<(crate::refs::api::Read, Option<Vec<Tensor>>)> {
        let (v, copied) = self.land_in::<T>(id, targets).await?;
        let read = crate::refs::api::Read {
            data: v.data,
            tensors: crate::refs::api::ReadTensors::Stored(v.tensors),
        };
        Ok((read, copied))
    }

    fn receiver(&self) -> String {
        self.w.name.to_string()
    }

    async fn settled(&self, id: u64) -> Result<()> {
        self.wait_id(id).await
    }

    async fn check_wait(&self, id: u64) -> Result<()> {
        self.refuse_endless_wait(id).await
    }

    fn check_wait_many(
        &self,
        ids: &[u64],
        num_returns: usize,
        timeout: Option<Duration>,
    ) -> Result<()> {
        if timeout.is_none() && super::host::in_method_that_runs_alone() {
            // HO-6: without a deadline, a wait that needs more of them than
            // are not pending calls of this actor to itself never ends.
            let own: Vec<u64> = {
                let pending = self.w.self_calls.lock();
                ids.iter()
                    .copied()
                    .filter(|id| pending.contains(id))
                    .collect()
            };
            if let Some(&object) = own.first() {
                if ids.len() - own.len() < num_returns {
                    return Err(Error::WouldDeadlock {
                        actor: self.w.name.to_string(),
                        object,
                    });
                }
            }
        }
        Ok(())
    }

    fn put_inline<T>(&self, encoded: Encoded) -> Result<ObjectRef<T>> {
        let wv = inline_value(encoded.payload.clone(), encoded.ref_ids())?;
        self.send_put(wv, encoded)
    }

    async fn put_direct<T: Serialize>(
        &self,
        value: &T,
        transport: Transport,
    ) -> Result<ObjectRef<T>> {
        let encoded = crate::refs::api::encode(value, "put_with")?;
        let inst = transport.instance()?;
        for t in &encoded.payload.tensors {
            inst.check_device(t.device())?;
        }
        if encoded.payload.tensors.is_empty() || inst.sidedness() == Sidedness::ThroughDriver {
            let wv = inline_value(encoded.payload.clone(), encoded.ref_ids())?;
            return self.send_put(wv, encoded);
        }
        // The id is made (not yet counted) before the export, which keys
        // the tensors by it.
        let id = self.w.next_object.fetch_add(1, Ordering::Relaxed);
        let exported = match inst.export(id, &encoded.payload.tensors).await {
            Ok(x) => x,
            Err(e) => {
                let _ = inst.release(id).await;
                return Err(e.into());
            }
        };
        self.w.store.insert(
            id,
            Slot::Ready(StoredValue {
                data: encoded.payload.data.clone(),
                tensors: Arc::new(encoded.payload.tensors.clone().into()),
                transport,
                produced: true,
            }),
        );
        let wv = WireValue {
            data: Blob::new(encoded.payload.data.clone()),
            transport,
            exported: WireExported::new(exported)?,
            refs: encoded.ref_ids(),
        };
        self.w.local_refs.counts.lock().insert(id, 1);
        if let Err(e) = self.w.tx.send(&ToDriver::Put {
            object: id,
            value: wv,
        }) {
            self.w.forget_object(id);
            self.w.store.remove(id);
            let _ = inst.release(id).await;
            return Err(e);
        }
        drop(encoded);
        Ok(ObjectRef::adopt(id, self.w.clone() as SharedClient))
    }
}
