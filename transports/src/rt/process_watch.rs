//! Watching a peer process for its exit without a path lookup: a pidfd
//! (Linux 5.3+), asked with a zero-timeout `poll`.
//!
//! # Why
//! A consumer of `cuda_ipc` checks, at every receive, that the producer
//! process is still alive (a dead producer's memory is gone: its tensors
//! must be a clear error, never a read of freed memory). Checking through
//! `/proc/<pid>/fd/<fd>` walks procfs on every receive, which cost a few
//! microseconds of a 4 KiB hand-off's budget on the GPU hosts. A pidfd
//! refers to one process for good (a reused pid is another process), and
//! asking it costs one system call that touches no path.
//!
//! Where pidfds are missing (an older kernel, a seccomp filter), [`watch`]
//! says so and callers keep their `/proc` check.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A handle on one process that says whether it has exited.
#[derive(Debug)]
pub(crate) struct ProcessWatch(OwnedFd);

/// Watches process `pid` (of this pid namespace). `None` where the kernel
/// gives no pidfd (the caller then checks through `/proc`), or where no
/// process `pid` exists.
///
/// The pidfd names whatever process has `pid` now: a caller that must know
/// it is a particular process opens the watch first and then checks that
/// process's identity (a reused pid fails that check; the watch then
/// refers to the wrong process, and is dropped with the check's error).
pub(crate) fn watch(pid: u32) -> Option<ProcessWatch> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor
    // or -1; no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return None;
    }
    // SAFETY: a fresh descriptor that nothing else owns.
    Some(ProcessWatch(unsafe { OwnedFd::from_raw_fd(fd as i32) }))
}

impl ProcessWatch {
    /// Has the process exited (a zombie has: its memory is gone)?
    pub(crate) fn exited(&self) -> bool {
        let mut p = libc::pollfd {
            fd: self.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        let n = unsafe { libc::poll(&mut p, 1, 0) };
        // A pidfd is readable once its process has exited. An error of
        // poll itself is taken as an exit: the caller then reports the
        // producer gone rather than reading memory it cannot vouch for.
        n != 0 && (n < 0 || p.revents & (libc::POLLIN | libc::POLLERR | libc::POLLNVAL) != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_child_is_alive_until_it_exits() {
        let Some(me) = watch(std::process::id()) else {
            eprintln!("skipped: no pidfd on this kernel");
            return;
        };
        assert!(!me.exited(), "this process is alive");
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("spawn sleep");
        let w = watch(child.id()).expect("a pidfd for a live child");
        assert!(!w.exited(), "the child was just started");
        child.kill().expect("kill");
        // The child is a zombie until reaped: it has exited all the same.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let mut p = libc::pollfd {
            fd: w.0.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd; waits up to 10 s for the exit.
        let n = unsafe { libc::poll(&mut p, 1, 10_000) };
        assert!(
            n == 1 && std::time::Instant::now() < deadline,
            "no exit seen"
        );
        assert!(w.exited(), "the killed child has exited");
        child.wait().expect("reap");
        assert!(w.exited(), "and stays exited once reaped");
    }

    #[test]
    fn no_such_process_gives_no_watch() {
        // Pids above the kernel's maximum (4194304) never exist.
        assert!(watch(0x7fff_fff0).is_none());
    }
}
