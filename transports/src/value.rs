//! Values with tensors inside: extraction and reinsertion (DESIGN §5).
//!
//! [`encode`] serializes any `Serialize` value with postcard while a
//! thread-local *sink* is active: each [`Tensor`] met on the way is replaced
//! by a placeholder index and collected. [`decode`] deserializes while a
//! *source* of tensors is active and puts them back by index.
//!
//! # Invariants
//! 1. A tensor is collected once per storage: the same tensor (or clones of
//!    it) appearing several times in one value is moved once and comes back
//!    as clones sharing one storage. Finding the earlier entry is a hash
//!    lookup, so encoding `n` tensors costs O(n). Different views of one
//!    storage ([`Tensor::view`]) are collected each once; the transport
//!    decides whether they come back as views of one storage again.
//! 2. Outside [`encode`]/[`decode`], `Tensor` serializes self-contained
//!    (dtype, shape and bytes), so user code may serialize tensors with any
//!    serde format.
//! 3. The contexts are thread-local and restored on exit, so encoding is
//!    re-entrant and never observed by another thread.
//! 4. A value that is exactly its tensors in order (a `Vec<Tensor>` of
//!    distinct tensors: a weights list) decodes without serde, to the
//!    same tensors serde would give ([`decode`], [`decode_list`]).

use std::cell::RefCell;

use rustc_hash::FxHashMap;

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::metas_wire::{put_varint, take_varint};
use crate::{dtype::DType, shape::Shape, tensor::Tensor, tensor::TensorList};

/// A value split into its serialized non-tensor part and its tensors.
#[derive(Clone, Debug, Default)]
pub struct Payload {
    /// postcard bytes of the value, with tensors replaced by indices.
    pub data: Bytes,
    /// The tensors, in placeholder order.
    pub tensors: Vec<Tensor>,
}

/// Errors of [`encode`] and [`decode`].
#[derive(Debug, thiserror::Error, Clone, PartialEq, Eq)]
pub enum ValueError {
    /// serde failed.
    #[error("{0}")]
    Serde(String),
    /// A placeholder names a tensor that is not there.
    #[error("value refers to tensor #{index} but only {count} tensors came with it")]
    MissingTensor {
        /// Index in the value.
        index: u32,
        /// Tensors present.
        count: usize,
    },
}

pub(crate) const PLACEHOLDER: &str = "__rdt_tensor";

/// What identifies a collected tensor (invariant 1): its storage (the sink
/// holds a clone, so the address is not reused while encoding), byte
/// offset in it, dtype and shape.
type SinkKey = (usize, usize, DType, Shape);

/// The tensors met while encoding, and where each went.
///
/// A weights object has thousands of tensors and this lookup is on each
/// one's path, so: the common case (one tensor per storage, or views of
/// one flat buffer at different offsets) is a map from the storage's
/// address and the byte offset, hashed with FxHash rather than SipHash
/// (the keys are addresses in this process, not input anyone chooses); and
/// that map is kept by the thread between encodes, cleared, so that a
/// large one is not allocated (and its pages faulted in) on every call.
#[derive(Default)]
struct Sink {
    /// The tensors, in placeholder order.
    tensors: Vec<Tensor>,
    /// Placeholder index of the first tensor collected for each storage
    /// and byte offset.
    by_storage: FxHashMap<(usize, usize), u32>,
    /// Other views (dtype or shape) at an offset already collected: rare.
    views: FxHashMap<SinkKey, u32>,
}

/// The largest `Sink::by_storage` a thread keeps between encodes (entries).
const KEEP_SINK_MAP: usize = 1 << 20;

thread_local! {
    static SPARE_SINK_MAP: RefCell<FxHashMap<(usize, usize), u32>> = RefCell::default();
}

impl Sink {
    fn new() -> Self {
        Sink {
            by_storage: SPARE_SINK_MAP.with(|m| std::mem::take(&mut *m.borrow_mut())),
            ..Sink::default()
        }
    }

    /// The placeholder index of `t`, collecting it if it is new.
    fn collect(&mut self, t: &Tensor) -> u32 {
        use std::collections::hash_map::Entry;
        let next = self.tensors.len() as u32;
        match self.by_storage.entry((t.storage_id(), t.byte_offset())) {
            Entry::Vacant(e) => {
                e.insert(next);
                self.tensors.push(t.clone());
                next
            }
            Entry::Occupied(e) => {
                let first = &self.tensors[*e.get() as usize];
                if first.dtype() == t.dtype() && first.shape() == t.shape() {
                    return *e.get();
                }
                let key = (
                    t.storage_id(),
                    t.byte_offset(),
                    t.dtype(),
                    Shape::from(t.shape()),
                );
                *self.views.entry(key).or_insert_with(|| {
                    self.tensors.push(t.clone());
                    next
                })
            }
        }
    }

    /// The tensors; the map goes back to the thread for the next encode.
    fn finish(self) -> Vec<Tensor> {
        let mut map = self.by_storage;
        if map.capacity() <= KEEP_SINK_MAP {
            map.clear();
            SPARE_SINK_MAP.with(|m| *m.borrow_mut() = map);
        }
        self.tensors
    }
}

enum Ctx {
    Sink(Sink),
    /// The tensors [`decode`] was given, borrowed for the length of the
    /// call (see there): a weights value has thousands of tensors, and
    /// copying the list first cost a clone and a drop of each.
    Source(*const [Tensor]),
    /// The same, from a [`TensorList`] (a lazy one makes each tensor
    /// here, once: [`decode_list`]).
    List(*const TensorList),
}

thread_local! {
    static CTX: RefCell<Option<Ctx>> = const { RefCell::new(None) };
    // postcard drops custom error messages; the missing index goes here.
    static MISSING: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

struct Restore(Option<Ctx>);
impl Drop for Restore {
    fn drop(&mut self) {
        let prev = self.0.take();
        CTX.with(|c| *c.borrow_mut() = prev);
    }
}

fn enter(ctx: Ctx) -> Restore {
    Restore(CTX.with(|c| c.borrow_mut().replace(ctx)))
}

fn take_ctx() -> Option<Ctx> {
    CTX.with(|c| c.borrow_mut().take())
}

/// Serializes `value`, pulling its tensors out.
pub fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Payload, ValueError> {
    let guard = enter(Ctx::Sink(Sink::new()));
    let data = postcard::to_stdvec(value).map_err(|e| ValueError::Serde(e.to_string()));
    let tensors = match take_ctx() {
        Some(Ctx::Sink(sink)) => sink.finish(),
        _ => Vec::new(),
    };
    drop(guard);
    Ok(Payload {
        data: Bytes::from(data?),
        tensors,
    })
}

/// Deserializes a value, putting `tensors` back in place of placeholders.
pub fn decode<T: DeserializeOwned + 'static>(
    data: &[u8],
    tensors: &[Tensor],
) -> Result<T, ValueError> {
    if let Some(v) = exactly_its_tensors(data, tensors.len(), || tensors.to_vec()) {
        return Ok(v);
    }
    decode_from(Ctx::Source(tensors as *const [Tensor]), data, tensors.len())
}

/// Invariant 4: `T` is `Vec<Tensor>` and `data` holds the value's `count`
/// tensors in order, so the value is `tensors()` itself.
///
/// Serde's path costs a placeholder read, a context lookup and a move of
/// each tensor through the visitor: about 25 ns a tensor more than making
/// the vector directly (10 000 tensors on the dev VM: 430 against 190 µs,
/// and more on the GPU hosts), on every receive of a weights list and
/// every weight update. The check reads `data` once and makes nothing.
fn exactly_its_tensors<T: 'static>(
    data: &[u8],
    count: usize,
    tensors: impl FnOnce() -> Vec<Tensor>,
) -> Option<T> {
    if std::any::TypeId::of::<T>() != std::any::TypeId::of::<Vec<Tensor>>()
        || !is_tensors_in_order(data, count)
    {
        return None;
    }
    let mut value = Some(tensors());
    (&mut value as &mut dyn std::any::Any)
        .downcast_mut::<Option<T>>()
        .and_then(Option::take)
}

/// Whether `data` is postcard's encoding of a sequence of `count`
/// placeholders 0, 1, …, `count - 1` (each a varint, as the length is),
/// and nothing after.
///
/// `data` is compared with that encoding, made once per count and kept
/// by each thread for the next call (a weights object comes again at
/// every step): one comparison of 20 KB for 10 000 tensors, where reading
/// their varints one by one took 20–30 µs of every call on the H200
/// hosts. Counts past [`IN_ORDER_KEPT`] are read one by one.
pub(crate) fn is_tensors_in_order(data: &[u8], count: usize) -> bool {
    if take_varint(data).is_none_or(|(n, _)| n != count as u64) {
        return false;
    }
    if count <= IN_ORDER_KEPT {
        thread_local! {
            static IN_ORDER: RefCell<(usize, Vec<u8>)> =
                const { RefCell::new((usize::MAX, Vec::new())) };
        }
        return IN_ORDER.with(|kept| {
            let mut kept = kept.borrow_mut();
            if kept.0 != count {
                *kept = (count, in_order_encoding(count));
            }
            data == kept.1.as_slice()
        });
    }
    let mut rest = data;
    let mut next_is = |want: usize| match take_varint(rest) {
        Some((v, r)) if v == want as u64 => {
            rest = r;
            true
        }
        _ => false,
    };
    next_is(count) && (0..count).all(&mut next_is) && rest.is_empty()
}

/// The fewest tensors for which [`tensors_in_order`] says yes: below it,
/// the bytes are fewer than a check costs.
pub const IN_ORDER_MIN: usize = 64;

/// If `data` is exactly a sequence of its `n` tensors' placeholders in
/// order (what a `Vec<Tensor>` value encodes to; `n` at least
/// [`IN_ORDER_MIN`]), `n`. The framework then sends `n` instead of the
/// bytes (about two per tensor) and makes them again from it where they
/// arrive ([`in_order_data`]).
pub fn tensors_in_order(data: &[u8]) -> Option<usize> {
    // Every value passes here on its way out: most are small.
    if data.len() <= IN_ORDER_MIN {
        return None;
    }
    // Made here by `in_order_data` (the driver forwards what it received
    // so): known without a comparison.
    if let Some((n, b)) = &*IN_ORDER_LAST.lock() {
        if std::ptr::eq(b.as_ptr(), data.as_ptr()) && b.len() == data.len() {
            return Some(*n);
        }
    }
    let (n, _) = take_varint(data)?;
    let n = usize::try_from(n).ok()?;
    ((IN_ORDER_MIN..=crate::metas_wire::MAX_TENSORS).contains(&n) && is_tensors_in_order(data, n))
        .then_some(n)
}

/// The last encoding [`in_order_data`] made, and its count.
static IN_ORDER_LAST: parking_lot::Mutex<Option<(usize, Bytes)>> = parking_lot::Mutex::new(None);

/// The encoding of `n` tensors' placeholders in order ([`tensors_in_order`]),
/// at most [`MAX_TENSORS`](crate::MAX_TENSORS) of them: made once for
/// the last count asked for in this process and shared after (a weights
/// object comes again at every step).
pub fn in_order_data(n: usize) -> Option<Bytes> {
    if n > crate::metas_wire::MAX_TENSORS {
        return None;
    }
    let mut last = IN_ORDER_LAST.lock();
    if let Some((m, b)) = &*last {
        if *m == n {
            return Some(b.clone());
        }
    }
    let b = Bytes::from(in_order_encoding(n));
    *last = Some((n, b.clone()));
    Some(b)
}

/// postcard's encoding of a sequence of `n` placeholders 0, 1, …, `n - 1`.
fn in_order_encoding(n: usize) -> Vec<u8> {
    let mut wire = Vec::with_capacity(2 * n + 3);
    put_varint(&mut wire, n as u64);
    for i in 0..n {
        put_varint(&mut wire, i as u64);
    }
    wire
}

/// Deserializes `data` with `source` (a [`Ctx::Source`] or [`Ctx::List`]
/// of `count` tensors) as the context.
///
/// The context holds a pointer to the caller's tensors, valid while this
/// call runs: the guard puts the previous context back before it returns
/// (or unwinds), so nothing reads the pointer after (invariant 3).
/// The longest list whose in-order encoding a thread keeps (about 300 KB).
const IN_ORDER_KEPT: usize = 100_000;

fn decode_from<T: DeserializeOwned>(
    source: Ctx,
    data: &[u8],
    count: usize,
) -> Result<T, ValueError> {
    let _guard = enter(source);
    MISSING.with(|m| m.set(None));
    postcard::from_bytes(data).map_err(|e| match MISSING.with(|m| m.take()) {
        Some(index) => ValueError::MissingTensor { index, count },
        None => ValueError::Serde(e.to_string()),
    })
}

/// [`decode`], taking each tensor from `tensors` by index: a lazy list
/// makes only the tensors the value names, each once, without making its
/// whole slice first.
pub fn decode_list<T: DeserializeOwned + 'static>(
    data: &[u8],
    tensors: &TensorList,
) -> Result<T, ValueError> {
    if let Some(v) = exactly_its_tensors(data, tensors.len(), || tensors.to_vec()) {
        return Ok(v);
    }
    if !tensors.is_lazy() {
        return decode(data, tensors.as_slice());
    }
    decode_from(Ctx::List(tensors as *const TensorList), data, tensors.len())
}

#[derive(Serialize, Deserialize)]
struct SelfContained {
    dtype: DType,
    shape: Vec<usize>,
    #[serde(with = "serde_bytes")]
    bytes: Vec<u8>,
}

thread_local! {
    /// The tensors handed over by `Tensor`'s `Serialize` while a walk for
    /// the tensors' paths (`paths`) runs on this thread (the walker itself
    /// sees only their index).
    pub(crate) static WALKING: RefCell<Option<Vec<Tensor>>> = const { RefCell::new(None) };
}

/// While a walk runs on this thread: keeps `t` for it and returns the
/// index `Tensor`'s `Serialize` hands the walker as its placeholder.
pub(crate) fn walked(t: &Tensor) -> Option<u32> {
    WALKING.with(|w| {
        w.borrow_mut().as_mut().map(|v| {
            v.push(t.clone());
            (v.len() - 1) as u32
        })
    })
}

impl Serialize for Tensor {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let index = CTX.with(|c| match &mut *c.borrow_mut() {
            // Invariant 1: one entry per storage.
            Some(Ctx::Sink(sink)) => Some(sink.collect(self)),
            _ => None,
        });
        // A walk for the tensors' paths (`paths`): a placeholder too.
        let index = index.or_else(|| walked(self));
        match index {
            Some(i) => s.serialize_newtype_struct(PLACEHOLDER, &i),
            None => {
                let bytes = self.copy_bytes().map_err(serde::ser::Error::custom)?;
                SelfContained {
                    dtype: self.dtype(),
                    shape: self.shape().to_vec(),
                    bytes,
                }
                .serialize(s)
            }
        }
    }
}

impl<'de> Deserialize<'de> for Tensor {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        enum From {
            Slice(*const [Tensor]),
            List(*const TensorList),
        }
        let source = CTX.with(|c| match &*c.borrow() {
            Some(Ctx::Source(v)) => Some(From::Slice(*v)),
            Some(Ctx::List(l)) => Some(From::List(*l)),
            _ => None,
        });
        if let Some(from) = source {
            #[derive(Deserialize)]
            #[serde(rename = "__rdt_tensor")]
            struct Index(u32);
            let Index(i) = Index::deserialize(d)?;
            let t = match from {
                // SAFETY: set by `decode` from a slice that outlives the
                // context, hence this call (see there).
                From::Slice(v) => unsafe { &*v }.get(i as usize).cloned(),
                // SAFETY: the same, by `decode_list`.
                From::List(l) => unsafe { &*l }.tensor(i as usize),
            };
            t.ok_or_else(|| {
                MISSING.with(|m| m.set(Some(i)));
                serde::de::Error::custom(format!("tensor #{i} is missing"))
            })
        } else {
            let sc = SelfContained::deserialize(d)?;
            Tensor::from_bytes(sc.dtype, &sc.shape, sc.bytes).map_err(serde::de::Error::custom)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[derive(Serialize, Deserialize)]
    struct Nested {
        name: String,
        weights: HashMap<String, Tensor>,
        extra: Option<Vec<Tensor>>,
        step: u64,
    }

    #[test]
    fn nested_round_trip_keeps_storage() {
        let a = Tensor::full(1.5f32, &[4]);
        let b = Tensor::arange::<i64>(10);
        let mut weights = HashMap::new();
        weights.insert("a".to_string(), a.clone());
        weights.insert("b".to_string(), b.clone());
        let v = Nested {
            name: "x".into(),
            weights,
            extra: Some(vec![a.clone()]),
            step: 7,
        };
        let p = encode(&v).unwrap();
        assert_eq!(p.tensors.len(), 2, "the repeated tensor is collected once");
        let back: Nested = decode(&p.data, &p.tensors).unwrap();
        assert_eq!(back.step, 7);
        assert!(back.weights["a"].shares_storage(&a));
        assert!(back.extra.unwrap()[0].shares_storage(&a));
        assert_eq!(
            back.weights["b"].to_vec::<i64>().unwrap(),
            (0..10).collect::<Vec<_>>()
        );
    }

    /// Defect 8: de-duplication was a linear scan per tensor, quadratic in
    /// the tensor count (20 000 tensors took seconds).
    #[test]
    fn many_tensors_are_deduplicated_by_storage() {
        const N: usize = 20_000;
        let distinct: Vec<Tensor> = (0..N).map(|i| Tensor::full(i as u32, &[1])).collect();
        // Every tensor, then every tenth again (a clone: same storage), then
        // a view of the first one's storage as another dtype, then the
        // first again.
        let view = distinct[0].view_as(DType::I32, &[1]);
        let mut value: Vec<Tensor> = distinct.clone();
        value.extend(distinct.iter().step_by(10).cloned());
        value.push(view.clone());
        value.push(distinct[0].clone());

        let p = encode(&value).unwrap();
        assert_eq!(p.tensors.len(), N + 1, "repeats are collected once");
        for (i, t) in distinct.iter().enumerate() {
            assert!(p.tensors[i].shares_storage(t), "first-use order");
        }

        // The placeholders of a tensor and of its repeat name one index.
        let indices: Vec<u32> = postcard::from_bytes(&p.data).unwrap();
        assert_eq!(indices.len(), value.len());
        assert!(indices[..N].iter().enumerate().all(|(i, &x)| x == i as u32));
        for (k, i) in (0..N).step_by(10).enumerate() {
            assert_eq!(indices[N + k], indices[i], "repeat of tensor {i}");
        }
        let tail = &indices[N + N / 10..];
        assert_eq!(tail, &[N as u32, 0], "another view is another entry");

        let back: Vec<Tensor> = decode(&p.data, &p.tensors).unwrap();
        assert!(back[N].shares_storage(&distinct[0]));
        assert!(back[N + 1].shares_storage(&back[10]));
        let last = back.len() - 1;
        assert!(back[last].shares_storage(&back[0]) && back[last - 1].shares_storage(&back[0]));
        assert_eq!(back[last - 1].dtype(), DType::I32);
        assert_eq!(back[0].dtype(), DType::U32);
        assert_eq!(back[12_345].to_vec::<u32>().unwrap(), vec![12_345]);
    }

    #[test]
    fn views_of_one_storage_are_collected_once_each() {
        let flat = Tensor::arange::<f32>(16);
        let a = flat.view(0, DType::F32, &[4]).unwrap();
        let b = flat.view(16, DType::F32, &[4]).unwrap();
        let a_again = flat.view(0, DType::F32, &[4]).unwrap();
        let a_as_u32 = flat.view(0, DType::U32, &[4]).unwrap();
        let a_as_2x2 = flat.view(0, DType::F32, &[2, 2]).unwrap();
        let value = vec![a, b, a_again, a_as_u32, a_as_2x2, flat.clone()];
        let p = encode(&value).unwrap();
        // a (and a_again), b, the u32 and 2×2 readings of a's bytes, flat.
        assert_eq!(p.tensors.len(), 5);
        let back: Vec<Tensor> = decode(&p.data, &p.tensors).unwrap();
        for (x, y) in back.iter().zip(&value) {
            assert_eq!(
                (x.dtype(), x.shape(), x.byte_offset()),
                (y.dtype(), y.shape(), y.byte_offset())
            );
            assert_eq!(x.copy_bytes().unwrap(), y.copy_bytes().unwrap());
        }
    }

    /// Invariant 4: a list of distinct tensors in order is recognised
    /// (also past 127 tensors, where placeholders take two bytes), decodes
    /// to the same tensors as serde gives, from a slice and from a lazy
    /// list; anything else goes through serde.
    #[test]
    fn a_weights_list_decodes_without_serde_to_the_same_tensors() {
        const N: usize = 300;
        let flat = Tensor::arange::<f32>(N * 2);
        let value: Vec<Tensor> = (0..N)
            .map(|i| flat.view(i * 8, DType::F32, &[2]).unwrap())
            .collect();
        let p = encode(&value).unwrap();
        assert!(is_tensors_in_order(&p.data, N));
        assert!(!is_tensors_in_order(&p.data, N - 1));
        assert!(!is_tensors_in_order(&p.data[..p.data.len() - 1], N));
        let fast = exactly_its_tensors::<Vec<Tensor>>(&p.data, N, || p.tensors.clone())
            .expect("a weights list takes the direct path");
        assert!(exactly_its_tensors::<Vec<u32>>(&p.data, N, Vec::new).is_none());
        let through_serde: Vec<Tensor> =
            decode_from(Ctx::Source(&p.tensors[..] as *const _), &p.data, N).unwrap();
        let from_slice: Vec<Tensor> = decode(&p.data, &p.tensors).unwrap();
        let lazy = TensorList::lazy(std::sync::Arc::new(crate::tensor::list::tests::Views::of(
            flat.clone(),
            N,
        )));
        let from_lazy: Vec<Tensor> = decode_list(&p.data, &lazy).unwrap();
        assert!(lazy.is_lazy(), "the direct path keeps no slice");
        for got in [&fast, &from_slice, &from_lazy] {
            assert_eq!(got.len(), N);
            for (x, y) in got.iter().zip(&through_serde) {
                assert!(x.shares_storage(y));
                assert_eq!(
                    (x.dtype(), x.shape(), x.byte_offset()),
                    (y.dtype(), y.shape(), y.byte_offset())
                );
            }
        }
        assert_eq!(from_lazy[N - 1].to_vec::<f32>().unwrap(), [598.0, 599.0]);

        // A repeated tensor, or a value that holds the list inside
        // something else, is not its tensors in order.
        let repeated = encode(&vec![value[0].clone(), value[1].clone(), value[0].clone()]).unwrap();
        assert!(!is_tensors_in_order(&repeated.data, 2));
        let back: Vec<Tensor> = decode(&repeated.data, &repeated.tensors).unwrap();
        assert!(back[2].shares_storage(&back[0]) && back[2].byte_offset() == 0);
        let wrapped = encode(&(7u8, value.clone())).unwrap();
        assert!(!is_tensors_in_order(&wrapped.data, N));
        let (seven, back): (u8, Vec<Tensor>) = decode(&wrapped.data, &wrapped.tensors).unwrap();
        assert_eq!((seven, back.len()), (7, N));
    }

    /// Past the kept length, the placeholders are read one by one, with
    /// the same answers.
    #[test]
    fn a_list_longer_than_the_kept_one_is_read_one_by_one() {
        let n = IN_ORDER_KEPT + 1;
        let mut wire = in_order_encoding(n);
        assert!(is_tensors_in_order(&wire, n));
        let last = wire.len() - 1;
        wire[last] ^= 1;
        assert!(!is_tensors_in_order(&wire, n));
        assert!(!is_tensors_in_order(&wire[..last], n));
    }

    #[test]
    fn missing_tensor_is_an_error() {
        let p = encode(&vec![Tensor::full(1u8, &[1])]).unwrap();
        let e = decode::<Vec<Tensor>>(&p.data, &[]).unwrap_err();
        assert_eq!(e, ValueError::MissingTensor { index: 0, count: 0 });
    }

    #[test]
    fn self_contained_outside_context() {
        let t = Tensor::from_slice(&[1.0f64, 2.0], &[2]).unwrap();
        let bytes = postcard::to_stdvec(&t).unwrap();
        let back: Tensor = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back.to_vec::<f64>().unwrap(), vec![1.0, 2.0]);
        assert!(!back.shares_storage(&t));
    }
}
