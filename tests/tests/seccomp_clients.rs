//! The sandbox's seccomp allowlist (issue 9, hole 11) against the real agent CLIs: each one does
//! its test task inside the launcher's real sandbox (bwrap as an agent uid, the task cgroup, the
//! filters of `sandbox/src/seccomp.rs`), against fakellm running in there with it on loopback.
//!
//! The clients reach the sandbox as a read-only venv (`/opt/venv`, the launcher's ordinary venv
//! mount): the install of `scripts/install-clients.sh` hard-linked into the launcher's venv root,
//! with `bin/` holding the four CLIs, Node 26 and fakellm. Each task is a bash script run as a
//! check (`bash -c`, the same sandbox and filters as an agent's); it starts fakellm, runs the
//! client, and leaves fakellm's request log in the workspace for the assertions.
//!
//! - Claude Code (`claude -p`) and opencode (`opencode run`): the model asks for a file write
//!   and a shell command (git in a scratch repository) at once; the client runs both, sends the
//!   results back, and the model finishes.
//! - Codex: `codex exec --json` with a custom provider (`wire_api = "responses"`): start-up,
//!   config load and the model call. fakellm has no Responses API yet, so the call gets a 404
//!   and Codex stops after its retries; the test asserts exactly that, and no other failure.
//!   Then `codex sandbox` tries Codex's own sandbox (bwrap in a new user namespace), which the
//!   filter must refuse.
//! - OpenClaw: `openclaw gateway run` on loopback with its state in the sandbox's `/tmp`, then
//!   one chat completion through its `/v1/chat/completions`, which its agent answers by calling
//!   fakellm.
//!
//! What the filter refused while these ran (traced from outside with strace, 2026-11-30): `clone3`
//! (`ENOSYS`; every runtime fell back to `clone`), `io_uring_setup` (Node's libuv, `EPERM`; it
//! fell back to its thread pool), `socket(AF_NETLINK)` (Bun's and Node's interface listing,
//! `EPERM`; both carried on), and Codex's namespace `clone`. No ioctl outside the allowlist.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use agentbox_tests::harness::clients_dir;
use agentbox_tests::harness::launcher::{Launcher, Options, SERVICE_UID, chown_tree};
use serde_json::{Value, json};

/// What every task script starts with: the environment, a helper that waits for a line in a
/// file, and fakellm on a free loopback port (`$PORT`).
const PRELUDE: &str = r#"set -euo pipefail
BIN=/opt/venv/bin W=/workspace T=/tmp/task
export PATH="$BIN:/usr/local/bin:/usr/bin:/bin"
export HOME="$T/home" XDG_CONFIG_HOME="$T/home/.config" XDG_DATA_HOME="$T/home/.local/share" \
  XDG_CACHE_HOME="$T/home/.cache" XDG_STATE_HOME="$T/home/.local/state" TMPDIR="$T/tmp"
mkdir -p "$HOME" "$TMPDIR"
# wait_for FILE REGEX: prints the first line of FILE matching REGEX (within 60 s).
wait_for() {
  for _ in $(seq 600); do
    if grep -m1 -E "$2" "$1" 2>/dev/null; then return 0; fi
    sleep 0.1
  done
  echo "timed out waiting for /$2/ in $1:" >&2; cat "$1" >&2; return 1
}
fakellm --script "$W/script.json" --log "$W/requests.jsonl" --listen 127.0.0.1:0 >"$T/fakellm.out" 2>&1 &
PORT=$(wait_for "$T/fakellm.out" 'listening on' | sed 's/.*://')
cd "$W"
"#;

/// A launcher whose venv root holds the real clients (see the module header).
struct ClientSandbox {
    launcher: Launcher,
    venv: PathBuf,
}

impl ClientSandbox {
    fn start() -> Self {
        let launcher = Launcher::start(Options {
            memory_mb: 3072,
            pids: 1024,
            tmp_mb: 1024,
            output_cap_kb: 2048,
            ..Options::default()
        });
        let venv = launcher.venvs.join("clients");
        let bin = venv.join("bin");
        std::fs::create_dir_all(&bin).unwrap();
        let install = clients_dir().unwrap_or_else(|e| panic!("{e}"));
        // Hard links: a second of work instead of copying 2 GB; the venv is mounted read-only.
        let st = Command::new("cp")
            .arg("-al")
            .arg(install.join("node_modules"))
            .arg(&venv)
            .status()
            .unwrap();
        assert!(st.success(), "cp -al {}", install.display());
        std::os::unix::fs::symlink("/usr/bin/python3", bin.join("python")).unwrap();
        for client in ["claude", "codex", "opencode", "openclaw", "node"] {
            std::os::unix::fs::symlink(
                Path::new("../node_modules/.bin").join(client),
                bin.join(client),
            )
            .unwrap();
        }
        let fakellm = bin.join("fakellm");
        std::fs::copy(env!("CARGO_BIN_EXE_fakellm"), &fakellm).unwrap();
        std::fs::set_permissions(&fakellm, std::fs::Permissions::from_mode(0o755)).unwrap();
        ClientSandbox { launcher, venv }
    }

    /// Runs `task` (after [`PRELUDE`]) as a check in workspace `tid`, with fakellm scripted by
    /// `script`.
    fn run(&self, tid: &str, script: &Value, task: &str) -> Run {
        let ws = self.launcher.workspace(tid);
        std::fs::write(ws.join("script.json"), script.to_string()).unwrap();
        std::fs::write(ws.join("task.sh"), format!("{PRELUDE}{task}")).unwrap();
        chown_tree(&ws, SERVICE_UID);
        let r = self.launcher.post(
            "/checks",
            &json!({"tid": tid, "command": "bash /workspace/task.sh",
                    "venv": self.venv, "timeout_s": 600}),
        );
        assert_eq!(r.status, 200, "{}\n{}", r.raw, self.launcher.stderr());
        let requests = std::fs::read_to_string(ws.join("requests.jsonl"))
            .unwrap_or_default()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        Run {
            result: r.body,
            requests,
            workspace: ws,
        }
    }
}

/// A finished task.
struct Run {
    /// The check's result (`exit_code`, `stdout`, `stderr`...).
    result: Value,
    /// fakellm's request log.
    requests: Vec<Value>,
    workspace: PathBuf,
}

impl Run {
    fn stdout(&self) -> &str {
        self.result["stdout"].as_str().unwrap_or("")
    }

    /// The JSON lines of stdout (the clients' event streams).
    fn events(&self) -> Vec<Value> {
        self.stdout()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    fn requests_to(&self, path: &str) -> Vec<&Value> {
        self.requests
            .iter()
            .filter(|r| r["path"].as_str().is_some_and(|p| p.starts_with(path)))
            .collect()
    }

    /// Everything a failing assertion should show.
    fn describe(&self) -> String {
        let log: Vec<String> = self
            .requests
            .iter()
            .map(|r| {
                format!(
                    "#{} {} {} {}",
                    r["seq"], r["method"], r["path"], r["served_by"]
                )
            })
            .collect();
        format!(
            "exit {} oom {} timed_out {}\n--- stdout ---\n{}\n--- stderr ---\n{}\n--- fakellm ---\n{}",
            self.result["exit_code"],
            self.result["oom_killed"],
            self.result["timed_out"],
            self.stdout(),
            self.result["stderr"].as_str().unwrap_or(""),
            log.join("\n")
        )
    }
}

/// One client's tools, as the model must call them.
struct Tools {
    /// The file-writing tool and its path argument.
    write: &'static str,
    path_key: &'static str,
    /// The shell tool.
    shell: &'static str,
    /// What shows in a request once tool results are in the conversation.
    result_marker: &'static str,
    /// The API path the client calls.
    api: &'static str,
}

const CONTENT: &str = "written under the seccomp allowlist\n";

/// The shell command the agents run: git in a scratch repository (processes, pipes, file
/// locking, the tools agents use most), its result left in the workspace.
const GIT_COMMAND: &str = "git init -q /tmp/task/g && git -C /tmp/task/g -c user.name=t \
    -c user.email=t@example.com commit -q --allow-empty -m 'from the agent shell' && \
    git -C /tmp/task/g log --format=%s > /workspace/shell.txt";

/// Runs `task` in a fresh sandbox with fakellm scripted to ask for a file write and a shell
/// command at once, then to say "done" once the tool results are in the conversation
/// (tool-less side requests, such as titles, get "ok"). Asserts that the task exited 0, both
/// tools did their work and their results reached the model.
fn write_and_shell(tid: &str, tools: &Tools, task: &str) -> Run {
    let sb = ClientSandbox::start();
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "ok"}],
        "steps": [
            {"match": {"has_tools": true},
             "tool_calls": [
                 {"id": "call_sc_write", "name": tools.write,
                  "input": {tools.path_key: "/workspace/hello.txt", "content": CONTENT}},
                 {"id": "call_sc_shell", "name": tools.shell,
                  "input": {"command": GIT_COMMAND, "description": "Commit in a scratch repo"}}],
             "usage": {"input_tokens": 100, "output_tokens": 20}},
            {"match": {"has_tools": true, "body_contains": tools.result_marker}, "text": "done",
             "usage": {"input_tokens": 130, "output_tokens": 2}}
        ]
    });
    let run = sb.run(tid, &script, task);
    assert_eq!(run.result["exit_code"], 0, "{}", run.describe());
    let read = |name: &str| {
        std::fs::read_to_string(run.workspace.join(name))
            .unwrap_or_else(|e| panic!("{name}: {e}\n{}", run.describe()))
    };
    assert_eq!(read("hello.txt"), CONTENT, "{}", run.describe());
    assert_eq!(
        read("shell.txt"),
        "from the agent shell\n",
        "{}",
        run.describe()
    );
    assert!(
        run.requests_to(tools.api)
            .iter()
            .any(|r| r["body"].to_string().contains("call_sc_shell")),
        "{}",
        run.describe()
    );
    run
}

#[test]
fn claude_code_writes_a_file_and_runs_a_command_under_the_filter() {
    let tools = Tools {
        write: "Write",
        path_key: "file_path",
        shell: "Bash",
        result_marker: "tool_result",
        api: "/v1/messages",
    };
    let run = write_and_shell(
        "claude",
        &tools,
        r#"export ANTHROPIC_BASE_URL="http://127.0.0.1:$PORT" ANTHROPIC_AUTH_TOKEN=test-token \
  CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1
claude -p "Create hello.txt in the current directory." --output-format stream-json --verbose \
  --model claude-sonnet-4-5 --permission-mode bypassPermissions </dev/null
"#,
    );
    let result = run
        .events()
        .into_iter()
        .find(|e| e["type"] == "result")
        .unwrap_or_else(|| panic!("no result event\n{}", run.describe()));
    assert_eq!(result["result"], "done", "{}", run.describe());
}

#[test]
fn opencode_writes_a_file_and_runs_a_command_under_the_filter() {
    let tools = Tools {
        write: "write",
        path_key: "filePath",
        shell: "bash",
        result_marker: "\"tool_call_id\"",
        api: "/v1/chat/completions",
    };
    let run = write_and_shell(
        "opencode",
        &tools,
        r#"export OPENCODE_CONFIG_CONTENT='{"$schema": "https://opencode.ai/config.json",
  "provider": {"fake": {"npm": "@ai-sdk/openai-compatible", "name": "fakellm",
    "options": {"baseURL": "http://127.0.0.1:'"$PORT"'/v1", "apiKey": "test-key"},
    "models": {"fake-model": {"name": "Fake", "tools": true,
                              "limit": {"context": 131072, "output": 8192}}}}},
  "model": "fake/fake-model", "small_model": "fake/fake-model",
  "permission": {"*": "allow"}, "autoupdate": false, "share": "disabled"}'
export OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_MODELS_FETCH=1 \
  OPENCODE_DISABLE_LSP_DOWNLOAD=1 OPENCODE_DISABLE_DEFAULT_PLUGINS=1 npm_config_offline=true
opencode run --format json --model fake/fake-model "Create hello.txt in the current directory." </dev/null
"#,
    );
    let texts: Vec<Value> = run
        .events()
        .into_iter()
        .filter(|e| e["type"] == "text")
        .map(|e| e["part"]["text"].clone())
        .collect();
    assert_eq!(texts, [json!("done")], "{}", run.describe());
}

#[test]
fn codex_starts_and_calls_its_model_under_the_filter() {
    let sb = ClientSandbox::start();
    let run = sb.run(
        "codex",
        &json!({"fallback": {"text": "hello"}}),
        r#"export CODEX_HOME="$T/codex" FAKE_API_KEY=test-key
mkdir -p "$CODEX_HOME"
cat >"$CODEX_HOME/config.toml" <<TOML
model = "fake-model"
model_provider = "fake"
approval_policy = "never"
sandbox_mode = "workspace-write"
[model_providers.fake]
name = "fakellm"
base_url = "http://127.0.0.1:$PORT/v1"
wire_api = "responses"
env_key = "FAKE_API_KEY"
TOML
set +e
codex exec --json --skip-git-repo-check "Say hello." </dev/null
echo "codex exec exited $?"
codex sandbox -- /bin/echo inside-codex-sandbox </dev/null
echo "codex sandbox exited $?"
"#,
    );
    assert_eq!(run.result["exit_code"], 0, "{}", run.describe());
    let calls = run.requests_to("/v1/responses");
    assert!(!calls.is_empty(), "{}", run.describe());
    for call in &calls {
        assert_eq!(call["method"], "POST");
        assert_eq!(call["headers"]["authorization"], "Bearer test-key");
        assert_eq!(call["body"]["model"], "fake-model");
        assert_eq!(call["body"]["stream"], true);
    }
    let events = run.events();
    let kinds: Vec<&str> = events.iter().filter_map(|e| e["type"].as_str()).collect();
    assert!(kinds.starts_with(&["thread.started"]), "{}", run.describe());
    assert!(kinds.contains(&"turn.started"), "{}", run.describe());
    let failed = events
        .iter()
        .find(|e| e["type"] == "turn.failed")
        .unwrap_or_else(|| panic!("{}", run.describe()));
    assert!(
        failed["error"]["message"]
            .as_str()
            .unwrap()
            .contains("404 Not Found: fakellm: no route for POST /v1/responses"),
        "the only failure is fakellm's missing Responses API\n{}",
        run.describe()
    );
    assert!(
        run.stdout().contains("codex exec exited 1\n"),
        "{}",
        run.describe()
    );
    // Codex's own sandbox is bwrap in a new user namespace: the filter refuses the clone
    // (EPERM; with the namespace allowed, the kernel would have said ENOSPC, as bwrap's
    // `--disable-userns` left no room for one).
    assert!(
        run.stdout().contains("codex sandbox exited 1\n"),
        "{}",
        run.describe()
    );
    assert!(
        run.result["stderr"]
            .as_str()
            .unwrap()
            .contains("bwrap: No permissions to create new namespace"),
        "{}",
        run.describe()
    );
    assert!(
        !run.stdout().contains("inside-codex-sandbox"),
        "{}",
        run.describe()
    );
}

#[test]
fn openclaw_answers_a_chat_completion_under_the_filter() {
    let sb = ClientSandbox::start();
    let run = sb.run(
        "openclaw",
        &json!({"fallback": {"text": "hello from fakellm",
                             "usage": {"input_tokens": 50, "output_tokens": 4}}}),
        r#"export OPENCLAW_STATE_DIR="$T/openclaw" OPENCLAW_CONFIG_PATH="$T/openclaw/openclaw.json"
mkdir -p "$OPENCLAW_STATE_DIR" "$T/openclaw-workspace"
GW_PORT=18789 GW_TOKEN=gw-test-token
cat >"$OPENCLAW_CONFIG_PATH" <<JSON
{"gateway": {"mode": "local", "bind": "loopback", "port": $GW_PORT,
             "auth": {"mode": "token", "token": "$GW_TOKEN"},
             "http": {"endpoints": {"chatCompletions": {"enabled": true}}}},
 "models": {"mode": "replace", "providers": {"fake": {
   "baseUrl": "http://127.0.0.1:$PORT/v1", "apiKey": "test-key", "api": "openai-completions",
   "models": [{"id": "fake-model", "name": "Fake", "reasoning": false, "input": ["text"],
               "contextWindow": 131072, "maxTokens": 8192}]}}},
 "agents": {"defaults": {"model": {"primary": "fake/fake-model"},
                         "workspace": "$T/openclaw-workspace"}}}
JSON
openclaw gateway run --port $GW_PORT --bind loopback --auth token --token $GW_TOKEN \
  >"$T/openclaw.out" 2>&1 &
GW_PID=$!
for _ in $(seq 1800); do
  if curl -sf -H "Authorization: Bearer $GW_TOKEN" "http://127.0.0.1:$GW_PORT/v1/models" \
      >/dev/null; then break; fi
  if ! kill -0 $GW_PID 2>/dev/null; then
    echo "openclaw gateway exited:" >&2; cat "$T/openclaw.out" >&2; exit 1
  fi
  sleep 0.1
done
curl -sS -m 300 -H "Authorization: Bearer $GW_TOKEN" -H 'content-type: application/json' \
  -d '{"model": "openclaw/default", "messages": [{"role": "user", "content": "Say hello."}]}' \
  "http://127.0.0.1:$GW_PORT/v1/chat/completions"
echo
kill $GW_PID
wait $GW_PID || true
cat "$T/openclaw.out" >&2
"#,
    );
    assert_eq!(run.result["exit_code"], 0, "{}", run.describe());
    let reply = run
        .events()
        .into_iter()
        .find(|e| e["object"] == "chat.completion")
        .unwrap_or_else(|| panic!("no chat completion\n{}", run.describe()));
    assert_eq!(
        reply["choices"][0]["message"]["content"],
        "hello from fakellm",
        "{}",
        run.describe()
    );
    let calls = run.requests_to("/v1/chat/completions");
    assert!(!calls.is_empty(), "{}", run.describe());
    assert!(
        calls
            .iter()
            .all(|c| c["headers"]["authorization"] == "Bearer test-key"),
        "{}",
        run.describe()
    );
}
