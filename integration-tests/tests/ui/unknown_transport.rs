use rdt::prelude::*;

#[rdt::actor]
pub struct P;

#[rdt::actor]
impl P {
    fn new() -> Self {
        P
    }

    #[rdt::method(tensor_transport = "infiniband")]
    async fn make(&mut self) -> Tensor {
        Tensor::full(1.0f32, &[1])
    }
}

fn main() {}
