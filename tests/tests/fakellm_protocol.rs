//! Protocol tests for `fakellm` itself: both wire formats streamed and not, exact usage, faults,
//! the request log, error shapes for bad input, and unix socket mode. Other tests trust fakellm
//! to behave like the real APIs, so this is where that trust is earned.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use agentbox_tests::harness::{FakeLlm, SseFrame, get_json, parse_sse, strs, unix_request};
use serde_json::{Value, json};

fn bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fakellm"))
}

fn start(script: &Value) -> FakeLlm {
    FakeLlm::start(bin(), script).expect("start fakellm")
}

async fn post(fake: &FakeLlm, path: &str, body: &Value) -> reqwest::Response {
    reqwest::Client::new()
        .post(format!("{}{path}", fake.base_url()))
        .header("x-api-key", "k")
        .header("anthropic-version", "2023-06-01")
        .json(body)
        .send()
        .await
        .expect("send")
}

/// [`post`], then the body as JSON.
async fn post_json(fake: &FakeLlm, path: &str, body: &Value) -> Value {
    post(fake, path, body)
        .await
        .json()
        .await
        .expect("json body")
}

fn anthropic_req(stream: bool) -> Value {
    json!({
        "model": "claude-test", "max_tokens": 1024, "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "Write", "input_schema": {"type": "object"}}]
    })
}

fn openai_req(stream: bool, include_usage: bool) -> Value {
    let mut v = json!({
        "model": "gpt-test", "stream": stream,
        "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"type": "function", "function": {"name": "write", "parameters": {}}}]
    });
    if include_usage {
        v["stream_options"] = json!({"include_usage": true});
    }
    v
}

/// A rich step: thinking, text, two tool calls, exact usage including cache numbers.
fn rich_script() -> Value {
    json!({"steps": [{
        "thinking": "Let me think about this carefully.",
        "signature": "sig-123",
        "text": "I will write two files now.",
        "tool_calls": [
            {"name": "Write", "input": {"file_path": "/w/a.txt", "content": "alpha\nbeta"}},
            {"name": "Write", "input": {"file_path": "/w/b.txt", "content": "ünïcødé ✓"}, "id": "toolu_custom"}
        ],
        "usage": {"input_tokens": 11, "output_tokens": 22,
                  "cache_read_input_tokens": 333, "cache_creation_input_tokens": 44}
    }]})
}

/// The usage of [`rich_script`] as Anthropic reports it, whole.
fn rich_usage() -> Value {
    json!({"input_tokens": 11, "cache_creation_input_tokens": 44,
           "cache_read_input_tokens": 333, "output_tokens": 22})
}

/// Appends `delta[field]` to `block[field]`, both strings.
fn append_str(block: &mut Value, field: &str, delta: &Value) {
    let joined = format!(
        "{}{}",
        block[field].as_str().unwrap(),
        delta[field].as_str().unwrap()
    );
    block[field] = json!(joined);
}

/// The `error.message` of an error response, in either API's shape.
async fn error_message(r: reqwest::Response) -> String {
    let v: Value = r.json().await.unwrap();
    v["error"]["message"].as_str().unwrap().to_owned()
}

fn data_json(frame: &SseFrame) -> Value {
    serde_json::from_str(&frame.data).unwrap_or_else(|e| panic!("bad data {frame:?}: {e}"))
}

#[tokio::test]
async fn anthropic_stream_is_well_formed_and_exact() {
    let fake = start(&rich_script());
    let resp = post(&fake, "/v1/messages?beta=true", &anthropic_req(true)).await;
    assert_eq!(resp.status(), 200);
    let content_type = resp.headers()["content-type"].to_str().unwrap();
    assert!(
        content_type.starts_with("text/event-stream"),
        "{content_type}"
    );
    let frames = parse_sse(&resp.text().await.unwrap());
    for f in &frames {
        let name = f.event.as_deref().expect("every frame has an event: line");
        assert_eq!(data_json(f)["type"], name, "event name matches data type");
    }
    let names: Vec<&str> = frames.iter().map(|f| f.event.as_deref().unwrap()).collect();
    assert_eq!(names.first(), Some(&"message_start"));
    assert_eq!(names.get(1), Some(&"ping"));
    assert_eq!(names.last(), Some(&"message_stop"));
    assert_eq!(names.get(names.len() - 2), Some(&"message_delta"));

    let start = data_json(&frames[0]);
    let msg = &start["message"];
    assert!(msg["id"].as_str().unwrap().starts_with("msg_"));
    assert_eq!(msg["type"], "message");
    assert_eq!(msg["role"], "assistant");
    assert_eq!(msg["model"], "claude-test");
    assert_eq!(msg["content"], json!([]));
    assert!(msg["stop_reason"].is_null());
    assert_eq!(msg["usage"]["input_tokens"], 11);
    assert_eq!(msg["usage"]["cache_read_input_tokens"], 333);
    assert_eq!(msg["usage"]["cache_creation_input_tokens"], 44);
    assert!(msg["usage"]["output_tokens"].as_u64().unwrap() <= 1);

    // Rebuild the content blocks from the deltas, checking index discipline on the way.
    let mut blocks: Vec<Value> = Vec::new();
    let mut open: Option<usize> = None;
    let mut json_deltas = [0_usize; 8];
    for f in &frames {
        let d = data_json(f);
        match f.event.as_deref().unwrap() {
            "content_block_start" => {
                assert!(open.is_none(), "blocks do not overlap");
                let i = d["index"].as_u64().unwrap() as usize;
                assert_eq!(i, blocks.len(), "indices are contiguous from 0");
                blocks.push(d["content_block"].clone());
                open = Some(i);
            }
            "content_block_delta" => {
                let i = d["index"].as_u64().unwrap() as usize;
                assert_eq!(Some(i), open, "delta goes to the open block");
                let b = &mut blocks[i];
                let delta = &d["delta"];
                match delta["type"].as_str().unwrap() {
                    "thinking_delta" => append_str(b, "thinking", delta),
                    "signature_delta" => b["signature"] = delta["signature"].clone(),
                    "text_delta" => append_str(b, "text", delta),
                    "input_json_delta" => {
                        assert_eq!(b["input"], json!({}), "tool_use starts with empty input");
                        json_deltas[i] += 1;
                        let acc = b
                            .get("partial")
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned();
                        b["partial"] = json!(acc + delta["partial_json"].as_str().unwrap());
                    }
                    other => panic!("unexpected delta {other}"),
                }
            }
            "content_block_stop" => {
                assert_eq!(Some(d["index"].as_u64().unwrap() as usize), open);
                open = None;
            }
            _ => {}
        }
    }
    assert_eq!(blocks.len(), 4);
    assert_eq!(blocks[0]["type"], "thinking");
    assert_eq!(blocks[0]["thinking"], "Let me think about this carefully.");
    assert_eq!(blocks[0]["signature"], "sig-123");
    assert_eq!(blocks[1]["type"], "text");
    assert_eq!(blocks[1]["text"], "I will write two files now.");
    for (i, want_input, want_id) in [
        (
            2,
            json!({"file_path": "/w/a.txt", "content": "alpha\nbeta"}),
            None,
        ),
        (
            3,
            json!({"file_path": "/w/b.txt", "content": "ünïcødé ✓"}),
            Some("toolu_custom"),
        ),
    ] {
        let b = &blocks[i];
        assert_eq!(b["type"], "tool_use");
        assert_eq!(b["name"], "Write");
        let id = b["id"].as_str().unwrap();
        match want_id {
            Some(w) => assert_eq!(id, w),
            None => assert!(id.starts_with("toolu_")),
        }
        assert!(json_deltas[i] >= 2, "arguments split over several deltas");
        let input: Value = serde_json::from_str(b["partial"].as_str().unwrap()).unwrap();
        assert_eq!(input, want_input);
    }

    let delta = data_json(&frames[frames.len() - 2]);
    assert_eq!(delta["delta"]["stop_reason"], "tool_use");
    assert!(delta["delta"]["stop_sequence"].is_null());
    assert_eq!(delta["usage"], rich_usage());
}

#[tokio::test]
async fn anthropic_non_stream_message() {
    let fake = start(&rich_script());
    let resp = post(&fake, "/v1/messages", &anthropic_req(false)).await;
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().contains_key("request-id"));
    let m: Value = resp.json().await.unwrap();
    assert_eq!(m["type"], "message");
    assert_eq!(m["role"], "assistant");
    assert_eq!(m["model"], "claude-test");
    assert_eq!(m["stop_reason"], "tool_use");
    let types: Vec<&str> = strs(&m["content"], "type");
    assert_eq!(types, ["thinking", "text", "tool_use", "tool_use"]);
    assert_eq!(m["content"][0]["signature"], "sig-123");
    assert_eq!(m["content"][3]["id"], "toolu_custom");
    assert_eq!(m["content"][3]["input"]["content"], "ünïcødé ✓");
    assert_eq!(m["usage"], rich_usage());
}

#[tokio::test]
async fn openai_stream_is_well_formed_and_exact() {
    let fake = start(&rich_script());
    let resp = post(&fake, "/v1/chat/completions", &openai_req(true, true)).await;
    assert_eq!(resp.status(), 200);
    let frames = parse_sse(&resp.text().await.unwrap());
    assert!(
        frames.iter().all(|f| f.event.is_none()),
        "OpenAI frames are data-only"
    );
    assert_eq!(frames.last().unwrap().data, "[DONE]");
    let chunks: Vec<Value> = frames[..frames.len() - 1].iter().map(data_json).collect();
    let id = chunks[0]["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    for c in &chunks {
        assert_eq!(c["object"], "chat.completion.chunk");
        assert_eq!(c["id"], id);
        assert_eq!(c["model"], "gpt-test");
    }
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");

    let (usage_chunk, body) = chunks.split_last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    assert_eq!(
        usage_chunk["usage"],
        json!({"prompt_tokens": 11 + 333 + 44, "completion_tokens": 22,
               "total_tokens": 11 + 333 + 44 + 22,
               "prompt_tokens_details": {"cached_tokens": 333}})
    );
    let (finish, deltas) = body.split_last().unwrap();
    assert_eq!(finish["choices"][0]["finish_reason"], "tool_calls");
    let mut reasoning = String::new();
    let mut content = String::new();
    let mut calls: Vec<(String, String, String, usize)> = Vec::new();
    for c in deltas {
        assert!(c["usage"].is_null(), "usage only in the last chunk");
        let choice = &c["choices"][0];
        assert!(choice["finish_reason"].is_null());
        let d = &choice["delta"];
        if let Some(r) = d["reasoning_content"].as_str() {
            reasoning.push_str(r);
        }
        if let Some(t) = d["content"].as_str() {
            content.push_str(t);
        }
        if let Some(tc) = d["tool_calls"].as_array() {
            for t in tc {
                let i = t["index"].as_u64().unwrap() as usize;
                if i == calls.len() {
                    assert_eq!(t["type"], "function");
                    calls.push((
                        t["id"]
                            .as_str()
                            .expect("first delta carries the id")
                            .to_owned(),
                        t["function"]["name"].as_str().unwrap().to_owned(),
                        String::new(),
                        0,
                    ));
                }
                let call = &mut calls[i];
                call.2
                    .push_str(t["function"]["arguments"].as_str().unwrap());
                call.3 += 1;
            }
        }
    }
    assert_eq!(reasoning, "Let me think about this carefully.");
    assert_eq!(content, "I will write two files now.");
    assert_eq!(calls.len(), 2);
    assert!(calls[0].0.starts_with("call_"));
    assert_eq!(calls[1].0, "toolu_custom");
    assert_eq!(calls[0].1, "Write");
    assert!(calls[0].3 >= 3, "name chunk plus several argument pieces");
    let args: Value = serde_json::from_str(&calls[1].2).unwrap();
    assert_eq!(
        args,
        json!({"file_path": "/w/b.txt", "content": "ünïcødé ✓"})
    );
}

#[tokio::test]
async fn openai_stream_without_usage_option_and_text_only() {
    let fake = start(
        &json!({"steps": [{"text": "hello there", "usage": {"input_tokens": 3, "output_tokens": 2}}]}),
    );
    let resp = post(&fake, "/chat/completions", &openai_req(true, false)).await;
    assert_eq!(resp.status(), 200);
    let frames = parse_sse(&resp.text().await.unwrap());
    assert_eq!(frames.last().unwrap().data, "[DONE]");
    let chunks: Vec<Value> = frames[..frames.len() - 1].iter().map(data_json).collect();
    assert!(
        chunks.iter().all(|c| c.get("usage").is_none()),
        "no usage without include_usage"
    );
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "stop"
    );
}

#[tokio::test]
async fn openai_non_stream_completion() {
    let fake = start(&rich_script());
    let resp = post(&fake, "/v1/chat/completions", &openai_req(false, false)).await;
    assert_eq!(resp.status(), 200);
    let c: Value = resp.json().await.unwrap();
    assert_eq!(c["object"], "chat.completion");
    let choice = &c["choices"][0];
    assert_eq!(choice["finish_reason"], "tool_calls");
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["message"]["content"], "I will write two files now.");
    assert_eq!(
        choice["message"]["reasoning_content"],
        "Let me think about this carefully."
    );
    let call = &choice["message"]["tool_calls"][0];
    assert_eq!(call["type"], "function");
    assert_eq!(call["function"]["name"], "Write");
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args["content"], "alpha\nbeta");
    assert_eq!(c["usage"]["prompt_tokens"], 388);
    assert_eq!(c["usage"]["completion_tokens"], 22);
    assert_eq!(c["usage"]["total_tokens"], 410);
    assert_eq!(c["usage"]["prompt_tokens_details"]["cached_tokens"], 333);
}

#[tokio::test]
async fn one_script_serves_both_apis_in_order() {
    let fake = start(&json!({"steps": [
        {"text": "first", "stop_reason": "max_tokens"},
        {"text": "second"}
    ]}));
    let a: Value = post_json(&fake, "/v1/messages", &anthropic_req(false)).await;
    assert_eq!(a["content"][0]["text"], "first");
    assert_eq!(a["stop_reason"], "max_tokens");
    // Without scripted usage the numbers are deterministic estimates, never 0.
    assert!(a["usage"]["input_tokens"].as_u64().unwrap() > 0);
    assert!(a["usage"]["output_tokens"].as_u64().unwrap() > 0);
    let o: Value = post_json(&fake, "/v1/chat/completions", &openai_req(false, false)).await;
    assert_eq!(o["choices"][0]["message"]["content"], "second");
    assert_eq!(o["choices"][0]["finish_reason"], "stop");
    assert!(o["usage"].get("prompt_tokens_details").is_none());
}

#[tokio::test]
async fn count_tokens_and_models_do_not_consume_steps() {
    let fake = start(&json!({"steps": [{"text": "only"}], "models": ["m-a", "m-b"]}));
    let body = json!({"model": "m", "messages": [{"role": "user", "content": "x".repeat(400)}]});
    let r = post(&fake, "/v1/messages/count_tokens?beta=true", &body).await;
    assert_eq!(r.status(), 200);
    let n = r.json::<Value>().await.unwrap()["input_tokens"]
        .as_u64()
        .unwrap();
    assert!(n >= 100, "bytes/4 estimate, got {n}");
    let empty = json!({"model": "m", "messages": []});
    let n = post(&fake, "/v1/messages/count_tokens", &empty)
        .await
        .json::<Value>()
        .await
        .unwrap()["input_tokens"]
        .as_u64()
        .unwrap();
    assert!(n > 0);

    let models = get_json(&format!("{}/v1/models", fake.base_url()))
        .await
        .unwrap();
    assert_eq!(models["object"], "list");
    let ids: Vec<&str> = strs(&models["data"], "id");
    assert_eq!(ids, ["m-a", "m-b"]);
    assert_eq!(models["data"][0]["object"], "model");
    assert_eq!(models["data"][0]["type"], "model");
    assert_eq!(models["data"][0]["display_name"], "m-a");

    let a: Value = post_json(&fake, "/v1/messages", &anthropic_req(false)).await;
    assert_eq!(a["content"][0]["text"], "only");
}

#[tokio::test]
async fn scripted_count_tokens() {
    let fake = start(&json!({"count_tokens": 4242}));
    let body = json!({"model": "m", "messages": []});
    let v: Value = post_json(&fake, "/v1/messages/count_tokens", &body).await;
    assert_eq!(v, json!({"input_tokens": 4242}));
}

#[tokio::test]
async fn scripted_errors_take_each_api_shape() {
    let fake = start(&json!({"steps": [
        {"error": {"status": 429, "message": "slow down"}, "headers": {"retry-after": "7"}},
        {"error": {"status": 529}},
        {"error": {"status": 403, "type": "permission_error", "message": "budget"}},
        {"error": {"status": 503, "message": "down"}},
        {"error": {"status": 418, "body": {"custom": true}}}
    ]}));
    let r = post(&fake, "/v1/messages", &anthropic_req(true)).await;
    assert_eq!(r.status(), 429);
    assert_eq!(r.headers()["retry-after"], "7");
    assert_eq!(
        r.json::<Value>().await.unwrap(),
        json!({"type": "error", "error": {"type": "rate_limit_error", "message": "slow down"}})
    );
    let r = post(&fake, "/v1/messages", &anthropic_req(false)).await;
    assert_eq!(r.status(), 529);
    assert_eq!(
        r.json::<Value>().await.unwrap()["error"]["type"],
        "overloaded_error"
    );
    let r = post(&fake, "/v1/chat/completions", &openai_req(true, true)).await;
    assert_eq!(r.status(), 403);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "permission_error");
    assert_eq!(v["error"]["message"], "budget");
    assert!(v["error"].as_object().unwrap().contains_key("param"));
    assert!(v["error"].as_object().unwrap().contains_key("code"));
    let r = post(&fake, "/v1/chat/completions", &openai_req(false, false)).await;
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "server_error");
    assert!(v.get("type").is_none(), "OpenAI shape has no envelope type");
    let r = post(&fake, "/v1/messages", &anthropic_req(false)).await;
    assert_eq!(r.status(), 418);
    assert_eq!(r.json::<Value>().await.unwrap(), json!({"custom": true}));
}

#[tokio::test]
async fn delay_holds_the_response_head() {
    let fake = start(&json!({"steps": [{"text": "late", "delay_ms": 400}, {"text": "now"}]}));
    let t = Instant::now();
    let r = post(&fake, "/v1/messages", &anthropic_req(true)).await;
    assert!(
        t.elapsed() >= Duration::from_millis(400),
        "head arrived after {:?}",
        t.elapsed()
    );
    assert_eq!(r.status(), 200);
    let t = Instant::now();
    post(&fake, "/v1/messages", &anthropic_req(true))
        .await
        .text()
        .await
        .unwrap();
    assert!(t.elapsed() < Duration::from_millis(400));
}

#[tokio::test]
async fn event_delay_spaces_frames() {
    let fake = start(&json!({"steps": [{"text": "abc", "event_delay_ms": 50}]}));
    let t = Instant::now();
    let r = post(&fake, "/v1/messages", &anthropic_req(true)).await;
    let frames = parse_sse(&r.text().await.unwrap());
    // message_start, ping, start, 3 deltas, stop, message_delta, message_stop = 9 frames.
    assert_eq!(frames.len(), 9);
    assert!(t.elapsed() >= Duration::from_millis(8 * 50));
}

/// Reads a streamed body until it ends or breaks; returns what arrived and whether it broke.
async fn read_until_break(mut resp: reqwest::Response) -> (String, bool) {
    let mut got = Vec::new();
    loop {
        match resp.chunk().await {
            Ok(Some(c)) => got.extend_from_slice(&c),
            Ok(None) => return (String::from_utf8(got).unwrap(), false),
            Err(_) => return (String::from_utf8(got).unwrap(), true),
        }
    }
}

#[tokio::test]
async fn disconnect_mid_stream_after_n_events() {
    let fake = start(&json!({"steps": [
        {"text": "a long enough answer", "disconnect_after_events": 4},
        {"text": "a long enough answer", "disconnect_after_events": 2},
        {"text": "whole answer", "disconnect_after_events": 0}
    ]}));
    let r = post(&fake, "/v1/messages", &anthropic_req(true)).await;
    assert_eq!(r.status(), 200);
    let (body, broke) = read_until_break(r).await;
    assert!(broke, "the connection must break, not end cleanly");
    let names: Vec<String> = parse_sse(&body)
        .into_iter()
        .map(|f| f.event.unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "message_start",
            "ping",
            "content_block_start",
            "content_block_delta"
        ]
    );

    let r = post(&fake, "/v1/chat/completions", &openai_req(true, true)).await;
    let (body, broke) = read_until_break(r).await;
    assert!(broke);
    assert_eq!(parse_sse(&body).len(), 2);
    assert!(!body.contains("[DONE]"));

    let r = post(&fake, "/v1/messages", &anthropic_req(false)).await;
    assert_eq!(r.status(), 200);
    let (body, broke) = read_until_break(r).await;
    assert!(broke);
    assert!(
        serde_json::from_str::<Value>(&body).is_err(),
        "only part of the JSON arrived"
    );
}

#[tokio::test]
async fn error_event_ends_the_stream() {
    let fake = start(&json!({"steps": [
        {"text": "partial answer", "error_event": {"after_events": 3, "message": "boom"}},
        {"text": "partial answer", "error_event": {"after_events": 2, "type": "server_error"}}
    ]}));
    let r = post(&fake, "/v1/messages", &anthropic_req(true)).await;
    let (body, broke) = read_until_break(r).await;
    assert!(!broke);
    let frames = parse_sse(&body);
    assert_eq!(frames.len(), 4);
    let last = frames.last().unwrap();
    assert_eq!(last.event.as_deref(), Some("error"));
    assert_eq!(
        data_json(last),
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "boom"}})
    );
    let r = post(&fake, "/v1/chat/completions", &openai_req(true, true)).await;
    let frames = parse_sse(&r.text().await.unwrap());
    assert_eq!(frames.len(), 3);
    assert_eq!(data_json(&frames[2])["error"]["type"], "server_error");
}

#[tokio::test]
async fn heartbeats_garbage_and_late_errors_for_router_stand_ins() {
    let fake = start(&json!({"steps": [
        {"text": "hi", "heartbeats": 2},
        {"text": "hello there friend", "garbage_after_events": 2},
        {"error": {"status": 413, "body": {"error": "context_overflow", "message": "long"}},
         "heartbeats": 1},
    ]}));
    let text = post(&fake, "/v1/chat/completions", &openai_req(true, true))
        .await
        .text()
        .await
        .unwrap();
    assert!(
        text.starts_with(": dressage-heartbeat\n\n: dressage-heartbeat\n\ndata: {"),
        "{text}"
    );
    assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
    let text = post(&fake, "/v1/chat/completions", &openai_req(true, true))
        .await
        .text()
        .await
        .unwrap();
    let frames = parse_sse(&text);
    assert_eq!(frames.len(), 3, "{text}");
    assert_eq!(frames[2].data, "fakellm-garbage{");
    let resp = post(&fake, "/v1/chat/completions", &openai_req(true, false)).await;
    assert_eq!(resp.status(), 200, "a late error is reported after the 200");
    let text = resp.text().await.unwrap();
    let frames = parse_sse(&text);
    let err = data_json(&frames[0]);
    assert_eq!(
        err,
        json!({"error": {"error": "context_overflow", "message": "long", "status_code": 413}})
    );
    assert_eq!(frames[1].data, "[DONE]");
}

#[tokio::test]
async fn rollout_control_calls_are_answered_and_logged_without_consuming_steps() {
    let fake = start(&json!({"steps": [{"text": "only"}]}));
    let body = json!({"session_id": "s", "instance_id": "i", "reason": "weight_update"});
    for path in ["/v1/rollout/pause", "/rollout/pause"] {
        assert_eq!(
            post_json(&fake, path, &body).await,
            json!({"quiesced": true})
        );
    }
    assert_eq!(
        post_json(&fake, "/v1/rollout/resume", &body).await,
        json!({})
    );
    let v = post_json(&fake, "/v1/chat/completions", &openai_req(false, false)).await;
    assert_eq!(v["choices"][0]["message"]["content"], "only");
    let log = fake.requests().unwrap();
    assert_eq!(log[0]["served_by"], "control");
    assert_eq!(log[0]["body"], body);
    assert_eq!(log[3]["served_by"], "step 0");
}

#[tokio::test]
async fn log_records_every_request_before_the_reply() {
    let fake = start(&json!({"steps": [{"text": "ok"}]}));
    let body = anthropic_req(true);
    let r = reqwest::Client::new()
        .post(format!("{}/v1/messages?beta=true", fake.base_url()))
        .header("authorization", "Bearer tok-1")
        .header("anthropic-beta", "a-1")
        .header("anthropic-beta", "b-2")
        .json(&body)
        .send()
        .await
        .unwrap();
    // Head received: the log line must already be there, before the body is read.
    let log = fake.requests().unwrap();
    assert_eq!(log.len(), 1);
    r.text().await.unwrap();
    let rec = &log[0];
    assert_eq!(rec["seq"], 1);
    assert!(rec["ts"].as_u64().unwrap() > 1_600_000_000_000);
    assert_eq!(rec["method"], "POST");
    assert_eq!(rec["path"], "/v1/messages?beta=true");
    assert_eq!(rec["headers"]["authorization"], "Bearer tok-1");
    assert_eq!(rec["headers"]["anthropic-beta"], "a-1, b-2");
    assert_eq!(rec["body"], body);
    assert_eq!(rec["served_by"], "step 0");

    reqwest::Client::new()
        .post(format!("{}/v1/messages", fake.base_url()))
        .body("not json {")
        .send()
        .await
        .unwrap();
    let log = fake.requests().unwrap();
    assert_eq!(log[1]["body"], "not json {");
    assert_eq!(log[1]["served_by"], "error");
}

#[tokio::test]
async fn bad_input_gets_the_real_apis_errors() {
    let fake = start(&json!({"steps": [{"text": "never"}]}));
    let client = reqwest::Client::new();
    let url = |p: &str| format!("{}{p}", fake.base_url());
    let post_raw = |p: &str, body: &'static str| client.post(url(p)).body(body).send();

    let r = post_raw("/v1/messages", "{oops").await.unwrap();
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "invalid_request_error");

    for (missing, body) in [
        ("max_tokens", json!({"model": "m", "messages": []})),
        ("messages", json!({"model": "m", "max_tokens": 5})),
        ("model", json!({"messages": [], "max_tokens": 5})),
    ] {
        let r = post(&fake, "/v1/messages", &body).await;
        assert_eq!(r.status(), 400);
        let v: Value = r.json().await.unwrap();
        assert_eq!(v["error"]["type"], "invalid_request_error");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(missing),
            "{v}"
        );
    }

    let r = post(&fake, "/v1/chat/completions", &json!({"model": "m"})).await;
    assert_eq!(r.status(), 400);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["param"], "messages");
    let r = post_raw("/v1/chat/completions", "[").await.unwrap();
    assert_eq!(r.status(), 400);
    assert!(r.json::<Value>().await.unwrap()["error"]["message"].is_string());

    let r = client.post(url("/v1/nope")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["type"], "not_found_error");
    let r = client.head(url("/api/hello")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let r = client.post(url("/v1/chat/nope")).send().await.unwrap();
    assert_eq!(r.status(), 404);
    let v: Value = r.json().await.unwrap();
    assert!(v.get("type").is_none());
    assert_eq!(v["error"]["type"], "not_found_error");

    let r = client.get(url("/v1/messages")).send().await.unwrap();
    assert_eq!(r.status(), 405);
    assert_eq!(r.json::<Value>().await.unwrap()["type"], "error");
    let r = client
        .get(url("/v1/chat/completions"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    let v: Value = r.json().await.unwrap();
    assert!(v["error"]["message"].is_string() && v.get("type").is_none());
    let r = client.post(url("/v1/models")).send().await.unwrap();
    assert_eq!(r.status(), 405);

    // None of that consumed the step.
    let v: Value = post_json(&fake, "/v1/messages", &anthropic_req(false)).await;
    assert_eq!(v["content"][0]["text"], "never");
}

#[tokio::test]
async fn exhausted_script_fails_loudly_and_fallback_answers() {
    let fake = start(&json!({"steps": [{"text": "one"}]}));
    post(&fake, "/v1/messages", &anthropic_req(false)).await;
    let r = post(&fake, "/v1/messages", &anthropic_req(false)).await;
    assert_eq!(r.status(), 500);
    assert_eq!(r.headers()["x-should-retry"], "false");
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["error"]["type"], "api_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("script exhausted")
    );
    let r = post(&fake, "/v1/chat/completions", &openai_req(false, false)).await;
    assert_eq!(r.status(), 500);
    let message = error_message(r).await;
    assert!(message.contains("fakellm"), "{message}");
    assert_eq!(fake.requests().unwrap()[1]["served_by"], "exhausted");

    let fake = start(&json!({"steps": [{"text": "one"}], "fallback": {"text": "again"}}));
    for want in ["one", "again", "again"] {
        let v: Value = post_json(&fake, "/v1/messages", &anthropic_req(false)).await;
        assert_eq!(v["content"][0]["text"], want);
    }
}

#[tokio::test]
async fn rules_answer_side_requests_without_consuming_steps() {
    let fake = start(&json!({
        "rules": [
            {"match": {"has_tools": false, "max_tokens_at_most": 1}, "text": "quota ok", "times": 1},
            {"match": {"has_tools": false}, "text": "A title"}
        ],
        "steps": [
            {"match": {"has_tools": true}, "text": "main 1"},
            {"match": {"has_tools": true, "body_contains": "tool_result"}, "text": "main 2"}
        ]
    }));
    let side = json!({"model": "haiku", "max_tokens": 1, "messages": [{"role": "user", "content": "quota"}]});
    let title = json!({"model": "haiku", "max_tokens": 512, "messages": [{"role": "user", "content": "t"}]});
    let text = |v: Value| v["content"][0]["text"].as_str().unwrap().to_owned();
    let main = anthropic_req(false);
    for (body, want) in [
        (&side, "quota ok"),
        (&side, "A title"),
        (&main, "main 1"),
        (&title, "A title"),
    ] {
        assert_eq!(text(post_json(&fake, "/v1/messages", body).await), want);
    }
    // The next step wants a tool_result: a request without one is not served by it.
    let r = post(&fake, "/v1/messages", &anthropic_req(false)).await;
    assert_eq!(r.status(), 500);
    let message = error_message(r).await;
    assert!(message.contains("did not match"), "{message}");
    let mut with_result = anthropic_req(false);
    with_result["messages"] = json!([{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "ok"}]}]);
    assert_eq!(
        text(post_json(&fake, "/v1/messages", &with_result).await),
        "main 2"
    );
    let served: Vec<String> = fake
        .requests()
        .unwrap()
        .iter()
        .map(|r| r["served_by"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(
        served,
        [
            "rule 0",
            "rule 1",
            "step 0",
            "rule 1",
            "exhausted",
            "step 1"
        ]
    );
}

#[tokio::test]
async fn unix_socket_mode() {
    let fake = FakeLlm::start_unix(
        bin(),
        &json!({"steps": [
            {"text": "over a socket", "usage": {"input_tokens": 5, "output_tokens": 6}},
            {"tool_calls": [{"name": "write", "input": {"filePath": "/x"}}]}
        ]}),
    )
    .unwrap();
    assert!(fake.address().starts_with("unix:"));
    let sock = fake.socket().unwrap();
    let body = serde_json::to_vec(&anthropic_req(true)).unwrap();
    let r = unix_request(
        sock,
        "POST",
        "/v1/messages?beta=true",
        &[("content-type", "application/json")],
        body,
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    assert!(r.headers["content-type"].starts_with("text/event-stream"));
    let frames = parse_sse(std::str::from_utf8(&r.body).unwrap());
    assert_eq!(
        frames.last().unwrap().event.as_deref(),
        Some("message_stop")
    );
    let delta = frames
        .iter()
        .find(|f| f.event.as_deref() == Some("message_delta"))
        .unwrap();
    assert_eq!(data_json(delta)["usage"]["output_tokens"], 6);

    let body = serde_json::to_vec(&openai_req(false, false)).unwrap();
    let r = unix_request(sock, "POST", "/v1/chat/completions", &[], body)
        .await
        .unwrap();
    assert_eq!(r.status, 200);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert_eq!(
        v["choices"][0]["message"]["tool_calls"][0]["function"]["name"],
        "write"
    );

    let r = unix_request(sock, "GET", "/nowhere", &[], Vec::new())
        .await
        .unwrap();
    assert_eq!(r.status, 404);
    let log = fake.requests().unwrap();
    assert_eq!(log.len(), 3);
    assert_eq!(log[0]["headers"]["host"], "localhost");
}

#[test]
fn a_bad_script_stops_fakellm_with_a_clear_message() {
    let err = FakeLlm::start(bin(), &json!({"steps": [{"txet": "typo"}]})).unwrap_err();
    let msg = err.to_string();
    assert!(
        msg.contains("invalid script") && msg.contains("txet"),
        "{msg}"
    );
    let err = FakeLlm::start(bin(), &json!({"steps": [{"error": {"status": 1000}}]})).unwrap_err();
    assert!(err.to_string().contains("invalid status"), "{err}");
}
