//! Sending frames: the `Sender` of a connection, its write queue, the
//! driver's deferred writes and the writer task.

use std::time::Duration;

use rdt_transport::wire::arriving::{Arriving, Progress};
use rdt_transport::wire::{self, FramePart};
use serde::Serialize;
use std::collections::VecDeque;
use std::io::IoSlice;
use std::sync::Arc;

use bytes::{Buf, Bytes};
use tokio::sync::Notify;

use crate::error::{Error, Result};

/// Sends frames on a connection; cheap to clone. Sending never blocks.
///
/// Latency matters here (a tiny call is four of these sends), so a frame is
/// written *inline* by the sending thread, with non-blocking vectored
/// writes, whenever nothing is queued before it; only what the socket does
/// not take at once is queued for the connection's writer task, which waits
/// for the socket to become writable. Writes happen under one lock, so
/// frames never interleave and keep their order (invariant 3).
#[derive(Clone)]
pub struct Sender {
    pub(super) inner: Arc<SenderInner>,
}

/// The writing half of a control connection (Unix socket or TCP).
pub enum WriteHalf {
    /// Local worker.
    Unix(tokio::net::unix::OwnedWriteHalf),
    /// Remote worker.
    Tcp(tokio::net::tcp::OwnedWriteHalf),
    /// Remote worker over TLS: always written by the writer task.
    Tls(tokio::sync::Mutex<tokio::io::WriteHalf<TlsStream>>),
}

/// A TLS control connection (either end).
pub type TlsStream = tokio_rustls::TlsStream<tokio::net::TcpStream>;

impl WriteHalf {
    fn try_write_vectored(&self, bufs: &[IoSlice<'_>]) -> std::io::Result<usize> {
        match self {
            WriteHalf::Unix(w) => w.try_write_vectored(bufs),
            WriteHalf::Tcp(w) => w.try_write_vectored(bufs),
            // Encryption happens in the writer task.
            WriteHalf::Tls(_) => Err(std::io::ErrorKind::WouldBlock.into()),
        }
    }
    async fn writable(&self) -> std::io::Result<()> {
        match self {
            WriteHalf::Unix(w) => w.writable().await,
            WriteHalf::Tcp(w) => w.writable().await,
            WriteHalf::Tls(_) => Ok(()),
        }
    }
}

/// `msg` as a frame, the 8-byte length at the head's front (no allocation
/// of its own).
fn encode<T: Serialize>(msg: &T) -> Result<wire::Frame> {
    wire::to_frame_with_length(msg).map_err(|e| Error::Protocol(e.to_string()))
}

/// The longest a frame sent with [`Deferred::send_soon`] waits for the next
/// frame on its connection before the writer task writes it.
pub const SOON: Duration = Duration::from_millis(1);

pub(super) struct SenderInner {
    half: WriteHalf,
    pub(super) queue: parking_lot::Mutex<WriteQueue>,
    wake: Notify,
    /// Frames were held by [`Deferred::send_soon`]: the writer task writes
    /// them within [`SOON`] if no other frame took them first.
    soon: Notify,
    /// `soon` was notified and the writer has not written since.
    soon_armed: std::sync::atomic::AtomicBool,
    max_frame: std::sync::atomic::AtomicUsize,
    counts: ForwardCounts,
    /// How long a blob being forwarded may bring no new byte before this
    /// sender gives up on it (milliseconds; see [`Sender::set_stall_limit`]).
    stall_limit_ms: std::sync::atomic::AtomicU64,
}

impl SenderInner {
    /// Waits until `blob` fills past `seen` bytes or ends; gives up on it
    /// (sets `g`) after the stall limit.
    async fn wait_for_bytes(&self, blob: &Arriving, seen: usize, g: &GivenUp) {
        let limit = Duration::from_millis(
            self.stall_limit_ms
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        if tokio::time::timeout(limit, blob.progress_beyond(seen))
            .await
            .is_err()
        {
            tracing::warn!(
                "a value being forwarded brought no byte for {limit:?} ({seen} of {} B in): \
                 its consumer's copy fails and the connection goes on",
                blob.len()
            );
            g.store(true, std::sync::atomic::Ordering::Relaxed);
        }
    }
}

/// The stall limit of a sender until [`Sender::set_stall_limit`]: the
/// default transfer deadline.
const DEFAULT_STALL_LIMIT: Duration = Duration::from_secs(120);

/// What a [`Sender`] wrote of blobs that were still arriving when it
/// queued them (see [`Sender::forwarded`]).
#[derive(Default)]
struct ForwardCounts {
    bytes: std::sync::atomic::AtomicU64,
    early: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
pub(super) struct WriteQueue {
    pub(super) chunks: VecDeque<Chunk>,
    closed: bool,
    /// Every queued frame came from [`Deferred::send_soon`] and nobody is
    /// writing them yet: the next frame, or the writer task within
    /// [`SOON`], writes them.
    pub(super) held: bool,
}

/// A piece of the write queue.
pub(super) enum Chunk {
    /// Bytes all here.
    Here(Bytes),
    /// A blob still arriving (cut-through), written as it lands, from
    /// byte `at`. If it fails, or this sender gives up on it (`given_up`,
    /// no byte for the stall limit), the rest is written as zeros and the
    /// frame's status says so.
    Arriving {
        blob: Arriving,
        at: usize,
        given_up: GivenUp,
    },
    /// A frame's status byte (`rdt_transport::wire` module docs), decided
    /// once every one of these blobs ended or was given up.
    Status(Vec<(Arriving, GivenUp)>),
}

/// Set when a sender stopped waiting for a blob's bytes (shared by the
/// blob's chunk and its frame's status chunk).
type GivenUp = Arc<std::sync::atomic::AtomicBool>;

fn given_up(g: &GivenUp) -> bool {
    g.load(std::sync::atomic::Ordering::Relaxed)
}

/// Padding for the rest of a blob that failed mid-way.
static ZEROS: [u8; 64 << 10] = [0; 64 << 10];

/// What a chunk can give the socket now.
enum Offer<'a> {
    /// These bytes; `whole`: the chunk's blob is whole (or it is no blob),
    /// so what follows may go in the same write.
    Bytes { bytes: &'a [u8], whole: bool },
    /// Nothing until this blob fills past this many bytes (or ends); the
    /// flag gives up on it.
    Wait(Arriving, usize, GivenUp),
}

impl Chunk {
    /// Its next bytes: a blob's part that is in (zeros once it failed), a
    /// status once every blob of the frame ended.
    fn offer(&self) -> Offer<'_> {
        match self {
            Chunk::Here(b) => Offer::Bytes {
                bytes: b,
                whole: true,
            },
            Chunk::Arriving {
                blob,
                at,
                given_up: g,
            } => match blob.progress() {
                Progress::Failed(_) => Offer::Bytes {
                    bytes: &ZEROS[..ZEROS.len().min(blob.len() - *at)],
                    whole: true,
                },
                _ if given_up(g) => Offer::Bytes {
                    bytes: &ZEROS[..ZEROS.len().min(blob.len() - *at)],
                    whole: true,
                },
                Progress::Filling(n) if n > *at => Offer::Bytes {
                    bytes: &blob.prefix(n)[*at..],
                    whole: false,
                },
                Progress::Filling(_) => Offer::Wait(blob.clone(), *at, g.clone()),
                Progress::Done => Offer::Bytes {
                    bytes: &blob.prefix(blob.len())[*at..],
                    whole: true,
                },
            },
            Chunk::Status(blobs) => {
                // Every blob's bytes were written (or padded) before its
                // status: one still filling was given up, or it ended.
                if let Some((b, g)) = blobs
                    .iter()
                    .find(|(b, g)| !given_up(g) && matches!(b.progress(), Progress::Filling(_)))
                {
                    return Offer::Wait(b.clone(), b.len(), g.clone());
                }
                let stalled = blobs.iter().any(|(_, g)| given_up(g));
                let lost = blobs
                    .iter()
                    .any(|(b, _)| matches!(b.progress(), Progress::Failed(_)));
                let status: &'static [u8] = match (lost, stalled) {
                    (true, _) => &[wire::STATUS_LOST],
                    (false, true) => &[wire::STATUS_STALLED],
                    (false, false) => &[0],
                };
                Offer::Bytes {
                    bytes: status,
                    whole: true,
                }
            }
        }
    }

    /// `k` bytes of what it offered (`whole` as offered) were written.
    /// True when the chunk is all written.
    fn advance(&mut self, k: usize, whole: bool, counts: &ForwardCounts) -> bool {
        use std::sync::atomic::Ordering::Relaxed;
        match self {
            Chunk::Here(b) => {
                b.advance(k);
                b.is_empty()
            }
            Chunk::Arriving { blob, at, .. } => {
                counts.bytes.fetch_add(k as u64, Relaxed);
                if !whole {
                    counts.early.fetch_add(k as u64, Relaxed);
                }
                *at += k;
                *at == blob.len()
            }
            Chunk::Status(_) => true,
        }
    }
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sender")
    }
}

impl Sender {
    /// Changes the frame limit (after the spawn order set it).
    pub fn set_max_frame(&self, max: usize) {
        self.inner
            .max_frame
            .store(max, std::sync::atomic::Ordering::Relaxed);
    }

    /// Queues a frame already encoded (with its length:
    /// `wire::to_frame_with_length`), which nothing waits for, to go out with the next frame on this
    /// connection, or within [`SOON`] if none comes: no system call now.
    ///
    /// For frees. Each was a socket write on the path of whatever the
    /// driver did next (a `drop` of a ref, the reply that released an
    /// argument): 3–5 µs of a 50 µs hand-off on the GPU hosts. Order is
    /// kept: a held frame goes out before any frame sent after it. Over
    /// TLS (whose writer task writes everything) it is sent as any frame.
    /// The frame is queued; what is left to do (a flush, or waking the
    /// writer task to write within [`SOON`]) is returned.
    fn queue_soon(&self, frame: wire::Frame) -> Result<SoonQueued> {
        if matches!(self.inner.half, WriteHalf::Tls(_)) || !frame.blobs.is_empty() || frame.status {
            // Only small, whole frames wait.
            return Ok(match self.queue(frame, false)? {
                true => SoonQueued::Flush,
                false => SoonQueued::Taken,
            });
        }
        let mut q = self.inner.queue.lock();
        if q.closed {
            return Ok(SoonQueued::Taken);
        }
        if q.chunks.is_empty() {
            q.held = true;
        }
        q.chunks.push_back(Chunk::Here(frame.head));
        let held = q.held;
        drop(q);
        if !held {
            // The writer task is writing the queue; it takes this too.
            self.inner.wake.notify_one();
            Ok(SoonQueued::Taken)
        } else if !self
            .inner
            .soon_armed
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            // Armed once per holding, so a connection is woken once.
            Ok(SoonQueued::Arm)
        } else {
            Ok(SoonQueued::Taken)
        }
    }

    /// Whether `other` sends on the same connection.
    pub fn same_connection(&self, other: &Sender) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Whether the connection is closed (its writer gave up): what is sent
    /// now is dropped.
    pub fn is_closed(&self) -> bool {
        self.inner.queue.lock().closed
    }

    /// Sends `msg`. A closed connection is not an error here: its reader
    /// notices and reports the death.
    ///
    /// A message larger than the frame limit is refused here, so the caller
    /// can turn it into an error for the call or object concerned instead
    /// of leaving the other end waiting.
    pub fn send<T: Serialize>(&self, msg: &T) -> Result<()> {
        let frame = encode(msg)?;
        rdt_transport::trace::timeline("frame encoded", frame.len() as u64);
        self.send_frame(frame)
    }

    /// [`send`](Self::send) of a frame already encoded.
    fn send_frame(&self, frame: wire::Frame) -> Result<()> {
        if self.queue(frame, false)? {
            self.flush();
        }
        Ok(())
    }

    /// Queues `frame` behind those already queued, and writes nothing:
    /// returns whether the caller must [`flush`](Self::flush) (the queue
    /// was empty, so no writer task writes it). `behind_own` says the
    /// caller flushes this connection anyway (it queued earlier frames
    /// here): then the writer task is not woken either.
    fn queue(&self, frame: wire::Frame, behind_own: bool) -> Result<bool> {
        let len = frame.len() - 8;
        let max_frame = self
            .inner
            .max_frame
            .load(std::sync::atomic::Ordering::Relaxed);
        if len > max_frame {
            return Err(Error::Protocol(format!(
                "a {len}-byte message exceeds the control frame limit of {max_frame} bytes; raise RuntimeBuilder::max_frame_bytes or move the tensors with a direct transport"
            )));
        }
        let mut q = self.inner.queue.lock();
        if q.closed {
            return Ok(false);
        }
        // Held frames (`send_soon`) go out with this one.
        let was_empty = q.chunks.is_empty() || q.held;
        q.chunks.push_back(Chunk::Here(frame.head));
        let mut arriving = Vec::new();
        for part in frame.blobs.into_iter().filter(|b| !b.is_empty()) {
            q.chunks.push_back(match part {
                FramePart::Here(b) => Chunk::Here(b),
                FramePart::Arriving(blob) => {
                    let g = GivenUp::default();
                    arriving.push((blob.clone(), g.clone()));
                    Chunk::Arriving {
                        blob,
                        at: 0,
                        given_up: g,
                    }
                }
            });
        }
        if frame.status {
            q.chunks.push_back(Chunk::Status(arriving));
        }
        drop(q);
        if behind_own {
            // Behind frames the caller's flush writes (a delivery, then
            // its call): it takes this one too. Waking the writer task
            // instead would cost a system call and race the flush for the
            // socket.
            Ok(false)
        } else if was_empty {
            Ok(true)
        } else {
            // The writer task has the earlier frames; it takes this one too.
            self.inner.wake.notify_one();
            Ok(false)
        }
    }
}

/// What is left to do for a frame [`Sender::queue_soon`] queued.
enum SoonQueued {
    /// Nothing: the writer task has it, or will within [`SOON`].
    Taken,
    /// The connection's queue must be flushed.
    Flush,
    /// The writer task must be woken, to write the held frames within
    /// [`SOON`].
    Arm,
}

/// Frames queued on connections, and tasks to wake, once a lock is
/// released: the driver queues its outbox here while it holds its state
/// lock (so the frames on each connection keep the order of the decisions
/// made under it, driver invariant 2) and runs [`flush`](Self::flush) after
/// the unlock, so no thread waits on the lock for a socket write or for a
/// wake-up's system call (1–3 µs each on the GPU hosts).
#[derive(Default)]
pub struct Deferred {
    /// Connections this holds frames for, each once.
    pub(super) flush: Vec<Sender>,
    /// Connections whose writer task must be woken for held frames.
    pub(super) soon: Vec<Sender>,
    /// Tasks to notify after the writes (a worker's reader, woken when a
    /// call goes out: the call's frames should not wait for the wake).
    tasks: Vec<Arc<tokio::sync::Notify>>,
}

impl std::fmt::Debug for Deferred {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deferred")
            .field("flush", &self.flush.len())
            .field("soon", &self.soon.len())
            .field("tasks", &self.tasks.len())
            .finish()
    }
}

impl Deferred {
    /// Queues `frame` (encoded with its length) on `conn`, in order behind
    /// what is queued there; written by [`flush`](Self::flush). A frame
    /// over the connection's limit is refused; a closed connection drops
    /// it (its reader reports the death).
    pub fn send(&mut self, conn: &Sender, frame: wire::Frame) -> Result<()> {
        let listed = self.listed(conn);
        if conn.queue(frame, listed)? {
            self.flush.push(conn.clone());
        }
        Ok(())
    }

    /// [`send`](Self::send) of a frame nothing waits for
    /// ([`Deferred::send_soon`]): it may wait up to [`SOON`] for the
    /// next frame on its connection.
    pub fn send_soon(&mut self, conn: &Sender, frame: wire::Frame) -> Result<()> {
        if self.listed(conn) {
            // Written by the flush, with the frames before it.
            return self.send(conn, frame);
        }
        match conn.queue_soon(frame)? {
            SoonQueued::Flush => self.flush.push(conn.clone()),
            SoonQueued::Arm => self.soon.push(conn.clone()),
            SoonQueued::Taken => {}
        }
        Ok(())
    }

    /// Notifies `task` after the writes of [`flush`](Self::flush).
    pub fn notify(&mut self, task: &Arc<tokio::sync::Notify>) {
        self.tasks.push(task.clone());
    }

    /// Whether nothing waits here.
    pub fn is_empty(&self) -> bool {
        self.flush.is_empty() && self.soon.is_empty() && self.tasks.is_empty()
    }

    fn listed(&self, conn: &Sender) -> bool {
        self.flush.iter().any(|s| s.same_connection(conn))
    }

    /// Writes what was queued, up to what each socket takes now (without
    /// blocking: each connection's writer task writes the rest), then
    /// wakes the writer tasks of held frames and the tasks to notify.
    pub fn flush(self) {
        if self.is_empty() {
            return;
        }
        rdt_transport::trace::timeline("flush deferred", self.flush.len() as u64);
        for s in self.flush {
            s.flush();
        }
        for s in self.soon {
            s.inner.soon.notify_one();
        }
        for t in self.tasks {
            t.notify_one();
        }
    }
}

impl Sender {
    /// Writes what is queued, up to what the socket takes now; the writer
    /// task is woken for the rest.
    fn flush(&self) {
        let q = self.inner.queue.lock();
        rdt_transport::trace::timeline("flush queue locked", q.chunks.len() as u64);
        if q.closed || q.chunks.is_empty() {
            return;
        }
        self.write_queued(q);
    }

    /// How long a blob this sender forwards while it still arrives may
    /// bring no new byte before the sender gives up on it: the rest goes
    /// out as zeros and the frame's status says the bytes stopped coming,
    /// so the receiver's value fails and the connection carries the next
    /// frames (a stopped producer must not stall every consumer it feeds).
    /// The driver sets its transfer deadline; the default is 120 s.
    pub fn set_stall_limit(&self, limit: Duration) {
        self.inner.stall_limit_ms.store(
            limit.as_millis().max(1) as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// Of the blobs this sender took while they were still arriving: the
    /// bytes written, and how many of those went out before their blob
    /// was whole (cut-through).
    pub fn forwarded(&self) -> (u64, u64) {
        use std::sync::atomic::Ordering::Relaxed;
        let c = &self.inner.counts;
        (c.bytes.load(Relaxed), c.early.load(Relaxed))
    }

    /// Writes the queue (held locked: `q`, open) without blocking; a write
    /// error closes it, and what the socket did not take, or what waits
    /// for bytes still arriving, goes to the writer task. Shared by an
    /// inline `send` and `flush`.
    fn write_queued(&self, mut q: parking_lot::MutexGuard<'_, WriteQueue>) {
        q.held = false;
        rdt_transport::trace::timeline("socket write", q.chunks.len() as u64);
        let written = write_ready(&self.inner, &mut q.chunks);
        rdt_transport::trace::timeline("socket written", q.chunks.len() as u64);
        match written {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            Err(e) => {
                tracing::debug!("control connection write failed: {e}");
                q.closed = true;
                q.chunks.clear();
                return;
            }
        }
        if !q.chunks.is_empty() {
            drop(q);
            self.inner.wake.notify_one();
        }
    }
}

/// Writes queued chunks without blocking until done, the socket is full
/// (`WouldBlock`), or the next bytes are still arriving: then the blob to
/// wait on and how much of it was taken (`Ok(Some(..))`).
fn write_ready(
    me: &SenderInner,
    chunks: &mut VecDeque<Chunk>,
) -> std::io::Result<Option<(Arriving, usize, GivenUp)>> {
    while !chunks.is_empty() {
        // What each chunk offers now, and whether its blob was whole.
        let mut offered: Vec<(usize, bool)> = Vec::new();
        let mut slices: Vec<IoSlice<'_>> = Vec::new();
        let mut wait = None;
        for c in chunks.iter().take(64) {
            match c.offer() {
                Offer::Wait(blob, seen, g) => {
                    wait = Some((blob, seen, g));
                    break;
                }
                Offer::Bytes { bytes, whole } => {
                    offered.push((bytes.len(), whole));
                    slices.push(IoSlice::new(bytes));
                    if !whole {
                        // Bytes past it are not in yet.
                        break;
                    }
                }
            }
        }
        if slices.is_empty() {
            return Ok(wait);
        }
        let mut n = me.half.try_write_vectored(&slices)?;
        drop(slices);
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        for (len, whole) in offered {
            if n == 0 {
                break;
            }
            let k = n.min(len);
            n -= k;
            let first = chunks.front_mut().expect("wrote no more than was queued");
            if first.advance(k, whole, &me.counts) {
                chunks.pop_front();
            }
        }
    }
    Ok(None)
}

/// Writes one chunk through an async writer (the TLS writer task),
/// waiting for the bytes of a blob still arriving.
async fn write_chunk<W: tokio::io::AsyncWrite + Unpin>(
    w: &mut W,
    mut c: Chunk,
    me: &SenderInner,
) -> std::io::Result<()> {
    use tokio::io::AsyncWriteExt;
    let counts = &me.counts;
    loop {
        let (k, whole) = match c.offer() {
            Offer::Wait(blob, seen, g) => {
                me.wait_for_bytes(&blob, seen, &g).await;
                continue;
            }
            Offer::Bytes { bytes, whole } => {
                w.write_all(bytes).await?;
                (bytes.len(), whole)
            }
        };
        if c.advance(k, whole, counts) {
            return Ok(());
        }
    }
}

/// The writer task of a TLS connection: drains the queue in order through
/// the encrypting stream.
async fn tls_writer(me: &SenderInner, w: &tokio::sync::Mutex<tokio::io::WriteHalf<TlsStream>>) {
    use tokio::io::AsyncWriteExt;
    let mut w = w.lock().await;
    loop {
        let notified = me.wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let chunks: Vec<Chunk> = {
            let mut q = me.queue.lock();
            if q.closed {
                return;
            }
            q.chunks.drain(..).collect()
        };
        if chunks.is_empty() {
            notified.await;
            continue;
        }
        for c in chunks {
            if let Err(e) = write_chunk(&mut *w, c, me).await {
                tracing::debug!("TLS control connection write failed: {e}");
                let mut q = me.queue.lock();
                q.closed = true;
                q.chunks.clear();
                return;
            }
        }
        if w.flush().await.is_err() {
            me.queue.lock().closed = true;
            return;
        }
    }
}

/// Wraps the writing half of a connection and starts its writer task.
pub fn spawn_writer(half: WriteHalf, max_frame: usize) -> Sender {
    let inner = Arc::new(SenderInner {
        half,
        queue: parking_lot::Mutex::new(WriteQueue::default()),
        wake: Notify::new(),
        soon: Notify::new(),
        soon_armed: std::sync::atomic::AtomicBool::new(false),
        max_frame: std::sync::atomic::AtomicUsize::new(max_frame),
        counts: ForwardCounts::default(),
        stall_limit_ms: std::sync::atomic::AtomicU64::new(DEFAULT_STALL_LIMIT.as_millis() as u64),
    });
    let me = inner.clone();
    tokio::spawn(async move {
        if let WriteHalf::Tls(w) = &me.half {
            return tls_writer(&me, w).await;
        }
        loop {
            tokio::select! {
                biased;
                _ = me.wake.notified() => {}
                _ = me.soon.notified() => {
                    // Held frames wait for the next frame on this
                    // connection, or this long.
                    tokio::select! {
                        _ = tokio::time::sleep(SOON) => {}
                        _ = me.wake.notified() => {}
                    }
                    me.soon_armed
                        .store(false, std::sync::atomic::Ordering::Release);
                }
            }
            loop {
                let res = {
                    let mut q = me.queue.lock();
                    if q.closed || q.chunks.is_empty() {
                        break;
                    }
                    q.held = false;
                    let r = write_ready(&me, &mut q.chunks);
                    if let Err(e) = &r {
                        if e.kind() != std::io::ErrorKind::WouldBlock {
                            tracing::debug!("control connection write failed: {e}");
                            q.closed = true;
                            q.chunks.clear();
                        }
                    }
                    r
                };
                match res {
                    Ok(None) => {}
                    // The next bytes are still arriving (cut-through).
                    Ok(Some((blob, taken, g))) => {
                        me.wait_for_bytes(&blob, taken, &g).await;
                    }
                    Err(e) => {
                        if e.kind() != std::io::ErrorKind::WouldBlock
                            || me.half.writable().await.is_err()
                        {
                            return;
                        }
                    }
                }
            }
        }
    });
    Sender { inner }
}
