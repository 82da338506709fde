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
    /// stay here, in shared memory, and the consumer maps them: no copy.
    #[rdt::method(tensor_transport = "shm")]
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
    let expected: f64 = (1..=layers).map(|i| (i * numel) as f64).sum();
    // The method's own transport (shm), then the object-store path for
    // comparison (a per-call override, like Ray's `.options(...)`).
    for transport in [Transport::Shm, Transport::Shm, Transport::ObjectStore] {
        let start = Instant::now();
        // The call returns a ref at once; `wait` only times the producer.
        let w: ObjectRef<HashMap<String, Tensor>> =
            trainer.weights(layers, numel).transport(transport).remote();
        rt.wait(&w).await?;
        let produced = start.elapsed();
        // Passing the ref moves the tensors to the consumer, then `load` runs.
        let total = rt.get(rollout.load(&w).remote()).await?;
        let moved = start.elapsed() - produced;
        assert_eq!(total, expected, "the consumer saw every byte");
        println!(
            "{layers} tensors, {:.1} MiB, {} -> {} via {transport}: produced in {:6.2} ms, moved and reduced in {:6.2} ms",
            bytes as f64 / (1 << 20) as f64,
            trainer.name(),
            rollout.name(),
            produced.as_secs_f64() * 1e3,
            moved.as_secs_f64() * 1e3,
        );
    }
    rt.shutdown().await;
    Ok(())
}
// ANCHOR_END: main
