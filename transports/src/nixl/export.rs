//! Export: a tensor list published as handles to registered memory.

use super::*;

impl NixlTransport {
    pub(super) async fn export_inner(
        &self,
        key: ObjectKey,
        tensors: &[Tensor],
    ) -> Result<Exported, TransportError> {
        let agent = self.agent()?;
        drain_notifications(&agent);
        let err = |m: String| TransportError::new(NAME, m);
        let mut kept: Vec<Kept> = Vec::new();
        // The registrations the tensors lie in, each once, and where each
        // tensor is: (index in `regs`, offset).
        let mut regs: Vec<Arc<Registered>> = Vec::new();
        let mut slab_regs = SlabRegistrations::default();
        let mut at: Vec<Option<(u32, usize)>> = vec![None; tensors.len()];
        fn reg_index(regs: &mut Vec<Arc<Registered>>, reg: &Arc<Registered>) -> u32 {
            match regs.iter().rposition(|r| Arc::ptr_eq(r, reg)) {
                Some(i) => i as u32,
                None => {
                    regs.push(reg.clone());
                    (regs.len() - 1) as u32
                }
            }
        }
        // Host tensors that need a region: plain memory moves in, foreign
        // memory is copied in.
        let mut to_place: Vec<usize> = Vec::new();
        let mut seen_storage: rustc_hash::FxHashMap<usize, usize> = Default::default();
        let mut dups: Vec<(usize, usize)> = Vec::new();
        let mut gpus: Vec<Arc<crate::cuda::Gpu>> = Vec::new();
        let mut last_region: Option<Arc<HostRegion>> = None;
        for (i, t) in tensors.iter().enumerate() {
            if t.is_cuda() {
                let found = t
                    .with_device_buffer(|d| {
                        if !gpus.iter().any(|g| Arc::ptr_eq(g, d.gpu())) {
                            gpus.push(d.gpu().clone());
                        }
                        slab_of(d)
                    })
                    .map_err(|e| err(e.to_string()))?;
                let (slab, offset, owner) = match found {
                    Some((s, o)) => (s, o, None),
                    None => {
                        // Foreign device memory (a cuda_ipc import): copied
                        // into a slab of this process.
                        let copy = t.deep_copy().map_err(|e| err(e.to_string()))?;
                        let (s, o) = copy
                            .with_device_buffer(slab_of)
                            .map_err(|e| err(e.to_string()))?
                            .ok_or_else(|| err("a CUDA copy is not in an rdt slab".into()))?;
                        (s, o, Some(copy))
                    }
                };
                let reg = slab_regs.of(self, &agent, &slab).map_err(|e| err(e.0))?;
                let r = reg_index(&mut regs, reg);
                kept.extend(owner.map(Kept::Tensor));
                at[i] = Some((r, offset));
                continue;
            }
            if let Some(&j) = seen_storage.get(&t.storage_id()) {
                // The same storage twice (a clone, or another view of it):
                // published once, at the first.
                dups.push((i, j));
                continue;
            }
            seen_storage.insert(t.storage_id(), i);
            let ours = t.with_external(|e| {
                let e = e?;
                let m = e.memory().as_any().downcast_ref::<NixlHostMem>()?;
                let same = last_region
                    .as_ref()
                    .is_some_and(|r| Arc::ptr_eq(r, &m.region));
                Some((
                    (!same).then(|| m.region.clone()),
                    m.region.offset + m.offset + e.offset(),
                ))
            });
            match ours {
                Some((new_region, offset)) => {
                    // Registered already (exported or received before): no
                    // copy, no registration.
                    if let Some(region) = new_region {
                        kept.push(Kept::Host(region.clone()));
                        last_region = Some(region);
                    }
                    let region = last_region.as_ref().expect("set above");
                    at[i] = Some((reg_index(&mut regs, &region.slab.reg), offset));
                }
                None => to_place.push(i),
            }
        }
        if !to_place.is_empty() {
            // One region for every host tensor that needs one (NX-3).
            let mut offsets = Vec::with_capacity(to_place.len());
            let mut len = 0usize;
            for &i in &to_place {
                // Room for the whole storage: a view's storage moves whole.
                offsets.push(len);
                len = (len + tensors[i].storage_nbytes()).next_multiple_of(ALIGN);
            }
            let region = HostRegion::new(&agent, len).map_err(|e| err(e.0))?;
            let r = reg_index(&mut regs, &region.slab.reg);
            for (&i, &offset) in to_place.iter().zip(&offsets) {
                let t = &tensors[i];
                let mem = Box::new(NixlHostMem {
                    region: region.clone(),
                    offset,
                    len: t.storage_nbytes(),
                });
                // Where the tensor's bytes are once its storage is in.
                let at_tensor = offset + t.byte_offset();
                if !t.migrate_storage(mem).map_err(|e| err(e.to_string()))? {
                    // Foreign external memory: copied into the region.
                    let bytes = t.to_bytes().map_err(|e| err(e.to_string()))?;
                    // SAFETY: a view's bytes lie within its storage, and
                    // the storage's length lies within the region at
                    // `offset`, which nothing else uses yet.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            bytes.as_ptr(),
                            region.ptr().add(at_tensor),
                            bytes.len(),
                        )
                    };
                }
                at[i] = Some((r, region.offset + at_tensor));
            }
            kept.push(Kept::Host(region));
        }
        for (i, j) in dups {
            // The first one's storage starts its own offset before it.
            at[i] =
                at[j].map(|(r, o)| (r, o - tensors[j].byte_offset() + tensors[i].byte_offset()));
        }
        // CUDA tensors: the GPU must have passed every write to them before
        // a peer reads.
        for g in gpus {
            g.completion()
                .map_err(|e| err(e.to_string()))?
                .wait()
                .await
                .map_err(|e| err(e.to_string()))?;
        }
        let conn = agent.connection_md().to_vec();
        let regions: Vec<RegionHandle> = regs.iter().map(|r| r.handle()).collect();
        let mut pieces = Vec::with_capacity(tensors.len());
        for (t, a) in tensors.iter().zip(at) {
            let (region, offset) = a.expect("every tensor is placed above");
            pieces.push(Piece {
                region,
                offset: offset as u64,
                len: t.nbytes() as u64,
            });
        }
        // Device slabs' registrations live as long as the export (host
        // ones go with their regions, kept above).
        kept.extend(slab_regs.into_kept());
        let handles = Handles {
            agent: agent.name().to_string(),
            conn,
            regions,
            tensors: pieces,
        };
        self.exports.lock().entry(key).or_default().extend(kept);
        Ok(Exported {
            metas: tensors.iter().map(Tensor::meta).collect(),
            handles: handles.encode().map_err(err)?,
            inline: Vec::new(),
        })
    }
}
