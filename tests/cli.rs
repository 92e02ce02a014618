//! The binary end to end: bad input gets one clear line on stderr and a non-zero exit, never a panic.

mod common;

use common::TinySpec;
use std::io::Write;
use std::process::{Command, Stdio};

fn probespec(args: &[&str], stdin: Option<&[u8]>) -> (i32, String, String) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_probespec"))
        .args(args)
        .env("PROBESPEC_MODEL_DIR", "/nonexistent-probespec-model-dir")
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    if let Some(bytes) = stdin {
        child.stdin.take().unwrap().write_all(bytes).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs a command that must fail: non-zero exit, exactly one line on stderr containing `needle`.
fn fails_with(args: &[&str], stdin: Option<&[u8]>, needle: &str) {
    let (code, _, err) = probespec(args, stdin);
    assert_ne!(code, 0, "{args:?} succeeded");
    assert!(
        !err.contains("panicked") && !err.contains("RUST_BACKTRACE"),
        "{args:?} panicked: {err}"
    );
    assert_eq!(
        err.trim_end().lines().count(),
        1,
        "{args:?}: expected one line, got: {err}"
    );
    assert!(err.contains(needle), "{args:?}: expected '{needle}' in: {err}");
}

fn tiny_dir() -> tempfile::TempDir {
    let d = common::tempdir();
    TinySpec::llama().write_hf(d.path());
    d
}

#[test]
fn missing_model_path() {
    fails_with(
        &["--model", "/no/such/model.gguf", "hi"],
        None,
        "model path not found: /no/such/model.gguf",
    );
}

#[test]
fn missing_default_model_says_how_to_fetch_it() {
    fails_with(&["hi"], None, "make model");
}

#[test]
fn folder_without_config() {
    let d = common::tempdir();
    fails_with(
        &["--model", d.path().to_str().unwrap(), "hi"],
        None,
        "config.json not found",
    );
}

#[test]
fn unsupported_architecture() {
    let d = tiny_dir();
    let cfg = d.path().join("config.json");
    let text = std::fs::read_to_string(&cfg)
        .unwrap()
        .replace("\"llama\"", "\"mistral\"");
    std::fs::write(&cfg, text.replace("LlamaForCausalLM", "MistralForCausalLM")).unwrap();
    fails_with(
        &["--model", d.path().to_str().unwrap(), "w5"],
        None,
        "unsupported architecture 'mistral'",
    );
}

#[test]
fn truncated_safetensors() {
    let d = tiny_dir();
    let f = d.path().join("model.safetensors");
    let bytes = std::fs::read(&f).unwrap();
    std::fs::write(&f, &bytes[..bytes.len() / 2]).unwrap();
    fails_with(
        &["--model", d.path().to_str().unwrap(), "w5"],
        None,
        "safetensors",
    );
}

#[test]
fn corrupt_safetensors_header() {
    let d = tiny_dir();
    std::fs::write(
        d.path().join("model.safetensors"),
        b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!",
    )
    .unwrap();
    fails_with(
        &["--model", d.path().to_str().unwrap(), "w5"],
        None,
        "safetensors",
    );
}

#[test]
fn truncated_gguf() {
    let d = common::tempdir();
    let p = d.path().join("m.gguf");
    TinySpec::llama().write_gguf(&p);
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 1000]).unwrap();
    fails_with(&["--model", p.to_str().unwrap(), "w5"], None, "truncated");
}

#[test]
fn corrupt_gguf() {
    let d = common::tempdir();
    let p = d.path().join("m.gguf");
    std::fs::write(&p, b"GGUF this is not a gguf file at all, just some bytes").unwrap();
    fails_with(
        &["--model", p.to_str().unwrap(), "w5"],
        None,
        "not a readable GGUF file",
    );
}

#[test]
fn tokenizer_larger_than_the_model_vocabulary() {
    let d = tiny_dir();
    let f = d.path().join("tokenizer.json");
    let mut tok: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&f).unwrap()).unwrap();
    let vocab = tok["model"]["vocab"].as_object_mut().unwrap();
    for i in 256..300 {
        vocab.insert(format!("x{i}"), serde_json::json!(i));
    }
    std::fs::write(&f, tok.to_string()).unwrap();
    fails_with(
        &["--model", d.path().to_str().unwrap(), "w5"],
        None,
        "(300 tokens) does not fit the model's embedding table (256 rows)",
    );
}

#[test]
fn empty_prompt() {
    let d = tiny_dir();
    fails_with(
        &["--model", d.path().to_str().unwrap(), ""],
        None,
        "the prompt is empty",
    );
    fails_with(
        &["--model", d.path().to_str().unwrap()],
        Some(b"  \n"),
        "the prompt is empty",
    );
}

#[test]
fn prompt_longer_than_the_context_window() {
    let d = tiny_dir();
    let long: String = (0..600).map(|i| format!("w{} ", 4 + i % 200)).collect();
    let (code, _, err) = probespec(
        &["--model", d.path().to_str().unwrap(), "--no-chat-template", &long],
        None,
    );
    assert_ne!(code, 0);
    assert!(err.contains("600 tokens") && err.contains("512"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

#[test]
fn non_utf8_stdin() {
    let d = tiny_dir();
    fails_with(
        &["--model", d.path().to_str().unwrap()],
        Some(b"w5 \xff\xfe w6"),
        "stdin is not valid UTF-8",
    );
}

#[test]
fn invalid_flag_values() {
    let d = tiny_dir();
    let m = d.path().to_str().unwrap();
    fails_with(
        &["--model", m, "--temperature", "-1", "w5"],
        None,
        "--temperature",
    );
    fails_with(&["--model", m, "--top-p", "0", "w5"], None, "--top-p");
    fails_with(&["--model", m, "--bc", "2", "w5"], None, "--bc 2 is too small");
    fails_with(&["--model", m, "--masks", "5", "w5"], None, "--masks");
    fails_with(
        &["--model", m, "--max-new-tokens", "0", "w5"],
        None,
        "--max-new-tokens",
    );
    fails_with(&["--model", m, "--device", "tpu", "w5"], None, "tpu");
    fails_with(&["--model", m, "--bc", "many", "w5"], None, "many");
    fails_with(
        &["--model", m, "--branches", "4,0", "--masks", "2", "w5"],
        None,
        "--branches",
    );
}

#[test]
fn generates_from_argument_and_stdin_and_json() {
    let d = tiny_dir();
    let m = d.path().to_str().unwrap();
    let (code, out, err) = probespec(&["--model", m, "--max-new-tokens", "8", "w5 w6 w7"], None);
    assert_eq!(code, 0, "{err}");
    assert!(!out.trim().is_empty());
    assert!(err.contains("model calls"), "stats line missing: {err}");
    let (code2, out2, _) = probespec(&["--model", m, "--max-new-tokens", "8", "-"], Some(b"w5 w6 w7"));
    assert_eq!(code2, 0);
    assert_eq!(out, out2, "stdin and argument prompts differ");
    let (code3, out3, _) = probespec(
        &[
            "--model",
            m,
            "--max-new-tokens",
            "8",
            "--json",
            "--method",
            "ar",
            "w5 w6 w7",
        ],
        None,
    );
    assert_eq!(code3, 0);
    let v: serde_json::Value = serde_json::from_str(out3.trim()).unwrap();
    for k in ["text", "token_ids", "prompt_token_ids", "stats"] {
        assert!(v.get(k).is_some(), "missing {k}");
    }
    for k in [
        "method",
        "new_tokens",
        "model_calls",
        "tau",
        "prefill_seconds",
        "decode_seconds",
        "tokens_per_second",
    ] {
        assert!(v["stats"].get(k).is_some(), "missing stats.{k}");
    }
    assert_eq!(v["stats"]["tau"], 1.0);
    assert_eq!(v["stats"]["method"], "ar");
}

#[test]
fn hub_id_missing_from_the_cache_offline() {
    let hf = common::tempdir();
    let (code, _, err) = probespec_env(
        &["--model", "someorg/some-model", "hi"],
        &[("HF_HOME", hf.path())],
    );
    assert_ne!(code, 0);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(
        err.contains("'someorg/some-model' is not in the local hub cache"),
        "{err}"
    );
}

#[test]
fn hub_id_found_in_the_local_cache() {
    // The hf-hub cache layout: models--ORG--NAME/refs/main holds a revision, snapshots/REV/ the files.
    let hf = common::tempdir();
    let repo = hf.path().join("hub").join("models--tiny--llama");
    let rev = "0123456789abcdef0123456789abcdef01234567";
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs").join("main"), rev).unwrap();
    TinySpec::llama().write_hf(&repo.join("snapshots").join(rev));
    let (code, out, err) = probespec_env(
        &["--model", "tiny/llama", "--max-new-tokens", "4", "w5 w6"],
        &[("HF_HOME", hf.path())],
    );
    assert_eq!(code, 0, "{err}");
    assert!(!out.trim().is_empty());
}

fn probespec_env(args: &[&str], env: &[(&str, &std::path::Path)]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_probespec"));
    cmd.args(args).stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
