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
use crate::{
    device::Device, dtype::DType, tensor::ExternalMemory, tensor::Tensor, tensor::TensorMeta,
    transport::Exported,
};

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
    fn receive_start(&self, _exported: &Exported) -> crate::transport::ReceiveStart {
        crate::transport::ReceiveStart::Now
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
mod tests;
