//! The control protocol: messages between driver and workers, framing, and
//! the authentication handshake.
//!
//! # Invariants
//! 1. Before any frame is read on a connection, both ends prove knowledge
//!    of the runtime's secret by HMAC-SHA256 over fresh nonces (mutual
//!    challenge-response; the secret never crosses the socket). A peer that
//!    fails is dropped and logged.
//! 2. After the handshake a connection carries frames: an 8-byte big-endian
//!    length, then a body made by [`rdt_transport::wire::to_frame`] (postcard
//!    header, then out-of-band blobs). A receiver refuses a body over the
//!    configured limit and closes the connection; a sender refuses to queue
//!    one and returns an error, which the caller turns into the error of the
//!    call or object concerned.
//! 3. Messages on one connection are handled in the order they were sent;
//!    the driver relies on this to order deliveries before the calls that
//!    need them.

use std::time::Duration;

use rdt_transport::arriving::{Arriving, ArrivingWriter, Progress};
use rdt_transport::wire::{self, FramePart};
use rdt_transport::{Blob, Exported, GroupRef, GroupSpec, Peer};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::Arc;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::AsyncRead;
use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::transport::Transport;

/// A value as it travels: serialized non-tensor part plus what the
/// transport exported for its tensors.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireValue {
    /// postcard bytes with tensor placeholders (see [`data_wire`] for how
    /// a list of tensors travels).
    #[serde(with = "data_wire")]
    pub data: Blob,
    /// Transport that holds the tensors (`object_store` when there are none).
    pub transport: Transport,
    /// Metadata, handles or inline bytes of the tensors.
    pub exported: WireExported,
    /// Ids of the objects whose refs the value contains, once per
    /// occurrence: the driver holds a count on each while the value lives
    /// (CL-2).
    pub refs: Vec<u64>,
}

impl WireValue {
    /// Waits until every byte of the value is here: a receiver hands a
    /// value on while its large blobs still arrive (cut-through,
    /// `rdt_transport::arriving`). The error says the bytes were lost on
    /// the way.
    pub async fn arrived(&self) -> Result<()> {
        for b in self.blobs() {
            b.arrived().await.map_err(lost_bytes)?;
        }
        Ok(())
    }

    /// Why its bytes will never all be here, if they won't.
    pub fn lost(&self) -> Option<Error> {
        self.blobs().find_map(Blob::lost).map(lost_bytes)
    }

    /// Every part of the value that may travel beside a frame's header.
    fn blobs(&self) -> impl Iterator<Item = &Blob> {
        [&self.data, &self.exported.head]
            .into_iter()
            .chain(&self.exported.inline)
    }

    /// The serialized non-tensor part; [`arrived`](Self::arrived) first.
    pub fn data_bytes(&self) -> Result<Bytes> {
        self.data.bytes().map_err(lost_bytes)
    }
}

/// What a transport exported for a value's tensors, as it travels.
///
/// The metadata and handles stay one run of encoded bytes until a process
/// that moves the tensors reads them ([`get`](Self::get), decoded once per
/// process and kept). The driver, which only forwards them to consumers,
/// never decodes them: for an object of 10 000 tensors that was a decode
/// and an encode of 10 000 entries on every pass. A large head travels
/// as a blob beside the frame's header (see [`head_wire`]), and the
/// inline bytes (object store) too.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct WireExported {
    /// postcard of the [`Exported`], its `inline` left empty.
    #[serde(with = "head_wire")]
    head: Blob,
    /// [`Exported::inline`].
    pub inline: Vec<Blob>,
    /// [`Exported::nbytes`], for accounting without decoding.
    nbytes: u64,
    /// The decoded form, once read in this process.
    #[serde(skip)]
    decoded: std::sync::OnceLock<Arc<Decoded>>,
}

/// A head decoded in this process, and the layout id it got then.
#[derive(Debug)]
struct Decoded {
    exported: Exported,
    /// Unique in this process, never reused: the same id means the same
    /// decode, hence the same bytes ([`WireExported::layout`]).
    layout: u64,
}

impl Decoded {
    fn new(exported: Exported) -> Arc<Decoded> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Arc::new(Decoded {
            exported,
            layout: NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        })
    }
}

impl WireExported {
    /// The wire form of `exported` (encoded here, once).
    pub fn new(mut exported: Exported) -> Result<WireExported> {
        let inline = std::mem::take(&mut exported.inline);
        let head = postcard::to_allocvec(&exported).map_err(|e| Error::Decode {
            what: "a value's tensor metadata".into(),
            message: e.to_string(),
        })?;
        exported.inline = inline.clone();
        let nbytes = exported.nbytes() as u64;
        Ok(WireExported {
            head: Blob::new(Bytes::from(head)),
            inline,
            nbytes,
            decoded: std::sync::OnceLock::from(Decoded::new(exported)),
        })
    }

    /// The exported metadata, handles and inline bytes (decoded on first
    /// use in this process; a head decoded lately, by content, is not
    /// decoded again: see [`RecentHeads`]).
    ///
    /// A large head may still be arriving in a frame that is handed on as
    /// it arrives: await [`head_arrived`](Self::head_arrived) (or
    /// [`WireValue::arrived`]) first; before that this is an error.
    pub fn get(&self) -> Result<&Exported> {
        if let Some(d) = self.decoded.get() {
            return Ok(&d.exported);
        }
        let head = self.head.bytes().map_err(lost_bytes)?;
        let recent = match head.len() {
            _ if !self.inline.is_empty() => None,
            n if n >= RecentHeads::MIN_HEAD => Some(&RECENT_HEADS),
            n if n > 0 => Some(&RECENT_SMALL_HEADS),
            _ => None,
        };
        if let Some(recent) = recent {
            if let Some(d) = RecentHeads::find(recent, &head) {
                return Ok(&self.decoded.get_or_init(|| d).exported);
            }
        }
        // An empty head is `Default`'s: a value without tensors.
        let mut e: Exported = if head.is_empty() {
            Exported::default()
        } else {
            postcard::from_bytes(&head).map_err(|e| {
                Error::Protocol(format!(
                    "malformed tensor metadata in a value ({} bytes): {e}; the producer runs \
                     another rdt version, or the frame was damaged",
                    head.len()
                ))
            })?
        };
        e.inline = self.inline.clone();
        let d = Decoded::new(e);
        if let Some(recent) = recent {
            RecentHeads::keep(recent, head, d.clone());
        }
        Ok(&self.decoded.get_or_init(|| d).exported)
    }

    /// Waits until the head is all here (it is, unless it is large and
    /// came in a frame handed on as it arrives); an error if it never
    /// will be.
    pub async fn head_arrived(&self) -> Result<()> {
        self.head.arrived().await.map(drop).map_err(lost_bytes)
    }

    /// Is the head all here (it is, unless it is large and came in a
    /// frame handed on as it arrives)?
    pub fn head_is_here(&self) -> bool {
        self.head.still_arriving().is_none()
    }

    /// Names the decoded form [`get`](Self::get) gave, in this process:
    /// values whose heads were found among the recent ones share it, so
    /// the same layout means byte-identical metadata and handles, and an
    /// id is never reused. `None` before `get`. Transports key what they
    /// work out once per layout on it ([`rdt_transport::TransferCtx::layout`]).
    pub fn layout(&self) -> Option<u64> {
        self.decoded.get().map(|d| d.layout)
    }

    /// Total tensor bytes described.
    pub fn nbytes(&self) -> usize {
        self.nbytes as usize
    }
}

/// The heads a process decoded last, by content.
///
/// A weight sync passes the same parameters every step: a new object each
/// time, whose head (the tensors' metadata and the transport's handles,
/// nothing that names the object) is byte for byte the last one's.
/// Decoding the metadata of 10 000 tensors took about 220 µs of a
/// consumer's receive (one H100 host); finding it here is one comparison
/// of the bytes. A head's size says little of its tensors: the metadata
/// of 10 000 tensors of a few shapes is a few bytes (`metas_wire`), and
/// decoding still makes 10 000 entries, and a new layout would make the
/// transport work out its plan again. So every head of at least
/// [`MIN_HEAD`](Self::MIN_HEAD) bytes is kept, the last
/// [`KEEP`](Self::KEEP) of them; a hit compares every byte, so a head is
/// never taken for another. Smaller heads (a few tensors, no transport
/// handles) are kept apart, as many, so that a stream of small values
/// does not push a weight sync's head out: decoding one costs little
/// alone, but it is on a small pass's path before its receive starts
/// (the group's thread found a 4 KiB `nccl` tensor's head decoded 1.1 µs
/// after it started on it, 2×H200); `RDT_SMALL_HEADS=0` decodes them
/// every time.
pub(crate) struct RecentHeads;

type Heads = rdt_transport::recent::Recent<(Bytes, Arc<Decoded>)>;

impl RecentHeads {
    /// The smallest head kept with the large ones.
    pub(crate) const MIN_HEAD: usize = 64;
    /// Heads kept, of each size.
    pub(crate) const KEEP: usize = 8;

    /// The decoded form of `head`, if it was decoded lately.
    fn find(recent: &Heads, head: &Bytes) -> Option<Arc<Decoded>> {
        recent.find(|(h, _)| h == head).map(|(_, d)| d)
    }

    fn keep(recent: &Heads, head: Bytes, d: Arc<Decoded>) {
        recent.keep((head, d));
    }
}

static RECENT_HEADS: Heads = Heads::new(RecentHeads::KEEP);
static RECENT_SMALL_HEADS: Heads = Heads::new(RecentHeads::KEEP);

/// How a [`WireExported`]'s head travels: small ones inside the frame's
/// header, large ones as a blob beside it.
///
/// The head of an object of 10 000 tensors is about 100 KB. Inside the
/// header it was copied by the serializer into the header and again into
/// the frame on the sending side, and out of the read buffer and again
/// into its own buffer on the receiving side: about 30 µs to encode and
/// 30 µs to decode on the dev VM, on every pass through the driver. As a
/// blob it is written from the buffer it is in, and read into one buffer.
/// A small head stays in the header: one blob more would cost the tiny
/// calls a buffer of its own at each end.
mod head_wire {
    use bytes::Bytes;
    use rdt_transport::Blob;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    /// Heads up to this size travel inside the header.
    pub(super) const INLINE_MAX: usize = 4096;

    #[derive(Serialize)]
    enum Out<'a> {
        Inline(&'a Bytes),
        Beside(&'a Blob),
    }

    #[derive(Deserialize)]
    enum In {
        Inline(Bytes),
        Beside(Blob),
    }

    pub(super) fn serialize<S: Serializer>(head: &Blob, s: S) -> Result<S::Ok, S::Error> {
        match head.bytes() {
            Ok(b) if b.len() <= INLINE_MAX => Out::Inline(&b).serialize(s),
            // Large, or still arriving (forwarded as it arrives).
            _ => Out::Beside(head).serialize(s),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Blob, D::Error> {
        Ok(match In::deserialize(d)? {
            In::Inline(b) => Blob::new(b),
            In::Beside(b) => b,
        })
    }
}

/// How a [`WireValue`]'s data travels: as its bytes (a blob), or, for a
/// value that is exactly its tensors in order (a `Vec<Tensor>` of at
/// least [`IN_ORDER_MIN`](rdt_transport::value::IN_ORDER_MIN), a
/// weights list), as their number.
///
/// The data of a list of 10 000 tensors is 10 000 placeholders, about
/// 20 KB, which the producer wrote to the driver and the driver to each
/// consumer on every pass (on the 2×H200 host all but 1 KB of the
/// delivery of such an object). The number is a few bytes; the receiving
/// process makes the same bytes again ([`in_order_data`]: once per count,
/// then shared), so nothing after the frame changes.
///
/// [`in_order_data`]: rdt_transport::value::in_order_data
mod data_wire {
    use rdt_transport::value::{in_order_data, tensors_in_order};
    use rdt_transport::Blob;
    use serde::de::Error as _;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize)]
    enum Out<'a> {
        Bytes(&'a Blob),
        TensorsInOrder(u64),
    }

    #[derive(Deserialize)]
    enum In {
        Bytes(Blob),
        TensorsInOrder(u64),
    }

    pub(super) fn serialize<S: Serializer>(data: &Blob, s: S) -> Result<S::Ok, S::Error> {
        // Still arriving (forwarded as it arrives): its bytes, as they come.
        match data.bytes().ok().and_then(|b| tensors_in_order(&b)) {
            Some(n) => Out::TensorsInOrder(n as u64).serialize(s),
            None => Out::Bytes(data).serialize(s),
        }
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Blob, D::Error> {
        Ok(match In::deserialize(d)? {
            In::Bytes(b) => b,
            In::TensorsInOrder(n) => Blob::new(
                usize::try_from(n)
                    .ok()
                    .and_then(in_order_data)
                    .ok_or_else(|| {
                        D::Error::custom(format!(
                            "a value of {n} tensors in order: more than {} tensors",
                            rdt_transport::MAX_TENSORS
                        ))
                    })?,
            ),
        })
    }
}

fn lost_bytes(e: rdt_transport::arriving::ArriveError) -> Error {
    Error::Transport(rdt_transport::TransportError::new(
        rdt_transport::object_store::NAME,
        format!("a value's bytes did not arrive whole: {e}"),
    ))
}

/// An argument of a call.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum WireArg {
    /// Passed by value (tensors inline, object-store path).
    Value(WireValue),
    /// Passed by ref: the worker waits for the object in its store.
    Ref(u64),
}

/// A method call.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CallMsg {
    /// Call id.
    pub call: u64,
    /// Method index in the actor's impl.
    pub method: u32,
    /// Arguments.
    pub args: Vec<WireArg>,
    /// Object id of the result.
    pub result: u64,
    /// Transport for the result's tensors.
    pub transport: Transport,
    /// Ref arguments whose copy the callee drops itself when this call
    /// ends, unless another call it holds takes them too (OW-12): the
    /// driver's last need of them from this actor, when it was submitted.
    pub release: Vec<u64>,
}

impl CallMsg {
    /// The objects its ref arguments name, in order.
    pub fn ref_args(&self) -> impl Iterator<Item = u64> + '_ {
        self.args.iter().filter_map(|a| match a {
            WireArg::Ref(r) => Some(*r),
            WireArg::Value(_) => None,
        })
    }
}

/// How a consumer obtains an object's tensors.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Delivery {
    /// The value (data and exported tensors).
    pub value: WireValue,
    /// The producer, for direct transports.
    pub from: Option<Peer>,
    /// Pairs the receive with the producer's send (two-sided transports).
    pub xfer: u64,
    /// The collective group the transfer runs in (two-sided transports).
    pub group: Option<GroupRef>,
    /// Acknowledge once the bytes landed, even when a call took the value
    /// before (WK-9 leaves that to its `CallDone`): the driver holds the
    /// next large send to this consumer until then (OW-15).
    pub ack_at_landing: bool,
}

/// What a worker is to host, and the settings it runs with.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SpawnOrder {
    /// Registered name of the actor type.
    pub actor_type: String,
    /// The actor's id.
    pub worker: u64,
    /// The actor's name.
    pub name: String,
    /// Control frame limit.
    pub max_frame: usize,
    /// Where the `tcp` transport listens (`None`: loopback for local
    /// workers, the control link's local address for remote ones).
    pub tcp_bind: Option<String>,
    /// Deadline of a direct transfer, in milliseconds.
    pub transfer_timeout_ms: u64,
    /// The hot window set by the driver's builder, in microseconds
    /// (`None`: the worker's own default, `rdt_transport::hot`).
    pub hot_window_us: Option<u64>,
    /// For workers over TCP: exit when the driver is silent this long
    /// (it pings every quarter of it), so a worker cut off from its driver
    /// does not live on.
    pub heartbeat_ms: Option<u64>,
    /// postcard bytes of the actor's constructor argument.
    pub args: Blob,
    /// The high bits of the ids this actor makes itself (results of the
    /// calls it submits, values it puts), so that they never collide with
    /// the driver's or another actor's (see [`actor_id_space`]).
    pub id_space: u64,
    /// The driver's transport ids: messages name a transport by its index
    /// here (`transport::set_wire_table`).
    pub transports: Vec<String>,
    /// Where this worker listens for deliveries straight from producers
    /// (`worker::peer`): a Unix socket in the runtime's private directory,
    /// for workers the driver spawned on its host; `None` for workers
    /// started by hand.
    pub peer_socket: Option<String>,
    /// Whether a value through the driver of 1 MiB or more goes straight
    /// to its consumer (`worker::peer`; `None`: the worker's default, by
    /// its core count).
    pub straight_large_values: Option<bool>,
}

/// A consumer as a producer reaches it to deliver a value straight
/// (`ToWorker::DeliverTo`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PeerSocket {
    /// The consumer's actor id.
    pub actor: u64,
    /// Its peer socket ([`SpawnOrder::peer_socket`]).
    pub path: String,
}

/// The first id of the `n`th actor's own id space (n ≥ 1): the top bit
/// set, 24 bits of actor, 39 bits of count (half a trillion ids each). The
/// driver's own ids count up from 1 and never reach the top bit.
pub fn actor_id_space(n: u64) -> u64 {
    (1 << 63) | ((n & 0xFF_FFFF) << 39)
}

/// A call submitted by an actor (DESIGN §3, "Actors are clients too").
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SubmitMsg {
    /// The actor to run it.
    pub actor: u64,
    /// Method index in that actor's impl.
    pub method: u32,
    /// Arguments; refs among them are the submitter's, held until the
    /// message is queued (CL-2).
    pub args: Vec<WireArg>,
    /// Object id of the result, from the submitter's id space; the
    /// submitter borrows it from the start.
    pub result: u64,
    /// Transport for the result's tensors.
    pub transport: Transport,
    /// Why the call cannot run (an argument did not encode): the result
    /// fails with it at once.
    pub error: Option<Error>,
}

/// Driver → worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ToWorker {
    /// Host this actor.
    Spawn(SpawnOrder),
    /// Heartbeat; answer with `Pong`.
    Ping,
    /// Run a method.
    Call(CallMsg),
    /// An object a queued call needs (or its error).
    Deliver {
        /// Object id.
        object: u64,
        /// The value or why there is none.
        value: std::result::Result<Delivery, Error>,
    },
    /// One-sided transports: when the call producing `object` finishes,
    /// deliver its value to `to` yourself, as transfer `xfer`, on the
    /// connection between the two workers, and say so in the call's
    /// `CallDone` (`delivered`). An order that comes after the call
    /// finished is dropped: the driver delivers what `CallDone` does not
    /// name (`worker::peer`, PD-1).
    DeliverTo {
        /// Object id (a call's result).
        object: u64,
        /// Transfer id, acknowledged by the consumer as for the driver's
        /// deliveries.
        xfer: u64,
        /// The consumer.
        to: PeerSocket,
    },
    /// Two-sided transports: send an object's tensors to a peer.
    SendTo {
        /// Object id.
        object: u64,
        /// Transfer id, paired with the consumer's receive.
        xfer: u64,
        /// Consumer.
        to: Peer,
        /// The collective group the transfer runs in, with both ranks.
        group: Option<GroupRef>,
    },
    /// Rank 0 of a group about to be created: make what every member
    /// joins with (NCCL: the unique id); answer `GroupPrepared`.
    PrepareGroup {
        /// The backend (a collective transport's name).
        backend: String,
        /// The members by rank, and this worker's rank (0).
        spec: GroupSpec,
    },
    /// Join a collective group: start the backend's part of it (NCCL: the
    /// communicator) and the group's ordered queue of transfers; answer
    /// `GroupReady`.
    CreateGroup {
        /// The backend (a collective transport's name).
        backend: String,
        /// The members by rank, and this worker's rank.
        spec: GroupSpec,
    },
    /// Leave a collective group: its queue drains, the backend tears its
    /// part down; answer `GroupDestroyed`.
    DestroyGroup {
        /// The group.
        group: u64,
    },
    /// A transfer in the group failed or a member died: the backend stops
    /// what is in flight in it, and later transfers in it fail at once.
    AbortGroup {
        /// The group.
        group: u64,
        /// Why (for errors).
        reason: String,
    },
    /// Stop a transfer in progress (either end): its deadline passed, the
    /// other end failed, or the peer died. The consumer's receive fails with
    /// `error` (and is acknowledged with `Received`), the producer's send
    /// stops. An abort for a transfer already finished is ignored.
    AbortTransfer {
        /// Object id.
        object: u64,
        /// The transfer.
        xfer: u64,
        /// Why (becomes the receive's error).
        error: Error,
    },
    /// An actor died: transports drop what they keep for it (connections,
    /// caches).
    PeerGone {
        /// The dead actor's id.
        actor: u64,
    },
    /// The owner table freed the object: drop it.
    Free {
        /// Object id.
        object: u64,
    },
    /// Send the whole value (tensors inline) to the driver.
    Fetch {
        /// Object id.
        object: u64,
        /// Request id for the reply.
        req: u64,
    },
    /// Answer to [`ToDriver::Watch`]: the object is finished, ready
    /// (`Ok`) or failed.
    Settled {
        /// The watch.
        req: u64,
        /// How it finished.
        result: std::result::Result<(), Error>,
    },
    /// Answer to [`ToDriver::Probe`]: how the object finished (ready
    /// `Ok`, failed or freed `Err`), or `None` while it is pending.
    Probed {
        /// The probe.
        req: u64,
        /// Its state.
        state: Option<std::result::Result<(), Error>>,
    },
    /// Exit now.
    Shutdown,
}

/// Worker → driver.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ToDriver {
    /// First frame after the handshake.
    Hello {
        /// The worker id the driver gave in the environment.
        worker: u64,
        /// Process id.
        pid: u32,
        /// Host name.
        host: String,
        /// Endpoints of this worker's transports, by transport name.
        endpoints: Vec<(String, String)>,
    },
    /// Reply to `Spawn`: the endpoints of this worker's transports, by
    /// transport name, or why the actor could not be constructed.
    Spawned(std::result::Result<Vec<(String, String)>, Error>),
    /// Answer to `Ping`.
    Pong,
    /// A call finished.
    CallDone {
        /// Call id.
        call: u64,
        /// The result value or the error.
        result: std::result::Result<WireValue, Error>,
        /// The transfers of `DeliverTo` orders this worker carried out
        /// (the value went to those consumers straight); the driver
        /// delivers to the others itself.
        delivered: Vec<u64>,
        /// The copies of this call's `release` arguments the worker took
        /// out of its store before this frame (OW-12): the driver forgets
        /// them without a `Free`.
        released: Vec<u64>,
        /// The call got past argument resolution, its arguments' landings
        /// included (XF-5): its `CallDone` settles the receives it took
        /// on. `false` (a call refused by the mailbox, an argument that did
        /// not arrive): their own acknowledgements settle them.
        resolved: bool,
    },
    /// The consumer's receive of a delivery finished: the object is in its
    /// store (`Ok`), or the receive failed. Every delivery of a direct
    /// transport is acknowledged exactly once; the driver frees nothing the
    /// receive may still touch before this arrives.
    Received {
        /// Object id.
        object: u64,
        /// The transfer.
        xfer: u64,
        /// How it ended.
        result: std::result::Result<(), Error>,
    },
    /// The producer's send of a two-sided transfer failed (the driver aborts
    /// the consumer's receive and, for collective transports, tears the
    /// group down).
    TransferFailed {
        /// Object id.
        object: u64,
        /// The transfer.
        xfer: u64,
        /// The other end.
        peer: u64,
        /// The transport (`None`: the producer no longer knows the object).
        transport: Option<Transport>,
        /// What happened.
        message: String,
    },
    /// Reply to `PrepareGroup`.
    GroupPrepared {
        /// The group.
        group: u64,
        /// What every member joins with, or why rank 0 could not make it.
        result: std::result::Result<Vec<u8>, Error>,
    },
    /// Reply to `CreateGroup`.
    GroupReady {
        /// The group.
        group: u64,
        /// Joined, or why not.
        result: std::result::Result<(), Error>,
    },
    /// Reply to `DestroyGroup`.
    GroupDestroyed {
        /// The group.
        group: u64,
        /// Torn down, or what went wrong doing it.
        result: std::result::Result<(), Error>,
    },
    /// Reply to `Fetch`.
    Fetched {
        /// Request id.
        req: u64,
        /// The value with tensors inline.
        result: std::result::Result<WireValue, Error>,
    },
    /// A method submitted a call to an actor.
    Submit(SubmitMsg),
    /// A method put a value: the object is ready with it (its tensors kept
    /// by this worker for a direct transport), borrowed by this actor.
    Put {
        /// Object id, from this actor's id space.
        object: u64,
        /// The value.
        value: WireValue,
    },
    /// This actor now holds refs to these objects (each went from no local
    /// ref to one: CL-1).
    Borrow(Vec<u64>),
    /// This actor dropped its last local ref to these objects.
    Release(Vec<u64>),
    /// A method gets the object: deliver it to this worker's store as for
    /// a call that takes it.
    Get {
        /// Object id.
        object: u64,
    },
    /// The get of the object ended (decoded or failed): its copy may go.
    GetDone {
        /// Object id.
        object: u64,
    },
    /// Answer with `Settled` once the object is ready or failed.
    Watch {
        /// Request id.
        req: u64,
        /// Object id.
        object: u64,
    },
    /// Answer with `Probed` at once: the object's state now (HO-6: was a
    /// call this worker made to itself refused at submission?).
    Probe {
        /// Request id.
        req: u64,
        /// Object id.
        object: u64,
    },
    /// A method asked to kill an actor (`kill()` on a handle).
    Kill {
        /// The actor.
        actor: u64,
    },
}

/// Sends frames on a connection; cheap to clone. Sending never blocks.
///
/// Latency matters here (a tiny call is four of these sends), so a frame is
/// written *inline* by the sending thread, with non-blocking vectored
/// writes, whenever nothing is queued before it; only what the socket does
/// not take at once is queued for the connection's writer task, which waits
/// for the socket to become writable. Writes happen under one lock, so
/// frames never interleave and keep their order (invariant 3).
#[derive(Clone)]
pub struct Sender {
    inner: Arc<SenderInner>,
}

/// The writing half of a control connection (Unix socket or TCP).
pub enum WriteHalf {
    /// Local worker.
    Unix(tokio::net::unix::OwnedWriteHalf),
    /// Remote worker.
    Tcp(tokio::net::tcp::OwnedWriteHalf),
    /// Remote worker over TLS: always written by the writer task.
    Tls(tokio::sync::Mutex<tokio::io::WriteHalf<TlsStream>>),
}

/// A TLS control connection (either end).
pub type TlsStream = tokio_rustls::TlsStream<tokio::net::TcpStream>;

impl WriteHalf {
    fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        match self {
            WriteHalf::Unix(w) => w.try_write_vectored(bufs),
            WriteHalf::Tcp(w) => w.try_write_vectored(bufs),
            // Encryption happens in the writer task.
            WriteHalf::Tls(_) => Err(std::io::ErrorKind::WouldBlock.into()),
        }
    }
    async fn writable(&self) -> std::io::Result<()> {
        match self {
            WriteHalf::Unix(w) => w.writable().await,
            WriteHalf::Tcp(w) => w.writable().await,
            WriteHalf::Tls(_) => Ok(()),
        }
    }
}

/// The reading half of a control connection (Unix socket or TCP).
pub enum ReadHalf {
    /// Local worker.
    Unix(tokio::net::unix::OwnedReadHalf),
    /// Remote worker.
    Tcp(tokio::net::tcp::OwnedReadHalf),
    /// Remote worker over TLS.
    Tls(tokio::io::ReadHalf<TlsStream>),
}

impl AsyncRead for ReadHalf {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::os::fd::AsRawFd;
        use std::task::Poll;
        let (polled, fd) = match self.get_mut() {
            ReadHalf::Unix(r) => {
                let fd = r.as_ref().as_raw_fd();
                (std::pin::Pin::new(r).poll_read(cx, buf), fd)
            }
            ReadHalf::Tcp(r) => {
                let fd = r.as_ref().as_raw_fd();
                (std::pin::Pin::new(r).poll_read(cx, buf), fd)
            }
            ReadHalf::Tls(r) => return std::pin::Pin::new(r).poll_read(cx, buf),
        };
        match polled {
            // Pending, with the waker registered: tokio has not seen the
            // socket readable. In a process that spins (hot window), ask
            // the socket itself (see `read_directly`).
            Poll::Pending if !rdt_transport::hot::window().is_zero() => read_directly(fd, buf),
            other => other,
        }
    }
}

/// Reads what the socket `fd` holds now, without waiting and without
/// asking tokio: `Pending` when it holds nothing.
///
/// Why: tokio learns that a socket is readable only when some worker
/// thread polls its I/O driver, and while one worker sleeps in
/// `epoll_wait` holding the driver, a thread that spins in a hot wait
/// (`rdt_transport::hot`) cannot poll it: the bytes are seen only after
/// the kernel wakes the sleeper, 5–12 µs on the GPU hosts' VMs, on every
/// hop of a call (timelines of cached `cuda_ipc` hand-offs, 2026-11-24).
/// A non-blocking `recv` from the spinning thread sees them at once.
/// Reading behind tokio's back is sound: the waker stays registered, and
/// the readiness tokio may report later for bytes taken here only costs
/// one read that finds nothing.
fn read_directly(
    fd: std::os::fd::RawFd,
    buf: &mut tokio::io::ReadBuf<'_>,
) -> std::task::Poll<std::io::Result<()>> {
    use std::task::Poll;
    // SAFETY: the bytes given to recv are the unfilled part of `buf`
    // (recv writes at most that many); those it reports written are
    // initialized and then counted as filled.
    unsafe {
        let spare = buf.unfilled_mut();
        let n = libc::recv(
            fd,
            spare.as_mut_ptr().cast(),
            spare.len(),
            libc::MSG_DONTWAIT,
        );
        if n >= 0 {
            DIRECT_READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            buf.assume_init(n as usize);
            buf.advance(n as usize);
            return Poll::Ready(Ok(()));
        }
    }
    let e = std::io::Error::last_os_error();
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Poll::Pending,
        _ => Poll::Ready(Err(e)),
    }
}

/// `msg` as a frame, the 8-byte length at the head's front (no allocation
/// of its own).
fn encode<T: Serialize>(msg: &T) -> Result<wire::Frame> {
    wire::to_frame_with_length(msg).map_err(|e| Error::Protocol(e.to_string()))
}

/// The longest a frame sent with [`Sender::send_soon`] waits for the next
/// frame on its connection before the writer task writes it.
pub const SOON: Duration = Duration::from_millis(1);

/// Reads [`read_directly`] answered (for tests).
static DIRECT_READS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

struct SenderInner {
    half: WriteHalf,
    queue: parking_lot::Mutex<WriteQueue>,
    wake: Notify,
    /// Frames were held by [`Sender::send_soon`]: the writer task writes
    /// them within [`SOON`] if no other frame took them first.
    soon: Notify,
    /// `soon` was notified and the writer has not written since.
    soon_armed: std::sync::atomic::AtomicBool,
    max_frame: std::sync::atomic::AtomicUsize,
    counts: ForwardCounts,
    /// How long a blob being forwarded may bring no new byte before this
    /// sender gives up on it (milliseconds; see [`Sender::set_stall_limit`]).
    stall_limit_ms: std::sync::atomic::AtomicU64,
}

impl SenderInner {
    /// Waits until `blob` fills past `seen` bytes or ends; gives up on it
    /// (sets `g`) after the stall limit.
    async fn wait_for_bytes(&self, blob: &Arriving, seen: usize, g: &GivenUp) {
        let limit = Duration::from_millis(
            self.stall_limit_ms
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        if tokio::time::timeout(limit, blob.progress_beyond(seen))
            .await
            .is_err()
        {
            tracing::warn!(
                "a value being forwarded brought no byte for {limit:?} ({seen} of {} B in): \
                 its consumer's copy fails and the connection goes on",
                blob.len()
            );
            g.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The stall limit of a sender until [`Sender::set_stall_limit`]: the
/// default transfer deadline.
const DEFAULT_STALL_LIMIT: Duration = Duration::from_secs(120);

/// What a [`Sender`] wrote of blobs that were still arriving when it
/// queued them (see [`Sender::forwarded`]).
#[derive(Default)]
struct ForwardCounts {
    bytes: std::sync::atomic::AtomicU64,
    early: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct WriteQueue {
    chunks: VecDeque<Chunk>,
    closed: bool,
    /// Every queued frame came from [`Sender::send_soon`] and nobody is
    /// writing them yet: the next frame, or the writer task within
    /// [`SOON`], writes them.
    held: bool,
}

/// A piece of the write queue.
enum Chunk {
    /// Bytes all here.
    Here(Bytes),
    /// A blob still arriving (cut-through), written as it lands, from
    /// byte `at`. If it fails, or this sender gives up on it (`given_up`,
    /// no byte for the stall limit), the rest is written as zeros and the
    /// frame's status says so.
    Arriving {
        blob: Arriving,
        at: usize,
        given_up: GivenUp,
    },
    /// A frame's status byte (`rdt_transport::wire` module docs), decided
    /// once every one of these blobs ended or was given up.
    Status(Vec<(Arriving, GivenUp)>),
}

/// Set when a sender stopped waiting for a blob's bytes (shared by the
/// blob's chunk and its frame's status chunk).
type GivenUp = Arc<std::sync::atomic::AtomicBool>;

fn given_up(g: &GivenUp) -> bool {
    g.load(std::sync::atomic::Ordering::Relaxed)
}

/// Padding for the rest of a blob that failed mid-way.
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

/// What a chunk can give the socket now.
enum Offer<'a> {
    /// These bytes; `whole`: the chunk's blob is whole (or it is no blob),
    /// so what follows may go in the same write.
    Bytes { bytes: &'a [u8], whole: bool },
    /// Nothing until this blob fills past this many bytes (or ends); the
    /// flag gives up on it.
    Wait(Arriving, usize, GivenUp),
}

impl Chunk {
    /// Its next bytes: a blob's part that is in (zeros once it failed), a
    /// status once every blob of the frame ended.
    fn offer(&self) -> Offer<'_> {
        match self {
            Chunk::Here(b) => Offer::Bytes {
                bytes: b,
                whole: true,
            },
            Chunk::Arriving {
                blob,
                at,
                given_up: g,
            } => match blob.progress() {
                Progress::Failed(_) => Offer::Bytes {
                    bytes: &ZEROS[..ZEROS.len().min(blob.len() - *at)],
                    whole: true,
                },
                _ if given_up(g) => Offer::Bytes {
                    bytes: &ZEROS[..ZEROS.len().min(blob.len() - *at)],
                    whole: true,
                },
                Progress::Filling(n) if n > *at => Offer::Bytes {
                    bytes: &blob.prefix(n)[*at..],
                    whole: false,
                },
                Progress::Filling(_) => Offer::Wait(blob.clone(), *at, g.clone()),
                Progress::Done => Offer::Bytes {
                    bytes: &blob.prefix(blob.len())[*at..],
                    whole: true,
                },
            },
            Chunk::Status(blobs) => {
                // Every blob's bytes were written (or padded) before its
                // status: one still filling was given up, or it ended.
                if let Some((b, g)) = blobs
                    .iter()
                    .find(|(b, g)| !given_up(g) && matches!(b.progress(), Progress::Filling(_)))
                {
                    return Offer::Wait(b.clone(), b.len(), g.clone());
                }
                let stalled = blobs.iter().any(|(_, g)| given_up(g));
                let lost = blobs
                    .iter()
                    .any(|(b, _)| matches!(b.progress(), Progress::Failed(_)));
                let status: &'static [u8] = match (lost, stalled) {
                    (true, _) => &[wire::STATUS_LOST],
                    (false, true) => &[wire::STATUS_STALLED],
                    (false, false) => &[0],
                };
                Offer::Bytes {
                    bytes: status,
                    whole: true,
                }
            }
        }
    }

    /// `k` bytes of what it offered (`whole` as offered) were written.
    /// True when the chunk is all written.
    fn advance(&mut self, k: usize, whole: bool, counts: &ForwardCounts) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        match self {
            Chunk::Here(b) => {
                b.advance(k);
                b.is_empty()
            }
            Chunk::Arriving { blob, at, .. } => {
                counts.bytes.fetch_add(k as u64, Relaxed);
                if !whole {
                    counts.early.fetch_add(k as u64, Relaxed);
                }
                *at += k;
                *at == blob.len()
            }
            Chunk::Status(_) => true,
        }
    }
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sender")
    }
}

impl Sender {
    /// Changes the frame limit (after the spawn order set it).
    pub fn set_max_frame(&self, max: usize) {
        self.inner
            .max_frame
            .store(max, std::sync::atomic::Ordering::Relaxed);
    }

    /// Sends `msg`, which nothing waits for, with the next frame on this
    /// connection, or within [`SOON`] if none comes: no system call now.
    ///
    /// For frees. Each was a socket write on the path of whatever the
    /// driver did next (a `drop` of a ref, the reply that released an
    /// argument): 3–5 µs of a 50 µs hand-off on the GPU hosts. Order is
    /// kept: a held frame goes out before any frame sent after it. Over
    /// TLS (whose writer task writes everything) it is [`send`](Self::send).
    pub fn send_soon<T: Serialize>(&self, msg: &T) -> Result<()> {
        let frame = encode(msg)?;
        if matches!(self.inner.half, WriteHalf::Tls(_)) || !frame.blobs.is_empty() || frame.status {
            // Only small, whole frames wait.
            return self.send_frame(frame);
        }
        let mut q = self.inner.queue.lock();
        if q.closed {
            return Ok(());
        }
        if q.chunks.is_empty() {
            q.held = true;
        }
        q.chunks.push_back(Chunk::Here(frame.head));
        let held = q.held;
        drop(q);
        if !held {
            // The writer task is writing the queue; it takes this too.
            self.inner.wake.notify_one();
        } else if !self
            .inner
            .soon_armed
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            self.arm_soon();
        }
        Ok(())
    }

    /// Wakes the writer task to write held frames within [`SOON`]. Under
    /// the driver's state lock ([`defer_writes`]) the wake waits for
    /// [`flush_deferred`]: waking a task that slept costs the waking
    /// thread a system call (1–2 µs on the GPU hosts), and the thread
    /// under the lock is usually the reader handling a call's end, whose
    /// getter wakes only after the unlock. A frame that comes meanwhile
    /// takes the held ones along anyway. Called once per arming
    /// (`soon_armed`), so a connection is listed once.
    fn arm_soon(&self) {
        wake_after_flush(Wake::WriterSoon(self.clone()));
    }

    /// Whether `other` sends on the same connection.
    pub fn same_connection(&self, other: &Sender) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether the connection is closed (its writer gave up): what is sent
    /// now is dropped.
    pub fn is_closed(&self) -> bool {
        self.inner.queue.lock().closed
    }

    /// Sends `msg`. A closed connection is not an error here: its reader
    /// notices and reports the death.
    ///
    /// A message larger than the frame limit is refused here, so the caller
    /// can turn it into an error for the call or object concerned instead
    /// of leaving the other end waiting.
    pub fn send<T: Serialize>(&self, msg: &T) -> Result<()> {
        let frame = encode(msg)?;
        rdt_transport::cuda::timeline("frame encoded", frame.len() as u64);
        self.send_frame(frame)
    }

    /// [`send`](Self::send) of a frame already encoded.
    fn send_frame(&self, frame: wire::Frame) -> Result<()> {
        let len = frame.len() - 8;
        let max_frame = self
            .inner
            .max_frame
            .load(std::sync::atomic::Ordering::Relaxed);
        if len > max_frame {
            return Err(Error::Protocol(format!(
                "a {len}-byte message exceeds the control frame limit of {max_frame} bytes; raise RuntimeBuilder::max_frame_bytes or move the tensors with a direct transport"
            )));
        }
        let mut q = self.inner.queue.lock();
        if q.closed {
            return Ok(());
        }
        // Held frames (`send_soon`) go out with this one.
        let was_empty = q.chunks.is_empty() || q.held;
        q.chunks.push_back(Chunk::Here(frame.head));
        let mut arriving = Vec::new();
        for part in frame.blobs.into_iter().filter(|b| !b.is_empty()) {
            q.chunks.push_back(match part {
                FramePart::Here(b) => Chunk::Here(b),
                FramePart::Arriving(blob) => {
                    let g = GivenUp::default();
                    arriving.push((blob.clone(), g.clone()));
                    Chunk::Arriving {
                        blob,
                        at: 0,
                        given_up: g,
                    }
                }
            });
        }
        if frame.status {
            q.chunks.push_back(Chunk::Status(arriving));
        }
        // Under the driver's state lock (`defer_writes`): whether this
        // connection is listed for `flush_deferred` already.
        let listed = DEFERRED.with(|d| {
            d.borrow()
                .as_ref()
                .map(|l| l.iter().any(|s| s.same_connection(self)))
        });
        match listed {
            // Behind frames the flush writes (a delivery, then its call):
            // it takes this one too. Waking the writer task instead cost
            // a system call on the call's path (the task slept) and raced
            // the flush for the socket.
            Some(true) => return Ok(()),
            // Queued in order now, written by the flush once the lock is
            // released.
            Some(false) if was_empty => {
                drop(q);
                DEFERRED.with(|d| {
                    if let Some(list) = d.borrow_mut().as_mut() {
                        list.push(self.clone());
                    }
                });
                return Ok(());
            }
            _ => {}
        }
        if was_empty {
            self.write_queued(q);
        } else {
            // The writer task has the earlier frames; it takes this one too.
            drop(q);
            self.inner.wake.notify_one();
        }
        Ok(())
    }
}

thread_local! {
    /// Senders with frames queued while this thread defers writes (see
    /// [`defer_writes`]).
    static DEFERRED: std::cell::RefCell<Option<Vec<Sender>>> = const { std::cell::RefCell::new(None) };
    /// Wake-ups that wait for this thread's deferred writes (see
    /// [`wake_after_flush`]).
    static DEFERRED_WAKES: std::cell::RefCell<Vec<Wake>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// A wake-up of another task that waits for [`flush_deferred`].
enum Wake {
    /// A connection's writer task, for its held frames ([`Sender::arm_soon`]).
    WriterSoon(Sender),
    /// A task of the caller's ([`notify_after_flush`]).
    Task(Arc<tokio::sync::Notify>),
}

impl Wake {
    fn now(self) {
        match self {
            Wake::WriterSoon(s) => s.inner.soon.notify_one(),
            Wake::Task(t) => t.notify_one(),
        }
    }
}

/// Does `wake` once this thread's deferred writes ([`defer_writes`]) are
/// written, if `knob` is on and the thread defers writes; else now.
fn wake_after_flush(wake: Wake) {
    if DEFERRED.with(|d| d.borrow().is_some()) {
        DEFERRED_WAKES.with(|d| d.borrow_mut().push(wake));
    } else {
        wake.now();
    }
}

/// Notifies `task` once this thread's deferred writes ([`defer_writes`])
/// are written, or now if it defers none. The driver wakes a worker's
/// reader this way when it submits a call: the reader slept, so the wake
/// is a system call (2-3 µs on the GPU hosts), and the call's frames
/// should not wait for it; the reply comes long after.
pub fn notify_after_flush(task: &Arc<tokio::sync::Notify>) {
    wake_after_flush(Wake::Task(task.clone()));
}

/// From now until [`flush_deferred`] on this thread, [`Sender::send`] queues
/// its frame in order and leaves the socket write for later. The driver
/// does this while it holds its state lock (so the order of frames on each
/// connection is the order of decisions made under the lock) and writes
/// after releasing it: no other thread waits on the lock for a system call.
pub fn defer_writes() {
    DEFERRED.with(|d| {
        let mut d = d.borrow_mut();
        if d.is_none() {
            *d = Some(Vec::new());
        }
    });
}

/// Whether frames queued since [`defer_writes`] on this thread wait for
/// [`flush_deferred`] on a connection other than `conn`'s.
pub fn deferred_besides(conn: &Sender) -> bool {
    DEFERRED.with(|d| {
        d.borrow()
            .as_ref()
            .is_some_and(|l| l.iter().any(|s| !s.same_connection(conn)))
    })
}

/// Ends [`defer_writes`] and writes what was queued meanwhile (without
/// blocking: what the socket does not take now, each connection's writer
/// task writes).
pub fn flush_deferred() {
    let Some(list) = DEFERRED.with(|d| d.borrow_mut().take()) else {
        return;
    };
    rdt_transport::cuda::timeline("flush deferred", list.len() as u64);
    for s in list {
        s.flush();
    }
    for wake in DEFERRED_WAKES.with(|d| std::mem::take(&mut *d.borrow_mut())) {
        wake.now();
    }
}

impl Sender {
    /// Writes what is queued, up to what the socket takes now; the writer
    /// task is woken for the rest.
    fn flush(&self) {
        let q = self.inner.queue.lock();
        rdt_transport::cuda::timeline("flush queue locked", q.chunks.len() as u64);
        if q.closed || q.chunks.is_empty() {
            return;
        }
        self.write_queued(q);
    }

    /// How long a blob this sender forwards while it still arrives may
    /// bring no new byte before the sender gives up on it: the rest goes
    /// out as zeros and the frame's status says the bytes stopped coming,
    /// so the receiver's value fails and the connection carries the next
    /// frames (a stopped producer must not stall every consumer it feeds).
    /// The driver sets its transfer deadline; the default is 120 s.
    pub fn set_stall_limit(&self, limit: Duration) {
        self.inner.stall_limit_ms.store(
            limit.as_millis().max(1) as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Of the blobs this sender took while they were still arriving: the
    /// bytes written, and how many of those went out before their blob
    /// was whole (cut-through).
    pub fn forwarded(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.inner.counts;
        (c.bytes.load(Relaxed), c.early.load(Relaxed))
    }

    /// Writes the queue (held locked: `q`, open) without blocking; a write
    /// error closes it, and what the socket did not take, or what waits
    /// for bytes still arriving, goes to the writer task. Shared by an
    /// inline `send` and `flush`.
    fn write_queued(&self, mut q: parking_lot::MutexGuard<'_, WriteQueue>) {
        q.held = false;
        rdt_transport::cuda::timeline("socket write", q.chunks.len() as u64);
        let written = write_ready(&self.inner, &mut q.chunks);
        rdt_transport::cuda::timeline("socket written", q.chunks.len() as u64);
        match written {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::debug!("control connection write failed: {e}");
                q.closed = true;
                q.chunks.clear();
                return;
            }
        }
        if !q.chunks.is_empty() {
            drop(q);
            self.inner.wake.notify_one();
        }
    }
}

/// Writes queued chunks without blocking until done, the socket is full
/// (`WouldBlock`), or the next bytes are still arriving: then the blob to
/// wait on and how much of it was taken (`Ok(Some(..))`).
fn write_ready(
    me: &SenderInner,
    chunks: &mut VecDeque<Chunk>,
) -> std::io::Result<Option<(Arriving, usize, GivenUp)>> {
    while !chunks.is_empty() {
        // What each chunk offers now, and whether its blob was whole.
        let mut offered: Vec<(usize, bool)> = Vec::new();
        let mut slices: Vec<IoSlice<'_>> = Vec::new();
        let mut wait = None;
        for c in chunks.iter().take(64) {
            match c.offer() {
                Offer::Wait(blob, seen, g) => {
                    wait = Some((blob, seen, g));
                    break;
                }
                Offer::Bytes { bytes, whole } => {
                    offered.push((bytes.len(), whole));
                    slices.push(IoSlice::new(bytes));
                    if !whole {
                        // Bytes past it are not in yet.
                        break;
                    }
                }
            }
        }
        if slices.is_empty() {
            return Ok(wait);
        }
        let mut n = me.half.try_write_vectored(&slices)?;
        drop(slices);
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        for (len, whole) in offered {
            if n == 0 {
                break;
            }
            let k = n.min(len);
            n -= k;
            let first = chunks.front_mut().expect("wrote no more than was queued");
            if first.advance(k, whole, &me.counts) {
                chunks.pop_front();
            }
        }
    }
    Ok(None)
}

/// Writes one chunk through an async writer (the TLS writer task),
/// waiting for the bytes of a blob still arriving.
async fn write_chunk<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    mut c: Chunk,
    me: &SenderInner,
) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let counts = &me.counts;
    loop {
        let (k, whole) = match c.offer() {
            Offer::Wait(blob, seen, g) => {
                me.wait_for_bytes(&blob, seen, &g).await;
                continue;
            }
            Offer::Bytes { bytes, whole } => {
                w.write_all(bytes).await?;
                (bytes.len(), whole)
            }
        };
        if c.advance(k, whole, counts) {
            return Ok(());
        }
    }
}

/// The writer task of a TLS connection: drains the queue in order through
/// the encrypting stream.
async fn tls_writer(me: &SenderInner, w: &tokio::sync::Mutex<tokio::io::WriteHalf<TlsStream>>) {
    use tokio::io::AsyncWriteExt;
    let mut w = w.lock().await;
    loop {
        let notified = me.wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let chunks: Vec<Chunk> = {
            let mut q = me.queue.lock();
            if q.closed {
                return;
            }
            q.chunks.drain(..).collect()
        };
        if chunks.is_empty() {
            notified.await;
            continue;
        }
        for c in chunks {
            if let Err(e) = write_chunk(&mut *w, c, me).await {
                tracing::debug!("TLS control connection write failed: {e}");
                let mut q = me.queue.lock();
                q.closed = true;
                q.chunks.clear();
                return;
            }
        }
        if w.flush().await.is_err() {
            me.queue.lock().closed = true;
            return;
        }
    }
}

/// Wraps the writing half of a connection and starts its writer task.
pub fn spawn_writer(half: WriteHalf, max_frame: usize) -> Sender {
    let inner = Arc::new(SenderInner {
        half,
        queue: parking_lot::Mutex::new(WriteQueue::default()),
        wake: Notify::new(),
        soon: Notify::new(),
        soon_armed: std::sync::atomic::AtomicBool::new(false),
        max_frame: std::sync::atomic::AtomicUsize::new(max_frame),
        counts: ForwardCounts::default(),
        stall_limit_ms: std::sync::atomic::AtomicU64::new(DEFAULT_STALL_LIMIT.as_millis() as u64),
    });
    let me = inner.clone();
    tokio::spawn(async move {
        if let WriteHalf::Tls(w) = &me.half {
            return tls_writer(&me, w).await;
        }
        loop {
            tokio::select! {
                biased;
                _ = me.wake.notified() => {}
                _ = me.soon.notified() => {
                    // Held frames wait for the next frame on this
                    // connection, or this long.
                    tokio::select! {
                        _ = tokio::time::sleep(SOON) => {}
                        _ = me.wake.notified() => {}
                    }
                    me.soon_armed
                        .store(false, std::sync::atomic::Ordering::Release);
                }
            }
            loop {
                let res = {
                    let mut q = me.queue.lock();
                    if q.closed || q.chunks.is_empty() {
                        break;
                    }
                    q.held = false;
                    let r = write_ready(&me, &mut q.chunks);
                    if let Err(e) = &r {
                        if e.kind() != std::io::ErrorKind::WouldBlock {
                            tracing::debug!("control connection write failed: {e}");
                            q.closed = true;
                            q.chunks.clear();
                        }
                    }
                    r
                };
                match res {
                    Ok(None) => {}
                    // The next bytes are still arriving (cut-through).
                    Ok(Some((blob, taken, g))) => {
                        me.wait_for_bytes(&blob, taken, &g).await;
                    }
                    Err(e) => {
                        if e.kind() != std::io::ErrorKind::WouldBlock
                            || me.half.writable().await.is_err()
                        {
                            return;
                        }
                    }
                }
            }
        }
    });
    Sender { inner }
}

/// The reading half of a connection (invariant 2).
///
/// Blobs stream into their own buffers: a small one is copied out of the
/// read buffer (which is then reused in place, and pinned by nothing); a
/// large one (at least
/// [`host_pool::MIN_POOLED`](rdt_transport::host_pool::MIN_POOLED)) is read
/// by the socket straight into a pooled, page-aligned host buffer (pinned
/// where the process has a CUDA context), so a frame is never buffered
/// whole and its tensors need no copy after the socket's own. All progress
/// lives in `self`, which makes [`recv`](Self::recv) cancel-safe: a frame
/// in progress is resumed by the next call.
pub struct Receiver<R> {
    r: R,
    /// Bytes read and not yet consumed.
    buf: BytesMut,
    max_frame: usize,
    state: ReadState,
    /// Bytes read from the connection so far: a frame still arriving
    /// counts, so a peer sending one large frame is alive (HB-1).
    read_bytes: u64,
}

enum ReadState {
    /// Waiting for a frame's 8-byte length.
    Length,
    /// Waiting for the head (header and blob table) of a `body`-byte frame.
    Head { body: usize },
    /// Reading the blobs, in order.
    Blobs {
        header: Vec<u8>,
        lens: Vec<usize>,
        blobs: Vec<Blob>,
        /// A large blob being read into its buffer, and how much is in.
        large: Option<(rdt_transport::host_pool::HostBuf, usize)>,
        /// Does a status byte follow the blobs?
        status: bool,
    },
    /// The message went up with its blobs from the first very large one on
    /// still arriving; their bytes are read into them, in order.
    Streaming {
        /// Blobs whose bytes are still to read, in order.
        writers: VecDeque<ArrivingWriter>,
        /// Blobs read whole, waiting for the frame's status byte.
        read: Vec<ArrivingWriter>,
        status: bool,
    },
}

/// Blobs from this size on are handed up while they arrive (cut-through:
/// the driver forwards them, a consumer waits for them, as they land).
/// Smaller ones gain less than the wake-ups cost.
pub const STREAM_MIN: usize = 4 << 20;

/// [`STREAM_MIN`], or `RDT_STREAM_MIN` (bytes; `off` turns cut-through
/// off) read once per process: the benchmarks compare both paths in one
/// run.
fn stream_min() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| match crate::env::var("RDT_STREAM_MIN") {
        Ok(v) if v == "off" => usize::MAX,
        Ok(v) => v.parse().unwrap_or(STREAM_MIN),
        Err(_) => STREAM_MIN,
    })
}

/// What the read buffer asks of the socket at least per read.
const READ_CHUNK: usize = 64 << 10;

impl<R: AsyncRead + Unpin> Receiver<R> {
    /// Is the next frame all in the read buffer already, so that
    /// [`recv`](Self::recv) returns it without reading the connection?
    /// (Between frames only; `false` when unsure.)
    pub fn has_whole_frame(&self) -> bool {
        matches!(self.state, ReadState::Length)
            && self.buf.len() >= 8
            && (self.buf.len() - 8) as u64
                >= u64::from_be_bytes(self.buf[..8].try_into().expect("8 bytes"))
    }

    /// Wraps a reader, refusing frames over `max_frame` bytes.
    pub fn new(r: R, max_frame: usize) -> Self {
        Receiver {
            r,
            buf: BytesMut::with_capacity(READ_CHUNK),
            max_frame,
            state: ReadState::Length,
            read_bytes: 0,
        }
    }

    /// Bytes read from the connection so far, a frame still arriving
    /// included (HB-1: bytes read are liveness).
    pub fn bytes_read(&self) -> u64 {
        self.read_bytes
    }

    /// Changes the frame limit (after the spawn order set it).
    pub fn set_max_frame(&mut self, max: usize) {
        self.max_frame = max;
    }

    /// Reads more into the read buffer, at least `want` bytes' room. False
    /// at the end of the stream.
    async fn fill(&mut self, want: usize) -> Result<bool> {
        use tokio::io::AsyncReadExt;
        self.buf.reserve(want.max(READ_CHUNK));
        let n = self
            .r
            .read_buf(&mut self.buf)
            .await
            .map_err(|e| Error::Io(e.to_string()))?;
        self.read_bytes += n as u64;
        rdt_transport::cuda::timeline("socket read", n as u64);
        Ok(n > 0)
    }

    /// The next message; `Ok(None)` at a clean end of stream. Cancel-safe.
    pub async fn recv<T: DeserializeOwned>(&mut self) -> Result<Option<T>> {
        use rdt_transport::host_pool::{HostBuf, MIN_POOLED};
        use tokio::io::AsyncReadExt;
        let cut = |what: &str| Error::Io(format!("the connection closed in the middle of {what}"));
        loop {
            match &mut self.state {
                ReadState::Length => {
                    if self.buf.len() < 8 {
                        if !self.fill(8).await? {
                            return match self.buf.is_empty() {
                                true => Ok(None),
                                false => Err(cut("a frame length")),
                            };
                        }
                        continue;
                    }
                    let body = self.buf.get_u64() as usize;
                    if body > self.max_frame {
                        return Err(Error::Protocol(format!(
                            "the peer sent a {body}-byte frame, over the control frame limit of {} bytes (RuntimeBuilder::max_frame_bytes)",
                            self.max_frame
                        )));
                    }
                    self.state = ReadState::Head { body };
                }
                ReadState::Head { body } => {
                    let body = *body;
                    match wire::parse_head(&self.buf, body)
                        .map_err(|e| Error::Protocol(e.to_string()))?
                    {
                        Some(h) => {
                            // Copied out (it is small), like small blobs
                            // below: the read buffer is then never shared,
                            // and every later read reuses it in place.
                            let header = self.buf[h.header].to_vec();
                            self.buf.advance(h.head_len);
                            self.state = ReadState::Blobs {
                                header,
                                lens: h.blob_lens,
                                blobs: Vec::new(),
                                large: None,
                                status: h.status,
                            };
                        }
                        // The head is at most the frame: read on.
                        None => {
                            if !self.fill(body.min(READ_CHUNK)).await? {
                                return Err(cut("a frame head"));
                            }
                        }
                    }
                }
                ReadState::Blobs {
                    header,
                    lens,
                    blobs,
                    large,
                    status,
                } => {
                    let Some(&len) = lens.get(blobs.len()) else {
                        let msg = wire::from_parts(header, std::mem::take(blobs))
                            .map_err(|e| Error::Protocol(e.to_string()));
                        // A status byte with no blob before it (a frame
                        // with blobs streams from its first, below) is
                        // read next, like any.
                        self.state = match *status {
                            true => ReadState::Streaming {
                                writers: VecDeque::new(),
                                read: Vec::new(),
                                status: true,
                            },
                            false => ReadState::Length,
                        };
                        return msg.map(Some);
                    };
                    if large.is_none() && (len >= stream_min() || *status) {
                        // Hand the message up now; its blobs from here on
                        // arrive in their buffers (AR-1, AR-2). A frame
                        // with a status byte goes this way from its first
                        // blob: the status, read last, decides them all.
                        let mut writers = VecDeque::new();
                        for &l in &lens[blobs.len()..] {
                            let (a, w) = Arriving::new(l).map_err(|e| {
                                Error::Io(format!("allocating {l} bytes for a received blob: {e}"))
                            })?;
                            blobs.push(Blob::arriving(a));
                            writers.push_back(w);
                        }
                        let msg = wire::from_parts(header, std::mem::take(blobs))
                            .map_err(|e| Error::Protocol(e.to_string()));
                        self.state = ReadState::Streaming {
                            writers,
                            read: Vec::new(),
                            status: *status,
                        };
                        return msg.map(Some);
                    }
                    if let Some((buf, filled)) = large {
                        if *filled == len {
                            let (buf, _) = large.take().expect("checked");
                            blobs.push(Blob::new(buf.freeze()));
                            continue;
                        }
                        let n = self
                            .r
                            .read(&mut buf.as_mut_slice()[*filled..])
                            .await
                            .map_err(|e| Error::Io(e.to_string()))?;
                        if n == 0 {
                            return Err(cut("a blob"));
                        }
                        *filled += n;
                        self.read_bytes += n as u64;
                    } else if len < MIN_POOLED {
                        if self.buf.len() >= len {
                            // A copy, not a slice of the read buffer: a
                            // small value kept in a store must not pin a
                            // whole read buffer (64 KiB or more) for life.
                            blobs.push(Blob::new(Bytes::copy_from_slice(&self.buf[..len])));
                            self.buf.advance(len);
                        } else if !self.fill(len - self.buf.len()).await? {
                            return Err(cut("a blob"));
                        }
                    } else {
                        let mut buf = HostBuf::new(len).map_err(|e| {
                            Error::Io(format!("allocating {len} bytes for a received blob: {e}"))
                        })?;
                        // What the read buffer already holds of it.
                        let have = self.buf.len().min(len);
                        buf.as_mut_slice()[..have].copy_from_slice(&self.buf[..have]);
                        self.buf.advance(have);
                        *large = Some((buf, have));
                    }
                }
                ReadState::Streaming { .. } => self.step_streaming().await?,
            }
        }
    }

    /// One step of reading the blobs of a frame already handed up: some
    /// bytes into the first unfinished blob, or its end, or the frame's
    /// status and end (back to `Length`).
    async fn step_streaming(&mut self) -> Result<()> {
        use tokio::io::AsyncReadExt;
        let ReadState::Streaming {
            writers,
            read,
            status,
        } = &mut self.state
        else {
            return Ok(());
        };
        let Some(w) = writers.front_mut() else {
            if *status {
                self.read_status().await?;
            }
            self.state = ReadState::Length;
            return Ok(());
        };
        if w.remaining() == 0 {
            let w = writers.pop_front().expect("looked at");
            match *status {
                // Whole only once the status vouches for it.
                true => read.push(w),
                false => w.finish(),
            }
        } else if !self.buf.is_empty() {
            let k = self.buf.len().min(w.remaining());
            w.spare()[..k].copy_from_slice(&self.buf[..k]);
            self.buf.advance(k);
            w.advance(k);
        } else {
            let n = self
                .r
                .read(w.spare())
                .await
                .map_err(|e| Error::Io(e.to_string()))?;
            if n == 0 {
                return Err(Error::Io(
                    "the connection closed in the middle of a blob".into(),
                ));
            }
            w.advance(n);
            self.read_bytes += n as u64;
        }
        Ok(())
    }

    /// Reads the rest of the frame whose message [`recv`](Self::recv)
    /// handed up early (its large blobs still arriving), so that they are
    /// whole without another `recv`. Does nothing between frames.
    pub async fn finish_frame(&mut self) -> Result<()> {
        while matches!(self.state, ReadState::Streaming { .. }) {
            self.step_streaming().await?;
        }
        Ok(())
    }

    /// Reads a frame's status byte (state `Streaming`, every blob read)
    /// and ends the blobs it vouches for: whole, or lost. Cancel-safe: the
    /// byte is consumed only once it is here.
    async fn read_status(&mut self) -> Result<()> {
        if self.buf.is_empty() && !self.fill(1).await? {
            return Err(Error::Io(
                "the connection closed in the middle of a frame's status".into(),
            ));
        }
        let status = self.buf.get_u8();
        if let ReadState::Streaming { read, .. } = &mut self.state {
            for w in read.drain(..) {
                match status {
                    0 => w.finish(),
                    wire::STATUS_STALLED => w.fail(
                        "the value's bytes stopped coming: the actor that made it sent none \
                         for longer than the transfer deadline while the driver forwarded \
                         them (RuntimeBuilder::transfer_timeout); it may be stopped or \
                         overloaded. The value fails here; get it again once its producer \
                         runs",
                    ),
                    _ => w.fail(
                        "the value's bytes were lost on the way: the actor that made it \
                         failed while the driver forwarded them",
                    ),
                }
            }
        }
        Ok(())
    }
}

/// Socket buffer size asked for on control connections (the kernel caps it
/// at `net.core.wmem_max` / `rmem_max`).
const SOCKET_BUFFER: libc::c_int = 4 << 20;

/// Enlarges a local (Unix socket) control connection's buffers: a large
/// blob then crosses in fewer, larger writes and reads, with fewer wake-ups
/// of the other end (20–30 % on a 256 MiB blob, dev VM). Not for TCP,
/// where a fixed size would turn Linux's buffer autotuning off. Best
/// effort: a refusal leaves the defaults.
pub fn size_socket_buffers(sock: &impl std::os::fd::AsRawFd) {
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        // SAFETY: a valid socket descriptor and a c_int option value.
        unsafe {
            libc::setsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&SOCKET_BUFFER as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

/// How long a peer may take to authenticate.
pub const HANDSHAKE_TIMEOUT: Duration = rdt_transport::auth::HANDSHAKE_TIMEOUT;

/// A fresh random secret for a runtime.
pub fn new_secret() -> [u8; 32] {
    rdt_transport::auth::random32()
}

/// Accepting side of the handshake (invariant 1) on a plain stream (Unix
/// socket or TCP), bounded by [`HANDSHAKE_TIMEOUT`].
pub async fn accept_plain<S: AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    secret: [u8; 32],
) -> Result<()> {
    tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        rdt_transport::auth::accept_async(stream, &secret),
    )
    .await
    .map_err(|_| Error::Protocol("peer did not authenticate in time".into()))?
    .map_err(|e| match e {
        // The peer went away mid-handshake: an I/O error, not a violation.
        rdt_transport::auth::AuthError::Io(e) => Error::Io(format!("handshake: {e}")),
        e => Error::Protocol(e.to_string()),
    })
}

/// Connecting side of the handshake (invariant 1) on a plain stream.
pub async fn connect_plain<S: AsyncRead + tokio::io::AsyncWrite + Unpin>(
    stream: &mut S,
    secret: &[u8],
) -> Result<()> {
    tokio::time::timeout(
        HANDSHAKE_TIMEOUT,
        rdt_transport::auth::connect_async(stream, secret),
    )
    .await
    .map_err(|_| Error::Protocol("the driver did not authenticate in time".into()))?
    .map_err(|e| Error::Protocol(e.to_string()))
}

/// Accepting side over TLS: the TLS handshake, then the secret's challenge
/// inside the encrypted stream.
pub async fn accept_tls(
    stream: tokio::net::TcpStream,
    acceptor: &tokio_rustls::TlsAcceptor,
    secret: [u8; 32],
) -> Result<TlsStream> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        stream.set_nodelay(true)?;
        let mut tls = acceptor
            .accept(stream)
            .await
            .map_err(|e| Error::Protocol(format!("TLS handshake: {e}")))?;
        rdt_transport::auth::accept_async(&mut tls, &secret)
            .await
            .map_err(|e| Error::Protocol(e.to_string()))?;
        Ok(TlsStream::from(tls))
    })
    .await
    .map_err(|_| Error::Protocol("peer did not authenticate in time".into()))?
}

/// Connecting side over TLS (remote workers): trusts `ca_pem`'s
/// certificates for `server_name`.
pub async fn connect_tls(
    addr: &str,
    server_name: &str,
    ca_pem: &[u8],
    secret: &[u8],
) -> Result<(TlsStream, std::net::IpAddr)> {
    use rustls_pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls_pki_types::CertificateDer::pem_slice_iter(ca_pem) {
        let cert = cert.map_err(|e| Error::Protocol(format!("TLS CA file: {e}")))?;
        roots
            .add(cert)
            .map_err(|e| Error::Protocol(format!("TLS CA certificate: {e}")))?;
    }
    let config = rustls::ClientConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::Protocol(e.to_string()))?
    .with_root_certificates(roots)
    .with_no_client_auth();
    let name = rustls_pki_types::ServerName::try_from(server_name.to_string())
        .map_err(|e| Error::Protocol(format!("TLS server name {server_name:?}: {e}")))?;
    tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| Error::Io(format!("connect to the driver at {addr}: {e}")))?;
        tcp.set_nodelay(true)?;
        let ip = tcp.local_addr()?.ip();
        let mut tls = tokio_rustls::TlsConnector::from(std::sync::Arc::new(config))
            .connect(name, tcp)
            .await
            .map_err(|e| Error::Protocol(format!("TLS handshake with {addr}: {e}")))?;
        rdt_transport::auth::connect_async(&mut tls, secret)
            .await
            .map_err(|e| Error::Protocol(e.to_string()))?;
        Ok((TlsStream::from(tls), ip))
    })
    .await
    .map_err(|_| Error::Protocol(format!("the driver at {addr} did not authenticate in time")))?
}

/// A TLS acceptor from a PEM certificate chain and private key.
pub fn tls_acceptor(cert_pem: &[u8], key_pem: &[u8]) -> Result<tokio_rustls::TlsAcceptor> {
    use rustls_pki_types::pem::PemObject;
    let certs = rustls_pki_types::CertificateDer::pem_slice_iter(cert_pem)
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| Error::Protocol(format!("TLS certificate: {e}")))?;
    let key = rustls_pki_types::PrivateKeyDer::from_pem_slice(key_pem)
        .map_err(|e| Error::Protocol(format!("TLS key: {e}")))?;
    let config = rustls::ServerConfig::builder_with_provider(std::sync::Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(|e| Error::Protocol(e.to_string()))?
    .with_no_client_auth()
    .with_single_cert(certs, key)
    .map_err(|e| Error::Protocol(format!("TLS certificate and key: {e}")))?;
    Ok(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::net::UnixStream;

    fn order(args: Blob) -> ToWorker {
        ToWorker::Spawn(SpawnOrder {
            actor_type: "T".into(),
            worker: 1,
            name: "T#1".into(),
            max_frame: 1 << 30,
            tcp_bind: None,
            transfer_timeout_ms: 1000,
            hot_window_us: None,
            straight_large_values: None,
            heartbeat_ms: None,
            args,
            id_space: actor_id_space(1),
            transports: vec![],
            peer_socket: None,
        })
    }

    #[test]
    fn actor_id_spaces_are_disjoint_from_each_other_and_from_the_driver() {
        let (a, b) = (actor_id_space(1), actor_id_space(2));
        assert!(a >> 63 == 1 && b >> 63 == 1, "the top bit marks actor ids");
        assert_eq!(b - a, 1 << 39, "half a trillion ids per actor");
        assert!(actor_id_space(0xFF_FFFF) > actor_id_space(0xFF_FFFE));
    }

    /// A sender and the receiver at the other end of a Unix socket pair,
    /// both with the frame limit `max`.
    fn connected(max: usize) -> (Sender, Receiver<UnixStream>) {
        let (a, b) = UnixStream::pair().unwrap();
        (
            spawn_writer(WriteHalf::Unix(a.into_split().1), max),
            Receiver::new(b, max),
        )
    }

    /// Reads one `Free` per object of `objects` from `rx`, in that order.
    async fn expect_frees(rx: &mut Receiver<UnixStream>, objects: &[u64]) {
        for &want in objects {
            match rx.recv::<ToWorker>().await.unwrap() {
                Some(ToWorker::Free { object }) => assert_eq!(object, want),
                other => panic!("{other:?}"),
            }
        }
    }

    #[tokio::test]
    async fn frames_round_trip_and_oversize_frames_are_refused() {
        tokio::time::timeout(Duration::from_secs(10), async {
            let (tx, mut rx) = connected(16 << 20);
            tx.send(&ToDriver::Pong).unwrap();
            assert!(matches!(
                rx.recv::<ToDriver>().await.unwrap(),
                Some(ToDriver::Pong)
            ));
            // A large frame goes out partly inline, partly from the queue,
            // and the next frame stays behind it.
            let big = Blob::new(bytes::Bytes::from(vec![7u8; 8 << 20]));
            tx.send(&order(big.clone())).unwrap();
            tx.send(&ToWorker::Shutdown).unwrap();
            match rx.recv::<ToWorker>().await.unwrap() {
                Some(ToWorker::Spawn(o)) => {
                    // Handed up while its 8 MiB still arrive.
                    assert!(o.args.still_arriving().is_some());
                    rx.finish_frame().await.unwrap();
                    assert_eq!(o.args, big)
                }
                other => panic!("{other:?}"),
            }
            assert!(matches!(
                rx.recv::<ToWorker>().await.unwrap(),
                Some(ToWorker::Shutdown)
            ));
            // Over the sender's limit: refused at once.
            let (c, _d) = UnixStream::pair().unwrap();
            let small = spawn_writer(WriteHalf::Unix(c.into_split().1), 1024);
            let e = small.send(&order(Blob::new(bytes::Bytes::from(vec![0u8; 4096]))));
            assert!(matches!(e, Err(Error::Protocol(m)) if m.contains("frame limit")));
            // Over the receiver's limit: an error, not an allocation.
            let (c, d) = UnixStream::pair().unwrap();
            let loose = spawn_writer(WriteHalf::Unix(c.into_split().1), 1 << 20);
            let mut strict = Receiver::new(d, 1024);
            loose
                .send(&order(Blob::new(bytes::Bytes::from(vec![0u8; 4096]))))
                .unwrap();
            assert!(strict.recv::<ToWorker>().await.is_err());
        })
        .await
        .unwrap();
    }

    /// A frame sent with `send_soon` costs no write: it goes out with the
    /// next frame, before it, or from the writer task within `SOON`.
    #[tokio::test]
    async fn a_frame_sent_soon_goes_with_the_next_frame_or_on_its_own_soon() {
        tokio::time::timeout(Duration::from_secs(10), async {
            let (tx, mut rx) = connected(1 << 20);
            tx.send_soon(&ToWorker::Free { object: 1 }).unwrap();
            {
                let q = tx.inner.queue.lock();
                assert!(q.held && q.chunks.len() == 1, "held, not written");
            }
            tx.send(&ToWorker::Ping).unwrap();
            assert!(!tx.inner.queue.lock().held);
            assert!(matches!(
                rx.recv::<ToWorker>().await.unwrap(),
                Some(ToWorker::Free { object: 1 })
            ));
            assert!(matches!(
                rx.recv::<ToWorker>().await.unwrap(),
                Some(ToWorker::Ping)
            ));
            // Alone, it still arrives (the writer task, after SOON).
            tx.send_soon(&ToWorker::Free { object: 2 }).unwrap();
            tx.send_soon(&ToWorker::Free { object: 3 }).unwrap();
            expect_frees(&mut rx, &[2, 3]).await;
        })
        .await
        .expect("deadline");
    }

    /// A frame sent with `send_soon` while writes are deferred (the
    /// driver's lock) wakes no writer then: the wake waits for
    /// `flush_deferred`, and the frame still arrives on its own.
    #[tokio::test]
    async fn a_frame_sent_soon_under_deferred_writes_wakes_the_writer_after_the_flush() {
        tokio::time::timeout(Duration::from_secs(10), async {
            let (tx, mut rx) = connected(1 << 20);
            defer_writes();
            tx.send_soon(&ToWorker::Free { object: 7 }).unwrap();
            let parked = DEFERRED_WAKES.with(|d| d.borrow().len());
            assert_eq!(parked, 1, "the writer's wake waits for the flush");
            flush_deferred();
            assert_eq!(DEFERRED_WAKES.with(|d| d.borrow().len()), 0);
            expect_frees(&mut rx, &[7]).await;
        })
        .await
        .expect("deadline");
    }

    /// Two frames on one connection while writes are deferred (a delivery
    /// and its call, under the driver's lock): the second wakes no writer
    /// task, so nothing is written before `flush_deferred`, which writes
    /// both, in order. Before, the second woke the writer task, which
    /// wrote them under the lock (and cost the sender a wake-up).
    #[tokio::test(flavor = "current_thread")]
    async fn a_frame_behind_deferred_ones_waits_for_the_flush() {
        tokio::time::timeout(Duration::from_secs(10), async {
            let (tx, mut rx) = connected(1 << 20);
            defer_writes();
            tx.send(&ToWorker::Free { object: 1 }).unwrap();
            tx.send(&ToWorker::Free { object: 2 }).unwrap();
            // Every task the sends woke runs during these yields (one
            // thread): a woken writer would write both frames now.
            for _ in 0..16 {
                tokio::task::yield_now().await;
            }
            {
                let mut recv = std::pin::pin!(rx.recv::<ToWorker>());
                assert!(
                    futures::poll!(recv.as_mut()).is_pending(),
                    "nothing is written before the flush"
                );
            }
            assert_eq!(tx.inner.queue.lock().chunks.len(), 2, "both still queued");
            flush_deferred();
            expect_frees(&mut rx, &[1, 2]).await;
        })
        .await
        .expect("deadline");
    }

    /// A task notified with `notify_after_flush` while writes are
    /// deferred hears it only once they are flushed; without deferred
    /// writes, at once.
    #[tokio::test]
    async fn a_notify_after_flush_waits_for_the_flush() {
        tokio::time::timeout(Duration::from_secs(10), async {
            let task = Arc::new(tokio::sync::Notify::new());
            defer_writes();
            notify_after_flush(&task);
            {
                let mut heard = std::pin::pin!(task.notified());
                assert!(
                    futures::poll!(heard.as_mut()).is_pending(),
                    "not before the flush"
                );
                flush_deferred();
                heard.await;
            }
            notify_after_flush(&task);
            let mut heard = std::pin::pin!(task.notified());
            assert!(futures::poll!(heard.as_mut()).is_ready(), "at once");
        })
        .await
        .expect("deadline");
    }

    /// In a process that spins (hot window), a poll reads bytes tokio has
    /// not seen yet (its I/O driver was not polled since they came): on
    /// a current-thread runtime that never yielded, only the direct read
    /// can find them.
    #[tokio::test(flavor = "current_thread")]
    async fn a_hot_poll_reads_bytes_tokio_has_not_seen() {
        use std::io::Write;
        use std::task::Poll;
        let window = rdt_transport::hot::window();
        rdt_transport::hot::set_window(Duration::from_millis(5));
        let (mut a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        b.set_nonblocking(true).unwrap();
        let b = UnixStream::from_std(b).unwrap();
        let mut rx = Receiver::new(ReadHalf::Unix(b.into_split().0), 1 << 20);
        let frame = wire::to_frame_with_length(&ToDriver::Pong).unwrap();
        assert!(frame.blobs.is_empty());
        a.write_all(&frame.head).unwrap();
        let before = DIRECT_READS.load(std::sync::atomic::Ordering::Relaxed);
        let polled = {
            let mut recv = std::pin::pin!(rx.recv::<ToDriver>());
            futures::poll!(recv.as_mut())
        };
        rdt_transport::hot::set_window(window);
        assert!(
            matches!(polled, Poll::Ready(Ok(Some(ToDriver::Pong)))),
            "the first poll, before tokio saw the socket readable, found the frame"
        );
        assert!(DIRECT_READS.load(std::sync::atomic::Ordering::Relaxed) > before);
        // The end of the stream is read directly too, as an end.
        drop(a);
        let end = tokio::time::timeout(Duration::from_secs(10), rx.recv::<ToDriver>())
            .await
            .expect("deadline");
        assert!(matches!(end, Ok(None)));
    }

    #[tokio::test]
    async fn a_cancelled_recv_resumes_the_frame_and_large_blobs_land_in_pooled_buffers() {
        use tokio::io::AsyncWriteExt;
        tokio::time::timeout(Duration::from_secs(10), async {
            let big = Blob::new(bytes::Bytes::from(
                (0..3 << 20).map(|i| (i % 251) as u8).collect::<Vec<u8>>(),
            ));
            let small = Blob::new(bytes::Bytes::from(vec![5u8; 100]));
            let msg = ToDriver::Fetched {
                req: 9,
                result: Ok(WireValue {
                    data: small.clone(),
                    transport: Transport::ObjectStore,
                    exported: WireExported::new(Exported {
                        inline: vec![big.clone()],
                        ..Default::default()
                    })
                    .unwrap(),
                    refs: vec![],
                }),
            };
            let frame = wire::to_frame(&msg).unwrap();
            let mut bytes = (frame.len() as u64).to_be_bytes().to_vec();
            bytes.extend_from_slice(&frame.head);
            for b in &frame.blobs {
                let FramePart::Here(b) = b else {
                    panic!("all here")
                };
                bytes.extend_from_slice(b);
            }
            let (mut a, b) = tokio::io::duplex(8 << 20);
            let mut rx = Receiver::new(b, 64 << 20);
            let before = rdt_transport::host_pool::stats();
            // Half the frame, then a recv that gives up (cancelled) ...
            let half = bytes.len() / 2;
            a.write_all(&bytes[..half]).await.unwrap();
            let gave_up =
                tokio::time::timeout(Duration::from_millis(50), rx.recv::<ToDriver>()).await;
            assert!(gave_up.is_err(), "only half a frame was sent");
            // ... and the next recv finishes the same frame.
            a.write_all(&bytes[half..]).await.unwrap();
            let got = rx.recv::<ToDriver>().await.unwrap().unwrap();
            let ToDriver::Fetched {
                req: 9,
                result: Ok(v),
            } = got
            else {
                panic!("{got:?}")
            };
            assert_eq!(v.data, small);
            assert_eq!(v.exported.inline, vec![big]);
            // The large blob sits in a page-aligned pool buffer.
            assert_eq!(
                v.exported.inline[0].bytes().unwrap().as_ptr() as usize % 4096,
                0
            );
            let s = rdt_transport::host_pool::stats();
            // (Other tests of this binary use the pool too: at least one more.)
            assert!(s.misses + s.hits > before.misses + before.hits);
            // A clean end after the frame.
            drop(a);
            assert!(rx.recv::<ToDriver>().await.unwrap().is_none());
        })
        .await
        .unwrap();
    }

    /// A head as it arrives: encoded in another process, decoded here.
    fn arrived(e: Exported) -> WireExported {
        let w = WireExported::new(e).unwrap();
        postcard::from_bytes(&postcard::to_stdvec(&w).unwrap()).unwrap()
    }

    fn metas(n: usize, numel: usize) -> Exported {
        Exported {
            metas: (0..n)
                .map(|_| rdt_transport::Tensor::zeros(rdt_transport::DType::F32, &[numel]).meta())
                .collect(),
            handles: vec![7; 8 * n],
            inline: Vec::new(),
        }
    }

    /// A frame's body in one buffer, as a socket carries it (every blob
    /// here).
    fn flat(frame: &wire::Frame) -> Vec<u8> {
        let mut bytes = frame.head.to_vec();
        for b in &frame.blobs {
            let FramePart::Here(b) = b else {
                panic!("every blob is here")
            };
            bytes.extend_from_slice(b);
        }
        bytes
    }

    #[test]
    fn a_list_of_tensors_in_order_travels_as_its_count() {
        // A value with `data`, as a frame carries it, and back: the
        // frame's size and the data that came back.
        let round_trip = |data: Bytes| {
            let v = WireValue {
                data: Blob::new(data),
                transport: Transport::Nixl,
                exported: WireExported::new(metas(1, 1)).unwrap(),
                refs: Vec::new(),
            };
            let frame = wire::to_frame(&v).unwrap();
            let bytes = flat(&frame);
            let size = bytes.len();
            let back: WireValue = wire::from_frame(Bytes::from(bytes)).unwrap();
            (size, back.data.bytes().unwrap())
        };
        let weights: Vec<rdt_transport::Tensor> = (0..10_000)
            .map(|_| rdt_transport::Tensor::zeros(rdt_transport::DType::F32, &[1]))
            .collect();
        let data = rdt_transport::value::encode(&weights).unwrap().data;
        assert!(
            data.len() > 19_000,
            "10 000 placeholders: {} bytes",
            data.len()
        );
        let (size, back) = round_trip(data.clone());
        assert!(size < 200, "the frame carries the count: {size} bytes");
        assert_eq!(back, data, "the same data made again");
        // Forwarded as the driver does, what came back goes as its count
        // again.
        let (size, again) = round_trip(back.clone());
        assert!(size < 200, "forwarded: {size} bytes");
        assert_eq!(again, data);
        // Anything else travels as its bytes: a shorter list, the same
        // placeholders out of order, the list inside another value.
        let short = rdt_transport::value::encode(&weights[..63].to_vec())
            .unwrap()
            .data;
        let mut shuffled = data.to_vec();
        let last = shuffled.len() - 1;
        shuffled.swap(last - 1, last);
        let wrapped = rdt_transport::value::encode(&(7u8, weights.clone()))
            .unwrap()
            .data;
        for other in [short, Bytes::from(shuffled), wrapped] {
            let (size, back) = round_trip(other.clone());
            assert!(size > other.len(), "{size} bytes for {}", other.len());
            assert_eq!(back, other);
        }
    }

    #[test]
    fn a_count_of_tensors_past_the_limit_is_malformed() {
        #[derive(Serialize)]
        enum Out {
            #[allow(dead_code)]
            Bytes(()),
            TensorsInOrder(u64),
        }
        #[derive(Serialize)]
        struct Forged {
            data: Out,
            transport: Transport,
            exported: WireExported,
            refs: Vec<u64>,
        }
        let forged = Forged {
            data: Out::TensorsInOrder(rdt_transport::MAX_TENSORS as u64 + 1),
            transport: Transport::Nixl,
            exported: WireExported::new(metas(1, 1)).unwrap(),
            refs: Vec::new(),
        };
        let bytes = flat(&wire::to_frame(&forged).unwrap());
        assert!(wire::from_frame::<WireValue>(Bytes::from(bytes)).is_err());
    }

    #[test]
    fn a_large_head_travels_beside_the_header_and_a_small_one_inside() {
        // A value as a frame carries it, and back.
        let round_trip = |e: Exported| {
            let v = WireValue {
                data: Blob::new(Bytes::from_static(b"data")),
                transport: Transport::Nixl,
                exported: WireExported::new(e).unwrap(),
                refs: Vec::new(),
            };
            let frame = wire::to_frame(&v).unwrap();
            let blob_bytes: usize = frame.blobs.iter().map(|b| b.len()).sum();
            let bytes = flat(&frame);
            let back: WireValue = wire::from_frame(Bytes::from(bytes)).unwrap();
            (frame.head.len(), blob_bytes, back)
        };
        // 10 000 tensors: about 100 KB of head, outside the header.
        let (header, blobs, back) = round_trip(metas(10_000, 1024));
        assert!(header < 1024, "the header holds no head: {header} bytes");
        assert!(blobs > 50_000, "the head is a blob: {blobs} bytes of blobs");
        let e = back.exported.get().unwrap();
        assert_eq!(e.metas.len(), 10_000);
        assert_eq!(e.metas[9_999].shape.as_slice(), &[1024]);
        assert_eq!(e.handles, vec![7; 80_000]);
        // Two tensors: the head stays inside, the data is the one blob.
        let (header, blobs, back) = round_trip(metas(2, 4));
        assert!(header > 16 + 4 && header <= 16 + head_wire::INLINE_MAX);
        assert_eq!(blobs, 4, "only the data travels beside");
        assert_eq!(back.exported.get().unwrap().metas.len(), 2);
    }

    #[test]
    fn a_head_decoded_lately_is_found_by_its_bytes() {
        // Two objects with the same head (the same parameters, two steps
        // of a weight sync): one decode.
        let (a, b) = (arrived(metas(300, 4)), arrived(metas(300, 4)));
        assert!(a.head.len() >= RecentHeads::MIN_HEAD);
        assert!(std::ptr::eq(a.get().unwrap(), b.get().unwrap()));
        // ... and one layout, which transports key their plans on.
        assert!(a.layout().is_some());
        assert_eq!(a.layout(), b.layout());
        // Another head (other shapes) is decoded on its own, and right,
        // with a layout of its own.
        let c = arrived(metas(300, 5));
        assert!(!std::ptr::eq(a.get().unwrap(), c.get().unwrap()));
        assert_eq!(c.get().unwrap().metas[0].shape.as_slice(), &[5]);
        assert_ne!(a.layout(), c.layout());
        // Small heads are kept apart: found by their bytes too, with one
        // layout (shapes no other test uses: the lists are the process's).
        let (d, e) = (arrived(metas(2, 4321)), arrived(metas(2, 4321)));
        assert!(d.head.len() < RecentHeads::MIN_HEAD);
        assert_eq!(d.layout(), None, "no layout before the head is read");
        assert!(std::ptr::eq(d.get().unwrap(), e.get().unwrap()));
        assert_eq!(d.layout(), e.layout());
        // A run of other small heads does not push a large one out.
        for n in 0..2 * RecentHeads::KEEP {
            arrived(metas(1, 5000 + n)).get().unwrap();
        }
        let f = arrived(metas(300, 4));
        assert!(std::ptr::eq(a.get().unwrap(), f.get().unwrap()));
    }

    #[test]
    fn transports_travel_as_ids_and_an_unknown_id_is_an_error() {
        for t in Transport::registered() {
            let bytes = postcard::to_stdvec(&t).unwrap();
            assert_eq!(bytes.len(), 1, "{t} is one varint byte, not its name");
            assert_eq!(postcard::from_bytes::<Transport>(&bytes).unwrap(), t);
        }
        let e = postcard::from_bytes::<Transport>(&postcard::to_stdvec(&999u16).unwrap());
        assert!(e.is_err());
        // A transport the driver does not link in cannot be named.
        assert!(postcard::to_stdvec(&Transport::named("not_linked_anywhere")).is_err());
    }

    #[tokio::test]
    async fn malformed_frame_is_an_error() {
        use tokio::io::AsyncWriteExt;
        tokio::time::timeout(Duration::from_secs(10), async {
            let (mut a, b) = tokio::io::duplex(1024);
            let mut rx = Receiver::new(b, 1024);
            a.write_all(&5u64.to_be_bytes()).await.unwrap();
            a.write_all(&[1, 2, 3, 4, 5]).await.unwrap();
            assert!(matches!(
                rx.recv::<ToWorker>().await,
                Err(Error::Protocol(_))
            ));
        })
        .await
        .unwrap();
    }

    /// A frame with one blob of `len` bytes, as its sender writes it
    /// (length, head, blob), and the value it carries.
    fn fetched_frame(len: usize) -> (Vec<u8>, Vec<u8>) {
        let blob: Vec<u8> = (0..len).map(|i| (i % 253) as u8).collect();
        let msg = ToDriver::Fetched {
            req: 1,
            result: Ok(WireValue {
                data: Blob::new(bytes::Bytes::from_static(b"d")),
                transport: Transport::ObjectStore,
                exported: WireExported::new(Exported {
                    inline: vec![Blob::new(bytes::Bytes::from(blob.clone()))],
                    ..Default::default()
                })
                .unwrap(),
                refs: vec![],
            }),
        };
        (flat(&wire::to_frame_with_length(&msg).unwrap()), blob)
    }

    /// The driver's hop of the object-store path, on real sockets: a
    /// receiver (the driver's, from the producer) and a sender that
    /// forwards what it got (to the consumer), and the consumer's receiver.
    struct Relay {
        producer: tokio::net::UnixStream,
        from_producer: Receiver<ReadHalf>,
        to_consumer: Sender,
        at_consumer: Receiver<ReadHalf>,
    }

    fn relay() -> Relay {
        use tokio::net::UnixStream;
        let (producer, driver_in) = UnixStream::pair().unwrap();
        let (driver_out, consumer) = UnixStream::pair().unwrap();
        let (r, _w) = driver_in.into_split();
        std::mem::forget(_w);
        let (_r, w) = driver_out.into_split();
        std::mem::forget(_r);
        let (cr, cw) = consumer.into_split();
        std::mem::forget(cw);
        Relay {
            producer,
            from_producer: Receiver::new(ReadHalf::Unix(r), 1 << 30),
            to_consumer: spawn_writer(WriteHalf::Unix(w), 1 << 30),
            at_consumer: Receiver::new(ReadHalf::Unix(cr), 1 << 30),
        }
    }

    fn forward(v: WireValue) -> ToWorker {
        ToWorker::Deliver {
            object: 7,
            value: Ok(Delivery {
                value: v,
                from: None,
                xfer: 0,
                group: None,
                ack_at_landing: false,
            }),
        }
    }

    fn delivered(m: ToWorker) -> WireValue {
        match m {
            ToWorker::Deliver { value: Ok(d), .. } => d.value,
            other => panic!("{other:?}"),
        }
    }

    fn fetched(m: ToDriver) -> WireValue {
        match m {
            ToDriver::Fetched { result: Ok(v), .. } => v,
            other => panic!("{other:?}"),
        }
    }

    /// The producer's side: writes the first `half` of `bytes`, then, when
    /// told, the rest (`true`: a producer that finishes) or nothing
    /// (`false`: one that dies mid-blob), and closes its socket.
    fn produce(
        producer: tokio::net::UnixStream,
        bytes: Vec<u8>,
        half: usize,
    ) -> (
        tokio::sync::oneshot::Sender<bool>,
        tokio::task::JoinHandle<()>,
    ) {
        use tokio::io::AsyncWriteExt;
        let (tell, told) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut producer = producer;
            producer.write_all(&bytes[..half]).await.unwrap();
            if told.await.unwrap_or(false) {
                producer.write_all(&bytes[half..]).await.unwrap();
            }
        });
        (tell, task)
    }

    #[tokio::test]
    async fn a_large_blob_is_handed_up_and_forwarded_while_it_arrives() {
        tokio::time::timeout(Duration::from_secs(30), async {
            let Relay {
                producer,
                mut from_producer,
                to_consumer,
                mut at_consumer,
            } = relay();
            let len = 3 * STREAM_MIN;
            let (bytes, blob) = fetched_frame(len);
            // The head and the first half of the blob, then the rest when
            // told.
            let half = bytes.len() - len / 2;
            let (more, producer) = produce(producer, bytes, half);
            let v = fetched(from_producer.recv().await.unwrap().unwrap());
            let at_driver = v.exported.inline[0].clone();
            assert!(
                at_driver.still_arriving().is_some(),
                "handed up before the blob is in"
            );
            // Forwarded before it is whole; the driver's reader goes on.
            to_consumer.send(&forward(v)).unwrap();
            let reader = tokio::spawn(async move {
                let r = from_producer.recv::<ToDriver>().await;
                (from_producer, r)
            });
            let v = delivered(at_consumer.recv::<ToWorker>().await.unwrap().unwrap());
            let at_consumer_blob = v.exported.inline[0].clone();
            let consumer_reader = tokio::spawn(async move {
                at_consumer.finish_frame().await.unwrap();
                at_consumer
            });
            // The consumer gets bytes while the driver's copy is not whole:
            // cut-through, not store-and-forward.
            let arriving = at_consumer_blob.still_arriving().unwrap().clone();
            let mut seen = 0;
            while seen < len / 4 {
                match arriving.progress_beyond(seen).await {
                    rdt_transport::arriving::Progress::Filling(n) => seen = n,
                    p => panic!("ended early: {p:?}"),
                }
            }
            assert!(at_driver.still_arriving().is_some());
            assert_eq!(arriving.prefix(seen), &blob[..seen]);
            let (_, early) = to_consumer.forwarded();
            assert!(early >= seen as u64 / 2, "sent before whole: {early}");
            // The rest: both ends become whole, with the right bytes.
            more.send(true).unwrap();
            producer.await.unwrap();
            assert_eq!(&at_driver.arrived().await.unwrap()[..], &blob[..]);
            assert_eq!(&at_consumer_blob.arrived().await.unwrap()[..], &blob[..]);
            let mut at_consumer = consumer_reader.await.unwrap();
            // Both connections go on: a clean end at the driver (the
            // producer closed its socket), the next frame at the consumer.
            let (_, end) = reader.await.unwrap();
            assert!(end.unwrap().is_none());
            to_consumer.send(&ToWorker::Ping).unwrap();
            assert!(matches!(
                at_consumer.recv::<ToWorker>().await.unwrap(),
                Some(ToWorker::Ping)
            ));
        })
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn a_blob_cut_off_at_its_source_is_lost_downstream_and_the_connection_goes_on() {
        tokio::time::timeout(Duration::from_secs(30), async {
            let Relay {
                producer,
                mut from_producer,
                to_consumer,
                mut at_consumer,
            } = relay();
            let len = 2 * STREAM_MIN;
            let (bytes, _) = fetched_frame(len);
            let half = bytes.len() - len / 2;
            let (die, producer) = produce(producer, bytes, half);
            let v = fetched(from_producer.recv().await.unwrap().unwrap());
            let at_driver = v.clone();
            to_consumer.send(&forward(v)).unwrap();
            // The producer dies mid-blob.
            die.send(false).unwrap();
            assert!(from_producer.recv::<ToDriver>().await.is_err());
            producer.await.unwrap();
            drop(from_producer);
            let e = at_driver.arrived().await.unwrap_err().to_string();
            assert!(e.contains("stopped after"), "{e}");
            assert!(at_driver.lost().is_some());
            // The consumer gets the frame (padded) and a status that says
            // its bytes are lost: the value fails, it is never used.
            let v = delivered(at_consumer.recv::<ToWorker>().await.unwrap().unwrap());
            let reader = tokio::spawn(async move {
                let next = at_consumer.recv::<ToWorker>().await;
                (at_consumer, next)
            });
            let e = v.arrived().await.unwrap_err().to_string();
            assert!(e.contains("lost on the way"), "{e}");
            // The connection stays in step: the next frame arrives whole.
            to_consumer.send(&ToWorker::Ping).unwrap();
            let (_, next) = reader.await.unwrap();
            assert!(matches!(next.unwrap(), Some(ToWorker::Ping)));
        })
        .await
        .unwrap();
    }
    #[tokio::test]
    async fn a_stalled_source_gives_up_its_forward_after_the_limit_and_frees_the_connection() {
        tokio::time::timeout(Duration::from_secs(30), async {
            let Relay {
                producer,
                mut from_producer,
                to_consumer,
                mut at_consumer,
            } = relay();
            to_consumer.set_stall_limit(Duration::from_millis(300));
            let len = 2 * STREAM_MIN;
            let (bytes, blob) = fetched_frame(len);
            let half = bytes.len() - len / 2;
            // The producer stops mid-blob (stopped, not dead: its socket
            // stays open), and goes on only when told.
            let (more, producer) = produce(producer, bytes, half);
            let v = fetched(from_producer.recv().await.unwrap().unwrap());
            let at_driver = v.exported.inline[0].clone();
            let reader = tokio::spawn(async move {
                let r = from_producer.recv::<ToDriver>().await;
                (from_producer, r)
            });
            to_consumer.send(&forward(v)).unwrap();
            let t0 = std::time::Instant::now();
            // The consumer's copy fails once no byte came for the limit...
            let v = delivered(at_consumer.recv::<ToWorker>().await.unwrap().unwrap());
            let consumer_reader = tokio::spawn(async move {
                let next = at_consumer.recv::<ToWorker>().await;
                (at_consumer, next)
            });
            let e = v.arrived().await.unwrap_err().to_string();
            assert!(e.contains("stopped coming"), "{e}");
            assert!(
                t0.elapsed() >= Duration::from_millis(300),
                "{:?}",
                t0.elapsed()
            );
            // ...and the connection to it goes on while the producer is
            // still stopped.
            to_consumer.send(&ToWorker::Ping).unwrap();
            let (_, next) = consumer_reader.await.unwrap();
            assert!(matches!(next.unwrap(), Some(ToWorker::Ping)));
            assert!(at_driver.still_arriving().is_some());
            // The driver's own copy is untouched: whole once the producer
            // goes on.
            more.send(true).unwrap();
            producer.await.unwrap();
            assert_eq!(&at_driver.arrived().await.unwrap()[..], &blob[..]);
            let (_, end) = reader.await.unwrap();
            assert!(end.unwrap().is_none());
        })
        .await
        .unwrap();
    }
}
