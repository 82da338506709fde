//! [`Blob`]: bytes that travel beside a serialized message, not inside it.
//!
//! Serializing a message with [`to_frame`] replaces every `Blob` by an index
//! and collects the bytes, so large tensor bytes are never copied through
//! the serializer; [`from_frame`] hands them back as zero-copy slices of the
//! received frame. Outside those functions a `Blob` serializes inline.
//!
//! Frame layout (inside the transport's length prefix):
//! `u32 header_len | header (postcard) | u32 blob_count | u64 len × count | blob bytes…`
//! All integers are little-endian.

use std::cell::RefCell;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Bytes carried out of band in a frame.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Blob(pub Bytes);

enum Ctx {
    Sink(Vec<Bytes>),
    Source(Vec<Bytes>),
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
    pub blobs: Vec<Bytes>,
}

impl Frame {
    /// Total length of the frame body.
    pub fn len(&self) -> usize {
        self.head.len() + self.blobs.iter().map(|b| b.len()).sum::<usize>()
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
    let header = postcard::to_stdvec(msg).map_err(|e| FrameError::Header(e.to_string()));
    let blobs = match CTX.with(|c| c.borrow_mut().take()) {
        Some(Ctx::Sink(b)) => b,
        _ => Vec::new(),
    };
    drop(restore);
    let header = header?;
    let mut head = BytesMut::with_capacity(16 + header.len() + 8 * blobs.len());
    if with_length {
        let blob_bytes: usize = blobs.iter().map(|b| b.len()).sum();
        head.put_u64((8 + header.len() + 8 * blobs.len() + blob_bytes) as u64);
    }
    head.put_u32_le(header.len() as u32);
    head.put_slice(&header);
    head.put_u32_le(blobs.len() as u32);
    for b in &blobs {
        head.put_u64_le(b.len() as u64);
    }
    Ok(Frame {
        head: head.freeze(),
        blobs,
    })
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
    let total = blob_lens.iter().try_fold(0usize, |a, &l| a.checked_add(l));
    if total != Some(body_len - head_len) {
        return Err(bad("blob lengths disagree with the frame length"));
    }
    Ok(Some(FrameHead {
        head_len,
        header: 4..4 + hlen,
        blob_lens,
    }))
}

/// Deserializes a message from its header bytes and its blobs (what a
/// streaming reader collected after [`parse_head`]).
pub fn from_parts<T: DeserializeOwned>(header: &[u8], blobs: Vec<Bytes>) -> Result<T, FrameError> {
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
    let blobs: Vec<Bytes> = head.blob_lens.iter().map(|&l| body.split_to(l)).collect();
    from_parts(&header, blobs)
}

impl Serialize for Blob {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let idx = CTX.with(|c| match &mut *c.borrow_mut() {
            Some(Ctx::Sink(v)) => {
                v.push(self.0.clone());
                Some((v.len() - 1) as u32)
            }
            _ => None,
        });
        match idx {
            Some(i) => s.serialize_u32(i),
            None => s.serialize_bytes(&self.0),
        }
    }
}

impl<'de> Deserialize<'de> for Blob {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let in_frame = CTX.with(|c| matches!(&*c.borrow(), Some(Ctx::Source(_))));
        if in_frame {
            let i = u32::deserialize(d)? as usize;
            CTX.with(|c| match &mut *c.borrow_mut() {
                Some(Ctx::Source(v)) => v.get(i).cloned().map(Blob).ok_or_else(|| {
                    serde::de::Error::custom(format!("blob #{i} is not in the frame"))
                }),
                _ => Err(serde::de::Error::custom("frame context vanished")),
            })
        } else {
            let v: Vec<u8> = serde::de::Deserialize::deserialize(d)?;
            Ok(Blob(Bytes::from(v)))
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
            b.put_slice(&x);
        }
        b.freeze()
    }

    #[test]
    fn round_trip() {
        let m = Msg {
            a: 3,
            blobs: vec![
                Blob(Bytes::from_static(b"hello")),
                Blob(Bytes::new()),
                Blob(Bytes::from(vec![7u8; 1000])),
            ],
            s: "x".into(),
        };
        let f = to_frame(&m).unwrap();
        assert_eq!(f.blobs.len(), 3);
        let back: Msg = from_frame(flatten(f)).unwrap();
        assert_eq!(back, m);
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
