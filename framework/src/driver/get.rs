//! Reading objects in the driver: every `get`, `wait` and the object store's fetch.

use super::*;

impl Runtime {
    /// Waits for an object and returns its value. Waits until the producer
    /// replies or dies; see [`Runtime::get_timeout`] for a deadline.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes loses nothing: the object stays
    /// readable by a later call, and a receive it started is given up (its copy
    /// freed when nothing else here needs it).
    pub async fn get<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
    ) -> Result<T> {
        crate::refs::api::get(self, r).await
    }

    /// Like [`Runtime::get`], with the object's tensors received into
    /// `targets`: one per tensor of the value, in the order the value holds
    /// them (a tensor held twice counts once), each of the same dtype and
    /// shape. The value returned holds `targets` themselves.
    ///
    /// Over `nixl` the read lands in the targets directly (CUDA tensors
    /// made with `Tensor::cuda_empty`, host tensors made by rdt): no
    /// staging, no allocation. Other transports come through the
    /// object-store path and are copied in once; a collective transport
    /// fails as for [`Runtime::get`]. Targets that do not fit fail with
    /// [`Error::Targets`] before any byte moves, and the object stays
    /// readable.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes writes nothing more into
    /// `targets` over `tcp`, `shm`, `cuda_ipc` (nothing more is queued on the
    /// stream) and the object store: their copy into the targets runs under a
    /// gate the drop closes (a copy under way ends first), or in this future
    /// itself. Over `nixl` and `nccl`, which write into the targets as the
    /// bytes come, the drop aborts the receive (over `nccl`, like any failed
    /// transfer, that aborts the group); a NIXL READ already posted ends or
    /// is cancelled a moment after the drop, and writes into the targets
    /// until then: [`Targets::idle`](crate::Targets::idle) waits for it.
    /// Either way the object stays readable.
    pub async fn get_into<T: Serialize + DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
        targets: impl Into<crate::Targets>,
    ) -> Result<T> {
        crate::refs::api::get_into(self, r, targets).await
    }

    /// [`get_into`](Runtime::get_into) without the value: the object's
    /// tensors written into `targets`, and nothing decoded (see
    /// [`ActorRuntime::load_into`](crate::ActorRuntime::load_into), the
    /// same for an actor). Same targets, same errors as `get_into`.
    ///
    /// # Cancel safety
    ///
    /// As [`get_into`](Self::get_into).
    pub async fn load_into<T: Serialize + DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
        targets: impl Into<crate::Targets>,
    ) -> Result<()> {
        crate::refs::api::load_into(self, r, targets).await
    }

    /// Object `id` received into `targets`: its value, the tensors
    /// received, and the targets as the value's tensors where they were
    /// copied in (`None`: the received tensors are the targets).
    pub(super) async fn land_in<T: Serialize + DeserializeOwned + 'static>(
        &self,
        id: u64,
        targets: &crate::Targets,
    ) -> Result<(
        WireValue,
        Vec<rdt_transport::Tensor>,
        Option<Vec<rdt_transport::Tensor>>,
    )> {
        let wv = match self.readable(id).await? {
            Readable::Direct(wv, inst) => {
                let metas = &wv.exported.get()?.metas;
                // TG-1, TG-2: ordered and checked before any byte moves.
                let ordered = targets.resolve::<T>(id, &wv.data_bytes()?, metas.len(), &|i| {
                    metas.get(i).cloned()
                })?;
                crate::refs::wait::check_targets(id, metas, &ordered)?;
                let target = Target::Tensors(ordered.clone());
                // TG-4: a READ that outlives this future counts as the
                // targets' writer (`Targets::idle`).
                let gate = Arc::new(targets.gate());
                let tensors = self.get_direct(id, &wv, inst, target, Some(gate)).await?;
                let copied = crate::refs::wait::into_targets(id, &ordered, &tensors)?;
                return Ok((wv, tensors, copied));
            }
            Readable::Inline(wv) => wv,
        };
        let tensors = object_store::unpack(wv.exported.get()?)?;
        let ordered = targets.resolve::<T>(id, &wv.data_bytes()?, tensors.len(), &|i| {
            tensors.get(i).map(rdt_transport::Tensor::meta)
        })?;
        let copied = crate::refs::wait::into_targets(id, &ordered, &tensors)?;
        Ok((wv, tensors, copied))
    }

    /// Object `id`'s value once it settled, and how the driver reads it:
    /// straight from a transport that serves the driver, or with its
    /// tensors inline (the object store's own, or fetched through it). A
    /// collective transport's value cannot be read here.
    pub(super) async fn readable(&self, id: u64) -> Result<Readable> {
        let wv = self.inner.wait_value(id).await?;
        // A value through the driver may still be arriving (cut-through).
        wv.arrived().await?;
        match wv.transport.sidedness() {
            rdt_transport::Sidedness::ThroughDriver => Ok(Readable::Inline(wv)),
            rdt_transport::Sidedness::TwoSided => Err(Error::CollectiveGet {
                object: id,
                transport: wv.transport.to_string(),
            }),
            rdt_transport::Sidedness::OneSided => match driver_transport(wv.transport) {
                // NIXL: read straight into this process, no worker involved.
                Some(inst) => Ok(Readable::Direct(wv, inst)),
                None => Ok(Readable::Inline(self.fetch_via_object_store(id).await?)),
            },
        }
    }

    /// Like [`Runtime::get`], with the value's tensors put in `place` of
    /// this process: host memory ([`Place::Host`], a checkpoint or an
    /// evaluation on the CPU) or one of its GPUs ([`Place::Cuda`]), whatever
    /// device they were on at their producer. Over `nixl` the read lands
    /// there directly; an object the driver reads through the object
    /// store lands there from the bytes it carries (no round trip through
    /// another device); elsewhere each tensor not in `place` already is
    /// copied there once. A `place` this process does not have fails with
    /// [`Error::NoSuchDevice`] before any byte moves, and the object stays
    /// readable. Values on a collective transport fail as for
    /// [`get`](Self::get).
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get).
    pub async fn get_on<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
        place: Place,
    ) -> Result<T> {
        crate::refs::api::get_on(self, r, place).await
    }

    /// [`get_on`](Self::get_on) host memory: every tensor read into this
    /// process's host memory, whatever device it is on at its producer.
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get).
    pub async fn get_on_host<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
    ) -> Result<T> {
        self.get_on(r, Place::Host).await
    }

    /// Gets several objects: every one is waited for and every direct read
    /// is started before any is awaited (Ray's `get` of a list; no
    /// one-at-a-time fetches, ray#61453). Fails with the first error.
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get), for each object.
    pub async fn get_all<T: DeserializeOwned + 'static>(
        &self,
        refs: &[ObjectRef<T>],
    ) -> Result<Vec<T>> {
        crate::refs::api::get_all(self, refs).await
    }

    /// Reads object `id`, held by an actor or by this driver, over a
    /// transport that serves the driver, within the transfer deadline.
    pub(super) async fn get_direct(
        &self,
        id: u64,
        wv: &WireValue,
        inst: Arc<dyn rdt_transport::TensorTransport>,
        target: Target,
        gate: Option<Arc<rdt_transport::TargetGate>>,
    ) -> Result<Vec<rdt_transport::Tensor>> {
        let (from, producer) = {
            let st = self.inner.lock();
            let e = st
                .table
                .objects
                .get(&id)
                .ok_or(Error::Freed { object: id })?;
            if let Some(held) = &e.held {
                // Put by this driver: its tensors are here already.
                let tensors = held.tensors().to_vec();
                drop(st);
                return target
                    .place(wv.transport.name(), &wv.exported.get()?.metas, tensors)
                    .map_err(Error::Transport);
            }
            let Some(p) = e.producer else {
                drop(st);
                let tensors = object_store::unpack(wv.exported.get()?)?;
                return target
                    .place(wv.transport.name(), &wv.exported.get()?.metas, tensors)
                    .map_err(Error::Transport);
            };
            let a = st.actors.get(&p).ok_or(Error::Freed { object: id })?;
            if let Some(d) = &a.dead {
                return Err(Error::ActorDied {
                    actor: a.name.clone(),
                    detail: d.clone(),
                });
            }
            (a.peer(p, wv.transport.name()), p)
        };
        let deadline = self.inner.config.transfer_timeout;
        let exported = wv.exported.get()?;
        let cx = rdt_transport::TransferCtx {
            target,
            gate,
            layout: wv.exported.layout(),
            ..rdt_transport::TransferCtx::new(0)
        };
        let read = tokio::time::timeout(deadline, inst.receive(&from, &cx, exported)).await;
        let dead = || {
            let st = self.inner.lock();
            st.actors.get(&producer).and_then(|a| {
                a.dead.clone().map(|d| Error::ActorDied {
                    actor: a.name.clone(),
                    detail: format!(
                        "{d} (while the driver read object {id} over {})",
                        wv.transport
                    ),
                })
            })
        };
        match read {
            Ok(Ok(tensors)) => Ok(tensors),
            Ok(Err(e)) => Err(dead().unwrap_or(Error::Transport(e))),
            Err(_) => Err(dead().unwrap_or(Error::Timeout {
                what: format!(
                    "the driver's read of object {id} from {} over {} (RuntimeBuilder::transfer_timeout)",
                    from.name, wv.transport
                ),
                after_ms: deadline.as_millis() as u64,
            })),
        }
    }

    /// Waits until an object is ready (`Ok`) or failed (its error), without
    /// moving its value anywhere (Ray's `wait` for one ref).
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes loses nothing: it moves no
    /// value.
    pub async fn wait<T>(&self, r: impl Borrow<ObjectRef<T>>) -> Result<()> {
        crate::refs::api::wait(self, r).await
    }

    /// Ray's `wait`: waits until `num_returns` of `refs` are finished
    /// (ready or failed) or `timeout` passes (`None`: no deadline), and
    /// returns `(finished, pending)`, each in the order of `refs`. Moves no
    /// value; a failed object counts as finished (its `get` gives the
    /// error). Every ref is watched at once, so the first `num_returns` to
    /// finish are the ones returned, whatever their place in `refs`.
    ///
    /// Errs if `num_returns` is larger than `refs.len()` (it could never
    /// be met), or if the runtime shuts down.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future before it completes loses nothing: it moves no
    /// value.
    pub async fn wait_many<T>(
        &self,
        refs: &[ObjectRef<T>],
        num_returns: usize,
        timeout: Option<Duration>,
    ) -> Result<(Vec<ObjectRef<T>>, Vec<ObjectRef<T>>)> {
        crate::refs::api::wait_many(self, refs, num_returns, timeout).await
    }

    /// [`Runtime::get`] with a deadline.
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get): a deadline that passes drops nothing but the
    /// wait.
    pub async fn get_timeout<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
        deadline: Duration,
    ) -> Result<T> {
        crate::refs::api::get_timeout(self, r, deadline).await
    }

    /// Gets a value through the object-store path whatever its transport:
    /// the producer serializes it, tensors included, to the driver.
    ///
    /// # Cancel safety
    ///
    /// As [`get`](Self::get).
    pub async fn get_via_object_store<T: DeserializeOwned + 'static>(
        &self,
        r: impl Borrow<ObjectRef<T>>,
    ) -> Result<T> {
        let id = r.borrow().id;
        let wv = self.inner.wait_value(id).await?;
        wv.arrived().await?;
        let wv = if wv.transport == Transport::ObjectStore {
            wv
        } else {
            self.fetch_via_object_store(id).await?
        };
        crate::refs::api::decode(self, id, &inline_read(&wv)?)
    }

    /// Object `id` (ready, on a transport other than the object store)
    /// serialized by its producer, tensors included, to the driver.
    pub(super) async fn fetch_via_object_store(&self, id: u64) -> Result<WireValue> {
        let (tx, rx) = oneshot::channel();
        let req = self.inner.next_id();
        {
            let mut st = self.inner.lock();
            let producer = st.table.objects.get(&id).and_then(|e| e.producer);
            let Some(p) = producer else {
                return Err(Error::Freed { object: id });
            };
            if let Some(d) = st.actors.get(&p).and_then(|a| a.dead.clone()) {
                return Err(Error::ActorDied {
                    actor: st.actors[&p].name.clone(),
                    detail: d,
                });
            }
            st.fetches.insert(req, (p, tx));
            st.table
                .outbox
                .send_small(p, &ToWorker::Fetch { object: id, req });
        }
        let wv = rx.await.map_err(|_| Error::Shutdown)??;
        wv.arrived().await?;
        Ok(wv)
    }
}

/// How the driver reads a settled value ([`Runtime::readable`]).
pub(super) enum Readable {
    /// Straight from the transport, which serves the driver.
    Direct(WireValue, Arc<dyn rdt_transport::TensorTransport>),
    /// Its tensors inline, all here ([`WireValue::arrived`]).
    Inline(WireValue),
}

/// A value whose tensors are inline, read: its tensors put back.
fn inline_read(wv: &WireValue) -> Result<crate::refs::api::Read> {
    let tensors = object_store::unpack(wv.exported.get()?)?;
    direct_read(wv, tensors)
}

/// A value with the tensors read for it.
fn direct_read(
    wv: &WireValue,
    tensors: Vec<rdt_transport::Tensor>,
) -> Result<crate::refs::api::Read> {
    Ok(crate::refs::api::Read {
        data: wv.data_bytes()?,
        tensors: crate::refs::api::ReadTensors::Made(tensors),
    })
}

/// The driver's instance of the transport called `name`, if it reads and
/// holds objects in the driver itself (`nixl`).
pub(super) fn driver_transport(t: Transport) -> Option<Arc<dyn rdt_transport::TensorTransport>> {
    let inst = t.instance().ok()?;
    inst.serves_driver().then_some(inst)
}

impl Inner {
    pub(super) async fn wait_value(&self, id: u64) -> Result<WireValue> {
        let rx = {
            let mut st = self.lock();
            let Some(e) = st.table.objects.get_mut(&id) else {
                return Err(Error::Freed { object: id });
            };
            if let Some(settled) = e.state.settled() {
                return settled;
            }
            let (tx, rx) = oneshot::channel();
            e.getters.push(crate::owner::Getter::Value(tx));
            rx
        };
        // Handed the value (OW-14). A dropped sender means the runtime went
        // away. Hot (rdt_transport::rt::hot): a value that arrives within the
        // window is seen at once, not after this thread is woken.
        let settled = hot(rx).await.map_err(|_| Error::Shutdown)?;
        rdt_transport::trace::timeline("driver getter woke", id);
        settled
    }
}

/// The driver's side of the one client API (`refs::api`): objects read
/// from the owner table, straight from a transport that serves the driver,
/// or fetched through the object store.
impl crate::refs::api::Objects for Runtime {
    fn client(&self) -> Option<SharedClient> {
        Some(self.inner.clone() as SharedClient)
    }

    async fn read(&self, id: u64) -> Result<crate::refs::api::Read> {
        match self.readable(id).await? {
            Readable::Direct(wv, inst) => {
                let tensors = self.get_direct(id, &wv, inst, Target::Any, None).await?;
                direct_read(&wv, tensors)
            }
            Readable::Inline(wv) => inline_read(&wv),
        }
    }

    async fn read_into<T: Serialize + DeserializeOwned + 'static>(
        &self,
        id: u64,
        targets: &crate::Targets,
    ) -> Result<(crate::refs::api::Read, Option<Vec<rdt_transport::Tensor>>)> {
        let (wv, tensors, copied) = self.land_in::<T>(id, targets).await?;
        Ok((direct_read(&wv, tensors)?, copied))
    }

    fn receiver(&self) -> String {
        "the driver".into()
    }

    async fn read_on(&self, id: u64, place: Place) -> Result<crate::refs::api::Read> {
        crate::refs::api::check_place(self, place)?;
        match self.readable(id).await? {
            Readable::Direct(wv, inst) => {
                let tensors = self.get_direct(id, &wv, inst, place.into(), None).await?;
                direct_read(&wv, tensors)
            }
            Readable::Inline(wv) => {
                let tensors = object_store::unpack_to(wv.exported.get()?, Some(place))?;
                direct_read(&wv, tensors)
            }
        }
    }

    async fn settled(&self, id: u64) -> Result<()> {
        self.inner.wait_value(id).await.map(|_| ())
    }

    fn put_inline<T>(&self, encoded: crate::refs::client::Encoded) -> Result<ObjectRef<T>> {
        self.put_encoded(encoded)
    }

    async fn put_direct<T: Serialize>(
        &self,
        value: &T,
        transport: Transport,
    ) -> Result<ObjectRef<T>> {
        self.put_exported(value, transport).await
    }
}

/// The driver's futures stay `Send` through the one client API: a program
/// awaits them on any tokio task (checked when the tests build).
#[cfg(test)]
#[allow(dead_code)]
fn the_drivers_futures_are_send(rt: &Runtime, r: &ObjectRef<Vec<rdt_transport::Tensor>>) {
    fn send<F: Send>(_: F) {}
    let refs = std::slice::from_ref(r);
    send(rt.get(r));
    send(rt.get_into(r, Vec::<rdt_transport::Tensor>::new()));
    send(rt.load_into(r, Vec::<rdt_transport::Tensor>::new()));
    send(rt.get_all(refs));
    send(rt.get_timeout(r, Duration::ZERO));
    send(rt.wait(r));
    send(rt.wait_many(refs, 1, None));
    send(rt.put_with(&0u32, Transport::Nixl));
}
