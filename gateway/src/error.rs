//! The gateway's two error types, each with one exhaustive mapping to a status and a body.
//!
//! - [`ProxyError`]: what an agent sees on its task socket, in Anthropic's shape
//!   (`{"type":"error","error":{"type","message"}}`; OpenAI's on `/v1/chat/completions`, which
//!   renders the same reply with `Protocol::OpenAi`), with the statuses Claude Code acts on:
//!   403 `permission_error` for an exhausted budget (it stops; it would retry 429 and 5xx).
//! - [`ControlError`]: what the operator's tools see on the control socket:
//!   `{"error":{"code","message"}}` ([`ErrorEnvelope`]).

use agentbox_api::ErrorEnvelope;
use agentbox_llm::{ErrorReply, LlmError, Protocol};
use agentbox_wire::anthropic::ErrorType;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::account::AccountError;
use crate::sockets::SocketError;
use crate::store::StoreError;

/// A failed request on a task socket.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// Not a route of this socket, or a route the task's model does not serve (`/v1/messages`
    /// on a rollout router, `/v1/chat/completions` on anything else).
    #[error("not found: {0}")]
    NotFound(String),
    /// Over `gateway.max_body_mb`.
    #[error("request body exceeds {limit} bytes")]
    BodyTooLarge {
        /// The limit.
        limit: u64,
    },
    /// The body did not arrive in time.
    #[error("request body not received in time")]
    BodyTimeout,
    /// The body could not be read.
    #[error("cannot read request body: {0}")]
    BodyRead(String),
    /// This task already has `gateway.max_connections_per_task` connections open.
    #[error("too many connections from this task")]
    TooManyConnections,
    /// This task already has `gateway.max_connections_per_task` model calls in flight, answers
    /// its clients left and the gateway still reads included.
    #[error(
        "too many model calls in flight from this task (answers left early are still read); retry later"
    )]
    TooManyCalls,
    /// This task's bodies already hold `gateway.max_inflight_body_mb_per_task`.
    #[error("too many request bytes in flight from this task; retry later")]
    TooManyBodyBytes,
    /// All tasks' bodies together hold `gateway.body_memory_mb`.
    #[error("the gateway is busy; retry later")]
    Overloaded,
    /// Not JSON, or JSON of the wrong shape.
    #[error("{0}")]
    InvalidRequest(String),
    /// The model's loopback listener is not the service user's (see `http::loopback`).
    #[error("the model's server is unavailable")]
    UntrustedUpstream,
    /// A remote model but no bridge token configured.
    #[error("the gateway has no bridge token: remote models are unavailable")]
    NoBridgeToken,
    /// The task's account refused: bad token, closed task, spent budget.
    #[error(transparent)]
    Account(#[from] AccountError),
    /// Calling the model failed (unreachable, timeout, its error, an invalid answer).
    #[error(transparent)]
    Llm(#[from] LlmError),
}

impl ProxyError {
    /// What the agent sees: status, kind, message.
    pub fn reply(&self) -> ErrorReply {
        let own = |s: StatusCode, k: ErrorType| ErrorReply::new(s, k, self.to_string());
        match self {
            ProxyError::NotFound(_) | ProxyError::Account(AccountError::TaskClosed) => {
                own(StatusCode::NOT_FOUND, ErrorType::NotFoundError)
            }
            ProxyError::Account(AccountError::Unauthorized) => {
                own(StatusCode::UNAUTHORIZED, ErrorType::AuthenticationError)
            }
            ProxyError::BodyTooLarge { .. } => {
                own(StatusCode::PAYLOAD_TOO_LARGE, ErrorType::RequestTooLarge)
            }
            ProxyError::BodyTimeout => {
                own(StatusCode::REQUEST_TIMEOUT, ErrorType::InvalidRequestError)
            }
            ProxyError::TooManyConnections
            | ProxyError::TooManyCalls
            | ProxyError::TooManyBodyBytes => {
                own(StatusCode::TOO_MANY_REQUESTS, ErrorType::RateLimitError)
            }
            ProxyError::Overloaded => {
                own(StatusCode::SERVICE_UNAVAILABLE, ErrorType::OverloadedError)
            }
            ProxyError::BodyRead(_) | ProxyError::InvalidRequest(_) => {
                own(StatusCode::BAD_REQUEST, ErrorType::InvalidRequestError)
            }
            ProxyError::Account(AccountError::Budget(_)) => {
                own(StatusCode::FORBIDDEN, ErrorType::PermissionError)
            }
            ProxyError::NoBridgeToken => own(StatusCode::SERVICE_UNAVAILABLE, ErrorType::ApiError),
            ProxyError::UntrustedUpstream => own(StatusCode::BAD_GATEWAY, ErrorType::ApiError),
            ProxyError::Llm(e) => e.reply(),
        }
    }
}

impl IntoResponse for ProxyError {
    fn into_response(self) -> Response {
        self.reply().into_response(Protocol::Anthropic)
    }
}

/// A failed request on the control socket.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// The caller is neither root nor the service user.
    #[error("uid {0} may not use the gateway control socket")]
    Forbidden(u32),
    /// No such route.
    #[error("not found: {0}")]
    NotFound(String),
    /// No such task.
    #[error("no task {0}")]
    NoTask(String),
    /// The request breaks a rule (bad tid, unknown model, bad token or budget, bad JSON).
    #[error("{0}")]
    BadRequest(String),
    /// The body is too large.
    #[error("request body too large")]
    TooLarge,
    /// The task is open with other settings.
    #[error("{0}")]
    Conflict(String),
    /// The task socket could not be created safely.
    #[error(transparent)]
    Socket(#[from] SocketError),
    /// The state could not be saved.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl ControlError {
    /// Status and machine-readable code.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            ControlError::Forbidden(_) => (StatusCode::FORBIDDEN, "forbidden"),
            ControlError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found"),
            ControlError::NoTask(_) => (StatusCode::NOT_FOUND, "no_such_task"),
            ControlError::BadRequest(_) => (StatusCode::BAD_REQUEST, "invalid_request"),
            ControlError::TooLarge => (StatusCode::PAYLOAD_TOO_LARGE, "too_large"),
            ControlError::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            ControlError::Socket(SocketError::Unsafe { .. } | SocketError::Owner { .. }) => {
                (StatusCode::CONFLICT, "unsafe_socket_path")
            }
            ControlError::Socket(SocketError::Io { .. }) | ControlError::Store(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "internal")
            }
        }
    }
}

impl IntoResponse for ControlError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        (
            status,
            axum::Json(ErrorEnvelope::new(code, self.to_string())),
        )
            .into_response()
    }
}
