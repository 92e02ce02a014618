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
//! [`records`] (record file, run.json), [`report`] (metrics, table, summary), [`chart`] (SVG);
//! machine and build facts come from [`crate::facts`].

pub mod chart;
pub mod cost;
pub mod cost_chart;
pub mod export;
pub mod questions;
pub mod records;
pub mod report;
pub mod runner;

use anyhow::{bail, Context, Result};
use records::{read_records, write_atomic, write_records, Record, RunInfo, RECORDS_FILE};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Writes `text` to stdout, returning the error (a closed pipe among them) instead of panicking as `print!`
/// does, so a reader that stops reading ends the command quietly.
pub fn write_stdout(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())?;
    out.flush()?;
    Ok(())
}

pub const SUMMARY_FILE: &str = "summary.json";
pub const TABLE_FILE: &str = "table.md";
pub const CHART_FILE: &str = "chart.svg";

/// `bench export DIR`: writes DIR's records in `format` into `out` (default: DIR/spec-bench); returns the
/// files written.
pub fn export_dir(dir: &Path, format: export::Format, out: Option<&Path>) -> Result<Vec<PathBuf>> {
    read_run(dir)?;
    let file = read_records(&dir.join(RECORDS_FILE))?;
    if file.records.is_empty() {
        bail!("{} has no records", dir.join(RECORDS_FILE).display());
    }
    let out = out
        .map(Path::to_path_buf)
        .unwrap_or_else(|| dir.join("spec-bench"));
    export::write(format, &file.records, &out)
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
pub fn report_dir(dir: &Path) -> Result<()> {
    let run = read_run(dir)?;
    let file = read_records(&dir.join(RECORDS_FILE))?;
    if file.records.is_empty() {
        bail!("{} has no records", dir.join(RECORDS_FILE).display());
    }
    let table = render_outputs(dir, &run, file.records)?;
    write_stdout(&table)?;
    Ok(())
}

/// `bench merge OUT DIR...`.
pub fn merge(out: &Path, dirs: &[PathBuf]) -> Result<()> {
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
    write_stdout(&table)?;
    Ok(())
}
