//! The control protocol: messages between driver and workers, framing, and
//! the authentication handshake.
//!
//! # Invariants
//! 1. Before any frame is read on a connection, both ends prove knowledge
//!    of the runtime's secret by HMAC-SHA256 over fresh nonces (mutual
//!    challenge-response; the secret never crosses the socket). A peer that
//!    fails is dropped and logged.
//! 2. After the handshake a connection carries frames: an 8-byte big-endian
//!    length, then a body made by [`rdt_transport::wire::to_frame`] (postcard
//!    header, then out-of-band blobs). A receiver refuses a body over the
//!    configured limit and closes the connection; a sender refuses to queue
//!    one and returns an error, which the caller turns into the error of the
//!    call or object concerned.
//! 3. Messages on one connection are handled in the order they were sent;
//!    the driver relies on this to order deliveries before the calls that
//!    need them.

pub(crate) mod boot;
mod handshake;
mod messages;
mod recv;
mod send;
#[cfg(test)]
mod tests;
mod value;

pub use handshake::*;
pub use messages::*;
pub use recv::*;
pub use send::*;
pub use value::*;
