//! [`ObjectRef`], call arguments ([`Arg`]) and the call builder ([`Call`]).

use std::marker::PhantomData;
use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::error::{Error, Result};
use crate::ids::{ActorId, ObjectId};
use crate::protocol::inline_value;
use crate::protocol::WireArg;
use crate::refs::client::{AnyRef, ArgOut, SharedClient};
use crate::refs::codec;
use crate::transport::Transport;

/// A typed reference to a value that a method produced (or will produce),
/// or that was `put`. Cloning and dropping refs drive the owner table's
/// count: the object is freed once no ref anywhere and no pending call
/// needs it.
///
/// A ref is `Serialize`: pass it to a method, return it, or nest it in a
/// value (`Vec<ObjectRef<Tensor>>`). A ref held by an actor is *borrowed*
/// from the driver, which stays the owner and counts it, so the object
/// lives exactly as long as some ref to it does, wherever it is.
pub struct ObjectRef<T> {
    pub(crate) id: ObjectId,
    /// The one count this ref and its clones hold: cloning a ref is an
    /// atomic increment, not a trip through the owner table (under the
    /// driver's state lock, or an actor's count map); the count goes when
    /// the last clone does.
    pub(crate) held: Arc<AnyRef>,
    _t: PhantomData<fn() -> T>,
}

impl<T> ObjectRef<T> {
    /// Wraps an id whose count the caller already took.
    pub(crate) fn adopt(id: ObjectId, client: SharedClient) -> Self {
        ObjectRef {
            id,
            held: Arc::new(AnyRef { id, client }),
            _t: PhantomData,
        }
    }

    /// The object's id.
    pub fn id(&self) -> ObjectId {
        self.id
    }

    /// This ref as a method argument whose tensors the callee gets in
    /// `place` of its own process: host memory, or one of its GPUs
    /// (PyTorch RPC's device maps, per argument). They are copied there
    /// from where they landed, once, before the method runs; tensors in
    /// host memory stay there. A call that asks for a device its callee
    /// lacks fails with [`Error::NoSuchDevice`] before any byte moves.
    ///
    /// ```no_run
    /// # use rdt::prelude::*;
    /// # #[rdt::actor] pub struct Eval {}
    /// # #[rdt::actor] impl Eval { fn new() -> Self { Eval {} }
    /// #   #[rdt::method] fn score(&mut self, w: Tensor) -> f64 { 0.0 } }
    /// # async fn f(eval: EvalHandle, weights: ObjectRef<Tensor>) -> rdt::Result<()> {
    /// // The evaluator reads the trainer's GPU weights in host memory.
    /// let score = eval.score(weights.to_device(Place::Host)).remote();
    /// # Ok(()) }
    /// ```
    pub fn to_device(&self, place: rdt_transport::Place) -> Arg<T> {
        Arg::RefOn(self.clone(), place)
    }

    /// Where its count is held.
    pub(crate) fn client(&self) -> &SharedClient {
        &self.held.client
    }
}

impl<T> Clone for ObjectRef<T> {
    fn clone(&self) -> Self {
        ObjectRef {
            id: self.id,
            held: self.held.clone(),
            _t: PhantomData,
        }
    }
}

impl<T> std::fmt::Debug for ObjectRef<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ObjectRef<{}>({})", std::any::type_name::<T>(), self.id)
    }
}

impl<T> AsRef<ObjectRef<T>> for ObjectRef<T> {
    fn as_ref(&self) -> &ObjectRef<T> {
        self
    }
}

/// A method argument: a value, or a ref to a value of the same type
/// (produced by any actor). Built by `From`, so handle methods take
/// `impl Into<Arg<T>>`: pass `value`, `ref_` or `&ref_` (and `&str` for a
/// `String`, `&tensor` for a `Tensor`).
pub enum Arg<T> {
    /// Sent with the call (tensors through the object-store path).
    Value(T),
    /// Resolved by the framework before the method runs; tensors move over
    /// the object's transport.
    Ref(ObjectRef<T>),
    /// A ref whose tensors the callee gets in this place of its process
    /// ([`ObjectRef::to_device`]).
    RefOn(ObjectRef<T>, rdt_transport::Place),
}

impl<T> From<T> for Arg<T> {
    fn from(v: T) -> Self {
        Arg::Value(v)
    }
}

/// `&str` passes for a `String` argument.
impl From<&str> for Arg<String> {
    fn from(v: &str) -> Self {
        Arg::Value(v.to_owned())
    }
}

/// `&Tensor` passes for a `Tensor` argument (the tensor is serialized
/// with the call; its storage is shared, not copied, until then).
impl From<&rdt_transport::Tensor> for Arg<rdt_transport::Tensor> {
    fn from(t: &rdt_transport::Tensor) -> Self {
        Arg::Value(t.clone())
    }
}

impl<T> From<ObjectRef<T>> for Arg<T> {
    fn from(r: ObjectRef<T>) -> Self {
        Arg::Ref(r)
    }
}

impl<T> From<&ObjectRef<T>> for Arg<T> {
    fn from(r: &ObjectRef<T>) -> Self {
        Arg::Ref(r.clone())
    }
}

/// `&ref_` passes for an `ObjectRef<T>` argument: the callee gets a ref
/// to the same object (the caller keeps its own).
impl<T> From<&ObjectRef<T>> for Arg<ObjectRef<T>> {
    fn from(r: &ObjectRef<T>) -> Self {
        Arg::Value(r.clone())
    }
}

/// A call's arguments as they travel (values inline, refs by id), and the
/// first error that keeps the call from running; the same for calls from
/// the driver and from actors.
pub(crate) fn wire_args(args: &[ArgOut]) -> (Vec<WireArg>, Option<Error>) {
    let mut wire = Vec::with_capacity(args.len());
    let mut error: Option<Error> = None;
    for a in args {
        match a {
            ArgOut::Value(Ok(enc)) => match inline_value(enc.payload.clone(), enc.ref_ids()) {
                Ok(v) => wire.push(WireArg::Value(v)),
                Err(e) => error = error.or(Some(e)),
            },
            ArgOut::Value(Err(e)) => error = error.or(Some(e.clone())),
            ArgOut::Ref(r, None) => wire.push(WireArg::Ref(r.id)),
            ArgOut::Ref(r, Some(place)) => wire.push(WireArg::RefOn(r.id, *place)),
        }
    }
    (wire, error)
}

/// Identifies a spawned actor for calls; generated handles wrap it.
///
/// A handle is `Serialize`: pass it to a method (or nest it in a value)
/// and the actor that receives it calls the same actor with it.
#[derive(Clone)]
pub struct RawHandle {
    pub(crate) client: SharedClient,
    pub(crate) actor: u64,
    pub(crate) name: Arc<str>,
}

impl std::fmt::Debug for RawHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.name)
    }
}

impl RawHandle {
    /// The actor's id.
    pub fn id(&self) -> ActorId {
        ActorId(self.actor)
    }
    /// The actor's name (`Type#id`).
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Kills the actor's process (SIGKILL). Its pending calls and the
    /// objects it holds fail; the rest of the runtime is unaffected.
    /// Inside an actor, the driver is asked to kill it.
    pub fn kill(&self) {
        self.client.kill(self.actor)
    }
    /// Resolves once the actor's worker process has exited and been
    /// reaped, with how it ended (`"was killed by signal 9"`); use it after
    /// [`kill`](Self::kill) to know the process, and every GPU mapping it
    /// held, is gone. Errs for a worker that joined by hand (its process
    /// is not this runtime's child), inside an actor (only the driver sees
    /// its workers exit) and when the runtime shuts down first.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future loses nothing.
    pub async fn exited(&self) -> crate::Result<String> {
        let mut rx = self.client.exit_notice(self.actor, &self.name)?;
        let seen = rx
            .wait_for(|s| s.is_some())
            .await
            .map_err(|_| crate::Error::Shutdown)?;
        Ok(seen.clone().unwrap_or_default())
    }
    /// The worker process id (known to the driver; `None` inside an
    /// actor).
    pub fn pid(&self) -> Option<u32> {
        self.client.pid(self.actor)
    }
}

/// A method call being built. `remote()` submits it and returns the ref to
/// its result at once.
#[must_use = "a call does nothing until `.remote()`"]
pub struct Call<T> {
    handle: RawHandle,
    method: u32,
    method_name: &'static str,
    args: Vec<ArgOut>,
    transport: Transport,
    _t: PhantomData<fn() -> T>,
}

impl<T> Call<T> {
    #[doc(hidden)]
    pub fn new(
        handle: &RawHandle,
        method: u32,
        method_name: &'static str,
        transport: Transport,
    ) -> Self {
        Call {
            handle: handle.clone(),
            method,
            method_name,
            args: Vec::new(),
            transport,
            _t: PhantomData,
        }
    }

    #[doc(hidden)]
    pub fn push_arg<A: Serialize>(&mut self, arg: Arg<A>) {
        self.args.push(match arg {
            Arg::Value(v) => ArgOut::Value(codec::encode(&v).map_err(|e| Error::Decode {
                what: format!("an argument of {}.{}", self.handle.name, self.method_name),
                message: e.to_string(),
            })),
            Arg::Ref(r) => ArgOut::Ref(r.held, None),
            Arg::RefOn(r, place) => ArgOut::Ref(r.held, Some(place)),
        });
    }

    /// Overrides the transport of this call's returned tensors by name
    /// (Ray's `.options(tensor_transport=...)`). An unknown name is an error
    /// listing the valid ones.
    pub fn tensor_transport(self, name: &str) -> Result<Self> {
        Ok(self.transport(name.parse()?))
    }

    /// Overrides the transport of this call's returned tensors.
    pub fn transport(mut self, transport: Transport) -> Self {
        self.transport = transport;
        self
    }

    /// Submits the call. Returns at once; the result arrives in the owner
    /// table.
    pub fn remote(self) -> ObjectRef<T> {
        let client = self.handle.client.clone();
        let id = client.submit(
            self.handle.actor,
            self.method,
            self.method_name,
            self.args,
            self.transport,
        );
        ObjectRef::adopt(id, client)
    }
}

/// The error of a ref serialized or deserialized outside rdt.
const OUTSIDE: &str =
    "an rdt ObjectRef or actor handle is serialized and deserialized only by rdt \
     (as a method argument, a return value or a put value, or nested in one); to save or \
     send one elsewhere, send its value (get it first)";

impl<T> Serialize for ObjectRef<T> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let held = codec::ENCODING.with(|e| match e.borrow_mut().as_mut() {
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
            codec::REFUSED.with(|r| r.set(true));
            return Err(serde::ser::Error::custom(OUTSIDE));
        }
        s.serialize_u64(self.id)
    }
}

impl<'de, T> Deserialize<'de> for ObjectRef<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let id = u64::deserialize(d)?;
        let client = codec::decoding_client().ok_or_else(|| serde::de::Error::custom(OUTSIDE))?;
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
        let client = codec::decoding_client().ok_or_else(|| serde::de::Error::custom(OUTSIDE))?;
        Ok(RawHandle {
            client,
            actor,
            name: name.into(),
        })
    }
}
