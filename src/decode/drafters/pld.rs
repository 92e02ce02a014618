//! Prompt Lookup Decoding (Saxena 2023): match the last n tokens (n = `max_ngram` down to 1) against the
//! prompt and everything generated so far, and draft the tokens that followed the most recent earlier
//! occurrence as one chain (up to `draft_len` tokens). No probes: a chain with no probe rows is verified
//! under a plain causal mask by the shared loop. Cheap, and strong wherever the answer copies its input
//! (translation, summarisation, RAG, code edits).
//!
//! Deviation from the reference script: it takes the *earliest* occurrence; this takes the most recent one,
//! which follows the text being produced now (a repeated list item, the current sentence of a copied
//! passage) more closely.

use super::ngram;
use crate::decode::check_flag;
use crate::decode::generate::{Draft, Drafter, Step};
use crate::decode::layout::Probe;
use crate::decode::method::MethodKind;
use crate::decode::tree::TokenTree;
use crate::model::Transformer;
use anyhow::{bail, Result};
use candle_core::Tensor;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PldConfig {
    /// Largest suffix length to match (the reference uses 3).
    pub max_ngram: usize,
    /// Most draft tokens per step (the reference uses 10).
    pub draft_len: usize,
}

impl Default for PldConfig {
    fn default() -> Self {
        PldConfig {
            max_ngram: 3,
            draft_len: 10,
        }
    }
}

pub struct Pld {
    cfg: PldConfig,
}

impl Pld {
    pub fn new(cfg: PldConfig) -> Result<Self> {
        check_flag("--ngram", cfg.max_ngram, 1)?;
        check_flag("--draft-len", cfg.draft_len, 1)?;
        Ok(Pld { cfg })
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
    fn name(&self) -> MethodKind {
        MethodKind::Pld
    }

    fn begin(&mut self, _: &Transformer, _: &[u32]) -> Result<usize> {
        Ok(0)
    }

    fn draft(&mut self, root: u32, history: &[u32], max_rows: usize) -> Draft {
        let len = self.cfg.draft_len.min(max_rows.saturating_sub(1));
        Draft {
            tree: pld_chain(root, history, self.cfg.max_ngram, len),
            probes: Vec::new(),
        }
    }

    fn probe_inputs(&self, _: &Transformer, _: &[Probe]) -> Result<Tensor> {
        bail!("prompt lookup has no probe rows")
    }

    fn observe(&mut self, _: &Transformer, _: &Step) -> Result<()> {
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
        let mut d = Pld::new(PldConfig::default()).unwrap();
        let draft = d.draft(3, &h, 3);
        assert_eq!(draft.tree.tokens(), &[3, 7, 8]);
        assert!(draft.probes.is_empty());
        assert_eq!(d.draft(3, &h, 1).tree.len(), 1);
        assert!(Pld::new(PldConfig {
            max_ngram: 0,
            draft_len: 10
        })
        .is_err());
        assert!(Pld::new(PldConfig {
            max_ngram: 3,
            draft_len: 0
        })
        .is_err());
    }
}
