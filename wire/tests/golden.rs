//! Golden tests: one directory per mapping rule under `tests/golden/<kind>/<rule>/`, holding
//! `input.json` (or `input.sse` for the meter), an optional `options.json` and
//! `expected.json`. One test per rule, named after it; `every_golden_dir_has_a_test` keeps the
//! list and the directories in step.
//!
//! Kinds: `request` (Anthropic request → chat request), `response` (chat response → Anthropic
//! response), `stream` (chat chunks → Anthropic events; strings in the input array are raw SSE
//! data such as `"[DONE]"`; the stream is always ended after the last one), `error` (status and
//! upstream body → Anthropic error body), `meter` (Anthropic body → usage report),
//! `responses_request` (Responses request → chat request), `responses_response` (chat response
//! → Responses response), `responses_stream` (chat chunks → Responses events, fed like
//! `stream`).
//!
//! `AGENTBOX_BLESS=1 cargo test -p agentbox-wire --test golden` rewrites every
//! `expected.json` from the current output; review the diff before keeping it.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use agentbox_wire::anthropic::MessagesRequest;
use agentbox_wire::error::anthropic_error_from_openai;
use agentbox_wire::responses::ResponsesRequest;
use agentbox_wire::translate::{
    AnthropicBody, ChatOptions, InlineSystem, MaxTokensField, ReasoningField, ResponseOptions,
    ResponsesOptions, ToolNames, anthropic_into_chat, chat_to_anthropic_response,
    chat_to_responses_response, responses_into_chat,
};
use agentbox_wire::usage::{BodyKind, MeterReport, UsageMeter};
use serde_json::{Value, json};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The rule's `input.json` as a `T`.
fn input<T: serde::de::DeserializeOwned>(dir: &Path) -> T {
    serde_json::from_value(read_json(&dir.join("input.json"))).unwrap()
}

/// The rule's `input.json` translated by `f`, as JSON.
fn translated<T, U, E>(dir: &Path, f: impl FnOnce(T) -> Result<U, E>) -> Value
where
    T: serde::de::DeserializeOwned,
    U: serde::Serialize,
    E: std::fmt::Debug,
{
    serde_json::to_value(f(input(dir)).unwrap()).unwrap()
}

fn options(dir: &Path) -> Value {
    let p = dir.join("options.json");
    if p.exists() { read_json(&p) } else { json!({}) }
}

fn chat_options(v: &Value) -> ChatOptions {
    let mut o = ChatOptions::default();
    if let Some(m) = v.get("model").and_then(Value::as_str) {
        o.model = Some(m.to_owned());
    }
    if let Some(n) = v.get("max_output_tokens").and_then(Value::as_u64) {
        o.max_output_tokens = Some(n);
    }
    match v.get("max_tokens_field").and_then(Value::as_str) {
        Some("max_tokens") => o.max_tokens_field = MaxTokensField::MaxTokens,
        Some("both") => o.max_tokens_field = MaxTokensField::Both,
        Some("max_completion_tokens") | None => {}
        Some(other) => panic!("unknown max_tokens_field {other}"),
    }
    let flag = |k: &str| v.get(k).and_then(Value::as_bool);
    if let Some(b) = flag("include_usage") {
        o.include_usage = b;
    }
    if let Some(b) = flag("strip_billing_header") {
        o.strip_billing_header = b;
    }
    if let Some(b) = flag("reasoning_passback") {
        o.reasoning_passback = b;
    }
    match v.get("reasoning").and_then(Value::as_str) {
        Some("reasoning_effort") => o.reasoning = ReasoningField::ReasoningEffort,
        Some("reasoning") => o.reasoning = ReasoningField::Reasoning,
        Some("none") | None => {}
        Some(other) => panic!("unknown reasoning {other}"),
    }
    if let Some(b) = flag("forward_user") {
        o.forward_user = b;
    }
    if let Some(b) = flag("forward_top_k") {
        o.forward_top_k = b;
    }
    if v.get("inline_system").and_then(Value::as_str) == Some("keep") {
        o.inline_system = InlineSystem::Keep;
    }
    o
}

fn response_options(v: &Value) -> ResponseOptions {
    let mut o = ResponseOptions {
        model: v.get("model").and_then(Value::as_str).map(str::to_owned),
        message_id: v
            .get("message_id")
            .and_then(Value::as_str)
            .map(str::to_owned),
        input_tokens_estimate: v
            .get("input_tokens_estimate")
            .and_then(Value::as_u64)
            .unwrap_or(0),
        ..ResponseOptions::default()
    };
    if let Some(stops) = v.get("stop_sequences").and_then(Value::as_array) {
        o.stop_sequences = stops
            .iter()
            .map(|s| s.as_str().unwrap().to_owned())
            .collect();
    }
    if let Some(req) = v.get("request") {
        let req: MessagesRequest = serde_json::from_value(req.clone()).unwrap();
        o.tool_names = ToolNames::from_request(&req);
    }
    o
}

fn responses_options(v: &Value) -> ResponsesOptions {
    ResponsesOptions {
        model: v.get("model").and_then(Value::as_str).map(str::to_owned),
        response_id: v
            .get("response_id")
            .and_then(Value::as_str)
            .map(str::to_owned),
        // Every fixture names `created` or sets this, so expected files do not depend on the
        // clock.
        created_at: v.get("created_at").and_then(Value::as_u64),
        input_tokens_estimate: v
            .get("input_tokens_estimate")
            .and_then(Value::as_u64)
            .unwrap_or(0),
    }
}

fn report_json(r: &MeterReport) -> Value {
    json!({
        "input_tokens": r.usage.input_tokens,
        "output_tokens": r.usage.output_tokens,
        "cache_read_input_tokens": r.usage.cache_read_input_tokens,
        "cache_creation_input_tokens": r.usage.cache_creation_input_tokens,
        "total": r.usage.total(),
        "saw_usage": r.saw_usage,
        "complete": r.complete,
        "stop_reason": r.stop_reason,
        "error": r.error,
        "malformed": r.malformed,
    })
}

fn actual(kind: &str, dir: &Path) -> Value {
    let opts = options(dir);
    match kind {
        "request" => translated(dir, |req| anthropic_into_chat(req, &chat_options(&opts))),
        "response" => translated(dir, |resp| {
            chat_to_anthropic_response(resp, &response_options(&opts))
        }),
        "stream" => {
            let chunks: Vec<Value> = input(dir);
            let events = common::translate_stream(&chunks, response_options(&opts));
            // A successful stream must also satisfy the contract.
            if events.iter().all(|e| e.event_name() != "error") {
                common::accumulate(&events);
            }
            serde_json::to_value(events).unwrap()
        }
        "responses_request" => {
            let req: ResponsesRequest = input(dir);
            match responses_into_chat(req, &chat_options(&opts)) {
                Ok(chat) => serde_json::to_value(chat).unwrap(),
                Err(e) => json!({"error": e.to_string()}),
            }
        }
        "responses_response" => translated(dir, |resp| {
            chat_to_responses_response(resp, &responses_options(&opts))
        }),
        "responses_stream" => {
            let chunks: Vec<Value> = input(dir);
            let events = common::translate_responses_stream(
                &chunks,
                responses_options(&opts),
                opts.get("start_early").and_then(Value::as_bool) == Some(true),
            );
            // Every stream, failed or not, must satisfy the event order Codex parses.
            common::check_responses_stream(&events);
            serde_json::to_value(events).unwrap()
        }
        "error" => {
            let input = read_json(&dir.join("input.json"));
            let status = u16::try_from(input["status"].as_u64().unwrap()).unwrap();
            let body = match input["body"].as_str() {
                Some(text) => text.as_bytes().to_vec(),
                None => serde_json::to_vec(&input["body"]).unwrap(),
            };
            serde_json::to_value(anthropic_error_from_openai(status, &body)).unwrap()
        }
        "meter" => {
            let sse = dir.join("input.sse");
            let (kind, bytes) = if sse.exists() {
                (BodyKind::EventStream, std::fs::read(sse).unwrap())
            } else {
                (
                    BodyKind::Json,
                    std::fs::read(dir.join("input.json")).unwrap(),
                )
            };
            // Feed in 7-byte pieces so the fixtures also exercise chunk boundaries.
            let mut meter = UsageMeter::new(kind);
            for piece in bytes.chunks(7) {
                meter.feed(piece);
            }
            report_json(&meter.finish())
        }
        other => panic!("unknown golden kind {other}"),
    }
}

fn run(kind: &str, rule: &str) {
    let dir = root().join(kind).join(rule);
    let got = actual(kind, &dir);
    let expected_path = dir.join("expected.json");
    if std::env::var_os("AGENTBOX_BLESS").is_some() {
        let mut text = serde_json::to_string_pretty(&got).unwrap();
        text.push('\n');
        std::fs::write(&expected_path, text).unwrap();
        return;
    }
    let expected = read_json(&expected_path);
    assert_eq!(
        got,
        expected,
        "golden {kind}/{rule} differs\n--- got ---\n{}",
        serde_json::to_string_pretty(&got).unwrap()
    );
    if kind == "request" {
        borrowed_agrees(&dir, &expected);
    }
}

/// The borrowed translation ([`AnthropicBody`]) of a request rule's input, as the file has it
/// and compacted, where it takes the body: the same chat request as the owned path, and the same
/// answer options. Returns whether it took the body.
fn borrowed_agrees(dir: &Path, expected: &Value) -> bool {
    let opts = chat_options(&options(dir));
    let text = std::fs::read_to_string(dir.join("input.json")).unwrap();
    let compact = serde_json::to_string(&read_json(&dir.join("input.json"))).unwrap();
    let mut took = Vec::new();
    for body in [&text, &compact] {
        let Some(parsed) = AnthropicBody::parse(body) else {
            took.push(false);
            continue;
        };
        took.push(true);
        let chat: Value = serde_json::from_slice(&parsed.write_chat(&opts, None)).unwrap();
        assert_eq!(
            &chat,
            expected,
            "borrowed {} differs\n--- got ---\n{}",
            dir.display(),
            serde_json::to_string_pretty(&chat).unwrap()
        );
        let owned: MessagesRequest = serde_json::from_str(body).unwrap();
        assert_eq!(
            parsed.response_options(),
            ResponseOptions::for_request(&owned)
        );
    }
    assert_eq!(
        took[0],
        took[1],
        "{}: pretty and compact taken alike",
        dir.display()
    );
    took[0]
}

/// The borrowed path takes most request rules (the others hold what it leaves to the owned
/// path: system messages, images, documents, malformed blocks), so the check above is not
/// vacuous.
#[test]
fn borrowed_path_takes_most_request_rules() {
    let mut taken = 0;
    let mut total = 0;
    for entry in std::fs::read_dir(root().join("request")).unwrap() {
        let dir = entry.unwrap().path();
        total += 1;
        if borrowed_agrees(&dir, &actual("request", &dir)) {
            taken += 1;
        }
    }
    assert!(taken * 2 > total, "taken {taken} of {total}");
}

macro_rules! golden {
    ($kind:ident: $($rule:ident),* $(,)?) => {
        mod $kind {
            pub const RULES: &[&str] = &[$(stringify!($rule)),*];
            $(
                #[test]
                fn $rule() {
                    super::run(stringify!($kind), stringify!($rule));
                }
            )*
        }
    };
}

golden!(request:
    system_string,
    system_blocks_joined_with_blank_line,
    billing_header_block_stripped,
    billing_header_block_kept_when_asked,
    user_single_text_block_is_a_string,
    user_several_blocks_are_parts,
    image_base64_to_data_url,
    image_url_source_to_url,
    assistant_tool_use_to_tool_calls,
    assistant_text_blocks_concatenated,
    tool_result_before_user_text,
    tool_result_blocks_become_text,
    tool_result_images_follow_tool_messages,
    tool_definitions,
    tool_choice_auto,
    tool_choice_any_to_required,
    tool_choice_tool_to_named_function,
    tool_choice_none,
    disable_parallel_tool_use,
    tool_choice_without_tools_dropped,
    tool_choice_of_a_server_tool_dropped,
    stop_sequences_to_stop,
    metadata_user_id_to_user,
    metadata_user_id_not_forwarded_by_default,
    max_tokens_clamped_to_model_limit,
    max_tokens_field_both,
    stream_requests_include_usage,
    thinking_passed_back_as_reasoning_content,
    thinking_to_reasoning_effort,
    thinking_to_reasoning_object,
    thinking_not_sent_by_default,
    thinking_adaptive_uses_output_config_effort,
    thinking_disabled_sends_nothing,
    inline_system_folded_into_user_turn,
    inline_system_kept_when_asked,
    long_tool_name_shortened,
    document_pdf_to_file_part,
    sampling_parameters,
    anthropic_only_fields_not_forwarded,
    output_format_to_response_format,
);

golden!(response:
    text_end_turn,
    reasoning_content_becomes_first_thinking_block,
    reasoning_field_becomes_thinking,
    tool_calls_to_tool_use,
    stop_with_tool_calls_is_tool_use,
    length_is_max_tokens,
    content_filter_is_refusal,
    unknown_finish_reason_is_end_turn,
    cached_tokens_moved_out_of_input,
    empty_arguments_are_empty_object,
    malformed_arguments_kept_as_string,
    tool_call_id_sanitized,
    content_never_null,
    matched_stop_sequence,
    long_tool_name_restored,
    requested_model_reported,
    missing_usage_uses_estimate,
);

golden!(stream:
    text_with_usage_chunk,
    thinking_then_text,
    text_then_tool_call,
    tool_call_in_one_chunk,
    parallel_tool_calls_sequential,
    parallel_tool_calls_interleaved,
    arguments_before_name,
    message_delta_waits_for_usage,
    no_usage_is_estimated,
    eof_without_finish_reason_is_error,
    error_chunk_is_error_event,
    stop_with_tool_calls_is_tool_use,
    length_is_max_tokens,
    empty_deltas_open_no_block,
    continuous_usage_stats,
    content_and_finish_in_one_chunk,
    unreadable_chunk_is_error_event,
    chunks_after_message_stop_dropped,
    refusal_delta_is_text,
    reasoning_field_deltas,
);

golden!(error:
    status_400_invalid_request,
    status_401_authentication,
    status_403_permission_not_authentication,
    status_404_not_found,
    status_413_request_too_large,
    status_429_rate_limit,
    status_500_api_error,
    status_503_api_error,
    status_529_overloaded,
    context_length_exceeded_is_prompt_too_long,
    max_tokens_too_large_is_not_prompt_too_long,
    vllm_top_level_message,
    fastapi_detail,
    non_json_body,
    empty_body,
    anthropic_shaped_body_kept,
    api_key_masked,
);

golden!(meter:
    stream_start_then_deltas,
    delta_overrides_start_estimate,
    crlf_line_endings,
    truncated_stream_incomplete,
    error_event,
    json_message_body,
    json_error_body,
    data_only_frames,
);

golden!(responses_request:
    assistant_message_and_call_merged,
    calls_not_merged_across_boundaries,
    codex_shaped_turn,
    consecutive_calls_merged_in_order,
    dressage_bridge_request,
    function_output_parts_and_images_moved,
    image_by_file_id_refused,
    input_file_data_to_file_part,
    input_string_is_one_user_message,
    max_output_tokens_clamped_to_model_limit,
    max_output_tokens_field_both,
    model_override,
    no_max_tokens_invented,
    pending_reasoning_cleared_on_boundaries,
    reasoning_attached_to_standalone_call_group,
    reasoning_content_text_when_no_summary,
    reasoning_dropped_without_passback,
    reasoning_effort_forwarded_when_asked,
    reasoning_round_trip_to_reasoning_content,
    responses_only_fields_not_forwarded,
    standalone_calls_merged,
    stream_requests_include_usage,
    stream_without_include_usage_when_off,
    text_format_json_schema_to_response_format,
    text_parts_joined_by_newline,
    tool_choice_forms,
    tool_choice_unknown_object_left_to_upstream,
    tool_choice_without_tools_dropped,
    tools_function_kept_others_dropped,
    user_images_become_parts,
    user_system_and_unknown_items_end_a_call_group,
);

golden!(responses_response:
    content_parts_and_refusal_joined,
    dressage_bridge_response,
    empty_content_still_has_a_message,
    empty_tool_calls_keep_text,
    first_choice_by_index,
    length_is_still_completed,
    missing_call_id_numbered,
    missing_usage_uses_estimate,
    only_tool_calls_no_message_item,
    reasoning_field_is_reasoning_item,
    reasoning_message_and_call,
    requested_model_and_id_reported,
    text_only,
    total_tokens_missing_is_sum,
    usage_details_cached_and_reasoning,
);

golden!(responses_stream:
    arguments_before_name,
    chunks_after_completed_dropped,
    completed_waits_for_usage_chunk,
    content_parts_list_deltas,
    context_overflow_error_chunk_is_context_length_exceeded,
    continuous_usage_stats,
    dressage_text_stream,
    dressage_text_then_tool_call,
    empty_deltas_open_no_item,
    empty_response_has_an_empty_message,
    eof_without_any_chunk_fails,
    eof_without_finish_reason_fails,
    error_chunk_fails,
    length_still_completes,
    missing_call_id_generated,
    no_usage_is_estimated,
    parallel_tool_calls_interleaved,
    parallel_tool_calls_sequential,
    reasoning_field_deltas,
    reasoning_only_gets_an_empty_message,
    reasoning_then_text_with_usage_chunk,
    reasoning_then_tool_call_only,
    refusal_delta_is_text,
    requested_model_and_id_reported,
    text_after_tool_call_is_a_new_message,
    tool_call_in_one_chunk,
    tool_call_without_index,
    tool_call_without_name_fails,
    unreadable_chunk_fails,
    unreadable_first_chunk_fails,
);

#[test]
fn every_golden_dir_has_a_test() {
    let declared: BTreeSet<String> = [
        ("request", request::RULES),
        ("response", response::RULES),
        ("stream", stream::RULES),
        ("error", error::RULES),
        ("meter", meter::RULES),
        ("responses_request", responses_request::RULES),
        ("responses_response", responses_response::RULES),
        ("responses_stream", responses_stream::RULES),
    ]
    .iter()
    .flat_map(|(k, rules)| rules.iter().map(move |r| format!("{k}/{r}")))
    .collect();
    let mut found = BTreeSet::new();
    for kind in std::fs::read_dir(root()).unwrap() {
        let kind = kind.unwrap();
        for rule in std::fs::read_dir(kind.path()).unwrap() {
            let rule = rule.unwrap();
            found.insert(format!(
                "{}/{}",
                kind.file_name().to_string_lossy(),
                rule.file_name().to_string_lossy()
            ));
        }
    }
    assert_eq!(
        declared, found,
        "golden directories and declared rules differ"
    );
}
