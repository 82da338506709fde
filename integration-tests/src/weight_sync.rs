//! Weight-sync test actors: a trainer that writes version v as bytes all
//! equal to [`byte_of`]`(v)`, and a rollout whose reader thread checks
//! that every step sees one version whole.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rdt::prelude::*;
use rdt::weights::{Layout, ParamSet, Published, Publisher, Snapshot, Subscriber, Swap};
use serde::{Deserialize, Serialize};

/// Every byte of version `v`'s arenas.
pub fn byte_of(version: u64) -> u8 {
    (version % 251) as u8 + 1
}

/// A small layout of mixed dtypes, `scale` making its tensors larger.
pub fn test_layout(scale: usize) -> Layout {
    Layout::new([
        (
            "model.embed_tokens.weight",
            DType::BF16,
            vec![64 * scale, 32],
        ),
        (
            "model.layers.0.mlp.up_proj.weight",
            DType::F32,
            vec![32, 16 * scale],
        ),
        ("model.layers.0.self_attn.q_proj.bias", DType::F16, vec![32]),
        ("model.norm.weight", DType::BF16, vec![32]),
    ])
    .unwrap()
}

/// The trainer: a [`Publisher`] over the transport it was made with.
#[rdt::actor]
pub struct SyncTrainer {
    publisher: Publisher,
    /// The trainer's own parameters, for `publish_copy`.
    own: Option<ParamSet>,
}

#[rdt::actor]
impl SyncTrainer {
    /// `(layout, transport name)`; over `cuda_ipc`, the parameters are
    /// on the worker's GPU.
    fn new(args: (Layout, String)) -> Self {
        let transport = match args.1.as_str() {
            "tcp" => Transport::Tcp,
            "nixl" => Transport::Nixl,
            "object_store" => Transport::ObjectStore,
            "cuda_ipc" => Transport::CudaIpc,
            _ => Transport::Shm,
        };
        let first = if transport == Transport::CudaIpc {
            ParamSet::cuda(&args.0, 0).expect("GPU memory")
        } else {
            ParamSet::cpu(&args.0).expect("host memory")
        };
        SyncTrainer {
            publisher: Publisher::new(first, transport),
            own: None,
        }
    }

    /// The layout subscribers check.
    async fn layout(&self) -> Layout {
        self.publisher.layout().clone()
    }

    /// A training step: version `version` written into a buffer no reader
    /// holds, then published.
    async fn publish(&mut self, version: u64) -> rdt::Result<Published> {
        let buffer = self.publisher.next_buffer()?;
        for a in buffer.arenas() {
            a.fill_(byte_of(version))?;
        }
        self.publisher.publish(version, &buffer).await
    }

    /// The other way to publish: the trainer's own parameters (kept
    /// here, trained in place: every byte set to `byte_of(version)`)
    /// copied into a buffer no reader holds, and published.
    async fn publish_copy(&mut self, version: u64) -> rdt::Result<Published> {
        let own = match &self.own {
            Some(own) => own.clone(),
            None => {
                let own = self.publisher.next_buffer()?.empty_like()?;
                self.own = Some(own.clone());
                own
            }
        };
        for a in own.arenas() {
            a.fill_(byte_of(version))?;
        }
        let p = self.publisher.publish_copy(version, &own).await?;
        // The trainer goes on training at once: the next step's writes
        // land in its own parameters, never in the published copy.
        for a in own.arenas() {
            a.fill_(0u8)?;
        }
        Ok(p)
    }

    /// The buffers the publisher made so far.
    async fn buffers(&self) -> usize {
        self.publisher.stats().buffers
    }

    /// Versions published (one export each).
    async fn exports(&self) -> u64 {
        self.publisher.stats().exports
    }
}

/// What a rollout's reader thread saw.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct ReadStats {
    /// Steps read.
    pub steps: u64,
    /// Steps whose bytes were not all of the version they were labelled
    /// with.
    pub mixed: u64,
    /// The versions seen, in order, each once.
    pub versions: Vec<u64>,
}

/// The rollout: a [`Subscriber`] and, on demand, a reader thread.
#[rdt::actor]
pub struct SyncRollout {
    sub: Subscriber,
    reader: Option<(Arc<AtomicBool>, std::thread::JoinHandle<ReadStats>)>,
    held: Option<(Published, Snapshot)>,
}

/// Are all of a snapshot's bytes `byte`?
fn snapshot_whole(snap: &Snapshot, byte: u8) -> rdt::Result<bool> {
    all_bytes(&snap.arenas, byte)
}

/// Are all bytes of these host tensors `byte`?
fn all_bytes(arenas: &[Tensor], byte: u8) -> rdt::Result<bool> {
    let mut all = true;
    for a in arenas {
        all &= a.with_bytes(|b| b.iter().all(|&x| x == byte))?;
    }
    Ok(all)
}

/// Are all of `params`' bytes `byte`? (On a GPU: is their checksum that
/// of such bytes, every 16-bit word `byte * 257`.)
fn uniform(params: &ParamSet, byte: u8) -> rdt::Result<bool> {
    if params.is_cuda() {
        let words = (params.nbytes() / 2) as f64;
        return Ok(params.checksum()? == words * f64::from(byte) * 257.0);
    }
    all_bytes(params.arenas(), byte)
}

#[rdt::actor]
impl SyncRollout {
    /// `(layout, in place?, on the worker's GPU?)`.
    fn new(args: (Layout, bool, bool)) -> Self {
        let swap = if args.1 {
            Swap::InPlace
        } else {
            Swap::DoubleBuffered
        };
        let params = if args.2 {
            ParamSet::cuda(&args.0, 0).expect("GPU memory")
        } else {
            ParamSet::cpu(&args.0).expect("host memory")
        };
        SyncRollout {
            sub: Subscriber::new(params, swap).expect("a second buffer"),
            reader: None,
            held: None,
        }
    }

    /// Checks the publisher's layout.
    async fn subscribe(&mut self, publisher: Layout) -> rdt::Result<()> {
        self.sub.subscribe(&publisher)
    }

    /// Receives a version; returns the live version and whether its bytes
    /// are all that version's.
    async fn receive(&mut self, p: Published) -> rdt::Result<(u64, bool)> {
        let r = self.sub.receive(&p).await?;
        let cur = self.sub.weights().current();
        assert_eq!(cur.version(), Some(r.version));
        Ok((r.version, uniform(&cur, byte_of(r.version))?))
    }

    /// [`receive`](Self::receive) of a version passed as the ref of the
    /// trainer's `publish` call.
    async fn receive_published(&mut self, p: Published) -> rdt::Result<(u64, bool)> {
        self.receive(p).await
    }

    /// The live version and whether its bytes are whole.
    async fn live(&self) -> rdt::Result<(Option<u64>, bool)> {
        let cur = self.sub.weights().current();
        let whole = match cur.version() {
            Some(v) => uniform(&cur, byte_of(v))?,
            None => uniform(&cur, 0)?,
        };
        Ok((cur.version(), whole))
    }

    /// Objects this worker received, over any transport.
    async fn received(&self) -> u64 {
        rdt::runtime().metrics().received.values().sum()
    }

    /// A slow reader: takes the version's tensors themselves (a `get`,
    /// which over `shm` maps the trainer's memory) and keeps them, with
    /// the version, until [`release`](Self::release). Says whether they
    /// hold that version's bytes only.
    async fn take(&mut self, p: Published) -> rdt::Result<bool> {
        let snap = rdt::runtime().get(&p.weights).await?;
        let whole = snapshot_whole(&snap, byte_of(p.version))?;
        self.held = Some((p, snap));
        Ok(whole)
    }

    /// Lets go of what [`take`](Self::take) kept, saying whether it still
    /// held its version's bytes only.
    async fn release(&mut self) -> rdt::Result<bool> {
        let (p, snap) = self.held.take().expect("take first");
        snapshot_whole(&snap, byte_of(p.version))
    }

    /// Starts a reader thread: steps of `step_us` each, every one taking
    /// the live parameters and checking them whole; the last one begins
    /// after `stop_reading` was called.
    async fn start_reading(&mut self, step_us: u64) {
        let stop = Arc::new(AtomicBool::new(false));
        let weights = self.sub.weights();
        let flag = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut stats = ReadStats::default();
            // A step begins after each look at the flag, so one more step
            // runs once the stop is asked: it sees what was live by then.
            loop {
                let stopping = flag.load(Ordering::Acquire);
                let cur = weights.current();
                let byte = cur.version().map_or(0, byte_of);
                if !uniform(&cur, byte).unwrap() {
                    stats.mixed += 1;
                }
                if let Some(v) = cur.version() {
                    if stats.versions.last() != Some(&v) {
                        stats.versions.push(v);
                    }
                }
                stats.steps += 1;
                if stopping {
                    break;
                }
                std::thread::sleep(Duration::from_micros(step_us));
            }
            stats
        });
        self.reader = Some((stop, handle));
    }

    /// Stops the reader thread and returns what it saw.
    async fn stop_reading(&mut self) -> ReadStats {
        let (stop, handle) = self.reader.take().expect("start_reading first");
        stop.store(true, Ordering::Release);
        handle.join().expect("the reader thread")
    }
}

/// Publishes `version` and passes the publish call's ref to every
/// rollout at once (the driver never decodes the `Published`); asserts
/// each one holds that version, whole.
pub async fn publish_to_all(
    rt: &Runtime,
    trainer: &SyncTrainerHandle,
    rollouts: &[SyncRolloutHandle],
    version: u64,
) {
    let p = trainer.publish(version).remote();
    let calls: Vec<_> = rollouts
        .iter()
        .map(|r| r.receive_published(&p).remote())
        .collect();
    for c in calls {
        assert_eq!(
            rt.get(c).await.unwrap(),
            (version, true),
            "version {version}"
        );
    }
}
