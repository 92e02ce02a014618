//! Turning a row of logits into a token: greedy argmax, or a sample after temperature / top-k / top-p; and
//! the top-N (token, probability) list that drafters build trees from.

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

/// Index of the largest logit; the first one on ties, so every strategy breaks ties the same way.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

/// The `n` most likely tokens with their softmax probabilities, most likely first (ties: lower id first).
pub fn top_candidates(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    let n = n.min(logits.len());
    if n == 0 {
        return Vec::new();
    }
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&v| (v - max).exp()).sum();
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if n < idx.len() {
        idx.select_nth_unstable_by(n - 1, by_logit);
        idx.truncate(n);
    }
    idx.sort_by(by_logit);
    idx.into_iter()
        .map(|t| (t, (logits[t as usize] - max).exp() / sum))
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
