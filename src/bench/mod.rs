//! `probespec bench`: the Spec-Bench runner.
//!
//! - `probespec bench [--questions question.jsonl] [--methods ar,esp] [--bc 10,30,60] [--masks 1,2] ...`
//!   decodes every question with every configuration, interleaved per question, appending a record per
//!   question × turn × configuration to `DIR/records.jsonl` (resumable), then writes `summary.json`,
//!   `table.md` and `chart.svg` and prints the table;
//! - `probespec bench report DIR` re-renders those three from the records;
//! - `probespec bench merge OUT DIR...` joins the record sets of shards (`--shard I/N`) into OUT;
//! - `probespec bench export DIR --format spec-bench` writes Spec-Bench model-answer files ([`export`]).
//!
//! `probespec cost` (module [`cost`]) times the forward pass against block size.
//!
//! Layout: [`questions`] (file, groups, selection), [`runner`] (configurations, decoding, progress),
//! [`records`] (record file, run.json), [`report`] (metrics, table, summary), [`chart`] (SVG),
//! [`facts`] (machine and build facts).

pub mod chart;
pub mod cost;
pub mod export;
pub mod facts;
pub mod questions;
pub mod records;
pub mod report;
pub mod runner;

use crate::cli::{MaskInitArg, MethodArg, ModelArgs, TreeArg};
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use records::{read_records, write_atomic, write_records, Record, RunInfo, RECORDS_FILE};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub const SUMMARY_FILE: &str = "summary.json";
pub const TABLE_FILE: &str = "table.md";
pub const CHART_FILE: &str = "chart.svg";

/// `probespec bench`: run a benchmark (the flags), or `report` / `merge` existing runs.
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
        #[arg(long, value_enum, default_value_t = export::Format::SpecBench)]
        format: export::Format,
        /// Folder for the files (default: DIR/spec-bench).
        #[arg(long)]
        out: Option<PathBuf>,
    },
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
    /// Block complexities to try for esp and hybrid (one configuration each, times --masks); "auto" for esp.
    #[arg(long, value_delimiter = ',', default_values = ["30"], value_parser = crate::cli::parse_bc)]
    pub bc: Vec<usize>,
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
    /// Keep the first N questions of each category.
    #[arg(long)]
    pub limit_per_category: Option<usize>,
    /// Output folder; a folder with records is resumed.
    #[arg(long, default_value = "bench-out")]
    pub out: PathBuf,
    /// Run the questions at index % N == I of the selection (I in 0..N); join shards with `bench merge`.
    #[arg(long, value_name = "I/N", value_parser = questions::parse_shard)]
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

/// Runs `probespec bench ...`.
pub fn run(args: &BenchArgs) -> Result<()> {
    match &args.action {
        None => runner::run_bench(&args.run),
        Some(BenchAction::Report { dir }) => report_dir(dir),
        Some(BenchAction::Merge { out, dirs }) => merge(out, dirs),
        Some(BenchAction::Export { dir, format, out }) => {
            read_run(dir)?;
            let file = read_records(&dir.join(RECORDS_FILE))?;
            if file.records.is_empty() {
                bail!("{} has no records", dir.join(RECORDS_FILE).display());
            }
            let out = out.clone().unwrap_or_else(|| dir.join("spec-bench"));
            for path in export::write(*format, &file.records, &out)? {
                println!("{}", path.display());
            }
            Ok(())
        }
    }
}

/// Writes summary.json, table.md and chart.svg into `dir` and returns the table.
pub fn render_outputs(dir: &Path, run: &RunInfo, records: Vec<Record>) -> Result<String> {
    let report = report::compute(records);
    let table = report::render_table(run, &report);
    let mut summary = serde_json::to_string_pretty(&report::summary_json(run, &report))?;
    summary.push('\n');
    write_atomic(&dir.join(SUMMARY_FILE), summary.as_bytes())?;
    write_atomic(&dir.join(TABLE_FILE), table.as_bytes())?;
    write_atomic(&dir.join(CHART_FILE), chart::render_svg(&report)?.as_bytes())?;
    Ok(table)
}

fn read_run(dir: &Path) -> Result<RunInfo> {
    if !dir.is_dir() {
        bail!("{} is not a folder", dir.display());
    }
    RunInfo::read(dir)?.with_context(|| {
        format!(
            "{} has no run.json: not an output folder of `probespec bench`",
            dir.display()
        )
    })
}

/// `bench report DIR`.
fn report_dir(dir: &Path) -> Result<()> {
    let run = read_run(dir)?;
    let file = read_records(&dir.join(RECORDS_FILE))?;
    if file.records.is_empty() {
        bail!("{} has no records", dir.join(RECORDS_FILE).display());
    }
    let table = render_outputs(dir, &run, file.records)?;
    print!("{table}");
    Ok(())
}

/// `bench merge OUT DIR...`.
fn merge(out: &Path, dirs: &[PathBuf]) -> Result<()> {
    let canon = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let mut merged: Option<RunInfo> = None;
    let mut records: Vec<Record> = Vec::new();
    let mut index: HashMap<(i64, usize, String), usize> = HashMap::new();
    for dir in dirs {
        let run = read_run(dir)?;
        let file = read_records(&dir.join(RECORDS_FILE))?;
        match &mut merged {
            None => merged = Some(run),
            Some(m) => {
                // Shards may sit on different machines, so paths and devices may differ; what decides
                // the tokens may not.
                let soft = ["shard", "questions_file", "model", "model_description", "device"];
                let hard = records::setting_differences(&m.settings, &run.settings, &soft);
                if !hard.is_empty() {
                    bail!(
                        "{} was run with other settings than {}: {}",
                        dir.display(),
                        dirs[0].display(),
                        hard.join("; ")
                    );
                }
                for d in
                    records::setting_differences(&m.settings, &run.settings, &["shard", "questions_file"])
                {
                    eprintln!(
                        "warning: {} differs from {} in {d}",
                        dir.display(),
                        dirs[0].display()
                    );
                }
                m.invocations.extend(run.invocations);
            }
        }
        for r in file.records {
            match index.get(&r.key()) {
                Some(&i) if records[i].tokens != r.tokens => eprintln!(
                    "warning: question {} turn {} {} is in several shards with different tokens; keeping the first",
                    r.question_id, r.turn, r.config
                ),
                Some(_) => {}
                None => {
                    index.insert(r.key(), records.len());
                    records.push(r);
                }
            }
        }
    }
    let mut run = merged.context("no folders to merge")?;
    run.settings.shard = None;
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let out_records = out.join(RECORDS_FILE);
    if out_records.exists() && !dirs.iter().any(|d| canon(d) == canon(out)) {
        bail!(
            "{} already holds records; merge into an empty folder (or list it among the folders to merge)",
            out.display()
        );
    }
    write_records(&out_records, &records)?;
    run.write(out)?;
    let table = render_outputs(out, &run, records)?;
    print!("{table}");
    Ok(())
}
