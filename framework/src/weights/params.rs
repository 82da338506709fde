//! [`ParamSet`]: a layout's parameters packed into a few aligned arenas,
//! laid out the same way wherever the layout is the same (WS-2).

use std::sync::Arc;

use rdt_transport::{DType, Tensor};

use super::layout::Layout;
use crate::{Error, Result};

/// Where each parameter starts in its arena: a multiple of this many
/// bytes (a CUDA allocation's granularity for vectorized copies, and more
/// than any dtype needs).
pub const PARAM_ALIGN: usize = 256;

/// The most bytes an arena holds before the next one starts (a parameter
/// larger than this has an arena of its own). 1 GiB keeps a transfer's
/// descriptors few (16 for the 16 GB `8b` layout) and each registration
/// of a size every transport takes.
pub const DEFAULT_ARENA_BYTES: usize = 1 << 30;

/// Where the arenas live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Place {
    Cpu,
    Cuda(usize),
}

/// A parameter set: every parameter of a [`Layout`] as a view of one of a
/// few contiguous arenas, in the layout's canonical order, each at an
/// offset aligned to [`PARAM_ALIGN`].
///
/// Two `ParamSet`s of equal layouts (and arena size) have the same arenas
/// at the same offsets (WS-2): a weight sync moves the arenas, one
/// descriptor each, not the parameters, so its cost does not grow with
/// the number of tensors. Write a parameter through its view
/// ([`get`](Self::get)); every clone of a `ParamSet` shares its memory.
///
/// ```
/// use rdt::weights::{Layout, ParamSet};
/// use rdt::DType;
/// let layout = Layout::new([("w", DType::F32, vec![2, 2]), ("b", DType::F32, vec![2])]).unwrap();
/// let params = ParamSet::cpu(&layout).unwrap();
/// params.get("w").unwrap().fill_(1.0f32).unwrap();
/// assert_eq!(params.get("w").unwrap().sum().unwrap(), 4.0);
/// assert_eq!(params.arenas().len(), 1);
/// ```
#[derive(Clone)]
pub struct ParamSet {
    layout: Arc<Layout>,
    place: Place,
    arena_bytes: usize,
    arenas: Arc<[Tensor]>,
    /// The parameters, in the layout's order.
    views: Arc<[Tensor]>,
}

impl std::fmt::Debug for ParamSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamSet")
            .field("params", &self.layout.len())
            .field("arenas", &self.arenas.len())
            .field("bytes", &self.nbytes())
            .field("place", &self.place)
            .finish()
    }
}

/// Where every parameter of `layout` lies: `(arena, byte offset)`, and
/// each arena's length, for arenas of at most `arena_bytes`.
fn plan(layout: &Layout, arena_bytes: usize) -> (Vec<(usize, usize)>, Vec<usize>) {
    let mut at = Vec::with_capacity(layout.len());
    let mut arenas = vec![0usize];
    for p in layout.params() {
        let len = p.nbytes();
        let mut arena = arenas.len() - 1;
        let mut offset = arenas[arena].next_multiple_of(PARAM_ALIGN);
        if offset > 0 && offset + len > arena_bytes {
            arenas.push(0);
            arena += 1;
            offset = 0;
        }
        at.push((arena, offset));
        // Every arena's length stays a multiple of the alignment, so that
        // any dtype's view of the whole arena fits it.
        arenas[arena] = (offset + len).next_multiple_of(PARAM_ALIGN);
    }
    arenas.retain(|&len| len > 0);
    (at, arenas)
}

impl ParamSet {
    /// The parameters of `layout` in host memory, zeroed.
    pub fn cpu(layout: &Layout) -> Result<ParamSet> {
        ParamSet::make(Arc::new(layout.clone()), Place::Cpu, DEFAULT_ARENA_BYTES)
    }

    /// The parameters of `layout` on the CUDA device `ordinal` (as this
    /// process numbers it), zeroed.
    pub fn cuda(layout: &Layout, ordinal: usize) -> Result<ParamSet> {
        ParamSet::make(
            Arc::new(layout.clone()),
            Place::Cuda(ordinal),
            DEFAULT_ARENA_BYTES,
        )
    }

    /// The same, with arenas of at most `arena_bytes` (a parameter larger
    /// than that has an arena of its own). Both ends of a sync must use
    /// the same size.
    pub fn with_arena_bytes(&self, arena_bytes: usize) -> Result<ParamSet> {
        ParamSet::make(self.layout.clone(), self.place, arena_bytes.max(1))
    }

    /// A new set of the same layout, place and arena size, zeroed: a
    /// second buffer.
    pub fn empty_like(&self) -> Result<ParamSet> {
        ParamSet::make(self.layout.clone(), self.place, self.arena_bytes)
    }

    fn make(layout: Arc<Layout>, place: Place, arena_bytes: usize) -> Result<ParamSet> {
        let (at, lens) = plan(&layout, arena_bytes);
        let arenas: Vec<Tensor> = lens
            .iter()
            .map(|&len| match place {
                Place::Cpu => {
                    // Written once here so that its pages are faulted in
                    // now, not by the first versions' receives (a fresh
                    // allocation maps the zero page until it is written).
                    let t = Tensor::zeros(DType::U8, &[len]);
                    t.with_bytes_mut(|b| b.fill(0))?;
                    Ok(t)
                }
                Place::Cuda(ordinal) => Tensor::cuda_zeros(DType::U8, &[len], ordinal),
            })
            .collect::<std::result::Result<_, _>>()?;
        let views = layout
            .params()
            .iter()
            .zip(&at)
            .map(|(p, &(arena, offset))| arenas[arena].view(offset, p.dtype, &p.shape))
            .collect::<std::result::Result<Vec<_>, _>>()?;
        Ok(ParamSet {
            layout,
            place,
            arena_bytes,
            arenas: arenas.into(),
            views: views.into(),
        })
    }

    /// The layout.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    /// The arenas (`u8` tensors), which a sync moves.
    pub fn arenas(&self) -> &[Tensor] {
        &self.arenas
    }

    /// The arenas as one shared list (a `Targets` registers it as it is).
    pub(crate) fn arena_list(&self) -> &Arc<[Tensor]> {
        &self.arenas
    }

    /// Bytes of the arenas (the parameters and their padding).
    pub fn nbytes(&self) -> usize {
        self.arenas.iter().map(Tensor::nbytes).sum()
    }

    /// Are the arenas in CUDA memory?
    pub fn is_cuda(&self) -> bool {
        matches!(self.place, Place::Cuda(_))
    }

    /// The parameter called `name`: a view of its arena.
    pub fn get(&self, name: &str) -> Option<&Tensor> {
        self.layout.index_of(name).map(|i| &self.views[i])
    }

    /// Every parameter with its name, in the layout's order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.layout
            .params()
            .iter()
            .map(|p| p.name.as_str())
            .zip(self.views.iter())
    }

    /// Copies every arena of `src` (a set of the same layout and arena
    /// size) into this one: one copy per arena.
    pub fn copy_from(&self, src: &ParamSet) -> Result<()> {
        self.check_same(src)?;
        for (d, s) in self.arenas.iter().zip(src.arenas.iter()) {
            d.copy_from(s)?;
        }
        Ok(())
    }

    /// Copies named tensors (the model's own, not packed) into their
    /// parameters. Fails, before copying anything, on a name the layout
    /// does not have or a dtype or shape that differs.
    pub fn load<'a, N: AsRef<str> + 'a>(
        &self,
        tensors: impl IntoIterator<Item = (&'a N, &'a Tensor)>,
    ) -> Result<()> {
        let pairs: Vec<(&Tensor, &Tensor)> = tensors
            .into_iter()
            .map(|(n, t)| {
                let name = n.as_ref();
                let dst = self.get(name).ok_or_else(|| Error::LayoutMismatch {
                    difference: format!("{name}: not a parameter of this set"),
                })?;
                if dst.dtype() != t.dtype() || dst.shape() != t.shape() {
                    return Err(Error::LayoutMismatch {
                        difference: format!(
                            "{name}: {} {:?} here, {} {:?} given",
                            dst.dtype(),
                            dst.shape(),
                            t.dtype(),
                            t.shape()
                        ),
                    });
                }
                Ok((dst, t))
            })
            .collect::<Result<_>>()?;
        for (dst, src) in pairs {
            dst.copy_from(src)?;
        }
        Ok(())
    }

    /// A checksum of every byte of the arenas: the sum of their 16-bit
    /// words as numbers, exact for any bits (on a GPU, summed there).
    /// Equal bytes give equal checksums on any device.
    pub fn checksum(&self) -> Result<f64> {
        let mut sum = 0.0;
        for a in self.arenas.iter() {
            sum += a.view(0, DType::BF16, &[a.nbytes() / 2])?.raw_word_sum()?;
        }
        Ok(sum)
    }

    /// Waits until every copy or receive enqueued on the arenas is done
    /// (CUDA; at once on the host).
    pub async fn ready(&self) -> Result<()> {
        for a in self.arenas.iter() {
            a.cuda_ready().await?;
        }
        Ok(())
    }

    /// Do the two sets share their first arena (the same buffer)?
    pub(crate) fn same_buffer(&self, other: &ParamSet) -> bool {
        self.arenas
            .first()
            .zip(other.arenas.first())
            .is_some_and(|(a, b)| a.shares_storage(b))
    }

    fn check_same(&self, other: &ParamSet) -> Result<()> {
        if let Some(d) = self.layout.first_difference(&other.layout) {
            return Err(Error::LayoutMismatch { difference: d });
        }
        if self.arena_bytes != other.arena_bytes {
            return Err(Error::LayoutMismatch {
                difference: format!(
                    "arenas of at most {} bytes here, {} there",
                    self.arena_bytes, other.arena_bytes
                ),
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ws_2_equal_layouts_pack_into_the_same_arenas_at_the_same_offsets() {
        let given = [
            ("z", DType::BF16, vec![3]),
            ("a", DType::F32, vec![5, 7]),
            ("m", DType::U8, vec![1000]),
        ];
        let mut reversed = given.clone();
        reversed.reverse();
        let a = ParamSet::cpu(&Layout::new(given).unwrap()).unwrap();
        let b = ParamSet::cpu(&Layout::new(reversed).unwrap()).unwrap();
        let offsets = |p: &ParamSet| {
            p.iter()
                .map(|(n, t)| (n.to_string(), t.byte_offset(), t.nbytes()))
                .collect::<Vec<_>>()
        };
        assert_eq!(offsets(&a), offsets(&b));
        for (_, t) in a.iter() {
            assert_eq!(t.byte_offset() % PARAM_ALIGN, 0);
        }
        assert_eq!(a.arenas().len(), 1);
        assert_eq!(a.nbytes() % PARAM_ALIGN, 0);
    }

    #[test]
    fn ws_2_arenas_split_at_their_size_and_a_large_parameter_has_its_own() {
        let layout = Layout::new([
            ("a", DType::U8, vec![600]),
            ("b", DType::U8, vec![300]),
            ("c", DType::U8, vec![5000]),
            ("d", DType::U8, vec![10]),
        ])
        .unwrap();
        let p = ParamSet::cpu(&layout)
            .unwrap()
            .with_arena_bytes(1024)
            .unwrap();
        // a at 0 (600 bytes, padded to 768); b would end at 1068 > 1024:
        // a new arena; c (5000) past any arena size: its own; d would end
        // past c's: a new one again.
        let at: Vec<usize> = p.iter().map(|(_, t)| t.byte_offset()).collect();
        assert_eq!(at, [0, 0, 0, 0]);
        assert_eq!(p.arenas().len(), 4);
        let small =
            Layout::new([("a", DType::U8, vec![100]), ("b", DType::U8, vec![100])]).unwrap();
        let q = ParamSet::cpu(&small)
            .unwrap()
            .with_arena_bytes(1024)
            .unwrap();
        let at: Vec<usize> = q.iter().map(|(_, t)| t.byte_offset()).collect();
        assert_eq!(at, [0, 256]);
        assert_eq!(q.arenas().len(), 1);
    }

    #[test]
    fn ws_2_writes_through_a_view_land_in_the_arena_and_copy_whole() {
        let layout = Layout::new([("w", DType::F32, vec![4]), ("b", DType::F32, vec![2])]).unwrap();
        let a = ParamSet::cpu(&layout).unwrap();
        a.get("w").unwrap().fill_(2.0f32).unwrap();
        a.get("b").unwrap().fill_(3.0f32).unwrap();
        let b = a.empty_like().unwrap();
        assert_eq!(b.checksum().unwrap(), 0.0);
        b.copy_from(&a).unwrap();
        assert_eq!(b.get("w").unwrap().to_vec::<f32>().unwrap(), [2.0; 4]);
        assert_eq!(b.get("b").unwrap().to_vec::<f32>().unwrap(), [3.0; 2]);
        assert_eq!(a.checksum().unwrap(), b.checksum().unwrap());
        assert!(!a.same_buffer(&b));
        assert!(a.same_buffer(&a.clone()));
    }

    #[test]
    fn ws_2_load_refuses_an_unknown_name_before_copying_anything() {
        let layout = Layout::new([("w", DType::F32, vec![2])]).unwrap();
        let p = ParamSet::cpu(&layout).unwrap();
        let w = Tensor::full(1.0f32, &[2]);
        let x = Tensor::full(1.0f32, &[2]);
        let e = p.load([(&"w", &w), (&"x", &x)]).unwrap_err();
        assert!(e.to_string().contains("x: not a parameter"), "{e}");
        assert_eq!(p.get("w").unwrap().sum().unwrap(), 0.0);
        p.load([(&"w", &w)]).unwrap();
        assert_eq!(p.get("w").unwrap().sum().unwrap(), 2.0);
    }
}
