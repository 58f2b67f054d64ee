//! What people see: the progress of a run on stderr (one spinner line on a terminal, plain
//! lines otherwise), the run's summary and the other verbs' results as text. The MCP server
//! sends the same lines as its progress messages. Numbers are grouped (`12,345`) so a budget
//! reads at a glance.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use agentbox_api::gateway::{Budget, Remaining, TaskState, TaskView};
use agentbox_api::launcher::{BackendStartResult, BackendStopResult, DeliverResult};
use agentbox_api::pool::{PoolStatus, SlotState};

use crate::run::{Event, Outcome, Progress, RunSummary, Tick};
use crate::verbs::{StatusReport, Stopped};

/// `12345` → `12,345`.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// `83s` → `1m23s`.
fn duration(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 60 {
        format!("{}m{:02}s", s / 60, s % 60)
    } else {
        format!("{s}s")
    }
}

/// What is left of a budget, or `no budget`.
fn left(budget: &Budget, remaining: &Remaining) -> String {
    let mut parts = Vec::new();
    if let (Some(_), Some(t)) = (budget.tokens, remaining.tokens) {
        parts.push(format!("{} tokens left", grouped(t)));
    }
    if let (Some(_), Some(u)) = (budget.usd, remaining.usd) {
        parts.push(format!("${u:.4} left"));
    }
    if parts.is_empty() {
        "no budget".to_owned()
    } else {
        parts.join(", ")
    }
}

/// The status of a run in one line, without the elapsed time.
pub fn tick_line(tick: &Tick) -> String {
    let mut line = tick.state.to_string();
    if let Some(TaskView {
        usage,
        budget,
        remaining,
        ..
    }) = &tick.task
    {
        line.push_str(&format!(
            " · {} requests · {} tokens · ${:.4} · {}",
            usage.requests,
            grouped(usage.total_tokens),
            usage.cost_usd,
            left(budget, remaining)
        ));
    }
    if let Some(action) = &tick.last_action {
        line.push_str(" · ");
        line.push_str(action);
    }
    line
}

const SPINNER: [char; 10] = ['⠋', '⠙', '⠹', '⠸', '⠼', '⠴', '⠦', '⠧', '⠇', '⠏'];

/// Progress on stderr: a spinner line redrawn in place on a terminal, else one plain line per
/// change (so a log file gets a line when something happens, not every poll).
#[derive(Debug)]
pub struct Terminal {
    tty: bool,
    frame: usize,
    spinning: bool,
    last: Option<String>,
}

impl Terminal {
    /// On stderr, as a spinner if stderr is a terminal.
    pub fn stderr() -> Self {
        Terminal {
            tty: std::io::stderr().is_terminal(),
            frame: 0,
            spinning: false,
            last: None,
        }
    }

    fn line(&mut self, text: &str) {
        let mut err = std::io::stderr().lock();
        if self.spinning {
            let _ = write!(err, "\r\x1b[2K");
            self.spinning = false;
        }
        let _ = writeln!(err, "{text}");
    }
}

/// One line for an event (a tick with its elapsed time), as plain progress shows it.
pub fn event_line(event: &Event<'_>) -> String {
    match event {
        Event::Snapshot { tid, sha } => {
            let short = sha.get(..12).unwrap_or(sha);
            format!("task {tid}: snapshot of {short}")
        }
        Event::Started { tid } => {
            format!("task {tid}: Claude Code runs in the sandbox (Ctrl-C stops it)")
        }
        Event::Tick(tick) => format!("[{}] {}", duration(tick.elapsed), tick_line(tick)),
        Event::Stopping => {
            "stopping: killing the sandbox, handing the workspace back, closing the gateway task"
                .to_owned()
        }
        Event::Finished(status) => {
            let code = status
                .exit_code
                .map_or_else(|| "no exit code".to_owned(), |c| format!("exit {c}"));
            format!("agent {} ({code})", status.state)
        }
        Event::Delivered { branch, sha } => {
            let short = sha.get(..12).unwrap_or(sha);
            format!("delivered {branch} ({short})")
        }
    }
}

impl Progress for Terminal {
    fn event(&mut self, event: &Event<'_>) {
        let Event::Tick(tick) = event else {
            self.line(&event_line(event));
            return;
        };
        let line = tick_line(tick);
        if self.tty {
            let spin = SPINNER.get(self.frame % SPINNER.len()).unwrap_or(&'*');
            self.frame += 1;
            let mut err = std::io::stderr().lock();
            let _ = write!(err, "\r\x1b[2K{spin} {} · {line}", duration(tick.elapsed));
            let _ = err.flush();
            self.spinning = true;
        } else if self.last.as_deref() != Some(line.as_str()) {
            self.line(&event_line(event));
            self.last = Some(line);
        }
    }
}

/// The summary as people read it.
pub fn summary_text(s: &RunSummary) -> String {
    let mut out = format!("task      {} (model {})\n", s.tid, s.model);
    let exit = s
        .exit_code
        .map_or_else(|| "no exit code".to_owned(), |c| format!("exit {c}"));
    let outcome = match s.outcome {
        Outcome::Succeeded => "succeeded",
        Outcome::AgentFailed => "agent failed",
        Outcome::BudgetExhausted => "budget exhausted",
        Outcome::TimedOut => "timed out",
        Outcome::OomKilled => "killed: out of memory (OOM)",
        Outcome::DiskExceeded => "stopped: disk limit",
        Outcome::Failed => "failed",
        Outcome::Interrupted => "interrupted",
    };
    out.push_str(&format!("outcome   {outcome} ({}, {exit})\n", s.state));
    match (&s.branch, &s.result_commit) {
        (Some(b), Some(c)) => out.push_str(&format!(
            "branch    {b} -> {} in {}\n",
            c.get(..12).unwrap_or(c),
            s.repo.display()
        )),
        (None, Some(c)) if c != &s.base_sha => out.push_str(&format!(
            "branch    not delivered (agent/{} is {} in the task's shadow repository; `agentbox deliver {} --repo {}`)\n",
            s.tid,
            c.get(..12).unwrap_or(c),
            s.tid,
            s.repo.display()
        )),
        (Some(_) | None, Some(_) | None) => out.push_str("branch    none (no changes)\n"),
    }
    if !s.commits.is_empty() {
        out.push_str(&format!("commits   {}\n", s.commits.len()));
        for c in &s.commits {
            out.push_str(&format!(
                "  {} {}\n",
                c.sha.get(..12).unwrap_or(&c.sha),
                c.subject
            ));
        }
    }
    if let Some(stat) = s.diffstat.as_deref().filter(|d| !d.is_empty()) {
        out.push_str("diffstat\n");
        for l in stat.lines() {
            out.push_str(&format!("  {}\n", l.trim()));
        }
    }
    let u = &s.usage;
    out.push_str(&format!(
        "usage     {} requests, {} tokens (input {}, output {}, cache read {}, cache write {}), ${:.4}\n",
        u.requests,
        grouped(u.total_tokens),
        grouped(u.input_tokens),
        grouped(u.output_tokens),
        grouped(u.cache_read_input_tokens),
        grouped(u.cache_creation_input_tokens),
        u.cost_usd
    ));
    let mut budget = Vec::new();
    if let Some(t) = s.budget.tokens {
        budget.push(format!("{} tokens", grouped(t)));
    }
    if let Some(usd) = s.budget.usd {
        budget.push(format!("${usd:.4}"));
    }
    if budget.is_empty() {
        out.push_str("budget    none\n");
    } else {
        out.push_str(&format!(
            "budget    {}: {}\n",
            budget.join(" and "),
            left(&s.budget, &s.remaining)
        ));
    }
    out.push_str(&format!("time      {:.1}s\n", s.elapsed_s));
    if let Some(e) = &s.error {
        out.push_str(&format!("error     {e}\n"));
    }
    out
}

/// The name `pool status` shows for a slot state (the API's spelling).
fn slot_state(s: SlotState) -> &'static str {
    match s {
        SlotState::Empty => "EMPTY",
        SlotState::Starting => "STARTING",
        SlotState::Ready => "READY",
        SlotState::Leased => "LEASED",
        SlotState::Releasing => "RELEASING",
        SlotState::Restarting => "RESTARTING",
        SlotState::Failed => "FAILED",
        SlotState::Dead => "DEAD",
        SlotState::Lost => "LOST",
    }
}

/// `pool status`: one line of counts, then a table of the slots.
pub fn pool_status_text(p: &PoolStatus) -> String {
    let mut s = format!(
        "pool      {} ({}) · {} slots: {} ready, {} leased, {} starting, {} releasing, {} restarting, {} failed, {} dead, {} lost{}\n",
        p.node_id,
        p.node_ip,
        p.capacity,
        p.ready,
        p.leased,
        p.starting,
        p.releasing,
        p.restarting,
        p.failed,
        p.dead,
        p.lost,
        match (p.closed, p.draining) {
            (true, _) => " · SHUTTING DOWN",
            (false, true) => " · DRAINING (no new leases)",
            (false, false) => "",
        }
    );
    if let Some(e) = &p.last_error {
        s.push_str(&format!("last error: {e}\n"));
    }
    s.push_str(&format!(
        "{:<5} {:<10} {:>4} {:>6}  {:<28} {}\n",
        "SLOT", "STATE", "GEN", "PORT", "TID", "LEASE / TRAJECTORY / ERROR"
    ));
    for v in &p.slots {
        let port = v.port.map_or_else(|| "-".to_owned(), |p| p.to_string());
        let what = match (&v.lease_id, &v.trajectory_id, &v.last_error) {
            (Some(l), Some(t), _) => format!("{l} ({t})"),
            (Some(l), None, _) => l.clone(),
            (None, _, Some(e)) => e.clone(),
            (None, _, None) => String::new(),
        };
        s.push_str(&format!(
            "{:<5} {:<10} {:>4} {:>6}  {:<28} {}\n",
            v.slot_id,
            slot_state(v.status),
            v.generation,
            port,
            v.tid.as_deref().unwrap_or("-"),
            what
        ));
    }
    s
}

/// `agentbox status` as tables.
pub fn status_text(report: &StatusReport) -> String {
    let launcher = report.launcher.as_ref();
    let gateway = report.gateway.as_ref();
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

/// What `agentbox stop` did, a line per daemon.
pub fn stopped_text(s: &Stopped) -> String {
    let mut lines = String::new();
    if let Some(state) = s.run {
        lines.push_str(&format!("run {}: {state}\n", s.tid));
    }
    if let Some(v) = &s.task {
        lines.push_str(&format!(
            "gateway task {}: closed ({} requests, {} tokens, ${:.4})\n",
            s.tid,
            v.usage.requests,
            grouped(v.usage.total_tokens),
            v.usage.cost_usd
        ));
    }
    lines
}

/// What `agentbox deliver` did.
pub fn delivered_text(r: &DeliverResult) -> String {
    format!("{} -> {} in {}\n", r.branch, r.sha, r.repo)
}

/// What `agentbox backends start` did.
pub fn backend_started_text(r: &BackendStartResult) -> String {
    let stopped = if r.stopped.is_empty() {
        String::new()
    } else {
        format!(" (stopped {})", r.stopped.join(", "))
    };
    format!(
        "{}: {} on 127.0.0.1:{}{stopped}\n",
        r.backend.model,
        r.backend.state.as_str(),
        r.backend.port
    )
}

/// What `agentbox backends stop` did.
pub fn backends_stopped_text(r: &BackendStopResult) -> String {
    if r.stopped.is_empty() {
        "no backend was running\n".to_owned()
    } else {
        format!("stopped {}\n", r.stopped.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_grouped() {
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(grouped(1_234_567), "1,234,567");
        assert_eq!(duration(Duration::from_secs(83)), "1m23s");
    }

    #[test]
    fn pool_status_is_a_table_of_slots() {
        use agentbox_api::pool::SlotView;
        let view = |id, status, generation, lease: Option<&str>| SlotView {
            slot_id: id,
            status,
            generation,
            port: lease.map(|_| 31000 + u16::try_from(id).unwrap_or(0)),
            tid: Some(format!("pool-{id}-g{generation}-abcd")),
            lease_id: lease.map(str::to_owned),
            trajectory_id: lease.map(|_| "traj-1".to_owned()),
            last_error: None,
        };
        let p = PoolStatus {
            node_id: "node-a".into(),
            node_ip: "10.0.0.1".into(),
            hostname: "h".into(),
            closed: false,
            draining: true,
            capacity: 2,
            ready: 1,
            leased: 1,
            releasing: 0,
            starting: 0,
            restarting: 0,
            failed: 0,
            dead: 0,
            lost: 0,
            empty: 0,
            last_error: None,
            slots: vec![
                view(0, SlotState::Leased, 3, Some("lease-x")),
                view(1, SlotState::Ready, 1, None),
            ],
        };
        let text = pool_status_text(&p);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 4, "{text}");
        assert!(lines[0].contains("2 slots: 1 ready, 1 leased") && lines[0].contains("DRAINING"));
        assert!(lines[2].starts_with("0     LEASED") && lines[2].contains("31000"));
        assert!(lines[2].contains("lease-x (traj-1)"));
        assert!(lines[3].starts_with("1     READY") && lines[3].contains("pool-1-g1-abcd"));
    }
}
