//! The engine against real sockets that misbehave: a silent upstream times out (504), a closed
//! port is unreachable (502), an endless error body is read only up to the cap, and none of
//! what the client would see names the upstream's address.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

mod common;

use agentbox_llm::{ClientOptions, LlmError, Upstream};
use axum::http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

fn upstream(read_timeout: Duration) -> Upstream {
    Upstream::new(&ClientOptions {
        read_timeout,
        ..ClientOptions::default()
    })
    .unwrap()
}

/// A listener that reads each request and then does what `answer` says with the socket.
async fn server<F, Fut>(answer: F) -> String
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/messages", listener.local_addr().unwrap());
    tokio::spawn(async move {
        loop {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut buf = vec![0u8; 65536];
            let _ = s.read(&mut buf).await;
            tokio::spawn(answer(s));
        }
    });
    url
}

async fn call(up: &Upstream, url: &str) -> LlmError {
    match common::anthropic_call(up, url, br#"{"model":"m"}"#).await {
        Ok(a) => panic!("expected an error, got {}", a.status),
        Err(e) => e,
    }
}

fn assert_generic(e: &LlmError, url: &str) {
    let reply = e.reply();
    let body = serde_json::to_string(&reply.body).unwrap();
    let host = url.trim_start_matches("http://").split('/').next().unwrap();
    assert!(!body.contains(host) && !body.contains("http://"), "{body}");
}

#[tokio::test]
async fn a_silent_upstream_times_out_with_504() {
    let url = server(|s| async move {
        tokio::time::sleep(Duration::from_secs(30)).await;
        drop(s);
    })
    .await;
    let e = call(&upstream(Duration::from_millis(300)), &url).await;
    assert!(matches!(e, LlmError::Timeout), "{e:?}");
    assert_eq!(e.reply().status, StatusCode::GATEWAY_TIMEOUT);
    assert_generic(&e, &url);
}

#[tokio::test]
async fn a_closed_port_is_unreachable_with_502() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/messages", listener.local_addr().unwrap());
    drop(listener);
    let e = call(&upstream(Duration::from_secs(5)), &url).await;
    assert!(matches!(e, LlmError::Unreachable(_)), "{e:?}");
    assert_eq!(e.reply().status, StatusCode::BAD_GATEWAY);
    assert_generic(&e, &url);
}

/// A connection that never completes (the listener's accept queue is full, so its SYNs are
/// dropped) is unreachable, not a timeout: nothing was sent, so nothing may be billed (the
/// gateway refunds `Unreachable` and bills a `Timeout`'s whole reservation).
#[tokio::test]
async fn a_connect_that_times_out_is_unreachable() {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind("127.0.0.1:0".parse().unwrap()).unwrap();
    let listener = socket.listen(0).unwrap();
    let addr = listener.local_addr().unwrap();
    // Never accepted: these fill the accept queue.
    let mut queued = Vec::new();
    for _ in 0..4 {
        if let Ok(Ok(s)) = tokio::time::timeout(
            Duration::from_millis(200),
            tokio::net::TcpStream::connect(addr),
        )
        .await
        {
            queued.push(s);
        }
    }
    let up = Upstream::new(&ClientOptions {
        connect_timeout: Duration::from_millis(300),
        ..ClientOptions::default()
    })
    .unwrap();
    let url = format!("http://{addr}/v1/messages");
    let e = call(&up, &url).await;
    assert!(matches!(e, LlmError::Unreachable(_)), "{e:?}");
    assert_eq!(e.reply().status, StatusCode::BAD_GATEWAY);
    drop((queued, listener));
}

#[tokio::test]
async fn an_endless_error_body_is_read_only_up_to_the_cap() {
    let url = server(|mut s| async move {
        let head = "HTTP/1.1 500 Internal Server Error\r\ncontent-type: text/plain\r\ncontent-length: 1073741824\r\n\r\n";
        if s.write_all(head.as_bytes()).await.is_err() {
            return;
        }
        // 1 MiB, naming the upstream, then nothing more: a reader that wanted the whole body
        // would wait for the read timeout.
        let line = "error at http://127.0.0.1:1/ ".repeat(1 << 15);
        let _ = s.write_all(line.as_bytes()).await;
        tokio::time::sleep(Duration::from_secs(30)).await;
    })
    .await;
    let started = Instant::now();
    let e = call(&upstream(Duration::from_secs(20)), &url).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "waited {:?}",
        started.elapsed()
    );
    let reply = e.reply();
    assert_eq!(reply.status, StatusCode::BAD_GATEWAY);
    assert_generic(&e, &url);
}
