//! Arbitrary bytes as the two halves of a value with tensors (the
//! placeholder data and the exported tensor metadata and bytes): extraction
//! and reinsertion must never panic, and a tensor whose declared size
//! disagrees with its bytes must be refused.
#![no_main]

use std::collections::HashMap;

use rdt::data::object_store;
use rdt::data::value;
use rdt::data::Exported;
use rdt::Tensor;

#[derive(serde::Deserialize)]
#[allow(dead_code)]
struct Nested {
    step: u64,
    weights: HashMap<String, Tensor>,
    extra: Vec<Tensor>,
    mask: Option<Tensor>,
    label: String,
}

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let split = (data[0] as usize) % data.len();
    let (meta, rest) = data[1..].split_at(split.min(data.len() - 1));
    // The exported half: postcard-encoded metadata and inline bytes.
    let tensors = match postcard_exported(meta) {
        Some(e) => match object_store::unpack(&e) {
            Ok(t) => {
                for (m, t) in e.metas.iter().zip(&t) {
                    assert_eq!(m.nbytes(), t.nbytes(), "sizes are checked");
                }
                t
            }
            Err(_) => Vec::new(),
        },
        None => Vec::new(),
    };
    let _ = value::decode::<Nested>(rest, &tensors);
    let _ = value::decode::<Vec<Tensor>>(rest, &tensors);
    let _ = value::decode::<Tensor>(rest, &[]);
});

fn postcard_exported(bytes: &[u8]) -> Option<Exported> {
    rdt::data::wire::from_frame::<Exported>(bytes::Bytes::copy_from_slice(bytes)).ok()
}
