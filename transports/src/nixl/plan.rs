//! Read plans (NX-7) and target plans (NX-8): where a receive's tensors land
//! and the coalesced descriptors it reads.

use super::*;

/// Two neighbouring tensors whose gap is at most this many bytes (on both
/// sides alike) are read as one descriptor, gap included: reading a little
/// padding costs less than another descriptor.
pub(super) const MERGE_GAP: usize = 4096;

/// What [`NixlTransport::target_destinations`] worked out.
pub(super) struct TargetDests {
    /// Where each target's bytes are (`None`: it has none).
    pub(super) dests: Vec<Option<Dest>>,
    /// What the read keeps alive.
    pub(super) keep: Vec<Kept>,
    /// Where each run of targets in one storage started.
    pub(super) runs: Vec<Run>,
}

/// Targets in a row in one storage, as a [`TargetPlan`] found them.
pub(super) struct Run {
    /// The first of them.
    pub(super) first: usize,
    /// Their storage, held, never read. Weak: a plan does not keep a
    /// caller's memory alive, yet the storage's address is not reused
    /// while this lives, so a target at that address is that storage.
    #[allow(dead_code)]
    pub(super) storage: std::sync::Weak<crate::tensor::Storage>,
    /// Where the storage's bytes started (its descriptor at offset 0).
    pub(super) base: Desc,
    /// The registration they were in.
    pub(super) reg: u64,
}

/// The content a plan was made for: the handles' bytes and the metadata,
/// compared once per layout and found by the layout's id after.
#[derive(Default)]
pub(super) struct PlanContent {
    pub(super) handles: Vec<u8>,
    pub(super) metas: Vec<TensorMeta>,
    /// The last layout ([`TransferCtx::layout`]) found to be that content
    /// (0: none yet).
    pub(super) layout: AtomicU64,
}

impl PlanContent {
    /// Made for `exported`'s content. A layout seen before answers at
    /// once; otherwise the content is compared, and the layout of a match
    /// remembered.
    pub(super) fn fits(&self, exported: &Exported, layout: Option<u64>) -> bool {
        if layout.is_some_and(|l| self.layout.load(Ordering::Relaxed) == l) {
            return true;
        }
        let same = self.handles == exported.handles && self.metas == exported.metas;
        if let (true, Some(l)) = (same, layout) {
            self.layout.store(l, Ordering::Relaxed);
        }
        same
    }
}

/// A receive into target tensors, worked out once per layout and targets
/// (NX-8): a weight update reads the same layout into the same parameters
/// at every step, and working out its 10 000 destinations, pairs and
/// coalesced descriptors each time cost most of its pass.
pub(super) struct TargetPlan {
    pub(super) content: PlanContent,
    /// The target list it was made for. A receive into that list again
    /// (a [`Target::Tensors`] the caller kept) has the same places and
    /// passes the same check, since a list is never written; the weak
    /// reference keeps its address from being taken by another list.
    pub(super) targets: std::sync::Weak<[Tensor]>,
    /// The handles, decoded and checked against the metadata.
    pub(super) h: Handles,
    /// Each target's storage and byte offset.
    pub(super) places: Vec<(usize, usize)>,
    /// Each run of targets in one storage: checked on every receive.
    pub(super) runs: Vec<Run>,
    /// The coalesced (local, remote) descriptor lists.
    pub(super) lists: Vec<(Vec<Desc>, Vec<Desc>)>,
}

impl TargetPlan {
    /// Whether `ts` is the very list this plan was made for.
    pub(super) fn made_for(&self, ts: &Arc<[Tensor]>) -> bool {
        std::ptr::addr_eq(self.targets.as_ptr(), Arc::as_ptr(ts))
    }

    /// Whether `ts` are the targets this plan was made for: the same
    /// storages at the same offsets. An equal address is the same storage:
    /// each storage with bytes among the targets starts a run, whose weak
    /// reference keeps its address from being reused ([`Run::storage`]).
    /// Their memory is checked apart.
    pub(super) fn same_places(&self, ts: &[Tensor]) -> bool {
        ts.len() == self.places.len()
            && ts
                .iter()
                .zip(&self.places)
                .all(|(t, &(s, o))| t.storage_id() == s && t.byte_offset() == o)
    }
}

/// The target of a receive into fresh memory, as a read plan keys it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum PlanTarget {
    Any,
    Device(usize),
    Host,
}

impl PlanTarget {
    pub(super) fn of(t: &Target) -> PlanTarget {
        match t {
            Target::Device(o) => PlanTarget::Device(*o),
            Target::Host => PlanTarget::Host,
            Target::Any | Target::Tensors(_) => PlanTarget::Any,
        }
    }
}

/// Where a tensor received into fresh memory lands.
#[derive(Clone, Copy, Debug)]
pub(super) enum At {
    /// At this offset of the range taken on GPU lane `.0` (the lane's index
    /// in [`ReadPlan::lanes`]).
    Lane(u32, usize),
    /// At this offset of the host region.
    Host(usize),
    /// Nowhere: a host tensor of no bytes.
    Empty,
}

/// A receive into fresh memory, worked out once per layout (NX-7).
pub(super) struct ReadPlan {
    pub(super) target: PlanTarget,
    /// The handles' bytes and the metadata it was made for (its key,
    /// with the target).
    pub(super) content: PlanContent,
    /// The handles, decoded and checked against the metadata.
    pub(super) h: Handles,
    /// Bytes taken on each GPU, one range per GPU: (ordinal, length).
    pub(super) lanes: Vec<(usize, usize)>,
    /// Bytes of the host region (laid out like the producer's memory, so
    /// neighbours stay neighbours); 0: none.
    pub(super) host_len: usize,
    /// Where each tensor lands.
    pub(super) at: Vec<At>,
    /// Each distinct (dtype, shape) of the object, once.
    pub(super) kinds: Vec<(crate::dtype::DType, crate::shape::Shape)>,
    /// Each tensor's index in `kinds`: making 10 000 views reads 4 bytes
    /// of this and a few kinds, not 10 000 metadata entries of 72 bytes.
    pub(super) kind_of: Vec<u32>,
    /// The bytes of all tensors.
    pub(super) nbytes: usize,
    /// The coalesced (local, remote) descriptor lists, each local address
    /// an offset in its lane (`dev` is the lane's GPU) or in the host
    /// region.
    pub(super) lists: Vec<(Vec<Desc>, Vec<Desc>)>,
}

/// Read plans kept (the last used first).
pub(super) const PLANS_KEPT: usize = 4;

/// Objects with at least this many tensors come back as lazy lists, and
/// their plans are kept in [`NixlTransport::plans`]; smaller ones in
/// [`NixlTransport::small_plans`].
pub(super) const PLAN_MIN_TENSORS: usize = 64;

/// Small objects' read plans kept. Since every head of 64 bytes or more
/// gets a layout id (`RecentHeads`), a small object passed again finds
/// its plan by that id, one comparison; planning it again (decoding and
/// checking its handles) took about 2.5 µs of a 4 KiB pass on the 2×H200
/// host.
pub(super) const SMALL_PLANS_KEPT: usize = 8;

/// The distinct (dtype, shape) pairs of `metas` in order of first use,
/// and each tensor's index among them (a model's parameters have a few
/// hundred shapes at most).
pub(super) fn kinds_of(
    metas: &[TensorMeta],
) -> (Vec<(crate::dtype::DType, crate::shape::Shape)>, Vec<u32>) {
    let mut index: rustc_hash::FxHashMap<(crate::dtype::DType, &[usize]), u32> = Default::default();
    let mut kinds = Vec::new();
    let kind_of = metas
        .iter()
        .map(|m| {
            *index.entry((m.dtype, &m.shape[..])).or_insert_with(|| {
                kinds.push((m.dtype, m.shape.clone()));
                (kinds.len() - 1) as u32
            })
        })
        .collect();
    (kinds, kind_of)
}

impl ReadPlan {
    pub(super) fn new(exported: &Exported, target: PlanTarget) -> Result<ReadPlan, String> {
        let metas = &exported.metas;
        let h = Handles::decode(&exported.handles, metas)?;
        check_handles(&h, metas)?;
        // CUDA tensors land on the same GPU where this process sees it,
        // else on its first GPU; on the host if it has none.
        let cuda_here = crate::cuda::available().is_ok();
        let gpu_of: Vec<Option<usize>> = metas
            .iter()
            .map(|m| match (&m.device, target) {
                (Device::Cpu, _) | (_, PlanTarget::Host) => None,
                (Device::Cuda { .. }, PlanTarget::Any) if !cuda_here => None,
                (Device::Cuda { .. }, PlanTarget::Device(o)) => Some(o),
                (Device::Cuda { uuid, .. }, _) => Some(crate::cuda::ordinal_of(uuid).unwrap_or(0)),
            })
            .collect();
        let mut at = vec![At::Empty; metas.len()];
        // Host tensors: one region laid out like the producer's, so
        // neighbours stay neighbours (one descriptor).
        let mut order: Vec<usize> = (0..metas.len())
            .filter(|&i| gpu_of[i].is_none() && metas[i].nbytes() > 0)
            .collect();
        order.sort_by_key(|&i| (h.tensors[i].region, h.tensors[i].offset));
        let mut host_len = 0usize;
        let mut run: Option<(u32, u64, u64, usize)> = None; // region, start, end, local base
        for &i in &order {
            let p = h.tensors[i];
            let end = p.offset + p.len;
            match &mut run {
                Some((r, start, rend, base))
                    if *r == p.region && p.offset <= *rend + MERGE_GAP as u64 =>
                {
                    at[i] = At::Host(*base + (p.offset - *start) as usize);
                    *rend = (*rend).max(end);
                    host_len = host_len.max(*base + (*rend - *start) as usize);
                }
                _ => {
                    let base = host_len.next_multiple_of(ALIGN);
                    at[i] = At::Host(base);
                    run = Some((p.region, p.offset, end, base));
                    host_len = base + p.len as usize;
                }
            }
        }
        // CUDA tensors: one range per GPU for the whole object, laid out
        // back to back (one allocation, and neighbours for the coalescer).
        let mut lanes: Vec<(usize, usize)> = Vec::new();
        for (i, m) in metas.iter().enumerate() {
            if let Some(o) = gpu_of[i] {
                let lane = match lanes.iter().position(|&(n, _)| n == o) {
                    Some(l) => l,
                    None => {
                        lanes.push((o, 0));
                        lanes.len() - 1
                    }
                };
                let len = &mut lanes[lane].1;
                at[i] = At::Lane(lane as u32, *len);
                *len = (*len + m.nbytes()).next_multiple_of(crate::cuda::alloc::ALIGN);
            }
        }
        // Pair remote and local ranges, local ones as offsets: a lane is
        // one range of one slab (one registration) and the host region is
        // one registration, so (memory type, GPU) tells them apart.
        let mut pairs: Vec<Pair> = Vec::with_capacity(metas.len());
        for (p, a) in h.tensors.iter().zip(&at) {
            let len = p.len as usize;
            let local = match *a {
                _ if len == 0 => continue,
                At::Lane(l, offset) => Desc {
                    mem: Mem::Vram,
                    addr: offset,
                    len,
                    dev: lanes[l as usize].0 as u64,
                },
                At::Host(offset) => Desc {
                    mem: Mem::Dram,
                    addr: offset,
                    len,
                    dev: 0,
                },
                At::Empty => continue,
            };
            pairs.push(h.pair(p, local, 0));
        }
        let lists = coalesce(pairs);
        let (kinds, kind_of) = kinds_of(metas);
        bump(&COUNTERS.read_plans_made, 1);
        Ok(ReadPlan {
            target,
            content: PlanContent {
                handles: exported.handles.clone(),
                metas: metas.clone(),
                layout: AtomicU64::new(0),
            },
            h,
            lanes,
            host_len,
            nbytes: metas.iter().map(TensorMeta::nbytes).sum(),
            at,
            kinds,
            kind_of,
            lists,
        })
    }

    /// Made for this content and target.
    pub(super) fn fits(
        &self,
        exported: &Exported,
        target: PlanTarget,
        layout: Option<u64>,
    ) -> bool {
        self.target == target && self.content.fits(exported, layout)
    }
}

/// The tensors of a receive through a read plan, made on demand: views of
/// the ranges the receive took (one per GPU) and of its host region, where
/// the plan lays each tensor out (within the range's or the region's
/// length, by construction).
pub(super) struct PlannedViews {
    pub(super) plan: Arc<ReadPlan>,
    /// A tensor over each GPU's range, in the plan's lane order.
    pub(super) lanes: Vec<Tensor>,
    /// A tensor over the host region, if the plan has one.
    pub(super) host: Option<Tensor>,
}

impl MakeTensors for PlannedViews {
    fn len(&self) -> usize {
        self.plan.at.len()
    }

    fn make(&self, i: usize) -> Tensor {
        self.view(self.plan.at[i], self.plan.kind_of[i])
    }

    fn make_all(&self) -> Vec<Tensor> {
        // One pass over the two compact columns, in order.
        self.plan
            .at
            .iter()
            .zip(&self.plan.kind_of)
            .map(|(&at, &kind)| self.view(at, kind))
            .collect()
    }

    fn nbytes(&self) -> usize {
        self.plan.nbytes
    }
}

impl PlannedViews {
    /// The tensor of kind `kind` the plan put `at`. The plan's metadata is
    /// the receive's (its key: equal content, or the same layout).
    #[inline]
    pub(super) fn view(&self, at: At, kind: u32) -> Tensor {
        let (dtype, shape) = &self.plan.kinds[kind as usize];
        match (at, &self.host) {
            (At::Lane(l, offset), _) => Tensor::view_of_storage(
                *dtype,
                shape.clone(),
                self.lanes[l as usize].storage(),
                offset,
            ),
            (At::Host(offset), Some(whole)) => {
                Tensor::view_of_storage(*dtype, shape.clone(), whole.storage(), offset)
            }
            // `At::Empty`: a host tensor of no bytes (the plan gives every
            // host tensor with bytes a place in the region).
            _ => Tensor::from_bytes(*dtype, shape, Vec::new())
                .expect("a tensor the plan placed nowhere has no bytes"),
        }
    }
}

/// Orders the pairs by memory types and remote address and merges
/// neighbours whose gap is at most [`MERGE_GAP`] on both sides (the gap is
/// read too: cheaper than a descriptor); one (local, remote) list per pair
/// of memory types, since one READ moves between two types only.
///
/// A receive lays its new tensors out in the producer's order, so the pairs
/// usually come sorted: checking that is one pass, and then they are not
/// moved at all.
pub(super) fn coalesce(mut pairs: Vec<Pair>) -> Vec<(Vec<Desc>, Vec<Desc>)> {
    let key = |p: &Pair| {
        (
            p.local.mem == Mem::Vram,
            p.remote.mem == Mem::Vram,
            p.remote_reg,
            p.remote.addr,
        )
    };
    if !pairs.is_sorted_by_key(key) {
        pairs.sort_by_key(key);
    }
    let mut out: Vec<(Vec<Desc>, Vec<Desc>)> = Vec::new();
    let mut last: Option<(u64, u64)> = None;
    for Pair {
        remote: r,
        remote_reg: rg,
        local: l,
        local_reg: lg,
    } in pairs
    {
        let open = out
            .last_mut()
            .filter(|(lo, re)| lo[0].mem == l.mem && re[0].mem == r.mem);
        let Some((local, remote)) = open else {
            out.push((vec![l], vec![r]));
            last = Some((rg, lg));
            continue;
        };
        if let (Some(pl), Some(pr), Some((prg, plg))) = (local.last_mut(), remote.last_mut(), last)
        {
            let rend = pr.addr + pr.len;
            let lend = pl.addr + pl.len;
            let same = prg == rg && plg == lg && pr.dev == r.dev && pl.dev == l.dev;
            if same && r.addr >= rend && l.addr >= lend {
                let gap = r.addr - rend;
                if gap == l.addr - lend && gap <= MERGE_GAP {
                    pr.len += gap + r.len;
                    pl.len += gap + l.len;
                    continue;
                }
            }
        }
        local.push(l);
        remote.push(r);
        last = Some((rg, lg));
    }
    out
}
