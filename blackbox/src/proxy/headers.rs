//! The headers a call carries upstream: the client's, minus what the proxy owns (its routing
//! and identity headers, which a client could otherwise forge, and transport headers), then the
//! configured static upstream headers, then the proxy's own tags. Mirrors the reference's
//! `_build_upstream_headers`.

use axum::http::header::{self, HeaderMap, HeaderName, HeaderValue};

/// The headers every tagged model call carries (besides the sticky header, whose name is
/// configured).
pub const SESSION_ID: &str = "x-session-id";
pub const INSTANCE_ID: &str = "x-instance-id";
pub const TURN_ID: &str = "x-turn-id";
pub const SANDBOX_ID: &str = "x-dressage-sandbox-id";
pub const PARTIAL_ROLLOUT: &str = "x-dressage-partial-rollout";
pub const EXPECTED_VERSION: &str = "x-dressage-expected-version";

/// Never forwarded: hop-by-hop and framing headers (the upstream request has its own), and
/// `accept-encoding`: the proxy asks for identity bodies, since it reads and rewrites them and
/// its client does not decompress.
const TRANSPORT: [&str; 11] = [
    "host",
    "accept-encoding",
    "content-length",
    "transfer-encoding",
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authorization",
    "te",
    "trailer",
    "upgrade",
];

/// Not forwarded on model calls: the proxy sets these itself.
const OWNED: [&str; 6] = [
    SESSION_ID,
    INSTANCE_ID,
    TURN_ID,
    PARTIAL_ROLLOUT,
    EXPECTED_VERSION,
    SANDBOX_ID,
];

/// Not forwarded from Anthropic clients: their protocol headers mean nothing to a chat
/// completions router (`x-stainless-*` are dropped by prefix).
const ANTHROPIC_ONLY: [&str; 5] = [
    "anthropic-beta",
    "anthropic-dangerous-direct-browser-access",
    "anthropic-version",
    "x-app",
    "x-claude-code-session-id",
];

/// What kind of call the headers are for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallKind {
    /// Not a model call: forwarded with the client's headers, untagged.
    Plain,
    /// A model call from a chat or Responses client.
    Model,
    /// A model call from an Anthropic client.
    AnthropicModel,
}

/// The proxy's identity, as it tags calls.
#[derive(Debug, Clone)]
pub struct Tags {
    pub sticky_header: HeaderName,
    pub session_id: HeaderValue,
    pub instance_id: HeaderValue,
    pub sandbox_id: Option<HeaderValue>,
    /// Static headers for every upstream request (credentials for the router), validated.
    pub static_headers: Vec<(HeaderName, HeaderValue)>,
    /// `Authorization: Bearer <BBS_ROUTER_TOKEN>` (marked sensitive), on every router call; with
    /// it, the client's `authorization` and `x-api-key` are never forwarded.
    pub router_token: Option<HeaderValue>,
}

/// The upstream request's headers for a call.
pub fn upstream_headers(
    client: &HeaderMap,
    kind: CallKind,
    tags: &Tags,
    turn_id: Option<&str>,
    version: Option<&str>,
) -> HeaderMap {
    let model = kind != CallKind::Plain;
    let mut out = HeaderMap::with_capacity(client.len() + 8);
    for (name, value) in client {
        let n = name.as_str();
        if TRANSPORT.contains(&n) {
            continue;
        }
        if model && (OWNED.contains(&n) || *name == tags.sticky_header) {
            continue;
        }
        if tags.router_token.is_some() && (n == "authorization" || n == "x-api-key") {
            continue;
        }
        if kind == CallKind::AnthropicModel
            && (ANTHROPIC_ONLY.contains(&n) || n.starts_with("x-stainless-"))
        {
            continue;
        }
        out.append(name.clone(), value.clone());
    }
    for (name, value) in &tags.static_headers {
        out.insert(name.clone(), value.clone());
    }
    if let Some(t) = &tags.router_token {
        out.insert(header::AUTHORIZATION, t.clone());
    }
    if model {
        out.insert(tags.sticky_header.clone(), tags.session_id.clone());
        out.insert(SESSION_ID, tags.session_id.clone());
        out.insert(INSTANCE_ID, tags.instance_id.clone());
        if let Some(turn) = turn_id.and_then(|t| HeaderValue::from_str(t).ok()) {
            out.insert(TURN_ID, turn);
        }
        if let Some(sandbox) = &tags.sandbox_id {
            out.insert(SANDBOX_ID, sandbox.clone());
        }
        out.insert(PARTIAL_ROLLOUT, HeaderValue::from_static("1"));
        if let Some(v) = version.and_then(|v| HeaderValue::from_str(v).ok()) {
            out.insert(EXPECTED_VERSION, v);
        }
        out.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
    }
    out.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    out
}

/// The headers of a router control call (pause, resume).
pub fn control_headers(tags: &Tags, version: Option<&str>) -> HeaderMap {
    let mut out = HeaderMap::new();
    for (name, value) in &tags.static_headers {
        out.insert(name.clone(), value.clone());
    }
    if let Some(t) = &tags.router_token {
        out.insert(header::AUTHORIZATION, t.clone());
    }
    out.insert(SESSION_ID, tags.session_id.clone());
    out.insert(INSTANCE_ID, tags.instance_id.clone());
    if let Some(v) = version.and_then(|v| HeaderValue::from_str(v).ok()) {
        out.insert(EXPECTED_VERSION, v);
    }
    out.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    out
}

/// Response headers that are not copied from an upstream answer to the client (the body is
/// re-framed, and never compressed).
pub fn is_unforwarded_response_header(name: &HeaderName) -> bool {
    let n = name.as_str();
    TRANSPORT.contains(&n) || n == "content-encoding"
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn tags() -> Tags {
        Tags {
            sticky_header: HeaderName::from_static("x-smg-routing-key"),
            session_id: HeaderValue::from_static("sess-001"),
            instance_id: HeaderValue::from_static("inst-001"),
            sandbox_id: None,
            static_headers: Vec::new(),
            router_token: None,
        }
    }

    fn map(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn the_router_token_replaces_every_client_credential() {
        let client = map(&[
            ("authorization", "Bearer client-dummy"),
            ("x-api-key", "client-key"),
            ("x-custom", "kept"),
        ]);
        let mut t = tags();
        t.router_token = Some(HeaderValue::from_static("Bearer router-tok"));
        for kind in [CallKind::Model, CallKind::AnthropicModel, CallKind::Plain] {
            let h = upstream_headers(&client, kind, &t, Some("turn-1"), None);
            assert_eq!(h.get_all("authorization").iter().count(), 1);
            assert_eq!(h["authorization"], "Bearer router-tok");
            assert!(h.get("x-api-key").is_none());
            assert_eq!(h["x-custom"], "kept");
        }
        assert_eq!(
            control_headers(&t, None)["authorization"],
            "Bearer router-tok"
        );
    }

    #[test]
    fn bound_ids_replace_client_copies_and_untagged_calls_get_no_turn_header() {
        let client = map(&[
            ("authorization", "Bearer x"),
            ("x-session-id", "bad-session"),
            ("x-instance-id", "bad-instance"),
            ("x-turn-id", "bad-turn"),
            ("x-smg-routing-key", "bad-key"),
            ("x-dressage-partial-rollout", "0"),
            ("x-dressage-expected-version", "bad"),
            ("accept-encoding", "gzip, br"),
            ("host", "127.0.0.1:1"),
        ]);
        let h = upstream_headers(&client, CallKind::Model, &tags(), None, None);
        assert_eq!(h["authorization"], "Bearer x");
        assert_eq!(h["x-smg-routing-key"], "sess-001");
        assert_eq!(h["x-session-id"], "sess-001");
        assert_eq!(h["x-instance-id"], "inst-001");
        assert_eq!(h["x-dressage-partial-rollout"], "1");
        assert_eq!(h["accept-encoding"], "identity");
        assert!(h.get("x-turn-id").is_none());
        assert!(h.get("x-dressage-expected-version").is_none());
        assert!(h.get("host").is_none());
        for name in ["x-session-id", "x-smg-routing-key", "x-turn-id"] {
            assert!(h.get_all(name).iter().count() <= 1, "{name} not duplicated");
        }
        let h = upstream_headers(
            &client,
            CallKind::Model,
            &tags(),
            Some("turn-1"),
            Some("v7"),
        );
        assert_eq!(h["x-turn-id"], "turn-1");
        assert_eq!(h["x-dressage-expected-version"], "v7");
    }

    #[test]
    fn sticky_header_name_is_configurable() {
        let mut t = tags();
        t.sticky_header = HeaderName::from_static("x-route");
        t.sandbox_id = Some(HeaderValue::from_static("sb-1"));
        let client = map(&[("x-route", "forged"), ("x-dressage-sandbox-id", "forged")]);
        let h = upstream_headers(&client, CallKind::Model, &t, Some("t"), None);
        assert_eq!(h["x-route"], "sess-001");
        assert_eq!(h["x-dressage-sandbox-id"], "sb-1");
        assert!(h.get("x-smg-routing-key").is_none());
    }

    #[test]
    fn anthropic_protocol_headers_are_dropped_and_static_headers_win() {
        let mut t = tags();
        t.static_headers = vec![(
            HeaderName::from_static("authorization"),
            HeaderValue::from_static("Bearer backend"),
        )];
        let client = map(&[
            ("anthropic-beta", "x"),
            ("anthropic-version", "2023-06-01"),
            ("x-app", "cli"),
            ("x-claude-code-session-id", "c"),
            ("x-stainless-lang", "js"),
            ("authorization", "Bearer agent"),
            ("x-request-id", "r1"),
        ]);
        let h = upstream_headers(&client, CallKind::AnthropicModel, &t, None, None);
        for gone in [
            "anthropic-beta",
            "anthropic-version",
            "x-app",
            "x-claude-code-session-id",
            "x-stainless-lang",
        ] {
            assert!(h.get(gone).is_none(), "{gone}");
        }
        assert_eq!(h["authorization"], "Bearer backend");
        assert_eq!(h.get_all("authorization").iter().count(), 1);
        assert_eq!(h["x-request-id"], "r1");
    }

    #[test]
    fn plain_calls_are_not_tagged() {
        let client = map(&[("x-session-id", "client"), ("accept-encoding", "gzip")]);
        let h = upstream_headers(&client, CallKind::Plain, &tags(), Some("t"), None);
        assert_eq!(h["x-session-id"], "client");
        assert_eq!(h["accept-encoding"], "identity");
        assert!(h.get("x-smg-routing-key").is_none());
        assert!(h.get("x-dressage-partial-rollout").is_none());
    }
}
