//! Everything a launcher request can fail with, and the one place that turns it into an HTTP
//! status and a JSON body.
//!
//! Body shape, for every error of every route: [`ErrorEnvelope`],
//! `{"error": {"code": "<stable snake_case code>", "message": "<human readable>"}}`.
//! Callers (the CLI, tests) branch on `code`; `message` is for people and may change. Untrusted
//! input only ever appears escaped and shortened (the policy crate's errors already do that).

use agentbox_api::ErrorEnvelope;
use agentbox_policy::env::EnvError;
use agentbox_policy::resolve::ResolveError;
use agentbox_sandbox::bwrap::SpawnError;
use agentbox_sandbox::cgroup::CgroupError;
use agentbox_sandbox::stage::StageError;
use agentbox_sandbox::walk::WalkError;
use axum::Json;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

use crate::backend::BackendError;
use crate::git::GitError;
use crate::layout::DataError;
use crate::state::StateError;

/// A failed launcher request.
#[derive(Debug, thiserror::Error)]
pub enum LauncherError {
    /// The peer's uid is neither root nor the service uid.
    #[error("uid {uid} may not use the launcher")]
    Forbidden {
        /// The peer's uid, from `SO_PEERCRED`.
        uid: u32,
    },
    /// No such route.
    #[error("no route for {0}")]
    NoRoute(String),
    /// A known route with the wrong method.
    #[error("method not allowed")]
    MethodNotAllowed,
    /// The body is over the limit.
    #[error("request body exceeds {limit} bytes")]
    BodyTooLarge {
        /// The limit, bytes.
        limit: u64,
    },
    /// The client did not send its body in time.
    #[error("request body not received in time")]
    BodyTimeout,
    /// Not JSON, wrong types, missing or unknown fields.
    #[error("invalid request: {0}")]
    BadRequest(String),
    /// `tid` (or the tid of a branch) broke the id rule.
    #[error("{0}")]
    InvalidTid(String),
    /// `model` is not in the catalogue.
    #[error("model {0} is not in the catalogue")]
    UnknownModel(String),
    /// `cmd` is not `claude ...`, or an argument is unacceptable.
    #[error("invalid cmd: {0}")]
    InvalidCmd(String),
    /// `command` of a check is unacceptable.
    #[error("invalid command: {0}")]
    InvalidCommand(String),
    /// `env` has a key that is not allowlisted, denied, malformed, or a bad value.
    #[error("invalid env: {0}")]
    InvalidEnv(String),
    /// `token` is malformed.
    #[error("invalid token: {0}")]
    InvalidToken(String),
    /// `stdin` is unacceptable (too large).
    #[error("invalid stdin: {0}")]
    InvalidStdin(String),
    /// `timeout_s` outside 1..=max.
    #[error("timeout_s {got} is outside 1..={max}")]
    InvalidTimeout {
        /// What was asked.
        got: u64,
        /// The configured maximum.
        max: u64,
    },
    /// `venv` is not an acceptable venv.
    #[error("invalid venv: {0}")]
    InvalidVenv(String),
    /// A path in a request broke a string rule or is outside the allowed roots.
    #[error("invalid path: {0}")]
    InvalidPath(String),
    /// A branch name is not `agent/<tid>`.
    #[error("invalid branch: {0}")]
    InvalidBranch(String),
    /// A git ref is unacceptable or does not name a commit.
    #[error("invalid ref: {0}")]
    InvalidRef(String),
    /// A path on the host is refused: a symlink or mount in the way, wrong owner or type, a
    /// hard link or device node inside a workspace.
    #[error("refused: {0}")]
    Unsafe(String),
    /// Something the request names does not exist (workspace, repository, gateway socket).
    #[error("not found: {0}")]
    Missing(String),
    /// No task with this tid is known.
    #[error("no task {0}")]
    UnknownTask(String),
    /// The tid already has a running agent or check, or a snapshot already exists.
    #[error("conflict: {0}")]
    Conflict(String),
    /// No rollout slot of that tid.
    #[error("no slot {0}")]
    UnknownSlot(String),
    /// A rollout slot's server did not come up (its stderr's end is in the message), or its
    /// sandbox failed.
    #[error("slot failed: {0}")]
    SlotFailed(String),
    /// The host cannot run sandboxes (bwrap, user namespaces, cgroups).
    #[error("host not ready: {0}")]
    HostNotReady(String),
    /// The launcher is shutting down.
    #[error("the launcher is shutting down")]
    ShuttingDown,
    /// Every uid of the agent range belongs to a run whose workspace is not handed back yet.
    #[error("every agent uid ({0}) is in use")]
    NoAgentUid(String),
    /// The configuration cannot work on this host.
    #[error("configuration: {0}")]
    Config(String),
    /// `/backends/{model}/start` names a model that is not served by vLLM.
    #[error("model {0} is not a vllm model")]
    NotVllm(String),
    /// The data directory refused or failed an operation.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A git helper failed.
    #[error(transparent)]
    Git(#[from] GitError),
    /// A vLLM backend request failed.
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The workspace could not be handed to the agent uid.
    #[error("workspace: {0}")]
    HandOver(#[source] WalkError),
    /// The workspace could not be handed back to the service uid.
    #[error("handing the workspace back: {0}")]
    HandBack(#[source] WalkError),
    /// Staging the sandbox's mounts failed.
    #[error(transparent)]
    Stage(#[from] StageError),
    /// Creating the run's cgroup failed.
    #[error("sandbox failed: {0}")]
    Cgroup(#[from] CgroupError),
    /// Spawning bwrap failed.
    #[error("sandbox failed: {0}")]
    Spawn(#[from] SpawnError),
    /// The launcher's records could not be opened.
    #[error("state: {0}")]
    State(#[from] StateError),
    /// The configured env allowlist is unusable.
    #[error("config allowlist: {0}")]
    Allowlist(#[from] EnvError),
    /// A descriptor could not be duplicated.
    #[error("duplicating a descriptor: {0}")]
    Dup(#[source] std::io::Error),
    /// A blocking task panicked or was cancelled.
    #[error("a blocking task failed: {0}")]
    Blocking(#[from] tokio::task::JoinError),
    /// An invariant of the launcher itself broke (a bug).
    #[error("internal error: {0}")]
    Internal(&'static str),
}

impl LauncherError {
    /// The status and the stable error code. This is the only mapping from errors to HTTP.
    pub fn status_and_code(&self) -> (StatusCode, &'static str) {
        match self {
            LauncherError::Forbidden { .. } => (StatusCode::FORBIDDEN, "forbidden"),
            LauncherError::NoRoute(_) => (StatusCode::NOT_FOUND, "no_route"),
            LauncherError::MethodNotAllowed => {
                (StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed")
            }
            LauncherError::BodyTooLarge { .. } => (StatusCode::PAYLOAD_TOO_LARGE, "body_too_large"),
            LauncherError::BodyTimeout => (StatusCode::REQUEST_TIMEOUT, "body_timeout"),
            LauncherError::BadRequest(_) => (StatusCode::BAD_REQUEST, "bad_request"),
            LauncherError::InvalidTid(_) => (StatusCode::BAD_REQUEST, "invalid_tid"),
            LauncherError::UnknownModel(_) => (StatusCode::BAD_REQUEST, "unknown_model"),
            LauncherError::InvalidCmd(_) => (StatusCode::BAD_REQUEST, "invalid_cmd"),
            LauncherError::InvalidCommand(_) => (StatusCode::BAD_REQUEST, "invalid_command"),
            LauncherError::InvalidEnv(_) => (StatusCode::BAD_REQUEST, "invalid_env"),
            LauncherError::InvalidToken(_) => (StatusCode::BAD_REQUEST, "invalid_token"),
            LauncherError::InvalidStdin(_) => (StatusCode::BAD_REQUEST, "invalid_stdin"),
            LauncherError::InvalidTimeout { .. } => (StatusCode::BAD_REQUEST, "invalid_timeout"),
            LauncherError::InvalidVenv(_) => (StatusCode::BAD_REQUEST, "invalid_venv"),
            LauncherError::InvalidPath(_) => (StatusCode::BAD_REQUEST, "invalid_path"),
            LauncherError::InvalidBranch(_) => (StatusCode::BAD_REQUEST, "invalid_branch"),
            LauncherError::InvalidRef(_) => (StatusCode::BAD_REQUEST, "invalid_ref"),
            LauncherError::Unsafe(_) => (StatusCode::BAD_REQUEST, "unsafe_path"),
            LauncherError::Missing(_) => (StatusCode::NOT_FOUND, "not_found"),
            LauncherError::UnknownTask(_) => (StatusCode::NOT_FOUND, "unknown_task"),
            LauncherError::Conflict(_) => (StatusCode::CONFLICT, "conflict"),
            LauncherError::UnknownSlot(_) => (StatusCode::NOT_FOUND, "unknown_slot"),
            LauncherError::SlotFailed(_) => (StatusCode::BAD_GATEWAY, "slot_failed"),
            LauncherError::HostNotReady(_) => (StatusCode::SERVICE_UNAVAILABLE, "host_not_ready"),
            LauncherError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
            LauncherError::NoAgentUid(_) => (StatusCode::SERVICE_UNAVAILABLE, "no_agent_uid"),
            LauncherError::Config(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
            LauncherError::NotVllm(_) => (StatusCode::BAD_REQUEST, "not_vllm"),
            LauncherError::Data(e) => data_status(e),
            LauncherError::Git(e) => git_status(e),
            LauncherError::Backend(e) => backend_status(e),
            LauncherError::HandOver(_) | LauncherError::HandBack(_) => {
                (StatusCode::BAD_REQUEST, "unsafe_path")
            }
            LauncherError::Cgroup(_) | LauncherError::Spawn(_) => {
                (StatusCode::INTERNAL_SERVER_ERROR, "sandbox_failed")
            }
            LauncherError::Stage(_)
            | LauncherError::State(_)
            | LauncherError::Allowlist(_)
            | LauncherError::Dup(_)
            | LauncherError::Blocking(_)
            | LauncherError::Internal(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
        }
    }
}

/// A path the launcher resolved on the host: a missing object is "not found", everything else
/// (symlink, mount, wrong type, I/O) is a refusal.
fn resolve_status(e: &ResolveError) -> (StatusCode, &'static str) {
    match e {
        ResolveError::NotFound { .. } => (StatusCode::NOT_FOUND, "not_found"),
        ResolveError::RootNotAbsolute { .. }
        | ResolveError::Symlink { .. }
        | ResolveError::CrossesMount { .. }
        | ResolveError::NotADirectory { .. }
        | ResolveError::WrongKind { .. }
        | ResolveError::Changed { .. }
        | ResolveError::OtherRoot { .. }
        | ResolveError::BadComponent { .. }
        | ResolveError::Openat2Unavailable { .. }
        | ResolveError::Io(_) => (StatusCode::BAD_REQUEST, "unsafe_path"),
    }
}

fn data_status(e: &DataError) -> (StatusCode, &'static str) {
    match e {
        DataError::Resolve(r) => resolve_status(r),
        DataError::Refused { .. } => (StatusCode::BAD_REQUEST, "unsafe_path"),
        DataError::Io { .. } | DataError::Name(_) => {
            (StatusCode::INTERNAL_SERVER_ERROR, "internal")
        }
    }
}

/// Git: a timeout is `git_timeout` (504: git did not answer in time, nothing is known to be
/// wrong with the request), never a missing ref; a ref that git says does not exist is the
/// caller's `invalid_ref`/`not_found`; git failing otherwise is `git_failed`.
fn git_status(e: &GitError) -> (StatusCode, &'static str) {
    match e {
        GitError::InvalidPath(_) => (StatusCode::BAD_REQUEST, "invalid_path"),
        GitError::InvalidRef(_) | GitError::NoSuchCommit(_) => {
            (StatusCode::BAD_REQUEST, "invalid_ref")
        }
        GitError::Resolve(r) => resolve_status(r),
        GitError::Refused(_) => (StatusCode::BAD_REQUEST, "unsafe_path"),
        GitError::NoRepository(_) | GitError::BranchMissing(_) => {
            (StatusCode::NOT_FOUND, "not_found")
        }
        GitError::CheckedOut(_) => (StatusCode::CONFLICT, "conflict"),
        GitError::Timeout { .. } => (StatusCode::GATEWAY_TIMEOUT, "git_timeout"),
        GitError::Spawn { .. }
        | GitError::Failed { .. }
        | GitError::BadOutput { .. }
        | GitError::Workspace(_) => (StatusCode::INTERNAL_SERVER_ERROR, "git_failed"),
        GitError::Blocking(_) => (StatusCode::INTERNAL_SERVER_ERROR, "internal"),
    }
}

fn backend_status(e: &BackendError) -> (StatusCode, &'static str) {
    match e {
        BackendError::Failed(_) => (StatusCode::BAD_GATEWAY, "backend_failed"),
        BackendError::InUse(_) | BackendError::StoppedWhileStarting(_) => {
            (StatusCode::CONFLICT, "conflict")
        }
        BackendError::ShuttingDown => (StatusCode::SERVICE_UNAVAILABLE, "shutting_down"),
        BackendError::Data(d) => data_status(d),
        BackendError::NoSlot(_) | BackendError::Transition(_) | BackendError::Log { .. } => {
            (StatusCode::INTERNAL_SERVER_ERROR, "internal")
        }
    }
}

impl IntoResponse for LauncherError {
    fn into_response(self) -> Response {
        let (status, code) = self.status_and_code();
        if status.is_server_error() {
            tracing::warn!(code, error = %self, "request failed");
        }
        (status, Json(ErrorEnvelope::new(code, self.to_string()))).into_response()
    }
}

impl From<agentbox_http::BodyError> for LauncherError {
    fn from(e: agentbox_http::BodyError) -> Self {
        match e {
            agentbox_http::BodyError::TooLarge { limit } => LauncherError::BodyTooLarge { limit },
            agentbox_http::BodyError::Timeout(_) => LauncherError::BodyTimeout,
            agentbox_http::BodyError::Read(m) => LauncherError::BadRequest(m),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn body_shape() {
        let resp = LauncherError::InvalidTimeout { got: 0, max: 10 }.into_response();
        assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 16)
            .await
            .unwrap();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "invalid_timeout");
        assert_eq!(v["error"]["message"], "timeout_s 0 is outside 1..=10");
        assert_eq!(v.as_object().unwrap().len(), 1);
    }
}
