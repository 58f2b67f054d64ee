//! Typed OpenAI Chat Completions bodies (`POST /v1/chat/completions`): the request, the
//! response, the streamed chunk and the error body, as spoken by OpenAI and by the
//! OpenAI-compatible servers we reach (vLLM, SGLang, Ollama, DeepSeek, ...).
//!
//! Like [`crate::anthropic`], every object keeps the fields we do not name in `extra`, and
//! tagged unions keep unknown variants in an `Other` map. Server extensions we read are named:
//! `reasoning_content` / `reasoning` (vLLM, SGLang, DeepSeek), vLLM's per-choice `stop_reason`
//! and SGLang's `matched_stop` stay in `extra` and are read through accessors.

use serde::{Deserialize, Serialize};
use serde_json::{Map, Number, Value};

pub use crate::serde_util::{RawJson, TextOrList};

/// Unknown fields of an object, kept in arrival order.
pub type Extra = Map<String, Value>;

/// A message's `content`: a string or a list of parts.
pub type ChatContent = TextOrList<ContentPart>;

/// `POST /v1/chat/completions` request body.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    /// Deprecated by OpenAI for reasoning models (which reject it) but the only limit some
    /// compatible servers read; see `translate::MaxTokensField`.
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub stop: Option<TextOrList<String>>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub temperature: Option<Number>,
    pub top_p: Option<Number>,
    pub tools: Option<Vec<ChatTool>>,
    pub tool_choice: Option<ChatToolChoice>,
    pub parallel_tool_calls: Option<bool>,
    pub user: Option<String>,
    pub reasoning_effort: Option<String>,
    /// OpenRouter's reasoning settings (`{"effort": ...}`).
    pub reasoning: Option<ReasoningConfig>,
    pub response_format: Option<Value>,
    /// `n`, `seed`, `top_k` (vLLM/SGLang/Ollama), `chat_template_kwargs`, ...
    #[serde(flatten)]
    pub extra: Extra,
}

/// `reasoning` of a request (OpenRouter's shape: `effort`, or `max_tokens`, `exclude`, ...).
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ReasoningConfig {
    pub effort: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `stream_options` of a request.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct StreamOptions {
    /// Ask for a final chunk with `choices: []` and the whole `usage`.
    pub include_usage: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// One message of a request, tagged by `role`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum ChatMessage {
    System {
        content: ChatContent,
        #[serde(flatten)]
        extra: Extra,
    },
    Developer {
        content: ChatContent,
        #[serde(flatten)]
        extra: Extra,
    },
    User {
        content: ChatContent,
        #[serde(flatten)]
        extra: Extra,
    },
    Assistant {
        /// `null` (serialized, not omitted) when the turn is only tool calls, as OpenAI itself
        /// returns it.
        #[serde(default)]
        content: Option<ChatContent>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        tool_calls: Option<Vec<ToolCall>>,
        /// Thinking passed back to servers that need it (DeepSeek and Kimi thinking modes
        /// reject tool-call turns without it).
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            serialize_with = "crate::serde_util::opt_text"
        )]
        reasoning_content: Option<String>,
        #[serde(flatten)]
        extra: Extra,
    },
    Tool {
        tool_call_id: String,
        content: ChatContent,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(untagged)]
    Other(Extra),
}

/// One part of a list-shaped `content`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    Text {
        #[serde(serialize_with = "crate::serde_util::text")]
        text: String,
        #[serde(flatten)]
        extra: Extra,
    },
    ImageUrl {
        image_url: ImageUrl,
        #[serde(flatten)]
        extra: Extra,
    },
    /// A file (PDF) as `{"file_data": "data:application/pdf;base64,...", "filename": ...}`.
    File {
        file: Value,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(untagged)]
    Other(Extra),
}

impl ContentPart {
    /// A text part with no extra fields.
    pub fn text(text: impl Into<String>) -> Self {
        ContentPart::Text {
            text: text.into(),
            extra: Extra::new(),
        }
    }
}

/// `image_url` of an image part: an `https:` URL or a `data:` URL.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ImageUrl {
    pub url: String,
    pub detail: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A complete tool call of an assistant message.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionCall,
    #[serde(flatten)]
    pub extra: Extra,
}

fn function_type() -> String {
    "function".to_owned()
}

/// The function part of a tool call: its name and its arguments as a JSON string.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    #[serde(default, serialize_with = "crate::serde_util::text")]
    pub arguments: String,
    #[serde(flatten)]
    pub extra: Extra,
}

/// One entry of `tools`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatTool {
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: FunctionDef,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A function tool's definition.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FunctionDef {
    pub name: String,
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        serialize_with = "crate::serde_util::opt_text"
    )]
    pub description: Option<String>,
    /// The JSON schema, opaque here: passed on as written.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<RawJson>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `tool_choice`: a mode string or a named function.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ChatToolChoice {
    Mode(ToolChoiceMode),
    Named(NamedToolChoice),
}

/// The string forms of `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoiceMode {
    None,
    Auto,
    Required,
    #[serde(untagged)]
    Other(String),
}

/// `{"type":"function","function":{"name":...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NamedToolChoice {
    #[serde(rename = "type", default = "function_type")]
    pub kind: String,
    pub function: NamedFunction,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The function a [`NamedToolChoice`] forces.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct NamedFunction {
    pub name: String,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A non-streamed response.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChatResponse {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub choices: Vec<Choice>,
    pub usage: Option<ChatUsage>,
    /// `object`, `created`, `system_fingerprint`, ...
    #[serde(flatten)]
    pub extra: Extra,
}

/// One choice of a response.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Choice {
    #[serde(default)]
    pub index: u32,
    #[serde(default)]
    pub message: ResponseMessage,
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    /// vLLM's `stop_reason`, SGLang's `matched_stop`, `logprobs`, ...
    #[serde(flatten)]
    pub extra: Extra,
}

impl Choice {
    /// The stop string that ended generation, when the server says (vLLM `stop_reason`,
    /// SGLang `matched_stop`); token ids are not strings and yield `None`.
    pub fn matched_stop(&self) -> Option<&str> {
        matched_stop(&self.extra)
    }
}

fn matched_stop(extra: &Extra) -> Option<&str> {
    ["stop_reason", "matched_stop"]
        .iter()
        .find_map(|k| extra.get(*k).and_then(Value::as_str))
}

/// The assistant message of a response choice.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ResponseMessage {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
    /// A string from OpenAI; a list of parts from a few compatible servers.
    #[serde(default)]
    pub content: Option<ChatContent>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning_content: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCall>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl ResponseMessage {
    /// The reasoning text, from whichever field the server uses.
    pub fn reasoning_text(&self) -> Option<&str> {
        self.reasoning_content
            .as_deref()
            .or(self.reasoning.as_deref())
    }
}

/// Why a choice finished.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    Stop,
    Length,
    ToolCalls,
    FunctionCall,
    ContentFilter,
    #[serde(untagged)]
    Other(String),
}

/// Token usage. `prompt_tokens` *includes* `prompt_tokens_details.cached_tokens`, unlike
/// Anthropic's `input_tokens`.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ChatUsage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    pub total_tokens: Option<u64>,
    pub prompt_tokens_details: Option<PromptTokensDetails>,
    /// `completion_tokens_details`, DeepSeek's `prompt_cache_hit_tokens`, ...
    #[serde(flatten)]
    pub extra: Extra,
}

impl ChatUsage {
    /// Prompt tokens served from the provider's cache: `prompt_tokens_details.cached_tokens`,
    /// or DeepSeek's `prompt_cache_hit_tokens`. Never more than `prompt_tokens`.
    pub fn cached_tokens(&self) -> u64 {
        let cached = self
            .prompt_tokens_details
            .as_ref()
            .and_then(|d| d.cached_tokens)
            .or_else(|| {
                self.extra
                    .get("prompt_cache_hit_tokens")
                    .and_then(Value::as_u64)
            })
            .unwrap_or(0);
        cached.min(self.prompt_tokens)
    }
}

/// `prompt_tokens_details` of a usage.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    pub cached_tokens: Option<u64>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// One streamed chunk (`data:` of a `chat.completion.chunk` event). A chunk with an `error`
/// object instead of choices is how some servers report a failure mid-stream.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChatChunk {
    #[serde(default)]
    pub id: String,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub choices: Vec<ChunkChoice>,
    /// Present (non-null) on the final chunk when `stream_options.include_usage` was set, and on
    /// every chunk with vLLM's `continuous_usage_stats`.
    pub usage: Option<ChatUsage>,
    pub error: Option<Value>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// One choice of a chunk.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChunkChoice {
    #[serde(default)]
    pub index: u32,
    #[serde(default)]
    pub delta: ChunkDelta,
    #[serde(default)]
    pub finish_reason: Option<FinishReason>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl ChunkChoice {
    /// See [`Choice::matched_stop`].
    pub fn matched_stop(&self) -> Option<&str> {
        matched_stop(&self.extra)
    }
}

/// The `delta` of a chunk choice.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChunkDelta {
    pub role: Option<String>,
    pub content: Option<ChatContent>,
    pub reasoning_content: Option<String>,
    pub reasoning: Option<String>,
    pub tool_calls: Option<Vec<ToolCallDelta>>,
    pub refusal: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

impl ChunkDelta {
    /// The reasoning text, from whichever field the server uses.
    pub fn reasoning_text(&self) -> Option<&str> {
        self.reasoning_content
            .as_deref()
            .or(self.reasoning.as_deref())
    }
}

/// A piece of a streamed tool call. The first piece for an `index` normally carries `id` and
/// `function.name`; later pieces carry slices of `function.arguments`.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ToolCallDelta {
    /// Missing from a few servers' chunks; see `translate::ChatStreamTranslator`.
    pub index: Option<u32>,
    pub id: Option<String>,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub function: Option<FunctionDelta>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The function part of a [`ToolCallDelta`].
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FunctionDelta {
    pub name: Option<String>,
    pub arguments: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// OpenAI's error body `{"error":{"message","type","param","code"}}`. Compatible servers vary
/// (vLLM puts the fields at the top level, FastAPI servers send `detail`);
/// [`crate::error::anthropic_error_from_openai`] reads all of them from raw bytes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatErrorBody {
    pub error: ChatErrorDetail,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The `error` object of a [`ChatErrorBody`].
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ChatErrorDetail {
    #[serde(default)]
    pub message: String,
    #[serde(rename = "type", default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub param: Option<Value>,
    pub code: Option<Value>,
    #[serde(flatten)]
    pub extra: Extra,
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cached_tokens_reads_openai_and_deepseek_shapes() {
        let u: ChatUsage = serde_json::from_value(json!({
            "prompt_tokens": 100, "completion_tokens": 5,
            "prompt_tokens_details": {"cached_tokens": 60}
        }))
        .unwrap();
        assert_eq!(u.cached_tokens(), 60);
        let d: ChatUsage = serde_json::from_value(json!({
            "prompt_tokens": 100, "completion_tokens": 5, "prompt_cache_hit_tokens": 30
        }))
        .unwrap();
        assert_eq!(d.cached_tokens(), 30);
        let bogus: ChatUsage = serde_json::from_value(json!({
            "prompt_tokens": 10, "prompt_tokens_details": {"cached_tokens": 60}
        }))
        .unwrap();
        assert_eq!(bogus.cached_tokens(), 10);
    }

    #[test]
    fn tool_choice_forms() {
        let m: ChatToolChoice = serde_json::from_value(json!("required")).unwrap();
        assert_eq!(m, ChatToolChoice::Mode(ToolChoiceMode::Required));
        let n: ChatToolChoice =
            serde_json::from_value(json!({"type":"function","function":{"name":"f"}})).unwrap();
        assert!(matches!(n, ChatToolChoice::Named(ref c) if c.function.name == "f"));
    }

    #[test]
    fn assistant_without_content_serializes_null() {
        let m = ChatMessage::Assistant {
            content: None,
            tool_calls: None,
            reasoning_content: None,
            extra: Extra::new(),
        };
        assert_eq!(
            serde_json::to_value(&m).unwrap(),
            json!({"role":"assistant","content":null})
        );
    }

    #[test]
    fn chunk_with_null_usage_and_error_parse() {
        let c: ChatChunk = serde_json::from_value(json!({
            "id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}],"usage":null
        }))
        .unwrap();
        assert!(c.usage.is_none());
        let e: ChatChunk =
            serde_json::from_value(json!({"error":{"message":"boom","type":"server_error"}}))
                .unwrap();
        assert!(e.error.is_some() && e.choices.is_empty());
    }
}
