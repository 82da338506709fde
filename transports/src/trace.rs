//! The timeline (`RDT_TIMELINE`) and the CUDA trace (`RDT_CUDA_TRACE`):
//! debugging aids that print what happened, and when, on a clock that every
//! process of a host shares. Reached as `rdt_transport::cuda::{timeline,
//! timeline_flush, ...}`, their old paths.

use std::sync::OnceLock;

/// Is `RDT_CUDA_TRACE` set (non-empty, not `0`)? Then every context
/// binding and IPC step of this process is printed to stderr with the
/// calling thread's name (a debugging aid for multi-GPU set-ups).
pub fn tracing_enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| crate::env::diagnostic("RDT_CUDA_TRACE"))
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
    *ON.get_or_init(|| crate::env::diagnostic("RDT_TIMELINE"))
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
        if $crate::trace::tracing_enabled() {
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
