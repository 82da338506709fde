//! On-device ops for tests, examples and benchmarks: random fill (cuRAND),
//! sum and compare (kernels compiled at run time by NVRTC).
//!
//! # Invariants
//! 1. Every op is enqueued on the [`Gpu`]'s one stream, so it is ordered
//!    after everything rdt enqueued before it in this process (fills,
//!    copies, and the wait on a `cuda_ipc` producer's event) and before
//!    everything after it.
//! 2. Reductions (`sum`, `count_differences`) return a host value, so they
//!    wait for their own result: they block the calling thread until the
//!    stream has reached them (a few microseconds past the preceding work).
//!    They are meant for checks, not for hot paths.
//! 3. cuRAND and NVRTC are optional libraries, loaded on first use. Their
//!    absence (or a missing symbol, on which cudarc's loader would panic) is
//!    a [`CudaError`] saying which library is missing and how to provide
//!    it, checked once per process before any of their symbols is touched.
//! 4. Kernels are compiled once per process for the device's exact
//!    architecture (`sm_XY`, a CUBIN: no PTX JIT, so an NVRTC newer than
//!    the driver still works) and loaded once per device.

use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::{Arc, OnceLock};

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;
use parking_lot::Mutex;

use super::{CudaError, Gpu};
use crate::dtype::DType;

/// Threads per block of every rdt kernel.
const BLOCK: u32 = 256;

/// The kernels, one source for every element type.
const SOURCE: &str = r#"
typedef unsigned long long u64;

__device__ double rdt_block_sum(double v) {
    __shared__ double warp_sums[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    v = (threadIdx.x < (blockDim.x >> 5)) ? warp_sums[lane] : 0.0;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

__device__ u64 rdt_block_count(u64 v) {
    __shared__ u64 warp_counts[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) warp_counts[warp] = v;
    __syncthreads();
    v = (threadIdx.x < (blockDim.x >> 5)) ? warp_counts[lane] : 0ull;
    if (warp == 0)
        for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return v;
}

#define RDT_SUM(NAME, T)                                                       \
extern "C" __global__ void NAME(const T* x, u64 n, double* out) {              \
    double acc = 0.0;                                                          \
    u64 stride = (u64)gridDim.x * blockDim.x;                                  \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) \
        acc += (double)x[i];                                                   \
    acc = rdt_block_sum(acc);                                                  \
    if (threadIdx.x == 0) atomicAdd(out, acc);                                 \
}

RDT_SUM(rdt_sum_f32, float)
RDT_SUM(rdt_sum_f64, double)
RDT_SUM(rdt_sum_i8, signed char)
RDT_SUM(rdt_sum_i16, short)
RDT_SUM(rdt_sum_i32, int)
RDT_SUM(rdt_sum_i64, long long)
RDT_SUM(rdt_sum_u8, unsigned char)
RDT_SUM(rdt_sum_u16, unsigned short)
RDT_SUM(rdt_sum_u32, unsigned int)
RDT_SUM(rdt_sum_u64, unsigned long long)

#define RDT_DIFF(NAME, T)                                                      \
extern "C" __global__ void NAME(const T* a, const T* b, u64 n, u64* out) {     \
    u64 acc = 0;                                                               \
    u64 stride = (u64)gridDim.x * blockDim.x;                                  \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) \
        acc += (a[i] != b[i]);                                                 \
    acc = rdt_block_count(acc);                                                \
    if (threadIdx.x == 0 && acc != 0) atomicAdd(out, acc);                     \
}

RDT_DIFF(rdt_diff_u32, unsigned int)
RDT_DIFF(rdt_diff_u8, unsigned char)
"#;

/// NVRTC symbols rdt calls (checked before first use, see invariant 3).
const NVRTC_SYMBOLS: &[&str] = &[
    "nvrtcCreateProgram",
    "nvrtcCompileProgram",
    "nvrtcDestroyProgram",
    "nvrtcGetCUBINSize",
    "nvrtcGetCUBIN",
    "nvrtcGetProgramLogSize",
    "nvrtcGetProgramLog",
    "nvrtcGetErrorString",
];

/// cuRAND symbols rdt calls.
const CURAND_SYMBOLS: &[&str] = &[
    "curandCreateGenerator",
    "curandSetPseudoRandomGeneratorSeed",
    "curandSetGeneratorOffset",
    "curandSetStream",
    "curandGenerate",
    "curandGenerateUniform",
    "curandGenerateUniformDouble",
    "curandDestroyGenerator",
];

/// Driver symbols only the ops use (the rest are checked by
/// [`available`](super::available)).
const DRIVER_SYMBOLS: &[&str] = &["cuModuleLoadData", "cuModuleGetFunction", "cuLaunchKernel"];

fn missing(lib: &str) -> CudaError {
    CudaError(format!(
        "{lib} was not found on the loader path: it ships with the CUDA toolkit \
         (and with PyTorch's nvidia-* wheels); add its folder to LD_LIBRARY_PATH"
    ))
}

/// Is NVRTC usable (library and every symbol rdt calls)? Checked once.
pub fn nvrtc_available() -> Result<(), CudaError> {
    static STATE: OnceLock<Result<(), CudaError>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            super::available()?;
            // SAFETY: only tries to load the library.
            if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
                return Err(missing(
                    "libnvrtc (NVRTC, used for on-device sum and compare)",
                ));
            }
            // SAFETY: the library is present (checked above); lookups call
            // nothing.
            let lib = unsafe { cudarc::nvrtc::sys::culib() };
            if let Some(s) = NVRTC_SYMBOLS.iter().find(|s| {
                // SAFETY: a lookup of a symbol's address; nothing is called.
                unsafe { lib.get::<*const ()>(s.as_bytes()) }.is_err()
            }) {
                return Err(CudaError(format!(
                    "libnvrtc lacks {s}: NVRTC 11.1 or newer is needed"
                )));
            }
            // SAFETY: loaded, as `available` checked; lookups call nothing.
            let drv = unsafe { sys::culib() };
            if let Some(s) = DRIVER_SYMBOLS.iter().find(|s| {
                // SAFETY: a lookup of a symbol's address; nothing is called.
                unsafe { drv.get::<*const ()>(s.as_bytes()) }.is_err()
            }) {
                return Err(CudaError(format!("libcuda lacks {s}")));
            }
            Ok(())
        })
        .clone()
}

/// Is cuRAND usable? Checked once.
pub fn curand_available() -> Result<(), CudaError> {
    static STATE: OnceLock<Result<(), CudaError>> = OnceLock::new();
    STATE
        .get_or_init(|| {
            super::available()?;
            // SAFETY: only tries to load the library.
            if !unsafe { cudarc::curand::sys::is_culib_present() } {
                return Err(missing("libcurand (cuRAND, used for random fill)"));
            }
            // SAFETY: the library is present (checked above); lookups call
            // nothing.
            let lib = unsafe { cudarc::curand::sys::culib() };
            if let Some(s) = CURAND_SYMBOLS.iter().find(|s| {
                // SAFETY: a lookup of a symbol's address; nothing is called.
                unsafe { lib.get::<*const ()>(s.as_bytes()) }.is_err()
            }) {
                return Err(CudaError(format!("libcurand lacks {s}")));
            }
            Ok(())
        })
        .clone()
}

/// A compiled CUBIN, or why there is none.
type Compiled = Result<Arc<Vec<u8>>, CudaError>;

/// Compiles [`SOURCE`] for `sm_<arch>` into a CUBIN, once per architecture.
fn cubin(arch: u32) -> Compiled {
    static CACHE: OnceLock<Mutex<HashMap<u32, Compiled>>> = OnceLock::new();
    let mut cache = CACHE.get_or_init(Default::default).lock();
    cache
        .entry(arch)
        .or_insert_with(|| compile(arch).map(Arc::new))
        .clone()
}

fn compile(arch: u32) -> Result<Vec<u8>, CudaError> {
    use cudarc::nvrtc::{result as rtc, sys as rsys};
    nvrtc_available()?;
    let src = CString::new(SOURCE).expect("no NUL in the kernel source");
    let name = CString::new("rdt_ops.cu").expect("no NUL");
    let prog = rtc::create_program(&src, Some(&name))
        .map_err(|e| CudaError(format!("nvrtcCreateProgram failed: {e:?}")))?;
    let opts = [format!("--gpu-architecture=sm_{arch}"), "-std=c++14".into()];
    // SAFETY: `prog` is a live program; destroyed below on every path.
    let compiled = unsafe { rtc::compile_program(prog, &opts) };
    let result = match compiled {
        Err(e) => {
            // SAFETY: live program.
            let log = unsafe { rtc::get_program_log(prog) }
                .map(|l| {
                    l.iter()
                        .take_while(|&&c| c != 0)
                        .map(|&c| c as u8 as char)
                        .collect::<String>()
                })
                .unwrap_or_default();
            Err(CudaError(format!(
                "NVRTC could not compile rdt's kernels for sm_{arch}: {e:?}: {log}"
            )))
        }
        Ok(()) => {
            let mut size = 0usize;
            // SAFETY: live, compiled program; the buffer has `size` bytes.
            unsafe {
                rsys::nvrtcGetCUBINSize(prog, &mut size)
                    .result()
                    .map_err(|e| CudaError(format!("nvrtcGetCUBINSize failed: {e:?}")))
                    .and_then(|()| {
                        let mut bin = vec![0u8; size];
                        rsys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut _)
                            .result()
                            .map_err(|e| CudaError(format!("nvrtcGetCUBIN failed: {e:?}")))
                            .map(|()| bin)
                    })
            }
        }
    };
    // SAFETY: live program, not used after this.
    let _ = unsafe { rtc::destroy_program(prog) };
    result
}

/// The kernels loaded in one device's context, and a small result buffer.
pub(crate) struct Kernels {
    _module: Arc<CudaModule>,
    functions: HashMap<&'static str, CudaFunction>,
    /// 8 bytes of device memory for reduction results.
    result: u64,
    /// Held from the reset of `result` to its read-back.
    busy: Mutex<()>,
}

const FUNCTIONS: &[&str] = &[
    "rdt_sum_f32",
    "rdt_sum_f64",
    "rdt_sum_i8",
    "rdt_sum_i16",
    "rdt_sum_i32",
    "rdt_sum_i64",
    "rdt_sum_u8",
    "rdt_sum_u16",
    "rdt_sum_u32",
    "rdt_sum_u64",
    "rdt_diff_u32",
    "rdt_diff_u8",
];

impl Kernels {
    pub(crate) fn load(gpu: &Gpu) -> Result<Kernels, CudaError> {
        nvrtc_available()?;
        let (major, minor) = gpu.compute_capability()?;
        let bin = cubin(major * 10 + minor)?;
        gpu.bind()?;
        let module = gpu
            .ctx
            .load_module(Ptx::from_binary(bin.as_ref().clone()))
            .map_err(|e| CudaError::call("cuModuleLoadData (rdt kernels)", e))?;
        let mut functions = HashMap::new();
        for &f in FUNCTIONS {
            let func = module
                .load_function(f)
                .map_err(|e| CudaError::call(&format!("cuModuleGetFunction({f})"), e))?;
            functions.insert(f, func);
        }
        let result = gpu.malloc(8)?;
        Ok(Kernels {
            _module: module,
            functions,
            result,
            busy: Mutex::new(()),
        })
    }

    /// Launches reduction `name` (every one takes `(inputs..., n, out)`)
    /// over `n` elements of the device arrays `inputs`, then reads the
    /// 8-byte result back.
    fn reduce(&self, gpu: &Gpu, name: &str, inputs: &[u64], n: u64) -> Result<[u8; 8], CudaError> {
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| CudaError(format!("no kernel {name}")))?;
        let mut args: Vec<u64> = inputs.iter().copied().chain([n, self.result]).collect();
        let mut params: Vec<*mut c_void> = args
            .iter_mut()
            .map(|a| a as *mut u64 as *mut c_void)
            .collect();
        let _busy = self.busy.lock();
        gpu.fill(self.result, 8, &[0])?;
        if n > 0 {
            let blocks = n
                .div_ceil(BLOCK as u64)
                .min(gpu.multiprocessors()? as u64 * 8)
                .max(1) as u32;
            // SAFETY: the parameters match the kernel's signature (every
            // rdt kernel takes device pointers, then `n`, then `out`, all
            // 8 bytes), every pointer is live device memory of this context
            // or reachable through unified addressing, and the stream
            // belongs to this context. `args` outlives the launch call,
            // which copies the values.
            unsafe {
                cu::launch_kernel(
                    f.cu_function(),
                    (blocks, 1, 1),
                    (BLOCK, 1, 1),
                    0,
                    gpu.own_stream(),
                    &mut params,
                )
            }
            .map_err(|e| CudaError::call(&format!("launching {name}"), e))?;
            gpu.enqueued();
        }
        let mut out = [0u8; 8];
        gpu.copy_dtoh(&mut out, self.result)?;
        Ok(out)
    }
}

fn sum_kernel(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "rdt_sum_f32",
        DType::F64 => "rdt_sum_f64",
        DType::I8 => "rdt_sum_i8",
        DType::I16 => "rdt_sum_i16",
        DType::I32 => "rdt_sum_i32",
        DType::I64 => "rdt_sum_i64",
        DType::U8 | DType::Bool => "rdt_sum_u8",
        // Storage-only types: the raw 16-bit words, as on the host.
        DType::F16 | DType::BF16 => "rdt_sum_u16",
        DType::U32 => "rdt_sum_u32",
        DType::U64 => "rdt_sum_u64",
    }
}

/// Sum of the `n` elements of type `dtype` at `ptr`, accumulated in `f64`
/// on the device (the order of additions differs from the host's, so a
/// floating-point sum may differ in its last bits). Blocks until done.
pub fn sum(gpu: &Gpu, dtype: DType, ptr: u64, n: usize) -> Result<f64, CudaError> {
    let bytes = gpu
        .kernels()?
        .reduce(gpu, sum_kernel(dtype), &[ptr], n as u64)?;
    Ok(f64::from_ne_bytes(bytes))
}

/// Number of differing units between `len` bytes at `a` and at `b` (4-byte
/// words where both are 4-aligned, then single bytes): zero means equal.
/// Both ranges must be addressable from `gpu`'s context. Blocks until done.
pub fn count_differences(gpu: &Gpu, a: u64, b: u64, len: usize) -> Result<u64, CudaError> {
    let k = gpu.kernels()?;
    let aligned = a % 4 == 0 && b % 4 == 0;
    let words = if aligned { len / 4 } else { 0 };
    let mut total = 0u64;
    if words > 0 {
        total += u64::from_ne_bytes(k.reduce(gpu, "rdt_diff_u32", &[a, b], words as u64)?);
    }
    let tail = len - words * 4;
    if tail > 0 {
        let off = (words * 4) as u64;
        total +=
            u64::from_ne_bytes(k.reduce(gpu, "rdt_diff_u8", &[a + off, b + off], tail as u64)?);
    }
    Ok(total)
}

/// A cuRAND generator bound to one device's stream, with a word of
/// device memory for the tail of byte lengths that are not whole words.
pub(crate) struct Generator {
    raw: cudarc::curand::sys::curandGenerator_t,
    tail: u64,
}
// SAFETY: the generator is only used under its device's mutex (`PerGpu`), with the
// device's context bound.
unsafe impl Send for Generator {}

impl Generator {
    pub(crate) fn new(gpu: &Gpu) -> Result<Generator, CudaError> {
        use cudarc::curand::result as cr;
        curand_available()?;
        gpu.bind()?;
        let raw = cr::create_generator()
            .map_err(|e| CudaError(format!("curandCreateGenerator failed: {e:?}")))?;
        // SAFETY: fresh generator; the stream belongs to the bound context.
        unsafe { cr::set_stream(raw, gpu.own_stream() as _) }
            .map_err(|e| CudaError(format!("curandSetStream failed: {e:?}")))?;
        let tail = gpu.malloc(8)?;
        Ok(Generator { raw, tail })
    }
}

/// The ops' state of one device: its kernels and its cuRAND generator,
/// each made on first use. Kept here, per GPU, so that [`Gpu`] does not
/// know the ops.
#[derive(Default)]
struct PerGpu {
    /// rdt's kernels in this context (compiled and loaded on first use).
    kernels: OnceLock<Result<Arc<Kernels>, CudaError>>,
    /// cuRAND generator on this stream (created on first use).
    generator: OnceLock<Result<Mutex<Generator>, CudaError>>,
}

/// The ops' state of `gpu`, made on first use. A [`Gpu`] lives as long as
/// the process (one per local ordinal), and so does its state.
fn per_gpu(gpu: &Gpu) -> &'static PerGpu {
    static ALL: OnceLock<Mutex<HashMap<usize, &'static PerGpu>>> = OnceLock::new();
    ALL.get_or_init(Default::default)
        .lock()
        .entry(gpu.ordinal())
        .or_insert_with(|| Box::leak(Box::<PerGpu>::default()))
}

impl Gpu {
    /// rdt's kernels in this device's context, compiled (NVRTC) and loaded
    /// on first use.
    pub(crate) fn kernels(&self) -> Result<Arc<Kernels>, CudaError> {
        per_gpu(self)
            .kernels
            .get_or_init(|| Kernels::load(self).map(Arc::new))
            .clone()
    }

    /// This device's cuRAND generator, created on first use.
    pub(crate) fn generator(&self) -> Result<&Mutex<Generator>, CudaError> {
        per_gpu(self)
            .generator
            .get_or_init(|| Generator::new(self).map(Mutex::new))
            .as_ref()
            .map_err(Clone::clone)
    }
}

/// Fills `[ptr, ptr + len)` with random values from `seed`: uniform in
/// (0, 1] for `F32`/`F64`, random bits for every other type. Writes only
/// inside the range (a byte length that is not whole words gets its last
/// bytes through a scratch word). `ptr` must be aligned to the element
/// type (4 bytes, 8 for `F64`). Enqueued on the stream; the same seed and
/// length give the same values.
pub fn random_fill(
    gpu: &Gpu,
    dtype: DType,
    ptr: u64,
    len: usize,
    seed: u64,
) -> Result<(), CudaError> {
    use cudarc::curand::result as cr;
    let align = if dtype == DType::F64 { 8 } else { 4 };
    if ptr % align != 0 {
        return Err(CudaError(format!(
            "random fill needs {align}-byte aligned memory; {ptr:#x} is not"
        )));
    }
    let gen = gpu.generator()?.lock();
    let g = gen.raw;
    gpu.bind()?;
    let words = len / 4;
    // SAFETY: live generator under its lock, context bound; `ptr` holds
    // `len` bytes, of which only whole elements are written here.
    unsafe {
        cr::set_seed(g, seed).map_err(|e| CudaError(format!("curandSetSeed failed: {e:?}")))?;
        cr::set_offset(g, 0)
            .map_err(|e| CudaError(format!("curandSetGeneratorOffset failed: {e:?}")))?;
        let r = match dtype {
            DType::F32 => cr::generate::uniform_f32(g, ptr as *mut f32, len / 4),
            DType::F64 => cr::generate::uniform_f64(g, ptr as *mut f64, len / 8),
            _ if words > 0 => cr::generate::uniform_u32(g, ptr as *mut u32, words),
            _ => Ok(()),
        };
        // Counted even if it failed: part of it may be enqueued (IK-1).
        gpu.enqueued();
        r.map_err(|e| CudaError(format!("cuRAND generate failed: {e:?}")))?;
    }
    let tail = len % 4;
    if !matches!(dtype, DType::F32 | DType::F64) && tail > 0 {
        // SAFETY: as above; the scratch word is ours, under the lock.
        let r = unsafe { cr::generate::uniform_u32(g, gen.tail as *mut u32, 1) };
        gpu.enqueued();
        r.map_err(|e| CudaError(format!("cuRAND generate failed: {e:?}")))?;
        // Ordered after the generate on the same stream; the lock is held
        // until both are enqueued, and the next use of the scratch word is
        // ordered after this copy.
        gpu.copy_dtod(ptr + (words * 4) as u64, gen.tail, tail)?;
    }
    drop(gen);
    Ok(())
}
