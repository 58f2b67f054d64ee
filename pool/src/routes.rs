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

#[cfg(test)]
mod tests {
    use agentbox_api::pool::AcquireRequest;
    use agentbox_api::{PoolClient, UnixClient};
    use tokio_util::sync::CancellationToken;

    use super::*;
    use crate::pool::tests::options;
    use crate::testing::Fake;

    #[tokio::test]
    async fn refusals_travel_as_the_envelope_with_their_status() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("pool.sock");
        let listener = tokio::net::UnixListener::bind(&sock).unwrap();
        let shutdown = CancellationToken::new();
        let pool = Pool::new(options(1), Fake::default(), shutdown.clone());
        let server = tokio::spawn(agentbox_http::serve_unix(
            listener,
            router(pool.clone()),
            shutdown.clone(),
        ));
        let client = PoolClient::new(&sock);
        let acq = |t: &str| AcquireRequest {
            trajectory_id: t.into(),
            env_type: None,
            env_args: None,
        };
        // Nothing started yet: no READY slot.
        let e = client.acquire(&acq("t")).await.unwrap_err();
        assert_eq!((e.status(), e.code()), (Some(503), Some("no_free_slot")));
        client.drain().await.unwrap();
        let e = client.acquire(&acq("t")).await.unwrap_err();
        assert_eq!((e.status(), e.code()), (Some(409), Some("draining")));
        let e = client
            .release(&agentbox_api::pool::LeaseRef::default())
            .await
            .unwrap_err();
        assert_eq!((e.status(), e.code()), (Some(400), Some("bad_request")));
        let raw = UnixClient::new(&sock);
        for (method, path, body, status, code) in [
            ("POST", "/acquire", "{not json", 400, "bad_request"),
            (
                "POST",
                "/acquire",
                r#"{"trajectory_id":"t","bogus":1}"#,
                400,
                "bad_request",
            ),
            (
                "POST",
                "/run_command",
                r#"{"trajectory_id":"t","command":"true"}"#,
                404,
                "lease_not_found",
            ),
            ("GET", "/nope", "", 404, "not_found"),
        ] {
            let r = raw
                .raw(
                    method,
                    path,
                    &[("content-type", "application/json")],
                    body.to_owned(),
                )
                .await
                .unwrap();
            assert_eq!(r.status, status, "{method} {path}: {}", r.text());
            assert_eq!(
                r.error().map(|e| e.code),
                Some(code.to_owned()),
                "{}",
                r.text()
            );
        }
        shutdown.cancel();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn callers_other_than_root_and_the_service_user_are_refused() {
        use tower::ServiceExt;
        let mut opts = options(1);
        opts.control_uids = vec![4242];
        let pool = Pool::new(opts, Fake::default(), CancellationToken::new());
        let call = |cred: Option<PeerCred>| {
            let mut req = Request::builder()
                .uri("/status")
                .body(axum::body::Body::empty())
                .unwrap();
            if let Some(c) = cred {
                req.extensions_mut().insert(c);
            }
            router(pool.clone()).oneshot(req)
        };
        let cred = |uid| {
            Some(PeerCred {
                uid,
                gid: uid,
                pid: None,
            })
        };
        for (who, status) in [
            (cred(0), 200),
            (cred(4242), 200),
            (cred(1000), 403),
            (None, 403),
        ] {
            let r = call(who).await.unwrap();
            assert_eq!(r.status().as_u16(), status, "{who:?}");
        }
    }
}
