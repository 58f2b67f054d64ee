//! An Anthropic event stream as arbitrary SSE bytes (what the gateway forwards and meters):
//! events parsed and accumulated, the meter fed in pieces; a stream the accumulator accepts is
//! billed as it says.
#![no_main]

use agentbox_fuzz::{decode, pieces};
use agentbox_wire::anthropic::{StreamAccumulator, StreamEvent};
use agentbox_wire::usage::UsageMeter;
use libfuzzer_sys::fuzz_target;

/// The event types the wire format models; anything else is an `Other` the stream may carry.
const KNOWN: [&str; 8] = [
    "message_start",
    "content_block_start",
    "content_block_delta",
    "content_block_stop",
    "message_delta",
    "message_stop",
    "ping",
    "error",
];

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
        // A known type whose body does not parse falls back to `Other`, which the accumulator
        // passes over while the meter, lenient by design, still bills its usage: such a
        // stream is not well formed, so the two need not agree on it.
        if let StreamEvent::Other(_) = &event
            && KNOWN.contains(&event.event_name())
        {
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
