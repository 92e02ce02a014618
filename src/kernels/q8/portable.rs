//! The portable path: each group-block unpacked once into signed weights `[32][16]` (outputs innermost,
//! so the integer loops vectorise on any target), then every row of `x` against it.

use super::format::{heads_bytes, high_bits_at, offset, stride};
use super::{Out, PackedFormat, PackedMatrix, QuantRows, GROUP};
use crate::kernels::qmatmul::BLOCK;

/// This variant's task ([`super::TaskFn`]): the format's entry below.
pub(super) fn task(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    match w.format {
        PackedFormat::Q4_0 => matmul_q4_0_q8(a, w, g0, out),
        PackedFormat::Q4_1 => matmul_q4_1_q8(a, w, g0, out),
        PackedFormat::Q8_0 => matmul_q8_0_q8(a, w, g0, out),
        PackedFormat::Q4K => matmul_q4k_q8(a, w, g0, out),
        PackedFormat::Q5K => matmul_q5k_q8(a, w, g0, out),
        PackedFormat::Q6K => matmul_q6k_q8(a, w, g0, out),
    }
}

/// Q4_0 (nibbles less 8, one f16 scale): [`groups`].
fn matmul_q4_0_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    groups(a, w, g0, out)
}

/// Q4_1 (nibbles, f16 scale and minimum): [`groups`].
fn matmul_q4_1_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    groups(a, w, g0, out)
}

/// Q8_0 (int8, one f16 scale): [`groups`], one byte a weight.
fn matmul_q8_0_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    groups(a, w, g0, out)
}

/// Q4_K (nibbles, K-quant scale and minimum heads): [`groups`].
fn matmul_q4k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    groups(a, w, g0, out)
}

/// Q5_K (nibbles and a high-bit chunk, K-quant heads): [`groups`].
fn matmul_q5k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    groups(a, w, g0, out)
}

/// Q6_K (nibbles and two high-bit chunks less 32, half-block scales): [`groups`], the halves summed
/// apart.
fn matmul_q6k_q8(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    groups(a, w, g0, out)
}

/// The portable path for every format (read from `w`, not monomorphised): groups `g0 ..` of `w`, one
/// at a time, each group-block unpacked once and multiplied by every row of `a`.
fn groups(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
    let (m, k, nb) = (a.rows, a.cols, a.cols / BLOCK);
    assert!(g0 + out.groups <= w.groups());
    let mut og = vec![0.0f32; GROUP * m];
    let (f, st) = (w.format, stride(w.format));
    let c = offset(f) as i16;
    let mut wq = [[0i16; GROUP]; BLOCK];
    let (mut h0, mut h1) = ([0f32; GROUP], [0f32; GROUP]);
    for gi in 0..out.groups {
        og.fill(0.0);
        for b in 0..nb {
            let blk = &w.data[((g0 + gi) * nb + b) * st..][..st];
            for l in 0..GROUP {
                [h0[l], h1[l]] = w.heads(g0 + gi, b, l);
            }
            // Chunk bytes 4l + i belong to lane l: stride-4 reads (one `ld4` on NEON).
            let q = &blk[heads_bytes(f)..];
            if f.nibble_planes() {
                for t in 0..4 {
                    let ch = &q[64 * t..64 * t + 64];
                    for i in 0..4 {
                        for l in 0..GROUP {
                            let u = ch[4 * l + i] as i16;
                            wq[4 * t + i][l] = u & 15;
                            wq[16 + 4 * t + i][l] = u >> 4;
                        }
                    }
                }
                for t in (0..8).filter(|_| f.high_chunks() > 0) {
                    let (chunk, bit) = high_bits_at(f, t);
                    let width = if f == PackedFormat::Q6K { 3 } else { 1 };
                    let ch = &q[256 + 64 * chunk..][..64];
                    for i in 0..4 {
                        for l in 0..GROUP {
                            wq[4 * t + i][l] |= ((ch[4 * l + i] >> bit) as i16 & width) << 4;
                        }
                    }
                }
                wq.iter_mut().flatten().for_each(|v| *v -= c);
            } else {
                for t in 0..8 {
                    let ch = &q[64 * t..64 * t + 64];
                    for i in 0..4 {
                        for l in 0..GROUP {
                            wq[4 * t + i][l] = ch[4 * l + i] as i16 - c;
                        }
                    }
                }
            }
            for (r, acc) in og.chunks_exact_mut(GROUP).enumerate() {
                let xq = &a.q[r * k + b * BLOCK..][..BLOCK];
                let (mut lo, mut hi) = ([0i32; GROUP], [0i32; GROUP]);
                for (wk, &xv) in wq[..16].iter().zip(&xq[..16]) {
                    for (s, &wv) in lo.iter_mut().zip(wk) {
                        *s += wv as i32 * xv as i32;
                    }
                }
                for (wk, &xv) in wq[16..].iter().zip(&xq[16..]) {
                    for (s, &wv) in hi.iter_mut().zip(wk) {
                        *s += wv as i32 * xv as i32;
                    }
                }
                let ab = r * nb + b;
                let (dx, sx) = (a.d[ab], a.s[ab]);
                for l in 0..GROUP {
                    if f.split() {
                        acc[l] = (h0[l] * dx).mul_add(lo[l] as f32, acc[l]);
                        acc[l] = (h1[l] * dx).mul_add(hi[l] as f32, acc[l]);
                    } else {
                        acc[l] = (h0[l] * dx).mul_add((lo[l] + hi[l]) as f32, acc[l]);
                        if f.two_heads() {
                            acc[l] = h1[l].mul_add(sx, acc[l]);
                        }
                    }
                }
            }
        }
        for (r, acc) in og.chunks_exact(GROUP).enumerate() {
            // SAFETY: group gi of this task, row r < m.
            unsafe { std::slice::from_raw_parts_mut(out.at(gi, r), GROUP) }.copy_from_slice(acc);
        }
    }
}
