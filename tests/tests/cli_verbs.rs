//! The verbs beside `run`, on the real daemons: `status` (table and `--json`), `logs`
//! (`--follow` ends with the run), `check`, `deliver` (after `run --keep`), `stop`,
//! `backends`, and `up` (three daemons in the foreground; Ctrl-C stops all three).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cli_common;

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

use agentbox_tests::harness::{readable_client, workspace_bin};
use cli_common::{SERVICE, Stack, cli_with, git, interrupt, status_task, writes};
use serde_json::Value;

fn text(out: &std::process::Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn status_logs_check_deliver_stop_and_backends() {
    let stack = Stack::start(
        &writes(&[("kept.txt", "kept", 0), ("slow.txt", "slow", 4_000)]),
        "",
        64560,
    );
    let repo = stack.repo.display().to_string();

    // run --keep: nothing delivered yet.
    let (out, diag) = stack.run(&[
        "--tid",
        "cli-v",
        "--keep",
        "--budget-usd",
        "1",
        "Write kept.txt.",
    ]);
    assert!(out.status.success(), "{diag}");
    assert!(text(&out).contains("branch    not delivered"), "{diag}");
    assert!(
        git(&stack.repo, &["branch", "--list", "agent/*"]).is_empty(),
        "{diag}"
    );

    // status: the task with its usage, the host, as a table and as JSON.
    let out = stack.cli(&["status"]).output().unwrap();
    let table = text(&out);
    assert!(out.status.success(), "{table}");
    assert!(table.contains("launcher  running"), "{table}");
    assert!(table.contains("host ready"), "{table}");
    assert!(table.contains("gateway   running"), "{table}");
    let row = table.lines().find(|l| l.starts_with("cli-v")).unwrap();
    assert!(row.contains("gpt") && row.contains("closed"), "{table}");
    let out = stack.cli(&["status", "--json"]).output().unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["launcher"]["ready"], true, "{v}");
    let task = status_task(&v, "cli-v");
    assert!(task["usage"]["requests"].as_u64().unwrap() >= 2, "{v}");
    assert_eq!(task["budget"]["usd"], 1.0, "{v}");

    // logs: Claude Code's stream-json, ending with its result.
    let out = stack.cli(&["logs", "cli-v"]).output().unwrap();
    assert!(out.status.success());
    assert!(text(&out).contains("\"type\":\"result\""), "{}", text(&out));

    // check: a command in a sandbox on the workspace; its output and exit status.
    let out = stack
        .cli(&["check", "cli-v", "--", "cat", "kept.txt"])
        .output()
        .unwrap();
    assert_eq!(
        text(&out),
        "kept",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success());
    let out = stack
        .cli(&["check", "cli-v", "--", "sh", "-c", "exit 3"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));

    // deliver: the kept branch lands.
    let out = stack
        .cli(&["deliver", "cli-v", "--repo", &repo])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text(&out).starts_with("agent/cli-v -> "), "{}", text(&out));
    assert_eq!(git(&stack.repo, &["show", "agent/cli-v:kept.txt"]), "kept");

    // logs --follow on a run in progress: prints as it goes and ends with the run.
    let mut running = stack
        .run_command(&["--tid", "cli-f", "Write slow.txt."])
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let out = stack.cli(&["status", "--json"]).output().unwrap();
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let agents = v["launcher"]["agents"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if agents.iter().any(|a| a["tid"] == "cli-f") {
            break;
        }
        assert!(Instant::now() < deadline, "cli-f never ran: {v}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = stack.cli(&["logs", "--follow", "cli-f"]).output().unwrap();
    assert!(out.status.success());
    assert!(text(&out).contains("\"type\":\"result\""), "{}", text(&out));
    assert!(running.wait().unwrap().success());

    // stop: a finished task is forgotten by the launcher, its gateway task stays closed.
    let out = stack.cli(&["stop", "cli-v"]).output().unwrap();
    let said = text(&out);
    assert!(
        out.status.success(),
        "{said}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(said.contains("gateway task cli-v: closed"), "{said}");
    let out = stack.cli(&["logs", "cli-v"]).output().unwrap();
    assert_eq!(out.status.code(), Some(66), "forgotten");

    // backends: nothing to stop; gpt is not a vLLM model.
    let out = stack.cli(&["backends", "stop"]).output().unwrap();
    assert!(out.status.success());
    assert_eq!(text(&out), "no backend was running\n");
    let out = stack.cli(&["backends", "start", "gpt"]).output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(65),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn up_runs_the_three_daemons_until_ctrl_c() {
    let base = tempfile::Builder::new()
        .prefix("cli-up-")
        .tempdir()
        .unwrap();
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let claude = readable_client("claude", base.path()).unwrap();
    let data = base.path().join("data");
    let config = base.path().join("agentbox.toml");
    std::fs::write(
        &config,
        format!(
            "data_dir = {data:?}\nagent_uid = 64570\nagent_gid = 64570\nagent_uid_count = 10\n\
             [launcher]\nclaude_bin = {claude:?}\nrepo_roots = [\"/nonexistent/repos\"]\n\
             venv_root = \"/nonexistent/venvs\"\n[bridge]\nlisten = \"127.0.0.1:0\"\n\
             [models.local]\nbackend = \"ollama\"\nupstream_model = \"x\"\n"
        ),
    )
    .unwrap();
    let bin_dir = workspace_bin("agentbox-cli", "agentbox")
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let cgroup = format!("agentbox-cli-up-{}", std::process::id());
    let mut up = cli_with(
        &config,
        &[
            "up",
            "--bin-dir",
            bin_dir.to_str().unwrap(),
            "--service-uid",
            &SERVICE.to_string(),
            "--cgroup-parent",
            &cgroup,
        ],
    )
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let out = cli_with(&config, &["status"]).output().unwrap();
        if out.status.success() {
            let table = text(&out);
            assert!(table.contains("launcher  running"), "{table}");
            assert!(table.contains("gateway   running"), "{table}");
            break;
        }
        assert!(
            Instant::now() < deadline && up.try_wait().unwrap().is_none(),
            "agentbox up did not come up: {}",
            text(&out)
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let daemons = |pat: &str| -> Vec<String> {
        std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| std::fs::read(e.path().join("cmdline")).ok())
            .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
            .filter(|c| c.contains(pat) && !c.contains(" up "))
            .collect()
    };
    let config_s = config.display().to_string();
    assert_eq!(daemons(&config_s).len(), 3, "{:?}", daemons(&config_s));

    let status = interrupt(&mut up, Duration::from_secs(30));
    let err = std::io::read_to_string(up.stderr.take().unwrap()).unwrap();
    assert!(status.success(), "{status:?}: {err}");
    assert!(err.contains("Ctrl-C stops all three"), "{err}");
    assert_eq!(daemons(&config_s), Vec::<String>::new(), "{err}");
    let out = cli_with(&config, &["status"]).output().unwrap();
    assert_eq!(out.status.code(), Some(69));
    for c in ["memory", "pids", "cpu", "freezer", ""] {
        let _ = std::fs::remove_dir(std::path::Path::new("/sys/fs/cgroup").join(c).join(&cgroup));
    }
}
