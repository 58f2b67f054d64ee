//! A whole paddock episode against blackbox-server, in the order and with the bodies of the
//! reference client (`dressage/paddock/blackbox/client.py`, `paddock.py`, `common/*.py`):
//! health, register (the paddock's opencode defaults, a system prompt file, a sandbox id,
//! `server_config` without `runtime_root` as for local bwrap), an async turn (submit with a
//! stable `turn_id`, a retried submit, long polls with `wait=30`), execute_cmd with
//! `timeout: null`, a sync-mode turn, pause/resume, a cancelled turn (its error as
//! `_raise_turn_error` reads it), abort, and a rebind to a new session that takes turns.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;
use std::time::{Duration, Instant};

use agentbox_tests::harness::{BlackboxProcess, FakeLlm, Reply, opencode_registration};
use serde_json::{Value, json};

fn fakellm_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fakellm"))
}

/// `register_agent`'s payload, as `client.py` builds it for the paddock's opencode defaults.
fn register_payload(router: &str, session_id: &str, prompt: &Path) -> Value {
    let mut v = opencode_registration(
        router,
        session_id,
        &json!({
            "bound_instance_id": "inst-episode",
            // server_config_for() with runtime_root popped for local_bwrap.
            "server_config": {"backend_timeout": 1800},
            "bound_sandbox_id": "sbx-episode",
            "system_prompt_file": prompt,
        }),
    );
    // merge_backend_options("opencode", None, args): static defaults + dynamic limits,
    // DRESSAGE_BLACKBOX_MAX_STEPS=0 (no limit).
    let opts = &mut v["backend_options"];
    opts["model_limit"] = json!({"context": 32768, "output": 4096, "input": 28672});
    opts["proxy"] = json!({"default_temperature": 1.0, "max_steps": null});
    opts["compaction"] = json!({"auto": true, "prune": true, "reserved": 4096});
    v
}

/// `register_agent`: the registration of `session_id` on `fake`, posted with retry; it must
/// succeed.
async fn register(bb: &BlackboxProcess, fake: &FakeLlm, session_id: &str, prompt: &Path) -> Reply {
    let payload = register_payload(&fake.base_url(), session_id, prompt);
    let reg = post_with_retry(bb, "/v1/rollout/register", &payload).await;
    assert_eq!(reg.status, 200, "{reg}\n{}", bb.describe());
    reg
}

/// `post_json_with_retry`: retried on 503 (and connect errors), anything else raised.
async fn post_with_retry(bb: &BlackboxProcess, path: &str, body: &Value) -> Reply {
    for _ in 0..6 {
        let r = bb.post(path, body).await;
        if r.status != 503 {
            return r;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    panic!("still 503 after 6 attempts: {path}");
}

/// `call_agent` in async mode: submit (re-posted once, as after a lost answer), then poll.
async fn call_agent_async(bb: &BlackboxProcess, session: &str, turn: &str, text: &str) -> Value {
    let body = json!({"turn_id": turn, "mode": "async",
                      "messages": [{"role": "user", "content": text}], "metadata": {}});
    let path = format!("/v1/sessions/{session}/messages");
    let first = post_with_retry(bb, &path, &body).await;
    assert_eq!(first.status, 202, "{first}");
    assert_eq!(first.body["idempotent_replay"], false);
    let again = post_with_retry(bb, &path, &body).await;
    assert_eq!(
        (again.status, again.body["idempotent_replay"].as_bool()),
        (202, Some(true)),
        "{again}"
    );
    bb.poll_turn(session, turn, 30, settled).await
}

/// `_poll_turn` stops at committed and at the error states.
fn settled(turn: &Value) -> bool {
    matches!(
        turn["status"].as_str(),
        Some("committed" | "failed" | "unknown" | "cancelled")
    )
}

fn last_text(outputs: &Value) -> &str {
    outputs.as_array().unwrap().last().unwrap()["content"]
        .as_str()
        .unwrap_or("")
}

#[tokio::test]
async fn a_paddock_episode_as_the_reference_client_drives_it() {
    let work = tempfile::Builder::new()
        .prefix("bb-episode-")
        .tempdir()
        .unwrap();
    let answer = work.path().join("answer.txt");
    let prompt = work.path().join("build.txt");
    std::fs::write(&prompt, "You are the episode agent. PROMPT-MARKER-42\n").unwrap();
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [
            {"match": {"has_tools": true, "body_contains": "first task"},
             "tool_calls": [{"id": "call_ep_write", "name": "write",
                             "input": {"filePath": answer, "content": "42\n"}}]},
            {"match": {"has_tools": true, "body_contains": "call_ep_write"}, "text": "wrote it"},
            {"match": {"has_tools": true, "body_contains": "second task"}, "text": "second done"},
            {"match": {"has_tools": true, "body_contains": "slow task"}, "text": "late", "delay_ms": 60_000},
            {"match": {"has_tools": true, "body_contains": "third task"}, "text": "third done"}
        ]
    });
    let fake = FakeLlm::start(fakellm_bin(), &script).unwrap();
    let bb = BlackboxProcess::start(&[]).unwrap();

    // health, then register.
    let h = bb.get("/health").await;
    assert_eq!(h.status, 200);
    let reg = register(&bb, &fake, "sess-ep-1", &prompt).await;
    assert_eq!(reg.body["binding"]["bound_sandbox_id"], "sbx-episode");
    assert_eq!(reg.body["binding"]["system_prompt"]["applies_to"], "build");
    assert_eq!(reg.body["config"]["backend_timeout"], 1800.0);
    let s = bb.get("/v1/sessions/sess-ep-1?include_history=true").await;
    assert_eq!(
        s.body["message_count"], 1,
        "the system prompt opens the history: {s}"
    );
    assert_eq!(s.body["conversation_history"][0]["role"], "system");

    // An async turn that edits a file.
    let t1 = call_agent_async(
        &bb,
        "sess-ep-1",
        "turn-0123456789abcdef0123456789abcdef",
        "first task: write the answer",
    )
    .await;
    assert_eq!(t1["status"], "committed", "{t1}\n{}", bb.describe());
    assert_eq!(last_text(&t1["outputs"]), "wrote it");
    assert_eq!(t1["instance_id"], "inst-episode");
    assert!(t1["usage"]["steps"].as_u64().unwrap() >= 2, "{t1}");
    assert_eq!(std::fs::read_to_string(&answer).unwrap(), "42\n");
    let calls = fake.chat_requests().unwrap();
    assert!(
        calls
            .iter()
            .any(|c| c["body"].to_string().contains("PROMPT-MARKER-42")),
        "the register-time system prompt never reached the model"
    );
    for c in &calls {
        assert_eq!(c["headers"]["x-dressage-sandbox-id"], "sbx-episode", "{c}");
    }

    // execute_cmd as build_execute_cmd_payload sends it (timeout null).
    let cmd = bb
        .execute_cmd(
            "sess-ep-1",
            &json!({"cmd": format!("cat {}", answer.display()), "timeout": null}),
        )
        .await;
    assert_eq!(
        (cmd.status, cmd.body["stdout"].as_str()),
        (200, Some("42\n")),
        "{cmd}"
    );

    // A sync-mode call (DRESSAGE_BLACKBOX_AGENT_CALL_MODE=sync).
    let sync = post_with_retry(
        &bb,
        "/v1/sessions/sess-ep-1/messages",
        &json!({"turn_id": "turn-sync-1", "mode": "sync",
                "messages": [{"role": "user", "content": "second task"}], "metadata": {}}),
    )
    .await;
    assert_eq!(sync.status, 200, "{sync}");
    assert_eq!(last_text(&sync.body["outputs"]), "second done");
    assert_eq!(sync.body["state"], "active");

    // pause / resume as the client sends them.
    let p = bb
        .post("/v1/rollout/pause", &json!({"reason": "weight_update"}))
        .await;
    assert_eq!(p.status, 200, "{p}");
    let r = bb
        .post(
            "/v1/rollout/resume",
            &json!({"reason": "weight_update", "version": null}),
        )
        .await;
    assert_eq!(r.status, 200, "{r}");

    // A turn cancelled in flight: the poll ends with the error the client re-raises.
    let slow = json!({"turn_id": "turn-slow", "mode": "async",
                      "messages": [{"role": "user", "content": "slow task"}], "metadata": {}});
    let sub = post_with_retry(&bb, "/v1/sessions/sess-ep-1/messages", &slow).await;
    assert_eq!(sub.status, 202, "{sub}");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let t = bb
            .get("/v1/sessions/sess-ep-1/turns/turn-slow?wait=1")
            .await;
        if t.body["status"] == "inflight" {
            break;
        }
        assert!(Instant::now() < deadline, "{t}");
    }
    let c = bb
        .post_empty("/v1/sessions/sess-ep-1/turns/turn-slow/cancel")
        .await;
    assert_eq!(c.status, 200, "{c}");
    let cancelled = bb.poll_turn("sess-ep-1", "turn-slow", 30, settled).await;
    assert_eq!(cancelled["status"], "cancelled", "{cancelled}");
    let err = &cancelled["error"];
    assert_eq!(
        (err["error"].as_str(), err["http_status"].as_u64()),
        (Some("cancelled"), Some(499))
    );
    assert!(
        err["message"].is_string() && err["details"].is_object(),
        "{err}"
    );

    // abort, then the rollout manager rebinds the slot to a new session.
    let a = bb.post_empty("/v1/sessions/sess-ep-1/abort").await;
    assert_eq!(
        (a.status, a.body["state"].as_str()),
        (200, Some("aborted")),
        "{a}"
    );
    let reg2 = register(&bb, &fake, "sess-ep-2", &prompt).await;
    assert_ne!(
        reg2.body["binding"]["runtime_id"],
        reg.body["binding"]["runtime_id"]
    );
    let t3 = call_agent_async(&bb, "sess-ep-2", "turn-third", "third task").await;
    assert_eq!(t3["status"], "committed", "{t3}\n{}", bb.describe());
    assert_eq!(last_text(&t3["outputs"]), "third done");
    let old = bb.get("/v1/sessions/sess-ep-1").await;
    assert_eq!(
        old.status, 409,
        "the old session is no longer served: {old}"
    );
}
