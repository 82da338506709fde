//! The control loop: every frame from the driver, in order (invariant 3).

use super::*;

pub(super) async fn control_loop<A: RdtActor>(
    rx: &mut protocol::Receiver<protocol::ReadHalf>,
    addr: Addr<Host<A>>,
    shared: Arc<WorkerShared>,
    heartbeat: Option<Duration>,
) -> Result<()> {
    let tx = shared.tx.clone();
    // Receives that start here once the frames already read are handled
    // (`ReceiveStart::AfterFramesInHand`): the call behind a delivery is
    // in the actor's mailbox before its READ is posted.
    // A steady stream of frames does not hold them back for long: they
    // start after at most this many frames.
    const MOST_FRAMES_AHEAD: usize = 16;
    let mut after_frames_in_hand: Vec<Job> = Vec::new();
    let mut frames_ahead = 0;
    loop {
        if !after_frames_in_hand.is_empty() {
            frames_ahead += 1;
            if frames_ahead > MOST_FRAMES_AHEAD || !rx.has_whole_frame() {
                frames_ahead = 0;
                shared.started_after_frames.fetch_add(
                    after_frames_in_hand.len() as u64,
                    std::sync::atomic::Ordering::Relaxed,
                );
                rdt_transport::trace::timeline("frames in hand handled", 0);
                for job in after_frames_in_hand.drain(..) {
                    run_now_or_spawn(job);
                }
            }
        }
        // Hot (rdt_transport::rt::hot): the next message of a pass often comes
        // within the window; waking this thread after it slept costs more.
        let next = match heartbeat {
            None => hot(rx.recv::<ToWorker>()).await,
            // recv is cancel-safe: a frame in progress stays buffered.
            Some(hb) => {
                // HB-1: bytes of a frame still arriving are a live driver;
                // and while one arrives, the driver's pings wait behind it,
                // so this worker says it is alive itself (an unasked
                // `Pong` is only that).
                let (mut seen, mut quiet) = (rx.bytes_read(), tokio::time::Instant::now());
                loop {
                    match tokio::time::timeout(hb / 4, hot(rx.recv::<ToWorker>())).await {
                        Ok(m) => break m,
                        Err(_) if rx.bytes_read() != seen => {
                            seen = rx.bytes_read();
                            quiet = tokio::time::Instant::now();
                            tx.send(&ToDriver::Pong)?;
                        }
                        Err(_) if quiet.elapsed() > hb => {
                            return Err(Error::Protocol(format!(
                                "the driver went silent for {hb:?} (network cut?); exiting"
                            )))
                        }
                        Err(_) => {}
                    }
                }
            }
        };
        let msg = match next {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(()),
            Err(e) => return Err(e),
        };
        match msg {
            ToWorker::Call(call) => {
                // The actor replies itself, from its own thread (no hop back
                // here); a full or closed mailbox fails the call at once.
                let result = call.result;
                rdt_transport::trace::timeline("call received", call.call);
                // WK-13: counted before the hand-off, so that a call
                // ending meanwhile keeps the copies this one takes.
                shared.uses_begin(call.ref_args());
                // PD-1: orders to deliver its value straight are taken
                // from now until it finishes.
                let straight = call.transport.sidedness() != Sidedness::TwoSided;
                if straight {
                    shared.straight.open_call(result);
                }
                // To the actor's thread: queued for it while it listens
                // after a call (no wake-up to pay here, before a READ
                // the call waits for), else through its mailbox.
                host::hand_over(&shared, &addr, call);
                rdt_transport::trace::timeline("call handed over", result);
            }
            ToWorker::Deliver { object, value } => {
                if let Ok(d) = &value {
                    rdt_transport::trace::timeline("deliver received", d.xfer);
                }
                if let Some(job) = on_deliver(&shared, object, value) {
                    after_frames_in_hand.push(job);
                }
            }
            ToWorker::DeliverTo { object, xfer, to } => straight::order(&shared, object, xfer, to),
            ToWorker::SendTo {
                object,
                xfer,
                to,
                group,
            } => {
                rdt_transport::trace::timeline("send order received", xfer);
                on_send(&shared, object, xfer, to, group)
            }
            ToWorker::PrepareGroup { backend, spec } => on_prepare_group(&shared, backend, spec),
            ToWorker::CreateGroup { backend, spec } => on_create_group(&shared, backend, spec),
            ToWorker::DestroyGroup { group } => {
                let g = shared.groups.lock().remove(&group);
                let tx = tx.clone();
                tokio::spawn(async move {
                    let result = match g {
                        // Dropping the queue ends its thread once it drained.
                        Some(g) => match g.backend.instance() {
                            Ok(inst) => inst.destroy_group(group).await.map_err(Error::from),
                            Err(e) => Err(e),
                        },
                        None => Ok(()),
                    };
                    let _ = tx.send(&ToDriver::GroupDestroyed { group, result });
                });
            }
            ToWorker::AbortGroup { group, reason } => {
                if let Some(g) = shared.groups.lock().get_mut(&group) {
                    g.broken = Some(reason.clone());
                    if let Some(inst) = g.backend.existing_instance() {
                        inst.abort_group(group, &reason);
                    }
                }
            }
            ToWorker::AbortTransfer {
                object,
                xfer,
                error,
            } => match shared.transfers.lock().remove(&xfer) {
                Some(abort) => {
                    tracing::debug!(xfer, object, "transfer aborted: {error}");
                    let _ = abort.send(error);
                }
                // Not received, not receiving: a straight delivery that
                // has not come (PD-5; a delivery from the driver comes
                // before its abort on this connection, and a finished
                // receive stored its value or error before its Free).
                None if shared.store.get(object).is_none()
                    && !shared.receiving.lock().contains_key(&object)
                    && shared.straight.give_up(xfer) =>
                {
                    tracing::debug!(xfer, object, "straight delivery given up: {error}");
                    shared.store.insert(object, Slot::Failed(error));
                }
                None => tracing::trace!(xfer, object, "abort of a finished transfer"),
            },
            ToWorker::PeerGone { actor } => {
                shared.straight.peer_gone(actor);
                for t in Transport::registered() {
                    if let Some(inst) = t.existing_instance() {
                        inst.peer_gone(actor);
                    }
                }
            }
            ToWorker::Free { object } => {
                rdt_transport::trace::timeline("free start", object);
                if let Some(freed) = shared.receiving.lock().get_mut(&object) {
                    // Tombstone (WK-3): the receive in flight drops its data.
                    *freed = true;
                }
                if let Some(Slot::Ready(v)) = shared.store.remove(object) {
                    if v.produced {
                        if let Ok(t) = v.transport.instance() {
                            tokio::spawn(async move {
                                if let Err(e) = t.release(object).await {
                                    tracing::warn!("releasing object {object}: {e}");
                                }
                            });
                        }
                    }
                    shared.drop_freed(v);
                }
                rdt_transport::trace::timeline("free done", object);
            }
            ToWorker::Fetch { object, req } => {
                // Captured here, in order (a later Free cannot overtake it);
                // packed on the blocking pool (device-to-host copies).
                let slot = shared.store.get(object);
                let tx = tx.clone();
                tokio::task::spawn_blocking(move || {
                    let result = match slot {
                        // The driver reads refs in it itself (the object's
                        // entry holds them).
                        Some(Slot::Ready(v)) => inline_value(
                            rdt_transport::value::Payload {
                                data: v.data,
                                tensors: Arc::unwrap_or_clone(v.tensors).into_vec(),
                            },
                            Vec::new(),
                        ),
                        Some(Slot::Failed(e)) => Err(e),
                        None => Err(Error::Freed { object }),
                    };
                    if let Err(e) = tx.send(&ToDriver::Fetched { req, result }) {
                        let _ = tx.send(&ToDriver::Fetched {
                            req,
                            result: Err(e),
                        });
                    }
                });
            }
            ToWorker::Settled { req, result } => {
                if let Some(w) = shared.watches.lock().remove(&req) {
                    let _ = w.send(result);
                }
            }
            ToWorker::Probed { req, state } => {
                if let Some(p) = shared.probes.lock().remove(&req) {
                    let _ = p.send(state);
                }
            }
            ToWorker::Ping => tx.send(&ToDriver::Pong)?,
            ToWorker::Shutdown => std::process::exit(0),
            ToWorker::Spawn(_) => tracing::warn!("second spawn order ignored"),
        }
    }
}
