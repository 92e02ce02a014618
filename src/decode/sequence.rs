//! One generation as state between forward passes: the decoding loop's body, stepped from outside.
//!
//! [`super::prefill`] prefills the prompt (whole, or in chunks beside other sequences' steps) and hands over
//! a `Sequence`. Then each step is: [`Sequence::emit`] hands the tokens the last step committed to the
//! caller, stopping exactly where plain decoding would; [`Sequence::plan`] asks the drafter for a tree (+
//! probe rows) and lays it out as a block; the caller runs the block through the model, alone
//! ([`generate_in`](super::generate::generate_in)) or beside other sequences' blocks (a batch);
//! [`Sequence::verify`] accepts a path, keeps prefix + root + accepted path in the KV cache and hands the
//! drafter what the step did. Verification, cache compaction, stopping rules and statistics are written here
//! once.

use super::layout::{BlockLayout, LayoutCache};
use super::sampling::Sampler;
use super::stats::DecodeStats;
use super::step::{Draft, Drafter, FinishReason, GenerateParams, Generation, Halt, Step};
use super::tree::accept;
use crate::model::{BlockMask, KvCache, Transformer};
use anyhow::Result;
use candle_core::Tensor;
use std::sync::Arc;
use std::time::Instant;

/// Most rows of one vocabulary projection while verifying (defined beside the cost model, which prices
/// it, so that the cost modules do not import the loop).
pub use super::cost_curve::LOGIT_ROWS;

/// A generation between steps.
pub struct Sequence {
    params: GenerateParams,
    sampler: Sampler,
    stats: DecodeStats,
    /// Prompt and emitted tokens.
    history: Vec<u32>,
    generated: Vec<u32>,
    /// What the last step committed, not emitted yet.
    pending: Vec<u32>,
    layouts: LayoutCache,
    mask_buf: Vec<f32>,
    /// The model's context window.
    ctx: usize,
    t_decode: Instant,
    finish: Option<FinishReason>,
}

/// A step's block, laid out for the model: its input rows, their positions and mask.
pub struct Block {
    pub x: Tensor,
    pub positions: Vec<u32>,
    pub mask: BlockMask,
    draft: Draft,
    layout: Arc<BlockLayout>,
    /// Cached rows before the block.
    p0: usize,
    /// The drafter's proposal did not fit: the root alone.
    replaced: bool,
}

/// Logits of block rows computed outside [`Sequence::verify`] (a batch's first vocabulary projection,
/// shared by its sequences): `logits[i]` is row `rows[i]`'s.
pub struct Prefetched {
    pub rows: Vec<usize>,
    pub logits: Vec<Vec<f32>>,
    pub seconds: f64,
}

impl Sequence {
    /// A generation whose prompt is prefilled and whose first token, `first`, is picked.
    pub(super) fn decoding(
        params: GenerateParams,
        sampler: Sampler,
        stats: DecodeStats,
        prompt: Vec<u32>,
        first: u32,
        ctx: usize,
    ) -> Sequence {
        Sequence {
            params,
            sampler,
            stats,
            history: prompt,
            generated: Vec::new(),
            pending: vec![first],
            layouts: LayoutCache::new(),
            mask_buf: Vec::new(),
            ctx,
            t_decode: Instant::now(),
            finish: None,
        }
    }

    /// The prompt and the tokens handed out so far.
    pub fn history(&self) -> &[u32] {
        &self.history
    }

    /// Hands what the last step committed to `on_token`, stopping exactly where plain decoding would;
    /// returns why the generation ended, if it did (then it takes no more steps). `on_token` may end it
    /// after a token by returning [`Halt`].
    pub fn emit(&mut self, on_token: &mut dyn FnMut(u32) -> Result<()>) -> Result<Option<FinishReason>> {
        if self.finish.is_some() {
            return Ok(self.finish);
        }
        let mut pending = std::mem::take(&mut self.pending);
        for (i, &t) in pending.iter().enumerate() {
            self.generated.push(t);
            self.history.push(t);
            let halted = match on_token(t) {
                Ok(()) => false,
                Err(e) if e.is::<Halt>() => true,
                Err(e) => return Err(e),
            };
            let reason = if halted {
                FinishReason::Halted
            } else if self.params.stop_tokens.contains(&t) {
                FinishReason::StopToken
            } else if self.generated.len() >= self.params.max_new_tokens {
                FinishReason::MaxNewTokens
            } else if self.history.len() >= self.ctx {
                FinishReason::ContextWindow
            } else {
                continue;
            };
            self.stats.truncate_last_step(i + 1);
            self.finish = Some(reason);
            break;
        }
        // The buffer is kept for the next step's tokens.
        pending.clear();
        self.pending = pending;
        Ok(self.finish)
    }

    /// The next step's block: the drafter's tree and probes after what `cache` holds, or the root alone
    /// when they do not fit in the context window, the cache or the largest block allowed.
    pub fn plan(&mut self, model: &Transformer, cache: &KvCache, drafter: &mut dyn Drafter) -> Result<Block> {
        let root = *self.history.last().expect("a prompt");
        let p0 = cache.len();
        let room = (self.ctx - p0).min(cache.capacity() - p0);
        let room = self
            .params
            .max_block_rows
            .map_or(room, |most| room.min(most.max(1)));
        let t_draft = Instant::now();
        let mut draft = drafter.draft(root, &self.history, room);
        let mut layout = self.layouts.get(&draft.tree, &draft.probes);
        let fits = layout.rows <= room && layout.rel_positions.iter().all(|&r| (p0 + r as usize) < self.ctx);
        let replaced = !fits;
        if replaced {
            draft = Draft::root_only(root);
            layout = self.layouts.get(&draft.tree, &draft.probes);
        }
        let mut x = model.embed(draft.tree.tokens())?;
        if !draft.probes.is_empty() {
            let probes = drafter.probe_inputs(model, &draft.probes)?.to_dtype(x.dtype())?;
            x = Tensor::cat(&[&x, &probes], 0)?;
        }
        let positions: Vec<u32> = layout.rel_positions.iter().map(|&r| p0 as u32 + r).collect();
        let is_chain =
            draft.probes.is_empty() && (1..draft.tree.len()).all(|n| draft.tree.parent(n) == Some(n - 1));
        let mask = if is_chain {
            BlockMask::Causal
        } else {
            layout.additive_mask_into(p0, &mut self.mask_buf);
            BlockMask::Additive(Tensor::from_slice(
                &self.mask_buf,
                (layout.rows, p0 + layout.rows),
                &model.device,
            )?)
        };
        self.stats.draft_seconds += t_draft.elapsed().as_secs_f64();
        Ok(Block {
            x,
            positions,
            mask,
            draft,
            layout,
            p0,
            replaced,
        })
    }

    /// Accepts a path of `block`'s tree from its `hidden` states (the model ran it in
    /// `forward_seconds`; `first`: logits a batch already computed), keeps prefix + root + accepted path
    /// in `cache` and tells the drafter what the step did.
    ///
    /// The tree is walked computing logits lazily: at each visited node its own row plus the probe rows
    /// its owner would hand back, and ahead of need those of its first-child path (the drafter's best
    /// guess), up to [`LOGIT_ROWS`] rows. A vocabulary projection costs little more for 8 rows than for
    /// one, so an accepted path is usually verified with one projection, and a rejected root wastes only a
    /// few rows of one.
    #[allow(clippy::too_many_arguments)]
    pub fn verify(
        &mut self,
        model: &Transformer,
        cache: &mut KvCache,
        drafter: &mut dyn Drafter,
        block: Block,
        hidden: &Tensor,
        forward_seconds: f64,
        first: Option<Prefetched>,
    ) -> Result<()> {
        let Block {
            draft,
            layout,
            p0,
            replaced,
            ..
        } = block;
        self.stats.forward_seconds += forward_seconds;
        let t_verify = Instant::now();
        let mut logits = RowLogits::new(layout.rows);
        if let Some(f) = first {
            logits.insert(f);
        }
        let (accepted, bonus) = accept(&draft.tree, |cur| -> Result<u32> {
            // A node fetched ahead came with its owner's probe rows: nothing more to compute.
            if !logits.has(cur) {
                let rows = fetch_rows(&draft, &layout, &*drafter, cur);
                logits.fetch(model, hidden, &rows)?;
            }
            Ok(self.sampler.pick(logits.row(cur)))
        })?;
        let cur = accepted.last().copied().unwrap_or(0);
        let probe_logits: Vec<Vec<f32>> = probe_rows(&layout, drafter.probe_owner(cur))
            .into_iter()
            .map(|r| logits.take(r))
            .collect();
        let mut keep = vec![0usize];
        keep.extend(accepted.iter().copied());
        // The vocabulary projections belong to the model's cost, not to the verifier's overhead.
        self.stats.forward_seconds += logits.seconds;
        self.stats.verify_seconds += t_verify.elapsed().as_secs_f64() - logits.seconds;

        let t_book = Instant::now();
        cache.keep(p0, &keep)?;
        self.pending.clear();
        self.pending.extend(accepted.iter().map(|&n| draft.tree.token(n)));
        self.pending.push(bonus);
        self.stats
            .record_step(self.pending.len(), draft.tree.len(), layout.rows);
        drafter.observe(
            model,
            &Step {
                accepted: &accepted,
                committed: &self.pending,
                probe_logits: &probe_logits,
                replaced,
                seconds: forward_seconds + logits.seconds,
                remaining: self
                    .params
                    .max_new_tokens
                    .saturating_sub(self.generated.len() + self.pending.len()),
            },
        )?;
        self.stats.bookkeeping_seconds += t_book.elapsed().as_secs_f64();
        Ok(())
    }

    /// Ends the generation (a caller that stops stepping it ends it as [`FinishReason::Halted`]); `cache`
    /// keeps the history only, ready for a next turn.
    pub fn finish(mut self, cache: &mut KvCache) -> Generation {
        // A stop inside an accepted path leaves rows after it in the cache: keep only the history.
        cache.truncate(self.history.len());
        self.stats.decode_seconds = self.t_decode.elapsed().as_secs_f64();
        self.stats.new_tokens = self.generated.len();
        self.stats.finish();
        Generation {
            tokens: self.generated,
            stats: self.stats,
            finish_reason: self.finish.unwrap_or(FinishReason::Halted),
        }
    }
}

impl Block {
    /// The rows whose logits verification reads first: the root's, its probes', and its first-child path's
    /// up to [`LOGIT_ROWS`]; a batch computes them for all its sequences in one projection.
    pub fn first_rows(&self, drafter: &dyn Drafter) -> Vec<usize> {
        fetch_rows(&self.draft, &self.layout, drafter, 0)
    }
}

/// The rows fetched when node `cur`'s logits are needed: its own and its owner's probes, then along its
/// first-child path while the projection stays within [`LOGIT_ROWS`] rows.
fn fetch_rows(draft: &Draft, layout: &BlockLayout, drafter: &dyn Drafter, cur: usize) -> Vec<usize> {
    let mut rows = Vec::with_capacity(LOGIT_ROWS);
    let mut next = Some(cur);
    while let Some(n) = next {
        let probes = probe_rows(layout, drafter.probe_owner(n));
        if n != cur && rows.len() + 1 + probes.len() > LOGIT_ROWS {
            break;
        }
        rows.push(n);
        rows.extend(probes);
        next = draft.tree.children(n).next();
    }
    rows
}

/// The block rows of `owner`'s probes, by offset.
fn probe_rows(layout: &BlockLayout, owner: usize) -> Vec<usize> {
    (1..)
        .map_while(|offset| layout.probe_row(owner, offset))
        .collect()
}

/// Logits of block rows, computed on demand and at most once each.
struct RowLogits {
    rows: Vec<Option<Vec<f32>>>,
    /// Time spent in the projections.
    seconds: f64,
}

impl RowLogits {
    fn new(n: usize) -> Self {
        RowLogits {
            rows: vec![None; n],
            seconds: 0.0,
        }
    }

    /// Rows computed elsewhere.
    fn insert(&mut self, f: Prefetched) {
        self.seconds += f.seconds;
        for (r, l) in f.rows.into_iter().zip(f.logits) {
            self.rows[r] = Some(l);
        }
    }

    /// Computes, in one vocabulary projection, the rows of `wanted` not computed yet.
    fn fetch(&mut self, model: &Transformer, hidden: &Tensor, wanted: &[usize]) -> Result<()> {
        let missing: Vec<usize> = wanted
            .iter()
            .copied()
            .filter(|&r| self.rows[r].is_none())
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let t = Instant::now();
        let computed = model.logits(hidden, &missing)?.to_vec2::<f32>()?;
        self.seconds += t.elapsed().as_secs_f64();
        for (r, l) in missing.into_iter().zip(computed) {
            self.rows[r] = Some(l);
        }
        Ok(())
    }

    fn has(&self, r: usize) -> bool {
        self.rows[r].is_some()
    }

    fn row(&self, r: usize) -> &[f32] {
        self.rows[r].as_deref().expect("row fetched before use")
    }

    fn take(&mut self, r: usize) -> Vec<f32> {
        self.rows[r].take().expect("row fetched before use")
    }
}
