//! Registration: validate, compare the registration's fingerprint with the current one (same
//! while ready = no-op; different = 409 while a session is open, else full teardown and
//! re-init), then start the proxy on an auto port, the agent pointed at it, wait for its
//! health, and create the bound session.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::{Bound, Server, remove_runtime_dir, stop_binding};
use crate::backend::{self, BackendError, InitContext};
use crate::config::RouterUrl;
use crate::error::{ApiError, obj};
use crate::hashing::{binding_fingerprint, normalize_router};
use crate::model::{
    BindingInfo, Message, ProxyOptions, RegisterRequest, RegisterResponse, Role,
    RuntimeSystemPrompt, ServerState, Timestamp, TraceEvent,
};
use crate::proxy::{LlmProxy, ProxyConfig};
use crate::session::Session;

/// How long stopping the previous agent may take during a rebind.
const TEARDOWN_GRACE: Duration = Duration::from_secs(10);

/// `system_prompt_file`: absolute, a readable regular file.
fn check_prompt_file(path: Option<&str>) -> Result<Option<String>, ApiError> {
    let Some(p) = path else { return Ok(None) };
    let path = Path::new(p);
    if !path.is_absolute() {
        return Err(ApiError::request(
            "system_prompt_file must be an absolute path.",
        ));
    }
    if !path.is_file() {
        return Err(ApiError::request("system_prompt_file does not exist."));
    }
    if std::fs::File::open(path).is_err() {
        return Err(ApiError::request("system_prompt_file is not readable."));
    }
    Ok(Some(p.to_owned()))
}

/// `backend_options.proxy`.
fn proxy_options(backend_options: &crate::model::Object) -> Result<ProxyOptions, ApiError> {
    let raw = match backend_options.get("proxy") {
        None | Some(serde_json::Value::Null) => serde_json::Value::Object(Default::default()),
        Some(v @ serde_json::Value::Object(_)) => v.clone(),
        Some(_) => {
            return Err(ApiError::request(
                "backend_options.proxy must be an object.",
            ));
        }
    };
    let options: ProxyOptions = serde_json::from_value(raw)
        .map_err(|e| ApiError::request(format!("Invalid proxy config: {e}")))?;
    if options.max_steps == Some(0) {
        return Err(ApiError::request(
            "Invalid proxy config: max_steps: Input should be greater than 0",
        ));
    }
    if options
        .default_temperature
        .is_some_and(|t| t < 0.0 || t.is_nan())
    {
        return Err(ApiError::request(
            "Invalid proxy config: default_temperature: Input should be greater than or equal to 0",
        ));
    }
    Ok(options)
}

/// `scheme://host[:port]` of the router.
fn upstream_origin(router_base_url: &str) -> Result<String, ApiError> {
    let url = url::Url::parse(router_base_url)
        .map_err(|_| ApiError::request(format!("Invalid router_base_url: {router_base_url}")))?;
    let host = url
        .host_str()
        .ok_or_else(|| ApiError::request(format!("Invalid router_base_url: {router_base_url}")))?;
    Ok(match url.port() {
        Some(p) => format!("{}://{host}:{p}", url.scheme()),
        None => format!("{}://{host}", url.scheme()),
    })
}

fn id_field(field: &str, value: &str) -> Result<(), ApiError> {
    if crate::ids::is_valid(value) {
        Ok(())
    } else {
        Err(ApiError::Request {
            message: format!("{field} has invalid format."),
            details: obj(json!({field: value})),
        })
    }
}

/// Where a backend reads the registration's system prompt.
fn prompt_target(blackbox_type: &str, runtime_dir: &Path) -> (PathBuf, &'static str) {
    match blackbox_type {
        "opencode" => (
            runtime_dir.join("home/.config/opencode/prompts/build.txt"),
            "build",
        ),
        "openclaw" => (
            runtime_dir.join("home/.openclaw/workspace/AGENTS.md"),
            "openclaw",
        ),
        _ => (runtime_dir.join("prompts/system.txt"), "system"),
    }
}

/// A register that failed after teardown: how the server is left.
enum InitFailure {
    /// The agent refused what it was given (400; the server is idle again).
    Request(String),
    /// Anything else (502; the server is in error).
    Failed(String),
}

impl Server {
    /// `POST /v1/rollout/register`.
    ///
    /// # Errors
    /// 400 for a bad registration, 409 for a rebind while a session is open or a registration
    /// in progress, 502 when the agent does not start, 503 while shutting down.
    pub async fn register(&self, req: RegisterRequest) -> Result<RegisterResponse, ApiError> {
        if self.state() == ServerState::ShuttingDown {
            return Err(ApiError::unavailable("Server is shutting down."));
        }
        let (router_base_url, router_api_path) =
            normalize_router(&req.router, &req.router_api_path).map_err(ApiError::request)?;
        let prompt_file = check_prompt_file(req.system_prompt_file.as_deref())?;
        let backend = backend::create(&req.blackbox_type, &req.backend_options)?;
        let capabilities = backend.capabilities();
        if prompt_file.is_some() && !capabilities.system_message {
            return Err(ApiError::Request {
                message: "Current backend does not support register-time system prompt injection."
                    .into(),
                details: obj(json!({"blackbox_type": req.blackbox_type})),
            });
        }
        let effective = req
            .server_config
            .as_ref()
            .map_or_else(|| self.inner.base.clone(), |o| o.apply(&self.inner.base));
        let proxy_opts = proxy_options(&req.backend_options)?;
        let session_id = req
            .bound_session_id
            .clone()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| ApiError::request("bound_session_id is required."))?;
        let instance_id = req
            .bound_instance_id
            .clone()
            .filter(|s| !s.is_empty())
            .ok_or_else(|| ApiError::request("bound_instance_id is required."))?;
        id_field("session_id", &session_id)?;
        id_field("instance_id", &instance_id)?;
        // `BBS_ROUTER_URL` decides where the calls go; the registration's router is still
        // validated, recorded and fingerprinted as sent.
        let registered_origin = upstream_origin(&router_base_url)?;
        let (origin, unix_socket, call_api_path) = match &self.inner.router.url {
            None => (registered_origin, None, router_api_path.clone()),
            Some(RouterUrl::Http { origin, api_path }) => (
                origin.clone(),
                None,
                api_path.clone().unwrap_or_else(|| router_api_path.clone()),
            ),
            // The host is a placeholder: every connection of that client goes to the socket.
            Some(RouterUrl::Unix(path)) => (
                "http://localhost".to_owned(),
                Some(path.clone()),
                router_api_path.clone(),
            ),
        };
        let fingerprint = binding_fingerprint(&req, &router_base_url, prompt_file.as_deref());

        let _init = self.inner.init_lock.lock().await;
        let previous = {
            let mut core = self.core();
            match core.state {
                ServerState::Initializing => {
                    return Err(ApiError::conflict("Server is initializing.", json!({})));
                }
                ServerState::ShuttingDown => {
                    return Err(ApiError::unavailable("Server is shutting down."));
                }
                ServerState::Idle | ServerState::Ready | ServerState::Error => {}
            }
            let same = core.fingerprint.as_deref() == Some(fingerprint.as_str());
            if same
                && core.state == ServerState::Ready
                && let Some(b) = &core.bound
            {
                return Ok(response(core.state, b));
            }
            if !same && core.bound.is_some() && core.sessions.has_open() {
                return Err(ApiError::conflict(
                    "Cannot rebind while active or desynced sessions still exist.",
                    json!({}),
                ));
            }
            if !same && core.bound.is_some() {
                core.sessions.clear();
            }
            core.state = ServerState::Initializing;
            core.fingerprint = Some(fingerprint);
            core.effective = self.inner.base.clone();
            core.bound.take()
        };
        if let Some(old) = previous {
            stop_binding(&old, TEARDOWN_GRACE).await;
        }

        let runtime_id = crate::ids::runtime_id();
        let runtime_dir = PathBuf::from(&effective.runtime_root).join(&runtime_id);
        let system_prompt = prompt_file.map(|source| {
            let (target, applies_to) = prompt_target(&req.blackbox_type, &runtime_dir);
            RuntimeSystemPrompt {
                source_file: source,
                runtime_file: target.display().to_string(),
                applies_to: applies_to.to_owned(),
            }
        });
        let info = BindingInfo {
            runtime_id,
            blackbox_type: req.blackbox_type.clone(),
            router_raw: req.router.clone(),
            router_base_url,
            router_api_path: router_api_path.clone(),
            bound_session_id: session_id.clone(),
            bound_instance_id: instance_id.clone(),
            bound_sandbox_id: req.bound_sandbox_id.clone().filter(|s| !s.is_empty()),
            system_prompt: system_prompt.clone(),
            runtime_dir: runtime_dir.display().to_string(),
            registered_at: Timestamp::now(),
            backend_options: req.backend_options.clone(),
        };
        let proxy_cfg = ProxyConfig {
            upstream_origin: origin,
            router_api_path: call_api_path,
            unix_socket,
            router_token: self.inner.router.token.clone(),
            bound_session_id: session_id.clone(),
            bound_instance_id: instance_id,
            bound_sandbox_id: info.bound_sandbox_id.clone(),
            sticky_header_name: proxy_opts.sticky_header_name,
            max_steps: proxy_opts
                .max_steps
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
            default_temperature: proxy_opts.default_temperature,
            router_timeout: effective.router_timeout(),
            upstream_headers: Vec::new(),
            model_override: None,
        };
        let backend: Arc<dyn backend::Backend> = Arc::from(backend);
        let started = self
            .bring_up(
                &runtime_dir,
                proxy_cfg,
                &backend,
                &effective,
                system_prompt,
                router_api_path,
            )
            .await;
        let proxy = match started {
            Ok(p) => p,
            Err(failure) => {
                remove_runtime_dir(&info.runtime_dir).await;
                let mut core = self.core();
                let details = obj(json!({"blackbox_type": req.blackbox_type}));
                let shutting = core.state == ServerState::ShuttingDown;
                return Err(match failure {
                    InitFailure::Request(message) => {
                        if !shutting {
                            core.state = ServerState::Idle;
                        }
                        core.fingerprint = None;
                        ApiError::Request { message, details }
                    }
                    InitFailure::Failed(why) => {
                        if !shutting {
                            core.state = ServerState::Error;
                        }
                        ApiError::Backend {
                            message: format!("Failed to initialize backend: {why}"),
                            details,
                        }
                    }
                });
            }
        };
        let bound = Arc::new(Bound {
            info,
            config: effective.clone(),
            capabilities,
            backend,
            proxy,
            monitor: self.inner.shutdown.child_token(),
        });
        // Read before taking the lock: the history of a session this registration creates.
        let (history, trace) = initial_history(bound.info.system_prompt.as_ref());
        let created = {
            let mut core = self.core();
            let blackbox_type = req.blackbox_type.clone();
            // SIGTERM arrived while the agent started: shutdown did not see this binding, so
            // it is stopped here instead of installed.
            let made = if core.state == ServerState::ShuttingDown {
                Err(None)
            } else {
                core.sessions
                    .get_or_create(&session_id, effective.max_sessions, || {
                        Session::new(session_id.clone(), blackbox_type, history, trace)
                    })
                    .map_err(Some)
            };
            match made {
                Ok(_) => {
                    core.state = ServerState::Ready;
                    core.effective = effective;
                    core.bound = Some(Arc::clone(&bound));
                    Ok(response(core.state, &bound))
                }
                Err(None) => Err(ApiError::unavailable("Server is shutting down.")),
                Err(Some(e)) => {
                    core.state = ServerState::Error;
                    Err(ApiError::Backend {
                        message: format!("Failed to initialize backend: {e}"),
                        details: obj(json!({"blackbox_type": req.blackbox_type})),
                    })
                }
            }
        };
        match created {
            Ok(r) => {
                self.start_monitor(&bound);
                Ok(r)
            }
            Err(e) => {
                stop_binding(&bound, TEARDOWN_GRACE).await;
                Err(e)
            }
        }
    }

    /// Creates the runtime directory, starts the proxy and the agent; undoes what it started
    /// when a step fails.
    async fn bring_up(
        &self,
        runtime_dir: &Path,
        proxy_cfg: ProxyConfig,
        backend: &Arc<dyn backend::Backend>,
        config: &crate::config::ServerConfig,
        system_prompt: Option<RuntimeSystemPrompt>,
        router_api_path: String,
    ) -> Result<LlmProxy, InitFailure> {
        let failed =
            |what: &str, e: &dyn std::fmt::Display| InitFailure::Failed(format!("{what}: {e}"));
        // Private (0700, under a root no other user can swap): the directory will hold the
        // agent's credentials and logs.
        let dir = runtime_dir.to_path_buf();
        tokio::task::spawn_blocking(move || crate::runtime_dir::prepare(&dir))
            .await
            .map_err(|e| failed("runtime directory", &e))?
            .map_err(|e| failed("runtime directory", &e))?;
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .map_err(|e| failed("cannot bind the proxy", &e))?;
        let (bound_session_id, bound_instance_id) = (
            proxy_cfg.bound_session_id.clone(),
            proxy_cfg.bound_instance_id.clone(),
        );
        let proxy = LlmProxy::start(listener, proxy_cfg)
            .await
            .map_err(|e| failed("cannot start the proxy", &e))?;
        let ctx = InitContext {
            runtime_dir: runtime_dir.to_path_buf(),
            router_api_path,
            system_prompt,
            config: config.clone(),
            bins: self.inner.bins.clone(),
            proxy: proxy.clone(),
            bound_session_id,
            bound_instance_id,
        };
        match backend.initialize(&ctx).await {
            Ok(()) => Ok(proxy),
            Err(e) => {
                backend.shutdown(TEARDOWN_GRACE).await;
                agentbox_sandbox::reaper::kill_adopted(crate::ORPHAN_KILL_WAIT).await;
                proxy.shutdown().await;
                Err(match e {
                    BackendError::InvalidOptions(m) | BackendError::Protocol(m) => {
                        InitFailure::Request(m)
                    }
                    other @ (BackendError::Transport(_)
                    | BackendError::Process(_)
                    | BackendError::ContextOverflow { .. }
                    | BackendError::MaxSteps { .. }) => InitFailure::Failed(other.to_string()),
                })
            }
        }
    }
}

/// A new session's history: the system prompt (when the file has text) and its trace event.
fn initial_history(prompt: Option<&RuntimeSystemPrompt>) -> (Vec<Message>, Vec<TraceEvent>) {
    let Some(p) = prompt else {
        return (Vec::new(), Vec::new());
    };
    let content = match std::fs::read_to_string(&p.source_file) {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(file = %p.source_file, error = %e, "cannot read system_prompt_file for the history");
            return (Vec::new(), Vec::new());
        }
    };
    if content.trim().is_empty() {
        return (Vec::new(), Vec::new());
    }
    let event = TraceEvent {
        turn_id: "__init__".into(),
        seq: 0,
        source: "blackbox_server".into(),
        event_type: "system_prompt_injected".into(),
        payload: obj(
            json!({"source_file": p.source_file, "content_length": content.chars().count()}),
        ),
        created_at: Timestamp::now(),
    };
    (
        vec![Message::text(Role::System, Some(content))],
        vec![event],
    )
}

fn response(state: ServerState, bound: &Bound) -> RegisterResponse {
    RegisterResponse {
        request_id: String::new(),
        status: state,
        binding: bound.info.clone(),
        capabilities: bound.capabilities,
        config: bound.config.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proxy_options_are_checked() {
        let o = |v: serde_json::Value| proxy_options(&obj(v));
        assert_eq!(o(json!({})).unwrap().max_steps, Some(100));
        assert_eq!(
            o(json!({"proxy": {"max_steps": null}})).unwrap().max_steps,
            None
        );
        assert!(o(json!({"proxy": {"enabled": false}})).is_err());
        assert!(o(json!({"proxy": {"max_steps": 0}})).is_err());
        assert!(o(json!({"proxy": {"default_temperature": -1.0}})).is_err());
        assert!(o(json!({"proxy": 3})).is_err());
    }

    #[test]
    fn origin_drops_the_path() {
        assert_eq!(upstream_origin("http://h:9/v1").unwrap(), "http://h:9");
        assert_eq!(upstream_origin("https://h/v1").unwrap(), "https://h");
    }
}
