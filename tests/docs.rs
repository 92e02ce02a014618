//! The docs stay today's truth: README.md and docs/BENCHMARKS.md within their sizes, every `src/` path they
//! (and the other docs) cite present, every record in docs/results indexed and behind a table, and every
//! table equal to what `scripts/results-tables.py` renders from its record.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const README_LINES: usize = 250;
const BENCHMARKS_LINES: usize = 400;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// Every Markdown file of the docs: the README, docs/, docs/results' index and CHANGELOG.md.
fn markdown_files() -> Vec<String> {
    let mut files = vec!["README.md".to_string(), "CHANGELOG.md".to_string()];
    for dir in ["docs", "docs/results"] {
        for entry in fs::read_dir(root().join(dir)).unwrap() {
            let name = entry.unwrap().file_name().into_string().unwrap();
            if name.ends_with(".md") {
                files.push(format!("{dir}/{name}"));
            }
        }
    }
    files
}

/// The `src/...` paths a text cites: a run of path characters after `src/`, not part of a longer word
/// (`data/spec_bench/` has no `src`, `xsrc/` is not cited), trailing punctuation left out.
fn cited_src_paths(text: &str) -> BTreeSet<String> {
    let bytes = text.as_bytes();
    let mut paths = BTreeSet::new();
    let mut start = 0;
    while let Some(at) = text[start..].find("src/") {
        let begin = start + at;
        start = begin + 4;
        if begin > 0 && (bytes[begin - 1].is_ascii_alphanumeric() || b"_-/.".contains(&bytes[begin - 1])) {
            continue;
        }
        let end = text[begin..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || "_-/.".contains(c)))
            .map_or(text.len(), |n| begin + n);
        paths.insert(text[begin..end].trim_end_matches('.').to_string());
    }
    paths
}

#[test]
fn readme_and_benchmarks_stay_within_their_sizes() {
    let readme = read("README.md").lines().count();
    let benchmarks = read("docs/BENCHMARKS.md").lines().count();
    assert!(
        readme <= README_LINES,
        "README.md has {readme} lines, at most {README_LINES}"
    );
    assert!(
        benchmarks <= BENCHMARKS_LINES,
        "docs/BENCHMARKS.md has {benchmarks} lines, at most {BENCHMARKS_LINES}"
    );
}

#[test]
fn every_cited_source_path_exists() {
    let mut missing = Vec::new();
    for file in markdown_files() {
        for path in cited_src_paths(&read(&file)) {
            if !root().join(&path).exists() {
                missing.push(format!("{file}: {path}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "cited paths that do not exist:\n{}",
        missing.join("\n")
    );
}

#[test]
fn cited_paths_are_found_in_text() {
    let found = cited_src_paths("see `src/decode/generate.rs`, src/kernels/ and (src/model/mod.rs). xsrc/no");
    let expected: BTreeSet<String> = ["src/decode/generate.rs", "src/kernels/", "src/model/mod.rs"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(found, expected);
}

/// The records: every entry of a CPU kind's folder in docs/results (a file, or a Spec-Bench run folder).
fn records() -> Vec<String> {
    let results = root().join("docs/results");
    let mut records = Vec::new();
    for kind in fs::read_dir(&results).unwrap() {
        let kind = kind.unwrap();
        let name = kind.file_name().into_string().unwrap();
        if name == "README.md" {
            continue;
        }
        assert!(
            kind.path().is_dir(),
            "docs/results/{name}: records go in a folder per CPU kind"
        );
        for record in fs::read_dir(kind.path()).unwrap() {
            records.push(format!(
                "{name}/{}",
                record.unwrap().file_name().into_string().unwrap()
            ));
        }
    }
    records.sort();
    records
}

#[test]
fn every_record_is_indexed_and_behind_a_table() {
    let index = read("docs/results/README.md");
    let tables = read("README.md") + &read("docs/BENCHMARKS.md");
    let records = records();
    assert!(!records.is_empty(), "docs/results holds no record");
    for record in records {
        assert!(
            index.contains(&format!("`{record}`")),
            "docs/results/README.md does not index `{record}`"
        );
        let kind = record.split('/').next().unwrap();
        let behind = tables.contains(&format!("<!-- table {record} "))
            || (record.ends_with("/shapes.json") || record.contains("/spec-bench-"))
                && tables.contains(&format!("<!-- table {kind} readme -->"));
        assert!(
            behind,
            "no table in README.md or docs/BENCHMARKS.md is rendered from {record}"
        );
    }
}

fn results_tables(root: &Path) -> std::process::Output {
    Command::new("python3")
        .arg(self::root().join("scripts/results-tables.py"))
        .args(["--check", "--root"])
        .arg(root)
        .output()
        .expect("python3 runs scripts/results-tables.py (install python3)")
}

#[test]
fn every_table_equals_what_its_record_renders() {
    let out = results_tables(&root());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The check above can fail: a copy of the docs with one number changed in a rendered table is refused.
#[test]
fn a_table_that_differs_from_its_record_is_refused() {
    let copy = tempfile::tempdir().unwrap();
    let copy_tree = |from: &Path, to: &Path| {
        let status = Command::new("cp").arg("-r").arg(from).arg(to).status().unwrap();
        assert!(status.success());
    };
    copy_tree(&root().join("docs"), copy.path());
    fs::copy(root().join("README.md"), copy.path().join("README.md")).unwrap();
    let benchmarks = copy.path().join("docs/BENCHMARKS.md");
    let text = fs::read_to_string(&benchmarks).unwrap();
    let start = text.find("<!-- table ").expect("BENCHMARKS has a rendered table");
    let row = start + text[start..].find("\n| ").expect("the table has rows") + 3;
    let digit = row + text[row..].find(|c: char| c.is_ascii_digit()).unwrap();
    let changed = if &text[digit..=digit] == "1" { "2" } else { "1" };
    fs::write(
        &benchmarks,
        format!("{}{changed}{}", &text[..digit], &text[digit + 1..]),
    )
    .unwrap();
    let out = results_tables(copy.path());
    assert!(!out.status.success(), "a changed number passed the check");
    assert!(String::from_utf8_lossy(&out.stderr).contains("docs/BENCHMARKS.md"));
}
