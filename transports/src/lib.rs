//! The data plane of rdt: [`Tensor`]s, devices and dtypes, the extraction of
//! tensors from values, and the [`TensorTransport`] trait with its
//! implementations.
//!
//! This crate knows nothing of actors: the framework (`rdt`) decides when
//! and between whom tensors move; a transport decides how. See
//! [`transport`] for the contract every transport implements.
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

pub mod cuda;
pub mod cuda_ipc;
mod device;
mod dtype;
#[cfg(any(feature = "nccl", feature = "nixl"))]
mod env;
mod metas_wire;
#[cfg(feature = "nccl")]
pub mod nccl;
#[cfg(feature = "nixl")]
pub mod nixl;
pub mod object_store;
pub mod paths;
mod place;
pub mod registry;
pub mod rt;
mod shape;
pub mod shm;
pub mod tcp;
mod tensor;
pub mod trace;
pub mod transport;
pub mod value;
pub mod wire;

// The host buffer pool, at its old path (it lives in `cuda/` now, beside the
// pinning it uses).
pub use cuda::host_pool;
pub use cuda_ipc::CudaIpcTransport;
/// The CUDA binding whose types rdt's CUDA API names (a stream handle in
/// [`cuda::DeviceBuffer`], say), re-exported so a program that brings its
/// own device memory uses the same version and features.
pub use cudarc;
pub use device::{Device, GpuUuid};
/// The DLPack crate rdt's [`Tensor::to_dlpack`] and [`Tensor::from_dlpack`]
/// speak, re-exported so a program uses the same version.
pub use dlpark;
pub use dtype::{DType, Element};
/// The `f16` and `bf16` types rdt's tensors hold ([`Element`]), re-exported
/// so a program uses the same version.
pub use half;
pub use metas_wire::MAX_TENSORS;
pub use object_store::ObjectStoreTransport;
pub use place::{DeviceMap, Mapped, Place};
pub use shape::Shape;
pub use shm::ShmTransport;
pub use tcp::TcpTransport;
pub use tensor::{
    DeviceBytes, DlpackTensor, DlpackTensorLegacy, ExternalBytes, ExternalMemory, MakeTensors,
    Tensor, TensorError, TensorList, TensorMeta,
};
pub use transport::{
    Exported, FirstReader, GroupRef, GroupSpec, ObjectKey, Peer, ReceiveStart, Sidedness, Target,
    TargetGate, TargetWriters, TensorTransport, TransferCtx, TransferId, TransportError, Writing,
};
pub use wire::Blob;

/// For [`register_transport!`]; not a public API.
#[doc(hidden)]
pub use linkme as __linkme;
