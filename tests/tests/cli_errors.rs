//! Every error `agentbox` can hit prints one line saying what happened and what to do, and
//! exits with its documented code (`agentbox --help`): unknown model 64, bad repository 65,
//! no such task 66, daemon not running 69, permission denied on the socket 77, and for a run
//! the agent's fate: budget exhausted 3, timeout 4, OOM 5.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cli_common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Output;

use agentbox_tests::harness::LauncherProcess;
use cli_common::{SERVICE, Stack, cli_with, write_script};
use serde_json::json;

/// The one line on stderr, which must start with `agentbox: ` and contain every `words`.
fn one_line(out: &Output, code: i32, words: &[&str]) -> String {
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(out.status.code(), Some(code), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one line: {err}");
    assert!(lines[0].starts_with("agentbox: "), "{err}");
    for w in words {
        assert!(lines[0].contains(w), "{w:?} in {err}");
    }
    err
}

/// A config for a CLI with no daemons: `data_dir` in `dir`, one model.
fn lone_config(dir: &Path) -> std::path::PathBuf {
    let config = dir.join("agentbox.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = {:?}\n[models.gpt]\nbackend = \"ollama\"\nupstream_model = \"x\"\n",
            dir.join("data")
        ),
    )
    .unwrap();
    config
}

#[test]
fn help_documents_the_exit_codes() {
    let dir = tempfile::tempdir().unwrap();
    for args in [&["--help"][..], &["run", "--help"][..]] {
        let out = cli_with(&lone_config(dir.path()), args).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        for code in ["64 ", "65 ", "69 ", "77 ", "3 ", "130 "] {
            assert!(text.contains(&format!("  {code}")), "{code} in {text}");
        }
    }
}

/// `agentbox ARGS...` with [`lone_config`], to its end.
fn lone(args: &[&str]) -> Output {
    let dir = tempfile::tempdir().unwrap();
    cli_with(&lone_config(dir.path()), args).output().unwrap()
}

#[test]
fn unknown_model_is_64_and_names_the_catalogue() {
    let out = lone(&["run", "--repo", "/tmp", "--model", "nope", "hi"]);
    one_line(&out, 64, &["unknown model \"nope\"", "gpt", "config check"]);
}

#[test]
fn missing_repository_is_65() {
    let out = lone(&["run", "--repo", "/nonexistent/repo", "--model", "gpt", "hi"]);
    one_line(&out, 65, &["/nonexistent/repo", "repo_roots"]);
}

#[test]
fn daemon_not_running_is_69_and_says_how_to_start_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = lone_config(dir.path());
    let out = cli_with(&config, &["run", "--repo", "/tmp", "--model", "gpt", "hi"])
        .output()
        .unwrap();
    one_line(
        &out,
        69,
        &["launcher is not running", "launcher.sock", "agentbox up"],
    );
    // --json: the same, as one object on stdout too.
    let out = cli_with(
        &config,
        &["run", "--json", "--repo", "/tmp", "--model", "gpt", "hi"],
    )
    .output()
    .unwrap();
    one_line(&out, 69, &["not running"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["exit_code"], 69);
    // status and the other verbs say the same.
    for args in [&["logs", "t1"][..], &["stop", "t1"][..]] {
        let out = cli_with(&config, args).output().unwrap();
        one_line(&out, 69, &["not running"]);
    }
    let out = cli_with(&config, &["status"]).output().unwrap();
    assert_eq!(out.status.code(), Some(69));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("launcher  the launcher is not running"),
        "{text}"
    );
    assert!(
        text.contains("gateway   the gateway is not running"),
        "{text}"
    );
}

#[test]
fn pool_not_running_is_69() {
    for args in [&["pool", "status"][..], &["pool", "status", "--json"][..]] {
        let out = lone(args);
        one_line(
            &out,
            69,
            &[
                "pool is not running",
                "pool.sock",
                "systemctl start agentbox-pool",
            ],
        );
    }
}

#[test]
fn permission_denied_on_the_socket_is_77() {
    // A real launcher; the CLI runs as `nobody`, who may not reach run/launcher.sock.
    let launcher = LauncherProcess::start("", SERVICE).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let config = dir.path().join("agentbox.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = {:?}\n[models.gpt]\nbackend = \"ollama\"\nupstream_model = \"x\"\n",
            launcher.data_dir()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&config, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = cli_with(&config, &["run", "--repo", "/tmp", "--model", "gpt", "hi"])
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    one_line(
        &out,
        77,
        &["permission denied", "launcher.sock", "service user"],
    );
}

#[tokio::test]
async fn refusals_by_the_daemons_are_65_and_66() {
    let stack = Stack::start(&json!({}), "", 64550);
    // A repository outside launcher.repo_roots: the launcher refuses it.
    let outside = stack.base.path().join("outside");
    std::fs::create_dir_all(&outside).unwrap();
    let out = stack
        .cli(&[
            "run",
            "--repo",
            outside.to_str().unwrap(),
            "--model",
            "gpt",
            "hi",
        ])
        .output()
        .unwrap();
    one_line(&out, 65, &["repository", "repo_roots"]);
    // Unknown tasks.
    for args in [&["logs", "nosuch"][..], &["stop", "nosuch"][..]] {
        let out = stack.cli(args).output().unwrap();
        one_line(&out, 66, &["nosuch", "agentbox status"]);
    }
    // A bad task id never reaches a daemon.
    let out = stack.cli(&["logs", "Bad_Id"]).output().unwrap();
    one_line(&out, 2, &["Bad_Id"]);
}

fn last_line(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr)
        .lines()
        .last()
        .unwrap_or_default()
        .to_owned()
}

#[tokio::test]
async fn budget_exhausted_is_3() {
    // The agent wants three turns; the budget is spent after two (the second is admitted on
    // its estimate and overshoots, as the ledger allows), so the gateway answers the third
    // with 403 and Claude Code stops.
    let bash = |n: u32| {
        json!({"match": {"has_tools": true},
               "tool_calls": [{"name": "Bash", "input": {
                   "command": format!("echo {n} > /workspace/b{n}.txt"), "description": "write"}}],
               "usage": {"input_tokens": 1000, "output_tokens": 20}})
    };
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "ok"}],
        "steps": [bash(1), bash(2), bash(3), {"match": {"has_tools": true}, "text": "done"}]
    });
    let stack = Stack::start(&script, "", 64520);
    let (out, diag) = stack.run(&["--budget-tokens", "1500", "--json", "Do the task."]);
    assert_eq!(out.status.code(), Some(3), "{diag}");
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["outcome"], "budget_exhausted", "{diag}");
    assert_eq!(s["budget"]["tokens"], 1500, "{diag}");
    let last = last_line(&out);
    assert!(
        last.starts_with("agentbox: ")
            && last.contains("budget is exhausted")
            && last.contains("--budget-tokens"),
        "{diag}"
    );
}

#[tokio::test]
async fn timeout_is_4() {
    // The second turn hangs in the model far past the run's timeout.
    let stack = Stack::start(&write_script("t.txt", "t", 120_000), "", 64530);
    let (out, diag) = stack.run(&["--timeout", "8", "--json", "Do the task."]);
    assert_eq!(out.status.code(), Some(4), "{diag}");
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["outcome"], "timed_out", "{diag}");
    assert_eq!(s["timed_out"], true, "{diag}");
    let last = last_line(&out);
    assert!(
        last.contains("timeout") && last.contains("--timeout"),
        "{diag}"
    );
}

#[tokio::test]
async fn oom_is_5() {
    // The agent's shell command fills memory past the sandbox's limit.
    let script = json!({
        "rules": [{"match": {"has_tools": false}, "text": "ok"}],
        "steps": [
            {"match": {"has_tools": true},
             "tool_calls": [{"name": "Bash", "input": {
                 "command": "head -c 3000m /dev/zero | tail -c 2000m > /dev/null; echo after",
                 "description": "use memory"}}]},
            {"match": {"has_tools": true, "body_contains": "tool_call_id"}, "text": "done"}
        ]
    });
    let stack = Stack::start(&script, "[launcher.limits]\nmemory_mb = 768\n", 64540);
    let (out, diag) = stack.run(&["--json", "Do the task."]);
    assert_eq!(out.status.code(), Some(5), "{diag}");
    let s: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(s["outcome"], "oom_killed", "{diag}");
    assert_eq!(s["oom_killed"], true, "{diag}");
    assert!(last_line(&out).contains("memory"), "{diag}");
}
