//! The forward cost curve: seconds of one decoding step against the rows in its block and the tokens
//! already cached. `--bc auto` prices every block it could send with it (see [`super::auto`]).
//!
//! It is timed once per machine, model, device and dtype, at a few cache lengths and block sizes, and
//! kept on disk ([`super::cost_cache`]); every step reads it at the current cache length, interpolated
//! between the timed ones (attention grows with the cache, so a block's price relative to one row moves as
//! the answer grows).

use crate::model::{BlockMask, KvCache, SequenceBlock, Transformer};
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// Most rows of one vocabulary projection while verifying: the visited node and what it may need next.
pub const LOGIT_ROWS: usize = 8;

/// Cache lengths timed (those that leave room for the largest block in the context window).
pub const TIMED_CONTEXTS: [usize; 3] = [64, 256, 1024];
/// Block sizes timed; costs in between are interpolated, beyond extrapolated (the curve is linear there:
/// 32 rows would add a third to the timing for a point the line from 8 and 16 predicts within a few %).
pub const TIMED_ROWS: [usize; 5] = [1, 2, 4, 8, 16];
/// Timed runs per point; the median is kept.
const REPEATS: usize = 3;
/// What the first timing pass of a model aims to cost ([`CostCurve::measure_within`]): it is paid by
/// the first run on a machine, on top of the answer.
pub const FIRST_TIMING_BUDGET: Duration = Duration::from_secs(1);

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

/// The runs a curve was made from, kept with it so that a timing cut short by its budget is topped up
/// by later runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Samples {
    pub contexts: Vec<usize>,
    pub rows: Vec<usize>,
    /// `points[c][r]`: the seconds of each run of `rows[r]` rows after `contexts[c]` cached tokens.
    pub points: Vec<Vec<Vec<f64>>>,
    /// The runs of the extra vocabulary projection.
    pub extra: Vec<f64>,
}

impl Samples {
    /// Whether every point (and the extra projection) has its `REPEATS` runs.
    pub fn complete(&self) -> bool {
        self.extra.len() >= REPEATS && self.points.iter().flatten().all(|t| t.len() >= REPEATS)
    }
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

    /// Times the model fully: at each cache length of [`TIMED_CONTEXTS`] that fits its window, every
    /// block size of [`TIMED_ROWS`], the median of `REPEATS` runs (`probespec cost --save`).
    pub fn measure(model: &Transformer) -> Result<(Self, Samples)> {
        Self::measure_within(model, None, None)
    }

    /// Times the model within about `budget` (none: no limit), continuing from `prior` (the samples a
    /// budgeted timing of the same grid left): the points of the grid in order of how much of the curve
    /// they pin down (the corners of the fewest and most rows at the shortest and longest cache first,
    /// then the middles), one run each, then more runs while the budget lasts, up to `REPEATS`.
    /// Points never timed are interpolated from the timed ones ([`fill_untimed`]), so a large model's
    /// first run pays a second or so for its curve instead of most of a minute, and each later run
    /// tops it up within the same budget until [`Samples::complete`]. The corners are always timed,
    /// past the budget if need be.
    pub fn measure_within(
        model: &Transformer,
        budget: Option<Duration>,
        prior: Option<&Samples>,
    ) -> Result<(Self, Samples)> {
        let start = Instant::now();
        let (contexts, rows) = grid_for(model);
        let order = timing_order(contexts.len(), rows.len());
        let max_rows = *rows.last().unwrap();
        let vocab = model.config.vocab_size as u64;
        let ids: Vec<u32> = (0..max_rows)
            .map(|i| ((i as u64 * 2_654_435_761 + 12_345) % vocab) as u32)
            .collect();
        let mut cache = model.new_cache(contexts[contexts.len() - 1] + max_rows)?;
        let mut samples = match prior {
            Some(p) if p.contexts == contexts && p.rows == rows => p.clone(),
            _ => Samples {
                points: vec![vec![Vec::new(); rows.len()]; contexts.len()],
                contexts: contexts.clone(),
                rows: rows.clone(),
                extra: Vec::new(),
            },
        };
        let over = |t: &Instant| budget.is_some_and(|b| t.elapsed() >= b);
        // One warm-up run of the fewest and most rows (the first forward pays page faults and buffers).
        resize(model, contexts[0], &mut cache)?;
        time_step(model, &ids[..1], &mut cache)?;
        time_step(model, &ids[..max_rows], &mut cache)?;
        'repeats: for repeat in 0..REPEATS {
            for &(c, r, priority) in &order {
                let runs = &samples.points[c][r];
                if runs.len() > repeat {
                    continue;
                }
                if over(&start) && !(priority == 0 && runs.is_empty()) {
                    break 'repeats;
                }
                resize(model, contexts[c], &mut cache)?;
                let t = time_step(model, &ids[..rows[r]], &mut cache)?;
                samples.points[c][r].push(t);
            }
        }
        let timed: Vec<Vec<Option<f64>>> = samples
            .points
            .iter()
            .map(|line| {
                line.iter()
                    .map(|t| (!t.is_empty()).then(|| median(&mut t.clone())))
                    .collect()
            })
            .collect();
        let seconds = fill_untimed(&contexts, &rows, &timed);
        let h = model.embed(&[0])?;
        // At least one run of the vocabulary projection, more while the budget lasts.
        while samples.extra.len() < REPEATS && (samples.extra.is_empty() || !over(&start)) {
            model.device.synchronize()?;
            let t = Instant::now();
            model.logits(&h, &[0])?.to_vec2::<f32>()?;
            samples.extra.push(t.elapsed().as_secs_f64());
        }
        let curve = CostCurve {
            contexts,
            rows,
            seconds,
            extra_logits_seconds: median(&mut samples.extra.clone()),
        };
        Ok((curve, samples))
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

/// The cache lengths of [`TIMED_CONTEXTS`] that leave room for the largest block in the model's
/// window (a window too small for the grid, a toy model: half of it), and the block sizes of
/// [`TIMED_ROWS`] that fit after the longest.
fn grid_for(model: &Transformer) -> (Vec<usize>, Vec<usize>) {
    let max_rows = *TIMED_ROWS.last().unwrap();
    let window = model.config.max_position_embeddings;
    let mut contexts: Vec<usize> = TIMED_CONTEXTS
        .iter()
        .copied()
        .filter(|&c| c + max_rows <= window)
        .collect();
    if contexts.is_empty() {
        contexts.push(window / 2);
    }
    let rows = TIMED_ROWS
        .iter()
        .copied()
        .filter(|&r| r == 1 || contexts[contexts.len() - 1] + r <= window)
        .collect();
    (contexts, rows)
}

/// How late bisection reaches index `i` of `n` sorted values: the two ends 0, the middle 1, the
/// quarters 2, ...
fn bisection_depth(i: usize, n: usize) -> usize {
    if i == 0 || i + 1 >= n {
        return 0;
    }
    let (mut lo, mut hi, mut depth) = (0, n - 1, 1);
    loop {
        let mid = (lo + hi) / 2;
        if i == mid {
            return depth;
        }
        (lo, hi) = if i < mid { (lo, mid) } else { (mid, hi) };
        depth += 1;
    }
}

/// The points (context index, rows index, priority) of a grid in the order they are timed: by the sum
/// of their bisection depths (the corners first), then by cache length and rows.
fn timing_order(contexts: usize, rows: usize) -> Vec<(usize, usize, usize)> {
    let mut order: Vec<(usize, usize, usize)> = (0..contexts)
        .flat_map(|c| (0..rows).map(move |r| (c, r, bisection_depth(c, contexts) + bisection_depth(r, rows))))
        .collect();
    order.sort_by_key(|&(c, r, p)| (p, c, r));
    order
}

/// The full grid from the timed points (`timed[c][r]`, `None` where untimed): a bigger block, or a longer
/// cache, is never recorded as cheaper than a smaller one (that is timing noise); a cache length with two or more timed
/// sizes gets the others by `interpolate` in rows; one with fewer is interpolated, size by size,
/// between the nearest such lengths below and above (held beyond them). At least one length must have
/// two timed sizes, or one size when there is only one.
pub fn fill_untimed(contexts: &[usize], rows: &[usize], timed: &[Vec<Option<f64>>]) -> Vec<Vec<f64>> {
    let mut lines: Vec<Option<Vec<f64>>> = timed
        .iter()
        .map(|line| {
            let mut xs = Vec::new();
            let mut ys: Vec<f64> = Vec::new();
            for (&r, t) in rows.iter().zip(line) {
                if let Some(t) = *t {
                    xs.push(r);
                    ys.push(ys.last().map_or(t, |&y: &f64| y.max(t)));
                }
            }
            (xs.len() >= 2 || (xs.len() == 1 && rows.len() == 1)).then(|| {
                let mut line: Vec<f64> = rows.iter().map(|&r| interpolate(&xs, &ys, r as f64)).collect();
                for i in 1..line.len() {
                    line[i] = line[i].max(line[i - 1]);
                }
                line
            })
        })
        .collect();
    let known: Vec<usize> = (0..lines.len()).filter(|&c| lines[c].is_some()).collect();
    for c in 0..lines.len() {
        if lines[c].is_some() {
            continue;
        }
        let below = known.iter().rev().copied().find(|&k| k < c);
        let above = known.iter().copied().find(|&k| k > c);
        let line = match (below, above) {
            (Some(a), Some(b)) => {
                let w = (contexts[c] - contexts[a]) as f64 / (contexts[b] - contexts[a]) as f64;
                let (la, lb) = (lines[a].as_ref().unwrap(), lines[b].as_ref().unwrap());
                la.iter().zip(lb).map(|(&x, &y)| x + w * (y - x)).collect()
            }
            (Some(k), None) | (None, Some(k)) => lines[k].clone().unwrap(),
            (None, None) => panic!("no cache length has enough timed points"),
        };
        lines[c] = Some(line);
    }
    // Attention only adds work as the cache grows: a longer cache timed cheaper is noise too.
    let mut lines: Vec<Vec<f64>> = lines.into_iter().map(Option::unwrap).collect();
    for c in 1..lines.len() {
        let (shorter, longer) = lines.split_at_mut(c);
        for (l, s) in longer[0].iter_mut().zip(&shorter[c - 1]) {
            *l = l.max(*s);
        }
    }
    lines
}

/// Times decoding steps of each block size after each cache length: `samples[c][r]` holds `repeats`
/// timings (after one warm-up run of every size; sizes interleaved within a repeat, so that a drift of the
/// machine spreads over all of them). Token ids are an arbitrary fixed sequence: the cost depends on the
/// shapes, not the values. With `sequences`, a block of R rows is R sequences of one row each, every one
/// after its own cache ([`time_batch_step`]): a batched server's plain decoding step.
pub fn time_grid(
    model: &Transformer,
    contexts: &[usize],
    rows: &[usize],
    repeats: usize,
    sequences: bool,
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
    // Caches grown from one length to the next: one, or one per sequence.
    let caches = if sequences { max_rows } else { 1 };
    let mut caches: Vec<KvCache> = (0..caches)
        .map(|_| model.new_cache(max_ctx + max_rows))
        .collect::<Result<_>>()?;
    for (slot, ctx) in sorted {
        for cache in caches.iter_mut() {
            fill(model, ctx, cache)?;
        }
        let mut time = |r: usize| match sequences {
            false => time_step(model, &ids[ctx..ctx + r], &mut caches[0]),
            true => time_batch_step(model, &ids[ctx..ctx + r], &mut caches[..r]),
        };
        for &r in rows {
            time(r)?;
        }
        let mut times: Vec<Vec<f64>> = vec![Vec::with_capacity(repeats); rows.len()];
        for _ in 0..repeats {
            for (i, &r) in rows.iter().enumerate() {
                times[i].push(time(r)?);
            }
        }
        out[slot] = times;
    }
    Ok(out)
}

/// Grows the cache to `len` rows of made-up keys and values: what attention reads costs the same
/// whatever the numbers, and writing a constant is far cheaper than a prefill of `len` tokens (seconds on
/// a CPU) or random draws (a fifth of a second for a 1B model's 1024 rows).
fn fill(model: &Transformer, len: usize, cache: &mut KvCache) -> Result<()> {
    let rows = len.saturating_sub(cache.len());
    if rows == 0 {
        return Ok(());
    }
    let c = &model.config;
    let shape = (1, rows, c.num_kv_heads, c.head_dim);
    let kv = Tensor::full(0.125f32, shape, &model.device)?.to_dtype(model.dtype)?;
    for layer in 0..c.num_layers {
        cache.write(layer, &kv, &kv)?;
    }
    cache.advance(rows);
    Ok(())
}

/// The cache at exactly `len` rows: grown with [`fill`], or cut back.
fn resize(model: &Transformer, len: usize, cache: &mut KvCache) -> Result<()> {
    if cache.len() > len {
        cache.truncate(len);
    }
    fill(model, len, cache)
}

/// Seconds of one decoding step: the block of tokens `block` after the cache's committed rows, under an
/// additive mask (a tree's shape does not change the cost), then the verifier's first vocabulary
/// projection (up to [`LOGIT_ROWS`] rows) read back to the host; the
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
    let first: Vec<usize> = (0..rows.min(LOGIT_ROWS)).collect();
    model.logits(&h, &first)?.to_vec2::<f32>()?;
    let dt = t.elapsed().as_secs_f64();
    cache.truncate(ctx);
    Ok(dt)
}

/// Seconds of a batched plain decoding step: token `ids[i]` as the next row of the sequence cached in
/// `caches[i]`, all in one forward pass, then every row's vocabulary projection (each sequence needs its
/// next token) read back to the host; the caches are rolled back afterwards.
pub fn time_batch_step(model: &Transformer, ids: &[u32], caches: &mut [KvCache]) -> Result<f64> {
    let xs: Vec<Tensor> = ids.iter().map(|&id| model.embed(&[id])).collect::<Result<_>>()?;
    let positions: Vec<[u32; 1]> = caches.iter().map(|c| [c.len() as u32]).collect();
    let lens: Vec<usize> = caches.iter().map(KvCache::len).collect();
    let mut blocks: Vec<SequenceBlock> = xs
        .iter()
        .zip(&positions)
        .zip(caches.iter_mut())
        .map(|((x, positions), cache)| SequenceBlock {
            x,
            positions,
            mask: &BlockMask::Causal,
            cache,
        })
        .collect();
    model.device.synchronize()?;
    let t = Instant::now();
    let hidden = model.forward_batch(&mut blocks)?;
    let h = Tensor::cat(&hidden, 0)?;
    let all: Vec<usize> = (0..ids.len()).collect();
    model.logits(&h, &all)?.to_vec2::<f32>()?;
    let dt = t.elapsed().as_secs_f64();
    for (cache, len) in caches.iter_mut().zip(lens) {
        cache.truncate(len);
    }
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
    fn the_corners_are_timed_first_and_the_rest_is_interpolated() {
        assert_eq!(
            (0..5).map(|i| bisection_depth(i, 5)).collect::<Vec<_>>(),
            [0, 2, 1, 2, 0]
        );
        assert_eq!(bisection_depth(0, 1), 0);
        let order: Vec<(usize, usize)> = timing_order(3, 5).iter().map(|p| (p.0, p.1)).collect();
        assert_eq!(order.len(), 15);
        // 1 and 16 rows at 64 and 1024 cached tokens, then 4 rows there and the middle length's ends.
        assert_eq!(&order[..4], &[(0, 0), (0, 4), (2, 0), (2, 4)]);
        assert_eq!(&order[4..8], &[(0, 2), (1, 0), (1, 4), (2, 2)]);
        // A curve linear in rows and in the cache length is rebuilt exactly from its corners alone.
        let (contexts, rows) = (TIMED_CONTEXTS.to_vec(), TIMED_ROWS.to_vec());
        let f = |c: usize, r: usize| 1.0 + r as f64 * (1.0 + c as f64 / 256.0);
        let corners: Vec<Vec<Option<f64>>> = contexts
            .iter()
            .enumerate()
            .map(|(ci, &c)| {
                rows.iter()
                    .enumerate()
                    .map(|(ri, &r)| (bisection_depth(ci, 3) + bisection_depth(ri, 5) == 0).then(|| f(c, r)))
                    .collect()
            })
            .collect();
        let full = fill_untimed(&contexts, &rows, &corners);
        for (ci, &c) in contexts.iter().enumerate() {
            for (ri, &r) in rows.iter().enumerate() {
                assert!((full[ci][ri] - f(c, r)).abs() < 1e-9, "{c} {r}: {}", full[ci][ri]);
            }
        }
        // A length with one timed size is rebuilt from its neighbours; a timed point wins over the
        // interpolation, and noise never makes a bigger block cheaper.
        let mut timed = corners.clone();
        timed[1][0] = Some(f(256, 1));
        timed[0][2] = Some(0.5);
        let full = fill_untimed(&contexts, &rows, &timed);
        assert!((full[1][4] - f(256, 16)).abs() < 1e-9);
        assert_eq!(full[0][2], full[0][1]);
        assert!(full[0].windows(2).all(|w| w[0] <= w[1]), "{:?}", full[0]);
        // A longer cache timed cheaper is raised to the shorter one's cost.
        let mut timed = corners;
        timed[2][0] = Some(0.1);
        let full = fill_untimed(&contexts, &rows, &timed);
        assert_eq!(full[2][0], full[0][0]);
        assert_eq!(full[1][0], full[0][0]);
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
