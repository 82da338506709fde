//! Two actors: a producer returns a map of tensors, a consumer reduces them.
//! The ref goes from the producer to the consumer; the tensors move with
//! the transport the producing method names. Run with
//! `cargo run --release --example quickstart`.

use std::collections::HashMap;
use std::time::Instant;

use rdt::prelude::*;

// ANCHOR: actors
#[rdt::actor]
pub struct Trainer {
    step: u64,
}

#[rdt::actor]
impl Trainer {
    fn new(step: u64) -> Self {
        Trainer { step }
    }

    /// Fresh "weights": `layers` tensors of `numel` f32 each. The tensors
    /// stay here until a consumer needs them.
    #[rdt::method(tensor_transport = "object_store")]
    async fn weights(&mut self, layers: usize, numel: usize) -> HashMap<String, Tensor> {
        self.step += 1;
        (0..layers)
            .map(|i| (format!("layer{i}"), Tensor::full((i + 1) as f32, &[numel])))
            .collect()
    }
}

#[rdt::actor]
pub struct Rollout;

#[rdt::actor]
impl Rollout {
    fn new() -> Self {
        Rollout
    }

    /// Receives real tensors: the framework moved them first.
    async fn load(&mut self, w: HashMap<String, Tensor>) -> rdt::Result<f64> {
        let mut total = 0.0;
        for t in w.values() {
            total += t.sum()?;
        }
        Ok(total)
    }
}
// ANCHOR_END: actors

// ANCHOR: main
#[rdt::main]
async fn main() -> rdt::Result<()> {
    let rt = Runtime::start().await?;
    let trainer = rt.spawn::<Trainer>(0).await?;
    let rollout = rt.spawn::<Rollout>(()).await?;

    let (layers, numel) = (8, 1 << 20);
    let bytes = layers * numel * 4;
    for round in 0..3 {
        let start = Instant::now();
        // Both calls return at once; the second waits for the first's value.
        let w: ObjectRef<HashMap<String, Tensor>> = trainer.weights(layers, numel).remote();
        let total = rt.get(rollout.load(&w).remote()).await?;
        let took = start.elapsed();
        let expected: f64 = (1..=layers).map(|i| (i * numel) as f64).sum();
        assert_eq!(total, expected, "the consumer saw every byte");
        println!(
            "round {round}: {layers} tensors, {:.1} MiB moved {} -> {} via {}, reduced to {total} in {:.2} ms ({:.2} GB/s)",
            bytes as f64 / (1 << 20) as f64,
            trainer.name(),
            rollout.name(),
            Transport::ObjectStore,
            took.as_secs_f64() * 1e3,
            bytes as f64 / took.as_secs_f64() / 1e9,
        );
    }
    rt.shutdown().await;
    Ok(())
}
// ANCHOR_END: main
