//! The engine's one error type, [`LlmError`], and the one place an error becomes what a client
//! sees: [`ErrorReply`] (status, error kind and message, `retry-after`), rendered in the
//! client's [`Protocol`].
//!
//! Rules every daemon gets from here:
//! - an upstream 429 stays 429 and keeps its `retry-after`; an upstream 5xx becomes 502 unless
//!   its body is Anthropic-shaped (`agentbox_wire::error::client_error_for_upstream`); a 4xx
//!   keeps its status with the upstream's message (the agent acts on it: "prompt is too long").
//! - a 5xx the client sees says what failed in generic words: never an upstream URL, host,
//!   port, upstream-supplied text or a reqwest error chain. The details go to the log.
//! - unreachable is 502 `api_error`, a timeout 504 `timeout_error`.

use agentbox_wire::anthropic::{ErrorBody, ErrorType, StreamEvent};
use agentbox_wire::error::client_error_for_upstream;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// The wire protocol the client speaks: the shape of error bodies and of the frame that ends a
/// broken stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Anthropic Messages: `{"type":"error","error":{"type","message"}}`, `event: error`.
    Anthropic,
    /// OpenAI (chat completions, and Responses error bodies): `{"error":{"message","type",
    /// "code"}}`; a broken chat stream ends with that object as a `data:` frame, which is how
    /// OpenAI-compatible servers report a failure after the 200.
    OpenAi,
}

impl Protocol {
    /// The body of `body` in this protocol's shape.
    pub fn error_body(self, body: &ErrorBody) -> serde_json::Value {
        match self {
            Protocol::Anthropic => serde_json::to_value(body).unwrap_or_default(),
            Protocol::OpenAi => serde_json::json!({
                "error": {
                    "message": body.error.message,
                    "type": body.error.kind,
                    "code": serde_json::Value::Null,
                }
            }),
        }
    }

    /// The bytes that end a passthrough event stream whose upstream broke, after a blank line
    /// when the bytes forwarded so far stopped mid-frame.
    pub fn failure_frame(self, mid_frame: bool, message: &str) -> Vec<u8> {
        match self {
            Protocol::Anthropic => StreamEvent::failure_frame(mid_frame, message),
            Protocol::OpenAi => {
                let mut out = if mid_frame {
                    b"\n\n".to_vec()
                } else {
                    Vec::new()
                };
                let body = ErrorBody::new(ErrorType::ApiError, message);
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(Protocol::OpenAi.error_body(&body).to_string().as_bytes());
                out.extend_from_slice(b"\n\n");
                out
            }
        }
    }
}

/// What a client is told about a failed request, before it is rendered in a protocol.
#[derive(Debug, Clone, PartialEq)]
pub struct ErrorReply {
    /// The HTTP status.
    pub status: StatusCode,
    /// Kind and message (Anthropic's vocabulary, which every protocol's errors map from).
    pub body: ErrorBody,
    /// `retry-after`, passed through from the upstream.
    pub retry_after: Option<HeaderValue>,
}

impl ErrorReply {
    /// A reply of our own making.
    pub fn new(status: StatusCode, kind: ErrorType, message: impl Into<String>) -> Self {
        ErrorReply {
            status,
            body: ErrorBody::new(kind, message),
            retry_after: None,
        }
    }

    /// The response in `protocol`'s shape.
    pub fn into_response(self, protocol: Protocol) -> Response {
        // Plain strings and enums: serializing cannot fail; an empty body beats a panic.
        let bytes = serde_json::to_vec(&protocol.error_body(&self.body)).unwrap_or_default();
        let mut resp = (self.status, bytes).into_response();
        let headers = resp.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Some(v) = self.retry_after {
            headers.insert(header::RETRY_AFTER, v);
        }
        resp
    }
}

/// Why a call through the engine failed. `Display` carries the detail for logs; what a client
/// sees is [`LlmError::reply`].
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    /// The request cannot be expressed upstream (translation refused it, or it does not parse
    /// as the protocol's request).
    #[error("{0}")]
    InvalidRequest(String),
    /// No response: connection refused or never made in time, reset, DNS, TLS, or the body broke
    /// while being read.
    #[error("upstream unreachable: {0}")]
    Unreachable(String),
    /// The upstream did not answer (or stopped sending) in time.
    #[error("upstream timed out")]
    Timeout,
    /// The upstream answered with an error, already mapped to what the client should see.
    #[error("upstream error {status}: {}", body.error.message)]
    Upstream {
        /// Status for the client.
        status: StatusCode,
        /// Kind and message for the client.
        body: Box<ErrorBody>,
        /// `retry-after`, passed through.
        retry_after: Option<HeaderValue>,
        /// The answer said ([`RAN_HEADER`]) that the model may have run the request before it
        /// failed: an agentbox bridge whose provider timed out or answered garbage.
        ran: bool,
    },
    /// The upstream answered 2xx with something that is not a valid response.
    #[error("upstream sent an invalid response: {0}")]
    InvalidResponse(String),
}

/// The header of an error answer whose request the model may have run (see
/// [`LlmError::may_have_run`]); its value is `1`.
pub const RAN_HEADER: &str = "x-agentbox-upstream-ran";

impl LlmError {
    /// A transport error (no response, or a body that broke), logged with its whole chain.
    pub fn from_transport(e: &reqwest::Error) -> Self {
        let chain = agentbox_http::error_chain(e);
        // A connection that timed out was never made: nothing was sent, so nothing was run.
        if e.is_timeout() && !e.is_connect() {
            tracing::warn!(error = %chain, "upstream timed out");
            LlmError::Timeout
        } else {
            tracing::warn!(error = %chain, "upstream unreachable");
            LlmError::Unreachable(chain)
        }
    }

    /// An upstream's error response (status, `retry-after`, the capped body) in the client's
    /// terms; see the module rules.
    pub fn from_upstream(
        status: StatusCode,
        retry_after: Option<HeaderValue>,
        body: &[u8],
    ) -> Self {
        let (mapped, mut reply) = client_error_for_upstream(status.as_u16(), body);
        // Only 4xx and 5xx are errors a client can act on; anything else that is not a 2xx (a
        // redirect, which is never followed, or an informational status) is a broken upstream.
        let mapped = match StatusCode::from_u16(mapped) {
            Ok(s) if s.is_client_error() || s.is_server_error() => s,
            Ok(_) | Err(_) => {
                reply = ErrorBody::new(ErrorType::ApiError, "");
                StatusCode::BAD_GATEWAY
            }
        };
        if mapped.is_server_error() {
            tracing::warn!(status = status.as_u16(), body = %String::from_utf8_lossy(&body[..body.len().min(2048)]),
                "upstream error");
            // Keep the kind (overloaded, api error) and the request id; drop the words.
            reply.error.message = format!("upstream returned HTTP {}", status.as_u16());
            reply.error.extra.clear();
            reply.extra.clear();
        }
        LlmError::Upstream {
            status: mapped,
            body: Box::new(reply),
            retry_after,
            ran: false,
        }
    }

    /// Whether the model may have run the request, and billed it, though it failed: it timed
    /// out after the request was sent, answered 2xx with something invalid, or said so
    /// ([`RAN_HEADER`]). A daemon answering with such an error sends [`RAN_HEADER`], so the
    /// one in front of it bills as it would (the gateway bills the whole reservation).
    pub fn may_have_run(&self) -> bool {
        match self {
            LlmError::Timeout | LlmError::InvalidResponse(_) => true,
            LlmError::Upstream { ran, .. } => *ran,
            LlmError::InvalidRequest(_) | LlmError::Unreachable(_) => false,
        }
    }

    /// What the client sees: the one mapping to status, kind and message.
    pub fn reply(&self) -> ErrorReply {
        match self {
            LlmError::InvalidRequest(m) => ErrorReply::new(
                StatusCode::BAD_REQUEST,
                ErrorType::InvalidRequestError,
                m.clone(),
            ),
            LlmError::Unreachable(_) => ErrorReply::new(
                StatusCode::BAD_GATEWAY,
                ErrorType::ApiError,
                "upstream unreachable",
            ),
            LlmError::Timeout => ErrorReply::new(
                StatusCode::GATEWAY_TIMEOUT,
                ErrorType::TimeoutError,
                "upstream timed out",
            ),
            LlmError::Upstream {
                status,
                body,
                retry_after,
                ran: _,
            } => ErrorReply {
                status: *status,
                body: (**body).clone(),
                retry_after: retry_after.clone(),
            },
            LlmError::InvalidResponse(_) => ErrorReply::new(
                StatusCode::BAD_GATEWAY,
                ErrorType::ApiError,
                "upstream sent an invalid response",
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn kind(e: &LlmError) -> ErrorType {
        e.reply().body.error.kind
    }

    #[test]
    fn own_errors_map_to_fixed_statuses_and_generic_words() {
        let e = LlmError::Unreachable(
            "error sending request for url (http://127.0.0.1:9/v1/messages): refused".into(),
        );
        let r = e.reply();
        assert_eq!(r.status, StatusCode::BAD_GATEWAY);
        assert_eq!(kind(&e), ErrorType::ApiError);
        assert_eq!(r.body.error.message, "upstream unreachable");
        let r = LlmError::Timeout.reply();
        assert_eq!(r.status, StatusCode::GATEWAY_TIMEOUT);
        assert_eq!(r.body.error.kind, ErrorType::TimeoutError);
        let r = LlmError::InvalidResponse("not a chat completion at http://x".into()).reply();
        assert_eq!(r.status, StatusCode::BAD_GATEWAY);
        assert!(!r.body.error.message.contains("http"));
        let r = LlmError::InvalidRequest("tools: bad".into()).reply();
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert_eq!(r.body.error.message, "tools: bad");
    }

    #[test]
    fn upstream_statuses_follow_the_wire_rule() {
        let ra = HeaderValue::from_static("7");
        let e = LlmError::from_upstream(StatusCode::TOO_MANY_REQUESTS, Some(ra.clone()), b"{}");
        let r = e.reply();
        assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(r.retry_after, Some(ra));
        assert_eq!(r.body.error.kind, ErrorType::RateLimitError);

        // Not Anthropic-shaped 5xx: 502, and none of the upstream's words.
        let body = br#"{"error":{"message":"backend http://10.0.0.5:8000/v1 refused"}}"#;
        let r = LlmError::from_upstream(StatusCode::INTERNAL_SERVER_ERROR, None, body).reply();
        assert_eq!(r.status, StatusCode::BAD_GATEWAY);
        assert_eq!(r.body.error.kind, ErrorType::ApiError);
        assert_eq!(r.body.error.message, "upstream returned HTTP 500");

        // Anthropic-shaped 5xx keeps status and kind, not the words.
        let body =
            br#"{"type":"error","error":{"type":"overloaded_error","message":"at 127.0.0.1:1"}}"#;
        let r = LlmError::from_upstream(StatusCode::from_u16(529).unwrap(), None, body).reply();
        assert_eq!(r.status.as_u16(), 529);
        assert_eq!(r.body.error.kind, ErrorType::OverloadedError);
        assert!(!r.body.error.message.contains("127.0.0.1"));

        // 4xx keeps the upstream's message: the agent acts on it.
        let body = br#"{"error":{"message":"maximum context length is 8192 tokens"}}"#;
        let r = LlmError::from_upstream(StatusCode::BAD_REQUEST, None, body).reply();
        assert_eq!(r.status, StatusCode::BAD_REQUEST);
        assert!(r.body.error.message.starts_with("prompt is too long"));

        // A redirect (never followed) is a broken upstream, whatever its body says.
        for status in [307, 308, 301] {
            let body = br#"{"type":"error","error":{"type":"invalid_request_error","message":"go to http://evil"}}"#;
            let r =
                LlmError::from_upstream(StatusCode::from_u16(status).unwrap(), None, body).reply();
            assert_eq!(r.status, StatusCode::BAD_GATEWAY);
            assert_eq!(r.body.error.kind, ErrorType::ApiError);
            assert_eq!(
                r.body.error.message,
                format!("upstream returned HTTP {status}")
            );
        }
    }

    #[test]
    fn replies_render_as_anthropic_bodies() {
        let mut r = ErrorReply::new(StatusCode::FORBIDDEN, ErrorType::PermissionError, "spent");
        r.retry_after = Some(HeaderValue::from_static("3"));
        let resp = r.into_response(Protocol::Anthropic);
        assert_eq!(resp.status(), StatusCode::FORBIDDEN);
        assert_eq!(resp.headers()[header::RETRY_AFTER], "3");
        assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/json");
    }

    #[test]
    fn replies_and_failure_frames_render_in_openai_shape() {
        let r = ErrorReply::new(StatusCode::BAD_GATEWAY, ErrorType::ApiError, "down");
        let v = Protocol::OpenAi.error_body(&r.body);
        assert_eq!(
            v,
            serde_json::json!({"error": {"message": "down", "type": "api_error", "code": null}})
        );
        let frame = String::from_utf8(Protocol::OpenAi.failure_frame(true, "cut")).unwrap();
        assert!(frame.starts_with("\n\ndata: {\"error\":"), "{frame}");
        assert!(frame.ends_with("}\n\n"), "{frame}");
        let frame = String::from_utf8(Protocol::OpenAi.failure_frame(false, "cut")).unwrap();
        assert!(frame.starts_with("data: "), "{frame}");
    }
}
