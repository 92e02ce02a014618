//! Command-line interface: clap's flags, their conversion into the library's types ([`ModelOptions`],
//! [`Method`], the benchmark's options), and the terminal front ends (one-shot generation, the interactive
//! conversation). Everything else is library code; nothing in the library imports this module.

use crate::bench::cost::CostOptions;
use crate::bench::export::Format;
use crate::bench::runner::BenchOptions;
use crate::decode::drafters::lookahead::DEFAULT_WINDOW;
use crate::decode::drafters::pld::DEFAULT_DRAFT_LEN;
use crate::decode::generate::GenerateParams;
use crate::decode::method::{
    Budget, EspSpec, EspTree, HybridSpec, LookaheadConfig, MaskInit, Masks, Method, MethodKind, PldConfig,
};
use crate::decode::sampling::SamplingParams;
use crate::model::load::Activations;
use crate::session::{DeviceKind, ModelOptions, Session};
use crate::tokenizer::StreamDecoder;
use anyhow::{bail, Context, Result};
use candle_core::DType;
use clap::{Args, Parser, Subcommand, ValueEnum};
use std::io::{Read, Write};
use std::path::PathBuf;

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
    /// Spec-Bench benchmark: `bench [--questions FILE]`, `bench report DIR`, `bench merge OUT DIR...`,
    /// `bench export DIR`.
    Bench(BenchArgs),
    /// Forward cost curve: one block of R rows after C cached tokens, for a model or a named shape.
    Cost(CostArgs),
    /// Write a GGUF of random weights in a published shape and llama-quantize's mix (speed tests only).
    ShapeGguf(ShapeGgufArgs),
    /// An OpenAI-compatible HTTP server (/v1/chat/completions, /v1/completions, /v1/models, /health).
    #[command(allow_negative_numbers = true)]
    Serve(crate::serve::ServeArgs),
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

impl ModelArgs {
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

fn parse_budget(s: &str) -> std::result::Result<Budget, String> {
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

#[derive(Args, Debug, Clone)]
pub struct GenerateArgs {
    /// The prompt; read from stdin when "-" or when stdin is not a terminal. Absent with a terminal: an
    /// interactive conversation (/exit or Ctrl-D ends it, /reset starts over).
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
    /// Print the prompt as the model will read it (after the chat template) and exit.
    #[arg(long)]
    pub print_prompt: bool,
}

/// `probespec bench`: run a benchmark (the flags), or `report` / `merge` / `export` existing runs.
#[derive(Args, Debug, Clone)]
#[command(args_conflicts_with_subcommands = true)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub action: Option<BenchAction>,
    #[command(flatten)]
    pub run: BenchRunArgs,
}

#[derive(Subcommand, Debug, Clone)]
pub enum BenchAction {
    /// Re-render summary.json, table.md and chart.svg of DIR from its records, and print the table.
    Report {
        /// An output folder of `probespec bench`.
        dir: PathBuf,
    },
    /// Join the records of shard folders (`--shard I/N` runs) into OUT, then render it.
    Merge {
        /// Folder for the merged run (created; must not hold records of another run).
        out: PathBuf,
        /// Shard output folders.
        #[arg(required = true, num_args = 1..)]
        dirs: Vec<PathBuf>,
    },
    /// Write DIR's records in another tool's format: `--format spec-bench` gives one model-answer file
    /// per configuration, for Spec-Bench's `evaluation/speed.py`.
    Export {
        /// An output folder of `probespec bench`.
        dir: PathBuf,
        #[arg(long, value_enum, default_value_t = FormatArg::SpecBench)]
        format: FormatArg,
        /// Folder for the files (default: DIR/spec-bench).
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum FormatArg {
    /// Spec-Bench's model-answer JSON lines, one file per configuration.
    SpecBench,
}

#[derive(Args, Debug, Clone)]
pub struct BenchRunArgs {
    /// Question file: JSON lines {"question_id": int, "category": str, "turns": [str, ...]}, as Spec-Bench's
    /// question.jsonl. Default: Spec-Bench's own 480 questions, built into the binary.
    #[arg(long)]
    pub questions: Option<PathBuf>,
    #[command(flatten)]
    pub model: ModelArgs,
    /// Methods to compare; ar is the reference of speedups and of the lossless check.
    #[arg(long, value_enum, value_delimiter = ',', default_values_t = [MethodArg::Ar, MethodArg::Esp])]
    pub methods: Vec<MethodArg>,
    /// Block complexities to try for esp and hybrid (one configuration each, times --masks); "auto" chooses
    /// every step's block (pld and lookahead always choose theirs).
    #[arg(long, value_delimiter = ',', default_values = ["auto"], value_parser = parse_budget)]
    pub bc: Vec<Budget>,
    /// Mask counts (k) to try for esp and hybrid.
    #[arg(long, value_delimiter = ',', default_values_t = [1])]
    pub masks: Vec<usize>,
    /// ESP tree shape, for every ESP configuration.
    #[arg(long, value_enum, default_value_t = TreeArg::Dynamic)]
    pub tree: TreeArg,
    #[arg(long, value_enum, default_value_t = MaskInitArg::Mean)]
    pub mask_init: MaskInitArg,
    /// ESP mask update rate.
    #[arg(long, default_value_t = 0.1)]
    pub mask_lambda: f32,
    /// Spec-Bench's limit.
    #[arg(long, default_value_t = 1024)]
    pub max_new_tokens: usize,
    /// Keep only these categories or groups (e.g. writing,qa or mt_bench).
    #[arg(long, value_delimiter = ',')]
    pub categories: Vec<String>,
    /// Pass over the first N questions of each category (run questions other than the first few).
    #[arg(long, default_value_t = 0)]
    pub skip_per_category: usize,
    /// Keep the first N questions of each category (after those skipped).
    #[arg(long)]
    pub limit_per_category: Option<usize>,
    /// Output folder; a folder with records is resumed.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// Run the questions at index % N == I of the selection (I in 0..N); join shards with `bench merge`.
    #[arg(long, value_name = "I/N", value_parser = crate::bench::questions::parse_shard)]
    pub shard: Option<(usize, usize)>,
    /// Unrecorded runs of the first question by every configuration before measuring (Spec-Bench: 3).
    #[arg(long, default_value_t = 3)]
    pub warmup: usize,
    /// System message for the chat template.
    #[arg(long)]
    pub system: Option<String>,
    /// Seed of drafters that draw random numbers (--mask-init normal).
    #[arg(long, default_value_t = 299792458)]
    pub seed: u64,
}

impl BenchRunArgs {
    pub fn options(&self) -> BenchOptions {
        BenchOptions {
            questions: self.questions.clone(),
            model: self.model.options(),
            methods: self.methods.iter().map(|&m| m.into()).collect(),
            bc: self.bc.clone(),
            masks: self.masks.clone(),
            static_tree: self.tree == TreeArg::Static,
            mask_init: self.mask_init.into(),
            mask_lambda: self.mask_lambda,
            max_new_tokens: self.max_new_tokens,
            categories: self.categories.clone(),
            skip_per_category: self.skip_per_category,
            limit_per_category: self.limit_per_category,
            out: self.out.clone(),
            shard: self.shard,
            warmup: self.warmup,
            system: self.system.clone(),
            seed: self.seed,
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct CostArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Random weights of a published shape instead of a checkpoint: qwen3-0.6b, qwen3-4b, qwen3-8b,
    /// llama3.2-1b, llama3.2-3b, llama3.1-8b (= llama3-8b), smollm2-135m.
    #[arg(long, conflicts_with = "model")]
    pub shape: Option<String>,
    /// Block sizes (rows per forward pass).
    #[arg(long, value_delimiter = ',', default_value = "1,2,4,8,16,32,64")]
    pub rows: Vec<usize>,
    /// Cached tokens before the block.
    #[arg(long, value_delimiter = ',', default_value = "256,1024")]
    pub cache: Vec<usize>,
    /// Timed runs per point (the median is reported).
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// One JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Time the curve --bc auto uses (its own grid of cache lengths and rows) and save it in the cost
    /// cache (`$PROBESPEC_COST_DIR`, else `cost/` in the model folder), replacing what was there.
    #[arg(long, conflicts_with_all = ["shape", "rows", "cache", "repeats"])]
    pub save: bool,
}

impl CostArgs {
    pub fn options(&self) -> CostOptions {
        CostOptions {
            model: self.model.options(),
            shape: self.shape.clone(),
            rows: self.rows.clone(),
            cache: self.cache.clone(),
            repeats: self.repeats,
            json: self.json,
            save: self.save,
        }
    }
}

#[derive(Args, Debug, Clone)]
pub struct ShapeGgufArgs {
    /// Published shape: qwen3-0.6b, qwen3-4b, qwen3-8b, llama3.2-1b, llama3.2-3b, llama3.1-8b.
    #[arg(long)]
    pub shape: String,
    /// llama-quantize's mix: q4_k_m, q4_0 or q8_0.
    #[arg(long, default_value = "q4_k_m")]
    pub format: String,
    /// Folder with the shape family's byte-level BPE tokenizer.json and tokenizer_config.json.
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// The GGUF file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

fn run_bench(b: &BenchArgs) -> Result<()> {
    match &b.action {
        None => crate::bench::runner::run_bench(&b.run.options()),
        Some(BenchAction::Report { dir }) => crate::bench::report_dir(dir),
        Some(BenchAction::Merge { out, dirs }) => crate::bench::merge(out, dirs),
        Some(BenchAction::Export { dir, format, out }) => {
            let format = match format {
                FormatArg::SpecBench => Format::SpecBench,
            };
            for path in crate::bench::export_dir(dir, format, out.as_deref())? {
                crate::bench::write_stdout(&format!("{}\n", path.display()))?;
            }
            Ok(())
        }
    }
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
        Some(Command::Bench(args)) => run_bench(&args),
        Some(Command::Cost(args)) => crate::bench::cost::run(&args.options()),
        Some(Command::ShapeGguf(a)) => {
            crate::model::shape_gguf::run(&crate::model::shape_gguf::ShapeGgufOptions {
                shape: a.shape,
                format: a.format,
                tokenizer: a.tokenizer,
                out: a.out,
                seed: a.seed,
            })
        }
        Some(Command::Serve(args)) => crate::serve::run(&args),
        None => run_generate(&cli.generate),
    };
    match result {
        Ok(()) => 0,
        // A reader that stopped reading (`probespec ... | head`): end quietly, as Unix tools do.
        Err(e) if is_broken_pipe(&e) => 0,
        Err(e) => {
            eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            1
        }
    }
}

/// Whether an error comes from writing to a closed pipe.
fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
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
    use std::io::IsTerminal;
    if a.prompt.is_none() && std::io::stdin().is_terminal() {
        return run_chat(a);
    }
    let sampling = check_sampling(a)?;
    let method = a.method.method()?;
    method.validate()?;
    let text = read_prompt(a.prompt.as_deref())?;
    crate::session::check_prompt_text(&text)?;
    let session = Session::load(&a.model.options())?;
    if a.print_prompt {
        let text = session.render_prompt(&text, a.system.as_deref(), !a.no_chat_template)?;
        crate::bench::write_stdout(&text)?;
        return Ok(());
    }
    let prompt = session.encode_prompt(&text, a.system.as_deref(), !a.no_chat_template)?;
    let params = GenerateParams {
        max_new_tokens: a.max_new_tokens,
        sampling,
        stop_tokens: session.stop_tokens(),
    };
    let mut stream = StreamDecoder::new(&session.tokenizer);
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let json = a.json;
    let result = session.generate(&prompt, &method, &params, &mut |t| {
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
            "text": session.tokenizer.decode(&g.tokens)?,
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

/// The interactive conversation: one line per user message, the reply streamed, a stats line per turn.
fn run_chat(a: &GenerateArgs) -> Result<()> {
    use rustyline::error::ReadlineError;
    let sampling = check_sampling(a)?;
    let method = a.method.method()?;
    method.validate()?;
    if a.no_chat_template {
        bail!("--no-chat-template needs a prompt: the interactive conversation uses the chat template");
    }
    let loaded = Session::load(&a.model.options())?;
    let params = GenerateParams {
        max_new_tokens: a.max_new_tokens,
        sampling,
        stop_tokens: loaded.stop_tokens(),
    };
    let mut chat = crate::chat::Conversation::new(&loaded.model, &loaded.tokenizer, a.system.clone())?;
    let mut editor = rustyline::DefaultEditor::new().context("cannot open the terminal for input")?;
    eprintln!(
        "{} | {} | /exit or Ctrl-D to quit, /reset to start over",
        loaded.description,
        method_label(&method)
    );
    let stdout = std::io::stdout();
    loop {
        let line = match editor.readline(">>> ") {
            Ok(l) => l,
            Err(ReadlineError::Eof) => break,
            // Ctrl-C on an empty prompt: a new prompt, as shells do.
            Err(ReadlineError::Interrupted) => continue,
            Err(e) => return Err(e).context("cannot read from the terminal"),
        };
        let text = line.trim();
        match text {
            "" => continue,
            "/exit" | "/quit" | "/bye" => break,
            "/reset" | "/clear" => {
                chat.reset();
                eprintln!("(new conversation)");
                continue;
            }
            "/help" | "/?" => {
                eprintln!("/exit, /quit or Ctrl-D: quit | /reset: forget the conversation | anything else: a message");
                continue;
            }
            t if t.starts_with('/') => {
                eprintln!("unknown command {t} (/help lists them)");
                continue;
            }
            _ => {}
        }
        let _ = editor.add_history_entry(text);
        let mut drafter = method.drafter(a.seed)?;
        let mut stream = StreamDecoder::new(&loaded.tokenizer);
        let mut out = stdout.lock();
        let turn = chat.turn(text, drafter.as_mut(), &params, &mut |t| {
            if let Some(s) = stream.push(t)? {
                out.write_all(s.as_bytes())?;
                out.flush()?;
            }
            Ok(())
        });
        match turn {
            Ok(turn) => {
                if let Some(s) = stream.finish()? {
                    out.write_all(s.as_bytes())?;
                }
                writeln!(out)?;
                out.flush()?;
                let s = &turn.generation.stats;
                eprintln!(
                    "[{}] {} tok | {:.1} tok/s | tau {:.2} | {} | prefill {} tok ({} from cache) {:.2}s",
                    s.method,
                    s.new_tokens,
                    s.tokens_per_second,
                    s.tau,
                    crate::decode::stats::blocks_line(&s.block_histogram),
                    s.prefill_tokens,
                    turn.reused_tokens,
                    s.prefill_seconds
                );
            }
            Err(e) => {
                let _ = writeln!(out);
                // A turn that cannot run (the context is full, ...) ends the turn, not the conversation.
                eprintln!("error: {}", format!("{e:#}").replace('\n', " "));
            }
        }
    }
    Ok(())
}

/// "esp, bc auto" and the like, for the conversation's banner.
fn method_label(m: &Method) -> String {
    match m.budget() {
        Some(b) => format!("{}, bc {b}", m.kind()),
        None => m.kind().to_string(),
    }
}
