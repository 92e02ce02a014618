//! ESP, Embedding-Space Probing (docs/ESP.md): k mask vectors made from the mean of the prompt's embeddings are
//! appended to every tree node; mask j of a node sits j positions after it, so its logits guess the token
//! j + 1 places after that node. The masks of the deepest accepted node seed the next step's tree.

use super::auto_bc::{self, AutoBudget, CostCurve};
use super::candidates::{dynamic_tree, static_tree, Candidates};
use crate::decode::generate::{Draft, Drafter, Step};
use crate::decode::layout::{esp_probes, Probe};
use crate::decode::method::{Masks, MethodKind};
use crate::decode::sampling::top_candidates;
use crate::decode::tree::TokenTree;
use crate::decode::MAX_DRAFT_FLAG;
use crate::model::Transformer;
use anyhow::{bail, Result};
use candle_core::{DType, Tensor};
use rand::{rngs::StdRng, SeedableRng};
use rand_distr::{Distribution, Normal};

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

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TreeShape {
    /// ESP Algorithm 1: best-first by cumulative probability within `budget` nodes (sum K_i).
    Dynamic { budget: usize },
    /// `--bc auto`: a dynamic tree whose budget is chosen every step from the measured forward cost and
    /// the observed acceptance (see `auto_bc`), plain decoding when no tree pays.
    Auto,
    /// K_i candidates at depth i, only the top-1 node of each depth expanded.
    Static { branches: Vec<usize> },
}

impl TreeShape {
    pub fn node_budget(&self) -> usize {
        match self {
            TreeShape::Dynamic { budget } => *budget,
            TreeShape::Static { branches } => branches.iter().sum(),
            TreeShape::Auto => auto_bc::MAX_RANK,
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
                let table = model.embed_tokens.to_dtype(DType::F32)?;
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
pub struct MaskProbes {
    spec: Masks,
    seed: u64,
    embedding: Option<MaskEmbedding>,
    /// Candidates for depth d + 1 of the next tree, from mask d + 1 of the last deepest accepted node.
    dists: Vec<Candidates>,
}

impl MaskProbes {
    pub fn new(spec: Masks, seed: u64) -> Result<Self> {
        spec.validate()?;
        Ok(MaskProbes {
            spec,
            seed,
            embedding: None,
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
        self.embedding = Some(MaskEmbedding::new(
            model, prompt, s.count, s.init, s.lambda, self.seed,
        )?);
        self.dists.clear();
        Ok(s.count)
    }

    pub fn probe_inputs(&self, model: &Transformer, probes: &[Probe]) -> Result<Tensor> {
        self.embedding
            .as_ref()
            .expect("begin() runs before probe_inputs()")
            .probe_inputs(model, probes)
    }

    /// After a step: the masks follow the committed tokens, and the probes' logits give the next
    /// candidate lists, `n` tokens each.
    pub fn observe(&mut self, model: &Transformer, step: &Step, n: usize) -> Result<()> {
        self.embedding
            .as_mut()
            .expect("begin() runs before observe()")
            .update_with_tokens(model, step.committed)?;
        self.dists = mask_candidates(step.probe_logits, n);
        Ok(())
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

pub struct Esp {
    tree: TreeShape,
    masks: MaskProbes,
    auto: Option<AutoBudget>,
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
    fn name(&self) -> MethodKind {
        MethodKind::Esp
    }

    fn begin(&mut self, model: &Transformer, prompt: &[u32]) -> Result<usize> {
        let k = self.masks.begin(model, prompt)?;
        if self.tree == TreeShape::Auto {
            self.auto = Some(AutoBudget::new(CostCurve::for_model(model, prompt)?, k));
        }
        Ok(k)
    }

    // Room is the loop's concern: a draft that does not fit is replaced there by the root alone.
    fn draft(&mut self, root: u32, _history: &[u32], _max_rows: usize) -> Draft {
        self.root = root;
        // Without candidates (after a plain step, or at the context edge) the tree builders return the
        // root alone, whose masks probe for the next step.
        let dists = self.masks.dists();
        let tree = match &self.tree {
            TreeShape::Dynamic { budget } => dynamic_tree(root, dists, *budget),
            TreeShape::Static { branches } => static_tree(root, dists, branches),
            TreeShape::Auto => {
                let auto = self.auto.as_mut().expect("begin() sets up --bc auto");
                match auto.choose() {
                    Some(budget) => dynamic_tree(root, dists, budget),
                    // Plain decoding, with a probe every few steps to keep measuring acceptance.
                    None if auto.explore() => TokenTree::new(root),
                    None => return Draft::root_only(root),
                }
            }
        };
        Draft {
            probes: esp_probes(tree.len(), self.masks.count()),
            tree,
        }
    }

    fn probe_inputs(&self, model: &Transformer, probes: &[Probe]) -> Result<Tensor> {
        self.masks.probe_inputs(model, probes)
    }

    fn observe(&mut self, model: &Transformer, step: &Step) -> Result<()> {
        if let (Some(auto), Some(depth1), Some(&next)) = (
            self.auto.as_mut(),
            self.masks.dists().first(),
            step.committed.first(),
        ) {
            let rank = depth1
                .iter()
                .filter(|c| c.0 != self.root)
                .position(|c| c.0 == next);
            auto.observe_rank(rank);
        }
        let n = self.candidates_needed();
        self.masks.observe(model, step, n)
    }
}
