//! The in-process rollout LLM proxy: one per server, on a loopback port the core binds, between
//! the agent CLI and the rollout manager's router. The agent is pointed at [`LlmProxy::base_url`]
//! and never talks to the router itself.
//!
//! What it does to every model call (`POST …/chat/completions`, `…/messages`, `…/responses`):
//! - tags it for the router: the sticky routing header (name configured, value the bound
//!   session id), `X-Session-Id`, `X-Instance-Id`, `X-Turn-Id` (inside a turn),
//!   `X-Dressage-Sandbox-Id` (when bound), `X-Dressage-Expected-Version` (after a resume with a
//!   version) and `X-Dressage-Partial-Rollout: 1`; client copies of these are dropped;
//! - sends it upstream as an OpenAI chat completion to `{upstream_origin}{router_api_path}
//!   /chat/completions`: chat as is, Anthropic Messages and OpenAI Responses translated (with
//!   `agentbox-wire`), the answer translated back, streamed or not;
//! - applies the rollout's sampling policy: `model_override`, `default_temperature` when the
//!   request has none, `stream_options.include_usage` forced on streams (dropped otherwise);
//! - counts it in the open turn ([`TurnCounts`]: steps admitted, tokens and tool calls from the
//!   upstream's own usage) and refuses the call past `max_steps` (429 `max_steps_exceeded` in
//!   the client's protocol), recording the error for [`LlmProxy::wait_for_max_steps_error`];
//! - records the router's context-overflow (413), rollout-invalidated (502 `generation_preempted`
//!   and kin: the agent gets an empty answer instead) and other failures for the core to consume;
//! - holds it while the rollout is paused (weight update), until [`LlmProxy::resume`].
//!
//! Anything else (`GET /v1/models`, `POST /v1/messages/count_tokens`, ...) is forwarded as is to
//! `{upstream_origin}{path}`, untagged, as the reference does. `GET /__proxy_health` answers
//! `{"ok": true}`.
//!
//! The router may be a unix socket (`BBS_ROUTER_URL=unix:/path`, [`ProxyConfig::unix_socket`]):
//! the one upstream client then connects there for every call, with the same paths as over TCP
//! (`{router_api_path}/chat/completions`, the forwarded paths, and the control calls
//! `{router_api_path}/rollout/pause|resume`). In a rollout slot that socket is the gateway's
//! task socket, which serves only `/v1/chat/completions`: a pause or resume there gets the
//! gateway's 404, which the server reports as the router's failure (502 `Rollout pause
//! failed: router /rollout/pause failed with HTTP 404: ...`) while the proxy's own pause still
//! holds the calls; a
//! rollout manager that pauses generations talks to its router directly. With
//! `BBS_ROUTER_TOKEN` ([`ProxyConfig::router_token`]) every router call carries `Authorization:
//! Bearer <token>` (a sensitive header value, never logged) and the client's `Authorization`
//! and `x-api-key` are dropped.
//!
//! Modules: `state` (turn scope, pause, in-flight marks and waits), `headers`, `rewrite`
//! (request policy), `meter` (usage counts from chat answers), `upstream` (classifying and
//! answering upstream failures, the keepalive prelude), `routes` (the handler), `control` (a
//! loopback control API for running the proxy alone: tests, bench).

mod control;
mod headers;
mod meter;
pub mod rewrite;
mod routes;
mod state;
mod upstream;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentbox_llm::{ClientError, ClientOptions, Upstream};
use agentbox_policy::secret::Secret;
use axum::http::{HeaderName, HeaderValue};
use serde_json::{Map, Value, json};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub use control::{control_router, serve_standalone};
pub use state::PauseState;

use headers::Tags;
use state::{Recorded, Shared};

/// Whether JSON text `data` may hold a member named by one of `members` (each given with its
/// quotes, e.g. `"usage"`), named plainly or with `\u` escapes: the check that lets the proxy
/// skip parsing a chunk. Inside a JSON string a quote is always escaped, so a model's text
/// cannot hide a member from it; it can only cause a parse that finds nothing.
fn may_name(data: &[u8], members: &[&[u8]]) -> bool {
    members
        .iter()
        .chain(std::iter::once(&b"\\u".as_slice()))
        .any(|m| memchr::memmem::find(data, m).is_some())
}

/// The sticky routing header's default name (`backend_options.proxy.sticky_header_name`).
pub const DEFAULT_STICKY_HEADER: &str = "X-SMG-Routing-Key";
/// The default `max_steps` per turn (the reference's `DEFAULT_PROXY_MAX_STEPS`).
pub const DEFAULT_MAX_STEPS: u32 = 100;
/// The default router API path.
pub const DEFAULT_ROUTER_API_PATH: &str = "/v1";
/// The largest request body the proxy reads (the Anthropic API's own limit).
pub const MAX_REQUEST_BODY: u64 = 32 << 20;

/// How the proxy is set up; see the module doc for what each field does.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// The router's origin, e.g. `http://127.0.0.1:8000` (a trailing `/` is ignored).
    pub upstream_origin: String,
    /// The router's API path (register's `router_api_path`), default `/v1`.
    pub router_api_path: String,
    pub bound_session_id: String,
    pub bound_instance_id: String,
    pub bound_sandbox_id: Option<String>,
    /// `backend_options.proxy.sticky_header_name`, default [`DEFAULT_STICKY_HEADER`].
    pub sticky_header_name: String,
    /// Model calls per turn; `None` or 0 disables the limit. Default [`DEFAULT_MAX_STEPS`].
    pub max_steps: Option<u32>,
    /// Set on requests that carry no `temperature`.
    pub default_temperature: Option<f64>,
    /// `BBS_ROUTER_TIMEOUT`: the longest silence from the router while it answers a call.
    pub router_timeout: Duration,
    /// Sent on every upstream request (router credentials), over the client's copies.
    pub upstream_headers: Vec<(String, String)>,
    /// Replaces the `model` of every model call.
    pub model_override: Option<String>,
    /// Reach the router over this unix socket (`BBS_ROUTER_URL=unix:...`): every router call,
    /// control calls included, goes there; `upstream_origin`'s host is then a placeholder.
    pub unix_socket: Option<PathBuf>,
    /// `BBS_ROUTER_TOKEN`: `Authorization: Bearer` on every router call, replacing the client's
    /// `Authorization` and `x-api-key`; never logged.
    pub router_token: Option<Secret>,
}

impl ProxyConfig {
    /// A config with the reference's defaults for everything but the router and the ids.
    pub fn new(
        upstream_origin: impl Into<String>,
        bound_session_id: impl Into<String>,
        bound_instance_id: impl Into<String>,
    ) -> Self {
        ProxyConfig {
            upstream_origin: upstream_origin.into(),
            router_api_path: DEFAULT_ROUTER_API_PATH.to_owned(),
            bound_session_id: bound_session_id.into(),
            bound_instance_id: bound_instance_id.into(),
            bound_sandbox_id: None,
            sticky_header_name: DEFAULT_STICKY_HEADER.to_owned(),
            max_steps: Some(DEFAULT_MAX_STEPS),
            default_temperature: None,
            router_timeout: Duration::from_millis(600_000),
            upstream_headers: Vec::new(),
            model_override: None,
            unix_socket: None,
            router_token: None,
        }
    }
}

/// Model usage of one turn, from the upstream's own chat usage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct TurnCounts {
    /// Model calls admitted in the turn (refused ones are not steps).
    pub steps: u64,
    /// `prompt_tokens` summed over the turn's answers.
    pub input_tokens: u64,
    /// `completion_tokens` summed.
    pub output_tokens: u64,
    /// `completion_tokens_details.reasoning_tokens` summed.
    pub reasoning_tokens: u64,
    /// `total_tokens` summed (input + output when an answer reports none).
    pub total_tokens: u64,
    /// Tool calls in the answers.
    pub tool_calls: u64,
}

/// Why a proxy operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    /// A config field is unusable.
    #[error("invalid proxy config: {0}")]
    Config(String),
    /// The upstream client could not be built.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The listener's address could not be read.
    #[error("cannot read the proxy listener's address: {0}")]
    Listener(std::io::Error),
    /// `open_turn` while another turn is open.
    #[error("turn scope is already active for {0}")]
    TurnActive(String),
    /// A router control call (pause, resume) failed.
    #[error("router {endpoint} failed{}: {detail}", status.map(|s| format!(" with HTTP {s}")).unwrap_or_default())]
    Control {
        /// `/rollout/pause` or `/rollout/resume`.
        endpoint: &'static str,
        /// The router's status, when it answered.
        status: Option<u16>,
        /// What went wrong (the router's body, previewed, or the transport error).
        detail: String,
    },
}

/// The validated config, as the handler uses it.
#[derive(Debug)]
pub(crate) struct Settings {
    origin: String,
    api_path: String,
    chat_url: String,
    /// `chat_url` parsed once (reqwest would parse the string on every call).
    chat_target: reqwest::Url,
    tags: Tags,
    policy: rewrite::Policy,
    router_timeout: Duration,
    session_id: String,
    instance_id: String,
}

impl Settings {
    fn from_config(cfg: &ProxyConfig) -> Result<Self, ProxyError> {
        let origin = cfg.upstream_origin.trim_end_matches('/').to_owned();
        if !(origin.starts_with("http://") || origin.starts_with("https://"))
            || origin.len() <= "https://".len()
        {
            return Err(ProxyError::Config(format!(
                "upstream_origin: expected http(s)://host[:port], got {:?}",
                cfg.upstream_origin
            )));
        }
        let trimmed = cfg.router_api_path.trim_end_matches('/');
        let api_path = if trimmed.is_empty() {
            "/".to_owned()
        } else if trimmed.starts_with('/') {
            trimmed.to_owned()
        } else {
            format!("/{trimmed}")
        };
        let chat_url = if api_path == "/" {
            format!("{origin}/chat/completions")
        } else {
            format!("{origin}{api_path}/chat/completions")
        };
        let chat_target = reqwest::Url::parse(&chat_url).map_err(|e| {
            ProxyError::Config(format!("upstream_origin: {chat_url:?} is not a URL: {e}"))
        })?;
        let header_value = |what: &str, v: &str| {
            HeaderValue::from_str(v)
                .map_err(|_| ProxyError::Config(format!("{what}: not a valid header value")))
        };
        let sticky_header =
            HeaderName::try_from(cfg.sticky_header_name.as_str()).map_err(|_| {
                ProxyError::Config(format!(
                    "sticky_header_name: {:?} is not a header name",
                    cfg.sticky_header_name
                ))
            })?;
        let mut static_headers = Vec::with_capacity(cfg.upstream_headers.len());
        for (k, v) in &cfg.upstream_headers {
            let name = HeaderName::try_from(k.as_str()).map_err(|_| {
                ProxyError::Config(format!("upstream_headers: {k:?} is not a header name"))
            })?;
            static_headers.push((name, header_value("upstream_headers", v)?));
        }
        let router_token = match &cfg.router_token {
            Some(t) => {
                let mut v =
                    HeaderValue::from_str(&format!("Bearer {}", t.expose())).map_err(|_| {
                        ProxyError::Config("router_token: not a valid header value".into())
                    })?;
                v.set_sensitive(true);
                Some(v)
            }
            None => None,
        };
        if let Some(t) = cfg.default_temperature
            && !t.is_finite()
        {
            return Err(ProxyError::Config(
                "default_temperature: not a finite number".into(),
            ));
        }
        Ok(Settings {
            origin,
            api_path,
            chat_url,
            chat_target,
            tags: Tags {
                sticky_header,
                session_id: header_value("bound_session_id", &cfg.bound_session_id)?,
                instance_id: header_value("bound_instance_id", &cfg.bound_instance_id)?,
                sandbox_id: cfg
                    .bound_sandbox_id
                    .as_deref()
                    .map(|s| header_value("bound_sandbox_id", s))
                    .transpose()?,
                static_headers,
                router_token,
            },
            policy: rewrite::Policy {
                model_override: cfg.model_override.clone(),
                default_temperature: cfg.default_temperature,
            },
            router_timeout: cfg.router_timeout,
            session_id: cfg.bound_session_id.clone(),
            instance_id: cfg.bound_instance_id.clone(),
        })
    }

    fn control_url(&self, endpoint: &str) -> String {
        if self.api_path == "/" {
            format!("{}{endpoint}", self.origin)
        } else {
            format!("{}{}{endpoint}", self.origin, self.api_path)
        }
    }
}

/// What the handler shares: settings, the upstream client and the state.
#[derive(Debug)]
pub(crate) struct Core {
    settings: Settings,
    upstream: Upstream,
    shared: Arc<Shared>,
}

/// Owns the serving task; dropping the last [`LlmProxy`] clone stops it.
#[derive(Debug)]
struct Handle {
    core: Arc<Core>,
    addr: SocketAddr,
    stop: CancellationToken,
    task: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.core.shared.close();
        self.stop.cancel();
    }
}

/// The running proxy. Cheap to clone; see the module doc.
#[derive(Debug, Clone)]
pub struct LlmProxy {
    handle: Arc<Handle>,
}

impl LlmProxy {
    /// Serves on `listener` (the core binds 127.0.0.1:0) until [`LlmProxy::shutdown`] or the
    /// last clone is dropped.
    pub async fn start(
        listener: tokio::net::TcpListener,
        cfg: ProxyConfig,
    ) -> Result<LlmProxy, ProxyError> {
        let settings = Settings::from_config(&cfg)?;
        let upstream = Upstream::new(&ClientOptions {
            read_timeout: cfg.router_timeout,
            unix_socket: cfg.unix_socket.clone(),
            ..ClientOptions::default()
        })?;
        let addr = listener.local_addr().map_err(ProxyError::Listener)?;
        let core = Arc::new(Core {
            settings,
            upstream,
            shared: Arc::new(Shared::new(cfg.max_steps, cfg.bound_session_id.clone())),
        });
        let stop = CancellationToken::new();
        let task = tokio::spawn(agentbox_http::serve_tcp(
            listener,
            routes::router(core.clone()),
            stop.clone(),
        ));
        match &cfg.unix_socket {
            Some(sock) => {
                tracing::info!(%addr, upstream = %core.settings.chat_url, socket = %sock.display(), "rollout proxy started (router over a unix socket)")
            }
            None => {
                tracing::info!(%addr, upstream = %core.settings.chat_url, "rollout proxy started")
            }
        }
        Ok(LlmProxy {
            handle: Arc::new(Handle {
                core,
                addr,
                stop,
                task: Mutex::new(Some(task)),
            }),
        })
    }

    fn core(&self) -> &Core {
        &self.handle.core
    }

    fn shared(&self) -> &Shared {
        &self.handle.core.shared
    }

    /// The address the proxy serves on.
    pub fn local_addr(&self) -> SocketAddr {
        self.handle.addr
    }

    /// `http://127.0.0.1:PORT` (backends append `/v1` etc.).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.handle.addr)
    }

    /// Opens the turn scope; an error if one is open.
    pub async fn open_turn(
        &self,
        turn_id: &str,
        backend_session_id: Option<&str>,
    ) -> Result<(), ProxyError> {
        self.shared()
            .open_turn(turn_id, backend_session_id)
            .map_err(ProxyError::TurnActive)
    }

    /// Sets the open turn's backend session id (no-op without a turn).
    pub async fn update_turn_backend_session(&self, backend_session_id: &str) {
        self.shared().update_backend_session(backend_session_id);
    }

    /// Waits for the open turn's in-flight model calls to finish, at most `timeout` of
    /// unpaused time.
    pub async fn drain_turn(&self, timeout: Option<Duration>) {
        if !self.try_drain_turn(timeout).await {
            tracing::warn!(
                inflight = self.shared().inflight(),
                "turn did not drain in time"
            );
        }
    }

    /// [`LlmProxy::drain_turn`], telling whether the turn drained (`false`: timed out).
    pub async fn try_drain_turn(&self, timeout: Option<Duration>) -> bool {
        self.shared().drain(timeout).await
    }

    /// Closes the turn scope and returns its counts (`None` if no turn was open).
    pub async fn clear_turn(&self) -> Option<TurnCounts> {
        self.shared().clear_turn()
    }

    /// The open turn's counts so far.
    pub fn turn_counts(&self) -> Option<TurnCounts> {
        self.shared().turn_counts()
    }

    /// Time spent paused since the proxy started, the current pause included (deadlines are
    /// extended by it).
    pub fn total_paused(&self) -> Duration {
        self.shared().lock().total_paused()
    }

    /// The pause state and in-flight counter.
    pub fn pause_state(&self) -> PauseState {
        self.shared().pause_state()
    }

    /// Pauses: new model calls are held until [`LlmProxy::resume`], and the router is asked to
    /// preempt this session's generations (`POST {router}/rollout/pause`, with `timeout` as
    /// its `timeout_seconds`). Returns the router's answer with `status`, `reason` and
    /// `http_inflight_requests` filled in. The proxy stays paused if the router call fails.
    pub async fn pause(
        &self,
        reason: &str,
        timeout: Option<Duration>,
    ) -> Result<Map<String, Value>, ProxyError> {
        let already = self.shared().begin_pause(reason);
        let s = &self.core().settings;
        let payload = json!({
            "session_id": s.session_id,
            "instance_id": s.instance_id,
            "reason": reason,
            "mode": "preempt",
            "timeout_seconds": timeout.map(|t| t.as_secs_f64()),
        });
        // The router may take the whole pause timeout to quiesce.
        let limit = timeout.map_or(s.router_timeout, |t| t + Duration::from_secs(30));
        let result = self.control_post("/rollout/pause", payload, limit).await?;
        let status = if already { "already_paused" } else { "paused" };
        Ok(self.filled(result, status, reason, None))
    }

    /// Resumes: tells the router (`POST {router}/rollout/resume`), then releases held calls;
    /// `version` becomes the expected weight version sent with later calls. Returns the
    /// router's answer with `status`, `reason`, `version` and `http_inflight_requests` filled
    /// in. The proxy stays paused if the router call fails.
    pub async fn resume(
        &self,
        version: Option<&str>,
        reason: &str,
    ) -> Result<Map<String, Value>, ProxyError> {
        let s = &self.core().settings;
        let payload = json!({
            "session_id": s.session_id,
            "instance_id": s.instance_id,
            "reason": reason,
            "version": version,
        });
        let result = self
            .control_post("/rollout/resume", payload, s.router_timeout)
            .await?;
        let (was_paused, current) = self.shared().end_pause(version);
        let status = if was_paused {
            "resumed"
        } else {
            "already_running"
        };
        Ok(self.filled(result, status, reason, Some(current)))
    }

    /// The router's answer to a control call with the reference's defaults: `status`,
    /// `reason` (and for resume `version`) where the router gave none, and the proxy's own
    /// `http_inflight_requests`.
    fn filled(
        &self,
        mut result: Map<String, Value>,
        status: &str,
        reason: &str,
        version: Option<Option<String>>,
    ) -> Map<String, Value> {
        result.entry("status").or_insert_with(|| json!(status));
        result.entry("reason").or_insert_with(|| json!(reason));
        if let Some(v) = version {
            result.entry("version").or_insert_with(|| json!(v));
        }
        result.insert(
            "http_inflight_requests".into(),
            json!(self.shared().inflight()),
        );
        result
    }

    /// Takes the open turn's context-overflow error (the router's 413 body), once.
    pub async fn consume_context_overflow_error(&self) -> Option<Value> {
        self.shared().take_recorded(Recorded::ContextOverflow)
    }

    /// Takes the open turn's rollout-invalidated error (the router's 502 detail), once.
    pub async fn consume_rollout_invalidated_error(&self) -> Option<Value> {
        self.shared().take_recorded(Recorded::RolloutInvalidated)
    }

    /// Takes the open turn's last failed-upstream error, once.
    pub async fn consume_failed_upstream_error(&self) -> Option<Value> {
        self.shared().take_recorded(Recorded::FailedUpstream)
    }

    /// Waits until the open turn hits `max_steps` (a copy of its error), the turn ends or
    /// `timeout` passes (`None` for both).
    pub async fn wait_for_max_steps_error(&self, timeout: Option<Duration>) -> Option<Value> {
        self.shared().wait_for_max_steps(timeout).await
    }

    /// Takes the open turn's max-steps error, once.
    pub async fn consume_max_steps_error(&self) -> Option<Value> {
        self.shared().take_recorded(Recorded::MaxSteps)
    }

    /// Stops serving: held calls are refused, in-flight ones get the serving loop's grace.
    pub async fn shutdown(self) {
        self.shared().close();
        self.handle.stop.cancel();
        let task = self
            .handle
            .task
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(task) = task
            && let Err(e) = task.await
        {
            tracing::warn!(error = %e, "proxy serving task failed");
        }
    }

    async fn control_post(
        &self,
        endpoint: &'static str,
        payload: Value,
        limit: Duration,
    ) -> Result<Map<String, Value>, ProxyError> {
        let core = self.core();
        let version = core.shared.lock().version.clone();
        let url = core.settings.control_url(endpoint);
        let fail = |status: Option<u16>, detail: String| ProxyError::Control {
            endpoint,
            status,
            detail,
        };
        let resp = core
            .upstream
            .client()
            .post(&url)
            .headers(headers::control_headers(
                &core.settings.tags,
                version.as_deref(),
            ))
            .body(payload.to_string())
            .timeout(limit)
            .send()
            .await
            .map_err(|e| fail(None, agentbox_http::error_chain(&e)))?;
        let status = resp.status();
        let body = agentbox_llm::client::read_capped(resp, agentbox_llm::client::MAX_ERROR_BODY)
            .await
            .map_err(|e| fail(Some(status.as_u16()), agentbox_http::error_chain(&e)))?;
        if !status.is_success() {
            return Err(fail(Some(status.as_u16()), upstream::preview(&body, 1000)));
        }
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(Map::new());
        }
        match serde_json::from_slice::<Value>(&body) {
            Ok(Value::Object(m)) => Ok(m),
            Ok(other) => Ok(Map::from_iter([("data".to_owned(), other)])),
            Err(e) => Err(fail(
                Some(status.as_u16()),
                format!("answer is not JSON: {e}"),
            )),
        }
    }
}
