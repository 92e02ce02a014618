//! `probespec serve` on a tiny checkpoint: every endpoint in OpenAI's shapes, streamed and whole; answers
//! token for token those of the library's `generate` and of the one-shot CLI for the same messages and
//! settings (greedy and seeded sampling, every method); a second turn prefilled from the cache.

mod common;

use common::server::{token_ids, Server};
use common::TinySpec;
use probespec::decode::method::Method;
use probespec::decode::sampling::SamplingParams;
use probespec::model::load::{load_model, LoadOptions, LoadedModel as Loaded, ModelSource};
use probespec::tokenizer::Message;
use serde_json::{json, Value};

/// A tiny LLaMA written to a temporary folder, loaded in-process as the server loads it.
fn tiny() -> (tempfile::TempDir, Loaded) {
    let dir = common::tempdir();
    TinySpec::llama().write_hf(dir.path());
    let opts = LoadOptions {
        device: candle_core::Device::Cpu,
        dtype: candle_core::DType::F32,
        dequantize: false,
        activations: Default::default(),
    };
    let loaded = load_model(&ModelSource::HfDir(dir.path().to_path_buf()), &opts).unwrap();
    (dir, loaded)
}

/// What the library generates for `messages` through the chat template.
fn library_answer(
    l: &Loaded,
    messages: &[Message],
    method: &Method,
    max_new: usize,
    sampling: SamplingParams,
) -> Vec<u32> {
    let tok = &l.tokenizer;
    let prompt = tok
        .encode(&tok.apply_chat_template(messages, true).unwrap())
        .unwrap();
    common::decoding::library_tokens(l, &prompt, method, max_new, sampling)
}

fn chat_body(messages: &[Message], extra: Value) -> Value {
    let mut body = json!({
        "model": "tiny",
        "messages": messages.iter().map(|m| json!({"role": m.role, "content": m.content})).collect::<Vec<_>>(),
    });
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

#[test]
fn health_and_models() {
    let (dir, _) = tiny();
    let s = Server::start(&["--model", dir.path().to_str().unwrap()]);
    let h = s.health();
    assert_eq!(h["status"], "ok");
    assert_eq!(h["waiting"], 0);
    let (status, m) = common::server::get(&s.url("/v1/models"), None);
    assert_eq!(status, 200);
    assert_eq!(m["object"], "list");
    let name = dir.path().file_name().unwrap().to_str().unwrap();
    assert_eq!(m["data"][0]["id"], name);
    assert_eq!(m["data"][0]["object"], "model");
}

/// Chat answers of several methods, greedy and sampled, equal the library's generate on the rendered
/// messages; the answer is a `chat.completion` with usage and probespec's statistics.
#[test]
fn chat_answers_are_the_librarys_tokens() {
    let (dir, l) = tiny();
    let s = Server::start(&["--model", dir.path().to_str().unwrap()]);
    let messages = [
        Message::new("system", "w5 w6"),
        Message::new("user", "w10 w11 w12 w10 w11"),
    ];
    let methods = [
        ("ar", json!({"method": "ar"}), Method::Ar),
        (
            "pld",
            json!({"method": "pld", "draft_len": 4}),
            common::decoding::pld(3, 4),
        ),
        (
            "esp",
            json!({"method": "esp", "bc": 10}),
            common::decoding::esp(10, 1, probespec::decode::method::EspTree::Dynamic),
        ),
        (
            "hybrid",
            json!({"method": "hybrid", "bc": "10"}),
            common::decoding::hybrid(10, 1),
        ),
        (
            "lookahead",
            json!({"method": "lookahead", "lookahead_window": 4}),
            common::decoding::lookahead(4, 5, 7),
        ),
    ];
    for (name, extra, method) in methods {
        for (temperature, seed) in [(0.0f32, 299792458u64), (0.9, 7)] {
            let sampling = SamplingParams {
                temperature,
                seed,
                ..Default::default()
            };
            let expected = library_answer(&l, &messages, &method, 24, sampling);
            let body = chat_body(
                &messages,
                json!({"max_tokens": 24, "temperature": temperature, "seed": seed, "probespec": extra}),
            );
            let a = s.ok("/v1/chat/completions", &body);
            assert_eq!(token_ids(&a), expected, "{name} at temperature {temperature}");
            assert_eq!(a["object"], "chat.completion");
            assert!(a["id"].as_str().unwrap().starts_with("chatcmpl-"));
            let choice = &a["choices"][0];
            assert_eq!(choice["message"]["role"], "assistant");
            assert_eq!(
                choice["message"]["content"],
                l.tokenizer.decode(&expected).unwrap(),
                "{name}: the content is the answer's text"
            );
            let finish = if expected.len() == 24 { "length" } else { "stop" };
            assert_eq!(choice["finish_reason"], finish);
            assert_eq!(a["usage"]["completion_tokens"], expected.len());
            let p = a["usage"]["prompt_tokens"].as_u64().unwrap();
            assert_eq!(
                a["usage"]["total_tokens"].as_u64().unwrap(),
                p + expected.len() as u64
            );
            assert_eq!(a["probespec"]["method"], name);
            assert!(a["probespec"]["tau"].as_f64().unwrap() >= 1.0);
        }
    }
}

/// The server's answer is the one-shot CLI's, flags for fields: system message, length, sampling, method.
#[test]
fn chat_answers_are_the_clis() {
    let (dir, _) = tiny();
    let model = dir.path().to_str().unwrap();
    let s = Server::start(&["--model", model]);
    for (temperature, seed, method) in [("0", "1", "hybrid"), ("0.8", "42", "pld"), ("1.2", "5", "ar")] {
        let cli = common::binary::probespec(&[
            "--model",
            model,
            "--json",
            "--system",
            "w7 w8",
            "--max-new-tokens",
            "20",
            "--temperature",
            temperature,
            "--seed",
            seed,
            "--method",
            method,
            "w30 w31 w32",
        ])
        .ok();
        let cli: Value = serde_json::from_str(cli.stdout.trim()).unwrap();
        let body = chat_body(
            &[
                Message::new("system", "w7 w8"),
                Message::new("user", "w30 w31 w32"),
            ],
            json!({
                "max_tokens": 20,
                "temperature": temperature.parse::<f32>().unwrap(),
                "seed": seed.parse::<u64>().unwrap(),
                "probespec": {"method": method},
            }),
        );
        let a = s.ok("/v1/chat/completions", &body);
        let cli_ids: Vec<u32> = serde_json::from_value(cli["token_ids"].clone()).unwrap();
        assert_eq!(token_ids(&a), cli_ids, "{method} at temperature {temperature}");
        assert_eq!(a["choices"][0]["message"]["content"], cli["text"]);
        assert_eq!(
            a["usage"]["prompt_tokens"],
            cli["prompt_token_ids"].as_array().unwrap().len()
        );
    }
    // /v1/completions is the CLI without the chat template.
    let cli = common::binary::probespec(&[
        "--model",
        model,
        "--json",
        "--no-chat-template",
        "--max-new-tokens",
        "16",
        "w9 w10 w11",
    ])
    .ok();
    let cli: Value = serde_json::from_str(cli.stdout.trim()).unwrap();
    let a = s.ok(
        "/v1/completions",
        &json!({"prompt": "w9 w10 w11", "max_tokens": 16}),
    );
    assert_eq!(a["object"], "text_completion");
    assert_eq!(a["choices"][0]["text"], cli["text"]);
    assert_eq!(
        token_ids(&a),
        serde_json::from_value::<Vec<u32>>(cli["token_ids"].clone()).unwrap()
    );
}

/// Template variables, from the server's flag and over it from a request, reach the prompt as they reach
/// the one-shot CLI's: the tiny template adds `w5` after the generation prompt when `enable_thinking` is
/// false, as Qwen 3's adds an empty thinking block.
#[test]
fn chat_template_kwargs_reach_the_prompt() {
    let (dir, l) = tiny();
    let model = dir.path().to_str().unwrap();
    let off = r#"{"enable_thinking": false}"#;
    let s = Server::start(&["--model", model, "--chat-template-kwargs", off]);
    // The prompts written out by hand: the template's text with and without the added word.
    let ids = |text: &str| l.tokenizer.encode(text).unwrap();
    let thinking = ids("user w30 w31 <|im_end|> w4 ");
    let not_thinking = ids("user w30 w31 <|im_end|> w4 w5 ");
    assert_eq!(not_thinking.len(), thinking.len() + 1);
    let cli_prompt = |kwargs: Option<&str>| -> Vec<u32> {
        let mut args = vec!["--model", model, "--json", "--max-new-tokens", "4"];
        args.extend(
            kwargs
                .map(|k| ["--chat-template-kwargs", k])
                .into_iter()
                .flatten(),
        );
        args.push("w30 w31");
        let out: Value = serde_json::from_str(common::binary::probespec(&args).ok().stdout.trim()).unwrap();
        serde_json::from_value(out["prompt_token_ids"].clone()).unwrap()
    };
    assert_eq!(cli_prompt(None), thinking);
    assert_eq!(cli_prompt(Some(off)), not_thinking);
    let user = [Message::new("user", "w30 w31")];
    for (extra, want) in [
        (json!({}), &not_thinking),
        (json!({"chat_template_kwargs": null}), &not_thinking),
        (
            json!({"chat_template_kwargs": {"enable_thinking": true}}),
            &thinking,
        ),
        (json!({"chat_template_kwargs": {"other": 1}}), &not_thinking),
    ] {
        let mut body = chat_body(&user, extra.clone());
        body["max_tokens"] = json!(4);
        let a = s.ok("/v1/chat/completions", &body);
        assert_eq!(a["usage"]["prompt_tokens"], want.len(), "{extra}");
    }
}

/// `--reasoning-format deepseek`: a template that opens a thinking block for the model puts the whole
/// answer (never closed by this tiny model) in `reasoning_content`, whole and streamed, and it is the CLI's
/// text; a prompt that opens none keeps the answer in `content`.
#[test]
fn reasoning_format_deepseek_sends_thinking_apart() {
    let (dir, _) = tiny();
    let model = dir.path().to_str().unwrap();
    let template = dir.path().join("think.jinja");
    std::fs::write(
        &template,
        "{% for m in messages %}{{ m.content }} {% endfor %}w4 {% if opens %}<think>\n{% endif %}",
    )
    .unwrap();
    let t = template.to_str().unwrap();
    let s = Server::start(&[
        "--model",
        model,
        "--chat-template-file",
        t,
        "--reasoning-format",
        "deepseek",
    ]);
    let user = [Message::new("user", "w30 w31")];
    for opens in [true, false] {
        let kwargs = format!(r#"{{"opens": {opens}}}"#);
        let cli = common::binary::probespec(&[
            "--model",
            model,
            "--json",
            "--max-new-tokens",
            "12",
            "--chat-template-file",
            t,
            "--chat-template-kwargs",
            &kwargs,
            "w30 w31",
        ])
        .ok();
        let cli: Value = serde_json::from_str(cli.stdout.trim()).unwrap();
        let text = cli["text"].as_str().unwrap();
        assert!(!text.is_empty() && !text.contains("think>"), "{text}");
        let extra = json!({"max_tokens": 12, "chat_template_kwargs": {"opens": opens}});
        let whole = s.ok("/v1/chat/completions", &chat_body(&user, extra.clone()));
        let message = &whole["choices"][0]["message"];
        let (thinking, reply) = if opens {
            (json!(text), json!(""))
        } else {
            (Value::Null, json!(text))
        };
        assert_eq!(message["reasoning_content"], thinking, "opens {opens}: {message}");
        assert_eq!(message["content"], reply, "opens {opens}: {message}");
        let mut body = chat_body(&user, extra);
        body["stream"] = json!(true);
        let chunks = s.stream("/v1/chat/completions", &body);
        let field = |name: &str| -> String {
            chunks
                .iter()
                .filter_map(|c| c["choices"][0]["delta"].get(name).and_then(Value::as_str))
                .collect()
        };
        let (thinking, reply) = if opens { (text, "") } else { ("", text) };
        assert_eq!(
            (field("reasoning_content").as_str(), field("content").as_str()),
            (thinking, reply)
        );
    }
}

/// A streamed answer: a role chunk, text chunks that add up to the whole answer, a last chunk with the
/// finish reason, usage and statistics, then [DONE].
#[test]
fn streaming_sends_the_same_answer_in_chunks() {
    let (dir, _) = tiny();
    let s = Server::start(&["--model", dir.path().to_str().unwrap()]);
    let body = chat_body(
        &[Message::new("user", "w40 w41 w42")],
        json!({"max_tokens": 30, "seed": 3, "temperature": 0.7}),
    );
    let whole = s.ok("/v1/chat/completions", &body);
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let chunks = s.stream("/v1/chat/completions", &streamed);
    assert!(chunks.len() >= 3, "{chunks:?}");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut text = String::new();
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], chunks[0]["id"]);
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    let last = chunks.last().unwrap();
    assert_eq!(text, whole["choices"][0]["message"]["content"].as_str().unwrap());
    assert_eq!(
        last["choices"][0]["finish_reason"],
        whole["choices"][0]["finish_reason"]
    );
    assert_eq!(
        last["usage"]["completion_tokens"],
        whole["usage"]["completion_tokens"]
    );
    assert_eq!(token_ids(last), token_ids(&whole));
    // More than one text chunk: tokens go out as they are committed, not at the end.
    let text_chunks = chunks
        .iter()
        .filter(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty())
        })
        .count();
    assert!(text_chunks > 1, "{chunks:?}");

    let comp = json!({"prompt": "w40 w41", "max_tokens": 12, "stream": true});
    let chunks = s.stream("/v1/completions", &comp);
    let text: String = chunks
        .iter()
        .map(|c| c["choices"][0]["text"].as_str().unwrap())
        .collect();
    let mut whole_body = comp.clone();
    whole_body["stream"] = json!(false);
    let whole = s.ok("/v1/completions", &whole_body);
    assert_eq!(text, whole["choices"][0]["text"].as_str().unwrap());
    assert_eq!(chunks.last().unwrap()["object"], "text_completion");
}

/// A stop string ends the answer before it, streamed or not; the answer is the stopless one cut there.
#[test]
fn stop_strings_cut_the_answer() {
    let (dir, _) = tiny();
    let s = Server::start(&["--model", dir.path().to_str().unwrap()]);
    let body = json!({"prompt": "w50 w51 w52", "max_tokens": 40, "ignore_eos": true});
    let full = s.ok("/v1/completions", &body);
    let text = full["choices"][0]["text"].as_str().unwrap().to_string();
    let words: Vec<&str> = text.split(' ').collect();
    assert!(words.len() > 6, "{text}");
    let stop = format!("{} {}", words[4], words[5]);
    let cut = &text[..text.find(&stop).unwrap()];
    for stream in [false, true] {
        let mut b = body.clone();
        b["stop"] = json!([stop, "never-there"]);
        b["stream"] = json!(stream);
        let (got, reason) = if stream {
            let chunks = s.stream("/v1/completions", &b);
            let t: String = chunks
                .iter()
                .map(|c| c["choices"][0]["text"].as_str().unwrap())
                .collect();
            (t, chunks.last().unwrap()["choices"][0]["finish_reason"].clone())
        } else {
            let a = s.ok("/v1/completions", &b);
            (
                a["choices"][0]["text"].as_str().unwrap().to_string(),
                a["choices"][0]["finish_reason"].clone(),
            )
        };
        assert_eq!(got, cut, "stream {stream}");
        assert_eq!(reason, "stop");
    }
}

/// The second turn of a conversation (prompt = first prompt + answer + new message) takes the first
/// turn's tokens from the cache and still answers as a fresh generation would.
#[test]
fn a_second_turn_reuses_the_cache() {
    // One request at a time, the server's one cache (the default, auto, batches).
    a_second_turn_reuses_the_cache_with(&["--parallel", "1"]);
}

/// The same, requests decoded together: the second turn takes the first's cache when it ended.
#[test]
fn a_second_turn_reuses_the_cache_beside_others() {
    a_second_turn_reuses_the_cache_with(&["--parallel", "4"]);
}

fn a_second_turn_reuses_the_cache_with(flags: &[&str]) {
    let (dir, l) = tiny();
    let mut args = vec!["--model", dir.path().to_str().unwrap()];
    args.extend(flags);
    let s = Server::start(&args);
    let mut messages = vec![Message::new("system", "w5"), Message::new("user", "w60 w61 w62")];
    let first = s.ok(
        "/v1/chat/completions",
        &chat_body(&messages, json!({"max_tokens": 16})),
    );
    let first_prompt = first["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(first["probespec"]["cached_prompt_tokens"], 0);
    let reply = first["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .trim()
        .to_string();
    messages.push(Message::new("assistant", reply));
    messages.push(Message::new("user", "w70 w71"));
    let second = s.ok(
        "/v1/chat/completions",
        &chat_body(&messages, json!({"max_tokens": 16})),
    );
    let cached = second["probespec"]["cached_prompt_tokens"].as_u64().unwrap();
    // The tiny template's generation prompt (one token) is replaced by the assistant's turn.
    assert!(
        cached >= first_prompt - 1,
        "{cached} cached of a first prompt of {first_prompt}"
    );
    assert_eq!(second["usage"]["prompt_tokens_details"]["cached_tokens"], cached);
    let prompt = second["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        second["probespec"]["prefill_tokens"].as_u64().unwrap(),
        prompt - cached
    );
    let expected = library_answer(&l, &messages, &Method::Ar, 16, SamplingParams::default());
    assert_eq!(token_ids(&second), expected);
}
