//! The scores and weighted sums written out in AVX2. Left to the compiler, code shared with AVX-512's
//! 32 registers (16 sums of 16 lanes) spilled sums to the stack on AVX2's 16 and split rows of 32 sums
//! 1 + 8 + 8 + 8 + 4 + 2 + 1 with the loaded keys shuffled to match, and most of the attention time
//! went to those reloads and shuffles. Here every pass keeps 8 sums (of 8 lanes) in
//! registers beside the vectors they share: two slots x 32 keys or dimensions, or one slot x 64. Each sum
//! is the same fused multiply-add chain, in the same order, as the portable code's.

use super::layout::{KeyLayout, KeyList, Values};
use super::*;
use std::arch::x86_64::*;

/// 16 values from `p` as f32, in two vectors. A bf16 is the top half of its f32, so one unpack
/// with zeros widens 8 of them exactly (a widening and a shift took two operations per 8, which
/// competed with the fused multiply-adds for the vector pipes); the unpacks work within 128-bit
/// halves, so the lanes hold values 0-3, 8-11 and 4-7, 12-15. f32 values come in order. Each lane
/// is its own chain, so the order changes no result; [`reorder`] maps sums between it and the
/// natural one.
#[inline(always)]
unsafe fn load16<E: KvElement>(p: *const E) -> [__m256; 2] {
    if size_of::<E>() == 2 {
        let (x, zero) = (_mm256_loadu_si256(p.cast()), _mm256_setzero_si256());
        [
            _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x)),
            _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x)),
        ]
    } else {
        let p = p.cast::<f32>();
        [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
    }
}

/// Two vectors of 16 sums between [`load16`]'s lane order for `E` and the natural one (the same
/// exchange of 128-bit halves either way).
#[inline(always)]
unsafe fn reorder<E: KvElement>([a, b]: [__m256; 2]) -> [__m256; 2] {
    if size_of::<E>() == 2 {
        [
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        ]
    } else {
        [a, b]
    }
}

/// [`super::score::score_all`]: a [`KEY_CHUNK`] of keys at a time, two slots over 32 of its keys per pass
/// (a last slot alone over all of them), the chunk only as wide as its keys in whole 16s.
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn score_all<'q, K: KvElement>(
    slots: usize,
    q: impl Fn(usize) -> &'q [f32],
    (kt, layout): (&[K], KeyLayout),
    keys: std::ops::Range<usize>,
    (scores, kp): (&mut [f32], usize),
) {
    let (hd, lo, hi) = (q(0).len(), keys.start, keys.end);
    for j0 in (lo..hi).step_by(KEY_CHUNK) {
        let w = (hi - j0).min(KEY_CHUNK).next_multiple_of(LANES);
        // The chunk's keys and scores from their start.
        let (at, ks) = layout.chunk(j0);
        let kt = &kt[at..];
        assert!((hd - 1) * ks + w <= kt.len() && (slots - 1) * kp + j0 - lo + w <= scores.len());
        // The next chunk's keys are asked for while this one is scored.
        let mut ahead = (j0 + KEY_CHUNK < hi).then(|| layout.chunk(j0 + KEY_CHUNK).0 - at);
        let mut slot = 0;
        while slot < slots {
            let out = scores.as_mut_ptr().add(slot * kp + j0 - lo);
            if slot + 1 < slots {
                let qs = [q(slot), q(slot + 1)];
                for j in (0..w).step_by(32) {
                    match (w - j).min(32) {
                        32 => block::<2, 4, K>(qs, kt, ks, j, out, kp, ahead),
                        _ => block::<2, 2, K>(qs, kt, ks, j, out, kp, ahead),
                    }
                    ahead = None;
                }
                slot += 2;
            } else {
                let qs = [q(slot)];
                match w {
                    64 => block::<1, 8, K>(qs, kt, ks, 0, out, kp, ahead),
                    48 => block::<1, 6, K>(qs, kt, ks, 0, out, kp, ahead),
                    32 => block::<1, 4, K>(qs, kt, ks, 0, out, kp, ahead),
                    _ => block::<1, 2, K>(qs, kt, ks, 0, out, kp, ahead),
                }
                ahead = None;
                slot += 1;
            }
        }
    }
}

/// Scores of N slots over the `8 V` keys from `j`, written at `out + i · kp + j`.
///
/// # Safety
/// AVX2 and FMA; the keys `j .. j + 8 V` of every one of the `qs[0].len()` rows of `kt` lie within
/// it, and `out` has room for row N - 1's.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn block<const N: usize, const V: usize, K: KvElement>(
    qs: [&[f32]; N],
    kt: &[K],
    ks: usize,
    j: usize,
    out: *mut f32,
    kp: usize,
    ahead: Option<usize>,
) {
    let mut acc = [[_mm256_setzero_ps(); V]; N];
    for d in 0..qs[0].len() {
        if let Some(a) = ahead {
            super::super::prefetch_l1(
                kt.as_ptr().wrapping_add(d * ks + a).cast(),
                size_of::<K>() * KEY_CHUNK,
            );
        }
        let k = kt.as_ptr().add(d * ks + j);
        let mut x = [_mm256_setzero_ps(); V];
        for g in (0..V).step_by(2) {
            [x[g], x[g + 1]] = load16(k.add(8 * g));
        }
        for (ai, qi) in acc.iter_mut().zip(&qs) {
            let qd = _mm256_set1_ps(*qi.get_unchecked(d));
            for (ag, &xg) in ai.iter_mut().zip(&x) {
                *ag = _mm256_fmadd_ps(qd, xg, *ag);
            }
        }
    }
    for (i, ai) in acc.iter().enumerate() {
        for g in (0..V).step_by(2) {
            let [a, b] = reorder::<K>([ai[g], ai[g + 1]]);
            _mm256_storeu_ps(out.add(i * kp + j + 8 * g), a);
            _mm256_storeu_ps(out.add(i * kp + j + 8 * g + 8), b);
        }
    }
}

/// `Problem::accumulate_n` of `8 V` dimensions for N slots, `sums` their `[N][8 V]` running sums.
///
/// # Safety
/// AVX2 and FMA; `sums` valid for N · 8 V values; every key's values `d0 .. d0 + 8 V` inside `vd`.
#[inline]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn accumulate<const N: usize, const V: usize, E: KvElement, L: KeyList>(
    values: Values<'_, E>,
    kvh: usize,
    keys: L,
    p: [&[f32]; N],
    d0: usize,
    prefetch: bool,
    sums: *mut f32,
) {
    let mut acc = [[_mm256_setzero_ps(); V]; N];
    for (i, ai) in acc.iter_mut().enumerate() {
        for g in (0..V).step_by(2) {
            let at = sums.add(i * 8 * V + 8 * g);
            [ai[g], ai[g + 1]] = reorder::<E>([_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8))]);
        }
    }
    let len = keys.len();
    let p: [&[f32]; N] = p.map(|pi| &pi[..len]);
    for t in 0..len {
        if prefetch {
            values.prefetch(&keys, t, kvh, d0, 8 * V);
        }
        let v = values.vd[values.at(keys.key(t), kvh, d0)..][..8 * V].as_ptr();
        let mut x = [_mm256_setzero_ps(); V];
        for g in (0..V).step_by(2) {
            [x[g], x[g + 1]] = load16(v.add(8 * g));
        }
        for (ai, pi) in acc.iter_mut().zip(&p) {
            let pt = _mm256_set1_ps(pi[t]);
            for (ag, &xg) in ai.iter_mut().zip(&x) {
                *ag = _mm256_fmadd_ps(pt, xg, *ag);
            }
        }
    }
    for (i, ai) in acc.iter().enumerate() {
        for g in (0..V).step_by(2) {
            let [a, b] = reorder::<E>([ai[g], ai[g + 1]]);
            let at = sums.add(i * 8 * V + 8 * g);
            _mm256_storeu_ps(at, a);
            _mm256_storeu_ps(at.add(8), b);
        }
    }
}
