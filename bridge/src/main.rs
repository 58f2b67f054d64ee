//! `agentbox-bridge`: reads the config and the keys, binds `bridge.listen`, serves until
//! SIGTERM or SIGINT. Prints `listening on <addr>` on stdout once bound (port 0 picks one).

#![forbid(unsafe_code)]

use std::io::Write;
use std::process::ExitCode;

use agentbox_policy::config::ProcessEnv;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    let config = match agentbox_http::start_daemon("agentbox-bridge", "The agentbox llm-bridge") {
        Ok(c) => c,
        Err(code) => return code,
    };
    let bridge = match agentbox_bridge::Bridge::from_config(&config, &ProcessEnv) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("agentbox-bridge: {e}");
            return ExitCode::from(78);
        }
    };
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            eprintln!("agentbox-bridge: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let listener = match tokio::net::TcpListener::bind(config.bridge.listen).await {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "agentbox-bridge: cannot listen on {}: {e}",
                    config.bridge.listen
                );
                return ExitCode::FAILURE;
            }
        };
        match listener.local_addr() {
            Ok(addr) => {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "listening on {addr}");
                let _ = out.flush();
            }
            Err(e) => {
                eprintln!("agentbox-bridge: {e}");
                return ExitCode::FAILURE;
            }
        }
        let shutdown = CancellationToken::new();
        let signals = shutdown.clone();
        tokio::spawn(async move {
            agentbox_http::shutdown_signal().await;
            signals.cancel();
        });
        agentbox_http::serve_tcp(listener, agentbox_bridge::router(bridge), shutdown).await;
        ExitCode::SUCCESS
    })
}
