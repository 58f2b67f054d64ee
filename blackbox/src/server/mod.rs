//! The server core: one binding at a time (the registration's agent, its proxy and its one
//! session), turns admitted under the session's lock and run in tracked tasks outside it, the
//! health monitor, pause/resume, and graceful shutdown.
//!
//! Locks: `core` (synchronous, short) holds the server state, the binding and the sessions;
//! each session has its own data lock (synchronous, short) and its admission gate (async);
//! `init_lock` (async) serializes registrations. No synchronous guard lives across an
//! `await`.
//!
//! Every task the server spawns (turns, commands, the monitor) is on `tasks`, and shutdown
//! cancels and waits for them before it stops the agent.

mod clock;
mod register;
mod turns;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::backend::{Backend, IMPLEMENTED_BACKENDS, KNOWN_BACKENDS};
use crate::config::{Bins, RouterSettings, ServerConfig, secs};
use crate::error::{ApiError, obj};
use crate::model::{
    BackendCapabilities, BindingInfo, Object, PauseRequest, PauseResponse, ResumeRequest,
    ResumeResponse, ServerState, SessionState, StatusResponse,
};
use crate::proxy::LlmProxy;
use crate::session::{Session, SessionStore};

pub use clock::PauseClock;
pub use turns::Submission;

/// What one registration owns.
#[derive(Debug)]
struct Bound {
    info: BindingInfo,
    config: ServerConfig,
    capabilities: BackendCapabilities,
    backend: Arc<dyn Backend>,
    proxy: LlmProxy,
    /// Stops this binding's health monitor.
    monitor: CancellationToken,
}

#[derive(Debug)]
struct Core {
    state: ServerState,
    fingerprint: Option<String>,
    bound: Option<Arc<Bound>>,
    /// The effective settings (the base ones when nothing is bound).
    effective: ServerConfig,
    sessions: SessionStore,
}

#[derive(Debug)]
struct Inner {
    base: ServerConfig,
    bins: Bins,
    /// `BBS_ROUTER_URL` and `BBS_ROUTER_TOKEN`.
    router: RouterSettings,
    core: Mutex<Core>,
    init_lock: tokio::sync::Mutex<()>,
    pause: PauseClock,
    tasks: TaskTracker,
    /// Cancelled when shutdown starts: wakes long polls and stops monitors.
    shutdown: CancellationToken,
    shutdown_started: AtomicBool,
    /// Requests being served.
    requests: watch::Sender<usize>,
}

/// The blackbox server. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Server {
    inner: Arc<Inner>,
}

/// Counts a request as in flight until dropped.
#[derive(Debug)]
pub struct RequestGuard {
    requests: watch::Sender<usize>,
}

impl Drop for RequestGuard {
    fn drop(&mut self) {
        self.requests.send_modify(|n| *n = n.saturating_sub(1));
    }
}

impl Server {
    /// A server with nothing registered.
    #[must_use]
    pub fn new(base: ServerConfig, bins: Bins) -> Server {
        Self::with_router(base, bins, RouterSettings::default())
    }

    /// A server whose registrations reach their router as `router` says (`BBS_ROUTER_URL`
    /// replaces the registration's router for the calls; the registration, its answer and its
    /// fingerprint keep what the paddock sent).
    #[must_use]
    pub fn with_router(base: ServerConfig, bins: Bins, router: RouterSettings) -> Server {
        Server {
            inner: Arc::new(Inner {
                core: Mutex::new(Core {
                    state: ServerState::Idle,
                    fingerprint: None,
                    bound: None,
                    effective: base.clone(),
                    sessions: SessionStore::default(),
                }),
                base,
                bins,
                router,
                init_lock: tokio::sync::Mutex::new(()),
                pause: PauseClock::default(),
                tasks: TaskTracker::new(),
                shutdown: CancellationToken::new(),
                shutdown_started: AtomicBool::new(false),
                requests: watch::channel(0).0,
            }),
        }
    }

    fn core(&self) -> MutexGuard<'_, Core> {
        self.inner
            .core
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// The server state.
    #[must_use]
    pub fn state(&self) -> ServerState {
        self.core().state
    }

    /// Marks a request in flight (shutdown waits for them).
    #[must_use]
    pub fn request_started(&self) -> RequestGuard {
        self.inner.requests.send_modify(|n| *n += 1);
        RequestGuard {
            requests: self.inner.requests.clone(),
        }
    }

    /// The binding, if the server is ready for turns.
    fn ready(&self) -> Result<Arc<Bound>, ApiError> {
        let core = self.core();
        match (&core.bound, core.state) {
            (Some(b), ServerState::Ready) => Ok(Arc::clone(b)),
            (_, state) => Err(ApiError::Unavailable {
                message: format!("Server is not ready. current_state={}", state.enum_name()),
                details: obj(json!({"state": state})),
            }),
        }
    }

    /// The bound session's id when something is bound; 409 when `session_id` is another one.
    fn check_bound_session(&self, session_id: &str) -> Result<Option<String>, ApiError> {
        let core = self.core();
        let Some(b) = &core.bound else {
            return Ok(None);
        };
        let expected = &b.info.bound_session_id;
        if expected != session_id {
            return Err(ApiError::BoundSessionMismatch {
                expected: expected.clone(),
                actual: session_id.to_owned(),
            });
        }
        Ok(Some(expected.clone()))
    }

    fn session(&self, id: &str) -> Option<Arc<Session>> {
        self.core().sessions.get(id)
    }

    fn instance_id(&self) -> Option<String> {
        self.core()
            .bound
            .as_ref()
            .map(|b| b.info.bound_instance_id.clone())
    }

    /// `GET /v1/status`.
    #[must_use]
    pub fn status(&self) -> StatusResponse {
        let core = self.core();
        StatusResponse {
            request_id: String::new(),
            status: core.state,
            binding: core.bound.as_ref().map(|b| b.info.clone()),
            sessions: core.sessions.stats(core.effective.max_sessions),
            capabilities: core.bound.as_ref().map(|b| b.capabilities),
            config: core.effective.clone(),
            implemented_backends: IMPLEMENTED_BACKENDS.to_vec(),
            known_backends: KNOWN_BACKENDS.to_vec(),
        }
    }

    /// Health with the configured retries: true at the first healthy answer.
    async fn healthy_with_retry(&self, bound: &Bound, reason: &str) -> bool {
        let attempts = bound.config.runtime_health_check_retries.max(1);
        let delay = secs(bound.config.runtime_health_check_retry_delay);
        for attempt in 1..=attempts {
            if bound.backend.health().await {
                return true;
            }
            if attempt < attempts {
                tracing::warn!(
                    reason,
                    attempt,
                    attempts,
                    "backend health check failed; retrying"
                );
                tokio::time::sleep(delay).await;
            }
        }
        false
    }

    /// The agent is gone: the server is in error and every open session desynced.
    fn mark_backend_error(&self, reason: &str) {
        let mut core = self.core();
        match core.state {
            ServerState::Error | ServerState::ShuttingDown => return,
            ServerState::Idle | ServerState::Initializing | ServerState::Ready => {}
        }
        tracing::error!(reason, "marking backend error");
        core.state = ServerState::Error;
        for s in core.sessions.all() {
            s.lock().set_state(SessionState::Desynced);
        }
    }

    /// Polls the agent's health every interval; a failure (after retries) marks the backend
    /// error and ends the monitor.
    fn start_monitor(&self, bound: &Arc<Bound>) {
        let server = self.clone();
        let bound = Arc::clone(bound);
        self.inner.tasks.spawn(async move {
            let interval = secs(bound.config.runtime_health_check_interval);
            loop {
                tokio::select! {
                    () = bound.monitor.cancelled() => return,
                    () = tokio::time::sleep(interval) => {}
                }
                let healthy = tokio::select! {
                    () = bound.monitor.cancelled() => return,
                    h = server.healthy_with_retry(&bound, "runtime_monitor") => h,
                };
                if !healthy {
                    server.mark_backend_error("runtime_monitor_failed");
                    return;
                }
            }
        });
    }

    /// `POST /v1/rollout/pause`: holds new model calls (the proxy) and the turn clock.
    ///
    /// # Errors
    /// 503 when not ready or not quiesced in time; 502 when the proxy or router refuse.
    pub async fn pause(&self, req: &PauseRequest) -> Result<PauseResponse, ApiError> {
        let bound = self.ready()?;
        let already = self.inner.pause.pause(&req.reason);
        let timeout = req.timeout_seconds.map(secs);
        let mut result = bound
            .proxy
            .pause(&req.reason, timeout)
            .await
            .map_err(|e| backend_failure("Rollout pause failed", &e.to_string()))?;
        bound
            .backend
            .pause(&req.reason)
            .await
            .map_err(|e| backend_failure("Rollout pause failed", &e.to_string()))?;
        let quiesced = result
            .get("quiesced")
            .and_then(Value::as_bool)
            .unwrap_or(true);
        if !quiesced {
            return Err(ApiError::PauseTimeout { details: result });
        }
        let status = text_of(&result, "status")
            .unwrap_or_else(|| if already { "already_paused" } else { "paused" }.to_owned());
        let version = text_of(&result, "version").or(self.inner.pause.snapshot().version);
        let count = |k: &str| result.get(k).and_then(Value::as_u64).unwrap_or(0);
        let response = PauseResponse {
            request_id: String::new(),
            status,
            reason: req.reason.clone(),
            quiesced,
            version,
            http_inflight_requests: count("http_inflight_requests"),
            active_sglang_generations: count("active_sglang_generations"),
            suspended_generations: count("suspended_generations"),
            details: std::mem::take(&mut result),
        };
        Ok(response)
    }

    /// `POST /v1/rollout/resume`.
    ///
    /// # Errors
    /// 503 when not ready; 502 when the proxy or router refuse.
    pub async fn resume(&self, req: &ResumeRequest) -> Result<ResumeResponse, ApiError> {
        let bound = self.ready()?;
        let result = bound
            .proxy
            .resume(req.version.as_deref(), &req.reason)
            .await
            .map_err(|e| backend_failure("Rollout resume failed", &e.to_string()))?;
        bound
            .backend
            .resume(&req.reason)
            .await
            .map_err(|e| backend_failure("Rollout resume failed", &e.to_string()))?;
        let was_paused = self.inner.pause.resume(req.version.as_deref());
        Ok(ResumeResponse {
            request_id: String::new(),
            status: text_of(&result, "status").unwrap_or_else(|| {
                if was_paused {
                    "resumed"
                } else {
                    "already_running"
                }
                .to_owned()
            }),
            reason: req.reason.clone(),
            version: text_of(&result, "version").or(self.inner.pause.snapshot().version),
            details: result,
        })
    }

    /// `GET /v1/rollout/pause_state`.
    #[must_use]
    pub fn pause_state(&self) -> Value {
        let s = self.inner.pause.snapshot();
        let adapter = self
            .core()
            .bound
            .as_ref()
            .and_then(|b| serde_json::to_value(b.proxy.pause_state()).ok())
            .unwrap_or_else(|| json!({}));
        json!({"paused": s.paused, "pause_reason": s.reason, "version": s.version,
               "adapter": adapter})
    }

    /// Graceful shutdown: no new work, commands killed, turns cancelled (recorded as unknown),
    /// in-flight requests given until `shutdown_timeout`, then the agent and the proxy stopped
    /// and the runtime directory removed. Idempotent.
    pub async fn shutdown(&self) {
        if self.inner.shutdown_started.swap(true, Ordering::SeqCst) {
            return;
        }
        let (timeout, sessions, bound) = {
            let mut core = self.core();
            core.state = ServerState::ShuttingDown;
            (
                secs(core.effective.shutdown_timeout),
                core.sessions.all(),
                core.bound.clone(),
            )
        };
        let deadline = Instant::now() + timeout;
        tracing::info!(?timeout, "shutting down");
        for s in &sessions {
            crate::exec::kill_published(&s.cmd);
            let d = s.lock();
            for t in d.turns.iter().filter(|t| t.record.status.is_active()) {
                t.cancel.cancel();
            }
        }
        self.inner.shutdown.cancel();
        if let Some(b) = &bound {
            b.monitor.cancel();
        }
        // Leave the agent's stop a few seconds of the budget.
        let reserve = Duration::from_secs(5).min(timeout / 2);
        let work_deadline = deadline.checked_sub(reserve).unwrap_or(deadline);
        self.inner.tasks.close();
        if tokio::time::timeout_at(work_deadline.into(), self.inner.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("shutdown: turns still running at the deadline");
        }
        let mut requests = self.inner.requests.subscribe();
        if tokio::time::timeout_at(work_deadline.into(), requests.wait_for(|n| *n == 0))
            .await
            .is_err()
        {
            tracing::warn!("shutdown: requests still in flight at the deadline");
        }
        if let Some(b) = bound {
            let left = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_secs(1));
            stop_binding(&b, left).await;
        }
        tracing::info!("shut down");
    }
}

/// Stops a binding's agent and proxy and removes its runtime directory.
async fn stop_binding(bound: &Bound, grace: Duration) {
    bound.monitor.cancel();
    bound.backend.shutdown(grace).await;
    // The processes that left the agent's tree (adopted by this server) go with it.
    agentbox_sandbox::reaper::kill_adopted(crate::ORPHAN_KILL_WAIT).await;
    bound.proxy.clone().shutdown().await;
    remove_runtime_dir(&bound.info.runtime_dir).await;
}

async fn remove_runtime_dir(dir: &str) {
    if let Err(e) = tokio::fs::remove_dir_all(dir).await
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(dir, error = %e, "cannot remove the runtime directory");
    }
}

fn backend_failure(what: &str, why: &str) -> ApiError {
    ApiError::Backend {
        message: format!("{what}: {why}"),
        details: Object::new(),
    }
}

fn text_of(map: &Object, key: &str) -> Option<String> {
    map.get(key)
        .filter(|v| !v.is_null())
        .map(|v| v.as_str().map_or_else(|| v.to_string(), str::to_owned))
}
