//! The [`TensorTransport`] trait: the contract between the framework and a
//! transport.
//!
//! The framework decides *when* tensors move and between *whom*; a transport
//! decides *how*. A transport never sees actors, refs or the owner table:
//! it sees an object key, tensors, peers and transfer ids.
//!
//! # The contract
//! 1. **Export (producer, every transport).** When a method returns a value
//!    whose ref uses this transport, the producer calls [`export`] once with
//!    the value's tensors. The returned [`Exported`] travels to the driver in
//!    the call's result and from there to every consumer. It holds the
//!    tensors' metadata, and:
//!    - for [`Sidedness::ThroughDriver`] transports (the object store), the
//!      tensor bytes themselves ([`Exported::inline`]): the producer keeps
//!      nothing;
//!    - for [`Sidedness::OneSided`] transports (`shm`, CUDA IPC, NIXL),
//!      opaque handles ([`Exported::handles`]) that let a consumer pull the
//!      bytes without the producer's participation;
//!    - for [`Sidedness::TwoSided`] transports (`tcp`, NCCL), metadata only.
//!
//!    Except for through-driver transports the producer keeps the tensors in
//!    its local store until the object is freed.
//! 2. **Move (consumer, and producer for two-sided).** When a ref reaches a
//!    consumer, the driver orders the move:
//!    - two-sided: the producer gets a send order ([`send`]) and the
//!      consumer a receive order ([`receive`]) carrying the same
//!      [`TransferId`]; both ends post, in the order the driver issued the
//!      orders, so a transport may pair them by id or by order;
//!    - one-sided and through-driver: only the consumer acts ([`receive`]),
//!      using what [`export`] published.
//!
//!    [`receive`] returns the tensors in the order of `exported.metas`; it
//!    must check that what arrived matches the metadata.
//! 3. **Release (producer).** When the owner table frees the object, the
//!    producer drops its tensors and calls [`release`] with the key, after
//!    which the transport may reclaim exported resources. A one-sided
//!    transport must not reclaim memory that a consumer still maps: the
//!    consumer's tensors keep their mapping alive and release it on drop.
//! 4. **Errors** name the transport and, where there is one, the peer
//!    ([`TransportError`]). A transport that cannot serve a device says so in
//!    [`check_device`] before anything is exported.
//! 5. **No blocking.** Every operation is async and completes on socket I/O,
//!    a CUDA event or a library's status: never by blocking an executor
//!    thread for the transfer's duration.
//! 6. **Peers and groups.** [`peer_gone`] tells a transport that an actor
//!    died (drop its connections and caches). Collective transports get
//!    [`create_group`], [`destroy_group`] and [`abort_group`] with the
//!    members by rank ([`GroupSpec`]); every transfer in a group carries
//!    its [`GroupRef`] in the [`TransferCtx`], and the framework runs a
//!    group's transfers one after the other, in the driver's order, on a
//!    thread of the group's own. The framework owns each transfer's
//!    deadline and aborts a transfer by dropping its future.
//! 7. **Targets.** A receive puts the tensors where [`TransferCtx::target`]
//!    says: anywhere, or into given tensors (receive in place).
//!
//! A transport registers itself in its own module with
//! [`register_transport!`](crate::register_transport) (see
//! [`crate::registry`]); nothing else names it.
//! 6. **Peer death.** When an actor dies or is killed, the framework calls
//!    [`peer_gone`] with its id in every process; the transport drops what
//!    it keeps for that peer, so that nothing it keeps per peer outlives
//!    the peer.
//!
//! [`export`]: TensorTransport::export
//! [`send`]: TensorTransport::send
//! [`receive`]: TensorTransport::receive
//! [`release`]: TensorTransport::release
//! [`check_device`]: TensorTransport::check_device
//! [`peer_gone`]: TensorTransport::peer_gone
//! [`create_group`]: TensorTransport::create_group
//! [`destroy_group`]: TensorTransport::destroy_group
//! [`abort_group`]: TensorTransport::abort_group
//! [`peer_gone`]: TensorTransport::peer_gone

use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};

use std::sync::Arc;

use crate::{device::Device, tensor::Tensor, tensor::TensorMeta, wire::Blob};

/// Identifies an object in the producer's store (the framework's object id).
pub type ObjectKey = u64;
/// Pairs the two ends of one two-sided transfer.
pub type TransferId = u64;

/// Who acts in a move (see the module contract, point 2).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Sidedness {
    /// The bytes travel with the metadata, through the driver.
    ThroughDriver,
    /// Producer sends while consumer receives (tcp, NCCL).
    TwoSided,
    /// The consumer pulls with handles the producer published (shm, CUDA
    /// IPC, NIXL).
    OneSided,
}

/// What a producer publishes about an object's tensors.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Exported {
    /// One entry per tensor (on the wire as columns: `metas_wire`).
    #[serde(with = "crate::metas_wire")]
    pub metas: Vec<TensorMeta>,
    /// Transport-specific handles (one-sided transports). On the wire as
    /// one run of bytes, not a sequence of numbers: tens of kilobytes for
    /// an object of thousands of tensors.
    #[serde(with = "serde_bytes")]
    pub handles: Vec<u8>,
    /// Tensor bytes (through-driver transports): one blob per tensor, or,
    /// where `handles` says so, chunks that several small tensors share
    /// (`object_store`).
    pub inline: Vec<Blob>,
}

impl Exported {
    /// Total tensor bytes described.
    pub fn nbytes(&self) -> usize {
        self.metas
            .iter()
            .fold(0usize, |a, m| a.saturating_add(m.nbytes()))
    }

    /// Waits until every inline blob is here (a receiver may hand the
    /// value on while they still arrive: [`crate::wire::arriving`]); the first
    /// one lost, if any.
    pub async fn arrived(&self) -> Result<(), crate::wire::arriving::ArriveError> {
        for b in &self.inline {
            b.arrived().await?;
        }
        Ok(())
    }

    /// Are all inline blobs here (or lost) already?
    pub fn all_here(&self) -> bool {
        self.inline.iter().all(|b| b.still_arriving().is_none())
    }
}

/// A collective group as a member sees it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSpec {
    /// The group's id (the framework's `GroupId`).
    pub id: u64,
    /// The members, by rank.
    pub ranks: Vec<Peer>,
    /// This process's rank.
    pub my_rank: u32,
    /// What rank 0 made for every member to join with
    /// ([`TensorTransport::group_bootstrap`]: NCCL's unique id); empty
    /// for transports that need nothing.
    pub bootstrap: Vec<u8>,
}

/// The group a two-sided transfer runs in, and the ranks of its ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupRef {
    /// The group's id.
    pub id: u64,
    /// This process's rank in it.
    pub my_rank: u32,
    /// The other end's rank in it.
    pub peer_rank: u32,
}

/// Where a receive puts the tensors (contract point 7).
#[derive(Clone, Debug, Default)]
pub enum Target {
    /// Wherever the transport chooses (its own memory, the producer's
    /// device for one-sided zero-copy transports).
    #[default]
    Any,
    /// Into these tensors, one per received tensor, in metadata order:
    /// the receiver's memory does not grow. Shared, not cloned: a
    /// receive that puts the bytes there returns this very list
    /// ([`TensorList::shared`](crate::TensorList::shared)).
    Tensors(Arc<[Tensor]>),
    /// Onto this process's CUDA device (ordinal), whatever device the
    /// producer's tensors were on; CPU tensors stay on the CPU.
    Device(usize),
    /// Into this process's host memory, whatever device the producer's
    /// tensors were on.
    Host,
}

impl Target {
    /// Puts `received` where the target says: as it is for [`Target::Any`],
    /// copied onto the device for [`Target::Device`], copied into the
    /// target tensors (after checking they match `expected`) for
    /// [`Target::Tensors`], returning those.
    pub fn place(
        &self,
        transport: &str,
        expected: &[TensorMeta],
        received: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, TransportError> {
        match self {
            Target::Any => Ok(received),
            Target::Host => place_all(transport, crate::place::Place::Host, received),
            Target::Device(ordinal) => place_all(
                transport,
                crate::place::Place::Cuda(*ordinal as u32),
                received,
            ),
            Target::Tensors(targets) => {
                check_received(transport, expected, targets).map_err(|e| {
                    TransportError::new(transport, format!("target tensors: {}", e.message))
                })?;
                for (t, r) in targets.iter().zip(&received) {
                    t.copy_from(r).map_err(|e| {
                        TransportError::new(transport, format!("copy into the target: {e}"))
                    })?;
                }
                Ok(targets.to_vec())
            }
        }
    }
}

impl From<crate::place::Place> for Target {
    fn from(p: crate::place::Place) -> Self {
        match p {
            crate::place::Place::Host => Target::Host,
            crate::place::Place::Cuda(o) => Target::Device(o as usize),
        }
    }
}

/// `received`, each tensor put in `place` ([`Place::put`](crate::place::Place::put)).
fn place_all(
    transport: &str,
    place: crate::place::Place,
    received: Vec<Tensor>,
) -> Result<Vec<Tensor>, TransportError> {
    place
        .put_all(received)
        .map_err(|e| TransportError::new(transport, format!("copy to {place}: {e}")))
}

/// What the framework tells a transport about one transfer.
#[derive(Clone, Debug, Default)]
pub struct TransferCtx {
    /// Pairs the two ends of a two-sided transfer.
    pub xfer: TransferId,
    /// The collective group it runs in (two-sided transports in a group).
    pub group: Option<GroupRef>,
    /// Where the receive puts the tensors.
    pub target: Target,
    /// Names the exact metadata and handles of the receive's
    /// [`Exported`], where the framework knows them: two receives with
    /// the same `layout` got byte-identical `metas` and `handles` (an id
    /// is never reused within a process). A transport may key what it
    /// works out once per layout on it instead of comparing the content
    /// (`nixl`'s read plans: the metadata of 10 000 tensors is 1.6 MB to
    /// compare). `None`: unknown.
    pub layout: Option<u64>,
    /// A thread waiting to read the received tensors, where the framework
    /// knows one (a call on an actor's thread that takes the object as an
    /// argument). A receive that makes its tensors while its bytes move
    /// ([`TensorList::premake`](crate::TensorList::premake)) offers the
    /// list to it first, as early as it can: the reader makes them on its
    /// own thread, where they are used next. `None`: nobody waits; the
    /// receive makes them.
    pub first_reader: Option<FirstReader>,
    /// For a receive into [`Target::Tensors`]: closed when the receiver
    /// stops waiting (a dropped `get_into`), after which the receive no
    /// longer writes into the targets. A transport that copies into the
    /// targets does so through [`TransferCtx::place`], which holds it
    /// open for the copy. `None`: the targets are wanted to the end.
    pub gate: Option<Arc<TargetGate>>,
}

/// Whether a receive may still write into its target tensors (see
/// [`TransferCtx::gate`]).
///
/// Closing it waits for a copy into the targets under way and keeps any
/// later one out: once [`close`](Self::close) returns, no copy through
/// [`TransferCtx::place`] writes into the targets.
///
/// A transport that writes into the targets itself as bytes come (a
/// one-sided READ posted into them) holds a [`Writing`] from
/// [`writing`](Self::writing) for as long as its writes may land, past
/// the receive future's drop where the transport finishes or cancels
/// them later: [`TargetWriters::idle`] waits for it.
#[derive(Debug)]
pub struct TargetGate {
    open: parking_lot::Mutex<bool>,
    writers: Arc<TargetWriters>,
}

impl Default for TargetGate {
    fn default() -> Self {
        TargetGate::new(Arc::default())
    }
}

impl TargetGate {
    /// An open gate whose writers count in `writers` (the target list's).
    pub fn new(writers: Arc<TargetWriters>) -> TargetGate {
        TargetGate {
            open: parking_lot::Mutex::new(true),
            writers,
        }
    }

    /// Counts a writer of the targets until the guard drops.
    pub fn writing(&self) -> Writing {
        Writing::new(self.writers.clone())
    }

    /// Nothing is written into the targets from now on.
    pub fn close(&self) {
        *self.open.lock() = false;
    }

    /// Whether it is still open.
    pub fn is_open(&self) -> bool {
        *self.open.lock()
    }
}

/// The receives that may still write into a list of target tensors (see
/// [`TargetGate::writing`]).
#[derive(Debug)]
pub struct TargetWriters(tokio::sync::watch::Sender<usize>);

impl Default for TargetWriters {
    fn default() -> Self {
        TargetWriters(tokio::sync::watch::Sender::new(0))
    }
}

impl TargetWriters {
    /// Waits until no receive writes into the targets.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only waits.
    pub async fn idle(&self) {
        let mut rx = self.0.subscribe();
        // The sender lives in `self`: the wait ends only by the count.
        let _ = rx.wait_for(|n| *n == 0).await;
    }
}

/// A writer of target tensors, counted in its [`TargetWriters`] until it
/// drops.
#[derive(Debug)]
pub struct Writing(Arc<TargetWriters>);

impl Writing {
    fn new(writers: Arc<TargetWriters>) -> Writing {
        writers.0.send_modify(|n| *n += 1);
        Writing(writers)
    }
}

impl Drop for Writing {
    fn drop(&mut self) {
        self.0 .0.send_modify(|n| *n -= 1);
    }
}

impl TransferCtx {
    /// [`Target::place`], through the [`gate`](Self::gate): received
    /// tensors are copied into target tensors only while the gate is
    /// open, and the gate stays open until the copy ends. A closed gate
    /// places them as [`Target::Any`] would (the received tensors as they
    /// are).
    pub fn place(
        &self,
        transport: &str,
        expected: &[TensorMeta],
        received: Vec<Tensor>,
    ) -> Result<Vec<Tensor>, TransportError> {
        match (&self.target, &self.gate) {
            (Target::Tensors(_), Some(gate)) => {
                let open = gate.open.lock();
                if !*open {
                    return Ok(received);
                }
                let placed = self.target.place(transport, expected, received);
                drop(open);
                placed
            }
            _ => self.target.place(transport, expected, received),
        }
    }
}

/// A thread waiting to read a receive's tensors (see
/// [`TransferCtx::first_reader`]).
///
/// Made on the thread that uses them, the tensors stay in its cache: a
/// list of 10 000 tensors is 640 KB of handles, and one made on another
/// core is read back one cache-line transfer at a time when the method
/// walks it, then written across cores again when the next receive
/// recycles the memory (on the H200 hosts, making 10 000 views took
/// 275–550 µs on a runtime thread, two to four times the work).
#[derive(Clone)]
pub struct FirstReader(Arc<dyn Fn(&crate::tensor::TensorList) -> bool + Send + Sync>);

impl FirstReader {
    /// A reader that `take`s a list offered to it: true if it will read
    /// it (and make its tensors), false if it is gone.
    pub fn new(take: impl Fn(&crate::tensor::TensorList) -> bool + Send + Sync + 'static) -> Self {
        FirstReader(Arc::new(take))
    }

    /// Offers `list` (a clone of it: the same list) to the reader; true
    /// if it took it.
    pub fn offer(&self, list: &crate::tensor::TensorList) -> bool {
        (self.0)(list)
    }
}

impl std::fmt::Debug for FirstReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FirstReader")
    }
}

impl TransferCtx {
    /// A transfer with only an id (no group, no target).
    pub fn new(xfer: TransferId) -> Self {
        TransferCtx {
            xfer,
            ..Default::default()
        }
    }
}

/// The other end of a move, as the framework knows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Peer {
    /// Framework id of the peer's actor (for messages).
    pub actor: u64,
    /// Human-readable name of the peer (for errors).
    pub name: String,
    /// Host the peer runs on.
    pub host: String,
    /// The peer's endpoint for this transport, as it published it.
    pub endpoint: String,
}

/// A transport failed.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[error("{transport} transport{}: {message}", .peer.as_ref().map(|p| format!(" (peer {p})")).unwrap_or_default())]
pub struct TransportError {
    /// Name of the transport.
    pub transport: String,
    /// The peer involved, if any.
    pub peer: Option<String>,
    /// What happened and, where it helps, what to do.
    pub message: String,
}

impl TransportError {
    /// An error of `transport` with no peer.
    pub fn new(transport: &str, message: impl Into<String>) -> Self {
        TransportError {
            transport: transport.to_string(),
            peer: None,
            message: message.into(),
        }
    }
    /// An error of `transport` involving `peer`.
    pub fn with_peer(transport: &str, peer: &Peer, message: impl Into<String>) -> Self {
        TransportError {
            transport: transport.to_string(),
            peer: Some(peer.name.clone()),
            message: message.into(),
        }
    }
}

/// Where a worker starts a receive that is not in a group
/// ([`TensorTransport::receive_start`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReceiveStart {
    /// In a task of its own, which starts when the worker's control loop
    /// next yields (the default).
    Task,
    /// On the control loop at once, up to its first wait, before the loop
    /// reads its next frame: for a receive that waits for nothing (it
    /// opens memory the producer published, usually a mapping kept from
    /// an earlier pass), so the value is stored, and the call waiting for
    /// it free to start, before the call is even read. A receive that
    /// does wait goes on in a task from there. The first receive from a
    /// new source holds the loop while it maps (`shm`: an `mmap`;
    /// `cuda_ipc`: a `cuIpcOpenMemHandle`, about a millisecond).
    Now,
    /// On the control loop, up to its first wait, once the frames the loop
    /// has already read are handled (the call behind the delivery is in
    /// the actor's mailbox by then): for a short read that waits a few
    /// microseconds for its bytes (a small `nixl` READ from a producer
    /// read before). The actor's thread wakes while the read is posted,
    /// and the read needs no task of its own (spawning one cost the 4 KiB
    /// pass the wait for the loop to yield, and a wake-up of the
    /// runtime's other thread).
    AfterFramesInHand,
}

/// A way to move tensors between processes. See the module docs for the
/// contract.
pub trait TensorTransport: Send + Sync + 'static {
    /// The name used in `#[rdt::method(tensor_transport = "...")]`.
    fn name(&self) -> &'static str;

    /// Who acts in a move.
    fn sidedness(&self) -> Sidedness;

    /// Can this transport move tensors on `device`? The error says which
    /// transport to use instead.
    fn check_device(&self, device: &Device) -> Result<(), TransportError>;

    /// This process's endpoint for peers (an address to connect to), if the
    /// transport has one.
    fn endpoint(&self) -> Option<String> {
        None
    }

    /// Producer: publish `tensors` of object `key` (contract point 1).
    fn export<'a>(
        &'a self,
        key: ObjectKey,
        tensors: &'a [Tensor],
    ) -> BoxFuture<'a, Result<Exported, TransportError>>;

    /// Producer of a two-sided transport: send `tensors` to `to` as transfer
    /// `cx.xfer`, in `cx.group` if the transport is collective (contract
    /// point 2).
    fn send<'a>(
        &'a self,
        to: &'a Peer,
        cx: &'a TransferCtx,
        tensors: &'a [Tensor],
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        let _ = (cx, tensors);
        Box::pin(async move {
            Err(TransportError::with_peer(
                self.name(),
                to,
                "this transport is not two-sided; the producer has nothing to send",
            ))
        })
    }

    /// Consumer: obtain the tensors `exported` describes from `from`
    /// (contract point 2), into `cx.target` when one is given (contract
    /// point 7; [`Target::place`] does it for transports that receive into
    /// memory of their own first).
    fn receive<'a>(
        &'a self,
        from: &'a Peer,
        cx: &'a TransferCtx,
        exported: &'a Exported,
    ) -> BoxFuture<'a, Result<Vec<Tensor>, TransportError>>;

    /// [`receive`](Self::receive), as a [`TensorList`](crate::TensorList):
    /// what the framework calls. A transport that lays a large object out
    /// in a few ranges may return a lazy list, whose tensors are made when
    /// a call's decode wants them instead of all at once here (`nixl`'s
    /// planned receives). The default is `receive`'s list.
    fn receive_list<'a>(
        &'a self,
        from: &'a Peer,
        cx: &'a TransferCtx,
        exported: &'a Exported,
    ) -> BoxFuture<'a, Result<crate::tensor::TensorList, TransportError>> {
        Box::pin(async move {
            self.receive(from, cx, exported)
                .await
                .map(crate::tensor::TensorList::from)
        })
    }

    /// Rank 0 of a collective group about to be created: make what every
    /// member needs to join it (NCCL: the unique id, whose bootstrap root
    /// lives in this process until every rank has joined). The framework
    /// asks rank 0 first and hands the bytes to every member in
    /// [`GroupSpec::bootstrap`]. The default needs nothing.
    fn group_bootstrap<'a>(
        &'a self,
        spec: &'a GroupSpec,
    ) -> BoxFuture<'a, Result<Vec<u8>, TransportError>> {
        let _ = spec;
        Box::pin(async { Ok(Vec::new()) })
    }

    /// A collective group with this process as a member is created
    /// (two-sided transports; contract point 2 of the framework's transfer
    /// contract). The framework sends this to every member and waits for
    /// every answer. The default has nothing to set up.
    fn create_group<'a>(
        &'a self,
        spec: &'a GroupSpec,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        let _ = spec;
        Box::pin(async { Ok(()) })
    }

    /// The group is destroyed (every transfer in it has ended or been
    /// aborted). The default has nothing to tear down.
    fn destroy_group(&self, group: u64) -> BoxFuture<'_, Result<(), TransportError>> {
        let _ = group;
        Box::pin(async { Ok(()) })
    }

    /// The group is aborted (a transfer in it failed or missed its deadline,
    /// or a member died): stop everything in flight in it now. Must not
    /// block. The default does nothing.
    fn abort_group(&self, group: u64, reason: &str) {
        let _ = (group, reason);
    }

    /// Consumer: the bytes of receive `xfer`, which returned already, have
    /// all landed (or failed to). A stream-ordered transport (NCCL)
    /// returns from [`receive`](Self::receive) once the copy is enqueued,
    /// with tensors that carry its done event, so the method can start
    /// while the bytes arrive; this future tells the framework when to
    /// acknowledge the receive. `None` (the default): the receive was
    /// complete when it returned. Asked once per receive, right after it
    /// returned.
    fn landed(&self, xfer: TransferId) -> Option<BoxFuture<'static, Result<(), TransportError>>> {
        let _ = xfer;
        None
    }

    /// Consumer: a receive of this transport ended and its own task sent
    /// its acknowledgement (a stream-ordered receive that a call
    /// acknowledged, WK-9, is not followed by this), while the call that
    /// takes the value may be running on the actor's thread. A transport may get ready for its next receive
    /// here (`nixl` makes the destination of a small read it expects
    /// again, NX-11). Called on the thread that ran the receive; must not
    /// block for long. The default does nothing.
    fn after_receive(&self) {}

    /// Where the worker starts the receive of `exported` (see
    /// [`ReceiveStart`]). Asked once per receive not in a group, with its
    /// decoded metadata and handles: it must be cheap. The default:
    /// [`ReceiveStart::Task`].
    fn receive_start(&self, exported: &Exported) -> ReceiveStart {
        let _ = exported;
        ReceiveStart::Task
    }

    /// Whether a receive can take `targets` as its [`Target::Tensors`]
    /// (contract point 7), for tensors of matching dtypes and shapes: `Err`
    /// says why not (memory this transport cannot write into). The
    /// framework then receives anywhere and copies into the targets, so a
    /// target never fails a receive. Called once per receive into targets,
    /// so it must be cheap. The default: yes (a transport that cannot
    /// write into some target copies into it itself).
    fn receives_into(&self, targets: &[Tensor]) -> Result<(), String> {
        let _ = targets;
        Ok(())
    }

    /// Whether a receive into [`Target::Tensors`] copies into them only
    /// through [`TransferCtx::place`] (under the [`TransferCtx::gate`]),
    /// rather than writing into them itself as bytes come. A dropped
    /// `get_into` then closes the gate and lets the receive finish; a
    /// transport that writes in place has its receive aborted instead.
    /// The default, `false`, is the safe answer for a transport that does
    /// not say.
    fn copies_into_targets(&self) -> bool {
        false
    }

    /// Can the driver read this transport's objects itself (`Runtime::get`
    /// with no worker involved) and hold objects of its own
    /// (`Runtime::put_with`)? One-sided transports whose receive needs no
    /// actor (NIXL) say yes. The default: no; the driver's `get` takes the
    /// object-store path.
    fn serves_driver(&self) -> bool {
        false
    }

    /// Producer: the object was freed (contract point 3).
    fn release(&self, key: ObjectKey) -> BoxFuture<'_, Result<(), TransportError>> {
        let _ = key;
        Box::pin(async { Ok(()) })
    }

    /// The actor with framework id `actor` ([`Peer::actor`]) died or was
    /// killed (contract point 6). The framework calls this in every
    /// process, once the death is known; the transport drops everything it
    /// keeps for that peer: connections, caches, records. Tensors already
    /// received from the peer stay valid as far as the transport can keep
    /// them so. Must be cheap and must not block; the default keeps nothing
    /// per peer and does nothing.
    fn peer_gone(&self, actor: u64) {
        let _ = actor;
    }

    /// Periodic upkeep: drop what a cache keeps for things that went away
    /// without a message (`shm` lets go of mappings of memfds their
    /// producer no longer publishes). The rdt worker calls it every
    /// [`HOUSEKEEPING_PERIOD`]. Must be cheap (a few system calls at most)
    /// and must not block; the default does nothing.
    fn housekeeping(&self) {}
}

/// How often the rdt worker calls [`TensorTransport::housekeeping`].
pub const HOUSEKEEPING_PERIOD: std::time::Duration = std::time::Duration::from_millis(200);

/// Where tensors stop matching the metadata they should have (dtype and
/// shape, one tensor per entry, in order).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MetaMismatch {
    /// There are not as many tensors as entries.
    Count,
    /// Tensor `.0` has another dtype or shape than its entry.
    At(usize),
}

/// The first place `got` does not match `expected`, if any: the one
/// comparison behind [`check_received`] and the framework's check of
/// `get_into` targets, which word the error each for its caller.
pub fn first_mismatch(expected: &[TensorMeta], got: &[Tensor]) -> Option<MetaMismatch> {
    if expected.len() != got.len() {
        return Some(MetaMismatch::Count);
    }
    expected
        .iter()
        .zip(got)
        .position(|(m, t)| m.dtype != t.dtype() || m.shape != t.shape())
        .map(MetaMismatch::At)
}

/// Checks that `got` matches `expected` (contract point 2), as every
/// transport's `receive` must.
pub fn check_received(
    transport: &str,
    expected: &[TensorMeta],
    got: &[Tensor],
) -> Result<(), TransportError> {
    let message = match first_mismatch(expected, got) {
        None => return Ok(()),
        Some(MetaMismatch::Count) => format!(
            "expected {} tensors, received {}",
            expected.len(),
            got.len()
        ),
        Some(MetaMismatch::At(i)) => format!(
            "tensor #{i}: expected {} {:?}, received {} {:?}",
            expected[i].dtype,
            expected[i].shape,
            got[i].dtype(),
            got[i].shape()
        ),
    };
    Err(TransportError::new(transport, message))
}
