//! The timeline: a `tracing` layer that records rdt's timeline points (the
//! `rdt::timeline` events of `rdt::data::trace::timeline`) with a clock
//! every process of a host shares, and prints them to standard error, one
//! line each: `[timeline] <µs>.<ns> pid <pid> tid <tid> <what> <id>`.
//! Merged and sorted, the lines of the driver and its workers show where a
//! call's or a transfer's time goes.
//!
//! A worker installs it when `RDT_TIMELINE` is set (not empty, not `0`);
//! the driver's program adds [`layer`] to its own subscriber:
//!
//! ```no_run
//! use tracing_subscriber::prelude::*;
//! tracing_subscriber::registry().with(rdt::timeline::layer()).init();
//! // ... the run ...
//! rdt::timeline::flush();
//! ```

use std::sync::OnceLock;

use parking_lot::Mutex;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::filter::{Filtered, Targets};
use tracing_subscriber::layer::{Context, Layer};

/// Points recorded and not printed yet: (ns, thread, what, id).
type Points = Mutex<Vec<(u64, u32, String, u64)>>;

/// The layer that records the timeline (see the module docs). Points are
/// printed every 20 ms by a thread of its own, and by [`flush`].
pub struct TimelineLayer(());

/// The timeline layer, with the filter that lets only the timeline's
/// events through to it.
pub fn layer<S>() -> Filtered<TimelineLayer, Targets, S>
where
    S: Subscriber,
{
    TimelineLayer(())
        .with_filter(Targets::new().with_target("rdt::timeline", tracing::Level::TRACE))
}

/// Prints the points recorded so far.
pub fn flush() {
    let Some(points) = POINTS.get() else { return };
    let points = std::mem::take(&mut *points.lock());
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

static POINTS: OnceLock<Points> = OnceLock::new();

fn points() -> &'static Points {
    POINTS.get_or_init(|| {
        let _ = std::thread::Builder::new()
            .name("rdt-timeline".into())
            .spawn(|| loop {
                std::thread::sleep(std::time::Duration::from_millis(20));
                flush();
            });
        Mutex::new(Vec::with_capacity(4096))
    })
}

/// CLOCK_MONOTONIC in nanoseconds: one clock for every process of a host.
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec to write; CLOCK_MONOTONIC exists on
    // Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

thread_local! {
    /// This thread's kernel id (what `perf` and `top -H` show).
    static TID: u32 = {
        // SAFETY: gettid has no preconditions.
        unsafe { libc::gettid() as u32 }
    };
}

#[derive(Default)]
struct Point {
    what: String,
    id: u64,
}

impl Visit for Point {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "what" {
            self.what = value.to_string();
        }
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        if field.name() == "id" {
            self.id = value;
        }
    }
    fn record_debug(&mut self, _field: &Field, _value: &dyn std::fmt::Debug) {}
}

impl<S: Subscriber> Layer<S> for TimelineLayer {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        let at = monotonic_ns();
        let mut p = Point::default();
        event.record(&mut p);
        let tid = TID.with(|t| *t);
        points().lock().push((at, tid, p.what, p.id));
    }
}
