//! The owner table: the driver's record of every live object.
//!
//! # States
//! An entry is created **pending** when a call is submitted (or **ready**
//! at once for `put`). The producer's reply makes it **ready** (value, or for
//! direct transports the non-tensor data plus tensor metadata) or
//! **failed** (the method's error, or the producer's death). An entry is
//! **freed** by removing it from the table.
//!
//! # Invariants
//! 1. `refs` counts the driver's live `ObjectRef`s; `pending_calls` counts
//!    submitted calls that take the object and have not finished. An entry
//!    is freed exactly when both are zero and it is not pending; then the
//!    producer (direct transports) and every holder of a copy are told to
//!    drop it.
//! 2. A consumer gets each object at most once (`holders`); a call that
//!    needs an object already delivered to its actor causes no transfer. The
//!    producer itself never receives its own object: it already holds the
//!    same storage (hand-over without copy).
//! 3. Deliveries for a pending object wait in `waiting` and go out, in
//!    order, when the object becomes ready or failed. A failed object is
//!    delivered as its error, so the consumer's call fails with a dependency
//!    error naming the original.
//! 4. When a producer dies, its pending objects fail, its ready direct
//!    objects become failed (their tensors died with it), and every holder
//!    of a direct copy still in flight is told so: nothing waits on a dead
//!    process.
//! 5. Messages to one actor go out on one ordered connection.

use std::collections::{HashMap, HashSet};

use rdt_transport::{Peer, Sidedness};
use tokio::sync::oneshot;

use crate::error::Error;
use crate::protocol::{Delivery, Sender, ToWorker, WireValue};
use crate::transport::Transport;

/// Driver-side id of an actor.
pub(crate) type ActorId = u64;

/// State of an object.
pub(crate) enum ObjState {
    Pending,
    Ready(WireValue),
    Failed(Error),
}

/// One object.
pub(crate) struct Entry {
    pub producer: Option<ActorId>,
    pub transport: String,
    pub state: ObjState,
    pub refs: usize,
    pub pending_calls: usize,
    pub holders: HashSet<ActorId>,
    waiting: Vec<ActorId>,
    pub getters: Vec<oneshot::Sender<()>>,
    passed_back: bool,
    sent_elsewhere: bool,
    warned: bool,
}

impl Entry {
    /// A new entry held by one driver ref (the one its creator returns).
    fn new(producer: Option<ActorId>, transport: &str, state: ObjState) -> Entry {
        Entry {
            producer,
            transport: transport.to_string(),
            state,
            refs: 1,
            pending_calls: 0,
            holders: HashSet::new(),
            waiting: Vec::new(),
            getters: Vec::new(),
            passed_back: false,
            sent_elsewhere: false,
            warned: false,
        }
    }

    fn sidedness(&self) -> Sidedness {
        match self.transport.parse::<Transport>() {
            Ok(t) => t.sidedness(),
            Err(_) => Sidedness::ThroughDriver,
        }
    }
}

/// What the driver knows of an actor.
pub(crate) struct ActorInfo {
    pub name: String,
    pub conn: Option<Sender>,
    pub dead: Option<String>,
    pub host: String,
    pub endpoints: HashMap<String, String>,
}

impl ActorInfo {
    pub fn peer(&self, id: ActorId, transport: &str) -> Peer {
        Peer {
            actor: id,
            name: self.name.clone(),
            host: self.host.clone(),
            endpoint: self.endpoints.get(transport).cloned().unwrap_or_default(),
        }
    }
}

pub(crate) type Actors = HashMap<ActorId, ActorInfo>;

fn send(actors: &Actors, to: ActorId, msg: &ToWorker) {
    if let Some(conn) = actors.get(&to).and_then(|a| a.conn.as_ref()) {
        if let Err(e) = conn.send(msg) {
            tracing::error!("could not encode a message for actor {to}: {e}");
        }
    }
}

/// The table.
#[derive(Default)]
pub(crate) struct OwnerTable {
    pub objects: HashMap<u64, Entry>,
    next_xfer: u64,
}

impl OwnerTable {
    /// A call's result, pending. The returned ref counts as one.
    pub fn insert_pending(&mut self, id: u64, producer: ActorId, transport: &str) {
        self.objects
            .insert(id, Entry::new(Some(producer), transport, ObjState::Pending));
    }

    /// A value put by the driver, or a call that failed before it was sent.
    pub fn insert_done(&mut self, id: u64, producer: Option<ActorId>, state: ObjState) {
        self.objects.insert(
            id,
            Entry::new(producer, Transport::ObjectStore.name(), state),
        );
    }

    /// A driver ref was cloned.
    pub fn inc(&mut self, id: u64) {
        if let Some(e) = self.objects.get_mut(&id) {
            e.refs += 1;
        }
    }

    /// A driver ref was dropped.
    pub fn dec(&mut self, id: u64, actors: &Actors) {
        if let Some(e) = self.objects.get_mut(&id) {
            e.refs = e.refs.saturating_sub(1);
        }
        self.maybe_free(id, actors);
    }

    /// A submitted call to `consumer` takes object `id`.
    pub fn need(&mut self, id: u64, consumer: ActorId, actors: &Actors) {
        let Some(e) = self.objects.get_mut(&id) else {
            // Cannot happen while the caller holds a ref; be loud if it does.
            tracing::error!("a call needs object {id}, which the owner table no longer has");
            send(
                actors,
                consumer,
                &ToWorker::Deliver {
                    object: id,
                    value: Err(Error::Freed { object: id }),
                },
            );
            return;
        };
        e.pending_calls += 1;
        if matches!(e.state, ObjState::Pending) {
            e.waiting.push(consumer);
        } else {
            self.deliver(id, consumer, actors);
        }
    }

    fn deliver(&mut self, id: u64, consumer: ActorId, actors: &Actors) {
        let xfer = {
            self.next_xfer += 1;
            self.next_xfer
        };
        let Some(e) = self.objects.get_mut(&id) else {
            return;
        };
        let sided = e.sidedness();
        let value = match &e.state {
            ObjState::Pending => return,
            ObjState::Failed(err) => {
                if e.holders.insert(consumer) {
                    send(
                        actors,
                        consumer,
                        &ToWorker::Deliver {
                            object: id,
                            value: Err(err.clone()),
                        },
                    );
                }
                return;
            }
            ObjState::Ready(v) => v.clone(),
        };
        if sided != Sidedness::ThroughDriver && e.producer == Some(consumer) {
            // Invariant 2: the producer already holds the storage.
            e.passed_back = true;
        } else if e.holders.insert(consumer) {
            if sided != Sidedness::ThroughDriver {
                e.sent_elsewhere = true;
            }
            let producer = e
                .producer
                .and_then(|p| actors.get(&p).map(|a| a.peer(p, &e.transport)));
            if let (Some(p), Some(c)) = (&producer, actors.get(&consumer)) {
                // One-sided same-host transports: refuse another host before
                // anything moves, naming both ends.
                let same_host_only = matches!(
                    e.transport.parse::<Transport>(),
                    Ok(Transport::Shm | Transport::CudaIpc)
                );
                if same_host_only && !p.host.is_empty() && !c.host.is_empty() && p.host != c.host {
                    let err = Error::Transport(rdt_transport::TransportError::with_peer(
                        &e.transport,
                        p,
                        format!(
                            "{} moves tensors only between actors on one host; {} is on {} and {} on {}: use tcp (in a collective group) or object_store",
                            e.transport, p.name, p.host, c.name, c.host
                        ),
                    ));
                    send(
                        actors,
                        consumer,
                        &ToWorker::Deliver {
                            object: id,
                            value: Err(err),
                        },
                    );
                    return;
                }
            }
            if sided == Sidedness::TwoSided {
                if let (Some(p), Some(c)) = (e.producer, actors.get(&consumer)) {
                    send(
                        actors,
                        p,
                        &ToWorker::SendTo {
                            object: id,
                            xfer,
                            to: c.peer(consumer, &e.transport),
                        },
                    );
                }
            }
            send(
                actors,
                consumer,
                &ToWorker::Deliver {
                    object: id,
                    value: Ok(Delivery {
                        value,
                        from: producer,
                        xfer,
                    }),
                },
            );
        }
        if e.passed_back && e.sent_elsewhere && !e.warned {
            e.warned = true;
            tracing::warn!(
                object = id,
                "object {id} was passed back to its producer and also sent to another actor; \
                 tensors are mutable and shared, so a write by the producer may be seen by \
                 readers of the other copies, or not: clone the tensors if you need isolation"
            );
        }
    }

    /// A call finished: record its result and release its arguments.
    pub fn call_done(
        &mut self,
        result: u64,
        outcome: Result<WireValue, Error>,
        args: &[u64],
        actors: &Actors,
    ) {
        if let Some(e) = self.objects.get_mut(&result) {
            if matches!(e.state, ObjState::Pending) {
                e.state = match outcome {
                    Ok(v) => {
                        e.transport = v.transport.clone();
                        ObjState::Ready(v)
                    }
                    Err(err) => ObjState::Failed(err),
                };
                for g in e.getters.drain(..) {
                    let _ = g.send(());
                }
                let waiting = std::mem::take(&mut e.waiting);
                for c in waiting {
                    self.deliver(result, c, actors);
                }
            }
        }
        for &a in args {
            if let Some(e) = self.objects.get_mut(&a) {
                e.pending_calls = e.pending_calls.saturating_sub(1);
            }
            self.maybe_free(a, actors);
        }
        self.maybe_free(result, actors);
    }

    fn maybe_free(&mut self, id: u64, actors: &Actors) {
        let free = match self.objects.get(&id) {
            Some(e) => e.refs == 0 && e.pending_calls == 0 && !matches!(e.state, ObjState::Pending),
            None => false,
        };
        if !free {
            return;
        }
        let e = self.objects.remove(&id).expect("checked above");
        let direct =
            e.sidedness() != Sidedness::ThroughDriver && matches!(e.state, ObjState::Ready(_));
        if direct {
            if let Some(p) = e.producer {
                send(actors, p, &ToWorker::Free { object: id });
            }
        }
        for h in e.holders {
            if Some(h) != e.producer || !direct {
                send(actors, h, &ToWorker::Free { object: id });
            }
        }
    }

    /// Invariant 4.
    pub fn actor_died(&mut self, actor: ActorId, err: &Error, actors: &Actors) {
        let ids: Vec<u64> = self
            .objects
            .iter()
            .filter(|(_, e)| e.producer == Some(actor))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            let e = self.objects.get_mut(&id).expect("listed above");
            match &e.state {
                ObjState::Pending => {
                    // Its call fails through the pending-call path; nothing here.
                }
                ObjState::Ready(_) if e.sidedness() != Sidedness::ThroughDriver => {
                    e.state = ObjState::Failed(err.clone());
                    let holders: Vec<ActorId> = e.holders.iter().copied().collect();
                    for h in holders {
                        send(
                            actors,
                            h,
                            &ToWorker::Deliver {
                                object: id,
                                value: Err(err.clone()),
                            },
                        );
                    }
                }
                _ => {}
            }
        }
    }

    /// Number of live entries (for tests and soak checks).
    pub fn len(&self) -> usize {
        self.objects.len()
    }
}
