//! The control listeners: the private Unix socket and the TCP (or TLS) address workers join through.

use super::*;

impl Runtime {
    /// The TCP address workers started by hand connect to
    /// (`--rdt-connect`), if [`RuntimeBuilder::listen`] was set.
    pub fn control_address(&self) -> Option<std::net::SocketAddr> {
        self.inner.control_addr
    }

    /// The secret a worker started by hand proves it knows (give it in the
    /// `RDT_TOKEN` environment variable). Anyone holding it can run code in
    /// this runtime's actors: hand it over like a password.
    pub fn join_token(&self) -> String {
        hex::encode(self.inner.secret)
    }
}

pub(super) async fn accept_loop(listener: UnixListener, rt: Weak<Inner>) {
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("control socket accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        protocol::size_socket_buffers(&stream);
        let Some(inner) = rt.upgrade() else { return };
        let secret = inner.secret;
        drop(inner);
        let rt = rt.clone();
        tokio::spawn(async move {
            let mut stream = stream;
            let joined = match protocol::accept_plain(&mut stream, secret).await {
                Ok(()) => {
                    let s = stream;
                    let (r, w) = s.into_split();
                    serve_worker(
                        protocol::ReadHalf::Unix(r),
                        protocol::WriteHalf::Unix(w),
                        rt,
                    )
                    .await
                }
                Err(e) => Err(e),
            };
            if let Err(e) = joined {
                tracing::warn!("dropped a control connection: {e}");
            }
        });
    }
}

/// Accepts workers started by hand (`--rdt-connect`) on the TCP control
/// address.
pub(super) async fn accept_tcp_loop(
    listener: tokio::net::TcpListener,
    tls: Option<tokio_rustls::TlsAcceptor>,
    rt: Weak<Inner>,
) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(e) => {
                tracing::error!("control TCP accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Some(inner) = rt.upgrade() else { return };
        let secret = inner.secret;
        drop(inner);
        let rt = rt.clone();
        let tls = tls.clone();
        let _ = stream.set_nodelay(true);
        let mut stream = stream;
        tokio::spawn(async move {
            let _ = set_keepalive(&stream);
            let joined = match tls {
                Some(acceptor) => match protocol::accept_tls(stream, &acceptor, secret).await {
                    Ok(s) => {
                        let (r, w) = tokio::io::split(s);
                        serve_worker(
                            protocol::ReadHalf::Tls(r),
                            protocol::WriteHalf::Tls(tokio::sync::Mutex::new(w)),
                            rt,
                        )
                        .await
                    }
                    Err(e) => Err(e),
                },
                None => match protocol::accept_plain(&mut stream, secret).await {
                    Ok(()) => {
                        let s = stream;
                        let (r, w) = s.into_split();
                        serve_worker(protocol::ReadHalf::Tcp(r), protocol::WriteHalf::Tcp(w), rt)
                            .await
                    }
                    Err(e) => Err(e),
                },
            };
            if let Err(e) = joined {
                tracing::warn!("dropped a control connection from {peer}: {e}");
            }
        });
    }
}

/// Lets the kernel notice a vanished remote peer too (beside heartbeats).
pub(super) fn set_keepalive(s: &tokio::net::TcpStream) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let on: libc::c_int = 1;
    // SAFETY: setsockopt on a socket we own, with a correctly sized value.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_KEEPALIVE,
            &on as *const _ as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

pub(super) async fn serve_worker(
    r: protocol::ReadHalf,
    w: protocol::WriteHalf,
    rt: Weak<Inner>,
) -> Result<()> {
    let (max, heartbeat) = {
        let inner = rt.upgrade().ok_or(Error::Shutdown)?;
        (inner.config.max_frame_bytes, inner.config.heartbeat_timeout)
    };
    let remote = !matches!(r, protocol::ReadHalf::Unix(_));
    let mut rx = protocol::Receiver::new(r, max);
    let hello = tokio::time::timeout(protocol::HANDSHAKE_TIMEOUT, rx.recv::<ToDriver>())
        .await
        .map_err(|_| Error::Protocol("no hello in time".into()))??;
    let Some(ToDriver::Hello { worker, host, .. }) = hello else {
        return Err(Error::Protocol("first frame was not a hello".into()));
    };
    let conn = protocol::spawn_writer(w, max);
    let inner = rt.upgrade().ok_or(Error::Shutdown)?;
    // A value forwarded while it arrives (cut-through) holds this
    // connection until its last byte: a producer stopped mid-value costs
    // the consumer at most the transfer deadline.
    conn.set_stall_limit(inner.config.transfer_timeout);
    if remote {
        if worker != 0 {
            return Err(Error::Protocol(
                "a worker joining over TCP must not claim an id".into(),
            ));
        }
        tracing::info!("a worker on {host} joined and waits for an actor");
        inner
            .state
            .lock()
            .volunteers
            .push_back(Volunteer { conn, rx, host });
        inner.volunteer_joined.notify_one();
        return Ok(());
    }
    {
        let mut st = inner.lock();
        let Some(tx) = st.joining.remove(&worker) else {
            return Err(Error::Protocol(format!(
                "hello from unknown worker {worker}"
            )));
        };
        if let Some(a) = st.actors.get_mut(&worker) {
            a.host = host;
            st.conns.insert(worker, conn.clone());
        }
        let _ = tx.send(Joined { conn });
    }
    drop(inner);
    read_worker(rx, rt, worker, None, heartbeat).await;
    Ok(())
}

#[cfg(test)]
mod security_tests {
    use std::os::unix::fs::PermissionsExt;

    #[tokio::test]
    async fn control_socket_lives_in_a_private_directory() {
        tokio::time::timeout(std::time::Duration::from_secs(10), async {
            let rt = super::Runtime::start().await.unwrap();
            let dir = rt.inner.sock.parent().unwrap();
            let mode = std::fs::metadata(dir).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o700, "{dir:?}");
            assert!(
                rt.control_address().is_none(),
                "no TCP listener unless asked for"
            );
        })
        .await
        .unwrap();
    }
}
