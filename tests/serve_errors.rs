//! `probespec serve` given bad input and bad keys: a 4xx with an OpenAI-shaped error object for each, no
//! panic, and the server keeps answering afterwards.

mod common;

use common::server::{get, post_raw, Server};
use common::TinySpec;
use serde_json::{json, Value};

fn tiny_dir() -> tempfile::TempDir {
    let d = common::tempdir();
    TinySpec::llama().write_hf(d.path());
    d
}

/// An OpenAI error object: `{"error": {"message": non-empty, "type": ..., "param": ..., "code": ...}}`.
fn assert_error(status: u16, v: &Value, expected: u16, needle: &str, what: &str) {
    assert_eq!(status, expected, "{what}: {v}");
    let e = &v["error"];
    let message = e["message"]
        .as_str()
        .unwrap_or_else(|| panic!("{what}: no error message: {v}"));
    assert!(
        message.contains(needle),
        "{what}: expected '{needle}' in '{message}'"
    );
    assert!(e["type"].is_string(), "{what}: {v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{what}: {v}");
}

#[test]
fn bad_requests_get_openai_shaped_4xx_and_the_server_keeps_serving() {
    let dir = tiny_dir();
    // A small body limit. The oversized body below (9 MB) is larger than a loopback socket's buffers: the
    // server must read it to its end before answering 413, or the client, still writing, meets a reset.
    let s = Server::start(&["--model", dir.path().to_str().unwrap(), "--max-body", "65536"]);
    let chat = s.url("/v1/chat/completions");
    let user = json!([{"role": "user", "content": "w10 w11"}]);
    let cases: Vec<(&str, String, u16, &str)> = vec![
        ("malformed JSON", "{\"messages\": [".into(), 400, "invalid request body"),
        ("not an object", "[1, 2]".into(), 400, "invalid request body"),
        ("empty body", "".into(), 400, "empty"),
        ("no messages field", json!({"model": "x"}).to_string(), 400, "messages"),
        ("empty message list", json!({"messages": []}).to_string(), 400, "messages is empty"),
        (
            "unknown role",
            json!({"messages": [{"role": "wizard", "content": "w10"}]}).to_string(),
            400,
            "unsupported role 'wizard'",
        ),
        (
            "content of the wrong type",
            json!({"messages": [{"role": "user", "content": 42}]}).to_string(),
            400,
            "invalid request body",
        ),
        (
            "image content",
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
                .to_string(),
            400,
            "image_url",
        ),
        (
            "temperature of the wrong type",
            json!({"messages": user, "temperature": "hot"}).to_string(),
            400,
            "invalid request body",
        ),
        ("negative max_tokens", json!({"messages": user, "max_tokens": -1}).to_string(), 400, "invalid request body"),
        ("zero max_tokens", json!({"messages": user, "max_tokens": 0}).to_string(), 400, "at least 1"),
        (
            "max_tokens beyond the context",
            json!({"messages": user, "max_tokens": 100000}).to_string(),
            400,
            "context window of 512",
        ),
        (
            "max_completion_tokens beyond the context",
            json!({"messages": user, "max_completion_tokens": 512}).to_string(),
            400,
            "max_completion_tokens is 512",
        ),
        ("temperature out of range", json!({"messages": user, "temperature": 3.0}).to_string(), 400, "temperature"),
        ("top_p out of range", json!({"messages": user, "top_p": 0.0}).to_string(), 400, "top_p"),
        ("n > 1", json!({"messages": user, "n": 2}).to_string(), 400, "n is not supported"),
        (
            "five stop strings",
            json!({"messages": user, "stop": ["a", "b", "c", "d", "e"]}).to_string(),
            400,
            "at most 4",
        ),
        (
            "unknown method",
            json!({"messages": user, "probespec": {"method": "magic"}}).to_string(),
            400,
            "unknown method 'magic'",
        ),
        (
            "bad budget",
            json!({"messages": user, "probespec": {"bc": 0}}).to_string(),
            400,
            "bc must be a positive number",
        ),
        (
            "misspelt probespec field",
            json!({"messages": user, "probespec": {"metod": "ar"}}).to_string(),
            400,
            "unknown field",
        ),
        (
            "chat_template_kwargs not an object",
            json!({"messages": user, "chat_template_kwargs": [true]}).to_string(),
            400,
            "an object of template variables",
        ),
        (
            "chat_template_kwargs replacing the messages",
            json!({"messages": user, "chat_template_kwargs": {"messages": []}}).to_string(),
            400,
            "'messages' is set by probespec itself",
        ),
        (
            "ends with the assistant",
            json!({"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w2"}]}).to_string(),
            400,
            "end with a user message",
        ),
    ];
    for (what, body, status, needle) in &cases {
        let (got, v) = post_raw(&chat, body, None);
        assert_error(got, &v, *status, needle, what);
    }
    let (got, v) = post_raw(
        &s.url("/v1/completions"),
        &json!({"prompt": "  "}).to_string(),
        None,
    );
    assert_error(got, &v, 400, "the prompt is empty", "blank completion prompt");
    let (got, v) = post_raw(
        &s.url("/v1/completions"),
        &json!({"prompt": "w9", "echo": true}).to_string(),
        None,
    );
    assert_error(got, &v, 400, "not supported", "echo");

    // Past the body limit: 413, still OpenAI-shaped.
    let big = format!(
        "{{\"messages\": [{{\"role\": \"user\", \"content\": \"{}\"}}]}}",
        "w5 ".repeat(3_000_000)
    );
    let (got, v) = post_raw(&chat, &big, None);
    assert_error(got, &v, 413, "body", "oversized body");
    // A prompt longer than the context window.
    let long = json!({"messages": [{"role": "user", "content": "w5 ".repeat(600)}]}).to_string();
    let (got, v) = post_raw(&chat, &long, None);
    assert_error(
        got,
        &v,
        400,
        "longer than the model's context window",
        "long prompt",
    );

    let (got, v) = get(&s.url("/v1/nothing"), None);
    assert_error(got, &v, 404, "no route", "unknown route");
    let (got, v) = get(&chat, None);
    assert_error(got, &v, 405, "method not allowed", "GET on a POST route");

    // Still serving, and no request panicked.
    let (got, v) = post_raw(
        &chat,
        &json!({"messages": user, "max_tokens": 4}).to_string(),
        None,
    );
    assert_eq!(got, 200, "{v}");
    let h = s.health();
    assert_eq!(h["failed"], 0, "{h}");
    let log = s.log.lock().unwrap().clone();
    assert!(!log.contains("panicked"), "{log}");
}

#[test]
fn the_api_key_is_required_when_set() {
    let dir = tiny_dir();
    let model = dir.path().to_str().unwrap();
    let body = json!({"messages": [{"role": "user", "content": "w10"}], "max_tokens": 3}).to_string();
    // From the flag, and from the environment.
    for (args, env) in [
        (vec!["--model", model, "--api-key", "sk-test-1"], vec![]),
        (vec!["--model", model], vec![("PROBESPEC_API_KEY", "sk-test-1")]),
    ] {
        let s = Server::start_with_env(&args, &env);
        let chat = s.url("/v1/chat/completions");
        for key in [None, Some("sk-test-2"), Some("sk-test-1x"), Some("")] {
            let (got, v) = post_raw(&chat, &body, key);
            assert_error(got, &v, 401, "API key", &format!("key {key:?}"));
        }
        let (got, v) = get(&s.url("/v1/models"), None);
        assert_error(got, &v, 401, "API key", "models without a key");
        let (got, v) = post_raw(&chat, &body, Some("sk-test-1"));
        assert_eq!(got, 200, "{v}");
        let (got, _) = get(&s.url("/v1/models"), Some("sk-test-1"));
        assert_eq!(got, 200);
        // Health stays open for probes.
        assert_eq!(s.health()["status"], "ok");
    }
}

#[test]
fn bad_flags_fail_with_one_line() {
    let dir = tiny_dir();
    let model = dir.path().to_str().unwrap();
    common::binary::probespec(&["serve", "--model", model, "--port", "0", "--queue", "0"])
        .errors_with("--queue");
    common::binary::probespec(&["serve", "--model", model, "--port", "0", "--api-key", ""])
        .errors_with("API key is empty");
    common::binary::probespec(&["serve", "--model", model, "--host", "256.1.1.1"])
        .errors_with("cannot listen on");
    common::binary::probespec(&["serve", "--model", "/no/such/model.gguf"]).errors_with("not found");
}
