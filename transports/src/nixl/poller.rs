//! One thread per process that drives every NIXL read to its end.
//!
//! A read is posted by the task that needs it; its completion is a future
//! ([`Poller::watch`]) that this thread resolves. No executor thread spins
//! on NIXL: while reads are in flight the poller asks NIXL for their status
//! (yielding the CPU between asks within the hot window, then sleeping a
//! little longer each round, up to [`MAX_NAP`]); with none in flight it
//! sleeps until the next one is posted.
//!
//! # Invariants
//! - **PL-1 (memory outlives the read):** a watched read owns what it reads
//!   into (`keep`) until NIXL has released its request, whether it
//!   completed, failed, or was abandoned; so an abandoned read (its future
//!   dropped at a deadline) never writes into freed memory.
//! - **PL-2 (abandoned reads are cancelled):** a read whose future was
//!   dropped is released (NIXL cancels it) at the next round; a release
//!   NIXL refuses for now is tried again every round.

use std::any::Any;
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::agent::{Agent, Progress, Request};

/// The longest sleep between two rounds while reads are in flight.
const MAX_NAP: Duration = Duration::from_micros(500);

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
    tx: parking_lot::Mutex<Sender<Watched>>,
}

impl Poller {
    /// The poller of this process for `agent`, started on first use.
    pub fn get(agent: &Arc<Agent>) -> &'static Poller {
        static P: OnceLock<Poller> = OnceLock::new();
        P.get_or_init(|| {
            let (tx, rx) = mpsc::channel();
            let agent = agent.clone();
            std::thread::Builder::new()
                .name("rdt-nixl-poller".into())
                .spawn(move || run(agent, rx))
                .expect("spawning the NIXL poller thread");
            Poller {
                tx: parking_lot::Mutex::new(tx),
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
        let _ = self.tx.lock().send(Watched { req, done, keep });
        rx
    }
}

fn run(agent: Arc<Agent>, rx: Receiver<Watched>) {
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
            match rx.recv() {
                Ok(w) => live.push(w),
                Err(_) => return,
            }
            idle_since = Instant::now();
            nap = Duration::from_micros(5);
        }
        while let Ok(w) = rx.try_recv() {
            live.push(w);
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
            match agent.release(w.req) {
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
        if idle_since.elapsed() < crate::hot::window() {
            std::thread::yield_now();
            continue;
        }
        match rx.recv_timeout(nap) {
            Ok(w) => live.push(w),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
        nap = (nap * 2).min(MAX_NAP);
    }
}
