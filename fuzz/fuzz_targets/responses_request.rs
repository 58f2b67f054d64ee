//! An OpenAI Responses request (what Codex sends) from arbitrary bytes: parse, re-serialize
//! round trip, and the translation to chat under any options.
#![no_main]

use agentbox_fuzz::{chat_options, parsed_round_trip};
use agentbox_wire::responses::ResponsesRequest;
use agentbox_wire::translate::{ResponsesOptions, responses_into_chat};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u16, &[u8])| {
    let (bits, bytes) = input;
    let Some(req) = parsed_round_trip::<ResponsesRequest>(bytes) else {
        return;
    };
    let _ = ResponsesOptions::for_request(&req);
    if let Ok(chat) = responses_into_chat(req, &chat_options(bits)) {
        serde_json::to_vec(&chat).expect("a translated request serializes");
    }
});
