//! Captures `tracing` events for assertions (the mutability warning).

use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::Layer;

/// Messages of captured warnings.
#[derive(Clone, Default)]
pub struct Captured(Arc<Mutex<Vec<String>>>);

impl Captured {
    /// The messages so far.
    pub fn messages(&self) -> Vec<String> {
        self.0.lock().unwrap().clone()
    }
}

struct Grab(Captured);

struct Msg(String);
impl Visit for Msg {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        }
    }
}

impl<S: Subscriber> Layer<S> for Grab {
    fn on_event(&self, event: &Event<'_>, _ctx: Context<'_, S>) {
        if *event.metadata().level() <= tracing::Level::WARN {
            let mut m = Msg(String::new());
            event.record(&mut m);
            self.0 .0.lock().unwrap().push(m.0);
        }
    }
}

/// Captures warnings emitted on this thread until the guard drops.
pub fn warnings_on_this_thread() -> (Captured, tracing::subscriber::DefaultGuard) {
    let c = Captured::default();
    let sub = tracing_subscriber::registry().with(Grab(c.clone()));
    let guard = tracing::subscriber::set_default(sub);
    (c, guard)
}
