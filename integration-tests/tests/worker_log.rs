//! How workers log (`RuntimeBuilder::worker_log`): through the subscriber
//! the driver's builder configures (filter, format, file), every line
//! naming its actor; at the default level a healthy run writes nothing and
//! a warning shows.

use rdt::prelude::*;
use rdt::WorkerLog;
use rdt_integration_tests::actors::Logger;
use rdt_integration_tests::capture::Spans;
use rdt_integration_tests::deadline;

/// A fresh path for a log in the system's temporary folder.
fn log_path(name: &str) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("rdt-{name}-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&p);
    p
}

#[tokio::test]
async fn a_workers_lines_go_where_its_log_says_each_naming_its_actor() {
    let path = log_path("worker-log-info");
    deadline(60, async {
        let rt = Runtime::builder()
            .worker_log(WorkerLog::new().filter("info").compact().file(&path))
            .start()
            .await
            .unwrap();
        let a = rt.spawn::<Logger>(()).await.unwrap();
        rt.get(a.info("hello from the actor".to_string()).remote())
            .await
            .unwrap();
        rt.shutdown().await;
        let text = std::fs::read_to_string(&path).expect("the worker wrote its log");
        let line = text
            .lines()
            .find(|l| l.contains("hello from the actor"))
            .unwrap_or_else(|| panic!("the actor's line in {}:\n{text}", path.display()));
        assert!(
            line.starts_with(&format!("{} ", a.raw().name())),
            "the line names its actor: {line}"
        );
        assert!(line.contains("INFO"), "{line}");
        assert!(
            !line.contains('\u{1b}'),
            "a log file has no colours: {line:?}"
        );
    })
    .await;
    let _ = std::fs::remove_file(&path);
}

#[tokio::test]
async fn at_the_default_level_a_healthy_worker_is_quiet_and_a_warning_shows() {
    let path = log_path("worker-log-default");
    deadline(60, async {
        // The default filter is the worker's RUST_LOG, else warn: the
        // workers of this test inherit none (the other test of this binary
        // names its filter).
        std::env::remove_var("RUST_LOG");
        let rt = Runtime::builder()
            .worker_log(WorkerLog::new().file(&path))
            .start()
            .await
            .unwrap();
        let a = rt.spawn::<Logger>(()).await.unwrap();
        rt.get(a.info("a healthy step".to_string()).remote())
            .await
            .unwrap();
        rt.get(a.warn("something to see".to_string()).remote())
            .await
            .unwrap();
        rt.shutdown().await;
        let text = std::fs::read_to_string(&path).expect("the worker wrote its log");
        assert!(!text.contains("a healthy step"), "{text}");
        let line = text
            .lines()
            .find(|l| l.contains("something to see"))
            .unwrap_or_else(|| panic!("the warning in {}:\n{text}", path.display()));
        assert!(line.starts_with(&format!("{} ", a.raw().name())), "{line}");
        assert!(line.contains("WARN"), "{line}");
    })
    .await;
    let _ = std::fs::remove_file(&path);
}

/// A call's trace crosses processes: the worker's `call` span names the
/// driver's (`caller_span`) and its trace, and a call an actor makes while
/// it runs one joins that trace, in the driver and in the callee's worker.
#[tokio::test]
async fn a_calls_trace_follows_it_into_the_workers_and_their_calls() {
    let spans = Spans::install();
    let path = std::env::temp_dir().join(format!("rdt-call-trace-{}.log", std::process::id()));
    let _ = std::fs::remove_file(&path);
    deadline(60, async {
        let rt = Runtime::builder()
            .worker_log(WorkerLog::new().filter("info").file(&path))
            .start()
            .await
            .unwrap();
        let a = rt.spawn::<Logger>(()).await.unwrap();
        let b = rt.spawn::<Logger>(()).await.unwrap();
        rt.get(a.relay(b.clone(), "traced line".to_string()).remote())
            .await
            .unwrap();
        rt.shutdown().await;

        let calls = spans.named("call");
        // This binary's other tests make calls too, seen by the same
        // subscriber: the relay is this test's alone, and the nested call
        // is the `info` made from inside it.
        let relay = (calls.iter())
            .find(|f| f.get("method").map(String::as_str) == Some("relay"))
            .unwrap_or_else(|| panic!("a driver call span for the relay: {calls:?}"))
            .clone();
        let info = (calls.iter())
            .find(|f| {
                f.get("method").map(String::as_str) == Some("info") && f.contains_key("caller_span")
            })
            .unwrap_or_else(|| panic!("a driver call span for the nested info: {calls:?}"))
            .clone();
        assert_eq!(
            relay["trace"], relay["call"],
            "a program's call starts a trace: {relay:?}"
        );
        assert!(!relay.contains_key("caller_span"), "{relay:?}");
        assert_eq!(
            info["trace"], relay["trace"],
            "the actor's call joins it: {info:?}"
        );
        let made_in_a: u64 = info["caller_span"].parse().unwrap();
        assert_ne!(made_in_a, 0, "the relay's span in its worker: {info:?}");

        let text = std::fs::read_to_string(&path).expect("the workers wrote their log");
        let line = |needle: &str| {
            text.lines()
                .find(|l| l.contains(needle))
                .unwrap_or_else(|| panic!("{needle:?} in {}:\n{text}", path.display()))
                .to_string()
        };
        let relaying = line("relaying");
        assert!(
            relaying.starts_with(&format!("{} ", a.raw().name())),
            "{relaying}"
        );
        assert!(
            relaying.contains(&format!("trace={}", relay["trace"]))
                && relaying.contains(&format!("caller_span={}", relay["span_id"])),
            "the relay's worker span is the child of the driver's: {relaying}\n{relay:?}"
        );
        let said = line("traced line");
        assert!(said.starts_with(&format!("{} ", b.raw().name())), "{said}");
        assert!(
            said.contains(&format!("trace={}", relay["trace"]))
                && said.contains(&format!("caller_span={}", info["span_id"])),
            "the nested call's worker span is the child of its driver span: {said}\n{info:?}"
        );
    })
    .await;
    let _ = std::fs::remove_file(&path);
}
