//! What the router's answers mean for a turn, and what the agent gets when the router fails:
//! the reference's classifiers (context overflow, rollout invalidated), the failed-upstream
//! record, the synthetic empty answers that replace an invalidated generation, the error
//! bodies an Anthropic client gets, and the keepalive prelude of a pseudo-streamed answer.
//!
//! The router is the rollout manager's own infrastructure, trusted like the config: its error
//! bodies reach the agent (previewed), as in the reference, so the agent and the turn's error
//! say what really failed.

use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures_util::StreamExt;
use serde_json::{Map, Value, json};

use agentbox_llm::body::{BodyError, UpstreamStream};

use super::state::Snapshot;

/// The Dressage router's error codes that mean "this generation no longer counts": the
/// rollout was preempted or went stale.
const ROLLOUT_INVALIDATED: [&str; 3] = [
    "generation_preempted",
    "partial_rollout_staleness_exceeded",
    "trajectory_version_changed",
];

/// The most of a stream's prelude (keepalive comments before the first real frame) that is
/// buffered while looking for that frame; past it the stream is forwarded as is.
const MAX_PRELUDE: usize = 1 << 20;

/// A body for logs and messages, as the reference previews it: text up to `limit` characters
/// (`...(truncated)` after), or `<N bytes binary; hex=…>` for bytes that are not text.
pub fn preview(body: &[u8], limit: usize) -> String {
    if body.is_empty() {
        return String::new();
    }
    let hex_limit = limit.min(96);
    let binary = || {
        let hex: String = body[..body.len().min(hex_limit)]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let suffix = if body.len() > hex_limit {
            "...(truncated)"
        } else {
            ""
        };
        format!("<{} bytes binary; hex={hex}{suffix}>", body.len())
    };
    let Ok(text) = std::str::from_utf8(body) else {
        return binary();
    };
    let sample: Vec<char> = text.chars().take(limit).collect();
    let control = sample
        .iter()
        .filter(|c| (**c as u32) < 32 && !matches!(c, '\n' | '\r' | '\t'))
        .count();
    if control > 8.max(sample.len() / 10) {
        return binary();
    }
    if text.chars().count() <= limit {
        text.to_owned()
    } else {
        let mut s: String = sample.into_iter().collect();
        s.push_str("...(truncated)");
        s
    }
}

/// Python's truthiness, for `payload.get("code") or payload.get("error")`.
fn code_or_error(m: &Map<String, Value>) -> Option<&str> {
    let truthy = |v: &&Value| match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::String(s) => !s.is_empty(),
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    };
    m.get("code")
        .filter(truthy)
        .or_else(|| m.get("error"))
        .and_then(Value::as_str)
}

/// The router's 413 `context_overflow` body, recorded whole for the core.
pub fn context_overflow(status: u16, body: &[u8]) -> Option<Value> {
    if status != 413 {
        return None;
    }
    let v: Value = serde_json::from_slice(body).ok()?;
    let m = v.as_object()?;
    (code_or_error(m) == Some("context_overflow")).then_some(v)
}

/// The router's 502 "rollout invalidated" error (its `detail` object when it has one).
pub fn rollout_invalidated(status: u16, body: &[u8]) -> Option<Value> {
    if status != 502 {
        return None;
    }
    let v: Value = serde_json::from_slice(body).ok()?;
    let m = v.as_object()?;
    let candidate = match m.get("detail") {
        Some(Value::Object(d)) => d,
        Some(_) | None => m,
    };
    let code = code_or_error(candidate)?;
    ROLLOUT_INVALIDATED
        .contains(&code)
        .then(|| Value::Object(candidate.clone()))
}

/// The turn's failed-upstream record.
pub fn failed_upstream(snapshot: &Snapshot, url: &str, status: u16, body: &[u8]) -> Value {
    let p = preview(body, 1000);
    let message = if p.is_empty() {
        format!("Upstream returned HTTP {status}")
    } else {
        format!("Upstream returned HTTP {status}: {p}")
    };
    json!({
        "error": "upstream_request_failed",
        "message": message,
        "status_code": status,
        "upstream_url": url,
        "turn_id": snapshot.turn_id,
        "step": snapshot.step,
    })
}

/// The turn's failed-upstream record for a call that got no answer at all.
pub fn unreachable_upstream(snapshot: &Snapshot, url: &str, status: u16, what: &str) -> Value {
    json!({
        "error": "upstream_request_failed",
        "message": format!("Upstream request failed: {what}"),
        "status_code": status,
        "upstream_url": url,
        "turn_id": snapshot.turn_id,
        "step": snapshot.step,
    })
}

fn json_response(status: StatusCode, body: &Value) -> Response {
    let mut resp = Response::new(Body::from(body.to_string()));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

fn sse_response(frames: Vec<u8>) -> Response {
    let mut resp = Response::new(Body::from(frames));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    resp
}

fn sse_frame(out: &mut Vec<u8>, event: Option<&str>, data: &Value) {
    if let Some(e) = event {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(e.as_bytes());
        out.push(b'\n');
    }
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(data.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

/// Which synthetic empty answer replaces an invalidated generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synthetic {
    Chat,
    Anthropic,
    Responses,
}

/// An empty, successful answer (the reference's): the agent ends its step quietly and the core
/// reports the invalidation from the recorded error.
pub fn synthetic(kind: Synthetic, stream: bool) -> Response {
    let zero_usage = json!({"input_tokens": 0, "output_tokens": 0, "total_tokens": 0});
    match (kind, stream) {
        (Synthetic::Chat, false) => json_response(
            StatusCode::OK,
            &json!({
                "id": "chatcmpl-rollout-invalidated", "object": "chat.completion", "created": 0,
                "model": "proxy-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": ""},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
            }),
        ),
        (Synthetic::Chat, true) => {
            let mut out = Vec::new();
            sse_frame(
                &mut out,
                None,
                &json!({
                    "id": "chatcmpl-rollout-invalidated", "object": "chat.completion.chunk",
                    "created": 0, "model": "proxy-model",
                    "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                 "finish_reason": "stop"}],
                }),
            );
            out.extend_from_slice(b"data: [DONE]\n\n");
            sse_response(out)
        }
        (Synthetic::Anthropic, false) => json_response(
            StatusCode::OK,
            &json!({
                "id": "msg_rollout_invalidated", "type": "message", "role": "assistant",
                "model": "proxy-model", "content": [{"type": "text", "text": ""}],
                "stop_reason": "end_turn", "stop_sequence": null,
                "usage": {"input_tokens": 0, "output_tokens": 0},
            }),
        ),
        (Synthetic::Anthropic, true) => {
            let mut out = Vec::new();
            sse_frame(
                &mut out,
                Some("message_start"),
                &json!({"type": "message_start", "message": {
                    "id": "msg_rollout_invalidated", "type": "message", "role": "assistant",
                    "model": "proxy-model", "content": [], "stop_reason": null,
                    "stop_sequence": null, "usage": {"input_tokens": 0, "output_tokens": 0}}}),
            );
            sse_frame(
                &mut out,
                Some("message_delta"),
                &json!({"type": "message_delta",
                        "delta": {"stop_reason": "end_turn", "stop_sequence": null},
                        "usage": {"output_tokens": 0}}),
            );
            sse_frame(
                &mut out,
                Some("message_stop"),
                &json!({"type": "message_stop"}),
            );
            sse_response(out)
        }
        (Synthetic::Responses, false) => json_response(
            StatusCode::OK,
            &json!({
                "id": "resp-rollout-invalidated", "object": "response", "status": "completed",
                "model": "proxy-model",
                "output": [{"type": "message", "role": "assistant",
                            "content": [{"type": "output_text", "text": ""}]}],
                "usage": zero_usage,
            }),
        ),
        (Synthetic::Responses, true) => {
            let id = "resp-rollout-invalidated";
            let item_id = "msg_proxy_stream";
            let message = |status: &str| {
                json!({"id": item_id, "type": "message", "status": status, "role": "assistant",
                       "content": if status == "completed" {
                           json!([{"type": "output_text", "text": ""}])
                       } else { json!([]) }})
            };
            let response = |status: &str, output: Value, usage: Value| {
                json!({"id": id, "object": "response", "status": status,
                       "model": "proxy-model", "output": output, "usage": usage})
            };
            let part = json!({"type": "output_text", "text": ""});
            let mut out = Vec::new();
            let events = [
                json!({"type": "response.created",
                       "response": response("in_progress", json!([]), Value::Null)}),
                json!({"type": "response.output_item.added", "output_index": 0,
                       "item": message("in_progress")}),
                json!({"type": "response.content_part.added", "item_id": item_id,
                       "output_index": 0, "content_index": 0, "part": part}),
                json!({"type": "response.output_text.done", "item_id": item_id,
                       "output_index": 0, "content_index": 0, "text": ""}),
                json!({"type": "response.content_part.done", "item_id": item_id,
                       "output_index": 0, "content_index": 0, "part": part}),
                json!({"type": "response.output_item.done", "item_id": item_id,
                       "output_index": 0, "item": message("completed")}),
                json!({"type": "response.completed",
                       "response": response("completed", json!([message("completed")]),
                                            zero_usage)}),
            ];
            for e in &events {
                sse_frame(&mut out, e["type"].as_str(), e);
            }
            sse_response(out)
        }
    }
}

/// An upstream error for an Anthropic client. A 5xx becomes a 400 `upstream_error` (the
/// reference's "non-retry" answer: Claude Code retries 5xx for minutes, while the turn should
/// end and report); a 4xx keeps its status with the router's message in Anthropic's shape.
pub fn anthropic_error(status: u16, body: &[u8]) -> Response {
    if (500..600).contains(&status) {
        let p = preview(body, 1000);
        let message = if p.is_empty() {
            format!("Upstream returned HTTP {status}")
        } else {
            format!("Upstream returned HTTP {status}: {p}")
        };
        return json_response(
            StatusCode::BAD_REQUEST,
            &json!({"type": "error", "error": {"type": "upstream_error", "message": message}}),
        );
    }
    let mut message = if body.is_empty() {
        "Upstream error.".to_owned()
    } else {
        preview(body, 1000)
    };
    let mut kind = "api_error".to_owned();
    if let Ok(Value::Object(m)) = serde_json::from_slice::<Value>(body) {
        match m.get("error") {
            Some(Value::Object(e)) => {
                if let Some(msg) = e.get("message").filter(|v| !v.is_null()) {
                    message = value_text(msg);
                }
                if let Some(t) = e
                    .get("type")
                    .filter(|v| !v.is_null())
                    .or_else(|| e.get("code").filter(|v| !v.is_null()))
                {
                    kind = value_text(t);
                }
            }
            Some(_) | None => {
                if let Some(msg) = m.get("message").filter(|v| !v.is_null()) {
                    message = value_text(msg);
                }
            }
        }
    }
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    json_response(
        status,
        &json!({"type": "error", "error": {"type": kind, "message": message}}),
    )
}

fn value_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other @ (Value::Null
        | Value::Bool(_)
        | Value::Number(_)
        | Value::Array(_)
        | Value::Object(_)) => other.to_string(),
    }
}

/// The router's error answer passed to an OpenAI client as it came (status, body, content
/// type), as the reference does.
pub fn passthrough_error(status: u16, body: Bytes, content_type: Option<HeaderValue>) -> Response {
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY);
    if let Some(ct) = content_type {
        resp.headers_mut().insert(header::CONTENT_TYPE, ct);
    }
    resp
}

/// What the start of a streamed answer turned out to be.
pub enum Prelude {
    /// A real stream: `head` (its first real frame and whatever came with it) then `rest`.
    Stream { head: Bytes, rest: UpstreamStream },
    /// The first real frame was an error the router could only report after committing to a
    /// 200 (keepalives went first): its status and the body a plain error would have carried.
    Error { status: u16, body: Bytes },
}

/// Drops the keepalive comment frames (`: dressage-heartbeat`) a pseudo-streaming router sends
/// before the first real frame, and recovers a late error from that frame. Everything from the
/// first real frame on is forwarded verbatim. A stream of nothing but keepalives is an empty
/// stream.
pub async fn prelude(mut up: UpstreamStream) -> Result<Prelude, BodyError> {
    let mut buf: Vec<u8> = Vec::new();
    let mut consumed = 0;
    loop {
        while let Some((frame_end, next)) = frame_boundary(&buf[consumed..]) {
            let frame = &buf[consumed..consumed + frame_end];
            if is_comment_only(frame) {
                consumed += next;
                continue;
            }
            if let Some((status, body)) = sniff_error(frame) {
                return Ok(Prelude::Error { status, body });
            }
            let head = Bytes::from(buf.split_off(consumed));
            return Ok(Prelude::Stream { head, rest: up });
        }
        if buf.len() - consumed > MAX_PRELUDE {
            let head = Bytes::from(buf.split_off(consumed));
            return Ok(Prelude::Stream { head, rest: up });
        }
        match up.next().await {
            Some(chunk) => buf.extend_from_slice(&chunk?),
            None => {
                let head = Bytes::from(buf.split_off(consumed));
                return Ok(Prelude::Stream {
                    head,
                    rest: Box::pin(futures_util::stream::empty()),
                });
            }
        }
    }
}

/// The end of the first SSE frame in `b` (before its blank line) and where the next begins.
fn frame_boundary(b: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < b.len() {
        let nl = match b[i] {
            b'\n' => 1,
            b'\r' if b.get(i + 1) == Some(&b'\n') => 2,
            b'\r' => 1,
            _ => {
                i += 1;
                continue;
            }
        };
        let j = i + nl;
        let blank = match b.get(j) {
            Some(b'\n') => Some(1),
            Some(b'\r') if b.get(j + 1) == Some(&b'\n') => Some(2),
            Some(b'\r') if j + 1 < b.len() => Some(1),
            // `\r` at the very end may be the start of `\r\n`: wait for more.
            Some(_) | None => None,
        };
        if let Some(n) = blank {
            return Some((i, j + n));
        }
        i = j;
    }
    None
}

fn is_comment_only(frame: &[u8]) -> bool {
    frame
        .split(|&c| c == b'\n' || c == b'\r')
        .filter(|l| !l.is_empty())
        .all(|l| l.starts_with(b":"))
}

/// A first frame `data: {"error": {..., "status_code": N}}` with N in 400..=599.
fn sniff_error(frame: &[u8]) -> Option<(u16, Bytes)> {
    // The first frame of every stream comes here: one that names no `error` member is not
    // parsed into a tree.
    if !super::may_name(frame, &[b"\"error\""]) {
        return None;
    }
    let text = std::str::from_utf8(frame).ok()?;
    let data: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("data:"))
        .map(str::trim)
        .collect();
    if data.is_empty() {
        return None;
    }
    let payload = data.join("\n");
    let v: Value = serde_json::from_str(&payload).ok()?;
    let err = v.get("error")?.as_object()?;
    let status = err.get("status_code")?.as_u64()?;
    let status = u16::try_from(status)
        .ok()
        .filter(|s| (400..=599).contains(s))?;
    Some((status, Bytes::from(Value::Object(err.clone()).to_string())))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::panic)]

    use super::*;

    const HEARTBEAT: &[u8] = b": dressage-heartbeat\n\n";

    fn stream(chunks: Vec<&'static [u8]>) -> UpstreamStream {
        Box::pin(futures_util::stream::iter(
            chunks
                .into_iter()
                .map(|c| Ok::<_, BodyError>(Bytes::from_static(c))),
        ))
    }

    async fn forwarded(chunks: Vec<&'static [u8]>) -> Vec<u8> {
        match prelude(stream(chunks)).await.unwrap() {
            Prelude::Stream { head, mut rest } => {
                let mut out = head.to_vec();
                while let Some(c) = rest.next().await {
                    out.extend_from_slice(&c.unwrap());
                }
                out
            }
            Prelude::Error { status, .. } => panic!("error {status}"),
        }
    }

    #[tokio::test]
    async fn heartbeats_are_dropped_and_the_rest_is_verbatim() {
        let real: &[u8] =
            b"data: {\"id\":\"c\",\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n";
        let out = forwarded(vec![HEARTBEAT, HEARTBEAT, real, b"data: [DONE]\n\n"]).await;
        assert_eq!(out, [real, b"data: [DONE]\n\n"].concat());
        // Split and glued across chunks.
        let out = forwarded(vec![
            b": dressage-",
            b"heartbeat\n\n: dressage-heartbeat\n\ndata: {\"a\"",
            b":1}\n\ndata: [DONE]\n\n",
        ])
        .await;
        assert_eq!(out, b"data: {\"a\":1}\n\ndata: [DONE]\n\n");
        // Every comment frame, and \r\n framing.
        let out = forwarded(vec![HEARTBEAT, b": other\r\n\r\n", b"data: [DONE]\n\n"]).await;
        assert_eq!(out, b"data: [DONE]\n\n");
        assert!(forwarded(vec![HEARTBEAT, HEARTBEAT]).await.is_empty());
    }

    #[tokio::test]
    async fn a_late_error_gets_its_status_back() {
        let err: &[u8] = b"data: {\"error\":{\"type\":\"dressage_proxy_error\",\"code\":\"context_overflow\",\"message\":\"m\",\"status_code\":413}}\n\n";
        match prelude(stream(vec![HEARTBEAT, err, b"data: [DONE]\n\n"]))
            .await
            .unwrap()
        {
            Prelude::Error { status, body } => {
                assert_eq!(status, 413);
                let v: Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(v["code"], "context_overflow");
                assert!(context_overflow(status, &body).is_some());
            }
            Prelude::Stream { .. } => panic!("not sniffed"),
        }
        // An error without a status code in range is just a frame.
        let other: &[u8] = b"data: {\"error\":{\"message\":\"m\",\"status_code\":200}}\n\n";
        assert!(!forwarded(vec![other]).await.is_empty());
    }

    #[test]
    fn classifiers_follow_the_reference() {
        let body = br#"{"detail":{"error":"generation_preempted","message":"stale"}}"#;
        assert_eq!(
            rollout_invalidated(502, body).unwrap(),
            json!({"error":"generation_preempted","message":"stale"})
        );
        assert!(rollout_invalidated(500, body).is_none());
        let body =
            br#"{"detail":{"error":"partial_rollout_staleness_exceeded","versions":["v1"]}}"#;
        assert_eq!(
            rollout_invalidated(502, body).unwrap()["versions"],
            json!(["v1"])
        );
        assert!(rollout_invalidated(502, br#"{"error":"other"}"#).is_none());
        let body =
            br#"{"error":"context_overflow","message":"too long","details":{"context_window":8}}"#;
        assert_eq!(
            context_overflow(413, body).unwrap()["details"]["context_window"],
            8
        );
        assert!(context_overflow(400, body).is_none());
        assert!(context_overflow(413, br#"{"code":"other","error":"context_overflow"}"#).is_none());
        assert!(context_overflow(413, br#"{"code":"","error":"context_overflow"}"#).is_some());
    }

    #[test]
    fn previews_cut_text_and_show_binary_as_hex() {
        assert_eq!(preview(b"boom", 1000), "boom");
        assert_eq!(preview(b"abcdef", 3), "abc...(truncated)");
        let p = preview(b"\x8b\xffcompressed-error-body", 1000);
        assert!(p.starts_with("<23 bytes binary; hex=8bff"), "{p}");
        assert!(!p.contains('\u{fffd}'));
        assert_eq!(preview(b"", 10), "");
    }

    #[tokio::test]
    async fn anthropic_clients_get_a_non_retry_400_for_5xx() {
        let r = anthropic_error(502, b"\x8b\xffcompressed");
        assert_eq!(r.status(), StatusCode::BAD_REQUEST);
        let body = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["type"], "upstream_error");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.contains("HTTP 502") && m.contains("binary; hex="), "{m}");
        let r = anthropic_error(
            429,
            br#"{"error":{"message":"slow down","type":"rate_limit_error"}}"#,
        );
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        let body = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(
            v,
            json!({"type":"error","error":{"type":"rate_limit_error","message":"slow down"}})
        );
    }
}
