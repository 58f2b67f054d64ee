//! blackbox-server refusing bad input the way the reference does (status, and the body
//! `{request_id, error, message, details}` with `x-request-id` matching): before and after a
//! registration, malformed JSON, unknown sessions, bad ids, an oversized body, a system
//! message in a turn, bad registrations; and its command line (`--help`, a bad variable).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::Duration;

use agentbox_tests::harness::{
    BlackboxProcess, FakeLlm, Reply, opencode_registration, run_captured, user, user_turn,
    workspace_bin,
};
use serde_json::{Value, json};

fn fakellm_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fakellm"))
}

/// Makes a good registration bad.
type Spoil = fn(&mut Value);
/// Checks the body of the refusal.
type Check = fn(&Value);

/// An error answer of the reference's shape; returns its body.
fn error(r: &Reply, status: u16, code: &str) -> Value {
    assert_eq!(r.status, status, "{r}");
    let b = &r.body;
    assert_eq!(b["error"], code, "{r}");
    assert!(b["message"].is_string(), "{r}");
    assert!(b["details"].is_object(), "{r}");
    let rid = b["request_id"].as_str().unwrap();
    assert!(rid.starts_with("req-") && rid.len() == 12, "{r}");
    assert_eq!(r.request_id.as_deref(), Some(rid), "x-request-id differs");
    b.clone()
}

#[tokio::test]
async fn bad_input_gets_the_reference_status_and_body() {
    let fake = FakeLlm::start(fakellm_bin(), &json!({})).unwrap();
    let bb = BlackboxProcess::start(&[]).unwrap();
    let health = bb.get("/health").await;
    assert_eq!(
        (health.status, &health.body["healthy"]),
        (200, &json!(true))
    );

    // Nothing registered: turns are 503 (which the paddock retries), sessions unknown.
    let r = bb
        .post("/v1/sessions/sess-001/messages", &user_turn("t", "x"))
        .await;
    let b = error(&r, 503, "service_unavailable");
    assert_eq!(b["details"]["state"], "idle");
    let r = bb.get("/v1/sessions/sess-001").await;
    error(&r, 404, "not_found");
    let r = bb.post("/v1/rollout/pause", &json!({})).await;
    error(&r, 503, "service_unavailable");

    // Bad registrations: 400, and the server stays idle. Each case spoils a good registration
    // and checks what the answer says about it.
    let good = opencode_registration(&fake.base_url(), "sess-001", &json!({}));
    let cases: [(Spoil, Check); 7] = [
        (
            |r| {
                r.as_object_mut().unwrap().remove("bound_session_id");
            },
            |b| assert_eq!(b["message"], "bound_session_id is required."),
        ),
        (
            |r| r["backend_options"]["model_limit"] = json!({"context": 200_000}),
            |b| {
                let msg = b["message"].as_str().unwrap();
                assert!(
                    msg.contains("Invalid opencode backend_options") && msg.contains("model_limit"),
                    "{msg}"
                );
            },
        ),
        (
            |r| r["backend_options"]["proxy"] = json!({"enabled": false}),
            |_| {},
        ),
        (
            |r| r["blackbox_type"] = json!("nope"),
            |b| assert_eq!(b["details"]["blackbox_type"], "nope"),
        ),
        (
            |r| r["server_config"] = json!({"execute_cmd_timeout": 0}),
            |b| assert_eq!(b["message"], "Request validation failed."),
        ),
        (
            |r| r["bound_session_id"] = json!("no spaces"),
            |b| assert_eq!(b["message"], "session_id has invalid format."),
        ),
        (|r| r["system_prompt_file"] = json!("prompt.txt"), |_| {}),
    ];
    for (spoil, check) in cases {
        let mut bad = good.clone();
        spoil(&mut bad);
        let r = bb.post("/v1/rollout/register", &bad).await;
        check(&error(&r, 400, "request_error"));
    }
    let status = bb.get("/v1/status").await;
    assert_eq!(status.body["status"], "idle", "{status}");

    let r = bb.post("/v1/rollout/register", &good).await;
    assert_eq!(r.status, 200, "{r}\n{}", bb.describe());
    let path = "/v1/sessions/sess-001/messages";

    // Malformed JSON.
    let r = bb
        .post_raw(path, b"{\"messages\": [".to_vec())
        .await
        .unwrap();
    let b = error(&r, 400, "request_error");
    assert_eq!(b["message"], "Request validation failed.");
    assert_eq!(b["details"]["errors"][0]["type"], "json_invalid", "{b}");
    // A body that is not the model: missing field, bad role, bad mode.
    for body in [
        json!({"turn_id": "t"}),
        json!({"turn_id": "t", "messages": [{"role": "boss", "content": "x"}]}),
        json!({"turn_id": "t", "messages": user("x"), "mode": "later"}),
    ] {
        let b = error(&bb.post(path, &body).await, 400, "request_error");
        assert_eq!(b["message"], "Request validation failed.", "{body}");
        assert!(b["details"]["errors"][0]["loc"][0] == "body", "{b}");
    }
    // Unknown session: this binding serves only its own.
    let b = error(
        &bb.post("/v1/sessions/sess-999/messages", &user_turn("t", "x"))
            .await,
        409,
        "bound_session_mismatch",
    );
    assert_eq!(
        b["details"],
        json!({"expected_session_id": "sess-001", "actual_session_id": "sess-999"})
    );
    error(
        &bb.get("/v1/sessions/sess-999").await,
        409,
        "bound_session_mismatch",
    );
    // Bad ids, in the path and in the body.
    let b = error(
        &bb.post("/v1/sessions/-bad/messages", &user_turn("t", "x"))
            .await,
        400,
        "request_error",
    );
    assert_eq!(b["message"], "session_id has invalid format.");
    assert_eq!(b["details"]["session_id"], "-bad");
    // A bad turn id (in the body and in the path), a system message in a turn (the prompt comes
    // from system_prompt_file at register), no messages: 400 with the reference's message.
    let long = format!("/v1/sessions/sess-001/turns/{}", "t".repeat(129));
    let system = json!({"turn_id": "t", "messages": [{"role": "system", "content": "be terse"}]});
    for (target, body, message) in [
        (
            path,
            Some(user_turn("t/../x", "x")),
            "turn_id has invalid format.",
        ),
        (long.as_str(), None, "turn_id has invalid format."),
        (
            path,
            Some(system),
            "opencode phase 1 only accepts a user message.",
        ),
        (
            path,
            Some(json!({"turn_id": "t", "messages": []})),
            "messages must not be empty.",
        ),
    ] {
        let r = match &body {
            Some(body) => bb.post(target, body).await,
            None => bb.get(target).await,
        };
        let b = error(&r, 400, "request_error");
        assert_eq!(b["message"], message, "{target} {body:?}");
    }
    // A body over 20 MiB.
    let mut big = br#"{"turn_id": "t", "messages": [{"role": "user", "content": ""#.to_vec();
    big.resize((20 << 20) + 1, b'a');
    big.extend_from_slice(br#""}]}"#);
    let b = error(
        &bb.post_raw(path, big).await.unwrap(),
        413,
        "payload_too_large",
    );
    assert_eq!(b["details"]["limit_bytes"], 20 << 20);
    // Bad query values.
    for target in [
        "/v1/sessions/sess-001/turns/t?wait=-1",
        "/v1/sessions/sess-001?include_turns=maybe",
    ] {
        error(&bb.get(target).await, 400, "request_error");
    }
    // Unknown routes and methods: FastAPI's bodies.
    let r = bb.get("/v1/nothing").await;
    assert_eq!((r.status, &r.body), (404, &json!({"detail": "Not Found"})));
    let r = bb.get("/v1/rollout/register").await;
    assert_eq!(
        (r.status, &r.body),
        (405, &json!({"detail": "Method Not Allowed"}))
    );

    // None of it reached the agent or the model; the session is untouched.
    let s = bb.get("/v1/sessions/sess-001?include_turns=true").await;
    assert_eq!(s.body["state"], "active", "{s}");
    assert_eq!(s.body["turn_ledger"], json!({}), "{s}");
    let calls = fake.chat_requests().unwrap();
    assert!(calls.is_empty(), "{calls:?}");
}

#[tokio::test]
async fn help_lists_every_variable_and_a_bad_one_is_named() {
    let bin = workspace_bin("agentbox-blackbox", "blackbox-server").unwrap();
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.arg("--help").env_clear();
    let help = run_captured("blackbox-server --help", cmd, Duration::from_secs(20))
        .await
        .unwrap();
    assert!(help.status.success(), "{}", help.describe());
    for var in [
        "BBS_HOST",
        "BBS_PORT",
        "BBS_RUNTIME_ROOT",
        "BBS_MAX_SESSIONS",
        "BBS_MAX_TURNS",
        "BBS_BACKEND_TIMEOUT",
        "BBS_EXECUTE_CMD_TIMEOUT",
        "BBS_ROUTER_TIMEOUT",
        "BBS_SHUTDOWN_TIMEOUT",
        "BBS_RUNTIME_HEALTH_CHECK_INTERVAL",
        "BBS_RUNTIME_HEALTH_CHECK_RETRIES",
        "BBS_RUNTIME_HEALTH_CHECK_RETRY_DELAY",
        "OPENCODE_BIN",
        "OPENCLAW_BIN",
        "CLAUDE_CODE_BIN",
        "CODEX_BIN",
    ] {
        assert!(help.stdout.contains(var), "{var} missing:\n{}", help.stdout);
    }
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.env_clear()
        .env("BBS_PORT", "0")
        .env("BBS_BACKEND_TIMEOUT", "soon");
    let bad = run_captured(
        "blackbox-server with a bad variable",
        cmd,
        Duration::from_secs(20),
    )
    .await
    .unwrap();
    assert_eq!(bad.status.code(), Some(78), "{}", bad.describe());
    assert!(
        bad.stderr.contains("BBS_BACKEND_TIMEOUT"),
        "{}",
        bad.describe()
    );
    assert!(!bad.stdout.contains("listening"), "{}", bad.describe());
}
