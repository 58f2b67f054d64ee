//! An Anthropic Messages request from arbitrary bytes: a parsed request re-serializes to the
//! same request (unknown fields survive), and translating it to chat under any options either
//! refuses with a typed error or gives a chat request that serializes. Where the borrowed
//! translation ([`AnthropicBody`]) takes the bytes, it gives the owned path's chat request and
//! answer options.
#![no_main]

use agentbox_fuzz::{chat_options, no_duplicate_members, parsed_round_trip};
use agentbox_wire::anthropic::MessagesRequest;
use agentbox_wire::normalize;
use agentbox_wire::translate::{AnthropicBody, ResponseOptions, anthropic_into_chat};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u16, &[u8])| {
    let (bits, bytes) = input;
    borrowed_agrees(bits, bytes);
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

fn borrowed_agrees(bits: u16, bytes: &[u8]) {
    let Some(body) = std::str::from_utf8(bytes).ok().and_then(AnthropicBody::parse) else {
        return;
    };
    let owned = match serde_json::from_slice::<MessagesRequest>(bytes) {
        Ok(owned) => owned,
        // The one refusal the borrowed path does not repeat (its module docs): a number beyond
        // f64's range in a member it never reads.
        Err(e) if e.to_string().contains("number out of range") => return,
        Err(e) => panic!("the borrowed path took a body the owned one refuses: {e}"),
    };
    assert_eq!(body.response_options(), ResponseOptions::for_request(&owned));
    let opts = chat_options(bits);
    let written = body.write_chat(&opts, None);
    let fast: serde_json::Value =
        serde_json::from_slice(&written).expect("the borrowed path writes JSON");
    // Duplicate members inside a tool input are kept as written, where a parsed value keeps
    // the last.
    let compare = no_duplicate_members(bytes, &owned);
    let chat = anthropic_into_chat(owned, &opts)
        .expect("the owned path translates what the borrowed one takes");
    if compare {
        assert_eq!(fast, serde_json::to_value(&chat).expect("serializes"));
    }
}
