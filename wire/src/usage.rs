//! Metering Anthropic responses as they flow through the gateway, streamed or not, without
//! holding the stream and without re-serializing a byte of it.
//!
//! Semantics (the metering pitfalls the gateway research lists):
//! - `message_start.message.usage` gives input, cache read and cache creation (and a small
//!   output count).
//! - every `message_delta.usage` is *cumulative* for the message: its `output_tokens` replaces
//!   the previous value, never adds to it; input and cache counts present in a `message_delta`
//!   replace those of `message_start` (Ollama puts a length/4 estimate in `message_start` and
//!   the real count in `message_delta`; newer API versions repeat the counts there).
//! - a non-streamed body carries the final usage in its `usage` object.
//!
//! Only `message_start`, `message_delta`, `message_stop`, `error` and `content_block_delta`
//! events are parsed, each into a minimal struct that skips everything else (of a delta, only
//! the length of the text it carries), so the meter's cost per byte is the SSE scan.
//!
//! The same meter reads OpenAI chat completions ([`Dialect::Chat`], [`UsageMeter::chat`]): a
//! body's `usage`, or in a stream the chunk carrying `usage` (the last one, when the request
//! asked for `stream_options.include_usage`), converted to Anthropic's convention
//! (`input_tokens = prompt_tokens - cached`, `cache_read_input_tokens = cached`); the stream is
//! complete at `data: [DONE]`, and every chunk with choices counts as a delta for
//! [`MeterReport::billable_usage`] (the text it carries: content, reasoning, refusal, tool
//! names and arguments; never its envelope, which is longer than the text of a one-token
//! chunk).

use serde::{Deserialize, Serialize};

use crate::anthropic::{DeltaUsage, ErrorDetail, StopReason, Usage, is_estimate};
use crate::chat::ChatUsage;
use crate::sse::{self, EventRef};

/// Token counts in Anthropic's convention: `input_tokens` excludes both cache counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct MeteredUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_input_tokens: u64,
    pub cache_creation_input_tokens: u64,
    /// Of `cache_creation_input_tokens`, those written for an hour (`cache_control.ttl =
    /// "1h"`, reported in `usage.cache_creation.ephemeral_1h_input_tokens`): priced higher.
    pub cache_creation_1h_input_tokens: u64,
}

/// `usage.cache_creation.ephemeral_1h_input_tokens`, if the usage has it.
fn one_hour_writes(extra: &crate::anthropic::Extra) -> Option<u64> {
    extra
        .get("cache_creation")?
        .get("ephemeral_1h_input_tokens")?
        .as_u64()
}

impl MeteredUsage {
    /// Everything the request consumed: input + output + cache read + cache creation (the
    /// gateway's token budget unit).
    pub fn total(&self) -> u64 {
        self.input_tokens
            .saturating_add(self.output_tokens)
            .saturating_add(self.cache_read_input_tokens)
            .saturating_add(self.cache_creation_input_tokens)
    }

    /// All input, cached or not (what Claude Code counts as the context size).
    pub fn total_input(&self) -> u64 {
        self.input_tokens
            .saturating_add(self.cache_read_input_tokens)
            .saturating_add(self.cache_creation_input_tokens)
    }

    fn apply_start(&mut self, u: &Usage) {
        self.input_tokens = u.input_tokens;
        self.output_tokens = u.output_tokens;
        self.cache_read_input_tokens = u.cache_read_input_tokens.unwrap_or(0);
        self.cache_creation_input_tokens = u.cache_creation_input_tokens.unwrap_or(0);
        self.cache_creation_1h_input_tokens = one_hour_writes(&u.extra)
            .unwrap_or(0)
            .min(self.cache_creation_input_tokens);
    }

    fn apply_delta(&mut self, u: &DeltaUsage) {
        self.output_tokens = u.output_tokens;
        if let Some(n) = u.input_tokens {
            self.input_tokens = n;
        }
        if let Some(n) = u.cache_read_input_tokens {
            self.cache_read_input_tokens = n;
        }
        if let Some(n) = u.cache_creation_input_tokens {
            self.cache_creation_input_tokens = n;
        }
        if let Some(n) = one_hour_writes(&u.extra) {
            self.cache_creation_1h_input_tokens = n;
        }
        self.cache_creation_1h_input_tokens = self
            .cache_creation_1h_input_tokens
            .min(self.cache_creation_input_tokens);
    }
}

impl From<&Usage> for MeteredUsage {
    fn from(u: &Usage) -> Self {
        let mut m = MeteredUsage::default();
        m.apply_start(u);
        m
    }
}

/// What a finished (or abandoned) response told the meter.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MeterReport {
    pub usage: MeteredUsage,
    /// A `message_start` (stream) or a message body with `usage` (JSON) was seen, and the last
    /// usage read was the provider's, not a translator's estimate
    /// ([`crate::anthropic::ESTIMATE_MARK`]).
    pub saw_usage: bool,
    /// The response completed: `message_stop` was seen, or a JSON message body parsed.
    /// `false` means the usage may be short (client disconnect, upstream cut): settle with an
    /// estimate if that matters.
    pub complete: bool,
    pub stop_reason: Option<StopReason>,
    /// An `error` event, or an error body.
    pub error: Option<ErrorDetail>,
    /// Events (or the body) whose JSON did not parse, or a stream that broke the SSE size
    /// bound; their usage, if any, is missing.
    pub malformed: u32,
    /// `content_block_delta` events (chat: chunks with choices) seen, and the bytes of the
    /// text they carried (text, tool input, thinking; chat: content, reasoning, refusal, tool
    /// names and arguments): what was generated before a stream was cut, for
    /// [`MeterReport::billable_usage`]. A delta that does not parse counts whole.
    pub delta_events: u32,
    pub delta_text_bytes: u64,
    /// The body was one JSON document, not a stream: the upstream generated all of it before
    /// its head, so one cut short was billed whole upstream, whatever the meter saw of it.
    pub whole_body: bool,
}

impl MeterReport {
    /// The usage to bill. A complete response is billed as reported. An incomplete stream
    /// (client gone, upstream cut) never delivered its final `message_delta`, and a complete
    /// one that never reported usage (a chat stream without its usage chunk) told nothing, so
    /// their output count is at least an estimate from the deltas that were forwarded: the
    /// generated text at 3 bytes a token, which errs high.
    pub fn billable_usage(&self) -> MeteredUsage {
        let mut u = self.usage;
        if !self.complete || !self.saw_usage {
            u.output_tokens = u.output_tokens.max(self.delta_text_bytes.div_ceil(3));
        }
        u
    }
}

/// What the meter is reading.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// `text/event-stream`.
    EventStream,
    /// `application/json` (a message or an error body).
    Json,
}

impl BodyKind {
    /// Picks the kind from a `Content-Type` header value: event streams by media type,
    /// everything else as JSON.
    pub fn from_content_type(content_type: &str) -> Self {
        let media = content_type
            .split(';')
            .next()
            .unwrap_or("")
            .trim()
            .to_ascii_lowercase();
        if media == "text/event-stream" {
            BodyKind::EventStream
        } else {
            BodyKind::Json
        }
    }
}

/// Which protocol's answers a meter reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    /// Anthropic Messages.
    Anthropic,
    /// OpenAI chat completions.
    Chat,
}

/// Reads an Anthropic (or, with [`Dialect::Chat`], an OpenAI chat) response body chunk by chunk and keeps its usage up to date.
///
/// For an event stream nothing is buffered beyond the current SSE line and event. A JSON body
/// has to be parsed whole, so it is copied up to [`UsageMeter::MAX_JSON_BYTES`] and parsed by
/// [`UsageMeter::finish`]; [`usage_from_json`] does the same for a body already in memory.
#[derive(Debug)]
pub struct UsageMeter {
    kind: BodyKind,
    dialect: Dialect,
    decoder: sse::Decoder,
    json: Vec<u8>,
    /// Metering gave up on this body (size bound); the report stands as it was.
    stopped: bool,
    report: MeterReport,
}

#[derive(Deserialize)]
struct StartEvent {
    message: StartMessage,
}

#[derive(Deserialize)]
struct StartMessage {
    #[serde(default)]
    usage: Usage,
}

#[derive(Deserialize)]
struct DeltaEvent {
    #[serde(default)]
    delta: DeltaBody,
    #[serde(default)]
    usage: Option<DeltaUsage>,
}

#[derive(Deserialize, Default)]
struct DeltaBody {
    #[serde(default)]
    stop_reason: Option<StopReason>,
}

#[derive(Deserialize)]
struct ErrorEvent {
    error: ErrorDetail,
}

#[derive(Deserialize)]
struct JsonBody {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    usage: Option<Usage>,
    #[serde(default)]
    stop_reason: Option<StopReason>,
    #[serde(default)]
    error: Option<ErrorDetail>,
}

impl UsageMeter {
    /// Bound on the copy of a JSON body (Anthropic's own request limit is 32 MB; responses are
    /// far smaller).
    pub const MAX_JSON_BYTES: usize = 32 << 20;

    pub fn new(kind: BodyKind) -> Self {
        Self::with_dialect(kind, Dialect::Anthropic)
    }

    /// A meter for an OpenAI chat completions body of `kind`.
    pub fn chat(kind: BodyKind) -> Self {
        Self::with_dialect(kind, Dialect::Chat)
    }

    /// A meter for a body of `kind` in `dialect`.
    pub fn with_dialect(kind: BodyKind, dialect: Dialect) -> Self {
        Self {
            kind,
            dialect,
            decoder: sse::Decoder::new(),
            json: Vec::new(),
            stopped: false,
            report: MeterReport::default(),
        }
    }

    /// A meter for an event stream.
    pub fn event_stream() -> Self {
        Self::new(BodyKind::EventStream)
    }

    /// A meter for a JSON body.
    pub fn json() -> Self {
        Self::new(BodyKind::Json)
    }

    /// Reads the next chunk of the body, exactly as it is forwarded.
    pub fn feed(&mut self, chunk: &[u8]) {
        if self.stopped {
            return;
        }
        match self.kind {
            BodyKind::EventStream => {
                let report = &mut self.report;
                let dialect = self.dialect;
                if self
                    .decoder
                    .feed_with(chunk, |e| match dialect {
                        Dialect::Anthropic => on_event(report, e),
                        Dialect::Chat => on_chat_event(report, e.data),
                    })
                    .is_err()
                {
                    // Stop metering this stream rather than buffer without bound; what was
                    // metered so far stands.
                    report.malformed += 1;
                    self.stopped = true;
                }
            }
            BodyKind::Json => {
                if self.json.len() + chunk.len() > Self::MAX_JSON_BYTES {
                    self.stopped = true;
                    self.json = Vec::new();
                    self.report.malformed += 1;
                    return;
                }
                self.json.extend_from_slice(chunk);
            }
        }
    }

    /// The usage seen so far (for an event stream, live; for JSON, zero until
    /// [`UsageMeter::finish`]).
    pub fn usage(&self) -> MeteredUsage {
        self.report.usage
    }

    /// Everything seen so far, without ending the meter.
    pub fn report(&self) -> &MeterReport {
        &self.report
    }

    /// Ends the body (completely or not) and returns the report.
    pub fn finish(mut self) -> MeterReport {
        if self.kind == BodyKind::Json {
            if !self.stopped {
                self.report = match self.dialect {
                    Dialect::Anthropic => usage_from_json(&self.json),
                    Dialect::Chat => chat_usage_from_json(&self.json),
                };
            }
            self.report.whole_body = true;
        }
        self.report
    }

    /// Whether the meter gave up on this body (a JSON body past [`Self::MAX_JSON_BYTES`], an
    /// event past the SSE bound): nothing more it reads changes its report.
    pub fn is_stopped(&self) -> bool {
        self.stopped
    }
}

fn on_event(report: &mut MeterReport, e: EventRef<'_>) {
    // Anthropic names every event; a frame without a name is classified by its JSON `type`
    // so a data-only upstream is still metered.
    let name = if e.event.is_empty() || e.event == "message" {
        sniff_type(e.data)
    } else {
        e.event
    };
    match name {
        "message_start" => match serde_json::from_str::<StartEvent>(e.data) {
            Ok(ev) => {
                report.usage.apply_start(&ev.message.usage);
                // A translator's guess before the real count is not the provider's word.
                report.saw_usage |= !is_estimate(&ev.message.usage.extra);
            }
            Err(_) => report.malformed += 1,
        },
        "message_delta" => match serde_json::from_str::<DeltaEvent>(e.data) {
            Ok(ev) => {
                if let Some(u) = &ev.usage {
                    report.usage.apply_delta(u);
                    report.saw_usage = !is_estimate(&u.extra);
                }
                if ev.delta.stop_reason.is_some() {
                    report.stop_reason = ev.delta.stop_reason;
                }
            }
            Err(_) => report.malformed += 1,
        },
        "message_stop" => report.complete = true,
        "content_block_delta" => {
            let text = serde_json::from_str::<BlockDeltaEvent>(e.data)
                .map_or(e.data.len() as u64, |ev| ev.delta.text_bytes());
            report.delta_events = report.delta_events.saturating_add(1);
            report.delta_text_bytes = report.delta_text_bytes.saturating_add(text);
        }
        "error" => match serde_json::from_str::<ErrorEvent>(e.data) {
            Ok(ev) => report.error = Some(ev.error),
            Err(_) => report.malformed += 1,
        },
        _ => {}
    }
}

/// The length in bytes of a JSON string, read without keeping it; any other value (`null`, an
/// array of parts some servers send) counts 0, so an odd delta never makes a chunk that carries
/// usage unreadable.
#[derive(Debug, Default, Clone, Copy)]
struct TextLen(u64);

impl<'de> Deserialize<'de> for TextLen {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Len;
        impl<'de> serde::de::Visitor<'de> for Len {
            type Value = TextLen;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("any JSON value")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<TextLen, E> {
                Ok(TextLen(v.len() as u64))
            }
            fn visit_bool<E>(self, _: bool) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_i64<E>(self, _: i64) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_u64<E>(self, _: u64) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_f64<E>(self, _: f64) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_unit<E>(self) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_none<E>(self) -> Result<TextLen, E> {
                Ok(TextLen(0))
            }
            fn visit_some<D: serde::Deserializer<'de>>(self, d: D) -> Result<TextLen, D::Error> {
                d.deserialize_any(self)
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<TextLen, A::Error> {
                while a.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(TextLen(0))
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<TextLen, A::Error> {
                while a
                    .next_entry::<serde::de::IgnoredAny, serde::de::IgnoredAny>()?
                    .is_some()
                {}
                Ok(TextLen(0))
            }
        }
        d.deserialize_any(Len)
    }
}

/// A `content_block_delta` event: only the length of the text it carries.
#[derive(Deserialize)]
struct BlockDeltaEvent {
    #[serde(default)]
    delta: BlockDelta,
}

#[derive(Deserialize, Default)]
struct BlockDelta {
    #[serde(default)]
    text: TextLen,
    #[serde(default)]
    partial_json: TextLen,
    #[serde(default)]
    thinking: TextLen,
}

impl BlockDelta {
    /// The generated text's bytes (a signature is not generated text).
    fn text_bytes(&self) -> u64 {
        self.text
            .0
            .saturating_add(self.partial_json.0)
            .saturating_add(self.thinking.0)
    }
}

/// A chat chunk or answer: only what the meter reads.
#[derive(Deserialize)]
struct ChatView {
    #[serde(default)]
    usage: Option<ChatUsage>,
    #[serde(default)]
    choices: Option<Vec<ChoiceView>>,
    #[serde(default)]
    error: Option<serde::de::IgnoredAny>,
}

/// A chunk's choice: only the length of what its delta generated (an answer's `message` is
/// skipped: a whole answer carries its usage).
#[derive(Deserialize)]
struct ChoiceView {
    #[serde(default)]
    delta: Option<ChatDeltaView>,
}

#[derive(Deserialize, Default)]
struct ChatDeltaView {
    #[serde(default)]
    content: TextLen,
    #[serde(default)]
    reasoning_content: TextLen,
    #[serde(default)]
    reasoning: TextLen,
    #[serde(default)]
    refusal: TextLen,
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallView>>,
}

#[derive(Deserialize)]
struct ToolCallView {
    #[serde(default)]
    function: Option<FunctionView>,
}

#[derive(Deserialize)]
struct FunctionView {
    #[serde(default)]
    name: TextLen,
    #[serde(default)]
    arguments: TextLen,
}

impl ChoiceView {
    fn text_bytes(&self) -> u64 {
        let Some(d) = &self.delta else { return 0 };
        let calls = d
            .tool_calls
            .iter()
            .flatten()
            .filter_map(|c| c.function.as_ref());
        calls.fold(
            d.content
                .0
                .saturating_add(d.reasoning_content.0)
                .saturating_add(d.reasoning.0)
                .saturating_add(d.refusal.0),
            |sum, f| sum.saturating_add(f.name.0).saturating_add(f.arguments.0),
        )
    }
}

impl From<&ChatUsage> for MeteredUsage {
    fn from(u: &ChatUsage) -> Self {
        let cached = u.cached_tokens();
        MeteredUsage {
            input_tokens: u.prompt_tokens.saturating_sub(cached),
            output_tokens: u.completion_tokens,
            cache_read_input_tokens: cached,
            cache_creation_input_tokens: 0,
            cache_creation_1h_input_tokens: 0,
        }
    }
}

fn on_chat_event(report: &mut MeterReport, data: &str) {
    let data = data.trim();
    if data == "[DONE]" {
        report.complete = true;
        return;
    }
    if data.is_empty() {
        return;
    }
    match serde_json::from_str::<ChatView>(data) {
        Ok(chunk) => {
            if let Some(u) = &chunk.usage {
                // Usage in a chunk is the whole answer's so far: it replaces, never adds.
                report.usage = MeteredUsage::from(u);
                report.saw_usage = true;
            }
            if let Some(choices) = chunk.choices.as_ref().filter(|c| !c.is_empty()) {
                let text = choices.iter().map(ChoiceView::text_bytes).sum::<u64>();
                report.delta_events = report.delta_events.saturating_add(1);
                report.delta_text_bytes = report.delta_text_bytes.saturating_add(text);
            }
            if chunk.error.is_some() {
                report.error = Some(ErrorDetail::new(
                    crate::anthropic::ErrorType::ApiError,
                    "the upstream reported an error mid-stream",
                ));
            }
        }
        Err(_) => report.malformed += 1,
    }
}

/// Meters a whole non-streamed chat completion (its `usage`); complete when it has one.
pub fn chat_usage_from_json(body: &[u8]) -> MeterReport {
    let mut report = MeterReport {
        whole_body: true,
        ..MeterReport::default()
    };
    match serde_json::from_slice::<ChatView>(body) {
        Ok(parsed) => {
            if let Some(u) = &parsed.usage {
                report.usage = MeteredUsage::from(u);
                report.saw_usage = true;
                report.complete = true;
            }
            if parsed.error.is_some() {
                report.error = Some(ErrorDetail::new(
                    crate::anthropic::ErrorType::ApiError,
                    "the upstream answered with an error",
                ));
                report.complete = true;
            }
        }
        Err(_) => report.malformed += 1,
    }
    report
}

/// The `type` of a data-only frame, read without parsing the JSON when `type` is its first key
/// (as Anthropic and every compatible server write it).
fn sniff_type(data: &str) -> &'static str {
    const NAMES: [&str; 5] = [
        "message_start",
        "message_delta",
        "message_stop",
        "error",
        "content_block_delta",
    ];
    let first_key_value = data
        .trim_start()
        .strip_prefix('{')
        .map(str::trim_start)
        .and_then(|s| s.strip_prefix("\"type\""))
        .map(str::trim_start)
        .and_then(|s| s.strip_prefix(':'))
        .map(str::trim_start)
        .and_then(|s| s.strip_prefix('"'));
    let kind: Option<std::borrow::Cow<'_, str>> = match first_key_value {
        Some(rest) => rest.split('"').next().map(std::borrow::Cow::Borrowed),
        None => {
            #[derive(Deserialize)]
            struct Typed {
                #[serde(rename = "type")]
                kind: Option<String>,
            }
            serde_json::from_str::<Typed>(data)
                .ok()
                .and_then(|t| t.kind)
                .map(std::borrow::Cow::Owned)
        }
    };
    kind.and_then(|k| NAMES.into_iter().find(|n| *n == k))
        .unwrap_or("")
}

/// Meters a whole non-streamed body: a message (its `usage`) or an error body (no usage).
pub fn usage_from_json(body: &[u8]) -> MeterReport {
    let mut report = MeterReport {
        whole_body: true,
        ..MeterReport::default()
    };
    match serde_json::from_slice::<JsonBody>(body) {
        Ok(parsed) if parsed.kind.as_deref() == Some("error") => {
            report.error = parsed.error;
            report.complete = true;
        }
        Ok(parsed) => {
            if let Some(u) = &parsed.usage {
                report.usage = MeteredUsage::from(u);
                report.saw_usage = !is_estimate(&u.extra);
            }
            report.stop_reason = parsed.stop_reason;
            report.complete = parsed.usage.is_some();
        }
        Err(_) => report.malformed += 1,
    }
    report
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"x\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":10,\"cache_creation_input_tokens\":3,\"cache_read_input_tokens\":100,\"output_tokens\":1}}}\n\nevent: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\nevent: ping\ndata: {\"type\": \"ping\"}\n\nevent: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hi\"}}\n\nevent: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":7}}\n\nevent: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":9}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n";

    #[test]
    fn stream_usage_is_cumulative_not_summed() {
        let mut m = UsageMeter::event_stream();
        m.feed(STREAM.as_bytes());
        let r = m.finish();
        assert_eq!(
            r.usage,
            MeteredUsage {
                input_tokens: 10,
                output_tokens: 9,
                cache_read_input_tokens: 100,
                cache_creation_input_tokens: 3,
                cache_creation_1h_input_tokens: 0,
            }
        );
        assert_eq!(r.usage.total(), 122);
        assert!(r.complete && r.saw_usage);
        assert_eq!(r.stop_reason, Some(StopReason::EndTurn));
    }

    #[test]
    fn hour_long_cache_writes_are_metered_apart() {
        let start = "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":5,\"cache_creation_input_tokens\":300,\"cache_creation\":{\"ephemeral_5m_input_tokens\":100,\"ephemeral_1h_input_tokens\":200},\"output_tokens\":1}}}\n\n";
        let mut m = UsageMeter::event_stream();
        m.feed(start.as_bytes());
        let u = m.finish().usage;
        assert_eq!(
            (
                u.cache_creation_input_tokens,
                u.cache_creation_1h_input_tokens
            ),
            (300, 200)
        );
        let whole = br#"{"type":"message","usage":{"input_tokens":5,"cache_creation_input_tokens":50,"cache_creation":{"ephemeral_1h_input_tokens":80},"output_tokens":1}}"#;
        let u = usage_from_json(whole).usage;
        // Never more hour-long writes than writes.
        assert_eq!(
            (
                u.cache_creation_input_tokens,
                u.cache_creation_1h_input_tokens
            ),
            (50, 50)
        );
    }

    #[test]
    fn data_only_frames_are_still_metered() {
        let stripped: String = STREAM
            .lines()
            .filter(|l| !l.starts_with("event:"))
            .map(|l| format!("{l}\n"))
            .collect();
        let mut m = UsageMeter::event_stream();
        m.feed(stripped.as_bytes());
        let r = m.finish();
        assert_eq!(r.usage.output_tokens, 9);
        assert_eq!(r.usage.input_tokens, 10);
        assert!(r.complete);
    }

    #[test]
    fn json_body_and_error_body() {
        let mut m = UsageMeter::json();
        let body = br#"{"id":"m","type":"message","role":"assistant","content":[],"model":"x","stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":5,"output_tokens":2,"cache_read_input_tokens":1}}"#;
        m.feed(&body[..10]);
        m.feed(&body[10..]);
        let r = m.finish();
        assert_eq!(r.usage.total(), 8);
        assert!(r.complete);
        let e = usage_from_json(
            br#"{"type":"error","error":{"type":"overloaded_error","message":"busy"}}"#,
        );
        assert_eq!(e.usage.total(), 0);
        assert!(e.error.is_some());
    }

    #[test]
    fn content_type_picks_the_kind() {
        assert_eq!(
            BodyKind::from_content_type("text/event-stream; charset=utf-8"),
            BodyKind::EventStream
        );
        assert_eq!(
            BodyKind::from_content_type("application/json"),
            BodyKind::Json
        );
    }
}

#[cfg(test)]
mod billable_tests {
    use super::*;

    const CHAT_STREAM: &str = "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hi\"},\"finish_reason\":null}]}\n\ndata: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"choices\":[],\"usage\":{\"prompt_tokens\":100,\"completion_tokens\":7,\"total_tokens\":107,\"prompt_tokens_details\":{\"cached_tokens\":40}}}\n\ndata: [DONE]\n\n";

    #[test]
    fn chat_stream_is_metered_from_its_usage_chunk() {
        let mut m = UsageMeter::chat(BodyKind::EventStream);
        // Split mid-frame: the decoder joins the pieces.
        let (a, b) = CHAT_STREAM.split_at(57);
        m.feed(a.as_bytes());
        m.feed(b.as_bytes());
        let r = m.finish();
        assert!(r.complete && r.saw_usage);
        assert_eq!(
            r.billable_usage(),
            MeteredUsage {
                input_tokens: 60,
                output_tokens: 7,
                cache_read_input_tokens: 40,
                cache_creation_input_tokens: 0,
                cache_creation_1h_input_tokens: 0,
            }
        );
        assert_eq!(r.usage.total(), 107);
    }

    #[test]
    fn cut_chat_stream_bills_at_least_its_deltas() {
        let mut m = UsageMeter::chat(BodyKind::EventStream);
        let text = "y".repeat(700);
        let chunk = format!(
            "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\n"
        );
        m.feed(chunk.as_bytes());
        let r = m.finish();
        assert!(!r.complete && !r.saw_usage);
        assert!(r.billable_usage().output_tokens >= 200, "{r:?}");
    }

    #[test]
    fn chat_json_body_is_metered() {
        let mut m = UsageMeter::chat(BodyKind::Json);
        m.feed(br#"{"id":"c","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"stop"}],"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15}}"#);
        let r = m.finish();
        assert!(r.complete);
        assert_eq!(r.usage.total(), 15);
        assert_eq!(r.usage.input_tokens, 12);
        let none = chat_usage_from_json(br#"{"choices":[]}"#);
        assert!(!none.complete && !none.saw_usage);
    }

    #[test]
    fn cut_stream_bills_at_least_the_forwarded_deltas() {
        let mut m = UsageMeter::event_stream();
        m.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"x\",\"content\":[],\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n");
        let text = "x".repeat(300);
        let delta = format!(
            "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"{text}\"}}}}\n\n"
        );
        m.feed(delta.as_bytes());
        let r = m.finish();
        assert!(!r.complete);
        assert_eq!(r.delta_events, 1);
        let billed = r.billable_usage();
        assert_eq!(billed.input_tokens, 10);
        assert!(billed.output_tokens >= 100, "{billed:?}");
    }

    /// A cut stream of one-token chunks bills about a token a chunk: the text, never the
    /// chunks' envelopes (which made a chat chunk with an id and a model name bill 40 to 70).
    #[test]
    fn cut_streams_bill_the_text_not_the_envelopes() {
        let mut chat = UsageMeter::chat(BodyKind::EventStream);
        let mut anthropic = UsageMeter::event_stream();
        for _ in 0..50 {
            chat.feed(b"data: {\"id\":\"chatcmpl-9f8e7d6c5b4a39281706\",\"object\":\"chat.completion.chunk\",\"created\":1733000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"system_fingerprint\":\"fp_0123456789\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ab\"},\"logprobs\":null,\"finish_reason\":null}]}\n\n");
            anthropic.feed(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"ab\"}}\n\n");
        }
        for r in [chat.finish(), anthropic.finish()] {
            assert!(!r.complete);
            assert_eq!((r.delta_events, r.delta_text_bytes), (50, 100), "{r:?}");
            assert_eq!(r.billable_usage().output_tokens, 34);
        }
    }

    /// Every kind of generated text counts, unescaped; a signature does not; an odd `content`
    /// (a list of parts) neither breaks the chunk nor hides the usage beside it.
    #[test]
    fn deltas_count_every_kind_of_text() {
        let mut m = UsageMeter::event_stream();
        for delta in [
            r#"{"type":"text_delta","text":"a\"b"}"#,
            r#"{"type":"input_json_delta","partial_json":"{\"k\": 1}"}"#,
            r#"{"type":"thinking_delta","thinking":"hmm"}"#,
            r#"{"type":"signature_delta","signature":"c2lnbmF0dXJlc2lnbmF0dXJl"}"#,
        ] {
            m.feed(
                format!("event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{delta}}}\n\n")
                    .as_bytes(),
            );
        }
        let r = m.finish();
        assert_eq!((r.delta_events, r.delta_text_bytes), (4, 3 + 8 + 3));

        let mut m = UsageMeter::chat(BodyKind::EventStream);
        m.feed(br#"data: {"choices":[{"index":0,"delta":{"reasoning_content":"think","tool_calls":[{"index":0,"function":{"name":"Bash","arguments":"{\"c\":1}"}}]}}]}"#);
        m.feed(b"\n\n");
        m.feed(br#"data: {"choices":[{"index":0,"delta":{"content":[{"type":"text","text":"x"}]}}],"usage":{"prompt_tokens":9,"completion_tokens":4}}"#);
        m.feed(b"\n\n");
        let r = m.finish();
        assert_eq!(r.malformed, 0, "{r:?}");
        assert!(r.saw_usage);
        assert_eq!(r.usage.output_tokens, 4);
        assert_eq!((r.delta_events, r.delta_text_bytes), (2, 5 + 4 + 7));
    }

    /// Data-only frames (no `event:` line) are classified by their JSON type, deltas too, so a
    /// cut data-only stream bills its deltas.
    #[test]
    fn a_cut_data_only_stream_bills_its_deltas() {
        let mut m = UsageMeter::event_stream();
        m.feed(b"data: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n");
        let text = "x".repeat(300);
        m.feed(
            format!("data: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\"{text}\"}}}}\n\n")
                .as_bytes(),
        );
        let r = m.finish();
        assert!(!r.complete);
        assert_eq!((r.delta_events, r.delta_text_bytes), (1, 300));
        assert_eq!(r.billable_usage().output_tokens, 100);
    }

    /// A chat stream that ends with `[DONE]` but never sent its usage chunk (a router that
    /// ignores `include_usage`) bills its deltas, not nothing.
    #[test]
    fn a_complete_chat_stream_without_usage_bills_its_deltas() {
        let mut m = UsageMeter::chat(BodyKind::EventStream);
        let text = "y".repeat(300);
        m.feed(format!("data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\"{text}\"}}}}]}}\n\ndata: [DONE]\n\n").as_bytes());
        let r = m.finish();
        assert!(r.complete && !r.saw_usage);
        assert_eq!(r.billable_usage().output_tokens, 100);
    }

    #[test]
    fn only_a_json_body_is_whole() {
        let mut m = UsageMeter::json();
        m.feed(br#"{"type":"message","usage":{"input_tokens":5,"out"#);
        let r = m.finish();
        assert!(r.whole_body && !r.complete && r.malformed == 1, "{r:?}");
        assert!(usage_from_json(b"{}").whole_body && chat_usage_from_json(b"{}").whole_body);
        assert!(!UsageMeter::event_stream().finish().whole_body);
    }

    #[test]
    fn complete_stream_bills_exactly_what_was_reported() {
        let mut m = UsageMeter::event_stream();
        m.feed(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n");
        m.feed(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hello world, a long answer indeed\"}}\n\n");
        m.feed(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\"},\"usage\":{\"output_tokens\":7}}\n\n");
        m.feed(b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
        let r = m.finish();
        assert!(r.complete);
        assert_eq!(r.billable_usage().output_tokens, 7);
    }
}
