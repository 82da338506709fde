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
use crate::{Blob, Device, Exported, Tensor, TensorMeta};

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
        Box::pin(async move {
            let tensors = unpack_arriving(exported).await?;
            cx.target.place(NAME, &exported.metas, tensors)
        })
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
        out.inline.push(Blob::new(bytes));
    }
    Ok(out)
}

/// Builds tensors from the inline blobs of `exported`, checking every size.
/// The blobs must be here ([`Exported::arrived`]); one still arriving or
/// lost on the way is an error.
pub fn unpack(exported: &Exported) -> Result<Vec<Tensor>, TransportError> {
    check_counts(exported)?;
    let tensors = exported
        .metas
        .iter()
        .zip(&exported.inline)
        .map(|(m, b)| unpack_one(m, b.bytes().map_err(not_arrived)?))
        .collect::<Result<Vec<_>, _>>()?;
    check_received(NAME, &exported.metas, &tensors)?;
    Ok(tensors)
}

/// One bytes blob per tensor.
fn check_counts(exported: &Exported) -> Result<(), TransportError> {
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
    Ok(())
}

fn not_arrived(e: crate::arriving::ArriveError) -> TransportError {
    TransportError::new(NAME, format!("a tensor's bytes did not arrive: {e}"))
}

/// The tensor `m` describes, over `bytes` without a copy, or copied to its
/// device when this process can use CUDA.
fn unpack_one(m: &TensorMeta, bytes: bytes::Bytes) -> Result<Tensor, TransportError> {
    let t = Tensor::from_shared_bytes(m.dtype, &m.shape, bytes)
        .map_err(|e| TransportError::new(NAME, e.to_string()))?;
    match &m.device {
        Device::Cuda { uuid, .. } if crate::cuda::available().is_ok() => {
            let ord = crate::cuda::ordinal_of(uuid).unwrap_or(0);
            t.to_device(ord)
                .map_err(|e| TransportError::new(NAME, e.to_string()))
        }
        _ => Ok(t),
    }
}

/// Copies land on a device in steps of at least this much (each step
/// waits for its copy: fewer, larger steps cost fewer waits).
const DEVICE_STEP: usize = 16 << 20;

/// [`unpack`] for blobs that may still be arriving (cut-through): a CUDA
/// tensor is copied to its device step by step as its bytes land, so that
/// copy overlaps the socket instead of following it; the others are built
/// once their bytes are all in. Fails with the loss if bytes never come.
pub async fn unpack_arriving(exported: &Exported) -> Result<Vec<Tensor>, TransportError> {
    use crate::arriving::{ArriveError, Progress};
    if exported.all_here() || crate::cuda::available().is_err() {
        exported.arrived().await.map_err(not_arrived)?;
        return unpack(exported);
    }
    check_counts(exported)?;
    let err = |e: &dyn std::fmt::Display| TransportError::new(NAME, e.to_string());
    let mut tensors = Vec::with_capacity(exported.metas.len());
    for (m, b) in exported.metas.iter().zip(&exported.inline) {
        let (Device::Cuda { uuid, .. }, Some(a)) = (&m.device, b.still_arriving()) else {
            tensors.push(unpack_one(m, b.arrived().await.map_err(not_arrived)?)?);
            continue;
        };
        let ord = crate::cuda::ordinal_of(uuid).unwrap_or(0);
        let t = Tensor::cuda_empty(m.dtype, &m.shape, ord).map_err(|e| err(&e))?;
        if t.nbytes() != a.len() {
            return Err(err(&format!(
                "a {:?} tensor of shape {:?} needs {} bytes; {} arrived",
                m.dtype,
                m.shape,
                t.nbytes(),
                a.len()
            )));
        }
        let len = a.len();
        let mut copied = 0;
        while copied < len {
            let wanted = (copied + DEVICE_STEP).min(len);
            let n = match a.progress_beyond(wanted - 1).await {
                Progress::Filling(n) => n,
                Progress::Done => len,
                Progress::Failed(why) => return Err(not_arrived(ArriveError(why))),
            };
            let part = &a.prefix(n)[copied..];
            t.with_device_buffer(|d| d.gpu().copy_htod(d.device_ptr() + copied as u64, part))
                .map_err(|e| err(&e))?
                .map_err(|e| err(&e))?;
            copied = n;
        }
        // Every byte copied: the frame's status still has to vouch for them.
        a.done().await.map_err(not_arrived)?;
        tensors.push(t);
    }
    check_received(NAME, &exported.metas, &tensors)?;
    Ok(tensors)
}
