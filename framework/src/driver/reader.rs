//! The reader of one worker's control connection.

use super::*;

/// Reads a worker's messages until its connection ends, then reports its
/// death. With `ping` set (remote workers), a worker silent for longer
/// than `heartbeat` is declared dead too: a cut link gives no end of
/// stream.
pub(super) async fn read_worker(
    mut rx: protocol::Receiver<protocol::ReadHalf>,
    rt: Weak<Inner>,
    worker: u64,
    ping: Option<protocol::Sender>,
    heartbeat: Duration,
) {
    let wake = Arc::new(tokio::sync::Notify::new());
    if let Some(inner) = rt.upgrade() {
        inner.lock().readers.insert(worker, wake.clone());
    }
    let mut last = tokio::time::Instant::now();
    let mut seen = rx.bytes_read();
    let end = loop {
        // Hot (rdt_transport::rt::hot) while the worker runs calls of ours:
        // their answers are read at once, not after this thread is woken.
        // Idle workers' readers sleep (a driver may have thousands), and
        // a submit wakes them into the hot read (recv is cancel-safe).
        let recv = async {
            loop {
                let busy = rt.upgrade().is_some_and(|i| i.lock().calls.any_for(worker));
                if busy {
                    rdt_transport::trace::timeline("driver reader hot", worker);
                    return hot(rx.recv::<ToDriver>()).await;
                }
                rdt_transport::trace::timeline("driver reader asleep", worker);
                tokio::select! {
                    m = rx.recv::<ToDriver>() => return m,
                    _ = wake.notified() => continue,
                }
            }
        };
        let msg = match &ping {
            None => recv.await,
            Some(conn) => {
                // recv is cancel-safe: a frame in progress stays buffered.
                match tokio::time::timeout(heartbeat / 4, recv).await {
                    Ok(m) => m,
                    Err(_) => {
                        // HB-1: bytes of a frame still arriving are a
                        // live peer (a large frame may take longer than
                        // the heartbeat).
                        if rx.bytes_read() != seen {
                            seen = rx.bytes_read();
                            last = tokio::time::Instant::now();
                        }
                        if last.elapsed() > heartbeat {
                            break format!(
                                "went silent for {heartbeat:?} (no heartbeat; network cut?)"
                            );
                        }
                        let _ = conn.send(&ToWorker::Ping);
                        continue;
                    }
                }
            }
        };
        last = tokio::time::Instant::now();
        // Tests slow the driver's reading down, so that frames queue up.
        #[cfg(feature = "failpoints")]
        fail::fail_point!("rdt::driver_read");
        match msg {
            Ok(Some(msg)) => match rt.upgrade() {
                Some(inner) => {
                    handle_from_worker(&inner, worker, msg);
                }
                None => return,
            },
            Ok(None) => break "closed its control connection".to_string(),
            Err(e) => break format!("broke its control connection ({e})"),
        }
    };
    let Some(inner) = rt.upgrade() else { return };
    inner.lock().readers.remove(&worker);
    // Prefer the exit status, if the process is gone, to the socket's story.
    let exit = inner
        .state
        .lock()
        .processes
        .get(&worker)
        .map(|p| p.exit.clone());
    let detail = match exit {
        Some(mut e) => {
            let _ = tokio::time::timeout(Duration::from_secs(1), e.wait_for(|s| s.is_some())).await;
            let s = e.borrow().clone();
            match s {
                Some(s) => format!("its process {s}"),
                None => format!("it {end}"),
            }
        }
        None => format!("it {end}"),
    };
    inner.on_death(worker, detail);
}
