//! The bridge's `/v1/messages` path in process, as `bridge/src/routes.rs` and the engine's
//! `anthropic_via_chat` take it: JSON, `model` a string, `sanitize_request` for the upstream
//! model, `stream` a boolean, then the typed request translated to chat for an OpenAI provider
//! (the model's upstream name and output limit) and serialized. The bridge's own handler is
//! async and needs a provider; these are the steps it runs on the caller's bytes.
#![no_main]

use agentbox_policy::sanitize::sanitize_request;
use agentbox_wire::anthropic::MessagesRequest;
use agentbox_wire::translate::{ChatOptions, ResponseOptions, anthropic_into_chat};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|input: (bool, Option<u16>, &[u8])| {
    let (allow_urls, max_output, bytes) = input;
    let Ok(mut value) = serde_json::from_slice::<Value>(bytes) else {
        return;
    };
    let Some(Value::String(_)) = value.get("model") else {
        return;
    };
    if sanitize_request(&mut value, "gpt-up", allow_urls).is_err() {
        return;
    }
    match value.get("stream") {
        None | Some(Value::Null | Value::Bool(_)) => {}
        Some(_) => return,
    }
    // The Anthropic provider forwards the sanitized value as it is.
    serde_json::to_vec(&value).expect("a sanitized body serializes");
    let Ok(req) = serde_json::from_value::<MessagesRequest>(value) else {
        return;
    };
    let _ = ResponseOptions::for_request(&req);
    let opts = ChatOptions {
        model: Some("gpt-up".into()),
        max_output_tokens: max_output.map(u64::from),
        ..ChatOptions::default()
    };
    if let Ok(chat) = anthropic_into_chat(req, &opts) {
        assert_eq!(chat.model, "gpt-up");
        serde_json::to_vec(&chat).expect("a translated request serializes");
    }
});
