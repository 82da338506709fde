//! Where a tensor lives.

use serde::{Deserialize, Serialize};

/// The device a tensor's storage is on.
///
/// CUDA devices are identified across processes by UUID: ordinals depend on
/// each process's `CUDA_VISIBLE_DEVICES` and must never be compared between
/// processes (invariant of DESIGN §3).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// A CUDA device, by UUID, with the ordinal it has in the process that
    /// described it.
    Cuda {
        /// The device UUID (`GPU-xxxxxxxx-...`).
        uuid: String,
        /// Ordinal in the describing process.
        ordinal: u32,
    },
}

impl Device {
    /// Is this host memory?
    pub fn is_cpu(&self) -> bool {
        matches!(self, Device::Cpu)
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda { uuid, ordinal } => write!(f, "cuda:{ordinal} ({uuid})"),
        }
    }
}
