//! `POST /v1/chat/completions` on the task socket of a task whose model is a rollout router
//! (`backend = "router"`): an OpenAI chat completion, streamed or not, authenticated, budgeted
//! and metered like `/v1/messages` ([`crate::proxy`], whose auth, body reading and detached
//! upstream call it shares), forwarded to `<base_url>/chat/completions`.
//!
//! What happens to a request:
//! - the task token (Bearer or `x-api-key`) is checked, the body read under the same limits and
//!   body budgets as `/v1/messages`;
//! - on a task whose model is not a router: 404 (its socket serves `/v1/messages`);
//! - `model` is rewritten only when the router model sets `upstream_model`;
//! - the output cap: `max_completion_tokens` and `max_tokens` (positive integers when present)
//!   are clamped to the model's `max_output_tokens`; with neither present the cap is written
//!   as `max_tokens`, the model's `max_output_tokens` or else [`DEFAULT_MAX_OUTPUT_TOKENS`], so
//!   what the model generates stays bounded by what was reserved (an uncapped request on a
//!   router runs to the model's context length, and 64 of them at once spent several times
//!   the budget);
//! - `stream` is a boolean or absent (400 otherwise: a router that reads `1` as true would
//!   stream without the usage chunk forced below);
//! - media the router would fetch (a content part's `image_url`, `video_url`, `audio_url`, ...
//!   that is not a `data:` URL) is refused (400) unless the model sets `allow_url_sources`, as
//!   on `/v1/messages`: such a URL can carry workspace data out, and what it costs is not in
//!   the request; each media part counts at least an image's tokens in the estimate;
//! - a stream gets `stream_options.include_usage = true` (forced, whatever the client sent) so
//!   its last chunk carries the usage the meter bills; a non-stream request loses
//!   `stream_options` (OpenAI refuses it without `stream`);
//! - reserved (input estimate + the output above, times the choices asked for: `n`, or vLLM's
//!   `best_of`, each generated up to the cap and all billed) and admitted through the task's
//!   account: 403 before any upstream call once the budget is spent;
//! - forwarded with the client's `x-*` headers (the rollout tags: the sticky routing header,
//!   `X-Session-Id`, `X-Instance-Id`, `X-Turn-Id`, `X-Dressage-*`, ...) and nothing else of
//!   the client's: never `Authorization` nor `x-api-key`, so the task token stays here;
//! - metered from the chat usage (`agentbox_wire::usage::UsageMeter::chat`), settled exactly once
//!   as [`crate::account`] says (a stream cut before its usage chunk bills the input estimate
//!   and at least the deltas read).
//!
//! Errors are in OpenAI's shape (`{"error":{"message","type","code"}}`, and a broken stream
//! ends with that object as a `data:` frame); 5xx in generic words, as on every route.
//!
//! The router's URL is not checked with the loopback guard: the guard protects what the
//! gateway sends to listeners the service user runs (the bridge token, vLLM), while a router
//! is the rollout manager's own service (remote, or on loopback under the manager's uid) and
//! gets no gateway secret, only the agent's prompt, like Ollama. A loopback router URL is
//! therefore trusted as configured, like `ollama_url`.

use agentbox_llm::{Auth, ChatPassTarget, Protocol};
use agentbox_policy::config::Backend;
use axum::extract::{Request, State};
use axum::http::HeaderMap;
use axum::response::Response;
use serde_json::{Map, Value, json};

use crate::error::ProxyError;
use crate::estimate;
use crate::ledger::Reservation;
use crate::proxy::{TaskCtx, call_permit, detached, read_json, settle_failed};

/// The output a request reserves when it states no limit and its model has no
/// `max_output_tokens`.
pub const DEFAULT_MAX_OUTPUT_TOKENS: u64 = 4096;

/// Client headers forwarded at most (a router's tags are a handful).
const MAX_FORWARDED_HEADERS: usize = 64;

/// `POST /v1/chat/completions`: every failure in OpenAI's error shape.
pub(crate) async fn completions(State(ctx): State<TaskCtx>, req: Request) -> Response {
    match handle(ctx, req).await {
        Ok(resp) => resp,
        Err(e) => e.reply().into_response(Protocol::OpenAi),
    }
}

async fn handle(ctx: TaskCtx, req: Request) -> Result<Response, ProxyError> {
    let (headers, mut value, _charge, size_hint) = read_json(&ctx, req).await?;
    let model = ctx.account.model()?;
    let Backend::Router {
        upstream_model,
        base_url,
    } = &model.backend
    else {
        return Err(ProxyError::NotFound(format!(
            "POST /v1/chat/completions: model {} is not a rollout router; this task serves POST /v1/messages",
            model.id
        )));
    };
    let body = value
        .as_object_mut()
        .ok_or_else(|| ProxyError::InvalidRequest("request body must be a JSON object".into()))?;
    if let Some(name) = upstream_model {
        body.insert("model".into(), json!(name));
    }
    if !model.allow_url_sources {
        refuse_url_sources(body)?;
    }
    let max_output = clamp_output(body, model.max_output_tokens)?;
    // Each of `n` choices (and each of vLLM's `best_of` candidates) is generated up to the
    // cap and billed in `usage`: the reservation covers all of them.
    let choices = positive(body, "n")?
        .unwrap_or(1)
        .max(positive(body, "best_of")?.unwrap_or(1));
    let max_output = max_output.saturating_mul(choices);
    let stream = match body.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => {
            return Err(ProxyError::InvalidRequest(
                "stream: expected a boolean".into(),
            ));
        }
    };
    if stream {
        let opts = body
            .entry("stream_options")
            .or_insert_with(|| Value::Object(Map::new()));
        if !opts.is_object() {
            *opts = Value::Object(Map::new());
        }
        if let Value::Object(o) = opts {
            o.insert("include_usage".into(), Value::Bool(true));
        }
    } else {
        body.remove("stream_options");
    }
    let reservation = Reservation::for_request(
        estimate::chat_input_tokens(&value),
        max_output,
        model.prices.as_ref(),
    );
    let url = agentbox_llm::upstream_url(&format!(
        "{}/chat/completions",
        base_url.as_str().trim_end_matches('/')
    ))?;
    let forwarded = forwarded_headers(&headers);
    // From here every path settles exactly once (see `proxy::detached`).
    let permit = call_permit(&ctx)?;
    let mut admission = ctx.account.admit(reservation)?;
    let cfg = ctx.cfg.clone();
    let tid = ctx.account.tid().clone();
    let call = async move {
        let pairs: Vec<(&str, &str)> = forwarded
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let target = ChatPassTarget {
            url: &url,
            auth: Auth::None,
            headers: &pairs,
            size_hint,
        };
        admission.sent();
        match cfg.upstream.chat(target, value).await {
            Ok(answer) => {
                let tid = tid.clone();
                Ok(answer
                    .metered_chat(move |report| {
                        if !report.complete {
                            tracing::warn!(%tid, "chat answer ended incomplete; billing what was generated");
                        }
                        admission.settle(&report);
                    })
                    .read_rest_with(cfg.background.clone(), cfg.shutdown.clone()))
            }
            Err(e) => {
                settle_failed(admission, &e);
                Err(ProxyError::Llm(e))
            }
        }
    };
    let cfg = ctx.cfg.clone();
    detached(&cfg, ctx.account.tid().clone(), permit, call).await
}

/// A positive integer field, if present.
fn positive(body: &Map<String, Value>, key: &str) -> Result<Option<u64>, ProxyError> {
    match body.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n.as_u64().filter(|n| *n > 0).map(Some).ok_or_else(|| {
            ProxyError::InvalidRequest(format!("{key}: expected a positive integer"))
        }),
        Some(_) => Err(ProxyError::InvalidRequest(format!(
            "{key}: expected a positive integer"
        ))),
    }
}

/// Clamps the request's output limits to `cap` (writing the cap when none is given) and
/// returns the output the request reserves.
fn clamp_output(body: &mut Map<String, Value>, cap: Option<u64>) -> Result<u64, ProxyError> {
    const KEYS: [&str; 2] = ["max_completion_tokens", "max_tokens"];
    let mut asked = None;
    for key in KEYS {
        if let Some(n) = positive(body, key)? {
            let n = match cap {
                Some(c) if n > c => {
                    body.insert(key.into(), json!(c));
                    c
                }
                Some(_) | None => n,
            };
            asked = Some(asked.map_or(n, |a: u64| a.max(n)));
        }
    }
    Ok(match (asked, cap) {
        (Some(n), _) => n,
        (None, Some(c)) => {
            body.insert("max_tokens".into(), json!(c));
            c
        }
        (None, None) => {
            body.insert("max_tokens".into(), json!(DEFAULT_MAX_OUTPUT_TOKENS));
            DEFAULT_MAX_OUTPUT_TOKENS
        }
    })
}

/// Refuses a content part whose media the router would fetch: a `*_url` member (`image_url`,
/// `video_url`, `audio_url`, ...) whose URL, given as a string or as `{"url": ...}`, is not a
/// `data:` URL.
fn refuse_url_sources(body: &Map<String, Value>) -> Result<(), ProxyError> {
    let Some(Value::Array(messages)) = body.get("messages") else {
        return Ok(());
    };
    for (i, m) in messages.iter().enumerate() {
        let Some(Value::Array(parts)) = m.get("content") else {
            continue;
        };
        for (j, part) in parts.iter().enumerate() {
            let Value::Object(part) = part else { continue };
            for (key, v) in part.iter().filter(|(k, _)| k.ends_with("_url")) {
                let url = match v {
                    Value::String(u) => Some(u.as_str()),
                    Value::Object(o) => o.get("url").and_then(Value::as_str),
                    Value::Null | Value::Bool(_) | Value::Number(_) | Value::Array(_) => None,
                };
                let inline = |u: &str| {
                    u.trim_start()
                        .get(..5)
                        .is_some_and(|p| p.eq_ignore_ascii_case("data:"))
                };
                if let Some(u) = url
                    && !inline(u)
                {
                    return Err(ProxyError::InvalidRequest(format!(
                        "messages[{i}].content[{j}].{key}: media with a URL source is not allowed for this model (the router would fetch it); send it inline as a data: URL"
                    )));
                }
            }
        }
    }
    Ok(())
}

/// The client headers the router gets: its `x-*` tags, never a credential.
fn forwarded_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(name, _)| {
            let n = name.as_str();
            n.starts_with("x-") && n != "x-api-key"
        })
        .filter_map(|(name, value)| {
            Some((name.as_str().to_owned(), value.to_str().ok()?.to_owned()))
        })
        .take(MAX_FORWARDED_HEADERS)
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use axum::http::HeaderValue;

    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn output_limits_are_clamped_or_written() {
        let mut b = obj(json!({"max_tokens": 9000, "max_completion_tokens": 100}));
        assert_eq!(clamp_output(&mut b, Some(1000)).unwrap(), 1000);
        assert_eq!(b["max_tokens"], 1000);
        assert_eq!(b["max_completion_tokens"], 100);
        let mut b = obj(json!({}));
        assert_eq!(clamp_output(&mut b, Some(500)).unwrap(), 500);
        assert_eq!(b["max_tokens"], 500);
        // No cap anywhere: the default is reserved, and written, so the router stops there.
        let mut b = obj(json!({}));
        assert_eq!(
            clamp_output(&mut b, None).unwrap(),
            DEFAULT_MAX_OUTPUT_TOKENS
        );
        assert_eq!(b["max_tokens"], DEFAULT_MAX_OUTPUT_TOKENS);
        let mut b = obj(json!({"max_tokens": 0}));
        assert!(clamp_output(&mut b, None).is_err());
        let mut b = obj(json!({"max_completion_tokens": "x"}));
        assert!(clamp_output(&mut b, None).is_err());
    }

    #[test]
    fn media_the_router_would_fetch_is_refused() {
        let part = |p: Value| obj(json!({"messages": [{"role": "user", "content": [p]}]}));
        for fetched in [
            json!({"type": "image_url", "image_url": {"url": "https://x.example/a.png?d=secret"}}),
            json!({"type": "image_url", "image_url": "http://x.example/a.png"}),
            json!({"type": "video_url", "video_url": {"url": "file:///etc/passwd"}}),
            json!({"type": "audio_url", "audio_url": {"url": " HTTPS://x.example/a.wav"}}),
        ] {
            let e = refuse_url_sources(&part(fetched.clone())).unwrap_err();
            assert!(e.to_string().contains("content[0]"), "{fetched}: {e}");
        }
        for inline in [
            json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}),
            json!({"type": "image_url", "image_url": {"url": "DATA:image/png;base64,AAAA"}}),
            json!({"type": "text", "text": "https://x.example is only text"}),
            json!({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}),
        ] {
            assert!(
                refuse_url_sources(&part(inline.clone())).is_ok(),
                "{inline}"
            );
        }
    }

    #[test]
    fn only_x_headers_but_the_api_key_are_forwarded() {
        let mut h = HeaderMap::new();
        h.insert("authorization", HeaderValue::from_static("Bearer tok"));
        h.insert("x-api-key", HeaderValue::from_static("tok"));
        h.insert("x-session-id", HeaderValue::from_static("s1"));
        h.insert("x-smg-routing-key", HeaderValue::from_static("s1"));
        h.insert("cookie", HeaderValue::from_static("c"));
        let f = forwarded_headers(&h);
        let names: Vec<&str> = f.iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(names.contains(&"x-session-id") && names.contains(&"x-smg-routing-key"));
    }
}
