//! The driver: [`Runtime`], worker processes, the control connections.
//!
//! # Invariants
//! 1. Every worker is spawned from a *reaper thread* that lives exactly as
//!    long as the worker and waits for its exit. The worker asks the kernel
//!    for SIGKILL when that thread (hence the driver) dies
//!    (`PR_SET_PDEATHSIG`), and it exits when its control connection closes:
//!    workers never outlive the driver, whether it returns, panics or is
//!    killed.
//! 2. The driver-side state (owner table, actors, pending calls) sits behind
//!    one mutex that is never held across an `.await`; sends under it only
//!    queue frames, in the order decided under it, and the socket writes
//!    happen once it is released (`Inner::lock`, `protocol::Deferred`):
//!    no thread waits on it for a system call.
//! 3. A worker's death (connection end) fails its pending calls, its spawn,
//!    its fetches and its objects at once (see `owner` invariant 4).
//! 4. Background tasks hold the runtime weakly, so dropping the last
//!    `Runtime` and `ObjectRef` kills the workers (`ChildGuard`).

use std::borrow::Borrow;
use std::collections::HashMap;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::protocol::inline_value;
use parking_lot::Mutex;
use rdt_transport::object_store;
use rdt_transport::rt::hot::{self, hot};
use rdt_transport::{Blob, DeviceMap, Place, Target};
use serde::de::DeserializeOwned;
use serde::Serialize;
use tokio::net::UnixListener;
use tokio::sync::{oneshot, watch};

use crate::actor::Actor;
use crate::error::{Error, Result};
use crate::ids::{ActorId, GroupId};
use crate::owner::{actor_name, ActorInfo, Actors, GroupLookup, ObjState, OwnerTable};
use crate::protocol::boot::{env as wenv, DEFAULT_MAX_FRAME};
use crate::protocol::{
    self, CallContext, CallMsg, SubmitMsg, ToDriver, ToWorker, WireArg, WireExported, WireValue,
};
use crate::refs::client::ArgOut;
use crate::refs::client::{Client, SharedClient};
use crate::refs::object_ref::{ObjectRef, RawHandle};
use crate::transport::Transport;

mod builder;
mod calls;
mod config;
mod conn;
mod death;
mod dispatch;
mod get;
mod gpu;
mod groups;
mod listen;
mod metrics;
mod put;
mod reader;
mod reaper;
mod spawn;
mod state;
mod transfers;

pub use builder::RuntimeBuilder;
use calls::*;
use config::*;
use conn::*;
use dispatch::*;
use gpu::*;
use groups::*;
use listen::*;
use reader::*;
use reaper::*;
pub use spawn::Spawn;
pub use state::Runtime;
use state::*;
use transfers::*;
