//! The bridge's HTTP surface: `GET /health` (open), and behind the bridge token
//! `GET /check/{model}` and `POST /v1/messages`. Everything else is a 404 (after auth, so an
//! unauthenticated caller learns nothing about the routes).

use std::sync::Arc;

use agentbox_http::BodyError;
use agentbox_http::bufpool::BodyBuf;
use axum::Router;
use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use bytes::Bytes;
use serde_json::error::Category;
use serde_json::value::RawValue;
use serde_json::{Value, json};

use agentbox_llm::adapter::anthropic_version;
use agentbox_llm::{AnthropicTarget, Auth, ChatTarget, Parts};
use agentbox_policy::config::{Provider, Reasoning};
use agentbox_policy::sanitize::{SanitizeError, raw};
use agentbox_policy::secret::{Secret, presented_token};
use agentbox_wire::anthropic::MessagesRequest;
use agentbox_wire::translate::{
    AnthropicBody, ChatOptions, NoUnicodeEscapes, ReasoningField, ResponseOptions,
};

use crate::check::check as probe;
use crate::error::BridgeError;
use crate::{Bridge, RemoteModel};

/// The bridge's router; state is the shared [`Bridge`].
pub fn router(bridge: Arc<Bridge>) -> Router {
    let authed = Router::new()
        .route("/check/{model}", get(check))
        .route("/v1/messages", post(messages))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            bridge.clone(),
            require_token,
        ));
    Router::new()
        .route("/health", get(health))
        .merge(authed)
        .with_state(bridge)
}

async fn require_token(State(bridge): State<Arc<Bridge>>, req: Request, next: Next) -> Response {
    let h = req.headers();
    let token = presented_token(
        h.get(header::AUTHORIZATION).map(|v| v.as_bytes()),
        h.get("x-api-key").map(|v| v.as_bytes()),
    );
    match token {
        Some(t) if bridge.token.matches(t) => next.run(req).await,
        Some(_) | None => BridgeError::Unauthorized.into_response(),
    }
}

async fn not_found(req: Request) -> BridgeError {
    BridgeError::NotFound(req.uri().path().to_owned())
}

async fn method_not_allowed() -> BridgeError {
    BridgeError::MethodNotAllowed
}

/// `GET /health`: liveness plus the external models and whether each has a key. No auth, so
/// it says nothing a local user could use against a provider.
async fn health(State(bridge): State<Arc<Bridge>>) -> Response {
    let models: Vec<Value> = bridge
        .models
        .values()
        .map(|m| {
            json!({
                "id": m.id,
                "provider": m.provider.as_str(),
                "upstream_model": m.upstream_model,
                "key_configured": m.key.is_some(),
            })
        })
        .collect();
    axum::Json(json!({"ok": true, "models": models})).into_response()
}

/// `GET /check/{model}`: can this model be used right now? Tells "no key configured",
/// "upstream unreachable" and "auth refused" apart with one cheap authenticated call.
async fn check(State(bridge): State<Arc<Bridge>>, Path(model): Path<String>) -> Response {
    let Some(m) = bridge.models.get(&model) else {
        return BridgeError::UnknownModel(model).into_response();
    };
    let outcome = probe(bridge.upstream.client(), m).await;
    let body = match outcome {
        Ok(()) => json!({"ok": true}),
        Err(e) => json!({"ok": false, "error": e.to_string(), "reason": e.reason()}),
    };
    axum::Json(body).into_response()
}

/// `POST /v1/messages`.
///
/// The body's top level is split once into raw members (a duplicate top-level key refused),
/// which says the model (so the provider) and whether the answer streams. An `openai` model's
/// request is then parsed once more, never into a `serde_json::Value` tree: with its strings
/// borrowed ([`AnthropicBody`]) when that path takes it and no URL source can be in it, else into
/// the typed request, checked for URL sources; then translated and written out: what the
/// sanitizer removes (server tools, `mcp_servers`, `container`, `context_management`, unknown
/// fields) has no place in a chat request anyway. An `anthropic` model's request is passed
/// through `policy::sanitize::raw`: every member walked once (duplicate keys refused at any
/// depth, URL sources unless allowed), the sanitizer's edits and `metadata.user_id` written
/// anew, everything else sent as the client's bytes. The common `openai` body (its model named
/// first, taken by the borrowed translation) skips the split: [`translated_at_once`].
async fn messages(
    State(bridge): State<Arc<Bridge>>,
    req: Request,
) -> Result<Response, BridgeError> {
    let (parts, body) = req.into_parts();
    let bytes = read_body(&bridge, &parts.headers, body).await?;
    if let Some((model, key, chat, resp_opts, stream)) = translated_at_once(&bridge, &bytes) {
        tracing::debug!(model = %model.id, provider = model.provider.as_str(), stream, bytes = bytes.len(), "messages");
        let target = chat_target(model, key, bytes.len());
        drop(bytes);
        let answer = bridge
            .upstream
            .chat_for_anthropic(target, chat, resp_opts, stream)
            .await?;
        return Ok(answer.into_response().await);
    }
    let request = raw::parse(&bytes).map_err(refusal)?;
    let model_id = match small(request.member("model"))? {
        Some(Value::String(s)) => s,
        Some(_) => {
            return Err(BridgeError::InvalidRequest(
                "model: expected a string".into(),
            ));
        }
        None => return Err(BridgeError::InvalidRequest("model: field required".into())),
    };
    let stream = match small(request.member("stream"))? {
        None | Some(Value::Null) | Some(Value::Bool(false)) => false,
        Some(Value::Bool(true)) => true,
        Some(_) => {
            return Err(BridgeError::InvalidRequest(
                "stream: expected a boolean".into(),
            ));
        }
    };
    let model = bridge
        .models
        .get(&model_id)
        .ok_or_else(|| BridgeError::UnknownModel(model_id.clone()))?;
    let key = model.key.as_ref().ok_or_else(|| BridgeError::NoKey {
        model: model.id.clone(),
        key_env: model.key_env.clone(),
    })?;
    tracing::debug!(model = %model.id, provider = model.provider.as_str(), stream, bytes = bytes.len(), "messages");
    let answer = match model.provider {
        Provider::Anthropic => {
            let sanitized = request
                .sanitize_to_pieces(&raw::Options {
                    model: &model.upstream_model,
                    allow_url_sources: model.allow_url_sources,
                    max_tokens_cap: None,
                    // Claude Code's device, account and session ids: not the provider's
                    // business.
                    strip_metadata_user_id: !model.forward_user_id,
                    estimate: None,
                })
                .map_err(refusal)?;
            drop(request);
            // The client's members go upstream as they came (shared, not copied).
            let body = Parts::from_pieces(&bytes, sanitized.body)?;
            drop(bytes);
            let target = AnthropicTarget {
                url: &model.endpoint,
                auth: Auth::ApiKey(key),
                version: anthropic_version(&parts.headers),
                size_hint: usize::try_from(body.len()).unwrap_or(usize::MAX),
            };
            bridge.upstream.anthropic_parts(target, body).await?
        }
        Provider::Openai => {
            drop(request);
            let target = chat_target(model, key, bytes.len());
            // The borrowed translation where it takes the body and no URL source can be in it
            // (else the typed request, whose walk applies the rule), all before the body is
            // freed.
            let borrowed = simdutf8::basic::from_utf8(&bytes)
                .ok()
                .filter(|text| model.allow_url_sources || !crate::typed::may_hold_url_source(text))
                .and_then(AnthropicBody::parse)
                .map(|b| {
                    let mut chat = BodyBuf::with_capacity(b.chat_size_hint());
                    b.write_chat_into(&target.chat, None, chat.vec_mut());
                    (chat.freeze(), b.response_options(), b.stream())
                });
            match borrowed {
                Some((chat, resp_opts, stream)) => {
                    drop(bytes);
                    bridge
                        .upstream
                        .chat_for_anthropic(target, chat, resp_opts, stream)
                        .await?
                }
                None => {
                    let request: MessagesRequest =
                        serde_json::from_slice(&bytes).map_err(json_error)?;
                    drop(bytes);
                    if !model.allow_url_sources {
                        crate::typed::refuse_url_sources(&request)
                            .map_err(|e| BridgeError::InvalidRequest(e.to_string()))?;
                    }
                    bridge.upstream.anthropic_via_chat(target, request).await?
                }
            }
        }
    };
    Ok(answer.into_response().await)
}

/// How an `openai` model's translated request is sent to its endpoint with `key`; `body_len`
/// is the client's body's.
fn chat_target<'a>(model: &'a RemoteModel, key: &'a Secret, body_len: usize) -> ChatTarget<'a> {
    ChatTarget {
        url: &model.endpoint,
        auth: Auth::Bearer(key),
        chat: chat_options(model),
        // Report the model the client asked for, not the provider's name for it.
        reported_model: model.id.clone(),
        // A rough count (4 bytes a token) until the provider's usage arrives.
        input_tokens_estimate: (body_len / 4) as u64,
    }
}

/// How an `openai` model's request is translated.
fn chat_options(model: &RemoteModel) -> ChatOptions {
    ChatOptions {
        model: Some(model.upstream_model.clone()),
        max_output_tokens: model.max_output_tokens,
        reasoning: match model.reasoning {
            Reasoning::None => ReasoningField::None,
            Reasoning::ReasoningEffort => ReasoningField::ReasoningEffort,
            Reasoning::Reasoning => ReasoningField::Reasoning,
        },
        forward_user: model.forward_user_id,
        ..ChatOptions::default()
    }
}

/// The common case in one parse: a body whose first member names an `openai` model with a
/// key, taken whole by the borrowed translation ([`AnthropicBody::parse_unique_keys`]: valid
/// JSON, an object, no top-level key twice) and clear of URL sources. For such a body the steps
/// of [`messages`] (the top-level split, `model`, `stream`, the model and its key, then the
/// borrowed translation) all pass and give this translation, so they are skipped; `None`
/// sends every other body through them, errors included.
fn translated_at_once<'b>(
    bridge: &'b Bridge,
    bytes: &[u8],
) -> Option<(&'b RemoteModel, &'b Secret, Bytes, ResponseOptions, bool)> {
    let model = bridge.models.get(first_model(bytes)?)?;
    let key = model.key.as_ref()?;
    if !matches!(model.provider, Provider::Openai) {
        return None;
    }
    let text = simdutf8::basic::from_utf8(bytes).ok()?;
    let body = if model.allow_url_sources {
        AnthropicBody::parse_unique_keys(text)?
    } else {
        // One search for `\u` serves both the URL-source rule and the parse's surrogate check.
        let text = NoUnicodeEscapes::check(text)?;
        if crate::typed::may_hold_url_member(text) {
            return None;
        }
        AnthropicBody::parse_unique_keys_checked(text)?
    };
    if body.model() != model.id {
        return None;
    }
    // Written into a pooled buffer (a ~100 KB body would otherwise be an mmap and a munmap of
    // its own; see `agentbox_http::bufpool`).
    let mut chat = BodyBuf::with_capacity(body.chat_size_hint());
    body.write_chat_into(&chat_options(model), None, chat.vec_mut());
    Some((
        model,
        key,
        chat.freeze(),
        body.response_options(),
        body.stream(),
    ))
}

/// The `model` of a body whose first member it is, as a string without escapes (how Claude Code
/// sends it); `None` otherwise. Only a hint: the body is parsed in full afterwards.
fn first_model(bytes: &[u8]) -> Option<&str> {
    let space = |b: &u8| matches!(b, b' ' | b'\t' | b'\n' | b'\r');
    let skip = |s: &[u8]| -> usize { s.iter().take_while(|b| space(b)).count() };
    let mut rest = bytes;
    rest = &rest[skip(rest)..];
    rest = rest.strip_prefix(b"{")?;
    rest = &rest[skip(rest)..];
    rest = rest.strip_prefix(b"\"model\"")?;
    rest = &rest[skip(rest)..];
    rest = rest.strip_prefix(b":")?;
    rest = &rest[skip(rest)..];
    rest = rest.strip_prefix(b"\"")?;
    let end = rest.iter().position(|b| matches!(b, b'"' | b'\\'))?;
    if rest[end] != b'"' {
        return None;
    }
    std::str::from_utf8(&rest[..end]).ok()
}

/// A top-level member read before the provider is known (`model`, `stream`: small values).
fn small(raw: Option<&RawValue>) -> Result<Option<Value>, BridgeError> {
    raw.map(|raw| serde_json::from_str(raw.get()).map_err(json_error))
        .transpose()
}

/// A sanitizer refusal: not JSON (400, "not valid JSON"), else a 400 naming what is wrong.
fn refusal(e: SanitizeError) -> BridgeError {
    match e {
        SanitizeError::Json(e) => json_error(e),
        e @ (SanitizeError::DuplicateKey(_)
        | SanitizeError::NotAnObject { .. }
        | SanitizeError::ToolsNotArray { .. }
        | SanitizeError::ToolNotObject { .. }
        | SanitizeError::UrlSource { .. }) => BridgeError::InvalidRequest(e.to_string()),
    }
}

/// A body serde_json refused: not JSON at all (400, "not valid JSON"), or JSON of the wrong
/// shape (400 naming what is wrong).
fn json_error(e: serde_json::Error) -> BridgeError {
    match e.classify() {
        Category::Syntax | Category::Eof | Category::Io => {
            BridgeError::MalformedJson(e.to_string())
        }
        Category::Data => BridgeError::InvalidRequest(e.to_string()),
    }
}

/// Reads the body under the size limit and the body timeout.
async fn read_body(bridge: &Bridge, headers: &HeaderMap, body: Body) -> Result<Bytes, BridgeError> {
    agentbox_http::read_body(headers, body, bridge.max_body_bytes, bridge.body_timeout)
        .await
        .map_err(|e| match e {
            BodyError::TooLarge { limit } => BridgeError::BodyTooLarge {
                limit_mb: limit >> 20,
            },
            BodyError::Timeout(t) => BridgeError::BodyTimeout(t.as_secs()),
            BodyError::Read(m) => BridgeError::BodyRead(m),
        })
}

#[cfg(test)]
mod tests {
    use super::first_model;

    #[test]
    fn first_model_reads_only_a_plain_first_member() {
        assert_eq!(first_model(br#"{"model":"gpt","x":1}"#), Some("gpt"));
        assert_eq!(first_model(b" {\n \"model\" : \"g p\" , }"), Some("g p"));
        // Not first, escaped, not a string, unterminated: left to the full split.
        for body in [
            &br#"{"x":1,"model":"gpt"}"#[..],
            br#"{"model":"g\u0070t"}"#,
            br#"{"model":7}"#,
            br#"{"model":"gpt"#,
            br#"["model","gpt"]"#,
            b"",
        ] {
            assert_eq!(first_model(body), None, "{}", String::from_utf8_lossy(body));
        }
    }
}
