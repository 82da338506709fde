//! Worker processes: started from a reaper thread (invariant 1), killed through their pidfd, their exits described.

use super::*;

pub(super) struct Process {
    pub(super) pid: u32,
    pub(super) exit: watch::Receiver<Option<String>>,
    /// Signals go through this, never through `pid` (DR-2); dropped at
    /// death.
    pub(super) pidfd: Option<Arc<std::os::fd::OwnedFd>>,
    pub(super) _guard: Option<ChildGuard>,
}

/// Kills a worker process on drop (through its pidfd: a no-op once it was
/// reaped, whatever process has its pid by then).
pub(super) struct ChildGuard {
    pub(super) pidfd: Arc<std::os::fd::OwnedFd>,
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = pidfd_kill(&self.pidfd);
    }
}

/// DR-2: sends SIGKILL to the process `pidfd` refers to. A pidfd names one
/// process for good: once that process was reaped the call fails with
/// `ESRCH` instead of signalling whatever process reuses its pid.
pub(super) fn pidfd_kill(pidfd: &std::os::fd::OwnedFd) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall on a descriptor we own; no siginfo.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The pid, a pidfd and the exit notice of a worker started by
/// [`start_reaped`].
pub(super) type Reaped = (u32, std::os::fd::OwnedFd, watch::Receiver<Option<String>>);

/// Spawns `cmd` from a thread that then waits for it (DR-1). The pidfd is
/// opened before the reaper waits, so it names our child and nothing else
/// (DR-2).
///
/// SP-2: the start runs on the reaper's thread and this waits for it
/// without blocking its executor thread. A caller gone by then (its spawn
/// dropped) leaves the child to the reaper, which kills it.
pub(super) async fn start_reaped(mut cmd: std::process::Command) -> Result<Reaped> {
    let (tx, rx) = watch::channel(None);
    let (ptx, prx) = oneshot::channel();
    std::thread::Builder::new()
        .name("rdt-reaper".into())
        .spawn(move || {
            // Tests slow a process start down.
            #[cfg(feature = "failpoints")]
            fail::fail_point!("rdt::reaper_spawn");
            match cmd.spawn() {
                Err(e) => {
                    let _ = ptx.send(Err(e));
                }
                Ok(mut child) => {
                    let pid = child.id();
                    // SAFETY: plain syscall; `pid` is our unreaped child (only
                    // this thread waits for it, below), so it cannot name
                    // another process.
                    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
                    let opened = if fd < 0 {
                        Err(std::io::Error::last_os_error())
                    } else {
                        // SAFETY: a fresh descriptor that nothing else owns.
                        Ok(unsafe {
                            <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32)
                        })
                    };
                    let failed = opened.is_err();
                    // Nobody to take it (its spawn was dropped): nobody else
                    // would kill it.
                    let unwanted = ptx.send(opened.map(|fd| (pid, fd))).is_err();
                    if failed || unwanted {
                        let _ = child.kill();
                    }
                    let status = match child.wait() {
                        Ok(s) => describe_exit(s),
                        Err(e) => format!("could not be waited for ({e})"),
                    };
                    let _ = tx.send(Some(status));
                }
            }
        })?;
    // Dropped before it takes the started child (its spawn was dropped),
    // this kills it: before the reaper's answer, the reaper does (the
    // answer finds nobody); after it, the guard does, through its pidfd.
    struct Unclaimed(Option<oneshot::Receiver<std::io::Result<(u32, std::os::fd::OwnedFd)>>>);
    impl Drop for Unclaimed {
        fn drop(&mut self) {
            if let Some(mut rx) = self.0.take() {
                rx.close();
                if let Ok(Ok((_, fd))) = rx.try_recv() {
                    let _ = pidfd_kill(&fd);
                }
            }
        }
    }
    let mut unclaimed = Unclaimed(Some(prx));
    let answer = match unclaimed.0.as_mut() {
        Some(rx) => rx.await,
        None => unreachable!("set above"),
    };
    unclaimed.0 = None;
    let (pid, fd) = answer
        .map_err(|_| Error::Spawn("the reaper thread died".into()))?
        .map_err(|e| Error::Spawn(format!("could not start a worker process (spawn or pidfd_open): {e}; rdt needs Linux 5.3 or later")))?;
    Ok((pid, fd, rx))
}

pub(super) fn describe_exit(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended".to_string(),
    }
}
