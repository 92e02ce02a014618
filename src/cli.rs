//! Command-line interface: argument parsing and wiring only.

use crate::decode::ar::Autoregressive;
use crate::decode::esp::{Esp, EspConfig, MaskInit, TreeShape};
use crate::decode::generate::{generate, Drafter, GenerateParams};
use crate::decode::hybrid::{Hybrid, HybridConfig, HybridMode};
use crate::decode::lookahead::{Lookahead, LookaheadConfig};
use crate::decode::pld::{Pld, PldConfig};
use crate::decode::sampling::SamplingParams;
use crate::decode::tree::node_budget;
use crate::model::load::LoadOptions;
use crate::model::{load_model, LoadedModel, ModelSource};
use crate::tokenizer::{Message, StreamDecoder, TextTokenizer};
use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::io::{Read, Write};

#[derive(Parser, Debug)]
#[command(
    name = "probespec",
    version,
    about = "Faster lossless generation from a frozen LLM by embedding-space probing"
)]
#[command(args_conflicts_with_subcommands = true, allow_negative_numbers = true)]
pub struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    generate: GenerateArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Generate a reply to a prompt (the default command).
    #[command(allow_negative_numbers = true)]
    Generate(GenerateArgs),
    /// Spec-Bench benchmark: `bench --questions FILE`, `bench report DIR`, `bench merge OUT DIR...`.
    Bench(crate::bench::BenchArgs),
    /// Forward cost curve: one block of R rows after C cached tokens, for a model or a named shape.
    Cost(crate::bench::cost::CostArgs),
}

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
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActivationsArg {
    Q8,
    F32,
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

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum HybridModeArg {
    /// Every candidate source scored by its learnt acceptance, the best nodes kept.
    Scored,
    /// The prompt-lookup chain, then ESP's candidates fill the budget.
    Simple,
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

#[derive(Args, Debug, Clone)]
pub struct MethodArgs {
    /// Decoding method.
    #[arg(long, value_enum, default_value_t = MethodArg::Esp)]
    pub method: MethodArg,
    /// Block complexity: tokens per forward pass, masks included, (k+1)(1 + sum K_i); "auto" picks it per
    /// step from the measured forward cost and the observed acceptance (stored as 0).
    #[arg(long, default_value = "auto", value_parser = parse_bc)]
    pub bc: usize,
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
    /// pld, hybrid: most tokens drafted from one match.
    #[arg(long, default_value_t = 10)]
    pub draft_len: usize,
    /// lookahead: window W (Jacobi probe rows per step).
    #[arg(long, default_value_t = 7)]
    pub lookahead_window: usize,
    /// lookahead: n-gram size N.
    #[arg(long, default_value_t = 5)]
    pub lookahead_ngram: usize,
    /// lookahead: most verification candidates G per step.
    #[arg(long, default_value_t = 7)]
    pub lookahead_guesses: usize,
    /// hybrid: how the candidate sources share the node budget.
    #[arg(long, value_enum, default_value_t = HybridModeArg::Scored)]
    pub hybrid_mode: HybridModeArg,
}

impl Default for MethodArgs {
    /// The defaults of the flags above (what `probespec generate` gets without them).
    fn default() -> Self {
        use clap::FromArgMatches;
        let m = MethodArgs::augment_args(clap::Command::new("defaults")).get_matches_from(["defaults"]);
        MethodArgs::from_arg_matches(&m).expect("every method flag has a default")
    }
}

#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    /// The prompt; read from stdin when absent or "-".
    pub prompt: Option<String>,
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub method: MethodArgs,
    /// System message for the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// Feed the prompt verbatim instead of through the model's chat template.
    #[arg(long)]
    pub no_chat_template: bool,
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    #[arg(long, default_value_t = 299792458)]
    pub seed: u64,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

/// Entry point: returns the process exit code. Errors are one line on stderr.
pub fn main() -> i32 {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return 0;
            }
            let text = e.to_string();
            eprintln!("{}", text.lines().next().unwrap_or("invalid arguments"));
            return 2;
        }
    };
    let result = match cli.command {
        Some(Command::Generate(args)) => run_generate(&args),
        Some(Command::Bench(args)) => crate::bench::run(&args),
        Some(Command::Cost(args)) => crate::bench::cost::run(&args),
        None => run_generate(&cli.generate),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            1
        }
    }
}

pub fn select_device(d: DeviceArg) -> Result<Device> {
    match d {
        DeviceArg::Cpu => Ok(Device::Cpu),
        DeviceArg::Cuda => {
            if !candle_core::utils::cuda_is_available() {
                bail!("CUDA is not available: this binary was built without the `cuda` feature or no GPU was found");
            }
            Ok(Device::new_cuda(0)?)
        }
        DeviceArg::Metal => {
            if !candle_core::utils::metal_is_available() {
                bail!("Metal is not available: this binary was built without the `metal` feature");
            }
            Ok(Device::new_metal(0)?)
        }
    }
}

/// The dtype asked for, or the device's default: f32 on the CPU, bf16 on a GPU.
pub fn select_dtype(d: Option<DTypeArg>, device: &Device) -> DType {
    match d {
        Some(DTypeArg::F32) => DType::F32,
        Some(DTypeArg::F16) => DType::F16,
        Some(DTypeArg::Bf16) => DType::BF16,
        None if device.is_cpu() => DType::F32,
        None => DType::BF16,
    }
}

pub fn load(args: &ModelArgs) -> Result<LoadedModel> {
    let device = select_device(args.device)?;
    let dtype = select_dtype(args.dtype, &device);
    let source = ModelSource::resolve(args.model.as_deref())?;
    load_model(
        &source,
        &LoadOptions {
            device,
            dtype,
            dequantize: args.dequantize,
            activations: match args.activations {
                ActivationsArg::Q8 => crate::model::load::Activations::Q8,
                ActivationsArg::F32 => crate::model::load::Activations::F32,
            },
        },
    )
}

/// Builds the drafter a method's flags describe.
pub fn make_drafter(m: &MethodArgs, seed: u64) -> Result<Box<dyn Drafter>> {
    Ok(match m.method {
        MethodArg::Ar => Box::new(Autoregressive),
        MethodArg::Esp => {
            if !(0.0..=1.0).contains(&m.mask_lambda) {
                bail!("--mask-lambda must be in [0, 1] (got {})", m.mask_lambda);
            }
            let tree = match (&m.branches, m.tree) {
                (Some(b), _) => TreeShape::Static { branches: b.clone() },
                (None, TreeArg::Dynamic) if m.bc == BC_AUTO => TreeShape::Auto,
                (None, TreeArg::Dynamic) => TreeShape::Dynamic { budget: budget(m)? },
                (None, TreeArg::Static) => TreeShape::Static {
                    branches: default_branches(budget(m)?, m.masks),
                },
            };
            let init = mask_init(m.mask_init);
            Box::new(Esp::new(EspConfig {
                masks: m.masks,
                tree,
                lambda: m.mask_lambda,
                init,
                seed,
            })?)
        }
        MethodArg::Pld => Box::new(Pld::new(PldConfig {
            max_ngram: m.ngram,
            draft_len: m.draft_len,
        })?),
        MethodArg::Lookahead => Box::new(Lookahead::new(LookaheadConfig {
            window: m.lookahead_window,
            ngram: m.lookahead_ngram,
            guesses: m.lookahead_guesses,
            seed,
        })?),
        MethodArg::Hybrid => {
            if !(0.0..=1.0).contains(&m.mask_lambda) {
                bail!("--mask-lambda must be in [0, 1] (got {})", m.mask_lambda);
            }
            let mut c = HybridConfig::new(m.masks, budget(m)?);
            c.max_ngram = m.ngram;
            c.draft_len = m.draft_len;
            c.lambda = m.mask_lambda;
            c.init = mask_init(m.mask_init);
            c.seed = seed;
            c.mode = match m.hybrid_mode {
                HybridModeArg::Scored => HybridMode::Scored,
                HybridModeArg::Simple => HybridMode::Simple,
            };
            Box::new(Hybrid::new(c)?)
        }
    })
}

fn mask_init(a: MaskInitArg) -> MaskInit {
    match a {
        MaskInitArg::Mean => MaskInit::Mean,
        MaskInitArg::Normal => MaskInit::Normal,
        MaskInitArg::Last => MaskInit::Last,
    }
}

/// `--bc` value: a number, or "auto" ([`BC_AUTO`]).
pub fn parse_bc(s: &str) -> std::result::Result<usize, String> {
    match s {
        "auto" => Ok(BC_AUTO),
        _ => match s.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(format!(
                "'{s}' is not a block complexity (a positive number or 'auto')"
            )),
        },
    }
}

/// The stored value of `--bc auto`.
pub const BC_AUTO: usize = 0;

fn budget(m: &MethodArgs) -> Result<usize> {
    if !(1..=3).contains(&m.masks) {
        bail!("--masks must be 1, 2 or 3 (got {})", m.masks);
    }
    // Only ESP's dynamic tree has an auto policy; elsewhere "auto" (the default) means the paper's BC 30.
    let bc = if m.bc == BC_AUTO { 30 } else { m.bc };
    node_budget(bc, m.masks).map_err(|e| anyhow::anyhow!(e))
}

/// A static shape for a node budget: the paper's proportions (BC 30, k=2: [7, 2]; BC 60, k=2: [15, 4]).
pub fn default_branches(budget: usize, k: usize) -> Vec<usize> {
    if k == 1 || budget < k {
        return vec![budget.max(1)];
    }
    let deeper = ((budget as f32 / 5.0).round() as usize).max(1);
    let mut b = vec![budget.saturating_sub(deeper * (k - 1)).max(1)];
    b.extend(std::iter::repeat_n(deeper, k - 1));
    b
}

/// The prompt text: the argument, or stdin when absent or "-".
fn read_prompt(arg: Option<&str>) -> Result<String> {
    match arg {
        Some(p) if p != "-" => Ok(p.to_string()),
        _ => {
            let mut buf = Vec::new();
            std::io::stdin()
                .read_to_end(&mut buf)
                .context("cannot read stdin")?;
            String::from_utf8(buf).map_err(|e| {
                anyhow::anyhow!("stdin is not valid UTF-8 (byte {})", e.utf8_error().valid_up_to())
            })
        }
    }
}

/// Prompt text -> token ids, through the chat template unless disabled.
pub fn encode_prompt(tok: &TextTokenizer, text: &str, system: Option<&str>, chat: bool) -> Result<Vec<u32>> {
    if text.trim().is_empty() {
        bail!("the prompt is empty");
    }
    let rendered = if chat {
        let mut messages = Vec::new();
        if let Some(s) = system {
            messages.push(Message {
                role: "system".into(),
                content: s.into(),
            });
        }
        messages.push(Message {
            role: "user".into(),
            content: text.into(),
        });
        tok.apply_chat_template(&messages, true)?
    } else {
        text.to_string()
    };
    let ids = tok.encode(&rendered)?;
    if ids.is_empty() {
        bail!("the prompt is empty after tokenisation");
    }
    Ok(ids)
}

fn check_sampling(a: &GenerateArgs) -> Result<SamplingParams> {
    if !(a.temperature >= 0.0 && a.temperature.is_finite()) {
        bail!("--temperature must be >= 0 (got {})", a.temperature);
    }
    if !(a.top_p > 0.0 && a.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1] (got {})", a.top_p);
    }
    if a.max_new_tokens == 0 {
        bail!("--max-new-tokens must be at least 1");
    }
    Ok(SamplingParams {
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
    })
}

fn run_generate(a: &GenerateArgs) -> Result<()> {
    let sampling = check_sampling(a)?;
    let mut drafter = make_drafter(&a.method, a.seed)?;
    let text = read_prompt(a.prompt.as_deref())?;
    if text.trim().is_empty() {
        bail!("the prompt is empty");
    }
    let LoadedModel { model, tokenizer, .. } = load(&a.model)?;
    let prompt = encode_prompt(&tokenizer, &text, a.system.as_deref(), !a.no_chat_template)?;
    let params = GenerateParams {
        max_new_tokens: a.max_new_tokens,
        sampling,
        stop_tokens: tokenizer.stop_tokens().to_vec(),
    };
    let mut stream = StreamDecoder::new(&tokenizer);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let json = a.json;
    let result = generate(&model, &prompt, drafter.as_mut(), &params, &mut |t| {
        if !json {
            if let Some(s) = stream.push(t)? {
                out.write_all(s.as_bytes())?;
                out.flush()?;
            }
        }
        Ok(())
    });
    let g = match result {
        Ok(g) => g,
        Err(e) => {
            if !json {
                let _ = writeln!(out);
            }
            return Err(e);
        }
    };
    if json {
        let v = serde_json::json!({
            "text": tokenizer.decode(&g.tokens)?,
            "token_ids": g.tokens,
            "prompt_token_ids": prompt,
            "finish_reason": g.finish_reason,
            "stats": g.stats,
        });
        writeln!(out, "{v}")?;
    } else {
        if let Some(s) = stream.finish()? {
            out.write_all(s.as_bytes())?;
        }
        writeln!(out)?;
        out.flush()?;
        eprintln!("{}", g.stats.summary_line(prompt.len()));
    }
    Ok(())
}
