//! An upstream chat stream as arbitrary SSE bytes in arbitrary pieces, through the decoder and
//! both stream translators (to Anthropic events and to Responses events); the Anthropic output
//! must keep the stream contract and bill what it carries.
#![no_main]

use agentbox_fuzz::{decode, pieces, translate_chat_stream};
use agentbox_wire::translate::ResponseOptions;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (bool, u32, &[u8])| {
    let (start_early, seed, bytes) = input;
    let Some(events) = decode(&pieces(bytes, seed), 1 << 20) else {
        return;
    };
    let datas: Vec<String> = events.into_iter().map(|e| e.data).collect();
    let opts = ResponseOptions {
        model: Some("claude-x".into()),
        stop_sequences: vec!["STOP".into()],
        input_tokens_estimate: 3,
        ..ResponseOptions::default()
    };
    translate_chat_stream(&datas, opts, start_early);
});
