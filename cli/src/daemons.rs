//! The control sockets as the CLI reaches them: paths from `agentbox.toml`, the typed
//! clients of `agentbox-api`, and a connect probe that tells "not running" from "not allowed"
//! by the `io::ErrorKind` before any request is sent.

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentbox_api::{ClientError, GatewayClient, LauncherClient, PoolClient, UnixClient};
use agentbox_policy::config::Config;

use crate::error::{CliError, Daemon};

/// How long an ordinary request may take (a snapshot of a large repository is one).
const REQUEST_TIMEOUT: Duration = Duration::from_secs(300);

/// How long the launcher's routes that wait (a stop and its hand-back, a backend's start) are
/// waited for: long enough for a large workspace or a large model, never forever.
const WAIT_TIMEOUT: Duration = Duration::from_secs(1800);

/// The launcher, the gateway and the pool of one configuration.
#[derive(Debug, Clone)]
pub struct Daemons {
    /// The loaded configuration.
    pub config: Config,
    /// `run/launcher.sock`.
    pub launcher: LauncherClient,
    /// `run/gateway.sock`.
    pub gateway: GatewayClient,
    /// `run/pool.sock`.
    pub pool: PoolClient,
}

impl Daemons {
    /// Clients for the sockets under `config.data_dir`.
    pub fn new(config: Config) -> Self {
        let http = |name: &str| {
            UnixClient::new(config.data_dir.join("run").join(name))
                .with_timeout(Some(REQUEST_TIMEOUT))
        };
        Daemons {
            launcher: LauncherClient::over(http("launcher.sock"))
                .with_wait_timeout(Some(WAIT_TIMEOUT)),
            gateway: GatewayClient::over(http("gateway.sock")),
            pool: PoolClient::over(http("pool.sock")),
            config,
        }
    }

    /// The socket of `daemon`.
    pub fn socket(&self, daemon: Daemon) -> &Path {
        match daemon {
            Daemon::Launcher => self.launcher.http().socket(),
            Daemon::Gateway => self.gateway.http().socket(),
            Daemon::Pool => self.pool.http().socket(),
        }
    }

    /// Connects to `daemon`'s socket once: a missing socket or nobody listening is
    /// [`CliError::DaemonDown`], a refused connect [`CliError::PermissionDenied`].
    ///
    /// # Errors
    /// As above; other connect errors count as "not running" with the OS's words.
    pub async fn probe(&self, daemon: Daemon) -> Result<(), CliError> {
        let socket = self.socket(daemon).to_path_buf();
        match tokio::net::UnixStream::connect(&socket).await {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
                Err(self.permission_denied(daemon, socket))
            }
            Err(e) => Err(CliError::DaemonDown {
                daemon,
                socket,
                reason: e.to_string(),
            }),
        }
    }

    /// [`Daemons::probe`] for both daemons, the launcher first.
    ///
    /// # Errors
    /// The first daemon that cannot be reached.
    pub async fn probe_both(&self) -> Result<(), CliError> {
        self.probe(Daemon::Launcher).await?;
        self.probe(Daemon::Gateway).await
    }

    fn permission_denied(&self, daemon: Daemon, socket: PathBuf) -> CliError {
        CliError::PermissionDenied {
            daemon,
            socket,
            service_user: self.config.service_user.clone(),
        }
    }

    /// A client failure of `daemon` (about task `tid`) as the error people should see.
    pub fn error(&self, daemon: Daemon, tid: Option<&str>, e: ClientError) -> CliError {
        CliError::from_client(
            daemon,
            self.socket(daemon),
            &self.config.service_user,
            tid,
            e,
        )
    }
}
