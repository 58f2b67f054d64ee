//! The proxy's HTTP surface: `GET /__proxy_health`, model calls (any path ending in
//! `/chat/completions`, `/messages` or `/responses`, POST), and plain forwarding of everything
//! else. A model call goes: read and parse the body, translate it to a chat completion, apply
//! the policy, be admitted (held while paused, refused past `max_steps`), go upstream with the
//! proxy's tags, come back (translated, counted, failures recorded for the turn).

use std::sync::Arc;
use std::time::Duration;

use agentbox_http::BodyError;
use agentbox_llm::body::{
    ChatToAnthropic, ChatToResponses, LlmBody, StreamTranslator, UpstreamStream, upstream_stream,
};
use agentbox_llm::client::{MAX_ANSWER_BODY, MAX_ERROR_BODY, Parts, read_capped};
use agentbox_llm::{ErrorReply, LlmError, Protocol};
use agentbox_wire::anthropic::ErrorType;
use agentbox_wire::chat::{ChatRequest, ChatResponse};
use agentbox_wire::translate::{
    AnthropicBody, ChatOptions, ResponseOptions, ResponsesOptions, TranslateError,
    anthropic_into_chat, chat_to_anthropic_response, chat_to_responses_response,
    responses_into_chat,
};
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use serde_json::{Number, Value, json};

use super::headers::{self, CallKind};
use super::meter::{ChatMeter, Metered};
use super::rewrite::{self, Edit};
use super::state::{Admission, CallGuard, Recorded};
use super::upstream::{self, Prelude, Synthetic};
use super::{Core, MAX_REQUEST_BODY};

/// How long a client may take to send its request body (loopback: this is generous).
const BODY_TIMEOUT: Duration = Duration::from_secs(120);

/// The proxy's router.
pub(crate) fn router(core: Arc<Core>) -> Router {
    Router::new()
        .route("/__proxy_health", get(health))
        .fallback(handle)
        .with_state(core)
}

async fn health() -> Response {
    axum::Json(json!({"ok": true})).into_response()
}

/// The client protocols of model calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    Chat,
    Anthropic,
    Responses,
}

impl Api {
    /// The reference's matching: POST to a path ending in the protocol's endpoint, under any
    /// prefix.
    fn of(method: &Method, path: &str) -> Option<Api> {
        if method != Method::POST {
            return None;
        }
        let p = path.trim_end_matches('/');
        if p.ends_with("/chat/completions") {
            Some(Api::Chat)
        } else if p.ends_with("/messages") {
            Some(Api::Anthropic)
        } else if p.ends_with("/responses") {
            Some(Api::Responses)
        } else {
            None
        }
    }

    fn protocol(self) -> Protocol {
        match self {
            Api::Anthropic => Protocol::Anthropic,
            Api::Chat | Api::Responses => Protocol::OpenAi,
        }
    }

    fn synthetic(self) -> Synthetic {
        match self {
            Api::Chat => Synthetic::Chat,
            Api::Anthropic => Synthetic::Anthropic,
            Api::Responses => Synthetic::Responses,
        }
    }
}

/// Why the proxy itself refused or failed a call.
#[derive(Debug, thiserror::Error)]
pub(crate) enum CallError {
    #[error(transparent)]
    Body(#[from] BodyError),
    #[error("request body is not a JSON object: {0}")]
    NotJson(String),
    #[error("{0}")]
    Invalid(String),
    #[error("the proxy is shutting down")]
    Closing,
    #[error(transparent)]
    Llm(#[from] LlmError),
    #[error("Turn exceeded max_steps.")]
    MaxSteps { max_steps: u32, attempted_step: u64 },
}

impl CallError {
    /// The one mapping to what the client sees, in its protocol's shape.
    fn into_response(self, protocol: Protocol) -> Response {
        let (status, kind, message) = match self {
            CallError::Body(BodyError::TooLarge { limit }) => (
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorType::RequestTooLarge,
                format!("request body is over {} MiB", limit >> 20),
            ),
            CallError::Body(e @ BodyError::Timeout(_)) => (
                StatusCode::REQUEST_TIMEOUT,
                ErrorType::InvalidRequestError,
                e.to_string(),
            ),
            CallError::Body(e @ BodyError::Read(_)) => (
                StatusCode::BAD_REQUEST,
                ErrorType::InvalidRequestError,
                e.to_string(),
            ),
            e @ (CallError::NotJson(_) | CallError::Invalid(_)) => (
                StatusCode::BAD_REQUEST,
                ErrorType::InvalidRequestError,
                e.to_string(),
            ),
            e @ CallError::Closing => (
                StatusCode::SERVICE_UNAVAILABLE,
                ErrorType::OverloadedError,
                e.to_string(),
            ),
            CallError::Llm(e) => return e.reply().into_response(protocol),
            CallError::MaxSteps {
                max_steps,
                attempted_step,
            } => return max_steps_response(protocol, max_steps, attempted_step),
        };
        ErrorReply::new(status, kind, message).into_response(protocol)
    }
}

/// The reference's 429 for a call past `max_steps`, in the client's protocol.
fn max_steps_response(protocol: Protocol, max_steps: u32, attempted_step: u64) -> Response {
    let error = json!({
        "message": "Turn exceeded max_steps.",
        "type": "rate_limit_error",
        "code": "max_steps_exceeded",
        "details": {"max_steps": max_steps, "attempted_step": attempted_step},
    });
    let body = match protocol {
        Protocol::Anthropic => json!({"type": "error", "error": error}),
        Protocol::OpenAi => json!({ "error": error }),
    };
    (
        StatusCode::TOO_MANY_REQUESTS,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn handle(State(core): State<Arc<Core>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let api = Api::of(&parts.method, parts.uri.path());
    let protocol = match api {
        Some(a) => a.protocol(),
        None if parts.uri.path().contains("/messages") => Protocol::Anthropic,
        None => Protocol::OpenAi,
    };
    let bytes = match agentbox_http::read_body(&parts.headers, body, MAX_REQUEST_BODY, BODY_TIMEOUT)
        .await
    {
        Ok(b) => b,
        Err(e) => return CallError::from(e).into_response(protocol),
    };
    let result = match api {
        Some(api) => model_call(&core, api, &parts.headers, bytes).await,
        None => plain(&core, &parts, bytes).await,
    };
    result.unwrap_or_else(|e| e.into_response(protocol))
}

/// How the upstream's chat answer goes back to the client.
enum Back {
    Chat,
    Anthropic(Box<ResponseOptions>),
    Responses(Box<ResponsesOptions>),
}

/// The upstream chat body and how to answer, from the client's body.
fn prepare(core: &Core, api: Api, bytes: Bytes) -> Result<(Parts, Back, bool), CallError> {
    let policy = &core.settings.policy;
    match api {
        Api::Chat => {
            let peeked = rewrite::peek(&bytes, policy).map_err(CallError::NotJson)?;
            // A complying body goes as the client sent it: no parse, no re-serializing; one
            // missing members gets them between two slices of it, not in a copy.
            let out = match &peeked.edit {
                Edit::None => Parts::new([bytes]),
                Edit::Add(members) => {
                    let (at, added) = rewrite::insertion(&bytes, members);
                    Parts::new([bytes.slice(..at), Bytes::from(added), bytes.slice(at..)])
                }
                Edit::Rewrite => {
                    let Ok(Value::Object(mut map)) = serde_json::from_slice::<Value>(&bytes) else {
                        return Err(CallError::NotJson("expected an object".into()));
                    };
                    rewrite::apply(&mut map, policy);
                    Parts::new([Bytes::from(Value::Object(map).to_string())])
                }
            };
            Ok((out, Back::Chat, peeked.stream))
        }
        Api::Anthropic => {
            if let Some((body, opts, stream)) = borrowed_to_chat(&bytes, policy) {
                return Ok((Parts::new([body]), Back::Anthropic(Box::new(opts)), stream));
            }
            let (body, opts, stream) = to_chat(
                &bytes,
                policy,
                ResponseOptions::for_request,
                anthropic_into_chat,
            )?;
            Ok((Parts::new([body]), Back::Anthropic(Box::new(opts)), stream))
        }
        Api::Responses => {
            let (body, opts, stream) = to_chat(
                &bytes,
                policy,
                ResponsesOptions::for_request,
                responses_into_chat,
            )?;
            Ok((Parts::new([body]), Back::Responses(Box::new(opts)), stream))
        }
    }
}

/// An Anthropic request translated on its borrowed strings ([`AnthropicBody`]) with the policy
/// applied as [`rewrite::apply_typed`] applies it to the owned translation: `None` when that
/// path leaves the body to the owned one ([`to_chat`]).
fn borrowed_to_chat(
    bytes: &[u8],
    policy: &rewrite::Policy,
) -> Option<(Bytes, ResponseOptions, bool)> {
    let body = AnthropicBody::parse(std::str::from_utf8(bytes).ok()?)?;
    let opts = ChatOptions {
        model: policy.model_override.clone(),
        ..ChatOptions::router()
    };
    // `stream_options` needs nothing more: `ChatOptions::router` asks for usage on streams, and a
    // translated body that does not stream has none.
    let temperature = policy.default_temperature.and_then(Number::from_f64);
    let chat = body.write_chat(&opts, temperature.as_ref());
    Some((Bytes::from(chat), body.response_options(), body.stream()))
}

/// A client request of protocol `R` as the chat body sent upstream (policy applied), the
/// options for translating the answer back, and whether it streams.
fn to_chat<R: DeserializeOwned, O>(
    bytes: &[u8],
    policy: &rewrite::Policy,
    answer_options: impl FnOnce(&R) -> O,
    into_chat: impl FnOnce(R, &ChatOptions) -> Result<ChatRequest, TranslateError>,
) -> Result<(Bytes, O, bool), CallError> {
    let req: R = serde_json::from_slice(bytes).map_err(|e| {
        if e.is_syntax() || e.is_eof() {
            CallError::NotJson(e.to_string())
        } else {
            CallError::Invalid(e.to_string())
        }
    })?;
    let opts = answer_options(&req);
    let mut chat =
        into_chat(req, &ChatOptions::router()).map_err(|e| CallError::Invalid(e.to_string()))?;
    rewrite::apply_typed(&mut chat, policy);
    let stream = chat.stream == Some(true);
    let body = serde_json::to_vec(&chat).map_err(|e| CallError::Invalid(e.to_string()))?;
    Ok((Bytes::from(body), opts, stream))
}

async fn model_call(
    core: &Core,
    api: Api,
    client_headers: &HeaderMap,
    bytes: Bytes,
) -> Result<Response, CallError> {
    let (body, back, stream) = prepare(core, api, bytes)?;
    let guard = match core.shared.admit().await {
        Admission::Admitted(g) => g,
        Admission::MaxSteps {
            snapshot,
            max_steps,
        } => {
            tracing::info!(turn = ?snapshot.turn_id, step = snapshot.step, "model call past max_steps refused");
            return Err(CallError::MaxSteps {
                max_steps,
                attempted_step: snapshot.step,
            });
        }
        Admission::Closing => return Err(CallError::Closing),
    };
    let snapshot = guard.snapshot().clone();
    let kind = match api {
        Api::Anthropic => CallKind::AnthropicModel,
        Api::Chat | Api::Responses => CallKind::Model,
    };
    let version = core.shared.lock().version.clone();
    let headers = headers::upstream_headers(
        client_headers,
        kind,
        &core.settings.tags,
        snapshot.turn_id.as_deref(),
        version.as_deref(),
    );
    let url = &core.settings.chat_url;
    tracing::debug!(?api, stream, turn = ?snapshot.turn_id, step = snapshot.step, bytes = body.len(), "model call");
    let resp = match core
        .upstream
        .client()
        .post(core.settings.chat_target.clone())
        .headers(headers)
        .body(body)
        .send()
        .await
    {
        Ok(r) => r,
        Err(e) => {
            let err = LlmError::from_transport(&e);
            let status = err.reply().status.as_u16();
            core.shared.record(
                guard.scope(),
                Recorded::FailedUpstream,
                upstream::unreachable_upstream(&snapshot, url, status, &err.to_string()),
            );
            return Err(err.into());
        }
    };
    let status = resp.status();
    if !status.is_success() {
        let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
        let body = read_capped(resp, MAX_ERROR_BODY).await.unwrap_or_default();
        return Ok(upstream_failure(
            core,
            &guard,
            api,
            stream,
            status.as_u16(),
            Bytes::from(body),
            content_type,
        ));
    }
    let mut passed = response_headers(resp.headers());
    if stream {
        let (head, rest) = match upstream::prelude(upstream_stream(resp)).await {
            Ok(Prelude::Stream { head, rest }) => (head, rest),
            Ok(Prelude::Error { status, body }) => {
                return Ok(upstream_failure(
                    core,
                    &guard,
                    api,
                    stream,
                    status,
                    body,
                    Some(HeaderValue::from_static("application/json")),
                ));
            }
            Err(e) => {
                tracing::warn!(error = %agentbox_http::error_chain(e.as_ref()), "upstream broke before its first frame");
                return Err(LlmError::Unreachable(e.to_string()).into());
            }
        };
        let upstream: UpstreamStream = if head.is_empty() {
            rest
        } else {
            Box::pin(futures_util::stream::once(async move { Ok(head) }).chain(rest))
        };
        let body = match back {
            Back::Chat => LlmBody::passthrough(
                Box::pin(Metered::new(upstream, guard, true)),
                Some(Protocol::OpenAi),
            ),
            Back::Anthropic(opts) => {
                passed = HeaderMap::new();
                translated(upstream, guard, Box::new(ChatToAnthropic::new(*opts)))
            }
            Back::Responses(opts) => {
                passed = HeaderMap::new();
                translated(upstream, guard, Box::new(ChatToResponses::new(*opts)))
            }
        };
        return Ok(stream_response(body, passed).await);
    }
    let raw = read_capped(resp, MAX_ANSWER_BODY)
        .await
        .map_err(|e| LlmError::from_transport(&e))?;
    guard.add_counts(&ChatMeter::from_json(&raw));
    drop(guard);
    let invalid = |what: String| {
        tracing::warn!(error = %what, "upstream sent an invalid chat completion");
        LlmError::InvalidResponse(what)
    };
    let parse = || -> Result<ChatResponse, LlmError> {
        serde_json::from_slice(&raw).map_err(|e| invalid(format!("not a chat completion: {e}")))
    };
    let json = match back {
        Back::Chat => {
            let mut r = Response::new(Body::from(raw));
            *r.headers_mut() = passed;
            return Ok(r);
        }
        Back::Anthropic(opts) => {
            let message =
                chat_to_anthropic_response(parse()?, &opts).map_err(|e| invalid(e.to_string()))?;
            serde_json::to_vec(&message)
        }
        Back::Responses(opts) => {
            let response =
                chat_to_responses_response(parse()?, &opts).map_err(|e| invalid(e.to_string()))?;
            serde_json::to_vec(&response)
        }
    }
    .map_err(|e| invalid(e.to_string()))?;
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        Bytes::from(json),
    )
        .into_response())
}

fn translated(
    upstream: UpstreamStream,
    guard: CallGuard,
    translator: Box<dyn StreamTranslator>,
) -> LlmBody {
    LlmBody::translated(Box::pin(Metered::new(upstream, guard, false)), translator)
}

/// An event-stream response: the upstream's headers when passed through, else ours.
async fn stream_response(body: LlmBody, mut headers: HeaderMap) -> Response {
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream"),
    );
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    let mut r = Response::new(body.into_body().await);
    *r.headers_mut() = headers;
    r
}

/// The upstream's response headers a client may see.
fn response_headers(upstream: &HeaderMap) -> HeaderMap {
    let mut out = HeaderMap::with_capacity(upstream.len());
    for (name, value) in upstream {
        if !headers::is_unforwarded_response_header(name) && name != header::CONTENT_LENGTH {
            out.append(name.clone(), value.clone());
        }
    }
    out
}

/// The router answered an error (or reported one in its first frame): record what the turn
/// needs, then answer the agent as the reference does.
fn upstream_failure(
    core: &Core,
    guard: &CallGuard,
    api: Api,
    stream: bool,
    status: u16,
    body: Bytes,
    content_type: Option<HeaderValue>,
) -> Response {
    let snapshot = guard.snapshot();
    tracing::warn!(status, turn = ?snapshot.turn_id, step = snapshot.step, body = %upstream::preview(&body, 2000), "router returned an error");
    let shared = &core.shared;
    if let Some(v) = upstream::context_overflow(status, &body) {
        shared.record(guard.scope(), Recorded::ContextOverflow, v);
    }
    if guard.scope().is_some()
        && let Some(v) = upstream::rollout_invalidated(status, &body)
    {
        shared.record(guard.scope(), Recorded::RolloutInvalidated, v);
        return upstream::synthetic(api.synthetic(), stream);
    }
    shared.record(
        guard.scope(),
        Recorded::FailedUpstream,
        upstream::failed_upstream(snapshot, &core.settings.chat_url, status, &body),
    );
    match api {
        Api::Anthropic => upstream::anthropic_error(status, &body),
        Api::Chat | Api::Responses => upstream::passthrough_error(status, body, content_type),
    }
}

/// Whether `path` reaches the router as it reads: no `.` or `..` segment (percent-encoded
/// ones included) and no backslash, which the upstream client's URL parser would resolve
/// (`/v1/chat/x/../completions` becomes `/v1/chat/completions`), turning a request that is
/// not a model call here into one at the router: untagged, unmetered, past `max_steps` and
/// the pause.
fn in_normal_form(path: &str) -> bool {
    !path.contains('\\')
        && path.split('/').all(|segment| {
            let s = segment.to_ascii_lowercase().replace("%2e", ".");
            s != "." && s != ".."
        })
}

/// Anything that is not a model call: forwarded to `{origin}{path}` untagged.
async fn plain(
    core: &Core,
    parts: &axum::http::request::Parts,
    bytes: Bytes,
) -> Result<Response, CallError> {
    if !in_normal_form(parts.uri.path()) {
        return Err(CallError::Invalid(format!(
            "path {} has dot segments or backslashes; send it resolved",
            parts.uri.path()
        )));
    }
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let url = format!("{}{path}", core.settings.origin);
    let headers = headers::upstream_headers(
        &parts.headers,
        CallKind::Plain,
        &core.settings.tags,
        None,
        None,
    );
    let resp = core
        .upstream
        .client()
        .request(parts.method.clone(), &url)
        .headers(headers)
        .body(bytes)
        .send()
        .await
        .map_err(|e| LlmError::from_transport(&e))?;
    let status = resp.status();
    let passed = response_headers(resp.headers());
    let mut r = Response::new(
        LlmBody::passthrough(upstream_stream(resp), None)
            .into_body()
            .await,
    );
    *r.status_mut() = status;
    *r.headers_mut() = passed;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_a_url_parser_would_resolve_are_not_forwarded() {
        for bad in [
            "/v1/chat/x/../completions",
            "/v1/chat/./completions",
            "/v1/chat/x/%2e%2E/completions",
            "/v1/chat/x/.%2e/completions",
            "/v1/chat\\completions",
            "/..",
        ] {
            assert!(!in_normal_form(bad), "{bad}");
        }
        for good in [
            "/v1/models",
            "/",
            "/v1/messages/count_tokens",
            "/a/..b/c",
            "/a/.well-known",
        ] {
            assert!(in_normal_form(good), "{good}");
        }
    }

    #[test]
    fn model_calls_match_any_prefix_and_only_post() {
        let post = Method::POST;
        assert_eq!(Api::of(&post, "/v1/chat/completions"), Some(Api::Chat));
        assert_eq!(
            Api::of(&post, "/custom-prefix/chat/completions/"),
            Some(Api::Chat)
        );
        assert_eq!(Api::of(&Method::GET, "/v1/chat/completions"), None);
        assert_eq!(Api::of(&post, "/v1/responses"), Some(Api::Responses));
        assert_eq!(Api::of(&post, "/x/responses"), Some(Api::Responses));
        assert_eq!(Api::of(&post, "/v1/messages"), Some(Api::Anthropic));
        assert_eq!(Api::of(&post, "/v1/messages/count_tokens"), None);
        assert_eq!(Api::of(&post, "/v1/models"), None);
    }

    /// The borrowed translation with the policy applied is the owned one's, for every policy.
    #[test]
    fn borrowed_translation_agrees_with_the_typed_one() {
        let bodies = [
            json!({"model": "claude", "stream": true, "max_tokens": 9, "system": "s",
                "messages": [{"role": "user", "content": "hi"},
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "Bash", "input": {"c": "ls"}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}],
                "tools": [{"name": "Bash", "input_schema": {"type": "object"}}], "top_k": 3,
                "metadata": {"user_id": "u"}}),
            json!({"model": "claude", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}),
            json!({"model": "claude", "stream": false, "messages": []}),
        ];
        let policies = [
            rewrite::Policy::default(),
            rewrite::Policy {
                model_override: Some("router-model".into()),
                default_temperature: Some(0.6),
            },
        ];
        for body in bodies {
            let bytes = serde_json::to_vec(&body).unwrap();
            for policy in &policies {
                let (fast, fast_opts, fast_stream) = borrowed_to_chat(&bytes, policy).unwrap();
                let (typed, typed_opts, typed_stream) = to_chat(
                    &bytes,
                    policy,
                    ResponseOptions::for_request,
                    anthropic_into_chat,
                )
                .unwrap();
                assert_eq!(
                    serde_json::from_slice::<Value>(&fast).unwrap(),
                    serde_json::from_slice::<Value>(&typed).unwrap()
                );
                assert_eq!(fast_opts, typed_opts);
                assert_eq!(fast_stream, typed_stream);
            }
        }
    }
}
