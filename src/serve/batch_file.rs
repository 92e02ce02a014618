//! The files of `probespec run-batch`, as plain data: the requests of an input file (OpenAI's batch input,
//! one JSON object a line, or one prompt a line), the answer and error lines of OpenAI's batch output
//! shape, and the answers an earlier run left in the output that a new run keeps.

use super::fields::Endpoint;
use anyhow::{bail, Result};
use clap::ValueEnum;
use serde_json::{json, Value};
use std::collections::{HashMap, HashSet};

/// How the input file is read (`--format`).
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputFormat {
    /// OpenAI's batch input when the first line that is not blank starts with `{`, else prompts.
    Auto,
    /// OpenAI's batch input: `{"custom_id", "method": "POST", "url", "body"}` a line.
    Openai,
    /// One prompt a line (blank lines skipped); line N's custom_id is `line-N`.
    Prompts,
}

/// One request of the input.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    pub custom_id: String,
    pub endpoint: Endpoint,
    pub body: Value,
}

/// An input line that is not a request, and why (the message names the line).
#[derive(Debug, Clone, PartialEq)]
pub struct LineError {
    /// The request's custom_id, when the line gave one.
    pub custom_id: Option<String>,
    pub message: String,
}

/// One request of the input, or why its line is not one.
pub type Entry = Result<Request, LineError>;

/// The input's requests in order, one entry a line that is not blank. `prompt` makes a prompt line's
/// request (its endpoint and body).
pub fn read_requests(
    text: &str,
    format: InputFormat,
    prompt: impl Fn(&str) -> (Endpoint, Value),
) -> Vec<Entry> {
    let lines = text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty());
    let openai = match format {
        InputFormat::Openai => true,
        InputFormat::Prompts => false,
        InputFormat::Auto => text
            .lines()
            .find(|l| !l.trim().is_empty())
            .is_some_and(|l| l.trim_start().starts_with('{')),
    };
    if !openai {
        return lines
            .map(|(i, line)| {
                let (endpoint, body) = prompt(line);
                Ok(Request {
                    custom_id: format!("line-{}", i + 1),
                    endpoint,
                    body,
                })
            })
            .collect();
    }
    let mut seen: HashMap<String, usize> = HashMap::new();
    lines
        .map(|(i, line)| {
            let request = openai_request(line).map_err(|e| LineError {
                message: format!("line {}: {}", i + 1, e.message),
                ..e
            })?;
            if let Some(first) = seen.insert(request.custom_id.clone(), i + 1) {
                seen.insert(request.custom_id.clone(), first);
                return Err(LineError {
                    message: format!(
                        "line {}: custom_id '{}' is also line {first}'s: each request needs its own",
                        i + 1,
                        request.custom_id
                    ),
                    custom_id: Some(request.custom_id),
                });
            }
            Ok(request)
        })
        .collect()
}

/// One line of OpenAI's batch input (the error's message without the line's number).
fn openai_request(line: &str) -> Result<Request, LineError> {
    let unnamed = |message: String| LineError {
        custom_id: None,
        message,
    };
    let v: Value = serde_json::from_str(line).map_err(|e| unnamed(format!("not JSON: {e}")))?;
    let Value::Object(fields) = v else {
        return Err(unnamed(
            "a request is a JSON object with custom_id, method, url and body".into(),
        ));
    };
    if let Some(k) = fields
        .keys()
        .find(|k| !["custom_id", "method", "url", "body"].contains(&k.as_str()))
    {
        return Err(unnamed(format!(
            "unknown field '{k}' (custom_id, method, url, body)"
        )));
    }
    let custom_id = match fields.get("custom_id") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        _ => {
            return Err(unnamed(
                "custom_id is missing: give each request a string that names it".into(),
            ))
        }
    };
    let named = |message: String| LineError {
        custom_id: Some(custom_id.clone()),
        message,
    };
    match fields.get("method") {
        None => {}
        Some(Value::String(m)) if m.eq_ignore_ascii_case("POST") => {}
        Some(m) => return Err(named(format!("method {m} is not POST"))),
    }
    let endpoint = match fields.get("url").and_then(Value::as_str) {
        Some("/v1/chat/completions") => Endpoint::Chat,
        Some("/v1/completions") => Endpoint::Completion,
        Some(url) => {
            return Err(named(format!(
                "url '{url}' is not answered here (/v1/chat/completions, /v1/completions)"
            )))
        }
        None => return Err(named("url is missing".into())),
    };
    let body = match fields.get("body") {
        Some(b @ Value::Object(_)) => b.clone(),
        _ => return Err(named("body is missing: the request body, a JSON object".into())),
    };
    Ok(Request {
        custom_id,
        endpoint,
        body,
    })
}

/// The batch output line of an answer: `body` is the endpoint's answer object.
pub fn answer_line(custom_id: &str, line_id: &str, body: Value) -> Value {
    json!({
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": body["id"], "body": body},
        "error": null,
    })
}

/// The batch output line of a request that failed with HTTP `status` (None: the line is not a request)
/// and OpenAI's error object `error` (`{"message", "type", "param", "code"}`).
pub fn error_line(custom_id: Option<&str>, line_id: &str, status: Option<u16>, error: Value) -> Value {
    json!({
        "id": line_id,
        "custom_id": custom_id,
        "response": status.map(|s| json!({"status_code": s, "request_id": null, "body": null})),
        "error": error,
    })
}

/// The answers an earlier run wrote to the output (its text), by custom_id, that a new run keeps: the
/// lines that answered (status 200, no error). A line that is not JSON, or that answers a custom_id the
/// input (`ids`) does not have, is an error: that output belongs to another input.
pub fn kept_answers(output: &str, ids: &HashSet<&str>) -> Result<HashMap<String, String>> {
    let mut kept = HashMap::new();
    for (i, line) in output.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => bail!("line {} of the output is not JSON ({e})", i + 1),
        };
        let answered = v["error"].is_null() && v["response"]["status_code"] == 200;
        let Some(id) = v["custom_id"].as_str() else {
            continue;
        };
        if !ids.contains(id) {
            bail!(
                "the output answers custom_id '{id}' (its line {}), which the input does not have",
                i + 1
            );
        }
        if answered {
            kept.insert(id.to_string(), line.to_string());
        }
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn as_completion(p: &str) -> (Endpoint, Value) {
        (Endpoint::Completion, json!({"prompt": p}))
    }

    fn errors(entries: &[Entry]) -> Vec<String> {
        entries
            .iter()
            .filter_map(|e| e.as_ref().err())
            .map(|e| e.message.clone())
            .collect()
    }

    #[test]
    fn prompt_lines_are_requests_named_by_their_line() {
        let entries = read_requests("Hi there\n\n  \nWhat is 2+2?\n", InputFormat::Auto, as_completion);
        assert_eq!(
            entries,
            vec![
                Ok(Request {
                    custom_id: "line-1".into(),
                    endpoint: Endpoint::Completion,
                    body: json!({"prompt": "Hi there"})
                }),
                Ok(Request {
                    custom_id: "line-4".into(),
                    endpoint: Endpoint::Completion,
                    body: json!({"prompt": "What is 2+2?"})
                }),
            ]
        );
        // A prompt that starts with a brace is a prompt when asked.
        let forced = read_requests("{not json}", InputFormat::Prompts, as_completion);
        assert_eq!(forced[0].as_ref().unwrap().body, json!({"prompt": "{not json}"}));
    }

    #[test]
    fn openai_lines_are_read_and_bad_ones_named() {
        let text = [
            r#"{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": []}}"#,
            r#"{"custom_id": "b", "url": "/v1/completions", "body": {"prompt": "x"}}"#,
            "not json",
            r#"{"custom_id": "a", "url": "/v1/completions", "body": {}}"#,
            r#"{"custom_id": "c", "url": "/v1/embeddings", "body": {}}"#,
            r#"{"url": "/v1/completions", "body": {}}"#,
            r#"{"custom_id": "d", "url": "/v1/completions", "body": "x"}"#,
            r#"{"custom_id": "e", "method": "GET", "url": "/v1/completions", "body": {}}"#,
            r#"{"custom_id": "f", "url": "/v1/completions", "body": {}, "extra": 1}"#,
            "[1]",
        ]
        .join("\n");
        let entries = read_requests(&text, InputFormat::Auto, as_completion);
        assert_eq!(entries.len(), 10);
        assert_eq!(entries[0].as_ref().unwrap().endpoint, Endpoint::Chat);
        assert_eq!(entries[1].as_ref().unwrap().body, json!({"prompt": "x"}));
        let errs = errors(&entries);
        let expected = [
            "line 3: not JSON",
            "line 4: custom_id 'a' is also line 1's",
            "line 5: url '/v1/embeddings' is not answered here",
            "line 6: custom_id is missing",
            "line 7: body is missing",
            "line 8: method \"GET\" is not POST",
            "line 9: unknown field 'extra'",
            "line 10: a request is a JSON object",
        ];
        assert_eq!(errs.len(), expected.len(), "{errs:?}");
        for (got, want) in errs.iter().zip(expected) {
            assert!(got.starts_with(want), "{got:?} does not start with {want:?}");
        }
        let named: Vec<Option<&str>> = entries
            .iter()
            .filter_map(|e| e.as_ref().err())
            .map(|e| e.custom_id.as_deref())
            .collect();
        assert_eq!(
            named,
            [None, Some("a"), Some("c"), None, Some("d"), Some("e"), None, None]
        );
    }

    #[test]
    fn only_answers_of_this_input_are_kept() {
        let ok = answer_line("a", "batch_req_1", json!({"id": "cmpl-1", "choices": []}));
        let failed = error_line(Some("b"), "batch_req_2", Some(400), json!({"message": "bad"}));
        let not_a_request = error_line(None, "batch_req_3", None, json!({"message": "line 3: not JSON"}));
        let output = format!("{ok}\n{failed}\n{not_a_request}\n");
        let ids: HashSet<&str> = ["a", "b"].into();
        let kept = kept_answers(&output, &ids).unwrap();
        assert_eq!(kept.len(), 1);
        assert_eq!(kept["a"], ok.to_string());
        assert_eq!(ok["response"]["request_id"], "cmpl-1");
        let other: HashSet<&str> = ["b"].into();
        let e = kept_answers(&output, &other).unwrap_err().to_string();
        assert!(e.contains("custom_id 'a'"), "{e}");
        assert!(kept_answers("{\"id\": 1\n", &ids).is_err());
    }
}
