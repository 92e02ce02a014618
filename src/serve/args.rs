//! `probespec serve`'s flags: the model, numerics and method flags of one-shot generation (the defaults of
//! every request), the address, the access key and the queue's size.

use crate::decode::sampling::SamplingParams;
use crate::flags::{MethodArgs, ModelArgs, SamplingArgs};
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
    #[command(flatten)]
    pub sampling: SamplingArgs,
}

/// Where a chat answer's thinking goes (`--reasoning-format`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReasoningFormat {
    None,
    Deepseek,
}

impl ServeArgs {
    /// The sampling defaults, checked as one-shot generation checks its flags, and the queue's size.
    pub fn sampling(&self) -> Result<SamplingParams> {
        if self.queue == 0 {
            bail!("--queue must be at least 1");
        }
        self.sampling.params()
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
