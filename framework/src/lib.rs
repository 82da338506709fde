//! # rdt: direct tensor transport between Rust actors
//!
//! Actors live in their own worker processes, hosted on actix. Calls return
//! [`ObjectRef`]s at once; a ref passed to another actor's method arrives
//! as the value, its tensors moved by the transport the producing method
//! named with `#[rdt::method(tensor_transport = "...")]` — device to device
//! where the transport allows, through the driver (`object_store`) otherwise.
//! The driver's owner table counts refs and frees objects when nothing needs
//! them.
//!
//! ```no_run
#![doc = include_str!("../../examples/doc_counter.rs")]
//! ```
#![deny(missing_docs)]
#![deny(clippy::undocumented_unsafe_blocks)]

mod actor;
mod deadlines;
mod driver;
mod env;
mod error;
mod ids;
mod log;
pub mod metrics;
mod owner;
mod process;
mod protocol;
mod refs;
pub mod timeline;
mod transport;
pub mod weights;
mod worker;

pub use actor::Actor;
pub use driver::{Runtime, RuntimeBuilder, Spawn};
pub use error::{Error, Result, TransportError, TypedError, DEPENDENCY_VIA};
pub use ids::{ActorId, GroupId, ObjectId};
pub use log::WorkerLog;
pub use rdt_macros::{actor, main, method};
pub use rdt_transport::register_transport;
pub use rdt_transport::{
    DType, Device, DeviceMap, Element, GpuUuid, Place, Tensor, TensorError, TensorMeta,
};
pub use refs::object_ref::{Arg, Call, ObjectRef, RawHandle};
pub use refs::targets::Targets;
pub use transport::Transport;
pub use worker::{
    init, runtime, try_runtime, wait_tensor_freed, wait_tensor_freed_timeout, ActorRuntime,
    GroupMembership,
};

/// The data-plane crate: tensors, the transport trait, value extraction.
pub use rdt_transport as data;

/// What most programs need.
pub mod prelude {
    pub use crate::{actor, method, Arg, Error, ObjectRef, Result, Runtime, Tensor, Transport};
    pub use crate::{DType, Device, Place};
}

/// Entry points for the fuzz targets (`fuzz/`); not a public API.
#[doc(hidden)]
pub mod __fuzz {
    /// Decodes `bytes` as a control frame body in both directions. Must
    /// never panic, whatever the bytes.
    pub fn decode_control_frame(bytes: &[u8]) {
        let b = bytes::Bytes::copy_from_slice(bytes);
        let _ = rdt_transport::wire::from_frame::<crate::protocol::ToWorker>(b.clone());
        let _ = rdt_transport::wire::from_frame::<crate::protocol::ToDriver>(b);
    }
}

/// For the benchmark harness (`examples/bench.rs`): its raw baselines
/// set up their sockets as rdt's own; not a public API.
#[doc(hidden)]
pub mod __bench {
    pub use crate::protocol::size_socket_buffers;
}

/// Used by generated code; not a public API.
#[doc(hidden)]
pub mod __private {
    pub use crate::actor::{
        encode_return, ActorRegistration, AppError, CallArgs, Concurrency, MethodInfo,
        TypedViaNothing, TypedViaSerialize, ACTOR_TYPES,
    };
    pub use crate::refs::object_ref::{Call, RawHandle};
    pub use crate::worker::{boot_before_main, run_worker, RDT_MAIN};
    #[cfg(feature = "failpoints")]
    pub use fail;
    pub use futures::future::LocalBoxFuture;
    pub use futures::FutureExt;
    pub use linkme;
    pub use rdt_transport::value::Payload;
    pub use serde;
    pub use tokio;

    /// Emits a pre-`main` hook that turns the process into a worker when the
    /// driver started it as one (so test binaries, whose `main` libtest
    /// owns, work too). Written with `link_section` in this crate's edition.
    #[macro_export]
    #[doc(hidden)]
    macro_rules! __worker_bootstrap {
        () => {
            const _: () = {
                #[used]
                #[cfg_attr(target_os = "linux", link_section = ".init_array")]
                static __RDT_WORKER_BOOT: extern "C" fn() = {
                    extern "C" fn __rdt_worker_boot() {
                        $crate::__private::boot_before_main();
                    }
                    __rdt_worker_boot
                };
            };
        };
    }
    pub use crate::__worker_bootstrap as worker_bootstrap;
}
