//! An upstream answer from arbitrary bytes: a chat completion translated to an Anthropic
//! message and to a Responses response, and the same bytes read as an upstream error body.
#![no_main]

use agentbox_wire::chat::ChatResponse;
use agentbox_wire::error::{anthropic_error_from_openai, client_error_for_upstream};
use agentbox_wire::translate::{
    ResponseOptions, ResponsesOptions, chat_to_anthropic_response, chat_to_responses_response,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|input: (u16, bool, &[u8])| {
    let (status, with_opts, bytes) = input;
    let _ = client_error_for_upstream(status, bytes);
    let _ = anthropic_error_from_openai(status, bytes);
    let Ok(resp) = serde_json::from_slice::<ChatResponse>(bytes) else {
        return;
    };
    let opts = if with_opts {
        ResponseOptions {
            model: Some("claude-x".into()),
            message_id: Some("msg_1".into()),
            stop_sequences: vec!["STOP".into(), String::new()],
            input_tokens_estimate: 7,
            ..ResponseOptions::default()
        }
    } else {
        ResponseOptions::default()
    };
    if let Ok(m) = chat_to_anthropic_response(resp.clone(), &opts) {
        serde_json::to_vec(&m).expect("a translated message serializes");
    }
    if let Ok(r) = chat_to_responses_response(resp, &ResponsesOptions::default()) {
        serde_json::to_vec(&r).expect("a translated response serializes");
    }
});
