//! The last few things a process worked out, found again by what they were
//! worked out from: the framework's decoded heads of values and `nixl`'s
//! read plans keep a handful each, and a weight sync's every step finds
//! the first step's.

use std::collections::VecDeque;

use parking_lot::Mutex;

/// Up to `keep` entries, the last found or kept first.
pub struct Recent<T> {
    entries: Mutex<VecDeque<T>>,
    keep: usize,
}

impl<T: Clone> Recent<T> {
    /// An empty list that keeps at most `keep` entries.
    pub const fn new(keep: usize) -> Self {
        Recent {
            entries: Mutex::new(VecDeque::new()),
            keep,
        }
    }

    /// The first entry `hit` accepts (it becomes the most recent).
    pub fn find(&self, hit: impl Fn(&T) -> bool) -> Option<T> {
        let mut entries = self.entries.lock();
        let i = entries.iter().position(hit)?;
        let e = entries.remove(i).expect("found above");
        entries.push_front(e.clone());
        Some(e)
    }

    /// Keeps `e` as the most recent, forgetting the oldest beyond `keep`.
    pub fn keep(&self, e: T) {
        let mut entries = self.entries.lock();
        entries.push_front(e);
        entries.truncate(self.keep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_hit_becomes_the_most_recent_and_the_oldest_goes() {
        let r = Recent::new(2);
        r.keep(1);
        r.keep(2);
        assert_eq!(r.find(|&e| e == 1), Some(1));
        r.keep(3); // forgets 2, the oldest now
        assert_eq!(r.find(|&e| e == 2), None);
        assert_eq!(r.find(|&e| e == 1), Some(1));
        assert_eq!(r.find(|&e| e == 3), Some(3));
    }
}
