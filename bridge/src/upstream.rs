//! Calling providers: Anthropic passthrough, OpenAI chat completions with translation both
//! ways, the `/check` probe, and the mapping of provider errors to what an Anthropic client
//! should see.
//!
//! Streams are forwarded as they arrive: each upstream chunk becomes response bytes as soon as
//! it is read (translated on the way for OpenAI), nothing waits for the whole response. The
//! response body owns the upstream stream, so a client that goes away drops it, which closes
//! the upstream connection and cancels the generation.

use agentbox_wire::anthropic::{ErrorType, MessagesRequest, StreamEvent};
use agentbox_wire::chat::ChatResponse;
use agentbox_wire::error::client_error_for_upstream;
use agentbox_wire::sse;
use agentbox_wire::translate::{
    ChatOptions, ChatStreamTranslator, ResponseOptions, ToolNames, anthropic_into_chat,
    chat_to_anthropic_response,
};
use axum::body::Body;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use serde_json::Value;

use agentbox_policy::secret::Secret;

use crate::RemoteModel;
use crate::error::BridgeError;

/// The largest non-streamed provider response we accept (a response is the model's output:
/// far below this).
const MAX_RESPONSE_BYTES: usize = 64 << 20;

/// The `anthropic-version` sent when the client sent none.
pub const DEFAULT_ANTHROPIC_VERSION: &str = "2023-06-01";

/// Why `/check/{model}` says a model cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// The key variable is unset.
    #[error("no key configured (${0} is not set)")]
    NoKey(String),
    /// Connecting or talking to the provider failed.
    #[error("upstream unreachable: {0}")]
    Unreachable(String),
    /// The provider refused the key.
    #[error("auth refused: upstream answered {0}")]
    AuthRefused(u16),
    /// The provider answered with another error status.
    #[error("upstream error: status {0}")]
    Status(u16),
}

impl CheckError {
    /// A stable machine-readable reason.
    pub fn reason(&self) -> &'static str {
        match self {
            CheckError::NoKey(_) => "no_key",
            CheckError::Unreachable(_) => "unreachable",
            CheckError::AuthRefused(_) => "auth_refused",
            CheckError::Status(_) => "upstream_error",
        }
    }
}

/// Probes the provider's model list with the model's key: the cheapest authenticated call both
/// APIs have.
pub async fn check(client: &reqwest::Client, model: &RemoteModel) -> Result<(), CheckError> {
    let key = model
        .key
        .as_ref()
        .ok_or_else(|| CheckError::NoKey(model.key_env.clone()))?;
    let req = match model.provider {
        agentbox_policy::config::Provider::Openai => client
            .get(format!("{}/models", model.base_url))
            .bearer_auth(key.expose()),
        agentbox_policy::config::Provider::Anthropic => client
            .get(format!("{}/v1/models", model.base_url))
            .header("x-api-key", key.expose())
            .header("anthropic-version", DEFAULT_ANTHROPIC_VERSION),
    };
    let resp = req
        .timeout(std::time::Duration::from_secs(10))
        .send()
        .await
        .map_err(|e| CheckError::Unreachable(agentbox_http::error_chain(&e)))?;
    let status = resp.status();
    if status.is_success() {
        Ok(())
    } else if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
        Err(CheckError::AuthRefused(status.as_u16()))
    } else {
        Err(CheckError::Status(status.as_u16()))
    }
}

/// Passes a sanitized request to an Anthropic provider and its answer back, streamed or not.
pub async fn anthropic(
    client: &reqwest::Client,
    model: &RemoteModel,
    key: &Secret,
    version: &str,
    body: &Value,
) -> Result<Response, BridgeError> {
    let bytes = serde_json::to_vec(body).map_err(|e| BridgeError::InvalidRequest(e.to_string()))?;
    let resp = client
        .post(format!("{}/v1/messages", model.base_url))
        .header("x-api-key", key.expose())
        .header("anthropic-version", version)
        .header(header::CONTENT_TYPE, "application/json")
        .body(bytes)
        .send()
        .await
        .map_err(send_error)?;
    if !resp.status().is_success() {
        return Err(error_from_response(resp).await);
    }
    let status = resp.status();
    let content_type = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or(HeaderValue::from_static("application/json"));
    let is_sse = content_type.as_bytes().starts_with(b"text/event-stream");
    // State: whether the bytes so far end at an SSE frame boundary, and whether the stream
    // already failed (nothing may follow the error).
    let stream = resp
        .bytes_stream()
        .scan((true, false), move |(at_boundary, failed), chunk| {
            let item = match chunk {
                _ if *failed => None,
                Ok(b) => {
                    if !b.is_empty() {
                        *at_boundary = sse::ends_frame(&b);
                    }
                    Some(Ok::<Bytes, std::io::Error>(b))
                }
                // A stream that breaks is ended with an Anthropic `error` event, so the client
                // sees an error rather than a silently truncated answer. A non-stream body cannot
                // be repaired: abort the response.
                Err(e) if is_sse => {
                    tracing::warn!(error = %e, "upstream stream broke");
                    *failed = true;
                    Some(Ok(Bytes::from(StreamEvent::failure_frame(
                        !*at_boundary,
                        format!("upstream stream broke: {}", agentbox_http::error_chain(&e)),
                    ))))
                }
                Err(e) => {
                    *failed = true;
                    Some(Err(std::io::Error::other(agentbox_http::error_chain(&e))))
                }
            };
            futures_util::future::ready(item)
        });
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(Body::from_stream(stream))
        .map_err(|e| BridgeError::UpstreamInvalid(e.to_string()))
}

/// Translates to OpenAI chat completions, calls the provider, translates the answer back.
pub async fn openai(
    client: &reqwest::Client,
    model: &RemoteModel,
    key: &Secret,
    body: Value,
    body_len: usize,
    stream: bool,
) -> Result<Response, BridgeError> {
    let req: MessagesRequest =
        serde_json::from_value(body).map_err(|e| BridgeError::InvalidRequest(e.to_string()))?;
    let resp_opts = ResponseOptions {
        // Report the model the client asked for, not the provider's name for it.
        model: Some(model.id.clone()),
        message_id: None,
        tool_names: ToolNames::from_request(&req),
        stop_sequences: req.stop_sequences.clone().unwrap_or_default(),
        // A rough count (4 bytes a token) until the provider's usage arrives.
        input_tokens_estimate: (body_len / 4) as u64,
    };
    let opts = ChatOptions {
        model: Some(model.upstream_model.clone()),
        max_output_tokens: model.max_output_tokens,
        ..ChatOptions::default()
    };
    let chat =
        anthropic_into_chat(req, &opts).map_err(|e| BridgeError::InvalidRequest(e.to_string()))?;
    let bytes =
        serde_json::to_vec(&chat).map_err(|e| BridgeError::InvalidRequest(e.to_string()))?;
    let resp = client
        .post(format!("{}/chat/completions", model.base_url))
        .bearer_auth(key.expose())
        .header(header::CONTENT_TYPE, "application/json")
        .body(bytes)
        .send()
        .await
        .map_err(send_error)?;
    if !resp.status().is_success() {
        return Err(error_from_response(resp).await);
    }
    if !stream {
        let body = read_capped(resp, MAX_RESPONSE_BYTES)
            .await
            .map_err(|e| BridgeError::UpstreamUnreachable(agentbox_http::error_chain(&e)))?;
        let chat: ChatResponse = serde_json::from_slice(&body)
            .map_err(|e| BridgeError::UpstreamInvalid(format!("not a chat completion: {e}")))?;
        let message = chat_to_anthropic_response(chat, &resp_opts)
            .map_err(|e| BridgeError::UpstreamInvalid(e.to_string()))?;
        let json = serde_json::to_vec(&message)
            .map_err(|e| BridgeError::UpstreamInvalid(e.to_string()))?;
        return Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(json))
            .map_err(|e| BridgeError::UpstreamInvalid(e.to_string()));
    }
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(translated_stream(
            resp.bytes_stream(),
            resp_opts,
        )))
        .map_err(|e| BridgeError::UpstreamInvalid(e.to_string()))
}

/// The provider's chat chunks as Anthropic SSE, translated as each upstream chunk arrives.
fn translated_stream<S>(
    upstream: S,
    opts: ResponseOptions,
) -> impl Stream<Item = Result<Bytes, std::io::Error>>
where
    S: Stream<Item = Result<Bytes, reqwest::Error>> + Unpin,
{
    struct State<S> {
        upstream: S,
        decoder: sse::Decoder,
        translator: ChatStreamTranslator,
        started: bool,
        /// Set once we ended the stream with our own `error` event.
        failed: bool,
    }
    let state = State {
        upstream,
        decoder: sse::Decoder::new(),
        translator: ChatStreamTranslator::new(opts),
        started: false,
        failed: false,
    };
    futures_util::stream::unfold(state, |mut st| async move {
        let mut out = Vec::new();
        if !st.started {
            // message_start goes out as soon as the provider answered, so a slow prefill does
            // not trip the client's idle watchdog.
            st.started = true;
            write_events(&st.translator.start(), &mut out);
            return Some((Ok(Bytes::from(out)), st));
        }
        while out.is_empty() {
            if st.failed || st.translator.is_done() {
                return None;
            }
            let events = match st.upstream.next().await {
                Some(Ok(chunk)) => {
                    let mut frames = Vec::new();
                    match st.decoder.feed(&chunk, &mut frames) {
                        Ok(()) => frames
                            .iter()
                            .flat_map(|f| st.translator.push_data(&f.data))
                            .collect::<Vec<_>>(),
                        Err(e) => fail(
                            &mut st.failed,
                            format!("upstream stream is not valid SSE: {e}"),
                        ),
                    }
                }
                Some(Err(e)) => fail(
                    &mut st.failed,
                    format!("upstream stream broke: {}", agentbox_http::error_chain(&e)),
                ),
                None => st.translator.finish(),
            };
            write_events(&events, &mut out);
        }
        Some((Ok(Bytes::from(out)), st))
    })
}

/// Ends a translated stream with an `error` event; nothing follows it.
fn fail(failed: &mut bool, message: String) -> Vec<StreamEvent> {
    tracing::warn!(%message, "translated stream failed");
    *failed = true;
    vec![StreamEvent::error(ErrorType::ApiError, message)]
}

/// Appends events as SSE frames.
fn write_events(events: &[StreamEvent], out: &mut Vec<u8>) {
    for e in events {
        if let Err(err) = e.write_sse(out) {
            tracing::error!(error = %err, "cannot serialize a stream event");
        }
    }
}

/// A request that never got a response.
pub fn send_error(e: reqwest::Error) -> BridgeError {
    if e.is_timeout() {
        BridgeError::UpstreamTimeout
    } else {
        BridgeError::UpstreamUnreachable(agentbox_http::error_chain(&e))
    }
}

/// Maps a provider's error response to what our client sees. A 429 stays a 429 with its
/// `retry-after`; a 5xx becomes 502 unless the provider already answered in Anthropic's shape
/// (then its status and type stand); a 4xx keeps its status with an Anthropic-shaped body.
pub async fn error_from_response(resp: reqwest::Response) -> BridgeError {
    let status = resp.status();
    let retry_after = resp.headers().get(header::RETRY_AFTER).cloned();
    // Error bodies are small; cap what we read so a hostile upstream cannot balloon memory.
    let body = read_capped(resp, 64 * 1024).await.unwrap_or_default();
    map_error(status, retry_after, &body)
}

/// Reads a response body up to `cap` bytes (the rest is dropped).
async fn read_capped(mut resp: reqwest::Response, cap: usize) -> Result<Vec<u8>, reqwest::Error> {
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        let room = cap.saturating_sub(out.len());
        out.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if out.len() >= cap {
            break;
        }
    }
    Ok(out)
}

/// The pure part of [`error_from_response`].
pub fn map_error(status: StatusCode, retry_after: Option<HeaderValue>, body: &[u8]) -> BridgeError {
    let (status, body) = client_error_for_upstream(status.as_u16(), body);
    BridgeError::Upstream {
        status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
        body: Box::new(body),
        retry_after,
    }
}
