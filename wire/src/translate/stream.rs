//! Streamed OpenAI chat completion chunks → Anthropic stream events, as a state machine fed one
//! chunk at a time.
//!
//! The output keeps the contract Claude Code's SDK enforces (and that the anchors' bugs broke):
//! - exactly one `message_start`, first, carrying a `usage` object;
//! - blocks at contiguous indices, never empty (no block is opened for `""`), never reopened,
//!   never receiving a delta of another kind (thinking and text get separate blocks);
//! - `tool_use` starts with `input: {}` and its arguments arrive only as `input_json_delta`,
//!   the first piece included, even when id, name and all arguments come in one chunk;
//! - arguments that arrive before the tool's name are held until the name is known;
//! - a tool block is closed when another block starts and its arguments already form complete
//!   JSON (the usual sequential case, which then looks exactly like Anthropic's own streams);
//!   a tool whose arguments are still incomplete stays open so upstreams that interleave
//!   parallel calls still land every piece in the right block; the rest close at the end;
//! - `message_delta` is held until both the finish reason and the usage are known (OpenAI
//!   sends usage in a final `choices: []` chunk after the finish reason), or until the stream
//!   ends; anything after it is dropped;
//! - an upstream that ends without a finish reason yields an `error` event, never a fake
//!   `end_turn`: open blocks are deliberately left unclosed so a client cannot run a tool with
//!   half its arguments.

use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::Value;

use super::{
    ResponseOptions, estimated_usage, final_stop, message_id_from, sanitize_tool_id,
    usage_from_chat,
};
use crate::anthropic::{
    BlockDelta, ContentBlock, DeltaUsage, ErrorType, Extra, MessageDeltaBody, MessagesResponse,
    StreamEvent, Usage,
};
use crate::chat::{
    ChatChunk, ChatContent, ChatUsage, ChunkDelta, ContentPart, FinishReason, ToolCallDelta,
};
use crate::error::stream_error_from_openai;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Prose {
    Thinking,
    Text,
}

/// Tracks whether a streamed JSON text is one complete value, without parsing it.
#[derive(Debug, Default, Clone, Copy)]
struct JsonProgress {
    depth: u32,
    started: bool,
    in_string: bool,
    escaped: bool,
    /// Something other than whitespace followed the end of the value, or a bracket closed
    /// that was never opened: not a single valid value.
    broken: bool,
}

impl JsonProgress {
    fn feed(&mut self, s: &str) {
        for b in s.bytes() {
            if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
                continue;
            }
            match b {
                b' ' | b'\n' | b'\r' | b'\t' => {}
                _ if self.started && self.depth == 0 => self.broken = true,
                b'{' | b'[' => {
                    self.started = true;
                    self.depth += 1;
                }
                b'}' | b']' => match self.depth.checked_sub(1) {
                    Some(d) => self.depth = d,
                    None => self.broken = true,
                },
                b'"' => {
                    self.in_string = true;
                    // A bare top-level string is not an argument object; treat it as open.
                    if self.depth == 0 {
                        self.broken = true;
                    }
                }
                _ => {
                    if self.depth == 0 {
                        self.broken = true;
                    }
                }
            }
        }
    }

    fn complete(&self) -> bool {
        self.started && self.depth == 0 && !self.in_string && !self.broken
    }
}

/// What this translator keeps about a tool call's `tool_use` block.
#[derive(Debug, Default)]
struct Block {
    json: JsonProgress,
    index: Option<u32>,
    closed: bool,
}

/// Translates one streamed chat completion into Anthropic stream events.
///
/// Feed it every chunk with [`push_chunk`](Self::push_chunk) (or every SSE `data:` payload
/// with [`push_data`](Self::push_data), which also understands `[DONE]` and bad JSON), then
/// call [`finish`](Self::finish) at end of stream. Each call returns the events to send, in
/// order. Once the message is complete or has failed, further input is ignored.
#[derive(Debug)]
pub struct ChatStreamTranslator {
    opts: ResponseOptions,
    started: bool,
    done: bool,
    next_index: u32,
    prose: Option<(Prose, u32)>,
    tools: Vec<ToolSlot<Block>>,
    end: EndGate,
    matched_stop: Option<String>,
    output_bytes: usize,
    final_usage: Option<Usage>,
}

impl ChatStreamTranslator {
    pub fn new(opts: ResponseOptions) -> Self {
        Self {
            opts,
            started: false,
            done: false,
            next_index: 0,
            prose: None,
            tools: Vec::new(),
            end: EndGate::default(),
            matched_stop: None,
            output_bytes: 0,
            final_usage: None,
        }
    }

    /// Emits `message_start` now, before the first chunk (e.g. as soon as the upstream answered
    /// 200, so a slow prefill does not trip the client's idle watchdog). Idempotent. The
    /// message id is [`ResponseOptions::message_id`] or a fresh one.
    pub fn start(&mut self) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        if !self.started && !self.done {
            let id = self
                .opts
                .message_id
                .clone()
                .unwrap_or_else(fresh_message_id);
            self.emit_start(id, String::new(), &mut out);
        }
        out
    }

    /// Whether the message has been completed (`message_stop`) or failed (`error`).
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The usage reported in the final `message_delta`, once sent.
    pub fn final_usage(&self) -> Option<&Usage> {
        self.final_usage.as_ref()
    }

    /// Translates one SSE `data:` payload: `[DONE]` ends the stream, JSON is a chunk, anything
    /// else is an upstream failure reported as an `error` event.
    pub fn push_data(&mut self, data: &str) -> Vec<StreamEvent> {
        match read_data(data) {
            Data::Done => self.finish(),
            Data::Chunk(chunk) => self.push_chunk(*chunk),
            Data::Unreadable(message) => self.fail(ErrorType::ApiError, message),
        }
    }

    /// Translates one chunk.
    pub fn push_chunk(&mut self, chunk: ChatChunk) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        if let Some(error) = &chunk.error
            && !error.is_null()
        {
            self.done = true;
            out.push(stream_error_from_openai(error));
            return out;
        }
        let ChatChunk {
            id,
            model,
            choices,
            usage,
            ..
        } = chunk;
        if !self.started {
            let id = self
                .opts
                .message_id
                .clone()
                .unwrap_or_else(|| message_id_from(&id));
            self.emit_start(id, model, &mut out);
        }
        let mut finish = None;
        if let Some(choice) = choices.into_iter().find(|c| c.index == 0) {
            let matched = choice.matched_stop().map(str::to_owned);
            let mut delta = choice.delta;
            for (kind, text) in prose_pieces(&mut delta) {
                self.prose_delta(kind, text, &mut out);
            }
            for call in delta.tool_calls.unwrap_or_default() {
                if let Err(message) = self.tool_delta(call, &mut out) {
                    out.extend(self.fail(ErrorType::ApiError, message));
                    return out;
                }
            }
            if choice.finish_reason.is_some() && matched.is_some() {
                self.matched_stop = matched;
            }
            finish = choice.finish_reason;
        }
        if self.end.record(usage, finish) {
            self.emit_tail(&mut out);
        }
        out
    }

    /// Ends the stream (upstream EOF or `[DONE]`): completes the message if a finish reason
    /// arrived, otherwise reports an `error` event. Idempotent.
    pub fn finish(&mut self) -> Vec<StreamEvent> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        if !self.started {
            return self.fail(
                ErrorType::ApiError,
                "upstream ended the stream without sending a response".to_owned(),
            );
        }
        if self.end.finish.is_none() {
            return self.fail(
                ErrorType::ApiError,
                "upstream ended the stream before the response was complete".to_owned(),
            );
        }
        self.emit_tail(&mut out);
        out
    }

    fn fail(&mut self, kind: ErrorType, message: String) -> Vec<StreamEvent> {
        if self.done {
            return Vec::new();
        }
        self.done = true;
        vec![StreamEvent::error(kind, message)]
    }

    fn emit_start(&mut self, id: String, model: String, out: &mut Vec<StreamEvent>) {
        self.started = true;
        let mut message = MessagesResponse::new(id, self.opts.model.clone().unwrap_or(model));
        message.usage = Usage {
            input_tokens: self.opts.input_tokens_estimate,
            // Zeros rather than absent: Claude Code takes their presence to mean the backend
            // reports caching.
            cache_creation_input_tokens: Some(0),
            cache_read_input_tokens: Some(0),
            output_tokens: 0,
            extra: Extra::new(),
        };
        out.push(StreamEvent::MessageStart {
            message,
            extra: Extra::new(),
        });
    }

    fn open_block(&mut self, block: ContentBlock, out: &mut Vec<StreamEvent>) -> u32 {
        let index = self.next_index;
        self.next_index += 1;
        out.push(StreamEvent::ContentBlockStart {
            index,
            content_block: block,
            extra: Extra::new(),
        });
        index
    }

    fn close_prose(&mut self, out: &mut Vec<StreamEvent>) {
        if let Some((_, index)) = self.prose.take() {
            out.push(stop(index));
        }
    }

    /// Closes open tool blocks whose arguments are complete, except `keep`.
    fn close_complete_tools(&mut self, keep: Option<usize>, out: &mut Vec<StreamEvent>) {
        for (i, slot) in self.tools.iter_mut().enumerate() {
            if Some(i) == keep || slot.state.closed {
                continue;
            }
            if let Some(index) = slot.state.index
                && slot.state.json.complete()
            {
                slot.state.closed = true;
                out.push(stop(index));
            }
        }
    }

    fn prose_delta(&mut self, kind: Prose, text: String, out: &mut Vec<StreamEvent>) {
        if text.is_empty() {
            return;
        }
        self.output_bytes += text.len();
        let index = match self.prose {
            Some((open, index)) if open == kind => index,
            Some(_) | None => {
                self.close_prose(out);
                self.close_complete_tools(None, out);
                let block = match kind {
                    Prose::Thinking => ContentBlock::Thinking {
                        thinking: String::new(),
                        signature: Some(String::new()),
                        extra: Extra::new(),
                    },
                    Prose::Text => ContentBlock::text(""),
                };
                let index = self.open_block(block, out);
                self.prose = Some((kind, index));
                index
            }
        };
        let delta = match kind {
            Prose::Thinking => BlockDelta::ThinkingDelta {
                thinking: text,
                extra: Extra::new(),
            },
            Prose::Text => BlockDelta::TextDelta {
                text,
                extra: Extra::new(),
            },
        };
        out.push(StreamEvent::ContentBlockDelta {
            index,
            delta,
            extra: Extra::new(),
        });
    }

    fn tool_delta(
        &mut self,
        call: ToolCallDelta,
        out: &mut Vec<StreamEvent>,
    ) -> Result<(), String> {
        let (pos, args) = tool_piece(&mut self.tools, call);
        if !args.is_empty() {
            self.output_bytes += args.len();
            let slot = &mut self.tools[pos];
            if slot.state.closed {
                return Err(format!(
                    "upstream sent more arguments for tool call {} after they were complete",
                    slot.key
                ));
            }
            slot.state.json.feed(&args);
            match slot.state.index {
                Some(index) => out.push(json_delta(index, args)),
                None => slot.pending.push_str(&args),
            }
        }
        if self.tools[pos].state.index.is_none()
            && let Some(name) = self.tools[pos].name.clone()
        {
            self.close_prose(out);
            self.close_complete_tools(Some(pos), out);
            let slot = &self.tools[pos];
            let key = slot.key;
            let id = match &slot.id {
                Some(id) => sanitize_tool_id(id).into_owned(),
                None => format!("toolu_{}_{key}", sanitize_tool_id(self.message_id_hint())),
            };
            let block = ContentBlock::ToolUse {
                id,
                name: self.opts.tool_names.original(&name).to_owned(),
                input: Value::Object(Default::default()),
                extra: Extra::new(),
            };
            let index = self.open_block(block, out);
            let slot = &mut self.tools[pos];
            slot.state.index = Some(index);
            if !slot.pending.is_empty() {
                let pending = std::mem::take(&mut slot.pending);
                out.push(json_delta(index, pending));
            }
        }
        Ok(())
    }

    fn message_id_hint(&self) -> &str {
        self.opts.message_id.as_deref().unwrap_or("call")
    }

    fn emit_tail(&mut self, out: &mut Vec<StreamEvent>) {
        if let Some(slot) = self
            .tools
            .iter()
            .find(|s| s.state.index.is_none() && !s.is_empty())
        {
            let message = format!(
                "upstream sent tool call {} without a function name",
                slot.key
            );
            out.extend(self.fail(ErrorType::ApiError, message));
            return;
        }
        // Close whatever is still open, in index order.
        let mut open: Vec<u32> = self.prose.take().map(|(_, i)| i).into_iter().collect();
        for slot in &mut self.tools {
            if let (Some(index), false) = (slot.state.index, slot.state.closed) {
                slot.state.closed = true;
                open.push(index);
            }
        }
        open.sort_unstable();
        out.extend(open.into_iter().map(stop));

        let had_tool_calls = self.tools.iter().any(|s| s.state.index.is_some());
        let (stop_reason, stop_sequence) = final_stop(
            self.end.finish.as_ref(),
            had_tool_calls,
            self.matched_stop.as_deref(),
            &self.opts.stop_sequences,
        );
        let usage = match &self.end.usage {
            Some(u) => usage_from_chat(u),
            None => estimated_usage(self.opts.input_tokens_estimate, self.output_bytes),
        };
        out.push(StreamEvent::MessageDelta {
            delta: MessageDeltaBody {
                stop_reason: Some(stop_reason),
                stop_sequence,
                extra: Extra::new(),
            },
            usage: DeltaUsage {
                input_tokens: Some(usage.input_tokens),
                cache_creation_input_tokens: usage.cache_creation_input_tokens,
                cache_read_input_tokens: usage.cache_read_input_tokens,
                output_tokens: usage.output_tokens,
                extra: Extra::new(),
            },
            extra: Extra::new(),
        });
        out.push(StreamEvent::MessageStop {
            extra: Extra::new(),
        });
        self.final_usage = Some(usage);
        self.done = true;
    }
}

/// What one SSE `data:` payload of a chat stream holds.
pub(super) enum Data {
    /// `[DONE]`: the end of the stream.
    Done,
    Chunk(Box<ChatChunk>),
    /// Not a chunk: the message to report as the upstream's failure.
    Unreadable(String),
}

pub(super) fn read_data(data: &str) -> Data {
    let data = data.trim();
    if data == "[DONE]" {
        return Data::Done;
    }
    match serde_json::from_str::<ChatChunk>(data) {
        Ok(chunk) => Data::Chunk(Box::new(chunk)),
        Err(e) => Data::Unreadable(format!("upstream sent an unreadable stream chunk: {e}")),
    }
}

/// When a streamed response may end: once the finish reason is known and the usage arrived
/// with or after it (OpenAI sends usage in a `choices: []` chunk after the finish reason; vLLM's
/// `continuous_usage_stats` sends it on every chunk, so usage before the finish is not final).
#[derive(Debug, Default)]
pub(super) struct EndGate {
    pub(super) finish: Option<FinishReason>,
    pub(super) usage: Option<ChatUsage>,
    usage_after_finish: bool,
}

impl EndGate {
    /// Records a chunk's usage and its choice's finish reason; true once the response can end.
    pub(super) fn record(
        &mut self,
        usage: Option<ChatUsage>,
        finish: Option<FinishReason>,
    ) -> bool {
        let had_usage = usage.is_some();
        if usage.is_some() {
            self.usage = usage;
        }
        if finish.is_some() {
            self.finish = finish;
        }
        if had_usage && self.finish.is_some() {
            self.usage_after_finish = true;
        }
        self.finish.is_some() && self.usage_after_finish
    }
}

/// Takes the prose of a chunk delta, in the order it is shown: reasoning (from whichever field
/// the server uses), text parts, refusal (shown as text). Empty pieces are kept; callers skip
/// them.
pub(super) fn prose_pieces(delta: &mut ChunkDelta) -> Vec<(Prose, String)> {
    let mut out = Vec::new();
    if let Some(r) = delta.reasoning_content.take().or(delta.reasoning.take()) {
        out.push((Prose::Thinking, r));
    }
    match delta.content.take() {
        Some(ChatContent::Text(t)) => out.push((Prose::Text, t)),
        Some(ChatContent::List(parts)) => {
            for p in parts {
                match p {
                    ContentPart::Text { text, .. } => out.push((Prose::Text, text)),
                    ContentPart::ImageUrl { .. }
                    | ContentPart::File { .. }
                    | ContentPart::Other(_) => {}
                }
            }
        }
        None => {}
    }
    if let Some(r) = delta.refusal.take() {
        out.push((Prose::Text, r));
    }
    out
}

/// A tool call of the upstream being streamed, by its chunk `index`; `S` is what a translator
/// keeps about its own output for it (a block, an item).
#[derive(Debug, Default)]
pub(super) struct ToolSlot<S> {
    /// The upstream's `index` for this call.
    pub(super) key: u32,
    pub(super) id: Option<String>,
    pub(super) name: Option<String>,
    /// Arguments received before the call could be announced (its name was not known yet).
    pub(super) pending: String,
    pub(super) state: S,
}

impl<S> ToolSlot<S> {
    /// Nothing of this call has arrived but its index.
    pub(super) fn is_empty(&self) -> bool {
        self.id.is_none() && self.name.is_none() && self.pending.is_empty()
    }
}

/// Files a tool-call piece: finds its slot (by `index`, or, for servers that omit it, a new slot
/// when a new id appears and the latest slot otherwise), records the first non-empty id and
/// name, and returns the slot's position and the piece's arguments.
pub(super) fn tool_piece<S: Default>(
    tools: &mut Vec<ToolSlot<S>>,
    call: ToolCallDelta,
) -> (usize, String) {
    let key = match call.index {
        Some(key) => key,
        None => {
            let new_id = call.id.as_deref().filter(|s| !s.is_empty());
            match tools.last() {
                Some(last) if new_id.is_none() || new_id == last.id.as_deref() => last.key,
                Some(_) | None => tools.iter().map(|s| s.key + 1).max().unwrap_or(0),
            }
        }
    };
    let pos = match tools.iter().position(|s| s.key == key) {
        Some(pos) => pos,
        None => {
            tools.push(ToolSlot {
                key,
                id: None,
                name: None,
                pending: String::new(),
                state: S::default(),
            });
            tools.len() - 1
        }
    };
    let ToolCallDelta { id, function, .. } = call;
    let (name, arguments) = match function {
        Some(f) => (f.name, f.arguments),
        None => (None, None),
    };
    let slot = &mut tools[pos];
    if slot.id.is_none() {
        slot.id = id.filter(|s| !s.is_empty());
    }
    if slot.name.is_none() {
        slot.name = name.filter(|s| !s.is_empty());
    }
    (pos, arguments.unwrap_or_default())
}

fn stop(index: u32) -> StreamEvent {
    StreamEvent::ContentBlockStop {
        index,
        extra: Extra::new(),
    }
}

fn json_delta(index: u32, partial_json: String) -> StreamEvent {
    StreamEvent::ContentBlockDelta {
        index,
        delta: BlockDelta::InputJsonDelta {
            partial_json,
            extra: Extra::new(),
        },
        extra: Extra::new(),
    }
}

/// A message id for a stream started before the upstream named one: unique within the process
/// and unlikely to repeat across restarts.
fn fresh_message_id() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("msg_{nanos:x}{n:04x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_progress() {
        let complete = |s: &str| {
            let mut p = JsonProgress::default();
            p.feed(s);
            p.complete()
        };
        assert!(complete(r#"{"a": "}{", "b": [1, {"c": "\"}"}]}"#));
        assert!(complete("{}\n"));
        assert!(!complete(r#"{"a": 1"#));
        assert!(!complete(""));
        assert!(!complete(r#"{"a": "x\"}"#));
        assert!(!complete("{} {}"));
        assert!(!complete("}"));
    }
}
