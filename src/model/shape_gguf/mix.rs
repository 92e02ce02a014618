//! Which ggml type each tensor gets in a file of a given quantisation mix, by the rules of llama.cpp's
//! `llama-quantize` (`src/llama-quant.cpp`, `llama_tensor_get_type_impl`), for a dense LLaMA / Qwen 3
//! model without an importance matrix:
//!
//! - one-dimensional tensors (norms, `rope_freqs`) stay F32;
//! - the output matrix (`output.weight`, or `token_embd.weight` when the embeddings are tied) is Q6_K,
//!   unless the mix is Q8_0 (then Q8_0);
//! - Q4_K_M: Q4_K, except `attn_v` and `ffn_down` in the "more bits" layers, which are Q6_K: layer `i` of
//!   `n` when `i < n/8`, `i >= 7n/8`, or `(i - n/8) % 3 == 2`;
//! - Q4_0 and Q8_0: that type for every other matrix;
//! - a matrix whose row length is not a multiple of the chosen type's block falls back as llama.cpp's
//!   does (Q4_K -> Q5_0, Q6_K -> Q8_0, then F16).

use anyhow::{bail, Result};
use candle_core::quantized::GgmlDType;

/// A file type of `llama-quantize`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMix {
    Q4KM,
    Q4_0,
    Q8_0,
}

/// What a tensor is, as far as the mix cares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Norm weights and RoPE factors.
    Vector,
    TokenEmbedding,
    Output,
    AttnV {
        layer: usize,
    },
    FfnDown {
        layer: usize,
    },
    /// Any other weight matrix (q, k, attention output, gate, up).
    Matrix,
}

impl QuantMix {
    pub const NAMES: [&'static str; 3] = ["q4_k_m", "q4_0", "q8_0"];

    pub fn parse(s: &str) -> Result<Self> {
        Ok(match s.to_ascii_lowercase().as_str() {
            "q4_k_m" => QuantMix::Q4KM,
            "q4_0" => QuantMix::Q4_0,
            "q8_0" => QuantMix::Q8_0,
            other => bail!("unknown format '{other}' (known: {})", Self::NAMES.join(", ")),
        })
    }

    /// The lower-case name used in file names.
    pub fn name(self) -> &'static str {
        match self {
            QuantMix::Q4KM => "q4_k_m",
            QuantMix::Q4_0 => "q4_0",
            QuantMix::Q8_0 => "q8_0",
        }
    }

    /// `general.file_type`: llama.cpp's `llama_ftype` (MOSTLY_Q4_0 = 2, MOSTLY_Q8_0 = 7,
    /// MOSTLY_Q4_K_M = 15).
    pub fn file_type(self) -> u32 {
        match self {
            QuantMix::Q4KM => 15,
            QuantMix::Q4_0 => 2,
            QuantMix::Q8_0 => 7,
        }
    }

    fn default_type(self) -> GgmlDType {
        match self {
            QuantMix::Q4KM => GgmlDType::Q4K,
            QuantMix::Q4_0 => GgmlDType::Q4_0,
            QuantMix::Q8_0 => GgmlDType::Q8_0,
        }
    }

    /// The type of a tensor of `role` whose rows are `cols` long, in a model of `n_layers` layers whose
    /// output matrix is the token embedding when `tied`.
    pub fn tensor_type(self, role: Role, cols: usize, n_layers: usize, tied: bool) -> Result<GgmlDType> {
        let more_bits = |i: usize| {
            // In llama.cpp's int arithmetic: `(i - n/8) % 3` truncates towards zero for negative values.
            let (i, n) = (i as i64, n_layers as i64);
            i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
        };
        let base = self.default_type();
        let chosen = match role {
            Role::Vector => return Ok(GgmlDType::F32),
            Role::Output | Role::TokenEmbedding if role == Role::Output || tied => {
                // Rows that do not fill the mix's blocks, and Q8_0 files, keep the output in Q8_0.
                if !cols.is_multiple_of(base.block_size()) || base == GgmlDType::Q8_0 {
                    GgmlDType::Q8_0
                } else {
                    GgmlDType::Q6K
                }
            }
            Role::AttnV { layer } | Role::FfnDown { layer } if self == QuantMix::Q4KM && more_bits(layer) => {
                GgmlDType::Q6K
            }
            _ => base,
        };
        fallback(chosen, cols)
    }
}

/// llama.cpp's `tensor_type_fallback` for the types a mix here can choose.
fn fallback(t: GgmlDType, cols: usize) -> Result<GgmlDType> {
    if cols.is_multiple_of(t.block_size()) {
        return Ok(t);
    }
    let next = match t {
        GgmlDType::Q4K => GgmlDType::Q5_0,
        GgmlDType::Q6K => GgmlDType::Q8_0,
        other => bail!(
            "rows of {cols} values cannot be stored as {other:?} (blocks of {}), and llama.cpp defines \
             no fallback for it",
            other.block_size()
        ),
    };
    Ok(if cols.is_multiple_of(next.block_size()) {
        next
    } else {
        GgmlDType::F16
    })
}
