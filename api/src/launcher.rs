//! The launcher's API (`run/launcher.sock`), exactly as it travels. Requests refuse unknown
//! fields (a misspelt `timeout_s` must not silently become a default); ids and paths are kept
//! as strings here and validated by the launcher, so every refusal gets its own error code
//! instead of a generic serde message.
//!
//! | method | path | success |
//! |---|---|---|
//! | POST | `/agents` [`AgentRequest`] | 201 [`AgentStatus`] |
//! | GET | `/agents/{tid}` (`?wait=1` blocks until done) | 200 [`AgentStatus`] |
//! | DELETE | `/agents/{tid}` | 200 final [`AgentStatus`] |
//! | POST | `/checks` [`CheckRequest`] | 200 [`CheckResult`] (synchronous) |
//! | POST | `/repo/snapshot` [`SnapshotRequest`] | 200 [`SnapshotResult`] |
//! | POST | `/repo/deliver` [`DeliverRequest`] | 200 [`DeliverResult`] |
//! | POST | `/repo/delete-branch` [`DeleteBranchRequest`] | 200 [`DeleteBranchResult`] |
//! | POST | `/backends/{model}/start` | 200 [`BackendStartResult`] once healthy |
//! | POST | `/backends/vllm/stop` | 200 [`BackendStopResult`] |
//! | GET | `/status` | 200 [`LauncherStatus`] |
//! | POST | `/slots` [`SlotRequest`] | 201 [`SlotStatus`] |
//! | GET | `/slots/{tid}` | 200 [`SlotStatus`] |
//! | DELETE | `/slots/{tid}` | 200 final [`SlotStatus`] (sandbox gone, directories removed) |
//! | POST | `/slots/{tid}/exec` [`SlotExecRequest`] | 200 [`SlotExecResult`] |
//! | POST | `/slots/{tid}/files/read` [`SlotReadRequest`] | 200 [`SlotFile`] |
//! | POST | `/slots/{tid}/files/write` [`SlotWriteRequest`] | 200 [`SlotWriteResult`] |

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

/// The `cmd` of a one-shot Claude Code agent, as every client of the launcher starts it: print
/// mode with no prompt argument (the prompt goes in [`AgentRequest::stdin`], never in `cmd`,
/// which the host's process list shows), stream-json output (the last action and the `result`
/// event are read back from it), permissions bypassed (the sandbox is the boundary).
#[must_use]
pub fn claude_print_cmd(model: &str) -> Vec<String> {
    [
        "claude",
        "-p",
        "--output-format",
        "stream-json",
        "--verbose",
        "--model",
        model,
        "--permission-mode",
        "bypassPermissions",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// `POST /agents`. `token` extends the seed API: the task token the gateway expects, passed
/// to the agent as `ANTHROPIC_AUTH_TOKEN` (the env allowlist refuses every `ANTHROPIC_*` key in
/// `env`, so the token needs a field of its own). The launcher keeps it in memory only, never
/// persisted or logged.
///
/// `stdin` is what the agent reads on its standard input (default: nothing): **the place for
/// the prompt** (`claude -p` with no prompt argument reads it from stdin). Everything in `cmd`
/// ends up in the host-visible argv of the agent process (`ps`, `/proc/<pid>/cmdline`), so a
/// prompt there is readable by every local user while the run lasts; `stdin` is delivered
/// through a sealed in-memory file that only the sandbox can read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentRequest {
    pub tid: String,
    pub model: String,
    pub cmd: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub venv: Option<String>,
    pub timeout_s: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
}

/// `POST /checks`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckRequest {
    pub tid: String,
    pub command: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub venv: Option<String>,
    pub timeout_s: u64,
}

/// `POST /repo/snapshot`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    pub tid: String,
    pub path: String,
    #[serde(default, rename = "ref", skip_serializing_if = "Option::is_none")]
    pub git_ref: Option<String>,
}

/// `POST /repo/deliver`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeliverRequest {
    pub tid: String,
    pub path: String,
    pub branch: String,
}

/// `POST /repo/delete-branch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteBranchRequest {
    pub path: String,
    pub branch: String,
}

/// Where a sandbox run (an agent or a check) is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunState {
    Starting,
    Running,
    Stopping,
    /// The sandbox is gone; the workspace is being handed back and collected.
    Finishing,
    Exited,
    TimedOut,
    /// By `DELETE` or launcher shutdown.
    Killed,
    /// Stopped because its workspace reached `launcher.limits.disk_mb` (the watcher's mode;
    /// under a project quota writes fail with `EDQUOT` instead and the run goes on).
    DiskExceeded,
    /// Could not start: refused before the sandbox existed, or bwrap failed to set the
    /// sandbox up (`setup_failed`), so the command never ran.
    Failed,
    /// The launcher died while it ran; found at restart.
    Lost,
}

impl RunState {
    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            RunState::Starting => "starting",
            RunState::Running => "running",
            RunState::Stopping => "stopping",
            RunState::Finishing => "finishing",
            RunState::Exited => "exited",
            RunState::TimedOut => "timed_out",
            RunState::Killed => "killed",
            RunState::DiskExceeded => "disk_exceeded",
            RunState::Failed => "failed",
            RunState::Lost => "lost",
        }
    }

    /// Whether the run has ended (nothing will change any more).
    pub fn is_done(self) -> bool {
        match self {
            RunState::Exited
            | RunState::TimedOut
            | RunState::Killed
            | RunState::DiskExceeded
            | RunState::Failed
            | RunState::Lost => true,
            RunState::Starting | RunState::Running | RunState::Stopping | RunState::Finishing => {
                false
            }
        }
    }
}

/// The wire names are also how the states print.
macro_rules! display_as_str {
    ($($state:ty),*) => {$(
        impl fmt::Display for $state {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
    )*};
}

display_as_str!(RunState, BackendState);

/// `GET /agents/{tid}` (and the body of `POST /agents` and `DELETE /agents/{tid}`).
/// `exit_code` is the sandboxed command's status, `128 + signal` when it was killed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentStatus {
    pub tid: String,
    pub state: RunState,
    pub exit_code: Option<i32>,
    pub oom_killed: bool,
    pub timed_out: bool,
    /// Whether the workspace reached `launcher.limits.disk_mb` (the run was then stopped, or
    /// its writes failed under a project quota).
    #[serde(default)]
    pub disk_exceeded: bool,
    /// bwrap failed to set the sandbox up (a mount, the seccomp filter, executing the
    /// command): the command never ran, `exit_code` is `null`, bwrap's message is in `stderr`,
    /// and `state` is `failed`. Without this, a setup failure looked like the command exiting 1.
    #[serde(default)]
    pub setup_failed: bool,
    pub stdout: String,
    pub stderr: String,
    /// Whether stdout or stderr hit `limits.output_cap_kb` and lost output.
    pub truncated: bool,
    /// The `agent/<tid>` commit in the shadow repository, when a snapshot existed.
    pub result_commit: Option<String>,
    /// Why starting, handing back or collecting went wrong, if it did.
    pub error: Option<String>,
}

/// The answer of `POST /checks`: the check runs to completion within the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    pub tid: String,
    pub exit_code: Option<i32>,
    pub oom_killed: bool,
    pub timed_out: bool,
    /// As in [`AgentStatus`].
    #[serde(default)]
    pub disk_exceeded: bool,
    /// As in [`AgentStatus`].
    #[serde(default)]
    pub setup_failed: bool,
    pub stdout: String,
    pub stderr: String,
    pub truncated: bool,
}

/// `POST /repo/snapshot` → `{repo, sha}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotResult {
    /// The repository's top-level directory.
    pub repo: String,
    /// The commit that was copied.
    pub sha: String,
}

/// `POST /repo/deliver` → the branch and the commit it now points at.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeliverResult {
    pub repo: String,
    pub branch: String,
    pub sha: String,
}

/// `POST /repo/delete-branch`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeleteBranchResult {
    pub repo: String,
    pub branch: String,
    /// The commit the branch pointed at before it was deleted.
    pub sha: String,
}

/// Where a vLLM backend is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendState {
    Stopped,
    /// Spawned, waiting for `GET /health` to answer 200.
    Starting,
    Healthy,
    Stopping,
    /// Exited, or never became healthy; `error` says which.
    Failed,
}

impl BackendState {
    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendState::Stopped => "stopped",
            BackendState::Starting => "starting",
            BackendState::Healthy => "healthy",
            BackendState::Stopping => "stopping",
            BackendState::Failed => "failed",
        }
    }
}

/// One vLLM backend, in `GET /status` and the answers of the backend routes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendStatus {
    pub model: String,
    pub state: BackendState,
    /// The server process (leader of its own process group), while it runs.
    pub pid: Option<u32>,
    /// It serves on `127.0.0.1:<port>`.
    pub port: u16,
    /// Running agents of this model: while there are any, the backend is busy and is not
    /// stopped to make room for another.
    pub agents: usize,
    pub error: Option<String>,
}

/// `POST /backends/{model}/start` → the backend, healthy, and the idle backends that were
/// stopped to make room for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendStartResult {
    #[serde(flatten)]
    pub backend: BackendStatus,
    pub stopped: Vec<String>,
}

/// `POST /backends/vllm/stop` → the backends that were running (or starting) and are now
/// stopped.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendStopResult {
    pub stopped: Vec<String>,
}

/// A run in progress, in `GET /status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunSummary {
    pub tid: String,
    pub state: RunState,
}

/// One host readiness item.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostCheck {
    pub ok: bool,
    pub detail: String,
}

/// Can this host run sandboxes, and if not, exactly what is missing.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostStatus {
    pub ready: bool,
    /// One line per problem; empty when ready.
    pub reasons: Vec<String>,
    pub bwrap: HostCheck,
    pub user_namespaces: HostCheck,
    pub cgroups: HostCheck,
}

/// How `launcher.limits.disk_mb` is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DiskMode {
    /// The data dir's filesystem enforces project quotas: writes past the limit fail.
    ProjectQuota,
    /// A watcher measures each workspace and stops the run past the limit.
    Watcher,
}

impl DiskMode {
    /// The wire string.
    pub fn as_str(self) -> &'static str {
        match self {
            DiskMode::ProjectQuota => "project_quota",
            DiskMode::Watcher => "watcher",
        }
    }
}

/// The per-run disk limit, in `GET /status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DiskStatus {
    pub mode: DiskMode,
    pub limit_mb: u64,
    /// Why this mode (what the kernel answered about the data dir's filesystem).
    pub detail: String,
}

/// `GET /status`: the runs in progress (sorted by tid), how many finished runs are kept, the
/// clients waiting on `?wait=1`, the backends, and host readiness (`ready` = `host.ready`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LauncherStatus {
    pub agents: Vec<RunSummary>,
    pub checks: Vec<RunSummary>,
    /// Rollout slots that are running (sorted by tid).
    #[serde(default)]
    pub slots: Vec<RunSummary>,
    pub finished: usize,
    pub waiters: usize,
    pub backends: Vec<BackendStatus>,
    pub ready: bool,
    pub host: HostStatus,
    /// The capabilities the launcher holds (only those it uses); `None` if they could not be
    /// read.
    #[serde(default)]
    pub capabilities: Option<crate::caps::Capabilities>,
    /// How the per-run disk limit is enforced.
    #[serde(default)]
    pub disk: Option<DiskStatus>,
}

// ---------------------------------------------------------------------------------------------
// Rollout slots: a long-running `blackbox-server` in its own sandbox (agentbox-pool's unit).
// ---------------------------------------------------------------------------------------------

/// `POST /slots`: start the configured `launcher.blackbox_bin` as a rollout slot.
///
/// A slot is a sandbox run like an agent's, with these differences: its workspace, home and
/// tmp are created fresh and empty by the launcher (no snapshot), it runs until `DELETE`
/// (or `timeout_s`), the pinned agent CLIs (`launcher.clients_dir`) are mounted read-only with
/// `OPENCODE_BIN`/`OPENCLAW_BIN`/`CLAUDE_CODE_BIN`/`CODEX_BIN` pointing at them, and the server
/// listens on a unix socket (`BBS_UNIX_SOCKET`) in a directory bound out to the host
/// ([`SlotStatus::socket`]). Like every sandbox it has no network but loopback, and its model
/// traffic goes to `sockets/<tid>/llm.sock` (the gateway task `tid`, opened by the caller
/// before), seen inside as `/run/gw/llm.sock`, presented with `token`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotRequest {
    /// The run id; also the gateway task whose socket the slot's proxy uses.
    pub tid: String,
    /// The gateway task token, given to the server as `BBS_ROUTER_TOKEN` (memory only).
    pub token: String,
    /// Extra environment (the launcher's allowlist plus `BBS_*` settings other than the ones it
    /// sets itself: host, port, unix socket, runtime root, router, router token).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Kill the slot after this long; `None`: until `DELETE`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
}

/// `POST /slots` (201), `GET /slots/{tid}`, `DELETE /slots/{tid}` (the final status, after the
/// sandbox is gone and its directories are removed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotStatus {
    pub tid: String,
    pub state: RunState,
    /// The host path of the server's unix socket (connectable by the service user).
    pub socket: String,
    /// The sandbox's leader process while it runs.
    pub pid: Option<u32>,
    pub exit_code: Option<i32>,
    pub oom_killed: bool,
    pub timed_out: bool,
    /// The server's stderr so far (capped): why a slot died.
    pub stderr: String,
    pub error: Option<String>,
}

/// `POST /slots/{tid}/exec`: a shell command in the slot's workspace, in a sandbox of the same
/// shape (same uid, workspace, home and tmp; no network), as `/bin/sh -lc COMMAND`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotExecRequest {
    pub command: String,
    /// Inside the sandbox; relative to `/workspace`; default `/workspace`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// `None`: `launcher.limits.max_check_timeout_s`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout_s: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
}

/// The answer of `POST /slots/{tid}/exec`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlotExecResult {
    pub stdout: String,
    pub stderr: String,
    /// `None` when killed by the timeout.
    pub returncode: Option<i32>,
    pub timed_out: bool,
    pub truncated: bool,
    pub duration_s: f64,
}

/// `POST /slots/{tid}/files/read`: a regular file under `/workspace`, `/home/agent` or `/tmp`
/// of the slot (a relative path is under `/workspace`), opened without following symlinks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotReadRequest {
    pub path: String,
    /// Read at most this many bytes (default and maximum: `launcher.limits.output_cap_kb`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
}

/// The answer of `POST /slots/{tid}/files/read`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotFile {
    pub path: String,
    /// The bytes read, standard base64.
    pub content_base64: String,
    /// The file's size.
    pub size: u64,
    /// Whether `max_bytes` cut it.
    pub truncated: bool,
}

/// `POST /slots/{tid}/files/write`: creates missing parent directories (as the slot's uid).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SlotWriteRequest {
    pub path: String,
    pub content_base64: String,
    #[serde(default)]
    pub append: bool,
}

/// The answer of `POST /slots/{tid}/files/write`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SlotWriteResult {
    pub path: String,
    /// Bytes written by this call.
    pub bytes: u64,
    pub append: bool,
}
