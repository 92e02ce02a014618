//! Portable scoring and summing: the recipe's exp and 16-lane sums and maxima, the keys' layouts and
//! lists, and step 1's dot products a chunk of keys at a time (the AVX2 build's own in [`super::avx2`]).

#[cfg(target_arch = "x86_64")]
use super::avx2;
use super::layout::KeyLayout;
use super::{KvElement, Width, KEY_CHUNK, LANES};
use crate::kernels::prefetch_l1;

/// `exp(x)` for `x <= 0` (a softmax's shifted scores), to about 2 ulp: `2^n · P(r)` with `n =
/// round(x / ln 2)`, `r = x - n ln 2` in two fused steps, and a degree-6 polynomial. Values below -87
/// are taken at -87 (about 1.6e-38, beside a maximum of 1). Only fused multiply-adds, multiplies, adds
/// and integer bit operations: the same bits in every build.
#[inline(always)]
pub(crate) fn exp_nonpositive(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    const MAGIC: f32 = 12_582_912.0; // 1.5 · 2^23: adding it rounds to an integer (ties to even)
    let x = x.max(-87.0);
    let t = x.mul_add(LOG2E, MAGIC);
    let n = t.to_bits() as i32 - MAGIC.to_bits() as i32;
    let nf = t - MAGIC;
    let r = nf.mul_add(-LN2_LO, nf.mul_add(-LN2_HI, x));
    let mut p: f32 = 1.0 / 720.0;
    p = p.mul_add(r, 1.0 / 120.0);
    p = p.mul_add(r, 1.0 / 24.0);
    p = p.mul_add(r, 1.0 / 6.0);
    p = p.mul_add(r, 0.5);
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    p * f32::from_bits(((n + 127) as u32) << 23)
}

/// The largest of `x` (NEG_INFINITY when empty), in 16 independent lanes: a maximum is exact in any
/// order, and one running maximum would be a chain of dependent compares.
#[inline(always)]
pub(crate) fn lane_max(x: &[f32]) -> f32 {
    let mut acc = [f32::NEG_INFINITY; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] = if c[l] > acc[l] { c[l] } else { acc[l] };
        }
    }
    for (l, &v) in tail.iter().enumerate() {
        acc[l] = if v > acc[l] { v } else { acc[l] };
    }
    acc.into_iter().fold(f32::NEG_INFINITY, f32::max)
}

/// `Σ x` in 16 lanes by position, then a fixed tree (step 4).
#[inline(always)]
pub(super) fn lane_sum(x: &[f32]) -> f32 {
    lane_sum_by(x, |v| v)
}

/// `Σ f(x)` in 16 lanes by position, then a fixed tree: vectorises, and the same bits at every width.
#[inline(always)]
pub(crate) fn lane_sum_by(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for l in 0..LANES {
            acc[l] += f(c[l]);
        }
    }
    for (l, &v) in tail.iter().enumerate() {
        acc[l] += f(v);
    }
    let v8: [f32; 8] = std::array::from_fn(|i| acc[i] + acc[i + 8]);
    let v4: [f32; 4] = std::array::from_fn(|i| v8[i] + v8[i + 4]);
    (v4[0] + v4[2]) + (v4[1] + v4[3])
}

/// Every slot's scores over `keys` (from a multiple of [`KEY_CHUNK`]), a chunk at a time, key `j`'s at
/// `j - keys.start` of the slot's scores (`slots`, `q`, `kt`, `scores` as in [`score_slots`]).
#[inline(always)]
pub(super) fn score_all<'q, K: KvElement>(
    width: Width,
    slots: usize,
    q: impl Fn(usize) -> &'q [f32] + Copy,
    (kt, layout): (&[K], KeyLayout),
    keys: std::ops::Range<usize>,
    (scores, kp): (&mut [f32], usize),
) {
    #[cfg(target_arch = "x86_64")]
    if width == Width::W256 {
        // SAFETY: W256 runs only where the CPU has AVX2 and FMA (`attention_with` checks).
        return unsafe { avx2::score_all(slots, q, (kt, layout), keys, (scores, kp)) };
    }
    // Four slots at a time where 32 vector registers hold their 16 chains, else two.
    let quads = width == Width::W512;
    let (lo, hi) = (keys.start, keys.end);
    for j0 in (lo..hi).step_by(KEY_CHUNK) {
        // The last chunk only as wide as the keys it holds, in whole vectors (a cache of 257 keys
        // would otherwise score 320; a score is its own chain, so the width cannot change it).
        // The chunk's keys and scores from their start.
        let (at, ks) = layout.chunk(j0);
        let (keys, scores) = ((&kt[at..], ks), (&mut scores[j0 - lo..], kp));
        // The next chunk's keys are asked for while this one is scored (as rows, its 64 rows lie `ks`
        // apart, a pattern the hardware prefetcher does not follow).
        let ahead = (j0 + KEY_CHUNK < hi).then(|| layout.chunk(j0 + KEY_CHUNK).0 - at);
        match (hi - j0).min(KEY_CHUNK).div_ceil(LANES) {
            1 => score_slots::<16, K>(slots, q, keys, 0, scores, quads, ahead),
            2 => score_slots::<32, K>(slots, q, keys, 0, scores, quads, ahead),
            3 => score_slots::<48, K>(slots, q, keys, 0, scores, quads, ahead),
            _ => score_slots::<KEY_CHUNK, K>(slots, q, keys, 0, scores, quads, ahead),
        }
    }
}

/// `scores[i][l] = Σ_d q_i[d] · kt[d · ks + j0 + l]` for the W (at most [`KEY_CHUNK`]) keys from `j0`
/// and each of the N query vectors (step 1's dot products): each a fused multiply-add chain in `d`
/// order, N · W/16 independent 16-lane chains, each key chunk loaded once for all N.
#[inline(always)]
fn score_chunk<const N: usize, const W: usize, K: KvElement>(
    q: [&[f32]; N],
    kt: &[K],
    ks: usize,
    j0: usize,
    ahead: Option<usize>,
) -> [[f32; W]; N] {
    let mut acc = [[0.0f32; W]; N];
    for d in 0..q[0].len() {
        if let Some(a) = ahead {
            prefetch_l1(
                kt.as_ptr().wrapping_add(d * ks + a).cast(),
                size_of::<K>() * KEY_CHUNK,
            );
        }
        let k = &kt[d * ks + j0..][..W];
        for (a, qi) in acc.iter_mut().zip(&q) {
            let qd = qi[d];
            for l in 0..W {
                a[l] = qd.mul_add(k[l].to_f32(), a[l]);
            }
        }
    }
    acc
}

/// [`score_chunk`] of the W keys from `j0` (`keys`: the transposed keys and their stride) for every
/// slot (`q(slot)` its query, its scores at `scores.0[slot · scores.1 ..]`), each key chunk loaded once
/// for several slots: four with `quads` (16 chains; AVX-512's 32 registers hold them), else two (8
/// chains, what AVX2's 16 hold); the last one or two slots in smaller groups. The first group also asks
/// for the keys of the chunk at `ahead`, if any.
#[inline(always)]
fn score_slots<'q, const W: usize, K: KvElement>(
    slots: usize,
    q: impl Fn(usize) -> &'q [f32],
    (kt, ks): (&[K], usize),
    j0: usize,
    (scores, kp): (&mut [f32], usize),
    quads: bool,
    ahead: Option<usize>,
) {
    let mut slot = 0;
    while slot < slots {
        let ahead = ahead.filter(|_| slot == 0);
        let out = &mut scores[slot * kp + j0..];
        if quads && slot + 3 < slots {
            let qs = [q(slot), q(slot + 1), q(slot + 2), q(slot + 3)];
            for (i, chunk) in score_chunk::<4, W, K>(qs, kt, ks, j0, ahead).iter().enumerate() {
                out[i * kp..][..W].copy_from_slice(chunk);
            }
            slot += 4;
        } else if slot + 1 < slots {
            for (i, chunk) in score_chunk::<2, W, K>([q(slot), q(slot + 1)], kt, ks, j0, ahead)
                .iter()
                .enumerate()
            {
                out[i * kp..][..W].copy_from_slice(chunk);
            }
            slot += 2;
        } else {
            out[..W].copy_from_slice(&score_chunk::<1, W, K>([q(slot)], kt, ks, j0, ahead)[0]);
            slot += 1;
        }
    }
}
