//! The handles an export hands out (on the wire and decoded), and the pairs
//! of remote and local ranges a read is made of.

use super::*;

/// One tensor in the handles.
#[derive(Clone, Copy, Debug)]
pub(super) struct Piece {
    pub(super) region: u32,
    pub(super) offset: u64,
    /// The tensor's bytes: not on the wire, its metadata says it.
    pub(super) len: u64,
}

/// What [`Exported::handles`] holds ([`HandlesWire`] on the wire).
#[derive(Clone, Debug)]
pub(super) struct Handles {
    pub(super) agent: String,
    pub(super) conn: Vec<u8>,
    pub(super) regions: Vec<RegionHandle>,
    pub(super) tensors: Vec<Piece>,
}

/// The handles as they travel. A tensor's registration comes from runs of
/// tensors in one registration, its length from its metadata, and its
/// offset from the previous tensor's end: each tensor is the gap after
/// the one before it in its run (the first one's after 0), zigzag
/// varints written as runs of equal gaps (`metas_wire::put_run`) in one
/// run of bytes. Tensors of one flat buffer, or allocated one after
/// another from a slab, are gaps of 0, one run: the handles of 10 000 of
/// them went from 80 KB (an 8-byte offset each) to 10 KB (a byte each),
/// then to a few bytes, bytes that every pass encodes, forwards through
/// the driver and reads. Nothing in it names
/// the object: the same tensors exported again (a weight sync's
/// parameters, every step) encode to the same bytes, so a consumer finds
/// its decoded metadata and its read plan again (NX-7).
#[derive(Serialize, Deserialize)]
pub(super) struct HandlesWire {
    pub(super) agent: String,
    #[serde(with = "serde_bytes")]
    pub(super) conn: Vec<u8>,
    pub(super) regions: Vec<RegionHandle>,
    /// (registration index, tensors in a row in it), in tensor order.
    pub(super) runs: Vec<(u32, u32)>,
    /// Each tensor's offset in its registration, less the end of the
    /// tensor before it in its run (0 for a run's first): zigzag varints,
    /// as runs of equal values (`metas_wire::put_run`).
    #[serde(with = "serde_bytes")]
    pub(super) gaps: Vec<u8>,
}

impl HandlesWire {
    /// The producer's agent named by encoded handles, read without
    /// decoding the rest (`agent` is their first field); `None` if
    /// malformed.
    pub(super) fn agent_of(handles: &[u8]) -> Option<&str> {
        postcard::take_from_bytes::<&str>(handles)
            .ok()
            .map(|(a, _)| a)
    }
}

/// A signed gap as an unsigned varint's value (zigzag: small of either
/// sign stays small).
pub(super) fn zigzag(v: i128) -> u64 {
    ((v << 1) ^ (v >> 127)) as u64
}

pub(super) fn unzigzag(v: u64) -> i128 {
    ((v >> 1) as i128) ^ -((v & 1) as i128)
}

impl Handles {
    /// Piece `p`'s remote range (its registration checked by
    /// [`check_handles`]) paired with `local`, in local registration
    /// `local_reg`.
    pub(super) fn pair(&self, p: &Piece, local: Desc, local_reg: u64) -> Pair {
        let r = &self.regions[p.region as usize];
        Pair {
            remote: Desc {
                mem: r.mem,
                addr: (r.base + p.offset) as usize,
                len: p.len as usize,
                dev: r.dev,
            },
            remote_reg: r.generation,
            local,
            local_reg,
        }
    }

    pub(super) fn encode(&self) -> Result<Vec<u8>, String> {
        let mut runs: Vec<(u32, u32)> = Vec::new();
        let mut gaps = Vec::new();
        let mut gap_runs = crate::metas_wire::RunWriter::new(&mut gaps);
        let mut end = 0u64;
        for p in &self.tensors {
            match runs.last_mut() {
                Some((r, n)) if *r == p.region => *n += 1,
                _ => {
                    runs.push((p.region, 1));
                    end = 0;
                }
            }
            let gap = p.offset as i128 - end as i128;
            // Runs hold values below 2^63 (`put_run`).
            if gap.unsigned_abs() >= 1 << 61 {
                return Err(format!(
                    "a tensor at offset {} of its registration",
                    p.offset
                ));
            }
            gap_runs.push(zigzag(gap));
            end = p.offset + p.len;
        }
        gap_runs.finish();
        postcard::to_allocvec(&HandlesWire {
            agent: self.agent.clone(),
            conn: self.conn.clone(),
            regions: self.regions.clone(),
            runs,
            gaps,
        })
        .map_err(|e| e.to_string())
    }

    /// Decodes handles sent with `metas` (each piece's length is its
    /// tensor's); [`check_handles`] checks them against the rest.
    pub(super) fn decode(bytes: &[u8], metas: &[TensorMeta]) -> Result<Handles, String> {
        let w: HandlesWire =
            postcard::from_bytes(bytes).map_err(|e| format!("malformed nixl handles: {e}"))?;
        let n = metas.len();
        let in_runs = w
            .runs
            .iter()
            .try_fold(0usize, |a, &(_, k)| a.checked_add(k as usize));
        let malformed = |what: &str| {
            format!(
                "malformed nixl handles: {what} ({:?} tensors in runs, {} gap bytes, for {n} \
                 tensors)",
                in_runs,
                w.gaps.len()
            )
        };
        if in_runs != Some(n) {
            return Err(malformed("the runs do not cover the tensors"));
        }
        let mut tensors = Vec::with_capacity(n);
        let mut gaps = &w.gaps[..];
        // The gap being repeated, and how many more times.
        let (mut g, mut left) = (0u64, 0u64);
        let mut metas = metas.iter();
        for &(region, k) in &w.runs {
            let mut end = 0u64;
            for m in metas.by_ref().take(k as usize) {
                if left == 0 {
                    let (v, count, rest) = crate::metas_wire::take_run(gaps)
                        .ok_or_else(|| malformed("gaps cut short"))?;
                    (g, left, gaps) = (v, count, rest);
                }
                left -= 1;
                let offset = u64::try_from(end as i128 + unzigzag(g))
                    .map_err(|_| malformed("an offset out of range"))?;
                let len = m.nbytes() as u64;
                end = offset
                    .checked_add(len)
                    .ok_or_else(|| malformed("an offset out of range"))?;
                tensors.push(Piece {
                    region,
                    offset,
                    len,
                });
            }
        }
        if !gaps.is_empty() || left != 0 {
            return Err(malformed("gaps left over"));
        }
        Ok(Handles {
            agent: w.agent,
            conn: w.conn,
            regions: w.regions,
            tensors,
        })
    }
}

/// One tensor's remote range and where it lands, with the registration
/// each lies in.
pub(super) struct Pair {
    pub(super) remote: Desc,
    pub(super) remote_reg: u64,
    pub(super) local: Desc,
    pub(super) local_reg: u64,
}

/// Where one tensor goes on the consumer.
pub(super) struct Dest {
    pub(super) desc: Desc,
    /// The local registration it lies in (descriptors never span two).
    pub(super) local_reg: u64,
}

/// Checks the handles against the metadata (malformed input is an error,
/// never a panic or an out-of-range read).
pub(super) fn check_handles(h: &Handles, metas: &[TensorMeta]) -> Result<(), String> {
    if h.tensors.len() != metas.len() {
        return Err(format!(
            "the handles describe {} tensors, the metadata {}",
            h.tensors.len(),
            metas.len()
        ));
    }
    for (i, (p, m)) in h.tensors.iter().zip(metas).enumerate() {
        let r = h.regions.get(p.region as usize).ok_or_else(|| {
            format!(
                "tensor #{i} names registration {} of {}",
                p.region,
                h.regions.len()
            )
        })?;
        if p.len as usize != m.nbytes() {
            return Err(format!(
                "tensor #{i}: {} B in the handles, {} B by its metadata",
                p.len,
                m.nbytes()
            ));
        }
        if p.offset.checked_add(p.len).is_none_or(|e| e > r.len) {
            return Err(format!(
                "tensor #{i} reaches past its registration ({}+{} of {} B)",
                p.offset, p.len, r.len
            ));
        }
        let cuda = matches!(m.device, Device::Cuda { .. });
        if cuda != (r.mem == Mem::Vram) {
            return Err(format!(
                "tensor #{i} is on {} but its registration is {:?} memory",
                m.device, r.mem
            ));
        }
    }
    Ok(())
}
