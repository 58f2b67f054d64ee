//! The engine over a unix socket (`ClientOptions::unix_socket`) with the chat passthrough
//! (`Upstream::chat`): every call of that client reaches the socket whatever host its URL
//! names, the caller's headers go with it, and the chat usage meter settles once with the
//! upstream's numbers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};

use agentbox_llm::{Auth, ChatPassTarget, ClientOptions, Upstream};
use agentbox_policy::secret::Secret;
use axum::Router;
use axum::http::HeaderMap;
use axum::routing::post;
use futures_util::StreamExt;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const STREAM: &str = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":42,\"completion_tokens\":5,\"total_tokens\":47}}\n\ndata: [DONE]\n\n";

#[tokio::test]
async fn chat_over_a_unix_socket_is_passed_through_and_metered() {
    let dir = std::env::temp_dir().join(format!("llm-unix-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let sock = dir.join("router.sock");
    let _ = std::fs::remove_file(&sock);
    let listener = tokio::net::UnixListener::bind(&sock).unwrap();
    let seen: Arc<Mutex<Vec<HeaderMap>>> = Arc::default();
    let log = seen.clone();
    let app = Router::new().route(
        "/v1/chat/completions",
        post(move |headers: HeaderMap| {
            log.lock().unwrap().push(headers);
            async { ([("content-type", "text/event-stream")], STREAM) }
        }),
    );
    let stop = CancellationToken::new();
    let server = tokio::spawn(agentbox_http::serve_unix(listener, app, stop.clone()));

    let upstream = Upstream::new(&ClientOptions {
        unix_socket: Some(sock.clone()),
        ..ClientOptions::default()
    })
    .unwrap();
    let token = Secret::new("router-token".into()).unwrap();
    let answer = upstream
        .chat(
            ChatPassTarget {
                // The host is never resolved: the client connects to the socket.
                url: &agentbox_llm::upstream_url("http://no-such-host.invalid/v1/chat/completions")
                    .unwrap(),
                auth: Auth::Bearer(&token),
                headers: &[("x-session-id", "s1")],
                size_hint: 64,
            },
            json!({"model": "m", "messages": [], "stream": true}),
        )
        .await
        .unwrap();
    let reports = Arc::new(Mutex::new(Vec::new()));
    let sink = reports.clone();
    let mut body = answer
        .metered_chat(move |r| sink.lock().unwrap().push(r))
        .body;
    let mut out = Vec::new();
    while let Some(chunk) = body.next().await {
        out.extend_from_slice(&chunk.unwrap());
    }
    drop(body);
    assert_eq!(String::from_utf8(out).unwrap(), STREAM);
    let reports = reports.lock().unwrap().clone();
    assert_eq!(reports.len(), 1, "settled exactly once");
    assert!(reports[0].complete);
    assert_eq!(
        (
            reports[0].usage.input_tokens,
            reports[0].usage.output_tokens
        ),
        (42, 5)
    );
    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0]["authorization"], "Bearer router-token");
    assert_eq!(seen[0]["x-session-id"], "s1");
    stop.cancel();
    server.await.unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
