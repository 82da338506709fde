//! Deliveries straight from a producer to a consumer (the owner table's
//! OW-9).
//!
//! A value passed from one actor to another used to cross the driver
//! twice: the producer's reply, then the driver's `Deliver` to the
//! consumer. On the GPU hosts each hop between processes costs a few µs
//! and the driver's decode, decision and write of the delivery several
//! more, about 10 µs of a 50 µs cached `cuda_ipc` hand-off. When the
//! consumer's call is submitted while the producing call still runs (the
//! usual case: both are submitted at once), the driver asks the producer
//! (`DeliverTo`) to hand the value over itself when the call finishes, on
//! a connection between the two workers. The consumer's receive and its
//! acknowledgement to the driver are the same as for a driver's delivery.
//!
//! # Invariants
//! - **PD-1 (one decider):** the producer's actor thread decides, once,
//!   as the call finishes, which orders it carries out: those that came
//!   while the call was open here and whose link is up. Its `CallDone`
//!   names them (`delivered`); the driver delivers to every other consumer
//!   itself, as if it had never given the order. An order that comes
//!   before its call or after the call finished finds no open call and is
//!   dropped: the `CallDone` does not name it.
//! - **PD-2 (values only):** only a value goes straight, of a one-sided
//!   transport or through the driver (`object_store`: it goes to the
//!   driver in the `CallDone` too, which keeps it). Errors stay on the
//!   driver's path, which owns failure (OW-4). A value through the driver
//!   whose straight bytes did not all come is not stored by the consumer:
//!   the driver delivers its own copy, or the error (OW-11). A value that
//!   holds refs stays on the driver's path too: a ref the method made
//!   (`put_with`) is known to the driver only once it read the producer's
//!   `Put`, on another connection than the consumer's `Borrow` and `Get`,
//!   so a consumer that met it first would find no such object (CL-2).
//! - **PD-3 (links off the actor's thread):** a link is made by a task of
//!   the control loop when the first order for that consumer comes; the
//!   actor's thread only uses links that are up, so a pass never waits for
//!   a connection (the first one to a consumer goes through the driver). A
//!   link that closes is forgotten and made again by a later order; links
//!   to a dead actor go with `PeerGone`.
//! - **PD-4 (who may deliver):** a worker the driver spawned listens on a
//!   Unix socket in the runtime's private directory (mode 0700); a peer
//!   proves the runtime's secret before its first frame is read, and only
//!   `Deliver` frames are taken from it.
//! - **PD-5 (a delivery that never comes):** the driver aborts a straight
//!   transfer whose producer died or whose deadline passed; a consumer
//!   that gets the abort before the delivery stores the error for the
//!   object (the call waiting for it fails) and drops the delivery if it
//!   comes after all. An abort for a delivery that already came (it
//!   crossed the acknowledgement, and the call may have released the copy
//!   since, WK-13) is no such case: it is dropped. Both records are
//!   bounded ([`RECENT`]).

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rdt_transport::rt::hot::hot;
use rdt_transport::{Peer, Sidedness};
use tokio::net::UnixStream;

use super::WorkerShared;
use crate::error::{Error, Result};
use crate::protocol::{self, Delivery, PeerSocket, ToWorker, WireValue};

/// After a link could not be made, orders for that consumer wait this long
/// before trying again (their values go through the driver meanwhile).
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The worker's side of straight deliveries: as a producer (orders, links)
/// and as a consumer (what it was given up on, counts).
pub(super) struct PeerDelivery {
    /// This worker's host and transport endpoints, as the driver tells
    /// consumers (`Delivery::from`).
    host: String,
    endpoints: HashMap<String, String>,
    /// The runtime's secret, proven on each link (PD-4).
    secret: [u8; 32],
    max_frame: usize,
    /// Orders for the calls open here, by result object (PD-1): present
    /// from the call's arrival until it finishes.
    orders: Mutex<HashMap<u64, Vec<Order>>>,
    /// Links to consumers, by actor.
    links: Arc<Mutex<HashMap<u64, Link>>>,
    /// Straight transfers the driver aborted before their delivery came
    /// (PD-5).
    given_up: Mutex<RecentTransfers>,
    /// Straight transfers whose delivery came (PD-5).
    arrived: Mutex<RecentTransfers>,
    /// Deliveries this worker received straight from producers.
    received: AtomicU64,
    /// Whether values through the driver of [`STRAIGHT_LARGE_FROM`] bytes
    /// or more go straight too.
    straight_large: bool,
}

/// Values through the driver of at least this many tensor bytes go
/// straight only where [`RuntimeBuilder::straight_large_values`] says so
/// (by default on machines with [`MIN_CORES_TO_SPIN`] cores or more):
/// the producer sends such a value twice at once, and on a machine with
/// few cores the two streams compete for them.
///
/// [`RuntimeBuilder::straight_large_values`]: crate::RuntimeBuilder::straight_large_values
/// [`MIN_CORES_TO_SPIN`]: rdt_transport::rt::hot::MIN_CORES_TO_SPIN
pub const STRAIGHT_LARGE_FROM: usize = 1 << 20;

/// The default of `straight_large`: the environment's `RDT_STRAIGHT_LARGE`
/// (`0` or `1`), else whether this machine has the cores.
fn straight_large_default() -> bool {
    match crate::env::straight_large() {
        Some(on) => on,
        None => {
            std::thread::available_parallelism().map_or(1, |n| n.get())
                >= rdt_transport::rt::hot::MIN_CORES_TO_SPIN
        }
    }
}

/// How many transfers each of PD-5's records keeps. An abort comes within
/// a transfer deadline of its delivery, and a late delivery within one of
/// its abort; thousands of straight transfers in between would be a pass
/// rate no worker reaches.
const RECENT: usize = 4096;

/// The latest [`RECENT`] transfers of a kind, oldest out first.
#[derive(Default)]
struct RecentTransfers {
    order: VecDeque<u64>,
    set: HashSet<u64>,
}

impl RecentTransfers {
    fn insert(&mut self, xfer: u64) {
        if self.set.insert(xfer) {
            self.order.push_back(xfer);
            if self.order.len() > RECENT {
                let oldest = self.order.pop_front().expect("not empty");
                self.set.remove(&oldest);
            }
        }
    }

    fn contains(&self, xfer: u64) -> bool {
        self.set.contains(&xfer)
    }

    /// Takes `xfer` out (its place in the order goes when it is oldest).
    fn remove(&mut self, xfer: u64) -> bool {
        self.set.remove(&xfer)
    }
}

/// An order to deliver a result to a consumer.
struct Order {
    xfer: u64,
    to: u64,
}

enum Link {
    Connecting,
    Up(protocol::Sender),
    /// Could not be made; try again after this.
    Failed(Instant),
}

impl PeerDelivery {
    pub(super) fn new(
        host: String,
        endpoints: &[(String, String)],
        secret: [u8; 32],
        max_frame: usize,
        straight_large: Option<bool>,
    ) -> PeerDelivery {
        PeerDelivery {
            host,
            endpoints: endpoints.iter().cloned().collect(),
            secret,
            max_frame,
            orders: Mutex::new(HashMap::new()),
            links: Arc::default(),
            given_up: Mutex::default(),
            arrived: Mutex::default(),
            received: AtomicU64::new(0),
            straight_large: straight_large.unwrap_or_else(straight_large_default),
        }
    }

    /// A call producing `result` over a one-sided transport arrived: orders
    /// for it are taken until it finishes.
    pub(super) fn open_call(&self, result: u64) {
        self.orders.lock().insert(result, Vec::new());
    }

    /// A call ended without running (its mailbox refused it).
    pub(super) fn close_call(&self, result: u64) {
        self.orders.lock().remove(&result);
    }

    /// An actor died: its link goes.
    pub(super) fn peer_gone(&self, actor: u64) {
        self.links.lock().remove(&actor);
    }

    /// The driver aborted straight transfer `xfer`, whose delivery had not
    /// come (its object is not here): it is given up unless it came before
    /// (PD-5). Returns whether it was.
    pub(super) fn give_up(&self, xfer: u64) -> bool {
        if self.arrived.lock().contains(xfer) {
            return false;
        }
        self.given_up.lock().insert(xfer);
        true
    }

    /// How many deliveries this worker received straight from producers.
    pub(super) fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }

    /// This worker as a consumer's `transport` names its producer.
    fn me(&self, shared: &WorkerShared, transport: crate::transport::Transport) -> Peer {
        Peer {
            actor: shared.actor,
            name: shared.name.to_string(),
            host: self.host.clone(),
            endpoint: self
                .endpoints
                .get(transport.name())
                .cloned()
                .unwrap_or_default(),
        }
    }
}

/// The control loop's part of a `DeliverTo`: the order waits with its call
/// (or is dropped: PD-1), and the link to the consumer is made if there is
/// none (PD-3).
pub(super) fn order(shared: &WorkerShared, object: u64, xfer: u64, to: PeerSocket) {
    let p = &shared.straight;
    {
        let mut links = p.links.lock();
        let connect = match links.get(&to.actor) {
            None => true,
            Some(Link::Failed(at)) => at.elapsed() >= RETRY_AFTER,
            Some(_) => false,
        };
        if connect {
            links.insert(to.actor, Link::Connecting);
            tokio::spawn(connect_link(
                p.links.clone(),
                to.clone(),
                p.secret,
                p.max_frame,
            ));
        }
    }
    match p.orders.lock().get_mut(&object) {
        Some(orders) => orders.push(Order { xfer, to: to.actor }),
        None => tracing::trace!(
            object,
            xfer,
            "straight delivery ordered for a call not open here; the driver delivers"
        ),
    }
}

/// Makes the link to a consumer (PD-3, PD-4) and forgets it when it
/// closes.
async fn connect_link(
    links: Arc<Mutex<HashMap<u64, Link>>>,
    to: PeerSocket,
    secret: [u8; 32],
    max_frame: usize,
) {
    let made = async {
        let mut s = UnixStream::connect(&to.path)
            .await
            .map_err(|e| Error::Io(format!("connect to {}: {e}", to.path)))?;
        protocol::size_socket_buffers(&s);
        protocol::connect_plain(&mut s, &secret).await?;
        Ok::<_, Error>(s.into_split())
    };
    match made.await {
        Ok((mut r, w)) => {
            let tx = protocol::spawn_writer(protocol::WriteHalf::Unix(w), max_frame);
            links.lock().insert(to.actor, Link::Up(tx.clone()));
            // The consumer never writes: the read ends when the link does.
            let mut sink = [0u8; 64];
            loop {
                match tokio::io::AsyncReadExt::read(&mut r, &mut sink).await {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
            }
            let mut links = links.lock();
            // Unless a newer link took its place.
            if matches!(links.get(&to.actor), Some(Link::Up(t)) if t.same_connection(&tx)) {
                links.remove(&to.actor);
            }
        }
        Err(e) => {
            tracing::debug!(
                consumer = to.actor,
                "no link for straight deliveries ({e}); values go through the driver"
            );
            links.lock().insert(to.actor, Link::Failed(Instant::now()));
        }
    }
}

/// The actor thread's part, as call `result` finishes (PD-1, PD-2): the
/// value goes to every consumer ordered whose link is up; returns their
/// transfers, for the `CallDone`.
pub(super) fn deliver_result(
    shared: &WorkerShared,
    result: u64,
    value: &Result<WireValue>,
) -> Vec<u64> {
    let p = &shared.straight;
    let Some(orders) = p.orders.lock().remove(&result) else {
        return Vec::new();
    };
    let Ok(v) = value else {
        return Vec::new();
    };
    let goes = match v.transport.sidedness() {
        Sidedness::OneSided => true,
        Sidedness::ThroughDriver => p.straight_large || v.exported.nbytes() < STRAIGHT_LARGE_FROM,
        Sidedness::TwoSided => false,
    };
    // PD-2: refs in the value go through the driver, after the CallDone.
    if orders.is_empty() || !goes || !v.refs.is_empty() {
        return Vec::new();
    }
    let from = p.me(shared, v.transport);
    let mut delivered = Vec::with_capacity(orders.len());
    for o in orders {
        let link = match p.links.lock().get(&o.to) {
            Some(Link::Up(tx)) if !tx.is_closed() => tx.clone(),
            _ => continue,
        };
        let msg = ToWorker::Deliver {
            object: result,
            value: Ok(Delivery {
                value: v.clone(),
                from: Some(from.clone()),
                xfer: o.xfer,
                group: None,
                ack_at_landing: false,
            }),
        };
        // Tests lose the delivery on its way (the link says it was sent):
        // the consumer must not wait for it past the transfer's deadline
        // (PD-5).
        #[cfg(feature = "failpoints")]
        if fail::eval("rdt::straight_delivery", |_| ()).is_some() {
            delivered.push(o.xfer);
            continue;
        }
        match link.send(&msg) {
            Ok(()) => {
                rdt_transport::trace::timeline("straight delivery sent", o.xfer);
                delivered.push(o.xfer);
            }
            Err(e) => tracing::debug!(
                xfer = o.xfer,
                "straight delivery not sent ({e}); the driver delivers"
            ),
        }
    }
    delivered
}

/// Listens for straight deliveries on `path` (PD-4). Bound here, before
/// the worker says it is spawned, so that no producer finds it missing;
/// served on the control runtime.
pub(super) fn listen(
    shared: &Arc<WorkerShared>,
    path: &str,
    control: &tokio::runtime::Handle,
) -> std::io::Result<()> {
    let listener = std::os::unix::net::UnixListener::bind(path)?;
    listener.set_nonblocking(true)?;
    let shared = shared.clone();
    control.spawn(async move {
        let listener = match tokio::net::UnixListener::from_std(listener) {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("cannot serve straight deliveries: {e}");
                return;
            }
        };
        loop {
            match listener.accept().await {
                Ok((s, _)) => {
                    tokio::spawn(serve_link(s, shared.clone()));
                }
                Err(e) => {
                    tracing::warn!("accepting a producer's link: {e}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    });
    Ok(())
}

/// Reads one producer's deliveries until its link closes.
async fn serve_link(mut s: UnixStream, shared: Arc<WorkerShared>) {
    match protocol::accept_plain(&mut s, shared.straight.secret).await {
        Ok(()) => {}
        // The producer went away mid-handshake (it exited or was killed):
        // nothing to warn about, its values go through the driver.
        Err(Error::Io(e)) => {
            tracing::debug!("a producer's link closed during its handshake: {e}");
            return;
        }
        Err(e) => {
            tracing::warn!("a link for straight deliveries did not authenticate: {e}");
            return;
        }
    }
    protocol::size_socket_buffers(&s);
    // The write half stays open: the producer reads its end to learn
    // when the link closes.
    let (r, _w) = s.into_split();
    let mut rx = protocol::Receiver::new(protocol::ReadHalf::Unix(r), shared.straight.max_frame);
    loop {
        // Hot, as the control loop: the next delivery of a pass comes
        // within the window.
        match hot(rx.recv::<ToWorker>()).await {
            Ok(Some(ToWorker::Deliver { object, value })) => {
                if let Ok(d) = &value {
                    rdt_transport::trace::timeline("straight delivery received", d.xfer);
                    if shared.straight.given_up.lock().remove(d.xfer) {
                        // PD-5: the call already failed with the abort.
                        tracing::debug!(xfer = d.xfer, object, "late straight delivery dropped");
                        continue;
                    }
                    shared.straight.arrived.lock().insert(d.xfer);
                }
                shared.straight.received.fetch_add(1, Ordering::Relaxed);
                // The call waiting for it is in the actor's mailbox
                // already: a receive the control loop would start after
                // the frames in hand starts now.
                if let Some(job) = super::on_deliver(&shared, object, value) {
                    super::run_now_or_spawn(job);
                }
            }
            Ok(Some(other)) => {
                tracing::warn!(
                    "a producer's link sent {other:?}, which only the driver sends; link closed"
                );
                return;
            }
            Ok(None) => return,
            Err(e) => {
                tracing::warn!("a producer's link broke: {e}");
                return;
            }
        }
    }
}
