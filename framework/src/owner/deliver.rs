//! Deliveries and transfers: a consumer's need, straight orders, direct
//! transfers and held sends (OW-4, OW-8, OW-9, OW-11, OW-15).

use super::*;

impl OwnerTable {
    /// Takes `xfer` out of the transfers in flight, noting that it ended;
    /// the end of a large one sends the next held send to its consumer
    /// (OW-15).
    pub(super) fn end_transfer(
        &mut self,
        xfer: u64,
        outcome: Outcome,
        actors: &Actors,
    ) -> Option<InFlight> {
        let t = self.transfers.remove(&xfer)?;
        self.ended.push(xfer);
        // The object's value is in the table by now (a straight transfer
        // was ordered while it was pending); it goes only after the end.
        let (bytes, tensors) =
            (self.objects.get(&t.object)).map_or((0, 0), |e| (e_bytes(e) as u64, e_tensors(e)));
        t.span.record("bytes", bytes);
        t.span.record("tensors", tensors);
        t.span.record("descriptors", tensors);
        t.span.record("outcome", outcome.as_str());
        if outcome == Outcome::Done {
            self.warm.insert(t.pair());
        }
        self.counts.transfer_ended(
            t.transport.name(),
            bytes,
            tensors,
            t.started.elapsed(),
            outcome,
        );
        if t.large {
            self.send_next_held(t.consumer, actors);
        }
        Some(t)
    }

    /// Tracks `t` until its end; its span says whether a transfer between
    /// its ends over its transport ended well before (`warm`) or not.
    fn track_transfer(&mut self, xfer: u64, t: InFlight) {
        t.span.record("warm", self.warm.contains(&t.pair()));
        self.transfers.insert(xfer, t);
    }

    /// The pairs of `actor` (dead) are cold again: no transfer uses them.
    pub(super) fn forget_warm(&mut self, actor: ActorId) {
        self.warm
            .retain(|&(_, p, c)| p != Some(actor) && c != actor);
    }

    /// OW-15: sends the held sends of `consumer`, oldest first, as long as
    /// no large transfer to it for another call is in flight with its send
    /// gone out: the next call's sends go together once the last one ahead
    /// ended. One aborted while held is dropped. A send that cannot go
    /// fails its transfer as in `start_direct` (OW-6); its end then sends
    /// the next.
    pub(super) fn send_next_held(&mut self, consumer: ActorId, actors: &Actors) {
        if actors.get(&consumer).is_none_or(|a| a.dead.is_some()) {
            // Its transfers are being aborted: none of them is sent.
            self.held_sends.remove(&consumer);
            return;
        }
        let transfers = &self.transfers;
        let Some(queue) = self.held_sends.get_mut(&consumer) else {
            return;
        };
        while let Some(h) = queue.front() {
            let Some(t) = transfers.get(&h.xfer) else {
                queue.pop_front();
                continue;
            };
            let ahead = transfers.iter().any(|(x, o)| {
                o.holds_back(consumer, h.call) && !queue.iter().any(|q| q.xfer == *x)
            });
            if ahead {
                break;
            }
            rdt_transport::trace::timeline("driver held send released", h.xfer);
            release_held(&mut self.outbox, h, consumer, t.object);
            queue.pop_front();
        }
        if queue.is_empty() {
            self.held_sends.remove(&consumer);
        }
    }

    /// OW-15: the held sends of transfers in `group`, which is being
    /// destroyed, go now. The members are told to leave it next, so each
    /// send reaches its producer ahead of that and its transfer ends as
    /// it would have without the hold (sent after the leave order, the
    /// send would find no group and its call would fail).
    pub fn send_held_in_group(&mut self, group: u64) {
        let transfers = &self.transfers;
        for (&consumer, queue) in self.held_sends.iter_mut() {
            queue.retain(|h| {
                let in_group = matches!(
                    &h.order,
                    ToWorker::SendTo { group: Some(g), .. } if g.id == group
                );
                if let (true, Some(t)) = (in_group, transfers.get(&h.xfer)) {
                    release_held(&mut self.outbox, h, consumer, t.object);
                }
                !in_group
            });
        }
        self.held_sends.retain(|_, q| !q.is_empty());
    }

    /// Whether `xfer`'s send is held (OW-15): its producer has not heard
    /// of it.
    pub(super) fn send_is_held(&self, consumer: ActorId, xfer: u64) -> bool {
        self.held_sends
            .get(&consumer)
            .is_some_and(|q| q.iter().any(|h| h.xfer == xfer))
    }

    /// The transfer `xfer`, if it is still in flight.
    pub fn transfer(&self, xfer: u64) -> Option<&InFlight> {
        self.transfers.get(&xfer)
    }

    /// Number of transfers in flight (for tests and leak checks).
    pub fn transfers_in_flight(&self) -> usize {
        self.transfers.len()
    }

    /// Transfers in flight, and straight orders (OW-9) whose producer has
    /// not answered: the consumer may have finished with the value while
    /// the producer's reply, which makes the object ready and may free it,
    /// is still on its way.
    pub fn transfers_unsettled(&self) -> usize {
        self.transfers.len() + self.straight_orders
    }

    /// A submitted call to `consumer` takes object `id`; `call` is that
    /// call, where the caller knows it (OW-15 orders large transfers of
    /// different calls, not those of one call).
    pub fn need(
        &mut self,
        id: u64,
        consumer: ActorId,
        call: Option<u64>,
        actors: &Actors,
        groups: &dyn GroupLookup,
    ) {
        let Some(e) = self.objects.get_mut(&id) else {
            // Cannot happen while the caller holds a ref; be loud if it does.
            tracing::error!("a call needs object {id}, which the owner table no longer has");
            self.outbox
                .deliver_error(consumer, id, Error::Freed { object: id });
            return;
        };
        *e.needs.entry(consumer).or_default() += 1;
        if matches!(e.state, ObjState::Pending) {
            if !self.order_straight(id, consumer, actors) {
                let e = self.objects.get_mut(&id).expect("looked up above");
                e.waiting.push((consumer, call));
            }
        } else {
            self.deliver(id, consumer, call, actors, groups);
        }
    }

    /// OW-12: may `consumer` drop its copy of `id` itself when the call
    /// just submitted ends? Yes if that call is its only need of the
    /// object and it did not produce it.
    pub fn releasable(&self, id: u64, consumer: ActorId) -> bool {
        self.objects
            .get(&id)
            .is_some_and(|e| e.producer != Some(consumer) && e.needs.get(&consumer) == Some(&1))
    }

    /// OW-9: asks the producer of pending object `id` to deliver it to
    /// `consumer` itself, if both are workers on this host that take
    /// such deliveries and the object's transport is one-sided. Returns
    /// whether the order went out.
    pub(super) fn order_straight(&mut self, id: u64, consumer: ActorId, actors: &Actors) -> bool {
        let Some(e) = self.objects.get_mut(&id) else {
            return false;
        };
        let Some(producer) = e.producer else {
            return false;
        };
        // OW-3: a copy on its way (an earlier call's order) is enough.
        if producer == consumer
            || e.sidedness() == Sidedness::TwoSided
            || e.copies.contains_key(&consumer)
        {
            return false;
        }
        let path = match (actors.get(&producer), actors.get(&consumer)) {
            (Some(p), Some(c)) if p.dead.is_none() && c.dead.is_none() => {
                match (&p.peer_socket, &c.peer_socket) {
                    (Some(_), Some(path)) => path.clone(),
                    _ => return false,
                }
            }
            _ => return false,
        };
        self.next_xfer += 1;
        let xfer = self.next_xfer;
        let order = ToWorker::DeliverTo {
            object: id,
            xfer,
            to: crate::protocol::PeerSocket {
                actor: consumer,
                path,
            },
        };
        if self.outbox.send(producer, &order).is_err() {
            return false;
        }
        rdt_transport::trace::timeline("driver ordered straight delivery", xfer);
        e.copies.insert(consumer, Copy::Receiving(xfer));
        e.straight.push((consumer, xfer));
        self.straight_orders += 1;
        e.sent_elsewhere = true;
        let transport = e.transport;
        self.track_transfer(
            xfer,
            InFlight {
                object: id,
                producer: Some(producer),
                consumer,
                transport,
                two_sided: false,
                large: false,
                call: None,
                span: transfer_span(xfer, id, transport, Some(producer), consumer, actors, true),
                started: std::time::Instant::now(),
            },
        );
        true
    }

    pub(super) fn deliver(
        &mut self,
        id: u64,
        consumer: ActorId,
        call: Option<u64>,
        actors: &Actors,
        groups: &dyn GroupLookup,
    ) {
        let Some(e) = self.objects.get_mut(&id) else {
            return;
        };
        let sided = e.sidedness();
        let value = match &e.state {
            ObjState::Pending => return,
            ObjState::Failed(err) => {
                if let std::collections::hash_map::Entry::Vacant(v) = e.copies.entry(consumer) {
                    v.insert(Copy::Held);
                    self.outbox.deliver_error(consumer, id, err.clone());
                }
                return;
            }
            ObjState::Ready(v) => match v.lost() {
                // Its bytes stopped arriving (its producer died while
                // sending them): the error, not a value with a hole.
                Some(err) => {
                    if let std::collections::hash_map::Entry::Vacant(v) = e.copies.entry(consumer) {
                        v.insert(Copy::Held);
                        self.outbox.deliver_error(consumer, id, err);
                    }
                    return;
                }
                None => v.clone(),
            },
        };
        if sided != Sidedness::ThroughDriver && e.producer == Some(consumer) {
            // OW-3: the producer already holds the storage.
            e.passed_back = true;
        } else if let std::collections::hash_map::Entry::Vacant(copy) = e.copies.entry(consumer) {
            if sided == Sidedness::ThroughDriver {
                // The bytes travel in the delivery: nothing to acknowledge.
                copy.insert(Copy::Held);
                let msg = ToWorker::Deliver {
                    object: id,
                    value: Ok(Delivery {
                        value,
                        from: None,
                        xfer: 0,
                        group: None,
                        ack_at_landing: false,
                    }),
                };
                if let Err(err) = self.outbox.send(consumer, &msg) {
                    self.outbox.deliver_error(consumer, id, err); // OW-6
                }
            } else {
                e.sent_elsewhere = true;
                self.next_xfer += 1;
                let xfer = self.next_xfer;
                // OW-15: behind a large transfer to the same consumer for
                // another call, a large one's send waits (those of one call
                // are all needed at once: they go together).
                let large = sided == Sidedness::TwoSided
                    && value.exported.nbytes() >= self.large_transfer_bytes.0;
                let behind = large
                    && self
                        .transfers
                        .values()
                        .any(|t| t.holds_back(consumer, call));
                let e = self.objects.get_mut(&id).expect("looked up above");
                let mut held = None;
                let started = start_direct(
                    e,
                    id,
                    xfer,
                    consumer,
                    value,
                    actors,
                    &mut self.outbox,
                    groups,
                    (large, behind, call),
                    &mut held,
                );
                if let Some((producer, deliver, order)) = held {
                    self.sends_held += 1;
                    self.held_sends
                        .entry(consumer)
                        .or_default()
                        .push_back(HeldSend {
                            xfer,
                            call,
                            producer,
                            deliver,
                            order,
                        });
                }
                if let Some((xfer, t)) = started {
                    self.track_transfer(xfer, t);
                }
                if self.transfers.contains_key(&xfer) {
                    self.started.push(xfer);
                }
                rdt_transport::trace::timeline("driver transfer noted", xfer);
            }
        }
        let e = self.objects.get_mut(&id).expect("looked up above");
        if e.passed_back && e.sent_elsewhere && !e.warned {
            e.warned = true;
            tracing::warn!(
                object = id,
                "object {id} was passed back to its producer and also sent to another actor; \
                 tensors are mutable and shared, so a write by the producer may be seen by \
                 readers of the other copies, or not: clone the tensors if you need isolation"
            );
        }
    }

    /// OW-11: a value through the driver that went straight to a consumer
    /// and did not arrive whole there (the consumer stored nothing) goes
    /// again from the driver's own copy, or as the error that copy holds,
    /// if the consumer still needs it; while the object is still pending,
    /// the consumer waits for it with the others (OW-4). Returns whether
    /// it did either.
    ///
    /// The same for a receive of any transport that its getter gave up
    /// (`cancelled`, TG-4): the consumer stored nothing.
    pub(super) fn deliver_again(
        &mut self,
        t: &InFlight,
        cancelled: bool,
        actors: &Actors,
        groups: &dyn GroupLookup,
    ) -> bool {
        let Some(e) = self.objects.get_mut(&t.object) else {
            return false;
        };
        if matches!(e.state, ObjState::Pending) {
            // Before its producer's reply (or death) reached the driver:
            // the consumer stored nothing, and waits with the others for
            // the value or its error (OW-4). Not settled: no copy is held.
            e.copies.remove(&t.consumer);
            if e.needs.contains_key(&t.consumer) && !e.waiting.iter().any(|(c, _)| *c == t.consumer)
            {
                e.waiting.push((t.consumer, t.call));
            }
            return true;
        }
        if e.sidedness() != Sidedness::ThroughDriver && !cancelled {
            return false;
        }
        e.copies.remove(&t.consumer);
        if e.needs.contains_key(&t.consumer) {
            self.deliver(t.object, t.consumer, None, actors, groups);
        } else {
            self.maybe_free(t.object);
        }
        true
    }
}

/// Sends the orders of a direct transfer of `e` to `consumer` as `xfer`
/// (the delivery first, then the send order for two-sided transports),
/// recording the copy. Returns the transfer to track, or `None` when it
/// could not start (the consumer then got the error instead: OW-6).
/// `large`: (the transfer is large, OW-15; a large one to the consumer
/// for another call is in flight: then the producer's order is left in
/// `held` instead of sent; the call it is for).
#[allow(clippy::too_many_arguments)]
pub(super) fn start_direct(
    e: &mut Entry,
    id: u64,
    xfer: u64,
    consumer: ActorId,
    value: WireValue,
    actors: &Actors,
    out: &mut Outbox,
    groups: &dyn GroupLookup,
    (large, behind, call): (bool, bool, Option<u64>),
    held: &mut Option<(ActorId, ToWorker, ToWorker)>,
) -> Option<(u64, InFlight)> {
    let sided = e.sidedness();
    let producer = e
        .producer
        .and_then(|p| actors.get(&p).map(|a| a.peer(p, e.transport.name())));
    // The consumer ends up holding either the value or an error.
    e.copies.insert(consumer, Copy::Held);
    if let (Some(p), Some(c)) = (&producer, actors.get(&consumer)) {
        // One-sided same-host transports: refuse another host before
        // anything moves, naming both ends.
        let same_host_only = e.transport.same_host_only();
        if same_host_only && !p.host.is_empty() && !c.host.is_empty() && p.host != c.host {
            let err = Error::Transport(rdt_transport::TransportError::with_peer(
                e.transport.name(),
                p,
                format!(
                    "{} moves tensors only between actors on one host; {} is on {} and {} on {}: use tcp (in a collective group) or object_store",
                    e.transport, p.name, p.host, c.name, c.host
                ),
            ));
            out.deliver_error(consumer, id, err);
            return None;
        }
    }
    let two_sided = sided == Sidedness::TwoSided;
    // OW-8: the group is looked up now, not only at submission.
    let group = match e.producer {
        Some(p) => match groups.group_for(e.transport.name(), id, p, consumer) {
            Ok(g) => g,
            Err(err) => {
                out.deliver_error(consumer, id, err);
                return None;
            }
        },
        None => None,
    };
    // The consumer's frame first: of the two ends of a two-sided transfer
    // its receive is the one that starts later (it frees, decodes and
    // allocates before it posts), and each end is written in the order
    // its connection was first used under the lock. Frames on different
    // connections have no order to keep.
    rdt_transport::trace::timeline("driver deliver", xfer);
    let msg = ToWorker::Deliver {
        object: id,
        value: Ok(Delivery {
            value,
            from: producer,
            xfer,
            group: group.map(|(g, prank, crank)| GroupRef {
                id: g,
                my_rank: crank,
                peer_rank: prank,
            }),
            ack_at_landing: large,
        }),
    };
    let order = match (two_sided, e.producer, actors.get(&consumer)) {
        (true, Some(p), Some(c)) => Some((
            p,
            ToWorker::SendTo {
                object: id,
                xfer,
                to: c.peer(consumer, e.transport.name()),
                group: group.map(|(g, prank, crank)| GroupRef {
                    id: g,
                    my_rank: prank,
                    peer_rank: crank,
                }),
            },
        )),
        _ => None,
    };
    match order {
        // OW-15: held, both ends at once (XF-3: every member's queue keeps
        // the driver's order, so no two transfers wait on each other).
        Some((p, order)) if behind => *held = Some((p, msg, order)),
        order => {
            let sent = out.send(consumer, &msg);
            rdt_transport::trace::timeline("driver deliver queued", xfer);
            if let Err(err) = sent {
                out.deliver_error(consumer, id, err); // OW-6
                return None;
            }
            if let Some((p, order)) = order {
                if !send_or_abort(out, p, &order, consumer, id, xfer) {
                    // OW-6: its failed acknowledgement finds no transfer
                    // (none is tracked), and the consumer holds the error.
                    return None;
                }
            }
        }
    }
    e.copies.insert(consumer, Copy::Receiving(xfer));
    tracing::debug!(
        xfer,
        object = id,
        transport = %e.transport,
        producer = ?e.producer,
        consumer,
        bytes = e_bytes(e),
        "transfer started"
    );
    Some((
        xfer,
        InFlight {
            object: id,
            producer: e.producer,
            consumer,
            transport: e.transport,
            two_sided,
            large,
            call,
            span: transfer_span(xfer, id, e.transport, e.producer, consumer, actors, false),
            started: std::time::Instant::now(),
        },
    ))
}

/// OW-15: a held transfer goes, both ends together: the consumer's
/// delivery, then its producer's send. A delivery that cannot go leaves
/// the consumer the error (OW-6), and the send is not made; the transfer
/// ends at its deadline.
pub(super) fn release_held(out: &mut Outbox, h: &HeldSend, consumer: ActorId, object: u64) {
    if let Err(err) = out.send(consumer, &h.deliver) {
        out.deliver_error(consumer, object, err);
        return;
    }
    send_or_abort(out, h.producer, &h.order, consumer, object, h.xfer);
}

/// Sends a two-sided transfer's `order` to its `producer`; if it cannot go,
/// the receive of `object` the consumer was delivered stops with the error
/// instead (OW-6). Returns whether it went.
pub(super) fn send_or_abort(
    out: &mut Outbox,
    producer: ActorId,
    order: &ToWorker,
    consumer: ActorId,
    object: u64,
    xfer: u64,
) -> bool {
    match out.send(producer, order) {
        Ok(()) => true,
        Err(error) => {
            out.send_small(
                consumer,
                &ToWorker::AbortTransfer {
                    object,
                    xfer,
                    error,
                },
            );
            false
        }
    }
}
