//! `agentbox-bridge`: reads the config and the keys, binds `bridge.listen`, serves until
//! SIGTERM or SIGINT. Prints `listening on <addr>` on stdout once bound (port 0 picks one).

#![forbid(unsafe_code)]

use std::process::ExitCode;

use agentbox_policy::config::ProcessEnv;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    // First, before any thread or arena exists: request-sized buffers go back to the kernel
    // when freed instead of staying in per-thread heaps (peak RSS at c=64, BENCHMARKS.md).
    let malloc = agentbox_sandbox::proc::tune_malloc(agentbox_sandbox::proc::MallocTuning::PROXY);
    let config = match agentbox_http::start_daemon("agentbox-bridge", "The agentbox llm-bridge") {
        Ok(c) => c,
        Err(code) => return code,
    };
    tracing::debug!(?malloc, "malloc tuning");
    let bridge = match agentbox_bridge::Bridge::from_config(&config, &ProcessEnv) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("agentbox-bridge: {e}");
            return ExitCode::from(78);
        }
    };
    let runtime =
        match agentbox_http::runtime_with_threads("agentbox-bridge", config.bridge.threads) {
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
