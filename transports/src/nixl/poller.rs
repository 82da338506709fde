//! One thread per process that drives every NIXL read to its end, and
//! sends the notices of finished reads.
//!
//! A read is posted by the task that needs it; its completion is a future
//! ([`Poller::watch`]) that this thread resolves. No executor thread spins
//! on NIXL: while reads are in flight the poller asks NIXL for their status
//! (yielding the CPU between asks within the hot window, then sleeping a
//! little longer each round, up to [`MAX_NAP`]); with none in flight it
//! sleeps until the next one is posted.
//!
//! A finished read's notice to its producer ([`Poller::notice`]) waits
//! here until this process's reads have been quiet for [`NOTICE_QUIET`]
//! (or the oldest has waited [`NOTICE_MAX_WAIT`]), and goes out as one
//! message per producer carrying the count. A notice is a UCX active
//! message that UCX sends at the next progress of the worker: sent after
//! each read, it went out inside the next read's post and wait, and a
//! 4 KiB host pass took 100-120 µs instead of 50-69 µs (one H100 host,
//! 2026-11-24, `bench_nixl --small-passes`). Sent here, it is driven out
//! at once, between bursts of reads.
//!
//! # Invariants
//! - **PL-1 (memory outlives the read):** a watched read owns what it reads
//!   into (`keep`) until NIXL has released its request, whether it
//!   completed, failed, or was abandoned; so an abandoned read (its future
//!   dropped at a deadline) never writes into freed memory.
//! - **PL-2 (abandoned reads are cancelled):** a read whose future was
//!   dropped is released (NIXL cancels it) at the next round; a release
//!   NIXL refuses for now is tried again every round.
//! - **PL-3 (notices leave between reads):** notices are sent only while
//!   no watched read is in flight and none ended for [`NOTICE_QUIET`], or
//!   once the oldest waited [`NOTICE_MAX_WAIT`]; each producer gets one
//!   message per flush with the number of reads it served.

use std::any::Any;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::agent::{Agent, Progress, Request};

/// The longest sleep between two rounds while reads are in flight.
const MAX_NAP: Duration = Duration::from_micros(500);

/// How long this process's reads must have been quiet before waiting
/// notices go out (PL-3): longer than the gap between back-to-back passes
/// (tens of microseconds) and a burst of reads of several objects.
pub(crate) const NOTICE_QUIET: Duration = Duration::from_millis(1);

/// The longest a notice waits for a quiet moment (PL-3): a process that
/// reads without pause still tells its producers, one message per
/// producer this often.
pub(crate) const NOTICE_MAX_WAIT: Duration = Duration::from_millis(100);

/// Finished reads not told yet.
#[derive(Default)]
struct Pending {
    /// Reads per producer agent.
    reads: HashMap<String, u64>,
    /// When the oldest of them ended.
    oldest: Option<Instant>,
    /// When the last ended.
    last: Option<Instant>,
}

/// Notices of finished reads not sent yet, per producer agent.
#[derive(Default)]
struct Notices {
    pending: parking_lot::Mutex<Pending>,
    /// The poller sleeps with no deadline: a new notice must wake it.
    parked: AtomicBool,
}

impl Notices {
    /// How long until the waiting notices go out (PL-3); `None` when none
    /// wait.
    fn due_in(&self, now: Instant) -> Option<Duration> {
        let p = self.pending.lock();
        let (oldest, last) = (p.oldest?, p.last?);
        let quiet = (last + NOTICE_QUIET).saturating_duration_since(now);
        let aged = (oldest + NOTICE_MAX_WAIT).saturating_duration_since(now);
        Some(quiet.min(aged))
    }

    /// One more read of `producer`'s memory ended `at`.
    fn add(&self, producer: &str, at: Instant) {
        let mut p = self.pending.lock();
        match p.reads.get_mut(producer) {
            Some(n) => *n += 1,
            None => {
                p.reads.insert(producer.to_string(), 1);
            }
        }
        p.oldest.get_or_insert(at);
        p.last = Some(at);
    }

    fn take(&self) -> HashMap<String, u64> {
        std::mem::take(&mut *self.pending.lock()).reads
    }
}

enum Msg {
    Watch(Watched),
    /// A notice is waiting and the poller slept with no deadline.
    Wake,
}

/// A read the poller drives.
struct Watched {
    req: Request,
    done: oneshot::Sender<Result<(), String>>,
    keep: Box<dyn Any + Send>,
}

/// A read whose future is gone, waiting for NIXL to release it (PL-2).
struct Abandoned {
    req: Request,
    _keep: Box<dyn Any + Send>,
}

/// The process's poller.
pub(crate) struct Poller {
    tx: parking_lot::Mutex<Sender<Msg>>,
    notices: Arc<Notices>,
}

impl Poller {
    /// The poller of this process for `agent`, started on first use.
    pub fn get(agent: &Arc<Agent>) -> &'static Poller {
        static P: OnceLock<Poller> = OnceLock::new();
        P.get_or_init(|| {
            let (tx, rx) = mpsc::channel();
            let agent = agent.clone();
            let notices = Arc::new(Notices::default());
            let n = notices.clone();
            std::thread::Builder::new()
                .name("rdt-nixl-poller".into())
                .spawn(move || run(agent, rx, n))
                .expect("spawning the NIXL poller thread");
            Poller {
                tx: parking_lot::Mutex::new(tx),
                notices,
            }
        })
    }

    /// Resolves when `req` ends; `keep` lives until NIXL released it
    /// (PL-1).
    pub fn watch(
        &self,
        req: Request,
        keep: Box<dyn Any + Send>,
    ) -> oneshot::Receiver<Result<(), String>> {
        let (done, rx) = oneshot::channel();
        // The thread never exits while the process lives (it owns the
        // receiver), so the send only fails at process exit.
        let _ = self.tx.lock().send(Msg::Watch(Watched { req, done, keep }));
        rx
    }

    /// Tells `producer` (an agent name), later (PL-3), that one more read
    /// of its memory ended.
    pub fn notice(&self, producer: &str) {
        self.notices.add(producer, Instant::now());
        if self.notices.parked.swap(false, Ordering::AcqRel) {
            let _ = self.tx.lock().send(Msg::Wake);
        }
    }
}

fn run(agent: Arc<Agent>, rx: Receiver<Msg>, notices: Arc<Notices>) {
    // Asking NIXL for a READ's status progresses UCX, whose CUDA
    // transports work in the calling thread's context.
    if crate::cuda::available().is_ok() {
        if let Ok(g) = crate::cuda::gpu(0) {
            let _ = g.bind();
        }
    }
    let mut live: Vec<Watched> = Vec::new();
    let mut abandoned: Vec<Abandoned> = Vec::new();
    let mut idle_since = Instant::now();
    let mut nap = Duration::from_micros(5);
    loop {
        if live.is_empty() && abandoned.is_empty() {
            // Idle: the notices' turn (PL-3).
            let got = match notices.due_in(Instant::now()) {
                Some(d) if d.is_zero() => {
                    super::send_notices(&agent, notices.take());
                    continue;
                }
                Some(d) => match rx.recv_timeout(d) {
                    Ok(m) => m,
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => return,
                },
                None => {
                    notices.parked.store(true, Ordering::Release);
                    // A notice that came before the flag was set did not
                    // wake us: look again.
                    if notices.due_in(Instant::now()).is_some() {
                        notices.parked.store(false, Ordering::Release);
                        continue;
                    }
                    match rx.recv() {
                        Ok(m) => m,
                        Err(_) => return,
                    }
                }
            };
            match got {
                Msg::Watch(w) => live.push(w),
                Msg::Wake => continue,
            }
            idle_since = Instant::now();
            nap = Duration::from_micros(5);
        }
        while let Ok(m) = rx.try_recv() {
            if let Msg::Watch(w) = m {
                live.push(w);
            }
        }
        let mut moved = false;
        let mut i = 0;
        while i < live.len() {
            if live[i].done.is_closed() {
                // PL-2: nobody waits for it any more.
                let w = live.swap_remove(i);
                abandoned.push(Abandoned {
                    req: w.req,
                    _keep: w.keep,
                });
                moved = true;
                continue;
            }
            let outcome = match agent.progress(&live[i].req) {
                Progress::Running => {
                    i += 1;
                    continue;
                }
                Progress::Done => Ok(()),
                Progress::Failed(e) => Err(e.0),
            };
            let w = live.swap_remove(i);
            moved = true;
            // Ended or failed: a kept request is posted again only after
            // it ended well.
            let ended = if outcome.is_ok() {
                agent.finish(w.req)
            } else {
                agent.release(w.req)
            };
            match ended {
                Ok(()) => {
                    // PL-1: the memory is handed over with the result.
                    let _ = w.done.send(outcome);
                    drop(w.keep);
                }
                Err(req) => {
                    let _ = w.done.send(outcome.and(Err(
                        "NIXL would not release a finished READ request".to_string(),
                    )));
                    abandoned.push(Abandoned { req, _keep: w.keep });
                }
            }
        }
        // PL-2: try the abandoned ones again.
        let mut j = 0;
        while j < abandoned.len() {
            let a = abandoned.swap_remove(j);
            match agent.release(a.req) {
                Ok(()) => moved = true,
                Err(req) => {
                    abandoned.push(Abandoned {
                        req,
                        _keep: a._keep,
                    });
                    let last = abandoned.len() - 1;
                    abandoned.swap(j, last);
                    j += 1;
                }
            }
        }
        if moved {
            idle_since = Instant::now();
            nap = Duration::from_micros(5);
        }
        if live.is_empty() && abandoned.is_empty() {
            continue;
        }
        if idle_since.elapsed() < crate::rt::hot::window() {
            std::thread::yield_now();
            continue;
        }
        match rx.recv_timeout(nap) {
            Ok(Msg::Watch(w)) => live.push(w),
            Ok(Msg::Wake) | Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        nap = (nap * 2).min(MAX_NAP);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn notices_wait_for_a_quiet_moment() {
        let n = Notices::default();
        let t0 = Instant::now();
        assert_eq!(n.due_in(t0), None, "nothing waits");
        n.add("p", t0);
        assert_eq!(n.due_in(t0), Some(NOTICE_QUIET));
        // Another read ends: the quiet starts again.
        let t1 = t0 + NOTICE_QUIET / 2;
        n.add("p", t1);
        n.add("q", t1);
        assert_eq!(n.due_in(t1), Some(NOTICE_QUIET));
        assert_eq!(n.due_in(t1 + NOTICE_QUIET), Some(Duration::ZERO));
        let sent = n.take();
        assert_eq!(sent, HashMap::from([("p".into(), 2), ("q".into(), 1)]));
        assert_eq!(n.due_in(t1), None, "all sent");
    }

    #[test]
    fn notices_of_endless_reads_go_out_at_the_longest_wait() {
        let n = Notices::default();
        let t0 = Instant::now();
        n.add("p", t0);
        // Reads every tenth of the quiet, never quiet long enough.
        let mut t = t0;
        while t < t0 + NOTICE_MAX_WAIT - NOTICE_QUIET {
            t += NOTICE_QUIET / 10;
            n.add("p", t);
        }
        let due = n.due_in(t).expect("waiting");
        assert_eq!(t + due, t0 + NOTICE_MAX_WAIT, "due when the oldest aged");
    }
}
