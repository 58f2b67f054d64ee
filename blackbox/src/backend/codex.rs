//! The codex backend: one `codex exec --json` process per turn (`codex exec resume <thread>`
//! after the first, the thread id read from the first turn's `thread.started` event), with
//! `CODEX_HOME` and `CODEX_SQLITE_HOME` inside the registration's runtime directory and a
//! `config.toml` whose one custom provider points at the in-process proxy's Responses
//! endpoint. The turn's outputs and usage come from the JSONL events on stdout (the proxy's
//! counts replace the usage when the core commits).
//!
//! Codex 0.169's `exec resume` takes no `--sandbox`/`--cd` (the reference passes one): every
//! setting goes through `config.toml` and `-c key=value`, which both forms accept. Each
//! process leads its own process group; abort and shutdown kill the group and anything that
//! left it. Health is the binary being runnable and no turn's process having been killed
//! behind our back.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use agentbox_sandbox::proc::{self, ChildSetup};
use futures_util::future::BoxFuture;
use rustix::process::Signal;
use serde::Deserialize;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio_util::task::TaskTracker;

use super::{Backend, BackendError, InitContext, TurnInput};
use crate::model::{
    AdapterResponse, BackendCapabilities, Message, Object, ProxyOptions, Role, Timestamp,
    TraceEvent, TurnUsage,
};
use crate::proxy::LlmProxy;

/// The longest JSONL line read (the reference's stream limit).
const MAX_LINE: u64 = 100 << 20;

/// How much of a bad line or a log tail an error quotes.
const QUOTE: usize = 1000;

/// How long a process group gets between SIGTERM and SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(3);

/// The variable the provider's `env_key` names; its value is a dummy (the proxy needs none,
/// and Codex refuses a provider whose key variable is unset).
const PROVIDER_KEY_ENV: &str = "DRESSAGE_PROXY_API_KEY";

/// Inherited variables that would point Codex at another account or home: removed, along
/// with every other `CODEX_*` and `OPENAI_*`.
const STRIPPED_PREFIXES: &[&str] = &["CODEX_", "OPENAI_"];

/// `model`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelOptions {
    /// The model id Codex asks for.
    #[serde(default = "default_model_id")]
    pub id: String,
    /// The provider's display name.
    #[serde(default = "default_model_name")]
    pub name: String,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            id: default_model_id(),
            name: default_model_name(),
        }
    }
}

fn default_model_id() -> String {
    "proxy-model".into()
}
fn default_model_name() -> String {
    "Dressage Proxy".into()
}
fn default_provider_id() -> String {
    "dressage_proxy".into()
}
fn yes() -> bool {
    true
}

/// Codex's `sandbox_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum SandboxMode {
    /// Read only.
    ReadOnly,
    /// Writes in the workspace.
    WorkspaceWrite,
    /// No Codex sandbox (the server's own sandbox is the boundary).
    #[default]
    DangerFullAccess,
}

impl SandboxMode {
    fn as_str(self) -> &'static str {
        match self {
            SandboxMode::ReadOnly => "read-only",
            SandboxMode::WorkspaceWrite => "workspace-write",
            SandboxMode::DangerFullAccess => "danger-full-access",
        }
    }
}

/// Codex's `approval_policy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "kebab-case")]
pub enum ApprovalPolicy {
    /// Ask for anything not trusted.
    Untrusted,
    /// Ask when the model requests it.
    OnRequest,
    /// Never ask (nobody would answer).
    #[default]
    Never,
}

impl ApprovalPolicy {
    fn as_str(self) -> &'static str {
        match self {
            ApprovalPolicy::Untrusted => "untrusted",
            ApprovalPolicy::OnRequest => "on-request",
            ApprovalPolicy::Never => "never",
        }
    }
}

/// Codex's `web_search`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum WebSearch {
    /// Off (a sandbox has no internet).
    #[default]
    Disabled,
    /// Cached results.
    Cached,
    /// Live.
    Live,
}

impl WebSearch {
    fn as_str(self) -> &'static str {
        match self {
            WebSearch::Disabled => "disabled",
            WebSearch::Cached => "cached",
            WebSearch::Live => "live",
        }
    }
}

/// codex's `backend_options` (the reference's defaults; unknown keys refused).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Options {
    /// The binary, over `CODEX_BIN`.
    #[serde(default)]
    pub executable: Option<String>,
    /// The model.
    #[serde(default)]
    pub model: ModelOptions,
    /// The custom provider's id (`[A-Za-z0-9_-]+`: it is a TOML table name).
    #[serde(default = "default_provider_id")]
    pub model_provider_id: String,
    /// Codex's own sandbox.
    #[serde(default)]
    pub sandbox_mode: SandboxMode,
    /// Codex's approvals.
    #[serde(default)]
    pub approval_policy: ApprovalPolicy,
    /// `--skip-git-repo-check`.
    #[serde(default = "yes")]
    pub skip_git_repo_check: bool,
    /// `--ignore-rules`.
    #[serde(default = "yes")]
    pub ignore_rules: bool,
    /// Web search.
    #[serde(default)]
    pub web_search: WebSearch,
    /// The proxy's options (parsed by the server too).
    #[serde(default)]
    pub proxy: ProxyOptions,
}

impl Options {
    /// Parses and checks `backend_options`.
    ///
    /// # Errors
    /// `Invalid codex backend_options: <why>`.
    pub fn parse(raw: &Object) -> Result<Options, BackendError> {
        let invalid = |why: String| {
            BackendError::InvalidOptions(format!("Invalid codex backend_options: {why}"))
        };
        let options: Options = serde_path_to_error::deserialize(Value::Object(raw.clone()))
            .map_err(|e| {
                let path = e.path().to_string();
                invalid(format!("{path}: {}", e.into_inner()))
            })?;
        let id = &options.model_provider_id;
        if id.is_empty()
            || !id
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
        {
            return Err(invalid(format!(
                "model_provider_id: must match [A-Za-z0-9_-]+, got {}",
                quote(id, 80)
            )));
        }
        for (name, v) in [
            ("model.id", &options.model.id),
            ("model.name", &options.model.name),
        ] {
            if v.is_empty() {
                return Err(invalid(format!("{name}: must not be empty")));
            }
        }
        Ok(options)
    }

    fn executable(&self, bins: &crate::config::Bins) -> String {
        self.executable
            .clone()
            .unwrap_or_else(|| bins.codex.clone())
    }
}

/// A TOML basic string (JSON's escapes are TOML's).
fn toml_string(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// `config.toml` for `options`, its provider at `base_url` (the proxy's `/v1`), with the
/// system prompt as developer instructions (as the reference: Codex keeps its own base
/// instructions and adds these).
#[must_use]
pub fn codex_config(
    options: &Options,
    base_url: &str,
    developer_instructions: Option<&str>,
) -> String {
    let mut lines = vec![
        format!("model = {}", toml_string(&options.model.id)),
        format!(
            "model_provider = {}",
            toml_string(&options.model_provider_id)
        ),
        format!(
            "approval_policy = {}",
            toml_string(options.approval_policy.as_str())
        ),
        format!(
            "sandbox_mode = {}",
            toml_string(options.sandbox_mode.as_str())
        ),
        format!("web_search = {}", toml_string(options.web_search.as_str())),
        "check_for_update_on_startup = false".into(),
        "cli_auth_credentials_store = \"file\"".into(),
    ];
    if let Some(text) = developer_instructions {
        lines.push(format!("developer_instructions = {}", toml_string(text)));
    }
    lines.extend([
        String::new(),
        "[analytics]".into(),
        "enabled = false".into(),
        String::new(),
        "[feedback]".into(),
        "enabled = false".into(),
        String::new(),
        format!("[model_providers.{}]", options.model_provider_id),
        format!("name = {}", toml_string(&options.model.name)),
        format!("base_url = {}", toml_string(base_url)),
        "wire_api = \"responses\"".into(),
        format!("env_key = {}", toml_string(PROVIDER_KEY_ENV)),
        String::new(),
    ]);
    lines.join("\n")
}

/// The argv after the binary: `exec [resume] --json ... -- [<thread>] <prompt>`.
#[must_use]
pub fn exec_args(
    options: &Options,
    log_dir: &Path,
    thread: Option<&str>,
    prompt: &str,
) -> Vec<String> {
    let mut args = vec!["exec".to_owned()];
    if thread.is_some() {
        args.push("resume".into());
    }
    args.extend(["--json".into(), "--model".into(), options.model.id.clone()]);
    for (key, value) in [
        ("approval_policy", options.approval_policy.as_str()),
        ("sandbox_mode", options.sandbox_mode.as_str()),
        ("model_provider", options.model_provider_id.as_str()),
        ("web_search", options.web_search.as_str()),
        ("log_dir", &log_dir.display().to_string()),
    ] {
        args.push("--config".into());
        args.push(format!("{key}={}", toml_string(value)));
    }
    if options.skip_git_repo_check {
        args.push("--skip-git-repo-check".into());
    }
    if options.ignore_rules {
        args.push("--ignore-rules".into());
    }
    // A prompt that starts with `-` must not be read as a flag.
    args.push("--".into());
    if let Some(t) = thread {
        args.push(t.to_owned());
    }
    args.push(prompt.to_owned());
    args
}

/// The first `max` characters of `s`, marked when cut.
fn quote(s: &str, max: usize) -> String {
    let mut out: String = s.chars().take(max).collect();
    if out.len() < s.len() {
        out.push_str("...(truncated)");
    }
    out
}

/// `value` as one line of text, at most `max` characters.
fn compact(value: &Value, max: usize) -> String {
    let text = value
        .as_str()
        .map_or_else(|| value.to_string(), str::to_owned);
    quote(&text.split_whitespace().collect::<Vec<_>>().join(" "), max)
}

/// The error text of a `turn.failed` / `error` event.
fn event_error_message(event: &Value) -> String {
    let value = event
        .get("error")
        .filter(|v| !v.is_null())
        .or_else(|| event.get("message").filter(|v| !v.is_null()))
        .unwrap_or(event);
    if let Some(m) = ["message", "error", "detail"]
        .iter()
        .find_map(|k| value.get(*k).filter(|v| !v.is_null()))
    {
        return compact(m, 1200);
    }
    compact(value, 1200)
}

/// The errors among the last events, for an exit message.
fn stream_error_summary(events: &[Value]) -> Option<String> {
    let start = events.len().saturating_sub(20);
    let parts: Vec<String> = events
        .get(start..)
        .unwrap_or(&[])
        .iter()
        .filter_map(|e| match e.get("type").and_then(Value::as_str) {
            Some("turn.failed" | "error") => Some(compact(e, 400)),
            _ => e
                .get("error")
                .filter(|v| !v.is_null() && *v != &Value::Bool(false))
                .map(|err| format!("error={}", compact(err, 400))),
        })
        .collect();
    (!parts.is_empty()).then(|| quote(&parts.join(" | "), 1200))
}

fn count(usage: &Value, key: &str) -> u64 {
    usage.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// What one turn's events amount to.
#[derive(Debug)]
pub struct Converted {
    /// The assistant's message (agent messages joined, reasoning kept).
    pub outputs: Vec<Message>,
    /// Every event, in order.
    pub trace_events: Vec<TraceEvent>,
    /// Codex's own usage (the proxy's counts replace it on commit).
    pub usage: TurnUsage,
    /// The thread the events name.
    pub thread_id: Option<String>,
}

/// Codex's JSONL events → the turn's outputs, as the reference maps them: the completed
/// `agent_message` items joined into one assistant message (reasoning items as its reasoning),
/// command executions, file changes and other tool items counted as tool calls, every event
/// kept as a trace event.
///
/// # Errors
/// A `turn.failed` or `error` event (transport), or no assistant text at all (protocol).
pub fn convert_events(turn_id: &str, events: &[Value]) -> Result<Converted, BackendError> {
    let mut trace_events = Vec::new();
    let mut texts = Vec::new();
    let mut reasoning = Vec::new();
    let mut usage = TurnUsage::default();
    let mut thread_id = None;
    for (seq, event) in (1_u64..).zip(events) {
        let kind = event.get("type").and_then(Value::as_str).unwrap_or("event");
        trace_events.push(TraceEvent {
            turn_id: turn_id.to_owned(),
            seq,
            source: "codex".into(),
            event_type: kind.to_owned(),
            payload: event.as_object().cloned().unwrap_or_default(),
            created_at: Timestamp::now(),
        });
        match kind {
            "thread.started" => {
                if let Some(t) = event.get("thread_id").and_then(Value::as_str) {
                    thread_id = Some(t.to_owned());
                }
            }
            "turn.failed" | "error" => {
                return Err(BackendError::Transport(event_error_message(event)));
            }
            "turn.completed" => {
                let u = event.get("usage").cloned().unwrap_or(Value::Null);
                usage.input_tokens = count(&u, "input_tokens");
                usage.output_tokens = count(&u, "output_tokens");
                usage.reasoning_tokens = count(&u, "reasoning_output_tokens");
                usage.total_tokens = match count(&u, "total_tokens") {
                    0 => usage.input_tokens + usage.output_tokens,
                    n => n,
                };
                usage.steps = usage.steps.max(1);
            }
            "item.completed" => {
                let Some(item) = event.get("item") else {
                    continue;
                };
                let text = ["text", "summary", "content", "message"]
                    .iter()
                    .find_map(|k| item.get(*k).filter(|v| !v.is_null()));
                match item.get("type").and_then(Value::as_str).unwrap_or("") {
                    "agent_message" => {
                        if let Some(t) = item.get("text").filter(|v| !v.is_null()) {
                            texts.push(t.as_str().map_or_else(|| t.to_string(), str::to_owned));
                        }
                    }
                    "reasoning" => {
                        if let Some(t) = text {
                            reasoning.push(t.as_str().map_or_else(|| t.to_string(), str::to_owned));
                        }
                    }
                    "command_execution" | "file_change" | "mcp_tool_call" | "tool_call"
                    | "web_search" => usage.tool_calls += 1,
                    _ => {}
                }
            }
            _ => {}
        }
    }
    if texts.is_empty() {
        return Err(BackendError::Protocol(
            "codex JSONL output contained no assistant output.".into(),
        ));
    }
    if usage.total_tokens == 0 {
        usage.total_tokens = usage.input_tokens + usage.output_tokens;
    }
    Ok(Converted {
        outputs: vec![Message {
            reasoning_content: (!reasoning.is_empty()).then(|| reasoning.join("\n")),
            ..Message::text(Role::Assistant, Some(texts.join("\n")))
        }],
        trace_events,
        usage,
        thread_id,
    })
}

/// Set at initialize.
#[derive(Debug, Clone)]
struct Setup {
    bin: String,
    runtime_dir: PathBuf,
    env: Vec<(String, String)>,
    proxy: LlmProxy,
}

/// The codex backend.
#[derive(Debug)]
pub struct Codex {
    options: Options,
    setup: Mutex<Option<Setup>>,
    /// The committed thread (set when a turn that started it commits).
    thread: Mutex<Option<String>>,
    /// The running turn's process group, for abort (taken out by whoever kills it).
    active: Arc<Mutex<Option<u32>>>,
    /// A turn's process was killed by a signal we did not send: the agent is not
    /// trustworthy any more, and health says so.
    killed: AtomicBool,
    logs: TaskTracker,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn io_err(what: &str, path: &Path, e: &std::io::Error) -> BackendError {
    BackendError::Process(format!("{what} {}: {e}", path.display()))
}

/// `name` as a runnable file: a path as given, else the first hit on `PATH`.
fn resolve_executable(name: &str) -> Option<PathBuf> {
    let runnable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| {
            use std::os::unix::fs::PermissionsExt;
            m.is_file() && m.permissions().mode() & 0o111 != 0
        })
    };
    if name.contains('/') {
        let p = PathBuf::from(name);
        return runnable(&p).then_some(p);
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join(name))
            .find(|p| runnable(p))
    })
}

/// The last `max` bytes of a log, as text.
async fn tail(path: &Path, max: usize) -> Option<String> {
    let data = tokio::fs::read(path).await.ok()?;
    let start = data.len().saturating_sub(max);
    let text = String::from_utf8_lossy(data.get(start..).unwrap_or(&[]))
        .trim()
        .to_owned();
    (!text.is_empty()).then_some(text)
}

/// Kills the process group in `slot` (SIGTERM, then SIGKILL after the grace) and any
/// descendant that left it; whether there was one.
async fn kill_group(slot: &Mutex<Option<u32>>) -> bool {
    let Some(pgid) = lock(slot).take() else {
        return false;
    };
    let tree = proc::descendants(pgid);
    if let Err(e) = proc::signal_group(pgid, Signal::TERM) {
        tracing::warn!(pgid, error = %e, "cannot signal codex's group");
    }
    let alive = || {
        i32::try_from(pgid)
            .ok()
            .and_then(rustix::process::Pid::from_raw)
            .is_some_and(|p| rustix::process::test_kill_process_group(p).is_ok())
    };
    let deadline = tokio::time::Instant::now() + TERM_GRACE;
    while alive() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    super::kill_leftovers(Some(pgid), &tree, "codex");
    true
}

/// The running process's group, published for abort while the turn runs. Dropped after the
/// process was reaped, it only unpublishes; dropped before (the turn's future was abandoned:
/// a cancel, a deadline), it kills the group and what left it, since `kill_on_drop` would
/// reach only the leader.
struct Published<'a> {
    slot: &'a Mutex<Option<u32>>,
    pgid: Option<u32>,
    reaped: bool,
}

impl<'a> Published<'a> {
    fn new(slot: &'a Mutex<Option<u32>>, pgid: Option<u32>) -> Published<'a> {
        *lock(slot) = pgid;
        Published {
            slot,
            pgid,
            reaped: false,
        }
    }
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        {
            let mut slot = lock(self.slot);
            if *slot == self.pgid {
                *slot = None;
            }
        }
        if let (false, Some(pgid)) = (self.reaped, self.pgid) {
            let tree = proc::descendants(pgid);
            super::kill_leftovers(Some(pgid), &tree, "codex");
        }
    }
}

impl Codex {
    /// A backend for `backend_options` (checked now; nothing starts until `initialize`).
    ///
    /// # Errors
    /// When the options do not fit.
    pub fn new(backend_options: &Object) -> Result<Codex, BackendError> {
        Ok(Codex {
            options: Options::parse(backend_options)?,
            setup: Mutex::new(None),
            thread: Mutex::new(None),
            active: Arc::new(Mutex::new(None)),
            killed: AtomicBool::new(false),
            logs: TaskTracker::new(),
        })
    }

    fn setup(&self) -> Result<Setup, BackendError> {
        lock(&self.setup)
            .clone()
            .ok_or_else(|| BackendError::Process("codex adapter has not been initialized.".into()))
    }

    async fn start(&self, ctx: &InitContext) -> Result<(), BackendError> {
        let root = &ctx.runtime_dir;
        let home = root.join("home");
        let codex_home = home.join(".codex");
        let sqlite_home = home.join(".codex-sqlite");
        for d in [
            codex_home.join("log"),
            sqlite_home.clone(),
            root.join("workspace"),
            root.join("logs"),
            root.join("run"),
            root.join("tmp"),
        ] {
            tokio::fs::create_dir_all(&d)
                .await
                .map_err(|e| io_err("cannot create", &d, &e))?;
        }
        let instructions = match &ctx.system_prompt {
            None => None,
            Some(prompt) => {
                let target = PathBuf::from(&prompt.runtime_file);
                if let Some(parent) = target.parent() {
                    tokio::fs::create_dir_all(parent)
                        .await
                        .map_err(|e| io_err("cannot create", parent, &e))?;
                }
                tokio::fs::copy(&prompt.source_file, &target)
                    .await
                    .map_err(|e| io_err("cannot copy the system prompt to", &target, &e))?;
                Some(tokio::fs::read_to_string(&target).await.map_err(|e| {
                    BackendError::Protocol(format!("Could not read Codex system prompt: {e}"))
                })?)
            }
        };
        let base_url = format!("{}{}", ctx.proxy.base_url(), ctx.router_api_path);
        let config = codex_config(&self.options, &base_url, instructions.as_deref());
        let config_path = codex_home.join("config.toml");
        tokio::fs::write(&config_path, config)
            .await
            .map_err(|e| io_err("cannot write", &config_path, &e))?;
        for (name, text) in [
            ("codex.config", config_path.display().to_string()),
            ("proxy.port", ctx.proxy.local_addr().port().to_string()),
        ] {
            let p = root.join("run").join(name);
            tokio::fs::write(&p, text)
                .await
                .map_err(|e| io_err("cannot write", &p, &e))?;
        }
        let bin = self.options.executable(&ctx.bins);
        if resolve_executable(&bin).is_none() {
            return Err(BackendError::Process(format!(
                "codex binary not found. Set CODEX_BIN or install Codex CLI. ({bin})"
            )));
        }
        let mut env: Vec<(String, String)> = std::env::vars()
            .filter(|(k, _)| !STRIPPED_PREFIXES.iter().any(|p| k.starts_with(p)))
            .filter(|(k, _)| !matches!(k.as_str(), "HOME" | "TMPDIR" | "RUST_LOG"))
            .collect();
        let path = |p: &Path| p.display().to_string();
        env.extend([
            ("HOME".into(), path(&home)),
            ("CODEX_HOME".into(), path(&codex_home)),
            ("CODEX_SQLITE_HOME".into(), path(&sqlite_home)),
            ("TMPDIR".into(), path(&root.join("tmp"))),
            // Codex's own logging goes to stderr; only errors matter there. The server's
            // RUST_LOG is for the server, not for Codex.
            ("RUST_LOG".into(), "error".into()),
            (PROVIDER_KEY_ENV.into(), "dressage-proxy".into()),
        ]);
        *lock(&self.setup) = Some(Setup {
            bin,
            runtime_dir: root.clone(),
            env,
            proxy: ctx.proxy.clone(),
        });
        Ok(())
    }

    /// Runs one `codex exec` to its end: the events it printed, or why it failed.
    async fn run_process(
        &self,
        setup: &Setup,
        thread: Option<&str>,
        prompt: &str,
        turn_id: &str,
    ) -> Result<Vec<Value>, BackendError> {
        let root = &setup.runtime_dir;
        let logs = root.join("logs");
        let args = exec_args(&self.options, &root.join("home/.codex/log"), thread, prompt);
        let mut cmd = tokio::process::Command::new(&setup.bin);
        cmd.args(&args)
            .current_dir(root.join("workspace"))
            .env_clear()
            .envs(setup.env.iter().map(|(k, v)| (k, v)))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let mut child = ChildSetup::same_identity()
            .new_session()
            .spawn(cmd)
            .map_err(|e| {
                BackendError::Process(format!(
                    "codex could not be started. Set CODEX_BIN or install Codex CLI. ({}: {e})",
                    setup.bin
                ))
            })?;
        let pgid = child.id();
        let mut published = Published::new(&self.active, pgid);
        if let Some(pid) = pgid {
            let p = root.join("run/codex.pid");
            if let Err(e) = tokio::fs::write(&p, pid.to_string()).await {
                tracing::warn!(error = %e, "cannot write codex.pid");
            }
        }
        let stderr_log = logs.join("codex.stderr.log");
        if let Some(err) = child.stderr.take() {
            let file = tokio::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&stderr_log)
                .await
                .map_err(|e| io_err("cannot open", &stderr_log, &e))?;
            self.logs.spawn(proc::capture(err, file, Some(64 << 20)));
        }
        let stdout_log = logs.join("codex.stdout.log");
        let mut log = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&stdout_log)
            .await
            .map_err(|e| io_err("cannot open", &stdout_log, &e))?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| BackendError::Process("codex has no stdout".into()))?;
        let mut reader = BufReader::new(stdout);
        let mut events = Vec::new();
        let mut line = Vec::new();
        let mut bad = None;
        loop {
            line.clear();
            let n = match (&mut reader)
                .take(MAX_LINE)
                .read_until(b'\n', &mut line)
                .await
            {
                Ok(n) => n,
                Err(e) => {
                    bad = Some(format!("cannot read codex's output: {e}"));
                    break;
                }
            };
            if n == 0 {
                break;
            }
            let _ = log.write_all(&line).await;
            if !line.ends_with(b"\n") && n as u64 >= MAX_LINE {
                bad = Some(format!(
                    "invalid codex JSONL: a line longer than {MAX_LINE} bytes; line={}",
                    quote(&String::from_utf8_lossy(&line), QUOTE)
                ));
                break;
            }
            let text = String::from_utf8_lossy(&line);
            let text = text.trim();
            if text.is_empty() {
                continue;
            }
            match serde_json::from_str::<Value>(text) {
                Ok(event) if event.is_object() => {
                    if event.get("type").and_then(Value::as_str) == Some("thread.started")
                        && let Some(t) = event.get("thread_id").and_then(Value::as_str)
                    {
                        // The proxy tags this turn's calls with the thread from now on.
                        setup.proxy.update_turn_backend_session(t).await;
                    }
                    events.push(event);
                }
                Ok(other) => {
                    bad = Some(format!(
                        "invalid codex JSONL event type: {}; line={}",
                        json_kind(&other),
                        quote(text, QUOTE)
                    ));
                    break;
                }
                Err(e) => {
                    bad = Some(format!(
                        "invalid codex JSONL: {e}; line={}",
                        quote(text, QUOTE)
                    ));
                    break;
                }
            }
        }
        let _ = log.flush().await;
        if let Some(why) = bad {
            kill_group(&self.active).await;
            let _ = child.wait().await;
            published.reaped = true;
            return Err(BackendError::Transport(why));
        }
        let status = child
            .wait()
            .await
            .map_err(|e| BackendError::Process(format!("cannot wait for codex: {e}")))?;
        published.reaped = true;
        // Still published: nobody on our side ended it.
        let ours = *lock(&self.active) != pgid;
        if let Some(sig) = std::os::unix::process::ExitStatusExt::signal(&status)
            && !ours
        {
            self.killed.store(true, Ordering::SeqCst);
            return Err(BackendError::Process(format!(
                "codex was killed by signal {sig}"
            )));
        }
        let code = proc::exit_code(status);
        if code != Some(0) {
            // Let the stderr copy catch up before quoting it.
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut parts = vec![match code {
                Some(c) => format!("codex exited with code {c}"),
                None => format!("codex was killed ({status})"),
            }];
            if let Some(s) = stream_error_summary(&events) {
                parts.push(format!("jsonl error: {s}"));
            }
            if let Some(t) = tail(&stderr_log, 2000).await {
                parts.push(format!("stderr tail: {t}"));
            }
            if let Some(t) = tail(&stdout_log, 2000).await {
                parts.push(format!("stdout tail: {t}"));
            }
            tracing::warn!(turn_id, "{}", parts.join("; "));
            return Err(BackendError::Transport(parts.join("; ")));
        }
        Ok(events)
    }

    /// The proxy's recorded refusals that explain a failed or finished turn.
    async fn proxy_errors(proxy: &LlmProxy) -> Result<(), BackendError> {
        if let Some(payload) = proxy.consume_context_overflow_error().await
            && let Some(e) = BackendError::from_context_overflow(&payload)
        {
            return Err(e);
        }
        if let Some(payload) = proxy.consume_rollout_invalidated_error().await {
            let code = payload
                .get("error")
                .and_then(Value::as_str)
                .unwrap_or("rollout_invalidated");
            let msg = payload
                .get("message")
                .and_then(Value::as_str)
                .unwrap_or("Dressage rollout was invalidated.");
            return Err(BackendError::Transport(format!(
                "Dressage proxy {code}: {msg}"
            )));
        }
        Ok(())
    }

    async fn turn(&self, turn: TurnInput<'_>) -> Result<AdapterResponse, BackendError> {
        let setup = self.setup()?;
        if resolve_executable(&setup.bin).is_none() {
            return Err(BackendError::Process(
                "codex backend is not healthy.".into(),
            ));
        }
        let [message] = turn.messages else {
            return Err(BackendError::Protocol(
                "codex adapter expects exactly one input message.".into(),
            ));
        };
        if message.role != Role::User {
            return Err(BackendError::Protocol(
                "codex adapter only accepts a user message.".into(),
            ));
        }
        let prompt = message
            .content
            .as_deref()
            .filter(|c| !c.trim().is_empty())
            .ok_or_else(|| {
                BackendError::Protocol("codex adapter requires non-empty user content.".into())
            })?;
        let thread = lock(&self.thread).clone();
        let events = match self
            .run_process(&setup, thread.as_deref(), prompt, turn.turn_id)
            .await
        {
            Ok(events) => events,
            Err(e) => {
                Self::proxy_errors(&setup.proxy).await?;
                if let Some(p) = setup.proxy.consume_failed_upstream_error().await
                    && let Some(m) = p.get("message").and_then(Value::as_str)
                {
                    return Err(BackendError::Transport(format!("{e}; upstream error: {m}")));
                }
                return Err(e);
            }
        };
        let converted = convert_events(turn.turn_id, &events)?;
        let session_id =
            converted.thread_id.clone().or(thread).ok_or_else(|| {
                BackendError::Protocol("codex JSONL output named no thread.".into())
            })?;
        // Codex has exited; the proxy may still be finishing the last call's bookkeeping.
        setup.proxy.drain_turn(None).await;
        Self::proxy_errors(&setup.proxy).await?;
        *lock(&self.thread) = Some(session_id.clone());
        Ok(AdapterResponse {
            outputs: converted.outputs,
            trace_events: converted.trace_events,
            usage: converted.usage,
            backend_session_id: session_id,
        })
    }

    async fn stop(&self) {
        kill_group(&self.active).await;
        super::close_logs(&self.logs, "codex").await;
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "bool",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

impl Backend for Codex {
    fn capabilities(&self) -> BackendCapabilities {
        CAPABILITIES
    }

    fn initialize<'a>(&'a self, ctx: &'a InitContext) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(self.start(ctx))
    }

    fn send_message<'a>(
        &'a self,
        turn: TurnInput<'a>,
    ) -> BoxFuture<'a, Result<AdapterResponse, BackendError>> {
        Box::pin(self.turn(turn))
    }

    fn abort_session(&self) -> BoxFuture<'_, bool> {
        Box::pin(kill_group(&self.active))
    }

    fn health(&self) -> BoxFuture<'_, bool> {
        Box::pin(async move {
            !self.killed.load(Ordering::SeqCst)
                && lock(&self.setup)
                    .as_ref()
                    .is_some_and(|s| resolve_executable(&s.bin).is_some())
        })
    }

    fn backend_session_id(&self) -> Option<String> {
        lock(&self.thread).clone()
    }

    fn shutdown(&self, _grace: Duration) -> BoxFuture<'_, ()> {
        Box::pin(self.stop())
    }
}

/// codex's capabilities: one user message per turn, a register-time system prompt.
pub const CAPABILITIES: BackendCapabilities = BackendCapabilities {
    chat: true,
    abort: true,
    pause_resume: true,
    stream: false,
    multi_message_input: false,
    system_message: true,
    history_injection: false,
};

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn options_default_like_the_reference_and_refuse_unknown_keys() {
        let o = Options::parse(&Object::new()).unwrap();
        assert_eq!(o.model.id, "proxy-model");
        assert_eq!(o.model_provider_id, "dressage_proxy");
        assert_eq!(o.sandbox_mode, SandboxMode::DangerFullAccess);
        assert_eq!(o.approval_policy, ApprovalPolicy::Never);
        assert_eq!(o.web_search, WebSearch::Disabled);
        assert!(o.skip_git_repo_check && o.ignore_rules);
        let bad = crate::error::obj(json!({"unknown": true}));
        let msg = Options::parse(&bad).unwrap_err().to_string();
        assert!(msg.starts_with("Invalid codex backend_options"), "{msg}");
        let bad = crate::error::obj(json!({"model_provider_id": "a.b"}));
        assert!(Options::parse(&bad).is_err());
        let bad = crate::error::obj(json!({"sandbox_mode": "yolo"}));
        assert!(Options::parse(&bad).is_err());
        let o = Options::parse(&crate::error::obj(
            json!({"sandbox_mode": "read-only", "approval_policy": "on-request"}),
        ))
        .unwrap();
        assert_eq!(
            (o.sandbox_mode.as_str(), o.approval_policy.as_str()),
            ("read-only", "on-request")
        );
    }

    #[test]
    fn config_points_the_provider_at_the_proxy_responses_endpoint() {
        let o = Options::parse(&Object::new()).unwrap();
        let c = codex_config(&o, "http://127.0.0.1:4567/v1", Some("line 1\n\"two\""));
        for want in [
            "model = \"proxy-model\"",
            "model_provider = \"dressage_proxy\"",
            "approval_policy = \"never\"",
            "sandbox_mode = \"danger-full-access\"",
            "web_search = \"disabled\"",
            "developer_instructions = \"line 1\\n\\\"two\\\"\"",
            "[model_providers.dressage_proxy]",
            "base_url = \"http://127.0.0.1:4567/v1\"",
            "wire_api = \"responses\"",
            "env_key = \"DRESSAGE_PROXY_API_KEY\"",
        ] {
            assert!(c.contains(want), "{want} missing from\n{c}");
        }
        // Top-level keys must precede the first table.
        let first_table = c.find('[').unwrap();
        assert!(c.find("developer_instructions").unwrap() < first_table);
    }

    #[test]
    fn resume_takes_the_thread_and_no_sandbox_flag() {
        let o = Options::parse(&Object::new()).unwrap();
        let first = exec_args(&o, Path::new("/r/log"), None, "-do it");
        assert_eq!(first[..2], ["exec", "--json"]);
        assert_eq!(first[first.len() - 2..], ["--", "-do it"]);
        let again = exec_args(&o, Path::new("/r/log"), Some("th-1"), "more");
        assert_eq!(again[..3], ["exec", "resume", "--json"]);
        assert_eq!(again[again.len() - 3..], ["--", "th-1", "more"]);
        assert!(!again.iter().any(|a| a == "--sandbox" || a == "-s"));
        assert!(again.contains(&"sandbox_mode=\"danger-full-access\"".to_owned()));
    }

    #[test]
    fn events_convert_as_the_reference() {
        let events = vec![
            json!({"type": "thread.started", "thread_id": "th-1"}),
            json!({"type": "turn.started"}),
            json!({"type": "item.completed", "item": {"type": "reasoning", "text": "think"}}),
            json!({"type": "item.completed", "item": {"type": "command_execution", "command": "ls"}}),
            json!({"type": "item.completed", "item": {"type": "file_change", "changes": []}}),
            json!({"type": "item.completed", "item": {"type": "agent_message", "text": "a"}}),
            json!({"type": "item.completed", "item": {"type": "agent_message", "text": "b"}}),
            json!({"type": "turn.completed", "usage": {"input_tokens": 10, "output_tokens": 5,
                   "reasoning_output_tokens": 2}}),
        ];
        let c = convert_events("t1", &events).unwrap();
        assert_eq!(c.thread_id.as_deref(), Some("th-1"));
        assert_eq!(c.outputs.len(), 1);
        assert_eq!(c.outputs[0].content.as_deref(), Some("a\nb"));
        assert_eq!(c.outputs[0].reasoning_content.as_deref(), Some("think"));
        assert_eq!(c.trace_events.len(), 8);
        assert_eq!(
            (
                c.usage.total_tokens,
                c.usage.reasoning_tokens,
                c.usage.tool_calls,
                c.usage.steps
            ),
            (15, 2, 2, 1)
        );
        let failed = [json!({"type": "turn.failed", "error": {"message": "boom"}})];
        let e = convert_events("t", &failed).unwrap_err();
        assert!(
            matches!(&e, BackendError::Transport(m) if m == "boom"),
            "{e:?}"
        );
        let silent = [json!({"type": "turn.completed"})];
        assert!(matches!(
            convert_events("t", &silent),
            Err(BackendError::Protocol(_))
        ));
    }

    #[test]
    fn quotes_are_truncated_and_marked() {
        let long = "x".repeat(3000);
        let q = quote(&long, QUOTE);
        assert!(q.len() < 1100 && q.ends_with("...(truncated)"));
        assert_eq!(quote("short", QUOTE), "short");
    }
}
