//! What metering costs per streamed answer: the Anthropic and chat meters fed a stream of
//! one-token deltas (the shape a model streams), each frame its own chunk, as the gateway feeds
//! them. Prints a Markdown table of ns per answer and per delta, the best of several rounds
//! (the least disturbed by other work on the machine). `cargo bench -p agentbox-wire --bench meter`.

use std::hint::black_box;
use std::time::Instant;

use agentbox_wire::usage::{BodyKind, UsageMeter};

const ROUNDS: usize = 15;
const ANSWERS: usize = 200;

fn anthropic(deltas: usize) -> Vec<String> {
    let mut frames = vec![
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_01XFDUDYJgAACzvnptvVoYEL\",\"type\":\"message\",\"role\":\"assistant\",\"content\":[],\"model\":\"claude-sonnet-4-5\",\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":2095,\"cache_creation_input_tokens\":0,\"cache_read_input_tokens\":40000,\"output_tokens\":1}}}\n\n".to_owned(),
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n".to_owned(),
    ];
    for i in 0..deltas {
        frames.push(format!("event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":\" word{}\"}}}}\n\n", i % 10));
    }
    frames.push(
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n"
            .to_owned(),
    );
    frames.push(format!("event: message_delta\ndata: {{\"type\":\"message_delta\",\"delta\":{{\"stop_reason\":\"end_turn\",\"stop_sequence\":null}},\"usage\":{{\"output_tokens\":{deltas}}}}}\n\n"));
    frames.push("event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n".to_owned());
    frames
}

fn chat(deltas: usize) -> Vec<String> {
    let mut frames = Vec::new();
    for i in 0..deltas {
        frames.push(format!("data: {{\"id\":\"chatcmpl-9f8e7d6c5b4a39281706\",\"object\":\"chat.completion.chunk\",\"created\":1733000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\" word{}\"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n", i % 10));
    }
    frames.push(format!("data: {{\"id\":\"chatcmpl-9f8e7d6c5b4a39281706\",\"object\":\"chat.completion.chunk\",\"created\":1733000000,\"model\":\"gpt-4o-mini-2024-07-18\",\"choices\":[],\"usage\":{{\"prompt_tokens\":2095,\"completion_tokens\":{deltas},\"total_tokens\":{}}}}}\n\n", 2095 + deltas));
    frames.push("data: [DONE]\n\n".to_owned());
    frames
}

/// The best ns per answer over the rounds.
fn measure(frames: &[String], meter: impl Fn() -> UsageMeter) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..ROUNDS {
        let start = Instant::now();
        for _ in 0..ANSWERS {
            let mut m = meter();
            for f in frames {
                m.feed(black_box(f.as_bytes()));
            }
            black_box(m.finish());
        }
        best = best.min(start.elapsed().as_nanos() as f64 / ANSWERS as f64);
    }
    best
}

fn main() {
    println!("| stream | deltas | ns per answer | ns per delta |");
    println!("|---|---|---|---|");
    for deltas in [10, 400] {
        let a = measure(&anthropic(deltas), UsageMeter::event_stream);
        println!(
            "| Anthropic | {deltas} | {a:.0} | {:.0} |",
            a / deltas as f64
        );
        let c = measure(&chat(deltas), || UsageMeter::chat(BodyKind::EventStream));
        println!("| chat | {deltas} | {c:.0} | {:.0} |", c / deltas as f64);
    }
}
