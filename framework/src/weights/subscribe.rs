//! The rollout's side: [`Subscriber`] receives each version into a
//! buffer no reader uses and flips it in between two reads (WS-5, WS-6).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use tokio::sync::Notify;

use super::layout::{Layout, LayoutDigest};
use super::params::ParamSet;
use super::publish::Published;
use crate::{Error, Result, Targets};

/// How a [`Subscriber`] takes a new version in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Swap {
    /// Receive into a second buffer while readers keep reading the live
    /// one, then flip: readers never wait (twice the parameters' memory).
    DoubleBuffered,
    /// Receive straight into the live parameters (no second buffer): the
    /// receive waits for the readers of the live set to finish, and new
    /// readers wait for the receive (a pause, for when memory is short).
    InPlace,
}

/// One buffer and the readers in it.
struct Slot {
    params: ParamSet,
    version: Mutex<Option<u64>>,
    readers: AtomicUsize,
    drained: Notify,
}

impl Slot {
    fn new(params: ParamSet) -> Arc<Slot> {
        Arc::new(Slot {
            params,
            version: Mutex::new(None),
            readers: AtomicUsize::new(0),
            drained: Notify::new(),
        })
    }

    /// Waits until no [`Current`] reads this buffer.
    async fn drained(&self) {
        loop {
            let notified = self.drained.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.readers.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// What readers see: the live buffer, and whether an in-place receive is
/// writing it.
struct Live {
    slot: Mutex<(Arc<Slot>, bool)>,
    unpaused: Condvar,
}

/// A reader's handle on a subscriber's live parameters: clone it into the
/// inference loop (any thread), and take [`current`](Self::current) at
/// the start of each step.
#[derive(Clone)]
pub struct Weights(Arc<Live>);

impl Weights {
    /// The live parameters, for one step: every read through the guard
    /// sees one version whole, even if a newer one is flipped in
    /// meanwhile (the next `current` sees that). With
    /// [`Swap::InPlace`], waits (blocking the thread) while a receive
    /// writes the live set.
    pub fn current(&self) -> Current {
        let mut live = self.0.slot.lock();
        while live.1 {
            self.0.unpaused.wait(&mut live);
        }
        let slot = live.0.clone();
        slot.readers.fetch_add(1, Ordering::AcqRel);
        drop(live);
        Current { slot }
    }
}

/// One step's view of the live parameters (see [`Weights::current`]):
/// the buffer it names is not written while the guard lives.
pub struct Current {
    slot: Arc<Slot>,
}

impl Current {
    /// The parameters.
    pub fn params(&self) -> &ParamSet {
        &self.slot.params
    }

    /// The version they hold (`None`: nothing received yet).
    pub fn version(&self) -> Option<u64> {
        *self.slot.version.lock()
    }
}

impl std::ops::Deref for Current {
    type Target = ParamSet;
    fn deref(&self) -> &ParamSet {
        &self.slot.params
    }
}

impl Drop for Current {
    fn drop(&mut self) {
        if self.slot.readers.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.slot.drained.notify_waiters();
        }
    }
}

/// What one [`Subscriber::receive`] took.
#[derive(Clone, Copy, Debug)]
pub struct Received {
    /// The version now live.
    pub version: u64,
    /// Waiting for the readers of the buffer written (the previous
    /// version's last steps; with [`Swap::InPlace`], the live set's).
    pub waited: Duration,
    /// Moving the bytes in (until they landed, on a GPU too).
    pub transfer: Duration,
    /// The flip: the new buffer made live for the next reader.
    pub flip: Duration,
    /// Bytes received.
    pub bytes: u64,
}

/// The rollout's side of a weight sync: its own parameters (a
/// [`ParamSet`] of the trainer's layout), receiving each version in place
/// and making it live between two reads.
///
/// - **Checked by name, once** (WS-1): [`subscribe`](Self::subscribe)
///   compares the publisher's layout with this one and names the first
///   difference; after it, each version's digest is compared, and a
///   mismatch fails before any byte moves.
/// - **Versions only increase** (WS-5): a version not newer than the live
///   one fails with [`Error::StaleVersion`], before any byte moves.
/// - **No pause** (WS-6): with [`Swap::DoubleBuffered`], the version is
///   received into the buffer readers do not use, then flipped in: a
///   reader's [`Current`] keeps the buffer it took until it drops it, and
///   the next one sees the new version. The flip is a pointer swap under
///   a lock (its time is in [`Received::flip`]).
///
/// On a GPU, the flip happens once the bytes have landed on the device
/// (the arenas' stream work is done): the next step's kernels read the new
/// buffer, the running ones the old. Inference that captured CUDA graphs
/// over fixed weight addresses captures one graph per buffer
/// ([`Subscriber::buffers`] gives both) and launches the one whose buffer
/// [`Current`] names.
///
/// Used inside an actor method (it receives through the actor's runtime).
pub struct Subscriber {
    layout: Layout,
    digest: LayoutDigest,
    subscribed: bool,
    swap: Swap,
    live: Arc<Live>,
    /// The buffer readers do not use (double-buffered), and its targets.
    back: Option<(Arc<Slot>, Targets)>,
    /// The live buffer's targets (in place).
    live_targets: Targets,
}

impl Subscriber {
    /// A subscriber receiving into `params` (made from the publisher's
    /// layout, the same arena size); double-buffered makes a second set
    /// like it.
    pub fn new(params: ParamSet, swap: Swap) -> Result<Subscriber> {
        let back = match swap {
            Swap::DoubleBuffered => {
                let b = params.empty_like()?;
                let t = Targets::from(b.arena_list().clone());
                Some((Slot::new(b), t))
            }
            Swap::InPlace => None,
        };
        let live_targets = Targets::from(params.arena_list().clone());
        Ok(Subscriber {
            layout: params.layout().clone(),
            digest: params.layout().digest(),
            subscribed: false,
            swap,
            live: Arc::new(Live {
                slot: Mutex::new((Slot::new(params), false)),
                unpaused: Condvar::new(),
            }),
            back,
            live_targets,
        })
    }

    /// Checks the publisher's layout against this subscriber's, once per
    /// subscription: fails with [`Error::LayoutMismatch`] naming the
    /// first difference (in the canonical order) if they differ.
    pub fn subscribe(&mut self, publisher: &Layout) -> Result<()> {
        if let Some(difference) = self.layout.first_difference(publisher) {
            return Err(Error::LayoutMismatch {
                difference: format!("{difference} (here: this subscriber, there: the publisher)"),
            });
        }
        self.subscribed = true;
        Ok(())
    }

    /// The handle readers take the live parameters from.
    pub fn weights(&self) -> Weights {
        Weights(self.live.clone())
    }

    /// The version live now.
    pub fn version(&self) -> Option<u64> {
        *self.live.slot.lock().0.version.lock()
    }

    /// How new versions come in.
    pub fn swap(&self) -> Swap {
        self.swap
    }

    /// Both buffers (one with [`Swap::InPlace`]), live first.
    pub fn buffers(&self) -> Vec<ParamSet> {
        let mut v = vec![self.live.slot.lock().0.params.clone()];
        v.extend(self.back.as_ref().map(|(s, _)| s.params.clone()));
        v
    }

    /// Receives `published` and makes it live. Fails before any byte
    /// moves if it is not newer than the live version
    /// ([`Error::StaleVersion`]), if [`subscribe`](Self::subscribe) was
    /// not called, or if its layout digest is not this subscriber's
    /// ([`Error::LayoutMismatch`]). A failed receive leaves the live
    /// version as it was.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves the live version
    /// live and its buffer untouched (double-buffered: the receive wrote
    /// only the other buffer, which the next receive writes again after
    /// [`Targets::idle`]); in place, the live set may hold part of the
    /// new version, and `version()` stays the old one.
    pub async fn receive(&mut self, published: &Published) -> Result<Received> {
        if !self.subscribed {
            return Err(Error::LayoutMismatch {
                difference: "this subscriber never checked the publisher's layout: call Subscriber::subscribe(publisher_layout) first".into(),
            });
        }
        if published.digest != self.digest {
            return Err(Error::LayoutMismatch {
                difference: format!(
                    "version {} has the layout digest {}, this subscriber {}: the publisher's layout changed since subscribe",
                    published.version, published.digest, self.digest
                ),
            });
        }
        if let Some(current) = self.version().filter(|&v| published.version <= v) {
            return Err(Error::StaleVersion {
                version: published.version,
                current,
            });
        }
        let rt = crate::runtime();
        let started = Instant::now();
        let received = match &self.back {
            Some((slot, targets)) => {
                // The buffer's last readers took it before the previous
                // flip; their steps end, then it is written.
                slot.drained().await;
                targets.idle().await;
                let waited = started.elapsed();
                rt.load_into(&published.weights, targets).await?;
                slot.params.ready().await?;
                let transfer = started.elapsed() - waited;
                *slot.version.lock() = Some(published.version);
                let flipping = Instant::now();
                let back = {
                    let mut live = self.live.slot.lock();
                    std::mem::replace(&mut live.0, slot.clone())
                };
                let flip = flipping.elapsed();
                // Each buffer keeps its own targets (checked once: TG-3).
                let back_targets = std::mem::replace(&mut self.live_targets, targets.clone());
                self.back = Some((back, back_targets));
                Received {
                    version: published.version,
                    waited,
                    transfer,
                    flip,
                    bytes: published.bytes,
                }
            }
            None => {
                let slot = {
                    let mut live = self.live.slot.lock();
                    live.1 = true;
                    live.0.clone()
                };
                let _resume = Resume(&self.live);
                slot.drained().await;
                let waited = started.elapsed();
                rt.load_into(&published.weights, &self.live_targets).await?;
                slot.params.ready().await?;
                let transfer = started.elapsed() - waited;
                *slot.version.lock() = Some(published.version);
                Received {
                    version: published.version,
                    waited,
                    transfer,
                    flip: Duration::ZERO,
                    bytes: published.bytes,
                }
            }
        };
        metrics::histogram!("rdt_weights_flip_seconds").record(received.flip.as_secs_f64());
        metrics::histogram!("rdt_weights_receive_seconds").record(received.transfer.as_secs_f64());
        Ok(received)
    }
}

/// Lets readers in again once an in-place receive ends, however it ends.
struct Resume<'a>(&'a Live);

impl Drop for Resume<'_> {
    fn drop(&mut self) {
        self.0.slot.lock().1 = false;
        self.0.unpaused.notify_all();
    }
}
