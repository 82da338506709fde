//! The `nixl` transport beyond the semantic suite, on the CPU (DRAM over
//! UCX, for real: `scripts/install-nixl.sh` puts NIXL where rdt finds it).
//! Each test proves the NIXL path ran from the counters of the processes
//! involved (`rdt::data::nixl::stats`): reads posted by the consumer,
//! reads served (NIXL notifications) at the producer.

use std::time::Duration;

use rdt::data::nixl::{stats, NixlStats};
use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::{deadline, spin_until};

const DL: u64 = 120;

/// Tests that read the driver's own counters (process-wide) run one at a
/// time.
static DRIVER_COUNTERS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn start() -> (Runtime, ProducerHandle, ConsumerHandle) {
    rdt_integration_tests::logs();
    let rt = Runtime::start().await.unwrap();
    let p = rt.spawn::<Producer>(()).await.unwrap();
    let c = rt.spawn::<Consumer>(()).await.unwrap();
    (rt, p, c)
}

async fn of_producer(rt: &Runtime, p: &ProducerHandle) -> NixlStats {
    rt.get(p.nixl_stats().remote()).await.unwrap()
}

async fn of_consumer(rt: &Runtime, c: &ConsumerHandle) -> NixlStats {
    rt.get(c.nixl_stats().remote()).await.unwrap()
}

/// Waits until `f` holds, within 20 s (the counters follow frees, which
/// cross the control plane).
async fn eventually<F, Fut>(what: &str, mut f: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let end = tokio::time::Instant::now() + Duration::from_secs(20);
    while !f().await {
        assert!(tokio::time::Instant::now() < end, "{what} within 20 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Process `pid` has exited: reaped, or a zombie (its memory released).
fn exited(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // The state follows the name, which is in parentheses.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z')),
    }
}

/// The producer learns of each finished read from NIXL's notification,
/// which follows the read's completion by a moment.
/// A tensor of `n` f32 equal to `v`, made by the producer before it is
/// passed on: its value comes through the driver's delivery, not straight
/// from the producer.
async fn produced(rt: &Runtime, p: &ProducerHandle, v: f32, n: usize) -> ObjectRef<Tensor> {
    let r = p.make(v, n).transport(Transport::Nixl).remote();
    rt.wait(&r).await.unwrap();
    r
}

async fn producer_served(rt: &Runtime, p: &ProducerHandle, n: u64) {
    eventually(&format!("{n} reads served at the producer"), || async {
        of_producer(rt, p).await.reads_served == n
    })
    .await;
}

/// Workers make their agents with UCX's memory hooks off
/// (`rdt::data::nixl::prepare_process`): the setting the driver's process
/// has (rdt's default, `no`, unless the environment chose), and the first
/// read's agent, connection and metadata are counted and timed.
#[tokio::test]
async fn a_workers_agent_starts_with_ucx_memory_hooks_off() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let here = std::env::var("UCX_MEM_EVENTS").ok();
        assert!(
            here.is_some(),
            "rdt's start-up gave this process UCX_MEM_EVENTS"
        );
        let there = rt.get(c.env_var("UCX_MEM_EVENTS").remote()).await.unwrap();
        assert_eq!(there, here, "the worker has the same UCX setting");
        let before = of_consumer(&rt, &c).await;
        let r = produced(&rt, &p, 2.0, 256).await;
        assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 512.0);
        let after = of_consumer(&rt, &c).await;
        assert_eq!(
            after.reads_posted - before.reads_posted,
            1,
            "read over NIXL"
        );
        assert!(after.agent_make_nanos > 0, "the consumer made its agent");
        assert!(
            after.remote_loads >= 2 && after.remote_load_nanos > 0,
            "the producer's connection and registration were loaded, timed: {after:?}"
        );
        rt.shutdown().await;
    })
    .await;
}

#[tokio::test]
async fn ten_thousand_tensors_are_one_registration_and_one_descriptor() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let (p0, c0) = (of_producer(&rt, &p).await, of_consumer(&rt, &c).await);
        let n = 10_000;
        let r = p.make_many(n, 1024).transport(Transport::Nixl).remote();
        let total = rt.get(c.sum_many(&r).remote()).await.unwrap();
        assert_eq!(total, 1024.0 * (n * (n - 1) / 2) as f64);
        let (p1, c1) = (of_producer(&rt, &p).await, of_consumer(&rt, &c).await);
        assert_eq!(p1.registrations - p0.registrations, 1, "one region");
        assert_eq!(c1.reads_posted - c0.reads_posted, 1, "one READ");
        assert_eq!(
            c1.descriptors_posted - c0.descriptors_posted,
            1,
            "neighbours coalesced into one descriptor"
        );
        assert_eq!(p0.reads_served, 0);
        producer_served(&rt, &p, 1).await;
    })
    .await;
}

/// A small object read again (the same ref passed to calls one after
/// another) finds the read plan its first read made: its head is found
/// again by its bytes, and the plan by the head's layout.
#[tokio::test]
async fn a_small_object_read_again_reuses_its_read_plan() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let r = p.make(3.0, 1024).transport(Transport::Nixl).remote();
        let c0 = of_consumer(&rt, &c).await;
        let passes = 5u64;
        for _ in 0..passes {
            assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 3.0 * 1024.0);
        }
        let c1 = of_consumer(&rt, &c).await;
        assert_eq!(c1.reads_posted - c0.reads_posted, passes, "one READ a pass");
        assert_eq!(c1.read_plans_made - c0.read_plans_made, 1, "planned once");
        assert_eq!(c1.read_plans_reused - c0.read_plans_reused, passes - 1);
    })
    .await;
}

/// NX-11 in host memory: after a small host read, the consumer makes the
/// next destination of its plan ahead, and the next pass posts into it;
/// while it waits its bytes count as ready, not in use, so a consumer
/// with every object freed still has no host bytes in use.
#[tokio::test]
async fn a_small_host_read_again_finds_its_destination_made_ahead() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let r = p.make_kept(0.0, 1024).transport(Transport::Nixl).remote();
        rt.wait(&r).await.unwrap();
        let c0 = of_consumer(&rt, &c).await;
        for k in 1..=6u32 {
            // New values each pass: the READ into a ready destination
            // moves the bytes.
            rt.get(p.write_kept(0, k as f32).remote()).await.unwrap();
            assert_eq!(
                rt.get(c.sum(&r).remote()).await.unwrap(),
                f64::from(k) * 1024.0,
                "pass {k} read its bytes"
            );
        }
        let c1 = of_consumer(&rt, &c).await;
        rdt_integration_tests::assert_destinations_made_ahead(&c0, &c1, 6);
        drop(r);
        rt.transfers_settled().await;
        eventually(
            "the consumer's taken memory is back in its pool",
            || async {
                let s = of_consumer(&rt, &c).await;
                s.host_bytes_in_use == 0 && s.host_bytes_ready == 4096
            },
        )
        .await;
    })
    .await;
}

/// WK-8: a call that waits for a large object as its argument makes the
/// object's tensors itself, on the actor's thread, while the READ runs:
/// the receive hands it the list instead of making them on a runtime
/// thread. Every large receive has its tensors made ahead exactly once,
/// by one or the other, and the values are right either way.
#[tokio::test]
async fn a_waiting_call_makes_a_large_objects_tensors_on_its_own_thread() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let (n, numel) = (1000usize, 16usize);
        let passes = 5u64;
        let c0 = of_consumer(&rt, &c).await;
        for _ in 0..passes {
            // Submitted together: the consumer's call is on its actor's
            // thread, waiting for the object, long before the producer
            // has made 1000 tensors and the delivery comes.
            let r = p.make_many(n, numel).transport(Transport::Nixl).remote();
            let total = rt.get(c.sum_many(&r).remote()).await.unwrap();
            assert_eq!(total, numel as f64 * (n * (n - 1) / 2) as f64);
        }
        let c1 = of_consumer(&rt, &c).await;
        assert_eq!(c1.reads_posted - c0.reads_posted, passes, "one READ a pass");
        let by_reader = c1.lists_made_by_reader - c0.lists_made_by_reader;
        let by_receive = c1.lists_premade - c0.lists_premade;
        assert_eq!(by_reader + by_receive, passes, "made ahead once a pass");
        assert!(
            by_reader >= 1,
            "the waiting call made the tensors in {by_reader} of {passes} passes"
        );
    })
    .await;
}

/// A weight sync: the same parameters, written in place between steps,
/// passed in a new object each step. The first receive makes a read plan
/// and the later ones find it (NX-7: the handles name no object), each
/// with its own READ of the new values; parameters of another layout get
/// a plan of their own.
#[tokio::test]
async fn every_step_of_a_weight_sync_reads_through_the_first_steps_plan() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let (n, numel) = (200usize, 16usize);
        let want = |first: f32, numel: usize| -> Vec<f64> {
            (0..n)
                .map(|i| (first + i as f32) as f64 * numel as f64)
                .collect()
        };
        let at = rt.get(p.keep_many(n, numel, 0.0).remote()).await.unwrap();
        let c0 = of_consumer(&rt, &c).await;
        for step in 0..3 {
            let first = 1000.0 * step as f32;
            rt.get(p.step_kept(at, n, first).remote()).await.unwrap();
            let r = p.kept_range(at, n).transport(Transport::Nixl).remote();
            let got = rt.get(c.sums(&r).remote()).await.unwrap();
            assert_eq!(got, want(first, numel), "step {step}");
        }
        let c1 = of_consumer(&rt, &c).await;
        assert_eq!(c1.reads_posted - c0.reads_posted, 3, "one READ per step");
        assert_eq!(
            c1.read_plans_made - c0.read_plans_made,
            1,
            "the first step made the plan"
        );
        assert_eq!(
            c1.read_plans_reused - c0.read_plans_reused,
            2,
            "the later steps found it"
        );
        // The same number of parameters, twice the size: another layout.
        let other = rt
            .get(p.keep_many(n, 2 * numel, 5.0).remote())
            .await
            .unwrap();
        let r = p.kept_range(other, n).transport(Transport::Nixl).remote();
        let got = rt.get(c.sums(&r).remote()).await.unwrap();
        assert_eq!(got, want(5.0, 2 * numel));
        let c2 = of_consumer(&rt, &c).await;
        assert_eq!(
            c2.read_plans_made - c1.read_plans_made,
            1,
            "a plan of its own"
        );
        assert_eq!(c2.read_plans_reused, c1.read_plans_reused);
        // And the first layout's plan is still found.
        let r = p.kept_range(at, n).transport(Transport::Nixl).remote();
        let got = rt.get(c.sums(&r).remote()).await.unwrap();
        assert_eq!(got, want(2000.0, numel));
        let c3 = of_consumer(&rt, &c).await;
        assert_eq!(c3.read_plans_reused - c2.read_plans_reused, 1);
    })
    .await;
}

/// A weight update in place, step after step (`get_into` the same
/// parameters, the producer's same tensors in a new object each step):
/// the first step works out the read into the parameters, and the later
/// ones find that plan (NX-8), each with its own READ of the new values.
/// New parameters (other storages) get a plan of their own.
#[tokio::test]
async fn every_update_in_place_reads_through_the_first_updates_plan() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let (n, numel) = (200usize, 16usize);
        let want = |first: f32| -> Vec<f64> {
            (0..n)
                .map(|i| (first + i as f32) as f64 * numel as f64)
                .collect()
        };
        let at = rt.get(p.keep_many(n, numel, 0.0).remote()).await.unwrap();
        let update = |first: f32| {
            let (rt, p, c) = (&rt, &p, &c);
            async move {
                rt.get(p.step_kept(at, n, first).remote()).await.unwrap();
                let r = p.kept_range(at, n).transport(Transport::Nixl).remote();
                let (sums, same) = rt
                    .get(c.update_params(&r, n, numel).remote())
                    .await
                    .unwrap();
                assert!(same, "the value got back holds the parameters");
                assert_eq!(sums, want(first), "every parameter holds its new value");
            }
        };
        let c0 = of_consumer(&rt, &c).await;
        for step in 0..3 {
            update(1000.0 * step as f32).await;
        }
        let c1 = of_consumer(&rt, &c).await;
        assert_eq!(c1.reads_posted - c0.reads_posted, 3, "one READ per step");
        assert_eq!(
            c1.target_plans_reused - c0.target_plans_reused,
            2,
            "the later steps found the first step's plan"
        );
        assert_eq!(rt.get(c.in_place().remote()).await.unwrap(), 3);
        // Other parameters: the plan does not fit them, and the update
        // still lands in them.
        assert_eq!(rt.get(c.drop_params().remote()).await.unwrap(), n);
        update(7.0).await;
        let c2 = of_consumer(&rt, &c).await;
        assert_eq!(
            c2.target_plans_reused, c1.target_plans_reused,
            "new parameters, a new plan"
        );
        update(8.0).await;
        let c3 = of_consumer(&rt, &c).await;
        assert_eq!(c3.target_plans_reused - c2.target_plans_reused, 1);
        assert_eq!(rt.get(c.in_place().remote()).await.unwrap(), 5);
    })
    .await;
}

/// Updates into parameters the consumer keeps as one `rdt::Targets`: from
/// the second on, the read plan is found for that very list (no places or
/// metadata compared), and each lands in place. An object of another
/// layout still fails the check into the same targets, losing nothing,
/// and the updates go on after it.
#[tokio::test]
async fn updates_into_kept_targets_are_checked_once_per_layout() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        // Enough tensors for a head that is kept and found again (2 KiB or
        // more), so each step's head has the first one's layout.
        let (n, numel) = (1000usize, 4usize);
        let at = rt.get(p.keep_many(n, numel, 0.0).remote()).await.unwrap();
        let update = |first: f32| {
            let (rt, p, c) = (&rt, &p, &c);
            async move {
                rt.get(p.step_kept(at, n, first).remote()).await.unwrap();
                let r = p.kept_range(at, n).transport(Transport::Nixl).remote();
                let (sums, same) = rt.get(c.update_kept(&r, n, numel).remote()).await.unwrap();
                assert!(same, "the value got back holds the kept parameters");
                let want: Vec<f64> = (0..n)
                    .map(|i| f64::from(first + i as f32) * numel as f64)
                    .collect();
                assert_eq!(sums, want, "every parameter holds its new value");
            }
        };
        let c0 = of_consumer(&rt, &c).await;
        for step in 0..3 {
            update(100.0 * step as f32).await;
        }
        let c1 = of_consumer(&rt, &c).await;
        assert_eq!(c1.reads_posted - c0.reads_posted, 3, "one READ per step");
        assert_eq!(c1.target_plans_reused - c0.target_plans_reused, 2);
        assert_eq!(
            c1.target_lists_reused - c0.target_lists_reused,
            2,
            "the later steps read into the plan's own target list"
        );
        assert_eq!(rt.get(c.in_place().remote()).await.unwrap(), 3);

        // Another layout (one element more per tensor) into the same
        // targets: refused before any byte moves, and still readable.
        let other = p
            .make_version(n, numel + 1, 5.0)
            .transport(Transport::Nixl)
            .remote();
        let e = rt
            .get(c.update_kept(&other, n, numel).remote())
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("target tensors given for object"),
            "a mismatch is a targets error: {e}"
        );
        let c2 = of_consumer(&rt, &c).await;
        assert_eq!(c2.reads_posted, c1.reads_posted + 1, "read anywhere, once");
        let sums: Vec<f64> = rt.get(c.sums(&other).remote()).await.unwrap();
        assert_eq!(sums[0], 5.0 * (numel + 1) as f64, "the object is intact");

        // The next step of the first layout lands in place again.
        update(900.0).await;
        let c3 = of_consumer(&rt, &c).await;
        assert_eq!(c3.target_lists_reused - c2.target_lists_reused, 1);
        assert_eq!(rt.get(c.in_place().remote()).await.unwrap(), 4);
    })
    .await;
}

/// A weight update of 10 000 tensors into an actor's own parameters
/// (`get_into`): the first moves the parameters into one registered
/// region, and from then on each update is one READ of one descriptor
/// straight into them, with no new registration.
#[tokio::test]
async fn ten_thousand_tensors_are_read_into_the_parameters_in_place() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let (n, numel) = (10_000usize, 1024usize);
        let mut regs = Vec::new();
        for (k, first) in [0.0f32, 1.0, 2.0].into_iter().enumerate() {
            let c0 = of_consumer(&rt, &c).await;
            let r = p
                .make_version(n, numel, first)
                .transport(Transport::Nixl)
                .remote();
            let (sums, same) = rt
                .get(c.update_params(&r, n, numel).remote())
                .await
                .unwrap();
            assert!(same, "the value got back holds the parameters");
            let want = |i: usize| f64::from(first + i as f32) * numel as f64;
            assert!(
                sums.iter().enumerate().all(|(i, &s)| s == want(i)),
                "update {k}: every parameter holds its new value"
            );
            let c1 = of_consumer(&rt, &c).await;
            assert_eq!(c1.reads_posted - c0.reads_posted, 1, "one READ");
            assert_eq!(
                c1.descriptors_posted - c0.descriptors_posted,
                1,
                "one descriptor"
            );
            regs.push(c1.registrations - c0.registrations);
        }
        assert_eq!(
            regs[1..],
            [0, 0],
            "later updates register nothing new: {regs:?}"
        );
        assert_eq!(rt.get(c.in_place().remote()).await.unwrap(), 3);
    })
    .await;
}

/// Targets nixl cannot read into (another transport's memory: a tensor
/// received over shm) are no error: the object is received elsewhere and
/// copied into them.
#[tokio::test]
async fn targets_nixl_cannot_write_are_copied_into() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let held = p.make_shm(0.0, 1000).remote();
        assert_eq!(rt.get(c.hold(&held).remote()).await.unwrap(), 1);
        let r = p
            .make_version(1, 1000, 3.0)
            .transport(Transport::Nixl)
            .remote();
        let sums = rt.get(c.update_held(&r).remote()).await.unwrap();
        assert_eq!(sums, [3000.0]);
        assert_eq!(rt.get(c.in_place().remote()).await.unwrap(), 0, "copied in");
        assert_eq!(rt.get(c.received("nixl").remote()).await.unwrap(), 1);
    })
    .await;
}

#[tokio::test]
async fn the_agent_and_its_connection_are_reused_over_many_transfers() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        for i in 0..50 {
            let r = p.make(i as f32, 256).transport(Transport::Nixl).remote();
            assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), i as f64 * 256.0);
        }
        let s = of_consumer(&rt, &c).await;
        assert_eq!(s.reads_posted, 50);
        // One connection and one pooled slab, loaded once: the agent is
        // never loaded twice, nor forgotten; no registration per object.
        assert_eq!(s.remote_loads, 2, "{s:?}");
        assert_eq!(s.remote_forgets, 0);
        assert_eq!(s.registrations, 1, "the consumer's one pooled slab");
        producer_served(&rt, &p, 50).await;
        let ps = of_producer(&rt, &p).await;
        assert_eq!(ps.registrations, 1, "the producer's one pooled slab");
        // Every object was freed after its call: its memory went back to
        // the pools on both sides.
        eventually("the memory is back in the pools", || async {
            of_producer(&rt, &p).await.host_bytes_in_use == 0
                && of_consumer(&rt, &c).await.host_bytes_in_use == 0
        })
        .await;
    })
    .await;
}

#[tokio::test]
async fn a_small_read_from_a_known_producer_starts_once_its_call_is_handed_on() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let on_loop = || async { rt.get(c.started_after_frames().remote()).await.unwrap() };
        for i in 0..4 {
            let r = produced(&rt, &p, i as f32, 256).await;
            assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), i as f64 * 256.0);
        }
        // The first read from the producer loaded its metadata and
        // connected, in a task of its own; the next three started on the
        // control loop once the call behind each was handed on.
        assert_eq!(on_loop().await, 3);
        // An object of many tensors (its views are made while it moves)
        // is read in a task of its own.
        let r = p.make_many(100, 16).transport(Transport::Nixl).remote();
        rt.wait(&r).await.unwrap();
        assert_eq!(
            rt.get(c.sum_many(&r).remote()).await.unwrap(),
            16.0 * (100 * 99 / 2) as f64
        );
        assert_eq!(on_loop().await, 3);
        assert_eq!(of_consumer(&rt, &c).await.reads_posted, 5);
    })
    .await;
}

#[tokio::test]
async fn a_long_call_does_not_hold_its_arguments_acknowledgement() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        // The first read from the producer connects; the next starts on
        // the control loop, and is acknowledged while its call still runs
        // (holding it for the reply was tried: see the book's NIXL
        // chapter), so a long method never runs into the transfer's
        // deadline.
        let r = produced(&rt, &p, 1.0, 256).await;
        assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 256.0);
        let r = produced(&rt, &p, 2.0, 256).await;
        let call = c.sum_after(&r, 4000).remote();
        tokio::time::timeout(Duration::from_secs(2), rt.transfers_settled())
            .await
            .expect("the receive was acknowledged while its call still ran");
        assert_eq!(rt.transfers_in_flight(), 0);
        assert_eq!(rt.get(c.started_after_frames().remote()).await.unwrap(), 1);
        assert_eq!(rt.get(call).await.unwrap(), 512.0);
    })
    .await;
}

#[tokio::test]
async fn a_small_object_read_again_posts_its_kept_request_and_sees_new_bytes() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let a = p.make_kept(1.0, 1024).transport(Transport::Nixl).remote();
        rt.wait(&a).await.unwrap();
        let c0 = of_consumer(&rt, &c).await;
        for i in 0..8 {
            // The producer writes its kept tensor between passes: a READ
            // posted again moves the bytes again.
            rt.get(p.write_kept(0, i as f32).remote()).await.unwrap();
            let r = p.kept_again(0).transport(Transport::Nixl).remote();
            rt.wait(&r).await.unwrap();
            assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), i as f64 * 1024.0);
        }
        let c1 = of_consumer(&rt, &c).await;
        assert_eq!(c1.reads_posted - c0.reads_posted, 8);
        // The same remote range each time, into the few destinations the
        // consumer's pool hands out in turn: most READs reuse a request.
        assert!(
            c1.reads_reposted - c0.reads_reposted >= 4,
            "{} of 8 READs posted a kept request",
            c1.reads_reposted - c0.reads_reposted
        );
    })
    .await;
}

#[tokio::test]
async fn the_same_tensor_in_two_objects_is_registered_once() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let a = p.make_kept(3.0, 4096).transport(Transport::Nixl).remote();
        let b = p.kept_again(0).transport(Transport::Nixl).remote();
        let p0 = of_producer(&rt, &p).await;
        assert_eq!(rt.get(c.sum(&a).remote()).await.unwrap(), 3.0 * 4096.0);
        assert_eq!(rt.get(c.sum(&b).remote()).await.unwrap(), 3.0 * 4096.0);
        assert_eq!(
            p0.host_bytes_in_use,
            4 * 4096,
            "the second export publishes the first's memory: no copy"
        );
        producer_served(&rt, &p, 2).await;
        // Writes by the producer to its kept tensor show in a new pass.
        rt.get(p.write_kept(0, 5.0).remote()).await.unwrap();
        let b2 = p.kept_again(0).transport(Transport::Nixl).remote();
        assert_eq!(rt.get(c.sum(&b2).remote()).await.unwrap(), 5.0 * 4096.0);
    })
    .await;
}

#[tokio::test]
async fn two_clones_of_one_storage_in_one_object() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let r = p.twice(2.0, 1000).transport(Transport::Nixl).remote();
        let (a, b) = rt.get(c.sum_pair(&r).remote()).await.unwrap();
        assert_eq!((a, b), (2000.0, 2000.0));
        let s = of_consumer(&rt, &c).await;
        assert_eq!(s.reads_posted, 1);
    })
    .await;
}

#[tokio::test]
async fn a_recycled_address_never_reads_through_an_old_registration() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        // Objects of shrinking sizes above the pool's slab share, each in
        // a slab of its own, freed (trimmed) after it: the producer's next
        // slab lands where the last one was (mmap reuses the hole), with
        // another generation and size. The consumer must notice the overlap, forget
        // the old registration, and read right.
        let mut forgot = false;
        for k in 0..24 {
            let numel = (17 << 18) - k * (64 << 10);
            let r = p
                .make((k + 1) as f32, numel)
                .transport(Transport::Nixl)
                .remote();
            let got = rt.get(c.sum(&r).remote()).await.unwrap();
            assert_eq!(got, (k + 1) as f64 * numel as f64, "pass {k}");
            drop(r);
            rt.transfers_settled().await;
            eventually("the object's slab is freed at the producer", || async {
                // An idle large slab is kept for reuse until trimmed.
                rt.get(p.nixl_trim().remote()).await.unwrap();
                let s = of_producer(&rt, &p).await;
                s.registrations == s.deregistrations
            })
            .await;
            if of_consumer(&rt, &c).await.remote_forgets > 0 {
                forgot = true;
                break;
            }
        }
        assert!(
            forgot,
            "no region was ever reallocated over an old one in 24 passes"
        );
        // And it goes on working.
        let r = p.make(9.0, 100).transport(Transport::Nixl).remote();
        assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 900.0);
    })
    .await;
}

#[tokio::test]
async fn the_driver_gets_directly_and_several_refs_at_once() {
    deadline(DL, async {
        let _one = DRIVER_COUNTERS.lock().await;
        let (rt, p, _c) = start().await;
        let d0 = stats();
        let r = p.make(1.5, 1 << 16).transport(Transport::Nixl).remote();
        let t: Tensor = rt.get(&r).await.unwrap();
        assert_eq!(t.sum().unwrap(), 1.5 * 65536.0);
        let d1 = stats();
        assert_eq!(
            d1.reads_posted - d0.reads_posted,
            1,
            "read by the driver's agent"
        );
        let refs: Vec<ObjectRef<Tensor>> = (0..8)
            .map(|i| p.make(i as f32, 1000).transport(Transport::Nixl).remote())
            .collect();
        let all = rt.get_all(&refs).await.unwrap();
        for (i, t) in all.iter().enumerate() {
            assert_eq!(t.sum().unwrap(), i as f64 * 1000.0);
        }
        assert_eq!(stats().reads_posted - d1.reads_posted, 8);
        producer_served(&rt, &p, 9).await;
        // The driver's copy is its own: dropping the refs frees the
        // producer's memory, and the tensors read stay valid.
        drop(refs);
        drop(r);
        eventually("the producer's memory is back in its pool", || async {
            of_producer(&rt, &p).await.host_bytes_in_use == 0
        })
        .await;
        assert_eq!(all[3].sum().unwrap(), 3000.0);
    })
    .await;
}

#[tokio::test]
async fn the_driver_puts_over_nixl_and_actors_read_it() {
    deadline(DL, async {
        let _one = DRIVER_COUNTERS.lock().await;
        let (rt, _p, c) = start().await;
        let d0 = stats();
        let w = Tensor::full(0.25f32, &[1 << 18]);
        let r = rt.put_with(&w, Transport::Nixl).await.unwrap();
        let d1 = stats();
        assert_eq!(d1.host_bytes_in_use - d0.host_bytes_in_use, 1 << 20);
        assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 0.25 * 262144.0);
        assert_eq!(
            rt.get(c.received("nixl".to_string()).remote())
                .await
                .unwrap(),
            1
        );
        // The driver reads its own object without a transfer.
        let back: Tensor = rt.get(&r).await.unwrap();
        assert!(back.shares_storage(&w), "the driver's own tensor, no copy");
        eventually("the driver was notified of the read", || async {
            stats().reads_served - d0.reads_served == 1
        })
        .await;
        // GC: the last ref and the tensors gone, the memory goes back to
        // the driver's pool.
        drop(r);
        rt.transfers_settled().await;
        assert_eq!(rt.live_objects(), 0);
        assert_eq!(
            stats().host_bytes_in_use,
            d1.host_bytes_in_use,
            "w still holds it"
        );
        drop((w, back));
        assert_eq!(stats().host_bytes_in_use, d0.host_bytes_in_use);
    })
    .await;
}

#[tokio::test]
async fn put_with_refuses_a_transport_the_driver_cannot_hold() {
    deadline(DL, async {
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let e = rt
            .put_with(&Tensor::full(1.0f32, &[4]), Transport::Tcp)
            .await
            .unwrap_err();
        assert!(
            e.to_string().contains("put_with takes Transport::Nixl"),
            "{e}"
        );
        assert_eq!(rt.live_objects(), 0);
    })
    .await;
}

#[tokio::test]
async fn a_producer_that_died_fails_the_read_and_leaves_the_consumer_usable() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let r = p.make(1.0, 1 << 20).transport(Transport::Nixl).remote();
        rt.wait(&r).await.unwrap();
        // The consumer has read from it before (its agent is loaded).
        let warm = p.make(1.0, 10).transport(Transport::Nixl).remote();
        assert_eq!(rt.get(c.sum(&warm).remote()).await.unwrap(), 10.0);
        let pid = p.pid().expect("a local worker");
        // SAFETY: killing a worker process of this test.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        // `kill` returns before the process is gone: a read made at once
        // could still find its memory (CI saw it succeed). Dead first.
        spin_until("the killed producer has exited", 20, || exited(pid)).await;
        // Read while the driver may or may not know yet: the call fails,
        // with the death or with NIXL's failure to read from the peer.
        let e = rt.get(c.sum(&r).remote()).await.unwrap_err().to_string();
        assert!(
            e.contains("died") || e.contains("reading from Producer"),
            "{e}"
        );
        // Once the death is known, every use of its objects says so.
        let e = rt.get(p.echo(1).remote()).await.unwrap_err();
        assert!(matches!(e, Error::ActorDied { .. }), "{e}");
        let e = rt.get(c.sum(&r).remote()).await.unwrap_err();
        assert!(e.to_string().contains("died"), "{e}");
        let e = rt.get(&r).await.unwrap_err();
        assert!(e.to_string().contains("died"), "{e}");
        // The consumer still reads from a new producer.
        let p2 = rt.spawn::<Producer>(()).await.unwrap();
        let r2 = p2.make(2.0, 1000).transport(Transport::Nixl).remote();
        assert_eq!(rt.get(c.sum(&r2).remote()).await.unwrap(), 2000.0);
        assert_eq!(
            rt.get(c.received("nixl".to_string()).remote())
                .await
                .unwrap(),
            2
        );
    })
    .await;
}

/// The producer is killed while the consumer's read of a 256 MiB object
/// is in flight (delivered to the consumer, which is connected to the
/// producer already, and not yet acknowledged): the call fails with the
/// read's error or the death (or, had the read ended first, has the whole
/// value), and nothing of the read is left.
#[tokio::test]
async fn a_producer_killed_mid_read_fails_the_read_and_leaves_the_consumer_usable() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        // The pair is connected first (agent metadata loaded), so that the
        // big read is posted as soon as it is delivered.
        let warm = p.make(1.0, 10).transport(Transport::Nixl).remote();
        assert_eq!(rt.get(c.sum(&warm).remote()).await.unwrap(), 10.0);
        let n = 64 << 20; // 256 MiB of f32: a read that lasts
        let big = p.make(1.0, n).transport(Transport::Nixl).remote();
        rt.wait(&big).await.unwrap();
        let call = c.sum(&big).remote();
        // Kill the producer once the consumer has the read (delivered, not
        // yet acknowledged).
        spin_until("the read delivered", 20, || rt.transfers_in_flight() > 0).await;
        let pid = p.pid().expect("a local worker");
        // SAFETY: killing a worker process of this test.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        let in_flight_at_kill = rt.transfers_in_flight() > 0;
        match rt.get(&call).await {
            Ok(v) => {
                assert_eq!(v, n as f64, "if it finished, it is whole");
                println!(
                    "the read ended before the kill (in flight at the kill: {in_flight_at_kill})"
                );
            }
            Err(e) => {
                let m = e.to_string();
                assert!(
                    m.contains("died") || m.contains("reading from Producer"),
                    "{m}"
                );
                assert!(
                    !m.contains("load_remote_md"),
                    "the read itself failed, not the connection: {m}"
                );
                println!("the read failed: {m}");
            }
        }
        let e = rt.get(p.echo(1).remote()).await.unwrap_err();
        assert!(matches!(e, Error::ActorDied { .. }), "{e}");
        // The consumer still reads, from a new producer, and nothing of the
        // cut read is left: no transfer, no object.
        let p2 = rt.spawn::<Producer>(()).await.unwrap();
        let r2 = p2.make(2.0, 1000).transport(Transport::Nixl).remote();
        assert_eq!(rt.get(c.sum(&r2).remote()).await.unwrap(), 2000.0);
        drop((warm, big, call, r2));
        rt.transfers_settled().await;
        assert_eq!(rt.live_objects(), 0, "every object freed");
        eventually("the consumer's memory is back in its pool", || async {
            of_consumer(&rt, &c).await.host_bytes_in_use == 0
        })
        .await;
    })
    .await;
}

/// OW-9 over `nixl`: a value still being produced when its consumer's call
/// comes is delivered by its producer straight (the consumer counts it)
/// and read over NIXL (one READ posted, one served).
#[tokio::test]
async fn a_pending_value_is_delivered_straight_and_read_over_nixl() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let _busy = p.block(200).remote();
        let r = p.make(2.0, 4096).transport(Transport::Nixl).remote();
        assert_eq!(rt.get(c.sum(&r).remote()).await.unwrap(), 8192.0);
        assert_eq!(rt.get(c.straight().remote()).await.unwrap(), 1);
        assert_eq!(of_consumer(&rt, &c).await.reads_posted, 1);
        producer_served(&rt, &p, 1).await;
    })
    .await;
}

/// NX-13: host memory a NIXL READ writes into (a receive's destination, a
/// target) is written outside the storage's lock, so the safe accessors
/// never put it behind a Rust reference: `with_bytes` hands out a
/// snapshot. At e05be92 it handed out a slice over the region itself,
/// which a READ into the same tensor (a weight update into it) could be
/// writing.
#[tokio::test]
async fn nx_13_nixl_host_memory_is_never_behind_a_reference() {
    deadline(DL, async {
        let (rt, p, c) = start().await;
        let r = produced(&rt, &p, 2.0, 1 << 16).await;
        let (behind, external) = rt
            .get(c.bytes_behind_a_reference(&r).remote())
            .await
            .unwrap();
        assert!(external, "received into NIXL's registered host memory");
        assert!(!behind, "with_bytes gave a reference into NIXL host memory");
        rt.shutdown().await;
    })
    .await
}
