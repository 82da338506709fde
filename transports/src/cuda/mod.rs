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
//! more than that) or the hot window ([`crate::rt::hot`]) if that is longer;
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
//! by the [`cuda_ipc`](crate::cuda_ipc) transport without a copy.

use std::sync::{Arc, OnceLock};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::driver::CudaContext;
use parking_lot::Mutex;

pub mod alloc;
mod driver;
mod events;
mod gpu;
pub mod host_pool;
mod memory;
pub mod ops;
pub mod ordered_drop;

pub(crate) use crate::trace::cuda_trace;
pub use driver::{available, device_count, CudaError};
pub use events::{events_created, Completion, FreeMarks, StreamEvent, SPIN_BEFORE_BLOCKING};
pub(crate) use events::{Event, IpcEvent};
pub use gpu::{gpu, gpu_by_uuid, has_context, idle_known_count, ordinal_of, Gpu};
pub use memory::{pin_host, unpin_host, DeviceBuffer};

#[cfg(test)]
mod tests;
