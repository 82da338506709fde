//! Waiting on refs and fitting received tensors to targets, for the
//! driver's and an actor's `get_timeout`, `wait_many` and `get_into` alike.

use std::future::Future;
use std::time::Duration;

use rdt_transport::Tensor;

use crate::error::{Error, Result as RdtResult};
use crate::refs::object_ref::ObjectRef;

/// A `get` of object `id` bounded by `deadline`, for the driver's and an
/// actor's `get_timeout` alike: running out is `Error::Timeout` naming the
/// object.
pub(crate) async fn get_within<T>(
    id: u64,
    deadline: Duration,
    get: impl Future<Output = RdtResult<T>>,
) -> RdtResult<T> {
    tokio::time::timeout(deadline, get)
        .await
        .map_err(|_| Error::Timeout {
            what: format!("object {id}"),
            after_ms: deadline.as_millis() as u64,
        })?
}

/// Ray's `wait` for the driver and for actors alike: `(finished, pending)`,
/// each in the order of `refs`, once `num_returns` of them are finished
/// (`wait` of its id resolved: ready or failed) or `timeout` passed.
/// Every ref is watched at once.
pub(crate) async fn wait_many<T, W, F>(
    refs: &[ObjectRef<T>],
    num_returns: usize,
    timeout: Option<Duration>,
    wait: W,
) -> RdtResult<(Vec<ObjectRef<T>>, Vec<ObjectRef<T>>)>
where
    W: Fn(u64) -> F,
    F: Future<Output = RdtResult<()>>,
{
    use futures::StreamExt;
    if num_returns > refs.len() {
        return Err(Error::Protocol(format!(
            "wait_many asked for {num_returns} of {} refs; ask for at most {}",
            refs.len(),
            refs.len()
        )));
    }
    let mut finished = vec![false; refs.len()];
    let mut watching: futures::stream::FuturesUnordered<_> = refs
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let w = wait(r.id);
            async move { (i, w.await) }
        })
        .collect();
    let mut count = 0;
    let collect = async {
        while count < num_returns {
            let Some((i, r)) = watching.next().await else {
                break;
            };
            if let Err(Error::Shutdown) = r {
                return Err(Error::Shutdown);
            }
            finished[i] = true;
            count += 1;
        }
        Ok(())
    };
    match timeout {
        None => collect.await?,
        // Past the deadline: what finished so far.
        Some(d) => {
            if let Ok(r) = tokio::time::timeout(d, collect).await {
                r?
            }
        }
    }
    drop(watching);
    let (done, pending): (Vec<_>, Vec<_>) = refs.iter().zip(finished).partition(|(_, f)| *f);
    Ok((
        done.into_iter().map(|(r, _)| r.clone()).collect(),
        pending.into_iter().map(|(r, _)| r.clone()).collect(),
    ))
}

/// Checks that `targets` fit object `id`'s tensors (`metas`): one target
/// per tensor, same dtype and shape, in order. For the driver's and an
/// actor's `get_into` alike, before any byte moves.
pub(crate) fn check_targets(
    id: u64,
    metas: &[rdt_transport::TensorMeta],
    targets: &[Tensor],
) -> RdtResult<()> {
    use rdt_transport::transport::{first_mismatch, MetaMismatch};
    let message = match first_mismatch(metas, targets) {
        None => return Ok(()),
        Some(MetaMismatch::Count) => format!(
            "the object holds {} tensors and {} targets were given",
            metas.len(),
            targets.len()
        ),
        Some(MetaMismatch::At(i)) => format!(
            "its tensor #{i} is {} {:?} and target #{i} is {} {:?}",
            metas[i].dtype,
            metas[i].shape,
            targets[i].dtype(),
            targets[i].shape()
        ),
    };
    Err(Error::Targets {
        object: id,
        message,
    })
}

/// Object `id`'s tensors (`got`, as received) in `targets`: nothing to
/// do when the receive put them there (they are the targets: in place,
/// `None`), else copied into `targets` (one copy, after
/// [`check_targets`]) and those returned. Borrowed, not taken: the stored
/// list is shared, and 10 000 tensors are 10 000 clones and drops.
pub(crate) fn into_targets(
    id: u64,
    targets: &[Tensor],
    got: &[Tensor],
) -> RdtResult<Option<Vec<Tensor>>> {
    let in_place = targets.len() == got.len()
        && targets.iter().zip(got).all(|(t, g)| {
            t.shares_storage(g)
                && t.byte_offset() == g.byte_offset()
                && t.dtype() == g.dtype()
                && t.shape() == g.shape()
        });
    if in_place {
        return Ok(None);
    }
    let metas: Vec<_> = got.iter().map(Tensor::meta).collect();
    check_targets(id, &metas, targets)?;
    for (i, (t, g)) in targets.iter().zip(got).enumerate() {
        t.copy_from(g).map_err(|e| Error::Targets {
            object: id,
            message: format!("copying its tensor #{i} into target #{i}: {e}"),
        })?;
    }
    Ok(Some(targets.to_vec()))
}
