//! `relay`: the floors under the bridge in `bench bridge`. A proxy in front of one upstream
//! that forwards every request unchanged, so the bench can show what a proxy costs before it
//! does anything of its own:
//! - `relay tcp HOST:PORT`: bytes copied between the two sockets, no HTTP at all (what one
//!   extra loopback hop costs: the kernel's copies and the wake-ups);
//! - `relay http HOST:PORT`: the bridge's stack with nothing on top: hyper (through
//!   `agentbox_http::serve_tcp`) reads the whole body, the bridge's reqwest client settings
//!   forward it with four headers, the answer streams back; no parse, no translation.
//!
//! One event loop, as the bridge's default. Prints `listening on <addr>` once bound.

#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use futures_util::TryStreamExt;
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

/// The headers the bench's requests carry that an LLM upstream reads.
const FORWARDED: [&str; 4] = [
    "content-type",
    "authorization",
    "x-api-key",
    "anthropic-version",
];

struct Http {
    client: reqwest::Client,
    base: String,
}

async fn forward(State(s): State<Arc<Http>>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, 64 << 20).await {
        Ok(b) => b,
        Err(e) => return (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
    };
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut out = s
        .client
        .request(parts.method, format!("{}{path}", s.base))
        .body(body);
    for name in FORWARDED {
        if let Some(v) = parts.headers.get(name) {
            out = out.header(name, v);
        }
    }
    match out.send().await {
        Ok(resp) => {
            let mut answer = Response::builder().status(resp.status());
            if let Some(ct) = resp.headers().get(header::CONTENT_TYPE) {
                answer = answer.header(header::CONTENT_TYPE, ct);
            }
            answer
                .body(Body::from_stream(
                    resp.bytes_stream().map_err(std::io::Error::other),
                ))
                .unwrap_or_else(|e| (StatusCode::BAD_GATEWAY, e.to_string()).into_response())
        }
        Err(e) => (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    }
}

async fn relay_tcp(listener: TcpListener, upstream: String) -> Result<()> {
    loop {
        let (mut inbound, _) = listener.accept().await?;
        inbound.set_nodelay(true)?;
        let upstream = upstream.clone();
        tokio::spawn(async move {
            let Ok(mut outbound) = TcpStream::connect(&upstream).await else {
                return;
            };
            if outbound.set_nodelay(true).is_err() {
                return;
            }
            let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
        });
    }
}

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (Some(mode), Some(upstream)) = (args.next(), args.next()) else {
        bail!("usage: relay tcp|http HOST:PORT");
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        println!("listening on {}", listener.local_addr()?);
        match mode.as_str() {
            "tcp" => relay_tcp(listener, upstream).await,
            "http" => {
                // As `agentbox_llm::Upstream` builds the bridge's client.
                let client = reqwest::Client::builder()
                    .connect_timeout(Duration::from_secs(10))
                    .tcp_nodelay(true)
                    .redirect(reqwest::redirect::Policy::none())
                    .build()
                    .context("client")?;
                let state = Arc::new(Http {
                    client,
                    base: format!("http://{upstream}"),
                });
                let app = axum::Router::new().fallback(forward).with_state(state);
                agentbox_http::serve_tcp(listener, app, CancellationToken::new()).await;
                Ok(())
            }
            other => bail!("unknown mode {other:?}: tcp or http"),
        }
    })
}
