//! Transport names and the per-process transport instances.

use std::str::FromStr;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rdt_transport::shm::ShmTransport;
use rdt_transport::{CudaIpcTransport, ObjectStoreTransport, TcpTransport, TensorTransport};

use crate::error::{Error, Result};

/// A tensor transport, by name. The same names are valid in
/// `#[rdt::method(tensor_transport = "...")]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Transport {
    /// Through the driver, serialized (Ray's default; the baseline).
    ObjectStore,
    /// CPU, two-sided, worker-to-worker sockets in a collective group.
    Tcp,
    /// CPU, one-sided, same-host shared memory.
    Shm,
    /// CUDA, two-sided, NCCL in a collective group.
    Nccl,
    /// CPU or CUDA, one-sided, NIXL.
    Nixl,
    /// CUDA, one-sided, same host.
    CudaIpc,
}

impl Transport {
    /// Every transport rdt knows.
    pub const ALL: [Transport; 6] = [
        Transport::ObjectStore,
        Transport::Tcp,
        Transport::Shm,
        Transport::Nccl,
        Transport::Nixl,
        Transport::CudaIpc,
    ];

    /// The name used in attributes and errors.
    pub const fn name(self) -> &'static str {
        match self {
            Transport::ObjectStore => "object_store",
            Transport::Tcp => "tcp",
            Transport::Shm => "shm",
            Transport::Nccl => "nccl",
            Transport::Nixl => "nixl",
            Transport::CudaIpc => "cuda_ipc",
        }
    }

    /// Who acts in a move over this transport.
    pub const fn sidedness(self) -> rdt_transport::Sidedness {
        use rdt_transport::Sidedness::*;
        match self {
            Transport::ObjectStore => ThroughDriver,
            Transport::Tcp | Transport::Nccl => TwoSided,
            Transport::Shm | Transport::Nixl | Transport::CudaIpc => OneSided,
        }
    }

    /// Is this a collective transport (its peers must share a group)?
    pub const fn is_collective(self) -> bool {
        matches!(self, Transport::Tcp | Transport::Nccl)
    }

    /// The valid names, comma-separated (for error messages).
    pub fn valid_names() -> String {
        Self::ALL
            .iter()
            .map(|t| t.name())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Does this build implement the transport?
    pub const fn is_implemented(self) -> bool {
        matches!(
            self,
            Transport::ObjectStore | Transport::Tcp | Transport::Shm | Transport::CudaIpc
        )
    }

    /// The transport instance of this process, or why there is none.
    ///
    /// Direct transports exist in worker processes only (the driver moves
    /// values through the object store).
    pub fn instance(self) -> Result<Arc<dyn TensorTransport>> {
        static OBJECT_STORE: OnceLock<Arc<dyn TensorTransport>> = OnceLock::new();
        static SHM: OnceLock<Arc<dyn TensorTransport>> = OnceLock::new();
        static CUDA_IPC: OnceLock<Arc<dyn TensorTransport>> = OnceLock::new();
        static TCP: OnceLock<std::result::Result<Arc<dyn TensorTransport>, String>> =
            OnceLock::new();
        match self {
            Transport::ObjectStore => Ok(OBJECT_STORE
                .get_or_init(|| Arc::new(ObjectStoreTransport))
                .clone()),
            Transport::Shm => Ok(SHM.get_or_init(|| Arc::new(ShmTransport::new())).clone()),
            // Usable wherever CUDA is; without it, exports of CUDA tensors
            // cannot happen and receives fail with the CUDA error.
            Transport::CudaIpc => Ok(CUDA_IPC
                .get_or_init(|| Arc::new(CudaIpcTransport::new()))
                .clone()),
            Transport::Tcp => {
                let cfg = WORKER_CONFIG
                    .get()
                    .ok_or_else(|| Error::TransportUnavailable {
                        name: "tcp".into(),
                        reason: "tcp connects actors of a collective group; the driver is in none"
                            .into(),
                    })?;
                TCP.get_or_init(|| {
                    // The framework owns each transfer's deadline (XF-6) and
                    // aborts both ends when it passes; the transport's own
                    // is a backstop behind it.
                    let backstop = cfg.transfer_timeout.saturating_mul(2);
                    TcpTransport::start(cfg.me, &cfg.secret, &cfg.tcp_bind, backstop)
                        .map(|t| Arc::new(t) as Arc<dyn TensorTransport>)
                        .map_err(|e| format!("could not listen on {}: {e}", cfg.tcp_bind))
                })
                .clone()
                .map_err(|reason| Error::TransportUnavailable {
                    name: "tcp".into(),
                    reason,
                })
            }
            other => Err(Error::TransportUnavailable {
                name: other.name().to_string(),
                reason: "this build of rdt does not implement it yet; use object_store, tcp, shm or cuda_ipc"
                    .to_string(),
            }),
        }
    }
}

/// What a worker's transports need to know about it.
pub(crate) struct WorkerTransportConfig {
    pub me: u64,
    pub secret: Vec<u8>,
    pub tcp_bind: String,
    pub transfer_timeout: Duration,
}

static WORKER_CONFIG: OnceLock<WorkerTransportConfig> = OnceLock::new();

/// Called once at worker boot; returns the endpoints to publish.
pub(crate) fn configure_worker(cfg: WorkerTransportConfig) -> Vec<(String, String)> {
    let _ = WORKER_CONFIG.set(cfg);
    let mut endpoints = Vec::new();
    match Transport::Tcp.instance() {
        Ok(t) => endpoints.extend(t.endpoint().map(|e| ("tcp".to_string(), e))),
        Err(e) => tracing::warn!("{e}"),
    }
    endpoints
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

impl FromStr for Transport {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Self::ALL
            .iter()
            .copied()
            .find(|t| t.name() == s)
            .ok_or_else(|| Error::UnknownTransport {
                name: s.to_string(),
                valid: Self::valid_names(),
            })
    }
}
