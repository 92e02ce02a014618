//! The binary end to end: bad input gets one clear line on stderr and a non-zero exit, never a panic.

mod common;

use common::binary::{command, probespec, probespec_stdin, run};
use common::TinySpec;
use std::io::Write;
use std::process::Stdio;

/// Runs the binary and checks that it fails: non-zero exit, no panic, one line on stderr containing
/// `needle`.
fn fails_with(args: &[&str], stdin: Option<&[u8]>, needle: &str) {
    match stdin {
        Some(bytes) => probespec_stdin(args, bytes),
        None => probespec(args),
    }
    .fails_with(needle);
}

/// Runs the binary and checks that it ends in an error: exit status 1, one line on stderr, `error: ` first
/// and containing `needle`, no panic.
fn errors_with(args: &[&str], needle: &str) {
    probespec(args).errors_with(needle);
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

/// `PROBESPEC_MODEL_DIR=` (set, empty) counts as unset, as in scripts/fetch-model.sh: the default model is
/// then read from `$XDG_CACHE_HOME/probespec`, where the script put it.
#[test]
fn an_empty_model_dir_variable_counts_as_unset() {
    let cache = common::tempdir();
    std::fs::create_dir(cache.path().join("probespec")).unwrap();
    let file = probespec::model::load::DEFAULT_MODEL_FILE;
    std::os::unix::fs::symlink(common::smollm2_path(), cache.path().join("probespec").join(file)).unwrap();
    let mut cmd = command(&["--max-new-tokens", "2", "hi"]);
    cmd.env("PROBESPEC_MODEL_DIR", "")
        .env("XDG_CACHE_HOME", cache.path());
    run(&mut cmd, None).ok();
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
    let r = probespec(&["--model", d.path().to_str().unwrap(), "--no-chat-template", &long]);
    let err = &r.stderr;
    assert_ne!(r.code(), 0);
    assert!(err.contains("600 tokens") && err.contains("512"), "{err}");
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
}

/// `--chat-template-file` replaces the model's template, with `--chat-template-kwargs` reaching it; a
/// missing or uncompilable file is one line, before any model is loaded.
#[test]
fn a_chat_template_file_replaces_the_models() {
    let d = tiny_dir();
    let m = d.path().to_str().unwrap();
    let file = d.path().join("my.jinja");
    std::fs::write(
        &file,
        "{% for m in messages %}[{{ m.role }}|{{ m.content }}]{% endfor %}{% if add_generation_prompt %}{{ greeting | default('go') }}:{% endif %}",
    )
    .unwrap();
    let f = file.to_str().unwrap();
    let prompt = |extra: &[&str]| {
        let mut args = vec!["--model", m, "--print-prompt", "--chat-template-file", f];
        args.extend_from_slice(extra);
        args.push("w5 w6");
        probespec(&args).ok().stdout
    };
    assert_eq!(prompt(&[]).trim_end(), "[user|w5 w6]go:");
    assert_eq!(
        prompt(&[
            "--system",
            "w7",
            "--chat-template-kwargs",
            r#"{"greeting": "hi"}"#
        ])
        .trim_end(),
        "[system|w7][user|w5 w6]hi:"
    );
    let missing = d.path().join("none.jinja");
    errors_with(
        &[
            "--model",
            m,
            "--chat-template-file",
            missing.to_str().unwrap(),
            "w5",
        ],
        "reading the chat template",
    );
    let broken = d.path().join("broken.jinja");
    std::fs::write(&broken, "{% for m in messages %}\n{{ m.content }\n").unwrap();
    errors_with(
        &[
            "--model",
            m,
            "--chat-template-file",
            broken.to_str().unwrap(),
            "w5",
        ],
        "cannot be compiled",
    );
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
    fails_with(&["--model", m, "--threads", "0", "w5"], None, "--threads");
    fails_with(&["--model", m, "-t", "two", "w5"], None, "--threads");
    fails_with(&["--model", m, "--kv-cache", "f16", "w5"], None, "--kv-cache");
    fails_with(&["--model", m, "--bc", "many", "w5"], None, "many");
    for (kwargs, says) in [
        ("enable_thinking=false", "not JSON"),
        ("[false]", "a JSON object of template variables"),
        (r#"{"messages": []}"#, "'messages' is set by probespec itself"),
    ] {
        fails_with(
            &["--model", m, "--chat-template-kwargs", kwargs, "w5"],
            None,
            says,
        );
    }
    fails_with(
        &[
            "--model",
            m,
            "--method",
            "esp",
            "--branches",
            "4,0",
            "--masks",
            "2",
            "w5",
        ],
        None,
        "--branches",
    );
    // ESP's tree flags with another method would be silently ignored.
    fails_with(
        &["--model", m, "--branches", "15,4", "w5"],
        None,
        "--branches and --tree static shape ESP's tree: add --method esp",
    );
    fails_with(
        &["--model", m, "--method", "pld", "--tree", "static", "w5"],
        None,
        "--method esp",
    );
}

#[test]
fn generates_from_argument_and_stdin_and_json() {
    let d = tiny_dir();
    let m = d.path().to_str().unwrap();
    let arg = probespec(&["--model", m, "--max-new-tokens", "8", "w5 w6 w7"]).ok();
    assert!(!arg.stdout.trim().is_empty());
    assert!(
        arg.stderr.contains("model calls"),
        "stats line missing: {}",
        arg.stderr
    );
    let stdin = probespec_stdin(&["--model", m, "--max-new-tokens", "8", "-"], b"w5 w6 w7").ok();
    assert_eq!(arg.stdout, stdin.stdout, "stdin and argument prompts differ");
    let json = probespec(&[
        "--model",
        m,
        "--max-new-tokens",
        "8",
        "--json",
        "--method",
        "ar",
        "w5 w6 w7",
    ])
    .ok();
    let v: serde_json::Value = serde_json::from_str(json.stdout.trim()).unwrap();
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
    let r = run(
        command(&["--model", "someorg/some-model", "hi"]).env("HF_HOME", hf.path()),
        None,
    );
    let err = &r.stderr;
    assert_ne!(r.code(), 0);
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
    let r = run(
        command(&["--model", "tiny/llama", "--max-new-tokens", "4", "w5 w6"]).env("HF_HOME", hf.path()),
        None,
    )
    .ok();
    assert!(!r.stdout.trim().is_empty());
}

/// A tiny LLaMA folder whose config.json has `field` set to `value` (removed when `value` is None).
fn tiny_dir_with(field: &str, value: Option<serde_json::Value>) -> tempfile::TempDir {
    let d = tiny_dir();
    let mut cfg = TinySpec::llama().config_json();
    match value {
        Some(v) => cfg[field] = v,
        None => {
            cfg.as_object_mut().unwrap().remove(field);
        }
    }
    std::fs::write(d.path().join("config.json"), cfg.to_string()).unwrap();
    d
}

#[test]
fn config_with_zero_attention_heads() {
    let d = tiny_dir_with("num_attention_heads", Some(0.into()));
    errors_with(
        &["--model", d.path().to_str().unwrap(), "w5"],
        "hidden size 64 is not a multiple of the attention head count 0",
    );
}

#[test]
fn config_with_zero_or_inconsistent_sizes() {
    use serde_json::json;
    for (field, value, needle) in [
        (
            "num_key_value_heads",
            json!(0),
            "invalid head counts: 4 attention heads, 0 key/value heads",
        ),
        (
            "num_key_value_heads",
            json!(3),
            "invalid head counts: 4 attention heads, 3 key/value heads",
        ),
        (
            "num_attention_heads",
            json!(5),
            "hidden size 64 is not a multiple of the attention head count 5",
        ),
        ("hidden_size", json!(0), "invalid head dimension 0"),
        (
            "num_hidden_layers",
            json!(0),
            "zero vocab_size, hidden_size or layer count",
        ),
        (
            "vocab_size",
            json!(0),
            "zero vocab_size, hidden_size or layer count",
        ),
        ("intermediate_size", json!(0), "intermediate size 0"),
        (
            "num_hidden_layers",
            json!(1u64 << 40),
            "layer count 1099511627776 is larger than 4096",
        ),
        (
            "max_position_embeddings",
            json!(u64::MAX),
            "context length 18446744073709551615 is larger",
        ),
        ("head_dim", json!(-1), "'head_dim' is not a non-negative integer"),
        (
            "hidden_size",
            json!("64"),
            "config.json's 'hidden_size' is missing or not a non-negative integer",
        ),
    ] {
        let d = tiny_dir_with(field, Some(value));
        errors_with(&["--model", d.path().to_str().unwrap(), "w5"], needle);
    }
}

#[test]
fn gguf_with_zero_head_count() {
    let d = common::tempdir();
    let p = d.path().join("m.gguf");
    TinySpec::llama().write_gguf(&p);
    common::edit_gguf(&p, |md, _| {
        md.insert(
            "llama.attention.head_count".into(),
            candle_core::quantized::gguf_file::Value::U32(0),
        );
    });
    errors_with(
        &["--model", p.to_str().unwrap(), "w5"],
        "invalid head counts: 0 attention heads, 2 key/value heads",
    );
}

/// candle's GGUF reader divides by `general.alignment`: 0 is refused before it reads; the default (32)
/// loads as without the key.
#[test]
fn gguf_with_zero_alignment() {
    use candle_core::quantized::gguf_file::Value;
    let d = common::tempdir();
    let p = d.path().join("m.gguf");
    TinySpec::llama().write_gguf(&p);
    let args = [
        "--model",
        p.to_str().unwrap(),
        "--no-chat-template",
        "--max-new-tokens",
        "4",
        "<s><s>", // the tiny byte-level vocabulary spells nothing else
    ];
    let plain = probespec(&args).ok().stdout;
    for (ty, value) in [("u32", Value::U32(32)), ("i8", Value::I8(32))] {
        common::edit_gguf(&p, |md, _| {
            md.insert("general.alignment".into(), value);
        });
        let r = probespec(&args);
        assert_eq!(r.code(), 0, "{ty}: {}", r.stderr);
        assert_eq!(r.stdout, plain, "{ty}");
    }
    for value in [Value::U32(0), Value::U8(0), Value::I16(0)] {
        TinySpec::llama().write_gguf(&p); // candle's own reader cannot read a file of alignment 0
        common::edit_gguf(&p, |md, _| {
            md.insert("general.alignment".into(), value);
        });
        errors_with(&args, "is not a readable GGUF file: general.alignment is 0");
    }
}

/// q/k matrices smaller than the head counts say, in the block format whose rows the loader reorders.
#[test]
fn gguf_with_attention_matrices_smaller_than_its_metadata() {
    use candle_core::quantized::{gguf_file::Value, GgmlDType, QTensor};
    let d = common::tempdir();
    let p = d.path().join("m.gguf");
    let write = || TinySpec::llama().write_gguf_as(&p, |_| GgmlDType::Q4_0);
    write();
    common::edit_gguf(&p, |md, _| {
        md.insert("llama.attention.head_count".into(), Value::U32(8));
    });
    errors_with(
        &["--model", p.to_str().unwrap(), "w5"],
        "tensor blk.0.attn_q.weight has shape [64, 64], but the metadata implies [128, 64]",
    );
    write();
    common::edit_gguf(&p, |_, tensors| {
        let k = tensors
            .iter_mut()
            .find(|(n, _)| n == "blk.1.attn_k.weight")
            .unwrap();
        let small = candle_core::Tensor::zeros((16, 64), candle_core::DType::F32, &candle_core::Device::Cpu);
        k.1 = QTensor::quantize(&small.unwrap(), GgmlDType::Q4_0).unwrap();
    });
    errors_with(
        &["--model", p.to_str().unwrap(), "w5"],
        "tensor blk.1.attn_k.weight has shape [16, 64], but the metadata implies [32, 64]",
    );
}

#[test]
fn huge_drafter_flags() {
    let d = tiny_dir();
    let m = d.path().to_str().unwrap();
    let huge = "100000000000";
    for (flags, needle) in [
        (
            vec!["--method", "lookahead", "--lookahead-window", huge],
            "--lookahead-window must be in 1..=1024 (got 100000000000)",
        ),
        (
            vec!["--method", "lookahead", "--lookahead-guesses", huge],
            "--lookahead-guesses must be in 1..=1024",
        ),
        (
            vec!["--method", "lookahead", "--lookahead-ngram", huge],
            "--lookahead-ngram must be in 2..=1024",
        ),
        (
            vec!["--method", "pld", "--ngram", huge],
            "--ngram must be in 1..=1024",
        ),
        (
            vec!["--method", "pld", "--draft-len", huge],
            "--draft-len must be in 1..=1024",
        ),
        (
            vec!["--method", "hybrid", "--ngram", huge],
            "--ngram must be in 1..=1024",
        ),
        (
            vec!["--method", "hybrid", "--draft-len", huge],
            "--draft-len must be in 1..=1024",
        ),
        (
            vec!["--method", "hybrid", "--bc", huge],
            "--bc 100000000000 is too large: it must be in 4..=1024",
        ),
        (
            vec!["--method", "esp", "--bc", huge],
            "--bc 100000000000 is too large",
        ),
        (vec!["--method", "esp", "--branches", huge], "each in 1..=1024"),
    ] {
        let mut args = vec!["--model", m];
        args.extend(flags);
        args.push("w5");
        errors_with(&args, needle);
    }
}

/// The largest `--max-new-tokens` means "until the context window or a stop token".
#[test]
fn max_new_tokens_at_the_integer_limit() {
    let d = tiny_dir();
    let m = d.path().to_str().unwrap();
    for method in ["ar", "esp", "pld"] {
        let r = probespec(&[
            "--model",
            m,
            "--method",
            method,
            "--json",
            "--max-new-tokens",
            "18446744073709551615",
            "w5 w6 w7",
        ]);
        assert_eq!(r.code(), 0, "{method}: {}", r.stderr);
        let v: serde_json::Value = serde_json::from_str(r.stdout.trim()).unwrap();
        let reason = v["finish_reason"].as_str().unwrap();
        assert!(
            reason == "context_window" || reason == "stop_token",
            "{method}: finish reason {reason}"
        );
    }
}

/// `probespec ... | head -c 10`: a reader that goes away ends the run quietly, with status 0.
#[test]
fn closed_stdout_ends_quietly() {
    let d = tiny_dir();
    let m = d.path().to_str().unwrap();
    for json in [false, true] {
        let mut args = vec!["--model", m, "--max-new-tokens", "64"];
        if json {
            args.push("--json");
        }
        args.push("-");
        let mut child = command(&args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // The reader closes its end before the prompt is even sent: every write to stdout fails.
        drop(child.stdout.take());
        child.stdin.take().unwrap().write_all(b"w5 w6 w7").unwrap();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "json {json}: {err}");
        assert!(err.is_empty(), "json {json}: {err}");
    }
}

/// With RUST_BACKTRACE=1 an error is still one line, without candle's captured backtrace; backtraces asked
/// for by name (RUST_LIB_BACKTRACE=1) still show, which shows the check below can see them.
#[test]
fn errors_stay_one_line_with_rust_backtrace() {
    let d = common::tempdir();
    let p = d.path().join("m.gguf");
    std::fs::write(&p, b"GGUF this is not a gguf file at all, just some bytes").unwrap();
    let backtrace_run = |lib: Option<&str>| {
        let mut cmd = command(&["--model", p.to_str().unwrap(), "w5"]);
        cmd.env("RUST_BACKTRACE", "1").env_remove("RUST_LIB_BACKTRACE");
        if let Some(v) = lib {
            cmd.env("RUST_LIB_BACKTRACE", v);
        }
        run(&mut cmd, None)
    };
    let has_frames = |err: &str| err.contains("Error::bt") || err.contains(" 0: ");
    let r = backtrace_run(None);
    let err = &r.stderr;
    assert_eq!(r.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(
        err.starts_with("error: ") && err.contains("not a readable GGUF file"),
        "{err}"
    );
    assert!(!has_frames(err), "backtrace in the message: {err}");
    let err = backtrace_run(Some("1")).stderr;
    assert!(has_frames(&err), "RUST_LIB_BACKTRACE=1 shows no backtrace: {err}");
}

/// The cost curve of `--bc auto` is kept on disk: `cost --save` writes it, a run reads it without timing
/// it again (the file is unchanged), and a corrupt file is timed again and replaced, never an error.
#[test]
fn the_cost_curve_is_saved_reused_and_replaced_when_corrupt() {
    let d = tiny_dir();
    let m = d.path().to_str().unwrap();
    let cache = tempfile::tempdir().unwrap();
    let with_cache = |args: &[&str]| {
        let mut cmd = command(args);
        cmd.env("PROBESPEC_COST_DIR", cache.path());
        run(&mut cmd, None)
    };
    let files = || -> Vec<std::path::PathBuf> {
        std::fs::read_dir(cache.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect()
    };
    let r = with_cache(&["cost", "--model", m, "--save", "--json"]);
    assert!(r.status.success(), "{}", r.stderr);
    let v: serde_json::Value = serde_json::from_str(r.stdout.trim()).unwrap();
    let saved = files();
    assert_eq!(saved.len(), 1, "{saved:?}");
    assert_eq!(v["path"].as_str().unwrap(), saved[0].to_str().unwrap());
    assert_eq!(v["curve"]["rows"][0], 1);
    let text = std::fs::read_to_string(&saved[0]).unwrap();
    // Every method under --bc auto reads the saved curve: the file stays as it was.
    for method in ["esp", "pld", "lookahead", "hybrid"] {
        let r = with_cache(&[
            "--model",
            m,
            "--method",
            method,
            "--max-new-tokens",
            "8",
            "w5 w6 w5 w6",
        ]);
        assert!(r.status.success(), "{method}: {}", r.stderr);
        assert!(
            r.stderr.contains("plain "),
            "{method}: the stats line names the plain share: {}",
            r.stderr
        );
        assert_eq!(std::fs::read_to_string(&saved[0]).unwrap(), text, "{method}");
        assert!(!r.stderr.contains("cost curve timed"), "{method}: {}", r.stderr);
    }
    // A corrupt file is timed again and replaced, and the run that paid for it says so.
    std::fs::write(&saved[0], "{ half a curve").unwrap();
    let r = with_cache(&["--model", m, "--max-new-tokens", "4", "w5 w6"]);
    assert!(r.status.success(), "{}", r.stderr);
    assert!(r.stderr.contains("| cost curve timed in "), "{}", r.stderr);
    let again: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&saved[0]).unwrap()).unwrap();
    assert_eq!(again["curve"]["rows"][0], 1);
    assert_eq!(files().len(), 1, "no temporary file is left behind");
    // A curve whose timing its budget cut short (a point without runs) is topped up by the next run,
    // and the one after reads it as it is.
    let full_runs = again["samples"]["points"][0][0].as_array().unwrap().len();
    assert!(full_runs >= 3, "{again}");
    let mut short = again.clone();
    short["samples"]["points"][0][1] = serde_json::json!([]);
    std::fs::write(&saved[0], short.to_string()).unwrap();
    let r = with_cache(&["--model", m, "--max-new-tokens", "4", "w5 w6"]);
    assert!(r.stderr.contains("| cost curve timed in "), "{}", r.stderr);
    let topped: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&saved[0]).unwrap()).unwrap();
    assert_eq!(
        topped["samples"]["points"][0][1].as_array().unwrap().len(),
        full_runs,
        "{topped}"
    );
    assert_eq!(
        topped["samples"]["points"][0][0],
        again["samples"]["points"][0][0]
    );
    let r = with_cache(&["--model", m, "--max-new-tokens", "4", "w5 w6"]);
    assert!(!r.stderr.contains("cost curve timed"), "{}", r.stderr);
    // --save keeps a model's curve: a random shape has none.
    let r = with_cache(&["cost", "--shape", "smollm2-135m", "--save"]);
    assert!(!r.status.success());
}

/// `--threads` far past the machine's cores is refused at once (thousands of spinning threads would only
/// stall it), on every command that takes it.
#[test]
fn threads_far_past_the_cores_are_refused() {
    let t = std::time::Instant::now();
    for args in [
        &["--threads", "4096", "--print-prompt", "Hi"][..],
        &["serve", "-t", "1024"],
    ] {
        fails_with(args, None, "--threads");
    }
    assert!(t.elapsed().as_secs() < 30, "refusing took {:?}", t.elapsed());
    let cores = std::thread::available_parallelism().unwrap().get();
    let d = tiny_dir();
    probespec(&[
        "--model",
        d.path().to_str().unwrap(),
        "-t",
        &cores.to_string(),
        "--print-prompt",
        "w1",
    ])
    .ok();
}

/// `PROBESPEC_ISA` caps the kernels at a lesser variant (the AVX2 tiles on an AVX-512 CPU, say). Every
/// variant computes the portable code's bits, so the real SmolLM2 (Q4_1, 8-bit activations) answers
/// with the same tokens under each variant this CPU has as under its default.
#[test]
fn every_kernel_variant_the_cpu_has_gives_the_same_answer() {
    use probespec::kernels::Isa;
    let model = common::smollm2_path();
    let args = [
        "--model",
        model.to_str().unwrap(),
        "--max-new-tokens",
        "24",
        "--json",
        "Name three rivers of Europe and say where each one ends.",
    ];
    let tokens = |isa: Option<Isa>| {
        let mut cmd = command(&args);
        if let Some(isa) = isa {
            cmd.env(probespec::kernels::isa::ISA_ENV, isa.name());
        }
        let out = run(&mut cmd, None).ok();
        let v: serde_json::Value = serde_json::from_str(out.stdout.trim()).unwrap();
        v["token_ids"].clone()
    };
    let default = tokens(None);
    let mut tried = 0;
    for isa in Isa::ALL.into_iter().filter(|i| i.detected()) {
        assert_eq!(
            tokens(Some(isa)),
            default,
            "{} differs from the default",
            isa.name()
        );
        tried += 1;
    }
    assert!(tried >= 2, "the portable variant and at least one SIMD variant");
}

#[test]
fn an_unknown_or_missing_kernel_variant_is_refused() {
    let d = tiny_dir();
    let m = d.path().to_str().unwrap();
    let with = |isa: &str| {
        let mut cmd = command(&["--model", m, "--max-new-tokens", "2", "w5"]);
        cmd.env(probespec::kernels::isa::ISA_ENV, isa);
        run(&mut cmd, None)
    };
    with("sse9").errors_with("PROBESPEC_ISA=sse9: expected one of portable, avx2");
    let missing = probespec::kernels::Isa::ALL
        .into_iter()
        .find(|i| !i.detected())
        .unwrap();
    with(missing.name()).errors_with("this CPU lacks it");
}
