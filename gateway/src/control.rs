//! The control socket (`run/gateway.sock`): `POST /tasks`, `GET /tasks/{tid}`,
//! `DELETE /tasks/{tid}`, `GET /status`. Only root and the service user may call it, checked
//! by `SO_PEERCRED` on every request (the socket's mode is a second fence, not the only one).
//! The shapes are `agentbox_api::gateway`'s.

use std::sync::Arc;
use std::time::Duration;

use agentbox_http::{BodyError, PeerCred, read_body};
use axum::Router;
use axum::extract::{Path, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;

use crate::error::ControlError;
use agentbox_api::gateway::OpenTask;

use crate::gateway::Gateway;

/// Control requests are tiny.
const MAX_CONTROL_BODY: u64 = 64 * 1024;

/// The control router.
pub fn router(gw: Arc<Gateway>) -> Router {
    Router::new()
        .route("/tasks", axum::routing::post(open))
        .route("/tasks/{tid}", get(show).delete(close))
        .route("/status", get(status))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(gw.clone(), only_service))
        .with_state(gw)
}

async fn only_service(State(gw): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    match req.extensions().get::<PeerCred>() {
        Some(c) if c.uid == 0 || gw.options().control_uids.contains(&c.uid) => next.run(req).await,
        Some(c) => ControlError::Forbidden(c.uid).into_response(),
        // No credentials means the router was not served by `serve_unix`: refuse.
        None => ControlError::Forbidden(u32::MAX).into_response(),
    }
}

async fn not_found(req: Request) -> ControlError {
    ControlError::NotFound(format!("{} {}", req.method(), req.uri().path()))
}

async fn open(State(gw): State<Arc<Gateway>>, req: Request) -> Result<Response, ControlError> {
    let (parts, body) = req.into_parts();
    let bytes = read_body(
        &parts.headers,
        body,
        MAX_CONTROL_BODY,
        Duration::from_secs(10),
    )
    .await
    .map_err(|e| match e {
        BodyError::TooLarge { .. } => ControlError::TooLarge,
        BodyError::Timeout(_) | BodyError::Read(_) => ControlError::BadRequest(e.to_string()),
    })?;
    let req: OpenTask = serde_json::from_slice(&bytes)
        .map_err(|e| ControlError::BadRequest(format!("invalid request: {e}")))?;
    let view = gw.open_task(req).await?;
    Ok((axum::http::StatusCode::CREATED, axum::Json(view)).into_response())
}

async fn show(
    State(gw): State<Arc<Gateway>>,
    Path(tid): Path<String>,
) -> Result<Response, ControlError> {
    Ok(axum::Json(gw.task(&tid)?).into_response())
}

async fn close(
    State(gw): State<Arc<Gateway>>,
    Path(tid): Path<String>,
) -> Result<Response, ControlError> {
    Ok(axum::Json(gw.close_task(&tid).await?).into_response())
}

async fn status(State(gw): State<Arc<Gateway>>) -> Response {
    axum::Json(gw.status()).into_response()
}
