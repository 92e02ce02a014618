//! Every tuning rule of the 8-bit-activation kernel in one place: when a product or a quantisation is
//! split over the kernel pool, how the ISA tiles cut rows and groups, and what they ask of the caches.
//! No rule changes a result (every tile, split and order of claims gives the same bits, tested); they
//! only decide speed. The measurements behind each rule (CPU, shapes, times) are in `docs/KERNELS.md`,
//! "Tuning notes", under the rule's name.
//!
//! | rule | value | applies to |
//! |---|---|---|
//! | [`PAR_MIN_WORK`] | 2^18 weight-activation products | splitting a product over the pool |
//! | [`MIN_TASK_BYTES`] | 32 KiB of weights | the smallest claim of a product's groups |
//! | [`QUANTIZE_PAR_MIN`] | 4 x 1536 activations | splitting the quantisation over the pool |
//! | [`KEEP_ACTIVATION_BYTES`] | 1 MiB | the quantised activations a thread keeps |
//! | [`TILE_ROWS`] | 8 | rows per register tile (x86) |
//! | [`PREFETCH_BLOCKS`] | 16 group-blocks ahead, `prefetcht2` | the x86 tiles' prefetch |
//! | [`prefetch_into_l1`] | `prefetcht0` at 8-row K-quant tiles | AVX-512 VNNI |
//! | [`ONE_PASS_ROWS`] | 4 | 256-bit: both halves of a group in one pass |
//! | [`TWO_GROUPS_ROWS`], [`avx256_two_groups_rows`] | 2 (VNNI, or four-bit formats) | 256-bit: two groups a tile |
//! | [`avx256_tile_rows`] | 4 for Q6_K, else 8 | 256-bit: rows a tile in two passes |
//! | [`avx2_paired_quads`] | Q6_K; Q5_K in one-slice tiles | AVX2 without VNNI: two quads widened once |
//! | [`FOUR_GROUPS_ROWS`] | 2 (Q6_K: 1) | AVX-512 VNNI: four groups a tile |
//! | [`Q6K_TWO_GROUPS_ROWS`] | 5 | AVX-512 VNNI: Q6_K's two groups a tile |
//! | [`zen4_hardware_alone`], [`zen4_one_stream`], [`zen4_one_group`] | see each | AVX-512 VNNI on Zen 4 |
//! | [`plan`] | the above combined | AVX-512 VNNI: groups per tile and prefetch |

#[cfg(target_arch = "x86_64")]
use super::PackedFormat;

/// A product is split over the kernel pool's threads ([`crate::kernels::pool`]) when it has at least
/// this many weight-activation products: a hand-off to a spinning worker costs about a microsecond,
/// which the smallest products do not repay. (Results do not depend on it.)
pub(super) const PAR_MIN_WORK: usize = 1 << 18;

/// The fewest weight bytes one claim of a product's groups takes
/// ([`crate::kernels::pool::Pool::run_ranges`]): a few microseconds of streaming, against the fraction
/// of one a claim costs.
pub(super) const MIN_TASK_BYTES: usize = 32 << 10;

/// Rows quantised by one task when a product has at least this many activations (a hand-off costs
/// about a microsecond, a row of 576 about half of one).
pub(super) const QUANTIZE_PAR_MIN: usize = 4 * 1536;

/// The most bytes of quantised activations [`super::with_quantized`] keeps for the next call: a long
/// prompt's are not kept for the one-row steps after it.
pub(super) const KEEP_ACTIVATION_BYTES: usize = 1 << 20;

/// Activation rows per register tile (of the x86 variants): each block of weights is unpacked once per
/// tile, and every row of it only adds integer multiply-adds and its one f32 step.
#[cfg(target_arch = "x86_64")]
pub(super) const TILE_ROWS: usize = 8;

/// Group-blocks ahead of the one being multiplied that the x86 tiles ask the caches for
/// ([`super::prefetch_ahead`]), into the outer caches (`prefetcht2`): a tile walks one group's blocks
/// in order, and the hardware prefetcher alone left the arithmetic waiting on loads.
#[cfg(target_arch = "x86_64")]
pub(super) const PREFETCH_BLOCKS: usize = 16;

/// Whether a tile of `rows` rows of format `f` asks for the blocks ahead into L1 (`prefetcht0`) instead
/// of the outer caches: the AVX-512 tiles of 8 rows of the K-quants take long enough over each
/// group-block that lines [`PREFETCH_BLOCKS`] ahead are not evicted before use, and their loads then
/// wait less on L2. Fewer rows lost by it, and Q4_0 and Q8_0, whose two-group tiles would hold
/// 9-17 KB of lines ahead in L1, gained nothing.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) const fn prefetch_into_l1(f: PackedFormat, rows: usize) -> bool {
    rows == TILE_ROWS && f.k_quant()
}

/// The most rows at which the 256-bit tiles run both halves of a group (8 lanes each) in one pass over
/// its blocks: each activation broadcast feeds both, and the weights stream from memory in one sweep.
/// At more rows the registers hold one half's sums only, and the halves run one after the other, the
/// second re-reading the group's weights from L1 / L2 (at 8 rows, tiles of four in one pass were as
/// fast or slower). The one-pass tiles are written out for 1 to 4 rows.
#[cfg(target_arch = "x86_64")]
pub(super) const ONE_PASS_ROWS: usize = 4;

/// The most rows at which a 256-bit tile takes two groups at a time (both halves of each: four
/// slices): two streams of weights at once, which keeps more loads in flight where a row's arithmetic
/// is light against its memory, as the AVX-512 tiles' [`FOUR_GROUPS_ROWS`]. From three rows two groups
/// lost (the arithmetic weighs more there). Not yet measured on an AVX2-only CPU.
#[cfg(target_arch = "x86_64")]
pub(super) const TWO_GROUPS_ROWS: usize = 2;

/// The most rows at which a one-pass 256-bit tile of format `f` takes two groups: [`TWO_GROUPS_ROWS`]
/// with VNNI; without, only for the four-bit formats (Q5_K, Q6_K and Q8_0 unpack or sign their bytes in
/// more registers: a two-group Q6_K tile spilled, and its mere presence slowed Q6_K's one-group tiles;
/// Q5_K and Q8_0 lost at one row). At most 2.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) const fn avx256_two_groups_rows(vnni: bool, f: PackedFormat) -> usize {
    if vnni || f.four_bit() {
        TWO_GROUPS_ROWS
    } else {
        0
    }
}

/// Rows per 256-bit tile of format `f` beyond [`ONE_PASS_ROWS`] (halves in two passes): Q6_K in tiles
/// of 4, since at 8 its two heads and unpacking leave too few of the 16 registers; the others at
/// [`TILE_ROWS`], where they were as fast or faster.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) const fn avx256_tile_rows(f: PackedFormat) -> usize {
    if matches!(f, PackedFormat::Q6K) {
        4
    } else {
        TILE_ROWS
    }
}

/// Whether the AVX2 tiles (no VNNI) of format `f` over `slices` slices add two quads' pair sums in 16
/// bits before one widening (Q5_K's and Q6_K's values are at most 63: within ±32004), so that a quad
/// costs one `maddubs` and half a `madd` (both share the multiply pipes): Q6_K always, Q5_K only in
/// tiles of one slice (at up to 4 rows, with both halves in registers, it keeps one widening per
/// quad, which measured faster there).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) const fn avx2_paired_quads(f: PackedFormat, slices: usize) -> bool {
    matches!(f, PackedFormat::Q6K) || (matches!(f, PackedFormat::Q5K) && slices == 1)
}

/// The most rows at which the AVX-512 Q6_K tiles take two groups at a time (as every other format does
/// at any count): two groups read two streams at once, which keeps more loads in flight; from 6 rows
/// two groups spill the registers.
#[cfg(target_arch = "x86_64")]
pub(super) const Q6K_TWO_GROUPS_ROWS: usize = 5;

/// The most rows at which the AVX-512 tiles take four groups at a time (Q6_K, whose values take more
/// registers to unpack: one row): four streams of weights at once, which keeps more loads in flight
/// where a row's arithmetic is light against its memory. From 3 rows the arithmetic weighs more.
#[cfg(target_arch = "x86_64")]
pub(super) const FOUR_GROUPS_ROWS: usize = 2;

/// Whether, on Zen 4, the tiles of `rows` rows of format `f`, `k` columns long, leave the blocks ahead
/// to the hardware prefetcher instead of asking for them ([`super::prefetch_ahead`]): it alone streams a
/// few rows of long enough groups faster there (short groups lose: the hardware finds each new stream
/// late). Q8_0 up to 4 rows from 2048 columns, the four-bit formats up to 2 rows from 4096 columns,
/// Q6_K at one row from 8192 columns. Other CPUs keep asking (on Zen 5 going without did no better; on
/// the Xeons it has not been timed).
#[cfg(target_arch = "x86_64")]
pub(super) fn zen4_hardware_alone(f: PackedFormat, rows: usize, k: usize) -> bool {
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
/// short streams, each found late. From 8192 columns four long streams do as well and their arithmetic
/// is lighter; at two rows one stream lost as often as it won. Other CPUs keep four groups at one row
/// (on the Xeon four measured faster than two, see [`FOUR_GROUPS_ROWS`]).
#[cfg(target_arch = "x86_64")]
pub(super) fn zen4_one_stream(rows: usize, k: usize) -> bool {
    rows == 1 && k < 8192
}

/// Whether, on Zen 4, tiles of `rows` rows of format `f` take one group at a time (and ask ahead
/// unless [`zen4_hardware_alone`] says otherwise) where they would take two or four: the 5- and 6-bit
/// formats, whose values take the most registers to unpack, ran faster so there from 2 to 5 rows (at 8
/// rows they were even; Q6_K takes one group from 6 rows everywhere, [`Q6K_TWO_GROUPS_ROWS`]).
#[cfg(target_arch = "x86_64")]
pub(super) fn zen4_one_group(f: PackedFormat, rows: usize) -> bool {
    matches!(f, PackedFormat::Q5K | PackedFormat::Q6K) && (2..=5).contains(&rows)
}

/// How the AVX-512 tiles of a product of `rows` rows of format `f`, `k` columns long, read the weights
/// on this CPU: the most groups a tile takes at once (4, 2 or 1; a tile near the end takes what is
/// left), and whether it asks for the blocks ahead ([`super::prefetch_ahead`]).
///
/// Everywhere, two groups at a time: each activation broadcast feeds two dot products (a broadcast
/// per dot product costs more than the multiply-adds it feeds). Tiles of up to 8 rows either way (two
/// groups: 16 integer and 16 f32 accumulators). Four at one or two rows (Q6_K: one), see
/// [`FOUR_GROUPS_ROWS`]. Q6_K one from 6 rows: its values take more registers to unpack, and from 6
/// rows two groups spill them ([`Q6K_TWO_GROUPS_ROWS`]). On AMD's Zen 4 (family 0x19, the only one of
/// that family with AVX-512) the `zen4_` rules above come first.
#[cfg(target_arch = "x86_64")]
pub(super) fn plan(f: PackedFormat, rows: usize, k: usize) -> (usize, bool) {
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
