//! Worker processes: boot, the actix host of the user's actor, the local
//! object store.
//!
//! # Invariants
//! 1. A worker is the driver's binary re-executed with the `RDT_WORKER_*`
//!    environment. It becomes a worker before `main` (a constructor emitted
//!    by `#[rdt::actor]`) or at `rdt::init()`, whichever comes first, and
//!    never returns to user code.
//! 2. Calls reach the actor as actix messages; when each runs (arguments
//!    first, then its turn, one at a time or concurrently) is `host`'s
//!    business (HO-1 … HO-5).
//! 3. The control loop never waits for a method: deliveries, sends, frees
//!    and fetches are served while a method runs.
//! 4. A method's panic is caught and becomes the call's error (HO-5).
//! 5. The worker exits when the driver's connection ends (and the kernel
//!    kills it if the driver dies first).
//! 6. **WK-6** A `Free` has taken effect before any call behind it starts: a freed
//!    value that the control loop drops on the blocking pool (large ones,
//!    so that the frames behind the `Free` are not held up) is counted
//!    in [`AsideDrops`], and a call waits for the count to reach zero
//!    before its method runs. So memory the driver freed is gone by the
//!    time a later call looks (`trim`, `wait_tensor_freed`, a slab count).
//! 7. **WK-7** A delivery's receive puts the tensors into the target tensors an
//!    actor's `get_into` registered for that object (in [`WorkerShared`]'s
//!    `targets`, before its `Get` is sent), when they fit the object's
//!    metadata; else anywhere (`get_into` then copies, or fails with
//!    `Error::Targets` and the received value stays stored). A target that
//!    does not fit never fails the receive: bad targets lose nothing.
//!    The same registered list with the same layout over the same
//!    transport as the last fit is not checked again ([`FittedTargets`]).
//! 8. **WK-8** The tensors of a large receive are made on the thread that
//!    waits to use them. A call's argument (or an actor's `get`) that
//!    waits for an object still being received registers as its first
//!    reader (`readers`); a receive that makes its tensors while its bytes
//!    move hands the list to that reader (`TransferCtx::first_reader`),
//!    which makes them on the actor's thread, where the method walks them
//!    next. With no reader registered, the receive makes them itself.
//! 9. **WK-9** A stream-ordered receive (its bytes still landing when it
//!    returns, WK-5) is acknowledged exactly once, by whoever takes it on
//!    first ([`Landed::take_ack`]): its task once the bytes landed, or a
//!    call that took the value before that. Such a call's `CallDone`
//!    settles the receive in the driver (XF-5: it got past its
//!    arguments), so no `Received` goes out, unless the call fails on the
//!    landing itself (`Dependency`): then it sends each `Received` it
//!    took on, with how that landing ended, before its `CallDone`.
//! 10. **WK-13** The consumer drops its own argument copies (OW-12). The
//!     control loop counts, per object, the calls it received that take it
//!     as a ref and have not ended (`arg_uses`), before it hands a call on.
//!     A call that ended past its arguments takes each of its `release`
//!     objects that no other counted call takes out of the store (a
//!     received copy only, never a value produced here) before it writes
//!     its `CallDone`, which names them; it drops them after the write
//!     (large ones on the blocking pool, counted for WK-6), off the path
//!     of the reply and of the next call's frames. A call counted late (its
//!     frame read after the drop) finds no copy and waits for the delivery
//!     the driver then sends again.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use actix::prelude::*;
use bytes::Bytes;
use futures::FutureExt;
use parking_lot::Mutex;
use rdt_transport::rt::hot::{self, hot};
use rdt_transport::{object_store, Peer, ReceiveStart, Sidedness, Target, Tensor, TensorList};
use tokio::net::UnixStream;
use tokio::sync::{oneshot, Notify};
use tracing::Instrument;

use crate::actor::{Actor as RdtActor, ACTOR_TYPES};

mod acks;
mod arrival;
mod boot;
mod context;
mod control;
mod copies;
mod groups;
mod handoff_queue;
mod host;
mod log;
mod metrics;
mod queues;
mod receive;
mod send;
mod shared;
mod start;
mod store;
mod straight;

use crate::error::{Error, Result};
use crate::protocol::boot::env;
pub use crate::protocol::boot::WorkerStart;
use crate::protocol::inline_value;
use crate::protocol::{self, Delivery, ToDriver, ToWorker};
use crate::transport::Transport;
pub(crate) use arrival::tensor_held;
pub use arrival::{wait_tensor_freed, wait_tensor_freed_timeout};
pub use boot::{boot_before_main, init};
pub use context::{runtime, try_runtime, ActorRuntime};
pub use groups::GroupMembership;
use host::Host;
pub use start::run_worker;
use {
    acks::*, boot::*, control::*, groups::*, handoff_queue::*, queues::*, receive::*, send::*,
    shared::*, store::*,
};

/// Binaries whose `main` is `#[rdt::main]` register here: their workers
/// boot from `main`, after Rust's own start-up.
#[doc(hidden)]
#[linkme::distributed_slice]
pub static RDT_MAIN: [u8];

#[cfg(test)]
mod tests;
