//! Where received tensors land (DM-1..DM-7): a `get_on` in the driver and
//! in an actor, an argument's `to_device`, an actor's device map; a device
//! the receiver lacks refused before any byte moves, the object kept.
//!
//! These run on any host: every process has host memory, and no host has
//! [`MISSING`]. The CUDA cases (a CUDA value onto the host, a value from
//! GPU 0 landing on GPU 1) are in `tests/gpu/device_maps.rs`.

use rdt::prelude::*;
use rdt::DeviceMap;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::deadline;

/// Every transport an actor on the CPU reads from (`tcp` in a group).
const TRANSPORTS: [&str; 4] = ["object_store", "tcp", "shm", "nixl"];

/// Those the driver reads from (`tcp` is collective: a member's only).
const DRIVER_READS: [&str; 3] = ["object_store", "shm", "nixl"];

/// A device no process has (no host has 65 GPUs).
const MISSING: Place = Place::Cuda(64);

const N: usize = 1000;

async fn start() -> (Runtime, ProducerHandle, ConsumerHandle) {
    rdt_integration_tests::logs();
    let rt = Runtime::start().await.unwrap();
    let p = rt.spawn::<Producer>(()).await.unwrap();
    let c = rt.spawn::<Consumer>(()).await.unwrap();
    rt.create_collective_group(&[p.id(), c.id()], Transport::Tcp)
        .await
        .unwrap();
    (rt, p, c)
}

fn is_no_such_device(e: &Error) -> bool {
    matches!(e, Error::NoSuchDevice { .. })
        || matches!(
            e.application_error::<Error>(),
            Some(Error::NoSuchDevice { .. })
        )
}

#[tokio::test]
async fn dm_1_the_driver_gets_a_value_on_the_host_over_every_transport() {
    deadline(120, async {
        let (rt, p, _c) = start().await;
        for t in DRIVER_READS {
            let r = p.make(2.0, N).tensor_transport(t).unwrap().remote();
            let v: Tensor = rt.get_on(&r, Place::Host).await.unwrap();
            assert!(v.device().is_cpu(), "over {t}");
            assert_eq!(v.sum().unwrap(), 2.0 * N as f64, "over {t}");
            let again: Tensor = rt.get_on_host(&r).await.unwrap();
            assert_eq!(again.sum().unwrap(), 2.0 * N as f64, "over {t}");
        }
        rt.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn dm_2_a_device_the_driver_lacks_is_refused_and_the_object_stays_readable() {
    deadline(120, async {
        let (rt, p, _c) = start().await;
        for t in DRIVER_READS {
            let r = p.make(3.0, N).tensor_transport(t).unwrap().remote();
            let e = rt.get_on(&r, MISSING).await.unwrap_err();
            match &e {
                Error::NoSuchDevice { receiver, reason } => {
                    assert_eq!(receiver, "the driver");
                    assert!(reason.contains("cuda:64"), "{reason}");
                }
                other => panic!("over {t}: expected NoSuchDevice, got {other}"),
            }
            assert!(e.to_string().contains("still readable"), "{e}");
            let v: Tensor = rt.get(&r).await.unwrap();
            assert_eq!(v.sum().unwrap(), 3.0 * N as f64, "over {t}");
        }
        rt.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn dm_3_an_actor_gets_a_value_on_the_host_and_is_refused_a_device_it_lacks() {
    deadline(120, async {
        let (rt, p, c) = start().await;
        for t in TRANSPORTS {
            let r = p.make(4.0, N).tensor_transport(t).unwrap().remote();
            rt.wait(&r).await.unwrap();
            let before = rt.get(c.received(t).remote()).await.unwrap();
            // Refused before the actor asks for the object: nothing moves.
            let e = rt
                .get(c.sum_on(r.clone(), MISSING).remote())
                .await
                .unwrap_err();
            assert!(is_no_such_device(&e), "over {t}: {e}");
            let after = rt.get(c.received(t).remote()).await.unwrap();
            assert_eq!(after, before, "over {t}: the refused get moved the value");
            let (sum, device) = rt.get(c.sum_on(r, Place::Host).remote()).await.unwrap();
            assert_eq!((sum, device.as_str()), (4.0 * N as f64, "cpu"), "over {t}");
        }
        rt.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn dm_4_an_argument_put_on_the_host_arrives_there() {
    deadline(120, async {
        let (rt, p, c) = start().await;
        for t in TRANSPORTS {
            let r = p.make(5.0, N).tensor_transport(t).unwrap().remote();
            let (sum, device) = rt
                .get(c.sum_where(r.to_device(Place::Host)).remote())
                .await
                .unwrap();
            assert_eq!((sum, device.as_str()), (5.0 * N as f64, "cpu"), "over {t}");
        }
        rt.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn dm_5_an_argument_on_a_device_its_callee_lacks_is_refused_before_any_byte_moves() {
    deadline(120, async {
        let (rt, p, c) = start().await;
        for t in TRANSPORTS {
            let r = p.make(6.0, N).tensor_transport(t).unwrap().remote();
            rt.wait(&r).await.unwrap();
            let e = rt
                .get(c.sum_where(r.to_device(MISSING)).remote())
                .await
                .unwrap_err();
            match &e {
                // The driver's refusal, not the callee's: no transfer was
                // ordered.
                Error::NoSuchDevice { receiver, reason } => {
                    assert!(receiver.starts_with("Consumer#"), "{receiver}");
                    assert!(reason.contains("cuda:64"), "{reason}");
                }
                other => panic!("over {t}: expected NoSuchDevice, got {other}"),
            }
            let received = rt.get(c.received(t).remote()).await.unwrap();
            assert_eq!(received, 0, "over {t}: the refused call moved its argument");
            // The object is untouched: the same argument, asked for where
            // the callee can take it, arrives.
            let (sum, _) = rt.get(c.sum_where(&r).remote()).await.unwrap();
            assert_eq!(sum, 6.0 * N as f64, "over {t}");
        }
        rt.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn dm_6_a_device_map_naming_a_device_the_actor_lacks_fails_its_spawn() {
    deadline(60, async {
        let rt = Runtime::start().await.unwrap();
        let gpu: rdt::GpuUuid = "GPU-01234567-89ab-cdef-0011-223344556677".parse().unwrap();
        let spawned = rt
            .spawn::<Consumer>(())
            .device_map(DeviceMap::new().map(gpu, MISSING))
            .await;
        let Err(e) = spawned else {
            panic!("the spawn must fail")
        };
        match &e {
            Error::NoSuchDevice { reason, .. } => {
                assert!(reason.contains("GPU-01234567"), "{reason}");
                assert!(reason.contains("cuda:64"), "{reason}");
            }
            other => panic!("expected NoSuchDevice, got {other}"),
        }
        // The runtime is unaffected.
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        let (sum, _) = rt
            .get(c.sum_where(Tensor::full(1.0f32, &[4])).remote())
            .await
            .unwrap();
        assert_eq!(sum, 4.0);
        rt.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn dm_7_a_device_map_leaves_host_tensors_in_host_memory() {
    deadline(120, async {
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let gpu: rdt::GpuUuid = "GPU-01234567-89ab-cdef-0011-223344556677".parse().unwrap();
        let c = rt
            .spawn::<Consumer>(())
            .device_map(DeviceMap::new().map(gpu, Place::Host))
            .await
            .unwrap();
        rt.create_collective_group(&[p.id(), c.id()], Transport::Tcp)
            .await
            .unwrap();
        for t in TRANSPORTS {
            let r = p.make(7.0, N).tensor_transport(t).unwrap().remote();
            let (sum, device) = rt.get(c.sum_where(&r).remote()).await.unwrap();
            assert_eq!((sum, device.as_str()), (7.0 * N as f64, "cpu"), "over {t}");
        }
        // A value passed inline goes through the map too.
        let (sum, device) = rt
            .get(c.sum_where(Tensor::full(2.0f32, &[N])).remote())
            .await
            .unwrap();
        assert_eq!((sum, device.as_str()), (2.0 * N as f64, "cpu"));
        rt.shutdown().await;
    })
    .await;
}
