//! A prompt's prefill, in one block or in chunks: [`Prefill::begin`] checks the prompt, lets the drafter
//! see it and makes room in the cache; [`Prefill::chunk`] lays out the next rows of the prompt (the
//! prefill's probe rows go with the last), which the caller runs through the model with plain causal
//! attention, alone or beside other sequences' blocks; [`Prefill::advance`] counts them in, and after the
//! last picks the first token and hands over the [`Sequence`] that decodes the rest.
//!
//! With the row-invariant CPU kernels a prompt prefilled in chunks gives the bits of one block (each
//! row's products do not depend on the rows beside it, and its attention reads the same cached keys), as
//! a conversation's reused prefix does; other ops prefill in one block ([`Transformer::row_invariant`]).

use super::layout::Probe;
use super::sampling::Sampler;
use super::sequence::Sequence;
use super::stats::DecodeStats;
use super::step::{Drafter, FinishReason, GenerateParams, Generation, Step};
use crate::model::{BlockMask, KvCache, Transformer};
use anyhow::{bail, Result};
use candle_core::Tensor;
use std::time::Instant;

/// The KV cache rows a generation reserves beyond its prompt and answer, for the block of its last step.
pub const BLOCK_ROOM: usize = 256;

/// The KV cache rows a generation reserves, its answer's and one more block's room, never more than the
/// context window `ctx` needs (a prefill's probes may take more when the answer is shorter than them).
pub fn cache_rows(ctx: usize, prompt_len: usize, max_new_tokens: usize) -> usize {
    prompt_len
        .saturating_add(max_new_tokens)
        .min(ctx)
        .saturating_add(BLOCK_ROOM)
}

/// How many tokens `a` and `b` share from their starts.
pub fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// Prefills `prompt` whole after what `cache` already holds of it (a conversation's earlier turns) and
/// picks the first token; the drafter sees the prompt first. With the row-invariant CPU kernels a reused
/// prefix gives the same numbers as prefilling the whole prompt.
pub fn start(
    model: &Transformer,
    cache: &mut KvCache,
    prompt: &[u32],
    drafter: &mut dyn Drafter,
    params: &GenerateParams,
) -> Result<Sequence> {
    Prefill::begin(model, cache, prompt, drafter, params)?.run(model, cache, drafter)
}

/// A prompt part-way into the cache.
pub struct Prefill {
    prompt: Vec<u32>,
    /// Prompt tokens whose keys and values the cache holds (a reused prefix included).
    done: usize,
    /// Of those, the ones reused from before.
    reused: usize,
    /// Probe rows the drafter asked for after the prompt.
    probes: usize,
    params: GenerateParams,
    stats: DecodeStats,
    t0: Instant,
}

/// The next rows of a prefill, laid out for the model.
pub struct PrefillChunk {
    pub x: Tensor,
    pub positions: Vec<u32>,
    pub mask: BlockMask,
    /// Prompt rows in it.
    rows: usize,
    /// It ends the prompt (and holds the probe rows).
    last: bool,
}

impl Prefill {
    /// Checks `prompt`, lets the drafter see it, keeps what `cache` already holds of it (a conversation's
    /// earlier turns; at least its last token is fed again, whose logits give the first token) and makes
    /// room for the answer.
    pub fn begin(
        model: &Transformer,
        cache: &mut KvCache,
        prompt: &[u32],
        drafter: &mut dyn Drafter,
        params: &GenerateParams,
    ) -> Result<Prefill> {
        let ctx = model.config.max_position_embeddings;
        if prompt.is_empty() {
            bail!("the prompt is empty");
        }
        if prompt.len() >= ctx {
            bail!(
                "the prompt is {} tokens, longer than the model's context window of {} tokens",
                prompt.len(),
                ctx
            );
        }
        let mut stats = DecodeStats::new(drafter.name());
        let probes = drafter.begin(model, prompt)?;
        stats.cost_curve_timed_seconds = super::cost_cache::take_timing(model).unwrap_or(0.0);
        // The prefill's clock starts after the drafter's setup, which on a machine's first run includes
        // timing the cost curve for `--bc auto` (once, then cached): 0.7 s that the stats line showed as
        // prefill of a 37-token prompt.
        let t0 = Instant::now();
        let probes = if prompt.len() + probes <= ctx { probes } else { 0 };
        cache.truncate(prompt.len() - 1);
        let reused = cache.len();
        cache.reserve(cache_rows(ctx, prompt.len(), params.max_new_tokens).max(prompt.len() + probes))?;
        Ok(Prefill {
            prompt: prompt.to_vec(),
            done: reused,
            reused,
            probes,
            params: params.clone(),
            stats,
            t0,
        })
    }

    /// Prompt tokens still to run.
    pub fn left(&self) -> usize {
        self.prompt.len() - self.done
    }

    /// The next at most `rows` prompt tokens (at least one), with the probe rows when they end it.
    pub fn chunk(&self, model: &Transformer, drafter: &dyn Drafter, rows: usize) -> Result<PrefillChunk> {
        let end = self.prompt.len().min(self.done.saturating_add(rows.max(1)));
        let last = end == self.prompt.len();
        let probes = if last { self.probes } else { 0 };
        let mut x = model.embed(&self.prompt[self.done..end])?;
        if probes > 0 {
            let p: Vec<Probe> = (1..=probes).map(|offset| Probe { owner: 0, offset }).collect();
            // Probe vectors are f32; the model's input rows are in its dtype.
            x = Tensor::cat(&[&x, &drafter.probe_inputs(model, &p)?.to_dtype(x.dtype())?], 0)?;
        }
        Ok(PrefillChunk {
            x,
            positions: (self.done as u32..(end + probes) as u32).collect(),
            mask: BlockMask::Causal,
            rows: end - self.done,
            last,
        })
    }

    /// Counts in `chunk`, which the model ran into `cache` giving `hidden`; after the last, the first
    /// token is picked and the generation goes on as a [`Sequence`].
    pub fn advance(
        &mut self,
        model: &Transformer,
        cache: &mut KvCache,
        drafter: &mut dyn Drafter,
        chunk: PrefillChunk,
        hidden: &Tensor,
    ) -> Result<Option<Sequence>> {
        self.done += chunk.rows;
        if !chunk.last {
            return Ok(None);
        }
        let last = chunk.rows - 1;
        let rows: Vec<usize> = (last..last + 1 + self.probes).collect();
        let logits = model.logits(hidden, &rows)?.to_vec2::<f32>()?;
        cache.truncate(self.prompt.len());
        let mut sampler = Sampler::new(self.params.sampling);
        let first = sampler.pick(&logits[0]);
        drafter.observe(
            model,
            &Step {
                accepted: &[],
                committed: &[first],
                probe_logits: &logits[1..],
                replaced: false,
                seconds: self.t0.elapsed().as_secs_f64(),
                remaining: self.params.max_new_tokens.saturating_sub(1),
            },
        )?;
        let mut stats = self.stats.clone();
        stats.prefill_seconds = self.t0.elapsed().as_secs_f64();
        stats.prefill_tokens = self.prompt.len() - self.reused;
        let ctx = model.config.max_position_embeddings;
        Ok(Some(Sequence::decoding(
            self.params.clone(),
            sampler,
            stats,
            std::mem::take(&mut self.prompt),
            first,
            ctx,
        )))
    }

    /// The generation of a prompt given up before its first token.
    pub fn abandon(mut self) -> Generation {
        self.stats.prefill_seconds = self.t0.elapsed().as_secs_f64();
        self.stats.prefill_tokens = self.done - self.reused;
        self.stats.finish();
        Generation {
            tokens: Vec::new(),
            stats: self.stats,
            finish_reason: FinishReason::Halted,
        }
    }

    /// Prefills the whole prompt in one block.
    pub fn run(
        mut self,
        model: &Transformer,
        cache: &mut KvCache,
        drafter: &mut dyn Drafter,
    ) -> Result<Sequence> {
        let chunk = self.chunk(model, drafter, usize::MAX)?;
        let hidden = model.forward(&chunk.x, &chunk.positions, &chunk.mask, cache)?;
        let seq = self.advance(model, cache, drafter, chunk, &hidden)?;
        Ok(seq.expect("one chunk holds the whole prompt"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_prefix_lengths() {
        assert_eq!(common_prefix(&[], &[1, 2]), 0);
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 2]), 2);
        assert_eq!(common_prefix(&[1, 2, 3], &[1, 5, 3]), 1);
        assert_eq!(common_prefix(&[4], &[1]), 0);
    }
}
