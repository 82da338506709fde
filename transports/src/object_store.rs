//! The object-store transport: tensor bytes travel with the value, through
//! the driver (Ray's default path, and the baseline every direct transport
//! is measured against).
//!
//! Protocol: `export` copies nothing for CPU tensors in private memory
//! (`Tensor::to_bytes` hands owned bytes over as wire bytes, and the
//! tensor turns copy-on-write) and copies the bytes of memory shared with
//! other processes once into an immutable buffer; those buffers ride as out-of-band blobs in the control frames
//! (producer → driver → consumer). Each control connection reads a large
//! blob straight into a pooled host buffer ([`crate::host_pool`]: no page
//! faults pass after pass, pinned in a process with a CUDA context), and
//! `receive` wraps each blob in a tensor without copying (copy on first
//! write, see `Tensor`). The producer keeps nothing, so `release` has
//! nothing to do.
//!
//! CUDA tensors take the same path through the host: `export` copies them
//! to the host (device to host, into pinned staging from
//! [`crate::host_pool`]), and `unpack` copies them back to a device
//! (host to device) when the receiving process can use CUDA: to the device
//! with the same UUID if it sees it, else to its first device. A process
//! without CUDA (a CPU-only driver, say) gets CPU tensors.

use futures::future::BoxFuture;

use crate::transport::{
    check_received, ObjectKey, Peer, Sidedness, TensorTransport, TransferCtx, TransportError,
};
use crate::{Blob, Device, Exported, Tensor};

/// Name of this transport in attributes and errors.
pub const NAME: &str = "object_store";

crate::register_transport!(crate::registry::Registration {
    name: NAME,
    sidedness: Sidedness::ThroughDriver,
    collective: false,
    devices: "CPU, CUDA (through the host)",
    same_host_only: false,
    start: |_| Ok(std::sync::Arc::new(ObjectStoreTransport)),
});

/// Moves tensors through the driver, serialized with the value.
#[derive(Debug, Default, Clone, Copy)]
pub struct ObjectStoreTransport;

impl TensorTransport for ObjectStoreTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn sidedness(&self) -> Sidedness {
        Sidedness::ThroughDriver
    }

    fn check_device(&self, device: &Device) -> Result<(), TransportError> {
        match device {
            // CUDA tensors go through the host (see the module docs).
            Device::Cpu | Device::Cuda { .. } => Ok(()),
        }
    }

    fn export<'a>(
        &'a self,
        _key: ObjectKey,
        tensors: &'a [Tensor],
    ) -> BoxFuture<'a, Result<Exported, TransportError>> {
        Box::pin(async move { pack(tensors) })
    }

    fn receive<'a>(
        &'a self,
        _from: &'a Peer,
        cx: &'a TransferCtx,
        exported: &'a Exported,
    ) -> BoxFuture<'a, Result<Vec<Tensor>, TransportError>> {
        Box::pin(async move { cx.target.place(NAME, &exported.metas, unpack(exported)?) })
    }
}

/// Puts each tensor's bytes inline, after its metadata. The inverse of
/// [`unpack`].
///
/// A large CUDA tensor is copied into a pooled host buffer
/// ([`crate::host_pool`]), pinned since this process has a context: the
/// copy runs at copy-engine speed, and the buffer, reused pass after pass,
/// faults in no pages. It then goes to the socket as it is.
pub fn pack(tensors: &[Tensor]) -> Result<Exported, TransportError> {
    let err = |e: &dyn std::fmt::Display| TransportError::new(NAME, e.to_string());
    let mut out = Exported::default();
    for t in tensors {
        out.metas.push(t.meta());
        let bytes = if t.is_cuda() && t.nbytes() >= crate::host_pool::MIN_POOLED {
            let mut staging = crate::host_pool::HostBuf::new(t.nbytes()).map_err(|e| {
                err(&format!(
                    "allocating {} bytes of host staging: {e}",
                    t.nbytes()
                ))
            })?;
            t.with_device_buffer(|d| d.gpu().copy_dtoh(staging.as_mut_slice(), d.device_ptr()))
                .map_err(|e| err(&e))?
                .map_err(|e| err(&e))?;
            staging.freeze()
        } else {
            t.to_cpu().and_then(|c| c.to_bytes()).map_err(|e| err(&e))?
        };
        out.inline.push(Blob(bytes));
    }
    Ok(out)
}

/// Builds tensors from the inline blobs of `exported`, checking every size.
pub fn unpack(exported: &Exported) -> Result<Vec<Tensor>, TransportError> {
    if exported.inline.len() != exported.metas.len() {
        return Err(TransportError::new(
            NAME,
            format!(
                "value describes {} tensors but carries bytes for {}",
                exported.metas.len(),
                exported.inline.len()
            ),
        ));
    }
    let tensors = exported
        .metas
        .iter()
        .zip(&exported.inline)
        .map(|(m, b)| {
            let t = Tensor::from_shared_bytes(m.dtype, &m.shape, b.0.clone())
                .map_err(|e| TransportError::new(NAME, e.to_string()))?;
            match &m.device {
                Device::Cuda { uuid, .. } if crate::cuda::available().is_ok() => {
                    let ord = crate::cuda::ordinal_of(uuid).unwrap_or(0);
                    t.to_device(ord)
                        .map_err(|e| TransportError::new(NAME, e.to_string()))
                }
                _ => Ok(t),
            }
        })
        .collect::<Result<Vec<_>, _>>()?;
    check_received(NAME, &exported.metas, &tensors)?;
    Ok(tensors)
}
