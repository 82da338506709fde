//! A randomized fault soak over the CPU transports: passes, weight updates
//! by key (`get_into`, `load_into`), borrows through a third actor, driver
//! gets, cancelled `get_into`s, deadlines, application errors, killed
//! actors, dropped spawns and junk on the control port, mixed by a seeded
//! generator. Every operation has a deadline (a hang fails it), and at the
//! end every store and the owner table are empty, no transfer is in
//! flight, and the workers that lived throughout have neither grown their
//! memory nor their threads.
//!
//! The same seed gives the same operations: a failure prints its seed,
//! and [`run`] with it plays the run again. `cargo test` runs three short
//! seeds (`tests/fault_soak.rs`); `bench soak --faults` the long form.

use std::time::{Duration, Instant};

use rdt::prelude::*;

use crate::actors::*;

/// How long one operation may take before the soak calls it a hang.
const OP_DEADLINE: Duration = Duration::from_secs(30);

/// What a soak saw.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Report {
    /// The seed it ran with.
    pub seed: u64,
    /// Operations run.
    pub ops: usize,
    /// Operations of each kind, by name.
    pub by_kind: std::collections::BTreeMap<String, usize>,
    /// Errors the operations were expected to meet (a killed actor's
    /// calls, deadlines, application errors), all checked for their kind.
    pub expected_errors: usize,
    /// Owner-table entries at the end (0 when nothing leaked).
    pub live_objects: usize,
    /// Objects in the stores of the actors alive at the end.
    pub stored: usize,
    /// Resident memory of the long-lived workers, KiB, after warm-up and
    /// at the end.
    pub rss_kib: (u64, u64),
    /// Threads of the long-lived workers after warm-up and at the end.
    pub threads: (usize, usize),
    /// Worker processes left at the end beyond the actors alive then (a
    /// dropped spawn's or a killed actor's).
    pub processes_left: usize,
    /// Wall time.
    pub seconds: f64,
}

/// splitmix64: a small, well-mixed generator a seed fully determines.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const TRANSPORTS: [Transport; 4] = [
    Transport::ObjectStore,
    Transport::Shm,
    Transport::Tcp,
    Transport::Nixl,
];

/// Resident memory (KiB) and threads of process `pid`.
fn usage(pid: u32) -> (u64, usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.split_whitespace().next())
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    (field("VmRSS:"), field("Threads:") as usize)
}

/// The actors of a soak: a producer and a consumer that live throughout
/// (their memory and threads are measured), and a pair that may be killed
/// and spawned again, all four in one `tcp` group with the relay outside.
struct Cast {
    p: ProducerHandle,
    c: ConsumerHandle,
    q: ProducerHandle,
    d: ConsumerHandle,
    relay: RelayHandle,
    group: Option<rdt::GroupId>,
}

async fn cast(rt: &Runtime) -> Cast {
    let p = rt.spawn::<Producer>(()).await.unwrap();
    let c = rt.spawn::<Consumer>(()).await.unwrap();
    let q = rt.spawn::<Producer>(()).await.unwrap();
    let d = rt.spawn::<Consumer>(()).await.unwrap();
    let relay = rt.spawn::<Relay>(()).await.unwrap();
    let mut cast = Cast {
        p,
        c,
        q,
        d,
        relay,
        group: None,
    };
    regroup(rt, &mut cast).await;
    cast
}

/// The `tcp` group of the four, made again after a kill.
async fn regroup(rt: &Runtime, cast: &mut Cast) {
    if let Some(g) = cast.group.take() {
        let _ = rt.destroy_collective_group(g).await;
    }
    let ids = [cast.p.id(), cast.c.id(), cast.q.id(), cast.d.id()];
    cast.group = Some(
        rt.create_collective_group(&ids, Transport::Tcp)
            .await
            .unwrap(),
    );
}

/// Runs `ops` operations chosen by `seed`. Panics, naming the seed and
/// the operation, on a wrong value, an unexpected error, a hang or a leak.
pub async fn run(seed: u64, ops: usize) -> Report {
    let t0 = Instant::now();
    let rt = Runtime::builder()
        .listen("127.0.0.1:0")
        .transfer_timeout(Duration::from_secs(10))
        .start()
        .await
        .unwrap();
    let mut cast = cast(&rt).await;
    let mut rng = Rng(seed);
    let mut report = Report {
        seed,
        ops,
        ..Report::default()
    };
    // Warm-up: one pass over each transport, so that the first use of
    // each (pools, mappings, registrations) is not counted as growth.
    for t in TRANSPORTS {
        for _ in 0..3 {
            let r = cast.p.make(1.0, 1 << 14).transport(t).remote();
            assert_eq!(rt.get(cast.c.sum(&r).remote()).await.unwrap(), 16384.0);
        }
    }
    let long_lived = [cast.p.pid().unwrap(), cast.c.pid().unwrap()];
    let sample = || {
        long_lived.iter().fold((0, 0), |(r, t), pid| {
            let (rss, threads) = usage(*pid);
            (r + rss, t + threads)
        })
    };
    let (rss0, threads0) = sample();
    let control = rt.control_address().unwrap();
    for i in 0..ops {
        let kind = rng.below(100);
        let t = TRANSPORTS[rng.below(4) as usize];
        let v = (rng.below(100) + 1) as f32;
        let name = match kind {
            0..=29 => "pass",
            30..=41 => "update by key",
            42..=49 => "cancelled get_into",
            50..=57 => "borrow through a relay",
            58..=65 => "driver get",
            66..=73 => "application error",
            74..=79 => "deadline",
            80..=84 => "kill",
            85..=89 => "dropped spawn",
            90..=94 => "junk on the control port",
            _ => "dropped ref under a receive",
        };
        *report.by_kind.entry(name.to_string()).or_default() += 1;
        let what = format!("seed {seed}, op {i} ({name} over {t})");
        let op = async {
            match name {
                "pass" => {
                    let n = [4usize, 1 << 10, 1 << 16, 1 << 18][rng.below(4) as usize];
                    let (prod, cons) = pick(&cast, &mut rng);
                    let r = prod.make(v, n).transport(t).remote();
                    let s = rt
                        .get(cons.sum(&r).remote())
                        .await
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(s, f64::from(v) * n as f64, "{what}");
                }
                "update by key" => {
                    let (n, numel) = (4 + rng.below(5) as usize, 256);
                    let w = cast.p.make_named(n, numel, v).transport(t).remote();
                    let get = rng.below(2) == 0;
                    // The consumer keeps one map of parameters by name: a
                    // layout it did not make first is a clear error.
                    match rt
                        .get(cast.c.load_named_by_key(&w, n, numel, get).remote())
                        .await
                    {
                        Ok(sums) => {
                            for (i, (_, s)) in sums.iter().enumerate() {
                                let want = f64::from(v + i as f32) * numel as f64;
                                assert_eq!(*s, want, "{what}");
                            }
                        }
                        Err(e) => {
                            assert!(e.to_string().contains("the targets"), "{what}: {e}");
                            report.expected_errors += 1;
                        }
                    }
                }
                "cancelled get_into" => {
                    let (n, numel) = (4, 1 << 18);
                    let r = cast.p.make_version(n, numel, v).transport(t).remote();
                    let ms = rng.below(5);
                    let (out, after, later) = rt
                        .get(cast.c.get_into_dropped(&r, n, numel, ms).remote())
                        .await
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    if out && t != Transport::Nixl {
                        assert_eq!(after, later, "{what}: written after the drop");
                    }
                }
                "borrow through a relay" => {
                    let r = cast.p.make(v, 1000).transport(t).remote();
                    // The relay is in no group: a tcp ref is refused there
                    // with a clear error, others go through it.
                    match rt.get(cast.relay.sum_via(cast.c.clone(), r).remote()).await {
                        Ok(s) => assert_eq!(s, f64::from(v) * 1000.0, "{what}"),
                        Err(e) => {
                            assert_eq!(t, Transport::Tcp, "{what}: {e}");
                            report.expected_errors += 1;
                        }
                    }
                }
                "driver get" => {
                    let r = cast.p.make(v, 1 << 12).transport(t).remote();
                    match rt.get(&r).await {
                        Ok(x) => assert_eq!(x.sum().unwrap(), f64::from(v) * 4096.0, "{what}"),
                        Err(e) => {
                            assert!(matches!(e, Error::CollectiveGet { .. }), "{what}: {e}");
                            report.expected_errors += 1;
                        }
                    }
                }
                "application error" => {
                    let bad = cast.p.fail(format!("op {i}")).transport(t).remote();
                    let e = rt.get(cast.c.sum(&bad).remote()).await.unwrap_err();
                    assert!(e.to_string().contains(&format!("op {i}")), "{what}: {e}");
                    report.expected_errors += 1;
                }
                "deadline" => {
                    let slow = cast.q.block(300).remote();
                    let e = rt
                        .get_timeout(&slow, Duration::from_millis(20))
                        .await
                        .unwrap_err();
                    assert!(matches!(e, Error::Timeout { .. }), "{what}: {e}");
                    report.expected_errors += 1;
                    // The call itself ends in its time.
                    rt.get(&slow)
                        .await
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                }
                "kill" => {
                    let r = cast.q.make(v, 1 << 16).transport(t).remote();
                    let s = cast.d.sum(&r).remote();
                    let producer = rng.below(2) == 0;
                    if producer {
                        cast.q.kill();
                    } else {
                        cast.d.kill();
                    }
                    if let Err(e) = rt.get(&s).await {
                        // The death itself, the group it broke, or the
                        // transport's own error when the transfer failed
                        // before the death was seen.
                        assert!(
                            matches!(
                                e.root_cause(),
                                Error::ActorDied { .. } | Error::Transport(_)
                            ) || e.to_string().contains("group"),
                            "{what}: {e}"
                        );
                        report.expected_errors += 1;
                    }
                    drop((r, s));
                    // The killed one is spawned again (a live actor whose
                    // handle is dropped keeps running).
                    if producer {
                        cast.q = rt
                            .spawn::<Producer>(())
                            .await
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                    } else {
                        cast.d = rt
                            .spawn::<Consumer>(())
                            .await
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                    }
                    regroup(&rt, &mut cast).await;
                }
                "dropped spawn" => {
                    use std::future::IntoFuture;
                    let mut spawn = rt.spawn::<Producer>(()).into_future();
                    let _ = futures::poll!(&mut spawn);
                }
                "junk on the control port" => {
                    use tokio::io::AsyncWriteExt;
                    let mut s = tokio::net::TcpStream::connect(control)
                        .await
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    let junk: Vec<u8> = (0..256).map(|_| rng.next() as u8).collect();
                    let _ = s.write_all(&junk).await;
                }
                _ => {
                    // A ref dropped while its consumer still receives it.
                    let r = cast.p.make(v, 1 << 18).transport(t).remote();
                    let s = cast.c.sum(&r).remote();
                    drop(r);
                    assert_eq!(rt.get(&s).await.unwrap(), f64::from(v) * (1 << 18) as f64);
                }
            }
        };
        if tokio::time::timeout(OP_DEADLINE, op).await.is_err() {
            panic!("{what}: did not end within {OP_DEADLINE:?} (a hang)");
        }
    }
    if let Some(g) = cast.group.take() {
        rt.destroy_collective_group(g).await.unwrap();
    }
    rt.transfers_settled().await;
    report.live_objects = rt.live_objects();
    let mut stored = 0;
    for c in [&cast.c, &cast.d] {
        stored += rt.get(c.stored().remote()).await.unwrap();
    }
    for p in [&cast.p, &cast.q] {
        stored += rt.get(p.stored().remote()).await.unwrap();
    }
    stored += rt.get(cast.relay.stored().remote()).await.unwrap_or(0);
    report.stored = stored;
    // Killed and dropped workers go within a bound (their reapers reap
    // them): then only the five actors alive are children.
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        report.processes_left = crate::children().len().saturating_sub(5);
        if report.processes_left == 0 || Instant::now() > end {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (rss1, threads1) = sample();
    report.rss_kib = (rss0, rss1);
    report.threads = (threads0, threads1);
    report.seconds = t0.elapsed().as_secs_f64();
    rt.shutdown().await;
    report
}

/// A producer and a consumer: the long-lived pair or the other.
fn pick<'a>(cast: &'a Cast, rng: &mut Rng) -> (&'a ProducerHandle, &'a ConsumerHandle) {
    match rng.below(3) {
        0 => (&cast.q, &cast.d),
        1 => (&cast.p, &cast.d),
        _ => (&cast.p, &cast.c),
    }
}

/// The checks every soak's end must pass: nothing left anywhere, memory
/// and threads of the long-lived workers flat (within `rss_slack_kib`).
pub fn assert_clean(r: &Report, rss_slack_kib: u64) {
    let seed = r.seed;
    assert_eq!(r.live_objects, 0, "seed {seed}: owner-table entries left");
    assert_eq!(r.stored, 0, "seed {seed}: objects left in the stores");
    assert_eq!(
        r.processes_left, 0,
        "seed {seed}: worker processes left behind"
    );
    assert!(
        r.rss_kib.1 <= r.rss_kib.0 + rss_slack_kib,
        "seed {seed}: the long-lived workers grew from {} to {} KiB",
        r.rss_kib.0,
        r.rss_kib.1
    );
    assert!(
        r.threads.1 <= r.threads.0,
        "seed {seed}: the long-lived workers went from {} to {} threads",
        r.threads.0,
        r.threads.1
    );
}
