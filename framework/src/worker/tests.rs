//! The worker's unit tests (the group queue, GQ-2).

use super::*;

/// GQ-2: the group's thread takes its jobs in the order queued,
/// whether it spins alone, spins beside a task of its own, or waits
/// plainly past the window, and sees the queue close.
#[test]
fn the_group_thread_takes_jobs_in_order_and_sees_the_queue_close() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
    let ran = Arc::new(Mutex::new(Vec::new()));
    let job = |n: u32| -> Job {
        let ran = ran.clone();
        Box::pin(async move { ran.lock().push(n) })
    };
    let sender = std::thread::spawn({
        let (j1, j2, j3, j4) = (job(1), job(2), job(3), job(4));
        move || {
            tx.send(j1).unwrap();
            std::thread::sleep(Duration::from_millis(1));
            tx.send(j2).unwrap();
            std::thread::sleep(Duration::from_millis(5));
            tx.send(j3).unwrap();
            // Past the window: the plain wait takes it.
            std::thread::sleep(Duration::from_millis(40));
            tx.send(j4).unwrap();
        }
    });
    let taken = rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(10), async {
            // A task of the runtime's own, alive for a while: asks
            // once per yield meanwhile.
            tokio::spawn(tokio::time::sleep(Duration::from_millis(3)));
            let mut n = 0;
            while let Some(job) = next_job(&mut rx, Duration::from_millis(20)).await {
                job.await;
                n += 1;
            }
            n
        })
        .await
        .expect("deadline")
    });
    sender.join().unwrap();
    assert_eq!(taken, 4);
    assert_eq!(*ran.lock(), vec![1, 2, 3, 4]);
}
