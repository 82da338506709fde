//! CUDA benchmark: `cargo run --release --example bench_cuda -- [--json PATH] [--quick]`.
//!
//! A pass = produce a CUDA tensor in one actor, hand the ref to another
//! actor on the same GPU, which waits until the tensor is usable on its
//! GPU, and the result reaches the driver. Measured over `cuda_ipc`
//! (first pass of a fresh actor pair = new mapping; later passes = cached
//! mapping) and over the object-store path (GPU → host → driver → host →
//! GPU) on the same tensors, next to a raw `cuMemcpyDtoD` of the same bytes
//! and a bare actor call (the control-plane round trip). Rows use the
//! harness schema: `suite, case, transport, device, bytes, iters,
//! median_us, p90_us, gbps`.

use std::time::Instant;

use rdt::prelude::*;
use serde::Serialize;

#[rdt::actor]
pub struct CudaSource {}

#[rdt::actor]
impl CudaSource {
    fn new() -> Self {
        CudaSource {}
    }

    /// A fresh CUDA tensor of `bytes` bytes (filled on the GPU).
    async fn make(&mut self, bytes: usize) -> rdt::Result<Tensor> {
        let t = Tensor::cuda_full(1u8, &[bytes], 0)?;
        Ok(t)
    }

    async fn ping(&mut self, x: u64) -> u64 {
        x
    }
}

#[rdt::actor]
pub struct CudaSink {}

#[rdt::actor]
impl CudaSink {
    fn new() -> Self {
        CudaSink {}
    }

    /// Waits until `t` is usable on this process's GPU.
    async fn touch(&mut self, t: Tensor) -> rdt::Result<usize> {
        t.cuda_ready().await?;
        Ok(t.nbytes())
    }

    /// (new mappings, cached mappings) of cuda_ipc in this process.
    async fn stats(&mut self) -> (u64, u64) {
        let s = rdt::data::cuda::ipc::stats();
        (s.opened, s.cached)
    }
}

#[derive(Serialize)]
struct Row {
    suite: &'static str,
    case: String,
    transport: String,
    device: String,
    bytes: usize,
    iters: usize,
    median_us: f64,
    p90_us: f64,
    gbps: f64,
}

fn row(case: &str, transport: &str, device: &str, bytes: usize, mut us: Vec<f64>) -> Row {
    us.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let median = us[us.len() / 2];
    let p90 = us[((us.len() as f64 * 0.9) as usize).min(us.len() - 1)];
    let r = Row {
        suite: "cuda",
        case: case.to_string(),
        transport: transport.to_string(),
        device: device.to_string(),
        bytes,
        iters: us.len(),
        median_us: median,
        p90_us: p90,
        gbps: if median > 0.0 {
            bytes as f64 / (median * 1e3)
        } else {
            0.0
        },
    };
    println!(
        "{:<28} {:<13} {:>12} B {:>5} it  median {:>12.1} us  p90 {:>12.1} us  {:>9.2} GB/s",
        r.case, r.transport, r.bytes, r.iters, r.median_us, r.p90_us, r.gbps
    );
    r
}

async fn pass(
    rt: &Runtime,
    p: &CudaSourceHandle,
    c: &CudaSinkHandle,
    bytes: usize,
    t: Transport,
) -> rdt::Result<f64> {
    let t0 = Instant::now();
    let r = p.make(bytes).transport(t).remote();
    let n = rt.get(c.touch(&r).remote()).await?;
    let us = t0.elapsed().as_secs_f64() * 1e6;
    assert_eq!(n, bytes);
    Ok(us)
}

#[rdt::main]
async fn main() -> rdt::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let json = args
        .iter()
        .position(|a| a == "--json")
        .and_then(|i| args.get(i + 1).cloned());
    let quick = args.iter().any(|a| a == "--quick");
    rdt::data::cuda::available().map_err(|e| Error::Protocol(e.to_string()))?;
    let gpu = rdt::data::cuda::gpu(0).map_err(|e| Error::Protocol(e.to_string()))?;
    let device = format!("cuda ({})", gpu.uuid());
    let rt = Runtime::builder()
        .max_frame_bytes((1usize << 30) + (64 << 20))
        .start()
        .await?;
    let mut rows = Vec::new();
    let sizes: &[usize] = if quick {
        &[4 << 10, 1 << 20]
    } else {
        &[4 << 10, 1 << 20, 64 << 20, 1 << 30]
    };
    let iters = if quick { 5 } else { 30 };

    // Control-plane floor: a bare call.
    {
        let p = rt.spawn::<CudaSource>(()).gpus(1).await?;
        let mut us = Vec::new();
        for i in 0..iters.max(50) {
            let t0 = Instant::now();
            rt.get(p.ping(i as u64).remote()).await?;
            us.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        rows.push(row("actor_call_rtt", "none", &device, 0, us));
    }

    for &bytes in sizes {
        // cuda_ipc, first pass on a fresh pair (new mapping), then cached.
        let p = rt.spawn::<CudaSource>(()).gpus(1).await?;
        let c = rt.spawn::<CudaSink>(()).gpus(1).await?;
        let first = pass(&rt, &p, &c, bytes, Transport::CudaIpc).await?;
        rows.push(row(
            "pass_first_open",
            "cuda_ipc",
            &device,
            bytes,
            vec![first],
        ));
        let mut us = Vec::new();
        for _ in 0..iters {
            us.push(pass(&rt, &p, &c, bytes, Transport::CudaIpc).await?);
        }
        let (opened, cached) = rt.get(c.stats().remote()).await?;
        println!("  cuda_ipc mappings for {bytes} B: {opened} opened, {cached} cached");
        let ipc = row("pass_cached", "cuda_ipc", &device, bytes, us);
        let ipc_median = ipc.median_us;
        rows.push(ipc);
        rows.push(Row {
            suite: "cuda",
            case: format!("mappings_opened_of_{}", iters + 1),
            transport: "cuda_ipc".into(),
            device: device.clone(),
            bytes,
            iters: (opened + cached) as usize,
            median_us: opened as f64,
            p90_us: cached as f64,
            gbps: 0.0,
        });

        // Object store on the same kind of tensor.
        let os_iters = if bytes >= 1 << 30 {
            3
        } else if bytes >= 64 << 20 {
            5
        } else {
            iters
        };
        let mut us = Vec::new();
        for _ in 0..os_iters {
            us.push(pass(&rt, &p, &c, bytes, Transport::ObjectStore).await?);
        }
        let os = row("pass", "object_store", &device, bytes, us);
        println!(
            "  cuda_ipc cached is {:.1}x faster than the object store",
            os.median_us / ipc_median
        );
        rows.push(os);

        // Raw device-to-device copy of the same bytes, in this process.
        let a = Tensor::cuda_full(1u8, &[bytes], 0)?;
        let b = Tensor::cuda_empty(DType::U8, &[bytes], 0)?;
        let (pa, pb) = (
            a.with_device_buffer(|d| d.device_ptr())?,
            b.with_device_buffer(|d| d.device_ptr())?,
        );
        let mut us = Vec::new();
        for _ in 0..iters {
            let t0 = Instant::now();
            gpu.copy_dtod(pb, pa, bytes)
                .map_err(|e| Error::Protocol(e.to_string()))?;
            gpu.completion()
                .map_err(|e| Error::Protocol(e.to_string()))?
                .wait()
                .await
                .map_err(|e| Error::Protocol(e.to_string()))?;
            us.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        rows.push(row("memcpy_dtod", "raw", &device, bytes, us));
        drop((a, b));
        p.kill();
        c.kill();
    }

    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&rows).unwrap())?;
        println!("wrote {path}");
    }
    Ok(())
}
