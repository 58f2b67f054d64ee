//! blackbox-server's rollout LLM proxy (`blackbox-proxy`, the same proxy run alone with a
//! control API) as a process in front of `fakellm` as a process, the router stand-in: the tags
//! every model call carries (and the client copies it drops), chat passthrough and Anthropic /
//! Responses translation streamed and not, the turn's usage counts against fakellm's scripted
//! usage, max_steps, pause and resume, drain, the sampling policy, and what the agent gets when
//! the router fails before or during a stream.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use agentbox_tests::harness::{BlackboxProxy, FakeLlm, get_json, parse_sse};
use serde_json::{Value, json};

fn fakellm(script: &Value) -> FakeLlm {
    FakeLlm::start(env!("CARGO_BIN_EXE_fakellm").as_ref(), script).unwrap()
}

fn start(script: &Value, args: &[&str]) -> (FakeLlm, BlackboxProxy) {
    let fake = fakellm(script);
    let proxy = BlackboxProxy::start(&fake.base_url(), args).unwrap();
    (fake, proxy)
}

/// The `type` of each object in the array at `v[key]`.
fn types<'a>(v: &'a Value, key: &str) -> Vec<&'a str> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("no {key} in {v}"))
        .iter()
        .map(|i| i["type"].as_str().unwrap())
        .collect()
}

/// The `event:` names of an SSE body's frames.
fn event_names(frames: &[agentbox_tests::harness::SseFrame]) -> Vec<&str> {
    frames.iter().filter_map(|f| f.event.as_deref()).collect()
}

struct Reply {
    status: u16,
    headers: reqwest::header::HeaderMap,
    text: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("{e}: {}", self.text))
    }

    /// The body of a 200 answer, as JSON.
    fn ok_json(&self) -> Value {
        assert_eq!(self.status, 200, "{}", self.text);
        self.json()
    }

    /// The frames of a 200 event stream whose first and last events are `first` and `last`.
    fn events(&self, first: &str, last: &str) -> Vec<agentbox_tests::harness::SseFrame> {
        assert_eq!(self.status, 200, "{}", self.text);
        let frames = parse_sse(&self.text);
        let names = event_names(&frames);
        assert_eq!(names.first(), Some(&first), "{}", self.text);
        assert_eq!(names.last(), Some(&last), "{}", self.text);
        frames
    }
}

async fn post(proxy: &BlackboxProxy, path: &str, body: &Value, headers: &[(&str, &str)]) -> Reply {
    post_url(format!("{}{path}", proxy.base_url()), body, headers).await
}

/// [`post`] to a whole URL (for a call made from a spawned task).
async fn post_url(url: String, body: &Value, headers: &[(&str, &str)]) -> Reply {
    let mut req = reqwest::Client::new().post(url).json(body);
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    read_reply(req).await
}

/// Sends `req` and reads the answer whole.
async fn read_reply(req: reqwest::RequestBuilder) -> Reply {
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    let headers = resp.headers().clone();
    // A broken body still yields what arrived: read chunk by chunk.
    let mut text = Vec::new();
    let mut resp = resp;
    while let Ok(Some(chunk)) = resp.chunk().await {
        text.extend_from_slice(&chunk);
    }
    Reply {
        status,
        headers,
        text: String::from_utf8(text).unwrap(),
    }
}

async fn control(proxy: &BlackboxProxy, path: &str, body: Option<&Value>) -> Value {
    let (status, v) = proxy.control(path, body).await.unwrap();
    assert!((200..300).contains(&status), "{path}: {status} {v}");
    v
}

async fn open_turn(proxy: &BlackboxProxy, turn: &str) {
    control(
        proxy,
        "/turn/open",
        Some(&json!({"turn_id": turn, "backend_session_id": "oc-1"})),
    )
    .await;
}

async fn clear_turn(proxy: &BlackboxProxy) -> Value {
    control(proxy, "/turn/clear", Some(&json!({}))).await["counts"].clone()
}

/// Checks a turn's counts: steps, input tokens, output tokens and tool calls.
fn assert_counts(counts: &Value, expected: [u64; 4]) {
    for (key, want) in ["steps", "input_tokens", "output_tokens", "tool_calls"]
        .into_iter()
        .zip(expected)
    {
        assert_eq!(counts[key], want, "{key}: {counts}");
    }
}

/// The requests fakellm got on its chat completions endpoint.
fn upstream_calls(fake: &FakeLlm) -> Vec<Value> {
    fake.requests()
        .unwrap()
        .into_iter()
        .filter(|r| r["path"] == "/v1/chat/completions")
        .collect()
}

fn chat(stream: bool) -> Value {
    json!({"model": "agent-model", "messages": [{"role": "user", "content": "hi"}], "stream": stream})
}

fn anthropic(stream: bool) -> Value {
    json!({"model": "claude-x", "max_tokens": 64, "stream": stream,
           "messages": [{"role": "user", "content": "hi"}]})
}

fn responses(stream: bool) -> Value {
    json!({"model": "codex-x", "instructions": "be brief", "stream": stream,
           "input": [{"type": "message", "role": "user",
                      "content": [{"type": "input_text", "text": "hi"}]}]})
}

const FORGED: [(&str, &str); 6] = [
    ("x-session-id", "forged-session"),
    ("x-instance-id", "forged-instance"),
    ("x-turn-id", "forged-turn"),
    ("x-smg-routing-key", "forged-key"),
    ("x-dressage-partial-rollout", "0"),
    ("x-dressage-sandbox-id", "forged-sandbox"),
];

#[tokio::test]
async fn every_model_call_is_tagged_and_client_copies_are_dropped() {
    let (fake, proxy) = start(
        &json!({"fallback": {"text": "ok"}}),
        &[
            "--session-id",
            "sess-7",
            "--instance-id",
            "inst-7",
            "--sandbox-id",
            "sb-7",
        ],
    );
    // Outside a turn: tagged, but no turn id.
    let r = post(&proxy, "/v1/chat/completions", &chat(false), &FORGED).await;
    assert_eq!(r.status, 200, "{}", r.text);
    open_turn(&proxy, "turn-1").await;
    for (path, body) in [
        ("/v1/chat/completions", chat(false)),
        ("/v1/chat/completions", chat(true)),
        ("/v1/messages", anthropic(false)),
        ("/v1/messages?beta=true", anthropic(true)),
        ("/v1/responses", responses(false)),
        ("/v1/responses", responses(true)),
    ] {
        let mut headers = FORGED.to_vec();
        headers.push(("anthropic-version", "2023-06-01"));
        headers.push(("x-stainless-lang", "js"));
        headers.push(("authorization", "Bearer agent-key"));
        let r = post(&proxy, path, &body, &headers).await;
        assert_eq!(r.status, 200, "{path}: {}", r.text);
    }
    clear_turn(&proxy).await;
    let calls = upstream_calls(&fake);
    assert_eq!(calls.len(), 7, "{calls:#?}");
    for (i, c) in calls.iter().enumerate() {
        let h = &c["headers"];
        assert_eq!(h["x-smg-routing-key"], "sess-7", "{c}");
        assert_eq!(h["x-session-id"], "sess-7", "{c}");
        assert_eq!(h["x-instance-id"], "inst-7", "{c}");
        assert_eq!(h["x-dressage-sandbox-id"], "sb-7", "{c}");
        assert_eq!(h["x-dressage-partial-rollout"], "1", "{c}");
        assert_eq!(h["accept-encoding"], "identity", "{c}");
        if i == 0 {
            assert!(h.get("x-turn-id").is_none(), "untagged outside a turn: {c}");
        } else {
            assert_eq!(h["x-turn-id"], "turn-1", "{c}");
            assert_eq!(h["authorization"], "Bearer agent-key", "{c}");
        }
        if (3..5).contains(&i) {
            for gone in ["anthropic-version", "x-stainless-lang"] {
                assert!(h.get(gone).is_none(), "{gone} reached the router: {c}");
            }
        }
    }
}

#[tokio::test]
async fn the_sticky_header_name_is_configurable() {
    let (fake, proxy) = start(
        &json!({"fallback": {"text": "ok"}}),
        &["--sticky-header", "X-Route-Key"],
    );
    let r = post(
        &proxy,
        "/v1/chat/completions",
        &chat(false),
        &[("x-route-key", "forged")],
    )
    .await;
    assert_eq!(r.status, 200);
    let h = &upstream_calls(&fake)[0]["headers"];
    assert_eq!(h["x-route-key"], "sess-001");
    assert!(h.get("x-smg-routing-key").is_none());
}

#[tokio::test]
async fn chat_passes_through_streamed_and_not_and_usage_is_counted() {
    let script = json!({"steps": [
        {"text": "one", "usage": {"input_tokens": 10, "output_tokens": 3}},
        {"text": "two", "tool_calls": [{"name": "Bash", "input": {"cmd": "ls"}},
                                      {"name": "Read", "input": {"path": "a"}}],
         "usage": {"input_tokens": 20, "output_tokens": 5, "cache_read_input_tokens": 100}},
    ]});
    let (fake, proxy) = start(&script, &[]);
    open_turn(&proxy, "t1").await;
    let r = post(&proxy, "/v1/chat/completions", &chat(false), &[]).await;
    let v = r.ok_json();
    assert_eq!(v["choices"][0]["message"]["content"], "one");
    assert_eq!(v["usage"]["prompt_tokens"], 10);
    // The client asked for no usage in its stream; the router is asked for it anyway.
    let mut body = chat(true);
    body["stream_options"] = json!({"include_usage": false, "extra": "keep-me"});
    let r = post(&proxy, "/v1/chat/completions", &body, &[]).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(
        r.headers["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let frames = parse_sse(&r.text);
    assert_eq!(frames.last().unwrap().data, "[DONE]", "{}", r.text);
    assert!(r.text.contains("\"tool_calls\""), "{}", r.text);
    let counts = clear_turn(&proxy).await;
    assert_eq!(
        counts,
        json!({"steps": 2, "input_tokens": 130, "output_tokens": 8, "reasoning_tokens": 0,
               "total_tokens": 138, "tool_calls": 2})
    );
    let calls = upstream_calls(&fake);
    assert_eq!(
        calls[0]["body"],
        chat(false),
        "unchanged bodies pass as sent"
    );
    assert_eq!(
        calls[1]["body"]["stream_options"],
        json!({"include_usage": true, "extra": "keep-me"})
    );
}

#[tokio::test]
async fn anthropic_is_sent_as_chat_and_answered_as_anthropic() {
    let script = json!({"steps": [
        {"thinking": "hmm", "text": "visible", "tool_calls": [{"name": "Bash", "input": {"cmd": "ls"}}],
         "usage": {"input_tokens": 7, "output_tokens": 4}},
        {"text": "streamed", "usage": {"input_tokens": 9, "output_tokens": 2}},
    ]});
    let (fake, proxy) = start(&script, &[]);
    open_turn(&proxy, "t1").await;
    let mut body = anthropic(false);
    body["system"] = json!("be brief");
    body["tools"] =
        json!([{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}]);
    let r = post(&proxy, "/v1/messages", &body, &[]).await;
    let v = r.ok_json();
    assert_eq!(v["type"], "message");
    assert_eq!(v["stop_reason"], "tool_use");
    assert_eq!(
        types(&v, "content"),
        ["thinking", "text", "tool_use"],
        "{v}"
    );
    assert_eq!(v["content"][2]["input"], json!({"cmd": "ls"}));
    let r = post(&proxy, "/v1/messages", &anthropic(true), &[]).await;
    let frames = r.events("message_start", "message_stop");
    let text: String = frames
        .iter()
        .filter(|f| f.event.as_deref() == Some("content_block_delta"))
        .filter_map(|f| serde_json::from_str::<Value>(&f.data).ok())
        .filter_map(|v| v["delta"]["text"].as_str().map(str::to_owned))
        .collect();
    assert_eq!(text, "streamed", "{}", r.text);
    let counts = clear_turn(&proxy).await;
    assert_counts(&counts, [2, 16, 6, 1]);
    let calls = upstream_calls(&fake);
    assert_eq!(calls.len(), 2);
    let sent = &calls[0]["body"];
    assert_eq!(
        sent["messages"][0],
        json!({"role": "system", "content": "be brief"})
    );
    assert_eq!(sent["tools"][0]["function"]["name"], "Bash");
    assert_eq!(sent["max_tokens"], 64);
    assert_eq!(
        calls[1]["body"]["stream_options"],
        json!({"include_usage": true})
    );
}

#[tokio::test]
async fn responses_are_sent_as_chat_and_answered_as_responses() {
    let script = json!({"steps": [
        {"thinking": "plan", "text": "visible", "tool_calls": [{"name": "shell", "input": {"cmd": ["ls"]}}],
         "usage": {"input_tokens": 5, "output_tokens": 7}},
        {"text": "streamed", "tool_calls": [{"name": "shell", "input": {"cmd": ["pwd"]}}],
         "usage": {"input_tokens": 11, "output_tokens": 3}},
        {"text": "word ".repeat(30), "disconnect_after_events": 3},
    ]});
    let (fake, proxy) = start(&script, &["--max-steps", "3"]);
    open_turn(&proxy, "t1").await;
    let mut body = responses(false);
    body["tools"] = json!([{"type": "function", "name": "shell", "parameters": {"type": "object"}},
                           {"type": "web_search_preview"}]);
    body["max_output_tokens"] = json!(128);
    let r = post(&proxy, "/v1/responses", &body, &[]).await;
    let v = r.ok_json();
    assert_eq!(v["object"], "response");
    assert_eq!(v["status"], "completed");
    assert_eq!(
        types(&v, "output"),
        ["reasoning", "message", "function_call"],
        "{v}"
    );
    assert_eq!(v["output"][2]["name"], "shell");
    assert_eq!(v["usage"]["input_tokens"], 5);
    assert_eq!(v["usage"]["output_tokens"], 7);
    let r = post(&proxy, "/v1/responses", &responses(true), &[]).await;
    let frames = r.events("response.created", "response.completed");
    let names = event_names(&frames);
    assert!(
        names.contains(&"response.function_call_arguments.delta"),
        "{names:?}"
    );
    let done = serde_json::from_str::<Value>(&frames.last().unwrap().data).unwrap();
    assert_eq!(done["response"]["usage"]["input_tokens"], 11);
    // A broken upstream ends the stream with response.failed.
    let r = post(&proxy, "/v1/responses", &responses(true), &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(
        last_frame(&r.text).event.as_deref(),
        Some("response.failed"),
        "{}",
        r.text
    );
    // Past max_steps: the OpenAI-shaped 429.
    let r = post(&proxy, "/v1/responses", &responses(false), &[]).await;
    assert_eq!(r.status, 429);
    assert_eq!(r.json()["error"]["code"], "max_steps_exceeded");
    let counts = clear_turn(&proxy).await;
    assert_counts(&counts, [3, 16, 10, 2]);
    let calls = upstream_calls(&fake);
    let sent = &calls[0]["body"];
    assert_eq!(
        sent["messages"][0],
        json!({"role": "system", "content": "be brief"})
    );
    assert_eq!(
        sent["messages"][1],
        json!({"role": "user", "content": "hi"})
    );
    assert_eq!(sent["max_tokens"], 128);
    assert_eq!(
        sent["tools"].as_array().unwrap().len(),
        1,
        "only function tools: {sent}"
    );
    assert_eq!(
        calls[1]["body"]["stream_options"],
        json!({"include_usage": true})
    );
}

#[tokio::test]
async fn max_steps_refuses_the_call_past_the_limit_in_the_clients_protocol() {
    let (fake, proxy) = start(&json!({"fallback": {"text": "ok"}}), &["--max-steps", "2"]);
    open_turn(&proxy, "t1").await;
    let waiter = {
        let url = proxy.control_url();
        tokio::spawn(async move {
            reqwest::Client::new()
                .post(format!("{url}/wait_max_steps"))
                .json(&json!({"timeout_ms": 20_000}))
                .send()
                .await
                .unwrap()
                .json::<Value>()
                .await
                .unwrap()
        })
    };
    for _ in 0..2 {
        assert_eq!(
            post(&proxy, "/v1/chat/completions", &chat(false), &[])
                .await
                .status,
            200
        );
    }
    let r = post(&proxy, "/v1/chat/completions", &chat(false), &[]).await;
    assert_eq!(r.status, 429);
    assert_eq!(
        r.json(),
        json!({"error": {"message": "Turn exceeded max_steps.", "type": "rate_limit_error",
                         "code": "max_steps_exceeded",
                         "details": {"max_steps": 2, "attempted_step": 2}}})
    );
    let r = post(&proxy, "/v1/messages", &anthropic(false), &[]).await;
    assert_eq!(r.status, 429);
    let v = r.json();
    assert_eq!(v["type"], "error");
    assert_eq!(v["error"]["code"], "max_steps_exceeded");
    let waited = waiter.await.unwrap();
    assert_eq!(waited["error"]["error"], "max_steps_exceeded");
    assert_eq!(waited["error"]["details"]["turn_id"], "t1");
    let state = control(&proxy, "/pause_state", None).await;
    assert_eq!(
        state["http_inflight_requests"], 0,
        "refused calls leak nothing"
    );
    let consumed = control(&proxy, "/consume/max_steps", Some(&json!({}))).await;
    assert_eq!(consumed["error"]["details"]["max_steps"], 2);
    let again = control(&proxy, "/consume/max_steps", Some(&json!({}))).await;
    assert!(again["error"].is_null());
    assert_eq!(clear_turn(&proxy).await["steps"], 2);
    assert_eq!(
        upstream_calls(&fake).len(),
        2,
        "the router never saw the refused calls"
    );
    // The next turn starts again from zero.
    open_turn(&proxy, "t2").await;
    assert_eq!(
        post(&proxy, "/v1/chat/completions", &chat(false), &[])
            .await
            .status,
        200
    );
}

#[tokio::test]
async fn pause_holds_new_calls_until_resume() {
    let (fake, proxy) = start(&json!({"fallback": {"text": "ok"}}), &[]);
    open_turn(&proxy, "t1").await;
    let paused = control(
        &proxy,
        "/pause",
        Some(&json!({"reason": "weight_update", "timeout_seconds": 5})),
    )
    .await;
    assert_eq!(paused["status"], "paused");
    assert_eq!(paused["quiesced"], true, "the router's answer is passed on");
    let url = format!("{}/v1/chat/completions", proxy.base_url());
    let held = tokio::spawn(async move {
        let started = Instant::now();
        let status = post_url(url, &chat(false), &[]).await.status;
        (status, started.elapsed())
    });
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert!(!held.is_finished(), "the call is held while paused");
    assert!(
        upstream_calls(&fake).is_empty(),
        "and never reached the router"
    );
    let state = control(&proxy, "/pause_state", None).await;
    assert_eq!(state["paused"], true);
    assert_eq!(state["pause_reason"], "weight_update");
    let again = control(&proxy, "/pause", Some(&json!({"reason": "weight_update"}))).await;
    assert_eq!(again["status"], "already_paused");
    let resumed = control(&proxy, "/resume", Some(&json!({"version": "v2"}))).await;
    assert_eq!(resumed["status"], "resumed");
    assert_eq!(resumed["version"], "v2");
    let (status, waited) = held.await.unwrap();
    assert_eq!(status, 200);
    assert!(waited >= Duration::from_millis(700), "{waited:?}");
    let state = control(&proxy, "/pause_state", None).await;
    assert_eq!(state["paused"], false);
    assert!(
        state["total_paused_seconds"].as_f64().unwrap() >= 0.7,
        "{state}"
    );
    // Later calls expect the new weights.
    post(&proxy, "/v1/chat/completions", &chat(false), &[]).await;
    let reqs = fake.requests().unwrap();
    let pause = reqs
        .iter()
        .find(|r| r["path"] == "/v1/rollout/pause")
        .unwrap();
    assert_eq!(pause["headers"]["x-session-id"], "sess-001");
    assert_eq!(pause["headers"]["x-instance-id"], "inst-001");
    assert_eq!(pause["body"]["mode"], "preempt");
    assert_eq!(pause["body"]["timeout_seconds"], 5.0);
    let resume = reqs
        .iter()
        .find(|r| r["path"] == "/v1/rollout/resume")
        .unwrap();
    assert_eq!(resume["body"]["version"], "v2");
    let calls = upstream_calls(&fake);
    assert_eq!(calls.len(), 2);
    // The held call went out after the resume: it, too, expects the new weights.
    for c in &calls {
        assert_eq!(c["headers"]["x-dressage-expected-version"], "v2", "{c}");
    }
}

#[tokio::test]
async fn drain_waits_for_a_streaming_call() {
    let script = json!({"steps": [{"text": "a b c d e f g h", "event_delay_ms": 150,
                                   "usage": {"input_tokens": 3, "output_tokens": 8}}]});
    let (_fake, proxy) = start(&script, &[]);
    open_turn(&proxy, "t1").await;
    let url = format!("{}/v1/chat/completions", proxy.base_url());
    let call = tokio::spawn(async move { post_url(url, &chat(true), &[]).await.text });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let state = control(&proxy, "/pause_state", None).await;
    assert_eq!(state["http_inflight_requests"], 1, "{state}");
    let quick = control(&proxy, "/turn/drain", Some(&json!({"timeout_ms": 50}))).await;
    assert_eq!(quick["drained"], false);
    let drained = control(&proxy, "/turn/drain", Some(&json!({}))).await;
    assert_eq!(drained["drained"], true);
    assert!(call.await.unwrap().contains("[DONE]"));
    let counts = clear_turn(&proxy).await;
    assert_eq!(
        counts["output_tokens"], 8,
        "counted when the stream ended: {counts}"
    );
}

#[tokio::test]
async fn sampling_policy_applies_to_every_protocol() {
    let (fake, proxy) = start(
        &json!({"fallback": {"text": "ok"}}),
        &[
            "--default-temperature",
            "0.7",
            "--model-override",
            "training-model",
        ],
    );
    post(&proxy, "/v1/chat/completions", &chat(false), &[]).await;
    let mut zero = chat(false);
    zero["temperature"] = json!(0.0);
    post(&proxy, "/v1/chat/completions", &zero, &[]).await;
    post(&proxy, "/v1/messages", &anthropic(true), &[]).await;
    let calls = upstream_calls(&fake);
    assert_eq!(calls.len(), 3);
    assert_eq!(calls[0]["body"]["temperature"], 0.7);
    assert_eq!(calls[0]["body"]["model"], "training-model");
    assert_eq!(
        calls[1]["body"]["temperature"], 0.0,
        "an explicit 0 is kept"
    );
    assert_eq!(calls[2]["body"]["temperature"], 0.7);
    assert_eq!(calls[2]["body"]["model"], "training-model");
    assert!(calls[0]["body"].get("stream_options").is_none());
}

/// The last SSE frame of a body.
fn last_frame(text: &str) -> agentbox_tests::harness::SseFrame {
    parse_sse(text)
        .pop()
        .unwrap_or_else(|| panic!("no frame in {text:?}"))
}

#[tokio::test]
async fn a_broken_stream_ends_with_the_protocols_error_frame() {
    let long = "word ".repeat(40);
    let script = json!({"steps": [
        {"text": long, "disconnect_after_events": 3},
        {"text": long, "garbage_after_events": 3},
        {"text": long, "error_event": {"after_events": 3, "type": "server_error", "message": "boom"}},
        {"text": long, "disconnect_after_events": 4},
        {"text": long, "garbage_after_events": 4},
    ]});
    let (_fake, proxy) = start(&script, &[]);
    open_turn(&proxy, "t1").await;
    for what in ["disconnect", "garbage", "in-stream error"] {
        let r = post(&proxy, "/v1/chat/completions", &chat(true), &[]).await;
        assert_eq!(r.status, 200, "{what}");
        let last = last_frame(&r.text);
        let v: Value =
            serde_json::from_str(&last.data).unwrap_or_else(|e| panic!("{what}: {e}: {}", r.text));
        assert!(v["error"]["message"].is_string(), "{what}: {}", r.text);
        assert!(!r.text.contains("[DONE]"), "{what}: {}", r.text);
        assert!(!r.text.contains("fakellm-garbage"), "{what}: {}", r.text);
    }
    for what in ["disconnect", "garbage"] {
        let r = post(&proxy, "/v1/messages", &anthropic(true), &[]).await;
        assert_eq!(r.status, 200, "{what}");
        let last = last_frame(&r.text);
        assert_eq!(last.event.as_deref(), Some("error"), "{what}: {}", r.text);
        assert!(!r.text.contains("message_stop"), "{what}: {}", r.text);
    }
    let drained = control(&proxy, "/turn/drain", Some(&json!({"timeout_ms": 5000}))).await;
    assert_eq!(drained["drained"], true, "broken calls release their marks");
}

#[tokio::test]
async fn router_errors_are_answered_and_recorded_as_the_reference_does() {
    let overflow = json!({"error": "context_overflow", "message": "too long",
                          "details": {"context_window": 8192, "input_tokens": 9000}});
    let script = json!({"steps": [
        {"error": {"status": 500, "body": {"error": {"message": "boom", "type": "server_error"}}}},
        {"error": {"status": 503, "message": "overloaded"}},
        {"error": {"status": 413, "body": overflow}},
        {"error": {"status": 502, "body": {"detail": {"error": "generation_preempted", "message": "stale"}}}},
        {"error": {"status": 502, "body": {"detail": {"error": "trajectory_version_changed"}}}},
        {"error": {"status": 413, "body": overflow}, "heartbeats": 2},
        {"text": "after heartbeats", "heartbeats": 3},
    ]});
    let (_fake, proxy) = start(&script, &[]);
    open_turn(&proxy, "t1").await;
    // Chat: the router's error as it came.
    let r = post(&proxy, "/v1/chat/completions", &chat(true), &[]).await;
    assert_eq!(r.status, 500);
    assert_eq!(r.json()["error"]["message"], "boom");
    let failed =
        control(&proxy, "/consume/failed_upstream", Some(&json!({}))).await["error"].clone();
    assert_eq!(failed["status_code"], 500);
    assert_eq!(failed["turn_id"], "t1");
    assert_eq!(failed["step"], 0);
    assert!(
        failed["message"]
            .as_str()
            .unwrap()
            .starts_with("Upstream returned HTTP 500: ")
    );
    assert!(
        failed["upstream_url"]
            .as_str()
            .unwrap()
            .ends_with("/v1/chat/completions")
    );
    // Anthropic: a 5xx is a non-retry 400.
    let r = post(&proxy, "/v1/messages", &anthropic(true), &[]).await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "upstream_error");
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("HTTP 503")
    );
    // Context overflow: recorded whole, the agent sees the 413.
    let r = post(&proxy, "/v1/messages", &anthropic(false), &[]).await;
    assert_eq!(r.status, 413);
    assert_eq!(r.json()["type"], "error");
    let got = control(&proxy, "/consume/context_overflow", Some(&json!({}))).await;
    assert_eq!(got["error"], overflow);
    // Rollout invalidated: an empty successful answer, the detail recorded.
    let r = post(&proxy, "/v1/messages", &anthropic(false), &[]).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["content"], json!([{"type": "text", "text": ""}]));
    let got = control(&proxy, "/consume/rollout_invalidated", Some(&json!({}))).await;
    assert_eq!(
        got["error"],
        json!({"error": "generation_preempted", "message": "stale"})
    );
    let r = post(&proxy, "/v1/chat/completions", &chat(true), &[]).await;
    assert_eq!(r.status, 200);
    assert!(r.text.ends_with("data: [DONE]\n\n"), "{}", r.text);
    // A late error behind keepalives gets its status back.
    let r = post(&proxy, "/v1/chat/completions", &chat(true), &[]).await;
    assert_eq!(r.status, 413, "{}", r.text);
    assert_eq!(r.json()["code"], Value::Null);
    assert_eq!(r.json()["error"], "context_overflow");
    assert!(
        control(&proxy, "/consume/context_overflow", Some(&json!({}))).await["error"].is_object()
    );
    // Keepalives before a good stream are dropped.
    let r = post(&proxy, "/v1/chat/completions", &chat(true), &[]).await;
    assert_eq!(r.status, 200);
    assert!(!r.text.contains("dressage-heartbeat"), "{}", r.text);
    assert!(r.text.starts_with("data: "), "{}", r.text);
}

#[tokio::test]
async fn other_requests_are_forwarded_untagged() {
    let (fake, proxy) = start(&json!({"count_tokens": 42, "models": ["m1"]}), &[]);
    let models = get_json(&format!("{}/v1/models", proxy.base_url()))
        .await
        .unwrap();
    assert_eq!(models["data"][0]["id"], "m1");
    let r = post(&proxy, "/v1/messages/count_tokens", &anthropic(false), &[]).await;
    assert_eq!(r.json(), json!({"input_tokens": 42}));
    for req in fake.requests().unwrap() {
        assert!(req["headers"].get("x-smg-routing-key").is_none(), "{req}");
    }
    let health = get_json(&format!("{}/__proxy_health", proxy.base_url()))
        .await
        .unwrap();
    assert_eq!(health, json!({"ok": true}));
}

#[tokio::test]
async fn bad_requests_are_refused_in_the_clients_protocol() {
    let (fake, proxy) = start(&json!({"fallback": {"text": "ok"}}), &[]);
    let raw = |path: &str, body: &'static str| {
        read_reply(
            reqwest::Client::new()
                .post(format!("{}{path}", proxy.base_url()))
                .body(body),
        )
    };
    let r = raw("/v1/chat/completions", "{not json").await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "invalid_request_error");
    let r = raw("/v1/messages", "[]").await;
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["type"], "error");
    assert!(upstream_calls(&fake).is_empty());
}

/// A model call spelled with dot segments is not a model call here, and the router must not
/// get it as one after the upstream client resolves the path: refused, nothing sent.
#[tokio::test]
async fn a_model_call_in_disguise_is_not_forwarded() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (fake, proxy) = start(&json!({"fallback": {"text": "ok"}}), &[]);
    let addr = proxy.base_url().trim_start_matches("http://").to_owned();
    for path in ["/v1/chat/x/../completions", "/v1/chat/x/%2e%2e/completions"] {
        let body = chat(false).to_string();
        let mut s = tokio::net::TcpStream::connect(&addr).await.unwrap();
        s.write_all(
            format!(
                "POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n\
                 content-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
        let mut got = String::new();
        s.read_to_string(&mut got).await.unwrap();
        assert!(got.starts_with("HTTP/1.1 400"), "{path}: {got}");
    }
    assert!(
        fake.requests().unwrap().is_empty(),
        "reached the router: {:?}",
        fake.requests().unwrap()
    );
}
