//! Arbitrary bytes as a control frame body: decoding must never panic.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    rdt::__fuzz::decode_control_frame(data);
});
