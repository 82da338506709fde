//! Where a tensor lives.
//!
//! [`Device`] is `Copy` and holds no heap memory: it is in every tensor's
//! metadata, and an object of 10 000 tensors carries 10 000 of them through
//! the driver (a `String` UUID made every one an allocation to make, copy
//! and free at each hop).

use serde::{Deserialize, Serialize};

/// The device a tensor's storage is on.
///
/// CUDA devices are identified across processes by UUID: ordinals depend on
/// each process's `CUDA_VISIBLE_DEVICES` and must never be compared between
/// processes (invariant of DESIGN §3).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// A CUDA device, by UUID, with the ordinal it has in the process that
    /// described it.
    Cuda {
        /// The device UUID (`GPU-xxxxxxxx-...`).
        uuid: GpuUuid,
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

/// A GPU's UUID: the 16 bytes CUDA gives (`cuDeviceGetUuid`), written as
/// `nvidia-smi -L` and `CUDA_VISIBLE_DEVICES` write it
/// (`GPU-8e4f0a2b-…`). `Copy`, no allocation, 16 bytes on the wire.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GpuUuid([u8; 16]);

impl GpuUuid {
    /// The UUID of these bytes.
    pub const fn from_bytes(bytes: [u8; 16]) -> Self {
        GpuUuid(bytes)
    }

    /// The 16 bytes.
    pub const fn as_bytes(&self) -> &[u8; 16] {
        &self.0
    }
}

impl std::fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let h = |r: std::ops::Range<usize>| hex::encode(&self.0[r]);
        write!(
            f,
            "GPU-{}-{}-{}-{}-{}",
            h(0..4),
            h(4..6),
            h(6..8),
            h(8..10),
            h(10..16)
        )
    }
}

impl std::fmt::Debug for GpuUuid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(self, f)
    }
}

impl std::str::FromStr for GpuUuid {
    type Err = String;
    /// Reads `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (the `GPU-` and
    /// the dashes may be left out).
    fn from_str(text: &str) -> Result<Self, String> {
        let digits: String = text
            .strip_prefix("GPU-")
            .unwrap_or(text)
            .chars()
            .filter(|&c| c != '-')
            .collect();
        let mut bytes = [0u8; 16];
        hex::decode_to_slice(&digits, &mut bytes).map_err(|_| {
            format!("{text:?} is not a GPU UUID (GPU- and 32 hex digits, as nvidia-smi -L prints)")
        })?;
        Ok(GpuUuid(bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_uuid_prints_and_parses_as_nvidia_smi_writes_it() {
        let text = "GPU-01234567-89ab-cdef-0011-223344556677";
        let u: GpuUuid = text.parse().unwrap();
        assert_eq!(u.to_string(), text);
        assert_eq!(u.as_bytes()[0], 0x01);
        assert_eq!(u.as_bytes()[15], 0x77);
        assert_eq!(postcard::to_stdvec(&u).unwrap().len(), 16);
        assert!("GPU-0".parse::<GpuUuid>().is_err());
    }

    #[test]
    fn a_device_is_small() {
        // It is in every tensor's metadata (module doc).
        assert!(std::mem::size_of::<Device>() <= 24);
    }
}
