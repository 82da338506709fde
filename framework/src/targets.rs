//! [`Targets`]: the tensors a weight update is received into, held once
//! and kept from one update to the next.

use std::sync::Arc;

use rdt_transport::Tensor;

/// The tensors [`get_into`](crate::ActorRuntime::get_into) receives an
/// object's tensors into: an actor's parameters, kept across weight
/// updates.
///
/// `get_into` takes a slice too, and registers a copy of it for the
/// receive: 10 000 parameters are 10 000 clones and drops per update, and
/// every check of them (do they match the metadata, can the transport
/// write into them) runs again. A `Targets` is the tensors held once and
/// never changed, so it is registered as it is; a receive into the same
/// `Targets` with the same layout as one before (a weight sync's next
/// step) checks nothing again, because nothing it checked can have
/// changed. Cloning a `Targets` clones a handle, not the tensors.
///
/// ```no_run
/// # use rdt::prelude::*;
/// # use rdt::Targets;
/// # async fn f(weights: ObjectRef<Vec<Tensor>>, params: Vec<Tensor>) -> rdt::Result<()> {
/// // Once, when the actor makes its parameters:
/// let params = Targets::from(params);
/// // At every step, inside a method that got a ref to the new weights:
/// rdt::runtime().get_into(&weights, &params).await?;
/// # Ok(()) }
/// ```
#[derive(Clone, Debug, Default)]
pub struct Targets(Arc<[Tensor]>);

impl Targets {
    /// The tensors.
    pub fn as_slice(&self) -> &[Tensor] {
        &self.0
    }

    /// The shared list itself, as a receive registers it.
    pub(crate) fn shared(&self) -> &Arc<[Tensor]> {
        &self.0
    }
}

impl std::ops::Deref for Targets {
    type Target = [Tensor];
    fn deref(&self) -> &[Tensor] {
        &self.0
    }
}

impl From<Vec<Tensor>> for Targets {
    fn from(v: Vec<Tensor>) -> Targets {
        Targets(v.into())
    }
}

impl From<Arc<[Tensor]>> for Targets {
    fn from(v: Arc<[Tensor]>) -> Targets {
        Targets(v)
    }
}

/// A copy of the slice's tensors (a clone of each).
impl From<&[Tensor]> for Targets {
    fn from(v: &[Tensor]) -> Targets {
        Targets(v.into())
    }
}

/// A copy of the vector's tensors (a clone of each).
impl From<&Vec<Tensor>> for Targets {
    fn from(v: &Vec<Tensor>) -> Targets {
        Targets(v.as_slice().into())
    }
}

/// The same tensors (a handle cloned, not the tensors).
impl From<&Targets> for Targets {
    fn from(v: &Targets) -> Targets {
        v.clone()
    }
}

impl FromIterator<Tensor> for Targets {
    fn from_iter<I: IntoIterator<Item = Tensor>>(iter: I) -> Targets {
        Targets(iter.into_iter().collect())
    }
}
