//! Every refusal and failure the server answers, with its ONE mapping to an HTTP status and the
//! reference's body `{request_id, error, message, details}` (details `{}` when there are none).
//!
//! [`TurnError`] is a turn's outcome when it did not commit: it is stored on the turn record
//! (with the status a synchronous caller gets, `http_status`) and replayed from there, so a
//! sync caller, a retry and a poller see the same error.

use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::model::{ErrorResponse, Object, TurnErrorBody};

/// What a turn that did not commit ended with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnErrorCode {
    /// The agent took longer than `backend_timeout` (paused time excluded).
    BackendTimeout,
    /// The model's context window was exceeded.
    ContextOverflow,
    /// The turn made more model calls than `max_steps`.
    MaxStepsExceeded,
    /// The agent failed (transport, protocol, process).
    BackendError,
    /// Something unexpected in the server.
    InternalError,
    /// Cancelled by the client.
    Cancelled,
    /// The session was aborted while the turn was active.
    Aborted,
    /// The server shut down while the turn was active.
    ServerShutdown,
}

impl TurnErrorCode {
    /// The wire code.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            TurnErrorCode::BackendTimeout => "backend_timeout",
            TurnErrorCode::ContextOverflow => "context_overflow",
            TurnErrorCode::MaxStepsExceeded => "max_steps_exceeded",
            TurnErrorCode::BackendError => "backend_error",
            TurnErrorCode::InternalError => "internal_error",
            TurnErrorCode::Cancelled => "cancelled",
            TurnErrorCode::Aborted => "aborted",
            TurnErrorCode::ServerShutdown => "server_shutdown",
        }
    }

    /// The status the synchronous caller gets (the reference's; 499 is nginx's "client closed
    /// request", which the reference uses for cancellation).
    #[must_use]
    pub fn http_status(self) -> u16 {
        match self {
            TurnErrorCode::BackendTimeout | TurnErrorCode::ServerShutdown => 504,
            TurnErrorCode::ContextOverflow => 413,
            TurnErrorCode::MaxStepsExceeded => 429,
            TurnErrorCode::BackendError => 502,
            TurnErrorCode::InternalError => 500,
            TurnErrorCode::Cancelled => 499,
            TurnErrorCode::Aborted => 409,
        }
    }

    /// Whether a desynced session may still run `execute_cmd` after this: the agent stopped
    /// for a known, non-retryable reason, and the sandbox is worth harvesting.
    #[must_use]
    pub fn allows_post_agent_commands(self) -> bool {
        match self {
            TurnErrorCode::ContextOverflow | TurnErrorCode::MaxStepsExceeded => true,
            TurnErrorCode::BackendTimeout
            | TurnErrorCode::BackendError
            | TurnErrorCode::InternalError
            | TurnErrorCode::Cancelled
            | TurnErrorCode::Aborted
            | TurnErrorCode::ServerShutdown => false,
        }
    }
}

/// A turn's error.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct TurnError {
    /// What happened.
    pub code: TurnErrorCode,
    /// Human text.
    pub message: String,
    /// `session_id`, `turn_id` and what the failure adds.
    pub details: Object,
}

impl TurnError {
    /// The stored and polled form.
    #[must_use]
    pub fn body(&self) -> TurnErrorBody {
        TurnErrorBody {
            error: self.code.as_str().to_owned(),
            message: self.message.clone(),
            http_status: self.code.http_status(),
            details: self.details.clone(),
        }
    }
}

/// An error answer.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// 400 `request_error`: the request is wrong.
    #[error("{message}")]
    Request {
        /// Why.
        message: String,
        /// Context.
        details: Object,
    },
    /// 400 `request_error` "Request validation failed.": the body does not fit its model.
    #[error("Request validation failed.")]
    Validation {
        /// pydantic-style `{type, loc, msg}` entries.
        errors: Vec<Value>,
    },
    /// 404 `not_found`.
    #[error("{message}")]
    NotFound {
        /// What.
        message: String,
        /// Context.
        details: Object,
    },
    /// 409 `conflict`.
    #[error("{message}")]
    Conflict {
        /// Why.
        message: String,
        /// Context.
        details: Object,
    },
    /// 409 `bound_session_mismatch`: this binding serves another session.
    #[error("This rollout binding only serves the registered session_id.")]
    BoundSessionMismatch {
        /// The bound session.
        expected: String,
        /// The one asked for.
        actual: String,
    },
    /// 413 `payload_too_large`: the body is over the limit (ours; the reference has none).
    #[error("Request body exceeds {limit} bytes.")]
    BodyTooLarge {
        /// Bytes.
        limit: u64,
    },
    /// 429 `too_many_requests`: `max_turns` committed turns.
    #[error("Session reached the max committed turn limit.")]
    TooManyTurns {
        /// Context.
        details: Object,
    },
    /// 500 `internal_error`.
    #[error("{message}")]
    Internal {
        /// What.
        message: String,
        /// Context.
        details: Object,
    },
    /// 502 `backend_error`: the agent (or the router behind the proxy) failed.
    #[error("{message}")]
    Backend {
        /// What.
        message: String,
        /// Context.
        details: Object,
    },
    /// 503 `service_unavailable`: not ready (no binding, initializing, shutting down, agent
    /// down). The paddock retries 503.
    #[error("{message}")]
    Unavailable {
        /// Why.
        message: String,
        /// Context.
        details: Object,
    },
    /// 503 `pause_timeout`: model calls did not quiesce in time.
    #[error("Rollout pause did not reach model-quiesced state before timeout.")]
    PauseTimeout {
        /// The proxy's answer.
        details: Object,
    },
    /// A turn's stored error, with its stored status.
    #[error(transparent)]
    Turn(#[from] TurnError),
}

/// An object from `json!` (anything else becomes `{}`).
#[must_use]
pub fn obj(v: Value) -> Object {
    match v {
        Value::Object(m) => m,
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) | Value::Array(_) => {
            Object::new()
        }
    }
}

impl ApiError {
    /// 400 `request_error` without details.
    pub fn request(message: impl Into<String>) -> ApiError {
        ApiError::Request {
            message: message.into(),
            details: Object::new(),
        }
    }

    /// 409 `conflict`.
    pub fn conflict(message: impl Into<String>, details: Value) -> ApiError {
        ApiError::Conflict {
            message: message.into(),
            details: obj(details),
        }
    }

    /// 404 `not_found` for a session.
    pub fn no_session(session_id: &str) -> ApiError {
        ApiError::NotFound {
            message: "Session does not exist.".into(),
            details: obj(json!({"session_id": session_id})),
        }
    }

    /// 404 `not_found` for a turn.
    pub fn no_turn(session_id: &str, turn_id: &str) -> ApiError {
        ApiError::NotFound {
            message: "Turn does not exist.".into(),
            details: obj(json!({"session_id": session_id, "turn_id": turn_id})),
        }
    }

    /// 503 `service_unavailable`.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::Unavailable {
            message: message.into(),
            details: Object::new(),
        }
    }

    /// The status and the body (with `request_id`).
    #[must_use]
    pub fn render(&self, request_id: &str) -> (StatusCode, ErrorResponse) {
        let (status, code, details) = match self {
            ApiError::Request { details, .. } => (400, "request_error", details.clone()),
            ApiError::Validation { errors } => {
                (400, "request_error", obj(json!({"errors": errors})))
            }
            ApiError::NotFound { details, .. } => (404, "not_found", details.clone()),
            ApiError::Conflict { details, .. } => (409, "conflict", details.clone()),
            ApiError::BoundSessionMismatch { expected, actual } => (
                409,
                "bound_session_mismatch",
                obj(json!({"expected_session_id": expected, "actual_session_id": actual})),
            ),
            ApiError::BodyTooLarge { limit } => {
                (413, "payload_too_large", obj(json!({"limit_bytes": limit})))
            }
            ApiError::TooManyTurns { details } => (429, "too_many_requests", details.clone()),
            ApiError::Internal { details, .. } => (500, "internal_error", details.clone()),
            ApiError::Backend { details, .. } => (502, "backend_error", details.clone()),
            ApiError::Unavailable { details, .. } => (503, "service_unavailable", details.clone()),
            ApiError::PauseTimeout { details } => (503, "pause_timeout", details.clone()),
            ApiError::Turn(t) => (t.code.http_status(), t.code.as_str(), t.details.clone()),
        };
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (
            status,
            ErrorResponse {
                request_id: request_id.to_owned(),
                error: code.to_owned(),
                message: self.to_string(),
                details,
            },
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn turn_errors_keep_their_sync_status() {
        let e = TurnError {
            code: TurnErrorCode::BackendTimeout,
            message: "Backend call exceeded backend_timeout.".into(),
            details: obj(json!({"session_id": "s", "turn_id": "t"})),
        };
        let body = serde_json::to_value(e.body()).unwrap();
        assert_eq!(body["http_status"], 504);
        assert_eq!(body["error"], "backend_timeout");
        let (status, reply) = ApiError::Turn(e).render("req-1");
        assert_eq!(status.as_u16(), 504);
        assert_eq!(reply.details["turn_id"], "t");
        assert_eq!(
            TurnErrorCode::Cancelled.http_status(),
            499,
            "a non-standard code must still render"
        );
        let (s, _) = ApiError::Turn(TurnError {
            code: TurnErrorCode::Cancelled,
            message: String::new(),
            details: Object::new(),
        })
        .render("r");
        assert_eq!(s.as_u16(), 499);
    }

    #[test]
    fn bodies_have_the_reference_shape() {
        let (status, body) = ApiError::request("messages must not be empty.").render("req-abc");
        assert_eq!(status.as_u16(), 400);
        let v = serde_json::to_value(body).unwrap();
        assert_eq!(
            v,
            json!({"request_id": "req-abc", "error": "request_error",
                   "message": "messages must not be empty.", "details": {}})
        );
    }
}
