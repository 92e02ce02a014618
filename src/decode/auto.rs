//! `--bc auto`, written once for every method: each step, the block that maximises expected committed
//! tokens per second, down to plain decoding when no block pays.
//!
//! A drafter prices what it could send this step as [`Offer`]s: a block's rows and the tokens it is
//! expected to commit (1 for the bonus token, plus the chance that each drafted node is accepted: by
//! linearity of expectation, accepted tokens are the sum of the nodes' reach probabilities). [`Chooser`]
//! divides those by the block's cost at the current cache length (the [`CostCurve`]) plus one vocabulary
//! projection per expected accepted level, and keeps the best; plain decoding is one row and one token,
//! and an offer must beat it by [`OFFER_MARGIN`], more than the prices' error.
//! After a run of plain steps it asks for one small exploring block, so acceptance keeps being observed and
//! speculation can come back when the text becomes predictable.
//!
//! What speculation may lose is bounded against the time measured (the prefill's included): every block
//! that commits less than its price would have bought as plain steps adds the difference to a loss, and
//! what speculation gained is summed apart (prices from the curve as the timed steps correct it). An
//! exploring block is sent only if what the explorations cost beyond plain steps, this one included,
//! stays within [`EXPLORE_SHARE`] of the time so far plus [`WIN_BACK_SHARE`] of the gains. A block the
//! drafter's model expects to pay is trusted to it until [`TRUSTED_FAILURES`] speculative blocks in a row
//! have committed nothing beyond the bonus token; from there on, until one commits a draft, the loss,
//! were it to commit nothing too, must stay within [`EXPLORE_SHARE`] of the time plus all of the gains.
//! So a method whose drafts keep failing, whatever its model says, stops and costs about 1% over plain
//! decoding (and a few blocks); one that pays may spend part of what it won looking for more.
//!
//! How a drafter estimates acceptance is its own: ESP from the rank of the committed token among its
//! mask's candidates, the chain and trie drafters from [`Rate`]s counted per source and depth.

use super::cost_curve::CostCurve;
use super::generate::{Beside, Step};
use super::tree::TokenTree;
use std::sync::Arc;

/// Pseudo-tokens, promised and accepted, that the calibration of offers starts from; a size class's own
/// calibration starts from this many at the overall ratio.
const CALIBRATION_PRIOR: f64 = 4.0;

/// Block sizes calibrated apart: 2, 3-4, 5-8, 9-16, 17-32 and more rows. A drafter's estimates are
/// not equally biased at every size: the hybrid's 5-8-row trees were measured to commit 0.57 of the
/// drafted tokens they promised where its 2-4-row chains committed 0.95, so one shared ratio
/// overrated the large blocks and underrated the small ones.
const SIZE_CLASSES: usize = 6;

/// The size class of a block of `rows` (at least 2).
fn size_class(rows: usize) -> usize {
    let ceil_log2 = (usize::BITS - (rows.max(2) - 1).leading_zeros()) as usize;
    (ceil_log2 - 1).min(SIZE_CLASSES - 1)
}

/// Classes of the measured cost correction: one row (a plain step), then blocks by [`size_class`].
const COST_CLASSES: usize = SIZE_CLASSES + 1;

fn cost_class(rows: usize) -> usize {
    if rows <= 1 {
        0
    } else {
        1 + size_class(rows)
    }
}

/// Steps' worth of evidence that a class's cost is the curve's, before its measured steps count.
const COST_PRIOR_STEPS: f64 = 3.0;

/// While plain decoding is chosen, after this many plain steps one small block explores ...
pub const EXPLORE_EVERY: usize = 8;
/// ... and after each exploration that does not bring speculation back, twice as many, up to this ...
pub const EXPLORE_EVERY_MAX: usize = 64;
/// ... if the budget allows. What speculative blocks lost against plain decoding stays within this share
/// of the time so far ...
pub const EXPLORE_SHARE: f64 = 0.01;
/// ... plus what they gained (their committed tokens at one plain step each, less their seconds): all of
/// it for an offer the drafter's model expects to pay, this share of it for an exploring block.
pub const WIN_BACK_SHARE: f64 = 0.25;
/// Speculative blocks in a row that committed no draft after which offers are held to the loss budget: a
/// few failures are the price of drafts that pay later (a lookup chain's first match often does not);
/// a run of them is evidence against the drafter's model.
pub const TRUSTED_FAILURES: usize = 8;

/// The share by which an offer's expected rate must beat plain decoding's: the prices come from a curve
/// timed in about a second and from steps whose times vary by a tenth, so an edge thinner than this is
/// within their error, and sending such blocks on a busy CPU was measured to lose (a 2-row lookahead
/// window sent at 49 of 51 steps for a 0.3% edge, 0.89x plain decoding).
pub const OFFER_MARGIN: f64 = 0.02;

/// Accepted levels whose logits the verifier's first projection usually holds already (it fetches the
/// first-child path ahead, up to [`LOGIT_ROWS`](super::cost_curve::LOGIT_ROWS) rows).
const PREFETCHED_LEVELS: f64 = 3.0;

/// A block a drafter could send.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Offer {
    /// Rows of the forward pass, probes included.
    pub rows: usize,
    /// Expected committed tokens, the bonus token included (at least 1).
    pub tokens: f64,
}

/// What the step should do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// The root alone.
    Plain,
    /// The drafter's smallest block that still observes acceptance (plain decoding was chosen for a
    /// while).
    Explore,
    /// The offer at this index.
    Offer(usize),
}

/// Picks the block of the step from the cost curve.
pub struct Chooser {
    curve: Arc<CostCurve>,
    /// Plain steps chosen in a row while something was on offer.
    plain_run: usize,
    /// Plain steps before the next exploration.
    explore_after: usize,
    /// Drafted tokens the chosen offers promised and those the verifier then accepted (each starting
    /// from [`CALIBRATION_PRIOR`]): a drafter's acceptance model may be biased (optimistic priors, a
    /// heuristic's guess), and the ratio corrects every offer by what the offers taken actually gave.
    promised: f64,
    accepted: f64,
    /// The same counts per block size class ([`size_class`]), from 0.
    class_promised: [f64; SIZE_CLASSES],
    class_accepted: [f64; SIZE_CLASSES],
    /// The offer chosen this step, until [`Chooser::record`].
    pending: Option<Pending>,
    /// Measured over curve seconds of the steps taken, summed per [`cost_class`], and their counts. The
    /// curve was timed once, in about a second, on a machine whose load changes: a noisy timing can price
    /// a block of 4 rows as cheap as one row (seen here: f32 weights, where every step then sent a block
    /// that could not pay). What the steps really took corrects the curve, class by class.
    cost_ratio_sum: [f64; COST_CLASSES],
    cost_steps: [f64; COST_CLASSES],
    /// The class and curve seconds of this step's choice (plain and exploring steps too), until
    /// [`Chooser::record`].
    last_priced: Option<(usize, f64)>,
    /// Rows of the drafter's exploring block.
    explore_rows: usize,
    /// Seconds so far: the prefill's and every step's, as measured (the curve's price for a step that
    /// carries no time).
    spent: f64,
    /// What the speculative blocks (offers and explorations) lost and gained against plain decoding: a
    /// block's seconds less what its committed tokens would have cost as plain steps, summed apart.
    lost: f64,
    gained: f64,
    /// Seconds the exploring blocks cost beyond a plain step each.
    explored: f64,
    /// Speculative blocks in a row (offers and explorations) that committed no draft.
    failed_in_a_row: usize,
    /// The other sequences of a batched step.
    beside: Beside,
}

/// The block chosen for a step, to learn from its verification.
#[derive(Debug, Clone, Copy)]
struct Pending {
    /// Drafted tokens an offer promised (the bonus token excluded); `None` for an exploring block.
    promised: Option<f64>,
    class: usize,
    /// Its block's predicted seconds and one plain step's, at the step's cache length.
    seconds: f64,
    plain_seconds: f64,
}

impl Chooser {
    pub fn new(curve: Arc<CostCurve>) -> Self {
        Chooser {
            curve,
            plain_run: 0,
            explore_after: EXPLORE_EVERY,
            promised: CALIBRATION_PRIOR,
            accepted: CALIBRATION_PRIOR,
            class_promised: [0.0; SIZE_CLASSES],
            class_accepted: [0.0; SIZE_CLASSES],
            pending: None,
            cost_ratio_sum: [0.0; COST_CLASSES],
            cost_steps: [0.0; COST_CLASSES],
            last_priced: None,
            explore_rows: 2,
            spent: 0.0,
            lost: 0.0,
            gained: 0.0,
            explored: 0.0,
            failed_in_a_row: 0,
            beside: Beside::default(),
        }
    }

    /// What else the next step carries: its blocks are priced by what they cost the whole step, so
    /// that a block pays only where the batch's tokens a second gain (the others are slowed by its
    /// rows too).
    pub fn beside(&mut self, beside: Beside) {
        self.beside = beside;
    }

    /// The rows of the drafter's exploring block ([`Choice::Explore`]), which the budget prices (2 when
    /// not given: the root and one probe or draft).
    pub fn exploring_with(mut self, rows: usize) -> Self {
        self.explore_rows = rows.max(1);
        self
    }

    /// A chooser whose request has already taken `seconds`: tests of the pricing, where the loss budget
    /// should not bind.
    #[cfg(test)]
    pub(crate) fn with_time_spent(mut self, seconds: f64) -> Self {
        self.spent = seconds;
        self
    }

    /// Seconds the explorations cost beyond a plain step each so far, and the seconds so far.
    pub fn exploration_cost(&self) -> (f64, f64) {
        (self.explored, self.spent)
    }

    /// Seconds the speculative blocks lost and gained against plain decoding so far.
    #[cfg(test)]
    pub(crate) fn losses_and_gains(&self) -> (f64, f64) {
        (self.lost, self.gained)
    }

    /// Whether some offer beats plain decoding after `context` cached tokens and may be sent (nothing is
    /// chosen or counted): a drafter asks before paying for what only a speculative step would use.
    pub fn would_speculate(&self, context: usize, offers: &[Offer]) -> bool {
        let bar = self.plain_bar(context);
        offers
            .iter()
            .any(|&o| self.rate(o, context) > bar && self.offer_allowed(o.rows, context))
    }

    /// The rate an offer must beat after `context` cached tokens: plain decoding's, plus [`OFFER_MARGIN`].
    pub fn plain_bar(&self, context: usize) -> f64 {
        self.rate(Offer { rows: 1, tokens: 1.0 }, context) * (1.0 + OFFER_MARGIN)
    }

    /// Whether an offer of `rows` may be sent after `context` cached tokens: trusted to the drafter's
    /// model unless [`TRUSTED_FAILURES`] blocks in a row committed nothing, else only within the loss
    /// budget with all of the gains.
    fn offer_allowed(&self, rows: usize, context: usize) -> bool {
        self.failed_in_a_row < TRUSTED_FAILURES || self.within_budget(rows, context, 1.0)
    }

    /// Whether an exploring block of `rows` after `context` cached tokens fits its budget: what the
    /// explorations cost beyond plain steps, this one included, within [`EXPLORE_SHARE`] of the time so
    /// far plus [`WIN_BACK_SHARE`] of the gains. Offers' losses are not charged to it: after failed offers
    /// the explorations are what finds the text predictable again.
    fn exploration_allowed(&self, rows: usize, context: usize) -> bool {
        let worst = (self.cost(rows, context) - self.cost(1, context)).max(0.0);
        self.explored + worst <= EXPLORE_SHARE * self.spent + WIN_BACK_SHARE * self.gained
    }

    /// Whether a block of `rows` after `context` cached tokens, were it to commit only its bonus token,
    /// would leave the loss within [`EXPLORE_SHARE`] of the time so far plus `share` of the gains.
    fn within_budget(&self, rows: usize, context: usize, share: f64) -> bool {
        let worst = (self.cost(rows, context) - self.cost(1, context)).max(0.0);
        self.lost + worst <= EXPLORE_SHARE * self.spent + share * self.gained
    }

    /// Accepted over promised drafted tokens so far, over every block (1 before any evidence).
    pub fn calibration(&self) -> f64 {
        (self.accepted / self.promised).clamp(0.05, 2.0)
    }

    /// The calibration of blocks of `rows`: their size class's counts, starting from
    /// `CALIBRATION_PRIOR` tokens at the overall ratio.
    pub fn calibration_at(&self, rows: usize) -> f64 {
        let c = size_class(rows);
        let prior = CALIBRATION_PRIOR * self.calibration();
        ((self.class_accepted[c] + prior) / (self.class_promised[c] + CALIBRATION_PRIOR)).clamp(0.05, 2.0)
    }

    /// What the step the last [`Chooser::choose`] decided committed (drafts accepted + the bonus token);
    /// sharpens [`Chooser::calibration`]. A step the loop did not verify as drafted teaches nothing.
    /// A step no choice priced (the prefill) adds its seconds to the time so far.
    pub fn record(&mut self, step: &Step) {
        let Some((class, priced)) = self.last_priced.take() else {
            self.spent += step.seconds;
            return;
        };
        let measured = step.seconds > 0.0;
        self.spent += if measured { step.seconds } else { priced };
        if !step.replaced && measured && priced > 0.0 && self.beside == Beside::default() {
            self.cost_ratio_sum[class] += (step.seconds / priced).clamp(0.25, 4.0);
            self.cost_steps[class] += 1.0;
        }
        if let Some(p) = self.pending.take() {
            if !step.replaced {
                let accepted = step.committed.len().saturating_sub(1) as f64;
                if let Some(promised) = p.promised {
                    self.promised += promised;
                    self.accepted += accepted;
                    self.class_promised[p.class] += promised;
                    self.class_accepted[p.class] += accepted;
                }
                self.failed_in_a_row = if accepted > 0.0 {
                    0
                } else {
                    self.failed_in_a_row + 1
                };
                // Priced, not timed: one step's time is noisy (plain steps vary by a tenth here) and a
                // failed block timed fast must not count as a gain; the timings correct the prices
                // through `cost_factor`.
                let seconds = p.seconds;
                let value = (1.0 + accepted) * p.plain_seconds - seconds;
                if value >= 0.0 {
                    self.gained += value;
                } else {
                    self.lost -= value;
                }
                // Explorations are charged what they took, as measured: the budget is a share of the
                // time spent. A step's noise cancels over many; a correction learnt from a request's
                // few explorations would not (the curve priced them low on this CPU).
                if p.promised.is_none() {
                    let took = if measured { step.seconds } else { seconds };
                    let slowed = 1.0 + self.beside.sequences as f64;
                    self.explored = (self.explored + slowed * (took - p.plain_seconds)).max(0.0);
                }
            }
        }
    }

    /// How much more (or less) than the curve's price the steps of `rows` rows took, from
    /// three steps at 1 (the curve) and every measured step.
    pub fn cost_factor(&self, rows: usize) -> f64 {
        let c = cost_class(rows);
        (self.cost_ratio_sum[c] + COST_PRIOR_STEPS) / (self.cost_steps[c] + COST_PRIOR_STEPS)
    }

    /// A block's cost after `context` cached tokens: the curve's, corrected by what such steps took, and
    /// never below a plain step's. A correction learnt from a few noisy steps could price extra rows
    /// below none; a failed block would then count as a gain and fund more of them.
    ///
    /// Beside other sequences ([`Chooser::beside`]) a block of `rows` is priced in the time of the
    /// whole step at every row, T(others + rows), and so that it beats a plain step exactly where the
    /// step's tokens a second gain: with `a` other sequences committing a token each, as
    /// (a + 1) T(others + rows) - a T(others + 1).
    fn cost(&self, rows: usize, context: usize) -> f64 {
        let step = |rows: usize| {
            let all = self.beside.rows + rows;
            self.curve.cost(all, context) * self.correction(all)
        };
        let plain = step(1);
        if rows <= 1 {
            return plain;
        }
        let others = self.beside.sequences as f64;
        ((others + 1.0) * step(rows) - others * plain).max(plain)
    }

    /// [`Chooser::cost_factor`] alone; beside other sequences none: a batched step's time holds their
    /// rows, which change from step to step, so it cannot correct the price of this sequence's rows
    /// (learnt per size class, it priced 8-row blocks below plain steps and sent them at a loss).
    fn correction(&self, rows: usize) -> f64 {
        if self.beside == Beside::default() {
            self.cost_factor(rows)
        } else {
            1.0
        }
    }

    /// The cost class and the curve's seconds of a step in which this sequence sends `rows`.
    fn priced(&self, rows: usize, context: usize) -> (usize, f64) {
        let all = self.beside.rows + rows;
        (cost_class(all), self.curve.cost(all, context))
    }

    /// Expected committed tokens per second of `offer` after `context` cached tokens.
    pub fn rate(&self, offer: Offer, context: usize) -> f64 {
        let offer = Offer {
            tokens: 1.0 + self.calibration_at(offer.rows) * (offer.tokens - 1.0).max(0.0),
            ..offer
        };
        // The curve's cost includes the verifier's first projection, which also covers the first few
        // levels of the drafter's best path; deeper accepted levels take a projection each.
        let levels = (offer.tokens - 1.0 - PREFETCHED_LEVELS).max(0.0);
        offer.tokens / (self.cost(offer.rows, context) + levels * self.curve.extra_logits_seconds)
    }

    /// The best of `offers` after `context` cached tokens that the loss budget affords, or plain decoding
    /// when none beats it by [`OFFER_MARGIN`] (ties go to the smaller block); after [`EXPLORE_EVERY`]
    /// plain steps in a row (twice as many after each exploration that changed nothing, up to
    /// [`EXPLORE_EVERY_MAX`]), [`Choice::Explore`], when the budget affords it (else the next plain step
    /// asks again). With nothing on offer the step is plain and no exploration is owed.
    pub fn choose(&mut self, context: usize, offers: &[Offer]) -> Choice {
        self.pending = None;
        self.last_priced = Some(self.priced(1, context));
        if offers.is_empty() {
            return Choice::Plain;
        }
        let plain_seconds = self.cost(1, context);
        let mut best = (self.plain_bar(context), None);
        for (i, &o) in offers.iter().enumerate() {
            let r = self.rate(o, context);
            if r > best.0 * (1.0 + 1e-9) && self.offer_allowed(o.rows, context) {
                best = (r, Some(i));
            }
        }
        let (rows, promised) = match best.1 {
            Some(i) => {
                self.plain_run = 0;
                self.explore_after = EXPLORE_EVERY;
                (offers[i].rows, Some((offers[i].tokens - 1.0).max(0.0)))
            }
            None => {
                self.plain_run += 1;
                let explore = self.plain_run >= self.explore_after
                    && self.exploration_allowed(self.explore_rows, context);
                if !explore {
                    return Choice::Plain;
                }
                self.plain_run = 0;
                self.explore_after = (2 * self.explore_after).min(EXPLORE_EVERY_MAX);
                (self.explore_rows, None)
            }
        };
        self.last_priced = Some(self.priced(rows, context));
        self.pending = Some(Pending {
            promised,
            class: size_class(rows),
            seconds: self.cost(rows, context),
            plain_seconds,
        });
        match best.1 {
            Some(i) => Choice::Offer(i),
            None => Choice::Explore,
        }
    }
}

/// The offers of keeping the best `m` nodes of a candidate tree, m = 1..=scores.len(): `scores` are
/// the nodes' reach probabilities, best first (a prefix of them must form a tree: a node's score never
/// exceeds its parent's), and `rows(m)` the block's rows with m nodes.
pub fn prefix_offers(scores: &[f64], rows: impl Fn(usize) -> usize) -> Vec<Offer> {
    let mut tokens = 1.0;
    scores
        .iter()
        .enumerate()
        .map(|(i, &s)| {
            tokens += s.clamp(0.0, 1.0);
            Offer {
                rows: rows(i + 1),
                tokens,
            }
        })
        .collect()
}

/// The non-root nodes of `tree` best first by `score` (ties: shallower, then earlier), so that every
/// prefix of the order is a tree when a node never scores above its parent.
pub fn best_first(tree: &TokenTree, score: &[f64]) -> Vec<usize> {
    let mut order: Vec<usize> = (1..tree.len()).collect();
    order.sort_by(|&a, &b| {
        score[b]
            .total_cmp(&score[a])
            .then(tree.depth(a).cmp(&tree.depth(b)))
            .then(a.cmp(&b))
    });
    order
}

/// The tree of the root and `nodes` of `tree` (each after its parent), and for each of its nodes the node
/// of `tree` it came from.
pub fn subtree(tree: &TokenTree, nodes: &[usize]) -> (TokenTree, Vec<usize>) {
    let mut out = TokenTree::with_capacity(tree.token(0), 1 + nodes.len());
    let mut from = vec![0];
    let mut map = vec![usize::MAX; tree.len()];
    map[0] = 0;
    for &n in nodes {
        let p = map[tree.parent(n).expect("not the root")];
        debug_assert!(p != usize::MAX, "a node was taken before its parent");
        if p == usize::MAX {
            continue;
        }
        map[n] = out.push(p, tree.token(n));
        from.push(n);
    }
    (out, from)
}

/// The nodes the verifier tried (their parent was reached) and whether each was accepted: what an
/// acceptance rate conditional on the parent counts.
pub fn tried_nodes(tree: &TokenTree, accepted: &[usize]) -> Vec<(usize, bool)> {
    let mut reached = vec![false; tree.len()];
    reached[0] = true;
    for &a in accepted {
        if a < reached.len() {
            reached[a] = true;
        }
    }
    (1..tree.len())
        .filter(|&n| reached[tree.parent(n).unwrap_or(0)])
        .map(|n| (n, reached[n]))
        .collect()
}

/// Acceptance of chain depths 1..=n given the depth above was accepted: depth 1's rate, and each deeper
/// one shrunk towards the depth above it (`rate(d)`: the counts of depth d, if any). An untried depth
/// inherits the rate of the one above: a chain that keeps being accepted is drafted longer, and learnt.
pub fn chain_rates(n: usize, rate: impl Fn(usize) -> Option<Rate>) -> Vec<f64> {
    (1..=n)
        .scan(FIRST_DEPTH_PRIOR, |prior, d| {
            *prior = deeper(*prior, rate(d));
            Some(*prior)
        })
        .collect()
}

/// The last of [`chain_rates`]`(n, rate)` (`n >= 1`), without building the list: what a node at depth
/// `n` is scored with.
pub fn chain_rate(n: usize, rate: impl Fn(usize) -> Option<Rate>) -> f64 {
    (1..=n).fold(FIRST_DEPTH_PRIOR, |prior, d| deeper(prior, rate(d)))
}

/// The rate a chain's first depth starts from.
const FIRST_DEPTH_PRIOR: f64 = 0.5;

/// A depth's rate from the one above it (`prior`) and its own counts, if any.
fn deeper(prior: f64, counts: Option<Rate>) -> f64 {
    counts.map_or(prior, |r| r.toward(prior))
}

/// A learnt acceptance rate: accepted / proposed, each starting from a pseudo-count (the prior).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rate {
    pub accepted: f64,
    pub proposed: f64,
}

impl Default for Rate {
    /// One accepted in two: a weak prior of 1/2.
    fn default() -> Self {
        Rate {
            accepted: 1.0,
            proposed: 2.0,
        }
    }
}

impl Rate {
    pub fn get(&self) -> f64 {
        self.accepted / self.proposed
    }

    /// The rate with its prior moved from 1/2 to `prior` (same weight): for a chain's deeper nodes, which
    /// are tried less often, shrunk towards the depth above rather than towards 1/2.
    pub fn toward(&self, prior: f64) -> f64 {
        ((self.accepted - 1.0 + 2.0 * prior) / self.proposed).clamp(0.0, 1.0)
    }

    pub fn record(&mut self, hit: bool) {
        self.proposed += 1.0;
        self.accepted += f64::from(u8::from(hit));
    }
}

#[cfg(test)]
#[path = "auto_tests.rs"]
mod tests;
