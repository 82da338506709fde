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
//! (`rdt_transport::rt::hot`), polling. While it does, it *listens*: the
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

use super::*;
use std::collections::VecDeque;

use crate::protocol::CallMsg;

/// Calls on their way to a listening actor's thread.
#[derive(Default)]
pub(super) struct HandOff {
    pub(super) state: Mutex<State>,
}

#[derive(Default)]
pub(super) struct State {
    /// Calls read while a listener was registered, oldest first (HF-1).
    pub(super) calls: VecDeque<CallMsg>,
    /// Listeners registered now (one per call that ended within the
    /// window; on a concurrent actor, several).
    pub(super) listeners: u32,
    /// Calls the control loop has handed on so far, either way: a
    /// listener ends once one came.
    pub(super) arrived: u64,
    /// Of those, the calls queued for a listener.
    pub(super) queued: u64,
}

impl HandOff {
    /// How many calls went to the actor's thread through the queue (for
    /// tests, which prove the path ran).
    pub(super) fn queued(&self) -> u64 {
        self.state.lock().queued
    }
}
