//! Bad input reaches a worker and gets a clear error; nothing is lost and
//! the actor keeps working. Calls are built by hand here (as a buggy or
//! mismatched client would) since the typed handles cannot express them.

use rdt::__private::Call;
use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::deadline;

#[tokio::test]
async fn wrong_argument_type_unknown_method_and_wrong_arity() {
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        // `sum` is method #0 and takes a Tensor: give it a string.
        let mut call = Call::<f64>::new(c.raw(), 0, "sum", Transport::ObjectStore);
        call.push_arg(Arg::Value("not a tensor".to_string()));
        let e = rt.get(call.remote()).await.unwrap_err();
        assert!(
            matches!(&e, Error::Decode { what, .. } if what.contains("argument t")),
            "{e}"
        );
        // A method index the actor does not have.
        let e = rt
            .get(Call::<u64>::new(c.raw(), 99, "nope", Transport::ObjectStore).remote())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("no method #99"), "{e}");
        // Too few arguments.
        let e = rt
            .get(Call::<f64>::new(c.raw(), 0, "sum", Transport::ObjectStore).remote())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("takes 1 arguments"), "{e}");
        // A result of another type than the caller expects: `seen` is
        // method #5 and returns a u64; ask for a String. postcard is not
        // self-describing, so the mismatch shows only where the bytes do
        // not fit: a u64 of 1 is the byte 0x01, a String of length 1 with
        // no byte after it (a 0 would read as the empty string).
        assert_eq!(
            rt.get(c.sum(Tensor::full(1.0f32, &[3])).remote())
                .await
                .unwrap(),
            3.0
        );
        assert_eq!(rt.get(c.seen().remote()).await.unwrap(), 1);
        let r = Call::<String>::new(c.raw(), 5, "seen", Transport::ObjectStore).remote();
        let e = rt.get(&r).await.unwrap_err();
        let want = format!("object {} as {}", r.id(), std::any::type_name::<String>());
        assert!(
            matches!(&e, Error::Decode { what, .. } if *what == want),
            "expected a decode error of {want:?}, got: {e}"
        );
        // The same call typed as a u64 reads the count.
        let as_u64 = Call::<u64>::new(c.raw(), 5, "seen", Transport::ObjectStore).remote();
        assert_eq!(rt.get(&as_u64).await.unwrap(), 1);
        // The actor is fine.
        assert_eq!(
            rt.get(c.sum(Tensor::full(2.0f32, &[2])).remote())
                .await
                .unwrap(),
            4.0
        );
    })
    .await;
}

#[tokio::test]
async fn tensor_transport_on_a_value_without_tensors_is_not_an_error() {
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        // tcp without a group is fine when nothing needs to move.
        assert_eq!(
            rt.get(p.echo(4).transport(Transport::Tcp).remote())
                .await
                .unwrap(),
            4
        );
    })
    .await;
}
