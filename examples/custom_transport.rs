//! A transport of your own, registered like the built-in ones (Ray's
//! `register_tensor_transport`): `files` moves CPU tensors through files in
//! a directory both processes can read (a shared file system, or
//! `/dev/shm` on one host). The producer writes each tensor to a file when
//! its method returns; a consumer reads the files (one-sided: the producer
//! takes no part in the move); the producer deletes them when the owner
//! table frees the object.
//!
//! Everything the framework needs to know comes from the registration:
//! the name, who acts in a move, the devices, whether it needs a group or
//! one host, and how a process starts it. Nothing else in rdt names it.
//!
//! Run with `cargo run --example custom_transport`.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use rdt::data::registry::{ProcessContext, Registration};
use rdt::data::transport::{check_received, ObjectKey, TransferCtx};
use rdt::data::{Exported, Peer, Sidedness, TensorTransport, TransportError};
use rdt::prelude::*;

// ANCHOR: registration
/// The transport's name, as methods name it.
pub const FILES: Transport = Transport::named("files");

rdt::register_transport!(Registration {
    name: FILES.name(),
    sidedness: Sidedness::OneSided,
    collective: false,
    devices: "CPU",
    same_host_only: false,
    start: start_files,
});

/// Starts the transport in a process (the driver too: it may `get`).
fn start_files(_: &ProcessContext) -> Result<Arc<dyn TensorTransport>, String> {
    let dir = std::env::var_os("RDT_FILES_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    Ok(Arc::new(FileTransport {
        dir,
        written: Mutex::new(HashMap::new()),
    }))
}
// ANCHOR_END: registration

/// Tensors as files in `dir`.
struct FileTransport {
    dir: PathBuf,
    /// What each exported object wrote, deleted at release.
    written: Mutex<HashMap<ObjectKey, Vec<PathBuf>>>,
}

fn err(e: impl std::fmt::Display) -> TransportError {
    TransportError::new("files", e.to_string())
}

impl TensorTransport for FileTransport {
    fn name(&self) -> &'static str {
        "files"
    }

    fn sidedness(&self) -> Sidedness {
        Sidedness::OneSided
    }

    /// Received tensors reach targets only through `TransferCtx::place`.
    fn copies_into_targets(&self) -> bool {
        true
    }

    fn check_device(&self, device: &Device) -> Result<(), TransportError> {
        match device {
            Device::Cpu => Ok(()),
            other => Err(err(format!(
                "files moves CPU tensors; this one is on {other:?}: use cuda_ipc"
            ))),
        }
    }

    fn export<'a>(
        &'a self,
        key: ObjectKey,
        tensors: &'a [Tensor],
    ) -> futures::future::BoxFuture<'a, Result<Exported, TransportError>> {
        Box::pin(async move {
            let mut out = Exported::default();
            let mut paths = Vec::new();
            for (i, t) in tensors.iter().enumerate() {
                let path = self
                    .dir
                    .join(format!("rdt-files-{}-{key}-{i}", std::process::id()));
                std::fs::write(&path, t.to_bytes().map_err(err)?).map_err(err)?;
                out.metas.push(t.meta());
                paths.push(path);
            }
            let names: Vec<String> = paths.iter().map(|p| p.display().to_string()).collect();
            out.handles = names.join("\n").into_bytes();
            self.written.lock().unwrap().insert(key, paths);
            Ok(out)
        })
    }

    fn receive<'a>(
        &'a self,
        from: &'a Peer,
        cx: &'a TransferCtx,
        exported: &'a Exported,
    ) -> futures::future::BoxFuture<'a, Result<Vec<Tensor>, TransportError>> {
        Box::pin(async move {
            let names = String::from_utf8(exported.handles.clone()).map_err(err)?;
            let mut tensors = Vec::new();
            for (meta, path) in exported.metas.iter().zip(names.lines()) {
                let bytes = tokio::fs::read(path).await.map_err(|e| {
                    TransportError::with_peer("files", from, format!("reading {path}: {e}"))
                })?;
                tensors.push(Tensor::from_bytes(meta.dtype, &meta.shape, bytes).map_err(err)?);
            }
            check_received("files", &exported.metas, &tensors)?;
            // Into a `get_into`'s targets through its gate: a getter that
            // gave up gets nothing written after its drop.
            cx.place("files", &exported.metas, tensors)
        })
    }

    fn release(
        &self,
        key: ObjectKey,
    ) -> futures::future::BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            for p in self
                .written
                .lock()
                .unwrap()
                .remove(&key)
                .unwrap_or_default()
            {
                let _ = std::fs::remove_file(p);
            }
            Ok(())
        })
    }
}

// ANCHOR: actors
#[rdt::actor]
pub struct Writer {}

#[rdt::actor]
impl Writer {
    fn new() -> Self {
        Writer {}
    }

    /// A tensor that leaves through `files`.
    #[rdt::method(tensor_transport = FILES)]
    async fn make(&mut self, v: f32, n: usize) -> Tensor {
        Tensor::full(v, &[n])
    }
}

#[rdt::actor]
pub struct Reader {}

#[rdt::actor]
impl Reader {
    fn new() -> Self {
        Reader {}
    }

    /// Sum of the tensor, and how many objects came in over `files`.
    async fn sum(&mut self, t: Tensor) -> rdt::Result<(f64, u64)> {
        Ok((t.sum()?, rdt::runtime().metrics().received_over(FILES)))
    }
}
// ANCHOR_END: actors

#[rdt::main]
async fn main() -> rdt::Result<()> {
    let rt = Runtime::start().await?;
    let w = rt.spawn::<Writer>(()).await?;
    let r = rt.spawn::<Reader>(()).await?;
    let t = w.make(2.0, 1000).remote();
    let (sum, over_files) = rt.get(r.sum(&t).remote()).await?;
    println!(
        "sum {sum} of a tensor that moved over `files` ({over_files} object received that way)"
    );
    assert_eq!(sum, 2000.0);
    assert_eq!(over_files, 1, "the value took the registered transport");
    println!(
        "registered transports: {}",
        Transport::registered()
            .iter()
            .map(|t| t.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}
