#[rdt::actor]
pub struct P;

#[rdt::actor]
impl P {
    fn new() -> Self {
        P
    }

    #[rdt::method(transport = "tcp")]
    async fn make(&mut self) -> u32 {
        1
    }
}

fn main() {}
