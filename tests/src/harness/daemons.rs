//! Our own daemons as child processes: locating (and freshening) their binaries, and wrappers
//! for `agentbox-bridge`, `agentbox-gateway` and `agentbox-launcher` (as root) with temp
//! configs and data dirs.
//!
//! `env!("CARGO_BIN_EXE_*")` only covers binaries of the test's own package, and the daemons
//! live in other packages (whose integration tests live here too, so a test build does not
//! produce their binaries). [`workspace_bin`] calls `cargo build` itself when the binary is
//! missing or older than a workspace source file: never a stale binary, and no rebuild (with
//! `-p`'s different feature set) when it is fresh. A build another cargo holds the lock for
//! waits for it, so do not edit sources while a long test run is under way.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{HarnessError, Service, workspace_root};

/// The path of a workspace binary, built (or confirmed fresh) for the profile the tests run
/// under.
///
/// # Errors
/// When cargo fails to build it.
pub fn workspace_bin(package: &str, bin: &str) -> Result<PathBuf, HarnessError> {
    // Tests run from target/<profile>/deps/<test>-<hash>, binaries (the bench) from
    // target/<profile>/<bin>.
    let exe = std::env::current_exe().map_err(|source| HarnessError::Io {
        path: PathBuf::from("/proc/self/exe"),
        source,
    })?;
    let profile_dir = exe
        .parent()
        .and_then(|d| {
            if d.ends_with("deps") {
                d.parent()
            } else {
                Some(d)
            }
        })
        .ok_or_else(|| HarnessError::Build(format!("unexpected test path {}", exe.display())))?;
    let target_dir = profile_dir
        .parent()
        .ok_or_else(|| HarnessError::Build(format!("unexpected test path {}", exe.display())))?;
    let profile = match profile_dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev",
        Some(other) => other,
    };
    let path = profile_dir.join(bin);
    if is_fresh(&path) {
        return Ok(path);
    }
    let mut args: Vec<std::ffi::OsString> = [
        "build",
        "--quiet",
        "--profile",
        profile,
        // Every binary of the workspace, as `cargo nextest run --workspace` builds them: with the
        // workspace's feature unification, so a stale-looking binary costs a no-op check, never
        // a rebuild of its dependencies with other features (which took minutes under load).
        "--workspace",
        "--bins",
        "--target-dir",
    ]
    .map(Into::into)
    .into();
    args.push(target_dir.into());
    cargo(&args)?;
    if !path.is_file() {
        return Err(HarnessError::Build(format!(
            "package {package} built no binary {}",
            path.display()
        )));
    }
    Ok(path)
}

/// Whether `bin` exists and is newer than every source file and manifest of the workspace.
fn is_fresh(bin: &Path) -> bool {
    let Ok(built) = std::fs::metadata(bin).and_then(|m| m.modified()) else {
        return false;
    };
    let root = workspace_root();
    let mut sources = vec![root.join("Cargo.toml"), root.join("Cargo.lock")];
    if let Ok(entries) = std::fs::read_dir(&root) {
        for e in entries.flatten() {
            let p = e.path();
            if p.join("Cargo.toml").is_file() {
                sources.push(p.join("Cargo.toml"));
                sources.push(p.join("src"));
            }
        }
    }
    // Unreadable or vanished entries are skipped: only a newer file makes the binary stale.
    let newer = |e: walkdir::DirEntry| {
        e.metadata()
            .is_ok_and(|m| !m.is_dir() && m.modified().is_ok_and(|t| t > built))
    };
    !sources
        .iter()
        .flat_map(walkdir::WalkDir::new)
        .filter_map(Result::ok)
        .any(newer)
}

/// Runs the cargo that runs the tests (`$CARGO`) in the workspace root with `args`; its
/// stdout.
///
/// # Errors
/// When cargo cannot start or fails (the error holds its stderr).
pub fn cargo<S: AsRef<std::ffi::OsStr>>(args: &[S]) -> Result<Vec<u8>, HarnessError> {
    let shown: Vec<_> = args.iter().map(|a| a.as_ref().to_string_lossy()).collect();
    let shown = shown.join(" ");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .current_dir(workspace_root())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| HarnessError::Spawn {
            what: format!("cargo {shown}"),
            source,
        })?;
    if !out.status.success() {
        return Err(HarnessError::Cargo {
            args: shown,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(out.stdout)
}

/// A fresh temp dir (named `<prefix>…`) holding `agentbox.toml` with `config`.
fn config_dir(prefix: &str, config: &str) -> Result<(tempfile::TempDir, PathBuf), HarnessError> {
    super::temp_file(prefix, "agentbox.toml", config)
}

deref_to_service!(BridgeProcess, GatewayProcess, LauncherProcess);

/// Our daemon `bin` (package and binary share the name) with `--config config`, in an empty
/// environment but for `RUST_LOG=info`.
fn daemon_cmd(bin: &str, config: &Path) -> Result<Command, HarnessError> {
    let mut cmd = Command::new(workspace_bin(bin, bin)?);
    cmd.arg("--config")
        .arg(config)
        .env_clear()
        .env("RUST_LOG", "info");
    Ok(cmd)
}

/// How long a daemon may take to print its ready line: a hang guard (the launcher checks the
/// host before it listens; the bridge and the gateway are ready well within it).
const READY_TIMEOUT: Duration = Duration::from_secs(60);

/// Starts `cmd` (our daemon `bin`) and waits for its line starting with `ready`; the rest of
/// that line is its address.
fn start_daemon(
    bin: &str,
    cmd: Command,
    ready: &'static str,
) -> Result<(Service, String), HarnessError> {
    Service::start_listening(bin, cmd, READY_TIMEOUT, ready)
}

/// A running `agentbox-bridge` on `127.0.0.1:0` with its own temp config.
#[derive(Debug)]
pub struct BridgeProcess {
    service: Service,
    address: String,
    config: PathBuf,
    env: Vec<(String, String)>,
    // Declared last so the process is gone before its files are removed.
    dir: tempfile::TempDir,
}

impl BridgeProcess {
    /// Starts the bridge with `config` (TOML; `[bridge] listen` is forced to port 0) and the
    /// given environment (the bridge token and provider keys).
    ///
    /// # Errors
    /// When the binary cannot be built or the bridge does not come up.
    pub fn start(config: &str, env: &[(&str, &str)]) -> Result<Self, HarnessError> {
        let (dir, path) = config_dir("bridge-", config)?;
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        let (service, address) = Self::spawn(dir.path(), &path, &env)?;
        Ok(Self {
            service,
            address,
            config: path,
            env,
            dir,
        })
    }

    fn spawn(
        data: &Path,
        config: &Path,
        env: &[(String, String)],
    ) -> Result<(Service, String), HarnessError> {
        let mut cmd = daemon_cmd("agentbox-bridge", config)?;
        cmd.env("AGENTBOX_DATA", data)
            .envs(env.iter().map(|(k, v)| (k, v)));
        start_daemon("agentbox-bridge", cmd, "listening on ")
    }

    /// Kills the bridge with SIGKILL and starts it again on the same address (its config's
    /// `listen` pinned to the port it had), so a gateway configured with it finds it again.
    ///
    /// # Errors
    /// When it does not come back.
    pub fn crash_and_restart(&mut self) -> Result<(), HarnessError> {
        self.service.kill();
        let io = |source| HarnessError::Io {
            path: self.config.clone(),
            source,
        };
        let text = std::fs::read_to_string(&self.config).map_err(io)?;
        let pinned: String = text
            .lines()
            .map(|l| {
                if l.trim_start().starts_with("listen") {
                    format!("listen = \"{}\"\n", self.address)
                } else {
                    format!("{l}\n")
                }
            })
            .collect();
        std::fs::write(&self.config, pinned).map_err(io)?;
        let (service, address) = Self::spawn(self.dir.path(), &self.config, &self.env)?;
        self.service = service;
        self.address = address;
        Ok(())
    }

    /// `http://127.0.0.1:PORT`.
    #[must_use]
    pub fn base_url(&self) -> String {
        format!("http://{}", self.address)
    }
}

/// A running `agentbox-gateway` with its own data dir and config.
#[derive(Debug)]
pub struct GatewayProcess {
    service: Service,
    config: PathBuf,
    env: Vec<(String, String)>,
    /// Run as this uid/gid (the service user) instead of the test's own.
    identity: Option<(u32, u32)>,
    // Declared last so the process is gone before its files are removed.
    dir: tempfile::TempDir,
}

impl GatewayProcess {
    /// Starts the gateway with `config` (TOML) and `env` on a fresh data dir.
    ///
    /// # Errors
    /// When the binary cannot be built or the gateway does not come up.
    pub fn start(config: &str, env: &[(&str, &str)]) -> Result<Self, HarnessError> {
        Self::start_as(config, env, None)
    }

    /// Like [`GatewayProcess::start`], running as `identity` (uid, gid) as in production: the
    /// gateway is the service user, in a data dir laid out as `packaging/tmpfiles.d` lays it
    /// out (root's, with the service user's `state/gateway`, `tasks` and `sockets`), so a
    /// launcher can share it.
    ///
    /// # Errors
    /// When the binary cannot be built or the gateway does not come up.
    pub fn start_as(
        config: &str,
        env: &[(&str, &str)],
        identity: Option<(u32, u32)>,
    ) -> Result<Self, HarnessError> {
        let (dir, path) = config_dir("gateway-", config)?;
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        if let Some((uid, gid)) = identity {
            let io = |source| HarnessError::Io {
                path: dir.path().to_path_buf(),
                source,
            };
            std::fs::set_permissions(
                dir.path(),
                std::os::unix::fs::PermissionsExt::from_mode(0o755),
            )
            .map_err(io)?;
            let data = dir.path().join("data");
            for (sub, owner, mode) in [
                ("", (0, 0), 0o711),
                ("run", (0, gid), 0o1770),
                ("state", (0, 0), 0o711),
                ("state/gateway", (uid, gid), 0o700),
                ("tasks", (uid, gid), 0o711),
                ("sockets", (uid, gid), 0o711),
            ] {
                let path = data.join(sub);
                std::fs::create_dir_all(&path).map_err(io)?;
                std::os::unix::fs::chown(&path, Some(owner.0), Some(owner.1)).map_err(io)?;
                std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(mode))
                    .map_err(io)?;
            }
        }
        let service = Self::spawn(dir.path(), &path, &env, identity)?;
        Ok(Self {
            service,
            config: path,
            env,
            identity,
            dir,
        })
    }

    fn spawn(
        data: &Path,
        config: &Path,
        env: &[(String, String)],
        identity: Option<(u32, u32)>,
    ) -> Result<Service, HarnessError> {
        let mut cmd = daemon_cmd("agentbox-gateway", config)?;
        cmd.env("AGENTBOX_DATA", data.join("data"))
            .envs(env.iter().map(|(k, v)| (k, v)));
        if let Some((uid, gid)) = identity {
            use std::os::unix::process::CommandExt;
            // std clears the supplementary groups when root drops to another uid.
            cmd.uid(uid).gid(gid);
        }
        std::fs::create_dir_all(data.join("data")).map_err(|source| HarnessError::Io {
            path: data.join("data"),
            source,
        })?;
        let (service, _) = start_daemon("agentbox-gateway", cmd, "listening on unix:")?;
        Ok(service)
    }

    /// Stops the gateway (SIGTERM, as systemd would) and starts it again on the same data dir.
    ///
    /// # Errors
    /// When it does not come back.
    pub fn restart(&mut self) -> Result<(), HarnessError> {
        self.service.stop();
        self.service = Self::spawn(self.dir.path(), &self.config, &self.env, self.identity)?;
        Ok(())
    }

    /// Stops the gateway with SIGTERM, giving it `wait` to drain and save (SIGKILL after
    /// that), and starts it again on the same data dir.
    ///
    /// # Errors
    /// When it does not come back.
    pub fn restart_within(&mut self, wait: Duration) -> Result<(), HarnessError> {
        self.service.stop_within(wait);
        self.service = Self::spawn(self.dir.path(), &self.config, &self.env, self.identity)?;
        Ok(())
    }

    /// Kills the gateway with SIGKILL (no chance to save) and starts it again.
    ///
    /// # Errors
    /// When it does not come back.
    pub fn crash_and_restart(&mut self) -> Result<(), HarnessError> {
        self.service.kill();
        self.service = Self::spawn(self.dir.path(), &self.config, &self.env, self.identity)?;
        Ok(())
    }

    /// `$AGENTBOX_DATA`.
    #[must_use]
    pub fn data_dir(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    /// The control socket.
    #[must_use]
    pub fn control_socket(&self) -> PathBuf {
        self.data_dir().join("run/gateway.sock")
    }

    /// The state the gateway last saved: the newest whole record of its two slot files
    /// (`state/gateway/gateway.state.{0,1}`, see `gateway/src/store.rs`), read as the format
    /// says without the gateway's code; `Value::Null` while neither holds one. The checksum is
    /// left to the gateway's own tests: a record whose body parses is taken as whole here.
    #[must_use]
    pub fn saved_state(&self) -> serde_json::Value {
        let dir = self.data_dir().join("state/gateway");
        let mut newest: Option<(u64, serde_json::Value)> = None;
        for name in ["gateway.state.0", "gateway.state.1"] {
            let bytes = std::fs::read(dir.join(name)).unwrap_or_default();
            let Some(nl) = bytes.iter().position(|&b| b == b'\n') else {
                continue;
            };
            let header = String::from_utf8_lossy(&bytes[..nl]);
            let words: Vec<&str> = header.split(' ').collect();
            let [magic, seq, len, _sum] = words[..] else {
                continue;
            };
            let (Ok(seq), Ok(len)) = (seq.parse::<u64>(), len.parse::<usize>()) else {
                continue;
            };
            let Some(body) = bytes[nl + 1..].get(..len) else {
                continue;
            };
            let Ok(state) = serde_json::from_slice(body) else {
                continue;
            };
            if magic == "agentbox-gateway-state" && newest.as_ref().is_none_or(|(s, _)| seq > *s) {
                newest = Some((seq, state));
            }
        }
        newest.map_or(serde_json::Value::Null, |(_, state)| state)
    }

    /// Waits (up to 30 s) until [`Gateway::saved_state`] satisfies `done`, and returns it. A
    /// save's bytes are readable before the save has returned (synced, an older state file
    /// removed): a test that needs those too puts them in `done`.
    ///
    /// # Errors
    /// [`HarnessError::NotSeen`] with the last state read, when `done` never held.
    pub async fn saved_state_when(
        &self,
        what: &str,
        done: impl Fn(&serde_json::Value) -> bool,
    ) -> Result<serde_json::Value, HarnessError> {
        let timeout = Duration::from_secs(30);
        let deadline = std::time::Instant::now() + timeout;
        loop {
            let state = self.saved_state();
            if done(&state) {
                return Ok(state);
            }
            if std::time::Instant::now() >= deadline {
                return Err(HarnessError::NotSeen {
                    what: what.to_owned(),
                    timeout,
                    last: state.to_string(),
                });
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A task's socket.
    #[must_use]
    pub fn task_socket(&self, tid: &str) -> PathBuf {
        self.data_dir().join("sockets").join(tid).join("llm.sock")
    }

    /// The typed client for the control socket.
    #[must_use]
    pub fn client(&self) -> agentbox_api::GatewayClient {
        agentbox_api::GatewayClient::new(self.control_socket())
    }

    /// One request on the control socket; the body is JSON unless empty.
    ///
    /// # Errors
    /// When the exchange fails.
    pub async fn control(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<super::UnixResponse, HarnessError> {
        super::unix_json(&self.control_socket(), method, path, body).await
    }

    /// `GET /tasks/{tid}` on the control socket: the task's view as JSON.
    ///
    /// # Errors
    /// When the exchange fails or the answer is not a 200 with a JSON body.
    pub async fn task(&self, tid: &str) -> Result<serde_json::Value, HarnessError> {
        let what = format!("GET /tasks/{tid}");
        let r = self.control("GET", &format!("/tasks/{tid}"), None).await?;
        if r.status != 200 {
            return Err(HarnessError::Status {
                what,
                status: r.status,
                body: String::from_utf8_lossy(&r.body).into_owned(),
            });
        }
        serde_json::from_slice(&r.body).map_err(|source| HarnessError::Json { what, source })
    }

    /// Opens task `tid` on `model` with `token` and `budget` (a JSON budget object) over the
    /// control socket; the caller judges the response.
    ///
    /// # Errors
    /// When the exchange fails.
    pub async fn open_task(
        &self,
        tid: &str,
        model: &str,
        token: &str,
        budget: serde_json::Value,
    ) -> Result<super::UnixResponse, HarnessError> {
        let body =
            serde_json::json!({"tid": tid, "model": model, "token": token, "budget": budget});
        self.control("POST", "/tasks", Some(&body)).await
    }
}

/// A running `agentbox-launcher` (the caller must be root) on a fresh data dir, with its own
/// cgroup parent (removed again on drop) and a 0755 temp directory the agent and service uids
/// can traverse.
#[derive(Debug)]
pub struct LauncherProcess {
    service: Service,
    data: PathBuf,
    cgroup_parent: String,
    service_uid: u32,
    // Declared last so the process is gone before its files are removed.
    dir: tempfile::TempDir,
}

impl LauncherProcess {
    /// Starts the launcher with `config` (TOML; the wrapper prepends `data_dir`) and
    /// `--service-uid service_uid`.
    ///
    /// # Errors
    /// When the binary cannot be built or the launcher does not come up.
    pub fn start(config: &str, service_uid: u32) -> Result<Self, HarnessError> {
        Self::start_on(None, config, service_uid)
    }

    /// Like [`LauncherProcess::start`], on the data dir `data` (another daemon's, shared as in
    /// production) instead of a fresh one.
    ///
    /// # Errors
    /// When the binary cannot be built or the launcher does not come up.
    pub fn start_on(
        data: Option<&Path>,
        config: &str,
        service_uid: u32,
    ) -> Result<Self, HarnessError> {
        use std::os::unix::fs::PermissionsExt;
        use std::sync::atomic::{AtomicUsize, Ordering};
        static COUNTER: AtomicUsize = AtomicUsize::new(0);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| HarnessError::Io { path, source }
        };
        let (dir, path) = config_dir("launcher-", "")?;
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .map_err(io(dir.path()))?;
        let data = data.map_or_else(|| dir.path().join("data"), Path::to_path_buf);
        // A small agent range (64000-64009), clear of the service uids the tests use.
        let range = if config.contains("agent_uid_count") {
            ""
        } else {
            "agent_uid_count = 10\n"
        };
        std::fs::write(&path, format!("data_dir = {data:?}\n{range}{config}"))
            .map_err(io(&path))?;
        let cgroup_parent = format!(
            "agentbox-harness-{}-{}",
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::SeqCst)
        );
        let mut cmd = daemon_cmd("agentbox-launcher", &path)?;
        cmd.arg("--service-uid")
            .arg(service_uid.to_string())
            .arg("--cgroup-parent")
            .arg(&cgroup_parent)
            .env("PATH", "/usr/local/bin:/usr/bin:/bin");
        let (service, _) = start_daemon("agentbox-launcher", cmd, "listening on unix:")?;
        Ok(Self {
            service,
            data,
            cgroup_parent,
            service_uid,
            dir,
        })
    }

    /// A 0755 directory for the caller's own files (binaries the agent uid must read).
    #[must_use]
    pub fn base(&self) -> &Path {
        self.dir.path()
    }

    /// `$AGENTBOX_DATA`.
    #[must_use]
    pub fn data_dir(&self) -> PathBuf {
        self.data.clone()
    }

    /// `run/launcher.sock`.
    #[must_use]
    pub fn socket(&self) -> PathBuf {
        self.data_dir().join("run/launcher.sock")
    }

    /// The typed client for the launcher's socket (routes that wait are unbounded; raw
    /// exchanges through its `http()`).
    #[must_use]
    pub fn client(&self) -> agentbox_api::LauncherClient {
        agentbox_api::LauncherClient::new(self.socket())
    }

    /// Creates `tasks/<tid>/workspace` (empty, owned by the service uid) and returns it.
    ///
    /// # Errors
    /// When it cannot be created.
    pub fn workspace(&self, tid: &str) -> Result<PathBuf, HarnessError> {
        let task = self.data_dir().join("tasks").join(tid);
        let ws = task.join("workspace");
        std::fs::create_dir_all(&ws).map_err(|source| HarnessError::Io {
            path: ws.clone(),
            source,
        })?;
        for p in [&task, &ws] {
            std::os::unix::fs::chown(p, Some(self.service_uid), Some(self.service_uid)).map_err(
                |source| HarnessError::Io {
                    path: p.clone(),
                    source,
                },
            )?;
        }
        Ok(ws)
    }

    /// Creates `sockets/<tid>/llm.sock`, the gateway socket an agent sandbox requires (nothing
    /// listens on it).
    ///
    /// # Errors
    /// When it cannot be created.
    pub fn gateway_socket(&self, tid: &str) -> Result<(), HarnessError> {
        let dir = self.data_dir().join("sockets").join(tid);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| HarnessError::Io { path, source }
        };
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        std::os::unix::fs::chown(&dir, Some(self.service_uid), Some(self.service_uid))
            .map_err(io(&dir))?;
        let sock = dir.join("llm.sock");
        if !sock.exists() {
            drop(std::os::unix::net::UnixListener::bind(&sock).map_err(io(&sock))?);
        }
        Ok(())
    }
}

impl Drop for LauncherProcess {
    fn drop(&mut self) {
        self.service.stop();
        // The launcher removes its task cgroups; its parent directories stay behind.
        let root = Path::new("/sys/fs/cgroup");
        for dir in ["memory", "pids", "cpu", "freezer", ""].map(|c| root.join(c)) {
            let _ = std::fs::remove_dir(dir.join(&self.cgroup_parent));
        }
    }
}
