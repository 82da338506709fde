//! The runtime's builder: its settings and `Runtime::start`.

use super::*;

/// Settings of a runtime. `Runtime::start()` uses the defaults.
#[derive(Clone, Debug, Default)]
pub struct RuntimeBuilder {
    pub(super) config: Config,
}

impl RuntimeBuilder {
    /// How long a worker may take to start, join and construct its actor
    /// (default 60 s).
    pub fn spawn_timeout(mut self, d: Duration) -> Self {
        self.config.spawn_timeout = d;
        self
    }
    /// Largest control frame accepted or sent (default 8 GiB). Values sent
    /// through the object store must fit in one frame.
    pub fn max_frame_bytes(mut self, n: usize) -> Self {
        self.config.max_frame_bytes = n;
        self
    }
    /// How long `shutdown` waits for workers to exit before killing them
    /// (default 5 s).
    pub fn shutdown_grace(mut self, d: Duration) -> Self {
        self.config.shutdown_grace = d;
        self
    }

    /// Address the workers' `tcp` transport listens on (default
    /// `127.0.0.1:0`: loopback, any port). Give a routable address for
    /// workers on other hosts.
    pub fn tcp_bind(mut self, addr: impl Into<String>) -> Self {
        self.config.tcp_bind = Some(addr.into());
        self
    }
    /// Also accept workers started by hand (`BINARY --rdt-connect
    /// HOST:PORT` with `RDT_TOKEN` set to [`Runtime::join_token`]) on this
    /// TCP address, as Slurm, Kubernetes or mpirun would start them. Off by
    /// default; give a loopback or private address unless you mean
    /// otherwise.
    pub fn listen(mut self, addr: impl Into<String>) -> Self {
        self.config.listen = Some(addr.into());
        self
    }
    /// Encrypt the control connections of workers started by hand with TLS
    /// (rustls), presenting this PEM certificate chain and private key.
    /// Workers then need `RDT_TLS_CA` (or `--rdt-tls-ca PATH`) naming a PEM
    /// file they trust for it. The runtime secret is still proven inside
    /// the encrypted stream.
    pub fn tls(mut self, cert_chain_pem: impl Into<Vec<u8>>, key_pem: impl Into<Vec<u8>>) -> Self {
        self.config.tls = Some((cert_chain_pem.into(), key_pem.into()));
        self
    }
    /// A remote worker silent for this long is declared dead (default
    /// 10 s; the driver pings every quarter of it).
    pub fn heartbeat_timeout(mut self, d: Duration) -> Self {
        self.config.heartbeat_timeout = d;
        self
    }
    /// How long a direct transfer may take before it fails (default 120 s).
    pub fn transfer_timeout(mut self, d: Duration) -> Self {
        self.config.transfer_timeout = d;
        self
    }
    /// How long a thread waiting on rdt's critical path (the driver
    /// waiting for a value; a worker's control loop, transfer thread and
    /// actor waiting for what comes next) stays awake polling before it
    /// sleeps, in the driver and every worker. Waking a thread that slept
    /// costs 0.1–0.3 ms on cloud VMs, several times per call; the window
    /// trades CPU time for that latency. Default: 5 ms on machines with 8
    /// cores or more, none on smaller ones (`RDT_HOT_WINDOW_US`
    /// overrides the default); `Duration::ZERO` turns it off. See
    /// [`rdt_transport::rt::hot`].
    pub fn hot_window(mut self, d: Duration) -> Self {
        self.config.hot_window = Some(d);
        self
    }
    /// Whether a producer hands a value straight to the consumer whose
    /// call was submitted while the producing call still ran, on a
    /// connection between the two workers, instead of through the driver
    /// (one-sided transports, workers the driver spawned on its host).
    /// It saves the driver's hop on the path of a pass: about 10 µs of a
    /// cached `cuda_ipc` hand-off. Default: on (`RDT_PEER_DELIVERY=0`
    /// turns the default off, for comparisons). See the book's Internals,
    /// "Deliveries straight from the producer".
    pub fn peer_delivery(mut self, on: bool) -> Self {
        self.config.peer_delivery = on;
        self
    }
    /// Whether a value through the driver (`object_store`) of 1 MiB or
    /// more also goes straight from its producer to a waiting consumer
    /// ([`peer_delivery`](Self::peer_delivery)); smaller ones always do.
    /// The producer then sends it twice at once, to the consumer and to the
    /// driver (which keeps it), and the consumer's copy crosses one socket
    /// instead of two. On a 2×H200 host (32 cores) that took a pass of a 1
    /// GiB CUDA tensor from 3.0 to 5.1–5.4 GB/s; on a 2-core VM the two
    /// streams compete for the cores and a 256 MiB pass went from 2.6 to
    /// 1.8 GB/s. Default: on with 8 cores or more (`RDT_STRAIGHT_LARGE=0`
    /// or `1` in a worker's environment overrides the default).
    pub fn straight_large_values(mut self, on: bool) -> Self {
        self.config.straight_large_values = Some(on);
        self
    }

    /// The size from which two-sided transfers (`nccl`, `tcp`) to one
    /// consumer for different calls land one call at a time, in the order
    /// they were delivered: the driver holds a producer's send while a
    /// transfer of that size to the same consumer for another call is in
    /// flight (bytes into one device share its links, so started together
    /// the call queued first would wait for both). Those one call needs
    /// go together. Default 128 MiB (`RDT_LARGE_TRANSFER_BYTES` overrides the
    /// default); `usize::MAX` turns it off. See the book's Internals,
    /// "OW-15".
    pub fn large_transfer_bytes(mut self, n: usize) -> Self {
        self.config.large_transfer_bytes = n;
        self
    }

    /// How the actors' worker processes log: filter, format, and standard
    /// error or a file; every line names its actor. Default: the worker's
    /// `RUST_LOG`, else `warn`, to standard error (see [`WorkerLog`]). The
    /// driver's own events go to the program's subscriber, whatever this
    /// says.
    ///
    /// [`WorkerLog`]: crate::WorkerLog
    ///
    /// ```
    /// let builder = rdt::Runtime::builder().worker_log(
    ///     rdt::WorkerLog::new()
    ///         .filter("info,rdt=debug")
    ///         .compact()
    ///         .file(std::env::temp_dir().join("my-run-workers.log")),
    /// );
    /// # drop(builder);
    /// ```
    pub fn worker_log(mut self, log: crate::WorkerLog) -> Self {
        self.config.worker_log = log;
        self
    }

    /// Starts the runtime: a private directory (mode 0700) with the control
    /// socket, and a fresh secret. Must be called inside a tokio runtime.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves no runtime: its listeners
    /// close with it.
    pub async fn start(self) -> Result<Runtime> {
        if let Some(d) = self.config.hot_window {
            hot::set_window(d);
        }
        let dir = tempfile::Builder::new().prefix("rdt-").tempdir()?;
        // tempfile creates the directory with mode 0700; say so explicitly.
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )?;
        let sock = dir.path().join("control.sock");
        let listener = UnixListener::bind(&sock)?;
        let tcp = match &self.config.listen {
            Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.map_err(|e| {
                Error::Io(format!("cannot listen for remote workers on {addr}: {e}"))
            })?),
            None => None,
        };
        let control_addr = tcp.as_ref().map(|l| l.local_addr()).transpose()?;
        let tls = match &self.config.tls {
            Some((cert, key)) => Some(protocol::tls_acceptor(cert, key)?),
            None => None,
        };
        let mut state = State::default();
        state
            .table
            .outbox
            .set_max_frame(self.config.max_frame_bytes);
        state.table.large_transfer_bytes =
            crate::owner::LargeTransferBytes(self.config.large_transfer_bytes);
        let inner = Arc::new_cyclic(|me| Inner {
            me: me.clone(),
            tokio: tokio::runtime::Handle::current(),
            config: self.config,
            secret: protocol::new_secret(),
            _dir: dir,
            sock,
            state: Mutex::new(state),
            next: AtomicU64::new(1),
            id_spaces: AtomicU64::new(1),
            control_addr,
            volunteer_joined: tokio::sync::Notify::new(),
            settled: tokio::sync::Notify::new(),
            deadline_wake: Arc::new(tokio::sync::Notify::new()),
            orders_first: AtomicU64::new(0),
        });
        tokio::spawn(deadline_keeper(
            Arc::downgrade(&inner),
            inner.deadline_wake.clone(),
        ));
        tokio::spawn(accept_loop(listener, Arc::downgrade(&inner)));
        if let Some(l) = tcp {
            tokio::spawn(accept_tcp_loop(l, tls, Arc::downgrade(&inner)));
        }
        Ok(Runtime { inner })
    }
}

impl Runtime {
    /// Starts a runtime with the defaults (embedded, local).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes leaves no runtime: its listeners
    /// close with it.
    pub async fn start() -> Result<Runtime> {
        RuntimeBuilder::default().start().await
    }

    /// Settings other than the defaults.
    pub fn builder() -> RuntimeBuilder {
        RuntimeBuilder::default()
    }
}
