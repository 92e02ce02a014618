//! The 256-bit x86 variants, AVX2 ([`avx2`]) and AVX-VNNI ([`avxvnni`]): one macro-generated module
//! each, the same tiles under different target features (only the integer dot product of a chunk
//! differs), with one named entry per format (`matmul_q4_0_q8` .. `matmul_q6k_q8`).

use super::format::{heads_bytes, high_bits_at, offset, stride, super_bytes, SUPER};
use super::plan::{avx256_tile_rows, avx256_two_groups_rows, avx2_paired_quads, ONE_PASS_ROWS};
use super::quantize::start_slot;
use super::{prefetch_ahead, Out, PackedFormat, PackedMatrix, QuantRows, GROUP};
use crate::kernels::qmatmul::BLOCK;

/// `[f(0), .., f(n - 1)]` written out as a loop: `std::array::from_fn`'s closure is a function of its
/// own, without the caller's target features, which the compiler may leave out of line (a call per
/// vector, which slowed the 256-bit tiles badly).
macro_rules! each {
    ($n:expr, |$i:ident| $e:expr) => {{
        let mut out = [std::mem::zeroed(); $n];
        for $i in 0..$n {
            out[$i] = $e;
        }
        out
    }};
}

/// The 256-bit x86 variants, one module per instruction set (the same code under different target
/// features; only the integer dot product of a chunk differs). A group's 16 outputs are two halves of
/// 8 lanes. At up to four rows ([`ONE_PASS_ROWS`]) both halves run in one pass over the group's blocks
/// (at one and two rows two groups at once where that measured faster: [`avx256_two_groups_rows`]); at
/// more, the registers hold one half's sums only, and the halves run one after the other, the second
/// re-reading the group's weights from L1 / L2. (One row in two passes left memory idle through the
/// second.)
macro_rules! avx256_variant {
    ($name:ident, $features:literal, $vnni:literal) => {
        pub(super) mod $name {
            use super::*;
            use std::arch::x86_64::*;

            /// This variant's task ([`super::super::TaskFn`]): the format's entry below.
            pub(in crate::kernels::q8) fn task(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                assert!(g0 + out.groups <= w.groups());
                // SAFETY: `matmul_quantized_with` picks this variant only if the CPU has its features;
                // `run` stays inside `w`'s groups `g0 ..` that `out` covers and `a`'s rows.
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

            /// Q4_0 (nibbles, offset 8, one f16 scale): the nibble path, two groups at up to 2 rows.
            #[inline(always)]
            unsafe fn matmul_q4_0_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q4_0.tag() }>(a, w, g0, out)
            }

            /// Q4_1 (nibbles, f16 scale and minimum): the nibble path, two groups at up to 2 rows.
            #[inline(always)]
            unsafe fn matmul_q4_1_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q4_1.tag() }>(a, w, g0, out)
            }

            /// Q8_0 (int8, one f16 scale): the byte path; with VNNI two groups at up to 2 rows, without
            /// signed `maddubs` (`dot_bytes`) one group at a time.
            #[inline(always)]
            unsafe fn matmul_q8_0_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q8_0.tag() }>(a, w, g0, out)
            }

            /// Q4_K (nibbles, byte scale and minimum under f16 super-block scales): the nibble path,
            /// two groups at up to 2 rows.
            #[inline(always)]
            unsafe fn matmul_q4k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q4K.tag() }>(a, w, g0, out)
            }

            /// Q5_K (nibbles and a high-bit chunk, K-quant heads): the byte path (`quad`); with VNNI two
            /// groups at up to 2 rows, without one group and paired quads in one-slice tiles.
            #[inline(always)]
            unsafe fn matmul_q5k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q5K.tag() }>(a, w, g0, out)
            }

            /// Q6_K (nibbles and two high-bit chunks, offset 32, signed byte scales per half-block):
            /// the byte path in two halves (`split`), tiles of 4 rows past the one-pass rows; with VNNI
            /// two groups at up to 2 rows, without one group and paired quads.
            #[inline(always)]
            unsafe fn matmul_q6k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q6K.tag() }>(a, w, g0, out)
            }

            #[target_feature(enable = $features)]
            unsafe fn run<const F: u8>(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                let (m, groups) = (a.rows, out.groups);
                let mut gi = 0;
                while gi < groups {
                    let g = g0 + gi;
                    if m <= ONE_PASS_ROWS {
                        // Both halves in one pass: each activation broadcast feeds both, and the
                        // weights stream from memory in one sweep (see `ONE_PASS_ROWS`).
                        let two_rows = avx256_two_groups_rows($vnni, PackedFormat::from_tag(F));
                        // (`two_rows` is at most 2.)
                        if m <= two_rows && gi + 1 < groups {
                            // Two groups at once: see `TWO_GROUPS_ROWS`.
                            let o = [out.at(gi, 0), out.at(gi + 1, 0)];
                            if m == 1 {
                                tile::<F, 1, 4, 2>(a, w, g, 0, 0, o, out.ld, true);
                            } else {
                                tile::<F, 2, 4, 2>(a, w, g, 0, 0, o, out.ld, true);
                            }
                            gi += 2;
                            continue;
                        }
                        let o = [out.at(gi, 0)];
                        match m {
                            1 => tile::<F, 1, 2, 1>(a, w, g, 0, 0, o, out.ld, true),
                            2 => tile::<F, 2, 2, 1>(a, w, g, 0, 0, o, out.ld, true),
                            3 => tile::<F, 3, 2, 1>(a, w, g, 0, 0, o, out.ld, true),
                            _ => tile::<F, 4, 2, 1>(a, w, g, 0, 0, o, out.ld, true),
                        }
                        gi += 1;
                        continue;
                    }
                    // Q6_K in tiles of 4 rows: at 8 its two heads and unpacking leave too few of the 16
                    // registers (`avx256_tile_rows`).
                    let tile_rows = avx256_tile_rows(PackedFormat::from_tag(F));
                    for h in 0..2 {
                        let mut r0 = 0;
                        while r0 < m {
                            let rows = (m - r0).min(tile_rows);
                            let o = [out.at(gi, r0).add(8 * h)];
                            // The first pass prefetches; the second finds the group's blocks in L1 / L2.
                            // (Fetching the next group's bytes through both passes cost 8 rows: they are
                            // bound by arithmetic here.)
                            let fetch = r0 == 0 && h == 0;
                            match rows {
                                1 => tile::<F, 1, 1, 1>(a, w, g, h, r0, o, out.ld, fetch),
                                2 => tile::<F, 2, 1, 1>(a, w, g, h, r0, o, out.ld, fetch),
                                3 => tile::<F, 3, 1, 1>(a, w, g, h, r0, o, out.ld, fetch),
                                4 => tile::<F, 4, 1, 1>(a, w, g, h, r0, o, out.ld, fetch),
                                5 => tile::<F, 5, 1, 1>(a, w, g, h, r0, o, out.ld, fetch),
                                6 => tile::<F, 6, 1, 1>(a, w, g, h, r0, o, out.ld, fetch),
                                7 => tile::<F, 7, 1, 1>(a, w, g, h, r0, o, out.ld, fetch),
                                _ => tile::<F, 8, 1, 1>(a, w, g, h, r0, o, out.ld, fetch),
                            }
                            r0 += rows;
                        }
                    }
                    gi += 1;
                }
            }

            /// Lanes `8h .. 8h + 8` of a K-quant super-block's scales at `sup` as the heads multiply
            /// them: `d` and `-dmin` (0 for Q6_K), converted once for its 8 blocks.
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn super_scales(f: PackedFormat, sup: *const u8, h: usize) -> [__m256; 2] {
                let f16s = |at: *const u8| _mm256_cvtph_ps(_mm_loadu_si128(at.add(16 * h).cast()));
                if f.split() {
                    [f16s(sup), _mm256_setzero_ps()]
                } else {
                    [
                        f16s(sup),
                        _mm256_xor_ps(f16s(sup.add(2 * GROUP)), _mm256_set1_ps(-0.0)),
                    ]
                }
            }

            /// The two heads (the second 0 where unused) of lanes `8h .. 8h + 8` of the group-block at
            /// `blk`, for the K-quants from their super-block's [`super_scales`] `sup`: as
            /// [`PackedMatrix::heads`].
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn heads(f: PackedFormat, blk: *const u8, sup: [__m256; 2], h: usize) -> [__m256; 2] {
                let f16s = |at: *const u8| _mm256_cvtph_ps(_mm_loadu_si128(at.add(16 * h).cast()));
                if f.k_quant() {
                    let small = |set: usize| {
                        let b = _mm_loadl_epi64(blk.add(GROUP * set + 8 * h).cast());
                        let i = if f.split() {
                            _mm256_cvtepi8_epi32(b)
                        } else {
                            _mm256_cvtepu8_epi32(b)
                        };
                        _mm256_cvtepi32_ps(i)
                    };
                    let [d, neg_dmin] = sup;
                    if f.split() {
                        [_mm256_mul_ps(d, small(0)), _mm256_mul_ps(d, small(1))]
                    } else {
                        [
                            _mm256_mul_ps(d, small(0)),
                            _mm256_mul_ps(neg_dmin, small(1)),
                        ]
                    }
                } else if f.two_heads() {
                    [f16s(blk), f16s(blk.add(2 * GROUP))]
                } else {
                    [f16s(blk), _mm256_setzero_ps()]
                }
            }

            /// Quad `t` (values `4t .. 4t + 4` of each row, 0..8) of lanes `8h ..` of a byte-path
            /// group-block whose weights are at `q`, as bytes: Q8_0's chunk, or Q5_K / Q6_K's nibble
            /// with its high bits shifted in.
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn quad(f: PackedFormat, q: *const u8, t: usize, h: usize) -> __m256i {
                if !f.nibble_planes() {
                    return _mm256_loadu_si256(q.add(64 * t + 32 * h).cast());
                }
                let low = _mm256_set1_epi8(15);
                let v = _mm256_loadu_si256(q.add(64 * (t % 4) + 32 * h).cast());
                let lo = if t < 4 {
                    _mm256_and_si256(v, low)
                } else {
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v), low)
                };
                let (chunk, bit) = high_bits_at(f, t);
                let hv = _mm256_loadu_si256(q.add(256 + 64 * chunk + 32 * h).cast());
                // Bit `bit` of each byte to bit 4 (16-bit shifts: the mask keeps only bits that stayed
                // in their byte).
                let moved = if bit <= 4 {
                    _mm256_sll_epi16(hv, _mm_cvtsi32_si128(4 - bit as i32))
                } else {
                    _mm256_srl_epi16(hv, _mm_cvtsi32_si128(bit as i32 - 4))
                };
                let mask = if f == PackedFormat::Q6K { 0x30 } else { 0x10 };
                _mm256_or_si256(lo, _mm256_and_si256(moved, _mm256_set1_epi8(mask)))
            }

            /// Rows `r0 .. r0 + R` against `S` slices of 8 lanes: `G` groups from `g`, each in `S / G`
            /// slices, lanes `8·h0 ..` onwards. Row `r`'s outputs of group `g + j` go to
            /// `out[j] + r·ld`, from lane `8·h0`. `fetch`: prefetch the blocks ahead (a pass that reads
            /// them from memory). Every output sees the same operations in the same order whatever `S`, `G`
            /// and `R`. The layout is derived from `g` and `h0` by compile-time constants (a tile that
            /// took lists of each slice's group, half and output ran slower).
            #[target_feature(enable = $features)]
            #[inline]
            #[allow(clippy::too_many_arguments, clippy::needless_range_loop)]
            unsafe fn tile<const F: u8, const R: usize, const S: usize, const G: usize>(
                a: &QuantRows,
                w: &PackedMatrix,
                g: usize,
                h0: usize,
                r0: usize,
                out: [*mut f32; G],
                ld: usize,
                fetch: bool,
            ) {
                // Slice `i`: group `g + i / halves`, lanes of half `h0 + i % halves`.
                let halves = S / G;
                let hs: [usize; S] = each!(S, |i| h0 + i % halves);
                let f = PackedFormat::from_tag(F);
                let (k, nb, st, hb) = (a.cols, a.cols / BLOCK, stride(f), heads_bytes(f));
                // Q8_0 without VNNI sums w·x directly (see `dot_bytes`).
                let c = if f == PackedFormat::Q8_0 && !$vnni {
                    0
                } else {
                    offset(f)
                };
                let mut acc = [[_mm256_setzero_ps(); R]; S];
                let wg0 = w.data.as_ptr().add(g * nb * st);
                let wg: [*const u8; S] = each!(S, |i| wg0.add(i / halves * nb * st));
                let sb = super_bytes(f);
                let sg0 = w.supers.as_ptr().add(g * (nb / SUPER) * sb);
                let sg: [*const u8; S] = each!(S, |i| sg0.add(i / halves * (nb / SUPER) * sb));
                let low = _mm256_set1_epi8(15);
                let mut sup = [[_mm256_setzero_ps(); 2]; S];
                for b in 0..nb {
                    let blk: [*const u8; S] = each!(S, |i| wg[i].add(b * st));
                    if f.k_quant() && b % SUPER == 0 {
                        sup = each!(S, |i| super_scales(f, sg[i].add(b / SUPER * sb), hs[i]));
                    }
                    if fetch {
                        // Once per group: its slices share the stream.
                        for j in 0..G {
                            prefetch_ahead(wg[j * halves], b, nb, st, G, false);
                        }
                    }
                    // The activation quads of row r, block b: 8 × 4 bytes.
                    let xq = |r: usize| a.q.as_ptr().add((r0 + r) * k + b * BLOCK).cast::<i32>();
                    let hd: [[__m256; 2]; S] = each!(S, |i| heads(f, blk[i], sup[i], hs[i]));
                    // Q6_K's halves are summed and added one after the other (their own scales), so only
                    // one half's sums are live (both spilled registers at 8 rows).
                    for half in 0..if f.split() { 2 } else { 1 } {
                        let mut isum = [[_mm256_setzero_si256(); R]; S];
                        if f.four_bit() {
                            for t in 0..4 {
                                let v: [__m256i; S] = each!(S, |i| _mm256_loadu_si256(
                                    blk[i].add(hb + 64 * t + 32 * hs[i]).cast()
                                ));
                                let lo: [__m256i; S] = each!(S, |i| _mm256_and_si256(v[i], low));
                                let hi: [__m256i; S] =
                                    each!(S, |i| _mm256_and_si256(_mm256_srli_epi16::<4>(v[i]), low));
                                add_two_quads(&mut isum, &xq, (lo, t), (hi, t + 4), true);
                            }
                        } else {
                            let quads = if f.split() {
                                4 * half..4 * half + 4
                            } else {
                                0..8
                            };
                            if !$vnni && avx2_paired_quads(f, S) {
                                // Two quads' pair sums added in 16 bits before one widening (Q5_K's
                                // and Q6_K's values are at most 63: within ±32004), so a quad costs
                                // one `maddubs` and half a `madd` (`avx2_paired_quads`).
                                for t in quads.step_by(2) {
                                    let u0: [__m256i; S] = each!(S, |i| quad(f, blk[i].add(hb), t, hs[i]));
                                    let u1: [__m256i; S] =
                                        each!(S, |i| quad(f, blk[i].add(hb), t + 1, hs[i]));
                                    add_two_quads(&mut isum, &xq, (u0, t), (u1, t + 1), false);
                                }
                            } else {
                                for t in quads {
                                    let u: [__m256i; S] = each!(S, |i| quad(f, blk[i].add(hb), t, hs[i]));
                                    for r in 0..R {
                                        let xv = _mm256_set1_epi32(xq(r).add(t).read_unaligned());
                                        for i in 0..S {
                                            isum[i][r] =
                                                dot_bytes(isum[i][r], u[i], xv, f == PackedFormat::Q8_0);
                                        }
                                    }
                                }
                            }
                        }
                        for r in 0..R {
                            let ab = (r0 + r) * nb + b;
                            let dx = _mm256_set1_ps(*a.d.get_unchecked(ab));
                            // `-c·Σq` over the sum's values.
                            let start = _mm256_set1_epi32(if c != 0 {
                                a.starts.get_unchecked(ab)[start_slot(f, half)]
                            } else {
                                0
                            });
                            for i in 0..S {
                                let [head0, head1] = hd[i];
                                let acc_r = &mut acc[i][r];
                                if f.split() {
                                    let hs = if half == 0 { head0 } else { head1 };
                                    let s = _mm256_add_epi32(isum[i][r], start);
                                    *acc_r =
                                        _mm256_fmadd_ps(_mm256_mul_ps(hs, dx), _mm256_cvtepi32_ps(s), *acc_r);
                                } else {
                                    let s = finish(isum[i][r], f);
                                    let s = _mm256_add_epi32(s, start);
                                    *acc_r = _mm256_fmadd_ps(
                                        _mm256_mul_ps(head0, dx),
                                        _mm256_cvtepi32_ps(s),
                                        *acc_r,
                                    );
                                    if f.two_heads() {
                                        let sx = _mm256_set1_ps(*a.s.get_unchecked(ab));
                                        *acc_r = _mm256_fmadd_ps(head1, sx, *acc_r);
                                    }
                                }
                            }
                        }
                    }
                }
                for i in 0..S {
                    for r in 0..R {
                        _mm256_storeu_ps(out[i / halves].add(r * ld + 8 * (i % halves)), acc[i][r]);
                    }
                }
            }

            /// Adds to each row's sums (per half) weights `w0` times the row's activation quad `t0`
            /// plus `w1` times quad `t1`: two nibble planes ([`dot_nibbles`]) or two byte quads
            /// widened once ([`dot_byte_pair`]).
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn add_two_quads<const R: usize, const H: usize>(
                isum: &mut [[__m256i; R]; H],
                xq: &impl Fn(usize) -> *const i32,
                (w0, t0): ([__m256i; H], usize),
                (w1, t1): ([__m256i; H], usize),
                nibbles: bool,
            ) {
                for r in 0..R {
                    let x0 = _mm256_set1_epi32(xq(r).add(t0).read_unaligned());
                    let x1 = _mm256_set1_epi32(xq(r).add(t1).read_unaligned());
                    for i in 0..H {
                        isum[i][r] = if nibbles {
                            dot_nibbles(isum[i][r], w0[i], x0, w1[i], x1)
                        } else {
                            dot_byte_pair(isum[i][r], w0[i], x0, w1[i], x1)
                        };
                    }
                }
            }

            /// `s + Σ u·x` per 32-bit lane over its 4 byte pairs, `x` within ±127. With VNNI that is
            /// `vpdpbusd`. Without, `maddubs` adds pairs in 16 bits: fine for the K-quants' values (up
            /// to 63: pairs within ±16002), but Q8_0's `u = w + 128` would saturate, so for it
            /// (`signed`) it takes `|w| · (x · sign w)` (pairs within ±32512) and sums `w·x` directly
            /// (the caller then subtracts nothing).
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn dot_bytes(s: __m256i, u: __m256i, x: __m256i, signed: bool) -> __m256i {
                if $vnni {
                    _mm256_dpbusd_avx_epi32(s, u, x)
                } else {
                    let p = if signed {
                        let wv = _mm256_xor_si256(u, _mm256_set1_epi8(-128));
                        _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(x, wv))
                    } else {
                        _mm256_maddubs_epi16(u, x)
                    };
                    _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
                }
            }

            /// `s + Σ u0·x0 + Σ u1·x1` per 32-bit lane, `u` at most 63 (Q5_K, Q6_K), without VNNI:
            /// the two `maddubs` (pairs within ±16002) are added in 16 bits (±32004) and widened once.
            #[target_feature(enable = $features)]
            #[inline]
            unsafe fn dot_byte_pair(
                s: __m256i,
                u0: __m256i,
                x0: __m256i,
                u1: __m256i,
                x1: __m256i,
            ) -> __m256i {
                let p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, x0), _mm256_maddubs_epi16(u1, x1));
                _mm256_add_epi32(s, _mm256_madd_epi16(p, _mm256_set1_epi16(1)))
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
            unsafe fn finish(s: __m256i, f: PackedFormat) -> __m256i {
                if $vnni || !f.four_bit() {
                    s
                } else {
                    _mm256_madd_epi16(s, _mm256_set1_epi16(1))
                }
            }
        }
    };
}

avx256_variant!(avx2, "avx2,fma,f16c", false);
avx256_variant!(avxvnni, "avx2,fma,f16c,avxvnni", true);
