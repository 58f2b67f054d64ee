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

use std::path::PathBuf;
use std::time::Duration;

use agentbox_policy::secret::Secret;
use axum::http::header;

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

    /// POSTs a JSON body; a non-2xx answer becomes [`LlmError::Upstream`] from its capped body.
    pub(crate) async fn post_json(
        &self,
        url: &str,
        auth: Auth<'_>,
        headers: &[(&str, &str)],
        body: Vec<u8>,
    ) -> Result<reqwest::Response, LlmError> {
        let mut req = self
            .client
            .post(url)
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

/// An upstream's error response in the client's terms, reading at most [`MAX_ERROR_BODY`].
pub async fn error_from_response(resp: reqwest::Response) -> LlmError {
    let status = resp.status();
    let retry_after = resp.headers().get(header::RETRY_AFTER).cloned();
    // A body that breaks while being read is mapped from what arrived (often nothing).
    let body = read_capped(resp, MAX_ERROR_BODY).await.unwrap_or_default();
    LlmError::from_upstream(status, retry_after, &body)
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
