#[rdt::actor]
pub struct P;

#[rdt::actor(max_concurrency = 4, concurrency_groups(io = 2))]
impl P {
    fn new() -> Self {
        P
    }

    #[rdt::method(concurrency_group = "compute")]
    async fn work(&self) -> u32 {
        1
    }
}

fn main() {}
