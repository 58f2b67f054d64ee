//! Realistic request bodies for tests and benchmarks: a Claude-Code-sized Anthropic Messages
//! request (~100 KB) with the shape Claude Code 2.1 sends (system list, many tools with JSON
//! schemas, thinking, metadata, context_management, a tool round trip in the history).
//!
//! The text is deterministic filler, so runs are comparable; what matters for the gateway and
//! the bridge is the size and the structure they have to parse, edit and re-serialize.

use serde_json::{Value, json};

/// A deterministic paragraph of prose-like filler of about `bytes` bytes.
fn filler(seed: usize, bytes: usize) -> String {
    const WORDS: [&str; 16] = [
        "the", "agent", "must", "read", "files", "before", "editing", "them", "and", "run",
        "tests", "after", "every", "change", "to", "verify",
    ];
    let mut out = String::with_capacity(bytes + 16);
    let mut i = seed;
    while out.len() < bytes {
        out.push_str(WORDS[i % WORDS.len()]);
        out.push(if i % 13 == 12 { '.' } else { ' ' });
        i = i.wrapping_mul(31).wrapping_add(7);
    }
    out
}

/// A tool definition with a realistic JSON schema and a long description.
fn tool(i: usize) -> Value {
    json!({
        "name": format!("Tool{i}"),
        "description": filler(i, 2400),
        "input_schema": {
            "type": "object",
            "$schema": "http://json-schema.org/draft-07/schema#",
            "additionalProperties": false,
            "required": ["path"],
            "properties": {
                "path": {"type": "string", "description": filler(i + 100, 120)},
                "content": {"type": "string", "description": filler(i + 200, 80)},
                "limit": {"type": "integer", "minimum": 1, "description": "max lines"},
                "flags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}}
            }
        }
    })
}

/// A Claude-Code-sized (about 100 KB serialized) Anthropic Messages request for `model`.
#[must_use]
pub fn claude_code_request(model: &str, stream: bool) -> Value {
    let tools: Vec<Value> = (0..18).map(tool).collect();
    json!({
        "model": model,
        "max_tokens": 32000,
        "stream": stream,
        "system": [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": filler(1, 42_000), "cache_control": {"type": "ephemeral"}}
        ],
        "tools": tools,
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": filler(2, 3000)},
                {"type": "text", "text": "Fix the failing test in src/lib.rs."}
            ]},
            {"role": "assistant", "content": [
                {"type": "text", "text": "Let me look at the file."},
                {"type": "tool_use", "id": "toolu_01", "name": "Tool1", "input": {"path": "src/lib.rs"}}
            ]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_01", "content": filler(3, 8000)},
                {"type": "text", "text": "Continue."}
            ]}
        ],
        "metadata": {"user_id": "user_bench_session_0001"},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "temperature": 1
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_is_claude_code_sized() {
        let n = serde_json::to_vec(&claude_code_request("m", true))
            .unwrap()
            .len();
        assert!((90_000..=120_000).contains(&n), "{n} bytes");
    }
}
