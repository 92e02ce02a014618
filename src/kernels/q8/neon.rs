//! The aarch64 variants: NEON, and NEON with the dot-product extension (`sdot`: ARMv8.2 and later,
//! Apple M1 on, Graviton 2 on, Ampere Altra). Per group-block and four outputs, their 128 weights are
//! unpacked once into eight registers of signed bytes laid out as `sdot` reads them (each 32-bit
//! element four consecutive weights of one output: the packed chunks' own order), then every row of `a`
//! takes its integer sums against them and its f32 steps, by the module's recipe. Q8_0's stored bytes
//! become the signed weights by a flip of the top bit; the other formats' unsigned values are small
//! enough to be signed bytes, their offset taken off the sums by the activations' `starts` (`-c·Σq`).
//!
//! Without `sdot` a four-way dot product is `smull` (bytes to 16-bit products), a pairwise add (two
//! products, at most 2·128·127 = 32,512: no 16-bit overflow) and a pairwise widening accumulate.

use super::format::{heads_bytes, high_bits_at, offset, stride, super_bytes, SUPER};
use super::quantize::start_slot;
use super::{Out, PackedFormat, PackedMatrix, QuantRows, GROUP};
use crate::kernels::qmatmul::BLOCK;
use std::arch::aarch64::*;

/// The aarch64 variants, one module per instruction set (the same code under different target
/// features; only the four-way dot product differs).
macro_rules! neon_variant {
    ($name:ident, $features:literal, $dot:ident) => {
        pub(super) mod $name {
            use super::*;

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

            /// Q4_0 (nibbles, offset 8, one f16 scale).
            unsafe fn matmul_q4_0_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q4_0.tag() }>(a, w, g0, out)
            }

            /// Q4_1 (nibbles, f16 scale and minimum).
            unsafe fn matmul_q4_1_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q4_1.tag() }>(a, w, g0, out)
            }

            /// Q8_0 (int8 stored plus 128, one f16 scale): the top bit flipped back.
            unsafe fn matmul_q8_0_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q8_0.tag() }>(a, w, g0, out)
            }

            /// Q4_K (nibbles, byte scale and minimum under f16 super-block scales).
            unsafe fn matmul_q4k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q4K.tag() }>(a, w, g0, out)
            }

            /// Q5_K (nibbles and a high-bit chunk, K-quant heads).
            unsafe fn matmul_q5k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q5K.tag() }>(a, w, g0, out)
            }

            /// Q6_K (nibbles and two high-bit chunks, offset 32, a scale per half-block): the halves
            /// summed apart.
            unsafe fn matmul_q6k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                run::<{ PackedFormat::Q6K.tag() }>(a, w, g0, out)
            }

            #[target_feature(enable = $features)]
            unsafe fn run<const F: u8>(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                groups::<F>(a, w, g0, out, |acc, w, x, lane| $dot(acc, w, x, lane))
            }
        }
    };
}

neon_variant!(neon, "neon", dot4_neon);
neon_variant!(neondot, "neon,dotprod", dot4_sdot);

/// `acc[j] += Σ_i w[4j + i] · x[4·lane + i]` with `smull` and pairwise adds.
#[inline(always)]
unsafe fn dot4_neon(acc: int32x4_t, w: int8x16_t, x: int8x16_t, lane: usize) -> int32x4_t {
    let xs = vreinterpretq_s32_s8(x);
    let quad = match lane {
        0 => vdupq_laneq_s32::<0>(xs),
        1 => vdupq_laneq_s32::<1>(xs),
        2 => vdupq_laneq_s32::<2>(xs),
        _ => vdupq_laneq_s32::<3>(xs),
    };
    let quad = vreinterpretq_s8_s32(quad);
    let lo = vmull_s8(vget_low_s8(w), vget_low_s8(quad));
    let hi = vmull_high_s8(w, quad);
    vpadalq_s16(acc, vpaddq_s16(lo, hi))
}

/// [`dot4_neon`] in one `sdot` (by element; in assembly, as Rust's `vdotq_laneq_s32` is not yet stable).
#[target_feature(enable = "neon,dotprod")]
#[inline]
unsafe fn dot4_sdot(acc: int32x4_t, w: int8x16_t, x: int8x16_t, lane: usize) -> int32x4_t {
    let mut acc = acc;
    macro_rules! sdot {
        ($lane:literal) => {
            std::arch::asm!(
                concat!("sdot {acc:v}.4s, {w:v}.16b, {x:v}.4b[", $lane, "]"),
                acc = inout(vreg) acc,
                w = in(vreg) w,
                x = in(vreg) x,
                options(pure, nomem, nostack, preserves_flags),
            )
        };
    }
    match lane {
        0 => sdot!("0"),
        1 => sdot!("1"),
        2 => sdot!("2"),
        _ => sdot!("3"),
    }
    acc
}

/// Groups `g0 ..` of `w` (format tag `F`) for every row of `a`: per group-block and four outputs, their
/// 128 weights unpacked once into eight registers, then every row's sums and f32 steps against them.
#[inline(always)]
unsafe fn groups<const F: u8>(
    a: &QuantRows,
    w: &PackedMatrix,
    g0: usize,
    out: Out,
    dot: impl Fn(int32x4_t, int8x16_t, int8x16_t, usize) -> int32x4_t,
) {
    let f = PackedFormat::from_tag(F);
    let (m, k, nb) = (a.rows, a.cols, a.cols / BLOCK);
    let st = stride(f);
    // Q8_0's bytes are flipped to the signed weights; the others keep their offset, taken off the sums
    // by the activations' `starts` (-c·Σq).
    let has_offset = f.nibble_planes() && offset(f) != 0;
    let (mut h0, mut h1) = ([0f32; GROUP], [0f32; GROUP]);
    for gi in 0..out.groups {
        // The group's outputs (this task's own, maybe never written yet) accumulate where they go.
        for r in 0..m {
            out.at(gi, r).write_bytes(0, GROUP);
        }
        for b in 0..nb {
            let blk = &w.data[((g0 + gi) * nb + b) * st..][..st];
            heads(w, g0 + gi, b, &mut h0, &mut h1);
            let q = blk[heads_bytes(f)..].as_ptr();
            for j in 0..4 {
                // wq[t]: weights 4t .. 4t + 4 of outputs 4j .. 4j + 4.
                let wq = unpack(f, q, j);
                let (hv0, hv1) = (
                    vld1q_f32(h0.as_ptr().add(4 * j)),
                    vld1q_f32(h1.as_ptr().add(4 * j)),
                );
                for r in 0..m {
                    let xq = a.q[r * k + b * BLOCK..][..BLOCK].as_ptr();
                    let (xlo, xhi) = (vld1q_s8(xq), vld1q_s8(xq.add(16)));
                    let (mut lo, mut hi) = (vdupq_n_s32(0), vdupq_n_s32(0));
                    for t in 0..4 {
                        lo = dot(lo, wq[t], xlo, t);
                        hi = dot(hi, wq[4 + t], xhi, t);
                    }
                    let ab = r * nb + b;
                    let start = |half| vdupq_n_s32(a.starts[ab][start_slot(f, half)]);
                    let dx = vdupq_n_f32(a.d[ab]);
                    let p = out.at(gi, r).add(4 * j);
                    let mut v = vld1q_f32(p);
                    if f.split() {
                        let (lo, hi) = (vaddq_s32(lo, start(0)), vaddq_s32(hi, start(1)));
                        v = vfmaq_f32(v, vmulq_f32(hv0, dx), vcvtq_f32_s32(lo));
                        v = vfmaq_f32(v, vmulq_f32(hv1, dx), vcvtq_f32_s32(hi));
                    } else {
                        let mut sum = vaddq_s32(lo, hi);
                        if has_offset {
                            sum = vaddq_s32(sum, start(0));
                        }
                        v = vfmaq_f32(v, vmulq_f32(hv0, dx), vcvtq_f32_s32(sum));
                        if f.two_heads() {
                            v = vfmaq_f32(v, hv1, vdupq_n_f32(a.s[ab]));
                        }
                    }
                    vst1q_f32(p, v);
                }
            }
        }
    }
}

/// The 16 first and second heads of group `g`, block `b`, as [`PackedMatrix::heads`] gives them (the
/// second 0 where unused): the f16 ones widened eight a time, the K-quants' byte scales widened and
/// multiplied by their super-block's scale (exact in f32, as there).
#[inline(always)]
unsafe fn heads(w: &PackedMatrix, g: usize, b: usize, h0: &mut [f32; GROUP], h1: &mut [f32; GROUP]) {
    let (f, nb) = (w.format, w.cols / BLOCK);
    let blk = w.data[(g * nb + b) * stride(f)..].as_ptr();
    if !f.k_quant() {
        f16s(blk, h0);
        if f.two_heads() {
            f16s(blk.add(2 * GROUP), h1);
        } else {
            *h1 = [0.0; GROUP];
        }
        return;
    }
    let sb = super_bytes(f);
    let sup = w.supers[(g * (nb / SUPER) + b / SUPER) * sb..][..sb].as_ptr();
    let (mut d, mut dmin) = ([0f32; GROUP], [0f32; GROUP]);
    f16s(sup, &mut d);
    let (sc, mn) = (bytes_f32(f, blk), bytes_f32(f, blk.add(GROUP)));
    if sb > 2 * GROUP {
        f16s(sup.add(2 * GROUP), &mut dmin);
    }
    for j in 0..4 {
        let dv = vld1q_f32(d.as_ptr().add(4 * j));
        vst1q_f32(h0.as_mut_ptr().add(4 * j), vmulq_f32(dv, sc[j]));
        let second = if f.split() {
            vmulq_f32(dv, mn[j])
        } else {
            vnegq_f32(vmulq_f32(vld1q_f32(dmin.as_ptr().add(4 * j)), mn[j]))
        };
        vst1q_f32(h1.as_mut_ptr().add(4 * j), second);
    }
}

/// The 16 little-endian f16 values at `p` as f32 (`fcvtl`, exact; in assembly, as Rust's f16 vector
/// types are not yet stable).
#[inline(always)]
unsafe fn f16s(p: *const u8, out: &mut [f32; GROUP]) {
    for j in 0..4 {
        let half = vld1_u16(p.add(8 * j).cast());
        let wide: float32x4_t;
        std::arch::asm!(
            "fcvtl {wide:v}.4s, {half:v}.4h",
            wide = lateout(vreg) wide,
            half = in(vreg) half,
            options(pure, nomem, nostack, preserves_flags),
        );
        vst1q_f32(out.as_mut_ptr().add(4 * j), wide);
    }
}

/// The 16 bytes at `p` as f32, four a register: signed for Q6_K's half scales, unsigned otherwise.
#[inline(always)]
unsafe fn bytes_f32(f: PackedFormat, p: *const u8) -> [float32x4_t; 4] {
    let u = vld1q_u8(p);
    let (lo, hi) = if f.split() {
        let s = vreinterpretq_s8_u8(u);
        (vmovl_s8(vget_low_s8(s)), vmovl_high_s8(s))
    } else {
        (
            vreinterpretq_s16_u16(vmovl_u8(vget_low_u8(u))),
            vreinterpretq_s16_u16(vmovl_high_u8(u)),
        )
    };
    [
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))),
        vcvtq_f32_s32(vmovl_high_s16(lo)),
        vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))),
        vcvtq_f32_s32(vmovl_high_s16(hi)),
    ]
}

/// The signed weights of outputs `4j .. 4j + 4` of the group-block whose values start at `q`: register
/// `t` holds values `4t .. 4t + 4` of each (the packed chunks' order: chunk byte `4l + i` is lane `l`'s
/// value `i` of the quad).
#[inline(always)]
unsafe fn unpack(f: PackedFormat, q: *const u8, j: usize) -> [int8x16_t; 8] {
    let mut wq = [vdupq_n_s8(0); 8];
    if !f.nibble_planes() {
        let top = vdupq_n_u8(0x80);
        for (t, v) in wq.iter_mut().enumerate() {
            *v = vreinterpretq_s8_u8(veorq_u8(vld1q_u8(q.add(64 * t + 16 * j)), top));
        }
        return wq;
    }
    let low = vdupq_n_u8(15);
    let mut wu = [vdupq_n_u8(0); 8];
    for t in 0..4 {
        let u = vld1q_u8(q.add(64 * t + 16 * j));
        wu[t] = vandq_u8(u, low);
        wu[4 + t] = vshrq_n_u8::<4>(u);
    }
    if f.high_chunks() > 0 {
        let width = vdupq_n_u8(if f == PackedFormat::Q6K { 3 } else { 1 });
        for (t, v) in wu.iter_mut().enumerate() {
            let (chunk, bit) = high_bits_at(f, t);
            let h = vld1q_u8(q.add(256 + 64 * chunk + 16 * j));
            let bits = vandq_u8(vshlq_u8(h, vdupq_n_s8(-(bit as i8))), width);
            *v = vorrq_u8(*v, vshlq_n_u8::<4>(bits));
        }
    }
    for (v, u) in wq.iter_mut().zip(wu) {
        *v = vreinterpretq_s8_u8(u);
    }
    wq
}
