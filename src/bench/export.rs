//! `probespec bench export`: records in Spec-Bench's model-answer shape, so that Spec-Bench's own scorer
//! (`evaluation/speed.py`) can read a probespec run.
//!
//! One file per configuration, `<config>.jsonl`, one line per question in question order:
//! `{"question_id", "category", "choices": [{"index": 0, "turns": [answer text per turn],
//! "new_tokens": [per turn], "wall_time": [seconds per turn], "accept_lengths": [tokens committed per
//! decoding call, all turns]}]}`. `speed.py` takes a method's tokens/s from `new_tokens` and `wall_time`,
//! the baseline's tokens from its `turns` re-tokenised, and #MAT from `accept_lengths`; `bench report`
//! computes the same numbers from the same records (see [`super::report`]).

use super::records::{keep_complete, Record};
use anyhow::{bail, Context, Result};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    /// Spec-Bench's model-answer JSON lines, one file per configuration.
    SpecBench,
}

/// One Spec-Bench answer line per complete question of `config`, in question-id order.
pub fn spec_bench_lines(records: &[Record], config: &str) -> Result<Vec<serde_json::Value>> {
    let mut by_question: BTreeMap<i64, Vec<&Record>> = BTreeMap::new();
    for r in records.iter().filter(|r| r.config == config) {
        by_question.entry(r.question_id).or_default().push(r);
    }
    let mut lines = Vec::new();
    for (qid, mut turns) in by_question {
        turns.sort_by_key(|r| r.turn);
        let mut texts = Vec::new();
        for r in &turns {
            match &r.text {
                Some(t) => texts.push(t.clone()),
                None => bail!(
                    "question {qid} turn {} ({config}) has no answer text or accept lengths: it was \
                     recorded by an older probespec; rerun it into a new folder",
                    r.turn
                ),
            }
        }
        let accept_lengths: Vec<usize> = turns
            .iter()
            .flat_map(|r| r.accept_lengths.iter().copied())
            .collect();
        lines.push(json!({
            "question_id": qid,
            "category": turns[0].category,
            "choices": [{
                "index": 0,
                "turns": texts,
                "new_tokens": turns.iter().map(|r| r.new_tokens).collect::<Vec<_>>(),
                "wall_time": turns.iter().map(|r| r.wall_seconds).collect::<Vec<_>>(),
                "accept_lengths": accept_lengths,
            }],
        }));
    }
    Ok(lines)
}

/// Writes one file per configuration into `out`; returns their paths.
pub fn write(format: Format, records: &[Record], out: &Path) -> Result<Vec<PathBuf>> {
    match format {
        Format::SpecBench => {}
    }
    let (records, _) = keep_complete(records.to_vec());
    let mut configs: Vec<&str> = Vec::new();
    for r in &records {
        if !configs.contains(&r.config.as_str()) {
            configs.push(&r.config);
        }
    }
    if configs.is_empty() {
        bail!("no complete conversations to export");
    }
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let mut paths = Vec::new();
    for c in configs {
        let mut text = String::new();
        for line in spec_bench_lines(&records, c)? {
            text.push_str(&line.to_string());
            text.push('\n');
        }
        let path = out.join(format!("{c}.jsonl"));
        super::records::write_atomic(&path, text.as_bytes())?;
        paths.push(path);
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(q: i64, turn: usize, turns: usize, config: &str, accept: Vec<usize>, wall: f64) -> Record {
        let committed: usize = accept.iter().sum();
        Record {
            question_id: q,
            category: "writing".into(),
            group: "mt_bench".into(),
            turn,
            turns,
            config: config.into(),
            method: crate::decode::method::MethodKind::Ar,
            bc: None,
            masks: None,
            prompt_tokens: 3,
            new_tokens: committed + 1,
            model_calls: accept.len(),
            committed,
            tau: committed as f64 / accept.len() as f64,
            decode_seconds: wall,
            prefill_seconds: 0.0,
            wall_seconds: wall,
            tokens: vec![7; committed + 1],
            finish_reason: crate::decode::generate::FinishReason::MaxNewTokens,
            accept_lengths: accept,
            text: Some(format!("answer {q}.{turn}")),
            text_tokens: Some(3),
            block_histogram: Vec::new(),
        }
    }

    #[test]
    fn one_line_per_question_with_every_turn() {
        let records = vec![
            rec(2, 2, 2, "esp", vec![2, 1], 0.5),
            rec(2, 1, 2, "esp", vec![1, 3, 1], 1.5),
            rec(1, 1, 1, "esp", vec![1], 0.25),
            rec(1, 1, 1, "ar", vec![1, 1], 0.75),
        ];
        let lines = spec_bench_lines(&records, "esp").unwrap();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["question_id"], 1);
        let c = &lines[1]["choices"][0];
        assert_eq!(lines[1]["category"], "writing");
        assert_eq!(c["index"], 0);
        assert_eq!(c["turns"], json!(["answer 2.1", "answer 2.2"]));
        assert_eq!(c["new_tokens"], json!([6, 4]));
        assert_eq!(c["wall_time"], json!([1.5, 0.5]));
        assert_eq!(c["accept_lengths"], json!([1, 3, 1, 2, 1]));
    }

    #[test]
    fn old_records_without_text_are_refused() {
        let mut r = rec(1, 1, 1, "ar", vec![1], 1.0);
        r.text = None;
        let e = spec_bench_lines(&[r], "ar").unwrap_err().to_string();
        assert!(e.contains("older probespec"), "{e}");
    }

    #[test]
    fn writes_a_file_per_configuration() {
        let dir = tempfile::tempdir().unwrap();
        let records = vec![
            rec(1, 1, 1, "ar", vec![1], 1.0),
            rec(1, 1, 1, "esp-bc10-k1", vec![2], 1.0),
        ];
        let paths = write(Format::SpecBench, &records, dir.path()).unwrap();
        let names: Vec<String> = paths
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["ar.jsonl", "esp-bc10-k1.jsonl"]);
        let text = std::fs::read_to_string(&paths[1]).unwrap();
        let v: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
        assert_eq!(v["choices"][0]["accept_lengths"], json!([2]));
    }
}
