//! Landings and their acknowledgements (WK-5, WK-9).

use super::*;

/// The landing of a stream-ordered receive (WK-5), awaited by the
/// receive's acknowledgement and by every call that took the value (the
/// first to ask drives it; each is woken directly when it resolves).
pub(super) type Landing = futures::future::Shared<
    futures::future::BoxFuture<'static, std::result::Result<(), rdt_transport::TransportError>>,
>;

/// A stream-ordered receive whose bytes are still landing (WK-5): the
/// landing, the transfer, and who acknowledges it (WK-9).
#[derive(Clone)]
pub(crate) struct Landed {
    pub(crate) landing: Landing,
    pub(crate) xfer: u64,
    /// Who acknowledges it, and whether the call that did has ended.
    pub(crate) ack: Arc<AckState>,
}

/// The acknowledgement of a stream-ordered receive (WK-9).
#[derive(Default)]
pub(crate) struct AckState {
    /// Set by whoever took the acknowledgement on: the receive's task
    /// once the bytes landed, or a call that took the value first (its
    /// `CallDone` settles the receive in the driver, XF-5).
    pub(super) taken: std::sync::atomic::AtomicBool,
    /// Set when the call that took it on has ended (its `CallDone`, or
    /// its own `Received` messages, follow at once).
    pub(super) call_ended: std::sync::atomic::AtomicBool,
}

impl Landed {
    /// Takes the acknowledgement on; false if someone else has.
    pub(crate) fn take_ack(&self) -> bool {
        !self
            .ack
            .taken
            .swap(true, std::sync::atomic::Ordering::AcqRel)
    }

    /// The call that took the acknowledgement on has ended.
    pub(crate) fn end_call(&self) {
        self.ack
            .call_ended
            .store(true, std::sync::atomic::Ordering::Release);
    }

    pub(super) fn call_ended(&self) -> bool {
        self.ack
            .call_ended
            .load(std::sync::atomic::Ordering::Acquire)
    }
}

/// How long the receive's task leaves the acknowledgement to a call that
/// took it on, once the bytes landed, before it sends one itself (WK-9):
/// an eighth of the transfer deadline, at most 10 ms. A method that runs
/// on must not hold it until the driver's deadline for the transfer,
/// which would abort a finished transfer and break its group.
pub(super) fn ack_wait(transfer_timeout: Duration) -> Duration {
    (transfer_timeout / 8).min(Duration::from_millis(10))
}
