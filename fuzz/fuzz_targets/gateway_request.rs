//! The gateway's handling of a task's `/v1/messages` body and auth headers, in process: the
//! presented token, the JSON object check, `sanitize_request` (URL sources refused or allowed),
//! the `max_tokens` rule, the local token estimate and the reservation. Sanitizing is
//! idempotent: a sanitized body sanitizes to itself with nothing removed.
#![no_main]

use agentbox_gateway::estimate;
use agentbox_gateway::ledger::Reservation;
use agentbox_policy::config::Prices;
use agentbox_policy::sanitize::{refuse_url_sources, sanitize_request};
use agentbox_policy::secret::presented_token;
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

fuzz_target!(|input: (bool, u8, &[u8])| {
    let (allow_urls, auth, body) = input;
    // The same bytes as either header, so the corpus stays plain request bodies.
    let _ = presented_token(
        (auth & 1 != 0).then_some(body),
        (auth & 2 != 0).then_some(body),
    );
    let Ok(mut value) = serde_json::from_slice::<Value>(body) else {
        return;
    };
    if !value.is_object() {
        return;
    }
    let before = value.clone();
    match sanitize_request(&mut value, "upstream-model", allow_urls) {
        Err(_) => assert_eq!(value, before, "a refused body was changed"),
        Ok(_) => {
            if !allow_urls {
                refuse_url_sources(&value).expect("a sanitized body has no URL source");
            }
            let again_before = value.clone();
            let report = sanitize_request(&mut value, "upstream-model", allow_urls)
                .expect("a sanitized body sanitizes again");
            assert!(
                !report.removed_anything(),
                "sanitize is not idempotent: {report:?}"
            );
            assert_eq!(value, again_before, "sanitize is not idempotent");
            assert_eq!(value["model"], "upstream-model");
        }
    }
    let input_tokens = estimate::input_tokens(&value);
    if let Some(max) = value.get("max_tokens").and_then(Value::as_u64) {
        let prices = Prices {
            input_per_mtok: 3.0,
            output_per_mtok: 15.0,
            cache_read_per_mtok: 0.3,
            cache_write_per_mtok: 3.75,
        };
        let _ = Reservation::for_request(input_tokens, max, Some(&prices));
        let _ = Reservation::for_request(input_tokens, max, None);
    }
});
