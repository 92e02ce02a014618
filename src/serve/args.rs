//! The flags of `probespec serve` and `run-batch`. Both take [`AnswerArgs`]: the model, numerics and method
//! flags of one-shot generation (the defaults of every request) and the limits on what a request may ask
//! (the largest block and answer). The server adds the address, the access key, the queue's size and the
//! limits that keep one client from holding it (connections, timeouts).

use super::api::{over_block_cap, Defaults};
use crate::decode::capacity::{self, Capacity};
use crate::decode::cost_cache;
use crate::flags::{MethodArgs, ModelArgs, SamplingArgs};
use crate::model::Transformer;
use anyhow::{bail, Result};
use clap::{Args, ValueEnum};

/// Environment variable read for the API key when `--api-key` is not given.
pub const API_KEY_ENV: &str = "PROBESPEC_API_KEY";

#[derive(Args, Debug, Clone)]
pub struct ServeArgs {
    /// Address to listen on (loopback by default: pass 0.0.0.0 to serve other machines).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on; 0 picks a free one (the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/ (default: $PROBESPEC_API_KEY when set).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Requests that may wait while others decode; one more is answered 503 with Retry-After.
    #[arg(long, default_value_t = 16)]
    pub queue: usize,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body: usize,
    /// Most connections open at once; one more is answered 503 and closed.
    #[arg(long, default_value_t = 64)]
    pub max_connections: usize,
    /// Seconds a connection has to send a request's headers, and may stay idle between requests, before
    /// it is closed.
    #[arg(long, default_value_t = 10)]
    pub header_timeout: u64,
    /// Seconds a request has to send its whole body (408 after).
    #[arg(long, default_value_t = 30)]
    pub body_timeout: u64,
    /// Requests decoded together, each step one forward pass over all of them (every answer the same as
    /// alone); 1 decodes one at a time; auto: from 1, doubled while that gives 15% more tokens a second on
    /// this machine's forward cost curve (where batching stops paying).
    #[arg(long, default_value = "auto", value_name = "N|auto", value_parser = parse_parallel)]
    pub parallel: Parallel,
    #[command(flatten)]
    pub answer: AnswerArgs,
}

/// The flags that say how a request is answered, which `serve` and `run-batch` share: the model, the
/// method and sampling defaults, and the limits on what a request may ask.
#[derive(Args, Debug, Clone)]
pub struct AnswerArgs {
    /// The largest block (tokens per forward pass, probes included) a step may send: a request asking for
    /// more with `probespec.bc`, `draft_len` or the lookahead sizes gets a 400 that says this cap.
    #[arg(long, default_value_t = 64)]
    pub max_bc: usize,
    /// The largest `max_tokens` a request may ask for (default: what the context window leaves).
    #[arg(long)]
    pub max_tokens: Option<usize>,
    /// MiB the KV caches of the requests decoding together may take (default: no bound but --parallel):
    /// a request waits until it fits beside the others, and one that can never fit gets a 400.
    #[arg(long, value_name = "MIB")]
    pub kv_budget: Option<u64>,
    /// With --parallel above 1: most prompt rows a step prefills beside the requests decoding, so that
    /// they keep producing tokens while a long prompt goes in; auto: as many as keep such a step within
    /// 0.4 s on this machine (from the forward cost curve); 0: a prompt goes in whole, between steps.
    #[arg(long, default_value = "auto", value_name = "ROWS|auto", value_parser = parse_prefill_chunk)]
    pub prefill_chunk: PrefillChunk,
    /// Refuse a request's `probespec` field (its method and budget) with a 400: every request decodes with
    /// the server's method flags.
    #[arg(long)]
    pub no_method_overrides: bool,
    /// How special-token strings in chat messages' contents are read: special (as transformers renders a
    /// template: `<|im_end|>` in a user message is that control token) or text (tokenised as plain text,
    /// so that a message cannot end its turn and forge another role).
    #[arg(long, value_enum, default_value_t = SpecialTokens::Special)]
    pub special_tokens_in_content: SpecialTokens,
    /// How a chat answer's thinking (a `<think>` block, as Qwen 3's) is sent: none (in the content, as the
    /// one-shot CLI prints it) or deepseek (apart, in `reasoning_content`, as vLLM's and llama.cpp's
    /// reasoning parsers send it).
    #[arg(long, value_enum, default_value_t = ReasoningFormat::None)]
    pub reasoning_format: ReasoningFormat,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub method: MethodArgs,
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// `--prefill-chunk`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PrefillChunk {
    /// From the forward cost curve ([`capacity::chunk_for`]).
    Auto,
    Rows(usize),
}

fn parse_prefill_chunk(s: &str) -> Result<PrefillChunk, String> {
    if s == "auto" {
        return Ok(PrefillChunk::Auto);
    }
    s.parse()
        .map(PrefillChunk::Rows)
        .map_err(|_| format!("'{s}' is neither a number of rows nor auto"))
}

/// Prompt rows a step prefills beside decoding requests where the cost curve cannot be had.
const FALLBACK_CHUNK: usize = 32;

/// `--parallel`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Parallel {
    /// From the forward cost curve ([`capacity::parallel_for`]).
    Auto,
    Count(usize),
}

/// Requests decoded together where the cost curve cannot be had: one at a time.
const FALLBACK_PARALLEL: usize = 1;

pub fn parse_parallel(s: &str) -> Result<Parallel, String> {
    if s == "auto" {
        return Ok(Parallel::Auto);
    }
    s.parse()
        .map(Parallel::Count)
        .map_err(|_| format!("'{s}' is neither a number of requests nor auto"))
}

/// How special-token strings in message contents are read (`--special-tokens-in-content`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpecialTokens {
    Special,
    Text,
}

/// Where a chat answer's thinking goes (`--reasoning-format`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    None,
    Deepseek,
}

impl ServeArgs {
    /// The server's flags checked, and the defaults of every request.
    pub fn defaults(&self) -> Result<Defaults> {
        if self.queue == 0 || self.parallel == Parallel::Count(0) {
            bail!("--queue and --parallel must be at least 1");
        }
        if self.max_connections == 0 {
            bail!("--max-connections must be at least 1");
        }
        if self.header_timeout == 0 || self.body_timeout == 0 {
            bail!("--header-timeout and --body-timeout must be at least 1 second");
        }
        self.answer.defaults()
    }

    /// The key to require: the flag, else the environment variable; an empty key is an error.
    pub fn api_key(&self) -> Result<Option<String>> {
        let key = match &self.api_key {
            Some(k) => Some(k.clone()),
            None => std::env::var(API_KEY_ENV).ok(),
        };
        match key {
            Some(k) if k.is_empty() => bail!("the API key is empty (--api-key or ${API_KEY_ENV})"),
            k => Ok(k),
        }
    }
}

impl AnswerArgs {
    /// The defaults of every request, checked as one-shot generation checks its flags: the sampling, the
    /// method, and its blocks within `--max-bc`.
    pub fn defaults(&self) -> Result<Defaults> {
        if self.max_bc == 0 || self.max_tokens == Some(0) || self.kv_budget == Some(0) {
            bail!("--max-bc, --max-tokens and --kv-budget must be at least 1");
        }
        let sampling = self.sampling.params()?;
        self.method.method()?.validate()?;
        if let Some((flag, rows)) = over_block_cap(&self.method, self.max_bc) {
            bail!(
                "--{} asks for blocks of {rows} rows, above --max-bc {}",
                flag.replace('_', "-"),
                self.max_bc
            );
        }
        Ok(Defaults {
            method: self.method.clone(),
            sampling,
            max_new_tokens: self.sampling.max_new_tokens,
            max_bc: self.max_bc,
            max_tokens: self.max_tokens,
            method_overrides: !self.no_method_overrides,
            contents_as_text: self.special_tokens_in_content == SpecialTokens::Text,
            kv_rows: None,
        })
    }

    /// `--kv-budget` in `model`'s KV cache rows.
    pub fn kv_rows(&self, model: &Transformer) -> Option<usize> {
        let bytes = self.kv_budget?.saturating_mul(1 << 20);
        Some(usize::try_from(bytes / model.kv_bytes_per_row() as u64).unwrap_or(usize::MAX))
    }

    /// How many requests may decode together (`parallel`) within the KV budget, and how a joining prompt
    /// goes in beside them, on `model`; the automatic ones from its cost curve.
    pub fn capacity(&self, parallel: Parallel, model: &Transformer) -> Capacity {
        // One request at a time needs no prefill chunk.
        let wanted = parallel == Parallel::Auto
            || (self.prefill_chunk == PrefillChunk::Auto && parallel != Parallel::Count(1));
        let curve = wanted
            .then(|| {
                cost_cache::curve_for(model)
                    .map_err(|e| eprintln!("probespec: no forward cost curve ({e:#})"))
                    .ok()
            })
            .flatten();
        let parallel = match parallel {
            Parallel::Count(n) => n,
            Parallel::Auto => curve
                .as_ref()
                .map_or(FALLBACK_PARALLEL, |c| capacity::parallel_for(c)),
        };
        let prefill_chunk = match self.prefill_chunk {
            _ if parallel < 2 => None,
            PrefillChunk::Rows(0) => None,
            PrefillChunk::Rows(rows) => Some(rows),
            PrefillChunk::Auto => Some(
                curve
                    .as_ref()
                    .map_or(FALLBACK_CHUNK, |c| capacity::chunk_for(c, parallel)),
            ),
        };
        Capacity {
            sequences: parallel,
            kv_rows: self.kv_rows(model),
            prefill_chunk,
        }
    }

    /// Whether a chat answer's thinking goes apart, in `reasoning_content`.
    pub fn thinking_apart(&self) -> bool {
        self.reasoning_format == ReasoningFormat::Deepseek
    }
}
