//! Keys transposed for the scores: a unit's keys from rows into `[head_dim][keys]`, 16 x 16 blocks at a
//! time on AVX-512 and 8 x 8 on AVX2 (pure data movement: the same values however it is done).

use super::layout::PREFETCH_KEYS;
use super::problem::Problem;
#[cfg(target_arch = "x86_64")]
use super::LANES;
use super::{KvElement, Width};
use crate::kernels::prefetch_l1;

impl<E: KvElement> Problem<'_, E> {
    /// `kt[d · kp + j - keys.start] = k_j[d]` for the `keys` of head `kvh` (columns past them keep
    /// whatever they held: their scores are never read). Pure data movement, so how it is done
    /// cannot change a result.
    #[inline(always)]
    pub(super) fn transpose_keys(
        &self,
        width: Width,
        kd: &[f32],
        kvh: usize,
        keys: std::ops::Range<usize>,
        kp: usize,
        kt: &mut Vec<f32>,
    ) {
        let (hd, lo, hi) = (self.shape.hd, keys.start, keys.end);
        if kt.len() < hd * kp {
            kt.resize(hd * kp, 0.0);
        }
        let src = |j: usize, d: usize| j * self.shape.row_stride + kvh * hd + d;
        // The head's key rows PREFETCH_KEYS on, asked for as each block of keys is moved.
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_variables))]
        let prefetch = |j0: usize, n: usize| {
            for j in j0 + PREFETCH_KEYS..(j0 + PREFETCH_KEYS + n).min(hi) {
                prefetch_l1(kd.as_ptr().wrapping_add(src(j, 0)).cast(), 4 * hd);
            }
        };
        #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
        let mut j0 = lo;
        #[cfg(target_arch = "x86_64")]
        if width == Width::W512 && hd.is_multiple_of(LANES) {
            while j0 + LANES <= hi {
                prefetch(j0, LANES);
                for d0 in (0..hd).step_by(LANES) {
                    let from = &kd[src(j0, d0)..src(j0 + LANES - 1, d0) + LANES];
                    let to = &mut kt[d0 * kp + j0 - lo..(d0 + LANES - 1) * kp + j0 - lo + LANES];
                    // SAFETY: W512 was checked by the caller; both slices span the 16 x 16 block.
                    unsafe { transpose16_avx512(from, self.shape.row_stride, to, kp) };
                }
                j0 += LANES;
            }
        }
        #[cfg(target_arch = "x86_64")]
        if width == Width::W256 && hd.is_multiple_of(8) {
            while j0 + 8 <= hi {
                prefetch(j0, 8);
                for d0 in (0..hd).step_by(8) {
                    let from = &kd[src(j0, d0)..src(j0 + 7, d0) + 8];
                    let to = &mut kt[d0 * kp + j0 - lo..(d0 + 7) * kp + j0 - lo + 8];
                    // SAFETY: W256 (AVX2) was checked by the caller; both slices span the 8 x 8 block.
                    unsafe { transpose8_avx(from, self.shape.row_stride, to, kp) };
                }
                j0 += 8;
            }
        }
        let _ = width;
        for j in j0..hi {
            for d in 0..hd {
                kt[d * kp + j - lo] = kd[src(j, d)];
            }
        }
    }
}

/// An 8 x 8 block transposed: `to[d · to_stride + j] = from[j · from_stride + d]`.
///
/// # Safety
/// The CPU must have AVX; `from` must hold 8 rows of 8 at `from_stride`, `to` 8 of 8 at `to_stride`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx")]
unsafe fn transpose8_avx(from: &[f32], from_stride: usize, to: &mut [f32], to_stride: usize) {
    use std::arch::x86_64::*;
    assert!(from.len() >= 7 * from_stride + 8 && to.len() >= 7 * to_stride + 8);
    let r: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(from.as_ptr().add(i * from_stride)));
    // Within 128-bit halves: rows interleaved by 32 bits, then 64; then the halves exchanged.
    let t: [__m256; 8] = std::array::from_fn(|i| {
        let (a, b) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm256_unpacklo_ps(a, b)
        } else {
            _mm256_unpackhi_ps(a, b)
        }
    });
    // u[4g + c]: column c (and c + 4 in the upper half) of rows 4g .. 4g + 4.
    let mut u = [_mm256_setzero_ps(); 8];
    for g in 0..2 {
        let (a, b, c, d) = (t[4 * g], t[4 * g + 1], t[4 * g + 2], t[4 * g + 3]);
        u[4 * g] = _mm256_shuffle_ps::<0x44>(a, c);
        u[4 * g + 1] = _mm256_shuffle_ps::<0xee>(a, c);
        u[4 * g + 2] = _mm256_shuffle_ps::<0x44>(b, d);
        u[4 * g + 3] = _mm256_shuffle_ps::<0xee>(b, d);
    }
    let out = to.as_mut_ptr();
    for c in 0..4 {
        _mm256_storeu_ps(
            out.add(c * to_stride),
            _mm256_permute2f128_ps::<0x20>(u[c], u[4 + c]),
        );
        _mm256_storeu_ps(
            out.add((c + 4) * to_stride),
            _mm256_permute2f128_ps::<0x31>(u[c], u[4 + c]),
        );
    }
}

/// A 16 x 16 block transposed: `to[d · to_stride + j] = from[j · from_stride + d]`.
///
/// # Safety
/// The CPU must have AVX-512F; `from` must hold 16 rows of 16 at `from_stride`, `to` 16 of 16 at
/// `to_stride`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16_avx512(from: &[f32], from_stride: usize, to: &mut [f32], to_stride: usize) {
    use std::arch::x86_64::*;
    assert!(from.len() >= 15 * from_stride + 16 && to.len() >= 15 * to_stride + 16);
    let r: [__m512; 16] = std::array::from_fn(|i| _mm512_loadu_ps(from.as_ptr().add(i * from_stride)));
    // Pairs of rows interleaved by 32 bits, then by 64: u[4i + c] holds, in 128-bit lane L, column
    // c + 4L of rows 4i .. 4i + 4.
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let pd = _mm512_castps_pd;
    let mut u = [_mm512_setzero_ps(); 16];
    for i in 0..4 {
        let (a, b, c, d) = (t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]);
        u[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a), pd(c)));
        u[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a), pd(c)));
        u[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(b), pd(d)));
        u[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(b), pd(d)));
    }
    // Then 128-bit lanes gathered across row groups: whole columns.
    let out = to.as_mut_ptr();
    for c in 0..4 {
        let w88 = _mm512_shuffle_f32x4::<0x88>(u[c], u[4 + c]);
        let wdd = _mm512_shuffle_f32x4::<0xdd>(u[c], u[4 + c]);
        let x88 = _mm512_shuffle_f32x4::<0x88>(u[8 + c], u[12 + c]);
        let xdd = _mm512_shuffle_f32x4::<0xdd>(u[8 + c], u[12 + c]);
        _mm512_storeu_ps(out.add(c * to_stride), _mm512_shuffle_f32x4::<0x88>(w88, x88));
        _mm512_storeu_ps(
            out.add((c + 8) * to_stride),
            _mm512_shuffle_f32x4::<0xdd>(w88, x88),
        );
        _mm512_storeu_ps(
            out.add((c + 4) * to_stride),
            _mm512_shuffle_f32x4::<0x88>(wdd, xdd),
        );
        _mm512_storeu_ps(
            out.add((c + 12) * to_stride),
            _mm512_shuffle_f32x4::<0xdd>(wdd, xdd),
        );
    }
}
