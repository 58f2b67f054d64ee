//! Helpers shared by the integration tests: running a chunk sequence through the stream
//! translator and checking the result against the Anthropic stream contract.

#![allow(dead_code)]

use agentbox_wire::anthropic::{ContentBlock, MessagesResponse, StreamAccumulator, StreamEvent};
use agentbox_wire::chat::ChatChunk;
use agentbox_wire::translate::{ChatStreamTranslator, ResponseOptions};
use serde_json::Value;

/// Feeds `chunks` (chunk objects, or strings passed as raw SSE data such as `"[DONE]"`) and then
/// ends the stream.
pub fn translate_stream(chunks: &[Value], opts: ResponseOptions) -> Vec<StreamEvent> {
    let mut t = ChatStreamTranslator::new(opts);
    let mut events = Vec::new();
    for c in chunks {
        if let Value::String(data) = c {
            events.extend(t.push_data(data));
        } else {
            let chunk: ChatChunk = serde_json::from_value(c.clone()).unwrap();
            events.extend(t.push_chunk(chunk));
        }
    }
    events.extend(t.finish());
    events
}

/// Checks the contract and rebuilds the message; panics with the violation otherwise. Also
/// refuses empty blocks, which the contract allows but no translator of ours may produce.
pub fn accumulate(events: &[StreamEvent]) -> MessagesResponse {
    let mut acc = StreamAccumulator::new();
    for (i, e) in events.iter().enumerate() {
        if let Err(v) = acc.push(e) {
            panic!(
                "event {i} ({}) breaks the stream contract: {v}\n{events:#?}",
                e.event_name()
            );
        }
    }
    let message = acc.finish().unwrap();
    for b in &message.content {
        let empty = matches!(b, ContentBlock::Text { text, .. } if text.is_empty())
            || matches!(b, ContentBlock::Thinking { thinking, .. } if thinking.is_empty());
        assert!(!empty, "empty {} block in {message:#?}", b.block_type());
    }
    message
}

/// Event names in order, for compact assertions.
pub fn names(events: &[StreamEvent]) -> Vec<&str> {
    events.iter().map(StreamEvent::event_name).collect()
}

/// A chat chunk with the given delta and finish reason.
pub fn chunk(delta: Value, finish: Option<&str>) -> Value {
    serde_json::json!({
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "up",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]
    })
}

/// The final usage-only chunk of `include_usage`.
pub fn usage_chunk(prompt: u64, completion: u64, cached: u64) -> Value {
    serde_json::json!({
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "model": "up",
        "choices": [],
        "usage": {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}
        }
    })
}
