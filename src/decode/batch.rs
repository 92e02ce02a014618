//! Many generations stepped together: each step runs every active sequence's block in one forward pass.
//!
//! A sequence is a [`Sequence`] with its own KV cache and drafter (so its own acceptance statistics and
//! `--bc auto` choices). Sequences join between steps ([`Batch::join`] prefills the prompt alone) and
//! leave when they end or are cancelled. A step plans every sequence's block (one row for plain decoding,
//! a tree and probe rows when speculating), runs them all through
//! [`Transformer::forward_batch`](crate::model::Transformer::forward_batch), computes every sequence's
//! first vocabulary projection in one product, and verifies each sequence on its own. The model's kernels
//! are row-invariant, so every sequence's tokens are those [`generate`](super::generate::generate) gives
//! it alone, whatever else is in the batch.
//!
//! # Example
//!
//! ```
//! use probespec::decode::batch::Batch;
//! use probespec::decode::generate::{generate, GenerateParams};
//! use probespec::decode::method::Method;
//! # use candle_core::{DType, Device};
//! # use probespec::model::{synthetic::random_model, ModelConfig};
//! # fn main() -> anyhow::Result<()> {
//! # let config = ModelConfig::from_hf_json(
//! #     r#"{"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
//! #         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
//! #         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
//! #         "tie_word_embeddings": false, "eos_token_id": 2}"#,
//! # )?;
//! # let model = random_model(config, &Device::Cpu, DType::F32)?;
//! let params = GenerateParams {
//!     max_new_tokens: 16,
//!     sampling: Default::default(),
//!     stop_tokens: vec![],
//!     max_block_rows: None,
//! };
//! let prompts = [vec![5, 17, 9, 40], vec![3, 3, 8]];
//! let mut batch = Batch::new(&model);
//! for p in &prompts {
//!     batch.join(p, Method::Ar.drafter(0)?, &params)?;
//! }
//! let mut streamed = vec![Vec::new(); prompts.len()];
//! let mut answers = vec![Vec::new(); prompts.len()];
//! while !batch.is_empty() {
//!     for (id, generation) in batch.step(&mut |id, token| {
//!         streamed[id as usize].push(token);
//!         Ok(())
//!     })? {
//!         answers[id as usize] = generation?.tokens;
//!     }
//! }
//! for (p, answer) in prompts.iter().zip(&answers) {
//!     let alone = generate(&model, p, Method::Ar.drafter(0)?.as_mut(), &params, &mut |_| Ok(()))?;
//!     assert_eq!(answer, &alone.tokens);
//! }
//! assert_eq!(streamed, answers);
//! # Ok(())
//! # }
//! ```

use super::sequence::{Block, Prefetched, Sequence};
use super::step::{Drafter, GenerateParams, Generation};
use crate::model::{KvCache, SequenceBlock, Transformer};
use anyhow::Result;
use candle_core::Tensor;
use std::time::Instant;

/// A sequence's number in its batch, in joining order from 0.
pub type SequenceId = u64;

/// A generation in the batch.
struct Member {
    id: SequenceId,
    seq: Sequence,
    cache: KvCache,
    drafter: Box<dyn Drafter>,
}

/// Generations decoded together.
pub struct Batch<'m> {
    model: &'m Transformer,
    members: Vec<Member>,
    next_id: SequenceId,
}

impl<'m> Batch<'m> {
    pub fn new(model: &'m Transformer) -> Self {
        Batch {
            model,
            members: Vec::new(),
            next_id: 0,
        }
    }

    /// Sequences still decoding.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Prefills `prompt` (alone, between steps) and adds its generation to the batch; its first token
    /// is handed out by the next [`Batch::step`].
    pub fn join(
        &mut self,
        prompt: &[u32],
        mut drafter: Box<dyn Drafter>,
        params: &GenerateParams,
    ) -> Result<SequenceId> {
        let mut cache = self.model.new_cache(0)?;
        let seq = Sequence::start(self.model, &mut cache, prompt, drafter.as_mut(), params)?;
        let id = self.next_id;
        self.next_id += 1;
        self.members.push(Member {
            id,
            seq,
            cache,
            drafter,
        });
        Ok(id)
    }

    /// Ends sequence `id` where it is ([`FinishReason::Halted`](super::step::FinishReason::Halted));
    /// `None` when it is not in the batch.
    pub fn cancel(&mut self, id: SequenceId) -> Option<Generation> {
        let i = self.members.iter().position(|m| m.id == id)?;
        let mut m = self.members.remove(i);
        Some(m.seq.finish(&mut m.cache))
    }

    /// One step: hands every sequence's committed tokens to `on_token(id, token)`, removes the sequences
    /// that ended (returned with their generation, or the error that ended them: an `on_token` error
    /// other than [`Halt`](super::step::Halt) ends only its own sequence), then runs one forward pass
    /// over the blocks of the others and verifies each.
    pub fn step(
        &mut self,
        on_token: &mut dyn FnMut(SequenceId, u32) -> Result<()>,
    ) -> Result<Vec<(SequenceId, Result<Generation>)>> {
        let mut ended = Vec::new();
        let mut i = 0;
        while i < self.members.len() {
            let m = &mut self.members[i];
            let id = m.id;
            match m.seq.emit(&mut |t| on_token(id, t)) {
                Ok(None) => i += 1,
                Ok(Some(_)) => {
                    let mut m = self.members.remove(i);
                    ended.push((id, Ok(m.seq.finish(&mut m.cache))));
                }
                Err(e) => {
                    self.members.remove(i);
                    ended.push((id, Err(e)));
                }
            }
        }
        if self.members.is_empty() {
            return Ok(ended);
        }
        let model = self.model;
        let blocks: Vec<Block> = self
            .members
            .iter_mut()
            .map(|m| m.seq.plan(model, &m.cache, m.drafter.as_mut()))
            .collect::<Result<_>>()?;
        let t = Instant::now();
        let mut inputs: Vec<SequenceBlock> = blocks
            .iter()
            .zip(self.members.iter_mut())
            .map(|(b, m)| SequenceBlock {
                x: &b.x,
                positions: &b.positions,
                mask: &b.mask,
                cache: &mut m.cache,
            })
            .collect();
        let hidden = model.forward_batch(&mut inputs)?;
        drop(inputs);
        let forward_seconds = t.elapsed().as_secs_f64();
        let first = self.first_projections(&blocks, &hidden)?;
        for (((m, block), h), f) in self.members.iter_mut().zip(blocks).zip(&hidden).zip(first) {
            let f = Some(f);
            m.seq.verify(
                model,
                &mut m.cache,
                m.drafter.as_mut(),
                block,
                h,
                forward_seconds,
                f,
            )?;
        }
        Ok(ended)
    }

    /// Every sequence's first vocabulary projection ([`Block::first_rows`]) as one product over all their
    /// rows.
    fn first_projections(&self, blocks: &[Block], hidden: &[Tensor]) -> Result<Vec<Prefetched>> {
        let rows: Vec<Vec<usize>> = blocks
            .iter()
            .zip(&self.members)
            .map(|(b, m)| b.first_rows(m.drafter.as_ref()))
            .collect();
        let t = Instant::now();
        let mut all = Vec::new();
        let mut start = 0;
        for (r, h) in rows.iter().zip(hidden) {
            all.extend(r.iter().map(|&row| start + row));
            start += h.dim(0)?;
        }
        let stacked = Tensor::cat(hidden, 0)?;
        let mut logits = self.model.logits(&stacked, &all)?.to_vec2::<f32>()?.into_iter();
        // Each sequence's share of the projection's time, by its rows.
        let seconds = t.elapsed().as_secs_f64() / all.len().max(1) as f64;
        Ok(rows
            .into_iter()
            .map(|rows| Prefetched {
                seconds: seconds * rows.len() as f64,
                logits: logits.by_ref().take(rows.len()).collect(),
                rows,
            })
            .collect())
    }
}

#[cfg(test)]
#[path = "batch_tests.rs"]
mod tests;
