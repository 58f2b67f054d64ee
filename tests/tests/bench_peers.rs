//! `bench peers` without the peers: its arguments are checked, a peer that is not installed
//! becomes a "not installed" row (the run still succeeds), and `scripts/install-peers.sh
//! --print-dir` names the cache without installing anything. No network, no measurement: the
//! benchmark itself is run by hand (BENCHMARKS.md).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Command, Output};

use agentbox_tests::harness::workspace_root;

fn bench(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_bench"))
        .args(args)
        .env_remove("AGENTBOX_PEERS_DIR")
        .output()
        .unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn peers_not_installed_are_rows_not_crashes() {
    let empty = tempfile::tempdir().unwrap();
    let out = bench(&[
        "peers",
        "--quick",
        "--only",
        "llms,ccr,litellm",
        "--peers-dir",
        empty.path().to_str().unwrap(),
    ]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for label in [
        "@musistudio/llms 1.0.53",
        "claude-code-router 2.0.0",
        "LiteLLM 1.108.7",
    ] {
        let row = stdout
            .lines()
            .find(|l| l.starts_with(&format!("| {label}")))
            .unwrap_or_else(|| panic!("no row for {label}:\n{stdout}"));
        assert!(row.contains("**not installed**"), "{row}");
        assert!(row.contains("scripts/install-peers.sh"), "{row}");
    }
    // Nothing was measured, so no tool was started: the bridge was not asked for.
    assert!(!stdout.contains("| agentbox-bridge"), "{stdout}");
    assert!(stderr.contains("not installed"), "{stderr}");
}

#[test]
fn peers_arguments_are_checked() {
    let out = bench(&["peers", "--only", "bridge,nonsense"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("nonsense"),
        "{}",
        text(&out.stderr)
    );

    let out = bench(&["peers", "--no-such-flag"]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));

    let out = bench(&["peers", "--help"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for flag in ["--quick", "--only", "--peers-dir", "--bin-dir"] {
        assert!(text(&out.stdout).contains(flag), "{}", text(&out.stdout));
    }
}

#[test]
fn install_peers_print_dir_installs_nothing() {
    let cache = tempfile::tempdir().unwrap();
    let script = workspace_root().join("scripts/install-peers.sh");
    let out = Command::new(&script)
        .arg("--print-dir")
        .env("AGENTBOX_PEERS_CACHE", cache.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let dir = text(&out.stdout);
    let dir = std::path::Path::new(dir.trim());
    assert_eq!(dir.parent(), Some(cache.path()), "{}", dir.display());
    assert!(!dir.exists(), "--print-dir created {}", dir.display());
    assert_eq!(std::fs::read_dir(cache.path()).unwrap().count(), 0);

    let out = Command::new(&script)
        .arg("--bogus")
        .env("AGENTBOX_PEERS_CACHE", cache.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out.stderr));
}
