//! The stack the `agentbox` CLI tests drive, every part real but the model: fakellm behind the
//! bridge (a `remote` model, provider `openai`, so every turn is translated), the gateway as
//! the service user, the launcher as root on the gateway's data dir with the real Claude Code,
//! a source repository owned by the service user, and a config file the CLI reads.

#![allow(clippy::unwrap_used, clippy::expect_used, dead_code)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Output, Stdio};

use agentbox_tests::fakellm::claude;
use agentbox_tests::harness::launcher::{chown_tree, git_with};
use agentbox_tests::harness::{
    BridgeProcess, FakeLlm, GatewayProcess, LauncherProcess, readable_client, workspace_bin,
};
use serde_json::Value;

/// The service user's uid/gid (no passwd entry needed: `--service-uid`).
pub const SERVICE: u32 = 64030;
/// Agent uids in each stack's range.
pub const AGENT_UIDS: u32 = 10;
const BRIDGE_TOKEN: &str = "cli-bridge-token-0123456789";

/// fakellm, bridge, gateway and launcher on one data dir, a repository, and the CLI's config.
pub struct Stack {
    pub fake: FakeLlm,
    pub bridge: BridgeProcess,
    pub gateway: GatewayProcess,
    pub launcher: LauncherProcess,
    pub repo: PathBuf,
    pub base_sha: String,
    pub config: PathBuf,
    /// The first uid of this stack's agent range: each test passes its own (64500, 64510, ...),
    /// so a scan for leftover processes and files cannot see another test's agents.
    pub agent_uid: u32,
    // Declared last so the processes are gone before the files.
    pub base: tempfile::TempDir,
}

/// The config every test git command runs with (the repository is the service user's).
const GIT_CONFIG: [&str; 3] = [
    "safe.directory=*",
    "user.name=t",
    "user.email=t@example.com",
];

/// git in a test repository (owned by the service user; the test is root).
pub fn git(dir: &Path, args: &[&str]) -> String {
    git_with(dir, &GIT_CONFIG, args)
}

impl Stack {
    /// Starts everything with fakellm running `script` and agent uids from `agent_uid`; the
    /// catalogue has `gpt` (remote, openai, with prices) and `extra_toml` is appended to the
    /// launcher's part of the config.
    pub fn start(script: &Value, extra_toml: &str, agent_uid: u32) -> Stack {
        let base = tempfile::Builder::new().prefix("cli-").tempdir().unwrap();
        std::fs::set_permissions(base.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let repos = base.path().join("repos");
        let repo = repos.join("proj");
        std::fs::create_dir_all(&repo).unwrap();
        std::fs::write(repo.join("README.md"), "hello\n").unwrap();
        for args in [
            &["init", "--quiet", "--initial-branch=main"][..],
            &["add", "README.md"],
            &["commit", "--quiet", "-m", "initial"],
        ] {
            git(&repo, args);
        }
        let base_sha = git(&repo, &["rev-parse", "HEAD"]);
        chown_tree(&repos, SERVICE);

        let fake = FakeLlm::scripted(script).unwrap();
        let models = format!(
            "[models.gpt]\nbackend = \"remote\"\nprovider = \"openai\"\nbase_url = \"{}/v1\"\n\
             upstream_model = \"gpt-upstream\"\nkey_env = \"OPENAI_KEY\"\nmax_output_tokens = 8192\n\
             price_input_per_mtok = 1.0\nprice_output_per_mtok = 10.0\n",
            fake.base_url()
        );
        let bridge = BridgeProcess::start(
            &format!("[bridge]\nlisten = \"127.0.0.1:0\"\n{models}"),
            &[
                ("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN),
                ("OPENAI_KEY", "sk-cli"),
            ],
        )
        .unwrap();
        // The bridge runs as root here, so the gateway is told to trust root's listener.
        let gateway_toml = format!(
            "[gateway]\nbridge_url = \"{}\"\nloopback_owner_uid = 0\n",
            bridge.base_url()
        );
        let gateway = GatewayProcess::start_as(
            &format!("{gateway_toml}{models}"),
            &[("AGENTBOX_BRIDGE_TOKEN", BRIDGE_TOKEN)],
            Some((SERVICE, SERVICE)),
        )
        .unwrap();
        let data = gateway.data_dir();
        let claude = readable_client("claude", base.path()).unwrap_or_else(|e| panic!("{e}"));
        let shared = format!(
            "agent_uid = {agent_uid}\nagent_gid = {agent_uid}\nagent_uid_count = {AGENT_UIDS}\n\
             [launcher]\nclaude_bin = {claude:?}\nrepo_roots = [{repos:?}]\n\
             venv_root = \"/nonexistent/venvs\"\n{extra_toml}"
        );
        let launcher =
            LauncherProcess::start_on(Some(&data), &format!("{shared}{models}"), SERVICE).unwrap();
        let config = base.path().join("agentbox.toml");
        std::fs::write(
            &config,
            format!("data_dir = {data:?}\n{shared}{gateway_toml}{models}"),
        )
        .unwrap();
        Stack {
            fake,
            bridge,
            gateway,
            launcher,
            repo,
            base_sha,
            config,
            agent_uid,
            base,
        }
    }

    /// `agentbox --config <ours> ARGS...`, ready to run (stdin closed, output piped).
    pub fn cli(&self, args: &[&str]) -> Command {
        cli_with(&self.config, args)
    }

    /// `agentbox run --repo <ours> --model gpt ARGS...` (the prompt last in `args`), ready to
    /// run as [`Stack::cli`] is.
    pub fn run_command(&self, args: &[&str]) -> Command {
        let repo = self.repo.display().to_string();
        let mut all = vec!["run", "--repo", &repo, "--model", "gpt"];
        all.extend_from_slice(args);
        self.cli(&all)
    }

    /// [`Stack::run_command`] to its end; the output and [`Stack::describe`] of it.
    pub fn run(&self, args: &[&str]) -> (Output, String) {
        let out = self.run_command(args).output().unwrap();
        let diag = self.describe(&out);
        (out, diag)
    }

    /// Everything a failing test needs to see.
    pub fn describe(&self, out: &Output) -> String {
        format!(
            "status {:?}\n--- cli stdout ---\n{}\n--- cli stderr ---\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
            self.describe_logs()
        )
    }

    /// What fakellm served and the daemons' logs.
    pub fn describe_logs(&self) -> String {
        format!(
            "--- fakellm ---\n{}\n--- gateway ---\n{}\n--- launcher ---\n{}",
            self.fake
                .requests()
                .map(|l| l
                    .iter()
                    .map(|r| format!("{} {}", r["path"], r["served_by"]))
                    .collect::<Vec<_>>()
                    .join("\n"))
                .unwrap_or_default(),
            self.gateway.stderr(),
            self.launcher.describe()
        )
    }
}

/// The `agentbox` binary with `--config config ARGS...`, in a clean environment.
pub fn cli_with(config: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(workspace_bin("agentbox-cli", "agentbox").unwrap());
    cmd.arg("--config")
        .arg(config)
        .args(args)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    cmd
}

impl Stack {
    /// Waits until fakellm has served `n` scripted steps (the agent is mid-run) while
    /// `alive()` says the client goes on; fails the test with `diag()` after `within`.
    pub fn wait_for_steps(
        &self,
        n: usize,
        within: std::time::Duration,
        alive: &mut dyn FnMut() -> bool,
        diag: &dyn Fn() -> String,
    ) {
        let deadline = std::time::Instant::now() + within;
        let steps_served = || {
            self.fake
                .requests()
                .unwrap_or_default()
                .iter()
                .filter(|r| {
                    r["served_by"]
                        .as_str()
                        .is_some_and(|s| s.starts_with("step"))
                })
                .count()
        };
        while steps_served() < n {
            assert!(
                std::time::Instant::now() < deadline && alive(),
                "the agent never reached step {n}\n{}",
                diag()
            );
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    }

    /// Live processes whose uid is in this stack's agent range (see [`agent_processes`]).
    pub fn agent_processes(&self) -> Vec<String> {
        agent_processes(self.agent_uid..self.agent_uid + AGENT_UIDS)
    }

    /// Files under `dir` owned by an agent uid or gid of this stack.
    pub fn agent_owned(&self, dir: &Path) -> Vec<PathBuf> {
        use std::os::unix::fs::MetadataExt;
        let range = self.agent_uid..self.agent_uid + AGENT_UIDS;
        walkdir::WalkDir::new(dir)
            .into_iter()
            .filter_map(Result::ok)
            .filter(|e| {
                e.path()
                    .symlink_metadata()
                    .is_ok_and(|m| range.contains(&m.uid()) || range.contains(&m.gid()))
            })
            .map(|e| e.path().to_path_buf())
            .collect()
    }
}

/// Ctrl-C for `child` (SIGINT to it alone), then its exit status; fails the test if it is still
/// there after `within`.
pub fn interrupt(child: &mut std::process::Child, within: std::time::Duration) -> ExitStatus {
    let pid = rustix::process::Pid::from_raw(i32::try_from(child.id()).unwrap()).unwrap();
    rustix::process::kill_process(pid, rustix::process::Signal::INT).unwrap();
    let deadline = std::time::Instant::now() + within;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "still running {within:?} after SIGINT"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Live processes whose uid is in this stack's agent range, as `pid uids name state ppid`. A
/// zombie is not counted: it has exited (bwrap's inner process, orphaned when the sandbox is
/// killed, waits a moment for init to reap it).
pub fn agent_processes(range: std::ops::Range<u32>) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(status) = std::fs::read_to_string(entry.path().join("status")) else {
            continue;
        };
        let uids: Vec<u32> = status
            .lines()
            .find(|l| l.starts_with("Uid:"))
            .map(|l| {
                l.split_whitespace()
                    .skip(1)
                    .filter_map(|u| u.parse().ok())
                    .collect()
            })
            .unwrap_or_default();
        let zombie = status
            .lines()
            .any(|l| l.starts_with("State:") && l.contains('Z'));
        if !zombie && uids.iter().any(|u| range.contains(u)) {
            let field = |k: &str| {
                status
                    .lines()
                    .find(|l| l.starts_with(k))
                    .unwrap_or_default()
                    .to_owned()
            };
            found.push(format!(
                "{} {uids:?} {} {} {}",
                entry.file_name().to_string_lossy(),
                field("Name:"),
                field("State:"),
                field("PPid:")
            ));
        }
    }
    found
}

/// [`write_script`]s for runs one after the other: `(file, content, done_delay_ms)` each.
pub fn writes(runs: &[(&str, &str, u64)]) -> Value {
    claude::chain(
        &runs
            .iter()
            .map(|(f, c, d)| write_script(f, c, *d))
            .collect::<Vec<_>>(),
    )
}

/// A fakellm script for Claude Code in chat mode (through the bridge): write `content` to
/// `/workspace/<file>` with a shell command, then say done ([`claude::write_file`]).
pub fn write_script(file: &str, content: &str, done_delay_ms: u64) -> Value {
    claude::write_file(file, content, done_delay_ms)
}

/// The gateway's entry for `tid` in a `status --json` object (fails the test when absent).
pub fn status_task<'a>(status: &'a Value, tid: &str) -> &'a Value {
    status["gateway"]["tasks"]
        .as_array()
        .and_then(|tasks| tasks.iter().find(|t| t["tid"] == tid))
        .unwrap_or_else(|| panic!("no task {tid} in {status}"))
}
