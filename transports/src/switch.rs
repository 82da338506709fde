//! Per-process on/off settings: the knobs that turn one mechanism off (or
//! an old one back on) to compare both in one benchmark run. Each is read
//! from the environment at its first use, and a benchmark may flip it
//! while the process runs ([`set`]), so that passes with and without the
//! mechanism alternate one by one on the same host.

use std::sync::atomic::{AtomicU8, Ordering};

use parking_lot::Mutex;

/// An on/off setting from the environment variable `env`: `1` turns it
/// on, `0` off, anything else (or nothing) leaves the default; [`set`]
/// overrides it while the process runs.
pub struct Switch {
    env: &'static str,
    on_by_default: bool,
    /// `UNREAD`, `OFF` or `ON`.
    value: AtomicU8,
}

const UNREAD: u8 = 0;
const OFF: u8 = 1;
const ON: u8 = 2;

/// The switches read so far (so that [`set`] finds them by name), and the
/// values [`set`] gave names whose switch was not read yet.
static READ: Mutex<Vec<&'static Switch>> = Mutex::new(Vec::new());
static PRESET: Mutex<Vec<(String, bool)>> = Mutex::new(Vec::new());

impl Switch {
    /// A switch read from `env`, `on_by_default` when it says nothing.
    pub const fn new(env: &'static str, on_by_default: bool) -> Self {
        Switch {
            env,
            on_by_default,
            value: AtomicU8::new(UNREAD),
        }
    }

    /// Whether it is on (the environment is read at the first call).
    pub fn on(&'static self) -> bool {
        match self.value.load(Ordering::Relaxed) {
            ON => true,
            OFF => false,
            _ => self.first_read(),
        }
    }

    #[cold]
    fn first_read(&'static self) -> bool {
        let mut read = READ.lock();
        // Another thread may have read it meanwhile (or `set` it).
        match self.value.load(Ordering::Relaxed) {
            ON => return true,
            OFF => return false,
            _ => {}
        }
        let preset = PRESET
            .lock()
            .iter()
            .rev()
            .find(|(name, _)| name == self.env)
            .map(|(_, on)| *on);
        let on =
            preset.unwrap_or_else(|| match std::env::var(self.env).as_deref().map(str::trim) {
                Ok("1") => true,
                Ok("0") => false,
                _ => self.on_by_default,
            });
        self.value
            .store(if on { ON } else { OFF }, Ordering::Relaxed);
        read.push(self);
        on
    }
}

/// Turns the switch named `env` (its environment variable) on or off in
/// this process from now on, whether it was read yet or not: a benchmark
/// alternates passes with and without a mechanism on one host. Code that
/// read the switch before keeps what it decided then.
pub fn set(env: &str, on: bool) {
    let read = READ.lock();
    PRESET.lock().push((env.to_string(), on));
    for s in read.iter().filter(|s| s.env == env) {
        s.value.store(if on { ON } else { OFF }, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_and_zero_override_the_default_and_anything_else_keeps_it() {
        for (value, default, want) in [
            (Some("1"), false, true),
            (Some(" 1 "), false, true),
            (Some("0"), true, false),
            (Some("yes"), false, false),
            (Some("yes"), true, true),
            (None, true, true),
            (None, false, false),
        ] {
            // A variable of this test's own per case (tests run in
            // parallel in one process).
            let env: &'static str =
                Box::leak(format!("RDT_SWITCH_TEST_{value:?}_{default}").into_boxed_str());
            match value {
                // SAFETY: a variable no other test reads or writes.
                Some(v) => unsafe { std::env::set_var(env, v) },
                // SAFETY: as above.
                None => unsafe { std::env::remove_var(env) },
            }
            let s: &'static Switch = Box::leak(Box::new(Switch::new(env, default)));
            assert_eq!(s.on(), want, "{env}={value:?}");
        }
    }

    #[test]
    fn set_flips_a_switch_read_before_and_presets_one_not_read_yet() {
        static READ_BEFORE: Switch = Switch::new("RDT_SWITCH_TEST_SET_READ", true);
        static NOT_YET: Switch = Switch::new("RDT_SWITCH_TEST_SET_UNREAD", true);
        assert!(READ_BEFORE.on());
        set("RDT_SWITCH_TEST_SET_READ", false);
        assert!(!READ_BEFORE.on());
        set("RDT_SWITCH_TEST_SET_READ", true);
        assert!(READ_BEFORE.on());
        set("RDT_SWITCH_TEST_SET_UNREAD", false);
        assert!(!NOT_YET.on(), "a value set before the first read wins");
    }
}
