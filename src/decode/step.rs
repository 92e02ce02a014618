//! What the decoding loop and a drafter exchange: the drafter's trait and its proposal ([`Draft`]), what a
//! step did ([`Step`]), the generation's parameters, and how it ended.

use super::kind::MethodKind;
use super::layout::Probe;
use super::sampling::SamplingParams;
use super::stats::DecodeStats;
use super::tree::TokenTree;
use crate::model::Transformer;
use anyhow::Result;
use candle_core::Tensor;
use serde::{Deserialize, Serialize};

/// What a drafter proposes for one step: candidate tree rooted at the last committed token, and probe rows.
pub struct Draft {
    pub tree: TokenTree,
    pub probes: Vec<Probe>,
}

impl Draft {
    pub fn root_only(root: u32) -> Self {
        Draft {
            tree: TokenTree::new(root),
            probes: Vec::new(),
        }
    }
}

/// A decoding strategy: only the drafting differs between methods.
pub trait Drafter {
    /// The method, for statistics.
    fn name(&self) -> MethodKind;
    /// Called once with the prompt before prefill. Returns how many probe rows (offsets 1..=n, owned by the
    /// last prompt token) to append to the prefill.
    fn begin(&mut self, model: &Transformer, prompt: &[u32]) -> Result<usize>;
    /// The tree and probes for a step whose root is `root`; `history` is every token so far (prompt +
    /// generated, root included). `max_rows` bounds the block (context window, cache room).
    fn draft(&mut self, root: u32, history: &[u32], max_rows: usize) -> Draft;
    /// Input vectors for probe rows `[probes.len(), hidden]`.
    fn probe_inputs(&self, model: &Transformer, probes: &[Probe]) -> Result<Tensor>;
    /// After each step (and after prefill) what the step did: see [`Step`].
    fn observe(&mut self, model: &Transformer, step: &Step) -> Result<()>;
    /// Whose probes' logits `observe` gets, given the deepest accepted node of the step (the root, 0, when
    /// nothing was accepted). ESP reads the masks of the deepest accepted node (the default); lookahead's
    /// Jacobi window belongs to the root whatever was accepted.
    fn probe_owner(&self, deepest: usize) -> usize {
        deepest
    }
    /// What else the next step's forward pass carries (a batch's other sequences), for `--bc auto`'s
    /// prices; nothing unless told.
    fn beside(&mut self, _beside: Beside) {}
}

/// The other sequences' part of a batched step: a block's rows slow all of them, so `--bc auto` prices
/// its extra rows by what they cost the whole step ([`crate::decode::auto::Chooser::beside`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Beside {
    /// Rows the other sequences send.
    pub rows: usize,
    /// Sequences decoding beside this one, each committing at least a token a step.
    pub sequences: usize,
}

/// What one decoding step did, as its drafter sees it.
pub struct Step<'a> {
    /// Accepted nodes of the verified tree, root excluded, in path order (none after prefill).
    pub accepted: &'a [usize],
    /// The tokens committed: the accepted drafts, then the bonus token. After prefill: the first token.
    pub committed: &'a [u32],
    /// Logits of the probes owned by node [`Drafter::probe_owner`] (by default the deepest accepted node),
    /// ordered by offset; empty when it had none. After prefill: the prefill probes' logits.
    pub probe_logits: &'a [Vec<f32>],
    /// The loop verified the root alone instead of the drafter's proposal (it did not fit in the context
    /// window or the cache), so `accepted` refers to no node of the proposal.
    pub replaced: bool,
    /// Wall seconds of the step's forward pass and vocabulary projections: what the cost curve prices.
    /// After prefill: the prefill's seconds.
    pub seconds: f64,
    /// Tokens the answer may still take after this step's (`max_new_tokens` less those committed): what
    /// a draft made for later can still be used in.
    pub remaining: usize,
}

#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_tokens: Vec<u32>,
    /// The largest block a step may send, root and probe rows included (a server's `--max-bc`); `None`:
    /// as large as the context window and the cache allow. A smaller block changes the speed, never the
    /// tokens.
    pub max_block_rows: Option<usize>,
}

/// Why decoding ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// The model produced one of the stop tokens (it is the last token).
    StopToken,
    MaxNewTokens,
    /// The context window is full.
    ContextWindow,
    /// The `on_token` callback returned [`Halt`] (a stop string was seen, the client went away).
    Halted,
}

/// The error an `on_token` callback returns to end the generation after the token it was given, as if a
/// stop token had come: the generation returns normally with [`FinishReason::Halted`], its statistics,
/// and a cache that holds the tokens so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Halt;

impl std::fmt::Display for Halt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("generation halted by its caller")
    }
}

impl std::error::Error for Halt {}

pub struct Generation {
    pub tokens: Vec<u32>,
    pub stats: DecodeStats,
    pub finish_reason: FinishReason,
}
