//! What a worker process sets up for itself before it serves: Rust's
//! start-up done by hand when it boots before `main`, and its C heap.

pub(crate) mod heap;
pub(crate) mod startup;
