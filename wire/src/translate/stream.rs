//! Streamed OpenAI chat completion chunks → Anthropic stream events, as a state machine fed one
//! chunk at a time: [`ChatStreamTranslator`], the shared chunk side ([`super::chunks`]) driving
//! [`ToAnthropic`].
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

use serde_json::Value;

use super::chunks::{
    EndGate, Failure, Head, Prose, Render, StreamTranslator, ToolSlot, tool_piece, unnamed_call,
};
use super::{
    ResponseOptions, estimated_usage, final_stop, fresh_id, message_id_from, sanitize_tool_id,
    usage_from_chat,
};
use crate::anthropic::{
    BlockDelta, ContentBlock, DeltaUsage, ErrorType, Extra, MessageDeltaBody, MessagesResponse,
    StreamEvent, Usage,
};
use crate::chat::{FinishReason, ToolCallDelta};
use crate::error::stream_error_from_openai;

/// Tracks whether a streamed JSON text is one complete value, without parsing it.
#[derive(Debug, Default, Clone, Copy)]
struct JsonProgress {
    depth: u32,
    /// Anything arrived, white space included.
    fed: bool,
    started: bool,
    in_string: bool,
    escaped: bool,
    /// Something other than whitespace followed the end of the value, or a bracket closed
    /// that was never opened: not a single valid value.
    broken: bool,
}

impl JsonProgress {
    fn feed(&mut self, s: &str) {
        self.fed |= !s.is_empty();
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

/// Translates one streamed chat completion into Anthropic stream events; see
/// [`StreamTranslator`] for how to feed it. [`start`](StreamTranslator::start) sends
/// `message_start` with [`ResponseOptions::message_id`] or a fresh id.
pub type ChatStreamTranslator = StreamTranslator<ToAnthropic>;

/// Anthropic stream events, as the module docs say.
#[derive(Debug, Default)]
pub struct ToAnthropic {
    opts: ResponseOptions,
    next_index: u32,
    prose: Option<(Prose, u32)>,
    tools: Vec<ToolSlot<Block>>,
}

impl From<ResponseOptions> for ToAnthropic {
    fn from(opts: ResponseOptions) -> Self {
        Self {
            opts,
            ..Self::default()
        }
    }
}

impl Render for ToAnthropic {
    type Event = StreamEvent;
    type Usage = Usage;
    const FAILS_INSIDE_OUTPUT: bool = false;

    fn begin(&mut self, head: Option<Head<'_>>, out: &mut Vec<StreamEvent>) {
        let given = self.opts.message_id.clone();
        let (id, model) = match head {
            Some(head) => (
                given.unwrap_or_else(|| message_id_from(head.id)),
                head.model,
            ),
            None => (given.unwrap_or_else(|| fresh_id("msg")), String::new()),
        };
        let mut message = MessagesResponse::new(id, self.opts.model.clone().unwrap_or(model));
        message.usage = Usage {
            input_tokens: self.opts.input_tokens_estimate,
            // Zeros rather than absent: Claude Code takes their presence to mean the backend
            // reports caching.
            cache_creation_input_tokens: Some(0),
            cache_read_input_tokens: Some(0),
            output_tokens: 0,
            // The real count comes with the upstream's last chunk, if at all.
            extra: crate::anthropic::estimate_mark(),
        };
        out.push(StreamEvent::MessageStart {
            message,
            extra: Extra::new(),
        });
    }

    fn prose(&mut self, kind: Prose, text: String, out: &mut Vec<StreamEvent>) {
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

    fn tool(&mut self, call: ToolCallDelta, out: &mut Vec<StreamEvent>) -> Result<(), String> {
        let (pos, args) = tool_piece(&mut self.tools, call);
        if !args.is_empty() {
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

    fn tail(&mut self, end: &EndGate, out: &mut Vec<StreamEvent>) -> Result<Usage, String> {
        unnamed_call(&self.tools, |block| block.index.is_some())?;
        // A tool call whose arguments stopped mid-value must not be closed as if whole (a client
        // would run it with half its arguments), unless the output was cut at `max_tokens`,
        // which Anthropic's own streams end the same way.
        if !matches!(end.finish, Some(FinishReason::Length))
            && let Some(slot) = self.tools.iter().find(|s| {
                // Arguments of white space only hold no value either: `"\n"` is as cut as
                // `{"a": `. Nothing at all is an empty input, as in Anthropic's own streams.
                let json = &s.state.json;
                s.state.index.is_some() && !s.state.closed && json.fed && !json.complete()
            })
        {
            return Err(format!(
                "upstream ended tool call {} with incomplete arguments",
                slot.key
            ));
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
            end.finish.as_ref(),
            had_tool_calls,
            end.matched_stop.as_deref(),
            &self.opts.stop_sequences,
        );
        let usage = match &end.usage {
            Some(u) => usage_from_chat(u),
            None => estimated_usage(self.opts.input_tokens_estimate, end.output_bytes),
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
                extra: usage.extra.clone(),
            },
            extra: Extra::new(),
        });
        out.push(StreamEvent::MessageStop {
            extra: Extra::new(),
        });
        Ok(usage)
    }

    fn fail(&mut self, why: Failure<'_>, out: &mut Vec<StreamEvent>) {
        out.push(match why {
            Failure::Upstream(error) => stream_error_from_openai(error),
            Failure::Broken(message) => StreamEvent::error(ErrorType::ApiError, message),
        });
    }
}

impl ToAnthropic {
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

    fn message_id_hint(&self) -> &str {
        self.opts.message_id.as_deref().unwrap_or("call")
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A chunk of choice 0 with `delta` and `finish`.
    fn chunk(delta: serde_json::Value, finish: Option<&str>) -> crate::chat::ChatChunk {
        let c = serde_json::json!({"id": "c1", "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        serde_json::from_value(c).unwrap_or_else(|e| panic!("{e}"))
    }

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

    /// Found by the `chat_stream_sse` fuzz target: an upstream that sent `tool_calls` as the
    /// finish reason while the call's arguments were cut mid-value got a closed `tool_use` block
    /// with half its arguments; now the stream ends in an error event, as a cut stream does.
    /// Cut at `max_tokens`, the block is closed as Anthropic's own streams do.
    #[test]
    fn a_tool_call_ended_mid_arguments_is_an_error_unless_cut_at_max_tokens() {
        let run = |finish: &str| {
            let mut t = ChatStreamTranslator::new(ResponseOptions::default());
            let mut events = t.push_chunk(chunk(
                serde_json::json!({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                    "function": {"name": "Write", "arguments": "{\"file_path\": \"/tmp/he"}}]}),
                None,
            ));
            events.extend(t.push_chunk(chunk(serde_json::json!({}), Some(finish))));
            events.extend(t.finish());
            events
        };
        let cut = run("tool_calls");
        assert!(
            matches!(cut.last(), Some(StreamEvent::Error { .. })),
            "{cut:#?}"
        );
        assert!(
            !cut.iter()
                .any(|e| matches!(e, StreamEvent::ContentBlockStop { index: 0, .. })),
            "the half tool call was closed: {cut:#?}"
        );
        let max = run("length");
        assert!(
            matches!(max.last(), Some(StreamEvent::MessageStop { .. })),
            "{max:#?}"
        );
    }

    /// Found by the `chat_stream_events` fuzz target: a tool call whose arguments were only
    /// white space (`"\n"`) was closed as if whole, so the client got a `tool_use` whose input
    /// does not parse; it is now an error, like arguments cut mid-value. No arguments at all
    /// still close as an empty input.
    #[test]
    fn a_tool_call_with_only_white_space_arguments_is_an_error() {
        let run = |args: &str| {
            let mut t = ChatStreamTranslator::new(ResponseOptions::default());
            let mut events = t.push_chunk(chunk(serde_json::json!({}), Some("")));
            events.extend(t.push_chunk(chunk(
                serde_json::json!({"tool_calls": [{"index": 97, "type": "function",
                    "function": {"name": "d", "arguments": args}}]}),
                None,
            )));
            events.extend(t.finish());
            events
        };
        let white = run("\n");
        assert!(
            matches!(white.last(), Some(StreamEvent::Error { .. })),
            "{white:#?}"
        );
        let empty = run("");
        assert!(
            matches!(empty.last(), Some(StreamEvent::MessageStop { .. })),
            "{empty:#?}"
        );
    }
}
