//! `probespec serve --parallel N` on the real SmolLM2 GGUF: requests decoded together, each answer token
//! for token the library's `generate` alone (every method, greedy and seeded sampling, streamed and
//! whole), with clients that leave mid-answer beside them; the server keeps serving after.

mod common;

use common::server::{token_ids, Server};
use probespec::decode::method::Method;
use probespec::decode::sampling::SamplingParams;
use probespec::model::load::{load_model, LoadOptions, LoadedModel, ModelSource};
use serde_json::{json, Value};
use std::io::Read;

/// The real SmolLM2 GGUF (packed weights: the flat layers, which batch the sequences' rows), loaded
/// in-process as the server loads it.
fn smollm2() -> (std::path::PathBuf, LoadedModel) {
    let path = common::smollm2_path();
    let opts = LoadOptions {
        device: candle_core::Device::Cpu,
        dtype: candle_core::DType::F32,
        dequantize: false,
        activations: Default::default(),
    };
    let loaded = load_model(&ModelSource::Gguf(path.clone()), &opts).unwrap();
    (path, loaded)
}

/// What the library generates for `prompt` as `/v1/completions` reads it (no chat template).
fn library_answer(
    l: &LoadedModel,
    prompt: &str,
    method: &Method,
    max_new: usize,
    sampling: SamplingParams,
) -> Vec<u32> {
    let prompt = l.tokenizer.encode(prompt).unwrap();
    common::decoding::library_tokens(l, &prompt, method, max_new, sampling)
}

/// Prompts with text to copy, and without.
const PROMPTS: [&str; 5] = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog.",
    "What is the capital of France?",
    "Copy this list in reverse order: apple, banana, cherry, date.",
    "Write one sentence about autumn.",
    "Rewrite in the past tense: I walk to the store and buy some bread.",
];

/// One request of the mix: its body and the tokens the library gives it alone.
struct Request {
    body: Value,
    stream: bool,
    expected: Vec<u32>,
}

fn requests(l: &LoadedModel) -> Vec<Request> {
    let methods = [
        (json!({"method": "ar"}), Method::Ar),
        (
            json!({"method": "pld", "draft_len": 4}),
            common::decoding::pld(3, 4),
        ),
        (
            json!({"method": "esp", "bc": 10}),
            common::decoding::esp(10, 1, probespec::decode::method::EspTree::Dynamic),
        ),
        (
            json!({"method": "hybrid", "bc": "10"}),
            common::decoding::hybrid(10, 1),
        ),
        (
            json!({"method": "lookahead", "lookahead_window": 4}),
            common::decoding::lookahead(4, 5, 7),
        ),
    ];
    (0..10)
        .map(|i| {
            let (extra, method) = &methods[i % methods.len()];
            let (temperature, seed) = if i % 3 == 2 {
                (0.9f32, 7 + i as u64)
            } else {
                (0.0, 1)
            };
            let prompt = PROMPTS[i % PROMPTS.len()].to_string();
            let max_tokens = 16 + 3 * i;
            let sampling = SamplingParams {
                temperature,
                seed,
                ..Default::default()
            };
            Request {
                body: json!({
                    "model": "default",
                    "prompt": prompt,
                    "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
                    "probespec": extra,
                    "stream": i % 2 == 1,
                }),
                stream: i % 2 == 1,
                expected: library_answer(l, &prompt, method, max_tokens, sampling),
            }
        })
        .collect()
}

/// The token ids of an answer, whole or streamed (the last chunk reports them).
fn answer_tokens(s: &Server, r: &Request) -> Vec<u32> {
    if r.stream {
        let chunks = s.stream("/v1/completions", &r.body);
        token_ids(chunks.last().expect("a last chunk"))
    } else {
        token_ids(&s.ok("/v1/completions", &r.body))
    }
}

/// Ten requests from ten clients at once, into a server decoding four together and prefilling a joining
/// prompt five rows a step beside them: every answer is the one the library gives alone; then the same
/// one by one.
#[test]
fn answers_decoded_together_are_the_answers_alone() {
    let (path, l) = smollm2();
    let model = path.to_str().unwrap();
    let s = Server::start(&["--model", model, "--parallel", "4", "--prefill-chunk", "5"]);
    let requests = requests(&l);
    std::thread::scope(|scope| {
        let handles: Vec<_> = requests
            .iter()
            .map(|r| scope.spawn(|| answer_tokens(&s, r)))
            .collect();
        for (i, (h, r)) in handles.into_iter().zip(&requests).enumerate() {
            assert_eq!(h.join().unwrap(), r.expected, "request {i}: {}", r.body);
        }
    });
    for (i, r) in requests.iter().enumerate().take(3) {
        assert_eq!(answer_tokens(&s, r), r.expected, "request {i} alone");
    }
    let h = s.health();
    assert_eq!(h["completed"], 13, "{h}");
    assert_eq!(h["failed"], 0, "{h}");
}

/// Clients that leave mid-answer leave the others' answers unchanged, and are counted as cancelled.
#[test]
fn clients_that_leave_do_not_change_the_others() {
    let (path, l) = smollm2();
    let s = Server::start(&["--model", path.to_str().unwrap(), "--parallel", "3"]);
    let requests = requests(&l);
    std::thread::scope(|scope| {
        let stayers: Vec<_> = requests[..4]
            .iter()
            .map(|r| scope.spawn(|| answer_tokens(&s, r)))
            .collect();
        // Two streamed requests of 8,000 tokens whose clients read one chunk and hang up.
        for seed in [3, 4] {
            let body = json!({"prompt": "Once upon a time", "max_tokens": 8_000, "ignore_eos": true,
                              "stream": true, "temperature": 0.9, "seed": seed});
            let s = &s;
            scope.spawn(move || {
                let response = common::server::agent()
                    .post(&s.url("/v1/completions"))
                    .set("Content-Type", "application/json")
                    .send_string(&body.to_string())
                    .unwrap();
                let mut first = [0u8; 64];
                let _ = response.into_reader().read(&mut first);
            });
        }
        for (i, (h, r)) in stayers.into_iter().zip(&requests).enumerate() {
            assert_eq!(h.join().unwrap(), r.expected, "request {i}");
        }
    });
    let h = s.wait_health("the cancelled requests", |h| h["cancelled"].as_u64() == Some(2));
    assert_eq!(h["completed"], 4, "{h}");
    assert_eq!(h["failed"], 0, "{h}");
    // Still serving.
    assert_eq!(answer_tokens(&s, &requests[5]), requests[5].expected);
}

/// With a KV budget that holds two of the requests' caches (16 MiB: 728 rows of SmolLM2's bf16 cache,
/// 30 layers of 3 heads of 64; each request reserves its prompt, answer and a block's 256 rows), four
/// clients at once still get their answers alone, the others waiting their turn; a request that could
/// never fit gets a 400 naming `max_tokens`, one without `max_tokens` (the server's default 600) is cut
/// to fit, and the server keeps serving.
#[test]
fn a_kv_budget_holds_requests_back_and_refuses_one_that_cannot_fit() {
    let (path, l) = smollm2();
    let model = path.to_str().unwrap();
    let s = Server::start(&[
        "--model",
        model,
        "--parallel",
        "4",
        "--kv-budget",
        "16",
        "--max-new-tokens",
        "600",
    ]);
    let requests = &requests(&l)[..4];
    std::thread::scope(|scope| {
        let handles: Vec<_> = requests
            .iter()
            .map(|r| scope.spawn(|| answer_tokens(&s, r)))
            .collect();
        for (i, (h, r)) in handles.into_iter().zip(requests).enumerate() {
            assert_eq!(h.join().unwrap(), r.expected, "request {i}: {}", r.body);
        }
    });
    let (status, body) = s.post("/v1/completions", &json!({"prompt": "Hello", "max_tokens": 1000}));
    assert_eq!(status, 400, "{body}");
    assert_eq!(body["error"]["param"], "max_tokens", "{body}");
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("--kv-budget holds (728)"), "{message}");
    // 728 rows less the block's 256 and the prompt's.
    let cut = s.ok("/v1/completions", &json!({"prompt": "Hello", "ignore_eos": true}));
    let prompt_tokens = cut["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(
        cut["usage"]["completion_tokens"],
        728 - 256 - prompt_tokens,
        "{cut}"
    );
    let h = s.health();
    assert_eq!(h["completed"], 5, "{h}");
    assert_eq!(h["failed"], 0, "{h}");
}

#[test]
fn parallel_zero_is_refused() {
    let path = common::smollm2_path();
    let model = path.to_str().unwrap();
    common::binary::probespec(&["serve", "--model", model, "--port", "0", "--parallel", "0"])
        .errors_with("--parallel");
}
