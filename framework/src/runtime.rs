//! The driver: [`Runtime`], worker processes, the control connections.
//!
//! # Invariants
//! 1. Every worker is spawned from a *reaper thread* that lives exactly as
//!    long as the worker and waits for its exit. The worker asks the kernel
//!    for SIGKILL when that thread (hence the driver) dies
//!    (`PR_SET_PDEATHSIG`), and it exits when its control connection closes:
//!    workers never outlive the driver, whether it returns, panics or is
//!    killed.
//! 2. The driver-side state (owner table, actors, pending calls) sits behind
//!    one mutex that is never held across an `.await`; sends under it only
//!    queue frames, in the order decided under it, and the socket writes
//!    happen once it is released (`Inner::lock`,
//!    `protocol::defer_writes`): no thread waits on it for a system call.
//! 3. A worker's death (connection end) fails its pending calls, its spawn,
//!    its fetches and its objects at once (see `owner` invariant 4).
//! 4. Background tasks hold the runtime weakly, so dropping the last
//!    `Runtime` and `ObjectRef` kills the workers (`ChildGuard`).

use std::borrow::Borrow;
use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::protocol::inline_value;
use parking_lot::Mutex;
use rdt_transport::hot::{self, hot};
use rdt_transport::object_store;
use rdt_transport::{Blob, Target};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::UnixListener;
use tokio::sync::{oneshot, watch};

use crate::actor::Actor;
use crate::error::{Error, Result};
use crate::ids::{ActorId, GroupId};
use crate::owner::{actor_name, ActorInfo, Actors, GroupLookup, ObjState, OwnerTable};
use crate::protocol::boot::{env as wenv, DEFAULT_MAX_FRAME};
use crate::protocol::{
    self, CallMsg, SubmitMsg, ToDriver, ToWorker, WireArg, WireExported, WireValue,
};
use crate::refs::client::ArgOut;
use crate::refs::client::{Client, SharedClient};
use crate::refs::object_ref::{ObjectRef, RawHandle};
use crate::transport::Transport;

/// Settings of a runtime. `Runtime::start()` uses the defaults.
#[derive(Clone, Debug)]
pub struct RuntimeBuilder {
    spawn_timeout: Duration,
    max_frame_bytes: usize,
    shutdown_grace: Duration,
    tcp_bind: Option<String>,
    transfer_timeout: Duration,
    listen: Option<String>,
    heartbeat_timeout: Duration,
    tls: Option<(Vec<u8>, Vec<u8>)>,
    hot_window: Option<Duration>,
    peer_delivery: bool,
    straight_large_values: Option<bool>,
    large_transfer_bytes: usize,
}

impl Default for RuntimeBuilder {
    fn default() -> Self {
        RuntimeBuilder {
            spawn_timeout: Duration::from_secs(60),
            max_frame_bytes: DEFAULT_MAX_FRAME,
            shutdown_grace: Duration::from_secs(5),
            tcp_bind: None,
            transfer_timeout: Duration::from_secs(120),
            listen: None,
            heartbeat_timeout: Duration::from_secs(10),
            tls: None,
            hot_window: None,
            peer_delivery: crate::env::var("RDT_PEER_DELIVERY").map_or(true, |v| v.trim() != "0"),
            straight_large_values: None,
            large_transfer_bytes: crate::env::var("RDT_LARGE_TRANSFER_BYTES")
                .ok()
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(crate::owner::DEFAULT_LARGE_TRANSFER_BYTES),
        }
    }
}

impl RuntimeBuilder {
    /// How long a worker may take to start, join and construct its actor
    /// (default 60 s).
    pub fn spawn_timeout(mut self, d: Duration) -> Self {
        self.spawn_timeout = d;
        self
    }
    /// Largest control frame accepted or sent (default 8 GiB). Values sent
    /// through the object store must fit in one frame.
    pub fn max_frame_bytes(mut self, n: usize) -> Self {
        self.max_frame_bytes = n;
        self
    }
    /// How long `shutdown` waits for workers to exit before killing them
    /// (default 5 s).
    pub fn shutdown_grace(mut self, d: Duration) -> Self {
        self.shutdown_grace = d;
        self
    }

    /// Address the workers' `tcp` transport listens on (default
    /// `127.0.0.1:0`: loopback, any port). Give a routable address for
    /// workers on other hosts.
    pub fn tcp_bind(mut self, addr: impl Into<String>) -> Self {
        self.tcp_bind = Some(addr.into());
        self
    }
    /// Also accept workers started by hand (`BINARY --rdt-connect
    /// HOST:PORT` with `RDT_TOKEN` set to [`Runtime::join_token`]) on this
    /// TCP address, as Slurm, Kubernetes or mpirun would start them. Off by
    /// default; give a loopback or private address unless you mean
    /// otherwise.
    pub fn listen(mut self, addr: impl Into<String>) -> Self {
        self.listen = Some(addr.into());
        self
    }
    /// Encrypt the control connections of workers started by hand with TLS
    /// (rustls), presenting this PEM certificate chain and private key.
    /// Workers then need `RDT_TLS_CA` (or `--rdt-tls-ca PATH`) naming a PEM
    /// file they trust for it. The runtime secret is still proven inside
    /// the encrypted stream.
    pub fn tls(mut self, cert_chain_pem: impl Into<Vec<u8>>, key_pem: impl Into<Vec<u8>>) -> Self {
        self.tls = Some((cert_chain_pem.into(), key_pem.into()));
        self
    }
    /// A remote worker silent for this long is declared dead (default
    /// 10 s; the driver pings every quarter of it).
    pub fn heartbeat_timeout(mut self, d: Duration) -> Self {
        self.heartbeat_timeout = d;
        self
    }
    /// How long a direct transfer may take before it fails (default 120 s).
    pub fn transfer_timeout(mut self, d: Duration) -> Self {
        self.transfer_timeout = d;
        self
    }
    /// How long a thread waiting on rdt's critical path (the driver
    /// waiting for a value; a worker's control loop, transfer thread and
    /// actor waiting for what comes next) stays awake polling before it
    /// sleeps, in the driver and every worker. Waking a thread that slept
    /// costs 0.1–0.3 ms on cloud VMs, several times per call; the window
    /// trades CPU time for that latency. Default: 5 ms on machines with 8
    /// cores or more, none on smaller ones (`RDT_HOT_WINDOW_US`
    /// overrides the default); `Duration::ZERO` turns it off. See
    /// [`rdt_transport::hot`].
    pub fn hot_window(mut self, d: Duration) -> Self {
        self.hot_window = Some(d);
        self
    }
    /// Whether a producer hands a value straight to the consumer whose
    /// call was submitted while the producing call still ran, on a
    /// connection between the two workers, instead of through the driver
    /// (one-sided transports, workers the driver spawned on its host).
    /// It saves the driver's hop on the path of a pass: about 10 µs of a
    /// cached `cuda_ipc` hand-off. Default: on (`RDT_PEER_DELIVERY=0`
    /// turns the default off, for comparisons). See the book's Internals,
    /// "Deliveries straight from the producer".
    pub fn peer_delivery(mut self, on: bool) -> Self {
        self.peer_delivery = on;
        self
    }
    /// Whether a value through the driver (`object_store`) of 1 MiB or
    /// more also goes straight from its producer to a waiting consumer
    /// ([`peer_delivery`](Self::peer_delivery)); smaller ones always do.
    /// The producer then sends it twice at once, to the consumer and to the
    /// driver (which keeps it), and the consumer's copy crosses one socket
    /// instead of two. On a 2×H200 host (32 cores) that took a pass of a 1
    /// GiB CUDA tensor from 3.0 to 5.1–5.4 GB/s; on a 2-core VM the two
    /// streams compete for the cores and a 256 MiB pass went from 2.6 to
    /// 1.8 GB/s. Default: on with 8 cores or more (`RDT_STRAIGHT_LARGE=0`
    /// or `1` in a worker's environment overrides the default).
    pub fn straight_large_values(mut self, on: bool) -> Self {
        self.straight_large_values = Some(on);
        self
    }

    /// The size from which two-sided transfers (`nccl`, `tcp`) to one
    /// consumer for different calls land one call at a time, in the order
    /// they were delivered: the driver holds a producer's send while a
    /// transfer of that size to the same consumer for another call is in
    /// flight (bytes into one device share its links, so started together
    /// the call queued first would wait for both). Those one call needs
    /// go together. Default 128 MiB (`RDT_LARGE_TRANSFER_BYTES` overrides the
    /// default); `usize::MAX` turns it off. See the book's Internals,
    /// "OW-15".
    pub fn large_transfer_bytes(mut self, n: usize) -> Self {
        self.large_transfer_bytes = n;
        self
    }

    /// Starts the runtime: a private directory (mode 0700) with the control
    /// socket, and a fresh secret. Must be called inside a tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves no runtime: its listeners
    /// close with it.
    pub async fn start(self) -> Result<Runtime> {
        if let Some(d) = self.hot_window {
            hot::set_window(d);
        }
        let dir = tempfile::Builder::new().prefix("rdt-").tempdir()?;
        // tempfile creates the directory with mode 0700; say so explicitly.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )?;
        let sock = dir.path().join("control.sock");
        let listener = UnixListener::bind(&sock)?;
        let tcp = match &self.listen {
            Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.map_err(|e| {
                Error::Io(format!("cannot listen for remote workers on {addr}: {e}"))
            })?),
            None => None,
        };
        let control_addr = tcp.as_ref().map(|l| l.local_addr()).transpose()?;
        let tls = match &self.tls {
            Some((cert, key)) => Some(protocol::tls_acceptor(cert, key)?),
            None => None,
        };
        let mut state = State::default();
        state.table.large_transfer_bytes =
            crate::owner::LargeTransferBytes(self.large_transfer_bytes);
        let inner = Arc::new_cyclic(|me| Inner {
            me: me.clone(),
            tokio: tokio::runtime::Handle::current(),
            config: self,
            secret: protocol::new_secret(),
            _dir: dir,
            sock,
            state: Mutex::new(state),
            next: AtomicU64::new(1),
            id_spaces: AtomicU64::new(1),
            control_addr,
            volunteer_joined: tokio::sync::Notify::new(),
            settled: tokio::sync::Notify::new(),
            deadline_wake: Arc::new(tokio::sync::Notify::new()),
            orders_first: AtomicU64::new(0),
        });
        tokio::spawn(deadline_keeper(
            Arc::downgrade(&inner),
            inner.deadline_wake.clone(),
        ));
        tokio::spawn(accept_loop(listener, Arc::downgrade(&inner)));
        if let Some(l) = tcp {
            tokio::spawn(accept_tcp_loop(l, tls, Arc::downgrade(&inner)));
        }
        Ok(Runtime { inner })
    }
}

/// The one task that watches every transfer deadline (XF-6; the
/// `deadlines` module says why not a timer per transfer). It sleeps until
/// the earliest deadline, or until woken for an earlier one (DL-1), and
/// ends with the runtime.
async fn deadline_keeper(rt: Weak<Inner>, wake: Arc<tokio::sync::Notify>) {
    loop {
        let next = match rt.upgrade() {
            Some(inner) => inner.lock().deadlines.next(),
            None => return,
        };
        // A wake sent since `next` was read is kept as a permit.
        match next {
            Some(at) => {
                tokio::select! {
                    _ = tokio::time::sleep_until(at) => {}
                    _ = wake.notified() => {}
                }
            }
            None => wake.notified().await,
        }
        match rt.upgrade() {
            Some(inner) => inner.expire_due(),
            None => return,
        }
    }
}

/// The driver's handle on an rdt runtime: spawns actors, gets and puts
/// values. Cheap to clone.
#[derive(Clone)]
pub struct Runtime {
    pub(crate) inner: Arc<Inner>,
}

pub(crate) struct Inner {
    /// This runtime, weakly (DR: background tasks never keep it alive).
    me: Weak<Inner>,
    /// Where the driver's background tasks run (settle watches, kills),
    /// since messages and calls may come from any thread.
    tokio: tokio::runtime::Handle,
    config: RuntimeBuilder,
    secret: [u8; 32],
    _dir: tempfile::TempDir,
    sock: PathBuf,
    pub(crate) state: Mutex<State>,
    next: AtomicU64,
    /// The next actor id space (`protocol::actor_id_space`).
    id_spaces: AtomicU64,
    control_addr: Option<std::net::SocketAddr>,
    volunteer_joined: tokio::sync::Notify,
    /// Woken whenever transfers end (see `Runtime::transfers_settled`).
    settled: tokio::sync::Notify,
    /// Wakes the deadline keeper (DL-1).
    deadline_wake: Arc<tokio::sync::Notify>,
    /// Calls whose transfer orders were written before them (for tests
    /// and benchmarks).
    orders_first: AtomicU64,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The deadline keeper holds the runtime weakly: woken, it sees it
        // gone and ends.
        self.deadline_wake.notify_one();
    }
}

/// The driver's state, locked (see [`Inner::lock`]).
pub(crate) struct StateGuard<'a> {
    guard: Option<parking_lot::MutexGuard<'a, State>>,
}

impl std::ops::Deref for StateGuard<'_> {
    type Target = State;
    fn deref(&self) -> &State {
        self.guard.as_ref().expect("held until drop")
    }
}

impl std::ops::DerefMut for StateGuard<'_> {
    fn deref_mut(&mut self) -> &mut State {
        self.guard.as_mut().expect("held until drop")
    }
}

impl Drop for StateGuard<'_> {
    fn drop(&mut self) {
        let wake = |getters: Vec<crate::owner::Woken>| {
            for g in getters {
                g.wake();
            }
        };
        let woken = (self.guard.as_mut())
            .map(|st| st.table.take_woken())
            .unwrap_or_default();
        // OW-1: released after the unlock (a transport's release may take
        // its time, or ask the runtime).
        let freed_held = (self.guard.as_mut())
            .map(|st| st.table.take_freed_held())
            .unwrap_or_default();
        // Unlock first, then wake the getters whose values settled (a
        // getter's first step is to take the lock: woken under it, it
        // waited there, parked, while this thread finished the message;
        // 4 µs of a 4 KiB pass in the 2×H200 timelines), then write what
        // was sent meanwhile (invariant 2: the frames are queued in order
        // already; a getter's own frames queue behind them).
        rdt_transport::cuda::timeline("driver unlocking", woken.len() as u64);
        drop(self.guard.take());
        rdt_transport::cuda::timeline("driver unlocked", 0);
        wake(woken);
        drop(freed_held);
        rdt_transport::cuda::timeline("driver getters woken", 0);
        protocol::flush_deferred();
    }
}

/// A call whose result and arguments are recorded, not sent yet
/// ([`Inner::stage_call`]).
struct StagedCall {
    call: u64,
    actor: u64,
    msg: ToWorker,
}

impl Inner {
    /// Locks the driver's state. Messages sent while it is held are queued
    /// on their connections in the order they were decided and written
    /// once it is released (invariant 2): no thread waits on this lock for a
    /// socket write.
    pub(crate) fn lock(&self) -> StateGuard<'_> {
        let guard = self.state.lock();
        protocol::defer_writes();
        StateGuard { guard: Some(guard) }
    }
}

struct PendingCall {
    actor: u64,
    result: u64,
    args: Vec<u64>,
    /// Objects whose refs are in the arguments passed by value: held until
    /// the call ends (CL-2).
    nested: Vec<u64>,
    /// Its `call` span in the driver, from its submission to its end
    /// (`outcome`).
    span: tracing::Span,
}

/// Calls in flight, by call id, and how many each actor has (its reader
/// keeps its thread awake while it has some: `read_worker`).
#[derive(Default)]
struct PendingCalls {
    by_id: HashMap<u64, PendingCall>,
    per_actor: HashMap<u64, usize>,
}

impl PendingCalls {
    fn insert(&mut self, call: u64, pc: PendingCall) {
        *self.per_actor.entry(pc.actor).or_default() += 1;
        self.by_id.insert(call, pc);
    }

    fn remove(&mut self, call: &u64) -> Option<PendingCall> {
        let pc = self.by_id.remove(call)?;
        if let Some(n) = self.per_actor.get_mut(&pc.actor) {
            *n -= 1;
            if *n == 0 {
                self.per_actor.remove(&pc.actor);
            }
        }
        Some(pc)
    }

    /// The calls `actor` is running or has queued.
    fn of(&self, actor: u64) -> Vec<u64> {
        if !self.any_for(actor) {
            return Vec::new();
        }
        self.by_id
            .iter()
            .filter(|(_, c)| c.actor == actor)
            .map(|(k, _)| *k)
            .collect()
    }

    fn any_for(&self, actor: u64) -> bool {
        self.per_actor.contains_key(&actor)
    }
}

struct Joined {
    conn: protocol::Sender,
}

struct Process {
    pid: u32,
    exit: watch::Receiver<Option<String>>,
    /// Signals go through this, never through `pid` (DR-2); dropped at
    /// death.
    pidfd: Option<Arc<std::os::fd::OwnedFd>>,
    _guard: Option<ChildGuard>,
}

/// Kills a worker process on drop (through its pidfd: a no-op once it was
/// reaped, whatever process has its pid by then).
struct ChildGuard {
    pidfd: Arc<std::os::fd::OwnedFd>,
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = pidfd_kill(&self.pidfd);
    }
}

/// DR-2: sends SIGKILL to the process `pidfd` refers to. A pidfd names one
/// process for good: once that process was reaped the call fails with
/// `ESRCH` instead of signalling whatever process reuses its pid.
fn pidfd_kill(pidfd: &std::os::fd::OwnedFd) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: plain syscall on a descriptor we own; no siginfo.
    let r = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[derive(Default)]
pub(crate) struct State {
    pub(crate) table: OwnerTable,
    actors: Actors,
    processes: HashMap<u64, Process>,
    calls: PendingCalls,
    /// Wakes a worker's reader into its hot read when a call is submitted
    /// to it (`read_worker`).
    readers: HashMap<u64, Arc<tokio::sync::Notify>>,
    joining: HashMap<u64, oneshot::Sender<Joined>>,
    spawning: HashMap<u64, oneshot::Sender<Result<()>>>,
    fetches: HashMap<u64, (u64, oneshot::Sender<Result<WireValue>>)>,
    groups: HashMap<u64, Group>,
    volunteers: std::collections::VecDeque<Volunteer>,
    /// Deadlines of transfers in flight (XF-6).
    deadlines: crate::deadlines::Deadlines,
    /// Group creates and destroys waiting for acknowledgements.
    group_ops: HashMap<u64, GroupOp>,
    /// `shutdown` asked every worker to stop: their exits are expected,
    /// not deaths to warn about.
    shutting_down: bool,
    /// Counts each actor holds (CL-1), by actor, then object: given back
    /// when it dies (CL-4).
    borrows: HashMap<u64, HashMap<u64, usize>>,
    /// Gets in flight inside actors, by (actor, object): each needs the
    /// object as a call would.
    gets: HashMap<(u64, u64), usize>,
}

/// A collective group: actors that may move objects of its backend between
/// each other.
struct Group {
    backend: Transport,
    members: std::collections::HashSet<u64>,
    /// The members by rank.
    ranks: Vec<u64>,
    /// Every member acknowledged joining.
    ready: bool,
    broken: Option<String>,
}

/// A group prepare, create or destroy waiting for its members'
/// acknowledgements (a prepare's answer carries rank 0's bootstrap bytes).
struct GroupOp {
    waiting: std::collections::HashSet<u64>,
    tx: oneshot::Sender<Result<Vec<u8>>>,
}

impl GroupOp {
    /// `actor` answered: the op ends at the first error or the last answer.
    fn answered(ops: &mut HashMap<u64, GroupOp>, group: u64, actor: u64, r: Result<Vec<u8>>) {
        let Some(op) = ops.get_mut(&group) else {
            return;
        };
        op.waiting.remove(&actor);
        if r.is_err() || op.waiting.is_empty() {
            let op = ops.remove(&group).expect("looked up above");
            let _ = op.tx.send(r);
        }
    }
}

/// SP-1: undoes a spawn that did not finish, on an error or when its
/// future is dropped: the worker is killed (its reaper reaps it), and the
/// actor is dead, so nothing waits for it and nothing it sends is applied
/// (CL-4).
struct UnfinishedSpawn<'a> {
    inner: &'a Arc<Inner>,
    id: u64,
    /// Why it did not finish; `None` once it did.
    why: Option<String>,
}

impl UnfinishedSpawn<'_> {
    /// The spawn failed with `e`: undone (now, as the error returns).
    fn fail(&mut self, e: Error) -> Error {
        self.why = Some(e.to_string());
        e
    }
}

impl Drop for UnfinishedSpawn<'_> {
    fn drop(&mut self) {
        let Some(why) = self.why.take() else { return };
        self.inner.kill_actor(self.id);
        let mut st = self.inner.lock();
        st.joining.remove(&self.id);
        st.spawning.remove(&self.id);
        if let Some(a) = st.actors.get_mut(&self.id) {
            a.dead = Some(why);
            a.conn = None;
        }
    }
}

impl Runtime {
    /// Starts a runtime with the defaults (embedded, local).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves no runtime: its listeners
    /// close with it.
    pub async fn start() -> Result<Runtime> {
        RuntimeBuilder::default().start().await
    }

    /// Settings other than the defaults.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }

    /// The TCP address workers started by hand connect to
    /// (`--rdt-connect`), if [`RuntimeBuilder::listen`] was set.
    pub fn control_address(&self) -> Option<std::net::SocketAddr> {
        self.inner.control_addr
    }

    /// The secret a worker started by hand proves it knows (give it in the
    /// `RDT_TOKEN` environment variable). Anyone holding it can run code in
    /// this runtime's actors: hand it over like a password.
    pub fn join_token(&self) -> String {
        hex::encode(self.inner.secret)
    }

    /// Spawns an actor in a new worker process. Await the returned builder
    /// (after optional settings) to get the actor's typed handle.
    pub fn spawn<A: Actor>(&self, args: A::Args) -> Spawn<A> {
        Spawn {
            rt: self.clone(),
            args,
            gpus: GpuRequest::None,
            name: None,
            remote: false,
        }
    }

    /// Waits for an object and returns its value. Waits until the producer
    /// replies or dies; see [`Runtime::get_timeout`] for a deadline.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes loses nothing: the object stays
    /// readable by a later call, and a receive it started is given up (its copy
    /// freed when nothing else here needs it).
    pub async fn get<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
    ) -> Result<T> {
        let r = r.borrow();
        let wv = self.inner.wait_value(r.id).await?;
        // A value through the driver may still be arriving (cut-through).
        wv.arrived().await?;
        match wv.transport.sidedness() {
            rdt_transport::Sidedness::ThroughDriver => decode_wire(&self.inner, &wv, r.id),
            rdt_transport::Sidedness::TwoSided => Err(Error::CollectiveGet {
                object: r.id,
                transport: wv.transport.to_string(),
            }),
            rdt_transport::Sidedness::OneSided => match driver_transport(wv.transport) {
                // NIXL: read straight into this process, no worker involved.
                Some(inst) => {
                    let tensors = self.get_direct(r.id, &wv, inst, Target::Any, None).await?;
                    decode_in_driver(&self.inner, &wv, r.id, &tensors)
                }
                None => self.get_via_object_store(r).await,
            },
        }
    }

    /// Like [`Runtime::get`], with the object's tensors received into
    /// `targets`: one per tensor of the value, in the order the value holds
    /// them (a tensor held twice counts once), each of the same dtype and
    /// shape. The value returned holds `targets` themselves.
    ///
    /// Over `nixl` the read lands in the targets directly (CUDA tensors
    /// made with `Tensor::cuda_empty`, host tensors made by rdt): no
    /// staging, no allocation. Other transports come through the
    /// object-store path and are copied in once; a collective transport
    /// fails as for [`Runtime::get`]. Targets that do not fit fail with
    /// [`Error::Targets`] before any byte moves, and the object stays
    /// readable.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes writes nothing more into
    /// `targets` over `tcp`, `shm`, `cuda_ipc` (nothing more is queued on the
    /// stream) and the object store: their copy into the targets runs under a
    /// gate the drop closes (a copy under way ends first), or in this future
    /// itself. Over `nixl` and `nccl`, which write into the targets as the
    /// bytes come, the drop aborts the receive (over `nccl`, like any failed
    /// transfer, that aborts the group); a NIXL READ already posted ends or
    /// is cancelled a moment after the drop, and writes into the targets
    /// until then: [`Targets::idle`](crate::Targets::idle) waits for it.
    /// Either way the object stays readable.
    pub async fn get_into<T: Serialize + DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
        targets: impl Into<crate::Targets>,
    ) -> Result<T> {
        let r = r.borrow();
        let targets: crate::Targets = targets.into();
        let (wv, tensors, copied) = self.land_in::<T>(r.id, &targets).await?;
        decode_in_driver(
            &self.inner,
            &wv,
            r.id,
            copied.as_deref().unwrap_or(&tensors),
        )
    }

    /// [`get_into`](Runtime::get_into) without the value: the object's
    /// tensors written into `targets`, and nothing decoded (see
    /// [`ActorRuntime::load_into`](crate::ActorRuntime::load_into), the
    /// same for an actor). Same targets, same errors as `get_into`.
    ///
    /// # Cancel safety
    ///
    /// As [`get_into`](Self::get_into).
    pub async fn load_into<T: Serialize + DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
        targets: impl Into<crate::Targets>,
    ) -> Result<()> {
        let targets: crate::Targets = targets.into();
        self.land_in::<T>(r.borrow().id, &targets).await.map(drop)
    }

    /// Object `id` received into `targets`: its value, the tensors
    /// received, and the targets as the value's tensors where they were
    /// copied in (`None`: the received tensors are the targets).
    async fn land_in<T: Serialize + DeserializeOwned + 'static>(
        &self,
        id: u64,
        targets: &crate::Targets,
    ) -> Result<(
        WireValue,
        Vec<rdt_transport::Tensor>,
        Option<Vec<rdt_transport::Tensor>>,
    )> {
        let wv = self.inner.wait_value(id).await?;
        wv.arrived().await?;
        let wv = match wv.transport.sidedness() {
            rdt_transport::Sidedness::TwoSided => {
                return Err(Error::CollectiveGet {
                    object: id,
                    transport: wv.transport.to_string(),
                })
            }
            rdt_transport::Sidedness::OneSided => match driver_transport(wv.transport) {
                Some(inst) => {
                    let metas = &wv.exported.get()?.metas;
                    // TG-1, TG-2: ordered and checked before any byte moves.
                    let ordered =
                        targets.resolve::<T>(id, &wv.data_bytes()?, metas.len(), &|i| {
                            metas.get(i).cloned()
                        })?;
                    crate::refs::wait::check_targets(id, metas, &ordered)?;
                    let target = Target::Tensors(ordered.clone());
                    // TG-4: a READ that outlives this future counts as the
                    // targets' writer (`Targets::idle`).
                    let gate = Arc::new(targets.gate());
                    let tensors = self.get_direct(id, &wv, inst, target, Some(gate)).await?;
                    let copied = crate::refs::wait::into_targets(id, &ordered, &tensors)?;
                    return Ok((wv, tensors, copied));
                }
                None => self.fetch_via_object_store(id).await?,
            },
            rdt_transport::Sidedness::ThroughDriver => wv,
        };
        let tensors = object_store::unpack(wv.exported.get()?)?;
        let ordered = targets.resolve::<T>(id, &wv.data_bytes()?, tensors.len(), &|i| {
            tensors.get(i).map(rdt_transport::Tensor::meta)
        })?;
        let copied = crate::refs::wait::into_targets(id, &ordered, &tensors)?;
        Ok((wv, tensors, copied))
    }

    /// Like [`Runtime::get`], with every tensor read straight into this
    /// process's host memory, whatever device it is on at its producer
    /// (a checkpoint, an evaluation on the CPU). For objects on a
    /// transport that serves the driver (`nixl`); others fail with a
    /// message that says to use [`Runtime::get`].
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get).
    pub async fn get_on_host<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
    ) -> Result<T> {
        let r = r.borrow();
        let wv = self.inner.wait_value(r.id).await?;
        wv.arrived().await?;
        match driver_transport(wv.transport) {
            Some(inst) => {
                let tensors = self.get_direct(r.id, &wv, inst, Target::Host, None).await?;
                decode_in_driver(&self.inner, &wv, r.id, &tensors)
            }
            None => Err(Error::TransportUnavailable {
                name: wv.transport.to_string(),
                reason: format!(
                    "get_on_host reads an object directly into the driver, which {} cannot do; \
                     use get (or return the tensors over nixl)",
                    wv.transport
                ),
            }),
        }
    }

    /// Gets several objects: every one is waited for and every direct read
    /// is started before any is awaited (Ray's `get` of a list; no
    /// one-at-a-time fetches, ray#61453). Fails with the first error.
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get), for each object.
    pub async fn get_all<T: DeserializeOwned + 'static>(
        &self,
        refs: &[ObjectRef<T>],
    ) -> Result<Vec<T>> {
        futures::future::try_join_all(refs.iter().map(|r| self.get(r))).await
    }

    /// Reads object `id`, held by an actor or by this driver, over a
    /// transport that serves the driver, within the transfer deadline.
    async fn get_direct(
        &self,
        id: u64,
        wv: &WireValue,
        inst: Arc<dyn rdt_transport::TensorTransport>,
        target: Target,
        gate: Option<Arc<rdt_transport::TargetGate>>,
    ) -> Result<Vec<rdt_transport::Tensor>> {
        let (from, producer) = {
            let st = self.inner.lock();
            let e = st
                .table
                .objects
                .get(&id)
                .ok_or(Error::Freed { object: id })?;
            if let Some(held) = &e.held {
                // Put by this driver: its tensors are here already.
                let tensors = held.tensors().to_vec();
                drop(st);
                return target
                    .place(wv.transport.name(), &wv.exported.get()?.metas, tensors)
                    .map_err(Error::Transport);
            }
            let Some(p) = e.producer else {
                drop(st);
                let tensors = object_store::unpack(wv.exported.get()?)?;
                return target
                    .place(wv.transport.name(), &wv.exported.get()?.metas, tensors)
                    .map_err(Error::Transport);
            };
            let a = st.actors.get(&p).ok_or(Error::Freed { object: id })?;
            if let Some(d) = &a.dead {
                return Err(Error::ActorDied {
                    actor: a.name.clone(),
                    detail: d.clone(),
                });
            }
            (a.peer(p, wv.transport.name()), p)
        };
        let deadline = self.inner.config.transfer_timeout;
        let exported = wv.exported.get()?;
        let cx = rdt_transport::TransferCtx {
            target,
            gate,
            layout: wv.exported.layout(),
            ..rdt_transport::TransferCtx::new(0)
        };
        let read = tokio::time::timeout(deadline, inst.receive(&from, &cx, exported)).await;
        let dead = || {
            let st = self.inner.lock();
            st.actors.get(&producer).and_then(|a| {
                a.dead.clone().map(|d| Error::ActorDied {
                    actor: a.name.clone(),
                    detail: format!(
                        "{d} (while the driver read object {id} over {})",
                        wv.transport
                    ),
                })
            })
        };
        match read {
            Ok(Ok(tensors)) => Ok(tensors),
            Ok(Err(e)) => Err(dead().unwrap_or(Error::Transport(e))),
            Err(_) => Err(dead().unwrap_or(Error::Timeout {
                what: format!(
                    "the driver's read of object {id} from {} over {} (RuntimeBuilder::transfer_timeout)",
                    from.name, wv.transport
                ),
                after_ms: deadline.as_millis() as u64,
            })),
        }
    }

    /// Waits until an object is ready (`Ok`) or failed (its error), without
    /// moving its value anywhere (Ray's `wait` for one ref).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes loses nothing: it moves no
    /// value.
    pub async fn wait<T>(&self, r: impl Borrow<ObjectRef<T>>) -> Result<()> {
        self.inner.wait_value(r.borrow().id).await.map(|_| ())
    }

    /// Ray's `wait`: waits until `num_returns` of `refs` are finished
    /// (ready or failed) or `timeout` passes (`None`: no deadline), and
    /// returns `(finished, pending)`, each in the order of `refs`. Moves no
    /// value; a failed object counts as finished (its `get` gives the
    /// error). Every ref is watched at once, so the first `num_returns` to
    /// finish are the ones returned, whatever their place in `refs`.
    ///
    /// Errs if `num_returns` is larger than `refs.len()` (it could never
    /// be met), or if the runtime shuts down.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes loses nothing: it moves no
    /// value.
    pub async fn wait_many<T>(
        &self,
        refs: &[ObjectRef<T>],
        num_returns: usize,
        timeout: Option<Duration>,
    ) -> Result<(Vec<ObjectRef<T>>, Vec<ObjectRef<T>>)> {
        crate::refs::wait::wait_many(refs, num_returns, timeout, |id| async move {
            self.inner.wait_value(id).await.map(|_| ())
        })
        .await
    }

    /// [`Runtime::get`] with a deadline.
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get): a deadline that passes drops nothing but the
    /// wait.
    pub async fn get_timeout<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
        deadline: Duration,
    ) -> Result<T> {
        let id = r.borrow().id;
        crate::refs::wait::get_within(id, deadline, self.get(r)).await
    }

    /// Gets a value through the object-store path whatever its transport:
    /// the producer serializes it, tensors included, to the driver.
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get).
    pub async fn get_via_object_store<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
    ) -> Result<T> {
        let id = r.borrow().id;
        let wv = self.inner.wait_value(id).await?;
        wv.arrived().await?;
        if wv.transport == Transport::ObjectStore {
            return decode_wire(&self.inner, &wv, id);
        }
        let wv = self.fetch_via_object_store(id).await?;
        decode_wire(&self.inner, &wv, id)
    }

    /// Object `id` (ready, on a transport other than the object store)
    /// serialized by its producer, tensors included, to the driver.
    async fn fetch_via_object_store(&self, id: u64) -> Result<WireValue> {
        let (tx, rx) = oneshot::channel();
        let req = self.inner.next_id();
        {
            let mut st = self.inner.lock();
            let producer = st.table.objects.get(&id).and_then(|e| e.producer);
            let Some(p) = producer else {
                return Err(Error::Freed { object: id });
            };
            if let Some(d) = st.actors.get(&p).and_then(|a| a.dead.clone()) {
                return Err(Error::ActorDied {
                    actor: st.actors[&p].name.clone(),
                    detail: d,
                });
            }
            st.fetches.insert(req, (p, tx));
            send_to(&st.actors, p, &ToWorker::Fetch { object: id, req });
        }
        let wv = rx.await.map_err(|_| Error::Shutdown)??;
        wv.arrived().await?;
        Ok(wv)
    }

    /// Stores `value` in the driver (object-store path) and returns a ref to
    /// it, to pass to any actor. See [`Runtime::put_with`] for a direct
    /// transport.
    pub fn put<T: Serialize>(&self, value: &T) -> Result<ObjectRef<T>> {
        let encoded = crate::refs::codec::encode(value).map_err(|e| Error::Decode {
            what: "the value given to put".into(),
            message: e.to_string(),
        })?;
        let wv = inline_value(encoded.payload.clone(), encoded.ref_ids())?;
        // The value travels in a delivery to every consumer: check the
        // size of that whole frame, not of the value alone (OW-6).
        let probe = ToWorker::Deliver {
            object: u64::MAX,
            value: Ok(protocol::Delivery {
                value: wv,
                from: None,
                xfer: 0,
                group: None,
                ack_at_landing: false,
            }),
        };
        let size = rdt_transport::wire::to_frame(&probe)
            .map_err(|e| Error::Protocol(e.to_string()))?
            .len();
        if size > self.inner.config.max_frame_bytes {
            return Err(Error::Protocol(format!(
                "a value put by the driver travels in a {size}-byte message, over the control frame limit of {} bytes; raise RuntimeBuilder::max_frame_bytes or return the tensors from an actor method with a direct transport",
                self.inner.config.max_frame_bytes
            )));
        }
        let ToWorker::Deliver { value: Ok(d), .. } = probe else {
            unreachable!("built above")
        };
        let wv = d.value;
        let id = self.inner.next_id();
        self.inner
            .state
            .lock()
            .table
            .insert_done(id, None, ObjState::Ready(wv));
        // CL-2: the table holds the refs in the value now.
        drop(encoded);
        Ok(ObjectRef::adopt(id, self.inner.clone() as SharedClient))
    }

    /// Stores `value` in the driver, its tensors over `transport`, and
    /// returns a ref to pass to any actor. With [`Transport::ObjectStore`]
    /// this is [`Runtime::put`]; with a one-sided transport that serves the
    /// driver (`nixl`), the tensors stay in this process, registered, and
    /// each consumer reads them directly. They live until the last ref and
    /// call that needs them are gone.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future while the tensors are exported (`nixl` registers
    /// them) returns no ref; what the export registered stays until the
    /// transport is dropped. Drop it only once it returned.
    pub async fn put_with<T: Serialize>(
        &self,
        value: &T,
        transport: Transport,
    ) -> Result<ObjectRef<T>> {
        if transport == Transport::ObjectStore {
            return self.put(value);
        }
        let refuse = || Error::TransportUnavailable {
            name: transport.name().into(),
            reason: "the driver cannot hold objects on it: put_with takes Transport::Nixl (a \
                     one-sided transport that serves the driver) or Transport::ObjectStore"
                .into(),
        };
        if transport.sidedness() != rdt_transport::Sidedness::OneSided {
            return Err(refuse());
        }
        let inst = transport.instance()?;
        if !inst.serves_driver() {
            return Err(refuse());
        }
        let encoded = crate::refs::codec::encode(value).map_err(|e| Error::Decode {
            what: "the value given to put_with".into(),
            message: e.to_string(),
        })?;
        let refs = encoded.ref_ids();
        let payload = encoded.payload.clone();
        for t in &payload.tensors {
            inst.check_device(t.device())?;
        }
        let id = self.inner.next_id();
        let exported = match inst.export(id, &payload.tensors).await {
            Ok(x) => x,
            Err(e) => {
                let _ = inst.release(id).await;
                return Err(e.into());
            }
        };
        let wv = WireValue {
            data: Blob::new(payload.data),
            transport,
            exported: WireExported::new(exported)?,
            refs,
        };
        let held = crate::owner::DriverHeld::new(id, payload.tensors, inst);
        self.inner
            .state
            .lock()
            .table
            .insert_held(id, transport, wv, held);
        drop(encoded);
        Ok(ObjectRef::adopt(id, self.inner.clone() as SharedClient))
    }

    /// Creates a collective group of `backend` (a collective transport:
    /// `tcp`, `nccl`) over `actors`. Refs on that transport may then be
    /// passed between members. An actor may belong to groups of different
    /// backends; a group can be destroyed and created again.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before the members answer leaves the group being
    /// made: the members that join keep it until
    /// [`destroy_collective_group`](Self::destroy_collective_group) or
    /// shutdown; nothing waits on it.
    pub async fn create_collective_group(
        &self,
        actors: &[ActorId],
        backend: Transport,
    ) -> Result<GroupId> {
        if !backend.is_collective() {
            return Err(Error::Group(format!(
                "{backend} is not a collective transport (collective: tcp, nccl); one-sided transports need no group"
            )));
        }
        if !backend.is_implemented() {
            return Err(Error::TransportUnavailable {
                name: backend.name().into(),
                reason: "this build of rdt does not implement it yet".into(),
            });
        }
        if actors.is_empty() {
            return Err(Error::Group(
                "a collective group needs at least one actor".into(),
            ));
        }
        let deadline = self.inner.config.spawn_timeout;
        let (id, peers, ranks, prepared) = {
            let mut st = self.inner.lock();
            let st = &mut *st;
            let mut members = std::collections::HashSet::new();
            for a in actors {
                let info = st
                    .actors
                    .get(&a.0)
                    .ok_or_else(|| Error::Group(format!("no actor with id {}", a.0)))?;
                if let Some(d) = &info.dead {
                    return Err(Error::ActorDied {
                        actor: info.name.clone(),
                        detail: d.clone(),
                    });
                }
                if !members.insert(a.0) {
                    return Err(Error::Group(format!("actor {} is listed twice", info.name)));
                }
            }
            if backend == Transport::Nccl {
                refuse_shared_gpus(&st.actors, actors)?;
            }
            let id = self.inner.next_id();
            let ranks: Vec<u64> = actors.iter().map(|a| a.0).collect();
            let peers: Vec<rdt_transport::Peer> = ranks
                .iter()
                .map(|a| st.actors[a].peer(*a, backend.name()))
                .collect();
            // XF-2, first step: rank 0 makes what every member joins with
            // (NCCL: the unique id; its process runs the bootstrap root).
            let order = ToWorker::PrepareGroup {
                backend: backend.name().to_string(),
                spec: rdt_transport::GroupSpec {
                    id,
                    ranks: peers.clone(),
                    my_rank: 0,
                    bootstrap: Vec::new(),
                },
            };
            send_to(&st.actors, ranks[0], &order);
            let (tx, rx) = oneshot::channel();
            st.group_ops.insert(
                id,
                GroupOp {
                    waiting: [ranks[0]].into_iter().collect(),
                    tx,
                },
            );
            st.groups.insert(
                id,
                Group {
                    backend,
                    members,
                    ranks: ranks.clone(),
                    ready: false,
                    broken: None,
                },
            );
            (id, peers, ranks, rx)
        };
        let joined = match self
            .group_step(id, backend, prepared, deadline, "prepare")
            .await
        {
            // Second step: every member joins (NCCL: with rank 0's unique
            // id) and acknowledges; the group is usable once all did.
            Ok(bootstrap) => {
                let rx = {
                    let mut st = self.inner.lock();
                    let st = &mut *st;
                    for (rank, a) in ranks.iter().enumerate() {
                        let order = ToWorker::CreateGroup {
                            backend: backend.name().to_string(),
                            spec: rdt_transport::GroupSpec {
                                id,
                                ranks: peers.clone(),
                                my_rank: rank as u32,
                                bootstrap: bootstrap.clone(),
                            },
                        };
                        send_to(&st.actors, *a, &order);
                    }
                    let (tx, rx) = oneshot::channel();
                    st.group_ops.insert(
                        id,
                        GroupOp {
                            waiting: ranks.iter().copied().collect(),
                            tx,
                        },
                    );
                    // A member that died since is not waited for.
                    let dead: Vec<(u64, Error)> = ranks
                        .iter()
                        .filter_map(|a| {
                            let i = st.actors.get(a)?;
                            i.dead.as_ref().map(|d| {
                                (
                                    *a,
                                    Error::ActorDied {
                                        actor: i.name.clone(),
                                        detail: d.clone(),
                                    },
                                )
                            })
                        })
                        .collect();
                    for (a, e) in dead {
                        GroupOp::answered(&mut st.group_ops, id, a, Err(e));
                    }
                    rx
                };
                self.group_step(id, backend, rx, deadline, "join").await
            }
            Err(e) => Err(e),
        };
        let mut st = self.inner.lock();
        match joined {
            Ok(_) => {
                if let Some(g) = st.groups.get_mut(&id) {
                    if let Some(why) = &g.broken {
                        let e = Error::Group(format!(
                            "{backend} group {id} broke while it was created: {why}"
                        ));
                        st.groups.remove(&id);
                        return Err(e);
                    }
                    g.ready = true;
                }
                Ok(GroupId(id))
            }
            Err(e) => {
                st.group_ops.remove(&id);
                if let Some(g) = st.groups.remove(&id) {
                    for a in g.ranks {
                        send_to(&st.actors, a, &ToWorker::DestroyGroup { group: id });
                    }
                }
                Err(e)
            }
        }
    }

    /// Waits for one step of a group's creation (every answer, or the
    /// first error), within `deadline`.
    async fn group_step(
        &self,
        id: u64,
        backend: Transport,
        rx: oneshot::Receiver<Result<Vec<u8>>>,
        deadline: Duration,
        step: &str,
    ) -> Result<Vec<u8>> {
        match tokio::time::timeout(deadline, rx).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(Error::Shutdown),
            Err(_) => Err(Error::Group(format!(
                "the members of {backend} group {id} did not all {step} within {deadline:?} (RuntimeBuilder::spawn_timeout)"
            ))),
        }
    }

    /// Destroys a collective group: no transfer starts in it from now on
    /// (a delivery still waiting for its object fails with `NotInGroup`),
    /// and every live member tears its part down and acknowledges. Objects
    /// already moved stay where they are; later passes between its actors
    /// need a new group.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future does not stop the teardown once ordered.
    pub async fn destroy_collective_group(&self, group: GroupId) -> Result<()> {
        let rx = {
            let mut st = self.inner.lock();
            let st = &mut *st;
            let Some(g) = st.groups.remove(&group.0) else {
                return Err(Error::Group(format!(
                    "no collective group {group} (already destroyed?)"
                )));
            };
            let live: std::collections::HashSet<u64> = g
                .ranks
                .iter()
                .copied()
                .filter(|a| st.actors.get(a).is_some_and(|i| i.dead.is_none()))
                .collect();
            // OW-15: sends held in the group go ahead of the leave order.
            st.table.send_held_in_group(group.0, &st.actors);
            for a in &live {
                send_to(&st.actors, *a, &ToWorker::DestroyGroup { group: group.0 });
            }
            let (tx, rx) = oneshot::channel();
            if live.is_empty() {
                let _ = tx.send(Ok(Vec::new()));
            } else {
                st.group_ops.insert(group.0, GroupOp { waiting: live, tx });
            }
            rx
        };
        let deadline = self.inner.config.spawn_timeout;
        match tokio::time::timeout(deadline, rx).await {
            Ok(Ok(r)) => r.map(|_| ()),
            Ok(Err(_)) => Err(Error::Shutdown),
            Err(_) => {
                self.inner.lock().group_ops.remove(&group.0);
                Err(Error::Group(format!(
                    "the members of group {group} did not all leave it within {deadline:?}"
                )))
            }
        }
    }

    /// What the driver sent on to its live actors of blobs it was still
    /// receiving (large values on the object-store path, forwarded as they
    /// arrive instead of after the whole value is in): `(bytes, of which
    /// sent before their blob was whole)`. For benchmarks and tests.
    pub fn forwarded_bytes(&self) -> (u64, u64) {
        let st = self.inner.lock();
        st.actors
            .values()
            .filter_map(|a| a.conn.as_ref())
            .map(|c| c.forwarded())
            .fold((0, 0), |(a, b), (x, y)| (a + x, b + y))
    }

    /// How many calls of the driver's had the orders of the transfers they
    /// need written before them: two-sided transfers (a delivery to the
    /// callee and a send order to the producer) start while the call
    /// itself is still being encoded. For tests and benchmarks.
    pub fn calls_with_orders_first(&self) -> u64 {
        self.inner.orders_first.load(Ordering::Relaxed)
    }

    /// How many of the driver's `get`s were handed their value as the
    /// call's reply stored it, and went on without waiting for the rest of
    /// the reply's handling (OW-14). For tests and benchmarks.
    pub fn gets_handed_values(&self) -> u64 {
        self.inner.lock().table.handed_values
    }

    /// How many sends of large two-sided transfers (128 MiB or more, or
    /// `RDT_LARGE_TRANSFER_BYTES`) waited in the driver for the large
    /// transfers to the same consumer ahead of them to end, so that
    /// they land one at a time, in order. For tests and benchmarks.
    pub fn sends_held(&self) -> u64 {
        self.inner.lock().table.sends_held
    }

    /// How many argument copies callees dropped themselves when their
    /// call ended (OW-12: no `Free` from the driver), and how many of
    /// those a call submitted meanwhile needed, so that they were
    /// delivered again. For tests and benchmarks.
    pub fn copies_released_by_callees(&self) -> (u64, u64) {
        let st = self.inner.lock();
        (st.table.released_by_callees, st.table.delivered_again)
    }

    /// What the driver has counted since it started: transfers, their
    /// bytes and outcomes per transport, and calls (see [`crate::metrics`],
    /// which also names what goes to a `metrics` recorder).
    pub fn metrics(&self) -> crate::metrics::DriverMetrics {
        self.inner.lock().table.counts.snapshot()
    }

    /// Number of objects the owner table holds (for tests and leak checks).
    pub fn live_objects(&self) -> usize {
        self.inner.lock().table.len()
    }

    /// The counts the owner table holds on object `id` (`None` once it
    /// is freed). A ref and all its clones hold one (for tests).
    #[doc(hidden)]
    pub fn ref_count(&self, id: u64) -> Option<usize> {
        self.inner.lock().table.objects.get(&id).map(|e| e.refs)
    }

    /// Number of direct transfers delivered to a consumer and not yet
    /// acknowledged by it (or aborted), and of deliveries ordered straight
    /// from a producer whose call has not finished yet
    /// ([`RuntimeBuilder::peer_delivery`]).
    pub fn transfers_in_flight(&self) -> usize {
        self.inner.lock().table.transfers_unsettled()
    }

    /// Waits until no direct transfer is in flight: every receive was
    /// acknowledged or aborted, every producer asked to deliver a value
    /// straight has answered, and the frees they held back went out.
    /// Each transfer has a deadline (`RuntimeBuilder::transfer_timeout`),
    /// and an order ends with the producer's call, so this ends once the
    /// calls involved do.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future loses nothing.
    pub async fn transfers_settled(&self) {
        loop {
            let notified = self.inner.settled.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.transfers_in_flight() == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Asks every worker to exit, waits up to the grace period, then kills
    /// the rest.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves the shutdown under way.
    pub async fn shutdown(&self) {
        let exits: Vec<watch::Receiver<Option<String>>> = {
            let mut st = self.inner.lock();
            st.shutting_down = true;
            for (id, a) in &st.actors {
                if a.dead.is_none() {
                    send_to(&st.actors, *id, &ToWorker::Shutdown);
                }
            }
            st.processes.values().map(|p| p.exit.clone()).collect()
        };
        let wait_all = async {
            for mut e in exits {
                let _ = e.wait_for(|s| s.is_some()).await;
            }
        };
        let _ = tokio::time::timeout(self.inner.config.shutdown_grace, wait_all).await;
        let procs: Vec<Process> = self
            .inner
            .state
            .lock()
            .processes
            .drain()
            .map(|(_, p)| p)
            .collect();
        drop(procs); // ChildGuard kills what is left
    }
}

/// Decodes a value whose bytes are all here ([`WireValue::arrived`]).
fn decode_wire<T: DeserializeOwned + 'static>(
    inner: &Arc<Inner>,
    wv: &WireValue,
    id: u64,
) -> Result<T> {
    let tensors = object_store::unpack(wv.exported.get()?)?;
    decode_in_driver(inner, wv, id, &tensors)
}

/// Decodes object `id`'s value in the driver, with `tensors` put back; refs
/// in it become driver refs. Never called under the state lock (a ref
/// read takes it).
fn decode_in_driver<T: DeserializeOwned + 'static>(
    inner: &Arc<Inner>,
    wv: &WireValue,
    id: u64,
    tensors: &[rdt_transport::Tensor],
) -> Result<T> {
    let client = inner.clone() as SharedClient;
    crate::refs::codec::decode(Some(&client), &wv.data_bytes()?, tensors).map_err(|e| {
        Error::Decode {
            what: format!("object {id} as {}", std::any::type_name::<T>()),
            message: e.to_string(),
        }
    })
}

/// The driver's instance of the transport called `name`, if it reads and
/// holds objects in the driver itself (`nixl`).
fn driver_transport(t: Transport) -> Option<Arc<dyn rdt_transport::TensorTransport>> {
    let inst = t.instance().ok()?;
    inst.serves_driver().then_some(inst)
}

fn send_to(actors: &Actors, to: u64, msg: &ToWorker) {
    if let Some(c) = actors.get(&to).and_then(|a| a.conn.as_ref()) {
        if let Err(e) = c.send(msg) {
            tracing::error!("could not encode a message for actor {to}: {e}");
        }
    }
}

/// A pending spawn; await it.
#[must_use = "await the spawn to start the actor"]
pub struct Spawn<A: Actor> {
    rt: Runtime,
    args: A::Args,
    gpus: GpuRequest,
    name: Option<String>,
    remote: bool,
}

/// The GPUs a worker asks for (see [`Spawn::gpus`] and [`Spawn::on_gpus`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
enum GpuRequest {
    /// No GPU (`CUDA_VISIBLE_DEVICES` is inherited unchanged).
    #[default]
    None,
    /// This many, assigned round-robin.
    Count(u32),
    /// These indices of the GPU pool, in this order.
    Devices(Vec<u32>),
}

impl<A: Actor> Spawn<A> {
    /// Gives the worker `n` GPUs, assigned round-robin over the host's GPU
    /// pool (`RDT_GPUS`, else the driver's `CUDA_VISIBLE_DEVICES`, else
    /// every device of the host): consecutive GPU actors land on different
    /// devices while there are enough, and share devices after that. The
    /// worker sees exactly those devices (`CUDA_VISIBLE_DEVICES`); its
    /// `cuda:0` is the first. Use [`on_gpus`](Self::on_gpus) to choose.
    pub fn gpus(mut self, n: u32) -> Self {
        self.gpus = if n == 0 {
            GpuRequest::None
        } else {
            GpuRequest::Count(n)
        };
        self
    }
    /// Gives the worker exactly these GPUs of the pool (indices into the
    /// list [`gpus`](Self::gpus) draws from; with neither `RDT_GPUS` nor
    /// `CUDA_VISIBLE_DEVICES` set in the driver, the host's device
    /// numbers), in this order: its `cuda:0` is `ids[0]`. Two actors given
    /// the same id share a device; `on_gpus([0, 1])` lets a worker see a
    /// second device as well (e.g. the producer's, to map its memory in
    /// that device's own context). Spawning fails if an id is not in the
    /// pool or appears twice.
    ///
    /// ```no_run
    /// # use rdt::prelude::*;
    /// # #[rdt::actor] pub struct A {}
    /// # #[rdt::actor] impl A { fn new() -> Self { A {} } }
    /// # async fn f(rt: Runtime) -> rdt::Result<()> {
    /// let producer = rt.spawn::<A>(()).on_gpus([0]).await?;
    /// let same_gpu = rt.spawn::<A>(()).on_gpus([0]).await?;
    /// let other_gpu = rt.spawn::<A>(()).on_gpus([1]).await?;
    /// # Ok(()) }
    /// ```
    pub fn on_gpus(mut self, ids: impl IntoIterator<Item = u32>) -> Self {
        let ids: Vec<u32> = ids.into_iter().collect();
        self.gpus = if ids.is_empty() {
            GpuRequest::None
        } else {
            GpuRequest::Devices(ids)
        };
        self
    }
    /// A name for logs and errors (default `Type#id`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }
    /// Host the actor on a worker that joined by hand (`--rdt-connect`),
    /// possibly on another host, instead of starting a local process.
    /// Waits for one up to the spawn timeout.
    pub fn on_joined_worker(mut self) -> Self {
        self.remote = true;
        self
    }
}

impl<A: Actor> std::future::IntoFuture for Spawn<A> {
    type Output = Result<A::Handle>;
    type IntoFuture = futures::future::BoxFuture<'static, Result<A::Handle>>;
    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            crate::refs::codec::take_refused();
            let args = postcard::to_stdvec(&self.args).map_err(|e| Error::Decode {
                what: format!("constructor argument of {}", A::NAME),
                message: if crate::refs::codec::take_refused() {
                    "it holds an ObjectRef, which a constructor argument cannot carry (the \
                     spawn would not count it); pass the ref to a method of the spawned actor"
                        .into()
                } else {
                    e.to_string()
                },
            })?;
            let short = A::NAME.rsplit("::").next().unwrap_or(A::NAME);
            let raw = if self.remote {
                self.rt
                    .inner
                    .spawn_on_volunteer(A::NAME, short, self.name, args)
                    .await?
            } else {
                self.rt
                    .inner
                    .spawn_raw(A::NAME, short, self.name, args, self.gpus)
                    .await?
            };
            Ok(A::Handle::from(raw))
        })
    }
}

impl Inner {
    pub(crate) fn next_id(&self) -> u64 {
        self.next.fetch_add(1, Ordering::Relaxed)
    }

    pub(crate) fn release_ref(&self, id: u64) {
        let mut st = self.lock();
        let st = &mut *st;
        st.table.dec(id, &st.actors);
    }

    pub(crate) fn actor_pid(&self, actor: u64) -> Option<u32> {
        self.lock().processes.get(&actor).map(|p| p.pid)
    }

    /// Follows the owner table's transfers (XF-6), after every change to
    /// it: arms a deadline for each transfer that started (when one passes,
    /// both ends are aborted and the calls involved fail with a timeout),
    /// and wakes `transfers_settled` when any ended. An ended transfer's
    /// deadline needs no cancelling (DL-2).
    fn sync_transfers(&self, st: &mut State) {
        let (started, ended) = st.table.take_transfer_changes();
        // A timeout too long to add to now (`Duration::MAX`) arms nothing:
        // it is never reached. The clock is read only when a transfer
        // started (this runs after every message).
        let at = (!started.is_empty())
            .then(|| tokio::time::Instant::now().checked_add(self.config.transfer_timeout))
            .flatten();
        if let Some(at) = at {
            let mut wake = false;
            for xfer in started {
                wake |= st.deadlines.arm(xfer, at);
            }
            let table = &st.table;
            st.deadlines
                .prune(table.transfers_in_flight(), |x| table.transfer(x).is_some());
            if wake {
                self.deadline_wake.notify_one();
            }
        }
        if !ended.is_empty() {
            self.settled.notify_waiters();
        }
    }

    /// Expires the transfers whose deadlines have passed (the keeper's
    /// work; DL-2: ended ones are skipped by `transfer_expired`).
    fn expire_due(&self) {
        let due = self.lock().deadlines.due(tokio::time::Instant::now());
        for xfer in due {
            self.transfer_expired(xfer);
        }
    }

    fn transfer_expired(&self, xfer: u64) {
        let mut st = self.lock();
        let st = &mut *st;
        let Some(t) = st.table.transfer(xfer).cloned() else {
            return;
        };
        let err = Error::Timeout {
            what: format!(
                "the {} transfer of object {} from {} to {} (the transfer deadline, RuntimeBuilder::transfer_timeout; both ends were aborted)",
                t.transport,
                t.object,
                t.producer
                    .map(|p| actor_name(&st.actors, p))
                    .unwrap_or_else(|| "the driver".into()),
                actor_name(&st.actors, t.consumer)
            ),
            after_ms: self.config.transfer_timeout.as_millis() as u64,
        };
        tracing::warn!(xfer, object = t.object, "{err}; aborting both ends");
        st.table.abort(xfer, err.clone(), &st.actors);
        break_groups(st, &t, &err.to_string());
        self.sync_transfers(st);
    }

    /// The exit notice of the actor's worker process, if this runtime
    /// started it.
    pub(crate) fn exit_notice(&self, actor: u64) -> Option<watch::Receiver<Option<String>>> {
        self.state
            .lock()
            .processes
            .get(&actor)
            .map(|p| p.exit.clone())
    }

    /// Kills an actor's process through its pidfd (DR-2) and marks it
    /// dead at once (DR-3): a call or pass submitted after `kill` returns
    /// sees the death, whatever the process is still doing while it dies.
    pub(crate) fn kill_actor(&self, actor: u64) {
        let pidfd = self
            .state
            .lock()
            .processes
            .get(&actor)
            .map(|p| p.pidfd.clone());
        match pidfd {
            // Dead already: nothing to signal.
            Some(None) => {}
            Some(Some(fd)) => {
                if pidfd_kill(&fd).is_ok() {
                    self.on_death(
                        actor,
                        "its process was killed by signal 9 (SIGKILL, by RawHandle::kill)".into(),
                    );
                }
            }
            // A worker that joined by hand: ask it to exit.
            None => send_to(&self.lock().actors, actor, &ToWorker::Shutdown),
        }
    }

    async fn wait_value(&self, id: u64) -> Result<WireValue> {
        let rx = {
            let mut st = self.lock();
            let Some(e) = st.table.objects.get_mut(&id) else {
                return Err(Error::Freed { object: id });
            };
            if let Some(settled) = e.state.settled() {
                return settled;
            }
            let (tx, rx) = oneshot::channel();
            e.getters.push(crate::owner::Getter::Value(tx));
            rx
        };
        // Handed the value (OW-14). A dropped sender means the runtime went
        // away. Hot (rdt_transport::hot): a value that arrives within the
        // window is seen at once, not after this thread is woken.
        let settled = hot(rx).await.map_err(|_| Error::Shutdown)?;
        rdt_transport::cuda::timeline("driver getter woke", id);
        settled
    }

    pub(crate) fn submit(
        &self,
        actor: u64,
        method: u32,
        method_name: &str,
        args: Vec<ArgOut>,
        transport: Transport,
    ) -> u64 {
        let id = self.next_id();
        let (wire_args, early) = crate::refs::object_ref::wire_args(&args);
        let msg = SubmitMsg {
            actor,
            method,
            args: wire_args,
            result: id,
            transport,
            error: early,
        };
        let mut guard = self.lock();
        let mut staged = self.stage_call(&mut guard, msg, method_name);
        let orders_to_others = staged.as_ref().is_some_and(|s| {
            guard
                .actors
                .get(&s.actor)
                .and_then(|a| a.conn.as_ref())
                .is_some_and(protocol::deferred_besides)
        });
        if orders_to_others {
            self.orders_first.fetch_add(1, Ordering::Relaxed);
            // The transfers this call needs were ordered on both ends (a
            // delivery to the callee, a send order to a producer: a
            // two-sided transport): their frames are written now, before
            // the call is encoded and queued behind them, so both ends
            // start moving bytes microseconds earlier (the call itself
            // waits for its arguments there anyway). Orders to the callee
            // alone (a one-sided read) go with the call: a write of their
            // own cost a 4 KiB nixl pass 1-1.7 us. The lock is released
            // for the writes (invariant 2); a death meanwhile ended the
            // call (`on_death`), and then it is not sent.
            drop(guard);
            guard = self.lock();
            staged = staged.filter(|s| guard.calls.by_id.contains_key(&s.call));
        }
        if let Some(s) = staged {
            self.send_call(&mut guard, s);
        }
        rdt_transport::cuda::timeline("driver submitted", 0);
        drop(guard);
        // Releases the arguments' refs after `need` and `hold` counted
        // them (outside the lock: dropping a ref takes it).
        drop(args);
        id
    }

    /// A call submitted by the driver or by an actor: its result becomes
    /// a pending object (failed at once if it cannot run), its arguments
    /// are needed by the callee, and the call goes out.
    fn submit_locked(&self, st: &mut State, msg: SubmitMsg, method_name: &str) {
        if let Some(s) = self.stage_call(st, msg, method_name) {
            self.send_call(st, s);
        }
    }

    /// The first half of [`submit_locked`](Self::submit_locked): the
    /// result becomes a pending object, the arguments are needed by the
    /// callee (which orders their transfers) and the call is pending.
    /// Returns the call to send, or `None` if it failed at once.
    fn stage_call(&self, st: &mut State, msg: SubmitMsg, method_name: &str) -> Option<StagedCall> {
        let SubmitMsg {
            actor,
            method,
            args: wire_args,
            result: id,
            transport,
            error,
        } = msg;
        let call = self.next_id();
        rdt_transport::cuda::timeline("driver submit", call);
        let mut arg_ids = Vec::new();
        let mut nested = Vec::new();
        for a in &wire_args {
            match a {
                WireArg::Ref(r) => arg_ids.push(*r),
                WireArg::Value(v) => nested.extend_from_slice(&v.refs),
            }
        }
        let dead = match st.actors.get(&actor) {
            None => Some(Error::Protocol(format!("no actor with id {actor}"))),
            Some(a) => a.dead.as_ref().map(|d| Error::ActorDied {
                actor: a.name.clone(),
                detail: d.clone(),
            }),
        };
        let early = error.or(dead).or_else(|| check_groups(st, actor, &arg_ids));
        if let Some(e) = early {
            st.table.insert_done(id, Some(actor), ObjState::Failed(e));
            return None;
        }
        st.table.insert_pending(id, actor, transport);
        st.table.hold(&nested);
        for &a in &arg_ids {
            let groups = GroupView {
                groups: &st.groups,
                actors: &st.actors,
            };
            st.table.need(a, actor, Some(call), &st.actors, &groups);
        }
        rdt_transport::cuda::timeline("driver arguments needed", call);
        // OW-12: the callee drops these copies itself when the call ends
        // (no `Free` on the next call's path).
        let release: Vec<u64> = arg_ids
            .iter()
            .copied()
            .filter(|&a| st.table.releasable(a, actor))
            .collect();
        st.calls.insert(
            call,
            PendingCall {
                actor,
                result: id,
                args: arg_ids,
                nested,
                span: tracing::info_span!(
                    parent: None,
                    "call",
                    call,
                    actor = %actor_name(&st.actors, actor),
                    method = method_name,
                    result = id,
                    outcome = tracing::field::Empty,
                ),
            },
        );
        tracing::trace!(call, method = method_name, "submit");
        rdt_transport::cuda::timeline("driver call pending", call);
        Some(StagedCall {
            call,
            actor,
            msg: ToWorker::Call(CallMsg {
                call,
                method,
                args: wire_args,
                result: id,
                transport,
                release,
            }),
        })
    }

    /// The second half of [`submit_locked`](Self::submit_locked): the
    /// staged call goes out (behind the frames of the transfers it
    /// needs), and the transfers it started are watched.
    fn send_call(&self, st: &mut State, staged: StagedCall) {
        let StagedCall { call, actor, msg } = staged;
        if let Some(reader) = st.readers.get(&actor) {
            // After the call's frames are written, not before.
            protocol::notify_after_flush(reader);
        }
        rdt_transport::cuda::timeline("driver call sending", call);
        if let Some(conn) = st.actors.get(&actor).and_then(|a| a.conn.as_ref()) {
            if let Err(e) = conn.send(&msg) {
                // Too large to send: the call fails, nothing waits. It
                // never reached its actor: its arguments' receives settle
                // by their own acknowledgements (XF-5).
                let pc = st.calls.remove(&call).expect("staged above");
                end_call(st, pc, Err(e), false, &[], &[]);
            }
        }
        self.sync_transfers(st);
    }

    async fn spawn_raw(
        self: &Arc<Self>,
        type_name: &str,
        short: &str,
        name: Option<String>,
        args: Vec<u8>,
        gpus: GpuRequest,
    ) -> Result<RawHandle> {
        let visible = match &gpus {
            GpuRequest::None => None,
            GpuRequest::Count(n) => {
                static GPU_SPAWNS: std::sync::atomic::AtomicU64 =
                    std::sync::atomic::AtomicU64::new(0);
                let nth = GPU_SPAWNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Some((*n, gpu_assignment(*n, nth)))
            }
            GpuRequest::Devices(ids) => Some((
                ids.len() as u32,
                gpu_devices(ids).map_err(|e| Error::Spawn(format!("{type_name}: {e}")))?,
            )),
        };
        let id = self.next_id();
        let name = name.unwrap_or_else(|| format!("{short}#{id}"));
        let (jtx, jrx) = oneshot::channel();
        let (stx, srx) = oneshot::channel();
        {
            let mut st = self.lock();
            st.joining.insert(id, jtx);
            st.spawning.insert(id, stx);
            st.actors.insert(
                id,
                ActorInfo {
                    name: name.clone(),
                    conn: None,
                    dead: None,
                    host: String::new(),
                    endpoints: HashMap::new(),
                    peer_socket: self.peer_socket(id),
                    gpu: visible
                        .as_ref()
                        .and_then(|(_, d)| d.split(',').next())
                        .map(str::to_string),
                },
            );
        }
        // SP-1: from here on, a spawn that does not finish (an error, or
        // its future dropped) leaves no worker behind.
        let mut unfinished = UnfinishedSpawn {
            inner: self,
            id,
            why: Some(format!(
                "{name}: its spawn was dropped before the actor was constructed"
            )),
        };
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.env(wenv::WORKER_ID, id.to_string())
            .env(wenv::SOCKET, &self.sock)
            .env(wenv::SECRET, hex::encode(self.secret))
            .env(wenv::PARENT_PID, std::process::id().to_string())
            .stdin(std::process::Stdio::null());
        if let Some((_n, devices)) = visible {
            cmd.env("CUDA_VISIBLE_DEVICES", devices);
        }
        // SAFETY: prctl is async-signal-safe; nothing else runs in the child
        // between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (pid, pidfd, exit) = start_reaped(cmd).await?;
        let pidfd = Arc::new(pidfd);
        self.lock().processes.insert(
            id,
            Process {
                pid,
                exit: exit.clone(),
                pidfd: Some(pidfd.clone()),
                _guard: Some(ChildGuard { pidfd }),
            },
        );
        let deadline = tokio::time::Instant::now() + self.config.spawn_timeout;
        let mut exit_w = exit.clone();
        let joined = tokio::select! {
            j = jrx => j.map_err(|_| Error::Spawn(format!("{name}: the runtime closed while it was joining"))),
            _ = exit_w.wait_for(|s| s.is_some()) => Err(Error::Spawn(format!(
                "{name}: the worker process {} before joining; its stderr above says why",
                exit.borrow().clone().unwrap_or_default()))),
            _ = tokio::time::sleep_until(deadline) => Err(Error::Spawn(format!(
                "{name}: the worker did not join within {:?}; does the binary call rdt::init() (or use #[rdt::main]) first thing in main?",
                self.config.spawn_timeout))),
        };
        let joined = joined.map_err(|e| unfinished.fail(e))?;
        joined
            .conn
            .send(&self.spawn_order(type_name, id, &name, args, true))
            .map_err(|e| unfinished.fail(e))?;
        self.constructed(srx, deadline, &name)
            .await
            .map_err(|e| unfinished.fail(e))?;
        unfinished.why = None;
        Ok(RawHandle {
            client: self.clone() as SharedClient,
            actor: id,
            name: name.into(),
        })
    }

    /// Waits for the worker's answer to its spawn order, up to `deadline`.
    async fn constructed(
        &self,
        srx: oneshot::Receiver<Result<()>>,
        deadline: tokio::time::Instant,
        name: &str,
    ) -> Result<()> {
        tokio::select! {
            r = srx => r.unwrap_or_else(|_| Err(Error::Spawn(format!("{name}: worker died while constructing the actor")))),
            _ = tokio::time::sleep_until(deadline) => Err(Error::Spawn(format!("{name}: the actor was not constructed within {:?}", self.config.spawn_timeout))),
        }
    }

    /// The spawn order for a worker. `RuntimeBuilder::tcp_bind` is for
    /// local workers; a remote one binds its `tcp` endpoint to the local
    /// address of its control link (`local == false`).
    fn spawn_order(
        &self,
        type_name: &str,
        id: u64,
        name: &str,
        args: Vec<u8>,
        local: bool,
    ) -> ToWorker {
        ToWorker::Spawn(protocol::SpawnOrder {
            transports: crate::transport::wire_names(),
            actor_type: type_name.to_string(),
            worker: id,
            name: name.to_string(),
            max_frame: self.config.max_frame_bytes,
            tcp_bind: if local {
                self.config.tcp_bind.clone()
            } else {
                None
            },
            transfer_timeout_ms: self.config.transfer_timeout.as_millis() as u64,
            hot_window_us: self.config.hot_window.map(|d| d.as_micros() as u64),
            heartbeat_ms: (!local).then_some(self.config.heartbeat_timeout.as_millis() as u64),
            args: Blob::new(args.into()),
            id_space: protocol::actor_id_space(self.id_spaces.fetch_add(1, Ordering::Relaxed)),
            peer_socket: if local { self.peer_socket(id) } else { None },
            straight_large_values: self.config.straight_large_values,
        })
    }

    /// Where a worker the driver spawns listens for deliveries straight
    /// from producers (`worker::peer`): beside the control socket, in the
    /// runtime's private directory. `None` when peer delivery is off.
    fn peer_socket(&self, id: u64) -> Option<String> {
        let dir = self.sock.parent()?;
        self.config.peer_delivery.then(|| {
            dir.join(format!("peer-{id}.sock"))
                .to_string_lossy()
                .into_owned()
        })
    }

    /// Hosts an actor on a worker that joined by hand (`--rdt-connect`),
    /// waiting for one up to the spawn timeout.
    async fn spawn_on_volunteer(
        self: &Arc<Self>,
        type_name: &str,
        short: &str,
        name: Option<String>,
        args: Vec<u8>,
    ) -> Result<RawHandle> {
        let deadline = tokio::time::Instant::now() + self.config.spawn_timeout;
        let v = loop {
            let notified = self.volunteer_joined.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(v) = self.lock().volunteers.pop_front() {
                break v;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Error::Spawn(format!(
                    "no worker joined with --rdt-connect within {:?}; start one with `BINARY --rdt-connect {}` and RDT_TOKEN set to Runtime::join_token()",
                    self.config.spawn_timeout,
                    self.control_addr.map(|a| a.to_string()).unwrap_or_else(|| "<RuntimeBuilder::listen was not set>".into())
                )));
            }
        };
        let id = self.next_id();
        let name = name.unwrap_or_else(|| format!("{short}#{id}"));
        let (stx, srx) = oneshot::channel();
        {
            let mut st = self.lock();
            st.spawning.insert(id, stx);
            st.actors.insert(
                id,
                ActorInfo {
                    name: name.clone(),
                    conn: Some(v.conn.clone()),
                    dead: None,
                    host: v.host.clone(),
                    endpoints: HashMap::new(),
                    peer_socket: None,
                    gpu: None,
                },
            );
        }
        v.conn
            .send(&self.spawn_order(type_name, id, &name, args, false))?;
        tokio::spawn(read_worker(
            v.rx,
            Arc::downgrade(self),
            id,
            Some(v.conn.clone()),
            self.config.heartbeat_timeout,
        ));
        if let Err(e) = self.constructed(srx, deadline, &name).await {
            let _ = v.conn.send(&ToWorker::Shutdown);
            self.on_death(id, e.to_string());
            return Err(e);
        }
        Ok(RawHandle {
            client: self.clone() as SharedClient,
            actor: id,
            name: name.into(),
        })
    }

    fn on_message(&self, actor: u64, msg: ToDriver) {
        let mut st = self.lock();
        let st = &mut *st;
        // CL-4: a dead actor holds nothing. Its death ended everything its
        // frames could end (calls, transfers, borrows, gets), and a frame
        // takes its counts only when applied: the frames it wrote before
        // it died (still in its socket, or read and waiting for this lock)
        // are dropped, and leave nothing behind.
        if st.actors.get(&actor).is_none_or(|a| a.dead.is_some()) {
            tracing::trace!(actor, "a frame of a dead actor dropped");
            return;
        }
        match msg {
            ToDriver::Spawned(r) => {
                let r = r.map(|endpoints| {
                    if let Some(a) = st.actors.get_mut(&actor) {
                        a.endpoints = endpoints.into_iter().collect();
                    }
                });
                if let Some(tx) = st.spawning.remove(&actor) {
                    let _ = tx.send(r);
                }
            }
            ToDriver::Pong => {}
            ToDriver::CallDone {
                call,
                result,
                delivered,
                released,
                resolved,
            } => {
                let Some(pc) = st.calls.remove(&call) else {
                    tracing::warn!("actor {actor} finished unknown call {call}; ignored");
                    return;
                };
                end_call(st, pc, result, resolved, &delivered, &released);
                rdt_transport::cuda::timeline("driver call ended", call);
                self.sync_transfers(st);
            }
            ToDriver::Received {
                object,
                xfer,
                result,
            } => {
                let groups = GroupView {
                    groups: &st.groups,
                    actors: &st.actors,
                };
                let done = st.table.received(xfer, actor, &result, &st.actors, &groups);
                match (done, result) {
                    (Some(t), Err(e)) => {
                        tracing::warn!(xfer, object, "receive failed: {e}");
                        break_groups(st, &t, &e.to_string());
                    }
                    (Some(_), Ok(())) => tracing::trace!(xfer, object, "transfer done"),
                    (None, _) => {}
                }
                self.sync_transfers(st);
            }
            ToDriver::Fetched { req, result } => {
                if let Some((_, tx)) = st.fetches.remove(&req) {
                    let _ = tx.send(result);
                }
            }
            ToDriver::TransferFailed {
                object,
                xfer,
                peer,
                transport,
                message,
            } => {
                let reason = format!(
                    "{} send of object {object} from {} to {} failed: {message}",
                    transport.map_or("the", |t| t.name()),
                    actor_name(&st.actors, actor),
                    actor_name(&st.actors, peer)
                );
                tracing::warn!(xfer, object, "{reason}");
                let err = Error::Transport(rdt_transport::TransportError {
                    transport: transport.map_or_else(String::new, |t| t.to_string()),
                    peer: Some(actor_name(&st.actors, actor)),
                    message: format!("the producer's send failed: {message}"),
                });
                // XF-6: the consumer's receive stops now, not at its
                // deadline.
                if let Some(t) = st.table.send_failed(xfer, err, &st.actors) {
                    break_groups(st, &t, &reason);
                }
            }
            ToDriver::GroupReady { group, result } | ToDriver::GroupDestroyed { group, result } => {
                let result = result.map(|()| Vec::new());
                let result = result.map_err(|e| group_error(&st.actors, actor, group, e));
                GroupOp::answered(&mut st.group_ops, group, actor, result);
            }
            ToDriver::GroupPrepared { group, result } => {
                let result = result.map_err(|e| group_error(&st.actors, actor, group, e));
                GroupOp::answered(&mut st.group_ops, group, actor, result);
            }
            ToDriver::Hello { .. } => tracing::warn!("actor {actor} said hello twice; ignored"),
            ToDriver::Submit(msg) => {
                if !self.new_actor_object(st, actor, msg.result) {
                    return;
                }
                self.submit_locked(st, msg, "(submitted by an actor)");
            }
            ToDriver::Put { object, value } => {
                if !self.new_actor_object(st, actor, object) {
                    return;
                }
                let through_driver = value.transport == Transport::ObjectStore;
                let producer = (!through_driver).then_some(actor);
                st.table.insert_put(object, producer, value);
            }
            ToDriver::Borrow(ids) => {
                for id in ids {
                    if !st.table.objects.contains_key(&id) {
                        // CL-3 makes this impossible; say so if it happens.
                        tracing::error!(
                            "actor {actor} borrowed object {id}, which the owner table no longer has"
                        );
                        continue;
                    }
                    st.table.inc(id);
                    *st.borrows.entry(actor).or_default().entry(id).or_default() += 1;
                }
            }
            ToDriver::Release(ids) => {
                for id in ids {
                    let held = st.borrows.get_mut(&actor).and_then(|b| {
                        let n = b.get_mut(&id)?;
                        *n -= 1;
                        if *n == 0 {
                            b.remove(&id);
                        }
                        Some(())
                    });
                    match held {
                        Some(()) => st.table.dec(id, &st.actors),
                        None => tracing::warn!(
                            "actor {actor} released object {id}, which it did not borrow; ignored"
                        ),
                    }
                }
                self.sync_transfers(st);
            }
            ToDriver::Get { object } => {
                *st.gets.entry((actor, object)).or_default() += 1;
                let groups = GroupView {
                    groups: &st.groups,
                    actors: &st.actors,
                };
                st.table.need(object, actor, None, &st.actors, &groups);
                self.sync_transfers(st);
            }
            ToDriver::GetDone { object } => {
                let Some(n) = st.gets.get_mut(&(actor, object)) else {
                    tracing::warn!("actor {actor} ended a get of object {object} it never began");
                    return;
                };
                *n -= 1;
                if *n == 0 {
                    st.gets.remove(&(actor, object));
                }
                st.table.unneed(&[object], actor, &st.actors);
                self.sync_transfers(st);
            }
            ToDriver::Watch { req, object } => match settled(st, object) {
                Some(result) => send_to(&st.actors, actor, &ToWorker::Settled { req, result }),
                None => {
                    let (tx, rx) = oneshot::channel();
                    if let Some(e) = st.table.objects.get_mut(&object) {
                        e.getters.push(crate::owner::Getter::Signal(tx));
                    }
                    let me = self.me.clone();
                    self.tokio.spawn(async move {
                        let _ = rx.await;
                        let Some(inner) = me.upgrade() else { return };
                        let st = inner.lock();
                        let result = settled(&st, object).unwrap_or(Err(Error::Shutdown));
                        send_to(&st.actors, actor, &ToWorker::Settled { req, result });
                    });
                }
            },
            ToDriver::Probe { req, object } => {
                let state = settled(st, object);
                send_to(&st.actors, actor, &ToWorker::Probed { req, state });
            }
            ToDriver::Kill { actor: target } => {
                // Off this lock: killing takes it.
                let me = self.me.clone();
                self.tokio.spawn(async move {
                    if let Some(inner) = me.upgrade() {
                        inner.kill_actor(target);
                    }
                });
            }
        }
    }

    /// An actor made object `id` (a call's result or a put value): it must
    /// be from an actor's id space and new; the actor borrows it (CL-1).
    fn new_actor_object(&self, st: &mut State, actor: u64, id: u64) -> bool {
        if id >> 63 == 0 || st.table.objects.contains_key(&id) {
            tracing::error!(
                "actor {actor} made object {id}, which is not a new id of an actor's id space; ignored"
            );
            return false;
        }
        *st.borrows.entry(actor).or_default().entry(id).or_default() += 1;
        true
    }

    fn on_death(&self, actor: u64, detail: String) {
        if !self.mark_dead(actor, detail) {
            return;
        }
        // The driver's own transports drop what they keep for it (a NIXL
        // agent forgets its metadata): off the state lock, since that may
        // block (UCX disconnects). Actor ids are never reused.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("rdt::peer_gone");
        for t in Transport::registered() {
            if let Some(inst) = t.existing_instance() {
                inst.peer_gone(actor);
            }
        }
    }

    /// The death of `actor`, under the state lock: everything it held or
    /// waited for ends. False if it was dead or unknown already.
    fn mark_dead(&self, actor: u64, detail: String) -> bool {
        let mut st = self.lock();
        let st = &mut *st;
        let Some(info) = st.actors.get_mut(&actor) else {
            return false;
        };
        if info.dead.is_some() {
            return false;
        }
        info.dead = Some(detail.clone());
        info.conn = None;
        // A dead worker keeps its name and cause of death (for errors), not
        // its pidfd: the guard's kill is a no-op or finishes a dying
        // process, and the descriptor is closed.
        if let Some(p) = st.processes.get_mut(&actor) {
            p.pidfd = None;
            p._guard = None;
        }
        let err = Error::ActorDied {
            actor: info.name.clone(),
            detail,
        };
        if st.shutting_down {
            // Stopped by `shutdown`, as asked: not news.
            tracing::debug!("{err}");
        } else {
            tracing::warn!("{err}");
        }
        if let Some(tx) = st.spawning.remove(&actor) {
            let _ = tx.send(Err(err.clone()));
        }
        let failed = st.calls.of(actor);
        for c in failed {
            let pc = st.calls.remove(&c).expect("listed above");
            end_call(st, pc, Err(err.clone()), false, &[], &[]);
        }
        // CL-4: what it borrowed and was getting, it holds no more.
        let gets: Vec<(u64, usize)> = st
            .gets
            .iter()
            .filter(|((a, _), _)| *a == actor)
            .map(|((_, o), n)| (*o, *n))
            .collect();
        for (object, n) in gets {
            st.gets.remove(&(actor, object));
            st.table.unneed(&vec![object; n], actor, &st.actors);
        }
        if let Some(borrowed) = st.borrows.remove(&actor) {
            for (object, n) in borrowed {
                st.table.unhold(&vec![object; n], &st.actors);
            }
        }
        let fetches: Vec<u64> = st
            .fetches
            .iter()
            .filter(|(_, (a, _))| *a == actor)
            .map(|(k, _)| *k)
            .collect();
        for f in fetches {
            if let Some((_, tx)) = st.fetches.remove(&f) {
                let _ = tx.send(Err(err.clone()));
            }
        }
        st.table.actor_died(actor, &err, &st.actors);
        self.sync_transfers(st);
        // Group creates and destroys waiting for it end now.
        let ops: Vec<u64> = st
            .group_ops
            .iter()
            .filter(|(_, op)| op.waiting.contains(&actor))
            .map(|(g, _)| *g)
            .collect();
        for g in ops {
            GroupOp::answered(&mut st.group_ops, g, actor, Err(err.clone()));
        }
        // Transports in the other workers drop what they keep for it.
        for (id, a) in st.actors.iter() {
            if *id != actor && a.dead.is_none() {
                send_to(&st.actors, *id, &ToWorker::PeerGone { actor });
            }
        }
        // A collective group cannot go on without a member (as in Ray):
        // tear down every group it was in, so later passes fail at once.
        let reason = format!("its member {} died", err_actor(&err));
        break_groups_where(st, |g| g.members.contains(&actor), &reason);
        true
    }
}

/// The driver's side of the one client API: counts are owner-table
/// counts (CL-1); calls are staged here; kills go through the pidfd.
impl Client for Inner {
    fn clone_ref(&self, id: u64) {
        self.lock().table.inc(id)
    }
    fn release_ref(&self, id: u64) {
        Inner::release_ref(self, id)
    }
    fn adopt_from_wire(&self, id: u64) {
        self.lock().table.inc(id)
    }
    fn submit(
        &self,
        actor: u64,
        method: u32,
        method_name: &'static str,
        args: Vec<ArgOut>,
        transport: Transport,
    ) -> u64 {
        Inner::submit(self, actor, method, method_name, args, transport)
    }
    fn kill(&self, actor: u64) {
        self.kill_actor(actor)
    }
    fn pid(&self, actor: u64) -> Option<u32> {
        self.actor_pid(actor)
    }
    fn exit_notice(&self, actor: u64, name: &str) -> Result<watch::Receiver<Option<String>>> {
        Inner::exit_notice(self, actor).ok_or_else(|| {
            Error::Protocol(format!(
                "{name} runs in a worker that joined by hand: its exit cannot be observed here"
            ))
        })
    }
}

/// Whether object `id` is finished: `Some(Ok)` ready, `Some(Err)` failed
/// or gone, `None` pending.
fn settled(st: &State, id: u64) -> Option<Result<()>> {
    match st.table.objects.get(&id).map(|e| &e.state) {
        None => Some(Err(Error::Freed { object: id })),
        Some(ObjState::Ready(_)) => Some(Ok(())),
        Some(ObjState::Failed(e)) => Some(Err(e.clone())),
        Some(ObjState::Pending) => None,
    }
}

/// A call ended (its reply, its callee's death, or a send that failed):
/// its result is recorded, its arguments and the refs in them released.
/// `resolved`: the call got past argument resolution (XF-5);
/// `delivered`: the transfers its producer carried out itself
/// (`DeliverTo`, PD-1); `released`: the argument copies its callee dropped
/// itself (OW-12).
fn end_call(
    st: &mut State,
    pc: PendingCall,
    outcome: Result<WireValue>,
    resolved: bool,
    delivered: &[u64],
    released: &[u64],
) {
    let groups = GroupView {
        groups: &st.groups,
        actors: &st.actors,
    };
    pc.span
        .record("outcome", if outcome.is_ok() { "ok" } else { "err" });
    st.table.counts.call_ended(outcome.is_ok());
    let ended = crate::owner::CallEnd {
        outcome,
        resolved,
        delivered,
        released,
    };
    st.table
        .call_done(pc.result, ended, pc.actor, &pc.args, &st.actors, &groups);
    st.table.unhold(&pc.nested, &st.actors);
}

/// A ref on a collective transport may only go to an actor that shares a
/// live group of that backend with its producer.
fn check_groups(st: &State, consumer: u64, args: &[u64]) -> Option<Error> {
    for &id in args {
        let e = st.table.objects.get(&id)?;
        let Some(producer) = e.producer else { continue };
        if matches!(e.state, ObjState::Failed(_)) {
            continue;
        }
        let lookup = GroupView {
            groups: &st.groups,
            actors: &st.actors,
        };
        if let Err(err) = lookup.group_for(e.transport.name(), id, producer, consumer) {
            return Some(err);
        }
    }
    None
}

/// The driver's groups as the owner table sees them (OW-8).
struct GroupView<'a> {
    groups: &'a HashMap<u64, Group>,
    actors: &'a Actors,
}

impl GroupLookup for GroupView<'_> {
    fn group_for(
        &self,
        transport: &str,
        object: u64,
        producer: u64,
        consumer: u64,
    ) -> Result<Option<(u64, u32, u32)>> {
        let Ok(t) = transport.parse::<Transport>() else {
            return Ok(None);
        };
        if !t.is_collective() || producer == consumer {
            return Ok(None);
        }
        let shared: Vec<(&u64, &Group)> = self
            .groups
            .iter()
            .filter(|(_, g)| {
                g.backend == t
                    && g.ready
                    && g.members.contains(&producer)
                    && g.members.contains(&consumer)
            })
            .collect();
        if let Some((id, g)) = shared.iter().find(|(_, g)| g.broken.is_none()) {
            let rank = |a: u64| g.ranks.iter().position(|r| *r == a).unwrap_or(0) as u32;
            return Ok(Some((**id, rank(producer), rank(consumer))));
        }
        Err(match shared.first() {
            Some((gid, g)) => Error::GroupBroken {
                group: **gid,
                transport: t.name().into(),
                reason: g.broken.clone().unwrap_or_default(),
            },
            None => Error::NotInGroup {
                object,
                transport: t.name().into(),
                backend: t.rust_expr(),
                producer: actor_name(self.actors, producer),
                consumer: actor_name(self.actors, consumer),
            },
        })
    }
}

/// A member's failure to take part in a group, naming the member.
fn group_error(actors: &Actors, actor: u64, group: u64, e: Error) -> Error {
    Error::Group(format!(
        "{} could not take part in group {group}: {e}",
        actor_name(actors, actor)
    ))
}

/// A failed transfer on a collective transport tears down the group its
/// ends share (its communicator may be in any state now).
fn break_groups(st: &mut State, t: &crate::owner::InFlight, reason: &str) {
    let Some(p) = t.producer else { return };
    break_groups_where(
        st,
        |g| g.backend == t.transport && g.members.contains(&p) && g.members.contains(&t.consumer),
        reason,
    );
}

/// Tears down every live group `which` selects: later passes in it fail
/// at once with `GroupBroken`, and every live member's backend stops what
/// is in flight in it (`AbortGroup`, XF-2/XF-6).
fn break_groups_where(st: &mut State, which: impl Fn(&Group) -> bool, reason: &str) {
    for (id, g) in st.groups.iter_mut() {
        if g.broken.is_some() || !which(g) {
            continue;
        }
        tracing::warn!("tearing down collective group {id}: {reason}");
        g.broken = Some(reason.to_string());
        for a in &g.ranks {
            send_to(
                &st.actors,
                *a,
                &ToWorker::AbortGroup {
                    group: *id,
                    reason: reason.to_string(),
                },
            );
        }
    }
}

fn err_actor(e: &Error) -> &str {
    match e {
        Error::ActorDied { actor, .. } => actor,
        _ => "?",
    }
}

/// The pid, a pidfd and the exit notice of a worker started by
/// [`start_reaped`].
type Reaped = (u32, std::os::fd::OwnedFd, watch::Receiver<Option<String>>);

/// Spawns `cmd` from a thread that then waits for it (DR-1). The pidfd is
/// opened before the reaper waits, so it names our child and nothing else
/// (DR-2).
///
/// SP-2: the start runs on the reaper's thread and this waits for it
/// without blocking its executor thread. A caller gone by then (its spawn
/// dropped) leaves the child to the reaper, which kills it.
async fn start_reaped(mut cmd: std::process::Command) -> Result<Reaped> {
    let (tx, rx) = watch::channel(None);
    let (ptx, prx) = oneshot::channel();
    std::thread::Builder::new()
        .name("rdt-reaper".into())
        .spawn(move || {
            // Tests slow a process start down.
            #[cfg(feature = "failpoints")]
            fail::fail_point!("rdt::reaper_spawn");
            match cmd.spawn() {
                Err(e) => {
                    let _ = ptx.send(Err(e));
                }
                Ok(mut child) => {
                    let pid = child.id();
                    // SAFETY: plain syscall; `pid` is our unreaped child (only
                    // this thread waits for it, below), so it cannot name
                    // another process.
                    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
                    let opened = if fd < 0 {
                        Err(std::io::Error::last_os_error())
                    } else {
                        // SAFETY: a fresh descriptor that nothing else owns.
                        Ok(unsafe {
                            <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32)
                        })
                    };
                    let failed = opened.is_err();
                    // Nobody to take it (its spawn was dropped): nobody else
                    // would kill it.
                    let unwanted = ptx.send(opened.map(|fd| (pid, fd))).is_err();
                    if failed || unwanted {
                        let _ = child.kill();
                    }
                    let status = match child.wait() {
                        Ok(s) => describe_exit(s),
                        Err(e) => format!("could not be waited for ({e})"),
                    };
                    let _ = tx.send(Some(status));
                }
            }
        })?;
    // Dropped before it takes the started child (its spawn was dropped),
    // this kills it: before the reaper's answer, the reaper does (the
    // answer finds nobody); after it, the guard does, through its pidfd.
    struct Unclaimed(Option<oneshot::Receiver<std::io::Result<(u32, std::os::fd::OwnedFd)>>>);
    impl Drop for Unclaimed {
        fn drop(&mut self) {
            if let Some(mut rx) = self.0.take() {
                rx.close();
                if let Ok(Ok((_, fd))) = rx.try_recv() {
                    let _ = pidfd_kill(&fd);
                }
            }
        }
    }
    let mut unclaimed = Unclaimed(Some(prx));
    let answer = match unclaimed.0.as_mut() {
        Some(rx) => rx.await,
        None => unreachable!("set above"),
    };
    unclaimed.0 = None;
    let (pid, fd) = answer
        .map_err(|_| Error::Spawn("the reaper thread died".into()))?
        .map_err(|e| Error::Spawn(format!("could not start a worker process (spawn or pidfd_open): {e}; rdt needs Linux 5.3 or later")))?;
    Ok((pid, fd, rx))
}

fn describe_exit(s: std::process::ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => format!("exited with status {c}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended".to_string(),
    }
}

async fn accept_loop(listener: UnixListener, rt: Weak<Inner>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("control socket accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        protocol::size_socket_buffers(&stream);
        let Some(inner) = rt.upgrade() else { return };
        let secret = inner.secret;
        drop(inner);
        let rt = rt.clone();
        tokio::spawn(async move {
            let mut stream = stream;
            let joined = match protocol::accept_plain(&mut stream, secret).await {
                Ok(()) => {
                    let s = stream;
                    let (r, w) = s.into_split();
                    serve_worker(
                        protocol::ReadHalf::Unix(r),
                        protocol::WriteHalf::Unix(w),
                        rt,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = joined {
                tracing::warn!("dropped a control connection: {e}");
            }
        });
    }
}

/// Accepts workers started by hand (`--rdt-connect`) on the TCP control
/// address.
async fn accept_tcp_loop(
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    rt: Weak<Inner>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("control TCP accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(inner) = rt.upgrade() else { return };
        let secret = inner.secret;
        drop(inner);
        let rt = rt.clone();
        let tls = tls.clone();
        let _ = stream.set_nodelay(true);
        let mut stream = stream;
        tokio::spawn(async move {
            let _ = set_keepalive(&stream);
            let joined = match tls {
                Some(acceptor) => match protocol::accept_tls(stream, &acceptor, secret).await {
                    Ok(s) => {
                        let (r, w) = tokio::io::split(s);
                        serve_worker(
                            protocol::ReadHalf::Tls(r),
                            protocol::WriteHalf::Tls(tokio::sync::Mutex::new(w)),
                            rt,
                        )
                        .await
                    }
                    Err(e) => Err(e),
                },
                None => match protocol::accept_plain(&mut stream, secret).await {
                    Ok(()) => {
                        let s = stream;
                        let (r, w) = s.into_split();
                        serve_worker(protocol::ReadHalf::Tcp(r), protocol::WriteHalf::Tcp(w), rt)
                            .await
                    }
                    Err(e) => Err(e),
                },
            };
            if let Err(e) = joined {
                tracing::warn!("dropped a control connection from {peer}: {e}");
            }
        });
    }
}

/// Lets the kernel notice a vanished remote peer too (beside heartbeats).
fn set_keepalive(s: &tokio::net::TcpStream) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let on: libc::c_int = 1;
    // SAFETY: setsockopt on a socket we own, with a correctly sized value.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_KEEPALIVE,
            &on as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// A worker that joined by hand and waits for an actor to host.
pub(crate) struct Volunteer {
    conn: protocol::Sender,
    rx: protocol::Receiver<protocol::ReadHalf>,
    host: String,
}

async fn serve_worker(
    r: protocol::ReadHalf,
    w: protocol::WriteHalf,
    rt: Weak<Inner>,
) -> Result<()> {
    let (max, heartbeat) = {
        let inner = rt.upgrade().ok_or(Error::Shutdown)?;
        (inner.config.max_frame_bytes, inner.config.heartbeat_timeout)
    };
    let remote = !matches!(r, protocol::ReadHalf::Unix(_));
    let mut rx = protocol::Receiver::new(r, max);
    let hello = tokio::time::timeout(protocol::HANDSHAKE_TIMEOUT, rx.recv::<ToDriver>())
        .await
        .map_err(|_| Error::Protocol("no hello in time".into()))??;
    let Some(ToDriver::Hello { worker, host, .. }) = hello else {
        return Err(Error::Protocol("first frame was not a hello".into()));
    };
    let conn = protocol::spawn_writer(w, max);
    let inner = rt.upgrade().ok_or(Error::Shutdown)?;
    // A value forwarded while it arrives (cut-through) holds this
    // connection until its last byte: a producer stopped mid-value costs
    // the consumer at most the transfer deadline.
    conn.set_stall_limit(inner.config.transfer_timeout);
    if remote {
        if worker != 0 {
            return Err(Error::Protocol(
                "a worker joining over TCP must not claim an id".into(),
            ));
        }
        tracing::info!("a worker on {host} joined and waits for an actor");
        inner
            .state
            .lock()
            .volunteers
            .push_back(Volunteer { conn, rx, host });
        inner.volunteer_joined.notify_one();
        return Ok(());
    }
    {
        let mut st = inner.lock();
        let Some(tx) = st.joining.remove(&worker) else {
            return Err(Error::Protocol(format!(
                "hello from unknown worker {worker}"
            )));
        };
        if let Some(a) = st.actors.get_mut(&worker) {
            a.conn = Some(conn.clone());
            a.host = host;
        }
        let _ = tx.send(Joined { conn });
    }
    drop(inner);
    read_worker(rx, rt, worker, None, heartbeat).await;
    Ok(())
}

/// Reads a worker's messages until its connection ends, then reports its
/// death. With `ping` set (remote workers), a worker silent for longer
/// than `heartbeat` is declared dead too: a cut link gives no end of
/// stream.
async fn read_worker(
    mut rx: protocol::Receiver<protocol::ReadHalf>,
    rt: Weak<Inner>,
    worker: u64,
    ping: Option<protocol::Sender>,
    heartbeat: Duration,
) {
    let wake = Arc::new(tokio::sync::Notify::new());
    if let Some(inner) = rt.upgrade() {
        inner.lock().readers.insert(worker, wake.clone());
    }
    let mut last = tokio::time::Instant::now();
    let mut seen = rx.bytes_read();
    let end = loop {
        // Hot (rdt_transport::hot) while the worker runs calls of ours:
        // their answers are read at once, not after this thread is woken.
        // Idle workers' readers sleep (a driver may have thousands), and
        // a submit wakes them into the hot read (recv is cancel-safe).
        let recv = async {
            loop {
                let busy = rt.upgrade().is_some_and(|i| i.lock().calls.any_for(worker));
                if busy {
                    rdt_transport::cuda::timeline("driver reader hot", worker);
                    return hot(rx.recv::<ToDriver>()).await;
                }
                rdt_transport::cuda::timeline("driver reader asleep", worker);
                tokio::select! {
                    m = rx.recv::<ToDriver>() => return m,
                    _ = wake.notified() => continue,
                }
            }
        };
        let msg = match &ping {
            None => recv.await,
            Some(conn) => {
                // recv is cancel-safe: a frame in progress stays buffered.
                match tokio::time::timeout(heartbeat / 4, recv).await {
                    Ok(m) => m,
                    Err(_) => {
                        // HB-1: bytes of a frame still arriving are a
                        // live peer (a large frame may take longer than
                        // the heartbeat).
                        if rx.bytes_read() != seen {
                            seen = rx.bytes_read();
                            last = tokio::time::Instant::now();
                        }
                        if last.elapsed() > heartbeat {
                            break format!(
                                "went silent for {heartbeat:?} (no heartbeat; network cut?)"
                            );
                        }
                        let _ = conn.send(&ToWorker::Ping);
                        continue;
                    }
                }
            }
        };
        last = tokio::time::Instant::now();
        // Tests slow the driver's reading down, so that frames queue up.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("rdt::driver_read");
        match msg {
            Ok(Some(msg)) => match rt.upgrade() {
                Some(inner) => {
                    handle_from_worker(&inner, worker, msg);
                }
                None => return,
            },
            Ok(None) => break "closed its control connection".to_string(),
            Err(e) => break format!("broke its control connection ({e})"),
        }
    };
    let Some(inner) = rt.upgrade() else { return };
    inner.lock().readers.remove(&worker);
    // Prefer the exit status, if the process is gone, to the socket's story.
    let exit = inner
        .state
        .lock()
        .processes
        .get(&worker)
        .map(|p| p.exit.clone());
    let detail = match exit {
        Some(mut e) => {
            let _ = tokio::time::timeout(Duration::from_secs(1), e.wait_for(|s| s.is_some())).await;
            let s = e.borrow().clone();
            match s {
                Some(s) => format!("its process {s}"),
                None => format!("it {end}"),
            }
        }
        None => format!("it {end}"),
    };
    inner.on_death(worker, detail);
}

/// One message of worker `worker`, handled (with its timeline points).
fn handle_from_worker(inner: &Inner, worker: u64, msg: ToDriver) {
    let (got, handled, id) = match &msg {
        ToDriver::CallDone { call, .. } => {
            ("driver got call done", "driver handled call done", *call)
        }
        ToDriver::Received { xfer, .. } => {
            ("driver got received", "driver handled received", *xfer)
        }
        _ => ("driver got message", "driver handled message", 0),
    };
    rdt_transport::cuda::timeline(got, id);
    inner.on_message(worker, msg);
    rdt_transport::cuda::timeline(handled, id);
}

/// The devices (as `CUDA_VISIBLE_DEVICES` entries) a worker asking for `n`
/// GPUs gets: taken round-robin, by worker id, from `RDT_GPUS` (a
/// comma-separated list), else from the driver's own
/// `CUDA_VISIBLE_DEVICES`, else from the devices `nvidia-smi` would number
/// 0..count (counted through `/proc/driver/nvidia/gpus`, or 1 if that is
/// absent). Several workers may share one device (fractional GPUs); a
/// worker never gets the same device twice.
pub(crate) fn gpu_assignment(n: u32, worker: u64) -> String {
    let pool = gpu_pool();
    let k = (n as usize).min(pool.len());
    let start = worker as usize % pool.len();
    (0..k)
        .map(|i| pool[(start + i) % pool.len()].clone())
        .collect::<Vec<_>>()
        .join(",")
}

/// The `CUDA_VISIBLE_DEVICES` value for [`Spawn::on_gpus`]`(ids)`: those
/// entries of the pool, in order.
pub(crate) fn gpu_devices(ids: &[u32]) -> std::result::Result<String, String> {
    let pool = gpu_pool();
    let mut out: Vec<&str> = Vec::with_capacity(ids.len());
    for (i, &id) in ids.iter().enumerate() {
        if ids[..i].contains(&id) {
            return Err(format!("GPU {id} is listed twice in on_gpus({ids:?})"));
        }
        match pool.get(id as usize) {
            Some(d) => out.push(d),
            None => {
                return Err(format!(
                    "on_gpus({ids:?}): there is no GPU {id}; the pool has {} ({})",
                    pool.len(),
                    pool.join(",")
                ))
            }
        }
    }
    Ok(out.join(","))
}

/// The devices GPU workers are placed on (see [`gpu_assignment`]).
/// GR-1: NCCL refuses two ranks on one device ("Duplicate GPU
/// detected"): two members of a `nccl` group that the driver gave the same
/// GPU are refused here, naming both, before any member is asked to join.
/// Members whose GPU the driver did not assign (joined workers) are left to
/// NCCL.
fn refuse_shared_gpus(actors: &Actors, members: &[ActorId]) -> Result<()> {
    let mut seen: HashMap<&str, &str> = HashMap::new();
    for m in members {
        let Some(info) = actors.get(&m.0) else {
            continue;
        };
        let Some(gpu) = info.gpu.as_deref() else {
            continue;
        };
        if let Some(first) = seen.insert(gpu, &info.name) {
            return Err(Error::Group(format!(
                "{first} and {} are both on GPU {gpu} (the same GPU): NCCL takes one rank per                  device; give each member its own GPU (`.gpus(1)` with enough devices, or                  `.on_gpus([..])`), or use `cuda_ipc` or `nixl` between actors on one GPU",
                info.name
            )));
        }
    }
    Ok(())
}

fn gpu_pool() -> Vec<String> {
    let list = |v: String| -> Vec<String> {
        v.split(',')
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
            .collect()
    };
    crate::env::var("RDT_GPUS")
        .ok()
        .map(list)
        .filter(|l| !l.is_empty())
        .or_else(|| {
            crate::env::var("CUDA_VISIBLE_DEVICES")
                .ok()
                .map(list)
                .filter(|l| !l.is_empty())
        })
        .unwrap_or_else(|| {
            let count = std::fs::read_dir("/proc/driver/nvidia/gpus")
                .map(|d| d.count())
                .unwrap_or(1)
                .max(1);
            (0..count).map(|i| i.to_string()).collect()
        })
}

#[cfg(test)]
mod gpu_assignment_tests {
    #[test]
    fn round_robin_over_rdt_gpus() {
        std::env::set_var("RDT_GPUS", "3,5");
        assert_eq!(super::gpu_assignment(1, 0), "3");
        assert_eq!(super::gpu_assignment(1, 1), "5");
        assert_eq!(super::gpu_assignment(1, 2), "3");
        assert_eq!(super::gpu_assignment(2, 1), "5,3");
        assert_eq!(super::gpu_assignment(4, 0), "3,5");
        assert_eq!(super::gpu_devices(&[1]).unwrap(), "5");
        assert_eq!(super::gpu_devices(&[1, 0]).unwrap(), "5,3");
        assert!(super::gpu_devices(&[2]).unwrap_err().contains("no GPU 2"));
        assert!(super::gpu_devices(&[0, 0]).unwrap_err().contains("twice"));
        std::env::remove_var("RDT_GPUS");
    }
}

#[cfg(test)]
mod security_tests {
    use std::os::unix::fs::PermissionsExt;

    #[tokio::test]
    async fn control_socket_lives_in_a_private_directory() {
        tokio::time::timeout(std::time::Duration::from_secs(10), async {
            let rt = super::Runtime::start().await.unwrap();
            let dir = rt.inner.sock.parent().unwrap();
            let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{dir:?}");
            assert!(
                rt.control_address().is_none(),
                "no TCP listener unless asked for"
            );
        })
        .await
        .unwrap();
    }
}
