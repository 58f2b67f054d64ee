//! The `agentbox` command line: argument parsing and the subcommands.
//!
//! Today it has `config check`, which loads `agentbox.toml` exactly as every daemon will and
//! reports the catalogue, so an operator (or systemd's `ExecStartPre`) finds a bad key before
//! a daemon refuses to start. `status` and `run` arrive with the launcher and gateway.

#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use agentbox_policy::config::{Backend, Config, HostEnv, config_path};
use clap::{Parser, Subcommand};

/// `EX_CONFIG` from sysexits.h: the configuration is wrong, retrying will not help.
const EX_CONFIG: u8 = 78;

#[derive(Debug, Parser)]
#[command(
    name = "agentbox",
    version,
    about = "Run AI coding agents in sandboxes and meter every model call"
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

/// Runs the CLI with the given arguments; the exit code follows sysexits.h.
pub fn run<I: IntoIterator<Item = OsString>>(args: I, env: &dyn HostEnv) -> ExitCode {
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            // clap prints help and version through the error path too; it knows the right code.
            let _ = e.print();
            return ExitCode::from(u8::try_from(e.exit_code()).unwrap_or(2));
        }
    };
    match cli.command {
        Command::Config {
            action: ConfigAction::Check { json },
        } => config_check(cli.config.as_deref(), json, env),
    }
}

fn config_check(cli_path: Option<&std::path::Path>, json: bool, env: &dyn HostEnv) -> ExitCode {
    let path = config_path(cli_path, env);
    let config = match Config::load(&path, env) {
        Ok(c) => c,
        Err(e) => {
            if json {
                let body = serde_json::json!({"ok": false, "path": path, "key": e.key(), "error": e.to_string()});
                println!("{body}");
            } else {
                eprintln!("agentbox: {e}");
            }
            return ExitCode::from(EX_CONFIG);
        }
    };
    let models: Vec<serde_json::Value> = config
        .models
        .values()
        .map(|m| {
            let (backend, detail) = match &m.backend {
                Backend::Vllm { port, .. } => ("vllm", format!("127.0.0.1:{port}")),
                Backend::Ollama => ("ollama", config.gateway.ollama_url.to_string()),
                Backend::Remote {
                    provider, base_url, ..
                } => ("remote", format!("{} {base_url}", provider.as_str())),
            };
            serde_json::json!({
                "id": m.id, "backend": backend, "upstream_model": m.upstream_model,
                "destination": detail, "cost_budgets": m.prices.is_some(),
            })
        })
        .collect();
    let mut out = std::io::stdout().lock();
    let written = if json {
        let body = serde_json::json!({
            "ok": true, "path": path, "data_dir": config.data_dir,
            "repo_roots": config.launcher.repo_roots, "models": models,
        });
        writeln!(out, "{body}")
    } else {
        let mut text = format!(
            "{}: ok\ndata_dir: {}\nrepo_roots: {}\nmodels: {}\n",
            path.display(),
            config.data_dir.display(),
            config
                .launcher
                .repo_roots
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", "),
            models.len()
        );
        for m in &models {
            text.push_str(&format!(
                "  {:<16} {:<7} {} -> {}{}\n",
                m["id"].as_str().unwrap_or_default(),
                m["backend"].as_str().unwrap_or_default(),
                m["upstream_model"].as_str().unwrap_or_default(),
                m["destination"].as_str().unwrap_or_default(),
                if m["cost_budgets"] == true {
                    ""
                } else {
                    " (no prices: token budgets only)"
                },
            ));
        }
        out.write_all(text.as_bytes())
    };
    match written {
        Ok(()) => ExitCode::SUCCESS,
        // A closed stdout (`| head`) is not a configuration problem.
        Err(_) => ExitCode::from(74),
    }
}
