//! The real Claude Code inside the launcher's real sandbox (bwrap as the agent uid, seccomp,
//! cgroup), reaching its model only through `/run/gw/llm.sock`: here fakellm listens on
//! `sockets/<tid>/llm.sock` in place of the gateway, which proves the sandbox side of the
//! end-to-end path (the gateway's own test covers the rest).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use agentbox_api::LauncherClient;
use agentbox_api::launcher::{AgentRequest, RunState};
use agentbox_policy::id::Tid;
use agentbox_tests::harness::launcher::{SERVICE_UID, chown, cmdlines_containing, temp_dir};
use agentbox_tests::harness::{
    LauncherProcess, Service, claude_print_cmd, readable_client, stream_json_result,
};
use serde_json::{Value, json};

/// The prompt, passed in the request's `stdin` (never in `cmd`, which `ps` shows).
const PROMPT: &str = "Create hello.txt in the current directory (prompt-marker-7f3a).";

#[tokio::test]
async fn real_claude_code_writes_a_file_from_inside_the_sandbox() {
    let base = temp_dir("launcher-claude-", 0o755);
    let claude = readable_client("claude", base.path()).unwrap_or_else(|e| panic!("{e}"));
    let launcher = LauncherProcess::start(
        &format!(
            "[launcher]\nclaude_bin = {claude:?}\nvenv_root = \"/nonexistent/venvs\"\n\
             [models.sonnet]\nbackend = \"ollama\"\nupstream_model = \"x\"\n"
        ),
        SERVICE_UID,
    )
    .unwrap();
    let socket = launcher.socket();
    let data = launcher.data_dir();

    let tid = "claude1";
    let ws = launcher.workspace(tid).unwrap();
    let gw = data.join("sockets").join(tid);
    std::fs::create_dir_all(&gw).unwrap();
    chown(&gw, SERVICE_UID);

    // fakellm plays the gateway on the task's socket.
    let content = "hello from inside the sandbox\n";
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "ok"}],
        "steps": [
            {"match": {"has_tools": true},
             "tool_calls": [{"id": "toolu_1", "name": "Write",
                             "input": {"file_path": "/workspace/hello.txt", "content": content}}]},
            {"match": {"has_tools": true, "body_contains": "tool_result"}, "text": "done"}
        ]
    });
    let script_path = base.path().join("script.json");
    std::fs::write(&script_path, script.to_string()).unwrap();
    let log = base.path().join("requests.jsonl");
    let llm_sock = gw.join("llm.sock");
    let mut fake = Command::new(env!("CARGO_BIN_EXE_fakellm"));
    fake.arg("--script")
        .arg(&script_path)
        .arg("--log")
        .arg(&log)
        .arg("--unix")
        .arg(&llm_sock);
    let (_fake, _) = Service::start("fakellm", fake, Duration::from_secs(20), |l| {
        l.strip_prefix("listening on ").map(str::to_owned)
    })
    .unwrap();
    std::fs::set_permissions(&llm_sock, std::fs::Permissions::from_mode(0o666)).unwrap();

    let client = LauncherClient::new(&socket);
    let agent = AgentRequest {
        tid: tid.into(),
        model: "sonnet".into(),
        cmd: claude_print_cmd(),
        stdin: Some(PROMPT.into()),
        env: Default::default(),
        venv: None,
        timeout_s: 300,
        token: Some("test-token".into()),
    };
    // While the agent runs, no process on the host shows the prompt in its command line.
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let watcher = {
        let done = std::sync::Arc::clone(&done);
        std::thread::spawn(move || {
            let mut seen = Vec::new();
            while !done.load(std::sync::atomic::Ordering::SeqCst) {
                seen.extend(cmdlines_containing("prompt-marker-7f3a"));
                std::thread::sleep(Duration::from_millis(20));
            }
            seen
        })
    };
    let started = client.start_agent(&agent).await;
    assert!(started.is_ok(), "{started:?}\n{}", launcher.describe());
    let v = client.wait_agent(&Tid::parse(tid).unwrap()).await.unwrap();
    done.store(true, std::sync::atomic::Ordering::SeqCst);
    let leaked = watcher.join().unwrap();
    assert!(
        leaked.is_empty(),
        "the prompt in a command line: {leaked:?}"
    );
    let requests = std::fs::read_to_string(&log).unwrap_or_default();
    let diag = format!(
        "{v:#?}\n--- fakellm log ---\n{requests}\n{}",
        launcher.describe()
    );
    assert_eq!(v.state, RunState::Exited, "{diag}");
    assert_eq!(v.exit_code, Some(0), "{diag}");
    let result = stream_json_result(&v.stdout).unwrap_or_else(|| panic!("no result event: {diag}"));
    assert_eq!(result["result"], "done", "{diag}");
    assert_eq!(
        std::fs::read_to_string(ws.join("hello.txt")).unwrap(),
        content
    );
    use std::os::unix::fs::MetadataExt;
    assert_eq!(
        std::fs::metadata(ws.join("hello.txt")).unwrap().uid(),
        SERVICE_UID,
        "handed back"
    );
    // Claude Code read the prompt from its stdin and sent it to the model.
    assert!(requests.contains("prompt-marker-7f3a"), "{diag}");
    let first: Value = serde_json::from_str(requests.lines().next().unwrap()).unwrap();
    assert_eq!(
        first["headers"]["authorization"], "Bearer test-token",
        "{diag}"
    );
}
