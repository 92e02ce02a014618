//! `--bc auto`: choose the block complexity that maximises committed tokens per second on the running
//! machine, down to plain decoding when speculation cannot pay.
//!
//! Two measurements meet here. The forward cost against block size (`CostCurve`), timed once per model and
//! process with a few forward passes at start-up; and the acceptance observed so far: the rank, among the
//! depth-1 candidates of the previous step's mask, of the token that was actually committed next. A
//! dynamic tree of `B` nodes with one mask depth accepts its first level when that rank is below `B`, so
//! the rank histogram prices every budget at once, whichever budget was in use when it was observed.

use crate::decode::budget::rows_for;
use crate::model::{BlockMask, KvCache, Transformer};
use anyhow::Result;
use candle_core::{DType, Tensor};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Instant;

/// Block sizes timed at start-up; costs in between are interpolated, beyond extrapolated. (Not 32: on a
/// CPU it alone would add a third to the start-up time, and the curve is linear there.)
const TIMED_ROWS: [usize; 5] = [1, 2, 4, 8, 16];
/// Node budgets considered (k = 1: BC 4, 6, 8, 10, 14, 20, 30, 40, 60).
const BUDGETS: [usize; 9] = [1, 2, 3, 4, 6, 9, 14, 19, 29];
/// Ranks tracked exactly; a rank at or beyond this counts as "never in the tree".
pub const MAX_RANK: usize = 32;
/// Weight of the prior, in observations.
const PRIOR_WEIGHT: f64 = 16.0;
/// While plain decoding is chosen, one step in this many still runs the root's masks, so acceptance keeps
/// being observed and speculation can come back when the text becomes predictable.
const EXPLORE_EVERY: usize = 8;

/// Seconds of one decoding step against the rows in its block, plus one extra vocabulary projection.
#[derive(Debug, Clone)]
pub struct CostCurve {
    pub rows: Vec<usize>,
    pub seconds: Vec<f64>,
    /// One more lm_head pass over a few rows: the verifier pays it per accepted tree level.
    pub extra_logits_seconds: f64,
}

impl CostCurve {
    /// Times forwards of each size in `TIMED_ROWS` after `context` cached rows (after a warm-up; the best
    /// of two runs for the cheap small blocks, where noise matters most), the way the decoding loop runs
    /// them: block, then logits of one row. About 15 single-row forwards in all.
    pub fn measure(model: &Transformer, context: &[u32]) -> Result<Self> {
        let ctx = context.len().clamp(1, 256);
        let max_rows = *TIMED_ROWS.last().unwrap();
        let mut cache = model.new_cache(ctx + max_rows)?;
        let pos: Vec<u32> = (0..ctx as u32).collect();
        model.forward(
            &model.embed(&context[..ctx])?,
            &pos,
            &BlockMask::Causal,
            &mut cache,
        )?;
        let fill = context[ctx - 1];
        let mut time_block = |s: usize| time_step(model, &vec![fill; s], &mut cache);
        time_block(1)?; // warm-up: first-touch of weights and buffers
        let mut seconds = Vec::with_capacity(TIMED_ROWS.len());
        for &s in &TIMED_ROWS {
            let t = time_block(s)?;
            seconds.push(if s <= 4 { t.min(time_block(s)?) } else { t });
        }
        let h = model.embed(&[fill])?;
        let t = Instant::now();
        model.logits(&h, &[0])?.to_vec2::<f32>()?;
        let extra_logits_seconds = t.elapsed().as_secs_f64();
        Ok(CostCurve {
            rows: TIMED_ROWS.to_vec(),
            seconds,
            extra_logits_seconds,
        })
    }

    /// The curve for `model`, measured on its first use in this process (keyed by the model's identity,
    /// not by where it sits in memory: a later model at the same address gets its own curve).
    pub fn for_model(model: &Transformer, context: &[u32]) -> Result<Arc<CostCurve>> {
        static CURVES: OnceLock<Mutex<HashMap<u64, Arc<CostCurve>>>> = OnceLock::new();
        let key = model.id;
        let curves = CURVES.get_or_init(Default::default);
        if let Some(c) = curves.lock().unwrap().get(&key) {
            return Ok(c.clone());
        }
        let c = Arc::new(CostCurve::measure(model, context)?);
        curves.lock().unwrap().insert(key, c.clone());
        Ok(c)
    }

    /// Cost of a block of `rows`, linearly interpolated (and extrapolated past the last size).
    pub fn cost(&self, rows: usize) -> f64 {
        let r = rows.max(1);
        let i = self.rows.partition_point(|&x| x < r);
        if i < self.rows.len() && self.rows[i] == r {
            return self.seconds[i];
        }
        let (a, b) = if i == 0 {
            (0, 1)
        } else if i >= self.rows.len() {
            (self.rows.len() - 2, self.rows.len() - 1)
        } else {
            (i - 1, i)
        };
        let (x0, x1) = (self.rows[a] as f64, self.rows[b] as f64);
        let (y0, y1) = (self.seconds[a], self.seconds[b]);
        y0 + (y1 - y0) * (r as f64 - x0) / (x1 - x0)
    }
}

/// Seconds of one decoding step: the block of tokens `block` after the cache's committed rows, under an
/// additive mask (a tree's shape does not change the cost), then one row of logits read back to the host;
/// the cache is rolled back afterwards.
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
    model.logits(&h, &[0])?.to_vec2::<f32>()?;
    let dt = t.elapsed().as_secs_f64();
    cache.truncate(ctx);
    Ok(dt)
}

/// Picks the node budget per step from the cost curve and the observed acceptance.
pub struct AutoBudget {
    curve: Arc<CostCurve>,
    masks: usize,
    /// ranks[r] = observations of rank r; ranks[MAX_RANK] = not among the candidates.
    ranks: Vec<u64>,
    plain_steps: usize,
}

impl AutoBudget {
    pub fn new(curve: Arc<CostCurve>, masks: usize) -> Self {
        AutoBudget {
            curve,
            masks,
            ranks: vec![0; MAX_RANK + 1],
            plain_steps: 0,
        }
    }

    /// Records where the committed token stood among the previous step's depth-1 candidates.
    pub fn observe_rank(&mut self, rank: Option<usize>) {
        self.ranks[rank.unwrap_or(MAX_RANK).min(MAX_RANK)] += 1;
    }

    /// Chance that a tree of `budget` depth-1 candidates holds the next token: the observed ranks, shrunk
    /// towards a prior fitted to SmolLM2's mask 1 (top-4 holds it 15% of the time, top-14 27%).
    pub fn accept_probability(&self, budget: usize) -> f64 {
        let prior = (0.093 * (1.0 + budget as f64).ln()).min(0.9);
        let seen: u64 = self.ranks.iter().sum();
        let hits: u64 = self.ranks[..budget.min(MAX_RANK)].iter().sum();
        (prior * PRIOR_WEIGHT + hits as f64) / (PRIOR_WEIGHT + seen as f64)
    }

    /// Expected committed tokens per second of a step with `budget` nodes (0 = plain decoding).
    pub fn rate(&self, budget: usize) -> f64 {
        if budget == 0 {
            return 1.0 / self.curve.cost(1);
        }
        let rows = rows_for(self.masks, budget);
        let p = self.accept_probability(budget);
        (1.0 + p) / (self.curve.cost(rows) + p * self.curve.extra_logits_seconds)
    }

    /// The best budget, `None` for plain decoding.
    pub fn choose(&self) -> Option<usize> {
        let mut best = (self.rate(0), None);
        for &b in &BUDGETS {
            let r = self.rate(b);
            if r > best.0 {
                best = (r, Some(b));
            }
        }
        best.1
    }

    /// Whether a plain-decoding step should still run the root's masks to keep observing acceptance.
    pub fn explore(&mut self) -> bool {
        self.plain_steps += 1;
        self.plain_steps.is_multiple_of(EXPLORE_EVERY)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn curve(seconds: [f64; 5]) -> Arc<CostCurve> {
        Arc::new(CostCurve {
            rows: TIMED_ROWS.to_vec(),
            seconds: seconds.to_vec(),
            extra_logits_seconds: 0.0,
        })
    }

    #[test]
    fn interpolates_the_cost_curve() {
        let c = curve([1.0, 2.0, 4.0, 8.0, 16.0]);
        assert_eq!(c.cost(1), 1.0);
        assert_eq!(c.cost(3), 3.0);
        assert_eq!(c.cost(12), 12.0);
        assert_eq!(c.cost(96), 96.0);
    }

    #[test]
    fn flat_cost_picks_a_large_tree() {
        // A GPU-like curve: 16 rows cost barely more than one.
        let a = AutoBudget::new(curve([1.0, 1.0, 1.0, 1.01, 1.02]), 1);
        assert!(a.choose() >= Some(14), "{:?}", a.choose());
    }

    #[test]
    fn linear_cost_falls_back_to_plain_decoding() {
        // Every row costs as much as the first: no tree can pay for itself.
        let a = AutoBudget::new(curve([1.0, 2.0, 4.0, 8.0, 16.0]), 1);
        assert_eq!(a.choose(), None);
    }

    #[test]
    fn observed_acceptance_moves_the_choice() {
        // Moderate cost growth; at the prior a small tree pays, and once the next token is always the top
        // candidate a 1-node tree is best; when it never is, plain decoding wins.
        let c = curve([1.0, 1.1, 1.2, 1.4, 1.9]);
        let mut good = AutoBudget::new(c.clone(), 1);
        for _ in 0..200 {
            good.observe_rank(Some(0));
        }
        assert_eq!(good.choose(), Some(1));
        let mut bad = AutoBudget::new(c, 1);
        for _ in 0..200 {
            bad.observe_rank(None);
        }
        assert_eq!(bad.choose(), None);
    }
}
