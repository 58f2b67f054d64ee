//! Regression tests for the bugs the gateway research (§6.3, §5, §7, §8) found in other
//! gateways and translators. Each test is named after the project and issue (or the code path)
//! where the bug was seen, and asserts that our translation does not repeat it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use agentbox_wire::anthropic::{
    BlockDelta, ContentBlock, MessagesRequest, Role, StopReason, StreamEvent,
};
use agentbox_wire::chat::{ChatMessage, ChatRequest, ChatResponse, ChatToolChoice, ToolChoiceMode};
use agentbox_wire::error::{anthropic_error_for_status, error_type_for_status};
use agentbox_wire::sse;
use agentbox_wire::translate::{
    ChatOptions, ChatStreamTranslator, ResponseOptions, anthropic_into_chat,
    chat_to_anthropic_response,
};
use agentbox_wire::usage::UsageMeter;
use common::{accumulate, chunk, names, translate_stream, usage_chunk};
use serde_json::{Value, json};

fn to_chat(req: Value) -> ChatRequest {
    let req: MessagesRequest = serde_json::from_value(req).unwrap();
    anthropic_into_chat(req, &ChatOptions::default()).unwrap()
}

fn chat_json(req: Value) -> Value {
    serde_json::to_value(to_chat(req)).unwrap()
}

fn tool(index: u32, id: Option<&str>, name: Option<&str>, args: Option<&str>) -> Value {
    let mut f = serde_json::Map::new();
    if let Some(n) = name {
        f.insert("name".into(), json!(n));
    }
    if let Some(a) = args {
        f.insert("arguments".into(), json!(a));
    }
    let mut t = json!({"index": index, "function": f});
    if let Some(id) = id {
        t["id"] = json!(id);
        t["type"] = json!("function");
    }
    t
}

/// A chunk whose delta is the first piece of tool call `index`: its id, name and `args`.
fn tool_start(index: u32, id: &str, name: &str, args: &str, finish: Option<&str>) -> Value {
    let call = tool(index, Some(id), Some(name), Some(args));
    chunk(json!({"tool_calls": [call]}), finish)
}

/// A chunk whose delta is a later piece of tool call `index`: more of its arguments.
fn tool_args(index: u32, args: &str, finish: Option<&str>) -> Value {
    chunk(
        json!({"tool_calls": [tool(index, None, None, Some(args))]}),
        finish,
    )
}

/// `chunks` through the translator with the default options.
fn stream(chunks: &[Value]) -> Vec<StreamEvent> {
    translate_stream(chunks, ResponseOptions::default())
}

/// `chunks`, translated, yield exactly the tool calls `expected` (name, parsed input).
fn assert_tool_inputs(chunks: &[Value], expected: &[(&str, Value)]) {
    let expected: Vec<(String, Value)> = expected
        .iter()
        .map(|(name, input)| ((*name).to_owned(), input.clone()))
        .collect();
    assert_eq!(tool_inputs(&stream(chunks)), expected);
}

fn tool_inputs(events: &[StreamEvent]) -> Vec<(String, Value)> {
    accumulate(events)
        .content
        .into_iter()
        .filter_map(|b| {
            if let ContentBlock::ToolUse { name, input, .. } = b {
                Some((name, input))
            } else {
                None
            }
        })
        .collect()
}

/// Raw upstream SSE bytes, cut into `pieces`, through the decoder and the translator.
fn bridge_bytes(pieces: &[&[u8]]) -> Vec<StreamEvent> {
    let mut decoder = sse::Decoder::new();
    let mut t = ChatStreamTranslator::new(ResponseOptions::default());
    let mut out = Vec::new();
    for p in pieces {
        let mut frames = Vec::new();
        decoder.feed(p, &mut frames).unwrap();
        for f in frames {
            out.extend(t.push_data(&f.data));
        }
    }
    out.extend(t.finish());
    out
}

fn data_frames(chunks: &[Value]) -> Vec<u8> {
    let mut out = Vec::new();
    for c in chunks {
        out.extend_from_slice(b"data: ");
        out.extend_from_slice(serde_json::to_string(c).unwrap().as_bytes());
        out.extend_from_slice(b"\n\n");
    }
    out.extend_from_slice(b"data: [DONE]\n\n");
    out
}

// ---- LiteLLM /v1/messages adapter -------------------------------------------------------

#[test]
fn litellm_25321_tool_input_kept_on_text_to_tool_transition() {
    assert_tool_inputs(
        &[
            chunk(json!({"content": "Let me look."}), None),
            tool_start(0, "call_1", "Read", "{\"file_path\":\"/x\"}", None),
            chunk(json!({}), Some("tool_calls")),
            usage_chunk(5, 5, 0),
        ],
        &[("Read", json!({"file_path": "/x"}))],
    );
}

#[test]
fn litellm_25321_text_and_tool_call_in_the_same_chunk_both_kept() {
    let events = stream(&[
        chunk(
            json!({"content": "Running.", "tool_calls": [tool(0, Some("c"), Some("Bash"), Some("{\"command\":\"ls\"}"))]}),
            Some("tool_calls"),
        ),
        usage_chunk(5, 5, 0),
    ]);
    let m = accumulate(&events);
    assert!(matches!(&m.content[0], ContentBlock::Text { text, .. } if text == "Running."));
    assert!(
        matches!(&m.content[1], ContentBlock::ToolUse { input, .. } if input == &json!({"command":"ls"}))
    );
}

#[test]
fn litellm_30765_first_text_delta_after_thinking_kept() {
    let events = stream(&[
        chunk(json!({"reasoning_content": "hmm"}), None),
        // The transition chunk carries both the last reasoning and the first text.
        chunk(json!({"reasoning_content": "...", "content": "The"}), None),
        chunk(json!({"content": " answer"}), Some("stop")),
        usage_chunk(5, 5, 0),
    ]);
    let m = accumulate(&events);
    assert!(
        matches!(&m.content[0], ContentBlock::Thinking { thinking, .. } if thinking == "hmm...")
    );
    assert!(matches!(&m.content[1], ContentBlock::Text { text, .. } if text == "The answer"));
}

#[test]
fn litellm_29286_no_empty_input_json_delta_for_empty_tool_calls() {
    let events = stream(&[
        chunk(json!({"content": "plain", "tool_calls": []}), None),
        chunk(json!({"content": " text", "tool_calls": []}), Some("stop")),
        usage_chunk(5, 5, 0),
    ]);
    assert!(events.iter().all(|e| !matches!(
        e,
        StreamEvent::ContentBlockDelta {
            delta: BlockDelta::InputJsonDelta { .. },
            ..
        }
    )));
    assert_eq!(accumulate(&events).stop_reason, Some(StopReason::EndTurn));
}

#[test]
fn litellm_32357_exactly_one_message_start() {
    let mut t = ChatStreamTranslator::new(ResponseOptions::default());
    let mut events = t.start();
    events.extend(t.start());
    for c in [
        chunk(json!({"role": "assistant", "content": ""}), None),
        chunk(json!({"content": "a"}), None),
        chunk(json!({}), Some("stop")),
        usage_chunk(1, 1, 0),
    ] {
        events.extend(t.push_chunk(serde_json::from_value(c).unwrap()));
    }
    events.extend(t.finish());
    let starts = names(&events)
        .iter()
        .filter(|n| **n == "message_start")
        .count();
    assert_eq!(starts, 1);
    accumulate(&events);
}

#[test]
fn litellm_32357_thinking_not_collapsed_into_text_block() {
    let events = stream(&[
        chunk(json!({"reasoning_content": "plan"}), None),
        chunk(json!({"content": "do"}), Some("stop")),
        usage_chunk(1, 1, 0),
    ]);
    let kinds: Vec<&str> = accumulate(&events)
        .content
        .iter()
        .map(|b| b.block_type())
        .collect::<Vec<_>>()
        .into_iter()
        .map(|s| if s == "thinking" { "thinking" } else { "text" })
        .collect();
    assert_eq!(kinds, ["thinking", "text"]);
}

#[test]
fn litellm_33224_no_thinking_delta_inside_text_block() {
    // Reasoning resumes after text: it must get its own thinking block.
    let events = stream(&[
        chunk(json!({"content": "first"}), None),
        chunk(json!({"reasoning_content": "second thoughts"}), None),
        chunk(json!({"content": "final"}), Some("stop")),
        usage_chunk(1, 1, 0),
    ]);
    // `accumulate` refuses a thinking_delta aimed at a text block.
    let m = accumulate(&events);
    let kinds: Vec<&str> = m.content.iter().map(ContentBlock::block_type).collect();
    assert_eq!(kinds, ["text", "thinking", "text"]);
}

#[test]
fn litellm_25561_gemini_args_in_the_first_chunk_kept() {
    // Gemini/xAI/Ollama send id, name and all arguments at once, sometimes with the finish.
    assert_tool_inputs(
        &[tool_start(
            0,
            "c1",
            "Grep",
            "{\"pattern\":\"fn main\"}",
            Some("tool_calls"),
        )],
        &[("Grep", json!({"pattern": "fn main"}))],
    );
}

#[test]
fn litellm_15307_parallel_tool_calls_each_get_their_own_block() {
    assert_tool_inputs(
        &[
            tool_start(0, "a", "Read", "{\"file_path\":\"/1\"}", None),
            tool_start(1, "b", "Read", "{\"file_path\":\"/2\"}", None),
            tool_start(2, "c", "Bash", "{\"command\":\"ls\"}", Some("tool_calls")),
            usage_chunk(1, 1, 0),
        ],
        &[
            ("Read", json!({"file_path": "/1"})),
            ("Read", json!({"file_path": "/2"})),
            ("Bash", json!({"command": "ls"})),
        ],
    );
}

#[test]
fn litellm_13373_no_delta_for_a_block_never_started() {
    // Arguments before the name: nothing may be sent until the block exists.
    let events = stream(&[
        tool_args(0, "{\"a\":", None),
        tool_start(0, "id", "T", "1}", Some("tool_calls")),
        usage_chunk(1, 1, 0),
    ]);
    assert_eq!(
        names(&events),
        [
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop"
        ]
    );
    assert_eq!(tool_inputs(&events), [("T".into(), json!({"a": 1}))]);
}

#[test]
fn litellm_29491_input_json_delta_survives_sse_encoding() {
    let events = stream(&[
        tool_start(0, "c", "Write", "{\"content\":\"line1\\nline2\\r\\n", None),
        tool_args(0, "\",\"file_path\":\"/f\"}", Some("tool_calls")),
        usage_chunk(1, 1, 0),
    ]);
    let mut bytes = Vec::new();
    for e in &events {
        e.write_sse(&mut bytes).unwrap();
    }
    // Re-read the client's side, one byte at a time.
    let mut decoder = sse::Decoder::new();
    let mut frames = Vec::new();
    for b in &bytes {
        decoder.feed(std::slice::from_ref(b), &mut frames).unwrap();
    }
    let reread: Vec<StreamEvent> = frames
        .iter()
        .map(|f| {
            let e: StreamEvent = serde_json::from_str(&f.data).unwrap();
            assert_eq!(e.event_name(), f.event);
            e
        })
        .collect();
    assert_eq!(reread, events);
    assert_eq!(
        tool_inputs(&reread),
        [(
            "Write".into(),
            json!({"content": "line1\nline2\r\n", "file_path": "/f"})
        )]
    );
}

#[test]
fn litellm_37351_mid_turn_system_never_between_tool_use_and_result() {
    let chat = to_chat(
        json!({"model": "m", "max_tokens": 10, "tools": [{"name": "Bash", "input_schema": {"type": "object"}}], "messages": [
            {"role": "user", "content": "go"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
            {"role": "system", "content": "reminder"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]}
        ]}),
    );
    let roles: Vec<&str> = chat
        .messages
        .iter()
        .map(|m| match m {
            ChatMessage::System { .. } => "system",
            ChatMessage::User { .. } => "user",
            ChatMessage::Assistant { .. } => "assistant",
            ChatMessage::Tool { .. } => "tool",
            ChatMessage::Developer { .. } | ChatMessage::Other(_) => "other",
        })
        .collect();
    assert_eq!(roles, ["user", "assistant", "tool"]);
}

#[test]
fn litellm_30557_tool_type_not_merged_into_parameters() {
    let v = chat_json(
        json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}],
        "tools": [{"type": "custom", "name": "T", "input_schema": {"type": "object", "properties": {"a": {"type": "string"}}}}]}),
    );
    assert_eq!(
        v["tools"][0],
        json!({"type": "function", "function": {"name": "T", "parameters": {"type": "object", "properties": {"a": {"type": "string"}}}}})
    );
}

// ---- Envoy AI Gateway -------------------------------------------------------------------

#[test]
fn envoy_1465_tool_use_starts_with_empty_input_and_args_only_in_deltas() {
    let events = stream(&[tool_start(
        0,
        "c",
        "Bash",
        "{\"command\":\"ls\"}",
        Some("tool_calls"),
    )]);
    let start = events
        .iter()
        .find_map(|e| {
            if let StreamEvent::ContentBlockStart {
                content_block: ContentBlock::ToolUse { input, .. },
                ..
            } = e
            {
                Some(input)
            } else {
                None
            }
        })
        .unwrap();
    assert_eq!(start, &json!({}));
    assert!(events.iter().any(|e| matches!(
        e,
        StreamEvent::ContentBlockDelta { delta: BlockDelta::InputJsonDelta { partial_json, .. }, .. }
            if partial_json == "{\"command\":\"ls\"}"
    )));
}

#[test]
fn envoy_system_blocks_joined_with_a_separator() {
    let v = chat_json(
        json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
        "system": [{"type": "text", "text": "first."}, {"type": "text", "text": "second."}]}),
    );
    assert_eq!(v["messages"][0]["content"], "first.\n\nsecond.");
}

#[test]
fn envoy_no_delta_after_block_stop_when_tool_indices_interleave() {
    let events = stream(&[
        tool_start(0, "a", "A", "{\"x\":", None),
        tool_start(1, "b", "B", "{\"y\":", None),
        tool_args(0, "1}", None),
        tool_args(1, "2}", Some("tool_calls")),
        usage_chunk(1, 1, 0),
    ]);
    // `accumulate` refuses any delta to a stopped block.
    assert_eq!(
        tool_inputs(&events),
        [("A".into(), json!({"x": 1})), ("B".into(), json!({"y": 2}))]
    );
}

#[test]
fn envoy_cached_tokens_forwarded_not_dropped() {
    let resp: ChatResponse = serde_json::from_value(json!({"id": "x", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1000, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 900}}})).unwrap();
    let r = chat_to_anthropic_response(resp, &ResponseOptions::default()).unwrap();
    assert_eq!(r.usage.cache_read_input_tokens, Some(900));
    assert_eq!(r.usage.input_tokens, 100);
}

// ---- musistudio/llms (CCR v1) -----------------------------------------------------------

#[test]
fn musistudio_error_event_has_an_error_object_not_message() {
    let events = stream(&[
        chunk(json!({"content": "x"}), None),
        json!({"error": {"message": "boom", "type": "server_error"}}),
    ]);
    let last = serde_json::to_value(events.last().unwrap()).unwrap();
    assert_eq!(
        last,
        json!({"type": "error", "error": {"type": "api_error", "message": "boom"}})
    );
    assert!(last.get("message").is_none());
}

#[test]
fn musistudio_thinking_precedes_text_in_non_stream_response() {
    let resp: ChatResponse = serde_json::from_value(json!({"id": "x", "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "answer", "reasoning_content": "why"}, "finish_reason": "stop"}]})).unwrap();
    let r = chat_to_anthropic_response(resp, &ResponseOptions::default()).unwrap();
    let kinds: Vec<&str> = r.content.iter().map(ContentBlock::block_type).collect();
    assert_eq!(kinds, ["thinking", "text"]);
}

#[test]
fn musistudio_content_filter_is_not_stop_sequence() {
    let events = stream(&[
        chunk(json!({"content": "partial"}), Some("content_filter")),
        usage_chunk(1, 1, 0),
    ]);
    assert_eq!(accumulate(&events).stop_reason, Some(StopReason::Refusal));
}

#[test]
fn musistudio_usage_in_the_same_read_as_finish_is_kept() {
    // finish chunk, usage chunk and [DONE] arrive in one read.
    let bytes = data_frames(&[
        chunk(json!({"content": "hi"}), None),
        chunk(json!({}), Some("stop")),
        usage_chunk(77, 3, 0),
    ]);
    let events = bridge_bytes(&[&bytes]);
    let m = accumulate(&events);
    assert_eq!((m.usage.input_tokens, m.usage.output_tokens), (77, 3));
}

#[test]
fn ccr_eof_without_finish_reason_is_an_error_not_end_turn() {
    let events = stream(&[tool_start(
        0,
        "c",
        "Bash",
        "{\"command\":\"rm -rf /tm",
        None,
    )]);
    assert_eq!(events.last().unwrap().event_name(), "error");
    assert!(!names(&events).contains(&"message_delta"));
    assert!(!names(&events).contains(&"message_stop"));
    // The half-streamed tool block is left open, so no client executes it.
    assert!(!names(&events).contains(&"content_block_stop"));
}

// ---- fuergaosi233/claude-code-proxy -----------------------------------------------------

#[test]
fn fuergaosi233_truncated_tool_args_still_streamed() {
    // Cut by max_tokens: the arguments never parse, but what arrived is forwarded.
    let events = stream(&[
        tool_start(0, "c", "Write", "{\"content\":\"abc", None),
        chunk(json!({}), Some("length")),
        usage_chunk(1, 1, 0),
    ]);
    assert!(events.iter().any(|e| matches!(
        e,
        StreamEvent::ContentBlockDelta { delta: BlockDelta::InputJsonDelta { partial_json, .. }, .. }
            if partial_json == "{\"content\":\"abc"
    )));
    let stop = events.iter().find_map(|e| {
        if let StreamEvent::MessageDelta { delta, .. } = e {
            delta.stop_reason.clone()
        } else {
            None
        }
    });
    assert_eq!(stop, Some(StopReason::MaxTokens));
}

#[test]
fn fuergaosi233_no_empty_text_block_for_a_tool_only_reply() {
    let events = stream(&[
        chunk(json!({"role": "assistant", "content": ""}), None),
        tool_start(0, "c", "T", "{}", Some("tool_calls")),
        usage_chunk(1, 1, 0),
    ]);
    let m = accumulate(&events);
    assert_eq!(m.content.len(), 1);
    assert_eq!(m.content[0].block_type(), "tool_use");
}

#[test]
fn fuergaosi233_usage_not_double_counted() {
    let events = stream(&[
        chunk(json!({"content": "x"}), Some("stop")),
        usage_chunk(1000, 10, 600),
    ]);
    let u = accumulate(&events).usage;
    let total_input = u.input_tokens
        + u.cache_read_input_tokens.unwrap()
        + u.cache_creation_input_tokens.unwrap();
    assert_eq!(total_input, 1000);
    assert_eq!(u.cache_read_input_tokens, Some(600));
}

// ---- y-router ---------------------------------------------------------------------------

fn response_with(message: Value, finish: &str) -> agentbox_wire::anthropic::MessagesResponse {
    let resp: ChatResponse = serde_json::from_value(json!({"id": "x", "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 4}}))
    .unwrap();
    chat_to_anthropic_response(resp, &ResponseOptions::default()).unwrap()
}

#[test]
fn y_router_non_stream_keeps_both_text_and_tool_use() {
    let r = response_with(
        json!({"role": "assistant", "content": "Let me check.", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "Bash", "arguments": "{}"}}]}),
        "tool_calls",
    );
    let kinds: Vec<&str> = r.content.iter().map(ContentBlock::block_type).collect();
    assert_eq!(kinds, ["text", "tool_use"]);
}

#[test]
fn y_router_non_stream_reports_usage() {
    let r = response_with(json!({"role": "assistant", "content": "hi"}), "stop");
    assert_eq!((r.usage.input_tokens, r.usage.output_tokens), (9, 4));
}

#[test]
fn y_router_length_is_max_tokens_not_end_turn() {
    let r = response_with(json!({"role": "assistant", "content": "cut"}), "length");
    assert_eq!(r.stop_reason, Some(StopReason::MaxTokens));
}

// ---- 1rgs/claude-code-proxy -------------------------------------------------------------

#[test]
fn one_rgs_tool_result_is_a_tool_message_not_user_text() {
    let v = chat_json(json!({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "output"}]}]}));
    assert_eq!(
        v["messages"][2],
        json!({"role": "tool", "tool_call_id": "t1", "content": "output"})
    );
    assert_eq!(v["messages"].as_array().unwrap().len(), 3);
}

#[test]
fn one_rgs_tool_choice_any_is_required_not_any() {
    let chat = to_chat(
        json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}],
        "tools": [{"name": "T", "input_schema": {"type": "object"}}], "tool_choice": {"type": "any"}}),
    );
    assert_eq!(
        chat.tool_choice,
        Some(ChatToolChoice::Mode(ToolChoiceMode::Required))
    );
}

#[test]
fn one_rgs_max_tokens_not_capped_at_16384() {
    let chat = to_chat(
        json!({"model": "m", "max_tokens": 32000, "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(chat.max_completion_tokens, Some(32000));
}

// ---- agentgateway, Claude Code reports ---------------------------------------------------

#[test]
fn agentgateway_403_is_permission_error_not_authentication_error() {
    let body = serde_json::to_value(anthropic_error_for_status(403, "budget exhausted")).unwrap();
    assert_eq!(
        body,
        json!({"type": "error", "error": {"type": "permission_error", "message": "budget exhausted"}})
    );
    assert_eq!(
        error_type_for_status(403),
        agentbox_wire::anthropic::ErrorType::PermissionError
    );
}

#[test]
fn free_claude_code_137_message_start_carries_usage() {
    let mut t = ChatStreamTranslator::new(ResponseOptions::default());
    let start = serde_json::to_value(&t.start()[0]).unwrap();
    let usage = &start["message"]["usage"];
    assert!(
        usage["input_tokens"].is_u64() && usage["output_tokens"].is_u64(),
        "{start}"
    );
}

#[test]
fn cliproxyapi_4431_content_is_never_null() {
    let r = response_with(json!({"role": "assistant", "content": null}), "stop");
    assert_eq!(serde_json::to_value(&r).unwrap()["content"], json!([]));
    // A probe answered with nothing still makes a valid, empty stream.
    let events = stream(&[
        chunk(json!({"content": ""}), Some("stop")),
        usage_chunk(1, 0, 0),
    ]);
    assert!(accumulate(&events).content.is_empty());
}

#[test]
fn dify_2667_parallel_tool_args_do_not_share_an_accumulator() {
    assert_tool_inputs(
        &[
            chunk(
                json!({"tool_calls": [tool(0, Some("a"), Some("A"), Some("{\"v\":")), tool(1, Some("b"), Some("B"), Some("{\"w\":"))]}),
                None,
            ),
            chunk(
                json!({"tool_calls": [tool(0, None, None, Some("\"a\"}")), tool(1, None, None, Some("\"b\"}"))]}),
                Some("tool_calls"),
            ),
            usage_chunk(1, 1, 0),
        ],
        &[("A", json!({"v": "a"})), ("B", json!({"w": "b"}))],
    );
}

#[test]
fn kimi_tool_call_ids_sanitized_in_streams() {
    let events = stream(&[tool_start(
        0,
        "functions.Bash:0",
        "Bash",
        "{}",
        Some("tool_calls"),
    )]);
    let m = accumulate(&events);
    assert!(matches!(&m.content[0], ContentBlock::ToolUse { id, .. } if id == "functions_Bash_0"));
}

#[test]
fn ollama_16372_mid_conversation_system_role_never_reaches_the_backend() {
    let chat = to_chat(
        json!({"model": "m", "max_tokens": 1, "system": "S", "messages": [
        {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
        {"role": "system", "content": "note"}, {"role": "user", "content": "c"}]}),
    );
    let systems = chat
        .messages
        .iter()
        .filter(|m| matches!(m, ChatMessage::System { .. }))
        .count();
    assert_eq!(systems, 1);
    assert!(matches!(chat.messages[0], ChatMessage::System { .. }));
}

#[test]
fn deepseek_9router_355_reasoning_content_passed_back_on_tool_call_turns() {
    let chat = to_chat(json!({"model": "m", "max_tokens": 1, "messages": [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "plan", "signature": "s"},
            {"type": "tool_use", "id": "t", "name": "T", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]}));
    assert!(
        matches!(&chat.messages[1], ChatMessage::Assistant { reasoning_content: Some(r), .. } if r == "plan")
    );
}

#[test]
fn vllm_36829_claude_code_billing_header_stripped() {
    let chat = to_chat(
        json!({"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "a"}],
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328; cch=1234;"}, {"type": "text", "text": "Prompt"}]}),
    );
    assert!(
        matches!(&chat.messages[0], ChatMessage::System { content, .. }
        if serde_json::to_value(content).unwrap() == json!("Prompt"))
    );
}

// ---- metering -----------------------------------------------------------------------------

fn anthropic_sse(events: &[Value]) -> Vec<u8> {
    let mut out = Vec::new();
    for e in events {
        let name = e["type"].as_str().unwrap();
        out.extend_from_slice(format!("event: {name}\r\ndata: {e}\r\n\r\n").as_bytes());
    }
    out
}

#[test]
fn langchain_31158_cumulative_output_tokens_not_summed() {
    let bytes = anthropic_sse(&[
        json!({"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant", "content": [], "model": "x", "usage": {"input_tokens": 10, "output_tokens": 1}}}),
        json!({"type": "message_delta", "delta": {"stop_reason": null}, "usage": {"output_tokens": 5}}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 12}}),
        json!({"type": "message_stop"}),
    ]);
    let mut m = UsageMeter::event_stream();
    m.feed(&bytes);
    let r = m.finish();
    assert_eq!(r.usage.output_tokens, 12);
    assert_eq!(r.usage.total(), 22);
}

#[test]
fn ollama_estimate_in_message_start_overridden_by_message_delta() {
    let bytes = anthropic_sse(&[
        json!({"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant", "content": [], "model": "x", "usage": {"input_tokens": 5000, "output_tokens": 0}}}),
        json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"input_tokens": 4321, "output_tokens": 7}}),
        json!({"type": "message_stop"}),
    ]);
    let mut m = UsageMeter::event_stream();
    for b in bytes.chunks(3) {
        m.feed(b);
    }
    assert_eq!(m.finish().usage.input_tokens, 4321);
}

#[test]
fn litellm_budget_429_not_used_for_exhausted_budgets() {
    // The gateway's budget refusal is 403 permission_error: a 429 makes Claude Code retry
    // (puffo-agent PR #327 saw thousands of rejected retries a day).
    assert_eq!(
        error_type_for_status(403),
        agentbox_wire::anthropic::ErrorType::PermissionError
    );
    assert_ne!(error_type_for_status(403), error_type_for_status(429));
}

#[test]
fn claude_code_role_system_messages_parse() {
    let req: MessagesRequest = serde_json::from_value(json!({"model": "m", "messages": [
        {"role": "system", "content": "x"}]}))
    .unwrap();
    assert_eq!(req.messages[0].role, Role::System);
}

/// The bridge's own guesses (the `message_start` input before the real count, a chat upstream
/// that never reported usage) reach the gateway's meter marked, so it bills them as unreported
/// with its own floors; the provider's own usage is taken as reported.
#[test]
fn translated_usage_is_the_providers_only_when_the_provider_reported_it() {
    let opts = || ResponseOptions {
        input_tokens_estimate: 10,
        ..ResponseOptions::default()
    };
    let meter = |events: &[StreamEvent]| {
        let values: Vec<Value> = events
            .iter()
            .map(|e| serde_json::to_value(e).unwrap())
            .collect();
        let mut m = UsageMeter::event_stream();
        m.feed(&anthropic_sse(&values));
        m.finish()
    };
    let text = chunk(json!({"content": "hello"}), None);
    let end = chunk(json!({}), Some("stop"));
    // The provider's count arrives: reported.
    let told = translate_stream(&[text.clone(), end.clone(), usage_chunk(900, 7, 0)], opts());
    let r = meter(&told);
    assert!(r.complete && r.saw_usage, "{r:?}");
    assert_eq!((r.usage.input_tokens, r.usage.output_tokens), (900, 7));
    // Cut after the text: only the bridge's guess was seen.
    let r = meter(&told[..told.len() - 3]);
    assert!(!r.complete && !r.saw_usage, "{r:?}");
    // Complete, but the provider never said: the bridge's estimate is not its word.
    let silent = translate_stream(&[text.clone(), end], opts());
    let r = meter(&silent);
    assert!(r.complete && !r.saw_usage, "{r:?}");
    // A whole answer without usage, likewise.
    let resp: ChatResponse = serde_json::from_value(json!({
        "id": "c", "object": "chat.completion", "created": 0, "model": "up",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hello"}, "finish_reason": "stop"}]
    }))
    .unwrap();
    let whole = chat_to_anthropic_response(resp, &opts()).unwrap();
    let r = agentbox_wire::usage::usage_from_json(&serde_json::to_vec(&whole).unwrap());
    assert!(r.whole_body && !r.saw_usage, "{r:?}");
    // A mark can only make a meter bill more: an Anthropic upstream's real usage is unmarked.
    let plain = json!({"type": "message", "usage": {"input_tokens": 3, "output_tokens": 4}});
    assert!(agentbox_wire::usage::usage_from_json(plain.to_string().as_bytes()).saw_usage);
}
