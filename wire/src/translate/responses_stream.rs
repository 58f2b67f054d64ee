//! Streamed OpenAI chat completion chunks → OpenAI Responses stream events, as a state machine
//! fed one chunk at a time.
//!
//! Dressage buffered the whole upstream stream and replayed it at the end; this translator
//! streams as the chunks arrive, in the event order of OpenAI's own Responses streams, which is
//! what Codex parses (`codex-api` `sse/responses.rs`: it takes text from
//! `response.output_text.delta`, reasoning from `response.reasoning_summary_text.delta`, whole
//! items from `response.output_item.done`, the end and the usage from `response.completed`, and
//! a failure from `response.failed`'s `response.error` `{code, message}`):
//! - `response.created` then `response.in_progress`, first, once;
//! - an item per run of reasoning (a `reasoning` item with one `summary_text` part), per run of
//!   text (a `message` item with one `output_text` part) and per tool call (a `function_call`
//!   item), at contiguous `output_index`es in the order they start; an item is announced with
//!   `response.output_item.added` (then `content_part.added` / `reasoning_summary_part.added`)
//!   before its first delta, and never for empty text;
//! - a reasoning or text item ends (`*.done` events, then `response.output_item.done`) when
//!   another item starts; a function call is opened when its name is known (arguments that
//!   arrive before are held) and its arguments stream as `function_call_arguments.delta`, but
//!   it is only closed at the end of the response, all open items in `output_index` order:
//!   Codex runs a call as soon as its `output_item.done` arrives, so a stream that fails later
//!   must not have announced any call complete;
//! - `response.completed` (the whole `response`: every item, `usage`) waits for both the
//!   finish reason and the usage (OpenAI sends usage in a `choices: []` chunk after the finish
//!   reason), or for the end of the stream; anything after it is dropped;
//! - every event carries `sequence_number`, counting from 0;
//! - an upstream that ends without a finish reason, sends an unreadable chunk or an `error`
//!   chunk yields `response.failed` (status `failed`, `error.code` `context_length_exceeded`
//!   for an overflowing prompt, which Codex answers by compacting; otherwise the upstream's code
//!   or `server_error`, which Codex retries); open items are left open.

use serde_json::Value;

use super::responses::{
    ResponsesOptions, created_at, estimated_responses_usage, fresh_response_id, function_call_item,
    item_id, message_item, output_text_part, reasoning_item, responses_usage_from_chat,
    summary_text_part,
};
use super::stream::{Data, EndGate, Prose, ToolSlot, prose_pieces, read_data, tool_piece};
use crate::chat::{ChatChunk, ToolCallDelta};
use crate::error::responses_error_from_openai;
use crate::responses::{
    Extra, OutputItem, Response, ResponseStatus, ResponseStreamEvent, ResponsesUsage,
};

/// One output item being streamed.
#[derive(Debug)]
struct Item {
    id: String,
    kind: ItemKind,
    /// Its text (reasoning, message) or arguments (function call) so far.
    text: String,
    closed: bool,
}

#[derive(Debug)]
enum ItemKind {
    Reasoning,
    Message,
    Call { call_id: String, name: String },
}

/// Translates one streamed chat completion into Responses stream events.
///
/// Feed it every chunk with [`push_chunk`](Self::push_chunk) (or every SSE `data:` payload
/// with [`push_data`](Self::push_data), which also understands `[DONE]` and bad JSON), then
/// call [`finish`](Self::finish) at end of stream. Each call returns the events to send, in
/// order; [`ResponseStreamEvent::write_sse`] frames them. Once the response has completed or
/// failed, further input is ignored.
#[derive(Debug)]
pub struct ResponsesStreamTranslator {
    opts: ResponsesOptions,
    started: bool,
    done: bool,
    sequence: u64,
    response_id: String,
    model: String,
    created_at: serde_json::Number,
    items: Vec<Item>,
    /// The reasoning or message item receiving deltas, by position in `items`.
    prose: Option<(Prose, usize)>,
    /// Each call's position in `items` once opened.
    tools: Vec<ToolSlot<Option<usize>>>,
    end: EndGate,
    output_bytes: usize,
    final_usage: Option<ResponsesUsage>,
}

impl ResponsesStreamTranslator {
    pub fn new(opts: ResponsesOptions) -> Self {
        Self {
            opts,
            started: false,
            done: false,
            sequence: 0,
            response_id: String::new(),
            model: String::new(),
            created_at: serde_json::Number::from(0u64),
            items: Vec::new(),
            prose: None,
            tools: Vec::new(),
            end: EndGate::default(),
            output_bytes: 0,
            final_usage: None,
        }
    }

    /// Emits `response.created` and `response.in_progress` now, before the first chunk (e.g. as
    /// soon as the upstream answered 200, so a slow prefill does not trip the client's idle
    /// timeout). Idempotent. The response id is [`ResponsesOptions::response_id`] or a fresh
    /// one.
    pub fn start(&mut self) -> Vec<ResponseStreamEvent> {
        let mut out = Vec::new();
        if !self.started && !self.done {
            self.emit_start("", String::new(), None, &mut out);
        }
        out
    }

    /// Whether the response has completed (`response.completed`) or failed
    /// (`response.failed`).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The usage reported in `response.completed`, once sent.
    pub fn final_usage(&self) -> Option<&ResponsesUsage> {
        self.final_usage.as_ref()
    }

    /// Translates one SSE `data:` payload: `[DONE]` ends the stream, JSON is a chunk, anything
    /// else is an upstream failure reported as `response.failed`.
    pub fn push_data(&mut self, data: &str) -> Vec<ResponseStreamEvent> {
        match read_data(data) {
            Data::Done => self.finish(),
            Data::Chunk(chunk) => self.push_chunk(*chunk),
            Data::Unreadable(message) => self.fail("server_error", message),
        }
    }

    /// Translates one chunk.
    pub fn push_chunk(&mut self, chunk: ChatChunk) -> Vec<ResponseStreamEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        let ChatChunk {
            id,
            model,
            choices,
            usage,
            error,
            extra,
        } = chunk;
        if !self.started {
            self.emit_start(&id, model, extra.get("created"), &mut out);
        } else if self.model.is_empty() {
            // Started before the upstream named its model: report it from here on.
            self.model = model;
        }
        if let Some(error) = error.filter(|e| !e.is_null()) {
            let (code, message) = responses_error_from_openai(&error);
            out.extend(self.fail(&code, message));
            return out;
        }
        let mut finish = None;
        if let Some(choice) = choices.into_iter().find(|c| c.index == 0) {
            let mut delta = choice.delta;
            for (kind, text) in prose_pieces(&mut delta) {
                self.prose_delta(kind, text, &mut out);
            }
            for call in delta.tool_calls.unwrap_or_default() {
                self.tool_delta(call, &mut out);
            }
            finish = choice.finish_reason;
        }
        if self.end.record(usage, finish) {
            self.emit_tail(&mut out);
        }
        out
    }

    /// Ends the stream (upstream EOF or `[DONE]`): completes the response if a finish reason
    /// arrived, otherwise reports `response.failed`. Idempotent.
    pub fn finish(&mut self) -> Vec<ResponseStreamEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        if !self.started {
            self.emit_start("", String::new(), None, &mut out);
            out.extend(self.fail(
                "server_error",
                "upstream ended the stream without sending a response".to_owned(),
            ));
            return out;
        }
        if self.end.finish.is_none() {
            return self.fail(
                "server_error",
                "upstream ended the stream before the response was complete".to_owned(),
            );
        }
        self.emit_tail(&mut out);
        out
    }

    /// Reports a failure: `response.failed` with `error {code, message}` and the items that
    /// were complete. Open items stay open.
    fn fail(&mut self, code: &str, message: String) -> Vec<ResponseStreamEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        self.done = true;
        let mut response = self.response(ResponseStatus::Failed, self.closed_items());
        response.error = Some(serde_json::json!({"code": code, "message": message}));
        self.push(
            ResponseStreamEvent::Failed {
                response,
                extra: Extra::new(),
            },
            &mut out,
        );
        out
    }

    /// Appends `event` with the next sequence number.
    fn push(&mut self, mut event: ResponseStreamEvent, out: &mut Vec<ResponseStreamEvent>) {
        let extra = match &mut event {
            ResponseStreamEvent::Created { extra, .. }
            | ResponseStreamEvent::InProgress { extra, .. }
            | ResponseStreamEvent::Completed { extra, .. }
            | ResponseStreamEvent::Failed { extra, .. }
            | ResponseStreamEvent::Incomplete { extra, .. }
            | ResponseStreamEvent::OutputItemAdded { extra, .. }
            | ResponseStreamEvent::OutputItemDone { extra, .. }
            | ResponseStreamEvent::ContentPartAdded { extra, .. }
            | ResponseStreamEvent::ContentPartDone { extra, .. }
            | ResponseStreamEvent::OutputTextDelta { extra, .. }
            | ResponseStreamEvent::OutputTextDone { extra, .. }
            | ResponseStreamEvent::FunctionCallArgumentsDelta { extra, .. }
            | ResponseStreamEvent::FunctionCallArgumentsDone { extra, .. }
            | ResponseStreamEvent::ReasoningSummaryTextDelta { extra, .. }
            | ResponseStreamEvent::ReasoningSummaryTextDone { extra, .. }
            | ResponseStreamEvent::ReasoningSummaryPartAdded { extra, .. }
            | ResponseStreamEvent::ReasoningSummaryPartDone { extra, .. }
            | ResponseStreamEvent::ReasoningTextDelta { extra, .. }
            | ResponseStreamEvent::Error { extra, .. }
            | ResponseStreamEvent::Other(extra) => extra,
        };
        extra.insert("sequence_number".to_owned(), Value::from(self.sequence));
        self.sequence += 1;
        out.push(event);
    }

    fn response(&self, status: ResponseStatus, output: Vec<OutputItem>) -> Response {
        Response {
            id: self.response_id.clone(),
            created_at: Some(self.created_at.clone()),
            status: Some(status),
            model: self.model.clone(),
            output,
            ..Response::default()
        }
    }

    fn emit_start(
        &mut self,
        upstream_id: &str,
        upstream_model: String,
        upstream_created: Option<&Value>,
        out: &mut Vec<ResponseStreamEvent>,
    ) {
        self.started = true;
        self.response_id = match &self.opts.response_id {
            Some(id) => id.clone(),
            None if !upstream_id.is_empty() => upstream_id.to_owned(),
            None => fresh_response_id(),
        };
        self.model = self.opts.model.clone().unwrap_or(upstream_model);
        self.created_at = created_at(&self.opts, upstream_created);
        let response = self.response(ResponseStatus::InProgress, Vec::new());
        self.push(
            ResponseStreamEvent::Created {
                response: response.clone(),
                extra: Extra::new(),
            },
            out,
        );
        self.push(
            ResponseStreamEvent::InProgress {
                response,
                extra: Extra::new(),
            },
            out,
        );
    }

    /// Opens an item: `output_item.added` with its in-progress form. Returns its position.
    fn open_item(&mut self, kind: ItemKind, out: &mut Vec<ResponseStreamEvent>) -> usize {
        let pos = self.items.len();
        let output_index = index(pos);
        let id = match &kind {
            ItemKind::Reasoning => item_id("rs", &self.response_id, output_index),
            ItemKind::Message => item_id("msg", &self.response_id, output_index),
            ItemKind::Call { call_id, .. } => format!("fc_{call_id}"),
        };
        self.items.push(Item {
            id,
            kind,
            text: String::new(),
            closed: false,
        });
        let item = self.item_json(pos, "in_progress");
        self.push(
            ResponseStreamEvent::OutputItemAdded {
                output_index,
                item,
                extra: Extra::new(),
            },
            out,
        );
        let item_id = self.items[pos].id.clone();
        match &self.items[pos].kind {
            ItemKind::Reasoning => self.push(
                ResponseStreamEvent::ReasoningSummaryPartAdded {
                    item_id,
                    output_index,
                    summary_index: 0,
                    part: summary_text_part(String::new()),
                    extra: Extra::new(),
                },
                out,
            ),
            ItemKind::Message => self.push(
                ResponseStreamEvent::ContentPartAdded {
                    item_id,
                    output_index,
                    content_index: 0,
                    part: output_text_part(String::new()),
                    extra: Extra::new(),
                },
                out,
            ),
            ItemKind::Call { .. } => {}
        }
        pos
    }

    /// An item as the `item` of an event or an entry of `output`.
    fn item_json(&self, pos: usize, status: &str) -> OutputItem {
        let item = &self.items[pos];
        match &item.kind {
            ItemKind::Reasoning => reasoning_item(item.id.clone(), item.text.clone()),
            ItemKind::Message if status == "in_progress" => {
                let mut message = message_item(item.id.clone(), String::new(), status);
                if let OutputItem::Message(m) = &mut message {
                    m.content = crate::serde_util::TextOrList::List(Vec::new());
                }
                message
            }
            ItemKind::Message => message_item(item.id.clone(), item.text.clone(), status),
            ItemKind::Call { call_id, name } => {
                function_call_item(call_id.clone(), name.clone(), item.text.clone(), status)
            }
        }
    }

    fn closed_items(&self) -> Vec<OutputItem> {
        (0..self.items.len())
            .filter(|&pos| self.items[pos].closed)
            .map(|pos| self.item_json(pos, "completed"))
            .collect()
    }

    /// Closes an item: its `*.done` events, then `output_item.done`.
    fn close_item(&mut self, pos: usize, out: &mut Vec<ResponseStreamEvent>) {
        if self.items[pos].closed {
            return;
        }
        self.items[pos].closed = true;
        let output_index = index(pos);
        let item_id = self.items[pos].id.clone();
        let text = self.items[pos].text.clone();
        match &self.items[pos].kind {
            ItemKind::Reasoning => {
                self.push(
                    ResponseStreamEvent::ReasoningSummaryTextDone {
                        item_id: item_id.clone(),
                        output_index,
                        summary_index: 0,
                        text: text.clone(),
                        extra: Extra::new(),
                    },
                    out,
                );
                self.push(
                    ResponseStreamEvent::ReasoningSummaryPartDone {
                        item_id,
                        output_index,
                        summary_index: 0,
                        part: summary_text_part(text),
                        extra: Extra::new(),
                    },
                    out,
                );
            }
            ItemKind::Message => {
                self.push(
                    ResponseStreamEvent::OutputTextDone {
                        item_id: item_id.clone(),
                        output_index,
                        content_index: 0,
                        text: text.clone(),
                        extra: logprobs(),
                    },
                    out,
                );
                self.push(
                    ResponseStreamEvent::ContentPartDone {
                        item_id,
                        output_index,
                        content_index: 0,
                        part: output_text_part(text),
                        extra: Extra::new(),
                    },
                    out,
                );
            }
            ItemKind::Call { .. } => self.push(
                ResponseStreamEvent::FunctionCallArgumentsDone {
                    item_id,
                    output_index,
                    arguments: text,
                    extra: Extra::new(),
                },
                out,
            ),
        }
        let item = self.item_json(pos, "completed");
        self.push(
            ResponseStreamEvent::OutputItemDone {
                output_index,
                item,
                extra: Extra::new(),
            },
            out,
        );
    }

    fn close_prose(&mut self, out: &mut Vec<ResponseStreamEvent>) {
        if let Some((_, pos)) = self.prose.take() {
            self.close_item(pos, out);
        }
    }

    fn prose_delta(&mut self, kind: Prose, text: String, out: &mut Vec<ResponseStreamEvent>) {
        if text.is_empty() {
            return;
        }
        self.output_bytes += text.len();
        let pos = match self.prose {
            Some((open, pos)) if open == kind => pos,
            Some(_) | None => {
                self.close_prose(out);
                let item = match kind {
                    Prose::Thinking => ItemKind::Reasoning,
                    Prose::Text => ItemKind::Message,
                };
                let pos = self.open_item(item, out);
                self.prose = Some((kind, pos));
                pos
            }
        };
        self.items[pos].text.push_str(&text);
        let item_id = self.items[pos].id.clone();
        let output_index = index(pos);
        let event = match kind {
            Prose::Thinking => ResponseStreamEvent::ReasoningSummaryTextDelta {
                item_id,
                output_index,
                summary_index: 0,
                delta: text,
                extra: Extra::new(),
            },
            Prose::Text => ResponseStreamEvent::OutputTextDelta {
                item_id,
                output_index,
                content_index: 0,
                delta: text,
                extra: logprobs(),
            },
        };
        self.push(event, out);
    }

    fn tool_delta(&mut self, call: ToolCallDelta, out: &mut Vec<ResponseStreamEvent>) {
        let (slot, args) = tool_piece(&mut self.tools, call);
        if !args.is_empty() {
            self.output_bytes += args.len();
            match self.tools[slot].state {
                Some(pos) => self.arguments_delta(pos, args, out),
                None => self.tools[slot].pending.push_str(&args),
            }
        }
        if self.tools[slot].state.is_none()
            && let Some(name) = self.tools[slot].name.clone()
        {
            self.close_prose(out);
            let s = &self.tools[slot];
            let call_id = match &s.id {
                Some(id) => id.clone(),
                None => format!("call_{}", s.key),
            };
            let pos = self.open_item(ItemKind::Call { call_id, name }, out);
            let s = &mut self.tools[slot];
            s.state = Some(pos);
            let pending = std::mem::take(&mut s.pending);
            if !pending.is_empty() {
                self.arguments_delta(pos, pending, out);
            }
        }
    }

    fn arguments_delta(&mut self, pos: usize, delta: String, out: &mut Vec<ResponseStreamEvent>) {
        self.items[pos].text.push_str(&delta);
        let item_id = self.items[pos].id.clone();
        self.push(
            ResponseStreamEvent::FunctionCallArgumentsDelta {
                item_id,
                output_index: index(pos),
                delta,
                extra: Extra::new(),
            },
            out,
        );
    }

    fn emit_tail(&mut self, out: &mut Vec<ResponseStreamEvent>) {
        if let Some(slot) = self
            .tools
            .iter()
            .find(|s| s.state.is_none() && !s.is_empty())
        {
            let message = format!(
                "upstream sent tool call {} without a function name",
                slot.key
            );
            out.extend(self.fail("server_error", message));
            return;
        }
        self.prose = None;
        // A response always says something: an empty message when there is neither text nor a
        // call (as the non-streamed translation and Dressage do).
        if !self
            .items
            .iter()
            .any(|i| matches!(i.kind, ItemKind::Message | ItemKind::Call { .. }))
        {
            self.open_item(ItemKind::Message, out);
        }
        for pos in 0..self.items.len() {
            self.close_item(pos, out);
        }
        let usage = match &self.end.usage {
            Some(u) => responses_usage_from_chat(u),
            None => estimated_responses_usage(self.opts.input_tokens_estimate, self.output_bytes),
        };
        let mut response = self.response(ResponseStatus::Completed, self.closed_items());
        response.usage = Some(usage.clone());
        self.push(
            ResponseStreamEvent::Completed {
                response,
                extra: Extra::new(),
            },
            out,
        );
        self.final_usage = Some(usage);
        self.done = true;
    }
}

/// An `output_index` for a position in `items` (a response never has 4 billion items).
fn index(pos: usize) -> u32 {
    u32::try_from(pos).unwrap_or(u32::MAX)
}

/// `"logprobs": []`, which OpenAI's text events carry and typed SDK clients expect.
fn logprobs() -> Extra {
    let mut extra = Extra::new();
    extra.insert("logprobs".to_owned(), Value::Array(Vec::new()));
    extra
}
