//! The consumer's mappings of producers' slabs: opened once per slab and
//! cached, closed when the producer retires the slab and no tensor uses it
//! any more, or when the producer is gone; and the imported ranges that
//! CUDA tensors are made of.

use super::*;

use crate::trace::cuda_trace;

/// One mapping of a producer's slab in this process.
pub(super) struct Mapping {
    pub(super) key: SlabKey,
    pub(super) ptr: u64,
    pub(super) len: usize,
    pub(super) gpu: Arc<Gpu>,
    pub(super) describe: String,
    /// The producer's counters, holding the slab's record, in which this
    /// mapping counts as one hold of this process.
    pub(super) counters: Arc<Counters>,
    pub(super) record: u32,
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

pub(super) type SlabKey = (u32, (u64, u64), u64, usize);

fn mappings() -> &'static Mutex<HashMap<SlabKey, Arc<Mapping>>> {
    static CACHE: OnceLock<Mutex<HashMap<SlabKey, Arc<Mapping>>>> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

pub(super) fn open_slab(
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
pub(super) fn forget_producer(key: ProducerKey) {
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
/// to pass their last uses ([`crate::cuda::ordered_drop`]).
fn settle_drops() {
    if !crate::cuda::ordered_drop::settle(std::time::Duration::from_secs(10)) {
        tracing::warn!(
            "imported CUDA tensors dropped here still wait for this process's stream after 10 s; their mappings stay open for now"
        );
    }
}

/// [`close_retired_mappings`] without waiting for queued drops (the
/// receive path and the housekeeping tick never wait for the GPU). Cheap
/// when nothing is mapped.
pub(super) fn close_retired_now() -> usize {
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
pub(super) fn retired_mapping_unused() -> bool {
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

/// A range of a producer's slab, as this consumer maps it.
pub(super) struct ImportedRange {
    pub(super) map: Arc<Mapping>,
    pub(super) offset: usize,
    pub(super) len: usize,
    pub(super) counters: Arc<Counters>,
    pub(super) slot: u32,
    /// The stream has passed every use of it: dropping it releases it at
    /// once (it went through `ordered_drop`).
    pub(super) stream_passed: bool,
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
            crate::cuda::ordered_drop::drop_after_stream(self.map.gpu.clone(), Box::new(range));
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
