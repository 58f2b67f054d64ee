//! HTTP helpers for tests: one exchange over a unix socket (reqwest only does TCP) through
//! `agentbox-api`'s client, and a small SSE parser that keeps each frame's `event:` name so
//! tests can check framing.

use std::path::Path;

use agentbox_api::UnixClient;
use bytes::Bytes;

use super::HarnessError;

/// A response read to the end over a unix socket.
pub use agentbox_api::RawResponse as UnixResponse;

/// Sends one request over the unix socket at `socket` and reads the whole response. The
/// `host` header is set to `localhost` unless given.
///
/// # Errors
/// When connecting, sending or reading fails (including a connection dropped mid-body).
pub async fn unix_request(
    socket: &Path,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Result<UnixResponse, HarnessError> {
    Ok(UnixClient::new(socket)
        .with_timeout(None)
        .raw(method, path, headers, body)
        .await?)
}

/// [`unix_request`] with an optional JSON body (`content-type: application/json`): the control
/// sockets' calling convention.
///
/// # Errors
/// When the exchange fails.
pub async fn unix_json(
    socket: &Path,
    method: &str,
    path: &str,
    body: Option<&serde_json::Value>,
) -> Result<UnixResponse, HarnessError> {
    let bytes = body.map(|b| b.to_string()).unwrap_or_default();
    unix_request(
        socket,
        method,
        path,
        &[("content-type", "application/json")],
        bytes,
    )
    .await
}

/// One SSE frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SseFrame {
    /// The `event:` name, if the frame had one.
    pub event: Option<String>,
    /// The `data:` lines joined by `\n`.
    pub data: String,
}

/// Splits an SSE body into frames (blank-line separated; `\r\n` accepted; comments skipped).
#[must_use]
pub fn parse_sse(body: &str) -> Vec<SseFrame> {
    let body = body.replace("\r\n", "\n");
    body.split("\n\n")
        .filter_map(|block| {
            let mut event = None;
            let mut data: Vec<&str> = Vec::new();
            for line in block.lines() {
                if let Some(v) = line.strip_prefix("event:") {
                    event = Some(v.trim_start().to_owned());
                } else if let Some(v) = line.strip_prefix("data:") {
                    data.push(v.strip_prefix(' ').unwrap_or(v));
                }
            }
            (event.is_some() || !data.is_empty()).then(|| SseFrame {
                event,
                data: data.join("\n"),
            })
        })
        .collect()
}

/// `GET url` (plain HTTP), its body as JSON.
///
/// # Errors
/// When the request fails or the body is not JSON.
pub async fn get_json(url: &str) -> Result<serde_json::Value, reqwest::Error> {
    reqwest::get(url).await?.json().await
}

/// `key` of every object in the JSON array `array`, as strings. An assertion helper: panics
/// when `array` is not an array or a `key` is not a string.
#[must_use]
#[allow(clippy::unwrap_used, clippy::expect_used)]
pub fn strs<'a>(array: &'a serde_json::Value, key: &str) -> Vec<&'a str> {
    let items = array.as_array().expect("an array");
    items
        .iter()
        .map(|v| {
            v[key]
                .as_str()
                .unwrap_or_else(|| panic!("{key} of {v} is not a string"))
        })
        .collect()
}

/// The text of a complete Anthropic answer, streamed (SSE ending in `message_stop`, the text
/// deltas joined) or whole (its text blocks joined); `None` for anything else.
#[must_use]
pub fn anthropic_text(body: &str) -> Option<String> {
    let frames = parse_sse(body);
    if frames.is_empty() {
        let v: serde_json::Value = serde_json::from_str(body).ok()?;
        let blocks = v["content"].as_array()?;
        return Some(blocks.iter().filter_map(|b| b["text"].as_str()).collect());
    }
    if frames.last()?.event.as_deref() != Some("message_stop") {
        return None;
    }
    let mut out = String::new();
    for f in &frames {
        let v: serde_json::Value = serde_json::from_str(&f.data).ok()?;
        if let Some(t) = v["delta"]["text"].as_str() {
            out.push_str(t);
        }
    }
    Some(out)
}
