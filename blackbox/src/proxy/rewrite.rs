//! The rollout's request policy on the chat completions body sent upstream (after any protocol
//! translation, so every client protocol gets the same policy): `model_override` (only where
//! the body names a model), `default_temperature` where the body has none (an explicit 0 is
//! kept), and `stream_options.include_usage: true` on streams, so every answer reports the
//! usage the turn counts are made of. A non-streamed body loses its `stream_options` (servers
//! refuse them without `stream`).
//!
//! A chat body is first only peeked at ([`peek`]: the four fields the policy reads, the rest
//! skipped unparsed). A body that complies goes upstream byte for byte; one that only lacks
//! members (`stream_options` on a stream, `temperature`) gets them spliced in after its opening
//! brace; only what needs a member changed or removed is parsed whole and re-serialized. The
//! hot path (an agent's 100 KB chat body) thus costs one scan, not a parse and a serialization.

use agentbox_wire::chat::{ChatRequest, StreamOptions};
use serde::{Deserialize, Deserializer};
use serde_json::{Map, Number, Value};

/// The policy, from the proxy's config.
#[derive(Debug, Clone, Default)]
pub struct Policy {
    pub model_override: Option<String>,
    pub default_temperature: Option<f64>,
}

/// Python's truthiness of a JSON value, which is how the reference reads `stream`.
pub fn truthy(v: Option<&Value>) -> bool {
    match v {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(Value::Number(n)) => n.as_f64().is_some_and(|f| f != 0.0),
        Some(Value::String(s)) => !s.is_empty(),
        Some(Value::Array(a)) => !a.is_empty(),
        Some(Value::Object(o)) => !o.is_empty(),
    }
}

/// A field that is present, even as `null` (`None` only when absent).
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

/// The fields of a chat body the policy reads.
#[derive(Deserialize)]
struct Peek {
    #[serde(default, deserialize_with = "present")]
    model: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    temperature: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    stream: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    stream_options: Option<Value>,
}

/// How a chat body must change to comply with the policy.
#[derive(Debug, Clone, PartialEq)]
pub enum Edit {
    /// It complies.
    None,
    /// It only lacks these members: add them.
    Add(Vec<(&'static str, Value)>),
    /// A member must change or go: parse, [`apply`], re-serialize.
    Rewrite,
}

/// What [`peek`] found: whether the body streams and what it needs.
#[derive(Debug, Clone, PartialEq)]
pub struct Peeked {
    pub stream: bool,
    pub edit: Edit,
}

/// Reads only what the policy needs from a chat body; an error when the body is not a JSON
/// object.
pub fn peek(bytes: &[u8], policy: &Policy) -> Result<Peeked, String> {
    // A derived struct also accepts a JSON array; a chat body is an object.
    if bytes.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err("expected an object".into());
    }
    // As text first: skipping the members it does not read, serde_json checks their syntax
    // but not their UTF-8, and a body that is not JSON must be refused whole, not forwarded.
    let text = std::str::from_utf8(bytes).map_err(|e| format!("not UTF-8: {e}"))?;
    let p: Peek = serde_json::from_str(text).map_err(|e| e.to_string())?;
    let stream = truthy(p.stream.as_ref());
    let mut rewrite = policy
        .model_override
        .as_ref()
        .is_some_and(|m| p.model.as_ref().is_some_and(|v| v.as_str() != Some(m)));
    let mut add = Vec::new();
    if let Some(t) = policy.default_temperature.and_then(Number::from_f64) {
        match &p.temperature {
            None => add.push(("temperature", Value::Number(t))),
            Some(Value::Null) => rewrite = true,
            Some(_) => {}
        }
    }
    match (&p.stream_options, stream) {
        (Some(Value::Object(o)), true) => {
            rewrite |= o.get("include_usage") != Some(&Value::Bool(true));
        }
        (None, true) => add.push((
            "stream_options",
            Value::Object(Map::from_iter([(
                "include_usage".to_owned(),
                Value::Bool(true),
            )])),
        )),
        (Some(_), true | false) => rewrite = true,
        (None, false) => {}
    }
    let edit = if rewrite {
        Edit::Rewrite
    } else if add.is_empty() {
        Edit::None
    } else {
        Edit::Add(add)
    };
    Ok(Peeked { stream, edit })
}

/// Adds `members` to the JSON object `body` (which lacks them) right after its opening brace,
/// in one buffer: what the proxy sends as [`insertion`]'s three pieces (the tests and the
/// `blackbox_request` fuzz target check the bytes through this).
pub fn splice(body: &[u8], members: &[(&'static str, Value)]) -> Vec<u8> {
    let (at, added) = insertion(body, members);
    [&body[..at], &added, &body[at..]].concat()
}

/// Where [`splice`] adds `members` to `body` and the text it adds there: the body then goes
/// upstream as three pieces (before, added, after), never copied whole.
pub fn insertion(body: &[u8], members: &[(&'static str, Value)]) -> (usize, Vec<u8>) {
    let open = body.iter().position(|&b| b == b'{').map_or(0, |i| i + 1);
    let empty = body[open..].iter().find(|b| !b.is_ascii_whitespace()) == Some(&b'}');
    let mut out = Vec::with_capacity(64);
    for (i, (key, value)) in members.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.push(b'"');
        out.extend_from_slice(key.as_bytes());
        out.extend_from_slice(b"\":");
        out.extend_from_slice(value.to_string().as_bytes());
    }
    if !empty && !members.is_empty() {
        out.push(b',');
    }
    (open, out)
}

/// [`apply`] on a translated chat request (where `model` always exists).
pub fn apply_typed(chat: &mut ChatRequest, policy: &Policy) {
    if let Some(m) = &policy.model_override {
        chat.model.clone_from(m);
    }
    if chat.temperature.is_none()
        && let Some(n) = policy.default_temperature.and_then(Number::from_f64)
    {
        chat.temperature = Some(n);
    }
    if chat.stream == Some(true) {
        chat.stream_options
            .get_or_insert_with(StreamOptions::default)
            .include_usage = Some(true);
    } else {
        chat.stream_options = None;
    }
}

/// Applies the policy to a chat body; `true` if anything changed.
pub fn apply(body: &mut Map<String, Value>, policy: &Policy) -> bool {
    let mut changed = false;
    if let Some(model) = &policy.model_override
        && let Some(current) = body.get_mut("model")
        && current.as_str() != Some(model)
    {
        *current = Value::String(model.clone());
        changed = true;
    }
    if let Some(t) = policy.default_temperature
        && body.get("temperature").is_none_or(Value::is_null)
        && let Some(n) = Number::from_f64(t)
    {
        body.insert("temperature".into(), Value::Number(n));
        changed = true;
    }
    if truthy(body.get("stream")) {
        match body.get_mut("stream_options") {
            Some(Value::Object(opts)) => {
                if opts.get("include_usage") != Some(&Value::Bool(true)) {
                    opts.insert("include_usage".into(), Value::Bool(true));
                    changed = true;
                }
            }
            Some(_) | None => {
                let opts = Map::from_iter([("include_usage".to_owned(), Value::Bool(true))]);
                body.insert("stream_options".into(), Value::Object(opts));
                changed = true;
            }
        }
    } else if body.remove("stream_options").is_some() {
        changed = true;
    }
    changed
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    /// Found by the `blackbox_request` fuzz target: invalid UTF-8 inside a member the policy
    /// does not read passed `peek`, so the proxy forwarded (or spliced into) a body that is not
    /// JSON.
    #[test]
    fn a_body_that_is_not_utf8_is_refused_wherever_the_bad_bytes_are() {
        let policy = Policy {
            model_override: None,
            default_temperature: Some(0.5),
        };
        // Inside `messages`, which peek skips.
        let mut body = br#"{"messages":[{"role":"user","content":"x"#.to_vec();
        body.extend_from_slice(b"\x8d\x8d\"}]}");
        assert!(serde_json::from_slice::<Value>(&body).is_err());
        assert!(peek(&body, &policy).is_err());
        // The same body in valid UTF-8 passes and only needs the temperature added.
        let good = br#"{"messages":[{"role":"user","content":"x"}],"f":1}"#;
        let p = peek(good, &policy).unwrap();
        assert!(matches!(p.edit, Edit::Add(_)));
    }

    fn run(body: Value, policy: &Policy) -> (Value, bool) {
        let Value::Object(mut m) = body else {
            unreachable!()
        };
        let changed = apply(&mut m, policy);
        (Value::Object(m), changed)
    }

    #[test]
    fn include_usage_is_forced_on_streams_keeping_other_options() {
        let (b, changed) = run(
            json!({"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":false,"extra":"keep-me"}}),
            &Policy::default(),
        );
        assert!(changed);
        assert_eq!(
            b,
            json!({"model":"m","messages":[],"stream":true,"stream_options":{"include_usage":true,"extra":"keep-me"}})
        );
        let (b, _) = run(
            json!({"model":"m","stream":true,"stream_options":"junk"}),
            &Policy::default(),
        );
        assert_eq!(b["stream_options"], json!({"include_usage": true}));
    }

    #[test]
    fn non_streams_are_left_alone_but_lose_stream_options() {
        let body = json!({"model":"gpt-test","messages":[],"stream":false});
        let (b, changed) = run(body.clone(), &Policy::default());
        assert!(!changed);
        assert_eq!(b, body);
        let (b, changed) = run(
            json!({"model":"m","stream_options":{"include_usage":true}}),
            &Policy::default(),
        );
        assert!(changed);
        assert_eq!(b, json!({"model":"m"}));
    }

    #[test]
    fn default_temperature_fills_only_a_missing_one() {
        let p = Policy {
            default_temperature: Some(0.7),
            ..Policy::default()
        };
        let (b, _) = run(json!({"model":"m","stream":false}), &p);
        assert_eq!(b["temperature"], json!(0.7));
        let (b, _) = run(json!({"model":"m","temperature":null}), &p);
        assert_eq!(b["temperature"], json!(0.7));
        let (b, changed) = run(json!({"model":"m","temperature":0.0}), &p);
        assert!(!changed);
        assert_eq!(b["temperature"], json!(0.0));
    }

    #[test]
    fn model_override_replaces_only_an_existing_model() {
        let p = Policy {
            model_override: Some("training-model".into()),
            ..Policy::default()
        };
        let (b, _) = run(json!({"model":"agent-model","messages":[]}), &p);
        assert_eq!(b["model"], "training-model");
        let (b, changed) = run(json!({"messages":[]}), &p);
        assert!(!changed);
        assert!(b.get("model").is_none());
    }

    #[test]
    fn peek_agrees_with_apply() {
        let policies = [
            Policy::default(),
            Policy {
                model_override: Some("m".into()),
                default_temperature: Some(0.5),
            },
        ];
        let bodies = [
            json!({}),
            json!({"stream":true}),
            json!({"model":"m","messages":[]}),
            json!({"model":"x","messages":[]}),
            json!({"messages":[],"temperature":null}),
            json!({"model":"m","temperature":0.5,"stream":true}),
            json!({"model":"m","temperature":0.5,"stream":true,"stream_options":{"include_usage":true}}),
            json!({"model":"m","temperature":0.5,"stream":true,"stream_options":null}),
            json!({"model":"m","temperature":0.5,"stream":false,"stream_options":null}),
            json!({"model":"m","temperature":0.5,"stream":1,"stream_options":{"include_usage":false}}),
        ];
        for p in &policies {
            for b in &bodies {
                let raw = b.to_string();
                let peeked = peek(raw.as_bytes(), p).unwrap();
                let Value::Object(mut m) = b.clone() else {
                    unreachable!()
                };
                let changed = apply(&mut m, p);
                assert_eq!(peeked.edit != Edit::None, changed, "{b} {p:?}");
                assert_eq!(peeked.stream, truthy(b.get("stream")), "{b}");
                if let Edit::Add(members) = &peeked.edit {
                    let spliced: Value = serde_json::from_slice(&splice(raw.as_bytes(), members))
                        .unwrap_or_else(|e| panic!("{b}: {e}"));
                    assert_eq!(spliced, Value::Object(m), "splicing is applying: {b} {p:?}");
                }
            }
        }
        assert!(peek(b"[]", &Policy::default()).is_err());
        let spliced = splice(b" { } ", &[("a", json!(1)), ("b", json!({"c": true}))]);
        assert_eq!(spliced, b" {\"a\":1,\"b\":{\"c\":true} } ");
        assert!(peek(b" {\"stream\": tru", &Policy::default()).is_err());
    }

    #[test]
    fn translated_requests_get_the_same_policy() {
        let mut chat: ChatRequest =
            serde_json::from_value(json!({"model":"agent","messages":[],"stream":true})).unwrap();
        let p = Policy {
            model_override: Some("training".into()),
            default_temperature: Some(0.7),
        };
        apply_typed(&mut chat, &p);
        assert_eq!(
            serde_json::to_value(&chat).unwrap(),
            json!({"model":"training","messages":[],"stream":true,
                   "stream_options":{"include_usage":true},"temperature":0.7})
        );
        chat.stream = Some(false);
        apply_typed(&mut chat, &p);
        assert!(chat.stream_options.is_none());
    }

    #[test]
    fn truthiness_follows_python() {
        assert!(truthy(Some(&json!(true))) && truthy(Some(&json!(1))));
        assert!(!truthy(Some(&json!(0))) && !truthy(Some(&json!(""))) && !truthy(None));
    }
}
