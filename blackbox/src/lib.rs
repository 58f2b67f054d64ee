//! `blackbox-server`: drives one agent CLI inside a sandbox for an RL rollout manager (the
//! Dressage paddock), with an in-process LLM proxy that tags every model call with session
//! and turn headers. The wire contract is the reference's (Accio-Lab/Dressage
//! `blackbox_server`), so its client works unchanged.
//!
//! Modules: [`config`] (`BBS_*`), [`model`] (every wire shape), [`error`] (the one mapping to
//! status and body), [`routes`] (HTTP), [`server`] (registration, turns, sessions, health
//! monitor, pause, shutdown), [`session`] (state machines and the turn ledger), [`backend`]
//! (the agent trait and opencode), [`exec`] (`execute_cmd`), [`hashing`], [`ids`],
//! [`leftovers`] (agents a killed server left running, stopped at start), [`listen`] (the
//! `BBS_UNIX_SOCKET` listener), and `proxy` (the in-process LLM proxy).
//!
//! The server adopts the orphans of the processes it runs (`agentbox_sandbox::reaper`): a
//! tool that leaves its agent's tree still dies when the agent is stopped.

#![forbid(unsafe_code)]

pub mod backend;
pub mod config;
pub mod error;
pub mod exec;
pub mod hashing;
pub mod ids;
pub mod leftovers;
pub mod listen;
pub mod model;
pub mod proxy;
pub mod routes;
pub mod runtime_dir;
pub mod server;
pub mod session;

use agentbox_sandbox::reaper;
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;

pub use config::Config;
pub use server::Server;

/// What the server listens on: `BBS_HOST:BBS_PORT`, or `BBS_UNIX_SOCKET`.
#[derive(Debug)]
pub enum Listener {
    /// TCP.
    Tcp(TcpListener),
    /// A unix socket (bound by [`listen::bind_unix`]).
    Unix(UnixListener),
}

/// Serves on `listener` until `stop` is cancelled, then shuts down gracefully: turns and
/// commands are ended, requests get until `BBS_SHUTDOWN_TIMEOUT`, the agent and its process
/// group are stopped and the runtime directory removed.
pub async fn run(listener: Listener, config: Config, stop: CancellationToken) {
    // Before anything is spawned (the reaper's rule): what the agents orphan comes to us.
    let reaping = CancellationToken::new();
    let reaper = match reaper::become_subreaper() {
        Ok(()) => Some(tokio::spawn(reap_orphans(reaping.clone()))),
        Err(e) => {
            tracing::warn!(error = %e, "cannot adopt orphans: a tool that leaves the agent's tree outlives it");
            None
        }
    };
    let root = std::path::PathBuf::from(&config.server.runtime_root);
    match tokio::task::spawn_blocking(move || leftovers::kill(&root)).await {
        Ok(0) => {}
        Ok(n) => tracing::warn!(processes = n, "killed what a previous server left running"),
        Err(e) => tracing::error!(error = %e, "the leftover scan failed"),
    }
    let server = Server::with_router(config.server, config.bins, config.router);
    let serving = CancellationToken::new();
    let app = routes::router(server.clone());
    let http = match listener {
        Listener::Tcp(l) => tokio::spawn(agentbox_http::serve_tcp(l, app, serving.clone())),
        Listener::Unix(l) => tokio::spawn(agentbox_http::serve_unix(l, app, serving.clone())),
    };
    stop.cancelled().await;
    server.shutdown().await;
    // Whatever is left outlived its agent (a command's background job, say).
    reaper::kill_adopted(ORPHAN_KILL_WAIT).await;
    serving.cancel();
    if let Err(e) = http.await {
        tracing::error!(error = %e, "the HTTP server task failed");
    }
    reaping.cancel();
    if let Some(r) = reaper
        && let Err(e) = r.await
    {
        tracing::error!(error = %e, "the orphan reaper task failed");
    }
}

/// How long stopping an agent waits for its orphans' own children to be reparented and killed.
pub(crate) const ORPHAN_KILL_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Reaps adopted orphans as they exit (on `SIGCHLD`, and every few seconds in case a signal
/// was merged with another) until `stop`.
async fn reap_orphans(stop: CancellationToken) {
    let mut sigchld = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "no SIGCHLD stream: reaping orphans on a timer only");
            None
        }
    };
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            _ = async {
                match sigchld.as_mut() {
                    Some(s) => s.recv().await,
                    None => std::future::pending().await,
                }
            } => {}
            () = tokio::time::sleep(std::time::Duration::from_secs(5)) => {}
        }
        // A scan of /proc: off the (single-threaded) runtime.
        if let Err(e) = tokio::task::spawn_blocking(reaper::reap_adopted).await {
            tracing::error!(error = %e, "the orphan reap failed");
        }
    }
}
