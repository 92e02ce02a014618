//! The attention kernel's tests: bit identity across widths, key layouts and element types, row
//! invariance in blocks, tiles and segments, against an f64 reference; and the ignored timings.

use super::problem::MAX_TILE_ROWS;
use super::segments::{leading_visible, segments, SPLIT_BYTES};
use super::*;
use candle_core::Device;

fn rand_tensor(shape: &[usize], seed: u32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed * 97)) % 1000) as f32 / 500.0 - 1.0)
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Queries `[1, rows, heads, hd]`, keys and values `[1, keys, kvh, hd]`, from seeds `seed ..= seed + 2`.
fn qkv(rows: usize, heads: usize, kvh: usize, hd: usize, keys: usize, seed: u32) -> (Tensor, Tensor, Tensor) {
    (
        rand_tensor(&[1, rows, heads, hd], seed),
        rand_tensor(&[1, keys, kvh, hd], seed + 1),
        rand_tensor(&[1, keys, kvh, hd], seed + 2),
    )
}

/// Straightforward f64 attention over the visible keys.
fn reference(q: &Tensor, k: &Tensor, v: &Tensor, visible: &dyn Fn(usize, usize) -> bool) -> Vec<f32> {
    let (_, rows, heads, hd) = q.dims4().unwrap();
    let (_, keys, kvh, _) = k.dims4().unwrap();
    let (q, k, v) = (
        q.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        k.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
        v.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
    );
    let mut out = vec![0.0; rows * heads * hd];
    for r in 0..rows {
        for h in 0..heads {
            let g = h / (heads / kvh);
            let s: Vec<Option<f64>> = (0..keys)
                .map(|j| {
                    visible(r, j).then(|| {
                        (0..hd)
                            .map(|d| q[(r * heads + h) * hd + d] as f64 * k[(j * kvh + g) * hd + d] as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                })
                .collect();
            let m = s.iter().flatten().cloned().fold(f64::NEG_INFINITY, f64::max);
            let z: f64 = s.iter().flatten().map(|x| (x - m).exp()).sum();
            for d in 0..hd {
                let y: f64 = (0..keys)
                    .filter_map(|j| s[j].map(|x| (x - m).exp() / z * v[(j * kvh + g) * hd + d] as f64))
                    .sum();
                out[(r * heads + h) * hd + d] = y as f32;
            }
        }
    }
    out
}

#[test]
fn every_width_gives_the_same_bits() {
    // Head size 72: four full chunks of 16 lanes and a remainder of 8.
    for (rows, heads, kvh, hd, cached) in [
        (3, 6, 2, 72, 19),
        (2, 4, 4, 64, 40),
        (1, 2, 1, 16, 3),
        (5, 9, 3, 64, 150),
        // Lists of several segments: 4 of them (the last 333 keys), and rows of 3 and 4.
        (1, 9, 3, 64, 1100),
        (4, 8, 2, 72, 885),
    ] {
        let keys = cached + rows;
        let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 4);
        let vis = Visibility::Causal { offset: cached };
        let run = |w| {
            attention_f32_with(w, &q, &k, &v, vis, 0.3)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let portable = run(Width::Portable);
        for w in Width::ALL.into_iter().filter(|w| w.available()) {
            let got = run(w);
            assert!(
                got.iter().zip(&portable).all(|(a, b)| a.to_bits() == b.to_bits()),
                "{w:?} differs from the portable path"
            );
        }
    }
}

#[test]
fn matches_reference_and_is_row_invariant() {
    let (rows, heads, kvh, hd, cached) = (5, 4, 2, 16, 7);
    let keys = cached + rows;
    let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 1);
    let scale = 1.0 / (hd as f32).sqrt();
    // A tree: rows 0 <- 1 <- 2, and 0 <- 3 <- 4.
    let parent = [usize::MAX, 0, 1, 0, 3];
    let sees = |r: usize, j: usize| -> bool {
        if j < cached {
            return true;
        }
        let mut n = r;
        loop {
            if n == j - cached {
                return true;
            }
            if parent[n] == usize::MAX {
                return false;
            }
            n = parent[n];
        }
    };
    let mask: Vec<f32> = (0..rows)
        .flat_map(|r| (0..keys).map(move |j| (r, j)))
        .map(|(r, j)| if sees(r, j) { 0.0 } else { f32::NEG_INFINITY })
        .collect();
    let got = attention_f32(&q, &k, &v, Visibility::Additive(&mask), scale).unwrap();
    let got = got.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let want = reference(&q, &k, &v, &sees);
    for (a, b) in got.iter().zip(&want) {
        assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    }
    // Row 4 alone, with its visible keys laid out contiguously (prefix, root, node 3, node 4) as plain
    // decoding's cache would hold them, gives the same bits.
    let idx = Tensor::new(&[0u32, 1, 2, 3, 4, 5, 6, 7, 10, 11], &Device::Cpu).unwrap();
    let (k1, v1) = (k.index_select(&idx, 1).unwrap(), v.index_select(&idx, 1).unwrap());
    let q1 = q.narrow(1, 4, 1).unwrap();
    let alone = attention_f32(&q1, &k1, &v1, Visibility::Causal { offset: 9 }, scale).unwrap();
    let alone = alone.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(alone, got[4 * heads * hd..].to_vec());
}

/// Rows whose visible lists are cut into segments at different places (a run of the cache, then
/// keys listed across a segment's start; lists of 1 to 3 segments, around where the count rounds
/// up) give, at every width, the bits of the same row alone over a cache holding just its visible
/// keys (as plain decoding's would), and match straightforward attention.
#[test]
fn long_lists_are_cut_into_segments_that_do_not_change_a_row() {
    let (heads, kvh, hd, keys) = (6, 2, 64, 900);
    // (leading run, listed keys after it): the lists' lengths and their segments.
    let rows: [(usize, Vec<usize>); 6] = [
        (200, (201..600).step_by(2).collect()), // 400 keys, 2 segments, the list across 256
        (383, vec![]),                          // 383 keys, 1 segment of all of them
        (380, vec![500, 700, 899]),             // 383 keys: still one segment
        (383, vec![899]),                       // 384 keys, 2 segments
        (639, vec![]),                          // 639: 2 segments, the second of 383
        (600, (640..900).step_by(3).collect()), // 687 keys, 3 segments
    ];
    let lens: Vec<usize> = rows.iter().map(|(l, rest)| l + rest.len()).collect();
    let segs: Vec<usize> = lens.iter().map(|&n| segments(n)).collect();
    assert_eq!(segs, [2, 1, 1, 2, 2, 3], "lengths {lens:?}");
    let sees = |r: usize, j: usize| j < rows[r].0 || rows[r].1.contains(&j);
    let mask: Vec<f32> = (0..rows.len())
        .flat_map(|r| (0..keys).map(move |j| (r, j)))
        .map(|(r, j)| if sees(r, j) { 0.0 } else { f32::NEG_INFINITY })
        .collect();
    let (q, k, v) = qkv(rows.len(), heads, kvh, hd, keys, 31);
    let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let want = reference(&q, &k, &v, &sees);
    let row = heads * hd;
    for w in Width::ALL.into_iter().filter(|w| w.available()) {
        let got = flat(attention_f32_with(w, &q, &k, &v, Visibility::Additive(&mask), 0.125).unwrap());
        for (a, b) in got.iter().zip(&want) {
            assert!((a - b).abs() < 1e-5, "{w:?}: {a} vs {b}");
        }
        for (r, (lead, rest)) in rows.iter().enumerate() {
            let visible: Vec<u32> = (0..*lead).chain(rest.iter().copied()).map(|j| j as u32).collect();
            let idx = Tensor::new(visible.as_slice(), &Device::Cpu).unwrap();
            let (k1, v1) = (k.index_select(&idx, 1).unwrap(), v.index_select(&idx, 1).unwrap());
            let n = visible.len();
            let vis = Visibility::Causal { offset: n - 1 };
            let alone =
                flat(attention_f32_with(w, &q.narrow(1, r, 1).unwrap(), &k1, &v1, vis, 0.125).unwrap());
            assert_eq!(alone, got[r * row..(r + 1) * row], "{w:?}: row {r}");
        }
    }
}

#[test]
fn leading_visible_counts_up_to_the_first_hidden_key() {
    for len in [0, 1, 15, 16, 17, 40, 64, 100] {
        for first_hidden in (0..=len).step_by(3).chain([len]) {
            let m: Vec<f32> = (0..len)
                .map(|j| match j {
                    j if j == first_hidden => f32::NEG_INFINITY,
                    // Later keys hidden or not, and finite biases, change nothing.
                    j if j > first_hidden && j % 2 == 0 => f32::NEG_INFINITY,
                    j => -(j as f32) * 0.5,
                })
                .collect();
            assert_eq!(
                leading_visible(&m),
                first_hidden.min(len),
                "len {len}, first {first_hidden}"
            );
        }
    }
}

/// A causal prefill long enough to be cut into several row tiles ([`MAX_TILE_ROWS`]) gives every row
/// the bits it gets alone over the cache before it (as decoding one token at a time computes it),
/// and the bits of the same block under an additive causal mask, at every width; with its rows'
/// lists cut into segments, whether the block's segments are units of their own or each unit
/// takes its segments in turn ([`SPLIT_BYTES`]; a row alone splits them).
#[test]
fn long_causal_blocks_are_row_invariant() {
    let (rows, heads, hd) = (3 * MAX_TILE_ROWS + 5, 9, 64);
    let results = |cached: usize| segments(cached + rows) * rows * heads * (hd + 2) * 4;
    // Rows see 335 .. 435 keys: one segment up to 383, two from 384 (rows 48 and 49); split.
    let cached = 334;
    assert_eq!((segments(cached + 49), segments(cached + 50)), (1, 2));
    assert!(results(cached) <= SPLIT_BYTES);
    causal_block_rows_match_rows_alone(rows, cached, &[48, 49]);
    // Rows see 1101 .. 1201 keys: 4 segments up to 1151, 5 from 1152 (row 51); in turn.
    let cached = 1100;
    assert_eq!((segments(cached + 51), segments(cached + 52)), (4, 5));
    assert!(results(cached) > SPLIT_BYTES);
    causal_block_rows_match_rows_alone(rows, cached, &[50, 51]);
}

fn causal_block_rows_match_rows_alone(rows: usize, cached: usize, also: &[usize]) {
    let (heads, kvh, hd) = (9, 3, 64);
    let keys = cached + rows;
    let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 7);
    let mask: Vec<f32> = (0..rows)
        .flat_map(|r| (0..keys).map(move |j| if j <= cached + r { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let row = heads * hd;
    for w in Width::ALL.into_iter().filter(|w| w.available()) {
        let causal =
            flat(attention_f32_with(w, &q, &k, &v, Visibility::Causal { offset: cached }, 0.125).unwrap());
        let additive = flat(attention_f32_with(w, &q, &k, &v, Visibility::Additive(&mask), 0.125).unwrap());
        assert_eq!(causal, additive, "{w:?}: causal and additive masks differ");
        let tiles = [
            0,
            1,
            MAX_TILE_ROWS - 1,
            MAX_TILE_ROWS,
            MAX_TILE_ROWS + 1,
            2 * MAX_TILE_ROWS + 3,
        ];
        for &r in tiles.iter().chain(also).chain(&[rows - 1]) {
            let n = cached + r + 1;
            let alone = attention_f32_with(
                w,
                &q.narrow(1, r, 1).unwrap(),
                &k.narrow(1, 0, n).unwrap(),
                &v.narrow(1, 0, n).unwrap(),
                Visibility::Causal { offset: n - 1 },
                0.125,
            )
            .unwrap();
            assert_eq!(
                flat(alone),
                causal[r * row..(r + 1) * row],
                "{w:?}: row {r} after {cached}"
            );
        }
    }
}

/// Keys handed over already transposed (as the KV cache keeps them, with a stride past the keys and
/// stale values beyond them) give the bits of transposing them, causal or masked.
#[test]
fn transposed_keys_give_the_same_bits() {
    for cached in [70, 700] {
        transposed_keys_give_the_same_bits_after(cached);
    }
}

fn transposed_keys_give_the_same_bits_after(cached: usize) {
    let (rows, heads, kvh, hd) = (6, 9, 3, 64);
    let keys = cached + rows;
    let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 11);
    let stride = keys.next_multiple_of(KEY_CHUNK) + KEY_CHUNK;
    let kv = k.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let mut data = vec![f32::NAN; kvh * hd * stride];
    for j in 0..keys {
        for c in 0..kvh * hd {
            data[transposed_key_index(hd, stride, c / hd, c % hd, j)] = kv[j * kvh * hd + c];
        }
    }
    let kt = TransposedKeys { data: &data, stride };
    let mask: Vec<f32> = (0..rows * keys)
        .map(|i| {
            if i % keys <= cached || (i % keys).is_multiple_of(3) {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    for vis in [Visibility::Causal { offset: cached }, Visibility::Additive(&mask)] {
        let want = attention_f32(&q, &k, &v, vis, 0.125).unwrap();
        let got = attention_f32_keys(&q, Keys::Transposed(kt), &v, vis, 0.125).unwrap();
        let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let (want, got) = (flat(want), flat(got));
        assert!(want.iter().all(|x| x.is_finite()));
        assert!(want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
    let short = TransposedKeys {
        data: &data,
        stride: keys.next_multiple_of(KEY_CHUNK) - KEY_CHUNK,
    };
    assert!(attention_f32_keys(
        &q,
        Keys::Transposed(short),
        &v,
        Visibility::Causal { offset: cached },
        0.1
    )
    .is_err());
}

/// bf16 keys (transposed) and values: on every width, the bits of f32 attention over the same
/// numbers (the keys and values rounded to bf16 first), which must differ from the unrounded ones'.
#[test]
fn bf16_keys_and_values_are_read_as_their_f32_values() {
    use half::bf16;
    let (rows, heads, kvh, hd, cached) = (5, 8, 2, 72, 83);
    let keys = cached + rows;
    let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 23);
    // Values of a few magnitudes, so that rounding moves most of them.
    let spread = |t: &Tensor| {
        let x: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let x: Vec<f32> = x
            .iter()
            .enumerate()
            .map(|(i, &x)| x * [0.37, 3.1, 17.3][i % 3])
            .collect();
        Tensor::from_vec(x, t.shape(), &Device::Cpu).unwrap()
    };
    let (k, v) = (spread(&k), spread(&v));
    let rounded = |t: &Tensor| t.to_dtype(DType::BF16).unwrap().to_dtype(DType::F32).unwrap();
    let (k16, v16) = (rounded(&k), rounded(&v));
    let kv: Vec<f32> = k.flatten_all().unwrap().to_vec1().unwrap();
    let stride = 2 * KEY_CHUNK;
    let mut data = vec![bf16::NAN; kvh * hd * stride];
    for j in 0..keys {
        for c in 0..kvh * hd {
            data[transposed_key_index(hd, stride, c / hd, c % hd, j)] = bf16::from_f32(kv[j * kvh * hd + c]);
        }
    }
    let kt = TransposedKeys { data: &data, stride };
    let v_bf16 = v.to_dtype(DType::BF16).unwrap();
    let mask: Vec<f32> = (0..rows * keys)
        .map(|i| {
            if i % keys < cached || i % 4 == 0 {
                0.0
            } else {
                f32::NEG_INFINITY
            }
        })
        .collect();
    let flat = |t: Tensor| t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    let same = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits());
    for width in Width::ALL.into_iter().filter(|w| w.available()) {
        for vis in [Visibility::Causal { offset: cached }, Visibility::Additive(&mask)] {
            let want = flat(attention_f32_with(width, &q, &k16, &v16, vis, 0.125).unwrap());
            let got = flat(attention_with(width, &q, Keys::TransposedBf16(kt), &v_bf16, vis, 0.125).unwrap());
            assert!(want.iter().all(|x| x.is_finite()));
            assert!(same(&want, &got), "{width:?}: bf16 cache against its f32 values");
            let unrounded = flat(attention_f32_with(width, &q, &k, &v, vis, 0.125).unwrap());
            assert!(!same(&unrounded, &got), "{width:?}: the rounding changed nothing");
        }
    }
    // bf16 keys with f32 values (or the reverse) are refused.
    let vis = Visibility::Causal { offset: cached };
    assert!(attention_f32_keys(&q, Keys::TransposedBf16(kt), &v, vis, 0.125).is_err());
    assert!(attention_f32_keys(&q, Keys::Rows(&k), &v_bf16, vis, 0.125).is_err());
}

/// `cargo test --release --lib attention::tests::decoding_timing -- --ignored --nocapture`: µs per
/// layer of SmolLM2's attention in a decoding step (1 or 4 rows; 9 heads, 3 key/value heads, head
/// size 64) over a bf16 cache of 256-2048 tokens, one pass over 30 layers' caches a call, as a step
/// reads them (not from a cache level that one layer's would fit).
#[test]
#[ignore]
fn decoding_timing() {
    use half::bf16;
    let (heads, kvh, hd, layers) = (9, 3, 64, 30);
    for cached in [256usize, 1024, 2048] {
        for rows in [1, 4] {
            let keys = cached + rows;
            let stride = keys.next_multiple_of(KEY_CHUNK);
            let data: Vec<Vec<bf16>> = (0..layers)
                .map(|l| {
                    let k = rand_tensor(&[kvh * hd * stride], 100 + l as u32);
                    let k: Vec<f32> = k.to_vec1().unwrap();
                    k.iter().map(|&x| bf16::from_f32(x)).collect()
                })
                .collect();
            let values: Vec<Tensor> = (0..layers)
                .map(|l| {
                    let v = rand_tensor(&[1, keys, kvh, hd], 200 + l as u32);
                    v.to_dtype(DType::BF16).unwrap()
                })
                .collect();
            let q = rand_tensor(&[1, rows, heads, hd], 7);
            let vis = Visibility::Causal { offset: cached };
            let t = crate::kernels::median_ms(0.2, || {
                for (d, v) in data.iter().zip(&values) {
                    let kt = TransposedKeys { data: d, stride };
                    attention_f32_keys(&q, Keys::TransposedBf16(kt), v, vis, 0.125).unwrap();
                }
            });
            println!(
                "{cached:5} cached, {rows} rows: {:7.1} us a layer",
                t * 1e3 / layers as f64
            );
        }
    }
}

/// `cargo test --release --lib attention::tests::timing -- --ignored --nocapture`: µs per call of
/// SmolLM2's attention (9 heads, 3 key/value heads, head size 64) after 256 cached rows, for blocks of
/// 1..32 rows under a tree mask (every row sees the cache and itself). Run with `RAYON_NUM_THREADS=1`
/// for the single-thread cost.
#[test]
#[ignore]
fn timing() {
    let (heads, kvh, hd, cached) = (9, 3, 64, 256);
    for rows in [1, 2, 4, 8, 16, 32] {
        let keys = cached + rows;
        let (q, k, v) = qkv(rows, heads, kvh, hd, keys, 1);
        let mask: Vec<f32> = (0..rows)
            .flat_map(|r| {
                (0..keys).map(move |j| {
                    if j < cached || j == cached + r {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
            .collect();
        let t = crate::kernels::median_ms(0.05, || {
            attention_f32(&q, &k, &v, Visibility::Additive(&mask), 0.125).unwrap();
        });
        // With RAYON_NUM_THREADS=1 the CPU time of this thread is the whole work.
        let cpu = crate::kernels::median_cpu_ms(|| {
            attention_f32(&q, &k, &v, Visibility::Additive(&mask), 0.125).unwrap();
        });
        println!(
            "{rows:3} rows: {:8.1} us wall, {:8.1} us CPU of this thread",
            t * 1e3,
            cpu * 1e3
        );
    }
}
