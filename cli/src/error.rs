//! Every way a command can fail, each with one line for people (what happened, then what to
//! do) and one documented exit code. The table of codes ([`EXIT_CODES`]) is what `--help` and
//! the README print, and [`CliError::exit_code`] is its one exhaustive mapping.

use std::path::PathBuf;

use agentbox_api::ClientError;

/// The exit codes, as `--help` lists them. Values follow sysexits.h where one fits.
pub const EXIT_CODES: &str = "\
Exit codes:
  0    done (run: the agent exited 0)
  1    run: the agent exited non-zero
  2    bad command line
  3    run: the task's budget is exhausted
  4    run: the agent ran past its timeout
  5    run: the agent was killed for using too much memory (OOM)
  6    run: the workspace reached launcher.limits.disk_mb
  7    run: the sandbox could not be set up, or the run was lost or killed from outside
  64   unknown model (not in the config's catalogue)
  65   a daemon refused the request (bad repository path, bad argument)
  66   no such task
  69   a daemon is not running (no socket, or nothing listening)
  70   a daemon answered something unexpected
  71   this host cannot run sandboxes (bubblewrap, user namespaces, cgroups; demo: also root,
       git, python3, npm), one line per missing thing
  74   an I/O error on this side (writing output, running git)
  77   permission denied on a daemon's socket (run as root or the service user)
  78   the configuration is invalid
  130  interrupted (Ctrl-C): the task was stopped and cleaned up";

/// Which daemon a failure concerns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Daemon {
    /// `agentbox-launcher` on `run/launcher.sock`.
    Launcher,
    /// `agentbox-gateway` on `run/gateway.sock`.
    Gateway,
    /// `agentbox-pool` on `run/pool.sock` (rollout hosts only).
    Pool,
}

impl Daemon {
    /// The name people know it by.
    pub fn name(self) -> &'static str {
        match self {
            Daemon::Launcher => "launcher",
            Daemon::Gateway => "gateway",
            Daemon::Pool => "pool",
        }
    }

    /// How to start it.
    fn start_hint(self) -> String {
        match self {
            Daemon::Launcher | Daemon::Gateway => {
                format!(
                    "`systemctl start {}`, or `agentbox up` for a trial",
                    self.unit()
                )
            }
            Daemon::Pool => format!(
                "`systemctl start {}` on a host whose config has a [pool] section",
                self.unit()
            ),
        }
    }

    /// The systemd unit that runs it.
    fn unit(self) -> &'static str {
        match self {
            Daemon::Launcher => "agentbox-launcher",
            Daemon::Gateway => "agentbox-gateway",
            Daemon::Pool => "agentbox-pool",
        }
    }
}

/// What a command can fail with.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// `agentbox.toml` could not be loaded.
    #[error(
        "{0}; fix the file (`agentbox config check` names the key) or pass --config/$AGENTBOX_CONFIG"
    )]
    Config(#[from] agentbox_policy::config::ConfigError),
    /// The model is not in the catalogue.
    #[error(
        "unknown model {model:?}; use one of: {} (`agentbox config check` lists the catalogue)",
        if known.is_empty() { "(the catalogue is empty)".to_owned() } else { known.join(", ") }
    )]
    UnknownModel {
        /// What was asked for.
        model: String,
        /// The catalogue's ids.
        known: Vec<String>,
    },
    /// The repository cannot be used.
    #[error(
        "repository {}: {reason}; pass the top of a git repository under one of launcher.repo_roots",
        path.display()
    )]
    BadRepo {
        /// As given.
        path: PathBuf,
        /// Why (ours or the launcher's words).
        reason: String,
    },
    /// A bad argument that clap could not catch (a task id, an env entry).
    #[error("{0}")]
    Usage(String),
    /// The daemon's socket is missing or nobody listens on it.
    #[error(
        "the {} is not running ({}: {reason}); start it ({})",
        daemon.name(), socket.display(), daemon.start_hint()
    )]
    DaemonDown {
        /// Which.
        daemon: Daemon,
        /// Its socket.
        socket: PathBuf,
        /// What connecting said.
        reason: String,
    },
    /// The socket or the daemon refused this user.
    #[error(
        "permission denied on the {}'s socket {}; run as root or as the service user (`sudo -u {service_user} agentbox ...`)",
        daemon.name(), socket.display()
    )]
    PermissionDenied {
        /// Which.
        daemon: Daemon,
        /// Its socket.
        socket: PathBuf,
        /// `service_user` from the config.
        service_user: String,
    },
    /// No task (or run) by that id.
    #[error("the {} knows no task {tid:?}; `agentbox status` lists the tasks", daemon.name())]
    UnknownTask {
        /// Which daemon said so.
        daemon: Daemon,
        /// The id.
        tid: String,
    },
    /// The launcher says the host cannot run sandboxes.
    #[error("this host cannot run sandboxes: {0}; fix that and restart the launcher")]
    HostNotReady(String),
    /// `agentbox demo`'s own host check failed: one line per missing thing, each with its fix.
    #[error(
        "this host cannot run the demo:{}",
        .0.iter().map(|l| format!("\n  - {l}")).collect::<String>()
    )]
    HostUnfit(Vec<String>),
    /// A daemon refused the request (a 4xx with its envelope).
    #[error("the {} refused: {message} ({code}); correct the request and retry", daemon.name())]
    Refused {
        /// Which.
        daemon: Daemon,
        /// The envelope's code.
        code: String,
        /// The envelope's message.
        message: String,
    },
    /// Anything else a daemon answered or failed with.
    #[error("the {} failed: {source}; see its log (`journalctl -u {}`)", daemon.name(), daemon.unit())]
    Daemon {
        /// Which.
        daemon: Daemon,
        /// What the client saw.
        source: ClientError,
    },
    /// Stopped by Ctrl-C (or SIGTERM) before the agent started; what was set up is undone.
    #[error("interrupted; nothing was left running")]
    Interrupted,
    /// Local I/O: output, git, spawning a daemon.
    #[error("{what}: {reason}")]
    Io {
        /// What we were doing.
        what: String,
        /// What failed.
        reason: String,
    },
}

impl CliError {
    /// The documented exit code ([`EXIT_CODES`]).
    pub fn exit_code(&self) -> u8 {
        match self {
            CliError::Usage(_) => 2,
            CliError::UnknownModel { .. } => 64,
            CliError::BadRepo { .. } | CliError::Refused { .. } => 65,
            CliError::UnknownTask { .. } => 66,
            CliError::DaemonDown { .. } => 69,
            CliError::Daemon { .. } => 70,
            CliError::HostNotReady(_) | CliError::HostUnfit(_) => 71,
            CliError::Io { .. } => 74,
            CliError::PermissionDenied { .. } => 77,
            CliError::Config(_) => 78,
            CliError::Interrupted => 130,
        }
    }

    /// The exit code's name, stable for scripts and MCP clients (`daemon_down`, ...).
    pub fn exit_name(&self) -> &'static str {
        match self {
            CliError::Usage(_) => "usage",
            CliError::UnknownModel { .. } => "unknown_model",
            CliError::BadRepo { .. } => "bad_repo",
            CliError::Refused { .. } => "refused",
            CliError::UnknownTask { .. } => "unknown_task",
            CliError::DaemonDown { .. } => "daemon_down",
            CliError::Daemon { .. } => "daemon_failed",
            CliError::HostNotReady(_) => "host_not_ready",
            CliError::HostUnfit(_) => "host_unfit",
            CliError::Io { .. } => "io",
            CliError::PermissionDenied { .. } => "permission_denied",
            CliError::Config(_) => "config",
            CliError::Interrupted => "interrupted",
        }
    }

    /// The error as `--json` prints it (and an MCP tool result carries it): its one line, its
    /// exit code and the code's name.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "ok": false,
            "error": self.to_string(),
            "exit_code": self.exit_code(),
            "exit_name": self.exit_name(),
        })
    }

    /// A daemon's answer (or failure) as the error people should see. `service_user` names who
    /// may call it; `tid` is the task the request was about, if any.
    pub fn from_client(
        daemon: Daemon,
        socket: &std::path::Path,
        service_user: &str,
        tid: Option<&str>,
        e: ClientError,
    ) -> CliError {
        let code = e.code().map(str::to_owned);
        match (&e, code.as_deref()) {
            (ClientError::Api { .. }, Some("forbidden")) => CliError::PermissionDenied {
                daemon,
                socket: socket.to_path_buf(),
                service_user: service_user.to_owned(),
            },
            (ClientError::Api { .. }, Some("unknown_task" | "no_such_task")) => {
                CliError::UnknownTask {
                    daemon,
                    tid: tid.unwrap_or_default().to_owned(),
                }
            }
            (ClientError::Api { error, .. }, Some("host_not_ready")) => {
                CliError::HostNotReady(error.message.clone())
            }
            (ClientError::Api { status, error }, _) if (400..500).contains(status) => {
                CliError::Refused {
                    daemon,
                    code: error.code.clone(),
                    message: error.message.clone(),
                }
            }
            (ClientError::Transport { message, .. }, _) => {
                connect_error(daemon, socket, service_user, message)
                    .unwrap_or(CliError::Daemon { daemon, source: e })
            }
            (
                ClientError::Api { .. }
                | ClientError::Status { .. }
                | ClientError::Decode { .. }
                | ClientError::Request(_)
                | ClientError::Timeout { .. },
                _,
            ) => CliError::Daemon { daemon, source: e },
        }
    }
}

/// A transport failure that is really "not running" or "not allowed": hyper keeps the
/// `io::Error` deep in its source chain, so its words are all we have here; [`crate::daemons`]
/// classifies by `io::ErrorKind` before the first request, this catches a daemon that went
/// away in the middle.
fn connect_error(
    daemon: Daemon,
    socket: &std::path::Path,
    service_user: &str,
    message: &str,
) -> Option<CliError> {
    let down = ["No such file or directory", "Connection refused"];
    if message.contains("Permission denied") {
        Some(CliError::PermissionDenied {
            daemon,
            socket: socket.to_path_buf(),
            service_user: service_user.to_owned(),
        })
    } else if down.iter().any(|d| message.contains(d)) {
        Some(CliError::DaemonDown {
            daemon,
            socket: socket.to_path_buf(),
            reason: message.to_owned(),
        })
    } else {
        None
    }
}
