//! The one decoding loop every strategy plugs into.
//!
//! prefill -> loop { emit what the last step committed -> drafter proposes a tree (+ probe rows) -> ONE
//! forward -> accept a path -> keep prefix + root + accepted path in the KV cache -> hand the probes'
//! logits back to the drafter }. The steps' bodies are [`Sequence`](super::sequence::Sequence)'s, which a batch steps the same way
//! beside other sequences; the loop's types are [`super::step`]'s, re-exported here.

pub use super::step::{Beside, Draft, Drafter, FinishReason, GenerateParams, Generation, Halt, Step};
use crate::model::{KvCache, Transformer};
use anyhow::Result;
use std::time::Instant;

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
    let mut seq = super::prefill::start(model, cache, prompt, drafter, params)?;
    while seq.emit(on_token)?.is_none() {
        let block = seq.plan(model, cache, drafter)?;
        let t = Instant::now();
        let hidden = model.forward(&block.x, &block.positions, &block.mask, cache)?;
        let seconds = t.elapsed().as_secs_f64();
        seq.verify(model, cache, drafter, block, &hidden, seconds, None)?;
    }
    Ok(seq.finish(cache))
}
