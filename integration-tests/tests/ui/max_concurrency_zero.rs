#[rdt::actor]
pub struct P;

#[rdt::actor(max_concurrency = 0)]
impl P {
    fn new() -> Self {
        P
    }

    async fn work(&self) -> u32 {
        1
    }
}

fn main() {}
