//! OpenAI Responses ⇄ OpenAI Chat Completions, for the blackbox proxy: Codex speaks only
//! `POST /v1/responses`, the router only chat completions.
//!
//! Entry points:
//! - [`responses_into_chat`]: the request.
//! - [`chat_to_responses_response`]: a non-streamed response.
//! - [`ResponsesStreamTranslator`]: a streamed response, chunk by chunk.
//!
//! [`ResponsesStreamTranslator`]: super::ResponsesStreamTranslator
//! [`responses_into_chat`]: super::responses_into_chat
//! [`chat_to_responses_response`]: super::chat_to_responses_response
//! [`ChatOptions::reasoning_passback`]: super::ChatOptions::reasoning_passback
//! [`ChatOptions::max_tokens_field`]: super::ChatOptions::max_tokens_field
//! [`ChatOptions::max_output_tokens`]: super::ChatOptions::max_output_tokens
//! [`ChatOptions::reasoning`]: super::ChatOptions::reasoning
//!
//! The rules follow the Dressage proxy (`rollout_llm_proxy.py`), which is the contract the
//! blackbox serves; where it is silent or lossy the choice is named here. Each rule is pinned by
//! a golden test under `wire/tests/golden/responses_*`.
//!
//! **Request.** `instructions`, then every `developer` / `system` message (wherever it stands),
//! become one leading system message, joined by a blank line. Other messages keep their order:
//! text parts (`input_text`, `output_text`, `refusal`, ...) are joined by a newline into a string
//! content; a user message with `input_image` (or `input_file` with `file_data`) parts becomes a
//! list of chat parts instead (Dressage dumped images as JSON text); an image or file given only
//! by id cannot be sent and is refused. Unknown roles are users. `function_call` items become
//! assistant `tool_calls`: consecutive calls, and calls right after an assistant message, merge
//! into that one assistant message. `function_call_output` items become `tool` messages (text;
//! images in them move to a user message after the run of tool messages, since tool messages
//! cannot carry images on most servers). `reasoning` items (summary text, else content text,
//! joined by newlines) become the `reasoning_content` of the next assistant message or call
//! group, when [`ChatOptions::reasoning_passback`] is set; any other item in between drops them.
//! Items of other types (`custom_tool_call`, `local_shell_call`, `item_reference`, ...) become a
//! user message holding the item's JSON, as in Dressage. Function tools become chat tools
//! (`parameters` defaulting to an empty object schema); other tools (`web_search`, `custom`,
//! `local_shell`, ...) are dropped. `tool_choice` strings pass through, `{"type":"function",
//! "name"}` becomes a named function, anything else is left to the upstream default; with no
//! tools left, `tool_choice` and `parallel_tool_calls` are not sent (OpenAI rejects them).
//! `max_output_tokens` → [`ChatOptions::max_tokens_field`] (clamped to
//! [`ChatOptions::max_output_tokens`]; never invented), `temperature`, `top_p`,
//! `parallel_tool_calls` and `stream` pass through, streaming requests ask for `include_usage`,
//! `text.format` with a JSON schema → `response_format`, `reasoning.effort` →
//! `reasoning_effort` or `reasoning.effort` as [`ChatOptions::reasoning`] says (not sent by
//! default).
//! `store`, `metadata`, `include`, `prompt_cache_key`, `previous_response_id` and the other
//! Responses-only fields are not sent: the proxy is stateless, as Dressage's is (Codex sends the
//! whole conversation with `store: false`).
//!
//! **Response.** `output` is a `reasoning` item (the chat reasoning as one `summary_text`), a
//! `message` item with one `output_text` part (present when there is text or when there are no
//! tool calls, so a response is never empty), then one `function_call` item per tool call (`id`
//! `fc_<call_id>`, `call_id` the chat tool-call id). `status` is always `completed`, as in
//! Dressage: Codex treats `incomplete` as a failed turn and retries it, which would repeat a
//! generation that hit its token limit. Usage: `input_tokens = prompt_tokens` (cached tokens
//! included, as in the Responses API, and reported in `input_tokens_details`), `output_tokens =
//! completion_tokens` (reasoning tokens in `output_tokens_details`), `total_tokens` as reported
//! or the sum; without upstream usage, an estimate (the caller's input estimate, output bytes/4).
//!
//! **Stream.** See [`ResponsesStreamTranslator`]: the same items and usage as the non-streamed
//! translation, announced and closed in the event order Codex parses.

use serde_json::{Number, Value};

use super::now_nanos;
use crate::chat::ChatUsage;
use crate::responses::{
    ContentPart, Extra, FunctionCallItem, InputTokensDetails, MessageItem, OutputItem,
    OutputTokensDetails, ReasoningItem, ResponsesRequest, ResponsesUsage,
};
use crate::serde_util::TextOrList;

/// Settings of a chat → Responses translation (streamed or not).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ResponsesOptions {
    /// The model name to report; `None` reports the upstream's (what Dressage does).
    pub model: Option<String>,
    /// The response id to report; `None` keeps the upstream's completion id (as Dressage does),
    /// or makes a fresh `resp_...` one when the upstream sent none.
    pub response_id: Option<String>,
    /// `created_at` to report (Unix seconds); `None` uses the upstream's `created`, else now.
    pub created_at: Option<u64>,
    /// Input tokens to report if the upstream never reports usage (an estimate, or 0).
    pub input_tokens_estimate: u64,
}

impl ResponsesOptions {
    /// The options for answering `req`: its model reported back.
    pub fn for_request(req: &ResponsesRequest) -> Self {
        Self {
            model: Some(req.model.clone()).filter(|m| !m.is_empty()),
            ..Self::default()
        }
    }
}

/// OpenAI chat usage → Responses usage. Both count cached tokens inside the input.
pub fn responses_usage_from_chat(u: &ChatUsage) -> ResponsesUsage {
    let reasoning = u
        .extra
        .get("completion_tokens_details")
        .and_then(|d| d.get("reasoning_tokens"))
        .and_then(Value::as_u64)
        .unwrap_or(0);
    let sum = u.prompt_tokens.saturating_add(u.completion_tokens);
    ResponsesUsage {
        input_tokens: u.prompt_tokens,
        input_tokens_details: Some(InputTokensDetails {
            cached_tokens: u.cached_tokens(),
            extra: Extra::new(),
        }),
        output_tokens: u.completion_tokens,
        output_tokens_details: Some(OutputTokensDetails {
            reasoning_tokens: reasoning.min(u.completion_tokens),
            extra: Extra::new(),
        }),
        total_tokens: u.total_tokens.filter(|t| *t > 0).unwrap_or(sum),
        extra: Extra::new(),
    }
}

/// The usage to report when the upstream reported none: the caller's input estimate and
/// bytes/4 of output, rounded up.
pub(super) fn estimated_responses_usage(input_tokens: u64, output_bytes: usize) -> ResponsesUsage {
    let output_tokens = u64::try_from(output_bytes.div_ceil(4)).unwrap_or(u64::MAX);
    ResponsesUsage {
        input_tokens,
        input_tokens_details: Some(InputTokensDetails::default()),
        output_tokens,
        output_tokens_details: Some(OutputTokensDetails::default()),
        total_tokens: input_tokens.saturating_add(output_tokens),
        extra: Extra::new(),
    }
}

/// The response id to report: the caller's, else the upstream's, else a fresh `resp_...` one.
pub(super) fn response_id(opts: &ResponsesOptions, upstream: &str) -> String {
    match &opts.response_id {
        Some(id) => id.clone(),
        None if !upstream.is_empty() => upstream.to_owned(),
        None => super::fresh_id("resp"),
    }
}

/// The Unix time to report: the caller's, else the upstream's `created`, else now.
pub(super) fn created_at(opts: &ResponsesOptions, upstream: Option<&Value>) -> Number {
    let secs = opts
        .created_at
        .or_else(|| upstream.and_then(Value::as_u64))
        .unwrap_or_else(|| u64::try_from(now_nanos() / 1_000_000_000).unwrap_or(0));
    Number::from(secs)
}

/// The id part that item ids are built from: the response id without its `resp_` prefix, so
/// `resp_X` has items `msg_X`, `rs_X`, `msg_X_2`, ...
pub(super) fn item_id(prefix: &str, response_id: &str, output_index: u32) -> String {
    let base = response_id.strip_prefix("resp_").unwrap_or(response_id);
    if output_index == 0 {
        format!("{prefix}_{base}")
    } else {
        format!("{prefix}_{base}_{output_index}")
    }
}

/// A finished assistant message item with one `output_text` part.
pub(super) fn message_item(id: String, text: String, status: &str) -> OutputItem {
    OutputItem::Message(MessageItem {
        id: Some(id),
        role: "assistant".to_owned(),
        content: TextOrList::List(vec![output_text_part(text)]),
        status: Some(status.to_owned()),
        extra: Extra::new(),
    })
}

pub(super) fn output_text_part(text: String) -> ContentPart {
    ContentPart::OutputText {
        text,
        annotations: Vec::new(),
        extra: Extra::new(),
    }
}

pub(super) fn summary_text_part(text: String) -> ContentPart {
    ContentPart::SummaryText {
        text,
        extra: Extra::new(),
    }
}

/// A reasoning item whose summary is `text` (empty summary when `text` is empty, as the
/// `output_item.added` of a streamed reasoning item has).
pub(super) fn reasoning_item(id: String, text: String) -> OutputItem {
    OutputItem::Reasoning(ReasoningItem {
        id: Some(id),
        summary: if text.is_empty() {
            Vec::new()
        } else {
            vec![summary_text_part(text)]
        },
        content: None,
        encrypted_content: None,
        extra: Extra::new(),
    })
}

/// A function call item; its id is `fc_<call_id>` as in Dressage.
pub(super) fn function_call_item(
    call_id: String,
    name: String,
    arguments: String,
    status: &str,
) -> OutputItem {
    OutputItem::FunctionCall(FunctionCallItem {
        id: Some(format!("fc_{call_id}")),
        call_id,
        name,
        arguments,
        status: Some(status.to_owned()),
        extra: Extra::new(),
    })
}
