//! `run/pool.sock`: the routes of `agentbox_api::pool`. Only root and the service user may
//! call them, checked by `SO_PEERCRED` on every request (the socket's mode is a second fence).

use std::sync::Arc;
use std::time::Duration;

use agentbox_http::{BodyError, PeerCred, read_body};
use axum::Router;
use axum::extract::{Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::de::DeserializeOwned;

use crate::backend::SlotBackend;
use crate::error::PoolError;
use crate::pool::Pool;

/// A `write_file` carries the file, base64: the launcher's default output cap (20 MiB) and then
/// some.
pub const MAX_BODY: u64 = 32 * 1024 * 1024;

/// The router of `pool.sock`.
pub fn router<B: SlotBackend>(pool: Arc<Pool<B>>) -> Router {
    Router::new()
        .route("/acquire", post(acquire::<B>))
        .route("/release", post(release::<B>))
        .route("/run_command", post(run_command::<B>))
        .route("/read_file", post(read_file::<B>))
        .route("/write_file", post(write_file::<B>))
        .route("/drain", post(drain::<B>))
        .route("/undrain", post(undrain::<B>))
        .route("/status", get(status::<B>))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(
            pool.clone(),
            only_service::<B>,
        ))
        .with_state(pool)
}

async fn only_service<B: SlotBackend>(
    State(pool): State<Arc<Pool<B>>>,
    req: Request,
    next: Next,
) -> Response {
    match req.extensions().get::<PeerCred>() {
        Some(c) if c.uid == 0 || pool.options().control_uids.contains(&c.uid) => {
            next.run(req).await
        }
        Some(c) => PoolError::Forbidden(c.uid).into_response(),
        None => PoolError::Forbidden(u32::MAX).into_response(),
    }
}

async fn not_found(req: Request) -> PoolError {
    PoolError::NotFound(format!("{} {}", req.method(), req.uri().path()))
}

async fn json<T: DeserializeOwned>(req: Request) -> Result<T, PoolError> {
    let (parts, body) = req.into_parts();
    let bytes = read_body(&parts.headers, body, MAX_BODY, Duration::from_secs(60))
        .await
        .map_err(|e| match e {
            BodyError::TooLarge { .. } => PoolError::TooLarge(MAX_BODY),
            BodyError::Timeout(_) | BodyError::Read(_) => PoolError::BadRequest(e.to_string()),
        })?;
    serde_json::from_slice(&bytes)
        .map_err(|e| PoolError::BadRequest(format!("invalid request: {e}")))
}

async fn acquire<B: SlotBackend>(
    State(pool): State<Arc<Pool<B>>>,
    req: Request,
) -> Result<Response, PoolError> {
    let req = json(req).await?;
    Ok(axum::Json(pool.acquire(&req)?).into_response())
}

async fn release<B: SlotBackend>(
    State(pool): State<Arc<Pool<B>>>,
    req: Request,
) -> Result<Response, PoolError> {
    let req = json(req).await?;
    Ok(axum::Json(pool.release(&req)?).into_response())
}

async fn run_command<B: SlotBackend>(
    State(pool): State<Arc<Pool<B>>>,
    req: Request,
) -> Result<Response, PoolError> {
    let req = json(req).await?;
    Ok(axum::Json(pool.run_command(&req).await?).into_response())
}

async fn read_file<B: SlotBackend>(
    State(pool): State<Arc<Pool<B>>>,
    req: Request,
) -> Result<Response, PoolError> {
    let req = json(req).await?;
    Ok(axum::Json(pool.read_file(&req).await?).into_response())
}

async fn write_file<B: SlotBackend>(
    State(pool): State<Arc<Pool<B>>>,
    req: Request,
) -> Result<Response, PoolError> {
    let req = json(req).await?;
    Ok(axum::Json(pool.write_file(&req).await?).into_response())
}

async fn drain<B: SlotBackend>(State(pool): State<Arc<Pool<B>>>) -> Response {
    axum::Json(pool.set_draining(true)).into_response()
}

async fn undrain<B: SlotBackend>(State(pool): State<Arc<Pool<B>>>) -> Response {
    axum::Json(pool.set_draining(false)).into_response()
}

async fn status<B: SlotBackend>(State(pool): State<Arc<Pool<B>>>) -> Response {
    axum::Json(pool.status()).into_response()
}
