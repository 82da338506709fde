//! Receive: one-sided READs into fresh memory or target tensors.

use super::*;

impl NixlTransport {
    pub(super) async fn receive_inner(
        &self,
        from: &Peer,
        cx: &TransferCtx,
        exported: &Exported,
    ) -> Result<TensorList, TransportError> {
        let err = |m: String| TransportError::with_peer(NAME, from, m);
        crate::trace::timeline("nixl receive start", cx.xfer);
        let agent = self.agent()?;
        // Into fresh memory: through the layout's plan, made once (NX-7).
        // Into the caller's tensors: through the plan of the same layout
        // and targets (NX-8), worked out now if there is none.
        enum Into<'t> {
            Targets(&'t Arc<[Tensor]>, Arc<TargetPlan>),
            Fresh(Arc<ReadPlan>),
        }
        let (into, mut target_keep) = match &cx.target {
            Target::Tensors(ts) => {
                let (plan, mut keep) = self.target_plan(&agent, exported, ts, cx.layout, from)?;
                // TG-4: a READ posted into the targets writes them until it
                // ends, also after this receive was dropped (the poller
                // cancels it later): counted as their writer until then.
                keep.extend(cx.gate.as_ref().map(|g| Kept::Writing(g.writing())));
                (Into::Targets(ts, plan), keep)
            }
            t => (
                Into::Fresh(
                    self.read_plan(exported, PlanTarget::of(t), cx.layout)
                        .map_err(err)?,
                ),
                Vec::new(),
            ),
        };
        let h: &Handles = match &into {
            Into::Targets(_, plan) => &plan.h,
            Into::Fresh(plan) => &plan.h,
        };
        if h.agent == agent.name() {
            return Err(err(
                "the object's tensors are in this process already; nothing to read".into(),
            ));
        }
        // NIXL's statuses say little; say what was being done, and to whom.
        let reading = |e: String| {
            err(format!(
                "reading from {} (NIXL agent {}) failed: {e}; the producer may have died or \
                 the link to it may be down",
                from.name, h.agent
            ))
        };
        self.load_remote(&agent, h).map_err(|e| reading(e.0))?;
        crate::trace::timeline("nixl remote loaded", cx.xfer);
        let Destination {
            out,
            lists,
            keep,
            not_clean,
        } = match &into {
            Into::Targets(ts, plan) => Destination {
                out: TensorList::shared(Arc::clone(ts)),
                lists: plan.lists.clone(),
                keep: std::mem::take(&mut target_keep),
                not_clean: Vec::new(),
            },
            Into::Fresh(plan) => match self.take_ready(plan) {
                Some(dest) => dest,
                None => self.take_planned(&agent, plan, &err)?,
            },
        };
        if let Into::Fresh(plan) = &into {
            self.want_ready(plan);
        }
        crate::trace::timeline("nixl destinations ready", cx.xfer);
        // The tensors of a large object are made while the bytes move
        // (`TensorList::premake`). A thread waiting to use them (WK-8)
        // gets the list now, before the post (tens of µs for a large READ
        // across GPUs), so that it makes them meanwhile too; with none,
        // this thread makes them once the READ is posted.
        let offered = out.is_lazy() && cx.first_reader.as_ref().is_some_and(|r| r.offer(&out));
        if offered {
            bump(&COUNTERS.lists_made_by_reader, 1);
            crate::trace::timeline("nixl views offered", cx.xfer);
        }
        // NX-9: UCX writes device memory on streams of its own. Work still
        // queued on rdt's stream may read what the READ overwrites: the
        // old values of target tensors, or memory freed while in use and
        // not clean yet. The READ waits until rdt's stream passed it on
        // those GPUs (nothing to wait for on an idle stream).
        let wait_on: Vec<usize> = match &into {
            Into::Targets(..) => {
                let mut gpus: Vec<usize> = lists
                    .iter()
                    .flat_map(|(local, _)| local)
                    .filter(|d| d.mem == Mem::Vram)
                    .map(|d| d.dev as usize)
                    .collect();
                gpus.sort_unstable();
                gpus.dedup();
                gpus
            }
            Into::Fresh(_) => not_clean,
        };
        for o in wait_on {
            let g = crate::cuda::gpu(o).map_err(|e| err(e.to_string()))?;
            g.completion()
                .map_err(|e| err(e.to_string()))?
                .wait()
                .await
                .map_err(|e| err(e.to_string()))?;
        }
        let poller = Poller::get(&agent);
        let keep = Arc::new(keep);
        // UCX's CUDA transports work in the calling thread's context: bind
        // the GPU the read lands on (or, reading device memory into the
        // host, this process's first GPU).
        let vram_local = lists
            .iter()
            .flat_map(|(local, _)| local)
            .find(|d| d.mem == Mem::Vram)
            .map(|d| d.dev as usize);
        let vram_remote = h.regions.iter().any(|r| r.mem == Mem::Vram);
        if let Some(o) = vram_local.or(vram_remote.then_some(0)) {
            if let Ok(g) = crate::cuda::gpu(o) {
                let _ = g.bind();
            }
        }
        crate::trace::timeline("nixl bound", cx.xfer);
        let started = std::time::Instant::now();
        let mut posted = Posted {
            agent: &agent,
            poller,
            reqs: Vec::new(),
            keep: keep.clone(),
        };
        for (local, remote) in lists {
            let n = local.len() as u64;
            // No notification rides on the READ: NIXL then ends the read
            // only after a flush round trip to the producer (4 KiB across
            // GPUs, raw: 9 µs without, 21 µs with). It follows the read.
            let (req, done) = agent
                .post_read(&local, &remote, &h.agent, &[], true)
                .map_err(|e| reading(e.0))?;
            bump(&COUNTERS.reads_posted, 1);
            bump(&COUNTERS.descriptors_posted, n);
            posted.reqs.push((req, done));
        }
        crate::trace::timeline("nixl posted", cx.xfer);
        // The READ moves the bytes without this thread: it makes the
        // tensors meanwhile if no reader took them.
        if out.is_lazy() && !offered {
            out.premake();
            bump(&COUNTERS.lists_premade, 1);
            crate::trace::timeline("nixl views premade", cx.xfer);
        }
        // Small reads end within microseconds of their post: ask for them
        // here, within the hot window (yielding to the executor between
        // asks), and hand the rest to the poller. Waking the poller and
        // being woken by it cost more than such a read on a busy host.
        let window = crate::rt::hot::window();
        let spin = read_spin().min(window);
        let posted_at = std::time::Instant::now();
        let mut yielded = false;
        loop {
            posted.settle().map_err(|e| reading(e.0))?;
            bump(&COUNTERS.read_asks, 1);
            if yielded {
                bump(&COUNTERS.read_asks_after_yield, 1);
            }
            if posted.reqs.is_empty() || started.elapsed() >= window {
                break;
            }
            if posted_at.elapsed() < spin {
                std::hint::spin_loop();
                yielded = false;
                continue;
            }
            tokio::task::yield_now().await;
            yielded = true;
        }
        let waits = posted.hand_to_poller();
        for w in waits {
            match w.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(reading(e)),
                Err(_) => return Err(err("the NIXL poller stopped".into())),
            }
        }
        bump(&COUNTERS.read_nanos, started.elapsed().as_nanos() as u64);
        crate::trace::timeline("nixl read done", cx.xfer);
        // The producer hears that the read ended (its `reads_served`),
        // later and in one message per producer (PL-3): a notice sent now
        // would go out inside this process's next read. Release does not
        // wait for it (NX-5): a lost notice loses a count, nothing else.
        poller.notice(&h.agent);
        crate::trace::timeline("nixl notice queued", cx.xfer);
        Ok(out)
    }

    /// Another process's device memory into this process's host memory.
    /// UCX read that at 0.5 GB/s on the 2xH200 host (no CUDA IPC into host
    /// memory), while a read onto this process's GPU (CUDA IPC) and one
    /// copy into
    /// page-locked host memory (the nixl host slabs are pinned where CUDA
    /// is present) run at NVLink and copy-engine speed.
    pub(super) async fn receive_to_host_through_gpu(
        &self,
        from: &Peer,
        cx: &TransferCtx,
        exported: &Exported,
    ) -> Result<Vec<Tensor>, TransportError> {
        let err = |m: String| TransportError::with_peer(NAME, from, m);
        let on_gpu = TransferCtx {
            target: Target::Any,
            ..cx.clone()
        };
        let received = self
            .receive_inner(from, &on_gpu, exported)
            .await?
            .into_vec();
        let agent = self.agent()?;
        let len = received
            .iter()
            .filter(|t| t.is_cuda())
            .fold(0usize, |a, t| (a + t.nbytes()).next_multiple_of(ALIGN));
        let region = HostRegion::new(&agent, len).map_err(|e| err(e.0))?;
        // The host tensors are views of one tensor over the region.
        let whole = Tensor::from_external(
            crate::dtype::DType::U8,
            &[region.len],
            Device::Cpu,
            Box::new(NixlHostMem {
                region: region.clone(),
                offset: 0,
                len: region.len,
            }),
        )
        .map_err(|e| err(e.to_string()))?;
        // (GPU ordinal, device address, offset in the region, bytes)
        let mut copies: Vec<(usize, u64, usize, usize)> = Vec::new();
        let mut out = Vec::with_capacity(received.len());
        let mut off = 0usize;
        for t in &received {
            let Device::Cuda { uuid, .. } = t.device() else {
                out.push(t.clone());
                continue;
            };
            let n = t.nbytes();
            let gpu = crate::cuda::ordinal_of(uuid).unwrap_or(0);
            let src = t
                .with_device_buffer(|d| d.device_ptr())
                .map_err(|e| err(e.to_string()))?;
            copies.push((gpu, src, off, n));
            // Laid out within the region's length (`len` above).
            out.push(Tensor::view_of_storage(
                t.dtype(),
                t.shape().into(),
                whole.storage(),
                off,
            ));
            off = (off + n).next_multiple_of(ALIGN);
        }
        // The copies block on the GPU: off the executor.
        tokio::task::spawn_blocking(move || -> Result<(), String> {
            let mut gpus: Vec<Arc<crate::cuda::Gpu>> = Vec::new();
            let mut outcome = Ok(());
            for (o, src, off, n) in copies {
                let gpu = match crate::cuda::gpu(o) {
                    Ok(g) => g,
                    Err(e) => {
                        outcome = Err(e.to_string());
                        break;
                    }
                };
                if !gpus.iter().any(|g| g.ordinal() == o) {
                    gpus.push(gpu.clone());
                }
                // SAFETY: `off + n` lies within the region, which this
                // closure holds until the copies are waited for below, as
                // `received` holds the device memory.
                if let Err(e) = unsafe { gpu.enqueue_dtoh(region.ptr().add(off), src, n) } {
                    outcome = Err(e.to_string());
                    break;
                }
            }
            // Every enqueued copy ends before its memory can go.
            for g in gpus {
                if let Err(e) = g.synchronize() {
                    outcome = outcome.and(Err(e.to_string()));
                }
            }
            drop((received, region));
            outcome
        })
        .await
        .map_err(|e| err(format!("the copy to the host panicked: {e}")))?
        .map_err(|e| err(format!("copying to the host: {e}")))?;
        Ok(out)
    }
}

/// Device memory read into this process's host memory: through its GPU
/// ([`NixlTransport::receive_to_host_through_gpu`]).
pub(super) fn to_host_through_gpu(cx: &TransferCtx, exported: &Exported) -> bool {
    matches!(cx.target, Target::Host)
        && crate::cuda::available().is_ok()
        && exported.metas.iter().any(|m| !m.device.is_cpu())
}

/// READs a receive posted and still drives itself (before handing them to
/// the poller). Dropped with some left (its task was cancelled, or one
/// failed), it gives them to the poller, which cancels and releases them
/// while it holds their memory (PL-1, PL-2).
pub(super) struct Posted<'a> {
    pub(super) agent: &'a Agent,
    pub(super) poller: &'static Poller,
    /// Each request, and whether it has already ended.
    pub(super) reqs: Vec<(agent::Request, bool)>,
    pub(super) keep: Arc<Vec<Kept>>,
}

impl Posted<'_> {
    /// Asks each READ once; releases those that ended. An error is the
    /// first READ that failed (the others go to the poller on drop).
    pub(super) fn settle(&mut self) -> Result<(), NixlError> {
        // Ended but not releasable now: kept for a later round (or the
        // poller), and not asked again in this one.
        let mut unreleased = Vec::new();
        let mut i = 0;
        let outcome = loop {
            if i == self.reqs.len() {
                break Ok(());
            }
            let done = self.reqs[i].1
                || match self.agent.progress(&self.reqs[i].0) {
                    agent::Progress::Running => false,
                    agent::Progress::Done => true,
                    agent::Progress::Failed(e) => break Err(e),
                };
            if !done {
                i += 1;
                continue;
            }
            let (req, _) = self.reqs.swap_remove(i);
            match self.agent.finish(req) {
                Ok(()) => bump(&COUNTERS.reads_done_inline, 1),
                Err(req) => unreleased.push((req, false)),
            }
        };
        self.reqs.extend(unreleased);
        outcome
    }

    /// Hands what is left to the poller.
    pub(super) fn hand_to_poller(
        mut self,
    ) -> Vec<tokio::sync::oneshot::Receiver<Result<(), String>>> {
        let reqs = std::mem::take(&mut self.reqs);
        reqs.into_iter()
            .map(|(r, _)| self.poller.watch(r, Box::new(self.keep.clone())))
            .collect()
    }
}

impl Drop for Posted<'_> {
    fn drop(&mut self) {
        for (r, _) in self.reqs.drain(..) {
            // Nobody waits: the poller cancels and releases it (PL-2).
            drop(self.poller.watch(r, Box::new(self.keep.clone())));
        }
    }
}
