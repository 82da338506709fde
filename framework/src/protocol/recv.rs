//! Reading frames: the `Receiver` of a connection and its direct reads.

use rdt_transport::wire;
use rdt_transport::wire::arriving::{Arriving, ArrivingWriter};
use rdt_transport::Blob;
use serde::de::DeserializeOwned;
use std::collections::VecDeque;

use bytes::{Buf, Bytes, BytesMut};
use tokio::io::AsyncRead;

use super::*;
use crate::error::{Error, Result};

/// Reads [`read_directly`] answered (for tests).
pub(super) static DIRECT_READS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The reading half of a control connection (Unix socket or TCP).
pub enum ReadHalf {
    /// Local worker.
    Unix(tokio::net::unix::OwnedReadHalf),
    /// Remote worker.
    Tcp(tokio::net::tcp::OwnedReadHalf),
    /// Remote worker over TLS.
    Tls(tokio::io::ReadHalf<TlsStream>),
}

impl AsyncRead for ReadHalf {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        use std::os::fd::AsRawFd;
        use std::task::Poll;
        let (polled, fd) = match self.get_mut() {
            ReadHalf::Unix(r) => {
                let fd = r.as_ref().as_raw_fd();
                (std::pin::Pin::new(r).poll_read(cx, buf), fd)
            }
            ReadHalf::Tcp(r) => {
                let fd = r.as_ref().as_raw_fd();
                (std::pin::Pin::new(r).poll_read(cx, buf), fd)
            }
            ReadHalf::Tls(r) => return std::pin::Pin::new(r).poll_read(cx, buf),
        };
        match polled {
            // Pending, with the waker registered: tokio has not seen the
            // socket readable. In a process that spins (hot window), ask
            // the socket itself (see `read_directly`).
            Poll::Pending if !rdt_transport::rt::hot::window().is_zero() => read_directly(fd, buf),
            other => other,
        }
    }
}

/// Reads what the socket `fd` holds now, without waiting and without
/// asking tokio: `Pending` when it holds nothing.
///
/// Why: tokio learns that a socket is readable only when some worker
/// thread polls its I/O driver, and while one worker sleeps in
/// `epoll_wait` holding the driver, a thread that spins in a hot wait
/// (`rdt_transport::rt::hot`) cannot poll it: the bytes are seen only after
/// the kernel wakes the sleeper, 5–12 µs on the GPU hosts' VMs, on every
/// hop of a call (timelines of cached `cuda_ipc` hand-offs, 2026-11-24).
/// A non-blocking `recv` from the spinning thread sees them at once.
/// Reading behind tokio's back is sound: the waker stays registered, and
/// the readiness tokio may report later for bytes taken here only costs
/// one read that finds nothing.
fn read_directly(
    fd: std::os::fd::RawFd,
    buf: &mut tokio::io::ReadBuf<'_>,
) -> std::task::Poll<std::io::Result<()>> {
    use std::task::Poll;
    // SAFETY: the bytes given to recv are the unfilled part of `buf`
    // (recv writes at most that many); those it reports written are
    // initialized and then counted as filled.
    unsafe {
        let spare = buf.unfilled_mut();
        let n = libc::recv(
            fd,
            spare.as_mut_ptr().cast(),
            spare.len(),
            libc::MSG_DONTWAIT,
        );
        if n >= 0 {
            DIRECT_READS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            buf.assume_init(n as usize);
            buf.advance(n as usize);
            return Poll::Ready(Ok(()));
        }
    }
    let e = std::io::Error::last_os_error();
    match e.kind() {
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Poll::Pending,
        _ => Poll::Ready(Err(e)),
    }
}

/// The reading half of a connection (invariant 2).
///
/// Blobs stream into their own buffers: a small one is copied out of the
/// read buffer (which is then reused in place, and pinned by nothing); a
/// large one (at least
/// [`host_pool::MIN_POOLED`](rdt_transport::host_pool::MIN_POOLED)) is read
/// by the socket straight into a pooled, page-aligned host buffer (pinned
/// where the process has a CUDA context), so a frame is never buffered
/// whole and its tensors need no copy after the socket's own. All progress
/// lives in `self`, which makes [`recv`](Self::recv) cancel-safe: a frame
/// in progress is resumed by the next call.
pub struct Receiver<R> {
    r: R,
    /// Bytes read and not yet consumed.
    buf: BytesMut,
    max_frame: usize,
    state: ReadState,
    /// Bytes read from the connection so far: a frame still arriving
    /// counts, so a peer sending one large frame is alive (HB-1).
    read_bytes: u64,
}

enum ReadState {
    /// Waiting for a frame's 8-byte length.
    Length,
    /// Waiting for the head (header and blob table) of a `body`-byte frame.
    Head { body: usize },
    /// Reading the blobs, in order.
    Blobs {
        header: Vec<u8>,
        lens: Vec<usize>,
        blobs: Vec<Blob>,
        /// A large blob being read into its buffer, and how much is in.
        large: Option<(rdt_transport::host_pool::HostBuf, usize)>,
        /// Does a status byte follow the blobs?
        status: bool,
    },
    /// The message went up with its blobs from the first very large one on
    /// still arriving; their bytes are read into them, in order.
    Streaming {
        /// Blobs whose bytes are still to read, in order.
        writers: VecDeque<ArrivingWriter>,
        /// Blobs read whole, waiting for the frame's status byte.
        read: Vec<ArrivingWriter>,
        status: bool,
    },
}

/// Blobs from this size on are handed up while they arrive (cut-through:
/// the driver forwards them, a consumer waits for them, as they land).
/// Smaller ones gain less than the wake-ups cost.
pub const STREAM_MIN: usize = 4 << 20;

/// [`STREAM_MIN`], or `RDT_STREAM_MIN` (bytes; `off` turns cut-through
/// off) read once per process: the benchmarks compare both paths in one
/// run.
fn stream_min() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| match crate::env::stream_min() {
        Some(v) if v == "off" => usize::MAX,
        Some(v) => v.parse().unwrap_or(STREAM_MIN),
        None => STREAM_MIN,
    })
}

/// What the read buffer asks of the socket at least per read.
const READ_CHUNK: usize = 64 << 10;

impl<R: AsyncRead + Unpin> Receiver<R> {
    /// Is the next frame all in the read buffer already, so that
    /// [`recv`](Self::recv) returns it without reading the connection?
    /// (Between frames only; `false` when unsure.)
    pub fn has_whole_frame(&self) -> bool {
        matches!(self.state, ReadState::Length)
            && self.buf.len() >= 8
            && (self.buf.len() - 8) as u64
                >= u64::from_be_bytes(self.buf[..8].try_into().expect("8 bytes"))
    }

    /// Wraps a reader, refusing frames over `max_frame` bytes.
    pub fn new(r: R, max_frame: usize) -> Self {
        Receiver {
            r,
            buf: BytesMut::with_capacity(READ_CHUNK),
            max_frame,
            state: ReadState::Length,
            read_bytes: 0,
        }
    }

    /// Bytes read from the connection so far, a frame still arriving
    /// included (HB-1: bytes read are liveness).
    pub fn bytes_read(&self) -> u64 {
        self.read_bytes
    }

    /// Changes the frame limit (after the spawn order set it).
    pub fn set_max_frame(&mut self, max: usize) {
        self.max_frame = max;
    }

    /// Reads more into the read buffer, at least `want` bytes' room. False
    /// at the end of the stream.
    async fn fill(&mut self, want: usize) -> Result<bool> {
        use tokio::io::AsyncReadExt;
        self.buf.reserve(want.max(READ_CHUNK));
        let n = self
            .r
            .read_buf(&mut self.buf)
            .await
            .map_err(|e| Error::Io(e.to_string()))?;
        self.read_bytes += n as u64;
        rdt_transport::trace::timeline("socket read", n as u64);
        Ok(n > 0)
    }

    /// The next message; `Ok(None)` at a clean end of stream. Cancel-safe.
    pub async fn recv<T: DeserializeOwned>(&mut self) -> Result<Option<T>> {
        use rdt_transport::host_pool::{HostBuf, MIN_POOLED};
        use tokio::io::AsyncReadExt;
        let cut = |what: &str| Error::Io(format!("the connection closed in the middle of {what}"));
        loop {
            match &mut self.state {
                ReadState::Length => {
                    if self.buf.len() < 8 {
                        if !self.fill(8).await? {
                            return match self.buf.is_empty() {
                                true => Ok(None),
                                false => Err(cut("a frame length")),
                            };
                        }
                        continue;
                    }
                    let body = self.buf.get_u64() as usize;
                    if body > self.max_frame {
                        return Err(Error::Protocol(format!(
                            "the peer sent a {body}-byte frame, over the control frame limit of {} bytes (RuntimeBuilder::max_frame_bytes)",
                            self.max_frame
                        )));
                    }
                    self.state = ReadState::Head { body };
                }
                ReadState::Head { body } => {
                    let body = *body;
                    match wire::parse_head(&self.buf, body)
                        .map_err(|e| Error::Protocol(e.to_string()))?
                    {
                        Some(h) => {
                            // Copied out (it is small), like small blobs
                            // below: the read buffer is then never shared,
                            // and every later read reuses it in place.
                            let header = self.buf[h.header].to_vec();
                            self.buf.advance(h.head_len);
                            self.state = ReadState::Blobs {
                                header,
                                lens: h.blob_lens,
                                blobs: Vec::new(),
                                large: None,
                                status: h.status,
                            };
                        }
                        // The head is at most the frame: read on.
                        None => {
                            if !self.fill(body.min(READ_CHUNK)).await? {
                                return Err(cut("a frame head"));
                            }
                        }
                    }
                }
                ReadState::Blobs {
                    header,
                    lens,
                    blobs,
                    large,
                    status,
                } => {
                    let Some(&len) = lens.get(blobs.len()) else {
                        let msg = wire::from_parts(header, std::mem::take(blobs))
                            .map_err(|e| Error::Protocol(e.to_string()));
                        // A status byte with no blob before it (a frame
                        // with blobs streams from its first, below) is
                        // read next, like any.
                        self.state = match *status {
                            true => ReadState::Streaming {
                                writers: VecDeque::new(),
                                read: Vec::new(),
                                status: true,
                            },
                            false => ReadState::Length,
                        };
                        return msg.map(Some);
                    };
                    if large.is_none() && (len >= stream_min() || *status) {
                        // Hand the message up now; its blobs from here on
                        // arrive in their buffers (AR-1, AR-2). A frame
                        // with a status byte goes this way from its first
                        // blob: the status, read last, decides them all.
                        let mut writers = VecDeque::new();
                        for &l in &lens[blobs.len()..] {
                            let (a, w) = Arriving::new(l).map_err(|e| {
                                Error::Io(format!("allocating {l} bytes for a received blob: {e}"))
                            })?;
                            blobs.push(Blob::arriving(a));
                            writers.push_back(w);
                        }
                        let msg = wire::from_parts(header, std::mem::take(blobs))
                            .map_err(|e| Error::Protocol(e.to_string()));
                        self.state = ReadState::Streaming {
                            writers,
                            read: Vec::new(),
                            status: *status,
                        };
                        return msg.map(Some);
                    }
                    if let Some((buf, filled)) = large {
                        if *filled == len {
                            let (buf, _) = large.take().expect("checked");
                            blobs.push(Blob::new(buf.freeze()));
                            continue;
                        }
                        let n = self
                            .r
                            .read(&mut buf.as_mut_slice()[*filled..])
                            .await
                            .map_err(|e| Error::Io(e.to_string()))?;
                        if n == 0 {
                            return Err(cut("a blob"));
                        }
                        *filled += n;
                        self.read_bytes += n as u64;
                    } else if len < MIN_POOLED {
                        if self.buf.len() >= len {
                            // A copy, not a slice of the read buffer: a
                            // small value kept in a store must not pin a
                            // whole read buffer (64 KiB or more) for life.
                            blobs.push(Blob::new(Bytes::copy_from_slice(&self.buf[..len])));
                            self.buf.advance(len);
                        } else if !self.fill(len - self.buf.len()).await? {
                            return Err(cut("a blob"));
                        }
                    } else {
                        let mut buf = HostBuf::new(len).map_err(|e| {
                            Error::Io(format!("allocating {len} bytes for a received blob: {e}"))
                        })?;
                        // What the read buffer already holds of it.
                        let have = self.buf.len().min(len);
                        buf.as_mut_slice()[..have].copy_from_slice(&self.buf[..have]);
                        self.buf.advance(have);
                        *large = Some((buf, have));
                    }
                }
                ReadState::Streaming { .. } => self.step_streaming().await?,
            }
        }
    }

    /// One step of reading the blobs of a frame already handed up: some
    /// bytes into the first unfinished blob, or its end, or the frame's
    /// status and end (back to `Length`).
    async fn step_streaming(&mut self) -> Result<()> {
        use tokio::io::AsyncReadExt;
        let ReadState::Streaming {
            writers,
            read,
            status,
        } = &mut self.state
        else {
            return Ok(());
        };
        let Some(w) = writers.front_mut() else {
            if *status {
                self.read_status().await?;
            }
            self.state = ReadState::Length;
            return Ok(());
        };
        if w.remaining() == 0 {
            let w = writers.pop_front().expect("looked at");
            match *status {
                // Whole only once the status vouches for it.
                true => read.push(w),
                false => w.finish(),
            }
        } else if !self.buf.is_empty() {
            let k = self.buf.len().min(w.remaining());
            w.spare()[..k].copy_from_slice(&self.buf[..k]);
            self.buf.advance(k);
            w.advance(k);
        } else {
            let n = self
                .r
                .read(w.spare())
                .await
                .map_err(|e| Error::Io(e.to_string()))?;
            if n == 0 {
                return Err(Error::Io(
                    "the connection closed in the middle of a blob".into(),
                ));
            }
            w.advance(n);
            self.read_bytes += n as u64;
        }
        Ok(())
    }

    /// Reads the rest of the frame whose message [`recv`](Self::recv)
    /// handed up early (its large blobs still arriving), so that they are
    /// whole without another `recv`. Does nothing between frames.
    pub async fn finish_frame(&mut self) -> Result<()> {
        while matches!(self.state, ReadState::Streaming { .. }) {
            self.step_streaming().await?;
        }
        Ok(())
    }

    /// Reads a frame's status byte (state `Streaming`, every blob read)
    /// and ends the blobs it vouches for: whole, or lost. Cancel-safe: the
    /// byte is consumed only once it is here.
    async fn read_status(&mut self) -> Result<()> {
        if self.buf.is_empty() && !self.fill(1).await? {
            return Err(Error::Io(
                "the connection closed in the middle of a frame's status".into(),
            ));
        }
        let status = self.buf.get_u8();
        if let ReadState::Streaming { read, .. } = &mut self.state {
            for w in read.drain(..) {
                match status {
                    0 => w.finish(),
                    wire::STATUS_STALLED => w.fail(
                        "the value's bytes stopped coming: the actor that made it sent none \
                         for longer than the transfer deadline while the driver forwarded \
                         them (RuntimeBuilder::transfer_timeout); it may be stopped or \
                         overloaded. The value fails here; get it again once its producer \
                         runs",
                    ),
                    _ => w.fail(
                        "the value's bytes were lost on the way: the actor that made it \
                         failed while the driver forwarded them",
                    ),
                }
            }
        }
        Ok(())
    }
}
