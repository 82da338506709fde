//! The one client API: `get`, `get_into`, `load_into`, `get_timeout`,
//! `get_all`, `wait`, `wait_many`, `put` and `put_with`, written once for
//! the driver (`Runtime`) and for an actor (`ActorRuntime`) over the few
//! things each does its own way ([`Objects`]): how it reads an object, how
//! it receives one into targets, how it waits for one, and where a put
//! value goes.

use std::borrow::Borrow;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use rdt_transport::{Place, Tensor, TensorList};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::error::{Error, Result};
use crate::refs::client::{Encoded, SharedClient};
use crate::refs::object_ref::ObjectRef;
use crate::refs::targets::Targets;
use crate::transport::Transport;

/// The tensors of a value read here, as the role holds them.
pub(crate) enum ReadTensors {
    /// Made by the read (the driver's).
    Made(Vec<Tensor>),
    /// A stored list, shared (an actor's; a lazy one makes each tensor
    /// when the decode wants it).
    Stored(Arc<TensorList>),
}

/// A value read here: its data and its tensors.
pub(crate) struct Read {
    pub data: Bytes,
    pub tensors: ReadTensors,
}

/// What the driver and an actor each do their own way.
pub(crate) trait Objects: Sync {
    /// The client the refs in a decoded value bind to (`None`: this
    /// worker's).
    fn client(&self) -> Option<SharedClient>;

    /// Object `id`, read here once it settled: its value, or its error.
    fn read(&self, id: u64) -> impl Future<Output = Result<Read>>;

    /// Object `id` received into `targets` (TG-1..4): the value read, and
    /// the targets as its tensors where they were copied in (`None`: the
    /// receive wrote into them itself).
    fn read_into<T: Serialize + DeserializeOwned + 'static>(
        &self,
        id: u64,
        targets: &Targets,
    ) -> impl Future<Output = Result<(Read, Option<Vec<Tensor>>)>>;

    /// Who receives here, as [`Error::NoSuchDevice`] names it.
    fn receiver(&self) -> String;

    /// Object `id`, read here with its tensors put in `place` (checked
    /// first: a place this process lacks fails before any byte moves).
    /// By default a read, then a copy of each tensor not there already;
    /// the driver lands them there directly where its transport can.
    fn read_on(&self, id: u64, place: Place) -> impl Future<Output = Result<Read>> {
        async move {
            check_place(self, place)?;
            let read = self.read(id).await?;
            placed(read, place)
        }
    }

    /// Waits until object `id` settled, moving nothing.
    fn settled(&self, id: u64) -> impl Future<Output = Result<()>>;

    /// Refuses a `wait` for object `id` that could never end here (an
    /// actor's HO-6); the driver's waits always can.
    fn check_wait(&self, _id: u64) -> impl Future<Output = Result<()>> {
        async { Ok(()) }
    }

    /// Refuses a `wait_many` for `ids` that could never end here (an
    /// actor's HO-6).
    fn check_wait_many(
        &self,
        _ids: &[u64],
        _num_returns: usize,
        _timeout: Option<Duration>,
    ) -> Result<()> {
        Ok(())
    }

    /// Puts a value through the object store.
    fn put_inline<T>(&self, encoded: Encoded) -> Result<ObjectRef<T>>;

    /// Puts a value with its tensors over `transport` (not the object
    /// store).
    fn put_direct<T: Serialize>(
        &self,
        value: &T,
        transport: Transport,
    ) -> impl Future<Output = Result<ObjectRef<T>>>;
}

/// Decodes a value read here, refs bound to `c`'s client. Never called
/// under the driver's state lock (a ref read takes it).
pub(crate) fn decode<C: Objects, T: DeserializeOwned + 'static>(
    c: &C,
    id: u64,
    read: &Read,
) -> Result<T> {
    let client = c.client();
    let data = &read.data;
    match &read.tensors {
        ReadTensors::Made(t) => crate::refs::codec::decode(client.as_ref(), data, t),
        ReadTensors::Stored(l) => crate::refs::codec::decode_list(client.as_ref(), data, l),
    }
    .map_err(|e| Error::Decode {
        what: format!("object {id} as {}", std::any::type_name::<T>()),
        message: e.to_string(),
    })
}

pub(crate) async fn get<C: Objects, T: DeserializeOwned + 'static>(
    c: &C,
    r: impl Borrow<ObjectRef<T>>,
) -> Result<T> {
    let id = r.borrow().id;
    let read = c.read(id).await?;
    decode(c, id, &read)
}

pub(crate) async fn get_on<C: Objects, T: DeserializeOwned + 'static>(
    c: &C,
    r: impl Borrow<ObjectRef<T>>,
    place: Place,
) -> Result<T> {
    let id = r.borrow().id;
    let read = c.read_on(id, place).await?;
    decode(c, id, &read)
}

/// Refuses a `place` this process cannot put tensors in.
pub(crate) fn check_place<C: Objects + ?Sized>(c: &C, place: Place) -> Result<()> {
    place.usable_here().map_err(|reason| Error::NoSuchDevice {
        receiver: c.receiver(),
        reason,
    })
}

/// `read` with every tensor put in `place` (a copy of each one that is
/// not there already).
pub(crate) fn placed(read: Read, place: Place) -> Result<Read> {
    let tensors = match read.tensors {
        ReadTensors::Made(t) => t,
        ReadTensors::Stored(l) => l.to_vec(),
    };
    let tensors = place
        .put_all(tensors)
        .map_err(|e| Error::Tensor(format!("putting a received tensor in {place}: {e}")))?;
    Ok(Read {
        data: read.data,
        tensors: ReadTensors::Made(tensors),
    })
}

pub(crate) async fn get_into<C: Objects, T: Serialize + DeserializeOwned + 'static>(
    c: &C,
    r: impl Borrow<ObjectRef<T>>,
    targets: impl Into<Targets>,
) -> Result<T> {
    let id = r.borrow().id;
    let targets: Targets = targets.into();
    let (read, copied) = c.read_into::<T>(id, &targets).await?;
    match copied {
        Some(t) => decode(
            c,
            id,
            &Read {
                data: read.data,
                tensors: ReadTensors::Made(t),
            },
        ),
        None => decode(c, id, &read),
    }
}

pub(crate) async fn load_into<C: Objects, T: Serialize + DeserializeOwned + 'static>(
    c: &C,
    r: impl Borrow<ObjectRef<T>>,
    targets: impl Into<Targets>,
) -> Result<()> {
    let targets: Targets = targets.into();
    c.read_into::<T>(r.borrow().id, &targets).await.map(drop)
}

pub(crate) async fn get_timeout<C: Objects, T: DeserializeOwned + 'static>(
    c: &C,
    r: impl Borrow<ObjectRef<T>>,
    deadline: Duration,
) -> Result<T> {
    let id = r.borrow().id;
    crate::refs::wait::get_within(id, deadline, get(c, r)).await
}

pub(crate) async fn get_all<C: Objects, T: DeserializeOwned + 'static>(
    c: &C,
    refs: &[ObjectRef<T>],
) -> Result<Vec<T>> {
    futures::future::try_join_all(refs.iter().map(|r| get(c, r))).await
}

pub(crate) async fn wait<C: Objects, T>(c: &C, r: impl Borrow<ObjectRef<T>>) -> Result<()> {
    let id = r.borrow().id;
    c.check_wait(id).await?;
    c.settled(id).await
}

pub(crate) async fn wait_many<C: Objects, T>(
    c: &C,
    refs: &[ObjectRef<T>],
    num_returns: usize,
    timeout: Option<Duration>,
) -> Result<(Vec<ObjectRef<T>>, Vec<ObjectRef<T>>)> {
    let ids: Vec<u64> = refs.iter().map(|r| r.id).collect();
    c.check_wait_many(&ids, num_returns, timeout)?;
    crate::refs::wait::wait_many(refs, num_returns, timeout, |id| c.settled(id)).await
}

pub(crate) fn put<C: Objects, T: Serialize>(c: &C, value: &T) -> Result<ObjectRef<T>> {
    c.put_inline(encode(value, "put")?)
}

pub(crate) async fn put_with<C: Objects, T: Serialize>(
    c: &C,
    value: &T,
    transport: Transport,
) -> Result<ObjectRef<T>> {
    if transport == Transport::ObjectStore {
        return put(c, value);
    }
    c.put_direct(value, transport).await
}

/// Serializes the value given to `what` (CL-2: its refs held).
pub(crate) fn encode<T: Serialize>(value: &T, what: &str) -> Result<Encoded> {
    crate::refs::codec::encode(value).map_err(|e| Error::Decode {
        what: format!("the value given to {what}"),
        message: e.to_string(),
    })
}
