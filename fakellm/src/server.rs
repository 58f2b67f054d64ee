//! The fakellm HTTP server: routing, request validation with the real APIs' error shapes,
//! logging, and turning a dispatched script entry into a response with its faults.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{HeaderName, HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use axum::serve::ListenerExt;
use serde_json::{Value, json};

use super::FakeLlmError;
use super::log::{LogRecord, RequestLog, header_map, now_ms, now_us};
use super::render::{self, ReplyMeta};
use super::script::{Api, Dispatcher, Entry, RequestView, Script, Source};

/// Request bodies above this are refused with 413, like the real APIs' 32 MB limit.
const MAX_BODY: usize = 32 * 1024 * 1024;

/// Where to listen.
#[derive(Debug, Clone)]
pub enum Listen {
    /// A TCP address; port 0 picks a free port.
    Tcp(SocketAddr),
    /// A unix socket path (must not exist yet).
    Unix(PathBuf),
}

#[derive(Debug)]
enum Bound {
    Tcp(tokio::net::TcpListener),
    Unix(tokio::net::UnixListener),
}

/// A bound, not yet serving fakellm.
#[derive(Debug)]
pub struct Server {
    bound: Bound,
    address: String,
    state: Arc<AppState>,
}

impl Server {
    /// Validates `script`, opens the log and binds the listener.
    ///
    /// # Errors
    /// When the script is invalid, the log cannot be opened or the address cannot be bound.
    pub async fn bind(script: Script, log: &Path, listen: &Listen) -> Result<Self, FakeLlmError> {
        validate(&script)?;
        let disconnects = Arc::new(disconnect_log_path(log));
        let log = RequestLog::open(log)?;
        let (bound, address) = match listen {
            Listen::Tcp(addr) => {
                let l = tokio::net::TcpListener::bind(addr)
                    .await
                    .map_err(|source| FakeLlmError::Bind {
                        what: addr.to_string(),
                        source,
                    })?;
                let local = l.local_addr().map_err(|source| FakeLlmError::Bind {
                    what: addr.to_string(),
                    source,
                })?;
                (Bound::Tcp(l), local.to_string())
            }
            Listen::Unix(path) => {
                let l =
                    tokio::net::UnixListener::bind(path).map_err(|source| FakeLlmError::Bind {
                        what: path.display().to_string(),
                        source,
                    })?;
                (Bound::Unix(l), format!("unix:{}", path.display()))
            }
        };
        let models = script
            .models
            .clone()
            .unwrap_or_else(|| vec!["fakellm".to_owned()]);
        let state = Arc::new(AppState {
            count_tokens: script.count_tokens,
            models,
            api_key: script.api_key.clone(),
            disconnects,
            dispatcher: Mutex::new(Dispatcher::new(script)),
            log,
            seq: AtomicU64::new(0),
        });
        Ok(Self {
            bound,
            address,
            state,
        })
    }

    /// `127.0.0.1:PORT` for TCP, `unix:PATH` for a unix socket.
    #[must_use]
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Serves until the process ends.
    ///
    /// # Errors
    /// When the accept loop fails.
    pub async fn serve(self) -> Result<(), FakeLlmError> {
        let app = Router::new().fallback(handle).with_state(self.state);
        let result = match self.bound {
            Bound::Tcp(l) => {
                // Without NODELAY, small SSE frames wait for delayed ACKs and streaming tests
                // measure Nagle instead of the code under test.
                let l = l.tap_io(|s| {
                    if let Err(e) = s.set_nodelay(true) {
                        eprintln!("fakellm: set_nodelay: {e}");
                    }
                });
                axum::serve(l, app).await
            }
            Bound::Unix(l) => axum::serve(l, app).await,
        };
        result.map_err(FakeLlmError::Serve)
    }
}

fn validate(script: &Script) -> Result<(), FakeLlmError> {
    let all = script
        .steps
        .iter()
        .enumerate()
        .map(|(i, e)| (format!("steps[{i}]"), e))
        .chain(
            script
                .rules
                .iter()
                .enumerate()
                .map(|(i, e)| (format!("rules[{i}]"), e)),
        )
        .chain(script.fallback.iter().map(|e| ("fallback".to_owned(), e)));
    for (at, entry) in all {
        for (name, value) in &entry.headers {
            if HeaderName::try_from(name.as_str()).is_err()
                || HeaderValue::try_from(value.as_str()).is_err()
            {
                return Err(FakeLlmError::InvalidScript(format!(
                    "{at}: invalid header {name:?}: {value:?}"
                )));
            }
        }
        if let Some(err) = &entry.error
            && StatusCode::from_u16(err.status).is_err()
        {
            return Err(FakeLlmError::InvalidScript(format!(
                "{at}: invalid status {}",
                err.status
            )));
        }
    }
    Ok(())
}

#[derive(Debug)]
struct AppState {
    dispatcher: Mutex<Dispatcher>,
    log: RequestLog,
    seq: AtomicU64,
    count_tokens: Option<u64>,
    models: Vec<String>,
    api_key: Option<String>,
    /// Where client disconnects mid-response are recorded.
    disconnects: Arc<PathBuf>,
}

/// The error shape a path calls for: OpenAI-style paths get `{"error":{…}}`, the rest the
/// Anthropic envelope.
fn api_of_path(path: &str) -> Api {
    const OPENAI: [&str; 7] = [
        "/v1/chat",
        "/chat",
        "/v1/completions",
        "/completions",
        "/v1/responses",
        "/responses",
        "/v1/embeddings",
    ];
    if OPENAI.iter().any(|p| {
        path.strip_prefix(p)
            .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
    }) {
        Api::Openai
    } else {
        Api::Anthropic
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Messages,
    CountTokens,
    Chat,
    Models,
    Health,
    Pause,
    Resume,
}

fn route(path: &str) -> Option<(Route, Method)> {
    match path {
        "/v1/rollout/pause" | "/rollout/pause" => Some((Route::Pause, Method::POST)),
        "/v1/rollout/resume" | "/rollout/resume" => Some((Route::Resume, Method::POST)),
        "/v1/messages" => Some((Route::Messages, Method::POST)),
        "/v1/messages/count_tokens" => Some((Route::CountTokens, Method::POST)),
        "/v1/chat/completions" | "/chat/completions" => Some((Route::Chat, Method::POST)),
        "/v1/models" | "/models" => Some((Route::Models, Method::GET)),
        "/health" => Some((Route::Health, Method::GET)),
        _ => None,
    }
}

/// What the server decided to do with a request.
enum Plan {
    Error {
        status: StatusCode,
        body: Value,
    },
    CountTokens(u64),
    Models,
    Health,
    /// A router control call (pause, resume): answered with this body.
    Control(Value),
    Reply {
        api: Api,
        source: Source,
        entry: Option<Box<Entry>>,
        stream: bool,
        include_usage: bool,
        request_model: String,
        request_bytes: usize,
    },
}

impl Plan {
    fn served_by(&self) -> String {
        match self {
            Self::Error { .. } => "error".to_owned(),
            Self::CountTokens(_) => "count_tokens".to_owned(),
            Self::Models => "models".to_owned(),
            Self::Health => "health".to_owned(),
            Self::Control(_) => "control".to_owned(),
            Self::Reply { source, .. } => source.to_string(),
        }
    }
}

fn error_plan(api: Api, status: StatusCode, kind: Option<&str>, message: &str) -> Plan {
    Plan::Error {
        status,
        body: error_body(api, status, kind, message, None),
    }
}

/// An error body in `api`'s shape; `kind` defaults to what the API uses for `status`.
fn error_body(
    api: Api,
    status: StatusCode,
    kind: Option<&str>,
    message: &str,
    param: Option<&str>,
) -> Value {
    match api {
        Api::Anthropic => render::anthropic_error_body(
            kind.unwrap_or_else(|| render::anthropic_error_type(status.as_u16())),
            message,
        ),
        Api::Openai => render::openai_error_body(
            kind.unwrap_or_else(|| render::openai_error_type(status.as_u16())),
            message,
            param,
        ),
    }
}

/// The first required field missing from `body`, or a type error, as the API would word it.
fn missing_field(
    api: Api,
    body: &Value,
    required: &[&'static str],
) -> Option<(String, &'static str)> {
    for &field in required {
        match body.get(field) {
            None | Some(Value::Null) => {
                let msg = match api {
                    Api::Anthropic => format!("{field}: Field required"),
                    Api::Openai => format!("Missing required parameter: '{field}'."),
                };
                return Some((msg, field));
            }
            Some(v) => {
                let ok = match field {
                    "messages" => v.is_array(),
                    "max_tokens" => v.is_u64(),
                    "model" => v.is_string(),
                    _ => true,
                };
                if !ok {
                    let msg = match api {
                        Api::Anthropic => format!("{field}: Input has the wrong type"),
                        Api::Openai => format!("Invalid type for '{field}'."),
                    };
                    return Some((msg, field));
                }
            }
        }
    }
    None
}

impl AppState {
    fn plan(
        &self,
        method: &Method,
        path: &str,
        headers: &axum::http::HeaderMap,
        parsed: Option<&Value>,
        raw: &str,
    ) -> Plan {
        let shape = api_of_path(path);
        let Some((route, want)) = route(path) else {
            return error_plan(
                shape,
                StatusCode::NOT_FOUND,
                None,
                &format!("fakellm: no route for {method} {path}"),
            );
        };
        if method != want {
            return error_plan(
                shape,
                StatusCode::METHOD_NOT_ALLOWED,
                Some("invalid_request_error"),
                &format!("fakellm: method {method} not allowed on {path}; use {want}"),
            );
        }
        // Like vLLM's, the health check needs no key: supervisors probe it without one.
        if route == Route::Health {
            return Plan::Health;
        }
        if let Some(key) = &self.api_key
            && !presents_key(headers, key)
        {
            return error_plan(
                shape,
                StatusCode::UNAUTHORIZED,
                Some("authentication_error"),
                "fakellm: invalid x-api-key or bearer token",
            );
        }
        if route == Route::Models {
            return Plan::Models;
        }
        match route {
            Route::Pause => return Plan::Control(json!({"quiesced": true})),
            Route::Resume => return Plan::Control(json!({})),
            Route::Messages | Route::CountTokens | Route::Chat | Route::Models | Route::Health => {}
        }
        let api = if route == Route::Chat {
            Api::Openai
        } else {
            Api::Anthropic
        };
        let Some(body) = parsed.filter(|v| v.is_object()) else {
            return error_plan(
                api,
                StatusCode::BAD_REQUEST,
                Some("invalid_request_error"),
                "fakellm: the request body is not a valid JSON object",
            );
        };
        let required: &[&'static str] = match route {
            Route::Messages => &["model", "messages", "max_tokens"],
            Route::CountTokens
            | Route::Chat
            | Route::Models
            | Route::Health
            | Route::Pause
            | Route::Resume => &["model", "messages"],
        };
        if let Some((msg, field)) = missing_field(api, body, required) {
            let status = StatusCode::BAD_REQUEST;
            let kind = Some("invalid_request_error");
            return Plan::Error {
                status,
                body: error_body(api, status, kind, &msg, Some(field)),
            };
        }
        if route == Route::CountTokens {
            return Plan::CountTokens(
                self.count_tokens
                    .unwrap_or_else(|| render::estimate_tokens(raw.len())),
            );
        }
        let view = RequestView { api, body, raw };
        let (source, entry) = match self.dispatcher.lock() {
            Ok(mut d) => d.dispatch(&view),
            Err(poisoned) => poisoned.into_inner().dispatch(&view),
        };
        Plan::Reply {
            api,
            source,
            entry: entry.map(Box::new),
            stream: view.stream(),
            include_usage: body
                .pointer("/stream_options/include_usage")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            request_model: body
                .get("model")
                .and_then(Value::as_str)
                .unwrap_or("")
                .to_owned(),
            request_bytes: raw.len(),
        }
    }

    fn models_body(&self) -> Value {
        let data: Vec<Value> = self
            .models
            .iter()
            .map(|id| {
                json!({
                    "id": id, "object": "model", "created": 0, "owned_by": "fakellm",
                    "type": "model", "display_name": id, "created_at": "1970-01-01T00:00:00Z",
                })
            })
            .collect();
        json!({
            "object": "list",
            "data": data,
            "has_more": false,
            "first_id": self.models.first(),
            "last_id": self.models.last(),
        })
    }
}

fn presents_key(headers: &axum::http::HeaderMap, key: &str) -> bool {
    let bearer = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "));
    let api_key = headers.get("x-api-key").and_then(|v| v.to_str().ok());
    bearer == Some(key) || api_key == Some(key)
}

async fn handle(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let seq = st.seq.fetch_add(1, Ordering::SeqCst) + 1;
    let (parts, body) = req.into_parts();
    let path = parts
        .uri
        .path_and_query()
        .map_or_else(|| parts.uri.path().to_owned(), |pq| pq.as_str().to_owned());
    let (logged_body, plan) = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(bytes) => {
            let raw = String::from_utf8_lossy(&bytes).into_owned();
            let parsed: Option<Value> = serde_json::from_slice(&bytes).ok();
            let plan = st.plan(
                &parts.method,
                parts.uri.path(),
                &parts.headers,
                parsed.as_ref(),
                &raw,
            );
            let logged = match parsed {
                Some(v) => v,
                None if raw.is_empty() => Value::Null,
                None => Value::String(raw),
            };
            (logged, plan)
        }
        Err(e) => (
            Value::Null,
            error_plan(
                api_of_path(parts.uri.path()),
                StatusCode::PAYLOAD_TOO_LARGE,
                Some("request_too_large"),
                &format!("fakellm: cannot read the request body: {e}"),
            ),
        ),
    };
    let ts_us = now_us();
    st.log.append(&LogRecord {
        seq,
        ts: ts_us / 1000,
        ts_us,
        method: parts.method.as_str(),
        path: &path,
        headers: header_map(&parts.headers),
        body: logged_body,
        served_by: plan.served_by(),
    });
    respond(&st, seq, plan).await
}

fn json_response(status: StatusCode, seq: u64, body: &Value) -> Response {
    let mut resp = Response::new(Body::from(body.to_string()));
    *resp.status_mut() = status;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    add_request_id(h, seq);
    resp
}

/// A 200 whose JSON body is sent as `body` produces it.
fn json_body_response(body: Body, seq: u64) -> Response {
    let mut resp = Response::new(body);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    add_request_id(resp.headers_mut(), seq);
    resp
}

fn add_request_id(h: &mut axum::http::HeaderMap, seq: u64) {
    if let Ok(v) = HeaderValue::try_from(format!("req_fakellm_{seq:06}")) {
        h.insert("request-id", v.clone());
        h.insert("x-request-id", v);
    }
}

async fn respond(st: &AppState, seq: u64, plan: Plan) -> Response {
    match plan {
        Plan::Error { status, body } => json_response(status, seq, &body),
        Plan::CountTokens(n) => json_response(StatusCode::OK, seq, &json!({"input_tokens": n})),
        Plan::Models => json_response(StatusCode::OK, seq, &st.models_body()),
        Plan::Health => json_response(StatusCode::OK, seq, &json!({"status": "ok"})),
        Plan::Control(body) => json_response(StatusCode::OK, seq, &body),
        Plan::Reply {
            api,
            source,
            entry,
            stream,
            include_usage,
            request_model,
            request_bytes,
        } => {
            let Some(entry) = entry else {
                return exhausted(api, seq, &source);
            };
            let notice = DropNotice::new(st.disconnects.clone(), seq);
            scripted(
                api,
                notice,
                &entry,
                stream,
                include_usage,
                request_model,
                request_bytes,
            )
            .await
        }
    }
}

fn exhausted(api: Api, seq: u64, source: &Source) -> Response {
    let detail = match source {
        Source::Exhausted {
            consumed,
            pending_mismatch: true,
        } => format!("step {consumed} did not match it"),
        Source::Exhausted { consumed, .. } => format!("all {consumed} steps are used"),
        Source::Rule(_) | Source::Step(_) | Source::Fallback => String::new(),
    };
    let msg = format!(
        "fakellm: script exhausted at request #{seq}: {detail}, no rule matched and there is no fallback"
    );
    let status = StatusCode::INTERNAL_SERVER_ERROR;
    let body = error_body(api, status, None, &msg, None);
    let mut resp = json_response(status, seq, &body);
    // Real clients retry 5xx for minutes; this error means the test is wrong, so say it once.
    resp.headers_mut()
        .insert("x-should-retry", HeaderValue::from_static("false"));
    resp
}

async fn scripted(
    api: Api,
    notice: DropNotice,
    entry: &Entry,
    stream: bool,
    include_usage: bool,
    request_model: String,
    request_bytes: usize,
) -> Response {
    let seq = notice.seq;
    // A huge text is rendered as one mark and expanded as the body goes out.
    let huge;
    let entry = match entry.huge_text_bytes {
        Some(_) => {
            huge = Entry {
                text: Some(HUGE_MARK.to_string()),
                ..entry.clone()
            };
            &huge
        }
        None => entry,
    };
    if entry.delay_ms > 0 {
        tokio::time::sleep(Duration::from_millis(entry.delay_ms)).await;
    }
    let mut resp = if let Some(err) = &entry.error {
        let status = StatusCode::from_u16(err.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = err.body.clone().unwrap_or_else(|| {
            let message = err
                .message
                .clone()
                .unwrap_or_else(|| format!("fakellm: scripted error {}", err.status));
            error_body(api, status, err.kind.as_deref(), &message, None)
        });
        if stream && entry.heartbeats > 0 {
            late_error_response(seq, notice, entry, status, body)
        } else {
            json_response(status, seq, &body)
        }
    } else {
        let (prefix, tool_prefix) = match api {
            Api::Anthropic => ("msg_fakellm_", "toolu_fakellm_"),
            Api::Openai => ("chatcmpl-fakellm-", "call_fakellm_"),
        };
        let meta = ReplyMeta {
            id: format!("{prefix}{seq:06}"),
            model: entry.model.clone().unwrap_or(request_model),
            tool_ids: entry
                .tool_calls
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    c.id.clone()
                        .unwrap_or_else(|| format!("{tool_prefix}{seq:06}_{i}"))
                })
                .collect(),
            usage: entry
                .usage
                .unwrap_or_else(|| render::estimate_usage(entry, request_bytes)),
            created: now_ms() / 1000,
        };
        if stream {
            stream_response(api, seq, notice, entry, &meta, include_usage)
        } else {
            let body = match api {
                Api::Anthropic => render::anthropic_message(entry, &meta),
                Api::Openai => render::openai_completion(entry, &meta),
            };
            match entry.disconnect_after_events {
                Some(_) => {
                    let text = body.to_string();
                    let half = Bytes::from(text.into_bytes());
                    let cut = half.len() / 2;
                    json_body_response(
                        frames_body(vec![half.slice(..cut)], Duration::ZERO, true, notice),
                        seq,
                    )
                }
                None => match entry.huge_text_bytes {
                    Some(bytes) => {
                        let frames = vec![Bytes::from(body.to_string())];
                        let (total, frames) = expand_huge(frames, bytes, false);
                        json_body_response(
                            frames_body_iter(total, frames, Duration::ZERO, false, notice),
                            seq,
                        )
                    }
                    None => json_response(StatusCode::OK, seq, &body),
                },
            }
        }
    };
    for (name, value) in &entry.headers {
        if let (Ok(n), Ok(v)) = (
            HeaderName::try_from(name.as_str()),
            HeaderValue::try_from(value.as_str()),
        ) {
            resp.headers_mut().insert(n, v);
        }
    }
    resp
}

fn stream_response(
    api: Api,
    seq: u64,
    notice: DropNotice,
    entry: &Entry,
    meta: &ReplyMeta,
    include_usage: bool,
) -> Response {
    let mut frames = match api {
        Api::Anthropic => render::anthropic_events(entry, meta),
        Api::Openai => render::openai_chunks(entry, meta, include_usage),
    };
    if let Some(ev) = &entry.error_event {
        frames.truncate(ev.after_events);
        let kind = ev.kind.as_deref().unwrap_or("overloaded_error");
        let message = ev
            .message
            .as_deref()
            .unwrap_or("fakellm: scripted stream error");
        frames.push(match api {
            Api::Anthropic => render::anthropic_error_event(kind, message),
            Api::Openai => render::openai_error_event(kind, message),
        });
    }
    if let Some(n) = entry.garbage_after_events {
        frames.truncate(n);
        frames.push(Bytes::from_static(b"data: fakellm-garbage{\n\n"));
    }
    let abort = match entry.disconnect_after_events {
        Some(n) => {
            frames.truncate(n);
            true
        }
        None => false,
    };
    frames.splice(0..0, heartbeat_frames(entry.heartbeats));
    event_stream(seq, notice, entry, frames, abort)
}

fn heartbeat_frames(n: usize) -> Vec<Bytes> {
    vec![Bytes::from_static(b": dressage-heartbeat\n\n"); n]
}

/// A failure reported after the 200 was committed: heartbeats, then the error (with its status
/// inside) as the first real frame, then `[DONE]`.
fn late_error_response(
    seq: u64,
    notice: DropNotice,
    entry: &Entry,
    status: StatusCode,
    body: Value,
) -> Response {
    let mut error = match body.get("error") {
        Some(Value::Object(e)) => e.clone(),
        Some(_) | None => body.as_object().cloned().unwrap_or_default(),
    };
    error.insert("status_code".into(), json!(status.as_u16()));
    let mut frames = heartbeat_frames(entry.heartbeats);
    frames.push(Bytes::from(format!(
        "data: {}\n\n",
        json!({ "error": error })
    )));
    frames.push(Bytes::from_static(b"data: [DONE]\n\n"));
    event_stream(seq, notice, entry, frames, false)
}

fn event_stream(
    seq: u64,
    notice: DropNotice,
    entry: &Entry,
    frames: Vec<Bytes>,
    abort: bool,
) -> Response {
    let (total, frames) = match entry.huge_text_bytes {
        Some(bytes) => expand_huge(frames, bytes, true),
        None => (frames.len(), Box::new(frames.into_iter()) as Frames),
    };
    let mut resp = Response::new(frames_body_iter(
        total,
        frames,
        Duration::from_millis(entry.event_delay_ms),
        abort,
        notice,
    ));
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    add_request_id(h, seq);
    resp
}

/// A body that sends `frames` one write each, `delay` apart, then ends cleanly or, with
/// `abort`, fails so hyper drops the connection without finishing the response. If the client
/// goes away first, `notice` records it.
fn frames_body(frames: Vec<Bytes>, delay: Duration, abort: bool, notice: DropNotice) -> Body {
    frames_body_iter(
        frames.len(),
        Box::new(frames.into_iter()),
        delay,
        abort,
        notice,
    )
}

/// Frames made as they are sent.
type Frames = Box<dyn Iterator<Item = Bytes> + Send>;

/// The one-character text a `huge_text_bytes` reply is rendered with (a private-use character:
/// one text delta, written raw in JSON), replaced by the filler on the way out.
const HUGE_MARK: char = '\u{E000}';

/// How much filler one piece of a huge reply carries.
const HUGE_CHUNK: usize = 64 << 10;

/// `frames` with the one holding [`HUGE_MARK`] expanded to `bytes` of filler (rounded up to
/// [`HUGE_CHUNK`]): with `whole_frames`, that frame repeated with a chunk in place of the mark
/// each time (text deltas); else its text before the mark, the chunks, its text after (a
/// JSON body). Each piece is a cheap clone of one buffer. Also how many pieces there are.
fn expand_huge(frames: Vec<Bytes>, bytes: u64, whole_frames: bool) -> (usize, Frames) {
    let chunks = usize::try_from(bytes.div_ceil(HUGE_CHUNK as u64)).unwrap_or(usize::MAX);
    let mut mark = [0_u8; 4];
    let mark = HUGE_MARK.encode_utf8(&mut mark).as_bytes().to_vec();
    let filler = Bytes::from(vec![b'x'; HUGE_CHUNK]);
    let per_mark = if whole_frames { chunks } else { chunks + 2 };
    let total = frames.len().saturating_sub(1).saturating_add(per_mark);
    let pieces = frames.into_iter().flat_map(move |f| -> Frames {
        let Some(at) = f.windows(mark.len()).position(|w| w == mark.as_slice()) else {
            return Box::new(std::iter::once(f));
        };
        let (before, after) = (f.slice(..at), f.slice(at + mark.len()..));
        if whole_frames {
            let frame = Bytes::from([&before[..], &filler[..], &after[..]].concat());
            Box::new(std::iter::repeat_n(frame, chunks))
        } else {
            Box::new(
                std::iter::once(before)
                    .chain(std::iter::repeat_n(filler.clone(), chunks))
                    .chain(std::iter::once(after)),
            )
        }
    });
    (total, Box::new(pieces))
}

/// [`frames_body`] over frames made as they are sent; `total` is how many there are.
fn frames_body_iter(
    total: usize,
    frames: Frames,
    delay: Duration,
    abort: bool,
    mut notice: DropNotice,
) -> Body {
    notice.total = total;
    let state = (frames, abort, true, notice);
    let stream = futures_util::stream::unfold(
        state,
        move |(mut it, abort, first, mut notice)| async move {
            match it.next() {
                Some(frame) => {
                    if !first && !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    notice.sent += 1;
                    Some((Ok(frame), (it, abort, false, notice)))
                }
                None if abort => {
                    // A scripted break is not a client disconnect.
                    notice.finished = true;
                    // hyper only flushes what it buffered when the body is pending; failing at
                    // once would drop the frames we meant to deliver before the break.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Some((
                        Err(std::io::Error::new(
                            std::io::ErrorKind::ConnectionAborted,
                            "fakellm: scripted disconnect",
                        )),
                        (it, false, false, notice),
                    ))
                }
                None => {
                    notice.complete();
                    None
                }
            }
        },
    );
    Body::from_stream(stream)
}

/// `<log>.disconnects`: one JSON line per response the client abandoned before its end.
fn disconnect_log_path(log: &Path) -> PathBuf {
    let mut p = log.as_os_str().to_owned();
    p.push(".disconnects");
    PathBuf::from(p)
}

/// Records, when dropped unfinished, that the client went away mid-response: how a test sees
/// that a proxy cancelled its upstream request.
struct DropNotice {
    path: Arc<PathBuf>,
    seq: u64,
    sent: usize,
    total: usize,
    finished: bool,
}

impl DropNotice {
    fn new(path: Arc<PathBuf>, seq: u64) -> Self {
        Self {
            path,
            seq,
            sent: 0,
            total: 0,
            finished: false,
        }
    }

    /// The response was delivered whole: recorded in `<log>.finished` (`{seq, ts_us}`, when
    /// its last frame was handed to the connection), not as a disconnect.
    fn complete(mut self) {
        self.finished = true;
        let line = json!({"seq": self.seq, "ts_us": now_us()});
        append_line(&self.path.with_extension("finished"), &line);
    }
}

impl Drop for DropNotice {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let line = json!({"seq": self.seq, "ts": now_ms(), "frames_sent": self.sent, "frames_total": self.total});
        append_line(&self.path, &line);
    }
}

/// Appends `line` to `path` (a side log); a failure is reported on stderr only.
fn append_line(path: &Path, line: &Value) {
    let written = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, format!("{line}\n").as_bytes()));
    if let Err(e) = written {
        eprintln!("fakellm: cannot write {}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_shape_follows_path() {
        let openai = ["/v1/chat/completions", "/chat/anything", "/v1/responses"];
        let anthropic = ["/v1/messages", "/chatter", "/"];
        for (paths, api) in [(openai, Api::Openai), (anthropic, Api::Anthropic)] {
            for path in paths {
                assert_eq!(api_of_path(path), api, "{path}");
            }
        }
    }

    #[test]
    fn health_is_a_get_route() {
        assert_eq!(route("/health"), Some((Route::Health, Method::GET)));
        assert_eq!(route("/health/x"), None);
    }
}
