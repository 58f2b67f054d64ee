//! The rollout model path with everything real but the model: fakellm as the RL router (chat
//! completions), the real gateway with a router model pointing at it and an open task, and the
//! real `blackbox-server` listening on a unix socket (`BBS_UNIX_SOCKET`) whose router is the
//! task's gateway socket (`BBS_ROUTER_URL=unix:<task socket>`, `BBS_ROUTER_TOKEN=<task
//! token>`), driven over that socket as the paddock does: register the real opencode, one sync
//! turn whose scripted tool call writes a file. Every call reaches fakellm through the gateway
//! with the rollout headers and without the task token, the gateway's usage is fakellm's to
//! the token, a tiny budget refuses the calls (403) and fails the turn cleanly, and a wrong
//! token is 401.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use agentbox_tests::harness::{
    BlackboxProcess, FakeLlm, GatewayProcess, assert_rollout_headers, opencode_registration,
    scratch, unix_request, user,
};
use serde_json::{Value, json};

const SESSION: &str = "sess-roll-1";
const TOKEN: &str = "slot-task-token-0123456789abcdef";

/// (input, output) per fakellm entry, so the log tells what each served request reported.
const TITLE: (u64, u64) = (7, 3);
const WRITE: (u64, u64) = (100, 20);
const DONE: (u64, u64) = (130, 2);

fn script(target: &Path) -> Value {
    json!({
        "rules": [{"match": {"has_tools": false}, "text": "title",
                   "usage": {"input_tokens": TITLE.0, "output_tokens": TITLE.1}}],
        "steps": [
            {"match": {"has_tools": true},
             "tool_calls": [{"id": "call_roll_write", "name": "write",
                             "input": {"filePath": target, "content": "from the rollout path\n"}}],
             "usage": {"input_tokens": WRITE.0, "output_tokens": WRITE.1}},
            {"match": {"has_tools": true, "body_contains": "call_roll_write"},
             "text": "done",
             "usage": {"input_tokens": DONE.0, "output_tokens": DONE.1}}
        ]
    })
}

struct Path3 {
    fake: FakeLlm,
    gw: GatewayProcess,
    bb: BlackboxProcess,
}

/// fakellm, the gateway with task `tid` (budget `budget`), and a blackbox-server on a unix
/// socket whose router is that task's socket, authenticated with `token`.
async fn start(script: &Value, tid: &str, budget: Value, token: &str) -> Path3 {
    let fake = FakeLlm::scripted(script).unwrap();
    let gw = GatewayProcess::start(&fake.router_gateway_config(), &[]).unwrap();
    let r = gw.open_task(tid, "rollout", TOKEN, budget).await.unwrap();
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let router = format!("unix:{}", gw.task_socket(tid).display());
    let bb = BlackboxProcess::start_unix(&[
        ("BBS_ROUTER_URL", router.as_str()),
        ("BBS_ROUTER_TOKEN", token),
    ])
    .unwrap();
    assert!(bb.unix_socket().unwrap().exists());
    // The paddock's registration names its own router; BBS_ROUTER_URL decides where calls go.
    let reg = opencode_registration("http://127.0.0.1:9", SESSION, &json!({}));
    let r = bb.post("/v1/rollout/register", &reg).await;
    assert_eq!(r.status, 200, "{r}\n{}", bb.describe());
    assert_eq!(
        r.body["binding"]["router_base_url"], "http://127.0.0.1:9/v1",
        "{r}"
    );
    Path3 { fake, gw, bb }
}

/// The server's proxy logged the router's refusal with `status`; its log never shows a token.
fn assert_router_refused(bb: &BlackboxProcess, status: u16, kind: &str) {
    let log = bb.stderr();
    assert!(
        log.lines().any(|l| l.contains("router returned an error")
            && l.contains(&status.to_string())
            && l.contains(kind)),
        "no router {status} in the server's log:\n{log}"
    );
    assert!(!log.contains(TOKEN), "the router token was logged");
}

fn usage_for(served_by: &str) -> (u64, u64) {
    match served_by {
        s if s.starts_with("rule") => TITLE,
        "step 0" => WRITE,
        "step 1" => DONE,
        other => panic!("unexpected fakellm answer {other}"),
    }
}

#[tokio::test]
async fn a_turn_through_the_gateway_is_tagged_metered_and_keeps_the_token_in() {
    let work = scratch().unwrap();
    let target = work.path().join("rollout.txt");
    let p = start(&script(&target), "slot-1", json!({}), TOKEN).await;
    let turn = json!({"turn_id": "turn-1", "messages": user("Create rollout.txt"), "metadata": {}});
    let r = p.bb.turn(SESSION, &turn).await;
    assert_eq!(r.status, 200, "{r}\n{}", p.bb.diag(&p.fake));
    assert_eq!(
        std::fs::read_to_string(&target).unwrap(),
        "from the rollout path\n"
    );
    assert_eq!(
        r.body["outputs"].as_array().unwrap().last().unwrap()["content"],
        "done"
    );

    let requests = p.fake.chat_requests().unwrap();
    assert!(requests.len() >= 2, "{}", p.bb.diag(&p.fake));
    assert_rollout_headers(&requests, SESSION, "turn-1");
    for req in &requests {
        assert!(
            !req.to_string().contains(TOKEN),
            "the task token reached the router: {req}"
        );
        assert!(req["headers"].get("authorization").is_none(), "{req}");
        assert!(req["headers"].get("x-api-key").is_none(), "{req}");
        assert_eq!(
            req["body"]["stream_options"]["include_usage"], true,
            "{req}"
        );
    }

    // The gateway's usage is what fakellm reported, to the token.
    let (mut input, mut output) = (0, 0);
    for req in &requests {
        let (i, o) = usage_for(req["served_by"].as_str().unwrap());
        input += i;
        output += o;
    }
    let view = p.gw.task("slot-1").await.unwrap();
    let u = &view["usage"];
    assert_eq!(u["input_tokens"], input, "{view}");
    assert_eq!(u["output_tokens"], output, "{view}");
    assert_eq!(u["total_tokens"], input + output, "{view}");
    assert_eq!(u["requests"], requests.len(), "{view}");
    assert_eq!(view["reserved"]["tokens"], 0, "{view}");
    // Router control calls go to the same socket; the gateway serves none, so a pause is the
    // router's failure with its 404 (the proxy documents this).
    let pause =
        p.bb.post("/v1/rollout/pause", &json!({"reason": "weight_update"}))
            .await;
    assert_eq!(pause.status, 502, "{pause}");
    let message = pause.body["message"].as_str().unwrap();
    assert!(
        message.contains("/rollout/pause failed with HTTP 404"),
        "{pause}"
    );
    assert!(!pause.to_string().contains(TOKEN), "{pause}");
    // The turn's own counts (from the same usage, read by the blackbox proxy) agree.
    assert_eq!(r.body["usage"]["input_tokens"], input, "{r}");
    assert_eq!(r.body["usage"]["output_tokens"], output, "{r}");
}

#[tokio::test]
async fn a_tiny_budget_refuses_the_calls_and_the_turn_fails_cleanly() {
    let work = scratch().unwrap();
    let target = work.path().join("never.txt");
    let p = start(&script(&target), "slot-b", json!({"tokens": 10}), TOKEN).await;
    // Spend the budget first (a lone request is admitted while anything is left: ledger.rs).
    let auth = format!("Bearer {TOKEN}");
    let spend = unix_request(
        &p.gw.task_socket("slot-b"),
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("authorization", auth.as_str()),
        ],
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}).to_string(),
    )
    .await
    .unwrap();
    assert_eq!(spend.status, 200);
    let spent = p.gw.task("slot-b").await.unwrap()["usage"]["total_tokens"].clone();
    assert_eq!(spent, TITLE.0 + TITLE.1);
    let r =
        p.bb.turn(
            SESSION,
            &json!({"turn_id": "turn-b", "messages": user("Create never.txt")}),
        )
        .await;
    assert_eq!(
        r.status,
        502,
        "the turn must fail: {r}\n{}",
        p.bb.diag(&p.fake)
    );
    assert_eq!(r.body["error"], "backend_error", "{r}");
    assert!(!target.exists(), "no tool ran");
    assert_eq!(
        p.fake.requests().unwrap().len(),
        1,
        "nothing more reached the router"
    );
    let view = p.gw.task("slot-b").await.unwrap();
    assert_eq!(view["usage"]["total_tokens"], spent, "{view}");
    assert_eq!(view["usage"]["requests"], 1, "{view}");
    assert_eq!(view["reserved"]["tokens"], 0, "{view}");
    // The refusal was the gateway's 403, as the server's proxy logged it.
    assert_router_refused(&p.bb, 403, "budget is exhausted");
    // The server is still serving over its socket.
    let s = p.bb.get("/v1/status").await;
    assert_eq!(s.status, 200, "{s}");
}

#[tokio::test]
async fn a_wrong_router_token_is_401_and_nothing_reaches_the_router() {
    let work = scratch().unwrap();
    let target = work.path().join("never.txt");
    let p = start(&script(&target), "slot-w", json!({}), "not-the-task-token").await;
    let r =
        p.bb.turn(
            SESSION,
            &json!({"turn_id": "turn-w", "messages": user("Create never.txt")}),
        )
        .await;
    assert!(
        r.status >= 400,
        "the turn must fail: {r}\n{}",
        p.bb.diag(&p.fake)
    );
    assert_eq!(r.body["error"], "backend_error", "{r}");
    assert_router_refused(&p.bb, 401, "authentication_error");
    assert!(!target.exists());
    assert!(
        p.fake.requests().unwrap().is_empty(),
        "nothing reached the router"
    );
    // The same socket, asked directly with the wrong token: 401 in OpenAI's shape.
    let direct = unix_request(
        &p.gw.task_socket("slot-w"),
        "POST",
        "/v1/chat/completions",
        &[
            ("content-type", "application/json"),
            ("authorization", "Bearer not-the-task-token"),
        ],
        json!({"model": "m", "messages": [{"role": "user", "content": "x"}]}).to_string(),
    )
    .await
    .unwrap();
    assert_eq!(direct.status, 401);
    let e: Value = serde_json::from_slice(&direct.body).unwrap();
    assert_eq!(e["error"]["type"], "authentication_error", "{e}");
    assert_eq!(p.gw.task("slot-w").await.unwrap()["usage"]["requests"], 0);
}
