//! HF checkpoint folders: `config.json`, `model.safetensors` (or its shards) and the tokenizer files,
//! built into the transformer.

use super::checkpoint::{check_vocab, LoadOptions, LoadedModel};
use super::{Layer, Linear, ModelConfig, RmsNorm, Transformer, Weight};
use crate::tokenizer::TextTokenizer;
use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use candle_nn::VarBuilder;
use std::path::Path;

/// Shard file names listed in a `model.safetensors.index.json`.
pub(super) fn shard_files(index: &Path) -> Result<Vec<String>> {
    let text = std::fs::read_to_string(index).with_context(|| format!("cannot read {}", index.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", index.display()))?;
    let map = v["weight_map"]
        .as_object()
        .with_context(|| format!("{} has no weight_map", index.display()))?;
    let mut files: Vec<String> = map
        .values()
        .filter_map(|s| s.as_str().map(String::from))
        .collect();
    files.sort();
    files.dedup();
    Ok(files)
}

pub(super) fn load_hf_dir(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
    let cfg_path = dir.join("config.json");
    if !cfg_path.is_file() {
        bail!("{} is not a model folder: config.json not found", dir.display());
    }
    let cfg_text =
        std::fs::read_to_string(&cfg_path).with_context(|| format!("cannot read {}", cfg_path.display()))?;
    let config =
        ModelConfig::from_hf_json(&cfg_text).with_context(|| format!("in {}", cfg_path.display()))?;
    let files = if dir.join("model.safetensors.index.json").is_file() {
        shard_files(&dir.join("model.safetensors.index.json"))?
            .into_iter()
            .map(|f| dir.join(f))
            .collect()
    } else if dir.join("model.safetensors").is_file() {
        vec![dir.join("model.safetensors")]
    } else {
        bail!(
            "{}: no model.safetensors or model.safetensors.index.json",
            dir.display()
        );
    };
    for f in &files {
        if !f.is_file() {
            bail!("missing weight shard {}", f.display());
        }
    }
    let tokenizer = TextTokenizer::from_hf_dir(dir)?;
    // SAFETY: the files are memory-mapped read-only; like every mmap loader we rely on nobody rewriting
    // them while the process runs.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&files, opts.dtype, &opts.device) }
        .map_err(|e| anyhow::anyhow!("cannot read safetensors in {}: {e}", dir.display()))?;
    let model = build_from_safetensors(config, &vb)
        .with_context(|| format!("loading weights from {}", dir.display()))?;
    check_vocab(&model, &tokenizer)?;
    Ok(LoadedModel {
        model,
        tokenizer,
        description: dir.display().to_string(),
    })
}

fn build_from_safetensors(config: ModelConfig, vb: &VarBuilder) -> Result<Transformer> {
    let c = &config;
    let get = |shape: (usize, usize), name: &str| -> Result<Tensor> {
        vb.get(shape, name)
            .map_err(|e| anyhow::anyhow!("tensor {name}: {e}"))
    };
    let get1 = |n: usize, name: &str| -> Result<Tensor> {
        vb.get(n, name).map_err(|e| anyhow::anyhow!("tensor {name}: {e}"))
    };
    let lin = |out: usize, inp: usize, name: &str, bias: bool| -> Result<Linear> {
        let w = get((out, inp), &format!("{name}.weight"))?;
        let b = if bias {
            Some(get1(out, &format!("{name}.bias"))?)
        } else {
            None
        };
        Ok(Linear::new(Weight::Dense(w), b))
    };
    let (d, hd) = (c.hidden_size, c.head_dim);
    let embed = get((c.vocab_size, d), "model.embed_tokens.weight")?;
    let mut layers = Vec::with_capacity(c.num_layers);
    for i in 0..c.num_layers {
        let p = format!("model.layers.{i}");
        let qk_norm = |which: &str| -> Result<Option<RmsNorm>> {
            Ok(if c.qk_norm() {
                Some(RmsNorm::new(
                    get1(hd, &format!("{p}.self_attn.{which}.weight"))?,
                    c.rms_norm_eps,
                ))
            } else {
                None
            })
        };
        layers.push(Layer {
            attn_norm: RmsNorm::new(get1(d, &format!("{p}.input_layernorm.weight"))?, c.rms_norm_eps),
            q_proj: lin(
                c.num_heads * hd,
                d,
                &format!("{p}.self_attn.q_proj"),
                c.attention_bias,
            )?,
            k_proj: lin(
                c.num_kv_heads * hd,
                d,
                &format!("{p}.self_attn.k_proj"),
                c.attention_bias,
            )?,
            v_proj: lin(
                c.num_kv_heads * hd,
                d,
                &format!("{p}.self_attn.v_proj"),
                c.attention_bias,
            )?,
            o_proj: lin(d, c.num_heads * hd, &format!("{p}.self_attn.o_proj"), false)?,
            q_norm: qk_norm("q_norm")?,
            k_norm: qk_norm("k_norm")?,
            mlp_norm: RmsNorm::new(
                get1(d, &format!("{p}.post_attention_layernorm.weight"))?,
                c.rms_norm_eps,
            ),
            gate_proj: lin(c.intermediate_size, d, &format!("{p}.mlp.gate_proj"), false)?,
            up_proj: lin(c.intermediate_size, d, &format!("{p}.mlp.up_proj"), false)?,
            down_proj: lin(d, c.intermediate_size, &format!("{p}.mlp.down_proj"), false)?,
        });
    }
    let norm = RmsNorm::new(get1(d, "model.norm.weight")?, c.rms_norm_eps);
    let lm_head = if c.tie_word_embeddings || !vb.contains_tensor("lm_head.weight") {
        Linear::new(Weight::Dense(embed.clone()), None)
    } else {
        lin(c.vocab_size, d, "lm_head", false)?
    };
    Transformer::new(config, embed.into(), layers, norm, lm_head, None)
}
