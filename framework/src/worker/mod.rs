//! Worker processes: boot, the actix host of the user's actor, the local
//! object store.
//!
//! # Invariants
//! 1. A worker is the driver's binary re-executed with the `RDT_WORKER_*`
//!    environment. It becomes a worker before `main` (a constructor emitted
//!    by `#[rdt::actor]`) or at `rdt::init()`, whichever comes first, and
//!    never returns to user code.
//! 2. Calls reach the actor as actix messages; when each runs (arguments
//!    first, then its turn, one at a time or concurrently) is `host`'s
//!    business (HO-1 … HO-5).
//! 3. The control loop never waits for a method: deliveries, sends, frees
//!    and fetches are served while a method runs.
//! 4. A method's panic is caught and becomes the call's error (HO-5).
//! 5. The worker exits when the driver's connection ends (and the kernel
//!    kills it if the driver dies first).
//! 6. **WK-6** A `Free` has taken effect before any call behind it starts: a freed
//!    value that the control loop drops on the blocking pool (large ones,
//!    so that the frames behind the `Free` are not held up) is counted
//!    in [`AsideDrops`], and a call waits for the count to reach zero
//!    before its method runs. So memory the driver freed is gone by the
//!    time a later call looks (`trim`, `wait_tensor_freed`, a slab count).
//! 7. **WK-7** A delivery's receive puts the tensors into the target tensors an
//!    actor's `get_into` registered for that object (in [`WorkerShared`]'s
//!    `targets`, before its `Get` is sent), when they fit the object's
//!    metadata; else anywhere (`get_into` then copies, or fails with
//!    `Error::Targets` and the received value stays stored). A target that
//!    does not fit never fails the receive: bad targets lose nothing.
//!    The same registered list with the same layout over the same
//!    transport as the last fit is not checked again ([`FittedTargets`]).
//! 8. **WK-8** The tensors of a large receive are made on the thread that
//!    waits to use them. A call's argument (or an actor's `get`) that
//!    waits for an object still being received registers as its first
//!    reader (`readers`); a receive that makes its tensors while its bytes
//!    move hands the list to that reader (`TransferCtx::first_reader`),
//!    which makes them on the actor's thread, where the method walks them
//!    next. With no reader registered, the receive makes them itself.
//! 9. **WK-9** A stream-ordered receive (its bytes still landing when it
//!    returns, WK-5) is acknowledged exactly once, by whoever takes it on
//!    first ([`Landed::take_ack`]): its task once the bytes landed, or a
//!    call that took the value before that. Such a call's `CallDone`
//!    settles the receive in the driver (XF-5: it got past its
//!    arguments), so no `Received` goes out, unless the call fails on the
//!    landing itself (`Dependency`): then it sends each `Received` it
//!    took on, with how that landing ended, before its `CallDone`.
//! 10. **WK-13** The consumer drops its own argument copies (OW-12). The
//!     control loop counts, per object, the calls it received that take it
//!     as a ref and have not ended (`arg_uses`), before it hands a call on.
//!     A call that ended past its arguments takes each of its `release`
//!     objects that no other counted call takes out of the store (a
//!     received copy only, never a value produced here) before it writes
//!     its `CallDone`, which names them; it drops them after the write
//!     (large ones on the blocking pool, counted for WK-6), off the path
//!     of the reply and of the next call's frames. A call counted late (its
//!     frame read after the drop) finds no copy and waits for the delivery
//!     the driver then sends again.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use actix::prelude::*;
use bytes::Bytes;
use futures::FutureExt;
use parking_lot::Mutex;
use rdt_transport::hot::{self, hot};
use rdt_transport::{object_store, Peer, ReceiveStart, Sidedness, Target, Tensor, TensorList};
use tokio::net::UnixStream;
use tokio::sync::{oneshot, Notify};
use tracing::Instrument;

use crate::actor::{Actor as RdtActor, ACTOR_TYPES};

mod client;
mod handoff;
mod host;
mod peer;
use crate::error::{Error, Result};
use crate::protocol::{self, Delivery, ToDriver, ToWorker};
use crate::runtime::inline_value;
use crate::transport::Transport;
pub(crate) use client::BorrowBatch;
pub use client::{runtime, try_runtime, ActorRuntime};
use host::Host;

/// Names of the environment variables a local worker is started with.
pub(crate) mod env {
    pub const SOCKET: &str = "RDT_WORKER_SOCKET";
    pub const SECRET: &str = "RDT_WORKER_SECRET";
    pub const WORKER_ID: &str = "RDT_WORKER_ID";
    pub const PARENT_PID: &str = "RDT_WORKER_PARENT_PID";
    pub const ALL: [&str; 4] = [SOCKET, SECRET, WORKER_ID, PARENT_PID];
    /// The secret of a worker started by hand (`--rdt-token` puts it in
    /// the process's argument list, visible to other users; prefer this).
    pub const TOKEN: &str = "RDT_TOKEN";
    /// PEM file of the certificate(s) to trust for a TLS control link
    /// (or `--rdt-tls-ca PATH`); without it the link is plain TCP.
    pub const TLS_CA: &str = "RDT_TLS_CA";
}

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
fn prepare_process() {
    #[cfg(feature = "nixl")]
    rdt_transport::nixl::prepare_process();
}

/// How a worker reaches its driver.
enum Link {
    /// Spawned by the driver: its private Unix socket.
    Unix(String),
    /// Started by hand (Slurm, Kubernetes, mpirun): the driver's TCP
    /// control address.
    Tcp(String),
    /// Started by hand, over TLS: address, server name, trusted PEM.
    Tls(String, String, Vec<u8>),
}

/// Binaries whose `main` is `#[rdt::main]` register here: their workers
/// boot from `main`, after Rust's own start-up.
#[doc(hidden)]
#[linkme::distributed_slice]
pub static RDT_MAIN: [u8];

/// The pre-`main` hook of every binary with actors. Where `main` will boot
/// the worker itself (`#[rdt::main]`), it does nothing; otherwise (test
/// binaries) it does Rust's start-up work by hand (WK-1) and boots.
#[doc(hidden)]
pub fn boot_before_main() {
    prepare_process();
    if !RDT_MAIN.is_empty() || !is_worker() {
        return;
    }
    crate::startup::rust_start_up();
    boot_if_worker();
}

fn is_worker() -> bool {
    crate::env::var_os(env::SOCKET).is_some() || cmdline_flag("--rdt-connect").is_some()
}

fn boot_if_worker() {
    let (link, secret, worker) = if let Ok(socket) = crate::env::var(env::SOCKET) {
        match local_boot(socket) {
            Ok(b) => b,
            Err(e) => fail_boot(&e),
        }
    } else if let Some(addr) = cmdline_flag("--rdt-connect") {
        let token = crate::env::var(env::TOKEN)
            .ok()
            .or_else(|| cmdline_flag("--rdt-token"))
            .unwrap_or_else(|| {
                fail_boot(
                    "--rdt-connect needs the runtime's token: set RDT_TOKEN or pass --rdt-token",
                )
            });
        let secret =
            hex::decode(token.trim()).unwrap_or_else(|_| fail_boot("the token is not hex"));
        let ca = crate::env::var(env::TLS_CA)
            .ok()
            .or_else(|| cmdline_flag("--rdt-tls-ca"));
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
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .try_init();
    // One worker thread unless `RDT_CONTROL_THREADS` says otherwise (a
    // measurement knob). With two, the idle one slept in `epoll_wait`
    // holding the I/O driver: every frame written to this worker woke it,
    // and the spinning control loop could not poll the driver itself. On
    // 2xH200 one was faster in most process pairs of session 38 (a 4 KiB
    // `nixl` pass in three of four, `nccl` in three of four, 10 000
    // tensors in all three), as it was for `nixl` in session 31; pairs
    // differ by as much (see the benchmark page of 2026-11-27).
    let threads = match crate::env::var("RDT_CONTROL_THREADS") {
        Err(_) => 1,
        Ok(v) => match v.trim().parse::<usize>() {
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

fn fail_boot(e: &str) -> ! {
    eprintln!("rdt worker: {e}");
    std::process::exit(2)
}

/// A flag's value from this process's command line. Read from
/// `/proc/self/cmdline`: this runs before `main`, where `std::env::args`
/// may not be set up yet.
fn cmdline_flag(flag: &str) -> Option<String> {
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

fn local_boot(socket: String) -> std::result::Result<(Link, Vec<u8>, u64), String> {
    let var = |k: &str| crate::env::var(k).map_err(|_| format!("missing environment variable {k}"));
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
    for k in env::ALL {
        // Children of the worker must not think they are workers.
        std::env::remove_var(k);
    }
    Ok((Link::Unix(socket), secret, worker))
}

/// A worker that joined its driver and got its spawn order.
#[doc(hidden)]
pub struct WorkerStart {
    joined: Joined,
    control: tokio::runtime::Runtime,
}

struct Joined {
    tx: protocol::Sender,
    rx: protocol::Receiver<protocol::ReadHalf>,
    order: protocol::SpawnOrder,
    secret: Vec<u8>,
    /// The local address of a TCP control link: remote workers bind their
    /// data endpoints there by default (routable to the driver's network).
    local_ip: Option<std::net::IpAddr>,
}

/// Entry point of a worker hosting `A`; never returns.
#[doc(hidden)]
pub fn run_worker<A: RdtActor>(start: WorkerStart) -> ! {
    crate::heap::tune_worker_heap();
    if let Err(e) = worker_main::<A>(start) {
        eprintln!("rdt worker: {e}");
        std::process::exit(1);
    }
    std::process::exit(0)
}

/// A value in the worker's store.
#[derive(Clone)]
struct StoredValue {
    data: Bytes,
    /// Shared: a call that takes the value, or a `get` of it in the actor,
    /// clones the list's handle, not each of its (thousands of) tensors.
    /// A lazy list (a planned `nixl` receive) makes each tensor when a
    /// decode wants it.
    tensors: Arc<TensorList>,
    transport: Transport,
    /// Produced here (released through the transport on free).
    produced: bool,
}

#[derive(Clone)]
enum Slot {
    Ready(StoredValue),
    Failed(Error),
}

/// Objects this worker produced (direct transports) or received.
#[derive(Default)]
struct Store {
    map: Mutex<HashMap<u64, Slot>>,
    changed: Notify,
}

impl Store {
    fn insert(&self, id: u64, slot: Slot) {
        let mut m = self.map.lock();
        // Never replace received data by a late error (owner invariant 4).
        if matches!(slot, Slot::Failed(_)) && matches!(m.get(&id), Some(Slot::Ready(_))) {
            return;
        }
        m.insert(id, slot);
        drop(m);
        self.changed.notify_waiters();
    }

    fn remove(&self, id: u64) -> Option<Slot> {
        let s = self.map.lock().remove(&id);
        self.changed.notify_waiters();
        s
    }

    /// A received value whose bytes never all arrived (a stream-ordered
    /// receive failed after it returned) becomes that error.
    fn fail_received(&self, id: u64, e: Error) {
        let mut m = self.map.lock();
        if let Some(
            slot @ Slot::Ready(StoredValue {
                produced: false, ..
            }),
        ) = m.get_mut(&id)
        {
            *slot = Slot::Failed(e);
        }
        drop(m);
        self.changed.notify_waiters();
    }

    fn get(&self, id: u64) -> Option<Slot> {
        self.map.lock().get(&id).cloned()
    }

    /// Takes `id` out if it is a value received here (WK-13).
    fn take_received(&self, id: u64) -> Option<StoredValue> {
        let mut m = self.map.lock();
        if !matches!(m.get(&id), Some(Slot::Ready(v)) if !v.produced) {
            return None;
        }
        let Some(Slot::Ready(v)) = m.remove(&id) else {
            unreachable!("looked up above")
        };
        drop(m);
        self.changed.notify_waiters();
        Some(v)
    }

    /// Waits until `ready` returns a value, checking again after every
    /// change of the store (registered before the check: no lost wake-up).
    async fn wait_until<T>(&self, ready: impl Fn(&Store) -> Option<T>) -> T {
        loop {
            // Polled hot (an actor's call waiting for its argument): look,
            // and register nothing, so the thread that stores the value
            // need not wake this one (`rdt_transport::hot::polled_hot`).
            if hot::polled_hot() {
                if let Some(v) = ready(self) {
                    return v;
                }
                hot::pending_once().await;
                continue;
            }
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(v) = ready(self) {
                return v;
            }
            notified.await;
        }
    }

    async fn wait_for(&self, id: u64) -> Slot {
        self.wait_until(|s| s.get(id)).await
    }

    fn holds_storage(&self, t: &Tensor) -> bool {
        self.map.lock().values().any(|s| match s {
            Slot::Ready(v) => v.tensors.iter().any(|x| x.shares_storage(t)),
            Slot::Failed(_) => false,
        })
    }
}

impl WorkerShared {
    /// WK-8: waits for object `id` in the store, as its first reader if
    /// it is not there yet: a large receive of it hands its list over while
    /// the bytes still move, and its tensors are made here, on the
    /// caller's thread (an actor's, which uses them next).
    async fn arrival(&self, id: u64) -> Slot {
        if let Some(slot) = self.store.get(id) {
            return slot;
        }
        let (tx, offered) = oneshot::channel();
        let token = self
            .next_req
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let registered = match self.readers.lock().entry(id) {
            std::collections::hash_map::Entry::Occupied(_) => false,
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert((token, tx));
                true
            }
        };
        let _unregister = registered.then_some(Unregister {
            readers: &self.readers,
            object: id,
            token,
        });
        let stored = self.store.wait_for(id);
        tokio::pin!(stored);
        if registered {
            match futures::future::select(stored.as_mut(), offered).await {
                futures::future::Either::Left((slot, _)) => return slot,
                futures::future::Either::Right((Ok(list), _)) => {
                    list.premake();
                    rdt_transport::cuda::timeline("views made on the reader's thread", id);
                }
                // The receive ended without offering it.
                futures::future::Either::Right((Err(_), _)) => {}
            }
        }
        stored.await
    }

    /// WK-8: the reader registered for `object`, which takes a receive's
    /// list once.
    fn first_reader(self: &Arc<Self>, object: u64) -> rdt_transport::FirstReader {
        let shared = self.clone();
        rdt_transport::FirstReader::new(move |list| {
            let reader = shared.readers.lock().remove(&object);
            reader.is_some_and(|(_, tx)| tx.send(list.clone()).is_ok())
        })
    }
}

/// Removes a reader's registration when its wait ends, unless the receive
/// took it (or another reader registered since: its token differs).
struct Unregister<'a> {
    readers: &'a Mutex<HashMap<u64, (u64, oneshot::Sender<TensorList>)>>,
    object: u64,
    token: u64,
}

impl Drop for Unregister<'_> {
    fn drop(&mut self) {
        let mut readers = self.readers.lock();
        if readers
            .get(&self.object)
            .is_some_and(|(t, _)| *t == self.token)
        {
            readers.remove(&self.object);
        }
    }
}

/// What the worker's threads share: the store, the control link, the
/// transfers, and the actor's side of the runtime (`client`).
pub(crate) struct WorkerShared {
    name: Arc<str>,
    store: Store,
    tx: protocol::Sender,
    /// Transfers this worker takes part in, by id: the sender aborts the
    /// receive or send (WK-4).
    transfers: Mutex<HashMap<u64, oneshot::Sender<Error>>>,
    /// Objects being received, and whether they were freed meanwhile
    /// (a tombstone: the receive drops what it got instead of storing it).
    receiving: Mutex<HashMap<u64, bool>>,
    /// Objects received, per transport: tests and logs see which path a
    /// value took.
    received: Mutex<HashMap<Transport, u64>>,
    /// The collective groups this worker is in (XF-3).
    groups: Mutex<HashMap<u64, WorkerGroup>>,
    /// Received objects whose bytes are still landing (stream-ordered
    /// receives, WK-5): a call that used one reports its result only once
    /// they landed, and fails if they did not.
    landing: Mutex<HashMap<u64, Landed>>,
    /// Calls on their way to the actor's thread while it listens after a
    /// call (`handoff.rs`, HF-1..3).
    handoff: handoff::HandOff,
    /// Freed values still being dropped on the blocking pool (WK-6).
    drops: Arc<AsideDrops>,
    /// The refs this actor holds, counted locally (CL-1).
    local_refs: client::LocalRefs,
    /// The next id of this actor's own id space (AC-1).
    next_object: std::sync::atomic::AtomicU64,
    /// `wait` inside the actor: answers the driver owes, by request.
    watches: Mutex<HashMap<u64, oneshot::Sender<Result<()>>>>,
    /// Answers the driver owes to `Probe`s, by request (HO-6).
    probes: Mutex<HashMap<u64, oneshot::Sender<Option<Result<()>>>>>,
    next_req: std::sync::atomic::AtomicU64,
    /// This actor's id.
    actor: u64,
    /// Results of calls this actor made to itself that have not run yet
    /// (HO-6).
    self_calls: Mutex<std::collections::HashSet<u64>>,
    /// Target tensors `get_into` waits to fill, by object (WK-7).
    targets: Mutex<HashMap<u64, crate::targets::Registered>>,
    /// The first thread waiting for each object still being received, by
    /// object: a token (its registration's) and where to hand the
    /// receive's list (WK-8).
    readers: Mutex<HashMap<u64, (u64, oneshot::Sender<TensorList>)>>,
    /// The targets last found to fit (WK-7).
    fitted: Mutex<Option<FittedTargets>>,
    /// `get_into` calls whose receive wrote into the targets itself.
    in_place: std::sync::atomic::AtomicU64,
    /// Receives the control loop started after the frames in hand
    /// (`ReceiveStart::AfterFramesInHand`).
    started_after_frames: std::sync::atomic::AtomicU64,
    /// Receives a call acknowledged with its `CallDone` (WK-9).
    acks_by_calls: std::sync::atomic::AtomicU64,
    /// How long a receive leaves its acknowledgement to a call that took
    /// it on, after the landing (`ack_wait`).
    ack_wait: Duration,
    /// The control loop's runtime: where a receive's bounded wait for its
    /// call's end runs (WK-12).
    control: tokio::runtime::Handle,
    /// Deliveries straight from producers to consumers (OW-9).
    peer: peer::PeerDelivery,
    /// Calls received and not ended, per object they take as a ref
    /// (WK-13).
    arg_uses: Mutex<HashMap<u64, u32>>,
}

/// A collective group this worker is in: its backend, its members, and its
/// ordered queue of two-sided transfers (XF-3), served by a thread of its
/// own (which can also host a backend's `!Send` handles).
struct WorkerGroup {
    backend: Transport,
    spec: rdt_transport::GroupSpec,
    queue: tokio::sync::mpsc::UnboundedSender<Job>,
    broken: Option<String>,
}

/// The landing of a stream-ordered receive (WK-5), awaited by the
/// receive's acknowledgement and by every call that took the value (the
/// first to ask drives it; each is woken directly when it resolves).
type Landing = futures::future::Shared<
    futures::future::BoxFuture<'static, std::result::Result<(), rdt_transport::TransportError>>,
>;

/// A stream-ordered receive whose bytes are still landing (WK-5): the
/// landing, the transfer, and who acknowledges it (WK-9).
#[derive(Clone)]
pub(crate) struct Landed {
    pub(crate) landing: Landing,
    pub(crate) xfer: u64,
    /// Who acknowledges it, and whether the call that did has ended.
    pub(crate) ack: Arc<AckState>,
}

/// The acknowledgement of a stream-ordered receive (WK-9).
#[derive(Default)]
pub(crate) struct AckState {
    /// Set by whoever took the acknowledgement on: the receive's task
    /// once the bytes landed, or a call that took the value first (its
    /// `CallDone` settles the receive in the driver, XF-5).
    taken: std::sync::atomic::AtomicBool,
    /// Set when the call that took it on has ended (its `CallDone`, or
    /// its own `Received` messages, follow at once).
    call_ended: std::sync::atomic::AtomicBool,
}

impl Landed {
    /// Takes the acknowledgement on; false if someone else has.
    pub(crate) fn take_ack(&self) -> bool {
        !self
            .ack
            .taken
            .swap(true, std::sync::atomic::Ordering::AcqRel)
    }

    /// The call that took the acknowledgement on has ended.
    pub(crate) fn end_call(&self) {
        self.ack
            .call_ended
            .store(true, std::sync::atomic::Ordering::Release);
    }

    fn call_ended(&self) -> bool {
        self.ack
            .call_ended
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

/// How long the receive's task leaves the acknowledgement to a call that
/// took it on, once the bytes landed, before it sends one itself (WK-9):
/// an eighth of the transfer deadline, at most 10 ms. A method that runs
/// on must not hold it until the driver's deadline for the transfer,
/// which would abort a finished transfer and break its group.
fn ack_wait(transfer_timeout: Duration) -> Duration {
    (transfer_timeout / 8).min(Duration::from_millis(10))
}

/// A transfer waiting its turn in a group's queue.
type Job = futures::future::BoxFuture<'static, ()>;

/// Starts the thread that runs a group's transfers one after the other, in
/// the order the control loop queued them (the driver's order). It ends
/// when the group is dropped and its queue has drained.
fn start_group_queue(group: u64) -> std::io::Result<tokio::sync::mpsc::UnboundedSender<Job>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
    // Timers only: no transport's group transfer does tokio I/O (`tcp`
    // moves bytes on threads of its own, NCCL on the GPU), and with an I/O
    // driver every yield of this thread's hot waits (its next transfer, a
    // landing) was an `epoll_wait` system call, so each round of those
    // waits saw what it waited for microseconds late.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    std::thread::Builder::new()
        .name(format!("rdt-group-{group}"))
        .spawn(move || {
            rt.block_on(async move {
                // Hot (rdt_transport::hot): the next transfer of a pass
                // often comes within the window, and waking this thread
                // after it slept costs more than the spin.
                while let Some(job) = next_job(&mut rx, hot::window()).await {
                    job.await;
                }
            })
        })?;
    Ok(tx)
}

/// How long the group's thread asks its queue in a tight loop between
/// yields while it has nothing else to run (GQ-2).
const PICKUP_SPIN: Duration = Duration::from_micros(20);

/// The group's next job (GQ-2), asked for with `try_recv` (tens of
/// nanoseconds) for up to the hot window, then awaited plainly. While
/// the group's runtime has no task of its own to run (the last job's
/// landing watch and acknowledgement have ended), the asks go on in a
/// tight loop for [`PICKUP_SPIN`] between yields; otherwise one ask per
/// yield, as the hot wait did. The hot wait's yield to the runtime after
/// every ask (its timer driver, its queues) left a job the control loop
/// queued 1.4-2.1 us before this thread took it, on both ends of every
/// small transfer (2xH100 and 2xH200 timelines). `window` is the hot
/// window (zero: a plain wait).
async fn next_job(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Job>,
    window: Duration,
) -> Option<Job> {
    use tokio::sync::mpsc::error::TryRecvError;
    if window.is_zero() {
        return hot(rx.recv()).await;
    }
    let metrics = tokio::runtime::Handle::current().metrics();
    let t0 = std::time::Instant::now();
    while t0.elapsed() < window {
        let spin_until =
            (metrics.num_alive_tasks() == 0).then(|| std::time::Instant::now() + PICKUP_SPIN);
        loop {
            match rx.try_recv() {
                Ok(job) => return Some(job),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) => {}
            }
            match spin_until {
                Some(until) if std::time::Instant::now() < until => std::hint::spin_loop(),
                _ => break,
            }
        }
        tokio::task::yield_now().await;
    }
    rx.recv().await
}

/// A collective group as an actor sees it (see [`group_memberships`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupMembership {
    /// The group.
    pub group: crate::runtime::GroupId,
    /// Its backend.
    pub backend: Transport,
    /// This actor's rank in it.
    pub rank: u32,
    /// How many members it has.
    pub size: usize,
}

/// The collective groups this worker's actor is a member of (see
/// [`ActorRuntime::group_memberships`]).
fn group_memberships(w: &WorkerShared) -> Vec<GroupMembership> {
    let mut v: Vec<GroupMembership> = w
        .groups
        .lock()
        .values()
        .map(|g| GroupMembership {
            group: crate::runtime::GroupId(g.spec.id),
            backend: g.backend,
            rank: g.spec.my_rank,
            size: g.spec.ranks.len(),
        })
        .collect();
    v.sort_by_key(|m| m.group.0);
    v
}

/// Runs `job` in `group`'s queue (XF-3), or returns why it cannot run
/// there (not a member: destroyed or never created; broken).
fn queue_in_group(
    shared: &WorkerShared,
    group: u64,
    job: Job,
) -> std::result::Result<(), (String, Job)> {
    let groups = shared.groups.lock();
    let Some(g) = groups.get(&group) else {
        return Err((
            format!("this worker is not in collective group {group} (destroyed, or never created)"),
            job,
        ));
    };
    if let Some(why) = &g.broken {
        return Err((format!("collective group {group} was aborted: {why}"), job));
    }
    g.queue.send(job).map_err(|e| {
        (
            format!("the queue of collective group {group} is closed"),
            e.0,
        )
    })
}

impl WorkerShared {
    /// WK-4: registers transfer `xfer`, whose abort handle `AbortTransfer`
    /// fires; run its work with [`until_aborted`].
    fn register_transfer(&self, xfer: u64) -> oneshot::Receiver<Error> {
        let (abort_tx, abort_rx) = oneshot::channel();
        self.transfers.lock().insert(xfer, abort_tx);
        abort_rx
    }

    /// The targets a `get_into` registered for `object`, taken (not
    /// cloned: 10 000 parameters are 10 000 clones); the getter keeps its
    /// own and copies into them if the receive does not take them.
    fn take_targets(&self, object: u64) -> Option<crate::targets::Registered> {
        self.targets.lock().remove(&object)
    }

    /// Where the receive of `object` puts its tensors (WK-7): the
    /// targets a `get_into` registered (`registered`), in the order the
    /// value (`data`) holds its tensors (TG-1), if they fit `metas` (of
    /// `layout`, as the head decoded here names it) and `transport` takes
    /// them.
    fn target_for(
        &self,
        object: u64,
        registered: crate::targets::Registered,
        data: &[u8],
        metas: &[rdt_transport::TensorMeta],
        layout: Option<u64>,
        transport: (Transport, &dyn rdt_transport::TensorTransport),
    ) -> Target {
        // TG-2: targets that do not match by key are received into
        // nothing of theirs; the getter reports why, with the key.
        let ts = match registered.resolve(object, data, metas.len(), &|i| metas.get(i).cloned()) {
            Ok(ts) => ts,
            Err(why) => {
                tracing::debug!(object, "received anywhere, the targets do not match: {why}");
                return Target::Any;
            }
        };
        let fitted = FittedTargets::of(&ts, layout, transport.0);
        if fitted.is_some() && *self.fitted.lock() == fitted {
            return Target::Tensors(ts);
        }
        let fit = crate::client::check_targets(object, metas, &ts)
            .map_err(|e| e.to_string())
            .and_then(|()| transport.1.receives_into(&ts));
        match fit {
            Ok(()) => {
                if fitted.is_some() {
                    *self.fitted.lock() = fitted;
                }
                Target::Tensors(ts)
            }
            Err(why) => {
                tracing::debug!(
                    object,
                    "received anywhere, then copied into the targets: {why}"
                );
                Target::Any
            }
        }
    }

    /// WK-13: a call that takes `refs` was received (counted before it is
    /// handed on).
    fn uses_begin(&self, refs: impl Iterator<Item = u64>) {
        let mut uses = self.arg_uses.lock();
        for r in refs {
            *uses.entry(r).or_default() += 1;
        }
    }

    /// WK-13: a call that took `refs` ended; the copies of `release` that
    /// no other call takes now come out of the store, to be dropped after
    /// the call's `CallDone` ([`drop_released`](Self::drop_released)).
    fn uses_end(&self, refs: &[u64], release: &[u64]) -> Vec<(u64, StoredValue)> {
        let mut uses = self.arg_uses.lock();
        for r in refs {
            if let std::collections::hash_map::Entry::Occupied(mut e) = uses.entry(*r) {
                *e.get_mut() -= 1;
                if *e.get() == 0 {
                    e.remove();
                }
            }
        }
        let mut out = Vec::new();
        for &r in release {
            if uses.contains_key(&r) || out.iter().any(|(id, _)| *id == r) {
                continue;
            }
            if let Some(v) = self.store.take_received(r) {
                out.push((r, v));
            }
        }
        out
    }

    /// Drops a value taken out of the store (a `Free`, or a call's
    /// release, WK-13). Dropping thousands of tensors, or unmapping tens
    /// of MiB, takes 0.2-1 ms, and every frame behind a `Free` waited (on
    /// the 2xH200 host a weights pass's delivery waited ~1 ms for the
    /// previous pass's free): large values go to the blocking pool,
    /// counted for WK-6; small ones are dropped here.
    fn drop_freed(&self, v: StoredValue) {
        if v.tensors.len() >= DROP_ASIDE_MIN || v.tensors.nbytes() >= DROP_ASIDE_BYTES {
            self.drops.drop_aside(v);
        }
    }

    /// Drops the values a call released (WK-13), as a `Free` would.
    fn drop_released(&self, released: Vec<(u64, StoredValue)>) {
        for (_, v) in released {
            self.drop_freed(v);
        }
    }

    /// A value received over `t`, counted, as it goes into the store.
    fn received_value(&self, t: Transport, data: Bytes, tensors: TensorList) -> Slot {
        *self.received.lock().entry(t).or_default() += 1;
        Slot::Ready(StoredValue {
            data,
            tensors: Arc::new(tensors),
            transport: t,
            produced: false,
        })
    }
}

static WORKER: OnceLock<Arc<WorkerShared>> = OnceLock::new();

/// A freed value with at least this many tensors is dropped on the
/// blocking pool, not in the control loop (a hand-off costs more than
/// dropping a few tensors).
const DROP_ASIDE_MIN: usize = 64;

/// ... or at least this many bytes.
const DROP_ASIDE_BYTES: usize = 1 << 20;

/// TG-4: `target` for a receive over `transport` (transfer `xfer`) into
/// targets a `get_into` registered (`landing`), with the gate the getter
/// closes when it is dropped. A transport that copies into the targets
/// does so through the gate; any other writes into them as the bytes come
/// (`nixl`, `nccl`, a user's own transport), so the getter's drop aborts
/// it. A getter gone already: received anywhere.
fn land_gated(
    target: Target,
    landing: &crate::targets::Landing,
    transport: &dyn rdt_transport::TensorTransport,
    xfer: u64,
) -> (
    Target,
    Option<Arc<rdt_transport::TargetGate>>,
    Option<rdt_transport::Writing>,
) {
    if !matches!(target, Target::Tensors(_)) {
        return (target, None, None);
    }
    let copies = transport.copies_into_targets();
    if !copies {
        // Noted before the gate is read: a getter dropped after the read
        // finds it and aborts the receive.
        *landing.in_place.lock() = Some(xfer);
    }
    // A receive that writes in place is the targets' writer until it ends
    // (`Targets::idle`; the transport counts what outlives it): counted
    // before the gate is read, so that a wait that begins after the drop
    // sees it.
    let writing = (!copies).then(|| landing.gate.writing());
    if !landing.gate.is_open() {
        return (Target::Any, None, None);
    }
    (target, Some(landing.gate.clone()), writing)
}

/// A registered target list found to fit a layout over a transport
/// (WK-7). A weight update registers the same list (a
/// [`Targets`](crate::Targets) the actor keeps) at every step, with a head
/// found among the recent ones (the same layout id: byte-identical
/// metadata). Nothing the check read can have changed: the list is shared
/// and never written, a tensor's dtype, shape and storage are fixed, and
/// the metadata is the same bytes. So the answer is the last one, and
/// 10 000 targets are not compared again. The weak reference keeps the
/// list's address from being taken by another list while this is kept.
#[derive(Debug)]
struct FittedTargets {
    targets: std::sync::Weak<[Tensor]>,
    layout: u64,
    transport: Transport,
}

impl FittedTargets {
    /// `None` for a head with no layout id (not decoded through
    /// `WireExported::get`).
    fn of(ts: &Arc<[Tensor]>, layout: Option<u64>, transport: Transport) -> Option<Self> {
        Some(FittedTargets {
            targets: Arc::downgrade(ts),
            layout: layout?,
            transport,
        })
    }
}

impl PartialEq for FittedTargets {
    fn eq(&self, other: &Self) -> bool {
        self.targets.ptr_eq(&other.targets)
            && self.layout == other.layout
            && self.transport == other.transport
    }
}

/// Freed values being dropped on the blocking pool (WK-6).
#[derive(Default)]
pub(crate) struct AsideDrops {
    pending: std::sync::atomic::AtomicUsize,
    settled: Notify,
}

impl AsideDrops {
    /// Drops `v` on the blocking pool, counted until it is gone.
    fn drop_aside<T: Send + 'static>(self: &Arc<Self>, v: T) {
        use std::sync::atomic::Ordering;
        self.pending.fetch_add(1, Ordering::AcqRel);
        let me = self.clone();
        drop(tokio::task::spawn_blocking(move || {
            drop(v);
            if me.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
                me.settled.notify_waiters();
            }
        }));
    }

    /// Resolves once every value counted so far is dropped (at once when
    /// none is pending: one atomic load). A drop always ends, so this
    /// needs no deadline of its own.
    pub(crate) async fn settled(&self) {
        use std::sync::atomic::Ordering;
        loop {
            let notified = self.settled.notified();
            tokio::pin!(notified);
            // Registered before the check, so a notification between the
            // check and the await is not lost.
            notified.as_mut().enable();
            if self.pending.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// This worker's shared state; `None` outside a worker.
pub(crate) fn shared() -> Option<Arc<WorkerShared>> {
    WORKER.get().cloned()
}

/// Inside an actor: waits until the local object store holds no reference
/// to `tensor`'s storage, i.e. until the owner table freed every object
/// that contained it (no driver ref and no pending call needs it). Returns
/// at once for tensors the store never held (values sent through the object
/// store are not kept by their producer).
pub async fn wait_tensor_freed(tensor: &Tensor) -> Result<()> {
    let Some(w) = WORKER.get() else {
        return Err(Error::Protocol(
            "wait_tensor_freed works inside an actor method; the driver holds no tensors in a store".into(),
        ));
    };
    w.store
        .wait_until(|s| (!s.holds_storage(tensor)).then_some(()))
        .await;
    Ok(())
}

impl WorkerShared {
    /// What this worker has counted (see [`ActorRuntime::metrics`]).
    fn metrics(&self) -> crate::metrics::WorkerMetrics {
        use std::sync::atomic::Ordering::Relaxed;
        crate::metrics::WorkerMetrics {
            local_objects: self.store.map.lock().len(),
            received: (self.received.lock().iter())
                .map(|(t, n)| (t.name().to_string(), *n))
                .collect(),
            straight_deliveries: self.peer.received(),
            received_in_place: self.in_place.load(Relaxed),
            receives_started_after_frames: self.started_after_frames.load(Relaxed),
            calls_handed_to_listener: self.handoff.queued(),
            receives_acknowledged_by_calls: self.acks_by_calls.load(Relaxed),
        }
    }
}

/// [`wait_tensor_freed`] with a deadline.
pub async fn wait_tensor_freed_timeout(tensor: &Tensor, deadline: Duration) -> Result<()> {
    tokio::time::timeout(deadline, wait_tensor_freed(tensor))
        .await
        .map_err(|_| Error::Timeout {
            what: "the tensor to be freed".into(),
            after_ms: deadline.as_millis() as u64,
        })?
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "localhost".into())
}

/// Connects to the driver, authenticates, says hello and waits for the
/// spawn order. Runs on the control runtime.
async fn join_driver(link: Link, secret: Vec<u8>, worker: u64) -> Result<Joined> {
    // Until the spawn order says otherwise, accept frames up to the
    // default limit.
    let max = crate::runtime::DEFAULT_MAX_FRAME;
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

/// The worker's two threads of control (invariant 3): the actor runs on
/// the actix system of the main thread; the control loop, deliveries and
/// sends run on a separate tokio runtime, so a method that blocks its
/// thread still lets transfers of objects it already produced go out.
fn worker_main<A: RdtActor>(start: WorkerStart) -> Result<()> {
    let WorkerStart { joined, control } = start;
    let Joined {
        tx,
        mut rx,
        order,
        secret,
        local_ip,
    } = joined;
    // Before any message that names a transport (ids, not names, travel).
    crate::transport::set_wire_table(&order.transports);
    let peer_secret = <[u8; 32]>::try_from(&secret[..]).ok();
    let tcp_bind = match (&order.tcp_bind, local_ip) {
        (Some(b), _) => b.clone(),
        (None, Some(ip)) => std::net::SocketAddr::new(ip, 0).to_string(),
        (None, None) => "127.0.0.1:0".to_string(),
    };
    let endpoints = crate::transport::configure_worker(crate::transport::WorkerTransportConfig {
        me: order.worker,
        secret,
        tcp_bind,
        transfer_timeout: Duration::from_millis(order.transfer_timeout_ms),
    });
    let boot_name: Arc<str> = order.name.clone().into();
    let heartbeat = order.heartbeat_ms.map(Duration::from_millis);
    let id_space = order.id_space;
    if let Some(us) = order.hot_window_us {
        hot::set_window(Duration::from_micros(us));
    }
    let args = order.args.clone();
    let handle = control.handle().clone();
    let sys = actix::System::new();
    sys.block_on(async move {
        let shared = Arc::new(WorkerShared {
            name: boot_name.clone(),
            store: Store::default(),
            tx: tx.clone(),
            transfers: Mutex::new(HashMap::new()),
            receiving: Mutex::new(HashMap::new()),
            received: Default::default(),
            groups: Mutex::new(HashMap::new()),
            landing: Mutex::new(HashMap::new()),
            handoff: Default::default(),
            drops: Arc::default(),
            local_refs: Default::default(),
            next_object: id_space.into(),
            watches: Mutex::new(HashMap::new()),
            next_req: 1.into(),
            actor: order.worker,
            self_calls: Mutex::new(Default::default()),
            probes: Mutex::new(HashMap::new()),
            targets: Mutex::new(HashMap::new()),
            fitted: Mutex::new(None),
            in_place: Default::default(),
            started_after_frames: Default::default(),
            acks_by_calls: Default::default(),
            ack_wait: ack_wait(Duration::from_millis(order.transfer_timeout_ms)),
            control: handle.clone(),
            readers: Mutex::new(HashMap::new()),
            arg_uses: Mutex::new(HashMap::new()),
            peer: peer::PeerDelivery::new(
                hostname(),
                &endpoints,
                peer_secret.unwrap_or_default(),
                order.max_frame,
                order.straight_large_values,
            ),
        });
        // PD-4: listening before the driver hears the actor exists.
        if let (Some(path), Some(_)) = (&order.peer_socket, peer_secret) {
            if let Err(e) = peer::listen(&shared, path, &handle) {
                tracing::warn!(
                    "cannot listen for straight deliveries on {path} ({e}); values for this actor go through the driver"
                );
            }
        }
        // Before the constructor: its argument may carry actor handles,
        // which read this worker's client.
        let _ = WORKER.set(shared.clone());
        let decoded =
            crate::client::reading_refs(Some(crate::client::Client::Actor(shared.clone())), || {
                postcard::from_bytes::<A::Args>(&args.bytes().unwrap_or_default())
            });
        let constructed = match decoded {
            Err(e) => Err(Error::Decode {
                what: format!("constructor argument of {}", A::NAME),
                message: e.to_string(),
            }),
            Ok(args) => match AssertUnwindSafe(A::__construct(args)).catch_unwind().await {
                Ok(Ok(a)) => Ok(a),
                Ok(Err(msg)) => Err(Error::Application {
                    actor: boot_name.to_string(),
                    method: "new".into(),
                    message: msg,
                    typed: None,
                }),
                Err(p) => Err(Error::Panic {
                    actor: boot_name.to_string(),
                    method: "new".into(),
                    message: panic_message(&p),
                }),
            },
        };
        let actor = match constructed {
            Ok(a) => a,
            Err(e) => {
                let _ = tx.send(&ToDriver::Spawned(Err(e)));
                // The driver kills us; until then, stay quiet.
                handle.spawn(async move {
                    while let Ok(Some(_)) = rx.recv::<ToWorker>().await {}
                    std::process::exit(1);
                });
                return futures::future::pending::<()>().await;
            }
        };
        // The mailbox is sized before the actor starts: calls may arrive
        // before `started` would run (invariant 2).
        let mut ctx = actix::Context::new();
        ctx.set_mailbox_capacity(host::MAILBOX);
        let addr = ctx.run(Host::<A>::new(actor, shared.clone()));
        let _ = tx.send(&ToDriver::Spawned(Ok(endpoints)));
        // CUDA IPC upkeep: close mappings of slabs their producer retired,
        // free retired slabs nobody maps any more. Only when there is
        // something to look at (never in a process that did not use CUDA
        // IPC), and on the blocking pool: freeing device memory may wait
        // for the GPU.
        // Then every transport's own upkeep (shm: mappings of memfds their
        // producer freed), in the same trip to the blocking pool: it may
        // unmap large files.
        handle.spawn(async {
            use rdt_transport::cuda::ipc;
            let mut tick = tokio::time::interval(rdt_transport::transport::HOUSEKEEPING_PERIOD);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let _ = tokio::task::spawn_blocking(|| {
                    if ipc::housekeeping_due() {
                        ipc::housekeeping();
                    }
                    for t in Transport::registered() {
                        if let Some(inst) = t.existing_instance() {
                            inst.housekeeping();
                        }
                    }
                })
                .await;
            }
        });
        handle.spawn(async move {
            let code = match control_loop(&mut rx, addr, shared, heartbeat).await {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("rdt worker {boot_name}: {e}");
                    1
                }
            };
            // Invariant 5: the driver is gone.
            std::process::exit(code);
        });
        futures::future::pending::<()>().await
    });
    drop(control);
    Ok(())
}

async fn control_loop<A: RdtActor>(
    rx: &mut protocol::Receiver<protocol::ReadHalf>,
    addr: Addr<Host<A>>,
    shared: Arc<WorkerShared>,
    heartbeat: Option<Duration>,
) -> Result<()> {
    let tx = shared.tx.clone();
    // Receives that start here once the frames already read are handled
    // (`ReceiveStart::AfterFramesInHand`): the call behind a delivery is
    // in the actor's mailbox before its READ is posted.
    // A steady stream of frames does not hold them back for long: they
    // start after at most this many frames.
    const MOST_FRAMES_AHEAD: usize = 16;
    let mut after_frames_in_hand: Vec<Job> = Vec::new();
    let mut frames_ahead = 0;
    loop {
        if !after_frames_in_hand.is_empty() {
            frames_ahead += 1;
            if frames_ahead > MOST_FRAMES_AHEAD || !rx.has_whole_frame() {
                frames_ahead = 0;
                shared.started_after_frames.fetch_add(
                    after_frames_in_hand.len() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                rdt_transport::cuda::timeline("frames in hand handled", 0);
                for job in after_frames_in_hand.drain(..) {
                    run_now_or_spawn(job);
                }
            }
        }
        // Hot (rdt_transport::hot): the next message of a pass often comes
        // within the window; waking this thread after it slept costs more.
        let next = match heartbeat {
            None => hot(rx.recv::<ToWorker>()).await,
            // recv is cancel-safe: a frame in progress stays buffered.
            Some(hb) => {
                // HB-1: bytes of a frame still arriving are a live driver;
                // and while one arrives, the driver's pings wait behind it,
                // so this worker says it is alive itself (an unasked
                // `Pong` is only that).
                let (mut seen, mut quiet) = (rx.bytes_read(), tokio::time::Instant::now());
                loop {
                    match tokio::time::timeout(hb / 4, hot(rx.recv::<ToWorker>())).await {
                        Ok(m) => break m,
                        Err(_) if rx.bytes_read() != seen => {
                            seen = rx.bytes_read();
                            quiet = tokio::time::Instant::now();
                            tx.send(&ToDriver::Pong)?;
                        }
                        Err(_) if quiet.elapsed() > hb => {
                            return Err(Error::Protocol(format!(
                                "the driver went silent for {hb:?} (network cut?); exiting"
                            )))
                        }
                        Err(_) => {}
                    }
                }
            }
        };
        let msg = match next {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(()),
            Err(e) => return Err(e),
        };
        match msg {
            ToWorker::Call(call) => {
                // The actor replies itself, from its own thread (no hop back
                // here); a full or closed mailbox fails the call at once.
                let result = call.result;
                rdt_transport::cuda::timeline("call received", call.call);
                // WK-13: counted before the hand-off, so that a call
                // ending meanwhile keeps the copies this one takes.
                shared.uses_begin(call.ref_args());
                // PD-1: orders to deliver its value straight are taken
                // from now until it finishes.
                let straight = call.transport.sidedness() != Sidedness::TwoSided;
                if straight {
                    shared.peer.open_call(result);
                }
                // To the actor's thread: queued for it while it listens
                // after a call (no wake-up to pay here, before a READ
                // the call waits for), else through its mailbox.
                handoff::hand_over(&shared, &addr, call);
                rdt_transport::cuda::timeline("call handed over", result);
            }
            ToWorker::Deliver { object, value } => {
                if let Ok(d) = &value {
                    rdt_transport::cuda::timeline("deliver received", d.xfer);
                }
                if let Some(job) = on_deliver(&shared, object, value) {
                    after_frames_in_hand.push(job);
                }
            }
            ToWorker::DeliverTo { object, xfer, to } => peer::order(&shared, object, xfer, to),
            ToWorker::SendTo {
                object,
                xfer,
                to,
                group,
            } => {
                rdt_transport::cuda::timeline("send order received", xfer);
                on_send(&shared, object, xfer, to, group)
            }
            ToWorker::PrepareGroup { backend, spec } => on_prepare_group(&shared, backend, spec),
            ToWorker::CreateGroup { backend, spec } => on_create_group(&shared, backend, spec),
            ToWorker::DestroyGroup { group } => {
                let g = shared.groups.lock().remove(&group);
                let tx = tx.clone();
                tokio::spawn(async move {
                    let result = match g {
                        // Dropping the queue ends its thread once it drained.
                        Some(g) => match g.backend.instance() {
                            Ok(inst) => inst.destroy_group(group).await.map_err(Error::from),
                            Err(e) => Err(e),
                        },
                        None => Ok(()),
                    };
                    let _ = tx.send(&ToDriver::GroupDestroyed { group, result });
                });
            }
            ToWorker::AbortGroup { group, reason } => {
                if let Some(g) = shared.groups.lock().get_mut(&group) {
                    g.broken = Some(reason.clone());
                    if let Some(inst) = g.backend.existing_instance() {
                        inst.abort_group(group, &reason);
                    }
                }
            }
            ToWorker::AbortTransfer {
                object,
                xfer,
                error,
            } => match shared.transfers.lock().remove(&xfer) {
                Some(abort) => {
                    tracing::debug!(xfer, object, "transfer aborted: {error}");
                    let _ = abort.send(error);
                }
                // Not received, not receiving: a straight delivery that
                // has not come (PD-5; a delivery from the driver comes
                // before its abort on this connection, and a finished
                // receive stored its value or error before its Free).
                None if shared.store.get(object).is_none()
                    && !shared.receiving.lock().contains_key(&object)
                    && shared.peer.give_up(xfer) =>
                {
                    tracing::debug!(xfer, object, "straight delivery given up: {error}");
                    shared.store.insert(object, Slot::Failed(error));
                }
                None => tracing::trace!(xfer, object, "abort of a finished transfer"),
            },
            ToWorker::PeerGone { actor } => {
                shared.peer.peer_gone(actor);
                for t in Transport::registered() {
                    if let Some(inst) = t.existing_instance() {
                        inst.peer_gone(actor);
                    }
                }
            }
            ToWorker::Free { object } => {
                rdt_transport::cuda::timeline("free start", object);
                if let Some(freed) = shared.receiving.lock().get_mut(&object) {
                    // Tombstone (WK-3): the receive in flight drops its data.
                    *freed = true;
                }
                if let Some(Slot::Ready(v)) = shared.store.remove(object) {
                    if v.produced {
                        if let Ok(t) = v.transport.instance() {
                            tokio::spawn(async move {
                                if let Err(e) = t.release(object).await {
                                    tracing::warn!("releasing object {object}: {e}");
                                }
                            });
                        }
                    }
                    shared.drop_freed(v);
                }
                rdt_transport::cuda::timeline("free done", object);
            }
            ToWorker::Fetch { object, req } => {
                // Captured here, in order (a later Free cannot overtake it);
                // packed on the blocking pool (device-to-host copies).
                let slot = shared.store.get(object);
                let tx = tx.clone();
                tokio::task::spawn_blocking(move || {
                    let result = match slot {
                        // The driver reads refs in it itself (the object's
                        // entry holds them).
                        Some(Slot::Ready(v)) => inline_value(
                            rdt_transport::value::Payload {
                                data: v.data,
                                tensors: Arc::unwrap_or_clone(v.tensors).into_vec(),
                            },
                            Vec::new(),
                        ),
                        Some(Slot::Failed(e)) => Err(e),
                        None => Err(Error::Freed { object }),
                    };
                    if let Err(e) = tx.send(&ToDriver::Fetched { req, result }) {
                        let _ = tx.send(&ToDriver::Fetched {
                            req,
                            result: Err(e),
                        });
                    }
                });
            }
            ToWorker::Settled { req, result } => {
                if let Some(w) = shared.watches.lock().remove(&req) {
                    let _ = w.send(result);
                }
            }
            ToWorker::Probed { req, state } => {
                if let Some(p) = shared.probes.lock().remove(&req) {
                    let _ = p.send(state);
                }
            }
            ToWorker::Ping => tx.send(&ToDriver::Pong)?,
            ToWorker::Shutdown => std::process::exit(0),
            ToWorker::Spawn(_) => tracing::warn!("second spawn order ignored"),
        }
    }
}

/// Takes a delivery: through-driver values are stored, direct receives
/// start where their transport says (`ReceiveStart`). Returns the receive
/// the loop starts itself once the frames in hand are handled.
#[must_use = "a receive returned here starts only when its caller runs it"]
fn on_deliver(
    shared: &Arc<WorkerShared>,
    object: u64,
    value: std::result::Result<Delivery, Error>,
) -> Option<Job> {
    let mut d = match value {
        Err(e) => {
            shared.store.insert(object, Slot::Failed(e));
            return None;
        }
        Ok(d) => d,
    };
    let xfer = d.xfer;
    let t = d.value.transport;
    let transport = match t.instance().map(|i| (t, i)) {
        Ok(t) => t,
        Err(e) => {
            if xfer != 0 {
                let _ = shared.tx.send(&ToDriver::Received {
                    object,
                    xfer,
                    result: Err(e.clone()),
                });
            }
            shared.store.insert(object, Slot::Failed(e));
            return None;
        }
    };
    if transport.1.sidedness() == Sidedness::ThroughDriver {
        if xfer != 0 {
            on_deliver_straight_inline(shared, object, transport.0, d.value, xfer);
        } else {
            on_deliver_inline(shared, object, transport.0, d.value);
        }
        return None;
    }
    rdt_transport::cuda::timeline("deliver transport found", xfer);
    // WK-4: the receive runs until done, failed or aborted by the driver;
    // its end is acknowledged exactly once (XF-5).
    let abort = shared.register_transfer(xfer);
    shared.receiving.lock().insert(object, false);
    rdt_transport::cuda::timeline("deliver transfer registered", xfer);
    let worker = shared.clone();
    let from = d.from.take().unwrap_or_else(|| Peer {
        actor: 0,
        name: "driver".into(),
        host: String::new(),
        endpoint: String::new(),
    });
    let span = tracing::debug_span!(
        "transfer",
        xfer,
        object,
        transport = transport.0.name(),
        peer = %from.name,
        bytes = d.value.exported.nbytes(),
        side = "receive",
    );
    let group = d.group;
    let ack_at_landing = d.ack_at_landing;
    // Asked only where the head is here already (a large one may still be
    // arriving, cut-through); decoded here, the job finds it decoded.
    let start = match group {
        Some(_) => ReceiveStart::Task,
        None if !d.value.exported.head_is_here() => ReceiveStart::Task,
        None => d
            .value
            .exported
            .get()
            .map_or(ReceiveStart::Task, |e| transport.1.receive_start(e)),
    };
    rdt_transport::cuda::timeline("deliver start chosen", xfer);
    let job = Box::pin(
        async move {
            rdt_transport::cuda::timeline("receive job start", xfer);
            let t0 = std::time::Instant::now();
            let shared = worker;
            // The receive and the acknowledgement are boxed on their own:
            // inline, they made this task 1 432 bytes, a request that glibc
            // serves only after consolidating its fastbins (1.5 µs of a
            // small `nixl` pass on the control loop, before the READ's
            // post, in the 2xH200 timelines of session 42); the task (672
            // bytes) and each box stay under 1 KiB, which the thread's
            // cache serves.
            let receive = Box::pin(async {
                // Tests keep a receive in flight.
                #[cfg(feature = "failpoints")]
                fail::fail_point!("rdt::receive");
                d.value.exported.head_arrived().await?;
                rdt_transport::cuda::timeline("receive head here", xfer);
                let exported = d.value.exported.get()?;
                rdt_transport::cuda::timeline("receive exported decoded", xfer);
                // Targets are ordered by the value's bytes (TG-1), which
                // may still be arriving: they come before the receive
                // writes into anything.
                let (target, gate, _writing) = match shared.take_targets(object) {
                    None => (Target::Any, None, None),
                    Some(registered) => {
                        let landing = registered.landing.clone();
                        let target = match d.value.data.arrived().await {
                            Ok(data) => shared.target_for(
                                object,
                                registered,
                                &data,
                                &exported.metas,
                                d.value.exported.layout(),
                                (transport.0, transport.1.as_ref()),
                            ),
                            Err(_) => Target::Any,
                        };
                        land_gated(target, &landing, transport.1.as_ref(), xfer)
                    }
                };
                let cx = rdt_transport::TransferCtx {
                    xfer,
                    group,
                    target,
                    gate,
                    layout: d.value.exported.layout(),
                    first_reader: Some(shared.first_reader(object)),
                };
                rdt_transport::cuda::timeline("receive target chosen", xfer);
                let tensors = transport
                    .1
                    .receive_list(&from, &cx, exported)
                    .await
                    .map_err(Error::from)?;
                rdt_transport::cuda::timeline("receive returned", xfer);
                // The non-tensor part, large enough to stream, may still
                // be arriving.
                let data = d.value.data.arrived().await.map_err(|e| {
                    Error::Transport(rdt_transport::TransportError::new(
                        transport.0.name(),
                        format!("the value's data did not arrive whole: {e}"),
                    ))
                })?;
                Ok::<_, Error>((data, tensors))
            });
            let received = until_aborted(&shared, xfer, abort, receive).await;
            rdt_transport::cuda::timeline("receive ended", xfer);
            let (data, received) = match received {
                Ok((data, tensors)) => (data, Ok(tensors)),
                Err(e) => (Bytes::new(), Err(e)),
            };
            let ack = match &received {
                Ok(_) => Ok(()),
                Err(e) => Err(e.clone()),
            };
            // A stream-ordered receive returned before its bytes landed
            // (the method may start; its kernels wait on the GPU): the
            // acknowledgement waits for the landing (XF-5).
            let landing: Option<Landed> = received
                .as_ref()
                .ok()
                .and_then(|_| transport.1.landed(xfer))
                .map(|l| Landed {
                    landing: l.shared(),
                    xfer,
                    ack: Arc::default(),
                });
            // WK-5: known before the value is stored, so that a call that
            // takes the value also finds the landing to wait for.
            if let Some(l) = &landing {
                shared.landing.lock().insert(object, l.clone());
            }
            rdt_transport::cuda::timeline("receive landing noted", xfer);
            {
                // Held across the store insert: a `Free` either finds the
                // receive and leaves a tombstone, or finds the value stored.
                let mut receiving = shared.receiving.lock();
                let freed = receiving.remove(&object).unwrap_or(false);
                let slot = match received {
                    Ok(tensors) => {
                        tracing::debug!(micros = t0.elapsed().as_micros() as u64, "received");
                        shared.received_value(transport.0, data, tensors)
                    }
                    Err(e) => {
                        tracing::debug!("receive failed: {e}");
                        Slot::Failed(e)
                    }
                };
                // TG-4: a receive its getter gave up leaves nothing: the
                // driver delivers again to whatever else needs it here.
                let cancelled = matches!(slot, Slot::Failed(Error::Cancelled { .. }));
                if !freed && !cancelled {
                    shared.store.insert(object, slot);
                }
                rdt_transport::cuda::timeline("receive stored", xfer);
            }
            // The acknowledgement comes after the value is stored, off the
            // path of the call waiting for it; a call that ran with it
            // settles the receive in the driver first (XF-5).
            let landed_already = landing.is_none();
            let acknowledge = Box::pin(async move {
                let ack = match landing {
                    None => ack,
                    Some(l) => {
                        let landed = l.landing.clone().await.map_err(Error::from);
                        if let Err(e) = &landed {
                            // The bytes never all arrived: a call that has
                            // not taken the value yet fails instead.
                            shared.store.fail_received(object, e.clone());
                        }
                        shared.landing.lock().remove(&object);
                        // WK-9: a call that took the value acknowledges
                        // with its `CallDone` (no second frame, written
                        // beside the reply on the same connection)...
                        if !l.take_ack() {
                            // ...unless its method runs on: then the
                            // acknowledgement goes now, well before the
                            // transfer deadline (a failed landing is the
                            // call's to report, with `Dependency`).
                            if landed.is_err() || l.call_ended() {
                                return;
                            }
                            if ack_at_landing {
                                // OW-15: the driver holds the consumer's
                                // next large send until this lands.
                                let _ = shared.tx.send(&ToDriver::Received {
                                    object,
                                    xfer,
                                    result: landed.and(ack),
                                });
                                return;
                            }
                            let bounded = {
                                let shared = shared.clone();
                                async move {
                                    tokio::time::sleep(shared.ack_wait).await;
                                    if !l.call_ended() {
                                        let _ = shared.tx.send(&ToDriver::Received {
                                            object,
                                            xfer,
                                            result: landed.and(ack),
                                        });
                                    }
                                }
                            };
                            // WK-12: the wait (up to 10 ms, behind almost
                            // every small pass, whose call took the value
                            // before it landed) sleeps on the control
                            // runtime, not on the group's: a group runtime
                            // with no task of its own takes its next job in
                            // a tight loop (GQ-2).
                            shared.control.spawn(bounded.in_current_span());
                            return;
                        }
                        landed.and(ack)
                    }
                };
                // Sent now, not held for the call's `CallDone`
                // (`send_soon`): tried on one H200, that cost a wake-up of
                // the writer task per receive (cached `cuda_ipc` hand-off
                // 63.5-68.4 -> 71.0-72.2 µs), and a driver that heard
                // nothing during a long read had left its hot window when
                // the reply came (+75 µs). Tried again on 2xH200 for small
                // nixl reads only, with the `CallDone` written ahead of the
                // held acknowledgement (`6e37ce6`, `6874524`): a 4 KiB pass
                // took 53.8-59.7 µs against 53.2-54.0 µs sent now,
                // alternating in one run.
                let _ = shared.tx.send(&ToDriver::Received {
                    object,
                    xfer,
                    result: ack,
                });
                transport.1.after_receive();
            });
            if landed_already {
                acknowledge.await;
            } else {
                // Off the group's queue: the next transfer is enqueued
                // while these bytes still move.
                tokio::spawn(acknowledge.in_current_span());
            }
        }
        .instrument(span),
    );
    rdt_transport::cuda::timeline("deliver job made", xfer);
    match start {
        ReceiveStart::Now => run_now_or_spawn(job),
        ReceiveStart::AfterFramesInHand => return Some(job),
        ReceiveStart::Task => run_transfer(shared, group, job, xfer),
    }
    None
}

/// Runs `job` here, on the control loop, up to its first wait, and spawns
/// the rest as a task (polled again at once there, with a real waker).
/// For a receive that does not wait (`ReceiveStart::Now`), that is all
/// of it: the value is stored before the loop reads its next frame.
fn run_now_or_spawn(mut job: Job) {
    let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
    if job.as_mut().poll(&mut cx).is_pending() {
        tokio::spawn(job);
    }
}

/// Stores a value delivered through the driver. One whose large blobs
/// are still arriving (cut-through) is stored by a task once they are all
/// in, unless the value was freed meanwhile (the same tombstone as a
/// receive, WK-3); calls that need it wait in the store.
fn on_deliver_inline(
    shared: &Arc<WorkerShared>,
    object: u64,
    t: Transport,
    value: crate::protocol::WireValue,
) {
    let slot = move |shared: &WorkerShared, got: Result<(Bytes, Vec<Tensor>)>| match got {
        Ok((data, tensors)) => shared.received_value(t, data, tensors.into()),
        Err(e) => Slot::Failed(e),
    };
    let mut unpacking = Box::pin(async move { unpack_inline(&value).await });
    // All here: stored at once, with no task and no tombstone.
    if let Some(got) = (&mut unpacking).now_or_never() {
        return shared.store.insert(object, slot(shared, got));
    }
    shared.receiving.lock().insert(object, false);
    let shared = shared.clone();
    tokio::spawn(async move {
        let slot = slot(&shared, unpacking.await);
        let mut receiving = shared.receiving.lock();
        if !receiving.remove(&object).unwrap_or(false) {
            shared.store.insert(object, slot);
        }
    });
}

/// A value through the driver that its producer delivered straight (OW-9,
/// PD-2): received as the driver's delivery is, against the transfer's
/// abort, then acknowledged (the driver holds the copy as receiving until
/// then). If its bytes do not all come (the producer died mid-send, its
/// link broke), nothing is stored: the driver, which holds the value
/// itself, delivers it again, or its error (OW-11). An abort (the
/// deadline, the consumer's own death) fails the call, as for any
/// transfer.
fn on_deliver_straight_inline(
    shared: &Arc<WorkerShared>,
    object: u64,
    t: Transport,
    value: crate::protocol::WireValue,
    xfer: u64,
) {
    let abort = shared.register_transfer(xfer);
    shared.receiving.lock().insert(object, false);
    let shared = shared.clone();
    tokio::spawn(async move {
        let unpack = async {
            // Tests make the value fail to arrive whole here.
            #[cfg(feature = "failpoints")]
            if fail::eval("rdt::straight_inline_receive", |_| ()).is_some() {
                return Err(Error::Protocol(
                    "failpoint rdt::straight_inline_receive".into(),
                ));
            }
            unpack_inline(&value).await
        };
        let (slot, ack) = tokio::select! {
            got = unpack => match got {
                Ok((data, tensors)) => (Some(shared.received_value(t, data, tensors.into())), Ok(())),
                Err(e) => (None, Err(e)),
            },
            e = abort => {
                let e = e.unwrap_or(Error::Shutdown);
                (Some(Slot::Failed(e.clone())), Err(e))
            }
        };
        shared.transfers.lock().remove(&xfer);
        {
            let mut receiving = shared.receiving.lock();
            let freed = receiving.remove(&object).unwrap_or(false);
            if let (Some(slot), false) = (slot, freed) {
                shared.store.insert(object, slot);
            }
        }
        // Tests hold the acknowledgement back (past the deadline).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("rdt::straight_ack");
        let _ = shared.tx.send(&ToDriver::Received {
            object,
            xfer,
            result: ack,
        });
    });
}

/// The data and tensors of a value through the driver, once its bytes are
/// in; a CUDA tensor still arriving is copied to its device step by step
/// as its bytes land (`object_store::unpack_arriving`).
pub(crate) async fn unpack_inline(v: &crate::protocol::WireValue) -> Result<(Bytes, Vec<Tensor>)> {
    v.exported.head_arrived().await?;
    let tensors = object_store::unpack_arriving(v.exported.get()?).await?;
    v.arrived().await?;
    Ok((v.data_bytes()?, tensors))
}

/// Runs a transfer's `work` until it ends or its abort handle fires, then
/// forgets the transfer (WK-4).
async fn until_aborted<T>(
    shared: &WorkerShared,
    xfer: u64,
    abort: oneshot::Receiver<Error>,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let r = tokio::select! {
        r = work => r,
        e = abort => Err(e.unwrap_or(Error::Shutdown)),
    };
    shared.transfers.lock().remove(&xfer);
    r
}

/// Runs a transfer's job: in its group's queue for a transfer in a group
/// (XF-3), on the control runtime otherwise. A job that cannot be queued
/// fails its transfer at once.
fn run_transfer(
    shared: &Arc<WorkerShared>,
    group: Option<rdt_transport::GroupRef>,
    job: Job,
    xfer: u64,
) {
    let Some(g) = group else {
        tokio::spawn(job);
        return;
    };
    rdt_transport::cuda::timeline("transfer job queued", xfer);
    if let Err((why, job)) = queue_in_group(shared, g.id, job) {
        // The job runs at once and meets its abort: a receive is
        // acknowledged as failed, a send reported, by the usual paths.
        if let Some(abort) = shared.transfers.lock().remove(&xfer) {
            let _ = abort.send(Error::Group(why));
        }
        tokio::spawn(job);
    }
}

/// Rank 0 of a new group (XF-2): the backend makes what every member joins
/// with (NCCL: the unique id), and the driver hears back either way.
fn on_prepare_group(shared: &Arc<WorkerShared>, backend: String, spec: rdt_transport::GroupSpec) {
    let tx = shared.tx.clone();
    tokio::spawn(async move {
        let made = async {
            let t: Transport = backend.parse()?;
            Ok::<_, Error>(t.instance()?.group_bootstrap(&spec).await?)
        };
        let result = made.await;
        let _ = tx.send(&ToDriver::GroupPrepared {
            group: spec.id,
            result,
        });
    });
}

/// Joins a collective group (XF-2): the backend sets up its part, the
/// group's queue starts, and the driver hears back either way.
fn on_create_group(shared: &Arc<WorkerShared>, backend: String, spec: rdt_transport::GroupSpec) {
    let shared = shared.clone();
    tokio::spawn(async move {
        let group = spec.id;
        let joined = async {
            let t: Transport = backend.parse()?;
            let inst = t.instance()?;
            inst.create_group(&spec).await?;
            let queue = start_group_queue(group)?;
            shared.groups.lock().insert(
                group,
                WorkerGroup {
                    backend: t,
                    spec: spec.clone(),
                    queue,
                    broken: None,
                },
            );
            Ok::<(), Error>(())
        };
        let result = joined.await;
        let _ = shared.tx.send(&ToDriver::GroupReady { group, result });
    });
}

/// A send order: the tensors are taken from the store here, in the
/// control loop's order (WK-2: a `Free` processed after this order cannot
/// pull them away; one processed before it makes the send fail at once,
/// and the driver aborts the receive).
fn on_send(
    shared: &Arc<WorkerShared>,
    object: u64,
    xfer: u64,
    to: Peer,
    group: Option<rdt_transport::GroupRef>,
) {
    let captured = match shared.store.get(object) {
        Some(Slot::Ready(v)) => v.transport.instance().map(|t| (t, v)),
        Some(Slot::Failed(e)) => Err(e),
        None => Err(Error::Freed { object }),
    };
    let (t, v) = match captured {
        Ok(c) => c,
        Err(e) => {
            let _ = shared.tx.send(&ToDriver::TransferFailed {
                object,
                xfer,
                peer: to.actor,
                transport: None,
                message: format!("the producer cannot send object {object}: {e}"),
            });
            return;
        }
    };
    let abort = shared.register_transfer(xfer);
    let worker = shared.clone();
    let span = tracing::debug_span!(
        "transfer",
        xfer,
        object,
        transport = v.transport.name(),
        peer = %to.name,
        side = "send",
    );
    let job = Box::pin(
        async move {
            let cx = rdt_transport::TransferCtx {
                group,
                ..rdt_transport::TransferCtx::new(xfer)
            };
            #[cfg(feature = "failpoints")]
            let injected = fail::eval("rdt::send", |m| m.unwrap_or_else(|| "injected".into()));
            #[cfg(not(feature = "failpoints"))]
            let injected: Option<String> = None;
            let shared = worker;
            let send = async {
                match injected {
                    Some(m) => Err(Error::Protocol(format!("failpoint rdt::send: {m}"))),
                    None => t.send(&to, &cx, &v.tensors).await.map_err(Error::from),
                }
            };
            if let Err(e) = until_aborted(&shared, xfer, abort, send).await {
                tracing::debug!("send failed: {e}");
                let _ = shared.tx.send(&ToDriver::TransferFailed {
                    object,
                    xfer,
                    peer: to.actor,
                    transport: Some(v.transport),
                    message: e.to_string(),
                });
            }
        }
        .instrument(span),
    );
    run_transfer(shared, group, job, xfer);
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GQ-2: the group's thread takes its jobs in the order queued,
    /// whether it spins alone, spins beside a task of its own, or waits
    /// plainly past the window, and sees the queue close.
    #[test]
    fn the_group_thread_takes_jobs_in_order_and_sees_the_queue_close() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let job = |n: u32| -> Job {
            let ran = ran.clone();
            Box::pin(async move { ran.lock().push(n) })
        };
        let sender = std::thread::spawn({
            let (j1, j2, j3, j4) = (job(1), job(2), job(3), job(4));
            move || {
                tx.send(j1).unwrap();
                std::thread::sleep(Duration::from_millis(1));
                tx.send(j2).unwrap();
                std::thread::sleep(Duration::from_millis(5));
                tx.send(j3).unwrap();
                // Past the window: the plain wait takes it.
                std::thread::sleep(Duration::from_millis(40));
                tx.send(j4).unwrap();
            }
        });
        let taken = rt.block_on(async {
            tokio::time::timeout(Duration::from_secs(10), async {
                // A task of the runtime's own, alive for a while: asks
                // once per yield meanwhile.
                tokio::spawn(tokio::time::sleep(Duration::from_millis(3)));
                let mut n = 0;
                while let Some(job) = next_job(&mut rx, Duration::from_millis(20)).await {
                    job.await;
                    n += 1;
                }
                n
            })
            .await
            .expect("deadline")
        });
        sender.join().unwrap();
        assert_eq!(taken, 4);
        assert_eq!(*ran.lock(), vec![1, 2, 3, 4]);
    }
}
