//! Captures `tracing` events (the mutability warning) and spans, for
//! assertions.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tracing::field::{Field, Visit};
use tracing::span::{Attributes, Id, Record};
use tracing::{Event, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::util::SubscriberInitExt;
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

/// A span's fields, by name, as text.
pub type FieldValues = HashMap<String, String>;

/// Each span's name and fields (its id as `span_id` among them), by id.
#[derive(Default, Clone)]
pub struct Spans(Arc<Mutex<HashMap<u64, (String, FieldValues)>>>);

struct Fields<'a>(&'a mut FieldValues);

impl Visit for Fields<'_> {
    fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
        self.0.insert(
            field.name().to_string(),
            format!("{value:?}").trim_matches('"').to_string(),
        );
    }

    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().to_string(), value.to_string());
    }
}

impl<S: tracing::Subscriber> Layer<S> for Spans {
    fn on_new_span(&self, attrs: &Attributes<'_>, id: &Id, _: Context<'_, S>) {
        let mut fields = HashMap::new();
        attrs.record(&mut Fields(&mut fields));
        fields.insert("span_id".to_string(), id.into_u64().to_string());
        self.0
            .lock()
            .unwrap()
            .insert(id.into_u64(), (attrs.metadata().name().to_string(), fields));
    }

    fn on_record(&self, id: &Id, values: &Record<'_>, _: Context<'_, S>) {
        if let Some((_, fields)) = self.0.lock().unwrap().get_mut(&id.into_u64()) {
            values.record(&mut Fields(fields));
        }
    }
}

impl Spans {
    /// Installs a global subscriber that records every span at `info` and
    /// above (once per process; later calls return the same record).
    pub fn install() -> Spans {
        static SPANS: std::sync::OnceLock<Spans> = std::sync::OnceLock::new();
        SPANS
            .get_or_init(|| {
                let spans = Spans::default();
                tracing_subscriber::registry()
                    .with(
                        spans
                            .clone()
                            .with_filter(tracing_subscriber::filter::LevelFilter::INFO),
                    )
                    .init();
                spans
            })
            .clone()
    }

    /// The fields of every span named `name`.
    pub fn named(&self, name: &str) -> Vec<FieldValues> {
        (self.0.lock().unwrap().values())
            .filter(|(n, _)| n == name)
            .map(|(_, f)| f.clone())
            .collect()
    }
}
