//! The weight-sync program's actors (`examples/weight_sync.rs`, and the
//! `weightsync` suite of `bench`): a trainer that steps its parameters
//! and publishes each version, rollouts that receive them while an
//! inference loop keeps reading, and the model layouts of DESIGN §9.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdt::data::half::bf16;
use rdt::prelude::*;
use rdt::weights::{Layout, ParamSet, Published, Publisher, Subscriber, Swap};
use serde::{Deserialize, Serialize};

/// The decoder layouts every weight-sync measurement uses (DESIGN §9): a
/// Qwen2-style decoder in bf16, names as in Hugging Face checkpoints.
/// `toy` (4 layers, 50 tensors, 9.97 MB), `1.5b` (338 tensors, 3.09 GB),
/// `8b` (1 106 tensors, 16.06 GB).
pub fn model_layout(model: &str) -> Option<Layout> {
    let (layers, h, inter, kv, vocab) = match model {
        "toy" => (4, 256, 1024, 128, 4096),
        "1.5b" => (28, 1536, 8960, 256, 151_936),
        "8b" => (92, 2048, 12_032, 384, 151_936),
        _ => return None,
    };
    let mut params = vec![("model.embed_tokens.weight".to_string(), vec![vocab, h])];
    for l in 0..layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        params.extend([
            (p("self_attn.q_proj.weight"), vec![h, h]),
            (p("self_attn.o_proj.weight"), vec![h, h]),
            (p("self_attn.q_proj.bias"), vec![h]),
            (p("self_attn.k_proj.weight"), vec![kv, h]),
            (p("self_attn.v_proj.weight"), vec![kv, h]),
            (p("self_attn.k_proj.bias"), vec![kv]),
            (p("self_attn.v_proj.bias"), vec![kv]),
            (p("mlp.gate_proj.weight"), vec![inter, h]),
            (p("mlp.up_proj.weight"), vec![inter, h]),
            (p("mlp.down_proj.weight"), vec![h, inter]),
            (p("input_layernorm.weight"), vec![h]),
            (p("post_attention_layernorm.weight"), vec![h]),
        ]);
    }
    params.push(("model.norm.weight".to_string(), vec![h]));
    Layout::new(params.into_iter().map(|(n, s)| (n, DType::BF16, s))).ok()
}

/// `n` f32 tensors of `each` bytes (`layer{i}.weight`): the shape of the
/// transports suite's weight update, and of the many-tensor series.
pub fn flat_layout(n: usize, each: usize) -> Layout {
    Layout::new((0..n).map(|i| (format!("layer{i:05}.weight"), DType::F32, vec![each / 4])))
        .expect("distinct names")
}

/// How a trainer or a rollout is made.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct SyncSetup {
    /// The parameters' layout.
    pub layout: Layout,
    /// The trainer's transport (`shm`, `tcp`, `nixl`, `object_store`,
    /// `cuda_ipc`, `nccl`).
    pub transport: String,
    /// On the worker's GPU (device 0 as it sees it), else host memory.
    pub gpu: bool,
    /// Rollouts: receive straight into the live parameters (no second
    /// buffer; readers wait for the receive).
    pub in_place: bool,
    /// Rollouts: checksum the live parameters after every receive (the
    /// benchmark asks for it apart, untimed).
    pub verify: bool,
}

fn params_for(s: &SyncSetup) -> rdt::Result<ParamSet> {
    if s.gpu {
        ParamSet::cuda(&s.layout, 0)
    } else {
        ParamSet::cpu(&s.layout)
    }
}

fn transport_named(name: &str) -> Transport {
    Transport::registered()
        .into_iter()
        .find(|t| t.name() == name)
        .unwrap_or(Transport::Shm)
}

/// What one training step and its publish cost the trainer.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Step {
    /// The version published.
    pub published: Published,
    /// The checksum of its bytes, as the trainer wrote them (NaN from
    /// `publish` alone).
    pub checksum: f64,
    /// The step (writing the new weights), µs.
    pub step_us: f64,
    /// The publish (the trainer blocked on rdt), µs.
    pub publish_us: f64,
    /// Buffers the trainer made so far.
    pub buffers: usize,
    /// Versions exported so far (one per publish, whatever the rollouts).
    pub exports: u64,
}

// ANCHOR: trainer
/// The trainer: its parameters are the publisher's buffers; a step writes
/// the next version into a buffer no rollout reads, and publishes it.
#[rdt::actor]
pub struct Trainer {
    publisher: Publisher,
    /// The buffer the last step wrote, until it is published.
    written: Option<ParamSet>,
}

#[rdt::actor]
impl Trainer {
    fn new(setup: SyncSetup) -> Self {
        let first = params_for(&setup).expect("the trainer's parameters");
        Trainer {
            publisher: Publisher::new(first, transport_named(&setup.transport)),
            written: None,
        }
    }

    /// The layout, for each rollout to check once.
    async fn layout(&self) -> Layout {
        self.publisher.layout().clone()
    }

    /// A training step (each parameter set to a value of this version),
    /// then the publish of the version.
    async fn step(&mut self, version: u64) -> rdt::Result<Step> {
        let (checksum, step_us) = self.write(version).await?;
        let mut step = self.publish(version).await?;
        step.checksum = checksum;
        step.step_us = step_us;
        Ok(step)
    }

    /// The training step alone: the next version written into a buffer
    /// no rollout reads. Returns its checksum and the time it took (µs).
    async fn write(&mut self, version: u64) -> rdt::Result<(f64, f64)> {
        let started = Instant::now();
        let buffer = self.publisher.next_buffer()?;
        for (i, (_, t)) in buffer.iter().enumerate() {
            let value = ((version * 31 + i as u64) % 1000) as f32 / 1000.0;
            match t.dtype() {
                DType::BF16 => t.fill_(bf16::from_f32(value))?,
                _ => t.fill_(value)?,
            }
        }
        buffer.ready().await?;
        let checksum = buffer.checksum()?;
        self.written = Some(buffer);
        Ok((checksum, started.elapsed().as_secs_f64() * 1e6))
    }

    /// The publish alone, of the buffer [`write`](Self::write) wrote.
    async fn publish(&mut self, version: u64) -> rdt::Result<Step> {
        let buffer = self
            .written
            .take()
            .ok_or_else(|| rdt::Error::Protocol("write a version before publishing it".into()))?;
        let publishing = Instant::now();
        let published = self.publisher.publish(version, &buffer).await?;
        let stats = self.publisher.stats();
        Ok(Step {
            published,
            checksum: f64::NAN,
            step_us: 0.0,
            publish_us: publishing.elapsed().as_secs_f64() * 1e6,
            buffers: stats.buffers,
            exports: stats.exports,
        })
    }
}
// ANCHOR_END: trainer

/// What a rollout's receive of one version took.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Got {
    /// The version now live.
    pub version: u64,
    /// The checksum of the live parameters.
    pub checksum: f64,
    /// Waiting for the buffer's last readers, µs.
    pub waited_us: f64,
    /// The bytes moving in, µs.
    pub transfer_us: f64,
    /// The flip, µs.
    pub flip_us: f64,
    /// The rollout's peak resident memory so far, KiB.
    pub peak_rss_kib: u64,
}

/// The inference loop's step gaps: between the starts of two steps, less
/// the step's fixed time, split by whether an update ran meanwhile.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Gaps {
    /// Steps run.
    pub steps: u64,
    /// Gaps (µs) of steps with no update under way.
    pub quiet_us: Vec<f64>,
    /// Gaps (µs) of steps during which an update ran or flipped.
    pub updating_us: Vec<f64>,
    /// Steps that saw a version other than the one they started with
    /// (never, by WS-6).
    pub torn: u64,
}

struct Inference {
    stop: Arc<AtomicBool>,
    thread: std::thread::JoinHandle<Gaps>,
}

// ANCHOR: spawn
/// A trainer and `n` rollouts made from `setup` (each on a GPU of its own
/// worker where `setup.gpu`), in one collective group over a collective
/// transport, every rollout subscribed: it checked the trainer's layout
/// once, by name.
pub async fn spawn_sync(
    rt: &Runtime,
    setup: &SyncSetup,
    n: usize,
) -> rdt::Result<(TrainerHandle, Vec<RolloutHandle>)> {
    let gpus = u32::from(setup.gpu);
    let trainer = rt.spawn::<Trainer>(setup.clone()).gpus(gpus).await?;
    let mut rollouts = Vec::new();
    for _ in 0..n {
        rollouts.push(rt.spawn::<Rollout>(setup.clone()).gpus(gpus).await?);
    }
    let t: Transport = setup.transport.parse()?;
    if t.is_collective() {
        let mut members = vec![trainer.id()];
        members.extend(rollouts.iter().map(|r| r.id()));
        rt.create_collective_group(&members, t).await?;
    }
    let layout = rt.get(trainer.layout().remote()).await?;
    for r in &rollouts {
        rt.get(r.subscribe(layout.clone()).remote()).await?;
    }
    Ok((trainer, rollouts))
}
// ANCHOR_END: spawn

// ANCHOR: rollout
/// A rollout: its own parameters, a subscriber receiving every version
/// into them, and an inference loop reading them all along.
#[rdt::actor]
pub struct Rollout {
    sub: Subscriber,
    verify: bool,
    /// When updates ran (from the receive's start to its flip).
    updates: Arc<Mutex<Vec<(Instant, Instant)>>>,
    inference: Option<Inference>,
}

#[rdt::actor]
impl Rollout {
    fn new(setup: SyncSetup) -> Self {
        let params = params_for(&setup).expect("the rollout's parameters");
        let swap = if setup.in_place {
            Swap::InPlace
        } else {
            Swap::DoubleBuffered
        };
        Rollout {
            sub: Subscriber::new(params, swap).expect("a second buffer"),
            verify: setup.verify,
            updates: Default::default(),
            inference: None,
        }
    }

    /// Checks the trainer's layout, once.
    async fn subscribe(&mut self, layout: Layout) -> rdt::Result<()> {
        self.sub.subscribe(&layout)
    }

    /// Receives a version into the buffer inference does not read, then
    /// flips it in; the checksum is of the parameters now live.
    async fn receive(&mut self, published: Published) -> rdt::Result<Got> {
        let started = Instant::now();
        let r = self.sub.receive(&published).await?;
        self.updates.lock().push((started, Instant::now()));
        let checksum = if self.verify {
            self.sub.weights().current().checksum()?
        } else {
            f64::NAN
        };
        Ok(Got {
            version: r.version,
            checksum,
            waited_us: r.waited.as_secs_f64() * 1e6,
            transfer_us: r.transfer.as_secs_f64() * 1e6,
            flip_us: r.flip.as_secs_f64() * 1e6,
            peak_rss_kib: peak_rss_kib(),
        })
    }

    /// [`receive`](Self::receive) of a trainer's [`Step`]: passed as the
    /// ref of the trainer's `publish` call, the driver fans a version out
    /// without waiting for the publish to return first.
    async fn receive_step(&mut self, step: Step) -> rdt::Result<Got> {
        self.receive(step.published).await
    }

    /// The checksum of the live parameters.
    async fn checksum(&self) -> rdt::Result<f64> {
        self.sub.weights().current().checksum()
    }

    /// Starts the inference loop: steps of `step_us` each, every one
    /// taking the live weights at its start and reading from them.
    async fn start_inference(&mut self, step_us: u64) {
        let weights = self.sub.weights();
        let updates = self.updates.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let step = Duration::from_micros(step_us);
            let mut gaps = Gaps::default();
            let mut last: Option<Instant> = None;
            while !flag.load(Ordering::Acquire) {
                let began = Instant::now();
                if let Some(prev) = last {
                    let gap = (began - prev).saturating_sub(step).as_secs_f64() * 1e6;
                    let busy = updates.lock().iter().any(|&(a, b)| a < began && b > prev);
                    if busy {
                        gaps.updating_us.push(gap);
                    } else {
                        gaps.quiet_us.push(gap);
                    }
                }
                last = Some(began);
                // One step: the weights of one version, read, held for the
                // step's time.
                let current = weights.current();
                let version = current.version();
                let _ = current.arenas().first().map(|a| a.nbytes());
                let end = began + step;
                if let Some(left) = end.checked_duration_since(Instant::now()) {
                    std::thread::sleep(left);
                }
                if current.version() != version {
                    gaps.torn += 1;
                }
                gaps.steps += 1;
            }
            gaps
        });
        self.inference = Some(Inference { stop, thread });
    }

    /// Stops the inference loop and returns its step gaps.
    async fn stop_inference(&mut self) -> Gaps {
        match self.inference.take() {
            Some(i) => {
                i.stop.store(true, Ordering::Release);
                i.thread.join().unwrap_or_default()
            }
            None => Gaps::default(),
        }
    }
}
// ANCHOR_END: rollout

/// This process's peak resident memory (`VmHWM`), KiB; 0 where `/proc`
/// does not tell.
pub fn peak_rss_kib() -> u64 {
    crate::status_kib(None, "VmHWM:")
}

/// The `p`-th percentile (0–100) of `v`; NaN when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    s[((s.len() - 1) as f64 * p / 100.0).round() as usize]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_layouts_are_design_s_table() {
        for (m, tensors, bytes) in [
            ("toy", 50, 9_970_176),
            ("1.5b", 338, 3_087_428_608),
            ("8b", 1_106, 16_058_644_480),
        ] {
            let l = model_layout(m).unwrap();
            assert_eq!((l.len(), l.nbytes()), (tensors, bytes), "{m}");
        }
    }
}
