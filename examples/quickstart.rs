//! Two actors: a producer returns a map of tensors, a consumer reduces them.
//! The ref goes from the producer to the consumer; the tensors move
//! directly, with no copy: device memory over `cuda_ipc` when the machine
//! has an NVIDIA GPU, shared memory over `shm` otherwise. Each round is
//! then repeated over the object store for comparison. Run with
//! `cargo run --release --example quickstart` (add `-- --cpu` to stay on
//! the CPU).

use std::collections::HashMap;
use std::time::Instant;

use rdt::prelude::*;

// ANCHOR: actors
#[rdt::actor]
pub struct Trainer {
    step: u64,
    on_gpu: bool,
}

#[rdt::actor]
impl Trainer {
    /// `on_gpu`: make the weights on this worker's GPU.
    fn new(on_gpu: bool) -> Self {
        Trainer { step: 0, on_gpu }
    }

    /// Fresh "weights": `layers` tensors of `numel` f32 each, the i-th
    /// filled with i + 1. The tensors stay here and the consumer maps them:
    /// no copy. `shm` is this method's transport; a call may pick another
    /// (`cuda_ipc` for CUDA tensors).
    #[rdt::method(tensor_transport = "shm")]
    async fn weights(
        &mut self,
        layers: usize,
        numel: usize,
    ) -> rdt::Result<HashMap<String, Tensor>> {
        self.step += 1;
        (0..layers)
            .map(|i| {
                let v = (i + 1) as f32;
                let t = if self.on_gpu {
                    Tensor::cuda_full(v, &[numel], 0)?
                } else {
                    Tensor::full(v, &[numel])
                };
                Ok((format!("layer{i}"), t))
            })
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

    /// Receives real tensors: the framework moved them first. On a GPU,
    /// `sum` runs there.
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
    // A GPU if there is one (and `--cpu` was not given), else the CPU.
    let cuda = if std::env::args().any(|a| a == "--cpu") {
        Err("--cpu given".to_string())
    } else {
        rdt::data::cuda::available().map_err(|e| e.to_string())
    };
    let on_gpu = cuda.is_ok();
    let direct = if on_gpu {
        Transport::CudaIpc
    } else {
        Transport::Shm
    };
    match &cuda {
        Ok(()) => println!(
            "device: GPU ({}); direct transport: {direct}",
            rdt::data::cuda::gpu(0).map(|g| g.name())?
        ),
        Err(why) => println!("device: CPU ({why}); direct transport: {direct}"),
    }

    let rt = Runtime::start().await?;
    // `.gpus(1)` gives each worker one device (`CUDA_VISIBLE_DEVICES`).
    let gpus = if on_gpu { 1 } else { 0 };
    let trainer = rt.spawn::<Trainer>(on_gpu).gpus(gpus).await?;
    let rollout = rt.spawn::<Rollout>(()).gpus(gpus).await?;

    let (layers, numel) = (8, 1 << 20);
    let bytes = layers * numel * 4;
    let expected: f64 = (1..=layers).map(|i| (i * numel) as f64).sum();
    // The direct transport twice, then the object-store path for
    // comparison (per-call choices, like Ray's `.options(...)`).
    for transport in [direct, direct, Transport::ObjectStore] {
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
