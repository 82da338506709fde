//! Sending an object to a consumer the driver named (`Send`).

use super::*;

/// A send order: the tensors are taken from the store here, in the
/// control loop's order (WK-2: a `Free` processed after this order cannot
/// pull them away; one processed before it makes the send fail at once,
/// and the driver aborts the receive).
pub(super) fn on_send(
    shared: &Arc<WorkerShared>,
    object: u64,
    xfer: u64,
    to: Peer,
    group: Option<rdt_transport::GroupRef>,
) {
    let captured = match shared.store.get(object) {
        Some(Slot::Ready(v)) => v.transport.instance().map(|t| (t, v)),
        Some(Slot::Failed(e)) => Err(e),
        None => Err(Error::Freed { object }),
    };
    let (t, v) = match captured {
        Ok(c) => c,
        Err(e) => {
            let _ = shared.tx.send(&ToDriver::TransferFailed {
                object,
                xfer,
                peer: to.actor,
                transport: None,
                message: format!("the producer cannot send object {object}: {e}"),
            });
            return;
        }
    };
    let abort = shared.register_transfer(xfer);
    let worker = shared.clone();
    let span = tracing::debug_span!(
        "transfer",
        xfer,
        object,
        transport = v.transport.name(),
        peer = %to.name,
        side = "send",
    );
    let job = Box::pin(
        async move {
            let cx = rdt_transport::TransferCtx {
                group,
                ..rdt_transport::TransferCtx::new(xfer)
            };
            #[cfg(feature = "failpoints")]
            let injected = fail::eval("rdt::send", |m| m.unwrap_or_else(|| "injected".into()));
            #[cfg(not(feature = "failpoints"))]
            let injected: Option<String> = None;
            let shared = worker;
            let send = async {
                match injected {
                    Some(m) => Err(Error::Protocol(format!("failpoint rdt::send: {m}"))),
                    None => t.send(&to, &cx, &v.tensors).await.map_err(Error::from),
                }
            };
            if let Err(e) = until_aborted(&shared, xfer, abort, send).await {
                tracing::debug!("send failed: {e}");
                let _ = shared.tx.send(&ToDriver::TransferFailed {
                    object,
                    xfer,
                    peer: to.actor,
                    transport: Some(v.transport),
                    message: e.to_string(),
                });
            }
        }
        .instrument(span),
    );
    run_transfer(shared, group, job, xfer);
}
