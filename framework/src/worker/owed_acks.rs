//! Acknowledgements of small receives, left to the call behind them
//! (WK-10).
//!
//! A small `nixl` receive started on the control loop behind its call
//! (`ReceiveStart::AfterFramesInHand`) ends before that call can run. Its
//! own `Received` frame would reach the driver just ahead of the call's
//! `CallDone`, and the driver reads and handles it first: on the 2×H200
//! host that put 4–5 µs between the reply reaching the driver and the
//! caller waking, on a 4 KiB pass of about 50 µs. A `CallDone` past
//! argument resolution settles the call's receives in the driver anyway
//! (XF-5), so the receive *owes* its acknowledgement here instead, and
//! the call that takes the value takes it on (WK-9's `take_ack`).
//!
//! What is owed is settled without a task or a timer of its own (each
//! costs a wake-up on the control runtime, which is what sank the first
//! try of this, session 34): the control loop looks at what is owed
//! before it waits for its next frame, and waits hot only until the
//! oldest is due.
//!
//! * **OA-1 (taken, then settled):** a call that took an owed
//!   acknowledgement on settles it with its `CallDone`; the entry is
//!   dropped once that call has ended.
//! * **OA-2 (bounded):** an acknowledgement is never owed for longer than
//!   `ack_wait` (an eighth of the transfer deadline, at most 10 ms): one no
//!   call took on by then, or whose call still runs (WK-9's bound), is
//!   sent as a `Received` then. The driver takes a `Received` after a
//!   `CallDone` settled the receive, or the reverse, as a no-op.
//! * **OA-3 (never past the hot window):** nothing stays owed while the
//!   control loop sleeps: when its hot window ends, everything owed goes
//!   out first. Without a window nothing is owed at all.
//!
//! `RDT_ACK_WITH_CALL=0` sends each at once (a measurement knob).
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdt_transport::switch::Switch;

use super::Landed;
use crate::protocol::{Sender, ToDriver};

static ACK_WITH_CALL: Switch = Switch::new("RDT_ACK_WITH_CALL", true);

/// Acknowledgements owed by small receives, by object.
#[derive(Default)]
pub(super) struct OwedAcks {
    owed: Mutex<HashMap<u64, (Landed, Instant)>>,
    /// `owed.len()`, read without the lock on every loop iteration.
    count: AtomicUsize,
}

impl OwedAcks {
    /// May a receive that ended now owe its acknowledgement (the knob,
    /// and a hot window for the control loop to wait in, OA-3)?
    pub(super) fn enabled() -> bool {
        ACK_WITH_CALL.on() && !rdt_transport::hot::window().is_zero()
    }

    /// Object `object`'s receive `xfer` ended well: its acknowledgement is
    /// owed. Call before the value is stored, so that the call that
    /// takes it finds this.
    pub(super) fn owe(&self, object: u64, xfer: u64) {
        let l = Landed {
            landing: futures::FutureExt::shared(
                Box::pin(futures::future::ready(Ok(()))) as futures::future::BoxFuture<'static, _>
            ),
            xfer,
            ack: Default::default(),
        };
        let mut o = self.owed.lock();
        o.insert(object, (l, Instant::now()));
        self.count.store(o.len(), Ordering::Release);
    }

    /// The owed acknowledgement of `object`, for a call that took its
    /// value (OA-1).
    pub(super) fn get(&self, object: u64) -> Option<Landed> {
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.owed.lock().get(&object).map(|(l, _)| l.clone())
    }

    /// When the oldest acknowledgement owed is due (OA-2); `None` when
    /// nothing is owed.
    pub(super) fn next_due(&self, ack_wait: Duration) -> Option<Instant> {
        if self.count.load(Ordering::Acquire) == 0 {
            return None;
        }
        self.owed
            .lock()
            .values()
            .map(|(_, since)| *since + ack_wait)
            .min()
    }

    /// Drops what calls settled (OA-1) and sends what is due (OA-2), or,
    /// with `all`, everything not settled yet (OA-3).
    pub(super) fn settle(&self, tx: &Sender, ack_wait: Duration, all: bool) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let now = Instant::now();
        let mut o = self.owed.lock();
        o.retain(|&object, (l, since)| {
            let taken = l.ack_taken();
            if taken && l.call_ended() {
                return false;
            }
            if !all && now.duration_since(*since) < ack_wait {
                return true;
            }
            // From here on no call takes it on: this `Received` settles
            // it (a call that did, and runs on, settles it again with its
            // `CallDone`: a no-op in the driver).
            l.take_ack();
            let _ = tx.send(&ToDriver::Received {
                object,
                xfer: l.xfer,
                result: Ok(()),
            });
            false
        });
        self.count.store(o.len(), Ordering::Release);
    }
}
