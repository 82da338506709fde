//! The driver's transfer deadlines (XF-6), kept in one heap and watched by
//! one task (`driver::transfers::deadline_keeper`).
//!
//! Why not a timer task per transfer: a weights sync starts thousands of
//! transfers per pass, and every one of them spawned a task, registered a
//! timer and aborted both when its acknowledgement came, all on the
//! driver's reader, on the path of the next message. Here arming a
//! deadline is a heap push under the state lock the driver already holds,
//! and a transfer that ends costs nothing: its entry is skipped when it
//! comes due (the owner table no longer has the transfer) or pruned when
//! ended entries pile up.
//!
//! Invariants:
//! - **DL-1 (the keeper never sleeps past a deadline).** The keeper sleeps
//!   until the earliest deadline it saw ([`Deadlines::next`]); arming one
//!   earlier than that, or any while the keeper waits with none, says so
//!   ([`Deadlines::arm`] returns true) and the caller wakes it.
//! - **DL-2 (an entry is only a reminder).** A due entry expires its
//!   transfer only if the owner table still has that transfer: ended
//!   transfers need no cancellation, and transfer ids are never reused.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use tokio::time::Instant;

/// Entries kept before ended ones are pruned, whatever the live count.
const PRUNE_ABOVE: usize = 1024;

/// Transfer deadlines, earliest first.
#[derive(Default)]
pub(crate) struct Deadlines {
    heap: BinaryHeap<Reverse<(Instant, u64)>>,
    /// What the keeper sleeps until: `None` while it waits for any
    /// deadline.
    keeper_until: Option<Instant>,
}

impl Deadlines {
    /// Arms transfer `xfer`'s deadline at `at`. True if the keeper must be
    /// woken to see it (DL-1).
    pub(crate) fn arm(&mut self, xfer: u64, at: Instant) -> bool {
        self.heap.push(Reverse((at, xfer)));
        let wake = self.keeper_until.is_none_or(|until| at < until);
        if wake {
            // Woken once for the earliest: later arms of this batch are not
            // earlier.
            self.keeper_until = Some(at);
        }
        wake
    }

    /// The earliest deadline, which the keeper now sleeps until.
    pub(crate) fn next(&mut self) -> Option<Instant> {
        self.keeper_until = self.heap.peek().map(|Reverse((at, _))| *at);
        self.keeper_until
    }

    /// Takes the entries due at `now` (DL-2: the caller skips ended
    /// transfers).
    pub(crate) fn due(&mut self, now: Instant) -> Vec<u64> {
        let mut due = Vec::new();
        while let Some(Reverse((at, xfer))) = self.heap.peek() {
            if *at > now {
                break;
            }
            due.push(*xfer);
            self.heap.pop();
        }
        due
    }

    /// Drops the entries of ended transfers once they outnumber the live
    /// ones (`live` transfers in flight, `is_live` says which).
    pub(crate) fn prune(&mut self, live: usize, is_live: impl Fn(u64) -> bool) {
        if self.heap.len() <= PRUNE_ABOVE.max(2 * live) {
            return;
        }
        self.heap.retain(|Reverse((_, xfer))| is_live(*xfer));
    }

    /// Entries held (live and ended).
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.heap.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn wakes_the_keeper_only_for_an_earlier_deadline() {
        let mut d = Deadlines::default();
        let t0 = Instant::now();
        assert!(
            d.arm(1, t0 + Duration::from_secs(5)),
            "keeper waits for any"
        );
        assert!(!d.arm(2, t0 + Duration::from_secs(6)), "later: no wake");
        assert_eq!(d.next(), Some(t0 + Duration::from_secs(5)));
        assert!(d.arm(3, t0 + Duration::from_secs(1)), "earlier: wake");
        assert_eq!(d.next(), Some(t0 + Duration::from_secs(1)));
    }

    #[test]
    fn due_entries_come_out_in_deadline_order() {
        let mut d = Deadlines::default();
        let t0 = Instant::now();
        for (x, s) in [(1, 3), (2, 1), (3, 2), (4, 9)] {
            d.arm(x, t0 + Duration::from_secs(s));
        }
        assert_eq!(d.due(t0), Vec::<u64>::new());
        assert_eq!(d.due(t0 + Duration::from_secs(3)), vec![2, 3, 1]);
        assert_eq!(d.next(), Some(t0 + Duration::from_secs(9)));
        assert_eq!(d.due(t0 + Duration::from_secs(9)), vec![4]);
        assert_eq!(d.next(), None);
    }

    #[test]
    fn ended_entries_are_pruned_when_they_pile_up() {
        let mut d = Deadlines::default();
        let at = Instant::now() + Duration::from_secs(60);
        for x in 0..PRUNE_ABOVE as u64 {
            d.arm(x, at);
        }
        d.prune(1, |x| x == 7);
        assert_eq!(d.len(), PRUNE_ABOVE, "not over the bound yet");
        d.arm(PRUNE_ABOVE as u64, at);
        d.prune(2, |x| x == 7 || x == PRUNE_ABOVE as u64);
        assert_eq!(d.len(), 2);
        assert_eq!(d.due(at), vec![7, PRUNE_ABOVE as u64]);
    }
}
