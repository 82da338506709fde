//! The benchmark harness: `cargo run --release --example bench -- SUITE [--json PATH] [--quick]`.
//!
//! Every suite runs rdt's path and its baseline in the same run and prints
//! the ratio. JSON output is an array of rows with the same schema for every
//! suite: `suite, case, transport, device, bytes, iters, median_us, p90_us,
//! kind, gbps`. `kind` says what the time is:
//! - `bandwidth`: the pass copies its bytes (`object_store`, `tcp`), so
//!   `gbps` is `bytes` per median (GB/s = 1e9 bytes per second);
//! - `handoff_latency`: a zero-copy hand-off (`shm` of a tensor already in
//!   shared memory): no byte is copied, the time does not grow with the
//!   size, and `bytes` per time would be no bandwidth; `gbps` is `null`
//!   and the table prints `—`;
//! - `latency`: a round trip of a tiny payload (`control`) or a per-pass
//!   latency with passes in flight (`soak`); `gbps` is `null`.
//!
//! Suites:
//! - `control`: a bare Unix-socket echo round trip (8-byte length-prefixed
//!   frames, a separate process, tokio client: the floor under any actor
//!   call), a tiny actor call round trip, the same call made by an actor
//!   (timed inside it), a tiny-tensor pass (produce → pass ref →
//!   consume → get) per CPU transport, and, where a GPU is visible, the
//!   cached `cuda_ipc` hand-off of a 4 KiB CUDA tensor between two actors
//!   on GPU 0, all in one run, with their ratios to the echo.
//! - `transports`: a full pass (produce → pass ref → consume → result) of
//!   one tensor of 1 KiB, 1 MiB, 64 MiB and 256 MiB over every CPU
//!   transport this build has (`nixl` where NIXL is installed:
//!   `scripts/install-nixl.sh`), with the object-store path as the
//!   baseline; and, from 1 MiB, the raw floors of the same bytes: the
//!   object store's (`raw_relay`: two plain processes, two Unix socket
//!   crossings one after the other into reused buffers), `tcp`'s
//!   (`raw_tcp`: two plain processes streaming over loopback TCP into a
//!   reused buffer), `nixl`'s (`raw_nixl`: one NIXL READ of registered host
//!   memory between two plain processes) and one warm in-process copy
//!   (`memcpy`), each transport's ratio to its floor printed. Then, per
//!   transport, the per-tensor cost: an object of 10 000 tensors of
//!   4 KiB against one tensor of the same 40.96 MB, both kept by the
//!   producer and passed again every time (a weights sync), with their
//!   ratio (`--size 40960000` runs this case alone, `--iters N` sets its
//!   passes). Then the weight update: 1 000 tensors of 64 KiB that the
//!   producer rewrites in place between versions, received with
//!   `load_into` into the consumer's preallocated tensors, warm median of
//!   5 versions, beside a warm in-process copy of the same tensors
//!   (`--size 65536000` runs this case alone). Consumers read received tensors in place
//!   (`with_bytes_unchecked`): a snapshot copy of shared memory would make
//!   a hand-off look like a copy. Both cases read one byte in every
//!   4 KiB (the first of each small tensor, every 4 KiB of the big one),
//!   so both fault in the same pages of a fresh mapping.
//! - `weightsync`: `rdt::weights` end to end per transport and rollout
//!   count beside warm in-process copies of the same bytes, and the
//!   many-tensor series (see `bench_weightsync.rs`).
//! - `timeline`: no rows; a few tiny calls, 4 KiB passes of a kept tensor
//!   over `tcp` in a group (two-sided, as `nccl`), and cached `cuda_ipc`
//!   hand-offs with `RDT_TIMELINE` on everywhere (where each one's time
//!   goes). `--passes N` runs N untimed passes first (200 by default);
//!   with `RDT_TIMELINE=0` that is a steady load to profile with `perf`.
//! - `soak`: the long form of the soak test: `--passes N` (default
//!   100 000) passes of mixed sizes per CPU transport, 32 in flight; reports
//!   the per-pass latency and checks at the end that the owner table is
//!   empty and the workers' resident memory came back (exits non-zero if
//!   not). `soak --faults` is the randomized fault soak instead
//!   (`rdt_integration_tests::fault_soak`): `--ops N` operations (default
//!   10 000) chosen by `--seed S` (default: from the clock, printed), with
//!   kills, dropped spawns, cancellations, deadlines and junk connections
//!   mixed in; exits non-zero unless every store and the owner table are
//!   empty and the long-lived workers' memory and threads stayed flat.

use std::time::{Duration, Instant};

// The raw baselines size their sockets as rdt's control connections do.
use rdt::__bench::size_socket_buffers;
use rdt::prelude::*;
use rdt_examples::{arg_value, Kind, Row};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[path = "bench_weightsync.rs"]
mod weightsync;

#[rdt::actor]
pub struct Source {
    /// One kept tensor per transport: a tensor a transport exported lives
    /// where that transport put it (`shm` moves it into shared memory),
    /// and a row measures its transport's steady state, not the move of
    /// one tensor from another transport's memory.
    kept: std::collections::HashMap<String, Tensor>,
    /// The many-tensor object, per transport likewise.
    many: std::collections::HashMap<String, Vec<Tensor>>,
    /// The weight-update case's weights, per transport likewise.
    weights: std::collections::HashMap<String, Vec<Tensor>>,
}

#[rdt::actor]
impl Source {
    fn new() -> Self {
        Source {
            kept: Default::default(),
            many: Default::default(),
            weights: Default::default(),
        }
    }

    /// `n` tensors of `each` bytes, allocated once and handed out again
    /// (weights-sync style: a model's many parameters, every pass).
    /// `n` tensors of `each` bytes, made once per transport and handed out
    /// again.
    async fn many(&mut self, n: usize, each: usize, transport: String) -> Vec<Tensor> {
        let many = self.many.entry(transport).or_default();
        if many.len() != n || many.first().is_some_and(|t| t.nbytes() != each) {
            *many = (0..n).map(|i| Tensor::full(i as u8, &[each])).collect();
        }
        many.clone()
    }

    async fn ping(&mut self, x: u64) -> u64 {
        x
    }

    /// A fresh tensor of `n` bytes (the soak allocates every time).
    async fn fresh(&mut self, n: usize) -> Tensor {
        Tensor::full(1u8, &[n])
    }

    /// The trainer's weights for `transport`: `n` tensors of `each` bytes,
    /// made once and handed out again.
    async fn weights(&mut self, n: usize, each: usize, transport: String) -> Vec<Tensor> {
        let w = self.weights.entry(transport).or_default();
        if w.len() != n || w.first().is_some_and(|t| t.nbytes() != each) {
            *w = (0..n).map(|_| Tensor::zeros(DType::U8, &[each])).collect();
        }
        w.clone()
    }

    /// A training step: rewrites every weight for `transport` in place
    /// (each byte becomes `version`).
    async fn step(&mut self, version: u8, transport: String) -> rdt::Result<()> {
        for t in self.weights.get(&transport).into_iter().flatten() {
            t.with_bytes_mut(|b| b.fill(version))?;
        }
        Ok(())
    }

    /// A tensor of `bytes` bytes, allocated once per transport and handed
    /// out again (weights-sync style: the same buffer every pass).
    async fn tensor(&mut self, bytes: usize, transport: String) -> Tensor {
        match self.kept.get(&transport) {
            Some(t) if t.nbytes() == bytes => t.clone(),
            _ => {
                let t = Tensor::full(1u8, &[bytes]);
                self.kept.insert(transport, t.clone());
                t
            }
        }
    }

    /// A CUDA tensor of `bytes` bytes on this worker's GPU, made (and
    /// finished) once and handed out again: a pass of it over `cuda_ipc`
    /// is a hand-off.
    async fn cuda_tensor(&mut self, bytes: usize) -> rdt::Result<Tensor> {
        if let Some(t) = (self.kept.get("cuda_ipc")).filter(|t| t.nbytes() == bytes) {
            return Ok(t.clone());
        }
        let t = Tensor::cuda_full(1u8, &[bytes], 0)?;
        t.cuda_ready().await?;
        self.kept.insert("cuda_ipc".into(), t.clone());
        Ok(t)
    }
}

#[rdt::actor]
pub struct Sink {
    /// Kept as one `rdt::Targets`, as a trainer keeps its weights.
    params: rdt::Targets,
}

#[rdt::actor]
impl Sink {
    fn new() -> Self {
        Sink {
            params: rdt::Targets::default(),
        }
    }

    /// A weight update: the object behind `r` received into this actor's
    /// parameters (`get_into`): `n` views of `each` bytes of one flat host
    /// buffer, made at the first update. Sums the first byte of each, as
    /// `touch_all` does.
    async fn update(
        &mut self,
        r: ObjectRef<Vec<Tensor>>,
        n: usize,
        each: usize,
    ) -> rdt::Result<u64> {
        keep_flat_params(&mut self.params, n, each)?;
        let got: Vec<Tensor> = rdt::runtime().get_into(&r, &self.params).await?;
        sum_first_bytes(&got)
    }

    /// `update` with `load_into`: the parameters hold the object's
    /// tensors, and no value (no tensor handle) comes back. Sums the first
    /// byte of each parameter.
    async fn load(&mut self, r: ObjectRef<Vec<Tensor>>, n: usize, each: usize) -> rdt::Result<u64> {
        keep_flat_params(&mut self.params, n, each)?;
        rdt::runtime().load_into(&r, &self.params).await?;
        sum_first_bytes(&self.params)
    }

    /// Reads the first and last byte: proves the consumer can use it.
    async fn touch(&mut self, t: Tensor) -> rdt::Result<u64> {
        let n = t.nbytes();
        let (a, b) = read_in_place(&t, |b| (b[0], b[n - 1]))?;
        Ok(a as u64 + b as u64)
    }

    /// Reads one byte in every `stride` bytes of `t`, and sums them: the
    /// same pages that `touch_all` reads of `stride`-byte tensors, so that
    /// the two cases map and read the same memory.
    async fn touch_strided(&mut self, t: Tensor, stride: usize) -> rdt::Result<u64> {
        read_in_place(&t, |b| b.iter().step_by(stride).map(|&x| x as u64).sum())
    }

    /// Reads the first byte of every tensor: proves each arrived whole.
    async fn touch_all(&mut self, ts: Vec<Tensor>) -> rdt::Result<u64> {
        sum_first_bytes(&ts)
    }

    /// `iters` tiny calls to `src` from inside this actor (an actor as a
    /// client: submit, then `get`), each timed here; nanoseconds.
    async fn ping_from_actor(&mut self, src: SourceHandle, iters: u64) -> rdt::Result<Vec<u64>> {
        let rt = rdt::runtime();
        let mut ns = Vec::with_capacity(iters as usize);
        for i in 0..iters {
            let t = Instant::now();
            let v = rt.get(src.ping(i).remote()).await?;
            assert_eq!(v, i);
            ns.push(t.elapsed().as_nanos() as u64);
        }
        Ok(ns)
    }

    /// Waits until a received CUDA tensor is usable on this worker's GPU
    /// (its stream has waited for the producer's event); its size.
    async fn touch_cuda(&mut self, t: Tensor) -> rdt::Result<usize> {
        t.cuda_ready().await?;
        Ok(t.nbytes())
    }
}

/// Reads a received tensor where it lies. `with_bytes` would take a
/// snapshot copy of memory shared with another process (`shm`, and `nixl`
/// host memory), a copy of the whole tensor that a pass of a kept tensor
/// does not need and that would make a hand-off look like a copy.
fn read_in_place<R>(t: &Tensor, f: impl FnOnce(&[u8]) -> R) -> rdt::Result<R> {
    // SAFETY: the producer of every tensor this benchmark passes never
    // writes it again after it is made, so no process writes these bytes
    // while `f` reads them.
    Ok(unsafe { t.with_bytes_unchecked(f) }?)
}

/// `params` as `n` views of `each` bytes of one flat host buffer, made
/// unless they are that already (a trainer's weights, kept across updates).
fn keep_flat_params(params: &mut rdt::Targets, n: usize, each: usize) -> rdt::Result<()> {
    if params.len() != n || params.first().is_some_and(|t| t.nbytes() != each) {
        let flat = Tensor::zeros(DType::U8, &[n * each]);
        *params = (0..n)
            .map(|i| flat.view(i * each, DType::U8, &[each]))
            .collect::<std::result::Result<_, _>>()?;
    }
    Ok(())
}

/// The sum of the first byte of each tensor, read in place: proves each
/// arrived whole.
fn sum_first_bytes(ts: &[Tensor]) -> rdt::Result<u64> {
    let mut s = 0u64;
    for t in ts {
        s += read_in_place(t, |b| b[0])? as u64;
    }
    Ok(s)
}

/// What a full pass of a tensor the producer keeps is: a hand-off over
/// `shm` (published where it is, after the first pass), a copy otherwise.
fn kind_of_pass(t: Transport) -> Kind {
    if t == Transport::Shm {
        Kind::HandoffLatency
    } else {
        Kind::Bandwidth
    }
}

fn row(
    suite: &str,
    case: &str,
    transport: &str,
    kind: Kind,
    bytes: u64,
    samples: Vec<Duration>,
) -> Row {
    let us = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    Row::new(suite, case, transport, "cpu", kind, bytes, us)
}

const ECHO_ENV: &str = "RDT_BENCH_ECHO_SOCKET";

/// The echo server process: length-prefixed frames back as they came.
fn echo_server(path: &str) -> ! {
    use std::io::{Read, Write};
    let listener = std::os::unix::net::UnixListener::bind(path).expect("bind echo socket");
    let (mut s, _) = listener.accept().expect("accept");
    let mut len = [0u8; 8];
    let mut buf = Vec::new();
    while s.read_exact(&mut len).is_ok() {
        let n = u64::from_be_bytes(len) as usize;
        buf.resize(n, 0);
        if s.read_exact(&mut buf).is_err() {
            break;
        }
        let _ = s.write_all(&len);
        let _ = s.write_all(&buf);
    }
    std::process::exit(0)
}

const RELAY_ENV: &str = "RDT_BENCH_RELAY";

/// The raw floor of the object-store path, as a process: `relay LISTEN
/// NEXT` reads each length-prefixed frame into a buffer it reuses, writing
/// each read on to `NEXT` as it lands, and waits for its one-byte
/// acknowledgement before it acknowledges (the driver in the middle,
/// forwarding as it receives); `sink LISTEN` reads each frame
/// into a buffer it reuses and acknowledges it (the consumer).
fn relay_server(spec: &str) -> ! {
    use std::io::{Read, Write};
    use std::os::unix::net::{UnixListener, UnixStream};
    let parts: Vec<&str> = spec.split('|').collect();
    let listener = UnixListener::bind(parts[1]).expect("bind relay socket");
    let mut next = (parts[0] == "relay").then(|| loop {
        if let Ok(s) = UnixStream::connect(parts[2]) {
            size_socket_buffers(&s);
            break s;
        }
        std::thread::yield_now();
    });
    let (mut s, _) = listener.accept().expect("accept");
    size_socket_buffers(&s);
    let mut len = [0u8; 8];
    let mut buf = Vec::new();
    let mut ack = [0u8; 1];
    'frames: while s.read_exact(&mut len).is_ok() {
        let n = u64::from_be_bytes(len) as usize;
        buf.resize(n, 0);
        match next.as_mut() {
            None => {
                if s.read_exact(&mut buf).is_err() {
                    break;
                }
            }
            Some(next) => {
                // Cut-through, as the driver does: each read goes on at
                // once, so the two crossings overlap.
                next.write_all(&len).unwrap();
                let mut got = 0;
                while got < n {
                    let k = match s.read(&mut buf[got..]) {
                        Ok(0) | Err(_) => break 'frames,
                        Ok(k) => k,
                    };
                    next.write_all(&buf[got..got + k]).unwrap();
                    got += k;
                }
                next.read_exact(&mut ack).unwrap();
            }
        }
        let _ = s.write_all(&ack);
    }
    std::process::exit(0)
}

/// The same bytes through two plain processes, the way the object store
/// moves them (this process → relay → sink, each crossing a Unix socket
/// with 4 MiB buffers into a reused buffer, the relay forwarding as it
/// reads): the floor under the
/// object-store pass, with none of rdt's work. The first pass (buffers
/// faulted in) is not timed.
fn bench_relay(bytes: usize, iters: usize, label: &str) -> Row {
    use std::io::{Read, Write};
    let dir = tempfile_dir();
    let (a, b) = (format!("{dir}/relay.sock"), format!("{dir}/sink.sock"));
    let exe = std::env::current_exe().unwrap();
    let mut sink = std::process::Command::new(&exe)
        .env(RELAY_ENV, format!("sink|{b}"))
        .spawn()
        .expect("start sink");
    let mut relay = std::process::Command::new(&exe)
        .env(RELAY_ENV, format!("relay|{a}|{b}"))
        .spawn()
        .expect("start relay");
    let mut s = loop {
        match std::os::unix::net::UnixStream::connect(&a) {
            Ok(s) => break s,
            Err(_) => std::thread::yield_now(),
        }
    };
    size_socket_buffers(&s);
    let payload = vec![1u8; bytes];
    let mut ack = [0u8; 1];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters + 1 {
        let t = Instant::now();
        s.write_all(&(bytes as u64).to_be_bytes()).unwrap();
        s.write_all(&payload).unwrap();
        s.read_exact(&mut ack).unwrap();
        if i > 0 {
            samples.push(t.elapsed());
        }
    }
    drop(s);
    let _ = relay.wait();
    let _ = sink.wait();
    let _ = std::fs::remove_dir_all(&dir);
    row(
        "transports",
        &format!("pass {label}"),
        "raw_relay",
        Kind::Bandwidth,
        bytes as u64,
        samples,
    )
}

const TCP_SINK_ENV: &str = "RDT_BENCH_TCP_SINK";

/// The raw floor of the `tcp` pass, as a process: listens on loopback,
/// prints its port, then reads each length-prefixed frame into a buffer
/// it reuses and acknowledges it with one byte.
fn tcp_sink_server() -> ! {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the tcp sink");
    println!("{}", listener.local_addr().expect("its address").port());
    std::io::stdout().flush().expect("print the port");
    let (mut s, _) = listener.accept().expect("accept");
    s.set_nodelay(true).ok();
    let mut len = [0u8; 8];
    let mut buf = Vec::new();
    while s.read_exact(&mut len).is_ok() {
        buf.resize(u64::from_le_bytes(len) as usize, 0);
        if s.read_exact(&mut buf).is_err() || s.write_all(&[1]).is_err() {
            break;
        }
    }
    std::process::exit(0)
}

/// The same bytes between two plain processes over loopback TCP, as a
/// good implementation streams them: this process writes each frame from
/// a buffer it reuses, the sink reads it into one it reuses and
/// acknowledges (kernel-tuned socket buffers, no delay): the floor under
/// a `tcp` pass, with none of rdt's work. The first pass (buffers faulted
/// in, the connection's windows grown) is not timed.
fn bench_raw_tcp(bytes: usize, iters: usize, label: &str) -> Row {
    use std::io::{BufRead, Read, Write};
    let mut sink = std::process::Command::new(std::env::current_exe().unwrap())
        .env(TCP_SINK_ENV, "1")
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the tcp sink");
    let mut port = String::new();
    std::io::BufReader::new(sink.stdout.take().expect("piped"))
        .read_line(&mut port)
        .expect("the sink's port");
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port.trim().parse::<u16>().unwrap()))
        .expect("connect to the sink");
    s.set_nodelay(true).ok();
    let payload = vec![1u8; bytes];
    let mut ack = [0u8; 1];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters + 1 {
        let t = Instant::now();
        s.write_all(&(bytes as u64).to_le_bytes()).unwrap();
        s.write_all(&payload).unwrap();
        s.read_exact(&mut ack).unwrap();
        if i > 0 {
            samples.push(t.elapsed());
        }
    }
    drop(s);
    let _ = sink.wait();
    row(
        "transports",
        &format!("pass {label}"),
        "raw_tcp",
        Kind::Bandwidth,
        bytes as u64,
        samples,
    )
}

/// One warm copy of the same bytes inside one process (both buffers
/// faulted in before): the floor under any pass that copies them once.
fn bench_memcpy(bytes: usize, iters: usize, label: &str) -> Row {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters + 1 {
        let t = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        std::hint::black_box(&dst);
        if i > 0 {
            samples.push(t.elapsed());
        }
    }
    row(
        "transports",
        &format!("pass {label}"),
        "memcpy",
        Kind::Bandwidth,
        bytes as u64,
        samples,
    )
}

const NIXL_HOLDER_ENV: &str = "RDT_BENCH_NIXL_HOLDER";

/// What the raw NIXL holder offers: its connection metadata, and per
/// size, the address of its registered host buffer and the registration's
/// metadata.
#[derive(serde::Serialize, serde::Deserialize)]
struct NixlHeld {
    conn: Vec<u8>,
    buffers: Vec<(usize, u64, Vec<u8>)>,
}

/// The raw floor of the `nixl` pass, as a process: one NIXL agent (UCX)
/// registers a host buffer of each size in `sizes` (comma-separated),
/// prints what a reader loads as one JSON line, and keeps them until its
/// stdin closes.
fn nixl_holder_server(sizes: &str) -> ! {
    use rdt::data::nixl::raw::{Memory, RawAgent};
    use std::io::{Read, Write};
    let agent = RawAgent::new(&format!("raw-holder-{}", std::process::id())).expect("a NIXL agent");
    let mut kept = Vec::new();
    let mut buffers = Vec::new();
    for bytes in sizes.split(',').filter_map(|b| b.parse::<usize>().ok()) {
        let b = vec![3u8; bytes];
        let md = (agent.register(Memory::Host, b.as_ptr() as u64, bytes)).expect("register");
        buffers.push((bytes, b.as_ptr() as u64, md));
        kept.push(b);
    }
    let held = NixlHeld {
        conn: agent.connection_md().expect("connection metadata"),
        buffers,
    };
    println!("{}", serde_json::to_string(&held).unwrap());
    std::io::stdout().flush().expect("print the plan");
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    for b in &kept {
        let _ = agent.deregister(Memory::Host, b.as_ptr() as u64, b.len());
    }
    std::process::exit(0)
}

/// One NIXL READ of the same registered host bytes between two plain
/// processes (the holder, a child; this process reads into a registered
/// buffer it reuses): the floor under a `nixl` pass on the CPU. The
/// first READ (connection set-up) is not timed. `None` without NIXL.
fn bench_raw_nixl(sizes: &[(usize, usize, &str)]) -> Vec<Row> {
    use rdt::data::nixl::raw::{Memory, RawAgent};
    use std::io::BufRead;
    if rdt::data::nixl::available().is_err() {
        return Vec::new();
    }
    let list: Vec<String> = sizes.iter().map(|s| s.0.to_string()).collect();
    let mut holder = std::process::Command::new(std::env::current_exe().unwrap())
        .env(NIXL_HOLDER_ENV, list.join(","))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start the NIXL holder");
    let mut line = String::new();
    std::io::BufReader::new(holder.stdout.take().expect("piped"))
        .read_line(&mut line)
        .expect("the holder's plan");
    let held: NixlHeld = serde_json::from_str(&line).expect("the holder's plan");
    let agent = RawAgent::new(&format!("raw-reader-{}", std::process::id())).expect("a NIXL agent");
    let peer = agent.load_remote(&held.conn).expect("load the holder");
    let mut rows = Vec::new();
    for (&(bytes, iters, label), (_, addr, md)) in sizes.iter().zip(&held.buffers) {
        agent.load_remote(md).expect("load the registration");
        let local = vec![0u8; bytes];
        let base = local.as_ptr() as u64;
        agent.register(Memory::Host, base, bytes).expect("register");
        let mut samples = Vec::with_capacity(iters);
        for i in 0..iters + 1 {
            let t = Instant::now();
            agent
                .read(
                    (Memory::Host, &[(base, bytes)]),
                    (Memory::Host, &[(*addr, bytes)]),
                    &peer,
                    &[],
                )
                .expect("a READ");
            if i > 0 {
                samples.push(t.elapsed());
            }
        }
        let _ = agent.deregister(Memory::Host, base, bytes);
        rows.push(row(
            "transports",
            &format!("pass {label}"),
            "raw_nixl",
            Kind::Bandwidth,
            bytes as u64,
            samples,
        ));
    }
    drop(holder.stdin.take());
    let _ = holder.wait();
    rows
}

async fn bench_echo(iters: usize) -> Row {
    let dir = tempfile_dir();
    let path = format!("{dir}/echo.sock");
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .env(ECHO_ENV, &path)
        .spawn()
        .expect("start echo server");
    let mut s = loop {
        match tokio::net::UnixStream::connect(&path).await {
            Ok(s) => break s,
            Err(_) => tokio::task::yield_now().await,
        }
    };
    let payload = [7u8; 64];
    let mut back = [0u8; 72];
    let mut samples = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        let mut frame = Vec::with_capacity(72);
        frame.extend_from_slice(&(payload.len() as u64).to_be_bytes());
        frame.extend_from_slice(&payload);
        s.write_all(&frame).await.unwrap();
        s.read_exact(&mut back).await.unwrap();
        if i >= iters / 10 {
            samples.push(t.elapsed());
        }
    }
    drop(s);
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    row(
        "control",
        "unix socket echo (64 B frame)",
        "-",
        Kind::Latency,
        64,
        samples,
    )
}

fn tempfile_dir() -> String {
    let d = std::env::temp_dir().join(format!("rdt-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.to_string_lossy().into_owned()
}

async fn control(rt: &Runtime, quick: bool) -> rdt::Result<Vec<Row>> {
    let iters = if quick { 200 } else { 2000 };
    let mut rows = vec![bench_echo(iters).await];
    let src = rt.spawn::<Source>(()).await?;
    let sink = rt.spawn::<Sink>(()).await?;
    rt.create_collective_group(&[src.id(), sink.id()], Transport::Tcp)
        .await?;
    let mut samples = Vec::new();
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        let v = rt.get(src.ping(i as u64).remote()).await?;
        assert_eq!(v, i as u64);
        if i >= iters / 10 {
            samples.push(t.elapsed());
        }
    }
    rows.push(row(
        "control",
        "tiny actor call round trip",
        "object_store",
        Kind::Latency,
        8,
        samples,
    ));
    // The same call made by an actor (through the driver: submit, reply,
    // get), timed inside the calling actor.
    let ns = rt
        .get(
            sink.ping_from_actor(src.clone(), (iters + iters / 10) as u64)
                .remote(),
        )
        .await?;
    rows.push(row(
        "control",
        "tiny call from an actor",
        "object_store",
        Kind::Latency,
        8,
        ns[iters / 10..]
            .iter()
            .map(|&n| Duration::from_nanos(n))
            .collect(),
    ));
    if let Some(r) = cuda_handoff(rt, iters).await? {
        rows.push(r);
    }
    for transport in cpu_transports() {
        let mut samples = Vec::new();
        for i in 0..iters + iters / 10 {
            let t = Instant::now();
            let r = src
                .tensor(16, transport.name().to_string())
                .transport(transport)
                .remote();
            let v = rt.get(sink.touch(&r).remote()).await?;
            assert_eq!(v, 2);
            drop(r);
            if i >= iters / 10 {
                samples.push(t.elapsed());
            }
        }
        rows.push(row(
            "control",
            "tiny tensor pass (16 B)",
            transport.name(),
            if transport == Transport::Shm {
                Kind::HandoffLatency
            } else {
                Kind::Latency
            },
            16,
            samples,
        ));
    }
    Ok(rows)
}

/// Where a GPU is visible: the cached `cuda_ipc` hand-off of a 4 KiB CUDA
/// tensor between two actors on GPU 0 (produce → pass ref → consumer's
/// stream waits → answer), after warm-up passes that open the mapping.
/// `None` without CUDA.
async fn cuda_handoff(rt: &Runtime, iters: usize) -> rdt::Result<Option<Row>> {
    if let Err(e) = rdt::data::cuda::available() {
        eprintln!("skipping the cuda_ipc hand-off: {e}");
        return Ok(None);
    }
    let src = rt.spawn::<Source>(()).on_gpus([0]).await?;
    let sink = rt.spawn::<Sink>(()).on_gpus([0]).await?;
    let mut samples = Vec::new();
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        let r = src.cuda_tensor(4096).transport(Transport::CudaIpc).remote();
        let n = rt.get(sink.touch_cuda(&r).remote()).await?;
        assert_eq!(n, 4096);
        drop(r);
        if i >= iters / 10 {
            samples.push(t.elapsed());
        }
    }
    src.kill();
    sink.kill();
    let us = samples.iter().map(|d| d.as_secs_f64() * 1e6).collect();
    Ok(Some(Row::new(
        "control",
        "cached cuda_ipc hand-off (4 KiB)",
        "cuda_ipc",
        "cuda",
        Kind::HandoffLatency,
        4096,
        us,
    )))
}

fn cpu_transports() -> Vec<Transport> {
    [
        Transport::ObjectStore,
        Transport::Tcp,
        Transport::Shm,
        Transport::Nixl,
    ]
    .into_iter()
    .filter(|t| usable(*t))
    .collect()
}

/// Can this build and machine run `t` (NIXL installed, for `nixl`)? Says
/// why not on stderr.
fn usable(t: Transport) -> bool {
    if !t.is_implemented() {
        eprintln!("skipping {t}: not implemented in this build");
        return false;
    }
    if t == Transport::Nixl {
        if let Err(e) = rdt::data::nixl::available() {
            eprintln!("skipping {t}: {e}");
            return false;
        }
    }
    true
}

/// `--transport NAME` and `--size BYTES` narrow the transports suite (for
/// profiling one case).
async fn transports(rt: &Runtime, quick: bool) -> rdt::Result<Vec<Row>> {
    let only_transport = arg_value("--transport");
    let only_size: Option<usize> = arg_value("--size").and_then(|s| s.parse().ok());
    let src = rt.spawn::<Source>(()).await?;
    let sink = rt.spawn::<Sink>(()).await?;
    rt.create_collective_group(&[src.id(), sink.id()], Transport::Tcp)
        .await?;
    let mut rows = Vec::new();
    let mut nixl_floors = Vec::new();
    let sizes: &[(usize, &str)] = &[
        (1 << 10, "1 KiB"),
        (1 << 20, "1 MiB"),
        (64 << 20, "64 MiB"),
        (256 << 20, "256 MiB"),
    ];
    for &(bytes, label) in sizes {
        if only_size.is_some_and(|s| s != bytes) {
            continue;
        }
        let iters = match (quick, bytes) {
            (true, b) if b >= 64 << 20 => 3,
            (true, _) => 20,
            (false, b) if b >= 64 << 20 => 10,
            (false, b) if b >= 1 << 20 => 50,
            _ => 500,
        };
        // The raw floors, same size, same run: the object store's relay,
        // plain TCP, one warm copy (and one NIXL READ, below).
        let floor = |name: &str| only_transport.as_deref().is_none_or(|t| t == name);
        if bytes >= 1 << 20 {
            if floor("object_store") {
                rows.push(bench_relay(bytes, iters, label));
            }
            if floor("tcp") {
                rows.push(bench_raw_tcp(bytes, iters, label));
            }
            if floor("nixl") {
                nixl_floors.push((bytes, iters, label));
            }
            rows.push(bench_memcpy(bytes, iters, label));
        }
        for transport in cpu_transports() {
            if only_transport
                .as_deref()
                .is_some_and(|t| t != transport.name())
            {
                continue;
            }
            // The tensor is allocated once by the first (unmeasured) pass.
            let mut samples = Vec::new();
            for i in 0..iters + 1 {
                let t = Instant::now();
                let r = src
                    .tensor(bytes, transport.name().to_string())
                    .transport(transport)
                    .remote();
                let v = rt.get(sink.touch(&r).remote()).await?;
                assert_eq!(v, 2);
                drop(r);
                if i > 0 {
                    samples.push(t.elapsed());
                }
            }
            rows.push(row(
                "transports",
                &format!("pass {label}"),
                transport.name(),
                kind_of_pass(transport),
                bytes as u64,
                samples,
            ));
        }
    }
    if cpu_transports().contains(&Transport::Nixl) {
        rows.extend(bench_raw_nixl(&nixl_floors));
    }
    // `--size 40960000` selects this case alone.
    if only_size.is_none_or(|s| s == MANY_N * many_each()) {
        rows.extend(many_tensors(rt, &src, &sink, only_transport.as_deref(), quick).await?);
    }
    // `--size 65536000` selects this case alone.
    if only_size.is_none_or(|s| s == WEIGHTS_N * WEIGHTS_EACH) {
        rows.extend(weight_update(rt, &src, &sink, only_transport.as_deref()).await?);
    }
    Ok(rows)
}

/// The weight update: 1 000 tensors of 64 KiB (f32 tensors of 16 384
/// elements, 64 MiB in all).
const WEIGHTS_N: usize = 1_000;
const WEIGHTS_EACH: usize = 64 << 10;

/// A weight update per transport: the trainer rewrites its weights in
/// place (untimed), then a pass hands them to the rollout, which receives
/// them into its own preallocated tensors with `load_into` (timed), warm
/// median of 5 versions after one unmeasured; beside one warm in-process
/// copy of the same tensors into preallocated ones.
async fn weight_update(
    rt: &Runtime,
    src: &SourceHandle,
    sink: &SinkHandle,
    only_transport: Option<&str>,
) -> rdt::Result<Vec<Row>> {
    const VERSIONS: usize = 5;
    let case = "weight update 1000 x 64 KiB (load_into)";
    let mut rows = Vec::new();
    for transport in cpu_transports() {
        if only_transport.is_some_and(|t| t != transport.name()) {
            continue;
        }
        let name = transport.name().to_string();
        let mut samples = Vec::new();
        for version in 0..=VERSIONS {
            rt.get(src.weights(WEIGHTS_N, WEIGHTS_EACH, name.clone()).remote())
                .await?;
            rt.get(src.step(version as u8 + 1, name.clone()).remote())
                .await?;
            let t = Instant::now();
            let r = src
                .weights(WEIGHTS_N, WEIGHTS_EACH, name.clone())
                .transport(transport)
                .remote();
            let sum = rt
                .get(sink.load(&r, WEIGHTS_N, WEIGHTS_EACH).remote())
                .await?;
            drop(r);
            if version > 0 {
                samples.push(t.elapsed());
            }
            assert_eq!(
                sum,
                (version as u64 + 1) * WEIGHTS_N as u64,
                "version {version} landed"
            );
        }
        rows.push(row(
            "transports",
            case,
            transport.name(),
            Kind::Bandwidth,
            (WEIGHTS_N * WEIGHTS_EACH) as u64,
            samples,
        ));
    }
    let from: Vec<Vec<u8>> = (0..WEIGHTS_N).map(|_| vec![1u8; WEIGHTS_EACH]).collect();
    let mut to: Vec<Vec<u8>> = (0..WEIGHTS_N).map(|_| vec![0u8; WEIGHTS_EACH]).collect();
    let mut samples = Vec::new();
    for version in 0..=VERSIONS {
        let t = Instant::now();
        for (d, s) in to.iter_mut().zip(&from) {
            d.copy_from_slice(std::hint::black_box(s));
        }
        std::hint::black_box(&to);
        if version > 0 {
            samples.push(t.elapsed());
        }
    }
    rows.push(row(
        "transports",
        case,
        "memcpy",
        Kind::Bandwidth,
        (WEIGHTS_N * WEIGHTS_EACH) as u64,
        samples,
    ));
    Ok(rows)
}

const MANY_N: usize = 10_000;
const MANY_EACH: usize = 4 << 10;

/// Bytes per tensor of the many-tensor case: 4 KiB, or `--many-each N`
/// (tiny tensors leave only the per-tensor cost, without the bytes).
fn many_each() -> usize {
    arg_value("--many-each")
        .and_then(|s| s.parse().ok())
        .unwrap_or(MANY_EACH)
}

/// Per-tensor cost: one object of 10 000 tensors of 4 KiB against one
/// tensor of the same 40.96 MB, both kept by the producer and passed again
/// (a weights sync: the same parameters every step), per transport.
async fn many_tensors(
    rt: &Runtime,
    src: &SourceHandle,
    sink: &SinkHandle,
    only_transport: Option<&str>,
    quick: bool,
) -> rdt::Result<Vec<Row>> {
    let iters: usize = arg_value("--iters")
        .and_then(|s| s.parse().ok())
        .unwrap_or(if quick { 5 } else { 20 });
    // What `touch_all` returns for `Source::many`'s tensors.
    let first_bytes: u64 = (0..MANY_N).map(|i| i as u8 as u64).sum();
    let each = many_each();
    let mut rows = Vec::new();
    for transport in cpu_transports() {
        if only_transport.is_some_and(|t| t != transport.name()) {
            continue;
        }
        let mut one = Vec::new();
        let mut many = Vec::new();
        let mut into = Vec::new();
        let mut load = Vec::new();
        // The first pass of each allocates (unmeasured).
        for i in 0..iters + 1 {
            let t = Instant::now();
            let r = src
                .tensor(MANY_N * each, transport.name().to_string())
                .transport(transport)
                .remote();
            let sum = rt.get(sink.touch_strided(&r, each).remote()).await?;
            assert_eq!(sum, MANY_N as u64, "one byte of 1 read per tensor's worth");
            drop(r);
            let one_took = t.elapsed();
            let t = Instant::now();
            rdt::data::trace::timeline("driver many start", i as u64);
            let r = src
                .many(MANY_N, each, transport.name().to_string())
                .transport(transport)
                .remote();
            let sum = rt.get(sink.touch_all(&r).remote()).await?;
            assert_eq!(sum, first_bytes);
            drop(r);
            rdt::data::trace::timeline("driver many end", i as u64);
            let many_took = t.elapsed();
            let t = Instant::now();
            rdt::data::trace::timeline("driver into start", i as u64);
            let r = src
                .many(MANY_N, each, transport.name().to_string())
                .transport(transport)
                .remote();
            let sum = rt.get(sink.update(&r, MANY_N, each).remote()).await?;
            assert_eq!(sum, first_bytes);
            drop(r);
            rdt::data::trace::timeline("driver into end", i as u64);
            let into_took = t.elapsed();
            let t = Instant::now();
            let r = src
                .many(MANY_N, each, transport.name().to_string())
                .transport(transport)
                .remote();
            let sum = rt.get(sink.load(&r, MANY_N, each).remote()).await?;
            assert_eq!(sum, first_bytes);
            drop(r);
            if i > 0 {
                one.push(one_took);
                many.push(many_took);
                into.push(into_took);
                load.push(t.elapsed());
            }
        }
        // The same two objects produced once and passed again (a consumer
        // reading a producer's kept weights: what `bench_nixl` times on
        // GPUs): the consumer's side of the per-tensor cost alone.
        let r_one = src
            .tensor(MANY_N * each, transport.name().to_string())
            .transport(transport)
            .remote();
        let r_many = src
            .many(MANY_N, each, transport.name().to_string())
            .transport(transport)
            .remote();
        rt.wait(&r_one).await?;
        rt.wait(&r_many).await?;
        let (mut one_kept, mut many_kept) = (Vec::new(), Vec::new());
        for i in 0..iters + 1 {
            let t = Instant::now();
            let sum = rt.get(sink.touch_strided(&r_one, each).remote()).await?;
            assert_eq!(sum, MANY_N as u64);
            let one_took = t.elapsed();
            let t = Instant::now();
            let sum = rt.get(sink.touch_all(&r_many).remote()).await?;
            assert_eq!(sum, first_bytes);
            if i > 0 {
                one_kept.push(one_took);
                many_kept.push(t.elapsed());
            }
        }
        drop((r_one, r_many));
        let kind = kind_of_pass(transport);
        rows.push(row(
            "transports",
            "1 tensor of 10000x4 KiB, produced once",
            transport.name(),
            kind,
            (MANY_N * each) as u64,
            one_kept,
        ));
        rows.push(row(
            "transports",
            "10000 tensors of 4 KiB, produced once",
            transport.name(),
            kind,
            (MANY_N * each) as u64,
            many_kept,
        ));
        rows.push(row(
            "transports",
            "1 tensor of 10000x4 KiB",
            transport.name(),
            kind,
            (MANY_N * each) as u64,
            one,
        ));
        rows.push(row(
            "transports",
            "10000 tensors of 4 KiB",
            transport.name(),
            kind,
            (MANY_N * each) as u64,
            many,
        ));
        rows.push(row(
            "transports",
            "10000 tensors of 4 KiB into the consumer's own (get_into)",
            transport.name(),
            kind,
            (MANY_N * each) as u64,
            into,
        ));
        rows.push(row(
            "transports",
            "10000 tensors of 4 KiB into the consumer's own (load_into)",
            transport.name(),
            kind,
            (MANY_N * each) as u64,
            load,
        ));
    }
    Ok(rows)
}

fn rss_kib(pid: u32) -> u64 {
    rdt_examples::status_kib(Some(pid), "VmRSS:")
}

async fn soak(rt: &Runtime, passes: usize) -> rdt::Result<Vec<Row>> {
    let mut rows = Vec::new();
    for transport in cpu_transports() {
        let src = rt.spawn::<Source>(()).await?;
        let sink = rt.spawn::<Sink>(()).await?;
        if transport.is_collective() {
            rt.create_collective_group(&[src.id(), sink.id()], transport)
                .await?;
        }
        let sizes = [16usize, 1 << 10, 64 << 10, 256, 1 << 20, 4 << 10];
        let mut inflight = std::collections::VecDeque::new();
        let mut samples = Vec::with_capacity(passes);
        let mut base = None;
        let mut bytes = 0u64;
        for i in 0..passes {
            if i == passes / 10 {
                base = Some((
                    rss_kib(src.pid().unwrap_or(0)),
                    rss_kib(sink.pid().unwrap_or(0)),
                ));
            }
            let n = sizes[i % sizes.len()];
            bytes += n as u64;
            let t = Instant::now();
            let r = src.fresh(n).transport(transport).remote();
            inflight.push_back((t, sink.touch(&r).remote()));
            drop(r);
            if inflight.len() >= 32 {
                let (t, s) = inflight.pop_front().expect("non-empty");
                rt.get(&s).await?;
                samples.push(t.elapsed());
            }
        }
        for (t, s) in inflight {
            rt.get(&s).await?;
            samples.push(t.elapsed());
        }
        // A one-sided transfer's entry stays until its consumer's
        // acknowledgement, which may come after the call's reply.
        rt.transfers_settled().await;
        let live = rt.live_objects();
        let end = (
            rss_kib(src.pid().unwrap_or(0)),
            rss_kib(sink.pid().unwrap_or(0)),
        );
        let (b0, b1) = base.unwrap_or(end);
        println!(
            "soak {transport}: {passes} passes, owner table {live} entries at the end, producer RSS {b0} -> {} KiB, consumer RSS {b1} -> {} KiB",
            end.0, end.1
        );
        if live != 0 || end.0 > b0 + 64 * 1024 || end.1 > b1 + 64 * 1024 {
            eprintln!("soak {transport}: leak suspected");
            std::process::exit(1);
        }
        rows.push(row(
            "soak",
            &format!("{passes} mixed passes (latency with 32 in flight)"),
            transport.name(),
            Kind::Latency,
            bytes / passes as u64,
            samples,
        ));
        src.kill();
        sink.kill();
    }
    Ok(rows)
}

fn print(rows: &[Row]) {
    println!(
        "{:<12} {:<34} {:<13} {:>12} {:>12} {:>12} {:>10}  kind",
        "suite", "case", "transport", "bytes", "median µs", "p90 µs", "GB/s"
    );
    for r in rows {
        // Only a copy has a bandwidth; a hand-off or a round trip has none.
        let gbps = r.gbps.map_or("—".to_string(), |g| format!("{g:.3}"));
        println!(
            "{:<12} {:<34} {:<13} {:>12} {:>12.1} {:>12.1} {:>10}  {}",
            r.suite,
            r.case,
            r.transport,
            r.bytes,
            r.median_us,
            r.p90_us,
            gbps,
            r.kind.label()
        );
    }
    // Ratios against the baseline of each case.
    let echo = rows.iter().find(|r| r.case.starts_with("unix socket echo"));
    let call = rows.iter().find(|r| r.case == "tiny actor call round trip");
    if let (Some(e), Some(c)) = (echo, call) {
        println!(
            "ratio: tiny actor call / bare socket echo = {:.2}x",
            c.median_us / e.median_us
        );
        if let Some(h) = rows.iter().find(|r| r.transport == "cuda_ipc") {
            println!(
                "ratio: cached cuda_ipc hand-off / bare socket echo = {:.2}x (same run)",
                h.median_us / e.median_us
            );
        }
        if let Some(a) = rows.iter().find(|r| r.case == "tiny call from an actor") {
            println!(
                "ratio: tiny call from an actor / bare socket echo = {:.2}x, / tiny call from the driver = {:.2}x",
                a.median_us / e.median_us,
                a.median_us / c.median_us
            );
        }
    }
    for r in rows
        .iter()
        .filter(|r| r.case.starts_with("10000 tensors of 4 KiB"))
    {
        let kept = r.case.ends_with("produced once");
        let one_case = if kept {
            "1 tensor of 10000x4 KiB, produced once"
        } else {
            "1 tensor of 10000x4 KiB"
        };
        if let Some(one) = rows
            .iter()
            .find(|b| b.case == one_case && b.transport == r.transport)
        {
            let how = if r.case.contains("get_into") {
                " into the consumer's own (get_into)"
            } else if r.case.contains("load_into") {
                " into the consumer's own (load_into)"
            } else if kept {
                ", produced once,"
            } else {
                ""
            };
            println!(
                "ratio: {} 10 000 tensors of 4 KiB{how} take {:.2}x one tensor of their size ({:.0} ns per tensor more)",
                r.transport,
                r.median_us / one.median_us,
                (r.median_us - one.median_us) * 1e3 / 10_000.0
            );
        }
    }
    for r in rows.iter().filter(|r| r.transport == "raw_relay") {
        if let Some(os) = rows
            .iter()
            .find(|b| b.case == r.case && b.transport == "object_store")
        {
            println!(
                "ratio: {} object_store takes {:.2}x the raw cut-through relay",
                r.case,
                os.median_us / r.median_us
            );
        }
    }
    // Each direct transport against its own raw floor, and every copying
    // pass against one warm copy of its bytes.
    for r in rows
        .iter()
        .filter(|r| matches!(r.transport.as_str(), "tcp" | "nixl"))
    {
        let floor = format!("raw_{}", r.transport);
        if let Some(f) = rows
            .iter()
            .find(|b| b.case == r.case && b.transport == floor)
        {
            println!(
                "ratio: {} {} moves {:.2}x the GB/s of {floor}",
                r.case,
                r.transport,
                f.median_us / r.median_us
            );
        }
    }
    for r in rows.iter().filter(|r| {
        r.suite == "transports"
            && (matches!(r.transport.as_str(), "object_store" | "tcp" | "nixl")
                // Into the consumer's own tensors, shm copies too.
                || (r.transport == "shm" && r.case.starts_with("weight update")))
    }) {
        if let Some(m) = rows
            .iter()
            .find(|b| b.case == r.case && b.transport == "memcpy")
        {
            println!(
                "ratio: {} {} takes {:.2}x a warm memcpy",
                r.case,
                r.transport,
                r.median_us / m.median_us
            );
        }
    }
    for r in rows.iter().filter(|r| {
        !matches!(
            r.transport.as_str(),
            "object_store" | "raw_relay" | "raw_tcp" | "raw_nixl" | "memcpy"
        ) && r.suite == "transports"
    }) {
        if let Some(base) = rows
            .iter()
            .find(|b| b.case == r.case && b.transport == "object_store")
        {
            println!(
                "ratio: {} {} is {:.2}x faster than object_store{}",
                r.case,
                r.transport,
                base.median_us / r.median_us,
                if r.kind == Kind::HandoffLatency {
                    " (a hand-off: no byte copied)"
                } else {
                    ""
                }
            );
        }
    }
}

/// `soak --faults`: the randomized fault soak, long form.
async fn fault_soak(json: Option<String>) -> rdt::Result<()> {
    let ops = arg_value("--ops")
        .and_then(|n| n.parse().ok())
        .unwrap_or(10_000);
    let seed = arg_value("--seed")
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        });
    println!("fault soak: seed {seed}, {ops} operations");
    let report = rdt_integration_tests::fault_soak::run(seed, ops).await;
    println!(
        "{}",
        serde_json::to_string_pretty(&report).unwrap_or_default()
    );
    if let Some(path) = json {
        std::fs::write(
            &path,
            serde_json::to_vec_pretty(&report).unwrap_or_default(),
        )?;
    }
    // Flat: the pools and caches a worker keeps are bounded (64 MiB).
    rdt_integration_tests::fault_soak::assert_clean(&report, 64 << 10);
    Ok(())
}

#[rdt::main]
async fn main() -> rdt::Result<()> {
    if let Ok(path) = std::env::var(ECHO_ENV) {
        echo_server(&path);
    }
    if let Ok(spec) = std::env::var(RELAY_ENV) {
        relay_server(&spec);
    }
    if std::env::var(TCP_SINK_ENV).is_ok() {
        tcp_sink_server();
    }
    if let Ok(sizes) = std::env::var(NIXL_HOLDER_ENV) {
        nixl_holder_server(&sizes);
    }
    let args: Vec<String> = std::env::args().skip(1).collect();
    let suite = args.first().cloned().unwrap_or_else(|| "control".into());
    let json = arg_value("--json");
    let quick = args.iter().any(|a| a == "--quick");
    let passes = arg_value("--passes")
        .and_then(|n| n.parse().ok())
        .unwrap_or(100_000);
    if suite == "timeline" {
        return timeline().await;
    }
    if suite == "soak" && args.iter().any(|a| a == "--faults") {
        return fault_soak(json).await;
    }
    let rt = Runtime::start().await?;
    let rows = match suite.as_str() {
        "control" => control(&rt, quick).await?,
        "transports" => transports(&rt, quick).await?,
        "soak" => soak(&rt, passes).await?,
        "weightsync" => weightsync::weightsync(&rt).await?,
        "all" => {
            let mut r = control(&rt, quick).await?;
            r.extend(transports(&rt, quick).await?);
            r
        }
        other => {
            eprintln!("unknown suite {other:?}; suites: control, transports, soak, weightsync, all, timeline");
            std::process::exit(2);
        }
    };
    print(&rows);
    weightsync::print_ratios(&rows);
    if let Some(path) = json {
        std::fs::write(&path, serde_json::to_string_pretty(&rows).unwrap()).expect("write JSON");
        println!("wrote {path}");
    }
    rt.shutdown().await;
    Ok(())
}

/// `timeline`: a few tiny calls and, where a GPU is visible, cached
/// `cuda_ipc` hand-offs, with `RDT_TIMELINE` on in the driver and the
/// workers (every step on one clock, on stderr); no rows.
async fn timeline() -> rdt::Result<()> {
    // Before any worker starts: they inherit it.
    rdt_examples::record_timeline();
    let rt = Runtime::start().await?;
    let gpu = rdt::data::cuda::available().is_ok();
    let (src, sink) = if gpu {
        (
            rt.spawn::<Source>(()).on_gpus([0]).await?,
            rt.spawn::<Sink>(()).on_gpus([0]).await?,
        )
    } else {
        (rt.spawn::<Source>(()).await?, rt.spawn::<Sink>(()).await?)
    };
    for i in 0..200 {
        rt.get(src.ping(i).remote()).await?;
    }
    for i in 0..8 {
        rdt::data::trace::timeline("driver tiny call start", i);
        rt.get(src.ping(i).remote()).await?;
        rdt::data::trace::timeline("driver tiny call end", i);
    }
    // A kept 4 KiB tensor passed over `tcp` in a group (two-sided, as
    // `nccl`: a delivery and a send order per pass, settled by the call's
    // `CallDone`, the copy freed after), each pass after a tiny call, as
    // `bench_nccl --timeline` times them ("driver pass start" 0 and 4096).
    rt.create_collective_group(&[src.id(), sink.id()], Transport::Tcp)
        .await?;
    let r = src
        .tensor(4096, "tcp".to_string())
        .transport(Transport::Tcp)
        .remote();
    rt.wait(&r).await?;
    // `--passes N`: N untimed passes first (200 by default), e.g. to
    // profile the pass with `perf` (`RDT_TIMELINE=0` then).
    let warm: u64 = arg_value("--passes")
        .and_then(|n| n.parse().ok())
        .unwrap_or(200);
    for i in 0..warm + 20 {
        let timed = i >= warm;
        if timed {
            rdt::data::trace::timeline("driver pass start", 0);
        }
        rt.get(src.ping(i).remote()).await?;
        if timed {
            rdt::data::trace::timeline("driver pass end", 0);
            rdt::data::trace::timeline("driver pass start", 4096);
        }
        rt.get(sink.touch(&r).remote()).await?;
        if timed {
            rdt::data::trace::timeline("driver pass end", 4096);
        }
    }
    drop(r);
    if gpu {
        for i in 0..208 {
            let timed = i >= 200;
            if timed {
                rdt::data::trace::timeline("driver hand-off start", i);
            }
            let r = src.cuda_tensor(4096).transport(Transport::CudaIpc).remote();
            rt.get(sink.touch_cuda(&r).remote()).await?;
            drop(r);
            if timed {
                rdt::data::trace::timeline("driver hand-off end", i);
            }
        }
    }
    // Every process prints its points every 20 ms.
    tokio::time::sleep(Duration::from_millis(100)).await;
    rdt::timeline::flush();
    rt.shutdown().await;
    Ok(())
}
