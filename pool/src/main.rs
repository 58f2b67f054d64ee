//! `agentbox-pool`: reads the config (`[pool]` is required), opens `run/pool.sock`, removes
//! the slots and tasks a crashed earlier pool left (`pool-*`), starts the slots and serves until SIGTERM or SIGINT; then stops accepting, closes every endpoint,
//! deletes every slot and closes every gateway task. Prints `listening on unix:<path>` once
//! the socket is bound.

#![forbid(unsafe_code)]

use std::process::ExitCode;
use std::time::Duration;

use agentbox_api::{GatewayClient, LauncherClient, UnixClient};
use agentbox_http::control::{self, ControlSocket};
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
    let opts = PoolOptions::from_config(&config, &pool_config);
    agentbox_http::block_on("agentbox-pool", run(config, pool_config, opts))
}

async fn run(
    config: agentbox_policy::config::Config,
    pool_config: agentbox_policy::config::PoolConfig,
    opts: PoolOptions,
) -> ExitCode {
    let run_dir = match control::run_dir("agentbox-pool", &config.data_dir) {
        Ok(d) => d,
        Err(code) => return code,
    };
    let socket = match ControlSocket::bind("agentbox-pool", run_dir.join("pool.sock")) {
        Ok(s) => s,
        Err(code) => return code,
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
    socket
        .serve(agentbox_pool::routes::router(pool.clone()), shutdown)
        .await;
    pool.shutdown().await;
    ExitCode::SUCCESS
}
