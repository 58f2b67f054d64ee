//! `agentbox config check` as an operator runs it: the real binary on real files.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::Command;

fn agentbox() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_agentbox"));
    c.env_remove("AGENTBOX_CONFIG").env_remove("AGENTBOX_DATA");
    c
}

fn example() -> String {
    format!(
        "{}/../packaging/agentbox.example.toml",
        env!("CARGO_MANIFEST_DIR")
    )
}

#[test]
fn example_config_checks_ok() {
    let out = agentbox()
        .args(["config", "check", "--config", &example()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("models: 5"), "{text}");
    assert!(text.contains("qwen-coder"), "{text}");
    assert!(
        text.contains("rollout          router  (the caller's) -> http://127.0.0.1:8000/v1"),
        "{text}"
    );
}

#[test]
fn json_output_and_env_override() {
    let out = agentbox()
        .args(["config", "check", "--json"])
        .env("AGENTBOX_CONFIG", example())
        .env("AGENTBOX_DATA", "/tmp/agentbox-test-data")
        .output()
        .unwrap();
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["ok"], true);
    assert_eq!(v["data_dir"], "/tmp/agentbox-test-data");
    assert_eq!(v["models"].as_array().unwrap().len(), 5);
}

#[test]
fn unknown_key_fails_with_ex_config_and_names_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("agentbox.toml");
    std::fs::write(&path, "[launcher.limits]\nmemory_gb = 8\n").unwrap();
    let out = agentbox()
        .args(["config", "check", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("launcher.limits.memory_gb"), "{err}");

    let out = agentbox()
        .args(["config", "check", "--json", "--config"])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["key"], "launcher.limits.memory_gb");
}

#[test]
fn missing_file_and_bad_usage() {
    let out = agentbox()
        .args(["config", "check", "--config", "/nonexistent.toml"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(78));
    let out = agentbox().args(["frobnicate"]).output().unwrap();
    assert_eq!(out.status.code(), Some(2));
}
