//! The worker's subscriber: installed at boot with the default (the
//! worker's `RUST_LOG`, else `warn`, to standard error), then reloaded with
//! the spawn order's [`WorkerLog`]. Every line starts with the actor's
//! name, whichever thread wrote it. With `RDT_TIMELINE` set, the
//! timeline layer records beside it (`rdt::timeline`).

use std::fs::OpenOptions;
use std::sync::{Arc, Mutex, OnceLock};

use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::{self, FormatEvent, FormatFields};
use tracing_subscriber::fmt::writer::BoxMakeWriter;
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::layer::{Layer, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{fmt, reload, EnvFilter, Registry};

use crate::log::WorkerLog;

type Output = Box<dyn Layer<Registry> + Send + Sync>;

struct Handles {
    filter: reload::Handle<EnvFilter, Registry>,
    output: reload::Handle<Output, Registry>,
}

static HANDLES: OnceLock<Handles> = OnceLock::new();

/// Installs the worker's subscriber with the default settings; lines are
/// named `name` until [`configure`] names the actor. Does nothing if the
/// process has a subscriber already.
pub(super) fn install(name: &str) {
    let default = WorkerLog::default();
    let (filter, filter_handle) = reload::Layer::new(filter_of(&default, name));
    let (output, output_handle) = reload::Layer::new(output_of(&default, name.into()));
    // The filter is the output's own, so that the timeline (`RDT_TIMELINE`)
    // sees its events whatever the log's level.
    let installed = tracing_subscriber::registry()
        .with(output.with_filter(filter))
        .with(crate::env::timeline().then(crate::timeline::layer))
        .try_init()
        .is_ok();
    if installed {
        let _ = HANDLES.set(Handles {
            filter: filter_handle,
            output: output_handle,
        });
    }
}

/// Applies the spawn order's settings, lines named after the actor.
pub(super) fn configure(log: &WorkerLog, actor: &str) {
    let Some(h) = HANDLES.get() else { return };
    let _ = h.output.reload(output_of(log, actor.into()));
    let _ = h.filter.reload(filter_of(log, actor));
}

fn filter_of(log: &WorkerLog, name: &str) -> EnvFilter {
    match &log.filter {
        Some(d) => EnvFilter::try_new(d).unwrap_or_else(|e| {
            eprintln!("{name}: the worker log filter {d:?} does not parse ({e}); logging at warn");
            EnvFilter::new("warn")
        }),
        None => EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn")),
    }
}

fn output_of(log: &WorkerLog, name: Arc<str>) -> Output {
    let file = log.file.as_ref().and_then(|p| {
        match OpenOptions::new().create(true).append(true).open(p) {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!(
                    "{name}: cannot open the worker log {}: {e}; logging to standard error",
                    p.display()
                );
                None
            }
        }
    });
    // A file gets no colours; standard error keeps the default.
    let ansi = file.is_none();
    let writer = match file {
        Some(f) => BoxMakeWriter::new(Mutex::new(f)),
        None => BoxMakeWriter::new(std::io::stderr),
    };
    let layer = fmt::layer().with_ansi(ansi).with_writer(writer);
    if log.compact {
        layer
            .event_format(Named {
                name,
                inner: format::Format::default().compact(),
            })
            .boxed()
    } else {
        layer
            .event_format(Named {
                name,
                inner: format::Format::default(),
            })
            .boxed()
    }
}

/// A format whose lines start with the actor's name.
struct Named<F> {
    name: Arc<str>,
    inner: F,
}

impl<S, N, F> FormatEvent<S, N> for Named<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: format::Writer<'_>,
        event: &Event<'_>,
    ) -> std::fmt::Result {
        write!(writer, "{} ", self.name)?;
        self.inner.format_event(ctx, writer, event)
    }
}
