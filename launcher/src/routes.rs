//! The HTTP surface: routes, caller authorization by `SO_PEERCRED`, body limits, and the JSON
//! error bodies of [`crate::error`] for everything including unknown routes and methods.
//!
//! | method | path | success |
//! |---|---|---|
//! | POST | `/agents` | 201 [`AgentStatus`](crate::api::AgentStatus) |
//! | GET | `/agents/{tid}` (`?wait=1` blocks until done) | 200 `AgentStatus` |
//! | DELETE | `/agents/{tid}` | 200 final `AgentStatus` |
//! | POST | `/checks` | 200 [`CheckResult`](crate::api::CheckResult) (synchronous) |
//! | POST | `/repo/snapshot` | 200 `{repo, sha}` |
//! | POST | `/repo/deliver` | 200 `{repo, branch, sha}` |
//! | POST | `/repo/delete-branch` | 200 `{repo, branch, sha}` |
//! | POST | `/backends/{model}/start` | 200 [`BackendStartResult`](crate::api::BackendStartResult) once healthy |
//! | POST | `/backends/vllm/stop` | 200 [`BackendStopResult`](crate::api::BackendStopResult) |
//! | GET | `/status` | 200 [`LauncherStatus`](crate::api::LauncherStatus): host readiness, runs and backends |
//! | POST | `/slots` | 201 [`SlotStatus`](crate::api::SlotStatus) once the server's socket exists |
//! | GET | `/slots/{tid}` | 200 `SlotStatus` |
//! | DELETE | `/slots/{tid}` | 200 final `SlotStatus` (sandbox gone, files removed) |
//! | POST | `/slots/{tid}/exec` | 200 [`SlotExecResult`](crate::api::SlotExecResult) |
//! | POST | `/slots/{tid}/files/read` | 200 [`SlotFile`](crate::api::SlotFile) |
//! | POST | `/slots/{tid}/files/write` | 200 [`SlotWriteResult`](crate::api::SlotWriteResult) |

use std::sync::Arc;
use std::time::Duration;

use agentbox_http::PeerCred;
use axum::Json;
use axum::Router;
use axum::extract::{FromRequest, Path, Query, Request, State};
use axum::http::{StatusCode, Uri};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde::de::DeserializeOwned;

use crate::api::{
    AgentRequest, AgentStatus, BackendStartResult, BackendStopResult, CheckRequest, CheckResult,
    DeleteBranchRequest, DeleteBranchResult, DeliverRequest, DeliverResult, SlotExecRequest,
    SlotExecResult, SlotFile, SlotReadRequest, SlotRequest, SlotStatus, SlotWriteRequest,
    SlotWriteResult, SnapshotRequest, SnapshotResult,
};
use crate::error::LauncherError;
use crate::launcher::Launcher;

/// Largest request body.
pub const BODY_LIMIT: u64 = 1 << 20;
/// How long a client may take to send its body.
pub const BODY_TIMEOUT: Duration = Duration::from_secs(30);

type Shared = State<Arc<Launcher>>;

/// The router, with `launcher` as state.
pub fn router(launcher: Arc<Launcher>) -> Router {
    Router::new()
        .route("/agents", post(post_agent))
        .route("/agents/{tid}", get(get_agent).delete(delete_agent))
        .route("/checks", post(run_check))
        .route("/repo/snapshot", post(snapshot))
        .route("/repo/deliver", post(deliver))
        .route("/repo/delete-branch", post(delete_branch))
        .route("/backends/{model}/start", post(backend_start))
        .route("/backends/vllm/stop", post(backend_stop))
        .route("/status", get(status))
        .route("/slots", post(post_slot))
        .route("/slots/{tid}", get(get_slot).delete(delete_slot))
        .route("/slots/{tid}/exec", post(slot_exec))
        .route("/slots/{tid}/files/read", post(slot_read))
        .route("/slots/{tid}/files/write", post(slot_write))
        .fallback(no_route)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(
            Arc::clone(&launcher),
            authorize,
        ))
        .with_state(launcher)
}

/// Only root and the service uid may talk to the launcher; the socket's mode is the first
/// layer, this is the second.
async fn authorize(State(l): Shared, req: Request, next: Next) -> Response {
    let uid = req.extensions().get::<PeerCred>().map(|c| c.uid);
    match uid {
        Some(uid) if uid == 0 || uid == l.service().uid => next.run(req).await,
        Some(uid) => LauncherError::Forbidden { uid }.into_response(),
        None => LauncherError::Forbidden { uid: u32::MAX }.into_response(),
    }
}

/// The whole body, within [`BODY_LIMIT`] and [`BODY_TIMEOUT`].
async fn read_body(req: Request) -> Result<bytes::Bytes, LauncherError> {
    let (parts, body) = req.into_parts();
    Ok(agentbox_http::read_body(&parts.headers, body, BODY_LIMIT, BODY_TIMEOUT).await?)
}

/// A request body that must be JSON of `T`, read within [`BODY_LIMIT`] and [`BODY_TIMEOUT`].
struct JsonBody<T>(T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = LauncherError;

    async fn from_request(req: Request, _: &S) -> Result<Self, LauncherError> {
        serde_json::from_slice(&read_body(req).await?)
            .map(JsonBody)
            .map_err(|e| LauncherError::BadRequest(e.to_string()))
    }
}

/// The body of the backend routes: nothing, or an empty JSON object.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NoFields {}

/// A body that must be empty or `{}`. Extracting it reads (and so drains) it: a request
/// answered before its body was read would have its connection closed under the client's
/// write.
struct NoBody;

impl<S: Send + Sync> FromRequest<S> for NoBody {
    type Rejection = LauncherError;

    async fn from_request(req: Request, _: &S) -> Result<Self, LauncherError> {
        let bytes = read_body(req).await?;
        if !bytes.iter().all(u8::is_ascii_whitespace) {
            serde_json::from_slice::<NoFields>(&bytes)
                .map_err(|e| LauncherError::BadRequest(e.to_string()))?;
        }
        Ok(NoBody)
    }
}

/// A JSON answer with status 200, or the error's own.
type Answer<T> = Result<Json<T>, LauncherError>;

async fn post_agent(
    State(l): Shared,
    JsonBody(req): JsonBody<AgentRequest>,
) -> Result<(StatusCode, Json<AgentStatus>), LauncherError> {
    Ok((StatusCode::CREATED, Json(l.start_agent(req).await?)))
}

#[derive(Debug, Deserialize)]
struct WaitQuery {
    wait: Option<String>,
}

async fn get_agent(
    State(l): Shared,
    Path(tid): Path<String>,
    Query(q): Query<WaitQuery>,
) -> Answer<AgentStatus> {
    let wait = match q.wait.as_deref() {
        None | Some("0" | "false") => false,
        Some("1" | "true") => true,
        Some(other) => {
            return Err(LauncherError::BadRequest(format!(
                "wait must be 0 or 1, got {other:?}"
            )));
        }
    };
    l.agent_status(&tid, wait).await.map(Json)
}

async fn delete_agent(State(l): Shared, Path(tid): Path<String>) -> Answer<AgentStatus> {
    l.delete_agent(&tid).await.map(Json)
}

async fn post_slot(
    State(l): Shared,
    JsonBody(req): JsonBody<SlotRequest>,
) -> Result<(StatusCode, Json<SlotStatus>), LauncherError> {
    Ok((StatusCode::CREATED, Json(l.start_slot(req).await?)))
}

async fn get_slot(State(l): Shared, Path(tid): Path<String>) -> Answer<SlotStatus> {
    l.slot_status(&tid).await.map(Json)
}

async fn delete_slot(State(l): Shared, Path(tid): Path<String>) -> Answer<SlotStatus> {
    l.delete_slot(&tid).await.map(Json)
}

/// Slot routes whose JSON body is the request of the launcher method of the same name.
macro_rules! slot_routes {
    ($($method:ident($request:ty) -> $answer:ty;)+) => {$(
        async fn $method(
            State(l): Shared,
            Path(tid): Path<String>,
            JsonBody(req): JsonBody<$request>,
        ) -> Answer<$answer> {
            l.$method(&tid, req).await.map(Json)
        }
    )+};
}

slot_routes! {
    slot_exec(SlotExecRequest) -> SlotExecResult;
    slot_read(SlotReadRequest) -> SlotFile;
    slot_write(SlotWriteRequest) -> SlotWriteResult;
}

/// Routes whose JSON body is the request of the launcher method of the same name, answered
/// with its result.
macro_rules! json_routes {
    ($($method:ident($request:ty) -> $answer:ty;)+) => {$(
        async fn $method(State(l): Shared, JsonBody(req): JsonBody<$request>) -> Answer<$answer> {
            l.$method(req).await.map(Json)
        }
    )+};
}

json_routes! {
    run_check(CheckRequest) -> CheckResult;
    snapshot(SnapshotRequest) -> SnapshotResult;
    deliver(DeliverRequest) -> DeliverResult;
    delete_branch(DeleteBranchRequest) -> DeleteBranchResult;
}

/// Waits until the backend is healthy (minutes for a large model). A client that goes away
/// does not stop the start: the backend's supervisor runs on its own.
async fn backend_start(
    State(l): Shared,
    Path(model): Path<String>,
    NoBody: NoBody,
) -> Answer<BackendStartResult> {
    l.start_backend(&model).await.map(Json)
}

async fn backend_stop(State(l): Shared, NoBody: NoBody) -> Answer<BackendStopResult> {
    l.stop_backends().await.map(Json)
}

async fn status(State(l): Shared) -> Response {
    let host = crate::status::probe_host(l.bwrap().to_path_buf(), l.cgroups().clone()).await;
    Json(l.status(host)).into_response()
}

async fn no_route(uri: Uri) -> LauncherError {
    LauncherError::NoRoute(format!(
        "{:?}",
        uri.path().chars().take(200).collect::<String>()
    ))
}

async fn method_not_allowed() -> LauncherError {
    LauncherError::MethodNotAllowed
}
