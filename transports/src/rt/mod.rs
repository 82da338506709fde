//! What the transports run on besides CUDA: the hot window, the
//! authentication of peers, caches of recent results, process watches,
//! shared libraries opened at run time and free-range lists.

pub mod auth;
pub(crate) mod dynlib;
pub(crate) mod free_list;
pub mod hot;
pub(crate) mod process_watch;
pub mod recent;
