//! A task socket: `POST /v1/messages` and `POST /v1/messages/count_tokens` (any query string),
//! and, for a task whose model is a rollout router, `POST /v1/chat/completions`
//! ([`crate::chat`], which shares this module's auth, body reading and detached upstream call);
//! everything else 404.
//!
//! **Guarantee: the meter never counts less than the upstream bills, whenever the client hangs
//! up.** The upstream call runs in a task of its own, detached from the client's connection, and
//! owns the request's [`Admission`]. If the client hangs up before the response head (axum then
//! drops the handler), the call still completes and its answer is read to the end in the
//! background, bounded by the upstream client's timeouts for the head and by [`DRAIN_LIMIT`]
//! (or gateway shutdown) for the body, and the admission settles on the upstream's own usage.
//! If the client hangs up mid-answer, the body is dropped, which closes the upstream connection
//! and cancels the generation; the admission settles on what was metered: the upstream's input
//! from `message_start` (or the reservation's input estimate if none arrived) and the output
//! read so far, at least as estimated from the deltas (`MeterReport::billable_usage`). Output
//! the upstream generated after the last read and before it saw the close (at most what sits in
//! socket buffers) is not seen. What every ending bills is stated once, in [`crate::account`];
//! each admission settles exactly once.
//!
//! A message request is authenticated (task token, constant time), read under the body limit,
//! refused (400) if it carries media with URL sources and the model does not allow them or a
//! duplicate key at any depth, sanitized by `policy::sanitize::raw` (model rewritten to the
//! destination's name, server-side tools, `mcp_servers`, `container` and `context_management`
//! removed, `max_tokens` clamped to the catalogue's cap, the input estimate counted, all in one
//! scan of the body and without a `Value` tree; untouched members are sent as the client's
//! bytes, shared with the body read, not copied),
//! admitted against the budget with a reservation (403 before any upstream call when spent),
//! and forwarded through `agentbox-llm` with only `anthropic-version`. The response streams
//! back as it arrives, metered.

use std::sync::Arc;
use std::time::Duration;

use agentbox_http::loopback::LoopbackGuard;
use agentbox_http::{BodyBudgets, BodyCharge, BodyError, BudgetedBodyError, read_body_within};
use agentbox_llm::adapter::anthropic_version;
use agentbox_llm::{Answer, AnthropicTarget, Auth, LlmError, Parts, Upstream, Url};
use agentbox_policy::config::{Backend, Model};
use agentbox_policy::id::Tid;
use agentbox_policy::sanitize::{SanitizeError, raw};
use agentbox_policy::secret::{Secret, presented_token};
use axum::Router;
use axum::body::Bytes;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, HeaderValue, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use futures_util::StreamExt;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, oneshot};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::account::{AccountError, Admission, TaskAccount};
use crate::error::ProxyError;
use crate::estimate;
use crate::ledger::Reservation;

/// What every task socket shares: the upstream engine, where models live, the limits.
#[derive(Debug)]
pub struct ProxyConfig {
    /// The upstream client.
    pub upstream: Upstream,
    /// Ollama's `/v1/messages`, parsed once at start.
    pub ollama_messages: Url,
    /// The bridge's `/v1/messages`, parsed once at start.
    pub bridge_messages: Url,
    /// `http://127.0.0.1/v1/messages`: a local vLLM's, its port set per model.
    pub vllm_messages: Url,
    /// The bridge's bearer token, for remote models.
    pub bridge_token: Option<Secret>,
    /// Largest request body.
    pub max_body_bytes: u64,
    /// How long a client may take to send its body.
    pub body_timeout: Duration,
    /// Runs the upstream calls (the gateway waits for it at shutdown).
    pub background: TaskTracker,
    /// Cancelled at shutdown: stops background drains, which then settle what they read.
    pub shutdown: CancellationToken,
    /// Who must own the loopback listener of a destination served by the service user.
    pub loopback: LoopbackGuard,
}

/// How long an answer whose client hung up before its head is read in the background.
pub const DRAIN_LIMIT: Duration = Duration::from_secs(300);

/// Where a model's requests go.
#[derive(Debug, Clone)]
pub struct Destination {
    /// The full `/v1/messages` URL.
    pub url: Url,
    /// The `model` to send.
    pub model: String,
    /// Whether this is the bridge (needs the bridge token).
    pub bridge: bool,
    /// Served by the service user (the bridge, vLLM): its loopback listener must be theirs.
    pub owned: bool,
}

impl ProxyConfig {
    /// Where a model's Anthropic requests go; `None` for a rollout router, which takes chat
    /// completions only.
    pub fn destination(&self, model: &Model) -> Option<Destination> {
        match &model.backend {
            Backend::Vllm {
                port,
                upstream_model,
                ..
            } => Some(Destination {
                // An http URL always takes a port.
                url: {
                    let mut url = self.vllm_messages.clone();
                    url.set_port(Some(*port)).ok()?;
                    url
                },
                model: upstream_model.clone(),
                bridge: false,
                owned: true,
            }),
            Backend::Ollama { upstream_model } => Some(Destination {
                url: self.ollama_messages.clone(),
                model: upstream_model.clone(),
                bridge: false,
                owned: false,
            }),
            // The bridge resolves the agentbox id to the provider's model itself.
            Backend::Remote { .. } => Some(Destination {
                url: self.bridge_messages.clone(),
                model: model.id.to_string(),
                bridge: true,
                owned: true,
            }),
            Backend::Router { .. } => None,
        }
    }
}

#[derive(Clone)]
pub(crate) struct TaskCtx {
    pub(crate) cfg: Arc<ProxyConfig>,
    pub(crate) account: TaskAccount,
    pub(crate) bodies: BodyBudgets,
    /// The task's model calls in flight, those whose client has gone included (see
    /// [`call_permit`]).
    pub(crate) calls: Arc<Semaphore>,
}

/// The router of one task's socket; its request bodies are charged to `bodies`, and at most
/// `max_calls` of its model calls run at once.
pub fn router(
    cfg: Arc<ProxyConfig>,
    account: TaskAccount,
    bodies: BodyBudgets,
    max_calls: usize,
) -> Router {
    Router::new()
        .route("/v1/messages", post(messages))
        .route("/v1/messages/count_tokens", post(count_tokens))
        .route("/v1/chat/completions", post(crate::chat::completions))
        .fallback(not_found)
        .method_not_allowed_fallback(not_found)
        .with_state(TaskCtx {
            cfg,
            account,
            bodies,
            calls: Arc::new(Semaphore::new(max_calls)),
        })
}

/// A place among the task's model calls in flight, held until its upstream call is over.
///
/// The connection limit alone does not bound them: an answer whose client hangs up before its
/// head is read in the background (to bill it), and so is the rest of a whole answer left
/// midway, so a task that asks and hangs up at once would otherwise have any number of calls
/// running upstream while holding no connection. The limit is the connection limit's: a task
/// that stays connected never meets it first.
pub(crate) fn call_permit(ctx: &TaskCtx) -> Result<OwnedSemaphorePermit, ProxyError> {
    ctx.calls
        .clone()
        .try_acquire_owned()
        .map_err(|_| ProxyError::TooManyCalls)
}

async fn not_found(req: Request) -> ProxyError {
    ProxyError::NotFound(format!("{} {}", req.method(), req.uri().path()))
}

pub(crate) fn authenticate(ctx: &TaskCtx, headers: &HeaderMap) -> Result<(), ProxyError> {
    let token = presented_token(
        headers
            .get(header::AUTHORIZATION)
            .map(HeaderValue::as_bytes),
        headers.get("x-api-key").map(HeaderValue::as_bytes),
    )
    .ok_or(AccountError::Unauthorized)?;
    Ok(ctx.account.check_token(token)?)
}

/// The body's bytes, with its charge against the body budgets (keep the charge while the bytes,
/// or what is made of them, live).
pub(crate) async fn read_bytes(
    ctx: &TaskCtx,
    req: Request,
) -> Result<(HeaderMap, Bytes, BodyCharge), ProxyError> {
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
    Ok((parts.headers, bytes, charge))
}

/// The body as JSON, with its charge against the body budgets (keep the charge while the value
/// lives) and the body's length.
pub(crate) async fn read_json(
    ctx: &TaskCtx,
    req: Request,
) -> Result<(HeaderMap, Value, BodyCharge, usize), ProxyError> {
    let (headers, bytes, charge) = read_bytes(ctx, req).await?;
    let value: Value = serde_json::from_slice(&bytes)
        .map_err(|e| ProxyError::InvalidRequest(format!("request body is not valid JSON: {e}")))?;
    let len = bytes.len();
    drop(bytes);
    if !value.is_object() {
        return Err(ProxyError::InvalidRequest(
            "request body must be a JSON object".into(),
        ));
    }
    Ok((headers, value, charge, len))
}

/// A sanitizer refusal as the client sees it (the words `read_json` uses for the same faults).
fn refusal(e: SanitizeError) -> ProxyError {
    match e {
        SanitizeError::Json(e) => {
            ProxyError::InvalidRequest(format!("request body is not valid JSON: {e}"))
        }
        SanitizeError::NotAnObject { .. } => {
            ProxyError::InvalidRequest("request body must be a JSON object".into())
        }
        e @ (SanitizeError::DuplicateKey(_)
        | SanitizeError::ToolsNotArray { .. }
        | SanitizeError::ToolNotObject { .. }
        | SanitizeError::UrlSource { .. }) => ProxyError::InvalidRequest(e.to_string()),
    }
}

/// `POST /v1/messages/count_tokens`: answered locally, never forwarded, never billed.
async fn count_tokens(State(ctx): State<TaskCtx>, req: Request) -> Result<Response, ProxyError> {
    let (_, value, _charge, _) = read_json(&ctx, req).await?;
    Ok(axum::Json(json!({"input_tokens": estimate::input_tokens(&value)})).into_response())
}

/// `POST /v1/messages`.
async fn messages(State(ctx): State<TaskCtx>, req: Request) -> Result<Response, ProxyError> {
    let (headers, bytes, _charge) = read_bytes(&ctx, req).await?;
    // The destination is known before the body is parsed, so the body is parsed, checked,
    // edited and counted in one scan. A body's own fault is reported before the task's (a
    // closed task, a router model), as when the body was parsed first.
    let model = ctx.account.model();
    let dest = model.as_ref().ok().and_then(|m| ctx.cfg.destination(m));
    let (model, dest) = match (model, dest) {
        (Ok(model), Some(dest)) => (model, dest),
        (model, _) => {
            raw::parse(&bytes).map_err(refusal)?;
            let model = model?;
            return Err(ProxyError::NotFound(format!(
                "POST /v1/messages: model {} is a rollout router, which serves POST /v1/chat/completions",
                model.id
            )));
        }
    };
    // Before any reservation or upstream call: a URL the provider fetches could carry workspace
    // data out, and its cost is invisible here. One walk checks, edits (the catalogue's output
    // limit bounds both what the model may generate and what a request reserves) and counts
    // the estimate; untouched members go upstream as the client's bytes.
    let sanitized = raw::sanitize_to_pieces(
        &bytes,
        &raw::Options {
            model: &dest.model,
            allow_url_sources: model.allow_url_sources,
            max_tokens_cap: model.max_output_tokens,
            strip_metadata_user_id: false,
            estimate: Some(estimate::RULES),
        },
    )
    .map_err(refusal)?;
    // The body sent is the client's members as they came (shared, not copied) and the few
    // bytes written anew, under the client's charge.
    let body = Parts::from_pieces(&bytes, sanitized.body)?;
    drop(bytes);
    let max_tokens = match sanitized.max_tokens {
        raw::MaxTokens::Value(n) => n,
        raw::MaxTokens::Invalid => {
            return Err(ProxyError::InvalidRequest(
                "max_tokens: expected a positive integer".into(),
            ));
        }
        raw::MaxTokens::Missing => {
            return Err(ProxyError::InvalidRequest(
                "max_tokens: field required".into(),
            ));
        }
    };
    let reservation =
        Reservation::for_request(sanitized.input_tokens, max_tokens, model.prices.as_ref());
    // Before reserving anything: a listener of another uid on the port (the bridge down, someone
    // else bound it) gets neither the prompt nor the token.
    if dest.owned
        && let Err(e) = ctx.cfg.loopback.check_url(&dest.url)
    {
        tracing::error!(tid = %ctx.account.tid(), error = %e, "refusing to send to an untrusted upstream");
        return Err(ProxyError::UntrustedUpstream);
    }
    // From here every path settles exactly once: the admission moves into the upstream call's
    // own task, which outlives this handler if the client hangs up.
    let permit = call_permit(&ctx)?;
    let admission = ctx.account.admit(reservation)?;
    let bridge_token = if dest.bridge {
        Some(
            ctx.cfg
                .bridge_token
                .clone()
                .ok_or(ProxyError::NoBridgeToken)?,
        )
    } else {
        None
    };
    let call = Call {
        cfg: ctx.cfg.clone(),
        tid: ctx.account.tid().clone(),
        dest,
        bridge_token,
        version: anthropic_version(&headers).to_owned(),
        body,
    };
    let cfg = ctx.cfg.clone();
    detached(
        &cfg,
        ctx.account.tid().clone(),
        permit,
        call.forward(admission),
    )
    .await
}

/// Runs an upstream call in a task of its own (see the module doc): the client gets its answer
/// while it waits; if it hung up before the head, the answer is read in the background so its
/// metered body settles on the upstream's usage. `permit` is held until the call is over,
/// background reads included.
pub(crate) async fn detached(
    cfg: &Arc<ProxyConfig>,
    tid: Tid,
    permit: OwnedSemaphorePermit,
    call: impl std::future::Future<Output = Result<Answer, ProxyError>> + Send + 'static,
) -> Result<Response, ProxyError> {
    let (tx, rx) = oneshot::channel();
    let shutdown = cfg.shutdown.clone();
    cfg.background.spawn(async move {
        let result = call.await.map(|answer| answer.hold_while_upstream(permit));
        if let Err(Ok(answer)) = tx.send(result) {
            drain(answer, &tid, &shutdown).await;
        }
    });
    match rx.await {
        Ok(answer) => Ok(answer?.into_response().await),
        // The call's task ended without an answer (the runtime is shutting down).
        Err(_) => Err(ProxyError::Llm(LlmError::Unreachable(
            "the upstream call ended without an answer".into(),
        ))),
    }
}

/// Settles an admission whose upstream call failed, as [`crate::account`] says.
pub(crate) fn settle_failed(admission: Admission, e: &LlmError) {
    match e {
        // Refused, or never reached: providers bill neither.
        LlmError::Upstream { ran: false, .. }
        | LlmError::Unreachable(_)
        | LlmError::InvalidRequest(_) => {
            admission.refund();
        }
        // It took the request and went silent or answered garbage (here, or behind the bridge,
        // which says so): it may have run it, so the drop bills the whole reservation.
        LlmError::Upstream { ran: true, .. } | LlmError::Timeout | LlmError::InvalidResponse(_) => {
            drop(admission);
        }
    }
}

/// One upstream call, owned by its own task.
struct Call {
    cfg: Arc<ProxyConfig>,
    tid: Tid,
    dest: Destination,
    bridge_token: Option<Secret>,
    version: String,
    /// The sanitized body, as it is sent.
    body: Parts,
}

impl Call {
    /// Sends the request; the answer's metered body settles `admission`, an error settles it
    /// as `account` says.
    async fn forward(self, mut admission: Admission) -> Result<Answer, ProxyError> {
        let auth = match &self.bridge_token {
            Some(t) => Auth::Bearer(t),
            None => Auth::None,
        };
        let target = AnthropicTarget {
            url: &self.dest.url,
            auth,
            version: &self.version,
            size_hint: usize::try_from(self.body.len()).unwrap_or(usize::MAX),
        };
        admission.sent();
        match self.cfg.upstream.anthropic_parts(target, self.body).await {
            Ok(answer) => {
                let tid = self.tid;
                Ok(answer
                    .metered(move |report| {
                        if !report.complete {
                            tracing::warn!(%tid, "response ended incomplete; billing what was generated");
                        }
                        admission.settle(&report);
                    })
                    .read_rest_with(self.cfg.background.clone(), self.cfg.shutdown.clone()))
            }
            Err(e) => {
                settle_failed(admission, &e);
                Err(e.into())
            }
        }
    }
}

/// Reads an answer whose client hung up before its head, so its metered body settles on the
/// upstream's usage; past [`DRAIN_LIMIT`] or at shutdown the body is dropped and settles on
/// what was read.
async fn drain(answer: Answer, tid: &Tid, shutdown: &CancellationToken) {
    tracing::info!(%tid, "client hung up before the answer; reading it to bill it");
    let mut body = answer.body;
    let read_all = async {
        while let Some(chunk) = body.next().await {
            if chunk.is_err() {
                break;
            }
        }
    };
    tokio::select! {
        () = read_all => {}
        () = tokio::time::sleep(DRAIN_LIMIT) => {
            tracing::warn!(%tid, "abandoned answer still running after the drain limit; billing what was read");
        }
        () = shutdown.cancelled() => {}
    }
}
