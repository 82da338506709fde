//! Faults: oversize messages, killed workers, a killed driver.

use std::time::{Duration, Instant};

use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::deadline;

#[tokio::test]
async fn oversize_result_fails_the_call_instead_of_hanging() {
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::builder()
            .max_frame_bytes(64 << 10)
            .start()
            .await
            .unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let e = rt.get(p.make(1.0, 1 << 20).remote()).await.unwrap_err();
        assert!(e.to_string().contains("frame limit"), "{e}");
        assert!(rt.put(&Tensor::full(1u8, &[1 << 20])).is_err());
        let e = rt
            .get(p.is_kept(Tensor::full(1.0f32, &[1 << 20]), 0).remote())
            .await
            .unwrap_err();
        assert!(e.to_string().contains("frame limit"), "{e}");
        assert_eq!(
            rt.get(p.echo(2).remote()).await.unwrap(),
            2,
            "the actor is still usable"
        );
    })
    .await;
}

#[tokio::test]
async fn sigkill_mid_call_fails_that_call_quickly() {
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        let busy = p.block(30_000).remote();
        let queued = p.echo(1).remote();
        let t0 = Instant::now();
        p.kill();
        let e = rt.get(&busy).await.unwrap_err();
        assert!(
            matches!(&e, Error::ActorDied { detail, .. } if detail.contains("signal 9")),
            "{e}"
        );
        assert!(matches!(
            rt.get(&queued).await,
            Err(Error::ActorDied { .. })
        ));
        // The process is reaped: `exited` says how it ended, and the pid
        // is gone.
        let pid = p.pid().unwrap();
        assert_eq!(p.raw().exited().await.unwrap(), "was killed by signal 9");
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "noticed in {:?}",
            t0.elapsed()
        );
        assert_eq!(
            rt.get(c.sum(Tensor::full(1.0f32, &[3])).remote())
                .await
                .unwrap(),
            3.0
        );
    })
    .await;
}

#[tokio::test]
async fn constructor_failure_is_a_spawn_error() {
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let e = rt
            .spawn::<Picky>(0)
            .await
            .expect_err("the constructor refuses 0");
        assert!(e.to_string().contains("zero is not allowed"), "{e}");
        let ok = rt.spawn::<Picky>(3).await.unwrap();
        assert_eq!(rt.get(ok.value().remote()).await.unwrap(), 3);
    })
    .await;
}

/// Waits up to `limit` for an arbitrary process to exit: `poll` on its
/// pidfd wakes exactly when it does. True if it exited.
async fn process_exit(pid: u32, limit: Duration) -> bool {
    tokio::task::spawn_blocking(move || {
        // SAFETY: plain syscalls on a descriptor we own and close.
        unsafe {
            let fd = libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) as i32;
            if fd < 0 {
                return true; // already gone
            }
            let mut p = libc::pollfd {
                fd,
                events: libc::POLLIN,
                revents: 0,
            };
            let n = libc::poll(&mut p, 1, limit.as_millis() as i32);
            libc::close(fd);
            n == 1
        }
    })
    .await
    .unwrap()
}

/// The driver is killed with SIGKILL: its workers die with it.
#[tokio::test]
async fn workers_die_with_a_killed_driver() {
    deadline(60, async {
        let mut child = tokio::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "driver_that_will_be_killed",
                "--ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("RDT_TEST_DRIVER_CHILD", "1")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let out = child.stdout.take().unwrap();
        let mut lines = tokio::io::AsyncBufReadExt::lines(tokio::io::BufReader::new(out));
        let pid = loop {
            let line = lines
                .next_line()
                .await
                .unwrap()
                .expect("the child driver printed its worker pid");
            // libtest prints "test name ... " on the same line.
            if let Some(i) = line.find("WORKER_PID=") {
                break line[i + "WORKER_PID=".len()..]
                    .trim()
                    .parse::<u32>()
                    .unwrap();
            }
        };
        assert!(std::path::Path::new(&format!("/proc/{pid}")).exists());
        child.start_kill().unwrap();
        child.wait().await.unwrap();
        assert!(
            process_exit(pid, Duration::from_secs(5)).await,
            "the worker outlived its driver by more than 5 s"
        );
    })
    .await;
}

/// Not a test on its own: the driver process of
/// `workers_die_with_a_killed_driver`, run by it with `--ignored`.
#[tokio::test]
#[ignore = "run by workers_die_with_a_killed_driver"]
async fn driver_that_will_be_killed() {
    if std::env::var("RDT_TEST_DRIVER_CHILD").is_err() {
        panic!("run by workers_die_with_a_killed_driver only");
    }
    let rt = Runtime::start().await.unwrap();
    let p = rt.spawn::<Producer>(()).await.unwrap();
    println!("WORKER_PID={}", p.pid().unwrap());
    // Wait for the parent's SIGKILL.
    std::future::pending::<()>().await;
}

/// For every CPU transport: a killed idle actor fails only the calls that
/// need it, within 5 s; a producer killed while its object is on the way
/// to a consumer fails that call (or it completes, if the bytes were
/// already across) within 5 s; the rest of the runtime keeps working.
async fn kills_per_transport(t: Transport) {
    rdt_integration_tests::logs();
    let rt = Runtime::start().await.unwrap();
    let p = rt.spawn::<Producer>(()).await.unwrap();
    let c = rt.spawn::<Consumer>(()).await.unwrap();
    let idle = rt.spawn::<Consumer>(()).await.unwrap();
    if t.is_collective() {
        rt.create_collective_group(&[p.id(), c.id(), idle.id()], t)
            .await
            .unwrap();
    }
    // Idle actor killed.
    let r = p.make(1.0, 1024).transport(t).remote();
    rt.wait(&r).await.unwrap();
    let t0 = Instant::now();
    idle.kill();
    let e = rt.get(idle.sum(&r).remote()).await;
    // The call may be submitted before or after the driver noticed: both
    // end in ActorDied, quickly.
    assert!(matches!(e, Err(Error::ActorDied { .. })), "{e:?}");
    assert!(t0.elapsed() < Duration::from_secs(5));
    if t.is_collective() {
        // A group does not survive a member's death (as in Ray): passes in
        // it fail at once until a new group is made.
        let e = rt.get(c.sum(&r).remote()).await.unwrap_err();
        assert!(matches!(e, Error::GroupBroken { .. }), "{e}");
        assert!(e.to_string().contains(idle.name()), "{e}");
        rt.create_collective_group(&[p.id(), c.id()], t)
            .await
            .unwrap();
    }
    assert_eq!(
        rt.get(c.sum(&r).remote()).await.unwrap(),
        1024.0,
        "the others are unaffected"
    );
    // Producer killed mid-transfer.
    let big = p.make(1.0, 16 << 20).transport(t).remote();
    rt.wait(&big).await.unwrap();
    let call = c.sum(&big).remote();
    let t0 = Instant::now();
    p.kill();
    match rt.get(&call).await {
        Ok(s) => assert_eq!(s, (16 << 20) as f64, "a completed transfer is whole"),
        Err(e) => {
            let root = e.root_cause();
            assert!(
                matches!(root, Error::ActorDied { .. } | Error::Transport(_)),
                "{e}"
            );
        }
    }
    assert!(
        t0.elapsed() < Duration::from_secs(5),
        "took {:?}",
        t0.elapsed()
    );
    assert_eq!(
        rt.get(c.sum(Tensor::full(1.0f32, &[4])).remote())
            .await
            .unwrap(),
        4.0
    );
    drop(call);
    assert_eq!(
        rt.live_objects(),
        2,
        "only the two produced objects are still referenced"
    );
    drop((r, big));
    assert_eq!(rt.live_objects(), 0);
}

#[tokio::test]
async fn kills_object_store() {
    deadline(60, kills_per_transport(Transport::ObjectStore)).await;
}

#[tokio::test]
async fn kills_tcp() {
    deadline(60, kills_per_transport(Transport::Tcp)).await;
}

#[tokio::test]
async fn kills_shm() {
    deadline(60, kills_per_transport(Transport::Shm)).await;
}

/// A killed actor is reported as dead (a WARN naming it); a clean
/// `shutdown` reports nobody: the workers it stops did not die.
#[tokio::test(flavor = "current_thread")]
async fn a_clean_shutdown_reports_no_deaths() {
    deadline(60, async {
        let (captured, guard) = rdt_integration_tests::capture::warnings_on_this_thread();
        let rt = Runtime::start().await.unwrap();
        let p = rt.spawn::<Producer>(()).name("doomed").await.unwrap();
        let c = rt.spawn::<Consumer>(()).name("survivor").await.unwrap();
        p.kill();
        assert_eq!(p.raw().exited().await.unwrap(), "was killed by signal 9");
        // The death of a killed actor is reported (so the capture sees the
        // driver's warnings).
        let died = |name: &str| {
            captured
                .messages()
                .iter()
                .filter(|m| m.contains(name) && m.contains("died"))
                .count()
        };
        let end = Instant::now() + Duration::from_secs(20);
        while died("doomed") == 0 {
            assert!(Instant::now() < end, "{:?}", captured.messages());
            tokio::task::yield_now().await;
        }
        assert_eq!(
            rt.get(c.sum(Tensor::full(1.0f32, &[3])).remote())
                .await
                .unwrap(),
            3.0
        );
        // Returns once every worker exited (or its grace ran out).
        rt.shutdown().await;
        drop(guard);
        assert_eq!(
            died("survivor"),
            0,
            "a clean shutdown reported a death: {:?}",
            captured.messages()
        );
    })
    .await;
}

/// XF-5, OW-1: a call that never reached its actor (its `Call` over the
/// frame limit, after its argument's delivery went out) settles nothing
/// under the receive of that argument still running at the consumer, so
/// nothing is freed under it. At e05be92 the call's error settled the
/// receive at once.
#[tokio::test]
async fn xf_5_a_call_that_never_ran_settles_no_receive_of_its_arguments() {
    deadline(60, async {
        rdt_integration_tests::logs();
        let rt = Runtime::builder()
            .max_frame_bytes(64 << 10)
            .start()
            .await
            .unwrap();
        let p = rt.spawn::<Producer>(()).await.unwrap();
        let c = rt.spawn::<Consumer>(()).await.unwrap();
        let r = p.make(1.0, 1000).transport(Transport::Shm).remote();
        rt.wait(&r).await.unwrap();
        rt.get(
            c.failpoint("rdt::receive".to_string(), "1*sleep(1000)".to_string())
                .remote(),
        )
        .await
        .unwrap();
        // 4 MiB inline: the call cannot be sent.
        let call = c.sum2(&r, Tensor::full(1.0f32, &[1 << 20])).remote();
        let e = rt.get(&call).await.unwrap_err();
        assert!(e.to_string().contains("frame limit"), "{e}");
        assert_eq!(
            rt.transfers_in_flight(),
            1,
            "the receive still running was settled by a call that never ran"
        );
        drop((call, r));
        rt.transfers_settled().await;
        assert_eq!(rt.live_objects(), 0);
        assert_eq!(rt.get(c.stored().remote()).await.unwrap(), 0);
        rt.shutdown().await;
    })
    .await
}
