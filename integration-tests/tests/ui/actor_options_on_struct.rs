#[rdt::actor(max_concurrency = 4)]
pub struct P;

#[rdt::actor]
impl P {
    fn new() -> Self {
        P
    }

    async fn work(&self) -> u32 {
        1
    }
}

fn main() {}
