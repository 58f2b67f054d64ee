//! The `agentbox` command line: argument parsing and the subcommands. It reaches the daemons
//! only through `agentbox-api`'s typed clients ([`daemons`]); the work of `run` lives in
//! [`run`] so other front doors (a demo, an MCP server) share it.
//!
//! - [`run`]: snapshot, gateway task, Claude Code in the sandbox, progress, deliver, summary.
//! - [`verbs`]: `status`, `logs`, `stop`, `check`, `deliver`, `backends`.
//! - [`render`]: the progress line and the summary as text.
//! - [`error`]: every failure as one line and a documented exit code ([`error::EXIT_CODES`]).
//! - [`config_check`]: `config check`.
//! - [`up`]: the three daemons in the foreground; [`demo`]: the whole path on a throwaway
//!   setup with a built-in scripted model.

#![forbid(unsafe_code)]

pub mod config_check;
pub mod daemons;
pub mod demo;
pub mod error;
pub mod render;
pub mod run;
pub mod up;
pub mod verbs;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use agentbox_api::gateway::Budget;
use agentbox_policy::config::{Config, HostEnv, config_path};
use agentbox_policy::id::Tid;
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::daemons::Daemons;
use crate::error::{CliError, EXIT_CODES};

#[derive(Debug, Parser)]
#[command(
    name = "agentbox",
    version,
    about = "Run AI coding agents in sandboxes and meter every model call",
    after_help = EXIT_CODES
)]
struct Cli {
    /// The config file (default: $AGENTBOX_CONFIG, then /etc/agentbox/agentbox.toml).
    #[arg(long, global = true)]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Inspect the configuration.
    Config {
        #[command(subcommand)]
        action: ConfigAction,
    },
    /// Run Claude Code on a snapshot of a repository in a sandbox, metered and budgeted, and
    /// deliver its work as the branch agent/<tid>.
    #[command(after_help = EXIT_CODES)]
    Run(RunArgs),
    /// Tasks, backends and host readiness.
    Status {
        /// One JSON object instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// The agent's output (Claude Code's stream-json lines).
    Logs {
        /// The task id.
        tid: String,
        /// Keep printing until the run ends.
        #[arg(long, short)]
        follow: bool,
        /// Its standard error instead.
        #[arg(long)]
        stderr: bool,
    },
    /// Stop a task: kill its sandbox, hand the workspace back, close its gateway task.
    Stop {
        /// The task id.
        tid: String,
    },
    /// Run a command in a sandbox on the task's workspace (no network, no model), e.g. tests.
    Check {
        /// The task id.
        tid: String,
        /// Seconds before the check is killed.
        #[arg(long, default_value_t = 600)]
        timeout: u64,
        /// A venv under launcher.venv_root, mounted at /opt/venv.
        #[arg(long)]
        venv: Option<String>,
        /// The command (run by /bin/sh -c; several words are quoted and joined).
        #[arg(last = true, required = true)]
        command: Vec<String>,
    },
    /// Bring agent/<tid> into the repository the task was snapshotted from.
    Deliver {
        /// The task id.
        tid: String,
        /// The repository.
        #[arg(long)]
        repo: PathBuf,
    },
    /// Start or stop vLLM backends.
    Backends {
        #[command(subcommand)]
        action: BackendsAction,
    },
    /// Run the launcher, gateway and bridge in the foreground on one data dir (a trial);
    /// Ctrl-C stops all three.
    Up(up::UpArgs),
    /// The whole `run` path on a throwaway setup with a built-in scripted model (nothing
    /// configured, no API key): Claude Code fixes a failing test in a new repository, then
    /// the delivered branch, its diff and the budget spent are shown; everything is removed
    /// on the way out.
    #[command(after_help = EXIT_CODES)]
    Demo(demo::DemoArgs),
}

#[derive(Debug, Subcommand)]
enum ConfigAction {
    /// Load and validate agentbox.toml as the daemons do, and print what it configures.
    Check {
        /// Print the result as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum BackendsAction {
    /// Start the vLLM backend of a model (answers once it is healthy).
    Start {
        /// The model id.
        model: String,
    },
    /// Stop every vLLM backend.
    Stop,
}

#[derive(Debug, clap::Args)]
struct RunArgs {
    /// The repository to work on (its top level, under one of launcher.repo_roots).
    #[arg(long)]
    repo: PathBuf,
    /// The model, an id of the config's catalogue.
    #[arg(long)]
    model: String,
    /// What to do; `-` reads it from standard input. It reaches the agent on its standard
    /// input, never in a command line other users can see.
    prompt: String,
    /// The commit to start from (default: HEAD).
    #[arg(long = "ref")]
    git_ref: Option<String>,
    /// Token budget (input + output + cache); the gateway refuses requests past it.
    #[arg(long)]
    budget_tokens: Option<u64>,
    /// Cost budget in USD (the model needs prices in the catalogue).
    #[arg(long)]
    budget_usd: Option<f64>,
    /// Seconds before the agent is killed.
    #[arg(long, default_value_t = 3600)]
    timeout: u64,
    /// A venv under launcher.venv_root, mounted at /opt/venv.
    #[arg(long)]
    venv: Option<String>,
    /// Extra environment for the agent, KEY=VALUE (repeatable; launcher.env_allowlist decides).
    #[arg(long = "env", value_name = "KEY=VALUE")]
    env: Vec<String>,
    /// Do not deliver: leave agent/<tid> in the task's shadow repository.
    #[arg(long)]
    keep: bool,
    /// The task id (default: a fresh random one).
    #[arg(long)]
    tid: Option<String>,
    /// The model name Claude Code is told (the gateway rewrites it to the catalogue's).
    #[arg(long, default_value = "claude-sonnet-4-5")]
    claude_model: String,
    /// Print one JSON object (the summary, or the error) on stdout.
    #[arg(long)]
    json: bool,
}

/// Runs the CLI with the given arguments; the exit codes are [`EXIT_CODES`].
pub fn run<I: IntoIterator<Item = OsString>>(args: I, env: &dyn HostEnv) -> ExitCode {
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // clap prints help and version through the error path too; it knows the right code.
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    if let Command::Config {
        action: ConfigAction::Check { json },
    } = cli.command
    {
        return config_check::config_check(cli.config.as_deref(), json, env);
    }
    let json = matches!(&cli.command, Command::Run(RunArgs { json: true, .. }));
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            return fail(
                &CliError::Io {
                    what: "starting the async runtime".to_owned(),
                    reason: e.to_string(),
                },
                json,
            );
        }
    };
    let config = config_path(cli.config.as_deref(), env);
    match runtime.block_on(dispatch(cli.command, &config, env)) {
        Ok(code) => code,
        Err(e) => fail(&e, json),
    }
}

/// Prints `e` as its one line (and, for `--json`, as a JSON object on stdout); its exit code.
fn fail(e: &CliError, json: bool) -> ExitCode {
    eprintln!("agentbox: {e}");
    if json {
        let body =
            serde_json::json!({"ok": false, "error": e.to_string(), "exit_code": e.exit_code()});
        println!("{body}");
    }
    ExitCode::from(e.exit_code())
}

/// A token cancelled by the first SIGINT or SIGTERM.
pub(crate) fn interrupt_token() -> Result<CancellationToken, CliError> {
    use tokio::signal::unix::{SignalKind, signal};
    let io = |e: std::io::Error| CliError::Io {
        what: "installing the signal handlers".to_owned(),
        reason: e.to_string(),
    };
    let mut int = signal(SignalKind::interrupt()).map_err(io)?;
    let mut term = signal(SignalKind::terminate()).map_err(io)?;
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        cancel.cancel();
    });
    Ok(token)
}

/// A task id given on the command line.
fn tid(s: &str) -> Result<Tid, CliError> {
    Tid::parse(s).map_err(|e| CliError::Usage(format!("task id {s:?}: {e}")))
}

async fn dispatch(
    command: Command,
    config: &std::path::Path,
    env: &dyn HostEnv,
) -> Result<ExitCode, CliError> {
    if let Command::Up(args) = command {
        return up::up(&args, config, env).await;
    }
    if let Command::Demo(args) = command {
        return demo::demo(&args, config, env).await;
    }
    let d = Daemons::new(Config::load(config, env)?);
    match command {
        Command::Run(args) => run_command(&d, args).await,
        Command::Status { json } => verbs::status(&d, json).await,
        Command::Logs {
            tid: t,
            follow,
            stderr,
        } => verbs::logs(&d, &tid(&t)?, follow, stderr).await,
        Command::Stop { tid: t } => verbs::stop(&d, &tid(&t)?).await,
        Command::Check {
            tid: t,
            timeout,
            venv,
            command,
        } => verbs::check(&d, &tid(&t)?, timeout, venv, &command).await,
        Command::Deliver { tid: t, repo } => verbs::deliver(&d, &tid(&t)?, &repo).await,
        Command::Backends {
            action: BackendsAction::Start { model },
        } => verbs::backend_start(&d, &model).await,
        Command::Backends {
            action: BackendsAction::Stop,
        } => verbs::backends_stop(&d).await,
        Command::Config { .. } | Command::Up(_) | Command::Demo(_) => Ok(ExitCode::SUCCESS),
    }
}

async fn run_command(d: &Daemons, args: RunArgs) -> Result<ExitCode, CliError> {
    let prompt = if args.prompt == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| CliError::Io {
                what: "reading the prompt from standard input".to_owned(),
                reason: e.to_string(),
            })?;
        s
    } else {
        args.prompt
    };
    let mut env = BTreeMap::new();
    for kv in &args.env {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| CliError::Usage(format!("--env {kv:?}: expected KEY=VALUE")))?;
        env.insert(k.to_owned(), v.to_owned());
    }
    let opts = run::RunOptions {
        repo: args.repo,
        git_ref: args.git_ref,
        model: args.model,
        prompt,
        tid: args.tid.as_deref().map(tid).transpose()?,
        budget: Budget {
            tokens: args.budget_tokens,
            usd: args.budget_usd,
        },
        timeout_s: args.timeout,
        venv: args.venv,
        env,
        keep: args.keep,
        claude_model: args.claude_model,
        poll: Duration::from_millis(500),
    };
    let cancel = interrupt_token()?;
    let mut progress = render::Terminal::stderr();
    let summary = run::run(d, &opts, &mut progress, &cancel).await?;
    if args.json {
        let body = serde_json::to_string(&summary).map_err(|e| CliError::Io {
            what: "writing the summary".to_owned(),
            reason: e.to_string(),
        })?;
        println!("{body}");
    } else {
        print!("{}", render::summary_text(&summary));
    }
    if let Some(advice) = summary.outcome.advice() {
        eprintln!("agentbox: {advice}");
    }
    Ok(ExitCode::from(summary.outcome.exit_code()))
}
