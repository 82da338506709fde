//! [`NixlTransport`]: its agent, its tables of registrations, peers and plans,
//! and the caches a receive finds its plan and destination in.

use super::*;

/// Name of this transport in attributes and errors.
pub const NAME: &str = "nixl";

/// What this process loaded of one peer agent.
#[derive(Default)]
pub(super) struct RemoteAgent {
    /// Loaded registrations: generation -> (mem, dev, base, len).
    pub(super) loaded: HashMap<u64, (Mem, u64, u64, u64)>,
}

/// Moves CPU and CUDA tensors with one-sided NIXL reads (see the module
/// docs).
pub struct NixlTransport {
    pub(super) name: String,
    /// Memory kept per exported object until release.
    pub(super) exports: Mutex<HashMap<ObjectKey, Vec<Kept>>>,
    /// Registrations of rdt's CUDA slabs, by slab id.
    pub(super) slabs: Arc<Mutex<HashMap<u64, Arc<Registered>>>>,
    /// Peer agents loaded, by name.
    pub(super) remotes: Mutex<HashMap<String, RemoteAgent>>,
    /// Read plans of recent layouts, the last used first (NX-7).
    pub(super) plans: crate::rt::recent::Recent<Arc<ReadPlan>>,
    /// The same for small objects (fewer than [`PLAN_MIN_TENSORS`]), kept
    /// apart so that they never push out a large object's plan.
    pub(super) small_plans: crate::rt::recent::Recent<Arc<ReadPlan>>,
    /// Plans of recent receives into target tensors (NX-8).
    pub(super) target_plans: crate::rt::recent::Recent<Arc<TargetPlan>>,
    /// Destinations made ahead for small device reads (NX-11), at most
    /// one per plan and [`SMALL_PLANS_KEPT`] in all.
    pub(super) ready: Mutex<Vec<ReadyDest>>,
    /// Plans whose next destination is to be made ahead, at the next
    /// [`TensorTransport::after_receive`].
    pub(super) wanted: Mutex<Vec<Arc<ReadPlan>>>,
}

impl std::fmt::Debug for NixlTransport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NixlTransport")
            .field("agent", &self.name)
            .finish()
    }
}

/// The slab registrations an export or a receive into target tensors met,
/// each once: an object's tensors share a few slabs, so a short scan from
/// the most recent finds one, not a lookup in the transport's table per
/// tensor.
#[derive(Default)]
pub(super) struct SlabRegistrations {
    /// (slab id, its registration).
    pub(super) kept: Vec<(u64, Arc<Registered>)>,
}

impl SlabRegistrations {
    /// `slab`'s registration (from `nixl`'s table at its first use here).
    pub(super) fn of(
        &mut self,
        nixl: &NixlTransport,
        agent: &Arc<Agent>,
        slab: &Arc<Slab>,
    ) -> Result<&Arc<Registered>, NixlError> {
        let at = match self.kept.iter().rposition(|(id, _)| *id == slab.id) {
            Some(at) => at,
            None => {
                self.kept
                    .push((slab.id, nixl.slab_registration(agent, slab)?));
                self.kept.len() - 1
            }
        };
        Ok(&self.kept[at].1)
    }

    /// What keeps them registered while the export or the read lasts.
    pub(super) fn into_kept(self) -> impl Iterator<Item = Kept> {
        self.kept.into_iter().map(|(_, r)| Kept::Slab(r))
    }
}

impl NixlTransport {
    /// The transport of a process: its agent is made on first use.
    pub fn new(cx: &ProcessContext) -> NixlTransport {
        let nonce: u32 = rand_u32();
        let name = match cx.actor {
            Some(a) => format!("rdt-a{a}-{}-{nonce:08x}", std::process::id()),
            None => format!("rdt-driver-{}-{nonce:08x}", std::process::id()),
        };
        let name2 = name.clone();
        // On a GPU host, making the agent (UCX with its CUDA transports)
        // takes about a second: a worker starts it in the background at
        // boot, so that its first transfer does not pay it.
        if cx.actor.is_some() && crate::cuda::available().is_ok() {
            let _ = std::thread::Builder::new()
                .name("rdt-nixl-start".into())
                .spawn(move || {
                    let _ = STARTED_AGENT.get_or_init(|| make_agent(&name2));
                });
        }
        NixlTransport {
            name,
            exports: Default::default(),
            slabs: Default::default(),
            remotes: Default::default(),
            plans: crate::rt::recent::Recent::new(PLANS_KEPT),
            small_plans: crate::rt::recent::Recent::new(SMALL_PLANS_KEPT),
            target_plans: crate::rt::recent::Recent::new(PLANS_KEPT),
            ready: Default::default(),
            wanted: Default::default(),
        }
    }

    pub(super) fn agent(&self) -> Result<Arc<Agent>, TransportError> {
        let made = match STARTED_AGENT.get() {
            Some(made) => made,
            None => {
                // Made here, or by the background start still at it.
                let t0 = std::time::Instant::now();
                let made = STARTED_AGENT.get_or_init(|| make_agent(&self.name));
                bump(&COUNTERS.agent_wait_nanos, t0.elapsed().as_nanos() as u64);
                made
            }
        };
        made.clone().map_err(|e| TransportError::new(NAME, e.0))
    }

    /// The registration of `slab`, made on first use (NX-3).
    pub(super) fn slab_registration(
        &self,
        agent: &Arc<Agent>,
        slab: &Arc<Slab>,
    ) -> Result<Arc<Registered>, NixlError> {
        let mut slabs = self.slabs.lock();
        if let Some(r) = slabs.get(&slab.id) {
            return Ok(r.clone());
        }
        // UCX tells device memory from host memory by asking CUDA in the
        // calling thread: the slab's context must be current.
        slab.gpu.bind().map_err(|e| NixlError(e.to_string()))?;
        let reg = Arc::new(Registered::new(
            agent,
            Desc {
                mem: Mem::Vram,
                addr: slab.base as usize,
                len: slab.len,
                dev: slab.gpu.ordinal() as u64,
            },
        )?);
        slabs.insert(slab.id, reg.clone());
        let table = Arc::downgrade(&self.slabs);
        let id = slab.id;
        // NX-2: undone while the slab still exists.
        slab.before_free(Box::new(move || {
            if let Some(t) = table.upgrade() {
                if let Some(r) = t.lock().remove(&id) {
                    r.deregister();
                }
            }
        }));
        Ok(reg)
    }

    /// Loads what `h` needs of its agent (NX-1).
    pub(super) fn load_remote(&self, agent: &Agent, h: &Handles) -> Result<(), NixlError> {
        let mut remotes = self.remotes.lock();
        let stale = remotes.get(&h.agent).is_some_and(|r| {
            h.regions.iter().any(|n| {
                !r.loaded.contains_key(&n.generation)
                    && r.loaded.iter().any(|(_, &(mem, dev, base, len))| {
                        mem == n.mem && dev == n.dev && base < n.base + n.len && n.base < base + len
                    })
            })
        });
        if stale {
            agent.forget_remote(&h.agent)?;
            bump(&COUNTERS.remote_forgets, 1);
            remotes.remove(&h.agent);
        }
        // Timed, and counted once loaded (`remote_loads`).
        let load = |md: &[u8]| {
            let t0 = std::time::Instant::now();
            let name = agent.load_remote(md);
            bump(&COUNTERS.remote_load_nanos, t0.elapsed().as_nanos() as u64);
            bump(&COUNTERS.remote_loads, u64::from(name.is_ok()));
            name
        };
        if !remotes.contains_key(&h.agent) {
            let name = load(&h.conn)?;
            if name != h.agent {
                return Err(NixlError(format!(
                    "the handles name agent {} but carry the metadata of {name}",
                    h.agent
                )));
            }
            remotes.insert(h.agent.clone(), RemoteAgent::default());
        }
        let r = remotes.get_mut(&h.agent).expect("inserted above");
        for n in &h.regions {
            if r.loaded.contains_key(&n.generation) {
                continue;
            }
            load(&n.md)?;
            r.loaded.insert(n.generation, (n.mem, n.dev, n.base, n.len));
        }
        Ok(())
    }
}

impl NixlTransport {
    /// The tensors a receive fills and where each one's bytes go (`None`
    /// for empty tensors), plus what must live while the read runs.
    #[allow(clippy::type_complexity)]
    /// Where the target tensors `ts` take each tensor's bytes (contract
    /// point 7), moving plain host targets into registered memory first.
    pub(super) fn target_destinations(
        &self,
        agent: &Arc<Agent>,
        metas: &[TensorMeta],
        ts: &[Tensor],
        from: &Peer,
    ) -> Result<TargetDests, TransportError> {
        let err = |m: String| TransportError::with_peer(NAME, from, m);
        let mut keep = Vec::new();
        let mut dests: Vec<Option<Dest>> = Vec::with_capacity(metas.len());
        check_received(NAME, metas, ts).map_err(|e| err(e.message))?;
        // Plain host targets move into one registered region first
        // (once: the next receive into them is in place).
        // Views of one storage move it once, whole.
        let mut seen = rustc_hash::FxHashSet::default();
        let plain: Vec<&Tensor> = ts
            .iter()
            .filter(|t| {
                !t.is_cuda()
                    && t.nbytes() > 0
                    && !t.with_external(|e| {
                        e.is_some_and(|e| e.memory().as_any().is::<NixlHostMem>())
                    })
                    && seen.insert(t.storage_id())
            })
            .collect();
        if !plain.is_empty() {
            let len = plain.iter().fold(0usize, |a, t| {
                (a + t.storage_nbytes()).next_multiple_of(ALIGN)
            });
            let region = HostRegion::new(agent, len).map_err(|e| err(e.0))?;
            let mut off = 0usize;
            for t in plain {
                let mem = Box::new(NixlHostMem {
                    region: region.clone(),
                    offset: off,
                    len: t.storage_nbytes(),
                });
                if !t.migrate_storage(mem).map_err(|e| err(e.to_string()))? {
                    return Err(err(format!(
                        "target tensor {:?} lives in memory of another transport; \
                         receive into rdt host tensors (Tensor::zeros) or tensors \
                         received over nixl",
                        t.meta()
                    )));
                }
                off = (off + t.storage_nbytes()).next_multiple_of(ALIGN);
            }
        }
        keep.push(one_per_storage(ts));
        let mut regs = SlabRegistrations::default();
        let mut runs = Vec::new();
        // Views of one storage (a flat buffer of parameters) share
        // its lookup: each lies at the storage's base plus its
        // offset. (The lookup also orders rdt's stream after the
        // storage's last writer, once per storage.)
        let mut last: Option<(usize, Desc, u64)> = None; // storage, its base, registration
        for (i, t) in ts.iter().enumerate() {
            let dest = match &last {
                Some((id, base, reg)) if *id == t.storage_id() && t.nbytes() > 0 => Some(Dest {
                    desc: Desc {
                        addr: base.addr + t.byte_offset(),
                        len: t.nbytes(),
                        ..*base
                    },
                    local_reg: *reg,
                }),
                _ => {
                    let d = self.local_dest(agent, t, &mut regs).map_err(err)?;
                    if let Some(d) = &d {
                        let base = Desc {
                            addr: d.desc.addr - t.byte_offset(),
                            ..d.desc
                        };
                        last = Some((t.storage_id(), base, d.local_reg));
                        runs.push(Run {
                            first: i,
                            storage: Arc::downgrade(t.storage()),
                            base,
                            reg: d.local_reg,
                        });
                    }
                    d
                }
            };
            dests.push(dest);
        }
        keep.extend(regs.into_kept());
        Ok(TargetDests { dests, keep, runs })
    }

    /// The plan of a receive into `ts` (NX-8): a kept one made for the
    /// same content and the same targets whose memory has not moved, or
    /// one worked out now (and kept, for a large object). With it, what
    /// the read keeps alive: a tensor per target storage and the slab
    /// registrations (PL-1).
    pub(super) fn target_plan(
        &self,
        agent: &Arc<Agent>,
        exported: &Exported,
        ts: &Arc<[Tensor]>,
        layout: Option<u64>,
        from: &Peer,
    ) -> Result<(Arc<TargetPlan>, Vec<Kept>), TransportError> {
        let err = |m: String| TransportError::with_peer(NAME, from, m);
        let metas = &exported.metas;
        let kept = metas.len() >= PLAN_MIN_TENSORS;
        if kept {
            if let Some(p) = self
                .target_plans
                .find(|p| p.content.fits(exported, layout) && (p.made_for(ts) || p.same_places(ts)))
            {
                // Contract point 2: the targets are what the metadata says
                // (as they were when the plan was made, if they are its
                // own list: nothing in it changes).
                let own = p.made_for(ts);
                if !own {
                    check_received(NAME, metas, ts).map_err(|e| err(e.message))?;
                }
                if let Some(keep) = self.target_memory_unmoved(agent, &p, ts) {
                    bump(&COUNTERS.target_plans_reused, 1);
                    bump(&COUNTERS.target_lists_reused, u64::from(own));
                    return Ok((p, keep));
                }
            }
        }
        let h = Handles::decode(&exported.handles, metas).map_err(err)?;
        check_handles(&h, metas).map_err(err)?;
        let TargetDests { dests, keep, runs } = self.target_destinations(agent, metas, ts, from)?;
        // Pair remote and local ranges (one pair per tensor, in order: no
        // map on a path that 10 000 tensors take).
        let mut pairs: Vec<Pair> = Vec::with_capacity(h.tensors.len());
        for (p, d) in h.tensors.iter().zip(&dests) {
            let Some(d) = d else { continue };
            pairs.push(h.pair(p, d.desc, d.local_reg));
        }
        let lists = coalesce(pairs);
        let content = if kept {
            PlanContent {
                handles: exported.handles.clone(),
                metas: metas.clone(),
                layout: AtomicU64::new(layout.unwrap_or(0)),
            }
        } else {
            PlanContent::default()
        };
        let plan = Arc::new(TargetPlan {
            content,
            targets: Arc::downgrade(ts),
            h,
            places: ts
                .iter()
                .map(|t| (t.storage_id(), t.byte_offset()))
                .collect(),
            runs,
            lists,
        });
        if kept {
            self.target_plans.keep(plan.clone());
        }
        Ok((plan, keep))
    }

    /// Whether each target storage of `plan` is still where it was, in the
    /// same registration (NX-8): looked up once per storage, as a receive
    /// without a plan does. Then what the read keeps alive.
    pub(super) fn target_memory_unmoved(
        &self,
        agent: &Arc<Agent>,
        plan: &TargetPlan,
        ts: &[Tensor],
    ) -> Option<Vec<Kept>> {
        let mut regs = SlabRegistrations::default();
        for run in &plan.runs {
            let t = &ts[run.first];
            let d = self.local_dest(agent, t, &mut regs).ok()??;
            let base = Desc {
                addr: d.desc.addr - t.byte_offset(),
                ..d.desc
            };
            if base != run.base || d.local_reg != run.reg {
                return None;
            }
        }
        let mut keep = vec![one_per_storage(plan.runs.iter().map(|r| &ts[r.first]))];
        keep.extend(regs.into_kept());
        Some(keep)
    }

    /// Where `t`'s bytes are in registered memory of this process.
    pub(super) fn local_dest(
        &self,
        agent: &Arc<Agent>,
        t: &Tensor,
        regs: &mut SlabRegistrations,
    ) -> Result<Option<Dest>, String> {
        if t.nbytes() == 0 {
            return Ok(None);
        }
        if t.is_cuda() {
            let found = t
                .with_device_buffer(|d| slab_of(d).map(|(s, o)| (s, o, d.device_ptr())))
                .map_err(|e| e.to_string())?;
            let Some((slab, _, ptr)) = found else {
                return Err(format!(
                    "target tensor {:?} is not in memory rdt allocated on this GPU (a cuda_ipc \
                     import?); receive into tensors made with Tensor::cuda_empty",
                    t.meta()
                ));
            };
            let g = regs.of(self, agent, &slab).map_err(|e| e.0)?.generation;
            let d = Desc {
                mem: Mem::Vram,
                addr: ptr as usize,
                len: t.nbytes(),
                dev: slab.gpu.ordinal() as u64,
            };
            return Ok(Some(Dest {
                desc: d,
                local_reg: g,
            }));
        }
        let found = t.with_external(|e| {
            let e = e?;
            let m = e.memory().as_any().downcast_ref::<NixlHostMem>()?;
            Some((m.region.clone(), e.as_ptr() as usize))
        });
        let (region, addr) = found.ok_or_else(|| {
            format!(
                "tensor {:?} is not in registered memory (internal error)",
                t.meta()
            )
        })?;
        let g = region.slab.reg.generation;
        Ok(Some(Dest {
            desc: Desc {
                mem: Mem::Dram,
                addr,
                len: t.nbytes(),
                dev: 0,
            },
            local_reg: g,
        }))
    }
}

/// One tensor per storage of `ts` (neighbours of one storage count once:
/// a flat buffer's views are one), which keeps their memory alive.
pub(super) fn one_per_storage<'a>(ts: impl IntoIterator<Item = &'a Tensor>) -> Kept {
    let mut storages: Vec<Tensor> = Vec::new();
    for t in ts {
        if storages.last().is_none_or(|l| !l.shares_storage(t)) {
            storages.push(t.clone());
        }
    }
    Kept::Tensors(storages)
}

impl NixlTransport {
    /// The read plan for `exported` into fresh memory: a recent one made
    /// for the same bytes, metadata and target, or a new one (NX-7).
    pub(super) fn read_plan(
        &self,
        exported: &Exported,
        target: PlanTarget,
        layout: Option<u64>,
    ) -> Result<Arc<ReadPlan>, String> {
        let plans = if exported.metas.len() >= PLAN_MIN_TENSORS {
            &self.plans
        } else {
            &self.small_plans
        };
        if let Some(p) = plans.find(|p| p.fits(exported, target, layout)) {
            bump(&COUNTERS.read_plans_reused, 1);
            return Ok(p);
        }
        let p = Arc::new(ReadPlan::new(exported, target)?);
        if let Some(l) = layout {
            p.content.layout.store(l, Ordering::Relaxed);
        }
        plans.keep(p.clone());
        Ok(p)
    }

    /// Takes the memory `plan` lays out (one range per GPU, one host
    /// region), makes each tensor a view of it, and turns the plan's
    /// descriptor offsets into addresses in it.
    ///
    /// The tensors of a kept plan (a large object) come back as a lazy list
    /// ([`PlannedViews`]): each view is made when a call's decode wants it.
    /// Also says which GPUs' ranges are not clean (`cuda::alloc`,
    /// invariant 5): the read waits for rdt's stream there first.
    pub(super) fn take_planned(
        &self,
        agent: &Arc<Agent>,
        plan: &Arc<ReadPlan>,
        err: &dyn Fn(String) -> TransportError,
    ) -> Result<Destination, TransportError> {
        let mut keep = Vec::new();
        // Each GPU's range and registration are found once, not per
        // tensor; each tensor is a view of it (a reference count, not an
        // allocation).
        struct Lane {
            base: u64,
            /// A tensor over the whole range, whose storage the received
            /// tensors are views of.
            whole: Tensor,
        }
        let mut lanes: Vec<Lane> = Vec::with_capacity(plan.lanes.len());
        let mut not_clean = Vec::new();
        for &(o, len) in &plan.lanes {
            let gpu = crate::cuda::gpu(o).map_err(|e| err(format!("CUDA device {o}: {e}")))?;
            let (r, clean) = crate::cuda::alloc::alloc_for_other_stream(&gpu, len.max(1))
                .map_err(|e| err(format!("allocating {len} B on CUDA device {o}: {e}")))?;
            if !clean {
                not_clean.push(o);
            }
            // The id is the lane's address: whether destinations repeat
            // (their READ requests are kept per address) shows here.
            crate::trace::timeline(
                "nixl lane allocated",
                crate::cuda::DeviceBuffer::device_ptr(&r),
            );
            let reg = self
                .slab_registration(agent, &r.slab)
                .map_err(|e| err(e.0))?;
            crate::trace::timeline("nixl lane registration found", 0);
            let range = Arc::new(r);
            let range_len = crate::cuda::DeviceBuffer::len(&*range);
            let whole = Tensor::from_device_buffer(
                crate::dtype::DType::U8,
                &[range_len],
                range.slab.gpu.device(),
                Box::new(crate::cuda::alloc::SlabSlice::new(
                    range.clone(),
                    0,
                    range_len,
                )),
            )
            .map_err(|e| err(e.to_string()))?;
            lanes.push(Lane {
                base: crate::cuda::DeviceBuffer::device_ptr(&*range),
                whole,
            });
            keep.push(Kept::Slab(reg));
            keep.push(Kept::Range(range));
        }
        crate::trace::timeline("nixl lanes ready", 0);
        let host = if plan.host_len == 0 {
            None
        } else {
            let region = HostRegion::new(agent, plan.host_len).map_err(|e| err(e.0))?;
            keep.push(Kept::Host(region.clone()));
            let len = region.len;
            let whole = Tensor::from_external(
                crate::dtype::DType::U8,
                &[len],
                Device::Cpu,
                Box::new(NixlHostMem {
                    region: region.clone(),
                    offset: 0,
                    len,
                }),
            )
            .map_err(|e| err(e.to_string()))?;
            Some((region, whole))
        };
        let bases: Vec<u64> = lanes.iter().map(|l| l.base).collect();
        let host_ptr = host.as_ref().map(|(r, _)| r.ptr() as usize);
        let views = PlannedViews {
            plan: plan.clone(),
            lanes: lanes.into_iter().map(|l| l.whole).collect(),
            host: host.map(|(_, whole)| whole),
        };
        crate::trace::timeline("nixl lanes and host ready", 0);
        let out = if plan.at.len() >= PLAN_MIN_TENSORS {
            TensorList::lazy(Arc::new(views))
        } else {
            TensorList::from(
                (0..plan.at.len())
                    .map(|i| views.make(i))
                    .collect::<Vec<_>>(),
            )
        };
        crate::trace::timeline("nixl views made", 0);
        let lists = plan
            .lists
            .iter()
            .map(|(local, remote)| {
                let local = local
                    .iter()
                    .map(|d| {
                        let base = match d.mem {
                            Mem::Vram => plan
                                .lanes
                                .iter()
                                .position(|&(o, _)| o as u64 == d.dev)
                                .map(|l| bases[l] as usize),
                            _ => host_ptr,
                        }
                        .expect("the plan's descriptors lie in its lanes and region");
                        Desc {
                            addr: base + d.addr,
                            ..*d
                        }
                    })
                    .collect();
                (local, remote.clone())
            })
            .collect();
        Ok(Destination {
            out,
            lists,
            keep,
            not_clean,
        })
    }
}

impl NixlTransport {
    /// The destination made ahead for `plan`, if there is one (NX-11).
    pub(super) fn take_ready(&self, plan: &Arc<ReadPlan>) -> Option<Destination> {
        let mut ready = self.ready.lock();
        let at = ready.iter().position(|r| Arc::ptr_eq(&r.plan, plan))?;
        bump(&COUNTERS.dests_taken_ready, 1);
        Some(ready.remove(at).take())
    }

    /// Notes that `plan`'s next destination is to be made ahead. A
    /// process whose receives are not followed by `after_receive` (the
    /// driver's reads) keeps the last few wanted, not all.
    pub(super) fn want_ready(&self, plan: &Arc<ReadPlan>) {
        if !plan.made_ahead() {
            return;
        }
        let mut wanted = self.wanted.lock();
        if !wanted.iter().any(|p| Arc::ptr_eq(p, plan)) {
            if wanted.len() >= SMALL_PLANS_KEPT {
                wanted.remove(0);
            }
            wanted.push(plan.clone());
        }
    }

    /// Makes the destinations wanted (NX-11): the memory, its
    /// registration, the tensors and the descriptor lists of the next
    /// receive of each plan, so that it posts its READ without them.
    pub(super) fn make_ready(&self) {
        let wanted = std::mem::take(&mut *self.wanted.lock());
        if wanted.is_empty() {
            return;
        }
        let Ok(agent) = self.agent() else { return };
        let err = |m: String| TransportError::new(NAME, m);
        for plan in wanted {
            if self
                .ready
                .lock()
                .iter()
                .any(|r| Arc::ptr_eq(&r.plan, &plan))
            {
                continue;
            }
            // A failure here is not the receive's: it makes its own.
            let Ok(dest) = self.take_planned(&agent, &plan, &err) else {
                continue;
            };
            bump(&COUNTERS.dests_made_ahead, 1);
            crate::trace::timeline("nixl destination made ahead", 0);
            let made = ReadyDest::new(plan, dest);
            let mut ready = self.ready.lock();
            if ready.iter().any(|r| Arc::ptr_eq(&r.plan, &made.plan)) {
                continue;
            }
            if ready.len() >= SMALL_PLANS_KEPT {
                ready.remove(0);
            }
            ready.push(made);
        }
    }
}

pub(super) fn rand_u32() -> u32 {
    let mut b = [0u8; 4];
    if getrandom::getrandom(&mut b).is_err() {
        return std::process::id().rotate_left(16);
    }
    u32::from_le_bytes(b)
}
