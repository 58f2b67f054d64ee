//! An Anthropic event stream as arbitrary SSE bytes (what the gateway forwards and meters):
//! events parsed and accumulated, the meter fed in pieces; a stream the accumulator accepts is
//! billed as it says.
#![no_main]

use agentbox_fuzz::{decode, pieces};
use agentbox_wire::anthropic::{StreamAccumulator, StreamEvent};
use agentbox_wire::usage::UsageMeter;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u32, &[u8])| {
    let (seed, bytes) = input;
    let chunks = pieces(bytes, seed);
    let mut meter = UsageMeter::event_stream();
    for c in &chunks {
        meter.feed(c);
    }
    let billed = meter.finish().billable_usage();
    let Some(events) = decode(&chunks, 1 << 20) else {
        return;
    };
    let mut acc = StreamAccumulator::new();
    for e in &events {
        let Ok(event) = serde_json::from_str::<StreamEvent>(&e.data) else {
            return;
        };
        if !e.event.is_empty() && e.event != event.event_name() {
            return;
        }
        if acc.push(&event).is_err() {
            return;
        }
    }
    let Ok(message) = acc.finish() else {
        return;
    };
    assert_eq!(
        (billed.input_tokens, billed.output_tokens),
        (message.usage.input_tokens, message.usage.output_tokens),
        "a well-formed stream is billed other than it says"
    );
});
