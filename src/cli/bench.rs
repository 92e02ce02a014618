//! The benchmark-side subcommands: the flags of `bench` (a run, or `report` / `merge` / `export` of
//! earlier runs), `cost` (the forward cost curve) and `shape-gguf` (a random GGUF of a published shape),
//! their conversion into the library's options, and their front ends.

use crate::bench::cost::CostOptions;
use crate::bench::export::Format;
use crate::bench::runner::BenchOptions;
use crate::decode::method::Budget;
use crate::flags::{parse_budget, MaskInitArg, MethodArg, ModelArgs, TreeArg};
use anyhow::Result;
use clap::{Args, Subcommand, ValueEnum};
use std::path::PathBuf;

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
    /// Runs of each question by every configuration, interleaved; each turn keeps the run of median wall
    /// time (for a machine whose load moves one run's time). 1: Spec-Bench's single run.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=100))]
    pub repeats: u32,
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
            repeats: self.repeats as usize,
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
    /// Each row a sequence of its own, after its own cache of --cache tokens: what decoding that many
    /// sequences in one forward pass costs over one.
    #[arg(long)]
    pub sequences: bool,
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
    #[arg(long, conflicts_with_all = ["shape", "rows", "cache", "repeats", "sequences"])]
    pub save: bool,
    /// Also draw the curve (a block's cost over one row's, a line per cache length) as an SVG chart.
    #[arg(long, value_name = "FILE", conflicts_with = "save")]
    pub svg: Option<PathBuf>,
    /// llama-bench's JSON output on the same model (`llama-bench -o json -p 1,2,4,... -n 0 -d C`), drawn
    /// dashed beside probespec's curve in the --svg chart.
    #[arg(long, value_name = "FILE", requires = "svg")]
    pub peer: Option<PathBuf>,
}

impl CostArgs {
    pub fn options(&self) -> CostOptions {
        CostOptions {
            model: self.model.options(),
            shape: self.shape.clone(),
            rows: self.rows.clone(),
            sequences: self.sequences,
            cache: self.cache.clone(),
            repeats: self.repeats,
            json: self.json,
            save: self.save,
            svg: self.svg.clone(),
            peer: self.peer.clone(),
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

/// `probespec bench`: a run, or `report` / `merge` / `export` of earlier runs.
pub(super) fn run_bench(b: &BenchArgs) -> Result<()> {
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

/// `probespec cost`: the forward cost curve of a model or of a named shape.
pub(super) fn run_cost(a: &CostArgs) -> Result<()> {
    crate::bench::cost::run(&a.options())
}

/// `probespec shape-gguf`: a GGUF of random weights in a published shape.
pub(super) fn run_shape_gguf(a: ShapeGgufArgs) -> Result<()> {
    crate::model::shape_gguf::run(&crate::model::shape_gguf::ShapeGgufOptions {
        shape: a.shape,
        format: a.format,
        tokenizer: a.tokenizer,
        out: a.out,
        seed: a.seed,
    })
}
