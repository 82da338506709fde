//! Actors and helpers shared by rdt's multi-process integration tests.
//!
//! Every test binary links this crate, so the actor types below are
//! registered in each of them and worker processes can host them.

pub mod actors;
pub mod capture;
pub mod dlpack_cuda;
pub mod fault_soak;
pub mod weight_sync;

use std::future::Future;
use std::time::Duration;

/// Runs `f` with a deadline: a hang fails the test instead of stalling CI.
///
/// Two layers: a tokio timeout for hangs in async code, and a watchdog
/// thread that aborts the whole process (failing the run loudly) if even
/// that cannot fire, e.g. when a thread deadlocks the executor.
pub async fn deadline<F: Future>(secs: u64, f: F) -> F::Output {
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = done.clone();
    let watchdog = std::thread::spawn(move || {
        let end = std::time::Instant::now() + Duration::from_secs(secs + 10);
        while !flag.load(std::sync::atomic::Ordering::Acquire) {
            let now = std::time::Instant::now();
            if now >= end {
                eprintln!(
                    "test exceeded its {secs} s deadline and its executor is stuck; aborting"
                );
                std::process::abort();
            }
            std::thread::park_timeout(end - now);
        }
    });
    let out = tokio::time::timeout(Duration::from_secs(secs), f).await;
    done.store(true, std::sync::atomic::Ordering::Release);
    watchdog.thread().unpark();
    match out {
        Ok(v) => v,
        Err(_) => panic!("test exceeded its {secs} s deadline"),
    }
}

/// Yields to the executor until `cond` holds; fails the test (saying
/// `what` did not happen) after `secs` seconds. For moments a test must
/// act within, too short to poll with a sleep: a read just delivered, a
/// value just being forwarded.
pub async fn spin_until(what: &str, secs: u64, mut cond: impl FnMut() -> bool) {
    let end = std::time::Instant::now() + Duration::from_secs(secs);
    while !cond() {
        assert!(
            std::time::Instant::now() < end,
            "{what}: not within {secs} s"
        );
        tokio::task::yield_now().await;
    }
}

/// A producer and a consumer spawned in `rt`, in one `tcp` collective
/// group.
pub async fn tcp_pair(
    rt: &rdt::Runtime,
) -> (actors::ProducerHandle, actors::ConsumerHandle, rdt::GroupId) {
    let p = rt.spawn::<actors::Producer>(()).await.unwrap();
    let c = rt.spawn::<actors::Consumer>(()).await.unwrap();
    let g = rt
        .create_collective_group(&[p.id(), c.id()], rdt::Transport::Tcp)
        .await
        .unwrap();
    (p, c, g)
}

/// Installs a log subscriber once (respects `RUST_LOG`).
pub fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_test_writer()
        .try_init();
}

/// NX-11 over `passes` passes of one small object, from the consumer's
/// `nixl` counters before and after: one READ a pass, and every pass
/// after the first found its destination made ahead by the one before.
pub fn assert_destinations_made_ahead(
    before: &rdt::data::nixl::NixlStats,
    after: &rdt::data::nixl::NixlStats,
    passes: u64,
) {
    assert_eq!(after.reads_posted - before.reads_posted, passes);
    assert!(
        after.dests_made_ahead - before.dests_made_ahead >= passes - 1,
        "{before:?} -> {after:?}"
    );
    assert!(
        after.dests_taken_ready - before.dests_taken_ready >= passes - 1,
        "{before:?} -> {after:?}"
    );
}

/// Live (not zombie) child processes of this process, sorted.
pub fn children() -> Vec<u32> {
    let me = std::process::id().to_string();
    let mut out: Vec<u32> = std::fs::read_dir("/proc")
        .map(|d| {
            d.filter_map(|e| {
                let pid: u32 = e.ok()?.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
                let mut f = stat[stat.rfind(')')? + 2..].split(' ');
                let (state, ppid) = (f.next()?, f.next()?);
                (ppid == me && state != "Z").then_some(pid)
            })
            .collect()
        })
        .unwrap_or_default();
    out.sort_unstable();
    out
}
