//! The recorder of the proxy fixtures: blackbox-server with the real client as its backend and
//! fakellm as the router, as the conformance suite runs them, with a recording relay between
//! the client and the server's in-process proxy. The backend's `executable` is a wrapper that
//! points the client at the relay (`/to/<proxy port>/...`) instead of the proxy; the relay
//! logs each request and forwards it, streaming the answer back. Two turns: the first runs a
//! scripted tool call (so a later call carries the call and its result), the second resumes.
//! Machine-specific paths are replaced by placeholders before the requests are written.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use agentbox_tests::harness::{
    BlackboxProcess, FakeLlm, client_bin, codex_options, registration, scratch,
    two_turn_write_script, user,
};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::Response;
use futures_util::TryStreamExt;
use serde_json::{Value, json};

/// One client as the recorder drives it.
pub struct Client {
    /// `blackbox_type` and the fixture directory's name.
    kind: &'static str,
    /// The CLI binary's name in the clients install.
    bin: &'static str,
    /// Its `backend_options`, with `executable` added.
    options: fn() -> Value,
    /// The shell lines that point the client at the relay (`$RELAY` is its address).
    redirect: &'static str,
    /// Its file-writing tool call for (path, content).
    write: fn(&Path, &str) -> (&'static str, Value),
}

pub const CLAUDE_CODE: Client = Client {
    kind: "claude_code",
    bin: "claude",
    options: || json!({}),
    redirect: r#"ANTHROPIC_BASE_URL="http://$RELAY/to/${ANTHROPIC_BASE_URL##*:}"
export ANTHROPIC_BASE_URL"#,
    write: |path, content| ("Write", json!({"file_path": path, "content": content})),
};

pub const CODEX: Client = Client {
    kind: "codex",
    bin: "codex",
    // The paddock's registration (as `blackbox_codex.rs` registers it).
    options: codex_options,
    // Anchored on `/v1"`, so the rewritten line (the relay's port then `/to/`) is left alone on
    // later turns.
    redirect: r##"sed -i -E "s#^base_url = \"http://127\.0\.0\.1:([0-9]+)/v1\"#base_url = \"http://$RELAY/to/\1/v1\"#" "$CODEX_HOME/config.toml""##,
    write: |path, content| {
        let cmd = format!("printf '%s' '{content}' > '{}'", path.display());
        ("exec_command", json!({"cmd": cmd}))
    },
};

#[derive(Clone)]
struct Relay {
    http: reqwest::Client,
    log: Arc<Mutex<Vec<Value>>>,
}

/// Headers not worth keeping or replaying: the connection's own.
fn connection_header(name: &str) -> bool {
    matches!(
        name,
        "host" | "content-length" | "connection" | "transfer-encoding" | "keep-alive"
    )
}

async fn relay(State(st): State<Relay>, req: Request) -> Response {
    let (parts, body) = req.into_parts();
    let full = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let Some((port, rest)) = full
        .strip_prefix("/to/")
        .and_then(|r| r.split_once('/'))
        .map(|(p, r)| (p.to_owned(), format!("/{r}")))
    else {
        let mut r = Response::new(Body::from(format!("relay: no target in {full}")));
        *r.status_mut() = axum::http::StatusCode::BAD_GATEWAY;
        return r;
    };
    let bytes = axum::body::to_bytes(body, usize::MAX)
        .await
        .unwrap_or_default();
    let headers: BTreeMap<String, String> = parts
        .headers
        .iter()
        .filter(|(k, _)| !connection_header(k.as_str()))
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let logged_body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    st.log.lock().unwrap().push(json!({
        "method": parts.method.as_str(),
        "path": rest,
        "headers": headers,
        "body": logged_body,
    }));
    let mut out = st
        .http
        .request(
            parts.method.clone(),
            format!("http://127.0.0.1:{port}{rest}"),
        )
        .body(bytes);
    for (k, v) in &parts.headers {
        if !connection_header(k.as_str()) {
            out = out.header(k, v);
        }
    }
    let resp = match out.send().await {
        Ok(r) => r,
        Err(e) => {
            let mut r = Response::new(Body::from(format!("relay: {e}")));
            *r.status_mut() = axum::http::StatusCode::BAD_GATEWAY;
            return r;
        }
    };
    let mut r = Response::builder().status(resp.status());
    for (k, v) in resp.headers() {
        if !connection_header(k.as_str()) {
            r = r.header(k, v);
        }
    }
    let stream = resp.bytes_stream().map_err(std::io::Error::other);
    r.body(Body::from_stream(stream)).unwrap()
}

/// Starts the relay on a loopback port: its address and its log.
async fn start_relay() -> (SocketAddr, Arc<Mutex<Vec<Value>>>) {
    let log = Arc::new(Mutex::new(Vec::new()));
    let st = Relay {
        http: reqwest::Client::new(),
        log: log.clone(),
    };
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = axum::Router::new().fallback(relay).with_state(st);
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, log)
}

/// The wrapper script the backend runs instead of the client.
fn wrapper(dir: &Path, client: &Client, relay: SocketAddr) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let real = client_bin(client.bin).unwrap();
    let text = format!(
        "#!/bin/sh\nRELAY={relay}\n{}\nexec {} \"$@\"\n",
        client.redirect,
        real.display()
    );
    let path = dir.join(format!("record-{}", client.bin));
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// A short label for a recorded call: what shape it is.
fn label(request: &Value) -> &'static str {
    let path = request["path"].as_str().unwrap_or("");
    let body = &request["body"];
    let text = body.to_string();
    if path.contains("count_tokens") {
        "count_tokens"
    } else if !(path.contains("/messages") || path.contains("/responses")) {
        "plain"
    } else if body["tools"].as_array().is_none_or(Vec::is_empty) {
        "side_call"
    } else if text.contains("second question") {
        "second_turn"
    } else if text.contains("\"tool_result\"") || text.contains("\"function_call_output\"") {
        "tool_result"
    } else {
        "first"
    }
}

/// Runs the two turns and writes `root/<kind>/NN_label/request.json`, replacing what was
/// there.
pub async fn record(client: &Client, root: &Path) {
    let work = scratch().unwrap();
    let target = work.path().join("hello.txt");
    let (tool, input) = (client.write)(&target, "hello from the fixtures\n");
    let call = "call_fixture_write_1";
    let mut script = two_turn_write_script("Fixture title", call, tool, &input);
    script["fallback"] = json!({"text": "done"});
    let fake = FakeLlm::start(Path::new(env!("CARGO_BIN_EXE_fakellm")), &script).unwrap();
    let (addr, log) = start_relay().await;
    let bb = BlackboxProcess::start(&[]).unwrap();
    let mut options = (client.options)();
    options["executable"] = json!(wrapper(work.path(), client, addr));
    let reg = registration(
        client.kind,
        options,
        &fake.base_url(),
        "sess-fixture",
        &json!({}),
    );
    let r = bb.post("/v1/rollout/register", &reg).await;
    assert_eq!(r.status, 200, "{r}\n{}", bb.describe());
    let runtime_dir = r.body["binding"]["runtime_dir"]
        .as_str()
        .unwrap()
        .to_owned();
    let path = "/v1/sessions/sess-fixture/messages";
    for (turn, text) in [
        ("turn-1", "Create hello.txt with the tool"),
        ("turn-2", "second question"),
    ] {
        let body = json!({"turn_id": turn, "messages": user(text)});
        let r = bb.post(path, &body).await;
        assert_eq!(r.status, 200, "{r}\n{}", bb.diag(&fake));
    }
    assert!(target.is_file(), "the tool call did not run");
    let records = log.lock().unwrap().clone();
    let clients = client_bin(client.bin).unwrap();
    let clients_dir = clients
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .parent()
        .unwrap();
    // Longest first: the runtime dir lies under the runtime root.
    let placeholders = [
        (runtime_dir.clone(), "/RUNTIME_DIR"),
        (bb.runtime_root().display().to_string(), "/RUNTIME_ROOT"),
        (work.path().display().to_string(), "/WORK_DIR"),
        (clients_dir.display().to_string(), "/CLIENTS_DIR"),
    ];
    let out = root.join(client.kind);
    if out.exists() {
        std::fs::remove_dir_all(&out).unwrap();
    }
    for (i, rec) in records.iter().enumerate() {
        let mut text = serde_json::to_string_pretty(rec).unwrap();
        for (from, to) in &placeholders {
            text = text.replace(from.as_str(), to);
        }
        let dir = out.join(format!("{:02}_{}", i + 1, label(rec)));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("request.json"), text + "\n").unwrap();
    }
    assert!(records.len() >= 3, "only {} calls recorded", records.len());
}
