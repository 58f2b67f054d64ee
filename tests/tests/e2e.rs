//! The whole path, every part real: the launcher (root) snapshots a repository and starts the
//! real Claude Code in a bubblewrap sandbox as the agent uid; the agent reaches its model only
//! through `/run/gw/llm.sock`, a task socket of the real gateway (running as the service user,
//! sharing the data dir with the launcher), which forwards to fakellm. The scripted agent edits
//! a file and plants hooks and git config in its workspace; `deliver` then brings
//! `agent/<tid>` into the source repository on top of the snapshot commit, and nothing the
//! agent planted ever runs on the host.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use agentbox_api::LauncherClient;
use agentbox_api::gateway::{Budget, OpenTask};
use agentbox_api::launcher::{AgentRequest, DeliverRequest, RunState, SnapshotRequest};
use agentbox_policy::id::Tid;
use agentbox_tests::harness::launcher::{chown_tree, git_with};
use agentbox_tests::harness::{
    FakeLlm, GatewayProcess, LauncherProcess, claude_print_cmd, readable_client, stream_json_result,
};
use serde_json::json;

/// The service user's uid/gid for this test (no passwd entry needed: `--service-uid`).
const SERVICE: u32 = 64020;
const TOKEN: &str = "e2e-task-token-0123456789";

fn git(dir: &Path, args: &[&str]) -> String {
    // The repository belongs to the service user; the test reads it as root.
    git_with(
        dir,
        &[
            "safe.directory=*",
            "user.name=t",
            "user.email=t@example.com",
        ],
        args,
    )
}

#[tokio::test]
async fn claude_in_the_sandbox_through_the_gateway_delivers_its_change() {
    let base = tempfile::Builder::new().prefix("e2e-").tempdir().unwrap();
    std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let sentinel = base.path().join("SENTINEL");

    // A source repository owned by the service user, with one commit.
    let repos = base.path().join("repos");
    let repo = repos.join("proj");
    std::fs::create_dir_all(&repo).unwrap();
    git(&repo, &["init", "--quiet", "--initial-branch=main"]);
    std::fs::write(repo.join("README.md"), "hello\n").unwrap();
    git(&repo, &["add", "README.md"]);
    git(&repo, &["commit", "--quiet", "-m", "initial"]);
    let base_sha = git(&repo, &["rev-parse", "HEAD"]);
    chown_tree(&repos, SERVICE);

    // The model: read, edit, plant hooks and config with Bash, then finish.
    let plant = format!(
        "mkdir -p .git/hooks && for h in pre-commit post-commit post-checkout reference-transaction; do \
         printf '#!/bin/sh\\ntouch {s}\\n' > .git/hooks/$h && chmod +x .git/hooks/$h; done && \
         printf '[core]\\n\\tfsmonitor = touch {s}\\n\\thooksPath = .git/hooks\\n[filter \"evil\"]\\n\\tclean = touch {s}\\n\\tsmudge = touch {s}\\n' >> .git/config && \
         printf '* filter=evil\\n' > .gitattributes && echo planted",
        s = sentinel.display()
    );
    let fake = FakeLlm::start(
        env!("CARGO_BIN_EXE_fakellm").as_ref(),
        &json!({
            "rules": [{"match": {"has_tools": false}, "text": "ok"}],
            "steps": [
                {"match": {"has_tools": true},
                 "tool_calls": [{"name": "Read", "input": {"file_path": "/workspace/README.md"}}],
                 "usage": {"input_tokens": 1000, "output_tokens": 10, "cache_creation_input_tokens": 500}},
                {"match": {"has_tools": true, "body_contains": "tool_result"},
                 "tool_calls": [{"name": "Edit", "input": {"file_path": "/workspace/README.md",
                                 "old_string": "hello", "new_string": "hello, edited by the agent"}}],
                 "usage": {"input_tokens": 1100, "output_tokens": 20, "cache_read_input_tokens": 500}},
                {"match": {"has_tools": true, "body_contains": "tool_result"},
                 "tool_calls": [{"name": "Bash", "input": {"command": plant, "description": "plant hooks"}}],
                 "usage": {"input_tokens": 1200, "output_tokens": 30, "cache_read_input_tokens": 500}},
                {"match": {"has_tools": true, "body_contains": "tool_result"},
                 "text": "done",
                 "usage": {"input_tokens": 1300, "output_tokens": 2, "cache_read_input_tokens": 500}}
            ]
        }),
    )
    .unwrap();

    // The gateway, as the service user; its data dir is the launcher's too.
    let model_toml =
        "[models.local]\nbackend = \"ollama\"\nupstream_model = \"qwen-upstream\"\n".to_owned();
    let gw = GatewayProcess::start_as(
        &format!(
            "[gateway]\nollama_url = \"{}\"\n{model_toml}",
            fake.base_url()
        ),
        &[],
        Some((SERVICE, SERVICE)),
    )
    .unwrap();
    let data = gw.data_dir();

    // The launcher, as root, on the same data dir.
    let claude = readable_client("claude", base.path()).unwrap_or_else(|e| panic!("{e}"));
    let launcher = LauncherProcess::start_on(
        Some(&data),
        &format!(
            "[launcher]\nclaude_bin = {claude:?}\nrepo_roots = [{repos:?}]\nvenv_root = \"/nonexistent/venvs\"\n{model_toml}"
        ),
        SERVICE,
    )
    .unwrap();
    let lsock = launcher.socket();

    // The gateway still works with the launcher's layout in place (run/ and state/ shared).
    let tid = "e2e1";
    let launcher_api = LauncherClient::new(&lsock);
    let snap = launcher_api
        .snapshot(&SnapshotRequest {
            tid: tid.into(),
            path: repo.display().to_string(),
            git_ref: None,
        })
        .await
        .unwrap_or_else(|e| panic!("{e}\n{}", launcher.describe()));
    assert_eq!(snap.sha, base_sha);
    let opened = gw
        .client()
        .open_task(&OpenTask {
            tid: tid.into(),
            model: "local".into(),
            token: TOKEN.into(),
            budget: Budget {
                tokens: Some(1_000_000),
                usd: None,
            },
        })
        .await;
    assert!(opened.is_ok(), "{opened:?}\n{}", gw.stderr());

    let started = launcher_api
        .start_agent(&AgentRequest {
            tid: tid.into(),
            model: "local".into(),
            cmd: claude_print_cmd(),
            stdin: Some("Edit README.md.".into()),
            env: Default::default(),
            venv: None,
            timeout_s: 300,
            token: Some(TOKEN.into()),
        })
        .await;
    assert!(started.is_ok(), "{started:?}\n{}", launcher.describe());
    let v = launcher_api
        .wait_agent(&Tid::parse(tid).unwrap())
        .await
        .unwrap();
    let log = fake.requests().unwrap();
    let diag = || {
        format!(
            "{v:#?}\n--- fakellm ---\n{}\n--- gateway ---\n{}\n--- launcher ---\n{}",
            log.iter()
                .map(|r| format!("{} {} {}", r["path"], r["served_by"], r["body"]["model"]))
                .collect::<Vec<_>>()
                .join("\n"),
            gw.stderr(),
            launcher.describe()
        )
    };
    assert_eq!(v.state, RunState::Exited, "{}", diag());
    assert_eq!(v.exit_code, Some(0), "{}", diag());
    let result =
        stream_json_result(&v.stdout).unwrap_or_else(|| panic!("no result event: {}", diag()));
    assert_eq!(result["result"], "done", "{}", diag());
    let bash_result = v.stdout.contains("planted");
    assert!(
        bash_result,
        "the agent's Bash tool ran inside the sandbox: {}",
        diag()
    );
    let commit = v
        .result_commit
        .clone()
        .unwrap_or_else(|| panic!("no result commit: {}", diag()));

    // Everything the agent sent went through the gateway, sanitized and metered.
    assert_eq!(log.len(), 4, "{}", diag());
    for r in &log {
        assert_eq!(r["body"]["model"], "qwen-upstream");
        assert!(r["body"].get("context_management").is_none());
        assert!(
            !r["headers"]
                .as_object()
                .unwrap()
                .contains_key("anthropic-beta")
        );
        assert!(!r.to_string().contains(TOKEN));
    }
    let view = gw.client().task(&Tid::parse(tid).unwrap()).await.unwrap();
    assert_eq!(
        view.usage.input_tokens,
        1000 + 1100 + 1200 + 1300,
        "{view:?}"
    );
    assert_eq!(view.usage.output_tokens, 10 + 20 + 30 + 2);
    assert_eq!(view.usage.cache_read_input_tokens, 1500);
    assert_eq!(view.usage.cache_creation_input_tokens, 500);

    // Deliver: agent/<tid> lands in the repo, on top of the snapshot, with the edit; the repo's
    // HEAD and work tree are untouched; nothing planted ran.
    let branch = format!("agent/{tid}");
    let d = launcher_api
        .deliver(&DeliverRequest {
            tid: tid.into(),
            path: repo.display().to_string(),
            branch: branch.clone(),
        })
        .await;
    assert!(d.is_ok(), "{d:?}\n{}", launcher.describe());
    let delivered = git(&repo, &["rev-parse", &format!("refs/heads/{branch}")]);
    assert_eq!(delivered, commit);
    assert_eq!(
        git(&repo, &["rev-parse", &format!("{branch}^")]),
        base_sha,
        "parent is the snapshot commit"
    );
    assert_eq!(
        git(&repo, &["show", &format!("{branch}:README.md")]),
        "hello, edited by the agent"
    );
    assert_eq!(
        git(&repo, &["rev-parse", "HEAD"]),
        base_sha,
        "HEAD untouched"
    );
    assert_eq!(git(&repo, &["symbolic-ref", "HEAD"]), "refs/heads/main");
    assert_eq!(
        std::fs::read_to_string(repo.join("README.md")).unwrap(),
        "hello\n",
        "work tree untouched"
    );
    let tree = git(&repo, &["ls-tree", "-r", "--name-only", &branch]);
    assert!(
        !tree.lines().any(|p| p.starts_with(".git/")),
        "no .git content delivered: {tree}"
    );
    assert!(
        !sentinel.exists(),
        "a hook or config the agent planted ran on the host"
    );
    // The workspace really carried the planted hooks (so the check above means something).
    let ws_hook = data
        .join("tasks")
        .join(tid)
        .join("workspace/.git/hooks/post-commit");
    assert!(ws_hook.exists(), "the agent planted {}", ws_hook.display());
}
