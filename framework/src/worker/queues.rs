//! The per-group FIFO of two-sided transfers (XF-3), served by a thread of its own.

use super::*;

/// A collective group this worker is in: its backend, its members, and its
/// ordered queue of two-sided transfers (XF-3), served by a thread of its
/// own (which can also host a backend's `!Send` handles).
pub(super) struct WorkerGroup {
    pub(super) backend: Transport,
    pub(super) spec: rdt_transport::GroupSpec,
    pub(super) queue: tokio::sync::mpsc::UnboundedSender<Job>,
    pub(super) broken: Option<String>,
}

/// A transfer waiting its turn in a group's queue.
pub(super) type Job = futures::future::BoxFuture<'static, ()>;

/// Starts the thread that runs a group's transfers one after the other, in
/// the order the control loop queued them (the driver's order). It ends
/// when the group is dropped and its queue has drained.
pub(super) fn start_group_queue(
    group: u64,
) -> std::io::Result<tokio::sync::mpsc::UnboundedSender<Job>> {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<Job>();
    // Timers only: no transport's group transfer does tokio I/O (`tcp`
    // moves bytes on threads of its own, NCCL on the GPU), and with an I/O
    // driver every yield of this thread's hot waits (its next transfer, a
    // landing) was an `epoll_wait` system call, so each round of those
    // waits saw what it waited for microseconds late.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    std::thread::Builder::new()
        .name(format!("rdt-group-{group}"))
        .spawn(move || {
            rt.block_on(async move {
                // Hot (rdt_transport::rt::hot): the next transfer of a pass
                // often comes within the window, and waking this thread
                // after it slept costs more than the spin.
                while let Some(job) = next_job(&mut rx, hot::window()).await {
                    job.await;
                }
            })
        })?;
    Ok(tx)
}

/// How long the group's thread asks its queue in a tight loop between
/// yields while it has nothing else to run (GQ-2).
pub(super) const PICKUP_SPIN: Duration = Duration::from_micros(20);

/// The group's next job (GQ-2), asked for with `try_recv` (tens of
/// nanoseconds) for up to the hot window, then awaited plainly. While
/// the group's runtime has no task of its own to run (the last job's
/// landing watch and acknowledgement have ended), the asks go on in a
/// tight loop for [`PICKUP_SPIN`] between yields; otherwise one ask per
/// yield, as the hot wait did. The hot wait's yield to the runtime after
/// every ask (its timer driver, its queues) left a job the control loop
/// queued 1.4-2.1 us before this thread took it, on both ends of every
/// small transfer (2xH100 and 2xH200 timelines). `window` is the hot
/// window (zero: a plain wait).
pub(super) async fn next_job(
    rx: &mut tokio::sync::mpsc::UnboundedReceiver<Job>,
    window: Duration,
) -> Option<Job> {
    use tokio::sync::mpsc::error::TryRecvError;
    if window.is_zero() {
        return hot(rx.recv()).await;
    }
    let metrics = tokio::runtime::Handle::current().metrics();
    let t0 = std::time::Instant::now();
    while t0.elapsed() < window {
        let spin_until =
            (metrics.num_alive_tasks() == 0).then(|| std::time::Instant::now() + PICKUP_SPIN);
        loop {
            match rx.try_recv() {
                Ok(job) => return Some(job),
                Err(TryRecvError::Disconnected) => return None,
                Err(TryRecvError::Empty) => {}
            }
            match spin_until {
                Some(until) if std::time::Instant::now() < until => std::hint::spin_loop(),
                _ => break,
            }
        }
        tokio::task::yield_now().await;
    }
    rx.recv().await
}
