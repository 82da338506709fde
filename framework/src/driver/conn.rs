//! The driver's connections to its actors: the owner table's outbox is
//! moved onto them, in order, before the lock is released, and written
//! after (invariant 2; OW-7).

use super::*;
use crate::owner::Outbox;

/// Moves the outbox onto the actors' connections, oldest first. Called
/// under the lock, which defers the socket writes (`protocol::defer_writes`)
/// to its release: the order of frames on each connection is the order
/// the table decided them. A message for an actor with no connection (dead,
/// or not joined yet) is dropped: its death is handled by its reader.
pub(super) fn write_outbox(outbox: &mut Outbox, conns: &HashMap<u64, protocol::Sender>) {
    for out in outbox.take() {
        let Some(conn) = conns.get(&out.to) else {
            continue;
        };
        let sent = if out.soon {
            conn.send_soon_encoded(out.frame)
        } else {
            conn.send_encoded(out.frame)
        };
        if let Err(e) = sent {
            tracing::error!("could not send a control message to actor {}: {e}", out.to);
        }
    }
}
