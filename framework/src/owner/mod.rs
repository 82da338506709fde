//! The owner table: the driver's record of every live object and of every
//! transfer in flight.
//!
//! # States
//! An entry is created **pending** when a call is submitted (or **ready**
//! at once for `put`). The producer's reply makes it **ready** (value, or for
//! direct transports the non-tensor data plus tensor metadata) or
//! **failed** (the method's error, or the producer's death). An entry is
//! **freed** by removing it from the table.
//!
//! A consumer's copy of an object is **receiving** from the moment its
//! delivery is sent until the consumer acknowledges the receive
//! (`Received`, done or failed) or the transfer is aborted, then **held**
//! until the consumer no longer needs it.
//!
//! # Invariants
//! - **OW-1 (free):** an entry is freed exactly when no count (`refs`:
//!   driver refs, actors' borrows, values that contain it: `client`
//!   CL-1/CL-2), no submitted call (`needs`) and no receive in flight needs
//!   it and it is not pending; then the producer (direct transports) and every
//!   holder of a copy are told to drop it. A receive in flight holds the
//!   free back until its acknowledgement: nothing is freed under a receive.
//! - **OW-2 (secondary copies):** when the last call of a consumer that
//!   needed an object finishes and its receive is acknowledged, that
//!   consumer is told to drop its copy (Ray pops secondary copies), so a
//!   rollout fed new weights every step does not keep the old ones. A later
//!   call that needs the object again gets a new delivery.
//! - **OW-3 (once per copy):** a consumer gets each object at most once
//!   while it holds a copy; a call that needs an object already delivered
//!   to its actor causes no transfer. The producer itself never receives its
//!   own object: it already holds the same storage (hand-over without copy).
//! - **OW-4 (waiting deliveries):** deliveries for a pending object wait in
//!   `waiting` and go out, in order, when the object becomes ready or
//!   failed. A failed object is delivered as its error, so the consumer's
//!   call fails with a dependency error naming the original.
//! - **OW-5 (death):** when a producer dies, its pending objects fail (their
//!   calls fail), its ready direct objects become failed (their tensors died
//!   with it), and every receive in flight from it is aborted with the
//!   producer's death as its error. When a consumer dies, its transfers are
//!   dropped (the producer's send is aborted) and its copies forgotten.
//! - **OW-6 (no message dropped):** a delivery that cannot be sent (too large
//!   for a frame) is replaced by the error saying so, so the call that
//!   needed it fails instead of waiting; a send order that cannot be sent
//!   fails the transfer the same way.
//! - **OW-7 (one connection):** messages to one actor go out on one ordered
//!   connection, so a `Free` never overtakes the delivery it frees.
//! - **OW-9 (straight from the producer):** an object of a one-sided
//!   transport or through the driver, holding no refs (PD-2), still
//!   pending when a consumer on
//!   the driver's host needs it, is delivered by its producer
//!   (`ToWorker::DeliverTo`), not through `waiting`: its
//!   transfer and the consumer's `Receiving` copy are recorded when the
//!   order goes out, and its deadline is armed when the producer's reply
//!   comes (a long method is not a slow transfer). The reply names the
//!   orders carried out (`worker::straight`, PD-1); each other one is
//!   withdrawn and the object delivered by the driver, as if it had
//!   waited (OW-4), to a consumer that still needs it.
//! - **OW-11 (the driver's copy backs a straight one):** a value through
//!   the driver goes to the driver in its producer's `CallDone` even when
//!   it also went straight to a consumer. If the consumer acknowledges the
//!   straight transfer as failed (its bytes did not all come: the
//!   producer died, the link broke), the driver delivers its own copy (or
//!   the error it holds) to the consumer, which stored nothing; and the
//!   producer's death does not abort such a transfer once its value is
//!   in the driver whole. The object store's promise, that a value
//!   outlives its producer, holds on the straight path too.
//! - **OW-12 (the consumer drops its own copy):** a call submitted while
//!   it was its actor's only need of a ref argument (and that actor is
//!   not the producer) names that argument in its `release` list; when
//!   the call ends past argument resolution and no other call the
//!   consumer holds takes the argument, the consumer takes its copy out
//!   of its store before writing the `CallDone`, which names it
//!   (`released`). The driver then forgets that copy without a `Free`
//!   (OW-2 without a frame on the next pass's path), and delivers again
//!   to a consumer that a call submitted meanwhile made need it.
//! - **OW-14 (getters handed the value):** the driver's `get` of a call
//!   result waits with a [`Getter::Value`]: when the call's `CallDone`
//!   stores the result, the getter is sent the value (or the error) and
//!   woken there and then, under the lock, and goes on without taking it,
//!   while the reader settles the call's transfers and releases its
//!   arguments. It holds a ref of its own, so what it was handed cannot
//!   have been freed. On 2×H200 this made tiny calls 0.5–0.7 µs faster
//!   and left 4 KiB passes as they were (in a closed loop the next
//!   submit waits for the lock instead). Other waiters
//!   ([`Getter::Signal`]) are woken after the unlock.
//! - **OW-15 (large sends to one consumer, one at a time):** a two-sided
//!   transfer of at least `RuntimeBuilder::large_transfer_bytes` (128 MiB) whose
//!   consumer already has such a transfer in flight for another call (the
//!   transfers one call needs go together) is held here, both ends (the
//!   consumer's delivery and the producer's `SendTo`, so that every
//!   member's group queue keeps the driver's order, XF-3), in order, until
//!   the transfers ahead of it for that consumer's other calls ended
//!   (acknowledged, failed or aborted). Bytes into one GPU share its
//!   links, and senders on one GPU share it in time slices: started
//!   together, two such transfers landed one after the other in whichever
//!   order their senders happened to start (2×H200, session 43), so the
//!   call queued first often waited for both. Held, the first call's bytes
//!   land first, at full speed. Such a delivery asks its consumer to
//!   acknowledge at landing even when a call took the value
//!   ([`Delivery::ack_at_landing`]), so the next send goes without waiting
//!   for that call's end. A held transfer's deadline runs from its
//!   hold; neither end hears of it if it is aborted while held (the
//!   consumer gets the error as the value), and none is sent to a consumer
//!   that died. A group being destroyed
//!   has its held sends sent first (`send_held_in_group`), so that their
//!   transfers end as they would have without the hold.
//! - **OW-8 (groups at delivery):** a two-sided transfer starts only inside
//!   a live collective group holding both ends, looked up when its orders
//!   go out (a delivery that waited for a pending object too): no transfer
//!   after a destroy or an abort; the orders carry the group and both
//!   ranks.

use std::collections::HashMap;

use rdt_transport::{GroupRef, Peer, Sidedness};
use tokio::sync::oneshot;

use crate::error::Error;
use crate::metrics::{Counts, Outcome};
use crate::protocol::{Delivery, ToWorker, WireValue};
use crate::transport::Transport;

mod deliver;
mod events;
mod free;
mod outbox;
#[cfg(test)]
mod tests;

pub(crate) use outbox::Outbox;

/// Driver-side id of an actor.
pub(crate) type ActorId = u64;

/// The size from which two-sided transfers to one consumer go one at a
/// time (OW-15) unless the runtime was built with another: 128 MiB, about
/// 0.35 ms over NVLink at 370 GB/s, so that the round trip that releases
/// the next send (tens of µs) costs it at most about a tenth.
pub(crate) const DEFAULT_LARGE_TRANSFER_BYTES: usize = 128 << 20;

/// OW-15's size, [`DEFAULT_LARGE_TRANSFER_BYTES`] unless set.
pub(crate) struct LargeTransferBytes(pub usize);

impl Default for LargeTransferBytes {
    fn default() -> Self {
        LargeTransferBytes(DEFAULT_LARGE_TRANSFER_BYTES)
    }
}

/// A producer's `SendTo` held until the large transfers ahead of it for
/// the same consumer ended (OW-15).
struct HeldSend {
    xfer: u64,
    /// The call that needs it (see [`InFlight::call`]).
    call: Option<u64>,
    producer: ActorId,
    /// The consumer's delivery, held with the send: both ends take the
    /// transfer at one point of the driver's order (XF-3).
    deliver: ToWorker,
    order: ToWorker,
}

/// Someone waiting for a pending object to become ready or fail.
pub(crate) enum Getter {
    /// Told that it settled; looks it up under the lock itself.
    Signal(oneshot::Sender<()>),
    /// Handed the value or the error itself (OW-14).
    Value(oneshot::Sender<Result<WireValue, Error>>),
}

/// A getter to wake once the driver's lock is released (a getter handed
/// the value is woken at once, OW-14).
pub(crate) struct Woken(oneshot::Sender<()>);

impl Woken {
    /// Wakes it (a getter that went away is no one's concern).
    pub(crate) fn wake(self) {
        let _ = self.0.send(());
    }
}

/// State of an object.
pub(crate) enum ObjState {
    Pending,
    Ready(WireValue),
    Failed(Error),
}

impl ObjState {
    /// What it settled to: its value or its error; `None` while pending.
    pub(crate) fn settled(&self) -> Option<Result<WireValue, Error>> {
        match self {
            ObjState::Pending => None,
            ObjState::Ready(v) => Some(Ok(v.clone())),
            ObjState::Failed(err) => Some(Err(err.clone())),
        }
    }
}

/// A consumer's copy of an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Copy {
    /// Delivered as transfer `xfer`; not acknowledged yet.
    Receiving(u64),
    /// In the consumer's store (the value or the error it got).
    Held,
}

/// One object.
pub(crate) struct Entry {
    pub producer: Option<ActorId>,
    pub transport: Transport,
    pub state: ObjState,
    /// Counts held on the object: driver refs, one per actor that borrows
    /// it (CL-1), one per value that contains it (CL-2).
    pub refs: usize,
    /// Objects whose refs this object's value contains: it holds a count
    /// on each, released when it is freed (CL-2).
    nested: Vec<u64>,
    /// Submitted, unfinished calls that take the object, per consumer.
    needs: HashMap<ActorId, usize>,
    /// Consumers that hold or are receiving a copy.
    copies: HashMap<ActorId, Copy>,
    /// Consumers waiting for it to be ready, with the call that needs it
    /// (`None`: not known), in order (OW-4).
    waiting: Vec<(ActorId, Option<u64>)>,
    /// Consumers its producer was asked to deliver to itself, with their
    /// transfers (OW-9), while it is pending.
    straight: Vec<(ActorId, u64)>,
    pub getters: Vec<Getter>,
    passed_back: bool,
    sent_elsewhere: bool,
    warned: bool,
    /// The tensors of an object the driver holds itself (`put_with`),
    /// released with the entry.
    pub held: Option<DriverHeld>,
}

/// Tensors the driver exported itself (`Runtime::put_with`): dropped, and
/// the transport told to release them, when the entry is freed (OW-1).
pub(crate) struct DriverHeld {
    key: u64,
    tensors: Vec<rdt_transport::Tensor>,
    transport: std::sync::Arc<dyn rdt_transport::TensorTransport>,
}

impl DriverHeld {
    pub fn new(
        key: u64,
        tensors: Vec<rdt_transport::Tensor>,
        transport: std::sync::Arc<dyn rdt_transport::TensorTransport>,
    ) -> DriverHeld {
        DriverHeld {
            key,
            tensors,
            transport,
        }
    }

    pub fn tensors(&self) -> &[rdt_transport::Tensor] {
        &self.tensors
    }
}

impl Drop for DriverHeld {
    fn drop(&mut self) {
        use futures::FutureExt;
        self.tensors.clear();
        let (t, key) = (self.transport.clone(), self.key);
        let mut release = Box::pin(async move { t.release(key).await });
        match (&mut release).now_or_never() {
            Some(Err(e)) => tracing::warn!("releasing object {key} held by the driver: {e}"),
            Some(Ok(())) => {}
            None => match tokio::runtime::Handle::try_current() {
                Ok(h) => {
                    h.spawn(async move {
                        if let Err(e) = release.await {
                            tracing::warn!("releasing object {key} held by the driver: {e}");
                        }
                    });
                }
                Err(_) => {
                    let _ = futures::executor::block_on(release);
                }
            },
        }
    }
}

impl Entry {
    /// A new entry held by one driver ref (the one its creator returns).
    fn new(producer: Option<ActorId>, transport: Transport, state: ObjState) -> Entry {
        Entry {
            producer,
            transport,
            state,
            refs: 1,
            nested: Vec::new(),
            needs: HashMap::new(),
            copies: HashMap::new(),
            waiting: Vec::new(),
            straight: Vec::new(),
            getters: Vec::new(),
            passed_back: false,
            sent_elsewhere: false,
            warned: false,
            held: None,
        }
    }

    fn sidedness(&self) -> Sidedness {
        self.transport.sidedness()
    }

    fn receiving(&self) -> bool {
        self.copies
            .values()
            .any(|c| matches!(c, Copy::Receiving(_)))
    }
}

/// A transfer in flight: delivered to its consumer, not yet acknowledged.
#[derive(Clone, Debug)]
pub(crate) struct InFlight {
    pub object: u64,
    pub producer: Option<ActorId>,
    pub consumer: ActorId,
    pub transport: Transport,
    pub two_sided: bool,
    /// Two-sided and at least `large_transfer_bytes` (OW-15).
    pub large: bool,
    /// The call it was delivered for, where known (OW-15).
    pub call: Option<u64>,
    /// Its `transfer` span, from its start to its end (its bytes, tensors
    /// and `outcome` recorded then).
    pub span: tracing::Span,
    /// When it started (`rdt_xfer_time`).
    pub started: std::time::Instant,
}

impl InFlight {
    /// OW-15: does this transfer hold back a large send to `consumer`
    /// for `call`? It does if it is large, to that consumer, and for
    /// another call (the transfers one call needs go together).
    fn holds_back(&self, consumer: ActorId, call: Option<u64>) -> bool {
        self.large && self.consumer == consumer && self.call != call
    }

    /// Its two ends and its transport: what a connection and its memory
    /// registrations are made for.
    fn pair(&self) -> WarmPair {
        (self.transport.name(), self.producer, self.consumer)
    }
}

/// What the owner table asks of the driver's collective groups (OW-8).
pub(crate) trait GroupLookup {
    /// For a collective `transport`: the live group holding both ends, as
    /// (group, producer's rank, consumer's rank), or the error saying why
    /// there is none. `Ok(None)` for other transports.
    fn group_for(
        &self,
        transport: &str,
        object: u64,
        producer: ActorId,
        consumer: ActorId,
    ) -> Result<Option<(u64, u32, u32)>, Error>;
}

/// How a call ended, as [`OwnerTable::call_done`] takes it.
pub(crate) struct CallEnd<'a> {
    /// Its result value or its error.
    pub outcome: Result<WireValue, Error>,
    /// XF-5: it got past argument resolution, landings included, so its
    /// end settles the receives of its arguments; `false` for a call that
    /// never ran (never sent, refused by the mailbox, an argument lost),
    /// whose receives settle by their own acknowledgements.
    pub resolved: bool,
    /// The transfers its producer carried out itself (OW-9).
    pub delivered: &'a [u64],
    /// The argument copies its consumer dropped itself (OW-12).
    pub released: &'a [u64],
}

/// What the driver knows of an actor.
pub(crate) struct ActorInfo {
    pub name: String,
    pub dead: Option<String>,
    pub host: String,
    pub endpoints: HashMap<String, String>,
    /// Where it takes deliveries straight from producers (workers the
    /// driver spawned, peer delivery on).
    pub peer_socket: Option<String>,
    /// The device its `cuda:0` is, as the driver assigned it
    /// (`CUDA_VISIBLE_DEVICES`'s first entry); `None` when the driver
    /// assigned none (a joined worker, a spawn without GPUs).
    pub gpu: Option<String>,
    /// How many CUDA devices its process sees, once it said
    /// (`SpawnedActor`).
    pub cuda_devices: Option<u32>,
}

impl ActorInfo {
    pub fn peer(&self, id: ActorId, transport: &str) -> Peer {
        Peer {
            actor: id,
            name: self.name.clone(),
            host: self.host.clone(),
            endpoint: self.endpoints.get(transport).cloned().unwrap_or_default(),
        }
    }
}

pub(crate) type Actors = HashMap<ActorId, ActorInfo>;

/// A transport and the two ends of a transfer over it (producer `None`:
/// the driver).
type WarmPair = (&'static str, Option<ActorId>, ActorId);

/// The table.
#[derive(Default)]
pub(crate) struct OwnerTable {
    pub objects: HashMap<u64, Entry>,
    /// The messages decided, in order, for the driver to write (OW-7).
    pub outbox: Outbox,
    transfers: HashMap<u64, InFlight>,
    /// The pairs a transfer ended well between: a transfer between them
    /// again is `warm` (their connection and registrations are made).
    warm: std::collections::HashSet<WarmPair>,
    /// Transfers started and ended since the driver last looked: it arms
    /// their deadlines, and wakes those waiting for transfers to settle.
    /// A straight order its producer answered counts as ended here (OW-9:
    /// it was unsettled until then).
    started: Vec<u64>,
    ended: Vec<u64>,
    next_xfer: u64,
    /// Straight orders (OW-9) whose producer has not answered yet.
    straight_orders: usize,
    /// OW-15: per consumer, the `SendTo`s held behind its large transfer
    /// in flight, oldest first.
    held_sends: HashMap<ActorId, std::collections::VecDeque<HeldSend>>,
    /// Sends held by OW-15 (for tests and benchmarks).
    pub sends_held: u64,
    /// OW-15's size (`RuntimeBuilder::large_transfer_bytes`).
    pub large_transfer_bytes: LargeTransferBytes,
    /// Getters of values that became ready or failed, to be woken once
    /// the driver's lock is released (`StateGuard`'s drop): woken under
    /// the lock, a getter that looks the value up found it held and
    /// waited for it. A getter handed the value itself is woken at once
    /// (OW-14).
    woken: Vec<Woken>,
    /// Tensors the driver held itself of objects freed (OW-1), dropped
    /// (and their transport's release run) once the driver's lock is
    /// released, like `woken`: a release may take its time.
    freed_held: Vec<DriverHeld>,
    /// What `Runtime::metrics` reports.
    pub counts: Counts,
    /// Getters handed their value as it was stored (OW-14): for tests.
    pub handed_values: u64,
    /// Copies consumers dropped themselves (OW-12), and those of them a
    /// call submitted meanwhile needed, delivered again: for tests.
    pub released_by_callees: u64,
    pub delivered_again: u64,
}

impl OwnerTable {
    /// A call's result, pending. The returned ref counts as one.
    pub fn insert_pending(&mut self, id: u64, producer: ActorId, transport: Transport) {
        self.objects
            .insert(id, Entry::new(Some(producer), transport, ObjState::Pending));
    }

    /// A value put by the driver, or a call that failed before it was sent.
    pub fn insert_done(&mut self, id: u64, producer: Option<ActorId>, state: ObjState) {
        let nested = match &state {
            ObjState::Ready(v) => v.refs.clone(),
            _ => Vec::new(),
        };
        self.hold(&nested);
        let mut e = Entry::new(producer, Transport::ObjectStore, state);
        e.nested = nested;
        self.objects.insert(id, e);
    }

    /// An object the driver holds itself over a direct transport
    /// (`put_with`), ready at once.
    pub fn insert_held(
        &mut self,
        id: u64,
        transport: Transport,
        value: WireValue,
        held: DriverHeld,
    ) {
        let nested = value.refs.clone();
        self.hold(&nested);
        let mut e = Entry::new(None, transport, ObjState::Ready(value));
        e.nested = nested;
        e.held = Some(held);
        self.objects.insert(id, e);
    }

    /// A value an actor put (`put` inside an actor): ready at once, held
    /// by that actor's borrow. `producer` keeps the tensors for a direct
    /// transport; `None` when the bytes came inline.
    pub fn insert_put(&mut self, id: u64, producer: Option<ActorId>, value: WireValue) {
        let nested = value.refs.clone();
        self.hold(&nested);
        let transport = value.transport;
        let mut e = Entry::new(producer, transport, ObjState::Ready(value));
        e.nested = nested;
        self.objects.insert(id, e);
    }

    /// Values that contain refs to `ids` arrived (CL-2): one count each.
    pub fn hold(&mut self, ids: &[u64]) {
        for &id in ids {
            self.inc(id);
        }
    }

    /// The counts taken by [`OwnerTable::hold`] are given back.
    pub fn unhold(&mut self, ids: &[u64]) {
        for &id in ids {
            self.dec(id);
        }
    }

    /// A driver ref was cloned.
    pub fn inc(&mut self, id: u64) {
        if let Some(e) = self.objects.get_mut(&id) {
            e.refs += 1;
        }
    }

    /// A driver ref was dropped.
    pub fn dec(&mut self, id: u64) {
        if let Some(e) = self.objects.get_mut(&id) {
            e.refs = e.refs.saturating_sub(1);
        }
        self.maybe_free(id);
    }

    /// The getters to wake now that their values are settled (see
    /// `woken`).
    pub fn take_woken(&mut self) -> Vec<Woken> {
        std::mem::take(&mut self.woken)
    }

    /// The driver-held tensors of objects freed since the last call (see
    /// `freed_held`).
    pub fn take_freed_held(&mut self) -> Vec<DriverHeld> {
        std::mem::take(&mut self.freed_held)
    }

    /// Transfers started and ended since the last call: `(started,
    /// ended)`; the driver arms the deadlines of the first and cancels
    /// those of the second.
    pub fn take_transfer_changes(&mut self) -> (Vec<u64>, Vec<u64>) {
        (
            std::mem::take(&mut self.started),
            std::mem::take(&mut self.ended),
        )
    }

    /// Number of live entries (for tests and soak checks).
    pub fn len(&self) -> usize {
        self.objects.len()
    }
}

fn e_bytes(e: &Entry) -> usize {
    match &e.state {
        ObjState::Ready(v) => v.exported.nbytes(),
        _ => 0,
    }
}

/// The tensors of an entry's value (0 while it is pending).
fn e_tensors(e: &Entry) -> u64 {
    match &e.state {
        ObjState::Ready(v) => v.exported.tensors() as u64,
        _ => 0,
    }
}

/// An actor's name, for messages and spans.
pub(crate) fn actor_name(actors: &Actors, a: ActorId) -> String {
    actors
        .get(&a)
        .map(|i| i.name.clone())
        .unwrap_or_else(|| format!("actor {a}"))
}

/// A transfer's span in the driver, from its start to its end: `warm`
/// is recorded when it is tracked (`track_transfer`), its bytes, tensors,
/// descriptors (the memory regions its value is exported as, one per
/// tensor) and `outcome` at its end (`end_transfer`).
fn transfer_span(
    xfer: u64,
    object: u64,
    transport: Transport,
    producer: Option<ActorId>,
    consumer: ActorId,
    actors: &Actors,
    straight: bool,
) -> tracing::Span {
    let name = |a: Option<ActorId>| match a {
        Some(a) => actor_name(actors, a),
        None => "driver".to_string(),
    };
    tracing::info_span!(
        parent: None,
        "transfer",
        xfer,
        object,
        transport = transport.name(),
        bytes = tracing::field::Empty,
        tensors = tracing::field::Empty,
        descriptors = tracing::field::Empty,
        warm = tracing::field::Empty,
        producer = %name(producer),
        consumer = %name(Some(consumer)),
        straight,
        outcome = tracing::field::Empty,
    )
}
