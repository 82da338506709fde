//! What the macros emit, one file per item they expand.

pub(crate) mod dispatch;
pub(crate) mod handle;
pub(crate) mod main;
