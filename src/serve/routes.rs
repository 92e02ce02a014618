//! The HTTP surface: the routes, the API key check, the body limit, and the handlers that turn a body
//! into a queued job and the job's events into an answer.

use super::api::{self, ChatRequest, CompletionRequest, Defaults};
use super::error::ApiError;
use super::queue::Queue;
use super::respond::{self, Endpoint, Envelope};
use crate::session::Session;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use std::sync::Arc;
use subtle::ConstantTimeEq;

/// What every handler shares.
pub struct AppState {
    /// Seconds a request has to send its whole body (`--body-timeout`).
    pub body_timeout: std::time::Duration,
    pub session: Arc<Session>,
    pub queue: Queue,
    pub defaults: Defaults,
    /// The name answers and /v1/models give the model.
    pub model_id: String,
    pub api_key: Option<String>,
    /// When the server started (the model's `created`).
    pub started: u64,
    /// The longest request body accepted, in bytes (`--max-body`).
    pub max_body: usize,
    /// Send a chat answer's thinking apart, in `reasoning_content` (`--reasoning-format deepseek`).
    pub reasoning: bool,
}

type Shared = Arc<AppState>;

/// The application: /v1/ behind the key check, /health open (for probes), OpenAI-shaped 404 and 405.
pub fn router(state: Shared) -> Router {
    let v1 = Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route_layer(middleware::from_fn_with_state(state.clone(), require_key));
    Router::new()
        .route("/health", get(health))
        .merge(v1)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

/// Whether `given` is `Authorization: Bearer KEY` (the scheme in any case, as HTTP's schemes are), the
/// key compared in constant time.
fn key_matches(given: Option<&[u8]>, key: &str) -> bool {
    let Some(given) = given else { return false };
    let Some(space) = given.iter().position(|&b| b == b' ') else {
        return false;
    };
    let (scheme, token) = (&given[..space], given[space..].trim_ascii_start());
    scheme.eq_ignore_ascii_case(b"Bearer") && bool::from(token.ct_eq(key.as_bytes()))
}

async fn require_key(State(state): State<Shared>, request: Request, next: Next) -> Response {
    if let Some(key) = &state.api_key {
        let given = request.headers().get(header::AUTHORIZATION).map(|v| v.as_bytes());
        if !key_matches(given, key) {
            let mut response = ApiError::unauthorized().into_response();
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                header::HeaderValue::from_static("Bearer"),
            );
            return response;
        }
    }
    next.run(request).await
}

async fn health(State(state): State<Shared>) -> Response {
    let mut v = state.queue.counters.snapshot();
    v["status"] = "ok".into();
    v["model"] = state.model_id.clone().into();
    Json(v).into_response()
}

async fn models(State(state): State<Shared>) -> Response {
    Json(serde_json::json!({
        "object": "list",
        "data": [{
            "id": state.model_id,
            "object": "model",
            "created": state.started,
            "owned_by": "probespec",
        }],
    }))
    .into_response()
}

/// The body, or an OpenAI-shaped error: 413 past `limit`, 408 when it has not come whole within
/// `timeout`.
async fn read_body(body: Body, limit: usize, timeout: std::time::Duration) -> Result<Bytes, ApiError> {
    tokio::time::timeout(timeout, read_body_within(body, limit))
        .await
        .unwrap_or_else(|_| {
            Err(ApiError::with_status(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "the request body did not arrive within {} s (--body-timeout)",
                    timeout.as_secs()
                ),
            ))
        })
}

/// A body past the limit is still read to its end (up to four times the limit, at least 16 MiB) and
/// dropped before the answer: a client that is still sending it would otherwise meet a reset connection
/// instead of the 413.
async fn read_body_within(body: Body, limit: usize) -> Result<Bytes, ApiError> {
    let drain_cap = limit.saturating_mul(4).max(16 << 20);
    let mut stream = body.into_data_stream();
    let (mut bytes, mut seen) = (Vec::new(), 0usize);
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::with_status(
                StatusCode::BAD_REQUEST,
                format!("cannot read the request body: {e}"),
            )
        })?;
        seen = seen.saturating_add(chunk.len());
        if seen <= limit {
            bytes.extend_from_slice(&chunk);
        } else if seen > drain_cap {
            break;
        }
    }
    if seen > limit {
        return Err(ApiError::with_status(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!("the request body is over the server's limit of {limit} bytes (--max-body)"),
        ));
    }
    Ok(bytes.into())
}

async fn chat(State(state): State<Shared>, b: Body) -> Response {
    let parsed = prepare(&state, b, Endpoint::Chat, |bytes, state| {
        let req: ChatRequest = api::parse_body(bytes, Endpoint::Chat)?;
        api::chat_job(&req, &state.session, &state.defaults)
    });
    answer(&state, Endpoint::Chat, parsed.await).await
}

async fn completions(State(state): State<Shared>, b: Body) -> Response {
    let parsed = prepare(&state, b, Endpoint::Completion, |bytes, state| {
        let req: CompletionRequest = api::parse_body(bytes, Endpoint::Completion)?;
        api::completion_job(&req, &state.session, &state.defaults)
    });
    answer(&state, Endpoint::Completion, parsed.await).await
}

/// Reads the body, then parses, renders and tokenises it on a blocking thread: a large prompt's
/// tokenising never holds the threads that answer other requests and `/health`.
async fn prepare(
    state: &Shared,
    body: Body,
    endpoint: Endpoint,
    parse: fn(&[u8], &AppState) -> Result<api::Parsed, ApiError>,
) -> Result<api::Parsed, ApiError> {
    let bytes = read_body(body, state.max_body, state.body_timeout).await?;
    let state = state.clone();
    tokio::task::spawn_blocking(move || parse(&bytes, &state))
        .await
        .unwrap_or_else(|e| {
            Err(ApiError::internal(format!(
                "preparing the {endpoint:?} request failed: {e}"
            )))
        })
}

/// Queues a parsed request and answers it, streamed or whole.
async fn answer(state: &AppState, endpoint: Endpoint, parsed: Result<api::Parsed, ApiError>) -> Response {
    let parsed = match parsed {
        Ok(p) => p,
        Err(e) => return e.into_response(),
    };
    let events = match state.queue.submit(parsed.spec) {
        Ok(rx) => rx,
        Err(e) => return e.into_response(),
    };
    let mut envelope = Envelope::new(endpoint, &state.model_id);
    if state.reasoning && endpoint == Endpoint::Chat {
        envelope.thinking = Some(parsed.prompt_opens_thinking);
    }
    if parsed.stream {
        respond::stream(envelope, events)
    } else {
        respond::collect(&envelope, events).await
    }
}

async fn not_found(request: Request) -> Response {
    ApiError::not_found(format!("no route {} {}", request.method(), request.uri().path())).into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::method_not_allowed().into_response()
}

#[cfg(test)]
mod tests {
    use super::key_matches;

    #[test]
    fn the_key_must_be_a_bearer_token_equal_to_the_key() {
        assert!(key_matches(Some(b"Bearer sk-1"), "sk-1"));
        assert!(!key_matches(Some(b"Bearer sk-2"), "sk-1"));
        assert!(!key_matches(Some(b"Bearer sk-1x"), "sk-1"));
        assert!(!key_matches(Some(b"Bearer sk-"), "sk-1"));
        assert!(!key_matches(Some(b"sk-1"), "sk-1"));
        assert!(!key_matches(Some(b"Basic sk-1"), "sk-1"));
        assert!(!key_matches(None, "sk-1"));
    }
}
