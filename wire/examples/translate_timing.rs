//! Times the bridge's per-request work on a Claude-Code-shaped request of about 100 KB: parse
//! the Anthropic body, translate it to a chat request, serialize that; and the per-chunk cost
//! of the stream translator. Run with
//! `cargo run --release -p agentbox-wire --example translate_timing`.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use agentbox_wire::anthropic::MessagesRequest;
use agentbox_wire::chat::ChatChunk;
use agentbox_wire::translate::{
    AnthropicBody, ChatOptions, ChatStreamTranslator, ResponseOptions, anthropic_into_chat,
};
use agentbox_wire::usage::UsageMeter;
use serde_json::{Value, json};

fn prose(n: usize, seed: usize) -> String {
    let words = [
        "the",
        "agent",
        "must",
        "read",
        "files",
        "before",
        "editing",
        "them",
        "and",
        "run",
        "tests",
        "after",
        "every",
        "change",
        "use",
        "tools",
        "carefully",
        "\"quoted\"",
        "path/to",
        "code\n",
    ];
    let mut s = String::with_capacity(n + 16);
    let mut i = seed;
    while s.len() < n {
        s.push_str(words[i % words.len()]);
        s.push(' ');
        i = i.wrapping_mul(31).wrapping_add(7);
    }
    s
}

/// About 100 KB: a 30 KB system prompt in blocks (billing header first), 18 tools with
/// schemas, and a history of tool calls and results.
fn claude_code_request() -> Value {
    let tools: Vec<Value> = (0..18)
        .map(|i| {
            json!({
                "name": format!("Tool{i}"),
                "description": prose(1200, i),
                "input_schema": {
                    "type": "object",
                    "properties": {
                        "file_path": {"type": "string", "description": prose(200, i + 1)},
                        "content": {"type": "string", "description": prose(200, i + 2)},
                        "flags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}}
                    },
                    "required": ["file_path"],
                    "additionalProperties": false,
                    "$schema": "http://json-schema.org/draft-07/schema#"
                }
            })
        })
        .collect();
    let mut messages = vec![json!({"role": "user", "content": [
        {"type": "text", "text": format!("<system-reminder>{}</system-reminder>", prose(3000, 3))},
        {"type": "text", "text": "Fix the failing test in src/lib.rs", "cache_control": {"type": "ephemeral"}}
    ]})];
    for i in 0..14 {
        messages.push(json!({"role": "assistant", "content": [
            {"type": "thinking", "thinking": prose(300, i), "signature": "EqQBCkYIBxgCKkB".repeat(8)},
            {"type": "text", "text": prose(200, i + 5)},
            {"type": "tool_use", "id": format!("toolu_{i:024}"), "name": format!("Tool{}", i % 18),
             "input": {"file_path": format!("/workspace/src/file{i}.rs"), "content": prose(400, i)}}
        ]}));
        messages.push(json!({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": format!("toolu_{i:024}"),
             "content": [{"type": "text", "text": prose(1100, i + 9)}]}
        ]}));
    }
    json!({
        "model": "claude-sonnet-4-5",
        "max_tokens": 32000,
        "stream": true,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.abc; cc_entrypoint=cli; cch=1f2e3d;"},
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
            {"type": "text", "text": prose(30_000, 1), "cache_control": {"type": "ephemeral"}}
        ],
        "messages": messages,
        "tools": tools,
        "metadata": {"user_id": "user_0123456789abcdef_account__session_0f0f0f0f"},
        "thinking": {"type": "enabled", "budget_tokens": 31999},
        "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
        "temperature": 1
    })
}

struct Stats(Vec<Duration>);

impl Stats {
    fn measure(iterations: usize, mut f: impl FnMut()) -> Self {
        for _ in 0..iterations / 10 {
            f();
        }
        let mut times = Vec::with_capacity(iterations);
        for _ in 0..iterations {
            let t = Instant::now();
            f();
            times.push(t.elapsed());
        }
        times.sort_unstable();
        Stats(times)
    }

    fn at(&self, q: f64) -> f64 {
        let i = ((self.0.len() as f64 - 1.0) * q).round() as usize;
        self.0[i].as_secs_f64() * 1e6
    }

    fn row(&self, name: &str) {
        println!(
            "{name:<44} p50 {:>8.1} µs   p99 {:>8.1} µs   max {:>8.1} µs",
            self.at(0.5),
            self.at(0.99),
            self.at(1.0)
        );
    }
}

fn main() {
    let body = serde_json::to_vec(&claude_code_request()).unwrap();
    let req: MessagesRequest = serde_json::from_slice(&body).unwrap();
    let opts = ChatOptions {
        max_output_tokens: Some(16384),
        ..ChatOptions::default()
    };
    let chat = anthropic_into_chat(req.clone(), &opts).unwrap();
    let chat_bytes = serde_json::to_vec(&chat).unwrap();
    println!(
        "request: {} bytes Anthropic, {} messages, {} tools -> {} bytes chat\n",
        body.len(),
        req.messages.len(),
        req.tools.as_ref().map_or(0, Vec::len),
        chat_bytes.len()
    );
    let n = 3000;

    Stats::measure(n, || {
        let r: MessagesRequest = serde_json::from_slice(&body).unwrap();
        std::hint::black_box(r);
    })
    .row("parse Anthropic request");
    Stats::measure(n, || {
        let owned = req.clone();
        std::hint::black_box(anthropic_into_chat(owned, &opts).unwrap());
    })
    .row("clone + anthropic_into_chat");
    Stats::measure(n, || {
        std::hint::black_box(serde_json::to_vec(&chat).unwrap());
    })
    .row("serialize chat request");
    Stats::measure(n, || {
        let r: MessagesRequest = serde_json::from_slice(&body).unwrap();
        let c = anthropic_into_chat(r, &opts).unwrap();
        std::hint::black_box(serde_json::to_vec(&c).unwrap());
    })
    .row("bytes -> bytes (parse + translate + write)");
    let text = std::str::from_utf8(&body).unwrap();
    let borrowed = AnthropicBody::parse(text).expect("the borrowed path takes this request");
    assert_eq!(
        serde_json::from_slice::<Value>(&borrowed.write_chat(&opts, None)).unwrap(),
        serde_json::from_slice::<Value>(&chat_bytes).unwrap()
    );
    Stats::measure(n, || {
        std::hint::black_box(AnthropicBody::parse(text).unwrap());
    })
    .row("borrowed: parse Anthropic request");
    Stats::measure(n, || {
        std::hint::black_box(borrowed.write_chat(&opts, None));
    })
    .row("borrowed: translate + write chat request");
    Stats::measure(n, || {
        let text = std::str::from_utf8(&body).unwrap();
        let b = AnthropicBody::parse(text).unwrap();
        std::hint::black_box(b.response_options());
        std::hint::black_box(b.write_chat(&opts, None));
    })
    .row("borrowed: bytes -> bytes (+ response options)");
    Stats::measure(n, || {
        let v: Value = serde_json::from_slice(&body).unwrap();
        std::hint::black_box(serde_json::to_vec(&v).unwrap());
    })
    .row("baseline: serde_json::Value parse + write");

    // Streaming: a 2,000-chunk answer.
    let chunks: Vec<Vec<u8>> = (0..2000)
        .map(|i| {
            serde_json::to_vec(&json!({"id": "chatcmpl-1", "object": "chat.completion.chunk",
                "model": "m", "choices": [{"index": 0, "delta": {"content": format!("tok{i} ")}, "finish_reason": null}]}))
            .unwrap()
        })
        .collect();
    let stream = Stats::measure(200, || {
        let mut t = ChatStreamTranslator::new(ResponseOptions::default());
        let mut out = Vec::with_capacity(64 * 1024);
        for c in &chunks {
            let chunk: ChatChunk = serde_json::from_slice(c).unwrap();
            for e in t.push_chunk(chunk) {
                e.write_sse(&mut out).unwrap();
            }
        }
        std::hint::black_box(out);
    });
    println!(
        "{:<44} {:>8.2} µs per chunk (parse + translate + write SSE)",
        "stream translation",
        stream.at(0.5) / 2000.0
    );
    let mut sse = Vec::new();
    {
        let mut t = ChatStreamTranslator::new(ResponseOptions::default());
        for c in &chunks {
            for e in t.push_chunk(serde_json::from_slice(c).unwrap()) {
                e.write_sse(&mut sse).unwrap();
            }
        }
    }
    let meter = Stats::measure(200, || {
        let mut m = UsageMeter::event_stream();
        for piece in sse.chunks(1400) {
            m.feed(piece);
        }
        std::hint::black_box(m.finish());
    });
    println!(
        "{:<44} {:>8.1} MB/s ({} bytes of Anthropic SSE)",
        "usage meter",
        sse.len() as f64 / meter.at(0.5),
        sse.len()
    );
}
