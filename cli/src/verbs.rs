//! The operator's verbs beside `run`: `status`, `logs`, `stop`, `check`, `deliver` and
//! `backends`. Each is one or two calls through `agentbox-api`; failures go through
//! [`Daemons::error`] so every verb reports the same way.

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;
use std::time::Duration;

use agentbox_api::gateway::{GatewayStatus, TaskState};
use agentbox_api::launcher::{CheckRequest, DeliverRequest, LauncherStatus};
use agentbox_policy::id::Tid;

use crate::daemons::Daemons;
use crate::error::{CliError, Daemon};
use crate::render::grouped;

fn io(what: &str) -> impl Fn(std::io::Error) -> CliError + '_ {
    move |e| CliError::Io {
        what: what.to_owned(),
        reason: e.to_string(),
    }
}

/// Writes `text` to stdout.
fn out(text: &str) -> Result<(), CliError> {
    std::io::stdout()
        .lock()
        .write_all(text.as_bytes())
        .map_err(io("writing to stdout"))
}

/// `call` on `daemon` once its socket answers; either failure as the error people see.
async fn reach<T>(
    d: &Daemons,
    daemon: Daemon,
    call: impl std::future::Future<Output = Result<T, agentbox_api::ClientError>>,
) -> Result<T, CliError> {
    d.probe(daemon).await?;
    call.await.map_err(|e| d.error(daemon, None, e))
}

/// `agentbox status`: both daemons (each may be down), tasks, backends, host readiness. Exits
/// with the first unreachable daemon's code, after printing what it could.
pub async fn status(d: &Daemons, json: bool) -> Result<ExitCode, CliError> {
    let launcher = reach(d, Daemon::Launcher, d.launcher.status()).await;
    let gateway = reach(d, Daemon::Gateway, d.gateway.status()).await;
    if json {
        let part = |r: Result<serde_json::Value, &CliError>| match r {
            Ok(v) => v,
            Err(e) => serde_json::json!({"error": e.to_string(), "exit_code": e.exit_code()}),
        };
        let body = serde_json::json!({
            "launcher": part(launcher.as_ref().map(|s| serde_json::to_value(s).unwrap_or_default())),
            "gateway": part(gateway.as_ref().map(|s| serde_json::to_value(s).unwrap_or_default())),
        });
        out(&format!("{body}\n"))?;
    } else {
        out(&status_text(launcher.as_ref(), gateway.as_ref()))?;
    }
    let code = [launcher.err(), gateway.err()]
        .into_iter()
        .flatten()
        .map(|e| e.exit_code())
        .next()
        .unwrap_or(0);
    Ok(ExitCode::from(code))
}

fn status_text(
    launcher: Result<&LauncherStatus, &CliError>,
    gateway: Result<&GatewayStatus, &CliError>,
) -> String {
    let mut s = String::new();
    match launcher {
        Ok(l) => {
            let host = if l.host.ready {
                "host ready".to_owned()
            } else {
                format!("HOST NOT READY: {}", l.host.reasons.join("; "))
            };
            let disk = l.disk.as_ref().map_or_else(String::new, |d| {
                format!(
                    " · disk {} MB per run ({})",
                    grouped(d.limit_mb),
                    d.mode.as_str()
                )
            });
            s.push_str(&format!(
                "launcher  running · {} agents, {} checks · {host}{disk}\n",
                l.agents.len(),
                l.checks.len()
            ));
            for (name, c) in [
                ("bwrap", &l.host.bwrap),
                ("user namespaces", &l.host.user_namespaces),
                ("cgroups", &l.host.cgroups),
            ] {
                let mark = if c.ok { "ok" } else { "MISSING" };
                s.push_str(&format!("  {name:<16} {mark:<8} {}\n", c.detail));
            }
        }
        Err(e) => s.push_str(&format!("launcher  {e}\n")),
    }
    match gateway {
        Ok(g) => s.push_str(&format!(
            "gateway   running · {} open tasks · bridge token {}\n",
            g.open_tasks,
            if g.bridge_token { "set" } else { "not set" }
        )),
        Err(e) => s.push_str(&format!("gateway   {e}\n")),
    }
    let runs = launcher.map(|l| l.agents.as_slice()).unwrap_or_default();
    if let Ok(g) = gateway {
        s.push_str(&format!(
            "\n{:<20} {:<14} {:<8} {:<10} {:>8} {:>12} {:>10}  {}\n",
            "TASK", "MODEL", "GATEWAY", "RUN", "REQUESTS", "TOKENS", "COST", "BUDGET LEFT"
        ));
        for t in &g.tasks {
            let run = runs
                .iter()
                .find(|r| r.tid == t.tid)
                .map_or("-", |r| r.state.as_str());
            let state = match t.state {
                TaskState::Open => "open",
                TaskState::Closed => "closed",
            };
            let mut left = Vec::new();
            if let Some(tok) = t.remaining.tokens {
                left.push(format!("{} tokens", grouped(tok)));
            }
            if let Some(usd) = t.remaining.usd {
                left.push(format!("${usd:.4}"));
            }
            s.push_str(&format!(
                "{:<20} {:<14} {:<8} {:<10} {:>8} {:>12} {:>10}  {}\n",
                t.tid,
                t.model,
                state,
                run,
                t.usage.requests,
                grouped(t.usage.total_tokens),
                format!("${:.4}", t.usage.cost_usd),
                if left.is_empty() {
                    "unlimited".to_owned()
                } else {
                    left.join(", ")
                }
            ));
        }
    }
    if let Ok(l) = launcher
        && !l.backends.is_empty()
    {
        s.push_str(&format!(
            "\n{:<20} {:<10} {:>6} {:>7}  {}\n",
            "BACKEND", "STATE", "PORT", "AGENTS", "ERROR"
        ));
        for b in &l.backends {
            s.push_str(&format!(
                "{:<20} {:<10} {:>6} {:>7}  {}\n",
                b.model,
                b.state.as_str(),
                b.port,
                b.agents,
                b.error.as_deref().unwrap_or("")
            ));
        }
    }
    s
}

/// How often `logs --follow` polls.
const FOLLOW_POLL: Duration = Duration::from_millis(500);

/// `agentbox logs TID [--follow]`: the run's output; following prints what is new until the
/// run ends.
pub async fn logs(
    d: &Daemons,
    tid: &Tid,
    follow: bool,
    stderr: bool,
) -> Result<ExitCode, CliError> {
    d.probe(Daemon::Launcher).await?;
    let mut shown = 0usize;
    loop {
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
        if let Some(new) = text.get(shown..) {
            out(new)?;
            shown = text.len();
        }
        if !follow || status.state.is_done() {
            return Ok(ExitCode::SUCCESS);
        }
        tokio::time::sleep(FOLLOW_POLL).await;
    }
}

/// `agentbox stop TID`: deletes the run (the launcher answers once the sandbox is gone and the
/// workspace handed back) and closes the gateway task. Unknown to both is an error.
pub async fn stop(d: &Daemons, tid: &Tid) -> Result<ExitCode, CliError> {
    d.probe_both().await?;
    let run = d.launcher.delete_agent(tid).await;
    let task = d.gateway.close_task(tid).await;
    let mut lines = String::new();
    let mut known = false;
    match run {
        Ok(s) => {
            known = true;
            lines.push_str(&format!("run {tid}: {}\n", s.state));
        }
        Err(e) if e.code() == Some("unknown_task") => {}
        Err(e) => return Err(d.error(Daemon::Launcher, Some(tid.as_str()), e)),
    }
    match task {
        Ok(v) => {
            known = true;
            lines.push_str(&format!(
                "gateway task {tid}: closed ({} requests, {} tokens, ${:.4})\n",
                v.usage.requests,
                grouped(v.usage.total_tokens),
                v.usage.cost_usd
            ));
        }
        Err(e) if e.code() == Some("no_such_task") => {}
        Err(e) => return Err(d.error(Daemon::Gateway, Some(tid.as_str()), e)),
    }
    if !known {
        return Err(CliError::UnknownTask {
            daemon: Daemon::Launcher,
            tid: tid.to_string(),
        });
    }
    out(&lines)?;
    Ok(ExitCode::SUCCESS)
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

/// `agentbox check TID -- CMD...`: runs the command in a sandbox on the workspace; prints its
/// output and exits with its status (4 at the timeout, 5 for OOM, as `run`).
pub async fn check(
    d: &Daemons,
    tid: &Tid,
    timeout_s: u64,
    venv: Option<String>,
    command: &[String],
) -> Result<ExitCode, CliError> {
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
    out(&r.stdout)?;
    eprint!("{}", r.stderr);
    let code = if r.timed_out {
        eprintln!("agentbox: the check ran past --timeout {timeout_s}s and was killed");
        4
    } else if r.oom_killed {
        eprintln!("agentbox: the check was killed for using too much memory");
        5
    } else if r.setup_failed {
        eprintln!("agentbox: the sandbox could not be set up for the check (see above)");
        7
    } else {
        r.exit_code.and_then(|c| u8::try_from(c).ok()).unwrap_or(1)
    };
    Ok(ExitCode::from(code))
}

/// `agentbox deliver TID --repo PATH`: `agent/<tid>` into the repository.
pub async fn deliver(d: &Daemons, tid: &Tid, repo: &Path) -> Result<ExitCode, CliError> {
    d.probe(Daemon::Launcher).await?;
    let path = std::fs::canonicalize(repo).map_err(|e| CliError::BadRepo {
        path: repo.to_path_buf(),
        reason: e.to_string(),
    })?;
    let r = d
        .launcher
        .deliver(&DeliverRequest {
            tid: tid.to_string(),
            path: path.display().to_string(),
            branch: format!("agent/{tid}"),
        })
        .await
        .map_err(|e| d.error(Daemon::Launcher, Some(tid.as_str()), e))?;
    out(&format!("{} -> {} in {}\n", r.branch, r.sha, r.repo))?;
    Ok(ExitCode::SUCCESS)
}

/// `agentbox backends start MODEL`.
pub async fn backend_start(d: &Daemons, model: &str) -> Result<ExitCode, CliError> {
    let id = agentbox_policy::config::ModelId::parse(model)
        .ok()
        .filter(|m| d.config.models.contains_key(m))
        .ok_or_else(|| CliError::UnknownModel {
            model: model.to_owned(),
            known: d.config.models.keys().map(ToString::to_string).collect(),
        })?;
    let r = reach(d, Daemon::Launcher, d.launcher.start_backend(&id)).await?;
    let stopped = if r.stopped.is_empty() {
        String::new()
    } else {
        format!(" (stopped {})", r.stopped.join(", "))
    };
    out(&format!(
        "{}: {} on 127.0.0.1:{}{stopped}\n",
        r.backend.model,
        r.backend.state.as_str(),
        r.backend.port
    ))?;
    Ok(ExitCode::SUCCESS)
}

/// `agentbox backends stop`.
pub async fn backends_stop(d: &Daemons) -> Result<ExitCode, CliError> {
    let r = reach(d, Daemon::Launcher, d.launcher.stop_backends()).await?;
    out(&if r.stopped.is_empty() {
        "no backend was running\n".to_owned()
    } else {
        format!("stopped {}\n", r.stopped.join(", "))
    })?;
    Ok(ExitCode::SUCCESS)
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
