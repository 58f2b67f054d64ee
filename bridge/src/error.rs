//! Everything a bridge request can fail with, and the one place that turns it into an HTTP
//! status and an Anthropic-shaped error body.
//!
//! Clients of the bridge are Anthropic clients (the gateway, Claude Code), so every error, ours
//! or a provider's, reaches them as `{"type":"error","error":{"type","message"}}` with the
//! status an Anthropic client expects to act on (429 is retried, 403 stops, 5xx is retried).
//! Messages never contain a key: upstream URLs carry none, and keys live only in headers.

use agentbox_wire::anthropic::{ErrorBody, ErrorType};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;

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
    /// JSON of the wrong shape (wrong types, missing fields, unsupported content).
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
    /// The provider could not be reached or the connection broke before a response.
    #[error("upstream unreachable: {0}")]
    UpstreamUnreachable(String),
    /// The provider did not answer in time.
    #[error("upstream timed out")]
    UpstreamTimeout,
    /// The provider answered with an error; already mapped to what our client should see.
    #[error("upstream error {status}: {}", body.error.message)]
    Upstream {
        /// The status to return.
        status: StatusCode,
        /// The Anthropic error body to return.
        body: Box<ErrorBody>,
        /// `retry-after`, passed through.
        retry_after: Option<HeaderValue>,
    },
    /// The provider answered 2xx with something we cannot understand.
    #[error("upstream sent an invalid response: {0}")]
    UpstreamInvalid(String),
}

impl BridgeError {
    /// The HTTP status and Anthropic error body for this error.
    pub fn status_and_body(&self) -> (StatusCode, ErrorBody) {
        let own =
            |status: StatusCode, kind: ErrorType| (status, ErrorBody::new(kind, self.to_string()));
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
            BridgeError::UpstreamUnreachable(_) | BridgeError::UpstreamInvalid(_) => {
                own(StatusCode::BAD_GATEWAY, ErrorType::ApiError)
            }
            BridgeError::UpstreamTimeout => {
                own(StatusCode::GATEWAY_TIMEOUT, ErrorType::TimeoutError)
            }
            BridgeError::Upstream { status, body, .. } => (*status, (**body).clone()),
        }
    }
}

/// Serializes an Anthropic error body.
pub fn error_bytes(body: &ErrorBody) -> Bytes {
    // Serializing plain strings and enums cannot fail; an empty body beats a panic.
    Bytes::from(serde_json::to_vec(body).unwrap_or_default())
}

impl IntoResponse for BridgeError {
    fn into_response(self) -> Response {
        let (status, body) = self.status_and_body();
        let mut resp = (status, error_bytes(&body)).into_response();
        let headers = resp.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let BridgeError::Upstream {
            retry_after: Some(v),
            ..
        } = self
        {
            headers.insert(header::RETRY_AFTER, v);
        }
        if status == StatusCode::UNAUTHORIZED {
            headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        resp
    }
}
