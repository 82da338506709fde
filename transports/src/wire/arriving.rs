//! Bytes still arriving: a buffer that one writer fills front to back while
//! readers already use the part that is in.
//!
//! This is what lets a large value go through the driver without waiting
//! for all of it: the driver's reader hands a message on as soon as its
//! head is in, with its large blobs as [`Arriving`] buffers that the socket
//! keeps filling, and the writer to the next hop sends each part as it
//! lands (cut-through). The same type lets a consumer start on a value
//! while its last bytes still cross, and a producer send a tensor while its
//! copy to the host is still running.
//!
//! # Invariants
//! - **AR-1** Only the [`ArrivingWriter`] writes, and only past the
//!   watermark; a byte below the watermark never changes again. Readers
//!   read only below a watermark they observed, and observing it (through
//!   the progress channel's lock) orders the writes before their reads.
//! - **AR-2** An `Arriving` ends exactly once: done, when its writer
//!   finished with every byte in, or failed, with a reason. A writer
//!   dropped unfinished fails it (a connection that broke mid-blob, a copy
//!   that errored), so no reader waits for a writer that is gone.
//! - **AR-3** The whole buffer is lent out as [`Bytes`] only once it is
//!   done; the storage is freed (or goes back to [`crate::cuda::host_pool`])
//!   when the last reader and those bytes are gone.

use std::sync::Arc;

use bytes::Bytes;
use tokio::sync::watch;

use crate::cuda::host_pool::{HostBuf, MIN_POOLED};

/// How much a writer adds before it tells readers (each telling wakes them).
const PUBLISH_STEP: usize = 1 << 20;

/// Where an [`Arriving`] buffer stands.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Progress {
    /// This many bytes are in (from the start); more may come.
    Filling(usize),
    /// Every byte is in, and the writer vouched for them.
    Done,
    /// It will never be whole: why.
    Failed(Arc<str>),
}

/// Why an [`Arriving`] buffer will never be whole.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ArriveError(pub Arc<str>);

enum Storage {
    Pooled(HostBuf),
    Heap(Vec<u8>),
}

struct Shared {
    /// Owns the memory `ptr` points into; never touched again until drop
    /// (the memory is a mapping or a heap block outside this struct).
    _storage: Storage,
    ptr: *mut u8,
    len: usize,
    progress: watch::Sender<Progress>,
}

// SAFETY: `ptr` points into memory owned by `_storage`, which lives as long
// as `Shared`; writes and reads of it follow AR-1 (disjoint ranges, ordered
// by the progress channel), so sharing across threads is sound.
unsafe impl Send for Shared {}
// SAFETY: see `Send`.
unsafe impl Sync for Shared {}

/// A buffer being filled (see the module docs). Clones share it.
#[derive(Clone)]
pub struct Arriving(Arc<Shared>);

impl std::fmt::Debug for Arriving {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Arriving({} B, {:?})", self.0.len, self.progress())
    }
}

/// The one writer of an [`Arriving`] buffer. Dropped before
/// [`finish`](Self::finish), it fails the buffer (AR-2).
pub struct ArrivingWriter {
    shared: Arc<Shared>,
    filled: usize,
    published: usize,
    ended: bool,
}

impl std::fmt::Debug for ArrivingWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ArrivingWriter({}/{} B)", self.filled, self.shared.len)
    }
}

impl Arriving {
    /// A buffer of `len` bytes to fill, and its writer. Large buffers come
    /// from [`crate::cuda::host_pool`] (page-aligned, reused, pinned where the
    /// process has a CUDA context).
    pub fn new(len: usize) -> std::io::Result<(Arriving, ArrivingWriter)> {
        let mut storage = if len >= MIN_POOLED {
            Storage::Pooled(HostBuf::new(len)?)
        } else {
            Storage::Heap(vec![0; len])
        };
        let ptr = match &mut storage {
            Storage::Pooled(b) => b.as_mut_slice().as_mut_ptr(),
            Storage::Heap(v) => v.as_mut_ptr(),
        };
        let (progress, _) = watch::channel(Progress::Filling(0));
        let shared = Arc::new(Shared {
            _storage: storage,
            ptr,
            len,
            progress,
        });
        let writer = ArrivingWriter {
            shared: shared.clone(),
            filled: 0,
            published: 0,
            ended: false,
        };
        Ok((Arriving(shared), writer))
    }

    /// Its full length.
    pub fn len(&self) -> usize {
        self.0.len
    }

    /// Is it zero bytes long?
    pub fn is_empty(&self) -> bool {
        self.0.len == 0
    }

    /// Where it stands now.
    pub fn progress(&self) -> Progress {
        self.0.progress.borrow().clone()
    }

    /// Do `self` and `other` share one buffer?
    pub fn same(&self, other: &Arriving) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// The first `n` bytes, which must be in: `n` at most the watermark of
    /// a [`Progress::Filling`] this caller observed, or the length once
    /// done (AR-1).
    ///
    /// # Panics
    /// If `n` is past what is in.
    pub fn prefix(&self, n: usize) -> &[u8] {
        let in_now = match &*self.0.progress.borrow() {
            Progress::Filling(f) => *f,
            Progress::Done => self.0.len,
            // The bytes in before the failure stay valid (AR-1); how many
            // that was is not kept, so only what the caller saw counts.
            Progress::Failed(_) => n.min(self.0.len),
        };
        assert!(n <= in_now, "asked for {n} bytes of which {in_now} are in");
        // SAFETY: bytes below an observed watermark are written and never
        // change again (AR-1); the memory lives as long as `self`.
        unsafe { std::slice::from_raw_parts(self.0.ptr, n) }
    }

    /// Waits until more than `seen` bytes are in, or it ended.
    pub async fn progress_beyond(&self, seen: usize) -> Progress {
        let mut rx = self.0.progress.subscribe();
        let r = rx
            .wait_for(|p| !matches!(p, Progress::Filling(f) if *f <= seen))
            .await
            .map(|p| p.clone());
        // The sender lives in `self`: the channel cannot close here.
        r.unwrap_or_else(|_| Progress::Failed("the buffer's writer vanished".into()))
    }

    /// The whole buffer as bytes, if it is done; the reason, if it failed;
    /// `None` while it fills.
    pub fn now(&self) -> Option<Result<Bytes, ArriveError>> {
        match self.progress() {
            Progress::Filling(_) => None,
            Progress::Done => Some(Ok(Bytes::from_owner(Whole(self.0.clone())))),
            Progress::Failed(why) => Some(Err(ArriveError(why))),
        }
    }

    /// Waits for the whole buffer (AR-3).
    pub async fn done(&self) -> Result<Bytes, ArriveError> {
        let mut rx = self.0.progress.subscribe();
        // The sender lives in `self`: the channel cannot close here.
        let _ = rx.wait_for(|p| !matches!(p, Progress::Filling(_))).await;
        self.now()
            .unwrap_or_else(|| Err(ArriveError("the buffer's writer vanished".into())))
    }
}

/// The owner behind the bytes of a done buffer.
struct Whole(Arc<Shared>);

impl AsRef<[u8]> for Whole {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: made only once done (AR-3): every byte is written and
        // none changes again.
        unsafe { std::slice::from_raw_parts(self.0.ptr, self.0.len) }
    }
}

impl ArrivingWriter {
    /// The part not yet written, to fill from the front.
    pub fn spare(&mut self) -> &mut [u8] {
        let s = &self.shared;
        // SAFETY: only this writer writes, and only past the watermark,
        // which no reader reads (AR-1); the memory lives as long as `s`.
        unsafe { std::slice::from_raw_parts_mut(s.ptr.add(self.filled), s.len - self.filled) }
    }

    /// How many bytes are still to come.
    pub fn remaining(&self) -> usize {
        self.shared.len - self.filled
    }

    /// The first `n` bytes of [`spare`](Self::spare) are now written.
    /// Readers hear of it every `PUBLISH_STEP` bytes (1 MiB) and at the end.
    ///
    /// # Panics
    /// If `n` is more than what remains.
    pub fn advance(&mut self, n: usize) {
        assert!(n <= self.remaining(), "advanced past the end");
        self.filled += n;
        if self.filled - self.published >= PUBLISH_STEP || self.filled == self.shared.len {
            self.published = self.filled;
            self.shared
                .progress
                .send_replace(Progress::Filling(self.filled));
        }
    }

    /// Every byte is in: readers get the whole buffer. Fails it instead
    /// if bytes are missing.
    pub fn finish(mut self) {
        self.ended = true;
        let p = if self.filled == self.shared.len {
            Progress::Done
        } else {
            Progress::Failed(
                format!(
                    "only {} of its {} bytes were written",
                    self.filled, self.shared.len
                )
                .into(),
            )
        };
        self.shared.progress.send_replace(p);
    }

    /// It will never be whole, because of `why`.
    pub fn fail(mut self, why: impl Into<Arc<str>>) {
        self.ended = true;
        self.shared
            .progress
            .send_replace(Progress::Failed(why.into()));
    }
}

impl Drop for ArrivingWriter {
    fn drop(&mut self) {
        if !self.ended {
            self.shared.progress.send_replace(Progress::Failed(
                format!(
                    "its sender stopped after {} of {} bytes (connection lost or copy failed)",
                    self.filled, self.shared.len
                )
                .into(),
            ));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn readers_see_the_prefix_then_the_whole() {
        let len = 3 * PUBLISH_STEP + 17;
        let (a, mut w) = Arriving::new(len).unwrap();
        assert_eq!(a.progress(), Progress::Filling(0));
        assert!(a.now().is_none());
        let reader = {
            let a = a.clone();
            tokio::spawn(async move {
                // Every byte read as it lands, in order.
                let mut got = Vec::new();
                loop {
                    match a.progress_beyond(got.len()).await {
                        Progress::Filling(n) => got.extend_from_slice(&a.prefix(n)[got.len()..]),
                        Progress::Done => {
                            got.extend_from_slice(&a.prefix(a.len())[got.len()..]);
                            return got;
                        }
                        Progress::Failed(w) => panic!("failed: {w}"),
                    }
                }
            })
        };
        let mut i = 0u8;
        while w.remaining() > 0 {
            let s = w.spare();
            let n = s.len().min(100_000);
            for b in &mut s[..n] {
                *b = i;
                i = i.wrapping_add(1);
            }
            w.advance(n);
            tokio::task::yield_now().await;
        }
        w.finish();
        let got = tokio::time::timeout(std::time::Duration::from_secs(10), reader)
            .await
            .expect("reader done in time")
            .unwrap();
        let want: Vec<u8> = (0..len).map(|k| (k % 256) as u8).collect();
        assert_eq!(got, want);
        assert_eq!(a.done().await.unwrap(), Bytes::from(want));
    }

    #[tokio::test]
    async fn a_dropped_writer_fails_the_buffer() {
        let (a, mut w) = Arriving::new(10).unwrap();
        w.spare()[..4].copy_from_slice(b"abcd");
        w.advance(4);
        let waiter = {
            let a = a.clone();
            tokio::spawn(async move { a.done().await })
        };
        drop(w);
        let err = tokio::time::timeout(std::time::Duration::from_secs(10), waiter)
            .await
            .expect("the failure wakes the waiter")
            .unwrap()
            .unwrap_err();
        assert!(err.0.contains("stopped after 4 of 10 bytes"), "{err}");
        assert!(matches!(a.progress(), Progress::Failed(_)));
    }

    #[test]
    fn finishing_early_is_a_failure() {
        let (a, mut w) = Arriving::new(8).unwrap();
        w.advance(3);
        w.finish();
        assert!(a.now().unwrap().unwrap_err().0.contains("only 3 of its 8"));
    }
}
