//! Metrics from records, computed as Spec-Bench computes them, and their renderings: `summary.json` and
//! the Markdown leaderboard table (`table.md`, also printed).
//!
//! - tau (#MAT): tokens committed by decoding calls over those calls, pooled over every step of the
//!   group (prefill excluded), so long answers weigh by their steps, as in Spec-Bench.
//! - speedup: per question, tokens/s = generated tokens over the summed wall time of its turns; the
//!   group's speedup is the mean of that over the group's questions divided by the same mean for `ar`,
//!   over the questions both finished. As in Spec-Bench's `evaluation/speed.py`, the baseline's tokens are
//!   re-counted from its answer text: `len(tokenize(text)) - 1` per turn (records carry that count), so
//!   `speed.py` run on `bench export`'s files prints the same number. `speedup_generated` counts the
//!   baseline's generated tokens instead (the two differ by the stop token and the "- 1").
//! - lossless: every configuration's tokens against `ar`'s, per question and turn.
//! - blocks: the rows per decoding call each configuration sent (what `--bc auto` chose), pooled over
//!   its records, and the share of plain one-row calls.
//!
//! Everything here is a pure function of the records and run.json, so `bench report` re-renders exactly
//! what the run printed.

use super::questions::{group_title, sort_groups};
use super::records::{keep_complete, Record, RunInfo};
use crate::decode::method::{Budget, MethodKind};
use crate::decode::stats::{blocks_line, plain_share};
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};

/// The configuration every other one is compared with.
pub const REFERENCE: &str = "ar";
/// Name of the all-questions column.
pub const OVERALL: &str = "overall";

#[derive(Debug, Clone, Default, Serialize)]
pub struct GroupStats {
    pub questions: usize,
    pub turns: usize,
    pub new_tokens: usize,
    pub model_calls: usize,
    pub committed: usize,
    /// Pooled committed / model_calls; none when nothing was decoded after prefill.
    pub tau: Option<f64>,
    /// Mean over questions of per-question tokens/s.
    pub tokens_per_second: Option<f64>,
    /// Over `ar`, on the questions both finished, with `ar`'s tokens counted as Spec-Bench's `speed.py`
    /// counts them (from its answer text); none without `ar` records.
    pub speedup: Option<f64>,
    /// The same with `ar`'s generated tokens.
    pub speedup_generated: Option<f64>,
    pub wall_seconds: f64,
    /// Turns whose tokens differ from `ar`'s.
    pub mismatches: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct ConfigSummary {
    pub config: String,
    pub method: MethodKind,
    pub bc: Option<Budget>,
    pub masks: Option<usize>,
    /// Per group, `overall` included.
    pub groups: BTreeMap<String, GroupStats>,
    /// `block_histogram[r]` = decoding calls with r rows, over every record (empty for older records).
    pub block_histogram: Vec<usize>,
    /// Share of those calls that decoded plainly (one row).
    pub plain_share: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Mismatch {
    pub question_id: i64,
    pub turn: usize,
    pub config: String,
    /// First index where the token lists differ (the shorter length when one is a prefix of the other).
    pub first_diff: usize,
    pub reference_tokens: usize,
    pub config_tokens: usize,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Column order: groups in Spec-Bench order, then `overall`.
    pub groups: Vec<String>,
    pub configs: Vec<ConfigSummary>,
    pub reference: Option<String>,
    pub mismatches: Vec<Mismatch>,
    pub questions: usize,
    pub records: usize,
    /// Records of conversations with a missing turn, left out of every metric.
    pub incomplete_records: usize,
}

/// Per-question totals of one configuration.
#[derive(Default)]
struct QuestionTotals {
    group: String,
    turns: usize,
    new_tokens: usize,
    /// Tokens as `speed.py` counts a baseline's: `text_tokens - 1` per turn (generated tokens for records
    /// without text).
    recounted_tokens: i64,
    model_calls: usize,
    committed: usize,
    wall_seconds: f64,
}

impl QuestionTotals {
    fn tokens_per_second(&self) -> Option<f64> {
        (self.wall_seconds > 0.0).then(|| self.new_tokens as f64 / self.wall_seconds)
    }

    /// Tokens per second as Spec-Bench's `speed.py` computes it for the baseline.
    fn recounted_tokens_per_second(&self) -> Option<f64> {
        (self.wall_seconds > 0.0).then(|| self.recounted_tokens as f64 / self.wall_seconds)
    }
}

/// What `speed.py` counts for one baseline turn.
pub fn recounted_tokens(r: &Record) -> i64 {
    match r.text_tokens {
        Some(n) => n as i64 - 1,
        None => r.new_tokens as i64,
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> Option<f64> {
    let (s, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    (n > 0).then(|| s / n as f64)
}

fn first_diff(a: &[u32], b: &[u32]) -> Option<usize> {
    match a.iter().zip(b).position(|(x, y)| x != y) {
        Some(i) => Some(i),
        None if a.len() != b.len() => Some(a.len().min(b.len())),
        None => None,
    }
}

/// Computes every metric from the records (duplicates already removed).
pub fn compute(records: Vec<Record>) -> Report {
    let total = records.len();
    let (records, incomplete_records) = keep_complete(records);

    // Configurations: the reference first, then in order of first appearance (the run's order).
    let mut order: Vec<String> = Vec::new();
    for r in &records {
        if !order.contains(&r.config) {
            order.push(r.config.clone());
        }
    }
    if let Some(i) = order.iter().position(|c| c == REFERENCE) {
        let ar = order.remove(i);
        order.insert(0, ar);
    }
    let reference = order.first().filter(|c| *c == REFERENCE).cloned();

    let groups = sort_groups(records.iter().map(|r| r.group.clone()));
    let mut per_q: HashMap<&str, BTreeMap<i64, QuestionTotals>> = HashMap::new();
    let mut by_turn: HashMap<(i64, usize, &str), &Record> = HashMap::new();
    for r in &records {
        let t = per_q
            .entry(r.config.as_str())
            .or_default()
            .entry(r.question_id)
            .or_default();
        t.group.clone_from(&r.group);
        t.turns += 1;
        t.new_tokens += r.new_tokens;
        t.recounted_tokens += recounted_tokens(r);
        t.model_calls += r.model_calls;
        t.committed += r.committed;
        t.wall_seconds += r.wall_seconds;
        by_turn.insert((r.question_id, r.turn, r.config.as_str()), r);
    }

    let mut mismatches = Vec::new();
    if let Some(refc) = &reference {
        let mut keys: Vec<(i64, usize, &str)> = by_turn.keys().copied().filter(|k| k.2 != refc).collect();
        let rank: HashMap<&str, usize> = order.iter().enumerate().map(|(i, c)| (c.as_str(), i)).collect();
        keys.sort_by_key(|k| (k.0, k.1, rank[k.2]));
        for (q, turn, c) in keys {
            let Some(a) = by_turn.get(&(q, turn, refc.as_str())) else {
                continue;
            };
            let b = by_turn[&(q, turn, c)];
            if let Some(i) = first_diff(&a.tokens, &b.tokens) {
                mismatches.push(Mismatch {
                    question_id: q,
                    turn,
                    config: c.to_string(),
                    first_diff: i,
                    reference_tokens: a.tokens.len(),
                    config_tokens: b.tokens.len(),
                });
            }
        }
    }

    let empty = BTreeMap::new();
    let ref_q = reference.as_deref().and_then(|c| per_q.get(c)).unwrap_or(&empty);
    let mut configs = Vec::new();
    for c in &order {
        let first = records
            .iter()
            .find(|r| &r.config == c)
            .expect("config comes from the records");
        let qs = &per_q[c.as_str()];
        let mut stats = BTreeMap::new();
        for g in groups.iter().map(String::as_str).chain([OVERALL]) {
            let in_group = |t: &&QuestionTotals| g == OVERALL || t.group == g;
            let mine: Vec<(&i64, &QuestionTotals)> = qs.iter().filter(|(_, t)| in_group(t)).collect();
            let mut s = GroupStats {
                questions: mine.len(),
                ..Default::default()
            };
            for (_, t) in &mine {
                s.turns += t.turns;
                s.new_tokens += t.new_tokens;
                s.model_calls += t.model_calls;
                s.committed += t.committed;
                s.wall_seconds += t.wall_seconds;
            }
            s.tau = (s.model_calls > 0).then(|| s.committed as f64 / s.model_calls as f64);
            s.tokens_per_second = mean(mine.iter().filter_map(|(_, t)| t.tokens_per_second()));
            // Speedup over the questions both this configuration and the reference finished.
            let both: Vec<(&QuestionTotals, &QuestionTotals)> = mine
                .iter()
                .filter_map(|(q, t)| ref_q.get(q).map(|r| (*t, r)))
                .collect();
            let num = mean(both.iter().filter_map(|(t, _)| t.tokens_per_second()));
            let den = mean(both.iter().filter_map(|(_, r)| r.recounted_tokens_per_second()));
            let den_generated = mean(both.iter().filter_map(|(_, r)| r.tokens_per_second()));
            let ratio = |n: Option<f64>, d: Option<f64>| match (n, d) {
                (Some(n), Some(d)) if d > 0.0 => Some(n / d),
                _ => None,
            };
            s.speedup_generated = ratio(num, den_generated);
            // The reference is the baseline itself: 1 by definition, whichever count.
            s.speedup = if Some(c) == reference.as_ref() {
                s.speedup_generated
            } else {
                ratio(num, den)
            };
            s.mismatches = mismatches
                .iter()
                .filter(|m| {
                    &m.config == c && (g == OVERALL || qs.get(&m.question_id).is_some_and(|t| t.group == g))
                })
                .count();
            stats.insert(g.to_string(), s);
        }
        let mut block_histogram: Vec<usize> = Vec::new();
        for r in records.iter().filter(|r| &r.config == c) {
            if block_histogram.len() < r.block_histogram.len() {
                block_histogram.resize(r.block_histogram.len(), 0);
            }
            for (total, n) in block_histogram.iter_mut().zip(&r.block_histogram) {
                *total += n;
            }
        }
        configs.push(ConfigSummary {
            config: c.clone(),
            method: first.method,
            bc: first.bc,
            masks: first.masks,
            groups: stats,
            plain_share: plain_share(&block_histogram),
            block_histogram,
        });
    }
    let questions = records
        .iter()
        .map(|r| r.question_id)
        .collect::<std::collections::HashSet<_>>()
        .len();
    let mut columns = groups;
    columns.push(OVERALL.to_string());
    Report {
        groups: columns,
        configs,
        reference,
        mismatches,
        questions,
        records: total,
        incomplete_records,
    }
}

/// `summary.json`: the run's settings and invocations (machine and build facts) with the metrics.
pub fn summary_json(run: &RunInfo, report: &Report) -> serde_json::Value {
    serde_json::json!({
        "settings": run.settings,
        "invocations": run.invocations,
        "reference": report.reference,
        "groups": report.groups,
        "questions": report.questions,
        "records": report.records,
        "incomplete_records": report.incomplete_records,
        "mismatch_count": report.mismatches.len(),
        "mismatches": report.mismatches,
        "configs": report.configs,
    })
}

/// The Markdown leaderboard: rows = configurations, columns = groups + overall, cells "tau / speedup",
/// then a mismatch column; the mismatches are listed below it.
pub fn render_table(run: &RunInfo, report: &Report) -> String {
    let s = &run.settings;
    let mut out = String::new();
    out.push_str(&format!(
        "Spec-Bench: {} ({}, {}, {} activations, {} KV cache), max {} new tokens, {} questions{}\n\n",
        s.model_description,
        s.device,
        s.dtype,
        s.activations,
        s.kv_cache,
        s.max_new_tokens,
        report.questions,
        s.shard
            .as_ref()
            .map(|sh| format!(", shard {sh}"))
            .unwrap_or_default()
    ));
    out.push_str(
        "Cells: tau (#MAT, tokens committed per model call) / speedup over ar (mean tokens/s per question; \
         ar's tokens re-counted from its text, as Spec-Bench's speed.py does).\n\n",
    );
    let mut header = vec!["Configuration".to_string()];
    header.extend(report.groups.iter().map(|g| group_title(g)));
    header.push("Mismatches".into());
    out.push_str(&format!("| {} |\n", header.join(" | ")));
    let mut rule = vec!["---".to_string()];
    rule.extend(std::iter::repeat_n("---:".to_string(), header.len() - 1));
    out.push_str(&format!("| {} |\n", rule.join(" | ")));
    for c in &report.configs {
        let mut row = vec![c.config.clone()];
        for g in &report.groups {
            row.push(match c.groups.get(g) {
                Some(st) if st.questions > 0 => format!(
                    "{} / {}",
                    st.tau.map(|t| format!("{t:.2}")).unwrap_or_else(|| "-".into()),
                    st.speedup
                        .map(|x| format!("{x:.2}x"))
                        .unwrap_or_else(|| "-".into())
                ),
                _ => "-".into(),
            });
        }
        let is_ref = report.reference.as_deref() == Some(c.config.as_str());
        row.push(if is_ref || report.reference.is_none() {
            "-".into()
        } else {
            c.groups
                .get(OVERALL)
                .map(|st| st.mismatches.to_string())
                .unwrap_or_default()
        });
        out.push_str(&format!("| {} |\n", row.join(" | ")));
    }
    let blocks: Vec<&ConfigSummary> = report
        .configs
        .iter()
        .filter(|c| c.method != MethodKind::Ar && c.plain_share.is_some())
        .collect();
    if !blocks.is_empty() {
        out.push_str("\nBlocks sent (rows per model call, all questions):\n");
        for c in blocks {
            out.push_str(&format!("- {}: {}\n", c.config, blocks_line(&c.block_histogram)));
        }
    }
    if report.reference.is_none() {
        out.push_str("\nNo `ar` records: speedups and the lossless check need the ar configuration.\n");
    } else if !report.mismatches.is_empty() {
        const SHOWN: usize = 50;
        out.push_str(&format!(
            "\n{} turn(s) differ from ar (question, turn, configuration, first differing token):\n",
            report.mismatches.len()
        ));
        for m in report.mismatches.iter().take(SHOWN) {
            out.push_str(&format!(
                "- question {} turn {} {}: token {} (ar {} tokens, {} {} tokens)\n",
                m.question_id, m.turn, m.config, m.first_diff, m.reference_tokens, m.config, m.config_tokens
            ));
        }
        if report.mismatches.len() > SHOWN {
            out.push_str(&format!(
                "- ... {} more in summary.json\n",
                report.mismatches.len() - SHOWN
            ));
        }
    }
    if report.incomplete_records > 0 {
        out.push_str(&format!(
            "\n{} record(s) of unfinished conversations are left out.\n",
            report.incomplete_records
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[allow(clippy::too_many_arguments)]
    fn rec(
        q: i64,
        group: &str,
        turn: usize,
        turns: usize,
        config: &str,
        new: usize,
        calls: usize,
        wall: f64,
        tokens: Vec<u32>,
    ) -> Record {
        Record {
            question_id: q,
            category: group.into(),
            group: group.into(),
            turn,
            turns,
            config: config.into(),
            method: if config == "ar" {
                MethodKind::Ar
            } else {
                MethodKind::Esp
            },
            bc: None,
            masks: None,
            prompt_tokens: 4,
            new_tokens: new,
            model_calls: calls,
            committed: new - 1,
            tau: (new - 1) as f64 / calls as f64,
            decode_seconds: wall,
            prefill_seconds: 0.0,
            wall_seconds: wall,
            tokens,
            finish_reason: crate::decode::generate::FinishReason::MaxNewTokens,
            accept_lengths: Vec::new(),
            text: None,
            text_tokens: None,
            block_histogram: Vec::new(),
        }
    }

    #[test]
    fn block_histograms_are_pooled_per_configuration() {
        let t = vec![1, 2, 3];
        let mut a = rec(1, "qa", 1, 1, "esp-bcauto-k1", 3, 2, 1.0, t.clone());
        a.block_histogram = vec![0, 2, 1];
        let mut b = rec(2, "qa", 1, 1, "esp-bcauto-k1", 3, 4, 1.0, t.clone());
        b.block_histogram = vec![0, 1, 0, 0, 3];
        let old = rec(1, "qa", 1, 1, "ar", 3, 2, 1.0, t);
        let r = compute(vec![old, a, b]);
        assert_eq!(r.configs[0].plain_share, None, "older records have no histogram");
        assert_eq!(r.configs[1].block_histogram, vec![0, 3, 1, 0, 3]);
        assert_eq!(r.configs[1].plain_share, Some(3.0 / 7.0));
    }

    #[test]
    fn spec_bench_metrics() {
        let t = vec![1, 2, 3, 4, 5];
        let records = vec![
            // q1, two turns: ar 10 tokens in 2 s (5 tok/s); esp 10 tokens in 1 s (10 tok/s).
            rec(1, "mt_bench", 1, 2, "ar", 5, 4, 1.0, t.clone()),
            rec(1, "mt_bench", 2, 2, "ar", 5, 4, 1.0, t.clone()),
            rec(1, "mt_bench", 1, 2, "esp-bc30-k1", 5, 2, 0.5, t.clone()),
            rec(1, "mt_bench", 2, 2, "esp-bc30-k1", 5, 1, 0.5, vec![1, 2, 9]),
            // q2: ar 5 tok/s, esp 20 tok/s.
            rec(2, "qa", 1, 1, "ar", 5, 4, 1.0, t.clone()),
            rec(2, "qa", 1, 1, "esp-bc30-k1", 5, 1, 0.25, t.clone()),
            // q3: esp only turn 1 of 2: incomplete, left out.
            rec(3, "qa", 1, 2, "esp-bc30-k1", 5, 1, 0.25, t.clone()),
        ];
        let r = compute(records);
        assert_eq!(r.groups, vec!["mt_bench", "qa", "overall"]);
        assert_eq!(r.incomplete_records, 1);
        assert_eq!(r.configs[0].config, "ar");
        let esp = &r.configs[1];
        let mt = &esp.groups["mt_bench"];
        assert_eq!(mt.tau, Some(8.0 / 3.0));
        assert_eq!(mt.speedup, Some(2.0));
        let all = &esp.groups["overall"];
        // mean(10, 20) / mean(5, 5) = 3.
        assert!((all.speedup.unwrap() - 3.0).abs() < 1e-12);
        assert_eq!(all.tau, Some(12.0 / 4.0));
        assert_eq!(
            r.mismatches,
            vec![Mismatch {
                question_id: 1,
                turn: 2,
                config: "esp-bc30-k1".into(),
                first_diff: 2,
                reference_tokens: 5,
                config_tokens: 3
            }]
        );
        assert_eq!((mt.mismatches, esp.groups["qa"].mismatches), (1, 0));
        assert_eq!(r.configs[0].groups["overall"].speedup, Some(1.0));
    }

    /// With answer texts, the baseline's tokens are `speed.py`'s count (text tokens - 1 per turn).
    #[test]
    fn speedup_recounts_the_baseline_from_text() {
        let t = vec![1, 2, 3, 4, 5];
        let mut ar = rec(1, "qa", 1, 1, "ar", 5, 4, 1.0, t.clone());
        ar.text_tokens = Some(4); // speed.py counts 3 tokens: 3 tok/s
        let esp = rec(1, "qa", 1, 1, "esp-bc30-k1", 5, 2, 1.0, t); // 5 tok/s
        let r = compute(vec![ar, esp]);
        let g = &r.configs[1].groups["overall"];
        assert!((g.speedup.unwrap() - 5.0 / 3.0).abs() < 1e-12);
        assert!((g.speedup_generated.unwrap() - 1.0).abs() < 1e-12);
        assert_eq!(r.configs[0].groups["overall"].speedup, Some(1.0));
    }

    #[test]
    fn first_diff_of_prefixes() {
        assert_eq!(first_diff(&[1, 2], &[1, 2]), None);
        assert_eq!(first_diff(&[1, 2], &[1, 2, 3]), Some(2));
        assert_eq!(first_diff(&[1, 2], &[1, 3]), Some(1));
    }
}
