//! NCCL benchmark: `cargo run --release --example bench_nccl -- [--json PATH] [--quick]`.
//! Needs two GPUs (NCCL refuses two ranks on one GPU in one communicator);
//! with fewer it says so and exits without rows.
//!
//! In one run, on GPU 0 → GPU 1:
//! * `raw`: NCCL send/recv between two plain processes (this one and a
//!   child, no actors) through rdt's own NCCL wrapper
//!   (`rdt::data::nccl::Communicator`): each iteration is one group call
//!   and a wait for its done event on both sides, timed on the receiver.
//!   Communicator set-up (`comm_init`: the non-blocking join, the split
//!   into the blocking communicator transfers run on, and its connection
//!   to the peer) and the first transfer are separate rows.
//! * `nccl`: rdt passes between two actors in an `nccl` group. A `pass` is
//!   one consumer call on a ref the producer made before: the driver hands
//!   the ref to the consumer, the producer sends, the consumer's method
//!   waits until the tensor is usable on its GPU (`cuda_ready`) and
//!   answers. `pass_produce` adds the producer's call that returns the
//!   ref. `group_create` and `pass_first` (the first pass in the group)
//!   are separate rows.
//! * `object_store`: the same pass through the driver, serialized.
//! * sizes 4 KiB, 1 MiB, 64 MiB, 1 GiB, and an object of 100 tensors
//!   totalling 1 GiB (`many100`); `actor_call_rtt` for the 4 KiB budget,
//!   and `actor_call_rtt_after_idle` (the same call after 3 ms idle).
//! * **overlap** (Ray Compiled Graphs' `_overlap_gpu_communication`
//!   workload): three senders on GPU 0 each hold a 10000×10000 f16 matrix,
//!   one receiver on GPU 1 (in three two-member groups) multiplies each
//!   received matrix by itself with cuBLAS and returns one element. Per
//!   iteration (5, after a warm-up): `off` = each call waits until its
//!   tensor landed (host sync), then multiplies, and the driver submits
//!   the next call after the previous returned (transfer and compute
//!   never overlap); `on` = transfers run on their communicators' streams
//!   and each multiply waits on its receive's done event on the GPU, with
//!   two calls in flight (the next transfer runs under the current
//!   multiply, as Compiled Graphs schedules it); `on_all_at_once` submits
//!   the three calls together (their transfers share the link). `T_x` = one transfer
//!   alone (a pass of one matrix), `T_c` = one multiply alone (timed in
//!   the receiver); ideal = T_x + 3·max(T_x, T_c). The multiplies use
//!   every SM; `RDT_BENCH_SMS_FOR_TRANSFERS=N` leaves N of them to the
//!   transfers' kernels (`T_c` is then timed the same way).
//!
//! Rows use the harness schema (`suite` = `nccl`, `case`, `transport`,
//! `device`, `bytes`, `iters`, `median_us`, `p90_us`, `kind`, `gbps`,
//! `device_name`, `commit`); every row here copies the bytes, so `gbps`
//! is `bytes` per median (1e9 B/s).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdt::data::nccl::{Communicator, P2p, UniqueId};
use rdt::prelude::*;
use rdt_examples::{arg_value, median_of, us_since, BenchError, Kind, Row};
use serde::Serialize;

/// Side of the overlap workload's matrices.
const N: usize = 10_000;
/// 0.01 in f16 (products stay far from f16's range limit).
const F16_0_01: u16 = 0x211f;

#[rdt::actor]
pub struct NcclSource {
    kept: HashMap<usize, Tensor>,
    many: Vec<Tensor>,
}

#[rdt::actor]
impl NcclSource {
    fn new() -> Self {
        NcclSource {
            kept: HashMap::new(),
            many: Vec::new(),
        }
    }

    /// Makes the tensor of `bytes` bytes now (filled, finished on the GPU).
    async fn prepare(&mut self, bytes: usize) -> Result<usize, BenchError> {
        let t = Tensor::cuda_full(1u8, &[bytes], 0)?;
        t.cuda_ready().await?;
        self.kept.insert(bytes, t);
        Ok(bytes)
    }

    /// The kept tensor of `bytes` bytes.
    async fn tensor(&mut self, bytes: usize) -> Result<Tensor, BenchError> {
        self.kept
            .get(&bytes)
            .cloned()
            .ok_or_else(|| BenchError::new(format!("prepare({bytes}) first")))
    }

    /// Makes `n` tensors totalling `total` bytes.
    async fn prepare_many(&mut self, n: usize, total: usize) -> Result<usize, BenchError> {
        self.many = (0..n)
            .map(|_| Tensor::cuda_full(2u8, &[total / n], 0))
            .collect::<std::result::Result<_, _>>()?;
        for t in &self.many {
            t.cuda_ready().await?;
        }
        Ok(n)
    }

    /// The kept tensors of `prepare_many`.
    async fn many(&mut self) -> Vec<Tensor> {
        self.many.clone()
    }

    /// Makes the overlap workload's N×N f16 matrix (every element 0.01).
    async fn prepare_matrix(&mut self) -> Result<usize, BenchError> {
        let t = Tensor::cuda_empty(DType::F16, &[N, N], 0)?;
        t.with_device_buffer(|d| -> Result<(), BenchError> {
            d.gpu().bind().map_err(cuda_err)?;
            // SAFETY: the tensor's own range, N*N 16-bit elements, on its
            // stream.
            let r = unsafe {
                cudarc::driver::sys::cuMemsetD16Async(
                    d.device_ptr(),
                    F16_0_01,
                    N * N,
                    d.gpu().raw_stream(),
                )
            };
            r.result().map_err(cuda_err)
        })??;
        t.cuda_ready().await?;
        self.kept.insert(usize::MAX, t);
        Ok(N)
    }

    /// The overlap workload's matrix.
    async fn matrix(&mut self) -> Result<Tensor, BenchError> {
        self.tensor(usize::MAX).await
    }
}

/// A cuBLAS handle bound to rdt's stream of this process's GPU.
struct Blas(cudarc::cublas::sys::cublasHandle_t);

/// SMs the receiver's multiplies leave free for the transfers' kernels
/// (`RDT_BENCH_SMS_FOR_TRANSFERS`, default [`SMS_FOR_TRANSFERS`]).
const SMS_FOR_TRANSFERS: u32 = 0;

/// (SMs cuBLAS may use, SMs of the GPU). cuBLAS's GEMMs on Hopper keep
/// every SM they start on until they end, so a receive kernel launched
/// under one waits for its end whatever its stream's priority; leaving it
/// SMs (`cublasSetSmCountTarget`) is how compute and communication overlap
/// there. `T_c` is timed with the same handle.
fn blas_sms(g: &rdt::data::cuda::Gpu) -> Result<(u32, u32), BenchError> {
    let all = g.multiprocessors().map_err(cuda_err)?;
    let free = std::env::var("RDT_BENCH_SMS_FOR_TRANSFERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(SMS_FOR_TRANSFERS);
    Ok((all.saturating_sub(free).max(1), all))
}
// SAFETY: a cuBLAS handle may be used from any thread, one at a time (the
// actor runs one call at a time).
unsafe impl Send for Blas {}

#[rdt::actor]
pub struct NcclSink {
    blas: Option<Blas>,
    out: Option<Tensor>,
}

#[rdt::actor]
impl NcclSink {
    fn new() -> Self {
        NcclSink {
            blas: None,
            out: None,
        }
    }

    /// Waits until `t` is usable on this process's GPU.
    async fn touch(&mut self, t: Tensor) -> Result<usize, BenchError> {
        rdt::data::trace::timeline("touch start", 0);
        t.cuda_ready().await?;
        rdt::data::trace::timeline("touch ready", 0);
        Ok(t.nbytes())
    }

    /// Waits until every tensor of `ts` is usable here: rdt's stream takes
    /// each tensor's ready event over, then one wait for the stream.
    async fn touch_all(&mut self, ts: Vec<Tensor>) -> Result<usize, BenchError> {
        for t in &ts {
            t.with_device_buffer(|_| ())?;
        }
        if let Some(t) = ts.first() {
            t.cuda_ready().await?;
        }
        Ok(ts.iter().map(Tensor::nbytes).sum())
    }

    /// Bytes this process holds in device slabs (in use or cached): a
    /// pass that could not reuse the previous pass's memory shows here.
    async fn slab_bytes(&mut self) -> usize {
        rdt::data::cuda::alloc::slab_bytes().values().sum()
    }

    /// A tiny call.
    async fn ping(&mut self, x: u64) -> u64 {
        x
    }

    /// This process's nccl receive counters.
    async fn nccl_stats(&mut self) -> rdt::data::nccl::NcclStats {
        rdt::data::nccl::stats()
    }

    /// (SMs the multiplies may use, SMs of the GPU).
    async fn blas_sms(&mut self) -> Result<(u32, u32), BenchError> {
        blas_sms(&*rdt::data::cuda::gpu(0).map_err(cuda_err)?)
    }

    /// Starts CUDA and cuBLAS here and runs one multiply (untimed).
    async fn warm(&mut self) -> Result<String, BenchError> {
        let g = rdt::data::cuda::gpu(0).map_err(cuda_err)?;
        let a = Tensor::cuda_zeros(DType::F16, &[N, N], 0)?;
        self.multiply(&a)?;
        self.read_one().await?;
        Ok(g.uuid().to_string())
    }

    /// Overlap on: multiplies `t` by itself at once; the multiply waits on
    /// the GPU for `t`'s transfer. Returns one element of the product.
    async fn mm(&mut self, t: Tensor) -> Result<u16, BenchError> {
        self.multiply(&t)?;
        self.read_one().await
    }

    /// Overlap off: waits until `t` landed (host sync), then multiplies.
    async fn mm_sync(&mut self, t: Tensor) -> Result<u16, BenchError> {
        t.cuda_ready().await?;
        self.multiply(&t)?;
        self.read_one().await
    }

    /// One multiply alone, on a local matrix: median of `reps`, in µs.
    async fn time_mm(&mut self, reps: usize) -> Result<f64, BenchError> {
        let a = Tensor::cuda_zeros(DType::F16, &[N, N], 0)?;
        a.cuda_ready().await?;
        let mut us = Vec::new();
        for _ in 0..reps {
            let t0 = Instant::now();
            self.multiply(&a)?;
            self.read_one().await?;
            us.push(us_since(t0));
        }
        Ok(rdt_examples::median(&mut us))
    }
}

impl NcclSink {
    /// Enqueues `out = t × t` (N×N f16, f32 accumulation) on rdt's stream,
    /// after `t`'s ready event.
    fn multiply(&mut self, t: &Tensor) -> Result<(), BenchError> {
        use cudarc::cublas::{result as blas, sys as bsys};
        if self.blas.is_none() {
            // SAFETY: only checks that the library loads.
            if !unsafe { bsys::is_culib_present() } {
                return Err(BenchError::new(
                    "cuBLAS (libcublas.so) was not found on the loader path",
                ));
            }
            let g = rdt::data::cuda::gpu(0).map_err(cuda_err)?;
            g.bind().map_err(cuda_err)?;
            let h = blas::create_handle().map_err(cuda_err)?;
            // SAFETY: a live handle and rdt's stream of the bound context.
            unsafe { blas::set_stream(h, g.raw_stream() as *mut _) }.map_err(cuda_err)?;
            let (used, all) = blas_sms(&g)?;
            if used < all {
                // SAFETY: a live handle; a count below the device's.
                unsafe { bsys::cublasSetSmCountTarget(h, used as i32) }
                    .result()
                    .map_err(cuda_err)?;
            }
            self.blas = Some(Blas(h));
            self.out = Some(Tensor::cuda_empty(DType::F16, &[N, N], 0)?);
        }
        let h = self.blas.as_ref().expect("made above").0;
        let out = self.out.as_ref().expect("made above");
        let a = t.with_device_buffer(|d| d.device_ptr())?;
        let c = out.with_device_buffer(|d| d.device_ptr())?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        // SAFETY: both ranges are N×N f16 on this GPU; alpha and beta are
        // host f32 (compute type 32F); the handle's stream is rdt's, which
        // waits for `t`'s ready event (with_device_buffer above).
        unsafe {
            blas::gemm_ex(
                h,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                N as i32,
                N as i32,
                N as i32,
                &alpha as *const f32 as *const _,
                a as *const _,
                bsys::cudaDataType::CUDA_R_16F,
                N as i32,
                a as *const _,
                bsys::cudaDataType::CUDA_R_16F,
                N as i32,
                &beta as *const f32 as *const _,
                c as *mut _,
                bsys::cudaDataType::CUDA_R_16F,
                N as i32,
                bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(cuda_err)
    }

    /// Waits for the product (without blocking the thread) and reads its
    /// first element (f16 bits).
    async fn read_one(&self) -> Result<u16, BenchError> {
        let out = self.out.as_ref().expect("a multiply ran");
        out.cuda_ready().await?;
        let ptr = out.with_device_buffer(|d| d.device_ptr())?;
        let mut one = [0u16; 1];
        // SAFETY: two bytes of the product; the stream is idle (above).
        unsafe { cudarc::driver::result::memcpy_dtoh_sync(&mut one, ptr) }.map_err(cuda_err)?;
        Ok(one[0])
    }
}

struct Ctx {
    device: String,
    device_name: String,
    commit: String,
}

impl Ctx {
    /// GPU 0 to GPU 1, as every row of this benchmark runs.
    fn across_gpus(commit: String) -> Result<Ctx, BenchError> {
        let (g0, g1) = (
            rdt::data::cuda::gpu(0).map_err(cuda_err)?,
            rdt::data::cuda::gpu(1).map_err(cuda_err)?,
        );
        Ok(Ctx {
            device: format!("cuda ({} -> {})", g0.uuid(), g1.uuid()),
            device_name: g0.name(),
            commit,
        })
    }
}

fn row(cx: &Ctx, case: &str, transport: &str, kind: Kind, bytes: usize, us: Vec<f64>) -> Row {
    let r = Row {
        device_name: Some(cx.device_name.clone()),
        commit: Some(cx.commit.clone()),
        ..Row::new("nccl", case, transport, &cx.device, kind, bytes as u64, us)
    };
    r.print();
    r
}

fn cuda_err(e: impl std::fmt::Debug) -> BenchError {
    BenchError::new(format!("{e:?}"))
}

/// The raw baseline's cases: (name, tensors, bytes each).
fn raw_cases(sizes: &[usize]) -> Vec<(String, usize, usize)> {
    let mut v: Vec<(String, usize, usize)> =
        sizes.iter().map(|&b| ("pass".to_string(), 1, b)).collect();
    v.push(("many100".into(), 100, (1 << 30) / 100));
    v
}

fn iters_for(bytes: usize, quick: bool) -> usize {
    match (quick, bytes) {
        (true, _) => 10,
        (_, b) if b >= 1 << 30 => 20,
        (_, b) if b >= 64 << 20 => 50,
        _ => 200,
    }
}

/// What one side of the raw baseline measured: (case, bytes,
/// per-iteration µs) per case, the communicator set-up and the first
/// transfer, in µs.
type RawResult = (Vec<(String, usize, Vec<f64>)>, f64, f64);

/// One side of the raw baseline: `rank` 0 sends, 1 receives; returns, on
/// the receiver, (case, bytes, per-iteration µs) and the set-up times.
async fn raw_side(
    id: UniqueId,
    rank: usize,
    sizes: &[usize],
    quick: bool,
) -> Result<RawResult, BenchError> {
    let gpu = rdt::data::cuda::gpu(0).map_err(cuda_err)?;
    let t0 = Instant::now();
    let comm = Communicator::start(&id, 2, rank, gpu.clone()).map_err(cuda_err)?;
    comm.ready().await.map_err(cuda_err)?;
    let init_us = us_since(t0);
    let peer = 1 - rank;
    let mut out = Vec::new();
    let mut first_us = f64::NAN;
    for (case, n, each) in raw_cases(sizes) {
        let bufs: Vec<Tensor> = (0..n)
            .map(|_| Tensor::cuda_full(3u8, &[each], 0))
            .collect::<std::result::Result<_, _>>()?;
        for b in &bufs {
            b.cuda_ready().await?;
        }
        let ops: Vec<P2p> = bufs
            .iter()
            .map(|b| {
                let (ptr, len) = b.with_device_buffer(|d| (d.device_ptr(), d.len()))?;
                Ok(if rank == 0 {
                    P2p::Send { peer, ptr, len }
                } else {
                    P2p::Recv { peer, ptr, len }
                })
            })
            .collect::<Result<_, BenchError>>()?;
        let iters = iters_for(n * each, quick);
        let mut us = Vec::new();
        for i in 0..iters + 3 {
            let t0 = Instant::now();
            // With RDT_TIMELINE: each side's group call and wait, to set
            // beside an rdt pass's (`--timeline`, `--small-passes`).
            let side = |what: [&'static str; 2]| what[rank.min(1)];
            rdt::data::trace::timeline(side(["raw send start", "raw recv start"]), i as u64);
            comm.group(&ops).await.map_err(cuda_err)?;
            rdt::data::trace::timeline(
                side(["raw send group call", "raw recv group call"]),
                i as u64,
            );
            let done = comm.record_done().map_err(cuda_err)?;
            comm.wait_done(&done, Duration::from_secs(30))
                .await
                .map_err(cuda_err)?;
            rdt::data::trace::timeline(side(["raw send done", "raw recv done"]), i as u64);
            let t = us_since(t0);
            if first_us.is_nan() {
                first_us = t;
            }
            if i >= 3 {
                us.push(t);
            }
        }
        out.push((case, n * each, us));
    }
    comm.destroy(Duration::from_secs(30))
        .await
        .map_err(cuda_err)?;
    rdt::timeline::flush();
    Ok((out, init_us, first_us))
}

/// The raw baseline: a child process (GPU 1) receives, this one (GPU 0)
/// sends.
async fn raw_baseline(cx: &Ctx, sizes: &[usize], quick: bool) -> Result<Vec<Row>, BenchError> {
    let id = UniqueId::new().map_err(cuda_err)?;
    let exe = std::env::current_exe()?;
    let gpu1 = std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .and_then(|v| v.split(',').nth(1).map(str::to_string))
        .unwrap_or_else(|| "1".into());
    let mut child = tokio::process::Command::new(exe)
        .arg("--raw-peer")
        .arg(hex_encode(&id.to_bytes()))
        .args(if quick { vec!["--quick"] } else { vec![] })
        .env("CUDA_VISIBLE_DEVICES", gpu1)
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let (_, init0, _) = raw_side(id, 0, sizes, quick).await?;
    let mut stdout = child.stdout.take().expect("piped");
    let mut text = String::new();
    tokio::io::AsyncReadExt::read_to_string(&mut stdout, &mut text).await?;
    let status = child.wait().await?;
    if !status.success() {
        return Err(BenchError::new(format!(
            "the raw NCCL peer failed: {status}"
        )));
    }
    let line = text
        .lines()
        .find_map(|l| l.strip_prefix("RAW "))
        .ok_or_else(|| BenchError::new(format!("the raw NCCL peer said: {text}")))?;
    let (cases, init1, first): RawResult = serde_json::from_str(line).map_err(cuda_err)?;
    let mut rows = vec![
        row(
            cx,
            "comm_init",
            "raw",
            Kind::Latency,
            0,
            vec![init0.max(init1)],
        ),
        row(
            cx,
            "first_transfer",
            "raw",
            Kind::Latency,
            4 << 10,
            vec![first],
        ),
    ];
    for (case, bytes, us) in cases {
        rows.push(row(cx, &case, "raw", Kind::Bandwidth, bytes, us));
    }
    Ok(rows)
}

fn hex_encode(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn hex_decode(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect()
}

fn sizes(quick: bool) -> Vec<usize> {
    if quick {
        vec![4 << 10, 1 << 20]
    } else {
        vec![4 << 10, 1 << 20, 64 << 20, 1 << 30]
    }
}

#[rdt::main]
async fn main() -> Result<(), BenchError> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    if let Some(i) = args.iter().position(|a| a == "--raw-peer") {
        let id = UniqueId::from_bytes(&hex_decode(&args[i + 1])).map_err(cuda_err)?;
        let r = raw_side(id, 1, &sizes(quick), quick).await?;
        println!("RAW {}", serde_json::to_string(&r).map_err(cuda_err)?);
        return Ok(());
    }
    let json = arg_value("--json");
    rdt::data::cuda::available().map_err(cuda_err)?;
    if args.iter().any(|a| a == "--timeline") {
        return timeline_passes().await;
    }
    if let Some(n) = arg_value("--ab-control-threads").and_then(|n| n.parse().ok()) {
        return ab_control_threads(n).await;
    }
    if let Some(n) = arg_value("--small-passes").and_then(|n| n.parse().ok()) {
        return small_passes(n).await;
    }
    if args.iter().any(|a| a == "--overlap-only") {
        return overlap_only(quick).await;
    }
    let n_gpus = rdt::data::cuda::device_count();
    let commit = std::env::var("RDT_COMMIT").unwrap_or_else(|_| "unknown".into());
    if n_gpus < 2 {
        println!("== bench_nccl: needs two GPUs, {n_gpus} visible: skipped (no rows)");
        return Ok(());
    }
    println!(
        "== bench_nccl  commit {commit}  {}",
        rdt::data::nccl::available().map_err(cuda_err)?
    );
    let cx = Ctx::across_gpus(commit)?;
    let sizes = sizes(quick);
    let mut rows = raw_baseline(&cx, &sizes, quick).await?;

    let rt = Runtime::builder()
        .max_frame_bytes((1usize << 30) + (64 << 20))
        .start()
        .await?;
    let p = rt.spawn::<NcclSource>(()).on_gpus([0]).await?;
    let c = rt.spawn::<NcclSink>(()).on_gpus([1]).await?;
    rt.get(c.warm().remote()).await?;
    for i in 0..200 {
        rt.get(c.ping(i).remote()).await?;
    }
    let mut us = Vec::new();
    for i in 0..200 {
        let t0 = Instant::now();
        rt.get(c.ping(i).remote()).await?;
        us.push(us_since(t0));
    }
    rows.push(row(&cx, "actor_call_rtt", "none", Kind::Latency, 0, us));
    // The same call after 3 ms with nothing to do (a 1 GiB pass keeps the
    // control plane idle about that long): what waking idle threads costs.
    let mut us = Vec::new();
    for i in 0..50 {
        tokio::time::sleep(Duration::from_millis(3)).await;
        let t0 = Instant::now();
        rt.get(c.ping(i).remote()).await?;
        us.push(us_since(t0));
    }
    rows.push(row(
        &cx,
        "actor_call_rtt_after_idle",
        "none",
        Kind::Latency,
        0,
        us,
    ));
    let t0 = Instant::now();
    rt.create_collective_group(&[p.id(), c.id()], Transport::Nccl)
        .await?;
    rows.push(row(
        &cx,
        "group_create",
        "nccl",
        Kind::Latency,
        0,
        vec![us_since(t0)],
    ));
    for &b in &sizes {
        rt.get(p.prepare(b).remote()).await?;
    }
    let first = sizes[0];
    let r = p.tensor(first).transport(Transport::Nccl).remote();
    rt.wait(&r).await?;
    let t0 = Instant::now();
    rt.get(c.touch(&r).remote()).await?;
    rows.push(row(
        &cx,
        "pass_first",
        "nccl",
        Kind::Latency,
        first,
        vec![us_since(t0)],
    ));
    for &bytes in &sizes {
        let iters = iters_for(bytes, quick);
        let r = p.tensor(bytes).transport(Transport::Nccl).remote();
        rt.wait(&r).await?;
        let mut us = Vec::new();
        for i in 0..iters + 3 {
            let t0 = Instant::now();
            rdt::data::trace::timeline("driver pass start", bytes as u64);
            let n = rt.get(c.touch(&r).remote()).await?;
            rdt::data::trace::timeline("driver pass end", bytes as u64);
            assert_eq!(n, bytes);
            if i >= 3 {
                us.push(us_since(t0));
            }
        }
        rows.push(row(&cx, "pass", "nccl", Kind::Bandwidth, bytes, us));
        let mut us = Vec::new();
        for _ in 0..iters {
            let t0 = Instant::now();
            let r = p.tensor(bytes).transport(Transport::Nccl).remote();
            rt.get(c.touch(&r).remote()).await?;
            us.push(us_since(t0));
        }
        rows.push(row(&cx, "pass_produce", "nccl", Kind::Bandwidth, bytes, us));
        let os_iters = match bytes {
            b if b >= 1 << 30 => 3,
            b if b >= 64 << 20 => 5,
            _ => iters.min(30),
        };
        // One unmeasured pass first, as `bench_cuda` does: each process's
        // host buffer pool maps and pins its buffers for this size once
        // (about a second for 1 GiB), and every later pass reuses them.
        let r = p.tensor(bytes).transport(Transport::ObjectStore).remote();
        rt.get(c.touch(&r).remote()).await?;
        drop(r);
        let mut us = Vec::new();
        for _ in 0..os_iters {
            let t0 = Instant::now();
            let r = p.tensor(bytes).transport(Transport::ObjectStore).remote();
            rt.get(c.touch(&r).remote()).await?;
            us.push(us_since(t0));
        }
        rows.push(row(&cx, "pass", "object_store", Kind::Bandwidth, bytes, us));
        println!(
            "  consumer's device slabs after these passes: {:.2} GiB",
            rt.get(c.slab_bytes().remote()).await? as f64 / (1u64 << 30) as f64
        );
    }
    rt.get(p.prepare_many(100, 1 << 30).remote()).await?;
    let m = p.many().transport(Transport::Nccl).remote();
    rt.wait(&m).await?;
    let mut us = Vec::new();
    for i in 0..iters_for(1 << 30, quick) + 3 {
        let t0 = Instant::now();
        rt.get(c.touch_all(&m).remote()).await?;
        if i >= 3 {
            us.push(us_since(t0));
        }
    }
    let total = (1usize << 30) / 100 * 100;
    rows.push(row(&cx, "many100", "nccl", Kind::Bandwidth, total, us));
    let mut us = Vec::new();
    // The first pass fills the pools (unmeasured).
    for i in 0..4 {
        let t0 = Instant::now();
        let m = p.many().transport(Transport::ObjectStore).remote();
        rt.get(c.touch_all(&m).remote()).await?;
        if i > 0 {
            us.push(us_since(t0));
        }
    }
    rows.push(row(
        &cx,
        "many100",
        "object_store",
        Kind::Bandwidth,
        total,
        us,
    ));
    drop((p, c));

    let overlap = overlap(&rt, &cx, &mut rows, if quick { 2 } else { 5 }).await?;

    println!("\n== summary (medians, same run)");
    let rtt = median_of(&rows, "actor_call_rtt", "none", 0);
    for &bytes in &sizes {
        let raw = median_of(&rows, "pass", "raw", bytes as u64);
        let ours = median_of(&rows, "pass", "nccl", bytes as u64);
        let os = median_of(&rows, "pass", "object_store", bytes as u64);
        println!(
            "  {bytes:>10} B: rdt nccl {ours:>9.1} us, raw NCCL {raw:>9.1} us (raw/rdt bandwidth {:>5.1} %), \
             object store {os:>11.1} us ({:>6.1}x slower than rdt); rdt - raw = {:>7.1} us vs one actor call {rtt:.1} us",
            100.0 * raw / ours,
            os / ours,
            ours - raw,
        );
    }
    let (raw_m, ours_m) = (
        median_of(&rows, "many100", "raw", total as u64),
        median_of(&rows, "many100", "nccl", total as u64),
    );
    println!(
        "  100 tensors / 1 GiB: rdt {ours_m:.1} us, raw {raw_m:.1} us ({:.1} %)",
        100.0 * raw_m / ours_m
    );
    if !quick {
        let (raw_g, ours_g) = (
            median_of(&rows, "pass", "raw", 1 << 30),
            median_of(&rows, "pass", "nccl", 1 << 30),
        );
        let (raw_k, ours_k) = (
            median_of(&rows, "pass", "raw", 4 << 10),
            median_of(&rows, "pass", "nccl", 4 << 10),
        );
        println!(
            "  target 1 GiB >= 95 % of raw: {} ({:.1} %); target 4 KiB <= raw + one actor call ({:.1} us): {} ({ours_k:.1} us)",
            if raw_g / ours_g >= 0.95 { "yes" } else { "NO" },
            100.0 * raw_g / ours_g,
            raw_k + rtt,
            if ours_k <= raw_k + rtt { "yes" } else { "NO" },
        );
    }
    println!("{}", overlap.line());

    if let Some(path) = json {
        let doc = serde_json::json!({ "rows": rows, "overlap": overlap });
        std::fs::write(&path, serde_json::to_string_pretty(&doc).unwrap())?;
        println!("wrote {path}");
    }
    Ok(())
}

#[derive(Serialize)]
struct Overlap {
    t_x_ms: f64,
    t_c_ms: f64,
    off_ms: f64,
    /// Window 2 (see `overlap`).
    on_ms: f64,
    /// Window 3: the three calls at once.
    on_all_at_once_ms: f64,
    ideal_ms: f64,
    /// SMs the multiplies could use, and the GPU's (`blas_sms`).
    blas_sms: (u32, u32),
    iterations: usize,
    off_iterations_ms: Vec<f64>,
    on_iterations_ms: Vec<f64>,
    on_all_at_once_iterations_ms: Vec<f64>,
}

impl Overlap {
    /// The five figures, the ratio to the ideal, the gain and the SMs, as
    /// one line of the log.
    fn line(&self) -> String {
        format!(
            "  overlap: T_x {:.2} ms, T_c {:.2} ms, off {:.2} ms, on {:.2} ms (all three at once {:.2} ms), ideal {:.2} ms; on/ideal {:.3}, gain of on over off {:.1} %; cuBLAS on {} of {} SMs",
            self.t_x_ms,
            self.t_c_ms,
            self.off_ms,
            self.on_ms,
            self.on_all_at_once_ms,
            self.ideal_ms,
            self.on_ms / self.ideal_ms,
            100.0 * (self.off_ms / self.on_ms - 1.0),
            self.blas_sms.0,
            self.blas_sms.1
        )
    }
}

fn med(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// The overlap workload (see the module docs).
async fn overlap(
    rt: &Runtime,
    cx: &Ctx,
    rows: &mut Vec<Row>,
    iters: usize,
) -> Result<Overlap, BenchError> {
    let recv = rt.spawn::<NcclSink>(()).on_gpus([1]).await?;
    rt.get(recv.warm().remote()).await?;
    let blas_sms = rt.get(recv.blas_sms().remote()).await?;
    let mut senders = Vec::new();
    for _ in 0..3 {
        let s = rt.spawn::<NcclSource>(()).on_gpus([0]).await?;
        rt.create_collective_group(&[s.id(), recv.id()], Transport::Nccl)
            .await?;
        rt.get(s.prepare_matrix().remote()).await?;
        senders.push(s);
    }
    let refs: Vec<_> = senders
        .iter()
        .map(|s| s.matrix().transport(Transport::Nccl).remote())
        .collect();
    for r in &refs {
        rt.wait(r).await?;
        // Connects each pair (NCCL does on first use), untimed.
        rt.get(recv.touch(r).remote()).await?;
    }
    let bytes = N * N * 2;
    let mut us = Vec::new();
    for i in 0..iters + 1 {
        let t0 = Instant::now();
        rt.get(recv.touch(&refs[i % 3]).remote()).await?;
        if i > 0 {
            us.push(us_since(t0));
        }
    }
    let t_x = med(us.clone()) / 1e3;
    rows.push(row(
        cx,
        "overlap_transfer",
        "nccl",
        Kind::Bandwidth,
        bytes,
        us,
    ));
    let t_c = rt.get(recv.time_mm(iters.max(3)).remote()).await? / 1e3;
    let mut off = Vec::new();
    for i in 0..iters + 1 {
        let t0 = Instant::now();
        for r in &refs {
            rt.get(recv.mm_sync(r).remote()).await?;
        }
        if i > 0 {
            off.push(us_since(t0) / 1e3);
        }
    }
    // On: at most `window` calls in flight; a call is submitted when the
    // one `window` places before it returned. Window 2 prefetches one
    // transfer ahead of the multiply (as Compiled Graphs schedules it);
    // window 3 submits all three at once (their transfers share the link).
    let mut on_by_window = Vec::new();
    for window in [2usize, 3] {
        let s0 = rt.get(recv.nccl_stats().remote()).await?;
        let held0 = rt.sends_held();
        let mut on = Vec::new();
        for i in 0..iters + 1 {
            let t0 = Instant::now();
            let mut pending = std::collections::VecDeque::new();
            for r in &refs {
                if pending.len() == window {
                    rt.get(pending.pop_front().expect("non-empty")).await?;
                }
                pending.push_back(recv.mm(r).remote());
            }
            for call in pending {
                rt.get(call).await?;
            }
            if i > 0 {
                on.push(us_since(t0) / 1e3);
            }
        }
        let s1 = rt.get(recv.nccl_stats().remote()).await?;
        println!(
            "  overlap on, {window} calls in flight: {} of {} receives into clean memory (did not wait for the receiver's compute); {} sends held behind the transfer ahead (OW-15)",
            s1.receives_clean - s0.receives_clean,
            s1.receives - s0.receives,
            rt.sends_held() - held0
        );
        on_by_window.push((window, on));
    }
    let on = on_by_window[0].1.clone();
    let on_all = on_by_window[1].1.clone();
    Ok(Overlap {
        t_x_ms: t_x,
        t_c_ms: t_c,
        off_ms: med(off.clone()),
        on_ms: med(on.clone()),
        on_all_at_once_ms: med(on_all.clone()),
        ideal_ms: t_x + 3.0 * t_x.max(t_c),
        blas_sms,
        iterations: iters,
        off_iterations_ms: off,
        on_iterations_ms: on,
        on_all_at_once_iterations_ms: on_all,
    })
}

/// `--overlap-only`: the overlap workload alone, its summary line on
/// stdout (no rows): for comparing settings run after run on one
/// machine.
async fn overlap_only(quick: bool) -> Result<(), BenchError> {
    if rdt::data::cuda::device_count() < 2 {
        println!("== bench_nccl --overlap-only: needs two GPUs: skipped");
        return Ok(());
    }
    let rt = Runtime::start().await?;
    let cx = Ctx {
        device: "cuda (0 -> 1)".into(),
        device_name: rdt::data::cuda::gpu(0).map_err(cuda_err)?.name(),
        commit: std::env::var("RDT_COMMIT").unwrap_or_else(|_| "unknown".into()),
    };
    let mut rows = Vec::new();
    let o = overlap(&rt, &cx, &mut rows, if quick { 2 } else { 5 }).await?;
    println!(
        "{}; on iterations {:?} ms",
        o.line(),
        o.on_iterations_ms
            .iter()
            .map(|v| (v * 100.0).round() / 100.0)
            .collect::<Vec<_>>()
    );
    rt.shutdown().await;
    Ok(())
}

/// `--timeline`: tiny calls, then passes at 4 KiB and 1 GiB, with `RDT_TIMELINE` on in
/// the driver and both workers (every step of every pass on one clock);
/// no rows.
async fn timeline_passes() -> Result<(), BenchError> {
    // Before any worker starts: they inherit it.
    rdt_examples::record_timeline();
    // ANCHOR: nccl_group
    let rt = Runtime::start().await?;
    let p = rt.spawn::<NcclSource>(()).on_gpus([0]).await?;
    let c = rt.spawn::<NcclSink>(()).on_gpus([1]).await?;
    rt.create_collective_group(&[p.id(), c.id()], Transport::Nccl)
        .await?;
    // ANCHOR_END: nccl_group
    // Tiny calls to the consumer first, on the same timeline (id 0): the
    // budget a 4 KiB pass is held to, step by step.
    for i in 0..20u64 {
        rdt::data::trace::timeline("driver pass start", 0);
        rt.get(c.ping(i).remote()).await?;
        rdt::data::trace::timeline("driver pass end", 0);
    }
    for (bytes, passes) in [(4usize << 10, 20), (1 << 30, 6)] {
        rt.get(p.prepare(bytes).remote()).await?;
        let r = p.tensor(bytes).transport(Transport::Nccl).remote();
        rt.wait(&r).await?;
        for _ in 0..passes {
            rdt::data::trace::timeline("driver pass start", bytes as u64);
            rt.get(c.touch(&r).remote()).await?;
            rdt::data::trace::timeline("driver pass end", bytes as u64);
        }
    }
    // Every process prints its points every 20 ms.
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    rdt::timeline::flush();
    Ok(())
}

/// `--ab-control-threads N`: two producer/consumer pairs (producers on
/// GPU 0, consumers on GPU 1, a group each), one whose workers run their
/// control loop on one tokio thread (`RDT_CONTROL_THREADS=1`), one on two
/// (the default); N rounds of a tiny call and a 4 KiB pass to each pair,
/// in turns.
async fn ab_control_threads(n: usize) -> Result<(), BenchError> {
    let cx = Ctx::across_gpus(std::env::var("RDT_COMMIT").unwrap_or_else(|_| "unknown".into()))?;
    let raw = raw_baseline(&cx, &sizes(true), true).await?;
    let raw4k = median_of(&raw, "pass", "raw", 4 << 10);
    let rt = Runtime::start().await?;
    let bytes = 4usize << 10;
    let mut pairs = Vec::new();
    for threads in ["1", "2"] {
        // SAFETY: no other thread of this process reads the environment
        // while the workers are spawned (they inherit it).
        unsafe { std::env::set_var("RDT_CONTROL_THREADS", threads) };
        let p = rt.spawn::<NcclSource>(()).on_gpus([0]).await?;
        let c = rt.spawn::<NcclSink>(()).on_gpus([1]).await?;
        rt.create_collective_group(&[p.id(), c.id()], Transport::Nccl)
            .await?;
        rt.get(c.warm().remote()).await?;
        rt.get(p.prepare(bytes).remote()).await?;
        let r = p.tensor(bytes).transport(Transport::Nccl).remote();
        rt.wait(&r).await?;
        rt.get(c.touch(&r).remote()).await?;
        pairs.push((p, c, r));
    }
    unsafe { std::env::remove_var("RDT_CONTROL_THREADS") };
    let mut tiny = [Vec::new(), Vec::new()];
    let mut pass = [Vec::new(), Vec::new()];
    for i in 0..n + 20 {
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for &k in &order {
            let (_, c, r) = &pairs[k];
            let t0 = Instant::now();
            rt.get(c.ping(i as u64).remote()).await?;
            let call = us_since(t0);
            let t0 = Instant::now();
            rt.get(c.touch(r).remote()).await?;
            if i >= 20 {
                tiny[k].push(call);
                pass[k].push(us_since(t0));
            }
        }
    }
    let median = rdt_examples::median;
    for (k, threads) in ["1", "2"].iter().enumerate() {
        let (t, ps) = (median(&mut tiny[k]), median(&mut pass[k]));
        println!(
            "nccl control threads {threads}: tiny call {t:.1} us, 4 KiB pass {ps:.1} us ({:.1} over raw {raw4k:.1} + call)",
            ps - raw4k - t
        );
    }
    rt.shutdown().await;
    Ok(())
}

/// `--small-passes N`: raw NCCL at 4 KiB (and 1 MiB), then N tiny calls
/// and N rdt passes of 4 KiB across the two GPUs, in one run; prints the
/// medians and the pass's excess over raw + call (no rows).
async fn small_passes(n: usize) -> Result<(), BenchError> {
    let cx = Ctx::across_gpus(std::env::var("RDT_COMMIT").unwrap_or_else(|_| "unknown".into()))?;
    let raw = raw_baseline(&cx, &sizes(true), true).await?;
    let raw4k = median_of(&raw, "pass", "raw", 4 << 10);
    let rt = Runtime::start().await?;
    let p = rt.spawn::<NcclSource>(()).on_gpus([0]).await?;
    let c = rt.spawn::<NcclSink>(()).on_gpus([1]).await?;
    rt.create_collective_group(&[p.id(), c.id()], Transport::Nccl)
        .await?;
    rt.get(c.warm().remote()).await?;
    let mut us = Vec::with_capacity(n);
    for i in 0..n as u64 + 20 {
        let t0 = Instant::now();
        rt.get(c.ping(i).remote()).await?;
        if i >= 20 {
            us.push(us_since(t0));
        }
    }
    let call = rdt_examples::median(&mut us);
    let bytes = 4usize << 10;
    rt.get(p.prepare(bytes).remote()).await?;
    let r = p.tensor(bytes).transport(Transport::Nccl).remote();
    rt.wait(&r).await?;
    let mut us = Vec::with_capacity(n);
    for i in 0..n + 20 {
        let t0 = Instant::now();
        rt.get(c.touch(&r).remote()).await?;
        if i >= 20 {
            us.push(us_since(t0));
        }
    }
    let pass = rdt_examples::median(&mut us);
    println!(
        "nccl small passes: {n} tiny calls median {call:.1} us; {n} passes of 4 KiB median {pass:.1} us; \
         raw 4 KiB {raw4k:.1} us; pass - (raw + call) = {:.1} us",
        pass - raw4k - call
    );
    rt.shutdown().await;
    Ok(())
}
