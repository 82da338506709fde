//! Actors and helpers shared by rdt's multi-process integration tests.
//!
//! Every test binary links this crate, so the actor types below are
//! registered in each of them and worker processes can host them.

pub mod actors;

use std::future::Future;
use std::time::Duration;

/// Runs `f` with a deadline: a hang fails the test instead of stalling CI.
pub async fn deadline<F: Future>(secs: u64, f: F) -> F::Output {
    match tokio::time::timeout(Duration::from_secs(secs), f).await {
        Ok(v) => v,
        Err(_) => panic!("test exceeded its {secs} s deadline"),
    }
}

/// Installs a log subscriber once (respects `RUST_LOG`).
pub fn logs() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()))
        .with_test_writer()
        .try_init();
}
