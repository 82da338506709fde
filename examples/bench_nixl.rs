//! NIXL GPU benchmark: `cargo run --release --example bench_nixl -- [--json PATH] [--quick]`.
//! Needs a GPU; the cross-GPU rows need two (with one, they are skipped
//! and say so).
//!
//! In one run:
//! * `raw`: NIXL READs between two plain processes through rdt's own
//!   binding (`rdt::data::nixl::raw`): a holder process registers its
//!   buffers on GPU 0, a reader process (on GPU 1 for `cross`, on GPU 0
//!   for `same`; each sees only its own GPU, as rdt's workers do)
//!   registers its own, loads the holder's metadata and times one READ per
//!   iteration (post, then poll until done). The first READ of the pair
//!   (connection set-up included) is its own row (`first_read`), and so
//!   is the same READ with the metadata loads before it
//!   (`first_read_loaded`: the holder's connection and registration, as
//!   an rdt first pass loads them). `many10000` is one READ
//!   of 10 000 descriptors of 4 KiB (what Ray and vLLM post), `one40M` one
//!   descriptor of 40 MiB.
//! * `nixl`: rdt passes between actors: the producer (GPU 0) made the
//!   tensor before; a pass is one consumer call (GPU 1 for `cross`, GPU 0
//!   for `same`) on its ref: the driver hands the ref over, the consumer
//!   reads it with NIXL and answers. `pass_first` is the first pass of a
//!   new pair (the consumer's agent, connection and metadata loads).
//!   `many10000` passes an object of 10 000 tensors of 4 KiB; `one40M`
//!   one tensor of 40 MiB; `many10000_into` the same object read into the
//!   consumer's own parameters (10 000 views of one flat CUDA buffer, with
//!   `get_into`: a weight update); `many10000_load` the same update with
//!   `load_into` (no value back: the consumer keeps its parameters, and no
//!   tensor handle is made). `actor_call_rtt` is a tiny call (the 4 KiB
//!   budget: raw + one call).
//! * `driver_get`: the driver reads a 1 GiB object held on GPU 0 into its
//!   host memory (`Runtime::get_on_host`) and onto its GPU 0
//!   (`Runtime::get`), next to the object-store path of the same object
//!   (`Runtime::get_via_object_store`).
//!
//! Rows use the harness schema (`suite` = `nixl`); every row copies its
//! bytes, so `gbps` is `bytes` per median (1e9 B/s).

use std::time::Instant;

use rdt::data::nixl::raw::{Memory, RawAgent};
use rdt::prelude::*;
use rdt_examples::{arg_value, us_since, BenchError, Kind, Row};
use serde::{Deserialize, Serialize};

#[rdt::actor]
pub struct NixlSource {
    kept: std::collections::HashMap<usize, Tensor>,
    many: Vec<Tensor>,
    host: Option<Tensor>,
}

#[rdt::actor]
impl NixlSource {
    fn new() -> Self {
        NixlSource {
            kept: Default::default(),
            many: Vec::new(),
            host: None,
        }
    }

    /// Makes the tensor of `bytes` bytes now (finished on the GPU).
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
            .ok_or_else(|| BenchError::new(format!("no tensor of {bytes} B prepared")))
    }

    /// Makes the host tensor of `bytes` bytes now.
    async fn prepare_host(&mut self, bytes: usize) -> usize {
        self.host = Some(Tensor::full(1u8, &[bytes]));
        bytes
    }

    /// The host tensor.
    async fn host_tensor(&mut self) -> Result<Tensor, BenchError> {
        self.host
            .clone()
            .ok_or_else(|| BenchError::new("no host tensor prepared"))
    }

    /// Makes `n` tensors of `each` bytes.
    async fn prepare_many(&mut self, n: usize, each: usize) -> Result<usize, BenchError> {
        self.many = (0..n)
            .map(|_| Tensor::cuda_full(2u8, &[each], 0))
            .collect::<std::result::Result<_, _>>()?;
        if let Some(t) = self.many.last() {
            t.cuda_ready().await?;
        }
        Ok(n)
    }

    /// The `n` tensors.
    async fn many(&mut self) -> Vec<Tensor> {
        self.many.clone()
    }
}

#[rdt::actor]
pub struct NixlSink {
    /// Kept as one `rdt::Targets`, as a trainer keeps its weights.
    params: rdt::Targets,
}

#[rdt::actor]
impl NixlSink {
    fn new() -> Self {
        NixlSink {
            params: rdt::Targets::default(),
        }
    }

    /// Makes its parameters: `n` views of `each` bytes of one flat CUDA
    /// buffer (a model's weights, laid out as trainers do).
    async fn make_params(&mut self, n: usize, each: usize) -> Result<usize, BenchError> {
        let flat = Tensor::cuda_zeros(DType::U8, &[n * each], 0)?;
        self.params = (0..n)
            .map(|i| flat.view(i * each, DType::U8, &[each]))
            .collect::<std::result::Result<_, _>>()?;
        flat.cuda_ready().await?;
        Ok(n)
    }

    // ANCHOR: sink_update
    /// A weight update: the object behind `r` read into the parameters
    /// (`get_into`), usable once this returns.
    async fn update(&mut self, r: ObjectRef<Vec<Tensor>>) -> Result<usize, BenchError> {
        let got: Vec<Tensor> = rdt::runtime().get_into(&r, &self.params).await?;
        if let Some(t) = got.last() {
            t.cuda_ready().await?;
        }
        Ok(got.iter().map(Tensor::nbytes).sum())
    }

    /// A weight update that needs no value back (`load_into`): the
    /// parameters hold the new weights, usable once this returns.
    async fn load(&mut self, r: ObjectRef<Vec<Tensor>>) -> Result<usize, BenchError> {
        rdt::runtime().load_into(&r, &self.params).await?;
        if let Some(t) = self.params.last() {
            t.cuda_ready().await?;
        }
        Ok(self.params.len() * self.params.first().map_or(0, Tensor::nbytes))
    }
    // ANCHOR_END: sink_update

    /// The tensors are usable here once the read returned.
    async fn touch(&mut self, t: Tensor) -> Result<usize, BenchError> {
        rdt::data::trace::timeline("touch start", 0);
        t.cuda_ready().await?;
        rdt::data::trace::timeline("touch ready", 0);
        let n = t.nbytes();
        drop(t);
        rdt::data::trace::timeline("touch dropped", 0);
        Ok(n)
    }

    /// All of them.
    async fn touch_all(&mut self, ts: Vec<Tensor>) -> Result<usize, BenchError> {
        rdt::data::trace::timeline("touch_all start", ts.len() as u64);
        if let Some(t) = ts.last() {
            t.cuda_ready().await?;
        }
        let n = ts.iter().map(Tensor::nbytes).sum();
        rdt::data::trace::timeline("touch_all dropping", 0);
        drop(ts);
        rdt::data::trace::timeline("touch_all dropped", 0);
        Ok(n)
    }

    /// A tiny call.
    async fn ping(&mut self, x: u64) -> u64 {
        x
    }

    /// Starts CUDA here (untimed).
    async fn warm(&mut self) -> Result<usize, BenchError> {
        let t = Tensor::cuda_zeros(DType::U8, &[4096], 0)?;
        t.cuda_ready().await?;
        Ok(t.nbytes())
    }

    /// Sets this worker's read spin (`rdt::data::nixl::set_read_spin`).
    async fn set_read_spin(&mut self, us: u64) -> u64 {
        rdt::data::nixl::set_read_spin(std::time::Duration::from_micros(us));
        us
    }

    /// This worker's NIXL counters.
    async fn nixl_stats(&mut self) -> rdt::data::nixl::NixlStats {
        rdt::data::nixl::stats()
    }
}

fn err(e: impl std::fmt::Display) -> BenchError {
    BenchError::new(e.to_string())
}

struct Ctx {
    device: String,
    device_name: String,
    commit: String,
}

impl Ctx {
    /// This run's GPU 0 and commit (`RDT_COMMIT`, set by `run.sh`).
    fn of_this_run() -> Result<Ctx, BenchError> {
        let g0 = rdt::data::cuda::gpu(0).map_err(err)?;
        Ok(Ctx {
            device: format!("cuda ({})", g0.uuid()),
            device_name: g0.name(),
            commit: std::env::var("RDT_COMMIT").unwrap_or_else(|_| "unknown".into()),
        })
    }
}

/// The GPUs this process sees, as `CUDA_VISIBLE_DEVICES` names them (for
/// the raw children, which each see one).
fn visible_gpus() -> Vec<String> {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(v) if !v.is_empty() => v.split(',').map(str::to_string).collect(),
        _ => (0..rdt::data::cuda::device_count())
            .map(|i| i.to_string())
            .collect(),
    }
}

fn row(cx: &Ctx, case: &str, transport: &str, kind: Kind, bytes: usize, us: Vec<f64>) -> Row {
    let r = Row {
        device_name: Some(cx.device_name.clone()),
        commit: Some(cx.commit.clone()),
        ..Row::new("nixl", case, transport, &cx.device, kind, bytes as u64, us)
    };
    r.print();
    r
}

fn iters_for(bytes: usize, quick: bool) -> usize {
    match (quick, bytes) {
        (true, _) => 10,
        (_, b) if b >= 1 << 30 => 20,
        (_, b) if b >= 64 << 20 => 50,
        _ => 200,
    }
}

/// One case of the raw baseline, as the holder publishes it.
#[derive(Serialize, Deserialize)]
struct RawCase {
    case: String,
    /// (address, length) of each buffer, on the holder's GPU 0.
    ranges: Vec<(u64, usize)>,
    /// The holder's registration metadata, one per buffer.
    mds: Vec<Vec<u8>>,
}

#[derive(Serialize, Deserialize)]
struct RawPlan {
    conn: Vec<u8>,
    cases: Vec<RawCase>,
    quick: bool,
    /// The buffers are in host memory (`--host`), not on GPU 0.
    host: bool,
    /// Host buffers are page-locked with CUDA (`--pin`), as rdt's are.
    pin: bool,
}

/// What the reader measured: (case, bytes, µs per READ), the first READ
/// of the pair, and the metadata loads before it (the holder's connection
/// and the first case's registrations), µs.
type RawResult = (Vec<(String, usize, Vec<f64>)>, f64, f64);

/// The raw reader (a child process): reads every case from the holder.
fn raw_reader(plan: RawPlan) -> Result<RawResult, String> {
    // As in an rdt worker: the process's CUDA context exists before the
    // agent is made.
    let warm = Tensor::cuda_zeros(DType::U8, &[4096], 0).map_err(|e| e.to_string())?;
    drop(warm);
    let agent = RawAgent::new(&format!("raw-reader-{}", std::process::id())).map_err(|e| e.0)?;
    let t0 = Instant::now();
    let peer = agent.load_remote(&plan.conn).map_err(|e| e.0)?;
    // Timed up to the first READ, as an rdt first pass loads them.
    let mut loads = us_since(t0);
    let mut out = Vec::new();
    let mut first = f64::NAN;
    for c in &plan.cases {
        let t0 = Instant::now();
        for md in &c.mds {
            agent.load_remote(md).map_err(|e| e.0)?;
        }
        if first.is_nan() {
            loads += us_since(t0);
        }
        let total: usize = c.ranges.iter().map(|r| r.1).sum();
        let mem = if plan.host {
            Memory::Host
        } else {
            Memory::Cuda(0)
        };
        // Local buffers: one allocation, the ranges back to back.
        let mut host_buf = Vec::new();
        let base = if plan.host {
            host_buf = vec![0u8; total];
            if plan.pin {
                // SAFETY: unpinned below, before the buffer is dropped.
                unsafe { rdt::data::cuda::pin_host(host_buf.as_mut_ptr(), total) }
                    .map_err(|e| e.to_string())?;
            }
            host_buf.as_ptr() as u64
        } else {
            let buf = Tensor::cuda_zeros(DType::U8, &[total], 0).map_err(|e| e.to_string())?;
            buf.with_device_buffer(|d| d.device_ptr())
                .map_err(|e| e.to_string())?
        };
        agent.register(mem, base, total).map_err(|e| e.0)?;
        let mut local = Vec::with_capacity(c.ranges.len());
        let mut off = 0u64;
        for r in &c.ranges {
            local.push((base + off, r.1));
            off += r.1 as u64;
        }
        let iters = iters_for(total, plan.quick);
        // At 4 KiB also with an 8-byte notification, as rdt's reads carry.
        let notifs: &[&[u8]] = if c.case == "pass" && total == 4 << 10 {
            &[&[], &[7u8; 8]]
        } else {
            &[&[]]
        };
        for notif in notifs {
            let mut us = Vec::new();
            let mut s0 = rdt::data::nixl::stats();
            for i in 0..iters + 3 {
                if i == 3 {
                    // The split below leaves out the warm-up READs.
                    s0 = rdt::data::nixl::stats();
                }
                let t0 = Instant::now();
                agent
                    .read((mem, &local), (mem, &c.ranges), &peer, notif)
                    .map_err(|e| e.0)?;
                let t = us_since(t0);
                if first.is_nan() {
                    first = t;
                }
                if i >= 3 {
                    us.push(t);
                }
            }
            let case = if notif.is_empty() {
                c.case.clone()
            } else {
                format!("{}_notif", c.case)
            };
            if total == 4 << 10 {
                let s1 = rdt::data::nixl::stats();
                eprintln!(
                    "   raw 4 KiB {case}: per READ {}",
                    post_split(&s0, &s1, iters as f64)
                );
            }
            out.push((case, total, us));
        }
        agent.deregister(mem, base, total).map_err(|e| e.0)?;
        if plan.host && plan.pin {
            // SAFETY: pinned above, still alive.
            unsafe { rdt::data::cuda::unpin_host(host_buf.as_mut_ptr()) };
        }
        drop(host_buf);
    }
    Ok((out, first, loads))
}

/// The raw holder (a child process, on the same GPU as rdt's producer and
/// with the same single-GPU view as an rdt worker): registers one buffer
/// per case on its GPU 0, prints the plan, and keeps everything until its
/// stdin closes.
async fn raw_holder(sizes: &[usize], quick: bool, host: bool, pin: bool) -> Result<(), BenchError> {
    // As in an rdt worker: the process's CUDA context exists before the
    // agent is made.
    Tensor::cuda_zeros(DType::U8, &[4096], 0)?
        .cuda_ready()
        .await?;
    let agent = RawAgent::new(&format!("raw-holder-{}", std::process::id())).map_err(err)?;
    let mut held = Vec::new();
    let mut cases = Vec::new();
    let mut shapes: Vec<(String, usize, usize)> =
        sizes.iter().map(|&b| ("pass".into(), 1, b)).collect();
    if !host {
        shapes.push(("many10000".into(), 10_000, 4 << 10));
        shapes.push(("one40M".into(), 1, 40 << 20));
    }
    let mem = if host { Memory::Host } else { Memory::Cuda(0) };
    let mut regs = Vec::new();
    let mut held_host = Vec::new();
    for (case, n, each) in shapes {
        // One allocation per case, registered once; the buffers are
        // ranges of it (as rdt's slabs are).
        let base = if host {
            let mut b = vec![3u8; n * each];
            if pin {
                // SAFETY: unpinned below, before the buffer is dropped.
                unsafe { rdt::data::cuda::pin_host(b.as_mut_ptr(), n * each) }?;
            }
            let base = b.as_ptr() as u64;
            held_host.push(b);
            base
        } else {
            let t = Tensor::cuda_full(3u8, &[n * each], 0)?;
            t.cuda_ready().await?;
            let base = t.with_device_buffer(|d| d.device_ptr())?;
            held.push(t);
            base
        };
        let md = agent.register(mem, base, n * each).map_err(err)?;
        regs.push((base, n * each));
        let ranges: Vec<(u64, usize)> = (0..n).map(|i| (base + (i * each) as u64, each)).collect();
        cases.push(RawCase {
            case,
            ranges,
            mds: vec![md],
        });
    }
    let plan = RawPlan {
        conn: agent.connection_md().map_err(err)?,
        cases,
        quick,
        host,
        pin,
    };
    println!("PLAN {}", serde_json::to_string(&plan).map_err(err)?);
    // Until the parent says the reader is done.
    let mut rest = String::new();
    let _ = std::io::Read::read_to_string(&mut std::io::stdin(), &mut rest);
    for (base, len) in regs {
        agent.deregister(mem, base, len).map_err(err)?;
    }
    drop(held);
    for mut b in held_host {
        if pin {
            // SAFETY: pinned above, still alive.
            unsafe { rdt::data::cuda::unpin_host(b.as_mut_ptr()) };
        }
    }
    Ok(())
}

/// The raw baseline between two plain child processes: a holder on
/// `holder_gpu`, a reader on `reader_gpu` (each seeing only its own GPU,
/// as rdt's workers do).
async fn raw_baseline(
    cx: &Ctx,
    label: &str,
    holder_gpu: &str,
    reader_gpu: &str,
    quick: bool,
) -> Result<Vec<Row>, BenchError> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let exe = std::env::current_exe()?;
    let mut holder = tokio::process::Command::new(&exe)
        .arg("--raw-holder")
        // Nothing reads its stdout after the plan: UCX's tables there
        // would fill the pipe and stop it.
        .env_remove("UCX_PROTO_INFO")
        .args(match label {
            "host" => vec!["--host"],
            "host_pinned" => vec!["--host", "--pin"],
            _ => vec![],
        })
        // UCX's diagnostics (stderr, into the log): what it could register.
        .env(
            "UCX_LOG_LEVEL",
            std::env::var("RDT_RAW_UCX_LOG").unwrap_or("warn".into()),
        )
        .args(if quick { vec!["--quick"] } else { vec![] })
        .env("CUDA_VISIBLE_DEVICES", holder_gpu)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let holder_in = holder.stdin.take().expect("piped");
    let mut holder_out = tokio::io::BufReader::new(holder.stdout.take().expect("piped"));
    let mut plan = String::new();
    loop {
        plan.clear();
        if holder_out.read_line(&mut plan).await? == 0 {
            return Err(err("the raw NIXL holder exited without a plan"));
        }
        if let Some(p) = plan.strip_prefix("PLAN ") {
            plan = p.to_string();
            break;
        }
    }
    let mut reader = tokio::process::Command::new(&exe)
        .arg("--raw-reader")
        .env("CUDA_VISIBLE_DEVICES", reader_gpu)
        // UCX prints the protocols it picks on the reader's stdout (the
        // error below shows them if the result line is missing): how device
        // memory moves between the two processes.
        .env("UCX_PROTO_INFO", "y")
        .env(
            "UCX_LOG_LEVEL",
            std::env::var("RDT_RAW_UCX_LOG").unwrap_or("warn".into()),
        )
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()?;
    let mut stdin = reader.stdin.take().expect("piped");
    stdin.write_all(plan.as_bytes()).await?;
    drop(stdin);
    let mut text = String::new();
    reader
        .stdout
        .take()
        .expect("piped")
        .read_to_string(&mut text)
        .await?;
    let status = reader.wait().await?;
    drop(holder_in);
    let _ = holder.wait().await;
    if !status.success() {
        return Err(err(format!("the raw NIXL reader failed: {status}: {text}")));
    }
    let line = text
        .lines()
        // (UCX's protocol tables share the reader's stdout, and may end
        // without a newline before this line.)
        .find_map(|l| l.find("RAW [").map(|i| &l[i + 4..]))
        .ok_or_else(|| err(format!("the raw NIXL reader said: {text}")))?;
    let (cases, first, loads): RawResult = serde_json::from_str(line).map_err(err)?;
    // What UCX picked for the reads (UCX_PROTO_INFO's table headers).
    for l in text.lines().filter(|l| l.contains("memory read")) {
        println!("   raw {label} reader, UCX: {}", l.trim());
    }
    let mut rows = vec![
        row(
            cx,
            &format!("first_read_{label}"),
            "raw",
            Kind::Latency,
            4 << 10,
            vec![first],
        ),
        // With the metadata loads before it: what an rdt first pass does
        // besides its call (and waiting for its agent, if still made).
        row(
            cx,
            &format!("first_read_loaded_{label}"),
            "raw",
            Kind::Latency,
            4 << 10,
            vec![loads + first],
        ),
    ];
    for (case, bytes, us) in cases {
        rows.push(row(
            cx,
            &format!("{case}_{label}"),
            "raw",
            Kind::Bandwidth,
            bytes,
            us,
        ));
    }
    Ok(rows)
}

/// rdt passes from `p` to `c`.
async fn rdt_passes(
    cx: &Ctx,
    rt: &Runtime,
    label: &str,
    p: &NixlSourceHandle,
    c: &NixlSinkHandle,
    sizes: &[usize],
    quick: bool,
) -> Result<Vec<Row>, BenchError> {
    let mut rows = Vec::new();
    let mut first = true;
    let mut all: Vec<usize> = sizes.to_vec();
    all.push(40 << 20);
    for b in all {
        let r = p.tensor(b).transport(Transport::Nixl).remote();
        rt.wait(&r).await?;
        if first {
            let s0 = rt.get(c.nixl_stats().remote()).await?;
            let t0 = Instant::now();
            rt.get(c.touch(&r).remote()).await?;
            let first_us = us_since(t0);
            let s1 = rt.get(c.nixl_stats().remote()).await?;
            // Where the first pass went: the consumer's agent (made in the
            // background since the worker started, waited for here), and
            // the producer's connection and registrations loaded.
            println!(
                "   first pass {label}: {:.1} ms; the consumer waited {:.1} ms for its agent \
                 (made in {:.1} ms), loaded {} remote metadata blobs in {:.1} ms",
                first_us / 1e3,
                (s1.agent_wait_nanos - s0.agent_wait_nanos) as f64 / 1e6,
                s1.agent_make_nanos as f64 / 1e6,
                s1.remote_loads - s0.remote_loads,
                (s1.remote_load_nanos - s0.remote_load_nanos) as f64 / 1e6,
            );
            rows.push(row(
                cx,
                &format!("pass_first_{label}"),
                "nixl",
                Kind::Latency,
                b,
                vec![first_us],
            ));
            first = false;
        }
        let iters = iters_for(b, quick);
        let mut us = Vec::new();
        let mut before = None;
        for i in 0..iters + 3 {
            if i == 3 {
                before = Some(rt.get(c.nixl_stats().remote()).await?);
            }
            let t0 = Instant::now();
            let n = rt.get(c.touch(&r).remote()).await?;
            assert_eq!(n, b);
            if i >= 3 {
                us.push(us_since(t0));
            }
        }
        if b == 4 << 10 {
            // Where a small pass's time goes in the consumer: posting, and
            // the READ (post to end), per pass; and how many READs ended
            // without the poller thread.
            let (s0, s1) = (before.expect("set"), rt.get(c.nixl_stats().remote()).await?);
            let n = (s1.reads_posted - s0.reads_posted).max(1) as f64;
            let post = (s1.post_nanos - s0.post_nanos) as f64 / n / 1e3;
            let read = (s1.read_nanos - s0.read_nanos) as f64 / n / 1e3;
            println!(
                "   4 KiB pass {label}: post {post:.1} us, read (post to end) {read:.1} us, \
                 {} of {} READs ended inline; {}",
                s1.reads_done_inline - s0.reads_done_inline,
                s1.reads_posted - s0.reads_posted,
                post_split(&s0, &s1, n)
            );
            rows.push(row(
                cx,
                &format!("pass_post_{label}"),
                "nixl",
                Kind::Latency,
                b,
                vec![post],
            ));
            rows.push(row(
                cx,
                &format!("pass_read_{label}"),
                "nixl",
                Kind::Latency,
                b,
                vec![read],
            ));
        }
        let case = if b == 40 << 20 { "one40M" } else { "pass" };
        rows.push(row(
            cx,
            &format!("{case}_{label}"),
            "nixl",
            Kind::Bandwidth,
            b,
            us,
        ));
    }
    let r = p.many().transport(Transport::Nixl).remote();
    rt.wait(&r).await?;
    let iters = iters_for(40 << 20, quick);
    let s0 = rt.get(c.nixl_stats().remote()).await?;
    let us = timed_passes(iters, || rt.get(c.touch_all(&r).remote())).await?;
    let s1 = rt.get(c.nixl_stats().remote()).await?;
    let reads = (s1.reads_posted - s0.reads_posted).max(1);
    println!(
        "   many10000_{label}: {:.1} READs per pass, {:.1} descriptors per READ",
        reads as f64 / (iters + 3) as f64,
        (s1.descriptors_posted - s0.descriptors_posted) as f64 / reads as f64
    );
    rows.push(row(
        cx,
        &format!("many10000_{label}"),
        "nixl",
        Kind::Bandwidth,
        10_000 * 4096,
        us,
    ));
    // The same object read into the consumer's own parameters (views of
    // one flat buffer): a weight update.
    rt.get(c.make_params(10_000, 4096).remote()).await?;
    let us = timed_passes(iters, || rt.get(c.update(&r).remote())).await?;
    rows.push(row(
        cx,
        &format!("many10000_into_{label}"),
        "nixl",
        Kind::Bandwidth,
        10_000 * 4096,
        us,
    ));
    // The same update with no value back (`load_into`): the parameters
    // are the consumer's own, so no tensor handle is made or dropped.
    let us = timed_passes(iters, || rt.get(c.load(&r).remote())).await?;
    rows.push(row(
        cx,
        &format!("many10000_load_{label}"),
        "nixl",
        Kind::Bandwidth,
        10_000 * 4096,
        us,
    ));
    Ok(rows)
}

/// `iters` passes of the object of 10 000 tensors of 4 KiB after 3
/// untimed ones; each `pass` returns the bytes the consumer saw. µs each.
async fn timed_passes<F, Fut>(iters: usize, mut pass: F) -> Result<Vec<f64>, BenchError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = rdt::Result<usize>>,
{
    let mut us = Vec::with_capacity(iters);
    for i in 0..iters + 3 {
        let t0 = Instant::now();
        assert_eq!(pass().await?, 10_000 * 4096);
        if i >= 3 {
            us.push(us_since(t0));
        }
    }
    Ok(us)
}

/// `n` + 3 passes of the object of 10 000 tensors of 4 KiB, numbered from
/// `first` on the timeline; prints the median as `what`.
async fn timeline_of<F, Fut>(
    what: &str,
    first: u64,
    n: usize,
    mut pass: F,
) -> Result<(), BenchError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = rdt::Result<usize>>,
{
    let mut us = Vec::with_capacity(n + 3);
    for i in first..first + n as u64 + 3 {
        rdt::data::trace::timeline("driver pass start", i);
        let t0 = Instant::now();
        assert_eq!(pass().await?, 10_000 * 4096);
        us.push(us_since(t0));
        rdt::data::trace::timeline("driver pass end", i);
    }
    us.sort_by(f64::total_cmp);
    println!("{} {what}: median {:.1} us", us.len(), us[us.len() / 2]);
    Ok(())
}

/// Where posting `reads` READs went, per READ: the agent's lock, making
/// the request, posting it.
fn post_split(
    s0: &rdt::data::nixl::NixlStats,
    s1: &rdt::data::nixl::NixlStats,
    reads: f64,
) -> String {
    let us = |a: u64, b: u64| (b - a) as f64 / reads / 1e3;
    format!(
        "lock {:.1} us, create {:.1} us, post {:.1} us",
        us(s0.post_lock_nanos, s1.post_lock_nanos),
        us(s0.post_create_nanos, s1.post_create_nanos),
        us(s0.post_submit_nanos, s1.post_submit_nanos)
    )
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
    if args.iter().any(|a| a == "--raw-holder") {
        let host = args.iter().any(|a| a == "--host");
        let pin = args.iter().any(|a| a == "--pin");
        let sizes = if host { vec![4 << 10] } else { sizes(quick) };
        return raw_holder(&sizes, quick, host, pin).await;
    }
    if args.iter().any(|a| a == "--raw-reader") {
        let mut line = String::new();
        std::io::stdin().read_line(&mut line)?;
        let plan: RawPlan = serde_json::from_str(&line).map_err(err)?;
        let r = raw_reader(plan).map_err(err)?;
        println!("RAW {}", serde_json::to_string(&r).map_err(err)?);
        return Ok(());
    }
    if args.iter().any(|a| a == "--timeline") {
        return timeline_passes(8).await;
    }
    if args.iter().any(|a| a == "--timeline-many") {
        return timeline_many(8).await;
    }
    if let Some(n) = arg_value("--ab-control-threads").and_then(|n| n.parse().ok()) {
        return ab_control_threads(n).await;
    }
    if let Some(n) = arg_value("--small-passes").and_then(|n| n.parse().ok()) {
        let spin = arg_value("--spin-us")
            .and_then(|n| n.parse().ok())
            .unwrap_or(30);
        return small_passes(n, spin).await;
    }
    let json = arg_value("--json");
    rdt::data::cuda::available().map_err(err)?;
    rdt::data::nixl::available().map_err(err)?;
    let n_gpus = rdt::data::cuda::device_count();
    let cx = Ctx::of_this_run()?;
    println!("== bench_nixl  commit {}  {n_gpus} GPU(s)", cx.commit);
    let visible = visible_gpus();
    let sizes = sizes(quick);
    let mut rows = Vec::new();
    rows.extend(raw_baseline(&cx, "same", &visible[0], &visible[0], quick).await?);
    if n_gpus >= 2 {
        rows.extend(raw_baseline(&cx, "cross", &visible[0], &visible[1], quick).await?);
    } else {
        println!("== cross-GPU rows: need two GPUs, {n_gpus} visible: skipped");
    }

    let rt = Runtime::builder()
        .max_frame_bytes((1usize << 30) + (64 << 20))
        .start()
        .await?;
    let p = rt.spawn::<NixlSource>(()).on_gpus([0]).await?;
    let c0 = rt.spawn::<NixlSink>(()).on_gpus([0]).await?;
    rt.get(c0.warm().remote()).await?;
    for i in 0..200 {
        rt.get(c0.ping(i).remote()).await?;
    }
    let mut us = Vec::new();
    for i in 0..200 {
        let t0 = Instant::now();
        rt.get(c0.ping(i).remote()).await?;
        us.push(us_since(t0));
    }
    rows.push(row(&cx, "actor_call_rtt", "none", Kind::Latency, 0, us));
    // The driver's reads are of 1 GiB, also with --quick.
    let big = 1usize << 30;
    for &b in sizes.iter().chain([40usize << 20, big].iter()) {
        rt.get(p.prepare(b).remote()).await?;
    }
    rt.get(p.prepare_many(10_000, 4096).remote()).await?;
    rows.extend(rdt_passes(&cx, &rt, "same", &p, &c0, &sizes, quick).await?);
    if n_gpus >= 2 {
        let c1 = rt.spawn::<NixlSink>(()).on_gpus([1]).await?;
        rt.get(c1.warm().remote()).await?;
        rows.extend(rdt_passes(&cx, &rt, "cross", &p, &c1, &sizes, quick).await?);
    }
    // ANCHOR: nixl_call
    // The driver reads a 1 GiB GPU object.
    let r = p.tensor(big).transport(Transport::Nixl).remote();
    rt.wait(&r).await?;
    // ANCHOR_END: nixl_call
    let iters = if quick { 3 } else { 10 };
    for (case, host) in [("driver_get_host", true), ("driver_get_gpu", false)] {
        let mut us = Vec::new();
        for i in 0..iters + 1 {
            let t0 = Instant::now();
            let t: Tensor = if host {
                rt.get_on_host(&r).await?
            } else {
                rt.get(&r).await?
            };
            assert_eq!(t.nbytes(), big);
            assert_eq!(t.is_cuda(), !host);
            if i >= 1 {
                us.push(us_since(t0));
            }
        }
        rows.push(row(&cx, case, "nixl", Kind::Bandwidth, big, us));
    }
    let mut us = Vec::new();
    for _ in 0..if quick { 1 } else { 3 } {
        let t0 = Instant::now();
        let t: Tensor = rt.get_via_object_store(&r).await?;
        assert_eq!(t.nbytes(), big);
        us.push(us_since(t0));
    }
    rows.push(row(
        &cx,
        "driver_get",
        "object_store",
        Kind::Bandwidth,
        big,
        us,
    ));
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&rows).map_err(err)?)?;
        println!("== wrote {path}");
    }
    rt.shutdown().await;
    Ok(())
}

/// `--timeline`: a few 4 KiB passes (across GPUs where two are visible)
/// with `RDT_TIMELINE` on in the driver and both workers (every step of
/// every pass on one clock); no rows.
async fn timeline_passes(n: usize) -> Result<(), BenchError> {
    // Before any worker starts: they inherit it.
    rdt_examples::record_timeline();
    small_passes(n, 0).await
}

/// `--timeline-many`: passes of the object of 10 000 tensors of 4 KiB
/// (across GPUs where two are visible) with `RDT_TIMELINE` on everywhere;
/// no rows, the median on stdout.
async fn timeline_many(n: usize) -> Result<(), BenchError> {
    rdt_examples::record_timeline();
    let (rt, p, c) = producer_and_consumer().await?;
    rt.get(p.prepare_many(10_000, 4096).remote()).await?;
    let r = p.many().transport(Transport::Nixl).remote();
    rt.wait(&r).await?;
    timeline_of("passes of 10 000 tensors of 4 KiB", 0, n, || {
        rt.get(c.touch_all(&r).remote())
    })
    .await?;
    // Weight updates: the same object read into the consumer's own
    // parameters (passes 100 and on).
    rt.get(c.make_params(10_000, 4096).remote()).await?;
    timeline_of(
        "weight updates of 10 000 tensors of 4 KiB (get_into)",
        100,
        n,
        || rt.get(c.update(&r).remote()),
    )
    .await?;
    // The same with no value back (passes 200 and on).
    timeline_of(
        "weight updates of 10 000 tensors of 4 KiB (load_into)",
        200,
        n,
        || rt.get(c.load(&r).remote()),
    )
    .await?;
    flush_timelines().await;
    Ok(())
}

/// `--small-passes N`: N passes of 4 KiB (across GPUs where two are
/// visible) of a CUDA tensor, then of a host tensor, each in four rounds
/// that alternate the consumer's read spin (`set_read_spin`: 0, then
/// `--spin-us`, default 30 µs; `--spin-us 0`: one round with the default
/// spin). Prints, per
/// round: the median pass and, per READ, the post, post to end, and how
/// many asks of NIXL it took (after a yield / in all).
async fn small_passes(n: usize, spin_us: u64) -> Result<(), BenchError> {
    // The raw baselines first, in the same run: host memory, and device
    // memory as the consumer below reads it.
    let cx = Ctx::of_this_run()?;
    let visible = visible_gpus();
    let reader_gpu = visible.get(1).unwrap_or(&visible[0]);
    raw_baseline(&cx, "host", &visible[0], &visible[0], true).await?;
    raw_baseline(&cx, "host_pinned", &visible[0], &visible[0], true).await?;
    raw_baseline(&cx, "device", &visible[0], reader_gpu, true).await?;
    let (rt, p, c) = producer_and_consumer().await?;
    // Tiny calls to the same consumer first, on the same timeline (id 0):
    // the budget a pass is held to, step by step.
    let mut us = Vec::with_capacity(n);
    for i in 0..n as u64 + 3 {
        rdt::data::trace::timeline("driver pass start", 0);
        let t0 = Instant::now();
        rt.get(c.ping(i).remote()).await?;
        us.push(us_since(t0));
        rdt::data::trace::timeline("driver pass end", 0);
    }
    us.sort_by(f64::total_cmp);
    println!("{} tiny calls: median {:.1} us", us.len(), us[us.len() / 2]);
    let bytes = 4usize << 10;
    rt.get(p.prepare(bytes).remote()).await?;
    rt.get(p.prepare_host(bytes).remote()).await?;
    // `None`: the default spin, left as it is.
    let spins: Vec<Option<u64>> = if spin_us == 0 {
        vec![None]
    } else {
        vec![Some(0), Some(spin_us), Some(0), Some(spin_us)]
    };
    for host in [false, true] {
        let r = if host {
            p.host_tensor().transport(Transport::Nixl).remote()
        } else {
            p.tensor(bytes).transport(Transport::Nixl).remote()
        };
        rt.wait(&r).await?;
        // The first pass of a pair connects (untimed).
        rt.get(c.touch(&r).remote()).await?;
        for &spin in &spins {
            if let Some(us) = spin {
                rt.get(c.set_read_spin(us).remote()).await?;
            }
            let spin = spin.map_or("default".to_string(), |us| format!("{us} us"));
            let s0 = rt.get(c.nixl_stats().remote()).await?;
            let mut us = Vec::with_capacity(n);
            for _ in 0..n {
                rdt::data::trace::timeline("driver pass start", bytes as u64);
                let t0 = Instant::now();
                rt.get(c.touch(&r).remote()).await?;
                us.push(us_since(t0));
                rdt::data::trace::timeline("driver pass end", bytes as u64);
            }
            let s1 = rt.get(c.nixl_stats().remote()).await?;
            let reads = (s1.reads_posted - s0.reads_posted).max(1) as f64;
            us.sort_by(f64::total_cmp);
            println!(
                "{n} passes of 4 KiB, {} memory, read spin {spin}: median {:.1} us; per read: \
                 post {:.1} us ({}), post to end {:.1} us, asks {:.1} ({:.1} after a yield), \
                 {} of {} ended inline, {} posted again with a kept request",
                if host { "host" } else { "device" },
                us[n / 2],
                (s1.post_nanos - s0.post_nanos) as f64 / reads / 1e3,
                post_split(&s0, &s1, reads),
                (s1.read_nanos - s0.read_nanos) as f64 / reads / 1e3,
                (s1.read_asks - s0.read_asks) as f64 / reads,
                (s1.read_asks_after_yield - s0.read_asks_after_yield) as f64 / reads,
                s1.reads_done_inline - s0.reads_done_inline,
                s1.reads_posted - s0.reads_posted,
                s1.reads_reposted - s0.reads_reposted,
            );
        }
    }
    flush_timelines().await;
    Ok(())
}

/// `--ab-control-threads N`: two consumers on the same GPU, one whose
/// worker runs its control loop on one tokio thread
/// (`RDT_CONTROL_THREADS=1`) and one on two (the default), fed by one
/// producer; N rounds of a tiny call and a 4 KiB pass to each, then N/4
/// rounds of a pass of 10 000 tensors of 4 KiB to each, in turns.
async fn ab_control_threads(n: usize) -> Result<(), BenchError> {
    let cx = Ctx::of_this_run()?;
    let visible = visible_gpus();
    let reader_gpu = visible.get(1).unwrap_or(&visible[0]);
    let raw_rows = raw_baseline(&cx, "device", &visible[0], reader_gpu, true).await?;
    let raw = rdt_examples::median_of(&raw_rows, "pass_device", "raw", 4096);
    let rt = Runtime::start().await?;
    let gpu = if rdt::data::cuda::device_count() >= 2 {
        1
    } else {
        0
    };
    let p = rt.spawn::<NixlSource>(()).on_gpus([0]).await?;
    let mut sinks = Vec::new();
    for threads in ["1", "2"] {
        // SAFETY: no other thread of this process reads the environment
        // while the worker is spawned (it inherits it).
        unsafe { std::env::set_var("RDT_CONTROL_THREADS", threads) };
        let c = rt.spawn::<NixlSink>(()).on_gpus([gpu]).await?;
        rt.get(c.warm().remote()).await?;
        sinks.push(c);
    }
    unsafe { std::env::remove_var("RDT_CONTROL_THREADS") };
    let bytes = 4usize << 10;
    rt.get(p.prepare(bytes).remote()).await?;
    rt.get(p.prepare_many(10_000, 4096).remote()).await?;
    let r = p.tensor(bytes).transport(Transport::Nixl).remote();
    let m = p.many().transport(Transport::Nixl).remote();
    rt.wait(&r).await?;
    rt.wait(&m).await?;
    for c in &sinks {
        rt.get(c.touch(&r).remote()).await?;
        rt.get(c.touch_all(&m).remote()).await?;
    }
    let mut tiny = [Vec::new(), Vec::new()];
    let mut pass = [Vec::new(), Vec::new()];
    let mut many = [Vec::new(), Vec::new()];
    for i in 0..n + 10 {
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for &k in &order {
            let t0 = Instant::now();
            rt.get(sinks[k].ping(i as u64).remote()).await?;
            let call = us_since(t0);
            let t0 = Instant::now();
            rt.get(sinks[k].touch(&r).remote()).await?;
            if i >= 10 {
                tiny[k].push(call);
                pass[k].push(us_since(t0));
            }
        }
    }
    for i in 0..n / 4 + 4 {
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for &k in &order {
            let t0 = Instant::now();
            rt.get(sinks[k].touch_all(&m).remote()).await?;
            if i >= 4 {
                many[k].push(us_since(t0));
            }
        }
    }
    let median = rdt_examples::median;
    for (k, threads) in ["1", "2"].iter().enumerate() {
        let (t, ps, mn) = (
            median(&mut tiny[k]),
            median(&mut pass[k]),
            median(&mut many[k]),
        );
        println!(
            "control threads {threads}: tiny call {t:.1} us, 4 KiB pass {ps:.1} us ({:.1} over raw {raw:.1} + call), 10 000 x 4 KiB {mn:.1} us",
            ps - raw - t
        );
    }
    rt.shutdown().await;
    Ok(())
}

/// A runtime, a producer on GPU 0 and a warmed-up consumer (on GPU 1
/// where two are visible, else on GPU 0): the single-case modes' pair.
async fn producer_and_consumer() -> Result<(Runtime, NixlSourceHandle, NixlSinkHandle), BenchError>
{
    let rt = Runtime::start().await?;
    let consumer_gpu = if rdt::data::cuda::device_count() >= 2 {
        1
    } else {
        0
    };
    let p = rt.spawn::<NixlSource>(()).on_gpus([0]).await?;
    let c = rt.spawn::<NixlSink>(()).on_gpus([consumer_gpu]).await?;
    rt.get(c.warm().remote()).await?;
    Ok((rt, p, c))
}

/// Lets every process print its timeline points (each does every 20 ms),
/// then prints the driver's.
async fn flush_timelines() {
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    rdt::timeline::flush();
}
