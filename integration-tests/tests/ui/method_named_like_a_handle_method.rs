#[rdt::actor]
pub struct P;

#[rdt::actor]
impl P {
    fn new() -> Self {
        P
    }

    async fn kill(&mut self) -> bool {
        true
    }
}

fn main() {}
