//! The object-store transport: tensor bytes travel with the value, through
//! the driver (Ray's default path, and the baseline every direct transport
//! is measured against).
//!
//! Protocol: `export` copies nothing for CPU tensors in private memory
//! (`Tensor::to_bytes` hands owned bytes over as wire bytes, and the
//! tensor turns copy-on-write) and copies the bytes of memory shared with
//! other processes once into an immutable buffer; those buffers ride as out-of-band blobs in the control frames
//! (producer → driver → consumer). Each control connection reads a large
//! blob straight into a pooled host buffer ([`crate::cuda::host_pool`]: no page
//! faults pass after pass, pinned in a process with a CUDA context), and
//! `receive` wraps each blob in a tensor without copying (copy on first
//! write, see `Tensor`). The producer keeps nothing, so `release` has
//! nothing to do.
//!
//! Small tensors (under [`SMALL`]) share blobs: a value of thousands of
//! small tensors (a model's state, passed without an attribute) is packed
//! into chunks of up to [`CHUNK`] bytes, each tensor at a 64-byte aligned
//! offset, and `handles` then says where each tensor lies (blob and
//! offset). Why: one blob per tensor cost each process on the way an
//! allocation, a frame part and a copy out of the read buffer per tensor,
//! about 3 µs per tensor in all; a chunk costs one memcpy of the bytes and
//! travels, and is received, like one large tensor (pooled buffers,
//! cut-through). A receiver builds each small tensor over its slice of the
//! chunk, without a copy. A value with at most one small tensor keeps the
//! plain layout (one blob per tensor, no handles).
//!
//! CUDA tensors take the same path through the host: `export` copies them
//! to the host (device to host, into pinned staging from
//! [`crate::cuda::host_pool`]), and `unpack` copies them back to a device
//! (host to device) when the receiving process can use CUDA: to the device
//! with the same UUID if it sees it, else to its first device. A process
//! without CUDA (a CPU-only driver, say) gets CPU tensors.

use futures::future::BoxFuture;

use serde::{Deserialize, Serialize};

use crate::place::Place;
use crate::transport::{
    check_received, ObjectKey, Peer, Sidedness, TensorTransport, TransferCtx, TransportError,
};
use crate::{device::Device, tensor::Tensor, tensor::TensorMeta, transport::Exported, wire::Blob};

/// Tensors of fewer bytes share chunk blobs (see the module docs): below
/// the size a receiver reads into a pooled buffer of its own.
pub const SMALL: usize = crate::cuda::host_pool::MIN_POOLED;

/// Most bytes of small tensors in one chunk blob.
pub const CHUNK: usize = 8 << 20;

/// Offsets of tensors in a chunk are multiples of this (any dtype's
/// alignment, and a cache line).
const ALIGN: usize = 64;

/// Where each tensor's bytes lie, when small tensors share chunks: the
/// object store's `handles`.
#[derive(Serialize, Deserialize, Debug, PartialEq, Eq)]
struct Layout {
    /// Per tensor, in metadata order: (blob index, byte offset in it).
    places: Vec<(u32, u64)>,
}

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

    /// Received tensors are copied into targets through `TransferCtx::place`.
    fn copies_into_targets(&self) -> bool {
        true
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
            cx.place(NAME, &exported.metas, tensors)
        })
    }
}

/// Puts each tensor's bytes inline, after its metadata. The inverse of
/// [`unpack`].
///
/// A large CUDA tensor is copied into a pooled host buffer
/// ([`crate::cuda::host_pool`]), pinned since this process has a context: the
/// copy runs at copy-engine speed, and the buffer, reused pass after pass,
/// faults in no pages. It then goes to the socket as it is.
pub fn pack(tensors: &[Tensor]) -> Result<Exported, TransportError> {
    let small = tensors.iter().filter(|t| t.nbytes() < SMALL).count();
    if small > 1 {
        return pack_chunked(tensors);
    }
    let mut out = Exported::default();
    for t in tensors {
        out.metas.push(t.meta());
        out.inline.push(own_blob(t)?);
    }
    Ok(out)
}

/// The blob of a tensor that travels in a blob of its own: its bytes taken
/// as they are (a CPU tensor), or copied into a pinned pool buffer (a large
/// CUDA tensor; one of several steps goes out while its copy runs, see
/// [`copied_as_it_goes`]).
fn own_blob(t: &Tensor) -> Result<Blob, TransportError> {
    let err = |e: &dyn std::fmt::Display| TransportError::new(NAME, e.to_string());
    if t.is_cuda()
        && t.nbytes() >= 2 * DEVICE_STEP
        && COPY_AS_IT_GOES.load(std::sync::atomic::Ordering::Relaxed)
    {
        return copied_as_it_goes(t);
    }
    let bytes = if t.is_cuda() && t.nbytes() >= crate::cuda::host_pool::MIN_POOLED {
        let mut staging = crate::cuda::host_pool::HostBuf::new(t.nbytes()).map_err(|e| {
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
    Ok(Blob::new(bytes))
}

static COPY_AS_IT_GOES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Whether this process sends a large CUDA tensor while its copy to the
/// host runs (the default), or copies all of it first and then sends it,
/// as rdt did before. For comparing the two in one benchmark run.
pub fn set_copy_as_it_goes(on: bool) {
    COPY_AS_IT_GOES.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// The blob of a large CUDA tensor, filled as its copy to the host runs:
/// the frame's writer sends each step once it is in, so the copy overlaps
/// the socket instead of coming before it (1 GiB at 25–50 GB/s is 20–40
/// ms of a pass of about 350 ms on the H200 hosts).
///
/// Every step's copy is enqueued on rdt's stream here, each with a
/// completion, before this returns: work the producer queues on the stream
/// after returning the tensor is ordered after the copies, so the blob
/// holds the bytes as they were at return, as a copy made at once would.
/// A thread then waits for each completion in turn and publishes the step
/// (the DMA engine writes for the buffer's one writer, past its watermark:
/// arriving AR-1). The thread keeps the tensor alive until the last copy
/// ran. The buffer is pooled and pinned (this process has a context), so
/// the copies run at copy-engine speed.
fn copied_as_it_goes(t: &Tensor) -> Result<Blob, TransportError> {
    let err = |e: &dyn std::fmt::Display| TransportError::new(NAME, e.to_string());
    let len = t.nbytes();
    let (blob, mut writer) = crate::wire::arriving::Arriving::new(len)
        .map_err(|e| err(&format!("allocating {len} bytes of host staging: {e}")))?;
    let base = writer.spare().as_mut_ptr();
    let (steps, gpu) = t
        .with_device_buffer(|d| {
            let gpu = d.gpu();
            let mut steps = Vec::with_capacity(len.div_ceil(DEVICE_STEP));
            let mut at = 0;
            while at < len {
                let n = DEVICE_STEP.min(len - at);
                // SAFETY: `base + at` holds `n` bytes of the buffer, past
                // the watermark (nothing reads them until the step is
                // published after its completion); `d` holds `len` bytes.
                let queued =
                    unsafe { gpu.enqueue_dtoh(base.add(at), d.device_ptr() + at as u64, n) };
                match queued.and_then(|()| gpu.completion()) {
                    Ok(done) => steps.push((n, done)),
                    Err(e) => {
                        // Copies already queued must not write into a
                        // buffer that goes back to the pool: wait for them.
                        let _ = gpu.synchronize();
                        return Err(e);
                    }
                }
                at += n;
            }
            Ok((steps, gpu.clone()))
        })
        .map_err(|e| err(&e))?
        .map_err(|e| err(&e))?;
    let keep = t.clone();
    let on_fail = gpu.clone();
    std::thread::Builder::new()
        .name("rdt-d2h".into())
        .spawn(move || {
            for (n, done) in steps {
                if let Err(e) = futures::executor::block_on(done.wait()) {
                    // The later copies must end before the buffer can go.
                    let _ = gpu.synchronize();
                    writer.fail(format!("copying the tensor to the host failed: {e}"));
                    return;
                }
                writer.advance(n);
            }
            drop(keep);
            writer.finish();
        })
        .map_err(|e| {
            // The copies are queued: let them end before the buffer goes.
            let _ = on_fail.synchronize();
            err(&format!("starting the copy's thread: {e}"))
        })?;
    Ok(Blob::arriving(blob))
}

/// [`pack`] for a value with several small tensors: each small tensor's
/// bytes are copied into a chunk, at an aligned offset; a large one keeps
/// a blob of its own (packed as [`pack`] does). Chunks are pooled host
/// buffers ([`crate::cuda::host_pool`]): a value packed pass after pass reuses
/// the same memory and faults in no pages.
fn pack_chunked(tensors: &[Tensor]) -> Result<Exported, TransportError> {
    let err = |e: &dyn std::fmt::Display| TransportError::new(NAME, e.to_string());
    let mut out = Exported::default();
    // Where each tensor goes: its own blob (`None`), or (chunk, offset).
    let mut plan: Vec<Option<(usize, usize)>> = Vec::with_capacity(tensors.len());
    let mut chunk_sizes: Vec<usize> = Vec::new();
    for t in tensors {
        let n = t.nbytes();
        if n >= SMALL {
            plan.push(None);
            continue;
        }
        let offset = match chunk_sizes.last() {
            Some(&used) if used.next_multiple_of(ALIGN) + n <= CHUNK => {
                used.next_multiple_of(ALIGN)
            }
            _ => {
                chunk_sizes.push(0);
                0
            }
        };
        let at = chunk_sizes.len() - 1;
        chunk_sizes[at] = offset + n;
        plan.push(Some((at, offset)));
    }
    let mut chunks = chunk_sizes
        .iter()
        .map(|&len| {
            crate::cuda::host_pool::HostBuf::new(len)
                .map_err(|e| err(&format!("allocating a {len}-byte chunk: {e}")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // Blob indices: the chunks first, then each large tensor's.
    let mut places = Vec::with_capacity(tensors.len());
    let mut filled = vec![0usize; chunks.len()];
    for (t, to) in tensors.iter().zip(&plan) {
        out.metas.push(t.meta());
        let Some((at, offset)) = *to else {
            out.inline.push(own_blob(t)?);
            places.push(((chunks.len() + out.inline.len() - 1) as u32, 0));
            continue;
        };
        let buf = chunks[at].as_mut_slice();
        // Padding is zeroed: a pooled buffer holds bytes of earlier use.
        buf[filled[at]..offset].fill(0);
        let dst = &mut buf[offset..offset + t.nbytes()];
        let host;
        let t = if t.is_cuda() {
            host = t.to_cpu().map_err(|e| err(&e))?;
            &host
        } else {
            t
        };
        // SAFETY: the bytes are copied out at once; a producer that writes
        // a tensor while returning it races with itself, as with any copy.
        unsafe { t.with_bytes_unchecked(|b| dst.copy_from_slice(b)) }.map_err(|e| err(&e))?;
        filled[at] = offset + dst.len();
        places.push((at as u32, offset as u64));
    }
    let own = std::mem::take(&mut out.inline);
    out.inline = chunks
        .into_iter()
        .map(|c| Blob::new(c.freeze()))
        .chain(own)
        .collect();
    out.handles = postcard::to_allocvec(&Layout { places }).map_err(|e| err(&e))?;
    Ok(out)
}

/// Where each tensor of `exported` lies: its blob, and its offset in a
/// chunk (`None`: the whole blob is the tensor's, the plain layout; its
/// size is checked against the tensor's when the tensor is built). A chunk
/// range is checked here against its blob.
fn places(exported: &Exported) -> Result<Vec<(usize, Option<usize>)>, TransportError> {
    let err = |m: String| TransportError::new(NAME, m);
    if exported.handles.is_empty() {
        check_counts(exported)?;
        return Ok((0..exported.metas.len()).map(|i| (i, None)).collect());
    }
    let layout: Layout = postcard::from_bytes(&exported.handles)
        .map_err(|e| err(format!("malformed object-store layout: {e}")))?;
    if layout.places.len() != exported.metas.len() {
        return Err(err(format!(
            "value describes {} tensors but places {}",
            exported.metas.len(),
            layout.places.len()
        )));
    }
    layout
        .places
        .iter()
        .zip(&exported.metas)
        .map(|(&(blob, offset), m)| {
            let blob = blob as usize;
            let len = exported.inline.get(blob).map(|b| b.len()).ok_or_else(|| {
                err(format!(
                    "a tensor lies in blob #{blob}; the value carries {}",
                    exported.inline.len()
                ))
            })?;
            let offset = usize::try_from(offset).unwrap_or(usize::MAX);
            match offset.checked_add(m.nbytes()) {
                // A blob that is exactly this tensor (a large one): its own,
                // as in the plain layout (a CUDA tensor lands step by step).
                Some(end) if offset == 0 && end == len => Ok((blob, None)),
                Some(end) if end <= len => Ok((blob, Some(offset))),
                _ => Err(err(format!(
                    "a {}-byte tensor at offset {offset} reaches past its {len}-byte blob",
                    m.nbytes()
                ))),
            }
        })
        .collect()
}

/// Builds tensors from the inline blobs of `exported`, checking every size.
/// The blobs must be here ([`Exported::arrived`]); one still arriving or
/// lost on the way is an error.
pub fn unpack(exported: &Exported) -> Result<Vec<Tensor>, TransportError> {
    unpack_to(exported, None)
}

/// [`unpack`], with the tensors that were in device memory at their
/// producer put in `place` instead of on their own GPU (`None`: as
/// [`unpack`] does): host memory stays host memory, so a value asked for
/// on the host is never copied to a device and back.
pub fn unpack_to(exported: &Exported, place: Option<Place>) -> Result<Vec<Tensor>, TransportError> {
    let places = places(exported)?;
    let tensors = exported
        .metas
        .iter()
        .zip(places)
        .map(|(m, (blob, offset))| {
            let bytes = exported.inline[blob].bytes().map_err(not_arrived)?;
            unpack_one(m, slice_of(bytes, offset, m), place)
        })
        .collect::<Result<Vec<_>, _>>()?;
    check_received(NAME, &exported.metas, &tensors)?;
    Ok(tensors)
}

/// `m`'s bytes: all of the blob in the plain layout, else its range of a
/// chunk (in bounds: `places` checked it).
fn slice_of(bytes: bytes::Bytes, offset: Option<usize>, m: &TensorMeta) -> bytes::Bytes {
    match offset {
        None => bytes,
        Some(o) => bytes.slice(o..o + m.nbytes()),
    }
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

fn not_arrived(e: crate::wire::arriving::ArriveError) -> TransportError {
    TransportError::new(NAME, format!("a tensor's bytes did not arrive: {e}"))
}

/// The tensor `m` describes, over `bytes` without a copy, or copied to its
/// device when this process can use CUDA.
fn unpack_one(
    m: &TensorMeta,
    bytes: bytes::Bytes,
    place: Option<Place>,
) -> Result<Tensor, TransportError> {
    let t = Tensor::from_shared_bytes(m.dtype, &m.shape, bytes)
        .map_err(|e| TransportError::new(NAME, e.to_string()))?;
    match (&m.device, place) {
        (Device::Cpu, _) | (_, Some(Place::Host)) => Ok(t),
        (Device::Cuda { .. }, Some(Place::Cuda(o))) => t
            .to_device(o as usize)
            .map_err(|e| TransportError::new(NAME, e.to_string())),
        (Device::Cuda { uuid, .. }, None) if crate::cuda::available().is_ok() => {
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
    use crate::wire::arriving::{ArriveError, Progress};
    if exported.all_here() || crate::cuda::available().is_err() {
        exported.arrived().await.map_err(not_arrived)?;
        return unpack(exported);
    }
    let places = places(exported)?;
    let err = |e: &dyn std::fmt::Display| TransportError::new(NAME, e.to_string());
    let mut tensors = Vec::with_capacity(exported.metas.len());
    for (m, (blob, offset)) in exported.metas.iter().zip(places) {
        let b = &exported.inline[blob];
        // Stepwise only for a CUDA tensor with a blob of its own.
        let alone = offset.is_none();
        let (Device::Cuda { uuid, .. }, Some(a), true) = (&m.device, b.still_arriving(), alone)
        else {
            let bytes = b.arrived().await.map_err(not_arrived)?;
            tensors.push(unpack_one(m, slice_of(bytes, offset, m), None)?);
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A value's tensors: small ones of several dtypes and sizes, with a
    /// large one between them.
    fn mixed() -> Vec<Tensor> {
        let mut ts: Vec<Tensor> = (0..300)
            .map(|i| match i % 3 {
                0 => Tensor::full(i as u8, &[1 + i]),
                1 => Tensor::full(i as f32, &[i, 3]),
                _ => Tensor::arange::<f64>(i % 17),
            })
            .collect();
        ts.insert(150, Tensor::full(7u8, &[SMALL + 3]));
        ts
    }

    #[test]
    fn small_tensors_share_chunks_and_come_back_equal() {
        let ts = mixed();
        let ex = pack(&ts).unwrap();
        assert!(!ex.handles.is_empty(), "packed layout");
        assert_eq!(ex.inline.len(), 2, "one chunk and the large tensor");
        let back = unpack(&ex).unwrap();
        assert_eq!(back.len(), ts.len());
        for (a, b) in ts.iter().zip(&back) {
            assert_eq!(a.meta(), b.meta());
            assert!(a.equal(b).unwrap());
        }
        // Built over the chunk, not copied: the first tensor's bytes are
        // the chunk's first bytes.
        let chunk = ex.inline[0].bytes().unwrap();
        let first = back[0].with_bytes(|b| b.as_ptr() as usize).unwrap();
        assert_eq!(first, chunk.as_ptr() as usize);
        // The large tensor has its blob to itself (a CUDA one lands step
        // by step); the small ones lie in the chunk.
        let at = places(&ex).unwrap();
        assert_eq!(at[150], (1, None));
        assert_eq!(at[0], (0, Some(0)));
        assert!(at[151].1.is_some());
        // Every offset in a chunk is aligned.
        let layout: Layout = postcard::from_bytes(&ex.handles).unwrap();
        assert!(layout.places.iter().all(|&(_, o)| o as usize % ALIGN == 0));
    }

    #[test]
    fn chunks_are_bounded() {
        // 4 MiB + 4 MiB + 1 small tensors: three chunks of at most CHUNK.
        let each = SMALL - 1;
        let n = 2 * CHUNK / each + 1;
        let ts: Vec<Tensor> = (0..n).map(|i| Tensor::full(i as u8, &[each])).collect();
        let ex = pack(&ts).unwrap();
        assert!(ex.inline.len() >= 3, "{} blobs", ex.inline.len());
        assert!(ex.inline.iter().all(|b| b.len() <= CHUNK));
        let back = unpack(&ex).unwrap();
        assert!(ts.iter().zip(&back).all(|(a, b)| a.equal(b).unwrap()));
    }

    #[test]
    fn one_small_tensor_keeps_the_plain_layout() {
        let ts = vec![Tensor::full(1u8, &[10]), Tensor::full(2u8, &[SMALL])];
        let ex = pack(&ts).unwrap();
        assert!(ex.handles.is_empty());
        assert_eq!(ex.inline.len(), 2);
        assert!(unpack(&ex).unwrap()[0].equal(&ts[0]).unwrap());
    }

    /// Found by the `tensor_value` fuzz target: in the plain layout, a
    /// blob shorter than its tensor was sliced (a panic) instead of
    /// refused.
    #[test]
    fn a_short_blob_in_the_plain_layout_is_an_error_not_a_panic() {
        let ex = Exported {
            metas: vec![Tensor::full(1.0f32, &[]).meta()],
            handles: vec![],
            inline: vec![Blob::new(bytes::Bytes::new())],
        };
        assert!(unpack(&ex).is_err());
    }

    #[test]
    fn a_malformed_layout_is_a_clear_error() {
        let ts = vec![Tensor::full(1u8, &[10]), Tensor::full(2u8, &[20])];
        let good = pack(&ts).unwrap();
        let with = |places: Vec<(u32, u64)>| Exported {
            handles: postcard::to_allocvec(&Layout { places }).unwrap(),
            ..good.clone()
        };
        let e = unpack(&with(vec![(0, 0), (5, 0)])).unwrap_err();
        assert!(e.message.contains("blob #5"), "{e}");
        let e = unpack(&with(vec![(0, 0), (0, u64::MAX)])).unwrap_err();
        assert!(e.message.contains("reaches past"), "{e}");
        let e = unpack(&with(vec![(0, 0)])).unwrap_err();
        assert!(e.message.contains("places 1"), "{e}");
        let e = unpack(&Exported {
            handles: vec![0xff; 3],
            ..good
        })
        .unwrap_err();
        assert!(e.message.contains("malformed object-store layout"), "{e}");
    }
}
