//! `agentbox-gateway`: reads the config, opens `run/gateway.sock`, restores the tasks that were
//! open, serves until SIGTERM or SIGINT, then drains and saves. Prints
//! `listening on unix:<path>` on stdout once the control socket is bound.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use agentbox_gateway::{Gateway, GatewayOptions};
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
    let runtime = match agentbox_http::runtime("agentbox-gateway") {
        Ok(r) => r,
        Err(code) => return code,
    };
    runtime.block_on(run(GatewayOptions::from_config(&config, &ProcessEnv)))
}

async fn run(opts: GatewayOptions) -> ExitCode {
    let run_dir = opts.data_dir.join("run");
    if let Err(e) = std::fs::create_dir_all(&run_dir) {
        eprintln!("agentbox-gateway: cannot create {}: {e}", run_dir.display());
        return ExitCode::FAILURE;
    }
    let shutdown = CancellationToken::new();
    let gw = match Gateway::new(opts, shutdown.clone()) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("agentbox-gateway: {e}");
            return ExitCode::FAILURE;
        }
    };
    let path = run_dir.join("gateway.sock");
    let listener = match bind_control(&path) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("agentbox-gateway: cannot listen on {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
    };
    for (tid, err) in gw.restore() {
        eprintln!("agentbox-gateway: task {tid} not restored: {err}");
    }
    // A closed stdout only loses the announcement; the socket serves all the same.
    let _ = agentbox_http::announce_listening(format_args!("unix:{}", path.display()));
    agentbox_http::cancel_on_shutdown_signal(&shutdown);
    let persister = tokio::spawn(gw.clone().run_persister());
    agentbox_http::serve_unix(listener, agentbox_gateway::control::router(gw), shutdown).await;
    if let Err(e) = persister.await {
        eprintln!("agentbox-gateway: state writer failed: {e}");
        return ExitCode::FAILURE;
    }
    let _ = std::fs::remove_file(&path);
    ExitCode::SUCCESS
}

/// Binds the control socket, replacing a stale socket from a previous run (never anything
/// else), mode 0600: only the service user (and root) may connect.
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
