//! The framework's semantic suite (mirroring Ray RDT's), run unchanged over
//! every CPU transport. Each test runs real worker processes.

use rdt::prelude::*;
use rdt_integration_tests::actors::*;

const DL: u64 = 60;

struct Setup {
    rt: Runtime,
    p: ProducerHandle,
    c: ConsumerHandle,
    c2: ConsumerHandle,
}

/// A producer and two consumers; for a collective transport, all three in
/// one group.
async fn setup_all(t: Transport) -> Setup {
    rdt_integration_tests::logs();
    let rt = Runtime::start().await.unwrap();
    let p = rt.spawn::<Producer>(()).await.unwrap();
    let c = rt.spawn::<Consumer>(()).await.unwrap();
    let c2 = rt.spawn::<Consumer>(()).await.unwrap();
    if t.is_collective() {
        rt.create_collective_group(&[p.id(), c.id(), c2.id()], t)
            .await
            .unwrap();
    }
    Setup { rt, p, c, c2 }
}

async fn setup(t: Transport) -> (Runtime, ProducerHandle, ConsumerHandle) {
    let s = setup_all(t).await;
    (s.rt, s.p, s.c)
}

pub async fn point_to_point(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let r = p.make(2.0, 1000).transport(t).remote();
    assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 2000.0);
    // A bigger one, to cross buffer sizes.
    let r = p.make(0.5, 3 << 20).transport(t).remote();
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        0.5 * (3 << 20) as f64
    );
    assert_path(&rt, &c, t, 2).await;
}

/// The consumer received exactly `n` objects over `t` and none over any
/// other transport: a direct transport that silently fell back to the
/// object store fails here.
async fn assert_path(rt: &Runtime, c: &ConsumerHandle, t: Transport, n: u64) {
    assert_path_within(rt, c, t, n..=n).await;
}

/// [`assert_path`] with at least `n` objects over `t`: a test whose
/// receives are not all counted once (a value received again after a
/// refused `get_into`) says how many it knows of.
async fn assert_path_at_least(rt: &Runtime, c: &ConsumerHandle, t: Transport, n: u64) {
    assert_path_within(rt, c, t, n..=u64::MAX).await;
}

async fn assert_path_within(
    rt: &Runtime,
    c: &ConsumerHandle,
    t: Transport,
    over_t: std::ops::RangeInclusive<u64>,
) {
    for other in Transport::registered() {
        let got = rt
            .get(c.received(other.name().to_string()).remote())
            .await
            .unwrap();
        if other == t {
            assert!(
                over_t.contains(&got),
                "{got} objects received over {t}, not {over_t:?}"
            );
        } else {
            assert_eq!(got, 0, "objects received over {other} (passing over {t})");
        }
    }
}

pub async fn nested_values_with_cpu_data(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let b = p.batch(7).transport(t).remote();
    let (step, label, s) = rt.get(c.batch_sum(&b).remote()).await.unwrap();
    assert_eq!(step, 7);
    assert_eq!(label, "batch-7");
    assert_eq!(s, 64.0 + 120.0 + 6.0 + 15.0 + 4.0);
    let w = p.weights(4).transport(t).remote();
    assert_eq!(rt.get(c.reduce(&w).remote()).await.unwrap(), 1024.0 * 6.0);
    assert_path(&rt, &c, t, 2).await;
}

pub async fn same_ref_twice_in_one_call(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let r = p.make(1.0, 10).transport(t).remote();
    let (s, shared) = rt.get(c.sum2(&r, &r).remote()).await.unwrap();
    assert_eq!(s, 20.0);
    assert!(
        shared,
        "one object arrives once: both arguments share its storage"
    );
}

pub async fn same_ref_to_two_calls_on_two_actors(t: Transport) {
    let Setup { rt, p, c, c2 } = setup_all(t).await;
    let r = p.make(1.0, 10).transport(t).remote();
    let a = c.sum(&r).remote();
    let b = c2.sum(&r).remote();
    assert_eq!(rt.get(&a).await.unwrap(), 10.0);
    assert_eq!(rt.get(&b).await.unwrap(), 10.0);
}

pub async fn same_ref_to_same_actor_twice(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let r = p.make(3.0, 10).transport(t).remote();
    let a = c.sum(&r).remote();
    let b = c.sum(&r).remote();
    assert_eq!(rt.get(&a).await.unwrap(), 30.0);
    assert_eq!(rt.get(&b).await.unwrap(), 30.0);
    assert_eq!(rt.get(c.seen().remote()).await.unwrap(), 2);
}

pub async fn gc_after_last_ref(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let r = p.make_kept(1.0, 10).transport(t).remote();
    let s = c.sum(&r).remote();
    assert_eq!(rt.get(&s).await.unwrap(), 10.0);
    drop(s);
    assert_eq!(rt.live_objects(), 1, "only the produced object is left");
    drop(r);
    // The value was still pending when the call came, so it went straight
    // to the consumer (OW-9); its result may reach the driver after the
    // consumer's answer (see the test below).
    rt.transfers_settled().await;
    assert_eq!(rt.live_objects(), 0, "the owner table freed the object");
    // Frees reach the workers before later calls (one ordered connection).
    assert_eq!(rt.get(p.stored().remote()).await.unwrap(), 0);
    assert_eq!(rt.get(c.stored().remote()).await.unwrap(), 0);
}

pub async fn gc_ref_dropped_before_consumer_finishes(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let r = p.make(2.0, 10).transport(t).remote();
    let s = c.sum(&r).remote();
    drop(r);
    assert_eq!(
        rt.get(&s).await.unwrap(),
        20.0,
        "a pending call keeps its argument alive"
    );
    drop(s);
    // The consumer's answer can reach the driver before the producer's:
    // a value still pending when the call came goes straight from the
    // producer to the consumer (OW-9), and the driver hears of that
    // delivery, and of the value's result, in the producer's CallDone, on
    // another connection. The object is freed once that has come
    // (`transfers_settled` waits for orders not answered yet).
    rt.transfers_settled().await;
    assert_eq!(rt.live_objects(), 0);
    assert_eq!(rt.get(p.stored().remote()).await.unwrap(), 0);
    assert_eq!(rt.get(c.stored().remote()).await.unwrap(), 0);
}

pub async fn put_and_by_value_arguments(t: Transport) {
    let (rt, _p, c) = setup(t).await;
    let r = rt.put(&Tensor::full(4i32, &[5])).unwrap();
    assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 20.0);
    let back: Tensor = rt.get(&r).await.unwrap();
    assert_eq!(back.to_vec::<i32>().unwrap(), vec![4; 5]);
    assert_eq!(
        rt.get(c.sum(Tensor::full(1.0f64, &[3])).remote())
            .await
            .unwrap(),
        3.0
    );
}

pub async fn app_error_to_driver_between_actors_and_inside_one(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let bad = p.fail("no weights today".to_string()).transport(t).remote();
    match rt.get(&bad).await {
        Err(Error::Application {
            method, message, ..
        }) => {
            assert_eq!(method, "fail");
            assert_eq!(message, "no weights today");
        }
        other => panic!("expected an application error, got {other:?}"),
    }
    // Between actors: the consumer's call fails naming the original.
    let e = rt.get(c.sum(&bad).remote()).await.unwrap_err();
    assert!(
        matches!(e, Error::Dependency { object, .. } if object == bad.id()),
        "{e}"
    );
    assert!(
        matches!(e.root_cause(), Error::Application { message, .. } if message == "no weights today")
    );
    assert!(e.to_string().contains("no weights today"), "{e}");
    // Inside one actor: the producer gets its own failed ref.
    let e = rt.get(p.is_kept(&bad, 0).remote()).await.unwrap_err();
    assert!(matches!(e.root_cause(), Error::Application { .. }), "{e}");
    // Both actors still work.
    assert_eq!(rt.get(p.echo(5).remote()).await.unwrap(), 5);
    assert_eq!(rt.get(c.seen().remote()).await.unwrap(), 0);
}

pub async fn panic_is_an_error_and_the_actor_lives(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let e = rt.get(p.boom().transport(t).remote()).await.unwrap_err();
    assert!(
        matches!(&e, Error::Panic { message, .. } if message.contains("boom on purpose")),
        "{e}"
    );
    let e = rt
        .get(c.sum(p.boom().transport(t).remote()).remote())
        .await
        .unwrap_err();
    assert!(matches!(e.root_cause(), Error::Panic { .. }), "{e}");
    assert_eq!(rt.get(p.echo(9).remote()).await.unwrap(), 9);
}

pub async fn actor_dies_before_producing(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let r = p.die().transport(t).remote();
    let downstream = c.sum(&r).remote();
    let e = rt.get(&r).await.unwrap_err();
    assert!(
        matches!(&e, Error::ActorDied { detail, .. } if detail.contains("status 7")),
        "{e}"
    );
    let e = rt.get(&downstream).await.unwrap_err();
    assert!(matches!(e.root_cause(), Error::ActorDied { .. }), "{e}");
    // Calls to the dead actor fail at once; the consumer is unaffected.
    assert!(matches!(
        rt.get(p.echo(1).remote()).await,
        Err(Error::ActorDied { .. })
    ));
    assert_eq!(
        rt.get(c.sum(Tensor::full(1.0f32, &[2])).remote())
            .await
            .unwrap(),
        2.0
    );
}

/// Kills the producer after its object is ready and before it is consumed.
/// Direct transports lose the object with its owner (a clear error);
/// the object store keeps it in the driver.
pub async fn actor_dies_before_object_is_consumed(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let r = p.make(1.0, 16).transport(t).remote();
    rt.wait(&r).await.unwrap();
    p.kill();
    // A call after the kill to the dead actor tells us the driver noticed.
    let e = rt.get(p.echo(1).remote()).await;
    let e = match e {
        Err(e) => e,
        Ok(_) => panic!("a killed actor answered"),
    };
    assert!(matches!(e, Error::ActorDied { .. }), "{e}");
    let res = rt.get(c.sum(&r).remote()).await;
    if t == Transport::ObjectStore {
        assert_eq!(
            res.unwrap(),
            16.0,
            "the object store holds the value in the driver"
        );
    } else {
        let e = res.unwrap_err();
        assert!(matches!(e.root_cause(), Error::ActorDied { .. }), "{e}");
    }
    assert_eq!(
        rt.get(c.seen().remote()).await.unwrap(),
        u64::from(t == Transport::ObjectStore)
    );
}

pub async fn unknown_transport_at_run_time(t: Transport) {
    let (_rt, p, _c) = setup(t).await;
    let e = p
        .make(1.0, 1)
        .tensor_transport("infiniband")
        .err()
        .expect("unknown name rejected");
    assert!(p.make(1.0, 1).tensor_transport(t.name()).is_ok());
    let msg = e.to_string();
    assert!(
        msg.contains("infiniband") && msg.contains("object_store") && msg.contains("cuda_ipc"),
        "{msg}"
    );
}

// ---- direct transports only ----

pub async fn pass_back_to_producer_is_zero_copy(t: Transport) {
    let (rt, p, _c) = setup(t).await;
    let r = p.make_kept(1.0, 10).transport(t).remote();
    assert!(
        rt.get(p.is_kept(&r, 0).remote()).await.unwrap(),
        "same storage, no copy"
    );
}

pub async fn mutability_warning_when_passed_back_and_elsewhere(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let r = p.make_kept(1.0, 10).transport(t).remote();
    rt.wait(&r).await.unwrap();
    let (captured, guard) = rdt_integration_tests::capture::warnings_on_this_thread();
    let a = p.is_kept(&r, 0).remote();
    assert!(
        captured.messages().is_empty(),
        "no warning for the producer alone"
    );
    let b = c.sum(&r).remote();
    drop(guard);
    assert!(
        captured.messages().iter().any(|m| m.contains("mutable")),
        "expected the mutability warning, got {:?}",
        captured.messages()
    );
    assert!(rt.get(&a).await.unwrap());
    assert_eq!(rt.get(&b).await.unwrap(), 10.0);
}

pub async fn wait_tensor_freed_waits_for_the_last_ref(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let r = p.make_kept(1.0, 10).transport(t).remote();
    rt.wait(&r).await.unwrap();
    assert!(
        !rt.get(p.wait_freed(0, 300).remote()).await.unwrap(),
        "not freed while a ref lives"
    );
    let s = c.sum(&r).remote();
    let w = p.wait_freed(0, 30_000).remote();
    drop(r);
    assert_eq!(rt.get(&s).await.unwrap(), 10.0);
    assert!(
        rt.get(&w).await.unwrap(),
        "freed once the last ref dropped and the call finished"
    );
}

macro_rules! suite {
    ($m:ident, $t:expr, [$($test:ident),* $(,)?]) => {
        mod $m {
            $(
                #[tokio::test]
                async fn $test() {
                    rdt_integration_tests::deadline(super::DL, super::$test($t)).await;
                }
            )*
        }
    };
}

/// Views of one flat buffer (overlapping ones, one of another dtype, and
/// the buffer itself) pass as one object and each arrives with its own
/// bytes.
pub async fn views_of_one_storage(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let r = p.views().transport(t).remote();
    let got = rt.get(c.describe_all(&r).remote()).await.unwrap();
    let local = flat_views(Tensor::arange::<f32>(1000));
    let want: Vec<(String, Vec<usize>, f64)> = local
        .iter()
        .map(|x| (x.dtype().to_string(), x.shape().to_vec(), x.sum().unwrap()))
        .collect();
    assert_eq!(got, want);
    // The u8 view reads the bytes of 996.0..=999.0.
    let bytes: f64 = [996f32, 997.0, 998.0, 999.0]
        .iter()
        .flat_map(|x| x.to_ne_bytes())
        .map(f64::from)
        .sum();
    assert_eq!(want[3].2, bytes);
    assert_path(&rt, &c, t, 1).await;
}

/// A weight update: an actor receives objects into its own parameters
/// (`get_into`), twice into the same tensors; targets that do not fit are
/// a clear error that loses nothing; the driver receives into its own
/// tensors too (a collective object: the driver's error).
pub async fn receive_into_target_tensors(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let (n, numel) = (3, 1000);
    let v1 = p.make_version(n, numel, 1.0).transport(t).remote();
    let (sums, same) = rt
        .get(c.update_params(&v1, n, numel).remote())
        .await
        .unwrap();
    assert_eq!(sums, [1000.0, 2000.0, 3000.0]);
    assert!(same, "the value got back holds the parameters themselves");
    let v2 = p.make_version(n, numel, 10.0).transport(t).remote();
    let (sums, same) = rt
        .get(c.update_params(&v2, n, numel).remote())
        .await
        .unwrap();
    assert_eq!(
        sums,
        [10000.0, 11000.0, 12000.0],
        "the second version, in the same tensors"
    );
    assert!(same);
    // Two targets for three tensors: the error says so, and the object is
    // still read whole afterwards.
    let v3 = p.make_version(n, numel, 5.0).transport(t).remote();
    let e = rt
        .get(c.update_params(&v3, n - 1, numel).remote())
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("holds 3 tensors and 2 targets were given"),
        "{e}"
    );
    let (sums, same) = rt
        .get(c.update_params(&v3, n, numel).remote())
        .await
        .unwrap();
    assert_eq!(sums, [5000.0, 6000.0, 7000.0]);
    assert!(same);
    // The receive itself wrote into the parameters (nixl reads into them,
    // tcp and shm copy into them as they receive); the object store's
    // value is copied in after.
    let in_place = rt.get(c.in_place().remote()).await.unwrap();
    if t != Transport::ObjectStore {
        assert!(
            in_place >= 2,
            "{in_place} updates received in place over {t}"
        );
    } else {
        assert_eq!(in_place, 0, "updates received in place over {t}");
    }
    // Every receive took the transport's path, none another.
    assert_path_at_least(&rt, &c, t, 3).await;
    // The driver.
    let mine: Vec<Tensor> = (0..n)
        .map(|_| Tensor::zeros(DType::F32, &[numel]))
        .collect();
    if t.is_collective() {
        let e = rt.get_into(&v2, &mine).await.unwrap_err();
        assert!(matches!(e, Error::CollectiveGet { .. }), "{e}");
        return;
    }
    let e = rt.get_into(&v2, &mine[..1]).await.unwrap_err();
    assert!(matches!(e, Error::Targets { .. }), "{e}");
    let got = rt.get_into(&v2, &mine).await.unwrap();
    let sums: Vec<f64> = mine.iter().map(|x| x.sum().unwrap()).collect();
    assert_eq!(sums, [10000.0, 11000.0, 12000.0]);
    assert!(got.iter().zip(&mine).all(|(g, m)| g.shares_storage(m)));
    // A second version into the same tensors.
    rt.get_into(&v3, &mine).await.unwrap();
    let sums: Vec<f64> = mine.iter().map(|x| x.sum().unwrap()).collect();
    assert_eq!(sums, [5000.0, 6000.0, 7000.0]);
}

/// A weight update that needs no value back (`load_into`): the object's
/// tensors land in the actor's kept parameters, step after step, with the
/// same path and the same errors as `get_into`; the driver loads into its
/// own tensors too (a collective object: the driver's error).
pub async fn load_into_target_tensors(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let (n, numel) = (3, 1000);
    let in_place_before = rt.get(c.in_place().remote()).await.unwrap();
    for first in [1.0f32, 10.0] {
        let v = p.make_version(n, numel, first).transport(t).remote();
        let sums = rt.get(c.load_kept(&v, n, numel).remote()).await.unwrap();
        let want: Vec<f64> = (0..n)
            .map(|i| f64::from(first + i as f32) * numel as f64)
            .collect();
        assert_eq!(sums, want, "version {first} in the kept parameters");
    }
    // The receive itself wrote into the parameters over every transport
    // but the object store, whose value is copied in after.
    let in_place = rt.get(c.in_place().remote()).await.unwrap() - in_place_before;
    if t == Transport::ObjectStore {
        assert_eq!(in_place, 0, "loads received in place over {t}");
    } else {
        assert_eq!(in_place, 2, "loads received in place over {t}");
    }
    // Another layout into the same parameters: a targets error, and the
    // object and the parameters are both intact.
    let other = p.make_version(n, numel + 1, 5.0).transport(t).remote();
    let e = rt
        .get(c.load_kept(&other, n, numel).remote())
        .await
        .unwrap_err();
    assert!(
        e.to_string().contains("target tensors given for object"),
        "a mismatch is a targets error: {e}"
    );
    let sums: Vec<f64> = rt.get(c.sums(&other).remote()).await.unwrap();
    assert_eq!(sums[0], 5.0 * (numel + 1) as f64, "the object is intact");
    // Every receive took the transport's path, none another.
    assert_path_at_least(&rt, &c, t, 3).await;
    // The driver.
    let v = p.make_version(n, numel, 20.0).transport(t).remote();
    let mine: Vec<Tensor> = (0..n)
        .map(|_| Tensor::zeros(DType::F32, &[numel]))
        .collect();
    if t.is_collective() {
        let e = rt.load_into(&v, &mine).await.unwrap_err();
        assert!(matches!(e, Error::CollectiveGet { .. }), "{e}");
        return;
    }
    let e = rt.load_into(&v, &mine[..1]).await.unwrap_err();
    assert!(matches!(e, Error::Targets { .. }), "{e}");
    rt.load_into(&v, &mine).await.unwrap();
    let sums: Vec<f64> = mine.iter().map(|x| x.sum().unwrap()).collect();
    assert_eq!(sums, [20000.0, 21000.0, 22000.0]);
    let got: Vec<Tensor> = rt.get(&v).await.unwrap();
    assert_eq!(got[2].sum().unwrap(), 22000.0, "still readable after");
}

/// TG-1: weights kept by name (a map) never land in the wrong parameter.
/// A rollout whose targets come from its own map, in its own map's order
/// (which is not the producer's: each process hashes differently), is
/// either refused with a targets error before any byte moves, or gets
/// every parameter right; never another layer's weights.
pub async fn tg_1_map_valued_weights_never_land_in_the_wrong_parameter(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let (n, numel) = (8, 64);
    let want: Vec<(String, f64)> = (0..n)
        .map(|i| {
            (
                format!("layer{i}.weight"),
                f64::from(1.0 + i as f32) * numel as f64,
            )
        })
        .collect();
    let w = p.make_named(n, numel, 1.0).transport(t).remote();
    match rt
        .get(c.load_named_by_position(&w, n, numel).remote())
        .await
    {
        Ok(got) => assert_eq!(got, want, "a parameter got another's weights over {t}"),
        // The actor's error comes back as its method's error, with the
        // targets error's text.
        Err(e) => assert!(
            e.to_string().contains("positional targets are refused"),
            "positional targets for a map are refused as such: {e}"
        ),
    }
}

/// TG-1: keyed targets put every parameter right: a map-valued update
/// received into a rollout's own map (its own iteration order), by
/// `load_into` and by `get_into`, twice into the same parameters; a
/// struct-valued update into a map kept by path; and the driver's own map.
pub async fn tg_1_keyed_targets_land_every_parameter_by_name(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let (n, numel) = (8, 64);
    let want = |first: f32| -> Vec<(String, f64)> {
        (0..n)
            .map(|i| {
                (
                    format!("layer{i}.weight"),
                    f64::from(first + i as f32) * numel as f64,
                )
            })
            .collect()
    };
    for (first, get) in [(1.0, false), (10.0, true), (20.0, false)] {
        let w = p.make_named(n, numel, first).transport(t).remote();
        let got = rt
            .get(c.load_named_by_key(&w, n, numel, get).remote())
            .await
            .unwrap();
        assert_eq!(got, want(first), "version {first} by key over {t}");
    }
    let layers = 3;
    let m = p.make_model(layers, numel, 1.0).transport(t).remote();
    let got = rt
        .get(c.load_model_by_key(&m, layers, numel).remote())
        .await
        .unwrap();
    let mut want_model = vec![("embed".to_string(), numel as f64)];
    for i in 0..layers {
        want_model.push((
            format!("layers.{i}.b"),
            f64::from(3.0 + 2.0 * i as f32) * numel as f64,
        ));
        want_model.push((
            format!("layers.{i}.w"),
            f64::from(2.0 + 2.0 * i as f32) * numel as f64,
        ));
    }
    want_model.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got, want_model, "a struct-valued update by path over {t}");
    // The driver, into its own map.
    let w = p.make_named(n, numel, 30.0).transport(t).remote();
    let mine = rdt_integration_tests::actors::named_weights(n, numel, 0.0);
    if t.is_collective() {
        let e = rt.load_into(&w, &mine).await.unwrap_err();
        assert!(matches!(e, Error::CollectiveGet { .. }), "{e}");
        return;
    }
    rt.load_into(&w, &mine).await.unwrap();
    assert_eq!(
        rdt_integration_tests::actors::named_sums(&mine).unwrap(),
        want(30.0)
    );
    let got = rt.get_into(&w, &mine).await.unwrap();
    assert!(got.iter().all(|(k, t)| t.shares_storage(&mine[k])));
}

/// TG-2: keyed targets that do not match (a key missing, a key extra, a
/// shape or a dtype that differs) fail before any byte lands, naming the
/// first differing key, and the object stays readable.
pub async fn tg_2_a_keyed_mismatch_names_the_first_differing_key(t: Transport) {
    let (rt, p, c) = setup(t).await;
    let (n, numel) = (4, 64);
    let w = p.make_named(n, numel, 1.0).transport(t).remote();
    let spec = |f: &dyn Fn(usize) -> Option<(String, DType, usize)>| -> Vec<_> {
        (0..n).filter_map(f).collect()
    };
    let key = |i: usize| format!("layer{i}.weight");
    type Spec = Vec<(String, DType, usize)>;
    let cases: Vec<(Spec, &str)> = vec![
        // layer2 missing from the targets.
        (
            spec(&|i| (i != 2).then(|| (key(i), DType::F32, numel))),
            "it has a tensor at `layer2.weight` and the targets have none",
        ),
        // An extra target key.
        (
            {
                let mut s = spec(&|i| Some((key(i), DType::F32, numel)));
                s.push(("layer1.bias".into(), DType::F32, numel));
                s
            },
            "the targets have `layer1.bias` and the object has no tensor there",
        ),
        // layer1's shape and layer3's dtype differ: layer1 comes first.
        (
            spec(&|i| {
                Some(match i {
                    1 => (key(i), DType::F32, numel + 1),
                    3 => (key(i), DType::F64, numel),
                    _ => (key(i), DType::F32, numel),
                })
            }),
            "its tensor `layer1.weight` is f32 [64] and the target `layer1.weight` is f32 [65]",
        ),
        (
            spec(&|i| Some((key(i), if i == 3 { DType::F64 } else { DType::F32 }, numel))),
            "`layer3.weight` is f32 [64] and the target `layer3.weight` is f64 [64]",
        ),
    ];
    for (spec, says) in cases {
        let e = rt
            .get(c.load_into_named(&w, spec).remote())
            .await
            .unwrap_err();
        assert!(e.to_string().contains(says), "over {t}: {e}");
    }
    // The object is whole, and fitting targets still take it.
    let got = rt
        .get(c.load_named_by_key(&w, n, numel, false).remote())
        .await
        .unwrap();
    assert_eq!(got[3].1, 4.0 * numel as f64);
    // The driver: the same error before any byte lands in its targets.
    if !t.is_collective() {
        let mut mine = rdt_integration_tests::actors::named_weights(n, numel, 0.0);
        mine.remove("layer0.weight");
        let before = rdt_integration_tests::actors::named_sums(&mine).unwrap();
        let e = rt.load_into(&w, &mine).await.unwrap_err();
        assert!(e.to_string().contains("`layer0.weight`"), "{e}");
        let after = rdt_integration_tests::actors::named_sums(&mine).unwrap();
        assert_eq!(after, before, "nothing landed");
        // Positional targets for a map-valued object: refused.
        let list: Vec<Tensor> = (0..n)
            .map(|_| Tensor::zeros(DType::F32, &[numel]))
            .collect();
        let e = rt.load_into(&w, &list).await.unwrap_err();
        assert!(
            e.to_string().contains("positional targets are refused"),
            "{e}"
        );
    }
}

/// TG-4 (cancel safety): a `get_into` dropped while its receive is under
/// way (a caller's timeout) writes nothing into its targets after the
/// drop; the object stays readable. At e05be92 the receive went on and
/// overwrote the targets later, after the caller had moved on.
pub async fn tg_4_a_dropped_get_into_writes_nothing_after_the_drop(t: Transport) {
    let (rt, p, c) = setup(t).await;
    // 64 MiB: a receive of tens of milliseconds on the dev machine.
    let (n, numel) = (8, 2 << 20);
    for ms in [2, 10, 30] {
        let v = p.make_version(n, numel, 1.0).transport(t).remote();
        rt.wait(&v).await.unwrap();
        let (timed_out, after_drop, later) = rt
            .get(c.get_into_dropped(&v, n, numel, ms).remote())
            .await
            .unwrap();
        // A `nixl` READ writes into the targets as its bytes come: the
        // drop aborts it, and `Targets::idle` waits for a READ already
        // posted to end or be cancelled. The object stays readable (the
        // `get` after the drop returned it whole).
        if timed_out {
            assert_eq!(
                later, after_drop,
                "over {t}, dropped at {ms} ms: the targets were written after the drop"
            );
        }
    }
}

macro_rules! common_suite {
    ($m:ident, $t:expr) => {
        suite!(
            $m,
            $t,
            [
                point_to_point,
                nested_values_with_cpu_data,
                same_ref_twice_in_one_call,
                same_ref_to_two_calls_on_two_actors,
                same_ref_to_same_actor_twice,
                gc_after_last_ref,
                gc_ref_dropped_before_consumer_finishes,
                put_and_by_value_arguments,
                app_error_to_driver_between_actors_and_inside_one,
                panic_is_an_error_and_the_actor_lives,
                actor_dies_before_producing,
                actor_dies_before_object_is_consumed,
                unknown_transport_at_run_time,
                views_of_one_storage,
                receive_into_target_tensors,
                load_into_target_tensors,
                tg_1_map_valued_weights_never_land_in_the_wrong_parameter,
                tg_1_keyed_targets_land_every_parameter_by_name,
                tg_2_a_keyed_mismatch_names_the_first_differing_key,
                tg_4_a_dropped_get_into_writes_nothing_after_the_drop,
            ]
        );
    };
}

macro_rules! direct_suite {
    ($m:ident, $t:expr) => {
        suite!(
            $m,
            $t,
            [
                pass_back_to_producer_is_zero_copy,
                mutability_warning_when_passed_back_and_elsewhere,
                wait_tensor_freed_waits_for_the_last_ref,
            ]
        );
    };
}

common_suite!(object_store, rdt::Transport::ObjectStore);
common_suite!(tcp, rdt::Transport::Tcp);
common_suite!(shm, rdt::Transport::Shm);
direct_suite!(tcp_direct, rdt::Transport::Tcp);
direct_suite!(shm_direct, rdt::Transport::Shm);
common_suite!(nixl, rdt::Transport::Nixl);
direct_suite!(nixl_direct, rdt::Transport::Nixl);
