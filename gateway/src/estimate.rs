//! Local input-token estimates for `count_tokens` and for reservations: no upstream call,
//! every block type counted, biased high, never 0 for a non-empty request.
//!
//! Text is counted at 3 bytes a token. English prose runs about 4 characters a token and code
//! and JSON about 3.5, so this errs high, which is the safe side for a budget reservation and
//! for Claude Code's compaction threshold; CJK text is 3 UTF-8 bytes a character and about a
//! token a character, so it is close. Images count as 1,600 tokens, Anthropic's ceiling for
//! an image at its maximum resolution, instead of their base64 size, whatever their source.
//!
//! Documents are where a request's size says least about its cost. A base64 document counts
//! its decoded bytes as text (PDF bytes are mostly compressed streams that expand into more
//! tokens than bytes), and at least [`DOCUMENT_MIN_TOKENS`]: a PDF page is billed as an image
//! plus its text. A document with a URL source (only forwarded for models with
//! `allow_url_sources`) counts [`URL_DOCUMENT_TOKENS`], since the gateway never sees what the
//! provider fetches; a wrong guess here is bounded by the ledger (it costs at most what that
//! one request bills beyond its reservation, see [`crate::ledger`]).

use agentbox_policy::sanitize::raw::{ByteCounter, EstimateRules};
use serde_json::Value;

/// Tokens charged per image block.
pub const IMAGE_TOKENS: u64 = 1600;
/// Least tokens charged per document with inline data: one PDF page as an image plus a page of
/// text.
pub const DOCUMENT_MIN_TOKENS: u64 = 3_200;
/// Tokens charged per document with a URL source: a 30-page PDF at Anthropic's per-page cost.
pub const URL_DOCUMENT_TOKENS: u64 = 100_000;
/// Framing tokens per message (role markers).
pub const MESSAGE_OVERHEAD: u64 = 4;
const BYTES_PER_TOKEN: u64 = 3;

/// These rules for the sanitizer's walk (`policy::sanitize::raw`), which counts the estimate
/// of a passthrough request while it checks it; its tests compare it with [`input_tokens`].
pub const RULES: EstimateRules = EstimateRules {
    image_tokens: IMAGE_TOKENS,
    document_min_tokens: DOCUMENT_MIN_TOKENS,
    url_document_tokens: URL_DOCUMENT_TOKENS,
    message_overhead: MESSAGE_OVERHEAD,
    bytes_per_token: BYTES_PER_TOKEN,
};

#[derive(Debug, Default)]
struct Tally {
    bytes: u64,
    fixed: u64,
}

impl Tally {
    fn text(&mut self, s: &str) {
        self.bytes += s.len() as u64;
    }

    fn json(&mut self, v: &Value) {
        let mut w = ByteCounter(0);
        // Writing into a counter cannot fail.
        let _ = serde_json::to_writer(&mut w, v);
        self.bytes += w.0;
    }

    fn content(&mut self, v: &Value) {
        match v {
            Value::String(s) => self.text(s),
            Value::Array(blocks) => blocks.iter().for_each(|b| self.block(b)),
            Value::Null => {}
            other @ (Value::Bool(_) | Value::Number(_) | Value::Object(_)) => self.json(other),
        }
    }

    fn block(&mut self, b: &Value) {
        let field = |k: &str| b.get(k);
        match field("type").and_then(Value::as_str) {
            Some("text") => self.content(field("text").unwrap_or(&Value::Null)),
            Some("image") => self.fixed += IMAGE_TOKENS,
            Some("document") => {
                let source = field("source");
                let source_type = source.and_then(|s| s.get("type")).and_then(Value::as_str);
                match (source_type, source.and_then(|s| s.get("data"))) {
                    (Some("url"), _) => self.fixed += URL_DOCUMENT_TOKENS,
                    // Base64 is 4/3 of the bytes it encodes.
                    (Some("base64"), Some(Value::String(data))) => {
                        self.fixed += DOCUMENT_MIN_TOKENS
                            .max((data.len() as u64 * 3 / 4).div_ceil(BYTES_PER_TOKEN));
                    }
                    // Text sources are their text; anything else counts as its JSON, plus the
                    // floor, since the provider may read it as a file.
                    (Some("text"), Some(Value::String(data))) => self.text(data),
                    _ => {
                        self.fixed += DOCUMENT_MIN_TOKENS;
                        self.json(b);
                    }
                }
            }
            Some("tool_use") | Some("server_tool_use") => {
                self.content(field("name").unwrap_or(&Value::Null));
                self.json(field("input").unwrap_or(&Value::Null));
            }
            Some("tool_result") => self.content(field("content").unwrap_or(&Value::Null)),
            Some("thinking") => self.content(field("thinking").unwrap_or(&Value::Null)),
            Some("redacted_thinking") => self.content(field("data").unwrap_or(&Value::Null)),
            Some(_) | None => self.json(b),
        }
    }
}

/// An upper-leaning estimate of the input tokens of an Anthropic Messages (or count_tokens)
/// request: system, messages, tools and tool choice.
pub fn input_tokens(req: &Value) -> u64 {
    let mut t = Tally::default();
    if let Some(system) = req.get("system") {
        t.content(system);
    }
    if let Some(Value::Array(messages)) = req.get("messages") {
        for m in messages {
            t.fixed += MESSAGE_OVERHEAD;
            t.content(m.get("content").unwrap_or(&Value::Null));
        }
    }
    if let Some(Value::Array(tools)) = req.get("tools") {
        tools.iter().for_each(|tool| t.json(tool));
    }
    if let Some(choice) = req.get("tool_choice") {
        t.json(choice);
    }
    (t.bytes.div_ceil(BYTES_PER_TOKEN) + t.fixed).max(1)
}

/// The input estimate of an OpenAI chat completions request: what [`input_tokens`] counts
/// (messages' content, tools, tool choice) plus the assistant messages' `tool_calls` and the
/// tool messages' ids, which chat carries outside `content`, and [`IMAGE_TOKENS`] for each
/// media part (`image_url`, `video_url`, ...).
pub fn chat_input_tokens(req: &Value) -> u64 {
    let mut t = Tally::default();
    if let Some(Value::Array(messages)) = req.get("messages") {
        for m in messages {
            if let Some(calls) = m.get("tool_calls") {
                t.json(calls);
            }
            // Media parts (`image_url`, `video_url`, ...): at least an image each, whatever
            // the size of their URL.
            if let Some(Value::Array(parts)) = m.get("content") {
                let media = parts
                    .iter()
                    .filter_map(Value::as_object)
                    .filter(|p| p.keys().any(|k| k.ends_with("_url")))
                    .count();
                t.fixed = t
                    .fixed
                    .saturating_add(IMAGE_TOKENS.saturating_mul(media as u64));
            }
            if let Some(Value::String(id)) = m.get("tool_call_id") {
                t.text(id);
            }
        }
    }
    input_tokens(req)
        .saturating_add(t.bytes.div_ceil(BYTES_PER_TOKEN))
        .saturating_add(t.fixed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn never_zero() {
        assert_eq!(input_tokens(&json!({})), 1);
        assert!(input_tokens(&json!({"messages": [{"role": "user", "content": "hi"}]})) >= 1);
    }

    #[test]
    fn biased_high_for_english() {
        // 4,000 characters of English is about 1,000 real tokens.
        let text = "the quick brown fox jumps over the lazy dog ".repeat(100);
        let n = input_tokens(&json!({"messages": [{"role": "user", "content": text}]}));
        assert!(n >= 1200, "{n}");
    }

    #[test]
    fn every_block_type_counts() {
        let base = input_tokens(&json!({"messages": [{"role": "user", "content": []}]}));
        for block in [
            json!({"type": "text", "text": "some words here"}),
            json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}),
            json!({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "QUJDREVGR0hJSktM"}}),
            json!({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain text doc"}}),
            json!({"type": "tool_use", "id": "t", "name": "Write", "input": {"path": "a.txt"}}),
            json!({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "ok done"}]}),
            json!({"type": "thinking", "thinking": "let me think", "signature": "sig"}),
            json!({"type": "redacted_thinking", "data": "opaque"}),
            json!({"type": "search_result", "source": "x", "title": "t", "content": []}),
        ] {
            let n =
                input_tokens(&json!({"messages": [{"role": "user", "content": [block.clone()]}]}));
            assert!(n > base, "{block} counted as nothing");
        }
        let image = input_tokens(&json!({"messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": "A".repeat(1_000_000)}}]}]}));
        assert!(
            image < 2000,
            "images count as a fixed size, not their base64: {image}"
        );
    }

    #[test]
    fn documents_count_conservatively() {
        let doc = |source: Value| {
            input_tokens(&json!({"messages": [{"role": "user", "content": [
                {"type": "document", "source": source}]}]}))
        };
        assert!(doc(json!({"type": "url", "url": "https://x/a.pdf"})) >= URL_DOCUMENT_TOKENS);
        assert!(doc(json!({"type": "base64", "data": "QUJD"})) >= DOCUMENT_MIN_TOKENS);
        assert!(doc(json!({"type": "file", "file_id": "f"})) >= DOCUMENT_MIN_TOKENS);
        // A URL image inside a tool result still counts as an image.
        let img = input_tokens(&json!({"messages": [{"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [
                {"type": "image", "source": {"type": "url", "url": "https://x/i.png"}}]}]}]}));
        assert!(img >= IMAGE_TOKENS);
    }

    #[test]
    fn system_and_tools_count() {
        let tools = json!([{"name": "Write", "description": "write a file", "input_schema": {"type": "object"}}]);
        let a = input_tokens(&json!({"messages": []}));
        let b = input_tokens(
            &json!({"messages": [], "system": [{"type": "text", "text": "be good"}], "tools": tools}),
        );
        assert!(b > a + 10, "{a} {b}");
    }

    /// The sanitizer's walk counts what [`input_tokens`] counts on the sanitized tree.
    fn same_as_walk(body: &Value) {
        use agentbox_policy::sanitize::{raw, sanitize_request};
        let bytes = serde_json::to_vec(body).unwrap();
        for allow in [true, false] {
            let mut tree = body.clone();
            let Ok(_) = sanitize_request(&mut tree, "m", allow) else {
                continue;
            };
            let walked = raw::parse(&bytes)
                .unwrap()
                .sanitize(&raw::Options {
                    model: "m",
                    allow_url_sources: allow,
                    max_tokens_cap: None,
                    strip_metadata_user_id: false,
                    estimate: Some(RULES),
                })
                .unwrap();
            assert_eq!(walked.input_tokens, input_tokens(&tree), "{body}");
        }
    }

    #[test]
    fn the_sanitizers_walk_counts_the_same() {
        let blocks = [
            json!({"type": "text", "text": "some words here"}),
            json!({"text": "type after text \n \"q\"", "type": "text"}),
            json!({"type": "text"}),
            json!({"type": "text", "text": ["odd", 1, {"a": null}]}),
            json!({"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}),
            json!({"type": "image", "source": {"type": "url", "url": "https://x/i.png"}}),
            json!({"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "QUJDREVGR0hJSktM".repeat(2000)}}),
            json!({"type": "document", "source": {"type": "base64", "data": 5}}),
            json!({"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "plain\ntext doc"}}),
            json!({"type": "document", "source": {"type": "url", "url": "https://x/a.pdf"}}),
            json!({"type": "document", "source": {"type": "file", "file_id": "f"}}),
            json!({"type": "document", "source": "s"}),
            json!({"type": "document"}),
            json!({"type": "tool_use", "id": "t", "name": "Write", "input": {"path": "a.txt", "n": [1.5, -2, 3e10]}}),
            json!({"input": {"p": "\u{1}"}, "name": "Write", "type": "server_tool_use"}),
            json!({"type": "tool_use", "id": "t"}),
            json!({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "ok done"}, {"type": "image"}]}),
            json!({"type": "tool_result", "tool_use_id": "t", "content": "plain"}),
            json!({"type": "thinking", "thinking": "let me think", "signature": "sig"}),
            json!({"type": "redacted_thinking", "data": "opaque"}),
            json!({"type": "search_result", "source": "x", "title": "t\t", "content": []}),
            json!({"type": 7, "x": true}),
            json!({"no_type": false}),
            json!("a bare string"),
            json!(42),
            json!(null),
            json!([1, "x"]),
        ];
        for block in &blocks {
            same_as_walk(&json!({"messages": [{"role": "user", "content": [block]}]}));
            same_as_walk(&json!({"system": [block], "messages": []}));
        }
        same_as_walk(&json!({}));
        same_as_walk(&json!({"system": "plain", "messages": "not a list"}));
        same_as_walk(
            &json!({"system": {"a": 1}, "messages": [7, {"content": null}, {"role": "user"}, {"content": "hi é"}]}),
        );
        same_as_walk(
            &json!({"messages": [], "system": 1.25, "tool_choice": {"type": "auto"},
            "tools": [{"name": "Write", "description": "write \"a\" file", "input_schema": {"type": "object"}},
                      {"type": "web_search_20250305", "name": "web_search"}]}),
        );
        same_as_walk(
            &json!({"messages": [], "tool_choice": {"type": "tool", "name": "web_search"},
            "tools": [{"name": "Write"}, {"type": "web_search_20250305", "name": "web_search"}]}),
        );
        same_as_walk(&json!({"messages": [], "tool_choice": {"type": "any"},
            "tools": [{"type": "web_search_20250305", "name": "web_search"}]}));
        // The recorded Claude Code requests.
        for request in [
            include_str!("../../tests/fixtures/proxy/claude_code/01_first/request.json"),
            include_str!("../../tests/fixtures/proxy/claude_code/02_tool_result/request.json"),
            include_str!("../../tests/fixtures/proxy/claude_code/03_second_turn/request.json"),
        ] {
            let recorded: Value = serde_json::from_str(request).unwrap();
            same_as_walk(&recorded["body"]);
        }
    }
}
