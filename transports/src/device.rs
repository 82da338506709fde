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

/// Where a receiver wants a value's tensors to land: a
/// [`DeviceMap`]'s entry, a `get_on`, an argument's `to_device`.
///
/// It names a device of the receiving process, so a CUDA device is its
/// ordinal there (as that process's `CUDA_VISIBLE_DEVICES` numbers it).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Place {
    /// Host memory, whatever device the tensors were on.
    Host,
    /// This CUDA device (local ordinal). Tensors in host memory stay
    /// there: a place moves device memory, it never uploads host tensors.
    Cuda(u32),
}

impl Place {
    /// Whether the calling process can put tensors here: `Err` says why
    /// not (no usable CUDA, or fewer devices than the ordinal needs).
    pub fn usable_here(&self) -> Result<(), String> {
        match *self {
            Place::Host => Ok(()),
            Place::Cuda(o) => {
                if let Err(e) = crate::cuda::available() {
                    return Err(format!(
                        "{self} was asked for, but this process cannot use CUDA: {e}"
                    ));
                }
                let n = crate::cuda::device_count();
                if (o as usize) < n {
                    Ok(())
                } else {
                    Err(format!(
                        "{self} was asked for, but this process sees {n} CUDA device(s)"
                    ))
                }
            }
        }
    }

    /// `t` in this place: itself where it is there already (host memory
    /// for [`Place::Host`], any host tensor or one on this very GPU for
    /// [`Place::Cuda`]), else a copy (device to host, or to this device).
    pub fn put(&self, t: crate::Tensor) -> Result<crate::Tensor, crate::TensorError> {
        match (*self, t.device()) {
            (_, Device::Cpu) => Ok(t),
            (Place::Host, Device::Cuda { .. }) => t.to_cpu(),
            (Place::Cuda(o), Device::Cuda { uuid, .. }) => {
                let here = crate::cuda::gpu(o as usize)?;
                if here.uuid() == *uuid {
                    Ok(t)
                } else {
                    t.to_device(o as usize)
                }
            }
        }
    }
}

impl std::fmt::Display for Place {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Place::Host => f.write_str("host memory"),
            Place::Cuda(o) => write!(f, "cuda:{o}"),
        }
    }
}

/// An actor's device map (PyTorch RPC's `set_device_map`): the tensors it
/// receives from a producer's GPU land in the [`Place`] mapped to that
/// GPU's UUID. Keyed by UUID, never by ordinal: ordinals differ between
/// processes (DESIGN §3). Tensors from a GPU the map does not name land
/// where the transport puts them; tensors in host memory stay there.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceMap {
    entries: Vec<(GpuUuid, Place)>,
}

/// Where a [`DeviceMap`] sends the tensors of one value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Mapped {
    /// The map names none of their devices.
    Unmapped,
    /// Every tensor the map names goes to this one place (a receive can
    /// land them there directly).
    One(Place),
    /// Tensor by tensor (`None`: left where it lands).
    Each(Vec<Option<Place>>),
}

impl DeviceMap {
    /// A map with no entries.
    pub fn new() -> Self {
        Self::default()
    }

    /// Tensors from GPU `from` land in `to` (replacing an earlier entry
    /// for `from`).
    pub fn map(mut self, from: GpuUuid, to: Place) -> Self {
        self.entries.retain(|(u, _)| *u != from);
        self.entries.push((from, to));
        self
    }

    /// Where tensors from GPU `from` land, if the map says.
    pub fn get(&self, from: &GpuUuid) -> Option<Place> {
        self.entries
            .iter()
            .find(|(u, _)| u == from)
            .map(|&(_, p)| p)
    }

    /// Does the map have no entries?
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries, in the order they were made.
    pub fn entries(&self) -> impl Iterator<Item = (GpuUuid, Place)> + '_ {
        self.entries.iter().copied()
    }

    /// Whether the calling process can use every place the map names
    /// (`Err`: the first it cannot, and why).
    pub fn usable_here(&self) -> Result<(), String> {
        for (from, to) in &self.entries {
            to.usable_here()
                .map_err(|e| format!("the device map sends tensors from {from} to {e}"))?;
        }
        Ok(())
    }

    /// Where the tensors of a value on `devices` go.
    pub fn places(&self, devices: impl IntoIterator<Item = Device>) -> Mapped {
        let mut each = Vec::new();
        // A CUDA tensor the map does not name keeps one place from serving
        // the whole value; a host tensor stays put under any place.
        let mut unmapped_cuda = false;
        for d in devices {
            each.push(match d {
                Device::Cpu => None,
                Device::Cuda { uuid, .. } => {
                    let p = self.get(&uuid);
                    unmapped_cuda |= p.is_none();
                    p
                }
            });
        }
        let mut named = each.iter().flatten();
        let Some(first) = named.next().copied() else {
            return Mapped::Unmapped;
        };
        if named.all(|p| *p == first) && !unmapped_cuda {
            Mapped::One(first)
        } else {
            Mapped::Each(each)
        }
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

    fn cuda(byte: u8) -> Device {
        Device::Cuda {
            uuid: GpuUuid::from_bytes([byte; 16]),
            ordinal: byte as u32,
        }
    }

    #[test]
    fn a_device_map_sends_a_value_on_one_gpu_to_one_place() {
        let map = DeviceMap::new()
            .map(GpuUuid::from_bytes([1; 16]), Place::Cuda(0))
            .map(GpuUuid::from_bytes([2; 16]), Place::Host);
        // Host tensors stay put under any place.
        assert_eq!(
            map.places([cuda(1), Device::Cpu, cuda(1)]),
            Mapped::One(Place::Cuda(0))
        );
        assert_eq!(map.places([cuda(2)]), Mapped::One(Place::Host));
        assert_eq!(map.places([Device::Cpu, Device::Cpu]), Mapped::Unmapped);
        assert_eq!(map.places([cuda(3)]), Mapped::Unmapped);
        assert_eq!(map.places([]), Mapped::Unmapped);
    }

    #[test]
    fn a_device_map_places_a_mixed_value_tensor_by_tensor() {
        let map = DeviceMap::new()
            .map(GpuUuid::from_bytes([1; 16]), Place::Cuda(0))
            .map(GpuUuid::from_bytes([2; 16]), Place::Host);
        assert_eq!(
            map.places([cuda(1), cuda(2), Device::Cpu]),
            Mapped::Each(vec![Some(Place::Cuda(0)), Some(Place::Host), None])
        );
        // A GPU the map does not name is left where it lands.
        assert_eq!(
            map.places([cuda(1), cuda(3)]),
            Mapped::Each(vec![Some(Place::Cuda(0)), None])
        );
    }

    #[test]
    fn a_later_entry_replaces_an_earlier_one_for_the_same_gpu() {
        let u = GpuUuid::from_bytes([1; 16]);
        let map = DeviceMap::new().map(u, Place::Cuda(1)).map(u, Place::Host);
        assert_eq!(map.get(&u), Some(Place::Host));
        assert_eq!(map.entries().count(), 1);
    }

    #[test]
    fn host_memory_is_usable_everywhere() {
        assert!(Place::Host.usable_here().is_ok());
        assert!(DeviceMap::new().usable_here().is_ok());
    }

    #[test]
    fn a_device_is_small() {
        // It is in every tensor's metadata (module doc).
        assert!(std::mem::size_of::<Device>() <= 24);
    }
}
