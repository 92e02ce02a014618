//! `probespec bench` end to end on a tiny random checkpoint: records, summary, table and chart; the
//! lossless check; resuming after a crash; shards and merge; `bench report`; malformed question files.

mod common;

use common::binary::{probespec, Run};
use common::TinySpec;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Four questions in four categories (three groups), the first with two turns: 5 turns.
const QUESTIONS: &str = r#"{"question_id": 81, "category": "writing", "turns": ["w5 w17 w9 w30 w41", "w12 w13 w99"]}
{"question_id": 100, "category": "qa", "turns": ["w7 w8 w9 w10"], "reference": ["w11"]}
{"question_id": 101, "category": "translation", "turns": ["w200 w201 w202 w7 w77 w100"]}

{"question_id": 102, "category": "qa", "turns": ["w60 w61 w62"]}
"#;
const TURNS: usize = 5;
/// ar + esp × bc {10, 30} × masks {1, 2}.
const CONFIGS: usize = 5;

struct Fixture {
    _tmp: tempfile::TempDir,
    root: PathBuf,
    model: PathBuf,
    questions: PathBuf,
}

fn fixture() -> Fixture {
    let tmp = common::tempdir();
    let root = tmp.path().to_path_buf();
    let model = root.join("tiny");
    TinySpec::llama().write_hf(&model);
    let questions = root.join("question.jsonl");
    std::fs::write(&questions, QUESTIONS).unwrap();
    Fixture {
        _tmp: tmp,
        root,
        model,
        questions,
    }
}

impl Fixture {
    /// `probespec bench` on the fixture into `out`; flags in `extra` replace the defaults of this helper.
    fn bench(&self, out: &Path, extra: &[&str]) -> Run {
        let mut args = vec![
            "bench",
            "--questions",
            self.questions.to_str().unwrap(),
            "--model",
            self.model.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ];
        let defaults = [
            ("--max-new-tokens", "16"),
            ("--methods", "ar,esp"),
            ("--bc", "10,30"),
            ("--masks", "1,2"),
            ("--warmup", "1"),
        ];
        for (flag, value) in defaults {
            if !extra.contains(&flag) {
                args.extend([flag, value]);
            }
        }
        args.extend_from_slice(extra);
        probespec(&args)
    }
}

fn record_lines(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("records.jsonl"))
        .unwrap()
        .lines()
        .map(String::from)
        .collect()
}

fn records(dir: &Path) -> Vec<Value> {
    record_lines(dir)
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// (question_id, turn, config, tokens) of every record, as a set; panics on duplicates.
fn record_set(dir: &Path) -> BTreeSet<(i64, u64, String, String)> {
    let rs = records(dir);
    let set: BTreeSet<_> = rs
        .iter()
        .map(|r| {
            (
                r["question_id"].as_i64().unwrap(),
                r["turn"].as_u64().unwrap(),
                r["config"].as_str().unwrap().to_string(),
                r["tokens"].to_string(),
            )
        })
        .collect();
    assert_eq!(set.len(), rs.len(), "duplicate records in {}", dir.display());
    set
}

#[test]
fn run_writes_records_summary_table_and_chart_and_is_lossless() {
    let f = fixture();
    let out = f.root.join("run");
    let o = f.bench(&out, &[]).ok();

    let rs = records(&out);
    assert_eq!(rs.len(), TURNS * CONFIGS);
    let configs: BTreeSet<&str> = rs.iter().map(|r| r["config"].as_str().unwrap()).collect();
    let expected: BTreeSet<&str> = ["ar", "esp-bc10-k1", "esp-bc10-k2", "esp-bc30-k1", "esp-bc30-k2"]
        .into_iter()
        .collect();
    assert_eq!(configs, expected);
    for r in &rs {
        for field in [
            "question_id",
            "category",
            "group",
            "turn",
            "config",
            "method",
            "bc",
            "masks",
            "prompt_tokens",
            "new_tokens",
            "model_calls",
            "committed",
            "tau",
            "decode_seconds",
            "prefill_seconds",
            "wall_seconds",
            "tokens",
            "finish_reason",
        ] {
            assert!(r.get(field).is_some(), "record lacks {field}: {r}");
        }
        assert_eq!(
            r["new_tokens"].as_u64().unwrap() as usize,
            r["tokens"].as_array().unwrap().len()
        );
        assert!(r["new_tokens"].as_u64().unwrap() <= 16);
    }
    // Interleaved per question: the first records are question 81's, ar first.
    assert_eq!(rs[0]["question_id"], 81);
    assert_eq!(rs[0]["config"], "ar");
    assert_eq!(
        (rs[0]["turn"].as_u64(), rs[1]["turn"].as_u64()),
        (Some(1), Some(2))
    );
    // The second turn's prompt holds the first turn and its answer.
    assert!(rs[1]["prompt_tokens"].as_u64() > rs[0]["prompt_tokens"].as_u64());
    assert_eq!(rs[0]["group"], "mt_bench");

    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    assert_eq!(
        summary["mismatch_count"], 0,
        "ESP differs from greedy: {}",
        summary["mismatches"]
    );
    assert_eq!(
        summary["groups"],
        serde_json::json!(["mt_bench", "translation", "qa", "overall"])
    );
    assert_eq!(summary["configs"].as_array().unwrap().len(), CONFIGS);
    let ar = &summary["configs"][0];
    assert_eq!(ar["config"], "ar");
    assert_eq!(ar["groups"]["overall"]["speedup"], 1.0);
    assert_eq!(ar["groups"]["overall"]["questions"], 4);
    for c in summary["configs"].as_array().unwrap() {
        let tau = c["groups"]["overall"]["tau"].as_f64().unwrap();
        assert!((1.0..=16.0).contains(&tau), "{c}");
        assert!(c["groups"]["overall"]["speedup"].as_f64().unwrap() > 0.0);
    }
    let inv = &summary["invocations"][0];
    for field in [
        "cpu",
        "threads",
        "device",
        "git_commit",
        "date",
        "probespec_version",
        "command",
    ] {
        assert!(
            inv.get(field).is_some_and(|v| !v.is_null()),
            "invocation lacks {field}: {inv}"
        );
    }
    assert!(inv["command"].as_str().unwrap().contains("--max-new-tokens 16"));
    assert_eq!(summary["settings"]["dtype"], "f32");

    let table = std::fs::read_to_string(out.join("table.md")).unwrap();
    assert_eq!(o.stdout, table, "stdout is the table");
    assert!(table.contains("| Configuration | Multi-turn Conversation | Translation | Question Answering | Overall | Mismatches |"));
    assert!(table
        .lines()
        .any(|l| l.starts_with("| ar | ") && l.contains("1.00x")));
    assert!(table
        .lines()
        .any(|l| l.starts_with("| esp-bc30-k1 | ") && l.ends_with("| 0 |")));

    let svg = std::fs::read_to_string(out.join("chart.svg")).unwrap();
    assert!(svg.trim_start().starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("esp-bc30-k2") && svg.contains("MT-bench") && svg.contains("Overall"));
}

#[test]
fn resume_keeps_finished_records_and_redoes_the_rest() {
    let f = fixture();
    let out = f.root.join("run");
    f.bench(&out, &[]).ok();
    let full = record_lines(&out);
    let full_set = record_set(&out);

    // A crash in the middle of question 81 (two turns): ar's two turns and one turn of the next
    // configuration were written, then half a line.
    let partial = format!(
        "{}\n{}\n{}\n{}",
        full[0],
        full[1],
        full[2],
        &full[3][..full[3].len() / 2]
    );
    std::fs::write(out.join("records.jsonl"), partial).unwrap();
    let o = f.bench(&out, &[]).ok();
    let stderr = &o.stderr;
    assert!(stderr.contains("incomplete last record"), "{stderr}");
    let after = record_lines(&out);
    assert_eq!(after.len(), TURNS * CONFIGS);
    // ar's finished conversation is kept verbatim (timings included); the half-done one is redone.
    assert_eq!(after[..2], full[..2]);
    let set = record_set(&out);
    assert_eq!(set, full_set);

    // Dropping the last records as if killed between turns: only those are redone.
    std::fs::write(
        out.join("records.jsonl"),
        after[..after.len() - 3].join("\n") + "\n",
    )
    .unwrap();
    f.bench(&out, &[]).ok();
    let again = record_lines(&out);
    assert_eq!(again[..again.len() - 3], after[..after.len() - 3]);
    assert_eq!(record_set(&out), full_set);

    // A finished run only re-renders.
    f.bench(&out, &[]).ok();
    assert_eq!(record_lines(&out), again);

    // Other settings in the same folder are refused rather than mixed in.
    let o = f.bench(&out, &["--max-new-tokens", "8"]);
    assert!(!o.status.success());
    assert!(o.stderr.contains("max_new_tokens"));

    // So are records of another build, when there is something left to run.
    let run_json = out.join("run.json");
    let mut run: Value = serde_json::from_str(&std::fs::read_to_string(&run_json).unwrap()).unwrap();
    for i in run["invocations"].as_array_mut().unwrap() {
        i["git_commit"] = "0000000".into();
    }
    std::fs::write(&run_json, run.to_string()).unwrap();
    f.bench(&out, &[]).ok();
    std::fs::write(out.join("records.jsonl"), again[..2].join("\n") + "\n").unwrap();
    f.bench(&out, &[])
        .errors_with("holds records made by commit 0000000");
    assert_eq!(record_lines(&out), again[..2]);
}

#[test]
fn shards_merge_into_the_full_run() {
    let f = fixture();
    let (full, a, b, merged) = (
        f.root.join("full"),
        f.root.join("s0"),
        f.root.join("s1"),
        f.root.join("merged"),
    );
    f.bench(&full, &[]).ok();
    f.bench(&a, &["--shard", "0/2"]).ok();
    f.bench(&b, &["--shard", "1/2"]).ok();
    let ids = |d: &Path| {
        records(d)
            .iter()
            .map(|r| r["question_id"].as_i64().unwrap())
            .collect::<BTreeSet<_>>()
    };
    assert_eq!(ids(&a), [81, 101].into_iter().collect());
    assert_eq!(ids(&b), [100, 102].into_iter().collect());

    let o = probespec(&[
        "bench",
        "merge",
        merged.to_str().unwrap(),
        a.to_str().unwrap(),
        b.to_str().unwrap(),
    ])
    .ok();
    assert_eq!(record_set(&merged), record_set(&full));
    let table = std::fs::read_to_string(merged.join("table.md")).unwrap();
    assert_eq!(o.stdout, table);
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(merged.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["invocations"].as_array().unwrap().len(), 2);
    assert_eq!(summary["settings"]["shard"], Value::Null);
    assert_eq!(summary["mismatch_count"], 0);
    assert!(merged.join("chart.svg").is_file());

    // Merging the same shards again into the merged folder changes nothing (duplicates are dropped).
    probespec(&[
        "bench",
        "merge",
        merged.to_str().unwrap(),
        merged.to_str().unwrap(),
        a.to_str().unwrap(),
    ])
    .ok();
    assert_eq!(record_set(&merged), record_set(&full));
    let o = probespec(&["bench", "merge", merged.to_str().unwrap(), a.to_str().unwrap()]);
    assert!(
        !o.status.success(),
        "merging into a folder with other records must fail"
    );

    let bad = probespec(&[
        "bench",
        "--questions",
        f.questions.to_str().unwrap(),
        "--shard",
        "2/2",
    ]);
    assert!(!bad.status.success());
}

#[test]
fn report_rerenders_the_table_of_the_run() {
    let f = fixture();
    let out = f.root.join("run");
    let run = f.bench(&out, &["--warmup", "0"]).ok();
    let table = std::fs::read_to_string(out.join("table.md")).unwrap();
    let summary = std::fs::read_to_string(out.join("summary.json")).unwrap();
    for file in ["table.md", "summary.json", "chart.svg"] {
        std::fs::remove_file(out.join(file)).unwrap();
    }
    let o = probespec(&["bench", "report", out.to_str().unwrap()]).ok();
    assert_eq!(o.stdout, run.stdout);
    assert_eq!(std::fs::read_to_string(out.join("table.md")).unwrap(), table);
    assert_eq!(
        std::fs::read_to_string(out.join("summary.json")).unwrap(),
        summary
    );
    assert!(out.join("chart.svg").is_file());

    let o = probespec(&["bench", "report", f.root.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(o.stderr.contains("run.json"));
}

#[test]
fn malformed_question_files_name_file_and_line() {
    let f = fixture();
    let good = r#"{"question_id": 1, "category": "qa", "turns": ["w5 w6"]}"#;
    let cases = [
        (
            "bad_json.jsonl",
            format!("{good}\n{{\"question_id\": 2, \"category\": \"qa\", \"turns\": [\"w5\"\n"),
            2,
            "not valid JSON",
        ),
        (
            "no_turns.jsonl",
            format!("{good}\n\n{{\"question_id\": 2, \"category\": \"qa\"}}\n"),
            3,
            "missing \"turns\"",
        ),
        (
            "empty_turns.jsonl",
            "{\"question_id\": 2, \"category\": \"qa\", \"turns\": []}\n".to_string(),
            1,
            "\"turns\" is empty",
        ),
        (
            "empty_turn.jsonl",
            format!("{good}\n{{\"question_id\": 2, \"category\": \"qa\", \"turns\": [\"w5\", \"\"]}}\n"),
            2,
            "turn 2 is an empty string",
        ),
    ];
    for (name, text, line, what) in cases {
        let path = f.root.join(name);
        std::fs::write(&path, text).unwrap();
        let o = probespec(&[
            "bench",
            "--questions",
            path.to_str().unwrap(),
            "--model",
            f.model.to_str().unwrap(),
            "--out",
            f.root.join("never").to_str().unwrap(),
        ]);
        assert!(!o.status.success(), "{name} was accepted");
        let stderr = &o.stderr;
        assert_eq!(
            stderr.trim_end().lines().count(),
            1,
            "one-line error expected: {stderr}"
        );
        assert!(
            stderr.contains(&format!("{}:{line}:", path.display())),
            "{name}: {stderr}"
        );
        assert!(stderr.contains(what), "{name}: {stderr}");
        assert!(!f.root.join("never").join("records.jsonl").exists());
    }
}

/// Without `--questions` the run reads Spec-Bench's own file, built into the binary: its first two
/// question-answering items are 321 and 322.
#[test]
fn bundled_spec_bench_questions_without_a_file() {
    let f = fixture();
    let out = f.root.join("bundled");
    probespec(&[
        "bench",
        "--model",
        f.model.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--methods",
        "ar",
        "--categories",
        "qa",
        "--limit-per-category",
        "2",
        "--max-new-tokens",
        "4",
        "--warmup",
        "0",
    ])
    .ok();
    let ids: Vec<i64> = records(&out)
        .iter()
        .map(|r| r["question_id"].as_i64().unwrap())
        .collect();
    assert_eq!(ids, vec![321, 322]);
    let run: Value = serde_json::from_str(&std::fs::read_to_string(out.join("run.json")).unwrap()).unwrap();
    assert_eq!(run["settings"]["questions_file"], "spec-bench (bundled)");
}

/// `bench export --format spec-bench`: one model-answer file per configuration, from which Spec-Bench's
/// `evaluation/speed.py` formulas (ported below) give the speedup and mean accepted tokens that
/// `bench report` prints.
#[test]
fn spec_bench_export_agrees_with_the_report() {
    let f = fixture();
    let out = f.root.join("run");
    f.bench(&out, &["--methods", "ar,esp,pld", "--bc", "10", "--masks", "1"])
        .ok();
    let export = f.root.join("export");
    let listed = probespec(&[
        "bench",
        "export",
        out.to_str().unwrap(),
        "--format",
        "spec-bench",
        "--out",
        export.to_str().unwrap(),
    ])
    .ok();
    assert_eq!(listed.stdout.lines().count(), 3);
    let tok = probespec::tokenizer::TextTokenizer::from_hf_dir(&f.model).unwrap();
    let read = |name: &str| -> Vec<Value> {
        std::fs::read_to_string(export.join(format!("{name}.jsonl")))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let base = read("ar");
    assert_eq!(base.len(), 4, "one line per question");
    // speed.py: a method's tokens/s per question = sum(new_tokens) / sum(wall_time); the baseline's
    // tokens are len(tokenizer(text).input_ids) - 1 per turn; speedup = ratio of the means.
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let wall = |q: &Value| -> f64 {
        q["choices"][0]["wall_time"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .sum()
    };
    let base_speeds: Vec<f64> = base
        .iter()
        .map(|q| {
            let tokens: i64 = q["choices"][0]["turns"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| tok.encode(t.as_str().unwrap()).unwrap().len() as i64 - 1)
                .sum();
            tokens as f64 / wall(q)
        })
        .collect();
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("summary.json")).unwrap()).unwrap();
    for name in ["esp-bc10-k1", "pld"] {
        let lines = read(name);
        let speeds: Vec<f64> = lines
            .iter()
            .map(|q| {
                let n: u64 = q["choices"][0]["new_tokens"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .sum();
                n as f64 / wall(q)
            })
            .collect();
        let accept: Vec<f64> = lines
            .iter()
            .flat_map(|q| q["choices"][0]["accept_lengths"].as_array().unwrap().clone())
            .map(|x| x.as_f64().unwrap())
            .collect();
        let config = summary["configs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["config"] == name)
            .unwrap();
        let overall = &config["groups"]["overall"];
        let speedup = mean(&speeds) / mean(&base_speeds);
        assert!(
            (overall["speedup"].as_f64().unwrap() - speedup).abs() < 1e-9,
            "{name}: report {} vs speed.py {speedup}",
            overall["speedup"]
        );
        assert!(
            (overall["tau"].as_f64().unwrap() - mean(&accept)).abs() < 1e-9,
            "{name}: tau"
        );
        // Each turn's text is what the configuration generated.
        for q in &lines {
            for t in q["choices"][0]["turns"].as_array().unwrap() {
                assert!(!t.as_str().unwrap().is_empty() || q["choices"][0]["new_tokens"][0] == 1);
            }
        }
    }
}

/// `--repeats 3` asks each question three times per configuration and keeps one record per turn, with
/// the same tokens as a single run; the invocation says how many runs each record is the median of.
#[test]
fn repeats_keep_one_record_per_turn() {
    let f = fixture();
    let (once, thrice) = (f.root.join("once"), f.root.join("thrice"));
    let flags = ["--methods", "ar,pld", "--warmup", "0"];
    f.bench(&once, &flags).ok();
    f.bench(&thrice, &[&flags[..], &["--repeats", "3"]].concat()).ok();
    let tokens = |dir: &Path| -> Vec<(i64, String, usize, Value)> {
        record_lines(dir)
            .iter()
            .map(|l| serde_json::from_str::<Value>(l).unwrap())
            .map(|r| {
                (
                    r["question_id"].as_i64().unwrap(),
                    r["config"].as_str().unwrap().to_string(),
                    r["turn"].as_u64().unwrap() as usize,
                    r["tokens"].clone(),
                )
            })
            .collect()
    };
    let (a, b) = (tokens(&once), tokens(&thrice));
    assert_eq!(a.len(), 2 * TURNS);
    assert_eq!(a, b);
    let summary: Value =
        serde_json::from_str(&std::fs::read_to_string(thrice.join("summary.json")).unwrap()).unwrap();
    assert_eq!(summary["invocations"][0]["repeats"], 3);
    f.bench(&f.root.join("never"), &[&flags[..], &["--repeats", "0"]].concat())
        .fails_with("--repeats");
}

/// A reader that stops reading (`probespec bench report DIR | head`) ends `bench report` and `bench export`
/// quietly, with status 0, like generation does.
#[test]
fn closed_stdout_ends_report_and_export_quietly() {
    let f = fixture();
    let out = f.root.join("run");
    f.bench(&out, &["--methods", "ar", "--warmup", "0"]).ok();
    let dir = out.to_str().unwrap();
    for args in [vec!["bench", "report", dir], vec!["bench", "export", dir]] {
        let mut child = common::binary::command(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take());
        let done = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&done.stderr);
        assert_eq!(done.status.code(), Some(0), "{args:?}: {err}");
        assert!(
            !err.contains("panicked") && !err.contains("error"),
            "{args:?}: {err}"
        );
    }
}
