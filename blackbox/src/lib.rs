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
    serving.cancel();
    if let Err(e) = http.await {
        tracing::error!(error = %e, "the HTTP server task failed");
    }
}
