//! The records of a run, one JSON line per question × turn × configuration in `records.jsonl`, and the
//! run's settings and invocations in `run.json`.
//!
//! The record file is the run's only state: each record is appended and flushed as soon as its turn ends,
//! in one write, so a killed run loses at most the turn in flight and leaves at most one half-written last
//! line. Resuming reads the file back, drops that line and any question × configuration whose turns are
//! not all there (turn 2 depends on turn 1's answer, so a half-done conversation is redone whole).

use crate::decode::generate::FinishReason;
use crate::decode::method::{Budget, MethodKind};
use crate::tokenizer::TemplateVars;
use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};

pub const RECORDS_FILE: &str = "records.jsonl";
pub const RUN_FILE: &str = "run.json";

/// One turn of one question decoded by one configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub question_id: i64,
    pub category: String,
    pub group: String,
    /// 1-based turn number.
    pub turn: usize,
    /// Number of turns of the question, so completeness can be judged without the question file.
    pub turns: usize,
    pub config: String,
    pub method: MethodKind,
    pub bc: Option<Budget>,
    pub masks: Option<usize>,
    pub prompt_tokens: usize,
    pub new_tokens: usize,
    /// Decoding forward passes (prefill excluded).
    pub model_calls: usize,
    /// Tokens committed by those calls (the first token comes from prefill and is not counted).
    pub committed: usize,
    /// committed / model_calls.
    pub tau: f64,
    pub decode_seconds: f64,
    pub prefill_seconds: f64,
    /// Time of the whole generate call, prefill included: what Spec-Bench times.
    pub wall_seconds: f64,
    pub tokens: Vec<u32>,
    pub finish_reason: FinishReason,
    /// Tokens committed by each decoding call (Spec-Bench's `accept_lengths`; absent in older records).
    #[serde(default)]
    pub accept_lengths: Vec<usize>,
    /// The answer as text, special tokens removed and trimmed (what Spec-Bench stores as the turn).
    #[serde(default)]
    pub text: Option<String>,
    /// Tokens of `text` re-encoded as the model's tokenizer encodes a prompt (BOS included where the model
    /// adds one): what Spec-Bench's `speed.py` counts, minus one, for the baseline's tokens.
    #[serde(default)]
    pub text_tokens: Option<usize>,
    /// `block_histogram[r]` = decoding calls whose block had r rows: what `--bc auto` chose (absent in
    /// older records).
    #[serde(default)]
    pub block_histogram: Vec<usize>,
}

impl Record {
    pub fn key(&self) -> (i64, usize, String) {
        (self.question_id, self.turn, self.config.clone())
    }
}

/// What was read from a record file.
#[derive(Debug, Default)]
pub struct RecordFile {
    /// Records in file order, first occurrence of each (question, turn, config) only.
    pub records: Vec<Record>,
    /// The file needs rewriting before appending: a half-written last line, a duplicate or a
    /// partial conversation was dropped.
    pub dirty: bool,
    /// Human-readable notes about what was dropped.
    pub notes: Vec<String>,
}

/// Reads `records.jsonl` (absent: no records). A last line that does not parse is the remains of a
/// crash and is ignored; a bad line before it is an error naming the line.
pub fn read_records(path: &Path) -> Result<RecordFile> {
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(RecordFile::default()),
        Err(e) => return Err(anyhow!("cannot read {}: {e}", path.display())),
    };
    let mut out = RecordFile::default();
    let mut seen = HashSet::new();
    let lines: Vec<&[u8]> = bytes.split(|&b| b == b'\n').collect();
    // `split` yields an empty final piece when the file ends with a newline.
    let unterminated = !bytes.is_empty() && !bytes.ends_with(b"\n");
    let last_nonempty = lines.iter().rposition(|l| !l.iter().all(u8::is_ascii_whitespace));
    for (i, line) in lines.iter().enumerate() {
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let parsed = std::str::from_utf8(line)
            .map_err(|e| e.to_string())
            .and_then(|s| serde_json::from_str::<Record>(s).map_err(|e| e.to_string()));
        match parsed {
            Ok(r) => {
                if seen.insert(r.key()) {
                    out.records.push(r);
                } else {
                    out.dirty = true;
                    out.notes
                        .push(format!("line {}: duplicate record dropped", i + 1));
                }
            }
            Err(_) if Some(i) == last_nonempty => {
                out.dirty = true;
                out.notes.push(format!(
                    "line {}: incomplete last record (from an interrupted run) ignored",
                    i + 1
                ));
            }
            Err(e) => bail!("{}:{}: not a valid record ({e})", path.display(), i + 1),
        }
    }
    if unterminated {
        // Appending after an unterminated line would glue two records together.
        out.dirty = true;
    }
    Ok(out)
}

/// Keys (question_id, config) whose turns are all recorded.
pub fn complete_conversations(records: &[Record]) -> HashSet<(i64, String)> {
    let mut turns: HashMap<(i64, String), (usize, HashSet<usize>)> = HashMap::new();
    for r in records {
        let e = turns
            .entry((r.question_id, r.config.clone()))
            .or_insert((r.turns, HashSet::new()));
        e.1.insert(r.turn);
    }
    turns
        .into_iter()
        .filter(|(_, (n, seen))| (1..=*n).all(|t| seen.contains(&t)))
        .map(|(k, _)| k)
        .collect()
}

/// Only the records of complete conversations, in their order.
pub fn keep_complete(records: Vec<Record>) -> (Vec<Record>, usize) {
    let done = complete_conversations(&records);
    let before = records.len();
    let kept: Vec<Record> = records
        .into_iter()
        .filter(|r| done.contains(&(r.question_id, r.config.clone())))
        .collect();
    let dropped = before - kept.len();
    (kept, dropped)
}

/// Writes a file whole, through a temporary file and a rename, so a crash never leaves it half-written.
pub fn write_atomic(path: &Path, contents: &[u8]) -> Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot replace {}", path.display()))
}

/// Writes records as JSON lines.
pub fn write_records(path: &Path, records: &[Record]) -> Result<()> {
    let mut buf = Vec::new();
    for r in records {
        serde_json::to_writer(&mut buf, r)?;
        buf.push(b'\n');
    }
    write_atomic(path, &buf)
}

/// An open record file that each finished turn is appended to.
pub struct RecordLog {
    file: std::fs::File,
    path: PathBuf,
}

impl RecordLog {
    pub fn open_append(path: &Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open {} for appending", path.display()))?;
        Ok(RecordLog {
            file,
            path: path.to_path_buf(),
        })
    }

    /// Appends one record as a single write of the whole line, then flushes it to the OS.
    pub fn append(&mut self, r: &Record) -> Result<()> {
        let mut line = serde_json::to_vec(r)?;
        line.push(b'\n');
        self.file
            .write_all(&line)
            .and_then(|_| self.file.flush())
            .with_context(|| format!("cannot append to {}", self.path.display()))
    }
}

/// Settings that decide what the records contain. A resumed run must match them exactly; merged shards
/// must match them except for the shard (and, with a warning, the model path and device).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// `--model` as given ("default" for the default model).
    pub model: String,
    pub model_description: String,
    pub device: String,
    pub dtype: String,
    /// `--activations` ("q8", "f32" or "dequantized"; absent in older runs: the default then, q8).
    #[serde(default = "default_activations")]
    pub activations: String,
    /// What the KV cache held ("f32", "bf16"; absent in older runs: f32).
    #[serde(default = "default_kv_cache")]
    pub kv_cache: String,
    pub max_new_tokens: usize,
    pub tree: String,
    pub mask_init: String,
    /// As typed (an f32 flag, kept as its shortest decimal so the JSON reads 0.1, not 0.100000001).
    pub mask_lambda: f64,
    pub seed: u64,
    pub system: Option<String>,
    /// `--chat-template-kwargs` (absent when none, as in older runs).
    #[serde(default, skip_serializing_if = "TemplateVars::is_empty")]
    pub chat_template_kwargs: TemplateVars,
    /// `--chat-template-file` as given, and the FNV-1a 64 of its bytes (absent when none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template_file: Option<String>,
    pub questions_file: String,
    /// FNV-1a 64 of the question file's bytes.
    pub questions_hash: String,
    pub categories: Vec<String>,
    /// Questions of each category passed over (absent in older runs: 0).
    #[serde(default)]
    pub skip_per_category: usize,
    pub limit_per_category: Option<usize>,
    /// "I/N", or none for a whole run (and a merge).
    pub shard: Option<String>,
}

fn default_activations() -> String {
    "q8".into()
}

fn default_kv_cache() -> String {
    "f32".into()
}

/// One `probespec bench` process that wrote records: the machine and build facts of the summary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Invocation {
    pub date: String,
    pub command: String,
    pub probespec_version: String,
    pub git_commit: String,
    pub cpu: String,
    pub threads: usize,
    pub device: String,
    pub configs: Vec<String>,
    pub warmup: usize,
    /// Runs of each question by every configuration, of which each turn kept the median (1 before
    /// `--repeats`).
    #[serde(default = "one_run")]
    pub repeats: usize,
    pub shard: Option<String>,
}

fn one_run() -> usize {
    1
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunInfo {
    pub settings: Settings,
    pub invocations: Vec<Invocation>,
}

impl RunInfo {
    pub fn read(dir: &Path) -> Result<Option<RunInfo>> {
        let path = dir.join(RUN_FILE);
        match std::fs::read_to_string(&path) {
            Ok(s) => {
                Ok(Some(serde_json::from_str(&s).with_context(|| {
                    format!("{} is not a valid run file", path.display())
                })?))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(anyhow!("cannot read {}: {e}", path.display())),
        }
    }

    pub fn write(&self, dir: &Path) -> Result<()> {
        let mut s = serde_json::to_string_pretty(self)?;
        s.push('\n');
        write_atomic(&dir.join(RUN_FILE), s.as_bytes())
    }
}

/// Setting fields that differ between two runs, as "field: a vs b", skipping `ignore`.
pub fn setting_differences(a: &Settings, b: &Settings, ignore: &[&str]) -> Vec<String> {
    let (va, vb) = (
        serde_json::to_value(a).unwrap_or_default(),
        serde_json::to_value(b).unwrap_or_default(),
    );
    let (Some(ma), Some(mb)) = (va.as_object(), vb.as_object()) else {
        return Vec::new();
    };
    // Over both runs' fields: one left out where empty (`chat_template_kwargs`) is in only one of them.
    let keys: std::collections::BTreeSet<&String> = ma.keys().chain(mb.keys()).collect();
    keys.into_iter()
        .filter(|k| !ignore.contains(&k.as_str()))
        .filter_map(|k| {
            let x = ma.get(k).cloned().unwrap_or_default();
            let y = mb.get(k).cloned().unwrap_or_default();
            (x != y).then(|| format!("{k}: {x} vs {y}"))
        })
        .collect()
}

/// The run of median wall time, turn by turn, of one question asked `runs.len()` times by one
/// configuration (each run its turns' records, in order): what `--repeats` keeps on a machine whose load
/// moves a single run's time by a tenth. Every run must have given the same tokens: greedy decoding does
/// not depend on timing, only the blocks the methods choose do.
pub fn median_run(runs: Vec<Vec<Record>>) -> Result<Vec<Record>> {
    let turns = runs.first().map_or(0, Vec::len);
    if runs.iter().any(|r| r.len() != turns) {
        bail!("repeats of one question gave different numbers of turns");
    }
    let mut by_turn: Vec<Vec<Record>> = (0..turns).map(|_| Vec::with_capacity(runs.len())).collect();
    for run in runs {
        for (t, r) in run.into_iter().enumerate() {
            by_turn[t].push(r);
        }
    }
    by_turn
        .into_iter()
        .map(|mut same| {
            let first = &same[0];
            if let Some(other) = same.iter().find(|r| r.tokens != first.tokens) {
                bail!(
                    "question {} turn {} ({}): a repeat gave other tokens ({} against {}): decoding is not \
                     deterministic",
                    first.question_id,
                    first.turn,
                    first.config,
                    other.tokens.len(),
                    first.tokens.len()
                );
            }
            same.sort_by(|a, b| a.wall_seconds.total_cmp(&b.wall_seconds));
            Ok(same.swap_remove((same.len() - 1) / 2))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeats_keep_the_run_of_median_time_turn_by_turn() {
        let timed = |turn: usize, wall: f64| Record {
            wall_seconds: wall,
            ..rec(7, turn, 2, "pld")
        };
        let runs = vec![
            vec![timed(1, 3.0), timed(2, 1.0)],
            vec![timed(1, 1.0), timed(2, 2.0)],
            vec![timed(1, 2.0), timed(2, 3.0)],
        ];
        let kept = median_run(runs).unwrap();
        let walls: Vec<(usize, f64)> = kept.iter().map(|r| (r.turn, r.wall_seconds)).collect();
        assert_eq!(walls, [(1, 2.0), (2, 2.0)]);
        // Two runs: the faster one.
        assert_eq!(
            median_run(vec![vec![timed(1, 5.0)], vec![timed(1, 4.0)]]).unwrap()[0].wall_seconds,
            4.0
        );
        // Other tokens in a repeat are an error, not a median.
        let mut other = timed(1, 1.0);
        other.tokens.push(99);
        let err = median_run(vec![vec![timed(1, 2.0)], vec![other]]).unwrap_err();
        assert!(err.to_string().contains("not deterministic"), "{err}");
        assert!(median_run(vec![vec![timed(1, 2.0)], vec![]]).is_err());
    }

    fn rec(q: i64, turn: usize, turns: usize, config: &str) -> Record {
        Record {
            question_id: q,
            category: "qa".into(),
            group: "qa".into(),
            turn,
            turns,
            config: config.into(),
            method: MethodKind::Ar,
            bc: None,
            masks: None,
            prompt_tokens: 3,
            new_tokens: 2,
            model_calls: 1,
            committed: 1,
            tau: 1.0,
            decode_seconds: 0.1,
            prefill_seconds: 0.1,
            wall_seconds: 0.2,
            tokens: vec![5, 6],
            finish_reason: FinishReason::MaxNewTokens,
            accept_lengths: vec![1],
            text: None,
            text_tokens: None,
            block_histogram: vec![0, 1],
        }
    }

    #[test]
    fn half_written_last_line_is_ignored_and_bad_middle_line_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join(RECORDS_FILE);
        let good = serde_json::to_string(&rec(1, 1, 1, "ar")).unwrap();
        std::fs::write(&p, format!("{good}\n{}", &good[..20])).unwrap();
        let f = read_records(&p).unwrap();
        assert_eq!(f.records.len(), 1);
        assert!(f.dirty);
        std::fs::write(&p, format!("{}\n{good}\n", &good[..20])).unwrap();
        let e = read_records(&p).unwrap_err().to_string();
        assert!(e.contains(":1:"), "{e}");
    }

    #[test]
    fn completeness_needs_every_turn() {
        let rs = vec![
            rec(1, 1, 2, "ar"),
            rec(1, 2, 2, "ar"),
            rec(2, 1, 2, "ar"),
            rec(3, 1, 1, "esp"),
        ];
        let (kept, dropped) = keep_complete(rs);
        assert_eq!(dropped, 1);
        assert_eq!(
            kept.iter().map(|r| r.question_id).collect::<Vec<_>>(),
            vec![1, 1, 3]
        );
    }

    /// Runs recorded before `activations` and `kv_cache` were settings read as the defaults of their day,
    /// and a resumed run with another KV cache is told apart.
    #[test]
    fn older_settings_read_with_the_defaults_of_their_day() {
        let old = r#"{"model":"default","model_description":"m.gguf","device":"cpu","dtype":"f32",
            "max_new_tokens":64,"tree":"dynamic","mask_init":"mean","mask_lambda":0.1,"seed":0,
            "system":null,"questions_file":"q.jsonl","questions_hash":"0","categories":[],
            "limit_per_category":null,"shard":null}"#;
        let s: Settings = serde_json::from_str(old).unwrap();
        assert_eq!((s.activations.as_str(), s.kv_cache.as_str()), ("q8", "f32"));
        let bf16 = Settings {
            kv_cache: "bf16".into(),
            ..s.clone()
        };
        let diffs = setting_differences(&s, &bf16, &[]);
        assert_eq!(diffs.len(), 1, "{diffs:?}");
        assert!(diffs[0].starts_with("kv_cache"), "{diffs:?}");
        // Template variables: none in older runs, and a run with some differs from one without, either way.
        assert!(s.chat_template_kwargs.is_empty());
        let no_thinking = Settings {
            chat_template_kwargs: crate::tokenizer::parse_template_vars(r#"{"enable_thinking": false}"#)
                .unwrap(),
            ..s.clone()
        };
        for (a, b) in [(&s, &no_thinking), (&no_thinking, &s)] {
            let diffs = setting_differences(a, b, &[]);
            assert_eq!(diffs.len(), 1, "{diffs:?}");
            assert!(diffs[0].starts_with("chat_template_kwargs"), "{diffs:?}");
        }
        let own_template = Settings {
            chat_template_file: Some("t.jinja (0123456789abcdef)".into()),
            ..s.clone()
        };
        assert_eq!(setting_differences(&own_template, &s, &[]).len(), 1);
        let json = serde_json::to_string(&s).unwrap();
        assert!(!json.contains("chat_template"), "{json}");
    }
}
