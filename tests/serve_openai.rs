//! The official `openai` Python client (tests/openai_client.py) against `probespec serve` on the default
//! SmolLM2 model: models, chat, streaming, another method per request, a two-turn conversation, a
//! completion, an error; its answers are the one-shot CLI's for the same messages. `make test` installs
//! the package; without python3 or the package the test fails and says how to install it.

mod common;

use common::server::Server;
use probespec::session::{ModelOptions, Session};
use probespec::tokenizer::Message;
use serde_json::Value;
use std::process::Command;

/// The CLI's text for `messages`: rendered through the model's template here, fed verbatim there.
fn cli_answer(session: &Session, model: &str, messages: &[Message], max_tokens: usize) -> String {
    let prompt = session.tokenizer.apply_chat_template(messages, true).unwrap();
    let run = common::binary::probespec(&[
        "--model",
        model,
        "--json",
        "--no-chat-template",
        "--max-new-tokens",
        &max_tokens.to_string(),
        &prompt,
    ])
    .ok();
    let v: Value = serde_json::from_str(run.stdout.trim()).unwrap();
    v["text"].as_str().unwrap().to_string()
}

fn messages(v: &Value) -> Vec<Message> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

#[test]
fn the_openai_python_client_gets_the_clis_answers() {
    let check = Command::new("python3").args(["-c", "import openai"]).output();
    match check {
        Err(e) => panic!("python3 not found ({e}): install Python 3 and `python3 -m pip install openai`"),
        Ok(o) if !o.status.success() => panic!(
            "the `openai` Python package is missing: run `python3 -m pip install openai` (`make test` does): {}",
            String::from_utf8_lossy(&o.stderr)
        ),
        Ok(_) => {}
    }
    let path = common::smollm2_path();
    let model = path.to_str().unwrap();
    let s = Server::start(&["--model", model, "--api-key", "sk-probespec-test"]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_client.py");
    let out = Command::new("python3")
        .args([script, &s.base, "sk-probespec-test"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "openai_client.py failed:\n{}\nserver log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        s.log.lock().unwrap()
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let session = Session::load(&ModelOptions {
        model: Some(model.to_string()),
        ..Default::default()
    })
    .unwrap();
    for (turn, msgs) in [("first", "first_messages"), ("second", "second_messages")] {
        let expected = cli_answer(&session, model, &messages(&v[msgs]), 24);
        assert_eq!(v[turn].as_str().unwrap(), expected, "{turn} turn");
    }
}
