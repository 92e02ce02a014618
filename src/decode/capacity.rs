//! How much a batch takes at once ([`Capacity`]), and the defaults that pay on this machine, read from
//! the forward cost curve: how many sequences decode together ([`parallel_for`]) and how many prompt rows
//! a step prefills beside them ([`chunk_for`]).

use super::cost_curve::{CostCurve, LOGIT_ROWS};

/// How much a batch may hold at once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capacity {
    /// Sequences decoded together.
    pub sequences: usize,
    /// KV cache rows the sequences decoding together may reserve
    /// ([`cache_rows`](super::prefill::cache_rows): their prompts, answers and a block each); `None`: no
    /// bound but `sequences`.
    pub kv_rows: Option<usize>,
    /// Most prompt rows a step prefills beside decoding sequences
    /// ([`Batch::with_prefill_chunk`](super::batch::Batch::with_prefill_chunk)); `None`: a joining prompt
    /// is prefilled whole, between steps.
    pub prefill_chunk: Option<usize>,
}

impl Capacity {
    /// Up to `sequences` together, with no bound on their caches, prompts prefilled whole.
    pub fn sequences(sequences: usize) -> Self {
        Capacity {
            sequences,
            kv_rows: None,
            prefill_chunk: None,
        }
    }
}

/// The cache length the defaults are priced at: a typical request's prompt and answer.
const CONTEXT: usize = 1024;

/// The most sequences [`parallel_for`] decodes together: each holds a KV cache of its own.
pub const MAX_PARALLEL: usize = 32;

/// How much more a doubling of the sequences decoded together must raise the tokens a second for
/// [`parallel_for`] to take it: each of them then waits up to twice as long for its tokens.
pub const PARALLEL_DOUBLING_GAIN: f64 = 1.15;

/// The sequences to decode together on a machine whose forward cost is `curve`: from 1, doubled while
/// the doubling still gives [`PARALLEL_DOUBLING_GAIN`] times the tokens a second, up to
/// [`MAX_PARALLEL`]: where batching stops paying. A step of `n` sequences is priced as a block of `n`
/// rows plus the vocabulary projections the curve's block leaves out (it projects at most
/// [`LOGIT_ROWS`] rows; each sequence needs its own).
pub fn parallel_for(curve: &CostCurve) -> usize {
    let step = |n: usize| {
        let projections = n.saturating_sub(LOGIT_ROWS).div_ceil(LOGIT_ROWS);
        curve.cost(n, CONTEXT) + projections as f64 * curve.extra_logits_seconds
    };
    let throughput = |n: usize| n as f64 / step(n);
    let mut n = 1;
    while 2 * n <= MAX_PARALLEL && throughput(2 * n) >= PARALLEL_DOUBLING_GAIN * throughput(n) {
        n *= 2;
    }
    n
}

/// The seconds a step that prefills beside decoding sequences may take: well below the half second a
/// streaming client notices between tokens, or twice a step of the decoding rows alone where that is
/// more (a model too slow for it still makes progress on its prompts).
pub const PREFILL_STEP_SECONDS: f64 = 0.4;

/// Most prompt rows a step prefills beside `decoding` sequences' rows on a machine whose forward cost is
/// `curve` (after 1024 cached tokens): the largest multiple of 8, at least 8 and at most 512, whose step
/// the curve prices within [`PREFILL_STEP_SECONDS`] or twice the decoding rows' step.
pub fn chunk_for(curve: &CostCurve, decoding: usize) -> usize {
    let limit = PREFILL_STEP_SECONDS.max(2.0 * curve.cost(decoding, CONTEXT));
    (1..=64)
        .map(|i| 8 * i)
        .take_while(|&rows| curve.cost(decoding + rows, CONTEXT) <= limit)
        .last()
        .unwrap_or(8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chunk_keeps_a_step_within_its_time() {
        // 9.9 ms a row: 8 decoding rows and 32 prompt rows take 0.396 s, 40 take 0.475 s.
        let slow = CostCurve::from_fn(|_, r| 0.0099 * r as f64, 0.0);
        assert_eq!(chunk_for(&slow, 8), 32);
        // 0.1 ms a row: the most.
        let fast = CostCurve::from_fn(|_, r| 0.0001 * r as f64, 0.0);
        assert_eq!(chunk_for(&fast, 8), 512);
        // 0.1 s a row: the decoding rows alone take 0.8 s; twice that leaves 8 prompt rows.
        let crawling = CostCurve::from_fn(|_, r| 0.1 * r as f64, 0.0);
        assert_eq!(chunk_for(&crawling, 8), 8);
    }

    #[test]
    fn parallel_doubles_while_it_pays() {
        // 10 ms a step plus 5 ms a row: 1, 2, 4, 8, 16 sequences give 66.7, 100, 133, 160, 178 tokens a
        // second; 8 -> 16 gains 11%, below 15%: 8.
        let rising = CostCurve::from_fn(|_, r| 0.010 + 0.005 * r as f64, 0.0);
        assert_eq!(parallel_for(&rising), 8);
        // Rows as dear as whole steps: one sequence at a time.
        let proportional = CostCurve::from_fn(|_, r| 0.01 * r as f64, 0.0);
        assert_eq!(parallel_for(&proportional), 1);
        // Rows free (a GPU's flat curve): the most.
        let flat = CostCurve::from_fn(|_, _| 0.01, 0.0);
        assert_eq!(parallel_for(&flat), MAX_PARALLEL);
        // The curve's block projects 8 rows' logits; every 8 sequences beyond pay one more projection: at
        // 40 ms a projection, a flat 10 ms step gives 8 sequences 800 tokens a second, 16 in 50 ms 320.
        let projecting = CostCurve::from_fn(|_, _| 0.01, 0.040);
        assert_eq!(parallel_for(&projecting), 8);
    }
}
