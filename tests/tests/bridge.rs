//! `agentbox-bridge` as a process against `fakellm` as a process: passthrough and translation,
//! streamed and not, what reaches the provider (key header, translated body, no bridge token),
//! error mapping, `/check`, `/health`, and bad input.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{Read, Write};
use std::time::Duration;

use agentbox_tests::harness::{BridgeProcess, FakeLlm, parse_sse};
use serde_json::{Value, json};

const TOKEN: &str = "bridge-token-0123456789";
const OPENAI_KEY: &str = "sk-openai-test-key";
const ANTHROPIC_KEY: &str = "sk-ant-test-key";

/// A config with one model per provider pointing at `fake`, plus a keyless one and one whose
/// provider is unreachable.
fn config(fake: &FakeLlm, extra: &str) -> String {
    format!(
        r#"
[bridge]
listen = "127.0.0.1:0"
max_body_mb = 8
body_timeout_s = 2
{extra}

[models.gpt]
backend = "remote"
provider = "openai"
base_url = "{base}/v1"
upstream_model = "gpt-upstream"
key_env = "TEST_OPENAI_KEY"
max_output_tokens = 4096
forward_user_id = true

[models.thinker]
backend = "remote"
provider = "openai"
base_url = "{base}/v1"
upstream_model = "o-upstream"
key_env = "TEST_OPENAI_KEY"
reasoning = "reasoning_effort"

[models.claude]
backend = "remote"
provider = "anthropic"
base_url = "{base}"
upstream_model = "claude-upstream"
key_env = "TEST_ANTHROPIC_KEY"

[models.keyless]
backend = "remote"
provider = "openai"
base_url = "{base}/v1"
upstream_model = "x"
key_env = "TEST_UNSET_KEY"

[models.unreachable]
backend = "remote"
provider = "openai"
base_url = "http://127.0.0.1:9/v1"
upstream_model = "x"
key_env = "TEST_OPENAI_KEY"

[models.local]
backend = "ollama"
upstream_model = "qwen"
"#,
        base = fake.base_url()
    )
}

/// A fakellm playing `script` and a bridge in front of it (keep both alive).
fn start(script: &Value) -> (FakeLlm, BridgeProcess) {
    let fake = FakeLlm::scripted(script).unwrap();
    let bridge = BridgeProcess::start(
        &config(&fake, ""),
        &[
            ("AGENTBOX_BRIDGE_TOKEN", TOKEN),
            ("TEST_OPENAI_KEY", OPENAI_KEY),
            ("TEST_ANTHROPIC_KEY", ANTHROPIC_KEY),
        ],
    )
    .unwrap();
    (fake, bridge)
}

/// A Claude-Code-like request: system list, tools (one server-side), thinking,
/// context_management, metadata.
fn request(model: &str, stream: bool) -> Value {
    json!({
        "model": model,
        "max_tokens": 32000,
        "stream": stream,
        "system": [{"type": "text", "text": "You are a coding agent."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "write hello.txt"}]}],
        "tools": [
            {"name": "Write", "description": "write a file", "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}, "content": {"type": "string"}}}},
            {"type": "web_search_20250305", "name": "web_search"}
        ],
        "metadata": {"user_id": "user-1"},
        "context_management": {"edits": []},
        "x_unknown_field": {"kept": true}
    })
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

async fn post(bridge: &BridgeProcess, body: &Value) -> reqwest::Response {
    client()
        .post(format!("{}/v1/messages", bridge.base_url()))
        .bearer_auth(TOKEN)
        .header("anthropic-version", "2023-06-01")
        .header("anthropic-beta", "context-management-2025-06-27")
        .json(body)
        .send()
        .await
        .unwrap()
}

/// `model`'s answer, streamed: a 200 whose last event is `error`. The whole body and that
/// event's data.
async fn stream_ending_in_error(bridge: &BridgeProcess, model: &str) -> (String, String) {
    let resp = post(bridge, &request(model, true)).await;
    assert_eq!(resp.status(), 200, "{model}");
    let body = resp.text().await.unwrap();
    let last = parse_sse(&body).pop().unwrap();
    assert_eq!(last.event.as_deref(), Some("error"), "{model}: {body}");
    (body, last.data)
}

fn assert_anthropic_error(v: &Value, error_type: &str) {
    assert_eq!(v["type"], "error", "{v}");
    assert_eq!(v["error"]["type"], error_type, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .is_some_and(|m| !m.is_empty()),
        "{v}"
    );
}

/// No upstream request may carry the bridge token anywhere in its headers or body.
fn assert_no_bridge_token(requests: &[Value]) {
    for r in requests {
        assert!(
            !r.to_string().contains(TOKEN),
            "bridge token leaked upstream: {r}"
        );
    }
}

/// The text of an Anthropic stream: every `text_delta` in order.
fn streamed_text(body: &str) -> String {
    parse_sse(body)
        .iter()
        .filter(|f| f.event.as_deref() == Some("content_block_delta"))
        .filter_map(|f| {
            let v: Value = serde_json::from_str(&f.data).ok()?;
            (v["delta"]["type"] == "text_delta")
                .then(|| v["delta"]["text"].as_str().unwrap_or("").to_owned())
        })
        .collect()
}

fn text_script() -> Value {
    json!({"steps": [
        {"text": "hello there", "usage": {"input_tokens": 120, "output_tokens": 7, "cache_read_input_tokens": 30}}
    ]})
}

#[tokio::test]
async fn anthropic_passthrough_non_stream() {
    let (fake, bridge) = start(&text_script());
    let resp = post(&bridge, &request("claude", false)).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["content"][0]["text"], "hello there");
    assert_eq!(v["usage"]["input_tokens"], 120);
    assert_eq!(v["usage"]["cache_read_input_tokens"], 30);

    let reqs = fake.requests().unwrap();
    assert_eq!(reqs.len(), 1);
    let r = &reqs[0];
    assert_eq!(r["path"], "/v1/messages");
    assert_eq!(r["headers"]["x-api-key"], ANTHROPIC_KEY);
    assert!(r["headers"].get("authorization").is_none(), "{r}");
    assert!(r["headers"].get("anthropic-beta").is_none(), "{r}");
    assert_eq!(r["headers"]["anthropic-version"], "2023-06-01");
    assert_eq!(r["body"]["model"], "claude-upstream");
    assert!(r["body"].get("context_management").is_none());
    let tools = r["body"]["tools"].as_array().unwrap();
    assert_eq!(
        tools.len(),
        1,
        "server-side tool must be stripped: {tools:?}"
    );
    assert_eq!(r["body"]["x_unknown_field"]["kept"], true);
    assert_no_bridge_token(&reqs);
}

/// `thinking` reaches a translated model's reasoning field only as its `reasoning` key says,
/// and `metadata.user_id` (Claude Code's device, account and session ids) reaches no provider
/// unless `forward_user_id` says so: not translated (`user`), not passed through.
#[tokio::test]
async fn thinking_and_client_ids_follow_the_model_config() {
    let (fake, bridge) = start(&json!({"fallback": {"text": "ok"}}));
    let thinking = |model: &str, thinking: Value| {
        let mut req = request(model, false);
        req["thinking"] = thinking;
        req
    };
    let cases = [
        thinking(
            "thinker",
            json!({"type": "enabled", "budget_tokens": 31999}),
        ),
        thinking("thinker", json!({"type": "enabled", "budget_tokens": 4000})),
        thinking("thinker", json!({"type": "disabled"})),
        thinking("gpt", json!({"type": "enabled", "budget_tokens": 31999})),
        thinking("claude", json!({"type": "enabled", "budget_tokens": 31999})),
    ];
    for req in &cases {
        let resp = post(&bridge, req).await;
        assert_eq!(resp.status(), 200, "{req}");
    }
    let reqs = fake.requests().unwrap();
    assert_eq!(reqs.len(), cases.len());
    let bodies: Vec<&Value> = reqs.iter().map(|r| &r["body"]).collect();
    assert_eq!(bodies[0]["reasoning_effort"], "high", "{}", bodies[0]);
    assert_eq!(bodies[1]["reasoning_effort"], "low", "{}", bodies[1]);
    for b in &bodies[..3] {
        assert!(
            b.get("user").is_none(),
            "user id sent without forward_user_id: {b}"
        );
        assert!(
            b.get("thinking").is_none() && b.get("reasoning").is_none(),
            "{b}"
        );
    }
    assert!(bodies[2].get("reasoning_effort").is_none(), "{}", bodies[2]);
    // `gpt` has no `reasoning` key (thinking not sent) and forwards the user id.
    assert!(bodies[3].get("reasoning_effort").is_none(), "{}", bodies[3]);
    assert_eq!(bodies[3]["user"], "user-1");
    // Passthrough keeps thinking as it is and drops only the user id.
    assert_eq!(bodies[4]["thinking"]["budget_tokens"], 31999);
    assert!(
        bodies[4]["metadata"].get("user_id").is_none(),
        "{}",
        bodies[4]
    );
    for (i, r) in reqs.iter().enumerate() {
        assert_eq!(r.to_string().contains("user-1"), i == 3, "{r}");
    }
}

#[tokio::test]
async fn anthropic_passthrough_stream() {
    let (fake, bridge) = start(&text_script());
    let resp = post(&bridge, &request("claude", true)).await;
    assert_eq!(resp.status(), 200);
    assert!(
        resp.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream")
    );
    let body = resp.text().await.unwrap();
    let frames = parse_sse(&body);
    let events: Vec<&str> = frames
        .iter()
        .map(|f| f.event.as_deref().unwrap_or(""))
        .collect();
    assert_eq!(events.first(), Some(&"message_start"));
    assert_eq!(events.last(), Some(&"message_stop"));
    assert_eq!(streamed_text(&body), "hello there", "{body}");
    let reqs = fake.requests().unwrap();
    assert_eq!(reqs[0]["headers"]["x-api-key"], ANTHROPIC_KEY);
    assert_eq!(reqs[0]["body"]["stream"], true);
    assert_no_bridge_token(&reqs);
}

#[tokio::test]
async fn provider_errors_map_to_anthropic_shape() {
    let (_fake, bridge) = start(&json!({"steps": [
        {"error": {"status": 429}, "headers": {"retry-after": "7"}},
        {"error": {"status": 500}},
        {"error": {"status": 529}},
        {"error": {"status": 503, "body": "<html>bad gateway</html>"}},
        {"error": {"status": 429}, "headers": {"retry-after": "3"}},
        {"error": {"status": 500}}
    ]}));

    // In the script's order: (case, model, stream, status, retry-after, error type).
    for (case, model, stream, status, retry_after, error_type) in [
        // Anthropic provider: Anthropic-shaped errors keep their status and type.
        (
            "anthropic 429",
            "claude",
            false,
            429,
            Some("7"),
            "rate_limit_error",
        ),
        ("anthropic 500", "claude", false, 500, None, "api_error"),
        (
            "anthropic 529",
            "claude",
            true,
            529,
            None,
            "overloaded_error",
        ),
        // Not Anthropic-shaped 5xx: 502.
        (
            "anthropic html 503",
            "claude",
            false,
            502,
            None,
            "api_error",
        ),
        // OpenAI provider: 429 stays 429 with retry-after, 5xx becomes 502.
        (
            "openai 429",
            "gpt",
            false,
            429,
            Some("3"),
            "rate_limit_error",
        ),
        ("openai 500", "gpt", true, 502, None, "api_error"),
    ] {
        let r = post(&bridge, &request(model, stream)).await;
        assert_eq!(r.status(), status, "{case}");
        if let Some(after) = retry_after {
            assert_eq!(r.headers()["retry-after"], after, "{case}");
        }
        let body: Value = r.json().await.unwrap();
        assert_eq!(body["error"]["type"], error_type, "{case}: {body}");
        assert_anthropic_error(&body, error_type);
    }
}

#[tokio::test]
async fn auth_is_required_everywhere_but_health() {
    let (fake, bridge) = start(&text_script());
    let c = client();
    let base = bridge.base_url();

    let bearer = format!("Bearer {TOKEN}");
    // (case, method, path, credential header, JSON body, status, error type)
    for (case, method, path, auth, body, status, error_type) in [
        (
            "no token",
            "POST",
            "/v1/messages",
            None,
            true,
            401,
            Some("authentication_error"),
        ),
        (
            "wrong bearer token",
            "POST",
            "/v1/messages",
            Some(("authorization", "Bearer wrong-token")),
            true,
            401,
            None,
        ),
        (
            "wrong x-api-key",
            "GET",
            "/check/gpt",
            Some(("x-api-key", "nope")),
            false,
            401,
            None,
        ),
        (
            "unknown paths are not revealed before auth",
            "GET",
            "/nowhere",
            None,
            false,
            401,
            None,
        ),
        // x-api-key works as well as Bearer.
        (
            "x-api-key authenticates",
            "GET",
            "/nowhere",
            Some(("x-api-key", TOKEN)),
            false,
            404,
            Some("not_found_error"),
        ),
        (
            "GET on a POST route",
            "GET",
            "/v1/messages",
            Some(("authorization", bearer.as_str())),
            false,
            405,
            None,
        ),
    ] {
        let mut req = c.request(method.parse().unwrap(), format!("{base}{path}"));
        if let Some((name, value)) = auth {
            req = req.header(name, value);
        }
        if body {
            req = req.json(&request("gpt", false));
        }
        let r = req.send().await.unwrap();
        assert_eq!(r.status(), status, "{case}");
        if let Some(error_type) = error_type {
            let body: Value = r.json().await.unwrap();
            assert_eq!(body["error"]["type"], error_type, "{case}: {body}");
            assert_anthropic_error(&body, error_type);
        }
    }

    let r = c.get(format!("{base}/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["ok"], true);
    let ids: Vec<&str> = v["models"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(
        ids,
        ["claude", "gpt", "keyless", "thinker", "unreachable"],
        "only remote models"
    );
    assert_eq!(v["models"][2]["key_configured"], false);
    for secret in [OPENAI_KEY, ANTHROPIC_KEY, TOKEN] {
        assert!(!text.contains(secret), "/health leaks a secret: {text}");
    }
    assert!(
        fake.requests().unwrap().is_empty(),
        "nothing reached the provider"
    );
}

#[tokio::test]
async fn check_tells_failures_apart() {
    let (fake, bridge) = start(&json!({"api_key": OPENAI_KEY}));
    let c = client();
    let check = |model: &str| {
        let c = c.clone();
        let url = format!("{}/check/{model}", bridge.base_url());
        async move {
            let r = c.get(url).bearer_auth(TOKEN).send().await.unwrap();
            (r.status().as_u16(), r.json::<Value>().await.unwrap())
        }
    };
    let (s, v) = check("gpt").await;
    assert_eq!((s, &v["ok"]), (200, &json!(true)), "{v}");
    let (_, v) = check("keyless").await;
    assert_eq!(v["ok"], false);
    assert_eq!(v["reason"], "no_key", "{v}");
    assert!(v["error"].as_str().unwrap().contains("TEST_UNSET_KEY"));
    let (_, v) = check("unreachable").await;
    assert_eq!(v["reason"], "unreachable", "{v}");
    // fakellm wants the OpenAI key; the Anthropic model presents another one.
    let (_, v) = check("claude").await;
    assert_eq!(v["reason"], "auth_refused", "{v}");
    let (s, v) = check("nope").await;
    assert_eq!(s, 404);
    assert_anthropic_error(&v, "not_found_error");

    let logged = fake.requests().unwrap().to_vec();
    assert_no_bridge_token(&logged);
    assert!(!bridge.stderr().contains(OPENAI_KEY) && !bridge.stderr().contains(ANTHROPIC_KEY));
}

#[tokio::test]
async fn bad_input_gets_clear_errors_and_the_bridge_keeps_serving() {
    let (fake, mut bridge) = start(&json!({"fallback": {"text": "still here"}}));
    let c = client();
    let url = format!("{}/v1/messages", bridge.base_url());
    let send = |body: reqwest::Body| {
        c.post(&url)
            .bearer_auth(TOKEN)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };

    let r = send("{not json".into()).await.unwrap();
    assert_eq!(r.status(), 400);
    assert_anthropic_error(&r.json().await.unwrap(), "invalid_request_error");

    let r = send(json!({"model": 5, "messages": []}).to_string().into())
        .await
        .unwrap();
    assert_eq!(r.status(), 400);
    assert_anthropic_error(&r.json().await.unwrap(), "invalid_request_error");

    let mut wrong = request("gpt", false);
    wrong["messages"] = json!("not a list");
    let r = send(wrong.to_string().into()).await.unwrap();
    assert_eq!(r.status(), 400);
    assert_anthropic_error(&r.json().await.unwrap(), "invalid_request_error");

    let mut wrong = request("claude", false);
    wrong["tools"] = json!({"not": "a list"});
    let r = send(wrong.to_string().into()).await.unwrap();
    assert_eq!(r.status(), 400);

    let mut wrong = request("claude", false);
    wrong["stream"] = json!("yes");
    let r = send(wrong.to_string().into()).await.unwrap();
    assert_eq!(r.status(), 400);

    for unknown in ["nope", "local", "../claude"] {
        let r = send(request(unknown, false).to_string().into())
            .await
            .unwrap();
        assert_eq!(r.status(), 404, "{unknown}");
        assert_anthropic_error(&r.json().await.unwrap(), "not_found_error");
    }

    let r = send(request("keyless", false).to_string().into())
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    let v: Value = r.json().await.unwrap();
    assert_anthropic_error(&v, "api_error");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("TEST_UNSET_KEY")
    );

    let r = send(request("unreachable", false).to_string().into())
        .await
        .unwrap();
    assert_eq!(r.status(), 502);
    assert_anthropic_error(&r.json().await.unwrap(), "api_error");

    // 20 MB, declared up front: refused before it is read.
    let mut big = request("claude", false);
    big["messages"][0]["content"][0]["text"] = json!("x".repeat(20 << 20));
    let r = send(big.to_string().into()).await.unwrap();
    assert_eq!(r.status(), 413);
    assert_anthropic_error(&r.json().await.unwrap(), "request_too_large");

    // 20 MB chunked, no content-length: refused once the limit is crossed.
    let chunks: Vec<Result<Vec<u8>, std::io::Error>> =
        (0..20).map(|_| Ok(vec![b' '; 1 << 20])).collect();
    let r = send(reqwest::Body::wrap_stream(futures_util::stream::iter(
        chunks,
    )))
    .await;
    match r {
        Ok(r) => assert_eq!(r.status(), 413),
        // The bridge may answer and close before the client finished sending.
        Err(e) => assert!(e.is_request() || e.is_body(), "{e}"),
    }

    // A slow client: head sent, body never finished. 408 after the body timeout.
    let addr = bridge.base_url().trim_start_matches("http://").to_owned();
    let slow = std::thread::spawn(move || {
        let mut s = std::net::TcpStream::connect(addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        write!(
            s,
            "POST /v1/messages HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n{{\"model\""
        )
        .unwrap();
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    });
    // Meanwhile other clients are served.
    let r = send(request("claude", false).to_string().into())
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let slow = tokio::task::spawn_blocking(move || slow.join().unwrap())
        .await
        .unwrap();
    assert!(slow.starts_with("HTTP/1.1 408"), "{slow}");
    assert!(slow.contains("invalid_request_error"), "{slow}");

    let r = send(request("gpt", false).to_string().into())
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the bridge still serves after all that");
    assert!(bridge.is_running());
    assert_no_bridge_token(&fake.requests().unwrap());
}

#[test]
fn refuses_to_start_without_its_token() {
    let fake = FakeLlm::scripted(&text_script()).unwrap();
    let err =
        BridgeProcess::start(&config(&fake, ""), &[("TEST_OPENAI_KEY", OPENAI_KEY)]).unwrap_err();
    assert!(err.to_string().contains("AGENTBOX_BRIDGE_TOKEN"), "{err}");
}

/// A client that hangs up mid-stream cancels the provider request, translated or not.
#[tokio::test]
async fn client_disconnect_cancels_the_upstream_request() {
    let long = "word ".repeat(300);
    let (fake, bridge) = start(
        &json!({"fallback": {"text": long, "usage": {"input_tokens": 5, "output_tokens": 300}, "event_delay_ms": 20}}),
    );
    for (i, model) in ["gpt", "claude"].into_iter().enumerate() {
        let resp = post(&bridge, &request(model, true)).await;
        assert_eq!(resp.status(), 200);
        let mut stream = resp.bytes_stream();
        let mut seen = Vec::new();
        while !String::from_utf8_lossy(&seen).contains("text_delta") {
            let chunk = futures_util::StreamExt::next(&mut stream)
                .await
                .unwrap()
                .unwrap();
            seen.extend_from_slice(&chunk);
        }
        drop(stream);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let d = fake.disconnects().unwrap();
            if d.len() > i {
                let (sent, total) = (d[i]["frames_sent"].as_u64(), d[i]["frames_total"].as_u64());
                assert!(sent.is_some() && total.is_some(), "{model}: {d:?}");
                assert!(sent < total, "{model}: {d:?}");
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{model}: upstream never cancelled"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A provider that breaks mid-stream: the client's stream ends with an Anthropic `error`
/// event, passthrough or translated, never a silent truncation or a fake `end_turn`.
#[tokio::test]
async fn mid_stream_failure_ends_with_an_error_event() {
    let (_fake, bridge) =
        start(&json!({"fallback": {"text": "a b c d e f g h", "disconnect_after_events": 4}}));
    for model in ["claude", "gpt"] {
        let (body, data) = stream_ending_in_error(&bridge, model).await;
        let v: Value = serde_json::from_str(&data).unwrap();
        assert_eq!(v["error"]["type"], "api_error", "{model}: {v}");
        assert!(!body.contains("message_stop"), "{model}: {body}");
        assert!(
            !body.contains("end_turn"),
            "{model}: no fake end_turn: {body}"
        );
    }
}

/// The same Anthropic request through an `openai` model, not streamed and streamed: what the
/// provider receives is a faithful chat request with the provider key, and what comes back is
/// an Anthropic message with the usage in Anthropic terms.
#[tokio::test]
async fn openai_translation_both_ways() {
    let (fake, bridge) = start(&json!({"steps": [
        {"text": "translated", "usage": {"input_tokens": 70, "output_tokens": 9, "cache_read_input_tokens": 30}},
        {"tool_calls": [{"name": "Write", "input": {"file_path": "a.txt", "content": "x"}}],
         "usage": {"input_tokens": 80, "output_tokens": 12}}
    ]}));
    let mut req = request("gpt", false);
    req["tool_choice"] =
        json!({"type": "tool", "name": "Write", "disable_parallel_tool_use": true});
    req["stop_sequences"] = json!(["STOP"]);

    let resp = post(&bridge, &req).await;
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["type"], "message");
    assert_eq!(v["model"], "gpt", "the client's model name is reported");
    assert_eq!(
        v["content"][0],
        json!({"type": "text", "text": "translated"})
    );
    assert_eq!(v["stop_reason"], "end_turn");
    // prompt_tokens 100 includes 30 cached: Anthropic's input_tokens excludes them.
    assert_eq!(v["usage"]["input_tokens"], 70);
    assert_eq!(v["usage"]["cache_read_input_tokens"], 30);
    assert_eq!(v["usage"]["output_tokens"], 9);

    req["stream"] = json!(true);
    let resp = post(&bridge, &req).await;
    assert_eq!(resp.status(), 200);
    let body = resp.text().await.unwrap();
    let frames = parse_sse(&body);
    let names: Vec<&str> = frames.iter().filter_map(|f| f.event.as_deref()).collect();
    assert_eq!(
        names.iter().filter(|n| **n == "message_start").count(),
        1,
        "{body}"
    );
    assert_eq!(names.last(), Some(&"message_stop"), "{body}");
    assert!(
        body.contains("\"type\":\"tool_use\"") && body.contains("input_json_delta"),
        "{body}"
    );
    assert!(body.contains("\"stop_reason\":\"tool_use\""), "{body}");

    let reqs = fake.requests().unwrap();
    assert_eq!(reqs.len(), 2);
    for (r, stream) in reqs.iter().zip([false, true]) {
        assert_eq!(r["path"], "/v1/chat/completions");
        assert_eq!(
            r["headers"]["authorization"],
            format!("Bearer {OPENAI_KEY}")
        );
        assert!(r["headers"].get("x-api-key").is_none());
        let b = &r["body"];
        assert_eq!(b["model"], "gpt-upstream");
        assert_eq!(b["stream"], stream);
        assert_eq!(b["messages"][0]["role"], "system");
        assert_eq!(b["messages"][0]["content"], "You are a coding agent.");
        assert_eq!(b["messages"][1]["role"], "user");
        let tools = b["tools"].as_array().unwrap();
        assert_eq!(tools.len(), 1, "server tool dropped: {tools:?}");
        assert_eq!(tools[0]["type"], "function");
        assert_eq!(tools[0]["function"]["name"], "Write");
        assert_eq!(b["tool_choice"]["function"]["name"], "Write");
        assert_eq!(b["parallel_tool_calls"], false);
        assert_eq!(b["stop"], json!(["STOP"]));
        assert_eq!(b["user"], "user-1");
        assert_eq!(
            b["max_completion_tokens"], 4096,
            "clamped to max_output_tokens"
        );
        for gone in [
            "context_management",
            "metadata",
            "x_unknown_field",
            "thinking",
        ] {
            assert!(b.get(gone).is_none(), "{gone} sent to the provider: {b}");
        }
        if stream {
            assert_eq!(b["stream_options"]["include_usage"], true);
        }
    }
    assert_no_bridge_token(&reqs);
}

/// Whatever breaks at the provider, a 5xx the client sees names no provider address: a closed
/// port, a provider 5xx whose own body names one (Anthropic-shaped or not), a stream cut
/// mid-way (passthrough and translated).
#[tokio::test]
async fn no_5xx_body_names_an_upstream_url() {
    let (fake, bridge) = start(&json!({"steps": [
        {"error": {"status": 500, "body": {"error": {"message": "backend http://127.0.0.1:8000/v1 refused"}}}},
        {"error": {"status": 500, "body": {"type": "error", "error": {"type": "api_error", "message": "proxy http://127.0.0.1:8000 failed"}}}},
        {"error": {"status": 503, "body": "<html>upstream 127.0.0.1:8000 is down</html>"}},
        {"text": "cut short by the provider", "disconnect_after_events": 3},
        {"text": "cut short by the provider", "disconnect_after_events": 3}
    ]}));
    let port = fake.base_url().rsplit(':').next().unwrap().to_owned();
    let assert_generic = |text: &str| {
        for addr in ["http://", "127.0.0.1", ":8000", &format!(":{port}")] {
            assert!(!text.contains(addr), "{addr} in {text}");
        }
    };
    for (model, status) in [("gpt", 502), ("claude", 500), ("claude", 502)] {
        let r = post(&bridge, &request(model, false)).await;
        assert_eq!(r.status(), status, "{model}");
        let text = r.text().await.unwrap();
        assert_anthropic_error(&serde_json::from_str(&text).unwrap(), "api_error");
        assert_generic(&text);
    }
    for model in ["claude", "gpt"] {
        let (_, data) = stream_ending_in_error(&bridge, model).await;
        assert_generic(&data);
    }
    let r = post(&bridge, &request("unreachable", false)).await;
    assert_eq!(r.status(), 502);
    let text = r.text().await.unwrap();
    assert_anthropic_error(&serde_json::from_str(&text).unwrap(), "api_error");
    assert_generic(&text);
}
