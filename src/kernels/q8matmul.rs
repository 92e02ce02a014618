//! Row-invariant `y = x · Wᵀ` from GGUF Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K weights with 8-bit
//! activations: the dot products are taken in integers.
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
//!    nibble minus 8 for Q4_0, the nibble for Q4_1, the int8 for Q8_0, the 4-, 5- or 6-bit value of
//!    the K-quants, minus 32 for Q6_K). `|isum| < 2^20`, so `f32(isum)` is exact. Q6_K takes two sums,
//!    over the block's halves.
//! 3. `acc = 0`; for each block in increasing order, `acc = fma(d_w · d_x, f32(isum), acc)`, then for
//!    Q4_1 / Q4_K / Q5_K `acc = fma(m_w, s_x, acc)` (`m_w` the block's minimum, negative for the
//!    K-quants); for Q6_K `acc = fma(d_lo · d_x, f32(isum_lo), acc)`, then `acc = fma(d_hi · d_x,
//!    f32(isum_hi), acc)`. Products rounded to f32 and fused multiply-adds (single rounding: `vfmadd`
//!    on x86, `f32::mul_add` in the portable path), nothing else. The K-quants' heads `d_w = d·sc`,
//!    `m_w = -dmin·mn` are exact in f32, resolved at load.
//!
//! The integer part is exact in any order and the f32 part is a fixed sequence per output, so every
//! variant (portable, AVX2, AVX-VNNI, AVX-512 VNNI) gives the same bits, and a row's outputs do not
//! depend on the other rows of the block, the tile it lands in, or the thread count.
//!
//! # Layout and speed
//! At load the weights are repacked ([`PackedMatrix`]): 16 output rows side by side per block, so that
//! one 512-bit register (two 256-bit ones) holds 4 consecutive weights of each of 16 outputs and
//! `vpdpbusd` against 4 broadcast activations accumulates 16 outputs at once, with no horizontal sums.
//! Every format keeps about its GGUF bytes per weight: 4-bit values stay packed two to a byte (Q5_K's and
//! Q6_K's high bits in planes beside them), the 32-value formats keep their f16 heads, and the K-quants
//! keep their sub-block scales as bytes and their super-block scales apart (Q4_K 0.58, Q5_K 0.70, Q6_K
//! 0.82 bytes per weight against GGUF's 0.56, 0.69 and 0.82; see [`PackedMatrix`]). Each block
//! of weights is loaded and unpacked once per tile of up to 8 activation rows, and every row of the
//! tile only adds integer multiply-adds and its one f32 step. Output groups are split into ranges that
//! the kernel pool ([`super::pool`]) spreads over threads; each output is computed by one thread.

use super::isa::Isa;
use super::pages::HugeBytes;
use super::qmatmul::{BlockFormat, BlockMatrix, BLOCK};
use candle_core::{Device, Error, Result, Tensor};

/// Output rows per packed group: the lanes of one 512-bit register of i32 / f32.
pub const GROUP: usize = 16;

/// Activation rows per register tile (of the x86 variants).
#[cfg(target_arch = "x86_64")]
const TILE_ROWS: usize = 8;

/// A product is split over the kernel pool's threads ([`super::pool`]) when it has at least this many
/// weight-activation products: a hand-off to a spinning worker costs about a microsecond, which SmolLM2's
/// 192 x 576 products (2 µs for one row) do not repay, its 576 x 576 ones (7.5 µs) do. (Results do not
/// depend on it.)
const PAR_MIN_WORK: usize = 1 << 18;

/// The fewest weight bytes one claim of a product's groups takes ([`super::pool::Pool::run_ranges`]):
/// a few microseconds of streaming, against the fraction of one a claim costs.
const MIN_TASK_BYTES: usize = 32 << 10;

/// The variants this kernel implements, best first.
pub const VARIANTS: [Isa; 4] = [Isa::Avx512Vnni, Isa::AvxVnni, Isa::Avx2, Isa::Portable];

/// The fastest variant this CPU has.
pub fn default_isa() -> Isa {
    Isa::best_of(&VARIANTS)
}

/// A GGUF weight format this kernel reads: the 32-value block formats, and the K-quants, whose 256-value
/// super-blocks are taken as 8 blocks of 32 with their two-level scales resolved into f32 heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PackedFormat {
    Q4_0,
    Q4_1,
    Q8_0,
    /// Per block of 32: weight = `(d·sc)·q - dmin·mn` with 6-bit `sc`, `mn` and 4-bit `q`.
    Q4K,
    /// As Q4_K with 5-bit `q`.
    Q5K,
    /// Per half-block of 16: weight = `(d·sc)·(q - 32)` with an int8 `sc` and 6-bit `q`.
    Q6K,
}

impl PackedFormat {
    pub const ALL: [PackedFormat; 6] = [
        PackedFormat::Q4_0,
        PackedFormat::Q4_1,
        PackedFormat::Q8_0,
        PackedFormat::Q4K,
        PackedFormat::Q5K,
        PackedFormat::Q6K,
    ];

    /// The format of a GGML dtype, if this kernel reads it.
    pub fn of_ggml(t: candle_core::quantized::GgmlDType) -> Option<Self> {
        use candle_core::quantized::GgmlDType as G;
        Some(match t {
            G::Q4_0 => PackedFormat::Q4_0,
            G::Q4_1 => PackedFormat::Q4_1,
            G::Q8_0 => PackedFormat::Q8_0,
            G::Q4K => PackedFormat::Q4K,
            G::Q5K => PackedFormat::Q5K,
            G::Q6K => PackedFormat::Q6K,
            _ => return None,
        })
    }

    /// Values and bytes per GGUF block.
    pub const fn gguf_block(self) -> (usize, usize) {
        match self {
            PackedFormat::Q4_0 => (32, 18),
            PackedFormat::Q4_1 => (32, 20),
            PackedFormat::Q8_0 => (32, 34),
            PackedFormat::Q4K => (256, 144),
            PackedFormat::Q5K => (256, 176),
            PackedFormat::Q6K => (256, 210),
        }
    }

    /// Const-generic tag (for monomorphised kernels and packing).
    const fn tag(self) -> u8 {
        self as u8
    }

    const fn from_tag(t: u8) -> Self {
        match t {
            0 => PackedFormat::Q4_0,
            1 => PackedFormat::Q4_1,
            2 => PackedFormat::Q8_0,
            3 => PackedFormat::Q4K,
            4 => PackedFormat::Q5K,
            _ => PackedFormat::Q6K,
        }
    }

    /// Values of at most 4 bits (the kernels' nibble path: two values per byte, 16-bit partial sums).
    const fn four_bit(self) -> bool {
        matches!(self, PackedFormat::Q4_0 | PackedFormat::Q4_1 | PackedFormat::Q4K)
    }

    /// The low 4 bits of every value stored as nibbles (all but Q8_0); Q5_K and Q6_K keep their
    /// remaining bits in [`Self::high_chunks`] chunks after them.
    const fn nibble_planes(self) -> bool {
        !matches!(self, PackedFormat::Q8_0)
    }

    /// 64-byte chunks of high bits after the nibbles: Q5_K's fifth bit (one), Q6_K's two (two).
    const fn high_chunks(self) -> usize {
        match self {
            PackedFormat::Q5K => 1,
            PackedFormat::Q6K => 2,
            _ => 0,
        }
    }

    /// The K-quants: per-row scales `d` (and `dmin`) once per 256-value super-block, kept apart from
    /// the blocks ([`PackedMatrix`]'s `supers`), and a byte of sub-block scale (and minimum) per block.
    /// The kernels multiply them back into the f32 heads (`d·sc` and `-dmin·mn`, exact in f32), so
    /// the heads cost 1 byte per 16 weights instead of 4 bytes per 16.
    const fn k_quant(self) -> bool {
        matches!(self, PackedFormat::Q4K | PackedFormat::Q5K | PackedFormat::Q6K)
    }

    /// Two heads per row and block: a scale and a minimum (Q4_1, Q4_K, Q5_K), or the scales of the
    /// block's two halves (Q6_K).
    const fn two_heads(self) -> bool {
        !matches!(self, PackedFormat::Q4_0 | PackedFormat::Q8_0)
    }

    /// The second head scales the second 16 values (Q6_K) rather than being a minimum.
    const fn split(self) -> bool {
        matches!(self, PackedFormat::Q6K)
    }
}

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

impl From<BlockFormat> for PackedFormat {
    fn from(f: BlockFormat) -> Self {
        match f {
            BlockFormat::Q4_0 => PackedFormat::Q4_0,
            BlockFormat::Q4_1 => PackedFormat::Q4_1,
            BlockFormat::Q8_0 => PackedFormat::Q8_0,
        }
    }
}

/// Bytes of heads per group-block: 16 first heads and, where the format has them, 16 second ones; an
/// f16 each for the 32-value formats, a byte each (sub-block scales and minima) for the K-quants.
const fn heads_bytes(f: PackedFormat) -> usize {
    let head = if f.k_quant() { 1 } else { 2 };
    GROUP * head * if f.two_heads() { 2 } else { 1 }
}

/// Bytes of quantised weights per group-block: 16 rows × 32 nibbles (and the high bits) or bytes.
const fn quant_bytes(f: PackedFormat) -> usize {
    if f.nibble_planes() {
        GROUP * BLOCK / 2 + 64 * f.high_chunks()
    } else {
        GROUP * BLOCK
    }
}

/// Bytes of the K-quants' super-block scales per group and super-block: 16 f16 `d`, and for Q4_K /
/// Q5_K 16 f16 `dmin` after them.
const fn super_bytes(f: PackedFormat) -> usize {
    match f {
        PackedFormat::Q4K | PackedFormat::Q5K => 4 * GROUP,
        PackedFormat::Q6K => 2 * GROUP,
        _ => 0,
    }
}

/// Blocks of 32 per K-quant super-block.
const SUPER: usize = 8;

/// Bytes per group-block.
const fn stride(f: PackedFormat) -> usize {
    heads_bytes(f) + quant_bytes(f)
}

/// `c` such that a weight's integer is `u - c`, where `u` is the unsigned value stored for it: Q4_0's
/// nibble (weight + 8), Q8_0's int8 + 128, Q6_K's 6-bit value (weight + 32), the others' value itself.
/// So `isum = Σ u·q - c·Σq`.
const fn offset(f: PackedFormat) -> i32 {
    match f {
        PackedFormat::Q4_0 => 8,
        PackedFormat::Q8_0 => 128,
        PackedFormat::Q6K => 32,
        _ => 0,
    }
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

/// Where the high bits of value `4t + i` (`t` 0..8: the value quads of the byte path) of a group-block
/// row lie in its high chunks: the chunk (0 or 1) and the bit they start at. Q5_K keeps bit 4 of quad
/// `t` at bit `t`; Q6_K bits 4-5 of quad `t` in chunk `t / 4` at bit `2·(t % 4)`.
const fn high_bits_at(f: PackedFormat, t: usize) -> (usize, u32) {
    match f {
        PackedFormat::Q6K => (t / 4, 2 * (t % 4) as u32),
        _ => (0, t as u32),
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
    format: PackedFormat,
    rows: usize,
    cols: usize,
    data: HugeBytes,
    supers: HugeBytes,
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
    fn heads(&self, g: usize, b: usize, l: usize) -> [f32; 2] {
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

    fn groups(&self) -> usize {
        self.rows.div_ceil(GROUP)
    }
}

/// Activation rows quantised per block of 32 (step 1 of the module's recipe).
#[derive(Clone, Debug, Default)]
pub struct QuantRows {
    rows: usize,
    cols: usize,
    /// `[rows, cols]` int8 values.
    q: Vec<i8>,
    /// Per row and block: the scale `d_x`.
    d: Vec<f32>,
    /// Per row and block: `Σq`, and over the block's first 16 values (what `s` and `starts` are made
    /// from).
    sum: Vec<i32>,
    sum_lo: Vec<i32>,
    /// Per row and block: `d_x · f32(Σq)`.
    s: Vec<f32>,
    /// Per row and block: the integer sums' starting values `-c·Σq` for the formats with an offset
    /// `c` ([`offset`]), at [`start_slot`], so that the x86 kernels load them (a broadcast from memory)
    /// instead of computing them for every tile of outputs (a multiply and a move into a vector
    /// register per row and block: 8-row Q6_K tiles, one thread, weights in L2, went 0.078-0.086 ->
    /// 0.064-0.071 ms for 512 x 2048 on AVX-512 VNNI, 0.148-0.156 -> 0.127-0.129 on AVX2).
    starts: Vec<[i32; 4]>,
}

/// Where [`QuantRows`]' `starts` keep the starting value for format `f` (one with an [`offset`]) and,
/// for Q6_K, the block's half `half`.
const fn start_slot(f: PackedFormat, half: usize) -> usize {
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
    let pool = super::pool::Pool::global();
    let per_task = if rows * cols >= QUANTIZE_PAR_MIN {
        rows.div_ceil(pool.threads())
    } else {
        rows.max(1)
    };
    let nb = cols / BLOCK;
    let q = super::pool::SharedMut::new(&mut out.q);
    let d = super::pool::SharedMut::new(&mut out.d);
    let sum = super::pool::SharedMut::new(&mut out.sum);
    let sum_lo = super::pool::SharedMut::new(&mut out.sum_lo);
    let sc = super::pool::SharedMut::new(&mut out.s);
    let starts = super::pool::SharedMut::new(&mut out.starts);
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

/// Rows quantised by one task when a product has at least this many activations (a hand-off costs
/// about a microsecond, a row of 576 about half of one).
const QUANTIZE_PAR_MIN: usize = 4 * 1536;

/// The outputs of [`quantize_rows`] for a run of blocks.
struct Blocks<'a> {
    q: &'a mut [i8],
    d: &'a mut [f32],
    sum: &'a mut [i32],
    sum_lo: &'a mut [i32],
    s: &'a mut [f32],
    starts: &'a mut [[i32; 4]],
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

/// [`quantize_blocks`] on the widest vectors the CPU has ([`Width::best`], detected once), written out
/// for AVX-512 and AVX2 ([`quantize_blocks_avx512`], [`quantize_blocks_avx2`]): the compiler's
/// vectorisation of the portable loop took two cycles a value, 5% of a prefill, and on AVX2 1.8% of
/// SmolLM2's decoding. The same IEEE and integer operations on every path: the same bits (tested).
fn quantize_blocks_with(x: &[f32], out: Blocks) {
    #[cfg(target_arch = "x86_64")]
    {
        use super::attention::Width;
        match Width::best() {
            // SAFETY: `Width::best` only names a width the CPU has (W512: Isa::Avx512, AVX-512 F/VL;
            // W256: AVX2 and FMA).
            Width::W512 => return unsafe { quantize_blocks_avx512(x, out) },
            Width::W256 => return unsafe { quantize_blocks_avx2(x, out) },
            Width::Portable => {}
        }
    }
    quantize_blocks(x, out)
}

/// [`quantize_blocks`] in AVX-512, a block of 32 values as two vectors: the largest magnitude as an
/// integer maximum of the bits, `d` and `1/d` as the portable code takes them, `v · (1/d)` then `+
/// ROUND_MAGIC` (two roundings, as the portable code, which Rust never fuses), the integers truncated to
/// bytes (`vpmovdb`, as `as i8`), and the sums exact in integers.
///
/// # Safety
/// The CPU must have AVX-512 F and VL ([`Isa::Avx512`]).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
unsafe fn quantize_blocks_avx512(x: &[f32], mut out: Blocks) {
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
unsafe fn quantize_blocks_avx2(x: &[f32], mut out: Blocks) {
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
fn quantize_blocks(x: &[f32], mut out: Blocks) {
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

/// Where a task writes: the 16 outputs of its `gi`-th group for row `r` at `ptr + r·ld + gi·16`.
/// Tasks own disjoint column ranges of the same rows, so they share the pointer.
#[derive(Clone, Copy)]
struct Out {
    ptr: *mut f32,
    ld: usize,
    groups: usize,
}

impl Out {
    /// # Safety
    /// `gi < groups` and `r` within the rows the pointer was made for.
    unsafe fn at(self, gi: usize, r: usize) -> *mut f32 {
        self.ptr.add(r * self.ld + gi * GROUP)
    }

    /// Where groups `lo .. hi` of these go: a task's share.
    ///
    /// # Safety
    /// `lo <= hi <= groups`.
    unsafe fn groups(self, lo: usize, hi: usize) -> Out {
        Out {
            ptr: self.at(lo, 0),
            groups: hi - lo,
            ..self
        }
    }
}

/// One task: groups `g0 .. g0 + out.groups` for every row.
type TaskFn = fn(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out);

/// The variant's task.
///
/// # Panics
/// If the variant is not implemented.
fn task_of(isa: Isa) -> TaskFn {
    match isa {
        Isa::Portable => portable::task,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::task,
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => avxvnni::task,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => avx512vnni::task,
        _ => panic!("matmul_q8 has no {isa:?} variant"),
    }
}

/// The product of already quantised rows (`y`: [a.rows, n]).
pub fn matmul_quantized_with(isa: Isa, a: &QuantRows, w: &PackedMatrix, y: &mut [f32]) {
    matmul_quantized_many(isa, a, &[w], &mut [y])
}

/// The products of the same quantised rows with several matrices (`ys[i]`: `[a.rows, ws[i] rows]`), as one
/// job on the kernel pool: a layer's q/k/v or gate/up projections share one quantisation of their input
/// and one hand-off, and the small ones no longer run alone.
///
/// # Panics
/// If a shape does not match, or the variant is not implemented or not available.
pub fn matmul_quantized_many(isa: Isa, a: &QuantRows, ws: &[&PackedMatrix], ys: &mut [&mut [f32]]) {
    assert_eq!(ws.len(), ys.len(), "matmul_q8: one output per matrix");
    for (w, y) in ws.iter().zip(ys.iter()) {
        let n = w.dims().0;
        assert_eq!(
            y.len(),
            a.rows * n,
            "matmul_q8: y must hold m*n = {}*{n} values",
            a.rows
        );
    }
    let ys: Vec<*mut f32> = ys.iter_mut().map(|y| y.as_mut_ptr()).collect();
    // SAFETY: each pointer holds a.rows * n values (checked above).
    unsafe { products_into(isa, a, ws, &ys) }
}

/// The products of [`matmul_quantized_many`] into `ys[i]`, every one of its `a.rows · n` values written
/// (never read): the outputs may be fresh, uninitialised allocations, which spares zero-filling them
/// (4% of a prefill's samples went to `memset`).
///
/// # Safety
/// `ys[i]` must be valid for writes of `a.rows · ws[i] rows` f32s, and the outputs must not overlap.
///
/// # Panics
/// As [`matmul_quantized_many`].
unsafe fn products_into(isa: Isa, a: &QuantRows, ws: &[&PackedMatrix], ys: &[*mut f32]) {
    assert_eq!(ws.len(), ys.len(), "matmul_q8: one output per matrix");
    let m = a.rows;
    for w in ws {
        let k = w.dims().1;
        assert_eq!(a.cols, k, "matmul_q8: x has {} columns, the weight {k}", a.cols);
    }
    assert!(
        isa.available(),
        "matmul_q8: {isa:?} requested on a CPU without it"
    );
    if m == 0 {
        return;
    }
    let task = task_of(isa);
    let pool = super::pool::Pool::global();
    let work: usize = ws.iter().map(|w| m * w.rows * w.cols).sum();
    let parallel = work >= PAR_MIN_WORK;
    // Per matrix: where its groups' outputs go (`y` itself, rows of whole groups; a padded copy when
    // the last group is partial) and where its groups start in the job's run of groups (the matrices'
    // groups one after the other).
    struct Part<'a> {
        w: &'a PackedMatrix,
        first: usize,
        out: Out,
    }
    // SAFETY: tasks write disjoint groups (column ranges) through `out`.
    unsafe impl Sync for Part<'_> {}
    let mut bufs: Vec<Vec<f32>> = ws
        .iter()
        .map(|w| {
            if w.rows.is_multiple_of(GROUP) {
                Vec::new()
            } else {
                vec![0.0f32; w.groups() * GROUP * m]
            }
        })
        .collect();
    let mut parts = Vec::with_capacity(ws.len());
    let mut groups = 0;
    // The fewest groups a claim takes: MIN_TASK_BYTES of weights in the matrix of the smallest groups.
    let mut min_groups = 1;
    for ((w, &y), buf) in ws.iter().zip(ys).zip(bufs.iter_mut()) {
        let n = w.groups();
        if n == 0 {
            continue;
        }
        let out = if buf.is_empty() {
            Out {
                ptr: y,
                ld: w.rows,
                groups: n,
            }
        } else {
            Out {
                ptr: buf.as_mut_ptr(),
                ld: n * GROUP,
                groups: n,
            }
        };
        parts.push(Part {
            w,
            first: groups,
            out,
        });
        groups += n;
        min_groups = min_groups.max(MIN_TASK_BYTES.div_ceil(w.bytes() / n));
    }
    // Groups `g0 .. g1` of the job, matrix by matrix.
    let run = |g0: usize, g1: usize| {
        for p in &parts {
            let (lo, hi) = (g0.max(p.first), g1.min(p.first + p.out.groups));
            if lo >= hi {
                continue;
            }
            let (lo, hi) = (lo - p.first, hi - p.first);
            // SAFETY: this range writes groups lo .. hi of the matrix, which no other range touches.
            task(a, p.w, lo, unsafe { p.out.groups(lo, hi) })
        }
    };
    if !parallel {
        run(0, groups);
    } else {
        pool.run_ranges(groups, min_groups, &run);
    }
    for ((w, &y), buf) in ws.iter().zip(ys).zip(&bufs) {
        if buf.is_empty() {
            continue;
        }
        let (n, ld) = (w.rows, w.groups() * GROUP);
        for (r, br) in buf.chunks_exact(ld).enumerate() {
            // SAFETY: row r of y (n values from r · n) lies inside y's m · n (the caller's contract).
            unsafe { std::ptr::copy_nonoverlapping(br.as_ptr(), y.add(r * n), n) };
        }
    }
}

/// The portable path: each group-block unpacked once into signed weights `[32][16]` (outputs innermost,
/// so the integer loops vectorise on any target), then every row of `x` against it.
mod portable {
    use super::*;

    pub(super) fn task(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
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
}

/// Group-blocks ahead of the one being multiplied that the x86 tiles ask the caches for. A tile walks
/// one group's blocks in order, but at 1 row it is bound by memory and at 8 rows by arithmetic, and the
/// hardware prefetcher alone left the arithmetic waiting on loads: on SmolLM2 (`probespec cost`, 2
/// threads, nothing cached) prefetching 4 blocks ahead took one row 5.6 -> 4.9 ms and 8 rows 10.3 ->
/// 8.5 ms with AVX-512 VNNI, 6.5 -> 5.0 and 13.8 -> 11.0 ms with AVX2; 2, 8 and 16 blocks measured
/// within noise of 4 there. At Llama-3.2-1B's shapes, whose products stream tens of MB, 16 blocks ahead
/// into the outer caches (`prefetcht2`) beat 4 into L1 by 5-25% at one row (`real_shape_timing`, 3
/// interleaved rounds on the EPYC Zen 5: medians of Q4_K 8192 x 2048 0.368 -> 0.327 ms, Q8_0 0.638 ->
/// 0.481, the Q6_K vocabulary 7.55 -> 7.07), and 32 blocks or no prefetch at all did no better.
#[cfg(target_arch = "x86_64")]
const PREFETCH_BLOCKS: usize = 16;

/// Asks for the group-block `PREFETCH_BLOCKS` ahead of block `b` of a group whose `nb` blocks of `st`
/// bytes start at `wg`, in a tile of `groups` consecutive groups. Past the group's end that is the
/// same group of the next tile (`groups` groups on), which is what this stream reads next: the group
/// right after it is another stream of this tile, already read. Past the matrix's end included
/// (harmless).
///
/// `into_l1`: into L1 instead (`prefetcht0`), for the AVX-512 tiles of 8 rows of the K-quants, which
/// take long enough over each group-block that lines 16 blocks ahead are not evicted before use, and
/// whose loads then wait less on L2 (`real_shape_timing`, 2 threads, the Xeon, 3 interleaved rounds, 8
/// rows: the Q6_K 128256 x 2048 vocabulary 12.86-13.08 -> 11.98-12.32 ms, Q6_K 2048 x 8192 0.95-0.99 ->
/// 0.90-0.95, Q4_K 8192 x 2048 0.47-0.50 -> 0.43-0.48). Fewer rows lost by it (at 4 rows the
/// vocabulary 9.7-10.2 -> 10.6-10.8 ms; at one row 8.5-8.6 -> 11.8-11.9), and Q4_0 and Q8_0, whose
/// two-group tiles would hold 9-17 KB of lines ahead in L1, gained nothing.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_ahead(wg: *const u8, b: usize, nb: usize, st: usize, groups: usize, into_l1: bool) {
    let ahead = b + PREFETCH_BLOCKS;
    let ahead = if ahead < nb {
        ahead
    } else {
        ahead + (groups - 1) * nb
    };
    if into_l1 {
        super::prefetch_l1(wg.wrapping_add(ahead * st), st);
    } else {
        super::prefetch_l2(wg.wrapping_add(ahead * st), st);
    }
}

/// `[f(0), .., f(n - 1)]` written out as a loop: `std::array::from_fn`'s closure is a function of its
/// own, without the caller's target features, which the compiler may leave out of line (a call per
/// vector: the 256-bit tiles ran 60% slower for Q8_0 and Q6_K when it did).
#[cfg(target_arch = "x86_64")]
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
/// 8 lanes. At up to four rows both halves run in one pass over the group's blocks (at one and two rows
/// two groups at once where that measured faster: `TWO_GROUPS_ROWS`); at more, the registers hold one
/// half's sums only, and the halves run one after the other, the second re-reading the group's weights
/// from L1 / L2. Before, one row ran in two passes too: memory idled through the
/// second, and a product streamed 22-25 GB/s where a read loop gets 30-37 GB/s (Zen 3, 2 threads;
/// `real_shape_timing`, interleaved runs: Q4_K 8192 x 2048 at one row 0.40-0.51 -> 0.32-0.38 ms, the
/// Q6_K 128256 x 2048 vocabulary 9.0-10.0 -> 5.9-7.2 ms, one run of seven at 11.5 on a busy host).
#[cfg(target_arch = "x86_64")]
macro_rules! avx256_variant {
    ($name:ident, $features:literal, $vnni:literal) => {
        mod $name {
            use super::*;
            use std::arch::x86_64::*;

            pub(super) fn task(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                assert!(g0 + out.groups <= w.groups());
                // SAFETY: `matmul_quantized_with` picks this variant only if the CPU has its features;
                // `run` stays inside `w`'s groups `g0 ..` that `out` covers and `a`'s rows.
                unsafe { with_format_tag!(w.format, F => run::<F>(a, w, g0, out)) }
            }

            /// The most rows at which a tile takes two groups at a time (both halves of each: four
            /// slices): two streams of weights at once, which keeps more loads in flight where a row's
            /// arithmetic is light against its memory, as the AVX-512 tiles' `FOUR_GROUPS_ROWS`. On the
            /// 2-core AMX Xeon (2026-12-05, these variants forced with `ISA=Avx2|AvxVnni ROWS=1,2,4
            /// SHAPES=8192x2048 COPIES=80 ... real_shape_timing`, 2 threads, streamed from memory, two to
            /// four alternated rounds against one group), one row, AVX-VNNI / AVX2: Q4_K 0.466-0.480 ->
            /// 0.393-0.408 / 0.463-0.495 -> 0.397-0.404 ms, Q8_0 0.649-0.663 -> 0.612-0.616 / 0.720-0.727
            /// -> 0.700-0.704, Q6_K 0.669-0.685 -> 0.577-0.591 / 0.683-0.713 -> 0.727-0.728 (slower: AVX2's
            /// Q6_K takes one group, below); two rows Q4_K 0.489-0.519
            /// -> 0.409-0.430 / 0.499-0.535 -> 0.441-0.464. From the L3 (`SHAPES=2048x2048 COPIES=6`)
            /// at three and four rows two groups lost 10-30% (Q4_0, Q4_1, Q4_K), so two rows at most.
            /// Not yet measured on an AVX2-only CPU.
            ///
            /// Without VNNI only the four-bit formats take two groups. Q5_K, Q6_K and Q8_0 unpack or
            /// sign their bytes in more registers. A two-group Q6_K tile spilled: forced to AVX2 on an
            /// EPYC Zen 4 (2026-12-05, `ISA=Avx2 ... SHAPES=2048x2048 COPIES=1`, from the caches, three
            /// alternated rounds) one row took 0.122-0.157 ms against one group's 0.055-0.068. Its
            /// mere presence in `run` also slowed Q6_K's one-group tiles there (two rows 0.109-0.119
            /// against 0.083-0.098). Q5_K lost 24-35% at one row, Q8_0 15%.
            const TWO_GROUPS_ROWS: usize = 2;

            #[target_feature(enable = $features)]
            unsafe fn run<const F: u8>(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
                let (m, groups) = (a.rows, out.groups);
                let mut gi = 0;
                while gi < groups {
                    let g = g0 + gi;
                    if m <= 4 {
                        // Both halves in one pass: each activation broadcast feeds both, and the
                        // weights stream from memory in one sweep. Three and four rows ran in two
                        // passes until the one-pass tiles measured faster there (`cost --rows
                        // 1,2,3,4,8`, Zen 3, two interleaved runs each: Qwen3-0.6B Q8_0 cost(3)
                        // 35.5-36.1 -> 29.0-29.9 ms, Llama-3.2-1B Q8_0 cost(4) 69.4-69.5 ->
                        // 50.5-54.6, SmolLM2 Q4_1 cost(4) 7.4-8.1 -> 6.4-6.6; the Q4_0 and Q4_K files
                        // unchanged). At eight rows, tiles of four in one pass were as fast for Q8_0
                        // and 10-20% slower for Q4_K: the two-pass tiles of eight stay.
                        let two_rows = if $vnni || PackedFormat::from_tag(F).four_bit() {
                            TWO_GROUPS_ROWS
                        } else {
                            0
                        };
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
                    // Q6_K in tiles of 4 rows: it ran slower at 8, where its two heads and unpacking
                    // leave too few of the 16 registers (`real_shape_timing`, Zen 3, interleaved runs: 2048 x 8192 at 8 rows 2.0-2.2 ->
                    // 1.58-1.63 ms; Q4_K, Q5_K and Q8_0 were as fast or faster at 8).
                    let tile_rows = if F == PackedFormat::Q6K.tag() { 4 } else { TILE_ROWS };
                    for h in 0..2 {
                        let mut r0 = 0;
                        while r0 < m {
                            let rows = (m - r0).min(tile_rows);
                            let o = [out.at(gi, r0).add(8 * h)];
                            // The first pass prefetches; the second finds the group's blocks in L1 / L2.
                            // (Fetching the next group's bytes through both passes, so that memory
                            // streams on through the second, sped up one row but cost 8 rows about 10%:
                            // they are bound by arithmetic here.)
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
            /// and `R`. The layout is derived from `g` and `h0` by compile-time constants. A tile that
            /// took lists of each slice's group, half and output ran AVX2's Q4_K 13-24% slower at four
            /// rows (Zen 4, 2048 x 2048 from the caches).
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
                                let v: [__m256i; S] =
                                    each!(S, |i| _mm256_loadu_si256(blk[i].add(hb + 64 * t + 32 * hs[i]).cast()));
                                let lo: [__m256i; S] = each!(S, |i| _mm256_and_si256(v[i], low));
                                let hi: [__m256i; S] = each!(S, |i| _mm256_and_si256(_mm256_srli_epi16::<4>(v[i]), low));
                                add_two_quads(&mut isum, &xq, (lo, t), (hi, t + 4), true);
                            }
                        } else {
                            let quads = if f.split() {
                                4 * half..4 * half + 4
                            } else {
                                0..8
                            };
                            let paired = f == PackedFormat::Q6K || (f == PackedFormat::Q5K && S == 1);
                            if !$vnni && paired {
                                // Two quads' pair sums added in 16 bits before one widening (Q5_K's
                                // and Q6_K's values are at most 63: within ±32004), so a quad costs
                                // one `maddubs` and half a `madd`; both share the multiply pipes.
                                // `real_shape_timing`, Zen 3, three interleaved runs: at 8 rows Q6_K
                                // 2048 x 8192 1.51-1.56 -> 1.44-1.49 ms, its 128256 x 2048 vocabulary
                                // 23.4-23.6 -> 22.1-22.3, Q5_K 8192 x 2048 1.19 -> 1.09-1.12; Q5_K at
                                // 4 rows, both halves in registers, went 0.60 -> 0.63, so it keeps
                                // one widening per quad there.
                                for t in quads.step_by(2) {
                                    let u0: [__m256i; S] = each!(S, |i| quad(f, blk[i].add(hb), t, hs[i]));
                                    let u1: [__m256i; S] = each!(S, |i| quad(f, blk[i].add(hb), t + 1, hs[i]));
                                    add_two_quads(&mut isum, &xq, (u0, t), (u1, t + 1), false);
                                }
                            } else {
                                for t in quads {
                                    let u: [__m256i; S] = each!(S, |i| quad(f, blk[i].add(hb), t, hs[i]));
                                    for r in 0..R {
                                        let xv = _mm256_set1_epi32(xq(r).add(t).read_unaligned());
                                        for i in 0..S {
                                            isum[i][r] = dot_bytes(isum[i][r], u[i], xv, f == PackedFormat::Q8_0);
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
                                    *acc_r = _mm256_fmadd_ps(
                                        _mm256_mul_ps(hs, dx),
                                        _mm256_cvtepi32_ps(s),
                                        *acc_r,
                                    );
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
            unsafe fn dot_byte_pair(s: __m256i, u0: __m256i, x0: __m256i, u1: __m256i, x1: __m256i) -> __m256i {
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

#[cfg(target_arch = "x86_64")]
avx256_variant!(avx2, "avx2,fma,f16c", false);
#[cfg(target_arch = "x86_64")]
avx256_variant!(avxvnni, "avx2,fma,f16c,avxvnni", true);

/// AVX-512 VNNI: a group's 16 outputs in one register.
#[cfg(target_arch = "x86_64")]
mod avx512vnni {
    use super::*;
    use std::arch::x86_64::*;

    pub(super) fn task(a: &QuantRows, w: &PackedMatrix, g0: usize, out: Out) {
        assert!(g0 + out.groups <= w.groups());
        // SAFETY: as the 256-bit variants'.
        unsafe { with_format_tag!(w.format, F => run::<F>(a, w, g0, out)) }
    }

    /// The most rows at which the AVX-512 Q6_K tiles take two groups at a time (as every other format
    /// does at any count). On the 2-core Xeon (2026-12-05; `ROWS=1,...,8 FORMATS=Q6K
    /// SHAPES=2048x8192,128256x2048 COPIES=5 ... real_shape_timing`, 2 threads, two or three alternated
    /// rounds) two groups against one: the 128256 x 2048 vocabulary streamed from memory at 1 row 7.56-7.76
    /// ms against 8.08-8.38, at 3 rows 8.25-8.58 against 9.78, at 5 rows 8.68-9.02 against 10.50-10.54, at
    /// 8 rows 11.41-12.00 against 11.35-11.69; 2048 x 8192 from L3 at 1 row 0.270-0.280 against
    /// 0.308-0.319, at 5 rows 0.387-0.405 against 0.396-0.442, at 6 rows 0.581-0.604 against 0.444-0.481
    /// (the registers spilled). Two groups read two streams at once, which keeps more loads in flight. On
    /// the EPYC Zen 5 (commit 8e86f27) one group had measured faster at 1 and 8 rows; not re-measured
    /// there since.
    const Q6K_TWO_GROUPS_ROWS: usize = 5;

    /// The most rows at which the AVX-512 tiles take four groups at a time (Q6_K, whose values take more
    /// registers to unpack: one row): four streams of weights at once, which keeps more loads in flight
    /// where a row's arithmetic is light against its memory. On the 2-core Xeon (2026-12-05; `ROWS=1,2,3,4
    /// FORMATS=... SHAPES=8192x2048 COPIES=80 ... real_shape_timing`, 2 threads, the weights streamed from
    /// memory, three alternated rounds) four groups against two at one row: Q4_K 0.336-0.341 ms against
    /// 0.359-0.367, Q4_0 0.321-0.329 against 0.339-0.343, Q8_0 0.580-0.598 against 0.609-0.624, Q6_K
    /// 0.492-0.508 against 0.511-0.517; at two rows Q4_K 0.355-0.361 against 0.390-0.393. From the L3
    /// (`SHAPES=2048x2048 COPIES=6`) at 3-4 rows Q5_K lost 10-15% (the arithmetic weighs more there).
    const FOUR_GROUPS_ROWS: usize = 2;

    /// Whether, on Zen 4, the tiles of `rows` rows of format `f`, `k` columns long, leave the blocks ahead
    /// to the hardware prefetcher instead of asking for them ([`prefetch_ahead`]): it alone streams a few
    /// rows of long enough groups faster there.
    /// Interleaved call by call with the same products asking 16 blocks ahead (`real_shape_timing` with a
    /// throwaway switch between the two per call, 2 threads, 40-200 copies streamed, 2026-12-05), without,
    /// at one row: Q8_0 8192 x 2048 0.337-0.348 ms against 0.383-0.392, 2048 x 6144 0.382 against
    /// 0.402, 1024 x 2048 0.064 against 0.067, 1024 x 1024 0.035 against 0.035; Q4_K 3072 x 8192 0.268
    /// against 0.324, 2048 x 6144 0.208 against 0.220, 2560 x 4096 0.178 against 0.186, but 8192 x 2048
    /// 0.254 against 0.250 and 2048 x 1024 0.044 against 0.038 (short groups: the hardware finds each
    /// new stream late); Q4_0 and Q4_1 alike. Q8_0 gained up to 4 rows, the four-bit formats up to 2 and
    /// lost from 3 (Q4_K 8192 x 2048 at 4 rows 0.359 against 0.281); Q5_K and Q6_K lost at one row (Q6_K
    /// 8192 x 2048 0.351 against 0.309). So on Zen 4 the tiles leave the blocks to the hardware for Q8_0
    /// up to 4 rows from 2048 columns, and for the four-bit formats up to 2 rows from 4096 columns.
    /// Other CPUs keep asking: on Zen 5 going without did no better (see [`PREFETCH_BLOCKS`]); on the
    /// Xeons going without at few rows has not been timed.
    /// Q6_K at one row from 8192 columns too (added with [`zen4_one_stream`], which takes the one-row
    /// products of fewer columns): 2048 x 8192 0.293-0.399 ms against 0.314-0.425, 4096 x 14336
    /// 0.944-1.388 against 1.047-1.490 (three runs, call by call, the same day).
    fn zen4_hardware_alone(f: PackedFormat, rows: usize, k: usize) -> bool {
        match f {
            PackedFormat::Q8_0 => rows <= 4 && k >= 2048,
            PackedFormat::Q6K => rows == 1 && k >= 8192,
            f if f.four_bit() => rows <= 2 && k >= 4096,
            _ => false,
        }
    }

    /// Whether, on Zen 4, a product of `rows` rows and `k` columns reads its weights as one stream: tiles
    /// of one group, each group's blocks right after the previous group's, with nothing asked ahead, so
    /// that a thread's share of the matrix is one sequential read which the hardware prefetcher follows
    /// alone. That is faster at one row where a group's blocks are few: four groups at once are four
    /// short streams, each found late. Interleaved call by call (`real_shape_timing` with a throwaway
    /// switch, 2 threads, 2000-4200 calls, the weights streamed, 2026-12-05), one stream against the
    /// four groups and prefetch rule before it: Q4_K 8192 x 2048 0.260-0.296 ms against 0.283-0.323 in
    /// three busy runs and 0.167 against 0.219 in a quieter one, 9728 x 2560 0.251-0.365 against
    /// 0.337-0.393, 14336 x 4096 0.507-0.560 against 0.582-0.634; Q6_K 8192 x 2048 0.243-0.416 against
    /// 0.286-0.454; Q5_K 9728 x 2560 0.444-0.504 against 0.487-0.542; Q4_0 8192 x 2048 0.254-0.267
    /// against 0.271-0.286; SmolLM2's Q8_0 vocabulary (49152 x 576) 0.492 against 0.640; a few
    /// products of 1024-3072 columns within 2% either way. A synthetic read of 288-byte blocks (the
    /// Q4_K stride) as four streams of 64 blocks a group read 48-50 GB/s where one stream read 57-58,
    /// as fast as the read loop, in the same quiet minutes. From 8192 columns four long streams do as
    /// well and their arithmetic is lighter (one group a tile takes up to 30% longer with the weights in
    /// L2): Q4_0 2560 x 9728 0.284-0.390 ms against 0.311-0.392 in one stream, Q6_K without prefetch
    /// 2560 x 9728 0.424-0.579 against 0.478-0.589, Q4_K and Q8_0 within 1%. At two rows one stream
    /// lost as often as it won. Other CPUs keep four groups at one row: on the Xeon four measured faster
    /// than two (see [`FOUR_GROUPS_ROWS`]), and one has not been timed there or on Zen 5.
    fn zen4_one_stream(rows: usize, k: usize) -> bool {
        rows == 1 && k < 8192
    }

    /// Whether, on Zen 4, tiles of `rows` rows of format `f` take one group at a time (and ask ahead
    /// unless [`zen4_hardware_alone`] says otherwise) where they would take two or four. The 5- and 6-bit
    /// formats, whose values take the most registers to unpack, ran faster so there from 2 to 5 rows:
    /// interleaved call by call (as [`zen4_one_stream`], 1600 calls, two runs), one group against two or four, Q5_K 9728 x 2560
    /// at 3 rows 0.487-0.494 ms against 0.540-0.553, 3072 x 1024 at 5 rows 0.070-0.076 against
    /// 0.086-0.096, 8192 x 2048 at 2 rows 0.343-0.345 against 0.369; Q6_K 9728 x 2560 at 4 rows 0.575
    /// against 0.617 (and 0.434 against 0.422 in a quiet minute), 8192 x 2048 at 3 rows 0.404 against
    /// 0.438, 2048 x 8192 at 5 rows 0.399-0.409 against 0.415-0.425: faster in 30 of 32 pairs. At 8
    /// rows they were even (Q6_K takes one group from 6 rows everywhere, `Q6K_TWO_GROUPS_ROWS`).
    fn zen4_one_group(f: PackedFormat, rows: usize) -> bool {
        matches!(f, PackedFormat::Q5K | PackedFormat::Q6K) && (2..=5).contains(&rows)
    }

    /// How the tiles of a product of `rows` rows of format `f`, `k` columns long, read the weights on
    /// this CPU: the most groups a tile takes at once (4, 2 or 1; a tile near the end takes what is
    /// left), and whether it asks for the blocks ahead ([`prefetch_ahead`]).
    ///
    /// Everywhere, two groups at a time: each activation broadcast feeds two dot products (a broadcast
    /// per dot product costs more than the multiply-adds it feeds). Tiles of up to 8 rows either way (two
    /// groups: 16 integer and 16 f32 accumulators); against 4 rows for two groups, on one thread
    /// (q8matmul::tests::timing): 1536 x 576 Q4_1 at 8 rows 54 -> 47 µs, 32 rows 222 -> 162 µs; the
    /// 49152 x 576 Q8_0 vocabulary at 8 rows 1.88 -> 1.40 ms. Four at one or two rows (Q6_K: one), see
    /// [`FOUR_GROUPS_ROWS`]. Q6_K one from 6 rows: its values take more registers to unpack, and from 6
    /// rows two groups spill them ([`Q6K_TWO_GROUPS_ROWS`]). On AMD's Zen 4 (family 0x19, the only one of
    /// that family with AVX-512) the `zen4_` rules above come first.
    fn plan(f: PackedFormat, rows: usize, k: usize) -> (usize, bool) {
        let zen4 = super::super::isa::amd_family() == Some(0x19);
        if zen4 && zen4_one_stream(rows, k) {
            return (1, false);
        }
        let q6k = f == PackedFormat::Q6K;
        let groups = if zen4 && zen4_one_group(f, rows) {
            1
        } else if rows <= if q6k { 1 } else { FOUR_GROUPS_ROWS } {
            4
        } else if !q6k || rows <= Q6K_TWO_GROUPS_ROWS {
            2
        } else {
            1
        };
        (groups, !(zen4 && zen4_hardware_alone(f, rows, k)))
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
                    prefetch_ahead(wg, b, nb, st, G, R == TILE_ROWS && f.k_quant());
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
                                isum[j][r] = _mm512_dpbusd_epi32(
                                    _mm512_dpbusd_epi32(isum[j][r], lo[j], x0),
                                    hi[j],
                                    x1,
                                );
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
                        *acc_r =
                            _mm512_fmadd_ps(_mm512_mul_ps(h, dx), _mm512_cvtepi32_ps(isum[j][r]), *acc_r);
                        if f.two_heads() && !f.split() {
                            *acc_r =
                                _mm512_fmadd_ps(heads[j][1], _mm512_set1_ps(*a.s.get_unchecked(ab)), *acc_r);
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
}

/// `x · Wᵀ` for a candle tensor `x` ([m, k], f32, CPU) and a packed matrix `w` ([n, k]): a new [m, n].
///
/// # Errors
/// If `x` is not f32, not on the CPU, not 2-D, or its width is not `w`'s.
pub fn linear_q8(x: &Tensor, w: &PackedMatrix) -> Result<Tensor> {
    Ok(linear_q8_many(x, &[w])?.pop().unwrap())
}

/// `x · Wᵢᵀ` for several matrices of `x`'s width: `x` quantised once, one job on the kernel pool (see
/// [`matmul_quantized_many`]). Each result is what [`linear_q8`] gives alone.
///
/// # Errors
/// If `x` is not f32, not on the CPU, not 2-D, or its width is not every matrix's.
pub fn linear_q8_many(x: &Tensor, ws: &[&PackedMatrix]) -> Result<Vec<Tensor>> {
    super::check_f32_cpu(x, "linear_q8")?;
    let (m, k) = x.dims2()?;
    for w in ws {
        let kw = w.dims().1;
        if k != kw {
            return Err(Error::Msg(format!("linear_q8: x has {k} columns, the weight {kw}")).bt());
        }
    }
    super::with_f32(x, |xs| with_quantized(xs, m, k, |a| products_of(a, ws)))?
}

/// `x · Wᵢᵀ` for f32 rows `x` (`[m, k]`, `k` every matrix's width) into `ys[i]` (`[m, n_i]`): `x`
/// quantised once, one job on the kernel pool, as [`linear_q8_many`] without tensors (the model's
/// layers on flat buffers).
///
/// # Panics
/// If a length does not match its shape.
pub fn matmul_q8_many(x: &[f32], m: usize, ws: &[&PackedMatrix], ys: &mut [&mut [f32]]) {
    let k = ws.first().map_or(0, |w| w.dims().1);
    with_quantized(x, m, k, |a| matmul_quantized_many(default_isa(), a, ws, ys))
}

/// `f` of `x` (`[m, k]`) quantised into this thread's kept buffer: a decoding step quantises four
/// inputs a layer, which would otherwise take fresh vectors each time.
fn with_quantized<T>(x: &[f32], m: usize, k: usize, f: impl FnOnce(&QuantRows) -> T) -> T {
    thread_local! {
        static ACTIVATIONS: std::cell::RefCell<QuantRows> = Default::default();
    }
    ACTIVATIONS.with_borrow_mut(|a| {
        quantize_rows_into(a, x, m, k);
        let out = f(a);
        // A long prompt's activations are not kept for the one-row steps after it.
        if a.q.capacity() > KEEP_ACTIVATION_BYTES {
            *a = QuantRows::default();
        }
        out
    })
}

/// The most bytes of quantised activations [`with_quantized`] keeps for the next call.
const KEEP_ACTIVATION_BYTES: usize = 1 << 20;

/// The products of quantised rows `a` with `ws`, as tensors.
fn products_of(a: &QuantRows, ws: &[&PackedMatrix]) -> Result<Vec<Tensor>> {
    let m = a.rows;
    let mut ys: Vec<Vec<f32>> = ws.iter().map(|w| Vec::with_capacity(m * w.dims().0)).collect();
    let outs: Vec<*mut f32> = ys.iter_mut().map(|y| y.as_mut_ptr()).collect();
    // SAFETY: each output has room for its m · n values and they are distinct allocations;
    // `products_into` writes every one of them, so they are initialised when the lengths are set.
    unsafe {
        products_into(default_isa(), a, ws, &outs);
        for (y, w) in ys.iter_mut().zip(ws) {
            y.set_len(m * w.dims().0);
        }
    }
    ys.into_iter()
        .zip(ws)
        .map(|(y, w)| Tensor::from_vec(y, (m, w.dims().0), &Device::Cpu))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::test_util::{random_blocks, with_threads};
    use candle_core::DType;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const FORMATS: [PackedFormat; 6] = PackedFormat::ALL;

    /// Matrix widths to test a format at: cut into blocks of 32, or super-blocks of 256.
    fn widths(format: PackedFormat) -> [usize; 3] {
        match format.gguf_block().0 {
            32 => [32, 96, 576],
            _ => [256, 512, 768],
        }
    }

    /// Random GGUF bytes of a format: every quant bit pattern, and finite f16 scales of either sign
    /// (`d`, `m` / `dmin`) in place of the random bytes there.
    fn random_gguf(rng: &mut StdRng, format: PackedFormat, rows: usize, cols: usize) -> Vec<u8> {
        let (bv, bb) = format.gguf_block();
        let mut data = vec![0u8; rows * cols / bv * bb];
        rng.fill(&mut data[..]);
        let heads: &[usize] = match format {
            PackedFormat::Q4_0 | PackedFormat::Q8_0 => &[0],
            PackedFormat::Q6K => &[208],
            _ => &[0, 2],
        };
        for blk in data.chunks_exact_mut(bb) {
            for &at in heads {
                let v = half::f16::from_f32(rng.random_range(-0.05f32..0.05));
                blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        data
    }

    fn random_packed(rng: &mut StdRng, format: PackedFormat, rows: usize, cols: usize) -> PackedMatrix {
        let data = random_gguf(rng, format, rows, cols);
        PackedMatrix::from_gguf(format, rows, cols, &data, None).unwrap()
    }

    /// The variants this CPU has, the portable one first.
    fn isas() -> Vec<Isa> {
        let mut v: Vec<Isa> = VARIANTS.into_iter().filter(|i| i.available()).collect();
        v.reverse();
        v
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
            for k in widths(format) {
                for n in [1, 5, 16, 17, 40, 100] {
                    let w = random_packed(&mut rng, format, n, k);
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
        let (k, n) = (768, 1400);
        assert!(n * k >= PAR_MIN_WORK);
        for isa in isas() {
            for format in FORMATS {
                let w = random_packed(&mut rng, format, n, k);
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

    /// A product's groups give the same bits however its job is cut into ranges (the pool's claims
    /// depend on timing): each group alone, in odd and even runs, or all at once, on every variant.
    #[test]
    fn any_cut_into_ranges_gives_the_same_bits() {
        let mut rng = StdRng::seed_from_u64(32);
        let (groups, k) = (9, 512);
        let n = groups * GROUP;
        let cuts: [&[usize]; 4] = [
            &[0, 9],
            &[0, 1, 4, 5, 9],
            &[0, 2, 3, 8, 9],
            &[0, 1, 2, 3, 4, 5, 6, 7, 8, 9],
        ];
        for isa in isas() {
            let task = task_of(isa);
            for format in FORMATS {
                let w = random_packed(&mut rng, format, n, k);
                for m in [1, 3, 8] {
                    let mut a = QuantRows::default();
                    quantize_rows_into(&mut a, &random_x(&mut rng, m * k), m, k);
                    let ys: Vec<Vec<f32>> = cuts
                        .iter()
                        .map(|cut| {
                            let mut y = vec![f32::NAN; m * n];
                            let out = Out {
                                ptr: y.as_mut_ptr(),
                                ld: n,
                                groups,
                            };
                            for r in cut.windows(2) {
                                // SAFETY: groups r[0] .. r[1] of m rows lie inside y.
                                task(&a, &w, r[0], unsafe { out.groups(r[0], r[1]) });
                            }
                            y
                        })
                        .collect();
                    assert!(ys[0].iter().all(|v| v.is_finite()), "{isa:?} {format:?}");
                    for (y, cut) in ys.iter().zip(cuts).skip(1) {
                        assert!(same_bits(y, &ys[0]), "{isa:?} {format:?} {m} rows, cut {cut:?}");
                    }
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
        let (m, k, n) = (5, 512, 37);
        for format in FORMATS {
            let w = random_packed(&mut rng, format, n, k);
            let wf = w.dequantize();
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

    /// A packed matrix holds about what its GGUF bytes hold (what a one-row product must read): within
    /// 3% for whole groups of 16 rows. (The K-quants once cost 1.33-1.52x their GGUF bytes in f32
    /// heads.)
    #[test]
    fn packed_bytes_are_the_gguf_bytes() {
        let mut rng = StdRng::seed_from_u64(30);
        for format in FORMATS {
            let (bv, bb) = format.gguf_block();
            let (rows, cols) = (64, 1024);
            let w = random_packed(&mut rng, format, rows, cols);
            let gguf = rows * cols / bv * bb;
            let ratio = w.bytes() as f64 / gguf as f64;
            assert!(
                (0.99..=1.03).contains(&ratio),
                "{format:?}: {} packed bytes for {gguf} in GGUF",
                w.bytes()
            );
        }
    }

    /// The packed weights are candle's (and so llama.cpp's) dequantisation of the GGUF bytes, value for
    /// value, bit for bit, with rows reordered where asked; and `pack` agrees with `from_gguf`.
    #[test]
    fn dequantize_matches_candle() -> Result<()> {
        use candle_core::quantized::{GgmlDType, QTensor};
        let mut rng = StdRng::seed_from_u64(28);
        let types = [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ];
        for (format, ggml) in FORMATS.into_iter().zip(types) {
            assert_eq!(PackedFormat::of_ggml(ggml), Some(format));
            let (rows, cols) = (19, 512);
            let t = Tensor::from_vec(random_x(&mut rng, rows * cols), (rows, cols), &Device::Cpu)?;
            let q = QTensor::quantize(&t, ggml)?;
            let bytes = q.data()?.into_owned();
            let theirs = q.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
            let w = PackedMatrix::from_gguf(format, rows, cols, &bytes, None)?;
            assert!(same_bits(&w.dequantize(), &theirs), "{format:?}");
            let order: Vec<u32> = (0..rows as u32).rev().collect();
            let wr = PackedMatrix::from_gguf(format, rows, cols, &bytes, Some(&order))?.dequantize();
            for (i, &j) in order.iter().enumerate() {
                let j = j as usize;
                assert!(same_bits(
                    &wr[i * cols..(i + 1) * cols],
                    &theirs[j * cols..(j + 1) * cols]
                ));
            }
            let block_format = match format {
                PackedFormat::Q4_0 => Some(BlockFormat::Q4_0),
                PackedFormat::Q4_1 => Some(BlockFormat::Q4_1),
                PackedFormat::Q8_0 => Some(BlockFormat::Q8_0),
                _ => None,
            };
            if let Some(bf) = block_format {
                let bm = BlockMatrix::new(bf, rows, cols, bytes)?;
                assert!(same_bits(&PackedMatrix::pack(&bm).dequantize(), &theirs));
            }
        }
        assert!(PackedMatrix::from_gguf(PackedFormat::Q4K, 2, 288, &[0; 4 * 144], None).is_err());
        assert!(PackedMatrix::from_gguf(PackedFormat::Q6K, 2, 256, &[0; 419], None).is_err());
        assert!(PackedMatrix::from_gguf(PackedFormat::Q6K, 2, 256, &[0; 420], Some(&[0, 2])).is_err());
        Ok(())
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
        assert_eq!(a.sum_lo[0], 130);
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
    fn quantisation_paths_give_the_same_bits() {
        let mut rng = StdRng::seed_from_u64(25);
        let mut x = random_x(&mut rng, 40 * BLOCK);
        // Edge blocks: all zero, a NaN, an infinity, subnormals, ties at amax 127, huge values.
        x[..BLOCK].fill(0.0);
        x[BLOCK + 5] = f32::NAN;
        x[2 * BLOCK + 7] = f32::INFINITY;
        x[3 * BLOCK..4 * BLOCK].fill(1e-40);
        x[4 * BLOCK..5 * BLOCK].copy_from_slice(&std::array::from_fn::<f32, BLOCK, _>(|i| i as f32 - 15.5));
        x[5 * BLOCK] = 127.0;
        x[6 * BLOCK..7 * BLOCK].fill(-3e38);
        let n = x.len() / BLOCK;
        let run = |f: &dyn Fn(&[f32], Blocks)| {
            let (mut q, mut d, mut sum, mut sum_lo, mut s) = (
                vec![0i8; x.len()],
                vec![0f32; n],
                vec![0i32; n],
                vec![0i32; n],
                vec![0f32; n],
            );
            let mut starts = vec![[0i32; 4]; n];
            f(
                &x,
                Blocks {
                    q: &mut q,
                    d: &mut d,
                    sum: &mut sum,
                    sum_lo: &mut sum_lo,
                    s: &mut s,
                    starts: &mut starts,
                },
            );
            let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            (q, bits(&d), sum, sum_lo, bits(&s))
        };
        let portable = run(&|x, o| quantize_blocks(x, o));
        assert_eq!(run(&quantize_blocks_with), portable);
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx512.available() {
            // SAFETY: checked just above.
            assert_eq!(run(&|x, o| unsafe { quantize_blocks_avx512(x, o) }), portable);
        }
        #[cfg(target_arch = "x86_64")]
        if Isa::Avx2.available() {
            // SAFETY: checked just above (Isa::Avx2 includes FMA).
            assert_eq!(run(&|x, o| unsafe { quantize_blocks_avx2(x, o) }), portable);
        }
    }

    #[test]
    fn shared_input_products_equal_separate_ones() -> Result<()> {
        // A layer's q/k/v shapes (with partial groups), several row counts, 1 to 3 threads: small
        // matrices that run on one thread, and larger ones whose job is split into ranges of groups
        // that cross from one matrix into the next.
        let mut rng = StdRng::seed_from_u64(31);
        let small = [
            (PackedFormat::Q8_0, 80),
            (PackedFormat::Q4_1, 40),
            (PackedFormat::Q4_0, 8),
        ];
        let large = [
            (PackedFormat::Q8_0, 400),
            (PackedFormat::Q4K, 136),
            (PackedFormat::Q6K, 40),
        ];
        const { assert!(576 * 512 >= PAR_MIN_WORK) };
        for (k, shapes) in [(96, small), (512, large)] {
            let ws: Vec<PackedMatrix> = shapes
                .into_iter()
                .map(|(f, n)| random_packed(&mut rng, f, n, k))
                .collect();
            let refs: Vec<&PackedMatrix> = ws.iter().collect();
            for m in [1, 3, 9] {
                let x = Tensor::from_vec(random_x(&mut rng, m * k), (m, k), &Device::Cpu)?;
                for threads in [1, 2, 3] {
                    let many = with_threads(threads, || linear_q8_many(&x, &refs))?;
                    for (w, y) in ws.iter().zip(&many) {
                        let alone = with_threads(1, || linear_q8(&x, w))?;
                        let alone = alone.flatten_all()?.to_vec1::<f32>()?;
                        assert!(
                            same_bits(&y.flatten_all()?.to_vec1::<f32>()?, &alone),
                            "k {k}, m {m}, {threads} threads"
                        );
                    }
                }
            }
        }
        Ok(())
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
    /// thread alone and on the kernel pool (as the decode loop calls).
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

    /// `copies` random `[n, k]` matrices of `format`; by default enough (256 MiB) that a timing cycling
    /// through them reads its weights from memory, not from the caches.
    fn streamed_copies(
        rng: &mut StdRng,
        format: PackedFormat,
        n: usize,
        k: usize,
        copies: Option<usize>,
    ) -> Vec<PackedMatrix> {
        let one = random_packed(rng, format, n, k);
        let copies = copies.unwrap_or((256 << 20) / one.bytes() + 1);
        std::iter::once(one)
            .chain((1..copies).map(|_| random_packed(rng, format, n, k)))
            .collect()
    }

    /// `cargo test --release --lib q8matmul::tests::real_shape_timing -- --ignored --nocapture`: ms per
    /// call (median) and GB/s of the weights read, on the default pool, for Llama-3.2-1B's products in
    /// the formats of its Q4_K_M, Q4_0 and Q8_0 files and Q5_K (random weights; a product's time depends on its
    /// shape and format only), weights cycled through enough copies to come from memory. `FORMATS=Q4K,Q6K`
    /// keeps some formats; `ROWS=1,2,3,4,8` sets the row counts (default 1 and 8); `COPIES=1` keeps one
    /// copy, so that its weights stay in cache (the arithmetic's share of the time).
    #[test]
    #[ignore]
    fn real_shape_timing() {
        let mut rng = StdRng::seed_from_u64(28);
        let only = std::env::var("FORMATS").unwrap_or_default();
        let rows: Vec<usize> = std::env::var("ROWS")
            .map(|r| {
                r.split(',')
                    .map(|m| m.parse().expect("ROWS: row counts"))
                    .collect()
            })
            .unwrap_or(vec![1, 8]);
        // ISA=Avx2 (a name from VARIANTS) times that variant instead of the fastest.
        let isa = match std::env::var("ISA") {
            Ok(name) => *VARIANTS
                .iter()
                .find(|v| format!("{v:?}") == name)
                .expect("ISA: one of VARIANTS"),
            Err(_) => default_isa(),
        };
        assert!(isa.available(), "{isa:?} is not available on this CPU");
        println!("{isa:?}: format n k: ms per call (GB/s) at m = {rows:?}; ns per group-block at m = 1");
        let mut shapes = vec![
            (PackedFormat::Q4K, 8192, 2048),
            (PackedFormat::Q4K, 2048, 2048),
            (PackedFormat::Q6K, 2048, 8192),
            (PackedFormat::Q6K, 128256, 2048),
            (PackedFormat::Q4_0, 8192, 2048),
            (PackedFormat::Q8_0, 8192, 2048),
            (PackedFormat::Q5K, 8192, 2048),
        ];
        // SHAPES=512x2048,... times those shapes instead (in every format FORMATS names).
        if let Ok(list) = std::env::var("SHAPES") {
            let dims: Vec<(usize, usize)> = list
                .split(',')
                .map(|s| {
                    let (n, k) = s.split_once('x').expect("SHAPES: NxK,...");
                    (n.parse().expect("SHAPES: N"), k.parse().expect("SHAPES: K"))
                })
                .collect();
            shapes = PackedFormat::ALL
                .iter()
                .flat_map(|&f| dims.iter().map(move |&(n, k)| (f, n, k)))
                .collect();
        }
        for (format, n, k) in shapes {
            if !only.is_empty() && !only.split(',').any(|f| format!("{format:?}") == f) {
                continue;
            }
            let copies = std::env::var("COPIES")
                .ok()
                .map(|c| c.parse().expect("COPIES: a count"));
            let w = streamed_copies(&mut rng, format, n, k, copies);
            print!("{format:?} {n} {k}:");
            for &m in &rows {
                let x = random_x(&mut rng, m * k);
                let mut y = vec![0.0f32; m * n];
                let mut i = 0;
                let t = crate::kernels::median_ms(0.3, || {
                    i = (i + 1) % w.len();
                    matmul_q8_with(isa, &x, &w[i], &mut y, m)
                });
                print!("  {t:8.3} ({:5.1})", w[0].bytes() as f64 / t / 1e6);
                if m == 1 {
                    print!(" {:6.2} ns", t * 1e6 / (n / GROUP * (k / BLOCK)) as f64);
                }
            }
            println!();
        }
    }

    /// `cargo test --release --lib q8matmul::tests::product_against_read -- --ignored --nocapture`: how
    /// close one-row products come to the memory. Call by call, alternately, a product of one row and a
    /// bare read of the same matrix's weights (a load per cache line, claimed in ranges on the same pool,
    /// as the product claims its groups), each on the next of enough copies to come from memory; prints
    /// both medians and their GB/s (10th-90th percentile). Alternating puts both under the same host
    /// conditions, which on a shared machine change within seconds. `SHAPES=Q4K:8192x3072,Q6K:128256x3072`
    /// (format:NxK; the default is the first), `CALLS=2000`.
    #[test]
    #[ignore]
    fn product_against_read() {
        let mut rng = StdRng::seed_from_u64(29);
        let list = std::env::var("SHAPES").unwrap_or("Q4K:8192x3072".into());
        let calls: usize = std::env::var("CALLS").map_or(2000, |c| c.parse().expect("CALLS: a count"));
        let pool = super::super::pool::Pool::global();
        for item in list.split(',') {
            let parsed = item.split_once(':').and_then(|(f, dims)| {
                let format = *PackedFormat::ALL.iter().find(|x| format!("{x:?}") == f)?;
                let (n, k) = dims.split_once('x')?;
                Some((format, n.parse().ok()?, k.parse().ok()?))
            });
            let (format, n, k): (PackedFormat, usize, usize) = parsed.expect("SHAPES: FORMAT:NxK,...");
            let w = streamed_copies(&mut rng, format, n, k, None);
            let x = random_x(&mut rng, k);
            let mut y = vec![0.0f32; n];
            let (mut product, mut read) = (Vec::new(), Vec::new());
            let sink = std::sync::atomic::AtomicU64::new(0);
            for c in 0..calls {
                let m = &w[c % w.len()];
                let t = std::time::Instant::now();
                if c % 2 == 0 {
                    matmul_q8_with(default_isa(), &x, m, &mut y, 1);
                    product.push(t.elapsed().as_secs_f64());
                } else {
                    let data: &[u8] = &m.data;
                    pool.run_ranges(data.len() / 64, 512, &|a, b| {
                        // SAFETY: line i (below len / 64) lies inside `data`.
                        let lines =
                            (a..b).map(|i| unsafe { std::ptr::read_volatile(data.as_ptr().add(64 * i)) });
                        let sum = lines.fold(0u64, |s, v| s.wrapping_add(v as u64));
                        sink.fetch_add(sum, std::sync::atomic::Ordering::Relaxed);
                    });
                    read.push(t.elapsed().as_secs_f64());
                }
            }
            let gb = |t: f64| w[0].data.len() as f64 / t / 1e9;
            let show = |v: &mut Vec<f64>| {
                v.sort_by(f64::total_cmp);
                let (p10, mid, p90) = (v[v.len() / 10], v[v.len() / 2], v[v.len() * 9 / 10]);
                format!(
                    "{:.3} ms ({:.1} GB/s, {:.1}-{:.1})",
                    mid * 1e3,
                    gb(mid),
                    gb(p90),
                    gb(p10)
                )
            };
            println!("{item}: product {}, read {}", show(&mut product), show(&mut read));
        }
    }

    /// Times `chains(n)` (12 independent chains of `n` instructions each) and prints instructions per
    /// second on one core.
    #[cfg(target_arch = "x86_64")]
    fn print_throughput(name: &str, isa: Isa, chains: unsafe fn(usize) -> i32) {
        if !isa.available() {
            panic!("this CPU has no {isa:?}");
        }
        let n = 50_000_000;
        let t = std::time::Instant::now();
        // SAFETY: `chains` needs only `isa`, which the CPU has (checked above).
        let check = unsafe { chains(std::hint::black_box(n)) };
        let s = t.elapsed().as_secs_f64();
        println!(
            "{name}: {:.2} G/s on one core ({check})",
            12.0 * n as f64 / s / 1e9
        );
    }

    /// `cargo test --release --lib q8matmul::tests::vnni_throughput -- --ignored --nocapture`: 512-bit
    /// `vpdpbusd` per second on one core (12 independent chains), the bound on what a block of rows can
    /// cost: a 1B model's 1.24 G weights at 8 rows are 155 M of them.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore]
    fn vnni_throughput() {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
        unsafe fn chains(n: usize) -> i32 {
            let mut acc = [_mm512_set1_epi32(1); 12];
            let (x, y) = (_mm512_set1_epi32(0x0102_0304), _mm512_set1_epi32(0x0506_0708));
            for _ in 0..n {
                for a in acc.iter_mut() {
                    *a = _mm512_dpbusd_epi32(*a, x, y);
                }
            }
            acc.iter()
                .fold(0i32, |s, &a| s.wrapping_add(_mm512_reduce_add_epi32(a)))
        }
        print_throughput("vpdpbusd zmm", Isa::Avx512Vnni, chains);
    }

    /// `cargo test --release --lib q8matmul::tests::vnni_sharing -- --ignored --nocapture`: which
    /// instructions compete with 512-bit `vpdpbusd` for the units it runs on. Each loop keeps 12
    /// independent chains: 12 `vpdpbusd`, or 8 and 4 of another instruction; it prints nanoseconds per
    /// iteration. A mix that takes the time of 12 `vpdpbusd` shares their units (so every such
    /// instruction in a tile costs a `vpdpbusd`'s slot), one that takes the time of 8 runs beside them.
    /// The f32 step per block (`vmulps`, two `vfmadd`) and an integer scale (`vpmulld`) are the
    /// candidates that matter; `vcvtdq2ps`, `vpaddd`, `vpandd` and shifts are the others in a tile.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore]
    fn vnni_sharing() {
        use std::arch::x86_64::*;
        if !Isa::Avx512Vnni.available() {
            panic!("this CPU has no AVX-512 VNNI");
        }
        // `$dp` `vpdpbusd` chains and 4 more of `$other` (`$i`: an integer chain, `$f`: an f32 one; `$m`
        // an f32 and `$y` an integer operand).
        macro_rules! mix {
            ($name:ident, $dp:literal, |$i:ident, $f:ident, $m:ident, $y:ident| $other:block) => {
                #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
                unsafe fn $name(n: usize) -> i32 {
                    let seed = |c: i32| _mm512_set1_epi32(std::hint::black_box(c));
                    let mut dp: [__m512i; $dp] = std::array::from_fn(|c| seed(c as i32));
                    let mut ints: [__m512i; 4] = std::array::from_fn(|c| seed(100 + c as i32));
                    let mut fs: [__m512; 4] = std::array::from_fn(|c| _mm512_set1_ps(1.0 + c as f32));
                    let (x, $y) = (seed(0x0102_0304), seed(0x0506_0708));
                    let $m = _mm512_set1_ps(std::hint::black_box(0.999));
                    for _ in 0..n {
                        for a in dp.iter_mut() {
                            *a = _mm512_dpbusd_epi32(*a, x, $y);
                        }
                        for c in 0..4 {
                            let ($i, $f) = (&mut ints[c], &mut fs[c]);
                            let _ = (&$i, &$f, $m, $y); // not every mix uses all four
                            $other
                        }
                    }
                    let sum = |v: &[__m512i]| {
                        v.iter()
                            .fold(0i32, |s, &a| s.wrapping_add(_mm512_reduce_add_epi32(a)))
                    };
                    let fsum: f32 = fs.iter().map(|&v| _mm512_reduce_add_ps(v)).sum();
                    sum(&dp).wrapping_add(sum(&ints)).wrapping_add(fsum as i32)
                }
            };
        }
        mix!(dpbusd_12, 12, |i, f, m, y| {});
        mix!(dpbusd_8, 8, |i, f, m, y| {});
        mix!(with_fma, 8, |i, f, m, y| { *f = _mm512_fmadd_ps(*f, m, m) });
        mix!(with_mul, 8, |i, f, m, y| { *f = _mm512_mul_ps(*f, m) });
        mix!(with_mullo, 8, |i, f, m, y| { *i = _mm512_mullo_epi32(*i, *i) });
        mix!(with_cvt, 8, |i, f, m, y| {
            *f = _mm512_cvtepi32_ps(_mm512_castps_si512(*f))
        });
        mix!(with_add, 8, |i, f, m, y| { *i = _mm512_add_epi32(*i, *i) });
        mix!(with_and_shift, 8, |i, f, m, y| {
            *i = _mm512_srli_epi16::<1>(_mm512_and_si512(*i, y))
        });
        let n = 20_000_000;
        type Chains = unsafe fn(usize) -> i32;
        let mixes: [(&str, Chains); 8] = [
            ("12 vpdpbusd", dpbusd_12),
            ("8 vpdpbusd", dpbusd_8),
            ("8 vpdpbusd + 4 vfmadd", with_fma),
            ("8 vpdpbusd + 4 vmulps", with_mul),
            ("8 vpdpbusd + 4 vpmulld", with_mullo),
            ("8 vpdpbusd + 4 vcvtdq2ps", with_cvt),
            ("8 vpdpbusd + 4 vpaddd", with_add),
            ("8 vpdpbusd + 4 (vpandd, vpsrlw)", with_and_shift),
        ];
        for (name, chains) in mixes {
            let t = std::time::Instant::now();
            // SAFETY: the CPU has AVX-512 VNNI and F/BW (`Isa::Avx512Vnni`, checked above).
            let check = unsafe { chains(std::hint::black_box(n)) };
            let ns = t.elapsed().as_secs_f64() * 1e9 / n as f64;
            println!("{name:34} {ns:.2} ns an iteration ({})", check & 1);
        }
    }

    /// `cargo test --release --lib q8matmul::tests::maddubs_throughput -- --ignored --nocapture`: 256-bit
    /// `vpmaddubsw` per second on one core (12 independent chains): the bound on a block of rows without
    /// VNNI, where a 1B model's 1.24 G weights at 8 rows are 310 M of them.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[ignore]
    fn maddubs_throughput() {
        use std::arch::x86_64::*;
        #[target_feature(enable = "avx2")]
        unsafe fn chains(n: usize) -> i32 {
            let mut acc = [_mm256_set1_epi32(0x0102_0304); 12];
            let y = _mm256_set1_epi32(0x0506_0708);
            for _ in 0..n {
                for a in acc.iter_mut() {
                    *a = _mm256_maddubs_epi16(*a, y);
                }
            }
            let mut out = [0i16; 16];
            let s = acc
                .iter()
                .fold(_mm256_setzero_si256(), |s, &a| _mm256_add_epi16(s, a));
            _mm256_storeu_si256(out.as_mut_ptr().cast(), s);
            out.iter().map(|&v| v as i32).sum()
        }
        print_throughput("vpmaddubsw ymm", Isa::Avx2, chains);
    }

    /// `cargo test --release --lib q8matmul::tests::timing -- --ignored --nocapture`: ms per call
    /// (median of 9) of the f32-activation block kernel (default and portable variants) and of this
    /// kernel on every variant, for
    /// SmolLM2's shapes, weights cycled through 30 copies so that they come from memory.
    #[test]
    #[ignore]
    fn timing() {
        let mut rng = StdRng::seed_from_u64(26);
        // 30 copies stream from memory as a model's weights do; one copy stays in L2, which shows what
        // the instructions cost on their own (the part every added row pays).
        for (format, n, k, copies) in [
            (BlockFormat::Q4_1, 1536, 576, 1),
            (BlockFormat::Q4_1, 1536, 576, 30),
            (BlockFormat::Q4_1, 576, 1536, 30),
            (BlockFormat::Q8_0, 49152, 576, 1),
        ] {
            let blocks: Vec<BlockMatrix> = (0..copies)
                .map(|_| random_blocks(&mut rng, format, n, k))
                .collect();
            let packed: Vec<PackedMatrix> = blocks.iter().map(PackedMatrix::pack).collect();
            let isas = isas();
            println!(
                "{format:?} n={n} k={k} x{copies}: m, ms per call: f32 activations (default, portable), q8 {isas:?}"
            );
            for m in [1, 2, 4, 8, 16, 32] {
                let x = random_x(&mut rng, m * k);
                let mut y = vec![0.0f32; m * n];
                let mut i = 0;
                let f = crate::kernels::median_ms(0.05, || {
                    i = (i + 1) % copies;
                    crate::kernels::matmul_blocks(&x, &blocks[i], &mut y, m)
                });
                let fp = crate::kernels::median_ms(0.05, || {
                    i = (i + 1) % copies;
                    crate::kernels::qmatmul::matmul_blocks_with(Isa::Portable, &x, &blocks[i], &mut y, m)
                });
                print!("{m:4} {f:9.4} {fp:9.4}");
                let mut last = None;
                for &isa in &isas {
                    let t = crate::kernels::median_ms(0.05, || {
                        i = (i + 1) % copies;
                        matmul_q8_with(isa, &x, &packed[i], &mut y, m)
                    });
                    last = Some(t);
                    print!(" {t:9.4}");
                }
                // The last variant (the best) per unit of work: one row, 16 outputs, one block of 32.
                if let Some(t) = last {
                    print!("   {:.2} ns/unit", t * 1e6 / (m * n / GROUP * (k / BLOCK)) as f64);
                }
                println!();
            }
        }
    }
}
