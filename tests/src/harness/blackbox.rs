//! `blackbox-server` as a child process for the blackbox tests: loopback port 0, a temp runtime
//! root, the real agent CLIs from the clients cache, and a JSON-over-HTTP helper that returns
//! status, `x-request-id` and body together. Also the registrations the paddock sends (opencode,
//! Claude Code, codex), the small helpers every blackbox test uses (turn bodies, settled turns,
//! diagnostics), and process lookups for the no-orphan checks.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{HarnessError, Service, client_bin, workspace_bin};

deref_to_service!(BlackboxProcess);

/// A running `blackbox-server`.
#[derive(Debug)]
pub struct BlackboxProcess {
    service: Service,
    address: String,
    http: reqwest::Client,
    env: Vec<(String, String)>,
    /// The directory of `BBS_UNIX_SOCKET` when the server listens on a unix socket.
    socket_dir: Option<tempfile::TempDir>,
    // Declared last so the process is gone before its files are removed.
    runtime_root: tempfile::TempDir,
}

/// Starts `bin` of the blackbox crate with the arguments and environment `prepare` gives it,
/// and waits for its `listening on <rest>` line; returns the rest.
pub(super) fn start_bin(
    bin: &str,
    prepare: impl FnOnce(&mut Command),
) -> Result<(Service, String), HarnessError> {
    let mut cmd = Command::new(workspace_bin("agentbox-blackbox", bin)?);
    prepare(&mut cmd);
    Service::start_listening(bin, cmd, Duration::from_secs(30), "listening on ")
}

/// One answer.
#[derive(Debug, Clone)]
pub struct Reply {
    /// HTTP status.
    pub status: u16,
    /// The `x-request-id` header.
    pub request_id: Option<String>,
    /// The body (JSON, else a string).
    pub body: Value,
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.status, self.body)
    }
}

impl BlackboxProcess {
    /// Starts the server with the real opencode (`OPENCODE_BIN`) and `env` on top of
    /// `BBS_HOST=127.0.0.1`, `BBS_PORT=0` and a temp `BBS_RUNTIME_ROOT`.
    ///
    /// # Errors
    /// When the binary cannot be built, opencode is not installed, or the server does not
    /// come up.
    pub fn start(env: &[(&str, &str)]) -> Result<Self, HarnessError> {
        Self::start_with(env, false)
    }

    /// Like [`BlackboxProcess::start`], listening on a unix socket (`BBS_UNIX_SOCKET` in a
    /// temp directory of its own), as in a rollout slot; every call goes over that socket.
    ///
    /// # Errors
    /// As [`BlackboxProcess::start`].
    pub fn start_unix(env: &[(&str, &str)]) -> Result<Self, HarnessError> {
        Self::start_with(env, true)
    }

    fn start_with(env: &[(&str, &str)], unix: bool) -> Result<Self, HarnessError> {
        let temp = |prefix: &str| {
            tempfile::Builder::new()
                .prefix(prefix)
                .tempdir()
                .map_err(|source| HarnessError::Io {
                    path: std::env::temp_dir(),
                    source,
                })
        };
        let runtime_root = temp("blackbox-")?;
        let mut env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let socket_dir = if unix { Some(temp("bb-sock-")?) } else { None };
        let mut http = reqwest::Client::builder().timeout(Duration::from_secs(300));
        if let Some(dir) = &socket_dir {
            let socket = dir.path().join("server.sock");
            env.push(("BBS_UNIX_SOCKET".into(), socket.display().to_string()));
            http = http.unix_socket(socket);
        }
        let (service, address) = Self::spawn(runtime_root.path(), &env)?;
        let http = http
            .build()
            .map_err(|e| HarnessError::Build(e.to_string()))?;
        Ok(Self {
            service,
            address,
            http,
            env,
            socket_dir,
            runtime_root,
        })
    }

    /// `BBS_UNIX_SOCKET`, when the server listens on one.
    #[must_use]
    pub fn unix_socket(&self) -> Option<PathBuf> {
        self.socket_dir
            .as_ref()
            .map(|d| d.path().join("server.sock"))
    }

    fn spawn(
        runtime_root: &Path,
        env: &[(String, String)],
    ) -> Result<(Service, String), HarnessError> {
        let opencode = client_bin("opencode")?;
        let claude = client_bin("claude")?;
        let codex = client_bin("codex")?;
        let openclaw = client_bin("openclaw")?;
        start_bin("blackbox-server", |cmd| {
            cmd.env_clear()
                .env("PATH", "/usr/local/bin:/usr/bin:/bin")
                .env("RUST_LOG", "info")
                .env("BBS_HOST", "127.0.0.1")
                .env("BBS_PORT", "0")
                .env("BBS_RUNTIME_ROOT", runtime_root)
                .env("OPENCODE_BIN", opencode)
                .env("CLAUDE_CODE_BIN", claude)
                .env("CODEX_BIN", codex)
                .env("OPENCLAW_BIN", openclaw)
                .envs(env.iter().map(|(k, v)| (k, v)));
        })
    }

    /// SIGKILL to the server alone (not its group: what it started is on its own, as after
    /// a real crash), then a new server on the same runtime root and environment.
    ///
    /// # Errors
    /// When the new server does not come up.
    ///
    /// # Panics
    /// When the signal cannot be sent.
    pub fn crash_and_restart(&mut self) -> Result<(), HarnessError> {
        let pid = i32::try_from(self.pid())
            .ok()
            .and_then(rustix::process::Pid::from_raw)
            .unwrap_or_else(|| panic!("pid {} out of range", self.pid()));
        rustix::process::kill_process(pid, rustix::process::Signal::KILL)
            .unwrap_or_else(|e| panic!("SIGKILL: {e}"));
        let deadline = Instant::now() + Duration::from_secs(30);
        while self.is_running() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let (service, address) = Self::spawn(self.runtime_root.path(), &self.env)?;
        // The old service's drop would signal its group; it is dead and reaped already.
        let mut old = std::mem::replace(&mut self.service, service);
        old.kill();
        self.address = address;
        Ok(())
    }

    /// `http://127.0.0.1:PORT` (`http://localhost` over the unix socket: the client sends
    /// every request there).
    #[must_use]
    pub fn base_url(&self) -> String {
        if self.socket_dir.is_some() {
            "http://localhost".to_owned()
        } else {
            format!("http://{}", self.address)
        }
    }

    /// `BBS_RUNTIME_ROOT`.
    #[must_use]
    pub fn runtime_root(&self) -> &Path {
        self.runtime_root.path()
    }

    /// `method path` with an optional JSON body.
    ///
    /// # Errors
    /// When the request cannot be sent.
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<Reply, reqwest::Error> {
        let method = reqwest::Method::from_bytes(method.as_bytes()).unwrap_or(reqwest::Method::GET);
        let mut req = self
            .http
            .request(method, format!("{}{path}", self.base_url()));
        if let Some(b) = body {
            req = req.json(b);
        }
        Self::reply(req.send().await?).await
    }

    /// `GET path`.
    ///
    /// # Panics
    /// When the request cannot be sent (the server died): a test cannot go on.
    pub async fn get(&self, path: &str) -> Reply {
        self.must(self.call("GET", path, None).await, path)
    }

    /// `POST path` with a JSON body.
    ///
    /// # Panics
    /// As [`BlackboxProcess::get`].
    pub async fn post(&self, path: &str, body: &Value) -> Reply {
        self.must(self.call("POST", path, Some(body)).await, path)
    }

    /// `POST path` without a body.
    ///
    /// # Panics
    /// As [`BlackboxProcess::get`].
    pub async fn post_empty(&self, path: &str) -> Reply {
        self.must(self.call("POST", path, None).await, path)
    }

    fn must(&self, r: Result<Reply, reqwest::Error>, path: &str) -> Reply {
        r.unwrap_or_else(|e| panic!("{path}: {e}\n{}", self.describe()))
    }

    /// Long-polls turn `turn` of `session` (`?wait=` seconds each) until `done` holds for its
    /// snapshot.
    ///
    /// # Panics
    /// When a poll is not 200 or the turn does not get there within 3 minutes.
    pub async fn poll_turn(
        &self,
        session: &str,
        turn: &str,
        wait: u32,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = std::time::Instant::now() + Duration::from_secs(180);
        loop {
            let r = self
                .get(&format!("/v1/sessions/{session}/turns/{turn}?wait={wait}"))
                .await;
            assert_eq!(r.status, 200, "poll: {r}");
            if done(&r.body) {
                return r.body;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "turn never settled: {r}\n{}",
                self.describe()
            );
        }
    }

    /// `POST path` with raw bytes as the body (`content-type: application/json`).
    ///
    /// # Errors
    /// When the request cannot be sent.
    pub async fn post_raw(&self, path: &str, body: Vec<u8>) -> Result<Reply, reqwest::Error> {
        let req = self
            .http
            .post(format!("{}{path}", self.base_url()))
            .header("content-type", "application/json")
            .body(body);
        Self::reply(req.send().await?).await
    }

    async fn reply(resp: reqwest::Response) -> Result<Reply, reqwest::Error> {
        let status = resp.status().as_u16();
        let request_id = resp
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        let text = resp.text().await?;
        let body = serde_json::from_str(&text).unwrap_or(Value::String(text));
        Ok(Reply {
            status,
            request_id,
            body,
        })
    }

    /// The pid of the opencode a registration started (`<runtime_dir>/run/opencode.pid`); it
    /// leads its own process group.
    #[must_use]
    pub fn opencode_pid(runtime_dir: &str) -> Option<u32> {
        Self::agent_pid(runtime_dir, "opencode.pid")
    }

    /// The pid in `<runtime_dir>/run/<file>` (an agent process, leading its own group).
    #[must_use]
    pub fn agent_pid(runtime_dir: &str, file: &str) -> Option<u32> {
        std::fs::read_to_string(PathBuf::from(runtime_dir).join("run").join(file))
            .ok()
            .and_then(|s| s.trim().parse().ok())
    }

    /// The server's state and fakellm's request log, for a failed assertion.
    #[must_use]
    pub fn diag(&self, fake: &super::FakeLlm) -> String {
        let log: Vec<String> = fake
            .requests()
            .unwrap_or_default()
            .iter()
            .map(|r| {
                format!(
                    "#{} {} {} served_by={}",
                    r["seq"], r["method"], r["path"], r["served_by"]
                )
            })
            .collect();
        format!("{}\n--- fakellm ---\n{}", self.describe(), log.join("\n"))
    }

    /// `POST /v1/sessions/{session}/messages`: submits a turn.
    ///
    /// # Panics
    /// As [`BlackboxProcess::get`].
    pub async fn turn(&self, session: &str, body: &Value) -> Reply {
        self.post(&format!("/v1/sessions/{session}/messages"), body)
            .await
    }

    /// `POST /v1/sessions/{session}/execute_cmd`.
    ///
    /// # Panics
    /// As [`BlackboxProcess::get`].
    pub async fn execute_cmd(&self, session: &str, body: &Value) -> Reply {
        self.post(&format!("/v1/sessions/{session}/execute_cmd"), body)
            .await
    }

    /// Waits until `cond` holds, looking every 50 ms.
    ///
    /// # Panics
    /// With `what` and [`BlackboxProcess::diag`] when it does not hold within `timeout`.
    pub async fn wait_for(
        &self,
        what: &str,
        fake: &super::FakeLlm,
        timeout: Duration,
        cond: impl Fn() -> bool,
    ) {
        let deadline = Instant::now() + timeout;
        while !cond() {
            assert!(Instant::now() < deadline, "{what}\n{}", self.diag(fake));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends SIGTERM to the server (not its group: the server must stop its agents itself)
    /// and waits for it to exit; returns how long that took.
    ///
    /// # Panics
    /// When the signal cannot be sent or the server still runs after `limit`.
    pub async fn terminate(&mut self, limit: Duration) -> Duration {
        let pid = i32::try_from(self.pid())
            .ok()
            .and_then(rustix::process::Pid::from_raw)
            .unwrap_or_else(|| panic!("pid {} out of range", self.pid()));
        let sent = Instant::now();
        rustix::process::kill_process(pid, rustix::process::Signal::TERM)
            .unwrap_or_else(|e| panic!("SIGTERM: {e}"));
        while self.is_running() {
            assert!(sent.elapsed() < limit, "still running\n{}", self.describe());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        sent.elapsed()
    }

    /// Posts the committed turn `turn` to `path` again and checks it is replayed: the same
    /// outputs as `committed`, and no new model call.
    ///
    /// # Panics
    /// When it is not.
    pub async fn assert_replay(
        &self,
        fake: &super::FakeLlm,
        path: &str,
        turn: &Value,
        committed: &Value,
    ) {
        let logged = || {
            fake.requests()
                .unwrap_or_else(|e| panic!("fakellm's log: {e}"))
                .len()
        };
        let seen = logged();
        let replay = self.post(path, turn).await;
        assert_eq!(replay.status, 200, "{replay}");
        assert_eq!(replay.body["idempotent_replay"], true);
        assert_eq!(replay.body["outputs"], committed["outputs"]);
        assert_eq!(logged(), seen, "the replay reached the model");
    }
}

impl Reply {
    /// Its status and its `error` code, to compare at once.
    #[must_use]
    pub fn status_and_error(&self) -> (u16, Option<&str>) {
        (self.status, self.body["error"].as_str())
    }
}

/// Checks that every proxied model call in `requests` (fakellm's log) carries the rollout
/// headers of `session`'s turn `turn` (instance `inst-001`, as [`registration`] binds it).
///
/// # Panics
/// On the first header that is missing or differs.
pub fn assert_rollout_headers(requests: &[Value], session: &str, turn: &str) {
    let expected = [
        ("x-session-id", session),
        ("x-instance-id", "inst-001"),
        ("x-turn-id", turn),
        ("x-smg-routing-key", session),
        ("x-dressage-partial-rollout", "1"),
    ];
    for req in requests {
        for (name, value) in expected {
            assert_eq!(req["headers"][name], value, "{name} in {req}");
        }
    }
}

/// A turn's `messages`: one user message.
#[must_use]
pub fn user(text: &str) -> Value {
    json!([{"role": "user", "content": text}])
}

/// A sync turn body: `turn_id` with one user message.
#[must_use]
pub fn user_turn(turn_id: &str, text: &str) -> Value {
    json!({"turn_id": turn_id, "messages": user(text)})
}

/// A turn that is neither queued nor inflight.
#[must_use]
pub fn settled(turn: &Value) -> bool {
    !matches!(turn["status"].as_str(), Some("queued" | "inflight"))
}

/// The content of a turn's last output.
#[must_use]
pub fn last_text(outputs: &Value) -> &str {
    outputs
        .as_array()
        .and_then(|o| o.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or("")
}

/// A scratch directory for files the agent writes.
///
/// # Errors
/// When no temp directory can be made.
pub fn scratch() -> Result<tempfile::TempDir, HarnessError> {
    tempfile::Builder::new()
        .prefix("bb-work-")
        .tempdir()
        .map_err(|source| HarnessError::Io {
            path: std::env::temp_dir(),
            source,
        })
}

/// A registration of `blackbox_type` with `backend_options` for `router` (fakellm's base URL),
/// with `extra` merged over the top level.
#[must_use]
pub fn registration(
    blackbox_type: &str,
    backend_options: Value,
    router: &str,
    session_id: &str,
    extra: &Value,
) -> Value {
    let mut v = json!({
        "blackbox_type": blackbox_type,
        "router": router,
        "router_api_path": "/v1",
        "bound_instance_id": "inst-001",
        "bound_session_id": session_id,
        "backend_options": backend_options,
        "server_config": {},
    });
    if let (Some(base), Some(extra)) = (v.as_object_mut(), extra.as_object()) {
        for (k, val) in extra {
            base.insert(k.clone(), val.clone());
        }
    }
    v
}

/// The Claude Code registration (the backend's defaults) for `router`, with `extra` merged
/// over the top level.
#[must_use]
pub fn claude_code_registration(router: &str, session_id: &str, extra: &Value) -> Value {
    registration("claude_code", json!({}), router, session_id, extra)
}

/// The opencode registration the paddock sends (its defaults), for `router` (fakellm's base
/// URL), with `extra` merged over the top level.
#[must_use]
pub fn opencode_registration(router: &str, session_id: &str, extra: &Value) -> Value {
    registration("opencode", opencode_options(), router, session_id, extra)
}

/// The opencode `backend_options` the paddock sends.
#[must_use]
pub fn opencode_options() -> Value {
    json!({
        "provider_id": "sglang",
        "provider_name": "Dressage Proxy",
        "provider_package": "@ai-sdk/openai-compatible",
        "model_id": "proxy-model",
        "model_name": "Dressage Proxy",
        "model_limit": {"context": 131_072, "output": 8192},
    })
}

/// The codex `backend_options` the paddock sends.
#[must_use]
pub fn codex_options() -> Value {
    json!({
        "model": {"id": "proxy-model", "name": "Dressage Proxy"},
        "model_provider_id": "dressage_proxy",
        "sandbox_mode": "danger-full-access",
        "approval_policy": "never",
        "skip_git_repo_check": true,
        "ignore_rules": true,
        "web_search": "disabled",
    })
}

/// Pids of live processes whose command line contains `needle`.
#[must_use]
pub fn processes_with(needle: &str) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = std::process::id();
    entries
        .filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()))
        .filter(|pid| *pid != me)
        .filter(|pid| {
            let alive = std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map(|s| !s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')))
                .unwrap_or(false);
            alive
                && std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| {
                    String::from_utf8_lossy(&c)
                        .replace('\0', " ")
                        .contains(needle)
                })
        })
        .collect()
}
