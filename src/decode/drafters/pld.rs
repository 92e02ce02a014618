//! Prompt Lookup Decoding (Saxena 2023): match the last n tokens (n = `max_ngram` down to 1) against the
//! prompt and everything generated so far, and draft the tokens that followed the most recent earlier
//! occurrence as one chain (up to `draft_len` tokens). No probes: a chain with no probe rows is verified
//! under a plain causal mask by the shared loop. Cheap, and strong wherever the answer copies its input
//! (translation, summarisation, RAG, code edits).
//!
//! Without a fixed `draft_len` (`--bc auto`) the chain's length is chosen every step, from 0 (plain
//! decoding) to [`AUTO_MAX_DRAFT`]: node d of a chain is reached with the product of the acceptance rates
//! of depths 1..=d, learnt per match length and depth over the chains verified so far (a depth not tried
//! yet takes the rate of the depth above).
//!
//! Deviation from the reference script: it takes the *earliest* occurrence; this takes the most recent one,
//! which follows the text being produced now (a repeated list item, the current sentence of a copied
//! passage) more closely.

use super::ngram;
use crate::decode::auto::{chain_rates, prefix_offers, Choice, Chooser, Rate};
use crate::decode::check_flag;
use crate::decode::cost_cache::curve_for;
use crate::decode::generate::{Beside, Draft, Drafter, Step};
use crate::decode::kind::MethodKind;
use crate::decode::layout::Probe;
use crate::decode::tree::TokenTree;
use crate::model::Transformer;
use anyhow::{bail, Result};
use candle_core::Tensor;
use std::collections::HashMap;

/// Longest chain `--bc auto` considers.
pub const AUTO_MAX_DRAFT: usize = 16;
/// The reference's chain length: the draft length when it is not chosen per step.
pub const DEFAULT_DRAFT_LEN: usize = 10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PldConfig {
    /// Largest suffix length to match (the reference uses 3).
    pub max_ngram: usize,
    /// Most draft tokens per step (the reference uses 10); `None`: chosen per step (`--bc auto`).
    pub draft_len: Option<usize>,
}

impl Default for PldConfig {
    fn default() -> Self {
        PldConfig {
            max_ngram: 3,
            draft_len: None,
        }
    }
}

impl PldConfig {
    /// The one check of `--ngram` and `--draft-len`.
    pub fn validate(&self) -> Result<()> {
        check_flag("--ngram", self.max_ngram, 1)?;
        if let Some(n) = self.draft_len {
            check_flag("--draft-len", n, 1)?;
        }
        Ok(())
    }
}

/// The chain length's state under `--bc auto`.
struct PldAuto {
    chooser: Chooser,
    /// Acceptance of chain node d given node d - 1 was accepted, by (match length, depth).
    rates: HashMap<(u8, u8), Rate>,
    /// The match length and chain length of the last draft, to learn from its verification.
    last: Option<(u8, usize)>,
}

pub struct Pld {
    cfg: PldConfig,
    auto: Option<PldAuto>,
}

impl Pld {
    pub fn new(cfg: PldConfig) -> Result<Self> {
        cfg.validate()?;
        Ok(Pld { cfg, auto: None })
    }
}

impl PldAuto {
    /// The chain for this step: the best length for the cost at the current cache length.
    fn draft(&mut self, root: u32, history: &[u32], max_ngram: usize, max_len: usize) -> TokenTree {
        self.last = None;
        let Some(m) = ngram::lookup(history, max_ngram, max_len) else {
            return TokenTree::new(root);
        };
        let n = m.n.min(u8::MAX as usize) as u8;
        let rates = chain_rates(m.continuation.len(), |d| {
            self.rates.get(&(n, d.min(u8::MAX as usize) as u8)).copied()
        });
        let mut reach = 1.0;
        let scores: Vec<f64> = rates
            .iter()
            .map(|r| {
                reach *= r;
                reach
            })
            .collect();
        let offers = prefix_offers(&scores, |len| 1 + len);
        let len = match self.chooser.choose(history.len() - 1, &offers) {
            Choice::Plain => return TokenTree::new(root),
            Choice::Explore => 1,
            Choice::Offer(i) => i + 1,
        };
        let mut tree = TokenTree::with_capacity(root, 1 + len);
        ngram::insert_chain(&mut tree, 0, &m.continuation[..len], len);
        self.last = Some((n, len));
        tree
    }

    /// Node d of the last chain was tried when node d - 1 was accepted.
    fn learn(&mut self, step: &Step) {
        let Some((n, len)) = self.last.take() else {
            return;
        };
        if step.replaced {
            return;
        }
        let accepted = step.accepted.len();
        for d in 1..=len.min(accepted + 1) {
            let key = (n, d.min(u8::MAX as usize) as u8);
            self.rates.entry(key).or_default().record(d <= accepted);
        }
    }
}

/// The PLD chain for the end of `history` (root included) as a tree: root -> c1 -> c2 -> ...
pub fn pld_chain(root: u32, history: &[u32], max_ngram: usize, draft_len: usize) -> TokenTree {
    let mut tree = TokenTree::with_capacity(root, 1 + draft_len);
    if let Some(m) = ngram::lookup(history, max_ngram, draft_len) {
        ngram::insert_chain(&mut tree, 0, m.continuation, draft_len);
    }
    tree
}

impl Drafter for Pld {
    fn beside(&mut self, beside: Beside) {
        if let Some(a) = &mut self.auto {
            a.chooser.beside(beside);
        }
    }

    fn name(&self) -> MethodKind {
        MethodKind::Pld
    }

    fn begin(&mut self, model: &Transformer, _: &[u32]) -> Result<usize> {
        self.auto = match self.cfg.draft_len {
            Some(_) => None,
            None => Some(PldAuto {
                chooser: Chooser::new(curve_for(model)?),
                rates: HashMap::new(),
                last: None,
            }),
        };
        Ok(0)
    }

    fn draft(&mut self, root: u32, history: &[u32], max_rows: usize) -> Draft {
        let room = max_rows.saturating_sub(1);
        let tree = match (&mut self.auto, self.cfg.draft_len) {
            (Some(auto), _) => auto.draft(root, history, self.cfg.max_ngram, AUTO_MAX_DRAFT.min(room)),
            (None, len) => pld_chain(
                root,
                history,
                self.cfg.max_ngram,
                len.unwrap_or(DEFAULT_DRAFT_LEN).min(room),
            ),
        };
        Draft {
            tree,
            probes: Vec::new(),
        }
    }

    fn probe_inputs(&self, _: &Transformer, _: &[Probe]) -> Result<Tensor> {
        bail!("prompt lookup has no probe rows")
    }

    fn observe(&mut self, _: &Transformer, step: &Step) -> Result<()> {
        if let Some(auto) = &mut self.auto {
            auto.chooser.record(step);
            auto.learn(step);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_from_the_most_recent_match() {
        // history ends in [2, 3]; [2, 3] occurred at 1 (-> 4 5 6) and 6 (-> 7 8 2 3).
        let h = [1, 2, 3, 4, 5, 6, 2, 3, 7, 8, 2, 3];
        let t = pld_chain(3, &h, 3, 3);
        assert_eq!(t.tokens(), &[3, 7, 8, 2]);
        assert_eq!(t.parents(), &[0, 0, 1, 2]);
        // No match: the root alone.
        assert_eq!(pld_chain(9, &[1, 2, 9], 3, 10).len(), 1);
        // The row bound of the step caps the chain.
        let mut d = Pld::new(PldConfig {
            max_ngram: 3,
            draft_len: Some(10),
        })
        .unwrap();
        let draft = d.draft(3, &h, 3);
        assert_eq!(draft.tree.tokens(), &[3, 7, 8]);
        assert!(draft.probes.is_empty());
        assert_eq!(d.draft(3, &h, 1).tree.len(), 1);
        assert!(Pld::new(PldConfig {
            max_ngram: 0,
            draft_len: Some(10)
        })
        .is_err());
        assert!(Pld::new(PldConfig {
            max_ngram: 3,
            draft_len: Some(0)
        })
        .is_err());
        assert!(Pld::new(PldConfig::default()).is_ok());
    }

    #[test]
    fn auto_chain_length_follows_cost_and_acceptance() {
        use crate::decode::cost_curve::CostCurve;
        use std::sync::Arc;
        let auto = |f: fn(usize, usize) -> f64| PldAuto {
            chooser: Chooser::new(Arc::new(CostCurve::from_fn(f, 0.0))).with_time_spent(1e9),
            rates: HashMap::new(),
            last: None,
        };
        let h = [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3];
        // Flat: the whole continuation (4..=9, then 1 2 3); steep: the root alone.
        let mut flat = auto(|_, r| 1.0 + 1e-4 * r as f64);
        assert_eq!(flat.draft(3, &h, 3, 16).tokens(), &[3, 4, 5, 6, 7, 8, 9, 1, 2, 3]);
        assert_eq!(flat.last, Some((3, 9)));
        let mut steep = auto(|_, r| r as f64);
        assert_eq!(steep.draft(3, &h, 3, 16).len(), 1);
        assert_eq!(steep.last, None);
        // Learning: two accepted of a 9-chain -> depths 1, 2 hit, 3 missed, deeper not tried.
        let step = Step {
            accepted: &[1, 2],
            committed: &[4, 5, 0],
            probe_logits: &[],
            replaced: false,
            seconds: 0.0,
            remaining: 64,
        };
        flat.learn(&step);
        assert_eq!(flat.rates[&(3, 1)].accepted, 2.0);
        assert_eq!(flat.rates[&(3, 3)].accepted, 1.0);
        assert_eq!(flat.rates[&(3, 3)].proposed, 3.0);
        assert!(!flat.rates.contains_key(&(3, 4)));
        // Moderate cost: a chain that is always rejected at depth 1 stops paying.
        let mut moderate = auto(|_, r| 1.0 + 0.05 * r as f64);
        moderate.rates.insert(
            (3, 1),
            Rate {
                accepted: 0.0,
                proposed: 50.0,
            },
        );
        assert_eq!(moderate.draft(3, &h, 3, 16).len(), 1);
    }
}
