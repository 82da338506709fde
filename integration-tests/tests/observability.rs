//! What a program's own subscriber and recorder see of the driver: a
//! `call` span per call and a `transfer` span per transfer, with their
//! fields, and the driver's counters, through `tracing` and the `metrics`
//! facade, and in `Runtime::metrics()`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};
use rdt::prelude::*;
use rdt_integration_tests::capture::Spans;
use rdt_integration_tests::deadline;

/// Counters by name and labels (`name{k=v,...}`).
#[derive(Default, Clone)]
struct Counters(Arc<Mutex<HashMap<String, Arc<AtomicU64>>>>);

impl Counters {
    fn get(&self, key: &str) -> u64 {
        (self.0.lock().unwrap().get(key)).map_or(0, |c| c.load(Ordering::SeqCst))
    }
}

impl Recorder for Counters {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let c = self.0.lock().unwrap().entry(name).or_default().clone();
        Counter::from_arc(c)
    }

    fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
        Gauge::noop()
    }

    /// A histogram counts its samples under its name and labels, like a
    /// counter.
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        Histogram::from_arc(Arc::new(Samples(
            self.register_counter(key, &Metadata::new("", metrics::Level::INFO, None)),
        )))
    }
}

/// Counts a histogram's samples.
struct Samples(Counter);

impl metrics::HistogramFn for Samples {
    fn record(&self, _: f64) {
        self.0.increment(1);
    }
}

#[tokio::test]
async fn a_pass_is_seen_as_spans_and_counted() {
    let spans = Spans::install();
    let counters = Counters::default();
    metrics::set_global_recorder(counters.clone()).expect("the test's recorder");
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let (p, c, g) = rdt_integration_tests::tcp_pair(&rt).await;
        let n = 1 << 18;
        let r = p.make(1.0, n).transport(Transport::Tcp).remote();
        assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), n as f64);
        drop(r);
        rt.transfers_settled().await;

        let calls = spans.named("call");
        let sum = calls
            .iter()
            .find(|f| f.get("method").map(String::as_str) == Some("sum"))
            .unwrap_or_else(|| panic!("a call span for the sum: {calls:?}"));
        assert!(sum["actor"].starts_with("Consumer"), "{sum:?}");
        assert!(
            sum.contains_key("call") && sum.contains_key("result"),
            "{sum:?}"
        );
        assert_eq!(
            sum.get("outcome").map(String::as_str),
            Some("ok"),
            "{sum:?}"
        );

        let transfers = spans.named("transfer");
        let t = transfers
            .iter()
            .find(|f| f.get("transport").map(String::as_str) == Some("tcp"))
            .unwrap_or_else(|| panic!("a transfer span over tcp: {transfers:?}"));
        assert_eq!(t["bytes"], (4 * n).to_string(), "{t:?}");
        assert_eq!(t["tensors"], "1", "{t:?}");
        assert_eq!(t["descriptors"], "1", "{t:?}");
        assert_eq!(t["warm"], "false", "the first between the two: {t:?}");
        assert!(t["producer"].starts_with("Producer"), "{t:?}");
        assert!(t["consumer"].starts_with("Consumer"), "{t:?}");
        assert!(t.contains_key("xfer") && t.contains_key("object"), "{t:?}");
        assert_eq!(t.get("outcome").map(String::as_str), Some("done"), "{t:?}");

        let m = rt.metrics();
        let tcp = m.transport("tcp");
        assert_eq!(tcp.transfers, 1, "{m:?}");
        assert_eq!(tcp.bytes, 4 * n as u64, "{m:?}");
        assert_eq!((tcp.tensors, tcp.failed, tcp.aborted), (1, 0, 0), "{m:?}");
        assert!(tcp.time > std::time::Duration::ZERO, "{m:?}");
        assert!(m.calls_ok >= 2, "the make and the sum: {m:?}");
        assert_eq!(
            counters.get("rdt_transfers{outcome=done,transport=tcp}"),
            1,
            "the recorder saw the transfer"
        );
        assert_eq!(counters.get("rdt_rx_bytes{transport=tcp}"), 4 * n as u64);
        assert_eq!(counters.get("rdt_calls{outcome=ok}"), m.calls_ok);
        assert_eq!(counters.get("rdt_descriptors{transport=tcp}"), 1);
        assert_eq!(
            counters.get("rdt_xfer_time{transport=tcp}"),
            1,
            "one sample of the transfer's time"
        );

        // The next transfer between the two is warm.
        let r = p.make(2.0, n).transport(Transport::Tcp).remote();
        assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 2.0 * n as f64);
        drop(r);
        rt.transfers_settled().await;
        let mut tcp_spans: Vec<_> = (spans.named("transfer").into_iter())
            .filter(|f| f.get("transport").map(String::as_str) == Some("tcp"))
            .collect();
        tcp_spans.sort_by_key(|f| f["xfer"].parse::<u64>().unwrap());
        let warmth: Vec<&str> = tcp_spans.iter().map(|f| f["warm"].as_str()).collect();
        assert_eq!(warmth, ["false", "true"], "{tcp_spans:?}");

        // A span per spawn, group operation and death.
        let spawns = spans.named("spawn");
        for who in ["Producer", "Consumer"] {
            let s = spawns
                .iter()
                .find(|f| f.get("actor_type").map(String::as_str) == Some(who))
                .unwrap_or_else(|| panic!("a spawn span for the {who}: {spawns:?}"));
            assert!(s["actor"].starts_with(who), "{s:?}");
            assert_eq!(s.get("outcome").map(String::as_str), Some("ok"), "{s:?}");
        }
        let groups = spans.named("group");
        let made = groups
            .iter()
            .find(|f| f.get("op").map(String::as_str) == Some("create"))
            .unwrap_or_else(|| panic!("a group span: {groups:?}"));
        assert_eq!(made["backend"], "tcp", "{made:?}");
        assert_eq!(made["members"], "2", "{made:?}");
        assert_eq!(made["group"], g.0.to_string(), "{made:?}");
        assert_eq!(
            made.get("outcome").map(String::as_str),
            Some("ok"),
            "{made:?}"
        );
        p.raw().kill();
        p.raw().exited().await.unwrap();
        let deaths = spans.named("death");
        let d = deaths
            .iter()
            .find(|f| f.get("actor") == Some(&p.id().0.to_string()))
            .unwrap_or_else(|| panic!("a death span for the producer: {deaths:?}"));
        assert!(d["cause"].contains("killed"), "{d:?}");
    })
    .await
}
