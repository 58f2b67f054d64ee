//! The real agent CLIs (installed by `scripts/install-clients.sh`) driven through a scripted
//! multi-step task against `fakellm`: the model asks for a file write, the client performs it,
//! sends the tool result back, and the model finishes. This is what proves fakellm is faithful
//! enough for the end-to-end tests of the gateway, bridge and blackbox server.
//!
//! A missing client fails the test with the install hint; it is never skipped.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentbox_tests::harness::{
    FakeLlm, GatewayProcess, Service, claude_headless, client_bin, run_captured, wait_group_gone,
};
use serde_json::{Value, json};

const CLIENT_TIMEOUT: Duration = Duration::from_secs(120);

fn fakellm_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fakellm"))
}

fn bin_or_fail(name: &str) -> PathBuf {
    client_bin(name).unwrap_or_else(|e| panic!("{e}"))
}

/// A temp dir with an empty `workspace/` and a `home/` for the client's state.
struct Scratch {
    dir: tempfile::TempDir,
}

impl Scratch {
    fn new(prefix: &str) -> Self {
        let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
        for sub in ["workspace", "home", "tmp"] {
            std::fs::create_dir_all(dir.path().join(sub)).unwrap();
        }
        Self { dir }
    }

    fn workspace(&self) -> PathBuf {
        self.dir.path().join("workspace")
    }

    fn home(&self) -> PathBuf {
        self.dir.path().join("home")
    }

    fn tmp(&self) -> PathBuf {
        self.dir.path().join("tmp")
    }
}

/// The message requests fakellm saw (count_tokens and probes left out).
fn message_requests(fake: &FakeLlm) -> Vec<Value> {
    fake.requests()
        .unwrap()
        .into_iter()
        .filter(|r| {
            let p = r["path"].as_str().unwrap_or("");
            p.starts_with("/v1/messages") && !p.starts_with("/v1/messages/count_tokens")
                || p.starts_with("/v1/chat/completions")
        })
        .collect()
}

fn summarize_log(fake: &FakeLlm) -> String {
    fake.requests()
        .unwrap_or_default()
        .iter()
        .map(|r| {
            format!(
                "#{} {} {} model={} served_by={}",
                r["seq"], r["method"], r["path"], r["body"]["model"], r["served_by"]
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// What a failing Claude Code test prints: the client's output, fakellm's log and, when a
/// daemon stands in between, that daemon's log.
fn claude_diag(run: &ClaudeRun, fake: &FakeLlm, daemon: Option<(&str, String)>) -> String {
    let mut text = format!(
        "{}\n--- fakellm log ---\n{}",
        run.out.describe(),
        summarize_log(fake)
    );
    if let Some((name, log)) = daemon {
        text.push_str(&format!("\n--- {name} ---\n{log}"));
    }
    text
}

/// The outcome of one headless `claude -p` run.
struct ClaudeRun {
    out: agentbox_tests::harness::Captured,
    events: Vec<Value>,
}

impl ClaudeRun {
    /// Runs the real Claude Code headless in `scratch` against `base_url` with `token`.
    async fn run(
        scratch: &Scratch,
        base_url: &str,
        token: &str,
        model: &str,
        prompt: &str,
    ) -> Self {
        Self::run_with(scratch, base_url, token, model, prompt, &[]).await
    }

    /// Like [`ClaudeRun::run`] with extra environment (e.g. `ANTHROPIC_UNIX_SOCKET`).
    async fn run_with(
        scratch: &Scratch,
        base_url: &str,
        token: &str,
        model: &str,
        prompt: &str,
        extra_env: &[(&str, &str)],
    ) -> Self {
        let mut cmd = claude_headless(
            &scratch.workspace(),
            &scratch.home(),
            &scratch.tmp(),
            base_url,
            token,
            model,
            prompt,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        cmd.args(["--permission-mode", "bypassPermissions"]);
        for (k, v) in extra_env {
            cmd.env(k, v);
        }
        let started = Instant::now();
        let out = run_captured("claude", cmd, CLIENT_TIMEOUT)
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        eprintln!("claude -p took {:?}", started.elapsed());
        let events = out
            .stdout
            .lines()
            .filter(|l| !l.trim().is_empty())
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        Self { out, events }
    }

    /// The final `result` event.
    fn result(&self) -> Option<&Value> {
        self.events.iter().rev().find(|e| e["type"] == "result")
    }

    /// What every completed write task shows: claude exited 0, its result is "done", and
    /// `target` holds `content`. Returns the result event.
    fn assert_done(&self, target: &Path, content: &str, diag: &dyn Fn() -> String) -> &Value {
        assert!(self.out.status.success(), "claude failed: {}", diag());
        let result = self
            .result()
            .unwrap_or_else(|| panic!("no result event: {}", diag()));
        assert_eq!(result["result"], "done", "{}", diag());
        assert_eq!(
            std::fs::read_to_string(target).unwrap_or_else(|e| panic!("{e}: {}", diag())),
            content
        );
        result
    }
}

/// The request fakellm served with the script's second step.
fn second_turn<'a>(requests: &'a [Value], diag: &dyn Fn() -> String) -> &'a Value {
    requests
        .iter()
        .find(|r| r["served_by"] == "step 1")
        .unwrap_or_else(|| panic!("no second turn: {}", diag()))
}

/// The `role: tool` messages of a chat-completions request.
fn tool_messages(request: &Value) -> Vec<&Value> {
    let messages = request["body"]["messages"].as_array().unwrap();
    messages.iter().filter(|m| m["role"] == "tool").collect()
}

/// A script for a two-step task: answer side requests (no tools) with `side_text`, make
/// `tool_call`, then answer "done" once the tool result came back (a request body containing
/// `result_marker`: `tool_result` in Anthropic requests, `tool_call_id` in chat requests).
fn two_step_script(side_text: &str, tool_call: Value, result_marker: &str) -> Value {
    json!({
        "rules": [{"match": {"has_tools": false}, "text": side_text}],
        "steps": [
            {"match": {"has_tools": true},
             "tool_calls": [tool_call],
             "usage": {"input_tokens": 100, "output_tokens": 20}},
            {"match": {"has_tools": true, "body_contains": result_marker},
             "text": "done",
             "usage": {"input_tokens": 130, "output_tokens": 2, "cache_read_input_tokens": 50}}
        ]
    })
}

/// [`two_step_script`] for Claude Code: `Write` `content` to `target` (tool id `tool_id`).
fn write_then_done_script(
    target: &Path,
    content: &str,
    tool_id: &str,
    result_marker: &str,
) -> Value {
    // Side requests (title, quota probe, small-model calls) carry no tools; answer them
    // without spending the scripted turn.
    let write = json!({"id": tool_id, "name": "Write",
                       "input": {"file_path": target, "content": content}});
    two_step_script("ok", write, result_marker)
}

/// A scratch dir, and fakellm scripted to have Claude Code write `content` into `file` of its
/// workspace (see [`write_then_done_script`]); the target's path is returned too.
fn write_task(
    prefix: &str,
    file: &str,
    content: &str,
    tool_id: &str,
    result_marker: &str,
) -> (Scratch, PathBuf, FakeLlm) {
    let scratch = Scratch::new(prefix);
    let target = scratch.workspace().join(file);
    let script = write_then_done_script(&target, content, tool_id, result_marker);
    let fake = FakeLlm::start(fakellm_bin(), &script).unwrap();
    (scratch, target, fake)
}

#[tokio::test]
async fn claude_code_writes_a_file_through_fakellm() {
    let content = "hello from fakellm\nsecond line ✓\n";
    let tool_id = "toolu_agentbox_write_1";
    let (scratch, target, fake) =
        write_task("claude-e2e-", "hello.txt", content, tool_id, "tool_result");
    let run = ClaudeRun::run(
        &scratch,
        &fake.base_url(),
        "test-token",
        "claude-sonnet-4-5",
        "Create hello.txt in the current directory.",
    )
    .await;
    let diag = || claude_diag(&run, &fake, None);
    let result = run.assert_done(&target, content, &diag);
    assert_eq!(result["is_error"], false, "{}", diag());
    assert_eq!(result["subtype"], "success", "{}", diag());
    assert_eq!(result["num_turns"], 2, "{}", diag());

    let requests = message_requests(&fake);
    let first = &requests[0];
    assert!(
        first["path"]
            .as_str()
            .unwrap()
            .starts_with("/v1/messages?beta=true")
    );
    assert_eq!(first["headers"]["authorization"], "Bearer test-token");
    assert_eq!(first["headers"]["anthropic-version"], "2023-06-01");
    assert_eq!(first["body"]["stream"], true);
    let tools: Vec<&str> = first["body"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["name"].as_str())
        .collect();
    assert!(tools.contains(&"Write"), "tools offered: {tools:?}");

    let second = second_turn(&requests, &diag);
    let results: Vec<&Value> = second["body"]["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|m| m["content"].as_array())
        .flatten()
        .filter(|b| b["type"] == "tool_result")
        .collect();
    assert_eq!(results.len(), 1, "{results:?}");
    assert_eq!(results[0]["tool_use_id"], tool_id);
    assert_ne!(results[0]["is_error"], true, "{:?}", results[0]);
    assert!(
        requests.iter().all(|r| r["served_by"] != "exhausted"),
        "{}",
        diag()
    );
}

/// Claude Code → agentbox-bridge (an `openai` model) → fakellm in chat-completions mode: the
/// bridge translates every turn both ways, streamed, and the task still completes.
#[tokio::test]
async fn claude_code_completes_a_task_through_the_bridge_in_chat_mode() {
    let content = "written through the bridge\n";
    let tool_id = "call_bridge_write_1";
    let (scratch, target, fake) = write_task(
        "claude-bridge-",
        "bridged.txt",
        content,
        tool_id,
        "tool_call_id",
    );
    let token = "bridge-e2e-token";
    let bridge = agentbox_tests::harness::BridgeProcess::start(
        &format!(
            "[bridge]\nlisten = \"127.0.0.1:0\"\n[models.gpt]\nbackend = \"remote\"\nprovider = \"openai\"\n\
             base_url = \"{}/v1\"\nupstream_model = \"gpt-upstream\"\nkey_env = \"OPENAI_KEY\"\nmax_output_tokens = 8192\n",
            fake.base_url()
        ),
        &[("AGENTBOX_BRIDGE_TOKEN", token), ("OPENAI_KEY", "sk-e2e")],
    )
    .unwrap();
    let run = ClaudeRun::run(
        &scratch,
        &bridge.base_url(),
        token,
        "gpt",
        "Create bridged.txt.",
    )
    .await;
    let diag = || claude_diag(&run, &fake, Some(("bridge", bridge.stderr())));
    let result = run.assert_done(&target, content, &diag);
    assert_eq!(result["is_error"], false, "{}", diag());

    let requests = message_requests(&fake);
    assert!(
        requests.iter().all(|r| r["path"] == "/v1/chat/completions"),
        "{}",
        diag()
    );
    let first = &requests[0];
    assert_eq!(first["headers"]["authorization"], "Bearer sk-e2e");
    assert_eq!(first["body"]["model"], "gpt-upstream");
    assert_eq!(first["body"]["stream"], true);
    assert_eq!(first["body"]["stream_options"]["include_usage"], true);
    assert!(
        first["body"]["max_completion_tokens"].as_u64().unwrap() <= 8192,
        "clamped: {}",
        first["body"]
    );
    assert!(first["body"].get("context_management").is_none());
    assert!(first["body"].get("thinking").is_none());
    let tool_msgs = tool_messages(second_turn(&requests, &diag));
    assert_eq!(tool_msgs.len(), 1, "{tool_msgs:?}");
    assert_eq!(tool_msgs[0]["tool_call_id"], tool_id);
    for r in &requests {
        assert!(
            !r.to_string().contains(token),
            "bridge token leaked upstream"
        );
    }
}

#[tokio::test]
async fn opencode_writes_a_file_through_fakellm() {
    let opencode = bin_or_fail("opencode");
    let scratch = Scratch::new("opencode-e2e-");
    let target = scratch.workspace().join("hello.txt");
    let content = "hello from fakellm\nsecond line ✓\n";
    let call_id = "call_agentbox_write_1";
    let fake = FakeLlm::start(
        fakellm_bin(),
        // opencode asks its small model for a session title, without tools, concurrently with
        // the first turn.
        &two_step_script(
            "Write hello file",
            json!({"id": call_id, "name": "write",
                   "input": {"filePath": target, "content": content}}),
            "\"tool_call_id\"",
        ),
    )
    .unwrap();

    let config = json!({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"fake": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "fakellm",
            "options": {"baseURL": format!("{}/v1", fake.base_url()), "apiKey": "test-key"},
            "models": {"fake-model": {"name": "Fake", "tools": true,
                                      "limit": {"context": 131_072, "output": 8192}}}
        }},
        "model": "fake/fake-model",
        "small_model": "fake/fake-model",
        "permission": {"*": "allow"},
        "autoupdate": false,
        "share": "disabled"
    });
    let home = scratch.home();
    let mut cmd = std::process::Command::new(&opencode);
    cmd.current_dir(scratch.workspace())
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("HOME", &home)
        .env("XDG_CONFIG_HOME", home.join(".config"))
        .env("XDG_DATA_HOME", home.join(".local/share"))
        .env("XDG_CACHE_HOME", home.join(".cache"))
        .env("XDG_STATE_HOME", home.join(".local/state"))
        .env("TMPDIR", scratch.tmp())
        .env("OPENCODE_CONFIG_CONTENT", config.to_string())
        .env("OPENCODE_DISABLE_AUTOUPDATE", "1")
        .env("OPENCODE_DISABLE_MODELS_FETCH", "1")
        .env("OPENCODE_DISABLE_LSP_DOWNLOAD", "1")
        .env("OPENCODE_DISABLE_DEFAULT_PLUGINS", "1")
        // opencode starts a background `npm install @opencode-ai/plugin` into its config dir;
        // it is optional (failure is a logged warning) and would otherwise fetch ~60 MB.
        .env("npm_config_offline", "true")
        .args(["serve", "--port", "0", "--hostname", "127.0.0.1"]);
    let started = Instant::now();
    let (mut server, url) = Service::start("opencode serve", cmd, Duration::from_secs(60), |l| {
        l.split_once("listening on ")
            .map(|(_, u)| u.trim().to_owned())
    })
    .unwrap();
    let pgid = server.pid();

    let http = reqwest::Client::builder()
        .timeout(CLIENT_TIMEOUT)
        .build()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = http
            .get(format!("{url}/global/health"))
            .send()
            .await
            .ok()
            .filter(|r| r.status().is_success());
        if let Some(r) = ok {
            let v: Value = r.json().await.unwrap();
            assert_eq!(v["healthy"], true);
            break;
        }
        assert!(
            Instant::now() < deadline,
            "opencode never healthy: {}",
            server.describe()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let session: Value = http
        .post(format!("{url}/session"))
        .json(&json!({}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let sid = session["id"].as_str().expect("session id").to_owned();
    let turn_started = Instant::now();
    let reply = http
        .post(format!("{url}/session/{sid}/message"))
        .json(&json!({
            "parts": [{"type": "text", "text": "Create hello.txt in the current directory."}],
            "model": {"providerID": "fake", "modelID": "fake-model"}
        }))
        .send()
        .await;
    let diag = |server: &Service| {
        format!(
            "{}\n--- fakellm log ---\n{}",
            server.describe(),
            summarize_log(&fake)
        )
    };
    let reply = reply.unwrap_or_else(|e| panic!("prompt failed: {e}\n{}", diag(&server)));
    assert!(
        reply.status().is_success(),
        "{}: {}",
        reply.status(),
        diag(&server)
    );
    let reply: Value = reply.json().await.unwrap();
    eprintln!(
        "opencode: start to healthy+turn {:?}, turn {:?}",
        started.elapsed(),
        turn_started.elapsed()
    );
    assert!(
        reply["info"].get("error").is_none(),
        "{reply}\n{}",
        diag(&server)
    );
    let texts: Vec<&str> = reply["parts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["type"] == "text")
        .filter_map(|p| p["text"].as_str())
        .collect();
    assert_eq!(texts, ["done"], "{reply}");
    assert_eq!(reply["info"]["tokens"]["output"], 2, "{reply}");

    assert_eq!(
        std::fs::read_to_string(&target).unwrap_or_else(|e| panic!("{e}: {}", diag(&server))),
        content
    );

    let requests = message_requests(&fake);
    let first = requests
        .iter()
        .find(|r| r["served_by"] == "step 0")
        .expect("first turn");
    assert_eq!(first["headers"]["authorization"], "Bearer test-key");
    assert_eq!(first["body"]["stream"], true);
    let write_tool = first["body"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["function"]["name"] == "write")
        .unwrap_or_else(|| panic!("no write tool in {}", first["body"]["tools"]));
    let params = &write_tool["function"]["parameters"]["properties"];
    assert!(params.get("filePath").is_some() && params.get("content").is_some());

    let tool_msgs = tool_messages(second_turn(&requests, &|| diag(&server)));
    assert_eq!(tool_msgs.len(), 1, "{tool_msgs:?}");
    assert_eq!(tool_msgs[0]["tool_call_id"], call_id);
    assert!(
        requests.iter().all(|r| r["served_by"] != "exhausted"),
        "{}",
        diag(&server)
    );

    server.stop();
    // Nothing of opencode's may outlive the test.
    let left = wait_group_gone(pgid, Duration::from_secs(5));
    assert!(left.is_empty(), "opencode processes survived: {left:?}");
}

/// A gateway with one Ollama-backed model pointing at `fake`, and a task opened on it.
async fn gateway_task(fake: &FakeLlm, tid: &str, token: &str, budget: Value) -> GatewayProcess {
    let gw = GatewayProcess::start(
        &format!(
            "[gateway]\nollama_url = \"{}\"\n[models.local]\nbackend = \"ollama\"\nupstream_model = \"qwen-upstream\"\n",
            fake.base_url()
        ),
        &[],
    )
    .unwrap();
    let r = gw
        .control(
            "POST",
            "/tasks",
            Some(&json!({"tid": tid, "model": "local", "token": token, "budget": budget})),
        )
        .await
        .unwrap();
    assert_eq!(r.status, 201, "{}", r.text());
    gw
}

/// Claude Code reaching its model only through the gateway's task socket, as inside a sandbox.
async fn run_on_task_socket(
    scratch: &Scratch,
    gw: &GatewayProcess,
    tid: &str,
    token: &str,
    prompt: &str,
) -> ClaudeRun {
    let sock = gw.task_socket(tid).to_string_lossy().into_owned();
    ClaudeRun::run_with(
        scratch,
        "http://localhost",
        token,
        "claude-sonnet-4-5",
        prompt,
        &[("ANTHROPIC_UNIX_SOCKET", &sock)],
    )
    .await
}

/// What a failing gateway test prints: the client's output, fakellm's log, the gateway's log.
fn gateway_diag(run: &ClaudeRun, fake: &FakeLlm, gw: &GatewayProcess) -> String {
    claude_diag(run, fake, Some(("gateway", gw.stderr())))
}

/// The real Claude Code talking to a task socket of the real gateway
/// (`ANTHROPIC_UNIX_SOCKET`), as it will inside a sandbox: the task completes, the model sees
/// only what the gateway lets through, and the meter equals what fakellm reported.
#[tokio::test]
async fn claude_code_completes_a_task_through_the_gateway_socket() {
    let content = "through the gateway socket\n";
    let (scratch, target, fake) =
        write_task("claude-gw-", "gw.txt", content, "toolu_gw_1", "tool_result");
    let token = "claude-task-token-0123456789";
    let gw = gateway_task(&fake, "cc1", token, json!({})).await;
    let run = run_on_task_socket(&scratch, &gw, "cc1", token, "Create gw.txt.").await;
    let diag = || gateway_diag(&run, &fake, &gw);
    run.assert_done(&target, content, &diag);

    let requests = message_requests(&fake);
    assert!(requests.len() >= 2, "{}", diag());
    let (mut input, mut output, mut cache_read, mut cache_creation) = (0u64, 0u64, 0u64, 0u64);
    for r in &requests {
        assert_eq!(r["body"]["model"], "qwen-upstream", "model rewritten");
        assert!(
            r["body"].get("context_management").is_none(),
            "context_management stripped"
        );
        let headers = r["headers"].as_object().unwrap();
        assert!(
            !headers.contains_key("anthropic-beta"),
            "anthropic-beta not forwarded"
        );
        assert!(!r.to_string().contains(token), "task token not forwarded");
        // What fakellm reported for this request, from its script.
        let served = r["served_by"].as_str().unwrap();
        let usage = match served {
            "step 0" => json!({"input_tokens": 100, "output_tokens": 20}),
            "step 1" => {
                json!({"input_tokens": 130, "output_tokens": 2, "cache_read_input_tokens": 50})
            }
            other => panic!("unexpected {other}: {}", diag()),
        };
        input += usage["input_tokens"].as_u64().unwrap();
        output += usage["output_tokens"].as_u64().unwrap();
        cache_read += usage["cache_read_input_tokens"].as_u64().unwrap_or(0);
        cache_creation += usage["cache_creation_input_tokens"].as_u64().unwrap_or(0);
    }
    let view = gw.task("cc1").await.unwrap();
    assert_eq!(view["usage"]["input_tokens"], input, "{view}");
    assert_eq!(view["usage"]["output_tokens"], output, "{view}");
    assert_eq!(
        view["usage"]["cache_read_input_tokens"], cache_read,
        "{view}"
    );
    assert_eq!(
        view["usage"]["cache_creation_input_tokens"], cache_creation,
        "{view}"
    );
    assert_eq!(view["usage"]["requests"], requests.len() as u64);
}

/// A budget the first reply exhausts: Claude Code's next request gets 403, it stops at once,
/// and fakellm never sees another request.
#[tokio::test]
async fn claude_code_stops_when_the_budget_runs_out() {
    let (scratch, _target, fake) = write_task(
        "claude-budget-",
        "never.txt",
        "x",
        "toolu_budget_1",
        "tool_result",
    );
    let token = "claude-budget-token-0123456789";
    // The first reply costs 120 tokens.
    let gw = gateway_task(&fake, "cc2", token, json!({"tokens": 100})).await;
    let run = run_on_task_socket(&scratch, &gw, "cc2", token, "Create never.txt.").await;
    let diag = || gateway_diag(&run, &fake, &gw);
    let result = run
        .result()
        .unwrap_or_else(|| panic!("no result event: {}", diag()));
    assert_eq!(result["is_error"], true, "{}", diag());
    let requests = message_requests(&fake);
    assert_eq!(
        requests.len(),
        1,
        "nothing reached the model after the budget ran out: {}",
        diag()
    );
    assert!(
        run.events.iter().all(|e| e["subtype"] != "api_retry"),
        "403 is not retried: {}",
        diag()
    );
    assert!(
        gw.stderr().contains("budget") || run.out.stdout.contains("budget"),
        "{}",
        diag()
    );
    let view = gw.task("cc2").await.unwrap();
    assert_eq!(view["usage"]["total_tokens"], 120);
    assert_eq!(view["usage"]["requests"], 1);
}
