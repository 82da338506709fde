//! Bring your own tensors: a tensor from another library comes in through
//! DLPack, travels to another actor and back, and goes out through DLPack,
//! its bytes, shape and dtype kept.

use rdt::data::dlpark::prelude::TensorView;
use rdt::data::dlpark::SafeManagedTensorVersioned;
use rdt::prelude::*;
use rdt_integration_tests::actors::Consumer;
use rdt_integration_tests::deadline;

#[tokio::test]
async fn a_dlpack_tensor_goes_to_an_actor_and_comes_back_out_through_dlpack() {
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        // ANCHOR: in
        // Another library's buffer (a Vec, as dlpark hands it out).
        let theirs: Vec<f32> = (0..1000).map(|i| i as f32).collect();
        let managed = SafeManagedTensorVersioned::new(theirs).unwrap();
        let t = Tensor::from_dlpack(managed).unwrap();
        assert_eq!((t.dtype(), t.shape()), (DType::F32, &[1000usize][..]));
        // ANCHOR_END: in

        let sum = rt.get(c.sum(t.clone()).remote()).await.unwrap();
        assert_eq!(sum, (0..1000).sum::<i32>() as f64);
        let plus_one: Tensor = rt.get(c.add_one(t.clone()).remote()).await.unwrap();
        drop(t);

        // ANCHOR: out
        let out = plus_one.to_dlpack().unwrap();
        assert!(out.read_only());
        assert_eq!(out.shape(), &[1000]);
        let back: &[f32] = out.as_slice_contiguous().unwrap();
        assert!(
            back.iter().enumerate().all(|(i, &x)| x == i as f32 + 1.0),
            "the actor's result, through DLPack"
        );
        // ANCHOR_END: out
        rt.shutdown().await;
    })
    .await;
}
