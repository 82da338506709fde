//! rdt's probes, as `tracing` events: a point of the timeline
//! ([`timeline`], target `rdt::timeline`) and a step of the CUDA layer
//! (`cuda_trace!`, target `rdt::cuda`), both at `TRACE`. Nothing is
//! recorded here: a subscriber that enables them sees them (`RUST_LOG=
//! rdt::cuda=trace`; the driver's `rdt::timeline` layer prints the
//! timeline), and one that does not pays one relaxed load per probe.
//! Building with `tracing`'s `max_level_debug` (or `release_max_level_*`)
//! features compiles them out.

/// A point of the timeline: `what` happened to `id` (a call, a transfer,
/// an object: the probe says which) now. A `tracing` event of target
/// `rdt::timeline` with fields `what` and `id`.
#[inline]
pub fn timeline(what: &'static str, id: u64) {
    tracing::trace!(target: "rdt::timeline", what, id);
}

/// A step of the CUDA layer (context bindings, IPC), as a `tracing`
/// event of target `rdt::cuda`.
macro_rules! cuda_trace {
    ($($arg:tt)*) => {
        ::tracing::trace!(target: "rdt::cuda", $($arg)*)
    };
}
pub(crate) use cuda_trace;
