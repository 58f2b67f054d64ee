//! The usage meter on an arbitrary answer body (event stream or JSON), fed in arbitrary pieces:
//! never panics, and the split does not change the count.
#![no_main]

use agentbox_fuzz::pieces;
use agentbox_wire::usage::{UsageMeter, usage_from_json};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (bool, u32, &[u8])| {
    let (stream, seed, bytes) = input;
    let meter = || {
        if stream {
            UsageMeter::event_stream()
        } else {
            UsageMeter::json()
        }
    };
    let mut whole = meter();
    whole.feed(bytes);
    let mut split = meter();
    for p in pieces(bytes, seed) {
        split.feed(p);
        let _ = split.usage();
    }
    let (whole, split) = (whole.finish(), split.finish());
    assert_eq!(
        whole.billable_usage(),
        split.billable_usage(),
        "a split changed the meter"
    );
    if !stream {
        let _ = usage_from_json(bytes).billable_usage();
    }
});
