//! How workers log: a [`WorkerLog`] the driver's builder takes and sends
//! each worker in its spawn order (floor 0: plain data).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// How an actor's worker process logs (see
/// [`RuntimeBuilder::worker_log`](crate::RuntimeBuilder::worker_log)).
/// Every line a worker writes starts with its actor's name
/// (`Counter#1`), whichever thread wrote it.
///
/// The default: the worker's own `RUST_LOG` (inherited from the driver's
/// environment), else `warn`, the full format, to standard error. At
/// `warn` a failure is visible and a healthy run writes nothing.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerLog {
    pub(crate) filter: Option<String>,
    pub(crate) compact: bool,
    pub(crate) file: Option<PathBuf>,
}

impl WorkerLog {
    /// The default (see the type's docs).
    pub fn new() -> WorkerLog {
        WorkerLog::default()
    }

    /// What to log, as `RUST_LOG` says it (`"info"`,
    /// `"warn,rdt=debug"`): an [`EnvFilter`] directive. A directive the
    /// worker cannot parse is reported on its standard error, and the
    /// worker logs at `warn`.
    ///
    /// [`EnvFilter`]: tracing_subscriber::EnvFilter
    pub fn filter(mut self, directives: impl Into<String>) -> WorkerLog {
        self.filter = Some(directives.into());
        self
    }

    /// One line per event, its spans' fields shortened
    /// (`tracing_subscriber`'s compact format).
    pub fn compact(mut self) -> WorkerLog {
        self.compact = true;
        self
    }

    /// Appends to `path` instead of standard error (without colours). The
    /// workers of one runtime may share one file: each line names its
    /// actor. A file that cannot be opened is reported on the worker's
    /// standard error, which it then logs to.
    pub fn file(mut self, path: impl Into<PathBuf>) -> WorkerLog {
        self.file = Some(path.into());
        self
    }
}
