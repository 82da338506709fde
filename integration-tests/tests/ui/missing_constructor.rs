#[rdt::actor]
pub struct P;

#[rdt::actor]
impl P {
    async fn ping(&mut self) -> u32 {
        1
    }
}

fn main() {}
