//! The error type of rdt. Every variant says what happened and, where the
//! caller can do something about it, what to do.

use serde::{Deserialize, Serialize};

pub use rdt_transport::TransportError;

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in rdt. Errors cross process boundaries, so
/// they are plain data (`Clone + Serialize`).
///
/// New variants may come in later versions (`#[non_exhaustive]`): a
/// `match` on it needs a wildcard arm.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum Error {
    /// A method returned `Err`.
    #[error("{actor}.{method} returned an error: {message}")]
    Application {
        /// The actor.
        actor: String,
        /// The method.
        method: String,
        /// The error's `Display`.
        message: String,
        /// The error itself, when its type is `Serialize`: read it back
        /// with [`Error::application_error`].
        typed: Option<TypedError>,
    },
    /// A method panicked. The actor keeps running with the state it had.
    #[error("{actor}.{method} panicked: {message}")]
    Panic {
        /// The actor.
        actor: String,
        /// The method.
        method: String,
        /// The panic payload, if it was a string.
        message: String,
    },
    /// A call did not run because one of its arguments is an error.
    ///
    /// Flat however long the chain of failed calls behind it (ER-1):
    /// `cause` is the original error, never another `Dependency`; `hops`
    /// counts the failed objects from `object` back to it, and `via`
    /// names the nearest of them. Make one with [`Error::dependency`].
    #[error(
        "argument object {object} is an error, so the call did not run; original error{}: {cause}",
        if *hops > 1 { format!(" ({hops} failed calls back)") } else { String::new() }
    )]
    Dependency {
        /// The failed object.
        object: u64,
        /// The failed objects between `object` and the original error,
        /// nearest first: at most [`DEPENDENCY_VIA`] of them.
        via: Vec<u64>,
        /// How many failed objects lead to the original error, `object`
        /// included (1: `object` itself failed with `cause`).
        hops: u64,
        /// The original error.
        #[serde(deserialize_with = "root_cause_only")]
        cause: Box<Error>,
    },
    /// The `get_into` waiting for this receive into its target tensors
    /// was dropped (a caller's timeout) while the receive wrote into them
    /// as its bytes came: the receive was aborted, so nothing lands in the
    /// targets after the drop. The object stays readable.
    #[error("the receive of object {object} into target tensors was aborted: the get_into waiting for it was dropped")]
    Cancelled {
        /// The object.
        object: u64,
    },
    /// An actor's process died (or its connection broke).
    #[error("actor {actor} died: {detail}; calls to it and objects it held fail from now on (spawn a new actor to continue)")]
    ActorDied {
        /// The actor.
        actor: String,
        /// Exit status or how the connection ended.
        detail: String,
    },
    /// A transport failed to move tensors.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A transport name that rdt does not know.
    #[error("unknown tensor transport {name:?}; valid names are: {valid}")]
    UnknownTransport {
        /// The name given.
        name: String,
        /// The valid names.
        valid: String,
    },
    /// A known transport that this build or machine cannot provide.
    #[error("tensor transport {name:?} is not available: {reason}")]
    TransportUnavailable {
        /// The transport.
        name: String,
        /// Why, and what to use instead.
        reason: String,
    },
    /// `get` from the driver of an object on a collective transport.
    #[error("object {object} lives on the collective transport {transport:?}, and the driver is in no collective group; fetch it with `Runtime::get_via_object_store` (the object-store path) or pass the ref to an actor in the group")]
    CollectiveGet {
        /// The object.
        object: u64,
        /// Its transport.
        transport: String,
    },
    /// A ref on a collective transport was passed to an actor that shares
    /// no live group of that backend with the producer.
    #[error("object {object} lives on the collective transport {transport:?}, and {consumer} shares no {transport} collective group with its producer {producer}; create one first with `Runtime::create_collective_group(&[producer.id(), consumer.id()], {backend})`, or use a one-sided transport")]
    NotInGroup {
        /// The object.
        object: u64,
        /// Its transport.
        transport: String,
        /// How the program names the backend in Rust (`Transport::Tcp`).
        backend: String,
        /// The producing actor.
        producer: String,
        /// The consuming actor.
        consumer: String,
    },
    /// The collective group was torn down after a failed transfer.
    #[error("collective group {group} ({transport}) was torn down after a failed transfer ({reason}); destroy it and create it again to keep using {transport} between its actors")]
    GroupBroken {
        /// The group.
        group: u64,
        /// Its backend.
        transport: String,
        /// The failure.
        reason: String,
    },
    /// A collective-group operation was given bad input.
    #[error("collective group: {0}")]
    Group(String),
    /// A wait ran past its deadline.
    #[error("timed out after {after_ms} ms waiting for {what}")]
    Timeout {
        /// What was awaited.
        what: String,
        /// The deadline.
        after_ms: u64,
    },
    /// A value, argument or message did not decode.
    #[error("{what} does not decode: {message}")]
    Decode {
        /// What was decoded.
        what: String,
        /// serde's message.
        message: String,
    },
    /// The object was freed (its last ref was dropped) before it was used.
    #[error("object {object} was freed (every ObjectRef to it was dropped); keep a ref alive while you need the value")]
    Freed {
        /// The object.
        object: u64,
    },
    /// The peer broke the control protocol.
    #[error("control protocol violated: {0}")]
    Protocol(String),
    /// An I/O error on the control plane.
    #[error("I/O error: {0}")]
    Io(String),
    /// A worker process could not be started or did not join.
    #[error("could not start a worker: {0}")]
    Spawn(String),
    /// A tensor operation failed.
    #[error("tensor: {0}")]
    Tensor(String),
    /// The runtime was shut down.
    #[error("the runtime is shut down")]
    Shutdown,
    /// A method that runs alone waited for a call its own actor had not
    /// run yet.
    #[error("{actor} waited, inside a method that runs alone (every method of an actor without max_concurrency, and &mut self methods), for object {object}: the result of a call to {actor} itself, which starts only after this method returns, so the wait would never end; return the ref instead of waiting for it, or make the method &self on an actor with max_concurrency > 1")]
    WouldDeadlock {
        /// The actor.
        actor: String,
        /// The object waited for.
        object: u64,
    },
    /// The target tensors given to `get_into` do not fit the object. The
    /// object is untouched: a `get` or a `get_into` with fitting targets
    /// still reads it.
    #[error("the target tensors given for object {object} do not fit it: {message}; give one target per tensor of the value, each of the same dtype and shape: by key (`Targets::from(&map)`, `Targets::from_value(&value)`), or, for a value that holds no map, in the order the value holds them (a tensor held twice counts once)")]
    Targets {
        /// The object.
        object: u64,
        /// What does not fit.
        message: String,
    },
    /// A weight-sync version that is not newer than the one held.
    #[error("weight version {version} is not newer than version {current}, which is live here; versions only increase (publish with a greater number, or drop the stale one)")]
    StaleVersion {
        /// The version refused.
        version: u64,
        /// The version held.
        current: u64,
    },
    /// A weight sync's two sides disagree on the parameters' layout.
    #[error("the parameters' layouts differ: {difference}; build both sides' ParamSet from the same weights::Layout (names, dtypes and shapes)")]
    LayoutMismatch {
        /// The first difference, in the layout's sorted order.
        difference: String,
    },
    /// Tensors were asked to land on a device the receiving process does
    /// not have ([`Place`](crate::Place)). Refused before any byte moved:
    /// the object is untouched.
    #[error("{receiver} cannot receive onto the device asked for: {reason}; ask for Place::Host or a CUDA ordinal it sees (nothing was moved, the object is still readable)")]
    NoSuchDevice {
        /// Who would have received (`driver`, or an actor's name).
        receiver: String,
        /// What it lacks.
        reason: String,
    },
}

/// The most failed objects a dependency error names on its way back to
/// the original error ([`Error::Dependency`]'s `via`).
pub const DEPENDENCY_VIA: usize = 8;

/// ER-1 on the wire: the cause of a dependency error is an original error,
/// so a frame that nests them (which rdt never sends) is refused at the
/// first level instead of being decoded one stack frame per level.
fn root_cause_only<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Box<Error>, D::Error> {
    thread_local! {
        static IN_CAUSE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    if IN_CAUSE.with(|c| c.replace(true)) {
        return Err(serde::de::Error::custom(
            "a dependency error nested in another's cause",
        ));
    }
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            IN_CAUSE.with(|c| c.set(false));
        }
    }
    let _reset = Reset;
    let cause = Error::deserialize(d)?;
    if matches!(cause, Error::Dependency { .. }) {
        return Err(serde::de::Error::custom(
            "a dependency error nested in another's cause",
        ));
    }
    Ok(Box::new(cause))
}

impl From<std::io::Error> for Error {
    fn from(e: std::io::Error) -> Self {
        Error::Io(e.to_string())
    }
}

impl From<rdt_transport::TensorError> for Error {
    fn from(e: rdt_transport::TensorError) -> Self {
        Error::Tensor(e.to_string())
    }
}

impl From<rdt_transport::cuda::CudaError> for Error {
    fn from(e: rdt_transport::cuda::CudaError) -> Self {
        Error::Tensor(e.to_string())
    }
}

/// The error value a method returned (`Err(e)` of a `Result<T, E>` whose
/// `E` is `Serialize`), as it crossed the process boundary. Read it with
/// [`Error::application_error`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TypedError {
    /// `std::any::type_name` of `E` in the worker.
    pub type_name: String,
    /// `E` in postcard.
    pub bytes: Vec<u8>,
}

impl TypedError {
    /// Encodes `e`; `None` if it does not serialize.
    pub fn encode<E: Serialize>(e: &E) -> Option<TypedError> {
        Some(TypedError {
            type_name: std::any::type_name::<E>().to_string(),
            bytes: postcard::to_allocvec(e).ok()?,
        })
    }
}

impl Error {
    /// The typed error a method returned, if this error is one (or is
    /// caused by one: dependency errors are looked through) and it was of
    /// type `E`. A method `fn f(&self) -> Result<T, MyError>` with
    /// `MyError: Serialize + DeserializeOwned` gives the caller back the
    /// `MyError`:
    ///
    /// ```
    /// # use rdt::Error;
    /// # #[derive(serde::Serialize, serde::Deserialize, Debug, PartialEq)]
    /// # enum MyError { OutOfMemory { needed: u64 } }
    /// # fn handle(e: Error) {
    /// match e.application_error::<MyError>() {
    ///     Some(MyError::OutOfMemory { needed }) => println!("needs {needed} bytes"),
    ///     None => println!("some other error: {e}"),
    /// }
    /// # }
    /// ```
    ///
    /// `None` for other errors, for errors whose type is not
    /// `Serialize` (their `Display` is in `message`), and for a different
    /// `E` than the method's.
    ///
    /// An actor that passes on, with `?`, the error of a call it made
    /// itself (`rdt::Result`) keeps the original cause: it is looked
    /// through too.
    pub fn application_error<E: serde::de::DeserializeOwned>(&self) -> Option<E> {
        match self.root_cause() {
            Error::Application { typed: Some(t), .. }
                if t.type_name == std::any::type_name::<E>() =>
            {
                postcard::from_bytes(&t.bytes).ok()
            }
            Error::Application { typed: Some(t), .. }
                if t.type_name == std::any::type_name::<Error>() =>
            {
                postcard::from_bytes::<Error>(&t.bytes)
                    .ok()?
                    .application_error()
            }
            _ => None,
        }
    }

    /// The innermost error: the original cause behind dependency errors.
    pub fn root_cause(&self) -> &Error {
        match self {
            Error::Dependency { cause, .. } => cause,
            other => other,
        }
    }

    /// The error of a call whose argument `object` failed with `cause`
    /// (ER-1): flat, whatever `cause` is. A `cause` that is itself a
    /// dependency error gives its original error and one hop more, so a
    /// chain of thousands of failed calls is one level deep, not one per
    /// call.
    pub fn dependency(object: u64, cause: Error) -> Error {
        match cause {
            Error::Dependency {
                object: nearer,
                mut via,
                hops,
                cause,
            } => {
                via.insert(0, nearer);
                via.truncate(DEPENDENCY_VIA);
                Error::Dependency {
                    object,
                    via,
                    hops: hops.saturating_add(1),
                    cause,
                }
            }
            root => Error::Dependency {
                object,
                via: Vec::new(),
                hops: 1,
                cause: Box::new(root),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn app() -> Error {
        Error::Application {
            actor: "A".into(),
            method: "m".into(),
            message: "failed".into(),
            typed: None,
        }
    }

    /// ER-1: one level deep, however many hops.
    #[test]
    fn er_1_a_dependency_of_a_dependency_is_flat() {
        let mut e = app();
        for object in 0..10_000 {
            e = Error::dependency(object, e);
        }
        match &e {
            Error::Dependency {
                object,
                via,
                hops,
                cause,
            } => {
                assert_eq!((*object, *hops), (9_999, 10_000));
                assert_eq!(
                    via,
                    &[9_998, 9_997, 9_996, 9_995, 9_994, 9_993, 9_992, 9_991]
                );
                assert_eq!(**cause, app());
            }
            other => panic!("{other}"),
        }
        assert!(e.to_string().contains("(10000 failed calls back)"), "{e}");
        let back: Error = postcard::from_bytes(&postcard::to_stdvec(&e).unwrap()).unwrap();
        assert_eq!(back, e);
    }

    /// ER-1 on the wire: a frame that nests dependency errors (a peer's
    /// bug, or a stranger's) is refused at the first level, not decoded
    /// one stack frame per level.
    #[test]
    fn er_1_a_nested_dependency_on_the_wire_is_refused() {
        let mut e = app();
        for object in 0..500 {
            e = Error::Dependency {
                object,
                via: Vec::new(),
                hops: 1,
                cause: Box::new(e),
            };
        }
        let bytes = postcard::to_stdvec(&e).unwrap();
        let err = postcard::from_bytes::<Error>(&bytes).unwrap_err();
        assert!(matches!(err, postcard::Error::SerdeDeCustom), "{err}");
        // Two levels are refused as well.
        let two = Error::Dependency {
            object: 1,
            via: Vec::new(),
            hops: 1,
            cause: Box::new(Error::dependency(0, app())),
        };
        let bytes = postcard::to_stdvec(&two).unwrap();
        assert!(postcard::from_bytes::<Error>(&bytes).is_err());
        // One level is an error rdt sends.
        let one = Error::dependency(0, app());
        let bytes = postcard::to_stdvec(&one).unwrap();
        assert_eq!(postcard::from_bytes::<Error>(&bytes).unwrap(), one);
    }
}
