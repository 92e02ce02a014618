//! The forward cost curve: seconds of one decoding step against the rows in its block and the tokens
//! already cached. `--bc auto` prices every block it could send with it (see [`super::auto`]).
//!
//! It is timed once per machine, model, device and dtype, at a few cache lengths and block sizes, and
//! kept on disk ([`super::cost_cache`]); every step reads it at the current cache length, interpolated
//! between the timed ones (attention grows with the cache, so a block's price relative to one row moves as
//! the answer grows).

use crate::model::{BlockMask, KvCache, Transformer};
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// Cache lengths timed (those that leave room for the largest block in the context window).
pub const TIMED_CONTEXTS: [usize; 3] = [64, 256, 1024];
/// Block sizes timed; costs in between are interpolated, beyond extrapolated (the curve is linear there:
/// 32 rows would add a third to the timing for a point the line from 8 and 16 predicts within a few %).
pub const TIMED_ROWS: [usize; 5] = [1, 2, 4, 8, 16];
/// Timed runs per point; the median is kept.
const REPEATS: usize = 3;

/// Seconds of a decoding step by cache length and block size, plus one extra vocabulary projection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostCurve {
    /// Cache lengths timed, ascending.
    pub contexts: Vec<usize>,
    /// Block sizes timed, ascending, starting at 1.
    pub rows: Vec<usize>,
    /// `seconds[c][r]`: a block of `rows[r]` rows after `contexts[c]` cached tokens, with the verifier's
    /// first vocabulary projection ([`time_step`]).
    pub seconds: Vec<Vec<f64>>,
    /// One more lm_head pass over a few rows: the verifier pays it per accepted level beyond those the
    /// first projection fetched ahead.
    pub extra_logits_seconds: f64,
}

impl CostCurve {
    /// A curve from a formula `f(cache length, rows)` at the timed points: for tests and what-if runs.
    pub fn from_fn(f: impl Fn(usize, usize) -> f64, extra_logits_seconds: f64) -> Self {
        let contexts = TIMED_CONTEXTS.to_vec();
        let rows = TIMED_ROWS.to_vec();
        let seconds = contexts
            .iter()
            .map(|&c| rows.iter().map(|&r| f(c, r)).collect())
            .collect();
        CostCurve {
            contexts,
            rows,
            seconds,
            extra_logits_seconds,
        }
    }

    /// Times the model: at each cache length of [`TIMED_CONTEXTS`] that fits its window, every block size
    /// of [`TIMED_ROWS`] (after a warm-up, the median of a few runs), the way the decoding loop runs them.
    /// A bigger block is never recorded as cheaper than a smaller one (that is timing noise).
    pub fn measure(model: &Transformer) -> Result<Self> {
        let max_rows = *TIMED_ROWS.last().unwrap();
        let window = model.config.max_position_embeddings;
        let mut contexts: Vec<usize> = TIMED_CONTEXTS
            .iter()
            .copied()
            .filter(|&c| c + max_rows <= window)
            .collect();
        // A window too small for the grid (a toy model): half of it, and the blocks that fit the rest.
        if contexts.is_empty() {
            contexts.push(window / 2);
        }
        let rows: Vec<usize> = TIMED_ROWS
            .iter()
            .copied()
            .filter(|&r| r == 1 || contexts[contexts.len() - 1] + r <= window)
            .collect();
        let samples = time_grid(model, &contexts, &rows, REPEATS)?;
        let seconds = samples
            .into_iter()
            .map(|per_rows| {
                let mut line: Vec<f64> = per_rows.into_iter().map(|mut t| median(&mut t)).collect();
                for i in 1..line.len() {
                    line[i] = line[i].max(line[i - 1]);
                }
                line
            })
            .collect();
        let h = model.embed(&[0])?;
        let mut extra = Vec::new();
        for _ in 0..REPEATS {
            model.device.synchronize()?;
            let t = Instant::now();
            model.logits(&h, &[0])?.to_vec2::<f32>()?;
            extra.push(t.elapsed().as_secs_f64());
        }
        Ok(CostCurve {
            contexts,
            rows,
            seconds,
            extra_logits_seconds: median(&mut extra),
        })
    }

    /// Whether the curve is usable (a file read back may hold anything).
    pub fn check(&self) -> Result<()> {
        let ascending = |v: &[usize]| v.windows(2).all(|w| w[0] < w[1]);
        if self.contexts.is_empty()
            || self.rows.first() != Some(&1)
            || !ascending(&self.contexts)
            || !ascending(&self.rows)
            || self.seconds.len() != self.contexts.len()
            || self.seconds.iter().any(|l| l.len() != self.rows.len())
            || self
                .seconds
                .iter()
                .flatten()
                .any(|s| !(s.is_finite() && *s > 0.0))
            || !(self.extra_logits_seconds.is_finite() && self.extra_logits_seconds >= 0.0)
        {
            bail!("malformed cost curve");
        }
        Ok(())
    }

    /// Seconds of a block of `rows` rows after `context` cached tokens: linear in the rows between the
    /// timed sizes (extrapolated past the largest), linear in the cache length between the timed lengths
    /// (held below the first, extrapolated past the last, never below it).
    pub fn cost(&self, rows: usize, context: usize) -> f64 {
        let at = |c: usize| interpolate(&self.rows, &self.seconds[c], rows.max(1) as f64);
        let n = self.contexts.len();
        if n == 1 || context <= self.contexts[0] {
            return at(0);
        }
        let i = self.contexts.partition_point(|&x| x < context).clamp(1, n - 1);
        let (x0, x1) = (self.contexts[i - 1] as f64, self.contexts[i] as f64);
        let (y0, y1) = (at(i - 1), at(i));
        let y = y0 + (y1 - y0) * (context as f64 - x0) / (x1 - x0);
        if context > self.contexts[n - 1] {
            y.max(y1)
        } else {
            y
        }
    }
}

/// Piecewise-linear `y(x)` through the points `(xs, ys)`, extrapolated from the two end points.
fn interpolate(xs: &[usize], ys: &[f64], x: f64) -> f64 {
    if xs.len() == 1 {
        return ys[0];
    }
    let i = xs.partition_point(|&v| (v as f64) < x).clamp(1, xs.len() - 1);
    let (x0, x1) = (xs[i - 1] as f64, xs[i] as f64);
    let y = ys[i - 1] + (ys[i] - ys[i - 1]) * (x - x0) / (x1 - x0);
    y.max(f64::MIN_POSITIVE)
}

/// Times decoding steps of each block size after each cache length: `samples[c][r]` holds `repeats`
/// timings (after one warm-up run of every size; sizes interleaved within a repeat, so that a drift of the
/// machine spreads over all of them). Token ids are an arbitrary fixed sequence: the cost depends on the
/// shapes, not the values.
pub fn time_grid(
    model: &Transformer,
    contexts: &[usize],
    rows: &[usize],
    repeats: usize,
) -> Result<Vec<Vec<Vec<f64>>>> {
    let max_rows = rows.iter().copied().max().unwrap_or(1);
    let max_ctx = contexts.iter().copied().max().unwrap_or(1);
    let vocab = model.config.vocab_size as u64;
    let ids: Vec<u32> = (0..max_ctx + max_rows)
        .map(|i| ((i as u64 * 2_654_435_761 + 12_345) % vocab) as u32)
        .collect();
    let mut sorted: Vec<(usize, usize)> = contexts.iter().copied().enumerate().collect();
    sorted.sort_by_key(|&(_, c)| c);
    let mut out = vec![Vec::new(); contexts.len()];
    // One cache grown from one length to the next.
    let mut cache = model.new_cache(max_ctx + max_rows)?;
    for (slot, ctx) in sorted {
        fill(model, ctx, &mut cache)?;
        for &r in rows {
            time_step(model, &ids[ctx..ctx + r], &mut cache)?;
        }
        let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(repeats); rows.len()];
        for _ in 0..repeats {
            for (i, &r) in rows.iter().enumerate() {
                times[i].push(time_step(model, &ids[ctx..ctx + r], &mut cache)?);
            }
        }
        out[slot] = times;
    }
    Ok(out)
}

/// Grows the cache to `len` rows of random keys and values: what attention reads costs the same whatever
/// the numbers, and writing them is far cheaper than a prefill of `len` tokens (seconds on a CPU).
fn fill(model: &Transformer, len: usize, cache: &mut KvCache) -> Result<()> {
    let rows = len.saturating_sub(cache.len());
    if rows == 0 {
        return Ok(());
    }
    let c = &model.config;
    let shape = (1, rows, c.num_kv_heads, c.head_dim);
    for layer in 0..c.num_layers {
        let k = Tensor::randn(0f32, 1.0, shape, &model.device)?.to_dtype(model.dtype)?;
        let v = Tensor::randn(0f32, 1.0, shape, &model.device)?.to_dtype(model.dtype)?;
        cache.write(layer, &k, &v)?;
    }
    cache.advance(rows);
    Ok(())
}

/// Seconds of one decoding step: the block of tokens `block` after the cache's committed rows, under an
/// additive mask (a tree's shape does not change the cost), then the verifier's first vocabulary
/// projection (up to [`LOGIT_ROWS`](crate::decode::generate::LOGIT_ROWS) rows) read back to the host; the
/// cache is rolled back afterwards.
pub fn time_step(model: &Transformer, block: &[u32], cache: &mut KvCache) -> Result<f64> {
    let (ctx, rows) = (cache.len(), block.len());
    let x = model.embed(block)?;
    let positions: Vec<u32> = (ctx as u32..(ctx + rows) as u32).collect();
    let mask = if rows == 1 {
        BlockMask::Causal
    } else {
        BlockMask::Additive(Tensor::zeros((rows, ctx + rows), DType::F32, &model.device)?)
    };
    model.device.synchronize()?;
    let t = Instant::now();
    let h = model.forward(&x, &positions, &mask, cache)?;
    // As the verifier's first projection: the root and what it fetches ahead.
    let first: Vec<usize> = (0..rows.min(crate::decode::generate::LOGIT_ROWS)).collect();
    model.logits(&h, &first)?.to_vec2::<f32>()?;
    let dt = t.elapsed().as_secs_f64();
    cache.truncate(ctx);
    Ok(dt)
}

/// The median (the mean of the middle two for an even count); sorts `v`.
pub fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interpolates_in_rows_and_cache_length() {
        // cost = rows * (1 + context / 1024): linear in both.
        let c = CostCurve::from_fn(|ctx, r| r as f64 * (1.0 + ctx as f64 / 1024.0), 0.0);
        c.check().unwrap();
        let want = |r: f64, ctx: f64| r * (1.0 + ctx / 1024.0);
        for (r, ctx) in [(1, 64), (3, 64), (12, 256), (96, 256), (5, 640), (20, 2048)] {
            let got = c.cost(r, ctx);
            assert!(
                (got - want(r as f64, ctx as f64)).abs() < 1e-9,
                "{r} {ctx}: {got}"
            );
        }
        // Below the first timed length the cost is held.
        assert_eq!(c.cost(4, 1), c.cost(4, 64));
        // One length only: the rows alone.
        let one = CostCurve {
            contexts: vec![100],
            rows: vec![1, 2],
            seconds: vec![vec![1.0, 3.0]],
            extra_logits_seconds: 0.0,
        };
        assert_eq!(one.cost(3, 5000), 5.0);
    }

    #[test]
    fn malformed_curves_are_refused() {
        let good = CostCurve::from_fn(|_, r| r as f64, 0.1);
        assert!(good.check().is_ok());
        let mut bad = good.clone();
        bad.seconds[1][2] = f64::NAN;
        assert!(bad.check().is_err());
        let mut bad = good.clone();
        bad.rows[0] = 2;
        assert!(bad.check().is_err());
        let mut bad = good.clone();
        bad.seconds.pop();
        assert!(bad.check().is_err());
        let mut bad = good;
        bad.contexts = vec![];
        bad.seconds = vec![];
        assert!(bad.check().is_err());
    }
}
