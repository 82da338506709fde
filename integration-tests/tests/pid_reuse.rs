//! Defect 4 / DR-2: `kill` reaches the actor's process and nothing else.
//! A stored pid, once its process was reaped, may name another process;
//! the driver signals through a pidfd, which names one process for good.
//!
//! This file holds one test (its own binary), because it steers the
//! kernel's next pid (`/proc/sys/kernel/ns_last_pid`, root only) to make a
//! new process get the dead worker's pid, and other tests forking at the
//! same time would take it.

use std::time::Duration;

use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::deadline;

/// Starts `sleep` with the pid `pid`, if the kernel lets us: true if it
/// got it.
fn sleeper_with_pid(pid: u32) -> std::io::Result<Option<std::process::Child>> {
    for _ in 0..20 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())?;
        let mut child = std::process::Command::new("sleep").arg("60").spawn()?;
        if child.id() == pid {
            return Ok(Some(child));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
    Ok(None)
}

#[tokio::test]
async fn dr_2_kill_never_signals_a_reused_pid() {
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let pid = p.pid().unwrap();
        p.kill();
        assert_eq!(p.raw().exited().await.unwrap(), "was killed by signal 9");
        let mut stranger = match sleeper_with_pid(pid) {
            Ok(Some(c)) => c,
            Ok(None) => panic!("could not start a process with pid {pid} (20 tries)"),
            Err(e) => panic!(
                "this test steers pids through /proc/sys/kernel/ns_last_pid and needs root: {e}"
            ),
        };
        // The handle still names the dead worker: neither kill nor the
        // runtime's drop may touch the process that now has its pid.
        p.kill();
        rt.shutdown().await;
        drop(p);
        drop(rt);
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(
            stranger.try_wait().unwrap().is_none(),
            "a process that reused the dead worker's pid was signalled"
        );
        stranger.kill().unwrap();
        stranger.wait().unwrap();
    })
    .await;
}
