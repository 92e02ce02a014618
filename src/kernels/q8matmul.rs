//! Row-invariant `y = x · Wᵀ` from GGUF Q4_0 / Q4_1 / Q8_0 weights with 8-bit activations: the dot
//! products are taken in integers.
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
//!    nibble minus 8 for Q4_0, the nibble for Q4_1, the int8 for Q8_0). `|isum| < 2^20`, so `f32(isum)`
//!    is exact.
//! 3. `acc = 0`; for each block in increasing order, `acc = fma(d_w · d_x, f32(isum), acc)`, then for
//!    Q4_1 `acc = fma(m_w, s_x, acc)`: a product rounded to f32 and one or two fused multiply-adds
//!    (single rounding: `vfmadd` on x86, `f32::mul_add` in the portable path), nothing else.
//!
//! The integer part is exact in any order and the f32 part is a fixed sequence per output, so every
//! variant (portable, AVX2, AVX-VNNI, AVX-512 VNNI) gives the same bits, and a row's outputs do not
//! depend on the other rows of the block, the tile it lands in, or the thread count.
//!
//! # Layout and speed
//! At load the weights are repacked ([`PackedMatrix`]): 16 output rows side by side per block, so that
//! one 512-bit register (two 256-bit ones) holds 4 consecutive weights of each of 16 outputs and
//! `vpdpbusd` against 4 broadcast activations accumulates 16 outputs at once, with no horizontal sums.
//! The quantised nibbles keep their 4-bit packing (the bytes read per token do not change). Each block
//! of weights is loaded and unpacked once per tile of up to 8 activation rows, and every row of the
//! tile only adds integer multiply-adds and its one f32 step. Output groups are split into ranges that
//! rayon spreads over threads; each output is computed by one thread.

use rayon::prelude::*;

use super::isa::Isa;
use super::qmatmul::{BlockFormat, BlockMatrix, BLOCK};
use candle_core::{DType, Device, Error, Result, Tensor};

/// Output rows per packed group: the lanes of one 512-bit register of i32 / f32.
pub const GROUP: usize = 16;

/// Activation rows per register tile.
const TILE_ROWS: usize = 8;

/// A product runs on rayon's threads only if its weights are at least this many (a large matrix is
/// worth a second core's bandwidth even for one row) ...
const PAR_MIN_WEIGHTS: usize = 1 << 20;

/// ... or its weight-activation products at least this many (compute-bound blocks of rows). Below both,
/// handing the work to the pool and waking the caller again (about 10 µs from outside the pool, where
/// the decode loop runs; the scheduler's wake-ups were a fifth of a SmolLM2 step) costs more than a
/// second core saves: SmolLM2's 576 x 576 projections run on the calling thread up to 12 rows, its MLP
/// matrices up to 4, its vocabulary projection never. (Results do not depend on it.)
const PAR_MIN_WORK: usize = 1 << 22;

/// The variants this kernel implements, best first.
pub const VARIANTS: [Isa; 4] = [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2, Isa::Portable];

/// The fastest variant this CPU has.
pub fn default_isa() -> Isa {
    Isa::best_of(&VARIANTS)
}

/// Bytes of f16 heads per group-block: 16 scales, and for Q4_1 16 minimums.
const fn heads_bytes(f: BlockFormat) -> usize {
    match f {
        BlockFormat::Q4_1 => 4 * GROUP,
        _ => 2 * GROUP,
    }
}

/// Bytes of quantised weights per group-block: 16 rows × 32 nibbles or bytes.
const fn quant_bytes(f: BlockFormat) -> usize {
    match f {
        BlockFormat::Q8_0 => GROUP * BLOCK,
        _ => GROUP * BLOCK / 2,
    }
}

/// Bytes per group-block.
const fn stride(f: BlockFormat) -> usize {
    heads_bytes(f) + quant_bytes(f)
}

/// `c` such that a weight is `u - c`, where `u` is the unsigned byte stored for it: the nibble (Q4_0:
/// weight + 8; Q4_1: the weight), or the int8 weight + 128 (Q8_0). So `isum = Σ u·q - c·Σq`.
const fn offset(f: BlockFormat) -> i32 {
    match f {
        BlockFormat::Q4_0 => 8,
        BlockFormat::Q4_1 => 0,
        BlockFormat::Q8_0 => 128,
    }
}

/// A `[rows, cols]` GGUF block matrix repacked for the 8-bit-activation kernel.
///
/// Rows are taken 16 at a time (a *group*; the last one padded with zero rows). For group `g` and block
/// `b` (columns `32b .. 32b + 32`), `stride` bytes at `(g · cols/32 + b) · stride`:
/// - 16 f16 scales `d` (one per row of the group), for Q4_1 then 16 f16 minimums `m`;
/// - the weights as 64-byte chunks, byte `4l + i` of a chunk belonging to row `l` of the group: for
///   Q4_0/Q4_1 chunk `t` (0..4) holds weight `4t + i` in its low nibble and `16 + 4t + i` in its high one
///   (the GGUF nibble pairs, regrouped); for Q8_0 chunk `t` (0..8) holds weight `4t + i` plus 128.
#[derive(Clone, Debug)]
pub struct PackedMatrix {
    format: BlockFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl PackedMatrix {
    /// Repacks a block matrix (same values, see the type's doc).
    pub fn pack(w: &BlockMatrix) -> Self {
        let format = w.format();
        let (rows, cols) = w.dims();
        let nb = cols / BLOCK;
        let (hb, st, bb) = (heads_bytes(format), stride(format), format.block_bytes());
        let groups = rows.div_ceil(GROUP);
        let mut data = vec![0u8; groups * nb * st];
        for j in 0..rows {
            let (g, l) = (j / GROUP, j % GROUP);
            let row = w.row(j);
            for b in 0..nb {
                let src = &row[b * bb..(b + 1) * bb];
                let dst = &mut data[(g * nb + b) * st..(g * nb + b + 1) * st];
                dst[2 * l..2 * l + 2].copy_from_slice(&src[..2]);
                if format == BlockFormat::Q4_1 {
                    dst[2 * GROUP + 2 * l..2 * GROUP + 2 * l + 2].copy_from_slice(&src[2..4]);
                }
                let q = &mut dst[hb..];
                for t in 0..quant_bytes(format) / 64 {
                    let chunk = &mut q[64 * t + 4 * l..64 * t + 4 * l + 4];
                    if format == BlockFormat::Q8_0 {
                        for (c, &v) in chunk.iter_mut().zip(&src[2 + 4 * t..]) {
                            *c = v ^ 0x80;
                        }
                    } else {
                        // The GGUF nibble pairs (weights i and 16 + i in byte i) keep their bytes.
                        chunk.copy_from_slice(&src[bb - 16 + 4 * t..][..4]);
                    }
                }
            }
        }
        PackedMatrix {
            format,
            rows,
            cols,
            data,
        }
    }

    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// `(rows, cols)`: rows are outputs, cols are inputs.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }
}

/// Activation rows quantised per block of 32 (step 1 of the module's recipe).
#[derive(Clone, Debug)]
pub struct QuantRows {
    rows: usize,
    cols: usize,
    /// `[rows, cols]` int8 values.
    q: Vec<i8>,
    /// Per row and block: the scale `d_x`.
    d: Vec<f32>,
    /// Per row and block: `Σq`.
    sum: Vec<i32>,
    /// Per row and block: `d_x · f32(Σq)`.
    s: Vec<f32>,
}

/// Adding 1.5·2^23 to an f32 of magnitude below 2^22 rounds it to an integer, ties to even, in the
/// default rounding mode (the same rule as `round_ties_even`), and leaves that integer in the low bits:
/// `bits(v + MAGIC) - bits(MAGIC)`. Pure f32 additions and integer subtractions, so the quantisation
/// vectorises on the baseline x86_64 target (which has no rounding instruction).
const ROUND_MAGIC: f32 = 12_582_912.0;

/// Quantises each row of `x` (`[rows, cols]`, `cols` a multiple of 32) on its own, per block of 32.
/// A block holding a NaN gets a NaN scale, so NaNs propagate to the outputs as in f32.
///
/// # Panics
/// If `cols` is not a multiple of 32 or `x` is not `rows · cols` long.
pub fn quantize_rows(x: &[f32], rows: usize, cols: usize) -> QuantRows {
    assert!(cols.is_multiple_of(BLOCK), "quantize_rows: {cols} columns");
    assert_eq!(
        x.len(),
        rows * cols,
        "quantize_rows: x must hold rows*cols values"
    );
    let blocks = rows * cols / BLOCK;
    let mut out = QuantRows {
        rows,
        cols,
        q: vec![0; rows * cols],
        d: vec![0.0; blocks],
        sum: vec![0; blocks],
        s: vec![0.0; blocks],
    };
    let magic = ROUND_MAGIC.to_bits() as i32;
    for (i, (xs, qs)) in x
        .chunks_exact(BLOCK)
        .zip(out.q.chunks_exact_mut(BLOCK))
        .enumerate()
    {
        let xs: &[f32; BLOCK] = xs.try_into().unwrap();
        // The largest magnitude as bits: integer order is magnitude order for non-negative floats,
        // and every NaN sorts above infinity.
        let mut amax_bits = 0u32;
        for v in xs {
            amax_bits = amax_bits.max(v.to_bits() & 0x7fff_ffff);
        }
        let amax = f32::from_bits(amax_bits);
        let (d, id) = if amax.is_nan() {
            (f32::NAN, 0.0)
        } else if amax > 0.0 {
            (amax / 127.0, 127.0 / amax)
        } else {
            (0.0, 0.0)
        };
        // |v · id| <= 127 plus a rounding, well inside the magic number's range.
        let mut qi = [0i32; BLOCK];
        for (q, v) in qi.iter_mut().zip(xs) {
            *q = (v * id + ROUND_MAGIC).to_bits() as i32 - magic;
        }
        for (q, v) in qs.iter_mut().zip(qi) {
            *q = v as i8;
        }
        let sum: i32 = qi.iter().sum();
        out.d[i] = d;
        out.sum[i] = sum;
        out.s[i] = d * sum as f32;
    }
    out
}

impl QuantRows {
    /// Row `r`, block `b` dequantised: `q · d_x` (the values the kernel multiplies, as f32).
    pub fn dequantize_block(&self, r: usize, b: usize) -> [f32; BLOCK] {
        let nb = self.cols / BLOCK;
        let d = self.d[r * nb + b];
        let q = &self.q[r * self.cols + b * BLOCK..][..BLOCK];
        std::array::from_fn(|i| q[i] as f32 * d)
    }
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

/// One task: groups `g0 .. g0 + out.len() / (16 m)` for every row, written `out[(gi·m + r)·16 + l]`.
type TaskFn = fn(a: &QuantRows, w: &PackedMatrix, g0: usize, out: &mut [f32]);

/// The product of already quantised rows (`y`: [a.rows, n]).
pub fn matmul_quantized_with(isa: Isa, a: &QuantRows, w: &PackedMatrix, y: &mut [f32]) {
    let (n, k) = w.dims();
    let m = a.rows;
    assert_eq!(a.cols, k, "matmul_q8: x has {} columns, the weight {k}", a.cols);
    assert_eq!(y.len(), m * n, "matmul_q8: y must hold m*n = {m}*{n} values");
    assert!(
        isa.available(),
        "matmul_q8: {isa:?} requested on a CPU without it"
    );
    if m == 0 || n == 0 {
        return;
    }
    let task: TaskFn = match isa {
        Isa::Portable => portable::task,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::task,
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => avxvnni::task,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => avx512vnni::task,
        _ => panic!("matmul_q8 has no {isa:?} variant"),
    };
    let groups = w.groups();
    let parallel =
        (n * k >= PAR_MIN_WEIGHTS || m * n * k >= PAR_MIN_WORK) && rayon::current_num_threads() > 1;
    let tasks = if parallel {
        (4 * rayon::current_num_threads()).min(groups)
    } else {
        1
    };
    let per_task = groups.div_ceil(tasks) * GROUP * m;
    // Tasks write [group][row][16]; with one row and whole groups that is `y` itself.
    let direct = m == 1 && n.is_multiple_of(GROUP);
    let mut buf = if direct {
        Vec::new()
    } else {
        vec![0.0f32; groups * GROUP * m]
    };
    let out: &mut [f32] = if direct { y } else { &mut buf };
    let run = |(i, o): (usize, &mut [f32])| task(a, w, i * per_task / (GROUP * m), o);
    if parallel {
        out.par_chunks_mut(per_task).enumerate().for_each(run);
    } else {
        out.chunks_mut(per_task).enumerate().for_each(run);
    }
    if !direct {
        for (g, gb) in buf.chunks_exact(GROUP * m).enumerate() {
            let lanes = GROUP.min(n - g * GROUP);
            for (r, v) in gb.chunks_exact(GROUP).enumerate() {
                y[r * n + g * GROUP..][..lanes].copy_from_slice(&v[..lanes]);
            }
        }
    }
}

/// The portable path: each group-block unpacked once into signed weights `[32][16]` (outputs innermost,
/// so the integer loops vectorise on any target), then every row of `x` against it.
mod portable {
    use super::*;

    pub(super) fn task(a: &QuantRows, w: &PackedMatrix, g0: usize, out: &mut [f32]) {
        let (m, k, nb) = (a.rows, a.cols, a.cols / BLOCK);
        let (f, st, hb) = (w.format, stride(w.format), heads_bytes(w.format));
        let c = offset(f) as i16;
        let mut wq = [[0i16; GROUP]; BLOCK];
        let (mut dw, mut mw) = ([0f32; GROUP], [0f32; GROUP]);
        for (gi, og) in out.chunks_exact_mut(GROUP * m).enumerate() {
            og.fill(0.0);
            for b in 0..nb {
                let blk = &w.data[((g0 + gi) * nb + b) * st..][..st];
                let q = &blk[hb..];
                for l in 0..GROUP {
                    dw[l] = half::f16::from_le_bytes([blk[2 * l], blk[2 * l + 1]]).to_f32();
                    if f == BlockFormat::Q4_1 {
                        mw[l] = half::f16::from_le_bytes([blk[32 + 2 * l], blk[33 + 2 * l]]).to_f32();
                    }
                    for t in 0..quant_bytes(f) / 64 {
                        for i in 0..4 {
                            let u = q[64 * t + 4 * l + i] as i16;
                            if f == BlockFormat::Q8_0 {
                                wq[4 * t + i][l] = u - c;
                            } else {
                                wq[4 * t + i][l] = (u & 15) - c;
                                wq[16 + 4 * t + i][l] = (u >> 4) - c;
                            }
                        }
                    }
                }
                for (r, acc) in og.chunks_exact_mut(GROUP).enumerate() {
                    let xq = &a.q[r * k + b * BLOCK..][..BLOCK];
                    let mut isum = [0i32; GROUP];
                    for (wk, &xv) in wq.iter().zip(xq) {
                        for (s, &wv) in isum.iter_mut().zip(wk) {
                            *s += wv as i32 * xv as i32;
                        }
                    }
                    let ab = r * nb + b;
                    let (dx, sx) = (a.d[ab], a.s[ab]);
                    for l in 0..GROUP {
                        acc[l] = (dw[l] * dx).mul_add(isum[l] as f32, acc[l]);
                        if f == BlockFormat::Q4_1 {
                            acc[l] = mw[l].mul_add(sx, acc[l]);
                        }
                    }
                }
            }
        }
    }
}

/// The 256-bit x86 variants, one module per instruction set (the same code under different target
/// features; only the integer dot product of a chunk differs). A group's 16 outputs are two halves of
/// 8 lanes, run one after the other; the second re-reads the group's weights from L1.
#[cfg(target_arch = "x86_64")]
macro_rules! avx256_variant {
    ($name:ident, $features:literal, $vnni:literal) => {
        mod $name {
            use super::*;
            use std::arch::x86_64::*;

            pub(super) fn task(a: &QuantRows, w: &PackedMatrix, g0: usize, out: &mut [f32]) {
                // SAFETY: `matmul_quantized_with` picks this variant only if the CPU has its features;
                // `run` stays inside `w`'s groups `g0 ..` that `out` covers and `a`'s rows.
                assert!(out.len() / (GROUP * a.rows) + g0 <= w.groups());
                unsafe {
                    match w.format {
                        BlockFormat::Q4_0 => run::<0>(a, w, g0, out),
                        BlockFormat::Q4_1 => run::<1>(a, w, g0, out),
                        BlockFormat::Q8_0 => run::<2>(a, w, g0, out),
                    }
                }
            }

            const fn format(f: u8) -> BlockFormat {
                match f {
                    0 => BlockFormat::Q4_0,
                    1 => BlockFormat::Q4_1,
                    _ => BlockFormat::Q8_0,
                }
            }

            #[target_feature(enable = $features)]
            unsafe fn run<const F: u8>(a: &QuantRows, w: &PackedMatrix, g0: usize, out: &mut [f32]) {
                let m = a.rows;
                for (gi, og) in out.chunks_exact_mut(GROUP * m).enumerate() {
                    let g = g0 + gi;
                    for h in 0..2 {
                        let mut r0 = 0;
                        while r0 < m {
                            let rows = (m - r0).min(TILE_ROWS);
                            let o = og.as_mut_ptr().add(r0 * GROUP + 8 * h);
                            match rows {
                                1 => tile::<F, 1>(a, w, g, h, r0, o),
                                2 => tile::<F, 2>(a, w, g, h, r0, o),
                                3 => tile::<F, 3>(a, w, g, h, r0, o),
                                4 => tile::<F, 4>(a, w, g, h, r0, o),
                                5 => tile::<F, 5>(a, w, g, h, r0, o),
                                6 => tile::<F, 6>(a, w, g, h, r0, o),
                                7 => tile::<F, 7>(a, w, g, h, r0, o),
                                _ => tile::<F, 8>(a, w, g, h, r0, o),
                            }
                            r0 += rows;
                        }
                    }
                }
            }

            /// Rows `r0 .. r0 + R` against half `h` (lanes `8h .. 8h + 8`) of group `g`; row `r`'s 8
            /// outputs go to `out + r·16`.
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn tile<const F: u8, const R: usize>(
                a: &QuantRows,
                w: &PackedMatrix,
                g: usize,
                h: usize,
                r0: usize,
                out: *mut f32,
            ) {
                let f = format(F);
                let (k, nb, st, hb) = (a.cols, a.cols / BLOCK, stride(f), heads_bytes(f));
                let c = if F == 2 && !$vnni { 0 } else { offset(f) };
                let mut acc = [_mm256_setzero_ps(); R];
                let wg = w.data.as_ptr().add(g * nb * st);
                let low = _mm256_set1_epi8(15);
                for b in 0..nb {
                    let blk = wg.add(b * st);
                    let q = blk.add(hb + 32 * h);
                    // The activation quads of row r, block b: 8 × 4 bytes.
                    let xq = |r: usize| a.q.as_ptr().add((r0 + r) * k + b * BLOCK).cast::<i32>();
                    let mut isum = [_mm256_setzero_si256(); R];
                    if F == 2 {
                        for t in 0..8 {
                            let u = _mm256_loadu_si256(q.add(64 * t).cast());
                            for (r, s) in isum.iter_mut().enumerate() {
                                let xv = _mm256_set1_epi32(xq(r).add(t).read_unaligned());
                                *s = dot_u8_i8(*s, u, xv);
                            }
                        }
                    } else {
                        for t in 0..4 {
                            let v = _mm256_loadu_si256(q.add(64 * t).cast());
                            let lo = _mm256_and_si256(v, low);
                            let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                            for (r, s) in isum.iter_mut().enumerate() {
                                let x0 = _mm256_set1_epi32(xq(r).add(t).read_unaligned());
                                let x1 = _mm256_set1_epi32(xq(r).add(t + 4).read_unaligned());
                                *s = dot_nibbles(*s, lo, x0, hi, x1);
                            }
                        }
                    }
                    let dw = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16 * h).cast()));
                    let mw = if F == 1 {
                        _mm256_cvtph_ps(_mm_loadu_si128(blk.add(32 + 16 * h).cast()))
                    } else {
                        _mm256_setzero_ps()
                    };
                    for (r, (acc_r, s)) in acc.iter_mut().zip(isum).enumerate() {
                        let ab = (r0 + r) * nb + b;
                        let s = finish(s, F);
                        let s = _mm256_sub_epi32(s, _mm256_set1_epi32(c * *a.sum.get_unchecked(ab)));
                        let dwx = _mm256_mul_ps(dw, _mm256_set1_ps(*a.d.get_unchecked(ab)));
                        *acc_r = _mm256_fmadd_ps(dwx, _mm256_cvtepi32_ps(s), *acc_r);
                        if F == 1 {
                            *acc_r = _mm256_fmadd_ps(mw, _mm256_set1_ps(*a.s.get_unchecked(ab)), *acc_r);
                        }
                    }
                }
                for (r, acc_r) in acc.iter().enumerate() {
                    _mm256_storeu_ps(out.add(r * GROUP), *acc_r);
                }
            }

            /// `s + Σ w·x` per 32-bit lane over its 4 byte pairs, from the stored `u = w + 128` and `x`
            /// within ±127: with VNNI `Σ u·x` (the caller subtracts `128·Σx`); without, `maddubs`'s
            /// 16-bit pair sums would saturate for `u` over 128, so it takes `|w| · (x · sign w)`
            /// (pairs within ±32512) and sums `w·x` directly (the caller subtracts nothing).
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn dot_u8_i8(s: __m256i, u: __m256i, x: __m256i) -> __m256i {
                if $vnni {
                    _mm256_dpbusd_avx_epi32(s, u, x)
                } else {
                    let wv = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
                    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(x, wv));
                    _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
                }
            }

            /// `s + Σ lo·x0 + Σ hi·x1` per lane (nibbles 0..15). Without VNNI the products are summed
            /// in 16-bit lanes across the block (at most 16 products of 15·127 per lane, 30480 < 2^15)
            /// and widened in [`finish`].
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn dot_nibbles(s: __m256i, lo: __m256i, x0: __m256i, hi: __m256i, x1: __m256i) -> __m256i {
                if $vnni {
                    _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(s, lo, x0), hi, x1)
                } else {
                    _mm256_add_epi16(
                        s,
                        _mm256_add_epi16(_mm256_maddubs_epi16(lo, x0), _mm256_maddubs_epi16(hi, x1)),
                    )
                }
            }

            /// The i32 lanes of a block's integer sum: as accumulated, or widened from 16-bit pairs.
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn finish(s: __m256i, f: u8) -> __m256i {
                if $vnni || f == 2 {
                    s
                } else {
                    _mm256_madd_epi16(s, _mm256_set1_epi16(1))
                }
            }
        }
    };
}

#[cfg(target_arch = "x86_64")]
avx256_variant!(avx2, "avx2,fma,f16c", false);
#[cfg(target_arch = "x86_64")]
avx256_variant!(avxvnni, "avx2,fma,f16c,avxvnni", true);

/// AVX-512 VNNI: a group's 16 outputs in one register.
#[cfg(target_arch = "x86_64")]
mod avx512vnni {
    use super::*;
    use std::arch::x86_64::*;

    pub(super) fn task(a: &QuantRows, w: &PackedMatrix, g0: usize, out: &mut [f32]) {
        assert!(out.len() / (GROUP * a.rows) + g0 <= w.groups());
        // SAFETY: as the 256-bit variants'.
        unsafe {
            match w.format {
                BlockFormat::Q4_0 => run::<0>(a, w, g0, out),
                BlockFormat::Q4_1 => run::<1>(a, w, g0, out),
                BlockFormat::Q8_0 => run::<2>(a, w, g0, out),
            }
        }
    }

    const fn format(f: u8) -> BlockFormat {
        match f {
            0 => BlockFormat::Q4_0,
            1 => BlockFormat::Q4_1,
            _ => BlockFormat::Q8_0,
        }
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn run<const F: u8>(a: &QuantRows, w: &PackedMatrix, g0: usize, out: &mut [f32]) {
        let m = a.rows;
        for (gi, og) in out.chunks_exact_mut(GROUP * m).enumerate() {
            let g = g0 + gi;
            let mut r0 = 0;
            while r0 < m {
                let rows = (m - r0).min(TILE_ROWS);
                let o = og.as_mut_ptr().add(r0 * GROUP);
                match rows {
                    1 => tile::<F, 1>(a, w, g, r0, o),
                    2 => tile::<F, 2>(a, w, g, r0, o),
                    3 => tile::<F, 3>(a, w, g, r0, o),
                    4 => tile::<F, 4>(a, w, g, r0, o),
                    5 => tile::<F, 5>(a, w, g, r0, o),
                    6 => tile::<F, 6>(a, w, g, r0, o),
                    7 => tile::<F, 7>(a, w, g, r0, o),
                    _ => tile::<F, 8>(a, w, g, r0, o),
                }
                r0 += rows;
            }
        }
    }

    /// Rows `r0 .. r0 + R` against group `g`; row `r`'s 16 outputs go to `out + r·16`.
    #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn tile<const F: u8, const R: usize>(
        a: &QuantRows,
        w: &PackedMatrix,
        g: usize,
        r0: usize,
        out: *mut f32,
    ) {
        let f = format(F);
        let (k, nb, st, hb) = (a.cols, a.cols / BLOCK, stride(f), heads_bytes(f));
        let c = offset(f);
        let mut acc = [_mm512_setzero_ps(); R];
        let wg = w.data.as_ptr().add(g * nb * st);
        let low = _mm512_set1_epi8(15);
        for b in 0..nb {
            let blk = wg.add(b * st);
            let q = blk.add(hb);
            let xq = |r: usize| a.q.as_ptr().add((r0 + r) * k + b * BLOCK).cast::<i32>();
            let mut isum = [_mm512_setzero_si512(); R];
            for (r, s) in isum.iter_mut().enumerate() {
                *s = _mm512_set1_epi32(-c * *a.sum.get_unchecked((r0 + r) * nb + b));
            }
            if F == 2 {
                for t in 0..8 {
                    let u = _mm512_loadu_si512(q.add(64 * t).cast());
                    for (r, s) in isum.iter_mut().enumerate() {
                        *s = _mm512_dpbusd_epi32(*s, u, _mm512_set1_epi32(xq(r).add(t).read_unaligned()));
                    }
                }
            } else {
                for t in 0..4 {
                    let v = _mm512_loadu_si512(q.add(64 * t).cast());
                    let lo = _mm512_and_si512(v, low);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low);
                    for (r, s) in isum.iter_mut().enumerate() {
                        let x0 = _mm512_set1_epi32(xq(r).add(t).read_unaligned());
                        let x1 = _mm512_set1_epi32(xq(r).add(t + 4).read_unaligned());
                        *s = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(*s, lo, x0), hi, x1);
                    }
                }
            }
            let dw = _mm512_cvtph_ps(_mm256_loadu_si256(blk.cast()));
            let mw = if F == 1 {
                _mm512_cvtph_ps(_mm256_loadu_si256(blk.add(32).cast()))
            } else {
                _mm512_setzero_ps()
            };
            for (r, (acc_r, s)) in acc.iter_mut().zip(isum).enumerate() {
                let ab = (r0 + r) * nb + b;
                let dwx = _mm512_mul_ps(dw, _mm512_set1_ps(*a.d.get_unchecked(ab)));
                *acc_r = _mm512_fmadd_ps(dwx, _mm512_cvtepi32_ps(s), *acc_r);
                if F == 1 {
                    *acc_r = _mm512_fmadd_ps(mw, _mm512_set1_ps(*a.s.get_unchecked(ab)), *acc_r);
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            _mm512_storeu_ps(out.add(r * GROUP), *acc_r);
        }
    }
}

/// `x · Wᵀ` for a candle tensor `x` ([m, k], f32, CPU) and a packed matrix `w` ([n, k]): a new [m, n].
///
/// # Errors
/// If `x` is not f32, not on the CPU, not 2-D, or its width is not `w`'s.
pub fn linear_q8(x: &Tensor, w: &PackedMatrix) -> Result<Tensor> {
    if x.dtype() != DType::F32 {
        return Err(Error::UnexpectedDType {
            msg: "linear_q8 takes f32 activations",
            expected: DType::F32,
            got: x.dtype(),
        }
        .bt());
    }
    if !x.device().is_cpu() {
        return Err(Error::Msg("linear_q8 takes CPU tensors".into()).bt());
    }
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims();
    if k != kw {
        return Err(Error::Msg(format!("linear_q8: x has {k} columns, the weight {kw}")).bt());
    }
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let mut y = vec![0.0f32; m * n];
    matmul_q8(&xs, w, &mut y, m);
    Tensor::from_vec(y, (m, n), &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const FORMATS: [BlockFormat; 3] = [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0];

    /// The variants this CPU has, the portable one first.
    fn isas() -> Vec<Isa> {
        let mut v: Vec<Isa> = VARIANTS.into_iter().filter(|i| i.available()).collect();
        v.reverse();
        v
    }

    fn with_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    /// Random blocks: every nibble and byte value (-128 included), scales and minimums random finite
    /// f16 values of either sign.
    fn random_blocks(rng: &mut StdRng, format: BlockFormat, rows: usize, cols: usize) -> BlockMatrix {
        let bb = format.block_bytes();
        let mut data = vec![0u8; rows * cols / BLOCK * bb];
        for blk in data.chunks_exact_mut(bb) {
            rng.fill(&mut blk[..]);
            let heads = if format == BlockFormat::Q4_1 { 2 } else { 1 };
            for h in 0..heads {
                let v = half::f16::from_f32(rng.random_range(-0.05f32..0.05));
                blk[2 * h..2 * h + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        BlockMatrix::new(format, rows, cols, data).unwrap()
    }

    /// Random activations, each block at its own magnitude (1e-3 .. 1e2), some blocks all zero.
    fn random_x(rng: &mut StdRng, len: usize) -> Vec<f32> {
        let mut x: Vec<f32> = (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        for blk in x.chunks_mut(BLOCK) {
            let scale = if rng.random_range(0..10) == 0 {
                0.0
            } else {
                10f32.powf(rng.random_range(-3.0..2.0))
            };
            blk.iter_mut().for_each(|v| *v *= scale);
        }
        x
    }

    fn product(isa: Isa, x: &[f32], w: &PackedMatrix, m: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * w.dims().0];
        matmul_q8_with(isa, x, w, &mut y, m);
        y
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// Every SIMD variant gives the portable path's bits, for shapes that cut tiles and groups
    /// everywhere (1..17 rows, partial last groups, one block). (Products this small run on the calling
    /// thread; `rows_are_invariant` covers split ones.)
    #[test]
    fn variants_are_bit_identical_to_portable() {
        let mut rng = StdRng::seed_from_u64(21);
        let isas = isas();
        assert_eq!(isas[0], Isa::Portable);
        for format in FORMATS {
            for k in [32, 96, 576] {
                for n in [1, 5, 16, 17, 40, 100] {
                    let w = PackedMatrix::pack(&random_blocks(&mut rng, format, n, k));
                    for m in (1..=17).chain([33]) {
                        let x = random_x(&mut rng, m * k);
                        let want = product(Isa::Portable, &x, &w, m);
                        assert!(want.iter().all(|v| v.is_finite()));
                        for &isa in &isas[1..] {
                            let got = product(isa, &x, &w, m);
                            assert!(same_bits(&got, &want), "{isa:?} {format:?} m={m} k={k} n={n}");
                        }
                    }
                }
            }
        }
    }

    /// Each row of a block of 2..16 (and 40) rows is bit-identical to that row alone, on every
    /// variant; and a product split over two threads is bit-identical to one thread's (the weights are
    /// large enough to be split).
    #[test]
    fn rows_are_invariant() {
        let mut rng = StdRng::seed_from_u64(22);
        let (k, n) = (576, 1900);
        assert!(n * k >= PAR_MIN_WEIGHTS);
        for isa in isas() {
            for format in FORMATS {
                let w = PackedMatrix::pack(&random_blocks(&mut rng, format, n, k));
                let x = random_x(&mut rng, 40 * k);
                let alone: Vec<Vec<f32>> = (0..40)
                    .map(|i| with_threads(2, || product(isa, &x[i * k..(i + 1) * k], &w, 1)))
                    .collect();
                for m in (2..=16).chain([40]) {
                    let y = with_threads(2, || product(isa, &x[..m * k], &w, m));
                    for (i, single) in alone.iter().enumerate().take(m) {
                        assert!(
                            same_bits(&y[i * n..(i + 1) * n], single),
                            "{isa:?} {format:?} row {i} of {m}"
                        );
                    }
                    let y1 = with_threads(1, || product(isa, &x[..m * k], &w, m));
                    assert!(same_bits(&y, &y1), "{isa:?} {format:?} {m} rows: 1 vs 2 threads");
                }
            }
        }
    }

    /// The kernel computes the dequantised weights times the dequantised 8-bit activations: against
    /// that product in f64 it is off by no more than f32 rounding; and against the unquantised
    /// activations by no more than the activation rounding (half a step per value).
    #[test]
    fn matches_f64_reference() {
        let mut rng = StdRng::seed_from_u64(23);
        let (m, k, n) = (5, 320, 37);
        for format in FORMATS {
            let bw = random_blocks(&mut rng, format, n, k);
            let wf = bw.dequantize();
            let w = PackedMatrix::pack(&bw);
            let x = random_x(&mut rng, m * k);
            let a = quantize_rows(&x, m, k);
            for isa in isas() {
                let y = product(isa, &x, &w, m);
                for r in 0..m {
                    for j in 0..n {
                        let (mut exact, mut mag, mut unq, mut bound) = (0.0f64, 0.0f64, 0.0f64, 0.0f64);
                        for b in 0..k / BLOCK {
                            let xb = a.dequantize_block(r, b);
                            let d = a.d[r * (k / BLOCK) + b] as f64;
                            for i in 0..BLOCK {
                                let (wv, kk) = (wf[j * k + b * BLOCK + i] as f64, b * BLOCK + i);
                                exact += wv * xb[i] as f64;
                                mag += (wv * xb[i] as f64).abs();
                                unq += wv * x[r * k + kk] as f64;
                                bound += wv.abs() * d * 0.5001;
                            }
                        }
                        let got = y[r * n + j] as f64;
                        assert!(
                            (got - exact).abs() <= 1e-5 * mag + 1e-30,
                            "{isa:?} {format:?} ({r}, {j}): {got} vs {exact} (magnitude {mag})"
                        );
                        assert!(
                            (got - unq).abs() <= bound + 1e-5 * mag + 1e-30,
                            "{isa:?} {format:?} ({r}, {j}): {got} vs unquantised {unq} (bound {bound})"
                        );
                    }
                }
            }
        }
    }

    /// The pinned activation rounding: scale `amax / 127`, ties to even, zero blocks, NaN blocks.
    #[test]
    fn activation_quantisation_rounds_half_to_even() {
        // amax = 127: the multiplier is exactly 1, so the halves are ties.
        let mut x = [0.0f32; BLOCK];
        let ties = [0.5f32, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 127.0, 3.25];
        x[..ties.len()].copy_from_slice(&ties);
        let a = quantize_rows(&x, 1, BLOCK);
        assert_eq!(&a.q[..ties.len()], &[0, 2, 2, 0, -2, -2, 126, -126, 127, 3]);
        assert_eq!(a.d[0], 1.0);
        assert_eq!(a.sum[0], 130);
        assert_eq!(a.s[0], a.sum[0] as f32);
        let a = quantize_rows(&[0.0; BLOCK], 1, BLOCK);
        assert!(a.q.iter().all(|&q| q == 0) && a.d[0] == 0.0);
        let mut x = [1.0f32; BLOCK];
        x[3] = f32::NAN;
        assert!(quantize_rows(&x, 1, BLOCK).d[0].is_nan());
        // Random blocks: within ±127 and within half a step of the input.
        let mut rng = StdRng::seed_from_u64(24);
        let x = random_x(&mut rng, 64 * BLOCK);
        let a = quantize_rows(&x, 2, 32 * BLOCK);
        for (i, &v) in x.iter().enumerate() {
            let (r, b) = (i / (32 * BLOCK), (i % (32 * BLOCK)) / BLOCK);
            let d = a.d[r * 32 + b];
            let q = a.q[i];
            assert!(q != -128);
            assert!((q as f32 * d - v).abs() <= 0.5001 * d, "{v} -> {q} × {d}");
        }
    }

    #[test]
    fn linear_q8_checks_its_inputs() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(25);
        let w = PackedMatrix::pack(&random_blocks(&mut rng, BlockFormat::Q4_1, 3, 64));
        let xv = random_x(&mut rng, 2 * 64);
        let x = Tensor::from_vec(xv.clone(), (2, 64), &Device::Cpu)?;
        let y = linear_q8(&x, &w)?;
        assert_eq!(y.dims(), &[2, 3]);
        assert!(same_bits(
            &y.flatten_all()?.to_vec1::<f32>()?,
            &product(default_isa(), &xv, &w, 2)
        ));
        assert!(linear_q8(&x.to_dtype(DType::F16)?, &w).is_err());
        assert!(linear_q8(&x.narrow(1, 0, 32)?, &w).is_err());
        Ok(())
    }

    /// `cargo test --release --lib q8matmul::tests::handoff -- --ignored --nocapture`: µs per call of
    /// SmolLM2's products (weights cycled through 30 copies, as in a decoding step) on the calling
    /// thread alone and on rayon's global pool called from outside it (as the decode loop calls).
    #[test]
    #[ignore]
    fn handoff() {
        let mut rng = StdRng::seed_from_u64(27);
        let alone = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        println!("n, k, m: us per call on 1 thread, on the global pool from outside");
        for (format, n, k) in [
            (BlockFormat::Q4_1, 192, 576),
            (BlockFormat::Q4_1, 576, 576),
            (BlockFormat::Q4_1, 1536, 576),
            (BlockFormat::Q4_1, 576, 1536),
        ] {
            let w: Vec<PackedMatrix> = (0..30)
                .map(|_| PackedMatrix::pack(&random_blocks(&mut rng, format, n, k)))
                .collect();
            for m in [1, 2, 4, 8, 16] {
                let x = random_x(&mut rng, m * k);
                let mut y = vec![0.0f32; m * n];
                let mut i = 0;
                let mut time = || {
                    1e3 * crate::kernels::median_ms(0.1, || {
                        i = (i + 1) % w.len();
                        matmul_q8(&x, &w[i], &mut y, m)
                    })
                };
                let one = alone.install(&mut time);
                let two = time();
                println!("{n:5} {k:5} {m:3}: {one:8.1} {two:8.1}");
            }
        }
    }

    /// `cargo test --release --lib q8matmul::tests::timing -- --ignored --nocapture`: ms per call
    /// (median of 9) of the f32-activation block kernel and of this kernel on every variant, for
    /// SmolLM2's shapes, weights cycled through 30 copies so that they come from memory.
    #[test]
    #[ignore]
    fn timing() {
        let mut rng = StdRng::seed_from_u64(26);
        for (format, n, k, copies) in [
            (BlockFormat::Q4_1, 1536, 576, 30),
            (BlockFormat::Q4_1, 576, 1536, 30),
            (BlockFormat::Q8_0, 49152, 576, 1),
        ] {
            let blocks: Vec<BlockMatrix> = (0..copies)
                .map(|_| random_blocks(&mut rng, format, n, k))
                .collect();
            let packed: Vec<PackedMatrix> = blocks.iter().map(PackedMatrix::pack).collect();
            let isas = isas();
            println!("{format:?} n={n} k={k} x{copies}: m, ms per call: f32 activations, q8 {isas:?}");
            for m in [1, 2, 4, 8, 16, 32] {
                let x = random_x(&mut rng, m * k);
                let mut y = vec![0.0f32; m * n];
                let mut i = 0;
                let f = crate::kernels::median_ms(0.05, || {
                    i = (i + 1) % copies;
                    crate::kernels::matmul_blocks(&x, &blocks[i], &mut y, m)
                });
                print!("{m:4} {f:9.4}");
                for &isa in &isas {
                    let t = crate::kernels::median_ms(0.05, || {
                        i = (i + 1) % copies;
                        matmul_q8_with(isa, &x, &packed[i], &mut y, m)
                    });
                    print!(" {t:9.4}");
                }
                println!();
            }
        }
    }
}
