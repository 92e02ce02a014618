//! CPU compute kernels that the model calls instead of candle's own where bit-exactness matters.
//!
//! Speculative decoding is only lossless if the verifier, which pushes a block of draft tokens through
//! the model in one pass, computes for each token exactly the numbers plain decoding computes for it
//! alone. candle's CPU matmul does not give that: its blocking, hence the order in which a dot
//! product's terms are summed, depends on the number of rows (with candle 0.11.1 about 90% of the
//! elements of a 17-row product differ in their last bits from the same rows multiplied one at a
//! time), which is enough to flip a greedy argmax now and then.
//!
//! [`matmul_xwt`] (and its tensor wrapper [`linear_f32`]) computes `x · Wᵀ` with a per-element
//! reduction order fixed independently of the number of rows, the other rows, tiling and threading,
//! and is memory-bandwidth bound for the few rows of decoding and verification. [`attention_f32`] does the
//! same for attention under an arbitrary tree mask. For GGUF block weights, [`linear_blocks`] keeps f32
//! activations (the dense kernel's numbers on the dequantised weights) and [`linear_q8`] quantises the
//! activations to 8 bits and multiplies in integers (faster; its own numbers, equally row-invariant).
//! The SIMD variant of each is chosen at run time ([`Isa`]).

pub mod attention;
pub mod cuda;
pub mod elementwise;
pub mod isa;
pub mod matmul;
pub mod pages;
pub mod pool;
pub mod q8;
pub mod qmatmul;
#[cfg(test)]
mod test_util;

use candle_core::{DType, Error, Result, Storage, Tensor};

pub use attention::{
    attention_f32, attention_f32_keys, attention_f32_with, transposed_key_index, Keys, TransposedKeys,
    Visibility, Width, KEY_CHUNK, SEGMENT,
};
pub use elementwise::{add_f32, rms_norm_f32, rope_f32, swiglu_f32};
pub use isa::Isa;
pub use matmul::{linear_f32, matmul_xwt};
pub use q8::{linear_q8, linear_q8_many, matmul_q8, PackedFormat, PackedMatrix};
pub use qmatmul::{linear_blocks, matmul_blocks, BlockFormat, BlockMatrix};

/// Fails unless `x` is an f32 tensor on the CPU (what the kernels take), naming the kernel.
pub(crate) fn check_f32_cpu(x: &Tensor, kernel: &str) -> Result<()> {
    if x.dtype() != DType::F32 {
        return Err(Error::Msg(format!("{kernel} takes f32 activations, got {:?}", x.dtype())).bt());
    }
    if !x.device().is_cpu() {
        return Err(Error::Msg(format!("{kernel} takes CPU tensors")).bt());
    }
    Ok(())
}

/// The f32 data of a CPU storage from `start` on, borrowed.
pub(crate) fn cpu_f32(storage: &Storage, start: usize) -> Result<&[f32]> {
    match storage {
        Storage::Cpu(cpu) => Ok(&cpu.as_slice::<f32>()?[start..]),
        _ => Err(Error::Msg("the CPU kernels take CPU tensors".into())),
    }
}

/// `f` of the values of a contiguous f32 CPU tensor, borrowed from its storage (no copy).
pub(crate) fn with_f32<T>(x: &Tensor, f: impl FnOnce(&[f32]) -> T) -> Result<T> {
    let x = x.contiguous()?;
    let (storage, layout) = x.storage_and_layout();
    Ok(f(&cpu_f32(&storage, layout.start_offset())?[..x.elem_count()]))
}

/// Asks for the cache lines of `bytes` bytes from `p` to be brought into L1: for reads the hardware
/// prefetcher does not see coming early enough (a layer's weights or cached keys as the arithmetic
/// moves along them). `p` may point anywhere, past an allocation included: a prefetch reads nothing
/// architecturally and cannot fault, and the addresses are formed with wrapping arithmetic. A no-op
/// off x86_64.
#[inline(always)]
pub(crate) fn prefetch_l1(p: *const u8, bytes: usize) {
    prefetch_lines::<0>(p, bytes)
}

/// As [`prefetch_l1`], into the outer caches only (`prefetcht2`): for reads far enough ahead that lines
/// brought into L1 would crowd out what the arithmetic is using.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the x86 kernels' only
pub(crate) fn prefetch_l2(p: *const u8, bytes: usize) {
    prefetch_lines::<2>(p, bytes)
}

/// `prefetcht0` (`LEVEL` 0) or `prefetcht2` (2) on every cache line of `bytes` bytes from `p`.
#[inline(always)]
fn prefetch_lines<const LEVEL: u8>(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    for l in (0..bytes).step_by(64) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T2};
        let at = p.wrapping_add(l).cast();
        // SAFETY: see `prefetch_l1`; `_mm_prefetch` is SSE, part of the x86_64 baseline.
        unsafe {
            if LEVEL == 0 {
                _mm_prefetch::<_MM_HINT_T0>(at)
            } else {
                _mm_prefetch::<_MM_HINT_T2>(at)
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}

/// Milliseconds of this thread's CPU time per call of `f` (median of 9 runs of at least 20 calls): for
/// single-threaded timings on a machine shared with other work, where wall time mostly measures the
/// neighbours.
#[cfg(all(test, unix))]
pub(crate) fn median_cpu_ms(mut f: impl FnMut()) -> f64 {
    fn now() -> f64 {
        let mut t = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid out-pointer.
        unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        t.tv_sec as f64 * 1e3 + t.tv_nsec as f64 * 1e-6
    }
    f();
    let mut v: Vec<f64> = (0..9)
        .map(|_| {
            let t = now();
            for _ in 0..20 {
                f();
            }
            (now() - t) / 20.0
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[4]
}

/// Milliseconds per call of `f`: the median of 9 timed runs, each repeating `f` at least 3 times and for at
/// least `min_seconds` (the kernels' ignored `timing` tests).
#[cfg(test)]
pub(crate) fn median_ms(min_seconds: f64, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..9)
        .map(|_| {
            let t = std::time::Instant::now();
            let mut it = 0;
            while it < 3 || t.elapsed().as_secs_f64() < min_seconds {
                f();
                it += 1;
            }
            t.elapsed().as_secs_f64() * 1e3 / it as f64
        })
        .collect();
    v.sort_by(f64::total_cmp);
    v[4]
}
