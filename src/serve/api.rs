//! The request bodies of `/v1/chat/completions` and `/v1/completions` in OpenAI's shapes, and their
//! conversion into a [`JobSpec`]: the prompt's token ids (through the model's chat template, as one-shot
//! generation renders a prompt), the method, the generation parameters and the stop strings. Every way a
//! body can be wrong ends here as an [`ApiError`] naming the field.

use super::error::ApiError;
use super::fields::{self, Endpoint};
use crate::decode::generate::GenerateParams;
use crate::decode::method::{Budget, Method};
use crate::decode::prefill::{cache_rows, BLOCK_ROOM};
use crate::decode::sampling::SamplingParams;
use crate::flags::{MethodArg, MethodArgs, TreeArg};
use crate::session::Session;
use crate::tokenizer::{check_template_vars, Message, TemplateVars};
use clap::ValueEnum;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::Value;

/// Most stop strings in a request (OpenAI's limit).
pub const MAX_STOP_STRINGS: usize = 4;

/// A chat message's content: a string, or a list of parts of which only text parts are understood.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: Option<Content>,
}

/// `stop`: one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Sampling and length fields common to both endpoints (which other fields a body may carry:
/// [`super::fields`]).
#[derive(Debug, Deserialize, Default)]
pub struct Common {
    pub model: Option<String>,
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Not OpenAI's: vLLM's and llama-server's extension.
    pub top_k: Option<u64>,
    pub seed: Option<u64>,
    pub stop: Option<Stop>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Not OpenAI's: vLLM's extension, generate to the length limit whatever the model says.
    pub ignore_eos: Option<bool>,
    /// probespec's own: the method and its budget for this request.
    pub probespec: Option<MethodOverrides>,
}

#[derive(Debug, Deserialize)]
pub struct ChatRequest {
    pub messages: Vec<ChatMessage>,
    /// Variables for the chat template over the server's `--chat-template-kwargs` (vLLM's field), e.g.
    /// `{"enable_thinking": false}`.
    pub chat_template_kwargs: Option<Value>,
    #[serde(flatten)]
    pub common: Common,
}

/// `prompt`: a string, or a list holding one string.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub prompt: PromptField,
    #[serde(flatten)]
    pub common: Common,
}

/// The `probespec` body field: the server's method flags, overridden for one request.
#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct MethodOverrides {
    pub method: Option<String>,
    /// A positive number or "auto".
    pub bc: Option<Value>,
    pub masks: Option<usize>,
    pub ngram: Option<usize>,
    pub draft_len: Option<usize>,
    pub lookahead_window: Option<usize>,
    pub lookahead_ngram: Option<usize>,
    pub lookahead_guesses: Option<usize>,
    pub mask_lambda: Option<f32>,
}

impl MethodOverrides {
    /// The method of the server's flags with these fields replaced, checked, and within `max_bc` rows.
    pub fn method(&self, defaults: &MethodArgs, max_bc: usize) -> Result<Method, ApiError> {
        let param = |e: anyhow::Error| ApiError::invalid_param("probespec", format!("{e:#}"));
        let mut a = defaults.clone();
        if let Some(m) = &self.method {
            a.method = MethodArg::from_str(m, false).map_err(|_| {
                ApiError::invalid_param(
                    "probespec.method",
                    format!("unknown method '{m}' (ar, esp, pld, lookahead, hybrid)"),
                )
            })?;
        }
        if let Some(bc) = &self.bc {
            a.bc = match bc {
                Value::String(s) => s.parse::<Budget>().ok(),
                Value::Number(n) => n.as_u64().filter(|&n| n > 0).map(|n| Budget::Fixed(n as usize)),
                _ => None,
            }
            .ok_or_else(|| {
                ApiError::invalid_param(
                    "probespec.bc",
                    format!("bc must be a positive number or \"auto\" (got {bc})"),
                )
            })?;
        }
        let set = |slot: &mut usize, v: Option<usize>| {
            if let Some(v) = v {
                *slot = v;
            }
        };
        set(&mut a.masks, self.masks);
        set(&mut a.ngram, self.ngram);
        set(&mut a.lookahead_ngram, self.lookahead_ngram);
        set(&mut a.lookahead_guesses, self.lookahead_guesses);
        if self.draft_len.is_some() {
            a.draft_len = self.draft_len;
        }
        if self.lookahead_window.is_some() {
            a.lookahead_window = self.lookahead_window;
        }
        if let Some(l) = self.mask_lambda {
            a.mask_lambda = l;
        }
        // A request for another method drops the ESP-only tree flags the server may have been given.
        if a.method != MethodArg::Esp {
            a.branches = None;
            a.tree = TreeArg::Dynamic;
        }
        if let Some((field, rows)) = over_block_cap(&a, max_bc) {
            return Err(ApiError::invalid_param(
                &format!("probespec.{field}"),
                format!("probespec.{field} asks for blocks of {rows} rows, above this server's cap of {max_bc} (--max-bc)"),
            ));
        }
        let method = a.method().map_err(param)?;
        method.validate().map_err(param)?;
        Ok(method)
    }
}

/// The first of the method flags `a` sets whose block would pass `max_bc` rows: the flag and the rows.
/// Sizes left to `--bc auto` are not counted: a step never sends more than `max_bc` rows
/// ([`GenerateParams::max_block_rows`]).
pub fn over_block_cap(a: &MethodArgs, max_bc: usize) -> Option<(&'static str, usize)> {
    let lookahead = a.method == MethodArg::Lookahead;
    let tree = 1 + a.lookahead_guesses * a.lookahead_ngram.saturating_sub(1);
    [
        ("bc", if let Budget::Fixed(n) = a.bc { n } else { 0 }),
        ("draft_len", a.draft_len.map_or(0, |d| d + 1)),
        ("lookahead_window", a.lookahead_window.map_or(0, |w| w + 1)),
        ("lookahead_guesses", if lookahead { tree } else { 0 }),
    ]
    .into_iter()
    .find(|&(_, rows)| rows > max_bc)
}

/// The server's defaults for what a request leaves out, and its limits on what a request may ask.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub method: MethodArgs,
    pub sampling: SamplingParams,
    pub max_new_tokens: usize,
    /// The largest block a step may send (`--max-bc`).
    pub max_bc: usize,
    /// The largest `max_tokens` a request may ask for (`--max-tokens`).
    pub max_tokens: Option<usize>,
    /// Whether a request's `probespec` field is taken (not `--no-method-overrides`).
    pub method_overrides: bool,
    /// Read special-token strings in message contents as plain text (`--special-tokens-in-content text`).
    pub contents_as_text: bool,
    /// The KV cache rows the requests decoding together may reserve (`--kv-budget`, in the model's rows).
    pub kv_rows: Option<usize>,
}

/// What the decoding thread needs for one request.
#[derive(Debug, Clone)]
pub struct JobSpec {
    pub prompt: Vec<u32>,
    pub method: Method,
    pub params: GenerateParams,
    pub stop: Vec<String>,
}

/// A request converted, with how its answer is sent.
#[derive(Debug)]
pub struct Parsed {
    pub spec: JobSpec,
    pub stream: bool,
    /// The rendered prompt ends inside a `<think>` block (a template that opens it for the model).
    pub prompt_opens_thinking: bool,
}

/// Parses a JSON body into `T` after checking its fields ([`fields::check`]), as a 400 on any error.
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8], endpoint: Endpoint) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid("the request body is empty: send a JSON object"));
    }
    let body: Value =
        serde_json::from_slice(bytes).map_err(|e| ApiError::invalid(format!("invalid request body: {e}")))?;
    parse_value(body, endpoint)
}

/// [`parse_body`] of a body already read as JSON.
pub fn parse_value<T: DeserializeOwned>(body: Value, endpoint: Endpoint) -> Result<T, ApiError> {
    let Value::Object(fields) = &body else {
        return Err(ApiError::invalid("invalid request body: send a JSON object"));
    };
    fields::check(fields, endpoint)?;
    serde_json::from_value(body).map_err(|e| ApiError::invalid(format!("invalid request body: {e}")))
}

/// A body of `endpoint`, read as JSON -> its job.
pub fn endpoint_job(
    body: Value,
    endpoint: Endpoint,
    session: &Session,
    d: &Defaults,
) -> Result<Parsed, ApiError> {
    match endpoint {
        Endpoint::Chat => chat_job(&parse_value(body, endpoint)?, session, d),
        Endpoint::Completion => completion_job(&parse_value(body, endpoint)?, session, d),
    }
}

/// The chat request's messages as the chat template reads them.
pub fn chat_messages(messages: &[ChatMessage]) -> Result<Vec<Message>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "messages is empty: send at least one message",
        ));
    }
    let mut out = Vec::with_capacity(messages.len());
    for (i, m) in messages.iter().enumerate() {
        let role = match m.role.as_str() {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            other => {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].role"),
                    format!("unsupported role '{other}' (system, developer, user, assistant)"),
                ))
            }
        };
        let param = || format!("messages[{i}].content");
        let text = match &m.content {
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut text = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => text.push_str(t),
                        _ => {
                            return Err(ApiError::invalid_param(
                                &param(),
                                format!("content part of type '{}' is not supported (text only)", p.kind),
                            ))
                        }
                    }
                }
                text
            }
            None if role == "assistant" => String::new(),
            None => return Err(ApiError::invalid_param(&param(), "content is missing")),
        };
        out.push(Message::new(role, text));
    }
    if out.last().is_some_and(|m| m.role == "assistant") {
        return Err(ApiError::invalid_param(
            "messages",
            "the last message is the assistant's: end with a user message",
        ));
    }
    Ok(out)
}

/// A chat request -> its job: the messages through the chat template (with the generation prompt).
pub fn chat_job(req: &ChatRequest, session: &Session, d: &Defaults) -> Result<Parsed, ApiError> {
    let messages = chat_messages(&req.messages)?;
    let vars = match &req.chat_template_kwargs {
        None | Some(Value::Null) => TemplateVars::new(),
        Some(Value::Object(vars)) => {
            check_template_vars(vars)
                .map_err(|e| ApiError::invalid_param("chat_template_kwargs", format!("{e:#}")))?;
            vars.clone()
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "chat_template_kwargs",
                "an object of template variables, e.g. {\"enable_thinking\": false}",
            ))
        }
    };
    check_fits(messages.iter().map(|m| m.content.len()).sum(), session)?;
    let template_error = |e: anyhow::Error| ApiError::invalid_param("messages", format!("{e:#}"));
    let (text, prompt) = if d.contents_as_text {
        session
            .tokenizer
            .encode_chat_contents_as_text(&messages, true, &vars)
            .map_err(template_error)?
    } else {
        let text = session
            .tokenizer
            .apply_chat_template_with(&messages, true, &vars)
            .map_err(template_error)?;
        let ids = encode(session, &text)?;
        (text, ids)
    };
    if prompt.is_empty() {
        return Err(ApiError::invalid("the prompt is empty after tokenisation"));
    }
    let mut parsed = job(&req.common, prompt, session, d)?;
    parsed.prompt_opens_thinking = super::reasoning::opens_thinking(&text);
    Ok(parsed)
}

/// A completion request -> its job: the prompt as it is, no template (one-shot's --no-chat-template).
pub fn completion_job(req: &CompletionRequest, session: &Session, d: &Defaults) -> Result<Parsed, ApiError> {
    let text = match &req.prompt {
        PromptField::One(t) => t,
        PromptField::Many(v) if v.len() == 1 => &v[0],
        PromptField::Many(_) => {
            return Err(ApiError::invalid_param(
                "prompt",
                "give one prompt (a string, or a list of one)",
            ))
        }
    };
    if text.trim().is_empty() {
        return Err(ApiError::invalid_param("prompt", "the prompt is empty"));
    }
    check_fits(text.len(), session)?;
    let prompt = encode(session, text)?;
    job(&req.common, prompt, session, d)
}

/// Refuses, without tokenising it, a prompt whose `bytes` of text cannot fit the context window whatever
/// its tokens: a multi-megabyte body costs no more than its parsing.
fn check_fits(bytes: usize, session: &Session) -> Result<(), ApiError> {
    let ctx = session.model.config.max_position_embeddings;
    let fewest = session.tokenizer.fewest_tokens(bytes);
    if fewest >= ctx {
        return Err(ApiError::invalid(format!(
            "the prompt is at least {fewest} tokens ({bytes} bytes of text), longer than the model's context window of {ctx} tokens"
        )));
    }
    Ok(())
}

fn encode(session: &Session, text: &str) -> Result<Vec<u32>, ApiError> {
    let ids = session
        .tokenizer
        .encode(text)
        .map_err(|e| ApiError::invalid(format!("{e:#}")))?;
    if ids.is_empty() {
        return Err(ApiError::invalid("the prompt is empty after tokenisation"));
    }
    Ok(ids)
}

/// `max_new_tokens` when a request of `prompt_len` tokens reserves no more KV cache rows than `--kv-budget`
/// gives all requests decoding together: a default answer length is cut to fit, an asked one refused.
fn within_kv_budget(
    ctx: usize,
    prompt_len: usize,
    max_new_tokens: usize,
    asked: bool,
    name: &str,
    d: &Defaults,
) -> Result<usize, ApiError> {
    let Some(budget) = d.kv_rows else {
        return Ok(max_new_tokens);
    };
    if cache_rows(ctx, prompt_len, max_new_tokens) <= budget {
        return Ok(max_new_tokens);
    }
    // The most tokens that fit, if any (the context window does not cap the rows here, or they would fit).
    let fits = budget.checked_sub(prompt_len + BLOCK_ROOM).filter(|&n| n > 0);
    match fits {
        Some(n) if !asked => Ok(n),
        _ => Err(ApiError::invalid_param(
            name,
            format!(
                "a prompt of {prompt_len} tokens and {name} {max_new_tokens} need {} KV cache rows (a block's room included), more than this server's --kv-budget holds ({budget}); {}",
                cache_rows(ctx, prompt_len, max_new_tokens),
                match fits {
                    Some(n) => format!("ask for {name} {n} or fewer"),
                    None => "the prompt alone is too long for it".to_string(),
                }
            ),
        )),
    }
}

/// The fields both endpoints share, checked against the model's context window.
fn job(c: &Common, prompt: Vec<u32>, session: &Session, d: &Defaults) -> Result<Parsed, ApiError> {
    let ctx = session.model.config.max_position_embeddings;
    if prompt.len() >= ctx {
        return Err(ApiError::invalid(format!(
            "the prompt is {} tokens, longer than the model's context window of {ctx} tokens",
            prompt.len()
        )));
    }
    let room = ctx - prompt.len();
    let (name, asked) = match (c.max_completion_tokens, c.max_tokens) {
        (Some(n), _) => ("max_completion_tokens", Some(n)),
        (None, n) => ("max_tokens", n),
    };
    let cap = d.max_tokens.unwrap_or(usize::MAX);
    let max_new_tokens = match asked {
        None => d.max_new_tokens.min(room).min(cap),
        Some(0) => return Err(ApiError::invalid_param(name, format!("{name} must be at least 1"))),
        Some(n) if n > cap as u64 => {
            return Err(ApiError::invalid_param(
                name,
                format!("{name} is {n}, above this server's cap of {cap} (--max-tokens)"),
            ))
        }
        Some(n) if n > room as u64 => {
            return Err(ApiError::invalid_param(
                name,
                format!(
                    "{name} is {n}, but the prompt is {} tokens and the context window of {ctx} leaves room for {room}",
                    prompt.len()
                ),
            ))
        }
        Some(n) => n as usize,
    };
    let max_new_tokens = within_kv_budget(ctx, prompt.len(), max_new_tokens, asked.is_some(), name, d)?;
    let mut sampling = d.sampling;
    if let Some(t) = c.temperature {
        if !(t.is_finite() && (0.0..=2.0).contains(&t)) {
            return Err(ApiError::invalid_param(
                "temperature",
                format!("temperature must be in [0, 2] (got {t})"),
            ));
        }
        sampling.temperature = t;
    }
    if let Some(p) = c.top_p {
        if !(p > 0.0 && p <= 1.0) {
            return Err(ApiError::invalid_param(
                "top_p",
                format!("top_p must be in (0, 1] (got {p})"),
            ));
        }
        sampling.top_p = p;
    }
    if let Some(k) = c.top_k {
        sampling.top_k = k as usize;
    }
    if let Some(s) = c.seed {
        sampling.seed = s;
    }
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > MAX_STOP_STRINGS || stop.iter().any(String::is_empty) {
        return Err(ApiError::invalid_param(
            "stop",
            format!("stop takes at most {MAX_STOP_STRINGS} non-empty strings"),
        ));
    }
    if c.probespec.is_some() && !d.method_overrides {
        return Err(ApiError::invalid_param(
            "probespec",
            "this server decodes every request with its own method (--no-method-overrides)",
        ));
    }
    let method = match &c.probespec {
        Some(o) => o.method(&d.method, d.max_bc)?,
        None => MethodOverrides::default().method(&d.method, d.max_bc)?,
    };
    let stop_tokens = if c.ignore_eos == Some(true) {
        Vec::new()
    } else {
        session.stop_tokens()
    };
    Ok(Parsed {
        spec: JobSpec {
            prompt,
            method,
            params: GenerateParams {
                max_new_tokens,
                sampling,
                stop_tokens,
                max_block_rows: Some(d.max_bc),
            },
            stop,
        },
        stream: c.stream == Some(true),
        prompt_opens_thinking: false,
    })
}
