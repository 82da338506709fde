//! Exportable device memory: slabs from `cuMemAlloc`, sub-allocated.
//!
//! Every CUDA tensor rdt makes lives in a range of a slab. Small tensors
//! share slabs of [`SLAB_BYTES`]; a tensor larger than that gets a slab of
//! its own. Because consecutive tensors land in the same few slabs, a
//! consumer of the [`cuda_ipc`](crate::cuda_ipc) transport that mapped a slab once
//! reuses that mapping for every later tensor in it (gpu.md pitfall 2).
//!
//! # Lifetime invariants
//! 1. **Ranges.** A range is recycled once the producer's last tensor over
//!    it is dropped **and** no live consumer holds a tensor over it. Each
//!    consumer process counts its tensors over the range in its own cell
//!    of the range's shared record (`Counters`): up when it builds a
//!    tensor over the range, down when the tensor is dropped (which
//!    happens when the owner table frees the object). A range still held
//!    when the producer drops it waits in a pending list, reclaimed on
//!    later allocations, releases and the worker's housekeeping. The share
//!    of a consumer that died is discarded (its process, and with it its
//!    mapping, is gone).
//! 2. **Slabs are cached.** A slab whose ranges are all free stays
//!    allocated (like a caching allocator), so the next tensor of that size
//!    lands in memory consumers have already mapped.
//! 3. **Slabs are freed only after every importer closed its mapping.**
//!    [`trim`] (and an allocation that runs out of memory) *retires* every
//!    slab with no range in use: a slab never exported is freed at once;
//!    an exported one is flagged retiring in its shared slab record, and
//!    freed (`cuMemFree`) once no live process is registered in that record.
//!    An importer registers its pid when it maps the slab and unregisters
//!    after `cuIpcCloseMemHandle`; it closes a retiring slab's mapping as
//!    soon as no tensor of its own uses it (when the owner table frees the
//!    object, at its next receive, or at the worker's periodic
//!    housekeeping). An importer that died counts as gone. An importer that
//!    found no free cell in the record pins the slab (never freed: safe).
//! 4. A retiring slab is never allocated from again; slab ids are never
//!    reused, so an importer's cached mapping can never be mistaken for a
//!    later slab at the same address.
//! 5. **Another stream writes clean memory only.** A slab remembers the
//!    free mark current at its last free (see the `cuda` module's free
//!    marks, FM-1). `alloc_for_other_stream` takes a range of a clean
//!    slab where one has room. Else, for a large tensor (a slab of its
//!    own) while the device has at least [`ROOM_FOR_CLEAN`] times its size
//!    free, a new slab: large slabs mark their frees (FM-3), so a dirty one
//!    turns clean once rdt's stream passes its free, and the cache grows
//!    by at most what is in flight (as a stream-ordered caching allocator
//!    does). Else any slab with room (and says it is not clean: the
//!    caller orders its stream after rdt's), else a new slab. Small
//!    tensors never make a slab only because cached ones are not clean.

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use memmap2::MmapRaw;
use parking_lot::Mutex;

use super::{CudaError, DeviceBuffer, Gpu};
use crate::rt::free_list::FreeList;

/// Size of a shared slab; larger tensors get a slab of their own.
pub const SLAB_BYTES: usize = 64 << 20;
/// Alignment of every range.
pub const ALIGN: usize = 512;
/// Large slabs are rounded up to this.
const LARGE_ROUND: usize = 2 << 20;
/// A large range for another stream takes a new slab rather than a dirty
/// cached one while the device has this many times its size free
/// (invariant 5).
pub const ROOM_FOR_CLEAN: usize = 4;
/// Number of import counters (live exported ranges) per process.
pub const COUNTER_SLOTS: usize = 1 << 16;
/// Number of slab records (exported slabs alive at once) per process.
pub const SLAB_RECORDS: usize = 1 << 12;
/// `u64` cells per range or slab record: one of flags, then importers.
const RECORD_CELLS: usize = 8;
/// Slab record flag: the producer wants to free the slab.
pub(crate) const RETIRING: u32 = 1;
/// Record flag: an importer found no free cell; never recycle the range or
/// free the slab.
const PINNED: u32 = 2;
/// Size of the shared record file (sparse: only touched pages use memory).
const COUNTER_FILE_BYTES: usize = (COUNTER_SLOTS + SLAB_RECORDS) * RECORD_CELLS * 8;

static NEXT_SLAB: AtomicU64 = AtomicU64::new(1);

/// One `cuMemAlloc` allocation.
pub(crate) struct Slab {
    pub(crate) id: u64,
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) base: u64,
    pub(crate) len: usize,
    /// IPC handle and shared slab record, made on first export.
    handle: OnceLock<Result<([u8; 64], u32), CudaError>>,
    /// Free ranges.
    free: FreeList,
    /// The free mark current when a range of it was last freed (5).
    freed_mark: AtomicU64,
    /// Run just before the slab is freed: what other parts of rdt made of
    /// its memory (a NIXL registration) is undone while it still exists.
    before_free: Mutex<Vec<Box<dyn FnOnce() + Send>>>,
    /// For an allocation of another library adopted by [`adopt`]: what
    /// keeps it alive (dropped instead of `cuMemFree`), one per import.
    foreign: Option<Mutex<Vec<Box<dyn Send + Sync>>>>,
}

impl Slab {
    /// The slab's IPC handle and the index of its shared slab record
    /// (invariant 3), made on first export.
    pub(crate) fn ipc_handle(&self) -> Result<([u8; 64], u32), CudaError> {
        self.handle
            .get_or_init(|| {
                let record = counters()?.take(Region::Slab)?;
                let made = (|| {
                    self.gpu.bind()?;
                    let mut h =
                        std::mem::MaybeUninit::<cudarc::driver::sys::CUipcMemHandle>::uninit();
                    // SAFETY: `base` is the start of a cuMemAlloc allocation.
                    unsafe {
                        cudarc::driver::sys::cuIpcGetMemHandle(h.as_mut_ptr(), self.base)
                            .result()
                            .map_err(|e| CudaError::call("cuIpcGetMemHandle", e))?;
                        Ok(h.assume_init().reserved.map(|c| c as u8))
                    }
                })();
                match made {
                    Ok(h) => Ok((h, record)),
                    Err(e) => {
                        counters()?.give(Region::Slab, record);
                        Err(e)
                    }
                }
            })
            .clone()
    }

    /// The slab record, if the slab was ever exported.
    fn record(&self) -> Option<u32> {
        match self.handle.get() {
            Some(Ok((_, r))) => Some(*r),
            _ => None,
        }
    }

    /// Is every byte of the slab free (no range in use or pending)?
    fn unused(&self) -> bool {
        self.free.all_free()
    }

    fn take(&self, len: usize) -> Option<usize> {
        self.free.take(len)
    }

    fn give(&self, off: usize, len: usize) {
        // An adopted allocation is never allocated from: its ranges are
        // the imports over it.
        if self.foreign.is_none() {
            self.free.give(off, len)
        }
    }

    /// Has rdt's stream passed every use of memory freed in this slab (5)?
    fn clean(&self) -> bool {
        self.gpu
            .marks()
            .clean(self.freed_mark.load(Ordering::SeqCst))
    }
}

impl Slab {
    /// Runs `f` just before the slab's memory is freed.
    #[cfg_attr(not(feature = "nixl"), allow(dead_code))]
    pub(crate) fn before_free(&self, f: Box<dyn FnOnce() + Send>) {
        self.before_free.lock().push(f);
    }
}

impl Drop for Slab {
    fn drop(&mut self) {
        for f in std::mem::take(&mut *self.before_free.lock()) {
            f();
        }
        // Only the allocator drops slabs, and only unused ones whose
        // importers are all gone (invariant 3). An adopted allocation goes
        // back to its library: its owners' drops free it.
        if let Some(owners) = &self.foreign {
            // The library may reuse the memory at once: rdt's work on it
            // ends first.
            if let Err(e) = self.gpu.synchronize() {
                tracing::warn!("adopted slab {}: waiting for rdt's stream: {e}", self.id);
            }
            drop(std::mem::take(&mut *owners.lock()));
        } else if self.gpu.bind().is_ok() {
            // SAFETY: `base` came from cuMemAlloc; no range and no importer
            // uses it any more.
            let r = unsafe { cudarc::driver::result::free_sync(self.base) };
            if let Err(e) = r {
                tracing::warn!("cuMemFree of slab {}: {e:?}", self.id);
            }
        }
        if let (Some(record), Ok(c)) = (self.record(), counters()) {
            c.give(Region::Slab, record);
        }
        super::cuda_trace!(
            "freed slab {} ({} B) on {}",
            self.id,
            self.len,
            self.gpu.uuid()
        );
    }
}

struct Pending {
    slab: Arc<Slab>,
    offset: usize,
    len: usize,
    slot: u32,
}

#[derive(Default)]
struct Allocator {
    /// Slabs allocations are served from, per local ordinal.
    slabs: HashMap<usize, Vec<Arc<Slab>>>,
    /// Ranges waiting for importers to drop their tensors (invariant 1).
    pending: Vec<Pending>,
    /// Unused slabs waiting for importers to close their mappings
    /// (invariant 3).
    retiring: Vec<Arc<Slab>>,
    /// Allocations of other libraries adopted as slabs ([`adopt`]), by
    /// local ordinal and base address: retired once no range of theirs
    /// and no pending range holds them.
    foreign: HashMap<(usize, u64), Arc<Slab>>,
}

fn allocator() -> &'static Mutex<Allocator> {
    static A: OnceLock<Mutex<Allocator>> = OnceLock::new();
    A.get_or_init(Default::default)
}

fn round(len: usize, to: usize) -> usize {
    len.div_ceil(to).max(1) * to
}

/// Recycles pending ranges no consumer holds any more, and frees retiring
/// slabs no importer maps any more.
pub(crate) fn reclaim() {
    let mut a = allocator().lock();
    reclaim_locked(&mut a);
}

fn reclaim_locked(a: &mut Allocator) {
    if a.pending.is_empty() && a.retiring.is_empty() && a.foreign.is_empty() {
        return;
    }
    let Ok(c) = counters() else { return };
    // An adopted allocation only the allocator holds is unused: retired
    // as any slab (invariant 3), or let go at once if never exported.
    let unused: Vec<(usize, u64)> = (a.foreign.iter())
        .filter(|(_, s)| Arc::strong_count(s) == 1)
        .map(|(k, _)| *k)
        .collect();
    for k in unused {
        let s = a.foreign.remove(&k).expect("listed above");
        if let Some(r) = s.record() {
            c.set_flag(Region::Slab, r, RETIRING);
            a.retiring.push(s);
        }
    }
    a.pending.retain(|p| {
        if !c.held(Region::Range, p.slot) {
            p.slab.give(p.offset, p.len);
            c.give(Region::Range, p.slot);
            false
        } else {
            true
        }
    });
    // Dropping a slab frees it (`Slab::drop`).
    a.retiring
        .retain(|s| s.record().is_some_and(|r| c.held(Region::Slab, r)));
}

/// Does this process hold ranges or slabs that wait for importers (what
/// [`reclaim`] would look at)?
pub(crate) fn waiting_for_importers() -> bool {
    let a = allocator().lock();
    !a.pending.is_empty() || !a.retiring.is_empty() || !a.foreign.is_empty()
}

/// What [`trim`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Trimmed {
    /// Bytes returned to the driver now.
    pub freed_bytes: usize,
    /// Bytes in retiring slabs that other processes still map: freed once
    /// they close their mappings (see the module docs, invariant 3).
    pub waiting_bytes: usize,
}

/// Returns the memory of every unused slab of this process to the driver:
/// at once where no other process maps it, else as soon as the importers
/// close their mappings (they do when their tensors over it are gone). Like
/// `torch.cuda.empty_cache`; an allocation that runs out of memory does
/// this by itself before it fails.
pub fn trim() -> Trimmed {
    let mut a = allocator().lock();
    trim_locked(&mut a)
}

fn trim_locked(a: &mut Allocator) -> Trimmed {
    reclaim_locked(a);
    let mut out = Trimmed::default();
    let mut retire = Vec::new();
    for slabs in a.slabs.values_mut() {
        slabs.retain(|s| {
            if s.unused() {
                retire.push(s.clone());
                false
            } else {
                true
            }
        });
    }
    for s in retire {
        match (s.record(), counters()) {
            (Some(r), Ok(c)) => {
                c.set_flag(Region::Slab, r, RETIRING);
                super::cuda_trace!("retiring slab {} ({} B)", s.id, s.len);
                a.retiring.push(s);
            }
            // Never exported: nobody else maps it.
            _ => out.freed_bytes += s.len,
        }
    }
    let before: usize = a.retiring.iter().map(|s| s.len).sum();
    reclaim_locked(a);
    let after: usize = a.retiring.iter().map(|s| s.len).sum();
    out.freed_bytes += before - after;
    out.waiting_bytes = after;
    out
}

/// A fresh range of `len` bytes on `gpu` (contents undefined), for rdt's
/// stream.
pub(crate) fn alloc(gpu: &Arc<Gpu>, len: usize) -> Result<SlabRange, CudaError> {
    alloc_in(gpu, len, false).map(|(r, _)| r)
}

/// A fresh range of `len` bytes on `gpu` for another stream to write (a
/// transfer's), and whether it is clean: rdt's stream passed every use of
/// its memory, so the other stream need not wait for rdt's (invariant 5).
pub(crate) fn alloc_for_other_stream(
    gpu: &Arc<Gpu>,
    len: usize,
) -> Result<(SlabRange, bool), CudaError> {
    alloc_in(gpu, len, true)
}

fn alloc_in(
    gpu: &Arc<Gpu>,
    len: usize,
    prefer_clean: bool,
) -> Result<(SlabRange, bool), CudaError> {
    let want = round(len, ALIGN);
    if prefer_clean {
        gpu.poll_marks();
    }
    let mut a = allocator().lock();
    reclaim_locked(&mut a);
    let slabs = a.slabs.entry(gpu.ordinal()).or_default();
    // A large one takes a new slab instead of a dirty one while there is
    // ample room (invariant 5).
    let mut skip_dirty = false;
    if prefer_clean {
        for s in slabs.iter().filter(|s| s.clean()) {
            if let Some(off) = s.take(want) {
                return Ok((SlabRange::new(s.clone(), off, len, want), true));
            }
        }
        skip_dirty = want > SLAB_BYTES
            && gpu
                .free_bytes()
                .is_ok_and(|free| free / ROOM_FOR_CLEAN >= round(want, LARGE_ROUND));
    }
    for s in slabs.iter().filter(|_| !skip_dirty) {
        if let Some(off) = s.take(want) {
            // Asked only where it matters: a range for rdt's stream needs
            // no answer.
            let clean = prefer_clean && s.clean();
            return Ok((SlabRange::new(s.clone(), off, len, want), clean));
        }
    }
    let slab_len = if want > SLAB_BYTES {
        round(want, LARGE_ROUND)
    } else {
        SLAB_BYTES
    };
    let base = match gpu.malloc(slab_len) {
        Ok(b) => b,
        Err(e) if e.0.contains("OUT_OF_MEMORY") => {
            // Give cached slabs back and try once more (invariant 3).
            let t = trim_locked(&mut a);
            gpu.malloc(slab_len).map_err(|e| {
                CudaError(format!(
                    "{e}; rdt returned {} B of cached slabs to the driver first, and {} B more \
                     wait for other processes to drop tensors they received from this one",
                    t.freed_bytes, t.waiting_bytes
                ))
            })?
        }
        Err(e) => return Err(e),
    };
    let slabs = a.slabs.entry(gpu.ordinal()).or_default();
    let slab = Arc::new(Slab {
        id: NEXT_SLAB.fetch_add(1, Ordering::Relaxed),
        gpu: gpu.clone(),
        base,
        len: slab_len,
        handle: OnceLock::new(),
        free: FreeList::new(slab_len),
        freed_mark: AtomicU64::new(0),
        before_free: Mutex::new(Vec::new()),
        foreign: None,
    });
    let off = slab.take(want).expect("a fresh slab fits");
    slabs.push(slab.clone());
    Ok((SlabRange::new(slab, off, len, want), true))
}

/// `len` bytes at `ptr` on `gpu`, memory of another library kept alive by
/// `owner`, as a range of a slab of rdt's: the allocation it lies in
/// (`cuMemGetAddressRange`) adopted, so that `cuda_ipc` hands it to other
/// processes by its IPC handle and `nixl` registers it, with no device
/// copy. Imports over one allocation share its slab. `Err(owner)` where
/// `cuIpcGetMemHandle` refuses the allocation (pools, virtual or managed
/// memory): the caller keeps it as it is; `cuda_ipc` copies it at export.
///
/// The owners drop (and the library frees the memory) once no range over
/// the allocation is left here, no process holds a tensor over it, and
/// every process that mapped it closed its mapping (invariants 1 and 3;
/// checked where [`reclaim`] runs: allocations, the worker's
/// housekeeping, [`trim`]).
///
/// # Safety
/// `ptr..ptr + len` must be device memory usable in `gpu`'s context, kept
/// allocated for as long as `owner` lives.
pub(crate) unsafe fn adopt(
    gpu: &Arc<Gpu>,
    ptr: u64,
    len: usize,
    owner: Box<dyn Send + Sync>,
) -> Result<SlabRange, Box<dyn Send + Sync>> {
    let located = (|| -> Result<(u64, usize), CudaError> {
        gpu.bind()?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: out-pointers to locals; the driver checks the address.
        unsafe { cudarc::driver::sys::cuMemGetAddressRange_v2(&mut base, &mut size, ptr) }
            .result()
            .map_err(|e| CudaError::call("cuMemGetAddressRange", e))?;
        Ok((base, size))
    })();
    let Ok((base, size)) = located else {
        return Err(owner);
    };
    if ptr + len as u64 > base + size as u64 {
        return Err(owner);
    }
    let mut a = allocator().lock();
    let slab = match a.foreign.get(&(gpu.ordinal(), base)) {
        Some(s) => s.clone(),
        None => {
            let s = Arc::new(Slab {
                id: NEXT_SLAB.fetch_add(1, Ordering::Relaxed),
                gpu: gpu.clone(),
                base,
                len: size,
                handle: OnceLock::new(),
                free: FreeList::new(0),
                freed_mark: AtomicU64::new(0),
                before_free: Mutex::new(Vec::new()),
                foreign: Some(Mutex::new(Vec::new())),
            });
            // Exportable, or not adopted at all.
            if s.ipc_handle().is_err() {
                return Err(owner);
            }
            a.foreign.insert((gpu.ordinal(), base), s.clone());
            s
        }
    };
    slab.foreign
        .as_ref()
        .expect("an adopted slab")
        .lock()
        .push(owner);
    let offset = (ptr - base) as usize;
    Ok(SlabRange::new(slab, offset, len, len))
}

/// Bytes held in slabs (in use, cached or retiring) on each local ordinal.
pub fn slab_bytes() -> HashMap<usize, usize> {
    let a = allocator().lock();
    let mut out: HashMap<usize, usize> = HashMap::new();
    for (k, v) in &a.slabs {
        *out.entry(*k).or_default() += v.iter().map(|s| s.len).sum::<usize>();
    }
    for s in &a.retiring {
        *out.entry(s.gpu.ordinal()).or_default() += s.len;
    }
    out
}

/// Part of a [`SlabRange`]: tensors received together share one range
/// (one allocation), each over its own slice. The range goes back to the
/// allocator when the last slice is dropped.
pub struct SlabSlice {
    range: Arc<SlabRange>,
    offset: usize,
    len: usize,
}

// Slices are made by the nixl transport's receive.
#[cfg_attr(not(feature = "nixl"), allow(dead_code))]
impl SlabSlice {
    /// `len` bytes at `offset` of `range` (which must hold them).
    pub(crate) fn new(range: Arc<SlabRange>, offset: usize, len: usize) -> SlabSlice {
        assert!(offset + len <= range.len, "a slice within its range");
        SlabSlice { range, offset, len }
    }

    pub(crate) fn range(&self) -> &SlabRange {
        &self.range
    }

    pub(crate) fn offset(&self) -> usize {
        self.offset
    }
}

// SAFETY: a range of a live slab (the slice keeps the slab), freed
// stream-ordered (alloc, invariant 5).
unsafe impl DeviceBuffer for SlabSlice {
    fn device_ptr(&self) -> u64 {
        self.range.device_ptr() + self.offset as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn gpu(&self) -> &Arc<Gpu> {
        &self.range.slab.gpu
    }
    fn describe(&self) -> String {
        format!(
            "slice +{} ({} B) of {}",
            self.offset,
            self.len,
            self.range.describe()
        )
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// A range of a slab: the memory of CUDA tensors made in this process.
pub struct SlabRange {
    pub(crate) slab: Arc<Slab>,
    pub(crate) offset: usize,
    len: usize,
    reserved: usize,
    /// Import counter slot, once exported.
    slot: Mutex<Option<u32>>,
}

impl SlabRange {
    fn new(slab: Arc<Slab>, offset: usize, len: usize, reserved: usize) -> Self {
        SlabRange {
            slab,
            offset,
            len,
            reserved,
            slot: Mutex::new(None),
        }
    }

    /// The import counter slot of this range, allocated on first export.
    pub(crate) fn counter_slot(&self) -> Result<u32, CudaError> {
        let mut s = self.slot.lock();
        if let Some(v) = *s {
            return Ok(v);
        }
        let v = counters()?.take(Region::Range)?;
        *s = Some(v);
        Ok(v)
    }
}

impl Drop for SlabRange {
    fn drop(&mut self) {
        // Every use of this range on rdt's stream was enqueued before now
        // (invariant 5, FM-1); a slab of its own marks the free (FM-3).
        let mark = self.slab.gpu.marks().current();
        self.slab.freed_mark.fetch_max(mark, Ordering::SeqCst);
        if self.reserved > SLAB_BYTES {
            self.slab.gpu.mark_free();
        }
        let slot = *self.slot.get_mut();
        let mut a = allocator().lock();
        match (slot, counters()) {
            (Some(slot), Ok(c)) if c.held(Region::Range, slot) => a.pending.push(Pending {
                slab: self.slab.clone(),
                offset: self.offset,
                len: self.reserved,
                slot,
            }),
            (slot, c) => {
                self.slab.give(self.offset, self.reserved);
                if let (Some(slot), Ok(c)) = (slot, c) {
                    c.give(Region::Range, slot);
                }
            }
        }
    }
}

// SAFETY: a range of a live slab (the range keeps the slab), freed
// stream-ordered (alloc, invariant 5).
unsafe impl DeviceBuffer for SlabRange {
    fn device_ptr(&self) -> u64 {
        self.slab.base + self.offset as u64
    }
    fn len(&self) -> usize {
        self.len
    }
    fn gpu(&self) -> &Arc<Gpu> {
        &self.slab.gpu
    }
    fn describe(&self) -> String {
        format!(
            "cuda slab {} +{} ({} B) on {}",
            self.slab.id,
            self.offset,
            self.len,
            self.slab.gpu.uuid()
        )
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// Which kind of record: one per exported range, or one per exported slab.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Region {
    /// [`COUNTER_SLOTS`] records; a holder is a process with tensors over
    /// the range.
    Range,
    /// [`SLAB_RECORDS`] records; a holder is a process that maps the slab.
    Slab,
}

impl Region {
    fn len(self) -> usize {
        match self {
            Region::Range => COUNTER_SLOTS,
            Region::Slab => SLAB_RECORDS,
        }
    }
    /// First record of the region in the file.
    fn base(self) -> usize {
        match self {
            Region::Range => 0,
            Region::Slab => COUNTER_SLOTS,
        }
    }
}

/// Import records shared with consumers: a memfd of `u64` cells that
/// consumers map through `/proc/<pid>/fd/<fd>` (as the `shm` transport
/// does). It holds [`COUNTER_SLOTS`] range records, then [`SLAB_RECORDS`]
/// slab records ([`Region`]), each of [`RECORD_CELLS`] cells.
///
/// Cell 0 of a record holds flags ([`RETIRING`], [`PINNED`]). Every other
/// cell belongs to one holder process as `pid << 32 | count`: for a range,
/// the tensors that process holds over it; for a slab, the mappings that
/// process has of it. A holder updates only its own cell (one atomic
/// compare-and-swap), so the producer can tell a dead holder's share apart
/// and discard it. A holder that finds no free cell sets [`PINNED`]: the
/// range or slab is then never recycled (leaked, never unsafe).
pub(crate) struct Counters {
    file: File,
    map: MmapRaw,
    /// Free range and slab records (producer side), by [`Region`].
    free: [Mutex<Vec<u32>>; 2],
    /// (device, inode) of the memfd, so that a consumer can tell it apart
    /// from a reused descriptor.
    pub(crate) id: (u64, u64),
}

impl Counters {
    /// Cell `i` of record `index` of `region`.
    fn cell(&self, region: Region, index: u32, i: usize) -> &AtomicU64 {
        assert!((index as usize) < region.len() && i < RECORD_CELLS);
        let at = ((region.base() + index as usize) * RECORD_CELLS + i) * 8;
        assert!(at + 8 <= self.map.len(), "record cell in range");
        // SAFETY: the mapping lives as long as `self`, is 8-aligned (page)
        // and the cell is in range; the memory is shared, so only atomics
        // touch it.
        unsafe { &*(self.map.as_mut_ptr().add(at) as *const AtomicU64) }
    }

    /// Counts one more of this process's holds on a record (consumer).
    pub(crate) fn hold(&self, region: Region, index: u32) {
        let me = this_pid();
        // Our own cell if we have one, else a free one.
        for want_empty in [false, true] {
            for i in 1..RECORD_CELLS {
                let c = self.cell(region, index, i);
                let mut v = c.load(Ordering::Acquire);
                loop {
                    let ours = v >> 32 == me;
                    if !(ours || (want_empty && v == 0)) {
                        break;
                    }
                    let next = if ours { v + 1 } else { (me << 32) | 1 };
                    match c.compare_exchange(v, next, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(_) => return,
                        Err(now) => v = now,
                    }
                }
            }
        }
        self.set_flag(region, index, PINNED);
    }
    /// Counts one of this process's holds on a record fewer.
    pub(crate) fn unhold(&self, region: Region, index: u32) {
        let me = this_pid();
        for i in 1..RECORD_CELLS {
            let c = self.cell(region, index, i);
            let mut v = c.load(Ordering::Acquire);
            while v >> 32 == me && v & 0xffff_ffff != 0 {
                // The last hold empties the cell for other processes.
                let next = if v & 0xffff_ffff == 1 { 0 } else { v - 1 };
                match c.compare_exchange(v, next, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => return,
                    Err(now) => v = now,
                }
            }
        }
        // Pinned records have no cell of ours: nothing to count down.
    }
    /// Is the record pinned, or held by a live process? Clears the cells
    /// of dead holders.
    pub(crate) fn held(&self, region: Region, index: u32) -> bool {
        if self.flags(region, index) & PINNED != 0 {
            return true;
        }
        let mut held = false;
        for i in 1..RECORD_CELLS {
            let c = self.cell(region, index, i);
            let v = c.load(Ordering::Acquire);
            if v == 0 {
                continue;
            }
            if process_alive((v >> 32) as u32) {
                held = true;
            } else {
                let _ = c.compare_exchange(v, 0, Ordering::AcqRel, Ordering::Acquire);
            }
        }
        held
    }
    /// Holds counted on a record, over every process.
    #[cfg(test)]
    fn holds(&self, region: Region, index: u32) -> u64 {
        (1..RECORD_CELLS)
            .map(|i| self.cell(region, index, i).load(Ordering::Acquire) & 0xffff_ffff)
            .sum()
    }
    /// The record's flags ([`RETIRING`], [`PINNED`]).
    pub(crate) fn flags(&self, region: Region, index: u32) -> u32 {
        self.cell(region, index, 0).load(Ordering::Acquire) as u32
    }
    fn set_flag(&self, region: Region, index: u32, flag: u32) {
        self.cell(region, index, 0)
            .fetch_or(flag as u64, Ordering::AcqRel);
    }
    /// A free record of `region` (producer side).
    fn take(&self, region: Region) -> Result<u32, CudaError> {
        self.free[region as usize].lock().pop().ok_or_else(|| {
            let what = match region {
                Region::Range => "ranges",
                Region::Slab => "slabs",
            };
            CudaError(format!(
                "more than {} exported CUDA {what} are alive in this process",
                region.len()
            ))
        })
    }
    /// Resets a record and makes it free again.
    fn give(&self, region: Region, index: u32) {
        for i in 0..RECORD_CELLS {
            self.cell(region, index, i).store(0, Ordering::Release);
        }
        self.free[region as usize].lock().push(index);
    }
    pub(crate) fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    fn create() -> Result<Counters, String> {
        let mfd = memfd::MemfdOptions::default()
            .close_on_exec(true)
            .create("rdt-cuda-import-records")
            .map_err(|e| format!("memfd_create: {e}"))?;
        let file = mfd.into_file();
        file.set_len(COUNTER_FILE_BYTES as u64)
            .map_err(|e| format!("sizing the import record memfd: {e}"))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| format!("mapping import records: {e}"))?;
        let md = file.metadata().map_err(|e| e.to_string())?;
        Ok(Counters {
            id: (md.dev(), md.ino()),
            file,
            map,
            free: [Region::Range, Region::Slab]
                .map(|r| Mutex::new((0..r.len() as u32).rev().collect())),
        })
    }

    /// Opens a producer's records (consumer side).
    pub(crate) fn open(pid: u32, fd: i32, id: (u64, u64)) -> Result<Counters, String> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| {
                format!("cannot open the producer's import records at {path} ({e}): has the producer exited?")
            })?;
        let md = file.metadata().map_err(|e| e.to_string())?;
        if (md.dev(), md.ino()) != id || md.len() < COUNTER_FILE_BYTES as u64 {
            return Err(format!(
                "{path} is not the producer's import record file any more: the producer has exited"
            ));
        }
        let map = MmapRaw::map_raw(&file).map_err(|e| format!("mapping {path}: {e}"))?;
        Ok(Counters {
            id,
            file,
            map,
            free: Default::default(),
        })
    }
}

/// Is process `pid` (of this pid namespace) alive? A zombie is not: its
/// memory, CUDA mappings included, is already gone.
fn process_alive(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the command name, which ends at the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .map(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X']))
            .unwrap_or(true),
        Err(_) => false,
    }
}

/// This process's import counters.
pub(crate) fn counters() -> Result<&'static Counters, CudaError> {
    static C: OnceLock<Result<Counters, String>> = OnceLock::new();
    C.get_or_init(Counters::create)
        .as_ref()
        .map_err(|e| CudaError(e.clone()))
}

/// This process's pid, asked once: a hold and its release run per tensor,
/// and `getpid` is a system call each time. A process forked after it
/// asked would see its parent's pid, but CUDA cannot be used in such a
/// child anyway, so no holder of imports ever is one.
fn this_pid() -> u64 {
    static PID: OnceLock<u64> = OnceLock::new();
    *PID.get_or_init(|| std::process::id() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn range_records_count_tensors_per_importer() {
        let r = Region::Range;
        let c = counters().unwrap();
        let s = c.take(r).unwrap();
        assert!(!c.held(r, s));
        // A consumer (another mapping of the same file, as in another
        // process) holds two tensors, then one.
        let other = Counters::open(std::process::id(), c.fd(), c.id).unwrap();
        other.hold(r, s);
        other.hold(r, s);
        other.unhold(r, s);
        assert_eq!(c.holds(r, s), 1);
        assert!(c.held(r, s));
        other.unhold(r, s);
        assert_eq!(c.holds(r, s), 0);
        assert!(!c.held(r, s));
        // A dead importer's share is discarded.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id() as u64;
        child.wait().unwrap();
        c.cell(r, s, 2).store((dead << 32) | 5, Ordering::Release);
        other.hold(r, s);
        assert_eq!(c.holds(r, s), 6);
        assert!(c.held(r, s), "the live importer still holds one");
        assert_eq!(c.holds(r, s), 1, "the dead one's five are gone");
        other.unhold(r, s);
        assert!(!c.held(r, s));
        // Every cell taken by other (live) processes: pinned.
        for i in 1..RECORD_CELLS {
            c.cell(r, s, i).store((1u64 << 32) | 1, Ordering::Release);
        }
        other.hold(r, s);
        for i in 1..RECORD_CELLS {
            c.cell(r, s, i).store(0, Ordering::Release);
        }
        assert!(c.held(r, s), "pinned");
        c.give(r, s);
        assert!(!c.held(r, s), "a freed record is reset");
        assert!(Counters::open(std::process::id(), c.fd(), (0, 0)).is_err());
    }

    #[test]
    fn slab_records_track_live_importers() {
        let sl = Region::Slab;
        let c = counters().unwrap();
        let importer = Counters::open(std::process::id(), c.fd(), c.id).unwrap();
        let r = c.take(sl).unwrap();
        assert!(!c.held(sl, r), "a fresh record has no importer");
        // An importer (this live process) maps the slab.
        importer.hold(sl, r);
        c.set_flag(sl, r, RETIRING);
        assert_ne!(
            importer.flags(sl, r) & RETIRING,
            0,
            "importer sees the flag"
        );
        assert!(c.held(sl, r), "a live importer keeps the slab");
        importer.unhold(sl, r);
        assert!(!c.held(sl, r), "closed: the slab may be freed");

        // A dead importer (an exited child) does not keep it, and its cell
        // is cleared.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id() as u64;
        child.wait().unwrap();
        c.cell(sl, r, 3).store((dead << 32) | 1, Ordering::Release);
        assert!(!c.held(sl, r));
        assert_eq!(c.cell(sl, r, 3).load(Ordering::Acquire), 0);

        // A zombie (exited, not reaped yet) is dead too: its mappings are
        // gone. `waitid(WNOWAIT)` waits for the exit without reaping.
        let child = std::process::Command::new("true").spawn().unwrap();
        let zombie = child.id();
        // SAFETY: plain syscall with a valid out-pointer.
        let rc = unsafe {
            let mut info: libc::siginfo_t = std::mem::zeroed();
            libc::waitid(
                libc::P_PID,
                zombie,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        assert_eq!(rc, 0);
        c.cell(sl, r, 5)
            .store(((zombie as u64) << 32) | 1, Ordering::Release);
        assert!(!process_alive(zombie));
        assert!(!c.held(sl, r));
        // Reap it now.
        let mut child = child;
        child.wait().unwrap();

        // More importer processes than cells: the slab is pinned, never
        // freed.
        for i in 1..RECORD_CELLS {
            c.cell(sl, r, i).store((1u64 << 32) | 1, Ordering::Release);
        }
        importer.hold(sl, r);
        assert_ne!(importer.flags(sl, r) & PINNED, 0, "no free cell: pinned");
        for i in 1..RECORD_CELLS {
            c.cell(sl, r, i).store(0, Ordering::Release);
        }
        assert!(c.held(sl, r), "pinned");
        c.give(sl, r);
        assert_eq!(c.flags(sl, r), 0, "a freed record is reset");
    }
}
