//! A task socket: `POST /v1/messages` and `POST /v1/messages/count_tokens` (any query string),
//! everything else 404.
//!
//! A message request is authenticated (task token, constant time), read under the body limit,
//! sanitized by `policy::sanitize` (model rewritten to the destination's name, server-side
//! tools, `mcp_servers`, `container` and `context_management` removed), admitted against the
//! budget with a reservation (403 before any upstream call when spent), and forwarded with only
//! `anthropic-version`. The response streams back as it arrives while [`MeteredBody`] feeds
//! the usage meter; the reservation is settled on the real usage when the body ends, or, if
//! the client goes away first, when the body is dropped (which also drops the upstream
//! request), billing what was generated up to then.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use agentbox_http::{BodyError, read_body};
use agentbox_policy::id::Tid;
use agentbox_policy::sanitize;
use agentbox_policy::secret::presented_token;
use agentbox_wire::anthropic::StreamEvent;
use agentbox_wire::error::client_error_for_upstream;
use agentbox_wire::usage::{BodyKind, MeteredUsage, UsageMeter};
use axum::Router;
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use bytes::Bytes;
use futures_util::Stream;
use serde_json::{Value, json};

use crate::error::ProxyError;
use crate::estimate;
use crate::gateway::Gateway;
use crate::ledger::Reservation;

/// The `anthropic-version` sent when the agent sent none (or an unusable one).
const DEFAULT_ANTHROPIC_VERSION: &str = "2023-06-01";

#[derive(Clone)]
struct TaskCtx {
    gw: Arc<Gateway>,
    tid: Tid,
}

/// The router of one task's socket.
pub fn router(gw: Arc<Gateway>, tid: Tid) -> Router {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .with_state(TaskCtx { gw, tid })
}

async fn not_found(req: Request) -> ProxyError {
    ProxyError::NotFound(format!("{} {}", req.method(), req.uri().path()))
}

fn authenticate(ctx: &TaskCtx, headers: &HeaderMap) -> Result<(), ProxyError> {
    let token = presented_token(
        headers
            .get(header::AUTHORIZATION)
            .map(HeaderValue::as_bytes),
        headers.get("x-api-key").map(HeaderValue::as_bytes),
    )
    .ok_or(ProxyError::Unauthorized)?;
    ctx.gw.check_token(&ctx.tid, token)
}

async fn read_json(ctx: &TaskCtx, req: Request) -> Result<(HeaderMap, Value), ProxyError> {
    let (parts, body) = req.into_parts();
    authenticate(ctx, &parts.headers)?;
    let opts = ctx.gw.options();
    let bytes = read_body(&parts.headers, body, opts.max_body_bytes, opts.body_timeout)
        .await
        .map_err(|e| match e {
            BodyError::TooLarge { limit } => ProxyError::BodyTooLarge { limit },
            BodyError::Timeout(_) => ProxyError::BodyTimeout,
            BodyError::Read(m) => ProxyError::BodyRead(m),
        })?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ProxyError::InvalidRequest(format!("request body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ProxyError::InvalidRequest(
            "request body must be a JSON object".into(),
        ));
    }
    Ok((parts.headers, value))
}

/// `POST /v1/messages/count_tokens`: answered locally, never forwarded, never billed.
async fn count_tokens(State(ctx): State<TaskCtx>, req: Request) -> Result<Response, ProxyError> {
    let (_, value) = read_json(&ctx, req).await?;
    Ok(axum::Json(json!({"input_tokens": estimate::input_tokens(&value)})).into_response())
}

/// `POST /v1/messages`.
async fn messages(State(ctx): State<TaskCtx>, req: Request) -> Result<Response, ProxyError> {
    let (headers, mut value) = read_json(&ctx, req).await?;
    let model = ctx.gw.model_of(&ctx.tid)?;
    let dest = ctx.gw.destination(&model);
    sanitize::sanitize(&mut value, &dest.model)
        .map_err(|e| ProxyError::InvalidRequest(e.to_string()))?;

    let max_tokens = match value.get("max_tokens") {
        Some(Value::Number(n)) => n.as_u64().filter(|n| *n > 0).ok_or_else(|| {
            ProxyError::InvalidRequest("max_tokens: expected a positive integer".into())
        })?,
        Some(_) => {
            return Err(ProxyError::InvalidRequest(
                "max_tokens: expected a positive integer".into(),
            ));
        }
        None => {
            return Err(ProxyError::InvalidRequest(
                "max_tokens: field required".into(),
            ));
        }
    };
    // The catalogue's output limit bounds both what the model may generate and what a request
    // reserves.
    let max_tokens = match model.max_output_tokens {
        Some(cap) if max_tokens > cap => {
            value["max_tokens"] = json!(cap);
            cap
        }
        Some(_) | None => max_tokens,
    };
    let reservation = Reservation::for_request(
        estimate::input_tokens(&value),
        max_tokens,
        model.prices.as_ref(),
    );
    ctx.gw.admit(&ctx.tid, reservation)?;
    // From here every path settles exactly once: on an early return the guard's drop does it.
    let settlement = Settlement {
        gw: ctx.gw.clone(),
        tid: ctx.tid.clone(),
        reservation: Some(reservation),
    };

    let token = if dest.bridge {
        Some(
            ctx.gw
                .options()
                .bridge_token
                .clone()
                .ok_or(ProxyError::NoBridgeToken)?,
        )
    } else {
        None
    };
    let version = headers
        .get("anthropic-version")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() < 64)
        .unwrap_or(DEFAULT_ANTHROPIC_VERSION);
    let body = serde_json::to_vec(&value).map_err(|e| ProxyError::InvalidRequest(e.to_string()))?;
    let mut upstream = ctx
        .gw
        .client()
        .post(&dest.url)
        .header(header::CONTENT_TYPE, "application/json")
        .header("anthropic-version", version)
        .body(body);
    if let Some(t) = &token {
        upstream = upstream.bearer_auth(t.expose());
    }
    let resp = upstream.send().await.map_err(|e| {
        if e.is_timeout() {
            ProxyError::UpstreamTimeout
        } else {
            ProxyError::UpstreamUnreachable(agentbox_http::error_chain(&e))
        }
    })?;
    let status = resp.status();
    if !status.is_success() {
        let retry_after = resp.headers().get(header::RETRY_AFTER).cloned();
        let body = resp.bytes().await.unwrap_or_default();
        let (status, body) = client_error_for_upstream(status.as_u16(), &body);
        return Err(ProxyError::Upstream {
            status: StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY),
            body: Box::new(body),
            retry_after,
        });
    }
    let content_type = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .cloned()
        .unwrap_or(HeaderValue::from_static("application/json"));
    let kind = BodyKind::from_content_type(content_type.to_str().unwrap_or(""));
    let metered = MeteredBody {
        upstream: Box::pin(resp.bytes_stream()),
        meter: Some(UsageMeter::new(kind)),
        settlement,
        is_sse: kind == BodyKind::EventStream,
        at_boundary: true,
        done: false,
    };
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, content_type)
        .body(Body::from_stream(metered))
        .map_err(|e| ProxyError::UpstreamUnreachable(e.to_string()))
}

/// Settles a reservation exactly once: explicitly with the final report, or on drop with
/// whatever was metered (client gone, early return).
struct Settlement {
    gw: Arc<Gateway>,
    tid: Tid,
    reservation: Option<Reservation>,
}

impl Settlement {
    fn settle(&mut self, usage: &MeteredUsage) {
        if let Some(r) = self.reservation.take() {
            self.gw.settle(&self.tid, r, usage);
        }
    }
}

impl Drop for Settlement {
    fn drop(&mut self) {
        self.settle(&MeteredUsage::default());
    }
}

type UpstreamStream = Pin<Box<dyn Stream<Item = Result<Bytes, reqwest::Error>> + Send>>;

/// The upstream body passed through chunk by chunk, metered on the way.
struct MeteredBody {
    upstream: UpstreamStream,
    meter: Option<UsageMeter>,
    settlement: Settlement,
    is_sse: bool,
    /// Whether the bytes forwarded so far end at an SSE frame boundary.
    at_boundary: bool,
    done: bool,
}

impl MeteredBody {
    fn finish(&mut self) {
        if let Some(meter) = self.meter.take() {
            let report = meter.finish();
            if !report.complete {
                tracing::warn!(tid = %self.settlement.tid, "response ended incomplete; billing what was generated");
            }
            self.settlement.settle(&report.billable_usage());
        }
    }
}

impl Stream for MeteredBody {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match this.upstream.as_mut().poll_next(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(Some(Ok(chunk))) => {
                if let Some(m) = this.meter.as_mut() {
                    m.feed(&chunk);
                }
                if !chunk.is_empty() {
                    this.at_boundary = agentbox_wire::sse::ends_frame(&chunk);
                }
                Poll::Ready(Some(Ok(chunk)))
            }
            Poll::Ready(Some(Err(e))) => {
                this.done = true;
                this.finish();
                tracing::warn!(tid = %this.settlement.tid, error = %agentbox_http::error_chain(&e), "upstream broke mid-response");
                if this.is_sse {
                    // End the stream with an Anthropic `error` event, so the client sees a
                    // failure rather than a silently truncated answer.
                    Poll::Ready(Some(Ok(Bytes::from(StreamEvent::failure_frame(
                        !this.at_boundary,
                        format!(
                            "upstream failed mid-stream: {}",
                            agentbox_http::error_chain(&e)
                        ),
                    )))))
                } else {
                    Poll::Ready(Some(Err(std::io::Error::other(
                        agentbox_http::error_chain(&e),
                    ))))
                }
            }
            Poll::Ready(None) => {
                this.done = true;
                this.finish();
                Poll::Ready(None)
            }
        }
    }
}

impl Drop for MeteredBody {
    fn drop(&mut self) {
        // The client went away (or the server is shutting down) before the end: dropping the
        // upstream stream cancels the generation; bill what the meter saw.
        self.finish();
    }
}
