//! Row-invariant `y = x · Wᵀ` read straight from GGUF block-quantised weights (Q4_0, Q4_1, Q8_0).
//!
//! # Why
//! A CPU decoding step is bound by the bytes of weights it reads. Dequantised to f32, the default
//! SmolLM2 GGUF is 540 MB per token; in its own Q4_1/Q8_0 blocks it is about 96 MB. candle's quantised
//! matmul reads the blocks, but it quantises the activations to 8 bits (so its numbers differ from the
//! f32 model's), multiplies one row at a time (a block of R rows costs R tokens, which kills
//! speculation) and runs scalar code for Q4_1.
//!
//! # The per-element recipe
//! A weight's value is its dequantised f32 ([`BlockMatrix::dequantize`]): Q4_0 `(q - 8)·d`, Q4_1
//! `q·d + m`, Q8_0 `q·d`, with the block's f16 scale `d` and minimum `m` widened to f32. `q·d` is exact
//! in f32 (at most 8 + 11 significant bits), so every value is rounded at most once, and a fused
//! multiply-add yields the same bits as a multiply then an add (which is what candle's `dequantize`
//! does). The kernel dequantises each block of 32 weights in registers and then runs the dense
//! kernel's recipe on it unchanged (`matmul.rs`: 8-lane accumulators over chunks of 8 in order, then
//! the fixed 8-lane sum). So each output is bit-identical to [`super::matmul_xwt`] on the dequantised
//! matrix, row-invariant for the same reasons, and the model computes the same numbers whether the
//! GGUF is run in its blocks or dequantised at load; only the memory traffic changes.
//!
//! # Speed
//! Dequantisation (an integer-to-float conversion and a multiply-add per weight) is paid once per tile
//! of up to 4 rows, so one row is compute-bound on it rather than on memory, and each extra row of a
//! tile adds one multiply-add per weight. On AVX-512 CPUs one register holds two weight rows' 8-lane
//! accumulators (same lanes, same operations, half the instructions). Tall blocks dequantise a group
//! of weight rows once into a buffer for the dense kernel instead. Output columns are split into
//! ranges that the kernel pool spreads over threads; each output element is computed by one thread.

use super::isa::Isa;
use super::matmul::{process_path, Path};
use candle_core::{Device, Error, Result, Tensor};

/// Weights per block in every supported format.
pub const BLOCK: usize = 32;

/// Below this many multiply-adds a product runs on the calling thread. (Results do not depend on it.)
const PAR_MIN_WORK: usize = 1 << 18;

/// Rows of `x` per panel: a panel's rows are multiplied with one tile of weights while it sits in L1.
#[cfg(target_arch = "x86_64")]
const PANEL_ROWS: usize = 32;

/// A GGUF block format this kernel reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockFormat {
    /// f16 scale, 32 4-bit values; weight = (q - 8)·d.
    Q4_0,
    /// f16 scale, f16 minimum, 32 4-bit values; weight = q·d + m.
    Q4_1,
    /// f16 scale, 32 signed 8-bit values; weight = q·d.
    Q8_0,
}

impl BlockFormat {
    /// Bytes per block of 32 weights, as stored in GGUF files.
    pub const fn block_bytes(self) -> usize {
        match self {
            BlockFormat::Q4_0 => 18,
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q8_0 => 34,
        }
    }

    /// The format of a GGML dtype, if this kernel reads it.
    pub fn of_ggml(t: candle_core::quantized::GgmlDType) -> Option<Self> {
        use candle_core::quantized::GgmlDType as G;
        match t {
            G::Q4_0 => Some(BlockFormat::Q4_0),
            G::Q4_1 => Some(BlockFormat::Q4_1),
            G::Q8_0 => Some(BlockFormat::Q8_0),
            _ => None,
        }
    }

    /// Const-generic tag of the format (for monomorphised kernels).
    #[cfg(target_arch = "x86_64")]
    const fn tag(self) -> u8 {
        match self {
            BlockFormat::Q4_0 => 0,
            BlockFormat::Q4_1 => 1,
            BlockFormat::Q8_0 => 2,
        }
    }
}

/// A `[rows, cols]` weight matrix in GGUF blocks: row `j` is `cols / 32` consecutive blocks.
#[derive(Clone, Debug)]
pub struct BlockMatrix {
    format: BlockFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
}

impl BlockMatrix {
    /// Wraps GGUF block bytes. `cols` must be a multiple of 32 and `data` exactly `rows` rows long.
    pub fn new(format: BlockFormat, rows: usize, cols: usize, data: Vec<u8>) -> Result<Self> {
        if !cols.is_multiple_of(BLOCK) {
            return Err(Error::Msg(format!(
                "{format:?} matrix needs a multiple of {BLOCK} columns, got {cols}"
            )));
        }
        let want = rows * cols / BLOCK * format.block_bytes();
        if data.len() != want {
            return Err(Error::Msg(format!(
                "{format:?} [{rows}, {cols}] matrix needs {want} bytes, got {}",
                data.len()
            )));
        }
        Ok(BlockMatrix {
            format,
            rows,
            cols,
            data,
        })
    }

    pub fn format(&self) -> BlockFormat {
        self.format
    }

    /// `(rows, cols)`: rows are outputs, cols are inputs.
    pub fn dims(&self) -> (usize, usize) {
        (self.rows, self.cols)
    }

    fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.format.block_bytes()
    }

    pub(crate) fn row(&self, j: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.data[j * rb..(j + 1) * rb]
    }

    /// The matrix with its rows reordered: row `i` of the result is row `order[i]` of `self`.
    ///
    /// # Panics
    /// If an index is out of range.
    pub fn select_rows(&self, order: &[u32]) -> Self {
        let data = order
            .iter()
            .flat_map(|&j| self.row(j as usize))
            .copied()
            .collect();
        BlockMatrix {
            format: self.format,
            rows: order.len(),
            cols: self.cols,
            data,
        }
    }

    /// Row `j` dequantised into `out` (`cols` values).
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        let bb = self.format.block_bytes();
        for (blk, o) in self.row(j).chunks_exact(bb).zip(out.chunks_exact_mut(BLOCK)) {
            dequantize_block(self.format, blk, o);
        }
    }

    /// All weights as f32, row-major `[rows, cols]`.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut out = vec![0.0f32; self.rows * self.cols];
        for (j, o) in out.chunks_exact_mut(self.cols.max(1)).enumerate() {
            self.dequantize_row(j, o);
        }
        out
    }
}

fn f16_at(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// The defining dequantisation of one block (see the module doc): every value rounded at most once.
fn dequantize_block(format: BlockFormat, blk: &[u8], out: &mut [f32]) {
    let d = f16_at(blk);
    match format {
        BlockFormat::Q4_0 => {
            for (i, &b) in blk[2..18].iter().enumerate() {
                out[i] = ((b & 15) as i32 - 8) as f32 * d;
                out[i + 16] = ((b >> 4) as i32 - 8) as f32 * d;
            }
        }
        BlockFormat::Q4_1 => {
            let m = f16_at(&blk[2..]);
            for (i, &b) in blk[4..20].iter().enumerate() {
                out[i] = (b & 15) as f32 * d + m;
                out[i + 16] = (b >> 4) as f32 * d + m;
            }
        }
        BlockFormat::Q8_0 => {
            for (o, &b) in out.iter_mut().zip(&blk[2..34]) {
                *o = b as i8 as f32 * d;
            }
        }
    }
}

/// `y[i*n + j] = Σ_kk x[i*k + kk] · w[j][kk]` for `x` [m, k] row-major and `w` [n, k] in blocks; `y`
/// ([m, n] row-major) is fully overwritten. Bit-identical to [`super::matmul_xwt`] on
/// `w.dequantize()`, hence row-invariant.
///
/// # Panics
/// If a slice length does not match its shape.
pub fn matmul_blocks(x: &[f32], w: &BlockMatrix, y: &mut [f32], m: usize) {
    matmul_blocks_with(default_isa(), x, w, y, m)
}

/// The variants this kernel implements. `Portable` computes the portable dense kernel's numbers, the
/// others the AVX2 dense kernel's (AVX-512 only runs them faster).
pub const VARIANTS: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

/// The variant matching the dense kernel's path of this process (so that `--dequantize` computes the
/// same numbers), the fastest such.
pub fn default_isa() -> Isa {
    match process_path() {
        Path::Portable => Isa::Portable,
        #[cfg(target_arch = "x86_64")]
        Path::Avx2Fma => Isa::best_of(&[Isa::Avx512, Isa::Avx2]),
    }
}

/// One task: output columns `j0 .. j0 + cols` for every row, written column-major into `out`
/// (`out[c*m + r]`).
type TaskFn = fn(x: &[f32], w: &BlockMatrix, j0: usize, cols: usize, m: usize, out: &mut [f32]);

/// [`matmul_blocks`] on an explicit variant (one of [`VARIANTS`]).
///
/// # Panics
/// If a slice length does not match its shape, or the variant is not implemented or not available.
pub fn matmul_blocks_with(isa: Isa, x: &[f32], w: &BlockMatrix, y: &mut [f32], m: usize) {
    let (n, k) = w.dims();
    assert_eq!(x.len(), m * k, "matmul_blocks: x must hold m*k = {m}*{k} values");
    assert_eq!(y.len(), m * n, "matmul_blocks: y must hold m*n = {m}*{n} values");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(0.0);
        return;
    }
    assert!(
        isa.available(),
        "matmul_blocks: {isa:?} requested on a CPU without it"
    );
    let task: TaskFn = match isa {
        Isa::Portable => portable::task,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => avx2::task::<false>,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => avx2::task::<true>,
        _ => panic!("matmul_blocks has no {isa:?} variant"),
    };
    let parallel = m * n * k >= PAR_MIN_WORK;
    // Column ranges: a few per thread for balance, in whole tiles of 4.
    let ranges = if parallel {
        4 * super::pool::Pool::global().threads()
    } else {
        1
    };
    let range_cols = n.div_ceil(ranges).next_multiple_of(4);
    // Tasks write column-major [n, m]; with one row that is y itself.
    let mut transposed = if m > 1 { vec![0.0f32; n * m] } else { Vec::new() };
    let out: &mut [f32] = if m > 1 { &mut transposed } else { y };
    let chunk = range_cols * m;
    let chunks = out.len().div_ceil(chunk);
    let shared = super::pool::SharedMut::new(out);
    super::pool::Pool::global().run(chunks, &|ci| {
        // SAFETY: range ci writes its own columns.
        let o = unsafe { shared.range(ci * chunk, chunk) };
        task(x, w, ci * range_cols, o.len() / m, m, o)
    });
    if m > 1 {
        for (j, col) in transposed.chunks_exact(m).enumerate() {
            for (r, &v) in col.iter().enumerate() {
                y[r * n + j] = v;
            }
        }
    }
}

/// Weight rows dequantised at a time by [`via_dense`]: a multiple of every dense tile width.
const DENSE_GROUP: usize = 24;

/// A task that dequantises groups of weight rows into a buffer and runs the dense kernel's block
/// function on them: the same numbers (module doc), with the dequantisation paid once per group for
/// any number of rows.
#[allow(clippy::too_many_arguments)]
fn via_dense(
    x: &[f32],
    w: &BlockMatrix,
    j0: usize,
    cols: usize,
    m: usize,
    out: &mut [f32],
    dequantize_row: fn(&BlockMatrix, usize, &mut [f32]),
    block: super::matmul::BlockFn,
) {
    let k = w.cols;
    let mut wf = vec![0.0f32; DENSE_GROUP * k];
    let mut tile = vec![0.0f32; m * DENSE_GROUP];
    for c0 in (0..cols).step_by(DENSE_GROUP) {
        let nc = DENSE_GROUP.min(cols - c0);
        for c in 0..nc {
            dequantize_row(w, j0 + c0 + c, &mut wf[c * k..(c + 1) * k]);
        }
        block(x, &wf[..nc * k], &mut tile[..m * nc], m, k, nc);
        for r in 0..m {
            for c in 0..nc {
                out[(c0 + c) * m + r] = tile[r * nc + c];
            }
        }
    }
}

/// The portable path: always [`via_dense`] with the portable dense kernel.
mod portable {
    use super::BlockMatrix;

    pub(super) fn task(x: &[f32], w: &BlockMatrix, j0: usize, cols: usize, m: usize, out: &mut [f32]) {
        super::via_dense(
            x,
            w,
            j0,
            cols,
            m,
            out,
            |w, j, o| w.dequantize_row(j, o),
            crate::kernels::matmul::portable::block,
        );
    }
}

/// The AVX2 + FMA (+ F16C for the scales) path.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{BlockFormat, BlockMatrix, BLOCK, PANEL_ROWS};
    use crate::kernels::matmul::avx2::hsum;
    use std::arch::x86_64::*;

    const Q4_0: u8 = BlockFormat::Q4_0.tag();
    const Q4_1: u8 = BlockFormat::Q4_1.tag();
    const Q8_0: u8 = BlockFormat::Q8_0.tag();

    /// Bytes per block of the format with tag `f`.
    const fn block_bytes(f: u8) -> usize {
        match f {
            Q4_0 => BlockFormat::Q4_0.block_bytes(),
            Q4_1 => BlockFormat::Q4_1.block_bytes(),
            _ => BlockFormat::Q8_0.block_bytes(),
        }
    }

    /// Up to this many rows, blocks are dequantised in registers for each tile of rows; beyond, once
    /// per group of weight rows into a buffer for the dense kernel ([`super::via_dense`]). With AVX-512
    /// the in-register dequantisation is cheap enough to win up to about 32 rows (`timing` test).
    const FUSED_MAX_ROWS: usize = 4;
    const FUSED_MAX_ROWS_AVX512: usize = 32;

    /// `WIDE`: use the AVX-512 tiles (the caller checked the CPU has them).
    pub(super) fn task<const WIDE: bool>(
        x: &[f32],
        w: &BlockMatrix,
        j0: usize,
        cols: usize,
        m: usize,
        out: &mut [f32],
    ) {
        let fused_max = if WIDE {
            FUSED_MAX_ROWS_AVX512
        } else {
            FUSED_MAX_ROWS
        };
        if m > fused_max {
            let dequantize_row: fn(&BlockMatrix, usize, &mut [f32]) = match w.format {
                BlockFormat::Q4_0 => dequantize_row::<Q4_0>,
                BlockFormat::Q4_1 => dequantize_row::<Q4_1>,
                BlockFormat::Q8_0 => dequantize_row::<Q8_0>,
            };
            let block = crate::kernels::matmul::avx2::block;
            return super::via_dense(x, w, j0, cols, m, out, dequantize_row, block);
        }
        assert!(x.len() == m * w.cols && out.len() >= cols * m && j0 + cols <= w.rows);
        // SAFETY: `matmul_blocks_with` selects this path only after checking the CPU has the variant's
        // features; the assert above keeps every access of `task_impl` in bounds (see there).
        unsafe {
            match w.format {
                BlockFormat::Q4_0 => task_impl::<Q4_0, WIDE>(x, w, j0, cols, m, out),
                BlockFormat::Q4_1 => task_impl::<Q4_1, WIDE>(x, w, j0, cols, m, out),
                BlockFormat::Q8_0 => task_impl::<Q8_0, WIDE>(x, w, j0, cols, m, out),
            }
        }
    }

    /// Tiles of `R` rows × `C` columns: one or two rows take 4 columns (independent FMA chains; with
    /// one row the dequantisation, not the FMA, is the bottleneck), 3 and 4 rows take 2, so that the
    /// `R·C` accumulators and the dequantised chunks stay within the 16 ymm registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn task_impl<const F: u8, const WIDE: bool>(
        x: &[f32],
        w: &BlockMatrix,
        j0: usize,
        cols: usize,
        m: usize,
        out: &mut [f32],
    ) {
        let k = w.cols;
        let rb = w.row_bytes();
        let (xp, op) = (x.as_ptr(), out.as_mut_ptr());
        let wp = w.data.as_ptr().add(j0 * rb);
        for p0 in (0..m).step_by(PANEL_ROWS) {
            let pend = (p0 + PANEL_ROWS).min(m);
            // A group of up to 4 weight rows (about 1-4 KiB) stays in L1 while the panel's rows pass.
            for c0 in (0..cols).step_by(4) {
                let c = (cols - c0).min(4);
                let g = Group {
                    w: wp.add(c0 * rb),
                    cols: c,
                    k,
                    rb,
                    ostride: m,
                };
                let mut r0 = p0;
                while r0 < pend {
                    let r = (pend - r0).min(4);
                    let (xr, o) = (xp.add(r0 * k), op.add(c0 * m + r0));
                    match (r, WIDE) {
                        (1, true) => avx512::run::<F, 1>(&g, xr, o),
                        (2, true) => avx512::run::<F, 2>(&g, xr, o),
                        (3, true) => avx512::run::<F, 3>(&g, xr, o),
                        (_, true) => avx512::run::<F, 4>(&g, xr, o),
                        (1, false) => g.run::<F, 1, 4>(xr, o),
                        (2, false) => g.run::<F, 2, 4>(xr, o),
                        (3, false) => g.run::<F, 3, 2>(xr, o),
                        (_, false) => g.run::<F, 4, 2>(xr, o),
                    }
                    r0 += r;
                }
            }
        }
    }

    /// Up to 4 consecutive weight rows and where their outputs go.
    struct Group {
        w: *const u8,
        cols: usize,
        k: usize,
        rb: usize,
        ostride: usize,
    }

    impl Group {
        /// `R` rows of `x` against the group's columns: tiles of `C` columns, then 1-column tiles for
        /// the rest (same per-element recipe, so the split changes no result).
        ///
        /// SAFETY: the caller keeps `R` rows of `x` (stride `k`), the group's weight rows and outputs
        /// in bounds.
        #[target_feature(enable = "avx2,fma,f16c")]
        #[inline]
        unsafe fn run<const F: u8, const R: usize, const C: usize>(&self, x: *const f32, out: *mut f32) {
            let full = self.cols / C * C;
            for c0 in (0..full).step_by(C) {
                tile::<F, R, C>(self, x, c0, out);
            }
            for c0 in full..self.cols {
                tile::<F, R, 1>(self, x, c0, out);
            }
        }
    }

    /// `out[c*ostride + r] = x_r · w_c` for `R` rows of `x` and the `C` weight rows from `c0` of the group.
    ///
    /// SAFETY: as [`Group::run`].
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn tile<const F: u8, const R: usize, const C: usize>(
        g: &Group,
        x: *const f32,
        c0: usize,
        out: *mut f32,
    ) {
        let (k, rb) = (g.k, g.rb);
        let w = g.w.add(c0 * rb);
        let bb = block_bytes(F);
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut wv = [[_mm256_setzero_ps(); 4]; C];
        for b in 0..k / BLOCK {
            for (c, v) in wv.iter_mut().enumerate() {
                *v = dequantize::<F>(w.add(c * rb + b * bb));
            }
            for t in 0..4 {
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(r * k + b * BLOCK + t * 8));
                    for (a, v) in acc_r.iter_mut().zip(&wv) {
                        *a = _mm256_fmadd_ps(xv, v[t], *a);
                    }
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (c, &a) in acc_r.iter().enumerate() {
                *out.add((c0 + c) * g.ostride + r) = hsum(a);
            }
        }
    }

    /// Row `j` of `w` dequantised into `out` with [`dequantize`] (same values as the scalar definition).
    fn dequantize_row<const F: u8>(w: &BlockMatrix, j: usize, out: &mut [f32]) {
        let (bb, row) = (w.format.block_bytes(), w.row(j));
        assert!(out.len() >= w.cols);
        // SAFETY: selected only for a variant the CPU has (AVX2/FMA/F16C); block `b` lies inside
        // `row` and its 32 outputs inside `out` (asserted above).
        unsafe {
            for b in 0..w.cols / BLOCK {
                store_block::<F>(row.as_ptr().add(b * bb), out.as_mut_ptr().add(b * BLOCK));
            }
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn store_block<const F: u8>(p: *const u8, out: *mut f32) {
        let v = dequantize::<F>(p);
        for (t, c) in v.iter().enumerate() {
            _mm256_storeu_ps(out.add(8 * t), *c);
        }
    }

    /// One block of 32 weights as four chunks of 8 f32, per the module's defining dequantisation.
    /// (No closures: they would not inherit the target features.)
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dequantize<const F: u8>(p: *const u8) -> [__m256; 4] {
        match F {
            Q4_1 => {
                // [d, m, 0, 0]
                let dm = _mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<i32>().read_unaligned()));
                let d = _mm256_broadcastss_ps(dm);
                let mv = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
                // Bytes 0..8 and 8..16 widened to 32 bits straight from memory; their low nibbles are
                // weights 0..16, their high nibbles weights 16..32. (Nibbles are split after widening:
                // one lane-crossing shuffle per 8 bytes instead of per 8 weights.)
                let (b0, b1) = (u8x8_at(p.add(4)), u8x8_at(p.add(12)));
                let nib = _mm256_set1_epi32(15);
                [
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b0, nib)), d, mv),
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(b1, nib)), d, mv),
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b0)), d, mv),
                    _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b1)), d, mv),
                ]
            }
            Q4_0 => {
                let d = scale(p);
                let (b0, b1) = (u8x8_at(p.add(2)), u8x8_at(p.add(10)));
                let (nib, eight) = (_mm256_set1_epi32(15), _mm256_set1_epi32(8));
                [
                    _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b0, nib), eight)),
                        d,
                    ),
                    _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(b1, nib), eight)),
                        d,
                    ),
                    _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32::<4>(b0), eight)),
                        d,
                    ),
                    _mm256_mul_ps(
                        _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32::<4>(b1), eight)),
                        d,
                    ),
                ]
            }
            _ => {
                let d = scale(p);
                let q = p.add(2);
                [
                    _mm256_mul_ps(i8x8(_mm_loadl_epi64(q.cast())), d),
                    _mm256_mul_ps(i8x8(_mm_loadl_epi64(q.add(8).cast())), d),
                    _mm256_mul_ps(i8x8(_mm_loadl_epi64(q.add(16).cast())), d),
                    _mm256_mul_ps(i8x8(_mm_loadl_epi64(q.add(24).cast())), d),
                ]
            }
        }
    }

    /// The f16 at `p`, widened and broadcast.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn scale(p: *const u8) -> __m256 {
        let h = p.cast::<u16>().read_unaligned() as i32;
        _mm256_broadcastss_ps(_mm_cvtph_ps(_mm_cvtsi32_si128(h)))
    }

    /// The 8 bytes at `p`, zero-extended to 32-bit lanes.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn u8x8_at(p: *const u8) -> __m256i {
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.cast()))
    }

    /// The low 8 bytes of `v` as signed integers, converted to f32.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn i8x8(v: __m128i) -> __m256 {
        _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
    }

    /// The fused tiles on AVX-512: one 512-bit register holds the 8-lane accumulators of two weight
    /// rows (lanes 0-7 the first, 8-15 the second), so dequantisation and multiply-adds run 16 lanes
    /// wide. Every lane does exactly what the AVX2 tile does for its row (same chunks, same order,
    /// same fused operations), so results are bit-identical to it; only the throughput changes.
    pub(super) mod avx512 {
        use super::{block_bytes, hsum, tile, Group, BLOCK, Q4_0, Q4_1};
        use std::arch::x86_64::*;

        /// `R` rows of `x` against the group's columns: pairs of columns 16 lanes wide, an odd last
        /// column with the AVX2 tile.
        ///
        /// SAFETY: as [`Group::run`]; the CPU has AVX-512F/VL ([`Isa::Avx512`](crate::kernels::Isa)).
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
        pub(super) unsafe fn run<const F: u8, const R: usize>(g: &Group, x: *const f32, out: *mut f32) {
            let pairs = g.cols / 2;
            if pairs == 2 {
                tile2::<F, R, 2>(g, x, 0, out);
            } else if pairs == 1 {
                tile2::<F, R, 1>(g, x, 0, out);
            }
            if g.cols % 2 == 1 {
                tile::<F, R, 1>(g, x, g.cols - 1, out);
            }
        }

        /// `R` rows against `P` pairs of weight rows from column `c0` of the group.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
        #[inline]
        unsafe fn tile2<const F: u8, const R: usize, const P: usize>(
            g: &Group,
            x: *const f32,
            c0: usize,
            out: *mut f32,
        ) {
            let (k, rb) = (g.k, g.rb);
            let w = g.w.add(c0 * rb);
            let bb = block_bytes(F);
            let mut acc = [[_mm512_setzero_ps(); P]; R];
            let mut wv = [[_mm512_setzero_ps(); 4]; P];
            for b in 0..k / BLOCK {
                for (p, v) in wv.iter_mut().enumerate() {
                    let a = w.add(2 * p * rb + b * bb);
                    *v = dequantize_pair::<F>(a, a.add(rb));
                }
                for t in 0..4 {
                    for (r, acc_r) in acc.iter_mut().enumerate() {
                        // The same 8 inputs for both halves.
                        let x8 = _mm256_loadu_ps(x.add(r * k + b * BLOCK + t * 8));
                        let xv = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(x8)));
                        for (a, v) in acc_r.iter_mut().zip(&wv) {
                            *a = _mm512_fmadd_ps(xv, v[t], *a);
                        }
                    }
                }
            }
            for (r, acc_r) in acc.iter().enumerate() {
                for (p, &a) in acc_r.iter().enumerate() {
                    let lo = _mm512_castps512_ps256(a);
                    let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
                    *out.add((c0 + 2 * p) * g.ostride + r) = hsum(lo);
                    *out.add((c0 + 2 * p + 1) * g.ostride + r) = hsum(hi);
                }
            }
        }

        /// Blocks `a` and `b` (same index, two weight rows) as four chunks of 16 f32: lanes 0-7 chunk
        /// `t` of `a`, lanes 8-15 chunk `t` of `b`, by the module's defining dequantisation.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
        #[inline]
        unsafe fn dequantize_pair<const F: u8>(a: *const u8, b: *const u8) -> [__m512; 4] {
            // Two 8-byte pieces side by side: [a[off..off+8] | b[off..off+8]].
            let two = |off: usize| -> __m128i {
                _mm_unpacklo_epi64(
                    _mm_loadl_epi64(a.add(off).cast()),
                    _mm_loadl_epi64(b.add(off).cast()),
                )
            };
            match F {
                Q4_1 => {
                    // [d_a, m_a, d_b, m_b]
                    let dm = _mm_cvtph_ps(_mm_unpacklo_epi32(
                        _mm_cvtsi32_si128(a.cast::<i32>().read_unaligned()),
                        _mm_cvtsi32_si128(b.cast::<i32>().read_unaligned()),
                    ));
                    let dm = _mm512_castps128_ps512(dm);
                    // Lanes 0-7 take element 0 / 1 (d_a / m_a), lanes 8-15 element 2 / 3 (d_b / m_b).
                    let d = _mm512_permutexvar_ps(
                        _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
                        dm,
                    );
                    let mv = _mm512_permutexvar_ps(
                        _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
                        dm,
                    );
                    let (z0, z1) = (_mm512_cvtepu8_epi32(two(4)), _mm512_cvtepu8_epi32(two(12)));
                    let nib = _mm512_set1_epi32(15);
                    let f = |q: __m512i| _mm512_fmadd_ps(_mm512_cvtepi32_ps(q), d, mv);
                    [
                        f(_mm512_and_si512(z0, nib)),
                        f(_mm512_and_si512(z1, nib)),
                        f(_mm512_srli_epi32::<4>(z0)),
                        f(_mm512_srli_epi32::<4>(z1)),
                    ]
                }
                Q4_0 => {
                    let d = scales(a, b);
                    let (z0, z1) = (_mm512_cvtepu8_epi32(two(2)), _mm512_cvtepu8_epi32(two(10)));
                    let (nib, eight) = (_mm512_set1_epi32(15), _mm512_set1_epi32(8));
                    let f = |q: __m512i| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, eight)), d);
                    [
                        f(_mm512_and_si512(z0, nib)),
                        f(_mm512_and_si512(z1, nib)),
                        f(_mm512_srli_epi32::<4>(z0)),
                        f(_mm512_srli_epi32::<4>(z1)),
                    ]
                }
                _ => {
                    let d = scales(a, b);
                    let f = |off: usize| _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(two(off))), d);
                    [f(2), f(10), f(18), f(26)]
                }
            }
        }

        /// `[d_a ×8 | d_b ×8]` from the f16 scales at the start of blocks `a` and `b`.
        #[target_feature(enable = "avx2,fma,f16c,avx512f,avx512vl")]
        #[inline]
        unsafe fn scales(a: *const u8, b: *const u8) -> __m512 {
            let h = _mm_unpacklo_epi16(
                _mm_cvtsi32_si128(a.cast::<u16>().read_unaligned() as i32),
                _mm_cvtsi32_si128(b.cast::<u16>().read_unaligned() as i32),
            );
            let ab = _mm512_castps128_ps512(_mm_cvtph_ps(h));
            _mm512_permutexvar_ps(
                _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0),
                ab,
            )
        }
    }
}

/// `x · Wᵀ` for a candle tensor `x` ([m, k], f32, CPU) and a block matrix `w` ([n, k]): a new [m, n].
///
/// # Errors
/// If `x` is not f32, not on the CPU, not 2-D, or its width is not `w`'s.
pub fn linear_blocks(x: &Tensor, w: &BlockMatrix) -> Result<Tensor> {
    super::check_f32_cpu(x, "linear_blocks")?;
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims();
    if k != kw {
        return Err(Error::Msg(format!("linear_blocks: x has {k} columns, the weight {kw}")).bt());
    }
    let mut y = vec![0.0f32; m * n];
    super::with_f32(x, |xs| matmul_blocks(xs, w, &mut y, m))?;
    Tensor::from_vec(y, (m, n), &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::matmul::matmul_with;
    use crate::kernels::test_util::{random_blocks, with_threads};
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::DType;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const FORMATS: [BlockFormat; 3] = [BlockFormat::Q4_0, BlockFormat::Q4_1, BlockFormat::Q8_0];

    /// The variants this CPU has.
    fn isas() -> Vec<Isa> {
        VARIANTS.into_iter().filter(|i| i.available()).collect()
    }

    /// The dense kernel's path whose numbers a variant reproduces.
    fn dense_path(isa: Isa) -> Path {
        match isa {
            Isa::Portable => Path::Portable,
            #[cfg(target_arch = "x86_64")]
            _ => Path::Avx2Fma,
            #[cfg(not(target_arch = "x86_64"))]
            _ => unreachable!(),
        }
    }

    fn random(rng: &mut StdRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    fn product(isa: Isa, x: &[f32], w: &BlockMatrix, m: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * w.dims().0];
        matmul_blocks_with(isa, x, w, &mut y, m);
        y
    }

    fn same_bits(a: &[f32], b: &[f32]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
    }

    /// Our dequantisation is candle's (and so llama.cpp's) value for value, bit for bit.
    #[test]
    fn dequantize_matches_candle() -> Result<()> {
        let mut rng = StdRng::seed_from_u64(7);
        for (format, ggml) in FORMATS
            .into_iter()
            .zip([GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0])
        {
            let (rows, cols) = (5, 96);
            let t = Tensor::from_vec(random(&mut rng, rows * cols), (rows, cols), &Device::Cpu)?;
            let q = QTensor::quantize(&t, ggml)?;
            let w = BlockMatrix::new(format, rows, cols, q.data()?.into_owned())?;
            let theirs = q.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1::<f32>()?;
            assert!(same_bits(&w.dequantize(), &theirs), "{format:?}");
            // And the dequantised values are close to what was quantised (the layout is read right).
            let orig = t.flatten_all()?.to_vec1::<f32>()?;
            let err = orig
                .iter()
                .zip(&theirs)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max);
            assert!(err < 0.15, "{format:?}: max quantisation error {err}");
        }
        Ok(())
    }

    /// The kernel equals the dense kernel on the dequantised matrix, bit for bit, on every variant, for
    /// shapes that exercise every tile and edge.
    #[test]
    fn equals_dense_kernel_on_dequantized_weights() {
        let mut rng = StdRng::seed_from_u64(8);
        for isa in isas() {
            for format in FORMATS {
                for k in [32, 64, 576] {
                    for n in [1, 3, 5, 17, 100] {
                        let w = random_blocks(&mut rng, format, n, k);
                        let wf = w.dequantize();
                        for m in (1..=9).chain([16, 33, 70]) {
                            let x = random(&mut rng, m * k);
                            let mut want = vec![0.0f32; m * n];
                            matmul_with(dense_path(isa), &x, &wf, &mut want, m, k, n);
                            for threads in [1, 2] {
                                let got = with_threads(threads, || product(isa, &x, &w, m));
                                assert!(
                                    same_bits(&got, &want),
                                    "{isa:?} {format:?} m={m} k={k} n={n} threads={threads}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Each row of a block is bit-identical to that row alone (large enough to run in parallel).
    #[test]
    fn rows_are_invariant() {
        let mut rng = StdRng::seed_from_u64(9);
        let (k, n) = (576, 200);
        for isa in isas() {
            for format in FORMATS {
                let w = random_blocks(&mut rng, format, n, k);
                let x = random(&mut rng, 40 * k);
                let y = with_threads(2, || product(isa, &x, &w, 40));
                for i in 0..40 {
                    let single = with_threads(1, || product(isa, &x[i * k..(i + 1) * k], &w, 1));
                    assert!(
                        same_bits(&y[i * n..(i + 1) * n], &single),
                        "{isa:?} {format:?} row {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn select_rows_reorders() {
        let mut rng = StdRng::seed_from_u64(10);
        let w = random_blocks(&mut rng, BlockFormat::Q4_1, 4, 64);
        let p = w.select_rows(&[2, 0, 3, 1]);
        let (a, b) = (w.dequantize(), p.dequantize());
        for (i, j) in [2, 0, 3, 1].into_iter().enumerate() {
            assert!(same_bits(&b[i * 64..(i + 1) * 64], &a[j * 64..(j + 1) * 64]));
        }
    }

    #[test]
    fn rejects_bad_shapes() -> Result<()> {
        assert!(BlockMatrix::new(BlockFormat::Q8_0, 2, 48, vec![0; 68]).is_err());
        assert!(BlockMatrix::new(BlockFormat::Q8_0, 2, 32, vec![0; 67]).is_err());
        let w = BlockMatrix::new(BlockFormat::Q8_0, 2, 32, vec![0; 68])?;
        let x = Tensor::zeros((3, 32), DType::F32, &Device::Cpu)?;
        assert_eq!(linear_blocks(&x, &w)?.dims(), &[3, 2]);
        assert!(linear_blocks(&x.to_dtype(DType::F16)?, &w).is_err());
        assert!(linear_blocks(&x.narrow(1, 0, 16)?, &w).is_err());
        Ok(())
    }

    /// `cargo test --release --lib qmatmul::tests::timing -- --ignored --nocapture`: ms per call
    /// (median of 9) of the dense kernel on f32 weights and of this kernel on Q4_1 / Q8_0 blocks, for
    /// SmolLM2's shapes; weights larger than the caches, as in a decoding step.
    #[test]
    #[ignore]
    fn timing() {
        let mut rng = StdRng::seed_from_u64(11);
        // 30 layers' worth of each matrix, cycled, so that weights come from memory.
        for (n, k, copies) in [(576, 576, 30), (1536, 576, 30), (576, 1536, 30), (49152, 576, 1)] {
            let dense: Vec<Vec<f32>> = (0..copies).map(|_| random(&mut rng, n * k)).collect();
            let q41: Vec<BlockMatrix> = (0..copies)
                .map(|_| random_blocks(&mut rng, BlockFormat::Q4_1, n, k))
                .collect();
            let q80: Vec<BlockMatrix> = (0..copies)
                .map(|_| random_blocks(&mut rng, BlockFormat::Q8_0, n, k))
                .collect();
            println!("n={n} k={k} x{copies}: m, ms per call: f32 dense, Q4_1, Q8_0");
            for m in [1, 2, 4, 8, 16, 32, 64] {
                let x = random(&mut rng, m * k);
                let mut y = vec![0.0f32; m * n];
                let mut i = 0;
                let d = crate::kernels::median_ms(0.05, || {
                    i = (i + 1) % copies;
                    crate::kernels::matmul_xwt(&x, &dense[i], &mut y, m, k, n)
                });
                let a = crate::kernels::median_ms(0.05, || {
                    i = (i + 1) % copies;
                    matmul_blocks(&x, &q41[i], &mut y, m)
                });
                let b = crate::kernels::median_ms(0.05, || {
                    i = (i + 1) % copies;
                    matmul_blocks(&x, &q80[i], &mut y, m)
                });
                println!("{m:4} {d:9.4} {a:9.4} {b:9.4}");
            }
        }
    }
}
