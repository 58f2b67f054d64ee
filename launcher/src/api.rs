//! The JSON shapes of the launcher's HTTP API, exactly as they travel. Requests refuse unknown
//! fields (a misspelt `timeout_s` must not silently become a default); ids and paths are kept
//! as strings here and validated by [`crate::validate`], so every refusal gets its own error
//! code instead of a generic serde message.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// `POST /agents`. `token` extends the seed API: the task token the gateway expects, passed
/// to the agent as `ANTHROPIC_AUTH_TOKEN` (the env allowlist refuses every `ANTHROPIC_*` key in
/// `env`, so the token needs a field of its own). It is kept in memory only, never persisted
/// or logged.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentRequest {
    pub tid: String,
    pub model: String,
    pub cmd: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub venv: Option<String>,
    pub timeout_s: u64,
    #[serde(default)]
    pub token: Option<String>,
}

/// `POST /checks`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CheckRequest {
    pub tid: String,
    pub command: String,
    #[serde(default)]
    pub venv: Option<String>,
    pub timeout_s: u64,
}

/// `POST /repo/snapshot`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotRequest {
    pub tid: String,
    pub path: String,
    #[serde(default, rename = "ref")]
    pub git_ref: Option<String>,
}

/// `POST /repo/deliver`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeliverRequest {
    pub tid: String,
    pub path: String,
    pub branch: String,
}

/// `POST /repo/delete-branch`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteBranchRequest {
    pub path: String,
    pub branch: String,
}

/// `GET /agents/{tid}` (and the body of `POST /agents` and `DELETE /agents/{tid}`).
///
/// `state` is one of `starting`, `running`, `stopping`, `finishing` (sandbox gone, workspace
/// being handed back and collected), `exited`, `timed_out`, `killed` (DELETE or launcher
/// shutdown), `failed` (could not start), `lost` (the launcher died while it ran; found at
/// restart). `exit_code` is the sandboxed command's status, `128 + signal` when it was killed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct AgentStatus {
    pub tid: String,
    pub state: String,
    pub exit_code: Option<i32>,
    pub oom_killed: bool,
    pub timed_out: bool,
    pub stdout: String,
    pub stderr: String,
    /// Whether stdout or stderr hit `limits.output_cap_kb` and lost output.
    pub truncated: bool,
    /// The `agent/<tid>` commit in the shadow repository, when a snapshot existed.
    pub result_commit: Option<String>,
    /// Why starting, handing back or collecting went wrong, if it did.
    pub error: Option<String>,
}

/// The response of `POST /checks`: the check runs to completion within the request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckResult {
    pub tid: String,
    pub exit_code: Option<i32>,
    pub oom_killed: bool,
    pub timed_out: bool,
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

/// One vLLM backend, in `GET /status` and the answers of the backend routes.
///
/// `state` is `stopped`, `starting` (spawned, waiting for `GET /health` to answer 200),
/// `healthy`, `stopping`, or `failed` (exited, or never became healthy; `error` says which).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BackendStatus {
    pub model: String,
    pub state: String,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_refused() {
        let err = serde_json::from_str::<AgentRequest>(
            r#"{"tid":"a","model":"m","cmd":["claude"],"timeout_s":1,"extra":1}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("unknown field `extra`"), "{err}");
        assert!(
            serde_json::from_str::<CheckRequest>(r#"{"tid":"a","command":"true","timeout_s":1.5}"#)
                .is_err()
        );
        assert!(
            serde_json::from_str::<CheckRequest>(r#"{"tid":"a","command":"true","timeout_s":-1}"#)
                .is_err()
        );
        let s: SnapshotRequest =
            serde_json::from_str(r#"{"tid":"a","path":"/x","ref":"main"}"#).unwrap();
        assert_eq!(s.git_ref.as_deref(), Some("main"));
    }
}
