//! Many generations stepped together: each step runs every active sequence's block in one forward pass.
//!
//! A sequence is a [`Sequence`] with its own KV cache and drafter (so its own acceptance statistics and
//! `--bc auto` choices). Sequences join between steps and leave when they end or are cancelled. A joining
//! prompt is prefilled alone when it joins, or, with a prefill chunk ([`Batch::with_prefill_chunk`]), a few
//! rows a step in the same forward pass as the others' blocks, so that they keep producing tokens while it
//! goes in. A step plans every sequence's block (one row for plain decoding, a tree and probe rows when
//! speculating), runs them all through
//! [`Transformer::forward_batch`](crate::model::Transformer::forward_batch), computes every sequence's first
//! vocabulary projection in one product, and verifies each sequence on its own. The model's kernels are
//! row-invariant, so every sequence's tokens are those [`generate`](super::generate::generate) gives it
//! alone, whatever else is in the batch.
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

use super::prefill::{Prefill, PrefillChunk};
use super::sequence::{Block, Prefetched, Sequence};
use super::step::{Beside, Drafter, GenerateParams, Generation};
use crate::model::{KvCache, SequenceBlock, Transformer};
use anyhow::Result;
use candle_core::Tensor;
use std::time::Instant;

/// A sequence's number in its batch, in joining order from 0.
pub type SequenceId = u64;

/// Where a generation is.
enum Work {
    /// Its prompt going into the cache, a chunk a step.
    Prefilling(Box<Prefill>),
    Decoding(Box<Sequence>),
}

/// A generation in the batch.
struct Member {
    id: SequenceId,
    work: Work,
    cache: KvCache,
    drafter: Box<dyn Drafter>,
    /// Rows it sent in the last step.
    last_rows: usize,
}

/// What a member sends in a step.
enum Planned {
    Nothing,
    Prefill(PrefillChunk),
    Decode(Block),
}

/// Generations decoded together.
pub struct Batch<'m> {
    model: &'m Transformer,
    members: Vec<Member>,
    next_id: SequenceId,
    /// Most prompt rows a step prefills beside decoding sequences (`None`: a prompt goes in whole).
    prefill_chunk: Option<usize>,
    /// The caches of the generations that ended, kept for [`Batch::take_retired`] (`None`: dropped).
    retired: Option<Vec<Retired>>,
}

/// The cache of a generation that ended and the tokens it holds (prompt and answer), for a later
/// prompt that starts with them ([`Batch::join_reusing`]).
pub struct Retired {
    pub tokens: Vec<u32>,
    pub cache: KvCache,
}

impl<'m> Batch<'m> {
    pub fn new(model: &'m Transformer) -> Self {
        Batch {
            model,
            members: Vec::new(),
            next_id: 0,
            prefill_chunk: None,
            retired: None,
        }
    }

    /// Keeps the caches of the generations that end (normally or cancelled) for
    /// [`Batch::take_retired`].
    pub fn keeping_caches(mut self) -> Self {
        self.retired = Some(Vec::new());
        self
    }

    /// The caches of the generations that ended since the last call.
    pub fn take_retired(&mut self) -> Vec<Retired> {
        self.retired.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Prompts that join go in a step at a time beside the decoding sequences, at most `rows` prompt
    /// rows a step, so that those keep producing tokens; while nothing decodes a prompt goes in whole.
    /// Only where the model gives a prompt in parts the bits of the whole
    /// ([`Transformer::row_invariant`]).
    pub fn with_prefill_chunk(mut self, rows: Option<usize>) -> Self {
        self.prefill_chunk = rows.filter(|_| self.model.row_invariant()).map(|r| r.max(1));
        self
    }

    /// Sequences still decoding.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Adds a generation of `prompt` to the batch. Without a prefill chunk its prompt is prefilled now
    /// (alone, between steps); with one the next steps prefill it. Its first token is handed out by the
    /// step after its prefill.
    pub fn join(
        &mut self,
        prompt: &[u32],
        drafter: Box<dyn Drafter>,
        params: &GenerateParams,
    ) -> Result<SequenceId> {
        let cache = self.model.new_cache(0)?;
        self.join_reusing(prompt, drafter, params, cache)
    }

    /// [`Batch::join`] into `cache`, which holds the keys and values of a prefix of `prompt` (a retired
    /// generation's, cut to what it shares with the prompt): only the rest is prefilled. With the
    /// row-invariant kernels the answer is the one a whole prefill gives.
    pub fn join_reusing(
        &mut self,
        prompt: &[u32],
        mut drafter: Box<dyn Drafter>,
        params: &GenerateParams,
        mut cache: KvCache,
    ) -> Result<SequenceId> {
        let prefill = Prefill::begin(self.model, &mut cache, prompt, drafter.as_mut(), params)?;
        let work = match self.prefill_chunk {
            Some(_) => Work::Prefilling(Box::new(prefill)),
            None => Work::Decoding(Box::new(prefill.run(self.model, &mut cache, drafter.as_mut())?)),
        };
        let id = self.next_id;
        self.next_id += 1;
        self.members.push(Member {
            id,
            work,
            cache,
            drafter,
            last_rows: 0,
        });
        Ok(id)
    }

    /// Ends sequence `id` where it is ([`FinishReason::Halted`](super::step::FinishReason::Halted));
    /// `None` when it is not in the batch.
    pub fn cancel(&mut self, id: SequenceId) -> Option<Generation> {
        let i = self.members.iter().position(|m| m.id == id)?;
        let m = self.members.remove(i);
        Some(self.retire(m))
    }

    /// One step: hands every sequence's committed tokens to `on_token(id, token)`, removes the sequences
    /// that ended (returned with their generation, or the error that ended them: an `on_token` error
    /// other than [`Halt`](super::step::Halt) ends only its own sequence), then runs one forward pass
    /// over the blocks of the others (and the next chunks of the prompts going in) and verifies each.
    pub fn step(
        &mut self,
        on_token: &mut dyn FnMut(SequenceId, u32) -> Result<()>,
    ) -> Result<Vec<(SequenceId, Result<Generation>)>> {
        let mut ended = Vec::new();
        let mut i = 0;
        while i < self.members.len() {
            let m = &mut self.members[i];
            let id = m.id;
            let Work::Decoding(seq) = &mut m.work else {
                i += 1;
                continue;
            };
            match seq.emit(&mut |t| on_token(id, t)) {
                Ok(None) => i += 1,
                Ok(Some(_)) => {
                    let m = self.members.remove(i);
                    ended.push((id, Ok(self.retire(m))));
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
        let planned = self.plan()?;
        let t = Instant::now();
        let mut inputs: Vec<SequenceBlock> = Vec::with_capacity(planned.len());
        for (p, m) in planned.iter().zip(self.members.iter_mut()) {
            let (x, positions, mask) = match p {
                Planned::Nothing => continue,
                Planned::Prefill(c) => (&c.x, &c.positions, &c.mask),
                Planned::Decode(b) => (&b.x, &b.positions, &b.mask),
            };
            inputs.push(SequenceBlock {
                x,
                positions,
                mask,
                cache: &mut m.cache,
            });
        }
        let mut hidden = model.forward_batch(&mut inputs)?.into_iter();
        drop(inputs);
        let forward_seconds = t.elapsed().as_secs_f64();
        let hidden: Vec<Option<Tensor>> = planned
            .iter()
            .map(|p| match p {
                Planned::Nothing => None,
                _ => hidden.next(),
            })
            .collect();
        let mut first = self.first_projections(&planned, &hidden)?.into_iter();
        for ((m, p), h) in self.members.iter_mut().zip(planned).zip(&hidden) {
            let Some(h) = h else { continue };
            match (p, &mut m.work) {
                (Planned::Decode(block), Work::Decoding(seq)) => {
                    let f = first.next();
                    seq.verify(
                        model,
                        &mut m.cache,
                        m.drafter.as_mut(),
                        block,
                        h,
                        forward_seconds,
                        f,
                    )?;
                }
                (Planned::Prefill(chunk), Work::Prefilling(prefill)) => {
                    if let Some(seq) = prefill.advance(model, &mut m.cache, m.drafter.as_mut(), chunk, h)? {
                        m.work = Work::Decoding(Box::new(seq));
                    }
                }
                _ => unreachable!("a member's plan follows its work"),
            }
        }
        Ok(ended)
    }

    /// Every member's part of the next forward pass: a decoding sequence's block; a prompt's next chunk,
    /// the prompts that joined first first, within the prefill chunk while others decode (whole while
    /// none does).
    fn plan(&mut self) -> Result<Vec<Planned>> {
        let model = self.model;
        let decoding = self
            .members
            .iter()
            .filter(|m| matches!(m.work, Work::Decoding(_)))
            .count();
        let mut prefill_rows = match self.prefill_chunk {
            Some(rows) if decoding > 0 => rows,
            _ => usize::MAX,
        };
        // The rows of the step before stand for the others' rows in this one (a decoding sequence sends
        // one at least).
        let rows_of = |m: &Member| match m.work {
            Work::Decoding(_) => m.last_rows.max(1),
            Work::Prefilling(_) => m.last_rows,
        };
        let all_rows: usize = self.members.iter().map(rows_of).sum();
        let mut planned = Vec::with_capacity(self.members.len());
        for m in self.members.iter_mut() {
            let rows = rows_of(m);
            let p = match &mut m.work {
                Work::Decoding(seq) => {
                    m.drafter.beside(Beside {
                        rows: all_rows - rows,
                        sequences: decoding - 1,
                    });
                    Planned::Decode(seq.plan(model, &m.cache, m.drafter.as_mut())?)
                }
                Work::Prefilling(_) if prefill_rows == 0 => Planned::Nothing,
                Work::Prefilling(prefill) => {
                    let chunk = prefill.chunk(model, m.drafter.as_ref(), prefill_rows)?;
                    prefill_rows = prefill_rows.saturating_sub(prefill.left().min(prefill_rows));
                    Planned::Prefill(chunk)
                }
            };
            m.last_rows = match &p {
                Planned::Nothing => 0,
                Planned::Prefill(c) => c.positions.len(),
                Planned::Decode(b) => b.positions.len(),
            };
            planned.push(p);
        }
        Ok(planned)
    }

    /// Every decoding sequence's first vocabulary projection ([`Block::first_rows`]) as one product over
    /// all their rows, in member order.
    fn first_projections(&self, planned: &[Planned], hidden: &[Option<Tensor>]) -> Result<Vec<Prefetched>> {
        let mut rows: Vec<Vec<usize>> = Vec::new();
        let mut decoded: Vec<&Tensor> = Vec::new();
        for ((p, h), m) in planned.iter().zip(hidden).zip(&self.members) {
            if let (Planned::Decode(b), Some(h)) = (p, h) {
                rows.push(b.first_rows(m.drafter.as_ref()));
                decoded.push(h);
            }
        }
        if decoded.is_empty() {
            return Ok(Vec::new());
        }
        let t = Instant::now();
        let mut all = Vec::new();
        let mut start = 0;
        for (r, h) in rows.iter().zip(&decoded) {
            all.extend(r.iter().map(|&row| start + row));
            start += h.dim(0)?;
        }
        let stacked = Tensor::cat(&decoded, 0)?;
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

impl Batch<'_> {
    /// The generation of `m`, where it is; its cache kept when caches are.
    fn retire(&mut self, mut m: Member) -> Generation {
        match m.work {
            Work::Decoding(seq) => {
                let mut tokens = seq.history().to_vec();
                let generation = seq.finish(&mut m.cache);
                if let Some(retired) = &mut self.retired {
                    tokens.truncate(m.cache.len());
                    retired.push(Retired {
                        tokens,
                        cache: m.cache,
                    });
                }
                generation
            }
            Work::Prefilling(prefill) => prefill.abandon(),
        }
    }
}

#[cfg(test)]
#[path = "batch_tests.rs"]
mod tests;
