//! What people see: the progress of a run on stderr (one spinner line on a terminal, plain
//! lines otherwise) and the run's summary as text. Numbers are grouped (`12,345`) so a budget
//! reads at a glance.

use std::io::{IsTerminal, Write};
use std::time::Duration;

use agentbox_api::gateway::{Budget, Remaining, TaskView};

use crate::run::{Event, Outcome, Progress, RunSummary, Tick};

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
fn tick_line(tick: &Tick) -> String {
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

impl Progress for Terminal {
    fn event(&mut self, event: &Event<'_>) {
        match event {
            Event::Snapshot { tid, sha } => {
                let short = sha.get(..12).unwrap_or(sha);
                self.line(&format!("task {tid}: snapshot of {short}"));
            }
            Event::Started { tid } => self.line(&format!(
                "task {tid}: Claude Code runs in the sandbox (Ctrl-C stops it)"
            )),
            Event::Tick(tick) => {
                let line = tick_line(tick);
                if self.tty {
                    let spin = SPINNER.get(self.frame % SPINNER.len()).unwrap_or(&'*');
                    self.frame += 1;
                    let mut err = std::io::stderr().lock();
                    let _ = write!(
                        err,
                        "\r\x1b[2K{spin} {} · {line}",
                        duration(tick.elapsed)
                    );
                    let _ = err.flush();
                    self.spinning = true;
                } else if self.last.as_deref() != Some(line.as_str()) {
                    self.line(&format!("[{}] {line}", duration(tick.elapsed)));
                    self.last = Some(line);
                }
            }
            Event::Stopping => self.line(
                "stopping: killing the sandbox, handing the workspace back, closing the gateway task",
            ),
            Event::Finished(status) => {
                let code = status
                    .exit_code
                    .map_or_else(|| "no exit code".to_owned(), |c| format!("exit {c}"));
                self.line(&format!("agent {} ({code})", status.state));
            }
            Event::Delivered { branch, sha } => {
                let short = sha.get(..12).unwrap_or(sha);
                self.line(&format!("delivered {branch} ({short})"));
            }
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
}
