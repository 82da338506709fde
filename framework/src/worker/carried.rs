//! Carried receives: a small receive that the control loop starts and the
//! call that takes its object finishes, on the actor's thread.
//!
//! # Why
//! A small `nixl` object from a known producer is read within
//! microseconds of its READ's post. Started on the control loop after the
//! call behind its delivery was handed on (`AfterFramesInHand`), its READ
//! was posted only once the call was handed on, the loop waited for it,
//! stored the value, wrote the `Received`, and the actor's thread, which
//! had the call by then, picked the value up from the store: on 2×H200 a
//! 4 KiB pass spent 9.9 µs more than a tiny call and a raw READ, in steps
//! of 1–3 µs, most of them there (book: NIXL chapter). Carried, the READ
//! is posted first and moves while the loop decodes the call and hands it
//! on; the actor's thread finishes the receive itself (it ends as the
//! thread gets there) and runs the method at once; no `Received` is
//! written: the call's `CallDone` settles the receive (XF-5).
//!
//! # When
//! A receive the transport starts after the frames in hand
//! (`ReceiveStart::AfterFramesInHand`), delivered while the actor's
//! thread listens for its next call (`handoff.rs`), is carried: the loop
//! polls it once, looking once instead of spinning
//! (`rdt_transport::hot::look_once`), and keeps it here. A call handed to
//! the listener claims the receives it takes. `RDT_CARRY_RECEIVES=0`
//! turns carrying off (a measurement knob).
//!
//! # Invariants
//! * **CR-1 (finished once):** a carried receive stays here until exactly
//!   one taker removes it and runs it to its end: the call that takes its
//!   object, first thing in its argument resolution, on the actor's
//!   thread; a call the mailbox refused, which hands it to the control
//!   runtime; or the control loop, once the frames in hand are handled,
//!   when no call handed to a listener claimed it (a task then, as an
//!   uncarried receive). Removal is under one lock, so no receive is run
//!   twice or left behind.
//! * **CR-2 (acknowledged once):** a carried receive that ends well on the
//!   actor's thread holds its `Received` here instead of writing it
//!   ([`HeldAcks`]). The call that took it, when it ends, drops the held
//!   acknowledgement if it got past its arguments (its `CallDone` settles
//!   the receive in the driver, XF-5) and sends it before its `CallDone`
//!   otherwise. A call that runs on past `ack_wait` does not hold it until
//!   the driver's transfer deadline: the control loop sends it then
//!   ([`HeldAcks::due`]); the call finds nothing left to drop. A failed
//!   receive is acknowledged at once, as before.
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdt_transport::hot;
use rdt_transport::switch::Switch;
use tokio::sync::Notify;

use super::Job;

/// `RDT_CARRY_RECEIVES=0` leaves every receive to the control loop, as
/// before carried receives (a measurement knob).
pub(super) static CARRY: Switch = Switch::new("RDT_CARRY_RECEIVES", true);

/// The receives carried now, by object, and their held acknowledgements.
#[derive(Default)]
pub(super) struct Carried {
    jobs: Mutex<HashMap<u64, Job>>,
    /// Carried receives a call finished on the actor's thread.
    finished_by_calls: AtomicU64,
    /// Acknowledgements held for the calls that finished their receives.
    pub(super) acks: HeldAcks,
}

/// What [`Carried::start`] did with a receive.
pub(super) enum Start {
    /// Not carried: the caller starts it as before.
    NotCarried(Job),
    /// Carried: its READ is posted, and the receive waits here for a
    /// taker (CR-1).
    Carried,
    /// It ended in its first poll.
    Ended,
}

impl Carried {
    /// Polls `job` (the receive of `object`) once, looking once, and keeps
    /// it if it did not end; `listening`: the actor's thread listens for
    /// its next call now.
    pub(super) fn start(&self, object: u64, mut job: Job, listening: bool) -> Start {
        if !CARRY.on() || !listening || self.jobs.lock().contains_key(&object) {
            return Start::NotCarried(job);
        }
        let mut cx = Context::from_waker(futures::task::noop_waker_ref());
        if hot::look_once(|| job.as_mut().poll(&mut cx)).is_ready() {
            return Start::Ended;
        }
        self.jobs.lock().insert(object, job);
        Start::Carried
    }

    /// Takes the carried receive of `object`, if any is left (CR-1).
    pub(super) fn take(&self, object: u64) -> Option<Job> {
        self.jobs.lock().remove(&object)
    }

    /// Finishes the carried receive of `object` here, on the actor's
    /// thread, if it is still waiting for a taker (CR-1).
    pub(super) async fn finish_here(&self, object: u64) {
        if let Some(job) = self.take(object) {
            rdt_transport::cuda::timeline("carried receive taken", object);
            OnCallsThread(job).await;
            rdt_transport::cuda::timeline("carried receive ended", object);
            self.finished_by_calls.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// How many carried receives calls finished on the actor's thread.
    pub(super) fn finished_by_calls(&self) -> u64 {
        self.finished_by_calls.load(Ordering::Relaxed)
    }
}

thread_local! {
    /// Set while a call polls a carried receive on the actor's thread.
    static ON_CALLS_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Is a call finishing a carried receive on this thread now? Its
/// acknowledgement is then held (CR-2).
pub(super) fn finishing_for_a_call() -> bool {
    ON_CALLS_THREAD.with(|c| c.get())
}

/// A carried receive polled by the call that takes it.
struct OnCallsThread(Job);

impl Future for OnCallsThread {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let was = ON_CALLS_THREAD.with(|c| c.replace(true));
        let r = self.0.as_mut().poll(cx);
        ON_CALLS_THREAD.with(|c| c.set(was));
        r
    }
}

/// A `Received` held for the call that took the receive (CR-2).
struct HeldAck {
    object: u64,
    xfer: u64,
    /// When the control loop sends it, if no call took it away first.
    due: Instant,
}

/// Acknowledgements held for calls (CR-2).
#[derive(Default)]
pub(super) struct HeldAcks {
    list: Mutex<Vec<HeldAck>>,
    /// `list.len()`, read without the lock on every turn of the loop.
    count: AtomicUsize,
    /// The control loop waits without looking (past its hot window): an
    /// acknowledgement held now has to wake it.
    parked: AtomicBool,
    wake: Notify,
}

impl HeldAcks {
    /// Holds the acknowledgement of a receive that ended well; the control
    /// loop sends it after `wait` unless a call took it away.
    pub(super) fn hold(&self, object: u64, xfer: u64, wait: Duration) {
        let mut list = self.list.lock();
        list.push(HeldAck {
            object,
            xfer,
            due: Instant::now() + wait,
        });
        self.count.store(list.len(), Ordering::SeqCst);
        drop(list);
        if self.parked.load(Ordering::SeqCst) {
            self.wake.notify_one();
        }
    }

    /// Takes away the acknowledgements held for `refs`' receives:
    /// `(object, transfer)` pairs.
    pub(super) fn take_for(&self, refs: &[u64]) -> Vec<(u64, u64)> {
        if self.count.load(Ordering::SeqCst) == 0 {
            return Vec::new();
        }
        self.take_where(|a| refs.contains(&a.object))
    }

    /// Takes the acknowledgements due now.
    pub(super) fn take_due(&self) -> Vec<(u64, u64)> {
        let now = Instant::now();
        self.take_where(|a| a.due <= now)
    }

    fn take_where(&self, mut pick: impl FnMut(&HeldAck) -> bool) -> Vec<(u64, u64)> {
        let mut list = self.list.lock();
        let mut taken = Vec::new();
        list.retain(|a| {
            if pick(a) {
                taken.push((a.object, a.xfer));
                false
            } else {
                true
            }
        });
        self.count.store(list.len(), Ordering::SeqCst);
        taken
    }

    fn earliest(&self) -> Option<Instant> {
        if self.count.load(Ordering::SeqCst) == 0 {
            return None;
        }
        self.list.lock().iter().map(|a| a.due).min()
    }

    /// Ready once an acknowledgement is due. Polled hot (the control
    /// loop's hot window), it only looks; past the window it sleeps until
    /// the earliest is due, or until one is held.
    pub(super) fn due(&self) -> impl Future<Output = ()> + '_ {
        struct Unpark<'a>(&'a AtomicBool);
        impl Drop for Unpark<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::SeqCst);
            }
        }
        let unpark = Unpark(&self.parked);
        let mut woken = Box::pin(self.wake.notified());
        let mut sleep: Option<Pin<Box<tokio::time::Sleep>>> = None;
        std::future::poll_fn(move |cx| {
            let _ = &unpark;
            loop {
                let due_now = |t: Option<Instant>| t.is_some_and(|t| t <= Instant::now());
                if due_now(self.earliest()) {
                    return Poll::Ready(());
                }
                if hot::polled_hot() {
                    // Asked again in a moment.
                    self.parked.store(false, Ordering::SeqCst);
                    return Poll::Pending;
                }
                self.parked.store(true, Ordering::SeqCst);
                // Looked at again after `parked` is set: one held
                // meanwhile is seen here or wakes the loop.
                let earliest = self.earliest();
                if due_now(earliest) {
                    return Poll::Ready(());
                }
                if woken.as_mut().poll(cx).is_ready() {
                    woken.set(self.wake.notified());
                    continue;
                }
                if let Some(t) = earliest {
                    let t = tokio::time::Instant::from_std(t);
                    let s = sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(t)));
                    if s.deadline() != t {
                        s.as_mut().reset(t);
                    }
                    if s.as_mut().poll(cx).is_ready() {
                        continue;
                    }
                }
                return Poll::Pending;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_acknowledgement_is_taken_once_by_its_call_or_when_due() {
        let acks = HeldAcks::default();
        acks.hold(1, 10, Duration::from_secs(60));
        acks.hold(2, 20, Duration::ZERO);
        assert!(acks.take_for(&[3]).is_empty());
        assert_eq!(acks.take_due(), vec![(2, 20)]);
        assert!(acks.take_due().is_empty());
        assert_eq!(acks.take_for(&[1, 3]), vec![(1, 10)]);
        assert!(acks.take_for(&[1]).is_empty());
    }

    #[tokio::test]
    async fn the_loop_past_its_hot_window_wakes_when_a_held_acknowledgement_is_due() {
        let acks = std::sync::Arc::new(HeldAcks::default());
        let holder = acks.clone();
        let due = tokio::spawn(async move {
            acks.due().await;
            acks.take_due()
        });
        // Held after the wait began: the wait must wake for it.
        tokio::task::yield_now().await;
        holder.hold(7, 70, Duration::from_millis(20));
        let got = tokio::time::timeout(Duration::from_secs(10), due)
            .await
            .expect("the held acknowledgement came due within its wait")
            .unwrap();
        assert_eq!(got, vec![(7, 70)]);
    }
}
