//! `agentbox-pool`: reads the config (`[pool]` is required), opens `run/pool.sock`, removes
//! the slots and tasks a crashed earlier pool left (`pool-*`), starts the slots and serves until SIGTERM or SIGINT; then stops accepting, closes every endpoint,
//! deletes every slot and closes every gateway task. Prints `listening on unix:<path>` once
//! the socket is bound.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use agentbox_api::{GatewayClient, LauncherClient, UnixClient};
use agentbox_pool::backend::Real;
use agentbox_pool::{Pool, PoolOptions};
use tokio_util::sync::CancellationToken;

/// Bounds the launcher's waiting routes (a slot start, a delete, a command).
const LAUNCHER_WAIT: Duration = Duration::from_secs(4 * 3600);

fn main() -> ExitCode {
    let config = match agentbox_http::start_daemon(
        "agentbox-pool",
        "The agentbox pool of warm rollout slots on this host",
    ) {
        Ok(c) => c,
        Err(code) => return code,
    };
    let Some(pool_config) = config.pool.clone() else {
        eprintln!("agentbox-pool: the config has no [pool] section");
        return ExitCode::from(78);
    };
    let runtime = match agentbox_http::runtime("agentbox-pool") {
        Ok(r) => r,
        Err(code) => return code,
    };
    let opts = PoolOptions::from_config(&config, &pool_config);
    runtime.block_on(run(config, pool_config, opts))
}

async fn run(
    config: agentbox_policy::config::Config,
    pool_config: agentbox_policy::config::PoolConfig,
    opts: PoolOptions,
) -> ExitCode {
    let run_dir = config.data_dir.join("run");
    if let Err(e) = std::fs::create_dir_all(&run_dir) {
        eprintln!("agentbox-pool: cannot create {}: {e}", run_dir.display());
        return ExitCode::FAILURE;
    }
    let path = run_dir.join("pool.sock");
    let listener = match bind_control(&path) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("agentbox-pool: cannot listen on {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    };
    let shutdown = CancellationToken::new();
    let launcher = LauncherClient::over(UnixClient::new(run_dir.join("launcher.sock")))
        .with_wait_timeout(Some(LAUNCHER_WAIT));
    let gateway = GatewayClient::new(run_dir.join("gateway.sock"));
    let backend = Real::new(
        launcher,
        gateway,
        pool_config.model.clone(),
        pool_config.budget_tokens,
        shutdown.clone(),
    );
    match backend.reap_orphans().await {
        Ok((0, 0)) => {}
        Ok((slots, tasks)) => tracing::warn!(
            slots,
            tasks,
            "removed what an earlier pool left behind (it did not shut down)"
        ),
        Err(e) => tracing::warn!(error = %e, "cannot look for what an earlier pool left behind"),
    }
    let pool = Pool::new(opts, backend, shutdown.clone());
    pool.start();
    let _ = agentbox_http::announce_listening(format_args!("unix:{}", path.display()));
    agentbox_http::cancel_on_shutdown_signal(&shutdown);
    agentbox_http::serve_unix(
        listener,
        agentbox_pool::routes::router(pool.clone()),
        shutdown,
    )
    .await;
    pool.shutdown().await;
    let _ = std::fs::remove_file(&path);
    ExitCode::SUCCESS
}

/// Binds the socket, replacing a stale socket from a previous run (never anything else),
/// mode 0600: only the service user (and root) may connect.
fn bind_control(path: &std::path::Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(std::io::Error::other(
                "exists and is not a socket; refusing to replace it",
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}
