//! A task socket: `POST /v1/messages` and `POST /v1/messages/count_tokens` (any query string),
//! everything else 404.
//!
//! A message request is authenticated (task token, constant time), read under the body limit,
//! sanitized by `policy::sanitize` (model rewritten to the destination's name, server-side
//! tools, `mcp_servers`, `container` and `context_management` removed), `max_tokens` clamped
//! to the catalogue's cap, admitted against the budget with a reservation (403 before any
//! upstream call when spent), and forwarded through `agentbox-llm` with only
//! `anthropic-version`. The response streams back as it arrives, metered; the reservation
//! ([`Admission`]) is settled on the real usage when the body ends, or, if the client goes away
//! first, when the body is dropped (which also drops the upstream request), billing what was
//! generated up to then.

use std::sync::Arc;
use std::time::Duration;

use agentbox_http::loopback::LoopbackGuard;
use agentbox_http::{BodyBudgets, BodyCharge, BodyError, BudgetedBodyError, read_body_within};
use agentbox_llm::adapter::anthropic_version;
use agentbox_llm::{AnthropicTarget, Auth, Upstream};
use agentbox_policy::config::{Backend, Model};
use agentbox_policy::sanitize;
use agentbox_policy::secret::{Secret, presented_token};
use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

use crate::account::{AccountError, TaskAccount};
use crate::error::ProxyError;
use crate::estimate;
use crate::ledger::Reservation;

/// What every task socket shares: the upstream engine, where models live, the limits.
#[derive(Debug)]
pub struct ProxyConfig {
    /// The upstream client.
    pub upstream: Upstream,
    /// Ollama's base URL, without a trailing `/`.
    pub ollama_url: String,
    /// The bridge's base URL, without a trailing `/`.
    pub bridge_url: String,
    /// The bridge's bearer token, for remote models.
    pub bridge_token: Option<Secret>,
    /// Largest request body.
    pub max_body_bytes: u64,
    /// How long a client may take to send its body.
    pub body_timeout: Duration,
    /// Who must own the loopback listener of a destination served by the service user.
    pub loopback: LoopbackGuard,
}

/// Where a model's requests go.
#[derive(Debug, Clone)]
pub struct Destination {
    /// The full `/v1/messages` URL.
    pub url: String,
    /// The `model` to send.
    pub model: String,
    /// Whether this is the bridge (needs the bridge token).
    pub bridge: bool,
    /// Served by the service user (the bridge, vLLM): its loopback listener must be theirs.
    pub owned: bool,
}

impl ProxyConfig {
    /// Where a model's requests go.
    pub fn destination(&self, model: &Model) -> Destination {
        match &model.backend {
            Backend::Vllm { port, .. } => Destination {
                url: format!("http://127.0.0.1:{port}/v1/messages"),
                model: model.upstream_model.clone(),
                bridge: false,
                owned: true,
            },
            Backend::Ollama => Destination {
                url: format!("{}/v1/messages", self.ollama_url),
                model: model.upstream_model.clone(),
                bridge: false,
                owned: false,
            },
            // The bridge resolves the agentbox id to the provider's model itself.
            Backend::Remote { .. } => Destination {
                url: format!("{}/v1/messages", self.bridge_url),
                model: model.id.to_string(),
                bridge: true,
                owned: true,
            },
        }
    }
}

#[derive(Clone)]
struct TaskCtx {
    cfg: Arc<ProxyConfig>,
    account: TaskAccount,
    bodies: BodyBudgets,
}

/// The router of one task's socket; its request bodies are charged to `bodies`.
pub fn router(cfg: Arc<ProxyConfig>, account: TaskAccount, bodies: BodyBudgets) -> Router {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .with_state(TaskCtx {
            cfg,
            account,
            bodies,
        })
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
    .ok_or(AccountError::Unauthorized)?;
    Ok(ctx.account.check_token(token)?)
}

/// The body as JSON, with its charge against the body budgets: keep the charge while the value
/// lives.
async fn read_json(
    ctx: &TaskCtx,
    req: Request,
) -> Result<(HeaderMap, Value, BodyCharge), ProxyError> {
    let (parts, body) = req.into_parts();
    authenticate(ctx, &parts.headers)?;
    let held = read_body_within(
        &parts.headers,
        body,
        ctx.cfg.max_body_bytes,
        ctx.cfg.body_timeout,
        &ctx.bodies,
    )
    .await
    .map_err(|e| match e {
        BudgetedBodyError::Body(BodyError::TooLarge { limit }) => {
            ProxyError::BodyTooLarge { limit }
        }
        BudgetedBodyError::Body(BodyError::Timeout(_)) => ProxyError::BodyTimeout,
        BudgetedBodyError::Body(BodyError::Read(m)) => ProxyError::BodyRead(m),
        BudgetedBodyError::ClientBusy => ProxyError::TooManyBodyBytes,
        BudgetedBodyError::ServerBusy => ProxyError::Overloaded,
    })?;
    let (bytes, charge) = held.split();
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ProxyError::InvalidRequest(format!("request body is not valid JSON: {e}")))?;
    drop(bytes);
    if !value.is_object() {
        return Err(ProxyError::InvalidRequest(
            "request body must be a JSON object".into(),
        ));
    }
    Ok((parts.headers, value, charge))
}

/// `POST /v1/messages/count_tokens`: answered locally, never forwarded, never billed.
async fn count_tokens(State(ctx): State<TaskCtx>, req: Request) -> Result<Response, ProxyError> {
    let (_, value, _charge) = read_json(&ctx, req).await?;
    Ok(axum::Json(json!({"input_tokens": estimate::input_tokens(&value)})).into_response())
}

/// `POST /v1/messages`.
async fn messages(State(ctx): State<TaskCtx>, req: Request) -> Result<Response, ProxyError> {
    let (headers, mut value, _charge) = read_json(&ctx, req).await?;
    let model = ctx.account.model()?;
    let dest = ctx.cfg.destination(&model);
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
    // From here every path settles exactly once: on an early return the admission's drop does
    // it, after the upstream answered the metered body does.
    let admission = ctx.account.admit(reservation)?;
    let auth = if dest.bridge {
        Auth::Bearer(
            ctx.cfg
                .bridge_token
                .as_ref()
                .ok_or(ProxyError::NoBridgeToken)?,
        )
    } else {
        Auth::None
    };
    let target = AnthropicTarget {
        url: &dest.url,
        auth,
        version: anthropic_version(&headers),
    };
    // Right before sending: a listener of another uid on the port (the bridge down, someone
    // else bound it) gets neither the prompt nor the token.
    if dest.owned
        && let Err(e) = ctx.cfg.loopback.check_url(&dest.url)
    {
        tracing::error!(tid = %ctx.account.tid(), error = %e, "refusing to send to an untrusted upstream");
        return Err(ProxyError::UntrustedUpstream);
    }
    let answer = ctx.cfg.upstream.anthropic(target, &value).await?;
    let tid = ctx.account.tid().clone();
    let answer = answer.metered(move |report| {
        if !report.complete {
            tracing::warn!(%tid, "response ended incomplete; billing what was generated");
        }
        admission.settle(&report.billable_usage());
    });
    Ok(answer.into_response())
}
