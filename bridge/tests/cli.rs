//! The `agentbox-bridge` binary's start-up contract: a bad config or a missing token exits 78
//! (`EX_CONFIG`) with a message naming the problem, before anything listens. (Its HTTP
//! behaviour is tested against fakellm in `tests/tests/bridge.rs`.)

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn bridge(config: &str, env: &[(&str, &str)]) -> std::process::Output {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agentbox.toml");
    std::fs::write(&path, config).unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_agentbox-bridge"));
    cmd.arg("--config")
        .arg(&path)
        .env_clear()
        .env("AGENTBOX_DATA", dir.path());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

#[test]
fn unknown_config_key_exits_ex_config() {
    let out = bridge(
        "[bridge]\nlisten_on = \"127.0.0.1:0\"\n",
        &[("AGENTBOX_BRIDGE_TOKEN", "t")],
    );
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("bridge.listen_on"));
}

#[test]
fn missing_token_exits_ex_config() {
    let out = bridge(
        "[bridge]\nlisten = \"127.0.0.1:0\"\ntoken_env = \"MY_TOKEN\"\n",
        &[],
    );
    assert_eq!(out.status.code(), Some(78));
    assert!(String::from_utf8_lossy(&out.stderr).contains("MY_TOKEN"));
    assert!(out.stdout.is_empty(), "nothing may listen");
}
