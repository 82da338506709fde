//! Transport names and the per-process transport instances.

use std::str::FromStr;
use std::sync::{Arc, OnceLock};

use rdt_transport::{ObjectStoreTransport, TensorTransport};

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
        Self::ALL.iter().map(|t| t.name()).collect::<Vec<_>>().join(", ")
    }

    /// The transport instance of this process, or why there is none.
    pub fn instance(self) -> Result<Arc<dyn TensorTransport>> {
        static OBJECT_STORE: OnceLock<Arc<dyn TensorTransport>> = OnceLock::new();
        match self {
            Transport::ObjectStore => Ok(OBJECT_STORE.get_or_init(|| Arc::new(ObjectStoreTransport)).clone()),
            other => Err(Error::TransportUnavailable {
                name: other.name().to_string(),
                reason: "this build of rdt does not implement it yet; use \"object_store\"".to_string(),
            }),
        }
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
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
