//! Renders one scripted [`Entry`] as an Anthropic Messages or OpenAI Chat Completions reply,
//! streamed (a list of complete SSE frames) or whole, and shapes error bodies per API.
//!
//! Streams are built up front as a list of frames so fault injection can count them, and so
//! each frame goes out as one write.

use bytes::Bytes;
use serde_json::{Value, json};

use super::script::{Entry, StopReason, Usage};

/// Ids and names fixed for one reply.
#[derive(Debug, Clone)]
pub struct ReplyMeta {
    /// Message / completion id.
    pub id: String,
    /// Model named in the reply.
    pub model: String,
    /// One id per scripted tool call.
    pub tool_ids: Vec<String>,
    /// Usage to report.
    pub usage: Usage,
    /// Unix seconds, for OpenAI's `created`.
    pub created: u64,
}

/// The stop reason an entry ends with.
#[must_use]
pub fn stop_reason(entry: &Entry) -> StopReason {
    entry.stop_reason.unwrap_or(if entry.tool_calls.is_empty() {
        StopReason::EndTurn
    } else {
        StopReason::ToolUse
    })
}

/// Deterministic usage when the script gives none: a bytes/4 estimate, never 0.
#[must_use]
pub fn estimate_usage(entry: &Entry, request_bytes: usize) -> Usage {
    let out_bytes = entry.text.as_deref().map_or(0, str::len)
        + entry.thinking.as_deref().map_or(0, str::len)
        + entry
            .tool_calls
            .iter()
            .map(|t| t.name.len() + t.input.to_string().len())
            .sum::<usize>();
    Usage {
        input_tokens: estimate_tokens(request_bytes),
        output_tokens: estimate_tokens(out_bytes),
        cache_read_input_tokens: None,
        cache_creation_input_tokens: None,
    }
}

/// bytes / 4, at least 1.
#[must_use]
pub fn estimate_tokens(bytes: usize) -> u64 {
    u64::try_from(bytes / 4).unwrap_or(u64::MAX).max(1)
}

/// Splits `s` into at most three pieces on char boundaries, so clients must reassemble deltas.
#[must_use]
pub fn split_pieces(s: &str) -> Vec<&str> {
    let chars = s.chars().count();
    if chars < 2 {
        return vec![s];
    }
    let per = chars.div_ceil(3).max(1);
    let mut pieces = Vec::new();
    let mut start = 0;
    for (n, (i, _)) in s.char_indices().enumerate() {
        if n > 0 && n % per == 0 {
            pieces.push(&s[start..i]);
            start = i;
        }
    }
    pieces.push(&s[start..]);
    pieces
}

fn thinking_signature(entry: &Entry) -> String {
    entry
        .signature
        .clone()
        .unwrap_or_else(|| "fakellm-signature".to_owned())
}

// ---------------------------------------------------------------------------------------------
// Anthropic

fn anthropic_usage(u: &Usage) -> Value {
    json!({
        "input_tokens": u.input_tokens,
        "cache_creation_input_tokens": u.cache_creation_input_tokens.unwrap_or(0),
        "cache_read_input_tokens": u.cache_read_input_tokens.unwrap_or(0),
        "output_tokens": u.output_tokens,
    })
}

/// A whole Anthropic `Message`.
#[must_use]
pub fn anthropic_message(entry: &Entry, meta: &ReplyMeta) -> Value {
    let mut content = Vec::new();
    if let Some(thinking) = &entry.thinking {
        content.push(json!({
            "type": "thinking", "thinking": thinking, "signature": thinking_signature(entry)
        }));
    }
    if let Some(text) = entry.text.as_deref().filter(|t| !t.is_empty()) {
        content.push(json!({"type": "text", "text": text}));
    }
    for (call, id) in entry.tool_calls.iter().zip(&meta.tool_ids) {
        content.push(json!({"type": "tool_use", "id": id, "name": call.name, "input": call.input}));
    }
    json!({
        "id": meta.id,
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        "stop_reason": stop_reason(entry).anthropic(),
        "stop_sequence": null,
        "usage": anthropic_usage(&meta.usage),
    })
}

fn sse(event: &str, data: &Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// The complete Anthropic SSE stream for an entry, one frame per element.
#[must_use]
pub fn anthropic_events(entry: &Entry, meta: &ReplyMeta) -> Vec<Bytes> {
    let u = &meta.usage;
    // Like the real API, message_start reports the prompt side and a token or so of output;
    // the cumulative figures come in message_delta.
    let start_usage = Usage {
        output_tokens: u.output_tokens.min(1),
        ..*u
    };
    let mut events = vec![
        sse(
            "message_start",
            &json!({"type": "message_start", "message": {
                "id": meta.id, "type": "message", "role": "assistant", "model": meta.model,
                "content": [], "stop_reason": null, "stop_sequence": null,
                "usage": anthropic_usage(&start_usage),
            }}),
        ),
        sse("ping", &json!({"type": "ping"})),
    ];
    let mut index = 0_usize;
    let mut block = |events: &mut Vec<Bytes>, start: Value, deltas: Vec<Value>| {
        events.push(sse(
            "content_block_start",
            &json!({"type": "content_block_start", "index": index, "content_block": start}),
        ));
        for delta in deltas {
            events.push(sse(
                "content_block_delta",
                &json!({"type": "content_block_delta", "index": index, "delta": delta}),
            ));
        }
        events.push(sse(
            "content_block_stop",
            &json!({"type": "content_block_stop", "index": index}),
        ));
        index += 1;
    };
    if let Some(thinking) = &entry.thinking {
        let mut deltas: Vec<Value> = split_pieces(thinking)
            .into_iter()
            .map(|p| json!({"type": "thinking_delta", "thinking": p}))
            .collect();
        deltas.push(json!({"type": "signature_delta", "signature": thinking_signature(entry)}));
        block(
            &mut events,
            json!({"type": "thinking", "thinking": "", "signature": ""}),
            deltas,
        );
    }
    if let Some(text) = entry.text.as_deref().filter(|t| !t.is_empty()) {
        let deltas = split_pieces(text)
            .into_iter()
            .map(|p| json!({"type": "text_delta", "text": p}))
            .collect();
        block(&mut events, json!({"type": "text", "text": ""}), deltas);
    }
    for (call, id) in entry.tool_calls.iter().zip(&meta.tool_ids) {
        let args = call.input.to_string();
        let deltas = split_pieces(&args)
            .into_iter()
            .map(|p| json!({"type": "input_json_delta", "partial_json": p}))
            .collect();
        block(
            &mut events,
            json!({"type": "tool_use", "id": id, "name": call.name, "input": {}}),
            deltas,
        );
    }
    events.push(sse(
        "message_delta",
        &json!({
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason(entry).anthropic(), "stop_sequence": null},
            "usage": anthropic_usage(u),
        }),
    ));
    events.push(sse("message_stop", &json!({"type": "message_stop"})));
    events
}

/// The Anthropic error type the real API uses for `status`.
#[must_use]
pub fn anthropic_error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        504 => "timeout_error",
        529 => "overloaded_error",
        s if s >= 500 => "api_error",
        _ => "invalid_request_error",
    }
}

/// `{"type":"error","error":{"type":…,"message":…}}`.
#[must_use]
pub fn anthropic_error_body(kind: &str, message: &str) -> Value {
    json!({"type": "error", "error": {"type": kind, "message": message}})
}

/// An Anthropic in-stream `event: error` frame.
#[must_use]
pub fn anthropic_error_event(kind: &str, message: &str) -> Bytes {
    sse("error", &anthropic_error_body(kind, message))
}

// ---------------------------------------------------------------------------------------------
// OpenAI

fn openai_usage(u: &Usage) -> Value {
    let read = u.cache_read_input_tokens.unwrap_or(0);
    let prompt = u.input_tokens + read + u.cache_creation_input_tokens.unwrap_or(0);
    let mut usage = json!({
        "prompt_tokens": prompt,
        "completion_tokens": u.output_tokens,
        "total_tokens": prompt + u.output_tokens,
    });
    if let (Some(cached), Some(obj)) = (u.cache_read_input_tokens, usage.as_object_mut()) {
        obj.insert(
            "prompt_tokens_details".to_owned(),
            json!({"cached_tokens": cached}),
        );
    }
    usage
}

/// A whole `chat.completion`.
#[must_use]
pub fn openai_completion(entry: &Entry, meta: &ReplyMeta) -> Value {
    let text = entry.text.as_deref().filter(|t| !t.is_empty());
    let mut message = json!({"role": "assistant", "content": text});
    if let Some(obj) = message.as_object_mut() {
        if let Some(thinking) = &entry.thinking {
            obj.insert("reasoning_content".to_owned(), json!(thinking));
        }
        if !entry.tool_calls.is_empty() {
            let calls: Vec<Value> = entry
                .tool_calls
                .iter()
                .zip(&meta.tool_ids)
                .map(|(c, id)| {
                    json!({"id": id, "type": "function",
                           "function": {"name": c.name, "arguments": c.input.to_string()}})
                })
                .collect();
            obj.insert("tool_calls".to_owned(), Value::Array(calls));
        }
    }
    json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": null,
        "choices": [{
            "index": 0, "message": message, "logprobs": null,
            "finish_reason": stop_reason(entry).openai(),
        }],
        "usage": openai_usage(&meta.usage),
    })
}

fn data(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// The complete OpenAI chunk stream for an entry, ending in `data: [DONE]`.
#[must_use]
pub fn openai_chunks(entry: &Entry, meta: &ReplyMeta, include_usage: bool) -> Vec<Bytes> {
    let chunk = |delta: Value, finish: Option<&str>| {
        let mut c = json!({
            "id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
            "model": meta.model, "system_fingerprint": null,
            "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish}],
        });
        if include_usage && let Some(obj) = c.as_object_mut() {
            obj.insert("usage".to_owned(), Value::Null);
        }
        data(&c)
    };
    let mut out = vec![chunk(json!({"role": "assistant", "content": ""}), None)];
    if let Some(thinking) = &entry.thinking {
        for p in split_pieces(thinking) {
            out.push(chunk(json!({"reasoning_content": p}), None));
        }
    }
    if let Some(text) = entry.text.as_deref().filter(|t| !t.is_empty()) {
        for p in split_pieces(text) {
            out.push(chunk(json!({"content": p}), None));
        }
    }
    for (i, (call, id)) in entry.tool_calls.iter().zip(&meta.tool_ids).enumerate() {
        out.push(chunk(
            json!({"tool_calls": [{"index": i, "id": id, "type": "function",
                                   "function": {"name": call.name, "arguments": ""}}]}),
            None,
        ));
        let args = call.input.to_string();
        for p in split_pieces(&args) {
            out.push(chunk(
                json!({"tool_calls": [{"index": i, "function": {"arguments": p}}]}),
                None,
            ));
        }
    }
    out.push(chunk(json!({}), Some(stop_reason(entry).openai())));
    if include_usage {
        out.push(data(&json!({
            "id": meta.id, "object": "chat.completion.chunk", "created": meta.created,
            "model": meta.model, "system_fingerprint": null, "choices": [],
            "usage": openai_usage(&meta.usage),
        })));
    }
    out.push(Bytes::from_static(b"data: [DONE]\n\n"));
    out
}

/// The OpenAI error type commonly used for `status`.
#[must_use]
pub fn openai_error_type(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        429 => "rate_limit_error",
        s if s >= 500 => "server_error",
        _ => "invalid_request_error",
    }
}

/// `{"error":{"message":…,"type":…,"param":…,"code":…}}`.
#[must_use]
pub fn openai_error_body(kind: &str, message: &str, param: Option<&str>) -> Value {
    json!({"error": {"message": message, "type": kind, "param": param, "code": null}})
}

/// An OpenAI in-stream error chunk.
#[must_use]
pub fn openai_error_event(kind: &str, message: &str) -> Bytes {
    data(&openai_error_body(kind, message, None))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_pieces_reassembles() {
        for s in ["", "a", "ab", "hello world", "ünïcødé ✓ text"] {
            let pieces = split_pieces(s);
            assert_eq!(pieces.concat(), s);
            assert!(pieces.len() <= 3);
            if s.chars().count() >= 3 {
                assert!(pieces.len() >= 2, "{s:?} → {pieces:?}");
            }
        }
    }

    #[test]
    fn openai_usage_counts_cache_inside_prompt() {
        let u = Usage {
            input_tokens: 10,
            output_tokens: 5,
            cache_read_input_tokens: Some(100),
            cache_creation_input_tokens: Some(7),
        };
        let v = openai_usage(&u);
        assert_eq!(v["prompt_tokens"], 117);
        assert_eq!(v["total_tokens"], 122);
        assert_eq!(v["prompt_tokens_details"]["cached_tokens"], 100);
        let plain = openai_usage(&Usage {
            input_tokens: 1,
            output_tokens: 1,
            ..Usage::default()
        });
        assert!(plain.get("prompt_tokens_details").is_none());
    }
}
