//! [`Tensor`]: a typed, shaped view of shared storage.
//!
//! # Invariants
//! 1. A tensor is contiguous and row-major: its bytes are the
//!    `shape.product() * dtype.size()` bytes at its byte offset in its
//!    storage, and they lie within the storage. A tensor made by a
//!    constructor covers its whole storage at offset 0; a *view*
//!    ([`Tensor::view`]) covers part of another tensor's bytes. A receive
//!    of many tensors makes them views of one allocation, so each costs a
//!    reference count, not an allocation.
//! 2. Cloning a tensor shares its storage (tensors are mutable and shared, as
//!    in Ray Direct Transport): a write through one clone, or through a
//!    view of the same bytes, is seen by all.
//! 3. Access to host bytes goes through the storage's lock, so concurrent
//!    readers and writers in one process are serialized (no data race); the
//!    order of writes between actors is the user's business, as in RDT.
//!    Memory that other processes may write
//!    ([`ExternalMemory::shared_with_other_processes`]) is never behind a
//!    Rust reference: the safe accessors copy it with raw-pointer copies
//!    (see [`Tensor`]'s "Shared memory" section).
//! 4. Storage received from the wire ([`bytes::Bytes`]) is shared read-only
//!    until the first write, which copies it once (copy on write).
//!
//! # Files
//! - `storage.rs`: [`TensorError`], [`ExternalMemory`], the [`Storage`]
//!   behind tensors, raw copies of external memory, [`ExternalBytes`].
//! - `tensor.rs`: [`Tensor`] and [`TensorMeta`], constructors, views,
//!   accessors.
//! - `access.rs`: host bytes (`with_bytes*`, `to_bytes`, `to_vec`) and copy
//!   on write (invariant 4).
//! - `cuda.rs`: CUDA tensors, their ready events, copies across devices,
//!   [`DeviceBytes`].
//! - `ops.rs`: the test ops (`fill_`, `add_scalar_`, `sum`, `equal`,
//!   `uniform_`).
//! - `list.rs`: [`TensorList`], a value's tensors, as a list or made on
//!   demand.

use std::sync::Arc;

use bytes::Bytes;
use parking_lot::RwLock;
use serde::{Deserialize, Serialize};

use crate::cuda::DeviceBuffer;
use crate::{device::Device, dtype::DType, dtype::Element, shape::Shape};

mod access;
mod cuda;
mod dlpack;
pub(crate) mod list;
mod ops;
mod storage;
// The module of the type: `tensor/tensor.rs` holds `Tensor` (LAYOUT.md).
#[allow(clippy::module_inception)]
mod tensor;

use storage::*;
use tensor::*;

pub use cuda::DeviceBytes;
pub use dlpack::{DlpackTensor, DlpackTensorLegacy};
pub use list::{MakeTensors, TensorList};
pub use storage::{ExternalBytes, ExternalMemory, Storage, TensorError};
pub use tensor::{Tensor, TensorMeta};

#[cfg(test)]
mod tests;
