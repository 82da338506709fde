//! One NCCL communicator: joined non-blocking, transfers on a blocking
//! child, abortable from any thread.
//!
//! # Two handles
//! A member joins with a **non-blocking** `ncclCommInitRankConfig`, polled
//! with `ncclCommGetAsyncError`: a join whose peer never comes can be
//! aborted. Transfers then run on a **blocking** child split from it
//! (`ncclCommSplit`, sharing its resources). On a non-blocking
//! communicator NCCL finishes every group call on a thread it starts for
//! that call (about 40 µs on the 2×H200 host, measured with this
//! wrapper); on a blocking one `ncclGroupEnd` returns once the kernels are
//! enqueued. The child connects to every peer at once (a one-byte
//! exchange), so that no later group call blocks on a connection to a peer
//! that stopped answering.
//!
//! # Invariants
//! - **NC-1 (one caller at a time).** Every NCCL call on the communicator
//!   is made under its lock, which is held only for calls that return at
//!   once: non-blocking calls, and blocking group calls to connected peers
//!   (which only enqueue). So an abort, from any thread, waits at most for
//!   one such call.
//! - **NC-2 (settled before the next call).** After a non-blocking init or
//!   finalize, nothing else is issued until `ncclCommGetAsyncError` stops
//!   saying `ncclInProgress` (NCCL's rule for non-blocking communicators).
//! - **NC-3 (abort is final).** After [`Communicator::abort`] both handles
//!   are gone: every later call fails with the reason given, and waits on
//!   its stream end (NCCL's kernels stop at the abort).
//! - **NC-4 (own stream).** The communicator's work runs on a stream of
//!   its own, in the primary context of its GPU (the one rdt uses), so
//!   transfers overlap rdt's and the user's compute; order across streams
//!   goes through events. The stream has the device's highest priority:
//!   a transfer's blocks start as soon as compute blocks end, not after a
//!   large kernel queued before it has placed all of its blocks.

use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::nccl::sys::{ncclComm_t, ncclDataType_t, ncclUniqueId};
use parking_lot::Mutex;

use super::api::{api, result, Api, NcclError};
use crate::cuda::{Gpu, StreamEvent};

/// How long a wait for NCCL asks again without sleeping. A group call on
/// a non-blocking communicator is finished by a thread NCCL starts for it:
/// it settles within a few hundred microseconds, and the communicator's
/// own thread has nothing else to do meanwhile.
const SPIN: Duration = Duration::from_millis(5);
/// Then it asks this often.
const POLL: Duration = Duration::from_millis(1);

/// The id every rank of a new communicator joins with. The process that
/// made it runs NCCL's bootstrap root: it must stay alive until every rank
/// has joined.
#[derive(Clone, Copy)]
pub struct UniqueId(ncclUniqueId);

impl UniqueId {
    /// A new id (`ncclGetUniqueId`).
    pub fn new() -> Result<Self, NcclError> {
        let a = api()?;
        // SAFETY: plain C data, filled by NCCL.
        let mut id: ncclUniqueId = unsafe { std::mem::zeroed() };
        // SAFETY: valid out-pointer.
        let r = unsafe { (a.get_unique_id)(&mut id) };
        if r != result::SUCCESS {
            return Err(a.error("ncclGetUniqueId", r, std::ptr::null_mut()));
        }
        Ok(UniqueId(id))
    }

    /// Its bytes, to send to the other ranks.
    pub fn to_bytes(&self) -> Vec<u8> {
        self.0.internal.iter().map(|&c| c as u8).collect()
    }

    /// An id from the bytes of [`to_bytes`](Self::to_bytes).
    pub fn from_bytes(b: &[u8]) -> Result<Self, NcclError> {
        // SAFETY: plain C data.
        let mut id: ncclUniqueId = unsafe { std::mem::zeroed() };
        if b.len() != id.internal.len() {
            return Err(NcclError(format!(
                "an NCCL unique id has {} bytes, got {}",
                id.internal.len(),
                b.len()
            )));
        }
        for (d, s) in id.internal.iter_mut().zip(b) {
            *d = *s as _;
        }
        Ok(UniqueId(id))
    }
}

/// One point-to-point operation of a group call: device memory of the
/// communicator's GPU, moved as bytes.
#[derive(Clone, Copy, Debug)]
pub enum P2p {
    /// Send `len` bytes at `ptr` to rank `peer`.
    Send {
        /// Receiving rank.
        peer: usize,
        /// Device address.
        ptr: u64,
        /// Bytes.
        len: usize,
    },
    /// Receive `len` bytes into `ptr` from rank `peer`.
    Recv {
        /// Sending rank.
        peer: usize,
        /// Device address.
        ptr: u64,
        /// Bytes.
        len: usize,
    },
}

#[derive(Clone, Copy)]
struct RawComm(ncclComm_t);
// SAFETY: an NCCL communicator may be used from any thread, one call at a
// time (NC-1 serializes calls).
unsafe impl Send for RawComm {}

#[derive(Clone, Copy)]
struct RawStream(sys::CUstream);
// SAFETY: CUDA streams may be used from any thread.
unsafe impl Send for RawStream {}
// SAFETY: as above.
unsafe impl Sync for RawStream {}

/// The handles of a live communicator.
#[derive(Clone, Copy)]
struct Handles {
    /// The non-blocking communicator every rank joined.
    joined: RawComm,
    /// The blocking child transfers run on, once split.
    transfers: Option<RawComm>,
}

impl Handles {
    /// The handle group calls and status queries go to.
    fn for_transfers(&self) -> RawComm {
        self.transfers.unwrap_or(self.joined)
    }
}

/// A communicator of `nranks` ranks on one GPU of this process.
pub struct Communicator {
    api: &'static Api,
    raw: Mutex<Option<Handles>>,
    /// The done event of the last group call (a destroy waits for it).
    last_done: Mutex<Option<Arc<StreamEvent>>>,
    /// Why it was aborted (NC-3).
    aborted: Mutex<Option<String>>,
    gpu: Arc<Gpu>,
    stream: RawStream,
    rank: usize,
    nranks: usize,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Communicator(rank {}/{} on {:?})",
            self.rank, self.nranks, self.gpu
        )
    }
}

impl Communicator {
    /// Starts joining communicator `id` as `rank` of `nranks` on `gpu`
    /// (`ncclCommInitRankConfig`, non-blocking); [`ready`](Self::ready)
    /// waits for the join. Every rank must call it.
    pub fn start(
        id: &UniqueId,
        nranks: usize,
        rank: usize,
        gpu: Arc<Gpu>,
    ) -> Result<Arc<Self>, NcclError> {
        let api = api()?;
        if rank >= nranks {
            return Err(NcclError(format!("rank {rank} of {nranks} ranks")));
        }
        // NCCL takes the device from the current context (NC-4). The
        // stream has the highest priority: its kernels' blocks go ahead
        // of compute's waiting ones, so a transfer overlaps a large kernel
        // queued before it instead of waiting for its last blocks.
        let stream = gpu
            .create_high_priority_stream()
            .map_err(|e| NcclError(format!("creating the communicator's stream: {e}")))?;
        gpu.bind().map_err(|e| NcclError(e.to_string()))?;
        let mut config = Api::nonblocking_config();
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: valid out-pointer and config; the id is plain data.
        let r = unsafe {
            (api.comm_init_rank_config)(&mut comm, nranks as i32, id.0, rank as i32, &mut config)
        };
        let c = Arc::new(Communicator {
            api,
            raw: Mutex::new((!comm.is_null()).then_some(Handles {
                joined: RawComm(comm),
                transfers: None,
            })),
            last_done: Mutex::new(None),
            aborted: Mutex::new(None),
            gpu,
            stream: RawStream(stream),
            rank,
            nranks,
        });
        if r != result::SUCCESS && r != result::IN_PROGRESS {
            let e = api.error("ncclCommInitRankConfig", r, comm);
            c.abort(&e.0);
            return Err(e);
        }
        Ok(c)
    }

    /// Waits until every rank joined (NC-2), then makes the blocking child
    /// transfers run on and connects it to every peer (see the module
    /// docs). Every rank must call it.
    pub async fn ready(self: &Arc<Self>) -> Result<(), NcclError> {
        self.settled("joining the communicator", Duration::ZERO)
            .await?;
        let me = self.clone();
        tokio::task::spawn_blocking(move || me.split_for_transfers())
            .await
            .map_err(|e| NcclError(format!("splitting the communicator: {e}")))??;
        self.connect_peers().await
    }

    /// `ncclCommSplit` into a blocking child sharing the joined
    /// communicator's resources. Blocks until every rank split (a blocking
    /// thread's work).
    fn split_for_transfers(&self) -> Result<(), NcclError> {
        let mut raw = self.raw.lock();
        let Some(h) = raw.as_mut() else {
            return Err(self.gone());
        };
        self.gpu.bind().map_err(|e| NcclError(e.to_string()))?;
        let mut config = Api::blocking_split_config();
        let mut child: ncclComm_t = std::ptr::null_mut();
        // SAFETY: NC-1; valid out-pointer and config.
        let r = unsafe {
            (self.api.comm_split)(h.joined.0, 0, self.rank as i32, &mut child, &mut config)
        };
        if r != result::SUCCESS && r != result::IN_PROGRESS {
            return Err(self.api.error("ncclCommSplit", r, h.joined.0));
        }
        // A non-blocking parent may still be finishing the split.
        let t0 = Instant::now();
        loop {
            let mut state = result::SUCCESS;
            // SAFETY: NC-1.
            unsafe { (self.api.comm_get_async_error)(h.joined.0, &mut state) };
            match state {
                result::SUCCESS => break,
                result::IN_PROGRESS if t0.elapsed() < Duration::from_secs(600) => {
                    std::thread::sleep(POLL)
                }
                e => return Err(self.api.error("ncclCommSplit", e, h.joined.0)),
            }
        }
        if child.is_null() {
            return Err(NcclError("ncclCommSplit gave no communicator".into()));
        }
        // And the child may still be joining.
        loop {
            let mut state = result::SUCCESS;
            // SAFETY: NC-1; the child is ours alone until stored.
            unsafe { (self.api.comm_get_async_error)(child, &mut state) };
            match state {
                result::SUCCESS => break,
                result::IN_PROGRESS if t0.elapsed() < Duration::from_secs(600) => {
                    std::thread::sleep(POLL)
                }
                e => {
                    let err = self.api.error("ncclCommSplit", e, child);
                    // SAFETY: ours alone; it failed.
                    unsafe { (self.api.comm_abort)(child) };
                    return Err(err);
                }
            }
        }
        h.transfers = Some(RawComm(child));
        Ok(())
    }

    /// One byte to and from every other rank, in one group call: NCCL
    /// connects peers on first use, and a blocking call that connects
    /// waits for the peer; afterwards group calls only enqueue.
    async fn connect_peers(&self) -> Result<(), NcclError> {
        if self.nranks < 2 {
            return Ok(());
        }
        let buf = crate::tensor::Tensor::cuda_zeros(
            crate::dtype::DType::U8,
            &[2 * self.nranks],
            self.gpu.ordinal(),
        )
        .map_err(|e| NcclError(e.to_string()))?;
        let base = buf
            .with_device_buffer(|d| d.device_ptr())
            .map_err(|e| NcclError(e.to_string()))?;
        // SAFETY: our stream lives in this GPU's context.
        unsafe { self.gpu.order_stream_after_rdt(self.stream.0) }
            .map_err(|e| NcclError(e.to_string()))?;
        let mut ops = Vec::new();
        for peer in (0..self.nranks).filter(|&p| p != self.rank) {
            ops.push(P2p::Send {
                peer,
                ptr: base + self.rank as u64,
                len: 1,
            });
            ops.push(P2p::Recv {
                peer,
                ptr: base + (self.nranks + peer) as u64,
                len: 1,
            });
        }
        self.group(&ops).await?;
        let done = self.record_done()?;
        self.wait_done(&done, SPIN).await?;
        drop(buf);
        Ok(())
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.nranks
    }

    /// The GPU it runs on.
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The communicator's own stream (NC-4).
    pub fn raw_stream(&self) -> sys::CUstream {
        self.stream.0
    }

    /// Why it was aborted, if it was.
    pub fn aborted(&self) -> Option<String> {
        self.aborted.lock().clone()
    }

    /// Its asynchronous status (`ncclCommGetAsyncError`): `Ok(true)` when
    /// settled, `Ok(false)` while in progress, or its error.
    pub fn status(&self, what: &str) -> Result<bool, NcclError> {
        let raw = self.raw.lock();
        let Some(h) = *raw else {
            return Err(self.gone());
        };
        let comm = match h.transfers {
            Some(c) => c,
            None => h.joined,
        };
        let mut state = result::SUCCESS;
        // SAFETY: a live communicator (NC-1: under its lock).
        let r = unsafe { (self.api.comm_get_async_error)(comm.0, &mut state) };
        if r != result::SUCCESS {
            return Err(self.api.error("ncclCommGetAsyncError", r, comm.0));
        }
        match state {
            result::SUCCESS => Ok(true),
            result::IN_PROGRESS => Ok(false),
            e => Err(self.api.error(what, e, comm.0)),
        }
    }

    fn gone(&self) -> NcclError {
        match &*self.aborted.lock() {
            Some(why) => NcclError(format!("the communicator was aborted: {why}")),
            None => NcclError("the communicator was destroyed".into()),
        }
    }

    /// Waits until the communicator is settled (NC-2): asking again at
    /// once for `spin`, then every millisecond.
    async fn settled(&self, what: &str, spin: Duration) -> Result<(), NcclError> {
        let t0 = Instant::now();
        loop {
            if self.status(what)? {
                return Ok(());
            }
            pause(t0, spin).await;
        }
    }

    /// Enqueues `ops` as one NCCL group call on the communicator's stream
    /// and waits until NCCL has taken them (not until the bytes moved:
    /// record an event on [`raw_stream`](Self::raw_stream) for that).
    pub async fn group(&self, ops: &[P2p]) -> Result<(), NcclError> {
        let blocking = {
            let raw = self.raw.lock();
            let Some(h) = *raw else {
                return Err(self.gone());
            };
            let comm = h.for_transfers();
            self.gpu.bind().map_err(|e| NcclError(e.to_string()))?;
            let a = self.api;
            let stream = self.stream.0;
            // SAFETY: NC-1 (under the lock); every pointer is device memory
            // of this communicator's GPU that the caller keeps alive until
            // the stream passes this point.
            unsafe {
                let r = (a.group_start)();
                if r != result::SUCCESS {
                    return Err(a.error("ncclGroupStart", r, comm.0));
                }
                let mut failed = None;
                for op in ops {
                    let (r, what) = match *op {
                        P2p::Send { len: 0, .. } | P2p::Recv { len: 0, .. } => continue,
                        P2p::Send { peer, ptr, len } => (
                            (a.send)(
                                ptr as *const _,
                                len,
                                ncclDataType_t::ncclUint8,
                                peer as i32,
                                comm.0,
                                stream,
                            ),
                            "ncclSend",
                        ),
                        P2p::Recv { peer, ptr, len } => (
                            (a.recv)(
                                ptr as *mut _,
                                len,
                                ncclDataType_t::ncclUint8,
                                peer as i32,
                                comm.0,
                                stream,
                            ),
                            "ncclRecv",
                        ),
                    };
                    if r != result::SUCCESS && r != result::IN_PROGRESS {
                        failed = Some(a.error(what, r, comm.0));
                        break;
                    }
                }
                // The group is closed even after a failed call (NCCL
                // drops the whole group then).
                let r = (a.group_end)();
                if let Some(e) = failed {
                    return Err(e);
                }
                if r != result::SUCCESS && r != result::IN_PROGRESS {
                    return Err(a.error("ncclGroupEnd", r, comm.0));
                }
            }
            h.transfers.is_some()
        };
        if blocking {
            // Enqueued when ncclGroupEnd returned; a failure of the
            // kernels shows in the status later.
            return Ok(());
        }
        self.settled("the group call", SPIN).await
    }

    /// Records an event on the communicator's stream: the GPU passes it
    /// when everything enqueued so far (the last group call) is done.
    pub fn record_done(&self) -> Result<Arc<StreamEvent>, NcclError> {
        // SAFETY: our stream, in the GPU's primary context (NC-4).
        let ev = unsafe { self.gpu.record_on_stream(self.stream.0) }
            .map(Arc::new)
            .map_err(|e| NcclError(e.to_string()))?;
        *self.last_done.lock() = Some(ev.clone());
        Ok(ev)
    }

    /// Waits until the GPU passed `done` (an event of
    /// [`record_done`](Self::record_done)) without blocking an executor
    /// thread: asks again at once for `spin`, then waits in the driver on
    /// the blocking pool (exact wake-up). Fails when the communicator was
    /// aborted before the bytes all moved (NC-3: the abort ends the
    /// kernels, so the wait ends too).
    pub async fn wait_done(
        &self,
        done: &Arc<StreamEvent>,
        spin: Duration,
    ) -> Result<(), NcclError> {
        let t0 = Instant::now();
        let cuda = |e: crate::cuda::CudaError| NcclError(e.to_string());
        // This thread asks CUDA until the event passes (or synchronizes
        // on it): a method waiting on the same event reads the answer.
        done.watched_by_caller();
        loop {
            if done.passed().map_err(cuda)? {
                break;
            }
            if t0.elapsed() >= spin {
                let ev = done.clone();
                tokio::task::spawn_blocking(move || ev.synchronize())
                    .await
                    .map_err(|e| NcclError(format!("waiting for the GPU: {e}")))?
                    .map_err(cuda)?;
                break;
            }
            tokio::task::yield_now().await;
        }
        // An abort lets the kernels end early: the bytes did not all
        // arrive then.
        match self.aborted() {
            Some(_) => Err(self.gone()),
            None => self.status("the transfer").map(|_| ()),
        }
    }

    /// Aborts the communicator now (`ncclCommAbort`): everything in flight
    /// in it stops, every later call fails with `reason` (NC-3). May block
    /// for as long as NCCL takes to stop its kernels and threads: call it
    /// from a thread of its own (a watchdog), never an executor's.
    pub fn abort(&self, reason: &str) {
        {
            let mut a = self.aborted.lock();
            if a.is_none() {
                *a = Some(reason.to_string());
            }
        }
        let raw = self.raw.lock().take();
        if let Some(h) = raw {
            let _ = self.gpu.bind();
            for comm in h.transfers.into_iter().chain([h.joined]) {
                // SAFETY: the handles were taken out: nobody else uses them.
                let r = unsafe { (self.api.comm_abort)(comm.0) };
                if r != result::SUCCESS {
                    tracing::warn!(
                        "{}",
                        self.api.error("ncclCommAbort", r, std::ptr::null_mut())
                    );
                }
            }
        }
    }

    /// Tears the communicator down: waits (up to `deadline`) until the GPU
    /// is done with the last transfer, frees the transfers' child (an
    /// abort: nothing is in flight any more, and it needs no peer), then
    /// finalizes and destroys the joined communicator (non-blocking,
    /// polled, bounded by `deadline`; past it, or on an error, aborted
    /// instead). Nothing to do after an abort.
    pub async fn destroy(&self, deadline: Duration) -> Result<(), NcclError> {
        let last = self.last_done.lock().clone();
        if let Some(ev) = last {
            let t0 = Instant::now();
            while !ev.passed().unwrap_or(true) {
                if t0.elapsed() > deadline {
                    let e = NcclError(format!(
                        "the communicator's last transfer did not finish within {deadline:?}"
                    ));
                    self.abort(&e.0);
                    return Err(e);
                }
                tokio::time::sleep(POLL).await;
            }
        }
        let child = self.raw.lock().as_mut().and_then(|h| h.transfers.take());
        if let Some(c) = child {
            let _ = self.gpu.bind();
            // SAFETY: taken out: nobody else uses it; nothing in flight.
            let r = unsafe { (self.api.comm_abort)(c.0) };
            if r != result::SUCCESS {
                return Err(self.api.error("ncclCommAbort", r, std::ptr::null_mut()));
            }
        }
        let finalized = {
            let raw = self.raw.lock();
            match *raw {
                None => return Ok(()),
                Some(h) => {
                    let _ = self.gpu.bind();
                    // SAFETY: NC-1.
                    let r = unsafe { (self.api.comm_finalize)(h.joined.0) };
                    if r != result::SUCCESS && r != result::IN_PROGRESS {
                        Err(self.api.error("ncclCommFinalize", r, h.joined.0))
                    } else {
                        Ok(())
                    }
                }
            }
        };
        let finalized = match finalized {
            Ok(()) => tokio::time::timeout(deadline, self.settled("ncclCommFinalize", SPIN))
                .await
                .unwrap_or_else(|_| {
                    Err(NcclError(format!(
                        "ncclCommFinalize did not finish within {deadline:?} (a peer stopped taking part?)"
                    )))
                }),
            Err(e) => Err(e),
        };
        if let Err(e) = finalized {
            self.abort(&e.0);
            return Err(e);
        }
        let raw = self.raw.lock().take();
        if let Some(h) = raw {
            // SAFETY: finalized and taken out: nobody else uses it.
            let r = unsafe { (self.api.comm_destroy)(h.joined.0) };
            if r != result::SUCCESS {
                return Err(self.api.error("ncclCommDestroy", r, std::ptr::null_mut()));
            }
        }
        Ok(())
    }
}

impl Drop for Communicator {
    fn drop(&mut self) {
        self.abort("the communicator was dropped");
        if self.gpu.bind().is_ok() {
            // SAFETY: our stream; work still on it finishes first.
            unsafe {
                let _ = cu::stream::destroy(self.stream.0);
            }
        }
    }
}

/// One pause of a polling loop: a yield (other tasks of the thread run,
/// the caller asks again at once) while within `spin` of `t0`, then a
/// millisecond's sleep.
async fn pause(t0: Instant, spin: Duration) {
    if t0.elapsed() < spin {
        tokio::task::yield_now().await;
    } else {
        tokio::time::sleep(POLL).await;
    }
}
