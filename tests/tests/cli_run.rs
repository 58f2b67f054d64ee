//! `agentbox run` end to end, as an operator runs it: the real CLI binary drives the real
//! launcher (Claude Code in bwrap), gateway and bridge, with fakellm as an `openai` model
//! behind the bridge. The branch lands in the repository and the summary (text and `--json`)
//! shows the budget; Ctrl-C in the middle leaves nothing running, nothing owned by an agent
//! uid, and the gateway task closed.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cli_common;

use std::io::{BufRead, BufReader};
use std::time::Duration;

use agentbox_api::gateway::TaskState;
use agentbox_policy::id::Tid;
use cli_common::{Stack, git, interrupt, write_script, writes};
use serde_json::Value;

#[tokio::test]
async fn run_delivers_the_branch_and_the_summary_shows_the_budget() {
    // Two runs, one after the other: the script's steps for the second follow the first's.
    let stack = Stack::start(
        &writes(&[("fix1.txt", "fixed one", 0), ("fix2.txt", "fixed two", 0)]),
        "",
        64500,
    );

    // --json: one object on stdout.
    let (out, diag) = stack.run(&["--budget-tokens", "1000000", "--json", "Write fix1.txt."]);
    assert!(out.status.success(), "{diag}");
    let s: Value = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {diag}"));
    let tid = s["tid"].as_str().unwrap().to_owned();
    assert_eq!(s["outcome"], "succeeded", "{diag}");
    assert_eq!(s["exit_code"], 0, "{diag}");
    assert_eq!(s["branch"], format!("agent/{tid}"), "{diag}");
    assert_eq!(s["base_sha"], stack.base_sha.as_str());
    let total = s["usage"]["total_tokens"].as_u64().unwrap();
    // Two scripted turns: 1000 + 20 and 1100 + 5 + 200 cached, whatever side requests add.
    assert!(total >= 2325, "{diag}");
    assert!(s["usage"]["requests"].as_u64().unwrap() >= 2, "{diag}");
    assert!(s["usage"]["cost_usd"].as_f64().unwrap() > 0.0, "{diag}");
    assert_eq!(s["budget"]["tokens"], 1_000_000, "{diag}");
    assert_eq!(
        s["remaining"]["tokens"].as_u64().unwrap(),
        1_000_000 - total,
        "{diag}"
    );
    // The branch is in the repository: the agent's file on top of the snapshot.
    let branch = format!("agent/{tid}");
    assert_eq!(
        git(&stack.repo, &["show", &format!("{branch}:fix1.txt")]),
        "fixed one"
    );
    assert_eq!(
        git(&stack.repo, &["rev-parse", &format!("{branch}^")]),
        stack.base_sha
    );
    assert_eq!(s["commits"].as_array().unwrap().len(), 1, "{diag}");
    assert!(
        s["diffstat"].as_str().unwrap().contains("fix1.txt"),
        "{diag}"
    );
    assert_eq!(git(&stack.repo, &["rev-parse", "HEAD"]), stack.base_sha);
    // The prompt went on stdin, and the gateway task is closed.
    let view = stack
        .gateway
        .client()
        .task(&Tid::parse(&tid).unwrap())
        .await
        .unwrap();
    assert_eq!(view.state, TaskState::Closed);
    // Progress went to stderr as plain lines (not a terminal).
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("Claude Code runs in the sandbox"), "{diag}");
    assert!(err.contains("requests ·"), "{diag}");
    assert!(!err.contains('\r'), "no spinner without a terminal: {diag}");

    // Text: the summary people read, with the budget and what is left of it.
    let (out, diag) = stack.run(&[
        "--budget-tokens",
        "500000",
        "--tid",
        "cli-text",
        "Write fix2.txt.",
    ]);
    assert!(out.status.success(), "{diag}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("outcome   succeeded"), "{diag}");
    assert!(text.contains("branch    agent/cli-text -> "), "{diag}");
    assert!(text.contains("fix2.txt"), "diffstat: {diag}");
    let budget_line = text.lines().find(|l| l.starts_with("budget")).unwrap();
    assert!(
        budget_line.starts_with("budget    500,000 tokens: ")
            && budget_line.ends_with("tokens left"),
        "{diag}"
    );
    assert_eq!(
        git(&stack.repo, &["show", "agent/cli-text:fix2.txt"]),
        "fixed two"
    );
}

#[tokio::test]
async fn sigint_mid_run_stops_everything_and_closes_the_task() {
    // The second turn hangs in the model for two minutes: the agent is mid-run when Ctrl-C
    // comes, having already written a file as its agent uid.
    let stack = Stack::start(&write_script("half.txt", "half", 120_000), "", 64510);
    let mut child = stack
        .run_command(&["--tid", "cli-int", "Write half.txt."])
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let lines = std::thread::spawn(move || {
        BufReader::new(stderr)
            .lines()
            .map_while(Result::ok)
            .collect::<Vec<_>>()
    });
    stack.wait_for_steps(
        2,
        Duration::from_secs(120),
        &mut || child.try_wait().unwrap().is_none(),
        &|| stack.launcher.describe(),
    );
    assert!(
        !stack.agent_processes().is_empty(),
        "the agent runs as its own uid"
    );

    let status = interrupt(&mut child, Duration::from_secs(60));
    let stdout = std::io::read_to_string(child.stdout.take().unwrap()).unwrap();
    let err = lines.join().unwrap().join("\n");
    let diag = format!(
        "{stdout}\n--- stderr ---\n{err}\n--- launcher ---\n{}",
        stack.launcher.describe()
    );
    assert_eq!(status.code(), Some(130), "{diag}");
    assert!(stdout.contains("outcome   interrupted"), "{diag}");
    assert!(err.contains("stopping:"), "{diag}");

    // Nothing running, nothing the agent's, the task closed, no branch delivered.
    assert_eq!(stack.agent_processes(), Vec::<String>::new(), "{diag}");
    let task_dir = stack.gateway.data_dir().join("tasks/cli-int");
    let workspace = task_dir.join("workspace");
    assert!(
        workspace.join("half.txt").exists(),
        "the agent did write: {diag}"
    );
    assert_eq!(
        stack.agent_owned(&task_dir),
        Vec::<std::path::PathBuf>::new(),
        "{diag}"
    );
    let tid = Tid::parse("cli-int").unwrap();
    let view = stack.gateway.client().task(&tid).await.unwrap();
    assert_eq!(view.state, TaskState::Closed, "{diag}");
    let status = stack.launcher.client().status().await.unwrap();
    assert!(status.agents.is_empty(), "{status:?}");
    let branches = git(&stack.repo, &["branch", "--list", "agent/*"]);
    assert!(branches.is_empty(), "nothing delivered: {branches}");
}
