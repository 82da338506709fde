//! The `weightsync` suite: `rdt::weights` end to end, per transport and
//! rollout count, beside the raw floors of the same bytes in the same run.
//!
//! - Per transport and rollout count (`--rollouts 1,4`): wall time per
//!   version (from the publish to the flip on every rollout; warm median
//!   of 5 versions after the two cold ones, the first into each of a
//!   rollout's two buffers, which have their own row), GB/s of all
//!   rollouts together, the trainer's blocked time (its publish), the
//!   flip, the receive's wait for its buffer's last readers, each
//!   rollout's peak memory and the trainer's exports (one per version,
//!   whatever the rollouts).
//! - Floors: one warm in-process copy of the same tensors (`memcpy`: per
//!   tensor, as a rollout copying from a trainer in its own process would;
//!   `memcpy_flat`: as one copy), and for N rollouts N such copies at once
//!   on N threads; the two-process floors of one reader (`raw_tcp`,
//!   `raw_nixl`, as in the transports suite); on a GPU, a flat device copy
//!   and a per-tensor copy loop of the same bytes.
//! - The many-tensor series: 1, 100, 1 000 and 10 000 tensors of the same
//!   40.96 MB per version, one rollout, per transport; µs per tensor
//!   against one tensor.
//!
//! `--model flat` (default: 1 000 f32 tensors of 64 KiB, the issue's
//! weight update), `toy`, `1.5b`, `8b` (DESIGN §9); `--transport NAME`
//! one transport; `--cpu` stays on the host where there is a GPU.

use std::time::Instant;

use rdt::prelude::*;
use rdt::weights::Layout;
use rdt_examples::sync::{flat_layout, model_layout, spawn_sync, SyncSetup};
use rdt_examples::{arg_value, Kind, Row};

const WARM: usize = 5;
/// The first version into each of a rollout's two buffers is cold (its
/// pages, a transport's registration of it): two cold versions.
const COLD: u64 = 2;
const SUITE: &str = "weightsync";

/// One configuration's versions: the cold one, the warm ones, and what
/// the trainer and the rollouts reported.
struct Run {
    /// The first version into each buffer of the rollouts.
    cold_us: Vec<f64>,
    warm_us: Vec<f64>,
    publish_us: Vec<f64>,
    flip_us: Vec<f64>,
    waited_us: Vec<f64>,
    exports: u64,
    buffers: usize,
    peak_rss_kib: u64,
}

/// The transports of the suite: the CPU ones of the transports suite, or
/// `cuda_ipc` and `nixl` on a GPU; `--transport NAME` one of them.
fn transports(gpu: bool) -> Vec<Transport> {
    let only = arg_value("--transport");
    let all = if gpu {
        [Transport::CudaIpc, Transport::Nixl]
            .into_iter()
            .filter(|t| super::usable(*t))
            .collect()
    } else {
        super::cpu_transports()
    };
    all.into_iter()
        .filter(|t| only.as_deref().is_none_or(|o| o == t.name()))
        .collect()
}

/// One trainer, `n` rollouts over `t`: a cold version, then `WARM` warm
/// ones, each checked by checksum on every rollout (untimed).
async fn sync_run(
    rt: &Runtime,
    layout: &Layout,
    t: Transport,
    n: usize,
    gpu: bool,
) -> rdt::Result<Run> {
    let setup = SyncSetup {
        layout: layout.clone(),
        transport: t.name().to_string(),
        gpu,
        in_place: false,
        verify: false,
    };
    let (trainer, rollouts) = spawn_sync(rt, &setup, n).await?;
    let mut run = Run {
        cold_us: vec![],
        warm_us: vec![],
        publish_us: vec![],
        flip_us: vec![],
        waited_us: vec![],
        exports: 0,
        buffers: 0,
        peak_rss_kib: 0,
    };
    for version in 1..=(WARM as u64 + COLD) {
        let (checksum, _) = rt.get(trainer.write(version).remote()).await?;
        let started = Instant::now();
        // The publish's ref goes to every rollout at once: no round trip
        // to the driver between the publish and the fan-out.
        let step = trainer.publish(version).remote();
        let calls: Vec<_> = rollouts
            .iter()
            .map(|r| r.receive_step(&step).remote())
            .collect();
        let got = rt.get_all(&calls).await?;
        let us = started.elapsed().as_secs_f64() * 1e6;
        let step = rt.get(&step).await?;
        for (i, r) in rollouts.iter().enumerate() {
            let sum = rt.get(r.checksum().remote()).await?;
            if sum != checksum || got[i].version != version {
                return Err(rdt::Error::Protocol(format!(
                    "{t}: rollout {i} holds version {} with checksum {sum}, the trainer wrote {checksum}",
                    got[i].version
                )));
            }
        }
        if version <= COLD {
            run.cold_us.push(us);
        } else {
            run.warm_us.push(us);
            run.publish_us.push(step.publish_us);
            run.flip_us.extend(got.iter().map(|g| g.flip_us));
            run.waited_us.extend(got.iter().map(|g| g.waited_us));
        }
        run.exports = step.exports;
        run.buffers = step.buffers;
        run.peak_rss_kib = got.iter().map(|g| g.peak_rss_kib).max().unwrap_or(0);
    }
    drop(rollouts);
    drop(trainer);
    Ok(run)
}

fn row(case: &str, transport: &str, device: &str, kind: Kind, bytes: u64, us: Vec<f64>) -> Row {
    Row::new(SUITE, case, transport, device, kind, bytes, us)
}

/// Warm copies of `n` tensors of `each` bytes into preallocated ones, on
/// `threads` threads at once (each its own destination, the same source):
/// the wall time of each round, µs.
fn host_copies(n: usize, each: usize, threads: usize) -> Vec<f64> {
    let src: Vec<Vec<u8>> = (0..n).map(|i| vec![i as u8; each]).collect();
    let mut dsts: Vec<Vec<Vec<u8>>> = (0..threads)
        .map(|_| (0..n).map(|_| vec![0u8; each]).collect())
        .collect();
    let mut us = Vec::new();
    for round in 0..=WARM {
        let started = Instant::now();
        std::thread::scope(|s| {
            for dst in dsts.iter_mut() {
                let src = &src;
                s.spawn(move || {
                    for (d, s) in dst.iter_mut().zip(src) {
                        d.copy_from_slice(std::hint::black_box(s));
                    }
                    std::hint::black_box(&dst);
                });
            }
        });
        if round > 0 {
            us.push(started.elapsed().as_secs_f64() * 1e6);
        }
    }
    us
}

/// On GPU 0 of this process: a flat device copy of `layout`'s arenas, and
/// a per-tensor copy loop of its parameters, µs per round.
async fn device_copies(layout: &Layout) -> rdt::Result<(Vec<f64>, Vec<f64>)> {
    let src = rdt::weights::ParamSet::cuda(layout, 0)?;
    let dst = src.empty_like()?;
    let (mut flat, mut loop_) = (Vec::new(), Vec::new());
    for round in 0..=WARM {
        let started = Instant::now();
        dst.copy_from(&src)?;
        dst.ready().await?;
        let a = started.elapsed().as_secs_f64() * 1e6;
        let started = Instant::now();
        for ((_, d), (_, s)) in dst.iter().zip(src.iter()) {
            d.copy_from(s)?;
        }
        dst.ready().await?;
        let b = started.elapsed().as_secs_f64() * 1e6;
        if round > 0 {
            flat.push(a);
            loop_.push(b);
        }
    }
    Ok((flat, loop_))
}

fn with(r: Row, rollouts: usize, tensors: usize) -> Row {
    Row {
        rollouts: Some(rollouts),
        tensors: Some(tensors),
        ..r
    }
}

/// The `weightsync` suite.
pub async fn weightsync(rt: &Runtime) -> rdt::Result<Vec<Row>> {
    let gpu = !std::env::args().any(|a| a == "--cpu") && rdt::data::cuda::available().is_ok();
    let device = if gpu { "cuda" } else { "cpu" };
    let model = arg_value("--model").unwrap_or_else(|| "flat".into());
    let layout = match model.as_str() {
        "flat" => flat_layout(1000, 64 << 10),
        m => model_layout(m)
            .ok_or_else(|| rdt::Error::Protocol(format!("--model {m}: flat, toy, 1.5b or 8b")))?,
    };
    let counts: Vec<usize> = arg_value("--rollouts")
        .unwrap_or_else(|| "1,4".into())
        .split(',')
        .filter_map(|n| n.parse().ok())
        .collect();
    let bytes = layout.nbytes() as u64;
    let tensors = layout.len();
    let case = |what: &str, n: usize| format!("{what} {model} x{n}");
    let mut rows = Vec::new();

    // The floors, same run.
    if gpu {
        let (flat, per_tensor) = device_copies(&layout).await?;
        rows.push(with(
            row(
                &case("version", 1),
                "device_copy",
                device,
                Kind::Bandwidth,
                bytes,
                flat,
            ),
            1,
            tensors,
        ));
        rows.push(with(
            row(
                &case("version", 1),
                "copy_loop",
                device,
                Kind::Bandwidth,
                bytes,
                per_tensor,
            ),
            1,
            tensors,
        ));
    } else {
        let each = bytes as usize / tensors;
        for &n in &counts {
            let us = host_copies(tensors, each, n);
            rows.push(with(
                row(
                    &case("version", n),
                    "memcpy",
                    device,
                    Kind::Bandwidth,
                    bytes * n as u64,
                    us,
                ),
                n,
                tensors,
            ));
            // The same bytes as one flat copy each (what an arena moves).
            let flat = host_copies(1, bytes as usize, n);
            rows.push(with(
                row(
                    &case("version", n),
                    "memcpy_flat",
                    device,
                    Kind::Bandwidth,
                    bytes * n as u64,
                    flat,
                ),
                n,
                tensors,
            ));
        }
        // The two-process floors of the same bytes, one reader.
        let label = format!("{model} x1");
        let relabel = |r: Row| Row {
            suite: SUITE.into(),
            case: case("version", 1),
            ..with(r, 1, tensors)
        };
        rows.push(relabel(super::bench_raw_tcp(bytes as usize, WARM, &label)));
        rows.extend(
            super::bench_raw_nixl(&[(bytes as usize, WARM, label.as_str())])
                .into_iter()
                .map(relabel),
        );
    }
    for t in transports(gpu) {
        for &n in &counts {
            let run = sync_run(rt, &layout, t, n, gpu).await?;
            let all = bytes * n as u64;
            let mk = |r: Row| Row {
                exports: Some(run.exports),
                peak_rss_kib: Some(run.peak_rss_kib),
                ..with(r, n, tensors)
            };
            rows.push(mk(row(
                &case("version", n),
                t.name(),
                device,
                Kind::Bandwidth,
                all,
                run.warm_us.clone(),
            )));
            rows.push(mk(row(
                &case("cold versions", n),
                t.name(),
                device,
                Kind::Bandwidth,
                all,
                run.cold_us.clone(),
            )));
            rows.push(mk(row(
                &case("trainer blocked", n),
                t.name(),
                device,
                Kind::Latency,
                0,
                run.publish_us.clone(),
            )));
            rows.push(mk(row(
                &case("flip", n),
                t.name(),
                device,
                Kind::Latency,
                0,
                run.flip_us.clone(),
            )));
            rows.push(mk(row(
                &case("wait for readers", n),
                t.name(),
                device,
                Kind::Latency,
                0,
                run.waited_us.clone(),
            )));
            eprintln!(
                "{t} x{n}: {} exports for {} versions, {} trainer buffers",
                run.exports,
                WARM as u64 + COLD,
                run.buffers
            );
        }
    }

    // The many-tensor series: the same bytes as 1 … 10 000 tensors.
    if arg_value("--model").is_none() {
        const TOTAL: usize = 10_000 * (4 << 10);
        for t in transports(gpu) {
            for count in [1usize, 100, 1000, 10_000] {
                let l = flat_layout(count, TOTAL / count);
                let run = sync_run(rt, &l, t, 1, gpu).await?;
                rows.push(with(
                    row(
                        &format!("{count} tensors of 40.96 MB"),
                        t.name(),
                        device,
                        Kind::Bandwidth,
                        TOTAL as u64,
                        run.warm_us,
                    ),
                    1,
                    count,
                ));
            }
        }
    }
    Ok(rows)
}

/// The suite's ratios: each version against its floor, fan-out against
/// N copies at once, µs per tensor against one tensor.
pub fn print_ratios(rows: &[Row]) {
    let ws: Vec<&Row> = rows.iter().filter(|r| r.suite == SUITE).collect();
    for r in ws.iter().filter(|r| {
        r.case.starts_with("version ")
            && !matches!(
                r.transport.as_str(),
                "memcpy" | "memcpy_flat" | "device_copy" | "copy_loop" | "raw_tcp" | "raw_nixl"
            )
    }) {
        let own_floor = format!("raw_{}", r.transport);
        for floor in [
            "memcpy",
            "memcpy_flat",
            "device_copy",
            "copy_loop",
            own_floor.as_str(),
        ] {
            if let Some(f) = ws.iter().find(|b| b.case == r.case && b.transport == floor) {
                println!(
                    "ratio: {} {} takes {:.2}x {floor} of the same bytes ({} exports)",
                    r.case,
                    r.transport,
                    r.median_us / f.median_us,
                    r.exports.unwrap_or(0)
                );
            }
        }
        if r.rollouts.unwrap_or(1) > 1 {
            let one = r
                .case
                .replace(&format!("x{}", r.rollouts.unwrap_or(1)), "x1");
            if let Some(o) = ws
                .iter()
                .find(|b| b.case == one && b.transport == r.transport)
            {
                println!(
                    "ratio: {} {} takes {:.2}x one rollout's version",
                    r.case,
                    r.transport,
                    r.median_us / o.median_us
                );
            }
        }
    }
    for r in ws.iter().filter(|r| r.case.starts_with("cold versions")) {
        let warm = r.case.replacen("cold versions", "version", 1);
        if let Some(w) = ws
            .iter()
            .find(|b| b.case == warm && b.transport == r.transport)
        {
            println!(
                "ratio: {} {} takes {:.2}x a warm one",
                r.case,
                r.transport,
                r.median_us / w.median_us
            );
        }
    }
    for r in ws
        .iter()
        .filter(|r| r.case.ends_with("tensors of 40.96 MB") && r.tensors > Some(1))
    {
        if let Some(one) = ws
            .iter()
            .find(|b| b.case == "1 tensors of 40.96 MB" && b.transport == r.transport)
        {
            let n = r.tensors.unwrap_or(1) as f64;
            println!(
                "ratio: {} {}: {:.3} us per tensor more than one tensor of the same bytes",
                r.case,
                r.transport,
                (r.median_us - one.median_us) / n
            );
        }
    }
}
