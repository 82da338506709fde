//! The transport registry: the one place that lists the transports a
//! program has.
//!
//! Each transport registers itself, in its own module, with
//! [`register_transport!`](crate::register_transport): its name, who acts
//! in a move, whether it needs a collective group, which devices it
//! serves, whether it works only on one host, and how a process starts it.
//! The framework's name table, its checks and its error messages read this
//! registry, so adding a transport — built in, or a user's own, as Ray's
//! `register_tensor_transport` allows — touches no other file.
//!
//! Registration happens at link time (`linkme`): a transport in any crate
//! linked into the binary is known to the driver and to every worker (the
//! same binary) before `main` runs.
//!
//! ```
//! use std::sync::Arc;
//! use rdt_transport::registry::{ProcessContext, Registration};
//! use rdt_transport::{ObjectStoreTransport, Sidedness, TensorTransport};
//!
//! fn start(_: &ProcessContext) -> Result<Arc<dyn TensorTransport>, String> {
//!     Ok(Arc::new(ObjectStoreTransport))
//! }
//!
//! rdt_transport::register_transport!(Registration {
//!     name: "doc_example",
//!     sidedness: Sidedness::ThroughDriver,
//!     collective: false,
//!     devices: "CPU",
//!     same_host_only: false,
//!     start,
//! });
//!
//! assert!(rdt_transport::registry::find("doc_example").is_some());
//! ```

use std::sync::Arc;
use std::time::Duration;

use crate::transport::{Sidedness, TensorTransport};

/// What a process tells a transport when it starts it (transfer contract,
/// point 1: every transport may start in every process that uses it, the
/// driver included).
#[derive(Clone, Debug)]
pub struct ProcessContext {
    /// Framework id of this process's actor; `None` in the driver.
    pub actor: Option<u64>,
    /// The runtime's secret: authenticate peer links with it.
    pub secret: Vec<u8>,
    /// Address to listen on for peer links, for transports that have them
    /// (`127.0.0.1:0` unless configured).
    pub bind: String,
    /// The framework's deadline of one transfer. The framework enforces it
    /// and aborts both ends; a transport may keep a backstop behind it.
    pub transfer_timeout: Duration,
}

/// One transport's entry in the registry.
#[derive(Debug)]
pub struct Registration {
    /// The name used in `#[rdt::method(tensor_transport = ...)]` and errors.
    pub name: &'static str,
    /// Who acts in a move.
    pub sidedness: Sidedness,
    /// Must producer and consumer share a collective group of it?
    pub collective: bool,
    /// The devices it moves tensors on, for people ("CPU", "CUDA",
    /// "CPU, CUDA").
    pub devices: &'static str,
    /// Does it move tensors only between processes of one host? The
    /// framework refuses other passes before anything moves.
    pub same_host_only: bool,
    /// Starts the transport in this process, or says why it cannot run
    /// here (that reason becomes the error of the calls that need it).
    pub start: fn(&ProcessContext) -> Result<Arc<dyn TensorTransport>, String>,
}

/// Every registered transport (see [`register_transport!`](crate::register_transport)).
#[linkme::distributed_slice]
pub static TRANSPORTS: [Registration];

/// The registration of `name`, if a transport of that name is linked in.
pub fn find(name: &str) -> Option<&'static Registration> {
    TRANSPORTS.iter().find(|r| r.name == name)
}

/// The registered names, sorted.
pub fn names() -> Vec<&'static str> {
    let mut n: Vec<&'static str> = TRANSPORTS.iter().map(|r| r.name).collect();
    n.sort_unstable();
    n.dedup();
    n
}

/// Registers a transport: give it a [`Registration`]. Use it once, in the
/// transport's own module.
#[macro_export]
macro_rules! register_transport {
    ($registration:expr $(,)?) => {
        const _: () = {
            #[$crate::__linkme::distributed_slice($crate::registry::TRANSPORTS)]
            #[linkme(crate = $crate::__linkme)]
            static __RDT_TRANSPORT: $crate::registry::Registration = $registration;
        };
    };
}
