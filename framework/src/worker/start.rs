//! A worker's start: its runtimes, its shared state and its actor, then
//! its control loop until the driver goes.

use super::*;
use crate::protocol::boot::Joined;

/// Entry point of a worker hosting `A`; never returns.
#[doc(hidden)]
pub fn run_worker<A: RdtActor>(start: WorkerStart) -> ! {
    crate::process::heap::tune_worker_heap();
    if let Err(e) = worker_main::<A>(start) {
        eprintln!("rdt worker: {e}");
        std::process::exit(1);
    }
    std::process::exit(0)
}

/// The worker's two threads of control (invariant 3): the actor runs on
/// the actix system of the main thread; the control loop, deliveries and
/// sends run on a separate tokio runtime, so a method that blocks its
/// thread still lets transfers of objects it already produced go out.
pub(super) fn worker_main<A: RdtActor>(start: WorkerStart) -> Result<()> {
    let WorkerStart { joined, control } = start;
    let Joined {
        tx,
        mut rx,
        order,
        secret,
        local_ip,
    } = joined;
    // Before any message that names a transport (ids, not names, travel).
    crate::transport::set_wire_table(&order.transports);
    let peer_secret = <[u8; 32]>::try_from(&secret[..]).ok();
    let tcp_bind = match (&order.tcp_bind, local_ip) {
        (Some(b), _) => b.clone(),
        (None, Some(ip)) => std::net::SocketAddr::new(ip, 0).to_string(),
        (None, None) => "127.0.0.1:0".to_string(),
    };
    let endpoints = crate::transport::configure_worker(crate::transport::WorkerTransportConfig {
        me: order.worker,
        secret,
        tcp_bind,
        transfer_timeout: Duration::from_millis(order.transfer_timeout_ms),
    });
    let boot_name: Arc<str> = order.name.clone().into();
    super::log::configure(&order.log, &order.name);
    let heartbeat = order.heartbeat_ms.map(Duration::from_millis);
    let id_space = order.id_space;
    if let Some(us) = order.hot_window_us {
        hot::set_window(Duration::from_micros(us));
    }
    let args = order.args.clone();
    let handle = control.handle().clone();
    let sys = actix::System::new();
    sys.block_on(async move {
        let shared = Arc::new(WorkerShared {
            name: boot_name.clone(),
            store: Store::default(),
            tx: tx.clone(),
            device_map: order.device_map.clone(),
            transfers: Mutex::new(HashMap::new()),
            receiving: Mutex::new(HashMap::new()),
            received: Default::default(),
            groups: Mutex::new(HashMap::new()),
            landing: Mutex::new(HashMap::new()),
            handoff: Default::default(),
            drops: Arc::default(),
            local_refs: Default::default(),
            next_object: id_space.into(),
            watches: Mutex::new(HashMap::new()),
            next_req: 1.into(),
            actor: order.worker,
            self_calls: Mutex::new(Default::default()),
            probes: Mutex::new(HashMap::new()),
            targets: Mutex::new(HashMap::new()),
            fitted: Mutex::new(None),
            in_place: Default::default(),
            started_after_frames: Default::default(),
            acks_by_calls: Default::default(),
            ack_wait: ack_wait(Duration::from_millis(order.transfer_timeout_ms)),
            control: handle.clone(),
            readers: Mutex::new(HashMap::new()),
            arg_uses: Mutex::new(HashMap::new()),
            straight: straight::PeerDelivery::new(
                hostname(),
                &endpoints,
                peer_secret.unwrap_or_default(),
                order.max_frame,
                order.straight_large_values,
            ),
        });
        // PD-4: listening before the driver hears the actor exists.
        if let (Some(path), Some(_)) = (&order.peer_socket, peer_secret) {
            if let Err(e) = straight::listen(&shared, path, &handle) {
                tracing::warn!(
                    "cannot listen for straight deliveries on {path} ({e}); values for this actor go through the driver"
                );
            }
        }
        // Before the constructor: its argument may carry actor handles,
        // which read this worker's client.
        let _ = WORKER.set(shared.clone());
        crate::refs::client::set_this_process(shared.clone());
        let decoded =
            crate::refs::codec::reading_refs(Some(shared.clone() as crate::refs::client::SharedClient), || {
                postcard::from_bytes::<A::Args>(&args.bytes().unwrap_or_default())
            });
        let constructed = match decoded {
            Err(e) => Err(Error::Decode {
                what: format!("constructor argument of {}", A::NAME),
                message: e.to_string(),
            }),
            Ok(args) => match AssertUnwindSafe(A::__construct(args)).catch_unwind().await {
                Ok(Ok(a)) => Ok(a),
                Ok(Err(msg)) => Err(Error::Application {
                    actor: boot_name.to_string(),
                    method: "new".into(),
                    message: msg,
                    typed: None,
                }),
                Err(p) => Err(Error::Panic {
                    actor: boot_name.to_string(),
                    method: "new".into(),
                    message: panic_message(&p),
                }),
            },
        };
        // A device map naming a place this process lacks fails the spawn
        // before the actor could receive anything.
        let constructed = constructed.and_then(|a| {
            order.device_map.usable_here().map(|()| a).map_err(|reason| Error::NoSuchDevice {
                receiver: boot_name.to_string(),
                reason,
            })
        });
        let actor = match constructed {
            Ok(a) => a,
            Err(e) => {
                let _ = tx.send(&ToDriver::Spawned(Err(e)));
                // The driver kills us; until then, stay quiet.
                handle.spawn(async move {
                    while let Ok(Some(_)) = rx.recv::<ToWorker>().await {}
                    std::process::exit(1);
                });
                return futures::future::pending::<()>().await;
            }
        };
        // The mailbox is sized before the actor starts: calls may arrive
        // before `started` would run (invariant 2).
        let mut ctx = actix::Context::new();
        ctx.set_mailbox_capacity(host::MAILBOX);
        let addr = ctx.run(Host::<A>::new(actor, shared.clone()));
        let _ = tx.send(&ToDriver::Spawned(Ok(protocol::SpawnedActor {
            endpoints,
            cuda_devices: rdt_transport::cuda::device_count() as u32,
        })));
        // CUDA IPC upkeep: close mappings of slabs their producer retired,
        // free retired slabs nobody maps any more. Only when there is
        // something to look at (never in a process that did not use CUDA
        // IPC), and on the blocking pool: freeing device memory may wait
        // for the GPU.
        // Then every transport's own upkeep (shm: mappings of memfds their
        // producer freed), in the same trip to the blocking pool: it may
        // unmap large files.
        handle.spawn(async {
            use rdt_transport::cuda_ipc;
            let mut tick = tokio::time::interval(rdt_transport::transport::HOUSEKEEPING_PERIOD);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let _ = tokio::task::spawn_blocking(|| {
                    if cuda_ipc::housekeeping_due() {
                        cuda_ipc::housekeeping();
                    }
                    for t in Transport::registered() {
                        if let Some(inst) = t.existing_instance() {
                            inst.housekeeping();
                        }
                    }
                })
                .await;
            }
        });
        handle.spawn(async move {
            let code = match control_loop(&mut rx, addr, shared, heartbeat).await {
                Ok(()) => 0,
                Err(e) => {
                    eprintln!("rdt worker {boot_name}: {e}");
                    1
                }
            };
            // Invariant 5: the driver is gone.
            std::process::exit(code);
        });
        futures::future::pending::<()>().await
    });
    drop(control);
    Ok(())
}
