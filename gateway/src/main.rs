//! `agentbox-gateway`: reads the config, opens `run/gateway.sock`, restores the tasks that were
//! open, serves until SIGTERM or SIGINT, then drains and saves. Prints
//! `listening on unix:<path>` on stdout once the control socket is bound.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use agentbox_gateway::{Gateway, GatewayOptions};
use agentbox_http::control::{self, ControlSocket};
use agentbox_policy::config::ProcessEnv;
use tokio_util::sync::CancellationToken;

fn main() -> ExitCode {
    // First, before any thread or arena exists: request-sized buffers go back to the kernel
    // when freed instead of staying in per-thread heaps (peak RSS at c=64, BENCHMARKS.md).
    let malloc = agentbox_sandbox::proc::tune_malloc(agentbox_sandbox::proc::MallocTuning::PROXY);
    let config = match agentbox_http::start_daemon(
        "agentbox-gateway",
        "The agentbox per-task LLM gateway",
    ) {
        Ok(c) => c,
        Err(code) => return code,
    };
    tracing::debug!(?malloc, "malloc tuning");
    // The control socket and the state writer: one thread is plenty. The task sockets run on
    // the gateway's shards (`gateway.threads` of them; `agentbox_gateway::shards`).
    match agentbox_http::current_thread_runtime("agentbox-gateway") {
        Ok(r) => r.block_on(run(GatewayOptions::from_config(&config, &ProcessEnv))),
        Err(code) => code,
    }
}

async fn run(opts: GatewayOptions) -> ExitCode {
    let run_dir = match control::run_dir("agentbox-gateway", &opts.data_dir) {
        Ok(d) => d,
        Err(code) => return code,
    };
    let shutdown = CancellationToken::new();
    let gw = match Gateway::new(opts, shutdown.clone()) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("agentbox-gateway: {e}");
            return ExitCode::FAILURE;
        }
    };
    let socket = match ControlSocket::bind("agentbox-gateway", run_dir.join("gateway.sock")) {
        Ok(s) => s,
        Err(code) => return code,
    };
    for (tid, err) in gw.restore() {
        eprintln!("agentbox-gateway: task {tid} not restored: {err}");
    }
    let persister = tokio::spawn(gw.clone().run_persister());
    socket
        .serve(agentbox_gateway::control::router(gw.clone()), shutdown)
        .await;
    let drained = persister.await;
    if let Err(e) = gw.stop_and_save().await {
        eprintln!("agentbox-gateway: cannot save the state at shutdown: {e}");
        return ExitCode::FAILURE;
    }
    if let Err(e) = drained {
        eprintln!("agentbox-gateway: state writer failed: {e}");
        return ExitCode::FAILURE;
    }
    ExitCode::SUCCESS
}
