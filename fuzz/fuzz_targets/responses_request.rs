//! An OpenAI Responses request (what Codex sends) from arbitrary bytes: parse, re-serialize
//! round trip, and the translation to chat under any options.
#![no_main]

use agentbox_fuzz::{chat_options, no_duplicate_members};
use agentbox_wire::responses::ResponsesRequest;
use agentbox_wire::translate::{ResponsesOptions, responses_into_chat};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u16, &[u8])| {
    let (bits, bytes) = input;
    let Ok(req) = serde_json::from_slice::<ResponsesRequest>(bytes) else {
        return;
    };
    let text = serde_json::to_vec(&req).expect("a parsed request serializes");
    let back: ResponsesRequest = serde_json::from_slice(&text).expect("own output parses");
    // A member named twice makes JSON itself ambiguous: the typed parse refuses it and keeps the
    // block opaque (translation then refuses a known block type as malformed), a `Value` keeps
    // the last. Only bodies without that ambiguity must round-trip exactly.
    if no_duplicate_members::<ResponsesRequest>(bytes, &req) {
        assert_eq!(req, back, "parse and serialize lost something");
    }

    let _ = ResponsesOptions::for_request(&req);
    if let Ok(chat) = responses_into_chat(req, &chat_options(bits)) {
        serde_json::to_vec(&chat).expect("a translated request serializes");
    }
});
