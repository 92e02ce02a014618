//! The command-line flags the front ends share: which model (`ModelArgs`), which decoding method
//! (`MethodArgs`) and how to sample (`SamplingArgs`), with their conversion into the library's
//! [`ModelOptions`], [`Method`] and [`SamplingParams`]. One-shot generation, the conversation, `bench` and
//! `serve` flatten them into their own flags.

use crate::decode::drafters::lookahead::DEFAULT_WINDOW;
use crate::decode::drafters::pld::DEFAULT_DRAFT_LEN;
use crate::decode::method::{
    Budget, EspSpec, EspTree, HybridSpec, LookaheadConfig, MaskInit, Masks, Method, MethodKind, PldConfig,
};
use crate::decode::sampling::SamplingParams;
use crate::model::load::Activations;
use crate::session::{DeviceKind, ModelOptions};
use crate::tokenizer::{parse_template_vars, TemplateVars};
use anyhow::{bail, Result};
use candle_core::DType;
use clap::{Args, ValueEnum};

/// The most `--threads` per core of the machine.
pub const THREADS_PER_CORE: usize = 4;

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// HF checkpoint folder, GGUF file, or hub id (e.g. Qwen/Qwen3-0.6B). Default: SmolLM2-135M-Instruct GGUF.
    #[arg(long, short = 'm')]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value_t = DeviceArg::Cpu)]
    pub device: DeviceArg,
    /// Weight and activation dtype (default: f32 on CPU, bf16 on GPU).
    #[arg(long, value_enum)]
    pub dtype: Option<DTypeArg>,
    /// Dequantise GGUF Q4_0/Q4_1/Q8_0 weights at load instead of reading their blocks on the CPU (the
    /// output of `--activations f32`, more memory and memory traffic; for comparisons).
    #[arg(long)]
    pub dequantize: bool,
    /// Activations for GGUF quantised weights on the CPU: q8 (8-bit, integer dot products, fast; Q4_0,
    /// Q4_1, Q8_0, Q4_K, Q5_K, Q6_K) or f32 (the dequantised model's exact numbers).
    #[arg(long, value_enum, default_value_t = ActivationsArg::Q8)]
    pub activations: ActivationsArg,
    /// CPU threads, the calling one included (as llama.cpp's -t). Default: `RAYON_NUM_THREADS` if set,
    /// else one per core.
    #[arg(long, short = 't', value_parser = clap::value_parser!(u16).range(1..))]
    pub threads: Option<u16>,
    /// What the KV cache holds on the CPU in f32 (the default dtype there): bf16 (default: half the
    /// memory, faster steps after a thousand tokens; rounds keys and values, which changes answers about
    /// as often as 8-bit activations do) or f32. Either is lossless: plain and speculative decoding share
    /// it. (`--dtype f16/bf16` on the CPU caches f32, a GPU the model's dtype.)
    #[arg(long, value_enum)]
    pub kv_cache: Option<KvCacheArg>,
    /// Variables for the model's chat template, as a JSON object (transformers' `apply_chat_template`
    /// keyword arguments), e.g. '{"enable_thinking": false}' to turn Qwen 3's thinking off.
    #[arg(long, value_name = "JSON", value_parser = template_vars_arg)]
    pub chat_template_kwargs: Option<TemplateVars>,
    /// A Jinja chat template to use instead of the model's (for a checkpoint without one, or another
    /// variant of it), as transformers renders templates.
    #[arg(long, value_name = "FILE")]
    pub chat_template_file: Option<std::path::PathBuf>,
}

fn template_vars_arg(json: &str) -> Result<TemplateVars, String> {
    parse_template_vars(json).map_err(|e| format!("{e:#}"))
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvCacheArg {
    F32,
    Bf16,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationsArg {
    Q8,
    F32,
}

impl ModelArgs {
    /// Applies `--threads` to the process: the kernel pool, rayon and candle all size themselves from
    /// `RAYON_NUM_THREADS` when they first start. Call before anything has spawned a thread. More than
    /// [`THREADS_PER_CORE`] per core of this machine is an error: every thread spins between products, so
    /// thousands of them only stall the machine.
    pub fn apply_threads(&self) -> Result<()> {
        if let Some(n) = self.threads {
            let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
            let most = THREADS_PER_CORE * cores;
            if usize::from(n) > most {
                bail!("--threads {n} is more than {THREADS_PER_CORE} per core of this machine's {cores}: at most {most}");
            }
            std::env::set_var("RAYON_NUM_THREADS", n.to_string());
        }
        Ok(())
    }

    pub fn options(&self) -> ModelOptions {
        ModelOptions {
            model: self.model.clone(),
            device: match self.device {
                DeviceArg::Cpu => DeviceKind::Cpu,
                DeviceArg::Cuda => DeviceKind::Cuda,
                DeviceArg::Metal => DeviceKind::Metal,
            },
            dtype: self.dtype.map(|d| match d {
                DTypeArg::F32 => DType::F32,
                DTypeArg::F16 => DType::F16,
                DTypeArg::Bf16 => DType::BF16,
            }),
            dequantize: self.dequantize,
            activations: match self.activations {
                ActivationsArg::Q8 => Activations::Q8,
                ActivationsArg::F32 => Activations::F32,
            },
            kv_dtype: self.kv_cache.map(|k| match k {
                KvCacheArg::F32 => DType::F32,
                KvCacheArg::Bf16 => DType::BF16,
            }),
            chat_template_vars: self.chat_template_kwargs.clone().unwrap_or_default(),
            chat_template_file: self.chat_template_file.clone(),
        }
    }
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceArg {
    Cpu,
    Cuda,
    Metal,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum DTypeArg {
    F32,
    F16,
    Bf16,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum MethodArg {
    Ar,
    Esp,
    /// Prompt Lookup Decoding: an n-gram match in the prompt and output drafts a chain.
    Pld,
    /// Lookahead decoding: a Jacobi window and an n-gram pool (one Jacobi level).
    Lookahead,
    /// ESP's mask candidates, prompt lookup and n-gram continuations in one tree under one --bc.
    Hybrid,
}

impl From<MethodArg> for MethodKind {
    fn from(m: MethodArg) -> Self {
        match m {
            MethodArg::Ar => MethodKind::Ar,
            MethodArg::Esp => MethodKind::Esp,
            MethodArg::Pld => MethodKind::Pld,
            MethodArg::Lookahead => MethodKind::Lookahead,
            MethodArg::Hybrid => MethodKind::Hybrid,
        }
    }
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum TreeArg {
    Dynamic,
    Static,
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskInitArg {
    Mean,
    Normal,
    Last,
}

impl From<MaskInitArg> for MaskInit {
    fn from(a: MaskInitArg) -> Self {
        match a {
            MaskInitArg::Mean => MaskInit::Mean,
            MaskInitArg::Normal => MaskInit::Normal,
            MaskInitArg::Last => MaskInit::Last,
        }
    }
}

pub fn parse_budget(s: &str) -> std::result::Result<Budget, String> {
    s.parse()
}

#[derive(Args, Debug, Clone)]
pub struct MethodArgs {
    /// Decoding method. The default, hybrid, is ESP's masks plus prompt lookup in one tree: under
    /// `--bc auto` it sends masks where they pay and lookup chains where those do (on a 2-core CPU ESP
    /// alone decodes plainly).
    #[arg(long, value_enum, default_value_t = MethodArg::Hybrid)]
    pub method: MethodArg,
    /// Block complexity of esp and hybrid: tokens per forward pass, masks included, (k+1)(1 + sum K_i).
    /// "auto" (every method): each step's block is chosen from the forward cost at the current cache
    /// length and the acceptance seen so far, down to plain decoding; pld's chain length and lookahead's
    /// window too, unless --draft-len / --lookahead-window fix them.
    #[arg(long, default_value = "auto", value_parser = parse_budget)]
    pub bc: Budget,
    /// Mask tokens per tree node (k).
    #[arg(long, default_value_t = 1)]
    pub masks: usize,
    #[arg(long, value_enum, default_value_t = TreeArg::Dynamic)]
    pub tree: TreeArg,
    /// Explicit static tree: candidates per depth, e.g. 15,4 (implies --tree static; overrides --bc).
    #[arg(long, value_delimiter = ',')]
    pub branches: Option<Vec<usize>>,
    #[arg(long, value_enum, default_value_t = MaskInitArg::Mean)]
    pub mask_init: MaskInitArg,
    /// Mask update rate: m <- m + lambda (e - m) per committed token.
    #[arg(long, default_value_t = 0.1)]
    pub mask_lambda: f32,
    /// pld, hybrid: longest suffix matched against the prompt and output (n = this down to 1).
    #[arg(long, default_value_t = 3)]
    pub ngram: usize,
    /// pld, hybrid: most tokens drafted from one match [default: chosen per step with --bc auto, else 10].
    #[arg(long)]
    pub draft_len: Option<usize>,
    /// lookahead: window W (Jacobi probe rows per step) [default: chosen per step with --bc auto, else 7].
    #[arg(long)]
    pub lookahead_window: Option<usize>,
    /// lookahead: n-gram size N.
    #[arg(long, default_value_t = 5)]
    pub lookahead_ngram: usize,
    /// lookahead: most verification candidates G per step.
    #[arg(long, default_value_t = 7)]
    pub lookahead_guesses: usize,
}

impl MethodArgs {
    /// The method these flags describe.
    pub fn method(&self) -> Result<Method> {
        if self.method != MethodArg::Esp && (self.branches.is_some() || self.tree == TreeArg::Static) {
            bail!("--branches and --tree static shape ESP's tree: add --method esp");
        }
        let masks = Masks {
            count: self.masks,
            init: self.mask_init.into(),
            lambda: self.mask_lambda,
        };
        // A size given on the command line is fixed; one left out is chosen per step under --bc auto and
        // takes its classic default under a fixed --bc.
        let fixed = |given: Option<usize>, default: usize| {
            given.or(match self.bc {
                Budget::Auto => None,
                Budget::Fixed(_) => Some(default),
            })
        };
        // The hybrid's chains are candidates its node budget chooses among: their length is not a policy.
        let lookup = |draft_len| PldConfig {
            max_ngram: self.ngram,
            draft_len,
        };
        Ok(match self.method {
            MethodArg::Ar => Method::Ar,
            MethodArg::Esp => Method::Esp(EspSpec {
                masks,
                budget: self.bc,
                tree: match (&self.branches, self.tree) {
                    (Some(b), _) => EspTree::Static(Some(b.clone())),
                    (None, TreeArg::Static) => EspTree::Static(None),
                    (None, TreeArg::Dynamic) => EspTree::Dynamic,
                },
            }),
            MethodArg::Pld => Method::Pld(lookup(fixed(self.draft_len, DEFAULT_DRAFT_LEN))),
            MethodArg::Lookahead => Method::Lookahead(LookaheadConfig {
                window: fixed(self.lookahead_window, DEFAULT_WINDOW),
                ngram: self.lookahead_ngram,
                guesses: self.lookahead_guesses,
                seed: 0,
            }),
            MethodArg::Hybrid => Method::Hybrid(HybridSpec {
                masks,
                budget: self.bc,
                lookup: lookup(self.draft_len),
            }),
        })
    }
}

/// How to sample: greedy by default. In `serve` these are the defaults of a request that leaves them out.
#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Most new tokens (serve: a request's default, cut to the room the context window leaves).
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus sampling: the smallest set of tokens whose probabilities sum to at least this.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Sample among the k most likely tokens; 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed of the sampler (and of the drafters that draw at random).
    #[arg(long, default_value_t = 299792458)]
    pub seed: u64,
}

impl SamplingArgs {
    /// The sampling flags, checked, as the library's [`SamplingParams`].
    pub fn params(&self) -> Result<SamplingParams> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("--temperature must be >= 0 (got {})", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("--top-p must be in (0, 1] (got {})", self.top_p);
        }
        if self.max_new_tokens == 0 {
            bail!("--max-new-tokens must be at least 1");
        }
        Ok(SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
        })
    }
}
