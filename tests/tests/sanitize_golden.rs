//! The passthrough sanitizer (`policy::sanitize::raw`, no `Value` tree, untouched members
//! copied as raw text) against the tree-based reference (`sanitize_request` on a
//! `serde_json::Value`, re-serialized): byte-equal output on the bench's Claude-Code-shaped
//! workload and on the recorded Claude Code requests, with the gateway's edits (`max_tokens`
//! cap) and the bridge's (`metadata.user_id` removed), and equal reports.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use agentbox_policy::sanitize::raw::{self, MaxTokens, Options};
use agentbox_policy::sanitize::{SanitizeError, sanitize_request};
use agentbox_tests::workload::claude_code_request;
use serde_json::{Value, json};

/// What the gateway and the bridge sent before: the tree sanitized, capped, stripped, written.
fn reference(body: &Value, o: &Options<'_>) -> (Vec<u8>, agentbox_policy::sanitize::Report) {
    let mut v = body.clone();
    let report = sanitize_request(&mut v, o.model, o.allow_url_sources).unwrap();
    if let (Some(cap), Some(n)) = (o.max_tokens_cap, v["max_tokens"].as_u64())
        && n > cap
    {
        v["max_tokens"] = json!(cap);
    }
    if o.strip_metadata_user_id
        && let Some(Value::Object(m)) = v.get_mut("metadata")
    {
        m.shift_remove("user_id");
    }
    (serde_json::to_vec(&v).unwrap(), report)
}

fn options() -> [Options<'static>; 3] {
    let plain = Options {
        model: "upstream-model",
        allow_url_sources: false,
        max_tokens_cap: None,
        strip_metadata_user_id: false,
        estimate: None,
    };
    [
        plain,
        // The gateway with a catalogue cap below the request's.
        Options {
            max_tokens_cap: Some(8192),
            ..plain
        },
        // The bridge for a model that does not forward user ids.
        Options {
            strip_metadata_user_id: true,
            allow_url_sources: true,
            ..plain
        },
    ]
}

fn assert_same(name: &str, body: &Value) {
    let bytes = serde_json::to_vec(body).unwrap();
    for o in options() {
        let (want, want_report) = reference(body, &o);
        let got = raw::parse(&bytes).unwrap().sanitize(&o).unwrap();
        // The one-scan entry point (the gateway's) gives the two steps' answer.
        let once = raw::sanitize(&bytes, &o).unwrap();
        assert!(once.body == got.body, "{name} with {o:?}: one scan differs");
        let pieces = raw::sanitize_to_pieces(&bytes, &o).unwrap();
        assert!(
            pieces.body.to_vec(&bytes) == got.body,
            "{name} with {o:?}: the pieces differ"
        );
        assert_eq!(once.report, got.report, "{name}");
        assert_eq!(
            (once.max_tokens, once.input_tokens),
            (got.max_tokens, got.input_tokens),
            "{name}"
        );
        assert!(
            got.body == want,
            "{name} with {o:?}: the output differs from the tree-based sanitizer's\n got: {}\nwant: {}",
            String::from_utf8_lossy(&got.body[..got.body.len().min(400)]),
            String::from_utf8_lossy(&want[..want.len().min(400)]),
        );
        assert_eq!(got.report, want_report, "{name}");
        let sent: Value = serde_json::from_slice(&got.body).unwrap();
        assert_eq!(
            got.max_tokens,
            MaxTokens::Value(sent["max_tokens"].as_u64().unwrap()),
            "{name}"
        );
    }
}

#[test]
fn the_workload_sanitizes_to_the_same_bytes() {
    for stream in [false, true] {
        let body = claude_code_request("claude-sonnet-4-5", stream);
        assert_same("workload", &body);
        // The edits the golden must show: model, context_management, the cap, user_id.
        let bytes = serde_json::to_vec(&body).unwrap();
        let got = raw::parse(&bytes).unwrap().sanitize(&options()[1]).unwrap();
        let sent: Value = serde_json::from_slice(&got.body).unwrap();
        assert_eq!(sent["model"], "upstream-model");
        assert_eq!(sent["max_tokens"], 8192);
        assert!(sent.get("context_management").is_none());
        assert_eq!(got.report.removed_fields, ["context_management"]);
        assert_eq!(
            got.report.requested_model.as_deref(),
            Some("claude-sonnet-4-5")
        );
    }
    // With a server tool and a tool_choice forcing it.
    let mut body = claude_code_request("m", true);
    body["tools"].as_array_mut().unwrap().insert(
        3,
        json!({"type": "web_search_20250305", "name": "web_search", "max_uses": 5}),
    );
    body["tool_choice"] = json!({"type": "tool", "name": "web_search"});
    assert_same("workload with a server tool", &body);
}

#[test]
fn the_recorded_claude_code_requests_sanitize_to_the_same_bytes() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/proxy/claude_code");
    let mut seen = 0;
    for entry in std::fs::read_dir(&root).unwrap() {
        let path = entry.unwrap().path().join("request.json");
        let recorded: Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        // Claude Code sends compact JSON: the body as it went over the wire.
        assert_same(&path.display().to_string(), &recorded["body"]);
        seen += 1;
    }
    assert_eq!(seen, 3, "the recorded requests under {}", root.display());
}

#[test]
fn a_duplicate_the_tree_would_collapse_is_refused() {
    // The tree keeps the last `source`; a parser keeping the first would fetch the URL. The
    // workload is big enough that the duplicate sits deep inside real-sized content.
    let body = claude_code_request("m", false);
    let text = serde_json::to_string(&body).unwrap();
    let marker = r#"{"type":"text","text":"Continue."}"#;
    assert!(text.contains(marker));
    let evil = text.replace(
        marker,
        r#"{"type":"image","source":{"type":"url","url":"https://evil.example/x"},"source":{"type":"base64","media_type":"image/png","data":"AAAA"}}"#,
    );
    let allow = Options {
        allow_url_sources: true,
        ..options()[0]
    };
    assert!(matches!(
        raw::parse(evil.as_bytes()).unwrap().sanitize(&allow),
        Err(SanitizeError::DuplicateKey(_))
    ));
    assert!(matches!(
        raw::sanitize(evil.as_bytes(), &allow),
        Err(SanitizeError::DuplicateKey(_))
    ));
}
