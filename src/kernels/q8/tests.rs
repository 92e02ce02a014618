//! The kernel's tests: bit identity of every variant and row invariance, against references, and
//! the ignored timings.

use super::quantize::{quantize_blocks, quantize_blocks_with, Blocks};
#[cfg(target_arch = "x86_64")]
use super::quantize::{quantize_blocks_avx2, quantize_blocks_avx512};
use super::*;
use crate::kernels::qmatmul::{BlockFormat, BlockMatrix, BLOCK};
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

/// `cargo test --release --lib q8::tests::handoff -- --ignored --nocapture`: µs per call of
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

/// `cargo test --release --lib q8::tests::real_shape_timing -- --ignored --nocapture`: ms per
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

/// `cargo test --release --lib q8::tests::product_against_read -- --ignored --nocapture`: how
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
                    let lines = (a..b).map(|i| unsafe { std::ptr::read_volatile(data.as_ptr().add(64 * i)) });
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

/// `cargo test --release --lib q8::tests::vnni_throughput -- --ignored --nocapture`: 512-bit
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

/// `cargo test --release --lib q8::tests::vnni_sharing -- --ignored --nocapture`: which
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

/// `cargo test --release --lib q8::tests::maddubs_throughput -- --ignored --nocapture`: 256-bit
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

/// `cargo test --release --lib q8::tests::timing -- --ignored --nocapture`: ms per call
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
