//! What the worker's threads share ([`WorkerShared`]), and this process's one.

use super::*;

/// What the worker's threads share: the store, the control link, the
/// transfers, and the actor's side of the runtime (`client`).
pub(crate) struct WorkerShared {
    pub(super) name: Arc<str>,
    /// Where the tensors of values this actor receives land
    /// (`Spawn::device_map`).
    pub(super) device_map: rdt_transport::DeviceMap,
    pub(super) store: Store,
    pub(super) tx: protocol::Sender,
    /// Transfers this worker takes part in, by id: the sender aborts the
    /// receive or send (WK-4).
    pub(super) transfers: Mutex<HashMap<u64, oneshot::Sender<Error>>>,
    /// Objects being received, and whether they were freed meanwhile
    /// (a tombstone: the receive drops what it got instead of storing it).
    pub(super) receiving: Mutex<HashMap<u64, bool>>,
    /// Objects received, per transport: tests and logs see which path a
    /// value took.
    pub(super) received: Mutex<HashMap<Transport, u64>>,
    /// The collective groups this worker is in (XF-3).
    pub(super) groups: Mutex<HashMap<u64, WorkerGroup>>,
    /// Received objects whose bytes are still landing (stream-ordered
    /// receives, WK-5): a call that used one reports its result only once
    /// they landed, and fails if they did not.
    pub(super) landing: Mutex<HashMap<u64, Landed>>,
    /// Calls on their way to the actor's thread while it listens after a
    /// call (`handoff_queue.rs`, HF-1..3).
    pub(super) handoff: HandOff,
    /// Freed values still being dropped on the blocking pool (WK-6).
    pub(super) drops: Arc<AsideDrops>,
    /// The refs this actor holds, counted locally (CL-1).
    pub(super) local_refs: LocalRefs,
    /// The next id of this actor's own id space (AC-1).
    pub(super) next_object: std::sync::atomic::AtomicU64,
    /// `wait` inside the actor: answers the driver owes, by request.
    pub(super) watches: Mutex<HashMap<u64, oneshot::Sender<Result<()>>>>,
    /// Answers the driver owes to `Probe`s, by request (HO-6).
    pub(super) probes: Mutex<HashMap<u64, oneshot::Sender<Option<Result<()>>>>>,
    pub(super) next_req: std::sync::atomic::AtomicU64,
    /// This actor's id.
    pub(super) actor: u64,
    /// Results of calls this actor made to itself that have not run yet
    /// (HO-6).
    pub(super) self_calls: Mutex<std::collections::HashSet<u64>>,
    /// Target tensors `get_into` waits to fill, by object (WK-7).
    pub(super) targets: Mutex<HashMap<u64, crate::refs::targets::Registered>>,
    /// The first thread waiting for each object still being received, by
    /// object: a token (its registration's) and where to hand the
    /// receive's list (WK-8).
    pub(super) readers: Mutex<HashMap<u64, (u64, oneshot::Sender<TensorList>)>>,
    /// The targets last found to fit (WK-7).
    pub(super) fitted: Mutex<Option<FittedTargets>>,
    /// `get_into` calls whose receive wrote into the targets itself.
    pub(super) in_place: std::sync::atomic::AtomicU64,
    /// Receives the control loop started after the frames in hand
    /// (`ReceiveStart::AfterFramesInHand`).
    pub(super) started_after_frames: std::sync::atomic::AtomicU64,
    /// Receives a call acknowledged with its `CallDone` (WK-9).
    pub(super) acks_by_calls: std::sync::atomic::AtomicU64,
    /// How long a receive leaves its acknowledgement to a call that took
    /// it on, after the landing (`ack_wait`).
    pub(super) ack_wait: Duration,
    /// The control loop's runtime: where a receive's bounded wait for its
    /// call's end runs (WK-12).
    pub(super) control: tokio::runtime::Handle,
    /// Deliveries straight from producers to consumers (OW-9).
    pub(super) straight: straight::PeerDelivery,
    /// Calls received and not ended, per object they take as a ref
    /// (WK-13).
    pub(super) arg_uses: Mutex<HashMap<u64, u32>>,
}

pub(super) static WORKER: OnceLock<Arc<WorkerShared>> = OnceLock::new();

/// This worker's shared state; `None` outside a worker.
pub(crate) fn shared() -> Option<Arc<WorkerShared>> {
    WORKER.get().cloned()
}

pub(super) fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}
