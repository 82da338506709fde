use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::deadline;

#[tokio::test]
async fn point_to_point_object_store() {
    rdt_integration_tests::logs();
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        let t = p.make(2.0, 100).remote();
        let s = rt.get(c.sum(&t).remote()).await.unwrap();
        assert_eq!(s, 200.0);
        let back: Tensor = rt.get(&t).await.unwrap();
        assert_eq!(back.to_vec::<f32>().unwrap(), vec![2.0; 100]);
    })
    .await;
}
