//! The fakellm script: its JSON shape (see the [module docs](super) for the format), request
//! matching, and the dispatcher that decides which entry answers each request.
//!
//! The dispatcher is the only mutable state of the server; it sits behind a mutex because real
//! clients send side requests concurrently with their main turn.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::FakeLlmError;

/// A whole script file.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Script {
    /// Replies consumed one per matching request, in order.
    pub steps: Vec<Entry>,
    /// Replies for side requests, consulted before `steps` and never consuming them.
    pub rules: Vec<Entry>,
    /// The reply once `steps` is exhausted (or its next step does not match); absent means a
    /// non-retryable 500 naming the request.
    pub fallback: Option<Entry>,
    /// A fixed answer for `count_tokens`; absent means an estimate of request bytes / 4.
    pub count_tokens: Option<u64>,
    /// Model ids listed by `GET /v1/models`; absent means `["fakellm"]`.
    pub models: Option<Vec<String>>,
    /// When set, every routed request must present this key (`x-api-key` or
    /// `Authorization: Bearer`), else 401 `authentication_error`, as a real provider does.
    pub api_key: Option<String>,
}

impl Script {
    /// Reads and parses a script file.
    ///
    /// # Errors
    /// When the file cannot be read or is not a valid script.
    pub fn load(path: &Path) -> Result<Self, FakeLlmError> {
        let text = std::fs::read_to_string(path).map_err(|source| FakeLlmError::ReadScript {
            path: path.to_path_buf(),
            source,
        })?;
        serde_json::from_str(&text).map_err(|source| FakeLlmError::ParseScript {
            path: path.to_path_buf(),
            source,
        })
    }
}

/// One scripted reply, plus the conditions under which it applies.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Entry {
    /// Conditions a request must meet for this entry to answer it; absent matches everything.
    #[serde(rename = "match")]
    pub when: Option<Match>,
    /// For rules: how many requests this rule may answer; absent means unlimited.
    pub times: Option<u32>,
    /// Assistant text.
    pub text: Option<String>,
    /// Thinking text, rendered before the text (Anthropic `thinking` block, OpenAI
    /// `reasoning_content`).
    pub thinking: Option<String>,
    /// Signature of the thinking block; a fixed placeholder when absent.
    pub signature: Option<String>,
    /// Tool calls, rendered after the text.
    pub tool_calls: Vec<ToolCall>,
    /// Exact usage numbers; absent means deterministic estimates.
    pub usage: Option<Usage>,
    /// Overrides the derived stop reason (`tool_use` with tool calls, else `end_turn`).
    pub stop_reason: Option<StopReason>,
    /// The model named in the reply; absent echoes the request's.
    pub model: Option<String>,
    /// Milliseconds to wait before sending the response head.
    pub delay_ms: u64,
    /// Milliseconds to wait between streamed events.
    pub event_delay_ms: u64,
    /// Answer with this HTTP error instead of a message.
    pub error: Option<ErrorReply>,
    /// Extra response headers.
    pub headers: BTreeMap<String, String>,
    /// Abort the connection after this many streamed events (non-streamed replies: after the
    /// first half of the body).
    pub disconnect_after_events: Option<usize>,
    /// Emit an in-stream error event after this many events and end the stream there.
    pub error_event: Option<ErrorEvent>,
    /// Streamed replies: SSE comment frames (`: dressage-heartbeat`) sent before the first
    /// frame, as a pseudo-streaming router does while it generates. With `error`, the error
    /// comes after them as the first real frame of a 200 stream (`data: {"error": {…,
    /// "status_code": N}}`), the way such a router reports a late failure.
    pub heartbeats: usize,
    /// Streamed replies: after this many frames, send one `data:` frame that is not JSON and
    /// end the stream there.
    pub garbage_after_events: Option<usize>,
    /// Replace `text` with this many bytes of filler, generated as the reply goes out (never
    /// held whole): streamed, as text deltas of 64 KiB; whole, inside the one JSON body.
    pub huge_text_bytes: Option<u64>,
}

/// A scripted tool call; its id is generated unless given.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ToolCall {
    /// Tool name as the client declared it.
    pub name: String,
    /// Tool arguments (Anthropic `input`, OpenAI `function.arguments` serialized).
    #[serde(default = "empty_object")]
    pub input: Value,
    /// Tool call id; generated (`toolu_…` / `call_…`) when absent.
    #[serde(default)]
    pub id: Option<String>,
}

fn empty_object() -> Value {
    Value::Object(serde_json::Map::new())
}

/// Usage in Anthropic terms; OpenAI replies derive `prompt_tokens` as input + cache read +
/// cache creation, because OpenAI counts cached tokens inside the prompt.
#[derive(Debug, Clone, Copy, Default, Deserialize, PartialEq, Eq)]
#[serde(default, deny_unknown_fields)]
pub struct Usage {
    /// Uncached input tokens.
    pub input_tokens: u64,
    /// Output tokens.
    pub output_tokens: u64,
    /// Tokens read from the prompt cache (`prompt_tokens_details.cached_tokens` in OpenAI).
    pub cache_read_input_tokens: Option<u64>,
    /// Tokens written to the prompt cache (no OpenAI field; counted in `prompt_tokens`).
    pub cache_creation_input_tokens: Option<u64>,
}

/// Why the reply stopped.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum StopReason {
    /// Anthropic `end_turn`, OpenAI `stop`.
    EndTurn,
    /// Anthropic `tool_use`, OpenAI `tool_calls`.
    ToolUse,
    /// Anthropic `max_tokens`, OpenAI `length`.
    MaxTokens,
    /// Anthropic `stop_sequence`, OpenAI `stop`.
    StopSequence,
}

impl StopReason {
    /// The Anthropic spelling.
    #[must_use]
    pub fn anthropic(self) -> &'static str {
        match self {
            Self::EndTurn => "end_turn",
            Self::ToolUse => "tool_use",
            Self::MaxTokens => "max_tokens",
            Self::StopSequence => "stop_sequence",
        }
    }

    /// The OpenAI `finish_reason` spelling.
    #[must_use]
    pub fn openai(self) -> &'static str {
        match self {
            Self::EndTurn | Self::StopSequence => "stop",
            Self::ToolUse => "tool_calls",
            Self::MaxTokens => "length",
        }
    }
}

/// A scripted HTTP error.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorReply {
    /// HTTP status code.
    pub status: u16,
    /// Error type; derived from the status when absent (e.g. 429 → `rate_limit_error`).
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// Error message; a fakellm default when absent.
    #[serde(default)]
    pub message: Option<String>,
    /// The whole response body, replacing the API-shaped one.
    #[serde(default)]
    pub body: Option<Value>,
}

/// A scripted in-stream error (Anthropic `event: error`, OpenAI `data: {"error":…}`).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ErrorEvent {
    /// How many normal events precede the error.
    pub after_events: usize,
    /// Error type; `overloaded_error` when absent.
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    /// Error message.
    #[serde(default)]
    pub message: Option<String>,
}

/// Conditions on a request; every condition given must hold.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Match {
    /// `anthropic` (`/v1/messages`) or `openai` (`/chat/completions`).
    pub api: Option<Api>,
    /// Exact request model.
    pub model: Option<String>,
    /// Substring of the request model.
    pub model_contains: Option<String>,
    /// Whether the request declares a non-empty `tools` list.
    pub has_tools: Option<bool>,
    /// Whether the request asks for a stream.
    pub stream: Option<bool>,
    /// Substring of the raw request body.
    pub body_contains: Option<String>,
    /// The raw request body must not contain this substring.
    pub body_lacks: Option<String>,
    /// `max_tokens` (or `max_completion_tokens`) is present and at most this.
    pub max_tokens_at_most: Option<u64>,
}

/// The two wire formats fakellm speaks.
#[derive(Debug, Clone, Copy, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// Anthropic Messages.
    Anthropic,
    /// OpenAI Chat Completions.
    Openai,
}

/// What matching looks at in a request.
#[derive(Debug, Clone, Copy)]
pub struct RequestView<'a> {
    /// Which API the request used.
    pub api: Api,
    /// The parsed body.
    pub body: &'a Value,
    /// The raw body text.
    pub raw: &'a str,
}

impl RequestView<'_> {
    fn model(&self) -> &str {
        self.body.get("model").and_then(Value::as_str).unwrap_or("")
    }

    fn has_tools(&self) -> bool {
        self.body
            .get("tools")
            .and_then(Value::as_array)
            .is_some_and(|t| !t.is_empty())
    }

    /// Whether the request asks for a streamed reply.
    #[must_use]
    pub fn stream(&self) -> bool {
        self.body
            .get("stream")
            .and_then(Value::as_bool)
            .unwrap_or(false)
    }

    fn max_tokens(&self) -> Option<u64> {
        self.body
            .get("max_tokens")
            .or_else(|| self.body.get("max_completion_tokens"))
            .and_then(Value::as_u64)
    }
}

impl Match {
    /// Whether `req` meets every condition.
    #[must_use]
    pub fn matches(&self, req: &RequestView<'_>) -> bool {
        let model = req.model();
        self.api.is_none_or(|a| a == req.api)
            && self.model.as_deref().is_none_or(|m| m == model)
            && self
                .model_contains
                .as_deref()
                .is_none_or(|m| model.contains(m))
            && self.has_tools.is_none_or(|t| t == req.has_tools())
            && self.stream.is_none_or(|s| s == req.stream())
            && self
                .body_contains
                .as_deref()
                .is_none_or(|s| req.raw.contains(s))
            && self
                .body_lacks
                .as_deref()
                .is_none_or(|s| !req.raw.contains(s))
            && self
                .max_tokens_at_most
                .is_none_or(|n| req.max_tokens().is_some_and(|m| m <= n))
    }
}

fn entry_matches(entry: &Entry, req: &RequestView<'_>) -> bool {
    entry.when.as_ref().is_none_or(|m| m.matches(req))
}

/// Which part of the script answered a request; logged as `served_by`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    /// `rules[i]`.
    Rule(usize),
    /// `steps[i]`.
    Step(usize),
    /// `fallback`.
    Fallback,
    /// Nothing did: the request gets the "script exhausted" error.
    Exhausted {
        /// Steps consumed so far.
        consumed: usize,
        /// Whether a step remains that did not match.
        pending_mismatch: bool,
    },
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Rule(i) => write!(f, "rule {i}"),
            Self::Step(i) => write!(f, "step {i}"),
            Self::Fallback => f.write_str("fallback"),
            Self::Exhausted { .. } => f.write_str("exhausted"),
        }
    }
}

/// Decides which entry answers each request.
#[derive(Debug)]
pub struct Dispatcher {
    script: Script,
    next_step: usize,
    rule_uses: Vec<u32>,
}

impl Dispatcher {
    /// A dispatcher at the start of `script`.
    #[must_use]
    pub fn new(script: Script) -> Self {
        let rule_uses = vec![0; script.rules.len()];
        Self {
            script,
            next_step: 0,
            rule_uses,
        }
    }

    /// The script being played.
    #[must_use]
    pub fn script(&self) -> &Script {
        &self.script
    }

    /// Picks the entry for `req`: the first rule that matches and has uses left, else the next
    /// step if it matches (consuming it), else the fallback.
    pub fn dispatch(&mut self, req: &RequestView<'_>) -> (Source, Option<Entry>) {
        for (i, rule) in self.script.rules.iter().enumerate() {
            let used = self.rule_uses.get(i).copied().unwrap_or(0);
            if rule.times.is_some_and(|t| used >= t) || !entry_matches(rule, req) {
                continue;
            }
            if let Some(u) = self.rule_uses.get_mut(i) {
                *u += 1;
            }
            return (Source::Rule(i), Some(rule.clone()));
        }
        let mut pending_mismatch = false;
        if let Some(step) = self.script.steps.get(self.next_step) {
            if entry_matches(step, req) {
                let i = self.next_step;
                self.next_step += 1;
                return (Source::Step(i), Some(step.clone()));
            }
            pending_mismatch = true;
        }
        match &self.script.fallback {
            Some(f) => (Source::Fallback, Some(f.clone())),
            None => (
                Source::Exhausted {
                    consumed: self.next_step,
                    pending_mismatch,
                },
                None,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn view(body: &Value) -> (Value, String) {
        (body.clone(), body.to_string())
    }

    #[test]
    fn rules_do_not_consume_steps_and_respect_times() {
        let script: Script = serde_json::from_value(json!({
            "rules": [{"match": {"has_tools": false}, "text": "side", "times": 1}],
            "steps": [{"match": {"has_tools": true}, "text": "main"}]
        }))
        .unwrap();
        let mut d = Dispatcher::new(script);
        let (side, side_raw) = view(&json!({"model": "m", "messages": []}));
        let (main, main_raw) =
            view(&json!({"model": "m", "messages": [], "tools": [{"name": "x"}]}));
        let side_req = RequestView {
            api: Api::Anthropic,
            body: &side,
            raw: &side_raw,
        };
        let main_req = RequestView {
            api: Api::Anthropic,
            body: &main,
            raw: &main_raw,
        };
        assert_eq!(d.dispatch(&side_req).0, Source::Rule(0));
        // The rule is used up and the step does not match: nothing answers.
        assert!(matches!(
            d.dispatch(&side_req).0,
            Source::Exhausted {
                consumed: 0,
                pending_mismatch: true
            }
        ));
        assert_eq!(d.dispatch(&main_req).0, Source::Step(0));
        assert!(matches!(
            d.dispatch(&main_req).0,
            Source::Exhausted {
                consumed: 1,
                pending_mismatch: false
            }
        ));
    }

    #[test]
    fn match_conditions() {
        let (body, raw) = view(&json!({
            "model": "claude-haiku-4-5", "max_tokens": 512, "stream": true, "messages": []
        }));
        let req = RequestView {
            api: Api::Anthropic,
            body: &body,
            raw: &raw,
        };
        let m = |v: Value| serde_json::from_value::<Match>(v).unwrap().matches(&req);
        assert!(m(json!({"model_contains": "haiku", "stream": true})));
        assert!(m(json!({"max_tokens_at_most": 512})));
        assert!(!m(json!({"max_tokens_at_most": 511})));
        assert!(!m(json!({"api": "openai"})));
        assert!(m(
            json!({"body_contains": "haiku", "body_lacks": "tool_result"})
        ));
        assert!(!m(json!({"has_tools": true})));
    }

    #[test]
    fn unknown_script_keys_are_refused() {
        assert!(serde_json::from_value::<Script>(json!({"stepz": []})).is_err());
        assert!(serde_json::from_value::<Script>(json!({"steps": [{"txt": "a"}]})).is_err());
    }
}
