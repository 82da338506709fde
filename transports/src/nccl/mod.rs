//! The `nccl` transport: CUDA tensors between the members of a collective
//! group, over NCCL point-to-point, stream-ordered.
//!
//! NCCL runs under rdt's own thin wrapper ([`api`](mod@api), [`comm`](mod@comm)) over
//! cudarc's `nccl::sys` types, loaded at run time: cudarc's safe `Comm` is
//! `!Send`, exposes no raw handle, cannot be aborted from a watchdog, and
//! cudarc 0.19 never looks for `libnccl.so.2`.
//!
//! # How a group and a transfer go
//! - **Group (XF-2).** The framework asks rank 0 for a unique id
//!   ([`TensorTransport::group_bootstrap`]); rank 0's process runs NCCL's
//!   bootstrap root from then on. Every member then joins with it
//!   ([`TensorTransport::create_group`]): a non-blocking
//!   `ncclCommInitRankConfig` on the member's first GPU, polled until
//!   every rank joined. The communicator gets a stream of its own.
//! - **Transfer (XF-3).** The framework runs a group's transfers one after
//!   the other on the group's own thread. A send or a receive is one NCCL
//!   group call holding every tensor of the object, enqueued on the
//!   communicator's stream after the stream waits for the tensors' ready
//!   events (rdt's stream, and any event a library recorded with
//!   `Tensor::produced_on_stream`). It returns once NCCL took the call: the
//!   bytes move while the next transfer is enqueued.
//! - **Stream order (§6.4).** The receive records a done event on the
//!   communicator's stream and gives it to every received tensor: rdt's
//!   next use of a tensor (an op, a copy, `cuda_ready`, or
//!   `Tensor::ready_on_stream` for a library's stream) waits for it on the
//!   GPU. The method can start while the bytes arrive; its first kernel
//!   waits. [`TensorTransport::landed`] tells the framework when the bytes
//!   are in (it acknowledges the receive then).
//! - **Memory.** Received tensors come from rdt's allocator on the
//!   communicator's GPU, or are the target tensors the receive was given.
//!   Memory a transfer reads or writes stays alive until the GPU passed
//!   the transfer's done event, whatever the framework frees meanwhile
//!   (a stream-ordered free, as PyTorch's `record_stream`). Fresh memory
//!   is taken clean where the allocator has some (rdt's stream passed its
//!   last use: `cuda::alloc`, invariant 5), and then the receive does not
//!   wait for rdt's stream, so it overlaps compute queued there (NC-6).
//!   Otherwise, and for targets (which compute queued there may still
//!   read), the communicator's stream waits for rdt's stream first.
//! - **Failures.** `abort_group` aborts the communicator from a thread of
//!   its own (`ncclCommAbort`); transfers in it fail with NCCL's message;
//!   later transfers in the group are refused. The process, its other
//!   groups and transports go on.

pub mod api;
pub mod comm;

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::registry::{ProcessContext, Registration};
use crate::transport::{
    check_received, Exported, GroupSpec, ObjectKey, Peer, Sidedness, Target, TensorTransport,
    TransferCtx, TransferId, TransportError,
};
use crate::{cuda, device::Device, tensor::Tensor};
pub use api::{available, NcclError};
pub use comm::{Communicator, P2p, UniqueId};

const NAME: &str = "nccl";

crate::register_transport!(Registration {
    name: NAME,
    sidedness: Sidedness::TwoSided,
    collective: true,
    devices: "CUDA",
    same_host_only: false,
    start,
});

/// Starting costs nothing: NCCL is loaded when a group is created (and
/// its absence is that call's error, not every worker's).
fn start(cx: &ProcessContext) -> Result<Arc<dyn TensorTransport>, String> {
    Ok(Arc::new(NcclTransport::new(cx.transfer_timeout)))
}

/// Counters of this process's nccl receives (for tests and benchmarks).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct NcclStats {
    /// Receives enqueued.
    pub receives: u64,
    /// Of those, receives into fresh memory that was clean: they did not
    /// wait for rdt's stream (NC-6).
    pub receives_clean: u64,
    /// Of those, receives straight into target tensors.
    pub receives_into_targets: u64,
}

static RECEIVES: AtomicU64 = AtomicU64::new(0);
static RECEIVES_CLEAN: AtomicU64 = AtomicU64::new(0);
static RECEIVES_INTO_TARGETS: AtomicU64 = AtomicU64::new(0);

/// This process's counters.
pub fn stats() -> NcclStats {
    NcclStats {
        receives: RECEIVES.load(Ordering::Relaxed),
        receives_clean: RECEIVES_CLEAN.load(Ordering::Relaxed),
        receives_into_targets: RECEIVES_INTO_TARGETS.load(Ordering::Relaxed),
    }
}

/// How long a landing waits asking the GPU again before it polls every
/// millisecond.
const LANDING_SPIN: Duration = Duration::from_micros(50);

/// The `nccl` transport of one process.
pub struct NcclTransport {
    /// This process's communicators, by group id.
    comms: Mutex<HashMap<u64, Arc<Communicator>>>,
    /// Receives that returned before their bytes landed, by transfer.
    landings: Mutex<HashMap<TransferId, oneshot::Receiver<Result<(), TransportError>>>>,
    /// The framework's transfer deadline: also the bound on a destroy's
    /// wait for what is in flight.
    deadline: Duration,
}

impl NcclTransport {
    /// A transport with no group yet.
    pub fn new(deadline: Duration) -> Self {
        NcclTransport {
            comms: Mutex::new(HashMap::new()),
            landings: Mutex::new(HashMap::new()),
            deadline,
        }
    }

    fn comm(
        &self,
        cx: &TransferCtx,
        peer: &Peer,
    ) -> Result<(Arc<Communicator>, usize), TransportError> {
        let Some(g) = cx.group else {
            return Err(TransportError::with_peer(
                NAME,
                peer,
                "an nccl transfer needs a collective group (Runtime::create_collective_group with Transport::Nccl)",
            ));
        };
        let comm = self.comms.lock().get(&g.id).cloned().ok_or_else(|| {
            TransportError::with_peer(
                NAME,
                peer,
                format!(
                    "this process has no communicator for group {} (destroyed or aborted)",
                    g.id
                ),
            )
        })?;
        Ok((comm, g.peer_rank as usize))
    }
}

fn err(e: impl std::fmt::Display) -> TransportError {
    TransportError::new(NAME, e.to_string())
}

/// Why nccl refuses a device that is not CUDA.
const CUDA_ONLY: &str =
    "nccl moves CUDA tensors only; for CPU tensors use tcp (collective) or shm (one-sided, same host)";

/// [`CUDA_ONLY`] for tensor `i` of an object, naming it.
fn check_tensor_device(
    i: usize,
    dtype: crate::dtype::DType,
    shape: &[usize],
    device: &Device,
) -> Result<(), TransportError> {
    match device {
        Device::Cuda { .. } => Ok(()),
        Device::Cpu => Err(err(format!(
            "tensor #{i} ({dtype} {shape:?}) is on cpu: {CUDA_ONLY}"
        ))),
    }
}

/// `(device address, bytes)` of a CUDA tensor on `gpu`, or why it cannot
/// take part in a transfer on it. Takes the tensor's ready event over to
/// rdt's stream (the caller orders the communicator's stream after it).
fn device_range(
    t: &Tensor,
    i: usize,
    gpu: &Arc<cuda::Gpu>,
) -> Result<(u64, usize), TransportError> {
    check_tensor_device(i, t.dtype(), t.shape(), t.device())?;
    t.with_device_buffer(|d| {
        if !Arc::ptr_eq(d.gpu(), gpu) {
            return Err(err(format!(
                "tensor #{i} ({} {:?}) is used from cuda:{}, but this process's nccl communicator is on cuda:{}: move it there first (Tensor::to_device)",
                t.dtype(),
                t.shape(),
                d.gpu().ordinal(),
                gpu.ordinal()
            )));
        }
        Ok((d.device_ptr(), d.len()))
    })
    .map_err(err)?
}

impl TensorTransport for NcclTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn sidedness(&self) -> Sidedness {
        Sidedness::TwoSided
    }

    fn check_device(&self, device: &Device) -> Result<(), TransportError> {
        match device {
            Device::Cuda { .. } => Ok(()),
            Device::Cpu => Err(err(CUDA_ONLY)),
        }
    }

    fn export<'a>(
        &'a self,
        _key: ObjectKey,
        tensors: &'a [Tensor],
    ) -> BoxFuture<'a, Result<Exported, TransportError>> {
        Box::pin(async move {
            for (i, t) in tensors.iter().enumerate() {
                if !t.is_cuda() {
                    return Err(err(format!(
                        "tensor #{i} ({} {:?}) is on {}: nccl moves CUDA tensors only (use tcp for CPU tensors)",
                        t.dtype(),
                        t.shape(),
                        t.device()
                    )));
                }
            }
            Ok(Exported {
                metas: tensors.iter().map(Tensor::meta).collect(),
                ..Default::default()
            })
        })
    }

    fn group_bootstrap<'a>(
        &'a self,
        _spec: &'a GroupSpec,
    ) -> BoxFuture<'a, Result<Vec<u8>, TransportError>> {
        Box::pin(async move { Ok(UniqueId::new().map_err(err)?.to_bytes()) })
    }

    fn create_group<'a>(
        &'a self,
        spec: &'a GroupSpec,
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            let id = UniqueId::from_bytes(&spec.bootstrap).map_err(err)?;
            // The group runs on this process's first visible GPU.
            let gpu = cuda::gpu(0).map_err(|e| {
                err(format!(
                    "an nccl group needs a CUDA device in every member: {e}"
                ))
            })?;
            let comm = Communicator::start(&id, spec.ranks.len(), spec.my_rank as usize, gpu)
                .map_err(err)?;
            // Known before it is ready: a destroy or an abort during the
            // join stops it.
            self.comms.lock().insert(spec.id, comm.clone());
            if let Err(e) = comm.ready().await {
                self.comms.lock().remove(&spec.id);
                abort_in_background(comm, e.0.clone());
                return Err(err(e));
            }
            Ok(())
        })
    }

    fn destroy_group(&self, group: u64) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            let comm = self.comms.lock().remove(&group);
            match comm {
                Some(c) => c.destroy(self.deadline).await.map_err(err),
                None => Ok(()),
            }
        })
    }

    fn abort_group(&self, group: u64, reason: &str) {
        // Kept in the map: a transfer that still looks it up fails with
        // the reason. A destroy removes it.
        if let Some(c) = self.comms.lock().get(&group).cloned() {
            abort_in_background(c, reason.to_string());
        }
    }

    fn send<'a>(
        &'a self,
        to: &'a Peer,
        cx: &'a TransferCtx,
        tensors: &'a [Tensor],
    ) -> BoxFuture<'a, Result<(), TransportError>> {
        Box::pin(async move {
            crate::trace::timeline("nccl send start", cx.xfer);
            let (comm, peer) = self.comm(cx, to)?;
            let send = |ptr, len| P2p::Send { peer, ptr, len };
            // The tensors' producers ran on rdt's stream (device_range took
            // their ready events over to it).
            let done = enqueue(&comm, to, tensors, send, true, SEND, cx.xfer).await?;
            // The memory stays alive until the GPU read it (a free of the
            // object meanwhile does not recycle it).
            keep_until_done(comm, done, tensors.to_vec(), to.clone(), SEND, cx.xfer);
            Ok(())
        })
    }

    fn receive<'a>(
        &'a self,
        from: &'a Peer,
        cx: &'a TransferCtx,
        exported: &'a Exported,
    ) -> BoxFuture<'a, Result<Vec<Tensor>, TransportError>> {
        Box::pin(async move {
            crate::trace::timeline("nccl receive start", cx.xfer);
            let (comm, peer) = self.comm(cx, from)?;
            let gpu = comm.gpu().clone();
            for (i, m) in exported.metas.iter().enumerate() {
                check_tensor_device(i, m.dtype, &m.shape, &m.device)
                    .map_err(|e| TransportError::with_peer(NAME, from, e.message))?;
            }
            // Into the targets where they are on this GPU (no staging);
            // otherwise into fresh memory here, placed afterwards.
            let in_place = match &cx.target {
                Target::Tensors(ts) => {
                    check_received(NAME, &exported.metas, ts)?;
                    ts.iter().all(|t| {
                        t.is_cuda()
                            && t.with_device_buffer(|d| Arc::ptr_eq(d.gpu(), &gpu))
                                .unwrap_or(false)
                    })
                }
                _ => false,
            };
            // NC-6: targets may have work pending on rdt's stream, and so
            // may fresh memory that is not clean; then the receive waits
            // for rdt's stream.
            let (tensors, clean): (Vec<Tensor>, bool) = match (&cx.target, in_place) {
                (Target::Tensors(ts), true) => (ts.to_vec(), false),
                _ => {
                    let mut clean = true;
                    let ts = exported
                        .metas
                        .iter()
                        .map(|m| {
                            let (t, c) = Tensor::cuda_empty_for_other_stream(
                                m.dtype,
                                &m.shape,
                                gpu.ordinal(),
                            )?;
                            clean &= c;
                            Ok(t)
                        })
                        .collect::<Result<_, crate::tensor::TensorError>>()
                        .map_err(err)?;
                    (ts, clean)
                }
            };
            crate::trace::timeline("nccl receive allocated", cx.xfer);
            let recv = |ptr, len| P2p::Recv { peer, ptr, len };
            let done = enqueue(&comm, from, &tensors, recv, !clean, RECEIVE, cx.xfer).await?;
            RECEIVES.fetch_add(1, Ordering::Relaxed);
            RECEIVES_CLEAN.fetch_add(u64::from(clean), Ordering::Relaxed);
            RECEIVES_INTO_TARGETS.fetch_add(u64::from(in_place), Ordering::Relaxed);
            for t in &tensors {
                t.set_ready_event(done.clone());
            }
            let rx = keep_until_done(comm, done, tensors.clone(), from.clone(), RECEIVE, cx.xfer);
            let placed = match (&cx.target, in_place) {
                (Target::Tensors(_), true) => Ok(tensors),
                (target, _) => target.place(NAME, &exported.metas, tensors),
            };
            if placed.is_ok() {
                self.landings.lock().insert(cx.xfer, rx);
            }
            placed
        })
    }

    fn landed(&self, xfer: TransferId) -> Option<BoxFuture<'static, Result<(), TransportError>>> {
        let rx = self.landings.lock().remove(&xfer)?;
        Some(Box::pin(async move {
            rx.await
                .unwrap_or_else(|_| Err(err("the receive's landing was dropped")))
        }))
    }
}

/// The timeline labels of one side of a transfer (see
/// `cuda::timeline`): ordered, group call made, enqueued, done.
struct Side([&'static str; 4]);

const SEND: Side = Side([
    "nccl send ordered",
    "nccl send group call",
    "nccl send enqueued",
    "nccl send done",
]);
const RECEIVE: Side = Side([
    "nccl receive ordered",
    "nccl receive group call",
    "nccl receive enqueued",
    "nccl receive landed",
]);

/// One side of a transfer (§6.4): `tensors` as one NCCL group call (`op`
/// makes each tensor's send or receive) on the communicator's stream,
/// after that stream waits for rdt's if `after_rdt` (the tensors'
/// producers, the last user of memory that is not clean, work on
/// targets). Returns the call's done event.
async fn enqueue(
    comm: &Communicator,
    peer: &Peer,
    tensors: &[Tensor],
    op: impl Fn(u64, usize) -> P2p,
    after_rdt: bool,
    side: Side,
    xfer: TransferId,
) -> Result<Arc<cuda::StreamEvent>, TransportError> {
    let gpu = comm.gpu();
    let ops = tensors
        .iter()
        .enumerate()
        .map(|(i, t)| device_range(t, i, gpu).map(|(ptr, len)| op(ptr, len)))
        .collect::<Result<Vec<_>, _>>()?;
    if after_rdt {
        // SAFETY: the communicator's stream lives in this GPU's context.
        unsafe { gpu.order_stream_after_rdt(comm.raw_stream()) }.map_err(err)?;
    }
    crate::trace::timeline(side.0[0], xfer);
    comm.group(&ops)
        .await
        .map_err(|e| TransportError::with_peer(NAME, peer, e.0))?;
    crate::trace::timeline(side.0[1], xfer);
    let done = comm.record_done().map_err(err)?;
    crate::trace::timeline(side.0[2], xfer);
    Ok(done)
}

/// Keeps `kept` (the memory a transfer reads or writes) alive until the
/// GPU passed `done`, on a task of the calling thread (the group's); the
/// receiver hears how the transfer ended (a stream-ordered free, §6.4).
fn keep_until_done(
    comm: Arc<Communicator>,
    done: Arc<cuda::StreamEvent>,
    kept: Vec<Tensor>,
    peer: Peer,
    side: Side,
    xfer: TransferId,
) -> oneshot::Receiver<Result<(), TransportError>> {
    let (tx, rx) = oneshot::channel();
    tokio::spawn(async move {
        let r = comm
            .wait_done(&done, LANDING_SPIN.max(crate::rt::hot::window()))
            .await
            .map_err(|e| TransportError::with_peer(NAME, &peer, e.0));
        crate::trace::timeline(side.0[3], xfer);
        drop(kept);
        let _ = tx.send(r);
    });
    rx
}

/// Aborts `comm` from a thread of its own: `ncclCommAbort` may take a
/// while and must not hold up the caller (the worker's control loop).
fn abort_in_background(comm: Arc<Communicator>, reason: String) {
    let spawned = std::thread::Builder::new()
        .name("rdt-nccl-abort".into())
        .spawn({
            let comm = comm.clone();
            let reason = reason.clone();
            move || comm.abort(&reason)
        });
    if spawned.is_err() {
        comm.abort(&reason);
    }
}
