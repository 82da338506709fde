//! Per-process on/off settings read once from the environment: the knobs
//! that turn one mechanism off (or an old one back on) to compare both in
//! one benchmark run.

use std::sync::OnceLock;

/// An on/off setting from the environment variable `env`, read once:
/// `1` turns it on, `0` off, anything else (or nothing) leaves the
/// default.
pub struct Switch {
    env: &'static str,
    on_by_default: bool,
    value: OnceLock<bool>,
}

impl Switch {
    /// A switch read from `env`, `on_by_default` when it says nothing.
    pub const fn new(env: &'static str, on_by_default: bool) -> Self {
        Switch {
            env,
            on_by_default,
            value: OnceLock::new(),
        }
    }

    /// Whether it is on (the environment is read at the first call).
    pub fn on(&self) -> bool {
        *self
            .value
            .get_or_init(|| match std::env::var(self.env).as_deref().map(str::trim) {
                Ok("1") => true,
                Ok("0") => false,
                _ => self.on_by_default,
            })
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
                None => unsafe { std::env::remove_var(env) },
            }
            assert_eq!(Switch::new(env, default).on(), want, "{env}={value:?}");
        }
    }
}
