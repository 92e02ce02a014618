//! The GGUF formats the 8-bit-activation kernel reads ([`PackedFormat`]) and the predicates that shape
//! each format's path through the kernels (see the table in the module doc), with the packed layout's
//! sizes and offsets per format.

use super::GROUP;
use crate::kernels::qmatmul::{BlockFormat, BLOCK};

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
    pub(super) const fn tag(self) -> u8 {
        self as u8
    }

    pub(super) const fn from_tag(t: u8) -> Self {
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
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the x86 kernels' only
    pub(super) const fn four_bit(self) -> bool {
        matches!(self, PackedFormat::Q4_0 | PackedFormat::Q4_1 | PackedFormat::Q4K)
    }

    /// The low 4 bits of every value stored as nibbles (all but Q8_0); Q5_K and Q6_K keep their
    /// remaining bits in [`Self::high_chunks`] chunks after them.
    pub(super) const fn nibble_planes(self) -> bool {
        !matches!(self, PackedFormat::Q8_0)
    }

    /// 64-byte chunks of high bits after the nibbles: Q5_K's fifth bit (one), Q6_K's two (two).
    pub(super) const fn high_chunks(self) -> usize {
        match self {
            PackedFormat::Q5K => 1,
            PackedFormat::Q6K => 2,
            _ => 0,
        }
    }

    /// The K-quants: per-row scales `d` (and `dmin`) once per 256-value super-block, kept apart from
    /// the blocks ([`PackedMatrix`](super::PackedMatrix)'s `supers`), and a byte of sub-block scale (and minimum) per block.
    /// The kernels multiply them back into the f32 heads (`d·sc` and `-dmin·mn`, exact in f32), so
    /// the heads cost 1 byte per 16 weights instead of 4 bytes per 16.
    pub(super) const fn k_quant(self) -> bool {
        matches!(self, PackedFormat::Q4K | PackedFormat::Q5K | PackedFormat::Q6K)
    }

    /// Two heads per row and block: a scale and a minimum (Q4_1, Q4_K, Q5_K), or the scales of the
    /// block's two halves (Q6_K).
    pub(super) const fn two_heads(self) -> bool {
        !matches!(self, PackedFormat::Q4_0 | PackedFormat::Q8_0)
    }

    /// The second head scales the second 16 values (Q6_K) rather than being a minimum.
    pub(super) const fn split(self) -> bool {
        matches!(self, PackedFormat::Q6K)
    }
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
pub(super) const fn heads_bytes(f: PackedFormat) -> usize {
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
pub(super) const fn super_bytes(f: PackedFormat) -> usize {
    match f {
        PackedFormat::Q4K | PackedFormat::Q5K => 4 * GROUP,
        PackedFormat::Q6K => 2 * GROUP,
        _ => 0,
    }
}

/// Blocks of 32 per K-quant super-block.
pub(super) const SUPER: usize = 8;

/// Bytes per group-block.
pub(super) const fn stride(f: PackedFormat) -> usize {
    heads_bytes(f) + quant_bytes(f)
}

/// `c` such that a weight's integer is `u - c`, where `u` is the unsigned value stored for it: Q4_0's
/// nibble (weight + 8), Q8_0's int8 + 128, Q6_K's 6-bit value (weight + 32), the others' value itself.
/// So `isum = Σ u·q - c·Σq`.
pub(super) const fn offset(f: PackedFormat) -> i32 {
    match f {
        PackedFormat::Q4_0 => 8,
        PackedFormat::Q8_0 => 128,
        PackedFormat::Q6K => 32,
        _ => 0,
    }
}

/// Where the high bits of value `4t + i` (`t` 0..8: the value quads of the byte path) of a group-block
/// row lie in its high chunks: the chunk (0 or 1) and the bit they start at. Q5_K keeps bit 4 of quad
/// `t` at bit `t`; Q6_K bits 4-5 of quad `t` in chunk `t / 4` at bit `2·(t % 4)`.
pub(super) const fn high_bits_at(f: PackedFormat, t: usize) -> (usize, u32) {
    match f {
        PackedFormat::Q6K => (t / 4, 2 * (t % 4) as u32),
        _ => (0, t as u32),
    }
}
