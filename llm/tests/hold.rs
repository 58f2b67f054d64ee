//! An upstream event stream that arrives in one read reaches the client as one frame (one
//! write), through the real client stack: hyper's client hands a chunked body over one chunk
//! per scheduler turn, and the body's hold waits those turns out.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentbox_llm::{AnthropicTarget, Auth, ClientOptions, LlmBody, Upstream};
use futures_util::StreamExt;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const EVENTS: [&str; 5] = [
    "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"x\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n",
    "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hello\"}}\n\n",
    "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
    "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":5}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
];

/// An upstream that answers one request with [`EVENTS`] in one write, each event a chunk of
/// its own (how a server that writes each event sends them when they are ready together).
async fn upstream_in_one_write() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/messages", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 65536];
        let _ = s.read(&mut buf).await;
        let mut answer = String::from(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
        );
        for e in EVENTS {
            answer.push_str(&format!("{:x}\r\n{e}\r\n", e.len()));
        }
        answer.push_str("0\r\n\r\n");
        s.write_all(answer.as_bytes()).await.unwrap();
        let _ = s.read(&mut buf).await;
    });
    url
}

/// The streamed answer of `url` through the engine's client.
async fn answer_of(up: &Upstream, url: &str) -> LlmBody {
    let url = agentbox_llm::upstream_url(url).unwrap();
    let target = AnthropicTarget {
        url: &url,
        auth: Auth::None,
        version: "2023-06-01",
        size_hint: 0,
    };
    up.anthropic_bytes(target, br#"{"model":"m","stream":true}"#.to_vec())
        .await
        .unwrap()
        .body
}

#[tokio::test]
async fn a_stream_read_at_once_goes_out_as_one_frame() {
    let url = upstream_in_one_write().await;
    let up = Upstream::new(&ClientOptions::default()).unwrap();
    let mut body = answer_of(&up, &url).await;
    let mut frames = Vec::new();
    while let Some(f) = body.next().await {
        frames.push(f.unwrap());
    }
    let all: Vec<u8> = frames.concat();
    assert_eq!(all, EVENTS.concat().as_bytes());
    assert_eq!(frames.len(), 1, "{frames:?}");
}

/// The same, with the body served by a server task of its own (as the daemons serve it): the
/// upstream's connection task and the server's take turns on one event loop.
#[tokio::test]
async fn a_stream_read_at_once_is_one_frame_when_served() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    let up_url = upstream_in_one_write().await;
    let frames = Arc::new(AtomicUsize::new(0));
    let counted = frames.clone();
    let up = Arc::new(Upstream::new(&ClientOptions::default()).unwrap());
    let app = axum::Router::new().route(
        "/",
        axum::routing::get(move || {
            let up = up.clone();
            let counted = counted.clone();
            let up_url = up_url.clone();
            async move {
                let body = answer_of(&up, &up_url).await.inspect(move |_| {
                    counted.fetch_add(1, Ordering::SeqCst);
                });
                axum::body::Body::from_stream(body)
            }
        }),
    );
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = server.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(agentbox_http::serve_tcp(server, app, stop.clone()));
    let got = reqwest::get(format!("http://{addr}/"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(got, EVENTS.concat().as_bytes());
    assert_eq!(frames.load(Ordering::SeqCst), 1);
    stop.cancel();
}
