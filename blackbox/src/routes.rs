//! The HTTP surface: the reference's routes, bodies read under a 20 MiB limit and parsed into
//! the wire types (a body that does not fit is 400 `request_error` "Request validation
//! failed." with pydantic-style `errors`, as the reference's handler answers), every answer
//! carrying its `request_id` (also in `x-request-id`), every request logged and counted
//! (shutdown waits for them).

use std::time::{Duration, Instant};

use axum::Json;
use axum::Router;
use axum::extract::rejection::PathRejection;
use axum::extract::{FromRequestParts, Path, RawQuery, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::model::{
    ExecuteCmdRequest, MessageRequest, PauseRequest, RegisterRequest, ResumeRequest, TurnMode,
    TurnSubmitResponse,
};
use crate::server::Server;

/// The largest request body (the reference has no limit; 20 MiB is far above any turn).
pub const BODY_LIMIT: u64 = 20 << 20;

/// How long a client may take to send its body.
const BODY_TIMEOUT: Duration = Duration::from_secs(60);

/// This request's id (`req-xxxxxxxx`).
#[derive(Debug, Clone)]
struct Rid(String);

/// What every handler takes: the server and this request's id (set by [`scope`]).
struct Ctx {
    s: Server,
    rid: Rid,
}

impl FromRequestParts<Server> for Ctx {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, s: &Server) -> Result<Self, Self::Rejection> {
        // `scope` sets it on every request; a fresh one keeps an answer's id well formed.
        let rid = parts.extensions.get::<Rid>().cloned();
        Ok(Ctx {
            s: s.clone(),
            rid: rid.unwrap_or_else(|| Rid(crate::ids::request_id())),
        })
    }
}

/// Path parameters, or the rejection [`path_params`] turns into a validation error.
type Params<T> = Result<Path<T>, PathRejection>;

/// The server's router.
pub fn router(server: Server) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/v1/status", get(status))
        .route("/v1/rollout/register", post(register))
        .route("/v1/rollout/pause", post(pause))
        .route("/v1/rollout/resume", post(resume))
        .route("/v1/rollout/pause_state", get(pause_state))
        .route("/v1/sessions/{session_id}", get(get_session))
        .route("/v1/sessions/{session_id}/messages", post(messages))
        .route("/v1/sessions/{session_id}/turns/{turn_id}", get(get_turn))
        .route(
            "/v1/sessions/{session_id}/turns/{turn_id}/cancel",
            post(cancel_turn),
        )
        .route("/v1/sessions/{session_id}/execute_cmd", post(execute_cmd))
        .route("/v1/sessions/{session_id}/abort", post(abort))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(server.clone(), scope))
        .with_state(server)
}

/// Request id, in-flight count, access log.
async fn scope(State(server): State<Server>, mut req: Request, next: Next) -> Response {
    let rid = crate::ids::request_id();
    let _inflight = server.request_started();
    let started = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    req.extensions_mut().insert(Rid(rid.clone()));
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert("x-request-id", v);
    }
    tracing::info!(
        request_id = %rid,
        %method,
        path,
        status = resp.status().as_u16(),
        duration_ms = started.elapsed().as_secs_f64() * 1000.0,
        "request completed"
    );
    resp
}

fn fail(rid: &Rid, e: &ApiError) -> Response {
    let (status, body) = e.render(&rid.0);
    (status, Json(body)).into_response()
}

/// `body` as JSON with `request_id` set.
fn ok<T: Serialize>(rid: &Rid, status: StatusCode, body: &T) -> Response {
    let mut v = serde_json::to_value(body).unwrap_or(Value::Null);
    if let Some(m) = v.as_object_mut()
        && m.contains_key("request_id")
    {
        m.insert("request_id".into(), Value::String(rid.0.clone()));
    }
    (status, Json(v)).into_response()
}

fn validation(kind: &str, loc: Vec<Value>, msg: impl Into<String>) -> ApiError {
    ApiError::Validation {
        errors: vec![json!({"type": kind, "loc": loc, "msg": msg.into()})],
    }
}

/// Reads and parses a JSON body into `T`.
async fn body<T: DeserializeOwned>(req: Request) -> Result<T, ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = agentbox_http::read_body(&parts.headers, body, BODY_LIMIT, BODY_TIMEOUT)
        .await
        .map_err(|e| match e {
            agentbox_http::BodyError::TooLarge { limit } => ApiError::BodyTooLarge { limit },
            other @ (agentbox_http::BodyError::Timeout(_) | agentbox_http::BodyError::Read(_)) => {
                ApiError::request(format!("Cannot read the request body: {other}"))
            }
        })?;
    parse_body(&bytes)
}

/// A request body into `T`, with the reference's validation errors: what every handler runs on
/// the caller's bytes (pure, so the fuzz targets reach it without a server).
pub fn parse_body<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Err(validation("missing", vec![json!("body")], "Field required"));
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| ApiError::Validation {
        errors: vec![json!({
            "type": "json_invalid",
            "loc": ["body", e.column()],
            "msg": "JSON decode error",
            "input": {},
            "ctx": {"error": e.to_string()},
        })],
    })?;
    if !value.is_object() {
        return Err(validation(
            "model_attributes_type",
            vec![json!("body")],
            "Input should be a valid dictionary or object to extract fields from",
        ));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let mut loc = vec![json!("body")];
        for seg in e.path().iter() {
            match seg {
                serde_path_to_error::Segment::Seq { index } => loc.push(json!(index)),
                serde_path_to_error::Segment::Map { key } => loc.push(json!(key)),
                serde_path_to_error::Segment::Enum { variant } => loc.push(json!(variant)),
                serde_path_to_error::Segment::Unknown => {}
            }
        }
        let msg = e.into_inner().to_string();
        if let Some(field) = msg
            .strip_prefix("missing field `")
            .and_then(|r| r.split('`').next())
        {
            loc.push(json!(field));
            return validation("missing", loc, "Field required");
        }
        validation("value_error", loc, msg)
    })
}

fn positive(loc: &[&str], v: Option<f64>) -> Result<(), ApiError> {
    match v {
        Some(x) if !(x > 0.0 && x.is_finite()) => Err(validation(
            "greater_than",
            loc.iter().map(|s| json!(s)).collect(),
            "Input should be greater than 0",
        )),
        Some(_) | None => Ok(()),
    }
}

/// Path parameters; a rejection (bad percent-encoding) is a validation error.
fn path_params<T>(p: Params<T>) -> Result<T, ApiError> {
    p.map(|Path(v)| v)
        .map_err(|e| validation("value_error", vec![json!("path")], e.body_text()))
}

/// Query parameters as pairs.
fn query_pairs(q: Option<&str>) -> Vec<(String, String)> {
    q.map(|q| {
        url::form_urlencoded::parse(q.as_bytes())
            .into_owned()
            .collect()
    })
    .unwrap_or_default()
}

/// A boolean query parameter, as pydantic reads one.
fn query_bool(pairs: &[(String, String)], name: &str) -> Result<bool, ApiError> {
    let Some((_, v)) = pairs.iter().rev().find(|(k, _)| k == name) else {
        return Ok(false);
    };
    match v.to_ascii_lowercase().as_str() {
        "1" | "true" | "t" | "yes" | "y" | "on" => Ok(true),
        "0" | "false" | "f" | "no" | "n" | "off" => Ok(false),
        _ => Err(validation(
            "bool_parsing",
            vec![json!("query"), json!(name)],
            "Input should be a valid boolean, unable to interpret input",
        )),
    }
}

async fn health() -> Response {
    Json(json!({"healthy": true, "version": env!("CARGO_PKG_VERSION")})).into_response()
}

async fn status(Ctx { s, rid }: Ctx) -> Response {
    ok(&rid, StatusCode::OK, &s.status())
}

/// A handler's outcome: a 200 with `body`, or the error rendered.
fn answer<T: Serialize>(rid: &Rid, r: Result<T, ApiError>) -> Response {
    match r {
        Ok(body) => ok(rid, StatusCode::OK, &body),
        Err(e) => fail(rid, &e),
    }
}

async fn register(Ctx { s, rid }: Ctx, req: Request) -> Response {
    let r = async {
        let r: RegisterRequest = body(req).await?;
        if let Some(o) = &r.server_config {
            let errors: Vec<Value> = o
                .violations()
                .into_iter()
                .map(|(field, msg)| {
                    json!({"type": "value_error", "loc": ["body", "server_config", field], "msg": msg})
                })
                .collect();
            if !errors.is_empty() {
                return Err(ApiError::Validation { errors });
            }
        }
        s.register(r).await
    };
    answer(&rid, r.await)
}

async fn pause(Ctx { s, rid }: Ctx, req: Request) -> Response {
    let r = async {
        let r: PauseRequest = body(req).await?;
        positive(&["body", "timeout_seconds"], r.timeout_seconds)?;
        s.pause(&r).await
    };
    answer(&rid, r.await)
}

async fn resume(Ctx { s, rid }: Ctx, req: Request) -> Response {
    let r = async { s.resume(&body::<ResumeRequest>(req).await?).await };
    answer(&rid, r.await)
}

async fn pause_state(State(s): State<Server>) -> Response {
    Json(s.pause_state()).into_response()
}

async fn messages(Ctx { s, rid }: Ctx, p: Params<String>, req: Request) -> Response {
    let r = async {
        let session_id = path_params(p)?;
        let r: MessageRequest = body(req).await?;
        match r.mode {
            TurnMode::Sync => Ok(ok(
                &rid,
                StatusCode::OK,
                &s.send_message(&session_id, &r).await?,
            )),
            TurnMode::Async => {
                if r.turn_id.is_none() {
                    return Err(ApiError::Request {
                        message: "turn_id is required for async submissions.".into(),
                        details: crate::error::obj(json!({"session_id": session_id})),
                    });
                }
                let sub = s.submit(&session_id, &r).await?;
                let reply = TurnSubmitResponse {
                    request_id: String::new(),
                    session_id,
                    instance_id: sub.instance_id,
                    turn_id: sub.turn_id,
                    status: sub.status,
                    idempotent_replay: sub.idempotent_replay,
                };
                Ok(ok(&rid, StatusCode::ACCEPTED, &reply))
            }
        }
    };
    r.await.unwrap_or_else(|e| fail(&rid, &e))
}

/// `?wait=` in seconds (`>= 0`, 0 when absent).
fn wait_param(pairs: &[(String, String)]) -> Result<f64, ApiError> {
    let Some((_, v)) = pairs.iter().rev().find(|(k, _)| k == "wait") else {
        return Ok(0.0);
    };
    let loc = vec![json!("query"), json!("wait")];
    match v.trim().parse::<f64>() {
        Ok(w) if w >= 0.0 && w.is_finite() => Ok(w),
        Ok(_) => Err(validation(
            "greater_than_equal",
            loc,
            "Input should be greater than or equal to 0",
        )),
        Err(_) => Err(validation(
            "float_parsing",
            loc,
            "Input should be a valid number, unable to parse string as a number",
        )),
    }
}

async fn get_turn(
    Ctx { s, rid }: Ctx,
    p: Params<(String, String)>,
    RawQuery(q): RawQuery,
) -> Response {
    let r = async {
        let (session_id, turn_id) = path_params(p)?;
        let wait = wait_param(&query_pairs(q.as_deref()))?;
        s.get_turn(&session_id, &turn_id, crate::config::secs(wait))
            .await
    };
    answer(&rid, r.await)
}

async fn cancel_turn(Ctx { s, rid }: Ctx, p: Params<(String, String)>) -> Response {
    let r = async {
        let (session_id, turn_id) = path_params(p)?;
        s.cancel_turn(&session_id, &turn_id).await
    };
    answer(&rid, r.await)
}

async fn execute_cmd(Ctx { s, rid }: Ctx, p: Params<String>, req: Request) -> Response {
    let r = async {
        let session_id = path_params(p)?;
        let r: ExecuteCmdRequest = body(req).await?;
        positive(&["body", "timeout"], r.timeout)?;
        s.execute_cmd(&session_id, &r).await
    };
    answer(&rid, r.await)
}

async fn get_session(Ctx { s, rid }: Ctx, p: Params<String>, RawQuery(q): RawQuery) -> Response {
    let r = (|| {
        let session_id = path_params(p)?;
        let pairs = query_pairs(q.as_deref());
        let [history, trace, turns] =
            ["include_history", "include_trace", "include_turns"].map(|f| query_bool(&pairs, f));
        s.get_session(&session_id, history?, trace?, turns?)
    })();
    answer(&rid, r)
}

async fn abort(Ctx { s, rid }: Ctx, p: Params<String>) -> Response {
    let r = async { s.abort(&path_params(p)?).await };
    answer(&rid, r.await)
}

async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, Json(json!({"detail": "Not Found"}))).into_response()
}

async fn method_not_allowed() -> Response {
    (
        StatusCode::METHOD_NOT_ALLOWED,
        Json(json!({"detail": "Method Not Allowed"})),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bodies_are_validated_like_pydantic() {
        let req = |b: &'static str| Request::new(axum::body::Body::from(b));
        let err = body::<MessageRequest>(req("{not json")).await.unwrap_err();
        let ApiError::Validation { errors } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(errors[0]["type"], "json_invalid");
        let err = body::<MessageRequest>(req("{}")).await.unwrap_err();
        let ApiError::Validation { errors } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(errors[0]["loc"], json!(["body", "messages"]));
        assert_eq!(errors[0]["type"], "missing");
        let err = body::<MessageRequest>(req(r#"{"messages": [{"role": "boss"}]}"#))
            .await
            .unwrap_err();
        let ApiError::Validation { errors } = &err else {
            panic!("{err:?}")
        };
        assert_eq!(errors[0]["loc"], json!(["body", "messages", 0, "role"]));
        let err = body::<MessageRequest>(req("")).await.unwrap_err();
        assert!(matches!(err, ApiError::Validation { .. }));
        let err = body::<MessageRequest>(req("[]")).await.unwrap_err();
        let (status, b) = err.render("r");
        assert_eq!(
            (status.as_u16(), b.message.as_str()),
            (400, "Request validation failed.")
        );
        let ok: MessageRequest = body(req(
            r#"{"messages": [{"role": "user", "content": "hi"}], "mode": "async"}"#,
        ))
        .await
        .unwrap();
        assert_eq!(ok.mode, TurnMode::Async);
    }
}
