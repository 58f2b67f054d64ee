//! blackbox-server keeps each registration's runtime directory private from other local users.
//! It holds what guards the agent (OpenClaw's gateway token, Codex's config, Claude Code's
//! settings) and its logs (prompts and answers); every local user is an attacker. Run as root:
//! the attacker is uid 65534 (`setpriv`, no supplementary groups).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use agentbox_tests::harness::{BlackboxProcess, FakeLlm, Reply, claude_code_registration, scratch};
use serde_json::json;

const NOBODY: &str = "65534";

fn fakellm_bin() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_fakellm"))
}

/// Runs `argv` as uid/gid 65534 with no supplementary groups; true when it succeeded.
fn as_nobody(argv: &[&str]) -> bool {
    Command::new("setpriv")
        .args(["--reuid", NOBODY, "--regid", NOBODY, "--clear-groups", "--"])
        .args(argv)
        .output()
        .expect("setpriv")
        .status
        .success()
}

/// A root the server has to create itself, under a directory every user may traverse (as
/// `/tmp/blackbox_server`, the default, is).
fn open_parent() -> tempfile::TempDir {
    let t = scratch().unwrap();
    std::fs::set_permissions(t.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    t
}

/// fakellm, a server with `root` as its runtime root, and its answer to a Claude Code
/// registration.
async fn register_under(root: &Path) -> (FakeLlm, BlackboxProcess, Reply) {
    let fake = FakeLlm::start(fakellm_bin(), &json!({})).unwrap();
    let bb = BlackboxProcess::start(&[("BBS_RUNTIME_ROOT", root.to_str().unwrap())]).unwrap();
    let r = bb
        .post(
            "/v1/rollout/register",
            &claude_code_registration(&fake.base_url(), "sess-001", &json!({})),
        )
        .await;
    (fake, bb, r)
}

#[tokio::test]
async fn another_user_cannot_read_a_registration_s_runtime_dir() {
    let parent = open_parent();
    let root = parent.path().join("bbs");
    let (_fake, bb, r) = register_under(&root).await;
    assert_eq!(r.status, 200, "{r}\n{}", bb.describe());
    let runtime_dir = r.body["binding"]["runtime_dir"]
        .as_str()
        .unwrap()
        .to_owned();
    let settings = format!("{runtime_dir}/home/.claude/settings.json");
    assert!(Path::new(&settings).is_file(), "{settings} not written");

    // The control: the attacker can run commands and reach the parent.
    assert!(as_nobody(&["ls", parent.path().to_str().unwrap()]));
    for argv in [
        ["ls", root.to_str().unwrap()],
        ["ls", runtime_dir.as_str()],
        ["cat", settings.as_str()],
    ] {
        assert!(!as_nobody(&argv), "uid {NOBODY} could run {argv:?}");
    }
}

#[tokio::test]
async fn a_root_squatted_by_another_user_is_refused() {
    let parent = open_parent();
    let root = parent.path().join("bbs");
    std::fs::create_dir(&root).unwrap();
    std::os::unix::fs::chown(&root, Some(65534), Some(65534)).unwrap();
    let (_fake, _bb, r) = register_under(&root).await;
    assert_ne!(r.status, 200, "{r}");
    let message = r.body["message"].as_str().unwrap_or_default();
    assert!(
        message.contains(root.to_str().unwrap()) && message.contains("owned by uid 65534"),
        "{r}"
    );
    assert_eq!(
        std::fs::read_dir(&root).unwrap().count(),
        0,
        "the server wrote into a directory another user owns"
    );
}
