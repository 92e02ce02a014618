//! Errors as OpenAI's API sends them: a status and `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: invalid_request_error, authentication_error, server_error, ...
    pub kind: &'static str,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// Seconds a client should wait before retrying (503 of a full queue).
    pub retry_after: Option<u64>,
}

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            retry_after: None,
        }
    }

    /// 400: the request is malformed or asks for something this server cannot give.
    pub fn invalid(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    /// 400 about one field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        ApiError {
            param: Some(param.to_string()),
            ..Self::invalid(message)
        }
    }

    pub fn unauthorized() -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "missing or wrong API key: send `Authorization: Bearer KEY`",
        )
    }

    pub fn not_found(message: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "invalid_request_error", message)
    }

    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request_error",
            "method not allowed on this endpoint",
        )
    }

    pub fn with_status(status: StatusCode, message: impl Into<String>) -> Self {
        Self::new(status, "invalid_request_error", message)
    }

    /// 503: every queue slot is taken.
    pub fn busy(retry_after: u64) -> Self {
        ApiError {
            retry_after: Some(retry_after),
            ..Self::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "server_busy",
                "the request queue is full: retry later",
            )
        }
    }

    /// 500: the decoding failed (the message is the error's).
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": null,
            }
        })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        response
    }
}
