//! The operator's verbs beside `run`: `status`, `logs`, `stop`, `check`, `deliver`,
//! `backends` and `pool status`, as library calls that return typed results; the CLI renders them
//! ([`crate::render`]) and the MCP server ([`crate::mcp`]) returns them as JSON. Each is one or
//! two calls through `agentbox-api`; failures go through [`Daemons::error`] so every verb
//! reports the same way.

use std::path::Path;

use agentbox_api::gateway::{GatewayStatus, TaskView};
use agentbox_api::launcher::{
    BackendStartResult, BackendStopResult, CheckRequest, CheckResult, DeliverRequest,
    DeliverResult, LauncherStatus, RunState,
};
use agentbox_api::pool::PoolStatus;
use agentbox_policy::id::Tid;
use serde::Serialize;

use crate::daemons::Daemons;
use crate::error::{CliError, Daemon};

/// `call` on `daemon` once its socket answers; either failure as the error people see.
async fn reach<T>(
    d: &Daemons,
    daemon: Daemon,
    call: impl std::future::Future<Output = Result<T, agentbox_api::ClientError>>,
) -> Result<T, CliError> {
    d.probe(daemon).await?;
    call.await.map_err(|e| d.error(daemon, None, e))
}

/// What `status` found: each daemon's status, or why it could not be reached.
#[derive(Debug)]
pub struct StatusReport {
    /// The launcher's status.
    pub launcher: Result<LauncherStatus, CliError>,
    /// The gateway's status.
    pub gateway: Result<GatewayStatus, CliError>,
}

impl StatusReport {
    /// The first unreachable daemon's exit code, else 0.
    pub fn exit_code(&self) -> u8 {
        [self.launcher.as_ref().err(), self.gateway.as_ref().err()]
            .into_iter()
            .flatten()
            .map(CliError::exit_code)
            .next()
            .unwrap_or(0)
    }

    /// `{"launcher": status or error, "gateway": status or error}` (what `--json` prints).
    pub fn to_json(&self) -> serde_json::Value {
        fn part<T: Serialize>(r: &Result<T, CliError>) -> serde_json::Value {
            match r {
                Ok(v) => serde_json::to_value(v).unwrap_or_default(),
                Err(e) => e.to_json(),
            }
        }
        serde_json::json!({"launcher": part(&self.launcher), "gateway": part(&self.gateway)})
    }
}

/// `status`: both daemons (each may be down): tasks, backends, host readiness.
pub async fn status(d: &Daemons) -> StatusReport {
    StatusReport {
        launcher: reach(d, Daemon::Launcher, d.launcher.status()).await,
        gateway: reach(d, Daemon::Gateway, d.gateway.status()).await,
    }
}

/// `pool status`: the rollout pool's slots and leases.
///
/// # Errors
/// The pool is not running or refuses this user.
pub async fn pool_status(d: &Daemons) -> Result<PoolStatus, CliError> {
    reach(d, Daemon::Pool, d.pool.status()).await
}

/// A page of a run's output.
#[derive(Debug, Clone, Serialize)]
pub struct Logs {
    /// The task id.
    pub tid: String,
    /// The run's state when it was read.
    pub state: RunState,
    /// The run has ended: no more output will come.
    pub done: bool,
    /// Where this page starts (a byte offset into the output).
    pub offset: usize,
    /// Where the next page starts.
    pub next_offset: usize,
    /// The output from `offset`, at most the limit asked for.
    pub output: String,
}

/// `logs`: the run's standard output (or error) from byte `offset`, at most `limit` bytes
/// (cut at a character boundary). `align`: an `offset` inside a character starts at that
/// character instead of failing; a follower needs it, since the launcher reads a live log with
/// a cut last character replaced (3 bytes), so the offset after it may fall inside the
/// character once it is whole.
///
/// # Errors
/// A daemon failure, an unknown task, or an `offset` past the end (or, without `align`,
/// inside a character).
pub async fn logs(
    d: &Daemons,
    tid: &Tid,
    stderr: bool,
    mut offset: usize,
    limit: Option<usize>,
    align: bool,
) -> Result<Logs, CliError> {
    d.probe(Daemon::Launcher).await?;
    let status = d
        .launcher
        .agent(tid)
        .await
        .map_err(|e| d.error(Daemon::Launcher, Some(tid.as_str()), e))?;
    let text = if stderr {
        &status.stderr
    } else {
        &status.stdout
    };
    if align {
        offset = text.floor_char_boundary(offset);
    }
    let rest = text.get(offset..).ok_or_else(|| {
        CliError::Usage(format!(
            "offset {offset} is not a character boundary within the {} bytes of output",
            text.len()
        ))
    })?;
    let end = rest.floor_char_boundary(limit.unwrap_or(usize::MAX));
    let output = rest.get(..end).unwrap_or_default().to_owned();
    Ok(Logs {
        tid: tid.to_string(),
        state: status.state,
        done: status.state.is_done(),
        offset,
        next_offset: offset + output.len(),
        output,
    })
}

/// What `stop` did.
#[derive(Debug, Clone, Serialize)]
pub struct Stopped {
    /// The task id.
    pub tid: String,
    /// The run's final state, if the launcher had a run by that id.
    pub run: Option<RunState>,
    /// The closed gateway task (its usage), if the gateway had one.
    pub task: Option<TaskView>,
}

/// `stop`: deletes the run (the launcher answers once the sandbox is gone and the workspace
/// handed back) and closes the gateway task.
///
/// # Errors
/// A daemon failure, or a task unknown to both.
pub async fn stop(d: &Daemons, tid: &Tid) -> Result<Stopped, CliError> {
    d.probe_both().await?;
    let run = d.launcher.delete_agent(tid).await;
    let task = d.gateway.close_task(tid).await;
    let run = match run {
        Ok(s) => Some(s.state),
        Err(e) if e.code() == Some("unknown_task") => None,
        Err(e) => return Err(d.error(Daemon::Launcher, Some(tid.as_str()), e)),
    };
    let task = match task {
        Ok(v) => Some(v),
        Err(e) if e.code() == Some("no_such_task") => None,
        Err(e) => return Err(d.error(Daemon::Gateway, Some(tid.as_str()), e)),
    };
    if run.is_none() && task.is_none() {
        return Err(CliError::UnknownTask {
            daemon: Daemon::Launcher,
            tid: tid.to_string(),
        });
    }
    Ok(Stopped {
        tid: tid.to_string(),
        run,
        task,
    })
}

/// One shell word, quoted when it needs to be.
fn shell_word(w: &str) -> String {
    let plain = !w.is_empty()
        && w.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if plain {
        w.to_owned()
    } else {
        format!("'{}'", w.replace('\'', r"'\''"))
    }
}

/// What a check did, and the exit code the CLI gives it.
#[derive(Debug, Clone, Serialize)]
pub struct Checked {
    /// The launcher's answer: the command's exit status and output.
    pub check: CheckResult,
    /// The CLI's exit code: the command's, or 4 at the timeout, 5 for OOM, 6 at the disk
    /// limit, 7 when the sandbox could not be set up (as `run`).
    pub exit_code: u8,
    /// What went wrong around the command, if something did.
    pub problem: Option<String>,
}

/// `check`: runs the command in a sandbox on the workspace.
///
/// # Errors
/// A daemon failure or an unknown task.
pub async fn check(
    d: &Daemons,
    tid: &Tid,
    timeout_s: u64,
    venv: Option<String>,
    command: &[String],
) -> Result<Checked, CliError> {
    d.probe(Daemon::Launcher).await?;
    let command = match command {
        [one] => one.clone(),
        many => many
            .iter()
            .map(|w| shell_word(w))
            .collect::<Vec<_>>()
            .join(" "),
    };
    let r = d
        .launcher
        .run_check(&CheckRequest {
            tid: tid.to_string(),
            command,
            venv,
            timeout_s,
        })
        .await
        .map_err(|e| d.error(Daemon::Launcher, Some(tid.as_str()), e))?;
    let (exit_code, problem) = if r.timed_out {
        (
            4,
            Some(format!(
                "the check ran past its timeout ({timeout_s}s) and was killed"
            )),
        )
    } else if r.oom_killed {
        (
            5,
            Some("the check was killed for using too much memory".to_owned()),
        )
    } else if r.disk_exceeded {
        (
            6,
            Some(
                "the check filled the workspace to launcher.limits.disk_mb and was stopped"
                    .to_owned(),
            ),
        )
    } else if r.setup_failed {
        (
            7,
            Some("the sandbox could not be set up for the check (see its stderr)".to_owned()),
        )
    } else {
        (
            r.exit_code.and_then(|c| u8::try_from(c).ok()).unwrap_or(1),
            None,
        )
    };
    Ok(Checked {
        check: r,
        exit_code,
        problem,
    })
}

/// `deliver`: `agent/<tid>` into the repository.
///
/// # Errors
/// A bad repository path, a daemon failure or an unknown task.
pub async fn deliver(d: &Daemons, tid: &Tid, repo: &Path) -> Result<DeliverResult, CliError> {
    d.probe(Daemon::Launcher).await?;
    let path = std::fs::canonicalize(repo).map_err(|e| CliError::BadRepo {
        path: repo.to_path_buf(),
        reason: e.to_string(),
    })?;
    d.launcher
        .deliver(&DeliverRequest {
            tid: tid.to_string(),
            path: path.display().to_string(),
            branch: format!("agent/{tid}"),
        })
        .await
        .map_err(|e| d.error(Daemon::Launcher, Some(tid.as_str()), e))
}

/// `backends start MODEL`.
///
/// # Errors
/// An unknown model or a daemon failure.
pub async fn backend_start(d: &Daemons, model: &str) -> Result<BackendStartResult, CliError> {
    let id = agentbox_policy::config::ModelId::parse(model)
        .ok()
        .filter(|m| d.config.models.contains_key(m))
        .ok_or_else(|| CliError::UnknownModel {
            model: model.to_owned(),
            known: d.config.models.keys().map(ToString::to_string).collect(),
        })?;
    reach(d, Daemon::Launcher, d.launcher.start_backend(&id)).await
}

/// `backends stop`.
///
/// # Errors
/// A daemon failure.
pub async fn backends_stop(d: &Daemons) -> Result<BackendStopResult, CliError> {
    reach(d, Daemon::Launcher, d.launcher.stop_backends()).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_are_quoted_for_sh() {
        assert_eq!(shell_word("cargo"), "cargo");
        assert_eq!(shell_word("a b"), "'a b'");
        assert_eq!(shell_word("it's"), r"'it'\''s'");
        assert_eq!(shell_word(""), "''");
    }
}
