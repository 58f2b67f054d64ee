//! An upstream event stream that arrives in one read reaches the client as one frame (one
//! write), through the real client stack: hyper's client hands a chunked body over one chunk
//! per scheduler turn, and the body's hold waits those turns out. A translated answer's end
//! is ready with its last frame when the upstream's end follows at once, and an answer's head
//! waits those turns for its first frame, so a burst is answered in one write in all.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use agentbox_llm::{Answer, ChatToAnthropic, ClientOptions, LlmBody, Upstream};
use agentbox_wire::translate::ResponseOptions;
use futures_util::StreamExt;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

const EVENTS: [&str; 5] = [
    "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"m\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"x\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":10,\"output_tokens\":1}}}\n\n",
    "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
    "event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":0,\"delta\":{\"type\":\"text_delta\",\"text\":\"hello\"}}\n\n",
    "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
    "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":5}}\n\nevent: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
];

/// An OpenAI chat stream whose `[DONE]` comes as a chunk of its own.
const CHAT: [&str; 3] = [
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"hi\"},\"finish_reason\":null}]}\n\n",
    "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3,\"total_tokens\":10}}\n\n",
    "data: [DONE]\n\n",
];

/// An upstream that answers one request with [`EVENTS`] in one write, each event a chunk of
/// its own (how a server that writes each event sends them when they are ready together).
async fn upstream_in_one_write() -> String {
    upstream_writing(&EVENTS).await
}

/// An upstream that answers one request with `chunks` in one write, as a chunked body.
async fn upstream_writing(chunks: &'static [&'static str]) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/v1/messages", listener.local_addr().unwrap());
    tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut buf = vec![0u8; 65536];
        let _ = s.read(&mut buf).await;
        let mut answer = String::from(
            "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n",
        );
        for e in chunks {
            answer.push_str(&format!("{:x}\r\n{e}\r\n", e.len()));
        }
        answer.push_str("0\r\n\r\n");
        s.write_all(answer.as_bytes()).await.unwrap();
        let _ = s.read(&mut buf).await;
    });
    url
}

/// The streamed answer of `url` through the engine's client.
async fn answer_of(up: &Upstream, url: &str) -> Answer {
    common::anthropic_call(up, url, br#"{"model":"m","stream":true}"#)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_stream_read_at_once_goes_out_as_one_frame() {
    let url = upstream_in_one_write().await;
    let up = Upstream::new(&ClientOptions::default()).unwrap();
    let mut body = answer_of(&up, &url).await.body;
    let mut frames = Vec::new();
    while let Some(f) = body.next().await {
        frames.push(f.unwrap());
    }
    let all: Vec<u8> = frames.concat();
    assert_eq!(all, EVENTS.concat().as_bytes());
    assert_eq!(frames.len(), 1, "{frames:?}");
}

/// A GET of `addr` answers [`EVENTS`], whole.
async fn assert_gets_the_events(addr: std::net::SocketAddr) {
    let got = reqwest::get(format!("http://{addr}/"))
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(got, EVENTS.concat().as_bytes());
}

/// The same, with the body served by a server task of its own (as the daemons serve it): the
/// upstream's connection task and the server's take turns on one event loop.
#[tokio::test]
async fn a_stream_read_at_once_is_one_frame_when_served() {
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
                let body = answer_of(&up, &up_url).await.body.inspect(move |_| {
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
    assert_gets_the_events(addr).await;
    assert_eq!(frames.load(Ordering::SeqCst), 1);
    stop.cancel();
}

/// A translated answer whose upstream end (its `[DONE]`, then the end of the body) was read
/// with it: once the client has the last frame, the body's end is ready too, so a server
/// writes them together and the drain arms no timer.
#[tokio::test]
async fn a_translated_answer_ends_with_its_last_frame() {
    let url = upstream_writing(&CHAT).await;
    let resp = reqwest::Client::new()
        .post(url)
        .body("{}")
        .send()
        .await
        .unwrap();
    let mut body = LlmBody::translated(
        agentbox_llm::body::upstream_stream(resp),
        Box::new(ChatToAnthropic::new(ResponseOptions::default())),
    );
    let mut got = Vec::new();
    while !String::from_utf8_lossy(&got).contains("message_stop") {
        let frame = body
            .next()
            .await
            .expect("the body ended before message_stop");
        got.extend_from_slice(&frame.unwrap());
    }
    assert!(
        matches!(
            futures_util::poll!(body.next()),
            std::task::Poll::Ready(None)
        ),
        "the end was not ready with the last frame"
    );
}

/// A server connection's IO that counts the writes hyper makes.
struct CountingIo {
    inner: tokio::net::TcpStream,
    writes: Arc<AtomicUsize>,
}

impl tokio::io::AsyncRead for CountingIo {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for CountingIo {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.writes.fetch_add(1, Ordering::SeqCst);
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// An upstream's burst served as the daemons serve an [`Answer`]: hyper writes the head, the
/// events and the end of the body once, not the head on its own first.
#[tokio::test]
async fn an_answer_read_at_once_is_served_in_one_write() {
    let up_url = upstream_in_one_write().await;
    let up = Arc::new(Upstream::new(&ClientOptions::default()).unwrap());
    let server = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = server.local_addr().unwrap();
    let writes = Arc::new(AtomicUsize::new(0));
    let counted = writes.clone();
    tokio::spawn(async move {
        let (tcp, _) = server.accept().await.unwrap();
        let io = CountingIo {
            inner: tcp,
            writes: counted,
        };
        let service = hyper::service::service_fn(move |_req| {
            let up = up.clone();
            let up_url = up_url.clone();
            async move {
                Ok::<_, std::convert::Infallible>(
                    answer_of(&up, &up_url).await.into_response().await,
                )
            }
        });
        let _ = hyper::server::conn::http1::Builder::new()
            .serve_connection(hyper_util::rt::TokioIo::new(io), service)
            .await;
    });
    assert_gets_the_events(addr).await;
    assert_eq!(
        writes.load(Ordering::SeqCst),
        1,
        "head and body in one write"
    );
}
