struct Q;

impl Q {
    #[rdt::method(tensor_transport = "tcp")]
    async fn make(&mut self) -> u32 {
        1
    }
}

fn main() {}
