//! Registered memory of this process: registrations, host slabs and regions,
//! and what an export or a read keeps alive.

use super::*;

/// Alignment of tensors in a host region: a cache line.
pub(super) const ALIGN: usize = 64;
pub(super) static NEXT_GENERATION: AtomicU64 = AtomicU64::new(1);

/// A registration with this process's agent, undone on drop (NX-2).
pub(super) struct Registered {
    pub(super) agent: Arc<Agent>,
    pub(super) generation: u64,
    pub(super) desc: Desc,
    /// What a peer loads to read it.
    pub(super) md: Vec<u8>,
    pub(super) done: std::sync::atomic::AtomicBool,
}

impl Registered {
    pub(super) fn new(agent: &Arc<Agent>, desc: Desc) -> Result<Registered, NixlError> {
        let md = agent.register(desc)?;
        bump(&COUNTERS.registrations, 1);
        Ok(Registered {
            agent: agent.clone(),
            generation: NEXT_GENERATION.fetch_add(1, Ordering::Relaxed),
            desc,
            md,
            done: Default::default(),
        })
    }

    pub(super) fn deregister(&self) {
        if !self.done.swap(true, Ordering::AcqRel) {
            if let Err(e) = self.agent.deregister(self.desc) {
                tracing::warn!("deregistering {:?}: {e}", self.desc);
            }
            bump(&COUNTERS.deregistrations, 1);
        }
    }

    pub(super) fn handle(&self) -> RegionHandle {
        RegionHandle {
            generation: self.generation,
            mem: self.desc.mem,
            base: self.desc.addr as u64,
            len: self.desc.len as u64,
            dev: self.desc.dev,
            md: self.md.clone(),
        }
    }
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.deregister();
    }
}

/// A slab of anonymous host memory, registered once with an agent (NX-3),
/// and page-locked where CUDA is present (so device copies to and from it
/// run at copy-engine speed).
pub(super) struct HostSlab {
    /// Shared with the exports that name it; deregistered when the slab is
    /// dropped, before the mapping goes (NX-2).
    pub(super) reg: Arc<Registered>,
    pub(super) ptr: *mut u8,
    pub(super) len: usize,
    /// Freed when its one range is given back (large requests), instead of
    /// staying in the pool.
    pub(super) dedicated: bool,
    pub(super) free: FreeList,
    pub(super) pinned: bool,
    pub(super) _map: MmapMut,
}

// SAFETY: the pointer is into `_map`, which the slab owns; its bytes are
// handed out as disjoint ranges, accessed through tensor storages.
unsafe impl Send for HostSlab {}
// SAFETY: as above.
unsafe impl Sync for HostSlab {}

/// Size of a pooled host slab.
pub(super) const HOST_SLAB_BYTES: usize = 64 << 20;
/// Requests above this get a slab of their own (kept for a later request
/// of about the same size, see [`LARGE_IDLE_CAP`]).
pub(super) const DEDICATED_ABOVE: usize = HOST_SLAB_BYTES / 4;
/// Dedicated slabs are rounded up to this.
pub(super) const DEDICATED_ROUND: usize = 2 << 20;
/// Idle dedicated slabs kept per agent, in bytes: making a large slab
/// costs far more than its transfer (mapping, page-locking and
/// registering 1 GiB takes hundreds of milliseconds), and repeated large
/// receives of one size are the common case (weight sync). Beyond this,
/// idle ones are freed when a new one is made; [`trim`] frees them all.
pub(super) const LARGE_IDLE_CAP: usize = 2 << 30;

pub(super) type Pools = std::sync::LazyLock<Mutex<HashMap<String, Vec<Arc<HostSlab>>>>>;
/// Pooled host slabs, per agent (one agent per process, but unit tests
/// make two).
pub(super) static HOST_POOLS: Pools = std::sync::LazyLock::new(Default::default);
/// Dedicated (large) host slabs, per agent, in use or idle.
pub(super) static LARGE_POOLS: Pools = std::sync::LazyLock::new(Default::default);

/// A slab in a pool that nothing uses.
pub(super) fn idle(s: &Arc<HostSlab>) -> bool {
    s.free.all_free() && Arc::strong_count(s) == 1
}

impl HostSlab {
    pub(super) fn new(
        agent: &Arc<Agent>,
        len: usize,
        dedicated: bool,
    ) -> Result<HostSlab, NixlError> {
        let mut map = MmapMut::map_anon(len)
            .map_err(|e| NixlError(format!("mapping {len} B of host memory: {e}")))?;
        let ptr = map.as_mut_ptr();
        // SAFETY: the mapping lives in the slab, which unpins before it
        // drops the mapping.
        let pinned = crate::cuda::available().is_ok()
            && unsafe { crate::cuda::pin_host(ptr, len) }
                .map_err(|e| tracing::warn!("nixl host slab left pageable: {e}"))
                .unwrap_or(false);
        let reg = Registered::new(
            agent,
            Desc {
                mem: Mem::Dram,
                addr: ptr as usize,
                len,
                dev: 0,
            },
        );
        let reg = match reg {
            Ok(r) => r,
            Err(e) => {
                if pinned {
                    // SAFETY: pinned above, still mapped.
                    unsafe { crate::cuda::unpin_host(ptr) };
                }
                return Err(e);
            }
        };
        bump(&COUNTERS.host_slabs, 1);
        Ok(HostSlab {
            reg: Arc::new(reg),
            ptr,
            len,
            dedicated,
            free: FreeList::new(len),
            pinned,
            _map: map,
        })
    }
}

impl Drop for HostSlab {
    fn drop(&mut self) {
        // NX-2: while the mapping (dropped after this body) still exists.
        self.reg.deregister();
        if self.pinned {
            // SAFETY: pinned when made; the mapping goes after this body.
            unsafe { crate::cuda::unpin_host(self.ptr) };
        }
        COUNTERS.host_slabs.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A range of a host slab: the memory of one export's or one receive's
/// host tensors. Given back to its slab on drop.
pub(super) struct HostRegion {
    pub(super) slab: Arc<HostSlab>,
    /// Offset in the slab.
    pub(super) offset: usize,
    /// Bytes reserved.
    pub(super) len: usize,
}

impl HostRegion {
    /// `len` bytes from this agent's pool (or a slab of their own).
    pub(super) fn new(agent: &Arc<Agent>, len: usize) -> Result<Arc<HostRegion>, NixlError> {
        let want = len.max(1).next_multiple_of(ALIGN);
        let (slab, offset) = if want > DEDICATED_ABOVE {
            let mut pools = LARGE_POOLS.lock();
            let pool = pools.entry(agent.name().to_string()).or_default();
            // An idle one of about this size (at most twice as large).
            let found = pool
                .iter()
                .filter(|s| idle(s) && s.len >= want && s.len / 2 <= want)
                .find_map(|s| s.free.take(want).map(|o| (s.clone(), o)));
            match found {
                Some(found) => found,
                None => {
                    let mut idle_bytes: usize =
                        pool.iter().filter(|s| idle(s)).map(|s| s.len).sum();
                    pool.retain(|s| {
                        if idle_bytes > LARGE_IDLE_CAP && idle(s) {
                            idle_bytes -= s.len;
                            false
                        } else {
                            true
                        }
                    });
                    let len = want.next_multiple_of(DEDICATED_ROUND);
                    let slab = Arc::new(HostSlab::new(agent, len, true)?);
                    pool.push(slab.clone());
                    let off = slab.free.take(want).expect("a fresh slab fits");
                    (slab, off)
                }
            }
        } else {
            let mut pools = HOST_POOLS.lock();
            let pool = pools.entry(agent.name().to_string()).or_default();
            match pool
                .iter()
                .find_map(|s| s.free.take(want).map(|o| (s.clone(), o)))
            {
                Some(found) => found,
                None => {
                    let slab = Arc::new(HostSlab::new(agent, HOST_SLAB_BYTES, false)?);
                    pool.push(slab.clone());
                    let off = slab.free.take(want).expect("a fresh slab fits");
                    (slab, off)
                }
            }
        };
        COUNTERS
            .host_bytes_in_use
            .fetch_add(want as u64, Ordering::Relaxed);
        Ok(Arc::new(HostRegion {
            slab,
            offset,
            len: want,
        }))
    }

    pub(super) fn ptr(&self) -> *mut u8 {
        // SAFETY: offset lies within the slab.
        unsafe { self.slab.ptr.add(self.offset) }
    }
}

impl Drop for HostRegion {
    fn drop(&mut self) {
        self.slab.free.give(self.offset, self.len);
        COUNTERS
            .host_bytes_in_use
            .fetch_sub(self.len as u64, Ordering::Relaxed);
        // A dedicated slab stays in its pool, idle, for a later request of
        // about its size (LARGE_IDLE_CAP).
        debug_assert!(!self.slab.dedicated || self.slab.len >= self.len);
    }
}

/// Gives every pooled host slab with no range in use back to the system
/// (deregistered, then unmapped). Consumers that read from them before
/// notice the new generation of whatever is mapped there later (NX-1).
pub fn trim() -> usize {
    let mut freed = 0;
    for pools in [&HOST_POOLS, &LARGE_POOLS] {
        for pool in pools.lock().values_mut() {
            pool.retain(|s| {
                if idle(s) {
                    freed += s.len;
                    false
                } else {
                    true
                }
            });
        }
    }
    freed
}

/// A tensor's bytes in a [`HostRegion`].
pub(super) struct NixlHostMem {
    pub(super) region: Arc<HostRegion>,
    pub(super) offset: usize,
    pub(super) len: usize,
}

// SAFETY: a range of a registered host region the value keeps alive;
// written by READs outside the storage lock, so it says it is shared
// (NX-13).
unsafe impl ExternalMemory for NixlHostMem {
    fn as_ptr(&self) -> *mut u8 {
        // SAFETY: offset + len lies within the region (made so).
        unsafe { self.region.ptr().add(self.offset) }
    }
    fn len(&self) -> usize {
        self.len
    }
    fn describe(&self) -> String {
        format!(
            "nixl host slab {} +{} ({} B)",
            self.region.slab.reg.generation,
            self.region.offset + self.offset,
            self.len
        )
    }
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
    /// NX-13: a READ of this process writes into it outside the storage's
    /// lock (a receive into a tensor that lives here: a weight update
    /// into its targets, while a clone of them may be read), and UCX or a
    /// NIC reads it for peers: never behind a Rust reference.
    fn shared_with_other_processes(&self) -> bool {
        true
    }
}

/// One registration in the handles.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub(super) struct RegionHandle {
    pub(super) generation: u64,
    pub(super) mem: Mem,
    pub(super) base: u64,
    pub(super) len: u64,
    pub(super) dev: u64,
    #[serde(with = "serde_bytes")]
    pub(super) md: Vec<u8>,
}

/// What an export keeps alive.
pub(super) enum Kept {
    Host(Arc<HostRegion>),
    Tensor(#[allow(dead_code)] Tensor),
    /// Target tensors of a receive, one per storage.
    Tensors(#[allow(dead_code)] Vec<Tensor>),
    /// The device range a receive's new tensors are slices of.
    Range(#[allow(dead_code)] Arc<crate::cuda::alloc::SlabRange>),
    Slab(#[allow(dead_code)] Arc<Registered>),
    /// The receive as a writer of its targets (TG-4).
    Writing(#[allow(dead_code)] crate::transport::Writing),
}

/// The rdt slab a tensor's device bytes lie in, and their offset there (a
/// range made by rdt's allocator, or a slice of one; a view adds its own
/// offset).
pub(super) fn slab_of(d: &crate::tensor::DeviceBytes<'_>) -> Option<(Arc<Slab>, usize)> {
    let any = d.buffer().as_any();
    if let Some(r) = any.downcast_ref::<SlabRange>() {
        return Some((r.slab.clone(), r.offset + d.offset()));
    }
    any.downcast_ref::<crate::cuda::alloc::SlabSlice>()
        .map(|s| {
            (
                s.range().slab.clone(),
                s.range().offset + s.offset() + d.offset(),
            )
        })
}
