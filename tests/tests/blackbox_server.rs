//! blackbox-server end to end: the server as a process, the real opencode behind it, fakellm
//! (chat completions) as the router behind the in-process proxy. Registration and rebind,
//! sync and async turns (a scripted tool call that really writes a file), replay and
//! conflicts, long poll and cancel, execute_cmd, abort, backend timeout, max_steps, a dead
//! agent, pause/resume, the headers every proxied call carries, and SIGTERM leaving nothing.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentbox_tests::harness::{
    BlackboxProcess, FakeLlm, assert_rollout_headers, last_text, live_group_members,
    opencode_registration, processes_with, scratch, settled, user, user_turn, wait_group_gone,
};
use serde_json::{Value, json};

const SESSION: &str = "sess-001";

fn fakellm_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fakellm"))
}

/// fakellm with `script`, and a blackbox-server (with `env`) registered on it with `extra`
/// over the paddock's registration.
async fn setup(
    script: &Value,
    env: &[(&str, &str)],
    extra: &Value,
) -> (FakeLlm, BlackboxProcess, Value) {
    let fake = FakeLlm::start(fakellm_bin(), script).unwrap();
    let bb = BlackboxProcess::start(env).unwrap();
    let r = bb
        .post(
            "/v1/rollout/register",
            &opencode_registration(&fake.base_url(), SESSION, extra),
        )
        .await;
    assert_eq!(r.status, 200, "{r}\n{}", bb.describe());
    (fake, bb, r.body)
}

fn diag(bb: &BlackboxProcess, fake: &FakeLlm) -> String {
    bb.diag(fake)
}

/// fakellm scripted to have opencode write `content` to `target` (call id `call_id`), then
/// answer "done".
fn write_script(target: &Path, content: &str, call_id: &str) -> Value {
    json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [
            {"match": {"has_tools": true},
             "tool_calls": [{"id": call_id, "name": "write",
                             "input": {"filePath": target, "content": content}}],
             "usage": {"input_tokens": 100, "output_tokens": 20}},
            {"match": {"has_tools": true, "body_contains": call_id},
             "text": "done",
             "usage": {"input_tokens": 130, "output_tokens": 2}}
        ]
    })
}

#[tokio::test]
async fn register_is_idempotent_and_rebinds_only_without_open_sessions() {
    let fake = FakeLlm::start(fakellm_bin(), &json!({})).unwrap();
    let bb = BlackboxProcess::start(&[]).unwrap();
    let reg = opencode_registration(&fake.base_url(), SESSION, &json!({}));
    let first = bb.post("/v1/rollout/register", &reg).await;
    assert_eq!(first.status, 200, "{first}\n{}", bb.describe());
    assert_eq!(first.body["status"], "ready");
    assert_eq!(
        first.body["request_id"].as_str(),
        first.request_id.as_deref()
    );
    let binding = &first.body["binding"];
    assert_eq!(binding["bound_session_id"], SESSION);
    assert_eq!(
        binding["router_base_url"],
        format!("{}/v1", fake.base_url())
    );
    assert_eq!(first.body["capabilities"]["system_message"], true);
    assert_eq!(first.body["config"]["max_turns"], 200);
    let runtime_dir = binding["runtime_dir"].as_str().unwrap().to_owned();
    assert!(runtime_dir.starts_with(bb.runtime_root().to_str().unwrap()));
    let pid = BlackboxProcess::opencode_pid(&runtime_dir).expect("opencode pid file");

    // Same registration: a no-op answering the same binding.
    let again = bb.post("/v1/rollout/register", &reg).await;
    assert_eq!(again.status, 200, "{again}");
    assert_eq!(again.body["binding"]["runtime_id"], binding["runtime_id"]);
    assert_eq!(BlackboxProcess::opencode_pid(&runtime_dir), Some(pid));

    let status = bb.get("/v1/status").await;
    assert_eq!(status.body["status"], "ready");
    assert_eq!(status.body["sessions"]["active_count"], 1);
    assert_eq!(
        status.body["implemented_backends"],
        json!(["opencode", "openclaw", "claude_code", "codex"])
    );
    assert_eq!(
        status.body["known_backends"],
        json!(["opencode", "openclaw", "claude_code", "codex"])
    );

    // Another registration while the session is open: 409, the agent untouched.
    let other = opencode_registration(&fake.base_url(), "sess-002", &json!({}));
    let conflict = bb.post("/v1/rollout/register", &other).await;
    assert_eq!(conflict.status, 409, "{conflict}");
    assert_eq!(conflict.body["error"], "conflict");
    assert!(!live_group_members(pid).is_empty(), "opencode stopped");

    // After abort the rebind tears everything down and starts again.
    let abort = bb
        .post_empty(&format!("/v1/sessions/{SESSION}/abort"))
        .await;
    assert_eq!(
        (abort.status, abort.body["mode"].as_str()),
        (200, Some("best_effort")),
        "{abort}"
    );
    let rebind = bb.post("/v1/rollout/register", &other).await;
    assert_eq!(rebind.status, 200, "{rebind}\n{}", bb.describe());
    assert_ne!(rebind.body["binding"]["runtime_id"], binding["runtime_id"]);
    assert_eq!(rebind.body["binding"]["bound_session_id"], "sess-002");
    let left = wait_group_gone(pid, Duration::from_secs(5));
    assert!(
        left.is_empty(),
        "the old opencode survived the rebind: {left:?}"
    );
    assert!(
        !Path::new(&runtime_dir).exists(),
        "old runtime dir left behind"
    );
    let status = bb.get("/v1/status").await;
    assert_eq!(status.body["sessions"]["total_count"], 1, "{status}");
    assert_eq!(status.body["binding"]["bound_session_id"], "sess-002");
}

#[tokio::test]
async fn a_sync_turn_writes_a_file_and_replays_without_a_second_run() {
    let work = scratch().unwrap();
    let target = work.path().join("hello.txt");
    let content = "hello from the blackbox\n";
    let (fake, bb, reg) = setup(
        &write_script(&target, content, "call_bb_write_1"),
        &[],
        &json!({}),
    )
    .await;
    let turn = json!({"turn_id": "turn-1", "messages": user("Create hello.txt"), "metadata": {}});
    let path = format!("/v1/sessions/{SESSION}/messages");
    let r = bb.turn(SESSION, &turn).await;
    assert_eq!(r.status, 200, "{r}\n{}", diag(&bb, &fake));
    assert_eq!(std::fs::read_to_string(&target).unwrap(), content);
    let body = &r.body;
    assert_eq!(body["turn_id"], "turn-1");
    assert_eq!(body["idempotent_replay"], false);
    assert_eq!(body["state"], "active");
    assert_eq!(body["instance_id"], "inst-001");
    assert_eq!(body["backend"]["type"], "opencode");
    assert!(
        body["backend"]["backend_session_id"]
            .as_str()
            .unwrap()
            .starts_with("ses")
    );
    let outputs = body["outputs"].as_array().unwrap();
    let call = outputs
        .iter()
        .find_map(|m| m["tool_calls"].as_array().and_then(|c| c.first()))
        .unwrap_or_else(|| panic!("no tool call in {body}"));
    assert_eq!(call["id"], "call_bb_write_1");
    assert_eq!(call["function"]["name"], "write");
    assert!(
        outputs
            .iter()
            .any(|m| m["role"] == "tool" && m["tool_call_id"] == "call_bb_write_1")
    );
    assert_eq!(outputs.last().unwrap()["content"], "done", "{body}");
    assert_eq!(body["usage"]["steps"], 2, "{body}");

    // Every proxied model call carries the rollout headers.
    let requests = fake.chat_requests().unwrap();
    assert!(requests.len() >= 2, "{}", diag(&bb, &fake));
    assert_rollout_headers(&requests, SESSION, "turn-1");

    // The same turn again: the committed result, and no new model call.
    bb.assert_replay(&fake, &path, &turn, body).await;

    // Same turn id, other messages: 409.
    let other = user_turn("turn-1", "Something else");
    let conflict = bb.turn(SESSION, &other).await;
    assert_eq!(conflict.status, 409, "{conflict}");
    assert_eq!(conflict.body["details"]["turn_id"], "turn-1");

    let session = bb
        .get(&format!(
            "/v1/sessions/{SESSION}?include_history=true&include_turns=true"
        ))
        .await;
    assert_eq!(session.status, 200, "{session}");
    assert_eq!(session.body["turn_count"], 1);
    assert_eq!(session.body["turn_ledger"]["turn-1"]["status"], "committed");
    assert_eq!(session.body["conversation_history"][0]["role"], "user");
    assert_eq!(
        session.body["backend_session_id"],
        body["backend"]["backend_session_id"]
    );
    drop(reg);
}

#[tokio::test]
async fn async_turns_long_poll_cancel_and_block_execute_cmd() {
    // The first model call is held long enough to observe the turn in flight.
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [
            {"match": {"has_tools": true}, "text": "late", "delay_ms": 60_000},
            {"match": {"has_tools": true}, "text": "second turn done"}
        ]
    });
    // One committed turn at most (BBS_MAX_TURNS through the registration's server_config).
    let (fake, bb, _) = setup(&script, &[], &json!({"server_config": {"max_turns": 1}})).await;
    let submit =
        json!({"turn_id": "turn-a", "mode": "async", "messages": user("slow"), "metadata": {}});
    let r = bb.turn(SESSION, &submit).await;
    assert_eq!(r.status, 202, "{r}");
    assert_eq!(r.body["status"], "queued");
    assert_eq!(r.body["idempotent_replay"], false);
    assert_eq!(r.body["turn_id"], "turn-a");
    // A retried submit re-attaches.
    let again = bb.turn(SESSION, &submit).await;
    assert_eq!(
        (again.status, again.body["idempotent_replay"].as_bool()),
        (202, Some(true)),
        "{again}"
    );
    // Async without a turn id: 400.
    let no_id = bb
        .turn(SESSION, &json!({"mode": "async", "messages": user("x")}))
        .await;
    assert_eq!(no_id.status, 400, "{no_id}");
    assert_eq!(
        no_id.body["message"],
        "turn_id is required for async submissions."
    );

    // Wait until the model call is held, then long-poll: the snapshot comes back when the
    // wait expires (never a 504).
    bb.wait_for("no model call", &fake, Duration::from_secs(60), || {
        !fake.chat_requests().unwrap().is_empty()
    })
    .await;
    let started = Instant::now();
    let poll = bb
        .get(&format!("/v1/sessions/{SESSION}/turns/turn-a?wait=1.5"))
        .await;
    let waited = started.elapsed();
    assert_eq!(poll.status, 200, "{poll}");
    assert_eq!(poll.body["status"], "inflight");
    assert!(poll.body["error"].is_null() && poll.body["outputs"].is_null());
    assert!(
        waited >= Duration::from_millis(1400) && waited < Duration::from_secs(10),
        "{waited:?}"
    );

    // Another turn or a command while this one is active: 409.
    let busy = bb.turn(SESSION, &user_turn("turn-b", "x")).await;
    assert_eq!(busy.status, 409, "{busy}");
    assert_eq!(busy.body["details"]["active_turn_id"], "turn-a");
    let cmd = bb.execute_cmd(SESSION, &json!({"cmd": "true"})).await;
    assert_eq!(cmd.status, 409, "{cmd}");
    assert_eq!(cmd.body["details"]["active_turn_id"], "turn-a");

    // Cancel: requested, then cancelled with the 499 a sync caller would get.
    let cancel = bb
        .post_empty(&format!("/v1/sessions/{SESSION}/turns/turn-a/cancel"))
        .await;
    assert_eq!(cancel.status, 200, "{cancel}");
    assert_eq!(cancel.body["status"], "cancel_requested");
    let ended = bb.poll_turn(SESSION, "turn-a", 5, settled).await;
    assert_eq!(ended["status"], "cancelled", "{ended}");
    assert_eq!(ended["error"]["http_status"], 499);
    let again = bb
        .post_empty(&format!("/v1/sessions/{SESSION}/turns/turn-a/cancel"))
        .await;
    assert_eq!(again.body["status"], "cancelled");

    // The session still takes turns.
    let next = json!({"turn_id": "turn-c", "mode": "async", "messages": user("go on")});
    let r = bb.turn(SESSION, &next).await;
    assert_eq!(r.status, 202, "{r}");
    let done = bb.poll_turn(SESSION, "turn-c", 5, settled).await;
    assert_eq!(done["status"], "committed", "{done}\n{}", diag(&bb, &fake));
    assert_eq!(last_text(&done["outputs"]), "second turn done");
    assert_eq!(done["backend"]["type"], "opencode");
    let limit = bb.turn(SESSION, &user_turn("turn-d", "more")).await;
    assert_eq!(limit.status, 429, "{limit}");
    assert_eq!(limit.body["error"], "too_many_requests");
    assert_eq!(limit.body["details"]["max_turns"], 1);
    let missing = bb
        .get(&format!("/v1/sessions/{SESSION}/turns/turn-zzz"))
        .await;
    assert_eq!(missing.status_and_error(), (404, Some("not_found")));
}

#[tokio::test]
async fn execute_cmd_runs_commands_with_a_timeout() {
    let (_fake, bb, _) = setup(&json!({}), &[], &json!({})).await;
    let r = bb
        .execute_cmd(SESSION, &json!({"cmd": "echo out; echo err >&2; exit 7"}))
        .await;
    assert_eq!(r.status, 200, "{r}");
    assert_eq!(r.body["stdout"], "out\n");
    assert_eq!(r.body["stderr"], "err\n");
    assert_eq!(r.body["returncode"], 7);
    assert_eq!(r.body["timed_out"], false);
    assert_eq!(r.body["instance_id"], "inst-001");
    assert!(r.body["duration_seconds"].as_f64().unwrap() >= 0.0);

    let marker = &format!("sleep 4242.{}", std::process::id());
    let started = Instant::now();
    let r = bb
        .execute_cmd(
            SESSION,
            &json!({"cmd": format!("{marker} & {marker}"), "timeout": 1}),
        )
        .await;
    assert_eq!(r.status, 200, "{r}");
    assert_eq!(r.body["timed_out"], true);
    assert!(started.elapsed() < Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        processes_with(marker).is_empty(),
        "the command's group survived its timeout"
    );

    for (body, status) in [
        (json!({"cmd": "  "}), 400),
        (json!({"cmd": "echo a\necho b"}), 400),
        (json!({"cmd": "true", "timeout": 0}), 400),
        (json!({"timeout": 3}), 400),
    ] {
        let r = bb.execute_cmd(SESSION, &body).await;
        assert_eq!(r.status, status, "{body}: {r}");
        assert_eq!(r.body["error"], "request_error", "{r}");
    }
    let other = bb.execute_cmd("sess-999", &json!({"cmd": "true"})).await;
    assert_eq!(
        other.status_and_error(),
        (409, Some("bound_session_mismatch"))
    );
}

#[tokio::test]
async fn abort_stops_the_turn_and_its_tool_processes() {
    let marker = &format!("sleep 3141.{}", std::process::id());
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [
            {"match": {"has_tools": true},
             "tool_calls": [{"id": "call_bb_sleep", "name": "bash",
                             "input": {"command": marker, "description": "wait"}}]},
        ],
        "fallback": {"text": "done"}
    });
    let (fake, bb, reg) = setup(&script, &[], &json!({})).await;
    let submit = json!({"turn_id": "turn-s", "mode": "async", "messages": user("wait")});
    assert_eq!(bb.turn(SESSION, &submit).await.status, 202);
    bb.wait_for("the tool never ran", &fake, Duration::from_secs(60), || {
        !processes_with(marker).is_empty()
    })
    .await;
    let abort = bb
        .post_empty(&format!("/v1/sessions/{SESSION}/abort"))
        .await;
    assert_eq!(abort.status, 200, "{abort}");
    assert_eq!(
        (abort.body["state"].as_str(), abort.body["mode"].as_str()),
        (Some("aborted"), Some("best_effort"))
    );
    let turn = bb
        .get(&format!("/v1/sessions/{SESSION}/turns/turn-s"))
        .await;
    assert_eq!(turn.body["status"], "unknown", "{turn}");
    assert_eq!(turn.body["error"]["error"], "aborted");
    assert_eq!(turn.body["error"]["http_status"], 409);
    bb.wait_for(
        "the agent's tool survived the abort",
        &fake,
        Duration::from_secs(10),
        || processes_with(marker).is_empty(),
    )
    .await;
    let again = bb
        .post_empty(&format!("/v1/sessions/{SESSION}/abort"))
        .await;
    assert_eq!(again.body["mode"], "noop");
    let refused = bb.turn(SESSION, &user_turn("turn-t", "x")).await;
    assert_eq!(refused.status, 409, "{refused}");
    assert!(
        refused.body["message"]
            .as_str()
            .unwrap()
            .contains("aborted")
    );
    let cmd = bb.execute_cmd(SESSION, &json!({"cmd": "true"})).await;
    assert_eq!(cmd.status, 409, "{cmd}");
    drop(reg);
}

#[tokio::test]
async fn a_backend_timeout_is_unknown_desynced_and_504() {
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [{"match": {"has_tools": true}, "text": "too late", "delay_ms": 60_000}]
    });
    let (_fake, bb, _) = setup(
        &script,
        &[],
        &json!({"server_config": {"backend_timeout": 3}}),
    )
    .await;
    let started = Instant::now();
    let r = bb.turn(SESSION, &user_turn("turn-slow", "slow")).await;
    assert_eq!(r.status, 504, "{r}\n{}", bb.describe());
    assert_eq!(r.body["error"], "backend_timeout");
    assert_eq!(r.body["details"]["turn_id"], "turn-slow");
    assert!(started.elapsed() < Duration::from_secs(30));
    let s = bb
        .get(&format!("/v1/sessions/{SESSION}?include_turns=true"))
        .await;
    assert_eq!(s.body["state"], "desynced", "{s}");
    assert_eq!(s.body["turn_ledger"]["turn-slow"]["status"], "unknown");
    assert_eq!(
        s.body["turn_ledger"]["turn-slow"]["error"]["http_status"],
        504
    );
    // Replaying the same turn: the session is desynced, so 409 (the reference's order).
    let next = bb.turn(SESSION, &user_turn("turn-next", "retry")).await;
    assert_eq!(next.status, 409, "{next}");
    assert!(next.body["message"].as_str().unwrap().contains("desynced"));
    let cmd = bb.execute_cmd(SESSION, &json!({"cmd": "true"})).await;
    assert_eq!(cmd.status, 409, "{cmd}");
}

#[tokio::test]
async fn max_steps_ends_the_turn_with_429() {
    let work = scratch().unwrap();
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [
            {"match": {"has_tools": true},
             "tool_calls": [{"id": "call_bb_1", "name": "write",
                             "input": {"filePath": work.path().join("a.txt"), "content": "a"}}]},
        ],
        "fallback": {"tool_calls": [{"name": "write",
                                     "input": {"filePath": work.path().join("b.txt"), "content": "b"}}]}
    });
    let extra = json!({"backend_options": {
        "provider_id": "sglang", "provider_name": "Dressage Proxy",
        "provider_package": "@ai-sdk/openai-compatible",
        "model_id": "proxy-model", "model_name": "Dressage Proxy",
        "proxy": {"max_steps": 1}
    }});
    let (fake, bb, _) = setup(&script, &[], &extra).await;
    let r = bb.turn(SESSION, &user_turn("turn-m", "write twice")).await;
    assert_eq!(r.status, 429, "{r}\n{}", diag(&bb, &fake));
    assert_eq!(r.body["error"], "max_steps_exceeded");
    assert_eq!(r.body["details"]["max_steps"], 1);
    let s = bb.get(&format!("/v1/sessions/{SESSION}")).await;
    assert_eq!(s.body["state"], "desynced");
    // A known agent stop: the sandbox may still be harvested.
    let cmd = bb.execute_cmd(SESSION, &json!({"cmd": "echo ok"})).await;
    assert_eq!(
        (cmd.status, cmd.body["stdout"].as_str()),
        (200, Some("ok\n")),
        "{cmd}"
    );
}

#[tokio::test]
async fn a_killed_agent_desyncs_the_session_within_the_health_interval() {
    let (_fake, bb, reg) = setup(
        &json!({}),
        &[
            ("BBS_RUNTIME_HEALTH_CHECK_INTERVAL", "1"),
            ("BBS_RUNTIME_HEALTH_CHECK_RETRIES", "2"),
            ("BBS_RUNTIME_HEALTH_CHECK_RETRY_DELAY", "0.2"),
        ],
        &json!({}),
    )
    .await;
    let runtime_dir = reg["binding"]["runtime_dir"].as_str().unwrap();
    let pid = BlackboxProcess::opencode_pid(runtime_dir).unwrap();
    let killed = Instant::now();
    rustix::process::kill_process_group(
        rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    let status = loop {
        let s = bb.get("/v1/status").await;
        if s.body["status"] == "error" {
            break s;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "never noticed: {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Interval 1 s, plus two probes 0.2 s apart (each a refused connection).
    assert!(
        killed.elapsed() < Duration::from_secs(5),
        "{:?}",
        killed.elapsed()
    );
    assert_eq!(status.body["sessions"]["desynced_count"], 1, "{status}");
    let s = bb.get(&format!("/v1/sessions/{SESSION}")).await;
    assert_eq!(s.body["state"], "desynced");
    let turn = bb.turn(SESSION, &user_turn("t", "x")).await;
    assert_eq!(turn.status, 503, "{turn}");
}

#[tokio::test]
async fn pause_holds_a_model_call_until_resume_and_its_time_is_not_counted() {
    // Step 1 runs a 3 s tool; the rollout is paused meanwhile, so step 2 (the model call with
    // the tool's result) is held by the proxy until resume. The pause outlasts the turn's
    // 25 s backend_timeout, which must not count it.
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [
            {"match": {"has_tools": true},
             "tool_calls": [{"id": "call_bb_nap", "name": "bash",
                             "input": {"command": "sleep 3", "description": "nap"}}]},
            {"match": {"has_tools": true, "body_contains": "call_bb_nap"}, "text": "after the pause"}
        ]
    });
    let (fake, bb, _) = setup(
        &script,
        &[],
        &json!({"server_config": {"backend_timeout": 25}}),
    )
    .await;
    let submit = json!({"turn_id": "turn-p", "mode": "async", "messages": user("nap")});
    assert_eq!(bb.turn(SESSION, &submit).await.status, 202);
    bb.wait_for("no model call", &fake, Duration::from_secs(60), || {
        !fake.chat_requests().unwrap().is_empty()
    })
    .await;
    let p = bb
        .post("/v1/rollout/pause", &json!({"reason": "weight_update"}))
        .await;
    assert_eq!(p.status, 200, "{p}\n{}", diag(&bb, &fake));
    assert_eq!(p.body["quiesced"], true, "{p}");
    assert_eq!(p.body["reason"], "weight_update");
    let state = bb.get("/v1/rollout/pause_state").await;
    assert_eq!(state.body["paused"], true, "{state}");
    // The router was told too (fakellm logs the control call).
    assert!(
        fake.requests()
            .unwrap()
            .iter()
            .any(|r| r["path"].as_str().unwrap_or("").ends_with("/rollout/pause")),
        "{}",
        diag(&bb, &fake)
    );

    // Well past the tool's 3 s and the turn's 25 s budget: the second call is still held.
    tokio::time::sleep(Duration::from_secs(26)).await;
    assert_eq!(
        fake.chat_requests().unwrap().len(),
        1,
        "a model call went out while paused"
    );
    let held = bb
        .get(&format!("/v1/sessions/{SESSION}/turns/turn-p"))
        .await;
    assert_eq!(held.body["status"], "inflight", "{held}\n{}", bb.describe());
    // A new submission waits for the resume too.
    let bb_url = bb.base_url();
    let blocked = tokio::spawn(async move {
        reqwest::Client::new()
            .post(format!("{bb_url}/v1/sessions/{SESSION}/messages"))
            .json(&json!({"turn_id": "turn-q", "mode": "async", "messages": user("later")}))
            .send()
            .await
            .map(|r| r.status().as_u16())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !blocked.is_finished(),
        "a submission went through while paused"
    );

    let r = bb
        .post(
            "/v1/rollout/resume",
            &json!({"reason": "weight_update", "version": "v2"}),
        )
        .await;
    assert_eq!(r.status, 200, "{r}");
    assert_eq!(r.body["version"], "v2");
    let done = bb.poll_turn(SESSION, "turn-p", 5, settled).await;
    assert_eq!(done["status"], "committed", "{done}\n{}", diag(&bb, &fake));
    assert_eq!(last_text(&done["outputs"]), "after the pause");
    // turn-p is done, so turn-q was admitted (or refused as the other active turn, had it
    // been admitted first: it was not, it waited for the resume).
    let q = blocked.await.unwrap().unwrap();
    assert!(q == 202 || q == 409, "{q}");
    let state = bb.get("/v1/rollout/pause_state").await;
    assert_eq!(
        (
            state.body["paused"].as_bool(),
            state.body["version"].as_str()
        ),
        (Some(false), Some("v2")),
        "{state}"
    );
}

#[tokio::test]
async fn sigterm_stops_everything_within_the_shutdown_timeout() {
    let marker = &format!("sleep 2718.{}", std::process::id());
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [{"match": {"has_tools": true},
                   "tool_calls": [{"name": "bash", "input": {"command": marker, "description": "wait"}}]}],
        "fallback": {"text": "done"}
    });
    let (fake, mut bb, reg) = setup(&script, &[("BBS_SHUTDOWN_TIMEOUT", "10")], &json!({})).await;
    let runtime_dir = PathBuf::from(reg["binding"]["runtime_dir"].as_str().unwrap());
    let opencode = BlackboxProcess::opencode_pid(runtime_dir.to_str().unwrap()).unwrap();
    let submit = json!({"turn_id": "turn-k", "mode": "async", "messages": user("wait")});
    let r = bb.turn(SESSION, &submit).await;
    assert_eq!(r.status, 202);
    bb.wait_for("the tool never ran", &fake, Duration::from_secs(60), || {
        !processes_with(marker).is_empty()
    })
    .await;
    let took = bb.terminate(Duration::from_secs(15)).await;
    assert!(took < Duration::from_secs(12), "{took:?}");
    assert!(bb.stderr().contains("shut down"), "{}", bb.describe());
    let left = wait_group_gone(opencode, Duration::from_secs(2));
    assert!(left.is_empty(), "opencode survived: {left:?}");
    assert!(
        processes_with(marker).is_empty(),
        "the agent's tool survived SIGTERM"
    );
    assert!(!runtime_dir.exists(), "runtime dir left behind");
}

/// A process that leaves every tree the server knows (a command's background job in a
/// session of its own, its shell gone) is adopted by the server and dies with it. Without
/// the adoption it is init's child and survives the stop.
#[tokio::test]
async fn a_process_that_escapes_into_its_own_session_dies_with_the_server() {
    let marker = &format!("sleep 1618.{}", std::process::id());
    let (_fake, mut bb, _) = setup(&json!({}), &[], &json!({})).await;
    let r = bb
        .execute_cmd(
            SESSION,
            &json!({"cmd": format!("setsid {marker} </dev/null >/dev/null 2>&1 &")}),
        )
        .await;
    assert_eq!(r.status, 200, "{r}");
    assert_eq!(r.body["returncode"], 0, "{r}");
    // The job may still be between fork and exec when the shell has exited: while the kernel
    // swaps its image its command line reads empty, so it is looked for until it shows.
    let seen = Instant::now() + Duration::from_secs(10);
    while processes_with(marker).len() != 1 && Instant::now() < seen {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let escaped = processes_with(marker);
    assert_eq!(escaped.len(), 1, "the background job is not running");
    let took = bb.terminate(Duration::from_secs(15)).await;
    assert!(took < Duration::from_secs(12), "{took:?}");
    // A SIGKILLed process takes a moment to die on a loaded machine; the job sleeps far longer.
    let grace = Instant::now() + Duration::from_secs(2);
    while !processes_with(marker).is_empty() && Instant::now() < grace {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let left = processes_with(marker);
    for pid in &left {
        // Not to leak it into the rest of the run.
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(i32::try_from(*pid).unwrap()).unwrap(),
            rustix::process::Signal::KILL,
        );
    }
    assert!(
        left.is_empty(),
        "the escaped process survived SIGTERM: {left:?}"
    );
}
