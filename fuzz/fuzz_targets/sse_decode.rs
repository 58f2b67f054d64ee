//! The SSE decoder on arbitrary bytes: any split of the same bytes decodes to the same events
//! (or the same refusal), and what the encoder writes for those events decodes back to them.
#![no_main]

use agentbox_fuzz::{decode, encode, pieces};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u16, u32, &[u8])| {
    let (limit, seed, bytes) = input;
    let limit = usize::from(limit).max(1);
    let whole = decode(&[bytes], limit);
    let split = decode(&pieces(bytes, seed), limit);
    let bytewise: Vec<&[u8]> = bytes.chunks(1).collect();
    assert_eq!(whole, split, "a split changed what the decoder saw");
    assert_eq!(whole, decode(&bytewise, limit), "byte-by-byte differs");
    if let Some(events) = whole {
        let again = decode(&[&encode(&events)], usize::MAX).expect("own encoding refused");
        assert_eq!(events.len(), again.len(), "re-encoded event count");
        for (a, b) in events.iter().zip(&again) {
            assert_eq!(a.event, b.event, "event name");
            assert_eq!(a.data, b.data, "data");
        }
    }
});
