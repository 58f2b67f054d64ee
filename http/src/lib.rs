//! The HTTP plumbing every agentbox daemon shares: an accept loop over a TCP or unix listener
//! that the caller bound (so tests use port 0 and temp sockets), with a header read timeout,
//! tracked connection tasks and graceful shutdown; the unix peer's credentials attached to
//! every request; and reading a request body under a size limit and a deadline.
//! [`start_daemon`] is every unprivileged daemon's start, and [`privs`] the capability sets
//! (the launcher keeps a few, the gateway and bridge none).
//!
//! One client must not starve the others: a listener can cap its connections
//! ([`ConnectionLimit`]: the excess is answered by a refusal router and closed, never queued
//! on a descriptor), and [`read_body_within`] buffers a body only after taking its bytes from
//! a per-client and a process-wide [`BodyBudget`], refusing at once when either is spent.
//!
//! We run our own loop instead of `axum::serve` because a slowloris client must not hold a
//! connection forever (`axum::serve` has no header timeout), because shutdown must wait for
//! in-flight requests and leak no task, and because the control sockets authenticate callers
//! by `SO_PEERCRED`, which axum does not expose.

#![forbid(unsafe_code)]

pub mod bufpool;
pub mod control;
pub mod loopback;
pub mod privs;

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::Request;
use axum::http::{HeaderMap, header};
use bytes::Bytes;

use crate::bufpool::BodyBuf;
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::ServiceExt;

/// How long a client may take to send its request head.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a refused (over-limit) connection may take to send its request head before it is
/// simply closed.
pub const REFUSAL_HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// The most a connection's read buffer grows to (hyper's default is ~400 KB), which is also the
/// longest request head accepted (nginx's default allows 32 KB of header lines too; Claude
/// Code's heads are a few KB). hyper doubles the buffer while reads fill it, so a ~100 KB body
/// read off a fast socket would leave a keep-alive connection holding up to 256 KB. It stays
/// under glibc's 64 KiB mmap threshold (`MallocTuning::PROXY`), so the buffers a large body is
/// read through come from the heap instead of an `mmap` and a `munmap` each (BENCHMARKS.md,
/// "Reused body buffers").
pub const MAX_READ_BUFFER: usize = 32 << 10;

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
            tracker.spawn(serve_connection(
                stream,
                router.clone(),
                shutdown.clone(),
                Conn::SERVED,
            ));
        },
    )
    .await;
}

/// Serves `router` on a unix listener until `shutdown` is cancelled. Every request carries the
/// connecting process's [`PeerCred`] in its extensions; a connection whose credentials cannot be
/// read is closed unserved, since the control sockets authorize on them.
pub async fn serve_unix(listener: UnixListener, router: Router, shutdown: CancellationToken) {
    serve_unix_limited(listener, router, None, shutdown).await;
}

/// How many connections one listener serves at once, and what the excess gets.
#[derive(Debug, Clone)]
pub struct ConnectionLimit {
    served: Arc<Semaphore>,
    refusing: Arc<Semaphore>,
    refusal: Router,
}

impl ConnectionLimit {
    /// At most `max` connections are served by the listener's router. Up to `max` more at a
    /// time are answered by `refusal` (which should say 429 or 503) and closed after one
    /// request; past that a new connection is closed at once. So one listener never holds more
    /// than `2 * max` descriptors, however many its client opens.
    pub fn new(max: usize, refusal: Router) -> Self {
        let max = max.clamp(1, Semaphore::MAX_PERMITS);
        ConnectionLimit {
            served: Arc::new(Semaphore::new(max)),
            refusing: Arc::new(Semaphore::new(max)),
            refusal,
        }
    }
}

/// [`serve_unix`] with an optional [`ConnectionLimit`].
pub async fn serve_unix_limited(
    listener: UnixListener,
    router: Router,
    limit: Option<ConnectionLimit>,
    shutdown: CancellationToken,
) {
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
            let (router, permit, refused) = match &limit {
                None => (router.clone(), None, false),
                Some(l) => match l.served.clone().try_acquire_owned() {
                    Ok(p) => (router.clone(), Some(p), false),
                    Err(_) => match l.refusing.clone().try_acquire_owned() {
                        Ok(p) => (l.refusal.clone(), Some(p), true),
                        Err(_) => {
                            tracing::debug!(uid = cred.uid, "connection limit reached; closing");
                            return;
                        }
                    },
                },
            };
            let svc = tower::service_fn(move |mut req: Request<hyper::body::Incoming>| {
                req.extensions_mut().insert(cred);
                router.clone().oneshot(req.map(Body::new))
            });
            let conn = if refused { Conn::REFUSAL } else { Conn::SERVED };
            let shutdown = shutdown.clone();
            tracker.spawn(async move {
                serve_connection(stream, svc, shutdown, conn).await;
                drop(permit);
            });
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

/// How one connection is served.
#[derive(Debug, Clone, Copy)]
struct Conn {
    header_timeout: Duration,
    keep_alive: bool,
}

impl Conn {
    const SERVED: Conn = Conn {
        header_timeout: HEADER_READ_TIMEOUT,
        keep_alive: true,
    };
    /// One quick answer, then the descriptor is given back.
    const REFUSAL: Conn = Conn {
        header_timeout: REFUSAL_HEADER_TIMEOUT,
        keep_alive: false,
    };
}

async fn serve_connection<IO, S>(io: IO, service: S, shutdown: CancellationToken, how: Conn)
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
        .header_read_timeout(how.header_timeout)
        .max_buf_size(MAX_READ_BUFFER)
        .keep_alive(how.keep_alive);
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

/// The most of a declared `content-length` reserved up front for a body read without budgets
/// ([`read_body`]): a body of a typical model request (~100 KB) is read into one buffer
/// allocated once, not one grown by doubling and copied on the way.
pub const UNCHARGED_RESERVE: usize = 1 << 20;

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
    match read_counted(headers, body, limit, timeout, None).await {
        Ok(held) => Ok(held.bytes),
        Err(BudgetedBodyError::Body(e)) => Err(e),
        // No budgets were given, so none can be spent.
        Err(e @ (BudgetedBodyError::ClientBusy | BudgetedBodyError::ServerBusy)) => {
            Err(BodyError::Read(e.to_string()))
        }
    }
}

/// A pool of bytes that buffered request bodies may hold at once (a semaphore of KiB).
#[derive(Debug, Clone)]
pub struct BodyBudget {
    kib: Arc<Semaphore>,
}

impl BodyBudget {
    /// A budget of `bytes` (rounded up to whole KiB).
    pub fn new(bytes: u64) -> Self {
        let kib = usize::try_from(bytes.div_ceil(1024)).unwrap_or(usize::MAX);
        BodyBudget {
            kib: Arc::new(Semaphore::new(kib.min(Semaphore::MAX_PERMITS))),
        }
    }

    /// Bytes not held by any body now (rounded down to KiB).
    pub fn available(&self) -> u64 {
        self.kib.available_permits() as u64 * 1024
    }
}

/// The two budgets a body is charged to: its client's (one task, one connection source) and the
/// whole process's. The client's is taken first, so a client over its own share is told so
/// without touching the shared pool.
#[derive(Debug, Clone)]
pub struct BodyBudgets {
    /// This client's share.
    pub client: BodyBudget,
    /// Every client's bodies together.
    pub server: BodyBudget,
}

/// Why a budgeted body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum BudgetedBodyError {
    /// Over the size limit, too slow, or broken.
    #[error(transparent)]
    Body(#[from] BodyError),
    /// This client's bodies already hold its whole share (answer 429).
    #[error("too many request bytes in flight from this client")]
    ClientBusy,
    /// All bodies together hold the process's whole budget (answer 503).
    #[error("the server's request-body memory is in use; retry later")]
    ServerBusy,
}

/// A body read under [`BodyBudgets`]: its bytes stay charged until this is dropped, so keep it
/// for as long as the request's data (and what is parsed from it) lives.
#[derive(Debug)]
pub struct HeldBody {
    bytes: Bytes,
    charge: BodyCharge,
}

impl HeldBody {
    /// The body.
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }

    /// The bytes and their charge apart: parse the bytes, drop them, and keep the charge for
    /// as long as what was parsed from them lives.
    pub fn split(self) -> (Bytes, BodyCharge) {
        (self.bytes, self.charge)
    }
}

/// What a body holds of its [`BodyBudgets`]; given back on drop.
#[derive(Debug)]
pub struct BodyCharge {
    _held: Option<Held>,
}

/// KiB taken from both budgets.
#[derive(Debug)]
struct Held {
    client: OwnedSemaphorePermit,
    server: OwnedSemaphorePermit,
}

impl Held {
    fn kib(&self) -> usize {
        self.client.num_permits()
    }
}

/// Takes `bytes` more from both budgets, or nothing.
fn charge(
    budgets: &BodyBudgets,
    held: &mut Option<Held>,
    bytes: usize,
) -> Result<(), BudgetedBodyError> {
    let want = bytes.div_ceil(1024);
    let have = held.as_ref().map_or(0, Held::kib);
    let Some(more) = want.checked_sub(have).filter(|m| *m > 0) else {
        return Ok(());
    };
    let more = u32::try_from(more).map_err(|_| BudgetedBodyError::ServerBusy)?;
    let take = |b: &BodyBudget, busy: BudgetedBodyError| {
        b.kib.clone().try_acquire_many_owned(more).map_err(|_| busy)
    };
    let client = take(&budgets.client, BudgetedBodyError::ClientBusy)?;
    let server = take(&budgets.server, BudgetedBodyError::ServerBusy)?;
    match held {
        Some(h) => {
            h.client.merge(client);
            h.server.merge(server);
        }
        None => *held = Some(Held { client, server }),
    }
    Ok(())
}

/// [`read_body`] charged to `budgets`: the bytes are taken before they are buffered (all of a
/// declared `content-length` up front, otherwise as the buffer grows), and a body that cannot
/// get them is drained and refused at once, never waiting, so a client that floods the server
/// is answered quickly and the others keep their memory.
pub async fn read_body_within(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    timeout: Duration,
    budgets: &BodyBudgets,
) -> Result<HeldBody, BudgetedBodyError> {
    read_counted(headers, body, limit, timeout, Some(budgets)).await
}

async fn read_counted(
    headers: &HeaderMap,
    body: Body,
    limit: u64,
    timeout: Duration,
    budgets: Option<&BodyBudgets>,
) -> Result<HeldBody, BudgetedBodyError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let deadline = tokio::time::Instant::now() + timeout;
    if declared.is_some_and(|n| n > limit) {
        discard(body, deadline).await;
        return Err(BodyError::TooLarge { limit }.into());
    }
    let mut held = None;
    let mut buf = BodyBuf::new();
    if let Some(n) = declared.and_then(|n| usize::try_from(n).ok()) {
        match budgets {
            Some(b) => {
                // Allocated once, at its final size (a pooled class may round it up to twice
                // that): the budget is charged for what the buffer really holds.
                if let Err(e) = charge(b, &mut held, BodyBuf::capacity_for(n)) {
                    discard(body, deadline).await;
                    return Err(e);
                }
                buf = BodyBuf::with_capacity(n);
            }
            // Uncharged, the declared length is trusted only up to a small size (a body
            // that never comes must not hold a large buffer); past it the buffer grows.
            None => buf = BodyBuf::with_capacity(n.min(UNCHARGED_RESERVE)),
        }
    }
    let mut body = body.into_data_stream();
    loop {
        let next = match tokio::time::timeout_at(deadline, body.next()).await {
            Err(_) => return Err(BodyError::Timeout(timeout).into()),
            Ok(n) => n,
        };
        match next {
            None => {
                return Ok(HeldBody {
                    bytes: buf.freeze(),
                    charge: BodyCharge { _held: held },
                });
            }
            Some(Err(e)) => return Err(BodyError::Read(e.to_string()).into()),
            Some(Ok(chunk)) => {
                let needed = buf.len() + chunk.len();
                if needed as u64 > limit {
                    discard_stream(body, deadline).await;
                    return Err(BodyError::TooLarge { limit }.into());
                }
                if let Some(b) = budgets
                    && needed > buf.capacity()
                {
                    // Grow by doubling, as `BytesMut` would, but charge the capacity first.
                    let cap = needed
                        .max(buf.capacity().saturating_mul(2))
                        .min(usize::try_from(limit).unwrap_or(usize::MAX));
                    if let Err(e) = charge(b, &mut held, cap) {
                        discard_stream(body, deadline).await;
                        return Err(e);
                    }
                    buf.reserve_exact(cap - buf.len());
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

/// The multi-threaded runtime a daemon's `main` runs on. A runtime that cannot start is
/// reported on stderr as `<program>: cannot start the runtime: <error>` and becomes exit code 1.
pub fn runtime(program: &str) -> Result<tokio::runtime::Runtime, std::process::ExitCode> {
    started(program, tokio::runtime::Runtime::new())
}

/// A runtime that was built, or its failure reported as [`runtime`] says.
fn started(
    program: &str,
    built: std::io::Result<tokio::runtime::Runtime>,
) -> Result<tokio::runtime::Runtime, std::process::ExitCode> {
    built.map_err(|e| {
        eprintln!("{program}: cannot start the runtime: {e}");
        std::process::ExitCode::FAILURE
    })
}

/// The runtime of a daemon with a configured thread count: [`current_thread_runtime`] for 1,
/// else a multi-threaded one with `threads` workers. Errors as for [`runtime`].
pub fn runtime_with_threads(
    program: &str,
    threads: usize,
) -> Result<tokio::runtime::Runtime, std::process::ExitCode> {
    if threads <= 1 {
        return current_thread_runtime(program);
    }
    started(
        program,
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .enable_all()
            .build(),
    )
}

/// Runs a daemon's `main` future on [`runtime`] to its exit code (the runtime's own failure
/// is reported as there).
pub fn block_on(
    program: &str,
    main: impl std::future::Future<Output = std::process::ExitCode>,
) -> std::process::ExitCode {
    match runtime(program) {
        Ok(r) => r.block_on(main),
        Err(code) => code,
    }
}

/// The single-threaded runtime of a daemon that serves one client at a time (blackbox-server:
/// one session, one agent): no worker thread per core, so a host with many cores and hundreds of
/// slots does not run cores × slots idle workers, and the multi-threaded scheduler's code stays
/// out of the idle server's memory. Blocking work still goes to tokio's blocking pool. Errors as
/// for [`runtime`].
pub fn current_thread_runtime(
    program: &str,
) -> Result<tokio::runtime::Runtime, std::process::ExitCode> {
    started(
        program,
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
    )
}

/// Prints `listening on <address>` on stdout and flushes it: the line the tests and the
/// daemons' supervisors wait for before they connect.
///
/// # Errors
/// When stdout cannot be written.
pub fn announce_listening(address: impl std::fmt::Display) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    writeln!(out, "listening on {address}")?;
    out.flush()
}

/// Cancels `token` on SIGTERM or SIGINT (see [`shutdown_signal`]), from a spawned task.
pub fn cancel_on_shutdown_signal(token: &CancellationToken) {
    let token = token.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        token.cancel();
    });
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

/// An error with its whole source chain, written once in `agentbox-api` (whose client needs it
/// and which this crate may use) and offered here to the daemons that do not link the API.
pub use agentbox_api::error_chain;
