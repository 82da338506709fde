//! The control protocol: messages between driver and workers, framing, and
//! the authentication handshake.
//!
//! # Invariants
//! 1. Before any frame is read on a connection, both ends prove knowledge
//!    of the runtime's secret by HMAC-SHA256 over fresh nonces (mutual
//!    challenge-response; the secret never crosses the socket). A peer that
//!    fails is dropped and logged.
//! 2. After the handshake a connection carries frames: an 8-byte big-endian
//!    length, then a body made by [`rdt_transport::wire::to_frame`] (postcard
//!    header, then out-of-band blobs). Bodies over the configured limit are
//!    refused and close the connection.
//! 3. Messages on one connection are handled in the order they were sent;
//!    the driver relies on this to order deliveries before the calls that
//!    need them.

use std::time::Duration;

use futures::StreamExt;
use hmac::{Hmac, Mac};
use rdt_transport::wire::{self, Frame};
use rdt_transport::{Blob, Exported, Peer};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter};
use tokio::sync::mpsc;
use tokio_util::codec::{FramedRead, LengthDelimitedCodec};

use crate::error::{Error, Result};

/// A value as it travels: serialized non-tensor part plus what the
/// transport exported for its tensors.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WireValue {
    /// postcard bytes with tensor placeholders.
    pub data: Blob,
    /// Transport that holds the tensors (`object_store` when there are none).
    pub transport: String,
    /// Metadata, handles or inline bytes of the tensors.
    pub exported: Exported,
}

/// An argument of a call.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum WireArg {
    /// Passed by value (tensors inline, object-store path).
    Value(WireValue),
    /// Passed by ref: the worker waits for the object in its store.
    Ref(u64),
}

/// A method call.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CallMsg {
    /// Call id.
    pub call: u64,
    /// Method index in the actor's impl.
    pub method: u32,
    /// Arguments.
    pub args: Vec<WireArg>,
    /// Object id of the result.
    pub result: u64,
    /// Transport for the result's tensors.
    pub transport: String,
}

/// How a consumer obtains an object's tensors.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Delivery {
    /// The value (data and exported tensors).
    pub value: WireValue,
    /// The producer, for direct transports.
    pub from: Option<Peer>,
    /// Pairs the receive with the producer's send (two-sided transports).
    pub xfer: u64,
}

/// Driver → worker.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ToWorker {
    /// Construct the actor from these postcard-encoded arguments.
    Spawn {
        /// postcard bytes of the actor's constructor argument.
        args: Blob,
    },
    /// Run a method.
    Call(CallMsg),
    /// An object a queued call needs (or its error).
    Deliver {
        /// Object id.
        object: u64,
        /// The value or why there is none.
        value: std::result::Result<Delivery, Error>,
    },
    /// Two-sided transports: send an object's tensors to a peer.
    SendTo {
        /// Object id.
        object: u64,
        /// Transfer id, paired with the consumer's receive.
        xfer: u64,
        /// Consumer.
        to: Peer,
    },
    /// The owner table freed the object: drop it.
    Free {
        /// Object id.
        object: u64,
    },
    /// Send the whole value (tensors inline) to the driver.
    Fetch {
        /// Object id.
        object: u64,
        /// Request id for the reply.
        req: u64,
    },
    /// Exit now.
    Shutdown,
}

/// Worker → driver.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum ToDriver {
    /// First frame after the handshake.
    Hello {
        /// The worker id the driver gave in the environment.
        worker: u64,
        /// Process id.
        pid: u32,
        /// Host name.
        host: String,
        /// Endpoints of this worker's transports, by transport name.
        endpoints: Vec<(String, String)>,
    },
    /// Reply to `Spawn`.
    Spawned(std::result::Result<(), Error>),
    /// A call finished.
    CallDone {
        /// Call id.
        call: u64,
        /// The result value or the error.
        result: std::result::Result<WireValue, Error>,
    },
    /// Reply to `Fetch`.
    Fetched {
        /// Request id.
        req: u64,
        /// The value with tensors inline.
        result: std::result::Result<WireValue, Error>,
    },
}

/// Sends frames on a connection; cheap to clone. Sending never blocks: frames
/// queue for the connection's writer task.
#[derive(Clone, Debug)]
pub struct Sender {
    tx: mpsc::UnboundedSender<Frame>,
}

impl Sender {
    /// Queues `msg`. A closed connection is not an error here: its reader
    /// notices and reports the death.
    pub fn send<T: Serialize>(&self, msg: &T) -> Result<()> {
        let frame = wire::to_frame(msg).map_err(|e| Error::Protocol(e.to_string()))?;
        let _ = self.tx.send(frame);
        Ok(())
    }
}

/// Starts the writer task of a connection.
pub fn spawn_writer<W: AsyncWrite + Unpin + Send + 'static>(w: W, max_frame: usize) -> Sender {
    let (tx, mut rx) = mpsc::unbounded_channel::<Frame>();
    tokio::spawn(async move {
        let mut w = BufWriter::with_capacity(64 * 1024, w);
        'outer: while let Some(frame) = rx.recv().await {
            let mut next = Some(frame);
            while let Some(f) = next.take() {
                if let Err(e) = write_frame(&mut w, f, max_frame).await {
                    tracing::debug!("control connection writer stopped: {e}");
                    break 'outer;
                }
                next = rx.try_recv().ok();
            }
            if w.flush().await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
    });
    Sender { tx }
}

async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, f: Frame, max_frame: usize) -> std::io::Result<()> {
    let len = f.len();
    if len > max_frame {
        tracing::error!("refusing to send a {len}-byte frame (limit {max_frame}); raise RuntimeBuilder::max_frame_bytes");
        return Ok(());
    }
    w.write_all(&(len as u64).to_be_bytes()).await?;
    w.write_all(&f.head).await?;
    for b in &f.blobs {
        w.write_all(b).await?;
    }
    Ok(())
}

/// The reading half of a connection.
pub struct Receiver<R> {
    inner: FramedRead<R, LengthDelimitedCodec>,
}

impl<R: AsyncRead + Unpin> Receiver<R> {
    /// Wraps a reader, refusing frames over `max_frame` bytes.
    pub fn new(r: R, max_frame: usize) -> Self {
        let codec = LengthDelimitedCodec::builder()
            .length_field_length(8)
            .max_frame_length(max_frame)
            .new_codec();
        Receiver {
            inner: FramedRead::new(r, codec),
        }
    }

    /// The next message; `Ok(None)` at a clean end of stream.
    pub async fn recv<T: DeserializeOwned>(&mut self) -> Result<Option<T>> {
        match self.inner.next().await {
            None => Ok(None),
            Some(Err(e)) => Err(Error::Io(e.to_string())),
            Some(Ok(body)) => wire::from_frame(body.freeze())
                .map(Some)
                .map_err(|e| Error::Protocol(e.to_string())),
        }
    }
}

type HmacSha256 = Hmac<Sha256>;
const NONCE: usize = 32;
const TAG: usize = 32;
/// How long a peer may take to authenticate.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

fn tag(secret: &[u8], label: &[u8], a: &[u8], b: &[u8]) -> [u8; TAG] {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(label);
    mac.update(a);
    mac.update(b);
    mac.finalize().into_bytes().into()
}

fn verify(secret: &[u8], label: &[u8], a: &[u8], b: &[u8], got: &[u8]) -> bool {
    let mut mac = HmacSha256::new_from_slice(secret).expect("HMAC takes keys of any length");
    mac.update(label);
    mac.update(a);
    mac.update(b);
    mac.verify_slice(got).is_ok()
}

/// A fresh random secret for a runtime.
pub fn new_secret() -> [u8; 32] {
    let mut s = [0u8; 32];
    getrandom::getrandom(&mut s).expect("the OS random source works");
    s
}

fn nonce() -> [u8; NONCE] {
    new_secret()
}

/// Accepting side of the handshake (invariant 1).
pub async fn authenticate_server<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, secret: &[u8]) -> Result<()> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let ns = nonce();
        s.write_all(&ns).await?;
        let mut buf = [0u8; NONCE + TAG];
        s.read_exact(&mut buf).await?;
        let (nc, t) = buf.split_at(NONCE);
        if !verify(secret, b"rdt-client", &ns, nc, t) {
            return Err(Error::Protocol("peer failed authentication (wrong runtime secret)".into()));
        }
        s.write_all(&tag(secret, b"rdt-server", nc, &ns)).await?;
        s.flush().await?;
        Ok(())
    })
    .await
    .map_err(|_| Error::Protocol("peer did not authenticate in time".into()))?
}

/// Connecting side of the handshake (invariant 1).
pub async fn authenticate_client<S: AsyncRead + AsyncWrite + Unpin>(s: &mut S, secret: &[u8]) -> Result<()> {
    tokio::time::timeout(HANDSHAKE_TIMEOUT, async {
        let mut ns = [0u8; NONCE];
        s.read_exact(&mut ns).await?;
        let nc = nonce();
        let mut out = [0u8; NONCE + TAG];
        out[..NONCE].copy_from_slice(&nc);
        out[NONCE..].copy_from_slice(&tag(secret, b"rdt-client", &ns, &nc));
        s.write_all(&out).await?;
        s.flush().await?;
        let mut t = [0u8; TAG];
        s.read_exact(&mut t).await?;
        if !verify(secret, b"rdt-server", &nc, &ns, &t) {
            return Err(Error::Protocol("server failed authentication (wrong runtime secret)".into()));
        }
        Ok(())
    })
    .await
    .map_err(|_| Error::Protocol("server did not authenticate in time".into()))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn handshake_accepts_the_secret_and_refuses_others() {
        tokio::time::timeout(Duration::from_secs(10), async {
            let (mut a, mut b) = tokio::io::duplex(1024);
            let (r1, r2) = tokio::join!(authenticate_server(&mut a, b"k1"), authenticate_client(&mut b, b"k1"));
            r1.unwrap();
            r2.unwrap();
            let (mut a, mut b) = tokio::io::duplex(1024);
            let (r1, _r2) = tokio::join!(authenticate_server(&mut a, b"k1"), authenticate_client(&mut b, b"k2"));
            assert!(r1.is_err());
        })
        .await
        .unwrap();
    }
}
