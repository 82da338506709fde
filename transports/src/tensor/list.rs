//! [`TensorList`]: a value's tensors, as a list or made on demand.
//!
//! A receive of a weights object into fresh memory lays its tensors out
//! in a few ranges (one per GPU, one host region), and each tensor is a
//! view of one of them. Making all the views when the bytes land, storing
//! them, and cloning each again when a call decodes the value cost two
//! tensor constructions per tensor per pass (about 25 and 45 ns each for
//! 10 000 tensors on one H100 host). A lazy list keeps the ranges and the
//! layout instead ([`MakeTensors`]); a call's decode makes each tensor
//! once, where it is needed ([`TensorList::tensor`]). Anything that wants
//! a slice gets one, made once and kept ([`Deref`](std::ops::Deref)).
//!
//! A receive into target tensors returns the targets themselves: a
//! shared list ([`TensorList::shared`]) holds them as the caller's
//! `Arc<[Tensor]>`, not a clone of each (10 000 parameters are 10 000
//! clones and drops), and tells the caller that they are its own
//! ([`TensorList::is_shared`]).
//!
//! A receive that waits for its bytes anyway (a NIXL READ of thousands of
//! tensors takes 100 µs and more) makes the tensors meanwhile
//! ([`TensorList::premake`]) and leaves them for the first reader of the
//! whole list ([`TensorList::to_vec`], [`TensorList::as_slice`]): the call
//! that receives the object then starts without making 10 000 views after
//! the bytes landed (20–30 ns each on the GPU hosts), and nobody clones
//! them.
//!
//! # Invariants
//! 1. Index `i` is the same tensor however it is reached: made on demand,
//!    premade, or from the kept slice, it has the same dtype, shape,
//!    storage and byte offset (a [`MakeTensors`] is a pure function of
//!    `i`).
//! 2. [`len`](TensorList::len) and [`nbytes`](TensorList::nbytes) never
//!    make tensors.
//! 3. Premade tensors go to one reader at most (the first of the whole
//!    list); every other reader makes or clones its own, as without them.

use std::sync::{Arc, OnceLock};

use super::Tensor;

/// Makes the tensors of a lazy [`TensorList`], each on demand.
pub trait MakeTensors: Send + Sync {
    /// The number of tensors.
    fn len(&self) -> usize;
    /// Whether there are none.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Tensor `i` (`i < len()`); the same tensor at every call
    /// (invariant 1).
    fn make(&self, i: usize) -> Tensor;
    /// All of them, in order: what [`make`](Self::make) gives for each
    /// index (a maker may do it in one pass over its layout).
    fn make_all(&self) -> Vec<Tensor> {
        (0..self.len()).map(|i| self.make(i)).collect()
    }
    /// The bytes of all tensors.
    fn nbytes(&self) -> usize;
}

/// A value's tensors: a list, or made on demand from a layout (see the
/// module's documentation). It reads as a `&[Tensor]`.
#[derive(Clone, Default)]
pub struct TensorList {
    /// The tensors, once made (from the start for a list).
    made: OnceLock<Vec<Tensor>>,
    /// What makes them on demand (lazy lists).
    lazy: Option<Lazy>,
    /// The tensors, shared with whoever gave them (shared lists).
    shared: Option<Arc<[Tensor]>>,
}

/// What makes a lazy list's tensors, and those it made ahead for the first
/// reader of the whole list (invariant 3), shared by clones of the list,
/// which are the same list.
#[derive(Clone)]
struct Lazy {
    maker: Arc<dyn MakeTensors>,
    premade: Arc<parking_lot::Mutex<Option<Vec<Tensor>>>>,
}

impl Lazy {
    /// All the tensors: those made ahead, the first time, else made now.
    fn whole(&self) -> Vec<Tensor> {
        self.premade
            .lock()
            .take()
            .unwrap_or_else(|| self.maker.make_all())
    }
}

impl TensorList {
    /// A lazy list: each tensor is made by `maker` when it is wanted.
    pub fn lazy(maker: Arc<dyn MakeTensors>) -> TensorList {
        TensorList {
            made: OnceLock::new(),
            lazy: Some(Lazy {
                maker,
                premade: Default::default(),
            }),
            shared: None,
        }
    }

    /// A list of `tensors`, shared (no tensor cloned).
    pub fn shared(tensors: Arc<[Tensor]>) -> TensorList {
        TensorList {
            made: OnceLock::new(),
            lazy: None,
            shared: Some(tensors),
        }
    }

    /// Whether this list is `tensors` itself (made by
    /// [`shared`](Self::shared) from that `Arc`).
    pub fn is_shared(&self, tensors: &Arc<[Tensor]>) -> bool {
        self.shared
            .as_ref()
            .is_some_and(|s| Arc::ptr_eq(s, tensors))
    }

    /// The number of tensors (none made).
    pub fn len(&self) -> usize {
        if let Some(s) = &self.shared {
            return s.len();
        }
        match (self.made.get(), &self.lazy) {
            (Some(v), _) => v.len(),
            (None, Some(l)) => l.maker.len(),
            (None, None) => 0,
        }
    }

    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes of all tensors (none made).
    pub fn nbytes(&self) -> usize {
        if let Some(s) = &self.shared {
            return s.iter().map(Tensor::nbytes).sum();
        }
        match (self.made.get(), &self.lazy) {
            (Some(v), _) => v.iter().map(Tensor::nbytes).sum(),
            (None, Some(l)) => l.maker.nbytes(),
            (None, None) => 0,
        }
    }

    /// Tensor `i`: a clone of the kept one, or made now for a lazy list
    /// that has not made its slice. `None` past the end.
    pub fn tensor(&self, i: usize) -> Option<Tensor> {
        if let Some(s) = &self.shared {
            return s.get(i).cloned();
        }
        match (self.made.get(), &self.lazy) {
            (Some(v), _) => v.get(i).cloned(),
            (None, Some(l)) => (i < l.maker.len()).then(|| l.maker.make(i)),
            (None, None) => None,
        }
    }

    /// Whether the tensors are made on demand and not all made yet.
    pub fn is_lazy(&self) -> bool {
        self.made.get().is_none() && self.lazy.is_some()
    }

    /// All tensors, made once and kept.
    pub fn as_slice(&self) -> &[Tensor] {
        if let Some(s) = &self.shared {
            return s;
        }
        self.made
            .get_or_init(|| self.lazy.as_ref().map(Lazy::whole).unwrap_or_default())
    }

    /// The tensors, as a new vector: a lazy list gives those it made ahead
    /// the first time ([`premake`](Self::premake)), else makes each (and
    /// keeps none); the others clone theirs.
    pub fn to_vec(&self) -> Vec<Tensor> {
        if let Some(s) = &self.shared {
            return s.to_vec();
        }
        match (self.made.get(), &self.lazy) {
            (Some(v), _) => v.clone(),
            (None, Some(l)) => l.whole(),
            (None, None) => Vec::new(),
        }
    }

    /// Makes a lazy list's tensors now and keeps them for the first reader
    /// of the whole list ([`to_vec`](Self::to_vec), or
    /// [`as_slice`](Self::as_slice), which keeps them); nothing for other
    /// lists, or if they were made ahead already.
    pub fn premake(&self) {
        let Some(l) = &self.lazy else { return };
        if self.made.get().is_some() {
            return;
        }
        let mut premade = l.premade.lock();
        if premade.is_none() {
            *premade = Some(l.maker.make_all());
        }
    }

    /// The tensors, as a vector.
    pub fn into_vec(mut self) -> Vec<Tensor> {
        if let Some(s) = &self.shared {
            return s.to_vec();
        }
        self.as_slice();
        self.made.take().unwrap_or_default()
    }
}

impl From<Vec<Tensor>> for TensorList {
    fn from(v: Vec<Tensor>) -> TensorList {
        TensorList {
            made: OnceLock::from(v),
            lazy: None,
            shared: None,
        }
    }
}

impl std::ops::Deref for TensorList {
    type Target = [Tensor];
    fn deref(&self) -> &[Tensor] {
        self.as_slice()
    }
}

impl std::fmt::Debug for TensorList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TensorList")
            .field("len", &self.len())
            .field("lazy", &self.is_lazy())
            .finish()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::DType;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Views of one flat tensor of `f32`s, counting what it made.
    pub(crate) struct Views {
        flat: Tensor,
        n: usize,
        made: AtomicUsize,
    }

    impl Views {
        /// `flat` split evenly into `n` views.
        pub(crate) fn of(flat: Tensor, n: usize) -> Views {
            Views {
                flat,
                n,
                made: AtomicUsize::new(0),
            }
        }
    }

    impl MakeTensors for Views {
        fn len(&self) -> usize {
            self.n
        }
        fn make(&self, i: usize) -> Tensor {
            self.made.fetch_add(1, Ordering::Relaxed);
            let each = self.flat.nbytes() / self.n;
            self.flat.view(i * each, DType::F32, &[each / 4]).unwrap()
        }
        fn nbytes(&self) -> usize {
            self.flat.nbytes()
        }
    }

    #[test]
    fn a_shared_list_is_the_given_tensors_and_knows_it() {
        let ts: Arc<[Tensor]> = (0..3)
            .map(|i| Tensor::from_slice(&[i as f32], &[1]).unwrap())
            .collect::<Vec<_>>()
            .into();
        let list = TensorList::shared(ts.clone());
        assert!(list.is_shared(&ts));
        assert!(!list.is_lazy());
        assert_eq!((list.len(), list.nbytes()), (3, 12));
        // The slice is the shared one: no tensor was cloned.
        assert!(std::ptr::eq(list.as_slice(), &ts[..]));
        assert!(list.tensor(2).unwrap().shares_storage(&ts[2]));
        // Another list of equal tensors is not that list.
        let other: Arc<[Tensor]> = ts.to_vec().into();
        assert!(!list.is_shared(&other));
        assert!(!TensorList::from(ts.to_vec()).is_shared(&ts));
        assert_eq!(list.into_vec().len(), 3);
    }

    #[test]
    fn a_lazy_list_makes_only_what_is_asked_and_the_same_tensors_as_its_slice() {
        let flat =
            Tensor::from_slice(&(0..100).map(|i| i as f32).collect::<Vec<_>>(), &[100]).unwrap();
        let views = Arc::new(Views {
            flat: flat.clone(),
            n: 100,
            made: AtomicUsize::new(0),
        });
        let list = TensorList::lazy(views.clone());
        // Length and bytes make nothing (invariant 2).
        assert_eq!((list.len(), list.nbytes()), (100, 400));
        assert!(list.is_lazy());
        assert_eq!(views.made.load(Ordering::Relaxed), 0);
        // One tensor asked, one made, and the right one.
        let t = list.tensor(7).unwrap();
        assert_eq!(views.made.load(Ordering::Relaxed), 1);
        assert_eq!(t.to_vec::<f32>().unwrap(), [7.0]);
        assert!(t.shares_storage(&flat));
        assert!(list.tensor(100).is_none());
        // The slice is made once, and index 7 is the same tensor there
        // (invariant 1).
        let s = list.as_slice();
        assert_eq!(s.len(), 100);
        assert_eq!(views.made.load(Ordering::Relaxed), 101);
        assert_eq!(
            (s[7].byte_offset(), s[7].shape()),
            (t.byte_offset(), t.shape())
        );
        assert!(!list.is_lazy());
        let again = list.tensor(7).unwrap();
        assert_eq!(
            views.made.load(Ordering::Relaxed),
            101,
            "kept, not made again"
        );
        assert_eq!(again.byte_offset(), t.byte_offset());
        assert_eq!(list.into_vec().len(), 100);
    }

    #[test]
    fn premade_tensors_go_to_the_first_reader_only_and_are_the_made_ones() {
        let flat =
            Tensor::from_slice(&(0..100).map(|i| i as f32).collect::<Vec<_>>(), &[100]).unwrap();
        let views = Arc::new(Views::of(flat.clone(), 100));
        let list = TensorList::lazy(views.clone());
        list.premake();
        list.premake();
        assert_eq!(views.made.load(Ordering::Relaxed), 100, "made ahead once");
        // Still lazy for everyone else (invariant 3).
        assert!(list.is_lazy());
        let first = list.clone().to_vec();
        assert_eq!(views.made.load(Ordering::Relaxed), 100, "taken, not made");
        let second = list.to_vec();
        assert_eq!(
            views.made.load(Ordering::Relaxed),
            200,
            "made for the second"
        );
        // A slice kept from the start takes them too.
        let kept = TensorList::lazy(views.clone());
        kept.premake();
        assert_eq!(kept.as_slice().len(), 100);
        assert_eq!(views.made.load(Ordering::Relaxed), 300, "made once, ahead");
        // The same tensors either way (invariant 1).
        assert_eq!(first.len(), 100);
        for (a, b) in first.iter().zip(&second) {
            assert!(a.shares_storage(&flat) && b.shares_storage(&flat));
            assert_eq!((a.byte_offset(), a.shape()), (b.byte_offset(), b.shape()));
        }
        assert_eq!(first[42].to_vec::<f32>().unwrap(), [42.0]);
        // Lists that are not lazy make nothing ahead.
        let plain = TensorList::from(second);
        plain.premake();
        assert_eq!(plain.to_vec().len(), 100);
        assert_eq!(views.made.load(Ordering::Relaxed), 300);
        assert!(kept.to_vec()[99].shares_storage(&flat));
    }

    #[test]
    fn a_plain_list_is_its_vector() {
        let v = vec![
            Tensor::zeros(DType::U8, &[3]),
            Tensor::zeros(DType::U8, &[5]),
        ];
        let list = TensorList::from(v.clone());
        assert!(!list.is_lazy());
        assert_eq!((list.len(), list.nbytes()), (2, 8));
        assert!(list.tensor(1).unwrap().shares_storage(&v[1]));
        assert!(list.tensor(2).is_none());
        assert_eq!(TensorList::default().len(), 0);
        assert!(TensorList::default().tensor(0).is_none());
    }
}
