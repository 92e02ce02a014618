//! ESP, Embedding-Space Probing (docs/ESP.md): k mask vectors made from the mean of the prompt's embeddings are
//! appended to every tree node; mask j of a node sits j positions after it, so its logits guess the token
//! j + 1 places after that node. The masks of the deepest accepted node seed the next step's tree.

use super::candidates::{dynamic_tree, static_tree, Candidates};
use crate::decode::auto::{Choice, Chooser, Offer};
use crate::decode::budget::rows_for;
use crate::decode::cost_cache::curve_for;
use crate::decode::generate::{Beside, Draft, Drafter, Step};
use crate::decode::kind::MethodKind;
use crate::decode::layout::{esp_probes, Probe};
use crate::decode::sampling::top_candidates;
use crate::decode::tree::TokenTree;
use crate::decode::MAX_DRAFT_FLAG;
use crate::model::Transformer;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use rand::{rngs::StdRng, SeedableRng};
use rand_distr::{Distribution, Normal};
use std::cell::RefCell;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskInit {
    /// Mean of the prompt's input embeddings (the paper's best).
    Mean,
    /// A draw from N(mean, var) of the embedding table, per dimension.
    Normal,
    /// The last k prompt embeddings (the paper's worst).
    Last,
}

impl MaskInit {
    /// The flag value (`--mask-init`).
    pub fn name(self) -> &'static str {
        match self {
            MaskInit::Mean => "mean",
            MaskInit::Normal => "normal",
            MaskInit::Last => "last",
        }
    }
}

/// The mask tokens of ESP and hybrid: how many per node, how they start, how fast they follow the text.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Masks {
    /// k, masks per tree node (1..=3).
    pub count: usize,
    pub init: MaskInit,
    /// Update rate: m <- m + lambda (e - m) per committed token.
    pub lambda: f32,
}

impl Default for Masks {
    fn default() -> Self {
        Masks {
            count: 1,
            init: MaskInit::Mean,
            lambda: 0.1,
        }
    }
}

impl Masks {
    /// The one check of `--masks` and `--mask-lambda` (every drafter with masks calls it).
    pub fn validate(&self) -> Result<()> {
        if !(1..=3).contains(&self.count) {
            bail!("--masks must be 1, 2 or 3 (got {})", self.count);
        }
        if !(0.0..=1.0).contains(&self.lambda) {
            bail!("--mask-lambda must be in [0, 1] (got {})", self.lambda);
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TreeShape {
    /// ESP Algorithm 1: best-first by cumulative probability within `budget` nodes (sum K_i).
    Dynamic { budget: usize },
    /// `--bc auto`: a dynamic tree whose budget is chosen every step from the forward cost at the current
    /// cache length and the observed acceptance (see [`RankHistogram`]), plain decoding when no tree pays.
    Auto,
    /// K_i candidates at depth i, only the top-1 node of each depth expanded.
    Static { branches: Vec<usize> },
}

impl TreeShape {
    pub fn node_budget(&self) -> usize {
        match self {
            TreeShape::Dynamic { budget } => *budget,
            TreeShape::Static { branches } => branches.iter().sum(),
            TreeShape::Auto => MAX_RANK,
        }
    }
}

#[derive(Debug, Clone)]
pub struct EspConfig {
    pub masks: Masks,
    pub tree: TreeShape,
    /// Seed of `--mask-init normal`.
    pub seed: u64,
}

/// The k mask vectors, updated towards every committed token's embedding: m <- m + lambda (e - m).
pub struct MaskEmbedding {
    vectors: Vec<Vec<f32>>,
    lambda: f32,
}

impl MaskEmbedding {
    pub fn new(
        model: &Transformer,
        prompt: &[u32],
        k: usize,
        init: MaskInit,
        lambda: f32,
        seed: u64,
    ) -> Result<Self> {
        let emb = model.embed(prompt)?.to_dtype(DType::F32)?;
        let vectors = match init {
            MaskInit::Mean => vec![emb.mean(0)?.to_vec1::<f32>()?; k],
            MaskInit::Last => {
                let rows = emb.to_vec2::<f32>()?;
                (0..k)
                    .map(|j| rows[rows.len().saturating_sub(k) + j.min(rows.len() - 1)].clone())
                    .collect()
            }
            MaskInit::Normal => {
                let table = model.embed_tokens.table()?.to_dtype(DType::F32)?;
                let mean = table.mean(0)?;
                let var = table.broadcast_sub(&mean)?.sqr()?.mean(0)?;
                let (mean, var) = (mean.to_vec1::<f32>()?, var.to_vec1::<f32>()?);
                let mut rng = StdRng::seed_from_u64(seed);
                let v: Vec<f32> = mean
                    .iter()
                    .zip(&var)
                    .map(|(&m, &s2)| {
                        Normal::new(m, s2.sqrt().max(1e-12))
                            .map(|n| n.sample(&mut rng))
                            .unwrap_or(m)
                    })
                    .collect();
                vec![v; k]
            }
        };
        Ok(MaskEmbedding { vectors, lambda })
    }

    pub fn update(&mut self, e: &[f32]) {
        for m in &mut self.vectors {
            for (mi, &ei) in m.iter_mut().zip(e) {
                *mi += self.lambda * (ei - *mi);
            }
        }
    }

    pub fn vector(&self, j: usize) -> &[f32] {
        &self.vectors[j]
    }

    /// One update per committed token, in order.
    pub fn update_with_tokens(&mut self, model: &Transformer, committed: &[u32]) -> Result<()> {
        let emb = model.embed(committed)?.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        for e in &emb {
            self.update(e);
        }
        Ok(())
    }

    /// The input rows of mask probes: probe (owner, j) gets mask vector j.
    pub fn probe_inputs(&self, model: &Transformer, probes: &[Probe]) -> Result<Tensor> {
        let d = model.config.hidden_size;
        let mut data = Vec::with_capacity(probes.len() * d);
        for p in probes {
            data.extend_from_slice(self.vector(p.offset - 1));
        }
        Ok(Tensor::from_vec(data, (probes.len(), d), &model.device)?)
    }
}

/// The candidate lists for the next tree from the masks' logits (mask j -> depth j), `n` tokens each.
pub fn mask_candidates(probe_logits: &[Vec<f32>], n: usize) -> Vec<Candidates> {
    probe_logits.iter().map(|row| top_candidates(row, n)).collect()
}

/// The mask-token side of a drafter (ESP's, and the hybrid's ESP source): the k mask vectors, their input
/// rows, and the candidate lists their logits gave for the next tree.
///
/// The masks follow the committed tokens lazily: tokens are queued as they are committed and folded into
/// the vectors, in order (the same numbers as one update per step), only when probe rows are next built,
/// so a drafter that decodes plainly pays no embedding look-ups.
pub struct MaskProbes {
    spec: Masks,
    seed: u64,
    embedding: RefCell<Option<MaskEmbedding>>,
    /// Committed tokens not yet folded into the mask vectors.
    unfolded: RefCell<Vec<u32>>,
    /// Candidates for depth d + 1 of the next tree, from mask d + 1 of the last deepest accepted node.
    dists: Vec<Candidates>,
}

impl MaskProbes {
    pub fn new(spec: Masks, seed: u64) -> Result<Self> {
        spec.validate()?;
        Ok(MaskProbes {
            spec,
            seed,
            embedding: RefCell::new(None),
            unfolded: RefCell::new(Vec::new()),
            dists: Vec::new(),
        })
    }

    /// k, masks per node.
    pub fn count(&self) -> usize {
        self.spec.count
    }

    /// At the start of a generation: the masks from the prompt; returns the prefill's probe rows (k).
    pub fn begin(&mut self, model: &Transformer, prompt: &[u32]) -> Result<usize> {
        let s = &self.spec;
        *self.embedding.get_mut() = Some(MaskEmbedding::new(
            model, prompt, s.count, s.init, s.lambda, self.seed,
        )?);
        self.unfolded.get_mut().clear();
        self.dists.clear();
        Ok(s.count)
    }

    /// The input rows of `probes`, after folding the queued tokens into the masks.
    pub fn probe_inputs(&self, model: &Transformer, probes: &[Probe]) -> Result<Tensor> {
        let mut embedding = self.embedding.borrow_mut();
        let embedding = embedding.as_mut().expect("begin() runs before probe_inputs()");
        let mut unfolded = self.unfolded.borrow_mut();
        if !unfolded.is_empty() {
            embedding.update_with_tokens(model, &unfolded)?;
            unfolded.clear();
        }
        embedding.probe_inputs(model, probes)
    }

    /// After a step: the committed tokens are queued for the masks, and the probes' logits give the next
    /// candidate lists, `n` tokens each.
    pub fn observe(&mut self, step: &Step, n: usize) {
        self.unfolded.get_mut().extend_from_slice(step.committed);
        self.dists = mask_candidates(step.probe_logits, n);
    }

    /// The candidate lists for the next tree (empty when the last step had no probes).
    pub fn dists(&self) -> &[Candidates] {
        &self.dists
    }

    #[cfg(test)]
    pub(crate) fn set_dists(&mut self, dists: Vec<Candidates>) {
        self.dists = dists;
    }
}

/// Node budgets `--bc auto` considers (k = 1: BC 4, 6, 8, 10, 14, 20, 30, 40, 60).
const BUDGETS: [usize; 9] = [1, 2, 3, 4, 6, 9, 14, 19, 29];
/// Ranks tracked exactly; a rank at or beyond this counts as "never in the tree".
pub const MAX_RANK: usize = 32;
/// Weight of the prior, in observations.
const PRIOR_WEIGHT: f64 = 16.0;

/// ESP's acceptance for `--bc auto`: the rank, among the depth-1 candidates of the previous step's mask,
/// of the token actually committed next. A dynamic tree of `B` nodes accepts its first level when that
/// rank is below `B`, so the histogram prices every budget at once, whichever was in use when observed.
#[derive(Debug, Clone)]
pub struct RankHistogram {
    /// ranks[r] = observations of rank r; ranks[MAX_RANK] = not among the candidates.
    ranks: Vec<u64>,
}

impl Default for RankHistogram {
    fn default() -> Self {
        RankHistogram {
            ranks: vec![0; MAX_RANK + 1],
        }
    }
}

impl RankHistogram {
    pub fn observe(&mut self, rank: Option<usize>) {
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

    /// The offers of [`BUDGETS`] that fit in `max_rows` with k masks per node: rows and 1 + the chance the
    /// first level is accepted (deeper levels are left out: a lower bound).
    fn offers(&self, k: usize, max_rows: usize) -> Vec<Offer> {
        BUDGETS
            .iter()
            .map(|&b| Offer {
                rows: rows_for(k, b),
                tokens: 1.0 + self.accept_probability(b),
            })
            .take_while(|o| o.rows <= max_rows)
            .collect()
    }
}

/// `--bc auto`'s state: the chooser and the observed ranks.
struct EspAuto {
    chooser: Chooser,
    ranks: RankHistogram,
}

pub struct Esp {
    tree: TreeShape,
    masks: MaskProbes,
    auto: Option<EspAuto>,
    /// Root of the current step: the depth-1 candidates were ranked without it (parent-equal pruning).
    root: u32,
}

impl Esp {
    pub fn new(cfg: EspConfig) -> Result<Self> {
        let masks = MaskProbes::new(cfg.masks, cfg.seed)?;
        if let TreeShape::Static { branches } = &cfg.tree {
            if branches.is_empty()
                || branches.len() > masks.count()
                || branches.iter().any(|b| !(1..=MAX_DRAFT_FLAG).contains(b))
            {
                bail!(
                    "--branches {:?} needs 1..={} entries (one per mask depth), each in 1..={MAX_DRAFT_FLAG}",
                    branches,
                    masks.count()
                );
            }
        }
        Ok(Esp {
            tree: cfg.tree,
            masks,
            auto: None,
            root: 0,
        })
    }

    fn candidates_needed(&self) -> usize {
        // Room for the parent-equal and duplicate skips.
        self.tree.node_budget() + 2
    }
}

impl Drafter for Esp {
    fn beside(&mut self, beside: Beside) {
        if let Some(a) = &mut self.auto {
            a.chooser.beside(beside);
        }
    }

    fn name(&self) -> MethodKind {
        MethodKind::Esp
    }

    fn begin(&mut self, model: &Transformer, prompt: &[u32]) -> Result<usize> {
        let k = self.masks.begin(model, prompt)?;
        if self.tree == TreeShape::Auto {
            let auto = EspAuto {
                chooser: Chooser::new(curve_for(model)?).exploring_with(1 + k),
                ranks: RankHistogram::default(),
            };
            // The prefill's mask rows only serve a first tree: where none would pay at the prior's
            // acceptance, the first step decodes plainly and the masks wait for an exploration.
            let room = model.config.max_position_embeddings.saturating_sub(prompt.len());
            let pays = auto
                .chooser
                .would_speculate(prompt.len(), &auto.ranks.offers(k, room));
            self.auto = Some(auto);
            if !pays {
                return Ok(0);
            }
        }
        Ok(k)
    }

    // Room is the loop's concern: a draft that does not fit is replaced there by the root alone.
    fn draft(&mut self, root: u32, history: &[u32], max_rows: usize) -> Draft {
        self.root = root;
        let k = self.masks.count();
        // Without candidates (after a plain step, or at the context edge) the tree builders return the
        // root alone, whose masks probe for the next step.
        let dists = self.masks.dists();
        let tree = match &self.tree {
            TreeShape::Dynamic { budget } => dynamic_tree(root, dists, *budget),
            TreeShape::Static { branches } => static_tree(root, dists, branches),
            TreeShape::Auto => {
                let auto = self.auto.as_mut().expect("begin() sets up --bc auto");
                // The cache holds the history but the root.
                let offers = auto.ranks.offers(k, max_rows);
                match auto.chooser.choose(history.len() - 1, &offers) {
                    Choice::Offer(i) => dynamic_tree(root, dists, BUDGETS[i]),
                    // The root's masks alone: they observe acceptance for the next step.
                    Choice::Explore => TokenTree::new(root),
                    Choice::Plain => return Draft::root_only(root),
                }
            }
        };
        Draft {
            probes: esp_probes(tree.len(), k),
            tree,
        }
    }

    fn probe_inputs(&self, model: &Transformer, probes: &[Probe]) -> Result<Tensor> {
        self.masks.probe_inputs(model, probes)
    }

    fn observe(&mut self, _: &Transformer, step: &Step) -> Result<()> {
        if let Some(auto) = self.auto.as_mut() {
            auto.chooser.record(step);
        }
        if let (Some(auto), Some(depth1), Some(&next)) = (
            self.auto.as_mut(),
            self.masks.dists().first(),
            step.committed.first(),
        ) {
            let rank = depth1
                .iter()
                .filter(|c| c.0 != self.root)
                .position(|c| c.0 == next);
            auto.ranks.observe(rank);
        }
        let n = self.candidates_needed();
        self.masks.observe(step, n);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::cost_curve::CostCurve;
    use std::sync::Arc;

    fn choice(curve: CostCurve, ranks: &RankHistogram) -> Choice {
        Chooser::new(Arc::new(curve))
            .with_time_spent(1e9)
            .choose(100, &ranks.offers(1, 1000))
    }

    #[test]
    fn auto_budget_follows_the_cost_and_the_ranks() {
        let fresh = RankHistogram::default();
        // A GPU-like curve: 32 rows cost barely more than one: a large tree.
        let flat = choice(CostCurve::from_fn(|_, r| 1.0 + 1e-3 * r as f64, 0.0), &fresh);
        assert!(matches!(flat, Choice::Offer(i) if BUDGETS[i] >= 14), "{flat:?}");
        // Every row costs as much as the first: no tree pays.
        let linear = || CostCurve::from_fn(|_, r| r as f64, 0.0);
        assert_eq!(choice(linear(), &fresh), Choice::Plain);
        // Moderate growth: once the next token is always the top candidate a 1-node tree is best; when
        // it never is, plain decoding wins.
        let moderate =
            || CostCurve::from_fn(|_, r| 1.0 + 0.1 * (r as f64).sqrt() * (r > 1) as u8 as f64, 0.0);
        let mut good = RankHistogram::default();
        let mut bad = RankHistogram::default();
        for _ in 0..200 {
            good.observe(Some(0));
            bad.observe(None);
        }
        assert_eq!(choice(moderate(), &good), Choice::Offer(0));
        assert_eq!(choice(moderate(), &bad), Choice::Plain);
        // Budgets that do not fit the room are not offered.
        assert_eq!(fresh.offers(1, 9).len(), 3);
    }
}
