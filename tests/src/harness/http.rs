//! HTTP helpers for tests: one HTTP/1.1 exchange over a unix socket (reqwest only does TCP),
//! and a small SSE parser that keeps each frame's `event:` name so tests can check framing.

use std::collections::BTreeMap;
use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;

use super::HarnessError;

/// A response read to the end over a unix socket.
#[derive(Debug, Clone)]
pub struct UnixResponse {
    /// Status code.
    pub status: u16,
    /// Header names (lowercase) to values; repeats joined by `", "`.
    pub headers: BTreeMap<String, String>,
    /// The whole body.
    pub body: Bytes,
}

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
    let fail = |message: String| HarnessError::UnixHttp {
        socket: socket.to_path_buf(),
        message,
    };
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| fail(format!("connect: {e}")))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| fail(format!("handshake: {e}")))?;
    let driver = tokio::spawn(conn);
    let mut builder = hyper::Request::builder().method(method).uri(path);
    if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("host")) {
        builder = builder.header("host", "localhost");
    }
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let request = builder
        .body(Full::new(body.into()))
        .map_err(|e| fail(format!("building the request: {e}")))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|e| fail(format!("sending: {e}")))?;
    let status = response.status().as_u16();
    let mut map: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in response.headers() {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        map.entry(name.as_str().to_owned())
            .and_modify(|v| {
                v.push_str(", ");
                v.push_str(&value);
            })
            .or_insert(value);
    }
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| fail(format!("reading the body: {e}")))?
        .to_bytes();
    driver.abort();
    Ok(UnixResponse {
        status,
        headers: map,
        body,
    })
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
