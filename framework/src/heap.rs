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
//! tensor still goes back to the kernel when freed).
//!
//! Workers also keep no *fastbins* (glibc's `M_MXFAST`, 0). Small chunks
//! freed beyond what a thread's cache holds wait in fastbins, and every
//! request of 1 KiB or more first consolidates all of them
//! (`malloc_consolidate`). A small `nixl` pass makes two such requests on
//! the consumer's path (the receive's task, 1 432 bytes, and the call's
//! argument wait), behind some fifty small frees: on the dev VM the
//! receive task's box took 1.6 µs with fastbins and 0.7 µs without (1.5 µs
//! on a 2×H200 host with them), whose timelines first showed it. The
//! thread caches (`tcache`, up to 1 KiB) serve small chunks as before.
//! `RDT_WORKER_FASTBINS=1` keeps them (a measurement knob, which a
//! benchmark may flip while the worker runs).
//!
//! `RDT_HEAP_DEFAULTS=1` keeps glibc's behaviour; so does a
//! `GLIBC_TUNABLES` that sets one of these (the user's choice wins). The
//! driver's process is the user's, and rdt leaves its heap alone.

/// Allocations at least this large are mapped on their own.
pub(crate) const MAP_ABOVE: usize = 32 << 20;
/// Freed heap kept (per arena) before it goes back to the kernel.
pub(crate) const TRIM_ABOVE: usize = 64 << 20;

/// Applies the worker heap settings (once, at worker start).
pub(crate) fn tune_worker_heap() {
    if std::env::var_os("RDT_HEAP_DEFAULTS").is_some_and(|v| v == "1") {
        return;
    }
    let tunables = std::env::var("GLIBC_TUNABLES").unwrap_or_default();
    if !tunables.contains("mxfast") {
        // Read once: the read applies it (`apply_fastbins`).
        let _ = FASTBINS.on();
    }
    if tunables.contains("mmap_threshold") || tunables.contains("trim_threshold") {
        return;
    }
    set_thresholds();
}

/// Whether workers keep glibc's fastbins (`RDT_WORKER_FASTBINS=1`).
static FASTBINS: rdt_transport::switch::Switch =
    rdt_transport::switch::Switch::applied_by("RDT_WORKER_FASTBINS", false, apply_fastbins);

/// glibc's default `M_MXFAST` on 64-bit targets (`64 * sizeof(size_t) / 4`).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const DEFAULT_MXFAST: libc::c_int = 128;

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn apply_fastbins(on: bool) {
    // SAFETY: mallopt only sets an allocator parameter (glibc consolidates
    // the fastbins it has when it changes).
    unsafe {
        libc::mallopt(libc::M_MXFAST, if on { DEFAULT_MXFAST } else { 0 });
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn apply_fastbins(_on: bool) {}

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
