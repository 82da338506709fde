//! The CUDA layer: per-process contexts, streams, events, an async
//! completion primitive, exportable device memory and the few ops that
//! tests, examples and benchmarks need. Built on `cudarc`'s driver API with
//! dynamic loading, so it compiles with no CUDA toolkit and loads `libcuda`
//! at run time.
//!
//! # Availability
//! Nothing here touches a lazily loaded CUDA symbol before [`available`] has
//! checked that `libcuda` can be loaded, that every driver symbol this crate
//! uses exists (cudarc's loader panics otherwise), that `cuInit` succeeds and
//! that at least one device is visible. Every entry point goes through it, so
//! a machine without a GPU gets a [`CudaError`] naming what is missing, never
//! a panic.
//!
//! # Contexts and streams
//! Each visible device (ordinal in *this* process, after
//! `CUDA_VISIBLE_DEVICES`) gets one [`Gpu`]: the device's primary context and
//! one non-blocking stream on which every rdt op of this process runs, so
//! ops are ordered against each other and against transfers. Devices are
//! named across processes by UUID ([`Gpu::uuid`]); [`gpu_by_uuid`] finds the
//! local ordinal of a UUID.
//!
//! # Completion
//! [`Gpu::completion`] returns a future that resolves when the GPU has done
//! everything enqueued on the stream so far. If the stream is already idle
//! (`cuStreamQuery`) it is ready at once and nothing is enqueued: work on a
//! GPU that another process is using costs a context switch (hundreds of
//! microseconds on one GPU shared by two processes), so an idle stream must
//! not be given any. Otherwise it records an event and asks `cuEventQuery`
//! again, yielding between asks, for at most [`SPIN_BEFORE_BLOCKING`]
//! (about what a hand-off to the blocking pool costs: a short wait pays no
//! more than that) or the hot window ([`crate::hot`]) if that is longer;
//! if the GPU is not there yet it waits in
//! `cuEventSynchronize` on tokio's blocking pool (exact wake-up, no
//! executor thread blocked or spinning for long; outside a tokio runtime
//! it blocks the caller). Works on current-thread runtimes (actix).
//!
//! # Known idle (asking the stream less)
//! `cuStreamQuery` cost 1.5 µs on the 2xH200 host, and a small pass asked
//! it several times (the method's `cuda_ready`, an NCCL send ordering its
//! stream after rdt's) while nothing had been enqueued since the stream
//! was last seen idle. So each [`Gpu`] counts rdt's enqueues and remembers
//! the count as of the last query that found the stream idle; while the
//! two are equal the stream is idle without asking.
//! - **IK-1 (counted after).** Every enqueue of rdt's on its stream (a
//!   copy, fill, kernel, cuRAND generate, wait on an event) bumps the
//!   count once the enqueue returned. Event records are not counted: they
//!   add no work the stream must pass.
//! - **IK-2 (read before).** A query reads the count first and, if the
//!   stream is idle, stores that count: everything counted before it was
//!   enqueued before the query, so it is done. An equal count later means
//!   nothing was enqueued since.
//! - **IK-3 (lent is unknown).** Once [`Gpu::raw_stream`] handed the
//!   stream to other code (cuBLAS, a user's kernel), what it enqueues is
//!   not counted: from then on the stream is always asked.
//!
//! # Free marks (what another stream may write)
//! Memory freed while rdt's stream may still use it is safe for rdt's
//! stream at once (its later work runs after the earlier), but not for
//! another stream (a transfer's): that one must wait until rdt's stream
//! passed the free. Waiting for everything on rdt's stream would also wait
//! for compute that has nothing to do with the memory, and a transfer would
//! never overlap it. So each [`Gpu`] counts *marks* ([`FreeMarks`]): every
//! time rdt records its stream's completion, or asks whether the stream is
//! idle, it takes a new mark number first. A slab remembers the mark
//! number current when memory in it was last freed (`alloc`); once a mark
//! taken after that free is seen passed (a completion waited for, or the
//! stream seen idle), every use before the free is done, and the slab is
//! *clean*: another stream may write a fresh range of it without waiting.
//! - **FM-1 (the mark comes after the free).** A free reads the current
//!   number; a mark takes the number and only then records or queries.
//!   Every atomic here is sequentially consistent, so a free that read `e`
//!   came before the mark that took `e`, and so did every use of the
//!   memory before the free.
//! - **FM-2 (only seen marks count).** The clean bound moves only when a
//!   mark's event was seen passed or the stream seen idle after the mark
//!   was taken; a mark whose event is never waited for cleans nothing.
//! - **FM-3 (large frees mark themselves).** Freeing a range of a slab of
//!   its own (a large tensor) takes a mark at once: passed if the stream
//!   is idle, else recorded as an event that the allocator asks about
//!   before it looks for clean memory. So a large slab turns clean as
//!   soon as the stream passes its free, even if nothing waits then.
//!
//! # Memory
//! Every CUDA tensor rdt allocates comes from [`alloc`]'s slab allocator over
//! `cuMemAlloc` (never stream-ordered pools, whose memory cannot be exported
//! with `cuIpcGetMemHandle`), so any of them can be handed to another process
//! by the [`ipc`] transport without a copy.

pub mod alloc;
pub mod ipc;
pub mod ops;
pub mod ordered_drop;

use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use parking_lot::Mutex;

use crate::{Device, GpuUuid};

/// A CUDA operation failed, or CUDA is not usable in this process.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("CUDA: {0}")]
pub struct CudaError(pub String);

impl CudaError {
    fn call(what: &str, e: cu::DriverError) -> Self {
        let name = e
            .error_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|_| format!("{:?}", e.0));
        let text = e
            .error_string()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        CudaError(format!("{what} failed: {name} ({text})"))
    }
}

/// Is `RDT_CUDA_TRACE` set (non-empty, not `0`)? Then every context
/// binding and IPC step of this process is printed to stderr with the
/// calling thread's name (a debugging aid for multi-GPU set-ups).
pub fn tracing_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        crate::env::var("RDT_CUDA_TRACE")
            .map(|v| !v.is_empty() && v != "0")
            .unwrap_or(false)
    })
}

/// Is `RDT_TIMELINE` set (non-empty, not `0`)? Then the steps of every
/// direct transfer (order received, job started, enqueued, landed) and of
/// every call are recorded with a host-wide monotonic timestamp and
/// printed to stderr, so the lines of the driver and of every worker on
/// one host line up (a debugging aid for latency: where a pass spends its
/// time).
///
/// Recording a point costs a clock read and a push under an uncontended
/// lock (well under a microsecond); a thread of its own prints the points
/// every 20 ms (a line printed where it happens cost about 5 µs on the
/// GPU host, as much as some of the steps it timed). Points of the last
/// 20 ms before a process ends may be lost; [`timeline_flush`] prints
/// them now.
pub fn timeline_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| {
        crate::env::var("RDT_TIMELINE")
            .map(|v| !v.is_empty() && v != "0")
            .unwrap_or(false)
    })
}

/// Microseconds of `CLOCK_MONOTONIC`: the same clock in every process of
/// a host.
pub fn monotonic_us() -> u64 {
    monotonic_ns() / 1000
}

/// Nanoseconds of `CLOCK_MONOTONIC`.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The timeline points recorded and not printed yet: (ns, thread, what,
/// id).
type TimelinePoints = parking_lot::Mutex<Vec<(u64, u32, &'static str, u64)>>;

thread_local! {
    /// This thread's kernel id (`gettid`), asked once.
    static TID: u32 = {
        // SAFETY: no arguments; returns the caller's thread id.
        unsafe { libc::gettid() as u32 }
    };
}

fn timeline_points() -> &'static TimelinePoints {
    static POINTS: OnceLock<TimelinePoints> = OnceLock::new();
    POINTS.get_or_init(|| {
        // The printer starts with the first point.
        let _ = std::thread::Builder::new()
            .name("rdt-timeline".into())
            .spawn(|| loop {
                std::thread::sleep(std::time::Duration::from_millis(20));
                timeline_flush();
            });
        parking_lot::Mutex::new(Vec::with_capacity(4096))
    })
}

/// One timeline point (see [`timeline_enabled`]): `what` happened to
/// transfer or call `id`. Printed as `[timeline] <µs, 3 decimals> pid
/// <pid> tid <thread> <what> <id>`.
pub fn timeline(what: &'static str, id: u64) {
    if timeline_enabled() {
        let at = monotonic_ns();
        let tid = TID.with(|t| *t);
        timeline_points().lock().push((at, tid, what, id));
    }
}

/// Prints the timeline points recorded so far (see [`timeline_enabled`]).
pub fn timeline_flush() {
    if !timeline_enabled() {
        return;
    }
    let points = std::mem::take(&mut *timeline_points().lock());
    if points.is_empty() {
        return;
    }
    use std::io::Write;
    let pid = std::process::id();
    let mut out = String::with_capacity(points.len() * 64);
    for (at, tid, what, id) in points {
        out.push_str(&format!(
            "[timeline] {}.{:03} pid {pid} tid {tid} {what} {id}\n",
            at / 1000,
            at % 1000
        ));
    }
    let _ = std::io::stderr().lock().write_all(out.as_bytes());
}

/// Prints a trace line when [`tracing_enabled`].
macro_rules! cuda_trace {
    ($($arg:tt)*) => {
        if $crate::cuda::tracing_enabled() {
            eprintln!(
                "[rdt-cuda pid {} thread {}] {}",
                std::process::id(),
                std::thread::current().name().unwrap_or("?"),
                format!($($arg)*)
            );
        }
    };
}
pub(crate) use cuda_trace;

/// Driver symbols this crate calls. All are checked before first use.
const SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDeviceGet",
    "cuDeviceGetCount",
    "cuDeviceGetUuid",
    "cuDeviceGetName",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuCtxSetCurrent",
    "cuCtxEnablePeerAccess",
    "cuStreamCreate",
    "cuStreamCreateWithPriority",
    "cuCtxGetStreamPriorityRange",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuEventSynchronize",
    "cuStreamWaitEvent",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
    "cuMemAlloc_v2",
    "cuMemGetInfo_v2",
    "cuMemFree_v2",
    "cuMemcpyHtoDAsync_v2",
    "cuMemHostRegister_v2",
    "cuMemHostUnregister",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyDtoDAsync_v2",
    "cuMemcpyPeerAsync",
    "cuMemsetD8Async",
    "cuMemsetD16Async",
    "cuMemsetD32Async",
    "cuMemsetD2D32Async",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuIpcGetEventHandle",
    "cuIpcOpenEventHandle",
    "cuGetErrorName",
    "cuGetErrorString",
];

/// Page-locks `len` bytes of host memory at `ptr` for every context of
/// the process (`CU_MEMHOSTREGISTER_PORTABLE`): device copies to and from
/// it run at copy-engine speed, where pageable memory is staged by the
/// driver. Returns whether it pinned: a process that has set up no device
/// yet pins nothing (registering needs a current context, and making one
/// only for this would cost a CPU-only process a device context). Undo
/// with [`unpin_host`] before the memory is unmapped.
///
/// # Safety
/// `ptr..ptr+len` is mapped host memory that stays mapped until
/// [`unpin_host`] is called on `ptr`.
pub unsafe fn pin_host(ptr: *mut u8, len: usize) -> Result<bool, CudaError> {
    available()?;
    let Some(g) = any_gpu_made() else {
        return Ok(false);
    };
    // Without a current context on this thread the call fails with
    // CUDA_ERROR_INVALID_CONTEXT (seen on a driver thread, H200).
    g.bind()?;
    // SAFETY: the caller's promise.
    unsafe { sys::cuMemHostRegister_v2(ptr.cast(), len, 0x01) }
        .result()
        .map(|()| true)
        .map_err(|e| CudaError::call(&format!("cuMemHostRegister of {len} B"), e))
}

/// Undoes [`pin_host`].
///
/// # Safety
/// `ptr` was pinned with [`pin_host`] and is still mapped.
pub unsafe fn unpin_host(ptr: *mut u8) {
    // Needs a current context too; `pin_host` made sure one exists.
    if let Some(g) = any_gpu_made() {
        let _ = g.bind();
    }
    // SAFETY: the caller's promise.
    let _ = unsafe { sys::cuMemHostUnregister(ptr.cast()) };
}

/// Is CUDA usable here? Checks, once per process, that `libcuda` loads, that
/// it has every symbol rdt uses, that `cuInit` succeeds and that a device is
/// visible. The error says which of these failed.
pub fn available() -> Result<(), CudaError> {
    static STATE: OnceLock<Result<(), CudaError>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            // SAFETY: only tries to load the library (no symbol is called).
            if !unsafe { sys::is_culib_present() } {
                return Err(CudaError(
                    "libcuda (the NVIDIA driver library) was not found on the loader path: \
                     this machine has no NVIDIA driver, or LD_LIBRARY_PATH misses it"
                        .into(),
                ));
            }
            // SAFETY: the library is present (checked above); looking a
            // symbol up calls nothing.
            let lib = unsafe { sys::culib() };
            for s in SYMBOLS {
                // SAFETY: a lookup only; the pointer is never called here.
                if unsafe { lib.get::<*const ()>(s.as_bytes()) }.is_err() {
                    return Err(CudaError(format!(
                        "libcuda lacks the symbol {s}: the NVIDIA driver is too old for rdt (CUDA 12 or newer needed)"
                    )));
                }
            }
            cu::init().map_err(|e| CudaError::call("cuInit", e))?;
            let n = cu::device::get_count().map_err(|e| CudaError::call("cuDeviceGetCount", e))?;
            if n <= 0 {
                return Err(CudaError(format!(
                    "no CUDA device is visible (CUDA_VISIBLE_DEVICES={})",
                    crate::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into())
                )));
            }
            Ok(())
        })
        .clone()
}

/// Number of CUDA devices visible to this process (0 if CUDA is not usable).
pub fn device_count() -> usize {
    if available().is_err() {
        return 0;
    }
    cu::device::get_count()
        .map(|n| n.max(0) as usize)
        .unwrap_or(0)
}

/// A raw stream handle that may cross threads (CUDA streams are
/// thread-safe).
#[derive(Clone, Copy, Debug)]
struct Stream(sys::CUstream);
// SAFETY: CUDA stream handles may be used from any thread.
unsafe impl Send for Stream {}
// SAFETY: as above.
unsafe impl Sync for Stream {}

/// A raw event handle that may cross threads.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Event(pub(crate) sys::CUevent);
// SAFETY: CUDA event handles may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: as above.
unsafe impl Sync for Event {}

/// The CUDA events of one device's context that rdt made and no longer
/// uses, kept for its next record instead of destroyed (EP-1, EP-2).
///
/// Every NCCL transfer records a done event on each side, and a busy
/// stream's completion records one too: `cuEventCreate` and
/// `cuEventDestroy` each cost a driver call on the transfer's path (the
/// record after the group call, the free of a received tensor that held
/// the last reference). `RDT_EVENT_POOL=0` creates and destroys them
/// every time (a measurement knob).
///
/// * **EP-1 (reuse is safe):** an event goes back to the pool only when
///   its last holder dropped it. A wait another stream enqueued on it
///   (`cuStreamWaitEvent`) waits for the record made before that call,
///   not for a later one (CUDA's documented semantics), so recording it
///   again for another transfer changes no enqueued wait.
/// * **EP-2 (bounded):** at most [`POOLED_EVENTS`] are kept per device;
///   the rest are destroyed as before. The pool lives as long as its
///   `Gpu` (the process's), and so does the primary context its events
///   belong to.
pub(crate) struct EventPool {
    free: Mutex<Vec<Event>>,
}

/// EP-2's bound: more than a pass ever has in flight per device.
const POOLED_EVENTS: usize = 64;

static EVENTS_CREATED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many CUDA events rdt's completions and stream events created in
/// this process (not counting interprocess ones): with the pool on
/// (EP-1), one per event in use at once, not one per record. Tests use it
/// to prove events are reused.
pub fn events_created() -> u64 {
    EVENTS_CREATED.load(std::sync::atomic::Ordering::Relaxed)
}

impl EventPool {
    fn new() -> Self {
        EventPool {
            free: Mutex::new(Vec::new()),
        }
    }

    /// An event without timing, from the pool or new. The caller has
    /// bound the pool's context.
    fn take(&self) -> Result<Event, CudaError> {
        if let Some(e) = self.free.lock().pop() {
            return Ok(e);
        }
        EVENTS_CREATED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        cu::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map(Event)
            .map_err(|e| CudaError::call("cuEventCreate", e))
    }

    /// Takes back an event nobody holds any more (EP-1). The caller has
    /// bound the pool's context.
    fn give(&self, e: Event) {
        let mut free = self.free.lock();
        if free.len() < POOLED_EVENTS {
            free.push(e);
            return;
        }
        drop(free);
        // SAFETY: our event, unused from here on; destroying one still
        // pending is allowed (an enqueued wait on it is not cancelled).
        unsafe {
            let _ = cu::event::destroy(e.0);
        }
    }
}

/// An event recorded on another library's stream (see
/// `Tensor::produced_on_stream`), owned by rdt and given back to its
/// device's pool (or destroyed) once its last holder drops it.
pub struct StreamEvent {
    event: Event,
    ctx: Arc<CudaContext>,
    /// Where the event goes when dropped (EP-1).
    pool: Arc<EventPool>,
    /// Someone saw the GPU pass the event. It is recorded once, so that
    /// stays true; other holders then need not ask CUDA (a query cost
    /// 1.5 µs on the 2xH200 host, and a method waiting for a receive's
    /// bytes asked after the transfer thread had seen them land).
    seen_passed: std::sync::atomic::AtomicBool,
    /// A thread asks CUDA about this event until it passes (an NCCL
    /// transfer's landing watcher): other waiters read `seen_passed`
    /// instead of asking too (see [`StreamEvent::wait`]).
    watched: std::sync::atomic::AtomicBool,
}

impl StreamEvent {
    /// Has the GPU passed the event? (Without waiting.)
    pub fn passed(&self) -> Result<bool, CudaError> {
        if self.seen_passed.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(true);
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::call("cuCtxSetCurrent", e))?;
        // SAFETY: valid event of the bound context.
        match unsafe { sys::cuEventQuery(self.event.0) } {
            sys::CUresult::CUDA_SUCCESS => {
                self.seen_passed
                    .store(true, std::sync::atomic::Ordering::Release);
                Ok(true)
            }
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(CudaError::call("cuEventQuery", cu::DriverError(r))),
        }
    }

    /// Blocks the calling thread until the GPU passed the event (for a
    /// blocking pool's thread, never an executor's).
    pub fn synchronize(&self) -> Result<(), CudaError> {
        if self.seen_passed.load(std::sync::atomic::Ordering::Acquire) {
            return Ok(());
        }
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::call("cuCtxSetCurrent", e))?;
        // SAFETY: valid event of the bound context.
        unsafe { sys::cuEventSynchronize(self.event.0) }
            .result()
            .map_err(|e| CudaError::call("cuEventSynchronize", e))?;
        self.seen_passed
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// The caller asks CUDA about this event until it passes (and sets
    /// what [`passed`](Self::passed) saw): other waiters watch for that.
    pub(crate) fn watched_by_caller(&self) {
        self.watched
            .store(true, std::sync::atomic::Ordering::Release);
    }

    /// Waits until the GPU passed the event, without blocking the executor
    /// thread (as [`Completion::wait`]).
    ///
    /// An event another thread watches (an NCCL transfer's landing
    /// watcher) is waited for by reading what that thread saw, within the
    /// hot window, and asking CUDA only every 20 µs (in case the watcher
    /// stopped): two threads asking CUDA about one event each saw it
    /// several microseconds late (a query cost 1.5 µs on the 2xH200 host;
    /// a method waiting for a 4 KiB NCCL receive saw its bytes 3.8 µs after
    /// the transfer thread did).
    pub async fn wait(self: Arc<Self>) -> Result<(), CudaError> {
        use std::sync::atomic::Ordering::Acquire;
        if self.watched.load(Acquire) && !self.seen_passed.load(Acquire) {
            let window = crate::hot::window();
            let t0 = std::time::Instant::now();
            let mut asked = t0;
            let in_runtime = tokio::runtime::Handle::try_current().is_ok();
            while t0.elapsed() < window {
                // A moment of reading the flag between yields (a yield
                // costs a system call).
                let s0 = std::time::Instant::now();
                while s0.elapsed() < WATCHED_SPIN {
                    if self.seen_passed.load(Acquire) {
                        return Ok(());
                    }
                    std::hint::spin_loop();
                }
                if asked.elapsed() >= WATCHED_ASK {
                    if self.passed()? {
                        return Ok(());
                    }
                    asked = std::time::Instant::now();
                }
                if in_runtime {
                    tokio::task::yield_now().await;
                }
            }
        }
        wait_for_gpu(self, |e| e.passed(), |e| e.synchronize()).await
    }
}

/// How often a waiter for a watched event asks CUDA itself (see
/// [`StreamEvent::wait`]).
const WATCHED_ASK: std::time::Duration = std::time::Duration::from_micros(20);

/// How long a waiter for a watched event reads the flag between yields.
const WATCHED_SPIN: std::time::Duration = std::time::Duration::from_micros(1);

/// Waits until `passed(&on)` says yes, without blocking the executor
/// thread: asks at once; then, as a small transfer or kernel is usually
/// done within microseconds, asks again, yielding between asks, for a
/// bounded moment (within the hot window, crate::hot, for as long: a
/// wake-up after sleeping costs more than the spin) before paying a
/// hand-off to the blocking pool (tens of microseconds), where
/// `synchronize(on)` waits in the driver (contract point 5: never spin on
/// an executor thread for long).
async fn wait_for_gpu<T: Send + 'static>(
    on: T,
    passed: impl Fn(&T) -> Result<bool, CudaError>,
    synchronize: impl FnOnce(T) -> Result<(), CudaError> + Send + 'static,
) -> Result<(), CudaError> {
    if passed(&on)? {
        return Ok(());
    }
    let limit = SPIN_BEFORE_BLOCKING.max(crate::hot::window());
    let spin = std::time::Instant::now();
    while spin.elapsed() < limit {
        if tokio::runtime::Handle::try_current().is_ok() {
            tokio::task::yield_now().await;
        } else {
            std::hint::spin_loop();
        }
        if passed(&on)? {
            return Ok(());
        }
    }
    if tokio::runtime::Handle::try_current().is_err() {
        return synchronize(on);
    }
    tokio::task::spawn_blocking(move || synchronize(on))
        .await
        .map_err(|e| CudaError(format!("waiting for the GPU: {e}")))?
}

impl Drop for StreamEvent {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // A wait already enqueued on it is neither cancelled by its
            // destruction nor changed by its next record (EP-1).
            self.pool.give(self.event);
        }
    }
}

/// An interprocess event and its IPC handle.
#[derive(Clone, Copy)]
pub(crate) struct IpcEvent {
    pub(crate) event: Event,
    pub(crate) handle: [u8; 64],
}

/// Marks recorded at large frees and not yet seen passed, per device
/// (FM-3): a bound on events made for that, never reached in practice.
const MAX_PENDING_MARKS: usize = 64;

/// The free marks of one device (see the module docs, FM-1 and FM-2).
#[derive(Debug)]
pub struct FreeMarks {
    /// The number the next mark takes (starts at 1: a slab never freed
    /// into has mark 0 and is clean).
    next: std::sync::atomic::AtomicU64,
    /// Every free that read a number up to this one is behind rdt's stream.
    clean_upto: std::sync::atomic::AtomicU64,
}

impl FreeMarks {
    fn new() -> Self {
        FreeMarks {
            next: std::sync::atomic::AtomicU64::new(1),
            clean_upto: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The number a free made now reads (FM-1).
    pub(crate) fn current(&self) -> u64 {
        self.next.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Takes a mark: call before recording the event or querying the
    /// stream it stands for (FM-1).
    fn take(&self) -> u64 {
        self.next.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    }

    /// Mark `m` was seen passed (FM-2).
    fn passed(&self, m: u64) {
        self.clean_upto
            .fetch_max(m, std::sync::atomic::Ordering::SeqCst);
    }

    /// Is memory last freed when the current number was `freed` behind
    /// rdt's stream?
    pub(crate) fn clean(&self, freed: u64) -> bool {
        freed <= self.clean_upto.load(std::sync::atomic::Ordering::SeqCst)
    }
}

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
    ctx: Arc<CudaContext>,
    ordinal: usize,
    /// What memory freed on this device another stream may write (FM-1).
    marks: Arc<FreeMarks>,
    uuid: GpuUuid,
    stream: Stream,
    /// Interprocess events free for the next export (each export records
    /// one of its own, returned here when the object is released).
    ipc_events: Mutex<Vec<IpcEvent>>,
    /// Marks recorded at large frees while the stream was busy, oldest
    /// first, not yet seen passed (FM-3).
    pending_marks: Mutex<std::collections::VecDeque<Completion>>,
    /// rdt's kernels in this context (compiled and loaded on first use).
    kernels: OnceLock<Result<Arc<ops::Kernels>, CudaError>>,
    /// cuRAND generator on this stream (created on first use).
    generator: OnceLock<Result<Mutex<ops::Generator>, CudaError>>,
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

fn gpu_uuid(u: &sys::CUuuid) -> GpuUuid {
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
fn any_gpu_made() -> Option<Arc<Gpu>> {
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
        kernels: OnceLock::new(),
        generator: OnceLock::new(),
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
            crate::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "<unset>".into())
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

    /// rdt's kernels in this device's context, compiled (NVRTC) and loaded
    /// on first use.
    pub(crate) fn kernels(&self) -> Result<Arc<ops::Kernels>, CudaError> {
        self.kernels
            .get_or_init(|| ops::Kernels::load(self).map(Arc::new))
            .clone()
    }

    /// This device's cuRAND generator, created on first use.
    pub(crate) fn generator(&self) -> Result<&Mutex<ops::Generator>, CudaError> {
        self.generator
            .get_or_init(|| ops::Generator::new(self).map(Mutex::new))
            .as_ref()
            .map_err(Clone::clone)
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

    /// Bytes of device memory free now (`cuMemGetInfo`).
    pub(crate) fn free_bytes(&self) -> Result<usize, CudaError> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; the context is bound.
        unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) }
            .result()
            .map_err(|e| CudaError::call("cuMemGetInfo", e))?;
        Ok(free)
    }

    /// Allocates `len` bytes with `cuMemAlloc` (IPC-capable).
    pub(crate) fn malloc(&self, len: usize) -> Result<u64, CudaError> {
        self.bind()?;
        // SAFETY: plain allocation in the bound context.
        unsafe { cu::malloc_sync(len.max(1)) }
            .map_err(|e| CudaError::call(&format!("cuMemAlloc of {len} bytes on {}", self.uuid), e))
    }

    /// Enqueues a fill of `[ptr, ptr+len)` with the repeated `pattern`
    /// (1, 2, 4 or 8 bytes).
    pub(crate) fn fill(&self, ptr: u64, len: usize, pattern: &[u8]) -> Result<(), CudaError> {
        self.bind()?;
        let s = self.stream.0;
        // SAFETY: the caller owns `[ptr, ptr+len)` on this device; sizes are
        // whole elements of the pattern's size.
        let r = unsafe {
            match pattern.len() {
                1 => sys::cuMemsetD8Async(ptr, pattern[0], len, s),
                2 => sys::cuMemsetD16Async(
                    ptr,
                    u16::from_ne_bytes([pattern[0], pattern[1]]),
                    len / 2,
                    s,
                ),
                4 => sys::cuMemsetD32Async(
                    ptr,
                    u32::from_ne_bytes(pattern.try_into().expect("4 bytes")),
                    len / 4,
                    s,
                ),
                8 => {
                    let lo = u32::from_ne_bytes(pattern[..4].try_into().expect("4 bytes"));
                    let hi = u32::from_ne_bytes(pattern[4..].try_into().expect("4 bytes"));
                    let n = len / 8;
                    if n == 0 {
                        sys::CUresult::CUDA_SUCCESS
                    } else {
                        // Two strided fills: the low words, then the high.
                        let r = sys::cuMemsetD2D32Async(ptr, 8, lo, 1, n, s);
                        if r != sys::CUresult::CUDA_SUCCESS {
                            r
                        } else {
                            sys::cuMemsetD2D32Async(ptr + 4, 8, hi, 1, n, s)
                        }
                    }
                }
                n => return Err(CudaError(format!("no fill for {n}-byte elements"))),
            }
        };
        r.result().map_err(|e| CudaError::call("cuMemset", e))?;
        self.enqueued();
        Ok(())
    }

    /// Enqueues a host-to-device copy. Returns once `src` may be reused
    /// (CUDA stages pageable memory before returning).
    pub(crate) fn copy_htod(&self, dst: u64, src: &[u8]) -> Result<(), CudaError> {
        if src.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `dst` holds `src.len()` bytes on this device; pageable
        // sources are staged before the call returns, pinned pool buffers
        // are waited for below.
        unsafe { cu::memcpy_htod_async(dst, src, self.stream.0) }
            .map_err(|e| CudaError::call("cuMemcpyHtoDAsync", e))?;
        self.enqueued();
        // host_pool HP-4: the copy may still read a pinned buffer, which the
        // caller may hand back to the pool as soon as this returns.
        if crate::host_pool::is_pinned(src.as_ptr()) {
            self.synchronize()?;
        }
        Ok(())
    }

    /// Copies device bytes to the host, waiting for the copy (and for
    /// everything enqueued before it).
    pub(crate) fn copy_dtoh(&self, dst: &mut [u8], src: u64) -> Result<(), CudaError> {
        if dst.is_empty() {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: `src` holds `dst.len()` bytes; the sync below finishes the
        // copy before `dst` is used.
        unsafe { cu::memcpy_dtoh_async(dst, src, self.stream.0) }
            .map_err(|e| CudaError::call("cuMemcpyDtoHAsync", e))?;
        self.enqueued();
        self.synchronize()
    }

    /// Enqueues a copy of `len` device bytes at `src` to host memory at
    /// `dst`; [`synchronize`](Self::synchronize) waits for it. Pinned `dst`
    /// ([`pin_host`]) runs at copy-engine speed.
    ///
    /// # Safety
    /// `dst` is valid for `len` bytes of writes, and nothing else touches
    /// them until the copy is waited for.
    pub(crate) unsafe fn enqueue_dtoh(
        &self,
        dst: *mut u8,
        src: u64,
        len: usize,
    ) -> Result<(), CudaError> {
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller's promise for `dst`; `src` holds `len` bytes.
        unsafe { sys::cuMemcpyDtoHAsync_v2(dst.cast(), src, len, self.stream.0) }
            .result()
            .map_err(|e| CudaError::call("cuMemcpyDtoHAsync", e))?;
        self.enqueued();
        Ok(())
    }

    /// Enqueues a device-to-device copy (any devices this context can reach
    /// through unified addressing).
    pub fn copy_dtod(&self, dst: u64, src: u64, len: usize) -> Result<(), CudaError> {
        if len == 0 {
            return Ok(());
        }
        self.bind()?;
        // SAFETY: the caller guarantees both ranges.
        unsafe { cu::memcpy_dtod_async(dst, src, len, self.stream.0) }
            .map_err(|e| CudaError::call("cuMemcpyDtoDAsync", e))?;
        self.enqueued();
        Ok(())
    }
}

/// How long [`Completion::wait`] asks the GPU again before it waits on the
/// blocking pool: about the cost of that hand-off, so a short wait costs no
/// more than the hand-off would and a long one loses at most this much
/// CPU time.
pub const SPIN_BEFORE_BLOCKING: std::time::Duration = std::time::Duration::from_micros(30);

/// A future that resolves when the GPU has passed an event (see the module
/// docs for how it waits).
pub struct Completion {
    /// `None`: the stream was idle, nothing to wait for. Else the event
    /// and the pool it goes back to (EP-1).
    event: Option<(Event, Arc<EventPool>)>,
    /// The context the event was created in: bound before every query and
    /// at destruction, whatever thread polls (executors move futures).
    ctx: Arc<CudaContext>,
    /// The free mark the event stands for, told when seen passed (FM-2).
    mark: Option<(Arc<FreeMarks>, u64)>,
}

impl Completion {
    /// Waits without blocking the executor thread (see the module docs).
    pub async fn wait(self) -> Result<(), CudaError> {
        let Some(event) = self.event.as_ref().map(|e| e.0) else {
            return Ok(());
        };
        wait_for_gpu(self, move |c| c.query(event), move |c| c.synchronize(event)).await
    }

    /// Has the GPU passed the point this completion marks? (Without
    /// waiting; true when the stream was idle.)
    pub(crate) fn passed(&self) -> Result<bool, CudaError> {
        match &self.event {
            None => Ok(true),
            Some((ev, _)) => self.query(*ev),
        }
    }

    fn query(&self, event: Event) -> Result<bool, CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::call("cuCtxSetCurrent", e))?;
        // SAFETY: valid event of the bound context.
        match unsafe { sys::cuEventQuery(event.0) } {
            sys::CUresult::CUDA_SUCCESS => {
                self.seen_passed();
                Ok(true)
            }
            sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
            r => Err(CudaError::call("cuEventQuery", cu::DriverError(r))),
        }
    }

    /// Blocks the calling thread until the GPU has passed the event.
    fn synchronize(&self, event: Event) -> Result<(), CudaError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| CudaError::call("cuCtxSetCurrent", e))?;
        // SAFETY: valid event of the bound context.
        unsafe { sys::cuEventSynchronize(event.0) }
            .result()
            .map_err(|e| CudaError::call("cuEventSynchronize", e))?;
        self.seen_passed();
        Ok(())
    }

    /// The event passed: so did its free mark (FM-2).
    fn seen_passed(&self) {
        if let Some((marks, m)) = &self.mark {
            marks.passed(*m);
        }
    }
}

impl Drop for Completion {
    fn drop(&mut self) {
        if let Some((event, pool)) = self.event.take() {
            if self.ctx.bind_to_thread().is_ok() {
                // Pending or not (EP-1).
                pool.give(event);
            }
        }
    }
}

/// Device memory behind a CUDA tensor's storage: a range of an rdt slab
/// ([`alloc`]) or of a mapping another process exported ([`ipc`]).
///
/// # Safety
///
/// [`Tensor`](crate::Tensor)'s safe operations (copies, fills, transfers)
/// launch work on this memory through the address this gives, so an
/// implementation must make sure that:
/// - [`device_ptr`](Self::device_ptr) and [`len`](Self::len) describe one
///   range of `len` bytes of device memory, usable in the context of
///   [`gpu`](Self::gpu) (allocated in it, or mapped into it), from the
///   value's creation until it is dropped (both return the same every
///   time);
/// - the memory stays allocated until the value is dropped, and dropping
///   it frees the memory only after the work queued on it (on `gpu()`'s
///   stream) has finished.
pub unsafe trait DeviceBuffer: Send + Sync + 'static {
    /// Device address of the first byte.
    fn device_ptr(&self) -> u64;
    /// Number of bytes.
    fn len(&self) -> usize;
    /// Is it empty?
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The GPU (context and stream) ops on this memory run on.
    fn gpu(&self) -> &Arc<Gpu>;
    /// A short description for debugging.
    fn describe(&self) -> String;
    /// The concrete buffer, so that a transport can recognize its own.
    fn as_any(&self) -> &dyn std::any::Any;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// FM-1 and FM-2 as the allocator uses them (no GPU needed): memory
    /// is clean only once a mark taken after its free was seen passed;
    /// marks seen out of order still cover every free before them.
    #[test]
    fn free_marks_clean_only_what_a_later_mark_covers() {
        let m = FreeMarks::new();
        assert!(m.clean(0), "a slab never freed into is clean");
        let freed = m.current();
        assert!(!m.clean(freed), "freed, no mark since");
        let before = m.take();
        assert!(before >= freed, "a mark taken after the free covers it");
        let later_free = m.current();
        assert!(later_free > before);
        let after = m.take();
        // The later mark is seen first (another thread's completion).
        m.passed(after);
        assert!(m.clean(freed) && m.clean(later_free));
        m.passed(before);
        assert!(
            m.clean(later_free),
            "an older mark seen later undoes nothing"
        );
        assert!(
            !m.clean(m.current()),
            "a free after the last mark is not clean"
        );
    }

    #[test]
    fn no_gpu_is_an_error_not_a_panic() {
        // On a machine with a GPU this passes trivially; without one every
        // entry point must answer with an error that says why.
        if available().is_err() {
            let e = gpu(0).unwrap_err();
            assert!(e.0.contains("libcuda") || e.0.contains("device"), "{e}");
            assert_eq!(device_count(), 0);
            assert!(gpu_by_uuid(&GpuUuid::from_bytes([0xee; 16])).is_err());
        }
    }

    #[test]
    fn ops_without_a_gpu_are_errors_not_panics() {
        let e = crate::Tensor::zeros(crate::DType::F32, &[4])
            .uniform_(1)
            .unwrap_err();
        assert!(e.to_string().contains("CUDA tensors"), "{e}");
        if available().is_err() {
            // The optional libraries are never touched without a GPU.
            assert!(ops::nvrtc_available().is_err());
            assert!(ops::curand_available().is_err());
            let e = crate::Tensor::cuda_rand(crate::DType::F32, &[4], 0, 1).unwrap_err();
            assert!(e.to_string().contains("CUDA"), "{e}");
        }
    }

    #[test]
    fn uuid_format() {
        let u = sys::CUuuid {
            bytes: [1i8; 16].map(|c| c),
        };
        assert_eq!(
            gpu_uuid(&u).to_string(),
            "GPU-01010101-0101-0101-0101-010101010101"
        );
    }
}
