//! The blackbox-server conformance suite: one list of scenarios, run against every backend
//! with the real agent CLI behind the server and fakellm (chat completions: the proxy turns
//! every backend's calls into chat) as the router. A backend is one [`Row`] (how to register
//! it, the names and argument shapes of its file-writing and shell tools, its pid file) and
//! one `conformance!` line; the scenarios do not know which agent they drive.
//!
//! Scenarios: register; a two-turn conversation whose first turn edits a file through a
//! scripted tool call, with the rollout headers on every model call and an idempotent retry
//! that reaches no model; cancel in flight; abort; the agent killed (the session desyncs);
//! max_steps (429); SIGTERM of the server leaving no process of the backend behind.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentbox_tests::harness::{
    BlackboxProcess, FakeLlm, opencode_options, processes_with, registration, scratch, settled,
    two_turn_write_script, user, wait_group_gone,
};
use serde_json::{Value, json};

const SESSION: &str = "sess-001";

fn fakellm_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fakellm"))
}

/// One backend, as the scenarios see it.
struct Row {
    /// `blackbox_type`.
    kind: &'static str,
    /// Its `backend_options` with `proxy` set to the given proxy options.
    options: fn(proxy: &Value) -> Value,
    /// Its file-writing tool call: name and arguments for (path, content).
    write: fn(&Path, &str) -> (&'static str, Value),
    /// Its shell tool call: name and arguments for a command.
    bash: fn(&str) -> (&'static str, Value),
    /// The file under `<runtime_dir>/run` holding the agent's pid (while it runs).
    pid_file: &'static str,
    /// Whether the turn's outputs list its tool calls and results as messages (codex, as the
    /// reference maps it, returns only the assistant's text; its tool items are trace events).
    tool_messages: bool,
    /// How the agent talks to us, for a stand-in that misbehaves.
    shape: Shape,
}

/// How an agent CLI talks to the server.
#[derive(Clone, Copy)]
enum Shape {
    /// One process per turn printing JSON lines (Claude Code, Codex).
    Stream,
    /// A long-running HTTP server (opencode, OpenClaw).
    Server,
}

fn with_proxy(mut options: Value, proxy: &Value) -> Value {
    if !proxy.is_null() {
        options["proxy"] = proxy.clone();
    }
    options
}

const OPENCODE: Row = Row {
    kind: "opencode",
    options: |proxy| with_proxy(opencode_options(), proxy),
    write: |path, content| ("write", json!({"filePath": path, "content": content})),
    bash: |cmd| ("bash", json!({"command": cmd, "description": "wait"})),
    pid_file: "opencode.pid",
    tool_messages: true,
    shape: Shape::Server,
};

const CLAUDE_CODE: Row = Row {
    kind: "claude_code",
    options: |proxy| with_proxy(json!({}), proxy),
    write: |path, content| ("Write", json!({"file_path": path, "content": content})),
    bash: |cmd| ("Bash", json!({"command": cmd, "description": "wait"})),
    pid_file: "claude_code.pid",
    tool_messages: true,
    shape: Shape::Stream,
};

/// Codex 0.169 has no file-writing tool: its shell tool (`exec_command`, one `cmd` string)
/// writes the file.
const CODEX: Row = Row {
    kind: "codex",
    options: |proxy| with_proxy(json!({}), proxy),
    write: |path, content| {
        let cmd = format!("printf '%s' '{content}' > '{}'", path.display());
        ("exec_command", json!({"cmd": cmd}))
    },
    bash: |cmd| ("exec_command", json!({"cmd": cmd})),
    pid_file: "codex.pid",
    tool_messages: false,
    shape: Shape::Stream,
};

/// OpenClaw answers the turn's request with the final message only (its tool calls stay in the
/// gateway); its shell tool is `exec`.
const OPENCLAW: Row = Row {
    kind: "openclaw",
    options: |proxy| with_proxy(json!({}), proxy),
    write: |path, content| ("write", json!({"path": path, "content": content})),
    bash: |cmd| ("exec", json!({"command": cmd})),
    pid_file: "openclaw.pid",
    tool_messages: false,
    shape: Shape::Server,
};

/// fakellm with `script`, and a blackbox-server (with `env`) registered for `row`.
async fn setup(
    row: &Row,
    script: &Value,
    env: &[(&str, &str)],
    proxy: &Value,
) -> (FakeLlm, BlackboxProcess, Value) {
    let fake = FakeLlm::start(fakellm_bin(), script).unwrap();
    let bb = BlackboxProcess::start(env).unwrap();
    let reg = registration(
        row.kind,
        (row.options)(proxy),
        &fake.base_url(),
        SESSION,
        &json!({}),
    );
    let r = bb.post("/v1/rollout/register", &reg).await;
    assert_eq!(r.status, 200, "{r}\n{}", bb.describe());
    (fake, bb, r.body)
}

/// A script whose only tool-using step runs `call` (then answers "done" forever).
fn one_call_script(call_id: &str, (name, input): (&str, Value)) -> Value {
    json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [{"match": {"has_tools": true},
                   "tool_calls": [{"id": call_id, "name": name, "input": input}]}],
        "fallback": {"text": "done"}
    })
}

/// Waits until `cond` holds (polling), or panics with `what` and the diagnostics.
async fn wait_for(what: &str, bb: &BlackboxProcess, fake: &FakeLlm, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(90);
    while !cond() {
        assert!(Instant::now() < deadline, "{what}\n{}", bb.diag(fake));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A shell command that blocks for long and is unique to this test and row (found by its
/// command line). Not a bare `sleep`: Claude Code refuses long foreground sleeps.
fn blocking_marker(tag: u32, row: &Row) -> String {
    format!(
        "timeout {tag}.{}{} tail -f /dev/null",
        std::process::id(),
        row.kind.len()
    )
}

fn runtime_dir(reg: &Value) -> String {
    reg["binding"]["runtime_dir"].as_str().unwrap().to_owned()
}

async fn register(row: &Row) {
    let (_fake, bb, reg) = setup(row, &json!({}), &[], &Value::Null).await;
    assert_eq!(reg["status"], "ready", "{reg}");
    assert_eq!(reg["binding"]["bound_session_id"], SESSION);
    assert_eq!(reg["binding"]["blackbox_type"], row.kind, "{reg}");
    assert_eq!(reg["capabilities"]["chat"], true);
    let status = bb.get("/v1/status").await;
    assert_eq!(status.body["status"], "ready");
    let implemented = status.body["implemented_backends"].as_array().unwrap();
    assert!(implemented.iter().any(|b| b == row.kind), "{status}");
}

async fn two_turns_edit_a_file_carry_the_headers_and_replay(row: &Row) {
    let work = scratch().unwrap();
    let target = work.path().join("hello.txt");
    let content = "hello from the blackbox\n";
    let (name, input) = (row.write)(&target, content);
    // Letters and digits only: OpenClaw rewrites other ids in the history it sends back.
    let call = "callconfwrite1";
    let script = two_turn_write_script("title", call, name, &input);
    let (fake, bb, _) = setup(row, &script, &[], &Value::Null).await;
    let path = format!("/v1/sessions/{SESSION}/messages");
    let turn = json!({"turn_id": "turn-1", "messages": user("Create hello.txt"), "metadata": {}});
    let r = bb.post(&path, &turn).await;
    assert_eq!(r.status, 200, "{r}\n{}", bb.diag(&fake));
    assert_eq!(std::fs::read_to_string(&target).unwrap(), content);
    let body = &r.body;
    assert_eq!(body["backend"]["type"], row.kind);
    let agent_session = body["backend"]["backend_session_id"].clone();
    assert!(agent_session.is_string(), "{body}");
    let outputs = body["outputs"].as_array().unwrap();
    if row.tool_messages {
        let tool_call = outputs
            .iter()
            .find_map(|m| m["tool_calls"].as_array().and_then(|c| c.first()))
            .unwrap_or_else(|| panic!("no tool call in {body}"));
        assert_eq!(tool_call["id"], call);
        assert_eq!(tool_call["function"]["name"], name);
        assert!(
            outputs
                .iter()
                .any(|m| m["role"] == "tool" && m["tool_call_id"] == call),
            "{body}"
        );
    } else {
        // The proxy counted the model's tool call.
        assert_eq!(body["usage"]["tool_calls"], 1, "{body}");
    }
    assert_eq!(outputs.last().unwrap()["content"], "done", "{body}");
    // The proxy's counts: two model calls with tools in this turn.
    assert_eq!(body["usage"]["steps"], 2, "{body}");

    // Every proxied model call carries the rollout headers, whatever the agent's protocol.
    let requests = fake.chat_requests().unwrap();
    assert!(requests.len() >= 2, "{}", bb.diag(&fake));
    for req in &requests {
        let h = &req["headers"];
        assert_eq!(h["x-session-id"], SESSION, "{req}");
        assert_eq!(h["x-instance-id"], "inst-001", "{req}");
        assert_eq!(h["x-turn-id"], "turn-1", "{req}");
        assert_eq!(h["x-smg-routing-key"], SESSION, "{req}");
        assert_eq!(h["x-dressage-partial-rollout"], "1", "{req}");
    }

    // The same turn again: the committed result, and no new model call.
    let seen = fake.requests().unwrap().len();
    let replay = bb.post(&path, &turn).await;
    assert_eq!(replay.status, 200, "{replay}");
    assert_eq!(replay.body["idempotent_replay"], true);
    assert_eq!(replay.body["outputs"], body["outputs"]);
    assert_eq!(
        fake.requests().unwrap().len(),
        seen,
        "the replay reached the model"
    );

    // The second turn continues the agent's session.
    let second = json!({"turn_id": "turn-2", "messages": user("second question")});
    let r2 = bb.post(&path, &second).await;
    assert_eq!(r2.status, 200, "{r2}\n{}", bb.diag(&fake));
    assert_eq!(
        r2.body["outputs"].as_array().unwrap().last().unwrap()["content"],
        "second turn done"
    );
    assert_eq!(r2.body["backend"]["backend_session_id"], agent_session);
    let last = fake.chat_requests().unwrap();
    let last = last.last().unwrap();
    assert_eq!(last["headers"]["x-turn-id"], "turn-2");
    // The agent sent its history: the first turn's tool call is in the second turn's call.
    assert!(last.to_string().contains(call), "{last}");
    let s = bb.get(&format!("/v1/sessions/{SESSION}")).await;
    assert_eq!(s.body["turn_count"], 2, "{s}");
}

/// A turn cancelled while its agent waits for a model call, after it ran a tool: it ends
/// cancelled, and the next turn's outputs are its own, not the cancelled turn's tool call and
/// result that stay in a long-running agent's history.
async fn cancel_in_flight(row: &Row) {
    let (name, input) = (row.bash)("echo first");
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [
            {"match": {"has_tools": true}, "tool_calls": [{"id": "callconfearly", "name": name, "input": input}]},
            {"match": {"has_tools": true}, "text": "late", "delay_ms": 60_000},
            {"match": {"has_tools": true}, "text": "after the cancel"}
        ]
    });
    let (fake, bb, _) = setup(row, &script, &[], &Value::Null).await;
    let path = format!("/v1/sessions/{SESSION}/messages");
    let submit = json!({"turn_id": "turn-a", "mode": "async", "messages": user("run it")});
    assert_eq!(bb.post(&path, &submit).await.status, 202);
    wait_for("the second model call never came", &bb, &fake, || {
        fake.chat_requests()
            .unwrap()
            .iter()
            .filter(|r| r["body"]["tools"].is_array())
            .count()
            >= 2
    })
    .await;
    let cancel = bb
        .post_empty(&format!("/v1/sessions/{SESSION}/turns/turn-a/cancel"))
        .await;
    assert_eq!(cancel.status, 200, "{cancel}");
    let ended = bb.poll_turn(SESSION, "turn-a", 5, settled).await;
    assert_eq!(ended["status"], "cancelled", "{ended}");
    assert_eq!(ended["error"]["http_status"], 499);
    let next = json!({"turn_id": "turn-b", "messages": user("go on")});
    let r = bb.post(&path, &next).await;
    assert_eq!(r.status, 200, "{r}\n{}", bb.diag(&fake));
    let outputs = r.body["outputs"].as_array().unwrap();
    assert!(
        !r.body["outputs"].to_string().contains("callconfearly"),
        "the cancelled turn's tool call is in the next turn's outputs: {r}"
    );
    assert_eq!(
        outputs.last().unwrap()["content"],
        "after the cancel",
        "{r}"
    );
}

async fn abort_stops_the_turn_and_its_tools(row: &Row) {
    let marker = blocking_marker(3141, row);
    let (fake, bb, reg) = setup(
        row,
        &one_call_script("call_conf_sleep", (row.bash)(&marker)),
        &[],
        &Value::Null,
    )
    .await;
    let submit = json!({"turn_id": "turn-s", "mode": "async", "messages": user("wait")});
    let path = format!("/v1/sessions/{SESSION}/messages");
    assert_eq!(bb.post(&path, &submit).await.status, 202);
    wait_for("the tool never ran", &bb, &fake, || {
        !processes_with(&marker).is_empty()
    })
    .await;
    let agent = BlackboxProcess::agent_pid(&runtime_dir(&reg), row.pid_file).expect("agent pid");
    let abort = bb
        .post_empty(&format!("/v1/sessions/{SESSION}/abort"))
        .await;
    assert_eq!(abort.status, 200, "{abort}");
    assert_eq!(abort.body["state"], "aborted");
    let turn = bb
        .get(&format!("/v1/sessions/{SESSION}/turns/turn-s"))
        .await;
    assert_eq!(turn.body["status"], "unknown", "{turn}");
    assert_eq!(turn.body["error"]["error"], "aborted");
    let deadline = Instant::now() + Duration::from_secs(10);
    while !processes_with(&marker).is_empty() {
        assert!(
            Instant::now() < deadline,
            "the agent's tool survived the abort"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    if matches!(row.shape, Shape::Stream) {
        // One process per turn: the turn's agent process goes with the abort.
        let left = wait_group_gone(agent, Duration::from_secs(10));
        assert!(left.is_empty(), "{} survived the abort: {left:?}", row.kind);
    }
}

async fn a_killed_agent_desyncs_the_session(row: &Row) {
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [{"match": {"has_tools": true}, "text": "late", "delay_ms": 60_000}]
    });
    let (fake, bb, reg) = setup(
        row,
        &script,
        &[
            ("BBS_RUNTIME_HEALTH_CHECK_INTERVAL", "1"),
            ("BBS_RUNTIME_HEALTH_CHECK_RETRIES", "2"),
            ("BBS_RUNTIME_HEALTH_CHECK_RETRY_DELAY", "0.2"),
        ],
        &Value::Null,
    )
    .await;
    let dir = runtime_dir(&reg);
    let path = format!("/v1/sessions/{SESSION}/messages");
    let submit = json!({"turn_id": "turn-k", "mode": "async", "messages": user("slow")});
    assert_eq!(bb.post(&path, &submit).await.status, 202);
    wait_for("the model call never came", &bb, &fake, || {
        !fake.chat_requests().unwrap().is_empty()
    })
    .await;
    let pid = BlackboxProcess::agent_pid(&dir, row.pid_file).expect("agent pid file");
    let killed = Instant::now();
    rustix::process::kill_process_group(
        rustix::process::Pid::from_raw(i32::try_from(pid).unwrap()).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    loop {
        let s = bb.get(&format!("/v1/sessions/{SESSION}")).await;
        if s.body["state"] == "desynced" {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(10),
            "never noticed: {s}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let turn = bb.poll_turn(SESSION, "turn-k", 5, settled).await;
    assert_ne!(turn["status"], "committed", "{turn}");
    let again = bb
        .post(&path, &json!({"turn_id": "t", "messages": user("x")}))
        .await;
    // Refused: 409 when the failed turn desynced the session, 503 when the health monitor
    // got there first and put the server in error.
    assert!(matches!(again.status, 409 | 503), "{again}");
    let want = if again.status == 409 {
        "desynced"
    } else {
        "error"
    };
    assert_eq!(
        again.body["details"]["state"].as_str().unwrap_or(want),
        want,
        "{again}"
    );
}

async fn max_steps_is_429(row: &Row) {
    let work = scratch().unwrap();
    let (name, input) = (row.write)(&work.path().join("a.txt"), "a");
    let (_, again) = (row.write)(&work.path().join("b.txt"), "b");
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "title"}],
        "steps": [{"match": {"has_tools": true},
                   "tool_calls": [{"id": "call_conf_1", "name": name, "input": input}]}],
        "fallback": {"tool_calls": [{"name": name, "input": again}]}
    });
    let (fake, bb, _) = setup(row, &script, &[], &json!({"max_steps": 1})).await;
    let r = bb
        .post(
            &format!("/v1/sessions/{SESSION}/messages"),
            &json!({"turn_id": "turn-m", "messages": user("write twice")}),
        )
        .await;
    assert_eq!(r.status, 429, "{r}\n{}", bb.diag(&fake));
    assert_eq!(r.body["error"], "max_steps_exceeded");
    assert_eq!(r.body["details"]["max_steps"], 1);
    let s = bb.get(&format!("/v1/sessions/{SESSION}")).await;
    assert_eq!(s.body["state"], "desynced");
}

async fn sigterm_leaves_no_process_behind(row: &Row) {
    let marker = blocking_marker(2718, row);
    let (fake, mut bb, reg) = setup(
        row,
        &one_call_script("call_conf_term", (row.bash)(&marker)),
        &[("BBS_SHUTDOWN_TIMEOUT", "10")],
        &Value::Null,
    )
    .await;
    let dir = PathBuf::from(runtime_dir(&reg));
    let submit = json!({"turn_id": "turn-t", "mode": "async", "messages": user("wait")});
    let r = bb
        .post(&format!("/v1/sessions/{SESSION}/messages"), &submit)
        .await;
    assert_eq!(r.status, 202);
    wait_for("the tool never ran", &bb, &fake, || {
        !processes_with(&marker).is_empty()
    })
    .await;
    let agent =
        BlackboxProcess::agent_pid(dir.to_str().unwrap(), row.pid_file).expect("agent pid file");
    let pid = rustix::process::Pid::from_raw(i32::try_from(bb.pid()).unwrap()).unwrap();
    let sent = Instant::now();
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).unwrap();
    while bb.is_running() {
        assert!(
            sent.elapsed() < Duration::from_secs(15),
            "still running\n{}",
            bb.describe()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let left = wait_group_gone(agent, Duration::from_secs(2));
    assert!(left.is_empty(), "{} survived: {left:?}", row.kind);
    // A SIGKILLed process takes a moment to finish dying on a loaded machine; the tool blocks
    // far longer than this on its own, so its going within the grace is the server's kill.
    let grace = Instant::now() + Duration::from_secs(2);
    while !processes_with(&marker).is_empty() && Instant::now() < grace {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        processes_with(&marker).is_empty(),
        "the agent's tool survived SIGTERM"
    );
    assert!(!dir.exists(), "runtime dir left behind");
}

/// A stand-in for the row's CLI (the real ones cannot be made to misbehave on cue), written to
/// `dir`: it speaks the row's protocol until the turn, then prints garbage (`garbage`) or dies
/// with code 3 after a line on stderr.
fn misbehaving_cli(row: &Row, dir: &Path, garbage: bool) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join(format!("fake-{}", row.kind));
    let script = match row.shape {
        Shape::Stream => {
            let turn = if garbage {
                format!("echo '{GARBAGE}{}'\nsleep 30", "x".repeat(3000))
            } else {
                "echo 'boom on stderr' >&2\nexit 3".to_owned()
            };
            // Claude Code reads its prompt on stdin; Codex's is /dev/null.
            format!("#!/bin/sh\ncat >/dev/null\necho '{{\"type\":\"system\"}}'\n{turn}\n")
        }
        Shape::Server => format!(
            r#"#!/usr/bin/env python3
# A stand-in agent server: healthy, one session, and a turn request it answers with garbage
# or by dying.
import http.server, json, os, sys
args = sys.argv[1:]
port = int(args[args.index("--port") + 1]) if "--port" in args else 0
GARBAGE = {garbage}
class H(http.server.BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass
    def answer(self, body, status=200):
        data = body.encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        if self.path == "/global/health":
            return self.answer(json.dumps({{"healthy": True}}))
        if self.path == "/v1/models":
            return self.answer(json.dumps({{"object": "list", "data": []}}))
        self.answer("{{}}")
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/session":
            return self.answer(json.dumps({{"id": "ses_fake"}}))
        if self.path in ("/session/ses_fake/message", "/v1/chat/completions"):
            if GARBAGE:
                return self.answer("{GARBAGE}" + "x" * 3000)
            sys.stderr.write("boom on stderr\n")
            sys.stderr.flush()
            os._exit(3)
        self.answer("{{}}")
server = http.server.ThreadingHTTPServer(("127.0.0.1", port), H)
print("listening on http://127.0.0.1:%d" % server.server_address[1], flush=True)
server.serve_forever()
"#,
            garbage = if garbage { "True" } else { "False" },
        ),
    };
    std::fs::write(&path, script).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// The processes whose command line has `needle`, once given 10 s to go.
async fn still_running(needle: &str) -> Vec<u32> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let left = processes_with(needle);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The start of the garbage a misbehaving CLI prints.
const GARBAGE: &str = "this is not json at all ";

/// A turn against the row's stand-in CLI: its failed answer, then whether anything of the
/// stand-in still runs once the server is gone.
async fn misbehaving_turn(row: &Row, garbage: bool) -> Value {
    let dir = scratch().unwrap();
    let bin = misbehaving_cli(row, dir.path(), garbage);
    let mut options = (row.options)(&Value::Null);
    options["executable"] = json!(bin);
    let fake = FakeLlm::start(fakellm_bin(), &json!({})).unwrap();
    let bb = BlackboxProcess::start(&[]).unwrap();
    let reg = registration(row.kind, options, &fake.base_url(), SESSION, &json!({}));
    let r = bb.post("/v1/rollout/register", &reg).await;
    assert_eq!(r.status, 200, "{r}\n{}", bb.describe());
    let t = bb
        .post(
            &format!("/v1/sessions/{SESSION}/messages"),
            &json!({"turn_id": "turn-x", "messages": user("hi")}),
        )
        .await;
    assert!(t.status >= 400, "{t}");
    let turn = bb
        .get(&format!("/v1/sessions/{SESSION}/turns/turn-x"))
        .await;
    assert!(
        matches!(turn.body["status"].as_str(), Some("failed" | "unknown")),
        "{turn}"
    );
    let needle = bin.to_str().unwrap();
    if matches!(row.shape, Shape::Stream) {
        // One process per turn: nothing of it may outlive the failed turn.
        let left = still_running(needle).await;
        assert!(
            left.is_empty(),
            "the agent outlived its failed turn: {left:?}"
        );
    }
    drop(bb);
    let left = still_running(needle).await;
    assert!(left.is_empty(), "the agent outlived the server: {left:?}");
    t.body
}

async fn garbage_output_fails_the_turn_quoting_the_line(row: &Row) {
    let body = misbehaving_turn(row, true).await;
    let msg = body["message"].as_str().unwrap_or_default();
    assert!(msg.contains(GARBAGE.trim()), "{body}");
    assert!(
        msg.contains("...(truncated)") && msg.len() < 2500,
        "not truncated: {body}"
    );
}

async fn a_non_zero_exit_mid_turn_fails_the_turn(row: &Row) {
    let body = misbehaving_turn(row, false).await;
    let msg = body["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("exited with code 3") && msg.contains("boom on stderr"),
        "{body}"
    );
}

/// The router preempts every generation (a weight update made the rollout stale): the turn is
/// not committed, whatever the agent made of the proxy's empty answer (Claude Code ended its
/// turn with it and exited 0), and the session is desynced, as the reference does.
async fn a_preempted_generation_is_never_committed(row: &Row) {
    let script = json!({"fallback": {"error": {"status": 502, "body":
        {"detail": {"error": "generation_preempted", "message": "stale weights"}}}}});
    let (fake, bb, _) = setup(row, &script, &[], &Value::Null).await;
    let r = bb
        .post(
            &format!("/v1/sessions/{SESSION}/messages"),
            &json!({"turn_id": "turn-p", "messages": user("write a file")}),
        )
        .await;
    assert_ne!(
        r.status,
        200,
        "a preempted turn was committed: {r}\n{}",
        bb.diag(&fake)
    );
    assert!(
        r.body["message"]
            .as_str()
            .is_some_and(|m| m.contains("generation_preempted")),
        "{r}"
    );
    let s = bb.get(&format!("/v1/sessions/{SESSION}")).await;
    assert_eq!(s.body["state"], "desynced", "{s}");
    assert_eq!(s.body["turn_count"], 0, "{s}");
}

async fn a_missing_binary_is_a_register_error_and_the_server_stays_usable(row: &Row) {
    let fake = FakeLlm::start(fakellm_bin(), &json!({})).unwrap();
    let bb = BlackboxProcess::start(&[]).unwrap();
    let mut options = (row.options)(&Value::Null);
    options["executable"] = json!(format!("/nonexistent/{}", row.kind));
    let bad = registration(row.kind, options, &fake.base_url(), SESSION, &json!({}));
    let r = bb.post("/v1/rollout/register", &bad).await;
    assert!(r.status >= 400, "{r}");
    let msg = r.body["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("binary not found") && msg.contains("/nonexistent/"),
        "{r}"
    );
    let good = registration(
        row.kind,
        (row.options)(&Value::Null),
        &fake.base_url(),
        SESSION,
        &json!({}),
    );
    let again = bb.post("/v1/rollout/register", &good).await;
    assert_eq!(again.status, 200, "{again}\n{}", bb.describe());
}

#[tokio::test]
async fn an_unknown_blackbox_type_is_400_naming_the_implemented_ones() {
    let fake = FakeLlm::start(fakellm_bin(), &json!({})).unwrap();
    let bb = BlackboxProcess::start(&[]).unwrap();
    let reg = registration("hermes", json!({}), &fake.base_url(), SESSION, &json!({}));
    let r = bb.post("/v1/rollout/register", &reg).await;
    assert_eq!(r.status, 400, "{r}");
    let msg = r.body["message"].as_str().unwrap_or_default();
    for kind in ["opencode", "openclaw", "claude_code", "codex"] {
        assert!(msg.contains(kind), "{kind} not named: {r}");
    }
    let status = bb.get("/v1/status").await;
    let implemented = status.body["implemented_backends"].as_array().unwrap();
    assert_eq!(implemented.len(), 4, "{status}");
}

/// Every scenario as a test, in a module named after the backend.
macro_rules! conformance {
    ($module:ident, $row:expr) => {
        mod $module {
            #[tokio::test]
            async fn register() {
                super::register(&$row).await;
            }
            #[tokio::test]
            async fn two_turns_edit_a_file_carry_the_headers_and_replay() {
                super::two_turns_edit_a_file_carry_the_headers_and_replay(&$row).await;
            }
            #[tokio::test]
            async fn cancel_in_flight() {
                super::cancel_in_flight(&$row).await;
            }
            #[tokio::test]
            async fn abort_stops_the_turn_and_its_tools() {
                super::abort_stops_the_turn_and_its_tools(&$row).await;
            }
            #[tokio::test]
            async fn a_killed_agent_desyncs_the_session() {
                super::a_killed_agent_desyncs_the_session(&$row).await;
            }
            #[tokio::test]
            async fn max_steps_is_429() {
                super::max_steps_is_429(&$row).await;
            }
            #[tokio::test]
            async fn sigterm_leaves_no_process_behind() {
                super::sigterm_leaves_no_process_behind(&$row).await;
            }
            #[tokio::test]
            async fn garbage_output_fails_the_turn_quoting_the_line() {
                super::garbage_output_fails_the_turn_quoting_the_line(&$row).await;
            }
            #[tokio::test]
            async fn a_non_zero_exit_mid_turn_fails_the_turn() {
                super::a_non_zero_exit_mid_turn_fails_the_turn(&$row).await;
            }
            #[tokio::test]
            async fn a_preempted_generation_is_never_committed() {
                super::a_preempted_generation_is_never_committed(&$row).await;
            }
            #[tokio::test]
            async fn a_missing_binary_is_a_register_error_and_the_server_stays_usable() {
                super::a_missing_binary_is_a_register_error_and_the_server_stays_usable(&$row)
                    .await;
            }
        }
    };
}

conformance!(opencode, super::OPENCODE);
conformance!(claude_code, super::CLAUDE_CODE);
conformance!(codex, super::CODEX);
conformance!(openclaw, super::OPENCLAW);

/// A tool that leaves a model call running when its agent ends the turn (a detached process
/// calling the proxy) keeps the turn waiting for that call's count, but a cancel still ends
/// the turn at once instead of waiting for the call, then committing it.
#[tokio::test]
async fn a_detached_model_call_does_not_hold_a_turn_past_its_cancel() {
    let work = scratch().unwrap();
    // The call's text ("long-call-7d1f") is in the script, never in the agent's own requests.
    let caller = work.path().join("caller.py");
    let cmd = format!(
        "setsid python3 {} </dev/null >/dev/null 2>&1 &",
        caller.display()
    );
    let (name, input) = (CLAUDE_CODE.bash)(&cmd);
    let script = json!({
        "rules": [
            {"match": {"body_contains": "long-call-7d1f"}, "text": "late", "delay_ms": 60_000},
            {"match": {"has_tools": false}, "text": "title"}
        ],
        "steps": [
            {"match": {"has_tools": true}, "tool_calls": [{"id": "calldetach", "name": name, "input": input}]},
            // Late enough for the detached call to be under way when the agent ends.
            {"match": {"has_tools": true}, "text": "done", "delay_ms": 5000}
        ]
    });
    let (fake, bb, reg) = setup(&CLAUDE_CODE, &script, &[], &Value::Null).await;
    let port = std::fs::read_to_string(format!("{}/run/proxy.port", runtime_dir(&reg))).unwrap();
    std::fs::write(
        &caller,
        format!(
            "import urllib.request as u\n\
             body = b'{{\"model\":\"m\",\"messages\":[{{\"role\":\"user\",\"content\":\"long-call-7d1f\"}}]}}'\n\
             u.urlopen(u.Request('http://127.0.0.1:{}/v1/chat/completions', data=body, \
             headers={{'content-type': 'application/json'}}), timeout=120).read()\n",
            port.trim()
        ),
    )
    .unwrap();
    let path = format!("/v1/sessions/{SESSION}/messages");
    let submit = json!({"turn_id": "turn-d", "mode": "async", "messages": user("start it")});
    assert_eq!(bb.post(&path, &submit).await.status, 202);
    let body_of = |r: &Value| r["body"].to_string();
    wait_for(
        "the agent never finished with the call running",
        &bb,
        &fake,
        || {
            let reqs = fake.chat_requests().unwrap();
            reqs.iter().any(|r| body_of(r).contains("long-call-7d1f"))
                && reqs
                    .iter()
                    .filter(|r| r["body"]["tools"].is_array())
                    .count()
                    >= 2
        },
    )
    .await;
    // Claude Code has exited (its command line names the runtime dir's settings): the turn
    // waits only for the detached call now.
    let runtime = runtime_dir(&reg);
    wait_for("Claude Code never exited", &bb, &fake, || {
        processes_with(&runtime).is_empty()
    })
    .await;
    let turn = bb
        .get(&format!("/v1/sessions/{SESSION}/turns/turn-d"))
        .await;
    assert_eq!(turn.body["status"], "inflight", "{turn}");
    let cancel = bb
        .post_empty(&format!("/v1/sessions/{SESSION}/turns/turn-d/cancel"))
        .await;
    assert_eq!(cancel.status, 200, "{cancel}");
    // Without the cancel reaching the wait, the turn commits once the call ends (60 s).
    let ended = bb.poll_turn(SESSION, "turn-d", 5, settled).await;
    assert_eq!(ended["status"], "cancelled", "{ended}");
}
