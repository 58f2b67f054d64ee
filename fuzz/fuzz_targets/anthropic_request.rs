//! An Anthropic Messages request from arbitrary bytes: a parsed request re-serializes to the
//! same request (unknown fields survive), and translating it to chat under any options either
//! refuses with a typed error or gives a chat request that serializes.
#![no_main]

use agentbox_fuzz::{chat_options, parsed_round_trip};
use agentbox_wire::anthropic::MessagesRequest;
use agentbox_wire::normalize;
use agentbox_wire::translate::{ResponseOptions, anthropic_into_chat};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u16, &[u8])| {
    let (bits, bytes) = input;
    let Some(req) = parsed_round_trip::<MessagesRequest>(bytes) else {
        return;
    };
    let _ = ResponseOptions::for_request(&req);
    let mut folded = req.clone();
    normalize::fold_inline_system(&mut folded);
    normalize::strip_billing_header(&mut folded);
    if let Ok(chat) = anthropic_into_chat(req, &chat_options(bits)) {
        serde_json::to_vec(&chat).expect("a translated request serializes");
    }
});
