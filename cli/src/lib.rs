//! The `agentbox` command line: argument parsing and the subcommands. It reaches the daemons
//! only through `agentbox-api`'s typed clients ([`daemons`]); the work of every verb lives in
//! [`run`] and [`verbs`] so other front doors (a demo, the MCP server) share it, and this
//! module only parses and prints.
//!
//! - [`args`]: the verbs' arguments, shared by clap and the MCP tools' JSON schemas.
//! - [`run`]: snapshot, gateway task, Claude Code in the sandbox, progress, deliver, summary.
//! - [`verbs`]: `status`, `logs`, `stop`, `check`, `deliver`, `backends`, as typed results.
//! - [`render`]: the progress line, the summary and the verbs' results as text.
//! - [`mcp`]: `agentbox mcp`, the same verbs as the tools of a stdio MCP server.
//! - [`error`]: every failure as one line and a documented exit code ([`error::EXIT_CODES`]).
//! - [`config_check`]: `config check`.
//! - [`up`]: the three daemons in the foreground; [`demo`]: the whole path on a throwaway
//!   setup with a built-in scripted model.

#![forbid(unsafe_code)]

pub mod args;
pub mod config_check;
pub mod daemons;
pub mod demo;
pub mod error;
pub mod mcp;
pub mod render;
pub mod run;
pub mod up;
pub mod verbs;

use std::ffi::OsString;
use std::io::Read;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use agentbox_policy::config::{Config, HostEnv, config_path};
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;

use crate::args::{CheckArgs, DeliverArgs, LogsArgs, RunArgs, StatusArgs, StopArgs, tid};
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
    Status(StatusArgs),
    /// The agent's output (Claude Code's stream-json lines).
    Logs(LogsArgs),
    /// Stop a task: kill its sandbox, hand the workspace back, close its gateway task.
    Stop(StopArgs),
    /// Run a command in a sandbox on the task's workspace (no network, no model), e.g. tests.
    Check(CheckArgs),
    /// Bring agent/<tid> into the repository the task was snapshotted from.
    Deliver(DeliverArgs),
    /// Start or stop vLLM backends.
    Backends {
        #[command(subcommand)]
        action: BackendsAction,
    },
    /// The rollout pool of this host (agentbox-pool).
    Pool {
        #[command(subcommand)]
        action: PoolAction,
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
    /// Serve run, status, logs, stop, check and deliver as the tools of an MCP server on
    /// stdin/stdout, for a supervising agent (`claude mcp add agentbox -- agentbox mcp`).
    Mcp,
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
enum PoolAction {
    /// Its slots (state, generation, port, lease) and counts.
    #[command(after_help = EXIT_CODES)]
    Status(StatusArgs),
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
    let json = matches!(&cli.command, Command::Run(args::RunArgs { json: true, .. }));
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
    let result = runtime.block_on(dispatch(cli.command, &config, env));
    // A read of stdin (`mcp`) cannot be cancelled; do not wait for it.
    runtime.shutdown_timeout(Duration::from_millis(100));
    match result {
        Ok(code) => code,
        Err(e) => fail(&e, json),
    }
}

/// Prints `e` as its one line (and, for `--json`, as a JSON object on stdout); its exit code.
fn fail(e: &CliError, json: bool) -> ExitCode {
    eprintln!("agentbox: {e}");
    if json {
        println!("{}", e.to_json());
    }
    ExitCode::from(e.exit_code())
}

/// A token cancelled by the first SIGINT or SIGTERM; a second one exits at once (130).
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
        // The handlers stay installed: a second signal would be swallowed while the first
        // one's clean-up waits (a hand-back of a large workspace). It leaves at once instead;
        // the launcher finishes the stop on its own.
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
        eprintln!("agentbox: interrupted again; leaving without waiting for the clean-up");
        crate::up::terminate_started();
        std::process::exit(130);
    });
    Ok(token)
}

/// Writes `text` to stdout.
fn out(text: &str) -> Result<(), CliError> {
    use std::io::Write;
    std::io::stdout()
        .lock()
        .write_all(text.as_bytes())
        .map_err(|e| CliError::Io {
            what: "writing to stdout".to_owned(),
            reason: e.to_string(),
        })
}

/// `value` as one JSON line on stdout.
fn out_json<T: serde::Serialize>(value: &T) -> Result<(), CliError> {
    let body = serde_json::to_string(value).map_err(|e| CliError::Io {
        what: "writing JSON".to_owned(),
        reason: e.to_string(),
    })?;
    out(&format!("{body}\n"))
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
        Command::Status(StatusArgs { json }) => {
            let report = verbs::status(&d).await;
            if json {
                out(&format!("{}\n", report.to_json()))?;
            } else {
                out(&render::status_text(&report))?;
            }
            Ok(ExitCode::from(report.exit_code()))
        }
        Command::Logs(args) => logs_command(&d, &args).await,
        Command::Stop(StopArgs { tid: t }) => {
            out(&render::stopped_text(&verbs::stop(&d, &tid(&t)?).await?))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Check(args) => {
            let c =
                verbs::check(&d, &tid(&args.tid)?, args.timeout, args.venv, &args.command).await?;
            out(&c.check.stdout)?;
            eprint!("{}", c.check.stderr);
            if let Some(problem) = &c.problem {
                eprintln!("agentbox: {problem}");
            }
            Ok(ExitCode::from(c.exit_code))
        }
        Command::Deliver(DeliverArgs { tid: t, repo }) => {
            out(&render::delivered_text(
                &verbs::deliver(&d, &tid(&t)?, &repo).await?,
            ))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Backends {
            action: BackendsAction::Start { model },
        } => {
            out(&render::backend_started_text(
                &verbs::backend_start(&d, &model).await?,
            ))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Backends {
            action: BackendsAction::Stop,
        } => {
            out(&render::backends_stopped_text(
                &verbs::backends_stop(&d).await?,
            ))?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Pool {
            action: PoolAction::Status(StatusArgs { json }),
        } => {
            let status = verbs::pool_status(&d).await?;
            if json {
                out_json(&status)?;
            } else {
                out(&render::pool_status_text(&status))?;
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Mcp => mcp::serve(d).await,
        Command::Config { .. } | Command::Up(_) | Command::Demo(_) => Ok(ExitCode::SUCCESS),
    }
}

/// How often `logs --follow` polls.
const FOLLOW_POLL: Duration = Duration::from_millis(500);

/// `agentbox logs TID [--follow]`: the run's output; following prints what is new until the
/// run ends.
async fn logs_command(d: &Daemons, args: &LogsArgs) -> Result<ExitCode, CliError> {
    let tid = tid(&args.tid)?;
    let mut offset = 0;
    loop {
        let page = verbs::logs(d, &tid, args.stderr, offset, None, args.follow).await?;
        out(&page.output)?;
        offset = page.next_offset;
        if !args.follow || page.done {
            return Ok(ExitCode::SUCCESS);
        }
        tokio::time::sleep(FOLLOW_POLL).await;
    }
}

async fn run_command(d: &Daemons, mut args: RunArgs) -> Result<ExitCode, CliError> {
    if args.prompt == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .map_err(|e| CliError::Io {
                what: "reading the prompt from standard input".to_owned(),
                reason: e.to_string(),
            })?;
        args.prompt = s;
    }
    let json = args.json;
    let opts = args.options(Duration::from_millis(500))?;
    let cancel = interrupt_token()?;
    let mut progress = render::Terminal::stderr();
    let summary = run::run(d, &opts, &mut progress, &cancel).await?;
    if json {
        out_json(&summary)?;
    } else {
        out(&render::summary_text(&summary))?;
    }
    if let Some(advice) = summary.outcome.advice() {
        eprintln!("agentbox: {advice}");
    }
    Ok(ExitCode::from(summary.outcome.exit_code()))
}
