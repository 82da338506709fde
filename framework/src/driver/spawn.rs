//! Spawning actors: on a new worker process or a volunteer that joined by hand, with their GPUs and spawn order.

use super::*;
use tracing::Instrument;

/// SP-1: undoes a spawn that did not finish, on an error or when its
/// future is dropped: the worker is killed (its reaper reaps it), and the
/// actor is dead, so nothing waits for it and nothing it sends is applied
/// (CL-4).
pub(super) struct UnfinishedSpawn<'a> {
    pub(super) inner: &'a Arc<Inner>,
    pub(super) id: u64,
    /// Why it did not finish; `None` once it did.
    pub(super) why: Option<String>,
}

impl UnfinishedSpawn<'_> {
    /// The spawn failed with `e`: undone (now, as the error returns).
    pub(super) fn fail(&mut self, e: Error) -> Error {
        self.why = Some(e.to_string());
        e
    }
}

impl Drop for UnfinishedSpawn<'_> {
    fn drop(&mut self) {
        let Some(why) = self.why.take() else { return };
        self.inner.kill_actor(self.id);
        let mut st = self.inner.lock();
        st.joining.remove(&self.id);
        st.spawning.remove(&self.id);
        if let Some(a) = st.actors.get_mut(&self.id) {
            a.dead = Some(why);
            st.conns.remove(&self.id);
        }
    }
}

/// A pending spawn; await it.
#[must_use = "await the spawn to start the actor"]
pub struct Spawn<A: Actor> {
    pub(super) rt: Runtime,
    pub(super) args: A::Args,
    pub(super) gpus: GpuRequest,
    pub(super) name: Option<String>,
    pub(super) remote: bool,
    pub(super) device_map: DeviceMap,
}

/// The GPUs a worker asks for (see [`Spawn::gpus`] and [`Spawn::on_gpus`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) enum GpuRequest {
    /// No GPU (`CUDA_VISIBLE_DEVICES` is inherited unchanged).
    #[default]
    None,
    /// This many, assigned round-robin.
    Count(u32),
    /// These indices of the GPU pool, in this order.
    Devices(Vec<u32>),
}

impl<A: Actor> Spawn<A> {
    /// Gives the worker `n` GPUs, assigned round-robin over the host's GPU
    /// pool (`RDT_GPUS`, else the driver's `CUDA_VISIBLE_DEVICES`, else
    /// every device of the host): consecutive GPU actors land on different
    /// devices while there are enough, and share devices after that. The
    /// worker sees exactly those devices (`CUDA_VISIBLE_DEVICES`); its
    /// `cuda:0` is the first. Use [`on_gpus`](Self::on_gpus) to choose.
    pub fn gpus(mut self, n: u32) -> Self {
        self.gpus = if n == 0 {
            GpuRequest::None
        } else {
            GpuRequest::Count(n)
        };
        self
    }
    /// Gives the worker exactly these GPUs of the pool (indices into the
    /// list [`gpus`](Self::gpus) draws from; with neither `RDT_GPUS` nor
    /// `CUDA_VISIBLE_DEVICES` set in the driver, the host's device
    /// numbers), in this order: its `cuda:0` is `ids[0]`. Two actors given
    /// the same id share a device; `on_gpus([0, 1])` lets a worker see a
    /// second device as well (e.g. the producer's, to map its memory in
    /// that device's own context). Spawning fails if an id is not in the
    /// pool or appears twice.
    ///
    /// ```no_run
    /// # use rdt::prelude::*;
    /// # #[rdt::actor] pub struct A {}
    /// # #[rdt::actor] impl A { fn new() -> Self { A {} } }
    /// # async fn f(rt: Runtime) -> rdt::Result<()> {
    /// let producer = rt.spawn::<A>(()).on_gpus([0]).await?;
    /// let same_gpu = rt.spawn::<A>(()).on_gpus([0]).await?;
    /// let other_gpu = rt.spawn::<A>(()).on_gpus([1]).await?;
    /// # Ok(()) }
    /// ```
    pub fn on_gpus(mut self, ids: impl IntoIterator<Item = u32>) -> Self {
        let ids: Vec<u32> = ids.into_iter().collect();
        self.gpus = if ids.is_empty() {
            GpuRequest::None
        } else {
            GpuRequest::Devices(ids)
        };
        self
    }
    /// The actor's device map: every value it receives (arguments, `get`s,
    /// values passed inline) has the tensors from a GPU the map names put
    /// in that entry's place of the actor's process, directly where the
    /// transport can (a `nixl` READ into it), else copied there once from
    /// where they landed. Keyed by the producer GPU's UUID, not its
    /// ordinal (ordinals differ between processes); tensors in host
    /// memory stay there, and tensors from a GPU the map does not name
    /// land as without it. Spawning fails with [`Error::NoSuchDevice`] if
    /// the actor's process lacks a place the map names.
    ///
    /// ```no_run
    /// # use rdt::prelude::*;
    /// # #[rdt::actor] pub struct A {}
    /// # #[rdt::actor] impl A { fn new() -> Self { A {} } }
    /// # async fn f(rt: Runtime, trainer_gpu: rdt::GpuUuid) -> rdt::Result<()> {
    /// // Tensors from the trainer's GPU land in this actor's host memory.
    /// let map = rdt::DeviceMap::new().map(trainer_gpu, Place::Host);
    /// let evaluator = rt.spawn::<A>(()).device_map(map).await?;
    /// # Ok(()) }
    /// ```
    pub fn device_map(mut self, map: DeviceMap) -> Self {
        self.device_map = map;
        self
    }
    /// A name for logs and errors (default `Type#id`).
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }
    /// Host the actor on a worker that joined by hand (`--rdt-connect`),
    /// possibly on another host, instead of starting a local process.
    /// Waits for one up to the spawn timeout.
    pub fn on_joined_worker(mut self) -> Self {
        self.remote = true;
        self
    }
}

impl<A: Actor> std::future::IntoFuture for Spawn<A> {
    type Output = Result<A::Handle>;
    type IntoFuture = futures::future::BoxFuture<'static, Result<A::Handle>>;
    fn into_future(self) -> Self::IntoFuture {
        Box::pin(async move {
            crate::refs::codec::take_refused();
            let args = postcard::to_stdvec(&self.args).map_err(|e| Error::Decode {
                what: format!("constructor argument of {}", A::NAME),
                message: if crate::refs::codec::take_refused() {
                    "it holds an ObjectRef, which a constructor argument cannot carry (the \
                     spawn would not count it); pass the ref to a method of the spawned actor"
                        .into()
                } else {
                    e.to_string()
                },
            })?;
            let short = A::NAME.rsplit("::").next().unwrap_or(A::NAME);
            let span = tracing::info_span!(
                parent: None,
                "spawn",
                actor_type = short,
                actor = tracing::field::Empty,
                outcome = tracing::field::Empty,
            );
            let spawned = if self.remote {
                self.rt
                    .inner
                    .spawn_on_volunteer(A::NAME, short, self.name, (args, self.device_map))
                    .instrument(span.clone())
                    .await
            } else {
                self.rt
                    .inner
                    .spawn_raw(
                        A::NAME,
                        short,
                        self.name,
                        (args, self.device_map),
                        self.gpus,
                    )
                    .instrument(span.clone())
                    .await
            };
            match &spawned {
                Ok(raw) => {
                    span.record("actor", raw.name());
                    span.record("outcome", "ok");
                }
                Err(_) => {
                    span.record("outcome", "failed");
                }
            }
            let raw = spawned?;
            Ok(A::Handle::from(raw))
        })
    }
}

impl Runtime {
    /// Spawns an actor in a new worker process. Await the returned builder
    /// (after optional settings) to get the actor's typed handle.
    pub fn spawn<A: Actor>(&self, args: A::Args) -> Spawn<A> {
        Spawn {
            rt: self.clone(),
            args,
            gpus: GpuRequest::None,
            name: None,
            remote: false,
            device_map: DeviceMap::new(),
        }
    }
}

impl Inner {
    pub(super) async fn spawn_raw(
        self: &Arc<Self>,
        type_name: &str,
        short: &str,
        name: Option<String>,
        args: (Vec<u8>, DeviceMap),
        gpus: GpuRequest,
    ) -> Result<RawHandle> {
        let visible = match &gpus {
            GpuRequest::None => None,
            GpuRequest::Count(n) => {
                static GPU_SPAWNS: std::sync::atomic::AtomicU64 =
                    std::sync::atomic::AtomicU64::new(0);
                let nth = GPU_SPAWNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Some((*n, gpu_assignment(*n, nth)))
            }
            GpuRequest::Devices(ids) => Some((
                ids.len() as u32,
                gpu_devices(ids).map_err(|e| Error::Spawn(format!("{type_name}: {e}")))?,
            )),
        };
        let id = self.next_id();
        let name = name.unwrap_or_else(|| format!("{short}#{id}"));
        let (jtx, jrx) = oneshot::channel();
        let (stx, srx) = oneshot::channel();
        {
            let mut st = self.lock();
            st.joining.insert(id, jtx);
            st.spawning.insert(id, stx);
            st.actors.insert(
                id,
                ActorInfo {
                    name: name.clone(),
                    dead: None,
                    host: String::new(),
                    endpoints: HashMap::new(),
                    peer_socket: self.peer_socket(id),
                    gpu: visible
                        .as_ref()
                        .and_then(|(_, d)| d.split(',').next())
                        .map(str::to_string),
                    cuda_devices: None,
                },
            );
        }
        // SP-1: from here on, a spawn that does not finish (an error, or
        // its future dropped) leaves no worker behind.
        let mut unfinished = UnfinishedSpawn {
            inner: self,
            id,
            why: Some(format!(
                "{name}: its spawn was dropped before the actor was constructed"
            )),
        };
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.env(wenv::WORKER_ID, id.to_string())
            .env(wenv::SOCKET, &self.sock)
            .env(wenv::SECRET, hex::encode(self.secret))
            .env(wenv::PARENT_PID, std::process::id().to_string())
            .stdin(std::process::Stdio::null());
        if let Some((_n, devices)) = visible {
            cmd.env("CUDA_VISIBLE_DEVICES", devices);
        }
        // SAFETY: prctl is async-signal-safe; nothing else runs in the child
        // between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let (pid, pidfd, exit) = start_reaped(cmd).await?;
        let pidfd = Arc::new(pidfd);
        self.lock().processes.insert(
            id,
            Process {
                pid,
                exit: exit.clone(),
                pidfd: Some(pidfd.clone()),
                _guard: Some(ChildGuard { pidfd }),
            },
        );
        let deadline = tokio::time::Instant::now() + self.config.spawn_timeout;
        let mut exit_w = exit.clone();
        let joined = tokio::select! {
            j = jrx => j.map_err(|_| Error::Spawn(format!("{name}: the runtime closed while it was joining"))),
            _ = exit_w.wait_for(|s| s.is_some()) => Err(Error::Spawn(format!(
                "{name}: the worker process {} before joining; its stderr above says why",
                exit.borrow().clone().unwrap_or_default()))),
            _ = tokio::time::sleep_until(deadline) => Err(Error::Spawn(format!(
                "{name}: the worker did not join within {:?}; does the binary call rdt::init() (or use #[rdt::main]) first thing in main?",
                self.config.spawn_timeout))),
        };
        let joined = joined.map_err(|e| unfinished.fail(e))?;
        joined
            .conn
            .send(&self.spawn_order(type_name, id, &name, args, true))
            .map_err(|e| unfinished.fail(e))?;
        self.constructed(srx, deadline, &name)
            .await
            .map_err(|e| unfinished.fail(e))?;
        unfinished.why = None;
        Ok(RawHandle {
            client: self.clone() as SharedClient,
            actor: id,
            name: name.into(),
        })
    }

    /// Waits for the worker's answer to its spawn order, up to `deadline`.
    pub(super) async fn constructed(
        &self,
        srx: oneshot::Receiver<Result<()>>,
        deadline: tokio::time::Instant,
        name: &str,
    ) -> Result<()> {
        tokio::select! {
            r = srx => r.unwrap_or_else(|_| Err(Error::Spawn(format!("{name}: worker died while constructing the actor")))),
            _ = tokio::time::sleep_until(deadline) => Err(Error::Spawn(format!("{name}: the actor was not constructed within {:?}", self.config.spawn_timeout))),
        }
    }

    /// The spawn order for a worker. `RuntimeBuilder::tcp_bind` is for
    /// local workers; a remote one binds its `tcp` endpoint to the local
    /// address of its control link (`local == false`).
    pub(super) fn spawn_order(
        &self,
        type_name: &str,
        id: u64,
        name: &str,
        (args, device_map): (Vec<u8>, DeviceMap),
        local: bool,
    ) -> ToWorker {
        ToWorker::Spawn(protocol::SpawnOrder {
            transports: crate::transport::wire_names(),
            actor_type: type_name.to_string(),
            worker: id,
            name: name.to_string(),
            max_frame: self.config.max_frame_bytes,
            tcp_bind: if local {
                self.config.tcp_bind.clone()
            } else {
                None
            },
            transfer_timeout_ms: self.config.transfer_timeout.as_millis() as u64,
            hot_window_us: self.config.hot_window.map(|d| d.as_micros() as u64),
            heartbeat_ms: (!local).then_some(self.config.heartbeat_timeout.as_millis() as u64),
            args: Blob::new(args.into()),
            id_space: protocol::actor_id_space(self.id_spaces.fetch_add(1, Ordering::Relaxed)),
            peer_socket: if local { self.peer_socket(id) } else { None },
            straight_large_values: self.config.straight_large_values,
            log: self.config.worker_log.clone(),
            device_map,
        })
    }

    /// Where a worker the driver spawns listens for deliveries straight
    /// from producers (`worker::straight`): beside the control socket, in the
    /// runtime's private directory. `None` when peer delivery is off.
    pub(super) fn peer_socket(&self, id: u64) -> Option<String> {
        let dir = self.sock.parent()?;
        self.config.peer_delivery.then(|| {
            dir.join(format!("peer-{id}.sock"))
                .to_string_lossy()
                .into_owned()
        })
    }

    /// Hosts an actor on a worker that joined by hand (`--rdt-connect`),
    /// waiting for one up to the spawn timeout.
    pub(super) async fn spawn_on_volunteer(
        self: &Arc<Self>,
        type_name: &str,
        short: &str,
        name: Option<String>,
        args: (Vec<u8>, DeviceMap),
    ) -> Result<RawHandle> {
        let deadline = tokio::time::Instant::now() + self.config.spawn_timeout;
        let v = loop {
            let notified = self.volunteer_joined.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(v) = self.lock().volunteers.pop_front() {
                break v;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Error::Spawn(format!(
                    "no worker joined with --rdt-connect within {:?}; start one with `BINARY --rdt-connect {}` and RDT_TOKEN set to Runtime::join_token()",
                    self.config.spawn_timeout,
                    self.control_addr.map(|a| a.to_string()).unwrap_or_else(|| "<RuntimeBuilder::listen was not set>".into())
                )));
            }
        };
        let id = self.next_id();
        let name = name.unwrap_or_else(|| format!("{short}#{id}"));
        let (stx, srx) = oneshot::channel();
        {
            let mut st = self.lock();
            st.spawning.insert(id, stx);
            st.actors.insert(
                id,
                ActorInfo {
                    name: name.clone(),
                    dead: None,
                    host: v.host.clone(),
                    endpoints: HashMap::new(),
                    peer_socket: None,
                    gpu: None,
                    cuda_devices: None,
                },
            );
            st.conns.insert(id, v.conn.clone());
        }
        v.conn
            .send(&self.spawn_order(type_name, id, &name, args, false))?;
        tokio::spawn(read_worker(
            v.rx,
            Arc::downgrade(self),
            id,
            Some(v.conn.clone()),
            self.config.heartbeat_timeout,
        ));
        if let Err(e) = self.constructed(srx, deadline, &name).await {
            let _ = v.conn.send(&ToWorker::Shutdown);
            self.on_death(id, e.to_string());
            return Err(e);
        }
        Ok(RawHandle {
            client: self.clone() as SharedClient,
            actor: id,
            name: name.into(),
        })
    }
}
