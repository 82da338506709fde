//! Where received tensors land: a [`Place`] of the receiving process, and
//! an actor's [`DeviceMap`] from a producer's GPU to a place.

use serde::{Deserialize, Serialize};

use crate::device::{Device, GpuUuid};
use crate::tensor::{Tensor, TensorError};

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
    pub fn put(&self, t: Tensor) -> Result<Tensor, TensorError> {
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

impl Place {
    /// Every tensor of `tensors` in this place ([`put`](Self::put)).
    pub fn put_all(&self, tensors: Vec<Tensor>) -> Result<Vec<Tensor>, TensorError> {
        tensors.into_iter().map(|t| self.put(t)).collect()
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
}
