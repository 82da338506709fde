//! What a worker's boot shares with the driver that starts it: the
//! environment names of a spawned worker, the frame limit before the spawn
//! order, and what a joined worker starts from.

/// Names of the environment variables a local worker is started with,
/// and the two a worker started by hand reads.
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
