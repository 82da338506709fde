//! What a worker's boot shares with the driver that starts it: the
//! environment names of a spawned worker, the frame limit before the spawn
//! order, and what a joined worker starts from.

/// The environment names a worker's boot reads ([`crate::env::worker_names`]).
pub(crate) use crate::env::worker_names as env;

/// Default control frame limit (8 GiB).
pub(crate) const DEFAULT_MAX_FRAME: usize = 8 << 30;

/// A worker that joined its driver and got its spawn order.
#[doc(hidden)]
pub struct WorkerStart {
    pub(crate) joined: Joined,
    pub(crate) control: tokio::runtime::Runtime,
}

pub(crate) struct Joined {
    pub(crate) tx: crate::protocol::Sender,
    pub(crate) rx: crate::protocol::Receiver<crate::protocol::ReadHalf>,
    pub(crate) order: crate::protocol::SpawnOrder,
    pub(crate) secret: Vec<u8>,
    /// The local address of a TCP control link: remote workers bind their
    /// data endpoints there by default (routable to the driver's network).
    pub(crate) local_ip: Option<std::net::IpAddr>,
}
