//! The shared serving loop on real sockets: peer credentials on unix sockets, body limits and
//! deadlines, and shutdown that finishes in-flight requests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use agentbox_http::{BodyError, PeerCred, read_body, serve_tcp, serve_unix};
use axum::Router;
use axum::extract::Request;
use axum::routing::{get, post};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

async fn raw<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut s: S,
    req: &str,
) -> String {
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    String::from_utf8_lossy(&out).into_owned()
}

fn app() -> Router {
    Router::new()
        .route(
            "/whoami",
            get(|req: Request| async move {
                let c = req.extensions().get::<PeerCred>().copied();
                format!("{:?}", c.map(|c| (c.uid, c.gid, c.pid.is_some())))
            }),
        )
        .route(
            "/echo",
            post(|req: Request| async move {
                let (parts, body) = req.into_parts();
                match read_body(&parts.headers, body, 16, Duration::from_millis(300)).await {
                    Ok(b) => format!("ok {}", b.len()),
                    Err(BodyError::TooLarge { limit }) => format!("too large {limit}"),
                    Err(BodyError::Timeout(_)) => "timeout".to_owned(),
                    Err(BodyError::Read(e)) => format!("read {e}"),
                }
            }),
        )
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(300)).await;
                "finished"
            }),
        )
}

#[tokio::test]
async fn unix_requests_carry_the_peer_credentials() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let stop = CancellationToken::new();
    let server = tokio::spawn(serve_unix(listener, app(), stop.clone()));
    let s = tokio::net::UnixStream::connect(&path).await.unwrap();
    let resp = raw(
        s,
        "GET /whoami HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
    )
    .await;
    let me = rustix_ids();
    assert!(
        resp.contains(&format!("Some(({}, {}, true))", me.0, me.1)),
        "{resp}"
    );
    stop.cancel();
    server.await.unwrap();
}

fn rustix_ids() -> (u32, u32) {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let field = |name: &str| -> u32 {
        let line = status.lines().find(|l| l.starts_with(name)).unwrap();
        // Real, effective, saved, fs: the kernel reports the effective id.
        line.split_whitespace().nth(2).unwrap().parse().unwrap()
    };
    (field("Uid:"), field("Gid:"))
}

/// `app()` served on a fresh loopback port: its address, the token that stops it, the task.
async fn tcp_server() -> (
    std::net::SocketAddr,
    CancellationToken,
    tokio::task::JoinHandle<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = CancellationToken::new();
    let server = tokio::spawn(serve_tcp(listener, app(), stop.clone()));
    (addr, stop, server)
}

#[tokio::test]
async fn bodies_are_limited_and_deadlined() {
    let (addr, stop, server) = tcp_server().await;
    let conn = || tokio::net::TcpStream::connect(addr);

    let head = "POST /echo HTTP/1.1\r\nhost: x\r\nconnection: close\r\n";
    for (case, rest, want) in [
        ("within the limit", "content-length: 5\r\n\r\nhello", "ok 5"),
        (
            "declared length refused before reading",
            "content-length: 17\r\n\r\n",
            "too large 16",
        ),
        (
            "chunked overflow",
            "transfer-encoding: chunked\r\n\r\n10\r\n0123456789abcdef\r\n1\r\nx\r\n0\r\n\r\n",
            "too large 16",
        ),
        ("body deadline", "content-length: 10\r\n\r\nabc", "timeout"),
    ] {
        let r = raw(conn().await.unwrap(), &format!("{head}{rest}")).await;
        assert!(r.ends_with(want), "{case}: {r}");
    }
    stop.cancel();
    server.await.unwrap();
}

#[tokio::test]
async fn shutdown_finishes_in_flight_requests_and_stops_accepting() {
    let (addr, stop, server) = tcp_server().await;
    let inflight = tokio::spawn(async move {
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        raw(s, "GET /slow HTTP/1.1\r\nhost: x\r\n\r\n").await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    stop.cancel();
    server.await.unwrap();
    let r = inflight.await.unwrap();
    assert!(
        r.starts_with("HTTP/1.1 200") && r.ends_with("finished"),
        "{r}"
    );
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "listener closed after shutdown"
    );
}
