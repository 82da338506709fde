//! The driver's settings: a plain [`Config`] that [`RuntimeBuilder`]
//! builds and `Inner` holds (tokio's `runtime/config.rs` shape).

use super::*;

/// A runtime's settings, as [`RuntimeBuilder`] made them: plain data,
/// read by the driver (`Inner::config`) and never changed after start.
#[derive(Clone, Debug)]
pub(crate) struct Config {
    pub(crate) spawn_timeout: Duration,
    pub(crate) max_frame_bytes: usize,
    pub(crate) shutdown_grace: Duration,
    pub(crate) tcp_bind: Option<String>,
    pub(crate) transfer_timeout: Duration,
    pub(crate) listen: Option<String>,
    pub(crate) heartbeat_timeout: Duration,
    pub(crate) tls: Option<(Vec<u8>, Vec<u8>)>,
    pub(crate) hot_window: Option<Duration>,
    pub(crate) peer_delivery: bool,
    pub(crate) straight_large_values: Option<bool>,
    pub(crate) large_transfer_bytes: usize,
    pub(crate) worker_log: crate::log::WorkerLog,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            spawn_timeout: Duration::from_secs(60),
            max_frame_bytes: DEFAULT_MAX_FRAME,
            shutdown_grace: Duration::from_secs(5),
            tcp_bind: None,
            transfer_timeout: Duration::from_secs(120),
            listen: None,
            heartbeat_timeout: Duration::from_secs(10),
            tls: None,
            hot_window: None,
            peer_delivery: crate::env::peer_delivery().unwrap_or(true),
            straight_large_values: None,
            large_transfer_bytes: crate::env::large_transfer_bytes()
                .unwrap_or(crate::owner::DEFAULT_LARGE_TRANSFER_BYTES),
            worker_log: crate::log::WorkerLog::default(),
        }
    }
}
