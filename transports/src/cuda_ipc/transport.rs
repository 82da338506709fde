//! [`CudaIpcTransport`]: export (publish the slabs, record an event per
//! device), receive (check the producer, wait on its events, map its
//! slabs), release, and the [`TensorTransport`] contract.

use super::*;

use crate::trace::cuda_trace;

// Usable wherever CUDA is; without it, exports of CUDA tensors cannot
// happen and receives fail with the CUDA error.
crate::register_transport!(crate::registry::Registration {
    name: NAME,
    sidedness: Sidedness::OneSided,
    collective: false,
    devices: "CUDA",
    same_host_only: true,
    start: |_| Ok(std::sync::Arc::new(CudaIpcTransport::new())),
});

/// Moves CUDA tensors between processes of one host with CUDA IPC, no copy.
#[derive(Default)]
pub struct CudaIpcTransport {
    /// Copies made at export, kept until release.
    copies: Mutex<HashMap<ObjectKey, Vec<Tensor>>>,
    /// The events each export recorded, given back to their device at
    /// release (every consumer has enqueued its wait by then: the driver
    /// frees only after every receive ended).
    export_events: Mutex<HashMap<ObjectKey, ExportEvents>>,
    /// The producer processes each peer actor sent us tensors from, as the
    /// caches key them, so that [`TensorTransport::peer_gone`] can drop
    /// their entries.
    pub(super) producers: Mutex<HashMap<u64, HashSet<ProducerKey>>>,
}

impl std::fmt::Debug for CudaIpcTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaIpcTransport").finish_non_exhaustive()
    }
}

impl CudaIpcTransport {
    /// A transport with nothing exported.
    pub fn new() -> Self {
        Self::default()
    }

    fn export_now(&self, key: ObjectKey, tensors: &[Tensor]) -> Result<Exported, TransportError> {
        let host = host_id()?;
        let counters = alloc::counters().map_err(err)?;
        let mut out = Exported::default();
        let mut gpus: Vec<Arc<Gpu>> = Vec::new();
        let mut handles = Vec::with_capacity(tensors.len());
        let mut slabs: Vec<SlabHandle> = Vec::new();
        // Slab id -> index in `slabs`.
        let mut slab_index: rustc_hash::FxHashMap<u64, u32> = Default::default();
        let mut copies = Vec::new();
        for t in tensors {
            self.check_device(t.device())?;
            // The handle of a range of ours; `None` for memory this process
            // did not allocate, which is copied into a range first.
            let mut handle = |t: &Tensor| {
                t.with_device_buffer(|d| -> Result<Option<TensorHandle>, CudaError> {
                    let Some(r) = d.buffer().as_any().downcast_ref::<SlabRange>() else {
                        return Ok(None);
                    };
                    if !gpus.iter().any(|g| Arc::ptr_eq(g, d.gpu())) {
                        gpus.push(d.gpu().clone());
                    }
                    let slab = match slab_index.get(&r.slab.id) {
                        Some(&i) => i,
                        None => {
                            let (handle, record) = r.slab.ipc_handle()?;
                            slabs.push(SlabHandle {
                                id: r.slab.id,
                                handle: handle.to_vec(),
                                len: r.slab.len as u64,
                                record,
                            });
                            let i = (slabs.len() - 1) as u32;
                            slab_index.insert(r.slab.id, i);
                            i
                        }
                    };
                    Ok(Some(TensorHandle {
                        slab,
                        // A view's bytes start inside its range.
                        offset: (r.offset + d.offset()) as u64,
                        len: d.len() as u64,
                        slot: r.counter_slot()?,
                    }))
                })
            };
            let h = match handle(t).map_err(err)?.map_err(err)? {
                Some(h) => {
                    out.metas.push(t.meta());
                    h
                }
                None => {
                    let (ord, what) = t
                        .with_device_buffer(|d| (d.gpu().ordinal(), d.buffer().describe()))
                        .map_err(err)?;
                    tracing::debug!(
                        "cuda_ipc copies {} B of {what} once to export it: its allocation cannot be \
                         handed to other processes as it is",
                        t.nbytes()
                    );
                    super::stats::EXPORT_COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    let c = t.to_device(ord).map_err(err)?;
                    let h = handle(&c)
                        .map_err(err)?
                        .map_err(err)?
                        .expect("a fresh copy lies in a range of ours");
                    out.metas.push(c.meta());
                    copies.push(c);
                    h
                }
            };
            handles.push(h);
        }
        let mut events = Vec::with_capacity(gpus.len());
        let mut recorded = Vec::new();
        for g in &gpus {
            // No handle: the producer's stream was idle, nothing to wait for.
            match g.record_ipc_event() {
                Ok(ev) => {
                    events.push((g.uuid(), ev.map(|e| e.handle.to_vec()).unwrap_or_default()));
                    recorded.extend(ev.map(|e| (g.clone(), e)));
                }
                Err(e) => {
                    for (g, ev) in recorded {
                        g.return_ipc_event(ev);
                    }
                    return Err(err(e));
                }
            }
        }
        if !recorded.is_empty() {
            self.export_events.lock().insert(key, recorded);
        }
        let h = Handles {
            boot_id: host.boot_id.clone(),
            pid_ns: host.pid_ns,
            pid: std::process::id(),
            counters_fd: counters.fd(),
            counters_id: counters.id,
            events,
            slabs,
            tensors: handles,
        };
        out.handles = postcard::to_allocvec(&h).map_err(err)?;
        if !copies.is_empty() {
            self.copies.lock().insert(key, copies);
        }
        Ok(out)
    }

    /// Reads and checks the handles of `exported`.
    fn handles(&self, from: &Peer, exported: &Exported) -> Result<Handles, TransportError> {
        let perr = |m: String| TransportError::with_peer(NAME, from, m);
        let h: Handles = postcard::from_bytes(&exported.handles)
            .map_err(|e| perr(format!("malformed handles: {e}")))?;
        let host = host_id()?;
        if h.boot_id != host.boot_id
            || (h.pid_ns.is_some() && host.pid_ns.is_some() && h.pid_ns != host.pid_ns)
        {
            return Err(perr(
                "the producer runs on another host (or pid namespace): cuda_ipc works between processes of one host; use nccl or nixl across hosts".into(),
            ));
        }
        if h.tensors.len() != exported.metas.len() {
            return Err(perr(format!(
                "handles describe {} tensors, metadata {}",
                h.tensors.len(),
                exported.metas.len()
            )));
        }
        if let Some(sh) = h
            .slabs
            .iter()
            .find(|sh| sh.record as usize >= alloc::SLAB_RECORDS || sh.handle.len() != 64)
        {
            return Err(perr(format!(
                "malformed handles: slab record {} out of range, or a {}-byte memory handle",
                sh.record,
                sh.handle.len()
            )));
        }
        if let Some(th) = h.tensors.iter().find(|th| {
            th.slot as usize >= alloc::COUNTER_SLOTS || th.slab as usize >= h.slabs.len()
        }) {
            return Err(perr(format!(
                "malformed handles: record index {} or slab #{} out of range",
                th.slot, th.slab
            )));
        }
        Ok(h)
    }

    /// Imports the tensors `h` describes. With `opening` false it does not
    /// wait on the driver: it returns `Ok(None)`, having changed nothing,
    /// where a producer's event or slab is not open in this process yet or
    /// a retired mapping is due to close (calls that may take
    /// milliseconds); the caller then asks again, with `opening`, where
    /// blocking is allowed.
    fn receive_now(
        &self,
        from: &Peer,
        exported: &Exported,
        h: &Handles,
        opening: bool,
    ) -> Result<Option<Vec<Tensor>>, TransportError> {
        let perr = |m: String| TransportError::with_peer(NAME, from, m);
        crate::cuda::available()
            .map_err(|e| perr(format!("this consumer cannot use CUDA: {e}")))?;
        let counters = open_counters(h).map_err(perr)?;
        if opening {
            close_retired_now();
        } else if retired_mapping_unused() {
            return Ok(None);
        }

        // Everything this receive uses, from the caches (or opened): no
        // wait enqueued and no record held until all of it is at hand.
        let mut local: rustc_hash::FxHashMap<GpuUuid, Arc<Gpu>> = Default::default();
        let mut waits = Vec::new();
        for (uuid, ev) in &h.events {
            let g = local_gpu(uuid).map_err(|e| perr(e.to_string()))?;
            if !ev.is_empty() {
                // Held while used: `peer_gone` may drop the cache's reference.
                match open_event(h, uuid, ev, &g, opening).map_err(|e| perr(e.to_string()))? {
                    Some(ev) => waits.push((g.clone(), ev)),
                    None => return Ok(None),
                }
            }
            local.insert(*uuid, g);
        }
        let mut maps = Vec::with_capacity(h.tensors.len());
        // Each slab's mapping, looked up once (its tensors share it).
        let mut mapped: Vec<Option<Arc<Mapping>>> = vec![None; h.slabs.len()];
        for (meta, th) in exported.metas.iter().zip(&h.tensors) {
            let Device::Cuda { uuid, .. } = &meta.device else {
                return Err(perr(format!(
                    "tensor on {} is not a CUDA tensor",
                    meta.device
                )));
            };
            if th.len as usize != meta.nbytes() {
                return Err(perr(format!(
                    "handle length {} does not match the tensor's {} bytes",
                    th.len,
                    meta.nbytes()
                )));
            }
            let g = match local.get(uuid) {
                Some(g) => g.clone(),
                None => local_gpu(uuid).map_err(|e| perr(e.to_string()))?,
            };
            let map = match &mapped[th.slab as usize] {
                Some(m) if Arc::ptr_eq(&m.gpu, &g) => m.clone(),
                _ => {
                    let sh = &h.slabs[th.slab as usize];
                    let Some(m) = open_slab(h, sh, &g, &counters, opening)
                        .map_err(|e| perr(e.to_string()))?
                    else {
                        return Ok(None);
                    };
                    mapped[th.slab as usize] = Some(m.clone());
                    m
                }
            };
            if th
                .offset
                .checked_add(th.len)
                .is_none_or(|end| end > map.len as u64)
            {
                return Err(perr("tensor range reaches past its slab".into()));
            }
            maps.push((map, *uuid));
        }
        self.producers
            .lock()
            .entry(from.actor)
            .or_default()
            .insert((h.pid, h.counters_id));

        // Order this process's stream after the producer's work.
        for (g, ev) in &waits {
            // Already passed: the producer's work before this export is
            // done, no GPU work here.
            if !event_passed(ev.event, g).map_err(|e| perr(e.to_string()))? {
                cuda_trace!(
                    "stream of local device {} waits on a producer's event",
                    g.ordinal()
                );
                g.wait_event(ev.event).map_err(|e| perr(e.to_string()))?;
            }
        }
        let mut out = Vec::with_capacity(h.tensors.len());
        for ((meta, th), (map, uuid)) in exported.metas.iter().zip(&h.tensors).zip(maps) {
            counters.hold(Region::Range, th.slot);
            let device = Device::Cuda {
                uuid,
                ordinal: map.gpu.ordinal() as u32,
            };
            let buf = ImportedRange {
                map,
                offset: th.offset as usize,
                len: th.len as usize,
                counters: counters.clone(),
                slot: th.slot,
                stream_passed: false,
            };
            out.push(
                Tensor::from_device_buffer(meta.dtype, &meta.shape, device, Box::new(buf))
                    .map_err(|e| perr(e.to_string()))?,
            );
        }
        check_received(NAME, &exported.metas, &out)?;
        Ok(Some(out))
    }
}

impl TensorTransport for CudaIpcTransport {
    fn name(&self) -> &'static str {
        NAME
    }

    fn sidedness(&self) -> Sidedness {
        Sidedness::OneSided
    }

    /// Received tensors are copied into targets through `TransferCtx::place`.
    fn copies_into_targets(&self) -> bool {
        true
    }

    /// It opens a published memory and returns: nothing to wait for.
    fn receive_start(&self, _exported: &Exported) -> crate::transport::ReceiveStart {
        crate::transport::ReceiveStart::Now
    }

    fn check_device(&self, device: &Device) -> Result<(), TransportError> {
        match device {
            Device::Cuda { .. } => Ok(()),
            Device::Cpu => Err(TransportError::new(
                NAME,
                "cuda_ipc moves CUDA tensors; use shm (same host) or tcp for CPU tensors",
            )),
        }
    }

    fn export<'a>(
        &'a self,
        key: ObjectKey,
        tensors: &'a [Tensor],
    ) -> BoxFuture<'a, Result<Exported, TransportError>> {
        Box::pin(async move { self.export_now(key, tensors) })
    }

    fn receive<'a>(
        &'a self,
        from: &'a Peer,
        cx: &'a TransferCtx,
        exported: &'a Exported,
    ) -> BoxFuture<'a, Result<Vec<Tensor>, TransportError>> {
        // Opening IPC handles blocks for 50 µs to 2 ms (more on a first
        // open across GPUs): off the executor's hands where the runtime
        // allows it (contract point 5).
        Box::pin(async move {
            let h = self.handles(from, exported)?;
            // From the caches (every pass after the first of a producer's
            // slab): no call here waits on the driver, so it runs where it
            // is, without `block_in_place` handing this thread's runtime
            // to another (several microseconds of a 4 KiB hand-off).
            let mapped = match self.receive_now(from, exported, &h, false)? {
                Some(t) => t,
                None => {
                    let open = || self.receive_now(from, exported, &h, true);
                    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
                        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => {
                            tokio::task::block_in_place(open)
                        }
                        _ => open(),
                    }?
                    .expect("a receive that may open does not give up")
                }
            };
            cx.place(NAME, &exported.metas, mapped)
        })
    }

    fn release(&self, key: ObjectKey) -> BoxFuture<'_, Result<(), TransportError>> {
        Box::pin(async move {
            for (g, ev) in self.export_events.lock().remove(&key).unwrap_or_default() {
                g.return_ipc_event(ev);
            }
            self.copies.lock().remove(&key);
            alloc::reclaim();
            Ok(())
        })
    }

    /// Drops the cache entries of the producer processes `actor` sent
    /// tensors from (unless another live actor sent from the same one):
    /// its import records, opened events and slab mappings. Tensors
    /// received from it keep their mappings until they are dropped.
    fn peer_gone(&self, actor: u64) {
        let gone = {
            let mut producers = self.producers.lock();
            let Some(keys) = producers.remove(&actor) else {
                return;
            };
            keys.into_iter()
                .filter(|k| !producers.values().any(|ks| ks.contains(k)))
                .collect::<Vec<_>>()
        };
        for key in gone {
            forget_producer(key);
        }
    }
}
