//! The chat-chunk side both stream translators share, as [`StreamTranslator`]: reading SSE
//! `data:` payloads, taking choice 0's prose and tool-call pieces, holding the end until both the
//! finish reason and the usage are known, and what an `error` chunk or an early end means. What
//! the output looks like is a [`Render`]'s: Anthropic events (`stream`), Responses events
//! (`responses_stream`).

use serde_json::Value;

use crate::chat::{
    ChatChunk, ChatContent, ChatUsage, ChunkDelta, ContentPart, FinishReason, ToolCallDelta,
};

/// An output format of a stream translation: how it starts, carries prose and tool calls, ends
/// and fails. [`StreamTranslator`] decides when each happens.
pub trait Render {
    type Event;
    /// The usage reported when the output ends.
    type Usage: std::fmt::Debug + Clone;
    /// Whether a failure is reported inside a started output (Responses: `response.created`,
    /// then `response.failed`) rather than on its own (Anthropic's bare `error` event).
    const FAILS_INSIDE_OUTPUT: bool;

    /// Starts the output: `head` is the first chunk's, or `None` when started before any chunk.
    fn begin(&mut self, head: Option<Head<'_>>, out: &mut Vec<Self::Event>);
    /// A chunk after the start named `model`.
    fn later_model(&mut self, _model: String) {}
    /// A non-empty piece of reasoning or text.
    fn prose(&mut self, kind: Prose, text: String, out: &mut Vec<Self::Event>);
    /// A tool-call piece; `Err` is why the stream must fail instead.
    fn tool(&mut self, call: ToolCallDelta, out: &mut Vec<Self::Event>) -> Result<(), String>;
    /// Ends the output as `end` says (its usage, or an estimate from its `output_bytes`); returns
    /// the usage reported, or why the stream must fail instead (nothing written then).
    fn tail(&mut self, end: &EndGate, out: &mut Vec<Self::Event>) -> Result<Self::Usage, String>;
    /// Reports the failure; nothing is written after it.
    fn fail(&mut self, why: Failure<'_>, out: &mut Vec<Self::Event>);
}

/// The fields of the first chunk an output starts from.
#[derive(Debug)]
pub struct Head<'a> {
    pub id: &'a str,
    pub model: String,
    /// The chunk's `created` (Unix seconds), if it sent one.
    pub created: Option<&'a Value>,
}

/// Why a stream fails.
#[derive(Debug)]
pub enum Failure<'a> {
    /// The upstream sent an `error` chunk: its error object.
    Upstream(&'a Value),
    /// The upstream broke the stream (ended early, sent an unreadable chunk or a tool call
    /// without a name): what to tell the client.
    Broken(String),
}

/// Translates one streamed chat completion into `R`'s events.
///
/// Feed it every chunk with [`push_chunk`](Self::push_chunk) (or every SSE `data:` payload
/// with [`push_data`](Self::push_data), which also understands `[DONE]` and bad JSON), then
/// call [`finish`](Self::finish) at end of stream. Each call returns the events to send, in
/// order. Once the output has completed or failed, further input is ignored.
#[derive(Debug)]
pub struct StreamTranslator<R: Render> {
    render: R,
    started: bool,
    done: bool,
    end: EndGate,
    final_usage: Option<R::Usage>,
}

impl<R: Render> StreamTranslator<R> {
    /// A translator answering with `opts` ([`super::ResponseOptions`] for Anthropic events,
    /// [`super::ResponsesOptions`] for Responses events).
    pub fn new(opts: impl Into<R>) -> Self {
        Self {
            render: opts.into(),
            started: false,
            done: false,
            end: EndGate::default(),
            final_usage: None,
        }
    }

    /// Starts the output now, before the first chunk (e.g. as soon as the upstream answered 200,
    /// so a slow prefill does not trip the client's idle timeout). Idempotent. The message or
    /// response id is the options' or a fresh one.
    pub fn start(&mut self) -> Vec<R::Event> {
        let mut out = Vec::new();
        if !self.started && !self.done {
            self.begin(None, &mut out);
        }
        out
    }

    /// Whether the output has completed or failed.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// The usage reported at the end of the output, once sent.
    pub fn final_usage(&self) -> Option<&R::Usage> {
        self.final_usage.as_ref()
    }

    /// Translates one SSE `data:` payload: `[DONE]` ends the stream, JSON is a chunk, anything
    /// else is an upstream failure.
    pub fn push_data(&mut self, data: &str) -> Vec<R::Event> {
        match read_data(data) {
            Data::Done => self.finish(),
            Data::Chunk(chunk) => self.push_chunk(*chunk),
            Data::Unreadable(message) => {
                let mut out = Vec::new();
                self.fail(Failure::Broken(message), &mut out);
                out
            }
        }
    }

    /// Translates one chunk.
    pub fn push_chunk(&mut self, chunk: ChatChunk) -> Vec<R::Event> {
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
        let error = error.filter(|e| !e.is_null());
        if self.started {
            self.render.later_model(model);
        } else if error.is_none() || R::FAILS_INSIDE_OUTPUT {
            let head = Head {
                id: &id,
                model,
                created: extra.get("created"),
            };
            self.begin(Some(head), &mut out);
        }
        if let Some(error) = &error {
            self.fail(Failure::Upstream(error), &mut out);
            return out;
        }
        let (mut finish, mut matched) = (None, None);
        if let Some(choice) = choices.into_iter().find(|c| c.index == 0) {
            matched = choice.matched_stop().map(str::to_owned);
            let mut delta = choice.delta;
            for (kind, text) in prose_pieces(&mut delta) {
                if !text.is_empty() {
                    self.end.output_bytes += text.len();
                    self.render.prose(kind, text, &mut out);
                }
            }
            for call in delta.tool_calls.unwrap_or_default() {
                let function = call.function.as_ref();
                self.end.output_bytes += function
                    .and_then(|f| f.arguments.as_ref())
                    .map_or(0, String::len);
                if let Err(message) = self.render.tool(call, &mut out) {
                    self.fail(Failure::Broken(message), &mut out);
                    return out;
                }
            }
            finish = choice.finish_reason;
        }
        if self.end.record(usage, finish, matched) {
            self.tail(&mut out);
        }
        out
    }

    /// Ends the stream (upstream EOF or `[DONE]`): completes the output if a finish reason
    /// arrived, otherwise reports a failure. Idempotent.
    pub fn finish(&mut self) -> Vec<R::Event> {
        let mut out = Vec::new();
        if self.done {
            return out;
        }
        if !self.started {
            let message = "upstream ended the stream without sending a response";
            self.fail(Failure::Broken(message.to_owned()), &mut out);
        } else if self.end.finish.is_none() {
            let message = "upstream ended the stream before the response was complete";
            self.fail(Failure::Broken(message.to_owned()), &mut out);
        } else {
            self.tail(&mut out);
        }
        out
    }

    fn begin(&mut self, head: Option<Head<'_>>, out: &mut Vec<R::Event>) {
        self.started = true;
        self.render.begin(head, out);
    }

    fn tail(&mut self, out: &mut Vec<R::Event>) {
        match self.render.tail(&self.end, out) {
            Ok(usage) => {
                self.final_usage = Some(usage);
                self.done = true;
            }
            Err(message) => self.fail(Failure::Broken(message), out),
        }
    }

    fn fail(&mut self, why: Failure<'_>, out: &mut Vec<R::Event>) {
        if self.done {
            return;
        }
        if !self.started && R::FAILS_INSIDE_OUTPUT {
            self.begin(None, out);
        }
        self.done = true;
        self.render.fail(why, out);
    }
}

/// What one SSE `data:` payload of a chat stream holds.
enum Data {
    /// `[DONE]`: the end of the stream.
    Done,
    Chunk(Box<ChatChunk>),
    /// Not a chunk: the message to report as the upstream's failure.
    Unreadable(String),
}

fn read_data(data: &str) -> Data {
    let data = data.trim();
    if data == "[DONE]" {
        return Data::Done;
    }
    match serde_json::from_str::<view::Chunk>(data) {
        Ok(chunk) => Data::Chunk(Box::new(chunk.into())),
        Err(e) => Data::Unreadable(format!("upstream sent an unreadable stream chunk: {e}")),
    }
}

/// A streamed chunk as the translator reads it: [`ChatChunk`]'s fields with the same rules,
/// but only the members a translation uses; the rest are skipped, not collected. `ChatChunk`
/// keeps every member in `#[serde(flatten)]` maps at four levels, and serde reads a flattened
/// struct by buffering all of it first: that was half of a streamed call's translation work.
mod view {
    use serde::Deserialize;
    use serde_json::Value;

    use crate::chat::{
        self, ChatContent, ChatUsage, ChunkChoice, ChunkDelta, Extra, FinishReason, FunctionDelta,
        ToolCallDelta,
    };

    #[derive(Deserialize)]
    pub(super) struct Chunk {
        #[serde(default)]
        id: String,
        #[serde(default)]
        model: String,
        #[serde(default)]
        choices: Vec<Choice>,
        usage: Option<ChatUsage>,
        error: Option<Value>,
        /// The one member of the chunk's extras a translation reads ([`super::Head::created`]).
        created: Option<Value>,
    }

    #[derive(Deserialize)]
    struct Choice {
        #[serde(default)]
        index: u32,
        #[serde(default)]
        delta: Delta,
        #[serde(default)]
        finish_reason: Option<FinishReason>,
        /// The members [`ChunkChoice::matched_stop`] reads.
        stop_reason: Option<Value>,
        matched_stop: Option<Value>,
    }

    #[derive(Deserialize, Default)]
    struct Delta {
        role: Option<String>,
        content: Option<ChatContent>,
        reasoning_content: Option<String>,
        reasoning: Option<String>,
        tool_calls: Option<Vec<ToolCall>>,
        refusal: Option<String>,
    }

    #[derive(Deserialize)]
    struct ToolCall {
        index: Option<u32>,
        id: Option<String>,
        #[serde(rename = "type", default)]
        kind: Option<String>,
        function: Option<Function>,
    }

    #[derive(Deserialize)]
    struct Function {
        name: Option<String>,
        arguments: Option<String>,
    }

    /// The extras holding `members` that were present (JSON `null` included, as a flattened
    /// map holds it).
    fn extra<const N: usize>(members: [(&str, Option<Value>); N]) -> Extra {
        let mut extra = Extra::new();
        for (key, value) in members {
            if let Some(v) = value {
                extra.insert(key.to_owned(), v);
            }
        }
        extra
    }

    impl From<Chunk> for chat::ChatChunk {
        fn from(c: Chunk) -> Self {
            chat::ChatChunk {
                id: c.id,
                model: c.model,
                choices: c.choices.into_iter().map(Into::into).collect(),
                usage: c.usage,
                error: c.error,
                extra: extra([("created", c.created)]),
            }
        }
    }

    impl From<Choice> for ChunkChoice {
        fn from(c: Choice) -> Self {
            let d = c.delta;
            ChunkChoice {
                index: c.index,
                delta: ChunkDelta {
                    role: d.role,
                    content: d.content,
                    reasoning_content: d.reasoning_content,
                    reasoning: d.reasoning,
                    tool_calls: d
                        .tool_calls
                        .map(|calls| calls.into_iter().map(Into::into).collect()),
                    refusal: d.refusal,
                    extra: Extra::new(),
                },
                finish_reason: c.finish_reason,
                extra: extra([
                    ("stop_reason", c.stop_reason),
                    ("matched_stop", c.matched_stop),
                ]),
            }
        }
    }

    impl From<ToolCall> for ToolCallDelta {
        fn from(t: ToolCall) -> Self {
            ToolCallDelta {
                index: t.index,
                id: t.id,
                kind: t.kind,
                function: t.function.map(|f| FunctionDelta {
                    name: f.name,
                    arguments: f.arguments,
                    extra: Extra::new(),
                }),
                extra: Extra::new(),
            }
        }
    }
}

/// When a streamed response may end: once the finish reason is known and the usage arrived
/// with or after it (OpenAI sends usage in a `choices: []` chunk after the finish reason; vLLM's
/// `continuous_usage_stats` sends it on every chunk, so usage before the finish is not final).
#[derive(Debug, Default)]
pub struct EndGate {
    pub finish: Option<FinishReason>,
    pub usage: Option<ChatUsage>,
    /// The stop string the server says ended generation, sent with the finish reason.
    pub matched_stop: Option<String>,
    /// Bytes of prose and tool arguments received: the output estimate when no usage comes.
    pub output_bytes: usize,
    usage_after_finish: bool,
}

impl EndGate {
    /// Records a chunk's usage and its choice's finish reason and matched stop string; true once
    /// the response can end.
    fn record(
        &mut self,
        usage: Option<ChatUsage>,
        finish: Option<FinishReason>,
        matched_stop: Option<String>,
    ) -> bool {
        let had_usage = usage.is_some();
        if usage.is_some() {
            self.usage = usage;
        }
        if finish.is_some() {
            self.finish = finish;
            if matched_stop.is_some() {
                self.matched_stop = matched_stop;
            }
        }
        if had_usage && self.finish.is_some() {
            self.usage_after_finish = true;
        }
        self.finish.is_some() && self.usage_after_finish
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Prose {
    Thinking,
    Text,
}

/// Takes the prose of a chunk delta, in the order it is shown: reasoning (from whichever field
/// the server uses), text parts, refusal (shown as text). Empty pieces are kept; the caller
/// skips them.
fn prose_pieces(delta: &mut ChunkDelta) -> Vec<(Prose, String)> {
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

/// A tool call of the upstream being streamed, by its chunk `index`; `S` is what a renderer
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
    fn is_empty(&self) -> bool {
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

/// At the end of a response, a tool call that sent something but never its name: it could not
/// be announced, and dropping it would hide that the model called a tool. `announced` says
/// whether a call's output was opened.
pub(super) fn unnamed_call<S>(
    tools: &[ToolSlot<S>],
    announced: impl Fn(&S) -> bool,
) -> Result<(), String> {
    match tools.iter().find(|s| !announced(&s.state) && !s.is_empty()) {
        Some(slot) => Err(format!(
            "upstream sent tool call {} without a function name",
            slot.key
        )),
        None => Ok(()),
    }
}
