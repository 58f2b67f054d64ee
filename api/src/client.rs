//! One HTTP/1.1 client over unix sockets (hyper's pooled client with hyperlocal's connector),
//! typed per route for the launcher and the gateway, with raw access (status, headers, body
//! bytes) for callers that must send or read what the types cannot: malformed requests, other
//! sockets (a task's `llm.sock`), streamed answers.
//!
//! A non-2xx answer becomes [`ClientError::Api`] carrying the status and the envelope's `code`
//! and `message`, so callers branch on `code`. Every exchange is bounded by a timeout, except
//! the routes that wait by design (`?wait=1`, starting a backend), which have their own.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use agentbox_policy::config::ModelId;
use agentbox_policy::id::Tid;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Method;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use hyperlocal::UnixConnector;
use serde::Serialize;
use serde::de::DeserializeOwned;

use crate::error::{ApiError, ErrorEnvelope};
use crate::gateway::{GatewayStatus, OpenTask, TaskView};
use crate::launcher::{
    AgentRequest, AgentStatus, BackendStartResult, BackendStopResult, CheckRequest, CheckResult,
    DeleteBranchRequest, DeleteBranchResult, DeliverRequest, DeliverResult, LauncherStatus,
    SlotExecRequest, SlotExecResult, SlotFile, SlotReadRequest, SlotRequest, SlotStatus,
    SlotWriteRequest, SlotWriteResult, SnapshotRequest, SnapshotResult,
};
use crate::pool::{
    AcquireRequest, CommandReply, FileReply, Lease, LeaseRef, PoolStatus, ReadFileRequest,
    ReleaseReply, RunCommandRequest, WriteFileRequest, WriteReply,
};

/// The default bound on one exchange.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How much of an unexpected body an error quotes.
const QUOTE_LIMIT: usize = 2048;

/// What a call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon answered with its error envelope.
    #[error("{status} {}: {}", error.code, error.message)]
    Api {
        /// The HTTP status.
        status: u16,
        /// `code` (stable) and `message` (for people).
        error: ApiError,
    },
    /// A non-2xx answer without the envelope (not one of our daemons?).
    #[error("status {status} without an error envelope: {body}")]
    Status {
        /// The HTTP status.
        status: u16,
        /// The start of the body.
        body: String,
    },
    /// A 2xx answer that is not the expected JSON.
    #[error("status {status}, unexpected body ({source}): {body}")]
    Decode {
        /// The HTTP status.
        status: u16,
        /// The start of the body.
        body: String,
        /// The parse error.
        source: serde_json::Error,
    },
    /// The request could not be built (a bad method, path or header).
    #[error("invalid request: {0}")]
    Request(String),
    /// Connecting, sending or reading failed (including a connection dropped mid-body).
    #[error("HTTP over {}: {message}", socket.display())]
    Transport {
        /// The socket.
        socket: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// No complete answer within the timeout.
    #[error("HTTP over {}: no answer within {timeout:?}", socket.display())]
    Timeout {
        /// The socket.
        socket: PathBuf,
        /// The bound.
        timeout: Duration,
    },
}

impl ClientError {
    /// The envelope's `code`, for an error answer of a daemon.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { error, .. } => Some(&error.code),
            ClientError::Status { .. }
            | ClientError::Decode { .. }
            | ClientError::Request(_)
            | ClientError::Transport { .. }
            | ClientError::Timeout { .. } => None,
        }
    }

    /// The HTTP status, when there was an answer.
    pub fn status(&self) -> Option<u16> {
        match self {
            ClientError::Api { status, .. }
            | ClientError::Status { status, .. }
            | ClientError::Decode { status, .. } => Some(*status),
            ClientError::Request(_)
            | ClientError::Transport { .. }
            | ClientError::Timeout { .. } => None,
        }
    }
}

/// An answer read to the end.
#[derive(Debug, Clone)]
pub struct RawResponse {
    /// Status code.
    pub status: u16,
    /// Header names (lowercase) to values; repeats joined by `", "`.
    pub headers: BTreeMap<String, String>,
    /// The whole body (de-chunked).
    pub body: Bytes,
}

/// Headers in [`RawResponse::headers`]' form: lowercase names to values, repeats joined by
/// `", "` (fakellm's request log uses the same form, so tests compare the two directly).
#[must_use]
pub fn header_map(headers: &hyper::HeaderMap) -> BTreeMap<String, String> {
    let mut out: BTreeMap<String, String> = BTreeMap::new();
    for (name, value) in headers {
        let value = String::from_utf8_lossy(value.as_bytes()).into_owned();
        out.entry(name.as_str().to_owned())
            .and_modify(|v| {
                v.push_str(", ");
                v.push_str(&value);
            })
            .or_insert(value);
    }
    out
}

impl RawResponse {
    /// The body as `T`, for a 2xx answer; the error envelope as [`ClientError::Api`] otherwise.
    ///
    /// # Errors
    /// A non-2xx status, or a body that is not `T`.
    pub fn json<T: DeserializeOwned>(&self) -> Result<T, ClientError> {
        if !(200..300).contains(&self.status) {
            return Err(match serde_json::from_slice::<ErrorEnvelope>(&self.body) {
                Ok(env) => ClientError::Api {
                    status: self.status,
                    error: env.error,
                },
                Err(_) => ClientError::Status {
                    status: self.status,
                    body: quote(&self.body),
                },
            });
        }
        serde_json::from_slice(&self.body).map_err(|source| ClientError::Decode {
            status: self.status,
            body: quote(&self.body),
            source,
        })
    }

    /// The body as text (invalid UTF-8 replaced), for messages and logs.
    pub fn text(&self) -> std::borrow::Cow<'_, str> {
        String::from_utf8_lossy(&self.body)
    }

    /// The error envelope, if the body is one.
    pub fn error(&self) -> Option<ApiError> {
        serde_json::from_slice::<ErrorEnvelope>(&self.body)
            .ok()
            .map(|e| e.error)
    }
}

fn quote(body: &[u8]) -> String {
    String::from_utf8_lossy(body.get(..QUOTE_LIMIT).unwrap_or(body)).into_owned()
}

/// HTTP/1.1 over one unix socket, keeping idle connections for reuse. Cheap to clone.
#[derive(Debug, Clone)]
pub struct UnixClient {
    socket: PathBuf,
    client: Client<UnixConnector, Full<Bytes>>,
    timeout: Option<Duration>,
}

impl UnixClient {
    /// A client for the socket at `socket`, with [`DEFAULT_TIMEOUT`].
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        let client = Client::builder(TokioExecutor::new())
            .pool_max_idle_per_host(256)
            .build(UnixConnector);
        UnixClient {
            socket: socket.into(),
            client,
            timeout: Some(DEFAULT_TIMEOUT),
        }
    }

    /// Bounds every exchange by `timeout` (`None`: unbounded).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.timeout = timeout;
        self
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// One exchange: `method path` with `headers` and `body`, read to the end. `host` is
    /// `localhost` unless given.
    ///
    /// # Errors
    /// A bad method or header, a transport failure, or the timeout.
    pub async fn raw(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: impl Into<Bytes>,
    ) -> Result<RawResponse, ClientError> {
        self.raw_within(self.timeout, method, path, headers, body.into())
            .await
    }

    async fn raw_within(
        &self,
        timeout: Option<Duration>,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<RawResponse, ClientError> {
        let method = Method::from_bytes(method.as_bytes())
            .map_err(|e| ClientError::Request(format!("method {method:?}: {e}")))?;
        let uri: hyper::Uri = hyperlocal::Uri::new(&self.socket, path).into();
        let mut builder = hyper::Request::builder().method(method).uri(uri);
        if !headers.iter().any(|(n, _)| n.eq_ignore_ascii_case("host")) {
            builder = builder.header("host", "localhost");
        }
        for (name, value) in headers {
            builder = builder.header(*name, *value);
        }
        let request = builder
            .body(Full::new(body))
            .map_err(|e| ClientError::Request(e.to_string()))?;
        let exchange = async {
            let fail = |what: &str, e: &dyn std::fmt::Display| ClientError::Transport {
                socket: self.socket.clone(),
                message: format!("{what}: {e}"),
            };
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| fail("sending", &error_chain(&e)))?;
            let status = response.status().as_u16();
            let map = header_map(response.headers());
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| fail("reading the body", &error_chain(&e)))?
                .to_bytes();
            Ok(RawResponse {
                status,
                headers: map,
                body,
            })
        };
        match timeout {
            None => exchange.await,
            Some(t) => {
                tokio::time::timeout(t, exchange)
                    .await
                    .map_err(|_| ClientError::Timeout {
                        socket: self.socket.clone(),
                        timeout: t,
                    })?
            }
        }
    }

    /// A JSON request (`content-type: application/json`; no body when `body` is `None`)
    /// whose answer is `T`.
    ///
    /// # Errors
    /// As [`UnixClient::raw`] and [`RawResponse::json`].
    pub async fn call<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        self.call_within(self.timeout, method, path, body).await
    }

    async fn call_within<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        timeout: Option<Duration>,
        method: &str,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        let bytes = match body {
            Some(b) => serde_json::to_vec(b).map_err(|e| ClientError::Request(e.to_string()))?,
            None => Vec::new(),
        };
        self.raw_within(
            timeout,
            method,
            path,
            &[("content-type", "application/json")],
            bytes.into(),
        )
        .await?
        .json()
    }
}

/// An error with its whole source chain (`a: b: c`): HTTP client errors keep the useful part
/// in their sources (hyper's say "client error (Connect)" and keep "connection refused" in
/// `source()`).
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        out.push_str(": ");
        out.push_str(&s.to_string());
        cur = s.source();
    }
    out
}

/// The `body` of a call that sends none.
const NO_BODY: Option<&()> = None;

/// The launcher's routes (`run/launcher.sock`). Every route fails with the launcher's refusal
/// ([`ClientError::Api`]) or a transport failure; those that wait also with the wait timeout.
#[derive(Debug, Clone)]
pub struct LauncherClient {
    http: UnixClient,
    wait_timeout: Option<Duration>,
}

impl LauncherClient {
    /// A client for the launcher at `socket`; routes that wait are unbounded.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self::over(UnixClient::new(socket))
    }

    /// The launcher's routes over `http` (whose timeout bounds the ordinary routes).
    pub fn over(http: UnixClient) -> Self {
        LauncherClient {
            http,
            wait_timeout: None,
        }
    }

    /// Bounds the routes that wait (`?wait=1`, starting a backend) by `timeout`.
    #[must_use]
    pub fn with_wait_timeout(mut self, timeout: Option<Duration>) -> Self {
        self.wait_timeout = timeout;
        self
    }

    /// The underlying client, for raw exchanges.
    pub fn http(&self) -> &UnixClient {
        &self.http
    }

    /// A route that waits by design, bounded by the wait timeout instead of the client's.
    async fn waiting<B: Serialize + ?Sized, T: DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Option<&B>,
    ) -> Result<T, ClientError> {
        self.http
            .call_within(self.wait_timeout, method, path, body)
            .await
    }

    /// `POST /agents`.
    pub async fn start_agent(&self, req: &AgentRequest) -> Result<AgentStatus, ClientError> {
        self.http.call("POST", "/agents", Some(req)).await
    }

    /// `GET /agents/{tid}`.
    pub async fn agent(&self, tid: &Tid) -> Result<AgentStatus, ClientError> {
        self.http
            .call("GET", &format!("/agents/{tid}"), NO_BODY)
            .await
    }

    /// `GET /agents/{tid}?wait=1` (waits): the status once the run has ended.
    pub async fn wait_agent(&self, tid: &Tid) -> Result<AgentStatus, ClientError> {
        self.waiting("GET", &format!("/agents/{tid}?wait=1"), NO_BODY)
            .await
    }

    /// `DELETE /agents/{tid}` (waits): stops the run if it is active and forgets it.
    pub async fn delete_agent(&self, tid: &Tid) -> Result<AgentStatus, ClientError> {
        self.waiting("DELETE", &format!("/agents/{tid}"), NO_BODY)
            .await
    }

    /// `POST /checks` (waits: runs to completion within the request).
    pub async fn run_check(&self, req: &CheckRequest) -> Result<CheckResult, ClientError> {
        self.waiting("POST", "/checks", Some(req)).await
    }

    /// `POST /repo/snapshot`.
    pub async fn snapshot(&self, req: &SnapshotRequest) -> Result<SnapshotResult, ClientError> {
        self.http.call("POST", "/repo/snapshot", Some(req)).await
    }

    /// `POST /repo/deliver`.
    pub async fn deliver(&self, req: &DeliverRequest) -> Result<DeliverResult, ClientError> {
        self.http.call("POST", "/repo/deliver", Some(req)).await
    }

    /// `POST /repo/delete-branch`.
    pub async fn delete_branch(
        &self,
        req: &DeleteBranchRequest,
    ) -> Result<DeleteBranchResult, ClientError> {
        self.http
            .call("POST", "/repo/delete-branch", Some(req))
            .await
    }

    /// `POST /backends/{model}/start` (waits), answered once the backend is healthy.
    pub async fn start_backend(&self, model: &ModelId) -> Result<BackendStartResult, ClientError> {
        self.waiting("POST", &format!("/backends/{model}/start"), NO_BODY)
            .await
    }

    /// `POST /backends/vllm/stop` (waits).
    pub async fn stop_backends(&self) -> Result<BackendStopResult, ClientError> {
        self.waiting("POST", "/backends/vllm/stop", NO_BODY).await
    }

    /// `GET /status`.
    pub async fn status(&self) -> Result<LauncherStatus, ClientError> {
        self.http.call("GET", "/status", NO_BODY).await
    }

    /// `POST /slots` (waits: answered once the sandbox runs).
    pub async fn start_slot(&self, req: &SlotRequest) -> Result<SlotStatus, ClientError> {
        self.waiting("POST", "/slots", Some(req)).await
    }

    /// `GET /slots/{tid}`.
    pub async fn slot(&self, tid: &Tid) -> Result<SlotStatus, ClientError> {
        self.http
            .call("GET", &format!("/slots/{tid}"), NO_BODY)
            .await
    }

    /// `DELETE /slots/{tid}` (waits): stops the slot and removes its directories.
    pub async fn delete_slot(&self, tid: &Tid) -> Result<SlotStatus, ClientError> {
        self.waiting("DELETE", &format!("/slots/{tid}"), NO_BODY)
            .await
    }

    /// `POST /slots/{tid}/exec` (waits: runs to completion within the request).
    pub async fn slot_exec(
        &self,
        tid: &Tid,
        req: &SlotExecRequest,
    ) -> Result<SlotExecResult, ClientError> {
        self.waiting("POST", &format!("/slots/{tid}/exec"), Some(req))
            .await
    }

    /// `POST /slots/{tid}/files/read`.
    pub async fn slot_read(
        &self,
        tid: &Tid,
        req: &SlotReadRequest,
    ) -> Result<SlotFile, ClientError> {
        self.http
            .call("POST", &format!("/slots/{tid}/files/read"), Some(req))
            .await
    }

    /// `POST /slots/{tid}/files/write`.
    pub async fn slot_write(
        &self,
        tid: &Tid,
        req: &SlotWriteRequest,
    ) -> Result<SlotWriteResult, ClientError> {
        self.http
            .call("POST", &format!("/slots/{tid}/files/write"), Some(req))
            .await
    }
}

/// The gateway's control routes (`run/gateway.sock`). Every route fails with the gateway's
/// refusal ([`ClientError::Api`]), a transport failure or the client's timeout.
#[derive(Debug, Clone)]
pub struct GatewayClient {
    http: UnixClient,
}

impl GatewayClient {
    /// A client for the gateway's control socket at `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self::over(UnixClient::new(socket))
    }

    /// The gateway's routes over `http`.
    pub fn over(http: UnixClient) -> Self {
        GatewayClient { http }
    }

    /// The underlying client, for raw exchanges.
    pub fn http(&self) -> &UnixClient {
        &self.http
    }

    /// `POST /tasks`.
    pub async fn open_task(&self, req: &OpenTask) -> Result<TaskView, ClientError> {
        self.http.call("POST", "/tasks", Some(req)).await
    }

    /// `GET /tasks/{tid}`.
    pub async fn task(&self, tid: &Tid) -> Result<TaskView, ClientError> {
        self.http
            .call("GET", &format!("/tasks/{tid}"), NO_BODY)
            .await
    }

    /// `DELETE /tasks/{tid}`.
    pub async fn close_task(&self, tid: &Tid) -> Result<TaskView, ClientError> {
        self.http
            .call("DELETE", &format!("/tasks/{tid}"), NO_BODY)
            .await
    }

    /// `GET /status`.
    pub async fn status(&self) -> Result<GatewayStatus, ClientError> {
        self.http.call("GET", "/status", NO_BODY).await
    }
}

/// `agentbox-pool`'s routes (`run/pool.sock`). Every route fails with the pool's refusal
/// ([`ClientError::Api`]), a transport failure or the client's timeout.
#[derive(Debug, Clone)]
pub struct PoolClient {
    http: UnixClient,
}

impl PoolClient {
    /// A client for the pool's socket at `socket`.
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        Self::over(UnixClient::new(socket))
    }

    /// The pool's routes over `http`.
    pub fn over(http: UnixClient) -> Self {
        PoolClient { http }
    }

    /// The underlying client, for raw exchanges.
    pub fn http(&self) -> &UnixClient {
        &self.http
    }

    /// `POST /acquire`.
    pub async fn acquire(&self, req: &AcquireRequest) -> Result<Lease, ClientError> {
        self.http.call("POST", "/acquire", Some(req)).await
    }

    /// `POST /release`.
    pub async fn release(&self, req: &LeaseRef) -> Result<ReleaseReply, ClientError> {
        self.http.call("POST", "/release", Some(req)).await
    }

    /// `POST /run_command`.
    pub async fn run_command(&self, req: &RunCommandRequest) -> Result<CommandReply, ClientError> {
        self.http.call("POST", "/run_command", Some(req)).await
    }

    /// `POST /read_file`.
    pub async fn read_file(&self, req: &ReadFileRequest) -> Result<FileReply, ClientError> {
        self.http.call("POST", "/read_file", Some(req)).await
    }

    /// `POST /write_file`.
    pub async fn write_file(&self, req: &WriteFileRequest) -> Result<WriteReply, ClientError> {
        self.http.call("POST", "/write_file", Some(req)).await
    }

    /// `POST /drain`: no new leases on this host.
    pub async fn drain(&self) -> Result<PoolStatus, ClientError> {
        self.http.call("POST", "/drain", NO_BODY).await
    }

    /// `POST /undrain`.
    pub async fn undrain(&self) -> Result<PoolStatus, ClientError> {
        self.http.call("POST", "/undrain", NO_BODY).await
    }

    /// `GET /status`.
    pub async fn status(&self) -> Result<PoolStatus, ClientError> {
        self.http.call("GET", "/status", NO_BODY).await
    }
}
