//! The host pool's test, in a process of its own: the pool and its limit
//! are process-wide, and the crate's unit tests take and give back pooled
//! buffers (object store packing, arriving blobs) while it counts.

use rdt_transport::host_pool::{set_limit, stats, HostBuf};

#[test]
fn buffers_come_back_and_the_limit_holds() {
    set_limit(64 << 20);
    let before = stats();
    let mut a = HostBuf::new(3 << 20).unwrap();
    a.as_mut_slice().fill(7);
    let addr = a.as_ref().as_ptr();
    assert_eq!(addr as usize % 4096, 0, "page-aligned");
    let bytes = a.freeze();
    let clone = bytes.slice(10..20);
    drop(bytes);
    assert_eq!(
        stats().idle_bytes,
        before.idle_bytes,
        "a slice still holds it"
    );
    assert_eq!(&clone[..], &[7u8; 10]);
    drop(clone);
    assert_eq!(stats().idle_bytes, before.idle_bytes + (3 << 20));
    // Same class: the same mapping comes back.
    let b = HostBuf::new(3 << 20).unwrap();
    assert_eq!(b.as_ref().as_ptr(), addr);
    assert_eq!(stats().hits, before.hits + 1);
    // A much smaller request does not take a big buffer.
    drop(b);
    let small = HostBuf::new(1 << 20).unwrap();
    assert_ne!(small.as_ref().as_ptr(), addr);
    drop(small);
    // Over the limit: the oldest goes.
    let big = HostBuf::new(62 << 20).unwrap();
    drop(big);
    assert!(stats().idle_bytes <= 64 << 20);
    set_limit(0);
    assert_eq!(stats().idle_bytes, 0);
}
