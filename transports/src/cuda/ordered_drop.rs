//! Stream-ordered drops, in bulk: memory that must not go back while rdt's
//! stream on its GPU may still read it (a `cuda_ipc` import, which goes
//! back to its producer) is handed here when it is dropped, and dropped for
//! real once that stream has passed every piece of work enqueued before
//! (as PyTorch's `record_stream`).
//!
//! Why a queue and a thread: a weights sync drops thousands of imported
//! tensors at once. Asking the GPU at each drop (a stream query, and an
//! event to record and query when the stream was busy) cost two to four
//! CUDA calls per tensor on the path of the `Free` that dropped them. Here
//! a drop is a push onto a queue; one thread ([`THREAD_NAME`]) takes
//! everything queued, marks the stream once per GPU, waits for the mark
//! (polling, with a growing pause: it never spins on a core for long) and
//! drops the batch.
//!
//! # Invariants
//!
//! - **OD-1 (the mark comes after the drop).** A batch's mark is recorded
//!   after every drop in it was queued, so it covers all work enqueued on
//!   the stream before any of those drops. A mark recorded earlier and
//!   reused would not: work enqueued between it and a later drop could
//!   still read that memory.
//! - **OD-2 (a broken stream reads nothing).** If the mark cannot be
//!   recorded or queried (the context is broken), the batch is dropped at
//!   once: no work of that stream runs any more.
//! - **OD-3 (settling has a deadline).** [`settle`] waits until everything
//!   queued before it was dropped, for at most its deadline, and says
//!   whether it got there.

use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::Gpu;

/// The name of the thread that drops queued items.
pub const THREAD_NAME: &str = "rdt-cuda-drop";

/// Something to drop once its GPU's stream passed what was queued before.
type Item = (Arc<Gpu>, Box<dyn Send>);

/// A batch's items of one GPU.
type GpuBatch = (Arc<Gpu>, Vec<Box<dyn Send>>);

#[derive(Default)]
struct State {
    queued: Vec<Item>,
    /// The thread holds a batch it has not dropped yet.
    busy: bool,
}

struct Queue {
    state: Mutex<State>,
    /// Something was queued (the thread waits on it).
    work: Condvar,
    /// The queue is empty and the thread idle (`settle` waits on it).
    idle: Condvar,
}

static QUEUE: OnceLock<Queue> = OnceLock::new();

/// The queue, with its thread started on first use.
fn queue() -> &'static Queue {
    QUEUE.get_or_init(|| {
        // The thread's first `queue()` waits for this initialization.
        std::thread::Builder::new()
            .name(THREAD_NAME.into())
            .spawn(run)
            .expect("spawn the CUDA stream-ordered drop thread");
        Queue {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            idle: Condvar::new(),
        }
    })
}

/// Drops `item` once `gpu`'s rdt stream has passed everything enqueued on
/// it before this call. Costs a lock and a push; wakes the thread only when
/// the queue was empty.
pub(crate) fn drop_after_stream(gpu: Arc<Gpu>, item: Box<dyn Send>) {
    let q = queue();
    let mut st = q.state.lock();
    let wake = st.queued.is_empty();
    st.queued.push((gpu, item));
    drop(st);
    if wake {
        q.work.notify_one();
    }
}

/// Waits until everything queued before this call has been dropped, for at
/// most `deadline` (OD-3): true if it was. Blocks the calling thread.
pub fn settle(deadline: Duration) -> bool {
    let Some(q) = started() else {
        return true;
    };
    // A deadline too long to add to now (`Duration::MAX`) is no deadline.
    let until = Instant::now().checked_add(deadline);
    let mut st = q.state.lock();
    while st.busy || !st.queued.is_empty() {
        match until {
            Some(until) => {
                if q.idle.wait_until(&mut st, until).timed_out() {
                    return !st.busy && st.queued.is_empty();
                }
            }
            None => q.idle.wait(&mut st),
        }
    }
    true
}

/// Items queued or being dropped now.
#[cfg(test)]
fn pending() -> usize {
    started().map_or(0, |q| {
        let st = q.state.lock();
        st.queued.len() + usize::from(st.busy)
    })
}

/// The queue, if this process ever queued anything (no thread otherwise).
fn started() -> Option<&'static Queue> {
    QUEUE.get()
}

fn run() {
    let q = queue();
    loop {
        let batch = {
            let mut st = q.state.lock();
            while st.queued.is_empty() {
                st.busy = false;
                q.idle.notify_all();
                q.work.wait(&mut st);
            }
            st.busy = true;
            std::mem::take(&mut st.queued)
        };
        drop_batch(batch);
    }
}

/// Drops a batch, GPU by GPU, each once its stream passed a mark recorded
/// now (OD-1, OD-2).
fn drop_batch(batch: Vec<Item>) {
    let mut per_gpu: Vec<GpuBatch> = Vec::new();
    for (gpu, item) in batch {
        match per_gpu.iter_mut().find(|(g, _)| Arc::ptr_eq(g, &gpu)) {
            Some((_, items)) => items.push(item),
            None => per_gpu.push((gpu, vec![item])),
        }
    }
    for (gpu, items) in per_gpu {
        if let Ok(mark) = gpu.completion() {
            let mut pause = Duration::from_micros(10);
            while let Ok(false) = mark.passed() {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
        }
        drop(items);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// OD-3 where nothing was ever queued (every process without imports):
    /// nothing to wait for, and no thread started.
    #[test]
    fn settling_with_nothing_queued_returns_at_once() {
        if QUEUE.get().is_some() {
            return; // another test of this binary queued drops
        }
        let t = Instant::now();
        assert!(settle(Duration::from_secs(5)));
        assert!(t.elapsed() < Duration::from_secs(1));
        assert_eq!(pending(), 0);
        assert!(QUEUE.get().is_none(), "settling started no thread");
    }
}
