#[rdt::actor]
pub struct P;

#[rdt::actor]
impl P {
    fn new() -> Self {
        P
    }

    async fn greet(&mut self, name: &str) -> usize {
        name.len()
    }
}

fn main() {}
