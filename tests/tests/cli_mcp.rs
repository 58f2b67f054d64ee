//! `agentbox mcp` as MCP clients drive it, on the real stack of the CLI tests (launcher with
//! the real Claude Code in bwrap, gateway, bridge, fakellm as an `openai` model):
//!
//! - raw JSON-RPC lines over the child's stdio (so the wire format itself is checked):
//!   `initialize`, `notifications/initialized`, `tools/list`, `tools/call` of `run` (progress
//!   notifications for its `progressToken`, the branch lands), `status` and `logs`, bad
//!   arguments answered with an `isError` result while the server keeps serving, and
//!   `notifications/cancelled` stopping a run as Ctrl-C does;
//! - the real Claude Code as the MCP client (`--mcp-config`), its own model fakellm scripted to
//!   call `mcp__agentbox__run`, delegating a task that lands as a branch.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cli_common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentbox_api::gateway::TaskState;
use agentbox_policy::id::Tid;
use agentbox_tests::harness::{
    FakeLlm, claude_headless, run_captured, stream_json_result, workspace_bin,
};
use cli_common::{Stack, cli_with, git, status_task, write_script, writes};
use serde_json::{Value, json};

/// How long a delegated run may take (Claude Code starting in bwrap, two turns).
const RUN_TIMEOUT: Duration = Duration::from_secs(240);

/// `agentbox --config <stack's> mcp`, spoken to in JSON-RPC lines.
struct McpChild {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Arc<Mutex<String>>,
    next_id: u64,
}

impl McpChild {
    fn start(stack: &Stack) -> McpChild {
        let mut child = cli_with(&stack.config, &["mcp"])
            .stdin(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&stderr);
        let err = child.stderr.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let mut s = sink.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        McpChild {
            child,
            stdin,
            lines,
            stderr,
            next_id: 1,
        }
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// One JSON-RPC message, one line.
    fn send(&mut self, message: &Value) {
        let stdin = self.stdin.as_mut().expect("stdin still open");
        writeln!(stdin, "{message}").unwrap();
        stdin.flush().unwrap();
    }

    /// Sends a request; its id.
    fn request(&mut self, method: &str, params: Value) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.send(&json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params}));
        id
    }

    /// The response to `id` and every message that came before it. Every line on stdout must
    /// be a JSON-RPC 2.0 message (logs go to stderr).
    fn response(
        &mut self,
        id: u64,
        within: Duration,
        diag: &dyn Fn() -> String,
    ) -> (Value, Vec<Value>) {
        let deadline = Instant::now() + within;
        let mut before = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = match self.lines.recv_timeout(left) {
                Ok(line) => line,
                Err(RecvTimeoutError::Timeout) => panic!(
                    "no response to request {id} within {within:?}; saw {before:?}\n--- mcp stderr ---\n{}\n{}",
                    self.stderr(),
                    diag()
                ),
                Err(RecvTimeoutError::Disconnected) => panic!(
                    "agentbox mcp closed stdout before answering {id}\n--- mcp stderr ---\n{}\n{}",
                    self.stderr(),
                    diag()
                ),
            };
            let message: Value = serde_json::from_str(&line)
                .unwrap_or_else(|e| panic!("not JSON on stdout ({e}): {line:?}"));
            assert_eq!(message["jsonrpc"], "2.0", "{message}");
            if message["id"] == id
                && (message.get("result").is_some() || message.get("error").is_some())
            {
                return (message, before);
            }
            before.push(message);
        }
    }

    /// `tools/call` of `name` with `arguments` (and `_meta` if given); its result and the
    /// notifications that came before it.
    fn call(
        &mut self,
        name: &str,
        arguments: Value,
        meta: Option<Value>,
        within: Duration,
        diag: &dyn Fn() -> String,
    ) -> (Value, Vec<Value>) {
        let mut params = json!({"name": name, "arguments": arguments});
        if let Some(meta) = meta {
            params["_meta"] = meta;
        }
        let id = self.request("tools/call", params);
        let (response, before) = self.response(id, within, diag);
        let result = response
            .get("result")
            .cloned()
            .unwrap_or_else(|| panic!("a protocol error, not a tool result: {response}"));
        (result, before)
    }

    /// `initialize` (protocol 2025-06-18) and `notifications/initialized`; the server's answer.
    fn handshake(&mut self) -> Value {
        let id = self.request(
            "initialize",
            json!({"protocolVersion": "2025-06-18", "capabilities": {},
                   "clientInfo": {"name": "cli_mcp", "version": "0"}}),
        );
        let (response, _) = self.response(id, Duration::from_secs(30), &String::new);
        self.send(&json!({"jsonrpc": "2.0", "method": "notifications/initialized"}));
        response["result"].clone()
    }

    /// Closes stdin (the client goes away); the server's exit status.
    fn close(&mut self, within: Duration) -> std::process::ExitStatus {
        drop(self.stdin.take());
        let deadline = Instant::now() + within;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "agentbox mcp still running {within:?} after stdin closed\n{}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for McpChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The progress notifications among `messages` for `token`.
fn progress_for<'a>(messages: &'a [Value], token: &str) -> Vec<&'a Value> {
    messages
        .iter()
        .filter(|m| {
            m["method"] == "notifications/progress" && m["params"]["progressToken"] == token
        })
        .collect()
}

#[tokio::test]
async fn handshake_tools_run_with_progress_status_logs_and_bad_arguments() {
    let stack = Stack::start(&writes(&[("mcp.txt", "via mcp", 0)]), "", 64700);
    let diag = || stack.describe_logs();
    let mut mcp = McpChild::start(&stack);

    let info = mcp.handshake();
    assert_eq!(info["protocolVersion"], "2025-06-18", "{info}");
    assert_eq!(info["serverInfo"]["name"], "agentbox", "{info}");
    assert!(info["capabilities"]["tools"].is_object(), "{info}");

    // tools/list: the six verbs, each with an object schema mirroring the CLI's arguments.
    let id = mcp.request("tools/list", json!({}));
    let (list, _) = mcp.response(id, Duration::from_secs(30), &diag);
    let tools = list["result"]["tools"].as_array().unwrap();
    let names: Vec<&str> = tools.iter().filter_map(|t| t["name"].as_str()).collect();
    assert_eq!(
        names,
        ["run", "status", "logs", "stop", "check", "deliver"],
        "{list}"
    );
    for t in tools {
        assert_eq!(t["inputSchema"]["type"], "object", "{t}");
        assert!(
            t["description"].as_str().is_some_and(|d| !d.is_empty()),
            "{t}"
        );
    }
    let run_schema = &tools[0]["inputSchema"];
    assert_eq!(
        run_schema["required"],
        json!(["repo", "model", "prompt"]),
        "{run_schema}"
    );
    for key in [
        "budget_tokens",
        "budget_usd",
        "timeout",
        "keep",
        "tid",
        "ref",
        "env",
        "venv",
    ] {
        assert!(
            run_schema["properties"][key].is_object(),
            "run lacks {key}: {run_schema}"
        );
    }
    assert_eq!(
        tools[4]["inputSchema"]["required"],
        json!(["tid", "command"]),
        "check: {}",
        tools[4]
    );

    // run, with a progress token: a real task through the sandbox; the branch lands.
    let repo = stack.repo.display().to_string();
    let (result, before) = mcp.call(
        "run",
        json!({"repo": repo, "model": "gpt", "prompt": "Write mcp.txt.",
               "budget_tokens": 1_000_000, "tid": "mcp-run"}),
        Some(json!({"progressToken": "run-1"})),
        RUN_TIMEOUT,
        &diag,
    );
    assert_eq!(result["isError"], false, "{result}\n{}", diag());
    let s = &result["structuredContent"];
    assert_eq!(s["outcome"], "succeeded", "{result}");
    assert_eq!(s["tid"], "mcp-run");
    assert_eq!(s["branch"], "agent/mcp-run", "{result}");
    assert_eq!(s["base_sha"], stack.base_sha.as_str());
    assert_eq!(
        git(&stack.repo, &["show", "agent/mcp-run:mcp.txt"]),
        "via mcp"
    );
    let total = s["usage"]["total_tokens"].as_u64().unwrap();
    assert!(total >= 2325, "both scripted turns metered: {result}");
    assert_eq!(s["budget"]["tokens"], 1_000_000);
    assert_eq!(
        s["remaining"]["tokens"].as_u64().unwrap(),
        1_000_000 - total
    );
    // The content: a line for people, then the same JSON as text.
    let content = result["content"].as_array().unwrap();
    assert!(
        content[0]["text"]
            .as_str()
            .unwrap()
            .contains("outcome   succeeded"),
        "{result}"
    );
    let as_text: Value = serde_json::from_str(content[1]["text"].as_str().unwrap()).unwrap();
    assert_eq!(&as_text, s);

    // Its progress came as notifications for the token, before the result, in order.
    let progress = progress_for(&before, "run-1");
    assert!(progress.len() >= 3, "snapshot, start, polls...: {before:?}");
    let values: Vec<f64> = progress
        .iter()
        .map(|p| p["params"]["progress"].as_f64().unwrap())
        .collect();
    assert!(
        values.windows(2).all(|w| w[0] < w[1]),
        "increasing: {values:?}"
    );
    let messages: Vec<&str> = progress
        .iter()
        .filter_map(|p| p["params"]["message"].as_str())
        .collect();
    assert!(
        messages[0].starts_with("task mcp-run: snapshot of"),
        "{messages:?}"
    );
    assert!(
        messages
            .iter()
            .any(|m| m.contains("Claude Code runs in the sandbox")),
        "{messages:?}"
    );
    assert!(
        messages
            .iter()
            .any(|m| m.starts_with("delivered agent/mcp-run")),
        "{messages:?}"
    );
    // The polls carry the numbers: requests, tokens, cost, budget left.
    let polls: Vec<&Value> = progress
        .iter()
        .map(|p| &p["params"]["_meta"]["agentbox/progress"])
        .filter(|m| m.is_object())
        .collect();
    assert!(!polls.is_empty(), "{progress:?}");
    let last = polls.last().unwrap();
    assert!(last["elapsed_s"].as_f64().is_some(), "{last}");
    assert_eq!(last["budget"]["tokens"], 1_000_000, "{last}");
    assert!(last["remaining"]["tokens"].as_u64().is_some(), "{last}");
    assert!(
        polls
            .iter()
            .any(|p| p["requests"].as_u64().is_some_and(|r| r >= 1)),
        "{polls:?}"
    );
    assert!(
        messages
            .iter()
            .any(|m| m.contains("requests ·") && m.contains("tokens left")),
        "{messages:?}"
    );

    // status: the same JSON as `status --json`; the task closed with its usage.
    let (result, _) = mcp.call("status", json!({}), None, Duration::from_secs(60), &diag);
    assert_eq!(result["isError"], false, "{result}");
    let s = &result["structuredContent"];
    assert_eq!(s["launcher"]["ready"], true, "{result}");
    let task = status_task(s, "mcp-run");
    assert_eq!(task["state"], "closed", "{task}");
    assert_eq!(task["usage"]["total_tokens"].as_u64().unwrap(), total);

    // logs: Claude Code's stream-json, paged by offset.
    let (result, _) = mcp.call(
        "logs",
        json!({"tid": "mcp-run"}),
        None,
        Duration::from_secs(60),
        &diag,
    );
    assert_eq!(result["isError"], false, "{result}");
    let page = &result["structuredContent"];
    assert_eq!(page["done"], true, "{page}");
    assert!(
        page["output"]
            .as_str()
            .unwrap()
            .contains("\"type\":\"result\""),
        "{page}"
    );
    let end = page["next_offset"].clone();
    let (result, _) = mcp.call(
        "logs",
        json!({"tid": "mcp-run", "offset": end}),
        None,
        Duration::from_secs(60),
        &diag,
    );
    assert_eq!(result["structuredContent"]["output"], "", "{result}");

    // Bad arguments: a tool error with the CLI's line and exit code, never a crash.
    let mut refused = |tool: &str, args: Value, code: u64, name: &str| {
        let (result, _) = mcp.call(tool, args, None, Duration::from_secs(30), &diag);
        assert_eq!(result["isError"], true, "{result}");
        assert_eq!(result["structuredContent"]["exit_code"], code, "{result}");
        assert_eq!(result["structuredContent"]["exit_name"], name, "{result}");
        result
    };
    refused("run", json!({"repo": 7}), 2, "usage");
    refused(
        "run",
        json!({"repo": repo, "prompt": "x", "model": "gpt", "budget": 5}),
        2,
        "usage",
    );
    let result = refused(
        "run",
        json!({"repo": repo, "model": "no-such-model", "prompt": "x"}),
        64,
        "unknown_model",
    );
    assert!(
        result["content"][0]["text"]
            .as_str()
            .unwrap()
            .contains("unknown model \"no-such-model\""),
        "{result}"
    );
    refused("stop", json!({"tid": "never-ran"}), 66, "unknown_task");
    refused("logs", json!({"tid": "bad/tid"}), 2, "usage");

    // Still serving after the errors.
    let (result, _) = mcp.call("status", json!({}), None, Duration::from_secs(60), &diag);
    assert_eq!(result["isError"], false, "{result}");

    // The client goes away: the server exits 0.
    let status = mcp.close(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{}", mcp.stderr());
}

#[tokio::test]
async fn cancelling_a_run_stops_it_like_ctrl_c() {
    // The second turn hangs in the model for two minutes: the agent is mid-run when the
    // request is cancelled, having already written a file as its agent uid.
    let stack = Stack::start(&write_script("half.txt", "half", 120_000), "", 64710);
    let diag = || stack.describe_logs();
    let mut mcp = McpChild::start(&stack);
    mcp.handshake();
    let repo = stack.repo.display().to_string();
    let id = mcp.request(
        "tools/call",
        json!({"name": "run", "_meta": {"progressToken": 7},
               "arguments": {"repo": repo, "model": "gpt", "prompt": "Write half.txt.",
                             "tid": "mcp-cancel"}}),
    );
    stack.wait_for_steps(2, Duration::from_secs(120), &mut || true, &|| {
        format!("{}\n{}", mcp.stderr(), diag())
    });
    assert!(
        !stack.agent_processes().is_empty(),
        "the agent runs as its own uid"
    );

    mcp.send(
        &json!({"jsonrpc": "2.0", "method": "notifications/cancelled",
                     "params": {"requestId": id, "reason": "the supervisor changed its mind"}}),
    );
    // Stopped and cleaned up: nothing running, nothing the agent's, the task closed.
    let tid = Tid::parse("mcp-cancel").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let closed = stack
            .gateway
            .client()
            .task(&tid)
            .await
            .is_ok_and(|v| v.state == TaskState::Closed);
        let runs = stack.launcher.client().status().await.unwrap().agents;
        if closed && runs.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "not stopped 60s after the cancel: closed {closed}, runs {runs:?}\n{}\n{}",
            mcp.stderr(),
            diag()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(stack.agent_processes(), Vec::<String>::new(), "{}", diag());
    let task_dir = stack.gateway.data_dir().join("tasks/mcp-cancel");
    assert!(
        task_dir.join("workspace/half.txt").exists(),
        "the agent did write"
    );
    assert_eq!(
        stack.agent_owned(&task_dir),
        Vec::<std::path::PathBuf>::new()
    );
    let branches = git(&stack.repo, &["branch", "--list", "agent/*"]);
    assert!(branches.is_empty(), "nothing delivered: {branches}");

    // The server goes on serving, and never answers the cancelled request.
    let (result, before) = mcp.call("status", json!({}), None, Duration::from_secs(60), &diag);
    assert_eq!(result["isError"], false, "{result}");
    assert!(
        before.iter().all(|m| m["id"] != id),
        "a cancelled request gets no response: {before:?}"
    );
    assert!(
        before.iter().any(|m| m["params"]["progressToken"] == 7
            && m["params"]["message"]
                .as_str()
                .is_some_and(|s| s.starts_with("stopping:"))),
        "the run said it was stopping: {before:?}"
    );
    let status = mcp.close(Duration::from_secs(30));
    assert!(status.success(), "{status:?}\n{}", mcp.stderr());
}

#[tokio::test]
async fn claude_code_delegates_a_task_through_agentbox_mcp() {
    // The inner task: Claude Code in the sandbox writes the file (fakellm behind the bridge).
    let stack = Stack::start(
        &writes(&[("delegated.txt", "from the supervisor", 0)]),
        "",
        64720,
    );
    let repo = stack.repo.display().to_string();
    // The supervisor: the real Claude Code on the host, its model a second fakellm scripted
    // to call the agentbox tool, then to finish once the tool's result came back.
    let call = json!({"id": "toolu_agentbox_run_1", "name": "mcp__agentbox__run",
                      "input": {"repo": repo, "model": "gpt", "prompt": "Write delegated.txt.",
                                "tid": "mcp-claude", "budget_tokens": 1_000_000}});
    let outer = FakeLlm::scripted(&json!({
        "rules": [{"match": {"has_tools": false}, "text": "ok"}],
        "steps": [
            {"match": {"has_tools": true, "body_contains": "mcp__agentbox__run"},
             "tool_calls": [call],
             "usage": {"input_tokens": 300, "output_tokens": 40}},
            {"match": {"has_tools": true, "body_contains": "toolu_agentbox_run_1"},
             "text": "delegated",
             "usage": {"input_tokens": 400, "output_tokens": 3}}
        ]
    }))
    .unwrap();

    let scratch = tempfile::Builder::new()
        .prefix("mcp-claude-")
        .tempdir()
        .unwrap();
    for sub in ["work", "home", "tmp"] {
        std::fs::create_dir_all(scratch.path().join(sub)).unwrap();
    }
    let agentbox = workspace_bin("agentbox-cli", "agentbox").unwrap();
    let mcp_config = scratch.path().join("mcp.json");
    std::fs::write(
        &mcp_config,
        json!({"mcpServers": {"agentbox": {
            "type": "stdio",
            "command": agentbox,
            "args": ["--config", stack.config, "mcp"]}}})
        .to_string(),
    )
    .unwrap();
    let mut cmd = claude_headless(
        &scratch.path().join("work"),
        &scratch.path().join("home"),
        &scratch.path().join("tmp"),
        &outer.base_url(),
        "supervisor-token",
        "claude-sonnet-4-5",
        "Delegate writing delegated.txt to agentbox.",
    )
    .unwrap();
    cmd.arg("--mcp-config")
        .arg(&mcp_config)
        .args([
            "--strict-mcp-config",
            "--allowedTools",
            "mcp__agentbox__run",
        ])
        // The run is long for an MCP tool call; Claude Code's default may cut it short.
        .env("MCP_TOOL_TIMEOUT", "300000")
        .env("MCP_TIMEOUT", "60000");
    let out = run_captured("claude", cmd, RUN_TIMEOUT + Duration::from_secs(60))
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", stack.describe_logs()));
    let outer_log = outer
        .requests()
        .unwrap_or_default()
        .iter()
        .map(|r| format!("{} {}", r["path"], r["served_by"]))
        .collect::<Vec<_>>()
        .join("\n");
    let diag = || {
        format!(
            "{}\n--- supervisor's fakellm ---\n{outer_log}\n{}",
            out.describe(),
            stack.describe_logs()
        )
    };
    assert!(out.status.success(), "{}", diag());
    let result =
        stream_json_result(&out.stdout).unwrap_or_else(|| panic!("no result event: {}", diag()));
    assert_eq!(result["result"], "delegated", "{}", diag());

    // The delegated task's branch landed, and its gateway task is closed.
    assert_eq!(
        git(&stack.repo, &["show", "agent/mcp-claude:delegated.txt"]),
        "from the supervisor"
    );
    let view = stack
        .gateway
        .client()
        .task(&Tid::parse("mcp-claude").unwrap())
        .await
        .unwrap();
    assert_eq!(view.state, TaskState::Closed);

    // The supervisor's model got the tool's result: the summary, not an error.
    let second = outer
        .requests()
        .unwrap()
        .into_iter()
        .find(|r| r["served_by"] == "step 1")
        .unwrap_or_else(|| panic!("no second turn: {}", diag()));
    let tool_result = second["body"]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["content"].as_array())
        .flatten()
        .find(|b| b["type"] == "tool_result" && b["tool_use_id"] == "toolu_agentbox_run_1")
        .cloned()
        .unwrap_or_else(|| panic!("no tool_result: {}", diag()));
    assert_ne!(tool_result["is_error"], true, "{tool_result}");
    let text = tool_result.to_string();
    assert!(text.contains("succeeded"), "{tool_result}");
    assert!(text.contains("agent/mcp-claude"), "{tool_result}");
}
