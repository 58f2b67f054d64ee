//! The opencode backend: `opencode serve` on a loopback port it picks itself (`--port 0`, the
//! address read from its ready line), with HOME and the XDG dirs inside the registration's
//! runtime directory and an `opencode.json` whose one provider
//! (`@ai-sdk/openai-compatible`) points at the in-process proxy. A turn is `POST
//! /session/{id}/message` (which returns when the agent loop ends), then the session's new
//! messages from `GET /session/{id}/message`, converted to chat messages.
//!
//! The process runs in its own process group; shutdown asks it to dispose, then terminates the
//! group, so nothing it started outlives it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use agentbox_sandbox::proc;
use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::task::TaskTracker;

use super::agent::{self, Agent, Cli, Daemon, Lifecycle, Lines, lock};
use super::{BackendError, InitContext, TurnInput};
use crate::model::{
    AdapterResponse, BackendCapabilities, FunctionCall, Message, Object, ProxyOptions, Role,
    Timestamp, ToolCall, ToolCallType, TraceEvent, TurnUsage,
};
use crate::proxy::LlmProxy;

/// How the files, logs and errors name opencode.
const CLI: Cli = Cli {
    name: "opencode",
    label: "opencode",
    hint: "Set OPENCODE_BIN or install opencode.",
};

/// How long opencode gets to answer its health probe. Every turn probes first, and eight
/// opencode servers warming up at once on two cores (`tests/tests/pool_episodes.rs`) took
/// longer than 2 s to answer, failing turns of servers that were fine; as openclaw's.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(10);

/// How long abort and dispose may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(5);

/// Connection retries of the turn's POST (opencode may still be binding).
const CONNECT_RETRIES: u32 = 5;
const CONNECT_RETRY_DELAY: Duration = Duration::from_millis(200);

/// `model_limit`.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct ModelLimit {
    /// Context window (`> 0`).
    pub context: u64,
    /// Output tokens (`> 0`).
    pub output: u64,
    /// Input tokens (`> 0`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<u64>,
}

/// `compaction`.
#[derive(Debug, Clone, PartialEq, Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Compaction {
    /// Automatic compaction.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub auto: Option<bool>,
    /// Prune old tool output.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prune: Option<bool>,
    /// Turns kept verbatim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail_turns: Option<u64>,
    /// Recent tokens kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preserve_recent_tokens: Option<u64>,
    /// Tokens reserved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reserved: Option<u64>,
}

/// opencode's `backend_options` (unknown keys refused, as the reference does).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Options {
    /// The binary, over `OPENCODE_BIN`.
    #[serde(default)]
    pub executable: Option<String>,
    /// Provider id in opencode's config.
    pub provider_id: String,
    /// Provider display name.
    pub provider_name: String,
    /// The AI SDK package (`@ai-sdk/openai-compatible`).
    pub provider_package: String,
    /// Model id.
    pub model_id: String,
    /// Model display name.
    pub model_name: String,
    /// Token limits.
    #[serde(default)]
    pub model_limit: Option<ModelLimit>,
    /// Compaction settings.
    #[serde(default)]
    pub compaction: Option<Compaction>,
    /// The proxy's options (parsed by the server too).
    #[serde(default)]
    pub proxy: ProxyOptions,
}

impl Options {
    /// Parses and range-checks `backend_options`.
    ///
    /// # Errors
    /// `Invalid opencode backend_options: <why>`.
    pub fn parse(raw: &Object) -> Result<Options, BackendError> {
        let invalid = |why: String| agent::invalid_options("opencode", &why);
        let options: Options = agent::parse_options(raw, "opencode")?;
        if let Some(l) = &options.model_limit {
            for (name, v) in [
                ("context", Some(l.context)),
                ("output", Some(l.output)),
                ("input", l.input),
            ] {
                if v == Some(0) {
                    return Err(invalid(format!(
                        "model_limit.{name}: Input should be greater than 0"
                    )));
                }
            }
        }
        Ok(options)
    }
}

/// The agent's session on our side.
#[derive(Debug, Default)]
struct SessionSide {
    /// opencode's session id (`ses_…`).
    id: Option<String>,
    /// Messages in that session after the last committed turn: the next turn's outputs start
    /// there.
    msg_count: usize,
    /// A turn began after `msg_count` was taken and did not commit (cancelled, aborted): the
    /// session may hold its messages, so the next turn counts them again before it starts.
    unsettled: bool,
}

/// Where a started opencode answers.
#[derive(Debug, Clone)]
struct Conn {
    base: String,
    proxy: LlmProxy,
}

/// The opencode backend.
#[derive(Debug)]
pub struct Opencode {
    options: Options,
    http: reqwest::Client,
    conn: Mutex<Option<Conn>>,
    daemon: Daemon,
    /// Its stderr log, quoted when it dies.
    stderr_log: Mutex<Option<std::path::PathBuf>>,
    session: Mutex<SessionSide>,
    logs: TaskTracker,
}

/// The opencode config that points its one provider at the proxy.
fn opencode_config(
    options: &Options,
    base_url: &str,
    router_timeout_ms: u64,
    with_prompt: bool,
) -> Value {
    let mut model = json!({"name": options.model_name, "tools": true});
    if let Some(limit) = &options.model_limit {
        model["limit"] = json!(limit);
    }
    let mut agent = json!({"title": {"disable": true}});
    if with_prompt {
        agent["build"] = json!({"prompt": "{file:./prompts/build.txt}"});
    }
    let mut config = json!({
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            options.provider_id.clone(): {
                "npm": options.provider_package,
                "name": options.provider_name,
                "options": {"baseURL": base_url, "timeout": router_timeout_ms},
                "models": {options.model_id.clone(): model},
            }
        },
        "model": format!("{}/{}", options.provider_id, options.model_id),
        "small_model": format!("{}/{}", options.provider_id, options.model_id),
        // Questions would wait for a human forever; doom-loop prompts likewise.
        "permission": {"*": "allow", "question": "deny", "doom_loop": "deny"},
        "agent": agent,
        // Offline sandbox: no update checks, no share links.
        "autoupdate": false,
        "share": "disabled",
    });
    if let Some(c) = &options.compaction {
        config["compaction"] = json!(c);
    }
    config
}

impl Opencode {
    /// A backend for `backend_options` (checked now; nothing starts until `initialize`).
    ///
    /// # Errors
    /// When the options do not fit.
    pub fn new(backend_options: &Object) -> Result<Opencode, BackendError> {
        Ok(Opencode {
            options: Options::parse(backend_options)?,
            http: agent::http_client()?,
            conn: Mutex::new(None),
            daemon: Daemon::default(),
            stderr_log: Mutex::new(None),
            session: Mutex::new(SessionSide::default()),
            logs: TaskTracker::new(),
        })
    }

    fn conn(&self) -> Result<Conn, BackendError> {
        agent::started(&self.conn, "opencode")
    }

    /// Reads opencode's stdout until its `listening on <url>` line (copied to the log, as
    /// everything after it).
    async fn read_listen_line(
        &self,
        mut lines: Lines,
        deadline: Instant,
    ) -> Result<String, BackendError> {
        let found = tokio::time::timeout_at(deadline.into(), async {
            while let Ok(Some(line)) = lines.next_line().await {
                let line = String::from_utf8_lossy(&line);
                if let Some((_, url)) = line.split_once("listening on ") {
                    return Some(url.trim().trim_end_matches('/').to_owned());
                }
            }
            None
        })
        .await;
        lines.copy_rest(&self.logs);
        match found {
            Ok(Some(url)) if url.starts_with("http://127.0.0.1:") => Ok(url),
            Ok(Some(url)) => Err(BackendError::Process(format!(
                "opencode listens on an unexpected address: {url}"
            ))),
            Ok(None) => Err(BackendError::Process(match self.daemon.exited().await {
                Some(code) => format!("opencode exited early with code {code}"),
                None => "opencode closed its stdout before listening".into(),
            })),
            Err(_) => Err(BackendError::Process(
                "Timed out waiting for opencode to listen.".into(),
            )),
        }
    }

    /// Why opencode is gone: its exit code and stderr's tail.
    async fn death(&self) -> BackendError {
        let log = lock(&self.stderr_log).clone().unwrap_or_default();
        self.daemon
            .died(&CLI, &log)
            .await
            .unwrap_or_else(|| BackendError::Process("opencode is gone.".into()))
    }

    async fn health_probe(&self) -> bool {
        let Ok(conn) = self.conn() else {
            return false;
        };
        let Ok(resp) = self
            .http
            .get(format!("{}/global/health", conn.base))
            .timeout(HEALTH_TIMEOUT)
            .send()
            .await
        else {
            return false;
        };
        if !resp.status().is_success() {
            return false;
        }
        resp.json::<Value>()
            .await
            .is_ok_and(|v| v.get("healthy").and_then(Value::as_bool) == Some(true))
    }

    /// One call to opencode; `None` for an empty answer.
    async fn call(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        timeout: Option<Duration>,
    ) -> Result<Option<Value>, agent::CallError> {
        let conn = self.conn().map_err(agent::CallError::Other)?;
        let mut req = self
            .http
            .request(method.clone(), format!("{}{path}", conn.base));
        if let Some(b) = body {
            req = req.json(b);
        }
        if let Some(t) = timeout {
            req = req.timeout(t);
        }
        let resp = req.send().await.map_err(|e| {
            let msg = format!(
                "opencode {method} {path}: {}",
                agentbox_http::error_chain(&e)
            );
            if e.is_connect() {
                agent::CallError::Connect(msg)
            } else {
                agent::CallError::Other(BackendError::Transport(msg))
            }
        })?;
        agent::read_answer(
            resp,
            &format!("opencode {method} {path}"),
            self.options.proxy.max_steps.unwrap_or(0),
        )
        .await
        .map_err(agent::CallError::Other)
    }

    async fn ensure_session(&self) -> Result<String, BackendError> {
        if let Some(id) = lock(&self.session).id.clone() {
            return Ok(id);
        }
        let data = self
            .call(reqwest::Method::POST, "/session", Some(&json!({})), None)
            .await
            .map_err(agent::CallError::into_backend)?;
        let id = data.as_ref().and_then(session_id_of).ok_or_else(|| {
            BackendError::Protocol(
                "Could not extract backend_session_id from /session response.".into(),
            )
        })?;
        lock(&self.session).id = Some(id.clone());
        Ok(id)
    }

    async fn post_turn(&self, path: &str, body: &Value) -> Result<Option<Value>, BackendError> {
        let mut attempt = 0;
        loop {
            if self.daemon.exited().await.is_some() {
                return Err(self.death().await);
            }
            match self
                .call(reqwest::Method::POST, path, Some(body), None)
                .await
            {
                Ok(v) => return Ok(v),
                Err(agent::CallError::Connect(msg)) if attempt < CONNECT_RETRIES => {
                    attempt += 1;
                    tracing::warn!(attempt, error = %msg, "retrying opencode POST on connect error");
                    tokio::time::sleep(CONNECT_RETRY_DELAY).await;
                }
                Err(e) => {
                    // opencode dying mid-turn closes the connection before it is reaped: give
                    // it the second `died` waits, so the turn reports the death, not the socket.
                    let log = lock(&self.stderr_log).clone().unwrap_or_default();
                    return Err(match self.daemon.died(&CLI, &log).await {
                        Some(death) => death,
                        None => e.into_backend(),
                    });
                }
            }
        }
    }

    /// How many messages the session holds now.
    async fn message_count(&self, sid: &str) -> Result<usize, BackendError> {
        let data = self
            .call(
                reqwest::Method::GET,
                &format!("/session/{sid}/message"),
                None,
                None,
            )
            .await
            .map_err(agent::CallError::into_backend)?;
        Ok(extract_messages(&data.unwrap_or(Value::Null))?.len())
    }

    /// The session's messages from `prev` on, converted; retried once when opencode has not
    /// stored the turn's answer yet.
    async fn fetch_outputs(
        &self,
        sid: &str,
        turn_id: &str,
        prev: usize,
    ) -> Result<(usize, Vec<Message>, Vec<TraceEvent>, TurnUsage), BackendError> {
        let path = format!("/session/{sid}/message");
        let mut last = None;
        for attempt in 0..2 {
            if attempt > 0 {
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            match self.call(reqwest::Method::GET, &path, None, None).await {
                Ok(data) => {
                    let data = data.unwrap_or(Value::Null);
                    if let Some(e) = agent::structured_max_steps(
                        &data,
                        self.options.proxy.max_steps.unwrap_or(0),
                    ) {
                        return Err(e);
                    }
                    let all = extract_messages(&data)?;
                    if all.len() < prev {
                        return Err(BackendError::Protocol(format!(
                            "opencode message count went backwards: prev={prev}, now={}",
                            all.len()
                        )));
                    }
                    let (outputs, trace, usage) =
                        convert_messages(turn_id, all.get(prev..).unwrap_or(&[]))?;
                    if !outputs.is_empty() {
                        return Ok((all.len(), outputs, trace, usage));
                    }
                    last = Some(BackendError::Transport(format!(
                        "opencode history fetch returned no material outputs for the current turn: prev={prev}, now={}",
                        all.len()
                    )));
                }
                Err(agent::CallError::Connect(msg)) => last = Some(BackendError::Transport(msg)),
                Err(agent::CallError::Other(e @ BackendError::Transport(_))) => last = Some(e),
                Err(agent::CallError::Other(e)) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| BackendError::Transport("opencode history fetch failed".into())))
    }
}

/// opencode's session id in a `/session` answer.
fn session_id_of(data: &Value) -> Option<String> {
    if let Some(s) = data.as_str().filter(|s| !s.is_empty()) {
        return Some(s.to_owned());
    }
    ["id", "session_id", "sessionID"]
        .iter()
        .find_map(|k| {
            data.get(k)
                .and_then(Value::as_str)
                .filter(|s| !s.is_empty())
        })
        .map(str::to_owned)
}

/// The message list of a history answer.
fn extract_messages(data: &Value) -> Result<Vec<Value>, BackendError> {
    let objects = |items: &Vec<Value>| items.iter().filter(|i| i.is_object()).cloned().collect();
    if let Some(items) = data.as_array() {
        return Ok(objects(items));
    }
    if let Some(items) = data.get("messages").and_then(Value::as_array) {
        return Ok(objects(items));
    }
    if let Some(m) = data.get("message").filter(|m| m.is_object()) {
        return Ok(vec![m.clone()]);
    }
    if data.get("info").is_some() && data.get("parts").is_some() {
        return Ok(vec![data.clone()]);
    }
    Err(BackendError::Protocol(
        "Could not extract opencode messages from response.".into(),
    ))
}

fn count(tokens: &Value, key: &str) -> u64 {
    tokens.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// opencode messages (`{info, parts}`) → chat messages: each assistant message's text and
/// reasoning parts joined, its tool parts as tool calls followed by their results; user
/// messages skipped. Reasoning, step and tool parts are also kept as trace events.
///
/// # Errors
/// When a message has no parts list.
pub fn convert_messages(
    turn_id: &str,
    messages: &[Value],
) -> Result<(Vec<Message>, Vec<TraceEvent>, TurnUsage), BackendError> {
    let mut outputs = Vec::new();
    let mut trace = Vec::new();
    let mut usage = TurnUsage::default();
    let mut seq = 0_u64;
    for msg in messages {
        if msg
            .get("info")
            .and_then(|i| i.get("role"))
            .and_then(Value::as_str)
            == Some("user")
        {
            continue;
        }
        let parts = msg.get("parts").and_then(Value::as_array).ok_or_else(|| {
            BackendError::Protocol("opencode message payload is missing parts.".into())
        })?;
        let mut reasoning = Vec::new();
        let mut texts = Vec::new();
        let mut calls = Vec::new();
        let mut results = Vec::new();
        for part in parts.iter().filter_map(Value::as_object) {
            seq += 1;
            let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
            if matches!(kind, "reasoning" | "step-start" | "step-finish" | "tool") {
                trace.push(TraceEvent {
                    turn_id: turn_id.to_owned(),
                    seq,
                    source: "opencode".into(),
                    event_type: kind.to_owned(),
                    payload: part.clone(),
                    created_at: Timestamp::now(),
                });
            }
            let text = part
                .get("text")
                .and_then(Value::as_str)
                .filter(|t| !t.is_empty());
            match kind {
                "reasoning" => reasoning.extend(text.map(str::to_owned)),
                "text" => texts.extend(text.map(str::to_owned)),
                "tool" => {
                    let id = ["callID", "callId", "id"]
                        .iter()
                        .find_map(|k| part.get(*k).and_then(Value::as_str))
                        .map_or_else(|| format!("call_{}", crate::ids::hex(4)), str::to_owned);
                    let name = ["tool", "name"]
                        .iter()
                        .find_map(|k| part.get(*k).and_then(Value::as_str))
                        .unwrap_or("tool")
                        .to_owned();
                    let state = part.get("state").cloned().unwrap_or(Value::Null);
                    let input = state.get("input").cloned().unwrap_or_else(|| json!({}));
                    let output = match state.get("output") {
                        None | Some(Value::Null) => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        Some(other) => other.to_string(),
                    };
                    calls.push(ToolCall {
                        id: id.clone(),
                        kind: ToolCallType::Function,
                        function: FunctionCall {
                            name: name.clone(),
                            arguments: input.to_string(),
                        },
                    });
                    results.push(Message {
                        tool_call_id: Some(id),
                        name: Some(name),
                        ..Message::text(Role::Tool, Some(output))
                    });
                    usage.tool_calls += 1;
                }
                "step-finish" => {
                    let tokens = part
                        .get("tokens")
                        .or_else(|| part.get("usage"))
                        .cloned()
                        .unwrap_or(Value::Null);
                    usage.total_tokens += count(&tokens, "total");
                    usage.input_tokens += count(&tokens, "input");
                    usage.output_tokens += count(&tokens, "output");
                    usage.reasoning_tokens += count(&tokens, "reasoning");
                    usage.steps += 1;
                }
                _ => {}
            }
        }
        let reasoning = Some(reasoning.join("\n")).filter(|s| !s.is_empty());
        let content = Some(texts.join("\n")).filter(|s| !s.is_empty());
        if !calls.is_empty() {
            outputs.push(Message {
                reasoning_content: reasoning,
                tool_calls: Some(calls),
                ..Message::text(Role::Assistant, content)
            });
            outputs.extend(results);
        } else if content.is_some() || reasoning.is_some() {
            outputs.push(Message {
                reasoning_content: reasoning,
                ..Message::text(Role::Assistant, content)
            });
        }
    }
    Ok((outputs, trace, usage))
}

impl Agent for Opencode {
    async fn start(&self, ctx: &InitContext) -> Result<(), BackendError> {
        let root = &ctx.runtime_dir;
        let home = root.join("home");
        let config_dir = home.join(".config/opencode");
        agent::create_dirs(&[
            config_dir.join("prompts"),
            root.join("logs"),
            root.join("run"),
            root.join("tmp"),
            home.join(".cache"),
            home.join(".local/share"),
            home.join(".local/state"),
        ])
        .await?;
        agent::install_system_prompt(ctx.system_prompt.as_ref()).await?;
        let base_url = format!("{}{}", ctx.proxy.base_url(), ctx.router_api_path);
        let config = opencode_config(
            &self.options,
            &base_url,
            ctx.config.router_timeout,
            ctx.system_prompt.is_some(),
        );
        let text = serde_json::to_string_pretty(&config).unwrap_or_default();
        agent::write_files(&config_dir, &[("opencode.json", text)]).await?;

        let bin = CLI.require(
            self.options
                .executable
                .as_ref()
                .unwrap_or(&ctx.bins.opencode),
        )?;
        let mut cmd = tokio::process::Command::new(&bin);
        cmd.args(["serve", "--port", "0", "--hostname", "127.0.0.1"])
            .current_dir(root)
            .env("HOME", &home)
            .env("XDG_CONFIG_HOME", home.join(".config"))
            .env("XDG_CACHE_HOME", home.join(".cache"))
            .env("XDG_DATA_HOME", home.join(".local/share"))
            .env("XDG_STATE_HOME", home.join(".local/state"))
            .env("TMPDIR", root.join("tmp"))
            // A sandbox has no internet: no update checks, model catalogue, LSP downloads or
            // plugin installs (the optional plugin install would otherwise try npm).
            .env("OPENCODE_DISABLE_AUTOUPDATE", "1")
            .env("OPENCODE_DISABLE_MODELS_FETCH", "1")
            .env("OPENCODE_DISABLE_LSP_DOWNLOAD", "1")
            .env("OPENCODE_DISABLE_DEFAULT_PLUGINS", "1")
            .env("npm_config_offline", "true")
            .stdin(std::process::Stdio::null());
        let mut spawned = CLI.spawn(cmd, root, &self.logs).await?;
        let lines = Lines::open(&CLI, &mut spawned).await;
        let stderr_log = spawned.stderr_log.clone();
        *lock(&self.stderr_log) = Some(stderr_log.clone());
        self.daemon.keep(spawned).await;
        let deadline = Instant::now() + crate::config::secs(ctx.config.health_check_timeout);
        let url = self.read_listen_line(lines?, deadline).await?;
        agent::write_files(
            &root.join("run"),
            &[
                (
                    "opencode.port",
                    url.rsplit(':').next().unwrap_or_default().to_owned(),
                ),
                ("proxy.port", ctx.proxy.local_addr().port().to_string()),
            ],
        )
        .await?;
        *lock(&self.conn) = Some(Conn {
            base: url,
            proxy: ctx.proxy.clone(),
        });
        self.daemon
            .wait_healthy(&CLI, &stderr_log, deadline, || self.health_probe())
            .await?;
        // opencode boots its project instance on the first session: do it now, so the first
        // turn does not pay for it against its deadline.
        if let Err(e) = self.ensure_session().await {
            tracing::warn!(error = %e, "opencode session warm-up failed; the first turn retries");
        }
        Ok(())
    }

    async fn turn(&self, turn: TurnInput<'_>) -> Result<AdapterResponse, BackendError> {
        if !self.healthy().await {
            return Err(BackendError::Process(
                "opencode backend is not healthy.".into(),
            ));
        }
        let conn = self.conn()?;
        let sid = self.ensure_session().await?;
        conn.proxy.update_turn_backend_session(&sid).await;
        let text = turn
            .messages
            .first()
            .and_then(|m| m.content.clone())
            .unwrap_or_default();
        if lock(&self.session).unsettled {
            let count = self.message_count(&sid).await?;
            lock(&self.session).msg_count = count;
        }
        let prev = {
            let mut side = lock(&self.session);
            side.unsettled = true;
            side.msg_count
        };
        let body = json!({"parts": [{"type": "text", "text": text}], "agent": "build"});
        let answer = self
            .post_turn(&format!("/session/{sid}/message"), &body)
            .await?;
        if let Some(v) = &answer
            && let Some(e) =
                agent::structured_max_steps(v, self.options.proxy.max_steps.unwrap_or(0))
        {
            return Err(e);
        }
        // opencode answers once its loop ends; the proxy may still be finishing the last
        // model call's bookkeeping, and the history must include it.
        conn.proxy.drain_turn(None).await;
        agent::proxy_errors(&conn.proxy).await?;
        let (count, outputs, trace_events, usage) =
            self.fetch_outputs(&sid, turn.turn_id, prev).await?;
        {
            let mut side = lock(&self.session);
            side.msg_count = count;
            side.unsettled = false;
        }
        Ok(AdapterResponse {
            outputs,
            trace_events,
            usage,
            backend_session_id: sid,
        })
    }

    fn session_id(&self) -> Option<String> {
        lock(&self.session).id.clone()
    }
}

impl Lifecycle for Opencode {
    async fn abort(&self) -> bool {
        let Some(sid) = lock(&self.session).id.clone() else {
            return false;
        };
        match self
            .call(
                reqwest::Method::POST,
                &format!("/session/{sid}/abort"),
                Some(&json!({})),
                Some(CONTROL_TIMEOUT),
            )
            .await
        {
            Ok(Some(v)) => v.as_bool().unwrap_or(true),
            Ok(None) | Err(_) => false,
        }
    }

    async fn healthy(&self) -> bool {
        self.daemon.exited().await.is_none() && self.health_probe().await
    }

    async fn stop(&self, grace: Duration) {
        // Its tool runners may sit in groups of their own, and dispose may end their parents:
        // find them first, while opencode is still their ancestor.
        let pgid = self.daemon.pgid().await;
        let tree = pgid.map(proc::descendants).unwrap_or_default();
        let had_conn = lock(&self.conn).is_some();
        if had_conn {
            let empty = json!({});
            let dispose = self.call(
                reqwest::Method::POST,
                "/instance/dispose",
                Some(&empty),
                Some(CONTROL_TIMEOUT.min(grace)),
            );
            if let Err(e) = dispose.await {
                tracing::debug!(error = ?e, "opencode dispose failed");
            }
        }
        *lock(&self.conn) = None;
        self.daemon.stop(grace, &tree, CLI.name).await;
        agent::close_logs(&self.logs, CLI.name).await;
    }
}

/// opencode's capabilities: one user message per turn, a register-time system prompt.
pub const CAPABILITIES: BackendCapabilities = agent::SINGLE_USER_MESSAGE;

#[cfg(test)]
mod tests {
    use super::*;

    fn options() -> Object {
        crate::error::obj(json!({
            "provider_id": "sglang", "provider_name": "Dressage Proxy",
            "provider_package": "@ai-sdk/openai-compatible",
            "model_id": "proxy-model", "model_name": "Dressage Proxy",
        }))
    }

    #[test]
    fn options_are_checked_like_the_reference() {
        assert!(Options::parse(&options()).is_ok());
        let mut bad = options();
        bad.insert("model_limit".into(), json!({"context": 200_000}));
        let msg = Options::parse(&bad).unwrap_err().to_string();
        assert!(msg.starts_with("Invalid opencode backend_options"), "{msg}");
        assert!(
            msg.contains("model_limit") && msg.contains("output"),
            "{msg}"
        );
        let mut extra = options();
        extra.insert("surprise".into(), json!(1));
        assert!(Options::parse(&extra).is_err());
        let mut zero = options();
        zero.insert("model_limit".into(), json!({"context": 0, "output": 1}));
        assert!(Options::parse(&zero).is_err());
    }

    #[test]
    fn config_points_the_provider_at_the_proxy() {
        let o = Options::parse(&options()).unwrap();
        let c = opencode_config(&o, "http://127.0.0.1:5000/v1", 600_000, true);
        let p = &c["provider"]["sglang"];
        assert_eq!(p["npm"], "@ai-sdk/openai-compatible");
        assert_eq!(p["options"]["baseURL"], "http://127.0.0.1:5000/v1");
        assert_eq!(p["options"]["timeout"], 600_000);
        assert_eq!(p["models"]["proxy-model"]["tools"], true);
        assert_eq!(c["model"], "sglang/proxy-model");
        assert_eq!(c["agent"]["build"]["prompt"], "{file:./prompts/build.txt}");
        assert_eq!(c["permission"]["question"], "deny");
    }

    #[test]
    fn conversion_follows_the_reference() {
        let msgs = vec![
            json!({"info": {"role": "user"}, "parts": [{"type": "text", "text": "hi"}]}),
            json!({"info": {"role": "assistant"}, "parts": [
                {"type": "step-start"},
                {"type": "reasoning", "text": "think"},
                {"type": "text", "text": "writing"},
                {"type": "tool", "callID": "call_1", "tool": "write",
                 "state": {"input": {"filePath": "/x"}, "output": "ok"}},
                {"type": "step-finish", "tokens": {"input": 10, "output": 5, "reasoning": 1, "total": 15}}
            ]}),
            json!({"info": {"role": "assistant"}, "parts": [{"type": "text", "text": "done"}]}),
        ];
        let (out, trace, usage) = convert_messages("t1", &msgs).unwrap();
        assert_eq!(out.len(), 3);
        assert_eq!(out[0].role, Role::Assistant);
        assert_eq!(out[0].content.as_deref(), Some("writing"));
        assert_eq!(out[0].reasoning_content.as_deref(), Some("think"));
        let call = &out[0].tool_calls.as_ref().unwrap()[0];
        assert_eq!(
            (call.id.as_str(), call.function.name.as_str()),
            ("call_1", "write")
        );
        assert_eq!(call.function.arguments, r#"{"filePath":"/x"}"#);
        assert_eq!(out[1].role, Role::Tool);
        assert_eq!(out[1].tool_call_id.as_deref(), Some("call_1"));
        assert_eq!(out[2].content.as_deref(), Some("done"));
        assert_eq!(trace.len(), 4);
        assert_eq!(
            (usage.steps, usage.tool_calls, usage.total_tokens),
            (1, 1, 15)
        );
        assert!(convert_messages("t", &[json!({"info": {"role": "assistant"}})]).is_err());
    }

    #[test]
    fn max_steps_answers_are_recognized() {
        let v = json!({"error": {"code": "max_steps_exceeded", "message": "x",
                                 "details": {"max_steps": 3, "attempted_step": 4}}});
        let Some(BackendError::MaxSteps { details, .. }) = agent::structured_max_steps(&v, 100)
        else {
            panic!()
        };
        assert_eq!(details["attempted_step"], 4);
        let v = json!({"error": {"type": "rate_limit_error", "message": "429 Turn exceeded max_steps."}});
        assert!(agent::structured_max_steps(&v, 7).is_some());
        let v = json!({"error": {"type": "rate_limit_error", "message": "slow down"}});
        assert!(agent::structured_max_steps(&v, 7).is_none());
    }
}
