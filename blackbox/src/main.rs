//! `blackbox-server`: reads `BBS_*` (`--help` lists them), binds `BBS_HOST:BBS_PORT` (or the
//! unix socket `BBS_UNIX_SOCKET`), prints `listening on <addr>` (or the socket's path) once bound, serves until SIGTERM or SIGINT, then shuts down
//! gracefully. A bad variable is exit code 78 naming it.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use agentbox_blackbox::Listener;
use agentbox_blackbox::config::{Config, Listen, variables_help};
use agentbox_policy::config::ProcessEnv;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    // The server takes no arguments, so clap only has work when there are some (`--help`,
    // `--version`, or a mistake to refuse): a plain start leaves its code untouched, which keeps
    // those pages out of the idle server's memory.
    if std::env::args_os().len() > 1 {
        clap::Command::new("blackbox-server")
            .about(
                "Drives one agent CLI for an RL rollout manager (the Dressage blackbox protocol)",
            )
            .version(env!("CARGO_PKG_VERSION"))
            .after_help(variables_help())
            .get_matches();
    }
    agentbox_http::init_logging();
    let config = match Config::from_env(&ProcessEnv) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("blackbox-server: {e}");
            return ExitCode::from(78);
        }
    };
    agentbox_http::block_on("blackbox-server", async move {
        let listener = match &config.listen {
            Listen::Unix(path) => match agentbox_blackbox::listen::bind_unix(path) {
                Ok(l) => {
                    if let Err(e) = agentbox_http::announce_listening(path.display()) {
                        eprintln!("blackbox-server: {e}");
                        return ExitCode::FAILURE;
                    }
                    Listener::Unix(l)
                }
                Err(e) => {
                    eprintln!("blackbox-server: {e}");
                    return ExitCode::FAILURE;
                }
            },
            Listen::Tcp => {
                let addr = (config.server.host.clone(), config.server.port);
                let listener = match tokio::net::TcpListener::bind(addr).await {
                    Ok(l) => l,
                    Err(e) => {
                        eprintln!(
                            "blackbox-server: cannot listen on {}:{}: {e}",
                            config.server.host, config.server.port
                        );
                        return ExitCode::FAILURE;
                    }
                };
                if let Err(e) = listener
                    .local_addr()
                    .and_then(agentbox_http::announce_listening)
                {
                    eprintln!("blackbox-server: {e}");
                    return ExitCode::FAILURE;
                }
                Listener::Tcp(listener)
            }
        };
        let stop = CancellationToken::new();
        agentbox_http::cancel_on_shutdown_signal(&stop);
        agentbox_blackbox::run(listener, config, stop).await;
        ExitCode::SUCCESS
    })
}
