//! The adapters: how an Anthropic Messages request reaches an upstream of a given protocol and
//! how its answer comes back as an [`Answer`]. The caller (a daemon's policy) supplies the URL,
//! the auth and the options; the engine does the HTTP, the capped reads, the error mapping and
//! the body.
//!
//! - [`Upstream::anthropic_bytes`]: passthrough to an Anthropic `/v1/messages` endpoint.
//! - [`Upstream::anthropic_via_chat`]: Anthropic → OpenAI chat completions → Anthropic,
//!   streamed through [`ChatToAnthropic`] or translated whole.
//!
//! - [`Upstream::chat`]: passthrough of an OpenAI chat completion (the gateway's rollout
//!   router models), with the caller's extra headers.
//!
//! A Responses ⇄ chat adapter is one more method here with its own [`StreamTranslator`].
//!
//! [`StreamTranslator`]: crate::body::StreamTranslator

use agentbox_wire::FastValue;
use agentbox_wire::anthropic::MessagesRequest;
use agentbox_wire::chat::ChatResponse;
use agentbox_wire::translate::{
    ChatOptions, ResponseOptions, anthropic_into_chat, chat_to_anthropic_response,
};
use agentbox_wire::usage::BodyKind;
use axum::http::{HeaderValue, StatusCode, header};
use bytes::Bytes;
use reqwest::Url;
use serde_json::Value;

use crate::body::{Answer, ChatToAnthropic, LlmBody, upstream_stream};
use crate::client::{Auth, MAX_ANSWER_BODY, Parts, Upstream, read_capped};
use crate::error::{LlmError, Protocol};

/// The `anthropic-version` sent when the client sent none (or an unusable one).
pub const DEFAULT_ANTHROPIC_VERSION: &str = "2023-06-01";

/// The `anthropic-version` to send: the client's when usable, else the default.
pub fn anthropic_version(headers: &axum::http::HeaderMap) -> &str {
    headers
        .get("anthropic-version")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() < 64)
        .unwrap_or(DEFAULT_ANTHROPIC_VERSION)
}

/// An Anthropic Messages endpoint.
#[derive(Debug, Clone, Copy)]
pub struct AnthropicTarget<'a> {
    /// The full `/v1/messages` URL.
    pub url: &'a Url,
    /// How to authenticate.
    pub auth: Auth<'a>,
    /// The `anthropic-version` header.
    pub version: &'a str,
    /// About how long the body will be written (the client's body length): its buffer is
    /// allocated once at that size rather than grown by doubling.
    pub size_hint: usize,
}

/// An OpenAI chat completions endpoint a chat request passes through to.
#[derive(Debug, Clone, Copy)]
pub struct ChatPassTarget<'a> {
    /// The full `/chat/completions` URL.
    pub url: &'a Url,
    /// How to authenticate.
    pub auth: Auth<'a>,
    /// Extra request headers (the caller chose which of its client's to keep).
    pub headers: &'a [(&'a str, &'a str)],
    /// About how long the body will be written (see [`AnthropicTarget::size_hint`]).
    pub size_hint: usize,
}

/// Where a passthrough goes: what [`AnthropicTarget`] and [`ChatPassTarget`] both come to.
#[derive(Debug, Clone, Copy)]
struct PassTarget<'a> {
    url: &'a Url,
    auth: Auth<'a>,
    headers: &'a [(&'a str, &'a str)],
    size_hint: usize,
}

/// An OpenAI chat completions endpoint and how to translate for it.
#[derive(Debug)]
pub struct ChatTarget<'a> {
    /// The full `/chat/completions` URL.
    pub url: &'a Url,
    /// How to authenticate.
    pub auth: Auth<'a>,
    /// Request translation (upstream model name, output cap, ...).
    pub chat: ChatOptions,
    /// The model reported back to the client (its own name, not the provider's).
    pub reported_model: String,
    /// Input tokens to report until the provider's usage arrives.
    pub input_tokens_estimate: u64,
}

impl Upstream {
    /// Passes a request to an Anthropic endpoint and its answer back, streamed or not. The
    /// body is the one already written (the sanitizer's output, which copies the client's
    /// members as they came) and is sent as it is.
    pub async fn anthropic_bytes(
        &self,
        target: AnthropicTarget<'_>,
        bytes: Vec<u8>,
    ) -> Result<Answer, LlmError> {
        self.anthropic_body(target, bytes).await
    }

    /// [`Upstream::anthropic_bytes`] for a body given as its [`Parts`] (the sanitizer's pieces:
    /// spans of the client's body and what it wrote anew), sent without being copied into one
    /// buffer.
    pub async fn anthropic_parts(
        &self,
        target: AnthropicTarget<'_>,
        parts: Parts,
    ) -> Result<Answer, LlmError> {
        self.anthropic_body(target, parts).await
    }

    /// The Anthropic passthrough for a body however it is held: only the body's type differs
    /// between [`Upstream::anthropic_bytes`] and [`Upstream::anthropic_parts`].
    async fn anthropic_body(
        &self,
        target: AnthropicTarget<'_>,
        body: impl Into<reqwest::Body>,
    ) -> Result<Answer, LlmError> {
        let headers = [("anthropic-version", target.version)];
        let pass = PassTarget {
            url: target.url,
            auth: target.auth,
            headers: &headers,
            size_hint: target.size_hint,
        };
        self.passthrough_bytes(pass, body, Protocol::Anthropic)
            .await
    }

    /// Passes a chat completions request to an OpenAI-compatible endpoint and its answer back,
    /// streamed or not; a stream that breaks ends with OpenAI's error frame. The request is
    /// written out and freed before the call.
    pub async fn chat(&self, target: ChatPassTarget<'_>, body: Value) -> Result<Answer, LlmError> {
        let pass = PassTarget {
            url: target.url,
            auth: target.auth,
            headers: target.headers,
            size_hint: target.size_hint,
        };
        self.passthrough(pass, body, Protocol::OpenAi).await
    }

    /// The one passthrough both protocols share: the body written once, posted, and the answer
    /// handed back as it came; only the error frame that ends a broken stream depends on
    /// `protocol`.
    async fn passthrough(
        &self,
        target: PassTarget<'_>,
        body: Value,
        protocol: Protocol,
    ) -> Result<Answer, LlmError> {
        let mut bytes = Vec::with_capacity(target.size_hint.saturating_add(4096));
        serde_json::to_writer(&mut bytes, &FastValue(&body))
            .map_err(|e| LlmError::InvalidRequest(e.to_string()))?;
        // The tree is several times the body's size: not kept while the upstream works.
        drop(body);
        self.passthrough_bytes(target, bytes, protocol).await
    }

    /// [`Upstream::passthrough`] for a body already written.
    async fn passthrough_bytes(
        &self,
        target: PassTarget<'_>,
        bytes: impl Into<reqwest::Body>,
        protocol: Protocol,
    ) -> Result<Answer, LlmError> {
        let resp = self
            .post_json(target.url, target.auth, target.headers, bytes)
            .await?;
        let status = resp.status();
        let content_type = resp
            .headers()
            .get(header::CONTENT_TYPE)
            .cloned()
            .unwrap_or(HeaderValue::from_static("application/json"));
        let kind = BodyKind::from_content_type(content_type.to_str().unwrap_or(""));
        let sse = (kind == BodyKind::EventStream).then_some(protocol);
        Ok(Answer {
            status,
            content_type,
            body: LlmBody::passthrough(upstream_stream(resp), sse),
        })
    }

    /// Translates a request to chat completions, calls the endpoint, translates the answer
    /// back: as Anthropic events while it streams, or whole.
    pub async fn anthropic_via_chat(
        &self,
        target: ChatTarget<'_>,
        req: MessagesRequest,
    ) -> Result<Answer, LlmError> {
        let stream = req.stream == Some(true);
        let resp_opts = ResponseOptions::for_request(&req);
        let chat = anthropic_into_chat(req, &target.chat)
            .map_err(|e| LlmError::InvalidRequest(e.to_string()))?;
        // Written once into a buffer of about the right size (the estimate is a quarter of the
        // client's body), not grown by doubling; the request is freed before the call.
        let mut bytes = Vec::with_capacity(
            usize::try_from(target.input_tokens_estimate)
                .unwrap_or(0)
                .saturating_mul(4)
                .saturating_add(4096),
        );
        serde_json::to_writer(&mut bytes, &chat)
            .map_err(|e| LlmError::InvalidRequest(e.to_string()))?;
        drop(chat);
        self.chat_for_anthropic(target, Bytes::from(bytes), resp_opts, stream)
            .await
    }

    /// [`Upstream::anthropic_via_chat`] for a request already written as a chat body (by
    /// [`agentbox_wire::translate::AnthropicBody`], which borrows from the client's body, so
    /// the caller translates before anything is awaited): `resp_opts` are the request's
    /// [`ResponseOptions`]; the reported model and the input estimate come from `target`.
    pub async fn chat_for_anthropic(
        &self,
        target: ChatTarget<'_>,
        bytes: Bytes,
        resp_opts: ResponseOptions,
        stream: bool,
    ) -> Result<Answer, LlmError> {
        let resp_opts = ResponseOptions {
            model: Some(target.reported_model),
            input_tokens_estimate: target.input_tokens_estimate,
            ..resp_opts
        };
        let resp = self.post_json(target.url, target.auth, &[], bytes).await?;
        if stream {
            return Ok(Answer {
                status: StatusCode::OK,
                content_type: HeaderValue::from_static("text/event-stream"),
                body: LlmBody::translated(
                    upstream_stream(resp),
                    Box::new(ChatToAnthropic::new(resp_opts)),
                ),
            });
        }
        let raw = read_capped(resp, MAX_ANSWER_BODY)
            .await
            .map_err(|e| LlmError::from_transport(&e))?;
        let invalid = |what: String| {
            tracing::warn!(error = %what, "upstream sent an invalid chat completion");
            LlmError::InvalidResponse(what)
        };
        let chat: ChatResponse = serde_json::from_slice(&raw)
            .map_err(|e| invalid(format!("not a chat completion: {e}")))?;
        let message =
            chat_to_anthropic_response(chat, &resp_opts).map_err(|e| invalid(e.to_string()))?;
        let json = serde_json::to_vec(&message).map_err(|e| invalid(e.to_string()))?;
        Ok(Answer {
            status: StatusCode::OK,
            content_type: HeaderValue::from_static("application/json"),
            body: LlmBody::ready(Bytes::from(json)),
        })
    }
}
