//! blackbox-server's request handling in process: the bodies of register, messages, pause,
//! resume and execute_cmd through `routes::parse_body` (pydantic-style errors rendered), the
//! register checks (server_config ranges, router normalization, fingerprints, ids), and the
//! in-process LLM proxy's chat-body policy (`proxy::rewrite`: peek, then splice or rewrite),
//! whose output must be the client's JSON object with the policy's members set.
#![no_main]

use agentbox_blackbox::error::ApiError;
use agentbox_blackbox::hashing::{binding_fingerprint, messages_fingerprint, normalize_router};
use agentbox_blackbox::ids;
use agentbox_blackbox::model::{
    ExecuteCmdRequest, MessageRequest, PauseRequest, RegisterRequest, ResumeRequest,
};
use agentbox_blackbox::proxy::rewrite::{self, Edit, Policy};
use agentbox_blackbox::routes::parse_body;
use libfuzzer_sys::fuzz_target;
use serde_json::{Map, Value};

fn rendered<T>(r: Result<T, ApiError>) -> Option<T> {
    r.map_err(|e| e.render("req-fuzz")).ok()
}

fn proxy_policy(bytes: &[u8], bits: u8) {
    let policy = Policy {
        model_override: (bits & 1 != 0).then(|| "router-model".to_owned()),
        default_temperature: (bits & 2 != 0).then_some(0.7),
    };
    let Ok(peeked) = rewrite::peek(bytes, &policy) else {
        return;
    };
    let out: Map<String, Value> = match &peeked.edit {
        Edit::None => return,
        Edit::Add(members) => {
            let spliced = rewrite::splice(bytes, members);
            match serde_json::from_slice(&spliced) {
                Ok(Value::Object(m)) => m,
                other => panic!("splice made no JSON object: {other:?}"),
            }
        }
        Edit::Rewrite => {
            let Ok(Value::Object(mut map)) = serde_json::from_slice::<Value>(bytes) else {
                return;
            };
            rewrite::apply(&mut map, &policy);
            map
        }
    };
    // What goes upstream now complies: peeking it again asks for nothing.
    let again = serde_json::to_vec(&out).expect("a map serializes");
    let p = rewrite::peek(&again, &policy).expect("the rewritten body peeks");
    assert_eq!(
        p.edit,
        Edit::None,
        "the policy does not hold after its own edit"
    );
    assert_eq!(
        p.stream, peeked.stream,
        "the edit changed whether it streams"
    );
}

fuzz_target!(|input: (u8, &[u8])| {
    let (which, bytes) = input;
    match which % 6 {
        0 => {
            let Some(r) = rendered(parse_body::<RegisterRequest>(bytes)) else {
                return;
            };
            if let Some(o) = &r.server_config {
                let _ = o.violations();
            }
            for id in [
                &r.bound_session_id,
                &r.bound_instance_id,
                &r.bound_sandbox_id,
            ]
            .into_iter()
            .flatten()
            {
                let _ = ids::is_valid(id);
            }
            if let Ok((base, path)) = normalize_router(&r.router, &r.router_api_path) {
                assert!(path.starts_with('/'));
                let _ = binding_fingerprint(&r, &base, r.system_prompt_file.as_deref());
            }
        }
        1 => {
            if let Some(r) = rendered(parse_body::<MessageRequest>(bytes)) {
                let _ = messages_fingerprint(&r.messages);
            }
        }
        2 => {
            let _ = rendered(parse_body::<PauseRequest>(bytes));
        }
        3 => {
            let _ = rendered(parse_body::<ResumeRequest>(bytes));
        }
        4 => {
            let _ = rendered(parse_body::<ExecuteCmdRequest>(bytes));
        }
        _ => proxy_policy(bytes, which >> 4),
    }
});
