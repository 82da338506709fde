//! Transport names, read from the registry, and the per-process transport
//! instances.
//!
//! Every transport registers itself in its own module
//! ([`rdt_transport::registry`]); this file only looks them up. A
//! [`Transport`] is a name: the built-in ones have constants
//! (`Transport::Shm`), a user's own is `Transport::named("...")` next to its
//! `register_transport!`.

use std::collections::HashMap;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::Mutex;
use rdt_transport::registry::{self, ProcessContext, Registration};
use rdt_transport::{Sidedness, TensorTransport};

use crate::error::{Error, Result};

/// A tensor transport, by name. The same names are valid in
/// `#[rdt::method(tensor_transport = "...")]`; a transport registered by the
/// program itself is passed there as its constant
/// (`tensor_transport = MY_TRANSPORT`).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Transport(&'static str);

#[allow(non_upper_case_globals)]
impl Transport {
    /// Through the driver, serialized (Ray's default; the baseline).
    pub const ObjectStore: Transport = Transport("object_store");
    /// CPU, two-sided, worker-to-worker sockets in a collective group.
    pub const Tcp: Transport = Transport("tcp");
    /// CPU, one-sided, same-host shared memory.
    pub const Shm: Transport = Transport("shm");
    /// CUDA, two-sided, NCCL in a collective group.
    pub const Nccl: Transport = Transport("nccl");
    /// CPU or CUDA, one-sided, NIXL reads (UCX), any hosts, the driver too.
    pub const Nixl: Transport = Transport("nixl");
    /// CUDA, one-sided, same host.
    pub const CudaIpc: Transport = Transport("cuda_ipc");

    /// The transports rdt names itself, registered or not, with the name
    /// of their constant.
    const BUILT_IN: [(Transport, &'static str); 6] = [
        (Transport::ObjectStore, "ObjectStore"),
        (Transport::Tcp, "Tcp"),
        (Transport::Shm, "Shm"),
        (Transport::Nccl, "Nccl"),
        (Transport::Nixl, "Nixl"),
        (Transport::CudaIpc, "CudaIpc"),
    ];

    /// The transport registered as `name` (a program's own transport;
    /// built-in ones have constants). Whether it is registered is checked
    /// where it is used.
    pub const fn named(name: &'static str) -> Transport {
        Transport(name)
    }

    /// For `#[rdt::method(tensor_transport = "...")]`: the built-in
    /// transport called `name`, checked while compiling.
    #[doc(hidden)]
    pub const fn built_in(name: &'static str) -> Transport {
        let mut i = 0;
        while i < Self::BUILT_IN.len() {
            if const_str_eq(Self::BUILT_IN[i].0 .0, name) {
                return Self::BUILT_IN[i].0;
            }
            i += 1;
        }
        panic!("unknown tensor transport; the built-in names are object_store, tcp, shm, nccl, nixl and cuda_ipc; for a transport the program registers itself, give its constant: tensor_transport = MY_TRANSPORT")
    }

    /// Every registered transport, by name.
    pub fn registered() -> Vec<Transport> {
        registry::names().into_iter().map(Transport).collect()
    }

    /// How a program names it in Rust (`Transport::Tcp`, or
    /// `Transport::named("files")` for a program's own), for errors.
    pub fn rust_expr(self) -> String {
        match Self::BUILT_IN.iter().find(|(t, _)| *t == self) {
            Some((_, c)) => format!("Transport::{c}"),
            None => format!("Transport::named({:?})", self.0),
        }
    }

    /// The name used in attributes and errors.
    pub const fn name(self) -> &'static str {
        self.0
    }

    /// The transport's registration, or why there is none.
    pub fn registration(self) -> Result<&'static Registration> {
        registry::find(self.0).ok_or_else(|| Error::TransportUnavailable {
            name: self.0.to_string(),
            reason: format!(
                "no transport of that name is linked into this program (registered: {})",
                Self::valid_names()
            ),
        })
    }

    /// Who acts in a move over this transport (through the driver for a
    /// name nobody registered: nothing can be exported with it).
    pub fn sidedness(self) -> Sidedness {
        registry::find(self.0)
            .map(|r| r.sidedness)
            .unwrap_or(Sidedness::ThroughDriver)
    }

    /// Is this a collective transport (its peers must share a group)?
    pub fn is_collective(self) -> bool {
        match registry::find(self.0) {
            Some(r) => r.collective,
            // Known before it is built: say so at group creation.
            None => self == Transport::Nccl,
        }
    }

    /// Does it move tensors only between actors on one host?
    pub fn same_host_only(self) -> bool {
        registry::find(self.0).is_some_and(|r| r.same_host_only)
    }

    /// The registered names, comma-separated (for error messages).
    pub fn valid_names() -> String {
        registry::names().join(", ")
    }

    /// Is the transport linked into this program?
    pub fn is_implemented(self) -> bool {
        registry::find(self.0).is_some()
    }

    /// The transport instance of this process, started on first use (in
    /// workers at boot), or why there is none.
    pub fn instance(self) -> Result<Arc<dyn TensorTransport>> {
        let reg = self.registration()?;
        let mut started = STARTED.lock();
        let entry = started
            .entry(reg.name)
            .or_insert_with(|| (reg.start)(&process_context()));
        entry.clone().map_err(|reason| Error::TransportUnavailable {
            name: reg.name.to_string(),
            reason,
        })
    }

    /// The instance of this process if it was started already.
    pub(crate) fn existing_instance(self) -> Option<Arc<dyn TensorTransport>> {
        STARTED.lock().get(self.0).and_then(|r| r.clone().ok())
    }
}

type Started = HashMap<&'static str, std::result::Result<Arc<dyn TensorTransport>, String>>;

/// The transports started in this process, by name.
static STARTED: std::sync::LazyLock<Mutex<Started>> = std::sync::LazyLock::new(Default::default);

const fn const_str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// What a worker's transports need to know about it.
pub(crate) struct WorkerTransportConfig {
    pub me: u64,
    pub secret: Vec<u8>,
    pub tcp_bind: String,
    pub transfer_timeout: Duration,
}

static WORKER_CONFIG: OnceLock<WorkerTransportConfig> = OnceLock::new();

/// The context transports start with: the worker's, or the driver's.
fn process_context() -> ProcessContext {
    match WORKER_CONFIG.get() {
        Some(cfg) => ProcessContext {
            actor: Some(cfg.me),
            secret: cfg.secret.clone(),
            bind: cfg.tcp_bind.clone(),
            transfer_timeout: cfg.transfer_timeout,
        },
        None => ProcessContext {
            actor: None,
            secret: Vec::new(),
            bind: "127.0.0.1:0".into(),
            transfer_timeout: Duration::from_secs(120),
        },
    }
}

/// Called once at worker boot: starts every registered transport (each
/// may publish an endpoint for its peers) and returns the endpoints to
/// publish. A transport that cannot start here is logged; calls that need
/// it fail with the reason.
pub(crate) fn configure_worker(cfg: WorkerTransportConfig) -> Vec<(String, String)> {
    let _ = WORKER_CONFIG.set(cfg);
    let mut endpoints = Vec::new();
    for t in Transport::registered() {
        match t.instance() {
            Ok(inst) => endpoints.extend(inst.endpoint().map(|e| (t.name().to_string(), e))),
            Err(e) => tracing::warn!("{e}"),
        }
    }
    endpoints
}

impl std::fmt::Debug for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Transport({})", self.0)
    }
}

impl std::fmt::Display for Transport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.pad(self.name())
    }
}

/// Transport ids on the control wire: a message names a transport by its
/// index in the driver's table (its registered names, sorted), not by its
/// name. A worker gets the driver's table in its spawn order
/// ([`set_wire_table`]), so a worker built with other transports linked in
/// still reads and writes the driver's ids.
static WIRE_TABLE: std::sync::OnceLock<Vec<Transport>> = std::sync::OnceLock::new();

fn wire_table() -> &'static [Transport] {
    WIRE_TABLE.get_or_init(Transport::registered)
}

/// The driver's table of wire ids, by name (for the spawn order).
pub(crate) fn wire_names() -> Vec<String> {
    wire_table().iter().map(|t| t.name().to_string()).collect()
}

/// Adopts the driver's table of wire ids (a worker, before any message
/// that names a transport). A name this program does not link in still
/// gets its id: using it then fails with "not available".
pub(crate) fn set_wire_table(names: &[String]) {
    let table = names
        .iter()
        .map(|n| {
            n.parse::<Transport>()
                .unwrap_or_else(|_| Transport(Box::leak(n.clone().into_boxed_str())))
        })
        .collect();
    if WIRE_TABLE.set(table).is_err() && wire_names() != names {
        tracing::warn!("the driver's transport table came after this process made its own");
    }
}

impl Serialize for Transport {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match wire_table().iter().position(|t| t.name() == self.name()) {
            Some(i) => s.serialize_u16(i as u16),
            None => Err(serde::ser::Error::custom(format!(
                "transport `{self}` is not linked into the driver (it knows: {}); register it in the driver's program too",
                wire_names().join(", ")
            ))),
        }
    }
}

impl<'de> Deserialize<'de> for Transport {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let i = u16::deserialize(d)? as usize;
        wire_table().get(i).copied().ok_or_else(|| {
            serde::de::Error::custom(format!(
                "transport id {i} is not in the driver's table of {}",
                wire_table().len()
            ))
        })
    }
}

impl FromStr for Transport {
    type Err = Error;
    /// A registered name, or a built-in one not linked in (whose use then
    /// says it is not available).
    fn from_str(s: &str) -> Result<Self> {
        if let Some(r) = registry::find(s) {
            return Ok(Transport(r.name));
        }
        Self::BUILT_IN
            .iter()
            .map(|(t, _)| *t)
            .find(|t| t.name() == s)
            .ok_or_else(|| Error::UnknownTransport {
                name: s.to_string(),
                valid: Self::valid_names(),
            })
    }
}
