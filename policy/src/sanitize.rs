//! The Anthropic Messages request sanitizer shared by the gateway and the bridge: the model is
//! whatever the operator mapped, and nothing in the request may make the upstream run tools or
//! reach services on the caller's behalf.
//!
//! Removed: every tool whose `type` is present and is not `"custom"` (server-side tools such as
//! `web_search_*`, `web_fetch_*`, `code_execution_*`, which run on the provider's side and
//! reach the internet; tools without `type` are ordinary client tools and stay), and the
//! top-level `mcp_servers`, `container` and `context_management`. Everything else is kept as it
//! came, in its original order, unknown fields included, so new API fields keep working.
//!
//! When removal leaves no tools, the `tools` key is dropped together with `tool_choice`: an
//! upstream refuses `tool_choice` of `any`/`tool` without tools, and a request that only asked
//! for a server tool reads best as a plain completion. A `tool_choice` that forces a removed
//! tool by name is dropped too (the model then chooses freely) rather than failing the whole
//! request. A `tools: []` that arrived empty is left alone: nothing was removed.
//!
//! Media whose `source` is `{"type": "url", ...}` (images, documents, any block at any depth
//! of `system` and `messages`, `tool_result` content included) is refused by
//! [`refuse_url_sources`] unless the model's `allow_url_sources` says otherwise: the provider
//! would fetch the URL, so an agent could carry workspace data out in it, and the gateway
//! cannot know what the fetched content costs.
//!
//! Two implementations of these rules. [`raw`] is what the gateway and the bridge run: the
//! body is split at its top level into raw members, every member is walked once without
//! building a tree, and untouched members go upstream as the client's own bytes. Its
//! invariant: **what goes upstream is exactly what was checked**: parsed once, duplicate keys
//! refused at every depth (so no parser, whichever duplicate it keeps, can read a value we did
//! not check), untouched members copied verbatim, edited members written by us. The
//! functions on `serde_json::Value` here ([`sanitize`], [`sanitize_request`],
//! [`sanitize_bytes`]) are the reference: the tree re-serialized from the parsed value, where
//! duplicate keys collapse to the last one; `raw`'s output equals theirs for every compact
//! body without duplicates (its golden tests), and the bridge's typed path and the fuzz
//! targets use them.

use serde_json::{Map, Value};
use std::fmt::Write as _;

pub mod raw;

/// Top-level fields that configure provider-side execution, removed from every request.
pub const REMOVED_FIELDS: [&str; 3] = ["mcp_servers", "container", "context_management"];

/// Why a body could not be sanitized. The body is left untouched when this is returned.
#[derive(Debug, thiserror::Error)]
pub enum SanitizeError {
    #[error("request body is not valid json: {0}")]
    Json(#[from] serde_json::Error),
    #[error("request body has a duplicate key: {0}")]
    DuplicateKey(serde_json::Error),
    #[error("request body must be a json object, got {found}")]
    NotAnObject { found: &'static str },
    #[error("tools must be an array, got {found}")]
    ToolsNotArray { found: &'static str },
    #[error("tools[{index}] must be an object, got {found}")]
    ToolNotObject { index: usize, found: &'static str },
    #[error(
        "{path}: content with a url source is refused (the provider would fetch it); send it as \
         base64, or allow url sources for this model (allow_url_sources)"
    )]
    UrlSource { path: String },
}

/// A tool that was removed, for logs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemovedTool {
    /// The tool's `name`, when it was a string.
    pub name: Option<String>,
    /// The tool's `type`: the string itself, or compact JSON when it was not a string.
    pub tool_type: String,
}

/// What the sanitizer changed besides the model.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Report {
    /// The `model` the client asked for, when it was a string.
    pub requested_model: Option<String>,
    pub removed_tools: Vec<RemovedTool>,
    /// Which of [`REMOVED_FIELDS`] were present and removed.
    pub removed_fields: Vec<&'static str>,
    /// `tools` was removed because nothing was left in it.
    pub tools_key_removed: bool,
    pub tool_choice_removed: bool,
}

impl Report {
    /// Whether anything besides the model was removed.
    pub fn removed_anything(&self) -> bool {
        !self.removed_tools.is_empty()
            || !self.removed_fields.is_empty()
            || self.tools_key_removed
            || self.tool_choice_removed
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// A tool is server-side when it carries a `type` other than `"custom"`.
fn is_server_tool(tool: &Map<String, Value>) -> bool {
    match tool.get("type") {
        None => false,
        Some(Value::String(t)) => t != "custom",
        Some(_) => true,
    }
}

/// Sanitizes a parsed request in place: rewrites `model` (in its position, or appended when the
/// client sent none), removes server-side tools and the [`REMOVED_FIELDS`].
pub fn sanitize(body: &mut Value, model: &str) -> Result<Report, SanitizeError> {
    let found = json_type(body);
    let Value::Object(obj) = body else {
        return Err(SanitizeError::NotAnObject { found });
    };
    // Validate everything first so an error leaves the body untouched.
    if let Some(tools) = obj.get("tools") {
        let Value::Array(list) = tools else {
            return Err(SanitizeError::ToolsNotArray {
                found: json_type(tools),
            });
        };
        for (index, tool) in list.iter().enumerate() {
            if !tool.is_object() {
                return Err(SanitizeError::ToolNotObject {
                    index,
                    found: json_type(tool),
                });
            }
        }
    }

    let mut report = Report::default();
    match obj.get_mut("model") {
        Some(slot) => {
            if let Value::String(old) = slot {
                report.requested_model = Some(std::mem::take(old));
            }
            *slot = Value::String(model.to_owned());
        }
        None => {
            obj.insert("model".to_owned(), Value::String(model.to_owned()));
        }
    }

    let mut now_empty = false;
    if let Some(Value::Array(list)) = obj.get_mut("tools") {
        let before = list.len();
        let mut kept = Vec::with_capacity(before);
        for tool in list.drain(..) {
            match &tool {
                Value::Object(t) if is_server_tool(t) => {
                    report.removed_tools.push(RemovedTool {
                        name: t.get("name").and_then(Value::as_str).map(str::to_owned),
                        tool_type: match t.get("type") {
                            Some(Value::String(s)) => s.clone(),
                            Some(other) => other.to_string(),
                            None => String::new(),
                        },
                    });
                }
                Value::Object(_)
                | Value::Null
                | Value::Bool(_)
                | Value::Number(_)
                | Value::String(_)
                | Value::Array(_) => kept.push(tool),
            }
        }
        now_empty = kept.is_empty() && before > 0;
        *list = kept;
    }

    if now_empty {
        obj.shift_remove("tools");
        report.tools_key_removed = true;
        report.tool_choice_removed = obj.shift_remove("tool_choice").is_some();
    } else if forces_removed_tool(obj, &report.removed_tools) {
        obj.shift_remove("tool_choice");
        report.tool_choice_removed = true;
    }

    for field in REMOVED_FIELDS {
        // shift_remove, not remove: with preserve_order, `remove` swaps the last key into the
        // hole and would reorder the request.
        if obj.shift_remove(field).is_some() {
            report.removed_fields.push(field);
        }
    }
    Ok(report)
}

/// Whether `tool_choice` is `{"type": "tool", "name": N}` with `N` a removed tool and not one
/// that is still present.
fn forces_removed_tool(obj: &Map<String, Value>, removed: &[RemovedTool]) -> bool {
    let Some(Value::Object(choice)) = obj.get("tool_choice") else {
        return false;
    };
    if choice.get("type").and_then(Value::as_str) != Some("tool") {
        return false;
    }
    let Some(name) = choice.get("name").and_then(Value::as_str) else {
        return false;
    };
    let still_present = obj
        .get("tools")
        .and_then(Value::as_array)
        .is_some_and(|tools| {
            tools
                .iter()
                .any(|t| t.get("name").and_then(Value::as_str) == Some(name))
        });
    !still_present && removed.iter().any(|r| r.name.as_deref() == Some(name))
}

/// Refuses a request carrying any block whose `source.type` is `"url"` anywhere in `system` or
/// `messages` (nested `tool_result` content included). The `input` of tool calls is the
/// model's own data, not content the provider fetches, and is not inspected.
pub fn refuse_url_sources(body: &Value) -> Result<(), SanitizeError> {
    for key in ["system", "messages"] {
        if let Some(v) = body.get(key) {
            find_url_source(v, &mut key.to_owned())?;
        }
    }
    Ok(())
}

/// [`refuse_url_sources`]'s rule for one object found at `path` (a block, or the fields of
/// one a caller holds typed): the bridge walks its typed request and hands the maps it holds
/// here.
pub fn refuse_url_sources_in(
    obj: &Map<String, Value>,
    path: &mut String,
) -> Result<(), SanitizeError> {
    if let Some(Value::Object(source)) = obj.get("source")
        && source.get("type").and_then(Value::as_str) == Some("url")
    {
        return Err(SanitizeError::UrlSource {
            path: format!("{path}.source"),
        });
    }
    let tool_call = matches!(
        obj.get("type").and_then(Value::as_str),
        Some("tool_use" | "server_tool_use")
    );
    for (k, child) in obj {
        if tool_call && k == "input" {
            continue;
        }
        let len = path.len();
        path.push('.');
        path.push_str(k);
        find_url_source(child, path)?;
        path.truncate(len);
    }
    Ok(())
}

fn find_url_source(v: &Value, path: &mut String) -> Result<(), SanitizeError> {
    match v {
        Value::Object(obj) => refuse_url_sources_in(obj, path),
        Value::Array(items) => each_indexed(items, path, find_url_source),
        Value::Null | Value::Bool(_) | Value::Number(_) | Value::String(_) => Ok(()),
    }
}

/// Runs `f` on each item with `[i]` appended to `path` (the URL-source walks' list step).
pub fn each_indexed<T>(
    items: &[T],
    path: &mut String,
    mut f: impl FnMut(&T, &mut String) -> Result<(), SanitizeError>,
) -> Result<(), SanitizeError> {
    for (i, item) in items.iter().enumerate() {
        let len = path.len();
        // Written in place: this runs for every array element of every request.
        let _ = write!(path, "[{i}]");
        f(item, path)?;
        path.truncate(len);
    }
    Ok(())
}

/// What the gateway and the bridge do to every request before it goes upstream: refuse media
/// with URL sources unless `allow_url_sources` (the model's setting), then [`sanitize`] for
/// `model`. A refused body is left untouched.
pub fn sanitize_request(
    body: &mut Value,
    model: &str,
    allow_url_sources: bool,
) -> Result<Report, SanitizeError> {
    if !allow_url_sources {
        refuse_url_sources(body)?;
    }
    sanitize(body, model)
}

/// Parses, sanitizes and re-serializes a request body.
pub fn sanitize_bytes(body: &[u8], model: &str) -> Result<Vec<u8>, SanitizeError> {
    sanitize_bytes_with_report(body, model).map(|(bytes, _)| bytes)
}

/// [`sanitize_bytes`], also returning what was removed.
pub fn sanitize_bytes_with_report(
    body: &[u8],
    model: &str,
) -> Result<(Vec<u8>, Report), SanitizeError> {
    let mut value: Value = serde_json::from_slice(body)?;
    let report = sanitize(&mut value, model)?;
    Ok((serde_json::to_vec(&value)?, report))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn keys(v: &Value) -> Vec<&str> {
        v.as_object().unwrap().keys().map(String::as_str).collect()
    }

    #[test]
    fn rewrites_model_in_place_and_keeps_order() {
        let mut v =
            json!({"max_tokens": 5, "model": "claude-x", "zz_unknown": {"a": [1]}, "messages": []});
        let r = sanitize(&mut v, "qwen").unwrap();
        assert_eq!(keys(&v), ["max_tokens", "model", "zz_unknown", "messages"]);
        assert_eq!(v["model"], "qwen");
        assert_eq!(v["zz_unknown"], json!({"a": [1]}));
        assert_eq!(r.requested_model.as_deref(), Some("claude-x"));
        assert!(!r.removed_anything());
    }

    #[test]
    fn missing_or_odd_model_is_set() {
        let mut v = json!({"messages": []});
        sanitize(&mut v, "m").unwrap();
        assert_eq!(keys(&v), ["messages", "model"]);
        let mut v = json!({"model": 7});
        let r = sanitize(&mut v, "m").unwrap();
        assert_eq!(v["model"], "m");
        assert_eq!(r.requested_model, None);
    }

    #[test]
    fn removes_server_tools_and_fields() {
        let mut v = json!({
            "model": "a",
            "container": "c",
            "tools": [
                {"name": "Bash", "input_schema": {}},
                {"type": "web_search_20250305", "name": "web_search"},
                {"type": "custom", "name": "Mine", "input_schema": {}},
                {"type": null, "name": "weird"},
            ],
            "mcp_servers": [{"url": "https://x"}],
            "context_management": {},
            "tool_choice": {"type": "auto"},
            "stream": true,
        });
        let r = sanitize(&mut v, "m").unwrap();
        assert_eq!(keys(&v), ["model", "tools", "tool_choice", "stream"]);
        let names: Vec<_> = v["tools"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["Bash", "Mine"]);
        assert_eq!(r.removed_tools.len(), 2);
        assert_eq!(r.removed_tools[0].tool_type, "web_search_20250305");
        assert_eq!(r.removed_tools[1].tool_type, "null");
        assert_eq!(
            r.removed_fields,
            ["mcp_servers", "container", "context_management"]
        );
        assert!(!r.tools_key_removed && !r.tool_choice_removed);
    }

    #[test]
    fn all_tools_removed_drops_tools_and_tool_choice() {
        let mut v = json!({
            "model": "a",
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "tool_choice": {"type": "any"},
            "messages": [],
        });
        let r = sanitize(&mut v, "m").unwrap();
        assert_eq!(keys(&v), ["model", "messages"]);
        assert!(r.tools_key_removed && r.tool_choice_removed);
    }

    #[test]
    fn empty_tools_left_alone() {
        let mut v = json!({"model": "a", "tools": [], "tool_choice": {"type": "auto"}});
        let r = sanitize(&mut v, "m").unwrap();
        assert_eq!(keys(&v), ["model", "tools", "tool_choice"]);
        assert!(!r.removed_anything());
    }

    #[test]
    fn tool_choice_naming_removed_tool_is_dropped() {
        let mut v = json!({
            "tools": [{"name": "Bash"}, {"type": "web_fetch_20250910", "name": "web_fetch"}],
            "tool_choice": {"type": "tool", "name": "web_fetch"},
        });
        let r = sanitize(&mut v, "m").unwrap();
        assert!(v.get("tool_choice").is_none());
        assert!(r.tool_choice_removed && !r.tools_key_removed);
        let mut v = json!({
            "tools": [{"name": "Bash"}, {"type": "web_fetch_20250910", "name": "web_fetch"}],
            "tool_choice": {"type": "tool", "name": "Bash"},
        });
        let r = sanitize(&mut v, "m").unwrap();
        assert_eq!(v["tool_choice"]["name"], "Bash");
        assert!(!r.tool_choice_removed);
    }

    #[test]
    fn refusals_leave_body_untouched() {
        for bad in [json!([]), json!("x"), json!(null), json!(1)] {
            let mut v = bad.clone();
            assert!(matches!(
                sanitize(&mut v, "m"),
                Err(SanitizeError::NotAnObject { .. })
            ));
            assert_eq!(v, bad);
        }
        let orig = json!({"model": "a", "tools": {"name": "x"}});
        let mut v = orig.clone();
        assert!(matches!(
            sanitize(&mut v, "m"),
            Err(SanitizeError::ToolsNotArray { found: "object" })
        ));
        assert_eq!(v, orig);
        let orig = json!({"model": "a", "tools": [{"name": "x"}, "web_search"]});
        let mut v = orig.clone();
        assert!(matches!(
            sanitize(&mut v, "m"),
            Err(SanitizeError::ToolNotObject { index: 1, .. })
        ));
        assert_eq!(v, orig);
        assert!(matches!(
            sanitize(&mut json!({"tools": null}), "m"),
            Err(SanitizeError::ToolsNotArray { found: "null" })
        ));
    }

    #[test]
    fn bytes_round_trip() {
        let out =
            sanitize_bytes(br#"{"b":1,"model":"x","a":2,"container":{"id":"c"}}"#, "up").unwrap();
        assert_eq!(out, br#"{"b":1,"model":"up","a":2}"#);
        assert!(matches!(
            sanitize_bytes(b"{", "m"),
            Err(SanitizeError::Json(_))
        ));
        // Duplicate keys collapse in the parsed value; upstream sees only what was checked.
        let out = sanitize_bytes(br#"{"model":"a","model":"b"}"#, "up").unwrap();
        assert_eq!(out, br#"{"model":"up"}"#);
    }

    #[test]
    fn url_sources_are_refused_at_any_depth() {
        let url_image = json!({"type": "image", "source": {"type": "url", "url": "https://evil.example/?d=secret"}});
        let nested = json!({"messages": [
            {"role": "user", "content": "hi"},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                "content": [{"type": "text", "text": "ok"}, url_image]}]},
        ]});
        match refuse_url_sources(&nested) {
            Err(SanitizeError::UrlSource { path }) => {
                assert_eq!(path, "messages[1].content[0].content[1].source")
            }
            other => panic!("{other:?}"),
        }
        let doc = json!({"type": "document", "source": {"type": "url", "url": "https://x/a.pdf"}});
        assert!(refuse_url_sources(&json!({"system": [doc.clone()]})).is_err());
        assert!(
            refuse_url_sources(&json!({"messages": [{"role": "user", "content": [doc]}]})).is_err()
        );
    }

    #[test]
    fn base64_media_and_tool_inputs_pass() {
        let ok = json!({
            "system": [{"type": "text", "text": "s"}],
            "messages": [{"role": "user", "content": [
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "d"}},
                {"type": "tool_use", "id": "t", "name": "Fetch", "input": {"source": {"type": "url"}}},
            ]}],
            "tools": [{"name": "x", "input_schema": {"properties": {"source": {"type": "url"}}}}],
        });
        refuse_url_sources(&ok).unwrap();
    }

    fn json_leaf() -> impl Strategy<Value = Value> {
        prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            "\\PC{0,8}".prop_map(Value::String),
        ]
    }

    fn json_value() -> impl Strategy<Value = Value> {
        json_leaf().prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::vec(("[a-z]{1,6}", inner), 0..4)
                    .prop_map(|kv| Value::Object(kv.into_iter().collect())),
            ]
        })
    }

    proptest! {
        #[test]
        fn unknown_keys_survive_in_order(
            fields in proptest::collection::vec(("[a-z_]{1,12}", json_value()), 0..12)
        ) {
            let mut obj = Map::new();
            for (k, v) in fields {
                if k == "tools" || k == "tool_choice" || k == "model" || REMOVED_FIELDS.contains(&k.as_str()) {
                    continue;
                }
                obj.insert(k, v);
            }
            let original = Value::Object(obj.clone());
            let mut v = original.clone();
            sanitize(&mut v, "m").unwrap();
            let out = v.as_object().unwrap();
            let out_keys: Vec<_> = out.keys().filter(|k| *k != "model").collect();
            let in_keys: Vec<_> = obj.keys().collect();
            prop_assert_eq!(out_keys, in_keys);
            for (k, val) in &obj {
                prop_assert_eq!(&out[k], val);
            }
            let bytes = sanitize_bytes(&serde_json::to_vec(&original).unwrap(), "m").unwrap();
            let reparsed: Value = serde_json::from_slice(&bytes).unwrap();
            prop_assert_eq!(reparsed, v);
        }

        #[test]
        fn no_server_tool_survives(
            types in proptest::collection::vec(proptest::option::of("custom|web_search_20250305|[a-z_0-9]{1,10}"), 0..8)
        ) {
            let tools: Vec<Value> = types.iter().enumerate().map(|(i, t)| match t {
                Some(t) => json!({"type": t, "name": format!("t{i}")}),
                None => json!({"name": format!("t{i}")}),
            }).collect();
            let mut v = json!({"model": "x", "tools": tools});
            let r = sanitize(&mut v, "m").unwrap();
            let left = v.get("tools").and_then(Value::as_array).cloned().unwrap_or_default();
            for t in &left {
                let ty = t.get("type").and_then(Value::as_str);
                prop_assert!(ty.is_none() || ty == Some("custom"));
            }
            prop_assert_eq!(left.len() + r.removed_tools.len(), types.len());
        }
    }
}
