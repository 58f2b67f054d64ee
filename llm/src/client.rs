//! The one upstream HTTP client and what every call shares: sending with the engine's error
//! mapping, and capped reads of bodies (an upstream error body at 64 KiB, a non-streamed
//! answer at 64 MiB), so a hostile or broken upstream cannot balloon a daemon's memory.
//!
//! A client may reach its upstream over a unix socket instead of TCP
//! ([`ClientOptions::unix_socket`]): every request of that client then goes to the socket,
//! whatever host its URL names (the URL's path and query are sent as for TCP).
//!
//! Redirects are never followed: a redirect would re-send the request, its prompt and its
//! credentials (`x-api-key`, the bridge token) to whatever host the upstream names. A 3xx is
//! an upstream error like any other non-2xx (502 to the client, see `error.rs`).

use std::collections::VecDeque;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use agentbox_policy::sanitize::raw::{Pieces, Span};
use agentbox_policy::secret::Secret;
use axum::http::header;
use bytes::Bytes;

use crate::error::LlmError;

/// The most of an upstream error body that is read: error bodies are small, and the message
/// the client sees is cut far below this.
pub const MAX_ERROR_BODY: usize = 64 << 10;

/// The most of a non-streamed answer that is read (an answer is the model's output: far below
/// this).
pub const MAX_ANSWER_BODY: usize = 64 << 20;

/// Timeouts and socket options of the upstream client.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// Connecting (TCP and TLS).
    pub connect_timeout: Duration,
    /// Silence between two reads: generations can be slow, but an upstream silent this long is
    /// gone.
    pub read_timeout: Duration,
    /// How long an idle pooled connection is kept.
    pub pool_idle_timeout: Duration,
    /// `TCP_NODELAY`: stream frames go out as they are written.
    pub tcp_nodelay: bool,
    /// Every connection goes to this unix socket (HTTP over it; the URL's host is ignored).
    pub unix_socket: Option<PathBuf>,
}

impl Default for ClientOptions {
    /// What the gateway and the bridge use.
    fn default() -> Self {
        ClientOptions {
            connect_timeout: Duration::from_secs(10),
            read_timeout: Duration::from_secs(600),
            pool_idle_timeout: Duration::from_secs(60),
            tcp_nodelay: true,
            unix_socket: None,
        }
    }
}

/// The upstream client could not be built (TLS backend failure).
#[derive(Debug, thiserror::Error)]
#[error("cannot build the upstream HTTP client: {0}")]
pub struct ClientError(String);

/// How a call authenticates upstream.
#[derive(Debug, Clone, Copy)]
pub enum Auth<'a> {
    /// Nothing (local backends).
    None,
    /// `x-api-key: <key>` (Anthropic).
    ApiKey(&'a Secret),
    /// `authorization: Bearer <token>` (OpenAI, the bridge).
    Bearer(&'a Secret),
}

impl Auth<'_> {
    pub(crate) fn apply(self, req: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match self {
            Auth::None => req,
            Auth::ApiKey(k) => req.header("x-api-key", k.expose()),
            Auth::Bearer(t) => req.bearer_auth(t.expose()),
        }
    }
}

/// The engine: one pooled upstream client. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Upstream {
    client: reqwest::Client,
}

impl Upstream {
    /// Builds the client.
    pub fn new(opts: &ClientOptions) -> Result<Self, ClientError> {
        let mut builder = reqwest::Client::builder()
            .connect_timeout(opts.connect_timeout)
            .read_timeout(opts.read_timeout)
            .pool_idle_timeout(opts.pool_idle_timeout)
            .tcp_nodelay(opts.tcp_nodelay)
            .redirect(reqwest::redirect::Policy::none());
        if let Some(path) = &opts.unix_socket {
            builder = builder.unix_socket(path.as_path());
        }
        let client = builder
            .build()
            .map_err(|e| ClientError(agentbox_http::error_chain(&e)))?;
        Ok(Upstream { client })
    }

    /// The client, for calls that are not model calls (the bridge's `/check` probe).
    pub fn client(&self) -> &reqwest::Client {
        &self.client
    }

    /// POSTs a JSON body (a buffer, or [`Parts`]); a non-2xx answer becomes
    /// [`LlmError::Upstream`] from its capped body.
    pub(crate) async fn post_json(
        &self,
        url: &reqwest::Url,
        auth: Auth<'_>,
        headers: &[(&str, &str)],
        body: impl Into<reqwest::Body>,
    ) -> Result<reqwest::Response, LlmError> {
        let mut req = self
            .client
            // A URL parsed once by the caller: parsing it again here was 4 % of the bridge's
            // CPU for a translated request.
            .post(url.clone())
            .header(header::CONTENT_TYPE, "application/json");
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = auth
            .apply(req)
            .body(body)
            .send()
            .await
            .map_err(|e| LlmError::from_transport(&e))?;
        if resp.status().is_success() {
            Ok(resp)
        } else {
            Err(error_from_response(resp).await)
        }
    }
}

/// An upstream URL parsed once, for a target to reuse: a daemon parses its configured
/// endpoints at start, not per request. What reqwest says of a URL it cannot use, as the
/// transport error it would otherwise be at send time.
pub fn upstream_url(url: &str) -> Result<reqwest::Url, LlmError> {
    reqwest::Url::parse(url)
        .map_err(|e| LlmError::Unreachable(format!("invalid upstream URL: {e}")))
}

/// An upstream's error response in the client's terms, reading at most [`MAX_ERROR_BODY`].
pub async fn error_from_response(resp: reqwest::Response) -> LlmError {
    let status = resp.status();
    let retry_after = resp.headers().get(header::RETRY_AFTER).cloned();
    let said_ran = resp.headers().contains_key(crate::error::RAN_HEADER);
    // A body that breaks while being read is mapped from what arrived (often nothing).
    let body = read_capped(resp, MAX_ERROR_BODY).await.unwrap_or_default();
    let mut e = LlmError::from_upstream(status, retry_after, &body);
    if let LlmError::Upstream { ran, .. } = &mut e {
        *ran = said_ran;
    }
    e
}

/// Reads a body up to `cap` bytes; the rest is never read (dropping the response closes the
/// connection).
pub async fn read_capped(
    mut resp: reqwest::Response,
    cap: usize,
) -> Result<Vec<u8>, reqwest::Error> {
    let mut out = Vec::new();
    while let Some(chunk) = resp.chunk().await? {
        let room = cap.saturating_sub(out.len());
        out.extend_from_slice(&chunk[..chunk.len().min(room)]);
        if out.len() >= cap {
            break;
        }
    }
    Ok(out)
}

/// A request body sent as the pieces it is made of (a sanitized body: spans of the client's
/// body and what was written anew), with its exact length: it goes out with the
/// `content-length` one buffer of those bytes would have, and the same bytes, without being
/// copied into one.
#[derive(Debug, Default)]
pub struct Parts {
    parts: VecDeque<Bytes>,
    len: u64,
}

/// How short a request body piece is to be copied together with its short neighbours rather
/// than sent as a buffer of its own. hyper's client queues at most 16 buffers for one `writev`
/// and writes the rest with another: Claude Code's request, sanitized, is the head and 17
/// pieces (its large members between keys, commas and short values), so its last piece, a
/// `}`, went out in a second `writev` of one byte. Copying the short ones costs a few hundred
/// bytes a request; the large members are still sent uncopied.
pub const SMALL_PIECE: usize = 4096;

/// Appends the short pieces of `run` to `parts` as one buffer (a lone piece as it is).
fn flush_run(run: &mut Vec<Bytes>, parts: &mut Vec<Bytes>) {
    match run.len() {
        0 => {}
        1 => parts.extend(run.pop()),
        _ => parts.push(Bytes::from(run.concat())),
    }
    run.clear();
}

impl Parts {
    /// The body made of `parts`, in order.
    pub fn new(parts: impl IntoIterator<Item = Bytes>) -> Self {
        let parts: VecDeque<Bytes> = parts.into_iter().filter(|p| !p.is_empty()).collect();
        let len = parts.iter().map(|p| p.len() as u64).sum();
        Parts { parts, len }
    }

    /// The sanitizer's [`Pieces`], cut from `client` (the client's body they were made from)
    /// and from what the sanitizer wrote. A span outside either (which the sanitizer never
    /// makes) is refused rather than sent. Pieces shorter than [`SMALL_PIECE`] next to each
    /// other are copied into one buffer.
    pub fn from_pieces(client: &Bytes, pieces: Pieces) -> Result<Self, LlmError> {
        let (written, spans) = pieces.into_parts();
        let written = Bytes::from(written);
        let cut = |from: &Bytes, r: &std::ops::Range<usize>| {
            (r.start <= r.end && r.end <= from.len())
                .then(|| from.slice(r.clone()))
                .ok_or_else(|| LlmError::InvalidRequest("a body piece out of range".into()))
        };
        let mut parts = Vec::with_capacity(spans.len());
        let mut run: Vec<Bytes> = Vec::new();
        for s in &spans {
            let piece = match s {
                Span::Body(r) => cut(client, r),
                Span::Written(r) => cut(&written, r),
            }?;
            if piece.len() < SMALL_PIECE {
                run.push(piece);
            } else {
                flush_run(&mut run, &mut parts);
                parts.push(piece);
            }
        }
        flush_run(&mut run, &mut parts);
        Ok(Self::new(parts))
    }

    /// The body's length.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether it is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl http_body::Body for Parts {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        let next = self.parts.pop_front();
        if let Some(part) = &next {
            self.len -= part.len() as u64;
        }
        Poll::Ready(next.map(|part| Ok(http_body::Frame::data(part))))
    }

    fn is_end_stream(&self) -> bool {
        self.parts.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.len)
    }
}

impl From<Parts> for reqwest::Body {
    fn from(parts: Parts) -> Self {
        reqwest::Body::wrap(parts)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use agentbox_policy::sanitize::raw;

    use super::*;

    /// A body whose members are mostly short goes out as few buffers: the short pieces between
    /// large members are joined, the large members are slices of the client's body.
    #[test]
    fn short_pieces_are_joined_and_large_ones_lent() {
        let big = "x".repeat(SMALL_PIECE);
        let body = format!(
            r#"{{"model":"a","max_tokens":5,"stream":true,"system":"{big}","a":1,"b":2,"c":3,"d":4,"e":5,"f":6,"g":7,"h":8,"i":9,"j":10,"k":11,"l":12,"m":13,"n":14,"o":15,"p":16,"q":17,"messages":[{{"role":"user","content":"{big}"}}],"temperature":1}}"#
        );
        let client = Bytes::from(body);
        let opts = raw::Options {
            model: "up",
            allow_url_sources: false,
            max_tokens_cap: None,
            strip_metadata_user_id: false,
            estimate: None,
        };
        let pieces = raw::sanitize_to_pieces(&client, &opts).unwrap().body;
        let want = pieces.to_vec(&client);
        assert!(pieces.spans().len() > 16, "{pieces:?}");
        let mut parts = Parts::from_pieces(&client, pieces).unwrap();
        assert_eq!(parts.len(), want.len() as u64);
        let got: Vec<Bytes> = parts.parts.drain(..).collect();
        assert_eq!(got.concat(), want);
        // Short, system, short, messages, short.
        assert_eq!(
            got.len(),
            5,
            "{:?}",
            got.iter().map(Bytes::len).collect::<Vec<_>>()
        );
        let lent = |p: &Bytes| {
            let at = p.as_ptr().addr();
            at >= client.as_ptr().addr() && at < client.as_ptr().addr() + client.len()
        };
        assert!(
            lent(&got[1]) && lent(&got[3]),
            "large members are not copied"
        );
    }
}
