//! The messages between driver and workers, and their payloads.

use rdt_transport::{Blob, GroupRef, GroupSpec, Peer};
use serde::{Deserialize, Serialize};

use super::*;
use crate::error::Error;
use crate::transport::Transport;

/// An argument of a call.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum WireArg {
    /// Passed by value (tensors inline, object-store path).
    Value(WireValue),
    /// Passed by ref: the worker waits for the object in its store.
    Ref(u64),
    /// Passed by ref, its tensors put in this place of the callee's
    /// process before the method runs (`ObjectRef::to_device`).
    RefOn(u64, rdt_transport::Place),
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
    /// The trace it belongs to and the span that made it.
    pub context: CallContext,
}

/// What a call carries of where it came from, as tarpc's `Context` does:
/// the trace it belongs to and its caller's span, so the worker's `call`
/// span names the driver's, and a call an actor makes while it runs one
/// stays in that call's trace, across processes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CallContext {
    /// The trace: the id of the first call of the chain, the one the
    /// driver's program made.
    pub trace: u64,
    /// The caller's `call` span, as the subscriber of the caller's process
    /// numbered it (`tracing::Id::into_u64`); 0 where it had none (no
    /// subscriber took the span).
    pub caller_span: u64,
}

impl CallContext {
    /// The context of calls made under `span`, in `trace`.
    pub fn under(trace: u64, span: &tracing::Span) -> Self {
        CallContext {
            trace,
            caller_span: span.id().map_or(0, |id| id.into_u64()),
        }
    }
}

impl CallMsg {
    /// The objects its ref arguments name, in order.
    pub fn ref_args(&self) -> impl Iterator<Item = u64> + '_ {
        self.args.iter().filter_map(|a| match a {
            WireArg::Ref(r) | WireArg::RefOn(r, _) => Some(*r),
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
    /// (`None`: the worker's own default, `rdt_transport::rt::hot`).
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
    /// (`worker::straight`): a Unix socket in the runtime's private directory,
    /// for workers the driver spawned on its host; `None` for workers
    /// started by hand.
    pub peer_socket: Option<String>,
    /// Whether a value through the driver of 1 MiB or more goes straight
    /// to its consumer (`worker::straight`; `None`: the worker's default, by
    /// its core count).
    pub straight_large_values: Option<bool>,
    /// How the worker logs (`RuntimeBuilder::worker_log`).
    pub log: crate::log::WorkerLog,
    /// Where the tensors of values this actor receives land, by the GPU
    /// they come from (`Spawn::device_map`).
    #[serde(default)]
    pub device_map: rdt_transport::DeviceMap,
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
    /// The method's name, for the driver's span of the call.
    pub method_name: String,
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
    /// The call the submitter was running when it made this one, if any:
    /// this one joins its trace.
    pub context: Option<CallContext>,
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
    /// name (`worker::straight`, PD-1).
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

/// A worker's answer to its spawn order, once its actor is constructed.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SpawnedActor {
    /// The endpoints of this worker's transports, by transport name.
    pub endpoints: Vec<(String, String)>,
    /// How many CUDA devices its process sees (0: none, or no usable
    /// CUDA), so the driver refuses a call that puts an argument on one
    /// it lacks before any byte moves.
    pub cuda_devices: u32,
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
    Spawned(std::result::Result<SpawnedActor, Error>),
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
