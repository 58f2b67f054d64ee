//! Typed OpenAI Responses API bodies (`POST /v1/responses`): the request, the response object
//! and every streamed event. Codex only speaks this API, so the blackbox proxy serves it and
//! translates to chat completions for the router.
//!
//! As elsewhere in this crate, unknown fields land in `extra` and unknown item, part and event
//! types in `Other`, so a body survives parse and re-serialize. One normalization: an input
//! message written in the short form `{"role":..., "content":...}` (no `type`) is read as a
//! message item and written back with `"type": "message"`.

use serde::de::{Deserializer, Error as _};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Number, Value};

use crate::serde_util::const_tag;
pub use crate::serde_util::{RawJson, TextOrList};

/// Unknown fields of an object, kept in arrival order.
pub type Extra = Map<String, Value>;

/// `POST /v1/responses` request body.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ResponsesRequest {
    pub model: String,
    pub input: Option<TextOrList<InputItem>>,
    pub instructions: Option<String>,
    pub tools: Option<Vec<ResponsesTool>>,
    /// `"auto"`, `"none"`, `"required"` or an object naming a tool.
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub stream: Option<bool>,
    pub max_output_tokens: Option<u64>,
    pub temperature: Option<Number>,
    pub top_p: Option<Number>,
    pub reasoning: Option<ReasoningConfig>,
    pub store: Option<bool>,
    pub previous_response_id: Option<String>,
    /// `text`, `include`, `prompt_cache_key`, `metadata`, ...
    #[serde(flatten)]
    pub extra: Extra,
}

/// `reasoning` of a request.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ReasoningConfig {
    pub effort: Option<String>,
    pub summary: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// One entry of `tools`. Read by hand (each member kept raw first) so that `parameters`, the
/// schema, stays opaque [`RawJson`]: a derived tagged enum would buffer it as a tree.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponsesTool {
    Function {
        name: String,
        #[serde(
            default,
            skip_serializing_if = "Option::is_none",
            serialize_with = "crate::serde_util::opt_text"
        )]
        description: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        parameters: Option<RawJson>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        strict: Option<bool>,
        #[serde(flatten)]
        extra: Extra,
    },
    /// `custom` (free-form tools such as Codex's `apply_patch`), `web_search`, `local_shell`,
    /// ...
    #[serde(untagged)]
    Other(Extra),
}

impl<'de> Deserialize<'de> for ResponsesTool {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let members = RawMembers::deserialize(deserializer)?;
        Ok(function_tool(&members).unwrap_or_else(|| {
            // Not a well-formed function tool: kept whole, `type` included, as an untagged
            // variant would keep it.
            ResponsesTool::Other(
                members
                    .0
                    .into_iter()
                    .map(|(k, v)| (k, v.to_value()))
                    .collect(),
            )
        }))
    }
}

/// A JSON object's members, each value kept raw, in arrival order.
struct RawMembers(Vec<(String, RawJson)>);

impl<'de> Deserialize<'de> for RawMembers {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = RawMembers;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<RawMembers, A::Error> {
                let mut members = Vec::with_capacity(map.size_hint().unwrap_or(0).min(64));
                while let Some(entry) = map.next_entry::<String, RawJson>()? {
                    members.push(entry);
                }
                Ok(RawMembers(members))
            }
        }
        deserializer.deserialize_map(V)
    }
}

/// The `function` variant, if the members make one (what the derived tagged enum accepted:
/// `type` "function", a string `name`, the optional members of their types, each at most once).
fn function_tool(members: &RawMembers) -> Option<ResponsesTool> {
    fn once<T: serde::de::DeserializeOwned>(slot: &mut Option<T>, raw: &RawJson) -> Option<()> {
        if slot.is_some() {
            return None;
        }
        *slot = Some(serde_json::from_str(raw.get()).ok()?);
        Some(())
    }
    let mut kind: Option<String> = None;
    let mut name: Option<String> = None;
    let mut description: Option<Option<String>> = None;
    let mut parameters: Option<Option<RawJson>> = None;
    let mut strict: Option<Option<bool>> = None;
    let mut extra = Extra::new();
    for (key, raw) in &members.0 {
        match key.as_str() {
            "type" => once(&mut kind, raw)?,
            "name" => once(&mut name, raw)?,
            "description" => once(&mut description, raw)?,
            "parameters" => once(&mut parameters, raw)?,
            "strict" => once(&mut strict, raw)?,
            _ => {
                extra.insert(key.clone(), raw.to_value());
            }
        }
    }
    if kind.as_deref() != Some("function") {
        return None;
    }
    Some(ResponsesTool::Function {
        name: name?,
        description: description.flatten(),
        parameters: parameters.flatten(),
        strict: strict.flatten(),
        extra,
    })
}

/// One item of a request's `input` list.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum InputItem {
    Message(MessageItem),
    FunctionCall(FunctionCallItem),
    FunctionCallOutput(FunctionCallOutputItem),
    Reasoning(ReasoningItem),
    /// `custom_tool_call`, `local_shell_call`, `item_reference`, ...
    #[serde(untagged)]
    Other(Extra),
}

impl<'de> Deserialize<'de> for InputItem {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let mut map = Extra::deserialize(deserializer)?;
        let kind = match map.remove("type") {
            Some(Value::String(kind)) => kind,
            None if map.contains_key("role") => "message".to_owned(),
            Some(other) => {
                map.insert("type".to_owned(), other);
                return Ok(InputItem::Other(map));
            }
            None => return Ok(InputItem::Other(map)),
        };
        let value = Value::Object(map);
        let item = match kind.as_str() {
            "message" => serde_json::from_value(value).map(InputItem::Message),
            "function_call" => serde_json::from_value(value).map(InputItem::FunctionCall),
            "function_call_output" => {
                serde_json::from_value(value).map(InputItem::FunctionCallOutput)
            }
            "reasoning" => serde_json::from_value(value).map(InputItem::Reasoning),
            _ => {
                let Value::Object(mut map) = value else {
                    return Err(D::Error::custom("input item is not an object"));
                };
                map.insert("type".to_owned(), Value::String(kind));
                return Ok(InputItem::Other(map));
            }
        };
        item.map_err(D::Error::custom)
    }
}

/// A message item, in input (`role` user, assistant, system or developer) or output (always
/// assistant).
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct MessageItem {
    pub id: Option<String>,
    pub role: String,
    pub content: TextOrList<ContentPart>,
    pub status: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A function call the model made.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FunctionCallItem {
    pub id: Option<String>,
    pub call_id: String,
    pub name: String,
    #[serde(default)]
    pub arguments: String,
    pub status: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// The result of a function call, sent back by the client.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct FunctionCallOutputItem {
    pub id: Option<String>,
    pub call_id: String,
    pub output: TextOrList<ContentPart>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A reasoning item: summaries and, with `include: ["reasoning.encrypted_content"]`, the opaque
/// reasoning to pass back.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct ReasoningItem {
    pub id: Option<String>,
    #[serde(default)]
    pub summary: Vec<ContentPart>,
    pub content: Option<Vec<ContentPart>>,
    pub encrypted_content: Option<String>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// A content part of a message, a function output or a reasoning item.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ContentPart {
    InputText {
        text: String,
        #[serde(flatten)]
        extra: Extra,
    },
    OutputText {
        text: String,
        #[serde(default)]
        annotations: Vec<Value>,
        #[serde(flatten)]
        extra: Extra,
    },
    InputImage {
        image_url: Option<String>,
        detail: Option<String>,
        #[serde(flatten)]
        extra: Extra,
    },
    Refusal {
        refusal: String,
        #[serde(flatten)]
        extra: Extra,
    },
    SummaryText {
        text: String,
        #[serde(flatten)]
        extra: Extra,
    },
    ReasoningText {
        text: String,
        #[serde(flatten)]
        extra: Extra,
    },
    /// `input_file`, `input_audio`, ...
    #[serde(untagged)]
    Other(Extra),
}

/// One item of a response's `output`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum OutputItem {
    Message(MessageItem),
    FunctionCall(FunctionCallItem),
    Reasoning(ReasoningItem),
    #[serde(untagged)]
    Other(Extra),
}

const_tag!(
    /// The `"object": "response"` of a response.
    ResponseObjectTag = "response"
);

/// A response object: the non-streamed body, and the `response` of lifecycle events.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct Response {
    pub id: String,
    #[serde(default)]
    pub object: ResponseObjectTag,
    pub created_at: Option<Number>,
    pub status: Option<ResponseStatus>,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub output: Vec<OutputItem>,
    pub usage: Option<ResponsesUsage>,
    pub error: Option<Value>,
    pub incomplete_details: Option<Value>,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `status` of a response.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResponseStatus {
    Completed,
    Failed,
    InProgress,
    Incomplete,
    Cancelled,
    Queued,
    #[serde(untagged)]
    Other(String),
}

/// Token usage of a response. Like chat completions, `input_tokens` includes cached tokens.
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ResponsesUsage {
    #[serde(default)]
    pub input_tokens: u64,
    pub input_tokens_details: Option<InputTokensDetails>,
    #[serde(default)]
    pub output_tokens: u64,
    pub output_tokens_details: Option<OutputTokensDetails>,
    #[serde(default)]
    pub total_tokens: u64,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `input_tokens_details` of a usage.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct InputTokensDetails {
    #[serde(default)]
    pub cached_tokens: u64,
    #[serde(flatten)]
    pub extra: Extra,
}

/// `output_tokens_details` of a usage.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct OutputTokensDetails {
    #[serde(default)]
    pub reasoning_tokens: u64,
    #[serde(flatten)]
    pub extra: Extra,
}

/// One streamed event. Each carries `sequence_number` (kept in `extra`); the SSE `event:` line
/// equals [`ResponseStreamEvent::event_name`].
#[serde_with::skip_serializing_none]
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type")]
pub enum ResponseStreamEvent {
    #[serde(rename = "response.created")]
    Created {
        response: Response,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.in_progress")]
    InProgress {
        response: Response,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.completed")]
    Completed {
        response: Response,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.failed")]
    Failed {
        response: Response,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.incomplete")]
    Incomplete {
        response: Response,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.output_item.added")]
    OutputItemAdded {
        output_index: u32,
        item: OutputItem,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.output_item.done")]
    OutputItemDone {
        output_index: u32,
        item: OutputItem,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.content_part.added")]
    ContentPartAdded {
        item_id: String,
        output_index: u32,
        content_index: u32,
        part: ContentPart,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.content_part.done")]
    ContentPartDone {
        item_id: String,
        output_index: u32,
        content_index: u32,
        part: ContentPart,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.output_text.delta")]
    OutputTextDelta {
        item_id: String,
        output_index: u32,
        content_index: u32,
        delta: String,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.output_text.done")]
    OutputTextDone {
        item_id: String,
        output_index: u32,
        content_index: u32,
        text: String,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.function_call_arguments.delta")]
    FunctionCallArgumentsDelta {
        item_id: String,
        output_index: u32,
        delta: String,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.function_call_arguments.done")]
    FunctionCallArgumentsDone {
        item_id: String,
        output_index: u32,
        arguments: String,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.reasoning_summary_text.delta")]
    ReasoningSummaryTextDelta {
        item_id: String,
        output_index: u32,
        summary_index: u32,
        delta: String,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.reasoning_summary_text.done")]
    ReasoningSummaryTextDone {
        item_id: String,
        output_index: u32,
        summary_index: u32,
        text: String,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.reasoning_summary_part.added")]
    ReasoningSummaryPartAdded {
        item_id: String,
        output_index: u32,
        summary_index: u32,
        part: ContentPart,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.reasoning_summary_part.done")]
    ReasoningSummaryPartDone {
        item_id: String,
        output_index: u32,
        summary_index: u32,
        part: ContentPart,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "response.reasoning_text.delta")]
    ReasoningTextDelta {
        item_id: String,
        output_index: u32,
        content_index: u32,
        delta: String,
        #[serde(flatten)]
        extra: Extra,
    },
    #[serde(rename = "error")]
    Error {
        code: Option<String>,
        #[serde(default)]
        message: String,
        param: Option<String>,
        #[serde(flatten)]
        extra: Extra,
    },
    /// `response.refusal.delta`, `response.custom_tool_call_input.delta`, ... and anything
    /// newer.
    #[serde(untagged)]
    Other(Extra),
}

impl ResponseStreamEvent {
    /// The SSE event name for this event: its `type`.
    pub fn event_name(&self) -> &str {
        match self {
            ResponseStreamEvent::Created { .. } => "response.created",
            ResponseStreamEvent::InProgress { .. } => "response.in_progress",
            ResponseStreamEvent::Completed { .. } => "response.completed",
            ResponseStreamEvent::Failed { .. } => "response.failed",
            ResponseStreamEvent::Incomplete { .. } => "response.incomplete",
            ResponseStreamEvent::OutputItemAdded { .. } => "response.output_item.added",
            ResponseStreamEvent::OutputItemDone { .. } => "response.output_item.done",
            ResponseStreamEvent::ContentPartAdded { .. } => "response.content_part.added",
            ResponseStreamEvent::ContentPartDone { .. } => "response.content_part.done",
            ResponseStreamEvent::OutputTextDelta { .. } => "response.output_text.delta",
            ResponseStreamEvent::OutputTextDone { .. } => "response.output_text.done",
            ResponseStreamEvent::FunctionCallArgumentsDelta { .. } => {
                "response.function_call_arguments.delta"
            }
            ResponseStreamEvent::FunctionCallArgumentsDone { .. } => {
                "response.function_call_arguments.done"
            }
            ResponseStreamEvent::ReasoningSummaryTextDelta { .. } => {
                "response.reasoning_summary_text.delta"
            }
            ResponseStreamEvent::ReasoningSummaryTextDone { .. } => {
                "response.reasoning_summary_text.done"
            }
            ResponseStreamEvent::ReasoningSummaryPartAdded { .. } => {
                "response.reasoning_summary_part.added"
            }
            ResponseStreamEvent::ReasoningSummaryPartDone { .. } => {
                "response.reasoning_summary_part.done"
            }
            ResponseStreamEvent::ReasoningTextDelta { .. } => "response.reasoning_text.delta",
            ResponseStreamEvent::Error { .. } => "error",
            ResponseStreamEvent::Other(map) => {
                map.get("type").and_then(Value::as_str).unwrap_or("")
            }
        }
    }

    /// Appends this event as one SSE frame (`event: <type>\ndata: <json>\n\n`).
    pub fn write_sse(&self, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
        out.extend_from_slice(b"event: ");
        out.extend_from_slice(self.event_name().as_bytes());
        out.extend_from_slice(b"\ndata: ");
        serde_json::to_writer(&mut *out, self)?;
        out.extend_from_slice(b"\n\n");
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn codex_style_request_round_trips() {
        let v = json!({
            "model": "gpt-5-codex",
            "instructions": "You are Codex.",
            "input": [
                {"type":"message","role":"user","content":[{"type":"input_text","text":"hi"}]},
                {"type":"reasoning","id":"rs_1","summary":[{"type":"summary_text","text":"s"}],"encrypted_content":"xyz"},
                {"type":"function_call","call_id":"call_1","name":"shell","arguments":"{\"cmd\":[\"ls\"]}"},
                {"type":"function_call_output","call_id":"call_1","output":"a\nb"},
                {"type":"custom_tool_call","call_id":"c2","name":"apply_patch","input":"*** Begin Patch"}
            ],
            "tools": [
                {"type":"function","name":"shell","parameters":{"type":"object"},"strict":false},
                {"type":"custom","name":"apply_patch","format":{"type":"grammar"}}
            ],
            "tool_choice": "auto",
            "parallel_tool_calls": false,
            "reasoning": {"effort":"medium","summary":"auto"},
            "store": false,
            "stream": true,
            "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "abc"
        });
        let r: ResponsesRequest = serde_json::from_value(v.clone()).unwrap();
        let Some(TextOrList::List(items)) = &r.input else {
            panic!("input not a list")
        };
        assert!(matches!(items[0], InputItem::Message(_)));
        assert!(matches!(items[4], InputItem::Other(_)));
        assert_eq!(serde_json::to_value(&r).unwrap(), v);
    }

    #[test]
    fn short_form_message_gets_a_type() {
        let item: InputItem =
            serde_json::from_value(json!({"role":"user","content":"hi"})).unwrap();
        assert!(matches!(item, InputItem::Message(ref m) if m.role == "user"));
        assert_eq!(
            serde_json::to_value(&item).unwrap(),
            json!({"type":"message","role":"user","content":"hi"})
        );
    }

    #[test]
    fn stream_events_parse_and_name_themselves() {
        let v = json!({"type":"response.output_text.delta","item_id":"msg_1","output_index":0,"content_index":0,"delta":"he","sequence_number":4});
        let e: ResponseStreamEvent = serde_json::from_value(v.clone()).unwrap();
        assert_eq!(e.event_name(), "response.output_text.delta");
        assert_eq!(serde_json::to_value(&e).unwrap(), v);
        let done = json!({"type":"response.completed","sequence_number":9,"response":{
            "id":"resp_1","object":"response","created_at":1,"status":"completed","model":"m",
            "output":[{"type":"message","id":"msg_1","role":"assistant","status":"completed",
                "content":[{"type":"output_text","text":"hello","annotations":[]}]}],
            "usage":{"input_tokens":10,"input_tokens_details":{"cached_tokens":4},"output_tokens":2,
                "output_tokens_details":{"reasoning_tokens":0},"total_tokens":12}}});
        let e: ResponseStreamEvent = serde_json::from_value(done.clone()).unwrap();
        assert!(matches!(e, ResponseStreamEvent::Completed { .. }));
        assert_eq!(serde_json::to_value(&e).unwrap(), done);
        let new = json!({"type":"response.something_new","x":1});
        let e: ResponseStreamEvent = serde_json::from_value(new.clone()).unwrap();
        assert_eq!(e.event_name(), "response.something_new");
        assert_eq!(serde_json::to_value(&e).unwrap(), new);
    }
}
