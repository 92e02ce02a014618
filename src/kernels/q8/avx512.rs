//! AVX-512 VNNI: a group's 16 outputs in one register, tiles of up to 4 groups x 8 rows as
//! [`plan`] shapes them, with one named entry per format (`matmul_q4_0_q8` .. `matmul_q6k_q8`).

use super::format::{heads_bytes, high_bits_at, offset, stride, super_bytes, SUPER};
use super::plan::{plan, prefetch_into_l1, TILE_ROWS};
use super::quantize::start_slot;
use super::{prefetch_ahead, Out, PackedFormat, PackedMatrix, QuantRows, GROUP};
use crate::kernels::qmatmul::BLOCK;
use std::arch::x86_64::*;

/// This variant's task ([`super::TaskFn`]): the format's entry below.
pub(super) fn task(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    assert!(g0 + out.groups <= w.groups());
    // SAFETY: as the 256-bit variants'.
    unsafe {
        match w.format {
            PackedFormat::Q4_0 => matmul_q4_0_q8(a, w, g0, out),
            PackedFormat::Q4_1 => matmul_q4_1_q8(a, w, g0, out),
            PackedFormat::Q8_0 => matmul_q8_0_q8(a, w, g0, out),
            PackedFormat::Q4K => matmul_q4k_q8(a, w, g0, out),
            PackedFormat::Q5K => matmul_q5k_q8(a, w, g0, out),
            PackedFormat::Q6K => matmul_q6k_q8(a, w, g0, out),
        }
    }
}

/// Q4_0 (nibbles, offset 8 from the activation sums, one f16 scale): the nibble path, four groups at
/// up to 2 rows, two beyond.
#[inline(always)]
unsafe fn matmul_q4_0_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    run::<{ PackedFormat::Q4_0.tag() }>(a, w, g0, out)
}

/// Q4_1 (nibbles, f16 scale and minimum): the nibble path, four groups at up to 2 rows, two beyond.
#[inline(always)]
unsafe fn matmul_q4_1_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    run::<{ PackedFormat::Q4_1.tag() }>(a, w, g0, out)
}

/// Q8_0 (int8 stored with 128 added, one f16 scale): the byte path, four groups at up to 2 rows, two
/// beyond.
#[inline(always)]
unsafe fn matmul_q8_0_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    run::<{ PackedFormat::Q8_0.tag() }>(a, w, g0, out)
}

/// Q4_K (nibbles, byte scale and minimum under f16 super-block scales): the nibble path, four groups
/// at up to 2 rows, two beyond; 8-row tiles prefetch into L1.
#[inline(always)]
unsafe fn matmul_q4k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    run::<{ PackedFormat::Q4K.tag() }>(a, w, g0, out)
}

/// Q5_K (nibbles and a high-bit chunk, K-quant heads): the byte path (`quad`), four groups at up to 2
/// rows, two beyond; 8-row tiles prefetch into L1.
#[inline(always)]
unsafe fn matmul_q5k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    run::<{ PackedFormat::Q5K.tag() }>(a, w, g0, out)
}

/// Q6_K (nibbles and two high-bit chunks, offset 32, signed byte scales per half-block): the byte path
/// in two halves (`split`), four groups at one row, two up to 5 rows, one beyond; 8-row tiles prefetch
/// into L1.
#[inline(always)]
unsafe fn matmul_q6k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    run::<{ PackedFormat::Q6K.tag() }>(a, w, g0, out)
}

#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn run<const F: u8>(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    let (m, groups) = (a.rows, out.groups);
    let (most, fetch) = plan(PackedFormat::from_tag(F), m, a.cols);
    let mut gi = 0;
    while gi < groups {
        let tile_groups = if most >= 4 && gi + 3 < groups {
            4
        } else if most >= 2 && gi + 1 < groups {
            2
        } else {
            1
        };
        let mut r0 = 0;
        while r0 < m {
            let rows = (m - r0).min(TILE_ROWS);
            let at = At {
                g: g0 + gi,
                r0,
                fetch,
                out: std::array::from_fn(|j| out.at((gi + j).min(groups - 1), r0)),
                ld: out.ld,
            };
            match tile_groups {
                4 if rows == 1 => tile::<F, 4, 1>(a, w, at),
                4 => tile::<F, 4, 2>(a, w, at),
                2 => tile_of::<F, 2>(rows, a, w, at),
                _ => tile_of::<F, 1>(rows, a, w, at),
            }
            r0 += rows;
        }
        gi += tile_groups;
    }
}

/// Where a tile works: groups from `g`, rows from `r0`; row `r`'s 16 outputs of group `g + j` go
/// to `out[j] + r·ld` (for the tile's `G` groups, the first `G` of these). `fetch`: ask for the
/// blocks ahead ([`plan`]).
#[derive(Clone, Copy)]
struct At {
    g: usize,
    r0: usize,
    fetch: bool,
    out: [*mut f32; 4],
    ld: usize,
}

/// [`tile`] for `rows` (1 ..= 8) rows.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn tile_of<const F: u8, const G: usize>(rows: usize, a: &QuantRows, w: &PackedMatrix, at: At) {
    match rows {
        1 => tile::<F, G, 1>(a, w, at),
        2 => tile::<F, G, 2>(a, w, at),
        3 => tile::<F, G, 3>(a, w, at),
        4 => tile::<F, G, 4>(a, w, at),
        5 => tile::<F, G, 5>(a, w, at),
        6 => tile::<F, G, 6>(a, w, at),
        7 => tile::<F, G, 7>(a, w, at),
        _ => tile::<F, G, 8>(a, w, at),
    }
}

/// A K-quant super-block's scales at `sup` as the heads multiply them: `d` and `-dmin` (0 for Q6_K),
/// converted once for its 8 blocks. `-(dmin·mn)` and `(-dmin)·mn` are the same f32.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn super_scales(f: PackedFormat, sup: *const u8) -> [__m512; 2] {
    let f16s = |at: *const u8| _mm512_cvtph_ps(_mm256_loadu_si256(at.cast()));
    if f.split() {
        [f16s(sup), _mm512_setzero_ps()]
    } else {
        let sign = _mm512_set1_epi32(i32::MIN);
        let dmin = _mm512_castps_si512(f16s(sup.add(2 * GROUP)));
        [f16s(sup), _mm512_castsi512_ps(_mm512_xor_si512(dmin, sign))]
    }
}

/// The two heads (the second 0 where unused) of the group-block at `blk`, for the K-quants from
/// their super-block's [`super_scales`] `sup`: as [`PackedMatrix::heads`].
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn heads(f: PackedFormat, blk: *const u8, sup: [__m512; 2]) -> [__m512; 2] {
    let f16s = |at: *const u8| _mm512_cvtph_ps(_mm256_loadu_si256(at.cast()));
    if f.k_quant() {
        let small = |set: usize| {
            let b = _mm_loadu_si128(blk.add(GROUP * set).cast());
            let i = if f.split() {
                _mm512_cvtepi8_epi32(b)
            } else {
                _mm512_cvtepu8_epi32(b)
            };
            _mm512_cvtepi32_ps(i)
        };
        let [d, neg_dmin] = sup;
        if f.split() {
            [_mm512_mul_ps(d, small(0)), _mm512_mul_ps(d, small(1))]
        } else {
            [_mm512_mul_ps(d, small(0)), _mm512_mul_ps(neg_dmin, small(1))]
        }
    } else if f.two_heads() {
        [f16s(blk), f16s(blk.add(2 * GROUP))]
    } else {
        [f16s(blk), _mm512_setzero_ps()]
    }
}

/// Quad `t` (values `4t .. 4t + 4` of each row, 0..8) of a byte-path group-block whose weights are
/// at `q`, as bytes: as the 256-bit variants' `quad`, for all 16 lanes.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn quad(f: PackedFormat, q: *const u8, t: usize) -> __m512i {
    if !f.nibble_planes() {
        return _mm512_loadu_si512(q.add(64 * t).cast());
    }
    let low = _mm512_set1_epi8(15);
    let v = _mm512_loadu_si512(q.add(64 * (t % 4)).cast());
    let lo = if t < 4 {
        _mm512_and_si512(v, low)
    } else {
        _mm512_and_si512(_mm512_srli_epi16::<4>(v), low)
    };
    let (chunk, bit) = high_bits_at(f, t);
    let hv = _mm512_loadu_si512(q.add(256 + 64 * chunk).cast());
    let moved = if bit <= 4 {
        _mm512_sll_epi16(hv, _mm_cvtsi32_si128(4 - bit as i32))
    } else {
        _mm512_srl_epi16(hv, _mm_cvtsi32_si128(bit as i32 - 4))
    };
    let mask = if f == PackedFormat::Q6K { 0x30 } else { 0x10 };
    // lo | (moved & mask) in one instruction.
    _mm512_ternarylogic_epi32::<0xF8>(lo, moved, _mm512_set1_epi8(mask))
}

/// Rows `at.r0 .. + R` against groups `at.g .. + G` (see [`At`]). Every output sees the same
/// operations in the same order whatever `G` and `R`.
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
#[allow(clippy::needless_range_loop)] // (row, group) index pairs over several arrays
unsafe fn tile<const F: u8, const G: usize, const R: usize>(a: &QuantRows, w: &PackedMatrix, at: At) {
    let At {
        g,
        r0,
        fetch,
        out,
        ld,
    } = at;
    let f = PackedFormat::from_tag(F);
    let (k, nb, st, hb) = (a.cols, a.cols / BLOCK, stride(f), heads_bytes(f));
    let c = offset(f);
    let mut acc = [[_mm512_setzero_ps(); R]; G];
    let wg: [*const u8; G] = std::array::from_fn(|j| w.data.as_ptr().add((g + j) * nb * st));
    let sb = super_bytes(f);
    let sg: [*const u8; G] = std::array::from_fn(|j| w.supers.as_ptr().add((g + j) * (nb / SUPER) * sb));
    let low = _mm512_set1_epi8(15);
    let mut sup = [[_mm512_setzero_ps(); 2]; G];
    for b in 0..nb {
        if f.k_quant() && b % SUPER == 0 {
            sup = std::array::from_fn(|j| super_scales(f, sg[j].add(b / SUPER * sb)));
        }
        let blk: [*const u8; G] = std::array::from_fn(|j| wg[j].add(b * st));
        if fetch {
            for &wg in &wg {
                prefetch_ahead(wg, b, nb, st, G, prefetch_into_l1(f, R));
            }
        }
        let xq = |r: usize| a.q.as_ptr().add((r0 + r) * k + b * BLOCK).cast::<i32>();
        let heads: [[__m512; 2]; G] = std::array::from_fn(|j| heads(f, blk[j], sup[j]));
        // Q6_K's halves are summed and added one after the other (their own scales), so only one
        // half's sums are live: with both, 8 rows of two groups spilled their registers.
        for half in 0..if f.split() { 2 } else { 1 } {
            // Each sum starts at `-c·Σq` over its values.
            let mut isum = [[_mm512_setzero_si512(); R]; G];
            for r in 0..R {
                if c != 0 {
                    let start = a.starts.get_unchecked((r0 + r) * nb + b)[start_slot(f, half)];
                    for j in 0..G {
                        isum[j][r] = _mm512_set1_epi32(start);
                    }
                }
            }
            if f.four_bit() {
                for t in 0..4 {
                    let v: [__m512i; G] =
                        std::array::from_fn(|j| _mm512_loadu_si512(blk[j].add(hb + 64 * t).cast()));
                    let lo: [__m512i; G] = std::array::from_fn(|j| _mm512_and_si512(v[j], low));
                    let hi: [__m512i; G] =
                        std::array::from_fn(|j| _mm512_and_si512(_mm512_srli_epi16::<4>(v[j]), low));
                    for r in 0..R {
                        let x0 = _mm512_set1_epi32(xq(r).add(t).read_unaligned());
                        let x1 = _mm512_set1_epi32(xq(r).add(t + 4).read_unaligned());
                        for j in 0..G {
                            isum[j][r] =
                                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(isum[j][r], lo[j], x0), hi[j], x1);
                        }
                    }
                }
            } else {
                let quads = if f.split() { 4 * half..4 * half + 4 } else { 0..8 };
                for t in quads {
                    let u: [__m512i; G] = std::array::from_fn(|j| quad(f, blk[j].add(hb), t));
                    for r in 0..R {
                        let x = _mm512_set1_epi32(xq(r).add(t).read_unaligned());
                        for j in 0..G {
                            isum[j][r] = _mm512_dpbusd_epi32(isum[j][r], u[j], x);
                        }
                    }
                }
            }
            for j in 0..G {
                let h = heads[j][half];
                for r in 0..R {
                    let ab = (r0 + r) * nb + b;
                    let dx = _mm512_set1_ps(*a.d.get_unchecked(ab));
                    let acc_r = &mut acc[j][r];
                    *acc_r = _mm512_fmadd_ps(_mm512_mul_ps(h, dx), _mm512_cvtepi32_ps(isum[j][r]), *acc_r);
                    if f.two_heads() && !f.split() {
                        *acc_r = _mm512_fmadd_ps(heads[j][1], _mm512_set1_ps(*a.s.get_unchecked(ab)), *acc_r);
                    }
                }
            }
        }
    }
    for j in 0..G {
        for r in 0..R {
            _mm512_storeu_ps(out[j].add(r * ld), acc[j][r]);
        }
    }
}
