//! Actors are clients too (DESIGN §3): an actor calls other actors with
//! refs it was given, puts, gets and waits inside its methods; refs and
//! handles travel in values, and the driver's owner table counts every
//! borrow, so an object lives exactly as long as a ref to it anywhere.

use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::{deadline, tcp_pair};

const DL: u64 = 90;

/// Actor A (a relay) calls actor B (a consumer) with a ref it got from the
/// driver; the tensor moves from the producer to B over `transport`, and
/// B's receive counter proves the direct path ran.
async fn relay_passes_a_driver_ref(transport: Transport) {
    let rt = Runtime::start().await.unwrap();
    let (p, c) = if transport == Transport::Tcp {
        // The relay is in no group: a collective ref may be passed by
        // anyone, not only the group's creator.
        let (p, c, _g) = tcp_pair(&rt).await;
        (p, c)
    } else {
        (
            rt.spawn::<Producer>(()).await.unwrap(),
            rt.spawn::<Consumer>(()).await.unwrap(),
        )
    };
    let relay = rt.spawn::<Relay>(()).await.unwrap();
    let name = transport.name().to_string();
    let before = rt.get(c.received(name.clone()).remote()).await.unwrap();

    let r = p.make(2.0, 1000).transport(transport).remote();
    let sum = rt.get(relay.sum_via(c.clone(), &r).remote()).await.unwrap();
    assert_eq!(sum, 2000.0);
    let after = rt.get(c.received(name.clone()).remote()).await.unwrap();
    assert_eq!(after, before + 1, "the consumer received over {name}");
    if transport != Transport::ObjectStore {
        // The relay itself moved no tensor (it got the f64 sum through
        // the object store).
        assert_eq!(rt.get(relay.received(name).remote()).await.unwrap(), 0);
    }

    // The ref of a call the relay made comes back to the driver.
    let inner = rt.get(relay.forward(c.clone(), &r).remote()).await.unwrap();
    assert_eq!(rt.get(&inner).await.unwrap(), 2000.0);

    drop((r, inner));
    // CL-2: the relay gives back its own borrow of `inner` right after its
    // reply, so the driver may not have read it yet. Any later reply of
    // the relay comes after that release on the same connection: one
    // round trip orders them.
    rt.get(relay.received(transport.name().to_string()).remote())
        .await
        .unwrap();
    rt.transfers_settled().await;
    assert_eq!(
        rt.live_objects(),
        0,
        "every object freed after its last ref"
    );
    rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn an_actor_calls_another_with_a_driver_ref_over_object_store() {
    deadline(DL, relay_passes_a_driver_ref(Transport::ObjectStore)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_actor_calls_another_with_a_driver_ref_over_shm() {
    deadline(DL, relay_passes_a_driver_ref(Transport::Shm)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_actor_calls_another_with_a_collective_ref_over_tcp() {
    deadline(DL, relay_passes_a_driver_ref(Transport::Tcp)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_actor_calls_another_with_a_driver_ref_over_nixl() {
    deadline(DL, relay_passes_a_driver_ref(Transport::Nixl)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_nested_ref_lives_until_its_last_borrower_drops_it() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let first = rt.spawn::<Relay>(()).await.unwrap();
        let second = rt.spawn::<Relay>(()).await.unwrap();
        let refs: Vec<ObjectRef<Tensor>> =
            (1..=3).map(|i| p.make_shm(i as f32, 10).remote()).collect();
        // Through two actors: the first hands the refs, nested in a Vec, to
        // the second, which keeps them.
        let kept = rt
            .get(first.hand_on(second.clone(), refs.clone()).remote())
            .await
            .unwrap();
        assert_eq!(kept, 3);
        // The driver drops its own refs: the second relay's borrows keep
        // the objects (and their tensors in the producer) alive.
        drop(refs);
        // The first relay got `keep`'s result straight from the second
        // (peer delivery), possibly before the second's call ended in the
        // driver: until it does, that result is still in the table.
        rt.transfers_settled().await;
        assert_eq!(rt.live_objects(), 3, "borrowed objects are alive");
        let sum = rt.get(second.sum_kept().remote()).await.unwrap();
        assert_eq!(sum, 10.0 * (1.0 + 2.0 + 3.0));
        // The last borrower drops them: its releases precede its reply on
        // the same connection, so they are counted when the reply is.
        assert_eq!(rt.get(second.drop_kept().remote()).await.unwrap(), 3);
        rt.transfers_settled().await;
        assert_eq!(
            rt.live_objects(),
            0,
            "owner table empty after the last borrower"
        );
        assert_eq!(
            rt.get(p.stored().remote()).await.unwrap(),
            0,
            "the producer freed the tensors"
        );
        rt.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_value_put_in_an_actor_is_got_in_another_actor_and_in_the_driver() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let maker = rt.spawn::<Relay>(()).await.unwrap();
        let taker = rt.spawn::<Relay>(()).await.unwrap();
        for transport in ["object_store", "shm"] {
            let before = rt.get(taker.received(transport).remote()).await.unwrap();
            let r: ObjectRef<Tensor> = rt
                .get(maker.put_tensor(1.5, 64, transport).remote())
                .await
                .unwrap();
            assert_eq!(
                rt.get(taker.get_sum(&r).remote()).await.unwrap(),
                96.0,
                "{transport}"
            );
            let after = rt.get(taker.received(transport).remote()).await.unwrap();
            assert_eq!(after, before + 1, "the taker received over {transport}");
            let t = rt.get(&r).await.unwrap();
            assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.5; 64], "{transport}");
            drop(r);
            // CL-2: the maker gives back its borrow of `r` after its reply;
            // a later reply of the maker orders that release before the
            // check.
            rt.get(maker.received(transport).remote()).await.unwrap();
            rt.transfers_settled().await;
            assert_eq!(rt.live_objects(), 0, "{transport}: freed");
        }
        rt.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn get_and_wait_inside_an_actor_see_errors_and_pending_objects() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let j = rt.spawn::<Juggler>(()).await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let relay = rt.spawn::<Relay>(()).await.unwrap();

        // One of two finishes; the other waits for a gate.
        let quick = j.nap(1, 1).remote();
        let gated = j.wait_gate(7).remote();
        let (done, pending) = rt
            .get(
                relay
                    .wait_some(vec![quick.clone(), gated.clone()], 1, 30_000)
                    .remote(),
            )
            .await
            .unwrap();
        assert_eq!((done, pending), (1, 1));
        // Asked for both with a short deadline: one is still pending.
        let (done, pending) = rt
            .get(relay.wait_some(vec![quick, gated.clone()], 2, 200).remote())
            .await
            .unwrap();
        assert_eq!((done, pending), (1, 1));
        rt.get(j.open_gate(7).remote()).await.unwrap();
        assert_eq!(rt.get(relay.get_u32(&gated).remote()).await.unwrap(), 7);

        // A failed object: the actor's get gives its error, typed.
        let failed = p.oops(1).remote();
        let e = rt.get(relay.get_sum(&failed).remote()).await.unwrap_err();
        assert_eq!(
            e.application_error::<Oops>(),
            Some(Oops::OutOfMemory { needed: 1 << 30 }),
            "{e}"
        );
        rt.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_borrower_that_dies_releases_its_borrows() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let relay = rt.spawn::<Relay>(()).await.unwrap();
        let refs: Vec<ObjectRef<Tensor>> =
            (0..4).map(|i| p.make_shm(i as f32, 8).remote()).collect();
        assert_eq!(rt.get(relay.keep(refs.clone()).remote()).await.unwrap(), 4);
        // Produced (a pending object is not freed before its reply).
        rt.wait_many(&refs, 4, None).await.unwrap();
        drop(refs);
        assert_eq!(rt.live_objects(), 4, "the relay's borrows keep them");
        relay.kill();
        relay.raw().exited().await.unwrap();
        rt.transfers_settled().await;
        assert_eq!(rt.live_objects(), 0, "a dead borrower borrows nothing");
        assert_eq!(rt.get(p.stored().remote()).await.unwrap(), 0);
        rt.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_ref_serialized_outside_rdt_is_a_clear_error() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let r = rt.put(&5u32).unwrap();
        let e = serde_json::to_string(&r).unwrap_err().to_string();
        assert!(e.contains("serialized and deserialized only by rdt"), "{e}");
        // A constructor argument cannot carry one (the spawn would not
        // count it): the spawn says so.
        let e = rt
            .spawn::<RefInConstructor>(r.clone())
            .await
            .map(|_| ())
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("a constructor argument cannot carry"),
            "{e}"
        );
        let e = serde_json::from_str::<ObjectRef<u32>>("7")
            .unwrap_err()
            .to_string();
        assert!(e.contains("serialized and deserialized only by rdt"), "{e}");
        // Inside an actor too: no borrow is taken behind the user's back.
        let relay = rt.spawn::<Relay>(()).await.unwrap();
        let e = rt
            .get(relay.ref_from_json(r.id().to_string()).remote())
            .await
            .unwrap();
        assert!(e.contains("serialized and deserialized only by rdt"), "{e}");
        rt.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_handle_in_a_constructor_argument_calls_its_actor() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        let d = rt.spawn::<Delegate>(c.clone()).await.unwrap();
        let r = p.make_shm(4.0, 25).remote();
        assert_eq!(rt.get(d.sum(&r).remote()).await.unwrap(), 100.0);
        assert_eq!(
            rt.get(c.received("shm").remote()).await.unwrap(),
            1,
            "the consumer the delegate was built with received the tensor"
        );
        rt.shutdown().await;
    })
    .await
}

/// Within 20 s, or the test fails (the wait it guards would be endless).
async fn within_20s<F: std::future::Future>(f: F) -> F::Output {
    tokio::time::timeout(std::time::Duration::from_secs(20), f)
        .await
        .expect("waiting for one's own call ends at once, not never")
}

/// A method that runs alone (any method of a serial actor, a `&mut self`
/// method of a concurrent one) and waits for a call it made to its own
/// actor would wait forever: that call starts only after the method
/// returns. The wait fails at once with an error that says so, the call
/// itself still runs afterwards (nothing is lost), and a `&self` method
/// of a concurrent actor may wait for its own calls.
#[tokio::test(flavor = "multi_thread")]
async fn waiting_inside_a_method_for_a_call_to_the_same_actor_is_an_error_not_a_hang() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let s = rt.spawn::<SelfCaller>(()).await.unwrap();
        let e = within_20s(rt.get(s.ping_self_and_wait(s.clone()).remote()))
            .await
            .unwrap_err();
        let text = e.to_string();
        assert!(text.contains("would never end"), "{text}");
        assert!(text.contains("SelfCaller"), "{text}");
        // With a deadline too: the error, not the deadline.
        let e = within_20s(rt.get(s.ping_self_and_wait_for(s.clone(), 60_000).remote()))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("would never end"), "{e}");
        // A call to itself that fails at submission is no endless wait:
        // its own error comes back.
        let e = within_20s(rt.get(s.bad_self_call_and_wait(s.clone()).remote()))
            .await
            .unwrap_err();
        let text = e.to_string();
        assert!(text.contains("an argument of SelfCaller#1.take"), "{text}");
        assert!(!text.contains("would never end"), "{text}");
        // wait_many with no deadline, too.
        let e = within_20s(rt.get(s.ping_self_and_wait_many(s.clone(), 1).remote()))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("would never end"), "{e}");
        // Every ping ran once its method returned (1 + 1 + 2); this is the fifth.
        assert_eq!(rt.get(s.ping().remote()).await.unwrap(), 5);
        // A ref to its own call, handed back without waiting, is fine.
        let later = rt.get(s.ping_self_later(s.clone()).remote()).await.unwrap();
        assert_eq!(rt.get(&later).await.unwrap(), 6);

        let j = rt.spawn::<Juggler>(()).await.unwrap();
        assert_eq!(
            within_20s(rt.get(j.nap_via_self(j.clone(), 41).remote()))
                .await
                .unwrap(),
            41
        );
        let e = within_20s(rt.get(j.exclusive_nap_via_self(j.clone(), 42).remote()))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("would never end"), "{e}");
        rt.shutdown().await;
    })
    .await
}

/// A ref and its clones hold one count in the owner table: cloning one
/// (as `&ref_` does for every call that takes it) is an atomic increment,
/// not a trip through the driver's state lock. The object lives while any
/// clone does, and goes with the last.
#[tokio::test(flavor = "multi_thread")]
async fn clones_of_a_ref_share_one_count_and_the_last_frees_the_object() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        let r = rt.put(&Tensor::full(2.0f32, &[8])).unwrap();
        let id = r.id();
        let clones: Vec<ObjectRef<Tensor>> = (0..100).map(|_| r.clone()).collect();
        assert_eq!(
            rt.ref_count(id),
            Some(1),
            "one count for the ref and its clones"
        );
        // Calls that take it by `&ref_` clone it for their argument.
        let sums: Vec<_> = clones[..10].iter().map(|x| c.sum(x).remote()).collect();
        for s in &sums {
            assert_eq!(rt.get(s).await.unwrap(), 16.0);
        }
        drop(sums);
        drop(r);
        let last = clones.last().cloned().unwrap();
        drop(clones);
        rt.transfers_settled().await;
        assert_eq!(rt.ref_count(id), Some(1), "the last clone keeps the object");
        assert_eq!(
            rt.get(&last).await.unwrap().to_vec::<f32>().unwrap(),
            vec![2.0; 8]
        );
        drop(last);
        rt.transfers_settled().await;
        assert_eq!(rt.ref_count(id), None, "freed with the last clone");
        assert_eq!(rt.live_objects(), 0);
        rt.shutdown().await;
    })
    .await
}

/// HO-6: a call to itself that the driver refuses at submission (here an
/// argument on `tcp`, whose producer shares no group with the caller) is
/// no endless wait either: the wait ends with the driver's own error, not
/// with "would never end" (at e05be92 it ended with `WouldDeadlock`, and
/// the call's id stayed among the actor's pending self-calls).
#[tokio::test(flavor = "multi_thread")]
async fn ho_6_a_self_call_the_driver_refused_ends_with_the_drivers_error() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let s = rt.spawn::<SelfCaller>(()).await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let t = p.make(1.0, 10).transport(Transport::Tcp).remote();
        let e = within_20s(
            rt.get(
                s.refused_self_call_and_wait(s.clone(), vec![t.clone()])
                    .remote(),
            ),
        )
        .await
        .unwrap_err();
        let text = e.to_string();
        assert!(!text.contains("would never end"), "{text}");
        assert!(text.contains("group"), "the driver's error: {text}");
        // The actor goes on.
        assert_eq!(rt.get(s.ping().remote()).await.unwrap(), 1);
        rt.shutdown().await;
    })
    .await
}
