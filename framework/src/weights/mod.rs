//! Weight sync: a trainer publishes versions of a named parameter set,
//! rollouts subscribe with their own parameters and receive each version
//! in place, without pausing their readers.
//!
//! `examples/weight_sync.rs` is a whole program: a trainer actor and N
//! rollout actors, versions checked by checksum, pause and flip times.
//!
//! The pieces:
//! - [`Layout`]: names, dtypes and shapes in one canonical (sorted)
//!   order, and its [`digest`](Layout::digest);
//! - [`ParamSet`]: a layout's parameters packed into a few aligned
//!   arenas, the same on both ends, so a version moves one descriptor per
//!   arena whatever the number of tensors;
//! - [`Publisher`]: the trainer's ring of buffers, each published as a
//!   version ([`Published`]) once and written again only when no reader
//!   holds it;
//! - [`Subscriber`]: the rollout's parameters, a version received into
//!   the buffer its readers do not use and flipped in between two reads
//!   ([`Weights::current`]).
//!
//! # Invariants
//! - WS-1: a publisher and a subscriber agree on the layout by name
//!   before any byte moves: [`Subscriber::subscribe`] names the first
//!   difference, and every version's digest is compared with the
//!   subscriber's before its receive starts.
//! - WS-2: equal layouts (and arena sizes) pack into the same arenas at
//!   the same offsets, each parameter aligned to [`PARAM_ALIGN`].
//! - WS-3: [`Publisher::next_buffer`] never waits for a reader: it makes
//!   a new buffer when every one is held.
//! - WS-4: a version's buffer is not handed out again while anything
//!   holds the version (its object is not freed): a reader of version v
//!   never sees bytes of v + 1.
//! - WS-5: a subscriber's versions only increase; a stale or repeated
//!   one is refused with [`Error::StaleVersion`](crate::Error::StaleVersion)
//!   before any byte moves.
//! - WS-6: a double-buffered receive never writes the buffer a reader's
//!   [`Current`] names; the flip makes the new version live for the next
//!   `current()` only.

mod layout;
mod params;
mod publish;
mod subscribe;

pub use layout::{Layout, LayoutDigest, ParamSpec};
pub use params::{ParamSet, DEFAULT_ARENA_BYTES, PARAM_ALIGN};
pub use publish::{PublishStats, Published, Publisher, Snapshot};
pub use subscribe::{Current, Received, Subscriber, Swap, Weights};
