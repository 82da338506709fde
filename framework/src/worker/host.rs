//! The actix host of the user's actor: when each call runs.
//!
//! # Invariants
//! - **HO-1 Arguments before the turn.** A call's arguments are resolved
//!   (values unpacked, refs awaited in the store) before it takes its turn;
//!   a call waiting for a transfer never holds back a call behind it whose
//!   arguments are ready.
//! - **HO-2 Serial actors keep order.** An actor without concurrency
//!   options runs one call at a time: the first call in submission order
//!   whose arguments are ready. Calls that had to wait for an argument
//!   still run in submission order among themselves.
//! - **HO-3 Concurrent actors.** With `max_concurrency = N` (and named
//!   concurrency groups), up to N `&self` calls of the default group (and
//!   each group's own limit) run interleaved on the actor's thread and
//!   finish in any order. A `&mut self` call runs alone: it starts once
//!   nothing runs, and a ready one holds back every call submitted after
//!   it, so it is never starved.
//! - **HO-4 Borrows follow the schedule.** The actor lives in a `RefCell`;
//!   a `&mut self` call borrows it mutably only when HO-3 says it runs
//!   alone, so a borrow never fails.
//! - **HO-5 Panics.** A method's panic is caught and becomes the call's
//!   error; the actor keeps the state it had at the panic.
//! - **HO-6 No endless wait for oneself.** A method that runs alone (every
//!   call of a serial actor, a `&mut self` call) cannot wait for a call
//!   its own actor has not run: by HO-2 and HO-3 that call starts only
//!   after the method returns. Such a `get` or `wait` inside the method
//!   (polled within the method's own future) fails at once with
//!   `Error::WouldDeadlock`, as does a `wait_many` without a timeout that
//!   needs such a call; the call itself still runs afterwards. A task the
//!   method spawns is polled on its own and may wait.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use bytes::Bytes;
use futures::future::LocalBoxFuture;
use futures::FutureExt;
use rdt_transport::rt::hot::{self, hot};
use rdt_transport::{Blob, Sidedness};
use tracing::Instrument;

use super::{panic_message, Landed, Slot, StoredValue, WorkerShared};
use crate::actor::{Actor as RdtActor, CallArgs, Concurrency, MethodInfo};
use crate::error::{Error, Result};
use crate::protocol::{CallContext, CallMsg, ToDriver, WireArg, WireExported, WireValue};
use crate::transport::Transport;

/// Calls that may queue at one actor; beyond, a call fails at once with
/// a clear error rather than waiting unboundedly.
pub(super) const MAILBOX: usize = 1 << 20;

/// Hosts one user actor on the worker's actix system.
pub(super) struct Host<A: RdtActor> {
    actor: Rc<RefCell<A>>,
    shared: Arc<WorkerShared>,
    /// Calls submitted and not started, in submission order.
    queue: VecDeque<Queued>,
    running: Running,
    /// Per group (0: the default group): how many `&self` calls may run.
    limits: Vec<u32>,
    /// No concurrency options: every call runs alone (HO-2).
    serial: bool,
    next_seq: u64,
}

#[derive(Default)]
struct Running {
    /// A `&mut self` call (or any call of a serial actor) runs.
    exclusive: bool,
    /// Calls running, per group.
    per_group: Vec<u32>,
    total: u32,
}

struct Queued {
    seq: u64,
    msg: Header,
    info: MethodInfo,
    /// Had to wait for an argument (HO-2 orders these among themselves).
    waited: bool,
    /// `None` while an argument is still awaited.
    args: Option<Result<Resolved>>,
}

/// A call without its arguments.
struct Header {
    call: u64,
    method: u32,
    result: u64,
    transport: Transport,
    /// Its ref arguments, counted in `arg_uses` (WK-13).
    refs: Vec<u64>,
    /// The copies it may drop when it ends (WK-13, OW-12).
    release: Vec<u64>,
    /// Its trace and its caller's span.
    context: CallContext,
}

tokio::task_local! {
    /// The call this task runs, for the calls its method makes: they join
    /// its trace ([`current_call`]).
    static CURRENT_CALL: CallContext;
}

/// The context for a call made now: that of the call this task runs (its
/// trace, its span), if it runs one. A task the method spawned runs none.
pub(super) fn current_call() -> Option<CallContext> {
    CURRENT_CALL.try_with(|c| *c).ok()
}

/// A call's arguments, ready for the method.
struct Resolved {
    values: Vec<(Bytes, Arc<rdt_transport::TensorList>)>,
    refs: Vec<u64>,
}

impl<A: RdtActor> Host<A> {
    pub(super) fn new(actor: A, shared: Arc<WorkerShared>) -> Self {
        let Concurrency { max, groups } = A::__CONCURRENCY;
        let mut limits = vec![max.max(1)];
        limits.extend(groups.iter().map(|(_, n)| (*n).max(1)));
        Host {
            actor: Rc::new(RefCell::new(actor)),
            shared,
            queue: VecDeque::new(),
            running: Running {
                per_group: vec![0; limits.len()],
                ..Running::default()
            },
            serial: max <= 1 && groups.is_empty(),
            limits,
            next_seq: 0,
        }
    }

    /// Starts every queued call that may run now (HO-1 … HO-3).
    fn pump(&mut self, ctx: &mut actix::Context<Self>) {
        let mut i = 0;
        // HO-2: an earlier call of a serial actor is still waiting for an
        // argument, so a later one that waited too must not pass it.
        let mut waiter_ahead = false;
        while i < self.queue.len() {
            let q = &self.queue[i];
            if q.args.is_none() {
                waiter_ahead |= q.waited;
                i += 1;
                continue;
            }
            if self.serial && q.waited && waiter_ahead {
                i += 1;
                continue;
            }
            let exclusive = self.serial || q.info.exclusive;
            let group = q.info.group as usize;
            let may_start = if exclusive {
                self.running.total == 0
            } else {
                !self.running.exclusive && self.running.per_group[group] < self.limits[group]
            };
            if may_start {
                let q = self.queue.remove(i).expect("index checked above");
                self.start(q, exclusive, ctx);
                continue;
            }
            if exclusive {
                // HO-3: a ready exclusive call holds back what follows.
                break;
            }
            i += 1;
        }
    }

    fn start(&mut self, q: Queued, exclusive: bool, ctx: &mut actix::Context<Self>) {
        let group = q.info.group as usize;
        self.running.total += 1;
        self.running.per_group[group] += 1;
        self.running.exclusive = exclusive;
        // The child of the driver's span of this call (`caller_span`, in
        // the driver's process), in its trace.
        let span = tracing::info_span!(
            "call",
            call = q.msg.call,
            actor = %self.shared.name,
            method = q.info.name,
            trace = q.msg.context.trace,
            caller_span = q.msg.context.caller_span,
        );
        let calls_made_here = CallContext::under(q.msg.context.trace, &span);
        let run = CURRENT_CALL
            .scope(
                calls_made_here,
                run_and_reply::<A>(
                    self.actor.clone(),
                    self.shared.clone(),
                    ctx.address(),
                    q,
                    exclusive,
                ),
            )
            .instrument(span);
        rdt_transport::trace::timeline("call spawning", 0);
        ctx.spawn(run.into_actor(self).map(move |(), this, ctx| {
            this.running.total -= 1;
            this.running.per_group[group] -= 1;
            this.running.exclusive = false;
            this.pump(ctx);
        }));
    }
}

impl<A: RdtActor> actix::Actor for Host<A> {
    type Context = actix::Context<Self>;
}

/// A call from the control loop.
pub(super) struct Invoke(pub(super) CallMsg);

impl actix::Message for Invoke {
    type Result = ();
}

impl<A: RdtActor> Handler<Invoke> for Host<A> {
    type Result = ();

    fn handle(&mut self, Invoke(msg): Invoke, ctx: &mut Self::Context) {
        rdt_transport::trace::timeline("call on the actor's thread", msg.call);
        let seq = self.next_seq;
        self.next_seq += 1;
        let info = A::__method_info(msg.method).unwrap_or(MethodInfo {
            name: "<unknown method>",
            exclusive: true,
            group: 0,
        });
        let header = Header {
            call: msg.call,
            method: msg.method,
            result: msg.result,
            transport: msg.transport,
            refs: msg.ref_args().collect(),
            release: msg.release,
            context: msg.context,
        };
        // Fast path: every argument is here (inline, or in the store).
        let mut resolving = resolve(self.shared.clone(), msg.args).boxed_local();
        let args = (&mut resolving).now_or_never();
        rdt_transport::trace::timeline("call arguments asked", msg.call);
        let waited = args.is_none();
        self.queue.push_back(Queued {
            seq,
            msg: header,
            info,
            waited,
            args,
        });
        if waited {
            // HO-1: awaited off the queue; the call takes its turn once
            // every argument is here.
            ctx.spawn(resolving.into_actor(self).map(move |args, this, ctx| {
                rdt_transport::trace::timeline("call arguments here", seq);
                if let Some(q) = this.queue.iter_mut().find(|q| q.seq == seq) {
                    q.args = Some(args);
                }
                this.pump(ctx);
            }));
        }
        self.pump(ctx);
    }
}

/// Unpacks inline arguments and waits for refs in the store.
async fn resolve(shared: Arc<WorkerShared>, args: Vec<WireArg>) -> Result<Resolved> {
    let mut values = Vec::with_capacity(args.len());
    let mut refs = Vec::new();
    for a in args {
        match a {
            // Large ones may still be arriving (cut-through).
            WireArg::Value(v) => {
                let (data, tensors) = super::unpack_inline(&shared.device_map, &v).await?;
                values.push((data, Arc::new(tensors.into())))
            }
            WireArg::Ref(id) => {
                refs.push(id);
                values.push(resolve_ref(&shared, id).await?);
            }
            WireArg::RefOn(id, place) => {
                refs.push(id);
                let (data, tensors) = resolve_ref(&shared, id).await?;
                // The driver refused this before ordering the transfer
                // (every spawned actor says what it sees); checked again
                // once the argument is here, so its receive settles first
                // (XF-5).
                place.usable_here().map_err(|reason| Error::NoSuchDevice {
                    receiver: shared.name.to_string(),
                    reason,
                })?;
                let placed = place.put_all(tensors.to_vec()).map_err(|e| {
                    Error::dependency(
                        id,
                        Error::Tensor(format!("putting the argument's tensor in {place}: {e}")),
                    )
                })?;
                values.push((data, Arc::new(placed.into())));
            }
        }
    }
    Ok(Resolved { values, refs })
}

/// A ref argument's value once it is in the store.
async fn resolve_ref(
    shared: &WorkerShared,
    id: u64,
) -> Result<(Bytes, Arc<rdt_transport::TensorList>)> {
    // Hot: the delivery usually comes within the window (the producer's
    // reply and the driver's `Deliver` are a few socket hops away); a
    // thread that parked here pays a scheduler wake-up on the call's
    // critical path.
    match hot(shared.arrival(id)).await {
        Slot::Ready(v) => {
            rdt_transport::trace::timeline("argument resolved", id);
            Ok((v.data, v.tensors))
        }
        Slot::Failed(e) => Err(Error::dependency(id, e)),
    }
}

/// Runs one call and sends its result to the driver from this thread (no
/// hop back to the control loop).
async fn run_and_reply<A: RdtActor>(
    actor: Rc<RefCell<A>>,
    shared: Arc<WorkerShared>,
    addr: actix::Addr<Host<A>>,
    mut q: Queued,
    exclusive: bool,
) {
    let call = q.msg.call;
    let result_id = q.msg.result;
    let refs = std::mem::take(&mut q.msg.refs);
    let release = std::mem::take(&mut q.msg.release);
    let t0 = std::time::Instant::now();
    rdt_transport::trace::timeline("call running", call);
    // Invariant 6 of the worker: the frees before this call took effect.
    shared.drops.settled().await;
    rdt_transport::trace::timeline("call start", call);
    // CL-2: the refs in the return value, released after the reply.
    let held = Rc::new(RefCell::new(Vec::new()));
    let (result, resolved) = match q.args.expect("only calls with their arguments start") {
        Ok(args) => {
            let r = run_call::<A>(&actor, &shared, q.msg, q.info, args, exclusive, &held).await;
            let resolved = !matches!(r, Err(Error::Dependency { .. }));
            (r, resolved)
        }
        Err(e) => (Err(e), false),
    };
    rdt_transport::trace::timeline("call done", call);
    // WK-13: out of the store before the `CallDone` that names them (a
    // delivery the driver sends again after reading it must find the
    // slot free); dropped after it.
    let released = shared.uses_end(&refs, if resolved { &release } else { &[] });
    let released_ids: Vec<u64> = released.iter().map(|(id, _)| *id).collect();
    rdt_transport::trace::timeline("call uses ended", call);
    // HO-6: it ran (a call of this actor to itself, or any other).
    shared.self_calls.lock().remove(&result_id);
    let sent = std::time::Instant::now();
    tracing::debug!(
        micros = t0.elapsed().as_micros() as u64,
        ok = result.is_ok(),
        "call done"
    );
    // Straight to the consumers the driver named first (OW-9): their
    // receive starts while the reply is on its way.
    let delivered = super::straight::deliver_result(&shared, result_id, &result);
    // Tests hold the reply back after a straight delivery went out.
    #[cfg(feature = "failpoints")]
    if !delivered.is_empty() {
        fail::fail_point!("rdt::reply_after_straight");
    }
    rdt_transport::trace::timeline("call reply ready", call);
    // Tests hold any reply back (past a transfer deadline, say).
    #[cfg(feature = "failpoints")]
    fail::fail_point!("rdt::call_done");
    if let Err(e) = shared.tx.send(&ToDriver::CallDone {
        call,
        result,
        delivered: delivered.clone(),
        released: released_ids.clone(),
        resolved,
    }) {
        // Too large for a frame: the call fails instead.
        let _ = shared.tx.send(&ToDriver::CallDone {
            call,
            result: Err(e),
            delivered,
            released: released_ids,
            resolved,
        });
    }
    drop(held);
    shared.drop_released(released);
    rdt_transport::trace::timeline("call done sent", sent.elapsed().as_micros() as u64);
    // Keep this thread awake for the hot window, or until the next call
    // arrives: a call that finds it asleep pays the wake-up, and one that
    // finds it listening costs the control loop no wake-up at all
    // (`handoff_queue.rs`).
    let window = hot::window();
    if !window.is_zero() {
        actix::spawn(listen(shared, addr, window));
    }
}

// HO-4: the borrow is held across the method's awaits on purpose; the
// schedule, not the borrow, keeps calls apart, so it never fails.
#[allow(clippy::await_holding_refcell_ref)]
async fn run_call<A: RdtActor>(
    actor: &RefCell<A>,
    shared: &WorkerShared,
    msg: Header,
    info: MethodInfo,
    args: Resolved,
    exclusive: bool,
    held: &Rc<RefCell<Vec<crate::refs::client::AnyRef>>>,
) -> Result<WireValue> {
    let method = info.name;
    // WK-5: arguments whose bytes are still landing; the method runs now
    // (its kernels wait on the GPU), its result waits for the landing.
    // WK-9: the call acknowledges those receives itself where their task
    // has not yet (a `CallDone` past argument resolution settles them in
    // the driver, XF-5): one frame instead of two written at once from
    // two threads.
    let landing: Vec<(u64, Landed, bool)> = {
        let l = shared.landing.lock();
        args.refs
            .iter()
            .filter_map(|id| l.get(id).map(|f| (*id, f.clone(), f.take_ack())))
            .collect()
    };
    // However the call ends, the receives it took on are its to
    // acknowledge from here on: their tasks stop waiting for it.
    let _ended = EndsTakenAcks(&landing);
    let ours = landing.iter().filter(|(_, _, ours)| *ours).count() as u64;
    shared
        .acks_by_calls
        .fetch_add(ours, std::sync::atomic::Ordering::Relaxed);
    let call_args = CallArgs {
        actor: shared.name.clone(),
        method,
        values: args.values,
        held: held.clone(),
    };
    let ran = if exclusive {
        // HO-4: nothing else runs, so nothing else borrows.
        let mut a = actor.borrow_mut();
        dispatch(A::__dispatch(&mut a, msg.method, call_args), true).await
    } else {
        let a = actor.borrow();
        dispatch(A::__dispatch_shared(&a, msg.method, call_args), false).await
    };
    rdt_transport::trace::timeline("method returned", msg.call);
    // A panic is the call's result once its landings are waited for, as
    // any other (XF-5: its `CallDone` settles their receives).
    let payload = ran.unwrap_or_else(|p| {
        Err(Error::Panic {
            actor: shared.name.to_string(),
            method: method.to_string(),
            message: panic_message(&p),
        })
    });
    let mut failed = None;
    for (object, l, _) in &landing {
        if let Err(e) = l.landing.clone().await {
            failed.get_or_insert((*object, e));
        }
    }
    if let Some((object, e)) = failed {
        // Not past its arguments after all (the driver does not settle
        // for it): the receives it took on are acknowledged here, each
        // with how it ended.
        for (object, l, ours) in &landing {
            if *ours {
                let result = l.landing.clone().await.map_err(Error::from);
                let _ = shared.tx.send(&ToDriver::Received {
                    object: *object,
                    xfer: l.xfer,
                    result,
                });
            }
        }
        return Err(Error::dependency(object, e.into()));
    }
    let payload = payload?;
    let refs: Vec<u64> = held.borrow().iter().map(|r| r.id).collect();
    if payload.tensors.is_empty() {
        return Ok(WireValue {
            data: Blob::new(payload.data),
            transport: Transport::ObjectStore,
            exported: Default::default(),
            refs,
        });
    }
    let transport = msg.transport;
    let inst = transport.instance()?;
    for (i, t) in payload.tensors.iter().enumerate() {
        if let Err(e) = inst.check_device(t.device()) {
            return Err(Error::Transport(rdt_transport::TransportError {
                message: format!(
                    "tensor #{i} ({} {:?}, on {}) of the value {}.{method} returned: {}",
                    t.dtype(),
                    t.shape(),
                    t.device(),
                    shared.name,
                    e.message
                ),
                ..e
            }));
        }
    }
    let exported = inst.export(msg.result, &payload.tensors).await?;
    rdt_transport::trace::timeline("exported", msg.call);
    if inst.sidedness() != Sidedness::ThroughDriver {
        shared.store.insert(
            msg.result,
            Slot::Ready(StoredValue {
                data: payload.data.clone(),
                tensors: Arc::new(payload.tensors.into()),
                transport,
                produced: true,
            }),
        );
    }
    Ok(WireValue {
        data: Blob::new(payload.data),
        transport,
        exported: WireExported::new(exported)?,
        refs,
    })
}

/// Marks the receives a call took on (WK-9) as the call's to acknowledge
/// when it ends, however it ends.
struct EndsTakenAcks<'a>(&'a [(u64, Landed, bool)]);

impl Drop for EndsTakenAcks<'_> {
    fn drop(&mut self) {
        for (_, l, ours) in self.0 {
            if *ours {
                l.end_call();
            }
        }
    }
}

/// HO-5: a panic in the method becomes an error, not the worker's end.
async fn dispatch(
    f: LocalBoxFuture<'_, Result<rdt_transport::value::Payload>>,
    alone: bool,
) -> std::result::Result<Result<rdt_transport::value::Payload>, Box<dyn std::any::Any + Send>> {
    AssertUnwindSafe(MethodPolls { f, alone })
        .catch_unwind()
        .await
}

thread_local! {
    /// Set while this thread polls the future of a method that runs alone
    /// (HO-6).
    static IN_METHOD_ALONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Is this thread polling a method that runs alone (HO-6)?
pub(super) fn in_method_that_runs_alone() -> bool {
    IN_METHOD_ALONE.with(|c| c.get())
}

/// A method's future, marking the thread while it is polled (HO-6).
struct MethodPolls<F> {
    f: F,
    alone: bool,
}

impl<F: std::future::Future + Unpin> std::future::Future for MethodPolls<F> {
    type Output = F::Output;

    fn poll(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let alone = self.alone;
        let before = IN_METHOD_ALONE.with(|c| c.replace(alone));
        // Restored however the poll ends (a panic included).
        struct Restore(bool);
        impl Drop for Restore {
            fn drop(&mut self) {
                IN_METHOD_ALONE.with(|c| c.set(self.0));
            }
        }
        let _restore = Restore(before);
        std::pin::Pin::new(&mut self.f).poll(cx)
    }
}

/// The control loop's side: `call` to the actor, queued for its listener
/// when one is registered, else through the mailbox.
pub(super) fn hand_over<A: RdtActor>(shared: &WorkerShared, addr: &Addr<Host<A>>, call: CallMsg) {
    let mut s = shared.handoff.state.lock();
    s.arrived += 1;
    if s.listeners > 0 {
        s.calls.push_back(call);
        s.queued += 1;
        return;
    }
    drop(s);
    invoke(shared, addr, call);
}

/// The actor's side, after a call: keeps its thread awake for `window`,
/// or until the next call arrived, moving queued calls into the mailbox
/// (HF-2). Runs on the actor's thread.
pub(super) async fn listen<A: RdtActor>(
    shared: Arc<WorkerShared>,
    addr: Addr<Host<A>>,
    window: Duration,
) {
    let h = &shared.handoff.state;
    let seen = {
        let mut s = h.lock();
        s.listeners += 1;
        s.arrived
    };
    let t0 = Instant::now();
    loop {
        {
            let mut s = h.lock();
            // Moved under the lock: a call the control loop sends straight
            // once no listener is left comes after these (HF-1).
            for call in std::mem::take(&mut s.calls) {
                invoke(&shared, &addr, call);
            }
            if s.arrived != seen || t0.elapsed() >= window {
                s.listeners -= 1;
                return;
            }
        }
        // Nothing registers a waker here (the control loop wakes nobody):
        // the thread yields to its other tasks and looks again.
        tokio::task::yield_now().await;
    }
}

/// The mailbox, or the call's failure if it refuses (HF-3).
pub(super) fn invoke<A: RdtActor>(shared: &WorkerShared, addr: &Addr<Host<A>>, call: CallMsg) {
    let id = call.call;
    let result = call.result;
    let straight = call.transport.sidedness() != Sidedness::TwoSided;
    if let Err(e) = addr.try_send(Invoke(call)) {
        if straight {
            shared.straight.close_call(result);
        }
        let why = e.to_string();
        // WK-13: it ends here, having taken nothing.
        let Invoke(call) = e.into_inner();
        let refs: Vec<u64> = call.ref_args().collect();
        let _ = shared.uses_end(&refs, &[]);
        let _ = shared.tx.send(&ToDriver::CallDone {
            call: id,
            result: Err(Error::Protocol(format!(
                "actor mailbox refused the call: {why}"
            ))),
            delivered: Vec::new(),
            released: Vec::new(),
            resolved: false,
        });
    }
}
