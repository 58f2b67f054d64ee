//! `agentbox-gateway` as a process, with `fakellm` (and the bridge) as processes, over the real
//! unix sockets: the control plane, what reaches the model, metering to the token, budgets,
//! restarts, and bad input.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use agentbox_tests::harness::{
    BridgeProcess, FakeLlm, GatewayProcess, parse_sse, strs, unix_request,
};
use serde_json::{Value, json};

const TOKEN: &str = "task-token-0123456789abcdef";
const BRIDGE_TOKEN: &str = "bridge-token-for-gateway-tests";

fn config(fake: &FakeLlm, bridge: Option<&BridgeProcess>) -> String {
    format!(
        r#"
[gateway]
ollama_url = "{fake}"
bridge_url = "{bridge}"
max_body_mb = 8

[models.local]
backend = "ollama"
upstream_model = "qwen-upstream"
max_output_tokens = 4096

[models.priced]
backend = "ollama"
upstream_model = "priced-upstream"
price_input_per_mtok = 3.0
price_output_per_mtok = 15.0

[models.gpt]
backend = "remote"
provider = "openai"
base_url = "{fake}/v1"
upstream_model = "gpt-upstream"
key_env = "OPENAI_KEY"

[models.vl]
backend = "vllm"
upstream_model = "vllm-upstream"
port = {port}
command = ["vllm", "serve"]
"#,
        fake = fake.base_url(),
        port = fake.base_url().rsplit(':').next().unwrap(),
        bridge = bridge.map_or("http://127.0.0.1:9".to_owned(), BridgeProcess::base_url),
    )
}

/// A bridge whose `gpt` is an OpenAI-compatible provider at `fake`.
fn openai_bridge(fake: &FakeLlm) -> BridgeProcess {
    BridgeProcess::start(
        &format!(
            "[bridge]\nlisten = \"127.0.0.1:0\"\n[models.gpt]\nbackend = \"remote\"\nprovider = \"openai\"\nbase_url = \"{}/v1\"\nupstream_model = \"gpt-upstream\"\nkey_env = \"OPENAI_KEY\"\n",
            fake.base_url()
        ),
        &[("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN), ("OPENAI_KEY", "sk-provider")],
    )
    .unwrap()
}

/// A gateway whose remote `gpt` goes through a bridge to `fake` (keep both alive).
fn through_bridge(fake: &FakeLlm) -> (BridgeProcess, GatewayProcess) {
    let bridge = openai_bridge(fake);
    let gw = GatewayProcess::start(
        &config(fake, Some(&bridge)),
        &[("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN)],
    )
    .unwrap();
    (bridge, gw)
}

/// A fakellm playing `script` and a gateway in front of it (keep both alive).
fn start(script: &Value) -> (FakeLlm, GatewayProcess) {
    let fake = FakeLlm::scripted(script).unwrap();
    let gw = GatewayProcess::start(
        &config(&fake, None),
        &[("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN)],
    )
    .unwrap();
    (fake, gw)
}

/// A gateway whose upstream is a closed port (`127.0.0.1:9`), with the task `down` open.
async fn upstream_down(fake: &FakeLlm) -> GatewayProcess {
    let gw = GatewayProcess::start(
        &config(fake, None).replace(&fake.base_url(), "http://127.0.0.1:9"),
        &[],
    )
    .unwrap();
    open(&gw, "down", "local", json!({})).await;
    gw
}

async fn open(gw: &GatewayProcess, tid: &str, model: &str, budget: Value) -> (u16, Value) {
    let r = gw.open_task(tid, model, TOKEN, budget).await.unwrap();
    (
        r.status,
        serde_json::from_slice(&r.body).unwrap_or(Value::Null),
    )
}

/// A script answering every request with "x" and this usage.
fn replying(input_tokens: u64, output_tokens: u64) -> Value {
    json!({"fallback": {"text": "x", "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}})
}

fn request(stream: bool, max_tokens: u64) -> Value {
    json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": max_tokens,
        "stream": stream,
        "system": [{"type": "text", "text": "You are a coding agent."}],
        "messages": [{"role": "user", "content": "write hello.txt"}],
        "tools": [
            {"name": "Write", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search"},
            {"type": "custom", "name": "Custom", "input_schema": {"type": "object"}}
        ],
        "mcp_servers": [{"type": "url", "url": "https://example.com", "name": "x"}],
        "container": "c1",
        "context_management": {"edits": []},
        "metadata": {"user_id": "u"},
        "x_unknown": 1
    })
}

async fn send(
    sock: &Path,
    body: &Value,
    token: Option<&str>,
) -> agentbox_tests::harness::UnixResponse {
    let auth = token.map(|t| format!("Bearer {t}"));
    let mut headers = vec![
        ("content-type", "application/json"),
        ("anthropic-version", "2023-06-01"),
        (
            "anthropic-beta",
            "context-management-2025-06-27,interleaved-thinking-2025-05-14",
        ),
        ("x-app", "cli"),
        ("x-stainless-lang", "js"),
    ];
    if let Some(a) = &auth {
        headers.push(("authorization", a.as_str()));
    }
    unix_request(
        sock,
        "POST",
        "/v1/messages?beta=true",
        &headers,
        body.to_string(),
    )
    .await
    .unwrap()
}

fn error_type(body: &[u8]) -> String {
    let v: Value = serde_json::from_slice(body)
        .unwrap_or_else(|_| panic!("not JSON: {}", String::from_utf8_lossy(body)));
    assert_eq!(v["type"], "error", "{v}");
    v["error"]["type"].as_str().unwrap().to_owned()
}

/// The sum of usage fakellm reported, from its scripted entries that were served.
fn usage_sum(entries: &[(u64, u64, u64, u64)]) -> Value {
    let (i, o, r, c) = entries.iter().fold((0, 0, 0, 0), |a, e| {
        (a.0 + e.0, a.1 + e.1, a.2 + e.2, a.3 + e.3)
    });
    json!({"input_tokens": i, "output_tokens": o, "cache_read_input_tokens": r, "cache_creation_input_tokens": c})
}

fn assert_usage(view: &Value, expected: &Value) {
    for k in [
        "input_tokens",
        "output_tokens",
        "cache_read_input_tokens",
        "cache_creation_input_tokens",
    ] {
        assert_eq!(view["usage"][k], expected[k], "{k}: {view}");
    }
}

#[tokio::test]
async fn forwards_sanitized_requests_and_meters_to_the_token() {
    let (fake, gw) = start(&json!({"steps": [
        {"text": "one", "usage": {"input_tokens": 101, "output_tokens": 11, "cache_read_input_tokens": 7, "cache_creation_input_tokens": 3}},
        {"text": "two", "usage": {"input_tokens": 202, "output_tokens": 22, "cache_read_input_tokens": 5}},
        {"tool_calls": [{"name": "Write", "input": {"path": "a"}}], "usage": {"input_tokens": 303, "output_tokens": 33}}
    ]}));
    let (status, v) = open(&gw, "t1", "local", json!({})).await;
    assert_eq!(status, 201, "{v}");
    assert_eq!(v["state"], "open");
    let sock = gw.task_socket("t1");

    let r = send(&sock, &request(false, 1000), Some(TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let r = send(&sock, &request(true, 1000), Some(TOKEN)).await;
    assert_eq!(r.status, 200);
    let frames = parse_sse(&r.text());
    assert_eq!(
        frames.last().unwrap().event.as_deref(),
        Some("message_stop")
    );
    // x-api-key works too.
    let r = unix_request(
        &sock,
        "POST",
        "/v1/messages",
        &[("x-api-key", TOKEN), ("content-type", "application/json")],
        request(true, 99_999).to_string(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);

    let reqs = fake.requests().unwrap();
    assert_eq!(reqs.len(), 3);
    for r in &reqs {
        assert_eq!(r["path"], "/v1/messages", "query strings are not forwarded");
        assert_eq!(r["body"]["model"], "qwen-upstream");
        for gone in ["context_management", "mcp_servers", "container"] {
            assert!(
                r["body"].get(gone).is_none(),
                "{gone} forwarded: {}",
                r["body"]
            );
        }
        assert_eq!(strs(&r["body"]["tools"], "name"), ["Write", "Custom"]);
        assert_eq!(r["body"]["x_unknown"], 1);
        let headers = r["headers"].as_object().unwrap();
        assert_eq!(headers["anthropic-version"], "2023-06-01");
        for h in [
            "anthropic-beta",
            "authorization",
            "x-api-key",
            "x-app",
            "x-stainless-lang",
        ] {
            assert!(!headers.contains_key(h), "{h} forwarded: {headers:?}");
        }
        assert!(!r.to_string().contains(TOKEN), "task token leaked upstream");
    }
    assert_eq!(
        reqs[2]["body"]["max_tokens"], 4096,
        "clamped to the catalogue's max_output_tokens"
    );

    let view = gw.task("t1").await.unwrap();
    assert_usage(
        &view,
        &usage_sum(&[(101, 11, 7, 3), (202, 22, 5, 0), (303, 33, 0, 0)]),
    );
    assert_eq!(view["usage"]["requests"], 3);
    assert_eq!(
        view["usage"]["total_tokens"],
        101 + 11 + 7 + 3 + 202 + 22 + 5 + 303 + 33
    );
    assert_eq!(view["in_flight"], 0);
    assert_eq!(view["reserved"]["tokens"], 0);
}

#[tokio::test]
async fn count_tokens_is_local_and_never_zero() {
    let (fake, gw) = start(&json!({}));
    open(&gw, "ct", "local", json!({})).await;
    let sock = gw.task_socket("ct");
    let r = unix_request(
        &sock,
        "POST",
        "/v1/messages/count_tokens?beta=true",
        &[("authorization", &format!("Bearer {TOKEN}")), ("content-type", "application/json")],
        json!({"model": "x", "messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]}).to_string(),
    )
    .await
    .unwrap();
    assert_eq!(r.status, 200);
    let v: Value = serde_json::from_slice(&r.body).unwrap();
    assert!(v["input_tokens"].as_u64().unwrap() >= 1600, "{v}");
    assert!(
        fake.requests().unwrap().is_empty(),
        "count_tokens never goes upstream"
    );
    assert_eq!(gw.task("ct").await.unwrap()["usage"]["requests"], 0);
}

#[tokio::test]
async fn remote_models_go_through_the_bridge_with_the_bridge_token() {
    let fake = FakeLlm::scripted(&json!({"steps": [
        {"text": "via bridge", "usage": {"input_tokens": 40, "output_tokens": 4, "cache_read_input_tokens": 10}}
    ]})).unwrap();
    let (_bridge, gw) = through_bridge(&fake);
    open(&gw, "rb", "gpt", json!({})).await;
    let r = send(&gw.task_socket("rb"), &request(true, 500), Some(TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let reqs = fake.requests().unwrap();
    assert_eq!(reqs.len(), 1);
    assert_eq!(reqs[0]["path"], "/v1/chat/completions");
    assert_eq!(reqs[0]["headers"]["authorization"], "Bearer sk-provider");
    assert_eq!(reqs[0]["body"]["model"], "gpt-upstream");
    let text = reqs[0].to_string();
    assert!(!text.contains(TOKEN) && !text.contains(BRIDGE_TOKEN));
    // OpenAI's prompt_tokens (50) includes the cached 10: Anthropic terms are 40 + 10 cached.
    assert_usage(&gw.task("rb").await.unwrap(), &usage_sum(&[(40, 4, 10, 0)]));
}

#[tokio::test]
async fn exhausted_budget_is_403_before_any_upstream_call() {
    let (fake, gw) = start(&replying(90, 30));
    open(&gw, "b1", "local", json!({"tokens": 100})).await;
    let sock = gw.task_socket("b1");
    // A request is admitted only if its whole reservation (input estimate + max_tokens) fits
    // what is left (ledger.rs), so the first one asks for little; its reply (120) spends all.
    assert_eq!(
        send(&sock, &request(true, 10), Some(TOKEN)).await.status,
        200
    );
    for _ in 0..3 {
        let r = send(&sock, &request(true, 50), Some(TOKEN)).await;
        assert_eq!(r.status, 403);
        assert_eq!(error_type(&r.body), "permission_error");
        assert!(r.text().contains("budget"));
    }
    assert_eq!(
        fake.requests().unwrap().len(),
        1,
        "nothing went upstream after the budget ran out"
    );
    let view = gw.task("b1").await.unwrap();
    assert_eq!(view["usage"]["total_tokens"], 120);
    assert_eq!(view["remaining"]["tokens"], 0);
    assert_eq!(view["usage"]["requests"], 1);
}

#[tokio::test]
async fn cost_budgets_use_catalogue_prices() {
    // 1000 in at $3/M + 1000 out at $15/M = $0.018 a request.
    let (_fake, gw) = start(&replying(1000, 1000));
    let (s, v) = open(&gw, "usd", "local", json!({"usd": 0.01})).await;
    assert_eq!(s, 400, "no prices, no cost budget: {v}");
    let (s, _) = open(&gw, "usd", "priced", json!({"usd": 0.03})).await;
    assert_eq!(s, 201);
    let sock = gw.task_socket("usd");
    assert_eq!(
        send(&sock, &request(false, 100), Some(TOKEN)).await.status,
        200
    );
    assert_eq!(
        send(&sock, &request(false, 100), Some(TOKEN)).await.status,
        200
    );
    assert_eq!(
        send(&sock, &request(false, 100), Some(TOKEN)).await.status,
        403
    );
    let view = gw.task("usd").await.unwrap();
    assert!(
        (view["usage"]["cost_usd"].as_f64().unwrap() - 0.036).abs() < 1e-9,
        "{view}"
    );
}

#[tokio::test]
async fn concurrent_streams_cannot_overshoot_more_than_their_reservations() {
    let per_reply = (50u64, 50u64);
    let (fake, gw) = start(&json!({"fallback": {
        "text": "a streamed answer in several deltas",
        "usage": {"input_tokens": per_reply.0, "output_tokens": per_reply.1},
        "event_delay_ms": 5
    }}));
    let budget = 2_000u64;
    open(&gw, "c64", "local", json!({"tokens": budget})).await;
    let sock = gw.task_socket("c64");
    let body = request(true, 100);
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..64 {
        let (sock, body) = (sock.clone(), body.clone());
        set.spawn(async move { send(&sock, &body, Some(TOKEN)).await });
    }
    let (mut ok, mut refused) = (0u64, 0u64);
    while let Some(r) = set.join_next().await {
        let r = r.unwrap();
        match r.status {
            200 => ok += 1,
            403 => refused += 1,
            s => panic!("unexpected {s}: {}", r.text()),
        }
    }
    let served = fake.requests().unwrap().len() as u64;
    assert_eq!(
        served, ok,
        "every admitted request reached fakellm, no refused one did"
    );
    assert!(refused > 0, "a tight budget refuses some of 64");
    let view = gw.task("c64").await.unwrap();
    let spent = view["usage"]["total_tokens"].as_u64().unwrap();
    assert_eq!(
        spent,
        served * (per_reply.0 + per_reply.1),
        "the meter equals fakellm's own total"
    );
    // Each request reserves at most its input estimate plus max_tokens; at most 64 were in
    // flight.
    let body_tokens = (body.to_string().len() as u64).div_ceil(3) + 4;
    let max_reservation = body_tokens + 100;
    assert!(spent <= budget + 64 * max_reservation, "spent {spent}");
    assert_eq!(view["in_flight"], 0);
    // Once nothing is in flight, requests are admitted again until the budget itself is spent.
    let mut more = 0;
    while send(&sock, &body, Some(TOKEN)).await.status == 200 {
        more += 1;
        assert!(more < 100, "the budget never ran out");
    }
    let view = gw.task("c64").await.unwrap();
    let spent = view["usage"]["total_tokens"].as_u64().unwrap();
    assert_eq!(
        spent,
        fake.requests().unwrap().len() as u64 * (per_reply.0 + per_reply.1)
    );
    // Admission needs the whole reservation to fit (ledger.rs), so "spent" here means: no
    // room left for one more request's reservation.
    assert!(
        spent + max_reservation > budget,
        "refused only once the budget could not hold another request: {spent}"
    );
    assert_eq!(view["in_flight"], 0);
}

/// The state file of gateways before the slots (`state/gateway/gateway.json`, one JSON
/// document) is taken over by the gateway that replaces them: its tasks come back with their
/// spend, and it is removed once a slot holds everything it held and more.
#[tokio::test]
async fn a_state_file_from_an_older_gateway_is_taken_over() {
    let (_fake, mut gw) = start(&replying(10, 5));
    open(&gw, "old", "local", json!({"tokens": 1000})).await;
    let sock = gw.task_socket("old");
    assert_eq!(
        send(&sock, &request(false, 10), Some(TOKEN)).await.status,
        200
    );
    let saved = gw
        .saved_state_when("the first request's usage", |s| {
            s["tasks"]["old"]["spent"]["output_tokens"] == 5
        })
        .await
        .unwrap();
    // What an older gateway would have left: the same state as one file, and no slots.
    let dir = gw.data_dir().join("state/gateway");
    let legacy = dir.join("gateway.json");
    std::fs::write(&legacy, serde_json::to_vec_pretty(&saved).unwrap()).unwrap();
    for slot in ["gateway.state.0", "gateway.state.1"] {
        std::fs::remove_file(dir.join(slot)).unwrap();
    }
    gw.crash_and_restart().unwrap();
    let view = gw.task("old").await.unwrap();
    assert_eq!(view["usage"]["total_tokens"], 15);
    assert_eq!(view["state"], "open");
    assert!(legacy.exists(), "removed before a slot held it");

    assert_eq!(
        send(&sock, &request(false, 10), Some(TOKEN)).await.status,
        200
    );
    // The old file goes once a slot holds its content (and more).
    gw.saved_state_when("the second request's usage, the old file gone", |s| {
        s["tasks"]["old"]["spent"]["output_tokens"] == 10 && !legacy.exists()
    })
    .await
    .unwrap();
    gw.crash_and_restart().unwrap();
    assert_eq!(gw.task("old").await.unwrap()["usage"]["total_tokens"], 30);
}

#[tokio::test]
async fn usage_survives_restarts_and_reopening() {
    let (_fake, mut gw) = start(&replying(10, 5));
    open(&gw, "r1", "local", json!({"tokens": 1000})).await;
    let sock = gw.task_socket("r1");
    assert_eq!(
        send(&sock, &request(true, 10), Some(TOKEN)).await.status,
        200
    );

    gw.restart().unwrap();
    let view = gw.task("r1").await.unwrap();
    assert_eq!(view["usage"]["total_tokens"], 15);
    assert_eq!(view["state"], "open");
    // The socket is served again in the same directory.
    assert_eq!(
        send(&sock, &request(false, 10), Some(TOKEN)).await.status,
        200
    );

    // A crash right after a request loses nothing once the state writer caught up.
    gw.saved_state_when("the requests' usage", |s| {
        s["tasks"]["r1"]["spent"]["output_tokens"] == 10
    })
    .await
    .unwrap();
    gw.crash_and_restart().unwrap();
    assert_eq!(gw.task("r1").await.unwrap()["usage"]["total_tokens"], 30);

    // Close, then re-open: the spend continues.
    let r = gw.control("DELETE", "/tasks/r1", None).await.unwrap();
    assert_eq!(r.status, 200);
    assert!(!sock.exists(), "socket removed");
    assert!(!sock.parent().unwrap().exists(), "task dir removed");
    assert_eq!(gw.task("r1").await.unwrap()["state"], "closed");
    let (s, v) = open(&gw, "r1", "local", json!({"tokens": 1000})).await;
    assert_eq!(s, 201);
    assert_eq!(v["usage"]["total_tokens"], 30);
    let (s, _) = open(&gw, "r1", "priced", json!({})).await;
    assert_eq!(s, 409, "an open task cannot change model");
}

#[tokio::test]
async fn upstream_failures_are_reported_and_billed_for_what_was_generated() {
    let (fake, gw) = start(&json!({"steps": [
        {"error": {"status": 529}},
        {"error": {"status": 500, "body": "<html>oops</html>"}},
        {"text": "partial answer that will be cut", "usage": {"input_tokens": 70, "output_tokens": 40}, "disconnect_after_events": 5},
        {"text": "x", "usage": {"input_tokens": 1, "output_tokens": 1}}
    ]}));
    open(&gw, "uf", "local", json!({})).await;
    let sock = gw.task_socket("uf");
    let r = send(&sock, &request(true, 10), Some(TOKEN)).await;
    assert_eq!(r.status, 529, "Anthropic-shaped errors keep their status");
    assert_eq!(error_type(&r.body), "overloaded_error");
    let r = send(&sock, &request(true, 10), Some(TOKEN)).await;
    assert_eq!(r.status, 502);
    assert_eq!(error_type(&r.body), "api_error");
    let r = send(&sock, &request(true, 10), Some(TOKEN)).await;
    assert_eq!(r.status, 200);
    let frames = parse_sse(&r.text());
    assert_eq!(
        frames.last().unwrap().event.as_deref(),
        Some("error"),
        "{frames:?}"
    );
    let view = gw.task("uf").await.unwrap();
    assert_eq!(
        view["usage"]["input_tokens"], 70,
        "message_start's input is billed"
    );
    assert!(view["usage"]["output_tokens"].as_u64().unwrap() >= 1);
    assert_eq!(view["in_flight"], 0);
    assert_eq!(
        send(&sock, &request(false, 10), Some(TOKEN)).await.status,
        200,
        "still serving"
    );

    // Nothing listening upstream: 502 before the first byte.
    let gw2 = upstream_down(&fake).await;
    let r = send(&gw2.task_socket("down"), &request(true, 10), Some(TOKEN)).await;
    assert_eq!(r.status, 502);
    assert_eq!(error_type(&r.body), "api_error");
    assert_eq!(gw2.task("down").await.unwrap()["in_flight"], 0);
}

/// Posts `body` to `/v1/messages` on `sock` and reads the answer until `enough` says so, then
/// hangs up; returns what was read.
async fn post_and_hang_up(sock: &Path, body: &Value, enough: impl Fn(&[u8]) -> bool) -> Vec<u8> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::UnixStream::connect(sock).await.unwrap();
    let body = body.to_string();
    s.write_all(format!("POST /v1/messages HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}", body.len()).as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    while !enough(&got) {
        let n = s.read(&mut buf).await.unwrap();
        assert!(n > 0, "the answer ended first");
        got.extend_from_slice(&buf[..n]);
    }
    got
}

/// The task's view once its one request has settled.
async fn settled_once(gw: &GatewayProcess, tid: &str) -> Value {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let v = gw.task(tid).await.unwrap();
        if v["in_flight"] == 0 && v["usage"]["requests"] == 1 {
            return v;
        }
        assert!(std::time::Instant::now() < deadline, "never settled: {v}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn client_disconnect_is_metered_for_what_was_generated() {
    let long = "word ".repeat(400);
    let (fake, gw) = start(
        &json!({"fallback": {"text": long, "usage": {"input_tokens": 500, "output_tokens": 400}, "event_delay_ms": 20}}),
    );
    open(&gw, "dc", "local", json!({})).await;
    let sock = gw.task_socket("dc");
    // Read the head and a few frames, then hang up.
    let got = post_and_hang_up(&sock, &request(true, 1000), |got| {
        String::from_utf8_lossy(got).contains("text_delta")
    })
    .await;
    assert!(got.starts_with(b"HTTP/1.1 200"));
    let view = settled_once(&gw, "dc").await;
    assert_eq!(view["usage"]["input_tokens"], 500);
    // The upstream request was cancelled: fakellm saw its client go away mid-stream.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let cut = loop {
        let d = fake.disconnects().unwrap();
        if !d.is_empty() {
            break d;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "upstream never cancelled"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let (sent, total) = (
        cut[0]["frames_sent"].as_u64(),
        cut[0]["frames_total"].as_u64(),
    );
    assert!(sent.is_some() && total.is_some(), "{cut:?}");
    assert!(sent < total, "{cut:?}");
    let out = view["usage"]["output_tokens"].as_u64().unwrap();
    assert!(
        (1..400).contains(&out),
        "billed for what was generated before the hang-up: {out}"
    );
}

/// A whole (non-stream) answer is generated, and billed upstream, before its head: a client
/// that reads the head and a little of the body, then hangs up, is billed the usage the upstream
/// reported (the gateway reads the rest for it), not a cut document's nothing.
#[tokio::test]
async fn a_hang_up_during_a_whole_answer_bills_its_reported_usage() {
    let (_fake, gw) = start(&json!({"fallback": {
        "huge_text_bytes": 4 << 20, "usage": {"input_tokens": 500, "output_tokens": 400}
    }}));
    open(&gw, "hw", "local", json!({})).await;
    let got = post_and_hang_up(&gw.task_socket("hw"), &request(false, 1000), |got| {
        got.len() >= 64 << 10
    })
    .await;
    assert!(got.starts_with(b"HTTP/1.1 200"));
    let view = settled_once(&gw, "hw").await;
    assert_eq!(view["usage"]["input_tokens"], 500, "{view}");
    assert_eq!(view["usage"]["output_tokens"], 400, "{view}");
}

/// A translated stream cut after its head: the bridge's `message_start` carries its own guess
/// of the input (4 bytes a token of the body), which is not the provider's count, so the
/// gateway bills at least its reservation's estimate (3 bytes a token of the text, about a
/// token a character for CJK) instead of taking the guess as reported.
#[tokio::test]
async fn a_cut_translated_stream_bills_the_gateways_input_estimate() {
    let long = "word ".repeat(400);
    let fake = FakeLlm::scripted(&json!({"fallback": {
        "text": long, "usage": {"input_tokens": 9000, "output_tokens": 400}, "event_delay_ms": 20
    }}))
    .unwrap();
    let (_bridge, gw) = through_bridge(&fake);
    open(&gw, "cjk", "gpt", json!({})).await;
    let mut body = request(true, 1000);
    body["messages"][0]["content"] = json!("\u{6f22}".repeat(3000));
    let got = post_and_hang_up(&gw.task_socket("cjk"), &body, |got| {
        String::from_utf8_lossy(got).contains("text_delta")
    })
    .await;
    assert!(got.starts_with(b"HTTP/1.1 200"));
    let view = settled_once(&gw, "cjk").await;
    // 3,000 CJK characters are about 3,000 tokens; the bridge's guess was about 2,500.
    let input = view["usage"]["input_tokens"].as_u64().unwrap();
    assert!(
        input >= 3000,
        "billed {input} input tokens for 3,000 CJK characters: {view}"
    );
}

/// A provider that answers 200 with something that is not a completion has run the request
/// and billed it; the bridge answers 502, which the gateway would refund, so it says the
/// provider may have run it, and the gateway bills the whole reservation as for its own
/// upstream's garbage.
#[tokio::test]
async fn garbage_behind_the_bridge_is_billed_like_garbage_here() {
    let fake = FakeLlm::scripted(&json!({"fallback": {
        "error": {"status": 200, "body": {"not": "a completion"}}
    }}))
    .unwrap();
    let (_bridge, gw) = through_bridge(&fake);
    open(&gw, "junk", "gpt", json!({})).await;
    let r = send(&gw.task_socket("junk"), &request(false, 1000), Some(TOKEN)).await;
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(fake.requests().unwrap().len(), 1);
    let view = settled_once(&gw, "junk").await;
    assert_eq!(view["usage"]["output_tokens"], 1000, "{view}");
    assert!(
        view["usage"]["input_tokens"].as_u64().unwrap() > 0,
        "{view}"
    );
}

#[tokio::test]
async fn bad_input_gets_clear_errors_and_creates_nothing() {
    let (fake, gw) = start(&json!({"fallback": {"text": "fine"}}));
    open(&gw, "good", "local", json!({})).await;
    let sock = gw.task_socket("good");

    // Task socket.
    assert_eq!(send(&sock, &request(false, 10), None).await.status, 401);
    let r = send(&sock, &request(false, 10), Some("wrong-token-0123456789")).await;
    assert_eq!(r.status, 401);
    assert_eq!(error_type(&r.body), "authentication_error");
    let auth = format!("Bearer {TOKEN}");
    for (method, path) in [
        ("GET", "/v1/messages"),
        ("POST", "/v1/complete"),
        ("GET", "/v1/models"),
        ("POST", "/v1/messages/batches"),
        ("DELETE", "/"),
    ] {
        let r = unix_request(&sock, method, path, &[("authorization", &auth)], "")
            .await
            .unwrap();
        assert_eq!(r.status, 404, "{method} {path}");
        assert_eq!(error_type(&r.body), "not_found_error");
    }
    let post = |body: String| {
        let sock = sock.clone();
        let auth = auth.clone();
        async move {
            unix_request(
                &sock,
                "POST",
                "/v1/messages",
                &[
                    ("authorization", &auth),
                    ("content-type", "application/json"),
                ],
                body,
            )
            .await
            .unwrap()
        }
    };
    let r = post("{oops".into()).await;
    assert_eq!(
        (r.status, error_type(&r.body).as_str()),
        (400, "invalid_request_error")
    );
    let r = post("[1,2]".into()).await;
    assert_eq!(r.status, 400);
    let mut no_max = request(false, 1);
    no_max.as_object_mut().unwrap().remove("max_tokens");
    assert_eq!(post(no_max.to_string()).await.status, 400);
    let mut bad_tools = request(false, 1);
    bad_tools["tools"] = json!("nope");
    assert_eq!(post(bad_tools.to_string()).await.status, 400);
    let mut big = request(false, 1);
    big["messages"][0]["content"] = json!("x".repeat(20 << 20));
    let r = post(big.to_string()).await;
    assert_eq!(
        (r.status, error_type(&r.body).as_str()),
        (413, "request_too_large")
    );
    assert!(
        fake.requests().unwrap().is_empty(),
        "no bad request went upstream"
    );

    // Control socket.
    for (body, what) in [
        (
            json!({"tid": "Bad_Tid", "model": "local", "token": TOKEN}),
            "tid",
        ),
        (
            json!({"tid": "ok\n", "model": "local", "token": TOKEN}),
            "newline",
        ),
        (
            json!({"tid": "x".repeat(65), "model": "local", "token": TOKEN}),
            "long tid",
        ),
        (
            json!({"tid": "t2", "model": "nope", "token": TOKEN}),
            "unknown model",
        ),
        (
            json!({"tid": "t2", "model": "../local", "token": TOKEN}),
            "model path",
        ),
        (
            json!({"tid": "t2", "model": "local", "token": "short"}),
            "short token",
        ),
        (
            json!({"tid": "t2", "model": "local", "token": TOKEN, "budget": {"tokens": 0}}),
            "zero budget",
        ),
        (
            json!({"tid": "t2", "model": "local", "token": TOKEN, "budget": {"usd": -1.0}}),
            "negative usd",
        ),
        (
            json!({"tid": "t2", "model": "local", "token": TOKEN, "extra": 1}),
            "unknown field",
        ),
    ] {
        let r = gw.control("POST", "/tasks", Some(&body)).await.unwrap();
        assert_eq!(r.status, 400, "{what}: {}", r.text());
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["error"]["code"], "invalid_request", "{what}");
    }
    let r = gw.control("POST", "/tasks", None).await.unwrap();
    assert_eq!(r.status, 400);
    assert_eq!(
        gw.control("GET", "/tasks/nope", None).await.unwrap().status,
        404
    );
    assert_eq!(
        gw.control("DELETE", "/tasks/nope", None)
            .await
            .unwrap()
            .status,
        404
    );
    assert_eq!(
        gw.control("GET", "/nowhere", None).await.unwrap().status,
        404
    );

    // A socket path that is a symlink: refused, nothing created through it.
    let elsewhere = tempfile::tempdir().unwrap();
    std::os::unix::fs::symlink(elsewhere.path(), gw.data_dir().join("sockets/evil")).unwrap();
    let (s, v) = open(&gw, "evil", "local", json!({})).await;
    assert_eq!(s, 409, "{v}");
    assert_eq!(v["error"]["code"], "unsafe_socket_path");
    assert_eq!(std::fs::read_dir(elsewhere.path()).unwrap().count(), 0);
    assert_eq!(
        gw.control("GET", "/tasks/evil", None).await.unwrap().status,
        404,
        "no task recorded"
    );
    let sockets: Vec<String> = std::fs::read_dir(gw.data_dir().join("sockets"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let mut sockets = sockets;
    sockets.sort();
    assert_eq!(
        sockets,
        ["evil", "good"],
        "only the existing task's dir and the planted link"
    );

    // The other task never noticed.
    assert_eq!(
        send(&sock, &request(false, 10), Some(TOKEN)).await.status,
        200
    );
    let status: Value =
        serde_json::from_slice(&gw.control("GET", "/status", None).await.unwrap().body).unwrap();
    assert_eq!(status["open_tasks"], 1);
}

#[tokio::test]
async fn control_socket_refuses_other_uids() {
    let (_fake, gw) = start(&json!({}));
    let sock = gw.control_socket();
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&sock).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    // Open the file modes on the way to check that SO_PEERCRED alone still refuses a stranger.
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
    let mut dir = sock.parent();
    while let Some(d) =
        dir.filter(|d| d.starts_with(std::env::temp_dir()) && *d != std::env::temp_dir())
    {
        std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
        dir = d.parent();
    }
    let out = std::process::Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/curl",
            "-s",
            "-i",
            "--unix-socket",
        ])
        .arg(&sock)
        .arg("http://localhost/status")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.starts_with("HTTP/1.1 403"),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("forbidden"));
}

/// A vLLM model goes to `127.0.0.1:<port>/v1/messages` with the upstream model name.
#[tokio::test]
async fn vllm_models_go_to_their_loopback_port() {
    let (fake, gw) = start(
        &json!({"fallback": {"text": "from vllm", "usage": {"input_tokens": 3, "output_tokens": 2}}}),
    );
    open(&gw, "v1", "vl", json!({})).await;
    let r = send(&gw.task_socket("v1"), &request(false, 10), Some(TOKEN)).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let reqs = fake.requests().unwrap();
    assert_eq!(reqs[0]["path"], "/v1/messages");
    assert_eq!(
        reqs[0]["headers"]["host"]
            .as_str()
            .unwrap()
            .split(':')
            .next(),
        Some("127.0.0.1")
    );
    assert_eq!(reqs[0]["body"]["model"], "vllm-upstream");
    assert_eq!(gw.task("v1").await.unwrap()["usage"]["total_tokens"], 5);
}

/// The gateway's peak resident memory (`VmHWM`), bytes.
fn peak_rss(pid: u32) -> u64 {
    agentbox_tests::harness::status_kib(pid, "VmHWM:").unwrap() << 10
}

/// An upstream error body is read only up to the engine's cap: a 24 MiB one costs the gateway
/// no more memory than a small one, and the agent gets a small, well-formed Anthropic error.
#[tokio::test]
async fn oversized_upstream_error_bodies_are_capped() {
    let huge = "x".repeat(24 << 20);
    let (_fake, gw) = start(&json!({"steps": [
        {"error": {"status": 500, "body": "warm-up"}},
        {"error": {"status": 500, "body": {"error": {"message": huge}}}},
        {"error": {"status": 400, "body": {"error": {"message": huge}}}}
    ]}));
    drop(huge);
    open(&gw, "big", "local", json!({})).await;
    let sock = gw.task_socket("big");
    // Warm up the paths a small error takes, then measure what a huge one adds.
    let r = send(&sock, &request(false, 10), Some(TOKEN)).await;
    assert_eq!(r.status, 502);
    let before = peak_rss(gw.pid());
    for status in [502, 400] {
        let r = send(&sock, &request(false, 10), Some(TOKEN)).await;
        assert_eq!(r.status, status);
        assert!(r.body.len() < 4096, "{} bytes", r.body.len());
        let v: Value = serde_json::from_slice(&r.body).unwrap();
        assert_eq!(v["type"], "error", "{v}");
        assert!(v["error"]["message"].is_string(), "{v}");
    }
    let grown = peak_rss(gw.pid()).saturating_sub(before);
    assert!(
        grown < 8 << 20,
        "peak memory grew by {} KiB for a 24 MiB error body",
        grown >> 10
    );
    assert_eq!(gw.task("big").await.unwrap()["in_flight"], 0);
}

/// Whatever breaks upstream, a 5xx the agent sees names no upstream address: not for a closed
/// port, not for an upstream 500 whose own body names one, not for a stream cut mid-way.
#[tokio::test]
async fn no_5xx_body_names_an_upstream_url() {
    let (fake, gw) = start(&json!({"steps": [
        {"error": {"status": 500, "body": {"error": {"message": "backend http://127.0.0.1:8000/v1 refused"}}}},
        {"error": {"status": 503, "body": "<html>upstream 127.0.0.1:8000 is down</html>"}},
        {"text": "cut short by the upstream", "disconnect_after_events": 3}
    ]}));
    open(&gw, "urls", "local", json!({})).await;
    let sock = gw.task_socket("urls");
    let port = fake.base_url().rsplit(':').next().unwrap().to_owned();
    let leaks = |body: &[u8]| {
        let text = String::from_utf8_lossy(body).into_owned();
        let named = text.contains("http://")
            || text.contains("127.0.0.1")
            || text.contains(&format!(":{port}"))
            || text.contains(":8000");
        (named, text)
    };
    for _ in 0..2 {
        let r = send(&sock, &request(false, 10), Some(TOKEN)).await;
        assert_eq!(r.status, 502);
        assert_eq!(error_type(&r.body), "api_error");
        let (named, text) = leaks(&r.body);
        assert!(!named, "{text}");
    }
    let r = send(&sock, &request(true, 10), Some(TOKEN)).await;
    assert_eq!(r.status, 200);
    let frames = parse_sse(&r.text());
    assert_eq!(frames.last().unwrap().event.as_deref(), Some("error"));
    let (named, text) = leaks(frames.last().unwrap().data.as_bytes());
    assert!(!named, "{text}");

    // Nothing listening upstream.
    let gw2 = upstream_down(&fake).await;
    let r = send(&gw2.task_socket("down"), &request(false, 10), Some(TOKEN)).await;
    assert_eq!(r.status, 502);
    let text = r.text();
    assert!(
        !text.contains("http://") && !text.contains("127.0.0.1:9"),
        "{text}"
    );
    // The detail is in the log instead.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !gw2.stderr().contains("127.0.0.1:9") {
        assert!(
            std::time::Instant::now() < deadline,
            "not logged: {}",
            gw2.stderr()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Task sockets are spread over `gateway.threads` event loops, each task on the least loaded
/// one; a closed task frees its place, and every task is served wherever it landed.
#[tokio::test]
async fn tasks_are_spread_over_the_event_loops() {
    let fake = FakeLlm::scripted(&replying(3, 1)).unwrap();
    let gw = GatewayProcess::start(
        &config(&fake, None).replace("[gateway]\n", "[gateway]\nthreads = 2\n"),
        &[],
    )
    .unwrap();
    let loops = || async { gw.client().status().await.unwrap().event_loops };
    assert_eq!(loops().await, [0, 0]);
    for tid in ["a", "b", "c"] {
        assert_eq!(open(&gw, tid, "local", json!({})).await.0, 201);
    }
    assert_eq!(loops().await, [2, 1]);
    let r = gw.control("DELETE", "/tasks/a", None).await.unwrap();
    assert_eq!(r.status, 200, "{}", r.text());
    // The closed socket's loop lets go of it once its connections have drained.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while loops().await != [1, 1] {
        assert!(
            std::time::Instant::now() < deadline,
            "still {:?} after closing a",
            loops().await
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(open(&gw, "d", "local", json!({})).await.0, 201);
    assert_eq!(loops().await, [2, 1]);
    for tid in ["b", "c", "d"] {
        for stream in [false, true] {
            let r = send(&gw.task_socket(tid), &request(stream, 10), Some(TOKEN)).await;
            assert_eq!(r.status, 200, "{tid}: {}", r.text());
        }
        assert_eq!(gw.task(tid).await.unwrap()["usage"]["requests"], 2, "{tid}");
    }
}

/// A request `text` bytes long whose text shows where every 8 bytes came from.
fn numbered(len: usize, tag: char) -> String {
    (0..len.div_ceil(8))
        .map(|i| format!("{tag}{i:06} "))
        .collect::<String>()[..len]
        .to_owned()
}

/// Bodies of 64 KiB and more are read into pooled buffers (and the bridge writes their chat
/// translations into them): a buffer handed to the next request carries nothing of the last,
/// whether the next is smaller in the same size class or much smaller after a much larger one.
#[tokio::test]
async fn large_bodies_back_to_back_reach_the_model_whole() {
    let fake = FakeLlm::scripted(&replying(5, 1)).unwrap();
    let bridge = openai_bridge(&fake);
    let gw = GatewayProcess::start(
        &config(&fake, Some(&bridge)).replace("[gateway]\n", "[gateway]\nthreads = 1\n"),
        &[("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN)],
    )
    .unwrap();
    open(&gw, "big", "local", json!({})).await;
    open(&gw, "bigr", "gpt", json!({})).await;
    let sizes = [100_000, 70_000, 300_000, 90_000, 1_000];
    let mut sent = Vec::new();
    for (tid, stream) in [
        ("big", false),
        ("big", true),
        ("bigr", false),
        ("bigr", true),
    ] {
        for (i, len) in sizes.iter().enumerate() {
            let text = numbered(*len, char::from(b'a' + u8::try_from(i).unwrap()));
            let mut body = request(stream, 10);
            body["messages"][0]["content"] = json!(text);
            let r = send(&gw.task_socket(tid), &body, Some(TOKEN)).await;
            assert_eq!(r.status, 200, "{tid} {len}: {}", r.text());
            sent.push(text);
        }
    }
    let reqs = fake.requests().unwrap();
    assert_eq!(reqs.len(), sent.len());
    for (r, text) in reqs.iter().zip(&sent) {
        let seen = if r["path"] == "/v1/chat/completions" {
            let user = r["body"]["messages"].as_array().unwrap().last().unwrap();
            user["content"].as_str().unwrap().to_owned()
        } else {
            r["body"]["messages"][0]["content"]
                .as_str()
                .unwrap()
                .to_owned()
        };
        assert_eq!(seen.len(), text.len(), "{}", r["path"]);
        assert!(seen == *text, "{}: the text changed on the way", r["path"]);
    }
}
