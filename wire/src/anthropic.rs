//! Typed Anthropic Messages API bodies: the request, the response, every streamed event and the
//! error body, plus [`StreamAccumulator`], which folds a stream back into a response while
//! checking the event-order contract Claude Code's SDK enforces.
//!
//! Every object we pass through carries `extra`, a `#[serde(flatten)]` map holding the fields
//! this crate does not name, so parsing and re-serializing a body (or editing one field) keeps
//! everything else. Tagged unions (content blocks, sources, tool choices, events) also keep
//! variants we do not know in an `Other` map. Limits of that promise: a known optional field
//! sent as `null` is re-serialized as absent, and object keys come back in declaration order
//! (JSON objects are unordered; nothing downstream may depend on key order).
//!
//! Numbers we never compute with (`temperature`, `top_p`) are kept as [`serde_json::Number`] so
//! `1` stays `1` rather than becoming `1.0`.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Number, Value};

use crate::serde_util::const_tag;
pub use crate::serde_util::{RawJson, TextOrList};

/// Unknown fields of an object, kept in arrival order.
pub type Extra = Map<String, Value>;

/// The member a translator adds (`true`) to a `usage` it made up because the upstream reported
/// none (a `message_start` before the real count, a chat upstream without usage): a meter
/// reading such a usage bills it as unreported, with its own floors, never as the provider's
/// word. It can only make a meter bill more, so an upstream that sends it gains nothing.
pub const ESTIMATE_MARK: &str = "agentbox_estimate";

/// Whether a `usage`'s other members carry [`ESTIMATE_MARK`].
pub fn is_estimate(extra: &Extra) -> bool {
    extra
        .get(ESTIMATE_MARK)
        .is_some_and(|v| v == &Value::Bool(true))
}

/// [`ESTIMATE_MARK`] as a usage's other members.
pub fn estimate_mark() -> Extra {
    let mut m = Extra::new();
    m.insert(ESTIMATE_MARK.to_owned(), Value::Bool(true));
    m
}

/// `POST /v1/messages` request body (also the shape of `count_tokens`, which omits
/// `max_tokens`).
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct MessagesRequest {
    pub model: String,
    pub messages: Vec<Message>,
    pub system: Option<System>,
    pub max_tokens: Option<u64>,
    pub stop_sequences: Option<Vec<String>>,
    pub stream: Option<bool>,
    pub temperature: Option<Number>,
    pub top_p: Option<Number>,
    pub top_k: Option<u64>,
    pub metadata: Option<Metadata>,
    pub tools: Option<Vec<Tool>>,
    pub tool_choice: Option<ToolChoice>,
    pub thinking: Option<ThinkingConfig>,
    /// `output_config`, `context_management`, `service_tier`, ... and anything newer.
    #[serde(flatten)]
    pub extra: Extra,
}

/// The top-level `system` prompt: a string or a list of text blocks.
pub type System = TextOrList<ContentBlock>;

/// A message's `content`: a string or a list of blocks.
pub type MessageContent = TextOrList<ContentBlock>;

/// One turn of the conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: Role,
    pub content: MessageContent,
    #[serde(flatten)]
    pub extra: Extra,
}

impl Message {
    /// A message with the given role and content and no extra fields.
    pub fn new(role: Role, content: impl Into<MessageContent>) -> Self {
        Self {
            role,
            content: content.into(),
            extra: Extra::new(),
        }
    }
}

/// Who spoke a turn. `system` is Claude Code's mid-conversation system message (beta
/// `mid-conversation-system-2026-04-07`); see [`crate::normalize`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    User,
    Assistant,
    System,
}

/// One content block of a message, of the system prompt or of a tool result.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentBlock {
    Text {
        #[serde(serialize_with = "crate::serde_util::text")]
        text: String,
        /// `cache_control`, `citations`, ...
        #[serde(flatten)]
        extra: Extra,
    },
    Image {
        source: ImageSource,
        #[serde(flatten)]
        extra: Extra,
    },
    Document {
        source: DocumentSource,
        /// `title`, `context`, `citations`, `cache_control`, ...
        #[serde(flatten)]
        extra: Extra,
    },
    ToolUse {
        id: String,
        name: String,
        /// The tool's arguments. An object on the wire; a string here means the upstream
        /// produced arguments that were not valid JSON and we kept them rather than invent `{}`.
        input: Value,
        #[serde(flatten)]
        extra: Extra,
    },
    ToolResult {
        tool_use_id: String,
        content: Option<TextOrList<ContentBlock>>,
        is_error: Option<bool>,
        #[serde(flatten)]
        extra: Extra,
    },
    Thinking {
        thinking: String,
        signature: Option<String>,
        #[serde(flatten)]
        extra: Extra,
    },
    RedactedThinking {
        data: String,
        #[serde(flatten)]
        extra: Extra,
    },
    /// A block type this crate does not model (`server_tool_use`, `web_search_tool_result`,
    /// `search_result`, ...), or a known type whose required fields are missing. Kept verbatim,
    /// `type` included.
    #[serde(untagged)]
    Other(Extra),
}

impl ContentBlock {
    /// A text block with no extra fields.
    pub fn text(text: impl Into<String>) -> Self {
        ContentBlock::Text {
            text: text.into(),
            extra: Extra::new(),
        }
    }

    /// The block's `type` string.
    pub fn block_type(&self) -> &str {
        match self {
            ContentBlock::Text { .. } => "text",
            ContentBlock::Image { .. } => "image",
            ContentBlock::Document { .. } => "document",
            ContentBlock::ToolUse { .. } => "tool_use",
            ContentBlock::ToolResult { .. } => "tool_result",
            ContentBlock::Thinking { .. } => "thinking",
            ContentBlock::RedactedThinking { .. } => "redacted_thinking",
            ContentBlock::Other(map) => map.get("type").and_then(Value::as_str).unwrap_or(""),
        }
    }
}

/// Where an image block's bytes come from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ImageSource {
    Base64 {
        media_type: String,
        data: String,
        #[serde(flatten)]
        extra: Extra,
    },
    Url {
        url: String,
        #[serde(flatten)]
        extra: Extra,
    },
    /// `file` (Files API) and anything newer.
    #[serde(untagged)]
    Other(Extra),
}

/// Where a document block's content comes from.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum DocumentSource {
    Base64 {
        media_type: String,
        data: String,
        #[serde(flatten)]
        extra: Extra,
    },
    Text {
        media_type: Option<String>,
        data: String,
        #[serde(flatten)]
        extra: Extra,
    },
    Url {
        url: String,
        #[serde(flatten)]
        extra: Extra,
    },
    /// `content`, `file` and anything newer.
    #[serde(untagged)]
    Other(Extra),
}

/// `metadata` of a request.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Metadata {
    pub user_id: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// One entry of `tools`: a client tool (no `type`, or `"custom"`) or a server tool (`type` such
/// as `web_search_20250305`).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Tool {
    #[serde(default)]
    pub name: String,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "crate::serde_util::opt_text"
    )]
    pub description: Option<String>,
    /// Opaque here: kept as the client wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_schema: Option<RawJson>,
    /// `cache_control`, `strict`, server-tool settings, ...
    #[serde(flatten)]
    pub extra: Extra,
}

impl Tool {
    /// Whether the provider runs this tool itself (a `type` other than `"custom"`).
    pub fn is_server_tool(&self) -> bool {
        self.kind.as_deref().is_some_and(|k| k != "custom")
    }
}

/// `tool_choice` of a request.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToolChoice {
    Auto {
        disable_parallel_tool_use: Option<bool>,
        #[serde(flatten)]
        extra: Extra,
    },
    Any {
        disable_parallel_tool_use: Option<bool>,
        #[serde(flatten)]
        extra: Extra,
    },
    Tool {
        name: String,
        disable_parallel_tool_use: Option<bool>,
        #[serde(flatten)]
        extra: Extra,
    },
    None {
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(untagged)]
    Other(Extra),
}

/// `thinking` of a request.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ThinkingConfig {
    Enabled {
        budget_tokens: Option<u64>,
        #[serde(flatten)]
        extra: Extra,
    },
    Disabled {
        #[serde(flatten)]
        extra: Extra,
    },
    /// The model decides how much to think; the effort is in `output_config.effort`.
    Adaptive {
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(untagged)]
    Other(Extra),
}

const_tag!(
    /// The `"type": "message"` of a response.
    MessageTag = "message"
);
const_tag!(
    /// The `"type": "error"` of an error body.
    ErrorTag = "error"
);

/// A non-streamed response, and the `message` of a `message_start` event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MessagesResponse {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: MessageTag,
    pub role: Role,
    /// Always an array: `null` here makes Claude Code report an empty or malformed response.
    #[serde(default)]
    pub content: Vec<ContentBlock>,
    pub model: String,
    /// `null` in a `message_start`; serialized as `null`, never omitted, as the API does.
    #[serde(default)]
    pub stop_reason: Option<StopReason>,
    #[serde(default)]
    pub stop_sequence: Option<String>,
    #[serde(default)]
    pub usage: Usage,
    #[serde(flatten)]
    pub extra: Extra,
}

impl MessagesResponse {
    /// An empty assistant message, as carried by `message_start`.
    pub fn new(id: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            id: id.into(),
            kind: MessageTag,
            role: Role::Assistant,
            content: Vec::new(),
            model: model.into(),
            stop_reason: None,
            stop_sequence: None,
            usage: Usage::default(),
            extra: Extra::new(),
        }
    }
}

/// Why the model stopped.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    EndTurn,
    MaxTokens,
    StopSequence,
    ToolUse,
    PauseTurn,
    Refusal,
    ModelContextWindowExceeded,
    #[serde(untagged)]
    Other(String),
}

/// Token usage of a response or a `message_start`. Anthropic's `input_tokens` excludes cache
/// reads and cache writes; the total input is the sum of the three.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub input_tokens: u64,
    pub cache_creation_input_tokens: Option<u64>,
    pub cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    pub output_tokens: u64,
    /// `server_tool_use`, `service_tier`, `cache_creation` breakdown, ...
    #[serde(flatten)]
    pub extra: Extra,
}

/// The `usage` of a `message_delta`: cumulative for the whole message so far. Newer API
/// versions (and Ollama, vLLM) also put the input and cache counts here.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct DeltaUsage {
    pub input_tokens: Option<u64>,
    pub cache_creation_input_tokens: Option<u64>,
    pub cache_read_input_tokens: Option<u64>,
    #[serde(default)]
    pub output_tokens: u64,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The `delta` of a `message_delta`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct MessageDeltaBody {
    #[serde(default)]
    pub stop_reason: Option<StopReason>,
    #[serde(default)]
    pub stop_sequence: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The `delta` of a `content_block_delta`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum BlockDelta {
    TextDelta {
        text: String,
        #[serde(flatten)]
        extra: Extra,
    },
    InputJsonDelta {
        partial_json: String,
        #[serde(flatten)]
        extra: Extra,
    },
    ThinkingDelta {
        thinking: String,
        #[serde(flatten)]
        extra: Extra,
    },
    SignatureDelta {
        signature: String,
        #[serde(flatten)]
        extra: Extra,
    },
    CitationsDelta {
        citation: Value,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(untagged)]
    Other(Extra),
}

/// One streamed event. The SSE `event:` line must equal [`StreamEvent::event_name`]: the SDK
/// dispatches on that line, not on the JSON.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    MessageStart {
        message: MessagesResponse,
        #[serde(flatten)]
        extra: Extra,
    },
    ContentBlockStart {
        index: u32,
        content_block: ContentBlock,
        #[serde(flatten)]
        extra: Extra,
    },
    ContentBlockDelta {
        index: u32,
        delta: BlockDelta,
        #[serde(flatten)]
        extra: Extra,
    },
    ContentBlockStop {
        index: u32,
        #[serde(flatten)]
        extra: Extra,
    },
    MessageDelta {
        delta: MessageDeltaBody,
        #[serde(default)]
        usage: DeltaUsage,
        /// `context_management`, ...
        #[serde(flatten)]
        extra: Extra,
    },
    MessageStop {
        #[serde(flatten)]
        extra: Extra,
    },
    Ping {
        #[serde(flatten)]
        extra: Extra,
    },
    Error {
        error: ErrorDetail,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(untagged)]
    Other(Extra),
}

impl StreamEvent {
    /// The SSE event name (`event:` line) for this event: its `type`.
    pub fn event_name(&self) -> &str {
        match self {
            StreamEvent::MessageStart { .. } => "message_start",
            StreamEvent::ContentBlockStart { .. } => "content_block_start",
            StreamEvent::ContentBlockDelta { .. } => "content_block_delta",
            StreamEvent::ContentBlockStop { .. } => "content_block_stop",
            StreamEvent::MessageDelta { .. } => "message_delta",
            StreamEvent::MessageStop { .. } => "message_stop",
            StreamEvent::Ping { .. } => "ping",
            StreamEvent::Error { .. } => "error",
            StreamEvent::Other(map) => map.get("type").and_then(Value::as_str).unwrap_or(""),
        }
    }

    /// A `ping`, for keeping an idle stream alive.
    pub fn ping() -> Self {
        StreamEvent::Ping {
            extra: Extra::new(),
        }
    }

    /// A mid-stream `error` event.
    pub fn error(kind: ErrorType, message: impl Into<String>) -> Self {
        StreamEvent::Error {
            error: ErrorDetail::new(kind, message),
            extra: Extra::new(),
        }
    }

    /// The bytes that end a passthrough stream whose upstream broke: an `api_error` event, after
    /// a blank line when the bytes forwarded so far stopped mid-frame (see
    /// [`crate::sse::ends_frame`]), so the error is a frame of its own, not the tail of a cut one.
    pub fn failure_frame(mid_frame: bool, message: impl Into<String>) -> Vec<u8> {
        let mut out = if mid_frame {
            b"\n\n".to_vec()
        } else {
            Vec::new()
        };
        // An error event holds two strings; serializing it cannot fail.
        let _ = StreamEvent::error(ErrorType::ApiError, message).write_sse(&mut out);
        out
    }

    /// Appends this event as one SSE frame (`event: <type>\ndata: <json>\n\n`). Compact JSON
    /// holds no raw line breaks, so one `data:` line always suffices.
    pub fn write_sse(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(self.event_name().as_bytes());
        out.extend_from_slice(b"\ndata: ");
        if !self.write_plain(out)? {
            serde_json::to_writer(&mut *out, self)?;
        }
        out.extend_from_slice(b"\n\n");
        Ok(())
    }

    /// Writes the JSON of the events a translated stream sends most (deltas, block stops, the
    /// stop, pings; with no extra members) exactly as serde writes them, without serde's
    /// tagged-enum machinery (a map serializer per level, for a few dozen bytes): `false` when
    /// the event is not one of them and nothing was written.
    fn write_plain(&self, out: &mut Vec<u8>) -> Result<bool, serde_json::Error> {
        use std::io::Write as _;
        match self {
            StreamEvent::ContentBlockDelta {
                index,
                delta,
                extra,
            } if extra.is_empty() => {
                let (kind, field, text) = match delta {
                    BlockDelta::TextDelta { text, extra } if extra.is_empty() => {
                        ("text_delta", "text", text)
                    }
                    BlockDelta::InputJsonDelta {
                        partial_json,
                        extra,
                    } if extra.is_empty() => ("input_json_delta", "partial_json", partial_json),
                    BlockDelta::ThinkingDelta { thinking, extra } if extra.is_empty() => {
                        ("thinking_delta", "thinking", thinking)
                    }
                    BlockDelta::TextDelta { .. }
                    | BlockDelta::InputJsonDelta { .. }
                    | BlockDelta::ThinkingDelta { .. }
                    | BlockDelta::SignatureDelta { .. }
                    | BlockDelta::CitationsDelta { .. }
                    | BlockDelta::Other(_) => return Ok(false),
                };
                write!(
                    out,
                    "{{\"type\":\"content_block_delta\",\"index\":{index},\"delta\":{{\"type\":\"{kind}\",\"{field}\":"
                )
                .map_err(serde_json::Error::io)?;
                serde_json::to_writer(&mut *out, text)?;
                out.extend_from_slice(b"}}");
            }
            StreamEvent::ContentBlockStop { index, extra } if extra.is_empty() => {
                write!(out, "{{\"type\":\"content_block_stop\",\"index\":{index}}}")
                    .map_err(serde_json::Error::io)?;
            }
            StreamEvent::MessageStop { extra } if extra.is_empty() => {
                out.extend_from_slice(br#"{"type":"message_stop"}"#);
            }
            StreamEvent::Ping { extra } if extra.is_empty() => {
                out.extend_from_slice(br#"{"type":"ping"}"#);
            }
            StreamEvent::MessageStart { .. }
            | StreamEvent::ContentBlockStart { .. }
            | StreamEvent::ContentBlockDelta { .. }
            | StreamEvent::ContentBlockStop { .. }
            | StreamEvent::MessageDelta { .. }
            | StreamEvent::MessageStop { .. }
            | StreamEvent::Ping { .. }
            | StreamEvent::Error { .. }
            | StreamEvent::Other(_) => return Ok(false),
        }
        Ok(true)
    }
}

/// An error response body: `{"type":"error","error":{"type":...,"message":...}}`.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorBody {
    #[serde(rename = "type")]
    pub kind: ErrorTag,
    pub error: ErrorDetail,
    pub request_id: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl ErrorBody {
    /// An error body with no request id.
    pub fn new(kind: ErrorType, message: impl Into<String>) -> Self {
        Self {
            kind: ErrorTag,
            error: ErrorDetail::new(kind, message),
            request_id: None,
            extra: Extra::new(),
        }
    }
}

/// The `error` object of an error body or an `error` event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorDetail {
    #[serde(rename = "type")]
    pub kind: ErrorType,
    #[serde(default)]
    pub message: String,
    #[serde(flatten)]
    pub extra: Extra,
}

impl ErrorDetail {
    pub fn new(kind: ErrorType, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            extra: Extra::new(),
        }
    }
}

/// Anthropic's error types (docs: errors). [`crate::error::error_type_for_status`] maps an HTTP
/// status to one.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorType {
    InvalidRequestError,
    AuthenticationError,
    BillingError,
    PermissionError,
    NotFoundError,
    RequestTooLarge,
    RateLimitError,
    ApiError,
    TimeoutError,
    OverloadedError,
    #[serde(untagged)]
    Other(String),
}

/// Why a stream broke the event-order contract (see [`StreamAccumulator`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamViolation {
    #[error("first event is {0}, not message_start")]
    NoMessageStart(String),
    #[error("a second message_start")]
    DuplicateMessageStart,
    #[error("content_block_start index {got}, expected {expected}")]
    BlockIndexGap { expected: u32, got: u32 },
    #[error("{event} for block {index}, which was never started")]
    BlockNotFound { event: &'static str, index: u32 },
    #[error("{event} for block {index}, which was already stopped")]
    BlockAlreadyStopped { event: &'static str, index: u32 },
    #[error("{delta} delta for block {index}, which is a {block} block")]
    DeltaTypeMismatch {
        index: u32,
        delta: &'static str,
        block: String,
    },
    #[error("tool_use block {index} started with a non-empty input")]
    ToolInputNotEmpty { index: u32 },
    #[error("tool_use block {index} input is not valid json: {reason}")]
    ToolInputInvalid { index: u32, reason: String },
    #[error("message_delta while block {index} is still open")]
    BlockOpenAtMessageDelta { index: u32 },
    #[error("message_stop without message_delta")]
    StopWithoutDelta,
    #[error("{0} after message_stop")]
    EventAfterStop(String),
    #[error("the stream carried an error event: {0}")]
    ErrorEvent(String),
    #[error("the stream ended without message_stop")]
    Truncated,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BlockState {
    Open,
    Stopped,
}

/// Rebuilds a [`MessagesResponse`] from stream events, refusing streams that break the contract
/// clients rely on: exactly one `message_start` first; blocks started at contiguous indices;
/// deltas only to started, unstopped blocks of the matching kind; `tool_use` started with
/// `input: {}` and its arguments only in `input_json_delta`s that join to valid JSON; every
/// block stopped before `message_delta`; `message_stop` last. `ping` is ignored anywhere.
#[derive(Debug, Default)]
pub struct StreamAccumulator {
    message: Option<MessagesResponse>,
    states: Vec<BlockState>,
    tool_json: Vec<Option<String>>,
    saw_delta: bool,
    stopped: bool,
}

impl StreamAccumulator {
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies one event.
    pub fn push(&mut self, event: &StreamEvent) -> Result<(), StreamViolation> {
        if self.stopped {
            if let StreamEvent::Ping { .. } = event {
                return Ok(());
            }
            return Err(StreamViolation::EventAfterStop(
                event.event_name().to_owned(),
            ));
        }
        if let StreamEvent::Error { error, .. } = event {
            return Err(StreamViolation::ErrorEvent(error.message.clone()));
        }
        let Some(message) = self.message.as_mut() else {
            return match event {
                StreamEvent::MessageStart { message, .. } => {
                    self.message = Some(message.clone());
                    Ok(())
                }
                StreamEvent::Ping { .. } => Ok(()),
                StreamEvent::ContentBlockStart { .. }
                | StreamEvent::ContentBlockDelta { .. }
                | StreamEvent::ContentBlockStop { .. }
                | StreamEvent::MessageDelta { .. }
                | StreamEvent::MessageStop { .. }
                | StreamEvent::Error { .. }
                | StreamEvent::Other(_) => Err(StreamViolation::NoMessageStart(
                    event.event_name().to_owned(),
                )),
            };
        };
        match event {
            StreamEvent::MessageStart { .. } => Err(StreamViolation::DuplicateMessageStart),
            StreamEvent::Ping { .. } | StreamEvent::Other(_) => Ok(()),
            StreamEvent::Error { .. } => Ok(()),
            StreamEvent::ContentBlockStart {
                index,
                content_block,
                ..
            } => {
                let expected = u32::try_from(self.states.len()).unwrap_or(u32::MAX);
                if *index != expected {
                    return Err(StreamViolation::BlockIndexGap {
                        expected,
                        got: *index,
                    });
                }
                let mut tool_json = None;
                if let ContentBlock::ToolUse { input, .. } = content_block {
                    if input.as_object().is_none_or(|o| !o.is_empty()) {
                        return Err(StreamViolation::ToolInputNotEmpty { index: *index });
                    }
                    tool_json = Some(String::new());
                }
                self.states.push(BlockState::Open);
                self.tool_json.push(tool_json);
                message.content.push(content_block.clone());
                Ok(())
            }
            StreamEvent::ContentBlockDelta { index, delta, .. } => {
                let i = Self::open_block(&self.states, *index, "content_block_delta")?;
                let block = &mut message.content[i];
                let mismatch = |delta: &'static str, block: &ContentBlock| {
                    Err(StreamViolation::DeltaTypeMismatch {
                        index: *index,
                        delta,
                        block: block.block_type().to_owned(),
                    })
                };
                match (delta, &mut *block) {
                    (BlockDelta::TextDelta { text, .. }, ContentBlock::Text { text: t, .. }) => {
                        t.push_str(text);
                    }
                    (
                        BlockDelta::ThinkingDelta { thinking, .. },
                        ContentBlock::Thinking { thinking: t, .. },
                    ) => t.push_str(thinking),
                    (
                        BlockDelta::SignatureDelta { signature, .. },
                        ContentBlock::Thinking { signature: s, .. },
                    ) => s.get_or_insert_with(String::new).push_str(signature),
                    (
                        BlockDelta::InputJsonDelta { partial_json, .. },
                        ContentBlock::ToolUse { .. },
                    ) => {
                        if let Some(Some(json)) = self.tool_json.get_mut(i) {
                            json.push_str(partial_json);
                        }
                    }
                    (BlockDelta::CitationsDelta { .. }, ContentBlock::Text { .. })
                    | (BlockDelta::Other(_), _) => {}
                    (BlockDelta::TextDelta { .. }, other) => return mismatch("text", other),
                    (BlockDelta::ThinkingDelta { .. }, other) => {
                        return mismatch("thinking", other);
                    }
                    (BlockDelta::SignatureDelta { .. }, other) => {
                        return mismatch("signature", other);
                    }
                    (BlockDelta::InputJsonDelta { .. }, other) => {
                        return mismatch("input_json", other);
                    }
                    (BlockDelta::CitationsDelta { .. }, other) => {
                        return mismatch("citations", other);
                    }
                }
                Ok(())
            }
            StreamEvent::ContentBlockStop { index, .. } => {
                let i = Self::open_block(&self.states, *index, "content_block_stop")?;
                self.states[i] = BlockState::Stopped;
                if let (Some(Some(json)), ContentBlock::ToolUse { input, .. }) =
                    (self.tool_json.get_mut(i), &mut message.content[i])
                {
                    // The SDK treats an empty argument string as `{}`.
                    if !json.is_empty() {
                        *input = serde_json::from_str(json).map_err(|e| {
                            StreamViolation::ToolInputInvalid {
                                index: *index,
                                reason: e.to_string(),
                            }
                        })?;
                    }
                }
                Ok(())
            }
            StreamEvent::MessageDelta { delta, usage, .. } => {
                if let Some(open) = self.states.iter().position(|s| *s == BlockState::Open) {
                    return Err(StreamViolation::BlockOpenAtMessageDelta {
                        index: u32::try_from(open).unwrap_or(u32::MAX),
                    });
                }
                self.saw_delta = true;
                message.stop_reason.clone_from(&delta.stop_reason);
                message.stop_sequence.clone_from(&delta.stop_sequence);
                message.usage.output_tokens = usage.output_tokens;
                if let Some(n) = usage.input_tokens {
                    message.usage.input_tokens = n;
                }
                if let Some(n) = usage.cache_read_input_tokens {
                    message.usage.cache_read_input_tokens = Some(n);
                }
                if let Some(n) = usage.cache_creation_input_tokens {
                    message.usage.cache_creation_input_tokens = Some(n);
                }
                // Whether the count is an estimate is the last usage's to say.
                if is_estimate(&usage.extra) {
                    message.usage.extra.extend(estimate_mark());
                } else {
                    message.usage.extra.remove(ESTIMATE_MARK);
                }
                Ok(())
            }
            StreamEvent::MessageStop { .. } => {
                if !self.saw_delta {
                    return Err(StreamViolation::StopWithoutDelta);
                }
                self.stopped = true;
                Ok(())
            }
        }
    }

    fn open_block(
        states: &[BlockState],
        index: u32,
        event: &'static str,
    ) -> Result<usize, StreamViolation> {
        let i = usize::try_from(index).unwrap_or(usize::MAX);
        match states.get(i) {
            None => Err(StreamViolation::BlockNotFound { event, index }),
            Some(BlockState::Stopped) => Err(StreamViolation::BlockAlreadyStopped { event, index }),
            Some(BlockState::Open) => Ok(i),
        }
    }

    /// The message, once `message_stop` was seen.
    pub fn finish(self) -> Result<MessagesResponse, StreamViolation> {
        match (self.stopped, self.message) {
            (true, Some(message)) => Ok(message),
            (false, _) | (true, None) => Err(StreamViolation::Truncated),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn unknown_block_types_survive() {
        let v =
            json!({"type":"server_tool_use","id":"srv_1","name":"web_search","input":{"q":"x"}});
        let b: ContentBlock = serde_json::from_value(v.clone()).unwrap();
        assert!(matches!(b, ContentBlock::Other(_)));
        assert_eq!(b.block_type(), "server_tool_use");
        assert_eq!(serde_json::to_value(&b).unwrap(), v);
    }

    #[test]
    fn response_serializes_null_stop_fields() {
        let r = MessagesResponse::new("msg_1", "m");
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["stop_reason"], Value::Null);
        assert_eq!(v["stop_sequence"], Value::Null);
        assert_eq!(v["content"], json!([]));
        assert_eq!(v["type"], "message");
    }

    #[test]
    fn unknown_stop_reason_and_error_type_are_kept() {
        let s: StopReason = serde_json::from_str(r#""brand_new""#).unwrap();
        assert_eq!(s, StopReason::Other("brand_new".into()));
        let e: ErrorType = serde_json::from_str(r#""weird_error""#).unwrap();
        assert_eq!(serde_json::to_string(&e).unwrap(), r#""weird_error""#);
    }

    #[test]
    fn sse_frame_uses_the_type_as_event_name() {
        let mut out = Vec::new();
        StreamEvent::ping().write_sse(&mut out).unwrap();
        assert_eq!(out, b"event: ping\ndata: {\"type\":\"ping\"}\n\n");
    }

    #[test]
    fn temperature_keeps_its_number_form() {
        let v = json!({"model":"m","messages":[],"temperature":1,"top_p":0.5});
        let r: MessagesRequest = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(serde_json::to_value(&r).unwrap(), v);
    }

    /// The plain writer writes what serde writes, byte for byte, for every event it takes
    /// (texts with quotes, escapes, controls, non-ASCII) and leaves the rest to serde.
    #[test]
    fn plain_event_json_is_serde_json() {
        let texts = [
            "",
            "hi",
            "a \"quoted\" \\ back\nslash\t\r\u{1}\u{1f}\u{7f}",
            "é😀\u{2028}",
            "{\"a\": [1, 2]}",
        ];
        let mut extra = Extra::new();
        extra.insert("x".into(), Value::from(1));
        let mut events = vec![
            StreamEvent::ping(),
            StreamEvent::MessageStop {
                extra: Extra::new(),
            },
            StreamEvent::MessageStop {
                extra: extra.clone(),
            },
            StreamEvent::ContentBlockStop {
                index: 0,
                extra: Extra::new(),
            },
            StreamEvent::ContentBlockStop {
                index: u32::MAX,
                extra: extra.clone(),
            },
            StreamEvent::error(ErrorType::ApiError, "x"),
        ];
        for (i, t) in texts.iter().enumerate() {
            let t = (*t).to_owned();
            let index = u32::try_from(i).unwrap_or(0) * 1000;
            for delta in [
                BlockDelta::TextDelta {
                    text: t.clone(),
                    extra: Extra::new(),
                },
                BlockDelta::InputJsonDelta {
                    partial_json: t.clone(),
                    extra: Extra::new(),
                },
                BlockDelta::ThinkingDelta {
                    thinking: t.clone(),
                    extra: Extra::new(),
                },
                BlockDelta::TextDelta {
                    text: t.clone(),
                    extra: extra.clone(),
                },
                BlockDelta::SignatureDelta {
                    signature: t.clone(),
                    extra: Extra::new(),
                },
            ] {
                events.push(StreamEvent::ContentBlockDelta {
                    index,
                    delta: delta.clone(),
                    extra: Extra::new(),
                });
                events.push(StreamEvent::ContentBlockDelta {
                    index,
                    delta,
                    extra: extra.clone(),
                });
            }
        }
        let mut plain = 0;
        for e in &events {
            let mut fast = Vec::new();
            let wrote = e.write_plain(&mut fast).unwrap();
            if wrote {
                plain += 1;
                assert_eq!(
                    String::from_utf8(fast).unwrap(),
                    serde_json::to_string(e).unwrap()
                );
            } else {
                assert!(fast.is_empty());
            }
        }
        assert_eq!(plain, 3 + 3 * texts.len());
    }
}
