//! CUDA benchmark: `cargo run --release --example bench_cuda -- [--json PATH] [--quick]`.
//!
//! Measures the hand-off of a CUDA tensor between two actors, cleanly: the
//! producer returns a tensor it made (and finished on the GPU) once and
//! kept, like `bench.rs`'s `Source::tensor`, so a **pass** is only: the
//! driver asks the producer for the ref, hands it to the consumer, the
//! consumer's stream waits for the producer's event and the consumer sees
//! the tensor usable on its GPU (`cuda_ready`), and its answer reaches the
//! driver. No fill or allocation is timed.
//!
//! For each placement (`same_gpu`: both actors on GPU 0; `cross_gpu`:
//! producer on GPU 0, consumer on GPU 1, when two are visible) and size:
//! * `pass_first_open`: the first `cuda_ipc` pass to a fresh consumer (it
//!   opens the producer's event and maps the slab); the producer made the
//!   tensor before, untimed.
//! * `pass_cached`: later `cuda_ipc` passes (mapping cached).
//! * `pass_copy`: `cuda_ipc` passes in copy mode: the consumer makes its own
//!   copy of the tensor (`Tensor::deep_copy`, a device-to-device copy
//!   ordered after the producer's event) and waits for it.
//! * `pass` over `object_store` on the same tensor (GPU → host → driver →
//!   host → GPU), after one unmeasured pass (host buffer pools warm up).
//! * `memcpy_dtod`: a raw `cuMemcpyDtoDAsync` of the same bytes in the
//!   driver process (GPU 0 → GPU 0, or GPU 0 → GPU 1 with peer access),
//!   waited for the same way.
//! * `many10000_pass_cached` and `one40M_pass_cached`: the per-tensor
//!   cost, a kept object of 10 000 tensors of 4 KiB against one kept
//!   tensor of the same 40.96 MB, passed over `cuda_ipc` in turn.
//!
//! and the control plane in the same run: `actor_call_rtt` (a tiny call to
//! the consumer) and `ref_chain_rtt` (a tiny value passed by ref from the
//! producer to the consumer: the same two calls as a pass, without a
//! tensor). Rows use the harness schema (`suite, case, transport, device,
//! bytes, iters, median_us, p90_us, kind, gbps`) plus `placement`,
//! `device_name` and `commit` (from `RDT_COMMIT`, set by
//! `scripts/gpu-bundle.sh`).
//!
//! A zero-copy `cuda_ipc` pass (`pass_first_open`, `pass_cached`) copies no
//! byte: its time is a hand-off latency, not a bandwidth (a 1 GiB hand-off
//! in 100 µs is not 10 000 GB/s). Those rows have `kind`
//! `handoff_latency` and `gbps` `null`, and print `hand-off latency`
//! instead of GB/s. Rows that copy the bytes (`pass_copy`, `pass` over
//! `object_store`, `memcpy_dtod`) have `kind` `bandwidth` and `gbps` =
//! `bytes` per median (1e9 bytes per second); the control round trips have
//! `kind` `latency` and no `gbps`.

use std::collections::HashMap;
use std::time::Instant;

use rdt::prelude::*;
use rdt_examples::{arg_value, median_of, us_since, BenchError, Kind, Row};

// ANCHOR: source
#[rdt::actor]
pub struct CudaSource {
    kept: HashMap<usize, Tensor>,
    many: Vec<Tensor>,
}

#[rdt::actor]
impl CudaSource {
    fn new() -> Self {
        CudaSource {
            kept: HashMap::new(),
            many: Vec::new(),
        }
    }

    /// Makes the tensor of `bytes` bytes now (allocated, filled and
    /// finished on the GPU), so that passes do not time it.
    async fn prepare(&mut self, bytes: usize) -> Result<usize, BenchError> {
        let t = Tensor::cuda_full(1u8, &[bytes], 0)?;
        t.cuda_ready().await?;
        self.kept.insert(bytes, t);
        Ok(bytes)
    }

    /// Whether this worker's object-store exports send a large CUDA
    /// tensor while its copy to the host runs (`set_copy_as_it_goes`).
    async fn copy_as_it_goes(&mut self, on: bool) -> bool {
        rdt::data::object_store::set_copy_as_it_goes(on);
        on
    }

    /// The kept tensor of `bytes` bytes (see `prepare`).
    async fn tensor(&mut self, bytes: usize) -> Result<Tensor, BenchError> {
        match self.kept.get(&bytes) {
            Some(t) => Ok(t.clone()),
            None => Err(BenchError::new(format!("prepare({bytes}) first"))),
        }
    }

    /// A tiny value (for the ref-chain round trip).
    async fn tiny(&mut self, x: u64) -> u64 {
        x
    }

    /// `n` tensors of `each` bytes, made once (a model's parameters) and
    /// handed out again.
    async fn many(&mut self, n: usize, each: usize) -> Result<Vec<Tensor>, BenchError> {
        if self.many.len() != n {
            self.many = (0..n)
                .map(|_| Tensor::cuda_full(1u8, &[each], 0))
                .collect::<Result<_, _>>()?;
            for t in &self.many {
                t.cuda_ready().await?;
            }
        }
        Ok(self.many.clone())
    }
}
// ANCHOR_END: source

#[rdt::actor]
pub struct CudaSink {}

#[rdt::actor]
impl CudaSink {
    fn new() -> Self {
        CudaSink {}
    }

    // ANCHOR: touch
    /// Waits until `t` is usable on this process's GPU.
    async fn touch(&mut self, t: Tensor) -> Result<usize, BenchError> {
        t.cuda_ready().await?;
        Ok(t.nbytes())
    }
    // ANCHOR_END: touch

    // ANCHOR: touch_copy
    /// Copy mode: makes a copy of `t` in this process's own memory and
    /// waits until it is done.
    async fn touch_copy(&mut self, t: Tensor) -> Result<usize, BenchError> {
        let own = t.deep_copy()?;
        own.cuda_ready().await?;
        Ok(own.nbytes())
    }
    // ANCHOR_END: touch_copy

    /// Waits until every tensor is usable here; their bytes.
    async fn touch_all(&mut self, ts: Vec<Tensor>) -> Result<usize, BenchError> {
        let mut n = 0;
        for t in &ts {
            t.cuda_ready().await?;
            n += t.nbytes();
        }
        Ok(n)
    }

    /// A tiny call.
    async fn ping(&mut self, x: u64) -> u64 {
        x
    }

    /// Starts CUDA in this process (context and stream of its GPU), so
    /// that the first pass does not time it.
    async fn warm(&mut self) -> Result<String, BenchError> {
        let g = rdt::data::cuda::gpu(0).map_err(cuda_err)?;
        Ok(g.uuid().to_string())
    }

    /// (new mappings, cached mappings) of cuda_ipc in this process.
    async fn stats(&mut self) -> (u64, u64) {
        let s = rdt::data::cuda_ipc::stats();
        (s.opened, s.cached)
    }
}

struct Ctx {
    device: String,
    device_name: String,
    commit: String,
    placement: &'static str,
}

fn row(cx: &Ctx, case: &str, transport: &str, kind: Kind, bytes: usize, us: Vec<f64>) -> Row {
    let r = Row {
        placement: Some(cx.placement.to_string()),
        device_name: Some(cx.device_name.clone()),
        commit: Some(cx.commit.clone()),
        ..Row::new("cuda", case, transport, &cx.device, kind, bytes as u64, us)
    };
    r.print();
    r
}

async fn pass(
    rt: &Runtime,
    p: &CudaSourceHandle,
    c: &CudaSinkHandle,
    bytes: usize,
    t: Transport,
) -> Result<f64, BenchError> {
    let t0 = Instant::now();
    let r = p.tensor(bytes).transport(t).remote();
    let n = rt.get(c.touch(&r).remote()).await?;
    let us = us_since(t0);
    assert_eq!(n, bytes);
    Ok(us)
}

/// Has process `pid` finished exiting (gone, or a zombie: its memory and
/// its CUDA context are released)?
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => matches!(
            s.rsplit_once(')')
                .and_then(|(_, r)| r.trim_start().chars().next()),
            Some('Z' | 'X')
        ),
        Err(_) => true,
    }
}

/// Kills the actors of a stage and waits until their processes have
/// finished exiting. A killed CUDA process can take 100 ms to tear down
/// its context and memory. Without this wait, the next stage could run
/// while that happened. On the H100, a stage that followed a kill once ran
/// its control round trips 2-3x slower.
async fn kill_and_wait(ps: &[&CudaSourceHandle], cs: &[&CudaSinkHandle]) {
    let mut pids: Vec<u32> = ps.iter().filter_map(|p| p.pid()).collect();
    pids.extend(cs.iter().filter_map(|c| c.pid()));
    for p in ps {
        p.kill();
    }
    for c in cs {
        c.kill();
    }
    let t0 = Instant::now();
    while !pids.iter().all(|&p| exited(p)) && t0.elapsed().as_secs() < 30 {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    println!(
        "  (killed actors exited after {:.1} ms)",
        t0.elapsed().as_secs_f64() * 1e3
    );
}

fn cuda_err(e: impl std::fmt::Display) -> BenchError {
    BenchError::new(e.to_string())
}

/// The median of `placement`'s row for (`case`, `transport`, `bytes`).
fn median(rows: &[Row], placement: &str, case: &str, transport: &str, bytes: usize) -> f64 {
    let here = rows
        .iter()
        .filter(|r| r.placement.as_deref() == Some(placement));
    median_of(here, case, transport, bytes as u64)
}

#[rdt::main]
async fn main() -> Result<(), BenchError> {
    let args: Vec<String> = std::env::args().collect();
    let json = arg_value("--json");
    let quick = args.iter().any(|a| a == "--quick");
    rdt::data::cuda::available().map_err(cuda_err)?;
    let n_gpus = rdt::data::cuda::device_count();
    let gpu0 = rdt::data::cuda::gpu(0).map_err(cuda_err)?;
    let commit = std::env::var("RDT_COMMIT").unwrap_or_else(|_| "unknown".into());
    let device_name = gpu0.name();
    println!(
        "== bench_cuda  commit {commit}  {n_gpus} x {device_name}  ({})",
        gpu0.uuid()
    );
    let rt = Runtime::builder()
        .max_frame_bytes((1usize << 30) + (64 << 20))
        .start()
        .await?;
    let sizes: &[usize] = if quick {
        &[4 << 10, 1 << 20]
    } else {
        &[4 << 10, 1 << 20, 64 << 20, 1 << 30]
    };
    let iters = if quick { 10 } else { 100 };
    let mut rows = Vec::new();
    let mut placements = vec![("same_gpu", 0u32, 0u32)];
    if n_gpus >= 2 {
        placements.push(("cross_gpu", 0, 1));
    }

    for &(placement, pg, cg) in &placements {
        let dst_gpu = rdt::data::cuda::gpu(cg as usize).map_err(cuda_err)?;
        let cx = Ctx {
            device: if pg == cg {
                format!("cuda ({})", gpu0.uuid())
            } else {
                format!("cuda ({} -> {})", gpu0.uuid(), dst_gpu.uuid())
            },
            device_name: device_name.clone(),
            commit: commit.clone(),
            placement,
        };

        // Control plane, same run, same placement.
        {
            let p = rt.spawn::<CudaSource>(()).on_gpus([pg]).await?;
            let c = rt.spawn::<CudaSink>(()).on_gpus([cg]).await?;
            for i in 0..20 {
                rt.get(c.ping(i).remote()).await?;
                let r = p.tiny(i).remote();
                rt.get(c.ping(&r).remote()).await?;
            }
            let mut us = Vec::new();
            for i in 0..iters.max(100) {
                let t0 = Instant::now();
                rt.get(c.ping(i as u64).remote()).await?;
                us.push(us_since(t0));
            }
            rows.push(row(&cx, "actor_call_rtt", "none", Kind::Latency, 0, us));
            let mut us = Vec::new();
            for i in 0..iters.max(100) {
                let t0 = Instant::now();
                let r = p.tiny(i as u64).remote();
                rt.get(c.ping(&r).remote()).await?;
                us.push(us_since(t0));
            }
            rows.push(row(&cx, "ref_chain_rtt", "none", Kind::Latency, 0, us));
            kill_and_wait(&[&p], &[&c]).await;
        }

        for &bytes in sizes {
            // A fresh pair per size: the first pass maps a new slab.
            let p = rt.spawn::<CudaSource>(()).on_gpus([pg]).await?;
            let c = rt.spawn::<CudaSink>(()).on_gpus([cg]).await?;
            rt.get(p.prepare(bytes).remote()).await?;
            rt.get(c.warm().remote()).await?;
            let first = pass(&rt, &p, &c, bytes, Transport::CudaIpc).await?;
            rows.push(row(
                &cx,
                "pass_first_open",
                "cuda_ipc",
                Kind::HandoffLatency,
                bytes,
                vec![first],
            ));
            let mut us = Vec::new();
            for _ in 0..iters {
                us.push(pass(&rt, &p, &c, bytes, Transport::CudaIpc).await?);
            }
            let (opened, cached) = rt.get(c.stats().remote()).await?;
            println!("  cuda_ipc mappings: {opened} opened, {cached} cached");
            rows.push(row(
                &cx,
                "pass_cached",
                "cuda_ipc",
                Kind::HandoffLatency,
                bytes,
                us,
            ));

            // Copy mode: the same pass, and the consumer copies the bytes.
            let mut us = Vec::new();
            for _ in 0..iters {
                let t0 = Instant::now();
                let r = p.tensor(bytes).transport(Transport::CudaIpc).remote();
                let n = rt.get(c.touch_copy(&r).remote()).await?;
                us.push(us_since(t0));
                assert_eq!(n, bytes);
            }
            rows.push(row(
                &cx,
                "pass_copy",
                "cuda_ipc",
                Kind::Bandwidth,
                bytes,
                us,
            ));

            let os_iters = if bytes >= 64 << 20 { 5 } else { iters.min(30) };
            // One unmeasured pass first, as in `bench transports`: each
            // process's host buffer pool (rdt_transport::host_pool) maps and
            // pins its buffers once, and every later pass reuses them.
            pass(&rt, &p, &c, bytes, Transport::ObjectStore).await?;
            let mut us = Vec::new();
            for _ in 0..os_iters {
                us.push(pass(&rt, &p, &c, bytes, Transport::ObjectStore).await?);
            }
            rows.push(row(&cx, "pass", "object_store", Kind::Bandwidth, bytes, us));
            if bytes == 1 << 30 {
                // The producer's copy to the host overlapping the socket
                // (the default) against the copy first, then the socket,
                // alternating on the same pair.
                let (mut stepped, mut first) = (Vec::new(), Vec::new());
                for _ in 0..3 {
                    for on in [false, true] {
                        rt.get(p.copy_as_it_goes(on).remote()).await?;
                        let us = pass(&rt, &p, &c, bytes, Transport::ObjectStore).await?;
                        if on { &mut stepped } else { &mut first }.push(us);
                    }
                }
                rows.push(row(
                    &cx,
                    "pass_copy_first",
                    "object_store",
                    Kind::Bandwidth,
                    bytes,
                    first,
                ));
                rows.push(row(
                    &cx,
                    "pass_copy_as_it_goes",
                    "object_store",
                    Kind::Bandwidth,
                    bytes,
                    stepped,
                ));
            }

            // Raw device-to-device copy of the same bytes, in this process.
            let a = Tensor::cuda_full(1u8, &[bytes], pg as usize)?;
            let b = Tensor::cuda_empty(DType::U8, &[bytes], cg as usize)?;
            a.cuda_ready().await?;
            let (pa, pb) = (
                a.with_device_buffer(|d| d.device_ptr())?,
                b.with_device_buffer(|d| d.device_ptr())?,
            );
            let mut us = Vec::new();
            for i in 0..iters + 3 {
                let t0 = Instant::now();
                dst_gpu.copy_dtod(pb, pa, bytes).map_err(cuda_err)?;
                dst_gpu
                    .completion()
                    .map_err(cuda_err)?
                    .wait()
                    .await
                    .map_err(cuda_err)?;
                if i >= 3 {
                    us.push(us_since(t0));
                }
            }
            rows.push(row(&cx, "memcpy_dtod", "raw", Kind::Bandwidth, bytes, us));
            drop((a, b));
            kill_and_wait(&[&p], &[&c]).await;
        }

        // Per-tensor cost: 10 000 tensors of 4 KiB against one tensor of
        // their 40.96 MB, both kept and passed again (cached mappings).
        {
            const N: usize = 10_000;
            const EACH: usize = 4 << 10;
            let p = rt.spawn::<CudaSource>(()).on_gpus([pg]).await?;
            let c = rt.spawn::<CudaSink>(()).on_gpus([cg]).await?;
            rt.get(p.prepare(N * EACH).remote()).await?;
            rt.get(c.warm().remote()).await?;
            let (mut one, mut many) = (Vec::new(), Vec::new());
            for i in 0..(iters / 5).max(5) + 1 {
                let o = pass(&rt, &p, &c, N * EACH, Transport::CudaIpc).await?;
                let t0 = Instant::now();
                let r = p.many(N, EACH).transport(Transport::CudaIpc).remote();
                let n = rt.get(c.touch_all(&r).remote()).await?;
                let m = us_since(t0);
                assert_eq!(n, N * EACH);
                // The first pass makes the tensors and maps the slabs.
                if i > 0 {
                    one.push(o);
                    many.push(m);
                }
            }
            rows.push(row(
                &cx,
                "one40M_pass_cached",
                "cuda_ipc",
                Kind::HandoffLatency,
                N * EACH,
                one,
            ));
            rows.push(row(
                &cx,
                "many10000_pass_cached",
                "cuda_ipc",
                Kind::HandoffLatency,
                N * EACH,
                many,
            ));
            let (o, m) = (
                median(&rows, placement, "one40M_pass_cached", "cuda_ipc", N * EACH),
                median(
                    &rows,
                    placement,
                    "many10000_pass_cached",
                    "cuda_ipc",
                    N * EACH,
                ),
            );
            println!(
                "  {placement}: 10 000 tensors of 4 KiB {m:.0} us, one of 40.96 MB {o:.0} us: {:.1}x, {:.0} ns per tensor more",
                m / o,
                (m - o) * 1000.0 / N as f64
            );
            kill_and_wait(&[&p], &[&c]).await;
        }
    }

    println!("\n== summary (medians; target: cached cuda_ipc pass <= 100 us + control round trip, >= 50x faster than the object store)");
    for &(placement, _, _) in &placements {
        let rtt = median(&rows, placement, "actor_call_rtt", "none", 0);
        let chain = median(&rows, placement, "ref_chain_rtt", "none", 0);
        println!("{placement}: actor call {rtt:.1} us, ref chain {chain:.1} us");
        for &bytes in sizes {
            let ipc = median(&rows, placement, "pass_cached", "cuda_ipc", bytes);
            let first = median(&rows, placement, "pass_first_open", "cuda_ipc", bytes);
            let copy = median(&rows, placement, "pass_copy", "cuda_ipc", bytes);
            let os = median(&rows, placement, "pass", "object_store", bytes);
            let raw = median(&rows, placement, "memcpy_dtod", "raw", bytes);
            let budget = 100.0 + rtt;
            println!(
                "  {bytes:>10} B: cached {ipc:>8.1} us (first {first:>9.1}), copy mode {copy:>8.1} us, object store {os:>11.1} us = {:>7.1}x, \
                 raw dtod {raw:>7.1} us, cached - call rtt {:>6.1} us, cached - ref chain {:>6.1} us; \
                 <= 100 us + rtt ({budget:.0} us): {}; >= 50x: {}",
                os / ipc,
                ipc - rtt,
                ipc - chain,
                if ipc <= budget { "yes" } else { "NO" },
                if os / ipc >= 50.0 { "yes" } else { "no" },
            );
        }
    }

    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&rows).unwrap())?;
        println!("wrote {path}");
    }
    Ok(())
}
