//! Text tokenisation for the supported checkpoints: encoding prompts, decoding (also incrementally,
//! see [`StreamDecoder`]), the stop tokens that end a generation, and the model's chat template.
//!
//! A [`TextTokenizer`] is built either from GGUF metadata ([`TextTokenizer::from_gguf`], see
//! `gguf.rs`) or from an HF checkpoint folder ([`TextTokenizer::from_hf_dir`]); both end up as a
//! `tokenizers::Tokenizer` plus the special-token facts the model's conventions need.

mod gguf_vocab;
mod plain_contents;
mod stream;
pub(crate) mod template;

use std::collections::HashMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::quantized::gguf_file;
use serde_json::Value as Json;

/// The split regexes that name a GGUF's `tokenizer.ggml.pre` (`probespec shape-gguf` writes that name).
pub(crate) use gguf_vocab::{LLAMA3_SPLIT, QWEN2_SPLIT};
pub use stream::StreamDecoder;
use template::ChatTemplate;
pub use template::{check_template_vars, parse_template_vars, Message, TemplateVars};

/// The chat template `source` compiled, or why minijinja cannot compile it, in one line.
pub(crate) fn compile_chat_template(source: String) -> Result<ChatTemplate> {
    let tmpl = ChatTemplate::new(source);
    if let Some(e) = tmpl.compile_error() {
        // The first line says what and where; minijinja's debug listing of the source follows it.
        let what = e.lines().next().unwrap_or_default();
        bail!("the chat template cannot be compiled: {what}");
    }
    Ok(tmpl)
}

/// Tokens that end an assistant turn in the supported families (ChatML, LLaMA 3, GPT-2 style,
/// SentencePiece, Phi). Those present in the vocabulary are stop tokens besides the EOS ids.
const END_OF_TURN_TOKENS: [&str; 6] = [
    "<|im_end|>",
    "<|eot_id|>",
    "<|end_of_text|>",
    "<|endoftext|>",
    "</s>",
    "<|end|>",
];

/// The special-token facts the two loaders extract.
#[derive(Debug, Clone, Default)]
struct SpecialTokens {
    bos_id: Option<u32>,
    /// EOS first, then any other ids the checkpoint says end generation.
    eos_ids: Vec<u32>,
    /// Whether the model expects BOS in front of every input.
    add_bos: bool,
}

/// A model's tokenizer with its conventions (BOS, stop tokens, chat template).
#[derive(Debug)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    bos_id: Option<u32>,
    add_bos: bool,
    /// The BOS/EOS strings templates refer to as `bos_token` / `eos_token` ("" when absent).
    bos_token: String,
    eos_token: String,
    stop_tokens: Vec<u32>,
    vocab_size: usize,
    /// The most bytes of input text one token can stand for (an upper bound: a text of B bytes has at
    /// least B / this many tokens).
    longest_token_bytes: usize,
    /// `inner` with special-token strings read as plain text, made on first use
    /// ([`TextTokenizer::encode_chat_contents_as_text`]).
    plain: std::sync::OnceLock<tokenizers::Tokenizer>,
    chat_template: Option<ChatTemplate>,
    /// Variables every rendering passes to the chat template (`--chat-template-kwargs`).
    template_vars: TemplateVars,
}

impl TextTokenizer {
    /// From GGUF metadata (`gguf_file::Content::metadata`).
    pub fn from_gguf(md: &HashMap<String, gguf_file::Value>) -> Result<Self> {
        let built = gguf_vocab::build(md)?;
        Ok(Self::assemble(
            built.tokenizer,
            built.special,
            built.chat_template,
        ))
    }

    /// From an HF checkpoint folder: `tokenizer.json` (required), `tokenizer_config.json` (BOS/EOS,
    /// `add_bos_token`, `chat_template`), `chat_template.jinja` (preferred when present) and
    /// `generation_config.json` (extra `eos_token_id`s).
    pub fn from_hf_dir(dir: &Path) -> Result<Self> {
        let tokenizer_path = dir.join("tokenizer.json");
        if !tokenizer_path.is_file() {
            bail!(
                "no tokenizer.json in {}: an HF checkpoint folder needs one",
                dir.display()
            );
        }
        let inner = tokenizers::Tokenizer::from_file(&tokenizer_path)
            .map_err(|e| anyhow!("reading {}: {e}", tokenizer_path.display()))?;

        let config = read_json_opt(&dir.join("tokenizer_config.json"))?;
        let generation = read_json_opt(&dir.join("generation_config.json"))?;
        let config = config.as_ref();

        let token_id = |field: &str| -> Option<u32> {
            let content = config.and_then(|c| token_content(c.get(field)?))?;
            inner.token_to_id(&content)
        };
        let ids_in = |v: Option<&Json>| -> Vec<u32> {
            match v {
                Some(Json::Number(n)) => n.as_u64().map(|x| x as u32).into_iter().collect(),
                Some(Json::Array(a)) => a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)).collect(),
                _ => Vec::new(),
            }
        };

        // BOS only from tokenizer_config.json, as transformers does: Qwen's is null there (and its
        // templates must see an empty `bos_token`) even though generation_config.json names one.
        let bos_id = token_id("bos_token");
        let mut eos_ids: Vec<u32> = token_id("eos_token").into_iter().collect();
        for id in ids_in(generation.as_ref().and_then(|g| g.get("eos_token_id"))) {
            if !eos_ids.contains(&id) {
                eos_ids.push(id);
            }
        }
        let add_bos = match config
            .and_then(|c| c.get("add_bos_token"))
            .and_then(Json::as_bool)
        {
            Some(b) => b,
            // No explicit setting: the tokenizer.json post-processor is the convention (LLaMA 3's
            // TemplateProcessing prepends <|begin_of_text|>, Qwen's adds nothing).
            None => match bos_id {
                Some(bos) => inner
                    .encode("a", true)
                    .map(|e| e.get_ids().first() == Some(&bos))
                    .unwrap_or(false),
                None => false,
            },
        };

        let jinja_path = dir.join("chat_template.jinja");
        let chat_template = if jinja_path.is_file() {
            Some(
                std::fs::read_to_string(&jinja_path)
                    .with_context(|| format!("reading {}", jinja_path.display()))?,
            )
        } else {
            config
                .and_then(|c| c.get("chat_template"))
                .map(template_from_config)
                .transpose()?
                .flatten()
        };

        Ok(Self::assemble(
            inner,
            SpecialTokens {
                bos_id,
                eos_ids,
                add_bos,
            },
            chat_template,
        ))
    }

    fn assemble(inner: tokenizers::Tokenizer, special: SpecialTokens, chat_template: Option<String>) -> Self {
        let mut stop_tokens = Vec::new();
        let candidates = special
            .eos_ids
            .iter()
            .copied()
            .chain(END_OF_TURN_TOKENS.iter().filter_map(|t| inner.token_to_id(t)));
        for id in candidates {
            if !stop_tokens.contains(&id) {
                stop_tokens.push(id);
            }
        }
        let piece = |id: Option<u32>| id.and_then(|i| inner.id_to_token(i)).unwrap_or_default();
        let bos_token = piece(special.bos_id);
        let eos_token = piece(special.eos_ids.first().copied());
        // Ids may have gaps (an added token past the model vocabulary), so count by the largest. A token's
        // text in the vocabulary takes at least as many bytes as the text it decodes to (byte-level
        // symbols, SentencePiece's `▁`, `<0x41>` byte tokens all shrink), so its longest is a bound.
        let vocab = inner.get_vocab(true);
        let vocab_size = vocab.values().max().map_or(0, |&m| m as usize + 1);
        // A normaliser may shrink a text before it is cut into tokens (NFKC turns some 3-byte characters
        // into one byte): then the bound allows for that.
        let shrink = if inner.get_normalizer().is_some() { 3 } else { 1 };
        let longest_token_bytes = shrink * vocab.keys().map(String::len).max().unwrap_or(1).max(1);
        Self {
            inner,
            bos_id: special.bos_id,
            add_bos: special.add_bos,
            bos_token,
            eos_token,
            stop_tokens,
            vocab_size,
            longest_token_bytes,
            plain: std::sync::OnceLock::new(),
            chat_template: chat_template.map(ChatTemplate::new),
            template_vars: TemplateVars::new(),
        }
    }

    /// Number of token ids, added tokens included (largest id + 1).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The text as the model reads it: special-token strings in the text (e.g. `<|im_start|>`)
    /// become their ids, and BOS is prepended when the model's convention says so, unless the text
    /// already starts with it (a chat template may write it itself).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| anyhow!("tokenizing failed: {e}"))?;
        Ok(self.with_bos(enc.get_ids().to_vec()))
    }

    /// `ids` with BOS in front when the model's convention asks for it and they do not start with it.
    fn with_bos(&self, mut ids: Vec<u32>) -> Vec<u32> {
        match self.bos_id {
            Some(bos) if self.add_bos && ids.first() != Some(&bos) => {
                ids.insert(0, bos);
                ids
            }
            _ => ids,
        }
    }

    /// The fewest tokens a text of `bytes` bytes can take: a check that needs no tokenising.
    pub fn fewest_tokens(&self, bytes: usize) -> usize {
        bytes.div_ceil(self.longest_token_bytes)
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| anyhow!("detokenizing failed: {e}"))
    }

    /// Ids that end generation: the EOS ids, then the end-of-turn tokens found in the vocabulary.
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop_tokens
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// Renders `messages` with the model's chat template and this tokenizer's template variables.
    pub fn apply_chat_template(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.apply_chat_template_with(messages, add_generation_prompt, &TemplateVars::new())
    }

    /// As [`Self::apply_chat_template`], with `vars` over this tokenizer's template variables (a server
    /// request's `chat_template_kwargs`).
    pub fn apply_chat_template_with(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
        vars: &TemplateVars,
    ) -> Result<String> {
        let Some(tmpl) = &self.chat_template else {
            bail!("this model has no chat template; run with --no-chat-template to use the prompt as is");
        };
        check_template_vars(vars)?;
        let mut all = self.template_vars.clone();
        all.extend(vars.iter().map(|(k, v)| (k.clone(), v.clone())));
        tmpl.render(
            messages,
            add_generation_prompt,
            &self.bos_token,
            &self.eos_token,
            &all,
        )
    }

    /// Replaces the model's chat template (`--chat-template-file`, [`compile_chat_template`]).
    pub(crate) fn set_chat_template(&mut self, template: ChatTemplate) {
        self.chat_template = Some(template);
    }

    /// Sets the variables every rendering passes to the chat template (Qwen 3's `enable_thinking`, ...).
    pub fn set_chat_template_vars(&mut self, vars: TemplateVars) -> Result<()> {
        check_template_vars(&vars)?;
        self.template_vars = vars;
        Ok(())
    }

    /// The variables every rendering passes to the chat template.
    pub fn chat_template_vars(&self) -> &TemplateVars {
        &self.template_vars
    }

    /// The text of one token, special tokens included (`None` for an id outside the vocabulary).
    /// A token holding part of a multi-byte character shows it as U+FFFD; use [`StreamDecoder`]
    /// to print generated text.
    pub fn token_to_piece(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)?;
        self.inner.decode(&[id], false).ok()
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// A JSON file that may be absent; present but unreadable is an error.
fn read_json_opt(path: &Path) -> Result<Option<Json>> {
    if !path.is_file() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let v = serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))?;
    Ok(Some(v))
}

/// A special token in tokenizer_config.json: a string, or an AddedToken object with `content`.
fn token_content(v: &Json) -> Option<String> {
    match v {
        Json::String(s) => Some(s.clone()),
        Json::Object(o) => o.get("content")?.as_str().map(str::to_string),
        _ => None,
    }
}

/// `chat_template` in tokenizer_config.json: a string, or a list of `{name, template}` of which we
/// take "default".
fn template_from_config(v: &Json) -> Result<Option<String>> {
    match v {
        Json::Null => Ok(None),
        Json::String(s) => Ok(Some(s.clone())),
        Json::Array(list) => {
            let default = list
                .iter()
                .find(|t| t.get("name").and_then(Json::as_str) == Some("default"));
            match default {
                Some(t) => Ok(t.get("template").and_then(Json::as_str).map(str::to_string)),
                None => {
                    let names: Vec<&str> = list
                        .iter()
                        .filter_map(|t| t.get("name").and_then(Json::as_str))
                        .collect();
                    bail!(
                        "tokenizer_config.json has named chat templates {names:?} but none called \"default\""
                    )
                }
            }
        }
        _ => bail!("tokenizer_config.json: chat_template is neither a string nor a list"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A small byte-level BPE tokenizer.json, as an HF checkpoint would ship it.
    fn tiny_tokenizer_json(post_processor_bos: bool) -> Json {
        let post = if post_processor_bos {
            json!({
                "type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<s>": {"id": "<s>", "ids": [0], "tokens": ["<s>"]}}
            })
        } else {
            Json::Null
        };
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": 0, "content": "<s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 1, "content": "</s>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true},
                {"id": 2, "content": "<|im_end|>", "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true},
            "post_processor": post,
            "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
            "model": {
                "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                "vocab": {"<s>": 0, "</s>": 1, "<|im_end|>": 2, "h": 3, "i": 4, "Ġ": 5, "hi": 6, "Ġhi": 7, "!": 8},
                "merges": [["h", "i"], ["Ġ", "hi"]]
            }
        })
    }

    fn write(dir: &Path, name: &str, v: &Json) {
        std::fs::write(dir.join(name), serde_json::to_string_pretty(v).unwrap()).unwrap();
    }

    #[test]
    fn hf_dir_with_config_template_and_generation_config() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "tokenizer.json", &tiny_tokenizer_json(false));
        write(
            dir.path(),
            "tokenizer_config.json",
            &json!({
                "bos_token": {"content": "<s>", "special": true},
                "eos_token": "</s>",
                "add_bos_token": true,
                "chat_template": "{{ bos_token }}{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
            }),
        );
        write(
            dir.path(),
            "generation_config.json",
            &json!({"eos_token_id": [1, 2]}),
        );
        let tok = TextTokenizer::from_hf_dir(dir.path()).unwrap();
        assert_eq!(tok.vocab_size(), 9);
        assert_eq!(tok.encode("hi hi!").unwrap(), vec![0, 6, 7, 8]);
        // BOS is not doubled when the text (e.g. a rendered template) starts with it.
        assert_eq!(tok.encode("<s>hi").unwrap(), vec![0, 6]);
        assert_eq!(tok.decode(&[0, 6, 7, 8, 1]).unwrap(), "hi hi!");
        assert_eq!(tok.stop_tokens(), &[1, 2]);
        assert_eq!(tok.token_to_piece(7).as_deref(), Some(" hi"));
        assert_eq!(tok.token_to_piece(1).as_deref(), Some("</s>"));
        assert_eq!(tok.token_to_piece(99), None);
        assert!(tok.has_chat_template());
        let prompt = tok
            .apply_chat_template(&[Message::new("user", "hi")], true)
            .unwrap();
        assert_eq!(prompt, "<s>user: hi</s>assistant:");
        // The template wrote BOS itself: encode must not add a second one.
        let ids = tok.encode(&prompt).unwrap();
        assert_eq!(ids[0], 0);
        assert_eq!(ids.iter().filter(|&&i| i == 0).count(), 1);
        assert!(
            ids.contains(&1),
            "special-token text in the prompt maps to its id"
        );
    }

    #[test]
    fn hf_dir_named_templates_jinja_file_and_post_processor_bos() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "tokenizer.json", &tiny_tokenizer_json(true));
        write(
            dir.path(),
            "tokenizer_config.json",
            &json!({
                "bos_token": "<s>",
                "eos_token": "</s>",
                "chat_template": [
                    {"name": "tool_use", "template": "TOOLS"},
                    {"name": "default", "template": "DEFAULT{{ messages[0].content }}"}
                ]
            }),
        );
        let tok = TextTokenizer::from_hf_dir(dir.path()).unwrap();
        // No add_bos_token: the post-processor's BOS is the convention.
        assert_eq!(tok.encode("hi").unwrap(), vec![0, 6]);
        let msgs = [Message::new("user", "x")];
        assert_eq!(tok.apply_chat_template(&msgs, false).unwrap(), "DEFAULTx");

        // chat_template.jinja wins over tokenizer_config.json.
        std::fs::write(
            dir.path().join("chat_template.jinja"),
            "JINJA{{ messages[0].role }}\n",
        )
        .unwrap();
        let tok = TextTokenizer::from_hf_dir(dir.path()).unwrap();
        assert_eq!(tok.apply_chat_template(&msgs, false).unwrap(), "JINJAuser");
    }

    #[test]
    fn template_vars_reach_the_template_and_a_request_overrides_them() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "tokenizer.json", &tiny_tokenizer_json(false));
        let src = "{{ mode | default('unset') }}/{{ extra | default('none') }}";
        std::fs::write(dir.path().join("chat_template.jinja"), src).unwrap();
        let mut tok = TextTokenizer::from_hf_dir(dir.path()).unwrap();
        let render = |tok: &TextTokenizer, vars: &str| {
            tok.apply_chat_template_with(&[], true, &parse_template_vars(vars).unwrap())
                .unwrap()
        };
        assert_eq!(tok.apply_chat_template(&[], true).unwrap(), "unset/none");
        tok.set_chat_template_vars(parse_template_vars(r#"{"mode": "fast"}"#).unwrap())
            .unwrap();
        assert_eq!(tok.apply_chat_template(&[], true).unwrap(), "fast/none");
        assert_eq!(render(&tok, r#"{"extra": 3}"#), "fast/3");
        assert_eq!(render(&tok, r#"{"mode": "slow"}"#), "slow/none");
        let reserved = TemplateVars::from_iter([("messages".to_string(), json!([]))]);
        let err = tok
            .apply_chat_template_with(&[], true, &reserved)
            .unwrap_err()
            .to_string();
        assert!(err.contains("'messages'"), "{err}");
        assert!(tok.set_chat_template_vars(reserved).is_err());
    }

    #[test]
    fn hf_dir_without_template_or_config() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "tokenizer.json", &tiny_tokenizer_json(false));
        let tok = TextTokenizer::from_hf_dir(dir.path()).unwrap();
        assert!(!tok.has_chat_template());
        let err = tok.apply_chat_template(&[], true).unwrap_err().to_string();
        assert!(err.contains("--no-chat-template"), "{err}");
        // No EOS configured: the end-of-turn tokens in the vocabulary still stop generation.
        assert_eq!(tok.stop_tokens(), &[2, 1]);
        assert_eq!(tok.encode("hi").unwrap(), vec![6]);
    }

    #[test]
    fn hf_dir_missing_tokenizer_json_names_folder() {
        let dir = tempfile::tempdir().unwrap();
        let err = TextTokenizer::from_hf_dir(dir.path()).unwrap_err().to_string();
        assert!(err.contains("tokenizer.json"), "{err}");
        assert!(err.contains(&dir.path().display().to_string()), "{err}");
    }

    #[test]
    fn stream_decoder_matches_decode_on_tiny_vocab() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), "tokenizer.json", &tiny_tokenizer_json(false));
        let tok = TextTokenizer::from_hf_dir(dir.path()).unwrap();
        let ids = [6, 7, 2, 8, 7];
        let mut stream = StreamDecoder::new(&tok);
        let mut out = String::new();
        for &id in &ids {
            if let Some(piece) = stream.push(id).unwrap() {
                out.push_str(&piece);
            }
        }
        if let Some(piece) = stream.finish().unwrap() {
            out.push_str(&piece);
        }
        assert_eq!(out, tok.decode(&ids).unwrap());
        assert_eq!(out, "hi hi! hi");
    }

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<TextTokenizer>();
    }
}
