//! The Claude Code backend: one `claude -p --output-format stream-json --verbose` process per
//! turn, the prompt on its stdin, in the registration's runtime directory (its own `HOME`,
//! `CLAUDE_CONFIG_DIR` and temp dir, a `settings.json` we write) with `ANTHROPIC_BASE_URL` at
//! the in-process proxy, which serves `/v1/messages` and sends every call upstream as chat.
//!
//! The agent's session id is derived from the bound instance and session, so a restarted
//! server resumes the same conversation: the first turn passes `--session-id`, later ones
//! (once Claude Code has stored the session) `--resume`. Outputs come from the stream's
//! `assistant` and `user` (tool result) events; the usage it reports is counted once per
//! message id (every content block repeats it), though the core replaces it with the proxy's
//! own counts.
//!
//! Each process leads its own process group; abort and shutdown end the group and whatever
//! left it. Health is the binary being runnable and the last turn's process not having been
//! killed behind our back.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use serde_json::{Value, json};
use sha2::Digest;

use super::agent::{self, Agent, Cli, PerTurn, TurnOptions, lock, quote, value_text};
use super::{BackendError, InitContext, TurnInput};
use crate::model::{
    AdapterResponse, FunctionCall, Message, Object, ProxyOptions, Role, Timestamp, ToolCall,
    ToolCallType, TraceEvent, TurnUsage,
};

/// How the files, logs and errors name Claude Code.
const CLI: Cli = Cli {
    name: "claude_code",
    label: "claude code",
    hint: "Set CLAUDE_CODE_BIN or install Claude Code.",
};

/// How much of an error event an exit message quotes.
const QUOTE: usize = 400;

/// Variables of the server's environment the agent must not see: credentials and endpoints of
/// a real Anthropic account, and state directories that would escape the runtime directory.
const INHERITED_PREFIXES: &[&str] = &["ANTHROPIC_", "CLAUDE_", "CLAUDECODE"];

fn default_model_id() -> String {
    "proxy-model".into()
}
fn default_model_name() -> String {
    "Dressage Proxy".into()
}
fn default_capabilities() -> Vec<String> {
    ["thinking", "adaptive_thinking", "interleaved_thinking"]
        .map(str::to_owned)
        .to_vec()
}
fn default_max_turns() -> u64 {
    20
}
fn default_setting_sources() -> String {
    "user".into()
}
fn default_token() -> String {
    "blackbox-local".into()
}
fn yes() -> bool {
    true
}

/// `model`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelOptions {
    /// `--model` and the custom model option.
    #[serde(default = "default_model_id")]
    pub id: String,
    /// Its display name.
    #[serde(default = "default_model_name")]
    pub name: String,
    /// `ANTHROPIC_CUSTOM_MODEL_OPTION_SUPPORTED_CAPABILITIES`.
    #[serde(default = "default_capabilities")]
    pub supported_capabilities: Vec<String>,
}

impl Default for ModelOptions {
    fn default() -> Self {
        ModelOptions {
            id: default_model_id(),
            name: default_model_name(),
            supported_capabilities: default_capabilities(),
        }
    }
}

/// `gateway`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayOptions {
    /// `ANTHROPIC_AUTH_TOKEN` (the proxy does not check it; the router might).
    #[serde(default = "default_token")]
    pub auth_token: String,
}

impl Default for GatewayOptions {
    fn default() -> Self {
        GatewayOptions {
            auth_token: default_token(),
        }
    }
}

/// `thinking`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThinkingOptions {
    /// Extended thinking.
    #[serde(default = "yes")]
    pub enabled: bool,
    /// Interleaved thinking.
    #[serde(default = "yes")]
    pub interleaved: bool,
    /// `MAX_THINKING_TOKENS` (`> 0`).
    #[serde(default)]
    pub budget_tokens: Option<u64>,
}

impl Default for ThinkingOptions {
    fn default() -> Self {
        ThinkingOptions {
            enabled: true,
            interleaved: true,
            budget_tokens: None,
        }
    }
}

/// `compaction`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompactionOptions {
    /// `autoCompactEnabled`.
    #[serde(default = "yes")]
    pub auto: bool,
    /// `CLAUDE_AUTOCOMPACT_PCT_OVERRIDE` (1..=100).
    #[serde(default)]
    pub auto_compact_pct_override: Option<u64>,
}

impl Default for CompactionOptions {
    fn default() -> Self {
        CompactionOptions {
            auto: true,
            auto_compact_pct_override: None,
        }
    }
}

/// `compat`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CompatOptions {
    /// `DISABLE_PROMPT_CACHING`.
    #[serde(default = "yes")]
    pub disable_prompt_caching: bool,
    /// `CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC`.
    #[serde(default = "yes")]
    pub disable_nonessential_traffic: bool,
}

impl Default for CompatOptions {
    fn default() -> Self {
        CompatOptions {
            disable_prompt_caching: true,
            disable_nonessential_traffic: true,
        }
    }
}

/// `subagents`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubagentsOptions {
    /// Whether the `Agent` tool is allowed.
    #[serde(default)]
    pub enabled: bool,
}

/// `--permission-mode`. The reference's `default` is not a choice of the pinned CLI (it calls
/// it `manual`); both are accepted and sent as `manual`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
pub enum PermissionMode {
    /// `acceptEdits`.
    #[serde(rename = "acceptEdits")]
    AcceptEdits,
    /// `auto`.
    #[serde(rename = "auto")]
    Auto,
    /// `bypassPermissions`: the default, since the agent runs inside our sandbox and a
    /// permission prompt would wait for a human forever.
    #[default]
    #[serde(rename = "bypassPermissions")]
    BypassPermissions,
    /// `default` (the reference's name for `manual`).
    #[serde(rename = "default")]
    Default,
    /// `manual`.
    #[serde(rename = "manual")]
    Manual,
    /// `dontAsk`.
    #[serde(rename = "dontAsk")]
    DontAsk,
    /// `plan`.
    #[serde(rename = "plan")]
    Plan,
}

impl PermissionMode {
    /// The CLI's spelling.
    #[must_use]
    pub fn as_cli(self) -> &'static str {
        match self {
            PermissionMode::AcceptEdits => "acceptEdits",
            PermissionMode::Auto => "auto",
            PermissionMode::BypassPermissions => "bypassPermissions",
            PermissionMode::Default | PermissionMode::Manual => "manual",
            PermissionMode::DontAsk => "dontAsk",
            PermissionMode::Plan => "plan",
        }
    }
}

/// What the registration's system prompt becomes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SystemPromptMode {
    /// `--append-system-prompt`.
    #[default]
    Append,
    /// `--system-prompt` (replaces Claude Code's own).
    Replace,
    /// Written to the workspace's `CLAUDE.md`.
    ClaudeMd,
    /// Ignored.
    None,
}

/// Claude Code's `backend_options` (unknown keys refused, as the reference does).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Options {
    /// The binary (over `CLAUDE_CODE_BIN`).
    #[serde(default)]
    pub executable: Option<String>,
    /// The agent's working directory (default `<runtime_dir>/workspace`).
    #[serde(default)]
    pub working_directory: Option<String>,
    /// The model it is told to use.
    #[serde(default)]
    pub model: ModelOptions,
    /// `--max-turns` (`> 0`).
    #[serde(default = "default_max_turns")]
    pub max_turns: u64,
    /// `--permission-mode`.
    #[serde(default)]
    pub permission_mode: PermissionMode,
    /// `--setting-sources`.
    #[serde(default = "default_setting_sources")]
    pub setting_sources: String,
    /// How the system prompt is given.
    #[serde(default)]
    pub system_prompt_mode: SystemPromptMode,
    /// The token the agent sends.
    #[serde(default)]
    pub gateway: GatewayOptions,
    /// Thinking settings.
    #[serde(default)]
    pub thinking: ThinkingOptions,
    /// Compaction settings.
    #[serde(default)]
    pub compaction: CompactionOptions,
    /// Offline switches.
    #[serde(default)]
    pub compat: CompatOptions,
    /// Subagents.
    #[serde(default)]
    pub subagents: SubagentsOptions,
    /// The proxy's options (parsed by the server too).
    #[serde(default)]
    pub proxy: ProxyOptions,
}

impl Options {
    /// Parses and range-checks `backend_options`.
    ///
    /// # Errors
    /// `Invalid claude_code backend_options: <why>`.
    pub fn parse(raw: &Object) -> Result<Options, BackendError> {
        let invalid = |why: String| agent::invalid_options("claude_code", &why);
        let options: Options = agent::parse_options(raw, "claude_code")?;
        if options.max_turns == 0 {
            return Err(invalid("max_turns: Input should be greater than 0".into()));
        }
        if options.thinking.budget_tokens == Some(0) {
            return Err(invalid(
                "thinking.budget_tokens: Input should be greater than 0".into(),
            ));
        }
        if let Some(p) = options.compaction.auto_compact_pct_override
            && !(1..=100).contains(&p)
        {
            return Err(invalid(
                "compaction.auto_compact_pct_override: Input should be between 1 and 100".into(),
            ));
        }
        for (name, v) in [
            ("model.id", &options.model.id),
            ("model.name", &options.model.name),
        ] {
            if v.is_empty() {
                return Err(invalid(format!(
                    "{name}: String should have at least 1 character"
                )));
            }
        }
        Ok(options)
    }
}

impl TurnOptions for Options {
    const CLI: Cli = CLI;
    type Setup = Setup;
}

/// The `settings.json` Claude Code reads (`--settings`).
fn settings(options: &Options) -> Value {
    let mut env = serde_json::Map::new();
    let mut set = |k: &str, v: String| {
        env.insert(k.to_owned(), Value::String(v));
    };
    if options.compat.disable_prompt_caching {
        set("DISABLE_PROMPT_CACHING", "1".into());
    }
    if options.compat.disable_nonessential_traffic {
        set("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1".into());
    }
    if !options.thinking.enabled {
        set("CLAUDE_CODE_DISABLE_THINKING", "1".into());
        set("MAX_THINKING_TOKENS", "0".into());
    } else if let Some(b) = options.thinking.budget_tokens {
        set("MAX_THINKING_TOKENS", b.to_string());
    }
    if !options.thinking.interleaved {
        set("DISABLE_INTERLEAVED_THINKING", "1".into());
    }
    if let Some(p) = options.compaction.auto_compact_pct_override {
        set("CLAUDE_AUTOCOMPACT_PCT_OVERRIDE", p.to_string());
    }
    let deny: Vec<&str> = if options.subagents.enabled {
        Vec::new()
    } else {
        vec!["Agent"]
    };
    json!({
        "autoCompactEnabled": options.compaction.auto,
        "permissions": {
            "allow": ["Bash(*)", "Read(*)", "Edit(*)", "Write(*)", "WebSearch", "WebFetch",
                      "Glob", "Grep", "LS", "NotebookRead", "NotebookEdit", "TodoWrite", "Task"],
            "deny": deny,
        },
        "env": env,
    })
}

/// The agent's session id for a bound instance and session: a UUID from SHA-256 of
/// `instance:session` (version nibble 8, "custom", RFC 9562), stable across restarts.
#[must_use]
pub fn session_uuid(bound_instance_id: &str, bound_session_id: &str) -> String {
    let digest = sha2::Sha256::digest(format!("{bound_instance_id}:{bound_session_id}"));
    let mut b = [0_u8; 16];
    b.copy_from_slice(&digest[..16]);
    b[6] = (b[6] & 0x0f) | 0x80;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// Everything a turn needs, fixed at initialize.
#[derive(Debug, Clone)]
pub(crate) struct Setup {
    bin: String,
    runtime_dir: PathBuf,
    home: PathBuf,
    config_dir: PathBuf,
    workspace: PathBuf,
    settings_path: PathBuf,
    /// The prompt text for `--append-system-prompt` / `--system-prompt`.
    system_prompt: Option<String>,
    base_url: String,
    router_timeout_ms: u64,
    session_uuid: String,
}

/// The Claude Code backend; its session id is set once a turn ran with it.
pub(crate) type ClaudeCode = PerTurn<Options>;

impl ClaudeCode {
    /// Whether Claude Code has stored session `id` (a turn ran with it, even one that failed
    /// after it started): then it must be resumed, as `--session-id` would be refused.
    fn session_stored(config_dir: &Path, id: &str) -> bool {
        let file = format!("{id}.jsonl");
        std::fs::read_dir(config_dir.join("projects")).is_ok_and(|dirs| {
            dirs.filter_map(Result::ok)
                .any(|d| d.path().join(&file).is_file())
        })
    }

    fn command(&self, s: &Setup) -> tokio::process::Command {
        let o = &self.options;
        let mut cmd = tokio::process::Command::new(&s.bin);
        cmd.args(["-p", "--output-format", "stream-json", "--verbose"])
            .args(["--model", &o.model.id])
            .args(["--max-turns", &o.max_turns.to_string()])
            .args(["--permission-mode", o.permission_mode.as_cli()])
            .arg("--settings")
            .arg(&s.settings_path)
            .args(["--setting-sources", &o.setting_sources]);
        if Self::session_stored(&s.config_dir, &s.session_uuid) {
            cmd.args(["--resume", &s.session_uuid]);
        } else {
            cmd.args(["--session-id", &s.session_uuid]);
        }
        match (&s.system_prompt, o.system_prompt_mode) {
            (Some(p), SystemPromptMode::Append) => {
                cmd.args(["--append-system-prompt", p]);
            }
            (Some(p), SystemPromptMode::Replace) => {
                cmd.args(["--system-prompt", p]);
            }
            (
                None,
                SystemPromptMode::Append
                | SystemPromptMode::Replace
                | SystemPromptMode::ClaudeMd
                | SystemPromptMode::None,
            )
            | (Some(_), SystemPromptMode::ClaudeMd | SystemPromptMode::None) => {}
        }
        agent::strip_inherited(&mut cmd, INHERITED_PREFIXES);
        cmd.current_dir(&s.workspace)
            .env("HOME", &s.home)
            .env("CLAUDE_CONFIG_DIR", &s.config_dir)
            .env("CLAUDE_CODE_TMPDIR", s.runtime_dir.join("tmp"))
            .env("TMPDIR", s.runtime_dir.join("tmp"))
            .env("ANTHROPIC_BASE_URL", &s.base_url)
            .env("ANTHROPIC_AUTH_TOKEN", &o.gateway.auth_token)
            .env("ANTHROPIC_CUSTOM_MODEL_OPTION", &o.model.id)
            .env("ANTHROPIC_CUSTOM_MODEL_OPTION_NAME", &o.model.name)
            .env(
                "ANTHROPIC_CUSTOM_MODEL_OPTION_SUPPORTED_CAPABILITIES",
                o.model.supported_capabilities.join(","),
            )
            .env("API_TIMEOUT_MS", s.router_timeout_ms.to_string())
            // A sandbox has no internet: no telemetry, error reports, update checks or other
            // traffic that is not a model call.
            .env("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1")
            .env("DISABLE_TELEMETRY", "1")
            .env("DISABLE_ERROR_REPORTING", "1")
            .env("DISABLE_AUTOUPDATER", "1")
            .env("DISABLE_BUG_COMMAND", "1");
        if o.permission_mode == PermissionMode::BypassPermissions {
            // As root, Claude Code refuses to bypass permissions unless told it is sandboxed,
            // which it is: bubblewrap around us, the proxy between it and any model.
            cmd.env("IS_SANDBOX", "1");
        }
        cmd
    }
}

/// The stream's error events (the last 20 events'), for an exit message.
fn stream_errors(events: &[Value]) -> Option<String> {
    let errors: Vec<String> = events
        .iter()
        .rev()
        .take(20)
        .rev()
        .filter_map(|e| {
            let kind = e.get("type").and_then(Value::as_str).unwrap_or("");
            if kind == "result" && e.get("is_error").and_then(Value::as_bool) == Some(true) {
                let v = e.get("result").or_else(|| e.get("error")).unwrap_or(e);
                return Some(format!("result={}", quote(&value_text(v), QUOTE)));
            }
            (kind == "error").then(|| quote(&e.to_string(), QUOTE))
        })
        .collect();
    (!errors.is_empty()).then(|| errors.join(" | "))
}

fn num(v: &Value, key: &str) -> u64 {
    v.get(key).and_then(Value::as_u64).unwrap_or(0)
}

/// A `tool_result` block's content as text.
fn tool_result_text(content: Option<&Value>) -> String {
    match content {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(blocks)) => blocks
            .iter()
            .filter_map(|b| b.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        Some(other) => other.to_string(),
    }
}

/// Stream-json events → chat messages, trace events and usage. Content blocks of one model
/// answer arrive as separate `assistant` events sharing the message id: they become one
/// assistant message, and the usage each repeats counts once. Tool results (`user` events)
/// follow as `tool` messages.
///
/// # Errors
/// A `result` event with `is_error`, or a stream with no assistant output.
pub fn convert_events(
    turn_id: &str,
    events: &[Value],
) -> Result<(Vec<Message>, Vec<TraceEvent>, TurnUsage), BackendError> {
    let mut outputs: Vec<Message> = Vec::new();
    let mut trace = Vec::new();
    let mut usage_by_id: HashMap<String, Value> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    let mut last_assistant_id: Option<String> = None;
    let mut result_text = None;
    let mut num_turns = 0;
    let mut tool_calls = 0;
    for (seq, event) in (1_u64..).zip(events) {
        let kind = event.get("type").and_then(Value::as_str).unwrap_or("event");
        trace.push(TraceEvent {
            turn_id: turn_id.to_owned(),
            seq,
            source: "claude_code".into(),
            event_type: kind.to_owned(),
            payload: event.as_object().cloned().unwrap_or_default(),
            created_at: Timestamp::now(),
        });
        match kind {
            "result" => {
                if event.get("is_error").and_then(Value::as_bool) == Some(true) {
                    let v = event
                        .get("result")
                        .or_else(|| event.get("error"))
                        .map_or_else(|| "Claude Code failed.".to_owned(), value_text);
                    return Err(BackendError::Transport(quote(&v, 2000)));
                }
                result_text = event.get("result").map(value_text);
                num_turns = num(event, "num_turns");
            }
            "assistant" => {
                let Some(msg) = event.get("message") else {
                    continue;
                };
                let id = msg
                    .get("id")
                    .and_then(Value::as_str)
                    .map_or_else(|| format!("anon-{seq}"), str::to_owned);
                if let Some(u) = msg.get("usage") {
                    if !usage_by_id.contains_key(&id) {
                        order.push(id.clone());
                    }
                    usage_by_id.insert(id.clone(), u.clone());
                }
                let blocks = match msg.get("content") {
                    Some(Value::Array(b)) => b.clone(),
                    Some(Value::String(s)) if !s.is_empty() => {
                        vec![json!({"type": "text", "text": s})]
                    }
                    _ => Vec::new(),
                };
                let same = last_assistant_id.as_deref() == Some(id.as_str())
                    && outputs.last().is_some_and(|m| m.role == Role::Assistant);
                if !same {
                    outputs.push(Message::text(Role::Assistant, None));
                    last_assistant_id = Some(id);
                }
                let Some(m) = outputs.last_mut() else {
                    continue;
                };
                for b in &blocks {
                    let append = |slot: &mut Option<String>, t: &str| {
                        *slot = Some(match slot.take() {
                            Some(prev) => format!("{prev}\n{t}"),
                            None => t.to_owned(),
                        });
                    };
                    match b.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            if let Some(t) = b.get("text").and_then(Value::as_str) {
                                append(&mut m.content, t);
                            }
                        }
                        Some("thinking" | "redacted_thinking") => {
                            if let Some(t) = ["thinking", "text", "data"]
                                .iter()
                                .find_map(|k| b.get(*k).and_then(Value::as_str))
                            {
                                append(&mut m.reasoning_content, t);
                            }
                        }
                        Some("tool_use") => {
                            let input = match b.get("input") {
                                Some(Value::String(s)) => s.clone(),
                                Some(v) if !v.is_null() => v.to_string(),
                                _ => "{}".into(),
                            };
                            let call = ToolCall {
                                id: b.get("id").and_then(Value::as_str).map_or_else(
                                    || format!("call_{}", crate::ids::hex(4)),
                                    str::to_owned,
                                ),
                                kind: ToolCallType::Function,
                                function: FunctionCall {
                                    name: b
                                        .get("name")
                                        .and_then(Value::as_str)
                                        .unwrap_or("tool")
                                        .to_owned(),
                                    arguments: input,
                                },
                            };
                            m.tool_calls.get_or_insert_with(Vec::new).push(call);
                            tool_calls += 1;
                        }
                        _ => {}
                    }
                }
            }
            "user" => {
                let Some(Value::Array(blocks)) =
                    event.get("message").and_then(|m| m.get("content"))
                else {
                    continue;
                };
                for b in blocks {
                    if b.get("type").and_then(Value::as_str) != Some("tool_result") {
                        continue;
                    }
                    let id = b
                        .get("tool_use_id")
                        .and_then(Value::as_str)
                        .map(str::to_owned);
                    let name = id.as_deref().and_then(|id| {
                        outputs.iter().rev().find_map(|m| {
                            m.tool_calls
                                .as_ref()?
                                .iter()
                                .find(|c| c.id == id)
                                .map(|c| c.function.name.clone())
                        })
                    });
                    outputs.push(Message {
                        tool_call_id: id,
                        name,
                        ..Message::text(Role::Tool, Some(tool_result_text(b.get("content"))))
                    });
                }
                last_assistant_id = None;
            }
            _ => {}
        }
    }
    // An assistant event that carried nothing readable leaves an empty message: drop it.
    outputs.retain(|m| {
        m.role != Role::Assistant
            || m.content.is_some()
            || m.reasoning_content.is_some()
            || m.tool_calls.is_some()
    });
    if outputs.is_empty()
        && let Some(t) = result_text
    {
        outputs.push(Message::text(Role::Assistant, Some(t)));
    }
    if outputs.is_empty() {
        return Err(BackendError::Protocol(
            "claude_code stream-json output contained no assistant output.".into(),
        ));
    }
    let mut usage = TurnUsage {
        tool_calls,
        steps: (order.len() as u64).max(num_turns),
        ..TurnUsage::default()
    };
    for id in &order {
        let u = &usage_by_id[id];
        let input = num(u, "input_tokens")
            + num(u, "cache_read_input_tokens")
            + num(u, "cache_creation_input_tokens");
        usage.input_tokens += input;
        usage.output_tokens += num(u, "output_tokens");
    }
    usage.total_tokens = usage.input_tokens + usage.output_tokens;
    Ok((outputs, trace, usage))
}

impl Agent for ClaudeCode {
    fn session_id(&self) -> Option<String> {
        lock(&self.session).clone()
    }

    async fn start(&self, ctx: &InitContext) -> Result<(), BackendError> {
        let root = &ctx.runtime_dir;
        let home = root.join("home");
        let config_dir = home.join(".claude");
        let workspace = self
            .options
            .working_directory
            .as_ref()
            .map_or_else(|| root.join("workspace"), PathBuf::from);
        agent::create_dirs(&[
            config_dir.clone(),
            workspace.clone(),
            root.join("logs"),
            root.join("run"),
            root.join("tmp"),
            root.join("prompts"),
        ])
        .await?;
        let text = agent::install_system_prompt(ctx.system_prompt.as_ref()).await?;
        let mut system_prompt = None;
        if let Some(text) = text {
            match self.options.system_prompt_mode {
                SystemPromptMode::Append | SystemPromptMode::Replace => system_prompt = Some(text),
                SystemPromptMode::ClaudeMd => {
                    agent::write_files(&workspace, &[("CLAUDE.md", text)]).await?;
                }
                SystemPromptMode::None => {}
            }
        }
        let settings_path = config_dir.join("settings.json");
        let text = serde_json::to_string_pretty(&settings(&self.options)).unwrap_or_default();
        agent::write_files(&config_dir, &[("settings.json", text)]).await?;
        agent::write_files(
            &root.join("run"),
            &[
                ("claude_code.settings", settings_path.display().to_string()),
                ("proxy.port", ctx.proxy.local_addr().port().to_string()),
            ],
        )
        .await?;
        let bin = self
            .options
            .executable
            .clone()
            .unwrap_or_else(|| ctx.bins.claude_code.clone());
        CLI.require(&bin)?;
        self.process.set_bin(&bin);
        *lock(&self.setup) = Some(Setup {
            bin,
            runtime_dir: root.clone(),
            home,
            config_dir,
            workspace,
            settings_path,
            system_prompt,
            base_url: ctx.proxy.base_url(),
            router_timeout_ms: ctx.config.router_timeout,
            session_uuid: session_uuid(&ctx.bound_instance_id, &ctx.bound_session_id),
        });
        Ok(())
    }

    async fn turn(&self, turn: TurnInput<'_>) -> Result<AdapterResponse, BackendError> {
        let s = agent::started(&self.setup, "claude_code")?;
        let text = agent::single_prompt(turn.messages, "claude_code")?;
        if agent::resolve_executable(&s.bin).is_none() {
            return Err(BackendError::Process(format!(
                "claude code binary not found. ({})",
                s.bin
            )));
        }
        *lock(&self.session) = Some(s.session_uuid.clone());
        let events = self
            .process
            .run(
                &CLI,
                self.command(&s),
                &s.runtime_dir,
                Some(text.as_bytes()),
                |_| std::future::ready(()),
                |events, exit| agent::exit_message(CLI.name, &exit, stream_errors(events)),
            )
            .await?;
        let (outputs, trace_events, usage) = convert_events(turn.turn_id, &events)?;
        Ok(AdapterResponse {
            outputs,
            trace_events,
            usage,
            backend_session_id: s.session_uuid,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_default_to_bypass_and_refuse_unknown_keys() {
        let o = Options::parse(&Object::new()).unwrap();
        assert_eq!(o.permission_mode, PermissionMode::BypassPermissions);
        assert_eq!(o.gateway.auth_token, "blackbox-local");
        assert_eq!(o.max_turns, 20);
        let bad = crate::error::obj(json!({"surprise": 1}));
        let msg = Options::parse(&bad).unwrap_err().to_string();
        assert!(
            msg.starts_with("Invalid claude_code backend_options"),
            "{msg}"
        );
        let zero = crate::error::obj(json!({"max_turns": 0}));
        assert!(Options::parse(&zero).is_err());
        let mode = crate::error::obj(json!({"permission_mode": "default"}));
        assert_eq!(
            Options::parse(&mode).unwrap().permission_mode.as_cli(),
            "manual"
        );
        let s = settings(&o);
        assert_eq!(s["env"]["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"], "1");
        assert_eq!(s["permissions"]["deny"], json!(["Agent"]));
    }

    #[test]
    fn the_session_id_is_a_stable_uuid() {
        let a = session_uuid("inst-001", "sess-001");
        assert_eq!(a, session_uuid("inst-001", "sess-001"));
        assert_ne!(a, session_uuid("inst-001", "sess-002"));
        let parts: Vec<usize> = a.split('-').map(str::len).collect();
        assert_eq!(parts, [8, 4, 4, 4, 12]);
        assert_eq!(&a[14..15], "8");
    }

    #[test]
    fn stream_events_become_messages_with_usage_counted_once_per_message() {
        let usage = json!({"input_tokens": 10, "cache_read_input_tokens": 5, "output_tokens": 3});
        let events = vec![
            json!({"type": "system", "subtype": "init", "session_id": "s"}),
            json!({"type": "assistant", "message": {"id": "m1", "role": "assistant",
                "content": [{"type": "text", "text": "writing"}], "usage": usage}}),
            json!({"type": "assistant", "message": {"id": "m1", "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "Write",
                             "input": {"file_path": "/x"}}], "usage": usage}}),
            json!({"type": "user", "message": {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1",
                 "content": [{"type": "text", "text": "ok"}]}]}}),
            json!({"type": "assistant", "message": {"id": "m2", "role": "assistant",
                "content": [{"type": "text", "text": "done"}],
                "usage": {"input_tokens": 20, "output_tokens": 1}}}),
            json!({"type": "result", "subtype": "success", "is_error": false,
                   "result": "done", "num_turns": 2}),
        ];
        let (out, trace, usage) = convert_events("t1", &events).unwrap();
        assert_eq!(out.len(), 3, "{out:?}");
        assert_eq!(out[0].content.as_deref(), Some("writing"));
        let call = &out[0].tool_calls.as_ref().unwrap()[0];
        assert_eq!(
            (call.id.as_str(), call.function.name.as_str()),
            ("toolu_1", "Write")
        );
        assert_eq!(call.function.arguments, r#"{"file_path":"/x"}"#);
        assert_eq!(out[1].role, Role::Tool);
        assert_eq!(out[1].tool_call_id.as_deref(), Some("toolu_1"));
        assert_eq!(out[1].name.as_deref(), Some("Write"));
        assert_eq!(out[1].content.as_deref(), Some("ok"));
        assert_eq!(out[2].content.as_deref(), Some("done"));
        assert_eq!(trace.len(), 6);
        assert_eq!(
            (
                usage.input_tokens,
                usage.output_tokens,
                usage.steps,
                usage.tool_calls
            ),
            (35, 4, 2, 1)
        );

        let failed = vec![json!({"type": "result", "is_error": true, "result": "boom"})];
        assert!(matches!(
            convert_events("t", &failed),
            Err(BackendError::Transport(m)) if m == "boom"
        ));
        let only_result = vec![json!({"type": "result", "is_error": false, "result": "hi"})];
        assert_eq!(
            convert_events("t", &only_result).unwrap().0[0]
                .content
                .as_deref(),
            Some("hi")
        );
        assert!(convert_events("t", &[json!({"type": "system"})]).is_err());
    }

    #[test]
    fn exit_errors_quote_the_stream_and_stderr() {
        let events = vec![json!({"type": "result", "is_error": true, "result": "API Error: 403"})];
        let exit = agent::Exit {
            code: Some(1),
            stderr: Some("bad token".into()),
            stdout: None,
        };
        let m = agent::exit_message(CLI.name, &exit, stream_errors(&events));
        assert!(m.contains("code 1") && m.contains("API Error: 403") && m.contains("bad token"));
    }
}
