//! The free ranges of one slab of memory (rdt's CUDA slabs, `nixl`'s host
//! slabs): first fit, neighbours merged when given back.

use std::collections::BTreeMap;

use parking_lot::Mutex;

/// Free ranges of a slab of `len` bytes: offset -> length.
pub(crate) struct FreeList {
    len: usize,
    free: Mutex<BTreeMap<usize, usize>>,
}

impl FreeList {
    /// A slab of `len` bytes, all free.
    pub fn new(len: usize) -> FreeList {
        FreeList {
            len,
            free: Mutex::new(BTreeMap::from([(0, len)])),
        }
    }

    /// The offset of `len` free bytes, now taken; `None` if no free range
    /// is that large.
    pub fn take(&self, len: usize) -> Option<usize> {
        let mut free = self.free.lock();
        let (&off, &flen) = free.iter().find(|(_, &l)| l >= len)?;
        free.remove(&off);
        if flen > len {
            free.insert(off + len, flen - len);
        }
        Some(off)
    }

    /// Gives back `len` bytes at `off`, merged with free neighbours.
    pub fn give(&self, off: usize, len: usize) {
        let mut free = self.free.lock();
        let (mut off, mut len) = (off, len);
        if let Some((&p, &pl)) = free.range(..off).next_back() {
            if p + pl == off {
                free.remove(&p);
                off = p;
                len += pl;
            }
        }
        if let Some(&nl) = free.get(&(off + len)) {
            free.remove(&(off + len));
            len += nl;
        }
        free.insert(off, len);
    }

    /// Is every byte free?
    pub fn all_free(&self) -> bool {
        let free = self.free.lock();
        free.len() == 1 && free.get(&0) == Some(&self.len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_taken_first_fit_and_merged_when_given_back() {
        let f = FreeList::new(100);
        assert_eq!(f.take(30), Some(0));
        assert_eq!(f.take(30), Some(30));
        assert_eq!(f.take(50), None);
        f.give(0, 30);
        assert_eq!(f.take(20), Some(0));
        f.give(30, 30);
        f.give(0, 20);
        assert!(f.all_free());
        assert_eq!(f.take(100), Some(0));
    }
}
