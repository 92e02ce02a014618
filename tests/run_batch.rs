//! `probespec run-batch` on the real SmolLM2 GGUF: every answer of a file is the one-shot CLI's for the
//! same request (several decoded together), the lines come in the input's order, a bad line gets an
//! error line of its own while the others are answered, and a second run keeps the answers an earlier
//! one wrote.

mod common;

use common::binary::{probespec, probespec_stdin, Run};
use serde_json::{json, Value};
use std::path::Path;

fn model() -> String {
    common::smollm2_path().to_str().unwrap().to_string()
}

/// The lines of an output file, as JSON.
fn output_lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn token_ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

/// The one-shot CLI's answer (`--json`) to `prompt` with `flags`.
fn cli(flags: &[&str], prompt: &str) -> Value {
    let model = model();
    let mut args = vec!["--model", &model, "--json"];
    args.extend_from_slice(flags);
    args.push(prompt);
    serde_json::from_str(probespec(&args).ok().stdout.trim()).unwrap()
}

/// Checks that output line `line` answers with the CLI's tokens and text.
fn assert_clis(line: &Value, cli: &Value, what: &str) {
    assert_eq!(line["error"], Value::Null, "{what}: {line}");
    assert_eq!(line["response"]["status_code"], 200, "{what}");
    let body = &line["response"]["body"];
    assert_eq!(
        token_ids(&body["probespec"]["completion_token_ids"]),
        token_ids(&cli["token_ids"]),
        "{what}"
    );
    let text = match body["object"].as_str() {
        Some("chat.completion") => &body["choices"][0]["message"]["content"],
        _ => &body["choices"][0]["text"],
    };
    assert_eq!(text, &cli["text"], "{what}");
    assert_eq!(line["response"]["request_id"], body["id"], "{what}");
}

#[test]
fn answers_are_the_clis_in_input_order_and_bad_lines_get_their_own_error() {
    let chat = |id: &str, messages: Value, extra: Value| {
        let mut body = json!({"messages": messages});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        json!({"custom_id": id, "method": "POST", "url": "/v1/chat/completions", "body": body}).to_string()
    };
    let user = |text: &str| json!([{"role": "user", "content": text}]);
    let completion = |id: &str, prompt: &str, extra: Value| {
        let mut body = json!({"prompt": prompt});
        body.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        json!({"custom_id": id, "url": "/v1/completions", "body": body}).to_string()
    };
    let copy = "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.";
    let reverse = "Copy this list in reverse order: apple, banana, cherry, date.";
    let input = [
        chat(
            "capital",
            user("What is the capital of France?"),
            json!({"max_tokens": 24, "probespec": {"method": "ar"}}),
        ),
        completion(
            "copy",
            copy,
            json!({"max_tokens": 24, "probespec": {"method": "pld", "draft_len": 4}}),
        ),
        "this line is not JSON".to_string(),
        chat("too-hot", user("Hi"), json!({"temperature": 5})),
        chat(
            "autumn",
            json!([{"role": "system", "content": "You are a poet."},
                   {"role": "user", "content": "Write one sentence about autumn."}]),
            json!({"max_tokens": 20, "temperature": 0.8, "seed": 7,
                   "probespec": {"method": "esp", "bc": 10}}),
        ),
        json!({"custom_id": "embed", "url": "/v1/embeddings", "body": {"input": "x"}}).to_string(),
        completion(
            "reverse",
            reverse,
            json!({"max_tokens": 24, "probespec": {"method": "lookahead", "lookahead_window": 4}}),
        ),
        chat(
            "past",
            user("Rewrite in the past tense: I walk to the store."),
            json!({"max_tokens": 20}),
        ),
    ]
    .join("\n");
    let dir = common::tempdir();
    let (inp, out) = (dir.path().join("in.jsonl"), dir.path().join("out.jsonl"));
    std::fs::write(&inp, input).unwrap();
    let model = model();
    let run = probespec(&[
        "run-batch",
        "--model",
        &model,
        "-i",
        inp.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--parallel",
        "3",
    ]);
    assert_eq!(run.code(), 1, "{}", run.stderr);
    assert!(!run.stderr.contains("panicked"), "{}", run.stderr);
    let last = run.stderr.trim_end().lines().last().unwrap();
    assert!(
        last.starts_with("error: 3 of 8 requests failed"),
        "{}",
        run.stderr
    );

    let lines = output_lines(&out);
    let ids: Vec<&Value> = lines.iter().map(|l| &l["custom_id"]).collect();
    assert_eq!(
        ids,
        [
            &json!("capital"),
            &json!("copy"),
            &Value::Null,
            &json!("too-hot"),
            &json!("autumn"),
            &json!("embed"),
            &json!("reverse"),
            &json!("past")
        ]
    );
    // The bad lines: not a request (no response), a 400 naming its field, an endpoint not served.
    assert_eq!(lines[2]["response"], Value::Null);
    assert!(lines[2]["error"]["message"]
        .as_str()
        .unwrap()
        .starts_with("line 3: not JSON"));
    assert_eq!(lines[3]["response"]["status_code"], 400);
    assert_eq!(lines[3]["error"]["param"], "temperature");
    assert!(lines[5]["error"]["message"]
        .as_str()
        .unwrap()
        .contains("'/v1/embeddings'"));

    assert_clis(
        &lines[0],
        &cli(
            &["--max-new-tokens", "24", "--method", "ar"],
            "What is the capital of France?",
        ),
        "chat, ar",
    );
    assert_clis(
        &lines[1],
        &cli(
            &[
                "--no-chat-template",
                "--max-new-tokens",
                "24",
                "--method",
                "pld",
                "--draft-len",
                "4",
            ],
            copy,
        ),
        "completion, pld",
    );
    assert_clis(
        &lines[4],
        &cli(
            &[
                "--system",
                "You are a poet.",
                "--max-new-tokens",
                "20",
                "--temperature",
                "0.8",
                "--seed",
                "7",
                "--method",
                "esp",
                "--bc",
                "10",
            ],
            "Write one sentence about autumn.",
        ),
        "chat, esp, sampled",
    );
    assert_clis(
        &lines[6],
        &cli(
            &[
                "--no-chat-template",
                "--max-new-tokens",
                "24",
                "--method",
                "lookahead",
                "--lookahead-window",
                "4",
            ],
            reverse,
        ),
        "completion, lookahead",
    );
    assert_clis(
        &lines[7],
        &cli(
            &["--max-new-tokens", "20"],
            "Rewrite in the past tense: I walk to the store.",
        ),
        "chat, the default method",
    );
}

#[test]
fn prompt_lines_are_the_clis_and_a_second_run_keeps_the_answers_written() {
    let model = model();
    let dir = common::tempdir();
    let out = dir.path().join("out.jsonl");
    let out_arg = out.to_str().unwrap();
    let prompts = "What is 2+2?\n\nName a colour.\nSay hello in French.\n";
    let run_batch = |extra: &[&str]| -> Run {
        let mut args = vec![
            "run-batch",
            "--model",
            &model,
            "-o",
            out_arg,
            "--max-new-tokens",
            "12",
            "--method",
            "ar",
            "--parallel",
            "2",
        ];
        args.extend_from_slice(extra);
        probespec_stdin(&args, prompts.as_bytes())
    };
    run_batch(&[]).ok();
    let first = std::fs::read_to_string(&out).unwrap();
    let lines = output_lines(&out);
    let ids: Vec<&str> = lines.iter().map(|l| l["custom_id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["line-1", "line-3", "line-4"]);
    for (line, prompt) in lines
        .iter()
        .zip(["What is 2+2?", "Name a colour.", "Say hello in French."])
    {
        assert_clis(
            line,
            &cli(&["--max-new-tokens", "12", "--method", "ar"], prompt),
            prompt,
        );
    }

    // An output holding line-3's answer and a failure of line-1: line-3's line is kept as it is (a new
    // answer would carry a new id and time), the others are answered again, all in input order.
    let kept = first.lines().nth(1).unwrap();
    let failed = json!({"id": "batch_req_1", "custom_id": "line-1", "response": null,
                        "error": {"message": "stopped", "type": "server_error", "param": null, "code": null}});
    std::fs::write(&out, format!("{failed}\n{kept}\n")).unwrap();
    let resumed = run_batch(&[]).ok();
    assert!(
        resumed.stderr.contains("1 answers kept, 2 requests to go"),
        "{}",
        resumed.stderr
    );
    let again = std::fs::read_to_string(&out).unwrap();
    assert_eq!(again.lines().nth(1).unwrap(), kept);
    let again = output_lines(&out);
    assert_eq!(again.len(), 3);
    for (a, b) in again.iter().zip(&lines) {
        assert_eq!(a["custom_id"], b["custom_id"]);
        assert_eq!(
            a["response"]["body"]["probespec"]["completion_token_ids"],
            b["response"]["body"]["probespec"]["completion_token_ids"]
        );
    }

    // An output with another input's answers is left as it is, unless --overwrite.
    let foreign = first.replace("\"line-4\"", "\"line-9\"");
    std::fs::write(&out, &foreign).unwrap();
    run_batch(&[]).errors_with("holds another input's answers: pass --overwrite");
    assert_eq!(std::fs::read_to_string(&out).unwrap(), foreign);
    run_batch(&["--overwrite"]).ok();
    assert_eq!(output_lines(&out).len(), 3);
}

#[test]
fn bad_invocations_end_in_one_line() {
    let model = model();
    let dir = common::tempdir();
    let out = dir.path().join("out.jsonl");
    let out = out.to_str().unwrap();
    let missing = dir.path().join("missing.jsonl");
    probespec(&[
        "run-batch",
        "--model",
        &model,
        "-i",
        missing.to_str().unwrap(),
        "-o",
        out,
    ])
    .errors_with("cannot read");
    probespec_stdin(&["run-batch", "--model", &model, "-o", out], b"\n  \n")
        .errors_with("stdin holds no requests");
    probespec_stdin(
        &["run-batch", "--model", &model, "-o", out, "--parallel", "0"],
        b"hi\n",
    )
    .errors_with("--parallel must be at least 1");
    probespec_stdin(
        &["run-batch", "--model", &model, "-o", out, "--max-bc", "0"],
        b"hi\n",
    )
    .errors_with("--max-bc");
    probespec(&["run-batch", "--model", &model]).fails_with("--output");
    assert!(!Path::new(out).exists(), "a failed start wrote {out}");
}
