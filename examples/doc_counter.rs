use rdt::prelude::*;

#[rdt::actor]
pub struct Counter {
    total: f64,
}

#[rdt::actor]
impl Counter {
    fn new(start: f64) -> Self {
        Counter { total: start }
    }

    async fn add(&mut self, t: Tensor) -> rdt::Result<f64> {
        self.total += t.sum()?;
        Ok(self.total)
    }
}

#[rdt::main]
async fn main() -> rdt::Result<()> {
    let rt = Runtime::start().await?;
    let c = rt.spawn::<Counter>(1.0).await?;
    let total = rt.get(c.add(Tensor::full(2.0f32, &[4])).remote()).await?;
    assert_eq!(total, 9.0);
    Ok(())
}
