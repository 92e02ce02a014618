//! The one decoding loop every strategy plugs into.
//!
//! prefill -> loop { drafter proposes a tree (+ probe rows) -> ONE forward -> accept a path -> keep prefix +
//! root + accepted path in the KV cache -> hand the probes' logits back to the drafter }.
//! Verification, cache compaction, stopping rules and statistics are written here once.

use super::kind::MethodKind;
use super::layout::{LayoutCache, Probe};
use super::sampling::{Sampler, SamplingParams};
use super::stats::DecodeStats;
use super::tree::{accept, TokenTree};
use crate::model::{BlockMask, KvCache, Transformer};
use anyhow::{bail, Result};
use candle_core::Tensor;
use serde::{Deserialize, Serialize};
use std::time::Instant;

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
    /// Wall seconds of the step's forward pass and vocabulary projections: what the cost curve prices
    /// (0 after prefill).
    pub seconds: f64,
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

/// Runs one generation. `on_token` sees every committed token as soon as its step ends (streaming); it
/// may end the generation there by returning [`Halt`].
///
/// # Example
///
/// Plain greedy decoding and ESP on the same model give the same tokens, ESP in fewer forward passes when
/// its guesses are accepted:
///
/// ```
/// use probespec::decode::drafters::ar::Autoregressive;
/// use probespec::decode::generate::{generate, FinishReason, GenerateParams};
/// use probespec::decode::method::{Budget, EspSpec, Method};
/// # use candle_core::{DType, Device};
/// # use probespec::model::{synthetic::random_model, ModelConfig};
/// # fn main() -> anyhow::Result<()> {
/// // A tiny LLaMA-shaped model with random weights, built in memory (no checkpoint needed).
/// let config = ModelConfig::from_hf_json(
///     r#"{"model_type": "llama", "vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
///         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
///         "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 256,
///         "tie_word_embeddings": false, "eos_token_id": 2}"#,
/// )?;
/// let model = random_model(config, &Device::Cpu, DType::F32)?;
///
/// let params = GenerateParams {
///     max_new_tokens: 24,
///     sampling: Default::default(), // greedy
///     stop_tokens: vec![],
///     max_block_rows: None,
/// };
/// let prompt = [5, 17, 9, 40, 17, 9];
///
/// let mut streamed = Vec::new();
/// let plain = generate(&model, &prompt, &mut Autoregressive, &params, &mut |t| {
///     streamed.push(t);
///     Ok(())
/// })?;
/// assert_eq!(plain.tokens.len(), 24);
/// assert_eq!(streamed, plain.tokens);
/// assert_eq!(plain.finish_reason, FinishReason::MaxNewTokens);
/// assert_eq!(plain.stats.model_calls, 23); // the prefill gives the first token
///
/// let esp = Method::Esp(EspSpec { budget: Budget::Fixed(30), ..EspSpec::default() });
/// let mut drafter = esp.drafter(0)?;
/// let fast = generate(&model, &prompt, drafter.as_mut(), &params, &mut |_| Ok(()))?;
/// assert_eq!(fast.tokens, plain.tokens); // lossless
/// assert!(fast.stats.model_calls <= plain.stats.model_calls);
/// # Ok(())
/// # }
/// ```
pub fn generate(
    model: &Transformer,
    prompt: &[u32],
    drafter: &mut dyn Drafter,
    params: &GenerateParams,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Generation> {
    let mut cache = model.new_cache(0)?;
    generate_in(model, &mut cache, prompt, drafter, params, on_token)
}

/// [`generate`] over a cache that may already hold the keys and values of a prefix of `prompt` (a
/// conversation's earlier turns): only the rest is prefilled. With the row-invariant CPU kernels that gives
/// the same numbers as prefilling the whole prompt. Afterwards the cache holds a prefix of
/// `prompt + generated tokens` (everything but the tokens never fed back), ready for the next turn.
pub fn generate_in(
    model: &Transformer,
    cache: &mut KvCache,
    prompt: &[u32],
    drafter: &mut dyn Drafter,
    params: &GenerateParams,
    on_token: &mut dyn FnMut(u32) -> Result<()>,
) -> Result<Generation> {
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
    let mut sampler = Sampler::new(params.sampling);
    // Prefill: [prompt not yet cached | prefill probes], plain causal attention. At least the last prompt
    // token is fed: its logits give the first token.
    let probes = drafter.begin(model, prompt)?;
    stats.cost_curve_timed_seconds = super::cost_cache::take_timing(model).unwrap_or(0.0);
    // The prefill's clock starts after the drafter's setup, which on a machine's first run includes
    // timing the cost curve for `--bc auto` (once, then cached): 0.7 s that the stats line showed as
    // prefill of a 37-token prompt.
    let t0 = Instant::now();
    let probes = if prompt.len() + probes <= ctx { probes } else { 0 };
    cache.truncate(prompt.len() - 1);
    let reused = cache.len();
    // Room for the answer and one more block (and the prefill's probes), never more than the context
    // window needs.
    let capacity = prompt
        .len()
        .saturating_add(params.max_new_tokens)
        .saturating_add(256)
        .max(prompt.len() + probes)
        .min(ctx.saturating_add(256));
    cache.reserve(capacity)?;
    let mut x = model.embed(&prompt[reused..])?;
    if probes > 0 {
        let p: Vec<Probe> = (1..=probes).map(|offset| Probe { owner: 0, offset }).collect();
        // Probe vectors are f32; the model's input rows are in its dtype.
        x = Tensor::cat(&[&x, &drafter.probe_inputs(model, &p)?.to_dtype(x.dtype())?], 0)?;
    }
    let positions: Vec<u32> = (reused as u32..(prompt.len() + probes) as u32).collect();
    let hidden = model.forward(&x, &positions, &BlockMask::Causal, cache)?;
    let last = prompt.len() - 1 - reused;
    let rows: Vec<usize> = (last..last + 1 + probes).collect();
    let logits = model.logits(&hidden, &rows)?.to_vec2::<f32>()?;
    cache.truncate(prompt.len());
    let first = sampler.pick(&logits[0]);
    drafter.observe(
        model,
        &Step {
            accepted: &[],
            committed: &[first],
            probe_logits: &logits[1..],
            replaced: false,
            seconds: 0.0,
        },
    )?;
    stats.prefill_seconds = t0.elapsed().as_secs_f64();
    stats.prefill_tokens = prompt.len() - reused;

    let mut history = prompt.to_vec();
    let mut generated: Vec<u32> = Vec::new();
    let mut layouts = LayoutCache::new();
    let mut mask_buf: Vec<f32> = Vec::new();
    let t_decode = Instant::now();

    let mut pending = vec![first];
    let finish_reason = 'outer: loop {
        // Emit what the last step committed, stopping exactly where plain decoding would.
        for (i, &t) in pending.iter().enumerate() {
            generated.push(t);
            history.push(t);
            let halted = match on_token(t) {
                Ok(()) => false,
                Err(e) if e.is::<Halt>() => true,
                Err(e) => return Err(e),
            };
            let reason = if halted {
                FinishReason::Halted
            } else if params.stop_tokens.contains(&t) {
                FinishReason::StopToken
            } else if generated.len() >= params.max_new_tokens {
                FinishReason::MaxNewTokens
            } else if history.len() >= ctx {
                FinishReason::ContextWindow
            } else {
                continue;
            };
            stats.truncate_last_step(i + 1);
            break 'outer reason;
        }
        let root = *history.last().unwrap();
        let p0 = cache.len();
        let room = (ctx - p0).min(cache.capacity() - p0);
        let room = params.max_block_rows.map_or(room, |most| room.min(most.max(1)));

        let t_draft = Instant::now();
        let mut draft = drafter.draft(root, &history, room);
        let mut layout = layouts.get(&draft.tree, &draft.probes);
        let fits = layout.rows <= room && layout.rel_positions.iter().all(|&r| (p0 + r as usize) < ctx);
        let replaced = !fits;
        if replaced {
            draft = Draft::root_only(root);
            layout = layouts.get(&draft.tree, &draft.probes);
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
            layout.additive_mask_into(p0, &mut mask_buf);
            BlockMask::Additive(Tensor::from_slice(
                &mask_buf,
                (layout.rows, p0 + layout.rows),
                &model.device,
            )?)
        };
        stats.draft_seconds += t_draft.elapsed().as_secs_f64();

        let t_fwd = Instant::now();
        let hidden = model.forward(&x, &positions, &mask, cache)?;
        let forward_seconds = t_fwd.elapsed().as_secs_f64();
        stats.forward_seconds += forward_seconds;

        // Walk down the tree computing logits lazily: at each visited node its own row plus the probe rows
        // its owner would hand back, and ahead of need those of its first-child path (the drafter's best
        // guess), up to LOGIT_ROWS rows. A vocabulary projection costs little more for 8 rows than for
        // one, so an accepted path is usually verified with one projection, and a rejected root wastes
        // only a few rows of one.
        let t_verify = Instant::now();
        let mut logits = RowLogits::new(layout.rows);
        let probe_rows_of = |owner: usize| -> Vec<usize> {
            (1..)
                .map_while(|offset| layout.probe_row(owner, offset))
                .collect()
        };
        let (accepted, bonus) = accept(&draft.tree, |cur| -> Result<u32> {
            // A node fetched ahead came with its owner's probe rows: nothing more to compute.
            if !logits.has(cur) {
                let mut rows = Vec::with_capacity(LOGIT_ROWS);
                let mut next = Some(cur);
                while let Some(n) = next {
                    let probes = probe_rows_of(drafter.probe_owner(n));
                    if n != cur && rows.len() + 1 + probes.len() > LOGIT_ROWS {
                        break;
                    }
                    rows.push(n);
                    rows.extend(probes);
                    next = draft.tree.children(n).next();
                }
                logits.fetch(model, &hidden, &rows)?;
            }
            Ok(sampler.pick(logits.row(cur)))
        })?;
        let cur = accepted.last().copied().unwrap_or(0);
        let probe_logits: Vec<Vec<f32>> = probe_rows_of(drafter.probe_owner(cur))
            .into_iter()
            .map(|r| logits.take(r))
            .collect();
        let mut keep = vec![0usize];
        keep.extend(accepted.iter().copied());
        // The vocabulary projections belong to the model's cost, not to the verifier's overhead.
        stats.forward_seconds += logits.seconds;
        stats.verify_seconds += t_verify.elapsed().as_secs_f64() - logits.seconds;

        let t_book = Instant::now();
        cache.keep(p0, &keep)?;
        pending.clear();
        pending.extend(accepted.iter().map(|&n| draft.tree.token(n)));
        pending.push(bonus);
        stats.record_step(pending.len(), draft.tree.len(), layout.rows);
        drafter.observe(
            model,
            &Step {
                accepted: &accepted,
                committed: &pending,
                probe_logits: &probe_logits,
                replaced,
                seconds: forward_seconds + logits.seconds,
            },
        )?;
        stats.bookkeeping_seconds += t_book.elapsed().as_secs_f64();
    };
    // A stop inside an accepted path leaves rows after it in the cache: keep only the history.
    cache.truncate(history.len());
    stats.decode_seconds = t_decode.elapsed().as_secs_f64();
    stats.new_tokens = generated.len();
    stats.finish();
    Ok(Generation {
        tokens: generated,
        stats,
        finish_reason,
    })
}

/// Most rows of one vocabulary projection while verifying (defined beside the cost model, which prices
/// it, so that the cost modules do not import the loop).
pub use super::cost_curve::LOGIT_ROWS;

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
