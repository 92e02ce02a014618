//! A checkpoint as loading takes and gives it: the options that decide how weights land in memory, and
//! the loaded model with its tokenizer. Shared by the GGUF and safetensors loaders.

use super::Transformer;
use crate::tokenizer::TextTokenizer;
use anyhow::{bail, Result};
use candle_core::{DType, Device};

/// Options that decide how weights land in memory.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    pub dtype: DType,
    /// Dequantise GGUF weights to dense `dtype` at load even where the CPU block kernels could read them
    /// in place: the numbers of `Activations::F32` (that block kernel is bit-identical to the dense
    /// one), 4-7x the memory traffic per token. For comparisons.
    pub dequantize: bool,
    /// How the CPU multiplies GGUF quantised weights (ignored for dense weights and on GPUs).
    pub activations: Activations,
}

/// The activations GGUF quantised weights are multiplied with on the CPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Activations {
    /// Quantised per row to 8 bits in blocks of 32, products in integers (Q4_0, Q4_1, Q8_0, Q4_K,
    /// Q5_K, Q6_K; other types as with `F32`): about twice as fast as f32, numbers within the
    /// activation rounding of f32's. Row-invariant like every CPU path.
    #[default]
    Q8,
    /// f32: Q4_0 / Q4_1 / Q8_0 bit-identical to the dense f32 kernel on the dequantised weights (and to
    /// `dequantize`); other quantised types dequantised at load up to 1B parameters, else candle's
    /// quantised matmul.
    F32,
}

pub struct LoadedModel {
    pub model: Transformer,
    pub tokenizer: TextTokenizer,
    pub description: String,
}

/// The tokenizer must not produce ids the embedding table lacks.
pub(super) fn check_vocab(model: &Transformer, tok: &TextTokenizer) -> Result<()> {
    let (m, t) = (model.config.vocab_size, tok.vocab_size());
    if t > m {
        bail!("tokenizer vocabulary ({t} tokens) does not fit the model's embedding table ({m} rows)");
    }
    Ok(())
}
