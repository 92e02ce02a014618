//! The `tokenizer.*` metadata of a GGUF, made from a Hugging Face tokenizer folder (`tokenizer.json` and
//! `tokenizer_config.json`) the way llama.cpp's `convert_hf_to_gguf.py` makes it for byte-level BPE:
//!
//! - `tokenizer.ggml.tokens`: every id up to the model's vocabulary size; the BPE vocabulary, then the
//!   added tokens, and ids the tokenizer does not use as `[PAD{id}]` of type UNUSED (Qwen 3's embedding
//!   table has 267 more rows than its tokenizer has tokens);
//! - `token_type`: NORMAL, CONTROL for special added tokens and those that look special (`<|...|>`),
//!   USER_DEFINED for the other added tokens (Qwen 3's `<think>`);
//! - `merges` as `"a b"` strings, `pre` named by the pre-tokenizer's split regex (`llama-bpe` for LLaMA 3,
//!   `qwen2` for Qwen 2/3), BOS/EOS/padding ids and `add_bos_token` from `tokenizer_config.json`, and the
//!   chat template.

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use serde_json::Value as Json;
use std::collections::HashMap;
use std::path::Path;

/// llama.cpp's `llama_token_type` values.
const NORMAL: i32 = 1;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;

fn read_json(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// A special token named in `tokenizer_config.json`: a string or `{"content": ...}`.
fn token_content(v: Option<&Json>) -> Option<&str> {
    match v? {
        Json::String(s) => Some(s),
        Json::Object(o) => o.get("content")?.as_str(),
        _ => None,
    }
}

/// Added tokens the converter marks as control tokens although `special` is false.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<｜") && t.ends_with("｜>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// The split regex of the pre-tokenizer (`Split` alone or inside a `Sequence`), if there is one.
fn split_regex(pre: &Json) -> Option<&str> {
    match pre["type"].as_str()? {
        "Split" => pre["pattern"]["Regex"].as_str(),
        "Sequence" => pre["pretokenizers"].as_array()?.iter().find_map(split_regex),
        _ => None,
    }
}

fn has_byte_level(pre: &Json) -> bool {
    match pre["type"].as_str() {
        Some("ByteLevel") => true,
        Some("Sequence") => pre["pretokenizers"]
            .as_array()
            .is_some_and(|ps| ps.iter().any(has_byte_level)),
        _ => false,
    }
}

/// The `tokenizer.ggml.pre` name of a tokenizer.json's pre-tokenizer.
fn pre_name(tokenizer: &Json) -> Result<&'static str> {
    let pre = &tokenizer["pre_tokenizer"];
    if !has_byte_level(pre) {
        bail!("the tokenizer is not byte-level BPE (its pre-tokenizer has no ByteLevel step)");
    }
    match split_regex(pre) {
        Some(r) if r == crate::tokenizer::LLAMA3_SPLIT => Ok("llama-bpe"),
        Some(r) if r == crate::tokenizer::QWEN2_SPLIT => Ok("qwen2"),
        Some(r) => bail!("unsupported pre-tokenizer split regex {r:?} (supported: LLaMA 3's and Qwen 2/3's)"),
        None => {
            bail!("the tokenizer's pre-tokenizer has no split regex (supported: LLaMA 3's and Qwen 2/3's)")
        }
    }
}

/// The `tokenizer.*` metadata for a model of `vocab_size` embedding rows from the tokenizer in `dir`.
/// `default_bos` is the model config's BOS id, used when `tokenizer_config.json` names none (Qwen 3).
pub fn tokenizer_metadata(
    dir: &Path,
    vocab_size: usize,
    default_bos: Option<u32>,
) -> Result<Vec<(String, Value)>> {
    let tokenizer = read_json(&dir.join("tokenizer.json"))?;
    let config = read_json(&dir.join("tokenizer_config.json"))?;
    let model = &tokenizer["model"];
    if model["type"].as_str() != Some("BPE") {
        bail!("tokenizer.json's model is not BPE");
    }
    let pre = pre_name(&tokenizer)?;

    let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab_size];
    let mut put = |id: u64, text: &str, ty: i32| -> Result<()> {
        let slot = tokens.get_mut(id as usize).ok_or_else(|| {
            anyhow!("the tokenizer has token id {id}, beyond the model's vocabulary of {vocab_size}")
        })?;
        *slot = Some((text.to_string(), ty));
        Ok(())
    };
    let vocab = model["vocab"]
        .as_object()
        .context("tokenizer.json has no model.vocab object")?;
    for (text, id) in vocab {
        put(
            id.as_u64().context("a vocabulary id is not an integer")?,
            text,
            NORMAL,
        )?;
    }
    for added in tokenizer["added_tokens"].as_array().into_iter().flatten() {
        let id = added["id"].as_u64().context("an added token has no integer id")?;
        let text = added["content"]
            .as_str()
            .context("an added token has no content")?;
        let special = added["special"].as_bool().unwrap_or(false) || looks_special(text);
        put(id, text, if special { CONTROL } else { USER_DEFINED })?;
    }
    let (texts, types): (Vec<Value>, Vec<Value>) = tokens
        .into_iter()
        .enumerate()
        .map(|(id, t)| {
            let (text, ty) = t.unwrap_or_else(|| (format!("[PAD{id}]"), UNUSED));
            (Value::String(text), Value::I32(ty))
        })
        .unzip();
    let id_of: HashMap<&str, u32> = texts
        .iter()
        .enumerate()
        .filter_map(|(i, t)| match t {
            Value::String(s) => Some((s.as_str(), i as u32)),
            _ => None,
        })
        .collect();

    let merges = model["merges"]
        .as_array()
        .context("tokenizer.json has no model.merges array")?
        .iter()
        .map(|m| match m {
            Json::String(s) => Ok(Value::String(s.clone())),
            Json::Array(pair) if pair.len() == 2 => match (pair[0].as_str(), pair[1].as_str()) {
                (Some(a), Some(b)) => Ok(Value::String(format!("{a} {b}"))),
                _ => bail!("a merge is not a pair of strings"),
            },
            _ => bail!("a merge is neither \"a b\" nor [a, b]"),
        })
        .collect::<Result<Vec<_>>>()?;

    let named_id = |field: &str| -> Result<Option<u32>> {
        match token_content(config.get(field)) {
            None => Ok(None),
            Some(t) => id_of
                .get(t)
                .map(|&id| Some(id))
                .with_context(|| format!("tokenizer_config.json's {field} {t:?} is not a token")),
        }
    };
    let bos = named_id("bos_token")?.or(default_bos);
    let eos = named_id("eos_token")?;
    let pad = named_id("pad_token")?;
    // Without `add_bos_token`, BOS is added when the post-processor's template starts with it (LLaMA 3).
    let add_bos = match config.get("add_bos_token").and_then(Json::as_bool) {
        Some(b) => b,
        None => {
            let bos_text = token_content(config.get("bos_token"));
            let first = tokenizer["post_processor"]["processors"]
                .as_array()
                .into_iter()
                .flatten()
                .chain(std::iter::once(&tokenizer["post_processor"]))
                .find_map(|p| p["single"][0]["SpecialToken"]["id"].as_str());
            bos_text.is_some() && first == bos_text
        }
    };
    let chat_template = match config.get("chat_template") {
        Some(Json::String(s)) => Some(s.clone()),
        Some(Json::Array(named)) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    };

    let mut md = vec![
        ("tokenizer.ggml.model".to_string(), Value::String("gpt2".into())),
        ("tokenizer.ggml.pre".to_string(), Value::String(pre.into())),
        ("tokenizer.ggml.tokens".to_string(), Value::Array(texts)),
        ("tokenizer.ggml.token_type".to_string(), Value::Array(types)),
        ("tokenizer.ggml.merges".to_string(), Value::Array(merges)),
    ];
    for (key, id) in [
        ("tokenizer.ggml.bos_token_id", bos),
        ("tokenizer.ggml.eos_token_id", eos),
        ("tokenizer.ggml.padding_token_id", pad),
    ] {
        if let Some(id) = id {
            md.push((key.to_string(), Value::U32(id)));
        }
    }
    md.push(("tokenizer.ggml.add_bos_token".to_string(), Value::Bool(add_bos)));
    if let Some(t) = chat_template {
        md.push(("tokenizer.chat_template".to_string(), Value::String(t)));
    }
    Ok(md)
}
