//! What the driver counts: read by a program with
//! [`Runtime::metrics`](crate::Runtime::metrics), and sent through the
//! [`metrics`] facade to whatever recorder the program installed (names
//! below; labels `transport` and `outcome`).
//!
//! | name | kind | what |
//! | --- | --- | --- |
//! | `rdt_transfers` | counter | transfers that ended, by `transport` and `outcome` (`done`, `failed`, `aborted`, `not_sent`) |
//! | `rdt_rx_bytes` | counter | tensor bytes of the transfers that arrived, by `transport` (NIXL's `rx_bytes`) |
//! | `rdt_descriptors` | counter | memory regions those transfers moved (one per tensor as exported), by `transport` (NIXL's `descriptors`) |
//! | `rdt_xfer_time` | histogram | seconds from a transfer's start to its arrival, as the driver saw them, by `transport` (NIXL's `xfer_time`) |
//! | `rdt_calls` | counter | calls that ended, by `outcome` (`ok`, `err`) |

use std::collections::BTreeMap;

/// How a transfer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    /// Its bytes arrived.
    Done,
    /// It failed (the consumer said so).
    Failed,
    /// The driver aborted it (its deadline, a death).
    Aborted,
    /// A straight delivery its producer did not make: the driver
    /// delivered the value instead.
    NotSent,
}

impl Outcome {
    /// As spans and metric labels say it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Outcome::Done => "done",
            Outcome::Failed => "failed",
            Outcome::Aborted => "aborted",
            Outcome::NotSent => "not_sent",
        }
    }
}

/// What the driver has counted since it started ([`Runtime::metrics`]).
///
/// [`Runtime::metrics`]: crate::Runtime::metrics
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct DriverMetrics {
    /// Transfers of direct transports, by transport name.
    pub transports: BTreeMap<String, TransportMetrics>,
    /// Calls that ended with a value.
    pub calls_ok: u64,
    /// Calls that ended with an error.
    pub calls_failed: u64,
}

impl DriverMetrics {
    /// The counts of `transport` (zero where it moved nothing).
    pub fn transport(&self, transport: &str) -> TransportMetrics {
        self.transports.get(transport).copied().unwrap_or_default()
    }
}

/// The transfers of one transport that ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct TransportMetrics {
    /// Transfers whose bytes arrived.
    pub transfers: u64,
    /// Their tensor bytes.
    pub bytes: u64,
    /// Their tensors.
    pub tensors: u64,
    /// Their time from start to arrival, summed, as the driver saw them.
    pub time: std::time::Duration,
    /// Transfers that failed.
    pub failed: u64,
    /// Transfers the driver aborted (deadline, death).
    pub aborted: u64,
}

/// The driver's counts, kept in its state: by transport name as the
/// registry holds it (no allocation per transfer), made a
/// [`DriverMetrics`] when asked.
#[derive(Default)]
pub(crate) struct Counts {
    transports: BTreeMap<&'static str, TransportMetrics>,
    calls_ok: u64,
    calls_failed: u64,
}

impl Counts {
    /// A transfer over `transport` of `bytes` in `tensors` ended, `took`
    /// after it started.
    pub(crate) fn transfer_ended(
        &mut self,
        transport: &'static str,
        bytes: u64,
        tensors: u64,
        took: std::time::Duration,
        outcome: Outcome,
    ) {
        metrics::counter!("rdt_transfers", "transport" => transport, "outcome" => outcome.as_str())
            .increment(1);
        let m = self.transports.entry(transport).or_default();
        match outcome {
            Outcome::Done => {
                metrics::counter!("rdt_rx_bytes", "transport" => transport).increment(bytes);
                metrics::counter!("rdt_descriptors", "transport" => transport).increment(tensors);
                metrics::histogram!("rdt_xfer_time", "transport" => transport)
                    .record(took.as_secs_f64());
                m.transfers += 1;
                m.bytes += bytes;
                m.tensors += tensors;
                m.time += took;
            }
            Outcome::Failed => m.failed += 1,
            Outcome::Aborted => m.aborted += 1,
            Outcome::NotSent => {}
        }
    }

    /// A call ended, with a value or not.
    pub(crate) fn call_ended(&mut self, ok: bool) {
        metrics::counter!("rdt_calls", "outcome" => if ok { "ok" } else { "err" }).increment(1);
        if ok {
            self.calls_ok += 1;
        } else {
            self.calls_failed += 1;
        }
    }

    /// A copy of the counts.
    pub(crate) fn snapshot(&self) -> DriverMetrics {
        DriverMetrics {
            transports: (self.transports.iter())
                .map(|(t, m)| (t.to_string(), *m))
                .collect(),
            calls_ok: self.calls_ok,
            calls_failed: self.calls_failed,
        }
    }
}

/// What an actor's worker has counted since it started
/// ([`ActorRuntime::metrics`](crate::ActorRuntime::metrics)). Tests and
/// benchmarks read it to tell which path a value took.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerMetrics {
    /// Objects in this worker's store (produced with a direct transport,
    /// or received).
    pub local_objects: usize,
    /// Objects received, by transport name (object-store deliveries under
    /// `object_store`).
    pub received: BTreeMap<String, u64>,
    /// Values received straight from the actor that produced them, on a
    /// link between the two workers, not through the driver
    /// (`RuntimeBuilder::peer_delivery`).
    pub straight_deliveries: u64,
    /// `get_into` calls whose tensors the receive wrote into the targets
    /// itself (`nccl`, `nixl`; `tcp`, `shm`, `cuda_ipc` copy into them as
    /// they receive), not received elsewhere and copied in afterwards.
    pub received_in_place: u64,
    /// Receives the control loop started itself once the frames it had
    /// read were handled (a small `nixl` read from a known producer).
    pub receives_started_after_frames: u64,
    /// Calls handed to the actor's thread through the hand-off queue,
    /// found listening after an earlier call.
    pub calls_handed_to_listener: u64,
    /// Stream-ordered receives (`nccl`) a call that took the value
    /// acknowledged with its `CallDone` (WK-9).
    pub receives_acknowledged_by_calls: u64,
}

impl WorkerMetrics {
    /// Objects received over `transport`.
    pub fn received_over(&self, transport: crate::Transport) -> u64 {
        self.received.get(transport.name()).copied().unwrap_or(0)
    }
}
