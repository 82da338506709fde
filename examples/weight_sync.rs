//! Weight sync: a trainer publishes versions of a decoder's weights, N
//! rollouts receive each one in place while an inference loop keeps
//! reading, every version checked by checksum on every rollout.
//!
//! `cargo run --release --example weight_sync -- --model toy --rollouts 4`
//! runs on the CPU (over `shm`); on a GPU host (without `--cpu`) the
//! weights live on the GPU and move over `cuda_ipc`. `--transport` picks
//! another (`tcp`, `nixl`, `object_store`; `nccl` on GPUs), `--in-place`
//! receives straight into the live weights (no second buffer).

use std::time::Instant;

use clap::Parser;
use rdt::prelude::*;
use rdt_examples::sync::{model_layout, percentile, spawn_sync, SyncSetup};

/// Weight sync between a trainer and rollouts.
#[derive(Parser, Debug)]
struct Args {
    /// The layout: toy (CPU, CI), 1.5b or 8b (DESIGN §9).
    #[arg(long, default_value = "toy")]
    model: String,
    /// Rollouts receiving every version.
    #[arg(long, default_value_t = 4)]
    rollouts: usize,
    /// Versions published (the first is the cold one).
    #[arg(long, default_value_t = 6)]
    versions: u64,
    /// The transport (default: cuda_ipc on a GPU, shm on the CPU).
    #[arg(long)]
    transport: Option<String>,
    /// Stay on the CPU even if there is a GPU.
    #[arg(long)]
    cpu: bool,
    /// Receive straight into the live weights (inference waits meanwhile).
    #[arg(long)]
    in_place: bool,
    /// The inference loop's step, µs.
    #[arg(long, default_value_t = 2000)]
    step_us: u64,
}

#[rdt::main]
async fn main() -> rdt::Result<()> {
    let args = Args::parse();
    let gpu = !args.cpu && rdt::data::cuda::available().is_ok();
    let transport = args
        .transport
        .clone()
        .unwrap_or_else(|| if gpu { "cuda_ipc" } else { "shm" }.into());
    let layout = model_layout(&args.model)
        .ok_or_else(|| rdt::Error::Protocol(format!("--model {}: toy, 1.5b or 8b", args.model)))?;
    println!(
        "model {}: {} tensors, {:.1} MB; {} rollouts over {transport} ({}){}",
        args.model,
        layout.len(),
        layout.nbytes() as f64 / 1e6,
        args.rollouts,
        if gpu { "GPU" } else { "CPU" },
        if args.in_place { ", in place" } else { "" },
    );

    // ANCHOR: setup
    let rt = Runtime::start().await?;
    let setup = SyncSetup {
        layout,
        transport: transport.clone(),
        gpu,
        in_place: args.in_place,
        verify: true,
    };
    let (trainer, rollouts) = spawn_sync(&rt, &setup, args.rollouts).await?;
    for r in &rollouts {
        rt.get(r.start_inference(args.step_us).remote()).await?;
    }
    // ANCHOR_END: setup

    // receive: the slowest rollout's, from its start to the flip; wall:
    // the driver's, from the step's call to the last rollout's answer
    // (the step and the rollouts' checksums included).
    println!(
        "{:>7} {:>9} {:>11} {:>11} {:>9} {:>8} {:>8} {:>8}",
        "version", "step ms", "publish ms", "receive ms", "wall ms", "GB/s", "flip us", "exports"
    );
    let mut bad = 0;
    // ANCHOR: loop
    for version in 1..=args.versions {
        let started = Instant::now();
        // The trainer steps and publishes; the ref of that call goes to
        // every rollout at once, each receiving from the one export.
        let step = trainer.step(version).remote();
        let calls: Vec<_> = rollouts
            .iter()
            .map(|r| r.receive_step(&step).remote())
            .collect();
        let got = rt.get_all(&calls).await?;
        let received = started.elapsed();
        let step = rt.get(&step).await?;
        for (i, g) in got.iter().enumerate() {
            if g.version != version || g.checksum != step.checksum {
                eprintln!(
                    "rollout {i}: version {} checksum {} (the trainer's: {})",
                    g.version, g.checksum, step.checksum
                );
                bad += 1;
            }
        }
        // ANCHOR_END: loop
        let flip = got.iter().map(|g| g.flip_us).fold(0.0, f64::max);
        let receive_us = got
            .iter()
            .map(|g| g.waited_us + g.transfer_us + g.flip_us)
            .fold(0.0, f64::max);
        println!(
            "{version:>7} {:>9.2} {:>11.3} {:>11.3} {:>9.2} {:>8.2} {flip:>8.1} {:>8}{}",
            step.step_us / 1e3,
            step.publish_us / 1e3,
            receive_us / 1e3,
            received.as_secs_f64() * 1e3,
            step.published.bytes as f64 * got.len() as f64 / receive_us / 1e3,
            step.exports,
            if version == 1 { "  (cold)" } else { "" },
        );
    }

    println!(
        "inference steps of {} us, gaps beyond the step:",
        args.step_us
    );
    println!(
        "{:>8} {:>7} {:>11} {:>11} {:>13} {:>13} {:>6}",
        "rollout", "steps", "quiet p50", "quiet p99", "updating p50", "updating p99", "torn"
    );
    for (i, r) in rollouts.iter().enumerate() {
        let g = rt.get(r.stop_inference().remote()).await?;
        println!(
            "{i:>8} {:>7} {:>8.0} us {:>8.0} us {:>10.0} us {:>10.0} us {:>6}",
            g.steps,
            percentile(&g.quiet_us, 50.0),
            percentile(&g.quiet_us, 99.0),
            percentile(&g.updating_us, 50.0),
            percentile(&g.updating_us, 99.0),
            g.torn,
        );
        bad += g.torn as usize;
    }
    rt.shutdown().await;
    if bad > 0 {
        return Err(rdt::Error::Protocol(format!(
            "{bad} checksums or steps were wrong"
        )));
    }
    println!(
        "every checksum matched: {} versions on {} rollouts",
        args.versions, args.rollouts
    );
    Ok(())
}
