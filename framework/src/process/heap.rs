//! The C heap of processes rdt starts (workers).
//!
//! A pass of an object with thousands of tensors allocates a few large
//! vectors (metadata, descriptors, the received tensors) and frees them
//! when it ends. glibc's defaults serve every allocation above 128 KiB
//! (raised on the fly only for chunks freed from `mmap`) with a fresh
//! `mmap`, and give the top of the heap back to the kernel once 128 KiB of
//! it is free: so every pass faulted its vectors' pages in again. On the
//! dev VM that was 40 % of a 10 000-tensor pass (818 → 478 ns per tensor,
//! `bench transports --many-each 64`).
//!
//! Workers therefore keep up to [`TRIM_ABOVE`] of freed heap per arena, and
//! map only allocations of [`MAP_ABOVE`] or more on their own (a large CPU
//! tensor still goes back to the kernel when freed). `RDT_HEAP_DEFAULTS=1`
//! keeps glibc's behaviour; so does a `GLIBC_TUNABLES` that sets either
//! threshold (the user's choice wins). The driver's process is the user's,
//! and rdt leaves its heap alone.

/// Allocations at least this large are mapped on their own.
pub(crate) const MAP_ABOVE: usize = 32 << 20;
/// Freed heap kept (per arena) before it goes back to the kernel.
pub(crate) const TRIM_ABOVE: usize = 64 << 20;

/// Applies the worker heap settings (once, at worker start).
pub(crate) fn tune_worker_heap() {
    if crate::env::heap_defaults() {
        return;
    }
    let tunables = crate::env::glibc_tunables();
    if tunables.contains("mmap_threshold") || tunables.contains("trim_threshold") {
        return;
    }
    set_thresholds();
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() {
    // SAFETY: mallopt only sets allocator parameters; called before the
    // worker starts its threads.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, MAP_ABOVE as libc::c_int);
        libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_ABOVE as libc::c_int);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() {}
