//! The process side of a runtime: who counts the refs made in this process
//! and through whom its calls go. In the driver that is the owner table
//! itself; in an actor it is the driver, over the worker's control link
//! (DESIGN §3, "Actors are clients too"). Also how refs and actor handles
//! serialize, so that they can be arguments, return values or nested in
//! values.
//!
//! # Invariants
//! - **CL-1 One count per holder.** In the driver every ref is one count
//!   in the owner table. In an actor, refs are counted locally; the driver
//!   holds one count for the actor while its local count is above zero
//!   (`Borrow` on the way up from zero, `Release` on the way down to it).
//!   The result of a call an actor submits, and a value it puts, start
//!   borrowed by it.
//! - **CL-2 Refs in a value are held while the value travels.**
//!   Serializing a value takes a count on every ref in it, kept by the
//!   sender until the message carrying the value is queued, and lists the
//!   ids in the value (`WireValue::refs`). The driver takes a count on each
//!   when the message arrives and keeps it while the object, pending call
//!   or value holding them lives. A release queued after the message is
//!   handled after it (one ordered connection), so no ref in a value is
//!   freed in flight.
//! - **CL-3 Borrows before they are needed.** An actor that deserializes a
//!   ref sends its `Borrow` before anything that can end the life of the
//!   value the ref came from (its call's `CallDone`, its get's `GetDone`),
//!   on the same connection; while the value lives, the driver holds the
//!   ref's object (CL-2).
//! - **CL-4 A dead borrower borrows nothing.** When an actor dies, the
//!   driver gives back every count it held for it.

use std::cell::RefCell;
use std::sync::Arc;

use std::future::Future;
use std::time::Duration;

use rdt_transport::value::{self, Payload, ValueError};
use rdt_transport::Tensor;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result as RdtResult};
use crate::object_ref::{ObjectRef, RawHandle};
use crate::runtime::Inner;
use crate::worker::WorkerShared;

/// Where a ref or handle was made: the driver, or an actor's worker.
#[derive(Clone)]
pub(crate) enum Client {
    /// The driver: counts are owner-table counts.
    Driver(Arc<Inner>),
    /// An actor: counts are local, borrowed from the driver (CL-1).
    Actor(Arc<WorkerShared>),
}

impl Client {
    /// The client of the value [`decode`] is decoding on this thread;
    /// `None` outside it (a ref read by serde outside rdt).
    fn current() -> Option<Client> {
        DECODING.with(|d| d.borrow().clone())
    }

    /// A ref was cloned: one more count.
    pub(crate) fn clone_ref(&self, id: u64) {
        match self {
            Client::Driver(inner) => inner.lock().table.inc(id),
            Client::Actor(w) => w.clone_ref(id),
        }
    }

    /// A ref was dropped.
    pub(crate) fn release_ref(&self, id: u64) {
        match self {
            Client::Driver(inner) => inner.release_ref(id),
            Client::Actor(w) => w.release_ref(id),
        }
    }

    /// A ref was read out of a value (CL-3).
    fn adopt_from_wire(&self, id: u64) {
        match self {
            Client::Driver(inner) => inner.lock().table.inc(id),
            Client::Actor(w) => w.adopt_from_wire(id),
        }
    }
}

/// An untyped ref: holds one count.
pub(crate) struct AnyRef {
    pub id: u64,
    pub client: Client,
}

impl Drop for AnyRef {
    fn drop(&mut self) {
        self.client.release_ref(self.id);
    }
}

/// A value serialized with its tensors pulled out and its refs held
/// (CL-2): keep `held` until the message carrying `payload` is queued.
pub(crate) struct Encoded {
    pub payload: Payload,
    pub held: Vec<AnyRef>,
}

impl Encoded {
    /// The ids of the refs in the value, once per occurrence.
    pub fn ref_ids(&self) -> Vec<u64> {
        self.held.iter().map(|r| r.id).collect()
    }
}

thread_local! {
    /// Refs met while encoding on this thread (`None`: not encoding).
    static ENCODING: RefCell<Option<Vec<AnyRef>>> = const { RefCell::new(None) };
    /// The client of refs decoded on this thread (`None`: not decoding).
    static DECODING: RefCell<Option<Client>> = const { RefCell::new(None) };
    /// A ref refused to serialize outside rdt on this thread (postcard
    /// drops serde's messages; callers that use it read this instead).
    static REFUSED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether a ref refused to serialize on this thread since the last call
/// (and forgets it).
pub(crate) fn take_refused() -> bool {
    REFUSED.with(|r| r.replace(false))
}

/// Serializes `value` as rdt sends it: tensors pulled out
/// ([`rdt_transport::value`]), refs counted and listed (CL-2).
pub(crate) fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Encoded, ValueError> {
    let outer = ENCODING.with(|e| e.borrow_mut().replace(Vec::new()));
    let payload = value::encode(value);
    let held = ENCODING.with(|e| std::mem::replace(&mut *e.borrow_mut(), outer));
    Ok(Encoded {
        payload: payload?,
        held: held.unwrap_or_default(),
    })
}

/// Deserializes a value rdt received: tensors put back, refs and handles
/// bound to `client` (`None`: this worker's). In an actor, the borrows of
/// refs met for the first time go out in one message when decoding ends
/// (CL-3).
pub(crate) fn decode<T: DeserializeOwned + 'static>(
    client: Option<&Client>,
    data: &[u8],
    tensors: &[Tensor],
) -> Result<T, ValueError> {
    reading_refs(bound_to(client), || value::decode(data, tensors))
}

/// [`decode`] from a [`TensorList`]: a lazy one makes only the tensors the
/// value names, each once ([`value::decode_list`]).
pub(crate) fn decode_list<T: DeserializeOwned + 'static>(
    client: Option<&Client>,
    data: &[u8],
    tensors: &rdt_transport::TensorList,
) -> Result<T, ValueError> {
    reading_refs(bound_to(client), || value::decode_list(data, tensors))
}

/// The client a decoded value's refs are bound to: `client`, or this
/// worker's.
fn bound_to(client: Option<&Client>) -> Option<Client> {
    client
        .cloned()
        .or_else(|| crate::worker::shared().map(Client::Actor))
}

/// Runs `read` (a deserialization) with refs and handles bound to
/// `client`; in an actor, the borrows met go out in one message at the end
/// (CL-3). Outside such a scope, reading a ref or a handle is an error.
pub(crate) fn reading_refs<R>(client: Option<Client>, read: impl FnOnce() -> R) -> R {
    let outer = DECODING.with(|d| std::mem::replace(&mut *d.borrow_mut(), client));
    let batch = crate::worker::BorrowBatch::start();
    let v = read();
    drop(batch);
    DECODING.with(|d| *d.borrow_mut() = outer);
    v
}

/// The error of a ref serialized or deserialized outside rdt.
const OUTSIDE: &str =
    "an rdt ObjectRef or actor handle is serialized and deserialized only by rdt \
     (as a method argument, a return value or a put value, or nested in one); to save or \
     send one elsewhere, send its value (get it first)";

impl<T> Serialize for ObjectRef<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let held = ENCODING.with(|e| match e.borrow_mut().as_mut() {
            Some(refs) => {
                self.client().clone_ref(self.id);
                refs.push(AnyRef {
                    id: self.id,
                    client: self.client().clone(),
                });
                true
            }
            None => false,
        });
        if !held {
            REFUSED.with(|r| r.set(true));
            return Err(serde::ser::Error::custom(OUTSIDE));
        }
        s.serialize_u64(self.id)
    }
}

impl<'de, T> Deserialize<'de> for ObjectRef<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let id = u64::deserialize(d)?;
        let client = Client::current().ok_or_else(|| serde::de::Error::custom(OUTSIDE))?;
        client.adopt_from_wire(id);
        Ok(ObjectRef::adopt(id, client))
    }
}

/// A handle travels as the actor's id and name; it keeps nothing alive
/// (actors live until killed or shut down), so it needs no count.
impl Serialize for RawHandle {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        (self.actor, &*self.name).serialize(s)
    }
}

impl<'de> Deserialize<'de> for RawHandle {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let (actor, name) = <(u64, String)>::deserialize(d)?;
        let client = Client::current().ok_or_else(|| serde::de::Error::custom(OUTSIDE))?;
        Ok(RawHandle {
            client,
            actor,
            name: name.into(),
        })
    }
}

/// A `get` of object `id` bounded by `deadline`, for the driver's and an
/// actor's `get_timeout` alike: running out is `Error::Timeout` naming the
/// object.
pub(crate) async fn get_within<T>(
    id: u64,
    deadline: Duration,
    get: impl Future<Output = RdtResult<T>>,
) -> RdtResult<T> {
    tokio::time::timeout(deadline, get)
        .await
        .map_err(|_| Error::Timeout {
            what: format!("object {id}"),
            after_ms: deadline.as_millis() as u64,
        })?
}

/// Ray's `wait` for the driver and for actors alike: `(finished, pending)`,
/// each in the order of `refs`, once `num_returns` of them are finished
/// (`wait` of its id resolved: ready or failed) or `timeout` passed.
/// Every ref is watched at once.
pub(crate) async fn wait_many<T, W, F>(
    refs: &[ObjectRef<T>],
    num_returns: usize,
    timeout: Option<Duration>,
    wait: W,
) -> RdtResult<(Vec<ObjectRef<T>>, Vec<ObjectRef<T>>)>
where
    W: Fn(u64) -> F,
    F: Future<Output = RdtResult<()>>,
{
    use futures::StreamExt;
    if num_returns > refs.len() {
        return Err(Error::Protocol(format!(
            "wait_many asked for {num_returns} of {} refs; ask for at most {}",
            refs.len(),
            refs.len()
        )));
    }
    let mut finished = vec![false; refs.len()];
    let mut watching: futures::stream::FuturesUnordered<_> = refs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let w = wait(r.id);
            async move { (i, w.await) }
        })
        .collect();
    let mut count = 0;
    let collect = async {
        while count < num_returns {
            let Some((i, r)) = watching.next().await else {
                break;
            };
            if let Err(Error::Shutdown) = r {
                return Err(Error::Shutdown);
            }
            finished[i] = true;
            count += 1;
        }
        Ok(())
    };
    match timeout {
        None => collect.await?,
        // Past the deadline: what finished so far.
        Some(d) => {
            if let Ok(r) = tokio::time::timeout(d, collect).await {
                r?
            }
        }
    }
    drop(watching);
    let (done, pending): (Vec<_>, Vec<_>) = refs.iter().zip(finished).partition(|(_, f)| *f);
    Ok((
        done.into_iter().map(|(r, _)| r.clone()).collect(),
        pending.into_iter().map(|(r, _)| r.clone()).collect(),
    ))
}

/// Checks that `targets` fit object `id`'s tensors (`metas`): one target
/// per tensor, same dtype and shape, in order. For the driver's and an
/// actor's `get_into` alike, before any byte moves.
pub(crate) fn check_targets(
    id: u64,
    metas: &[rdt_transport::TensorMeta],
    targets: &[Tensor],
) -> RdtResult<()> {
    use rdt_transport::transport::{first_mismatch, MetaMismatch};
    let message = match first_mismatch(metas, targets) {
        None => return Ok(()),
        Some(MetaMismatch::Count) => format!(
            "the object holds {} tensors and {} targets were given",
            metas.len(),
            targets.len()
        ),
        Some(MetaMismatch::At(i)) => format!(
            "its tensor #{i} is {} {:?} and target #{i} is {} {:?}",
            metas[i].dtype,
            metas[i].shape,
            targets[i].dtype(),
            targets[i].shape()
        ),
    };
    Err(Error::Targets {
        object: id,
        message,
    })
}

/// Object `id`'s tensors (`got`, as received) in `targets`: nothing to
/// do when the receive put them there (they are the targets: in place,
/// `None`), else copied into `targets` (one copy, after
/// [`check_targets`]) and those returned. Borrowed, not taken: the stored
/// list is shared, and 10 000 tensors are 10 000 clones and drops.
pub(crate) fn into_targets(
    id: u64,
    targets: &[Tensor],
    got: &[Tensor],
) -> RdtResult<Option<Vec<Tensor>>> {
    let in_place = targets.len() == got.len()
        && targets.iter().zip(got).all(|(t, g)| {
            t.shares_storage(g)
                && t.byte_offset() == g.byte_offset()
                && t.dtype() == g.dtype()
                && t.shape() == g.shape()
        });
    if in_place {
        return Ok(None);
    }
    let metas: Vec<_> = got.iter().map(Tensor::meta).collect();
    check_targets(id, &metas, targets)?;
    for (i, (t, g)) in targets.iter().zip(got).enumerate() {
        t.copy_from(g).map_err(|e| Error::Targets {
            object: id,
            message: format!("copying its tensor #{i} into target #{i}: {e}"),
        })?;
    }
    Ok(Some(targets.to_vec()))
}
