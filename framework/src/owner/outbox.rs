//! The table's messages out: an ordered list of encoded frames, each for
//! one actor. The table only pushes here (it writes no socket); the
//! driver moves the list onto its connections before it releases its
//! lock and writes them after (`driver::conn`, driver invariant 2), so
//! the frames on each connection keep the order of the decisions (OW-7).

use rdt_transport::wire;

use crate::error::Error;
use crate::protocol::boot::DEFAULT_MAX_FRAME;
use crate::protocol::ToWorker;

/// One message out.
pub(crate) struct Outgoing {
    /// The actor it is for.
    pub to: u64,
    /// The message, encoded with its length in front.
    pub frame: wire::Frame,
    /// Nothing waits for it (a `Free`): it may wait for the next frame on
    /// its connection (`protocol::Deferred::send_soon`).
    pub soon: bool,
}

/// The messages the table decided to send, in order.
pub(crate) struct Outbox {
    items: Vec<Outgoing>,
    /// The control frame limit: a message over it is refused when pushed
    /// (OW-6), so the table turns it into an error while it decides.
    max_frame: usize,
}

impl Default for Outbox {
    fn default() -> Self {
        Outbox {
            items: Vec::new(),
            max_frame: DEFAULT_MAX_FRAME,
        }
    }
}

impl Outbox {
    /// Sets the control frame limit (`RuntimeBuilder::max_frame_bytes`).
    pub fn set_max_frame(&mut self, max_frame: usize) {
        self.max_frame = max_frame;
    }

    /// Queues `msg` for `to`. A message that cannot be encoded or is too
    /// large for a frame is refused (OW-6); a dead or unconnected actor's
    /// is dropped by the driver when it writes.
    pub fn send(&mut self, to: u64, msg: &ToWorker) -> Result<(), Error> {
        let frame = encode(msg)?;
        let len = frame.len() - 8;
        if len > self.max_frame {
            return Err(Error::Protocol(format!(
                "a {len}-byte message exceeds the control frame limit of {} bytes; raise RuntimeBuilder::max_frame_bytes or move the tensors with a direct transport",
                self.max_frame
            )));
        }
        self.items.push(Outgoing {
            to,
            frame,
            soon: false,
        });
        Ok(())
    }

    /// Queues a message that cannot be too large (frees, aborts, errors);
    /// a failure can only be an encoding bug, so it is logged loudly.
    pub fn send_small(&mut self, to: u64, msg: &ToWorker) {
        if let Err(e) = self.send(to, msg) {
            tracing::error!("could not send a control message to actor {to}: {e}");
        }
    }

    /// Queues a `Free` of `object` for `to`, which nothing waits for: it
    /// goes with the next frame on the connection (`protocol::Deferred::send_soon`).
    pub fn send_free(&mut self, to: u64, object: u64) {
        match encode(&ToWorker::Free { object }) {
            Ok(frame) => self.items.push(Outgoing {
                to,
                frame,
                soon: true,
            }),
            Err(e) => tracing::error!("could not send a control message to actor {to}: {e}"),
        }
    }

    /// Queues `err` as the value of `object` for `to`.
    pub fn deliver_error(&mut self, to: u64, object: u64, err: Error) {
        self.send_small(
            to,
            &ToWorker::Deliver {
                object,
                value: Err(err),
            },
        );
    }

    /// Takes the messages queued so far, oldest first.
    pub fn take(&mut self) -> Vec<Outgoing> {
        std::mem::take(&mut self.items)
    }

    /// Whether a message for an actor other than `to` waits here.
    pub fn waits_besides(&self, to: u64) -> bool {
        self.items.iter().any(|o| o.to != to)
    }
}

fn encode(msg: &ToWorker) -> Result<wire::Frame, Error> {
    wire::to_frame_with_length(msg).map_err(|e| Error::Protocol(e.to_string()))
}

#[cfg(test)]
impl Outgoing {
    /// The message, decoded from its frame as its actor would read it.
    pub fn message(&self) -> ToWorker {
        let mut body = self.frame.head[8..].to_vec();
        for part in &self.frame.blobs {
            match part {
                wire::FramePart::Here(b) => body.extend_from_slice(b),
                wire::FramePart::Arriving(_) => panic!("a frame of the table forwards nothing"),
            }
        }
        wire::from_frame(bytes::Bytes::from(body)).expect("the table's frames decode")
    }
}
