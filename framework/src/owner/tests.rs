//! The owner table's invariants (OW-1..OW-15), in memory: a [`Pair`] owns
//! a table, the actors the driver knows and the collective groups it
//! would look up; events are driven as the driver drives them
//! (`driver/calls.rs`, `dispatch.rs`, `death.rs`), and what the table
//! decided is read back from its outbox, decoded as each actor reads it,
//! and written as a line ([`log`]): `C deliver 101 xfer 1, C call 104`.

use super::*;
use bytes::Bytes;
use rdt_transport::{Blob, DType, Device, Exported, Shape, TensorMeta};

use crate::protocol::{CallMsg, WireArg, WireExported};

/// The producer, and two consumers, all on host `h`.
const P: ActorId = 1;
const C: ActorId = 2;
const D: ActorId = 3;

/// A collective group as `GroupView` sees one: its members by rank, and
/// whether it is live (created, not destroyed nor broken).
struct TestGroup {
    id: u64,
    ranks: Vec<ActorId>,
    live: bool,
}

/// The driver's groups, answering as `GroupView` does: `Ok(None)` for a
/// transport that needs no group, the live group holding both ends, or
/// the error saying there is none.
struct Groups(Vec<TestGroup>);

impl GroupLookup for Groups {
    fn group_for(
        &self,
        transport: &str,
        object: u64,
        producer: ActorId,
        consumer: ActorId,
    ) -> Result<Option<(u64, u32, u32)>, Error> {
        let t = transport.parse::<Transport>();
        if !t.is_ok_and(|t| t.is_collective()) || producer == consumer {
            return Ok(None);
        }
        let rank = |g: &TestGroup, a: ActorId| g.ranks.iter().position(|r| *r == a);
        for g in self.0.iter().filter(|g| g.live) {
            if let (Some(p), Some(c)) = (rank(g, producer), rank(g, consumer)) {
                return Ok(Some((g.id, p as u32, c as u32)));
            }
        }
        Err(Error::NotInGroup {
            object,
            transport: transport.to_string(),
            backend: "Transport::Tcp".into(),
            producer: who(producer).into(),
            consumer: who(consumer).into(),
        })
    }
}

/// A call submitted and not ended yet.
struct Submitted {
    actor: ActorId,
    result: u64,
    args: Vec<u64>,
    release: Vec<u64>,
}

/// What [`Pair::submit`] staged: the call, its result, its `release`.
struct Staged {
    call: u64,
    result: u64,
    release: Vec<u64>,
}

/// The table with its surroundings (quinn-proto's `Pair`, without sockets).
struct Pair {
    table: OwnerTable,
    actors: Actors,
    groups: Groups,
    /// The last id given (objects and calls, as `Inner::next_id`).
    next: u64,
    calls: HashMap<u64, Submitted>,
}

impl Pair {
    fn new() -> Pair {
        let info = |a: ActorId| ActorInfo {
            name: who(a).into(),
            dead: None,
            host: "h".into(),
            endpoints: HashMap::new(),
            peer_socket: None,
            gpu: None,
            cuda_devices: None,
        };
        Pair {
            table: OwnerTable::default(),
            actors: [P, C, D].into_iter().map(|a| (a, info(a))).collect(),
            groups: Groups(Vec::new()),
            next: 100,
            calls: HashMap::new(),
        }
    }

    /// Every actor takes deliveries straight from producers: workers the
    /// driver spawned on its host with `RuntimeBuilder::peer_delivery` on
    /// (the default) get a peer socket (`Inner::peer_socket`).
    fn straight(mut self) -> Pair {
        for (a, info) in self.actors.iter_mut() {
            info.peer_socket = Some(format!("/run/rdt/peer-{a}.sock"));
        }
        self
    }

    /// A live collective group of `ranks`, in rank order.
    fn group(mut self, id: u64, ranks: &[ActorId]) -> Pair {
        let ranks = ranks.to_vec();
        self.groups.0.push(TestGroup {
            id,
            ranks,
            live: true,
        });
        self
    }

    fn id(&mut self) -> u64 {
        self.next += 1;
        self.next
    }

    /// A call to `actor` taking `args` by ref, as `Inner::stage_call` and
    /// `send_call` make it: its result pending, each argument needed, the
    /// `release` list (OW-12), then the call itself into the outbox.
    fn submit(&mut self, actor: ActorId, args: &[u64], transport: Transport) -> Staged {
        let result = self.id();
        let call = self.id();
        self.table.insert_pending(result, actor, transport);
        for &a in args {
            (self.table).need(a, actor, Some(call), &self.actors, &self.groups);
        }
        let releasable = |a: &u64| self.table.releasable(*a, actor);
        let release: Vec<u64> = args.iter().copied().filter(releasable).collect();
        let msg = ToWorker::Call(CallMsg {
            call,
            method: 0,
            args: args.iter().map(|&a| WireArg::Ref(a)).collect(),
            result,
            transport,
            release: release.clone(),
            context: crate::protocol::CallContext::default(),
        });
        self.table.outbox.send(actor, &msg).expect("a call fits");
        let args = args.to_vec();
        let (sub_release, staged_release) = (release.clone(), release);
        let sub = Submitted {
            actor,
            result,
            args,
            release: sub_release,
        };
        self.calls.insert(call, sub);
        Staged {
            call,
            result,
            release: staged_release,
        }
    }

    /// A value put by the driver (`Runtime::put`): ready, one driver ref.
    fn put(&mut self, value: WireValue) -> u64 {
        let id = self.id();
        self.table.insert_done(id, None, ObjState::Ready(value));
        id
    }

    /// An object `producer` made with a call that ended (its messages
    /// dropped): ready, held by the driver's ref.
    fn produce(&mut self, producer: ActorId, value: WireValue) -> u64 {
        let s = self.submit(producer, &[], value.transport);
        self.done(s.call, value);
        self.table.outbox.take();
        s.result
    }

    /// The call's `CallDone` (or its end by a death), as `end_call` hands
    /// it to the table: `ends` is (resolved, delivered, released).
    fn end(&mut self, call: u64, outcome: Result<WireValue, Error>, ends: (bool, &[u64], &[u64])) {
        let s = self
            .calls
            .remove(&call)
            .expect("a call submitted, not ended");
        let (resolved, delivered, released) = ends;
        let ended = CallEnd {
            outcome,
            resolved,
            delivered,
            released,
        };
        let (actors, groups) = (&self.actors, &self.groups);
        (self.table).call_done(s.result, ended, s.actor, &s.args, actors, groups);
    }

    /// The call ran and returned `value`; its worker dropped the copies
    /// its `release` names that no other call it holds takes (OW-12).
    fn done(&mut self, call: u64, value: WireValue) {
        let me = &self.calls[&call];
        let others_take = |a: &u64| {
            let mut others = self
                .calls
                .iter()
                .filter(|(c, o)| **c != call && o.actor == me.actor);
            others.any(|(_, o)| o.args.contains(a))
        };
        let released: Vec<u64> = me
            .release
            .iter()
            .copied()
            .filter(|a| !others_take(a))
            .collect();
        self.end(call, Ok(value), (true, &[], &released));
    }

    /// `Received` from the consumer of `xfer`: was it in flight?
    fn received(&mut self, xfer: u64, from: ActorId, result: Result<(), Error>) -> bool {
        let (actors, groups) = (&self.actors, &self.groups);
        self.table
            .received(xfer, from, &result, actors, groups)
            .is_some()
    }

    /// The actor dies, as `Inner::mark_dead` handles it: marked dead, its
    /// calls ended unresolved, then the table told.
    fn kill(&mut self, actor: ActorId) -> Error {
        let detail = "killed".to_string();
        let err = Error::ActorDied {
            actor: who(actor).into(),
            detail: detail.clone(),
        };
        self.actors.get_mut(&actor).expect("known").dead = Some(detail);
        let mine = self.calls.iter().filter(|(_, s)| s.actor == actor);
        let mut calls: Vec<u64> = mine.map(|(c, _)| *c).collect();
        calls.sort_unstable();
        for c in calls {
            self.end(c, Err(err.clone()), (false, &[], &[]));
        }
        self.table.actor_died(actor, &err, &self.actors);
        err
    }

    /// The messages decided since the last look, in order, decoded.
    fn messages(&mut self) -> Vec<(u64, ToWorker)> {
        let out = self.table.outbox.take();
        out.iter().map(|o| (o.to, o.message())).collect()
    }

    /// [`Pair::messages`], as a [`log`].
    fn sent(&mut self) -> String {
        log(&self.messages())
    }

    fn copy_of(&self, object: u64, actor: ActorId) -> Option<Copy> {
        self.table.objects[&object].copies.get(&actor).copied()
    }
}

fn who(a: ActorId) -> &'static str {
    match a {
        P => "P",
        C => "C",
        D => "D",
        _ => "?",
    }
}

/// A value through the driver: `n` bytes of data, no tensors.
fn through_driver(n: usize) -> WireValue {
    WireValue {
        data: Blob::new(Bytes::from(vec![7u8; n])),
        transport: Transport::ObjectStore,
        exported: WireExported::new(Exported::default()).expect("encodes"),
        refs: Vec::new(),
    }
}

/// A direct transport's value as its producer's `CallDone` carries it:
/// the data, and the metadata of one tensor of `nbytes` bytes.
fn direct(transport: Transport, nbytes: usize) -> WireValue {
    let shape = Shape::from(vec![nbytes]);
    let meta = TensorMeta {
        dtype: DType::U8,
        shape,
        device: Device::Cpu,
    };
    let exported = Exported {
        metas: vec![meta],
        handles: Vec::new(),
        inline: Vec::new(),
    };
    WireValue {
        data: Blob::new(Bytes::from_static(b"tensor")),
        transport,
        exported: WireExported::new(exported).expect("encodes"),
        refs: Vec::new(),
    }
}

/// A message, in short, with the fields the rules are about.
fn show(m: &ToWorker) -> String {
    match m {
        ToWorker::Call(c) => format!("call {}", c.call),
        ToWorker::Deliver {
            object,
            value: Ok(d),
        } => format!("deliver {object} xfer {}", d.xfer),
        ToWorker::Deliver {
            object,
            value: Err(_),
        } => format!("deliver {object} error"),
        ToWorker::DeliverTo { object, xfer, to } => {
            format!("order {object} to {} xfer {xfer}", who(to.actor))
        }
        ToWorker::SendTo {
            object, xfer, to, ..
        } => {
            format!("send {object} to {} xfer {xfer}", who(to.actor))
        }
        ToWorker::AbortTransfer { object, xfer, .. } => format!("abort {object} xfer {xfer}"),
        ToWorker::Free { object } => format!("free {object}"),
        other => format!("{other:?}"),
    }
}

/// Messages in order, each as `<actor> <message>`, comma-separated.
fn log(ms: &[(u64, ToWorker)]) -> String {
    let each: Vec<String> = ms
        .iter()
        .map(|(to, m)| format!("{} {}", who(*to), show(m)))
        .collect();
    each.join(", ")
}

/// The error a `Deliver` of `object` carries.
fn error_of(m: &ToWorker, object: u64) -> Error {
    match m {
        ToWorker::Deliver {
            object: o,
            value: Err(e),
        } if *o == object => e.clone(),
        other => panic!("expected the error of object {object}, got {}", show(other)),
    }
}

fn link_broke() -> Error {
    Error::Transport(rdt_transport::TransportError::new(
        "object_store",
        "the link broke",
    ))
}

const RAN: (bool, &[u64], &[u64]) = (true, &[], &[]);
const NEVER_RAN: (bool, &[u64], &[u64]) = (false, &[], &[]);

/// OW-1: freed once no ref and no call needs it; its producer is told.
#[test]
fn ow_1_an_object_is_freed_when_its_last_ref_and_call_go_and_its_producer_is_told() {
    let mut t = Pair::new();
    let r = t.produce(P, direct(Transport::Shm, 64));
    let c = t.submit(C, &[r], Transport::ObjectStore);
    assert_eq!(t.sent(), format!("C deliver {r} xfer 1, C call {}", c.call));
    t.table.dec(r);
    assert!(t.table.objects.contains_key(&r), "a call still needs it");
    assert_eq!(t.sent(), "");
    // The consumer dropped its copy itself (OW-12); the producer is told.
    t.done(c.call, through_driver(1));
    assert_eq!(t.sent(), format!("P free {r}"));
    assert!(!t.table.objects.contains_key(&r));
    assert_eq!(t.table.len(), 1, "only the call's result is left");
    assert_eq!(t.table.transfers_in_flight(), 0);
}

/// OW-1: a receive in flight holds the free back until it is acknowledged.
#[test]
fn ow_1_a_receive_in_flight_holds_the_free_back_until_its_ack() {
    let mut t = Pair::new();
    let r = t.produce(P, direct(Transport::Shm, 64));
    let c = t.submit(C, &[r], Transport::ObjectStore);
    t.messages();
    t.table.dec(r);
    // The call never ran (refused by the mailbox): unresolved.
    t.end(c.call, Err(Error::Protocol("refused".into())), NEVER_RAN);
    assert_eq!(t.sent(), "", "nothing is freed under a receive");
    assert_eq!(t.copy_of(r, C), Some(Copy::Receiving(1)));
    assert!(t.received(1, C, Ok(())));
    assert_eq!(t.sent(), format!("C free {r}, P free {r}"));
    assert!(!t.table.objects.contains_key(&r));
}

/// OW-2: the consumer's copy goes after its last call ends; a later call
/// gets a new delivery.
#[test]
fn ow_2_a_consumer_is_told_to_drop_its_copy_after_its_last_call_and_a_later_call_gets_it_again() {
    let mut t = Pair::new();
    let r = t.produce(P, direct(Transport::Shm, 64));
    let c1 = t.submit(C, &[r], Transport::ObjectStore);
    let c2 = t.submit(C, &[r], Transport::ObjectStore);
    assert_eq!(c1.release, [r]);
    assert!(
        c2.release.is_empty(),
        "a second call needs it: not the last"
    );
    t.messages();
    t.done(c1.call, through_driver(1));
    assert_eq!(t.sent(), "", "the second call still needs it");
    t.done(c2.call, through_driver(1));
    assert_eq!(t.sent(), format!("C free {r}"));
    assert!(
        t.table.objects.contains_key(&r),
        "the driver's ref holds it"
    );
    assert_eq!(t.copy_of(r, C), None);
    let c3 = t.submit(C, &[r], Transport::ObjectStore);
    assert_eq!(
        t.sent(),
        format!("C deliver {r} xfer 2, C call {}", c3.call)
    );
}

/// OW-2: the copy of a call that ended goes only once its receive is
/// acknowledged.
#[test]
fn ow_2_a_copy_is_dropped_only_once_its_receive_is_acknowledged() {
    let mut t = Pair::new();
    let r = t.produce(P, direct(Transport::Shm, 64));
    let c = t.submit(C, &[r], Transport::ObjectStore);
    t.messages();
    t.end(c.call, Err(Error::Protocol("refused".into())), NEVER_RAN);
    assert_eq!(t.sent(), "");
    assert!(t.received(1, C, Ok(())));
    assert_eq!(t.sent(), format!("C free {r}"));
    assert_eq!(t.table.transfers_in_flight(), 0);
}

/// OW-3: no second delivery to an actor receiving or holding a copy.
#[test]
fn ow_3_a_consumer_receiving_or_holding_a_copy_gets_no_second_delivery() {
    let mut t = Pair::new();
    let r = t.produce(P, direct(Transport::Shm, 64));
    let c1 = t.submit(C, &[r], Transport::ObjectStore);
    t.messages();
    let c2 = t.submit(C, &[r], Transport::ObjectStore);
    assert_eq!(t.sent(), format!("C call {}", c2.call), "receiving");
    t.done(c1.call, through_driver(1));
    assert_eq!(t.copy_of(r, C), Some(Copy::Held));
    t.messages();
    let c3 = t.submit(C, &[r], Transport::ObjectStore);
    assert_eq!(t.sent(), format!("C call {}", c3.call), "held");
    assert_eq!(t.table.transfers_in_flight(), 0);
}

/// OW-3: the producer never receives its own object.
#[test]
fn ow_3_the_producer_is_not_delivered_its_own_object() {
    let mut t = Pair::new();
    let r = t.produce(P, direct(Transport::Shm, 64));
    let p = t.submit(P, &[r], Transport::ObjectStore);
    assert_eq!(t.sent(), format!("P call {}", p.call));
    assert_eq!(t.table.transfers_in_flight(), 0);
    assert!(p.release.is_empty(), "OW-12: not for its producer");
}

/// OW-4: deliveries wait for a pending object and go out in order.
#[test]
fn ow_4_deliveries_of_a_pending_object_wait_and_go_out_in_order_when_it_is_ready() {
    let mut t = Pair::new();
    let p = t.submit(P, &[], Transport::Shm);
    let r = p.result;
    let c = t.submit(C, &[r], Transport::ObjectStore);
    let d = t.submit(D, &[r], Transport::ObjectStore);
    let calls = format!("P call {}, C call {}, D call {}", p.call, c.call, d.call);
    assert_eq!(t.sent(), calls);
    assert_eq!(t.table.transfers_in_flight(), 0);
    t.done(p.call, direct(Transport::Shm, 64));
    assert_eq!(
        t.sent(),
        format!("C deliver {r} xfer 1, D deliver {r} xfer 2")
    );
    assert_eq!(t.table.transfers_in_flight(), 2);
}

/// OW-4: a failed object is delivered as its error, now and later.
#[test]
fn ow_4_a_failed_object_is_delivered_to_its_waiting_and_later_consumers_as_its_error() {
    let mut t = Pair::new();
    let p = t.submit(P, &[], Transport::Shm);
    let r = p.result;
    t.submit(C, &[r], Transport::ObjectStore);
    t.messages();
    let err = Error::Application {
        actor: "P".into(),
        method: "make".into(),
        message: "boom".into(),
        typed: None,
    };
    t.end(p.call, Err(err.clone()), RAN);
    let m = t.messages();
    assert_eq!(log(&m), format!("C deliver {r} error"));
    assert_eq!(error_of(&m[0].1, r), err);
    let d = t.submit(D, &[r], Transport::ObjectStore);
    let m = t.messages();
    assert_eq!(log(&m), format!("D deliver {r} error, D call {}", d.call));
    assert_eq!(error_of(&m[0].1, r), err);
}

/// OW-5: a dead producer's pending objects fail, and their calls with them.
#[test]
fn ow_5_a_dead_producers_pending_object_fails_its_waiting_consumer() {
    let mut t = Pair::new();
    let p = t.submit(P, &[], Transport::Shm);
    let r = p.result;
    t.submit(C, &[r], Transport::ObjectStore);
    t.messages();
    let err = t.kill(P);
    let m = t.messages();
    assert_eq!(log(&m), format!("C deliver {r} error"));
    assert_eq!(error_of(&m[0].1, r), err);
    assert!(matches!(t.table.objects[&r].state, ObjState::Failed(_)));
}

/// OW-5: a dead producer's ready direct object fails; its receives abort.
#[test]
fn ow_5_a_dead_producers_ready_direct_object_fails_and_its_receives_are_aborted() {
    let mut t = Pair::new();
    let r = t.produce(P, direct(Transport::Shm, 64));
    t.submit(C, &[r], Transport::ObjectStore);
    t.messages();
    let err = t.kill(P);
    let m = t.messages();
    assert_eq!(log(&m), format!("C abort {r} xfer 1, C deliver {r} error"));
    assert!(matches!(&m[0].1, ToWorker::AbortTransfer { error, .. } if *error == err));
    assert_eq!(error_of(&m[1].1, r), err);
    assert_eq!(t.table.transfers_in_flight(), 0);
    // Its tensors died with it: a later consumer gets the death at once.
    let d = t.submit(D, &[r], Transport::ObjectStore);
    assert_eq!(t.sent(), format!("D deliver {r} error, D call {}", d.call));
}

/// OW-5: a dead consumer's transfers are dropped (the producer's send is
/// aborted) and its copies forgotten.
#[test]
fn ow_5_a_dead_consumers_transfer_is_aborted_at_the_producer_and_its_copy_forgotten() {
    let mut t = Pair::new().group(9, &[P, C]);
    let r = t.produce(P, direct(Transport::Tcp, 64));
    let c = t.submit(C, &[r], Transport::ObjectStore);
    let want = format!(
        "C deliver {r} xfer 1, P send {r} to C xfer 1, C call {}",
        c.call
    );
    assert_eq!(t.sent(), want);
    let err = t.kill(C);
    let m = t.messages();
    // What goes to the dead consumer is dropped by the driver's writer.
    let to_p: Vec<(u64, ToWorker)> = m.into_iter().filter(|(to, _)| *to == P).collect();
    assert_eq!(log(&to_p), format!("P abort {r} xfer 1"));
    assert!(matches!(&to_p[0].1, ToWorker::AbortTransfer { error, .. } if *error == err));
    assert_eq!(t.table.transfers_in_flight(), 0);
    assert_eq!(t.copy_of(r, C), None);
}

/// OW-6: a delivery too large for a frame becomes the error saying so.
#[test]
fn ow_6_a_value_too_large_for_a_frame_is_delivered_as_an_error_instead() {
    let mut t = Pair::new();
    t.table.outbox.set_max_frame(1024);
    let r = t.put(through_driver(4096));
    let c = t.submit(C, &[r], Transport::ObjectStore);
    let m = t.messages();
    assert_eq!(log(&m), format!("C deliver {r} error, C call {}", c.call));
    let err = error_of(&m[0].1, r);
    let limit = "exceeds the control frame limit";
    assert!(
        matches!(&err, Error::Protocol(s) if s.contains(limit)),
        "{err}"
    );
    assert_eq!(t.copy_of(r, C), Some(Copy::Held), "not delivered again");
    assert_eq!(t.table.transfers_in_flight(), 0);
}

/// OW-6: a send order too large for a frame aborts the consumer's receive.
#[test]
fn ow_6_a_send_order_too_large_for_a_frame_aborts_the_receive_it_pairs_with() {
    let mut t = Pair::new().group(9, &[P, C]);
    let r = t.produce(P, direct(Transport::Tcp, 64));
    let c_info = t.actors.get_mut(&C).expect("known");
    c_info.endpoints.insert("tcp".into(), "x".repeat(4000));
    t.table.outbox.set_max_frame(2048);
    let c = t.submit(C, &[r], Transport::ObjectStore);
    let m = t.messages();
    let want = format!(
        "C deliver {r} xfer 1, C abort {r} xfer 1, C call {}",
        c.call
    );
    assert_eq!(log(&m), want, "no send order to P");
    let too_large = |e: &Error| matches!(e, Error::Protocol(s) if s.contains("frame limit"));
    assert!(matches!(&m[1].1, ToWorker::AbortTransfer { error, .. } if too_large(error)));
    assert_eq!(t.table.transfers_in_flight(), 0, "none is tracked");
    assert_eq!(t.copy_of(r, C), Some(Copy::Held));
}

/// OW-7: one ordered queue: a delivery goes before the `Free` that frees it.
#[test]
fn ow_7_a_delivery_and_the_free_that_frees_it_go_out_in_decision_order() {
    let mut t = Pair::new();
    let p = t.submit(P, &[], Transport::ObjectStore);
    let r = p.result;
    let c1 = t.submit(C, &[r], Transport::ObjectStore);
    let c2 = t.submit(C, &[r], Transport::ObjectStore);
    t.table.dec(r);
    t.done(p.call, through_driver(16));
    t.done(c1.call, through_driver(1));
    t.done(c2.call, through_driver(1));
    let out = t.table.outbox.take();
    let m: Vec<(u64, ToWorker)> = out.iter().map(|o| (o.to, o.message())).collect();
    let calls = format!("P call {}, C call {}, C call {}", p.call, c1.call, c2.call);
    assert_eq!(
        log(&m),
        format!("{calls}, C deliver {r} xfer 0, C free {r}")
    );
    let soon: Vec<bool> = out.iter().map(|o| o.soon).collect();
    assert_eq!(
        soon,
        [false, false, false, false, true],
        "only a Free waits"
    );
    assert!(!t.table.objects.contains_key(&r));
}

/// OW-8: a two-sided transfer outside any live group gets an error.
#[test]
fn ow_8_a_two_sided_transfer_outside_any_group_is_delivered_as_an_error() {
    let mut t = Pair::new();
    let r = t.produce(P, direct(Transport::Tcp, 64));
    let c = t.submit(C, &[r], Transport::ObjectStore);
    let m = t.messages();
    assert_eq!(log(&m), format!("C deliver {r} error, C call {}", c.call));
    assert!(matches!(error_of(&m[0].1, r), Error::NotInGroup { object, .. } if object == r));
    assert_eq!(t.table.transfers_in_flight(), 0);
}

/// OW-8: the group is looked up when a waiting delivery goes out.
#[test]
fn ow_8_a_group_destroyed_while_the_object_was_pending_fails_its_waiting_delivery() {
    let mut t = Pair::new().group(9, &[P, C]);
    let p = t.submit(P, &[], Transport::Tcp);
    let r = p.result;
    t.submit(C, &[r], Transport::ObjectStore);
    t.messages();
    t.groups.0[0].live = false;
    t.done(p.call, direct(Transport::Tcp, 64));
    let m = t.messages();
    assert_eq!(log(&m), format!("C deliver {r} error"), "no send order");
    assert!(matches!(error_of(&m[0].1, r), Error::NotInGroup { .. }));
}

/// OW-8: inside a live group, both orders carry the group and both ranks.
#[test]
fn ow_8_inside_a_group_the_delivery_and_the_send_order_carry_the_group_and_ranks() {
    let mut t = Pair::new().group(9, &[C, P]);
    let r = t.produce(P, direct(Transport::Tcp, 64));
    let c = t.submit(C, &[r], Transport::ObjectStore);
    let m = t.messages();
    let want = format!(
        "C deliver {r} xfer 1, P send {r} to C xfer 1, C call {}",
        c.call
    );
    assert_eq!(log(&m), want);
    let (at_c, at_p) = ((0, 1), (1, 0));
    let ranks = |g: &Option<GroupRef>| g.map(|g| (g.id, (g.my_rank, g.peer_rank)));
    let ToWorker::Deliver { value: Ok(d), .. } = &m[0].1 else {
        panic!("{}", show(&m[0].1))
    };
    assert_eq!(ranks(&d.group), Some((9, at_c)));
    assert_eq!(d.from.as_ref().map(|p| p.actor), Some(P));
    assert!(!d.ack_at_landing);
    let ToWorker::SendTo { group, .. } = &m[1].1 else {
        panic!("{}", show(&m[1].1))
    };
    assert_eq!(ranks(group), Some((9, at_p)));
}

/// OW-9: a pending one-sided object goes straight from its producer (both
/// ends have a peer socket: the straight path is on), and the transfer's
/// deadline is armed at the producer's reply.
#[test]
fn ow_9_a_pending_one_sided_object_is_ordered_straight_from_its_producer() {
    let mut t = Pair::new().straight();
    let p = t.submit(P, &[], Transport::Shm);
    let r = p.result;
    let c = t.submit(C, &[r], Transport::ObjectStore);
    let m = t.messages();
    let want = format!(
        "P call {}, P order {r} to C xfer 1, C call {}",
        p.call, c.call
    );
    assert_eq!(log(&m), want);
    let path = "/run/rdt/peer-2.sock";
    assert!(matches!(&m[1].1, ToWorker::DeliverTo { to, .. } if to.path == path));
    assert_eq!(t.copy_of(r, C), Some(Copy::Receiving(1)));
    let in_flight = (t.table.transfers_in_flight(), t.table.transfers_unsettled());
    assert_eq!(in_flight, (1, 2));
    let none: (Vec<u64>, Vec<u64>) = (vec![], vec![]);
    assert_eq!(t.table.take_transfer_changes(), none, "no deadline yet");
    t.end(p.call, Ok(direct(Transport::Shm, 64)), (true, &[1], &[]));
    assert_eq!(t.sent(), "", "carried out: the driver delivers nothing");
    assert_eq!(t.table.take_transfer_changes(), (vec![1], vec![1]));
    assert_eq!(t.table.transfers_unsettled(), 1);
}

/// OW-9: a straight order the producer did not carry out is withdrawn and
/// the driver delivers, as to a consumer that waited.
#[test]
fn ow_9_a_straight_order_not_carried_out_is_delivered_by_the_driver() {
    let mut t = Pair::new().straight();
    let p = t.submit(P, &[], Transport::Shm);
    let r = p.result;
    t.submit(C, &[r], Transport::ObjectStore);
    t.messages();
    t.table.take_transfer_changes();
    t.end(p.call, Ok(direct(Transport::Shm, 64)), RAN);
    assert_eq!(t.sent(), format!("C deliver {r} xfer 2"));
    assert_eq!(t.table.take_transfer_changes(), (vec![2], vec![1]));
    assert_eq!(t.table.transfers_unsettled(), 1);
}

/// OW-9: a two-sided object is never ordered straight.
#[test]
fn ow_9_a_two_sided_object_waits_for_the_driver_even_with_the_straight_path_on() {
    let mut t = Pair::new().straight().group(9, &[P, C]);
    let p = t.submit(P, &[], Transport::Tcp);
    let r = p.result;
    let c = t.submit(C, &[r], Transport::ObjectStore);
    assert_eq!(t.sent(), format!("P call {}, C call {}", p.call, c.call));
    t.done(p.call, direct(Transport::Tcp, 64));
    assert_eq!(
        t.sent(),
        format!("C deliver {r} xfer 1, P send {r} to C xfer 1")
    );
}

/// The delivery from the driver's own copy of `n` bytes (OW-11).
fn assert_driver_copy(m: &[(u64, ToWorker)], r: u64, n: usize) {
    assert_eq!(log(m), format!("C deliver {r} xfer 0"));
    let ToWorker::Deliver { value: Ok(d), .. } = &m[0].1 else {
        panic!("{}", show(&m[0].1))
    };
    assert!(d.from.is_none(), "from the driver");
    assert_eq!(
        d.value.data_bytes().expect("here"),
        Bytes::from(vec![7u8; n])
    );
}

/// OW-11: a straight transfer acknowledged as failed is made good from
/// the driver's copy.
#[test]
fn ow_11_a_failed_straight_receive_is_delivered_again_from_the_drivers_copy() {
    let mut t = Pair::new().straight();
    let p = t.submit(P, &[], Transport::ObjectStore);
    let r = p.result;
    let c = t.submit(C, &[r], Transport::ObjectStore);
    let want = format!(
        "P call {}, P order {r} to C xfer 1, C call {}",
        p.call, c.call
    );
    assert_eq!(t.sent(), want);
    t.end(p.call, Ok(through_driver(32)), (true, &[1], &[]));
    assert_eq!(t.sent(), "");
    assert!(t.received(1, C, Err(link_broke())));
    assert_driver_copy(&t.messages(), r, 32);
    assert_eq!(t.copy_of(r, C), Some(Copy::Held));
    assert_eq!(t.table.transfers_in_flight(), 0);
}

/// OW-11: the producer's death aborts no straight transfer of a value
/// whole in the driver, which backs it.
#[test]
fn ow_11_the_producers_death_does_not_abort_a_straight_transfer_the_driver_backs() {
    let mut t = Pair::new().straight();
    let p = t.submit(P, &[], Transport::ObjectStore);
    let r = p.result;
    t.submit(C, &[r], Transport::ObjectStore);
    t.end(p.call, Ok(through_driver(32)), (true, &[1], &[]));
    t.messages();
    t.kill(P);
    assert_eq!(t.sent(), "", "no abort");
    assert_eq!(t.table.transfers_in_flight(), 1);
    assert!(matches!(t.table.objects[&r].state, ObjState::Ready(_)));
    assert!(t.received(1, C, Err(link_broke())));
    assert_driver_copy(&t.messages(), r, 32);
}

/// OW-12: a call that was its actor's only need of an argument names it in
/// `release`; the copy dropped by the callee needs no `Free`.
#[test]
fn ow_12_a_copy_the_consumer_released_itself_is_forgotten_without_a_free() {
    let mut t = Pair::new();
    let r = t.produce(P, direct(Transport::Shm, 64));
    let c = t.submit(C, &[r], Transport::ObjectStore);
    let m = t.messages();
    assert!(matches!(&m[1].1, ToWorker::Call(msg) if msg.release == [r]));
    t.done(c.call, through_driver(1));
    assert_eq!(t.sent(), "", "no Free");
    assert_eq!(t.table.released_by_callees, 1);
    assert_eq!(t.copy_of(r, C), None);
    assert!(t.table.objects.contains_key(&r));
}

/// OW-12: a copy released while a call submitted meanwhile needs it goes
/// again.
#[test]
fn ow_12_a_released_copy_that_a_call_submitted_meanwhile_needs_is_delivered_again() {
    let mut t = Pair::new();
    let r = t.produce(P, direct(Transport::Shm, 64));
    let c1 = t.submit(C, &[r], Transport::ObjectStore);
    let c2 = t.submit(C, &[r], Transport::ObjectStore);
    assert!(c2.release.is_empty());
    t.messages();
    // The worker had not read the second call when the first ended.
    t.end(c1.call, Ok(through_driver(1)), (true, &[], &[r]));
    assert_eq!(t.sent(), format!("C deliver {r} xfer 2"));
    assert_eq!(t.table.delivered_again, 1);
    assert_eq!(t.copy_of(r, C), Some(Copy::Receiving(2)));
}

/// OW-14: a `Getter::Value` is handed the value as the `CallDone` stores
/// it; a `Getter::Signal` waits for the unlock (`take_woken`).
#[test]
fn ow_14_a_value_getter_is_handed_the_value_when_the_call_done_stores_it() {
    let mut t = Pair::new();
    let p = t.submit(P, &[], Transport::ObjectStore);
    let (vtx, mut vrx) = oneshot::channel::<Result<WireValue, Error>>();
    let (stx, mut srx) = oneshot::channel::<()>();
    let e = t.table.objects.get_mut(&p.result).expect("pending");
    e.getters.push(Getter::Value(vtx));
    e.getters.push(Getter::Signal(stx));
    assert!(vrx.try_recv().is_err());
    t.done(p.call, through_driver(8));
    let v = vrx.try_recv().expect("handed").expect("the value");
    assert_eq!(v.data_bytes().expect("here"), Bytes::from(vec![7u8; 8]));
    assert_eq!(t.table.handed_values, 1);
    assert!(srx.try_recv().is_err(), "a signal waits for the unlock");
    t.table.take_woken().into_iter().for_each(Woken::wake);
    assert!(srx.try_recv().is_ok());
}

/// OW-14: a value getter is handed the error of a call that failed.
#[test]
fn ow_14_a_value_getter_is_handed_the_error_of_a_failed_call() {
    let mut t = Pair::new();
    let p = t.submit(P, &[], Transport::ObjectStore);
    let (vtx, mut vrx) = oneshot::channel::<Result<WireValue, Error>>();
    let e = t.table.objects.get_mut(&p.result).expect("pending");
    e.getters.push(Getter::Value(vtx));
    let err = Error::Protocol("boom".into());
    t.end(p.call, Err(err.clone()), RAN);
    assert_eq!(vrx.try_recv().expect("handed").unwrap_err(), err);
    assert_eq!(t.table.handed_values, 1);
    assert!(t.table.take_woken().is_empty());
}

/// Two tcp objects of `P` of 4096 bytes, large from 1000, and a group
/// with `C`.
fn large_pair() -> (Pair, u64, u64) {
    let mut t = Pair::new().group(9, &[P, C]);
    t.table.large_transfer_bytes = LargeTransferBytes(1000);
    let r1 = t.produce(P, direct(Transport::Tcp, 4096));
    let r2 = t.produce(P, direct(Transport::Tcp, 4096));
    (t, r1, r2)
}

fn acks_at_landing(m: &ToWorker) -> bool {
    matches!(m, ToWorker::Deliver { value: Ok(d), .. } if d.ack_at_landing)
}

/// OW-15: a second large two-sided transfer to a consumer for another call
/// is held, both ends, until the first ends.
#[test]
fn ow_15_a_large_send_for_another_call_is_held_until_the_one_ahead_ends() {
    let (mut t, r1, r2) = large_pair();
    let c1 = t.submit(C, &[r1], Transport::ObjectStore);
    let m = t.messages();
    let want = format!(
        "C deliver {r1} xfer 1, P send {r1} to C xfer 1, C call {}",
        c1.call
    );
    assert_eq!(log(&m), want);
    assert!(acks_at_landing(&m[0].1));
    let c2 = t.submit(C, &[r2], Transport::ObjectStore);
    assert_eq!(t.sent(), format!("C call {}", c2.call), "held: neither end");
    assert_eq!(t.table.sends_held, 1);
    assert_eq!(t.table.transfers_in_flight(), 2);
    assert!(t.received(1, C, Ok(())));
    let m = t.messages();
    assert_eq!(
        log(&m),
        format!("C deliver {r2} xfer 2, P send {r2} to C xfer 2")
    );
    assert!(acks_at_landing(&m[0].1));
}

/// OW-15: the large transfers one call needs go together.
#[test]
fn ow_15_the_large_transfers_of_one_call_go_together() {
    let (mut t, r1, r2) = large_pair();
    let c = t.submit(C, &[r1, r2], Transport::ObjectStore);
    let first = format!("C deliver {r1} xfer 1, P send {r1} to C xfer 1");
    let second = format!("C deliver {r2} xfer 2, P send {r2} to C xfer 2");
    assert_eq!(t.sent(), format!("{first}, {second}, C call {}", c.call));
    assert_eq!(t.table.sends_held, 0);
}

/// OW-15: a transfer aborted while held: the consumer gets the error as
/// the value, and neither end hears of the transfer.
#[test]
fn ow_15_a_send_aborted_while_held_is_never_sent_and_its_consumer_gets_the_error() {
    let (mut t, r1, r2) = large_pair();
    t.submit(C, &[r1], Transport::ObjectStore);
    t.submit(C, &[r2], Transport::ObjectStore);
    t.messages();
    let err = Error::Protocol("deadline".into());
    assert!(t.table.abort(2, err.clone(), &t.actors).is_some());
    let m = t.messages();
    assert_eq!(log(&m), format!("C deliver {r2} error"));
    assert_eq!(error_of(&m[0].1, r2), err);
    assert!(t.received(1, C, Ok(())));
    assert_eq!(t.sent(), "", "nothing left to release");
    assert_eq!(t.table.transfers_in_flight(), 0);
}

/// OW-15: a group being destroyed has its held sends sent first.
#[test]
fn ow_15_a_group_being_destroyed_has_its_held_sends_sent_at_once() {
    let (mut t, r1, r2) = large_pair();
    t.submit(C, &[r1], Transport::ObjectStore);
    t.submit(C, &[r2], Transport::ObjectStore);
    t.messages();
    t.table.send_held_in_group(9);
    assert_eq!(
        t.sent(),
        format!("C deliver {r2} xfer 2, P send {r2} to C xfer 2")
    );
    assert!(t.received(1, C, Ok(())));
    assert_eq!(t.sent(), "", "sent once");
}

/// OW-15: none of a dead consumer's held sends is sent.
#[test]
fn ow_15_a_held_send_is_never_sent_once_its_consumer_died() {
    let (mut t, r1, r2) = large_pair();
    t.submit(C, &[r1], Transport::ObjectStore);
    t.submit(C, &[r2], Transport::ObjectStore);
    t.messages();
    t.kill(C);
    let m = t.messages();
    let sends_r2 = |msg: &ToWorker| match msg {
        ToWorker::SendTo { object, .. } => *object == r2,
        ToWorker::Deliver { object, value } => *object == r2 && value.is_ok(),
        _ => false,
    };
    assert!(!m.iter().any(|(_, msg)| sends_r2(msg)), "{}", log(&m));
    assert_eq!(t.table.transfers_in_flight(), 0);
    assert!(t.table.held_sends.is_empty());
}
