//! Anthropic Messages ⇄ OpenAI Chat Completions, for the bridge's `provider = "openai"` models.
//!
//! Entry points:
//! - [`anthropic_into_chat`]: the request.
//! - [`chat_to_anthropic_response`]: a non-streamed response.
//! - [`ChatStreamTranslator`]: a streamed response, chunk by chunk.
//! - [`crate::error::anthropic_error_from_openai`]: an error response.
//!
//! OpenAI Responses ⇄ chat completions (for Codex, through the blackbox proxy) lives in
//! [`responses`]: [`responses_into_chat`], [`chat_to_responses_response`],
//! [`ResponsesStreamTranslator`].
//!
//! The rules, each pinned by a golden test under `wire/tests/golden/`:
//!
//! **Request.** `system` (string or text blocks, Claude Code's billing-header block removed)
//! becomes one leading system message, blocks joined by a blank line. Mid-conversation
//! `role: "system"` messages are folded into the adjacent user turn ([`crate::normalize`]).
//! User text and images become content parts (base64 → `data:` URL, url → url; PDFs → `file`
//! parts); a user turn that is one text block stays a plain string. `tool_result` blocks become
//! `role: "tool"` messages placed *before* the rest of that user turn, since OpenAI wants them
//! right after the assistant's `tool_calls`; their block lists are flattened to text, and
//! images (or documents) inside them move to a user message after the tool messages, because
//! tool messages cannot carry images on most servers. Assistant text blocks are concatenated
//! without a separator (so text the upstream generated goes back byte for byte, which keeps
//! prefix caches warm), `tool_use` becomes `tool_calls`, thinking becomes `reasoning_content`
//! when [`ChatOptions::reasoning_passback`] is set. Tools become functions (server tools are
//! skipped; names over 64 characters are shortened, see [`ToolNames`]); `tool_choice` auto /
//! any / tool / none → `"auto"` / `"required"` / named function / `"none"`, and
//! `disable_parallel_tool_use` → `parallel_tool_calls: false`. `stop_sequences` → `stop`,
//! `metadata.user_id` → `user` only when [`ChatOptions::forward_user`] is set (the rest of
//! `metadata` is never sent), `thinking` → `reasoning_effort` or `reasoning` as
//! [`ChatOptions::reasoning`] says ([`ReasoningField`] states the effort buckets),
//! `max_tokens` is clamped to [`ChatOptions::max_output_tokens`], streaming requests ask for
//! `include_usage`. Other top-level Anthropic fields have no chat equivalent and are not sent.
//!
//! **Response.** Content order is thinking (from `reasoning_content` / `reasoning`), text, then
//! tool calls; `content` is always an array. Finish reason → stop reason: `stop` → `end_turn`
//! (or `stop_sequence` when the server names the matched stop string), `length` →
//! `max_tokens`, `tool_calls` / `function_call` → `tool_use`, `content_filter` → `refusal`
//! (the output was withheld by the provider's filter, which is what Anthropic's `refusal`
//! means; `end_turn` would present a cut-off answer as complete), anything else → `end_turn`.
//! If tool calls were emitted the stop reason is `tool_use` whatever the finish reason said,
//! except `length`, which stays `max_tokens` (the calls may be cut off). Usage:
//! `input_tokens = prompt_tokens - cached_tokens`, `cache_read_input_tokens = cached_tokens`,
//! `cache_creation_input_tokens = 0`, `output_tokens = completion_tokens`.

mod borrowed;
mod chunks;
mod request;
mod response;
pub mod responses;
mod responses_request;
mod responses_response;
mod responses_stream;
mod stream;
mod tool_names;

pub use borrowed::{AnthropicBody, NoUnicodeEscapes};
pub use chunks::StreamTranslator;
pub use request::anthropic_into_chat;
pub use response::chat_to_anthropic_response;
pub use responses::{ResponsesOptions, responses_usage_from_chat};
pub use responses_request::responses_into_chat;
pub use responses_response::chat_to_responses_response;
pub use responses_stream::ResponsesStreamTranslator;
pub use stream::ChatStreamTranslator;
pub use tool_names::{MAX_TOOL_NAME_LEN, ToolNames, upstream_tool_name};

use std::sync::atomic::{AtomicU64, Ordering};

use crate::anthropic::{MessagesRequest, StopReason, Usage};
use crate::chat::{ChatUsage, FinishReason};

/// Which field carries the output limit in a chat request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum MaxTokensField {
    /// `max_completion_tokens`: what OpenAI's reasoning models require (they reject
    /// `max_tokens`); vLLM and SGLang read it too.
    #[default]
    MaxCompletionTokens,
    /// `max_tokens`: for servers that only know the older field.
    MaxTokens,
    /// Both, as vLLM's own Anthropic front end does.
    Both,
}

impl MaxTokensField {
    /// `(max_tokens, max_completion_tokens)` carrying `limit` in the field(s) this names.
    pub(crate) fn carry(self, limit: Option<u64>) -> (Option<u64>, Option<u64>) {
        match self {
            MaxTokensField::MaxCompletionTokens => (None, limit),
            MaxTokensField::MaxTokens => (limit, None),
            MaxTokensField::Both => (limit, limit),
        }
    }
}

/// What to do with mid-conversation `role: "system"` messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InlineSystem {
    /// Fold them into the adjacent user turn ([`crate::normalize`]).
    #[default]
    Fold,
    /// Send them as chat `system` messages in place (for servers whose templates render
    /// them).
    Keep,
}

/// Settings of a request translation, from the bridge's model catalogue entry. A Responses
/// request ([`responses_into_chat`]) reads `model`, `max_output_tokens`, `max_tokens_field`,
/// `include_usage`, `reasoning_passback` and `reasoning`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatOptions {
    /// The upstream model name; `None` keeps the request's `model`.
    pub model: Option<String>,
    /// The model's output limit: `max_tokens` is clamped to it.
    pub max_output_tokens: Option<u64>,
    pub max_tokens_field: MaxTokensField,
    /// On streaming requests, set `stream_options.include_usage` so the upstream reports usage
    /// in a final chunk (without it, streamed usage is an estimate).
    pub include_usage: bool,
    /// Drop Claude Code's per-request billing-header system block.
    pub strip_billing_header: bool,
    pub inline_system: InlineSystem,
    /// Send assistant thinking back as `reasoning_content` (DeepSeek and Kimi thinking modes
    /// return 400 on tool-call turns without it). Turn off for servers that reject unknown
    /// message fields.
    pub reasoning_passback: bool,
    /// Which field carries the request's `thinking` ([`ReasoningField`]); for a Responses
    /// request, where its `reasoning.effort` goes. Only for reasoning models: others reject
    /// the field.
    pub reasoning: ReasoningField,
    /// Forward `metadata.user_id` as `user`. Off by default: Claude Code puts its device,
    /// account and session ids there, which identify the person to the provider.
    pub forward_user: bool,
    /// Forward `top_k` (vLLM, SGLang and Ollama accept it; OpenAI does not).
    pub forward_top_k: bool,
}

/// Where a request's `thinking` goes in a chat request (the model's `reasoning` key).
///
/// The effort: `thinking.type = "enabled"` buckets `budget_tokens` as < 4096 → `low`,
/// < 16384 → `medium`, else `high` (so Claude Code's "think" 4,000, "think hard" 10,000 and
/// "ultrathink" 31,999 land on the three levels; no budget counts as high); `"adaptive"`
/// takes `output_config.effort` (`low`/`medium`/`high`; anything above is `high`, none is
/// `high`, Anthropic's default). `"disabled"` (and a type we do not know) sends nothing, so
/// the upstream's default applies: there is no off value every server accepts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ReasoningField {
    /// `thinking` is not sent (for models that reject reasoning settings).
    #[default]
    None,
    /// `"reasoning_effort": "<effort>"`: OpenAI's reasoning models, vLLM, SGLang, Ollama.
    ReasoningEffort,
    /// `"reasoning": {"effort": "<effort>"}`: OpenRouter and servers in its shape.
    Reasoning,
}

impl ChatOptions {
    /// The options for a rollout router (blackbox-server's proxy): the router reads
    /// `max_tokens`, keeps `top_k`, and sees the conversation as the agent sent it
    /// (reasoning passed back). The router is the operator's own, so it keeps the agent's
    /// session ids (`forward_user`).
    #[must_use]
    pub fn router() -> Self {
        ChatOptions {
            max_tokens_field: MaxTokensField::MaxTokens,
            include_usage: true,
            forward_top_k: true,
            forward_user: true,
            ..ChatOptions::default()
        }
    }

    /// The chat request's output limit fields for an Anthropic `max_tokens`: the client's
    /// ask clamped to [`ChatOptions::max_output_tokens`], or that cap when it asked none
    /// (chat servers default to their own, often far larger, limit).
    pub(crate) fn anthropic_output_limit(&self, asked: Option<u64>) -> (Option<u64>, Option<u64>) {
        let limit = match (asked, self.max_output_tokens) {
            (Some(asked), Some(cap)) => Some(asked.min(cap)),
            (asked, cap) => asked.or(cap),
        };
        self.max_tokens_field.carry(limit)
    }
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            model: None,
            max_output_tokens: None,
            max_tokens_field: MaxTokensField::default(),
            include_usage: true,
            strip_billing_header: true,
            inline_system: InlineSystem::default(),
            reasoning_passback: true,
            reasoning: ReasoningField::None,
            forward_user: false,
            forward_top_k: false,
        }
    }
}

/// An effort as the chat request's `reasoning_effort` or `reasoning` field, as `field` says.
fn reasoning_fields(
    field: ReasoningField,
    effort: Option<String>,
) -> (Option<String>, Option<crate::chat::ReasoningConfig>) {
    match field {
        ReasoningField::None => (None, None),
        ReasoningField::ReasoningEffort => (effort, None),
        ReasoningField::Reasoning => (
            None,
            effort.map(|e| crate::chat::ReasoningConfig {
                effort: Some(e),
                extra: crate::chat::Extra::new(),
            }),
        ),
    }
}

/// Settings of a response translation (streamed or not).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResponseOptions {
    /// The model name to report: the one the client asked for. `None` reports the upstream's.
    pub model: Option<String>,
    /// The message id to report; `None` derives one from the upstream id.
    pub message_id: Option<String>,
    /// Maps shortened tool names back; build it from the request with
    /// [`ToolNames::from_request`].
    pub tool_names: ToolNames,
    /// The request's `stop_sequences`, to recognize a stop string the server reports.
    pub stop_sequences: Vec<String>,
    /// Input tokens to report in `message_start` before the upstream's real count arrives (an
    /// estimate, or 0), and in the final usage if the upstream never reports usage.
    pub input_tokens_estimate: u64,
}

impl ResponseOptions {
    /// The options for answering `req`: its model reported back, its long tool names mapped
    /// back, its stop sequences recognized. Call it before the request is consumed by
    /// [`anthropic_into_chat`].
    pub fn for_request(req: &MessagesRequest) -> Self {
        Self {
            model: Some(req.model.clone()),
            message_id: None,
            tool_names: ToolNames::from_request(req),
            stop_sequences: req.stop_sequences.clone().unwrap_or_default(),
            input_tokens_estimate: 0,
        }
    }
}

/// Why a translation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TranslateError {
    /// The request holds something chat completions cannot express.
    #[error("{what} cannot be sent to a chat completions api")]
    Unsupported { what: String },
    /// A block of a known type is missing required fields or sits where it cannot.
    #[error("messages[{message}]: {problem}")]
    Malformed { message: usize, problem: String },
    /// The upstream response has no choices.
    #[error("upstream response has no choices")]
    NoChoices,
}

/// Finish reason → stop reason, before the "tool calls were emitted" rule.
pub fn stop_reason_for(finish: Option<&FinishReason>) -> StopReason {
    match finish {
        Some(FinishReason::Length) => StopReason::MaxTokens,
        Some(FinishReason::ToolCalls | FinishReason::FunctionCall) => StopReason::ToolUse,
        Some(FinishReason::ContentFilter) => StopReason::Refusal,
        Some(FinishReason::Stop | FinishReason::Other(_)) | None => StopReason::EndTurn,
    }
}

/// The full stop-reason rule: emitted tool calls mean `tool_use` (unless the output was cut
/// at `max_tokens`), a reported stop string that the request asked for means `stop_sequence`.
fn final_stop(
    finish: Option<&FinishReason>,
    had_tool_calls: bool,
    matched_stop: Option<&str>,
    stop_sequences: &[String],
) -> (StopReason, Option<String>) {
    let base = stop_reason_for(finish);
    if had_tool_calls && base != StopReason::MaxTokens && base != StopReason::Refusal {
        return (StopReason::ToolUse, None);
    }
    if base == StopReason::EndTurn
        && matches!(finish, Some(FinishReason::Stop))
        && let Some(s) = matched_stop
        && stop_sequences.iter().any(|q| q == s)
    {
        return (StopReason::StopSequence, Some(s.to_owned()));
    }
    (base, None)
}

/// OpenAI usage → Anthropic usage (cached tokens moved out of the input count).
pub fn usage_from_chat(u: &ChatUsage) -> Usage {
    let cached = u.cached_tokens();
    Usage {
        input_tokens: u.prompt_tokens.saturating_sub(cached),
        cache_creation_input_tokens: Some(0),
        cache_read_input_tokens: Some(cached),
        output_tokens: u.completion_tokens,
        extra: Default::default(),
    }
}

/// The usage to report when the upstream reported none: the caller's input estimate and
/// bytes/4 of output, rounded up (the usual estimate; Anthropic tokens average about 4 bytes).
fn estimated_usage(input_tokens: u64, output_bytes: usize) -> Usage {
    Usage {
        input_tokens,
        cache_creation_input_tokens: Some(0),
        cache_read_input_tokens: Some(0),
        output_tokens: u64::try_from(output_bytes.div_ceil(4)).unwrap_or(u64::MAX),
        extra: crate::anthropic::estimate_mark(),
    }
}

/// `msg_` + the upstream id, so ids look like Anthropic's; ids are opaque to clients.
fn message_id_from(upstream: &str) -> String {
    if upstream.starts_with("msg_") {
        upstream.to_owned()
    } else if upstream.is_empty() {
        "msg_bridge".to_owned()
    } else {
        format!("msg_{upstream}")
    }
}

/// An id for an output started before the upstream named one (`msg_...`, `resp_...`): unique
/// within the process and unlikely to repeat across restarts.
fn fresh_id(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!("{prefix}_{:x}{n:04x}", now_nanos())
}

fn now_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// Makes a tool call id acceptable to Anthropic clients (`^[a-zA-Z0-9_-]+$`): some servers
/// emit ids such as `functions.Bash:0`.
pub fn sanitize_tool_id(id: &str) -> std::borrow::Cow<'_, str> {
    let ok = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if !id.is_empty() && id.chars().all(ok) {
        return std::borrow::Cow::Borrowed(id);
    }
    if id.is_empty() {
        return std::borrow::Cow::Borrowed("toolu_missing");
    }
    std::borrow::Cow::Owned(id.chars().map(|c| if ok(c) { c } else { '_' }).collect())
}

/// The schema of a tool that declares none: an object with no properties.
fn empty_schema() -> crate::serde_util::RawJson {
    crate::serde_util::RawJson::from_value(&serde_json::json!({"type": "object", "properties": {}}))
}

/// Parses tool-call arguments: `""` is `{}`; text that is not JSON is kept as a string (the
/// client then reports the malformed call to the model, which can retry) rather than replaced
/// by a silent `{}` that would run the tool with no arguments.
fn tool_input(arguments: &str) -> serde_json::Value {
    if arguments.trim().is_empty() {
        return serde_json::Value::Object(Default::default());
    }
    serde_json::from_str(arguments)
        .unwrap_or_else(|_| serde_json::Value::String(arguments.to_owned()))
}
