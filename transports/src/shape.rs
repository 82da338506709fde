//! [`Shape`]: a tensor's dimensions, inline up to four.
//!
//! Every tensor and every [`TensorMeta`](crate::TensorMeta) has one, and a
//! weights object has thousands of tensors: a heap-allocated shape made
//! each of them an allocation to make and free at every step (export, each
//! hop through the driver, receive, drop). Shapes of up to four dimensions
//! (all of an LLM's parameters; convolution kernels) live inline, and a
//! copy of one is a copy of 40 bytes; longer ones are shared on the heap.

use std::sync::Arc;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Dimensions kept inline.
const INLINE: usize = 4;

/// The dimensions of a row-major tensor. It reads as a `&[usize]`
/// (`Deref`), and travels exactly as a `Vec<usize>` does.
#[derive(Clone)]
pub struct Shape(Repr);

#[derive(Clone)]
enum Repr {
    // `len` is a `u32`, not a `u8`, though it is at most 4: with a `u8`,
    // copying a shape moved the tag, the length and their padding as two
    // overlapping 4-byte halves through the stack, which the CPU cannot
    // forward from the stores to the loads, twice per copy. Making 10 000
    // views (a receive of a weights object) took 102 µs that way, 61 µs
    // with this layout (dev VM). The size is the same 40 bytes.
    Inline { len: u32, dims: [usize; INLINE] },
    Heap(Arc<[usize]>),
}

impl Shape {
    /// The dimensions.
    #[inline]
    pub fn as_slice(&self) -> &[usize] {
        match &self.0 {
            Repr::Inline { len, dims } => &dims[..*len as usize],
            Repr::Heap(dims) => dims,
        }
    }
}

impl Default for Shape {
    fn default() -> Self {
        Shape::from(&[][..])
    }
}

impl std::ops::Deref for Shape {
    type Target = [usize];
    #[inline]
    fn deref(&self) -> &[usize] {
        self.as_slice()
    }
}

impl std::fmt::Debug for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_slice(), f)
    }
}

impl PartialEq for Shape {
    fn eq(&self, other: &Shape) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for Shape {}

impl std::hash::Hash for Shape {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.as_slice().hash(state)
    }
}

impl Shape {
    /// At most [`INLINE`] dimensions, given in place: the first `len` of
    /// `dims` (a decoder that fills them one by one copies nothing).
    pub(crate) fn inline(len: usize, dims: [usize; INLINE]) -> Self {
        debug_assert!(len <= INLINE);
        Shape(Repr::Inline {
            len: len as u32,
            dims,
        })
    }
}

/// Shapes with at most this many dimensions are stored in place.
pub(crate) const INLINE_DIMS: usize = INLINE;

impl From<&[usize]> for Shape {
    #[inline]
    fn from(src: &[usize]) -> Self {
        if src.len() <= INLINE {
            let mut dims = [0; INLINE];
            dims[..src.len()].copy_from_slice(src);
            Shape(Repr::Inline {
                len: src.len() as u32,
                dims,
            })
        } else {
            Shape(Repr::Heap(src.into()))
        }
    }
}

impl<const N: usize> From<[usize; N]> for Shape {
    fn from(dims: [usize; N]) -> Self {
        Shape::from(&dims[..])
    }
}

impl<const N: usize> From<&[usize; N]> for Shape {
    fn from(dims: &[usize; N]) -> Self {
        Shape::from(&dims[..])
    }
}

impl From<Vec<usize>> for Shape {
    fn from(dims: Vec<usize>) -> Self {
        Shape::from(dims.as_slice())
    }
}

impl FromIterator<usize> for Shape {
    fn from_iter<I: IntoIterator<Item = usize>>(iter: I) -> Self {
        Shape::from(iter.into_iter().collect::<Vec<_>>())
    }
}

impl PartialEq<[usize]> for Shape {
    fn eq(&self, other: &[usize]) -> bool {
        self.as_slice() == other
    }
}

impl PartialEq<&[usize]> for Shape {
    fn eq(&self, other: &&[usize]) -> bool {
        self.as_slice() == *other
    }
}

impl PartialEq<Vec<usize>> for Shape {
    fn eq(&self, other: &Vec<usize>) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl<const N: usize> PartialEq<[usize; N]> for Shape {
    fn eq(&self, other: &[usize; N]) -> bool {
        self.as_slice() == other
    }
}

impl Serialize for Shape {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.as_slice().serialize(s)
    }
}

impl<'de> Deserialize<'de> for Shape {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Shape;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a sequence of dimensions")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Shape, A::Error> {
                let mut dims = [0; INLINE];
                for (len, slot) in dims.iter_mut().enumerate() {
                    match seq.next_element()? {
                        Some(d) => *slot = d,
                        None => {
                            return Ok(Shape(Repr::Inline {
                                len: len as u32,
                                dims,
                            }))
                        }
                    }
                }
                let Some(fifth) = seq.next_element()? else {
                    return Ok(Shape(Repr::Inline {
                        len: INLINE as u32,
                        dims,
                    }));
                };
                // The length hint comes from the wire: nothing is reserved
                // for it, the dimensions that do come are collected.
                let mut all = dims.to_vec();
                all.push(fifth);
                while let Some(d) = seq.next_element()? {
                    all.push(d);
                }
                Ok(Shape(Repr::Heap(all.into())))
            }
        }
        d.deserialize_seq(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shape_travels_as_a_vec_does() {
        for dims in [
            vec![],
            vec![3],
            vec![2, 3, 4, 5],
            vec![1, 2, 3, 4, 5],
            vec![1, 2, 3, 4, 5, 6, 7],
        ] {
            let s = Shape::from(dims.clone());
            assert_eq!(s, dims);
            assert_eq!(s.len(), dims.len());
            let wire = postcard::to_stdvec(&s).unwrap();
            assert_eq!(wire, postcard::to_stdvec(&dims).unwrap());
            let back = postcard::from_bytes::<Shape>(&wire).unwrap();
            assert_eq!(back, s);
            assert_eq!(back.as_slice(), dims.as_slice());
        }
    }

    #[test]
    fn a_huge_length_on_the_wire_reserves_nothing_before_failing() {
        // A length of u32::MAX and no elements after it.
        let wire = postcard::to_stdvec(&u32::MAX).unwrap();
        assert!(postcard::from_bytes::<Shape>(&wire).is_err());
    }
}
