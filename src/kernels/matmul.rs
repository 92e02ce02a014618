//! Row-invariant `y = x · Wᵀ` for f32 on the CPU.
//!
//! # The per-element recipe
//!
//! Every output element `y[i][j] = Σ_kk x[i][kk] · w[j][kk]` is computed by one thread with one fixed
//! sequence of floating-point operations, which depends only on `k`:
//!
//! 1. one 8-lane accumulator starts at zero; for each full chunk of 8 along `k`, in increasing order,
//!    `acc = x_chunk · w_chunk + acc` lane-wise (a fused multiply-add on the AVX2 path);
//! 2. if `k % 8 != 0`, one more such step on the last partial chunk, padded with zeros;
//! 3. the 8 lanes are summed in a fixed tree: `((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))`.
//!
//! Nothing else (the number of rows `m`, the other rows of `x`, the row's position, the register tile
//! it lands in, the panel it belongs to, the number of threads) enters that sequence, so row `i` of a
//! 17-row product is bit-identical to the product of that row alone. That is what makes speculative
//! decoding (the verifier multiplies a block of rows) token-identical to plain decoding (one row).
//!
//! # Speed
//!
//! Register tiles of `R` rows × `C` outputs (`R·C` independent accumulators) hide the FMA latency and
//! reuse each loaded weight chunk for all `R` rows, so for small `m` every weight row is read from
//! memory once and the product stays close to memory-bandwidth bound. Larger `m` is cut into panels of
//! rows so that the rows of `x` being worked on stay in cache. Output columns are split into blocks
//! that the kernel pool ([`super::pool`]) spreads over threads; each block (hence each output element) is
//! computed by one thread. Small products stay on the calling thread.
//!
//! Two code paths exist: AVX2+FMA intrinsics on x86_64 CPUs that have them, and portable Rust
//! otherwise. The path is chosen once per process, so one process always gets one set of results.
//! (The two paths round differently from each other; each is row-invariant on its own.)

use std::sync::OnceLock;

use candle_core::{DType, Device, Error, Result, Tensor};

/// Lanes per accumulator: one AVX2 register of f32.
const LANES: usize = 8;

/// Output columns per parallel task. A multiple of every tile width used below (8, 6, 4, 3, 2, 1), so
/// that only the last block of a matrix has edge tiles.
const COL_BLOCK: usize = 24;

/// Below this many multiply-adds (`rows · n · k`) a panel is computed on the calling thread: handing
/// it to the kernel pool's workers would cost more than it saves. (Results do not depend on it.)
const PAR_MIN_WORK: usize = 1 << 17;

/// Which implementation of the per-element recipe this process uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Path {
    /// Plain Rust on `[f32; 8]` chunks (multiply then add, not fused).
    Portable,
    /// x86_64 AVX2 + FMA intrinsics.
    #[cfg(target_arch = "x86_64")]
    Avx2Fma,
}

/// Whether the CPU running us has AVX2 and FMA, and `PROBESPEC_ISA` allows AVX2.
#[cfg(target_arch = "x86_64")]
pub(crate) fn avx2_fma_available() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && super::isa::allowed(super::Isa::Avx2)
}

/// The path of this process, detected once.
pub(crate) fn process_path() -> Path {
    static PATH: OnceLock<Path> = OnceLock::new();
    *PATH.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        if avx2_fma_available() {
            return Path::Avx2Fma;
        }
        Path::Portable
    })
}

/// `y[i*n + j] = Σ_kk x[i*k + kk] · w[j*k + kk]`: `x` is [m, k] row-major, `w` is [n, k] row-major (a
/// linear layer's weight), `y` is [m, n] row-major and fully overwritten.
///
/// Row-invariant: each `y[i][j]` is bit-identical whatever `m`, the other rows of `x` or the thread
/// count (see the module doc).
///
/// # Panics
/// If a slice length does not match its shape.
pub fn matmul_xwt(x: &[f32], w: &[f32], y: &mut [f32], m: usize, k: usize, n: usize) {
    matmul_with(process_path(), x, w, y, m, k, n)
}

/// One parallel task's work: `out` ([rows, cols] row-major) = `x` ([rows, k]) · `w` ([cols, k])ᵀ.
pub(super) type BlockFn = fn(x: &[f32], w: &[f32], out: &mut [f32], rows: usize, k: usize, cols: usize);

/// [`matmul_xwt`] on an explicit path (tests run both).
///
/// # Panics
/// If a slice length does not match its shape, or if `path` is not supported by this CPU.
pub(crate) fn matmul_with(path: Path, x: &[f32], w: &[f32], y: &mut [f32], m: usize, k: usize, n: usize) {
    assert_eq!(x.len(), m * k, "matmul_xwt: x must hold m*k = {m}*{k} values");
    assert_eq!(w.len(), n * k, "matmul_xwt: w must hold n*k = {n}*{k} values");
    assert_eq!(y.len(), m * n, "matmul_xwt: y must hold m*n = {m}*{n} values");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(0.0);
        return;
    }
    let block: BlockFn = match path {
        Path::Portable => portable::block,
        #[cfg(target_arch = "x86_64")]
        Path::Avx2Fma => {
            assert!(
                avx2_fma_available(),
                "matmul_xwt: AVX2+FMA path requested on a CPU without them"
            );
            avx2::block
        }
    };

    let panel = panel_rows(k).min(m);
    // Each task writes its block of columns as a small [rows, cols] matrix; with one row that is
    // exactly the output row, otherwise the blocks are gathered here and copied into `y`.
    let mut scratch = if panel > 1 {
        vec![0.0f32; panel * n]
    } else {
        Vec::new()
    };
    for (xp, yp) in x.chunks(panel * k).zip(y.chunks_mut(panel * n)) {
        let rows = xp.len() / k;
        if rows == 1 {
            run_blocks(block, xp, w, yp, 1, k);
        } else {
            let buf = &mut scratch[..rows * n];
            run_blocks(block, xp, w, buf, rows, k);
            scatter_blocks(buf, yp, rows, n);
        }
    }
}

/// Rows of `x` per panel: every weight row is streamed through the cache once per panel, so panels
/// should be tall, but the panel itself (`rows · k` floats) should stay in the per-core L2 cache.
fn panel_rows(k: usize) -> usize {
    const PANEL_BYTES: usize = 1 << 20;
    (PANEL_BYTES / (4 * k)).clamp(16, 64) / 4 * 4
}

/// Computes one panel: `out` holds `ceil(n / COL_BLOCK)` consecutive blocks, block `b` being the
/// [rows, cols] product of `x` with weight rows `b*COL_BLOCK ..`. Each block is one task.
fn run_blocks(block: BlockFn, x: &[f32], w: &[f32], out: &mut [f32], rows: usize, k: usize) {
    let work = |(o, wb): (&mut [f32], &[f32])| block(x, wb, o, rows, k, o.len() / rows);
    if rows * k * (out.len() / rows) < PAR_MIN_WORK {
        out.chunks_mut(COL_BLOCK * rows)
            .zip(w.chunks(COL_BLOCK * k))
            .for_each(work);
    } else {
        let (chunk, chunks) = (COL_BLOCK * rows, out.len().div_ceil(COL_BLOCK * rows));
        let shared = super::pool::SharedMut::new(out);
        super::pool::Pool::global().run(chunks, &|b| {
            // SAFETY: block b writes its own outputs.
            let o = unsafe { shared.range(b * chunk, chunk) };
            let cols = o.len() / rows;
            work((o, &w[b * COL_BLOCK * k..][..cols * k]))
        });
    }
}

/// Copies the blocks written by [`run_blocks`] into the [rows, n] row-major `y`.
fn scatter_blocks(buf: &[f32], y: &mut [f32], rows: usize, n: usize) {
    for (b, blk) in buf.chunks(COL_BLOCK * rows).enumerate() {
        let j0 = b * COL_BLOCK;
        let cols = blk.len() / rows;
        for (src, dst) in blk.chunks_exact(cols).zip(y.chunks_exact_mut(n)) {
            dst[j0..j0 + cols].copy_from_slice(src);
        }
    }
}

/// Body of a path's block function: walks the block's rows in tiles of up to 4 rows; a tile of `R`
/// rows takes its width `C` from the `(R, C)` list and covers the columns with `tile::<R, C>`, the
/// last `cols % C` columns with `tile::<R, 1>` (same per-element recipe, so edges change nothing).
/// `tile::<R, C>(x_rows, w_rows, k, out, stride)` writes `out[r*stride + c]`.
macro_rules! block_driver {
    ($x:ident, $w:ident, $out:ident, $rows:ident, $k:ident, $cols:ident, $tile:ident,
     [$(($r:literal, $c:literal)),*]) => {{
        let mut r0 = 0;
        while r0 < $rows {
            let r = ($rows - r0).min(4);
            let xr = &$x[r0 * $k..(r0 + r) * $k];
            let o = &mut $out[r0 * $cols..(r0 + r) * $cols];
            match r {
                $($r => {
                    let full = $cols / $c * $c;
                    for j0 in (0..full).step_by($c) {
                        $tile::<$r, $c>(xr, &$w[j0 * $k..(j0 + $c) * $k], $k, &mut o[j0..], $cols);
                    }
                    for j0 in full..$cols {
                        $tile::<$r, 1>(xr, &$w[j0 * $k..(j0 + 1) * $k], $k, &mut o[j0..], $cols);
                    }
                })*
                _ => unreachable!(),
            }
            r0 += r;
        }
    }};
}

/// The portable path: plain Rust that LLVM vectorises; multiply and add are separate roundings.
pub(super) mod portable {
    use super::LANES;

    /// Tile shapes (rows, cols): `R·C` accumulators of 8 lanes must fit the 16 SSE registers of
    /// baseline x86_64 (two per accumulator) with room for the loaded chunks.
    pub(in crate::kernels) fn block(
        x: &[f32],
        w: &[f32],
        out: &mut [f32],
        rows: usize,
        k: usize,
        cols: usize,
    ) {
        block_driver!(x, w, out, rows, k, cols, tile, [(1, 4), (2, 2), (3, 1), (4, 1)]);
    }

    /// `out[r*stride + c] = x_r · w_c` for `R` rows of `x` ([R, k]) and `C` rows of `w` ([C, k]).
    ///
    /// Not inlined: each shape then gets its own register allocation; inlined into `block`, all the
    /// shapes together made LLVM spill accumulators to the stack.
    #[inline(never)]
    fn tile<const R: usize, const C: usize>(x: &[f32], w: &[f32], k: usize, out: &mut [f32], stride: usize) {
        let xr: [&[f32]; R] = std::array::from_fn(|r| &x[r * k..(r + 1) * k]);
        let wr: [&[f32]; C] = std::array::from_fn(|c| &w[c * k..(c + 1) * k]);
        let mut acc = [[V8::ZERO; C]; R];
        let full = k / LANES * LANES;
        for off in (0..full).step_by(LANES) {
            let wv: [V8; C] = std::array::from_fn(|c| V8::load(&wr[c][off..off + LANES]));
            for r in 0..R {
                let xv = V8::load(&xr[r][off..off + LANES]);
                for c in 0..C {
                    acc[r][c] = xv.mul_add(wv[c], acc[r][c]);
                }
            }
        }
        if full < k {
            // Last partial chunk, zero-padded.
            let wv: [V8; C] = std::array::from_fn(|c| V8::load(&wr[c][full..]));
            for r in 0..R {
                let xv = V8::load(&xr[r][full..]);
                for c in 0..C {
                    acc[r][c] = xv.mul_add(wv[c], acc[r][c]);
                }
            }
        }
        for r in 0..R {
            for c in 0..C {
                out[r * stride + c] = hsum8(&acc[r][c].0);
            }
        }
    }

    /// Sums the 8 lanes in the fixed tree `((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))` (the AVX2 path
    /// uses the same tree).
    ///
    /// Not inlined: seeing this lane pairing, LLVM's SLP vectoriser otherwise splits the accumulators
    /// of the whole tile into 2-lane vectors, which is several times slower.
    #[inline(never)]
    pub(in crate::kernels) fn hsum8(a: &[f32; LANES]) -> f32 {
        let s = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
        (s[0] + s[2]) + (s[1] + s[3])
    }

    /// One 8-lane accumulator or chunk.
    #[derive(Clone, Copy)]
    struct V8([f32; LANES]);

    impl V8 {
        const ZERO: V8 = V8([0.0; LANES]);

        /// Up to 8 values, zero-padded.
        #[inline(always)]
        fn load(s: &[f32]) -> V8 {
            let mut v = [0.0; LANES];
            v[..s.len()].copy_from_slice(s);
            V8(v)
        }

        /// `self · w + acc`, lane-wise, rounded after the multiply and after the add.
        #[inline(always)]
        fn mul_add(self, w: V8, acc: V8) -> V8 {
            V8(std::array::from_fn(|l| self.0[l] * w.0[l] + acc.0[l]))
        }
    }
}

/// The AVX2 + FMA path.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use std::arch::x86_64::*;

    /// Minimum software-prefetch distance along the weights, in floats (64 KiB).
    const PREFETCH_FLOATS: usize = 1 << 14;

    /// Safe entry point for [`super::BlockFn`].
    pub(in crate::kernels) fn block(
        x: &[f32],
        w: &[f32],
        out: &mut [f32],
        rows: usize,
        k: usize,
        cols: usize,
    ) {
        // SAFETY: this function is only selected by `matmul_with` after `avx2_fma_available()`
        // returned true, so the CPU supports the features `block_impl` is compiled for.
        unsafe { block_impl(x, w, out, rows, k, cols) }
    }

    /// Tile shapes (rows, cols): 8–12 accumulators, leaving registers for the loaded chunks out of
    /// the 16 ymm registers. One row uses 8 columns so that 8 independent FMA chains hide latency.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block_impl(x: &[f32], w: &[f32], out: &mut [f32], rows: usize, k: usize, cols: usize) {
        block_driver!(x, w, out, rows, k, cols, tile, [(1, 8), (2, 6), (3, 4), (4, 3)]);
    }

    /// `out[r*stride + c] = x_r · w_c` for `R` rows of `x` ([R, k]) and `C` rows of `w` ([C, k]).
    ///
    /// No closures here: they do not inherit `target_feature` on older compilers, which would leave
    /// the intrinsics un-inlined.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn tile<const R: usize, const C: usize>(
        x: &[f32],
        w: &[f32],
        k: usize,
        out: &mut [f32],
        stride: usize,
    ) {
        assert!(x.len() >= R * k && w.len() >= C * k);
        let xp = x.as_ptr();
        let wp = w.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); C]; R];
        let mut wv = [_mm256_setzero_ps(); C];
        let full = k / 8 * 8;
        // Prefetch distance: the hardware prefetcher follows one long stream well but not the `C`
        // short interleaved ones of a tile (rows of a few KiB), so for memory-bound shapes (small
        // `m`, large `n`) fetch ahead into L2: past the next tile and at least 64 KiB ahead.
        let pf = (C * k).max(PREFETCH_FLOATS);
        let mut off = 0;
        while off < full {
            // SAFETY: `off + 8 <= full <= k`, and the assert above keeps every row `r < R` of x
            // (`r*k .. r*k + k`) and `c < C` of w inside its slice.
            unsafe {
                if off % 16 == 0 {
                    // Once per 64-byte line of each weight row: ask for the line `pf` floats further
                    // on. Rows are contiguous, so that is a later tile; it may lie past the end of
                    // `w` (`wrapping_add`: no out-of-bounds pointer arithmetic, and a prefetch of
                    // any address is harmless).
                    for c in 0..C {
                        _mm_prefetch::<_MM_HINT_T1>(wp.wrapping_add(c * k + off + pf) as *const i8);
                    }
                }
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = _mm256_loadu_ps(wp.add(c * k + off));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(xp.add(r * k + off));
                    for (a, &wc) in acc_r.iter_mut().zip(&wv) {
                        *a = _mm256_fmadd_ps(xv, wc, *a);
                    }
                }
            }
            off += 8;
        }
        if full < k {
            // Last partial chunk: masked-off lanes load as zero and are not touched in memory.
            let mask = _mm256_cmpgt_epi32(
                _mm256_set1_epi32((k - full) as i32),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            );
            // SAFETY: as above, and lanes `k - full ..` are masked off, so only `full .. k` of each
            // row is read.
            unsafe {
                for (c, v) in wv.iter_mut().enumerate() {
                    *v = _mm256_maskload_ps(wp.add(c * k + full), mask);
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xv = _mm256_maskload_ps(xp.add(r * k + full), mask);
                    for (a, &wc) in acc_r.iter_mut().zip(&wv) {
                        *a = _mm256_fmadd_ps(xv, wc, *a);
                    }
                }
            }
        }
        for (r, acc_r) in acc.iter().enumerate() {
            for (c, &a) in acc_r.iter().enumerate() {
                out[r * stride + c] = hsum(a);
            }
        }
    }

    /// Sums the 8 lanes in the fixed tree `((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))`.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    pub(in crate::kernels) unsafe fn hsum(v: __m256) -> f32 {
        // [a0+a4, a1+a5, a2+a6, a3+a7]
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        // [(a0+a4)+(a2+a6), (a1+a5)+(a3+a7), ..]
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }
}

/// `x · wᵀ` for candle tensors, computed by [`matmul_xwt`]: `x` [m, k] and `w` [n, k] (a linear
/// layer's weight), both f32 on the CPU, give a new [m, n] tensor.
///
/// `x` is copied (activations are small); `w` is borrowed in place when it is contiguous, which it is
/// for loaded weights (otherwise it is made contiguous first, which copies it).
///
/// # Errors
/// If either tensor is not f32, not on the CPU, not 2-D, or the inner dimensions differ.
pub fn linear_f32(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    for t in [x, w] {
        if t.dtype() != DType::F32 {
            return Err(Error::UnexpectedDType {
                msg: "linear_f32 takes f32 tensors",
                expected: DType::F32,
                got: t.dtype(),
            }
            .bt());
        }
        if !t.device().is_cpu() {
            return Err(Error::Msg(format!(
                "linear_f32 takes CPU tensors, got one on {:?}",
                t.device().location()
            ))
            .bt());
        }
    }
    let (m, k) = x.dims2()?;
    let (n, kw) = w.dims2()?;
    if k != kw {
        return Err(Error::ShapeMismatchBinaryOp {
            lhs: x.shape().clone(),
            rhs: w.shape().clone(),
            op: "linear_f32",
        }
        .bt());
    }
    // Copy x first and release its storage before borrowing w's: x and w may share a storage.
    let xs = x.flatten_all()?.to_vec1::<f32>()?;
    let w = if w.is_contiguous() {
        w.clone()
    } else {
        w.contiguous()?
    };
    let mut y = vec![0.0f32; m * n];
    {
        let (storage, layout) = w.storage_and_layout();
        let candle_core::Storage::Cpu(cpu) = &*storage else {
            return Err(Error::Msg("linear_f32: weight storage is not on the CPU".into()).bt());
        };
        let start = layout.start_offset();
        let ws = &cpu.as_slice::<f32>()?[start..start + n * k];
        matmul_xwt(&xs, ws, &mut y, m, k, n);
    }
    Tensor::from_vec(y, (m, n), &Device::Cpu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn random(rng: &mut StdRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// The paths this CPU can run.
    fn paths() -> Vec<Path> {
        #[allow(unused_mut)]
        let mut p = vec![Path::Portable];
        #[cfg(target_arch = "x86_64")]
        if avx2_fma_available() {
            p.push(Path::Avx2Fma);
        }
        p
    }

    fn with_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(f)
    }

    fn product(path: Path, x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * n];
        matmul_with(path, x, w, &mut y, m, k, n);
        y
    }

    #[test]
    fn matches_f64_reference() {
        let mut rng = StdRng::seed_from_u64(1);
        let ms: Vec<usize> = (1..=20).chain([33, 100]).collect();
        for path in paths() {
            for &m in &ms {
                for k in [1, 7, 8, 9, 64, 576, 1000] {
                    for n in [1, 3, 5, 17, 192] {
                        let x = random(&mut rng, m * k);
                        let w = random(&mut rng, n * k);
                        let y = product(path, &x, &w, m, k, n);
                        for i in 0..m {
                            for j in 0..n {
                                let (xr, wr) = (&x[i * k..(i + 1) * k], &w[j * k..(j + 1) * k]);
                                let exact: f64 = xr.iter().zip(wr).map(|(&a, &b)| a as f64 * b as f64).sum();
                                let scale: f64 = xr
                                    .iter()
                                    .zip(wr)
                                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                                    .sum();
                                let err = (y[i * n + j] as f64 - exact).abs();
                                assert!(
                                    err <= 1e-6 * scale.max(1e-30) * (k as f64).sqrt().max(1.0) * 4.0,
                                    "{path:?} m={m} k={k} n={n} y[{i}][{j}]={} exact={exact} scale={scale}",
                                    y[i * n + j]
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Each row of a batched product is bit-identical to that row multiplied alone, on 1 or 2 threads.
    #[test]
    fn rows_are_invariant() {
        let mut rng = StdRng::seed_from_u64(2);
        for path in paths() {
            for (k, n) in [(576, 200), (13, 51), (1000, 24)] {
                let w = random(&mut rng, n * k);
                let xall = random(&mut rng, 40 * k);
                let singles: Vec<Vec<f32>> = (0..40)
                    .map(|i| with_threads(1, || product(path, &xall[i * k..(i + 1) * k], &w, 1, k, n)))
                    .collect();
                for m in 1..=40 {
                    // Take a window at a varying offset so rows land in different tile positions.
                    let s = (m * 7) % (41 - m);
                    let x = &xall[s * k..(s + m) * k];
                    for threads in [1, 2] {
                        let y = with_threads(threads, || product(path, x, &w, m, k, n));
                        for i in 0..m {
                            let got = &y[i * n..(i + 1) * n];
                            let want = &singles[s + i];
                            assert!(
                                got.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                                "{path:?} k={k} n={n} m={m} threads={threads}: row {i} differs from m=1"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Large enough to go through several panels and parallel blocks.
    #[test]
    fn rows_are_invariant_across_panels() {
        let mut rng = StdRng::seed_from_u64(3);
        let (m, k, n) = (150, 96, 300);
        let x = random(&mut rng, m * k);
        let w = random(&mut rng, n * k);
        for path in paths() {
            let y = with_threads(2, || product(path, &x, &w, m, k, n));
            for i in [0, 1, 63, 64, 65, 127, 128, 149] {
                let single = product(path, &x[i * k..(i + 1) * k], &w, 1, k, n);
                assert!(
                    y[i * n..(i + 1) * n]
                        .iter()
                        .zip(&single)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{path:?} row {i}"
                );
            }
        }
    }

    #[test]
    fn degenerate_shapes() {
        for path in paths() {
            let mut y = vec![1.0f32; 6];
            matmul_with(path, &[], &[], &mut y, 2, 0, 3);
            assert_eq!(y, vec![0.0; 6]);
            let mut y: Vec<f32> = vec![];
            matmul_with(path, &[], &[1.0, 2.0], &mut y, 0, 2, 1);
        }
    }

    #[test]
    fn linear_f32_matches_candle() -> Result<()> {
        let dev = Device::Cpu;
        for (m, k, n) in [(1, 64, 30), (7, 576, 100), (20, 9, 5)] {
            let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
            let ours = linear_f32(&x, &w)?;
            let theirs = x.matmul(&w.t()?)?;
            assert_eq!(ours.dims(), &[m, n]);
            let diff = (ours - &theirs)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let scale = theirs.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(
                diff <= 1e-4 * scale.max(1.0),
                "m={m} k={k} n={n}: max diff {diff}"
            );
        }
        // A weight that is a view into a larger tensor (non-zero start offset) and a transposed one.
        let big = Tensor::randn(0f32, 1.0, (10, 16), &dev)?;
        let w = big.narrow(0, 3, 5)?;
        let x = Tensor::randn(0f32, 1.0, (4, 16), &dev)?;
        let diff = (linear_f32(&x, &w)? - x.matmul(&w.t()?)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-4);
        let wt = Tensor::randn(0f32, 1.0, (16, 5), &dev)?.t()?;
        let diff = (linear_f32(&x, &wt)? - x.matmul(&wt.t()?)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-4);
        Ok(())
    }

    /// `cargo test --release --lib kernels -- --ignored --nocapture`: ms per call (median of 9, weights
    /// hot in cache) of each path and of candle's `x.matmul(&w.t())`.
    #[test]
    #[ignore]
    fn timing() -> Result<()> {
        let dev = Device::Cpu;
        for (n, k) in [(576, 576), (1536, 576), (576, 1536), (49152, 576)] {
            let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
            let (wv, wt) = (w.flatten_all()?.to_vec1::<f32>()?, w.t()?);
            println!("n={n} k={k}: m, ms per call for {:?} and candle", paths());
            for m in [1, 2, 4, 8, 16, 32, 64] {
                let x = Tensor::randn(0f32, 1.0, (m, k), &dev)?;
                let xv = x.flatten_all()?.to_vec1::<f32>()?;
                let mut y = vec![0.0f32; m * n];
                let ours: Vec<String> = paths()
                    .into_iter()
                    .map(|p| {
                        format!(
                            "{:9.4}",
                            crate::kernels::median_ms(0.02, || matmul_with(p, &xv, &wv, &mut y, m, k, n))
                        )
                    })
                    .collect();
                let theirs = crate::kernels::median_ms(0.02, || drop(x.matmul(&wt).unwrap()));
                println!("{m:4} {} {theirs:9.4}", ours.join(" "));
            }
        }
        Ok(())
    }

    #[test]
    fn linear_f32_rejects_bad_inputs() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (2, 8), &dev)?;
        let w = Tensor::randn(0f32, 1.0, (3, 8), &dev)?;
        assert!(linear_f32(&x.to_dtype(DType::F16)?, &w).is_err());
        assert!(linear_f32(&x, &w.to_dtype(DType::BF16)?).is_err());
        assert!(linear_f32(&x, &w.narrow(1, 0, 7)?).is_err());
        assert!(linear_f32(&x.unsqueeze(0)?, &w).is_err());
        Ok(())
    }
}
