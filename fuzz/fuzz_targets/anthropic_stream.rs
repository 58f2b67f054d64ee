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

/// Whether `event` (parsed from `data`) is as the format writes it. A known type whose body
/// does not parse falls back to `Other`, which the accumulator passes over; a `message_delta`
/// without `usage` reads as zero output to the accumulator and as no news to the meter. The
/// meter is lenient by design (it bills what the stream reports), so on such streams the two
/// need not agree.
fn well_formed(event: &StreamEvent, data: &str) -> bool {
    if let StreamEvent::Other(_) = event
        && KNOWN.contains(&event.event_name())
    {
        return false;
    }
    let Ok(v) = serde_json::from_str::<serde_json::Value>(data) else {
        return false;
    };
    match event.event_name() {
        "message_start" => v["message"].get("usage").is_some(),
        "message_delta" => v.get("delta").is_some() && v.get("usage").is_some(),
        _ => true,
    }
}

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
        if !well_formed(&event, &e.data) {
            return;
        }
        if acc.push(&event).is_err() {
            return;
        }
    }
    let Ok(message) = acc.finish() else {
        return;
    };
    let said = (message.usage.input_tokens, message.usage.output_tokens);
    if agentbox_wire::anthropic::is_estimate(&message.usage.extra) {
        // A translator's estimate: the meter's floors may bill more, never less.
        assert!(
            billed.input_tokens >= said.0 && billed.output_tokens >= said.1,
            "a stream's estimate is billed under what it says"
        );
    } else {
        assert_eq!(
            (billed.input_tokens, billed.output_tokens),
            said,
            "a well-formed stream is billed other than it says"
        );
    }
});
