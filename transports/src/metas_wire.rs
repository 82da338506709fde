//! How an object's tensor metadata travels ([`crate::Exported::metas`]).
//!
//! A weights object has thousands of tensors, and its metadata crosses
//! three processes (producer, driver, consumer) every pass. Written as a
//! list of [`TensorMeta`]s, each tensor carried its device whole (a tag,
//! a 16-byte UUID and an ordinal: 18 fields to encode and decode one by
//! one) for the one or two devices an object is on; written as columns
//! (a dtype, a device index, a rank and the dimensions per tensor), it
//! was still about five bytes a tensor, 50 KB for 10 000 tensors that
//! the driver wrote and the consumer read on every pass (about 35 µs of a
//! pass across GPUs on the 2×H200 host). But the tensors of one object are
//! of few kinds: the layers of a model repeat the same handful of shapes.
//! So:
//!
//! - `devices`: each distinct device, in order of first use;
//! - `kinds`: each distinct (dtype, device, shape), in order of first use:
//!   its dtype (its index in [`DTYPES`]), its device (index in
//!   `devices`) and its rank, one byte each, then its dimensions as
//!   LEB128 varints;
//! - `tensors`: each tensor's kind, in tensor order, as runs
//!   ([`put_run`]): a tensor of another kind than the one before costs
//!   a byte (fewer than 64 kinds), a run of tensors of one kind two or
//!   three bytes in all.
//!
//! 10 000 tensors of one shape are a few bytes; 10 000 of a model whose
//! layers alternate a dozen shapes, about 10 KB. Decoding makes each kind
//! once and copies it for its tensors.
//!
//! Decoding checks that the columns agree (a malformed frame is an error,
//! never a panic).

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::shape::INLINE_DIMS;
use crate::{device::Device, dtype::DType, shape::Shape, tensor::TensorMeta};

#[derive(Serialize, Deserialize)]
struct Columns {
    devices: Vec<Device>,
    #[serde(with = "serde_bytes")]
    kinds: Vec<u8>,
    #[serde(with = "serde_bytes")]
    tensors: Vec<u8>,
}

/// Every dtype, by its code on the wire (its declaration order).
const DTYPES: [DType; 12] = DType::ALL;

pub(crate) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The next varint of `b` and the rest, or `None` if it is cut short or
/// does not fit in 64 bits.
pub(crate) fn take_varint(b: &[u8]) -> Option<(u64, &[u8])> {
    let mut v = 0u64;
    for (i, &x) in b.iter().enumerate().take(10) {
        let bits = u64::from(x & 0x7f);
        if i == 9 && x > 1 {
            return None;
        }
        v |= bits << (7 * i);
        if x & 0x80 == 0 {
            return Some((v, &b[i + 1..]));
        }
    }
    None
}

/// Writes `count` (at least 1) repeats of `value` (below 2^63): one
/// varint of `value` shifted left by one, its low bit set when a second
/// varint, `count - 2`, follows. A value on its own costs what its varint
/// costs (one byte below 64); a run of any length, one or two more.
pub(crate) fn put_run(out: &mut Vec<u8>, value: u64, count: u64) {
    debug_assert!(value < 1 << 63 && count >= 1);
    if count == 1 {
        put_varint(out, value << 1);
    } else {
        put_varint(out, (value << 1) | 1);
        put_varint(out, count - 2);
    }
}

/// The next run of `b` ([`put_run`]) as (value, count), and the rest;
/// `None` if it is cut short or malformed.
pub(crate) fn take_run(b: &[u8]) -> Option<(u64, u64, &[u8])> {
    let (v, rest) = take_varint(b)?;
    if v & 1 == 0 {
        return Some((v >> 1, 1, rest));
    }
    let (extra, rest) = take_varint(rest)?;
    Some((v >> 1, extra.checked_add(2)?, rest))
}

/// Writes values as runs ([`put_run`]) as they come; [`finish`](Self::finish)
/// writes the last one.
pub(crate) struct RunWriter<'a> {
    out: &'a mut Vec<u8>,
    /// The run being counted: (value, count).
    run: Option<(u64, u64)>,
}

impl<'a> RunWriter<'a> {
    pub(crate) fn new(out: &'a mut Vec<u8>) -> Self {
        RunWriter { out, run: None }
    }

    pub(crate) fn push(&mut self, v: u64) {
        match &mut self.run {
            Some((value, count)) if *value == v => *count += 1,
            run => {
                if let Some((value, count)) = run.replace((v, 1)) {
                    put_run(self.out, value, count);
                }
            }
        }
    }

    pub(crate) fn finish(self) {
        if let Some((value, count)) = self.run {
            put_run(self.out, value, count);
        }
    }
}

/// Writes `values` as runs ([`RunWriter`]).
#[cfg(test)]
pub(crate) fn put_runs(out: &mut Vec<u8>, values: impl IntoIterator<Item = u64>) {
    let mut w = RunWriter::new(out);
    values.into_iter().for_each(|v| w.push(v));
    w.finish();
}

/// Every value of `b`'s runs, one per repeat; `None` if malformed.
#[cfg(test)]
pub(crate) fn expand_runs(mut b: &[u8]) -> Option<Vec<u64>> {
    let mut values = Vec::new();
    while !b.is_empty() {
        let (v, n, rest) = take_run(b)?;
        values.extend(std::iter::repeat_n(v, usize::try_from(n).ok()?));
        b = rest;
    }
    Some(values)
}

/// At most this many distinct devices in one object (indices are bytes).
const MAX_DEVICES: usize = u8::MAX as usize + 1;

pub(crate) fn serialize<S: Serializer>(metas: &[TensorMeta], s: S) -> Result<S::Ok, S::Error> {
    if metas.len() > MAX_TENSORS {
        return Err(serde::ser::Error::custom(format!(
            "an object has {} tensors, more than the {MAX_TENSORS} one object may have; \
             split it, or pack small tensors into larger ones",
            metas.len()
        )));
    }
    let mut devices: Vec<Device> = Vec::new();
    // Each kind's index, by its metadata.
    let mut index: rustc_hash::FxHashMap<&TensorMeta, u64> = Default::default();
    let mut kind_bytes = Vec::new();
    let mut tensors = Vec::new();
    let mut runs = RunWriter::new(&mut tensors);
    let mut last: Option<(&TensorMeta, u64)> = None;
    for m in metas {
        // The kind of the tensor before, usually; else the map.
        let i = match last {
            Some((k, i)) if k == m => i,
            _ => match index.get(m) {
                Some(&i) => i,
                None => {
                    let at = match devices.iter().rposition(|d| *d == m.device) {
                        Some(i) => i,
                        None => {
                            devices.push(m.device);
                            devices.len() - 1
                        }
                    };
                    if at >= MAX_DEVICES || m.shape.len() > u8::MAX as usize {
                        return Err(serde::ser::Error::custom(format!(
                            "an object's tensors span more than {MAX_DEVICES} devices, or one \
                             has more than 255 dimensions"
                        )));
                    }
                    kind_bytes.push(m.dtype as u8);
                    kind_bytes.push(at as u8);
                    kind_bytes.push(m.shape.len() as u8);
                    for &d in m.shape.iter() {
                        put_varint(&mut kind_bytes, d as u64);
                    }
                    let i = index.len() as u64;
                    index.insert(m, i);
                    i
                }
            },
        };
        last = Some((m, i));
        runs.push(i);
    }
    runs.finish();
    Columns {
        devices,
        kinds: kind_bytes,
        tensors,
    }
    .serialize(s)
}

pub(crate) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<TensorMeta>, D::Error> {
    let c = Columns::deserialize(d)?;
    let mut kinds = Vec::new();
    let mut b = &c.kinds[..];
    let bad = |what: &str| D::Error::custom(format!("tensor metadata: {what}"));
    while !b.is_empty() {
        let [dtype, on, rank, rest @ ..] = b else {
            return Err(bad("a kind cut short"));
        };
        let device = *c
            .devices
            .get(*on as usize)
            .ok_or_else(|| bad(&format!("device #{on} of {}", c.devices.len())))?;
        let dtype = *DTYPES
            .get(*dtype as usize)
            .ok_or_else(|| bad(&format!("dtype code {dtype}")))?;
        let rank = *rank as usize;
        b = rest;
        let mut next = || -> Result<usize, D::Error> {
            let (v, rest) =
                take_varint(b).ok_or_else(|| bad("a kind's dimensions cut short, or a bad one"))?;
            b = rest;
            usize::try_from(v).map_err(|_| bad("a dimension past usize"))
        };
        let shape = if rank <= INLINE_DIMS {
            // Filled in place: the usual shape, built without a copy.
            let mut inline = [0usize; INLINE_DIMS];
            for d in inline.iter_mut().take(rank) {
                *d = next()?;
            }
            Shape::inline(rank, inline)
        } else {
            let mut heap = Vec::with_capacity(rank);
            for _ in 0..rank {
                heap.push(next()?);
            }
            Shape::from(&heap[..])
        };
        kinds.push(TensorMeta {
            dtype,
            shape,
            device,
        });
    }
    let mut out = Vec::new();
    let mut t = &c.tensors[..];
    while !t.is_empty() {
        let (kind, count, rest) = take_run(t).ok_or_else(|| bad("a run cut short"))?;
        t = rest;
        let meta = usize::try_from(kind)
            .ok()
            .and_then(|k| kinds.get(k))
            .ok_or_else(|| bad(&format!("kind #{kind} of {}", kinds.len())))?;
        // A count past what a frame could hold is malformed, not a reason
        // to reserve memory for it.
        let count = usize::try_from(count)
            .ok()
            .filter(|&n| n <= MAX_TENSORS - out.len())
            .ok_or_else(|| bad(&format!("a run of {count} tensors")))?;
        out.extend(std::iter::repeat_n(meta, count).cloned());
    }
    Ok(out)
}

/// The most tensors one object may have (4 194 304): a frame of a few
/// bytes can claim a run of any length, and decoding makes every tensor's
/// metadata (about 60 bytes each), so a malformed count must not reach
/// the allocator. The largest models have about 10^5 tensors.
pub const MAX_TENSORS: usize = 1 << 22;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GpuUuid;

    #[derive(Serialize, Deserialize, PartialEq, Debug)]
    struct Holder(#[serde(with = "super")] Vec<TensorMeta>);

    fn meta(dtype: DType, shape: &[usize], device: Device) -> TensorMeta {
        TensorMeta {
            dtype,
            shape: shape.into(),
            device,
        }
    }

    #[test]
    fn metadata_comes_back_as_it_went() {
        let gpu = |o| Device::Cuda {
            uuid: GpuUuid::from_bytes([o as u8; 16]),
            ordinal: o,
        };
        let metas = vec![
            meta(DType::F32, &[4, 5], gpu(0)),
            meta(DType::U8, &[], Device::Cpu),
            meta(DType::BF16, &[1, 2, 3, 4, 5, 6], gpu(1)),
            meta(DType::I64, &[7], gpu(0)),
        ];
        let bytes = postcard::to_allocvec(&Holder(metas.clone())).unwrap();
        let back: Holder = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back.0, metas);
    }

    #[test]
    fn tensors_of_a_few_kinds_cost_a_byte_or_less_each() {
        let d = Device::Cuda {
            uuid: GpuUuid::from_bytes([9; 16]),
            ordinal: 0,
        };
        // One kind: a run.
        let metas = vec![meta(DType::BF16, &[1024, 64], d); 10_000];
        let bytes = postcard::to_allocvec(&Holder(metas.clone())).unwrap();
        assert!(bytes.len() < 64, "{} bytes", bytes.len());
        assert_eq!(postcard::from_bytes::<Holder>(&bytes).unwrap().0, metas);
        // The layers of a model: a dozen shapes, over and over.
        let layer: Vec<TensorMeta> = (0..12)
            .map(|i| meta(DType::BF16, &[4096, 128 * (i + 1)], d))
            .collect();
        let metas: Vec<TensorMeta> = layer.iter().cycle().take(10_000).cloned().collect();
        let bytes = postcard::to_allocvec(&Holder(metas.clone())).unwrap();
        assert!(bytes.len() < 10_000 + 200, "{} bytes", bytes.len());
        assert_eq!(postcard::from_bytes::<Holder>(&bytes).unwrap().0, metas);
        // Hundreds of kinds, in runs of
        // various lengths, and every dtype with large dimensions.
        let metas: Vec<TensorMeta> = (0..3000)
            .map(|i| meta(DType::F32, &[(i / 7) % 400, i % 3], d))
            .collect();
        let bytes = postcard::to_allocvec(&Holder(metas.clone())).unwrap();
        assert_eq!(postcard::from_bytes::<Holder>(&bytes).unwrap().0, metas);
        let all: Vec<TensorMeta> = DTYPES
            .iter()
            .map(|&t| meta(t, &[0, 1, 127, 128, usize::MAX >> 1, usize::MAX], d))
            .collect();
        let bytes = postcard::to_allocvec(&Holder(all.clone())).unwrap();
        assert_eq!(postcard::from_bytes::<Holder>(&bytes).unwrap().0, all);
    }

    #[test]
    fn runs_come_back_as_they_went() {
        let values = [0u64, 0, 0, 5, 1, 1, 63, 64, 64, 1 << 40, 0];
        let mut b = Vec::new();
        put_runs(&mut b, values.iter().copied());
        assert_eq!(expand_runs(&b).unwrap(), values);
        // A lone small value is one byte; a run of it two.
        let mut one = Vec::new();
        put_run(&mut one, 5, 1);
        assert_eq!(one.len(), 1);
        put_run(&mut one, 5, 100);
        assert_eq!(one.len(), 3);
        assert_eq!(take_run(&[0x01]), None, "a run without its count");
    }

    #[test]
    fn columns_that_disagree_are_errors() {
        // One CPU device; kinds (dtype, device, rank, dims) and runs.
        let cols = |kinds: &[u8], tensors: &[u8]| Columns {
            devices: vec![Device::Cpu],
            kinds: kinds.to_vec(),
            tensors: tensors.to_vec(),
        };
        let bad = [
            // A device that is not listed.
            cols(&[0, 1, 0], &[0]),
            // Fewer dimensions than the rank, and a kind cut short.
            cols(&[0, 0, 2, 3], &[0]),
            cols(&[0, 0], &[0]),
            // A tensor of a kind that is not listed.
            cols(&[0, 0, 1, 3], &[2]),
            // An unknown dtype code.
            cols(&[12, 0, 0], &[0]),
            // A dimension cut short, and one past 64 bits.
            cols(&[0, 0, 1, 0x80], &[0]),
            cols(
                &[
                    0, 0, 1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
                ],
                &[0],
            ),
            // A run without its count, and one too long to be real.
            cols(&[0, 0, 0], &[1]),
            cols(&[0, 0, 0], &[1, 0xff, 0xff, 0xff, 0xff, 0x7f]),
        ];
        for c in bad {
            let bytes = postcard::to_allocvec(&c).unwrap();
            let err = postcard::from_bytes::<Holder>(&bytes).unwrap_err();
            assert!(matches!(err, postcard::Error::SerdeDeCustom), "{err:?}");
        }
    }
}
