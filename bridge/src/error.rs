//! Everything a bridge request can fail with, and the one place that turns it into what the
//! client sees.
//!
//! Clients of the bridge are Anthropic clients (the gateway, Claude Code), so every error, ours
//! or a provider's, reaches them as `{"type":"error","error":{"type","message"}}` with the
//! status an Anthropic client expects to act on (429 is retried, 403 stops, 5xx is retried).
//! Provider failures are the engine's [`LlmError`] (mapped there, with generic words for every
//! 5xx); this type adds the bridge's own refusals. Messages never contain a key: keys live only
//! in headers.

use agentbox_llm::{ErrorReply, LlmError, Protocol};
use agentbox_wire::anthropic::ErrorType;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// A failed bridge request.
#[derive(Debug, thiserror::Error)]
pub enum BridgeError {
    /// No bridge token, or the wrong one.
    #[error("missing or invalid bridge token")]
    Unauthorized,
    /// No such route.
    #[error("not found: {0}")]
    NotFound(String),
    /// A known route with the wrong method.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The body is over the configured limit.
    #[error("request body exceeds the {limit_mb} MiB limit")]
    BodyTooLarge {
        /// The limit, MiB.
        limit_mb: u64,
    },
    /// The client did not deliver its body in time.
    #[error("request body not received within {0} s")]
    BodyTimeout(u64),
    /// The body could not be read (client went away, broken chunking).
    #[error("cannot read request body: {0}")]
    BodyRead(String),
    /// The body is not JSON.
    #[error("request body is not valid JSON: {0}")]
    MalformedJson(String),
    /// JSON of the wrong shape (wrong types, missing fields).
    #[error("{0}")]
    InvalidRequest(String),
    /// The model is not a remote model of the catalogue.
    #[error("model {0:?} is not served by this bridge")]
    UnknownModel(String),
    /// The model's provider key variable is unset.
    #[error("no key configured for model {model} (${key_env} is not set)")]
    NoKey {
        /// The agentbox model id.
        model: String,
        /// The variable that should hold the key.
        key_env: String,
    },
    /// Calling the provider failed (unreachable, timeout, its error, an invalid answer, a
    /// request translation refused).
    #[error(transparent)]
    Llm(#[from] LlmError),
}

impl BridgeError {
    /// What the client sees: status, kind, message.
    pub fn reply(&self) -> ErrorReply {
        let own =
            |status: StatusCode, kind: ErrorType| ErrorReply::new(status, kind, self.to_string());
        match self {
            BridgeError::Unauthorized => {
                own(StatusCode::UNAUTHORIZED, ErrorType::AuthenticationError)
            }
            BridgeError::NotFound(_) | BridgeError::UnknownModel(_) => {
                own(StatusCode::NOT_FOUND, ErrorType::NotFoundError)
            }
            BridgeError::MethodNotAllowed => own(
                StatusCode::METHOD_NOT_ALLOWED,
                ErrorType::InvalidRequestError,
            ),
            BridgeError::BodyTooLarge { .. } => {
                own(StatusCode::PAYLOAD_TOO_LARGE, ErrorType::RequestTooLarge)
            }
            BridgeError::BodyTimeout(_) => {
                own(StatusCode::REQUEST_TIMEOUT, ErrorType::InvalidRequestError)
            }
            BridgeError::BodyRead(_)
            | BridgeError::MalformedJson(_)
            | BridgeError::InvalidRequest(_) => {
                own(StatusCode::BAD_REQUEST, ErrorType::InvalidRequestError)
            }
            BridgeError::NoKey { .. } => own(StatusCode::SERVICE_UNAVAILABLE, ErrorType::ApiError),
            BridgeError::Llm(e) => e.reply(),
        }
    }
}

impl IntoResponse for BridgeError {
    fn into_response(self) -> Response {
        let mut resp = self.reply().into_response(Protocol::Anthropic);
        // The gateway refunds an error answer unless told the provider may have billed it.
        if let BridgeError::Llm(e) = &self
            && e.may_have_run()
        {
            resp.headers_mut()
                .insert(agentbox_llm::RAN_HEADER, HeaderValue::from_static("1"));
        }
        if resp.status() == StatusCode::UNAUTHORIZED {
            resp.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
