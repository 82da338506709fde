//! The hot window: how long a thread that waits for something rdt expects
//! soon keeps polling instead of going to sleep.
//!
//! # Why
//! Waking a thread that has slept for a while costs far more than a
//! hand-off between two busy threads: on the cloud VMs GPUs are rented as
//! (measured on our 2×H200 host, a 32-vCPU guest without C-state control),
//! a tiny actor call costs 47–51 µs back to back and 190–210 µs after
//! 3 ms idle, because every idle vCPU on its path has to be woken through
//! the hypervisor. A 1 GiB NCCL pass keeps the control plane idle for
//! those 3 ms, then pays that wake-up two to four times in a row (the
//! driver, the worker's control loop, the transfer thread, the actor);
//! raw NCCL pays none, because CUDA's own synchronization spins.
//!
//! # What
//! [`hot`] wraps a wait on rdt's critical path (the driver waiting for a
//! value, a worker's control loop waiting for its next message, a group's
//! transfer thread waiting for its next transfer, a GPU completion): for
//! up to [`window`] after the wait began it asks the future again,
//! yielding to the executor between asks (other tasks run, the I/O driver
//! is polled), so the thread stays awake; past the window it parks as
//! before, so an idle runtime costs nothing after the window. This is
//! what CUDA does by default (`CU_CTX_SCHED_AUTO` spins when there are
//! more cores than contexts) and what NCCL's proxy thread does while work
//! is pending.
//!
//! # Setting
//! [`window`] is, in order: what [`set_window`] set in this process (the
//! framework sets it in every worker from `RuntimeBuilder::hot_window`),
//! else `RDT_HOT_WINDOW_US` (microseconds; `0` turns it off), else
//! [`DEFAULT_WINDOW`] on machines with at least [`MIN_CORES_TO_SPIN`]
//! cores and zero on smaller ones (a 2-core machine running a driver and
//! several workers has no idle core to spend: spinning there would slow
//! everything down).
use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant};

/// The window on machines with enough cores: longer than a 1 GiB transfer
/// over NVLink (about 3 ms), so a pass of that size stays hot end to end;
/// waits longer than this pay one wake-up, a small share of them.
pub const DEFAULT_WINDOW: Duration = Duration::from_millis(5);

/// Machines with fewer cores than this default to no hot window.
pub const MIN_CORES_TO_SPIN: usize = 8;

static WINDOW: MicrosSetting = MicrosSetting::new("RDT_HOT_WINDOW_US");

/// How long [`hot`] keeps a waiting thread awake (see the module docs for
/// where the value comes from).
pub fn window() -> Duration {
    WINDOW.get(|| {
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        if cores >= MIN_CORES_TO_SPIN {
            DEFAULT_WINDOW
        } else {
            Duration::ZERO
        }
    })
}

/// Sets this process's hot window (zero turns it off).
pub fn set_window(d: Duration) {
    WINDOW.set(d);
}

/// A per-process duration setting: what `set` stored, else the
/// environment variable `env` (microseconds), else a default; read once.
pub(crate) struct MicrosSetting {
    /// Microseconds; `u64::MAX` until set or read.
    us: AtomicU64,
    env: &'static str,
}

impl MicrosSetting {
    pub(crate) const fn new(env: &'static str) -> Self {
        MicrosSetting {
            us: AtomicU64::new(u64::MAX),
            env,
        }
    }

    /// The setting; `default` is asked only when neither `set` nor the
    /// environment gave one.
    pub(crate) fn get(&self, default: impl FnOnce() -> Duration) -> Duration {
        let us = self.us.load(Ordering::Relaxed);
        if us != u64::MAX {
            return Duration::from_micros(us);
        }
        let d = self.in_env().unwrap_or_else(default);
        // A racing `set` wins: it is the explicit choice.
        let _ = self.us.compare_exchange(
            u64::MAX,
            d.as_micros().min(u64::MAX as u128 - 1) as u64,
            Ordering::Relaxed,
            Ordering::Relaxed,
        );
        Duration::from_micros(self.us.load(Ordering::Relaxed))
    }

    pub(crate) fn set(&self, d: Duration) {
        self.us.store(
            d.as_micros().min(u64::MAX as u128 - 1) as u64,
            Ordering::Relaxed,
        );
    }

    fn in_env(&self) -> Option<Duration> {
        let v = crate::env::hot_tuning(self.env)?;
        match v.trim().parse::<u64>() {
            Ok(us) => Some(Duration::from_micros(us)),
            Err(_) => {
                tracing::warn!(
                    "{}={v:?} is not a number of microseconds; using the default",
                    self.env
                );
                None
            }
        }
    }
}

thread_local! {
    /// Set while [`hot_for`] polls its future on this thread.
    static POLLED_HOT: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Is the future being polled on this thread polled by a hot wait (which
/// polls it again after every yield, woken or not)? A future may then
/// just look, and return `Pending` without registering a waker: the hot
/// wait asks again in a moment, and once its window is over it awaits
/// the future plainly (this is then `false`, and the future registers).
///
/// Why: the thread that makes the awaited thing ready wakes a registered
/// waker, and waking a task of another runtime is not free: on a
/// current-thread runtime with I/O (an actor's thread), every wake from
/// another thread writes the runtime's eventfd, a system call of 1–2 µs
/// on the GPU hosts' VMs, paid on the waking thread's path (the worker's
/// control loop, storing a received value that the actor's call waits
/// for). A thread that spins needs no wake-up.
pub fn polled_hot() -> bool {
    POLLED_HOT.with(|p| p.get())
}

/// A future that is pending once, without waking anyone, then ready: for
/// a future polled hot ([`polled_hot`]) to give the hot wait its turn.
pub fn pending_once() -> impl Future<Output = ()> {
    let mut first = true;
    std::future::poll_fn(move |_| {
        if std::mem::take(&mut first) {
            Poll::Pending
        } else {
            Poll::Ready(())
        }
    })
}

/// Awaits `fut`, keeping this thread awake for up to [`window`] (asking
/// `fut` again after every yield to the executor), then parking as a
/// plain `.await` would. Outside a tokio runtime, or with a zero window,
/// it is a plain `.await`.
pub async fn hot<F: Future>(fut: F) -> F::Output {
    hot_for(window(), fut).await
}

/// [`hot`] with an explicit window.
pub async fn hot_for<F: Future>(window: Duration, fut: F) -> F::Output {
    if window.is_zero() || tokio::runtime::Handle::try_current().is_err() {
        return fut.await;
    }
    let mut fut = pin!(fut);
    let t0 = Instant::now();
    loop {
        let was = POLLED_HOT.with(|p| p.replace(true));
        let polled = futures::poll!(fut.as_mut());
        POLLED_HOT.with(|p| p.set(was));
        if let Poll::Ready(v) = polled {
            return v;
        }
        if t0.elapsed() >= window {
            return fut.await;
        }
        // Yield, not wake-and-return: tokio polls its I/O driver and other
        // tasks before it comes back here, so what we wait for can arrive.
        tokio::task::yield_now().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_hot_wait_returns_what_arrives_within_the_window() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2));
            let _ = tx.send(7u32);
        });
        let got =
            tokio::time::timeout(Duration::from_secs(10), hot_for(Duration::from_secs(5), rx))
                .await
                .expect("deadline");
        assert_eq!(got.unwrap(), 7);
    }

    #[tokio::test]
    async fn a_hot_wait_parks_after_the_window_and_still_gets_the_value() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let t0 = Instant::now();
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            let _ = tx.send(9u32);
        });
        let got = tokio::time::timeout(
            Duration::from_secs(10),
            hot_for(Duration::from_millis(1), rx),
        )
        .await
        .expect("deadline");
        assert_eq!(got.unwrap(), 9);
        assert!(t0.elapsed() >= Duration::from_millis(50));
    }

    #[tokio::test(flavor = "current_thread")]
    async fn a_hot_wait_lets_other_tasks_of_its_thread_run() {
        // On one thread, the value comes from a task that can only run
        // when the hot wait yields.
        let (tx, rx) = tokio::sync::oneshot::channel();
        tokio::spawn(async move {
            let _ = tx.send(3u32);
        });
        let got =
            tokio::time::timeout(Duration::from_secs(10), hot_for(Duration::from_secs(5), rx))
                .await
                .expect("deadline");
        assert_eq!(got.unwrap(), 3);
    }

    /// Waits for `flag`: while polled hot, only looks (counting the looks
    /// in `looked_hot`; `true` if it saw the flag so); else registers on
    /// `notify` before it looks (`false` if it saw the flag so).
    async fn looks_hot_or_waits(
        flag: std::sync::Arc<std::sync::atomic::AtomicBool>,
        notify: std::sync::Arc<tokio::sync::Notify>,
        looked_hot: std::sync::Arc<std::sync::atomic::AtomicU32>,
    ) -> bool {
        loop {
            if polled_hot() {
                looked_hot.fetch_add(1, Ordering::Relaxed);
                if flag.load(Ordering::Acquire) {
                    return true;
                }
                pending_once().await;
                continue;
            }
            let n = notify.notified();
            tokio::pin!(n);
            n.as_mut().enable();
            if flag.load(Ordering::Acquire) {
                return false;
            }
            n.await;
        }
    }

    #[tokio::test]
    async fn a_future_polled_hot_may_look_without_a_waker_and_still_sees_the_value() {
        // The value is set by another thread that wakes nobody: a future
        // that only looks while polled hot still returns it, within the
        // window (polled again after every yield) or after (awaited
        // plainly: it must then be woken, here by a notify).
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let notify = std::sync::Arc::new(tokio::sync::Notify::new());
        let looked_hot = std::sync::Arc::new(std::sync::atomic::AtomicU32::new(0));
        let wait = looks_hot_or_waits(flag.clone(), notify.clone(), looked_hot.clone());
        let setter = {
            let flag = flag.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(2));
                flag.store(true, Ordering::Release);
            })
        };
        let got = tokio::time::timeout(
            Duration::from_secs(10),
            hot_for(Duration::from_secs(5), wait),
        )
        .await
        .expect("deadline");
        setter.join().unwrap();
        assert!(got, "seen while polled hot, with no waker");
        assert!(looked_hot.load(Ordering::Relaxed) > 1);
        assert!(!polled_hot(), "the flag is this poll's only");
        // Past the window: awaited plainly, registered, woken.
        flag.store(false, Ordering::Release);
        let wait = looks_hot_or_waits(flag.clone(), notify.clone(), looked_hot.clone());
        let setter = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(30));
            flag.store(true, Ordering::Release);
            notify.notify_waiters();
        });
        let got = tokio::time::timeout(
            Duration::from_secs(10),
            hot_for(Duration::from_millis(1), wait),
        )
        .await
        .expect("deadline");
        setter.join().unwrap();
        assert!(!got, "seen after the window, through the waker");
    }

    /// The acting side's cost of 2000 hand-offs to another thread, in
    /// microseconds each: every round lets the other side settle for
    /// `settle` (spin, or park), times `act`, then waits until `seen`
    /// counts the round.
    fn hand_off_costs(settle: Duration, mut act: impl FnMut(), seen: &AtomicU64) -> f64 {
        let rounds = 2000u64;
        let mut spent = Duration::ZERO;
        for i in 0..rounds {
            let settling = Instant::now();
            while settling.elapsed() < settle {
                std::hint::spin_loop();
            }
            let t = Instant::now();
            act();
            spent += t.elapsed();
            while seen.load(Ordering::Acquire) <= i {
                std::hint::spin_loop();
            }
        }
        spent.as_secs_f64() * 1e6 / rounds as f64
    }

    /// Not a test: what the steps a hot wait and a hand-off between
    /// threads are made of cost on this host (`cargo test --release -p
    /// rdt-transport -- --ignored host_costs_timing --nocapture`): a clock
    /// read, a yield on a current-thread runtime with and without I/O,
    /// and the waker's side of waking a task of a current-thread runtime
    /// with I/O (an actor's thread) from another thread, while that
    /// runtime spins and while it sleeps.
    #[test]
    #[ignore]
    fn host_costs_timing() {
        if let Ok(c) = std::fs::read_to_string(
            "/sys/devices/system/clocksource/clocksource0/current_clocksource",
        ) {
            println!("clocksource: {}", c.trim());
        }
        let n = 200_000;
        let t0 = Instant::now();
        for _ in 0..n {
            std::hint::black_box(Instant::now());
        }
        println!(
            "Instant::now: {:.3} us each",
            t0.elapsed().as_secs_f64() * 1e6 / n as f64
        );
        for io in [true, false] {
            let mut b = tokio::runtime::Builder::new_current_thread();
            if io {
                b.enable_io();
            }
            let rt = b.enable_time().build().unwrap();
            let t0 = Instant::now();
            rt.block_on(async {
                for _ in 0..n {
                    tokio::task::yield_now().await;
                }
            });
            println!(
                "yield_now on a current-thread runtime (I/O {io}): {:.3} us each",
                t0.elapsed().as_secs_f64() * 1e6 / n as f64
            );
        }
        for spinning in [true, false] {
            let notify = std::sync::Arc::new(tokio::sync::Notify::new());
            let woken = std::sync::Arc::new(AtomicU64::new(0));
            let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            let th = {
                let (notify, woken, stop) = (notify.clone(), woken.clone(), stop.clone());
                std::thread::spawn(move || {
                    let rt = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .unwrap();
                    let local = tokio::task::LocalSet::new();
                    local.block_on(&rt, async move {
                        if spinning {
                            let stop = stop.clone();
                            tokio::task::spawn_local(async move {
                                while !stop.load(Ordering::Relaxed) {
                                    tokio::task::yield_now().await;
                                }
                            });
                        }
                        while !stop.load(Ordering::Relaxed) {
                            notify.notified().await;
                            woken.fetch_add(1, Ordering::Release);
                        }
                    });
                })
            };
            // Let the task register (and the runtime settle: spin, or
            // park in epoll_wait).
            let settle = Duration::from_micros(if spinning { 20 } else { 200 });
            let us = hand_off_costs(settle, || notify.notify_one(), &woken);
            stop.store(true, Ordering::Relaxed);
            notify.notify_one();
            th.join().unwrap();
            println!(
                "waking a task of a current-thread runtime with I/O from another thread, \
                 runtime {}: {:.2} us on the waker's side",
                if spinning { "spinning" } else { "asleep" },
                us
            );
        }
    }

    /// Not a test: what a few microseconds of control-plane-like work
    /// (a frame of about 800 bytes encoded and decoded with postcard, a
    /// map entry made and taken out, a few small allocations) costs on
    /// this host right after what a hot wait does between its asks
    /// (`cargo test --release -p rdt-transport -- --ignored
    /// cold_after_syscall_timing --nocapture`): nothing, a pure spin, a
    /// cheap system call, `epoll_wait` through a runtime's `yield_now`,
    /// and `sched_yield`. On a guest whose kernel flushes the CPU's
    /// predictors or TLB at every system call, the same work costs more
    /// after one, and hot waits that ask through the I/O driver slow down
    /// every step that follows them.
    #[test]
    #[ignore]
    fn cold_after_syscall_timing() {
        for f in std::fs::read_dir("/sys/devices/system/cpu/vulnerabilities")
            .into_iter()
            .flatten()
            .flatten()
        {
            let v = std::fs::read_to_string(f.path()).unwrap_or_default();
            println!("{}: {}", f.file_name().to_string_lossy(), v.trim());
        }
        if let Ok(c) = std::fs::read_to_string("/proc/cmdline") {
            println!("cmdline: {}", c.trim());
        }
        #[derive(serde::Serialize, serde::Deserialize)]
        struct Frame {
            name: String,
            host: String,
            endpoint: String,
            ids: Vec<u64>,
            #[serde(with = "serde_bytes")]
            head: Vec<u8>,
        }
        let frame = Frame {
            name: "producer#1".into(),
            host: "gpu-host-0".into(),
            endpoint: "/tmp/rdt-1234/peer.sock".into(),
            ids: (0..16).collect(),
            head: vec![7u8; 600],
        };
        let mut map: std::collections::HashMap<u64, String> = Default::default();
        let mut work = |i: u64| {
            let bytes = postcard::to_allocvec(&frame).unwrap();
            let back: Frame = postcard::from_bytes(&bytes).unwrap();
            map.insert(i, back.name);
            std::hint::black_box(map.remove(&i));
            std::hint::black_box(back.head.len() + back.ids.len());
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let n = 50_000u64;
        let cases = [
            "back to back",
            "after a 5 us spin",
            "after getppid",
            "after yield_now (epoll_wait)",
            "after sched_yield",
        ];
        for round in 0..2 {
            for (case, what) in cases.iter().enumerate() {
                let mut spent = Duration::ZERO;
                rt.block_on(async {
                    for i in 0..n {
                        match case {
                            1 => {
                                let t = Instant::now();
                                while t.elapsed() < Duration::from_micros(5) {
                                    std::hint::spin_loop();
                                }
                            }
                            2 => {
                                // SAFETY: no arguments, no memory.
                                std::hint::black_box(unsafe { libc::getppid() });
                            }
                            3 => tokio::task::yield_now().await,
                            4 => {
                                // SAFETY: no arguments, no memory.
                                unsafe { libc::sched_yield() };
                            }
                            _ => {}
                        }
                        let t = Instant::now();
                        work(i);
                        spent += t.elapsed();
                    }
                });
                println!(
                    "round {round}: the work {what}: {:.3} us",
                    spent.as_secs_f64() * 1e6 / n as f64
                );
            }
        }
    }

    /// Not a test: the floor of a control-socket round trip on this host
    /// (`cargo test --release -p rdt-transport -- --ignored
    /// spinning_echo_timing --nocapture`): two threads echo a 64-byte
    /// frame over a Unix socket pair, each spinning on a non-blocking
    /// `recv` (no epoll, no sleep), then the same with each side's spin
    /// yielding through a current-thread runtime with I/O between reads
    /// (what rdt's hot waits do). Compare with `bench control`'s blocking
    /// echo and tiny call.
    #[test]
    #[ignore]
    fn spinning_echo_timing() {
        use std::io::{Read, Write};
        use std::os::unix::net::UnixStream;
        fn read_frame(s: &mut UnixStream, buf: &mut [u8; 64], turn: &mut impl FnMut()) {
            let mut got = 0;
            while got < buf.len() {
                match s.read(&mut buf[got..]) {
                    Ok(0) => panic!("closed"),
                    Ok(n) => got += n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => turn(),
                    Err(e) => panic!("{e}"),
                }
            }
        }
        for through_runtime in [false, true, false, true] {
            let (mut a, mut b) = UnixStream::pair().unwrap();
            a.set_nonblocking(true).unwrap();
            b.set_nonblocking(true).unwrap();
            let rounds = 20_000;
            let runtime = || {
                tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .unwrap()
            };
            let echo = std::thread::spawn(move || {
                let rt = runtime();
                let mut buf = [0u8; 64];
                let mut turn = || {
                    if through_runtime {
                        rt.block_on(tokio::task::yield_now());
                    } else {
                        std::hint::spin_loop();
                    }
                };
                for _ in 0..rounds {
                    read_frame(&mut b, &mut buf, &mut turn);
                    b.write_all(&buf).unwrap();
                }
            });
            let rt = runtime();
            let mut turn = || {
                if through_runtime {
                    rt.block_on(tokio::task::yield_now());
                } else {
                    std::hint::spin_loop();
                }
            };
            let mut buf = [7u8; 64];
            let mut us = Vec::with_capacity(rounds);
            for _ in 0..rounds {
                let t = Instant::now();
                a.write_all(&buf).unwrap();
                read_frame(&mut a, &mut buf, &mut turn);
                us.push(t.elapsed().as_secs_f64() * 1e6);
            }
            echo.join().unwrap();
            us.sort_by(f64::total_cmp);
            println!(
                "spinning echo, {}: median {:.2} us, p90 {:.2} us",
                if through_runtime {
                    "a runtime turn (epoll_wait) between reads"
                } else {
                    "pure spin between reads"
                },
                us[us.len() / 2],
                us[us.len() * 9 / 10]
            );
        }
    }

    /// Not a test: what writing a small frame (38 bytes, a `CallDone`)
    /// into a Unix socket costs the writer on this host, by what the
    /// reading side is doing (`cargo test --release -p rdt-transport --
    /// --ignored socket_write_costs_timing --nocapture`): a thread that
    /// spins on a non-blocking `recv` of a socket in no epoll set; a
    /// current-thread runtime with the socket registered that spins
    /// (yields between reads: never in `epoll_wait` for long); the same
    /// runtime asleep in `epoll_wait`; a two-worker runtime whose one task
    /// spins while the other worker sleeps in `epoll_wait` (a worker's
    /// control runtime, and the case the book's Internals names).
    #[test]
    #[ignore]
    fn socket_write_costs_timing() {
        use std::io::Write;
        use std::sync::atomic::AtomicBool;
        use std::sync::Arc;
        let cases = [
            "a thread spinning on recv, socket in no epoll set",
            "a current-thread runtime spinning, socket registered",
            "a current-thread runtime asleep in epoll_wait",
            "a two-worker runtime, one task spinning, the other worker asleep",
        ];
        for (case, what) in cases.iter().enumerate() {
            let (mut w, r) = std::os::unix::net::UnixStream::pair().unwrap();
            r.set_nonblocking(true).unwrap();
            let got = Arc::new(AtomicU64::new(0));
            let stop = Arc::new(AtomicBool::new(false));
            // Reads until stopped, counting each read that got bytes;
            // yields between empty reads when asked to.
            async fn spin_reading(
                r: tokio::net::UnixStream,
                got: Arc<AtomicU64>,
                stop: Arc<AtomicBool>,
            ) {
                let mut buf = [0u8; 256];
                while !stop.load(Ordering::Relaxed) {
                    match r.try_read(&mut buf) {
                        Ok(n) if n > 0 => {
                            got.fetch_add(1, Ordering::Release);
                        }
                        _ => tokio::task::yield_now().await,
                    }
                }
            }
            let th = {
                let (got, stop) = (got.clone(), stop.clone());
                std::thread::spawn(move || match case {
                    0 => {
                        use std::io::Read;
                        let mut r = r;
                        let mut buf = [0u8; 256];
                        while !stop.load(Ordering::Relaxed) {
                            if let Ok(n) = r.read(&mut buf) {
                                if n > 0 {
                                    got.fetch_add(1, Ordering::Release);
                                }
                            }
                            std::hint::spin_loop();
                        }
                    }
                    1 | 2 => {
                        let rt = tokio::runtime::Builder::new_current_thread()
                            .enable_all()
                            .build()
                            .unwrap();
                        rt.block_on(async move {
                            let r = tokio::net::UnixStream::from_std(r).unwrap();
                            if case == 1 {
                                return spin_reading(r, got, stop).await;
                            }
                            let mut buf = [0u8; 256];
                            while !stop.load(Ordering::Relaxed) {
                                let _ =
                                    tokio::time::timeout(Duration::from_millis(50), r.readable())
                                        .await;
                                if let Ok(n) = r.try_read(&mut buf) {
                                    if n > 0 {
                                        got.fetch_add(1, Ordering::Release);
                                    }
                                }
                            }
                        })
                    }
                    _ => {
                        let rt = tokio::runtime::Builder::new_multi_thread()
                            .worker_threads(2)
                            .enable_all()
                            .build()
                            .unwrap();
                        rt.block_on(async move {
                            let r = tokio::net::UnixStream::from_std(r).unwrap();
                            tokio::spawn(spin_reading(r, got, stop)).await.unwrap()
                        })
                    }
                })
            };
            let asleep = case == 2;
            let frame = [7u8; 38];
            // Let the reader settle: spin, or park.
            let settle = Duration::from_micros(if asleep { 200 } else { 30 });
            let us = hand_off_costs(settle, || w.write_all(&frame).unwrap(), &got);
            stop.store(true, Ordering::Relaxed);
            let _ = w.write_all(&frame);
            th.join().unwrap();
            println!(
                "writing a 38-byte frame into a Unix socket, the reader {what}: {us:.2} us on the writer's side"
            );
        }
    }

    #[test]
    fn set_window_overrides_the_default() {
        set_window(Duration::from_micros(1234));
        assert_eq!(window(), Duration::from_micros(1234));
        set_window(Duration::ZERO);
        assert_eq!(window(), Duration::ZERO);
    }
}
