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
//!   transport or through the driver, still pending when a consumer on
//!   the driver's host needs it, is delivered by its producer
//!   (`ToWorker::DeliverTo`), not through `waiting`: its
//!   transfer and the consumer's `Receiving` copy are recorded when the
//!   order goes out, and its deadline is armed when the producer's reply
//!   comes (a long method is not a slow transfer). The reply names the
//!   orders carried out (`worker::peer`, PD-1); each other one is
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
//!   submit waits for the lock instead; session 39's OW-13 saw only
//!   that). Other waiters
//!   ([`Getter::Signal`]) are woken after the unlock, as before.
//!   `RDT_HAND_VALUES=0` wakes every getter after the unlock (a
//!   measurement knob).
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
//!   `RDT_LARGE_SENDS_IN_ORDER=0` turns it off.
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
use crate::protocol::{Delivery, Sender, ToWorker, WireValue};
use crate::transport::Transport;

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
pub(crate) enum Woken {
    Signal(oneshot::Sender<()>),
}

impl Woken {
    /// Wakes it (a getter that went away is no one's concern).
    pub(crate) fn wake(self) {
        match self {
            Woken::Signal(tx) => {
                let _ = tx.send(());
            }
        }
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
    /// Its tensor bytes and tensors, as the producer exported them.
    pub bytes: u64,
    pub tensors: u64,
    /// Its `transfer` span, from its start to its end (`outcome`).
    pub span: tracing::Span,
}

impl InFlight {
    /// OW-15: does this transfer hold back a large send to `consumer`
    /// for `call`? It does if it is large, to that consumer, and for
    /// another call (the transfers one call needs go together).
    fn holds_back(&self, consumer: ActorId, call: Option<u64>) -> bool {
        self.large && self.consumer == consumer && self.call != call
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
    pub conn: Option<Sender>,
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

/// Sends `msg` to `to` (OW-7). A closed connection is not an error here
/// (the reader reports the death); a message that cannot be encoded or is
/// too large for a frame is (OW-6).
fn send(actors: &Actors, to: ActorId, msg: &ToWorker) -> Result<(), Error> {
    match actors.get(&to).and_then(|a| a.conn.as_ref()) {
        Some(conn) => conn.send(msg),
        None => Ok(()),
    }
}

/// Sends a message that cannot be too large (frees, aborts, errors); a
/// failure can only be an encoding bug, so it is logged loudly.
fn send_small(actors: &Actors, to: ActorId, msg: &ToWorker) {
    if let Err(e) = send(actors, to, msg) {
        tracing::error!("could not send a control message to actor {to}: {e}");
    }
}

/// Sends a `Free` to `to`, with its next frame (`Sender::send_soon`):
/// nothing waits for it, and writing it now would put a system call on
/// the path of what the driver does next.
fn send_free(actors: &Actors, to: ActorId, object: u64) {
    let msg = ToWorker::Free { object };
    if let Some(conn) = actors.get(&to).and_then(|a| a.conn.as_ref()) {
        if let Err(e) = conn.send_soon(&msg) {
            tracing::error!("could not send a control message to actor {to}: {e}");
        }
    }
}

fn deliver_error(actors: &Actors, to: ActorId, object: u64, err: Error) {
    send_small(
        actors,
        to,
        &ToWorker::Deliver {
            object,
            value: Err(err),
        },
    );
}

/// The table.
#[derive(Default)]
pub(crate) struct OwnerTable {
    pub objects: HashMap<u64, Entry>,
    transfers: HashMap<u64, InFlight>,
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
    pub fn unhold(&mut self, ids: &[u64], actors: &Actors) {
        for &id in ids {
            self.dec(id, actors);
        }
    }

    /// A driver ref was cloned.
    pub fn inc(&mut self, id: u64) {
        if let Some(e) = self.objects.get_mut(&id) {
            e.refs += 1;
        }
    }

    /// A driver ref was dropped.
    pub fn dec(&mut self, id: u64, actors: &Actors) {
        if let Some(e) = self.objects.get_mut(&id) {
            e.refs = e.refs.saturating_sub(1);
        }
        self.maybe_free(id, actors);
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

    /// Takes `xfer` out of the transfers in flight, noting that it ended;
    /// the end of a large one sends the next held send to its consumer
    /// (OW-15).
    fn end_transfer(&mut self, xfer: u64, outcome: Outcome, actors: &Actors) -> Option<InFlight> {
        let t = self.transfers.remove(&xfer)?;
        self.ended.push(xfer);
        t.span.record("outcome", outcome.as_str());
        self.counts
            .transfer_ended(t.transport.name(), t.bytes, t.tensors, outcome);
        if t.large {
            self.send_next_held(t.consumer, actors);
        }
        Some(t)
    }

    /// OW-15: sends the held sends of `consumer`, oldest first, as long as
    /// no large transfer to it for another call is in flight with its send
    /// gone out: the next call's sends go together once the last one ahead
    /// ended. One aborted while held is dropped. A send that cannot go
    /// fails its transfer as in `start_direct` (OW-6); its end then sends
    /// the next.
    fn send_next_held(&mut self, consumer: ActorId, actors: &Actors) {
        if actors.get(&consumer).is_none_or(|a| a.dead.is_some()) {
            // Its transfers are being aborted: none of them is sent.
            self.held_sends.remove(&consumer);
            return;
        }
        let transfers = &self.transfers;
        let Some(queue) = self.held_sends.get_mut(&consumer) else {
            return;
        };
        while let Some(h) = queue.front() {
            let Some(t) = transfers.get(&h.xfer) else {
                queue.pop_front();
                continue;
            };
            let ahead = transfers.iter().any(|(x, o)| {
                o.holds_back(consumer, h.call) && !queue.iter().any(|q| q.xfer == *x)
            });
            if ahead {
                break;
            }
            rdt_transport::cuda::timeline("driver held send released", h.xfer);
            release_held(actors, h, consumer, t.object);
            queue.pop_front();
        }
        if queue.is_empty() {
            self.held_sends.remove(&consumer);
        }
    }

    /// OW-15: the held sends of transfers in `group`, which is being
    /// destroyed, go now. The members are told to leave it next, so each
    /// send reaches its producer ahead of that and its transfer ends as
    /// it would have without the hold (sent after the leave order, the
    /// send would find no group and its call would fail).
    pub fn send_held_in_group(&mut self, group: u64, actors: &Actors) {
        let transfers = &self.transfers;
        for (&consumer, queue) in self.held_sends.iter_mut() {
            queue.retain(|h| {
                let in_group = matches!(
                    &h.order,
                    ToWorker::SendTo { group: Some(g), .. } if g.id == group
                );
                if let (true, Some(t)) = (in_group, transfers.get(&h.xfer)) {
                    release_held(actors, h, consumer, t.object);
                }
                !in_group
            });
        }
        self.held_sends.retain(|_, q| !q.is_empty());
    }

    /// Whether `xfer`'s send is held (OW-15): its producer has not heard
    /// of it.
    fn send_is_held(&self, consumer: ActorId, xfer: u64) -> bool {
        self.held_sends
            .get(&consumer)
            .is_some_and(|q| q.iter().any(|h| h.xfer == xfer))
    }

    /// The transfer `xfer`, if it is still in flight.
    pub fn transfer(&self, xfer: u64) -> Option<&InFlight> {
        self.transfers.get(&xfer)
    }

    /// Number of transfers in flight (for tests and leak checks).
    pub fn transfers_in_flight(&self) -> usize {
        self.transfers.len()
    }

    /// Transfers in flight, and straight orders (OW-9) whose producer has
    /// not answered: the consumer may have finished with the value while
    /// the producer's reply, which makes the object ready and may free it,
    /// is still on its way.
    pub fn transfers_unsettled(&self) -> usize {
        self.transfers.len() + self.straight_orders
    }

    /// A submitted call to `consumer` takes object `id`; `call` is that
    /// call, where the caller knows it (OW-15 orders large transfers of
    /// different calls, not those of one call).
    pub fn need(
        &mut self,
        id: u64,
        consumer: ActorId,
        call: Option<u64>,
        actors: &Actors,
        groups: &dyn GroupLookup,
    ) {
        let Some(e) = self.objects.get_mut(&id) else {
            // Cannot happen while the caller holds a ref; be loud if it does.
            tracing::error!("a call needs object {id}, which the owner table no longer has");
            deliver_error(actors, consumer, id, Error::Freed { object: id });
            return;
        };
        *e.needs.entry(consumer).or_default() += 1;
        if matches!(e.state, ObjState::Pending) {
            if !self.order_straight(id, consumer, actors) {
                let e = self.objects.get_mut(&id).expect("looked up above");
                e.waiting.push((consumer, call));
            }
        } else {
            self.deliver(id, consumer, call, actors, groups);
        }
    }

    /// OW-12: may `consumer` drop its copy of `id` itself when the call
    /// just submitted ends? Yes if that call is its only need of the
    /// object and it did not produce it.
    pub fn releasable(&self, id: u64, consumer: ActorId) -> bool {
        self.objects
            .get(&id)
            .is_some_and(|e| e.producer != Some(consumer) && e.needs.get(&consumer) == Some(&1))
    }

    /// OW-9: asks the producer of pending object `id` to deliver it to
    /// `consumer` itself, if both are workers on this host that take
    /// such deliveries and the object's transport is one-sided. Returns
    /// whether the order went out.
    fn order_straight(&mut self, id: u64, consumer: ActorId, actors: &Actors) -> bool {
        let Some(e) = self.objects.get_mut(&id) else {
            return false;
        };
        let Some(producer) = e.producer else {
            return false;
        };
        // OW-3: a copy on its way (an earlier call's order) is enough.
        if producer == consumer
            || e.sidedness() == Sidedness::TwoSided
            || e.copies.contains_key(&consumer)
        {
            return false;
        }
        let path = match (actors.get(&producer), actors.get(&consumer)) {
            (Some(p), Some(c)) if p.dead.is_none() && c.dead.is_none() => {
                match (&p.peer_socket, &c.peer_socket) {
                    (Some(_), Some(path)) => path.clone(),
                    _ => return false,
                }
            }
            _ => return false,
        };
        self.next_xfer += 1;
        let xfer = self.next_xfer;
        let order = ToWorker::DeliverTo {
            object: id,
            xfer,
            to: crate::protocol::PeerSocket {
                actor: consumer,
                path,
            },
        };
        if send(actors, producer, &order).is_err() {
            return false;
        }
        rdt_transport::cuda::timeline("driver ordered straight delivery", xfer);
        e.copies.insert(consumer, Copy::Receiving(xfer));
        e.straight.push((consumer, xfer));
        self.straight_orders += 1;
        e.sent_elsewhere = true;
        self.transfers.insert(
            xfer,
            InFlight {
                object: id,
                producer: Some(producer),
                consumer,
                transport: e.transport,
                two_sided: false,
                large: false,
                call: None,
                bytes: e_bytes(e) as u64,
                tensors: e_tensors(e),
                span: transfer_span(xfer, id, e, Some(producer), consumer, actors, true),
            },
        );
        true
    }

    fn deliver(
        &mut self,
        id: u64,
        consumer: ActorId,
        call: Option<u64>,
        actors: &Actors,
        groups: &dyn GroupLookup,
    ) {
        let Some(e) = self.objects.get_mut(&id) else {
            return;
        };
        let sided = e.sidedness();
        let value = match &e.state {
            ObjState::Pending => return,
            ObjState::Failed(err) => {
                if let std::collections::hash_map::Entry::Vacant(v) = e.copies.entry(consumer) {
                    v.insert(Copy::Held);
                    deliver_error(actors, consumer, id, err.clone());
                }
                return;
            }
            ObjState::Ready(v) => match v.lost() {
                // Its bytes stopped arriving (its producer died while
                // sending them): the error, not a value with a hole.
                Some(err) => {
                    if let std::collections::hash_map::Entry::Vacant(v) = e.copies.entry(consumer) {
                        v.insert(Copy::Held);
                        deliver_error(actors, consumer, id, err);
                    }
                    return;
                }
                None => v.clone(),
            },
        };
        if sided != Sidedness::ThroughDriver && e.producer == Some(consumer) {
            // OW-3: the producer already holds the storage.
            e.passed_back = true;
        } else if let std::collections::hash_map::Entry::Vacant(copy) = e.copies.entry(consumer) {
            if sided == Sidedness::ThroughDriver {
                // The bytes travel in the delivery: nothing to acknowledge.
                copy.insert(Copy::Held);
                let msg = ToWorker::Deliver {
                    object: id,
                    value: Ok(Delivery {
                        value,
                        from: None,
                        xfer: 0,
                        group: None,
                        ack_at_landing: false,
                    }),
                };
                if let Err(err) = send(actors, consumer, &msg) {
                    deliver_error(actors, consumer, id, err); // OW-6
                }
            } else {
                e.sent_elsewhere = true;
                self.next_xfer += 1;
                let xfer = self.next_xfer;
                // OW-15: behind a large transfer to the same consumer for
                // another call, a large one's send waits (those of one call
                // are all needed at once: they go together).
                let large = sided == Sidedness::TwoSided
                    && value.exported.nbytes() >= self.large_transfer_bytes.0;
                let behind = large
                    && self
                        .transfers
                        .values()
                        .any(|t| t.holds_back(consumer, call));
                let e = self.objects.get_mut(&id).expect("looked up above");
                let mut held = None;
                let started = start_direct(
                    e,
                    id,
                    xfer,
                    consumer,
                    value,
                    actors,
                    groups,
                    (large, behind, call),
                    &mut held,
                );
                if let Some((producer, deliver, order)) = held {
                    self.sends_held += 1;
                    self.held_sends
                        .entry(consumer)
                        .or_default()
                        .push_back(HeldSend {
                            xfer,
                            call,
                            producer,
                            deliver,
                            order,
                        });
                }
                self.transfers.extend(started);
                if self.transfers.contains_key(&xfer) {
                    self.started.push(xfer);
                }
                rdt_transport::cuda::timeline("driver transfer noted", xfer);
            }
        }
        let e = self.objects.get_mut(&id).expect("looked up above");
        if e.passed_back && e.sent_elsewhere && !e.warned {
            e.warned = true;
            tracing::warn!(
                object = id,
                "object {id} was passed back to its producer and also sent to another actor; \
                 tensors are mutable and shared, so a write by the producer may be seen by \
                 readers of the other copies, or not: clone the tensors if you need isolation"
            );
        }
    }

    /// A call finished: record its result and release its arguments
    /// (see [`CallEnd`]).
    pub fn call_done(
        &mut self,
        result: u64,
        ended: CallEnd<'_>,
        consumer: ActorId,
        args: &[u64],
        actors: &Actors,
        groups: &dyn GroupLookup,
    ) {
        let CallEnd {
            outcome,
            resolved,
            delivered,
            released,
        } = ended;
        if let Some(e) = self.objects.get_mut(&result) {
            if matches!(e.state, ObjState::Pending) {
                e.state = match outcome {
                    Ok(v) => {
                        e.transport = v.transport;
                        e.nested = v.refs.clone();
                        ObjState::Ready(v)
                    }
                    Err(err) => ObjState::Failed(err),
                };
                // OW-14: a getter handed the value needs no lock to go
                // on; woken now, it runs while this thread settles the
                // call's transfers and releases its arguments below.
                // One that looks the value up waits for the unlock.
                // Cloned only for those waiting: most replies have none.
                let settled = || e.state.settled().expect("set above");
                for g in std::mem::take(&mut e.getters) {
                    match g {
                        Getter::Value(tx) => {
                            self.handed_values += 1;
                            let _ = tx.send(settled());
                        }
                        Getter::Signal(tx) => self.woken.push(Woken::Signal(tx)),
                    }
                }
                let nested = e.nested.clone();
                let waiting = std::mem::take(&mut e.waiting);
                let straight = std::mem::take(&mut e.straight);
                self.hold(&nested);
                // OW-9: the orders carried out run against their deadline
                // from now; the others are withdrawn, and the driver
                // delivers as for a consumer that waited.
                // Each order answered wakes those waiting for transfers to
                // settle (`ended`; `end_transfer` notes the withdrawn ones).
                self.straight_orders -= straight.len();
                for (c, xfer) in straight {
                    if !self.transfers.contains_key(&xfer) {
                        // Acknowledged already, or aborted (the consumer
                        // died): nothing left to do.
                        self.ended.push(xfer);
                        continue;
                    }
                    if delivered.contains(&xfer) {
                        self.started.push(xfer);
                        self.ended.push(xfer);
                        continue;
                    }
                    self.end_transfer(xfer, Outcome::NotSent, actors);
                    let e = self.objects.get_mut(&result).expect("looked up above");
                    if e.copies.get(&c) == Some(&Copy::Receiving(xfer)) {
                        e.copies.remove(&c);
                    }
                    if e.needs.contains_key(&c) {
                        self.deliver(result, c, None, actors, groups);
                    }
                }
                for (c, call) in waiting {
                    self.deliver(result, c, call, actors, groups);
                }
            }
        }
        rdt_transport::cuda::timeline("driver call result stored", result);
        // XF-5: a call that got past argument resolution received every
        // argument; its receives are settled now, without waiting for their
        // acknowledgements (which follow on the same connection). The
        // consumer still needs each argument here, so settling frees
        // nothing yet: the loop below does.
        if resolved {
            for &a in args {
                let copy = self
                    .objects
                    .get(&a)
                    .and_then(|e| e.copies.get(&consumer).copied());
                if let Some(Copy::Receiving(xfer)) = copy {
                    if let Some(t) = self.end_transfer(xfer, Outcome::Done, actors) {
                        self.settle(&t, actors);
                    }
                }
            }
        }
        rdt_transport::cuda::timeline("driver call receives settled", result);
        // OW-12: those copies are gone from the consumer's store already.
        let released: Vec<u64> = if resolved {
            released
                .iter()
                .copied()
                .filter(|a| args.contains(a))
                .collect()
        } else {
            Vec::new()
        };
        for &a in &released {
            let copy = self
                .objects
                .get_mut(&a)
                .and_then(|e| e.copies.remove(&consumer));
            if let Some(Copy::Receiving(xfer)) = copy {
                // Received (the call ran with it): settled with it.
                self.end_transfer(xfer, Outcome::Done, actors);
            }
            self.released_by_callees += u64::from(copy.is_some());
        }
        self.unneed(args, consumer, actors);
        rdt_transport::cuda::timeline("driver call arguments released", result);
        // A call submitted since still needs a released copy: it goes again.
        for &a in &released {
            let again = self.objects.get(&a).is_some_and(|e| {
                e.needs.contains_key(&consumer) && !e.copies.contains_key(&consumer)
            });
            if !again {
                continue;
            }
            self.delivered_again += 1;
            let e = self.objects.get_mut(&a).expect("looked up above");
            if matches!(e.state, ObjState::Pending) {
                // Received straight from its producer, whose reply has
                // not come: delivered with the waiting ones (OW-4).
                if !e.waiting.iter().any(|(c, _)| *c == consumer) {
                    e.waiting.push((consumer, None));
                }
            } else {
                self.deliver(a, consumer, None, actors, groups);
            }
        }
        self.maybe_free(result, actors);
    }

    /// `consumer` no longer needs `args` (its call or get ended): each
    /// copy it no longer needs goes (OW-2), each object nothing needs is
    /// freed (OW-1).
    pub fn unneed(&mut self, args: &[u64], consumer: ActorId, actors: &Actors) {
        for &a in args {
            if let Some(e) = self.objects.get_mut(&a) {
                if let Some(n) = e.needs.get_mut(&consumer) {
                    *n -= 1;
                    if *n == 0 {
                        e.needs.remove(&consumer);
                        release_copy(e, a, consumer, actors);
                    }
                }
            }
            self.maybe_free(a, actors);
        }
    }

    /// The consumer acknowledged transfer `xfer` (done or failed). Returns
    /// the transfer, if it was still in flight.
    pub fn received(
        &mut self,
        xfer: u64,
        from: ActorId,
        result: &Result<(), Error>,
        actors: &Actors,
        groups: &dyn GroupLookup,
    ) -> Option<InFlight> {
        let Some(t) = self.transfers.get(&xfer) else {
            // Aborted before the ack: the copy is already `Held` (an
            // `AbortTransfer` crossed a finished receive) and is freed with
            // the rest; nothing to do.
            return None;
        };
        if t.consumer != from {
            tracing::warn!("actor {from} acknowledged transfer {xfer}, which is not its own");
            return None;
        }
        // A producer whose send is still held never heard of it (OW-15).
        let held = self.send_is_held(from, xfer);
        let outcome = if result.is_ok() {
            Outcome::Done
        } else {
            Outcome::Failed
        };
        let t = self
            .end_transfer(xfer, outcome, actors)
            .expect("looked up above");
        // TG-4: a receive its getter gave up stored nothing either.
        let cancelled = matches!(result, Err(Error::Cancelled { .. }));
        if result.is_err() && self.deliver_again(&t, cancelled, actors, groups) {
            return Some(t);
        }
        if let (Err(e), true, Some(p), false) = (result, t.two_sided, t.producer, held) {
            // The producer may still be sending into a receive that gave up.
            send_small(
                actors,
                p,
                &ToWorker::AbortTransfer {
                    object: t.object,
                    xfer,
                    error: e.clone(),
                },
            );
        }
        self.settle(&t, actors);
        Some(t)
    }

    /// OW-11: a value through the driver that went straight to a consumer
    /// and did not arrive whole there (the consumer stored nothing) goes
    /// again from the driver's own copy, or as the error that copy holds,
    /// if the consumer still needs it; while the object is still pending,
    /// the consumer waits for it with the others (OW-4). Returns whether
    /// it did either.
    ///
    /// The same for a receive of any transport that its getter gave up
    /// (`cancelled`, TG-4): the consumer stored nothing.
    fn deliver_again(
        &mut self,
        t: &InFlight,
        cancelled: bool,
        actors: &Actors,
        groups: &dyn GroupLookup,
    ) -> bool {
        let Some(e) = self.objects.get_mut(&t.object) else {
            return false;
        };
        if matches!(e.state, ObjState::Pending) {
            // Before its producer's reply (or death) reached the driver:
            // the consumer stored nothing, and waits with the others for
            // the value or its error (OW-4). Not settled: no copy is held.
            e.copies.remove(&t.consumer);
            if e.needs.contains_key(&t.consumer) && !e.waiting.iter().any(|(c, _)| *c == t.consumer)
            {
                e.waiting.push((t.consumer, t.call));
            }
            return true;
        }
        if e.sidedness() != Sidedness::ThroughDriver && !cancelled {
            return false;
        }
        e.copies.remove(&t.consumer);
        if e.needs.contains_key(&t.consumer) {
            self.deliver(t.object, t.consumer, None, actors, groups);
        } else {
            self.maybe_free(t.object, actors);
        }
        true
    }

    /// The producer's send of `xfer` failed: the consumer's receive is
    /// aborted with that error (it acknowledges, which settles the copy).
    pub fn send_failed(&mut self, xfer: u64, error: Error, actors: &Actors) -> Option<InFlight> {
        let t = self.transfers.get(&xfer)?.clone();
        send_small(
            actors,
            t.consumer,
            &ToWorker::AbortTransfer {
                object: t.object,
                xfer,
                error,
            },
        );
        Some(t)
    }

    /// `xfer`'s deadline passed (or an end of it died): both ends are told
    /// to stop, and the copy is settled now, without waiting for an ack
    /// that may never come.
    pub fn abort(&mut self, xfer: u64, error: Error, actors: &Actors) -> Option<InFlight> {
        // A producer whose send is still held never heard of it (OW-15).
        let held = self
            .transfers
            .get(&xfer)
            .is_some_and(|t| self.send_is_held(t.consumer, xfer));
        let t = self.end_transfer(xfer, Outcome::Aborted, actors)?;
        if held {
            // Neither end heard of it (OW-15): the consumer, whose call
            // may wait for it, gets the error as the value.
            deliver_error(actors, t.consumer, t.object, error);
        } else {
            let msg = ToWorker::AbortTransfer {
                object: t.object,
                xfer,
                error,
            };
            send_small(actors, t.consumer, &msg);
            if let (true, Some(p)) = (t.two_sided, t.producer) {
                send_small(actors, p, &msg);
            }
        }
        self.settle(&t, actors);
        Some(t)
    }

    /// A receive ended (acknowledged or aborted): the copy is held (value
    /// or error in the consumer's store) and follows OW-1/OW-2 from here.
    fn settle(&mut self, t: &InFlight, actors: &Actors) {
        if let Some(e) = self.objects.get_mut(&t.object) {
            if let Some(c) = e.copies.get_mut(&t.consumer) {
                *c = Copy::Held;
            }
            if !e.needs.contains_key(&t.consumer) {
                release_copy(e, t.object, t.consumer, actors);
            }
        }
        self.maybe_free(t.object, actors);
    }

    fn maybe_free(&mut self, id: u64, actors: &Actors) {
        // CL-2: freeing an object gives back the counts its value held,
        // which may free more; a worklist, not recursion (a long chain of
        // nested values must not overflow the stack).
        let mut check = vec![id];
        while let Some(id) = check.pop() {
            let free = match self.objects.get(&id) {
                Some(e) => {
                    e.refs == 0
                        && e.needs.is_empty()
                        && !e.receiving()
                        && !matches!(e.state, ObjState::Pending)
                }
                None => false,
            };
            if !free {
                continue;
            }
            let mut e = self.objects.remove(&id).expect("checked above");
            self.freed_held.extend(e.held.take());
            let direct =
                e.sidedness() != Sidedness::ThroughDriver && matches!(e.state, ObjState::Ready(_));
            if direct {
                if let Some(p) = e.producer {
                    send_free(actors, p, id);
                }
            }
            for (h, _) in e.copies {
                if Some(h) != e.producer || !direct {
                    send_free(actors, h, id);
                }
            }
            for n in e.nested {
                if let Some(inner) = self.objects.get_mut(&n) {
                    inner.refs = inner.refs.saturating_sub(1);
                    check.push(n);
                }
            }
        }
    }

    /// OW-5.
    pub fn actor_died(&mut self, actor: ActorId, err: &Error, actors: &Actors) {
        // Transfers with the dead actor at either end; except a value
        // through the driver that its dead producer delivered straight
        // (it keeps its copy, OW-11): the consumer's receive ends by
        // itself (the link closed with the producer), and a failed one is
        // delivered again from the driver's copy.
        let objects = &self.objects;
        let kept_by_driver = |t: &InFlight| {
            objects.get(&t.object).is_some_and(|e| {
                e.sidedness() == Sidedness::ThroughDriver
                    && matches!(&e.state, ObjState::Ready(v) if v.lost().is_none())
            })
        };
        let ended: Vec<u64> = self
            .transfers
            .iter()
            .filter(|(_, t)| {
                t.consumer == actor || (t.producer == Some(actor) && !kept_by_driver(t))
            })
            .map(|(x, _)| *x)
            .collect();
        for xfer in ended {
            self.abort(xfer, err.clone(), actors);
        }
        let ids: Vec<u64> = self.objects.keys().copied().collect();
        for id in ids {
            let e = self.objects.get_mut(&id).expect("listed above");
            // A dead consumer holds nothing any more.
            e.copies.remove(&actor);
            if e.producer == Some(actor)
                && matches!(e.state, ObjState::Ready(_))
                && e.sidedness() != Sidedness::ThroughDriver
            {
                e.state = ObjState::Failed(err.clone());
                // Holders whose call still waits see the death (a store
                // never replaces received data by a late error).
                for (&h, _) in e.copies.iter() {
                    deliver_error(actors, h, id, err.clone());
                }
            }
            self.maybe_free(id, actors);
        }
    }

    /// Number of live entries (for tests and soak checks).
    pub fn len(&self) -> usize {
        self.objects.len()
    }
}

/// OW-2: `consumer` no longer needs its copy of `id`; once its receive is
/// acknowledged, it drops it.
fn release_copy(e: &mut Entry, id: u64, consumer: ActorId, actors: &Actors) {
    if e.copies.get(&consumer) == Some(&Copy::Held) && e.producer != Some(consumer) {
        e.copies.remove(&consumer);
        send_free(actors, consumer, id);
    }
}

/// Sends the orders of a direct transfer of `e` to `consumer` as `xfer`
/// (the delivery first, then the send order for two-sided transports),
/// recording the copy. Returns the transfer to track, or `None` when it
/// could not start (the consumer then got the error instead: OW-6).
/// `large`: (the transfer is large, OW-15; a large one to the consumer
/// for another call is in flight: then the producer's order is left in
/// `held` instead of sent; the call it is for).
#[allow(clippy::too_many_arguments)]
fn start_direct(
    e: &mut Entry,
    id: u64,
    xfer: u64,
    consumer: ActorId,
    value: WireValue,
    actors: &Actors,
    groups: &dyn GroupLookup,
    (large, behind, call): (bool, bool, Option<u64>),
    held: &mut Option<(ActorId, ToWorker, ToWorker)>,
) -> Option<(u64, InFlight)> {
    let sided = e.sidedness();
    let producer = e
        .producer
        .and_then(|p| actors.get(&p).map(|a| a.peer(p, e.transport.name())));
    // The consumer ends up holding either the value or an error.
    e.copies.insert(consumer, Copy::Held);
    if let (Some(p), Some(c)) = (&producer, actors.get(&consumer)) {
        // One-sided same-host transports: refuse another host before
        // anything moves, naming both ends.
        let same_host_only = e.transport.same_host_only();
        if same_host_only && !p.host.is_empty() && !c.host.is_empty() && p.host != c.host {
            let err = Error::Transport(rdt_transport::TransportError::with_peer(
                e.transport.name(),
                p,
                format!(
                    "{} moves tensors only between actors on one host; {} is on {} and {} on {}: use tcp (in a collective group) or object_store",
                    e.transport, p.name, p.host, c.name, c.host
                ),
            ));
            deliver_error(actors, consumer, id, err);
            return None;
        }
    }
    let two_sided = sided == Sidedness::TwoSided;
    // OW-8: the group is looked up now, not only at submission.
    let group = match e.producer {
        Some(p) => match groups.group_for(e.transport.name(), id, p, consumer) {
            Ok(g) => g,
            Err(err) => {
                deliver_error(actors, consumer, id, err);
                return None;
            }
        },
        None => None,
    };
    // The consumer's frame first: of the two ends of a two-sided transfer
    // its receive is the one that starts later (it frees, decodes and
    // allocates before it posts), and each end is written in the order
    // its connection was first used under the lock. Frames on different
    // connections have no order to keep.
    rdt_transport::cuda::timeline("driver deliver", xfer);
    let msg = ToWorker::Deliver {
        object: id,
        value: Ok(Delivery {
            value,
            from: producer,
            xfer,
            group: group.map(|(g, prank, crank)| GroupRef {
                id: g,
                my_rank: crank,
                peer_rank: prank,
            }),
            ack_at_landing: large,
        }),
    };
    let order = match (two_sided, e.producer, actors.get(&consumer)) {
        (true, Some(p), Some(c)) => Some((
            p,
            ToWorker::SendTo {
                object: id,
                xfer,
                to: c.peer(consumer, e.transport.name()),
                group: group.map(|(g, prank, crank)| GroupRef {
                    id: g,
                    my_rank: prank,
                    peer_rank: crank,
                }),
            },
        )),
        _ => None,
    };
    match order {
        // OW-15: held, both ends at once (XF-3: every member's queue keeps
        // the driver's order, so no two transfers wait on each other).
        Some((p, order)) if behind => *held = Some((p, msg, order)),
        order => {
            let sent = send(actors, consumer, &msg);
            rdt_transport::cuda::timeline("driver deliver queued", xfer);
            if let Err(err) = sent {
                deliver_error(actors, consumer, id, err); // OW-6
                return None;
            }
            if let Some((p, order)) = order {
                if !send_or_abort(actors, p, &order, consumer, id, xfer) {
                    // OW-6: its failed acknowledgement finds no transfer
                    // (none is tracked), and the consumer holds the error.
                    return None;
                }
            }
        }
    }
    e.copies.insert(consumer, Copy::Receiving(xfer));
    tracing::debug!(
        xfer,
        object = id,
        transport = %e.transport,
        producer = ?e.producer,
        consumer,
        bytes = e_bytes(e),
        "transfer started"
    );
    Some((
        xfer,
        InFlight {
            object: id,
            producer: e.producer,
            consumer,
            transport: e.transport,
            two_sided,
            large,
            call,
            bytes: e_bytes(e) as u64,
            tensors: e_tensors(e),
            span: transfer_span(xfer, id, e, e.producer, consumer, actors, false),
        },
    ))
}

/// OW-15: a held transfer goes, both ends together: the consumer's
/// delivery, then its producer's send. A delivery that cannot go leaves
/// the consumer the error (OW-6), and the send is not made; the transfer
/// ends at its deadline.
fn release_held(actors: &Actors, h: &HeldSend, consumer: ActorId, object: u64) {
    if let Err(err) = send(actors, consumer, &h.deliver) {
        deliver_error(actors, consumer, object, err);
        return;
    }
    send_or_abort(actors, h.producer, &h.order, consumer, object, h.xfer);
}

/// Sends a two-sided transfer's `order` to its `producer`; if it cannot go,
/// the receive of `object` the consumer was delivered stops with the error
/// instead (OW-6). Returns whether it went.
fn send_or_abort(
    actors: &Actors,
    producer: ActorId,
    order: &ToWorker,
    consumer: ActorId,
    object: u64,
    xfer: u64,
) -> bool {
    match send(actors, producer, order) {
        Ok(()) => true,
        Err(error) => {
            send_small(
                actors,
                consumer,
                &ToWorker::AbortTransfer {
                    object,
                    xfer,
                    error,
                },
            );
            false
        }
    }
}

fn e_bytes(e: &Entry) -> usize {
    match &e.state {
        ObjState::Ready(v) => v.exported.nbytes(),
        _ => 0,
    }
}

/// The tensors of an entry's value, where its metadata is here.
fn e_tensors(e: &Entry) -> u64 {
    match &e.state {
        ObjState::Ready(v) => v.exported.get().map_or(0, |x| x.metas.len() as u64),
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

/// A transfer's span in the driver, from its start to its end, where its
/// `outcome` is recorded (the field vocabulary of the book's
/// Observability section).
fn transfer_span(
    xfer: u64,
    object: u64,
    e: &Entry,
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
        transport = e.transport.name(),
        bytes = e_bytes(e),
        tensors = e_tensors(e),
        producer = %name(producer),
        consumer = %name(Some(consumer)),
        straight,
        outcome = tracing::field::Empty,
    )
}
