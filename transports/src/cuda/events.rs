//! Streams and events: [`Event`], the [`EventPool`], [`StreamEvent`],
//! [`FreeMarks`] (FM-1, FM-2) and [`Completion`], and how a waiter waits
//! for the GPU without blocking the executor.

use super::*;

/// A raw stream handle that may cross threads (CUDA streams are
/// thread-safe).
#[derive(Clone, Copy, Debug)]
pub(super) struct Stream(pub(super) sys::CUstream);
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
/// the last reference).
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
    pub(super) fn new() -> Self {
        EventPool {
            free: Mutex::new(Vec::new()),
        }
    }

    /// An event without timing, from the pool or new. The caller has
    /// bound the pool's context.
    pub(super) fn take(&self) -> Result<Event, CudaError> {
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
    pub(super) fn give(&self, e: Event) {
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
    pub(super) event: Event,
    pub(super) ctx: Arc<CudaContext>,
    /// Where the event goes when dropped (EP-1).
    pub(super) pool: Arc<EventPool>,
    /// Someone saw the GPU pass the event. It is recorded once, so that
    /// stays true; other holders then need not ask CUDA (a query cost
    /// 1.5 µs on the 2xH200 host, and a method waiting for a receive's
    /// bytes asked after the transfer thread had seen them land).
    pub(super) seen_passed: std::sync::atomic::AtomicBool,
    /// A thread asks CUDA about this event until it passes (an NCCL
    /// transfer's landing watcher): other waiters read `seen_passed`
    /// instead of asking too (see [`StreamEvent::wait`]).
    pub(super) watched: std::sync::atomic::AtomicBool,
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
            let window = crate::rt::hot::window();
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
/// bounded moment (within the hot window, crate::rt::hot, for as long: a
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
    let limit = SPIN_BEFORE_BLOCKING.max(crate::rt::hot::window());
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
    pub(super) fn new() -> Self {
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
    pub(super) fn take(&self) -> u64 {
        self.next.fetch_add(1, std::sync::atomic::Ordering::SeqCst)
    }

    /// Mark `m` was seen passed (FM-2).
    pub(super) fn passed(&self, m: u64) {
        self.clean_upto
            .fetch_max(m, std::sync::atomic::Ordering::SeqCst);
    }

    /// Is memory last freed when the current number was `freed` behind
    /// rdt's stream?
    pub(crate) fn clean(&self, freed: u64) -> bool {
        freed <= self.clean_upto.load(std::sync::atomic::Ordering::SeqCst)
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
    pub(super) event: Option<(Event, Arc<EventPool>)>,
    /// The context the event was created in: bound before every query and
    /// at destruction, whatever thread polls (executors move futures).
    pub(super) ctx: Arc<CudaContext>,
    /// The free mark the event stands for, told when seen passed (FM-2).
    pub(super) mark: Option<(Arc<FreeMarks>, u64)>,
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
    pub(super) fn seen_passed(&self) {
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
