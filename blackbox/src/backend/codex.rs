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

use serde::Deserialize;
use serde_json::Value;

use super::agent::{self, Agent, Cli, PerTurn, TurnOptions, lock, quote};
use super::{BackendError, InitContext, TurnInput};
use crate::model::{
    AdapterResponse, Message, Object, ProxyOptions, Role, Timestamp, TraceEvent, TurnUsage,
};
use crate::proxy::LlmProxy;

/// How the files, logs and errors name Codex.
const CLI: Cli = Cli {
    name: "codex",
    label: "codex",
    hint: "Set CODEX_BIN or install Codex CLI.",
};

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
        let invalid = |why: String| agent::invalid_options("codex", &why);
        let options: Options = agent::parse_options(raw, "codex")?;
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

impl TurnOptions for Options {
    const CLI: Cli = CLI;
    type Setup = Setup;
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
pub(crate) struct Setup {
    bin: String,
    runtime_dir: PathBuf,
    home: PathBuf,
    proxy: LlmProxy,
}

/// The codex backend; its session id is the committed thread (set when a turn that started
/// it commits).
pub(crate) type Codex = PerTurn<Options>;

impl Codex {
    /// `codex exec` for one turn, in an environment without inherited Codex/OpenAI settings.
    fn command(
        &self,
        setup: &Setup,
        thread: Option<&str>,
        prompt: &str,
    ) -> tokio::process::Command {
        let root = &setup.runtime_dir;
        let args = exec_args(&self.options, &root.join("home/.codex/log"), thread, prompt);
        let mut cmd = tokio::process::Command::new(&setup.bin);
        agent::strip_inherited(&mut cmd, STRIPPED_PREFIXES);
        cmd.args(&args)
            .current_dir(root.join("workspace"))
            .env("HOME", &setup.home)
            .env("CODEX_HOME", setup.home.join(".codex"))
            .env("CODEX_SQLITE_HOME", setup.home.join(".codex-sqlite"))
            .env("TMPDIR", root.join("tmp"))
            // Codex's own logging goes to stderr; only errors matter there. The server's
            // RUST_LOG is for the server, not for Codex.
            .env("RUST_LOG", "error")
            .env(PROVIDER_KEY_ENV, "dressage-proxy");
        cmd
    }
}

impl Agent for Codex {
    fn session_id(&self) -> Option<String> {
        lock(&self.session).clone()
    }

    async fn start(&self, ctx: &InitContext) -> Result<(), BackendError> {
        let root = &ctx.runtime_dir;
        let home = root.join("home");
        let codex_home = home.join(".codex");
        agent::create_dirs(&[
            codex_home.join("log"),
            home.join(".codex-sqlite"),
            root.join("workspace"),
            root.join("logs"),
            root.join("run"),
            root.join("tmp"),
        ])
        .await?;
        let instructions = agent::install_system_prompt(ctx.system_prompt.as_ref()).await?;
        let base_url = format!("{}{}", ctx.proxy.base_url(), ctx.router_api_path);
        let config = codex_config(&self.options, &base_url, instructions.as_deref());
        let config_path = codex_home.join("config.toml");
        agent::write_files(&codex_home, &[("config.toml", config)]).await?;
        agent::write_files(
            &root.join("run"),
            &[
                ("codex.config", config_path.display().to_string()),
                ("proxy.port", ctx.proxy.local_addr().port().to_string()),
            ],
        )
        .await?;
        let bin = self.options.executable(&ctx.bins);
        CLI.require(&bin)?;
        self.process.set_bin(&bin);
        *lock(&self.setup) = Some(Setup {
            bin,
            runtime_dir: root.clone(),
            home,
            proxy: ctx.proxy.clone(),
        });
        Ok(())
    }

    async fn turn(&self, turn: TurnInput<'_>) -> Result<AdapterResponse, BackendError> {
        let setup = agent::started(&self.setup, "codex")?;
        if agent::resolve_executable(&setup.bin).is_none() {
            return Err(BackendError::Process(
                "codex backend is not healthy.".into(),
            ));
        }
        let prompt = agent::single_prompt(turn.messages, "codex")?;
        let thread = lock(&self.session).clone();
        let proxy = setup.proxy.clone();
        let ran = self
            .process
            .run(
                &CLI,
                self.command(&setup, thread.as_deref(), prompt),
                &setup.runtime_dir,
                None,
                |event| {
                    let started = (event.get("type").and_then(Value::as_str)
                        == Some("thread.started"))
                    .then(|| event.get("thread_id").and_then(Value::as_str))
                    .flatten()
                    .map(str::to_owned);
                    let proxy = proxy.clone();
                    async move {
                        // The proxy tags this turn's calls with the thread from now on.
                        if let Some(t) = started {
                            proxy.update_turn_backend_session(&t).await;
                        }
                    }
                },
                |events, exit| agent::exit_message(CLI.name, &exit, stream_error_summary(events)),
            )
            .await;
        let events = match ran {
            Ok(events) => events,
            Err(e) => {
                agent::proxy_errors(&setup.proxy).await?;
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
        agent::proxy_errors(&setup.proxy).await?;
        *lock(&self.session) = Some(session_id.clone());
        Ok(AdapterResponse {
            outputs: converted.outputs,
            trace_events: converted.trace_events,
            usage: converted.usage,
            backend_session_id: session_id,
        })
    }
}

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
}
