//! Step 1 of the recipe: activation rows quantised to 8 bits per block of 32 ([`QuantRows`]), by one
//! portable rule written out for AVX-512 and AVX2 (the same bits on every path).

use super::format::offset;
use super::plan::QUANTIZE_PAR_MIN;
use super::PackedFormat;
use crate::kernels::qmatmul::BLOCK;

/// Activation rows quantised per block of 32 (step 1 of the module's recipe).
#[derive(Clone, Debug, Default)]
pub struct QuantRows {
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// `[rows, cols]` int8 values.
    pub(super) q: Vec<i8>,
    /// Per row and block: the scale `d_x`.
    pub(super) d: Vec<f32>,
    /// Per row and block: `Σq`, and over the block's first 16 values (what `s` and `starts` are made
    /// from).
    pub(super) sum: Vec<i32>,
    pub(super) sum_lo: Vec<i32>,
    /// Per row and block: `d_x · f32(Σq)`.
    pub(super) s: Vec<f32>,
    /// Per row and block: the integer sums' starting values `-c·Σq` for the formats with an offset
    /// `c` ([`offset`]), at [`start_slot`], so that the SIMD kernels load them (a broadcast from memory)
    /// instead of computing them for every tile of outputs (a multiply and a move into a vector
    /// register per row and block, which the 8-row Q6_K tiles felt).
    pub(super) starts: Vec<[i32; 4]>,
}

/// Where [`QuantRows`]' `starts` keep the starting value for format `f` (one with an [`offset`]) and,
/// for Q6_K, the block's half `half`.
pub(super) const fn start_slot(f: PackedFormat, half: usize) -> usize {
    match f {
        PackedFormat::Q4_0 => 0,
        PackedFormat::Q8_0 => 1,
        _ => 2 + half,
    }
}

/// A block's `starts` from its sums `Σq` and `sum_lo` (over its first 16 values), slot by slot as
/// [`start_slot`] places them. Wrapping: only a NaN block's garbage sums could overflow.
fn block_starts(sum: i32, sum_lo: i32) -> [i32; 4] {
    let c = |f| offset(f).wrapping_neg();
    [
        c(PackedFormat::Q4_0).wrapping_mul(sum),
        c(PackedFormat::Q8_0).wrapping_mul(sum),
        c(PackedFormat::Q6K).wrapping_mul(sum_lo),
        c(PackedFormat::Q6K).wrapping_mul(sum.wrapping_sub(sum_lo)),
    ]
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
    let mut out = QuantRows::default();
    quantize_rows_into(&mut out, x, rows, cols);
    out
}

/// [`quantize_rows`] into `out`, reusing its buffers: a decoding step quantises four inputs a layer,
/// which would otherwise take five fresh vectors each.
///
/// # Panics
/// As [`quantize_rows`].
pub fn quantize_rows_into(out: &mut QuantRows, x: &[f32], rows: usize, cols: usize) {
    assert!(cols.is_multiple_of(BLOCK), "quantize_rows: {cols} columns");
    assert_eq!(
        x.len(),
        rows * cols,
        "quantize_rows: x must hold rows*cols values"
    );
    let blocks = rows * cols / BLOCK;
    // Every value is written below; `resize` only fills what the buffers grow by.
    (out.rows, out.cols) = (rows, cols);
    out.q.resize(rows * cols, 0);
    out.d.resize(blocks, 0.0);
    out.sum.resize(blocks, 0);
    out.sum_lo.resize(blocks, 0);
    out.s.resize(blocks, 0.0);
    out.starts.resize(blocks, [0; 4]);
    // Rows split over the kernel pool when there are enough of them (each block is quantised alone,
    // so the split cannot change a value).
    let pool = crate::kernels::pool::Pool::global();
    let per_task = if rows * cols >= QUANTIZE_PAR_MIN {
        rows.div_ceil(pool.threads())
    } else {
        rows.max(1)
    };
    let nb = cols / BLOCK;
    let q = crate::kernels::pool::SharedMut::new(&mut out.q);
    let d = crate::kernels::pool::SharedMut::new(&mut out.d);
    let sum = crate::kernels::pool::SharedMut::new(&mut out.sum);
    let sum_lo = crate::kernels::pool::SharedMut::new(&mut out.sum_lo);
    let sc = crate::kernels::pool::SharedMut::new(&mut out.s);
    let starts = crate::kernels::pool::SharedMut::new(&mut out.starts);
    pool.run(rows.div_ceil(per_task), &|t| {
        let (r0, r1) = (t * per_task, ((t + 1) * per_task).min(rows));
        let (b0, b1) = (r0 * nb, r1 * nb);
        // SAFETY: task t writes rows r0..r1 (their blocks b0..b1) only.
        let blocks = unsafe {
            Blocks {
                q: q.range(b0 * BLOCK, (b1 - b0) * BLOCK),
                d: d.range(b0, b1 - b0),
                sum: sum.range(b0, b1 - b0),
                sum_lo: sum_lo.range(b0, b1 - b0),
                s: sc.range(b0, b1 - b0),
                starts: starts.range(b0, b1 - b0),
            }
        };
        quantize_blocks_with(&x[r0 * cols..r1 * cols], blocks);
    });
}

/// The outputs of [`quantize_rows`] for a run of blocks.
pub(super) struct Blocks<'a> {
    pub(super) q: &'a mut [i8],
    pub(super) d: &'a mut [f32],
    pub(super) sum: &'a mut [i32],
    pub(super) sum_lo: &'a mut [i32],
    pub(super) s: &'a mut [f32],
    pub(super) starts: &'a mut [[i32; 4]],
}

impl Blocks<'_> {
    /// The blocks of `x`, checked to fit these outputs.
    fn fit(&self, x: &[f32]) -> usize {
        let n = x.len() / BLOCK;
        assert!(self.q.len() >= n * BLOCK && self.d.len() >= n && self.s.len() >= n);
        assert!(self.sum.len() >= n && self.sum_lo.len() >= n && self.starts.len() >= n);
        n
    }

    /// Block `i`'s scale and sums, and `s = d · Σq` and the [`block_starts`] from them.
    ///
    /// # Safety
    /// `i` below [`Blocks::fit`]'s count.
    #[inline(always)]
    unsafe fn set_block(&mut self, i: usize, d: f32, sum: i32, sum_lo: i32) {
        *self.d.get_unchecked_mut(i) = d;
        *self.sum.get_unchecked_mut(i) = sum;
        *self.sum_lo.get_unchecked_mut(i) = sum_lo;
        *self.s.get_unchecked_mut(i) = d * sum as f32;
        *self.starts.get_unchecked_mut(i) = block_starts(sum, sum_lo);
    }
}

/// [`quantize_blocks`] on the widest vectors the CPU has
/// ([`Width::best`](crate::kernels::attention::Width::best), detected once), written out for AVX-512 and
/// AVX2 ([`quantize_blocks_avx512`], [`quantize_blocks_avx2`]) and aarch64's NEON: the compiler's
/// vectorisation of the portable loop was slow enough to show in a prefill and in decoding. The same
/// IEEE and integer operations on every path: the same bits (tested).
pub(super) fn quantize_blocks_with(x: &[f32], out: Blocks) {
    #[cfg(target_arch = "x86_64")]
    {
        use crate::kernels::attention::Width;
        match Width::best() {
            // SAFETY: `Width::best` only names a width the CPU has (W512: Isa::Avx512, AVX-512 F/VL;
            // W256: AVX2 and FMA).
            Width::W512 => return unsafe { quantize_blocks_avx512(x, out) },
            Width::W256 => return unsafe { quantize_blocks_avx2(x, out) },
            Width::Portable => {}
        }
    }
    // SAFETY: NEON is part of the aarch64 baseline.
    #[cfg(target_arch = "aarch64")]
    unsafe {
        quantize_blocks_neon(x, out)
    };
    #[cfg(not(target_arch = "aarch64"))]
    quantize_blocks(x, out);
}

/// [`quantize_blocks`] in NEON, a block of 32 values as eight vectors, step for step as the AVX2 path:
/// the largest magnitude as an integer maximum of the bits, `v · (1/d)` then `+ ROUND_MAGIC` (two
/// roundings), the integers narrowed to their low bytes without saturation (as `as i8`), and the sums
/// wrapping in integers.
///
/// # Safety
/// NEON (every aarch64 CPU).
#[cfg(target_arch = "aarch64")]
#[target_feature(enable = "neon")]
pub(super) unsafe fn quantize_blocks_neon(x: &[f32], mut out: Blocks) {
    use std::arch::aarch64::*;
    let n = out.fit(x);
    let abs = vdupq_n_u32(0x7fff_ffff);
    let magic = vdupq_n_f32(ROUND_MAGIC);
    let magic_bits = vdupq_n_s32(ROUND_MAGIC.to_bits() as i32);
    for i in 0..n {
        let p = x.as_ptr().add(i * BLOCK);
        let v: [float32x4_t; 8] = std::array::from_fn(|j| vld1q_f32(p.add(4 * j)));
        let mag = |j: usize| vandq_u32(vreinterpretq_u32_f32(v[j]), abs);
        let bits = vmaxq_u32(
            vmaxq_u32(vmaxq_u32(mag(0), mag(1)), vmaxq_u32(mag(2), mag(3))),
            vmaxq_u32(vmaxq_u32(mag(4), mag(5)), vmaxq_u32(mag(6), mag(7))),
        );
        let amax = f32::from_bits(vmaxvq_u32(bits));
        let (d, id) = block_scale(amax);
        let id = vdupq_n_f32(id);
        let qi: [int32x4_t; 8] = std::array::from_fn(|j| {
            vsubq_s32(
                vreinterpretq_s32_f32(vaddq_f32(vmulq_f32(v[j], id), magic)),
                magic_bits,
            )
        });
        let bytes = |a: usize| {
            let lo = vcombine_s16(vmovn_s32(qi[a]), vmovn_s32(qi[a + 1]));
            let hi = vcombine_s16(vmovn_s32(qi[a + 2]), vmovn_s32(qi[a + 3]));
            vcombine_s8(vmovn_s16(lo), vmovn_s16(hi))
        };
        let q = out.q.as_mut_ptr().add(i * BLOCK);
        vst1q_s8(q, bytes(0));
        vst1q_s8(q.add(16), bytes(4));
        let sum_lo = vaddvq_s32(vaddq_s32(vaddq_s32(qi[0], qi[1]), vaddq_s32(qi[2], qi[3])));
        let sum_hi = vaddvq_s32(vaddq_s32(vaddq_s32(qi[4], qi[5]), vaddq_s32(qi[6], qi[7])));
        out.set_block(i, d, sum_lo.wrapping_add(sum_hi), sum_lo);
    }
}

/// [`quantize_blocks`] in AVX-512, a block of 32 values as two vectors: the largest magnitude as an
/// integer maximum of the bits, `d` and `1/d` as the portable code takes them, `v · (1/d)` then `+
/// ROUND_MAGIC` (two roundings, as the portable code, which Rust never fuses), the integers truncated to
/// bytes (`vpmovdb`, as `as i8`), and the sums exact in integers.
///
/// # Safety
/// The CPU must have AVX-512 F and VL ([`Isa::Avx512`](crate::kernels::Isa::Avx512)).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
pub(super) unsafe fn quantize_blocks_avx512(x: &[f32], mut out: Blocks) {
    use std::arch::x86_64::*;
    let n = out.fit(x);
    let abs = _mm512_set1_epi32(0x7fff_ffff);
    let magic = _mm512_set1_ps(ROUND_MAGIC);
    let magic_bits = _mm512_set1_epi32(ROUND_MAGIC.to_bits() as i32);
    for i in 0..n {
        let p = x.as_ptr().add(i * BLOCK);
        let (lo, hi) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
        let bits = _mm512_max_epu32(
            _mm512_and_si512(_mm512_castps_si512(lo), abs),
            _mm512_and_si512(_mm512_castps_si512(hi), abs),
        );
        let amax = f32::from_bits(_mm512_reduce_max_epu32(bits));
        let (d, id) = block_scale(amax);
        let id = _mm512_set1_ps(id);
        let round = |v: __m512| {
            _mm512_sub_epi32(
                _mm512_castps_si512(_mm512_add_ps(_mm512_mul_ps(v, id), magic)),
                magic_bits,
            )
        };
        let (qlo, qhi) = (round(lo), round(hi));
        let q = out.q.as_mut_ptr().add(i * BLOCK);
        _mm_storeu_si128(q.cast(), _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128(q.add(16).cast(), _mm512_cvtepi32_epi8(qhi));
        let sum_lo = _mm512_reduce_add_epi32(qlo);
        let sum = sum_lo.wrapping_add(_mm512_reduce_add_epi32(qhi));
        out.set_block(i, d, sum, sum_lo);
    }
}

/// [`quantize_blocks`] in AVX2, a block of 32 values as four vectors, step for step as
/// [`quantize_blocks_avx512`]. The integers are cut to their low bytes (as `as i8`: masked to a byte,
/// then packed without saturation taking effect) rather than packed with saturation, which would
/// differ from the portable code on a NaN or infinite block's garbage integers.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_blocks_avx2(x: &[f32], mut out: Blocks) {
    use std::arch::x86_64::*;
    let n = out.fit(x);
    let abs = _mm256_set1_epi32(0x7fff_ffff);
    let byte = _mm256_set1_epi32(0xff);
    let magic = _mm256_set1_ps(ROUND_MAGIC);
    let magic_bits = _mm256_set1_epi32(ROUND_MAGIC.to_bits() as i32);
    // `packus` interleaves its two sources per 128-bit lane: this puts the 32 bytes back in order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let hmax = |v: __m256i| {
        let v = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let v = _mm_max_epu32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
        _mm_cvtsi128_si32(_mm_max_epu32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v))) as u32
    };
    let hsum = |v: __m256i| {
        let v = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
        _mm_cvtsi128_si32(_mm_add_epi32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v)))
    };
    for i in 0..n {
        let p = x.as_ptr().add(i * BLOCK);
        let v: [__m256; 4] = std::array::from_fn(|j| _mm256_loadu_ps(p.add(8 * j)));
        let mag = |j: usize| _mm256_and_si256(_mm256_castps_si256(v[j]), abs);
        let bits = _mm256_max_epu32(_mm256_max_epu32(mag(0), mag(1)), _mm256_max_epu32(mag(2), mag(3)));
        let amax = f32::from_bits(hmax(bits));
        let (d, id) = block_scale(amax);
        let id = _mm256_set1_ps(id);
        let qi: [__m256i; 4] = std::array::from_fn(|j| {
            _mm256_sub_epi32(
                _mm256_castps_si256(_mm256_add_ps(_mm256_mul_ps(v[j], id), magic)),
                magic_bits,
            )
        });
        let low = |j: usize| _mm256_and_si256(qi[j], byte);
        let words = [
            _mm256_packus_epi32(low(0), low(1)),
            _mm256_packus_epi32(low(2), low(3)),
        ];
        let bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(words[0], words[1]), order);
        _mm256_storeu_si256(out.q.as_mut_ptr().add(i * BLOCK).cast(), bytes);
        let sum_lo = hsum(_mm256_add_epi32(qi[0], qi[1]));
        let sum = sum_lo.wrapping_add(hsum(_mm256_add_epi32(qi[2], qi[3])));
        out.set_block(i, d, sum, sum_lo);
    }
}

/// A block's scale `d = amax / 127` and its multiplier `127 / amax` (NaN and 0 where the block holds a
/// NaN, both 0 for an all-zero block), shared by every quantisation path.
#[inline(always)]
fn block_scale(amax: f32) -> (f32, f32) {
    if amax.is_nan() {
        (f32::NAN, 0.0)
    } else if amax > 0.0 {
        (amax / 127.0, 127.0 / amax)
    } else {
        (0.0, 0.0)
    }
}

#[inline(always)]
#[cfg_attr(target_arch = "aarch64", allow(dead_code))] // there the tests' reference only
pub(super) fn quantize_blocks(x: &[f32], mut out: Blocks) {
    let n = out.fit(x);
    let magic = ROUND_MAGIC.to_bits() as i32;
    for (i, xs) in x.chunks_exact(BLOCK).enumerate() {
        let xs: &[f32; BLOCK] = xs.try_into().unwrap();
        // The largest magnitude as bits: integer order is magnitude order for non-negative floats,
        // and every NaN sorts above infinity.
        let mut amax_bits = 0u32;
        for v in xs {
            amax_bits = amax_bits.max(v.to_bits() & 0x7fff_ffff);
        }
        let amax = f32::from_bits(amax_bits);
        let (d, id) = block_scale(amax);
        // |v · id| <= 127 plus a rounding, well inside the magic number's range.
        let mut qi = [0i32; BLOCK];
        for (q, v) in qi.iter_mut().zip(xs) {
            *q = (v * id + ROUND_MAGIC).to_bits() as i32 - magic;
        }
        for (q, v) in out.q[i * BLOCK..][..BLOCK].iter_mut().zip(qi) {
            *q = v as i8;
        }
        let sum_lo: i32 = qi[..16].iter().sum();
        let sum = sum_lo + qi[16..].iter().sum::<i32>();
        debug_assert!(i < n);
        // SAFETY: `i` counts x's blocks, `n` of them, the count `fit` checked the outputs against.
        unsafe { out.set_block(i, d, sum, sum_lo) };
    }
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
