//! [`Targets`]: the tensors a weight update is received into, held once
//! and kept from one update to the next, matched to the object's tensors
//! by key or by position.
//!
//! # Invariants
//! - TG-1: a target is never matched to an object's tensor by a
//!   container's iteration order. Keyed targets match the object's tensors
//!   by path (map key, field name, item index: `rdt_transport::paths`);
//!   positional targets match by position only an object that holds no
//!   map above a tensor, and are refused for one that does.
//! - TG-2: a mismatch (a key on one side only, a dtype or shape that
//!   differs) fails with [`Error::Targets`] naming the first differing key
//!   in sorted order, before any byte lands in a target; the object stays
//!   readable.
//! - TG-3: resolving the same targets against the same value bytes of the
//!   same type gives the very same ordered list again (kept, not made
//!   again), so a weight sync's next step checks nothing again (WK-7).

use std::any::TypeId;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use parking_lot::Mutex;
use rdt_transport::{Tensor, TensorMeta};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{Error, Result};

/// The tensors [`get_into`](crate::ActorRuntime::get_into) and
/// [`load_into`](crate::ActorRuntime::load_into) receive an object's
/// tensors into: an actor's parameters, kept across weight updates.
///
/// **Keyed** targets ([`Targets::from`] a map of names to tensors, or
/// [`Targets::from_value`] of any value holding tensors) are matched to the
/// object's tensors by their path in the value: a map value by its key, a
/// struct field by its name, a sequence item by its index, joined with `.`
/// (`layers.3.w`). Neither side's iteration order matters, so a rollout
/// that keeps its parameters in its own `HashMap` gets every one right.
///
/// **Positional** targets (a `Vec`, a slice) are matched by the order the
/// value holds its tensors, which is fixed for structs, tuples and
/// sequences. An object that holds a tensor below a map (whose order is
/// the producer's hash order, which no other process can know) refuses
/// positional targets with [`Error::Targets`].
///
/// A mismatch (a key on one side only, a dtype or shape that differs)
/// fails with [`Error::Targets`] naming the first differing key, before any
/// byte lands, and the object stays readable.
///
/// Held once and never changed, a `Targets` is registered as it is; a
/// receive into the same `Targets` of the same layout as one before (a
/// weight sync's next step) checks nothing again. Cloning a `Targets`
/// clones a handle, not the tensors.
///
/// ```no_run
/// # use rdt::prelude::*;
/// # use rdt::Targets;
/// # use std::collections::HashMap;
/// # async fn f(weights: ObjectRef<HashMap<String, Tensor>>, params: &HashMap<String, Tensor>) -> rdt::Result<()> {
/// // Once, when the actor makes its parameters (kept by name):
/// let targets = Targets::from(params);
/// // At every step, inside a method that got a ref to the new weights:
/// rdt::runtime().load_into(&weights, &targets).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Default)]
pub struct Targets(Arc<Inner>);

#[derive(Default)]
struct Inner {
    /// The tensors: in the order given (positional), or sorted by key.
    tensors: Arc<[Tensor]>,
    /// Keyed targets: each tensor's key, in the order of `tensors`.
    keys: Option<Box<[String]>>,
    /// The last resolution (TG-3).
    kept: Mutex<Option<Resolved>>,
    /// Receives that may still write into the tensors (TG-4).
    writers: Arc<rdt_transport::TargetWriters>,
}

/// Targets resolved against one value's bytes.
struct Resolved {
    type_id: TypeId,
    data: Box<[u8]>,
    ordered: std::result::Result<Arc<[Tensor]>, String>,
}

impl std::fmt::Debug for Targets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Targets");
        d.field("tensors", &self.0.tensors.len());
        if let Some(keys) = &self.0.keys {
            d.field("keys", keys);
        }
        d.finish()
    }
}

impl Targets {
    fn positional(tensors: Arc<[Tensor]>) -> Targets {
        Targets(Arc::new(Inner {
            tensors,
            keys: None,
            kept: Mutex::new(None),
            writers: Arc::default(),
        }))
    }

    /// Waits until no receive writes into these targets (this list and
    /// its clones).
    ///
    /// A `get_into` or `load_into` dropped before it completes writes
    /// nothing more into the targets once the drop returns, except over a
    /// transport that writes them itself as the bytes come (`nixl`: a READ
    /// already posted ends, or is cancelled, a moment later). Wait for
    /// this before reading targets whose receive was dropped, or before
    /// handing them to another receive.
    ///
    /// # Cancel safety
    ///
    /// Cancel safe: it only waits.
    pub async fn idle(&self) {
        self.0.writers.idle().await
    }

    /// An open gate for a receive into these targets, its writers counted
    /// in theirs.
    pub(crate) fn gate(&self) -> rdt_transport::TargetGate {
        rdt_transport::TargetGate::new(self.0.writers.clone())
    }

    /// Keyed targets from `(key, tensor)` pairs; two tensors under one key
    /// are an error.
    pub fn by_key<K: Into<String>>(
        pairs: impl IntoIterator<Item = (K, Tensor)>,
    ) -> Result<Targets> {
        let mut pairs: Vec<(String, Tensor)> =
            pairs.into_iter().map(|(k, t)| (k.into(), t)).collect();
        pairs.sort_by(|a, b| a.0.cmp(&b.0));
        if let Some(w) = pairs.windows(2).find(|w| w[0].0 == w[1].0) {
            return Err(Error::Targets {
                object: 0,
                message: format!("two target tensors have the key `{}`", w[0].0),
            });
        }
        let (keys, tensors): (Vec<String>, Vec<Tensor>) = pairs.into_iter().unzip();
        Ok(Targets(Arc::new(Inner {
            tensors: tensors.into(),
            keys: Some(keys.into()),
            kept: Mutex::new(None),
            writers: Arc::default(),
        })))
    }

    /// Keyed targets: every tensor of `value` under its path in it (map
    /// values by key, struct fields by name, sequence items by index,
    /// joined with `.`), the same paths the object's tensors have when it
    /// is a value of the same shape. The tensors are the value's own (their
    /// handles cloned): a receive writes into them.
    pub fn from_value<T: Serialize + ?Sized>(value: &T) -> Result<Targets> {
        let (found, _) = rdt_transport::paths::tensor_paths(value).map_err(|e| Error::Targets {
            object: 0,
            message: format!("the targets' value has no paths: {e}"),
        })?;
        Targets::by_key(found)
    }

    /// The tensors: in the order given, or, keyed, sorted by key.
    pub fn as_slice(&self) -> &[Tensor] {
        &self.0.tensors
    }

    /// The keys of keyed targets, in the order of [`as_slice`](Self::as_slice).
    pub fn keys(&self) -> Option<&[String]> {
        self.0.keys.as_deref()
    }

    /// The tensors in the order an object whose value is of type `T` and
    /// encodes to `data` holds its `count` tensors (TG-1), checked against
    /// their metadata (`meta_of(i)`, TG-2); the same list again for the
    /// same bytes (TG-3).
    pub(crate) fn resolve<T>(
        &self,
        object: u64,
        data: &[u8],
        count: usize,
        meta_of: &dyn Fn(usize) -> Option<TensorMeta>,
    ) -> Result<Arc<[Tensor]>>
    where
        T: Serialize + DeserializeOwned + 'static,
    {
        let type_id = TypeId::of::<T>();
        let mut kept = self.0.kept.lock();
        if let Some(r) = &*kept {
            if r.type_id == type_id && *r.data == *data {
                return r
                    .ordered
                    .clone()
                    .map_err(|message| Error::Targets { object, message });
            }
        }
        let ordered = self.order::<T>(data, count, meta_of);
        *kept = Some(Resolved {
            type_id,
            data: data.into(),
            ordered: ordered.clone(),
        });
        ordered.map_err(|message| Error::Targets { object, message })
    }

    fn order<T>(
        &self,
        data: &[u8],
        count: usize,
        meta_of: &dyn Fn(usize) -> Option<TensorMeta>,
    ) -> std::result::Result<Arc<[Tensor]>, String>
    where
        T: Serialize + DeserializeOwned + 'static,
    {
        let paths = rdt_transport::paths::object_paths::<T>(data, count).map_err(|e| {
            format!(
                "the object's tensors have no paths as {}: {e}",
                std::any::type_name::<T>()
            )
        })?;
        let Some(keys) = &self.0.keys else {
            if paths.keyed {
                let below = paths
                    .by_path
                    .first()
                    .map_or(String::new(), |(p, _)| format!(" (`{p}`)"));
                return Err(format!(
                    "its tensors sit below a map{below}, in the producer's map order, which no \
                     other process can know: positional targets are refused for it; match them \
                     by key with `Targets::from(&map)` or `Targets::from_value(&value)`"
                ));
            }
            // Positional: counts, dtypes and shapes are checked where the
            // list is received into (`check_targets`).
            return Ok(self.0.tensors.clone());
        };
        let tensors = &self.0.tensors;
        let mut ordered: Vec<Option<Tensor>> = vec![None; count];
        let (mut o, mut t) = (0, 0);
        let obj = &paths.by_path;
        // A merge of two sorted key lists: the first key on one side only,
        // or with another dtype or shape, is the one named (TG-2).
        while o < obj.len() || t < keys.len() {
            let (ok, tk) = (obj.get(o).map(|x| &x.0), keys.get(t));
            match (ok, tk) {
                (Some(ok), Some(tk)) if ok == tk => {
                    let i = obj[o].1 as usize;
                    let Some(meta) = meta_of(i) else {
                        return Err(format!(
                            "its tensor `{ok}` is not among the tensors received"
                        ));
                    };
                    let target = &tensors[t];
                    if meta.dtype != target.dtype() || *meta.shape != *target.shape() {
                        return Err(format!(
                            "its tensor `{ok}` is {} {:?} and the target `{tk}` is {} {:?}",
                            meta.dtype,
                            &*meta.shape,
                            target.dtype(),
                            target.shape()
                        ));
                    }
                    match &ordered[i] {
                        None => ordered[i] = Some(target.clone()),
                        // One tensor held at two paths: one target for both.
                        Some(first)
                            if first.shares_storage(target)
                                && first.byte_offset() == target.byte_offset() => {}
                        Some(_) => {
                            return Err(format!(
                                "the object holds one tensor at `{ok}` and at another path, and \
                                 their targets are two tensors: give both keys the same tensor"
                            ))
                        }
                    }
                    o += 1;
                    t += 1;
                }
                (Some(ok), tk) if tk.is_none_or(|tk| ok < tk) => {
                    return Err(format!(
                        "it has a tensor at `{ok}` and the targets have none"
                    ));
                }
                (_, Some(tk)) => {
                    return Err(format!(
                        "the targets have `{tk}` and the object has no tensor there"
                    ));
                }
                (_, None) => unreachable!("the loop runs while one side has keys"),
            }
        }
        ordered
            .into_iter()
            .enumerate()
            .map(|(i, t)| t.ok_or_else(|| format!("its tensor #{i} has no path")))
            .collect()
    }
}

impl std::ops::Deref for Targets {
    type Target = [Tensor];
    fn deref(&self) -> &[Tensor] {
        &self.0.tensors
    }
}

/// Positional targets.
impl From<Vec<Tensor>> for Targets {
    fn from(v: Vec<Tensor>) -> Targets {
        Targets::positional(v.into())
    }
}

/// Positional targets.
impl From<Arc<[Tensor]>> for Targets {
    fn from(v: Arc<[Tensor]>) -> Targets {
        Targets::positional(v)
    }
}

/// Positional targets: a copy of the slice's tensors (a clone of each).
impl From<&[Tensor]> for Targets {
    fn from(v: &[Tensor]) -> Targets {
        Targets::positional(v.into())
    }
}

/// Positional targets: a copy of the vector's tensors (a clone of each).
impl From<&Vec<Tensor>> for Targets {
    fn from(v: &Vec<Tensor>) -> Targets {
        Targets::positional(v.as_slice().into())
    }
}

/// The same tensors (a handle cloned, not the tensors).
impl From<&Targets> for Targets {
    fn from(v: &Targets) -> Targets {
        v.clone()
    }
}

/// Positional targets.
impl FromIterator<Tensor> for Targets {
    fn from_iter<I: IntoIterator<Item = Tensor>>(iter: I) -> Targets {
        Targets::positional(iter.into_iter().collect())
    }
}

/// Keyed targets: each tensor under its key (its handle cloned).
impl<S> From<&HashMap<String, Tensor, S>> for Targets {
    fn from(map: &HashMap<String, Tensor, S>) -> Targets {
        keyed_from_unique(map.iter())
    }
}

/// Keyed targets: each tensor under its key.
impl<S> From<HashMap<String, Tensor, S>> for Targets {
    fn from(map: HashMap<String, Tensor, S>) -> Targets {
        keyed_from_unique(map.iter())
    }
}

/// Keyed targets: each tensor under its key (its handle cloned).
impl From<&BTreeMap<String, Tensor>> for Targets {
    fn from(map: &BTreeMap<String, Tensor>) -> Targets {
        keyed_from_unique(map.iter())
    }
}

/// Keyed targets: each tensor under its key.
impl From<BTreeMap<String, Tensor>> for Targets {
    fn from(map: BTreeMap<String, Tensor>) -> Targets {
        keyed_from_unique(map.iter())
    }
}

/// A map's keys are unique, so `by_key` cannot fail.
fn keyed_from_unique<'a>(pairs: impl Iterator<Item = (&'a String, &'a Tensor)>) -> Targets {
    Targets::by_key(pairs.map(|(k, t)| (k.clone(), t.clone()))).expect("a map's keys are unique")
}

/// Targets registered for a receive (WK-7), with how to order them for the
/// value's type, which the receive does not know.
#[derive(Clone)]
pub(crate) struct Registered {
    pub(crate) targets: Targets,
    resolve: Resolve,
    /// TG-4: how far the receive that took them got, for the `get_into`
    /// that registered them.
    pub(crate) landing: Arc<Landing>,
}

/// TG-4 (cancel safety): a receive into registered targets, as the
/// `get_into` that registered them sees it. When that `get_into` is
/// dropped, the gate closes (no copy into the targets from then on) and a
/// receive that writes into them in place as its bytes come (`nixl`,
/// `nccl`) is aborted.
pub(crate) struct Landing {
    pub(crate) gate: Arc<rdt_transport::TargetGate>,
    /// The transfer of a receive that writes into the targets in place.
    pub(crate) in_place: Mutex<Option<u64>>,
}

type Resolve =
    fn(&Targets, u64, &[u8], usize, &dyn Fn(usize) -> Option<TensorMeta>) -> Result<Arc<[Tensor]>>;

impl Registered {
    /// `targets` for a value of type `T`.
    pub(crate) fn of<T: Serialize + DeserializeOwned + 'static>(targets: &Targets) -> Registered {
        Registered {
            targets: targets.clone(),
            resolve: Targets::resolve::<T>,
            landing: Arc::new(Landing {
                gate: Arc::new(targets.gate()),
                in_place: Mutex::default(),
            }),
        }
    }

    /// [`Targets::resolve`] for the registered type.
    pub(crate) fn resolve(
        &self,
        object: u64,
        data: &[u8],
        count: usize,
        meta_of: &dyn Fn(usize) -> Option<TensorMeta>,
    ) -> Result<Arc<[Tensor]>> {
        (self.resolve)(&self.targets, object, data, count, meta_of)
    }
}
