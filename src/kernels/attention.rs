//! Row-invariant attention for f32 on the CPU, with an arbitrary additive mask.
//!
//! Each (query row, head) is computed by one thread with one fixed sequence of operations over the keys it
//! may see, in cache order: scores (a dot product with a fixed 8-lane reduction), their maximum, the sum of
//! exponentials, and the weighted sum of values. Masked keys are skipped outright, so a tree node that sees
//! prefix + ancestors computes exactly what plain decoding computes for the same token over the same
//! cache: the property speculative decoding's losslessness rests on. candle's CPU flash-attention kernel
//! takes a scalar path per key when given a mask, which made every extra row of a speculative block cost
//! about as much attention as a whole plain step at long contexts; this kernel is vectorisable either way.

use candle_core::{DType, Error, Result, Storage, Tensor};

/// Which keys a query row may see.
#[derive(Clone, Copy)]
pub enum Visibility<'a> {
    /// Row i sees keys 0..=offset + i.
    Causal { offset: usize },
    /// Additive mask `[rows, keys]`: 0 visible, -inf hidden (finite values are added to the score).
    Additive(&'a [f32]),
}

/// Lanes of the fixed reduction: a dot product keeps 16 partial sums (lane `i` takes terms `i`, `i + 16`,
/// ...), each a chain of fused multiply-adds, then adds them in a fixed tree. One 512-bit register, two
/// 256-bit ones, or an array in the portable build: the same operations in the same order, so every
/// variant gives the same bits.
const LANES: usize = 16;

/// Sum of products in the fixed order above.
#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let (ta, tb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for l in 0..LANES {
            acc[l] = x[l].mul_add(y[l], acc[l]);
        }
    }
    for l in 0..ta.len() {
        acc[l] = ta[l].mul_add(tb[l], acc[l]);
    }
    let v8: [f32; 8] = std::array::from_fn(|i| acc[i] + acc[i + 8]);
    let v4: [f32; 4] = std::array::from_fn(|i| v8[i] + v8[i + 4]);
    (v4[0] + v4[2]) + (v4[1] + v4[3])
}

/// `o += p · v`, one fused multiply-add per element.
#[inline(always)]
fn axpy(o: &mut [f32], p: f32, v: &[f32]) {
    for (oi, vi) in o.iter_mut().zip(v) {
        *oi = p.mul_add(*vi, *oi);
    }
}

/// The vector width the per-row loops are compiled for, chosen at run time. Only the width differs (see
/// [`LANES`]); every width gives the same result.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Width {
    /// AVX-512 with FMA.
    W512,
    /// AVX2 with FMA.
    W256,
    /// Whatever the compile target gives (NEON on aarch64; `mul_add` is a library call on an x86 CPU
    /// without FMA).
    Portable,
}

impl Width {
    pub const ALL: [Width; 3] = [Width::W512, Width::W256, Width::Portable];

    pub fn available(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Width::W512 => is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma"),
            #[cfg(target_arch = "x86_64")]
            Width::W256 => is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"),
            Width::Portable => true,
            #[allow(unreachable_patterns)]
            _ => false,
        }
    }

    /// The widest this CPU has.
    pub fn best() -> Width {
        static BEST: std::sync::OnceLock<Width> = std::sync::OnceLock::new();
        *BEST.get_or_init(|| Width::ALL.into_iter().find(|w| w.available()).unwrap())
    }
}

/// One attention problem, split into units of (query row, key/value head).
struct HeadRows<'a> {
    qv: &'a [f32],
    kd: &'a [f32],
    vd: &'a [f32],
    vis: Visibility<'a>,
    scale: f32,
    keys: usize,
    heads: usize,
    hd: usize,
    group: usize,
    row_stride: usize,
}

impl HeadRows<'_> {
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f,avx512vl,avx2,fma")]
    unsafe fn run_512(&self, i: usize, o: &mut [f32]) {
        self.run(i, o)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn run_256(&self, i: usize, o: &mut [f32]) {
        self.run(i, o)
    }

    fn run_with(&self, width: Width, i: usize, o: &mut [f32]) {
        assert!(width.available(), "{width:?} attention on a CPU without it");
        match width {
            // SAFETY: checked just above.
            #[cfg(target_arch = "x86_64")]
            Width::W512 => unsafe { self.run_512(i, o) },
            #[cfg(target_arch = "x86_64")]
            Width::W256 => unsafe { self.run_256(i, o) },
            _ => self.run(i, o),
        }
    }

    /// Outputs `o` (`group · head_dim` values) of the `group` query heads that share key/value head
    /// `i % kv_heads`, for query row `i / kv_heads`.
    ///
    /// The heads of a group are interleaved key by key, so each key and value row is read from memory
    /// once for the whole group; each head still runs its own fixed sequence (scores in key order, their
    /// maximum, exponentials and weighted values summed in key order), so a head's result does not
    /// depend on the grouping.
    #[inline(always)]
    fn run(&self, i: usize, o: &mut [f32]) {
        let (hd, keys, group) = (self.hd, self.keys, self.group);
        let kv_heads = self.heads / group;
        let (r, kvh) = (i / kv_heads, i % kv_heads);
        let q0 = (r * self.heads + kvh * group) * hd;
        let qs = &self.qv[q0..q0 + group * hd];
        // The keys this row sees, with their additive bias, in cache order.
        let (seen, mask): (usize, Option<&[f32]>) = match self.vis {
            Visibility::Causal { offset } => ((offset + r + 1).min(keys), None),
            Visibility::Additive(m) => (keys, Some(&m[r * keys..(r + 1) * keys])),
        };
        let bias = |j: usize| -> Option<f32> {
            match mask {
                None => Some(0.0),
                Some(m) => (m[j] != f32::NEG_INFINITY).then_some(m[j]),
            }
        };
        // scores[g * keys + j]
        let mut scores = vec![f32::NEG_INFINITY; group * keys];
        let mut max = vec![f32::NEG_INFINITY; group];
        for j in 0..seen {
            if let Some(b) = bias(j) {
                let base = j * self.row_stride + kvh * hd;
                let kr = &self.kd[base..base + hd];
                for g in 0..group {
                    let s = dot(&qs[g * hd..(g + 1) * hd], kr) * self.scale + b;
                    scores[g * keys + j] = s;
                    max[g] = max[g].max(s);
                }
            }
        }
        let mut sum = vec![0.0f32; group];
        for j in 0..seen {
            if bias(j).is_none() {
                continue;
            }
            let base = j * self.row_stride + kvh * hd;
            let vr = &self.vd[base..base + hd];
            for g in 0..group {
                let s = scores[g * keys + j];
                if s == f32::NEG_INFINITY {
                    continue;
                }
                let p = (s - max[g]).exp();
                sum[g] += p;
                axpy(&mut o[g * hd..(g + 1) * hd], p, vr);
            }
        }
        for g in 0..group {
            let inv = 1.0 / sum[g];
            o[g * hd..(g + 1) * hd].iter_mut().for_each(|x| *x *= inv);
        }
    }
}

/// Borrowed f32 data of a CPU tensor whose last two dims are contiguous, from its start offset.
fn cpu_f32(guard: &Storage, start: usize) -> Result<&[f32]> {
    match guard {
        Storage::Cpu(cpu) => Ok(&cpu.as_slice::<f32>()?[start..]),
        _ => Err(Error::Msg("attention_f32 takes CPU tensors".into())),
    }
}

/// `q`: [1, rows, heads, hd]; `k`, `v`: [1, keys, kv_heads, hd] (a prefix view of the KV cache);
/// returns [rows, heads * hd].
pub fn attention_f32(q: &Tensor, k: &Tensor, v: &Tensor, vis: Visibility, scale: f32) -> Result<Tensor> {
    attention_f32_with(Width::best(), q, k, v, vis, scale)
}

/// [`attention_f32`] compiled for an explicit vector width (all give the same bits).
///
/// # Panics
/// If this CPU lacks `width`.
pub fn attention_f32_with(
    width: Width,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    vis: Visibility,
    scale: f32,
) -> Result<Tensor> {
    for t in [q, k, v] {
        if t.dtype() != DType::F32 {
            return Err(Error::Msg("attention_f32 takes f32 tensors".into()));
        }
    }
    let (_, rows, heads, hd) = q.dims4()?;
    let (_, keys, kv_heads, _) = k.dims4()?;
    if let Visibility::Additive(m) = vis {
        if m.len() != rows * keys {
            return Err(Error::Msg(format!(
                "mask has {} entries for {rows} x {keys}",
                m.len()
            )));
        }
    }
    let q = q.contiguous()?;
    let qv = q.flatten_all()?.to_vec1::<f32>()?;
    let (kg, kl) = k.storage_and_layout();
    let (vg, vl) = v.storage_and_layout();
    // Keys and values are read row by row: each [kv_heads, hd] row must be contiguous.
    let row_stride = kl.stride()[1];
    if kl.stride()[2..] != [hd, 1] || vl.stride()[2..] != [hd, 1] || vl.stride()[1] != row_stride {
        return Err(Error::Msg(
            "attention_f32: keys/values rows must be contiguous".into(),
        ));
    }
    let (kd, vd) = (cpu_f32(&kg, kl.start_offset())?, cpu_f32(&vg, vl.start_offset())?);
    let group = heads / kv_heads;
    let mut out = vec![0.0f32; rows * heads * hd];
    let job = HeadRows {
        qv: &qv,
        kd,
        vd,
        vis,
        scale,
        keys,
        heads,
        hd,
        group,
        row_stride,
    };
    let chunk = group * hd;
    let units = rows * kv_heads;
    let shared = super::pool::SharedMut::new(&mut out);
    super::pool::Pool::global().run(units, &|i| {
        // SAFETY: unit i writes its own `chunk` outputs.
        let o = unsafe { shared.range(i * chunk, chunk) };
        job.run_with(width, i, o);
    });
    Tensor::from_vec(out, (rows, heads * hd), q.device())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    fn rand_tensor(shape: &[usize], seed: u32) -> Tensor {
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n)
            .map(|i| {
                (((i as u32).wrapping_mul(2654435761).wrapping_add(seed * 97)) % 1000) as f32 / 500.0 - 1.0
            })
            .collect();
        Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
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
                                .map(|d| {
                                    q[(r * heads + h) * hd + d] as f64 * k[(j * kvh + g) * hd + d] as f64
                                })
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
        for (rows, heads, kvh, hd, cached) in [(3, 6, 2, 72, 19), (2, 4, 4, 64, 40), (1, 2, 1, 16, 3)] {
            let keys = cached + rows;
            let q = rand_tensor(&[1, rows, heads, hd], 4);
            let k = rand_tensor(&[1, keys, kvh, hd], 5);
            let v = rand_tensor(&[1, keys, kvh, hd], 6);
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
        let q = rand_tensor(&[1, rows, heads, hd], 1);
        let k = rand_tensor(&[1, keys, kvh, hd], 2);
        let v = rand_tensor(&[1, keys, kvh, hd], 3);
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

    /// `cargo test --release --lib attention::tests::timing -- --ignored --nocapture`: µs per call of
    /// SmolLM2's attention (9 heads, 3 key/value heads, head size 64) after 256 cached rows, for blocks of
    /// 1..32 rows under a tree mask (every row sees the cache and itself).
    #[test]
    #[ignore]
    fn timing() {
        let (heads, kvh, hd, cached) = (9, 3, 64, 256);
        for rows in [1, 2, 4, 8, 16, 32] {
            let keys = cached + rows;
            let q = rand_tensor(&[1, rows, heads, hd], 1);
            let k = rand_tensor(&[1, keys, kvh, hd], 2);
            let v = rand_tensor(&[1, keys, kvh, hd], 3);
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
            println!("{rows:3} rows: {:8.1} us", t * 1e3);
        }
    }
}
