//! Non-streamed OpenAI chat completions response → OpenAI Responses `response` object (rules in
//! the module docs of [`crate::translate::responses`]).

use super::TranslateError;
use super::response::{first_choice, reasoning_and_text};
use super::responses::{
    ResponsesOptions, created_at, estimated_responses_usage, fresh_response_id, function_call_item,
    item_id, message_item, reasoning_item, responses_usage_from_chat,
};
use crate::chat::ChatResponse;
use crate::responses::{Extra, Response, ResponseStatus};

/// Translates a response, consuming it. Only the first choice is used.
pub fn chat_to_responses_response(
    resp: ChatResponse,
    opts: &ResponsesOptions,
) -> Result<Response, TranslateError> {
    let ChatResponse {
        id,
        model,
        choices,
        usage,
        extra,
    } = resp;
    let mut message = first_choice(choices)?.message;
    let response_id = match &opts.response_id {
        Some(id) => id.clone(),
        None if !id.is_empty() => id,
        None => fresh_response_id(),
    };

    let mut output = Vec::new();
    let mut output_bytes = 0;
    let (reasoning, text) = reasoning_and_text(&mut message);
    if let Some(text) = reasoning {
        output_bytes += text.len();
        output.push(reasoning_item(item_id("rs", &response_id, 0), text));
    }
    let calls = message.tool_calls.unwrap_or_default();
    if !text.is_empty() || calls.is_empty() {
        output_bytes += text.len();
        let index = u32::try_from(output.len()).unwrap_or(u32::MAX);
        output.push(message_item(
            item_id("msg", &response_id, index),
            text,
            "completed",
        ));
    }
    for (n, call) in calls.into_iter().enumerate() {
        output_bytes += call.function.arguments.len();
        let call_id = if call.id.is_empty() {
            format!("call_{n}")
        } else {
            call.id
        };
        output.push(function_call_item(
            call_id,
            call.function.name,
            call.function.arguments,
            "completed",
        ));
    }

    let usage = match &usage {
        Some(u) => responses_usage_from_chat(u),
        None => estimated_responses_usage(opts.input_tokens_estimate, output_bytes),
    };
    Ok(Response {
        id: response_id,
        created_at: Some(created_at(opts, extra.get("created"))),
        status: Some(ResponseStatus::Completed),
        model: opts.model.clone().unwrap_or(model),
        output,
        usage: Some(usage),
        extra: Extra::new(),
        ..Response::default()
    })
}
