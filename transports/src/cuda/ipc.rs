//! The `cuda_ipc` transport: zero-copy hand-over of CUDA tensors between
//! processes of one host, through CUDA IPC.
//!
//! # Protocol
//! 1. **Export (producer).** Every CUDA tensor rdt allocates lives in a
//!    range of a `cuMemAlloc` slab ([`super::alloc`]). Export
//!    publishes a table of the slabs the tensors lie in (each slab's
//!    `cuIpcGetMemHandle`, made once per slab, its id, length and record),
//!    and per tensor its slab's index in that table, the range's offset and
//!    length, and the range's import record slot; and, per device, the handle of an interprocess
//!    event of this export's own (from a pool, given back at release),
//!    recorded on rdt's stream at export, so it completes when the work
//!    that produced the tensors does and never covers work the producer
//!    enqueues later (no handle when that stream is idle: the tensors are
//!    ready, and a pass of ready tensors puts no work on either GPU). The handles
//!    also carry the host's boot id and pid namespace, the producer's pid
//!    and the descriptor and inode of its import-record memfd. A tensor in
//!    memory the producer did not allocate (one it received itself) is
//!    copied into a fresh range first, kept until [`release`].
//! 2. **Receive (consumer).** The consumer checks it runs on the same host,
//!    checks the producer is alive (its import-record memfd is still at
//!    `/proc/<pid>/fd/<fd>` with the same inode at the first receive from
//!    a process; after it, a pidfd of that process: a dead producer is a
//!    clear error, never a hang), makes its stream wait on the producer's event
//!    unless it has already passed (`cuStreamWaitEvent`: no host sync; each
//!    event handle is opened once per process, in the context of the device
//!    whose stream waits on it), and maps each slab **once** (`cuIpcOpenMemHandle` with
//!    lazy peer access), caching the mapping for every later tensor in that
//!    slab (gpu.md pitfall 2). [`stats`] counts new mappings vs cache hits.
//!    The tensors it returns share the producer's memory: a write by the
//!    consumer is seen by the producer (Ray's semantics). Each tensor counts
//!    itself in the range's shared import record while it lives.
//! 3. **Release.** A consumer's dropped tensor counts itself out of its
//!    range's import record once this process's stream passed every use
//!    enqueued before the drop ([`super::ordered_drop`]: queued, released
//!    in batches behind one stream mark). The producer's release drops the
//!    copies made at export. The
//!    producer's own tensors give their ranges back to the slab when they
//!    are dropped, but a range that a live importer still holds waits until
//!    every importer dropped its tensors (see `alloc` for the lifetime
//!    rules).
//! 4. **Mappings and freeing.** An importer keeps each slab mapping cached
//!    while the slab lives, so later tensors in it cost no new mapping, and
//!    registers its pid in the slab's shared record. The producer frees a
//!    slab only once it is unused and every registered importer has closed
//!    its mapping or died ([`alloc::trim`], invariant 3 of `alloc`). An
//!    importer closes a mapping of a slab the producer retires as soon as
//!    its last tensor in that slab is dropped (the owner table freed the
//!    object), or, if it had none left, at its next receive or at the
//!    worker's periodic [`housekeeping`].
//! 5. **Peer death.** An importer caches, per producer process, the
//!    producer's import records, opened events and slab mappings. When the
//!    producer's actor is gone ([`TensorTransport::peer_gone`]), they are
//!    dropped from the caches: events are destroyed, and mappings are closed
//!    at once or, if tensors still use them, when the last of those goes.
//!
//! Devices are matched by UUID: a consumer that sees the producer's device
//! maps it there; otherwise it maps it in its first device's context with
//! peer access (both devices must be visible to the consumer). Another host
//! is an error naming the transports that cross hosts.
//!
//! [`release`]: TensorTransport::release

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use cudarc::driver::sys;
use futures::future::BoxFuture;
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use super::alloc::{self, Counters, Region, SlabRange};
use super::{cuda_trace, CudaError, DeviceBuffer, Event, Gpu, IpcEvent};
use crate::process_watch::ProcessWatch;
use crate::transport::{
    check_received, ObjectKey, Peer, Sidedness, TensorTransport, TransferCtx, TransportError,
};
use crate::{Device, Exported, GpuUuid, Tensor};

/// Name of this transport in attributes and errors.
pub const NAME: &str = "cuda_ipc";

// Usable wherever CUDA is; without it, exports of CUDA tensors cannot
// happen and receives fail with the CUDA error.
crate::register_transport!(crate::registry::Registration {
    name: NAME,
    sidedness: Sidedness::OneSided,
    collective: false,
    devices: "CUDA",
    same_host_only: true,
    start: |_| Ok(std::sync::Arc::new(CudaIpcTransport::new())),
});

static OPENED: AtomicU64 = AtomicU64::new(0);
static CACHED: AtomicU64 = AtomicU64::new(0);
static EVENTS_OPENED: AtomicU64 = AtomicU64::new(0);
static CLOSED: AtomicU64 = AtomicU64::new(0);

/// How often this process, as a consumer, had to open a new mapping.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcStats {
    /// Tensors whose slab had to be mapped (`cuIpcOpenMemHandle`).
    pub opened: u64,
    /// Tensors whose slab was already mapped.
    pub cached: u64,
    /// Producer events opened (`cuIpcOpenEventHandle`).
    pub events_opened: u64,
    /// Mappings closed (`cuIpcCloseMemHandle`).
    pub closed: u64,
}

/// This process's counts (consumer side).
pub fn stats() -> IpcStats {
    IpcStats {
        opened: OPENED.load(Ordering::Relaxed),
        cached: CACHED.load(Ordering::Relaxed),
        events_opened: EVENTS_OPENED.load(Ordering::Relaxed),
        closed: CLOSED.load(Ordering::Relaxed),
    }
}

#[derive(Serialize, Deserialize)]
struct Handles {
    boot_id: String,
    pid_ns: Option<u64>,
    pid: u32,
    counters_fd: i32,
    counters_id: (u64, u64),
    /// Per producer device: UUID and event handle.
    events: Vec<(GpuUuid, Vec<u8>)>,
    /// The slabs the tensors lie in, each once: a weights sync's thousands
    /// of tensors share a few slabs, so their 64-byte memory handles travel
    /// and are looked up once per slab, not per tensor.
    slabs: Vec<SlabHandle>,
    tensors: Vec<TensorHandle>,
}

/// One slab of the producer's, as its tensors' handles refer to it.
#[derive(Serialize, Deserialize)]
struct SlabHandle {
    /// The producer's slab id.
    id: u64,
    /// `cuIpcGetMemHandle` of the slab (64 bytes).
    #[serde(with = "serde_bytes")]
    handle: Vec<u8>,
    len: u64,
    /// The slab's shared record (retiring flag, importer pids).
    record: u32,
}

#[derive(Serialize, Deserialize)]
struct TensorHandle {
    /// Index of its slab in [`Handles::slabs`].
    slab: u32,
    offset: u64,
    len: u64,
    slot: u32,
}

/// Moves CUDA tensors between processes of one host with CUDA IPC, no copy.
#[derive(Default)]
pub struct CudaIpcTransport {
    /// Copies made at export, kept until release.
    copies: Mutex<HashMap<ObjectKey, Vec<Tensor>>>,
    /// The events each export recorded, given back to their device at
    /// release (every consumer has enqueued its wait by then: the driver
    /// frees only after every receive ended).
    export_events: Mutex<HashMap<ObjectKey, ExportEvents>>,
    /// The producer processes each peer actor sent us tensors from, as the
    /// caches key them, so that [`TensorTransport::peer_gone`] can drop
    /// their entries.
    producers: Mutex<HashMap<u64, HashSet<ProducerKey>>>,
}

impl std::fmt::Debug for CudaIpcTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaIpcTransport").finish_non_exhaustive()
    }
}

fn err(e: impl std::fmt::Display) -> TransportError {
    TransportError::new(NAME, e.to_string())
}

struct HostId {
    boot_id: String,
    pid_ns: Option<u64>,
}

fn host_id() -> Result<&'static HostId, TransportError> {
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

impl CudaIpcTransport {
    /// A transport with nothing exported.
    pub fn new() -> Self {
        Self::default()
    }

    fn export_now(&self, key: ObjectKey, tensors: &[Tensor]) -> Result<Exported, TransportError> {
        let host = host_id()?;
        let counters = alloc::counters().map_err(err)?;
        let mut out = Exported::default();
        let mut gpus: Vec<Arc<Gpu>> = Vec::new();
        let mut handles = Vec::with_capacity(tensors.len());
        let mut slabs: Vec<SlabHandle> = Vec::new();
        // Slab id -> index in `slabs`.
        let mut slab_index: rustc_hash::FxHashMap<u64, u32> = Default::default();
        let mut copies = Vec::new();
        for t in tensors {
            self.check_device(t.device())?;
            // The handle of a range of ours; `None` for memory this process
            // did not allocate, which is copied into a range first.
            let mut handle = |t: &Tensor| {
                t.with_device_buffer(|d| -> Result<Option<TensorHandle>, CudaError> {
                    let Some(r) = d.buffer().as_any().downcast_ref::<SlabRange>() else {
                        return Ok(None);
                    };
                    if !gpus.iter().any(|g| Arc::ptr_eq(g, d.gpu())) {
                        gpus.push(d.gpu().clone());
                    }
                    let slab = match slab_index.get(&r.slab.id) {
                        Some(&i) => i,
                        None => {
                            let (handle, record) = r.slab.ipc_handle()?;
                            slabs.push(SlabHandle {
                                id: r.slab.id,
                                handle: handle.to_vec(),
                                len: r.slab.len as u64,
                                record,
                            });
                            let i = (slabs.len() - 1) as u32;
                            slab_index.insert(r.slab.id, i);
                            i
                        }
                    };
                    Ok(Some(TensorHandle {
                        slab,
                        // A view's bytes start inside its range.
                        offset: (r.offset + d.offset()) as u64,
                        len: d.len() as u64,
                        slot: r.counter_slot()?,
                    }))
                })
            };
            let h = match handle(t).map_err(err)?.map_err(err)? {
                Some(h) => {
                    out.metas.push(t.meta());
                    h
                }
                None => {
                    let ord = t.with_device_buffer(|d| d.gpu().ordinal()).map_err(err)?;
                    let c = t.to_device(ord).map_err(err)?;
                    let h = handle(&c)
                        .map_err(err)?
                        .map_err(err)?
                        .expect("a fresh copy lies in a range of ours");
                    out.metas.push(c.meta());
                    copies.push(c);
                    h
                }
            };
            handles.push(h);
        }
        let mut events = Vec::with_capacity(gpus.len());
        let mut recorded = Vec::new();
        for g in &gpus {
            // No handle: the producer's stream was idle, nothing to wait for.
            match g.record_ipc_event() {
                Ok(ev) => {
                    events.push((g.uuid(), ev.map(|e| e.handle.to_vec()).unwrap_or_default()));
                    recorded.extend(ev.map(|e| (g.clone(), e)));
                }
                Err(e) => {
                    for (g, ev) in recorded {
                        g.return_ipc_event(ev);
                    }
                    return Err(err(e));
                }
            }
        }
        if !recorded.is_empty() {
            self.export_events.lock().insert(key, recorded);
        }
        let h = Handles {
            boot_id: host.boot_id.clone(),
            pid_ns: host.pid_ns,
            pid: std::process::id(),
            counters_fd: counters.fd(),
            counters_id: counters.id,
            events,
            slabs,
            tensors: handles,
        };
        out.handles = postcard::to_allocvec(&h).map_err(err)?;
        if !copies.is_empty() {
            self.copies.lock().insert(key, copies);
        }
        Ok(out)
    }

    /// Reads and checks the handles of `exported`.
    fn handles(&self, from: &Peer, exported: &Exported) -> Result<Handles, TransportError> {
        let perr = |m: String| TransportError::with_peer(NAME, from, m);
        let h: Handles = postcard::from_bytes(&exported.handles)
            .map_err(|e| perr(format!("malformed handles: {e}")))?;
        let host = host_id()?;
        if h.boot_id != host.boot_id
            || (h.pid_ns.is_some() && host.pid_ns.is_some() && h.pid_ns != host.pid_ns)
        {
            return Err(perr(
                "the producer runs on another host (or pid namespace): cuda_ipc works between processes of one host; use nccl or nixl across hosts".into(),
            ));
        }
        if h.tensors.len() != exported.metas.len() {
            return Err(perr(format!(
                "handles describe {} tensors, metadata {}",
                h.tensors.len(),
                exported.metas.len()
            )));
        }
        if let Some(sh) = h
            .slabs
            .iter()
            .find(|sh| sh.record as usize >= alloc::SLAB_RECORDS || sh.handle.len() != 64)
        {
            return Err(perr(format!(
                "malformed handles: slab record {} out of range, or a {}-byte memory handle",
                sh.record,
                sh.handle.len()
            )));
        }
        if let Some(th) = h.tensors.iter().find(|th| {
            th.slot as usize >= alloc::COUNTER_SLOTS || th.slab as usize >= h.slabs.len()
        }) {
            return Err(perr(format!(
                "malformed handles: record index {} or slab #{} out of range",
                th.slot, th.slab
            )));
        }
        Ok(h)
    }

    /// Imports the tensors `h` describes. With `opening` false it does not
    /// wait on the driver: it returns `Ok(None)`, having changed nothing,
    /// where a producer's event or slab is not open in this process yet or
    /// a retired mapping is due to close (calls that may take
    /// milliseconds); the caller then asks again, with `opening`, where
    /// blocking is allowed.
    fn receive_now(
        &self,
        from: &Peer,
        exported: &Exported,
        h: &Handles,
        opening: bool,
    ) -> Result<Option<Vec<Tensor>>, TransportError> {
        let perr = |m: String| TransportError::with_peer(NAME, from, m);
        super::available().map_err(|e| perr(format!("this consumer cannot use CUDA: {e}")))?;
        let counters = open_counters(h).map_err(perr)?;
        if opening {
            close_retired_now();
        } else if retired_mapping_unused() {
            return Ok(None);
        }

        // Everything this receive uses, from the caches (or opened): no
        // wait enqueued and no record held until all of it is at hand.
        let mut local: rustc_hash::FxHashMap<GpuUuid, Arc<Gpu>> = Default::default();
        let mut waits = Vec::new();
        for (uuid, ev) in &h.events {
            let g = local_gpu(uuid).map_err(|e| perr(e.to_string()))?;
            if !ev.is_empty() {
                // Held while used: `peer_gone` may drop the cache's reference.
                match open_event(h, uuid, ev, &g, opening).map_err(|e| perr(e.to_string()))? {
                    Some(ev) => waits.push((g.clone(), ev)),
                    None => return Ok(None),
                }
            }
            local.insert(*uuid, g);
        }
        let mut maps = Vec::with_capacity(h.tensors.len());
        // Each slab's mapping, looked up once (its tensors share it).
        let mut mapped: Vec<Option<Arc<Mapping>>> = vec![None; h.slabs.len()];
        for (meta, th) in exported.metas.iter().zip(&h.tensors) {
            let Device::Cuda { uuid, .. } = &meta.device else {
                return Err(perr(format!(
                    "tensor on {} is not a CUDA tensor",
                    meta.device
                )));
            };
            if th.len as usize != meta.nbytes() {
                return Err(perr(format!(
                    "handle length {} does not match the tensor's {} bytes",
                    th.len,
                    meta.nbytes()
                )));
            }
            let g = match local.get(uuid) {
                Some(g) => g.clone(),
                None => local_gpu(uuid).map_err(|e| perr(e.to_string()))?,
            };
            let map = match &mapped[th.slab as usize] {
                Some(m) if Arc::ptr_eq(&m.gpu, &g) => m.clone(),
                _ => {
                    let sh = &h.slabs[th.slab as usize];
                    let Some(m) = open_slab(h, sh, &g, &counters, opening)
                        .map_err(|e| perr(e.to_string()))?
                    else {
                        return Ok(None);
                    };
                    mapped[th.slab as usize] = Some(m.clone());
                    m
                }
            };
            if th
                .offset
                .checked_add(th.len)
                .is_none_or(|end| end > map.len as u64)
            {
                return Err(perr("tensor range reaches past its slab".into()));
            }
            maps.push((map, *uuid));
        }
        self.producers
            .lock()
            .entry(from.actor)
            .or_default()
            .insert((h.pid, h.counters_id));

        // Order this process's stream after the producer's work.
        for (g, ev) in &waits {
            // Already passed: the producer's work before this export is
            // done, no GPU work here.
            if !event_passed(ev.event, g).map_err(|e| perr(e.to_string()))? {
                cuda_trace!(
                    "stream of local device {} waits on a producer's event",
                    g.ordinal()
                );
                g.wait_event(ev.event).map_err(|e| perr(e.to_string()))?;
            }
        }
        let mut out = Vec::with_capacity(h.tensors.len());
        for ((meta, th), (map, uuid)) in exported.metas.iter().zip(&h.tensors).zip(maps) {
            counters.hold(Region::Range, th.slot);
            let device = Device::Cuda {
                uuid,
                ordinal: map.gpu.ordinal() as u32,
            };
            let buf = ImportedRange {
                map,
                offset: th.offset as usize,
                len: th.len as usize,
                counters: counters.clone(),
                slot: th.slot,
                stream_passed: false,
            };
            out.push(
                Tensor::from_device_buffer(meta.dtype, &meta.shape, device, Box::new(buf))
                    .map_err(|e| perr(e.to_string()))?,
            );
        }
        check_received(NAME, &exported.metas, &out)?;
        Ok(Some(out))
    }
}

/// The local GPU to use for memory on device `uuid`: that device if this
/// process sees it, else the first visible device (peer access).
fn local_gpu(uuid: &GpuUuid) -> Result<Arc<Gpu>, CudaError> {
    match super::ordinal_of(uuid) {
        Some(i) => super::gpu(i),
        None => super::gpu(0),
    }
}

/// A producer process as this module's caches key it: its pid and the
/// (device, inode) of its import-record memfd.
type ProducerKey = (u32, (u64, u64));

/// A producer process this consumer imports from: its import records, and
/// a watch on its exit.
struct ProducerProcess {
    counters: Arc<Counters>,
    /// `None` where the kernel gives no pidfd: liveness is then checked
    /// through `/proc` at each receive.
    watch: Option<ProcessWatch>,
}

fn counters_cache() -> &'static Mutex<HashMap<ProducerKey, Arc<ProducerProcess>>> {
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
fn open_counters(h: &Handles) -> Result<Arc<Counters>, String> {
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
    let watch = crate::process_watch::watch(h.pid);
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
type ExportEvents = Vec<(Arc<Gpu>, IpcEvent)>;

/// A producer's event: its process, its records file, its device, its
/// handle (each export has an event of its own, from a pool).
type EventKey = (u32, (u64, u64), GpuUuid, Vec<u8>);

/// A producer's event, opened in this process; destroyed when the last
/// holder (the cache, a receive using it) drops it.
struct OpenedEvent {
    event: Event,
    /// The device whose context it was opened in.
    gpu: Arc<Gpu>,
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

fn events() -> &'static Mutex<HashMap<EventKey, Arc<OpenedEvent>>> {
    static CACHE: OnceLock<Mutex<HashMap<EventKey, Arc<OpenedEvent>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

fn open_event(
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
fn event_passed(ev: Event, g: &Gpu) -> Result<bool, CudaError> {
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

/// One mapping of a producer's slab in this process.
struct Mapping {
    key: SlabKey,
    ptr: u64,
    len: usize,
    gpu: Arc<Gpu>,
    describe: String,
    /// The producer's counters, holding the slab's record, in which this
    /// mapping counts as one hold of this process.
    counters: Arc<Counters>,
    record: u32,
}

impl Mapping {
    /// Has the producer retired the slab (wants to free it)?
    fn retiring(&self) -> bool {
        self.counters.flags(Region::Slab, self.record) & alloc::RETIRING != 0
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.gpu.bind().is_ok() {
            // SAFETY: `ptr` came from cuIpcOpenMemHandle and no tensor uses
            // it any more (each holds an Arc of this mapping).
            unsafe {
                let _ = sys::cuIpcCloseMemHandle(self.ptr);
            }
        }
        // Only after the close: the producer may free the slab now.
        self.counters.unhold(Region::Slab, self.record);
        CLOSED.fetch_add(1, Ordering::Relaxed);
        cuda_trace!("closed the mapping of {}", self.describe);
    }
}

type SlabKey = (u32, (u64, u64), u64, usize);

fn mappings() -> &'static Mutex<HashMap<SlabKey, Arc<Mapping>>> {
    static CACHE: OnceLock<Mutex<HashMap<SlabKey, Arc<Mapping>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

fn open_slab(
    h: &Handles,
    sh: &SlabHandle,
    g: &Arc<Gpu>,
    counters: &Arc<Counters>,
    opening: bool,
) -> Result<Option<Arc<Mapping>>, CudaError> {
    let key = (h.pid, h.counters_id, sh.id, g.ordinal());
    let mut cache = mappings().lock();
    if let Some(m) = cache.get(&key) {
        CACHED.fetch_add(1, Ordering::Relaxed);
        return Ok(Some(m.clone()));
    }
    if !opening {
        return Ok(None);
    }
    if sh.handle.len() != 64 {
        return Err(CudaError("malformed memory handle".into()));
    }
    let mut raw = sys::CUipcMemHandle { reserved: [0; 64] };
    for (d, s) in raw.reserved.iter_mut().zip(&sh.handle) {
        *d = *s as _;
    }
    g.bind()?;
    cuda_trace!(
        "mapping slab {} of pid {} ({} B) in local device {} ({})",
        sh.id,
        h.pid,
        sh.len,
        g.ordinal(),
        g.uuid()
    );
    let mut ptr = 0;
    // SAFETY: out-pointer valid; the handle came from cuIpcGetMemHandle.
    unsafe {
        sys::cuIpcOpenMemHandle_v2(
            &mut ptr,
            raw,
            sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
        )
    }
    .result()
    .map_err(|e| {
        let mut c = CudaError::call("cuIpcOpenMemHandle", e);
        c.0.push_str(
            " (the producer's device must be visible to the consumer, or peer-accessible from its device)",
        );
        c
    })?;
    // `record` was checked against SLAB_RECORDS by `receive_now`.
    counters.hold(Region::Slab, sh.record);
    let m = Arc::new(Mapping {
        key,
        ptr,
        len: sh.len as usize,
        gpu: g.clone(),
        describe: format!("pid {} slab {}", h.pid, sh.id),
        counters: counters.clone(),
        record: sh.record,
    });
    cuda_trace!("slab {} of pid {} mapped at {ptr:#x}", sh.id, h.pid);
    OPENED.fetch_add(1, Ordering::Relaxed);
    cache.insert(key, m.clone());
    Ok(Some(m))
}

/// Drops every cache entry of producer `key`: its import records, its
/// opened events (destroyed once no receive uses them) and its slab
/// mappings (closed now if no tensor uses them, else when the last one
/// goes: each tensor holds its mapping).
fn forget_producer(key: ProducerKey) {
    let is_key = |pid: u32, id: (u64, u64)| (pid, id) == key;
    mappings()
        .lock()
        .retain(|&(pid, id, _, _), _| !is_key(pid, id));
    events()
        .lock()
        .retain(|(pid, id, _, _), _| !is_key(*pid, *id));
    counters_cache().lock().remove(&key);
}

/// Closes every cached mapping no tensor of this process uses any more.
/// Returns how many were closed. Tensors dropped before the call are
/// counted out first (see `settle_drops`).
pub fn close_unused_mappings() -> usize {
    settle_drops();
    let mut cache = mappings().lock();
    let before = cache.len();
    cache.retain(|_, m| Arc::strong_count(m) > 1);
    before - cache.len()
}

/// Closes every cached mapping that no tensor of this process uses and
/// whose slab the producer retired, so that the producer can free it.
/// Returns how many were closed. Tensors dropped before the call are
/// counted out first (see `settle_drops`), so a tensor the caller dropped
/// no longer keeps its slab mapped.
pub fn close_retired_mappings() -> usize {
    settle_drops();
    close_retired_now()
}

/// Waits, up to 10 s, until the imported tensors dropped so far have gone
/// back to their producers: their release waits for this process's stream
/// to pass their last uses ([`super::ordered_drop`]).
fn settle_drops() {
    if !super::ordered_drop::settle(std::time::Duration::from_secs(10)) {
        tracing::warn!(
            "imported CUDA tensors dropped here still wait for this process's stream after 10 s; their mappings stay open for now"
        );
    }
}

/// [`close_retired_mappings`] without waiting for queued drops (the
/// receive path and the housekeeping tick never wait for the GPU). Cheap
/// when nothing is mapped.
fn close_retired_now() -> usize {
    let mut cache = mappings().lock();
    if cache.is_empty() {
        return 0;
    }
    let before = cache.len();
    cache.retain(|_, m| !closable(m));
    before - cache.len()
}

/// Does `m` (the cache's entry) map a slab its producer retired, with no
/// tensor of this process left in it?
fn closable(m: &Arc<Mapping>) -> bool {
    Arc::strong_count(m) == 1 && m.retiring()
}

/// Is a mapping due to close ([`close_retired_now`] would close one)?
/// Closing waits on the driver, so a receive that finds one closes it
/// where blocking is allowed.
fn retired_mapping_unused() -> bool {
    mappings().lock().values().any(closable)
}

/// Periodic upkeep for a process that uses CUDA IPC (the rdt worker runs it
/// every [`HOUSEKEEPING_PERIOD`], when [`housekeeping_due`]): importers
/// close mappings of retired slabs, producers free retired slabs no
/// importer maps any more. Touches no CUDA state in a process that never
/// used CUDA.
pub fn housekeeping() {
    close_retired_now();
    alloc::reclaim();
}

/// Could [`housekeeping`] find anything to do: does this process map a
/// producer's slab, or wait for importers to let go of its own memory?
/// Cheap (two locks, no system call), so that a process that never used
/// CUDA IPC does not run the upkeep at all.
pub fn housekeeping_due() -> bool {
    !mappings().lock().is_empty() || alloc::waiting_for_importers()
}

/// How often the rdt worker runs [`housekeeping`].
pub use crate::transport::HOUSEKEEPING_PERIOD;

/// A range of a producer's slab, as this consumer maps it.
struct ImportedRange {
    map: Arc<Mapping>,
    offset: usize,
    len: usize,
    counters: Arc<Counters>,
    slot: u32,
    /// The stream has passed every use of it: dropping it releases it at
    /// once (it went through `ordered_drop`).
    stream_passed: bool,
}

impl Drop for ImportedRange {
    fn drop(&mut self) {
        // Stream-ordered free (ordered_drop): the range goes back once this
        // process's stream passed every use enqueued before this drop.
        if !self.stream_passed {
            let range = ImportedRange {
                map: self.map.clone(),
                offset: self.offset,
                len: self.len,
                counters: self.counters.clone(),
                slot: self.slot,
                stream_passed: true,
            };
            super::ordered_drop::drop_after_stream(self.map.gpu.clone(), Box::new(range));
            return;
        }
        self.counters.unhold(Region::Range, self.slot);
        // The last tensor in a slab the producer retires: close the mapping
        // now (it closes when `self.map`, the last user, drops right after).
        if self.map.retiring() {
            let mut cache = mappings().lock();
            if cache
                .get(&self.map.key)
                .is_some_and(|m| Arc::ptr_eq(m, &self.map) && Arc::strong_count(m) == 2)
            {
                cache.remove(&self.map.key);
            }
        }
    }
}

// SAFETY: a range of a mapping that stays open while the range lives
// (the range keeps it), in the context it was opened in.
unsafe impl DeviceBuffer for ImportedRange {
    fn device_ptr(&self) -> u64 {
        self.map.ptr + self.offset as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn gpu(&self) -> &Arc<Gpu> {
        &self.map.gpu
    }
    fn describe(&self) -> String {
        format!(
            "cuda_ipc import of {} +{} ({} B)",
            self.map.describe, self.offset, self.len
        )
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

impl TensorTransport for CudaIpcTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn sidedness(&self) -> Sidedness {
        Sidedness::OneSided
    }

    /// Received tensors are copied into targets through `TransferCtx::place`.
    fn copies_into_targets(&self) -> bool {
        true
    }

    /// It opens a published memory and returns: nothing to wait for.
    fn receive_start(&self, _exported: &Exported) -> crate::ReceiveStart {
        crate::ReceiveStart::Now
    }

    fn check_device(&self, device: &Device) -> Result<(), TransportError> {
        match device {
            Device::Cuda { .. } => Ok(()),
            Device::Cpu => Err(TransportError::new(
                NAME,
                "cuda_ipc moves CUDA tensors; use shm (same host) or tcp for CPU tensors",
            )),
        }
    }

    fn export<'a>(
        &'a self,
        key: ObjectKey,
        tensors: &'a [Tensor],
    ) -> BoxFuture<'a, Result<Exported, TransportError>> {
        Box::pin(async move { self.export_now(key, tensors) })
    }

    fn receive<'a>(
        &'a self,
        from: &'a Peer,
        cx: &'a TransferCtx,
        exported: &'a Exported,
    ) -> BoxFuture<'a, Result<Vec<Tensor>, TransportError>> {
        // Opening IPC handles blocks for 50 µs to 2 ms (more on a first
        // open across GPUs): off the executor's hands where the runtime
        // allows it (contract point 5).
        Box::pin(async move {
            let h = self.handles(from, exported)?;
            // From the caches (every pass after the first of a producer's
            // slab): no call here waits on the driver, so it runs where it
            // is, without `block_in_place` handing this thread's runtime
            // to another (several microseconds of a 4 KiB hand-off).
            let mapped = match self.receive_now(from, exported, &h, false)? {
                Some(t) => t,
                None => {
                    let open = || self.receive_now(from, exported, &h, true);
                    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
                        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                            tokio::task::block_in_place(open)
                        }
                        _ => open(),
                    }?
                    .expect("a receive that may open does not give up")
                }
            };
            cx.place(NAME, &exported.metas, mapped)
        })
    }

    fn release(&self, key: ObjectKey) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            for (g, ev) in self.export_events.lock().remove(&key).unwrap_or_default() {
                g.return_ipc_event(ev);
            }
            self.copies.lock().remove(&key);
            alloc::reclaim();
            Ok(())
        })
    }

    /// Drops the cache entries of the producer processes `actor` sent
    /// tensors from (unless another live actor sent from the same one):
    /// its import records, opened events and slab mappings. Tensors
    /// received from it keep their mappings until they are dropped.
    fn peer_gone(&self, actor: u64) {
        let gone = {
            let mut producers = self.producers.lock();
            let Some(keys) = producers.remove(&actor) else {
                return;
            };
            keys.into_iter()
                .filter(|k| !producers.values().any(|ks| ks.contains(k)))
                .collect::<Vec<_>>()
        };
        for key in gone {
            forget_producer(key);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn peer() -> Peer {
        Peer {
            actor: 1,
            name: "producer".into(),
            host: "here".into(),
            endpoint: String::new(),
        }
    }

    #[test]
    fn cpu_tensors_are_refused() {
        let t = CudaIpcTransport::new();
        let e = t.check_device(&Device::Cpu).unwrap_err();
        assert!(e.message.contains("shm"), "{e}");
        let x = Tensor::full(1f32, &[4]);
        let e = futures::executor::block_on(t.export(1, &[x])).unwrap_err();
        assert!(e.message.contains("CUDA tensors"), "{e}");
    }

    /// Handles from a producer on this host (this process), with `tensors`.
    fn handles_here(tensors: Vec<TensorHandle>) -> Handles {
        Handles {
            boot_id: host_id().unwrap().boot_id.clone(),
            pid_ns: host_id().unwrap().pid_ns,
            pid: std::process::id(),
            counters_fd: 0,
            counters_id: (0, 0),
            events: vec![],
            slabs: vec![SlabHandle {
                id: 1,
                handle: vec![0; 64],
                len: 1024,
                record: 0,
            }],
            tensors,
        }
    }

    /// What a fresh transport's `receive` of `h` with `metas` fails with.
    fn receive_error(h: &Handles, metas: Vec<crate::TensorMeta>) -> TransportError {
        let ex = Exported {
            metas,
            handles: postcard::to_allocvec(h).unwrap(),
            inline: vec![],
        };
        futures::executor::block_on(CudaIpcTransport::new().receive(
            &peer(),
            &TransferCtx::new(0),
            &ex,
        ))
        .unwrap_err()
    }

    #[test]
    fn another_host_is_a_clear_error() {
        let h = Handles {
            boot_id: "another-boot".into(),
            pid_ns: None,
            pid: 1,
            ..handles_here(vec![])
        };
        let e = receive_error(&h, vec![]);
        assert!(e.message.contains("another host"), "{e}");
    }

    #[test]
    fn out_of_range_record_indices_are_refused() {
        let mut h = handles_here(vec![TensorHandle {
            slab: 0,
            offset: 0,
            len: 16,
            slot: alloc::COUNTER_SLOTS as u32,
        }]);
        let meta = Tensor::zeros(crate::DType::F32, &[4]).meta();
        let e = receive_error(&h, vec![meta.clone()]);
        assert!(e.message.contains("out of range"), "{e}");
        h.tensors[0].slot = 0;
        h.tensors[0].slab = 1; // one slab only
        let e = receive_error(&h, vec![meta.clone()]);
        assert!(e.message.contains("out of range"), "{e}");
        h.tensors[0].slab = 0;
        h.slabs[0].record = u32::MAX;
        let e = receive_error(&h, vec![meta.clone()]);
        assert!(e.message.contains("out of range"), "{e}");
        h.slabs[0].record = 0;
        h.slabs[0].handle = vec![0; 3];
        let e = receive_error(&h, vec![meta]);
        assert!(e.message.contains("3-byte memory handle"), "{e}");
    }

    /// Defect 8: the caches of producers' records, events and mappings
    /// were never pruned when a producer died.
    #[test]
    fn peer_gone_forgets_the_producers_caches() {
        // This process's own import records stand in for a producer's
        // (no GPU needed); a second key stands in for another producer.
        let mine = alloc::counters().unwrap();
        let key = (std::process::id(), mine.id);
        let other = (u32::MAX, (u64::MAX, u64::MAX));
        for k in [key, other] {
            let c = Counters::open(key.0, mine.fd(), mine.id).unwrap();
            let p = ProducerProcess {
                counters: Arc::new(c),
                watch: None,
            };
            counters_cache().lock().insert(k, Arc::new(p));
        }
        let cached = |k: &ProducerKey| counters_cache().lock().contains_key(k);

        let t = CudaIpcTransport::new();
        // Actors 7 and 8 run in one process; 9 in another.
        for (actor, k) in [(7, key), (8, key), (9, other)] {
            t.producers.lock().entry(actor).or_default().insert(k);
        }
        t.peer_gone(7);
        assert!(cached(&key), "actor 8 still sends from that process");
        t.peer_gone(8);
        assert!(!cached(&key) && cached(&other));
        t.peer_gone(9);
        assert!(!cached(&other));
        assert!(t.producers.lock().is_empty());
        t.peer_gone(10); // unknown: nothing to do
    }

    /// After the first receive from a producer process, its liveness is
    /// its pidfd's: a producer that exited is a clear error, and leaves
    /// the cache.
    #[test]
    fn a_cached_producer_that_exited_is_an_error() {
        let mine = alloc::counters().unwrap();
        let mut h = handles_here(vec![]);
        h.counters_fd = mine.fd();
        h.counters_id = mine.id;
        // This process as its own producer: alive, cached, watched.
        open_counters(&h).unwrap();
        let key = (h.pid, h.counters_id);
        let p = counters_cache().lock().get(&key).cloned().expect("cached");
        let Some(w) = &p.watch else {
            eprintln!("skipped: no pidfd on this kernel");
            return;
        };
        assert!(!w.exited());
        open_counters(&h).expect("alive, from the cache");

        // A process that has exited, cached as if it had sent tensors.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        let watch = crate::process_watch::watch(pid);
        child.wait().unwrap();
        let Some(watch) = watch else {
            return; // it was reaped before the watch: nothing to check
        };
        let dead = (pid, h.counters_id);
        counters_cache().lock().insert(
            dead,
            Arc::new(ProducerProcess {
                counters: p.counters.clone(),
                watch: Some(watch),
            }),
        );
        h.pid = pid;
        let e = open_counters(&h).err().expect("a dead producer");
        assert!(e.contains("has exited"), "{e}");
        assert!(!counters_cache().lock().contains_key(&dead));
    }

    #[test]
    fn without_cuda_receive_says_why() {
        if super::super::available().is_ok() {
            return;
        }
        let e = receive_error(&handles_here(vec![]), vec![]);
        assert!(e.message.contains("cannot use CUDA"), "{e}");
        let e = Tensor::cuda_zeros(crate::DType::F32, &[4], 0).unwrap_err();
        assert!(e.to_string().contains("CUDA"), "{e}");
    }
}
