//! Freeing: copies released and objects freed once nothing needs them
//! (OW-1, OW-2, OW-12).

use super::*;

impl OwnerTable {
    /// `consumer` no longer needs `args` (its call or get ended): each
    /// copy it no longer needs goes (OW-2), each object nothing needs is
    /// freed (OW-1).
    pub fn unneed(&mut self, args: &[u64], consumer: ActorId) {
        for &a in args {
            if let Some(e) = self.objects.get_mut(&a) {
                if let Some(n) = e.needs.get_mut(&consumer) {
                    *n -= 1;
                    if *n == 0 {
                        e.needs.remove(&consumer);
                        release_copy(e, a, consumer, &mut self.outbox);
                    }
                }
            }
            self.maybe_free(a);
        }
    }

    /// A receive ended (acknowledged or aborted): the copy is held (value
    /// or error in the consumer's store) and follows OW-1/OW-2 from here.
    pub(super) fn settle(&mut self, t: &InFlight) {
        if let Some(e) = self.objects.get_mut(&t.object) {
            if let Some(c) = e.copies.get_mut(&t.consumer) {
                *c = Copy::Held;
            }
            if !e.needs.contains_key(&t.consumer) {
                release_copy(e, t.object, t.consumer, &mut self.outbox);
            }
        }
        self.maybe_free(t.object);
    }

    pub(super) fn maybe_free(&mut self, id: u64) {
        // CL-2: freeing an object gives back the counts its value held,
        // which may free more; a worklist, not recursion (a long chain of
        // nested values must not overflow the stack).
        let mut check = vec![id];
        while let Some(id) = check.pop() {
            let free = match self.objects.get(&id) {
                Some(e) => {
                    e.refs == 0
                        && e.needs.is_empty()
                        && !e.receiving()
                        && !matches!(e.state, ObjState::Pending)
                }
                None => false,
            };
            if !free {
                continue;
            }
            let mut e = self.objects.remove(&id).expect("checked above");
            self.freed_held.extend(e.held.take());
            let direct =
                e.sidedness() != Sidedness::ThroughDriver && matches!(e.state, ObjState::Ready(_));
            if direct {
                if let Some(p) = e.producer {
                    self.outbox.send_free(p, id);
                }
            }
            for (h, _) in e.copies {
                if Some(h) != e.producer || !direct {
                    self.outbox.send_free(h, id);
                }
            }
            for n in e.nested {
                if let Some(inner) = self.objects.get_mut(&n) {
                    inner.refs = inner.refs.saturating_sub(1);
                    check.push(n);
                }
            }
        }
    }
}

/// OW-2: `consumer` no longer needs its copy of `id`; once its receive is
/// acknowledged, it drops it.
pub(super) fn release_copy(e: &mut Entry, id: u64, consumer: ActorId, out: &mut Outbox) {
    if e.copies.get(&consumer) == Some(&Copy::Held) && e.producer != Some(consumer) {
        e.copies.remove(&consumer);
        out.send_free(consumer, id);
    }
}
