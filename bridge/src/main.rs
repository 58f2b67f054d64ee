//! `agentbox-bridge`: reads the config and the keys, binds `bridge.listen`, serves until
//! SIGTERM or SIGINT. Prints `listening on <addr>` on stdout once bound (port 0 picks one).

#![forbid(unsafe_code)]

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
    let runtime = match agentbox_http::runtime("agentbox-bridge") {
        Ok(r) => r,
        Err(code) => return code,
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
        let addr = match listener.local_addr() {
            Ok(a) => a,
            Err(e) => {
                eprintln!("agentbox-bridge: {e}");
                return ExitCode::FAILURE;
            }
        };
        // A closed stdout only loses the announcement; the listener serves all the same.
        let _ = agentbox_http::announce_listening(addr);
        let shutdown = CancellationToken::new();
        agentbox_http::cancel_on_shutdown_signal(&shutdown);
        agentbox_http::serve_tcp(listener, agentbox_bridge::router(bridge), shutdown).await;
        ExitCode::SUCCESS
    })
}
