//! The process side of a runtime: who counts the refs made in this process
//! and through whom its calls go ([`Client`]). In the driver that is the owner table
//! itself; in an actor it is the driver, over the worker's control link
//! (DESIGN §3, "Actors are clients too"). Both implement one crate-private
//! trait, so refs, handles and calls never ask which of the two they are in.
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

use std::sync::{Arc, OnceLock};

use rdt_transport::value::Payload;
use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::ids::ObjectId;
use crate::transport::Transport;

/// Where a ref or handle was made, and through whom its counts and calls
/// go: the driver (counts are owner-table counts) or an actor's worker
/// (counts are local, borrowed from the driver: CL-1).
///
/// Sealed: the trait is crate-private, so only the driver's `Inner` and
/// the worker's `WorkerShared` implement it.
pub(crate) trait Client: Send + Sync {
    /// A ref was cloned: one more count.
    fn clone_ref(&self, id: ObjectId);
    /// A ref was dropped.
    fn release_ref(&self, id: ObjectId);
    /// A ref was read out of a value (CL-3).
    fn adopt_from_wire(&self, id: ObjectId);
    /// Submits a call of `method` on `actor`; the id of its result, whose
    /// count the caller now holds.
    fn submit(
        &self,
        actor: u64,
        method: u32,
        method_name: &'static str,
        args: Vec<ArgOut>,
        transport: Transport,
    ) -> ObjectId;
    /// Kills `actor`'s process, or asks the driver to.
    fn kill(&self, actor: u64);
    /// `actor`'s worker process id, where this process knows it.
    fn pid(&self, actor: u64) -> Option<u32>;
    /// Watches the exit of `actor` (`name` for errors): `Some(how it
    /// ended)` once its process was reaped.
    fn exit_notice(&self, actor: u64, name: &str) -> Result<watch::Receiver<Option<String>>>;
    /// A decode begins on this thread; `true` if this call began the
    /// outermost one (CL-3: an actor batches the borrows it meets).
    fn decode_begins(&self) -> bool {
        false
    }
    /// The outermost decode that [`decode_begins`](Self::decode_begins)
    /// began ended: an actor sends the borrows it met, in one message.
    fn decode_ends(&self) {}
}

/// A client as refs and handles hold it.
pub(crate) type SharedClient = Arc<dyn Client>;

/// This process's client when it is an actor's worker: set once at the
/// worker's boot; values decoded with no client named bind to it.
static THIS_PROCESS: OnceLock<SharedClient> = OnceLock::new();

/// Makes `client` the one values decoded in this process bind to (the
/// worker, at boot).
pub(crate) fn set_this_process(client: SharedClient) {
    let _ = THIS_PROCESS.set(client);
}

/// This process's client, if it is a worker.
pub(crate) fn this_process() -> Option<SharedClient> {
    THIS_PROCESS.get().cloned()
}

/// An untyped ref: holds one count.
pub(crate) struct AnyRef {
    pub id: ObjectId,
    pub client: SharedClient,
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

/// A call's argument as submitted: a value encoded, or a ref.
pub(crate) enum ArgOut {
    /// A value, or why it could not be encoded (the call then fails).
    Value(std::result::Result<Encoded, Error>),
    /// The ref's count, shared with the caller's ref: held until the call
    /// was submitted (its `need` counted), and where its tensors are put
    /// in the callee (`ObjectRef::to_device`).
    Ref(Arc<AnyRef>, Option<rdt_transport::Place>),
}
