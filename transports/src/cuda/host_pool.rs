//! Reused host buffers for large bytes that cross a socket or the PCIe bus.
//!
//! Why: a fresh anonymous mapping costs a page fault and a page clear per
//! 4 KiB on first touch. Receiving 256 MiB into fresh memory on the dev VM
//! runs at 0.3–1 GB/s, into memory touched before at 4–6 GB/s (same socket,
//! same copy): on the object-store path the faults, not the copies, set the
//! speed. Ray's plasma store and PyTorch's caching host allocator keep
//! memory for the same reason. A [`HostBuf`] comes from this pool and goes
//! back to it when its last user drops it; the pool keeps at most
//! [`limit`] bytes of idle buffers (oldest dropped first).
//!
//! Buffers are page-aligned mappings (any dtype's alignment), and pinned
//! (`cuMemHostRegister`) when the process has a CUDA context: a copy
//! between a pinned buffer and a GPU runs at copy-engine speed, a pageable
//! one through the driver's own staging. A buffer made before the process
//! had a context is pinned when it is next taken from the pool.
//!
//! # Invariants
//! - HP-1. A buffer is in the pool or in exactly one [`HostBuf`], never
//!   both: [`HostBuf`] returns it in `Drop`, after every `Bytes` over it
//!   is gone ([`HostBuf::freeze`] hands ownership to the `Bytes`).
//! - HP-2. A pinned buffer is unpinned before its mapping is unmapped.
//! - HP-3. Contents of a buffer taken from the pool are whatever its last
//!   user left: callers overwrite every byte they expose (the socket
//!   reader reads exactly the blob's length, a device-to-host copy writes
//!   all of it).
//! - HP-4. A copy from a pinned buffer to a GPU may still be reading it
//!   after the call that enqueued it returns; whoever enqueues one holds
//!   the buffer until the copy is done ([`is_pinned`] lets
//!   [`crate::cuda`] tell).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use bytes::Bytes;
use memmap2::MmapMut;
use parking_lot::Mutex;

/// Below this size a blob is an ordinary heap allocation: small buffers
/// are cheap to fault in, and the pool is for the large ones.
pub const MIN_POOLED: usize = 256 << 10;

/// Idle bytes the pool keeps by default: 4 GiB or an eighth of the
/// machine's memory, whichever is smaller.
fn default_limit() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let total = (pages.max(0) as usize).saturating_mul(page.max(0) as usize);
    (total / 8).clamp(64 << 20, 4 << 30)
}

static LIMIT: AtomicUsize = AtomicUsize::new(usize::MAX);
static HITS: AtomicU64 = AtomicU64::new(0);
static MISSES: AtomicU64 = AtomicU64::new(0);

struct Mapping {
    map: MmapMut,
    pinned: bool,
}

impl Mapping {
    fn capacity(&self) -> usize {
        self.map.len()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        if self.pinned {
            // SAFETY: pinned by `pin` and still mapped (HP-2: the mapping
            // field drops after this body).
            unsafe { crate::cuda::unpin_host(self.map.as_mut_ptr()) };
        }
    }
}

#[derive(Default)]
struct Pool {
    /// Idle buffers, oldest first.
    idle: VecDeque<Mapping>,
    idle_bytes: usize,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

fn with_pool<R>(f: impl FnOnce(&mut Pool) -> R) -> R {
    f(POOL.lock().get_or_insert_with(Pool::default))
}

/// The most idle bytes the pool keeps.
pub fn limit() -> usize {
    match LIMIT.load(Ordering::Relaxed) {
        usize::MAX => default_limit(),
        n => n,
    }
}

/// Sets the most idle bytes the pool keeps (0: keep none, every buffer is
/// unmapped when dropped); trims at once.
pub fn set_limit(bytes: usize) {
    LIMIT.store(bytes, Ordering::Relaxed);
    let dropped = with_pool(|p| p.trim(bytes));
    drop(dropped);
}

/// What the pool did so far in this process.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers served from the pool.
    pub hits: u64,
    /// Buffers that needed a fresh mapping.
    pub misses: u64,
    /// Bytes held idle now.
    pub idle_bytes: usize,
    /// Bytes of buffers pinned for CUDA now, idle or in use.
    pub pinned_bytes: usize,
}

/// Counters of this process's pool.
pub fn stats() -> PoolStats {
    PoolStats {
        hits: HITS.load(Ordering::Relaxed),
        misses: MISSES.load(Ordering::Relaxed),
        idle_bytes: with_pool(|p| p.idle_bytes),
        pinned_bytes: super::memory::pinned_bytes(),
    }
}

// The pinned buffers' address ranges live with the CUDA memory code, which
// asks them on every host-to-device copy (HP-4).
pub use super::memory::is_pinned;

impl Pool {
    /// Drops the oldest idle buffers until at most `keep` bytes stay; the
    /// caller drops what comes back outside the lock (unpinning may wait).
    fn trim(&mut self, keep: usize) -> Vec<Mapping> {
        let mut out = Vec::new();
        while self.idle_bytes > keep {
            let Some(m) = self.idle.pop_front() else {
                break;
            };
            self.idle_bytes -= m.capacity();
            self.forget_pinned(&m);
            out.push(m);
        }
        out
    }

    fn forget_pinned(&mut self, m: &Mapping) {
        if m.pinned {
            super::memory::forget_pinned(m.map.as_ptr() as usize);
        }
    }

    /// The smallest idle buffer of at least `len` bytes that wastes at
    /// most a quarter of itself.
    fn take(&mut self, len: usize) -> Option<Mapping> {
        let best = self
            .idle
            .iter()
            .enumerate()
            .filter(|(_, m)| m.capacity() >= len && m.capacity() - len <= m.capacity() / 4)
            .min_by_key(|(_, m)| m.capacity())
            .map(|(i, _)| i)?;
        let m = self.idle.remove(best)?;
        self.idle_bytes -= m.capacity();
        Some(m)
    }
}

/// A page-aligned host buffer of `len` bytes from the pool (see the module
/// docs). Its bytes are unspecified until written (HP-3).
pub struct HostBuf {
    mapping: Option<Mapping>,
    len: usize,
}

impl std::fmt::Debug for HostBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostBuf({} B, pinned: {})", self.len, self.is_pinned())
    }
}

/// Rounds up to whole 2 MiB (what a huge page would be) for large
/// buffers, to 64 KiB below 8 MiB, so buffers of nearly the same size
/// share one class and a reused buffer wastes little.
fn round_capacity(len: usize) -> usize {
    let step: usize = if len < 8 << 20 { 64 << 10 } else { 2 << 20 };
    len.div_ceil(step).max(1) * step
}

impl HostBuf {
    /// A buffer of `len` bytes: an idle one from the pool, or a fresh
    /// mapping. Pinned when the process has a CUDA context (see the
    /// module docs).
    pub fn new(len: usize) -> std::io::Result<HostBuf> {
        let reused = with_pool(|p| p.take(len));
        let mut mapping = match reused {
            Some(m) => {
                HITS.fetch_add(1, Ordering::Relaxed);
                m
            }
            None => {
                MISSES.fetch_add(1, Ordering::Relaxed);
                Mapping {
                    map: MmapMut::map_anon(round_capacity(len))?,
                    pinned: false,
                }
            }
        };
        if !mapping.pinned && crate::cuda::has_context() {
            let (ptr, cap) = (mapping.map.as_mut_ptr(), mapping.capacity());
            // SAFETY: the mapping stays mapped until `Mapping::drop`
            // unpins it first (HP-2).
            match unsafe { crate::cuda::pin_host(ptr, cap) } {
                Ok(true) => {
                    mapping.pinned = true;
                    super::memory::add_pinned(ptr as usize, cap);
                }
                Ok(false) => {}
                Err(e) => tracing::debug!("host buffer left pageable: {e}"),
            }
        }
        Ok(HostBuf {
            mapping: Some(mapping),
            len,
        })
    }

    /// The buffer's bytes, to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.mapping.as_mut().expect("present until drop").map[..len]
    }

    /// Is the buffer pinned for CUDA copies?
    pub fn is_pinned(&self) -> bool {
        self.mapping.as_ref().is_some_and(|m| m.pinned)
    }

    /// Immutable bytes over the buffer, with no copy; the buffer goes back
    /// to the pool when the last clone of them drops (HP-1).
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for HostBuf {
    fn as_ref(&self) -> &[u8] {
        &self.mapping.as_ref().expect("present until drop").map[..self.len]
    }
}

impl Drop for HostBuf {
    fn drop(&mut self) {
        let Some(m) = self.mapping.take() else {
            return;
        };
        let keep = limit();
        let dropped = with_pool(|p| {
            if m.capacity() > keep {
                p.forget_pinned(&m);
                return vec![m];
            }
            p.idle_bytes += m.capacity();
            p.idle.push_back(m);
            p.trim(keep)
        });
        // Unmapped (and unpinned) outside the pool's lock.
        drop(dropped);
    }
}

// Its test is `tests/host_pool.rs`: the pool and its limit are
// process-wide, so it runs in a process of its own (beside the unit tests,
// which take and give back pooled buffers, it failed at random).
