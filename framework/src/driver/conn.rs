//! Writing to an actor's control connection.

use super::*;

pub(super) fn send_to(actors: &Actors, to: u64, msg: &ToWorker) {
    if let Some(c) = actors.get(&to).and_then(|a| a.conn.as_ref()) {
        if let Err(e) = c.send(msg) {
            tracing::error!("could not encode a message for actor {to}: {e}");
        }
    }
}
