//! Unit tests of the CUDA layer that need no GPU (free marks, errors
//! without a GPU, UUIDs).

use super::gpu::gpu_uuid;
use super::*;
use crate::GpuUuid;

/// FM-1 and FM-2 as the allocator uses them (no GPU needed): memory
/// is clean only once a mark taken after its free was seen passed;
/// marks seen out of order still cover every free before them.
#[test]
fn free_marks_clean_only_what_a_later_mark_covers() {
    let m = FreeMarks::new();
    assert!(m.clean(0), "a slab never freed into is clean");
    let freed = m.current();
    assert!(!m.clean(freed), "freed, no mark since");
    let before = m.take();
    assert!(before >= freed, "a mark taken after the free covers it");
    let later_free = m.current();
    assert!(later_free > before);
    let after = m.take();
    // The later mark is seen first (another thread's completion).
    m.passed(after);
    assert!(m.clean(freed) && m.clean(later_free));
    m.passed(before);
    assert!(
        m.clean(later_free),
        "an older mark seen later undoes nothing"
    );
    assert!(
        !m.clean(m.current()),
        "a free after the last mark is not clean"
    );
}

#[test]
fn no_gpu_is_an_error_not_a_panic() {
    // On a machine with a GPU this passes trivially; without one every
    // entry point must answer with an error that says why.
    if available().is_err() {
        let e = gpu(0).unwrap_err();
        assert!(e.0.contains("libcuda") || e.0.contains("device"), "{e}");
        assert_eq!(device_count(), 0);
        assert!(gpu_by_uuid(&GpuUuid::from_bytes([0xee; 16])).is_err());
    }
}

#[test]
fn ops_without_a_gpu_are_errors_not_panics() {
    let e = crate::Tensor::zeros(crate::DType::F32, &[4])
        .uniform_(1)
        .unwrap_err();
    assert!(e.to_string().contains("CUDA tensors"), "{e}");
    if available().is_err() {
        // The optional libraries are never touched without a GPU.
        assert!(ops::nvrtc_available().is_err());
        assert!(ops::curand_available().is_err());
        let e = crate::Tensor::cuda_rand(crate::DType::F32, &[4], 0, 1).unwrap_err();
        assert!(e.to_string().contains("CUDA"), "{e}");
    }
}

#[test]
fn uuid_format() {
    let u = sys::CUuuid {
        bytes: [1i8; 16].map(|c| c),
    };
    assert_eq!(
        gpu_uuid(&u).to_string(),
        "GPU-01010101-0101-0101-0101-010101010101"
    );
}
