//! The proxy's Anthropic and Responses translations against recorded real requests of the
//! pinned Claude Code and Codex (`tests/fixtures/proxy/`, its README says how they were
//! recorded), with golden outputs.
//!
//! - Requests: each recorded model call, translated as the proxy does (its chat options and
//!   `model_override`), must equal its `upstream.expected.json`; the same body, replayed to a
//!   `blackbox-proxy` process, must reach fakellm (the router) equal to the same golden, with
//!   the rollout headers. Hand-checked invariants on each (model rewritten, system prompt first,
//!   tool names and call ids carried) keep a wrong golden from passing silently.
//! - Answers: a scripted chat completion (JSON) and chunk stream, each with text, a tool call
//!   and usage, translated back to Anthropic (message, SSE) and Responses (response, SSE) for
//!   each client's first request, against golden files; plus the same through the proxy.
//!
//! Comparisons are of parsed JSON, so key order and whitespace are free.
//! `AGENTBOX_BLESS=1 cargo nextest run -p agentbox-tests --test proxy_fixtures` rewrites the
//! expected files (review the diff). The recorders are ignored tests:
//! `cargo nextest run -p agentbox-tests --test proxy_fixtures --run-ignored only record_`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use agentbox_tests::harness::{BlackboxProxy, FakeLlm, parse_sse};
use agentbox_wire::anthropic::MessagesRequest;
use agentbox_wire::chat::ChatResponse;
use agentbox_wire::responses::ResponsesRequest;
use agentbox_wire::translate::{
    ChatOptions, ChatStreamTranslator, ResponseOptions, ResponsesOptions,
    ResponsesStreamTranslator, anthropic_into_chat, chat_to_anthropic_response,
    chat_to_responses_response, responses_into_chat,
};
use serde_json::{Value, json};

/// The proxy's `model_override` in the golden translations: the router's model name.
const ROUTER_MODEL: &str = "router-model";
/// What the answer goldens report as ids and creation time, so they do not depend on the clock.
const MESSAGE_ID: &str = "msg_golden_1";
const RESPONSE_ID: &str = "resp_golden_1";
const CREATED_AT: u64 = 1_764_547_200;

fn fakellm_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fakellm"))
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/proxy")
}

fn read_json(path: &Path) -> Value {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn write_json(path: &Path, v: &Value) {
    let mut text = serde_json::to_string_pretty(v).unwrap();
    text.push('\n');
    std::fs::write(path, text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
}

/// Compares `got` with the golden at `path` (rewriting it under `AGENTBOX_BLESS`).
fn golden(path: &Path, got: &Value) {
    if std::env::var_os("AGENTBOX_BLESS").is_some() {
        write_json(path, got);
        return;
    }
    let expected = read_json(path);
    assert_eq!(
        got,
        &expected,
        "golden {} differs\n--- got ---\n{}",
        path.display(),
        serde_json::to_string_pretty(got).unwrap()
    );
}

/// The client protocols of recorded calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Anthropic,
    Responses,
}

impl Api {
    /// The proxy's rule: a POST to a path ending in the endpoint is a model call; anything
    /// else (count_tokens, models) is forwarded untranslated.
    fn of(request: &Value) -> Option<Api> {
        const ENDPOINTS: [(&str, Api); 2] = [
            ("/messages", Api::Anthropic),
            ("/responses", Api::Responses),
        ];
        let path = request["path"].as_str().unwrap_or("");
        let path = path.split('?').next().unwrap_or(path).trim_end_matches('/');
        let (_, api) = ENDPOINTS.iter().find(|(e, _)| path.ends_with(e))?;
        (request["method"] == "POST").then_some(*api)
    }
}

/// One recorded request: its directory and `request.json`.
struct Fixture {
    dir: PathBuf,
    request: Value,
}

impl Fixture {
    fn name(&self) -> String {
        let client = self.dir.parent().unwrap().file_name().unwrap();
        let call = self.dir.file_name().unwrap();
        format!("{}/{}", client.to_string_lossy(), call.to_string_lossy())
    }

    fn api(&self) -> Option<Api> {
        Api::of(&self.request)
    }

    fn body(&self) -> &Value {
        &self.request["body"]
    }
}

/// The recorded requests of `client`, in recording order.
fn fixtures(client: &str) -> Vec<Fixture> {
    let dir = root().join(client);
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.join("request.json").is_file())
        .collect();
    dirs.sort();
    assert!(!dirs.is_empty(), "no fixtures under {}", dir.display());
    dirs.into_iter()
        .map(|dir| Fixture {
            request: read_json(&dir.join("request.json")),
            dir,
        })
        .collect()
}

/// The chat body the proxy sends the router for a model call, with `ROUTER_MODEL` as its
/// `model_override` (its policy: the model replaced, `stream_options.include_usage` on streams
/// and dropped otherwise; no default temperature).
fn upstream_of(f: &Fixture) -> Value {
    let mut chat = match f.api().unwrap() {
        Api::Anthropic => {
            let req: MessagesRequest = serde_json::from_value(f.body().clone()).unwrap();
            anthropic_into_chat(req, &ChatOptions::router()).unwrap()
        }
        Api::Responses => {
            let req: ResponsesRequest = serde_json::from_value(f.body().clone()).unwrap();
            responses_into_chat(req, &ChatOptions::router()).unwrap()
        }
    };
    chat.model = ROUTER_MODEL.to_owned();
    let mut v = serde_json::to_value(&chat).unwrap();
    if chat.stream == Some(true) {
        v["stream_options"]["include_usage"] = json!(true);
    } else if let Some(o) = v.as_object_mut() {
        o.remove("stream_options");
    }
    v
}

/// The text of a system prompt, a message content or an instructions field, whatever its form.
fn text_of(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts
            .iter()
            .map(|p| p["text"].as_str().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n"),
        Value::Object(_) => v["text"].as_str().unwrap_or("").to_owned(),
        Value::Null | Value::Bool(_) | Value::Number(_) => String::new(),
    }
}

/// The texts of a client request's system prompt: Anthropic's `system` blocks but the billing
/// header; Responses' `instructions` and its developer and system messages.
fn system_parts(api: Api, body: &Value) -> Vec<String> {
    let mut parts: Vec<String> = match api {
        Api::Anthropic => match &body["system"] {
            Value::Array(blocks) => blocks.iter().map(text_of).collect(),
            other @ (Value::Null
            | Value::Bool(_)
            | Value::Number(_)
            | Value::String(_)
            | Value::Object(_)) => vec![text_of(other)],
        },
        Api::Responses => {
            let mut p = vec![text_of(&body["instructions"])];
            for item in body["input"].as_array().into_iter().flatten() {
                if item["type"] == "message"
                    && matches!(item["role"].as_str(), Some("developer" | "system"))
                {
                    p.push(text_of(&item["content"]));
                }
            }
            p
        }
    };
    parts.retain(|p| !p.trim().is_empty() && !p.starts_with("x-anthropic-billing-header"));
    parts
}

/// Every text block of a client request's messages (tool results aside).
fn conversation_texts(api: Api, body: &Value) -> Vec<String> {
    let items = match api {
        Api::Anthropic => &body["messages"],
        Api::Responses => &body["input"],
    };
    let mut out = Vec::new();
    for m in items.as_array().into_iter().flatten() {
        match &m["content"] {
            Value::String(s) => out.push(s.clone()),
            Value::Array(parts) => out.extend(
                parts
                    .iter()
                    .filter(|p| {
                        p["type"] == "text"
                            || p["type"] == "input_text"
                            || p["type"] == "output_text"
                    })
                    .filter_map(|p| p["text"].as_str().map(str::to_owned)),
            ),
            Value::Null | Value::Bool(_) | Value::Number(_) | Value::Object(_) => {}
        }
    }
    out.retain(|t| !t.trim().is_empty());
    out
}

/// The tool names a client request offers (function tools only for Responses: the proxy drops
/// the others).
fn client_tool_names(api: Api, body: &Value) -> Vec<String> {
    let tools = body["tools"].as_array().cloned().unwrap_or_default();
    tools
        .iter()
        .filter(|t| api == Api::Anthropic || t["type"] == "function")
        .filter_map(|t| t["name"].as_str().map(str::to_owned))
        .collect()
}

/// The tool call ids of a client request's history: (calls, results).
fn client_call_ids(api: Api, body: &Value) -> (Vec<String>, Vec<String>) {
    let mut calls = Vec::new();
    let mut results = Vec::new();
    let s = |v: &Value| v.as_str().unwrap_or("").to_owned();
    match api {
        Api::Anthropic => {
            for m in body["messages"].as_array().unwrap() {
                for b in m["content"].as_array().into_iter().flatten() {
                    match b["type"].as_str() {
                        Some("tool_use") => calls.push(s(&b["id"])),
                        Some("tool_result") => results.push(s(&b["tool_use_id"])),
                        _ => {}
                    }
                }
            }
        }
        Api::Responses => {
            for item in body["input"].as_array().into_iter().flatten() {
                match item["type"].as_str() {
                    Some("function_call") => calls.push(s(&item["call_id"])),
                    Some("function_call_output") => results.push(s(&item["call_id"])),
                    _ => {}
                }
            }
        }
    }
    (calls, results)
}

/// Invariants every translated call must hold, checked by hand so a wrong golden is caught.
fn check_upstream(f: &Fixture, up: &Value) {
    let name = f.name();
    let api = f.api().unwrap();
    let body = f.body();
    assert_eq!(up["model"], ROUTER_MODEL, "{name}: model not rewritten");
    let messages = up["messages"].as_array().unwrap();
    // One system message, first, carrying every part of the client's system prompt.
    let system = text_of(&messages[0]["content"]);
    let parts = system_parts(api, body);
    assert!(!parts.is_empty(), "{name}: no system prompt recorded");
    assert_eq!(messages[0]["role"], "system", "{name}: system not first");
    let systems = messages.iter().filter(|m| m["role"] == "system").count();
    assert_eq!(systems, 1, "{name}: system messages");
    for part in &parts {
        let first_line = part.lines().find(|l| !l.trim().is_empty()).unwrap();
        assert!(
            system.contains(first_line.trim()),
            "{name}: the system message lacks {first_line:?}"
        );
    }
    // Claude Code's billing header is not a prompt: the proxy strips it.
    assert!(!system.contains("x-anthropic-billing-header"), "{name}");
    // Every offered tool is offered upstream, under its own name (all are short).
    let offered: Vec<&str> = up["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    let tools = client_tool_names(api, body);
    assert_eq!(offered.len(), tools.len(), "{name}: tool count");
    for t in &tools {
        assert!(offered.contains(&t.as_str()), "{name}: tool {t} lost");
    }
    // Every call and result id of the history is carried, in a call and a tool message.
    let (calls, results) = client_call_ids(api, body);
    let up_calls: Vec<&str> = messages
        .iter()
        .flat_map(|m| m["tool_calls"].as_array().into_iter().flatten())
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    let up_results: Vec<&str> = messages
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| m["tool_call_id"].as_str().unwrap())
        .collect();
    assert_eq!(up_calls, calls, "{name}: tool call ids");
    assert_eq!(up_results, results, "{name}: tool result ids");
    // No text of the conversation is lost (Claude Code's inline system message is folded into
    // the user turn, Codex's developer messages into the system message).
    let upstream_text: String = messages
        .iter()
        .map(|m| text_of(&m["content"]))
        .collect::<Vec<_>>()
        .join("\n");
    for text in conversation_texts(api, body) {
        assert!(
            upstream_text.contains(text.trim()),
            "{name}: text lost: {:?}",
            text.chars().take(80).collect::<String>()
        );
    }
    // Streaming is kept, with usage asked for.
    let stream = body["stream"] == true;
    assert_eq!(up["stream"] == true, stream, "{name}: stream flag");
    if stream {
        assert_eq!(up["stream_options"]["include_usage"], true, "{name}");
    }
}

fn check_requests(client: &str) -> usize {
    let mut checked = 0;
    for f in fixtures(client) {
        if f.api().is_none() {
            continue;
        }
        let up = upstream_of(&f);
        check_upstream(&f, &up);
        golden(&f.dir.join("upstream.expected.json"), &up);
        checked += 1;
    }
    checked
}

#[test]
fn claude_code_requests_translate_to_the_goldens() {
    let n = check_requests("claude_code");
    assert!(n >= 3, "only {n} recorded model calls");
}

#[test]
fn codex_requests_translate_to_the_goldens() {
    let n = check_requests("codex");
    assert!(n >= 3, "only {n} recorded model calls");
}

/// The recordings hold the shapes the issue asks for: a first call with a system prompt and
/// the full tool list, a follow-up carrying a call and its result, streamed calls.
#[test]
fn the_recordings_cover_the_shapes() {
    for client in ["claude_code", "codex"] {
        let all = fixtures(client);
        let calls: Vec<&Fixture> = all.iter().filter(|f| f.api().is_some()).collect();
        let first = calls
            .iter()
            .find(|f| f.name().ends_with("_first"))
            .unwrap_or_else(|| panic!("{client}: no first call"));
        let api = first.api().unwrap();
        assert!(client_tool_names(api, first.body()).len() >= 5, "{client}");
        let paired = calls.iter().any(|f| {
            let (c, r) = client_call_ids(f.api().unwrap(), f.body());
            !c.is_empty() && c == r
        });
        assert!(paired, "{client}: no call/result pair recorded");
        assert!(calls.iter().any(|f| f.body()["stream"] == true), "{client}");
    }
}

// ---- answers ------------------------------------------------------------------------------

/// The options the proxy answers `f` with, with fixed ids and time.
fn anthropic_options(f: &Fixture) -> ResponseOptions {
    let req: MessagesRequest = serde_json::from_value(f.body().clone()).unwrap();
    ResponseOptions {
        message_id: Some(MESSAGE_ID.to_owned()),
        ..ResponseOptions::for_request(&req)
    }
}

fn responses_options(f: &Fixture) -> ResponsesOptions {
    let req: ResponsesRequest = serde_json::from_value(f.body().clone()).unwrap();
    ResponsesOptions {
        response_id: Some(RESPONSE_ID.to_owned()),
        created_at: Some(CREATED_AT),
        ..ResponsesOptions::for_request(&req)
    }
}

/// SSE text as `[{event, data}]`, data parsed when it is JSON.
fn sse_json(text: &str) -> Value {
    parse_sse(text)
        .into_iter()
        .map(|f| {
            let data = serde_json::from_str(&f.data).unwrap_or(Value::String(f.data));
            json!({"event": f.event, "data": data})
        })
        .collect()
}

/// The chunks fixture fed as the proxy feeds a stream: each chunk's data, `[DONE]`, the end.
fn feed<T, E>(
    t: &mut T,
    chunks: &Value,
    start: fn(&mut T) -> Vec<E>,
    push: fn(&mut T, &str) -> Vec<E>,
    finish: fn(&mut T) -> Vec<E>,
    write: fn(&E, &mut Vec<u8>) -> Result<(), serde_json::Error>,
) -> Value {
    let mut events = start(t);
    for c in chunks.as_array().unwrap() {
        events.extend(push(t, &c.to_string()));
    }
    events.extend(push(t, "[DONE]"));
    events.extend(finish(t));
    let mut out = Vec::new();
    for e in &events {
        write(e, &mut out).unwrap();
    }
    sse_json(&String::from_utf8(out).unwrap())
}

/// The first recorded model call of `client` (the answers are for it).
fn first_call(client: &str) -> Fixture {
    fixtures(client)
        .into_iter()
        .find(|f| f.api().is_some())
        .unwrap()
}

/// The scripted chat answer's facts every translation must carry.
struct Facts {
    text: String,
    call_id: String,
    tool: String,
    arguments: Value,
    prompt: u64,
    completion: u64,
    cached: u64,
}

fn facts(chat: &Value) -> Facts {
    let m = &chat["choices"][0]["message"];
    let call = &m["tool_calls"][0];
    let u = &chat["usage"];
    Facts {
        text: m["content"].as_str().unwrap().to_owned(),
        call_id: call["id"].as_str().unwrap().to_owned(),
        tool: call["function"]["name"].as_str().unwrap().to_owned(),
        arguments: serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap(),
        prompt: u["prompt_tokens"].as_u64().unwrap(),
        completion: u["completion_tokens"].as_u64().unwrap(),
        cached: u["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap(),
    }
}

/// An Anthropic message (from JSON or rebuilt from SSE) against the facts.
fn check_anthropic_message(what: &str, model: &Value, msg: &Value, x: &Facts) {
    assert_eq!(&msg["model"], model, "{what}: model");
    assert_eq!(msg["stop_reason"], "tool_use", "{what}");
    let content = msg["content"].as_array().unwrap();
    assert_eq!(content[0]["type"], "text", "{what}");
    assert_eq!(content[0]["text"], x.text.as_str(), "{what}");
    let tool = content.iter().find(|b| b["type"] == "tool_use").unwrap();
    assert_eq!(tool["id"], x.call_id.as_str(), "{what}");
    assert_eq!(tool["name"], x.tool.as_str(), "{what}");
    assert_eq!(tool["input"], x.arguments, "{what}");
    let u = &msg["usage"];
    assert_eq!(u["output_tokens"], x.completion, "{what}");
    assert_eq!(u["cache_read_input_tokens"], x.cached, "{what}");
    assert_eq!(u["input_tokens"], x.prompt - x.cached, "{what}");
}

/// A Responses response (JSON or `response.completed`'s) against the facts.
fn check_responses_response(what: &str, model: &Value, resp: &Value, x: &Facts) {
    assert_eq!(&resp["model"], model, "{what}: model");
    assert_eq!(resp["status"], "completed", "{what}");
    let output = resp["output"].as_array().unwrap();
    let message = output.iter().find(|i| i["type"] == "message").unwrap();
    assert_eq!(message["content"][0]["text"], x.text.as_str(), "{what}");
    let call = output
        .iter()
        .find(|i| i["type"] == "function_call")
        .unwrap();
    assert_eq!(call["call_id"], x.call_id.as_str(), "{what}");
    assert_eq!(call["name"], x.tool.as_str(), "{what}");
    let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, x.arguments, "{what}");
    let u = &resp["usage"];
    assert_eq!(u["input_tokens"], x.prompt, "{what}");
    assert_eq!(u["output_tokens"], x.completion, "{what}");
    assert_eq!(
        u["input_tokens_details"]["cached_tokens"], x.cached,
        "{what}"
    );
}

/// Rebuilds the Anthropic message an SSE stream delivers (`[{event, data}]`).
fn anthropic_from_sse(events: &Value) -> Value {
    let events = events.as_array().unwrap();
    let names: Vec<&str> = events.iter().filter_map(|e| e["event"].as_str()).collect();
    assert_eq!(names.first(), Some(&"message_start"), "{names:?}");
    assert_eq!(names.last(), Some(&"message_stop"), "{names:?}");
    let mut msg = events[0]["data"]["message"].clone();
    let mut blocks: Vec<Value> = Vec::new();
    let mut json_parts: Vec<String> = Vec::new();
    for e in events {
        let d = &e["data"];
        match e["event"].as_str().unwrap_or("") {
            "content_block_start" => {
                blocks.push(d["content_block"].clone());
                json_parts.push(String::new());
            }
            "content_block_delta" => {
                let i = usize::try_from(d["index"].as_u64().unwrap()).unwrap();
                match d["delta"]["type"].as_str().unwrap() {
                    "text_delta" => {
                        let t = format!(
                            "{}{}",
                            blocks[i]["text"].as_str().unwrap_or(""),
                            d["delta"]["text"].as_str().unwrap()
                        );
                        blocks[i]["text"] = json!(t);
                    }
                    "input_json_delta" => {
                        json_parts[i].push_str(d["delta"]["partial_json"].as_str().unwrap());
                    }
                    other => panic!("unexpected delta {other}"),
                }
            }
            "message_delta" => {
                msg["stop_reason"] = d["delta"]["stop_reason"].clone();
                for (k, v) in d["usage"].as_object().unwrap() {
                    msg["usage"][k] = v.clone();
                }
            }
            _ => {}
        }
    }
    for (b, j) in blocks.iter_mut().zip(json_parts) {
        if b["type"] == "tool_use" && !j.is_empty() {
            b["input"] = serde_json::from_str(&j).unwrap();
        }
    }
    msg["content"] = Value::Array(blocks);
    msg
}

/// The last event's response of a Responses SSE stream (`response.completed`).
fn responses_from_sse(events: &Value) -> Value {
    let events = events.as_array().unwrap();
    let last = events.last().unwrap();
    assert_eq!(last["event"], "response.completed", "{last}");
    assert_eq!(events[0]["event"], "response.created");
    last["data"]["response"].clone()
}

fn answers_dir(client: &str) -> PathBuf {
    root().join("answers").join(client)
}

/// A client's answer fixtures and the call they answer.
struct Answer {
    call: Fixture,
    dir: PathBuf,
    chat: ChatResponse,
    chunks: Value,
    facts: Facts,
    model: Value,
}

fn answer(client: &str) -> Answer {
    let call = first_call(client);
    let dir = answers_dir(client);
    let chat = read_json(&dir.join("chat.json"));
    Answer {
        facts: facts(&chat),
        chat: serde_json::from_value(chat).unwrap(),
        chunks: read_json(&dir.join("chunks.json")),
        model: call.body()["model"].clone(),
        dir,
        call,
    }
}

#[test]
fn claude_code_answers_translate_to_the_goldens() {
    let a = answer("claude_code");
    let msg = chat_to_anthropic_response(a.chat.clone(), &anthropic_options(&a.call)).unwrap();
    let msg = serde_json::to_value(msg).unwrap();
    check_anthropic_message("json", &a.model, &msg, &a.facts);
    golden(&a.dir.join("message.expected.json"), &msg);

    let sse = feed(
        &mut ChatStreamTranslator::new(anthropic_options(&a.call)),
        &a.chunks,
        ChatStreamTranslator::start,
        ChatStreamTranslator::push_data,
        ChatStreamTranslator::finish,
        agentbox_wire::anthropic::StreamEvent::write_sse,
    );
    check_anthropic_message("sse", &a.model, &anthropic_from_sse(&sse), &a.facts);
    golden(&a.dir.join("sse.expected.json"), &sse);
}

#[test]
fn codex_answers_translate_to_the_goldens() {
    let a = answer("codex");
    let resp = chat_to_responses_response(a.chat.clone(), &responses_options(&a.call)).unwrap();
    let resp = serde_json::to_value(resp).unwrap();
    check_responses_response("json", &a.model, &resp, &a.facts);
    assert_eq!(resp["id"], RESPONSE_ID);
    golden(&a.dir.join("response.expected.json"), &resp);

    let sse = feed(
        &mut ResponsesStreamTranslator::new(responses_options(&a.call)),
        &a.chunks,
        ResponsesStreamTranslator::start,
        ResponsesStreamTranslator::push_data,
        ResponsesStreamTranslator::finish,
        agentbox_wire::responses::ResponseStreamEvent::write_sse,
    );
    check_responses_response("sse", &a.model, &responses_from_sse(&sse), &a.facts);
    golden(&a.dir.join("sse.expected.json"), &sse);
}

// ---- through the proxy process ------------------------------------------------------------

/// The headers a replayed call carries: the recorded ones but those of the connection.
fn replay_headers(request: &Value) -> reqwest::header::HeaderMap {
    let mut h = reqwest::header::HeaderMap::new();
    for (k, v) in request["headers"].as_object().unwrap() {
        if matches!(k.as_str(), "host" | "content-length" | "connection") {
            continue;
        }
        h.insert(
            reqwest::header::HeaderName::try_from(k.as_str()).unwrap(),
            reqwest::header::HeaderValue::try_from(v.as_str().unwrap()).unwrap(),
        );
    }
    h
}

/// Replays every recorded model call of `client` to a `blackbox-proxy` (with `ROUTER_MODEL` as
/// its model override) in front of fakellm, which answers each with the answer fixture's text,
/// tool call and usage. Checks what fakellm received against the request goldens and the
/// rollout headers, and what the client got back against the answer's facts.
async fn replay_through_proxy(client: &str) {
    let chat = read_json(&answers_dir(client).join("chat.json"));
    let x = facts(&chat);
    let script = json!({"fallback": {
        "text": x.text,
        "tool_calls": [{"id": x.call_id, "name": x.tool, "input": x.arguments}],
        "usage": {"input_tokens": x.prompt - x.cached, "output_tokens": x.completion,
                  "cache_read_input_tokens": x.cached},
    }});
    let fake = FakeLlm::start(fakellm_bin(), &script).unwrap();
    let proxy = BlackboxProxy::start(
        &fake.base_url(),
        &[
            "--model-override",
            ROUTER_MODEL,
            "--session-id",
            "sess-fixture",
        ],
    )
    .unwrap();
    let http = reqwest::Client::new();
    let mut replayed = 0;
    for f in fixtures(client) {
        let Some(api) = f.api() else { continue };
        let name = f.name();
        let url = format!(
            "{}{}",
            proxy.base_url(),
            f.request["path"].as_str().unwrap()
        );
        let resp = http
            .post(&url)
            .headers(replay_headers(&f.request))
            .body(f.body().to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200, "{name}");
        let text = resp.text().await.unwrap();
        let seen = fake.chat_requests().unwrap();
        let seen = seen.last().unwrap();
        // What the router received is the golden.
        let expected = read_json(&f.dir.join("upstream.expected.json"));
        assert_eq!(
            seen["body"], expected,
            "{name}: the proxy sent something else"
        );
        let h = &seen["headers"];
        assert_eq!(h["x-session-id"], "sess-fixture", "{name}");
        assert_eq!(h["x-smg-routing-key"], "sess-fixture", "{name}");
        assert_eq!(h["x-instance-id"], "inst-001", "{name}");
        assert_eq!(h["x-dressage-partial-rollout"], "1", "{name}");
        // What the client got back.
        let model = f.body()["model"].clone();
        let stream = f.body()["stream"] == true;
        match (api, stream) {
            (Api::Anthropic, true) => {
                check_anthropic_message(&name, &model, &anthropic_from_sse(&sse_json(&text)), &x);
            }
            (Api::Anthropic, false) => {
                check_anthropic_message(&name, &model, &serde_json::from_str(&text).unwrap(), &x);
            }
            (Api::Responses, true) => {
                check_responses_response(&name, &model, &responses_from_sse(&sse_json(&text)), &x);
            }
            (Api::Responses, false) => {
                check_responses_response(&name, &model, &serde_json::from_str(&text).unwrap(), &x);
            }
        }
        replayed += 1;
    }
    assert!(replayed >= 3, "{client}: only {replayed} calls replayed");
}

#[tokio::test]
async fn claude_code_calls_through_the_proxy_process() {
    replay_through_proxy("claude_code").await;
}

#[tokio::test]
async fn codex_calls_through_the_proxy_process() {
    replay_through_proxy("codex").await;
}

// ---- recording ----------------------------------------------------------------------------

#[path = "proxy_fixtures/record.rs"]
mod record;

/// Records Claude Code's calls afresh into `fixtures/proxy/claude_code/` (then bless the
/// goldens).
#[tokio::test]
#[ignore = "re-records the fixtures from the real Claude Code; run on purpose"]
async fn record_claude_code() {
    record::record(&record::CLAUDE_CODE, &root()).await;
}

/// Records Codex's calls afresh into `fixtures/proxy/codex/` (then bless the goldens).
#[tokio::test]
#[ignore = "re-records the fixtures from the real Codex; run on purpose"]
async fn record_codex() {
    record::record(&record::CODEX, &root()).await;
}
