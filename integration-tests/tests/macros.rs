//! Pins the error messages of rdt's macros, and that the memory traits
//! (`ExternalMemory`, `DeviceBuffer`) take only an `unsafe impl`.

#[test]
fn macro_errors() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
