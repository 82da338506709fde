//! The `shm` transport: zero-copy hand-over of CPU tensors between actors
//! on one host, through shared memory.
//!
//! A producer's tensors are put into a `memfd` (an anonymous shared-memory
//! file) and stay there; a consumer maps the same file and builds its
//! tensors over that mapping. No byte is copied on the way, and afterwards
//! producer and consumer tensors *are* the same memory: a write on either
//! side is seen by the other, as with CUDA IPC (and as tensors are mutable
//! and shared in Ray Direct Transport). Ordering those writes between
//! processes is the user's business, as it is in RDT.
//!
//! # Protocol
//!
//! 1. **Export (producer).** The tensors of one object that are not in
//!    shared memory yet are laid out in one fresh memfd, each at a 64-byte
//!    aligned offset. The memfd is sized, sealed (see invariant 4) and
//!    mapped, and each tensor's storage is moved into its slot with
//!    [`Tensor::migrate_storage`]: its bytes are copied once, and from then
//!    on the tensor and all its clones live in the shared memory. A tensor
//!    already in memory of this transport (made by [`ShmTransport::alloc`],
//!    exported before, or received over `shm`) is published where it is,
//!    with no copy at all. The transport keeps every memfd the object uses
//!    (descriptor and mapping) under the object's key. The handles
//!    ([`Exported::handles`], postcard) carry the producer's boot id, pid
//!    namespace and pid, a table of the object's memfds (descriptor number,
//!    device and inode), and per tensor its memfd, offset and length.
//! 2. **Receive (consumer).** The consumer checks that it runs on the same
//!    kernel (boot id) and in the same pid namespace, opens
//!    `/proc/<pid>/fd/<fd>` read-write, checks that this still is the memfd
//!    that was published, and maps it `MAP_SHARED`, once per memfd (a
//!    memfd it mapped before is looked at, not mapped again: invariant 7).
//!    Each tensor is a [`Tensor::from_external`] over its range of
//!    that mapping; the tensors of one memfd share the mapping through an
//!    [`Arc`].
//! 3. **Release (producer).** The transport drops what it kept for the
//!    object: its references to the object's memfds.
//!
//! # Invariants
//!
//! 1. **One host, one pid namespace.** Handles carry the boot id
//!    (`/proc/sys/kernel/random/boot_id`) and the pid namespace; a consumer
//!    elsewhere fails with an error that names the transports that work
//!    across hosts, before it touches `/proc`.
//! 2. **Published memfds stay open until release.** The producer holds each
//!    published memfd's descriptor from export until [`release`], whether or
//!    not it still holds the tensors, so `/proc/<pid>/fd/<fd>` names the
//!    memfd for as long as the object exists.
//! 3. **A handle names a file, not just a number.** Descriptor numbers are
//!    reused after a close and pids after an exit, so a handle also carries
//!    the memfd's device and inode; a consumer that opens a stale handle
//!    sees another file there and fails instead of mapping it.
//! 4. **No mapping reaches past its file.** Every memfd is sealed against
//!    shrinking and growing before it is published (and against further
//!    seals, so no one can add a write seal that would make writable
//!    mappings fail), and a consumer checks the seal and every range against
//!    the file's size before it builds a tensor. So no access to a mapping
//!    raises `SIGBUS`, and a malformed handle is an error, never a panic or
//!    an out-of-bounds pointer.
//! 5. **The kernel owns the lifetime.** A memfd's pages live while any
//!    descriptor or mapping of it exists, in any process. [`release`] drops
//!    only the producer's references; a consumer's mapping keeps the pages
//!    until its last tensor over them is dropped, and the producer's own
//!    tensors keep theirs. That is why the owner's free never pulls memory
//!    from under a consumer, and why a consumer needs no message to the
//!    producer to keep it (nor to give it back).
//! 6. **A storage moves at most once, and only from plain host memory.**
//!    [`Tensor::migrate_storage`] swaps memory under the storage's write
//!    lock and never replaces external memory (another transport may have
//!    published it). A tensor in such foreign memory is copied into the
//!    memfd instead; its consumers then share memory with one another but
//!    not with the producer's tensor.
//! 7. **A consumer keeps its mappings while the producer publishes.** A
//!    weights sync passes the same kept tensors every step; mapping their
//!    memfd afresh each time cost a `mmap`, a page fault per 4 KiB on the
//!    first read and a `munmap` after: 4.5 ms of 6.5 for a 40 MB tensor.
//!    So a consumer keeps each memfd it mapped, by (device, inode), and a
//!    later receive of it reuses the mapping and its page tables; it still
//!    checks that `/proc/<pid>/fd/<fd>` names that memfd now (invariant 3:
//!    a stale handle fails as before). A kept mapping that no tensor here
//!    uses is dropped once its producer no longer publishes the memfd (it
//!    freed the object and its tensors), looked at every 200 ms (at a
//!    receive or release, and at the worker's housekeeping tick), and at
//!    every receive while more than 64 memfds are kept (a producer of
//!    fresh tensors publishes a new memfd every pass),
//!    and at once when the producer's actor is gone ([`peer_gone`]). So
//!    memory freed by its producer is let go by consumers within about
//!    200 ms; [`ShmTransport::mapping_stats`] counts mappings made and
//!    reused.
//!
//! # Why memfd and `/proc/<pid>/fd`
//!
//! A memfd has no name in `/dev/shm`: nothing to collide with and nothing
//! to leak when a process crashes, since the memory goes with its last
//! descriptor or mapping. A consumer reaches it with a plain `open` of the
//! producer's `/proc/<pid>/fd/<fd>`, so there is no descriptor passing over
//! a Unix socket (`SCM_RIGHTS`) and no extra connection: the handles ride
//! through the driver like those of any one-sided transport, and the
//! producer takes no part in the move. `pidfd_getfd` would also work, but it
//! needs ptrace *attach* permission, which Yama's default
//! (`ptrace_scope = 1`) refuses between sibling processes; opening
//! `/proc/<pid>/fd` needs only ptrace *read* access.
//!
//! What that needs: both actors on one host (one kernel) and in one pid
//! namespace, running as the same user, with the producer dumpable (not
//! setuid, no `PR_SET_DUMPABLE` 0). Each live memfd costs one descriptor in
//! every process that holds it (producer and consumers), which counts
//! against `RLIMIT_NOFILE`: a process that holds thousands of live objects
//! needs a higher limit.
//!
//! [`release`]: TensorTransport::release
//! [`peer_gone`]: TensorTransport::peer_gone

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::MetadataExt;
use std::os::unix::io::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use memfd::{FileSeal, Memfd, MemfdOptions};
use memmap2::MmapRaw;
use parking_lot::Mutex;
use rustc_hash::FxHashMap;
use serde::{Deserialize, Serialize};

use crate::transport::{
    check_received, ObjectKey, Peer, Sidedness, TensorTransport, TransferCtx, TransportError,
};
use crate::{DType, Device, Exported, ExternalMemory, Tensor, TensorMeta};

/// Name of this transport in attributes and errors.
pub const NAME: &str = "shm";

crate::register_transport!(crate::registry::Registration {
    name: NAME,
    sidedness: Sidedness::OneSided,
    collective: false,
    devices: "CPU",
    same_host_only: true,
    start: |_| Ok(Arc::new(ShmTransport::new())),
});

/// Alignment of every tensor in a memfd: a cache line, and enough for any
/// element type and for SIMD loads.
const ALIGN: usize = 64;

const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// Moves CPU tensors between actors on one host through shared memory,
/// with no copy (see the module docs for the protocol).
#[derive(Default)]
pub struct ShmTransport {
    /// The memfds each exported object uses, kept open until release
    /// (invariant 2).
    exports: Mutex<HashMap<ObjectKey, Vec<Arc<Region>>>>,
    /// Memfds of other objects' producers mapped here, by (device, inode),
    /// kept while their producer still publishes them (invariant 7).
    mapped: Mutex<FxHashMap<(u64, u64), Mapped>>,
    /// When `mapped` was last swept of memfds nobody publishes any more.
    last_sweep: Mutex<Option<Instant>>,
    /// Producer memfds mapped, and mappings reused ([`Self::mapping_stats`]).
    mappings_made: AtomicU64,
    mappings_reused: AtomicU64,
}

/// A producer's memfd, mapped in this process and kept for the next
/// receive of it (invariant 7).
struct Mapped {
    region: Arc<Region>,
    /// Who published it last: the sweep looks there whether it still does.
    pid: u32,
    fd: RawFd,
    actor: u64,
}

/// How often a receive sweeps the mapping cache: as often as the rdt
/// worker's housekeeping tick, which sweeps it too.
const SWEEP_PERIOD: Duration = crate::transport::HOUSEKEEPING_PERIOD;
/// A receive sweeps the mapping cache at once when it holds more memfds.
const SWEEP_ABOVE: usize = 64;

impl std::fmt::Debug for ShmTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmTransport")
            .field("exported_objects", &self.exports.lock().len())
            .finish()
    }
}

impl ShmTransport {
    /// A transport with nothing exported.
    pub fn new() -> Self {
        Self::default()
    }

    /// A zero-filled CPU tensor that lives in shared memory from the start,
    /// so exporting it over `shm` copies nothing.
    pub fn alloc(dtype: DType, shape: &[usize]) -> Result<Tensor, TransportError> {
        let len = nbytes(dtype, shape).ok_or_else(|| {
            TransportError::new(
                NAME,
                format!("a {dtype} tensor of shape {shape:?} has more bytes than fit in memory"),
            )
        })?;
        // A fresh memfd reads as zeros, which is what makes this "zeros".
        let region = Region::create("rdt-shm-alloc", len)?;
        let mem = region
            .slice(0, len)
            .map_err(|e| TransportError::new(NAME, e))?;
        Tensor::from_external(dtype, shape, Device::Cpu, Box::new(mem))
            .map_err(|e| TransportError::new(NAME, e.to_string()))
    }

    /// Does `tensor` live in shared memory of this transport (so that an
    /// export publishes it without a copy)?
    pub fn is_shm(tensor: &Tensor) -> bool {
        shm_place(tensor).is_some()
    }

    fn export_now(&self, key: ObjectKey, tensors: &[Tensor]) -> Result<Exported, TransportError> {
        let host = host_id()?;
        for t in tensors {
            self.check_device(t.device())?;
        }

        // Lay out every tensor that is not in shared memory yet in one
        // fresh memfd. A tensor that already is (or becomes so concurrently)
        // keeps a slot it does not use: harmless, and it keeps this simple.
        // A slot holds a whole storage: views of one storage share its
        // slot (the first to be placed moves the storage there, the others
        // find it moved).
        let mut slots: Vec<Result<(Arc<Region>, usize), usize>> = Vec::with_capacity(tensors.len());
        let mut slot_of_storage: FxHashMap<usize, usize> = FxHashMap::default();
        let mut total = 0usize;
        for t in tensors {
            if let Some(place) = shm_place(t) {
                slots.push(Ok(place));
                continue;
            }
            if !t.covers_storage() {
                if let Some(&offset) = slot_of_storage.get(&t.storage_id()) {
                    slots.push(Err(offset));
                    continue;
                }
            }
            let offset = align_up(total).ok_or_else(too_big)?;
            total = offset.checked_add(t.storage_nbytes()).ok_or_else(too_big)?;
            if !t.covers_storage() {
                slot_of_storage.insert(t.storage_id(), offset);
            }
            slots.push(Err(offset));
        }
        let fresh = if slots.iter().any(Result::is_err) {
            Some(Region::create(&format!("rdt-shm-{key}"), total)?)
        } else {
            None
        };

        let mut places = Vec::with_capacity(tensors.len());
        for (i, (t, slot)) in tensors.iter().zip(slots).enumerate() {
            let place = match (slot, &fresh) {
                // In shared memory when laid out, and shm memory is never
                // migrated away (invariant 6).
                (Ok(place), _) => place,
                (Err(offset), Some(region)) => place_in(region, offset, i, t)?,
                (Err(_), None) => unreachable!("a fresh region is made for every slot"),
            };
            places.push(place);
        }

        // One table entry per distinct memfd, in order of first use.
        let mut regions: Vec<Arc<Region>> = Vec::new();
        let mut index: FxHashMap<*const Region, u32> = FxHashMap::default();
        let mut handles = Handles {
            boot_id: host.boot_id.clone(),
            pid_ns: host.pid_ns,
            pid: std::process::id(),
            files: Vec::new(),
            tensors: Vec::with_capacity(places.len()),
        };
        for ((region, offset), t) in places.into_iter().zip(tensors) {
            let file = match index.get(&Arc::as_ptr(&region)) {
                Some(&file) => file,
                None => {
                    let file = u32::try_from(regions.len()).map_err(|_| too_big())?;
                    index.insert(Arc::as_ptr(&region), file);
                    handles.files.push(region.handle());
                    regions.push(region.clone());
                    file
                }
            };
            handles.tensors.push(Slot {
                file,
                offset: offset as u64,
                len: t.nbytes() as u64,
            });
        }

        let bytes = postcard::to_stdvec(&handles)
            .map_err(|e| TransportError::new(NAME, format!("cannot encode handles: {e}")))?;
        self.exports.lock().entry(key).or_default().extend(regions);
        Ok(Exported {
            metas: tensors.iter().map(Tensor::meta).collect(),
            handles: bytes,
            inline: Vec::new(),
        })
    }

    fn receive_now(&self, from: &Peer, exported: &Exported) -> Result<Vec<Tensor>, TransportError> {
        let err = |m: String| TransportError::with_peer(NAME, from, m);
        let h: Handles = postcard::from_bytes(&exported.handles)
            .map_err(|e| err(format!("malformed shm handles: {e}")))?;
        let here = host_id()?;
        if h.boot_id != here.boot_id {
            return Err(err(format!(
                "shm moves tensors only between actors on one host; peer {} is on another host ({}): \
                 use tcp (in a collective group) or object_store",
                from.name, from.host
            )));
        }
        if let (Some(theirs), Some(ours)) = (h.pid_ns, here.pid_ns) {
            if theirs != ours {
                return Err(err(format!(
                    "shm needs both actors in one pid namespace; peer {} runs in another one \
                     (another container on this host?): use tcp (in a collective group) or object_store",
                    from.name
                )));
            }
        }
        if h.tensors.len() != exported.metas.len() {
            return Err(err(format!(
                "handles describe {} tensors but the metadata {}",
                h.tensors.len(),
                exported.metas.len()
            )));
        }

        // Map each memfd once; its tensors share the mapping, and a memfd
        // mapped before (a kept tensor passed again) is not mapped again.
        self.sweep_if_due();
        let regions = h
            .files
            .iter()
            .map(|f| self.map_published(from, h.pid, f).map_err(&err))
            .collect::<Result<Vec<_>, _>>()?;

        // The tensors are views of one tensor per memfd: a reference
        // count each, not an allocation.
        let mut wholes: Vec<Option<Tensor>> = vec![None; regions.len()];
        let mut tensors = Vec::with_capacity(h.tensors.len());
        for (i, (meta, slot)) in exported.metas.iter().zip(&h.tensors).enumerate() {
            let t = tensor_over(&regions, &mut wholes, meta, slot)
                .map_err(|m| err(format!("tensor #{i}: {m}")))?;
            tensors.push(t);
        }
        check_received(NAME, &exported.metas, &tensors)?;
        Ok(tensors)
    }
}

impl ShmTransport {
    /// The mapping of memfd `f` that process `pid` publishes: the cached
    /// one if this process mapped that memfd before, else a new one, kept
    /// for next time (invariant 7). Either way the memfd must be what
    /// `/proc/<pid>/fd/<fd>` names now (invariant 3).
    fn map_published(&self, from: &Peer, pid: u32, f: &FileHandle) -> Result<Arc<Region>, String> {
        let key = (f.dev, f.ino);
        let cached = self.mapped.lock().get(&key).map(|m| m.region.clone());
        if let Some(region) = cached {
            Region::published(pid, f)?;
            // The publisher to look at from now on (a consumer may publish
            // what it received).
            if let Some(m) = self.mapped.lock().get_mut(&key) {
                (m.pid, m.fd, m.actor) = (pid, f.fd, from.actor);
            }
            self.mappings_reused.fetch_add(1, Ordering::Relaxed);
            return Ok(region);
        }
        let region = Region::open(pid, f)?;
        self.mappings_made.fetch_add(1, Ordering::Relaxed);
        let mut mapped = self.mapped.lock();
        // Another receive may have mapped it meanwhile: keep one.
        let kept = mapped.entry(key).or_insert_with(|| Mapped {
            region: region.clone(),
            pid,
            fd: f.fd,
            actor: from.actor,
        });
        Ok(kept.region.clone())
    }

    /// Sweeps the mapping cache if the last sweep is older than
    /// [`SWEEP_PERIOD`], or if it holds more than [`SWEEP_ABOVE`] memfds (a
    /// producer that makes fresh tensors every pass publishes a new memfd
    /// each time: their mappings must not pile up between sweeps).
    fn sweep_if_due(&self) {
        let now = Instant::now();
        let crowded = self.mapped.lock().len() > SWEEP_ABOVE;
        {
            let mut last = self.last_sweep.lock();
            if !crowded && last.is_some_and(|t| now.duration_since(t) < SWEEP_PERIOD) {
                return;
            }
            *last = Some(now);
        }
        self.sweep();
    }

    /// Drops the cached mappings that no tensor here uses and whose
    /// producer no longer publishes (it freed the object and its tensors):
    /// kept, they would hold the memory and a descriptor for nothing.
    fn sweep(&self) {
        let idle: Vec<((u64, u64), u32, FileHandle)> = self
            .mapped
            .lock()
            .iter()
            .filter(|(_, m)| Arc::strong_count(&m.region) == 1)
            .map(|(&(dev, ino), m)| ((dev, ino), m.pid, FileHandle { fd: m.fd, dev, ino }))
            .collect();
        // Looked at outside the lock: a stat of /proc per memfd.
        let stale: Vec<(u64, u64)> = idle
            .into_iter()
            .filter(|(_, pid, h)| Region::published(*pid, h).is_err())
            .map(|(k, _, _)| k)
            .collect();
        if stale.is_empty() {
            return;
        }
        let mut dropped = Vec::with_capacity(stale.len());
        {
            let mut mapped = self.mapped.lock();
            for k in stale {
                // Still idle: a receive may have taken it meanwhile.
                if mapped
                    .get(&k)
                    .is_some_and(|m| Arc::strong_count(&m.region) == 1)
                {
                    dropped.extend(mapped.remove(&k));
                }
            }
        }
        // Unmapped here, outside the lock (munmap of a large file is slow).
        drop(dropped);
    }

    /// How many memfds of other producers this process keeps mapped for
    /// later receives (see the module's invariant 7).
    pub fn cached_mappings(&self) -> usize {
        self.mapped.lock().len()
    }

    /// How many producer memfds this transport mapped, and how many times
    /// a receive reused a mapping it kept (invariant 7), over its life: a
    /// kept tensor passed again costs no new mapping.
    pub fn mapping_stats(&self) -> (u64, u64) {
        (
            self.mappings_made.load(Ordering::Relaxed),
            self.mappings_reused.load(Ordering::Relaxed),
        )
    }
}

impl TensorTransport for ShmTransport {
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
            Device::Cpu => Ok(()),
            other => Err(TransportError::new(
                NAME,
                format!("shm moves CPU tensors only; for tensors on {other} use cuda_ipc (same host) or nixl"),
            )),
        }
    }

    fn export<'a>(
        &'a self,
        key: ObjectKey,
        tensors: &'a [Tensor],
    ) -> BoxFuture<'a, Result<Exported, TransportError>> {
        // Creating and mapping a memfd are short system calls, and the one
        // copy (of tensors not yet in shared memory) is the export's own
        // work, as in the object store: nothing here waits on a peer.
        Box::pin(async move { self.export_now(key, tensors) })
    }

    fn receive<'a>(
        &'a self,
        from: &'a Peer,
        cx: &'a TransferCtx,
        exported: &'a Exported,
    ) -> BoxFuture<'a, Result<Vec<Tensor>, TransportError>> {
        // Opening and mapping move no bytes: the receive costs the same
        // whatever the tensors' size (a target costs one copy).
        Box::pin(async move {
            let mapped = self.receive_now(from, exported)?;
            cx.place(NAME, &exported.metas, mapped)
        })
    }

    fn release(&self, key: ObjectKey) -> BoxFuture<'_, Result<(), TransportError>> {
        // Dropping our references closes the descriptors (once the
        // producer's tensors are gone too); consumers keep their mappings
        // (invariant 5). Releasing an unknown key is not an error: an object
        // whose export failed is freed all the same.
        Box::pin(async move {
            let dropped = self.exports.lock().remove(&key);
            self.sweep_if_due();
            tracing::trace!(
                key,
                memfds = dropped.as_ref().map_or(0, Vec::len),
                "shm release"
            );
            Ok(())
        })
    }

    fn peer_gone(&self, actor: u64) {
        // Its memfds go with it (unless this process's tensors still use
        // them, which then keep their mapping until they are dropped).
        let gone: Vec<Mapped> = {
            let mut mapped = self.mapped.lock();
            let keys: Vec<(u64, u64)> = mapped
                .iter()
                .filter(|(_, m)| m.actor == actor)
                .map(|(k, _)| *k)
                .collect();
            keys.into_iter().filter_map(|k| mapped.remove(&k)).collect()
        };
        drop(gone);
    }

    fn housekeeping(&self) {
        self.sweep();
    }
}

/// What the producer publishes (postcard-encoded in [`Exported::handles`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Handles {
    /// The producer's kernel (invariant 1).
    boot_id: String,
    /// Inode of the producer's pid namespace, where it could be read.
    pid_ns: Option<u64>,
    /// The producer's pid, in that namespace.
    pid: u32,
    /// The memfds the object's tensors live in.
    files: Vec<FileHandle>,
    /// One per tensor, in the order of the metadata.
    tensors: Vec<Slot>,
}

/// A memfd of the producer (invariant 3).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct FileHandle {
    fd: RawFd,
    dev: u64,
    ino: u64,
}

/// Where one tensor's bytes are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
struct Slot {
    /// Index into [`Handles::files`].
    file: u32,
    offset: u64,
    len: u64,
}

/// One memfd, open and mapped in this process. The descriptor stays open
/// as long as the region lives so that it can be published (again): the
/// producer's `/proc/<pid>/fd/<fd>` must name it (invariant 2).
struct Region {
    file: File,
    map: MmapRaw,
    dev: u64,
    ino: u64,
}

impl Region {
    /// A fresh memfd of `len` bytes, sealed and mapped.
    fn create(name: &str, len: usize) -> Result<Arc<Region>, TransportError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            TransportError::new(NAME, format!("cannot {what} a memfd of {len} bytes: {e}"))
        };
        let memfd = MemfdOptions::new()
            .allow_sealing(true)
            .close_on_exec(true)
            .create(name)
            .map_err(|e| fail("create", &e))?;
        memfd
            .as_file()
            .set_len(len as u64)
            .map_err(|e| fail("size", &e))?;
        memfd
            .add_seals(&[FileSeal::SealShrink, FileSeal::SealGrow, FileSeal::SealSeal])
            .map_err(|e| fail("seal", &e))?;
        Region::map(memfd.into_file()).map_err(|e| fail("map", &e))
    }

    /// Opens and maps the memfd `h` of process `pid`, checking that it is
    /// the one published (invariants 3 and 4).
    fn open(pid: u32, h: &FileHandle) -> Result<Arc<Region>, String> {
        // Look before opening: a stale or malformed handle may name any
        // file of the producer (a device, a socket), and opening some files
        // has effects of its own.
        let path = Self::published(pid, h)?;
        let stale = || stale_handle(pid, h);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| open_error(&e, pid, h.fd, &path))?;
        // Check again what was opened: the descriptor may have been closed
        // and its number reused between the look and the open.
        let stat = file
            .metadata()
            .map_err(|e| format!("cannot stat {path}: {e}"))?;
        if (stat.dev(), stat.ino()) != (h.dev, h.ino) {
            return Err(stale());
        }
        let memfd = Memfd::try_from_file(file).map_err(|_| format!("{path} is not a memfd"))?;
        let seals = memfd
            .seals()
            .map_err(|e| format!("cannot read the seals of {path}: {e}"))?;
        if !seals.contains(&FileSeal::SealShrink) {
            return Err(format!(
                "{path} is not sealed against shrinking, so mapping it is unsafe"
            ));
        }
        Region::map(memfd.into_file()).map_err(|e| format!("cannot map {path}: {e}"))
    }

    /// Does `/proc/<pid>/fd/<fd>` name the memfd `h` (invariant 3)? Its
    /// path if so; why not, if not. Looks (`stat`), opens nothing.
    fn published(pid: u32, h: &FileHandle) -> Result<String, String> {
        let path = format!("/proc/{pid}/fd/{}", h.fd);
        let target = std::fs::metadata(&path).map_err(|e| open_error(&e, pid, h.fd, &path))?;
        if (target.dev(), target.ino()) != (h.dev, h.ino) {
            return Err(stale_handle(pid, h));
        }
        Ok(path)
    }

    /// Maps all of `file`, shared and writable.
    fn map(file: File) -> std::io::Result<Arc<Region>> {
        let stat = file.metadata()?;
        let map = MmapRaw::map_raw(&file)?;
        Ok(Arc::new(Region {
            dev: stat.dev(),
            ino: stat.ino(),
            file,
            map,
        }))
    }

    fn fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    fn handle(&self) -> FileHandle {
        FileHandle {
            fd: self.fd(),
            dev: self.dev,
            ino: self.ino,
        }
    }

    /// The memory of bytes `offset..offset + len`, checked against the
    /// mapping (invariant 4).
    fn slice(self: &Arc<Self>, offset: usize, len: usize) -> Result<ShmMemory, String> {
        match offset.checked_add(len) {
            Some(end) if end <= self.map.len() => Ok(ShmMemory {
                region: self.clone(),
                offset,
                len,
            }),
            _ => Err(format!(
                "bytes {offset}..{offset}+{len} lie outside the memfd's {} bytes",
                self.map.len()
            )),
        }
    }
}

/// The error of a handle whose descriptor names another file now.
fn stale_handle(pid: u32, h: &FileHandle) -> String {
    format!(
        "descriptor {} of process {pid} no longer is the memfd that was published \
         (the object was freed, or the handle is stale)",
        h.fd
    )
}

/// Says why `/proc/<pid>/fd/<fd>` (`path`) could not be looked at or opened.
/// Is process `pid` gone, a zombie, or on its way out? A killed process
/// closes its descriptors while it exits, before it is a zombie: its
/// `/proc/<pid>/stat` state is then `X`, `Z`, or its `PF_EXITING` flag is
/// set.
fn process_ending(pid: u32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // Fields after the command name (which may hold spaces) in parentheses.
    let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) else {
        return true;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    const PF_EXITING: u64 = 0x4;
    let state = fields.first().copied().unwrap_or("X");
    let flags: u64 = fields.get(6).and_then(|f| f.parse().ok()).unwrap_or(0);
    matches!(state, "X" | "x" | "Z") || flags & PF_EXITING != 0
}

fn open_error(e: &std::io::Error, pid: u32, fd: RawFd, path: &str) -> String {
    match e.kind() {
        ErrorKind::NotFound if process_ending(pid) => {
            format!("the producer died: its process {pid} is gone or exiting")
        }
        ErrorKind::NotFound => format!(
            "producer process {pid} no longer has descriptor {fd} open: the object was \
             released by its producer (a bug, since the driver frees objects only after \
             their receives end: please report it)"
        ),
        ErrorKind::PermissionDenied => format!(
            "cannot open {path}: permission denied; shm needs both actors to run as the same \
             user, with the producer dumpable"
        ),
        _ => format!("cannot open {path}: {e}"),
    }
}

/// A tensor's bytes inside a [`Region`]: the [`ExternalMemory`] of `shm`
/// tensors. Every tensor over a region holds the region, so the mapping
/// (and descriptor) goes with the last of them.
struct ShmMemory {
    region: Arc<Region>,
    offset: usize,
    len: usize,
}

// SAFETY: a mapping that stays mapped until the value drops, and says it
// is shared with other processes (it is a `MAP_SHARED` memfd).
unsafe impl ExternalMemory for ShmMemory {
    fn as_ptr(&self) -> *mut u8 {
        // In bounds: `Region::slice` is the only constructor.
        self.region.map.as_mut_ptr().wrapping_add(self.offset)
    }

    fn len(&self) -> usize {
        self.len
    }

    fn describe(&self) -> String {
        format!(
            "shm memfd (fd {}, inode {}) bytes {}..{}",
            self.region.fd(),
            self.region.ino,
            self.offset,
            self.offset + self.len
        )
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }

    /// Yes: every process that received the tensor maps the same memfd,
    /// and so does the producer; any of them may write at any time.
    fn shared_with_other_processes(&self) -> bool {
        true
    }
}

/// The region and offset of `t`'s bytes, if it lives in `shm` memory.
fn shm_place(t: &Tensor) -> Option<(Arc<Region>, usize)> {
    t.with_external(|mem| {
        let mem = mem?;
        let shm = mem.memory().as_any().downcast_ref::<ShmMemory>()?;
        Some((shm.region.clone(), shm.offset + mem.offset()))
    })
}

/// Puts tensor #`i`'s storage into its slot at `offset` of the fresh
/// `region`, and says where the tensor's bytes are now.
fn place_in(
    region: &Arc<Region>,
    offset: usize,
    i: usize,
    t: &Tensor,
) -> Result<(Arc<Region>, usize), TransportError> {
    let fail = |m: String| TransportError::new(NAME, format!("tensor #{i}: {m}"));
    let mem = region.slice(offset, t.storage_nbytes()).map_err(fail)?;
    if t.migrate_storage(Box::new(mem))
        .map_err(|e| fail(e.to_string()))?
    {
        return Ok((region.clone(), offset + t.byte_offset()));
    }
    // Already external: ours (another export got there first, or the same
    // tensor appears twice in this object), or another transport's.
    if let Some(place) = shm_place(t) {
        return Ok(place);
    }
    let what = t
        .with_external(|m| m.map(|m| m.memory().describe()))
        .unwrap_or_default();
    tracing::debug!(tensor = i, memory = %what, "shm copies a tensor in foreign memory; the producer will not see consumers' writes");
    t.with_bytes(|src| {
        if src.is_empty() {
            return;
        }
        // SAFETY: `slice` above checked `offset + t.storage_nbytes()`
        // against the mapping, and a view's bytes lie within its storage;
        // this slot belongs to no storage (the migration did not take it),
        // so nothing else reads or writes it. Views of one foreign storage
        // share the slot and each writes its own bytes where the storage
        // has them.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                region.map.as_mut_ptr().add(offset + t.byte_offset()),
                src.len(),
            )
        }
    })
    .map_err(|e| fail(e.to_string()))?;
    Ok((region.clone(), offset + t.byte_offset()))
}

/// Builds the consumer's tensor for `meta` over `slot`, validating the
/// slot against the metadata and the mapped memfd (invariant 4): a view of
/// the tensor over the whole memfd (`wholes`, made on first use).
fn tensor_over(
    regions: &[Arc<Region>],
    wholes: &mut [Option<Tensor>],
    meta: &TensorMeta,
    slot: &Slot,
) -> Result<Tensor, String> {
    if !meta.device.is_cpu() {
        return Err(format!(
            "described on {}, but shm moves CPU tensors only",
            meta.device
        ));
    }
    let file = usize::try_from(slot.file)
        .ok()
        .filter(|&f| f < regions.len())
        .ok_or_else(|| format!("names memfd #{} of {}", slot.file, regions.len()))?;
    let region = &regions[file];
    let expected = nbytes(meta.dtype, &meta.shape)
        .ok_or_else(|| format!("shape {:?} has more bytes than fit in memory", meta.shape))?;
    if slot.len != expected as u64 {
        return Err(format!(
            "handle says {} bytes, but a {} tensor of shape {:?} has {expected}",
            slot.len, meta.dtype, meta.shape
        ));
    }
    let offset =
        usize::try_from(slot.offset).map_err(|_| format!("offset {} out of range", slot.offset))?;
    // In bounds, or an error (never a view past the mapping).
    drop(region.slice(offset, expected)?);
    let whole = match &mut wholes[file] {
        Some(w) => w,
        slot @ None => {
            let len = region.map.len();
            let mem = region.slice(0, len)?;
            slot.insert(
                Tensor::from_external(DType::U8, &[len], Device::Cpu, Box::new(mem))
                    .map_err(|e| e.to_string())?,
            )
        }
    };
    whole
        .view(offset, meta.dtype, &meta.shape)
        .map_err(|e| e.to_string())
}

/// Bytes of a `dtype` tensor of `shape`, or `None` on overflow (shapes in
/// handles come from outside and must not panic us).
fn nbytes(dtype: DType, shape: &[usize]) -> Option<usize> {
    shape
        .iter()
        .try_fold(dtype.size(), |acc, &d| acc.checked_mul(d))
}

fn align_up(x: usize) -> Option<usize> {
    Some(x.checked_add(ALIGN - 1)? & !(ALIGN - 1))
}

fn too_big() -> TransportError {
    TransportError::new(NAME, "the object has more bytes than fit in memory")
}

/// Identifies this kernel and pid namespace (invariant 1).
struct HostId {
    boot_id: String,
    pid_ns: Option<u64>,
}

fn host_id() -> Result<&'static HostId, TransportError> {
    static ID: OnceLock<Result<HostId, String>> = OnceLock::new();
    ID.get_or_init(|| {
        let boot_id = std::fs::read_to_string(BOOT_ID_PATH).map_err(|e| {
            format!("cannot read {BOOT_ID_PATH} ({e}): shm needs Linux with /proc mounted")
        })?;
        // The namespace file's inode identifies the namespace. Some sandboxes
        // hide it; then only the boot id is compared.
        let pid_ns = std::fs::metadata("/proc/self/ns/pid").ok().map(|m| m.ino());
        Ok(HostId {
            boot_id: boot_id.trim().to_string(),
            pid_ns,
        })
    })
    .as_ref()
    .map_err(|e| TransportError::new(NAME, e.clone()))
}

#[cfg(test)]
mod tests {
    use futures::executor::block_on;

    use super::*;

    fn peer() -> Peer {
        Peer {
            actor: 1,
            name: "producer".into(),
            host: "here".into(),
            endpoint: String::new(),
        }
    }

    fn decode(e: &Exported) -> Handles {
        postcard::from_bytes(&e.handles).expect("handles we made decode")
    }

    fn with_handles(e: &Exported, f: impl FnOnce(&mut Handles)) -> Exported {
        let mut h = decode(e);
        f(&mut h);
        Exported {
            handles: postcard::to_stdvec(&h).expect("encodes"),
            ..e.clone()
        }
    }

    /// Where `t`'s bytes are in this process (an shm tensor's mapping).
    fn ptr(t: &Tensor) -> usize {
        t.with_external(|m| m.expect("shm tensor").as_ptr() as usize)
    }

    /// The address range of the whole mapping `t`'s bytes live in.
    fn mapping_of(t: &Tensor) -> std::ops::Range<usize> {
        let (region, _) = shm_place(t).expect("shm tensor");
        let start = region.map.as_mut_ptr() as usize;
        start..start + region.map.len()
    }

    /// Does the slice `b` overlap the address range `r`?
    fn overlaps(b: &[u8], r: &std::ops::Range<usize>) -> bool {
        let start = b.as_ptr() as usize;
        start < r.end && r.start < start + b.len().max(1)
    }

    fn receive(shm: &ShmTransport, e: &Exported) -> Result<Vec<Tensor>, TransportError> {
        block_on(shm.receive(&peer(), &TransferCtx::new(0), e))
    }

    fn sample() -> Vec<Tensor> {
        vec![
            Tensor::from_slice(&[1.5f32, -2.0, 3.25, 4.0, 5.0, 6.5], &[2, 3]).unwrap(),
            Tensor::arange::<i64>(5),
            // 7 bytes: the next tensor must still start 64-byte aligned.
            Tensor::from_slice(&[1u8, 2, 3, 4, 5, 6, 7], &[7]).unwrap(),
            Tensor::zeros(DType::F64, &[0]),
            Tensor::from_bytes(DType::Bool, &[3, 1], vec![1, 0, 1]).unwrap(),
            Tensor::full(7u32, &[2, 2, 2]),
        ]
    }

    #[test]
    fn bytes_round_trip_in_one_memfd() {
        let shm = ShmTransport::new();
        let tensors = sample();
        let copies: Vec<Tensor> = tensors.iter().map(|t| t.deep_copy().unwrap()).collect();
        let exported = block_on(shm.export(1, &tensors)).unwrap();
        assert_eq!(exported.metas.len(), tensors.len());
        assert!(exported.inline.is_empty());

        let h = decode(&exported);
        assert_eq!(h.files.len(), 1, "one object, one memfd");
        assert!(h
            .tensors
            .iter()
            .all(|s| s.file == 0 && s.offset % ALIGN as u64 == 0));

        let got = receive(&shm, &exported).unwrap();
        for (i, ((g, c), p)) in got.iter().zip(&copies).zip(&tensors).enumerate() {
            assert!(
                g.equal(c).unwrap(),
                "tensor #{i} differs from the original bytes"
            );
            assert!(
                p.equal(c).unwrap(),
                "producer tensor #{i} changed when migrated"
            );
            assert!(ShmTransport::is_shm(g) && ShmTransport::is_shm(p));
            assert_eq!(ptr(g) % ALIGN, 0);
        }
    }

    #[test]
    fn writes_are_shared_both_ways() {
        let shm = ShmTransport::new();
        let producer = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[4]).unwrap();
        let clone = producer.clone();
        let exported = block_on(shm.export(1, std::slice::from_ref(&producer))).unwrap();
        let consumer = receive(&shm, &exported).unwrap().remove(0);
        assert!(
            !consumer.shares_storage(&producer),
            "another storage over the same memory"
        );

        consumer.fill_(9.0f32).unwrap();
        assert_eq!(producer.to_vec::<f32>().unwrap(), vec![9.0; 4]);
        assert_eq!(
            clone.to_vec::<f32>().unwrap(),
            vec![9.0; 4],
            "every clone migrated"
        );

        producer.add_scalar_(1.0f32).unwrap();
        assert_eq!(consumer.to_vec::<f32>().unwrap(), vec![10.0; 4]);

        // A second consumer maps the same memory too.
        let second = receive(&shm, &exported).unwrap().remove(0);
        second.fill_(-1.0f32).unwrap();
        assert_eq!(consumer.to_vec::<f32>().unwrap(), vec![-1.0; 4]);
    }

    #[test]
    fn shm_tensors_are_exported_without_a_copy() {
        let shm = ShmTransport::new();
        let a = ShmTransport::alloc(DType::F32, &[4, 4]).unwrap();
        assert!(ShmTransport::is_shm(&a));
        assert_eq!(
            a.to_vec::<f32>().unwrap(),
            vec![0.0; 16],
            "alloc gives zeros"
        );
        a.fill_(3.0f32).unwrap();
        let (id, at) = (a.storage_id(), ptr(&a));
        let (region, _) = shm_place(&a).unwrap();

        let e1 = block_on(shm.export(1, std::slice::from_ref(&a))).unwrap();
        let e2 = block_on(shm.export(2, std::slice::from_ref(&a))).unwrap();
        assert_eq!((a.storage_id(), ptr(&a)), (id, at), "no migration");
        for e in [&e1, &e2] {
            assert_eq!(
                decode(e).files,
                vec![region.handle()],
                "published where it lives"
            );
        }

        // A plain tensor is copied once, on its first export, and never again.
        let b = Tensor::arange::<f64>(10);
        let e3 = block_on(shm.export(3, std::slice::from_ref(&b))).unwrap();
        let after_first = ptr(&b);
        let e4 = block_on(shm.export(4, std::slice::from_ref(&b))).unwrap();
        assert_eq!(ptr(&b), after_first);
        assert_eq!(decode(&e3).files, decode(&e4).files);

        // Mixed: the shm tensor stays where it is, the plain one gets a memfd.
        let c = Tensor::full(1i32, &[3]);
        let e5 = block_on(shm.export(5, &[a.clone(), c.clone(), a.clone()])).unwrap();
        let h5 = decode(&e5);
        assert_eq!(h5.files.len(), 2);
        assert_eq!(h5.files[0], region.handle());
        assert_eq!(
            h5.tensors[0], h5.tensors[2],
            "the same tensor twice is one place"
        );
        let got = receive(&shm, &e5).unwrap();
        assert_eq!(got[0].to_vec::<f32>().unwrap(), vec![3.0; 16]);
        assert_eq!(got[1].to_vec::<i32>().unwrap(), vec![1; 3]);

        // A received tensor is re-exported from the consumer's own mapping.
        let e6 = block_on(shm.export(6, &got[1..2])).unwrap();
        assert_eq!(decode(&e6).files[0].ino, h5.files[1].ino, "same memfd");
        assert_eq!(ptr(&receive(&shm, &e6).unwrap()[0]) % ALIGN, 0);
    }

    /// Defect 5: `with_bytes`/`with_bytes_mut` put a Rust reference over a
    /// mapping that other processes write. They must hand out a private
    /// copy instead, and still read and write the shared bytes.
    #[test]
    fn safe_byte_access_to_shm_never_points_into_the_mapping() {
        let shm = ShmTransport::new();
        let producer = Tensor::from_slice(&[1u32, 2, 3, 4, 5, 6, 7, 8], &[8]).unwrap();
        let e = block_on(shm.export(1, std::slice::from_ref(&producer))).unwrap();
        // Received in this process: another mapping of the same memfd.
        let consumer = receive(&shm, &e).unwrap().remove(0);
        let (theirs, ours) = (mapping_of(&producer), mapping_of(&consumer));
        assert_ne!(theirs, ours, "two mappings");

        // Reads give the bytes, from a copy outside both mappings.
        let want: Vec<u8> = bytemuck::cast_slice(&[1u32, 2, 3, 4, 5, 6, 7, 8]).to_vec();
        for t in [&producer, &consumer] {
            t.with_bytes(|b| {
                assert_eq!(b, &want[..]);
                assert!(!overlaps(b, &theirs) && !overlaps(b, &ours), "a snapshot");
            })
            .unwrap();
        }

        // Writes through a private copy reach the memory: the other mapping
        // sees them.
        consumer
            .with_bytes_mut(|b| {
                assert!(
                    !overlaps(b, &theirs) && !overlaps(b, &ours),
                    "a staged copy"
                );
                assert_eq!(b, &want[..], "the copy starts as the memory's bytes");
                b[4..8].copy_from_slice(&42u32.to_le_bytes());
            })
            .unwrap();
        assert_eq!(
            producer.to_vec::<u32>().unwrap(),
            vec![1, 42, 3, 4, 5, 6, 7, 8]
        );
        producer
            .with_bytes_mut(|b| b[28..].copy_from_slice(&9u32.to_le_bytes()))
            .unwrap();
        assert_eq!(
            consumer.to_vec::<u32>().unwrap(),
            vec![1, 42, 3, 4, 5, 6, 7, 9]
        );

        // Everything built on the accessors sees the shared bytes too.
        assert_eq!(consumer.sum().unwrap(), 77.0);
        assert!(consumer.equal(&producer).unwrap());
        let copy = consumer.deep_copy().unwrap();
        assert!(!ShmTransport::is_shm(&copy) && copy.equal(&producer).unwrap());
        assert_eq!(consumer.to_bytes().unwrap(), producer.to_bytes().unwrap());

        // The unchecked forms are zero-copy: the caller vouches that no one
        // writes meanwhile (true here: this thread is the only user).
        let (at_consumer, at_producer) = (ptr(&consumer), ptr(&producer));
        // SAFETY: nothing else touches the memfd during these calls.
        unsafe {
            consumer
                .with_bytes_unchecked(|b| {
                    assert_eq!(b.as_ptr() as usize, at_consumer);
                    assert!(overlaps(b, &ours));
                })
                .unwrap();
            producer
                .with_bytes_mut_unchecked(|b| {
                    assert_eq!(b.as_ptr() as usize, at_producer);
                    b[..4].copy_from_slice(&0u32.to_le_bytes());
                })
                .unwrap();
        }
        assert_eq!(consumer.to_vec::<u32>().unwrap()[0], 0);
    }

    #[test]
    fn the_same_plain_tensor_twice_is_migrated_once() {
        let shm = ShmTransport::new();
        let t = Tensor::arange::<u64>(3);
        let e = block_on(shm.export(1, &[t.clone(), t.clone()])).unwrap();
        let h = decode(&e);
        assert_eq!(h.tensors[0], h.tensors[1]);
        let got = receive(&shm, &e).unwrap();
        got[1].fill_(5u64).unwrap();
        assert_eq!(t.to_vec::<u64>().unwrap(), vec![5; 3]);
        assert_eq!(got[0].to_vec::<u64>().unwrap(), vec![5; 3]);
    }

    #[test]
    fn malformed_handles_are_errors() {
        let shm = ShmTransport::new();
        let tensors = vec![Tensor::arange::<f32>(8), Tensor::arange::<i16>(3)];
        let e = block_on(shm.export(1, &tensors)).unwrap();
        receive(&shm, &e).unwrap();

        let fails = |e: &Exported, needle: &str| {
            let err = receive(&shm, e).expect_err(needle);
            assert_eq!(err.transport, NAME);
            assert_eq!(err.peer.as_deref(), Some("producer"));
            assert!(err.message.contains(needle), "{err}");
        };
        fails(
            &with_handles(&e, |h| h.tensors[1].offset = 1 << 40),
            "outside",
        );
        fails(&with_handles(&e, |h| h.tensors[1].offset = u64::MAX), "out");
        fails(
            &with_handles(&e, |h| h.tensors[0].len = 4),
            "handle says 4 bytes",
        );
        fails(&with_handles(&e, |h| h.tensors[0].file = 7), "memfd #7");
        fails(
            &with_handles(&e, |h| h.tensors.truncate(1)),
            "handles describe 1",
        );
        fails(
            &with_handles(&e, |h| h.boot_id = "another-kernel".into()),
            "another host",
        );
        if decode(&e).pid_ns.is_some() {
            fails(
                &with_handles(&e, |h| h.pid_ns = h.pid_ns.map(|n| n + 1)),
                "pid namespace",
            );
        }
        fails(&with_handles(&e, |h| h.pid = u32::MAX), "is gone");
        fails(
            &with_handles(&e, |h| h.files[0].ino ^= 1),
            "no longer is the memfd",
        );
        // A descriptor that is not the memfd (stdin, whatever it is under
        // the test harness, or not open at all) is refused before opening.
        let not_ours = with_handles(&e, |h| h.files[0].fd = 0);
        assert!(receive(&shm, &not_ours).is_err());
        fails(
            &Exported {
                handles: vec![0xff; 3],
                ..e.clone()
            },
            "malformed shm handles",
        );

        let mut huge = e.clone();
        huge.metas[0].shape = vec![usize::MAX, 2].into();
        fails(&huge, "more bytes than fit");
        let mut wrong = e.clone();
        wrong.metas[1].dtype = DType::I32;
        fails(&wrong, "handle says 6 bytes");
    }

    #[test]
    fn release_leaves_consumers_their_memory() {
        let shm = ShmTransport::new();
        let mut producer = vec![Tensor::arange::<f32>(1000), Tensor::full(2u8, &[10])];
        let e = block_on(shm.export(1, &producer)).unwrap();
        let got = receive(&shm, &e).unwrap();
        let pinned = decode(&e).files[0].clone();

        block_on(shm.release(1)).unwrap();
        block_on(shm.release(1)).unwrap(); // idempotent
        assert!(shm.exports.lock().is_empty());
        producer.clear(); // the owner's free: its tensors go

        assert_eq!(
            got[0].to_vec::<f32>().unwrap(),
            (0..1000).map(|i| i as f32).collect::<Vec<_>>()
        );
        got[1].fill_(4u8).unwrap();
        assert_eq!(got[1].sum().unwrap(), 40.0);

        // The consumer's tensors still hold the memfd (its own descriptor);
        // the producer's published descriptor is closed, or names another
        // file by now: a late receive fails instead of mapping anything.
        assert_eq!(shm_place(&got[0]).unwrap().0.ino, pinned.ino);
        assert!(receive(&shm, &e).is_err());
        drop(got);
    }

    /// Invariant 7: the weights-sync pattern (the producer keeps its
    /// tensors and passes them again) maps the memfd once per consumer.
    #[test]
    fn a_kept_tensor_passed_again_reuses_the_consumers_mapping() {
        let shm = ShmTransport::new();
        let mut producer = vec![Tensor::full(3u8, &[1 << 20]), Tensor::arange::<f32>(100)];
        let e1 = block_on(shm.export(1, &producer)).unwrap();
        let first = receive(&shm, &e1).unwrap();
        let mapping = mapping_of(&first[0]);
        assert_ne!(
            mapping,
            mapping_of(&producer[0]),
            "the consumer's own mapping"
        );
        drop(first);
        block_on(shm.release(1)).unwrap();
        assert_eq!(shm.cached_mappings(), 1);

        // Passed again: same memfd, and the consumer's same mapping.
        let e2 = block_on(shm.export(2, &producer)).unwrap();
        assert_eq!(decode(&e2).files, decode(&e1).files);
        assert_eq!(shm.mapping_stats(), (1, 0));
        let second = receive(&shm, &e2).unwrap();
        assert_eq!(shm.mapping_stats(), (1, 1), "no new mapping");
        assert_eq!(mapping_of(&second[0]), mapping);
        assert_eq!(second[0].sum().unwrap(), 3.0 * (1 << 20) as f64);
        second[1].fill_(1.0f32).unwrap();
        assert_eq!(producer[1].sum().unwrap(), 100.0, "still shared memory");

        // Kept while the producer publishes the memfd, even with no
        // tensor here.
        drop(second);
        block_on(shm.release(2)).unwrap();
        shm.housekeeping();
        assert_eq!(shm.cached_mappings(), 1, "the producer still has it");

        // The producer's free: its tensors go, its descriptor closes, and
        // the consumer lets go of the mapping at the next sweep.
        producer.clear();
        shm.housekeeping();
        assert_eq!(shm.cached_mappings(), 0, "nothing publishes it any more");
        assert!(receive(&shm, &e2).is_err(), "a stale handle still fails");
    }

    #[test]
    fn a_mapping_in_use_is_kept_and_a_gone_producers_mappings_are_dropped() {
        let shm = ShmTransport::new();
        let producer = vec![Tensor::full(5u8, &[4096])];
        let e = block_on(shm.export(1, &producer)).unwrap();
        let got = receive(&shm, &e).unwrap();
        block_on(shm.release(1)).unwrap();
        drop(producer);
        // Nothing publishes the memfd now, but a tensor here uses it.
        shm.housekeeping();
        assert_eq!(shm.cached_mappings(), 1);
        assert_eq!(got[0].sum().unwrap(), 5.0 * 4096.0);

        let p2 = vec![Tensor::full(6u8, &[4096])];
        let e2 = block_on(shm.export(2, &p2)).unwrap();
        let got2 = receive(&shm, &e2).unwrap();
        assert_eq!(shm.cached_mappings(), 2);
        shm.peer_gone(peer().actor);
        assert_eq!(shm.cached_mappings(), 0, "the producer's actor is gone");
        assert_eq!(
            got2[0].sum().unwrap(),
            6.0 * 4096.0,
            "tensors keep their mapping"
        );
        assert_eq!(got[0].sum().unwrap(), 5.0 * 4096.0);
    }

    #[test]
    fn cuda_tensors_are_refused() {
        let shm = ShmTransport::new();
        let cuda = Device::Cuda {
            uuid: crate::GpuUuid::from_bytes([0; 16]),
            ordinal: 0,
        };
        let err = shm.check_device(&cuda).unwrap_err();
        assert!(
            err.message.contains("cuda_ipc") && err.message.contains("nixl"),
            "{err}"
        );
        assert_eq!(shm.sidedness(), Sidedness::OneSided);
        assert_eq!(shm.name(), "shm");
    }

    #[test]
    fn an_object_of_no_bytes_round_trips() {
        let shm = ShmTransport::new();
        let e = block_on(shm.export(1, &[Tensor::zeros(DType::F32, &[0, 3])])).unwrap();
        let got = receive(&shm, &e).unwrap();
        assert_eq!(got[0].shape(), &[0, 3]);
        let e = block_on(shm.export(2, &[])).unwrap();
        assert!(receive(&shm, &e).unwrap().is_empty());
    }

    /// Set in the environment of the child that
    /// `another_process_maps_the_producers_memory` starts.
    const CHILD: &str = "RDT_SHM_TEST_CHILD";

    fn hex(bytes: &[u8]) -> String {
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// The producer half of `another_process_maps_the_producers_memory`;
    /// does nothing unless that test started it.
    #[test]
    fn child_producer() {
        if crate::env::var_os(CHILD).is_none() {
            return;
        }
        // Never outlive a parent that failed: our exit ends its wait on
        // our output, and so the test, instead of hanging it.
        std::thread::spawn(|| {
            std::thread::sleep(std::time::Duration::from_secs(60));
            std::process::exit(2);
        });
        let shm = ShmTransport::new();
        let t = Tensor::arange::<f32>(16);
        let e = block_on(shm.export(1, std::slice::from_ref(&t))).unwrap();
        println!("EXPORTED {}", hex(&postcard::to_stdvec(&e).unwrap()));
        // The consumer writes, then says so on our stdin.
        let mut line = String::new();
        std::io::stdin().read_line(&mut line).unwrap();
        println!("SEEN {}", t.sum().unwrap());
    }

    #[test]
    fn another_process_maps_the_producers_memory() {
        use std::io::{BufRead, BufReader, Write};
        use std::process::{Command, Stdio};

        let exe = std::env::current_exe().unwrap();
        let mut child = Command::new(exe)
            .args(["--exact", "shm::tests::child_producer", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(CHILD, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut line_with = |prefix: &str| loop {
            let line = out.next().expect("child output ended").unwrap();
            // The harness may print the test's name on the same line.
            if let Some(at) = line.find(prefix) {
                return line[at + prefix.len()..].to_string();
            }
        };
        let e: Exported = postcard::from_bytes(&unhex(&line_with("EXPORTED "))).unwrap();
        assert_eq!(decode(&e).pid, child.id());

        let shm = ShmTransport::new();
        let got = receive(&shm, &e).unwrap().remove(0);
        assert_eq!(got.sum().unwrap(), (0..16).sum::<i32>() as f64);
        got.fill_(7.0f32).unwrap();
        writeln!(child.stdin.take().unwrap(), "written").unwrap();
        assert_eq!(line_with("SEEN "), "112", "the producer sees our write");
        assert!(child.wait().unwrap().success());

        // The producer is gone; our mapping is not (invariant 5).
        assert_eq!(got.to_vec::<f32>().unwrap(), vec![7.0; 16]);
        let err = receive(&shm, &e).unwrap_err();
        assert!(err.message.contains("is gone"), "{err}");
    }
}
