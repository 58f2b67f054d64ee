//! The wire contract: every request and answer shape of the reference's `core/models.py`, with
//! its field names, enum spellings and defaults, so the paddock's client works unchanged.
//!
//! Answers serialize every field (an absent optional one as `null`), as FastAPI's
//! `response_model` does. Requests ignore unknown fields, as pydantic's default models do; the
//! few models the reference declares `extra="forbid"` deny them.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::config::ServerConfig;
use crate::config::ServerConfigOverride;

/// A JSON object.
pub type Object = Map<String, Value>;

/// The reference's default `backend_options.proxy.max_steps`.
pub const DEFAULT_PROXY_MAX_STEPS: u32 = 100;

/// A UTC instant, written as pydantic writes one (`2026-11-30T12:00:00.123456Z`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Timestamp(time::OffsetDateTime);

impl Timestamp {
    /// Now.
    #[must_use]
    pub fn now() -> Timestamp {
        Timestamp(time::OffsetDateTime::now_utc())
    }

    /// `YYYYmmdd-HHMMSS`, for runtime ids.
    #[must_use]
    pub fn compact(self) -> String {
        let t = self.0;
        format!(
            "{:04}{:02}{:02}-{:02}{:02}{:02}",
            t.year(),
            u8::from(t.month()),
            t.day(),
            t.hour(),
            t.minute(),
            t.second()
        )
    }
}

impl Serialize for Timestamp {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        const FORMAT: &[time::format_description::BorrowedFormatItem<'_>] = time::macros::format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
        );
        let text = self.0.format(FORMAT).map_err(serde::ser::Error::custom)?;
        s.serialize_str(&text)
    }
}

/// The server's lifecycle (`status` in `/v1/status` and register answers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ServerState {
    /// Nothing registered.
    Idle,
    /// A registration is starting the agent.
    Initializing,
    /// Registered and serving turns.
    Ready,
    /// The agent failed (a registration error, or the health monitor found it dead).
    Error,
    /// SIGTERM received.
    ShuttingDown,
}

impl ServerState {
    /// The reference's `str(state)` in messages (`ServerState.READY`).
    #[must_use]
    pub fn enum_name(self) -> &'static str {
        match self {
            ServerState::Idle => "ServerState.IDLE",
            ServerState::Initializing => "ServerState.INITIALIZING",
            ServerState::Ready => "ServerState.READY",
            ServerState::Error => "ServerState.ERROR",
            ServerState::ShuttingDown => "ServerState.SHUTTING_DOWN",
        }
    }
}

/// A session's state: `active → desynced | aborted`, `desynced → aborted`; nothing else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    /// Healthy, takes turns.
    Active,
    /// A turn ended in an unknown state (or the agent died): takes no turns; abort to recover.
    Desynced,
    /// Terminal.
    Aborted,
}

impl SessionState {
    /// Whether `self → next` is a transition of the state machine (staying put is not one).
    #[must_use]
    pub fn can_become(self, next: SessionState) -> bool {
        use SessionState::{Aborted, Active, Desynced};
        match (self, next) {
            (Active, Desynced | Aborted) | (Desynced, Aborted) => true,
            (Active, Active)
            | (Desynced, Active | Desynced)
            | (Aborted, Active | Desynced | Aborted) => false,
        }
    }
}

/// A turn record's status: `queued → inflight → committed | failed | cancelled | unknown`; a
/// queued turn may also be cancelled, or become unknown when its session is aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnStatus {
    /// Accepted, not started.
    Queued,
    /// The agent is working on it.
    Inflight,
    /// Succeeded; the result is kept for replays.
    Committed,
    /// A deterministic failure (the session is not necessarily desynced).
    Failed,
    /// Cancelled.
    Cancelled,
    /// Its outcome is unknown (timeout, agent error, abort); the session is desynced.
    Unknown,
}

impl TurnStatus {
    /// Whether `self → next` is a transition of the state machine.
    #[must_use]
    pub fn can_become(self, next: TurnStatus) -> bool {
        use TurnStatus::{Cancelled, Committed, Failed, Inflight, Queued, Unknown};
        match (self, next) {
            (Queued, Inflight | Cancelled | Unknown)
            | (Inflight, Committed | Failed | Cancelled | Unknown) => true,
            (Queued, Queued | Committed | Failed)
            | (Inflight, Queued | Inflight)
            | (Committed | Failed | Cancelled | Unknown, _) => false,
        }
    }

    /// Queued or inflight.
    #[must_use]
    pub fn is_active(self) -> bool {
        match self {
            TurnStatus::Queued | TurnStatus::Inflight => true,
            TurnStatus::Committed
            | TurnStatus::Failed
            | TurnStatus::Cancelled
            | TurnStatus::Unknown => false,
        }
    }

    /// The wire spelling.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            TurnStatus::Queued => "queued",
            TurnStatus::Inflight => "inflight",
            TurnStatus::Committed => "committed",
            TurnStatus::Failed => "failed",
            TurnStatus::Cancelled => "cancelled",
            TurnStatus::Unknown => "unknown",
        }
    }
}

/// A tool call's function.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FunctionCall {
    /// Tool name.
    pub name: String,
    /// Arguments, a JSON string.
    pub arguments: String,
}

/// The only tool call type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolCallType {
    /// `function`.
    #[default]
    Function,
}

/// A tool call of an assistant message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// Call id.
    pub id: String,
    /// Always `function`.
    #[serde(rename = "type", default)]
    pub kind: ToolCallType,
    /// The call.
    pub function: FunctionCall,
}

/// A message role.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// `system` (refused in turns: the prompt comes from `system_prompt_file`).
    System,
    /// `user`.
    User,
    /// `assistant`.
    Assistant,
    /// `tool`.
    Tool,
}

/// A chat message (turn input and output).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    /// Who speaks.
    pub role: Role,
    /// Text.
    #[serde(default)]
    pub content: Option<String>,
    /// Reasoning text.
    #[serde(default)]
    pub reasoning_content: Option<String>,
    /// Tool calls (assistant).
    #[serde(default)]
    pub tool_calls: Option<Vec<ToolCall>>,
    /// The call this answers (tool).
    #[serde(default)]
    pub tool_call_id: Option<String>,
    /// Tool name (tool).
    #[serde(default)]
    pub name: Option<String>,
}

impl Message {
    /// A message with only `role` and `content`.
    #[must_use]
    pub fn text(role: Role, content: Option<String>) -> Message {
        Message {
            role,
            content,
            reasoning_content: None,
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// One agent event kept for the trace.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TraceEvent {
    /// The turn it belongs to (`__init__` for registration events).
    pub turn_id: String,
    /// Order within the turn.
    pub seq: u64,
    /// Who produced it (`opencode`, `blackbox_server`).
    pub source: String,
    /// Its kind (`tool`, `reasoning`, `step-finish`, ...).
    pub event_type: String,
    /// The raw event.
    pub payload: Object,
    /// When it was recorded.
    pub created_at: Timestamp,
}

/// A turn's usage.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct TurnUsage {
    /// Input + output.
    pub total_tokens: u64,
    /// Prompt tokens over the turn's model calls.
    pub input_tokens: u64,
    /// Completion tokens.
    pub output_tokens: u64,
    /// Reasoning tokens.
    pub reasoning_tokens: u64,
    /// Model calls.
    pub steps: u64,
    /// Tool calls the model made.
    pub tool_calls: u64,
}

/// What a backend returns for a committed turn.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AdapterResponse {
    /// The new messages (assistant, tool).
    pub outputs: Vec<Message>,
    /// Agent events.
    pub trace_events: Vec<TraceEvent>,
    /// Usage.
    pub usage: TurnUsage,
    /// The agent's own session id.
    pub backend_session_id: String,
}

/// What a backend supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[allow(clippy::struct_excessive_bools)]
pub struct BackendCapabilities {
    /// Chat turns.
    pub chat: bool,
    /// Abort.
    pub abort: bool,
    /// Pause/resume of model calls.
    pub pause_resume: bool,
    /// Streaming answers.
    pub stream: bool,
    /// Several input messages per turn.
    pub multi_message_input: bool,
    /// A register-time system prompt.
    pub system_message: bool,
    /// Assistant/tool history injection.
    pub history_injection: bool,
}

/// Where a registration's system prompt was copied for the agent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RuntimeSystemPrompt {
    /// The file given at register (absolute).
    pub source_file: String,
    /// The copy the agent reads.
    pub runtime_file: String,
    /// Which agent mode it applies to (`build` for opencode).
    pub applies_to: String,
}

/// `backend_options.proxy` (the reference forbids unknown keys here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyOptions {
    /// The sticky routing header.
    #[serde(default = "default_sticky_header")]
    pub sticky_header_name: String,
    /// Model calls per turn (`> 0`); `null` disables the limit.
    #[serde(default = "default_max_steps")]
    pub max_steps: Option<u64>,
    /// Temperature for requests that give none (`>= 0`).
    #[serde(default)]
    pub default_temperature: Option<f64>,
}

fn default_sticky_header() -> String {
    "X-SMG-Routing-Key".to_owned()
}

#[allow(clippy::unnecessary_wraps)]
fn default_max_steps() -> Option<u64> {
    Some(u64::from(DEFAULT_PROXY_MAX_STEPS))
}

impl Default for ProxyOptions {
    fn default() -> Self {
        ProxyOptions {
            sticky_header_name: default_sticky_header(),
            max_steps: default_max_steps(),
            default_temperature: None,
        }
    }
}

/// What a registration bound this server to.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct BindingInfo {
    /// `bbs-YYYYmmdd-HHMMSS-xxxx`.
    pub runtime_id: String,
    /// The backend.
    pub blackbox_type: String,
    /// `router` as given.
    pub router_raw: String,
    /// `scheme://host[:port]/path`, no trailing slash.
    pub router_base_url: String,
    /// The router's API path (`/v1`).
    pub router_api_path: String,
    /// The one session this binding serves.
    pub bound_session_id: String,
    /// The rollout instance.
    pub bound_instance_id: String,
    /// The sandbox, if given.
    pub bound_sandbox_id: Option<String>,
    /// The system prompt, if given.
    pub system_prompt: Option<RuntimeSystemPrompt>,
    /// This registration's directory.
    pub runtime_dir: String,
    /// When.
    pub registered_at: Timestamp,
    /// As given.
    pub backend_options: Object,
}

/// A turn's error, as stored on its record and shown to pollers: `http_status` is the status
/// a synchronous caller got, so both kinds of client see the same error.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnErrorBody {
    /// The code (`backend_timeout`, `context_overflow`, ...).
    pub error: String,
    /// Human text.
    pub message: String,
    /// The HTTP status.
    pub http_status: u16,
    /// `session_id`, `turn_id` and what the failure adds.
    pub details: Object,
}

/// A turn, as `include_turns` shows it (its error as [`TurnErrorBody`]); the session keeps the
/// same record with its error typed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnRecord<E = TurnErrorBody> {
    /// Its id.
    pub turn_id: String,
    /// Hash of its messages: a retry must match it.
    pub request_fingerprint: String,
    /// Where it is.
    pub status: TurnStatus,
    /// Its input.
    pub request_messages: Vec<Message>,
    /// Its result, once committed.
    pub response: Option<AdapterResponse>,
    /// Its error, once failed.
    pub error: Option<E>,
    /// When accepted.
    pub created_at: Timestamp,
    /// Last change.
    pub updated_at: Timestamp,
}

impl<E> TurnRecord<E> {
    /// The same record with its error passed through `f`.
    #[must_use]
    pub fn map_error<F>(&self, f: impl FnOnce(&E) -> F) -> TurnRecord<F> {
        TurnRecord {
            turn_id: self.turn_id.clone(),
            request_fingerprint: self.request_fingerprint.clone(),
            status: self.status,
            request_messages: self.request_messages.clone(),
            response: self.response.clone(),
            error: self.error.as_ref().map(f),
            created_at: self.created_at,
            updated_at: self.updated_at,
        }
    }
}

/// `POST /v1/rollout/register`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct RegisterRequest {
    /// The backend (`opencode`).
    pub blackbox_type: String,
    /// The router (`host:port` or a URL).
    pub router: String,
    /// The router's API path.
    #[serde(default = "default_api_path")]
    pub router_api_path: String,
    /// Required in practice (400 when missing).
    #[serde(default)]
    pub bound_session_id: Option<String>,
    /// Required in practice (400 when missing).
    #[serde(default)]
    pub bound_instance_id: Option<String>,
    /// Optional.
    #[serde(default)]
    pub bound_sandbox_id: Option<String>,
    /// An absolute, readable file.
    #[serde(default)]
    pub system_prompt_file: Option<String>,
    /// Backend-specific (opencode: provider and model; `proxy`).
    #[serde(default)]
    pub backend_options: Object,
    /// Per-registration settings.
    #[serde(default)]
    pub server_config: Option<ServerConfigOverride>,
}

fn default_api_path() -> String {
    "/v1".to_owned()
}

/// Reference to the agent's session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BackendRef {
    /// The backend type.
    #[serde(rename = "type")]
    pub kind: String,
    /// The agent's session id.
    pub backend_session_id: Option<String>,
}

/// The register answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct RegisterResponse {
    /// Request id.
    pub request_id: String,
    /// Server state.
    pub status: ServerState,
    /// The binding.
    pub binding: BindingInfo,
    /// The backend's capabilities.
    pub capabilities: BackendCapabilities,
    /// The effective settings.
    pub config: ServerConfig,
}

/// `POST /v1/rollout/pause`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct PauseRequest {
    /// Why.
    #[serde(default = "default_reason")]
    pub reason: String,
    /// How long to wait for in-flight model calls (`> 0`).
    #[serde(default)]
    pub timeout_seconds: Option<f64>,
}

fn default_reason() -> String {
    "weight_update".to_owned()
}

/// The pause answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PauseResponse {
    /// Request id.
    pub request_id: String,
    /// `paused`, `already_paused`, or the router's word.
    pub status: String,
    /// Why.
    pub reason: String,
    /// Whether model calls are quiet.
    pub quiesced: bool,
    /// Weights version.
    pub version: Option<String>,
    /// Model calls in flight.
    pub http_inflight_requests: u64,
    /// Router-reported.
    pub active_sglang_generations: u64,
    /// Router-reported.
    pub suspended_generations: u64,
    /// The proxy's answer.
    pub details: Object,
}

/// `POST /v1/rollout/resume`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ResumeRequest {
    /// Why.
    #[serde(default = "default_reason")]
    pub reason: String,
    /// The new weights version.
    #[serde(default)]
    pub version: Option<String>,
}

/// The resume answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResumeResponse {
    /// Request id.
    pub request_id: String,
    /// `resumed`, `already_running`, or the router's word.
    pub status: String,
    /// Why.
    pub reason: String,
    /// Weights version.
    pub version: Option<String>,
    /// The proxy's answer.
    pub details: Object,
}

/// `sync` (the call waits for the turn) or `async` (202, then poll).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TurnMode {
    /// Wait.
    #[default]
    Sync,
    /// 202 at once.
    Async,
}

/// `POST /v1/sessions/{id}/messages`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct MessageRequest {
    /// Idempotency key (required in async mode).
    #[serde(default)]
    pub turn_id: Option<String>,
    /// The input (one user message for opencode).
    pub messages: Vec<Message>,
    /// Passed to the backend.
    #[serde(default)]
    pub metadata: Object,
    /// Sync or async.
    #[serde(default)]
    pub mode: TurnMode,
}

/// A committed turn's answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MessageResponse {
    /// Request id.
    pub request_id: String,
    /// The session.
    pub session_id: String,
    /// The bound instance.
    pub instance_id: Option<String>,
    /// The turn.
    pub turn_id: String,
    /// The session's state.
    pub state: SessionState,
    /// Whether this replays an earlier result.
    pub idempotent_replay: bool,
    /// New messages.
    pub outputs: Vec<Message>,
    /// The agent session.
    pub backend: BackendRef,
    /// Usage.
    pub usage: TurnUsage,
}

/// The 202 of an async submit.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnSubmitResponse {
    /// Request id.
    pub request_id: String,
    /// The session.
    pub session_id: String,
    /// The bound instance.
    pub instance_id: Option<String>,
    /// The turn.
    pub turn_id: String,
    /// Its status now.
    pub status: TurnStatus,
    /// Whether the turn existed already.
    pub idempotent_replay: bool,
}

/// A turn's snapshot (the long poll).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnStatusResponse {
    /// Request id.
    pub request_id: String,
    /// The session.
    pub session_id: String,
    /// The bound instance.
    pub instance_id: Option<String>,
    /// The turn.
    pub turn_id: String,
    /// Its status.
    pub status: TurnStatus,
    /// The session's state.
    pub state: SessionState,
    /// Outputs, once committed.
    pub outputs: Option<Vec<Message>>,
    /// Usage, once committed.
    pub usage: Option<TurnUsage>,
    /// The agent session, once committed.
    pub backend: Option<BackendRef>,
    /// The error of a failed, unknown or cancelled turn.
    pub error: Option<TurnErrorBody>,
    /// When accepted.
    pub created_at: Timestamp,
    /// Last change.
    pub updated_at: Timestamp,
}

/// The cancel answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TurnCancelResponse {
    /// Request id.
    pub request_id: String,
    /// The session.
    pub session_id: String,
    /// The bound instance.
    pub instance_id: Option<String>,
    /// The turn.
    pub turn_id: String,
    /// `cancelled`, `cancel_requested`, or the terminal status it already had.
    pub status: String,
    /// The session's state.
    pub state: SessionState,
}

/// `POST /v1/sessions/{id}/execute_cmd`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ExecuteCmdRequest {
    /// One shell line.
    pub cmd: String,
    /// Seconds (`> 0`); the server default when absent.
    #[serde(default)]
    pub timeout: Option<f64>,
}

/// What a command did (the reference's `ExecuteCmdResult`).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExecuteCmdResult {
    /// The command as run.
    pub cmd: String,
    /// Its stdout (lossy UTF-8, capped).
    pub stdout: String,
    /// Its stderr (lossy UTF-8, capped).
    pub stderr: String,
    /// Exit code (128 + signal when killed).
    pub returncode: Option<i32>,
    /// Whether the timeout ended it.
    pub timed_out: bool,
    /// Wall time.
    pub duration_seconds: f64,
    /// Start.
    pub started_at: Timestamp,
    /// End.
    pub finished_at: Timestamp,
    /// Whether stdout was cut at the cap (ours; not in the reference).
    pub stdout_truncated: bool,
    /// Whether stderr was cut at the cap (ours; not in the reference).
    pub stderr_truncated: bool,
}

/// The execute_cmd answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ExecuteCmdResponse {
    /// Request id.
    pub request_id: String,
    /// The session.
    pub session_id: String,
    /// The bound instance.
    pub instance_id: Option<String>,
    /// What the command did.
    #[serde(flatten)]
    pub result: ExecuteCmdResult,
}

/// `GET /v1/sessions/{id}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SessionResponse {
    /// Request id.
    pub request_id: String,
    /// The session.
    pub session_id: String,
    /// The bound instance.
    pub instance_id: Option<String>,
    /// Its state.
    pub state: SessionState,
    /// The backend.
    pub blackbox_type: String,
    /// The agent session.
    pub backend_session_id: Option<String>,
    /// Messages in the history.
    pub message_count: usize,
    /// Committed turns.
    pub turn_count: u64,
    /// Created.
    pub created_at: Timestamp,
    /// Last change.
    pub updated_at: Timestamp,
    /// With `include_history`.
    pub conversation_history: Option<Vec<Message>>,
    /// With `include_trace`.
    pub trace_events: Option<Vec<TraceEvent>>,
    /// With `include_turns`: turn id → record, in submission order.
    pub turn_ledger: Option<Object>,
}

/// Abort's mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum AbortMode {
    /// The session was aborted now.
    BestEffort,
    /// It already was.
    Noop,
}

/// The abort answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AbortResponse {
    /// Request id.
    pub request_id: String,
    /// The session.
    pub session_id: String,
    /// The bound instance.
    pub instance_id: Option<String>,
    /// Always `abort`.
    pub action: &'static str,
    /// The session's state.
    pub state: SessionState,
    /// What happened.
    pub mode: AbortMode,
}

/// Session counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct SessionStats {
    /// Active.
    pub active_count: u64,
    /// Desynced.
    pub desynced_count: u64,
    /// Aborted.
    pub aborted_count: u64,
    /// All.
    pub total_count: u64,
    /// The limit.
    pub max_sessions: u64,
}

/// `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StatusResponse {
    /// Request id.
    pub request_id: String,
    /// Server state.
    pub status: ServerState,
    /// The binding, if any.
    pub binding: Option<BindingInfo>,
    /// Sessions.
    pub sessions: SessionStats,
    /// The backend's capabilities, if bound.
    pub capabilities: Option<BackendCapabilities>,
    /// The effective settings.
    pub config: ServerConfig,
    /// Backends this server runs.
    pub implemented_backends: Vec<&'static str>,
    /// Backends the protocol names.
    pub known_backends: Vec<&'static str>,
}

/// Every error answer: `{request_id, error, message, details}`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ErrorResponse {
    /// Request id.
    pub request_id: String,
    /// The code.
    pub error: String,
    /// Human text.
    pub message: String,
    /// Context (`{}` when none).
    pub details: Object,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_look_like_pydantic_ones() {
        let t = serde_json::to_value(Timestamp::now()).unwrap();
        let s = t.as_str().unwrap();
        assert_eq!(s.len(), "2026-11-30T12:00:00.123456Z".len(), "{s}");
        assert!(s.ends_with('Z') && s.as_bytes()[10] == b'T', "{s}");
    }

    #[test]
    fn state_machines_allow_only_the_documented_transitions() {
        use SessionState::{Aborted, Active, Desynced};
        assert!(Active.can_become(Desynced) && Active.can_become(Aborted));
        assert!(Desynced.can_become(Aborted));
        assert!(!Desynced.can_become(Active) && !Aborted.can_become(Active));
        assert!(!Aborted.can_become(Desynced));
        use TurnStatus::{Cancelled, Committed, Failed, Inflight, Queued, Unknown};
        assert!(Queued.can_become(Inflight) && Queued.can_become(Cancelled));
        assert!(!Queued.can_become(Committed));
        for end in [Committed, Failed, Cancelled, Unknown] {
            assert!(Inflight.can_become(end));
            for next in [Queued, Inflight, Committed, Failed, Cancelled, Unknown] {
                assert!(!end.can_become(next), "{end:?} -> {next:?}");
            }
        }
    }

    #[test]
    fn messages_keep_the_reference_field_names() {
        let m: Message = serde_json::from_value(serde_json::json!({
            "role": "assistant", "content": null, "extra": 1,
            "tool_calls": [{"id": "c1", "function": {"name": "write", "arguments": "{}"}}]
        }))
        .unwrap();
        let v = serde_json::to_value(&m).unwrap();
        assert_eq!(v["tool_calls"][0]["type"], "function");
        assert!(v.get("extra").is_none());
        assert!(v["reasoning_content"].is_null() && v["tool_call_id"].is_null());
        assert!(
            serde_json::from_value::<ProxyOptions>(serde_json::json!({"enabled": false})).is_err()
        );
        let p: ProxyOptions = serde_json::from_value(serde_json::json!({})).unwrap();
        assert_eq!(p.max_steps, Some(100));
        assert_eq!(p.sticky_header_name, "X-SMG-Routing-Key");
    }
}
