//! Anthropic error bodies for the gateway's own refusals and for upstream failures translated
//! by the bridge: HTTP status → Anthropic error type, OpenAI-style error bodies (and the looser
//! shapes compatible servers send) → `{"type":"error","error":{"type","message"}}`, and
//! mid-stream errors → an `error` event (or, for the Responses API, the code and message of a
//! `response.failed` event).
//!
//! Status map (Anthropic's documented types): 400 `invalid_request_error`, 401
//! `authentication_error`, 402 `billing_error`, 403 `permission_error` (never
//! `authentication_error`: Claude Code must read a budget refusal as final, not as bad
//! credentials), 404 `not_found_error`, 413 `request_too_large`, 429 `rate_limit_error`, 504
//! `timeout_error`, 529 `overloaded_error`, other 5xx `api_error`, other 4xx
//! `invalid_request_error`.
//!
//! Upstream messages are passed on (they are what the agent needs to see) with anything that
//! looks like an API key masked, since provider error messages sometimes quote the key they
//! rejected.

use std::borrow::Cow;

use serde_json::Value;

use crate::anthropic::{ErrorBody, ErrorType, StreamEvent};

/// Upstream text longer than this is cut: an HTML error page is noise, not a message.
const MAX_MESSAGE_CHARS: usize = 2000;

/// The Anthropic error type for an HTTP status.
pub fn error_type_for_status(status: u16) -> ErrorType {
    match status {
        401 => ErrorType::AuthenticationError,
        402 => ErrorType::BillingError,
        403 => ErrorType::PermissionError,
        404 => ErrorType::NotFoundError,
        413 => ErrorType::RequestTooLarge,
        429 => ErrorType::RateLimitError,
        504 => ErrorType::TimeoutError,
        529 => ErrorType::OverloadedError,
        500..=599 => ErrorType::ApiError,
        _ => ErrorType::InvalidRequestError,
    }
}

/// An Anthropic error body for `status` with the given message.
pub fn anthropic_error_for_status(status: u16, message: impl Into<String>) -> ErrorBody {
    ErrorBody::new(error_type_for_status(status), message)
}

/// Translates an upstream error response (status and raw body) into an Anthropic error body.
///
/// The message is taken from, in order: an Anthropic-shaped body (whose type is then kept),
/// `error.message`, `error` as a string, a top-level `message` (vLLM), `detail` (FastAPI), the
/// body as text, or a generic `upstream returned HTTP <status>`. A context-window overflow is
/// worded "prompt is too long: ..." because that phrase is what makes Claude Code compact the
/// conversation instead of failing the turn.
pub fn anthropic_error_from_openai(status: u16, body: &[u8]) -> ErrorBody {
    let parsed: Option<Value> = serde_json::from_slice(body).ok();
    if let Some(v) = &parsed
        && let Some(body) = anthropic_shaped(v)
    {
        return body;
    }
    let (message, code) = match &parsed {
        Some(v) => (message_from_value(v), code_from_value(v)),
        None => (None, None),
    };
    let message = message
        .or_else(|| {
            let text = String::from_utf8_lossy(body);
            let text = text.trim();
            (!text.is_empty()).then(|| text.to_owned())
        })
        .unwrap_or_else(|| format!("upstream returned HTTP {status}"));
    let mut message = finish_message(&message);
    if is_context_overflow(code.as_deref(), &message) && !message.starts_with("prompt is too long")
    {
        message = format!("prompt is too long: {message}");
    }
    anthropic_error_for_status(status, message)
}

/// What an Anthropic client should receive for an upstream error response: the status and
/// body. An Anthropic-shaped body keeps its status and type (the upstream speaks our client's
/// language); otherwise a 5xx becomes 502 (the upstream failed, not us) and a 4xx keeps its
/// status, with the body translated by [`anthropic_error_from_openai`]. 429's `retry-after` is
/// the caller's to copy.
pub fn client_error_for_upstream(status: u16, body: &[u8]) -> (u16, ErrorBody) {
    let anthropic = serde_json::from_slice::<Value>(body)
        .ok()
        .and_then(|v| anthropic_shaped(&v));
    if let Some(b) = anthropic {
        return (status, b);
    }
    let status = if (500..=599).contains(&status) {
        502
    } else {
        status
    };
    (status, anthropic_error_from_openai(status, body))
}

/// Translates the `error` object of a chunk (an error reported mid-stream, after a 200) into an
/// Anthropic `error` event.
pub fn stream_error_from_openai(error: &Value) -> StreamEvent {
    let message = message_from_value(&serde_json::json!({ "error": error }))
        .unwrap_or_else(|| "upstream reported an error mid-stream".to_owned());
    let kind = code_from_value(&serde_json::json!({ "error": error }))
        .and_then(|c| error_type_for_openai_code(&c))
        .unwrap_or(ErrorType::ApiError);
    StreamEvent::error(kind, finish_message(&message))
}

/// The `code` and `message` of a Responses `response.failed` error for the `error` object of a
/// chat chunk (an error reported mid-stream). A context overflow gets the code
/// `context_length_exceeded` whatever the upstream called it, since that code is what makes
/// Codex compact its history instead of retrying.
pub fn responses_error_from_openai(error: &Value) -> (String, String) {
    let wrapped = serde_json::json!({ "error": error });
    let message = message_from_value(&wrapped)
        .unwrap_or_else(|| "upstream reported an error mid-stream".to_owned());
    let code = code_from_value(&wrapped);
    let code = if is_context_overflow(code.as_deref(), &message) {
        "context_length_exceeded".to_owned()
    } else {
        code.unwrap_or_else(|| "server_error".to_owned())
    };
    (code, finish_message(&message))
}

/// The Anthropic error type for an OpenAI error `type` or `code` string, when one fits.
pub fn error_type_for_openai_code(code: &str) -> Option<ErrorType> {
    let code = code.to_ascii_lowercase();
    let kind = match code.as_str() {
        "invalid_request_error" | "context_length_exceeded" | "badrequesterror" => {
            ErrorType::InvalidRequestError
        }
        "authentication_error" | "invalid_api_key" => ErrorType::AuthenticationError,
        "permission_error" | "permission_denied" => ErrorType::PermissionError,
        "not_found_error" | "model_not_found" => ErrorType::NotFoundError,
        "rate_limit_error" | "rate_limit_exceeded" | "requests" | "tokens" => {
            ErrorType::RateLimitError
        }
        "insufficient_quota" | "billing_error" => ErrorType::BillingError,
        "timeout" | "timeout_error" => ErrorType::TimeoutError,
        "overloaded" | "overloaded_error" | "server_overloaded" | "service_unavailable" => {
            ErrorType::OverloadedError
        }
        "server_error" | "api_error" | "internal_error" | "internalservererror" => {
            ErrorType::ApiError
        }
        _ => return None,
    };
    Some(kind)
}

fn anthropic_shaped(v: &Value) -> Option<ErrorBody> {
    if v.get("type")?.as_str()? != "error" {
        return None;
    }
    let mut body: ErrorBody = serde_json::from_value(v.clone()).ok()?;
    body.error.message = finish_message(&body.error.message);
    Some(body)
}

fn message_from_value(v: &Value) -> Option<String> {
    let text = |v: &Value| -> Option<String> {
        match v {
            Value::String(s) if !s.trim().is_empty() => Some(s.clone()),
            Value::String(_) | Value::Null => None,
            Value::Array(items) => {
                // FastAPI validation errors: [{"loc": [...], "msg": "..."}].
                let msgs: Vec<String> = items
                    .iter()
                    .map(|i| match i.get("msg").and_then(Value::as_str) {
                        Some(m) => m.to_owned(),
                        None => i.to_string(),
                    })
                    .collect();
                (!msgs.is_empty()).then(|| msgs.join("; "))
            }
            Value::Bool(_) | Value::Number(_) | Value::Object(_) => Some(v.to_string()),
        }
    };
    if let Some(err) = v.get("error") {
        if let Some(m) = err.get("message").and_then(text) {
            return Some(m);
        }
        if let Some(m) = text(err) {
            return Some(m);
        }
    }
    v.get("message")
        .and_then(text)
        .or_else(|| v.get("detail").and_then(text))
}

fn code_from_value(v: &Value) -> Option<String> {
    let err = v.get("error").filter(|e| e.is_object()).unwrap_or(v);
    ["code", "type"].iter().find_map(|k| match err.get(*k) {
        Some(Value::String(s)) if !s.is_empty() => Some(s.clone()),
        Some(_) | None => None,
    })
}

fn is_context_overflow(code: Option<&str>, message: &str) -> bool {
    let lower = message.to_ascii_lowercase();
    // A max_tokens problem is not a long prompt: compacting would not help.
    if lower.contains("max_tokens") || lower.contains("max_completion_tokens") {
        return false;
    }
    code == Some("context_length_exceeded")
        || lower.contains("maximum context length")
        || lower.contains("context length exceeded")
        || lower.contains("longer than the model's context length")
        || lower.contains("prompt is too long")
}

fn finish_message(message: &str) -> String {
    let redacted = redact_secrets(message);
    match redacted.char_indices().nth(MAX_MESSAGE_CHARS) {
        Some((cut, _)) => format!("{}...", &redacted[..cut]),
        None => redacted.into_owned(),
    }
}

/// Masks what looks like a credential: `sk-...` style keys and the token after `Bearer `.
pub fn redact_secrets(text: &str) -> Cow<'_, str> {
    fn key_char(c: u8) -> bool {
        c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'*' | b'.')
    }
    let bytes = text.as_bytes();
    let mut out: Option<String> = None;
    let mut copied = 0;
    let mut i = 0;
    while i < bytes.len() {
        let (prefix_len, min_secret) =
            if bytes[i..].starts_with(b"sk-") && (i == 0 || !key_char(bytes[i - 1])) {
                (3, 8)
            } else if bytes[i..].starts_with(b"Bearer ") {
                (7, 1)
            } else {
                i += 1;
                continue;
            };
        let start = i + prefix_len;
        let mut end = start;
        while end < bytes.len() && key_char(bytes[end]) {
            end += 1;
        }
        if end - start >= min_secret {
            let o = out.get_or_insert_with(|| String::with_capacity(text.len()));
            o.push_str(&text[copied..start]);
            o.push_str("***");
            copied = end;
        }
        i = end.max(i + 1);
    }
    match out {
        Some(mut o) => {
            o.push_str(&text[copied..]);
            Cow::Owned(o)
        }
        None => Cow::Borrowed(text),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_table() {
        for (status, kind) in [
            (400, ErrorType::InvalidRequestError),
            (401, ErrorType::AuthenticationError),
            (403, ErrorType::PermissionError),
            (404, ErrorType::NotFoundError),
            (413, ErrorType::RequestTooLarge),
            (422, ErrorType::InvalidRequestError),
            (429, ErrorType::RateLimitError),
            (500, ErrorType::ApiError),
            (502, ErrorType::ApiError),
            (503, ErrorType::ApiError),
            (529, ErrorType::OverloadedError),
        ] {
            assert_eq!(error_type_for_status(status), kind, "{status}");
        }
    }

    #[test]
    fn keys_are_masked() {
        assert_eq!(
            redact_secrets("Incorrect API key provided: sk-proj-abcdEFGH1234. See"),
            "Incorrect API key provided: sk-*** See"
        );
        assert_eq!(redact_secrets("Bearer abc.def"), "Bearer ***");
        assert_eq!(redact_secrets("task-sk-1 is fine"), "task-sk-1 is fine");
        assert!(matches!(redact_secrets("nothing here"), Cow::Borrowed(_)));
    }

    #[test]
    fn body_shapes() {
        let b = anthropic_error_from_openai(502, b"<html>Bad Gateway</html>");
        assert_eq!(b.error.message, "<html>Bad Gateway</html>");
        assert_eq!(b.error.kind, ErrorType::ApiError);
        let b = anthropic_error_from_openai(503, b"");
        assert_eq!(b.error.message, "upstream returned HTTP 503");
        let b = anthropic_error_from_openai(
            400,
            br#"{"object":"error","message":"bad things","type":"BadRequestError","code":400}"#,
        );
        assert_eq!(b.error.message, "bad things");
        let b = anthropic_error_from_openai(
            422,
            br#"{"detail":[{"loc":["body"],"msg":"field required"}]}"#,
        );
        assert_eq!(b.error.message, "field required");
        let b = anthropic_error_from_openai(
            529,
            br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
        );
        assert_eq!(b.error.kind, ErrorType::OverloadedError);
    }
}
