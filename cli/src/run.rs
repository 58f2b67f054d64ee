//! `agentbox run` as a library, so `run`, `demo` and `mcp` share one path: snapshot the
//! repository, open a gateway task with a fresh random token and the budget, start Claude Code
//! in the launcher's sandbox (the prompt in the request's `stdin`, never in argv), report
//! progress to a [`Progress`] sink while it runs, close the task, deliver `agent/<tid>`, and
//! return a typed [`RunSummary`].
//!
//! A cancelled [`CancellationToken`] (Ctrl-C) stops cleanly at any point: before the agent
//! starts, what was opened is closed ([`CliError::Interrupted`]); after, the run is deleted
//! (the launcher kills the sandbox and hands the workspace back before it answers) and the
//! gateway task closed, and the summary says `interrupted`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use agentbox_api::ClientError;
use agentbox_api::gateway::{Budget, OpenTask, Remaining, TaskUsage, TaskView};
use agentbox_api::launcher::{
    AgentRequest, AgentStatus, DeliverRequest, RunState, SnapshotRequest,
};
use agentbox_policy::id::Tid;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::daemons::Daemons;
use crate::error::{CliError, Daemon};

/// What to run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The repository (any path to its top level; made absolute here).
    pub repo: PathBuf,
    /// The commit to snapshot (default: `HEAD`).
    pub git_ref: Option<String>,
    /// An agentbox model id from the catalogue.
    pub model: String,
    /// What the agent is asked to do; it reaches the agent on its standard input.
    pub prompt: String,
    /// The task id (default: a fresh random one).
    pub tid: Option<Tid>,
    /// The gateway budget; `None` parts are unlimited.
    pub budget: Budget,
    /// The agent's wall-clock limit.
    pub timeout_s: u64,
    /// A venv under `launcher.venv_root`, mounted at `/opt/venv`.
    pub venv: Option<String>,
    /// Extra environment for the agent (the launcher's allowlist decides).
    pub env: BTreeMap<String, String>,
    /// Leave `agent/<tid>` in the task's shadow repository instead of delivering it.
    pub keep: bool,
    /// The model name Claude Code is told (the gateway rewrites it to the catalogue's).
    pub claude_model: String,
    /// How often progress is polled.
    pub poll: Duration,
}

/// How a run ended; each has its exit code in [`crate::error::EXIT_CODES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The agent exited 0.
    Succeeded,
    /// The agent exited non-zero.
    AgentFailed,
    /// The gateway refused a request because the budget was spent.
    BudgetExhausted,
    /// The agent ran past its timeout.
    TimedOut,
    /// The sandbox's memory limit killed it.
    OomKilled,
    /// The workspace reached `launcher.limits.disk_mb`.
    DiskExceeded,
    /// The sandbox could not be set up, or the run was lost or killed from outside.
    Failed,
    /// Ctrl-C: stopped and cleaned up.
    Interrupted,
}

impl Outcome {
    /// The documented exit code.
    pub fn exit_code(self) -> u8 {
        match self {
            Outcome::Succeeded => 0,
            Outcome::AgentFailed => 1,
            Outcome::BudgetExhausted => 3,
            Outcome::TimedOut => 4,
            Outcome::OomKilled => 5,
            Outcome::DiskExceeded => 6,
            Outcome::Failed => 7,
            Outcome::Interrupted => 130,
        }
    }

    /// One line for people: what happened and what to do; `None` for success.
    pub fn advice(self) -> Option<&'static str> {
        match self {
            Outcome::Succeeded => None,
            Outcome::AgentFailed => Some(
                "the agent exited non-zero; read its output with `agentbox logs TID` and retry",
            ),
            Outcome::BudgetExhausted => Some(
                "the task's budget is exhausted; run again with a larger --budget-tokens/--budget-usd",
            ),
            Outcome::TimedOut => Some(
                "the agent ran past its timeout and was killed; run again with a larger --timeout",
            ),
            Outcome::OomKilled => Some(
                "the agent was killed for using too much memory; raise launcher.limits.memory_mb or ask for less",
            ),
            Outcome::DiskExceeded => Some(
                "the workspace reached launcher.limits.disk_mb and the run was stopped; raise the limit or clean the repository",
            ),
            Outcome::Failed => Some(
                "the sandbox could not run the agent (or it was stopped from outside); see the error above and `agentbox status`",
            ),
            Outcome::Interrupted => Some(
                "interrupted: the sandbox was stopped, the workspace handed back and the gateway task closed",
            ),
        }
    }
}

/// One commit the agent made.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Commit {
    /// Full hash.
    pub sha: String,
    /// First line of the message.
    pub subject: String,
}

/// What a run did, for people and (`--json`) for scripts.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    /// The task id.
    pub tid: String,
    /// The agentbox model id.
    pub model: String,
    /// The repository's top level.
    pub repo: PathBuf,
    /// The snapshot commit the agent started from.
    pub base_sha: String,
    /// How it ended.
    pub outcome: Outcome,
    /// The launcher's final run state.
    pub state: RunState,
    /// The agent's exit status (`128 + signal` when killed).
    pub exit_code: Option<i32>,
    /// Killed by the memory limit.
    pub oom_killed: bool,
    /// Killed at the timeout.
    pub timed_out: bool,
    /// Stopped at the disk limit.
    pub disk_exceeded: bool,
    /// `agent/<tid>` in the shadow repository.
    pub result_commit: Option<String>,
    /// The branch delivered into the repository, if it was.
    pub branch: Option<String>,
    /// The agent's commits on top of the snapshot (known once delivered).
    pub commits: Vec<Commit>,
    /// `git diff --stat` of the delivered branch against the snapshot.
    pub diffstat: Option<String>,
    /// What the gateway metered.
    pub usage: TaskUsage,
    /// The budget the task had.
    pub budget: Budget,
    /// What is left of it.
    pub remaining: Remaining,
    /// Wall-clock seconds, snapshot to summary.
    pub elapsed_s: f64,
    /// Claude Code's final answer (its stream-json `result`), if it gave one.
    pub result: Option<String>,
    /// Why starting, handing back or collecting went wrong, if the launcher said so.
    pub error: Option<String>,
}

/// A progress report while a run is under way.
#[derive(Debug, Clone)]
pub struct Tick {
    /// Since the run started.
    pub elapsed: Duration,
    /// The launcher's run state.
    pub state: RunState,
    /// The gateway's view of the task (usage, budget left), if it answered.
    pub task: Option<TaskView>,
    /// The agent's last tool call or words, from its stream-json output.
    pub last_action: Option<String>,
}

/// What happens during a run, in order.
#[derive(Debug, Clone)]
pub enum Event<'a> {
    /// The repository was copied.
    Snapshot {
        /// The task id.
        tid: &'a str,
        /// The commit copied.
        sha: &'a str,
    },
    /// The agent runs in its sandbox.
    Started {
        /// The task id.
        tid: &'a str,
    },
    /// A poll.
    Tick(&'a Tick),
    /// Ctrl-C: the run is being stopped.
    Stopping,
    /// The run ended.
    Finished(&'a AgentStatus),
    /// `agent/<tid>` is in the repository.
    Delivered {
        /// The branch.
        branch: &'a str,
        /// Its commit.
        sha: &'a str,
    },
}

/// Where progress goes (a terminal line, plain lines, MCP notifications). `Send` so a run can
/// be a spawned task (each MCP request is one).
pub trait Progress: Send {
    /// Called for every event, in order.
    fn event(&mut self, event: &Event<'_>);
}

/// A sink that drops everything.
#[derive(Debug, Default)]
pub struct Silent;

impl Progress for Silent {
    fn event(&mut self, _: &Event<'_>) {}
}

/// `n` random bytes as lowercase hex.
fn random_hex(n: usize) -> Result<String, CliError> {
    let mut buf = vec![0u8; n];
    getrandom::fill(&mut buf).map_err(|e| CliError::Io {
        what: "reading random bytes".to_owned(),
        reason: e.to_string(),
    })?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// A fresh task id: `r` and 12 random hex digits.
///
/// # Errors
/// When the kernel gives no random bytes.
pub fn fresh_tid() -> Result<Tid, CliError> {
    let tid = format!("r{}", random_hex(6)?);
    Tid::parse(&tid).map_err(|e| CliError::Usage(e.to_string()))
}

/// A fresh task token: 24 random bytes as hex.
///
/// # Errors
/// When the kernel gives no random bytes.
pub fn fresh_token() -> Result<String, CliError> {
    random_hex(24)
}

/// Runs an agent on `opts.repo` (see the module docs).
///
/// # Errors
/// Anything that stops the run from starting (unknown model, bad repository, a daemon down or
/// refusing), a daemon failing while it runs, delivery failing, or Ctrl-C before the agent
/// started. A run that starts always ends in a summary, whatever the agent did.
pub async fn run(
    d: &Daemons,
    opts: &RunOptions,
    progress: &mut dyn Progress,
    cancel: &CancellationToken,
) -> Result<RunSummary, CliError> {
    let started = Instant::now();
    if d.config.model(&opts.model).is_none() {
        return Err(CliError::UnknownModel {
            model: opts.model.clone(),
            known: d.config.models.keys().map(ToString::to_string).collect(),
        });
    }
    let repo = std::fs::canonicalize(&opts.repo).map_err(|e| CliError::BadRepo {
        path: opts.repo.clone(),
        reason: e.to_string(),
    })?;
    if !repo.is_dir() {
        return Err(CliError::BadRepo {
            path: opts.repo.clone(),
            reason: "not a directory".to_owned(),
        });
    }
    d.probe_both().await?;
    let tid = match &opts.tid {
        Some(t) => t.clone(),
        None => fresh_tid()?,
    };
    let token = fresh_token()?;
    let tid_s = tid.as_str().to_owned();

    let snapshot = SnapshotRequest {
        tid: tid_s.clone(),
        path: repo.display().to_string(),
        git_ref: opts.git_ref.clone(),
    };
    let snap = tokio::select! {
        r = d.launcher.snapshot(&snapshot) => r.map_err(|e| snapshot_error(d, &repo, &tid_s, e))?,
        () = cancel.cancelled() => return Err(CliError::Interrupted),
    };
    progress.event(&Event::Snapshot {
        tid: &tid_s,
        sha: &snap.sha,
    });

    let open = OpenTask {
        tid: tid_s.clone(),
        model: opts.model.clone(),
        token: token.clone(),
        budget: opts.budget,
    };
    let opened = tokio::select! {
        r = d.gateway.open_task(&open) => r,
        () = cancel.cancelled() => {
            close_quietly(d, &tid).await;
            return Err(CliError::Interrupted);
        }
    };
    opened.map_err(|e| d.error(Daemon::Gateway, Some(&tid_s), e))?;

    let agent = AgentRequest {
        tid: tid_s.clone(),
        model: opts.model.clone(),
        cmd: agentbox_api::launcher::claude_print_cmd(&opts.claude_model),
        env: opts.env.clone(),
        venv: opts.venv.clone(),
        timeout_s: opts.timeout_s,
        token: Some(token),
        stdin: Some(opts.prompt.clone()),
    };
    // Not raced against Ctrl-C: a start cut off half-way could leave a sandbox nobody stops.
    if let Err(e) = d.launcher.start_agent(&agent).await {
        close_quietly(d, &tid).await;
        return Err(d.error(Daemon::Launcher, Some(&tid_s), e));
    }
    progress.event(&Event::Started { tid: &tid_s });

    let (status, interrupted) = match watch(d, &tid, opts.poll, started, progress, cancel).await {
        Ok(done) => done,
        Err(e) => {
            // The run cannot be watched any more (the launcher failed to answer, or someone
            // else removed it): stop it rather than leave a sandbox nobody delivers. After a
            // Ctrl-C the watch's own stop was that attempt.
            if !cancel.is_cancelled()
                && let Err(stop) = d.launcher.delete_agent(&tid).await
            {
                tracing::debug!(error = %stop, "stopping an unwatched run");
            }
            close_quietly(d, &tid).await;
            return Err(e);
        }
    };
    progress.event(&Event::Finished(&status));
    let view = d
        .gateway
        .close_task(&tid)
        .await
        .map_err(|e| d.error(Daemon::Gateway, Some(&tid_s), e))?;

    let outcome = outcome(&status, &view, interrupted);
    let mut summary = RunSummary {
        tid: tid_s.clone(),
        model: opts.model.clone(),
        repo: repo.clone(),
        base_sha: snap.sha.clone(),
        outcome,
        state: status.state,
        exit_code: status.exit_code,
        oom_killed: status.oom_killed,
        timed_out: status.timed_out,
        disk_exceeded: status.disk_exceeded,
        result_commit: status.result_commit.clone(),
        branch: None,
        commits: Vec::new(),
        diffstat: None,
        usage: view.usage,
        budget: view.budget,
        remaining: view.remaining,
        elapsed_s: 0.0,
        result: stream_json_result(&status.stdout),
        error: status.error.clone(),
    };
    let changed = status.result_commit.as_deref().filter(|c| *c != snap.sha);
    if let (false, false, Some(_)) = (interrupted, opts.keep, changed) {
        let branch = format!("agent/{tid_s}");
        let delivered = d
            .launcher
            .deliver(&DeliverRequest {
                tid: tid_s.clone(),
                path: repo.display().to_string(),
                branch: branch.clone(),
            })
            .await
            .map_err(|e| d.error(Daemon::Launcher, Some(&tid_s), e))?;
        progress.event(&Event::Delivered {
            branch: &branch,
            sha: &delivered.sha,
        });
        summary.commits = git_commits(&repo, &snap.sha, &delivered.sha).await;
        summary.diffstat = git_diffstat(&repo, &snap.sha, &delivered.sha).await;
        summary.branch = Some(branch);
    }
    summary.elapsed_s = started.elapsed().as_secs_f64();
    Ok(summary)
}

/// Polls the run until it ends, reporting each poll; on Ctrl-C deletes it (the launcher
/// answers once the sandbox is gone and the workspace handed back). Returns the final status
/// and whether it was interrupted.
async fn watch(
    d: &Daemons,
    tid: &Tid,
    poll: Duration,
    started: Instant,
    progress: &mut dyn Progress,
    cancel: &CancellationToken,
) -> Result<(AgentStatus, bool), CliError> {
    let launcher_err = |e| d.error(Daemon::Launcher, Some(tid.as_str()), e);
    let mut interval = tokio::time::interval(poll);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = interval.tick() => {}
            () = cancel.cancelled() => {
                progress.event(&Event::Stopping);
                let status = d.launcher.delete_agent(tid).await.map_err(launcher_err)?;
                return Ok((status, true));
            }
        }
        let status = d.launcher.agent(tid).await.map_err(launcher_err)?;
        let tick = Tick {
            elapsed: started.elapsed(),
            state: status.state,
            task: d.gateway.task(tid).await.ok(),
            last_action: last_action(&status.stdout),
        };
        progress.event(&Event::Tick(&tick));
        if status.state.is_done() {
            return Ok((status, false));
        }
    }
}

/// Closes the gateway task on a path that is already failing (its own failure adds nothing).
async fn close_quietly(d: &Daemons, tid: &Tid) {
    let _ = d.gateway.close_task(tid).await;
}

/// A snapshot refusal about the path or ref is the repository's fault.
fn snapshot_error(d: &Daemons, repo: &Path, tid: &str, e: ClientError) -> CliError {
    let about_repo = matches!(
        e.code(),
        Some("invalid_path" | "not_found" | "unsafe_path" | "invalid_ref" | "git_failed")
    );
    if let (true, ClientError::Api { error, .. }) = (about_repo, &e) {
        return CliError::BadRepo {
            path: repo.to_path_buf(),
            reason: error.message.clone(),
        };
    }
    d.error(Daemon::Launcher, Some(tid), e)
}

/// How the run ended, from the launcher's final status and the gateway's view.
fn outcome(status: &AgentStatus, view: &TaskView, interrupted: bool) -> Outcome {
    if interrupted {
        return Outcome::Interrupted;
    }
    if status.oom_killed {
        return Outcome::OomKilled;
    }
    if status.timed_out {
        return Outcome::TimedOut;
    }
    if status.disk_exceeded {
        return Outcome::DiskExceeded;
    }
    match status.state {
        RunState::Exited if status.exit_code == Some(0) && !result_is_error(&status.stdout) => {
            Outcome::Succeeded
        }
        RunState::Exited if budget_spent(view, &status.stdout) => Outcome::BudgetExhausted,
        RunState::Exited => Outcome::AgentFailed,
        RunState::TimedOut => Outcome::TimedOut,
        RunState::DiskExceeded => Outcome::DiskExceeded,
        RunState::Starting
        | RunState::Running
        | RunState::Stopping
        | RunState::Finishing
        | RunState::Killed
        | RunState::Failed
        | RunState::Lost => Outcome::Failed,
    }
}

/// The gateway refused for the budget: nothing left, or its 403 message in the agent's
/// output (a request can be refused with some budget left when its reservation does not fit).
fn budget_spent(view: &TaskView, stdout: &str) -> bool {
    view.remaining.tokens == Some(0)
        || view.remaining.usd.is_some_and(|u| u <= 0.0)
        || stdout.contains("budget exhausted")
}

/// The stream-json events of Claude Code's output, newest first.
fn events_rev(stdout: &str) -> impl Iterator<Item = serde_json::Value> + '_ {
    stdout
        .lines()
        .rev()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
}

/// The `result` event's text.
fn stream_json_result(stdout: &str) -> Option<String> {
    events_rev(stdout)
        .find(|e| e["type"] == "result")
        .and_then(|e| e["result"].as_str().map(str::to_owned))
}

fn result_is_error(stdout: &str) -> bool {
    events_rev(stdout)
        .find(|e| e["type"] == "result")
        .is_some_and(|e| e["is_error"] == true)
}

/// Longest last-action text shown.
const ACTION_CHARS: usize = 72;

/// The agent's last tool call (`Bash: cargo test`) or words, from its stream-json output.
pub fn last_action(stdout: &str) -> Option<String> {
    let event = events_rev(stdout).find(|e| e["type"] == "assistant")?;
    let content = event["message"]["content"].as_array()?;
    let block = content.last()?;
    let text = if block["type"] == "tool_use" {
        let input = &block["input"];
        let detail = [
            "command",
            "file_path",
            "pattern",
            "path",
            "url",
            "description",
        ]
        .iter()
        .find_map(|k| input[*k].as_str())
        .unwrap_or_default();
        format!("{}: {detail}", block["name"].as_str().unwrap_or("tool"))
    } else {
        block["text"].as_str()?.to_owned()
    };
    let line = text.lines().find(|l| !l.trim().is_empty())?.trim();
    Some(if line.chars().count() > ACTION_CHARS {
        let cut: String = line.chars().take(ACTION_CHARS - 1).collect();
        format!("{cut}…")
    } else {
        line.to_owned()
    })
}

/// git in the operator's repository, reading only: no system or global config, no fsmonitor,
/// any owner accepted (the CLI may run as root on the service user's repository).
pub(crate) async fn git(repo: &Path, args: &[&str]) -> Option<String> {
    git_checked(repo, args).await.ok()
}

/// [`git`], with why it failed (its stderr, or why it could not start).
pub(crate) async fn git_checked(repo: &Path, args: &[&str]) -> Result<String, String> {
    let out = tokio::process::Command::new("git")
        .arg("-C")
        .arg(repo)
        .args(["-c", "safe.directory=*", "-c", "core.fsmonitor=false"])
        .args(args)
        .env_clear()
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| e.to_string())?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

async fn git_commits(repo: &Path, base: &str, head: &str) -> Vec<Commit> {
    let range = format!("{base}..{head}");
    let log = git(repo, &["log", "--format=%H%x09%s", &range])
        .await
        .unwrap_or_default();
    log.lines()
        .filter_map(|l| l.split_once('\t'))
        .map(|(sha, subject)| Commit {
            sha: sha.to_owned(),
            subject: subject.to_owned(),
        })
        .collect()
}

async fn git_diffstat(repo: &Path, base: &str, head: &str) -> Option<String> {
    git(repo, &["diff", "--stat", base, head])
        .await
        .map(|s| s.trim_end().to_owned())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn last_action_reads_the_newest_tool_call() {
        let out = concat!(
            r#"{"type":"assistant","message":{"content":[{"type":"text","text":"looking"}]}}"#,
            "\n",
            r#"{"type":"assistant","message":{"content":[{"type":"tool_use","name":"Bash","input":{"command":"cargo test\nmore"}}]}}"#,
            "\n",
            r#"{"type":"user","message":{"content":[]}}"#,
            "\nnot json\n"
        );
        assert_eq!(last_action(out).unwrap(), "Bash: cargo test");
        assert_eq!(last_action("").as_deref(), None);
        let long = format!(
            r#"{{"type":"assistant","message":{{"content":[{{"type":"text","text":"{}"}}]}}}}"#,
            "x".repeat(200)
        );
        assert_eq!(last_action(&long).unwrap().chars().count(), ACTION_CHARS);
    }

    #[test]
    fn fresh_ids_are_valid_and_differ() {
        let a = fresh_tid().unwrap();
        let b = fresh_tid().unwrap();
        assert_ne!(a, b);
        assert_eq!(a.as_str().len(), 13);
    }
}
