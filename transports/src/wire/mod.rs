//! [`Blob`]: bytes that travel beside a serialized message, not inside it.
//!
//! Serializing a message with [`to_frame`] replaces every `Blob` by an index
//! and collects the bytes, so large tensor bytes are never copied through
//! the serializer; [`from_frame`] hands them back as zero-copy slices of the
//! received frame. Outside those functions a `Blob` serializes inline.
//!
//! Frame layout (inside the transport's length prefix):
//! `u32 header_len | header (postcard) | u32 blob_count | u64 len × count | blob bytes… | [status]`
//! All integers are little-endian. The top bit of `blob_count` says the
//! frame ends with one status byte: a frame that forwards blobs still
//! arriving ([`crate::wire::arriving`]) is written before all its bytes exist,
//! and the status, written last, says whether they all did (`0`) or not:
//! the source failed ([`STATUS_LOST`]) or the writer gave up waiting for
//! it ([`STATUS_STALLED`]), and the rest of the blob bytes are padding. A
//! reader must treat the blobs of a frame with a bad status as lost.

use std::cell::RefCell;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

pub mod arriving;

use arriving::{ArriveError, Arriving, Progress};

/// Bytes carried out of band in a frame: all here, or still arriving
/// (a receiver hands a message on before its large blobs are in; see
/// [`crate::wire::arriving`]).
#[derive(Clone)]
pub struct Blob(Repr);

#[derive(Clone)]
enum Repr {
    Here(Bytes),
    Arriving(Arriving),
}

impl std::fmt::Debug for Blob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            Repr::Here(b) if b.len() <= 16 => write!(f, "Blob({b:?})"),
            Repr::Here(b) => write!(f, "Blob({} B)", b.len()),
            Repr::Arriving(a) => write!(f, "Blob({a:?})"),
        }
    }
}

impl Default for Blob {
    fn default() -> Self {
        Blob::new(Bytes::new())
    }
}

impl From<Bytes> for Blob {
    fn from(b: Bytes) -> Self {
        Blob::new(b)
    }
}

impl PartialEq for Blob {
    fn eq(&self, other: &Blob) -> bool {
        match (&self.0, &other.0) {
            (Repr::Arriving(a), Repr::Arriving(b)) if a.same(b) => true,
            _ => match (self.bytes(), other.bytes()) {
                (Ok(a), Ok(b)) => a == b,
                _ => false,
            },
        }
    }
}

impl Eq for Blob {}

impl Blob {
    /// Bytes that are all here.
    pub fn new(b: Bytes) -> Blob {
        Blob(Repr::Here(b))
    }

    /// Bytes still arriving.
    pub fn arriving(a: Arriving) -> Blob {
        Blob(Repr::Arriving(a))
    }

    /// Its length, arrived or not.
    pub fn len(&self) -> usize {
        match &self.0 {
            Repr::Here(b) => b.len(),
            Repr::Arriving(a) => a.len(),
        }
    }

    /// Is it empty?
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes, if they are all here. An error if they are still
    /// arriving (await [`arrived`](Self::arrived) first) or never will.
    pub fn bytes(&self) -> Result<Bytes, ArriveError> {
        match &self.0 {
            Repr::Here(b) => Ok(b.clone()),
            Repr::Arriving(a) => a.now().unwrap_or_else(|| {
                Err(ArriveError(
                    "bytes still arriving (a bug: the value was used before Blob::arrived)".into(),
                ))
            }),
        }
    }

    /// Waits for all the bytes.
    pub async fn arrived(&self) -> Result<Bytes, ArriveError> {
        match &self.0 {
            Repr::Here(b) => Ok(b.clone()),
            Repr::Arriving(a) => a.done().await,
        }
    }

    /// The buffer still filling, if the bytes are not all here yet.
    pub fn still_arriving(&self) -> Option<&Arriving> {
        match &self.0 {
            Repr::Arriving(a) if matches!(a.progress(), Progress::Filling(_)) => Some(a),
            _ => None,
        }
    }

    /// Why the bytes will never all be here, if they won't.
    pub fn lost(&self) -> Option<ArriveError> {
        match &self.0 {
            Repr::Arriving(a) => match a.progress() {
                Progress::Failed(why) => Some(ArriveError(why)),
                _ => None,
            },
            Repr::Here(_) => None,
        }
    }
}

/// A part of a frame's blob region, as a writer sends it.
#[derive(Clone, Debug)]
pub enum FramePart {
    /// Bytes all here.
    Here(Bytes),
    /// A blob still arriving: sent as it lands.
    Arriving(Arriving),
}

impl FramePart {
    /// Its length.
    pub fn len(&self) -> usize {
        match self {
            FramePart::Here(b) => b.len(),
            FramePart::Arriving(a) => a.len(),
        }
    }

    /// Is it empty?
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

enum Ctx {
    Sink(Vec<Blob>),
    Source(Vec<Blob>),
}

thread_local! {
    static CTX: RefCell<Option<Ctx>> = const { RefCell::new(None) };
}

struct Restore(Option<Ctx>);
impl Drop for Restore {
    fn drop(&mut self) {
        let prev = self.0.take();
        CTX.with(|c| *c.borrow_mut() = prev);
    }
}

/// Errors of frame encoding and decoding.
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum FrameError {
    /// The frame is shorter than its own header says, or inconsistent.
    #[error("malformed frame: {0}")]
    Malformed(String),
    /// The header did not deserialize.
    #[error("frame header does not decode: {0}")]
    Header(String),
}

/// A message ready to write: a small head and the out-of-band blobs.
#[derive(Debug, Default)]
pub struct Frame {
    /// Header and blob table.
    pub head: Bytes,
    /// Blob bytes, in order.
    pub blobs: Vec<FramePart>,
    /// Does a status byte follow the blobs? (Some blob is still arriving:
    /// see the module docs.) The writer writes it: `0` when every
    /// arriving blob ended whole, [`STATUS_LOST`] or [`STATUS_STALLED`]
    /// otherwise.
    pub status: bool,
}

/// The status byte of a frame whose arriving blobs did not all arrive.
pub const STATUS_LOST: u8 = 1;
/// Status byte: a relay stopped forwarding the blobs because their bytes
/// stopped coming (no byte for its stall limit); the rest is zeros.
pub const STATUS_STALLED: u8 = 2;

const STATUS_FLAG: u32 = 1 << 31;

impl Frame {
    /// Total length of the frame body.
    pub fn len(&self) -> usize {
        self.head.len() + self.blobs.iter().map(|b| b.len()).sum::<usize>() + self.status as usize
    }
    /// Is the frame empty?
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Serializes `msg` into a frame, blobs out of band.
pub fn to_frame<T: Serialize>(msg: &T) -> Result<Frame, FrameError> {
    to_frame_prefixed(msg, false)
}

/// [`to_frame`], with the frame's length (8 bytes, big-endian, not
/// counting themselves) at the front of the head, as a stream of frames
/// carries it: one buffer for both, no allocation for the length.
/// [`Frame::len`] counts those 8 bytes.
pub fn to_frame_with_length<T: Serialize>(msg: &T) -> Result<Frame, FrameError> {
    to_frame_prefixed(msg, true)
}

fn to_frame_prefixed<T: Serialize>(msg: &T, with_length: bool) -> Result<Frame, FrameError> {
    let prev = CTX.with(|c| c.borrow_mut().replace(Ctx::Sink(Vec::new())));
    let restore = Restore(prev);
    // Serialized into this thread's kept buffer: no allocation, and none
    // of the doublings a fresh `Vec` goes through, per frame.
    let header =
        postcard::to_extend(msg, SCRATCH.take()).map_err(|e| FrameError::Header(e.to_string()));
    let blobs = match CTX.with(|c| c.borrow_mut().take()) {
        Some(Ctx::Sink(b)) => b,
        _ => Vec::new(),
    };
    drop(restore);
    let mut header = header?;
    let blobs: Vec<FramePart> = blobs
        .into_iter()
        .map(|b| match b.0 {
            Repr::Here(b) => FramePart::Here(b),
            Repr::Arriving(a) => match a.now() {
                // Already whole (or lost: the writer pads it and marks
                // the status).
                Some(Ok(b)) => FramePart::Here(b),
                _ => FramePart::Arriving(a),
            },
        })
        .collect();
    let status = blobs.iter().any(|b| matches!(b, FramePart::Arriving(_)));
    if blobs.len() >= STATUS_FLAG as usize {
        return Err(FrameError::Malformed(format!(
            "{} blobs in one frame",
            blobs.len()
        )));
    }
    let mut head = BytesMut::with_capacity(16 + header.len() + 8 * blobs.len());
    if with_length {
        let blob_bytes: usize = blobs.iter().map(|b| b.len()).sum();
        head.put_u64((8 + header.len() + 8 * blobs.len() + blob_bytes + status as usize) as u64);
    }
    head.put_u32_le(header.len() as u32);
    head.put_slice(&header);
    head.put_u32_le(blobs.len() as u32 | if status { STATUS_FLAG } else { 0 });
    for b in &blobs {
        head.put_u64_le(b.len() as u64);
    }
    if header.capacity() <= SCRATCH_KEPT {
        header.clear();
        SCRATCH.set(header);
    }
    Ok(Frame {
        head: head.freeze(),
        blobs,
        status,
    })
}

/// The largest serialization buffer a thread keeps for its next frame.
const SCRATCH_KEPT: usize = 64 << 10;

thread_local! {
    /// The buffer the last frame's header was serialized into (taken out
    /// while one is, so a frame made inside another gets its own).
    static SCRATCH: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Where a frame's parts are, read from its start: see [`parse_head`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FrameHead {
    /// Bytes from the frame's start to its first blob (header, blob table
    /// and their lengths).
    pub head_len: usize,
    /// The header's place in those bytes.
    pub header: std::ops::Range<usize>,
    /// Length of each blob, in order; they follow the head back to back.
    pub blob_lens: Vec<usize>,
    /// Does a status byte follow the blobs (see the module docs)?
    pub status: bool,
}

/// Reads the head of a frame body of `body_len` bytes from `start`, the
/// body's first bytes (any number of them). `Ok(None)`: `start` is too
/// short to hold the head yet. Every length is checked against
/// `body_len`, so a reader can allocate the blobs before it has them.
pub fn parse_head(start: &[u8], body_len: usize) -> Result<Option<FrameHead>, FrameError> {
    let bad = |m: &str| FrameError::Malformed(m.to_string());
    let u32_at = |at: usize| -> Option<usize> {
        start
            .get(at..at + 4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")) as usize)
    };
    if body_len < 4 {
        return Err(bad("shorter than its header length"));
    }
    let Some(hlen) = u32_at(0) else {
        return Ok(None);
    };
    let table = hlen
        .checked_add(8)
        .filter(|&t| t <= body_len)
        .ok_or_else(|| bad("header length exceeds the frame"))?;
    let Some(count) = u32_at(hlen + 4) else {
        return Ok(None);
    };
    let status = count as u32 & STATUS_FLAG != 0;
    let count = (count as u32 & !STATUS_FLAG) as usize;
    let head_len = count
        .checked_mul(8)
        .and_then(|n| n.checked_add(table))
        .filter(|&h| h <= body_len)
        .ok_or_else(|| bad("blob table exceeds the frame"))?;
    let Some(lens) = start.get(table..head_len) else {
        return Ok(None);
    };
    let blob_lens: Vec<usize> = lens
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")) as usize)
        .collect();
    let total = blob_lens
        .iter()
        .try_fold(status as usize, |a, &l| a.checked_add(l));
    if total != Some(body_len - head_len) {
        return Err(bad("blob lengths disagree with the frame length"));
    }
    Ok(Some(FrameHead {
        head_len,
        header: 4..4 + hlen,
        blob_lens,
        status,
    }))
}

/// Deserializes a message from its header bytes and its blobs (what a
/// streaming reader collected after [`parse_head`]).
pub fn from_parts<T: DeserializeOwned>(header: &[u8], blobs: Vec<Blob>) -> Result<T, FrameError> {
    let prev = CTX.with(|c| c.borrow_mut().replace(Ctx::Source(blobs)));
    let _restore = Restore(prev);
    postcard::from_bytes(header).map_err(|e| FrameError::Header(e.to_string()))
}

/// Deserializes a frame body made by [`to_frame`]. Never panics on
/// arbitrary input.
pub fn from_frame<T: DeserializeOwned>(mut body: Bytes) -> Result<T, FrameError> {
    let head = parse_head(&body, body.len())?
        .ok_or_else(|| FrameError::Malformed("shorter than its blob table".into()))?;
    let header = body.slice(head.header.clone());
    body.advance(head.head_len);
    let blobs: Vec<Blob> = head
        .blob_lens
        .iter()
        .map(|&l| Blob::new(body.split_to(l)))
        .collect();
    if head.status && body.first() != Some(&0) {
        return Err(FrameError::Malformed(
            "its sender lost part of its blobs on the way (status byte)".into(),
        ));
    }
    from_parts(&header, blobs)
}

impl Serialize for Blob {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let idx = CTX.with(|c| match &mut *c.borrow_mut() {
            Some(Ctx::Sink(v)) => {
                v.push(self.clone());
                Some((v.len() - 1) as u32)
            }
            _ => None,
        });
        match idx {
            Some(i) => s.serialize_u32(i),
            None => {
                let b = self.bytes().map_err(serde::ser::Error::custom)?;
                s.serialize_bytes(&b)
            }
        }
    }
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let in_frame = CTX.with(|c| matches!(&*c.borrow(), Some(Ctx::Source(_))));
        if in_frame {
            let i = u32::deserialize(d)? as usize;
            CTX.with(|c| match &mut *c.borrow_mut() {
                Some(Ctx::Source(v)) => v.get(i).cloned().ok_or_else(|| {
                    serde::de::Error::custom(format!("blob #{i} is not in the frame"))
                }),
                _ => Err(serde::de::Error::custom("frame context vanished")),
            })
        } else {
            let v: Vec<u8> = serde::de::Deserialize::deserialize(d)?;
            Ok(Blob::new(Bytes::from(v)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Serialize, Deserialize, Debug, PartialEq)]
    struct Msg {
        a: u32,
        blobs: Vec<Blob>,
        s: String,
    }

    fn flatten(f: Frame) -> Bytes {
        let mut b = BytesMut::new();
        b.put_slice(&f.head);
        for x in f.blobs {
            match x {
                FramePart::Here(x) => b.put_slice(&x),
                FramePart::Arriving(a) => b.put_slice(a.prefix(a.len())),
            }
        }
        if f.status {
            b.put_u8(0);
        }
        b.freeze()
    }

    #[test]
    fn round_trip() {
        let m = Msg {
            a: 3,
            blobs: vec![
                Blob::new(Bytes::from_static(b"hello")),
                Blob::new(Bytes::new()),
                Blob::new(Bytes::from(vec![7u8; 1000])),
            ],
            s: "x".into(),
        };
        let f = to_frame(&m).unwrap();
        assert_eq!(f.blobs.len(), 3);
        let back: Msg = from_frame(flatten(f)).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn a_frame_with_blobs_still_arriving_ends_with_a_status() {
        let (a, mut w) = Arriving::new(6).unwrap();
        let m = Msg {
            a: 1,
            blobs: vec![Blob::new(Bytes::from_static(b"x")), Blob::arriving(a)],
            s: String::new(),
        };
        let f = to_frame(&m).unwrap();
        assert!(f.status, "an arriving blob asks for the status byte");
        assert_eq!(f.len(), f.head.len() + 1 + 6 + 1);
        w.spare().copy_from_slice(b"abcdef");
        w.advance(6);
        w.finish();
        let body = flatten(f);
        let head = parse_head(&body, body.len()).unwrap().unwrap();
        assert!(head.status);
        assert_eq!(head.blob_lens, vec![1, 6]);
        let back: Msg = from_frame(body.clone()).unwrap();
        assert_eq!(
            back.blobs[1].bytes().unwrap(),
            Bytes::from_static(b"abcdef")
        );
        // A bad status loses the blobs.
        let mut lost = BytesMut::from(&body[..]);
        *lost.last_mut().unwrap() = STATUS_LOST;
        assert!(from_frame::<Msg>(lost.freeze()).is_err());
        // Once whole, the blob goes as plain bytes: no status.
        let f = to_frame(&back).unwrap();
        assert!(!f.status);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for len in 0..64 {
            let junk: Vec<u8> = (0..len).map(|i| (i * 37 + 11) as u8).collect();
            let _ = from_frame::<Msg>(Bytes::from(junk));
        }
        let mut b = BytesMut::new();
        b.put_u32_le(0);
        b.put_u32_le(u32::MAX);
        assert!(from_frame::<Msg>(b.freeze()).is_err());
    }
}
