//! Running the proxy alone, without the server around it: the `blackbox-proxy` binary uses
//! this so the integration tests and the bench can drive a real proxy process through its
//! whole [`LlmProxy`] API. The control API is JSON over HTTP on its own loopback listener
//! (never the agent-facing one):
//!
//! | request | body | answer |
//! |---|---|---|
//! | `POST /turn/open` | `{turn_id, backend_session_id?}` | 204, or 409 `{error}` |
//! | `POST /turn/backend_session` | `{backend_session_id}` | 204 |
//! | `POST /turn/drain` | `{timeout_ms?}` | `{drained}` |
//! | `POST /turn/clear` | — | `{counts}` (`null` without a turn) |
//! | `GET /turn/counts` | — | `{counts}` |
//! | `GET /pause_state` | — | the [`PauseState`] |
//! | `POST /pause` | `{reason?, timeout_seconds?}` | the router's answer, or 502 `{error}` |
//! | `POST /resume` | `{version?, reason?}` | the router's answer, or 502 `{error}` |
//! | `POST /consume/{kind}` | — | `{error}`: `context_overflow`, `rollout_invalidated`, `failed_upstream`, `max_steps` |
//! | `POST /wait_max_steps` | `{timeout_ms?}` | `{error}` |
//! | `GET /total_paused` | — | `{seconds}` |

use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use super::{LlmProxy, PauseState, ProxyConfig, ProxyError};

#[derive(Deserialize)]
struct Open {
    turn_id: String,
    #[serde(default)]
    backend_session_id: Option<String>,
}

#[derive(Deserialize)]
struct BackendSession {
    backend_session_id: String,
}

#[derive(Deserialize, Default)]
struct Timeout {
    #[serde(default)]
    timeout_ms: Option<u64>,
}

#[derive(Deserialize, Default)]
struct Pause {
    #[serde(default)]
    reason: Option<String>,
    #[serde(default)]
    timeout_seconds: Option<f64>,
}

#[derive(Deserialize, Default)]
struct Resume {
    #[serde(default)]
    version: Option<String>,
    #[serde(default)]
    reason: Option<String>,
}

/// The control API's router over `proxy`.
pub fn control_router(proxy: LlmProxy) -> Router {
    Router::new()
        .route("/turn/open", post(open))
        .route("/turn/backend_session", post(backend_session))
        .route("/turn/drain", post(drain))
        .route("/turn/clear", post(clear))
        .route("/turn/counts", get(counts))
        .route("/pause_state", get(pause_state))
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/consume/{kind}", post(consume))
        .route("/wait_max_steps", post(wait_max_steps))
        .route("/total_paused", get(total_paused))
        .with_state(proxy)
}

/// Starts the proxy on `proxy_listener` and its control API on `control_listener`; serves
/// until `shutdown`, then shuts the proxy down.
pub async fn serve_standalone(
    proxy_listener: TcpListener,
    control_listener: TcpListener,
    cfg: ProxyConfig,
    shutdown: CancellationToken,
) -> Result<(), ProxyError> {
    let proxy = LlmProxy::start(proxy_listener, cfg).await?;
    agentbox_http::serve_tcp(
        control_listener,
        control_router(proxy.clone()),
        shutdown.clone(),
    )
    .await;
    proxy.shutdown().await;
    Ok(())
}

fn duration_ms(ms: Option<u64>) -> Option<Duration> {
    ms.map(Duration::from_millis)
}

async fn open(State(p): State<LlmProxy>, Json(b): Json<Open>) -> Response {
    match p
        .open_turn(&b.turn_id, b.backend_session_id.as_deref())
        .await
    {
        Ok(()) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => (StatusCode::CONFLICT, Json(json!({"error": e.to_string()}))).into_response(),
    }
}

async fn backend_session(State(p): State<LlmProxy>, Json(b): Json<BackendSession>) -> StatusCode {
    p.update_turn_backend_session(&b.backend_session_id).await;
    StatusCode::NO_CONTENT
}

async fn drain(State(p): State<LlmProxy>, body: Option<Json<Timeout>>) -> Json<Value> {
    let t = body.map(|b| b.0).unwrap_or_default();
    let drained = p.try_drain_turn(duration_ms(t.timeout_ms)).await;
    Json(json!({ "drained": drained }))
}

async fn clear(State(p): State<LlmProxy>) -> Json<Value> {
    Json(json!({ "counts": p.clear_turn().await }))
}

async fn counts(State(p): State<LlmProxy>) -> Json<Value> {
    Json(json!({ "counts": p.turn_counts() }))
}

async fn pause_state(State(p): State<LlmProxy>) -> Json<PauseState> {
    Json(p.pause_state())
}

fn control_result(r: Result<serde_json::Map<String, Value>, ProxyError>) -> Response {
    match r {
        Ok(m) => Json(Value::Object(m)).into_response(),
        Err(e) => (
            StatusCode::BAD_GATEWAY,
            Json(json!({"error": e.to_string()})),
        )
            .into_response(),
    }
}

async fn pause(State(p): State<LlmProxy>, body: Option<Json<Pause>>) -> Response {
    let b = body.map(|b| b.0).unwrap_or_default();
    let timeout = b
        .timeout_seconds
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map(Duration::from_secs_f64);
    let reason = b.reason.as_deref().unwrap_or("weight_update");
    control_result(p.pause(reason, timeout).await)
}

async fn resume(State(p): State<LlmProxy>, body: Option<Json<Resume>>) -> Response {
    let b = body.map(|b| b.0).unwrap_or_default();
    let reason = b.reason.as_deref().unwrap_or("weight_update");
    control_result(p.resume(b.version.as_deref(), reason).await)
}

async fn consume(State(p): State<LlmProxy>, Path(kind): Path<String>) -> Response {
    let error = match kind.as_str() {
        "context_overflow" => p.consume_context_overflow_error().await,
        "rollout_invalidated" => p.consume_rollout_invalidated_error().await,
        "failed_upstream" => p.consume_failed_upstream_error().await,
        "max_steps" => p.consume_max_steps_error().await,
        _ => {
            return (
                StatusCode::NOT_FOUND,
                Json(json!({"error": format!("unknown error kind {kind:?}")})),
            )
                .into_response();
        }
    };
    Json(json!({ "error": error })).into_response()
}

async fn wait_max_steps(State(p): State<LlmProxy>, body: Option<Json<Timeout>>) -> Json<Value> {
    let t = body.map(|b| b.0).unwrap_or_default();
    let error = p.wait_for_max_steps_error(duration_ms(t.timeout_ms)).await;
    Json(json!({ "error": error }))
}

async fn total_paused(State(p): State<LlmProxy>) -> Json<Value> {
    Json(json!({ "seconds": p.total_paused().as_secs_f64() }))
}
