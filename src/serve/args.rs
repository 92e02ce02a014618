//! `probespec serve`'s flags: the model, numerics and method flags of one-shot generation (the defaults of
//! every request), the address, the access key and the queue's size.

use crate::cli::{MethodArgs, ModelArgs};
use crate::decode::sampling::SamplingParams;
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
    /// Requests that may wait while one decodes; one more is answered 503 with Retry-After.
    #[arg(long, default_value_t = 16)]
    pub queue: usize,
    /// Largest request body, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_body: usize,
    /// How a chat answer's thinking (a `<think>` block, as Qwen 3's) is sent: none (in the content, as the
    /// one-shot CLI prints it) or deepseek (apart, in `reasoning_content`, as vLLM's and llama.cpp's
    /// reasoning parsers send it).
    #[arg(long, value_enum, default_value_t = ReasoningFormat::None)]
    pub reasoning_format: ReasoningFormat,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub method: MethodArgs,
    /// Default of a request without max_tokens (cut to the room the context window leaves).
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Default of a request without temperature; 0 = greedy (as one-shot generation).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Default of a request without top_p.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Default of a request without top_k; 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Default of a request without seed (the one-shot default).
    #[arg(long, default_value_t = 299792458)]
    pub seed: u64,
}

/// Where a chat answer's thinking goes (`--reasoning-format`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    None,
    Deepseek,
}

impl ServeArgs {
    /// The sampling defaults, checked as one-shot generation checks its flags.
    pub fn sampling(&self) -> Result<SamplingParams> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("--temperature must be >= 0 (got {})", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1] (got {})", self.top_p);
        }
        if self.max_new_tokens == 0 {
            bail!("--max-new-tokens must be at least 1");
        }
        if self.queue == 0 {
            bail!("--queue must be at least 1");
        }
        Ok(SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
        })
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
