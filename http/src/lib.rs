//! The HTTP plumbing every agentbox daemon shares: an accept loop over a TCP or unix listener
//! that the caller bound (so tests use port 0 and temp sockets), with a header read timeout,
//! tracked connection tasks and graceful shutdown; the unix peer's credentials attached to
//! every request; and reading a request body under a size limit and a deadline.
//! [`start_daemon`] is every unprivileged daemon's start, and [`privs`] the capability sets
//! (the launcher keeps a few, the gateway and bridge none).
//!
//! We run our own loop instead of `axum::serve` because a slowloris client must not hold a
//! connection forever (`axum::serve` has no header timeout), because shutdown must wait for
//! in-flight requests and leak no task, and because the control sockets authenticate callers
//! by `SO_PEERCRED`, which axum does not expose.

#![forbid(unsafe_code)]

pub mod privs;

use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, header};
use bytes::Bytes;
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

/// How long a client may take to send its request head.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long shutdown waits for in-flight connections before dropping them.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(10);

/// The credentials of the process on the other end of a unix socket, as the kernel reported
/// them at connect time (`SO_PEERCRED`). Present in the extensions of every request served by
/// [`serve_unix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCred {
    /// The peer's effective uid.
    pub uid: u32,
    /// The peer's effective gid.
    pub gid: u32,
    /// The peer's pid, when the kernel reported one.
    pub pid: Option<i32>,
}

/// Serves `router` on a TCP listener until `shutdown` is cancelled.
pub async fn serve_tcp(listener: TcpListener, router: Router, shutdown: CancellationToken) {
    accept_loop(
        || listener.accept(),
        &shutdown,
        |stream, tracker| {
            if let Err(e) = stream.set_nodelay(true) {
                tracing::debug!(error = %e, "set_nodelay failed");
            }
            tracker.spawn(serve_connection(stream, router.clone(), shutdown.clone()));
        },
    )
    .await;
}

/// Serves `router` on a unix listener until `shutdown` is cancelled. Every request carries the
/// connecting process's [`PeerCred`] in its extensions; a connection whose credentials cannot be
/// read is closed unserved, since the control sockets authorize on them.
pub async fn serve_unix(listener: UnixListener, router: Router, shutdown: CancellationToken) {
    accept_loop(
        || listener.accept(),
        &shutdown,
        |stream, tracker| {
            let cred = match stream.peer_cred() {
                Ok(c) => PeerCred {
                    uid: c.uid(),
                    gid: c.gid(),
                    pid: c.pid(),
                },
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read peer credentials; closing");
                    return;
                }
            };
            let router = router.clone();
            let svc = tower::service_fn(move |mut req: Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(cred);
                router.clone().oneshot(req.map(Body::new))
            });
            tracker.spawn(serve_connection(stream, svc, shutdown.clone()));
        },
    )
    .await;
}

/// The loop both listeners share: accept until `shutdown` is cancelled, hand each stream to
/// `serve` (which spawns its connection task on the tracker), back off on accept errors, then
/// drain the tracked connections.
async fn accept_loop<S, A, F>(
    mut accept: impl FnMut() -> F,
    shutdown: &CancellationToken,
    mut serve: impl FnMut(S, &TaskTracker),
) where
    F: Future<Output = std::io::Result<(S, A)>>,
{
    let tracker = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = accept() => accepted,
        };
        match accepted {
            Ok((stream, _)) => serve(stream, &tracker),
            Err(e) => accept_backoff(&e).await,
        }
    }
    drain_connections(tracker).await;
}

async fn accept_backoff(e: &std::io::Error) {
    // EMFILE and friends: back off instead of spinning; the listener stays usable.
    tracing::warn!(error = %e, "accept failed");
    tokio::time::sleep(Duration::from_millis(50)).await;
}

async fn drain_connections(tracker: TaskTracker) {
    tracker.close();
    if tokio::time::timeout(SHUTDOWN_GRACE, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("connections still open after the shutdown grace period; dropping them");
    }
}

async fn serve_connection<IO, S>(io: IO, service: S, shutdown: CancellationToken)
where
    IO: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    S: tower::Service<
            Request<hyper::body::Incoming>,
            Response = axum::response::Response,
            Error = std::convert::Infallible,
        > + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT);
    let conn = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(service));
    let mut conn = std::pin::pin!(conn);
    let result = tokio::select! {
        r = conn.as_mut() => r,
        () = shutdown.cancelled() => {
            conn.as_mut().graceful_shutdown();
            conn.await
        }
    };
    if let Err(e) = result {
        tracing::debug!(error = %e, "connection ended with an error");
    }
}

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    /// Over the limit (declared by `content-length` or found while reading).
    #[error("request body exceeds {limit} bytes")]
    TooLarge {
        /// The limit, bytes.
        limit: u64,
    },
    /// The client did not deliver the body before the deadline.
    #[error("request body not received within {0:?}")]
    Timeout(Duration),
    /// The connection broke or the framing was invalid.
    #[error("cannot read request body: {0}")]
    Read(String),
}

/// How much of an over-limit body is read and discarded so the client, still sending, gets to
/// read our 413 instead of a broken pipe. Past this the connection is simply closed.
pub const DRAIN_MAX: u64 = 64 << 20;

/// Reads a request body of at most `limit` bytes within `timeout`. A declared
/// `content-length` over the limit is refused without buffering; the rest of an over-limit body
/// is drained (up to [`DRAIN_MAX`], within the same deadline) so the client sees the error.
pub async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    timeout: Duration,
) -> Result<Bytes, BodyError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let deadline = tokio::time::Instant::now() + timeout;
    if declared.is_some_and(|n| n > limit) {
        discard(body, deadline).await;
        return Err(BodyError::TooLarge { limit });
    }
    let mut body = body.into_data_stream();
    let mut buf = bytes::BytesMut::new();
    loop {
        let next = match tokio::time::timeout_at(deadline, body.next()).await {
            Err(_) => return Err(BodyError::Timeout(timeout)),
            Ok(n) => n,
        };
        match next {
            None => return Ok(buf.freeze()),
            Some(Err(e)) => return Err(BodyError::Read(e.to_string())),
            Some(Ok(chunk)) => {
                if (buf.len() + chunk.len()) as u64 > limit {
                    discard_stream(body, deadline).await;
                    return Err(BodyError::TooLarge { limit });
                }
                buf.extend_from_slice(&chunk);
            }
        }
    }
}

async fn discard(body: Body, deadline: tokio::time::Instant) {
    discard_stream(body.into_data_stream(), deadline).await;
}

async fn discard_stream(mut body: axum::body::BodyDataStream, deadline: tokio::time::Instant) {
    let mut seen = 0u64;
    while seen < DRAIN_MAX {
        match tokio::time::timeout_at(deadline, body.next()).await {
            Ok(Some(Ok(chunk))) => seen += chunk.len() as u64,
            Ok(Some(Err(_)) | None) | Err(_) => return,
        }
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (default `info`): what every daemon's `main` sets up
/// first, so journald gets one format from all of them.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
}

/// The command line of a daemon that takes only its config file.
#[derive(Debug, clap::Parser)]
struct DaemonArgs {
    /// The config file (default: $AGENTBOX_CONFIG, then /etc/agentbox/agentbox.toml).
    #[arg(long)]
    config: Option<std::path::PathBuf>,
}

/// A daemon's first steps: its command line (`--config <file>`, `--help`, `--version`),
/// logging (see [`init_logging`]), no capabilities ([`privs::require_none`]: a service user
/// holding any is refused with exit code 77, `EX_NOPERM`; root drops them all), then its config
/// from `--config` (else `$AGENTBOX_CONFIG`, else the default path). A config that does not
/// load is reported on stderr as `<program>: <error>` and becomes exit code 78 (`EX_CONFIG`),
/// before anything listens. Call it before starting any thread: capabilities are per thread.
pub fn start_daemon(
    program: &'static str,
    about: &'static str,
) -> Result<agentbox_policy::config::Config, std::process::ExitCode> {
    use agentbox_policy::config::{Config, ProcessEnv, config_path};
    use clap::{CommandFactory, FromArgMatches};
    let matches = DaemonArgs::command()
        .name(program)
        .bin_name(program)
        .about(about)
        .version(env!("CARGO_PKG_VERSION"))
        .get_matches();
    let args = DaemonArgs::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    init_logging();
    match privs::require_none() {
        Ok(privs::NoCaps::Held) => {}
        Ok(privs::NoCaps::DroppedAsRoot) => {
            tracing::warn!("running as root: dropped every capability");
        }
        Err(e) => {
            eprintln!("{program}: {e}");
            return Err(std::process::ExitCode::from(77));
        }
    }
    let env = ProcessEnv;
    Config::load(&config_path(args.config.as_deref(), &env), &env).map_err(|e| {
        eprintln!("{program}: {e}");
        std::process::ExitCode::from(78)
    })
}

/// Resolves on SIGTERM (systemd's stop) or SIGINT.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        (Err(e), _) | (_, Err(e)) => {
            tracing::error!(error = %e, "cannot install signal handlers; stopping only on ctrl-c");
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

/// An error with its whole source chain (`a: b: c`): HTTP client errors keep the useful part
/// (connection refused, timed out) in their sources.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}
