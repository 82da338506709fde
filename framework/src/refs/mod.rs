//! What a user holds, and the one API both roles offer ([`api`]): refs, handles and calls ([`object_ref`]), the
//! client they count and call through ([`client`]), how values with refs
//! in them serialize ([`codec`]), waiting on refs ([`wait`]) and the
//! targets of a weight update ([`targets`]).

pub(crate) mod api;
pub(crate) mod client;
pub(crate) mod codec;
pub(crate) mod object_ref;
pub(crate) mod targets;
pub(crate) mod wait;
