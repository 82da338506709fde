//! Exportable device memory: slabs from `cuMemAlloc`, sub-allocated.
//!
//! Every CUDA tensor rdt makes lives in a range of a slab. Small tensors
//! share slabs of [`SLAB_BYTES`]; a tensor larger than that gets a slab of
//! its own. Because consecutive tensors land in the same few slabs, a
//! consumer of the [`ipc`](super::ipc) transport that mapped a slab once
//! reuses that mapping for every later tensor in it (gpu.md pitfall 2).
//!
//! # Lifetime (why the owner never frees memory an importer maps)
//! * Slabs are never returned to the driver while the process lives (like a
//!   caching allocator). A consumer's mapping of a slab therefore never
//!   outlives the slab: the driver releases both when the processes exit.
//! * A *range* is recycled once the producer's last tensor over it is
//!   dropped **and** no consumer holds a tensor over it. Consumers count
//!   themselves in a shared-memory counter of the range ([`Counters`]): the
//!   consumer increments it when it builds tensors over the range and
//!   decrements it when its last such tensor is dropped. A producer range
//!   whose counter is not zero when the producer drops it waits in a pending
//!   list, reclaimed on later allocations. A consumer that dies holding a
//!   range leaves it pending for the producer's lifetime (leaked, never
//!   reused: safe).

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use memmap2::MmapRaw;
use parking_lot::Mutex;

use super::{CudaError, DeviceBuffer, Gpu};

/// Size of a shared slab; larger tensors get a slab of their own.
pub const SLAB_BYTES: usize = 64 << 20;
/// Alignment of every range.
pub const ALIGN: usize = 512;
/// Large slabs are rounded up to this.
const LARGE_ROUND: usize = 2 << 20;
/// Number of import counters (live exported ranges) per process.
pub const COUNTER_SLOTS: usize = 1 << 16;

static NEXT_SLAB: AtomicU64 = AtomicU64::new(1);

/// One `cuMemAlloc` allocation.
pub(crate) struct Slab {
    pub(crate) id: u64,
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) base: u64,
    pub(crate) len: usize,
    /// IPC handle, made on first export.
    handle: OnceLock<Result<[u8; 64], CudaError>>,
    /// Free ranges: offset -> length.
    free: Mutex<BTreeMap<usize, usize>>,
}

impl Slab {
    pub(crate) fn ipc_handle(&self) -> Result<[u8; 64], CudaError> {
        self.handle
            .get_or_init(|| {
                self.gpu.bind()?;
                let mut h = std::mem::MaybeUninit::<cudarc::driver::sys::CUipcMemHandle>::uninit();
                // SAFETY: `base` is the start of a cuMemAlloc allocation.
                unsafe {
                    cudarc::driver::sys::cuIpcGetMemHandle(h.as_mut_ptr(), self.base)
                        .result()
                        .map_err(|e| CudaError::call("cuIpcGetMemHandle", e))?;
                    Ok(h.assume_init().reserved.map(|c| c as u8))
                }
            })
            .clone()
    }

    fn take(&self, len: usize) -> Option<usize> {
        let mut free = self.free.lock();
        let (&off, &flen) = free.iter().find(|(_, &l)| l >= len)?;
        free.remove(&off);
        if flen > len {
            free.insert(off + len, flen - len);
        }
        Some(off)
    }

    fn give(&self, off: usize, len: usize) {
        let mut free = self.free.lock();
        let (mut off, mut len) = (off, len);
        if let Some((&p, &pl)) = free.range(..off).next_back() {
            if p + pl == off {
                free.remove(&p);
                off = p;
                len += pl;
            }
        }
        if let Some(&nl) = free.get(&(off + len)) {
            free.remove(&(off + len));
            len += nl;
        }
        free.insert(off, len);
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
    slabs: HashMap<usize, Vec<Arc<Slab>>>,
    pending: Vec<Pending>,
}

fn allocator() -> &'static Mutex<Allocator> {
    static A: OnceLock<Mutex<Allocator>> = OnceLock::new();
    A.get_or_init(Default::default)
}

fn round(len: usize, to: usize) -> usize {
    len.div_ceil(to).max(1) * to
}

/// Recycles pending ranges no consumer holds any more.
pub(crate) fn reclaim() {
    let mut a = allocator().lock();
    reclaim_locked(&mut a);
}

fn reclaim_locked(a: &mut Allocator) {
    let Ok(c) = counters() else { return };
    a.pending.retain(|p| {
        if c.get(p.slot) == 0 {
            p.slab.give(p.offset, p.len);
            c.free_slot(p.slot);
            false
        } else {
            true
        }
    });
}

/// A fresh range of `len` bytes on `gpu` (contents undefined).
pub(crate) fn alloc(gpu: &Arc<Gpu>, len: usize) -> Result<SlabRange, CudaError> {
    let want = round(len, ALIGN);
    let mut a = allocator().lock();
    reclaim_locked(&mut a);
    let slabs = a.slabs.entry(gpu.ordinal()).or_default();
    for s in slabs.iter() {
        if let Some(off) = s.take(want) {
            return Ok(SlabRange::new(s.clone(), off, len, want));
        }
    }
    let slab_len = if want > SLAB_BYTES {
        round(want, LARGE_ROUND)
    } else {
        SLAB_BYTES
    };
    let base = gpu.malloc(slab_len)?;
    let slab = Arc::new(Slab {
        id: NEXT_SLAB.fetch_add(1, Ordering::Relaxed),
        gpu: gpu.clone(),
        base,
        len: slab_len,
        handle: OnceLock::new(),
        free: Mutex::new(BTreeMap::from([(0, slab_len)])),
    });
    let off = slab.take(want).expect("a fresh slab fits");
    slabs.push(slab.clone());
    Ok(SlabRange::new(slab, off, len, want))
}

/// Bytes held in slabs on each local ordinal (for diagnostics).
pub fn slab_bytes() -> HashMap<usize, usize> {
    allocator()
        .lock()
        .slabs
        .iter()
        .map(|(k, v)| (*k, v.iter().map(|s| s.len).sum()))
        .collect()
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
        let v = counters()?.take_slot()?;
        *s = Some(v);
        Ok(v)
    }
}

impl Drop for SlabRange {
    fn drop(&mut self) {
        let slot = *self.slot.get_mut();
        let mut a = allocator().lock();
        match (slot, counters()) {
            (Some(slot), Ok(c)) if c.get(slot) != 0 => a.pending.push(Pending {
                slab: self.slab.clone(),
                offset: self.offset,
                len: self.reserved,
                slot,
            }),
            (slot, c) => {
                self.slab.give(self.offset, self.reserved);
                if let (Some(slot), Ok(c)) = (slot, c) {
                    c.free_slot(slot);
                }
            }
        }
    }
}

impl DeviceBuffer for SlabRange {
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

/// Import counters shared with consumers: a memfd of `u32`s that consumers
/// map through `/proc/<pid>/fd/<fd>` (as the `shm` transport does).
pub(crate) struct Counters {
    file: File,
    map: MmapRaw,
    free: Mutex<Vec<u32>>,
    /// (device, inode) of the memfd, so that a consumer can tell it apart
    /// from a reused descriptor.
    pub(crate) id: (u64, u64),
}

impl Counters {
    fn cell(&self, slot: u32) -> &AtomicU32 {
        assert!(
            (slot as usize) < self.map.len() / 4,
            "counter slot in range"
        );
        // SAFETY: the mapping lives as long as `self`, is 4-aligned (page)
        // and the slot is in range; the memory is shared, so only atomics
        // touch it.
        unsafe { &*(self.map.as_mut_ptr().add(slot as usize * 4) as *const AtomicU32) }
    }
    pub(crate) fn get(&self, slot: u32) -> u32 {
        self.cell(slot).load(Ordering::Acquire)
    }
    pub(crate) fn add(&self, slot: u32, d: i32) {
        if d > 0 {
            self.cell(slot).fetch_add(d as u32, Ordering::AcqRel);
        } else {
            self.cell(slot).fetch_sub((-d) as u32, Ordering::AcqRel);
        }
    }
    fn take_slot(&self) -> Result<u32, CudaError> {
        self.free.lock().pop().ok_or_else(|| {
            CudaError(format!(
                "more than {COUNTER_SLOTS} exported CUDA ranges are alive in this process"
            ))
        })
    }
    fn free_slot(&self, slot: u32) {
        self.cell(slot).store(0, Ordering::Release);
        self.free.lock().push(slot);
    }
    pub(crate) fn fd(&self) -> i32 {
        self.file.as_raw_fd()
    }

    fn create() -> Result<Counters, String> {
        let mfd = memfd::MemfdOptions::default()
            .close_on_exec(true)
            .create("rdt-cuda-import-counters")
            .map_err(|e| format!("memfd_create: {e}"))?;
        let file = mfd.into_file();
        file.set_len((COUNTER_SLOTS * 4) as u64)
            .map_err(|e| format!("sizing the counter memfd: {e}"))?;
        let map = MmapRaw::map_raw(&file).map_err(|e| format!("mapping counters: {e}"))?;
        let md = file.metadata().map_err(|e| e.to_string())?;
        Ok(Counters {
            id: (md.dev(), md.ino()),
            file,
            map,
            free: Mutex::new((0..COUNTER_SLOTS as u32).rev().collect()),
        })
    }

    /// Opens a producer's counters (consumer side).
    pub(crate) fn open(pid: u32, fd: i32, id: (u64, u64)) -> Result<Counters, String> {
        let path = format!("/proc/{pid}/fd/{fd}");
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| {
                format!("cannot open the producer's import counters at {path} ({e}): has the producer exited?")
            })?;
        let md = file.metadata().map_err(|e| e.to_string())?;
        if (md.dev(), md.ino()) != id || md.len() < (COUNTER_SLOTS * 4) as u64 {
            return Err(format!(
                "{path} is not the producer's counter file any more: the producer has exited"
            ));
        }
        let map = MmapRaw::map_raw(&file).map_err(|e| format!("mapping {path}: {e}"))?;
        Ok(Counters {
            id,
            file,
            map,
            free: Mutex::new(Vec::new()),
        })
    }
}

/// This process's import counters.
pub(crate) fn counters() -> Result<&'static Counters, CudaError> {
    static C: OnceLock<Result<Counters, String>> = OnceLock::new();
    C.get_or_init(Counters::create)
        .as_ref()
        .map_err(|e| CudaError(e.clone()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_count() {
        let c = counters().unwrap();
        let s = c.take_slot().unwrap();
        c.add(s, 1);
        c.add(s, 1);
        c.add(s, -1);
        assert_eq!(c.get(s), 1);
        c.free_slot(s);
        assert_eq!(c.get(s), 0);
        let other = Counters::open(std::process::id(), c.fd(), c.id).unwrap();
        let s = c.take_slot().unwrap();
        other.add(s, 3);
        assert_eq!(c.get(s), 3);
        c.free_slot(s);
        assert!(Counters::open(std::process::id(), c.fd(), (0, 0)).is_err());
    }
}
