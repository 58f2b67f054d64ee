//! Helpers shared by the integration tests: running a chunk sequence through the stream
//! translators and checking the result against the Anthropic stream contract, or against the
//! Responses event order Codex parses.

#![allow(dead_code)]

use agentbox_wire::anthropic::{ContentBlock, MessagesResponse, StreamAccumulator, StreamEvent};
use agentbox_wire::chat::ChatChunk;
use agentbox_wire::responses::{OutputItem, Response, ResponseStreamEvent};
use agentbox_wire::translate::{
    ChatStreamTranslator, ResponseOptions, ResponsesOptions, ResponsesStreamTranslator,
};
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

/// Feeds `chunks` (as [`translate_stream`]) through the Responses translator, after `start()`
/// when `start_early`, and ends the stream.
pub fn translate_responses_stream(
    chunks: &[Value],
    opts: ResponsesOptions,
    start_early: bool,
) -> Vec<ResponseStreamEvent> {
    let mut t = ResponsesStreamTranslator::new(opts);
    let mut events = if start_early { t.start() } else { Vec::new() };
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

fn seq(e: &ResponseStreamEvent) -> Option<u64> {
    let v = serde_json::to_value(e).unwrap();
    v.get("sequence_number").and_then(Value::as_u64)
}

fn item_id(item: &OutputItem) -> String {
    match item {
        OutputItem::Message(m) => m.id.clone().unwrap(),
        OutputItem::FunctionCall(c) => c.id.clone().unwrap(),
        OutputItem::Reasoning(r) => r.id.clone().unwrap(),
        OutputItem::Other(map) => panic!("unexpected item {map:?}"),
    }
}

/// Checks a Responses stream against the order OpenAI streams and Codex parse, and returns the
/// final response (`response.completed`'s or `response.failed`'s). Panics on a violation:
/// - `sequence_number` on every event, counting from 0;
/// - `response.created` then `response.in_progress` first, one terminal event
///   (`response.completed` / `response.failed`) last;
/// - items added at contiguous `output_index`es, each done at most once (exactly once when
///   completed), deltas only to an added, not yet done item of the right kind, after its part
///   was added;
/// - each done text equals its deltas joined, and the done item carries it;
/// - `response.completed`'s output is every done item, in `output_index` order.
pub fn check_responses_stream(events: &[ResponseStreamEvent]) -> Response {
    #[derive(Default)]
    struct Open {
        id: String,
        kind: &'static str,
        part: bool,
        text: String,
        done: Option<OutputItem>,
    }
    let fail = |i: usize, why: &str| -> ! {
        panic!("event {i} ({}): {why}\n{events:#?}", events[i].event_name())
    };
    let mut items: Vec<Open> = Vec::new();
    assert!(events.len() >= 3, "too few events: {events:#?}");
    for (i, e) in events.iter().enumerate() {
        if seq(e) != Some(i as u64) {
            fail(i, "sequence_number is not its position");
        }
        let last = i + 1 == events.len();
        let open = |items: &mut Vec<Open>, idx: u32, item_id: &str, kind: &str| -> usize {
            let pos = idx as usize;
            let o = items
                .get(pos)
                .unwrap_or_else(|| fail(i, "delta for an item never added"));
            if o.id != item_id || o.kind != kind {
                fail(i, "delta item_id or kind does not match the item");
            }
            if o.done.is_some() {
                fail(i, "delta after the item was done");
            }
            pos
        };
        match e {
            ResponseStreamEvent::Created { response, .. } if i == 0 => {
                assert_eq!(response.output.len(), 0);
            }
            ResponseStreamEvent::InProgress { .. } if i == 1 => {}
            ResponseStreamEvent::Created { .. } | ResponseStreamEvent::InProgress { .. } => {
                fail(i, "lifecycle event out of place")
            }
            _ if i < 2 => fail(i, "stream does not open with created, in_progress"),
            ResponseStreamEvent::OutputItemAdded {
                output_index, item, ..
            } => {
                if *output_index as usize != items.len() {
                    fail(i, "output_index not contiguous");
                }
                let (kind, text) = match item {
                    OutputItem::Message(m) => {
                        assert_eq!(m.status.as_deref(), Some("in_progress"));
                        ("message", String::new())
                    }
                    OutputItem::FunctionCall(c) => {
                        assert_eq!(c.status.as_deref(), Some("in_progress"));
                        assert!(!c.name.is_empty() && !c.call_id.is_empty());
                        ("function_call", c.arguments.clone())
                    }
                    OutputItem::Reasoning(_) => ("reasoning", String::new()),
                    OutputItem::Other(_) => fail(i, "unknown item type"),
                };
                assert!(text.is_empty(), "added item already has content");
                items.push(Open {
                    id: item_id(item),
                    kind,
                    part: kind == "function_call",
                    ..Open::default()
                });
            }
            ResponseStreamEvent::ContentPartAdded {
                item_id,
                output_index,
                content_index,
                ..
            } => {
                let p = open(&mut items, *output_index, item_id, "message");
                assert_eq!(*content_index, 0);
                if items[p].part {
                    fail(i, "part added twice");
                }
                items[p].part = true;
            }
            ResponseStreamEvent::ReasoningSummaryPartAdded {
                item_id,
                output_index,
                summary_index,
                ..
            } => {
                let p = open(&mut items, *output_index, item_id, "reasoning");
                assert_eq!(*summary_index, 0);
                if items[p].part {
                    fail(i, "part added twice");
                }
                items[p].part = true;
            }
            ResponseStreamEvent::OutputTextDelta {
                item_id,
                output_index,
                delta,
                ..
            } => {
                let p = open(&mut items, *output_index, item_id, "message");
                if !items[p].part || delta.is_empty() {
                    fail(i, "text delta before its part, or empty");
                }
                items[p].text.push_str(delta);
            }
            ResponseStreamEvent::ReasoningSummaryTextDelta {
                item_id,
                output_index,
                delta,
                ..
            } => {
                let p = open(&mut items, *output_index, item_id, "reasoning");
                if !items[p].part || delta.is_empty() {
                    fail(i, "summary delta before its part, or empty");
                }
                items[p].text.push_str(delta);
            }
            ResponseStreamEvent::FunctionCallArgumentsDelta {
                item_id,
                output_index,
                delta,
                ..
            } => {
                let p = open(&mut items, *output_index, item_id, "function_call");
                if delta.is_empty() {
                    fail(i, "empty arguments delta");
                }
                items[p].text.push_str(delta);
            }
            ResponseStreamEvent::OutputTextDone {
                item_id,
                output_index,
                text,
                ..
            } => {
                let p = open(&mut items, *output_index, item_id, "message");
                if &items[p].text != text {
                    fail(i, "done text differs from its deltas");
                }
            }
            ResponseStreamEvent::ReasoningSummaryTextDone {
                item_id,
                output_index,
                text,
                ..
            } => {
                let p = open(&mut items, *output_index, item_id, "reasoning");
                if &items[p].text != text {
                    fail(i, "done summary differs from its deltas");
                }
            }
            ResponseStreamEvent::FunctionCallArgumentsDone {
                item_id,
                output_index,
                arguments,
                ..
            } => {
                let p = open(&mut items, *output_index, item_id, "function_call");
                if &items[p].text != arguments {
                    fail(i, "done arguments differ from their deltas");
                }
            }
            ResponseStreamEvent::ContentPartDone {
                item_id,
                output_index,
                ..
            }
            | ResponseStreamEvent::ReasoningSummaryPartDone {
                item_id,
                output_index,
                ..
            } => {
                let kind = if matches!(e, ResponseStreamEvent::ContentPartDone { .. }) {
                    "message"
                } else {
                    "reasoning"
                };
                open(&mut items, *output_index, item_id, kind);
            }
            ResponseStreamEvent::OutputItemDone {
                output_index, item, ..
            } => {
                let p = *output_index as usize;
                let kind = items
                    .get(p)
                    .map(|o| o.kind)
                    .unwrap_or_else(|| fail(i, "done for an item never added"));
                open(&mut items, *output_index, &item_id(item), kind);
                let text = match item {
                    OutputItem::Message(m) => {
                        assert_eq!(m.status.as_deref(), Some("completed"));
                        let v = serde_json::to_value(&m.content).unwrap();
                        assert_eq!(v.as_array().unwrap().len(), 1, "one output_text part");
                        v[0]["text"].as_str().unwrap().to_owned()
                    }
                    OutputItem::FunctionCall(c) => {
                        assert_eq!(c.status.as_deref(), Some("completed"));
                        c.arguments.clone()
                    }
                    OutputItem::Reasoning(r) => {
                        let v = serde_json::to_value(&r.summary).unwrap();
                        v.as_array()
                            .unwrap()
                            .iter()
                            .map(|p| p["text"].as_str().unwrap().to_owned())
                            .collect()
                    }
                    OutputItem::Other(_) => fail(i, "unknown item type"),
                };
                if text != items[p].text {
                    fail(i, "done item differs from its deltas");
                }
                items[p].done = Some(item.clone());
            }
            ResponseStreamEvent::Completed { response, .. } if last => {
                assert_eq!(
                    response.status,
                    Some(agentbox_wire::responses::ResponseStatus::Completed)
                );
                assert!(response.usage.is_some(), "completed without usage");
                let done: Vec<OutputItem> = items
                    .iter()
                    .map(|o| {
                        o.done
                            .clone()
                            .unwrap_or_else(|| fail(i, "completed with an item not done"))
                    })
                    .collect();
                assert_eq!(
                    response.output, done,
                    "completed output is not the done items"
                );
                return response.clone();
            }
            ResponseStreamEvent::Failed { response, .. } if last => {
                assert_eq!(
                    response.status,
                    Some(agentbox_wire::responses::ResponseStatus::Failed)
                );
                let error = response.error.as_ref().expect("failed without error");
                assert!(error["code"].is_string() && error["message"].is_string());
                let done: Vec<OutputItem> = items.iter().filter_map(|o| o.done.clone()).collect();
                assert_eq!(response.output, done, "failed output is not the done items");
                return response.clone();
            }
            ResponseStreamEvent::Completed { .. }
            | ResponseStreamEvent::Failed { .. }
            | ResponseStreamEvent::Incomplete { .. }
            | ResponseStreamEvent::ReasoningTextDelta { .. }
            | ResponseStreamEvent::Error { .. }
            | ResponseStreamEvent::Other(_) => {
                fail(i, "unexpected event (or terminal event not last)")
            }
        }
    }
    panic!("stream has no terminal event: {events:#?}")
}
