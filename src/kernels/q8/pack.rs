//! Repacking GGUF weights for the kernel ([`PackedMatrix`]): decoding a GGUF block's heads and values,
//! laying 16 rows side by side per block, and dequantising the packed matrix back to f32.

use super::format::{heads_bytes, high_bits_at, offset, stride, super_bytes, SUPER};
use super::{PackedFormat, GROUP};
use crate::kernels::pages::HugeBytes;
use crate::kernels::qmatmul::{BlockMatrix, BLOCK};
use candle_core::{Error, Result};

/// `$call` monomorphised per format: evaluated with the const `$tag` (a [`PackedFormat::tag`]) set to
/// `$format`'s, so that code written for one `F: u8` has no branches on the format.
macro_rules! with_format_tag {
    ($format:expr, $tag:ident => $call:expr) => {
        with_format_tag!(@arms $format, $tag, $call, Q4_0 Q4_1 Q8_0 Q4K Q5K Q6K)
    };
    (@arms $format:expr, $tag:ident, $call:expr, $($v:ident)*) => {
        match $format {
            $(PackedFormat::$v => {
                const $tag: u8 = PackedFormat::$v.tag();
                $call
            })*
        }
    };
}

fn f16_at(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// The f32 heads of a K-quant block from its byte scales `small` (sub-block scale and minimum, or Q6_K's
/// two signed half scales) and its super-block's `sup` (`d`, and `dmin` for Q4_K / Q5_K): `[d·sc,
/// -(dmin·mn)]` or `[d·sc_lo, d·sc_hi]`. Each product is exact in f32 (11 by at most 8 significant
/// bits), so the SIMD paths, which compute the same products, give the same bits.
fn k_heads(f: PackedFormat, small: [u8; 2], sup: [f32; 2]) -> [f32; 2] {
    if f.split() {
        [sup[0] * small[0] as i8 as f32, sup[0] * small[1] as i8 as f32]
    } else {
        [sup[0] * small[0] as f32, -(sup[1] * small[1] as f32)]
    }
}

/// The K-quants' 6-bit scale and minimum of sub-block `j` (0..8) from their 12 packed bytes.
fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The heads of a GGUF block as they are packed: the 32-value formats' f16 scale (and minimum), as
/// bits; the K-quants' byte scales and their super-block's f16 `d` (and `dmin`), as bits.
#[derive(Clone, Copy)]
enum SourceHeads {
    F16([u16; 2]),
    K { small: [u8; 2], sup: [u16; 2] },
}

fn u16_at(b: &[u8]) -> u16 {
    u16::from_le_bytes([b[0], b[1]])
}

/// Block `b` (32 values) of a GGUF row: its heads (the second 0 where unused) and the 32 stored unsigned
/// values `u` (see [`offset`]). Inlined into [`pack_group`], where `f` is a constant.
#[inline(always)]
fn source(f: PackedFormat, row: &[u8], b: usize) -> (SourceHeads, [u8; BLOCK]) {
    let mut u = [0u8; BLOCK];
    let (bv, bb) = f.gguf_block();
    let blk = &row[b * BLOCK / bv * bb..][..bb];
    // Sub-block within a K-quant super-block.
    let s = b % (bv / BLOCK);
    match f {
        PackedFormat::Q4_0 | PackedFormat::Q4_1 => {
            let qs = &blk[bb - 16..];
            for i in 0..16 {
                u[i] = qs[i] & 15;
                u[16 + i] = qs[i] >> 4;
            }
            let m = if f == PackedFormat::Q4_1 {
                u16_at(&blk[2..])
            } else {
                0
            };
            (SourceHeads::F16([u16_at(blk), m]), u)
        }
        PackedFormat::Q8_0 => {
            for (o, &v) in u.iter_mut().zip(&blk[2..]) {
                *o = v ^ 0x80;
            }
            (SourceHeads::F16([u16_at(blk), 0]), u)
        }
        PackedFormat::Q4K | PackedFormat::Q5K => {
            let (sc, mn) = scale_min_k4(s, &blk[4..16]);
            let qs = if f == PackedFormat::Q4K {
                &blk[16..144]
            } else {
                &blk[48..176]
            };
            let qs = &qs[32 * (s / 2)..][..32];
            for (l, o) in u.iter_mut().enumerate() {
                *o = if s.is_multiple_of(2) {
                    qs[l] & 15
                } else {
                    qs[l] >> 4
                };
                if f == PackedFormat::Q5K {
                    *o |= ((blk[16 + l] >> s) & 1) << 4;
                }
            }
            let sup = [u16_at(blk), u16_at(&blk[2..])];
            (SourceHeads::K { small: [sc, mn], sup }, u)
        }
        PackedFormat::Q6K => {
            let (n, p) = (s / 4, s % 4);
            let ql = &blk[64 * n..][..64];
            let qh = &blk[128 + 32 * n..][..32];
            let sc = &blk[192 + 8 * n..][..8];
            for (l, o) in u.iter_mut().enumerate() {
                let byte = if p.is_multiple_of(2) { ql[l] } else { ql[l + 32] };
                let lo = if p < 2 { byte & 15 } else { byte >> 4 };
                *o = lo | (((qh[l] >> (2 * p)) & 3) << 4);
            }
            let sup = [u16_at(&blk[208..]), 0];
            (
                SourceHeads::K {
                    small: [sc[2 * p], sc[2 * p + 1]],
                    sup,
                },
                u,
            )
        }
    }
}

/// Packs one group's `n` rows (`row(l)`: row `l`'s GGUF bytes, `nb` blocks of 32) into its blocks `gdata`
/// and, for the K-quants, its super-block scales `gsup` (see [`PackedMatrix`]); monomorphised per format
/// so that [`source`]'s decoding has no branches on it (loading a 1B model is mostly this).
fn pack_group<'a, const F: u8>(
    n: usize,
    nb: usize,
    row: &impl Fn(usize) -> &'a [u8],
    gdata: &mut [u8],
    gsup: &mut [u8],
) {
    let f = PackedFormat::from_tag(F);
    let (hb, st, sb) = (heads_bytes(f), stride(f), super_bytes(f));
    for l in 0..n {
        let src = row(l);
        for b in 0..nb {
            let (heads, u) = source(f, src, b);
            let dst = &mut gdata[b * st..][..st];
            match heads {
                SourceHeads::F16(h) => {
                    for (set, bits) in h.iter().enumerate().take(if f.two_heads() { 2 } else { 1 }) {
                        dst[2 * (set * GROUP + l)..][..2].copy_from_slice(&bits.to_le_bytes());
                    }
                }
                SourceHeads::K { small, sup } => {
                    dst[l] = small[0];
                    dst[GROUP + l] = small[1];
                    let at = &mut gsup[b / SUPER * sb..][..sb];
                    for (set, bits) in sup.iter().enumerate().take(sb / (2 * GROUP)) {
                        at[2 * (set * GROUP + l)..][..2].copy_from_slice(&bits.to_le_bytes());
                    }
                }
            }
            let q = &mut dst[hb..];
            if f.nibble_planes() {
                for t in 0..4 {
                    for i in 0..4 {
                        q[64 * t + 4 * l + i] = (u[4 * t + i] & 15) | ((u[16 + 4 * t + i] & 15) << 4);
                    }
                }
                for t in (0..8).filter(|_| f.high_chunks() > 0) {
                    let (chunk, bit) = high_bits_at(f, t);
                    for i in 0..4 {
                        q[256 + 64 * chunk + 4 * l + i] |= (u[4 * t + i] >> 4) << bit;
                    }
                }
            } else {
                for t in 0..8 {
                    q[64 * t + 4 * l..][..4].copy_from_slice(&u[4 * t..][..4]);
                }
            }
        }
    }
}

/// A `[rows, cols]` GGUF weight matrix repacked for the 8-bit-activation kernel.
///
/// Rows are taken 16 at a time (a *group*; the last one padded with zero rows). For group `g` and block
/// `b` (columns `32b .. 32b + 32`), `stride` bytes at `(g · cols/32 + b) · stride`:
/// - 16 first heads (one per row of the group), then where the format has them 16 second heads (see
///   [`PackedFormat`]): f16 as in GGUF, or for the K-quants the bytes of the sub-block scales and
///   minima (Q6_K: the signed scales of the block's halves), whose super-block scales `d` (and `dmin`)
///   lie in `supers`, 16 f16 of each per group and super-block;
/// - the weights as 64-byte chunks, bytes `4l .. 4l + 4` of a chunk belonging to row `l` of the group:
///   for every format but Q8_0 chunk `t` (0..4) holds the low 4 bits of values `4t + i` in the low
///   nibbles and of `16 + 4t + i` in the high ones; Q5_K and Q6_K follow them with one and two chunks
///   of their values' high bits (`high_bits_at`); Q8_0's chunk `t` (0..8) holds values `4t + i`, a
///   byte each.
///
/// So a weight costs what it costs in the GGUF file, give or take a byte per 16 rows and super-block
/// (Q4_K 0.58, Q5_K 0.70, Q6_K 0.82 bytes against GGUF's 0.56, 0.69, 0.82).
#[derive(Clone, Debug)]
pub struct PackedMatrix {
    pub(super) format: PackedFormat,
    pub(super) rows: usize,
    pub(super) cols: usize,
    pub(super) data: HugeBytes,
    pub(super) supers: HugeBytes,
}

impl PackedMatrix {
    /// The last `bytes` bytes (at most) of the packed weights: the last groups' blocks.
    pub fn tail(&self, bytes: usize) -> &[u8] {
        &self.data[self.data.len() - bytes.min(self.data.len())..]
    }

    /// Repacks a block matrix (same values, see the type's doc).
    pub fn pack(w: &BlockMatrix) -> Self {
        let (rows, cols) = w.dims();
        Self::build(w.format().into(), rows, cols, |j| w.row(j))
    }

    /// Repacks GGUF bytes of `format` (`rows` rows of `cols` values, a whole number of GGUF blocks
    /// each); with `order`, row `i` of the result is row `order[i]` of the data.
    pub fn from_gguf(
        format: PackedFormat,
        rows: usize,
        cols: usize,
        data: &[u8],
        order: Option<&[u32]>,
    ) -> Result<Self> {
        let (bv, bb) = format.gguf_block();
        if !cols.is_multiple_of(bv) {
            return Err(Error::Msg(format!(
                "{format:?} matrix needs a multiple of {bv} columns, got {cols}"
            )));
        }
        let rb = cols / bv * bb;
        if data.len() != rows * rb {
            return Err(Error::Msg(format!(
                "{format:?} [{rows}, {cols}] matrix needs {} bytes, got {}",
                rows * rb,
                data.len()
            )));
        }
        if let Some(o) = order {
            if o.len() != rows || o.iter().any(|&j| j as usize >= rows) {
                return Err(Error::Msg(format!("row order does not fit {rows} rows")));
            }
        }
        let row = |j: usize| {
            let j = order.map_or(j, |o| o[j] as usize);
            &data[j * rb..(j + 1) * rb]
        };
        Ok(Self::build(format, rows, cols, row))
    }

    /// Groups are packed in parallel (rayon, at load only): a 1B model's 1.2 G weights took seconds
    /// on one core.
    fn build<'a>(
        format: PackedFormat,
        rows: usize,
        cols: usize,
        row: impl Fn(usize) -> &'a [u8] + Sync,
    ) -> Self {
        use rayon::prelude::*;
        let f = format;
        let nb = cols / BLOCK;
        let st = stride(f);
        let (ns, sb) = (nb / SUPER, super_bytes(f));
        let groups = rows.div_ceil(GROUP);
        let mut data = HugeBytes::zeroed(groups * nb * st);
        let mut supers = HugeBytes::zeroed(groups * ns * sb);
        let pack = |g: usize, gdata: &mut [u8], gsup: &mut [u8]| {
            // Written before anything reads it: a page whose first touch is a read is first mapped to
            // the shared zero page and faults again, with a TLB flush on every core, when written.
            gdata.fill(0);
            let n = GROUP.min(rows - g * GROUP);
            let row = |l: usize| row(g * GROUP + l);
            with_format_tag!(f, F => pack_group::<F>(n, nb, &row, gdata, gsup))
        };
        if sb == 0 {
            data.par_chunks_mut(nb * st)
                .enumerate()
                .for_each(|(g, gd)| pack(g, gd, &mut []));
        } else {
            data.par_chunks_mut(nb * st)
                .zip(supers.par_chunks_mut(ns * sb))
                .enumerate()
                .for_each(|(g, (gd, gs))| pack(g, gd, gs));
        }
        PackedMatrix {
            format,
            rows,
            cols,
            data,
            supers,
        }
    }

    /// The two heads (the second 0 where unused) of row `l` of group `g`, block `b`, as the kernels
    /// multiply them.
    pub(super) fn heads(&self, g: usize, b: usize, l: usize) -> [f32; 2] {
        let (f, nb) = (self.format, self.cols / BLOCK);
        let blk = &self.data[(g * nb + b) * stride(f)..];
        if f.k_quant() {
            let sb = super_bytes(f);
            let sup = &self.supers[(g * (nb / SUPER) + b / SUPER) * sb..][..sb];
            let dmin = if sb > 2 * GROUP {
                f16_at(&sup[2 * (GROUP + l)..])
            } else {
                0.0
            };
            k_heads(f, [blk[l], blk[GROUP + l]], [f16_at(&sup[2 * l..]), dmin])
        } else {
            let h1 = if f.two_heads() {
                f16_at(&blk[2 * (GROUP + l)..])
            } else {
                0.0
            };
            [f16_at(&blk[2 * l..]), h1]
        }
    }

    /// Stored value `i` (0..32) of row `l` of a group-block.
    fn stored(&self, blk: &[u8], l: usize, i: usize) -> u8 {
        let f = self.format;
        let q = &blk[heads_bytes(f)..];
        if f.nibble_planes() {
            let byte = q[64 * (i % 16 / 4) + 4 * l + i % 4];
            let low = if i < 16 { byte & 15 } else { byte >> 4 };
            if f.high_chunks() == 0 {
                return low;
            }
            let (chunk, bit) = high_bits_at(f, i / 4);
            let width = if f == PackedFormat::Q6K { 3 } else { 1 };
            low | (((q[256 + 64 * chunk + 4 * l + i % 4] >> bit) & width) << 4)
        } else {
            q[64 * (i / 4) + 4 * l + i % 4]
        }
    }

    /// All weights as f32, row-major `[rows, cols]`: the values the kernel multiplies (the same as
    /// candle's and llama.cpp's dequantisation of the GGUF data).
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        for (j, row) in out.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(j, row);
        }
        out
    }

    /// Row `j` as f32 into `out` (`cols` values): an embedding lookup, without a dense copy of the table.
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        let (nb, st, f) = (self.cols / BLOCK, stride(self.format), self.format);
        assert!(
            j < self.rows && out.len() == self.cols,
            "dequantize_row: row {j} of {}",
            self.rows
        );
        let (g, l) = (j / GROUP, j % GROUP);
        for (b, o) in out.chunks_exact_mut(BLOCK).enumerate() {
            let blk = &self.data[(g * nb + b) * st..][..st];
            let [h0, h1] = self.heads(g, b, l);
            for (i, o) in o.iter_mut().enumerate() {
                let v = (self.stored(blk, l, i) as i32 - offset(f)) as f32;
                *o = if f.split() {
                    if i < 16 {
                        h0 * v
                    } else {
                        h1 * v
                    }
                } else if f.two_heads() {
                    h0 * v + h1
                } else {
                    h0 * v
                };
            }
        }
    }

    pub fn format(&self) -> PackedFormat {
        self.format
    }

    /// `(rows, cols)`: rows are outputs, cols are inputs.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    /// Bytes held (what a product reads).
    pub fn bytes(&self) -> usize {
        self.data.len() + self.supers.len()
    }

    pub(super) fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }
}
