//! `probespec serve` with many clients: a full queue answers 503 with Retry-After, a client that leaves
//! mid-stream stops its generation, and a reader that does not read does not hold up the requests queued
//! behind it. A tiny model with a long context window and `ignore_eos` gives generations long enough
//! (up to tens of thousands of tokens) to act on while they decode.

mod common;

use common::server::{agent, sse_events, Server};
use common::TinySpec;
use serde_json::{json, Value};
use std::io::{BufRead, BufReader};

/// Tokens of the long generations: the tiny model's context window minus room for the prompt.
const LONG: usize = 32_000;

fn long_context_dir() -> tempfile::TempDir {
    let d = common::tempdir();
    TinySpec {
        max_pos: 32_768,
        ..TinySpec::llama()
    }
    .write_hf(d.path());
    d
}

fn long_request(tokens: usize) -> Value {
    json!({"prompt": "w10 w11 w12", "max_tokens": tokens, "ignore_eos": true, "stream": true,
           "probespec": {"method": "ar"}})
}

#[test]
fn a_full_queue_answers_503_and_a_client_that_leaves_stops_its_generation() {
    let dir = long_context_dir();
    // One request decoding at a time (`--parallel 1`): the others wait in the queue.
    let s = Server::start(&[
        "--model",
        dir.path().to_str().unwrap(),
        "--queue",
        "1",
        "--parallel",
        "1",
    ]);
    let url = s.url("/v1/completions");
    // A: a long streamed answer; read two chunks, so that it is decoding.
    let a = agent()
        .post(&url)
        .set("Content-Type", "application/json")
        .send_string(&long_request(LONG).to_string())
        .unwrap();
    let mut a_lines = BufReader::new(a.into_reader()).lines();
    let mut seen = 0;
    while seen < 2 {
        if a_lines.next().unwrap().unwrap().starts_with("data: ") {
            seen += 1;
        }
    }
    assert_eq!(s.health()["decoding"], true);
    // B waits in the queue's one slot.
    let b_url = url.clone();
    let b = std::thread::spawn(move || {
        common::server::post_raw(
            &b_url,
            &json!({"prompt": "w20", "max_tokens": 5}).to_string(),
            None,
        )
    });
    s.wait_health("B in the queue", |h| h["waiting"] == 1);
    // C finds the queue full.
    let c = agent()
        .post(&url)
        .set("Content-Type", "application/json")
        .send_string(&json!({"prompt": "w30", "max_tokens": 5}).to_string());
    let Err(ureq::Error::Status(503, c)) = c else {
        panic!("C was not refused: {c:?}")
    };
    assert!(c.header("Retry-After").is_some_and(|r| r.parse::<u64>().is_ok()));
    let c: Value = serde_json::from_str(&c.into_string().unwrap()).unwrap();
    assert!(
        c["error"]["message"].as_str().unwrap().contains("queue is full"),
        "{c}"
    );
    assert_eq!(s.health()["rejected"], 1);
    // A leaves: its generation stops, B runs.
    drop(a_lines);
    let h = s.wait_health("A cancelled and B done", |h| {
        h["cancelled"] == 1 && h["completed"] == 1
    });
    assert_eq!(h["waiting"], 0, "{h}");
    let (status, b) = b.join().unwrap();
    assert_eq!(status, 200, "{b}");
    assert_eq!(b["usage"]["completion_tokens"], 5);
    let log = s.log.lock().unwrap().clone();
    let stopped_after: usize = log
        .lines()
        .find_map(|l| l.split("the client left after ").nth(1))
        .and_then(|rest| rest.split(' ').next())
        .unwrap_or_else(|| panic!("no cancellation in the log: {log}"))
        .parse()
        .unwrap();
    assert!(
        stopped_after < LONG,
        "A ran to its end ({stopped_after} tokens) although its client left"
    );
}

/// The decoding thread hands a streamed answer to an unbounded channel and moves on, so the request
/// queued behind an unread stream is answered. (Loopback's socket buffers may hold much of A's answer
/// too; what fails here is a queue that waits for a stream to be delivered before taking the next job.)
#[test]
fn a_reader_that_does_not_read_does_not_hold_up_the_queue() {
    const TOKENS: usize = 2_000;
    let dir = long_context_dir();
    // One request decoding at a time: B waits for A's generation, not for A's reader.
    let s = Server::start(&["--model", dir.path().to_str().unwrap(), "--parallel", "1"]);
    let url = s.url("/v1/completions");
    // A: a long streamed answer nobody reads yet.
    let a = agent()
        .post(&url)
        .set("Content-Type", "application/json")
        .send_string(&long_request(TOKENS).to_string())
        .unwrap();
    // B, queued behind A, is answered while A's reader still has not read anything.
    let (status, b) =
        common::server::post_raw(&url, &json!({"prompt": "w20", "max_tokens": 5}).to_string(), None);
    assert_eq!(status, 200, "{b}");
    let h = s.health();
    assert_eq!(h["completed"], 2, "A was decoded to its end before B: {h}");
    // A's answer is all there when its reader comes back.
    let events = sse_events(a.into_reader());
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["usage"]["completion_tokens"], TOKENS);
    assert_eq!(last["choices"][0]["finish_reason"], "length");
}
