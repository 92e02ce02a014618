//! Builds a `tokenizers::Tokenizer` from the tokenizer a GGUF file describes in its metadata
//! (llama.cpp's `tokenizer.ggml.*` keys).
//!
//! A GGUF has no `tokenizer.json`; it stores the vocabulary, the merges, the token types and the
//! special token ids. We rebuild the `tokenizer.json` the model family ships on the Hub as a
//! `serde_json::Value` (BPE model, the family's pre-tokenizer, a ByteLevel decoder, the control and
//! user-defined tokens as added tokens) and let the `tokenizers` crate parse it, so encoding and
//! decoding run through the same, well-tested code as for an HF checkpoint.
//!
//! Only byte-level BPE (`tokenizer.ggml.model = "gpt2"`: LLaMA 3, Qwen 2/3, SmolLM/SmolLM2) is
//! supported; SentencePiece (`"llama"`) is refused with a clear error.

use std::collections::HashMap;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file::Value;
use serde_json::json;

use super::SpecialTokens;

const KEY_MODEL: &str = "tokenizer.ggml.model";
const KEY_PRE: &str = "tokenizer.ggml.pre";
const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
const KEY_MERGES: &str = "tokenizer.ggml.merges";
const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
const KEY_EOT: &str = "tokenizer.ggml.eot_token_id";
const KEY_EOM: &str = "tokenizer.ggml.eom_token_id";
const KEY_UNK: &str = "tokenizer.ggml.unknown_token_id";
const KEY_PAD: &str = "tokenizer.ggml.padding_token_id";
const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

/// llama.cpp's `llama_token_type` values stored in `tokenizer.ggml.token_type`.
const TOKEN_TYPE_UNKNOWN: i64 = 2;
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// LLaMA 3's split regex, as in its tokenizer.json and llama.cpp's llama-vocab.cpp.
pub(crate) const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2/3's split regex: LLaMA 3's, but digits are split one by one.
pub(crate) const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What the GGUF metadata gives besides the tokenizer itself.
pub(super) struct GgufTokenizer {
    pub tokenizer: tokenizers::Tokenizer,
    pub special: SpecialTokens,
    pub chat_template: Option<String>,
}

/// Reads the tokenizer out of GGUF metadata.
pub(super) fn build(md: &HashMap<String, Value>) -> Result<GgufTokenizer> {
    let model = get_str(md, KEY_MODEL)?;
    match model {
        "gpt2" => {}
        "llama" => bail!(
            "unsupported GGUF tokenizer model 'llama' (SentencePiece): only byte-level BPE ('gpt2': \
             LLaMA 3, Qwen 2/3, SmolLM2) is supported"
        ),
        other => bail!(
            "unsupported GGUF tokenizer model '{other}' in '{KEY_MODEL}': only byte-level BPE ('gpt2') \
             is supported"
        ),
    }
    // llama.cpp falls back to "default" (with a loud warning) when the key is absent; so do we.
    let pre = match md.get(KEY_PRE) {
        Some(v) => v
            .to_string()
            .map_err(|_| anyhow!("GGUF metadata '{KEY_PRE}' is not a string"))?
            .as_str(),
        None => "default",
    };
    let pre_cfg = pre_tokenizer(pre)?;

    let tokens = get_string_array(md, KEY_TOKENS)?;
    if tokens.is_empty() {
        bail!("GGUF metadata '{KEY_TOKENS}' is empty");
    }
    let merges = get_string_array(md, KEY_MERGES)?;
    let token_types = match md.get(KEY_TOKEN_TYPE) {
        Some(v) => {
            let arr = v
                .to_vec()
                .map_err(|_| anyhow!("GGUF metadata '{KEY_TOKEN_TYPE}' is not an array"))?;
            let types = arr
                .iter()
                .map(as_i64)
                .collect::<Option<Vec<_>>>()
                .ok_or_else(|| anyhow!("GGUF metadata '{KEY_TOKEN_TYPE}' holds a non-integer"))?;
            if types.len() != tokens.len() {
                bail!(
                    "GGUF metadata '{KEY_TOKEN_TYPE}' has {} entries but '{KEY_TOKENS}' has {}",
                    types.len(),
                    tokens.len()
                );
            }
            Some(types)
        }
        None => None,
    };

    let bos_id = get_id(md, KEY_BOS, tokens.len())?;
    let eos_id = get_id(md, KEY_EOS, tokens.len())?;
    let eot_id = get_id(md, KEY_EOT, tokens.len())?;
    let eom_id = get_id(md, KEY_EOM, tokens.len())?;
    let unk_id = get_id(md, KEY_UNK, tokens.len())?;
    let pad_id = get_id(md, KEY_PAD, tokens.len())?;
    let add_bos = match md.get(KEY_ADD_BOS) {
        Some(v) => v
            .to_bool()
            .map_err(|_| anyhow!("GGUF metadata '{KEY_ADD_BOS}' is not a bool"))?,
        None => pre_cfg.add_bos_default,
    };
    let chat_template = match md.get(KEY_CHAT_TEMPLATE) {
        Some(v) => Some(
            v.to_string()
                .map_err(|_| anyhow!("GGUF metadata '{KEY_CHAT_TEMPLATE}' is not a string"))?
                .clone(),
        ),
        None => None,
    };

    // The BPE model, built directly: through tokenizer.json it would be a JSON document of the whole
    // vocabulary and merges, written and parsed again (on a 128K vocabulary, most of a second).
    // Every token, first id wins if a (broken) file repeats a string.
    let mut vocab = tokenizers::models::bpe::Vocab::default();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.entry((*tok).to_string()).or_insert(id as u32);
    }
    let merges = merges
        .iter()
        .enumerate()
        .map(|(i, m)| {
            // Byte-level tokens never contain a literal space (it is spelled 'Ġ'), so the first
            // space is the separator.
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| anyhow!("malformed entry #{i} in '{KEY_MERGES}': {m:?} (expected \"a b\")"))
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = tokenizers::models::bpe::BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(pre_cfg.ignore_merges)
        .build()
        .map_err(|e| anyhow!("building the tokenizer from GGUF metadata failed: {e}"))?;

    // Tokens matched whole in the raw text before pre-tokenization, as llama.cpp does for every
    // non-normal token: control (and unknown) ones are special (skipped when decoding),
    // user-defined ones (e.g. `<think>`) are plain text.
    let mut added = Vec::new();
    match &token_types {
        Some(types) => {
            for (tok, ty) in tokens.iter().zip(types) {
                let special = match *ty {
                    TOKEN_TYPE_CONTROL | TOKEN_TYPE_UNKNOWN => true,
                    TOKEN_TYPE_USER_DEFINED => false,
                    _ => continue,
                };
                added.push(added_token(tok, special));
            }
        }
        None => {
            // No types: at least keep the ids the metadata names as special tokens whole.
            let mut ids: Vec<u32> = [bos_id, eos_id, eot_id, eom_id, unk_id, pad_id]
                .into_iter()
                .flatten()
                .collect();
            ids.sort_unstable();
            ids.dedup();
            for id in ids {
                added.push(added_token(tokens[id as usize], true));
            }
        }
    }

    // The rest as a tokenizer.json would give it (the model is replaced below).
    let rest = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": pre_cfg.pre_tokenizer,
        // BOS is added by TextTokenizer::encode itself (so it is never added twice).
        "post_processor": null,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": true,
            "trim_offsets": true,
            "use_regex": true
        },
        "model": { "type": "BPE", "vocab": {}, "merges": [] }
    });
    let mut tokenizer = tokenizers::Tokenizer::from_bytes(serde_json::to_vec(&rest)?)
        .map_err(|e| anyhow!("building the tokenizer from GGUF metadata failed: {e}"))?;
    tokenizer.with_model(bpe);
    // Added after the model, as tokenizer.json's are: each takes its id in the vocabulary.
    tokenizer.add_tokens(&added);

    let mut eos_ids = Vec::new();
    for id in [eos_id, eot_id, eom_id].into_iter().flatten() {
        if !eos_ids.contains(&id) {
            eos_ids.push(id);
        }
    }
    Ok(GgufTokenizer {
        tokenizer,
        special: SpecialTokens {
            bos_id,
            eos_ids,
            add_bos,
        },
        chat_template,
    })
}

/// The pre-tokenizer of a family, named by `tokenizer.ggml.pre`.
struct PreTokenizerConfig {
    pre_tokenizer: serde_json::Value,
    /// LLaMA 3's tokenizer.json sets `ignore_merges` (a whole pre-token that is in the vocabulary
    /// is taken as is, without running the merges); llama.cpp does the same for that family.
    ignore_merges: bool,
    /// Whether BOS is prepended when the file has no `tokenizer.ggml.add_bos_token`
    /// (llama.cpp's defaults: on for LLaMA 3, off for the others).
    add_bos_default: bool,
}

fn pre_tokenizer(pre: &str) -> Result<PreTokenizerConfig> {
    // The split regexes go through a Split (Isolated) and then a ByteLevel that does no splitting of
    // its own, exactly as in the families' tokenizer.json files.
    let split_then_bytes = |regex: &str| {
        json!({
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": { "Regex": regex },
                    "behavior": "Isolated",
                    "invert": false
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": false,
                    "trim_offsets": true,
                    "use_regex": false
                }
            ]
        })
    };
    // GPT-2's regex, built into the ByteLevel pre-tokenizer (`use_regex`).
    let gpt2_bytes = json!({
        "type": "ByteLevel",
        "add_prefix_space": false,
        "trim_offsets": true,
        "use_regex": true
    });
    let cfg = match pre {
        "llama-bpe" | "llama3" => PreTokenizerConfig {
            pre_tokenizer: split_then_bytes(LLAMA3_SPLIT),
            ignore_merges: true,
            add_bos_default: true,
        },
        "qwen2" => PreTokenizerConfig {
            pre_tokenizer: split_then_bytes(QWEN2_SPLIT),
            ignore_merges: false,
            add_bos_default: false,
        },
        // SmolLM/SmolLM2's tokenizer.json: every digit on its own, then GPT-2's split.
        "smollm" => PreTokenizerConfig {
            pre_tokenizer: json!({
                "type": "Sequence",
                "pretokenizers": [
                    { "type": "Digits", "individual_digits": true },
                    gpt2_bytes
                ]
            }),
            ignore_merges: false,
            add_bos_default: false,
        },
        "gpt-2" | "default" => PreTokenizerConfig {
            pre_tokenizer: gpt2_bytes,
            ignore_merges: false,
            add_bos_default: false,
        },
        other => bail!(
            "unsupported tokenizer pre-tokenizer '{other}' (supported: llama-bpe, llama3, qwen2, smollm, gpt-2)"
        ),
    };
    Ok(cfg)
}

fn added_token(content: &str, special: bool) -> tokenizers::AddedToken {
    tokenizers::AddedToken::from(content.to_string(), special)
        .single_word(false)
        .lstrip(false)
        .rstrip(false)
        .normalized(false)
}

fn get<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a Value> {
    md.get(key)
        .ok_or_else(|| anyhow!("GGUF metadata has no '{key}': the file carries no usable tokenizer"))
}

fn get_str<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<&'a str> {
    get(md, key)?
        .to_string()
        .map(String::as_str)
        .map_err(|_| anyhow!("GGUF metadata '{key}' is not a string"))
}

fn get_string_array<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Vec<&'a str>> {
    let arr = get(md, key)?
        .to_vec()
        .map_err(|_| anyhow!("GGUF metadata '{key}' is not an array"))?;
    arr.iter()
        .enumerate()
        .map(|(i, v)| {
            v.to_string()
                .map(String::as_str)
                .map_err(|_| anyhow!("GGUF metadata '{key}' entry #{i} is not a string"))
        })
        .collect()
}

/// An optional token id; present but out of range or not an integer is an error.
fn get_id(md: &HashMap<String, Value>, key: &str, n_tokens: usize) -> Result<Option<u32>> {
    let Some(v) = md.get(key) else {
        return Ok(None);
    };
    let id = as_i64(v)
        .and_then(|i| u32::try_from(i).ok())
        .with_context(|| format!("GGUF metadata '{key}' is not a token id: {v:?}"))?;
    if id as usize >= n_tokens {
        bail!("GGUF metadata '{key}' = {id} is out of range (vocabulary of {n_tokens} tokens)");
    }
    Ok(Some(id))
}

/// Any GGUF integer as i64 (writers differ in which width they use for ids and types).
fn as_i64(v: &Value) -> Option<i64> {
    match v {
        Value::U8(x) => Some(i64::from(*x)),
        Value::I8(x) => Some(i64::from(*x)),
        Value::U16(x) => Some(i64::from(*x)),
        Value::I16(x) => Some(i64::from(*x)),
        Value::U32(x) => Some(i64::from(*x)),
        Value::I32(x) => Some(i64::from(*x)),
        Value::U64(x) => i64::try_from(*x).ok(),
        Value::I64(x) => Some(*x),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(x: &str) -> Value {
        Value::String(x.to_string())
    }

    fn arr(xs: &[&str]) -> Value {
        Value::Array(xs.iter().map(|x| s(x)).collect())
    }

    /// A tiny byte-level BPE: "hello" / "Ġworld" reachable through merges, plus control tokens.
    fn tiny_md(pre: &str) -> HashMap<String, Value> {
        let mut tokens: Vec<String> = Vec::new();
        let mut types = Vec::new();
        for special in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] {
            tokens.push(special.to_string());
            types.push(Value::I32(3));
        }
        for c in ["h", "e", "l", "o", "Ġ", "w", "r", "d", "1", "2"] {
            tokens.push(c.to_string());
            types.push(Value::I32(1));
        }
        let merges = [
            "h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "Ġwor l", "Ġworl d",
        ];
        for m in merges {
            tokens.push(m.replace(' ', ""));
            types.push(Value::I32(1));
        }
        tokens.push("<think>".to_string());
        types.push(Value::I32(4));
        let mut md = HashMap::new();
        md.insert(KEY_MODEL.to_string(), s("gpt2"));
        md.insert(KEY_PRE.to_string(), s(pre));
        md.insert(
            KEY_TOKENS.to_string(),
            Value::Array(tokens.iter().map(|t| s(t)).collect()),
        );
        md.insert(KEY_MERGES.to_string(), arr(&merges));
        md.insert(KEY_TOKEN_TYPE.to_string(), Value::Array(types));
        md.insert(KEY_BOS.to_string(), Value::U32(1));
        md.insert(KEY_EOS.to_string(), Value::U32(2));
        md
    }

    fn id(tok: &tokenizers::Tokenizer, s: &str) -> u32 {
        tok.token_to_id(s).unwrap()
    }

    #[test]
    fn tiny_vocab_encodes_and_decodes() {
        for pre in ["smollm", "gpt-2", "default", "llama-bpe", "llama3", "qwen2"] {
            let built = build(&tiny_md(pre)).unwrap();
            let tok = &built.tokenizer;
            let enc = tok
                .encode("<|im_start|>hello world<think><|im_end|>", false)
                .unwrap();
            let want = vec![1, id(tok, "hello"), id(tok, "Ġworld"), id(tok, "<think>"), 2];
            assert_eq!(enc.get_ids(), want.as_slice(), "pre={pre}");
            // Control tokens are skipped when decoding, user-defined ones are kept.
            assert_eq!(tok.decode(enc.get_ids(), true).unwrap(), "hello world<think>");
            assert_eq!(built.special.bos_id, Some(1));
            assert_eq!(built.special.eos_ids, vec![2]);
        }
    }

    #[test]
    fn add_bos_default_follows_family_and_key_overrides() {
        assert!(build(&tiny_md("llama-bpe")).unwrap().special.add_bos);
        assert!(!build(&tiny_md("qwen2")).unwrap().special.add_bos);
        let mut md = tiny_md("llama-bpe");
        md.insert(KEY_ADD_BOS.to_string(), Value::Bool(false));
        assert!(!build(&md).unwrap().special.add_bos);
    }

    #[test]
    fn digits_split_per_family() {
        // "12" is a token of the tiny vocabulary only if we add it; with individual digits it is
        // never produced.
        let mut md = tiny_md("smollm");
        let Value::Array(tokens) = md.get_mut(KEY_TOKENS).unwrap() else {
            unreachable!()
        };
        tokens.push(s("12"));
        let Value::Array(types) = md.get_mut(KEY_TOKEN_TYPE).unwrap() else {
            unreachable!()
        };
        types.push(Value::I32(1));
        let Value::Array(merges) = md.get_mut(KEY_MERGES).unwrap() else {
            unreachable!()
        };
        merges.push(s("1 2"));
        let smollm = build(&md).unwrap().tokenizer;
        assert_eq!(smollm.encode("12", false).unwrap().get_ids().len(), 2);
        md.insert(KEY_PRE.to_string(), s("gpt-2"));
        let gpt2 = build(&md).unwrap().tokenizer;
        assert_eq!(gpt2.encode("12", false).unwrap().get_ids().len(), 1);
        md.insert(KEY_PRE.to_string(), s("qwen2"));
        let qwen = build(&md).unwrap().tokenizer;
        assert_eq!(qwen.encode("12", false).unwrap().get_ids().len(), 2);
        md.insert(KEY_PRE.to_string(), s("llama-bpe"));
        let llama = build(&md).unwrap().tokenizer;
        assert_eq!(llama.encode("12", false).unwrap().get_ids().len(), 1);
    }

    #[test]
    fn unknown_pre_is_an_error() {
        let err = build(&tiny_md("falcon")).err().unwrap().to_string();
        assert_eq!(
            err,
            "unsupported tokenizer pre-tokenizer 'falcon' (supported: llama-bpe, llama3, qwen2, smollm, gpt-2)"
        );
    }

    #[test]
    fn missing_keys_are_named() {
        for key in [KEY_TOKENS, KEY_MERGES, KEY_MODEL] {
            let mut md = tiny_md("smollm");
            md.remove(key);
            let err = build(&md).err().unwrap().to_string();
            assert!(err.contains(key), "{err}");
        }
    }

    #[test]
    fn sentencepiece_is_refused() {
        let mut md = tiny_md("default");
        md.insert(KEY_MODEL.to_string(), s("llama"));
        let err = build(&md).err().unwrap().to_string();
        assert!(err.contains("unsupported") && err.contains("'llama'"), "{err}");
    }

    #[test]
    fn bad_ids_and_merges_are_errors() {
        let mut md = tiny_md("smollm");
        md.insert(KEY_EOS.to_string(), Value::U32(10_000));
        assert!(build(&md).err().unwrap().to_string().contains(KEY_EOS));
        let mut md = tiny_md("smollm");
        md.insert(KEY_MERGES.to_string(), arr(&["he"]));
        assert!(build(&md).err().unwrap().to_string().contains("malformed"));
    }
}
