//! What runs under the driver's state lock: nothing a transport does.
//!
//! A transport's `release` of an object the driver held itself
//! (`put_with`) and its `peer_gone` of a dead actor may take their time
//! (NIXL deregisters memory, UCX disconnects) or call back into the
//! runtime; run under the state lock, they stall every message the driver
//! handles meanwhile, and one that takes the lock deadlocks.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use rdt::data::registry::{ProcessContext, Registration};
use rdt::data::transport::{ObjectKey, TransferCtx};
use rdt::data::{Exported, Peer, Sidedness, TensorTransport, TransportError};
use rdt::prelude::*;
use rdt_integration_tests::deadline;

/// A one-sided transport whose `release` and `peer_gone` ask the runtime a
/// question.
const ASKS_ON_RELEASE: Transport = Transport::named("asks_on_release");

rdt::register_transport!(Registration {
    name: ASKS_ON_RELEASE.name(),
    sidedness: Sidedness::OneSided,
    collective: false,
    devices: "CPU",
    same_host_only: false,
    start: |_: &ProcessContext| Ok(Arc::new(AsksOnRelease) as Arc<dyn TensorTransport>),
});

/// The runtime `release` asks.
static RUNTIME: OnceLock<Runtime> = OnceLock::new();
/// Releases that found the state lock taken (they ran under it).
static UNDER_LOCK: AtomicBool = AtomicBool::new(false);
static RELEASED: AtomicUsize = AtomicUsize::new(0);
/// The same for `peer_gone`.
static PEER_GONE_UNDER_LOCK: AtomicBool = AtomicBool::new(false);
static PEER_GONE: tokio::sync::Notify = tokio::sync::Notify::const_new();

/// Whether the runtime's state lock is taken now: another thread asks it
/// a question (asked here, a release under the lock would deadlock).
fn state_locked() -> bool {
    let (tx, rx) = std::sync::mpsc::channel();
    let rt = RUNTIME.get().expect("set by the test").clone();
    std::thread::spawn(move || tx.send(rt.live_objects()));
    rx.recv_timeout(Duration::from_secs(2)).is_err()
}

struct AsksOnRelease;

impl TensorTransport for AsksOnRelease {
    fn name(&self) -> &'static str {
        ASKS_ON_RELEASE.name()
    }

    fn sidedness(&self) -> Sidedness {
        Sidedness::OneSided
    }

    fn check_device(&self, _: &Device) -> Result<(), TransportError> {
        Ok(())
    }

    fn serves_driver(&self) -> bool {
        true
    }

    fn export<'a>(
        &'a self,
        _: ObjectKey,
        tensors: &'a [Tensor],
    ) -> futures::future::BoxFuture<'a, Result<Exported, TransportError>> {
        Box::pin(async move {
            Ok(Exported {
                metas: tensors.iter().map(Tensor::meta).collect(),
                ..Exported::default()
            })
        })
    }

    fn receive<'a>(
        &'a self,
        _: &'a Peer,
        _: &'a TransferCtx,
        _: &'a Exported,
    ) -> futures::future::BoxFuture<'a, Result<Vec<Tensor>, TransportError>> {
        Box::pin(async { Err(TransportError::new("asks_on_release", "not read here")) })
    }

    fn release(&self, _: ObjectKey) -> futures::future::BoxFuture<'_, Result<(), TransportError>> {
        if state_locked() {
            UNDER_LOCK.store(true, Ordering::SeqCst);
        }
        RELEASED.fetch_add(1, Ordering::SeqCst);
        Box::pin(async { Ok(()) })
    }

    fn peer_gone(&self, _: u64) {
        // Workers call it too; only the driver has a runtime to ask.
        if RUNTIME.get().is_some() {
            if state_locked() {
                PEER_GONE_UNDER_LOCK.store(true, Ordering::SeqCst);
            }
            PEER_GONE.notify_one();
        }
    }
}

/// OW-1, OW-5: an object the driver held itself is released, and the
/// transports forget a dead actor, after the state lock is given back. At
/// d5ce7c1 `DriverHeld`'s drop ran the transport's release inside the
/// owner table's free, under the lock; before 64d9a46 `on_death` called
/// `peer_gone` under it.
#[tokio::test]
async fn ow_1_ow_5_transport_work_runs_outside_the_state_lock() {
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        RUNTIME.set(rt.clone()).ok().expect("one runtime");
        let r = rt
            .put_with(&Tensor::full(1.0f32, &[16]), ASKS_ON_RELEASE)
            .await
            .unwrap();
        assert_eq!(rt.live_objects(), 1);
        drop(r);
        assert_eq!(rt.live_objects(), 0);
        assert_eq!(RELEASED.load(Ordering::SeqCst), 1, "released at the free");
        assert!(
            !UNDER_LOCK.load(Ordering::SeqCst),
            "the transport's release ran under the driver's state lock"
        );
        // An actor's death: the driver's transports forget it.
        let p = rt
            .spawn::<rdt_integration_tests::actors::Producer>(())
            .await
            .unwrap();
        assert_eq!(rt.get(p.echo(7).remote()).await.unwrap(), 7);
        p.kill();
        PEER_GONE.notified().await;
        assert!(
            !PEER_GONE_UNDER_LOCK.load(Ordering::SeqCst),
            "the transport's peer_gone ran under the driver's state lock"
        );
    })
    .await
}
