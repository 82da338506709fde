//! A parameter set's layout: names, dtypes and shapes in one canonical
//! order, its digest, and the first difference between two (WS-1).

use std::fmt;

use rdt_transport::{DType, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::{Error, Result};

/// One parameter of a [`Layout`]: its name, dtype and shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamSpec {
    /// The parameter's name (`model.layers.0.mlp.up_proj.weight`).
    pub name: String,
    /// Its element type.
    pub dtype: DType,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl ParamSpec {
    /// Bytes of the parameter.
    pub fn nbytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

impl fmt::Display for ParamSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {} {:?}", self.name, self.dtype, self.shape)
    }
}

/// The names, dtypes and shapes of a parameter set, sorted by name: what
/// a publisher and a subscriber must agree on before any byte moves.
///
/// The order is canonical (sorted by name, whatever order the parameters
/// were given in), so two processes that hold the same parameters in
/// different containers build equal layouts with equal
/// [`digest`](Self::digest)s.
///
/// ```
/// use rdt::weights::Layout;
/// use rdt::DType;
/// let a = Layout::new([("b", DType::F32, vec![4]), ("a", DType::BF16, vec![2, 2])]).unwrap();
/// let b = Layout::new([("a", DType::BF16, vec![2, 2]), ("b", DType::F32, vec![4])]).unwrap();
/// assert_eq!(a.digest(), b.digest());
/// let c = Layout::new([("a", DType::BF16, vec![2, 2]), ("b", DType::F32, vec![5])]).unwrap();
/// assert_eq!(a.first_difference(&c).unwrap(), "b: f32 [4] here, f32 [5] there");
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Layout {
    params: Vec<ParamSpec>,
}

/// A [`Layout`]'s SHA-256 over its canonical encoding: equal for equal
/// layouts, and what every published version carries.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct LayoutDigest(pub [u8; 32]);

impl fmt::Debug for LayoutDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LayoutDigest({self})")
    }
}

impl fmt::Display for LayoutDigest {
    /// The first 8 bytes in hex, as `git` abbreviates.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex::encode(&self.0[..8]))
    }
}

impl Layout {
    /// The layout of these parameters, sorted by name. Fails on a name
    /// given twice.
    pub fn new<N: Into<String>>(
        params: impl IntoIterator<Item = (N, DType, Vec<usize>)>,
    ) -> Result<Layout> {
        let mut params: Vec<ParamSpec> = params
            .into_iter()
            .map(|(name, dtype, shape)| ParamSpec {
                name: name.into(),
                dtype,
                shape,
            })
            .collect();
        params.sort_by(|a, b| a.name.cmp(&b.name));
        if let Some(w) = params.windows(2).find(|w| w[0].name == w[1].name) {
            return Err(Error::LayoutMismatch {
                difference: format!("the parameter {} is named twice", w[0].name),
            });
        }
        Ok(Layout { params })
    }

    /// The layout of named tensors: a `HashMap` or `BTreeMap` of them
    /// (`Layout::of(&map)`), or any pairs of a name and a tensor.
    pub fn of<'a, N: AsRef<str> + 'a>(
        tensors: impl IntoIterator<Item = (&'a N, &'a Tensor)>,
    ) -> Result<Layout> {
        Layout::new(
            tensors
                .into_iter()
                .map(|(n, t)| (n.as_ref().to_string(), t.dtype(), t.shape().to_vec())),
        )
    }

    /// The parameters, sorted by name.
    pub fn params(&self) -> &[ParamSpec] {
        &self.params
    }

    /// The number of parameters.
    pub fn len(&self) -> usize {
        self.params.len()
    }

    /// No parameters at all?
    pub fn is_empty(&self) -> bool {
        self.params.is_empty()
    }

    /// Bytes of every parameter (without an arena's padding).
    pub fn nbytes(&self) -> usize {
        self.params.iter().map(ParamSpec::nbytes).sum()
    }

    /// The parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&ParamSpec> {
        self.index_of(name).map(|i| &self.params[i])
    }

    /// Where `name` is in the canonical order.
    pub(crate) fn index_of(&self, name: &str) -> Option<usize> {
        self.params
            .binary_search_by(|p| p.name.as_str().cmp(name))
            .ok()
    }

    /// The digest: SHA-256 over every parameter's name, dtype and shape,
    /// in the canonical order, each field length-prefixed (so no two
    /// layouts share an encoding).
    pub fn digest(&self) -> LayoutDigest {
        let mut h = Sha256::new();
        h.update((self.params.len() as u64).to_le_bytes());
        for p in &self.params {
            h.update((p.name.len() as u64).to_le_bytes());
            h.update(p.name.as_bytes());
            h.update(p.dtype.name().as_bytes());
            h.update([0]);
            h.update((p.shape.len() as u64).to_le_bytes());
            for d in &p.shape {
                h.update((*d as u64).to_le_bytes());
            }
        }
        LayoutDigest(h.finalize().into())
    }

    /// The first difference between this layout (`here`) and `other`
    /// (`there`) in the canonical order, in words; `None` if they are
    /// equal.
    pub fn first_difference(&self, other: &Layout) -> Option<String> {
        let (mut a, mut b) = (
            self.params.iter().peekable(),
            other.params.iter().peekable(),
        );
        loop {
            match (a.peek(), b.peek()) {
                (None, None) => return None,
                (Some(x), None) => return Some(format!("{}: only here", x.name)),
                (None, Some(y)) => return Some(format!("{}: only there", y.name)),
                (Some(x), Some(y)) => match x.name.cmp(&y.name) {
                    std::cmp::Ordering::Less => return Some(format!("{}: only here", x.name)),
                    std::cmp::Ordering::Greater => return Some(format!("{}: only there", y.name)),
                    std::cmp::Ordering::Equal => {
                        if x.dtype != y.dtype || x.shape != y.shape {
                            return Some(format!(
                                "{}: {} {:?} here, {} {:?} there",
                                x.name, x.dtype, x.shape, y.dtype, y.shape
                            ));
                        }
                        a.next();
                        b.next();
                    }
                },
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(ps: &[(&str, DType, &[usize])]) -> Layout {
        Layout::new(ps.iter().map(|(n, d, s)| (*n, *d, s.to_vec()))).unwrap()
    }

    #[test]
    fn ws_1_the_order_given_does_not_change_the_layout_or_its_digest() {
        let a = layout(&[("x", DType::F32, &[2]), ("a", DType::BF16, &[3, 4])]);
        let b = layout(&[("a", DType::BF16, &[3, 4]), ("x", DType::F32, &[2])]);
        assert_eq!(a, b);
        assert_eq!(a.digest(), b.digest());
        assert_eq!(a.params()[0].name, "a");
    }

    #[test]
    fn ws_1_any_change_of_name_dtype_or_shape_changes_the_digest() {
        let base = layout(&[("a", DType::BF16, &[3, 4])]);
        for other in [
            layout(&[("b", DType::BF16, &[3, 4])]),
            layout(&[("a", DType::F16, &[3, 4])]),
            layout(&[("a", DType::BF16, &[4, 3])]),
            layout(&[("a", DType::BF16, &[12])]),
            layout(&[("a", DType::BF16, &[3, 4]), ("b", DType::U8, &[])]),
        ] {
            assert_ne!(base.digest(), other.digest(), "{other:?}");
            assert!(base.first_difference(&other).is_some());
        }
    }

    #[test]
    fn ws_1_the_first_difference_is_named_in_sorted_order() {
        let here = layout(&[
            ("a", DType::F32, &[1]),
            ("c", DType::F32, &[1]),
            ("d", DType::F32, &[2]),
        ]);
        let there = layout(&[
            ("a", DType::F32, &[1]),
            ("b", DType::F32, &[1]),
            ("d", DType::F32, &[3]),
        ]);
        assert_eq!(here.first_difference(&there).unwrap(), "b: only there");
        assert_eq!(there.first_difference(&here).unwrap(), "b: only here");
        let shorter = layout(&[("a", DType::F32, &[1])]);
        assert_eq!(here.first_difference(&shorter).unwrap(), "c: only here");
        assert_eq!(here.first_difference(&here.clone()), None);
    }

    #[test]
    fn ws_1_a_name_given_twice_is_refused() {
        let e = Layout::new([("a", DType::F32, vec![1]), ("a", DType::F32, vec![1])]).unwrap_err();
        assert!(e.to_string().contains("named twice"), "{e}");
    }
}
