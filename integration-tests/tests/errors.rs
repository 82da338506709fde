//! What a caller writes and gets back: typed application errors (a
//! method's `Err(e)` comes back as `e` when its type is `Serialize`), and
//! borrowed arguments (`&str`, `&Tensor`).

use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::deadline;

const DL: u64 = 60;

#[tokio::test(flavor = "multi_thread")]
async fn a_typed_error_round_trips_to_the_driver_and_through_a_dependency() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();

        let oom = p.oops(1).remote();
        let e = rt.get(&oom).await.unwrap_err();
        // ANCHOR: typed_error
        // The caller matches on the method's own error type.
        match e.application_error::<Oops>() {
            Some(Oops::OutOfMemory { needed }) => assert_eq!(needed, 1 << 30),
            other => panic!("expected Oops::OutOfMemory, got {other:?} from {e}"),
        }
        // ANCHOR_END: typed_error
        // The message is still the error's Display.
        assert!(
            matches!(&e, Error::Application { method, message, .. }
                if method == "oops" && message == "out of memory: needs 1073741824 bytes"),
            "{e}"
        );
        // Another type does not decode it.
        assert_eq!(e.application_error::<String>(), None);

        // Passed to another actor: the call fails with a dependency error
        // that still carries the typed cause.
        let busy = p.oops(0).remote();
        let e = rt.get(c.sum(&busy).remote()).await.unwrap_err();
        assert!(matches!(e, Error::Dependency { .. }), "{e}");
        assert_eq!(
            e.application_error::<Oops>(),
            Some(Oops::Busy("try later".into()))
        );
        rt.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_error_that_is_only_display_keeps_its_message() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let e = rt.get(p.plain_error().remote()).await.unwrap_err();
        match &e {
            Error::Application { message, typed, .. } => {
                assert_eq!(message, "plain failure");
                assert_eq!(typed, &None);
            }
            other => panic!("expected an application error, got {other:?}"),
        }
        rt.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn str_and_tensor_references_pass_as_arguments() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        // `fail(msg: String)` takes a `&str`.
        let e = rt.get(p.fail("from a str").remote()).await.unwrap_err();
        assert!(e.to_string().contains("from a str"), "{e}");
        // `sum(t: Tensor)` takes a `&Tensor`, and the caller keeps it.
        let t = Tensor::full(1.5f32, &[4]);
        assert_eq!(rt.get(c.sum(&t).remote()).await.unwrap(), 6.0);
        assert_eq!(t.to_vec::<f32>().unwrap(), vec![1.5; 4]);
        rt.shutdown().await;
    })
    .await
}

/// ER-1: a chain of failed calls keeps its root cause and stays flat: the
/// error of the last call names the root (a typed application error) and
/// how many failed calls lie between, in a message of bounded size, and
/// nothing on the way recurses once per hop (at e05be92 each hop wrapped
/// the one before: 4 000 hops were a message of 400 KB, and 2 000–20 000
/// overflowed the driver's stack).
#[tokio::test(flavor = "multi_thread")]
async fn er_1_a_chain_of_failed_calls_keeps_its_root_cause_flat() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let a = rt.spawn::<Consumer>(()).await.unwrap();
        let b = rt.spawn::<Consumer>(()).await.unwrap();
        let hops = 4000;
        let mut r: ObjectRef<Tensor> = p.oops(0).remote();
        for i in 0..hops {
            let next = if i % 2 == 0 { &a } else { &b };
            r = next.pass(&r).remote();
        }
        let e = rt.get(&r).await.unwrap_err();
        assert_eq!(
            e.application_error::<Oops>(),
            Some(Oops::Busy("try later".into())),
            "the root cause is kept"
        );
        assert!(
            matches!(e.root_cause(), Error::Application { method, .. } if method == "oops"),
            "{:?}",
            e.root_cause()
        );
        match &e {
            Error::Dependency { hops: h, via, .. } => {
                assert_eq!(*h, hops, "every failed call counted");
                assert_eq!(via.len(), rdt::DEPENDENCY_VIA);
            }
            other => panic!("expected a dependency error, got {other}"),
        }
        let message = e.to_string();
        assert!(
            message.len() < 2048,
            "a flat message: {} bytes",
            message.len()
        );
        rt.shutdown().await;
    })
    .await
}
