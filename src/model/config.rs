//! One `ModelConfig` for every supported checkpoint, read from an HF `config.json` or from GGUF metadata.
//!
//! LLaMA 3 (SmolLM2 included) and Qwen 3 are the same decoder with a few switches: per-head q/k RMSNorm,
//! an explicit head dimension, and the RoPE frequency schedule.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file;
use std::collections::HashMap;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Qwen3,
}

impl Arch {
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "llama" | "LlamaForCausalLM" => Ok(Arch::Llama),
            "qwen3" | "Qwen3ForCausalLM" => Ok(Arch::Qwen3),
            other => bail!("unsupported architecture '{other}' (supported: llama, qwen3)"),
        }
    }
}

/// Largest vocabulary a config may declare.
const MAX_VOCAB: usize = 1 << 22;
/// Largest hidden or intermediate size a config may declare.
const MAX_WIDTH: usize = 1 << 18;
/// Largest layer count, head count or head dimension a config may declare.
const MAX_COUNT: usize = 1 << 12;
/// Largest context length a config may declare (the RoPE tables are allocated for all of it).
const MAX_POSITIONS: usize = 1 << 20;

/// `hidden / heads` for configs without an explicit head dimension: defined only when it divides evenly.
fn derived_head_dim(hidden: usize, heads: usize) -> Result<usize> {
    if heads == 0 || !hidden.is_multiple_of(heads) {
        bail!(
            "invalid config: no explicit head dimension, and the hidden size {hidden} is not a multiple of \
             the attention head count {heads}"
        );
    }
    Ok(hidden / heads)
}

/// LLaMA 3.1's long-context RoPE rescaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Debug, Clone, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub arch: Arch,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub rope_scaling: Option<Llama3RopeScaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Per-head RMSNorm on queries and keys before RoPE (Qwen 3).
    pub fn qk_norm(&self) -> bool {
        self.arch == Arch::Qwen3
    }

    /// Parses a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str) -> Result<Self> {
        let v: serde_json::Value = serde_json::from_str(text).context("config.json is not valid JSON")?;
        let arch_name = v["model_type"]
            .as_str()
            .or_else(|| v["architectures"][0].as_str())
            .context("config.json names no model_type")?;
        let arch = Arch::parse(arch_name)?;
        let req = |k: &str| -> Result<usize> {
            v[k].as_u64()
                .map(|x| x as usize)
                .with_context(|| format!("config.json's '{k}' is missing or not a non-negative integer"))
        };
        let hidden_size = req("hidden_size")?;
        let num_heads = req("num_attention_heads")?;
        let num_kv_heads = v["num_key_value_heads"]
            .as_u64()
            .map(|x| x as usize)
            .unwrap_or(num_heads);
        let head_dim = match v.get("head_dim") {
            None | Some(serde_json::Value::Null) => derived_head_dim(hidden_size, num_heads)?,
            Some(h) => h
                .as_u64()
                .map(|x| x as usize)
                .context("config.json's 'head_dim' is not a non-negative integer")?,
        };
        let rope_scaling = match v.get("rope_scaling") {
            Some(rs) if rs.is_object() => {
                let kind = rs["rope_type"]
                    .as_str()
                    .or_else(|| rs["type"].as_str())
                    .unwrap_or("default");
                match kind {
                    "llama3" => Some(Llama3RopeScaling {
                        factor: rs["factor"]
                            .as_f64()
                            .context("config.json's rope_scaling.factor is missing or not a number")?
                            as f32,
                        low_freq_factor: rs["low_freq_factor"].as_f64().unwrap_or(1.0) as f32,
                        high_freq_factor: rs["high_freq_factor"].as_f64().unwrap_or(4.0) as f32,
                        original_max_position_embeddings: rs["original_max_position_embeddings"]
                            .as_u64()
                            .unwrap_or(8192)
                            as usize,
                    }),
                    "default" => None,
                    other => bail!("unsupported rope_scaling type '{other}' (supported: llama3, default)"),
                }
            }
            _ => None,
        };
        let eos_token_ids = match &v["eos_token_id"] {
            serde_json::Value::Number(n) => vec![n.as_u64().unwrap_or(0) as u32],
            serde_json::Value::Array(a) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
            _ => vec![],
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: req("vocab_size")?,
            hidden_size,
            intermediate_size: req("intermediate_size")?,
            num_layers: req("num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: v["rms_norm_eps"].as_f64().unwrap_or(1e-6),
            rope_theta: v["rope_theta"].as_f64().unwrap_or(10_000.0) as f32,
            rope_scaling,
            max_position_embeddings: v["max_position_embeddings"].as_u64().unwrap_or(4096) as usize,
            tie_word_embeddings: v["tie_word_embeddings"].as_bool().unwrap_or(false),
            attention_bias: v["attention_bias"].as_bool().unwrap_or(false),
            bos_token_id: v["bos_token_id"].as_u64().map(|x| x as u32),
            eos_token_ids,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads the `{arch}.*` keys llama.cpp writes. `vocab_size` comes from the embedding tensor's shape,
    /// which the caller passes, and tied embeddings from the absence of `output.weight`.
    pub fn from_gguf(
        md: &HashMap<String, gguf_file::Value>,
        vocab_size: usize,
        tie_word_embeddings: bool,
    ) -> Result<Self> {
        let arch_name = md
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .context("GGUF metadata lacks general.architecture")?
            .clone();
        let arch = Arch::parse(&arch_name)?;
        let get = |k: &str| md.get(&format!("{arch_name}.{k}"));
        let req_u = |k: &str| -> Result<usize> {
            get(k)
                .and_then(|v| v.to_u64().ok().or_else(|| v.to_u32().ok().map(u64::from)))
                .map(|x| x as usize)
                .with_context(|| format!("GGUF metadata lacks {arch_name}.{k}"))
        };
        let hidden_size = req_u("embedding_length")?;
        let num_heads = req_u("attention.head_count")?;
        let num_kv_heads = req_u("attention.head_count_kv").unwrap_or(num_heads);
        let head_dim = match get("attention.key_length") {
            None => derived_head_dim(hidden_size, num_heads)?,
            Some(_) => req_u("attention.key_length")?,
        };
        let tok_u32 = |k: &str| md.get(k).and_then(|v| v.to_u32().ok());
        let cfg = ModelConfig {
            arch,
            vocab_size,
            hidden_size,
            intermediate_size: req_u("feed_forward_length")?,
            num_layers: req_u("block_count")?,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: get("attention.layer_norm_rms_epsilon")
                .and_then(|v| v.to_f32().ok())
                .unwrap_or(1e-6) as f64,
            rope_theta: get("rope.freq_base")
                .and_then(|v| v.to_f32().ok())
                .unwrap_or(10_000.0),
            // llama.cpp stores LLaMA 3.1 scaling as a `rope_freqs.weight` tensor; the loader applies it.
            rope_scaling: None,
            max_position_embeddings: req_u("context_length").unwrap_or(4096),
            tie_word_embeddings,
            attention_bias: false,
            bos_token_id: tok_u32("tokenizer.ggml.bos_token_id"),
            eos_token_ids: tok_u32("tokenizer.ggml.eos_token_id").into_iter().collect(),
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        // Sizes far beyond any real checkpoint: a corrupt file, refused before anything is allocated.
        for (what, n, max) in [
            ("vocabulary size", self.vocab_size, MAX_VOCAB),
            ("hidden size", self.hidden_size, MAX_WIDTH),
            ("intermediate size", self.intermediate_size, MAX_WIDTH),
            ("layer count", self.num_layers, MAX_COUNT),
            ("attention head count", self.num_heads, MAX_COUNT),
            ("key/value head count", self.num_kv_heads, MAX_COUNT),
            ("head dimension", self.head_dim, MAX_COUNT),
            ("context length", self.max_position_embeddings, MAX_POSITIONS),
        ] {
            if n > max {
                bail!("invalid config: {what} {n} is larger than {max}");
            }
        }
        if self.intermediate_size == 0 || self.max_position_embeddings == 0 {
            bail!(
                "invalid config: intermediate size {} and context length {} must be positive",
                self.intermediate_size,
                self.max_position_embeddings
            );
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            bail!(
                "invalid config: rms_norm_eps {} is not a non-negative number",
                self.rms_norm_eps
            );
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            bail!(
                "invalid config: rope_theta {} is not a positive number",
                self.rope_theta
            );
        }
        if self.num_heads == 0 || self.num_kv_heads == 0 || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            bail!(
                "invalid head counts: {} attention heads, {} key/value heads",
                self.num_heads,
                self.num_kv_heads
            );
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            bail!("invalid head dimension {}", self.head_dim);
        }
        if self.vocab_size == 0 || self.hidden_size == 0 || self.num_layers == 0 {
            bail!("config has a zero vocab_size, hidden_size or layer count");
        }
        Ok(())
    }

    /// RoPE inverse frequencies, with LLaMA 3 scaling applied when configured.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let d = self.head_dim;
        let base: Vec<f32> = (0..d)
            .step_by(2)
            .map(|i| 1.0 / self.rope_theta.powf(i as f32 / d as f32))
            .collect();
        let Some(s) = &self.rope_scaling else { return base };
        let low_wavelen = s.original_max_position_embeddings as f32 / s.low_freq_factor;
        let high_wavelen = s.original_max_position_embeddings as f32 / s.high_freq_factor;
        base.into_iter()
            .map(|freq| {
                let wavelen = 2.0 * std::f32::consts::PI / freq;
                if wavelen < high_wavelen {
                    freq
                } else if wavelen > low_wavelen {
                    freq / s.factor
                } else {
                    let smooth = (s.original_max_position_embeddings as f32 / wavelen - s.low_freq_factor)
                        / (s.high_freq_factor - s.low_freq_factor);
                    (1.0 - smooth) * freq / s.factor + smooth * freq
                }
            })
            .collect()
    }
}
