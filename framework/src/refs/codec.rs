//! How values with refs in them serialize (CL-2, CL-3): encoding takes a
//! count on every ref met; decoding binds refs and handles to a client and,
//! in an actor, batches the borrows it meets.

use std::cell::RefCell;

use rdt_transport::value::{self, ValueError};
use rdt_transport::Tensor;
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::refs::client::{this_process, AnyRef, Encoded, SharedClient};

thread_local! {
    /// Refs met while encoding on this thread (`None`: not encoding).
    pub(super) static ENCODING: RefCell<Option<Vec<AnyRef>>> = const { RefCell::new(None) };
    /// The client of refs decoded on this thread (`None`: not decoding).
    pub(super) static DECODING: RefCell<Option<SharedClient>> = const { RefCell::new(None) };
    /// A ref refused to serialize outside rdt on this thread (postcard
    /// drops serde's messages; callers that use it read this instead).
    pub(super) static REFUSED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
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
    client: Option<&SharedClient>,
    data: &[u8],
    tensors: &[Tensor],
) -> Result<T, ValueError> {
    reading_refs(bound_to(client), || value::decode(data, tensors))
}

/// [`decode`] from a [`TensorList`]: a lazy one makes only the tensors the
/// value names, each once ([`value::decode_list`]).
pub(crate) fn decode_list<T: DeserializeOwned + 'static>(
    client: Option<&SharedClient>,
    data: &[u8],
    tensors: &rdt_transport::TensorList,
) -> Result<T, ValueError> {
    reading_refs(bound_to(client), || value::decode_list(data, tensors))
}

/// The client a decoded value's refs are bound to: `client`, or this
/// worker's.
fn bound_to(client: Option<&SharedClient>) -> Option<SharedClient> {
    client.cloned().or_else(this_process)
}

/// Runs `read` (a deserialization) with refs and handles bound to
/// `client`; in an actor, the borrows met go out in one message at the end
/// (CL-3). Outside such a scope, reading a ref or a handle is an error.
pub(crate) fn reading_refs<R>(client: Option<SharedClient>, read: impl FnOnce() -> R) -> R {
    let began = client.as_ref().is_some_and(|c| c.decode_begins());
    let outer = DECODING.with(|d| std::mem::replace(&mut *d.borrow_mut(), client.clone()));
    // Restored and the batch ended even if `read` panics.
    let _scope = DecodeScope {
        outer: Some(outer),
        began: began.then_some(client).flatten(),
    };
    read()
}

/// Ends a [`reading_refs`] scope: puts back the outer client and ends the
/// borrow batch this scope began.
struct DecodeScope {
    outer: Option<Option<SharedClient>>,
    began: Option<SharedClient>,
}

impl Drop for DecodeScope {
    fn drop(&mut self) {
        if let Some(c) = self.began.take() {
            c.decode_ends();
        }
        let outer = self.outer.take().flatten();
        DECODING.with(|d| *d.borrow_mut() = outer);
    }
}

/// The client of the value [`decode`] is decoding on this thread;
/// `None` outside it (a ref read by serde outside rdt).
pub(super) fn decoding_client() -> Option<SharedClient> {
    DECODING.with(|d| d.borrow().clone())
}
