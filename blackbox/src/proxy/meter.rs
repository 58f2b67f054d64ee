//! Usage counts from the chat completions the router sends back, whatever protocol the agent
//! speaks: the proxy reads the upstream's chat answer (streamed: every `data:` chunk as it
//! passes; whole: the JSON body) for `usage` and tool calls, so the turn's counts are the
//! router's own numbers, not an estimate and not the agent's view.
//!
//! [`Metered`] wraps the upstream byte stream: it counts as the bytes pass, and when it is
//! dropped (the stream ended, broke, or the client went away) it adds what it saw to the
//! call's turn and releases the call's in-flight mark, in that order. On a passthrough stream
//! it is also the judge of garbage: a `data:` payload that is not JSON ends the stream with an
//! error (which the body turns into the protocol's error frame) instead of being forwarded.

use std::pin::Pin;
use std::task::{Context, Poll};

use agentbox_llm::body::{BodyError, UpstreamStream};
use agentbox_wire::sse;
use bytes::Bytes;
use futures_util::Stream;
use serde::Deserialize;
use serde::de::IgnoredAny;

use super::TurnCounts;
use super::state::CallGuard;

#[derive(Deserialize, Default, Clone, Copy)]
struct UsageView {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
    #[serde(default)]
    total_tokens: Option<u64>,
    #[serde(default)]
    completion_tokens_details: Option<DetailsView>,
}

#[derive(Deserialize, Default, Clone, Copy)]
struct DetailsView {
    #[serde(default)]
    reasoning_tokens: Option<u64>,
}

#[derive(Deserialize)]
struct ToolCallView {
    #[serde(default)]
    index: Option<u32>,
}

#[derive(Deserialize, Default)]
struct MessageView {
    #[serde(default)]
    tool_calls: Option<Vec<IgnoredAny>>,
}

#[derive(Deserialize, Default)]
struct DeltaView {
    #[serde(default)]
    tool_calls: Option<Vec<ToolCallView>>,
}

#[derive(Deserialize)]
struct ChoiceView {
    #[serde(default)]
    index: u32,
    #[serde(default)]
    delta: Option<DeltaView>,
    #[serde(default)]
    message: Option<MessageView>,
}

/// A chunk or a whole answer: only what is counted.
#[derive(Deserialize)]
struct AnswerView {
    #[serde(default)]
    usage: Option<UsageView>,
    #[serde(default)]
    choices: Option<Vec<ChoiceView>>,
}

/// Counts of one answer, built from its chunks.
#[derive(Default)]
pub struct ChatMeter {
    usage: Option<UsageView>,
    /// (choice, tool call index) pairs seen in a stream: one tool call each.
    tools: Vec<(u32, u32)>,
    tool_calls: u64,
}

impl ChatMeter {
    /// Reads one streamed `data:` payload; `false` if it is neither JSON nor `[DONE]`.
    pub fn push_data(&mut self, data: &str) -> bool {
        let data = data.trim();
        if data == "[DONE]" {
            return true;
        }
        match serde_json::from_str::<AnswerView>(data) {
            Ok(chunk) => {
                self.push(chunk);
                true
            }
            // Valid JSON that is not an object (a server's oddity) is not garbage.
            Err(_) => serde_json::from_str::<IgnoredAny>(data).is_ok(),
        }
    }

    fn push(&mut self, a: AnswerView) {
        if let Some(u) = a.usage {
            // Usage is cumulative for the answer: the last report stands.
            self.usage = Some(u);
        }
        for choice in a.choices.unwrap_or_default() {
            let calls = choice.delta.and_then(|d| d.tool_calls).unwrap_or_default();
            for (pos, call) in calls.iter().enumerate() {
                let key = (
                    choice.index,
                    call.index
                        .unwrap_or_else(|| u32::try_from(pos).unwrap_or(u32::MAX)),
                );
                if !self.tools.contains(&key) {
                    self.tools.push(key);
                }
            }
            if let Some(calls) = choice.message.and_then(|m| m.tool_calls) {
                self.tool_calls += calls.len() as u64;
            }
        }
    }

    /// The counts of a whole (non-streamed) answer.
    pub fn from_json(body: &[u8]) -> TurnCounts {
        let mut m = ChatMeter::default();
        if let Ok(a) = serde_json::from_slice::<AnswerView>(body) {
            m.push(a);
        }
        m.counts()
    }

    /// What the answer counts for (its `steps` is 0: steps are counted at admission).
    pub fn counts(&self) -> TurnCounts {
        let u = self.usage.unwrap_or_default();
        TurnCounts {
            steps: 0,
            input_tokens: u.prompt_tokens,
            output_tokens: u.completion_tokens,
            reasoning_tokens: u
                .completion_tokens_details
                .and_then(|d| d.reasoning_tokens)
                .unwrap_or(0),
            total_tokens: u
                .total_tokens
                .unwrap_or_else(|| u.prompt_tokens.saturating_add(u.completion_tokens)),
            tool_calls: self.tool_calls + self.tools.len() as u64,
        }
    }
}

/// Whether a chunk's text may hold something counted: a `usage` or `tool_calls` member.
fn may_count(data: &str) -> bool {
    super::may_name(data.as_bytes(), &[b"\"usage\"", b"\"tool_calls\""])
}

/// The upstream stream, counted; see the module doc.
pub struct Metered {
    inner: UpstreamStream,
    decoder: sse::Decoder,
    meter: ChatMeter,
    guard: Option<CallGuard>,
    /// Refuse non-JSON payloads (passthrough streams; translators judge their own input).
    strict: bool,
    failed: bool,
}

impl Metered {
    pub fn new(inner: UpstreamStream, guard: CallGuard, strict: bool) -> Self {
        Metered {
            inner,
            decoder: sse::Decoder::new(),
            meter: ChatMeter::default(),
            guard: Some(guard),
            strict,
            failed: false,
        }
    }
}

impl Stream for Metered {
    type Item = Result<Bytes, BodyError>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.failed {
            return Poll::Ready(None);
        }
        match this.inner.as_mut().poll_next(cx) {
            Poll::Ready(Some(Ok(chunk))) => {
                let meter = &mut this.meter;
                let strict = this.strict;
                let mut garbage = false;
                let framed = this.decoder.feed_with(&chunk, |ev| {
                    // Only a strict meter needs every payload parsed (to refuse garbage); a
                    // lenient one skips those that cannot count.
                    if (strict || may_count(ev.data)) && !meter.push_data(ev.data) {
                        garbage = true;
                    }
                });
                if this.strict && (garbage || framed.is_err()) {
                    this.failed = true;
                    tracing::warn!("upstream sent a stream chunk that is not JSON");
                    return Poll::Ready(Some(Err(BodyError::from(
                        "upstream sent an unreadable stream chunk",
                    ))));
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            other @ (Poll::Ready(_) | Poll::Pending) => other,
        }
    }
}

impl Drop for Metered {
    fn drop(&mut self) {
        if let Some(guard) = self.guard.take() {
            guard.add_counts(&self.meter.counts());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn streamed_usage_and_tool_calls_are_counted_once() {
        let mut m = ChatMeter::default();
        for data in [
            r#"{"choices":[{"index":0,"delta":{"role":"assistant"}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"f","arguments":""}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"b","function":{"name":"g"}}]}}]}"#,
            r#"{"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}"#,
            r#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":4,"total_tokens":14,"completion_tokens_details":{"reasoning_tokens":2}}}"#,
            "[DONE]",
        ] {
            assert!(m.push_data(data), "{data}");
        }
        assert_eq!(
            m.counts(),
            TurnCounts {
                steps: 0,
                input_tokens: 10,
                output_tokens: 4,
                reasoning_tokens: 2,
                total_tokens: 14,
                tool_calls: 2,
            }
        );
        assert!(!m.push_data("not json"));
    }

    #[test]
    fn only_chunks_that_cannot_count_are_skipped() {
        assert!(!may_count(
            r#"{"choices":[{"index":0,"delta":{"content":"the \"usage\" of tool_calls"}}]}"#
        ));
        assert!(may_count(r#"{"choices":[],"usage":{"prompt_tokens":1}}"#));
        assert!(may_count(
            r#"{"choices":[{"delta":{"tool_calls":[{"index":0}]}}]}"#
        ));
        assert!(may_count(
            r#"{"choices":[],"\u0075sage":{"prompt_tokens":1}}"#
        ));
    }

    #[test]
    fn whole_answers_are_counted() {
        let c = ChatMeter::from_json(
            br#"{"id":"x","choices":[{"index":0,"message":{"role":"assistant","content":null,"tool_calls":[{"id":"a"},{"id":"b"},{"id":"c"}]}}],"usage":{"prompt_tokens":5,"completion_tokens":7}}"#,
        );
        assert_eq!(
            (
                c.input_tokens,
                c.output_tokens,
                c.total_tokens,
                c.tool_calls
            ),
            (5, 7, 12, 3)
        );
        assert_eq!(ChatMeter::from_json(b"garbage"), TurnCounts::default());
    }
}
