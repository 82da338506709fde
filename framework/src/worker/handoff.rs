//! How a call crosses from the control loop to the actor's thread.
//!
//! The plain way is the actor's mailbox (`Addr::try_send`). Its wake-up
//! is a system call on the control loop: the actor's thread runs a
//! current-thread runtime with I/O (actix), and a task of it woken from
//! another thread writes that runtime's eventfd. On a 4 KiB `nixl` pass
//! that write sits on the pass's path: the control loop hands the call
//! over, then posts the READ the call waits for.
//!
//! After each call the actor's thread stays awake for the hot window
//! (`rdt_transport::hot`), polling. While it does, it *listens*: the
//! control loop puts the next call in a queue here and wakes nobody, and
//! the listener, on the actor's thread, moves it into the mailbox (a wake
//! within one thread is a queue push, no system call).
//!
//! Invariants:
//! * **HF-1 (order):** calls reach the mailbox in the order the control
//!   loop read them. Every decision is made under the hand-off's lock: a
//!   call is queued only while a listener is registered, and the last
//!   listener to leave moves what is queued into the mailbox in the same
//!   critical section in which it unregisters. So a call the control loop
//!   then sends straight (no listener) comes after them; queued calls are
//!   moved in queue order, all on the actor's one thread.
//! * **HF-2 (nothing stranded):** a queued call is moved by a listener
//!   still registered, at the latest when it leaves (the window ends, or
//!   it moved a call).
//! * **HF-3 (the mailbox's limit):** a call moved by a listener goes
//!   through `try_send` as a straight one does; a full or closed mailbox
//!   fails the call at once with the same `CallDone`.
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Addr;
use parking_lot::Mutex;

use super::host::{Host, Invoke};
use super::WorkerShared;
use crate::actor::Actor as RdtActor;
use crate::error::Error;
use crate::protocol::{CallMsg, ToDriver};
use rdt_transport::Sidedness;

/// Calls on their way to a listening actor's thread.
#[derive(Default)]
pub(super) struct HandOff {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Calls read while a listener was registered, oldest first (HF-1).
    calls: VecDeque<CallMsg>,
    /// Listeners registered now (one per call that ended within the
    /// window; on a concurrent actor, several).
    listeners: u32,
    /// Calls the control loop has handed on so far, either way: a
    /// listener ends once one came.
    arrived: u64,
    /// Of those, the calls queued for a listener.
    queued: u64,
}

impl HandOff {
    /// How many calls went to the actor's thread through the queue (for
    /// tests, which prove the path ran).
    pub(super) fn queued(&self) -> u64 {
        self.state.lock().queued
    }
}

/// The control loop's side: `call` to the actor, queued for its listener
/// when one is registered, else through the mailbox.
pub(super) fn hand_over<A: RdtActor>(shared: &WorkerShared, addr: &Addr<Host<A>>, call: CallMsg) {
    let mut s = shared.handoff.state.lock();
    s.arrived += 1;
    if s.listeners > 0 {
        s.calls.push_back(call);
        s.queued += 1;
        return;
    }
    drop(s);
    invoke(shared, addr, call);
}

/// The mailbox, or the call's failure if it refuses (HF-3).
fn invoke<A: RdtActor>(shared: &WorkerShared, addr: &Addr<Host<A>>, call: CallMsg) {
    let id = call.call;
    let result = call.result;
    let straight = call.transport.sidedness() != Sidedness::TwoSided;
    if let Err(e) = addr.try_send(Invoke(call)) {
        if straight {
            shared.peer.close_call(result);
        }
        let why = e.to_string();
        // WK-13: it ends here, having taken nothing.
        let Invoke(call) = e.into_inner();
        let refs: Vec<u64> = call.ref_args().collect();
        let _ = shared.uses_end(&refs, &[]);
        let _ = shared.tx.send(&ToDriver::CallDone {
            call: id,
            result: Err(Error::Protocol(format!(
                "actor mailbox refused the call: {why}"
            ))),
            delivered: Vec::new(),
            released: Vec::new(),
            resolved: false,
        });
    }
}

/// The actor's side, after a call: keeps its thread awake for `window`,
/// or until the next call arrived, moving queued calls into the mailbox
/// (HF-2). Runs on the actor's thread.
pub(super) async fn listen<A: RdtActor>(
    shared: Arc<WorkerShared>,
    addr: Addr<Host<A>>,
    window: Duration,
) {
    let h = &shared.handoff.state;
    let seen = {
        let mut s = h.lock();
        s.listeners += 1;
        s.arrived
    };
    let t0 = Instant::now();
    loop {
        {
            let mut s = h.lock();
            // Moved under the lock: a call the control loop sends straight
            // once no listener is left comes after these (HF-1).
            for call in std::mem::take(&mut s.calls) {
                invoke(&shared, &addr, call);
            }
            if s.arrived != seen || t0.elapsed() >= window {
                s.listeners -= 1;
                return;
            }
        }
        // Nothing registers a waker here (the control loop wakes nobody):
        // the thread yields to its other tasks and looks again.
        tokio::task::yield_now().await;
    }
}
