//! When calls run: concurrent actors (`max_concurrency`, concurrency
//! groups, `&mut self` exclusion) and arguments resolved before a call
//! takes its turn (the worker's HO-1 … HO-3).

use std::time::{Duration, Instant};

use rdt::prelude::*;
use rdt_integration_tests::actors::*;
use rdt_integration_tests::deadline;

const DL: u64 = 60;

#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_calls_run_ten_at_a_time_and_finish_out_of_order() {
    deadline(DL, async {
        rdt_integration_tests::logs();
        let rt = Runtime::start().await.unwrap();
        let j = rt.spawn::<Juggler>(()).await.unwrap();
        // Later calls of each ten sleep less: run concurrently, they finish
        // before earlier ones.
        let nap = |i: u32| 20 + 5 * (9 - u64::from(i % 10));
        let serial: Duration = (0..100).map(|i| Duration::from_millis(nap(i))).sum();
        let t0 = Instant::now();
        let refs: Vec<_> = (0..100).map(|i| j.nap(nap(i), i).remote()).collect();
        let tags = rt.get_all(&refs).await.unwrap();
        let took = t0.elapsed();
        assert_eq!(tags, (0..100).collect::<Vec<_>>());
        let (peak, _) = rt.get(j.peaks().remote()).await.unwrap();
        assert_eq!(
            peak, 10,
            "max_concurrency = 10 must be reached, never passed"
        );
        let finished = rt.get(j.finished().remote()).await.unwrap();
        assert_eq!(finished.len(), 100);
        assert_ne!(
            finished,
            (0..100).collect::<Vec<_>>(),
            "calls that sleep less finish first"
        );
        eprintln!("100 calls: {took:?} (serially {serial:?})");
        // A tenth of the serial time plus the calls' own cost; half is a
        // bound no serial schedule can meet.
        assert!(took < serial / 2, "took {took:?}, serially {serial:?}");
        rt.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_later_call_can_release_an_earlier_one() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let j = rt.spawn::<Juggler>(()).await.unwrap();
        // Serially this would never end: the first call waits for the
        // second.
        let waiting = j.wait_gate(1).remote();
        let opener = j.open_gate(1).remote();
        rt.get(&opener).await.unwrap();
        assert_eq!(rt.get(&waiting).await.unwrap(), 1);
        rt.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_mut_self_call_runs_alone() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let j = rt.spawn::<Juggler>(()).await.unwrap();
        let before: Vec<_> = (0..10).map(|i| j.nap(30, i).remote()).collect();
        let reset = j.reset().remote();
        let after: Vec<_> = (10..20).map(|i| j.nap(30, i).remote()).collect();
        assert_eq!(
            rt.get(&reset).await.unwrap(),
            0,
            "`&mut self` started while other calls ran"
        );
        rt.get_all(&before).await.unwrap();
        rt.get_all(&after).await.unwrap();
        // The reset cleared the log: only the calls submitted after it
        // (which waited for it) are in it.
        let mut finished = rt.get(j.finished().remote()).await.unwrap();
        finished.sort();
        assert_eq!(finished, (10..20).collect::<Vec<_>>());
        rt.shutdown().await;
    })
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_concurrency_group_has_its_own_limit() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let j = rt.spawn::<Juggler>(()).await.unwrap();
        // The default group is busy with a call that waits; the io group
        // still runs, two at a time.
        let waiting = j.wait_gate(3).remote();
        let io: Vec<_> = (0..8).map(|_| j.io_nap(20).remote()).collect();
        let peaks = rt.get_all(&io).await.unwrap();
        assert_eq!(peaks.iter().max(), Some(&2));
        rt.get(j.open_gate(3).remote()).await.unwrap();
        rt.get(&waiting).await.unwrap();
        rt.shutdown().await;
    })
    .await
}

/// An argument still being produced no longer holds back a serial actor's
/// later calls; calls that waited keep their order among themselves.
async fn pending_argument(t: Transport) {
    let rt = Runtime::start().await.unwrap();
    let j = rt.spawn::<Juggler>(()).await.unwrap();
    let r = rt.spawn::<Recorder>(()).await.unwrap();
    let make = |g: u32, v: f32| j.tensor_after_gate(g, v, 4).transport(t).remote();
    let first = make(1, 1.0);
    let second = make(2, 2.0);
    let took_first = r.take(&first, 1).remote();
    let took_second = r.take(&second, 2).remote();
    // Not waiting for anything: runs now, though two calls before it
    // wait for arguments whose producers are stuck.
    assert_eq!(rt.get(r.note(3).remote()).await.unwrap(), 3);
    assert_eq!(rt.get(r.log().remote()).await.unwrap(), vec![3]);
    // The second argument arrives first; its call still runs after the
    // first one's.
    rt.get(j.open_gate(2).remote()).await.unwrap();
    rt.wait(&second).await.unwrap();
    assert_eq!(rt.get(r.note(4).remote()).await.unwrap(), 4);
    rt.get(j.open_gate(1).remote()).await.unwrap();
    assert_eq!(rt.get(&took_first).await.unwrap(), 4.0);
    assert_eq!(rt.get(&took_second).await.unwrap(), 8.0);
    assert_eq!(rt.get(r.log().remote()).await.unwrap(), vec![3, 4, 1, 2]);
    rt.shutdown().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pending_argument_does_not_delay_an_unrelated_call_object_store() {
    deadline(DL, pending_argument(Transport::ObjectStore)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn a_pending_argument_does_not_delay_an_unrelated_call_shm() {
    deadline(DL, pending_argument(Transport::Shm)).await
}

#[tokio::test(flavor = "multi_thread")]
async fn wait_many_returns_the_first_to_finish() {
    deadline(DL, async {
        let rt = Runtime::start().await.unwrap();
        let j = rt.spawn::<Juggler>(()).await.unwrap();
        let refs: Vec<_> = (11..14)
            .map(|g| j.tensor_after_gate(g, g as f32, 2).remote())
            .collect();
        rt.get(j.open_gate(12).remote()).await.unwrap();
        let (done, pending) = rt.wait_many(&refs, 1, None).await.unwrap();
        assert_eq!(
            done.iter().map(|r| r.id()).collect::<Vec<_>>(),
            vec![refs[1].id()]
        );
        assert_eq!(
            pending.iter().map(|r| r.id()).collect::<Vec<_>>(),
            vec![refs[0].id(), refs[2].id()]
        );
        // Asking for more than can finish: the deadline ends the wait with
        // what finished.
        let (done, pending) = rt
            .wait_many(&refs, 3, Some(Duration::from_millis(50)))
            .await
            .unwrap();
        assert_eq!((done.len(), pending.len()), (1, 2));
        for g in [11, 13] {
            rt.get(j.open_gate(g).remote()).await.unwrap();
        }
        let (done, pending) = rt.wait_many(&refs, 3, None).await.unwrap();
        assert_eq!((done.len(), pending.len()), (3, 0));
        let e = rt.wait_many(&refs, 4, None).await.unwrap_err();
        assert!(e.to_string().contains("at most 3"), "{e}");
        rt.shutdown().await;
    })
    .await
}
