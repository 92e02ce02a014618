//! Answers in OpenAI's shapes: `chat.completion` and `text_completion` objects, their streamed chunks
//! (server-sent events ending in `data: [DONE]`), `usage`, and probespec's statistics in an extra
//! `probespec` field that clients ignore.

use super::error::ApiError;
use super::queue::{Event, Outcome};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream};
use serde_json::{json, Value};
use std::convert::Infallible;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};
use tokio::sync::mpsc::UnboundedReceiver;

/// Which endpoint's shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completion,
}

/// The fields every object of one answer shares.
#[derive(Debug, Clone)]
pub struct Envelope {
    pub endpoint: Endpoint,
    pub id: String,
    pub created: u64,
    pub model: String,
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
            Endpoint::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": o.text},
                "logprobs": null,
                "finish_reason": o.finish_reason,
            }),
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
        let choice = match self.endpoint {
            Endpoint::Chat => {
                let delta = match text {
                    None => json!({"role": "assistant", "content": ""}),
                    Some(t) => json!({"content": t}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null})
            }
            Endpoint::Completion => {
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": null})
            }
        };
        self.wrap(true, choice)
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
    let body = stream::unfold((Phase::Start, events), move |(phase, mut events)| {
        let envelope = envelope.clone();
        async move {
            match phase {
                Phase::Start if envelope.endpoint == Endpoint::Chat => {
                    Some((data(&envelope.chunk(None)), (Phase::Body, events)))
                }
                Phase::Start | Phase::Body => match events.recv().await {
                    Some(Event::Text(t)) => Some((data(&envelope.chunk(Some(&t))), (Phase::Body, events))),
                    Some(Event::Done(o)) => Some((data(&envelope.last_chunk(&o)), (Phase::Finished, events))),
                    Some(Event::Failed(m)) => {
                        Some((data(&ApiError::internal(m).body()), (Phase::Finished, events)))
                    }
                    None => Some((
                        data(&ApiError::internal("the decoding thread dropped the request").body()),
                        (Phase::Finished, events),
                    )),
                },
                Phase::Finished => Some((Ok(SseEvent::default().data("[DONE]")), (Phase::Over, events))),
                Phase::Over => None,
            }
        }
    });
    sse(body)
}

fn sse(body: impl Stream<Item = Result<SseEvent, Infallible>> + Send + 'static) -> Response {
    Sse::new(body).keep_alive(KeepAlive::default()).into_response()
}
