//! Row-invariant `y = x · Wᵀ` from GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights with 8-bit
//! activations: the dot products are taken in integers.
//!
//! # Why
//! With f32 activations ([`super::qmatmul`]) every weight is converted to f32 and multiplied in f32:
//! a decoding step is bound by that conversion, not by memory, and each row of a block adds its own
//! share of it. Quantising the activations to 8 bits (as llama.cpp does) turns a block of 32 weights
//! times 32 activations into a few integer instructions (`vpdpbusd` with VNNI, `vpmaddubsw` on plain
//! AVX2) and leaves one f32 step per block. The numbers differ from the f32 model's by the activation
//! rounding (at most half a step of `amax / 127` per value), which plain and speculative decoding
//! share: on SmolLM2 the logits move by about 0.3 (rms, logits of order 20), which flips the greedy
//! choice only at near ties.
//!
//! # The per-element recipe (every variant, bit for bit)
//! 1. Each row of `x` is quantised on its own, per block of 32 values ([`quantize_rows`], one portable
//!    function for all variants): `amax = max |x|`, `d_x = amax / 127`, `q = round_half_even(x ·
//!    (127 / amax))` (all zero when `amax = 0`), `Σq`, and `s_x = d_x · f32(Σq)`.
//! 2. For output `j` and block `b`, `isum = Σ w_q · q` over the 32 pairs, exactly in i32 (`w_q`: the
//!    nibble minus 8 for Q4_0, the nibble for Q4_1, the int8 for Q8_0, the 4-, 5- or 6-bit value of
//!    the K-quants, minus 32 for Q6_K). `|isum| < 2^20`, so `f32(isum)` is exact. Q6_K takes two sums,
//!    over the block's halves.
//! 3. `acc = 0`; for each block in increasing order, `acc = fma(d_w · d_x, f32(isum), acc)`, then for
//!    Q4_1 / Q4_K / Q5_K `acc = fma(m_w, s_x, acc)` (`m_w` the block's minimum, negative for the
//!    K-quants); for Q6_K `acc = fma(d_lo · d_x, f32(isum_lo), acc)`, then `acc = fma(d_hi · d_x,
//!    f32(isum_hi), acc)`. Products rounded to f32 and fused multiply-adds (single rounding: `vfmadd`
//!    on x86, `f32::mul_add` in the portable path), nothing else. The K-quants' heads `d_w = d·sc`,
//!    `m_w = -dmin·mn` are exact in f32, resolved at load.
//!
//! The integer part is exact in any order and the f32 part is a fixed sequence per output, so every
//! variant (portable, AVX2, AVX-VNNI, AVX-512 VNNI) gives the same bits, and a row's outputs do not
//! depend on the other rows of the block, the tile it lands in, or the thread count.
//!
//! # Layout and speed
//! At load the weights are repacked ([`PackedMatrix`]): 16 output rows side by side per block, so that
//! one 512-bit register (two 256-bit ones) holds 4 consecutive weights of each of 16 outputs and
//! `vpdpbusd` against 4 broadcast activations accumulates 16 outputs at once, with no horizontal sums.
//! Every format keeps about its GGUF bytes per weight: 4-bit values stay packed two to a byte (Q5_K's and
//! Q6_K's high bits in planes beside them), the 32-value formats keep their f16 heads, and the K-quants
//! keep their sub-block scales as bytes and their super-block scales apart (Q4_K 0.58, Q5_K 0.70, Q6_K
//! 0.82 bytes per weight against GGUF's 0.56, 0.69 and 0.82; see [`PackedMatrix`]). Each block
//! of weights is loaded and unpacked once per tile of up to 8 activation rows, and every row of the
//! tile only adds integer multiply-adds and its one f32 step. Output groups are split into ranges that
//! the kernel pool ([`super::pool`]) spreads over threads; each output is computed by one thread.
//!
//! # Formats and instruction sets
//! A format's path through the kernels is shaped by a few predicates of [`PackedFormat`] (in
//! `format.rs`), all constant once a kernel is monomorphised for the format:
//! - `four_bit`: values of at most 4 bits, the *nibble* path (a chunk's two nibble planes against two
//!   activation quads; without VNNI the products summed in 16 bits and widened once per block); the
//!   others take the *byte* path (`quad`: a stored value per byte, Q8_0's byte or a nibble with its high
//!   bits shifted in);
//! - `nibble_planes`: the low 4 bits of every value stored as nibbles (all but Q8_0), and `high_chunks`
//!   the 64-byte chunks of high bits after them (Q5_K one, Q6_K two);
//! - `k_quant`: byte sub-block heads under per-row f16 super-block scales (kept apart: `supers`);
//! - `two_heads`: a second head per row and block, a minimum or (`split`, Q6_K) the scale of the
//!   block's second half, whose sum is then taken and added apart;
//! - `offset`: what the stored unsigned value exceeds the weight's integer by (subtracted once per
//!   block as `-c·Σq`, from the activations' `starts`).
//!
//! | format | four_bit | nibble_planes | high_chunks | k_quant | two_heads | split | offset |
//! |---|---|---|---|---|---|---|---|
//! | Q4_0 | yes | yes | 0 | no | no | no | 8 |
//! | Q4_1 | yes | yes | 0 | no | yes (minimum) | no | 0 |
//! | Q8_0 | no | no | 0 | no | no | no | 128 |
//! | Q4_K | yes | yes | 0 | yes | yes (minimum) | no | 0 |
//! | Q5_K | no | yes | 1 | yes | yes (minimum) | no | 0 |
//! | Q6_K | no | yes | 2 | yes | yes (half scale) | yes | 32 |
//!
//! Each instruction set has one generic tile, monomorphised per format by a const tag
//! (`PackedFormat::tag`), and one named entry per format that runs it: `matmul_q4_0_q8`,
//! `matmul_q4_1_q8`, `matmul_q8_0_q8`, `matmul_q4k_q8`, `matmul_q5k_q8`, `matmul_q6k_q8` in
//! `portable.rs` (which reads the format at run time instead), `avx2.rs` (modules `avx2` and `avxvnni`),
//! `avx512.rs` and, on aarch64, `neon.rs` (modules `neon` and `neondot`: one group-block's four outputs
//! at a time, every row, the same tile for every format). What each runs ("g": groups of 16 outputs a
//! tile, at up to that many rows; the rules and their reasons are in `plan.rs`):
//!
//! | format | portable | AVX2 | AVX-VNNI | AVX-512 VNNI |
//! |---|---|---|---|---|
//! | Q4_0 | unpacked to i16 | nibble; 2g ≤ 2 rows | nibble; 2g ≤ 2 rows | nibble; 4g ≤ 2 rows, else 2g |
//! | Q4_1 | unpacked to i16 | nibble; 2g ≤ 2 rows | nibble; 2g ≤ 2 rows | nibble; 4g ≤ 2 rows, else 2g |
//! | Q8_0 | unpacked to i16 | byte, signed `maddubs`; 1g | byte; 2g ≤ 2 rows | byte; 4g ≤ 2 rows, else 2g |
//! | Q4_K | unpacked to i16 | nibble; 2g ≤ 2 rows | nibble; 2g ≤ 2 rows | nibble; 4g ≤ 2 rows, else 2g; L1 prefetch at 8 rows |
//! | Q5_K | unpacked to i16 | byte, paired quads past 4 rows; 1g | byte; 2g ≤ 2 rows | byte; 4g ≤ 2 rows, else 2g; L1 prefetch at 8 rows |
//! | Q6_K | unpacked to i16 | byte in halves, paired quads; 1g; tiles of 4 rows | byte in halves; 2g ≤ 2 rows; tiles of 4 rows | byte in halves; 4g at 1 row, 2g ≤ 5 rows, else 1g; L1 prefetch at 8 rows |
//!
//! The 256-bit tiles (AVX2, AVX-VNNI) take a group as two halves of 8 lanes: both in one pass at up to
//! 4 rows, one after the other in tiles of 8 rows (Q6_K 4) beyond. The AVX-512 tiles take up to 8 rows;
//! on Zen 4 their groups and prefetch follow the `zen4_` rules of `plan.rs`.

use super::isa::Isa;
use candle_core::{Device, Error, Result, Tensor};
#[cfg(target_arch = "x86_64")]
use plan::PREFETCH_BLOCKS;
use plan::{KEEP_ACTIVATION_BYTES, MIN_TASK_BYTES, PAR_MIN_WORK};

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod format;
#[cfg(target_arch = "aarch64")]
mod neon;
mod pack;
mod plan;
mod portable;
mod quantize;
#[cfg(test)]
mod tests;

pub use format::PackedFormat;
pub use pack::PackedMatrix;
pub use quantize::{quantize_rows, quantize_rows_into, QuantRows};

/// Output rows per packed group: the lanes of one 512-bit register of i32 / f32.
pub const GROUP: usize = 16;

/// The variants this kernel implements, best first.
pub const VARIANTS: [Isa; 6] = [
    Isa::Avx512Vnni,
    Isa::AvxVnni,
    Isa::Avx2,
    Isa::NeonDot,
    Isa::Neon,
    Isa::Portable,
];

/// The fastest variant this CPU has.
pub fn default_isa() -> Isa {
    Isa::best_of(&VARIANTS)
}

/// `y[i*n + j] = Σ_kk x[i*k + kk] · w[j][kk]` by the module's recipe, for `x` [m, k] row-major and `w`
/// [n, k]; `y` ([m, n] row-major) is fully overwritten. Row-invariant.
///
/// # Panics
/// If a slice length does not match its shape.
pub fn matmul_q8(x: &[f32], w: &PackedMatrix, y: &mut [f32], m: usize) {
    matmul_q8_with(default_isa(), x, w, y, m)
}

/// [`matmul_q8`] on an explicit variant (one of [`VARIANTS`]); all give the same bits.
///
/// # Panics
/// If a slice length does not match its shape, or the variant is not implemented or not available.
pub fn matmul_q8_with(isa: Isa, x: &[f32], w: &PackedMatrix, y: &mut [f32], m: usize) {
    let k = w.dims().1;
    assert_eq!(x.len(), m * k, "matmul_q8: x must hold m*k = {m}*{k} values");
    let a = quantize_rows(x, m, k);
    matmul_quantized_with(isa, &a, w, y)
}

/// `x · Wᵀ` for a candle tensor `x` ([m, k], f32, CPU) and a packed matrix `w` ([n, k]): a new [m, n].
///
/// # Errors
/// If `x` is not f32, not on the CPU, not 2-D, or its width is not `w`'s.
pub fn linear_q8(x: &Tensor, w: &PackedMatrix) -> Result<Tensor> {
    Ok(linear_q8_many(x, &[w])?.pop().unwrap())
}

/// `x · Wᵢᵀ` for several matrices of `x`'s width: `x` quantised once, one job on the kernel pool (see
/// [`matmul_quantized_many`]). Each result is what [`linear_q8`] gives alone.
///
/// # Errors
/// If `x` is not f32, not on the CPU, not 2-D, or its width is not every matrix's.
pub fn linear_q8_many(x: &Tensor, ws: &[&PackedMatrix]) -> Result<Vec<Tensor>> {
    super::check_f32_cpu(x, "linear_q8")?;
    let (m, k) = x.dims2()?;
    for w in ws {
        let kw = w.dims().1;
        if k != kw {
            return Err(Error::Msg(format!("linear_q8: x has {k} columns, the weight {kw}")).bt());
        }
    }
    super::with_f32(x, |xs| with_quantized(xs, m, k, |a| products_of(a, ws)))?
}

/// `x · Wᵢᵀ` for f32 rows `x` (`[m, k]`, `k` every matrix's width) into `ys[i]` (`[m, n_i]`): `x`
/// quantised once, one job on the kernel pool, as [`linear_q8_many`] without tensors (the model's
/// layers on flat buffers).
///
/// # Panics
/// If a length does not match its shape.
pub fn matmul_q8_many(x: &[f32], m: usize, ws: &[&PackedMatrix], ys: &mut [&mut [f32]]) {
    let k = ws.first().map_or(0, |w| w.dims().1);
    with_quantized(x, m, k, |a| matmul_quantized_many(default_isa(), a, ws, ys))
}

/// The product of already quantised rows (`y`: [a.rows, n]).
pub fn matmul_quantized_with(isa: Isa, a: &QuantRows, w: &PackedMatrix, y: &mut [f32]) {
    matmul_quantized_many(isa, a, &[w], &mut [y])
}

/// The products of the same quantised rows with several matrices (`ys[i]`: `[a.rows, ws[i] rows]`), as one
/// job on the kernel pool: a layer's q/k/v or gate/up projections share one quantisation of their input
/// and one hand-off, and the small ones no longer run alone.
///
/// # Panics
/// If a shape does not match, or the variant is not implemented or not available.
pub fn matmul_quantized_many(isa: Isa, a: &QuantRows, ws: &[&PackedMatrix], ys: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), ys.len(), "matmul_q8: one output per matrix");
    for (w, y) in ws.iter().zip(ys.iter()) {
        let n = w.dims().0;
        assert_eq!(
            y.len(),
            a.rows * n,
            "matmul_q8: y must hold m*n = {}*{n} values",
            a.rows
        );
    }
    let ys: Vec<*mut f32> = ys.iter_mut().map(|y| y.as_mut_ptr()).collect();
    // SAFETY: each pointer holds a.rows * n values (checked above).
    unsafe { products_into(isa, a, ws, &ys) }
}

/// Where a task writes: the 16 outputs of its `gi`-th group for row `r` at `ptr + r·ld + gi·16`.
/// Tasks own disjoint column ranges of the same rows, so they share the pointer.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    ld: usize,
    groups: usize,
}

impl Out {
    /// # Safety
    /// `gi < groups` and `r` within the rows the pointer was made for.
    unsafe fn at(self, gi: usize, r: usize) -> *mut f32 {
        self.ptr.add(r * self.ld + gi * GROUP)
    }

    /// Where groups `lo .. hi` of these go: a task's share.
    ///
    /// # Safety
    /// `lo <= hi <= groups`.
    unsafe fn groups(self, lo: usize, hi: usize) -> Out {
        Out {
            ptr: self.at(lo, 0),
            groups: hi - lo,
            ..self
        }
    }
}

/// One task: groups `g0 .. g0 + out.groups` for every row.
type TaskFn = fn(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out);

/// The variant's task.
///
/// # Panics
/// If the variant is not implemented.
fn task_of(isa: Isa) -> TaskFn {
    match isa {
        Isa::Portable => portable::task,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::avx2::task,
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => avx2::avxvnni::task,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => avx512::task,
        #[cfg(target_arch = "aarch64")]
        Isa::Neon => neon::neon::task,
        #[cfg(target_arch = "aarch64")]
        Isa::NeonDot => neon::neondot::task,
        _ => panic!("matmul_q8 has no {isa:?} variant"),
    }
}

/// The products of [`matmul_quantized_many`] into `ys[i]`, every one of its `a.rows · n` values written
/// (never read): the outputs may be fresh, uninitialised allocations, which spares zero-filling them
/// (`memset` showed in a prefill's profile).
///
/// # Safety
/// `ys[i]` must be valid for writes of `a.rows · ws[i] rows` f32s, and the outputs must not overlap.
///
/// # Panics
/// As [`matmul_quantized_many`].
unsafe fn products_into(isa: Isa, a: &QuantRows, ws: &[&PackedMatrix], ys: &[*mut f32]) {
    assert_eq!(ws.len(), ys.len(), "matmul_q8: one output per matrix");
    let m = a.rows;
    for w in ws {
        let k = w.dims().1;
        assert_eq!(a.cols, k, "matmul_q8: x has {} columns, the weight {k}", a.cols);
    }
    assert!(
        isa.available(),
        "matmul_q8: {isa:?} requested on a CPU without it"
    );
    if m == 0 {
        return;
    }
    let task = task_of(isa);
    let pool = super::pool::Pool::global();
    let work: usize = ws.iter().map(|w| m * w.rows * w.cols).sum();
    let parallel = work >= PAR_MIN_WORK;
    // Per matrix: where its groups' outputs go (`y` itself, rows of whole groups; a padded copy when
    // the last group is partial) and where its groups start in the job's run of groups (the matrices'
    // groups one after the other).
    struct Part<'a> {
        w: &'a PackedMatrix,
        first: usize,
        out: Out,
    }
    // SAFETY: tasks write disjoint groups (column ranges) through `out`.
    unsafe impl Sync for Part<'_> {}
    let mut bufs: Vec<Vec<f32>> = ws
        .iter()
        .map(|w| {
            if w.rows.is_multiple_of(GROUP) {
                Vec::new()
            } else {
                vec![0.0f32; w.groups() * GROUP * m]
            }
        })
        .collect();
    let mut parts = Vec::with_capacity(ws.len());
    let mut groups = 0;
    // The fewest groups a claim takes: MIN_TASK_BYTES of weights in the matrix of the smallest groups.
    let mut min_groups = 1;
    for ((w, &y), buf) in ws.iter().zip(ys).zip(bufs.iter_mut()) {
        let n = w.groups();
        if n == 0 {
            continue;
        }
        let out = if buf.is_empty() {
            Out {
                ptr: y,
                ld: w.rows,
                groups: n,
            }
        } else {
            Out {
                ptr: buf.as_mut_ptr(),
                ld: n * GROUP,
                groups: n,
            }
        };
        parts.push(Part {
            w,
            first: groups,
            out,
        });
        groups += n;
        min_groups = min_groups.max(MIN_TASK_BYTES.div_ceil(w.bytes() / n));
    }
    // Groups `g0 .. g1` of the job, matrix by matrix.
    let run = |g0: usize, g1: usize| {
        for p in &parts {
            let (lo, hi) = (g0.max(p.first), g1.min(p.first + p.out.groups));
            if lo >= hi {
                continue;
            }
            let (lo, hi) = (lo - p.first, hi - p.first);
            // SAFETY: this range writes groups lo .. hi of the matrix, which no other range touches.
            task(a, p.w, lo, unsafe { p.out.groups(lo, hi) })
        }
    };
    if !parallel {
        run(0, groups);
    } else {
        pool.run_ranges(groups, min_groups, &run);
    }
    for ((w, &y), buf) in ws.iter().zip(ys).zip(&bufs) {
        if buf.is_empty() {
            continue;
        }
        let (n, ld) = (w.rows, w.groups() * GROUP);
        for (r, br) in buf.chunks_exact(ld).enumerate() {
            // SAFETY: row r of y (n values from r · n) lies inside y's m · n (the caller's contract).
            unsafe { std::ptr::copy_nonoverlapping(br.as_ptr(), y.add(r * n), n) };
        }
    }
}

/// Asks for the group-block `PREFETCH_BLOCKS` ahead of block `b` of a group whose `nb` blocks of `st`
/// bytes start at `wg`, in a tile of `groups` consecutive groups. Past the group's end that is the
/// same group of the next tile (`groups` groups on), which is what this stream reads next: the group
/// right after it is another stream of this tile, already read. Past the matrix's end included
/// (harmless).
///
/// `into_l1`: into L1 instead (`prefetcht0`), where [`plan::prefetch_into_l1`] asks for it (the
/// AVX-512 tiles of 8 rows of the K-quants).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(wg: *const u8, b: usize, nb: usize, st: usize, groups: usize, into_l1: bool) {
    let ahead = b + PREFETCH_BLOCKS;
    let ahead = if ahead < nb {
        ahead
    } else {
        ahead + (groups - 1) * nb
    };
    if into_l1 {
        super::prefetch_l1(wg.wrapping_add(ahead * st), st);
    } else {
        super::prefetch_l2(wg.wrapping_add(ahead * st), st);
    }
}

/// `f` of `x` (`[m, k]`) quantised into this thread's kept buffer: a decoding step quantises four
/// inputs a layer, which would otherwise take fresh vectors each time.
fn with_quantized<T>(x: &[f32], m: usize, k: usize, f: impl FnOnce(&QuantRows) -> T) -> T {
    thread_local! {
        static ACTIVATIONS: std::cell::RefCell<QuantRows> = Default::default();
    }
    ACTIVATIONS.with_borrow_mut(|a| {
        quantize_rows_into(a, x, m, k);
        let out = f(a);
        // A long prompt's activations are not kept for the one-row steps after it.
        if a.q.capacity() > KEEP_ACTIVATION_BYTES {
            *a = QuantRows::default();
        }
        out
    })
}

/// The products of quantised rows `a` with `ws`, as tensors.
fn products_of(a: &QuantRows, ws: &[&PackedMatrix]) -> Result<Vec<Tensor>> {
    let m = a.rows;
    let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| Vec::with_capacity(m * w.dims().0)).collect();
    let outs: Vec<*mut f32> = ys.iter_mut().map(|y| y.as_mut_ptr()).collect();
    // SAFETY: each output has room for its m · n values and they are distinct allocations;
    // `products_into` writes every one of them, so they are initialised when the lengths are set.
    unsafe {
        products_into(default_isa(), a, ws, &outs);
        for (y, w) in ys.iter_mut().zip(ws) {
            y.set_len(m * w.dims().0);
        }
    }
    ys.into_iter()
        .zip(ws)
        .map(|(y, w)| Tensor::from_vec(y, (m, w.dims().0), &Device::Cpu))
        .collect()
}
