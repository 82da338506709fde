//! rdt's timeline points are `tracing` events (target `rdt::timeline`,
//! fields `what` and `id`): a program's own subscriber sees them when it
//! enables that target, and the `rdt::timeline` layer records them.

use std::sync::{Arc, Mutex};

use rdt::prelude::*;
use rdt_integration_tests::actors::Logger;
use rdt_integration_tests::deadline;
use tracing::field::{Field, Visit};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::{Context, Layer};
use tracing_subscriber::prelude::*;

/// The `what` of every timeline event seen.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<(String, u64)>>>);

#[derive(Default)]
struct Point(String, u64);

impl Visit for Point {
    fn record_str(&mut self, f: &Field, v: &str) {
        if f.name() == "what" {
            self.0 = v.to_string();
        }
    }
    fn record_u64(&mut self, f: &Field, v: u64) {
        if f.name() == "id" {
            self.1 = v;
        }
    }
    fn record_debug(&mut self, _: &Field, _: &dyn std::fmt::Debug) {}
}

impl<S: tracing::Subscriber> Layer<S> for Seen {
    fn on_event(&self, e: &tracing::Event<'_>, _: Context<'_, S>) {
        let mut p = Point::default();
        e.record(&mut p);
        self.0.lock().unwrap().push((p.0, p.1));
    }
}

#[tokio::test]
async fn a_call_leaves_timeline_events_that_a_subscriber_sees() {
    let seen = Seen::default();
    tracing_subscriber::registry()
        .with(
            seen.clone()
                .with_filter(Targets::new().with_target("rdt::timeline", tracing::Level::TRACE)),
        )
        .with(rdt::timeline::layer())
        .init();
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let a = rt.spawn::<Logger>(()).await.unwrap();
        let r = a.info("a step".to_string()).remote();
        rt.get(&r).await.unwrap();
        let seen = seen.0.lock().unwrap().clone();
        let pending = seen
            .iter()
            .find(|(what, _)| what == "driver call pending")
            .unwrap_or_else(|| panic!("the driver's submit point among {seen:?}"));
        assert!(pending.1 > 0, "it names the call: {pending:?}");
        assert!(
            seen.iter().any(|(what, _)| what == "driver submitted"),
            "{seen:?}"
        );
        rdt::timeline::flush();
    })
    .await;
}
