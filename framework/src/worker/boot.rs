//! A worker's boot: the process made a worker before `main` (invariant
//! 1), by the driver's environment or by `--rdt-connect`, then joined to
//! its driver.

use super::*;
use crate::protocol::boot::{Joined, WorkerStart};

/// Makes this process a worker if the driver started it as one, or if it
/// was started by hand with `--rdt-connect HOST:PORT` (invariant 1);
/// returns at once otherwise. Call it first thing in `main`
/// (`#[rdt::main]` does).
pub fn init() {
    prepare_process();
    boot_if_worker();
}

/// Settings every rdt process takes before it has threads (driver and
/// workers alike): `rdt_transport::nixl::prepare_process`.
pub(super) fn prepare_process() {
    #[cfg(feature = "nixl")]
    rdt_transport::nixl::prepare_process();
}

/// How a worker reaches its driver.
pub(super) enum Link {
    /// Spawned by the driver: its private Unix socket.
    Unix(String),
    /// Started by hand (Slurm, Kubernetes, mpirun): the driver's TCP
    /// control address.
    Tcp(String),
    /// Started by hand, over TLS: address, server name, trusted PEM.
    Tls(String, String, Vec<u8>),
}

/// The pre-`main` hook of every binary with actors. Where `main` will boot
/// the worker itself (`#[rdt::main]`), it does nothing; otherwise (test
/// binaries) it does Rust's start-up work by hand (WK-1) and boots.
#[doc(hidden)]
pub fn boot_before_main() {
    prepare_process();
    if !RDT_MAIN.is_empty() || !is_worker() {
        return;
    }
    crate::process::startup::rust_start_up();
    boot_if_worker();
}

pub(super) fn is_worker() -> bool {
    crate::env::is_spawned_worker() || cmdline_flag("--rdt-connect").is_some()
}

pub(super) fn boot_if_worker() {
    let (link, secret, worker) = if let Some(socket) = crate::env::spawned_worker(env::SOCKET) {
        match local_boot(socket) {
            Ok(b) => b,
            Err(e) => fail_boot(&e),
        }
    } else if let Some(addr) = cmdline_flag("--rdt-connect") {
        let token = crate::env::token()
            .or_else(|| cmdline_flag("--rdt-token"))
            .unwrap_or_else(|| {
                fail_boot(
                    "--rdt-connect needs the runtime's token: set RDT_TOKEN or pass --rdt-token",
                )
            });
        let secret =
            hex::decode(token.trim()).unwrap_or_else(|_| fail_boot("the token is not hex"));
        let ca = crate::env::tls_ca().or_else(|| cmdline_flag("--rdt-tls-ca"));
        let link = match ca {
            None => Link::Tcp(addr),
            Some(path) => {
                let pem = std::fs::read(&path).unwrap_or_else(|e| {
                    fail_boot(&format!("cannot read the TLS CA file {path}: {e}"))
                });
                let name = cmdline_flag("--rdt-tls-name").unwrap_or_else(|| {
                    addr.rsplit_once(':')
                        .map(|(h, _)| h.trim_matches(['[', ']']).to_string())
                        .unwrap_or_else(|| addr.clone())
                });
                Link::Tls(addr, name, pem)
            }
        };
        (link, secret, 0)
    } else {
        return;
    };
    super::log::install(&format!("rdt worker {}", std::process::id()));
    // One worker thread unless `RDT_CONTROL_THREADS` says otherwise (a
    // measurement knob). With two, the idle one slept in `epoll_wait`
    // holding the I/O driver: every frame written to this worker woke it,
    // and the spinning control loop could not poll the driver itself. On
    // 2xH200 one was faster in most process pairs of session 38 (a 4 KiB
    // `nixl` pass in three of four, `nccl` in three of four, 10 000
    // tensors in all three), as it was for `nixl` in session 31; pairs
    // differ by as much (see the benchmark page of 2026-11-27).
    let threads = match crate::env::control_threads() {
        None => 1,
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                tracing::warn!(
                    "RDT_CONTROL_THREADS={v:?} is not a positive number of threads; using 1"
                );
                1
            }
        },
    };
    let control = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads)
        .thread_name("rdt-control")
        .enable_all()
        .build()
        .unwrap_or_else(|e| fail_boot(&format!("no tokio runtime: {e}")));
    let joined = control
        .block_on(join_driver(link, secret, worker))
        .unwrap_or_else(|e| fail_boot(&e.to_string()));
    let type_name = joined.order.actor_type.clone();
    match ACTOR_TYPES.iter().find(|r| r.name == type_name) {
        Some(reg) => (reg.run)(WorkerStart { joined, control }),
        None => {
            let known: Vec<&str> = ACTOR_TYPES.iter().map(|r| r.name).collect();
            let e = Error::Spawn(format!(
                "actor type {type_name} is not registered in this worker's binary (registered: {known:?}); \
                 run the same binary as the driver"
            ));
            let _ = joined.tx.send(&ToDriver::Spawned(Err(e.clone())));
            fail_boot(&e.to_string())
        }
    }
}

pub(super) fn fail_boot(e: &str) -> ! {
    eprintln!("rdt worker: {e}");
    std::process::exit(2)
}

/// A flag's value from this process's command line. Read from
/// `/proc/self/cmdline`: this runs before `main`, where `std::env::args`
/// may not be set up yet.
pub(super) fn cmdline_flag(flag: &str) -> Option<String> {
    let raw = std::fs::read("/proc/self/cmdline").ok()?;
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let prefix = format!("{flag}=");
    args.iter().enumerate().find_map(|(i, a)| {
        if a == flag {
            args.get(i + 1).cloned()
        } else {
            a.strip_prefix(&prefix).map(str::to_string)
        }
    })
}

pub(super) fn local_boot(socket: String) -> std::result::Result<(Link, Vec<u8>, u64), String> {
    let var = |k: &'static str| {
        crate::env::spawned_worker(k).ok_or_else(|| format!("missing environment variable {k}"))
    };
    let secret = hex::decode(var(env::SECRET)?).map_err(|_| "bad secret")?;
    let worker = var(env::WORKER_ID)?.parse().map_err(|_| "bad worker id")?;
    let parent: i32 = var(env::PARENT_PID)?
        .parse()
        .map_err(|_| "bad parent pid")?;
    // SAFETY: plain syscalls.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() != parent {
            return Err("the driver exited before this worker started".into());
        }
    }
    // Children of the worker must not think they are workers.
    crate::env::forget_spawned_worker();
    Ok((Link::Unix(socket), secret, worker))
}

pub(super) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// Connects to the driver, authenticates, says hello and waits for the
/// spawn order. Runs on the control runtime.
pub(super) async fn join_driver(link: Link, secret: Vec<u8>, worker: u64) -> Result<Joined> {
    // Until the spawn order says otherwise, accept frames up to the
    // default limit.
    let max = crate::protocol::boot::DEFAULT_MAX_FRAME;
    let (tx, mut rx, local_ip) = match link {
        Link::Unix(path) => {
            let mut s = UnixStream::connect(&path).await?;
            protocol::size_socket_buffers(&s);
            protocol::connect_plain(&mut s, &secret).await?;
            let (r, w) = s.into_split();
            (
                protocol::spawn_writer(protocol::WriteHalf::Unix(w), max),
                protocol::Receiver::new(protocol::ReadHalf::Unix(r), max),
                None,
            )
        }
        Link::Tls(addr, name, pem) => {
            let (s, ip) = protocol::connect_tls(&addr, &name, &pem, &secret).await?;
            let (r, w) = tokio::io::split(s);
            (
                protocol::spawn_writer(protocol::WriteHalf::Tls(tokio::sync::Mutex::new(w)), max),
                protocol::Receiver::new(protocol::ReadHalf::Tls(r), max),
                Some(ip),
            )
        }
        Link::Tcp(addr) => {
            let mut s = tokio::net::TcpStream::connect(&addr)
                .await
                .map_err(|e| Error::Io(format!("connect to the driver at {addr}: {e}")))?;
            s.set_nodelay(true)?;
            protocol::connect_plain(&mut s, &secret).await?;
            let ip = s.local_addr()?.ip();
            let (r, w) = s.into_split();
            (
                protocol::spawn_writer(protocol::WriteHalf::Tcp(w), max),
                protocol::Receiver::new(protocol::ReadHalf::Tcp(r), max),
                Some(ip),
            )
        }
    };
    tx.send(&ToDriver::Hello {
        worker,
        pid: std::process::id(),
        host: hostname(),
        endpoints: Vec::new(),
    })?;
    loop {
        match rx.recv::<ToWorker>().await? {
            Some(ToWorker::Spawn(order)) => {
                // A large constructor argument may still be arriving: read
                // it whole before the actor is made from it.
                rx.finish_frame().await?;
                rx.set_max_frame(order.max_frame);
                tx.set_max_frame(order.max_frame);
                return Ok(Joined {
                    tx,
                    rx,
                    order,
                    secret,
                    local_ip,
                });
            }
            // A volunteer may wait long for work: answer heartbeats.
            Some(ToWorker::Ping) => tx.send(&ToDriver::Pong)?,
            Some(other) => {
                return Err(Error::Protocol(format!(
                    "expected a spawn order, got {other:?}"
                )))
            }
            None => {
                return Err(Error::Protocol(
                    "the driver closed the connection before the spawn order".into(),
                ))
            }
        }
    }
}
