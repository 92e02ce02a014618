//! Answers in OpenAI's shapes: `chat.completion` and `text_completion` objects, their streamed chunks
//! (server-sent events ending in `data: [DONE]`), `usage`, and probespec's statistics in an extra
//! `probespec` field that clients ignore.

use super::error::ApiError;
use super::queue::{Event, Outcome};
use super::reasoning::{Piece, ThinkSplitter};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use serde_json::{json, Value};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;

pub use super::fields::Endpoint;

/// The fields every object of one answer shares.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
    /// A chat answer's thinking goes to `reasoning_content` (`--reasoning-format deepseek`): `Some(open)`,
    /// `open` when the prompt already opened the thinking block.
    pub thinking: Option<bool>,
}

/// Seconds since the Unix epoch.
pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl Envelope {
    pub fn new(endpoint: Endpoint, model: &str) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        let prefix = match endpoint {
            Endpoint::Chat => "chatcmpl",
            Endpoint::Completion => "cmpl",
        };
        let created = unix_now();
        Envelope {
            endpoint,
            id: format!("{prefix}-{created:x}{:06}", NEXT.fetch_add(1, Ordering::Relaxed)),
            created,
            model: model.to_string(),
            thinking: None,
        }
    }

    fn object(&self, streamed: bool) -> &'static str {
        match (self.endpoint, streamed) {
            (Endpoint::Chat, false) => "chat.completion",
            (Endpoint::Chat, true) => "chat.completion.chunk",
            (Endpoint::Completion, _) => "text_completion",
        }
    }

    fn wrap(&self, streamed: bool, choice: Value) -> Value {
        json!({
            "id": self.id,
            "object": self.object(streamed),
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": [choice],
        })
    }

    /// The whole answer as one object.
    pub fn complete(&self, o: &Outcome) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let message = match self.thinking {
                    None => json!({"role": "assistant", "content": o.text}),
                    Some(open) => {
                        let (reasoning, content) = ThinkSplitter::split(&o.text, open);
                        let reasoning = (!reasoning.is_empty()).then_some(reasoning);
                        json!({"role": "assistant", "content": content, "reasoning_content": reasoning})
                    }
                };
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": null,
                    "finish_reason": o.finish_reason,
                })
            }
            Endpoint::Completion => json!({
                "index": 0,
                "text": o.text,
                "logprobs": null,
                "finish_reason": o.finish_reason,
            }),
        };
        let mut v = self.wrap(false, choice);
        v["usage"] = usage(o);
        v["probespec"] = stats(o);
        v
    }

    /// A chunk of streamed text (`None`: the chat stream's first chunk, which names the role).
    fn chunk(&self, text: Option<&str>) -> Value {
        self.chunk_of(text.map(|t| Piece::Content(t.to_string())))
    }

    /// A chunk of a streamed answer's reply or thinking (`None`: the chat stream's first chunk).
    fn chunk_of(&self, piece: Option<Piece>) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let delta = match piece {
                    None => json!({"role": "assistant", "content": ""}),
                    Some(Piece::Content(t)) => json!({"content": t}),
                    Some(Piece::Reasoning(t)) => json!({"reasoning_content": t}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null})
            }
            Endpoint::Completion => {
                let text = match piece {
                    Some(Piece::Content(t) | Piece::Reasoning(t)) => t,
                    None => String::new(),
                };
                json!({"index": 0, "text": text, "logprobs": null, "finish_reason": null})
            }
        };
        self.wrap(true, choice)
    }

    /// The chunks of one streamed event: its text as one chunk, or, splitting thinking from reply, the
    /// pieces it completes (none while a tag may be under way; the held-back rest with the last event).
    fn event_chunks(&self, splitter: &mut Option<ThinkSplitter>, event: &Event) -> Vec<Value> {
        let pieces = match (event, splitter.as_mut()) {
            (Event::Text(t), None) => return vec![self.chunk(Some(t))],
            (Event::Text(t), Some(s)) => s.push(t),
            (Event::Done(_), Some(_)) => splitter.take().map(ThinkSplitter::finish).unwrap_or_default(),
            _ => Vec::new(),
        };
        pieces.into_iter().map(|p| self.chunk_of(Some(p))).collect()
    }

    /// The last chunk: the finish reason, usage and statistics.
    fn last_chunk(&self, o: &Outcome) -> Value {
        let choice = match self.endpoint {
            Endpoint::Chat => {
                json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": o.finish_reason})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": "", "logprobs": null, "finish_reason": o.finish_reason})
            }
        };
        let mut v = self.wrap(true, choice);
        v["usage"] = usage(o);
        v["probespec"] = stats(o);
        v
    }
}

fn usage(o: &Outcome) -> Value {
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": o.tokens.len(),
        "total_tokens": o.prompt_tokens + o.tokens.len(),
        "prompt_tokens_details": {"cached_tokens": o.cached_tokens},
    })
}

/// probespec's own account of the answer.
fn stats(o: &Outcome) -> Value {
    let s = &o.stats;
    json!({
        "method": s.method,
        "tau": s.tau,
        "model_calls": s.model_calls,
        "block_histogram": s.block_histogram,
        "committed_histogram": s.committed_histogram,
        "plain_share": s.plain_share,
        "tokens_per_second": s.tokens_per_second,
        "prefill_tokens": s.prefill_tokens,
        "cached_prompt_tokens": o.cached_tokens,
        "prefill_seconds": s.prefill_seconds,
        "decode_seconds": s.decode_seconds,
        "queue_seconds": o.queue_seconds,
        "completion_token_ids": o.tokens,
    })
}

/// Waits for the whole answer.
pub async fn collect(envelope: &Envelope, mut events: UnboundedReceiver<Event>) -> Response {
    while let Some(e) = events.recv().await {
        match e {
            Event::Text(_) => {}
            Event::Done(o) => return Json(envelope.complete(&o)).into_response(),
            Event::Failed(m) => return ApiError::internal(m).into_response(),
        }
    }
    ApiError::internal("the decoding thread dropped the request").into_response()
}

/// Where a streamed answer is.
enum Phase {
    Start,
    Body,
    Finished,
    Over,
}

fn data(v: &Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

/// The answer as server-sent events: a chunk per piece of committed text, as it comes.
pub fn stream(envelope: Envelope, events: UnboundedReceiver<Event>) -> Response {
    let splitter = envelope.thinking.map(ThinkSplitter::new);
    let start = Streamed {
        phase: Phase::Start,
        events,
        splitter,
        ready: VecDeque::new(),
    };
    let body = stream::unfold(start, move |mut st| {
        let envelope = envelope.clone();
        async move {
            if let Some(v) = st.ready.pop_front() {
                return Some((data(&v), st));
            }
            match st.phase {
                Phase::Start if envelope.endpoint == Endpoint::Chat => {
                    st.phase = Phase::Body;
                    Some((data(&envelope.chunk(None)), st))
                }
                Phase::Start | Phase::Body => {
                    st.phase = Phase::Body;
                    // Until a chunk is ready: an event may complete none (a tag under way).
                    while st.ready.is_empty() {
                        let event = st.events.recv().await;
                        if let Some(e) = &event {
                            st.ready.extend(envelope.event_chunks(&mut st.splitter, e));
                        }
                        let last = match event {
                            Some(Event::Text(_)) => continue,
                            Some(Event::Done(o)) => envelope.last_chunk(&o),
                            Some(Event::Failed(m)) => ApiError::internal(m).body(),
                            None => ApiError::internal("the decoding thread dropped the request").body(),
                        };
                        st.ready.push_back(last);
                        st.phase = Phase::Finished;
                    }
                    let v = st.ready.pop_front()?;
                    Some((data(&v), st))
                }
                Phase::Finished => {
                    st.phase = Phase::Over;
                    Some((Ok(SseEvent::default().data("[DONE]")), st))
                }
                Phase::Over => None,
            }
        }
    });
    sse(body)
}

/// A streamed answer's state between events.
struct Streamed {
    phase: Phase,
    events: UnboundedReceiver<Event>,
    /// Splits thinking from reply (`--reasoning-format deepseek`).
    splitter: Option<ThinkSplitter>,
    /// Chunks made and not yet sent.
    ready: VecDeque<Value>,
}

fn sse(body: impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static) -> Response {
    Sse::new(body).keep_alive(KeepAlive::default()).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::method::MethodKind;
    use crate::decode::stats::DecodeStats;

    fn outcome(text: &str) -> Outcome {
        Outcome {
            text: text.to_string(),
            tokens: vec![1, 2, 3],
            finish_reason: "stop",
            stats: DecodeStats::new(MethodKind::Ar),
            prompt_tokens: 5,
            cached_tokens: 0,
            queue_seconds: 0.0,
        }
    }

    fn chat(thinking: Option<bool>) -> Envelope {
        Envelope {
            thinking,
            ..Envelope::new(Endpoint::Chat, "m")
        }
    }

    /// The streamed chunks' deltas of `parts` (the last event `Done` with their whole text).
    fn deltas(e: &Envelope, parts: &[&str]) -> Vec<Value> {
        let mut splitter = e.thinking.map(ThinkSplitter::new);
        let mut events: Vec<Event> = parts.iter().map(|p| Event::Text(p.to_string())).collect();
        events.push(Event::Done(Box::new(outcome(&parts.concat()))));
        events
            .iter()
            .flat_map(|ev| e.event_chunks(&mut splitter, ev))
            .map(|v| v["choices"][0]["delta"].clone())
            .collect()
    }

    #[test]
    fn thinking_goes_to_reasoning_content_only_when_asked() {
        let text = "<think>\nhm\n</think>\n\nParis.";
        let plain = chat(None).complete(&outcome(text));
        assert_eq!(
            plain["choices"][0]["message"],
            json!({"role": "assistant", "content": text})
        );
        let apart = chat(Some(false)).complete(&outcome(text));
        assert_eq!(
            apart["choices"][0]["message"],
            json!({"role": "assistant", "content": "Paris.", "reasoning_content": "\nhm\n"})
        );
        let no_thinking = chat(Some(false)).complete(&outcome("Paris."));
        assert_eq!(
            no_thinking["choices"][0]["message"]["reasoning_content"],
            Value::Null
        );
        let opened_by_the_prompt = chat(Some(true)).complete(&outcome("hm</think>Paris."));
        assert_eq!(
            opened_by_the_prompt["choices"][0]["message"]["reasoning_content"],
            "hm"
        );
        assert_eq!(opened_by_the_prompt["choices"][0]["message"]["content"], "Paris.");
    }

    #[test]
    fn streamed_thinking_arrives_in_reasoning_deltas_and_adds_up_to_the_whole() {
        let parts = ["<thi", "nk>\nh", "m\n</th", "ink>", "\n\n", "Par", "is."];
        let e = chat(Some(false));
        let got = deltas(&e, &parts);
        let field = |name: &str| -> String {
            got.iter()
                .filter_map(|d| d.get(name).and_then(Value::as_str))
                .collect()
        };
        let whole = e.complete(&outcome(&parts.concat()));
        assert_eq!(
            field("reasoning_content"),
            whole["choices"][0]["message"]["reasoning_content"]
        );
        assert_eq!(field("content"), whole["choices"][0]["message"]["content"]);
        // No chunk is empty, none carries both fields, none is sent while a tag may be under way.
        for d in &got {
            let fields: Vec<&String> = d.as_object().unwrap().keys().collect();
            assert_eq!(fields.len(), 1, "{d}");
            assert_ne!(d[fields[0]], "", "{d}");
        }
        assert_eq!(got[0], json!({"reasoning_content": "\nh"}));
        // Without the flag every event is one content chunk, tags included.
        let plain: Vec<Value> = deltas(&chat(None), &parts);
        assert_eq!(plain.len(), parts.len());
        assert_eq!(plain[0], json!({"content": "<thi"}));
    }
}
