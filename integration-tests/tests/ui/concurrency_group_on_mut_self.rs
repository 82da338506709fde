#[rdt::actor]
pub struct P;

#[rdt::actor(concurrency_groups(io = 2))]
impl P {
    fn new() -> Self {
        P
    }

    #[rdt::method(concurrency_group = "io")]
    async fn work(&mut self) -> u32 {
        1
    }
}

fn main() {}
