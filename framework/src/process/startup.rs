//! What Rust's start-up (`lang_start`) does for a process, done by hand for
//! a worker that boots before `main`.
//!
//! A binary with `#[rdt::main]` boots its workers from `main`, after Rust's
//! own start-up: nothing here runs. Test binaries have no `main` of ours
//! (libtest owns it), so their workers boot from a pre-`main` constructor,
//! and std's start-up never runs for them. Two things a Rust program relies
//! on come from it:
//!
//! - **WK-1a: SIGPIPE is ignored**, so a write to a closed socket or pipe is
//!   an `EPIPE` error, not the death of the process.
//! - **WK-1b: a stack overflow is reported** ("thread 'main' has overflowed
//!   its stack", then SIGABRT) instead of a bare SIGSEGV: a handler on an
//!   alternate signal stack recognises faults in the guard region below the
//!   main thread's stack, where the actor's methods run.
//!
//! Faults anywhere else get the default action, as without the handler.

use std::sync::atomic::{AtomicUsize, Ordering};

/// Lowest and highest address of the main thread's guard region.
static GUARD: [AtomicUsize; 2] = [AtomicUsize::new(0), AtomicUsize::new(0)];

/// How far below the stack's lowest address a fault still counts as an
/// overflow: Linux keeps a gap of 256 pages below a growing stack.
const GUARD_GAP: usize = 1 << 20;

/// Alternate signal stack size for the handler.
const ALT_STACK: usize = 64 << 10;

/// Does, for this process, what `lang_start` would have (WK-1a, WK-1b).
/// Call on the main thread, before it runs user code.
pub(crate) fn rust_start_up() {
    // SAFETY: setting a signal disposition to SIG_IGN has no preconditions.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_IGN);
    }
    if let Err(e) = install_overflow_handler() {
        eprintln!(
            "rdt worker: no stack overflow handler ({e}); an overflow will be a bare SIGSEGV"
        );
    }
}

fn install_overflow_handler() -> std::io::Result<()> {
    // SAFETY: plain libc calls with correctly sized, initialised arguments;
    // the attribute object is destroyed after use; the alternate stack is a
    // fresh private mapping that lives as long as the process.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return Err(std::io::Error::other("pthread_getattr_np failed"));
        }
        let mut addr: *mut libc::c_void = std::ptr::null_mut();
        let mut size: libc::size_t = 0;
        let r = libc::pthread_attr_getstack(&attr, &mut addr, &mut size);
        libc::pthread_attr_destroy(&mut attr);
        if r != 0 {
            return Err(std::io::Error::other("pthread_attr_getstack failed"));
        }
        let lowest = addr as usize;
        let page = libc::sysconf(libc::_SC_PAGESIZE) as usize;
        GUARD[0].store(lowest.saturating_sub(GUARD_GAP), Ordering::Relaxed);
        GUARD[1].store(lowest + page, Ordering::Relaxed);

        let stack = libc::mmap(
            std::ptr::null_mut(),
            ALT_STACK,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if stack == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ss = libc::stack_t {
            ss_sp: stack,
            ss_flags: 0,
            ss_size: ALT_STACK,
        };
        if libc::sigaltstack(&ss, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_fault as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut action.sa_mask);
        for sig in [libc::SIGSEGV, libc::SIGBUS] {
            if libc::sigaction(sig, &action, std::ptr::null_mut()) != 0 {
                return Err(std::io::Error::last_os_error());
            }
        }
    }
    Ok(())
}

/// The fault handler: async-signal-safe calls only (`write`, `abort`,
/// `sigaction`).
extern "C" fn on_fault(sig: libc::c_int, info: *mut libc::siginfo_t, _ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo for SA_SIGINFO handlers.
    let addr = unsafe { (*info).si_addr() } as usize;
    let (lo, hi) = (
        GUARD[0].load(Ordering::Relaxed),
        GUARD[1].load(Ordering::Relaxed),
    );
    if addr >= lo && addr < hi {
        const MSG: &[u8] =
            b"\nthread 'main' has overflowed its stack\nfatal runtime error: stack overflow, aborting\n";
        // SAFETY: write(2) and abort(3) are async-signal-safe.
        unsafe {
            libc::write(2, MSG.as_ptr().cast(), MSG.len());
            libc::abort();
        }
    }
    // Not an overflow: restore the default action and return, so the
    // faulting instruction faults again and the process dies as usual.
    // SAFETY: sigaction(2) is async-signal-safe; the struct is zeroed
    // (SIG_DFL, empty mask).
    unsafe {
        let mut dfl: libc::sigaction = std::mem::zeroed();
        dfl.sa_sigaction = libc::SIG_DFL;
        libc::sigaction(sig, &dfl, std::ptr::null_mut());
    }
}
