//! Non-streamed OpenAI chat completions response → Anthropic Messages response (rules in the
//! module docs of [`crate::translate`]).

use super::estimated_usage;
use super::{
    ResponseOptions, TranslateError, final_stop, message_id_from, sanitize_tool_id, tool_input,
    usage_from_chat,
};
use crate::anthropic::{ContentBlock, Extra, MessagesResponse};
use crate::chat::{ChatContent, ChatResponse, Choice, ContentPart, ResponseMessage};

/// Translates a response, consuming it. Only the first choice is used (the bridge never asks
/// for `n > 1`).
pub fn chat_to_anthropic_response(
    resp: ChatResponse,
    opts: &ResponseOptions,
) -> Result<MessagesResponse, TranslateError> {
    let ChatResponse {
        id,
        model,
        choices,
        usage,
        ..
    } = resp;
    let choice = first_choice(choices)?;
    let matched_stop = choice.matched_stop().map(str::to_owned);
    let mut message = choice.message;

    let mut content = Vec::new();
    let (reasoning, text) = reasoning_and_text(&mut message);
    if let Some(thinking) = reasoning {
        content.push(ContentBlock::Thinking {
            thinking,
            signature: Some(String::new()),
            extra: Extra::new(),
        });
    }
    if !text.is_empty() {
        content.push(ContentBlock::text(text));
    }
    let calls = message.tool_calls.unwrap_or_default();
    let had_tool_calls = !calls.is_empty();
    for call in calls {
        content.push(ContentBlock::ToolUse {
            id: sanitize_tool_id(&call.id).into_owned(),
            name: opts.tool_names.original(&call.function.name).to_owned(),
            input: tool_input(&call.function.arguments),
            extra: Extra::new(),
        });
    }

    let (stop_reason, stop_sequence) = final_stop(
        choice.finish_reason.as_ref(),
        had_tool_calls,
        matched_stop.as_deref(),
        &opts.stop_sequences,
    );
    let usage = match &usage {
        Some(u) => usage_from_chat(u),
        None => estimated_usage(opts.input_tokens_estimate, output_bytes(&content)),
    };
    Ok(MessagesResponse {
        id: opts
            .message_id
            .clone()
            .unwrap_or_else(|| message_id_from(&id)),
        content,
        model: opts.model.clone().unwrap_or(model),
        stop_reason: Some(stop_reason),
        stop_sequence,
        usage,
        ..MessagesResponse::new("", "")
    })
}

/// Bytes of generated output, for the usage estimate when the upstream reports none.
fn output_bytes(content: &[ContentBlock]) -> usize {
    content
        .iter()
        .map(|b| match b {
            ContentBlock::Text { text, .. } => text.len(),
            ContentBlock::Thinking { thinking, .. } => thinking.len(),
            ContentBlock::ToolUse { input, .. } => input.to_string().len(),
            ContentBlock::Image { .. }
            | ContentBlock::Document { .. }
            | ContentBlock::ToolResult { .. }
            | ContentBlock::RedactedThinking { .. }
            | ContentBlock::Other(_) => 0,
        })
        .sum()
}

/// The choice to translate: the first by index (the bridge and the proxy never ask for
/// `n > 1`).
pub(super) fn first_choice(choices: Vec<Choice>) -> Result<Choice, TranslateError> {
    choices
        .into_iter()
        .min_by_key(|c| c.index)
        .ok_or(TranslateError::NoChoices)
}

/// Takes a message's reasoning (from whichever field the server uses; `None` when empty) and
/// its visible text: the text parts joined, then any refusal.
pub(super) fn reasoning_and_text(message: &mut ResponseMessage) -> (Option<String>, String) {
    let reasoning = message
        .reasoning_content
        .take()
        .or(message.reasoning.take())
        .filter(|r| !r.is_empty());
    let mut text = match message.content.take() {
        Some(ChatContent::Text(t)) => t,
        Some(ChatContent::List(parts)) => parts
            .into_iter()
            .filter_map(|p| match p {
                ContentPart::Text { text, .. } => Some(text),
                ContentPart::ImageUrl { .. } | ContentPart::File { .. } | ContentPart::Other(_) => {
                    None
                }
            })
            .collect(),
        None => String::new(),
    };
    if let Some(refusal) = message.refusal.take().filter(|r| !r.is_empty()) {
        text.push_str(&refusal);
    }
    (reasoning, text)
}
