//! Turning a row of logits into a token: greedy argmax, or a sample after temperature / top-k / top-p; and
//! the top-N (token, probability) list that drafters build trees from.

use crate::kernels::elementwise::{exp_nonpositive, lane_max, softmax_denominator};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// 1.0 = off.
    pub top_p: f32,
    /// 0 = off.
    pub top_k: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 299792458,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// Index of the largest logit; the first one on ties, so every strategy breaks ties the same way (0 when
/// no logit is above `-inf`; NaN never wins). The maximum first, in vector lanes, then its first index:
/// a scan that kept the running best took 56 µs for a 49152-token row, a few percent of a step.
pub fn argmax(logits: &[f32]) -> u32 {
    let max = lane_max(logits);
    if max == f32::NEG_INFINITY {
        return 0;
    }
    logits.iter().position(|&v| v == max).unwrap_or(0) as u32
}

/// The `n` most likely tokens with their softmax probabilities, most likely first (ties: lower id first;
/// NaN logits are never candidates). One pass keeps the best `n` in order; a chunk of 16 logits none of
/// which beats the `n`-th best so far is passed over whole, so the pass costs little more than reading the
/// row. The probabilities use the vectorised softmax denominator.
pub fn top_candidates(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    const CHUNK: usize = 16;
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    let max = lane_max(logits);
    let sum = softmax_denominator(logits, max);
    let mut best: Vec<u32> = Vec::with_capacity(n + 1);
    for (ci, chunk) in logits.chunks(CHUNK).enumerate() {
        if best.len() == n {
            let floor = logits[best[n - 1] as usize];
            if !chunk.iter().fold(false, |any, &v| any | (v > floor)) {
                continue;
            }
        }
        for (j, &v) in chunk.iter().enumerate() {
            if v.is_nan() || (best.len() == n && v <= logits[best[n - 1] as usize]) {
                continue;
            }
            // After every kept logit at least as large (those came first: lower ids).
            let at = best.partition_point(|&b| logits[b as usize] >= v);
            best.insert(at, (ci * CHUNK + j) as u32);
            best.truncate(n);
        }
    }
    best.into_iter()
        .map(|t| (t, exp_nonpositive(logits[t as usize] - max) / sum))
        .collect()
}

/// Draws tokens; owns the random state so a seed reproduces a run.
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    scratch: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Sampler {
            params,
            rng: StdRng::seed_from_u64(params.seed),
            scratch: Vec::new(),
        }
    }

    /// Greedy argmax at temperature 0, else a draw from the filtered, tempered distribution.
    pub fn pick(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() {
            return argmax(logits);
        }
        let t = self.params.temperature;
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        self.scratch.clear();
        self.scratch.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &v)| (i as u32, ((v - max) / t).exp())),
        );
        let probs = &mut self.scratch;
        let k = self.params.top_k;
        let nucleus = self.params.top_p < 1.0;
        if (k > 0 && k < probs.len()) || nucleus {
            probs.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            if k > 0 && k < probs.len() {
                probs.truncate(k);
            }
            if nucleus {
                let total: f32 = probs.iter().map(|p| p.1).sum();
                let mut acc = 0.0;
                let mut keep = probs.len();
                for (i, p) in probs.iter().enumerate() {
                    acc += p.1 / total;
                    if acc >= self.params.top_p {
                        keep = i + 1;
                        break;
                    }
                }
                probs.truncate(keep);
            }
        }
        let total: f32 = probs.iter().map(|p| p.1).sum();
        let mut r = self.rng.random::<f32>() * total;
        for &(tok, p) in probs.iter() {
            if r < p {
                return tok;
            }
            r -= p;
        }
        probs.last().map(|p| p.0).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_first_of_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
    }

    /// The plain scans the fast versions replace: the first strictly larger value wins; candidates are
    /// a full sort by (logit descending, id ascending), NaN left out.
    fn argmax_scan(logits: &[f32]) -> u32 {
        let (mut best, mut best_v) = (0, f32::NEG_INFINITY);
        for (i, &v) in logits.iter().enumerate() {
            if v > best_v {
                (best, best_v) = (i, v);
            }
        }
        best as u32
    }

    fn top_sorted(logits: &[f32], n: usize) -> Vec<u32> {
        let mut idx: Vec<u32> = (0..logits.len() as u32)
            .filter(|&i| !logits[i as usize].is_nan())
            .collect();
        idx.sort_by(|&a, &b| {
            logits[b as usize]
                .partial_cmp(&logits[a as usize])
                .unwrap()
                .then(a.cmp(&b))
        });
        idx.truncate(n);
        idx
    }

    #[test]
    fn fast_argmax_and_candidates_match_plain_scans() {
        let mut rng = StdRng::seed_from_u64(7);
        for len in [1, 5, 16, 17, 100, 1000, 49152] {
            for case in 0..6 {
                // Few distinct values (many ties), -inf, NaN, zeros of both signs, or all -inf.
                let logits: Vec<f32> = (0..len)
                    .map(|_| match (case, rng.random_range(0..10)) {
                        (5, _) => f32::NEG_INFINITY,
                        (0, _) => rng.random_range(-20.0..20.0),
                        (1, _) => rng.random_range(0..4) as f32,
                        (2, 0) => f32::NEG_INFINITY,
                        (3, 0) => f32::NAN,
                        (4, 0) => -0.0,
                        (4, 1) => 0.0,
                        _ => rng.random_range(-3.0..3.0f32).round(),
                    })
                    .collect();
                assert_eq!(argmax(&logits), argmax_scan(&logits), "len {len} case {case}");
                for n in [1, 3, 16, 60] {
                    let got: Vec<u32> = top_candidates(&logits, n).iter().map(|c| c.0).collect();
                    assert_eq!(got, top_sorted(&logits, n), "len {len} case {case} n {n}");
                }
            }
        }
        // Probabilities: the softmax's, summing to 1 over the whole row.
        let logits: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.37).sin() * 8.0).collect();
        let all = top_candidates(&logits, logits.len());
        let total: f64 = all.iter().map(|c| f64::from(c.1)).sum();
        assert!((total - 1.0).abs() < 1e-5, "{total}");
        let max = logits.iter().copied().fold(f32::MIN, f32::max);
        let z: f64 = logits.iter().map(|&v| f64::from(v - max).exp()).sum();
        for c in &all[..10] {
            let want = f64::from(logits[c.0 as usize] - max).exp() / z;
            assert!(
                (f64::from(c.1) - want).abs() < 1e-6 * want.max(1e-3),
                "{c:?} {want}"
            );
        }
    }

    #[test]
    fn top_candidates_are_sorted_probabilities() {
        let c = top_candidates(&[0.0, 2.0, 1.0, 2.0], 3);
        assert_eq!(c.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3, 2]);
        let z = 1.0 + 2.0 * 2f32.exp() + 1f32.exp();
        assert!((c[0].1 - 2f32.exp() / z).abs() < 1e-6);
    }

    #[test]
    fn top_k_one_is_greedy() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..Default::default()
        });
        for _ in 0..20 {
            assert_eq!(s.pick(&[0.5, 0.1, 2.0, 1.9]), 2);
        }
    }

    #[test]
    fn sampling_follows_distribution() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            ..Default::default()
        });
        let logits = [0.0f32, (3.0f32).ln()]; // p = 0.25, 0.75
        let n = 20000;
        let ones = (0..n).filter(|_| s.pick(&logits) == 1).count() as f64 / n as f64;
        // sd = sqrt(.25*.75/20000) ~ 0.003; 5 sd
        assert!((ones - 0.75).abs() < 0.016, "{ones}");
    }
}
