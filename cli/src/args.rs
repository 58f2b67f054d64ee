//! The arguments of the verbs, one type each for both front doors: clap reads them from the
//! command line and serde from an MCP `tools/call` (whose JSON schema schemars derives from the
//! same fields and doc comments), so `agentbox run --budget-tokens N` and the `run` tool's
//! `budget_tokens` cannot drift apart. Flags that only make sense on a terminal (`--json`,
//! `--follow`) are skipped by serde; the MCP-only `offset` of `logs` is skipped by clap.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use agentbox_api::gateway::Budget;
use agentbox_policy::id::Tid;
use schemars::JsonSchema;
use serde::Deserialize;

use crate::error::CliError;
use crate::run::RunOptions;

/// The default of `--timeout` for `run`.
const RUN_TIMEOUT_S: u64 = 3600;
/// The default of `--timeout` for `check`.
const CHECK_TIMEOUT_S: u64 = 600;
/// The default of `--claude-model`.
const CLAUDE_MODEL: &str = "claude-sonnet-4-5";

fn run_timeout() -> u64 {
    RUN_TIMEOUT_S
}

fn check_timeout() -> u64 {
    CHECK_TIMEOUT_S
}

fn claude_model() -> String {
    CLAUDE_MODEL.to_owned()
}

/// A task id given as an argument.
///
/// # Errors
/// [`CliError::Usage`] when it is not a valid task id.
pub fn tid(s: &str) -> Result<Tid, CliError> {
    Tid::parse(s).map_err(|e| CliError::Usage(format!("task id {s:?}: {e}")))
}

/// `run`: Claude Code on a snapshot of a repository, in a sandbox, metered and budgeted.
#[derive(Debug, Clone, clap::Args, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RunArgs {
    /// The repository to work on (its top level, under one of launcher.repo_roots).
    #[arg(long)]
    pub repo: PathBuf,
    /// The model, an id of the config's catalogue.
    #[arg(long)]
    pub model: String,
    /// What to do. It reaches the agent on its standard input, never in a command line other
    /// users can see (on the command line, `-` reads it from standard input).
    pub prompt: String,
    /// The commit to start from (default: HEAD).
    #[arg(long = "ref")]
    #[serde(rename = "ref", default)]
    pub git_ref: Option<String>,
    /// Token budget (input + output + cache); the gateway refuses requests past it.
    #[arg(long)]
    #[serde(default)]
    pub budget_tokens: Option<u64>,
    /// Cost budget in USD (the model needs prices in the catalogue).
    #[arg(long)]
    #[serde(default)]
    pub budget_usd: Option<f64>,
    /// Seconds before the agent is killed.
    #[arg(long, default_value_t = RUN_TIMEOUT_S)]
    #[serde(default = "run_timeout")]
    pub timeout: u64,
    /// A venv under launcher.venv_root, mounted at /opt/venv.
    #[arg(long)]
    #[serde(default)]
    pub venv: Option<String>,
    /// Extra environment for the agent, KEY=VALUE each (launcher.env_allowlist decides).
    #[arg(long = "env", value_name = "KEY=VALUE")]
    #[serde(default)]
    pub env: Vec<String>,
    /// Do not deliver: leave agent/<tid> in the task's shadow repository.
    #[arg(long)]
    #[serde(default)]
    pub keep: bool,
    /// The task id (default: a fresh random one).
    #[arg(long)]
    #[serde(default)]
    pub tid: Option<String>,
    /// The model name Claude Code is told (the gateway rewrites it to the catalogue's).
    #[arg(long, default_value = CLAUDE_MODEL)]
    #[serde(default = "claude_model")]
    pub claude_model: String,
    /// Print one JSON object (the summary, or the error) on stdout.
    #[arg(long)]
    #[serde(skip)]
    pub json: bool,
}

impl RunArgs {
    /// What [`crate::run::run`] needs, polling progress every `poll`.
    ///
    /// # Errors
    /// A bad `env` entry or task id ([`CliError::Usage`]).
    pub fn options(self, poll: Duration) -> Result<RunOptions, CliError> {
        let mut env = BTreeMap::new();
        for kv in &self.env {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| CliError::Usage(format!("env {kv:?}: expected KEY=VALUE")))?;
            env.insert(k.to_owned(), v.to_owned());
        }
        Ok(RunOptions {
            repo: self.repo,
            git_ref: self.git_ref,
            model: self.model,
            prompt: self.prompt,
            tid: self.tid.as_deref().map(tid).transpose()?,
            budget: Budget {
                tokens: self.budget_tokens,
                usd: self.budget_usd,
            },
            timeout_s: self.timeout,
            venv: self.venv,
            env,
            keep: self.keep,
            claude_model: self.claude_model,
            poll,
        })
    }
}

/// `status`: tasks, backends and host readiness.
#[derive(Debug, Clone, clap::Args, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StatusArgs {
    /// One JSON object instead of tables.
    #[arg(long)]
    #[serde(skip)]
    pub json: bool,
}

/// `logs`: the agent's output (Claude Code's stream-json lines).
#[derive(Debug, Clone, clap::Args, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LogsArgs {
    /// The task id.
    pub tid: String,
    /// Keep printing until the run ends.
    #[arg(long, short)]
    #[serde(skip)]
    pub follow: bool,
    /// Its standard error instead.
    #[arg(long)]
    #[serde(default)]
    pub stderr: bool,
    /// Start at this byte of the output: the `next_offset` of the previous call, to read only
    /// what is new (a page is at most 64 KiB).
    #[arg(skip)]
    #[serde(default)]
    pub offset: usize,
}

/// `stop`: kill the task's sandbox, hand the workspace back, close its gateway task.
#[derive(Debug, Clone, clap::Args, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StopArgs {
    /// The task id.
    pub tid: String,
}

/// `check`: a command in a sandbox on the task's workspace (no network, no model), e.g. tests.
#[derive(Debug, Clone, clap::Args, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CheckArgs {
    /// The task id.
    pub tid: String,
    /// Seconds before the check is killed.
    #[arg(long, default_value_t = CHECK_TIMEOUT_S)]
    #[serde(default = "check_timeout")]
    pub timeout: u64,
    /// A venv under launcher.venv_root, mounted at /opt/venv.
    #[arg(long)]
    #[serde(default)]
    pub venv: Option<String>,
    /// The command, run by /bin/sh -c (several words are quoted and joined).
    #[arg(last = true, required = true)]
    pub command: Vec<String>,
}

/// `deliver`: bring agent/<tid> into the repository the task was snapshotted from.
#[derive(Debug, Clone, clap::Args, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct DeliverArgs {
    /// The task id.
    pub tid: String,
    /// The repository.
    #[arg(long)]
    pub repo: PathBuf,
}
