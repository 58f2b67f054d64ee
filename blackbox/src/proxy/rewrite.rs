//! The rollout's request policy on the chat completions body sent upstream (after any protocol
//! translation, so every client protocol gets the same policy): `model_override` (only where
//! the body names a model), `default_temperature` where the body has none (an explicit 0 is
//! kept), and `stream_options.include_usage: true` on streams, so every answer reports the
//! usage the turn counts are made of. A non-streamed body loses its `stream_options` (servers
//! refuse them without `stream`).

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
    fn truthiness_follows_python() {
        assert!(truthy(Some(&json!(true))) && truthy(Some(&json!(1))));
        assert!(!truthy(Some(&json!(0))) && !truthy(Some(&json!(""))) && !truthy(None));
    }
}
