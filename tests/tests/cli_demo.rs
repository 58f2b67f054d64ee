//! `agentbox demo`, as a new user meets it: the README's main command (read from README.md
//! between its markers, so the two cannot drift apart) runs on this checkout with the real
//! daemons, the real Claude Code in bwrap and the built-in scripted model; the branch is
//! delivered, its diff fixes the failing test, the summary shows tokens and budget, and
//! nothing is left running or on disk. And every host-check failure, each made real for the
//! binary alone (a private mount namespace hides bwrap or turns user namespaces off, a
//! non-root uid, a PATH without npm) without touching the host.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod cli_common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use agentbox_tests::harness::{clients_dir, processes_with, workspace_bin, workspace_root};

/// The one line between the README's main-command markers.
fn readme_main_command() -> String {
    let readme = std::fs::read_to_string(workspace_root().join("README.md")).unwrap();
    let start = readme
        .find("<!-- main-command")
        .expect("README.md has a main-command marker");
    let end = readme
        .find("<!-- /main-command -->")
        .expect("README.md closes the main-command marker");
    let block = &readme[start..end];
    let lines: Vec<&str> = block
        .lines()
        .skip(1)
        .filter(|l| !l.starts_with("```") && !l.trim().is_empty())
        .collect();
    assert_eq!(lines.len(), 1, "one command line in the block: {block}");
    lines[0].trim().to_owned()
}

/// The demo's agent uids (cli/src/demo: 64980, ten of them).
const DEMO_AGENT_UIDS: std::ops::Range<u32> = 64980..64990;

/// The README's command through `sh`, from the workspace root, as a user types it; the build
/// is the test's own profile and target dir (already built: a no-op), the clients the tests'.
fn run_readme_command(keep: bool) -> (Output, String) {
    let command = readme_main_command();
    let agentbox = workspace_bin("agentbox-cli", "agentbox").unwrap();
    let profile_dir = agentbox.parent().unwrap();
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(other) => other.to_owned(),
    };
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(&command)
        .current_dir(workspace_root())
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap())
        .env(
            "HOME",
            std::env::var_os("HOME").unwrap_or_else(|| "/root".into()),
        )
        .env("AGENTBOX_DEMO_PROFILE", profile)
        .env("CARGO_TARGET_DIR", profile_dir.parent().unwrap())
        .env("AGENTBOX_CLIENTS_DIR", clients_dir().unwrap())
        .stdin(Stdio::null());
    if let Some(cargo_home) = std::env::var_os("CARGO_HOME") {
        cmd.env("CARGO_HOME", cargo_home);
    }
    if let Some(rustup_home) = std::env::var_os("RUSTUP_HOME") {
        cmd.env("RUSTUP_HOME", rustup_home);
    }
    if keep {
        cmd.env("AGENTBOX_DEMO_KEEP", "1");
    }
    let out = cmd.output().unwrap();
    let diag = format!(
        "`{command}`: {:?}\n--- stdout ---\n{}\n--- stderr ---\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out, diag)
}

/// The repository the demo delivered into, from its summary's branch line.
fn branch_and_repo(stdout: &str) -> (String, PathBuf) {
    let line = stdout
        .lines()
        .find(|l| l.starts_with("branch "))
        .unwrap_or_else(|| panic!("no branch line: {stdout}"));
    let branch = line.split_whitespace().nth(1).unwrap().to_owned();
    let repo = line.rsplit_once(" in ").unwrap().1;
    (branch, PathBuf::from(repo))
}

/// The demo's temp dir (`…/agentbox-demo-XXXX`) above its repository.
fn temp_dir_of(repo: &Path) -> PathBuf {
    repo.ancestors()
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("agentbox-demo-"))
        })
        .unwrap_or_else(|| panic!("{} is not in a demo temp dir", repo.display()))
        .to_path_buf()
}

/// Nothing of the demo in `temp` runs and no agent process is left.
fn assert_nothing_left_running(temp: &Path, diag: &str) {
    assert_eq!(
        processes_with(&temp.display().to_string()),
        Vec::<u32>::new(),
        "{diag}"
    );
    assert_eq!(
        cli_common::agent_processes(DEMO_AGENT_UIDS),
        Vec::<String>::new()
    );
}

#[test]
fn the_readme_main_command_fixes_the_failing_test_and_shows_the_budget() {
    // Kept, so the branch can be checked in the repository; then once more as a user runs it,
    // to see everything removed. One test: the demo's agent uids are fixed.
    let (out, diag) = run_readme_command(true);
    assert!(out.status.success(), "{diag}");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let (branch, repo) = branch_and_repo(&stdout);
    let temp = temp_dir_of(&repo);
    assert!(branch.starts_with("agent/r"), "{diag}");
    assert!(
        stdout.contains("outcome   succeeded (exited, exit 0)"),
        "{diag}"
    );

    // The branch is in the repository, one commit on the first, and it fixes the bug.
    let git = |args: &[&str]| cli_common::git(&repo, args);
    let base = git(&["rev-parse", "main"]);
    assert_eq!(git(&["rev-parse", &format!("{branch}^")]), base, "{diag}");
    let diff = git(&["diff", &base, &branch]);
    assert!(diff.contains("-    return a - b"), "{diff}");
    assert!(diff.contains("+    return a + b"), "{diff}");
    assert_eq!(
        git(&["diff", "--name-only", &base, &branch]),
        "calc.py",
        "only the source changed, not the test: {diag}"
    );
    assert!(stdout.contains(&format!("diff of {branch}:")), "{diag}");
    assert!(
        stdout.contains("+    return a + b"),
        "the diff is shown: {diag}"
    );
    // The test fails on the base and passes on the branch (run here, on the scripted fix).
    let unittest = |rev: &str| -> bool {
        let tree = tempfile::tempdir().unwrap();
        for f in ["calc.py", "test_calc.py"] {
            std::fs::write(tree.path().join(f), git(&["show", &format!("{rev}:{f}")])).unwrap();
        }
        Command::new("python3")
            .args(["-m", "unittest", "-q"])
            .current_dir(tree.path())
            .env("PYTHONDONTWRITEBYTECODE", "1")
            .output()
            .unwrap()
            .status
            .success()
    };
    assert!(!unittest(&base), "the demo's test fails before");
    assert!(unittest(&branch), "and passes on the branch");
    assert!(
        stdout.contains("in a sandbox on the agent's work: passes"),
        "{diag}"
    );

    // The summary: tokens, cost and the budget left; progress on stderr as plain lines.
    let usage = stdout.lines().find(|l| l.starts_with("usage")).unwrap();
    assert!(
        usage.contains("tokens (input") && usage.contains('$'),
        "{diag}"
    );
    let budget = stdout.lines().find(|l| l.starts_with("budget")).unwrap();
    assert!(
        budget.starts_with("budget    200,000 tokens and $0.5000: ")
            && budget.contains("tokens left"),
        "{diag}"
    );
    assert!(
        !budget.contains(": 200,000 tokens left"),
        "some spent: {diag}"
    );
    assert!(stderr.contains("Claude Code runs in the sandbox"), "{diag}");
    // Progress is sampled (the launcher is polled), so which of the agent's actions a line
    // shows depends on timing (a run of under two seconds may show none of its tool calls);
    // the line at exit always shows the last one, its closing words.
    assert!(
        stderr.lines().any(|l| l.starts_with('[')
            && l.contains(" exited · ")
            && l.contains(" left · Fixed: ")),
        "{diag}"
    );

    // Kept: the dir is there, nothing of it runs, no agent process is left.
    assert!(temp.is_dir(), "{diag}");
    assert_nothing_left_running(&temp, &diag);
    std::fs::remove_dir_all(&temp).unwrap();

    // As a user runs it: the temp dir is gone afterwards.
    let (out, diag) = run_readme_command(false);
    assert!(out.status.success(), "{diag}");
    let (_, repo) = branch_and_repo(&String::from_utf8_lossy(&out.stdout));
    let temp = temp_dir_of(&repo);
    assert!(!temp.exists(), "removed: {diag}");
    assert_nothing_left_running(&temp, &diag);
}

/// `agentbox demo` run by `wrap` (a shell line in a private mount namespace whose `"$@"` is
/// the binary and its arguments), with `env`, as `uid`; its exit code and stderr.
/// `AGENTBOX_CLIENTS_DIR` is the tests' unless `env` is given (then Claude Code is not
/// installed yet).
fn demo_host_check(wrap: Option<&str>, env: &[(&str, &str)], uid: Option<u32>) -> (i32, String) {
    use std::os::unix::process::CommandExt;
    let agentbox = workspace_bin("agentbox-cli", "agentbox").unwrap();
    let mut cmd = match wrap {
        Some(line) => {
            let mut c = Command::new("unshare");
            c.args([
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                line,
                "sh",
            ])
            .arg(&agentbox);
            c
        }
        None => Command::new(&agentbox),
    };
    cmd.arg("demo")
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .stdin(Stdio::null());
    if env.is_empty() {
        cmd.env("AGENTBOX_CLIENTS_DIR", clients_dir().unwrap());
    }
    cmd.envs(env.iter().copied());
    if let Some(uid) = uid {
        cmd.uid(uid).gid(uid);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Exactly one problem line, `what` with its `fix`, and exit 71.
fn assert_one_problem((code, stderr): (i32, String), what: &str, fix: &str) {
    assert_eq!(code, 71, "{stderr}");
    assert!(
        stderr.starts_with("agentbox: this host cannot run the demo:\n"),
        "{stderr}"
    );
    let problems: Vec<&str> = stderr.lines().filter(|l| l.starts_with("  - ")).collect();
    assert_eq!(problems.len(), 1, "{stderr}");
    assert!(problems[0].contains(what), "{stderr}");
    assert!(problems[0].contains(fix), "{stderr}");
}

#[test]
fn demo_says_bubblewrap_is_missing() {
    assert_one_problem(
        demo_host_check(
            Some(r#"mount --bind /dev/null /usr/bin/bwrap && exec "$@""#),
            &[],
            None,
        ),
        "bubblewrap is missing (/usr/bin/bwrap",
        "apt install bubblewrap",
    );
}

#[test]
fn demo_says_user_namespaces_are_off() {
    let zero = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(zero.path(), "0\n").unwrap();
    let line = format!(
        r#"mount --bind {} /proc/sys/user/max_user_namespaces && exec "$@""#,
        zero.path().display()
    );
    assert_one_problem(
        demo_host_check(Some(&line), &[], None),
        "user namespaces are disabled (user.max_user_namespaces is 0)",
        "sysctl -w user.max_user_namespaces=15000",
    );
}

#[test]
fn demo_says_it_needs_root() {
    // The binary and its directories are world-readable; the clients dir need not be, the
    // check comes first.
    assert_one_problem(
        demo_host_check(None, &[], Some(65534)),
        "not running as root",
        "sudo",
    );
}

#[test]
fn demo_says_npm_is_missing_when_claude_code_is_not_installed() {
    // An empty clients cache and a PATH with what the install script's cache lookup uses, but
    // no npm.
    let dir = tempfile::tempdir().unwrap();
    let bin = dir.path().join("bin");
    std::fs::create_dir(&bin).unwrap();
    for tool in ["bash", "sha256sum", "cut", "mkdir", "cat"] {
        let real = ["/usr/bin", "/bin"]
            .iter()
            .map(|d| Path::new(d).join(tool))
            .find(|p| p.exists())
            .unwrap();
        std::os::unix::fs::symlink(real, bin.join(tool)).unwrap();
    }
    let cache = dir.path().join("cache");
    assert_one_problem(
        demo_host_check(
            None,
            &[
                ("PATH", bin.to_str().unwrap()),
                ("AGENTBOX_CLIENTS_CACHE", cache.to_str().unwrap()),
                ("HOME", dir.path().to_str().unwrap()),
            ],
            None,
        ),
        "npm is missing from PATH",
        "AGENTBOX_CLIENTS_DIR",
    );
}
