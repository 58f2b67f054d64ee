//! An upstream chat stream built from typed pieces (text, reasoning, tool-call starts and
//! argument fragments at any index, finish reasons, usage, errors, `[DONE]`, garbage), rendered
//! as chat chunks in SSE, cut into arbitrary pieces, then decoded and translated like
//! `chat_stream_sse`. The structure reaches the deep states of the translators that raw bytes
//! rarely do.
#![no_main]

use agentbox_fuzz::{decode, pieces, translate_chat_stream};
use agentbox_wire::translate::{ResponseOptions, ToolNames};
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use serde_json::{Value, json};

#[derive(Debug, Arbitrary)]
enum Finish {
    Stop,
    Length,
    ToolCalls,
    ContentFilter,
    Other(String),
}

#[derive(Debug, Arbitrary)]
enum Piece {
    Role,
    Text(String),
    Reasoning(String),
    Refusal(String),
    ToolStart {
        index: u8,
        id: Option<String>,
        name: Option<String>,
        args: Option<String>,
    },
    ToolArgs {
        index: u8,
        args: String,
    },
    Finish {
        reason: Finish,
        matched_stop: bool,
    },
    Usage {
        prompt: u32,
        completion: u32,
        cached: Option<u32>,
    },
    NoChoices,
    Error(String),
    Done,
    Raw(String),
}

#[derive(Debug, Arbitrary)]
struct Input {
    pieces: Vec<Piece>,
    choice_index: u8,
    crlf: bool,
    start_early: bool,
    long_tool_name: bool,
    seed: u32,
}

fn chunk(choices: Value, usage: Option<Value>) -> String {
    let mut c = json!({
        "id": "chatcmpl-f",
        "object": "chat.completion.chunk",
        "created": 1_700_000_000,
        "model": "up",
        "choices": choices,
    });
    if let Some(u) = usage {
        c["usage"] = u;
    }
    c.to_string()
}

fn data(p: &Piece, index: u8, long_name: &str) -> String {
    let choice = |delta: Value, finish: Value| json!([{"index": index, "delta": delta, "finish_reason": finish}]);
    match p {
        Piece::Role => chunk(choice(json!({"role": "assistant"}), Value::Null), None),
        Piece::Text(t) => chunk(choice(json!({"content": t}), Value::Null), None),
        Piece::Reasoning(t) => chunk(choice(json!({"reasoning_content": t}), Value::Null), None),
        Piece::Refusal(t) => chunk(choice(json!({"refusal": t}), Value::Null), None),
        Piece::ToolStart {
            index: i,
            id,
            name,
            args,
        } => {
            let name = name
                .as_deref()
                .map(|n| if n == "L" { long_name } else { n });
            let call = json!({"index": i, "id": id, "type": "function",
                "function": {"name": name, "arguments": args}});
            chunk(choice(json!({"tool_calls": [call]}), Value::Null), None)
        }
        Piece::ToolArgs { index: i, args } => {
            let call = json!({"index": i, "function": {"arguments": args}});
            chunk(choice(json!({"tool_calls": [call]}), Value::Null), None)
        }
        Piece::Finish {
            reason,
            matched_stop,
        } => {
            let r = match reason {
                Finish::Stop => "stop",
                Finish::Length => "length",
                Finish::ToolCalls => "tool_calls",
                Finish::ContentFilter => "content_filter",
                Finish::Other(s) => s,
            };
            let mut c = choice(json!({}), json!(r));
            if *matched_stop {
                c[0]["matched_stop"] = json!("STOP");
            }
            chunk(c, None)
        }
        Piece::Usage {
            prompt,
            completion,
            cached,
        } => {
            let mut u = json!({"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": u64::from(*prompt) + u64::from(*completion)});
            if let Some(c) = cached {
                u["prompt_tokens_details"] = json!({"cached_tokens": c});
            }
            chunk(json!([]), Some(u))
        }
        Piece::NoChoices => chunk(json!([]), None),
        Piece::Error(m) => json!({"error": {"message": m, "type": "server_error"}}).to_string(),
        Piece::Done => "[DONE]".to_owned(),
        Piece::Raw(s) => s.clone(),
    }
}

fuzz_target!(|input: Input| {
    let long_name = "t".repeat(80);
    let eol = if input.crlf { "\r\n" } else { "\n" };
    let mut sse = String::new();
    for p in &input.pieces {
        // A raw piece may hold line breaks: one `data:` line per line, as a server would.
        for line in data(p, input.choice_index % 2, &long_name).split('\n') {
            sse.push_str("data: ");
            sse.push_str(line.trim_end_matches('\r'));
            sse.push_str(eol);
        }
        sse.push_str(eol);
    }
    let Some(events) = decode(&pieces(sse.as_bytes(), input.seed), 1 << 20) else {
        return;
    };
    let datas: Vec<String> = events.into_iter().map(|e| e.data).collect();
    let mut tool_names = ToolNames::default();
    if input.long_tool_name {
        tool_names.add(&long_name);
    }
    let opts = ResponseOptions {
        model: Some("claude-x".into()),
        message_id: None,
        tool_names,
        stop_sequences: vec!["STOP".into()],
        input_tokens_estimate: 5,
    };
    translate_chat_stream(&datas, opts, input.start_early);
});
