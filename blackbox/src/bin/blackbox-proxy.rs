//! `blackbox-proxy`: the rollout LLM proxy alone, with a loopback control API for its turn and
//! pause operations (`agentbox_blackbox::proxy::control`). Used by the integration tests and
//! the bench; `blackbox-server` runs the same proxy in-process.
//!
//! Prints `listening on <proxy addr> control <control addr>` once both listeners are bound.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use agentbox_blackbox::proxy::{
    DEFAULT_MAX_STEPS, DEFAULT_ROUTER_API_PATH, DEFAULT_STICKY_HEADER, ProxyConfig,
    serve_standalone,
};
use clap::Parser;
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(about = "The blackbox rollout LLM proxy, standalone, with a control API")]
struct Args {
    /// Where agents connect.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where the control API listens (keep it on loopback).
    #[arg(long, default_value = "127.0.0.1:0")]
    control: SocketAddr,
    /// The router's origin, e.g. http://127.0.0.1:8000.
    #[arg(long)]
    upstream: String,
    #[arg(long, default_value = DEFAULT_ROUTER_API_PATH)]
    router_api_path: String,
    #[arg(long, default_value = "sess-001")]
    session_id: String,
    #[arg(long, default_value = "inst-001")]
    instance_id: String,
    #[arg(long)]
    sandbox_id: Option<String>,
    #[arg(long, default_value = DEFAULT_STICKY_HEADER)]
    sticky_header: String,
    /// Model calls per turn; 0 disables the limit.
    #[arg(long, default_value_t = DEFAULT_MAX_STEPS)]
    max_steps: u32,
    #[arg(long)]
    default_temperature: Option<f64>,
    #[arg(long)]
    model_override: Option<String>,
    /// The longest silence from the router while it answers, in milliseconds.
    #[arg(long, default_value_t = 600_000)]
    router_timeout_ms: u64,
    /// `NAME=VALUE` sent on every upstream request; repeatable.
    #[arg(long = "upstream-header")]
    upstream_headers: Vec<String>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    agentbox_http::init_logging();
    // The runtime blackbox-server runs its proxy on, so the bench measures what ships.
    let runtime = match agentbox_http::current_thread_runtime("blackbox-proxy") {
        Ok(r) => r,
        Err(code) => return code,
    };
    match runtime.block_on(run(args)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("blackbox-proxy: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let mut upstream_headers = Vec::new();
    for h in &args.upstream_headers {
        let (k, v) = h
            .split_once('=')
            .ok_or_else(|| format!("--upstream-header {h:?}: expected NAME=VALUE"))?;
        upstream_headers.push((k.to_owned(), v.to_owned()));
    }
    let cfg = ProxyConfig {
        router_api_path: args.router_api_path,
        bound_sandbox_id: args.sandbox_id,
        sticky_header_name: args.sticky_header,
        max_steps: Some(args.max_steps),
        default_temperature: args.default_temperature,
        router_timeout: Duration::from_millis(args.router_timeout_ms),
        upstream_headers,
        model_override: args.model_override,
        ..ProxyConfig::new(args.upstream, args.session_id, args.instance_id)
    };
    let bind = |addr: SocketAddr| async move {
        tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))
    };
    let proxy = bind(args.listen).await?;
    let control = bind(args.control).await?;
    let addrs = (proxy.local_addr(), control.local_addr());
    let (Ok(p), Ok(c)) = addrs else {
        return Err("cannot read the listeners' addresses".into());
    };
    agentbox_http::announce_listening(format_args!("{p} control {c}"))
        .map_err(|e| format!("stdout: {e}"))?;
    let stop = CancellationToken::new();
    agentbox_http::cancel_on_shutdown_signal(&stop);
    serve_standalone(proxy, control, cfg, stop)
        .await
        .map_err(|e| e.to_string())
}
