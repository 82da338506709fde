//! Receiving: a delivery's receive started where its transport says,
//! raced against its abort, stored (or tombstoned) and acknowledged.

use super::*;

/// TG-4: `target` for a receive over `transport` (transfer `xfer`) into
/// targets a `get_into` registered (`landing`), with the gate the getter
/// closes when it is dropped. A transport that copies into the targets
/// does so through the gate; any other writes into them as the bytes come
/// (`nixl`, `nccl`, a user's own transport), so the getter's drop aborts
/// it. A getter gone already: received anywhere.
pub(super) fn land_gated(
    target: Target,
    landing: &crate::refs::targets::Landing,
    transport: &dyn rdt_transport::TensorTransport,
    xfer: u64,
) -> (
    Target,
    Option<Arc<rdt_transport::TargetGate>>,
    Option<rdt_transport::Writing>,
) {
    if !matches!(target, Target::Tensors(_)) {
        return (target, None, None);
    }
    let copies = transport.copies_into_targets();
    if !copies {
        // Noted before the gate is read: a getter dropped after the read
        // finds it and aborts the receive.
        *landing.in_place.lock() = Some(xfer);
    }
    // A receive that writes in place is the targets' writer until it ends
    // (`Targets::idle`; the transport counts what outlives it): counted
    // before the gate is read, so that a wait that begins after the drop
    // sees it.
    let writing = (!copies).then(|| landing.gate.writing());
    if !landing.gate.is_open() {
        return (Target::Any, None, None);
    }
    (target, Some(landing.gate.clone()), writing)
}

/// Takes a delivery: through-driver values are stored, direct receives
/// start where their transport says (`ReceiveStart`). Returns the receive
/// the loop starts itself once the frames in hand are handled.
#[must_use = "a receive returned here starts only when its caller runs it"]
pub(super) fn on_deliver(
    shared: &Arc<WorkerShared>,
    object: u64,
    value: std::result::Result<Delivery, Error>,
) -> Option<Job> {
    let mut d = match value {
        Err(e) => {
            shared.store.insert(object, Slot::Failed(e));
            return None;
        }
        Ok(d) => d,
    };
    let xfer = d.xfer;
    let t = d.value.transport;
    let transport = match t.instance().map(|i| (t, i)) {
        Ok(t) => t,
        Err(e) => {
            if xfer != 0 {
                let _ = shared.tx.send(&ToDriver::Received {
                    object,
                    xfer,
                    result: Err(e.clone()),
                });
            }
            shared.store.insert(object, Slot::Failed(e));
            return None;
        }
    };
    if transport.1.sidedness() == Sidedness::ThroughDriver {
        if xfer != 0 {
            on_deliver_straight_inline(shared, object, transport.0, d.value, xfer);
        } else {
            on_deliver_inline(shared, object, transport.0, d.value);
        }
        return None;
    }
    rdt_transport::trace::timeline("deliver transport found", xfer);
    // WK-4: the receive runs until done, failed or aborted by the driver;
    // its end is acknowledged exactly once (XF-5).
    let abort = shared.register_transfer(xfer);
    shared.receiving.lock().insert(object, false);
    rdt_transport::trace::timeline("deliver transfer registered", xfer);
    let worker = shared.clone();
    let from = d.from.take().unwrap_or_else(|| Peer {
        actor: 0,
        name: "driver".into(),
        host: String::new(),
        endpoint: String::new(),
    });
    let span = tracing::debug_span!(
        "transfer",
        xfer,
        object,
        transport = transport.0.name(),
        peer = %from.name,
        bytes = d.value.exported.nbytes(),
        side = "receive",
    );
    let group = d.group;
    let ack_at_landing = d.ack_at_landing;
    // Asked only where the head is here already (a large one may still be
    // arriving, cut-through); decoded here, the job finds it decoded.
    let start = match group {
        Some(_) => ReceiveStart::Task,
        None if !d.value.exported.head_is_here() => ReceiveStart::Task,
        None => d
            .value
            .exported
            .get()
            .map_or(ReceiveStart::Task, |e| transport.1.receive_start(e)),
    };
    rdt_transport::trace::timeline("deliver start chosen", xfer);
    let job = Box::pin(
        async move {
            rdt_transport::trace::timeline("receive job start", xfer);
            let t0 = std::time::Instant::now();
            let shared = worker;
            // The receive and the acknowledgement are boxed on their own:
            // inline, they made this task 1 432 bytes, a request that glibc
            // serves only after consolidating its fastbins (1.5 µs of a
            // small `nixl` pass on the control loop, before the READ's
            // post, in the 2xH200 timelines of session 42); the task (672
            // bytes) and each box stay under 1 KiB, which the thread's
            // cache serves.
            let receive = Box::pin(async {
                // Tests keep a receive in flight.
                #[cfg(feature = "failpoints")]
                fail::fail_point!("rdt::receive");
                d.value.exported.head_arrived().await?;
                rdt_transport::trace::timeline("receive head here", xfer);
                let exported = d.value.exported.get()?;
                rdt_transport::trace::timeline("receive exported decoded", xfer);
                // Targets are ordered by the value's bytes (TG-1), which
                // may still be arriving: they come before the receive
                // writes into anything.
                // The actor's device map, from where the producer has
                // the tensors: one place for them all is where the
                // receive lands them; the rest are put there after.
                let mapped = shared
                    .device_map
                    .places(exported.metas.iter().map(|m| m.device));
                let (target, gate, _writing) = match shared.take_targets(object) {
                    None => match &mapped {
                        rdt_transport::Mapped::One(place) => (Target::from(*place), None, None),
                        _ => (Target::Any, None, None),
                    },
                    Some(registered) => {
                        let landing = registered.landing.clone();
                        let target = match d.value.data.arrived().await {
                            Ok(data) => shared.target_for(
                                object,
                                registered,
                                &data,
                                &exported.metas,
                                d.value.exported.layout(),
                                (transport.0, transport.1.as_ref()),
                            ),
                            Err(_) => Target::Any,
                        };
                        land_gated(target, &landing, transport.1.as_ref(), xfer)
                    }
                };
                let cx = rdt_transport::TransferCtx {
                    xfer,
                    group,
                    target,
                    gate,
                    layout: d.value.exported.layout(),
                    first_reader: Some(shared.first_reader(object)),
                };
                rdt_transport::trace::timeline("receive target chosen", xfer);
                let tensors = transport
                    .1
                    .receive_list(&from, &cx, exported)
                    .await
                    .map_err(Error::from)?;
                let tensors = match cx.target {
                    // Targets a `get_into` gave are where it wants them.
                    Target::Tensors(_) => tensors,
                    _ => apply_map(&mapped, tensors)?,
                };
                rdt_transport::trace::timeline("receive returned", xfer);
                // The non-tensor part, large enough to stream, may still
                // be arriving.
                let data = d.value.data.arrived().await.map_err(|e| {
                    Error::Transport(rdt_transport::TransportError::new(
                        transport.0.name(),
                        format!("the value's data did not arrive whole: {e}"),
                    ))
                })?;
                Ok::<_, Error>((data, tensors))
            });
            let received = until_aborted(&shared, xfer, abort, receive).await;
            rdt_transport::trace::timeline("receive ended", xfer);
            let (data, received) = match received {
                Ok((data, tensors)) => (data, Ok(tensors)),
                Err(e) => (Bytes::new(), Err(e)),
            };
            let ack = match &received {
                Ok(_) => Ok(()),
                Err(e) => Err(e.clone()),
            };
            // A stream-ordered receive returned before its bytes landed
            // (the method may start; its kernels wait on the GPU): the
            // acknowledgement waits for the landing (XF-5).
            let landing: Option<Landed> = received
                .as_ref()
                .ok()
                .and_then(|_| transport.1.landed(xfer))
                .map(|l| Landed {
                    landing: l.shared(),
                    xfer,
                    ack: Arc::default(),
                });
            // WK-5: known before the value is stored, so that a call that
            // takes the value also finds the landing to wait for.
            if let Some(l) = &landing {
                shared.landing.lock().insert(object, l.clone());
            }
            rdt_transport::trace::timeline("receive landing noted", xfer);
            {
                // Held across the store insert: a `Free` either finds the
                // receive and leaves a tombstone, or finds the value stored.
                let mut receiving = shared.receiving.lock();
                let freed = receiving.remove(&object).unwrap_or(false);
                let slot = match received {
                    Ok(tensors) => {
                        tracing::debug!(micros = t0.elapsed().as_micros() as u64, "received");
                        shared.received_value(transport.0, data, tensors)
                    }
                    Err(e) => {
                        tracing::debug!("receive failed: {e}");
                        Slot::Failed(e)
                    }
                };
                // TG-4: a receive its getter gave up leaves nothing: the
                // driver delivers again to whatever else needs it here.
                let cancelled = matches!(slot, Slot::Failed(Error::Cancelled { .. }));
                if !freed && !cancelled {
                    shared.store.insert(object, slot);
                }
                rdt_transport::trace::timeline("receive stored", xfer);
            }
            // The acknowledgement comes after the value is stored, off the
            // path of the call waiting for it; a call that ran with it
            // settles the receive in the driver first (XF-5).
            let landed_already = landing.is_none();
            let acknowledge = Box::pin(async move {
                let ack = match landing {
                    None => ack,
                    Some(l) => {
                        let landed = l.landing.clone().await.map_err(Error::from);
                        if let Err(e) = &landed {
                            // The bytes never all arrived: a call that has
                            // not taken the value yet fails instead.
                            shared.store.fail_received(object, e.clone());
                        }
                        shared.landing.lock().remove(&object);
                        // WK-9: a call that took the value acknowledges
                        // with its `CallDone` (no second frame, written
                        // beside the reply on the same connection)...
                        if !l.take_ack() {
                            // ...unless its method runs on: then the
                            // acknowledgement goes now, well before the
                            // transfer deadline (a failed landing is the
                            // call's to report, with `Dependency`).
                            if landed.is_err() || l.call_ended() {
                                return;
                            }
                            if ack_at_landing {
                                // OW-15: the driver holds the consumer's
                                // next large send until this lands.
                                let _ = shared.tx.send(&ToDriver::Received {
                                    object,
                                    xfer,
                                    result: landed.and(ack),
                                });
                                return;
                            }
                            let bounded = {
                                let shared = shared.clone();
                                async move {
                                    tokio::time::sleep(shared.ack_wait).await;
                                    if !l.call_ended() {
                                        let _ = shared.tx.send(&ToDriver::Received {
                                            object,
                                            xfer,
                                            result: landed.and(ack),
                                        });
                                    }
                                }
                            };
                            // WK-12: the wait (up to 10 ms, behind almost
                            // every small pass, whose call took the value
                            // before it landed) sleeps on the control
                            // runtime, not on the group's: a group runtime
                            // with no task of its own takes its next job in
                            // a tight loop (GQ-2).
                            shared.control.spawn(bounded.in_current_span());
                            return;
                        }
                        landed.and(ack)
                    }
                };
                // Sent now, not held for the call's `CallDone`
                // (`send_soon`): tried on one H200, that cost a wake-up of
                // the writer task per receive (cached `cuda_ipc` hand-off
                // 63.5-68.4 -> 71.0-72.2 µs), and a driver that heard
                // nothing during a long read had left its hot window when
                // the reply came (+75 µs). Tried again on 2xH200 for small
                // nixl reads only, with the `CallDone` written ahead of the
                // held acknowledgement (`6e37ce6`, `6874524`): a 4 KiB pass
                // took 53.8-59.7 µs against 53.2-54.0 µs sent now,
                // alternating in one run.
                let _ = shared.tx.send(&ToDriver::Received {
                    object,
                    xfer,
                    result: ack,
                });
                transport.1.after_receive();
            });
            if landed_already {
                acknowledge.await;
            } else {
                // Off the group's queue: the next transfer is enqueued
                // while these bytes still move.
                tokio::spawn(acknowledge.in_current_span());
            }
        }
        .instrument(span),
    );
    rdt_transport::trace::timeline("deliver job made", xfer);
    match start {
        ReceiveStart::Now => run_now_or_spawn(job),
        ReceiveStart::AfterFramesInHand => return Some(job),
        ReceiveStart::Task => run_transfer(shared, group, job, xfer),
    }
    None
}

/// Runs `job` here, on the control loop, up to its first wait, and spawns
/// the rest as a task (polled again at once there, with a real waker).
/// For a receive that does not wait (`ReceiveStart::Now`), that is all
/// of it: the value is stored before the loop reads its next frame.
pub(super) fn run_now_or_spawn(mut job: Job) {
    let mut cx = std::task::Context::from_waker(futures::task::noop_waker_ref());
    if job.as_mut().poll(&mut cx).is_pending() {
        tokio::spawn(job);
    }
}

/// Stores a value delivered through the driver. One whose large blobs
/// are still arriving (cut-through) is stored by a task once they are all
/// in, unless the value was freed meanwhile (the same tombstone as a
/// receive, WK-3); calls that need it wait in the store.
pub(super) fn on_deliver_inline(
    shared: &Arc<WorkerShared>,
    object: u64,
    t: Transport,
    value: crate::protocol::WireValue,
) {
    let slot = move |shared: &WorkerShared, got: Result<(Bytes, Vec<Tensor>)>| match got {
        Ok((data, tensors)) => shared.received_value(t, data, tensors.into()),
        Err(e) => Slot::Failed(e),
    };
    let map = shared.device_map.clone();
    let mut unpacking = Box::pin(async move { unpack_inline(&map, &value).await });
    // All here: stored at once, with no task and no tombstone.
    if let Some(got) = (&mut unpacking).now_or_never() {
        return shared.store.insert(object, slot(shared, got));
    }
    shared.receiving.lock().insert(object, false);
    let shared = shared.clone();
    tokio::spawn(async move {
        let slot = slot(&shared, unpacking.await);
        let mut receiving = shared.receiving.lock();
        if !receiving.remove(&object).unwrap_or(false) {
            shared.store.insert(object, slot);
        }
    });
}

/// A value through the driver that its producer delivered straight (OW-9,
/// PD-2): received as the driver's delivery is, against the transfer's
/// abort, then acknowledged (the driver holds the copy as receiving until
/// then). If its bytes do not all come (the producer died mid-send, its
/// link broke), nothing is stored: the driver, which holds the value
/// itself, delivers it again, or its error (OW-11). An abort (the
/// deadline, the consumer's own death) fails the call, as for any
/// transfer.
pub(super) fn on_deliver_straight_inline(
    shared: &Arc<WorkerShared>,
    object: u64,
    t: Transport,
    value: crate::protocol::WireValue,
    xfer: u64,
) {
    let abort = shared.register_transfer(xfer);
    shared.receiving.lock().insert(object, false);
    let shared = shared.clone();
    tokio::spawn(async move {
        let unpack = async {
            // Tests make the value fail to arrive whole here.
            #[cfg(feature = "failpoints")]
            if fail::eval("rdt::straight_inline_receive", |_| ()).is_some() {
                return Err(Error::Protocol(
                    "failpoint rdt::straight_inline_receive".into(),
                ));
            }
            unpack_inline(&shared.device_map, &value).await
        };
        let (slot, ack) = tokio::select! {
            got = unpack => match got {
                Ok((data, tensors)) => (Some(shared.received_value(t, data, tensors.into())), Ok(())),
                Err(e) => (None, Err(e)),
            },
            e = abort => {
                let e = e.unwrap_or(Error::Shutdown);
                (Some(Slot::Failed(e.clone())), Err(e))
            }
        };
        shared.transfers.lock().remove(&xfer);
        {
            let mut receiving = shared.receiving.lock();
            let freed = receiving.remove(&object).unwrap_or(false);
            if let (Some(slot), false) = (slot, freed) {
                shared.store.insert(object, slot);
            }
        }
        // Tests hold the acknowledgement back (past the deadline).
        #[cfg(feature = "failpoints")]
        fail::fail_point!("rdt::straight_ack");
        let _ = shared.tx.send(&ToDriver::Received {
            object,
            xfer,
            result: ack,
        });
    });
}

/// The data and tensors of a value through the driver, once its bytes are
/// in; a CUDA tensor still arriving is copied to its device step by step
/// as its bytes land (`object_store::unpack_arriving`).
pub(crate) async fn unpack_inline(
    map: &rdt_transport::DeviceMap,
    v: &crate::protocol::WireValue,
) -> Result<(Bytes, Vec<Tensor>)> {
    v.exported.head_arrived().await?;
    let exported = v.exported.get()?;
    let tensors = object_store::unpack_arriving(exported).await?;
    v.arrived().await?;
    let mapped = map.places(exported.metas.iter().map(|m| m.device));
    let tensors = apply_map(&mapped, tensors.into())?.into_vec();
    Ok((v.data_bytes()?, tensors))
}

/// `tensors` put where the actor's device map sends them (`mapped`, from
/// the devices their producer had them on).
pub(super) fn apply_map(
    mapped: &rdt_transport::Mapped,
    tensors: rdt_transport::TensorList,
) -> Result<rdt_transport::TensorList> {
    use rdt_transport::Mapped;
    let put = |place: rdt_transport::Place, t: Tensor| {
        place.put(t).map_err(|e| {
            Error::Tensor(format!(
                "putting a received tensor in {place}, as the actor's device map says: {e}"
            ))
        })
    };
    let placed = match mapped {
        Mapped::Unmapped => return Ok(tensors),
        Mapped::One(place) => tensors
            .into_vec()
            .into_iter()
            .map(|t| put(*place, t))
            .collect::<Result<Vec<_>>>()?,
        Mapped::Each(places) => tensors
            .into_vec()
            .into_iter()
            .zip(places)
            .map(|(t, p)| match p {
                Some(place) => put(*place, t),
                None => Ok(t),
            })
            .collect::<Result<Vec<_>>>()?,
    };
    Ok(placed.into())
}

/// Runs a transfer's `work` until it ends or its abort handle fires, then
/// forgets the transfer (WK-4).
pub(super) async fn until_aborted<T>(
    shared: &WorkerShared,
    xfer: u64,
    abort: oneshot::Receiver<Error>,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let r = tokio::select! {
        r = work => r,
        e = abort => Err(e.unwrap_or(Error::Shutdown)),
    };
    shared.transfers.lock().remove(&xfer);
    r
}

/// Runs a transfer's job: in its group's queue for a transfer in a group
/// (XF-3), on the control runtime otherwise. A job that cannot be queued
/// fails its transfer at once.
pub(super) fn run_transfer(
    shared: &Arc<WorkerShared>,
    group: Option<rdt_transport::GroupRef>,
    job: Job,
    xfer: u64,
) {
    let Some(g) = group else {
        tokio::spawn(job);
        return;
    };
    rdt_transport::trace::timeline("transfer job queued", xfer);
    if let Err((why, job)) = queue_in_group(shared, g.id, job) {
        // The job runs at once and meets its abort: a receive is
        // acknowledged as failed, a send reported, by the usual paths.
        if let Some(abort) = shared.transfers.lock().remove(&xfer) {
            let _ = abort.send(Error::Group(why));
        }
        tokio::spawn(job);
    }
}
