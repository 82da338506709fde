//! What an export publishes and a receive reads: the wire handles of the
//! slabs and tensors, the host's identity, the producer processes'
//! import records (checked alive), and the producers' events, opened once
//! per process.

use super::*;

use crate::trace::cuda_trace;

/// Name of this transport in attributes and errors.
pub const NAME: &str = "cuda_ipc";

pub(super) fn err(e: impl std::fmt::Display) -> TransportError {
    TransportError::new(NAME, e.to_string())
}

#[derive(Serialize, Deserialize)]
pub(super) struct Handles {
    pub(super) boot_id: String,
    pub(super) pid_ns: Option<u64>,
    pub(super) pid: u32,
    pub(super) counters_fd: i32,
    pub(super) counters_id: (u64, u64),
    /// Per producer device: UUID and event handle.
    pub(super) events: Vec<(GpuUuid, Vec<u8>)>,
    /// The slabs the tensors lie in, each once: a weights sync's thousands
    /// of tensors share a few slabs, so their 64-byte memory handles travel
    /// and are looked up once per slab, not per tensor.
    pub(super) slabs: Vec<SlabHandle>,
    pub(super) tensors: Vec<TensorHandle>,
}

/// One slab of the producer's, as its tensors' handles refer to it.
#[derive(Serialize, Deserialize)]
pub(super) struct SlabHandle {
    /// The producer's slab id.
    pub(super) id: u64,
    /// `cuIpcGetMemHandle` of the slab (64 bytes).
    #[serde(with = "serde_bytes")]
    pub(super) handle: Vec<u8>,
    pub(super) len: u64,
    /// The slab's shared record (retiring flag, importer pids).
    pub(super) record: u32,
}

#[derive(Serialize, Deserialize)]
pub(super) struct TensorHandle {
    /// Index of its slab in [`Handles::slabs`].
    pub(super) slab: u32,
    pub(super) offset: u64,
    pub(super) len: u64,
    pub(super) slot: u32,
}

pub(super) struct HostId {
    pub(super) boot_id: String,
    pub(super) pid_ns: Option<u64>,
}

pub(super) fn host_id() -> Result<&'static HostId, TransportError> {
    static ID: OnceLock<Result<HostId, String>> = OnceLock::new();
    ID.get_or_init(|| {
        let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map_err(|e| format!("cannot read the boot id ({e}): cuda_ipc needs Linux /proc"))?;
        let pid_ns = std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino());
        Ok(HostId {
            boot_id: boot_id.trim().to_string(),
            pid_ns,
        })
    })
    .as_ref()
    .map_err(err)
}

/// The local GPU to use for memory on device `uuid`: that device if this
/// process sees it, else the first visible device (peer access).
pub(super) fn local_gpu(uuid: &GpuUuid) -> Result<Arc<Gpu>, CudaError> {
    match crate::cuda::ordinal_of(uuid) {
        Some(i) => crate::cuda::gpu(i),
        None => crate::cuda::gpu(0),
    }
}

/// A producer process as this module's caches key it: its pid and the
/// (device, inode) of its import-record memfd.
pub(super) type ProducerKey = (u32, (u64, u64));

/// A producer process this consumer imports from: its import records, and
/// a watch on its exit.
pub(super) struct ProducerProcess {
    pub(super) counters: Arc<Counters>,
    /// `None` where the kernel gives no pidfd: liveness is then checked
    /// through `/proc` at each receive.
    pub(super) watch: Option<ProcessWatch>,
}

pub(super) fn counters_cache() -> &'static Mutex<HashMap<ProducerKey, Arc<ProducerProcess>>> {
    static CACHE: OnceLock<Mutex<HashMap<ProducerKey, Arc<ProducerProcess>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// Is the producer's import-record memfd still at the descriptor its
/// handles name (with the same inode)? False once the producer exited.
fn records_still_there(h: &Handles) -> bool {
    let path = format!("/proc/{}/fd/{}", h.pid, h.counters_fd);
    matches!(std::fs::metadata(&path), Ok(md) if (md.dev(), md.ino()) == h.counters_id)
}

/// The producer's import records, checking that the producer is alive: a
/// dead producer fails here (cached or not) with a clear message. After
/// the first receive from a process the check is one `poll` of its pidfd,
/// no path lookup.
pub(super) fn open_counters(h: &Handles) -> Result<Arc<Counters>, String> {
    let key = (h.pid, h.counters_id);
    let gone = || {
        counters_cache().lock().remove(&key);
        format!(
            "the producer (pid {}) has exited or closed its CUDA memory: the tensors are gone",
            h.pid
        )
    };
    let cached = counters_cache().lock().get(&key).cloned();
    if let Some(p) = cached {
        let alive = match &p.watch {
            Some(w) => !w.exited(),
            None => records_still_there(h),
        };
        return if alive {
            Ok(p.counters.clone())
        } else {
            Err(gone())
        };
    }
    // Watched before its identity is checked: if the pid was reused in
    // between, the check fails (the new process has no such memfd).
    let watch = crate::rt::process_watch::watch(h.pid);
    if !records_still_there(h) {
        return Err(gone());
    }
    let counters = Arc::new(Counters::open(h.pid, h.counters_fd, h.counters_id)?);
    let p = counters_cache()
        .lock()
        .entry(key)
        .or_insert_with(|| Arc::new(ProducerProcess { counters, watch }))
        .clone();
    Ok(p.counters.clone())
}

/// The events one export recorded, with their devices.
pub(super) type ExportEvents = Vec<(Arc<Gpu>, IpcEvent)>;

/// A producer's event: its process, its records file, its device, its
/// handle (each export has an event of its own, from a pool).
pub(super) type EventKey = (u32, (u64, u64), GpuUuid, Vec<u8>);

/// A producer's event, opened in this process; destroyed when the last
/// holder (the cache, a receive using it) drops it.
pub(super) struct OpenedEvent {
    pub(super) event: Event,
    /// The device whose context it was opened in.
    pub(super) gpu: Arc<Gpu>,
}

impl Drop for OpenedEvent {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: opened by cuIpcOpenEventHandle in this context, and no
            // one uses it any more (every user holds an Arc of it). A stream
            // that waits on it waits on the record it saw when the wait was
            // enqueued; destroying the event does not cancel that wait.
            unsafe {
                let _ = cudarc::driver::result::event::destroy(self.event.0);
            }
        }
    }
}

pub(super) fn events() -> &'static Mutex<HashMap<EventKey, Arc<OpenedEvent>>> {
    static CACHE: OnceLock<Mutex<HashMap<EventKey, Arc<OpenedEvent>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

pub(super) fn open_event(
    h: &Handles,
    uuid: &GpuUuid,
    handle: &[u8],
    g: &Arc<Gpu>,
    opening: bool,
) -> Result<Option<Arc<OpenedEvent>>, CudaError> {
    let key = (h.pid, h.counters_id, *uuid, handle.to_vec());
    let mut cache = events().lock();
    if let Some(e) = cache.get(&key) {
        return Ok(Some(e.clone()));
    }
    if !opening {
        return Ok(None);
    }
    let mut raw = sys::CUipcEventHandle { reserved: [0; 64] };
    if handle.len() != 64 {
        return Err(CudaError("malformed event handle".into()));
    }
    for (d, s) in raw.reserved.iter_mut().zip(handle) {
        *d = *s as _;
    }
    // Opened in the context of the device whose stream will wait on it
    // (the driver call needs a current context on this thread).
    g.bind()?;
    cuda_trace!(
        "opening the event of pid {} on {uuid} in local device {}",
        h.pid,
        g.ordinal()
    );
    let mut ev = std::ptr::null_mut();
    // SAFETY: out-pointer valid; the handle came from cuIpcGetEventHandle.
    unsafe { sys::cuIpcOpenEventHandle(&mut ev, raw) }
        .result()
        .map_err(|e| CudaError::call("cuIpcOpenEventHandle", e))?;
    EVENTS_OPENED.fetch_add(1, Ordering::Relaxed);
    let opened = Arc::new(OpenedEvent {
        event: Event(ev),
        gpu: g.clone(),
    });
    cache.insert(key, opened.clone());
    Ok(Some(opened))
}

/// Has the GPU passed the (opened) producer event?
pub(super) fn event_passed(ev: Event, g: &Gpu) -> Result<bool, CudaError> {
    g.bind()?;
    // SAFETY: a valid event opened in this process.
    match unsafe { sys::cuEventQuery(ev.0) } {
        sys::CUresult::CUDA_SUCCESS => Ok(true),
        sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        r => Err(CudaError::call(
            "cuEventQuery",
            cudarc::driver::result::DriverError(r),
        )),
    }
}
