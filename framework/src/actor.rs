//! The [`Actor`] trait (implemented by `#[rdt::actor]`) and the link-time
//! registry that lets a worker process construct an actor type by name.

use std::sync::Arc;

use bytes::Bytes;
use futures::future::LocalBoxFuture;
use rdt_transport::value::Payload;
use rdt_transport::TensorList;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result, TypedError};
use crate::refs::object_ref::RawHandle;

/// An actor type. Implemented by `#[rdt::actor]` on an `impl` block; you do
/// not implement it by hand.
pub trait Actor: Sized + 'static {
    /// The argument of the constructor (`fn new(args: Args) -> Self`).
    type Args: Serialize + DeserializeOwned + Send + 'static;
    /// The typed client handle generated for this actor.
    type Handle: From<RawHandle> + Send + 'static;
    /// Unique name of the type (its module path).
    const NAME: &'static str;

    #[doc(hidden)]
    fn __construct(args: Self::Args) -> LocalBoxFuture<'static, std::result::Result<Self, String>>;

    #[doc(hidden)]
    const __CONCURRENCY: Concurrency;

    /// Runs any method (`&mut self` or `&self`).
    #[doc(hidden)]
    fn __dispatch(&mut self, method: u32, args: CallArgs) -> LocalBoxFuture<'_, Result<Payload>>;

    /// Runs a `&self` method (the worker's schedule lets several run at
    /// once on a concurrent actor).
    #[doc(hidden)]
    fn __dispatch_shared(&self, method: u32, args: CallArgs)
        -> LocalBoxFuture<'_, Result<Payload>>;

    #[doc(hidden)]
    fn __method_info(method: u32) -> Option<MethodInfo>;
}

/// An actor's concurrency options (`#[rdt::actor(max_concurrency = N,
/// concurrency_groups(name = N, ..))]`).
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct Concurrency {
    /// How many `&self` calls of the default group may run at once.
    pub max: u32,
    /// Named groups and their limits; a method's group index is its
    /// position here plus one.
    pub groups: &'static [(&'static str, u32)],
}

/// What the worker's schedule needs to know of a method.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct MethodInfo {
    /// Its name.
    pub name: &'static str,
    /// Takes `&mut self`: runs alone.
    pub exclusive: bool,
    /// Its concurrency group (0: the default group).
    pub group: u32,
}

/// Registration of an actor type, collected at link time.
#[doc(hidden)]
pub struct ActorRegistration {
    /// [`Actor::NAME`].
    pub name: &'static str,
    /// Runs the worker for this type; never returns.
    pub run: fn(crate::protocol::boot::WorkerStart) -> !,
}

#[doc(hidden)]
#[linkme::distributed_slice]
pub static ACTOR_TYPES: [ActorRegistration];

/// The resolved arguments of one call, handed to generated dispatch code.
#[doc(hidden)]
pub struct CallArgs {
    pub(crate) actor: Arc<str>,
    pub(crate) method: &'static str,
    pub(crate) values: Vec<(Bytes, std::sync::Arc<TensorList>)>,
    /// The refs in the return value, held until its reply is queued
    /// (CL-2).
    pub(crate) held: std::rc::Rc<std::cell::RefCell<Vec<crate::refs::client::AnyRef>>>,
}

impl CallArgs {
    /// Decodes argument `i` (named `name` in the signature).
    pub fn decode<T: DeserializeOwned + 'static>(&self, i: usize, name: &str) -> Result<T> {
        let (data, tensors) = self.values.get(i).ok_or_else(|| {
            Error::Protocol(format!(
                "{}.{} got {} arguments; argument {i} ({name}) is missing",
                self.actor,
                self.method,
                self.values.len()
            ))
        })?;
        crate::refs::codec::decode_list(None, data, tensors).map_err(|e| Error::Decode {
            what: format!(
                "argument {name} of {}.{} as {}",
                self.actor,
                self.method,
                std::any::type_name::<T>()
            ),
            message: e.to_string(),
        })
    }

    /// Checks the argument count.
    pub fn expect_len(&self, n: usize) -> Result<()> {
        if self.values.len() != n {
            return Err(Error::Protocol(format!(
                "{}.{} takes {n} arguments but the call carried {}",
                self.actor,
                self.method,
                self.values.len()
            )));
        }
        Ok(())
    }

    /// The error for a method that returned `Err(e)`; `typed` is `e`
    /// encoded when its type is `Serialize` (see [`AppError`]).
    pub fn app_error(&self, e: &dyn std::fmt::Display, typed: Option<TypedError>) -> Error {
        Error::Application {
            actor: self.actor.to_string(),
            method: self.method.to_string(),
            message: e.to_string(),
            typed,
        }
    }
}

/// A method's `Err(e)`, on its way to [`Error::Application`]: generated
/// code calls `(&AppError(&e)).typed()`, which encodes `e` when `E` is
/// `Serialize` ([`TypedViaSerialize`]) and gives `None` otherwise
/// ([`TypedViaNothing`], found one auto-reference later), so a method may
/// return any `Display` error.
#[doc(hidden)]
pub struct AppError<'a, E>(pub &'a E);

#[doc(hidden)]
pub trait TypedViaSerialize {
    fn typed(&self) -> Option<TypedError>;
}

impl<E: Serialize> TypedViaSerialize for AppError<'_, E> {
    fn typed(&self) -> Option<TypedError> {
        TypedError::encode(self.0)
    }
}

#[doc(hidden)]
pub trait TypedViaNothing {
    fn typed(&self) -> Option<TypedError> {
        None
    }
}

impl<E> TypedViaNothing for &AppError<'_, E> {}

/// Encodes a method's return value (generated code calls this).
#[doc(hidden)]
pub fn encode_return<T: Serialize>(v: &T, args: &CallArgs) -> Result<Payload> {
    let encoded = crate::refs::codec::encode(v).map_err(|e| Error::Decode {
        what: format!("the return value of {}.{}", args.actor, args.method),
        message: e.to_string(),
    })?;
    args.held.borrow_mut().extend(encoded.held);
    Ok(encoded.payload)
}

/// Placeholder so that an unused `Deserialize` import in generated code
/// never warns.
#[doc(hidden)]
pub fn __assert_args<T: for<'de> Deserialize<'de>>() {}
