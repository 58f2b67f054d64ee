//! Fingerprints that decide idempotency: of a registration (same hash while ready = no-op,
//! another hash = rebind) and of a turn's messages (same `turn_id` and hash = replay, another
//! hash = 409). The hash is SHA-256 of a canonical JSON text: object keys sorted, `null`
//! members dropped, so key order and explicit nulls in a retry do not make it a new request.
//! Also the router URL normalization the binding reports.

use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::model::{Message, RegisterRequest};

/// `value` with object keys sorted and `null` members removed, recursively.
#[must_use]
pub fn canonicalize(value: &Value) -> Value {
    match value {
        Value::Object(map) => {
            let mut keys: Vec<&String> = map.keys().collect();
            keys.sort();
            let mut out = Map::new();
            for k in keys {
                if let Some(v) = map.get(k).filter(|v| !v.is_null()) {
                    out.insert(k.clone(), canonicalize(v));
                }
            }
            Value::Object(out)
        }
        Value::Array(items) => Value::Array(items.iter().map(canonicalize).collect()),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => value.clone(),
    }
}

/// Hex SHA-256 of the canonical JSON of `value`.
#[must_use]
pub fn sha256_hex(value: &Value) -> String {
    let text = canonicalize(value).to_string();
    hex::encode(Sha256::digest(text.as_bytes()))
}

/// The router as the binding reports it: `(base_url, api_path)`. A bare `host:port` gets
/// `http://`; a URL with a path keeps it as the API path, else `router_api_path` (default
/// `/v1`) is used.
///
/// # Errors
/// When the router has no host.
pub fn normalize_router(router: &str, router_api_path: &str) -> Result<(String, String), String> {
    let raw = router.trim();
    let with_scheme = if raw.contains("://") {
        raw.to_owned()
    } else {
        format!("http://{raw}")
    };
    let url =
        url::Url::parse(&with_scheme).map_err(|_| format!("Invalid router value: {router}"))?;
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| format!("Invalid router value: {router}"))?;
    let authority = match url.port() {
        Some(p) => format!("{host}:{p}"),
        None => host.to_owned(),
    };
    let given_path = url.path();
    let mut path = if given_path.is_empty() || given_path == "/" && !raw.ends_with('/') {
        if router_api_path.is_empty() {
            "/v1".to_owned()
        } else {
            router_api_path.to_owned()
        }
    } else {
        given_path.to_owned()
    };
    if !path.starts_with('/') {
        path.insert(0, '/');
    }
    let base = format!("{}://{authority}{path}", url.scheme());
    Ok((base.trim_end_matches('/').to_owned(), path))
}

/// The registration's fingerprint: everything that, changed, needs a new agent.
#[must_use]
pub fn binding_fingerprint(
    request: &RegisterRequest,
    router_base_url: &str,
    system_prompt_file: Option<&str>,
) -> String {
    let server_config = request
        .server_config
        .as_ref()
        .and_then(|o| serde_json::to_value(o).ok())
        .unwrap_or_else(|| Value::Object(Map::new()));
    sha256_hex(&serde_json::json!({
        "blackbox_type": request.blackbox_type,
        "router_base_url": router_base_url,
        "bound_session_id": request.bound_session_id,
        "bound_instance_id": request.bound_instance_id,
        "bound_sandbox_id": request.bound_sandbox_id,
        "system_prompt_file": system_prompt_file,
        "backend_options": request.backend_options,
        "server_config": server_config,
    }))
}

/// A turn's fingerprint: its messages without their `null` fields.
#[must_use]
pub fn messages_fingerprint(messages: &[Message]) -> String {
    sha256_hex(&serde_json::to_value(messages).unwrap_or(Value::Null))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Role;
    use serde_json::json;

    #[test]
    fn key_order_and_nulls_do_not_change_the_hash() {
        let a = json!({"b": 1, "a": {"y": null, "x": [1, {"k": null}]}});
        let b = json!({"a": {"x": [1, {}]}, "b": 1});
        assert_eq!(sha256_hex(&a), sha256_hex(&b));
        assert_ne!(sha256_hex(&a), sha256_hex(&json!({"b": 2})));
    }

    #[test]
    fn message_fingerprint_sees_every_field() {
        let m = |reasoning: &str| Message {
            reasoning_content: Some(reasoning.into()),
            ..Message::text(Role::User, Some("hello".into()))
        };
        assert_ne!(
            messages_fingerprint(&[m("first")]),
            messages_fingerprint(&[m("second")])
        );
        assert_eq!(
            messages_fingerprint(&[m("same")]),
            messages_fingerprint(&[m("same")])
        );
    }

    #[test]
    fn routers_normalize_like_the_reference() {
        let n = |r: &str, p: &str| normalize_router(r, p).unwrap();
        assert_eq!(
            n("127.0.0.1:30000", "/v1"),
            ("http://127.0.0.1:30000/v1".into(), "/v1".into())
        );
        assert_eq!(
            n("http://router:8000/api", "/v1"),
            ("http://router:8000/api".into(), "/api".into())
        );
        assert_eq!(
            n("https://router", "v2"),
            ("https://router/v2".into(), "/v2".into())
        );
        assert!(normalize_router("http://", "/v1").is_err());
    }
}
