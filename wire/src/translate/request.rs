//! Anthropic Messages request → OpenAI chat completions request (rules in the module docs of
//! [`crate::translate`]).

use serde_json::{Map, Value, json};

use super::tool_names::upstream_tool_name;
use super::{ChatOptions, InlineSystem, TranslateError};
use crate::anthropic::{
    ContentBlock, DocumentSource, ImageSource, Message, MessageContent, MessagesRequest, Role,
    ThinkingConfig, Tool, ToolChoice,
};
use crate::chat::{
    ChatContent, ChatMessage, ChatRequest, ChatTool, ChatToolChoice, ContentPart, Extra,
    FunctionCall, FunctionDef, ImageUrl, NamedFunction, NamedToolChoice, StreamOptions, ToolCall,
    ToolChoiceMode,
};
use crate::normalize;

/// Translates a request, consuming it (its large strings move into the chat request; clone a
/// request that is needed afterwards).
pub fn anthropic_into_chat(
    mut req: MessagesRequest,
    opts: &ChatOptions,
) -> Result<ChatRequest, TranslateError> {
    if opts.strip_billing_header {
        normalize::strip_billing_header(&mut req);
    }
    let MessagesRequest {
        model,
        messages,
        system,
        max_tokens,
        stop_sequences,
        stream,
        temperature,
        top_p,
        top_k,
        metadata,
        tools,
        tool_choice,
        thinking,
        extra,
    } = req;

    let mut system_text = system
        .as_ref()
        .map(|s| normalize::system_text(s, "\n\n"))
        .unwrap_or_default();
    let messages = match opts.inline_system {
        InlineSystem::Fold => {
            let (leading, folded, _) = normalize::fold_messages(messages);
            if !leading.is_empty() {
                if !system_text.is_empty() {
                    system_text.push_str("\n\n");
                }
                system_text.push_str(&leading);
            }
            folded
        }
        InlineSystem::Keep => messages,
    };

    let mut out = Vec::with_capacity(messages.len() + 1);
    if !system_text.is_empty() {
        out.push(ChatMessage::System {
            content: ChatContent::Text(system_text),
            extra: Extra::new(),
        });
    }
    for (index, message) in messages.into_iter().enumerate() {
        translate_message(index, message, opts, &mut out)?;
    }

    let tools: Vec<ChatTool> = tools
        .unwrap_or_default()
        .into_iter()
        .filter(|t| !t.is_server_tool())
        .map(translate_tool)
        .collect();
    let (tool_choice, parallel_tool_calls) = match translate_tool_choice(tool_choice) {
        _ if tools.is_empty() => (None, None),
        // A choice forcing a server tool, which is not sent: the model chooses freely (the
        // sanitizer's rule for the same case).
        (Some(ChatToolChoice::Named(named)), _)
            if !tools.iter().any(|t| t.function.name == named.function.name) =>
        {
            (None, None)
        }
        other => other,
    };

    let (max_tokens, max_completion_tokens) = opts.anthropic_output_limit(max_tokens);

    let streaming = stream == Some(true);
    let mut chat_extra = Extra::new();
    if opts.forward_top_k
        && let Some(k) = top_k
    {
        chat_extra.insert("top_k".to_owned(), Value::from(k));
    }
    let (reasoning_effort, reasoning) =
        super::reasoning_fields(opts.reasoning, thinking_effort(thinking.as_ref(), &extra));

    Ok(ChatRequest {
        model: opts.model.clone().unwrap_or(model),
        messages: out,
        max_tokens,
        max_completion_tokens,
        stop: stop_sequences
            .filter(|s| !s.is_empty())
            .map(crate::chat::TextOrList::List),
        stream,
        stream_options: (streaming && opts.include_usage).then(|| StreamOptions {
            include_usage: Some(true),
            extra: Extra::new(),
        }),
        temperature,
        top_p,
        tool_choice,
        parallel_tool_calls,
        tools: (!tools.is_empty()).then_some(tools),
        user: metadata
            .filter(|_| opts.forward_user)
            .and_then(|m| m.user_id),
        reasoning_effort,
        reasoning,
        response_format: response_format(&extra),
        extra: chat_extra,
    })
}

fn translate_message(
    index: usize,
    message: Message,
    opts: &ChatOptions,
    out: &mut Vec<ChatMessage>,
) -> Result<(), TranslateError> {
    match message.role {
        Role::System => {
            let text = normalize::system_text(&message.content, "\n\n");
            if !text.is_empty() {
                out.push(ChatMessage::System {
                    content: ChatContent::Text(text),
                    extra: Extra::new(),
                });
            }
            Ok(())
        }
        Role::User => translate_user(index, message.content, out),
        Role::Assistant => {
            out.push(translate_assistant(index, message.content, opts)?);
            Ok(())
        }
    }
}

fn translate_user(
    index: usize,
    content: MessageContent,
    out: &mut Vec<ChatMessage>,
) -> Result<(), TranslateError> {
    let blocks = match content {
        MessageContent::Text(text) => {
            out.push(user(ChatContent::Text(text)));
            return Ok(());
        }
        MessageContent::List(blocks) => blocks,
    };
    // Parts moved out of tool results (images, documents) go first: they belong to the
    // results just before them.
    let mut moved: Vec<ContentPart> = Vec::new();
    let mut own: Vec<ContentPart> = Vec::new();
    for block in blocks {
        match block {
            ContentBlock::ToolResult {
                tool_use_id,
                content,
                ..
            } => {
                let text = tool_result_text(index, &tool_use_id, content, &mut moved)?;
                out.push(ChatMessage::Tool {
                    tool_call_id: tool_use_id,
                    content: ChatContent::Text(text),
                    extra: Extra::new(),
                });
            }
            other @ (ContentBlock::Text { .. }
            | ContentBlock::Image { .. }
            | ContentBlock::Document { .. }
            | ContentBlock::ToolUse { .. }
            | ContentBlock::Thinking { .. }
            | ContentBlock::RedactedThinking { .. }
            | ContentBlock::Other(_)) => {
                if let Some(part) = user_part(index, other)? {
                    own.push(part);
                }
            }
        }
    }
    if moved.is_empty() && own.len() == 1 && matches!(own[0], ContentPart::Text { .. }) {
        if let Some(ContentPart::Text { text, .. }) = own.pop() {
            out.push(user(ChatContent::Text(text)));
        }
        return Ok(());
    }
    moved.append(&mut own);
    if !moved.is_empty() {
        out.push(user(ChatContent::List(moved)));
    }
    Ok(())
}

fn user(content: ChatContent) -> ChatMessage {
    ChatMessage::User {
        content,
        extra: Extra::new(),
    }
}

/// A user content block as a chat part; `None` for blocks with no chat meaning.
fn user_part(index: usize, block: ContentBlock) -> Result<Option<ContentPart>, TranslateError> {
    Ok(match block {
        ContentBlock::Text { text, .. } => (!text.is_empty()).then(|| ContentPart::text(text)),
        ContentBlock::Image { source, .. } => Some(image_part(source)?),
        ContentBlock::Document { source, extra } => Some(document_part(source, &extra)?),
        // Thinking only exists in assistant turns; a client that echoes it in a user turn
        // gains nothing from sending it.
        ContentBlock::Thinking { .. } | ContentBlock::RedactedThinking { .. } => None,
        ContentBlock::ToolUse { .. } => {
            return Err(TranslateError::Malformed {
                message: index,
                problem: "tool_use block in a user turn".to_owned(),
            });
        }
        ContentBlock::ToolResult { .. } => None,
        ContentBlock::Other(map) => other_block(index, &map)?,
    })
}

/// Blocks of unknown types (server-tool calls and results, search results, ...) have no chat
/// equivalent and are dropped; a block of a known type that failed to parse is an error, not
/// something to drop silently.
fn other_block(
    index: usize,
    map: &Map<String, Value>,
) -> Result<Option<ContentPart>, TranslateError> {
    let kind = map.get("type").and_then(Value::as_str).unwrap_or("");
    match kind {
        "text" | "image" | "document" | "tool_use" | "tool_result" | "thinking"
        | "redacted_thinking" => Err(TranslateError::Malformed {
            message: index,
            problem: format!("{kind} block is missing required fields"),
        }),
        _ => Ok(None),
    }
}

fn image_part(source: ImageSource) -> Result<ContentPart, TranslateError> {
    let url = match source {
        ImageSource::Base64 {
            media_type, data, ..
        } => data_url(&media_type, &data),
        ImageSource::Url { url, .. } => url,
        ImageSource::Other(map) => {
            return Err(TranslateError::Unsupported {
                what: format!(
                    "an image with source type {:?}",
                    map.get("type").and_then(Value::as_str).unwrap_or("")
                ),
            });
        }
    };
    Ok(ContentPart::ImageUrl {
        image_url: ImageUrl {
            url,
            detail: None,
            extra: Extra::new(),
        },
        extra: Extra::new(),
    })
}

fn data_url(media_type: &str, data: &str) -> String {
    let mut url = String::with_capacity(13 + media_type.len() + 8 + data.len());
    url.push_str("data:");
    url.push_str(media_type);
    url.push_str(";base64,");
    url.push_str(data);
    url
}

fn document_part(source: DocumentSource, extra: &Extra) -> Result<ContentPart, TranslateError> {
    match source {
        DocumentSource::Text { data, .. } => Ok(ContentPart::text(data)),
        DocumentSource::Base64 {
            media_type, data, ..
        } => {
            let mut file = Map::new();
            file.insert(
                "file_data".to_owned(),
                Value::String(data_url(&media_type, &data)),
            );
            let filename = extra
                .get("title")
                .and_then(Value::as_str)
                .unwrap_or("document.pdf");
            file.insert("filename".to_owned(), Value::String(filename.to_owned()));
            Ok(ContentPart::File {
                file: Value::Object(file),
                extra: Extra::new(),
            })
        }
        DocumentSource::Url { .. } => Err(TranslateError::Unsupported {
            what: "a document given by url".to_owned(),
        }),
        DocumentSource::Other(map) => Err(TranslateError::Unsupported {
            what: format!(
                "a document with source type {:?}",
                map.get("type").and_then(Value::as_str).unwrap_or("")
            ),
        }),
    }
}

/// A tool result's content as tool-message text. Images and documents go to `moved`, after a
/// label naming the call, since several results may move attachments into the same user
/// message.
fn tool_result_text(
    index: usize,
    tool_use_id: &str,
    content: Option<MessageContent>,
    moved: &mut Vec<ContentPart>,
) -> Result<String, TranslateError> {
    let blocks = match content {
        None => return Ok(String::new()),
        Some(MessageContent::Text(text)) => return Ok(text),
        Some(MessageContent::List(blocks)) => blocks,
    };
    let mut text = String::new();
    let mut attachments = Vec::new();
    for block in blocks {
        match block {
            ContentBlock::Text { text: t, .. } => {
                if !text.is_empty() && !t.is_empty() {
                    text.push('\n');
                }
                text.push_str(&t);
            }
            ContentBlock::Image { source, .. } => attachments.push(image_part(source)?),
            ContentBlock::Document { source, extra } => match document_part(source, &extra)? {
                ContentPart::Text { text: t, .. } => {
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&t);
                }
                part @ (ContentPart::ImageUrl { .. }
                | ContentPart::File { .. }
                | ContentPart::Other(_)) => attachments.push(part),
            },
            ContentBlock::ToolUse { .. }
            | ContentBlock::ToolResult { .. }
            | ContentBlock::Thinking { .. }
            | ContentBlock::RedactedThinking { .. } => {}
            ContentBlock::Other(map) => {
                other_block(index, &map)?;
            }
        }
    }
    if !attachments.is_empty() {
        if !text.is_empty() {
            text.push('\n');
        }
        text.push_str("[attachments follow in the next user message]");
        moved.push(ContentPart::text(format!(
            "Attachments from tool call {tool_use_id}:"
        )));
        moved.append(&mut attachments);
    }
    Ok(text)
}

/// An assistant turn: always one chat message.
fn translate_assistant(
    index: usize,
    content: MessageContent,
    opts: &ChatOptions,
) -> Result<ChatMessage, TranslateError> {
    let blocks = match content {
        MessageContent::Text(text) => vec![ContentBlock::text(text)],
        MessageContent::List(blocks) => blocks,
    };
    let mut text: Option<String> = None;
    let mut reasoning: Option<String> = None;
    let mut calls: Vec<ToolCall> = Vec::new();
    for block in blocks {
        match block {
            ContentBlock::Text { text: t, .. } => match &mut text {
                Some(acc) => acc.push_str(&t),
                None => text = Some(t),
            },
            ContentBlock::Thinking { thinking, .. } => {
                if opts.reasoning_passback {
                    match &mut reasoning {
                        Some(acc) => acc.push_str(&thinking),
                        None => reasoning = Some(thinking),
                    }
                }
            }
            ContentBlock::ToolUse {
                id, name, input, ..
            } => {
                // A string input is arguments that were not valid JSON, kept verbatim.
                let arguments = match input {
                    Value::String(raw) => raw,
                    Value::Object(_)
                    | Value::Array(_)
                    | Value::Null
                    | Value::Bool(_)
                    | Value::Number(_) => input.to_string(),
                };
                calls.push(ToolCall {
                    id,
                    kind: "function".to_owned(),
                    function: FunctionCall {
                        name: upstream_tool_name(&name).into_owned(),
                        arguments,
                        extra: Extra::new(),
                    },
                    extra: Extra::new(),
                });
            }
            ContentBlock::RedactedThinking { .. }
            | ContentBlock::Image { .. }
            | ContentBlock::Document { .. } => {}
            ContentBlock::ToolResult { .. } => {
                return Err(TranslateError::Malformed {
                    message: index,
                    problem: "tool_result block in an assistant turn".to_owned(),
                });
            }
            ContentBlock::Other(map) => {
                other_block(index, &map)?;
            }
        }
    }
    let text = text.filter(|t| !t.is_empty());
    let content = match (text, calls.is_empty()) {
        (Some(t), _) => Some(ChatContent::Text(t)),
        (None, false) => None,
        (None, true) => Some(ChatContent::Text(String::new())),
    };
    Ok(ChatMessage::Assistant {
        content,
        tool_calls: (!calls.is_empty()).then_some(calls),
        reasoning_content: reasoning.filter(|r| !r.is_empty()),
        extra: Extra::new(),
    })
}

fn translate_tool(tool: Tool) -> ChatTool {
    let Tool {
        name,
        description,
        input_schema,
        extra,
        ..
    } = tool;
    ChatTool {
        kind: "function".to_owned(),
        function: FunctionDef {
            name: upstream_tool_name(&name).into_owned(),
            description,
            parameters: Some(input_schema.unwrap_or_else(super::empty_schema)),
            strict: extra.get("strict").and_then(Value::as_bool),
            extra: Extra::new(),
        },
        extra: Extra::new(),
    }
}

pub(super) fn translate_tool_choice(
    choice: Option<ToolChoice>,
) -> (Option<ChatToolChoice>, Option<bool>) {
    let no_parallel = |d: Option<bool>| (d == Some(true)).then_some(false);
    match choice {
        None => (None, None),
        Some(ToolChoice::Auto {
            disable_parallel_tool_use,
            ..
        }) => (
            Some(ChatToolChoice::Mode(ToolChoiceMode::Auto)),
            no_parallel(disable_parallel_tool_use),
        ),
        Some(ToolChoice::Any {
            disable_parallel_tool_use,
            ..
        }) => (
            Some(ChatToolChoice::Mode(ToolChoiceMode::Required)),
            no_parallel(disable_parallel_tool_use),
        ),
        Some(ToolChoice::Tool {
            name,
            disable_parallel_tool_use,
            ..
        }) => (
            Some(ChatToolChoice::Named(NamedToolChoice {
                kind: "function".to_owned(),
                function: NamedFunction {
                    name: upstream_tool_name(&name).into_owned(),
                    extra: Extra::new(),
                },
                extra: Extra::new(),
            })),
            no_parallel(disable_parallel_tool_use),
        ),
        Some(ToolChoice::None { .. }) => (Some(ChatToolChoice::Mode(ToolChoiceMode::None)), None),
        // An unknown choice: let the upstream default apply rather than guess.
        Some(ToolChoice::Other(_)) => (None, None),
    }
}

/// The effort a request's `thinking` asks for ([`super::ReasoningField`] states the rule).
pub(super) fn thinking_effort(thinking: Option<&ThinkingConfig>, extra: &Extra) -> Option<String> {
    let bucket = |budget: u64| match budget {
        0..4096 => "low",
        4096..16384 => "medium",
        _ => "high",
    };
    match thinking? {
        ThinkingConfig::Enabled { budget_tokens, .. } => {
            Some(bucket(budget_tokens.unwrap_or(16384)).to_owned())
        }
        ThinkingConfig::Adaptive { .. } => {
            let effort = extra
                .get("output_config")
                .and_then(|c| c.get("effort"))
                .and_then(Value::as_str)
                .unwrap_or("high");
            // OpenAI's scale tops out at "high".
            Some(match effort {
                "low" | "medium" | "high" => effort.to_owned(),
                _ => "high".to_owned(),
            })
        }
        ThinkingConfig::Disabled { .. } | ThinkingConfig::Other(_) => None,
    }
}

/// `output_config.format` (or the older `output_format`) with a JSON schema →
/// `response_format`.
pub(super) fn response_format(extra: &Extra) -> Option<Value> {
    let format = extra
        .get("output_config")
        .and_then(|c| c.get("format"))
        .or_else(|| extra.get("output_format"))?;
    if format.get("type").and_then(Value::as_str) != Some("json_schema") {
        return None;
    }
    let schema = format.get("schema")?;
    Some(json!({
        "type": "json_schema",
        "json_schema": {"name": "structured_output", "schema": schema}
    }))
}
