//! Submitting calls: staging a call's result and arguments under the lock, sending it, ending it.

use super::*;

/// A call whose result and arguments are recorded, not sent yet
/// ([`Inner::stage_call`]).
pub(super) struct StagedCall {
    pub(super) call: u64,
    pub(super) actor: u64,
    pub(super) msg: ToWorker,
}

impl Inner {
    pub(crate) fn submit(
        &self,
        actor: u64,
        method: u32,
        method_name: &str,
        args: Vec<ArgOut>,
        transport: Transport,
    ) -> u64 {
        let id = self.next_id();
        let (wire_args, early) = crate::refs::object_ref::wire_args(&args);
        let msg = SubmitMsg {
            actor,
            method,
            method_name: String::new(),
            args: wire_args,
            result: id,
            transport,
            error: early,
            context: None,
        };
        let mut guard = self.lock();
        let mut staged = self.stage_call(&mut guard, msg, method_name);
        let orders_to_others = staged
            .as_ref()
            .is_some_and(|s| guard.table.outbox.waits_besides(s.actor));
        if orders_to_others {
            self.orders_first.fetch_add(1, Ordering::Relaxed);
            // The transfers this call needs were ordered on both ends (a
            // delivery to the callee, a send order to a producer: a
            // two-sided transport): their frames are written now, before
            // the call is encoded and queued behind them, so both ends
            // start moving bytes microseconds earlier (the call itself
            // waits for its arguments there anyway). Orders to the callee
            // alone (a one-sided read) go with the call: a write of their
            // own cost a 4 KiB nixl pass 1-1.7 us. The lock is released
            // for the writes (invariant 2); a death meanwhile ended the
            // call (`on_death`), and then it is not sent.
            drop(guard);
            guard = self.lock();
            staged = staged.filter(|s| guard.calls.by_id.contains_key(&s.call));
        }
        if let Some(s) = staged {
            self.send_call(&mut guard, s);
        }
        rdt_transport::trace::timeline("driver submitted", 0);
        drop(guard);
        // Releases the arguments' refs after `need` and `hold` counted
        // them (outside the lock: dropping a ref takes it).
        drop(args);
        id
    }

    /// A call submitted by the driver or by an actor: its result becomes
    /// a pending object (failed at once if it cannot run), its arguments
    /// are needed by the callee, and the call goes out.
    pub(super) fn submit_locked(&self, st: &mut State, msg: SubmitMsg, method_name: &str) {
        if let Some(s) = self.stage_call(st, msg, method_name) {
            self.send_call(st, s);
        }
    }

    /// The first half of [`submit_locked`](Self::submit_locked): the
    /// result becomes a pending object, the arguments are needed by the
    /// callee (which orders their transfers) and the call is pending.
    /// Returns the call to send, or `None` if it failed at once.
    pub(super) fn stage_call(
        &self,
        st: &mut State,
        msg: SubmitMsg,
        method_name: &str,
    ) -> Option<StagedCall> {
        let SubmitMsg {
            actor,
            method,
            method_name: _,
            args: wire_args,
            result: id,
            transport,
            error,
            context,
        } = msg;
        let call = self.next_id();
        // A call the driver's program made starts a trace; one an actor
        // made while it ran a call joins that call's.
        let trace = context.map_or(call, |c| c.trace);
        rdt_transport::trace::timeline("driver submit", call);
        let mut arg_ids = Vec::new();
        let mut nested = Vec::new();
        let mut places = Vec::new();
        for a in &wire_args {
            match a {
                WireArg::Ref(r) => arg_ids.push(*r),
                WireArg::RefOn(r, place) => {
                    arg_ids.push(*r);
                    places.push(*place);
                }
                WireArg::Value(v) => nested.extend_from_slice(&v.refs),
            }
        }
        let dead = match st.actors.get(&actor) {
            None => Some(Error::Protocol(format!("no actor with id {actor}"))),
            Some(a) => a.dead.as_ref().map(|d| Error::ActorDied {
                actor: a.name.clone(),
                detail: d.clone(),
            }),
        };
        let early = error
            .or(dead)
            .or_else(|| check_places(st, actor, &places))
            .or_else(|| check_groups(st, actor, &arg_ids));
        if let Some(e) = early {
            st.table.insert_done(id, Some(actor), ObjState::Failed(e));
            return None;
        }
        st.table.insert_pending(id, actor, transport);
        st.table.hold(&nested);
        for &a in &arg_ids {
            let groups = GroupView {
                groups: &st.groups,
                actors: &st.actors,
            };
            st.table.need(a, actor, Some(call), &st.actors, &groups);
        }
        rdt_transport::trace::timeline("driver arguments needed", call);
        // OW-12: the callee drops these copies itself when the call ends
        // (no `Free` on the next call's path).
        let release: Vec<u64> = arg_ids
            .iter()
            .copied()
            .filter(|&a| st.table.releasable(a, actor))
            .collect();
        let span = tracing::info_span!(
            parent: None,
            "call",
            call,
            actor = %actor_name(&st.actors, actor),
            method = method_name,
            result = id,
            trace,
            caller_span = tracing::field::Empty,
            outcome = tracing::field::Empty,
        );
        if let Some(c) = context {
            span.record("caller_span", c.caller_span);
        }
        let context = CallContext::under(trace, &span);
        st.calls.insert(
            call,
            PendingCall {
                actor,
                result: id,
                args: arg_ids,
                nested,
                span,
            },
        );
        tracing::trace!(call, method = method_name, "submit");
        rdt_transport::trace::timeline("driver call pending", call);
        Some(StagedCall {
            call,
            actor,
            msg: ToWorker::Call(CallMsg {
                call,
                method,
                args: wire_args,
                result: id,
                transport,
                release,
                context,
            }),
        })
    }

    /// The second half of [`submit_locked`](Self::submit_locked): the
    /// staged call goes out (behind the frames of the transfers it
    /// needs), and the transfers it started are watched.
    pub(super) fn send_call(&self, st: &mut State, staged: StagedCall) {
        let StagedCall { call, actor, msg } = staged;
        if let Some(reader) = st.readers.get(&actor) {
            // After the call's frames are written, not before.
            st.after_unlock.notify(reader);
        }
        rdt_transport::trace::timeline("driver call sending", call);
        if let Err(e) = st.table.outbox.send(actor, &msg) {
            // Too large to send: the call fails, nothing waits. It
            // never reached its actor: its arguments' receives settle
            // by their own acknowledgements (XF-5).
            let pc = st.calls.remove(&call).expect("staged above");
            end_call(st, pc, Err(e), false, &[], &[]);
        }
        self.sync_transfers(st);
    }
}

/// A call that puts an argument on a CUDA device its callee's process
/// lacks (`ObjectRef::to_device`), refused before any transfer is ordered;
/// the callee checks again where it has not said what it sees.
fn check_places(st: &State, actor: u64, places: &[Place]) -> Option<Error> {
    let a = st.actors.get(&actor)?;
    let seen = a.cuda_devices?;
    places.iter().find_map(|p| match *p {
        Place::Cuda(o) if o >= seen => Some(Error::NoSuchDevice {
            receiver: a.name.clone(),
            reason: format!(
                "an argument was asked onto {p}, and its process sees {seen} CUDA device(s)"
            ),
        }),
        _ => None,
    })
}

/// A call ended (its reply, its callee's death, or a send that failed):
/// its result is recorded, its arguments and the refs in them released.
/// `resolved`: the call got past argument resolution (XF-5);
/// `delivered`: the transfers its producer carried out itself
/// (`DeliverTo`, PD-1); `released`: the argument copies its callee dropped
/// itself (OW-12).
pub(super) fn end_call(
    st: &mut State,
    pc: PendingCall,
    outcome: Result<WireValue>,
    resolved: bool,
    delivered: &[u64],
    released: &[u64],
) {
    let groups = GroupView {
        groups: &st.groups,
        actors: &st.actors,
    };
    pc.span
        .record("outcome", if outcome.is_ok() { "ok" } else { "err" });
    st.table.counts.call_ended(outcome.is_ok());
    let ended = crate::owner::CallEnd {
        outcome,
        resolved,
        delivered,
        released,
    };
    st.table
        .call_done(pc.result, ended, pc.actor, &pc.args, &st.actors, &groups);
    st.table.unhold(&pc.nested);
}

pub(super) fn err_actor(e: &Error) -> &str {
    match e {
        Error::ActorDied { actor, .. } => actor,
        _ => "?",
    }
}
