//! The driver's connections to its actors: the owner table's outbox is
//! moved onto them, in order, before the lock is released, and written
//! after (invariant 2; OW-7).

use super::*;
use crate::owner::Outbox;

/// Moves the outbox onto the actors' connections, oldest first, into
/// `deferred`: called under the lock, it queues the frames and writes
/// none; the guard's release flushes them (`StateGuard`'s drop). The
/// order of frames on each connection is the order the table decided
/// them. A message for an actor with no connection (dead, or not joined
/// yet) is dropped: its death is handled by its reader.
pub(super) fn write_outbox(
    outbox: &mut Outbox,
    conns: &HashMap<u64, protocol::Sender>,
    deferred: &mut protocol::Deferred,
) {
    for out in outbox.take() {
        let Some(conn) = conns.get(&out.to) else {
            continue;
        };
        let sent = if out.soon {
            deferred.send_soon(conn, out.frame)
        } else {
            deferred.send(conn, out.frame)
        };
        if let Err(e) = sent {
            tracing::error!("could not send a control message to actor {}: {e}", out.to);
        }
    }
}
