//! The question file: Spec-Bench's `question.jsonl` or any file of its shape, one
//! `{"question_id": int, "category": str, "turns": [str, ...]}` per line. Every line is checked before a
//! model is loaded, so a typo in line 300 fails in a second, not after an hour of decoding.
//!
//! Also here: the Spec-Bench groups of the categories, and the selection of a run's questions
//! (`--categories`, `--limit-per-category`, `--shard`).

use crate::facts::fnv1a_hex;
use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::path::Path;

/// One question: a conversation of user turns, asked one after the other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Question {
    pub question_id: i64,
    pub category: String,
    pub turns: Vec<String>,
}

impl Question {
    /// The Spec-Bench group of this question's category.
    pub fn group(&self) -> String {
        group_of(&self.category)
    }
}

/// The eight MT-bench categories, reported together as Spec-Bench's "multi-turn conversation" group.
pub const MT_BENCH_CATEGORIES: [&str; 8] = [
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
];

/// Spec-Bench's groups in the order of its leaderboard; other groups follow alphabetically.
pub const GROUP_ORDER: [&str; 6] = [
    "mt_bench",
    "translation",
    "summarization",
    "qa",
    "math_reasoning",
    "rag",
];

/// The group a category is reported under: the MT-bench categories pool into `mt_bench`, every other
/// category (Spec-Bench's five, or any category of another file) is its own group.
pub fn group_of(category: &str) -> String {
    if MT_BENCH_CATEGORIES.contains(&category) {
        "mt_bench".to_string()
    } else {
        category.to_string()
    }
}

/// Column title of a group in the table and chart.
pub fn group_title(group: &str) -> String {
    match group {
        "mt_bench" => "Multi-turn Conversation".into(),
        "translation" => "Translation".into(),
        "summarization" => "Summarization".into(),
        "qa" => "Question Answering".into(),
        "math_reasoning" => "Mathematical Reasoning".into(),
        "rag" => "Retrieval-aug. Generation".into(),
        "overall" => "Overall".into(),
        other => other.to_string(),
    }
}

/// Groups in report order: Spec-Bench's first, then the rest alphabetically.
pub fn sort_groups(groups: impl IntoIterator<Item = String>) -> Vec<String> {
    let set: BTreeSet<String> = groups.into_iter().collect();
    let mut out: Vec<String> = GROUP_ORDER
        .iter()
        .filter(|g| set.contains(**g))
        .map(|g| g.to_string())
        .collect();
    out.extend(set.into_iter().filter(|g| !GROUP_ORDER.contains(&g.as_str())));
    out
}

/// Reads and validates a question file. An error names the file and the 1-based line number.
/// Spec-Bench's own `question.jsonl` (480 questions, Apache-2.0; `data/spec_bench/NOTICE`), embedded in the
/// binary so that an installed `probespec bench` runs it without any file at hand.
pub const SPEC_BENCH_QUESTIONS: &str = include_str!("../../data/spec_bench/question.jsonl");

/// What `run.json` records as the question file when the embedded one is used.
pub const BUNDLED_NAME: &str = "spec-bench (bundled)";

/// The embedded Spec-Bench questions and their content hash.
pub fn bundled_questions() -> (Vec<Question>, String) {
    let questions = parse_questions(SPEC_BENCH_QUESTIONS).expect("the bundled Spec-Bench file parses");
    (questions, fnv1a_hex(SPEC_BENCH_QUESTIONS.as_bytes()))
}

/// The questions of `--questions FILE`, or the bundled Spec-Bench file without it; with the name recorded in
/// `run.json` and the content hash.
pub fn questions_or_bundled(path: Option<&Path>) -> Result<(Vec<Question>, String, String)> {
    match path {
        Some(p) => {
            let (q, h) = load_questions(p)?;
            Ok((q, h, p.display().to_string()))
        }
        None => {
            let (q, h) = bundled_questions();
            Ok((q, h, BUNDLED_NAME.to_string()))
        }
    }
}

pub fn load_questions(path: &Path) -> Result<(Vec<Question>, String)> {
    let bytes =
        std::fs::read(path).with_context(|| format!("cannot read the question file {}", path.display()))?;
    let text = String::from_utf8(bytes).map_err(|e| {
        let line = 1 + e.as_bytes()[..e.utf8_error().valid_up_to()]
            .iter()
            .filter(|&&b| b == b'\n')
            .count();
        anyhow!("{}:{line}: not valid UTF-8", path.display())
    })?;
    let questions =
        parse_questions(&text).map_err(|(line, msg)| anyhow!("{}:{line}: {msg}", path.display()))?;
    if questions.is_empty() {
        bail!("{}: no questions in the file", path.display());
    }
    // The content hash goes into run.json, so a resumed or merged run can tell it reads the same file.
    Ok((questions, fnv1a_hex(text.as_bytes())))
}

/// Parses question lines; an error is (1-based line, message). Blank lines are allowed.
pub fn parse_questions(text: &str) -> std::result::Result<Vec<Question>, (usize, String)> {
    let mut out = Vec::new();
    let mut seen: HashMap<i64, usize> = HashMap::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let q = parse_line(line).map_err(|m| (n, m))?;
        if let Some(first) = seen.insert(q.question_id, n) {
            return Err((
                n,
                format!("question_id {} repeats the one of line {first}", q.question_id),
            ));
        }
        out.push(q);
    }
    Ok(out)
}

fn parse_line(line: &str) -> std::result::Result<Question, String> {
    let v: Value = serde_json::from_str(line).map_err(|e| format!("not valid JSON ({e})"))?;
    let obj = v.as_object().ok_or("not a JSON object")?;
    let question_id = match obj.get("question_id") {
        None => return Err("missing \"question_id\"".into()),
        Some(id) => id
            .as_i64()
            .ok_or_else(|| format!("\"question_id\" must be an integer (got {id})"))?,
    };
    let category = match obj.get("category") {
        None => return Err("missing \"category\"".into()),
        Some(Value::String(s)) if !s.trim().is_empty() => s.clone(),
        Some(c) => return Err(format!("\"category\" must be a non-empty string (got {c})")),
    };
    let turns = match obj.get("turns") {
        None => return Err("missing \"turns\"".into()),
        Some(Value::Array(a)) if a.is_empty() => return Err("\"turns\" is empty".into()),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(t, v)| match v {
                Value::String(s) if !s.trim().is_empty() => Ok(s.clone()),
                Value::String(_) => Err(format!("turn {} is an empty string", t + 1)),
                other => Err(format!("turn {} must be a string (got {other})", t + 1)),
            })
            .collect::<std::result::Result<Vec<_>, _>>()?,
        Some(t) => return Err(format!("\"turns\" must be an array of strings (got {t})")),
    };
    Ok(Question {
        question_id,
        category,
        turns,
    })
}

/// Which questions a run asks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selection {
    /// Categories or group names to keep (empty: all).
    pub categories: Vec<String>,
    /// Questions of each category passed over first, in file order (to run questions other than the
    /// first few, which earlier runs may have tuned on).
    pub skip_per_category: usize,
    /// The first N questions of each category after those skipped, in file order.
    pub limit_per_category: Option<usize>,
    /// (I, N): every N-th question of the selection, those at index % N == I.
    pub shard: Option<(usize, usize)>,
}

/// Applies a selection. Filters run before sharding, so the shards of one selection partition it.
pub fn select(questions: &[Question], sel: &Selection) -> Result<Vec<Question>> {
    let wanted: HashSet<&str> = sel.categories.iter().map(|s| s.as_str()).collect();
    if !wanted.is_empty() {
        let known: BTreeSet<String> = questions
            .iter()
            .flat_map(|q| [q.category.clone(), q.group()])
            .collect();
        let unknown: Vec<&str> = sel
            .categories
            .iter()
            .map(|s| s.as_str())
            .filter(|c| !known.contains(*c))
            .collect();
        if !unknown.is_empty() {
            bail!(
                "--categories: no question has category or group {} (the file has: {})",
                unknown.join(", "),
                known.into_iter().collect::<Vec<_>>().join(", ")
            );
        }
    }
    let mut per_category: HashMap<&str, usize> = HashMap::new();
    let mut kept = Vec::new();
    for q in questions {
        if !wanted.is_empty() && !wanted.contains(q.category.as_str()) && !wanted.contains(q.group().as_str())
        {
            continue;
        }
        let n = per_category.entry(q.category.as_str()).or_default();
        *n += 1;
        let index = *n - 1;
        if index < sel.skip_per_category
            || sel
                .limit_per_category
                .is_some_and(|limit| index - sel.skip_per_category >= limit)
        {
            continue;
        }
        kept.push(q.clone());
    }
    if let Some((i, n)) = sel.shard {
        kept = kept
            .into_iter()
            .enumerate()
            .filter(|(k, _)| k % n == i)
            .map(|(_, q)| q)
            .collect();
    }
    Ok(kept)
}

/// Parses `I/N` with N >= 1 and I in 0..N.
pub fn parse_shard(s: &str) -> std::result::Result<(usize, usize), String> {
    let (i, n) = s
        .split_once('/')
        .ok_or_else(|| format!("expected I/N, e.g. 0/2 (got {s:?})"))?;
    let i: usize = i
        .trim()
        .parse()
        .map_err(|_| format!("shard index {i:?} is not a number"))?;
    let n: usize = n
        .trim()
        .parse()
        .map_err(|_| format!("shard count {n:?} is not a number"))?;
    if n == 0 || i >= n {
        return Err(format!("shard {i}/{n}: the index must be in 0..{n}"));
    }
    Ok((i, n))
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = r#"{"question_id": 1, "category": "writing", "turns": ["a", "b"]}

{"question_id": 2, "category": "qa", "turns": ["c"], "reference": ["x"]}
{"question_id": 3, "category": "qa", "turns": ["d"]}
{"question_id": 4, "category": "roleplay", "turns": ["e", "f"]}
"#;

    /// The embedded file is Spec-Bench's: 480 questions, 80 per group, MT-bench two turns and the others one.
    #[test]
    fn bundled_file_is_spec_bench() {
        let (q, hash) = bundled_questions();
        assert_eq!(q.len(), 480);
        let mut per_group: HashMap<String, usize> = HashMap::new();
        for x in &q {
            *per_group.entry(x.group()).or_default() += 1;
            let turns = if x.group() == "mt_bench" { 2 } else { 1 };
            assert_eq!(x.turns.len(), turns, "question {}", x.question_id);
        }
        assert_eq!(per_group.len(), 6);
        assert!(per_group.values().all(|&n| n == 80), "{per_group:?}");
        assert_eq!(hash, fnv1a_hex(SPEC_BENCH_QUESTIONS.as_bytes()));
    }

    #[test]
    fn parses_and_groups() {
        let q = parse_questions(GOOD).unwrap();
        assert_eq!(q.len(), 4);
        assert_eq!(q[0].turns, vec!["a", "b"]);
        assert_eq!(q[0].group(), "mt_bench");
        assert_eq!(q[1].group(), "qa");
        assert_eq!(
            sort_groups(["zeta".into(), "qa".into(), "mt_bench".into()]),
            vec!["mt_bench", "qa", "zeta"]
        );
    }

    #[test]
    fn bad_lines_name_their_line() {
        let cases = [
            ("{\"question_id\": 1, \"category\": \"qa\", \"turns\": [\"a\"]}\n{oops\n", 2, "not valid JSON"),
            ("{\"question_id\": 1, \"category\": \"qa\"}\n", 1, "missing \"turns\""),
            ("\n\n{\"question_id\": 1, \"category\": \"qa\", \"turns\": []}\n", 3, "\"turns\" is empty"),
            ("{\"question_id\": 1, \"category\": \"qa\", \"turns\": [\" \"]}\n", 1, "turn 1 is an empty string"),
            ("{\"question_id\": \"1\", \"category\": \"qa\", \"turns\": [\"a\"]}\n", 1, "must be an integer"),
            ("{\"question_id\": 1, \"category\": \"qa\", \"turns\": [\"a\"]}\n{\"question_id\": 1, \"category\": \"qa\", \"turns\": [\"a\"]}", 2, "repeats"),
            ("[1]\n", 1, "not a JSON object"),
        ];
        for (text, line, msg) in cases {
            let (l, m) = parse_questions(text).unwrap_err();
            assert_eq!(l, line, "{text}");
            assert!(m.contains(msg), "{m} lacks {msg}");
        }
    }

    #[test]
    fn selection_filters_then_shards() {
        let q = parse_questions(GOOD).unwrap();
        let ids = |s: &Selection| {
            select(&q, s)
                .unwrap()
                .iter()
                .map(|q| q.question_id)
                .collect::<Vec<_>>()
        };
        assert_eq!(ids(&Selection::default()), vec![1, 2, 3, 4]);
        assert_eq!(
            ids(&Selection {
                categories: vec!["mt_bench".into()],
                ..Default::default()
            }),
            vec![1, 4]
        );
        assert_eq!(
            ids(&Selection {
                limit_per_category: Some(1),
                ..Default::default()
            }),
            vec![1, 2, 4]
        );
        // Skipping the first question of each category leaves qa's second alone, and with a limit the
        // count starts after the skipped ones.
        assert_eq!(
            ids(&Selection {
                skip_per_category: 1,
                ..Default::default()
            }),
            vec![3]
        );
        assert_eq!(
            ids(&Selection {
                skip_per_category: 1,
                limit_per_category: Some(1),
                ..Default::default()
            }),
            vec![3]
        );
        assert_eq!(
            ids(&Selection {
                skip_per_category: 1,
                limit_per_category: Some(0),
                ..Default::default()
            }),
            Vec::<i64>::new()
        );
        let s0 = Selection {
            shard: Some((0, 2)),
            ..Default::default()
        };
        let s1 = Selection {
            shard: Some((1, 2)),
            ..Default::default()
        };
        assert_eq!(ids(&s0), vec![1, 3]);
        assert_eq!(ids(&s1), vec![2, 4]);
        assert!(select(
            &q,
            &Selection {
                categories: vec!["nope".into()],
                ..Default::default()
            }
        )
        .is_err());
    }

    #[test]
    fn shard_syntax() {
        assert_eq!(parse_shard("1/3"), Ok((1, 3)));
        assert!(parse_shard("3/3").is_err());
        assert!(parse_shard("0/0").is_err());
        assert!(parse_shard("1").is_err());
    }
}
