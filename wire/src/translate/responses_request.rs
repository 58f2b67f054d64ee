//! OpenAI Responses request → OpenAI chat completions request (rules in the module docs of
//! [`crate::translate::responses`]).

use serde_json::{Map, Value, json};

use super::{ChatOptions, TranslateError};
use crate::chat::{
    ChatContent, ChatMessage, ChatRequest, ChatTool, ChatToolChoice, ContentPart as ChatPart,
    Extra, FunctionCall, FunctionDef, ImageUrl, NamedFunction, NamedToolChoice, StreamOptions,
    ToolCall, ToolChoiceMode,
};
use crate::responses::{
    ContentPart, FunctionCallItem, FunctionCallOutputItem, InputItem, MessageItem, ReasoningItem,
    ResponsesRequest, ResponsesTool,
};
use crate::serde_util::{RawJson, TextOrList};

/// Translates a request, consuming it.
pub fn responses_into_chat(
    req: ResponsesRequest,
    opts: &ChatOptions,
) -> Result<ChatRequest, TranslateError> {
    let mut history = History::new(opts.reasoning_passback);
    if let Some(text) = req.instructions.filter(|t| !t.is_empty()) {
        history.system.push(text);
    }
    match req.input {
        None => {}
        Some(TextOrList::Text(text)) => history.messages.push(user(ChatContent::Text(text))),
        Some(TextOrList::List(items)) => {
            for (index, item) in items.into_iter().enumerate() {
                history.item(index, item)?;
            }
        }
    }
    let messages = history.finish();

    let tools: Vec<ChatTool> = req
        .tools
        .unwrap_or_default()
        .into_iter()
        .filter_map(translate_tool)
        .collect();
    let (tool_choice, parallel_tool_calls) = if tools.is_empty() {
        (None, None)
    } else {
        (
            req.tool_choice.as_ref().and_then(translate_tool_choice),
            req.parallel_tool_calls,
        )
    };

    let limit = match (req.max_output_tokens, opts.max_output_tokens) {
        (Some(asked), Some(cap)) => Some(asked.min(cap)),
        (asked, _) => asked,
    };
    let (max_tokens, max_completion_tokens) = opts.max_tokens_field.carry(limit);
    let streaming = req.stream == Some(true);
    let (reasoning_effort, reasoning) =
        super::reasoning_fields(opts.reasoning, req.reasoning.and_then(|r| r.effort));

    Ok(ChatRequest {
        model: opts.model.clone().unwrap_or(req.model),
        messages,
        max_tokens,
        max_completion_tokens,
        stop: None,
        stream: Some(streaming),
        stream_options: (streaming && opts.include_usage).then(|| StreamOptions {
            include_usage: Some(true),
            extra: Extra::new(),
        }),
        temperature: req.temperature,
        top_p: req.top_p,
        tools: (!tools.is_empty()).then_some(tools),
        tool_choice,
        parallel_tool_calls,
        user: None,
        reasoning_effort,
        reasoning,
        response_format: response_format(&req.extra),
        extra: Extra::new(),
    })
}

/// The conversation being built, with the state that merges items into messages.
struct History {
    reasoning_passback: bool,
    /// `instructions` and developer/system texts, for the one leading system message.
    system: Vec<String>,
    messages: Vec<ChatMessage>,
    /// The assistant message that a following `function_call` joins.
    open_assistant: Option<usize>,
    /// Reasoning waiting for the next assistant message or call group.
    reasoning: Option<String>,
    /// Images and files from tool outputs, sent after the run of tool messages.
    moved: Vec<ChatPart>,
}

impl History {
    fn new(reasoning_passback: bool) -> Self {
        Self {
            reasoning_passback,
            system: Vec::new(),
            messages: Vec::new(),
            open_assistant: None,
            reasoning: None,
            moved: Vec::new(),
        }
    }

    /// Ends a run of tool messages, a call group and pending reasoning.
    fn boundary(&mut self) {
        self.open_assistant = None;
        self.reasoning = None;
        self.flush_moved();
    }

    fn flush_moved(&mut self) {
        if !self.moved.is_empty() {
            let parts = std::mem::take(&mut self.moved);
            self.messages.push(user(ChatContent::List(parts)));
        }
    }

    fn item(&mut self, index: usize, item: InputItem) -> Result<(), TranslateError> {
        match item {
            InputItem::Message(m) => self.message(index, m),
            InputItem::FunctionCall(call) => {
                self.function_call(call);
                Ok(())
            }
            InputItem::FunctionCallOutput(output) => self.function_output(index, output),
            InputItem::Reasoning(r) => {
                self.open_assistant = None;
                self.flush_moved();
                let text = reasoning_text(&r);
                if self.reasoning_passback && !text.is_empty() {
                    match &mut self.reasoning {
                        Some(acc) => {
                            acc.push('\n');
                            acc.push_str(&text);
                        }
                        None => self.reasoning = Some(text),
                    }
                }
                Ok(())
            }
            InputItem::Other(map) => {
                self.boundary();
                self.messages.push(user(ChatContent::Text(item_json(map))));
                Ok(())
            }
        }
    }

    fn message(&mut self, index: usize, m: MessageItem) -> Result<(), TranslateError> {
        match m.role.to_ascii_lowercase().as_str() {
            "system" | "developer" => {
                self.boundary();
                let text = text_of(m.content);
                if !text.is_empty() {
                    self.system.push(text);
                }
            }
            "assistant" => {
                self.open_assistant = None;
                self.flush_moved();
                self.messages.push(ChatMessage::Assistant {
                    content: Some(ChatContent::Text(text_of(m.content))),
                    tool_calls: None,
                    reasoning_content: self.reasoning.take(),
                    extra: Extra::new(),
                });
                self.open_assistant = Some(self.messages.len() - 1);
            }
            _ => {
                self.boundary();
                let content = user_content(index, m.content)?;
                self.messages.push(user(content));
            }
        }
        Ok(())
    }

    fn function_call(&mut self, call: FunctionCallItem) {
        self.flush_moved();
        let FunctionCallItem {
            call_id,
            name,
            arguments,
            ..
        } = call;
        let tool_call = ToolCall {
            id: call_id,
            kind: "function".to_owned(),
            function: FunctionCall {
                name,
                arguments,
                extra: Extra::new(),
            },
            extra: Extra::new(),
        };
        if let Some(i) = self.open_assistant
            && let Some(ChatMessage::Assistant { tool_calls, .. }) = self.messages.get_mut(i)
        {
            tool_calls.get_or_insert_with(Vec::new).push(tool_call);
            return;
        }
        self.messages.push(ChatMessage::Assistant {
            content: None,
            tool_calls: Some(vec![tool_call]),
            reasoning_content: self.reasoning.take(),
            extra: Extra::new(),
        });
        self.open_assistant = Some(self.messages.len() - 1);
    }

    fn function_output(
        &mut self,
        index: usize,
        output: FunctionCallOutputItem,
    ) -> Result<(), TranslateError> {
        self.open_assistant = None;
        self.reasoning = None;
        let FunctionCallOutputItem {
            call_id, output, ..
        } = output;
        let text = match output {
            TextOrList::Text(text) => text,
            TextOrList::List(parts) => {
                let mut texts = Vec::new();
                let mut attachments = Vec::new();
                for part in parts {
                    match part_to_chat(index, part)? {
                        Some(ChatPart::Text { text, .. }) => texts.push(text),
                        Some(other) => attachments.push(other),
                        None => {}
                    }
                }
                if !attachments.is_empty() {
                    texts.push("[attachments follow in the next user message]".to_owned());
                    self.moved.push(ChatPart::text(format!(
                        "Attachments from tool call {call_id}:"
                    )));
                    self.moved.append(&mut attachments);
                }
                join_nonempty(texts)
            }
        };
        self.messages.push(ChatMessage::Tool {
            tool_call_id: call_id,
            content: ChatContent::Text(text),
            extra: Extra::new(),
        });
        Ok(())
    }

    fn finish(mut self) -> Vec<ChatMessage> {
        self.flush_moved();
        let mut out = Vec::with_capacity(self.messages.len() + 1);
        if !self.system.is_empty() {
            out.push(ChatMessage::System {
                content: ChatContent::Text(self.system.join("\n\n")),
                extra: Extra::new(),
            });
        }
        out.append(&mut self.messages);
        out
    }
}

fn user(content: ChatContent) -> ChatMessage {
    ChatMessage::User {
        content,
        extra: Extra::new(),
    }
}

/// An unknown item as JSON text, `type` first as the client wrote it (the typed parse moved it
/// last).
fn item_json(mut map: Extra) -> String {
    let mut ordered = Map::with_capacity(map.len());
    if let Some(kind) = map.remove("type") {
        ordered.insert("type".to_owned(), kind);
    }
    ordered.append(&mut map);
    Value::Object(ordered).to_string()
}

fn join_nonempty(parts: Vec<String>) -> String {
    let parts: Vec<String> = parts.into_iter().filter(|p| !p.is_empty()).collect();
    parts.join("\n")
}

/// The text of a part, when it has one (`None` for images and files).
fn part_text(part: &ContentPart) -> Option<String> {
    match part {
        ContentPart::InputText { text, .. }
        | ContentPart::OutputText { text, .. }
        | ContentPart::SummaryText { text, .. }
        | ContentPart::ReasoningText { text, .. } => Some(text.clone()),
        ContentPart::Refusal { refusal, .. } => Some(refusal.clone()),
        ContentPart::InputImage { .. } => None,
        ContentPart::Other(map) => match map.get("type").and_then(Value::as_str) {
            Some("input_file") => None,
            Some(_) | None => Some(match map.get("text").and_then(Value::as_str) {
                Some(text) => text.to_owned(),
                None => Value::Object(map.clone()).to_string(),
            }),
        },
    }
}

/// A content's text parts joined by newlines; images and files are dropped (system and
/// assistant messages cannot carry them).
fn text_of(content: TextOrList<ContentPart>) -> String {
    match content {
        TextOrList::Text(text) => text,
        TextOrList::List(parts) => join_nonempty(parts.iter().filter_map(part_text).collect()),
    }
}

/// A user message's content: a string when it is only text, chat parts when it holds images or
/// files.
fn user_content(
    index: usize,
    content: TextOrList<ContentPart>,
) -> Result<ChatContent, TranslateError> {
    let parts = match content {
        TextOrList::Text(text) => return Ok(ChatContent::Text(text)),
        TextOrList::List(parts) => parts,
    };
    let has_media = parts.iter().any(|p| part_text(p).is_none());
    if !has_media {
        return Ok(ChatContent::Text(join_nonempty(
            parts.iter().filter_map(part_text).collect(),
        )));
    }
    let mut out = Vec::with_capacity(parts.len());
    for part in parts {
        match part_to_chat(index, part)? {
            Some(ChatPart::Text { text, .. }) if text.is_empty() => {}
            Some(p) => out.push(p),
            None => {}
        }
    }
    Ok(ChatContent::List(out))
}

/// One part as a chat part: text, an image, or a file.
fn part_to_chat(index: usize, part: ContentPart) -> Result<Option<ChatPart>, TranslateError> {
    if let Some(text) = part_text(&part) {
        return Ok(Some(ChatPart::text(text)));
    }
    match part {
        ContentPart::InputImage {
            image_url: Some(url),
            detail,
            ..
        } if !url.is_empty() => Ok(Some(ChatPart::ImageUrl {
            image_url: ImageUrl {
                url,
                detail,
                extra: Extra::new(),
            },
            extra: Extra::new(),
        })),
        ContentPart::InputImage { .. } => Err(TranslateError::Unsupported {
            what: format!("input[{index}]: an input_image without an image_url (a file_id)"),
        }),
        ContentPart::Other(map) => match map.get("file_data").and_then(Value::as_str) {
            Some(data) => {
                let mut file = Map::new();
                file.insert("file_data".to_owned(), Value::String(data.to_owned()));
                let filename = map
                    .get("filename")
                    .and_then(Value::as_str)
                    .unwrap_or("document.pdf");
                file.insert("filename".to_owned(), Value::String(filename.to_owned()));
                Ok(Some(ChatPart::File {
                    file: Value::Object(file),
                    extra: Extra::new(),
                }))
            }
            None => Err(TranslateError::Unsupported {
                what: format!("input[{index}]: an input_file without file_data"),
            }),
        },
        ContentPart::InputText { .. }
        | ContentPart::OutputText { .. }
        | ContentPart::Refusal { .. }
        | ContentPart::SummaryText { .. }
        | ContentPart::ReasoningText { .. } => Ok(None),
    }
}

/// A reasoning item's text: its summary, else its content, joined by newlines.
fn reasoning_text(r: &ReasoningItem) -> String {
    let summary = join_nonempty(r.summary.iter().filter_map(part_text).collect());
    if !summary.is_empty() {
        return summary;
    }
    match &r.content {
        Some(parts) => join_nonempty(parts.iter().filter_map(part_text).collect()),
        None => String::new(),
    }
}

fn translate_tool(tool: ResponsesTool) -> Option<ChatTool> {
    let (name, description, parameters, strict) = match tool {
        ResponsesTool::Function {
            name,
            description,
            parameters,
            strict,
            ..
        } => (name, description, parameters, strict),
        // A chat-shaped tool (`{"type":"function","function":{...}}`) sent to /responses.
        ResponsesTool::Other(map) => {
            if map.get("type").and_then(Value::as_str) != Some("function") {
                return None;
            }
            let f = map.get("function")?.as_object()?;
            (
                f.get("name")?.as_str()?.to_owned(),
                f.get("description")
                    .and_then(Value::as_str)
                    .map(str::to_owned),
                f.get("parameters")
                    .filter(|p| !p.is_null())
                    .map(RawJson::from_value),
                f.get("strict").and_then(Value::as_bool),
            )
        }
    };
    Some(ChatTool {
        kind: "function".to_owned(),
        function: FunctionDef {
            name,
            description,
            parameters: Some(parameters.unwrap_or_else(super::empty_schema)),
            strict,
            extra: Extra::new(),
        },
        extra: Extra::new(),
    })
}

fn translate_tool_choice(choice: &Value) -> Option<ChatToolChoice> {
    match choice {
        Value::String(mode) => Some(ChatToolChoice::Mode(match mode.as_str() {
            "auto" => ToolChoiceMode::Auto,
            "none" => ToolChoiceMode::None,
            "required" => ToolChoiceMode::Required,
            other => ToolChoiceMode::Other(other.to_owned()),
        })),
        Value::Object(map) if map.get("type").and_then(Value::as_str) == Some("function") => {
            let name = map
                .get("name")
                .or_else(|| map.get("function").and_then(|f| f.get("name")))
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())?;
            Some(ChatToolChoice::Named(NamedToolChoice {
                kind: "function".to_owned(),
                function: NamedFunction {
                    name: name.to_owned(),
                    extra: Extra::new(),
                },
                extra: Extra::new(),
            }))
        }
        Value::Object(_) | Value::Null | Value::Bool(_) | Value::Number(_) | Value::Array(_) => {
            None
        }
    }
}

/// `text.format` with a JSON schema → `response_format`.
fn response_format(extra: &Extra) -> Option<Value> {
    let format = extra.get("text")?.get("format")?;
    if format.get("type").and_then(Value::as_str) != Some("json_schema") {
        return None;
    }
    let mut schema = Map::new();
    schema.insert(
        "name".to_owned(),
        format
            .get("name")
            .cloned()
            .unwrap_or_else(|| Value::from("output")),
    );
    schema.insert("schema".to_owned(), format.get("schema")?.clone());
    if let Some(strict) = format.get("strict").filter(|s| s.is_boolean()) {
        schema.insert("strict".to_owned(), strict.clone());
    }
    Some(json!({"type": "json_schema", "json_schema": schema}))
}
