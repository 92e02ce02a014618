//! Every top-level field a request may carry, in three lists: read (implemented, as OpenAI's API defines
//! them), ignored (they do not change the answer's tokens), and accepted only at the value that leaves the
//! answer as it is (refused otherwise). Any other field is refused with a 400, as OpenAI's own API refuses
//! an unrecognised argument: nothing that would change the answer is silently dropped.

use super::error::ApiError;
use serde_json::{Map, Value};

/// Read by both endpoints.
pub const READ: &[&str] = &[
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "ignore_eos",
    "probespec",
];
/// Read by `/v1/chat/completions` only.
pub const READ_CHAT: &[&str] = &["messages", "chat_template_kwargs"];
/// Read by `/v1/completions` only.
pub const READ_COMPLETION: &[&str] = &["prompt"];
/// Accepted and ignored: bookkeeping, caching and routing hints that do not change the tokens
/// (`prediction` is a hint for speculation: it may make an answer faster, never different).
pub const IGNORED: &[&str] = &[
    "user",
    "metadata",
    "store",
    "service_tier",
    "prediction",
    "safety_identifier",
    "prompt_cache_key",
    "parallel_tool_calls",
];

/// Whether a field's value leaves the answer as it is.
type Neutral = fn(&Value) -> bool;

/// Fields that change the answer, each with the values that leave it unchanged (accepted) and what it
/// asks for otherwise (refused).
const NEUTRAL_ONLY: &[(&str, Neutral)] = &[
    ("n", |v| v.as_u64() == Some(1)),
    ("best_of", |v| v.as_u64() == Some(1)),
    ("frequency_penalty", is_zero),
    ("presence_penalty", is_zero),
    ("logprobs", |v| v == &Value::Bool(false)),
    ("top_logprobs", is_zero),
    ("logit_bias", |v| v.as_object().is_some_and(Map::is_empty)),
    ("tools", |v| v.as_array().is_some_and(Vec::is_empty)),
    ("functions", |v| v.as_array().is_some_and(Vec::is_empty)),
    ("tool_choice", |v| v == "none" || v == "auto"),
    ("function_call", |v| v == "none" || v == "auto"),
    ("response_format", |v| v.get("type").is_some_and(|t| t == "text")),
    ("echo", |v| v == &Value::Bool(false)),
    ("suffix", |v| v.as_str().is_some_and(str::is_empty)),
];

fn is_zero(v: &Value) -> bool {
    v.as_f64() == Some(0.0)
}

/// Which endpoint a body was sent to (and so which shapes its answer takes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// Refuses a body with a field outside the lists, or one of [`NEUTRAL_ONLY`] at a value that would change
/// the answer. `null` is as the field's absence.
pub fn check(body: &Map<String, Value>, endpoint: Endpoint) -> Result<(), ApiError> {
    let own = match endpoint {
        Endpoint::Chat => READ_CHAT,
        Endpoint::Completion => READ_COMPLETION,
    };
    for (name, value) in body {
        let name = name.as_str();
        if value.is_null() || READ.contains(&name) || own.contains(&name) || IGNORED.contains(&name) {
            continue;
        }
        let endpoint_field =
            matches!(name, "best_of" | "echo" | "suffix") == (endpoint == Endpoint::Completion);
        match NEUTRAL_ONLY.iter().find(|(n, _)| *n == name) {
            Some((_, neutral)) if endpoint_field && neutral(value) => {}
            Some(_) => {
                return Err(ApiError::invalid_param(
                    name,
                    format!(
                        "{name} is not supported by this server (only at the value that changes nothing)"
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid_param(
                    name,
                    format!("{name} is not supported by this server (unrecognised request argument)"),
                ))
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn check_json(v: Value, endpoint: Endpoint) -> Result<(), String> {
        check(v.as_object().unwrap(), endpoint).map_err(|e| e.message)
    }

    #[test]
    fn read_and_ignored_fields_pass() {
        let body = json!({"messages": [], "model": "m", "max_tokens": 3, "user": "u", "store": false,
                          "metadata": {"a": "b"}, "n": 1, "logprobs": false, "tools": [], "tool_choice": "none",
                          "response_format": {"type": "text"}, "presence_penalty": 0, "top_logprobs": null});
        assert_eq!(check_json(body, Endpoint::Chat), Ok(()));
        let body = json!({"prompt": "p", "echo": false, "best_of": 1, "suffix": ""});
        assert_eq!(check_json(body, Endpoint::Completion), Ok(()));
    }

    #[test]
    fn fields_that_change_the_answer_are_refused() {
        for (field, value) in [
            ("functions", json!([{"name": "f"}])),
            ("function_call", json!({"name": "f"})),
            ("tool_choice", json!("required")),
            ("top_logprobs", json!(5)),
            ("logprobs", json!(true)),
            ("n", json!(2)),
            ("frequency_penalty", json!(0.5)),
            ("logit_bias", json!({"42": 10})),
            ("response_format", json!({"type": "json_object"})),
            ("reasoning_effort", json!("high")),
            ("modalities", json!(["text", "audio"])),
            ("min_p", json!(0.1)),
        ] {
            let mut body = json!({"messages": []});
            body[field] = value;
            let e = check_json(body, Endpoint::Chat).expect_err(field);
            assert!(
                e.starts_with(&format!("{field} is not supported")),
                "{field}: {e}"
            );
        }
        // A completion-only field on the chat endpoint, and the reverse.
        assert!(check_json(json!({"messages": [], "echo": false}), Endpoint::Chat).is_err());
        assert!(check_json(json!({"prompt": "p", "messages": []}), Endpoint::Completion).is_err());
    }
}
