//! What the driver tells the table: a call's end, a receive's
//! acknowledgement, a failed send, an abort, a death (OW-3, OW-5, OW-6).

use super::*;

impl OwnerTable {
    /// A call finished: record its result and release its arguments
    /// (see [`CallEnd`]).
    pub fn call_done(
        &mut self,
        result: u64,
        ended: CallEnd<'_>,
        consumer: ActorId,
        args: &[u64],
        actors: &Actors,
        groups: &dyn GroupLookup,
    ) {
        let CallEnd {
            outcome,
            resolved,
            delivered,
            released,
        } = ended;
        if let Some(e) = self.objects.get_mut(&result) {
            if matches!(e.state, ObjState::Pending) {
                e.state = match outcome {
                    Ok(v) => {
                        e.transport = v.transport;
                        e.nested = v.refs.clone();
                        ObjState::Ready(v)
                    }
                    Err(err) => ObjState::Failed(err),
                };
                // OW-14: a getter handed the value needs no lock to go
                // on; woken now, it runs while this thread settles the
                // call's transfers and releases its arguments below.
                // One that looks the value up waits for the unlock.
                // Cloned only for those waiting: most replies have none.
                let settled = || e.state.settled().expect("set above");
                for g in std::mem::take(&mut e.getters) {
                    match g {
                        Getter::Value(tx) => {
                            self.handed_values += 1;
                            let _ = tx.send(settled());
                        }
                        Getter::Signal(tx) => self.woken.push(Woken(tx)),
                    }
                }
                let nested = e.nested.clone();
                let waiting = std::mem::take(&mut e.waiting);
                let straight = std::mem::take(&mut e.straight);
                self.hold(&nested);
                // OW-9: the orders carried out run against their deadline
                // from now; the others are withdrawn, and the driver
                // delivers as for a consumer that waited.
                // Each order answered wakes those waiting for transfers to
                // settle (`ended`; `end_transfer` notes the withdrawn ones).
                self.straight_orders -= straight.len();
                for (c, xfer) in straight {
                    if !self.transfers.contains_key(&xfer) {
                        // Acknowledged already, or aborted (the consumer
                        // died): nothing left to do.
                        self.ended.push(xfer);
                        continue;
                    }
                    if delivered.contains(&xfer) {
                        self.started.push(xfer);
                        self.ended.push(xfer);
                        continue;
                    }
                    self.end_transfer(xfer, Outcome::NotSent, actors);
                    let e = self.objects.get_mut(&result).expect("looked up above");
                    if e.copies.get(&c) == Some(&Copy::Receiving(xfer)) {
                        e.copies.remove(&c);
                    }
                    if e.needs.contains_key(&c) {
                        self.deliver(result, c, None, actors, groups);
                    }
                }
                for (c, call) in waiting {
                    self.deliver(result, c, call, actors, groups);
                }
            }
        }
        rdt_transport::trace::timeline("driver call result stored", result);
        // XF-5: a call that got past argument resolution received every
        // argument; its receives are settled now, without waiting for their
        // acknowledgements (which follow on the same connection). The
        // consumer still needs each argument here, so settling frees
        // nothing yet: the loop below does.
        if resolved {
            for &a in args {
                let copy = self
                    .objects
                    .get(&a)
                    .and_then(|e| e.copies.get(&consumer).copied());
                if let Some(Copy::Receiving(xfer)) = copy {
                    if let Some(t) = self.end_transfer(xfer, Outcome::Done, actors) {
                        self.settle(&t);
                    }
                }
            }
        }
        rdt_transport::trace::timeline("driver call receives settled", result);
        // OW-12: those copies are gone from the consumer's store already.
        let released: Vec<u64> = if resolved {
            released
                .iter()
                .copied()
                .filter(|a| args.contains(a))
                .collect()
        } else {
            Vec::new()
        };
        for &a in &released {
            let copy = self
                .objects
                .get_mut(&a)
                .and_then(|e| e.copies.remove(&consumer));
            if let Some(Copy::Receiving(xfer)) = copy {
                // Received (the call ran with it): settled with it.
                self.end_transfer(xfer, Outcome::Done, actors);
            }
            self.released_by_callees += u64::from(copy.is_some());
        }
        self.unneed(args, consumer);
        rdt_transport::trace::timeline("driver call arguments released", result);
        // A call submitted since still needs a released copy: it goes again.
        for &a in &released {
            let again = self.objects.get(&a).is_some_and(|e| {
                e.needs.contains_key(&consumer) && !e.copies.contains_key(&consumer)
            });
            if !again {
                continue;
            }
            self.delivered_again += 1;
            let e = self.objects.get_mut(&a).expect("looked up above");
            if matches!(e.state, ObjState::Pending) {
                // Received straight from its producer, whose reply has
                // not come: delivered with the waiting ones (OW-4).
                if !e.waiting.iter().any(|(c, _)| *c == consumer) {
                    e.waiting.push((consumer, None));
                }
            } else {
                self.deliver(a, consumer, None, actors, groups);
            }
        }
        self.maybe_free(result);
    }

    /// The consumer acknowledged transfer `xfer` (done or failed). Returns
    /// the transfer, if it was still in flight.
    pub fn received(
        &mut self,
        xfer: u64,
        from: ActorId,
        result: &Result<(), Error>,
        actors: &Actors,
        groups: &dyn GroupLookup,
    ) -> Option<InFlight> {
        let Some(t) = self.transfers.get(&xfer) else {
            // Aborted before the ack: the copy is already `Held` (an
            // `AbortTransfer` crossed a finished receive) and is freed with
            // the rest; nothing to do.
            return None;
        };
        if t.consumer != from {
            tracing::warn!("actor {from} acknowledged transfer {xfer}, which is not its own");
            return None;
        }
        // A producer whose send is still held never heard of it (OW-15).
        let held = self.send_is_held(from, xfer);
        let outcome = if result.is_ok() {
            Outcome::Done
        } else {
            Outcome::Failed
        };
        let t = self
            .end_transfer(xfer, outcome, actors)
            .expect("looked up above");
        // TG-4: a receive its getter gave up stored nothing either.
        let cancelled = matches!(result, Err(Error::Cancelled { .. }));
        if result.is_err() && self.deliver_again(&t, cancelled, actors, groups) {
            return Some(t);
        }
        if let (Err(e), true, Some(p), false) = (result, t.two_sided, t.producer, held) {
            // The producer may still be sending into a receive that gave up.
            self.outbox.send_small(
                p,
                &ToWorker::AbortTransfer {
                    object: t.object,
                    xfer,
                    error: e.clone(),
                },
            );
        }
        self.settle(&t);
        Some(t)
    }

    /// The producer's send of `xfer` failed: the consumer's receive is
    /// aborted with that error (it acknowledges, which settles the copy).
    pub fn send_failed(&mut self, xfer: u64, error: Error) -> Option<InFlight> {
        let t = self.transfers.get(&xfer)?.clone();
        self.outbox.send_small(
            t.consumer,
            &ToWorker::AbortTransfer {
                object: t.object,
                xfer,
                error,
            },
        );
        Some(t)
    }

    /// `xfer`'s deadline passed (or an end of it died): both ends are told
    /// to stop, and the copy is settled now, without waiting for an ack
    /// that may never come.
    pub fn abort(&mut self, xfer: u64, error: Error, actors: &Actors) -> Option<InFlight> {
        // A producer whose send is still held never heard of it (OW-15).
        let held = self
            .transfers
            .get(&xfer)
            .is_some_and(|t| self.send_is_held(t.consumer, xfer));
        let t = self.end_transfer(xfer, Outcome::Aborted, actors)?;
        if held {
            // Neither end heard of it (OW-15): the consumer, whose call
            // may wait for it, gets the error as the value.
            self.outbox.deliver_error(t.consumer, t.object, error);
        } else {
            let msg = ToWorker::AbortTransfer {
                object: t.object,
                xfer,
                error,
            };
            self.outbox.send_small(t.consumer, &msg);
            if let (true, Some(p)) = (t.two_sided, t.producer) {
                self.outbox.send_small(p, &msg);
            }
        }
        self.settle(&t);
        Some(t)
    }

    /// OW-5.
    pub fn actor_died(&mut self, actor: ActorId, err: &Error, actors: &Actors) {
        // Transfers with the dead actor at either end; except a value
        // through the driver that its dead producer delivered straight
        // (it keeps its copy, OW-11): the consumer's receive ends by
        // itself (the link closed with the producer), and a failed one is
        // delivered again from the driver's copy.
        let objects = &self.objects;
        let kept_by_driver = |t: &InFlight| {
            objects.get(&t.object).is_some_and(|e| {
                e.sidedness() == Sidedness::ThroughDriver
                    && matches!(&e.state, ObjState::Ready(v) if v.lost().is_none())
            })
        };
        let ended: Vec<u64> = self
            .transfers
            .iter()
            .filter(|(_, t)| {
                t.consumer == actor || (t.producer == Some(actor) && !kept_by_driver(t))
            })
            .map(|(x, _)| *x)
            .collect();
        for xfer in ended {
            self.abort(xfer, err.clone(), actors);
        }
        self.forget_warm(actor);
        let ids: Vec<u64> = self.objects.keys().copied().collect();
        for id in ids {
            let e = self.objects.get_mut(&id).expect("listed above");
            // A dead consumer holds nothing any more.
            e.copies.remove(&actor);
            if e.producer == Some(actor)
                && matches!(e.state, ObjState::Ready(_))
                && e.sidedness() != Sidedness::ThroughDriver
            {
                e.state = ObjState::Failed(err.clone());
                // Holders whose call still waits see the death (a store
                // never replaces received data by a late error).
                for (&h, _) in e.copies.iter() {
                    self.outbox.deliver_error(h, id, err.clone());
                }
            }
            self.maybe_free(id);
        }
    }
}
