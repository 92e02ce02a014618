//! Random-weight models of real shapes (Qwen 3 0.6B / 4B / 8B, LLaMA 3.2 1B / 3B, LLaMA 3.1 8B, SmolLM2
//! 135M).
//!
//! The cost of a forward pass depends on the shapes, not on the values of the weights, so the cost curve
//! of a model that cannot be downloaded (no machine here reaches a hub) can still be measured on any
//! device: `probespec cost --shape llama3-8b --device cuda`, or written as a GGUF file by `probespec
//! shape-gguf` (`shape_gguf`). The configurations are the published `config.json` values of those
//! checkpoints, parsed by the same code as a real checkpoint's.

use super::{Layer, Linear, ModelConfig, RmsNorm, Transformer, Weight};
use anyhow::{bail, Result};
use candle_core::{DType, Device, Tensor};

/// LLaMA 3.1 8B (Meta-Llama-3.1-8B's config.json); `llama3-8b` and `llama3.1-8b` name it.
const LLAMA31_8B: &str = r#"{"model_type": "llama", "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": false, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}"#;

/// Shapes known by name, with their `config.json` essentials.
const SHAPES: [(&str, &str); 8] = [
    ("llama3-8b", LLAMA31_8B),
    ("llama3.1-8b", LLAMA31_8B),
    (
        "llama3.2-1b",
        r#"{"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "tie_word_embeddings": true, "bos_token_id": 128000, "eos_token_id": 128001}"#,
    ),
    (
        "llama3.2-3b",
        r#"{"model_type": "llama", "vocab_size": 128256, "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rope_scaling": {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 8192, "rope_type": "llama3"},
            "tie_word_embeddings": true, "bos_token_id": 128000, "eos_token_id": 128001}"#,
    ),
    (
        "qwen3-0.6b",
        r#"{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
            "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
            "tie_word_embeddings": true, "attention_bias": false, "bos_token_id": 151643,
            "eos_token_id": 151645}"#,
    ),
    (
        "qwen3-4b",
        r#"{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 2560, "intermediate_size": 9728,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
            "tie_word_embeddings": true, "attention_bias": false, "bos_token_id": 151643,
            "eos_token_id": 151645}"#,
    ),
    (
        "qwen3-8b",
        r#"{"model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rms_norm_eps": 1e-6, "rope_theta": 1000000, "max_position_embeddings": 40960,
            "tie_word_embeddings": false, "attention_bias": false, "bos_token_id": 151643,
            "eos_token_id": 151645}"#,
    ),
    (
        "smollm2-135m",
        r#"{"model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
            "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
            "rms_norm_eps": 1e-5, "rope_theta": 100000, "max_position_embeddings": 8192,
            "tie_word_embeddings": true, "bos_token_id": 1, "eos_token_id": 2}"#,
    ),
];

/// Names accepted by [`shape_config`].
pub fn shape_names() -> Vec<&'static str> {
    SHAPES.iter().map(|(n, _)| *n).collect()
}

/// The configuration of a named shape.
pub fn shape_config(name: &str) -> Result<ModelConfig> {
    match SHAPES.iter().find(|(n, _)| *n == name) {
        Some((_, json)) => ModelConfig::from_hf_json(json),
        None => bail!(
            "unknown model shape '{name}' (known: {})",
            shape_names().join(", ")
        ),
    }
}

/// A model of `config`'s shape with weights drawn from N(0, 0.02²) (norm weights 1), created directly on
/// `device` in `dtype`.
pub fn random_model(config: ModelConfig, device: &Device, dtype: DType) -> Result<Transformer> {
    let randn = |rows: usize, cols: usize| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 0.02, (rows, cols), device)?.to_dtype(dtype)?)
    };
    let eps = config.rms_norm_eps;
    model_of(
        config,
        |rows, cols| Ok(Linear::new(Weight::Dense(randn(rows, cols)?), None)),
        |n| Ok(RmsNorm::new(Tensor::ones(n, dtype, device)?, eps)),
        randn,
    )
}

/// A model of `config`'s shape from its parts' makers: `lin(rows, cols)` a projection, `norm(n)` an
/// RMSNorm, `embed(vocab, hidden)` the embedding table (shared with the output projection when tied).
pub(crate) fn model_of(
    config: ModelConfig,
    lin: impl Fn(usize, usize) -> Result<Linear>,
    norm: impl Fn(usize) -> Result<RmsNorm>,
    embed: impl Fn(usize, usize) -> Result<Tensor>,
) -> Result<Transformer> {
    let c = &config;
    let (d, hd) = (c.hidden_size, c.head_dim);
    let mut layers = Vec::with_capacity(c.num_layers);
    for _ in 0..c.num_layers {
        layers.push(Layer {
            attn_norm: norm(d)?,
            q_proj: lin(c.num_heads * hd, d)?,
            k_proj: lin(c.num_kv_heads * hd, d)?,
            v_proj: lin(c.num_kv_heads * hd, d)?,
            o_proj: lin(d, c.num_heads * hd)?,
            q_norm: if c.qk_norm() { Some(norm(hd)?) } else { None },
            k_norm: if c.qk_norm() { Some(norm(hd)?) } else { None },
            mlp_norm: norm(d)?,
            gate_proj: lin(c.intermediate_size, d)?,
            up_proj: lin(c.intermediate_size, d)?,
            down_proj: lin(d, c.intermediate_size)?,
        });
    }
    let embed = embed(c.vocab_size, d)?;
    let lm_head = if c.tie_word_embeddings {
        Linear::new(Weight::Dense(embed.clone()), None)
    } else {
        lin(c.vocab_size, d)?
    };
    let final_norm = norm(d)?;
    Transformer::new(config, embed.into(), layers, final_norm, lm_head, None)
}

/// A small model of `shape`'s kind (Qwen 3's per-head norms, or LLaMA's plain heads) with random packed
/// weights in `format` (the output projection too) and random norm weights: what the flat layers run.
#[cfg(test)]
pub(crate) fn packed_model(shape: &str, format: candle_core::quantized::GgmlDType) -> Result<Transformer> {
    use crate::kernels::{PackedFormat, PackedMatrix};
    use candle_core::quantized::QTensor;
    use std::sync::Arc;
    let mut c = shape_config(shape)?;
    (c.hidden_size, c.intermediate_size, c.num_layers, c.head_dim) = (256, 512, 3, 32);
    (
        c.num_heads,
        c.num_kv_heads,
        c.vocab_size,
        c.max_position_embeddings,
    ) = (8, 2, 300, 128);
    c.tie_word_embeddings = false;
    let (dev, eps) = (Device::Cpu, c.rms_norm_eps);
    model_of(
        c,
        |rows, cols| {
            let w = Tensor::randn(0f32, 0.05, (rows, cols), &dev)?;
            let q = QTensor::quantize(&w, format)?;
            let f = PackedFormat::of_ggml(format).expect("a packed format");
            let p = PackedMatrix::from_gguf(f, rows, cols, &q.data()?, None)?;
            Ok(Linear::new(Weight::Packed(Arc::new(p)), None))
        },
        |n| Ok(RmsNorm::new(Tensor::rand(0.5f32, 1.5, n, &dev)?, eps)),
        |rows, cols| Ok(Tensor::randn(0f32, 1.0, (rows, cols), &dev)?),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::BlockMask;

    #[test]
    fn known_shapes_parse_with_their_published_sizes() -> Result<()> {
        let l = shape_config("llama3-8b")?;
        assert_eq!(
            (l.num_layers, l.hidden_size, l.head_dim, l.num_kv_heads),
            (32, 4096, 128, 8)
        );
        assert!(l.rope_scaling.is_some() && !l.tie_word_embeddings);
        let q = shape_config("qwen3-8b")?;
        assert!(q.qk_norm());
        assert_eq!(
            (q.num_layers, q.intermediate_size, q.vocab_size),
            (36, 12288, 151936)
        );
        // The small shapes, against their published config.json values.
        for (name, layers, hidden, ff, heads, kv, hd, tied) in [
            ("qwen3-0.6b", 28, 1024, 3072, 16, 8, 128, true),
            ("qwen3-4b", 36, 2560, 9728, 32, 8, 128, true),
            ("llama3.2-1b", 16, 2048, 8192, 32, 8, 64, true),
            ("llama3.2-3b", 28, 3072, 8192, 24, 8, 128, true),
            ("llama3.1-8b", 32, 4096, 14336, 32, 8, 128, false),
        ] {
            let c = shape_config(name)?;
            assert_eq!(
                (
                    c.num_layers,
                    c.hidden_size,
                    c.intermediate_size,
                    c.num_heads,
                    c.num_kv_heads
                ),
                (layers, hidden, ff, heads, kv),
                "{name}"
            );
            assert_eq!((c.head_dim, c.tie_word_embeddings), (hd, tied), "{name}");
            let llama = name.starts_with("llama");
            assert_eq!(c.vocab_size, if llama { 128256 } else { 151936 }, "{name}");
            assert_eq!(c.rope_theta, if llama { 500000.0 } else { 1e6 }, "{name}");
            let factor = c.rope_scaling.as_ref().map(|s| s.factor);
            let want = if name == "llama3.1-8b" {
                Some(8.0)
            } else if llama {
                Some(32.0)
            } else {
                None
            };
            assert_eq!(factor, want, "{name}");
        }
        let e = shape_config("gpt-9").unwrap_err().to_string();
        assert!(e.contains("llama3-8b") && e.contains("gpt-9"), "{e}");
        Ok(())
    }

    #[test]
    fn a_random_model_runs_a_block() -> Result<()> {
        let mut c = shape_config("qwen3-8b")?;
        (c.hidden_size, c.intermediate_size, c.num_layers, c.head_dim) = (64, 96, 2, 16);
        (
            c.num_heads,
            c.num_kv_heads,
            c.vocab_size,
            c.max_position_embeddings,
        ) = (4, 2, 100, 64);
        let m = random_model(c, &Device::Cpu, DType::F32)?;
        let mut cache = m.new_cache(16)?;
        let h = m.forward(&m.embed(&[1, 2, 3])?, &[0, 1, 2], &BlockMask::Causal, &mut cache)?;
        let logits = m.logits(&h, &[2])?;
        assert_eq!(logits.dims(), &[1, 100]);
        assert!(logits.to_vec2::<f32>()?[0].iter().all(|v| v.is_finite()));
        Ok(())
    }
}
