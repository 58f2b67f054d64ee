//! The client against a real axum server on a temp unix socket: typed answers, a chunked body,
//! the error envelope as a typed error, raw access, and the timeout.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::time::Duration;

use agentbox_api::error::ErrorEnvelope;
use agentbox_api::gateway::OpenTask;
use agentbox_api::launcher::{AgentStatus, RunState};
use agentbox_api::{ClientError, GatewayClient, LauncherClient, UnixClient};
use agentbox_policy::id::Tid;
use axum::Router;
use axum::body::{Body, Bytes};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

fn status_json(tid: &str) -> String {
    serde_json::json!({"tid": tid, "state": "exited", "exit_code": 0, "oom_killed": false,
        "timed_out": false, "stdout": "x".repeat(100_000), "stderr": "", "truncated": false,
        "result_commit": null, "error": null})
    .to_string()
}

/// The answer in small chunks and without a length: `transfer-encoding: chunked`.
async fn chunked() -> Response {
    let text = status_json("t1");
    let chunks: Vec<Result<Bytes, Infallible>> = text
        .as_bytes()
        .chunks(1000)
        .map(|c| Ok(Bytes::copy_from_slice(c)))
        .collect();
    Body::from_stream(futures_util::stream::iter(chunks)).into_response()
}

async fn refuse() -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(ErrorEnvelope::new("no_such_task", "no task nope")),
    )
        .into_response()
}

async fn echo(body: Bytes) -> Response {
    (StatusCode::IM_A_TEAPOT, body).into_response()
}

async fn slow() -> &'static str {
    tokio::time::sleep(Duration::from_secs(30)).await;
    "late"
}

async fn serve() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("api.sock");
    let listener = tokio::net::UnixListener::bind(&sock).unwrap();
    let app = Router::new()
        .route("/agents/{tid}", get(chunked))
        .route("/tasks/{tid}", get(refuse))
        .route("/tasks", post(echo))
        .route("/status", get(|| async { "not json" }))
        .route("/slow", get(slow));
    tokio::spawn(async move { axum::serve(listener, app).await });
    (dir, sock)
}

#[tokio::test]
async fn typed_answers_errors_and_raw_access() {
    let (_dir, sock) = serve().await;
    let launcher = LauncherClient::new(&sock);
    let tid = Tid::parse("t1").unwrap();

    // A chunked answer arrives whole and typed.
    let raw = launcher
        .http()
        .raw("GET", "/agents/t1", &[], "")
        .await
        .unwrap();
    assert_eq!(
        raw.headers.get("transfer-encoding").map(String::as_str),
        Some("chunked")
    );
    let status: AgentStatus = launcher.agent(&tid).await.unwrap();
    assert_eq!(status.state, RunState::Exited);
    assert_eq!(status.stdout.len(), 100_000);
    // Twice more over the pooled connection.
    for _ in 0..2 {
        assert_eq!(launcher.wait_agent(&tid).await.unwrap(), status);
    }

    // The envelope becomes a typed error carrying status, code and message.
    let gateway = GatewayClient::new(&sock);
    let err = gateway
        .task(&Tid::parse("nope").unwrap())
        .await
        .unwrap_err();
    assert_eq!(
        (err.status(), err.code()),
        (Some(404), Some("no_such_task"))
    );
    let ClientError::Api { status, error } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*status, 404);
    assert_eq!(error.message, "no task nope");

    // A 2xx that is not the type is a decode error; a non-2xx without an envelope keeps its
    // status and body.
    let err = launcher.status().await.unwrap_err();
    assert!(
        matches!(err, ClientError::Decode { status: 200, .. }),
        "{err:?}"
    );
    let open = OpenTask {
        tid: "t1".into(),
        model: "m".into(),
        token: "tok".into(),
        budget: Default::default(),
    };
    let err = gateway.open_task(&open).await.unwrap_err();
    let ClientError::Status { status, body } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(*status, 418);
    // The request went out as the JSON of the type.
    let sent: OpenTask = serde_json::from_str(body).unwrap();
    assert_eq!(sent, open);

    // Raw access sends whatever it is given, byte for byte.
    let raw = gateway
        .http()
        .raw(
            "POST",
            "/tasks",
            &[("content-type", "text/plain")],
            "{not json",
        )
        .await
        .unwrap();
    assert_eq!((raw.status, &raw.body[..]), (418, &b"{not json"[..]));
    assert!(raw.error().is_none());
}

#[tokio::test]
async fn timeouts_and_transport_errors() {
    let (dir, sock) = serve().await;
    let client = UnixClient::new(&sock).with_timeout(Some(Duration::from_millis(200)));
    let err = client.raw("GET", "/slow", &[], "").await.unwrap_err();
    assert!(matches!(err, ClientError::Timeout { .. }), "{err:?}");

    let missing = UnixClient::new(dir.path().join("absent.sock"));
    let err = missing.raw("GET", "/status", &[], "").await.unwrap_err();
    let ClientError::Transport { message, .. } = &err else {
        panic!("{err:?}")
    };
    assert!(message.contains("No such file"), "{message}");
    let err = client.raw("BAD METHOD", "/", &[], "").await.unwrap_err();
    assert!(matches!(err, ClientError::Request(_)), "{err:?}");
}
