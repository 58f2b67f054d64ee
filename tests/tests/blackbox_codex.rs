//! blackbox-server's codex backend end to end, what only Codex has: the server as a process,
//! the real Codex (`codex exec --json`, one process per turn) behind it, fakellm (chat
//! completions) as the router; the in-process proxy translates Codex's Responses calls to chat
//! and back, streamed. Its isolated `config.toml` at the proxy's Responses endpoint, the
//! proxy's counts of a turn, the second turn resuming the thread with the first one's history,
//! `CODEX_BIN` missing, and a bad `sandbox_mode`. What every backend does (headers, replay,
//! cancel, abort, kill, max_steps, SIGTERM, bad agents) is in `blackbox_conformance.rs`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};

use agentbox_tests::harness::{
    BlackboxProcess, FakeLlm, codex_options, live_group_members, registration, scratch, user,
};
use serde_json::{Value, json};

const SESSION: &str = "sess-codex";

fn fakellm_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fakellm"))
}

/// The paddock's codex registration (its defaults) for `router`, `extra_options` merged over
/// the backend options.
fn codex_registration(router: &str, extra_options: &Value) -> Value {
    let mut options = codex_options();
    if let (Some(o), Some(extra)) = (options.as_object_mut(), extra_options.as_object()) {
        for (k, v) in extra {
            o.insert(k.clone(), v.clone());
        }
    }
    registration("codex", options, router, SESSION, &json!({}))
}

async fn setup(script: &Value) -> (FakeLlm, BlackboxProcess, Value) {
    let fake = FakeLlm::start(fakellm_bin(), script).unwrap();
    let bb = BlackboxProcess::start(&[]).unwrap();
    let r = bb
        .post(
            "/v1/rollout/register",
            &codex_registration(&fake.base_url(), &json!({})),
        )
        .await;
    assert_eq!(r.status, 200, "{r}\n{}", bb.describe());
    (fake, bb, r.body)
}

fn diag(bb: &BlackboxProcess, fake: &FakeLlm, runtime_dir: &str) -> String {
    let read = |name: &str| {
        std::fs::read_to_string(PathBuf::from(runtime_dir).join("logs").join(name))
            .unwrap_or_default()
    };
    format!(
        "{}\n--- codex stdout ---\n{}\n--- codex stderr ---\n{}",
        bb.diag(fake),
        read("codex.stdout.log"),
        read("codex.stderr.log")
    )
}

/// Codex 0.169's shell tool: `exec_command` with one `cmd` string.
fn shell_call(id: &str, cmd: &str) -> Value {
    json!({"id": id, "name": "exec_command", "input": {"cmd": cmd}})
}

#[tokio::test]
async fn config_counts_and_the_resumed_thread() {
    let work = scratch().unwrap();
    let target = work.path().join("hello.txt");
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [
            {"match": {"has_tools": true, "body_contains": "Create hello"},
             "tool_calls": [shell_call(
                 "call_cx_write",
                 &format!("printf 'hello from codex\\n' > {}", target.display()),
             )],
             "usage": {"input_tokens": 100, "output_tokens": 20}},
            {"match": {"has_tools": true, "body_contains": "call_cx_write"},
             "text": "file written",
             "usage": {"input_tokens": 130, "output_tokens": 2}},
            {"match": {"has_tools": true, "body_contains": "Append a line"},
             "text": "second turn done"}
        ]
    });
    let (fake, bb, reg) = setup(&script).await;
    let rt = reg["binding"]["runtime_dir"].as_str().unwrap().to_owned();
    assert_eq!(reg["capabilities"]["system_message"], true);
    assert_eq!(reg["capabilities"]["multi_message_input"], false);
    // The isolated Codex home: a config whose provider is the proxy's Responses endpoint.
    let config = std::fs::read_to_string(PathBuf::from(&rt).join("home/.codex/config.toml"))
        .expect("config.toml");
    let port = std::fs::read_to_string(PathBuf::from(&rt).join("run/proxy.port")).unwrap();
    assert!(
        config.contains(&format!(
            "base_url = \"http://127.0.0.1:{}/v1\"",
            port.trim()
        )),
        "{config}"
    );
    assert!(config.contains("wire_api = \"responses\""), "{config}");

    let path = format!("/v1/sessions/{SESSION}/messages");
    let turn1 = json!({"turn_id": "turn-1", "messages": user("Create hello.txt"), "metadata": {}});
    let r = bb.post(&path, &turn1).await;
    assert_eq!(r.status, 200, "{r}\n{}", diag(&bb, &fake, &rt));
    let body = &r.body;
    let thread = body["backend"]["backend_session_id"]
        .as_str()
        .expect("a thread id")
        .to_owned();
    assert!(!thread.is_empty());
    // The proxy's counts: two model calls, one tool call, the scripted tokens.
    assert_eq!(body["usage"]["steps"], 2, "{body}");
    assert_eq!(body["usage"]["tool_calls"], 1, "{body}");
    assert_eq!(body["usage"]["input_tokens"], 230, "{body}");
    assert_eq!(body["usage"]["output_tokens"], 22, "{body}");
    for req in fake.chat_requests().unwrap() {
        assert_eq!(req["body"]["model"], "proxy-model", "{req}");
    }
    // Codex ran for the turn and is gone.
    let pid: u32 = std::fs::read_to_string(PathBuf::from(&rt).join("run/codex.pid"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(live_group_members(pid).is_empty());

    // Second turn: `codex exec resume <thread>`, so the model sees the first turn's history.
    let turn2 = json!({"turn_id": "turn-2", "messages": user("Append a line"), "metadata": {}});
    let r2 = bb.post(&path, &turn2).await;
    assert_eq!(r2.status, 200, "{r2}\n{}", diag(&bb, &fake, &rt));
    assert_eq!(r2.body["backend"]["backend_session_id"], thread.as_str());
    let second: Vec<Value> = fake
        .chat_requests()
        .unwrap()
        .into_iter()
        .filter(|r| r["headers"]["x-turn-id"] == "turn-2")
        .collect();
    assert!(!second.is_empty(), "{}", diag(&bb, &fake, &rt));
    let first_body = second[0]["body"].to_string();
    assert!(
        first_body.contains("Create hello.txt") && first_body.contains("file written"),
        "turn 2 did not resume the thread: {first_body}"
    );
    let session = bb.get(&format!("/v1/sessions/{SESSION}")).await;
    assert_eq!(session.body["backend_session_id"], thread.as_str());
}

#[tokio::test]
async fn codex_bin_missing_is_a_register_error_and_bad_options_are_refused() {
    let fake = FakeLlm::start(fakellm_bin(), &json!({})).unwrap();
    let bb = BlackboxProcess::start(&[("CODEX_BIN", "/nonexistent/codex")]).unwrap();
    let r = bb
        .post(
            "/v1/rollout/register",
            &codex_registration(&fake.base_url(), &json!({})),
        )
        .await;
    assert!(r.status >= 400, "{r}");
    assert!(r.body.to_string().contains("codex binary not found"), "{r}");
    let bad = bb
        .post(
            "/v1/rollout/register",
            &codex_registration(&fake.base_url(), &json!({"sandbox_mode": "yolo"})),
        )
        .await;
    assert!(bad.status == 400 || bad.status == 409, "{bad}");
}
