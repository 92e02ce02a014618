//! The request bodies of `/v1/chat/completions` and `/v1/completions` in OpenAI's shapes, and their
//! conversion into a [`JobSpec`]: the prompt's token ids (through the model's chat template, as one-shot
//! generation renders a prompt), the method, the generation parameters and the stop strings. Every way a
//! body can be wrong ends here as an [`ApiError`] naming the field.

use super::error::ApiError;
use crate::decode::generate::GenerateParams;
use crate::decode::method::{Budget, Method};
use crate::decode::sampling::SamplingParams;
use crate::flags::{MethodArg, MethodArgs, TreeArg};
use crate::session::Session;
use crate::tokenizer::{check_template_vars, Message, TemplateVars};
use clap::ValueEnum;
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

/// Sampling and length fields common to both endpoints, and the fields that would change the answer in
/// ways this server does not implement (refused rather than ignored).
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
    pub n: Option<u64>,
    /// Not OpenAI's: vLLM's extension, generate to the length limit whatever the model says.
    pub ignore_eos: Option<bool>,
    pub frequency_penalty: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub logprobs: Option<Value>,
    pub logit_bias: Option<Value>,
    pub tools: Option<Value>,
    pub response_format: Option<Value>,
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
    pub echo: Option<bool>,
    pub suffix: Option<String>,
    pub best_of: Option<u64>,
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
    /// The method of the server's flags with these fields replaced, checked.
    pub fn method(&self, defaults: &MethodArgs) -> Result<Method, ApiError> {
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
        let method = a.method().map_err(param)?;
        method.validate().map_err(param)?;
        Ok(method)
    }
}

/// The server's defaults for what a request leaves out.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub method: MethodArgs,
    pub sampling: SamplingParams,
    pub max_new_tokens: usize,
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

/// Parses a JSON body into `T`, as a 400 on any error.
pub fn parse_body<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::invalid("the request body is empty: send a JSON object"));
    }
    serde_json::from_slice(bytes).map_err(|e| ApiError::invalid(format!("invalid request body: {e}")))
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
    let text = session
        .tokenizer
        .apply_chat_template_with(&messages, true, &vars)
        .map_err(|e| ApiError::invalid_param("messages", format!("{e:#}")))?;
    let prompt = encode(session, &text)?;
    let mut parsed = job(&req.common, prompt, session, d)?;
    parsed.prompt_opens_thinking = super::reasoning::opens_thinking(&text);
    Ok(parsed)
}

/// A completion request -> its job: the prompt as it is, no template (one-shot's --no-chat-template).
pub fn completion_job(req: &CompletionRequest, session: &Session, d: &Defaults) -> Result<Parsed, ApiError> {
    if req.echo == Some(true) || req.suffix.is_some() || req.best_of.is_some_and(|b| b != 1) {
        return Err(ApiError::invalid("echo, suffix and best_of are not supported"));
    }
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
    let prompt = encode(session, text)?;
    job(&req.common, prompt, session, d)
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

/// The fields both endpoints share, checked against the model's context window.
fn job(c: &Common, prompt: Vec<u32>, session: &Session, d: &Defaults) -> Result<Parsed, ApiError> {
    refuse_unsupported(c)?;
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
    let max_new_tokens = match asked {
        None => d.max_new_tokens.min(room),
        Some(0) => return Err(ApiError::invalid_param(name, format!("{name} must be at least 1"))),
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
    let method = c.probespec.as_ref().map_or_else(
        || MethodOverrides::default().method(&d.method),
        |o| o.method(&d.method),
    )?;
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
            },
            stop,
        },
        stream: c.stream == Some(true),
        prompt_opens_thinking: false,
    })
}

/// Fields that would change the answer in a way this server does not implement.
fn refuse_unsupported(c: &Common) -> Result<(), ApiError> {
    let refuse = |p: &str| {
        Err(ApiError::invalid_param(
            p,
            format!("{p} is not supported by this server"),
        ))
    };
    if c.n.is_some_and(|n| n != 1) {
        return refuse("n");
    }
    if c.frequency_penalty.is_some_and(|v| v != 0.0) {
        return refuse("frequency_penalty");
    }
    if c.presence_penalty.is_some_and(|v| v != 0.0) {
        return refuse("presence_penalty");
    }
    if c.logprobs
        .as_ref()
        .is_some_and(|v| !v.is_null() && v != &Value::Bool(false))
    {
        return refuse("logprobs");
    }
    if c.logit_bias
        .as_ref()
        .is_some_and(|v| v.as_object().is_some_and(|o| !o.is_empty()))
    {
        return refuse("logit_bias");
    }
    if c.tools
        .as_ref()
        .is_some_and(|v| v.as_array().is_some_and(|a| !a.is_empty()))
    {
        return refuse("tools");
    }
    if c.response_format
        .as_ref()
        .is_some_and(|v| v.get("type").is_some_and(|t| t != "text"))
    {
        return refuse("response_format");
    }
    Ok(())
}
