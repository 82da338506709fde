//! [`Gpu`]: one visible device of this process, its primary context and
//! rdt's stream; the devices set up so far ([`gpu`], [`gpu_by_uuid`]);
//! what rdt enqueued and when the stream is idle (IK-1..3), free marks
//! (FM-3) and interprocess events.

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use parking_lot::Mutex;

use super::events::{EventPool, Stream};
use super::{
    available, device_count, Completion, CudaError, Event, FreeMarks, IpcEvent, StreamEvent,
};
use crate::trace::cuda_trace;
use crate::{device::Device, device::GpuUuid};

/// Marks recorded at large frees and not yet seen passed, per device
/// (FM-3): a bound on events made for that, never reached in practice.
const MAX_PENDING_MARKS: usize = 64;

/// Questions "is rdt's stream idle?" answered without asking CUDA (see
/// "Known idle" in the module docs).
static IDLE_KNOWN: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many times this process knew rdt's stream idle without asking
/// CUDA (IK-2): for tests and measurements.
pub fn idle_known_count() -> u64 {
    IDLE_KNOWN.load(std::sync::atomic::Ordering::Relaxed)
}

/// One visible device of this process: its primary context and rdt's stream.
pub struct Gpu {
    pub(super) ctx: Arc<CudaContext>,
    ordinal: usize,
    /// What memory freed on this device another stream may write (FM-1).
    marks: Arc<FreeMarks>,
    pub(super) uuid: GpuUuid,
    pub(super) stream: Stream,
    /// Interprocess events free for the next export (each export records
    /// one of its own, returned here when the object is released).
    ipc_events: Mutex<Vec<IpcEvent>>,
    /// Marks recorded at large frees while the stream was busy, oldest
    /// first, not yet seen passed (FM-3).
    pending_marks: Mutex<std::collections::VecDeque<Completion>>,
    /// What rdt enqueued on its stream, counted after each enqueue (IK-1).
    enqueued: std::sync::atomic::AtomicU64,
    /// `enqueued` as read before a query that found the stream idle
    /// (IK-2).
    idle_upto: std::sync::atomic::AtomicU64,
    /// [`Gpu::raw_stream`] was handed out: others may enqueue what rdt
    /// does not count, so the stream is always asked (IK-3).
    stream_lent: std::sync::atomic::AtomicBool,
    /// Events of this context free for the next record (EP-1, EP-2).
    events: Arc<EventPool>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Gpu(cuda:{} {})", self.ordinal, self.uuid)
    }
}

pub(super) fn gpu_uuid(u: &sys::CUuuid) -> GpuUuid {
    GpuUuid::from_bytes(u.bytes.map(|c| c as u8))
}

/// The devices this process has set up, by local ordinal.
static GPUS: OnceLock<Mutex<HashMap<usize, Arc<Gpu>>>> = OnceLock::new();

/// Has this process set up a CUDA context (cheap: loads nothing)?
pub fn has_context() -> bool {
    GPUS.get().is_some_and(|m| !m.lock().is_empty())
}

/// A device this process already set up (its lowest ordinal), if any:
/// for work that needs some context but must not create one.
pub(super) fn any_gpu_made() -> Option<Arc<Gpu>> {
    let map = GPUS.get()?.lock();
    map.keys().min().and_then(|k| map.get(k).cloned())
}

/// The [`Gpu`] of local ordinal `ordinal`, created on first use.
pub fn gpu(ordinal: usize) -> Result<Arc<Gpu>, CudaError> {
    available()?;
    let mut map = GPUS.get_or_init(Default::default).lock();
    if let Some(g) = map.get(&ordinal) {
        return Ok(g.clone());
    }
    let count = device_count();
    if ordinal >= count {
        return Err(CudaError(format!(
            "device ordinal {ordinal} does not exist: this process sees {count} device(s)"
        )));
    }
    cuda_trace!("creating the context of local device {ordinal}");
    let ctx = CudaContext::new(ordinal).map_err(|e| CudaError::call("creating a context", e))?;
    let uuid = gpu_uuid(
        &ctx.uuid()
            .map_err(|e| CudaError::call("cuDeviceGetUuid", e))?,
    );
    let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
        .map_err(|e| CudaError::call("cuStreamCreate", e))?;
    let g = Arc::new(Gpu {
        ctx,
        ordinal,
        marks: Arc::new(FreeMarks::new()),
        uuid,
        stream: Stream(stream),
        ipc_events: Mutex::new(Vec::new()),
        pending_marks: Mutex::new(std::collections::VecDeque::new()),
        // Nothing is known idle until the stream is first asked.
        enqueued: 1.into(),
        idle_upto: 0.into(),
        stream_lent: false.into(),
        events: Arc::new(EventPool::new()),
    });
    // Peer access with every device already set up, both ways (gpu.md
    // pitfall 3): without it cross-GPU copies run ten times slower.
    for other in map.values() {
        g.enable_peer(other);
        other.enable_peer(&g);
    }
    // Leave the new device's context current, as `CudaContext::new` did.
    g.bind()?;
    cuda_trace!("local device {ordinal} is {}", g.uuid);
    map.insert(ordinal, g.clone());
    Ok(g)
}

/// The local ordinal whose device has `uuid`, if this process sees it.
///
/// Asked per tensor on receive paths, so the answer is a lookup in a table
/// made on the first call (which sets up every visible device, as finding
/// a UUID needs).
pub fn ordinal_of(uuid: &GpuUuid) -> Option<usize> {
    static UUIDS: OnceLock<Vec<Option<GpuUuid>>> = OnceLock::new();
    let uuids = UUIDS.get_or_init(|| {
        (0..device_count())
            .map(|i| gpu(i).ok().map(|g| g.uuid))
            .collect()
    });
    uuids.iter().position(|u| u.as_ref() == Some(uuid))
}

/// The [`Gpu`] whose device has `uuid`.
pub fn gpu_by_uuid(uuid: &GpuUuid) -> Result<Arc<Gpu>, CudaError> {
    available()?;
    match ordinal_of(uuid) {
        Some(i) => gpu(i),
        None => Err(CudaError(format!(
            "device {uuid} is not visible in this process (CUDA_VISIBLE_DEVICES={})",
            crate::env::cuda_visible_devices()
        ))),
    }
}

impl Gpu {
    /// Local ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device UUID (`GPU-...`).
    pub fn uuid(&self) -> GpuUuid {
        self.uuid
    }

    /// The device's product name (e.g. `NVIDIA H100 80GB HBM3`).
    pub fn name(&self) -> String {
        self.ctx
            .name()
            .unwrap_or_else(|_| "unknown CUDA device".into())
    }

    /// The [`Device`] value for tensors on this GPU.
    pub fn device(&self) -> Device {
        Device::Cuda {
            uuid: self.uuid,
            ordinal: self.ordinal as u32,
        }
    }

    /// Makes this GPU's context current on the calling thread (cheap;
    /// every op calls it).
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::call("cuCtxSetCurrent", e))
    }

    /// `(major, minor)` compute capability.
    pub fn compute_capability(&self) -> Result<(u32, u32), CudaError> {
        let (a, b) = self
            .ctx
            .compute_capability()
            .map_err(|e| CudaError::call("cuDeviceGetAttribute(compute capability)", e))?;
        Ok((a as u32, b as u32))
    }

    /// Number of streaming multiprocessors.
    pub fn multiprocessors(&self) -> Result<u32, CudaError> {
        self.ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map(|n| n.max(1) as u32)
            .map_err(|e| CudaError::call("cuDeviceGetAttribute(multiprocessors)", e))
    }

    /// The raw stream every rdt op of this process runs on, for interop.
    /// From then on rdt no longer knows what is enqueued on it: every
    /// question whether it is idle asks CUDA (IK-3).
    pub fn raw_stream(&self) -> sys::CUstream {
        self.stream_lent
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.stream.0
    }

    /// rdt's stream for rdt's own enqueues; each is followed by
    /// [`enqueued`](Self::enqueued) (IK-1).
    pub(crate) fn own_stream(&self) -> sys::CUstream {
        self.stream.0
    }

    /// Something was just enqueued on rdt's stream (IK-1): called after
    /// every enqueue of rdt's.
    pub(crate) fn enqueued(&self) {
        self.enqueued
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    fn enable_peer(&self, other: &Gpu) {
        let mut can = 0;
        // SAFETY: plain queries and a context call with valid handles.
        unsafe {
            if sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), other.ctx.cu_device())
                .result()
                .is_err()
                || can == 0
            {
                return;
            }
            if self.bind().is_ok() {
                cuda_trace!("enabling peer access {} -> {}", self.uuid, other.uuid);
                let r = sys::cuCtxEnablePeerAccess(other.ctx.cu_ctx(), 0);
                if r != sys::CUresult::CUDA_SUCCESS
                    && r != sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                {
                    tracing::warn!(
                        "enabling peer access {} -> {}: {r:?}",
                        self.uuid,
                        other.uuid
                    );
                }
            }
        }
    }

    /// Resolves when the GPU has done everything enqueued on the stream so
    /// far: at once if the stream is idle, else through a fresh event (see
    /// the module docs).
    pub fn completion(&self) -> Result<Completion, CudaError> {
        if self.stream_idle()? {
            return Ok(Completion {
                event: None,
                ctx: self.ctx.clone(),
                mark: None,
            });
        }
        let ev = self.events.take()?;
        let c = Completion {
            event: Some((ev, self.events.clone())),
            ctx: self.ctx.clone(),
            mark: Some((self.marks.clone(), self.marks.take())),
        };
        // SAFETY: valid event and stream of this context.
        unsafe { cu::event::record(ev.0, self.stream.0) }
            .map_err(|e| CudaError::call("cuEventRecord", e))?;
        Ok(c)
    }

    /// This device's free marks (see the module docs).
    pub(crate) fn marks(&self) -> &Arc<FreeMarks> {
        &self.marks
    }

    /// After a large free (FM-3): takes a mark that covers it, passed at
    /// once if the stream is idle, else recorded as an event that
    /// [`poll_marks`](Self::poll_marks) looks at later, so the memory turns
    /// clean once the stream passes the free even if nobody waits for it.
    /// Best effort: a failure leaves the memory dirty until another mark.
    pub(crate) fn mark_free(&self) {
        // An idle stream passes its mark inside `completion` (no event).
        let Ok(c) = self.completion() else { return };
        let mut pending = self.pending_marks.lock();
        if c.event.is_some() && pending.len() < MAX_PENDING_MARKS {
            pending.push_back(c);
        }
    }

    /// Tells the free marks about recorded marks the stream has passed
    /// (FM-3), oldest first; stops at the first still pending (the stream
    /// passes them in order).
    pub(crate) fn poll_marks(&self) {
        let mut pending = self.pending_marks.lock();
        while let Some(c) = pending.front() {
            match c.passed() {
                Ok(false) => break,
                Ok(true) => {}
                // The context is broken (OD-2: no work of its stream runs
                // any more).
                Err(_) => c.seen_passed(),
            }
            // Dropping it destroys its event.
            pending.pop_front();
        }
    }

    /// Has the GPU finished everything enqueued on the stream? Known
    /// without asking CUDA when nothing was enqueued since the stream was
    /// last seen idle (IK-2).
    pub fn stream_idle(&self) -> Result<bool, CudaError> {
        use std::sync::atomic::Ordering::SeqCst;
        let mark = self.marks.take();
        // IK-2: read before the query it may be stored for.
        let upto = self.enqueued.load(SeqCst);
        if !self.stream_lent.load(SeqCst) && self.idle_upto.load(SeqCst) == upto {
            self.marks.passed(mark);
            IDLE_KNOWN.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            return Ok(true);
        }
        self.bind()?;
        // SAFETY: valid stream of the bound context.
        match unsafe { sys::cuStreamQuery(self.stream.0) } {
            sys::CUresult::CUDA_SUCCESS => {
                self.marks.passed(mark);
                self.idle_upto.fetch_max(upto, SeqCst);
                Ok(true)
            }
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(CudaError::call("cuStreamQuery", cu::DriverError(r))),
        }
    }

    /// Waits on the host until the stream is idle (blocking; for test
    /// helpers and synchronous accessors only).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        use std::sync::atomic::Ordering::SeqCst;
        let upto = self.enqueued.load(SeqCst);
        self.bind()?;
        // SAFETY: valid stream.
        unsafe { cu::stream::synchronize(self.stream.0) }
            .map_err(|e| CudaError::call("cuStreamSynchronize", e))?;
        self.idle_upto.fetch_max(upto, SeqCst);
        Ok(())
    }

    /// Makes the stream wait for `event` (recorded anywhere, any process
    /// that opened it) without a host sync.
    pub(crate) fn wait_event(&self, event: Event) -> Result<(), CudaError> {
        self.bind()?;
        // SAFETY: valid stream and event.
        unsafe {
            cu::stream::wait_event(
                self.stream.0,
                event.0,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )
        }
        .map_err(|e| CudaError::call("cuStreamWaitEvent", e))?;
        self.enqueued();
        Ok(())
    }

    /// Records an event on `stream` (another library's, in this device's
    /// context).
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context.
    pub(crate) unsafe fn record_on_stream(
        &self,
        stream: sys::CUstream,
    ) -> Result<StreamEvent, CudaError> {
        self.bind()?;
        let ev = StreamEvent {
            event: self.events.take()?,
            ctx: self.ctx.clone(),
            pool: self.events.clone(),
            seen_passed: false.into(),
            watched: false.into(),
        };
        // SAFETY: valid event; the stream is the caller's promise.
        unsafe { cu::event::record(ev.event.0, stream) }
            .map_err(|e| CudaError::call("cuEventRecord", e))?;
        Ok(ev)
    }

    /// Makes rdt's stream wait on `ev` (destroyed once its last holder
    /// drops it; a wait already enqueued is not cancelled by that).
    pub(crate) fn wait_stream_event(&self, ev: &StreamEvent) -> Result<(), CudaError> {
        self.wait_event(ev.event)
    }

    /// Makes `stream` wait for everything enqueued on rdt's stream so far
    /// (nothing when rdt's stream is idle).
    ///
    /// # Safety
    /// `stream` must be a live stream of this device's primary context.
    pub(crate) unsafe fn order_stream_after_rdt(
        &self,
        stream: sys::CUstream,
    ) -> Result<(), CudaError> {
        let c = self.completion()?;
        if let Some((ev, _)) = &c.event {
            // SAFETY: valid event; the stream is the caller's promise.
            unsafe {
                cu::stream::wait_event(stream, ev.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT)
            }
            .map_err(|e| CudaError::call("cuStreamWaitEvent", e))?;
        }
        Ok(())
    }

    /// A new non-blocking stream of this device's primary context at the
    /// highest priority it offers, for transfers that run beside compute:
    /// the GPU's block scheduler starts their kernels' blocks ahead of
    /// compute blocks still waiting for room, so a transfer is not held
    /// back until a large kernel queued before it has placed every block.
    /// The caller owns the stream (destroy it with `cuStreamDestroy`).
    pub(crate) fn create_high_priority_stream(&self) -> Result<sys::CUstream, CudaError> {
        self.bind()?;
        let (mut least, mut greatest) = (0, 0);
        // SAFETY: valid out-pointers; the device's context is bound.
        unsafe { sys::cuCtxGetStreamPriorityRange(&mut least, &mut greatest) }
            .result()
            .map_err(|e| CudaError::call("cuCtxGetStreamPriorityRange", e))?;
        let mut stream = std::ptr::null_mut();
        // SAFETY: valid out-pointer; a priority within the range.
        unsafe {
            sys::cuStreamCreateWithPriority(
                &mut stream,
                sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32,
                greatest,
            )
        }
        .result()
        .map_err(|e| CudaError::call("cuStreamCreateWithPriority", e))?;
        Ok(stream)
    }

    /// Records an interprocess event of its own for one export on rdt's
    /// stream (taken from the free ones, or made), so a consumer waits for
    /// the work before this export and for nothing the producer enqueues
    /// later. `None` when the stream is idle: the tensors are ready.
    /// Give the event back with [`Gpu::return_ipc_event`] once every
    /// consumer has enqueued its wait (the object was released).
    pub(crate) fn record_ipc_event(&self) -> Result<Option<IpcEvent>, CudaError> {
        if self.stream_idle()? {
            return Ok(None);
        }
        let free = self.ipc_events.lock().pop();
        let ev = match free {
            Some(ev) => ev,
            None => {
                self.bind()?;
                let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32
                    | sys::CUevent_flags::CU_EVENT_INTERPROCESS as u32;
                let mut ev = std::ptr::null_mut();
                let mut h = std::mem::MaybeUninit::<sys::CUipcEventHandle>::uninit();
                // SAFETY: out-pointers valid; the flags make the event
                // exportable.
                unsafe {
                    sys::cuEventCreate(&mut ev, flags)
                        .result()
                        .map_err(|e| CudaError::call("cuEventCreate(interprocess)", e))?;
                    sys::cuIpcGetEventHandle(h.as_mut_ptr(), ev)
                        .result()
                        .map_err(|e| CudaError::call("cuIpcGetEventHandle", e))?;
                    let h = h.assume_init();
                    IpcEvent {
                        event: Event(ev),
                        handle: h.reserved.map(|c| c as u8),
                    }
                }
            }
        };
        // SAFETY: valid event and stream.
        if let Err(e) = unsafe { cu::event::record(ev.event.0, self.stream.0) } {
            self.ipc_events.lock().push(ev);
            return Err(CudaError::call("cuEventRecord", e));
        }
        Ok(Some(ev))
    }

    /// An export's event is free again (see [`Gpu::record_ipc_event`]).
    pub(crate) fn return_ipc_event(&self, ev: IpcEvent) {
        self.ipc_events.lock().push(ev);
    }
}
