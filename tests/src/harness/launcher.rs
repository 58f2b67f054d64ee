//! The launcher's own integration tests (`tests/tests/launcher_*.rs`): a real
//! `agentbox-launcher` process (as root) on a temp data dir with a temp config (repo and venv
//! roots, a scripted stand-in for claude) and its own cgroup parent, restartable and crashable,
//! and blocking calls on its socket through `agentbox-api`'s client.
//!
//! Unlike the rest of the harness these helpers panic on failure: they are assertions of the
//! tests that call them. Timeouts here are hang guards only; no test asserts on elapsed time.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentbox_api::{LauncherClient, UnixClient};
use serde_json::Value;

use super::workspace_bin;

/// The service identity the tests give the launcher with `--service-uid`.
pub const SERVICE_UID: u32 = 64010;
/// The first agent identity (config default); each run gets one of
/// `AGENT_UID..AGENT_UID + AGENT_UID_COUNT`.
pub const AGENT_UID: u32 = 64000;
/// How many agent uids the test launchers have (the range must not reach [`SERVICE_UID`]).
pub const AGENT_UID_COUNT: u32 = 10;

/// A stand-in for the claude binary: runs its first argument as a bash script, so agent
/// lifecycle tests can script what "the agent" does inside the sandbox.
pub const FAKE_CLAUDE: &str = "#!/bin/bash\nexec /bin/bash -c \"$1\"\n";

const HANG_GUARD: Duration = Duration::from_secs(600);

static COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Options for a launcher under test.
#[derive(Debug, Clone)]
pub struct Options {
    pub memory_mb: u64,
    pub pids: u64,
    pub tmp_mb: u64,
    /// `launcher.limits.disk_mb`.
    pub disk_mb: u64,
    pub output_cap_kb: u64,
    pub max_agent_timeout_s: u64,
    pub claude_bin: Option<PathBuf>,
    pub env_allowlist: Vec<String>,
    /// `--backend-start-timeout-s`.
    pub backend_start_timeout_s: u64,
    /// TOML appended to the config (more `[models.*]`).
    pub extra_config: String,
    /// `launcher.blackbox_bin` (rollout slots), with `launcher.clients_dir` the real agent
    /// CLIs of [`super::clients_dir`].
    pub slot_server: Option<PathBuf>,
    /// The first agent uid and gid (`agent_uid`, `agent_gid`): tests that look for processes
    /// by uid give their launcher a range of its own.
    pub agent_uid: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            memory_mb: 256,
            pids: 64,
            tmp_mb: 8,
            disk_mb: 10240,
            output_cap_kb: 64,
            max_agent_timeout_s: 600,
            claude_bin: None,
            env_allowlist: vec!["MAX_THINKING_TOKENS".to_owned()],
            backend_start_timeout_s: 120,
            extra_config: String::new(),
            slot_server: None,
            agent_uid: AGENT_UID,
        }
    }
}

/// A response, its body as JSON (`Null` when it is not JSON).
#[derive(Debug, Clone)]
pub struct Resp {
    pub status: u16,
    pub body: Value,
    /// Status and body as text, for failure messages.
    pub raw: String,
}

impl Resp {
    pub fn code(&self) -> &str {
        self.body["error"]["code"].as_str().unwrap_or("")
    }

    /// The error envelope's message; panics when the body has none.
    pub fn message(&self) -> &str {
        self.body["error"]["message"]
            .as_str()
            .unwrap_or_else(|| panic!("no error message in {}", self.raw))
    }
}

/// A launcher process and its directories.
#[derive(Debug)]
pub struct Launcher {
    pub base: PathBuf,
    pub data: PathBuf,
    pub repos: PathBuf,
    pub venvs: PathBuf,
    pub config: PathBuf,
    pub socket: PathBuf,
    pub cgroup_parent: String,
    pub opts: Options,
    child: Option<Child>,
    stderr: Arc<Mutex<String>>,
    _dir: tempfile::TempDir,
}

/// A fresh temp dir named `<prefix>…` with permission bits `mode` (root's temp dirs are 0700,
/// which the service and agent users could not enter).
pub fn temp_dir(prefix: &str, mode: u32) -> tempfile::TempDir {
    let dir = tempfile::Builder::new().prefix(prefix).tempdir().unwrap();
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(mode)).unwrap();
    dir
}

/// `git -c <each of config> -C dir args` as root (the operator) for test setup and inspection,
/// with no system or global config; panics with git's stderr when it fails. Its stdout,
/// trimmed.
pub fn git_with(dir: &Path, config: &[&str], args: &[&str]) -> String {
    let mut cmd = Command::new("git");
    for c in config {
        cmd.arg("-c").arg(c);
    }
    let out = cmd
        .arg("-C")
        .arg(dir)
        .args(args)
        .env("GIT_CONFIG_NOSYSTEM", "1")
        .env("GIT_CONFIG_GLOBAL", "/dev/null")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "git {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `chown uid:uid` (following symlinks: for paths the test made itself).
pub fn chown(path: &Path, uid: u32) {
    std::os::unix::fs::chown(path, Some(uid), Some(uid)).unwrap();
}

/// `chown -R` without following symlinks.
pub fn chown_tree(path: &Path, uid: u32) {
    let st = Command::new("chown")
        .arg("-R")
        .arg("-h")
        .arg(format!("{uid}:{uid}"))
        .arg(path)
        .status()
        .unwrap();
    assert!(st.success());
}

impl Launcher {
    /// [`Launcher::start`] with the default options changed by `adjust`.
    pub fn start_with(adjust: impl FnOnce(&mut Options)) -> Launcher {
        let mut opts = Options::default();
        adjust(&mut opts);
        Launcher::start(opts)
    }

    /// Starts a launcher with `opts` on a fresh temp dir.
    pub fn start(opts: Options) -> Launcher {
        // The service and agent uids must be able to traverse down to their directories.
        let dir = temp_dir("launcher-it-", 0o755);
        let base = dir.path().to_path_buf();
        let data = base.join("data");
        let repos = base.join("repos");
        let venvs = base.join("venvs");
        for d in [&repos, &venvs] {
            std::fs::create_dir_all(d).unwrap();
        }
        chown(&repos, SERVICE_UID);
        let claude = match &opts.claude_bin {
            Some(p) => p.clone(),
            None => {
                let p = base.join("fake-claude");
                std::fs::write(&p, FAKE_CLAUDE).unwrap();
                std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
                p
            }
        };
        let n = COUNTER.fetch_add(1, Ordering::SeqCst);
        let cgroup_parent = format!("agentbox-it-{}-{n}", std::process::id());
        let allow: Vec<String> = opts
            .env_allowlist
            .iter()
            .map(|k| format!("{k:?}"))
            .collect();
        let slots = match &opts.slot_server {
            Some(bin) => format!(
                "blackbox_bin = {bin:?}\nclients_dir = {:?}\n",
                super::clients_dir().unwrap()
            ),
            None => String::new(),
        };
        let config = base.join("agentbox.toml");
        std::fs::write(
            &config,
            format!(
                "data_dir = {data:?}\nservice_user = \"nobody-here\"\nagent_uid_count = {AGENT_UID_COUNT}\n\
                 agent_uid = {uid}\nagent_gid = {uid}\n\
                 [launcher]\nrepo_roots = [{repos:?}]\nvenv_root = {venvs:?}\nclaude_bin = {claude:?}\n\
                 env_allowlist = [{allow}]\n{slots}\
                 [launcher.limits]\nmemory_mb = {mem}\npids = {pids}\ncpus = 1\ntmp_mb = {tmp}\nhome_mb = 8\ndisk_mb = {disk}\n\
                 max_agent_timeout_s = {maxt}\nmax_check_timeout_s = 600\noutput_cap_kb = {cap}\n\
                 [models.m1]\nbackend = \"ollama\"\nupstream_model = \"x\"\n{extra}",
                allow = allow.join(", "),
                uid = opts.agent_uid,
                mem = opts.memory_mb,
                pids = opts.pids,
                tmp = opts.tmp_mb,
                disk = opts.disk_mb,
                maxt = opts.max_agent_timeout_s,
                cap = opts.output_cap_kb,
                extra = opts.extra_config,
            ),
        )
        .unwrap();
        let mut l = Launcher {
            socket: data.join("run/launcher.sock"),
            base,
            data,
            repos,
            venvs,
            config,
            cgroup_parent,
            opts,
            child: None,
            stderr: Arc::new(Mutex::new(String::new())),
            _dir: dir,
        };
        l.spawn();
        l
    }

    /// Starts (or restarts) the launcher process.
    pub fn spawn(&mut self) {
        let bin = workspace_bin("agentbox-launcher", "agentbox-launcher").unwrap();
        let mut child = Command::new(bin)
            .arg("--config")
            .arg(&self.config)
            .arg("--service-uid")
            .arg(SERVICE_UID.to_string())
            .arg("--cgroup-parent")
            .arg(&self.cgroup_parent)
            .arg("--backend-start-timeout-s")
            .arg(self.opts.backend_start_timeout_s.to_string())
            .env("RUST_LOG", "info")
            .env_remove("AGENTBOX_DATA")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let buf = Arc::clone(&self.stderr);
        std::thread::spawn(move || {
            let mut r = BufReader::new(stderr);
            let mut line = String::new();
            while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                buf.lock().unwrap().push_str(&line);
                line.clear();
            }
        });
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut r = BufReader::new(stdout);
            let mut line = String::new();
            while r.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
                if line.starts_with("listening on unix:") {
                    let _ = tx.send(line.trim().to_owned());
                }
                line.clear();
            }
        });
        let ready = rx.recv_timeout(Duration::from_secs(60));
        assert!(ready.is_ok(), "launcher did not start:\n{}", self.stderr());
        assert_eq!(
            ready.unwrap(),
            format!("listening on unix:{}", self.socket.display())
        );
        self.child = Some(child);
    }

    /// Its stderr (the logs) over every start so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The running process's pid.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().unwrap().id()
    }

    /// SIGTERM and wait; returns the exit status code.
    pub fn stop(&mut self) -> Option<i32> {
        let mut child = self.child.take()?;
        let pid = rustix::process::Pid::from_raw(i32::try_from(child.id()).unwrap()).unwrap();
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        for _ in 0..6000 {
            if let Ok(Some(st)) = child.try_wait() {
                return st.code();
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        panic!("launcher did not stop on SIGTERM:\n{}", self.stderr());
    }

    /// SIGKILL, as if the launcher crashed.
    pub fn crash(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The typed client for this launcher (async; for the blocking calls use [`request`]).
    ///
    /// [`request`]: Launcher::request
    pub fn client(&self) -> LauncherClient {
        LauncherClient::over(UnixClient::new(&self.socket).with_timeout(Some(HANG_GUARD)))
    }

    /// One blocking JSON exchange on the socket.
    pub fn request(&self, method: &str, path: &str, body: Option<&Value>) -> Resp {
        request(&self.socket, method, path, body)
    }

    /// `POST path` with `body`.
    pub fn post(&self, path: &str, body: &Value) -> Resp {
        self.request("POST", path, Some(body))
    }

    /// `GET path`.
    pub fn get(&self, path: &str) -> Resp {
        self.request("GET", path, None)
    }

    /// Creates `tasks/<tid>/workspace` owned by the service uid, and returns it.
    pub fn workspace(&self, tid: &str) -> PathBuf {
        let task = self.data.join("tasks").join(tid);
        let ws = task.join("workspace");
        std::fs::create_dir_all(&ws).unwrap();
        chown(&task, SERVICE_UID);
        chown(&ws, SERVICE_UID);
        ws
    }

    /// Creates `sockets/<tid>/llm.sock` (a listening unix socket the agent may connect to);
    /// keep the returned listener alive for as long as the socket should accept.
    pub fn gateway_socket(&self, tid: &str) -> std::os::unix::net::UnixListener {
        let dir = self.data.join("sockets").join(tid);
        std::fs::create_dir_all(&dir).unwrap();
        chown(&dir, SERVICE_UID);
        let sock = dir.join("llm.sock");
        let _ = std::fs::remove_file(&sock);
        let l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o666)).unwrap();
        l
    }

    /// What an agent run needs before it starts: its [`Launcher::workspace`] and its
    /// [`Launcher::gateway_socket`] (keep the listener alive).
    pub fn prepare_task(&self, tid: &str) -> (PathBuf, std::os::unix::net::UnixListener) {
        (self.workspace(tid), self.gateway_socket(tid))
    }

    /// `POST /agents` for `tid` with model `m1`, `timeout_s` 300 and the fields of `body` (an
    /// object: at least `cmd`), asserting it started; its answer.
    pub fn start_agent(&self, tid: &str, body: Value) -> Value {
        let mut req = serde_json::json!({"tid": tid, "model": "m1", "timeout_s": 300});
        if let (Some(req), Value::Object(fields)) = (req.as_object_mut(), body) {
            req.extend(fields);
        }
        let r = self.post("/agents", &req);
        assert_eq!(r.status, 201, "{}\n{}", r.raw, self.stderr());
        r.body
    }

    /// `GET /agents/{tid}?wait=1`: the agent's final status.
    pub fn wait_agent(&self, tid: &str) -> Value {
        let r = self.get(&format!("/agents/{tid}?wait=1"));
        assert_eq!(r.status, 200, "{}", r.raw);
        r.body
    }

    /// An agent run from start to end in a fresh [`Launcher::prepare_task`]: started with
    /// [`Launcher::start_agent`], its final status.
    pub fn run_agent(&self, tid: &str, body: Value) -> Value {
        let _task = self.prepare_task(tid);
        self.start_agent(tid, body);
        self.wait_agent(tid)
    }

    /// `venvs/<name>`, a venv whose `bin/python` is the host's python3; returns its path.
    pub fn venv(&self, name: &str) -> PathBuf {
        let venv = self.venvs.join(name);
        std::fs::create_dir_all(venv.join("bin")).unwrap();
        std::os::unix::fs::symlink("/usr/bin/python3", venv.join("bin/python")).unwrap();
        venv
    }

    /// Runs a check to completion and returns its result.
    pub fn check(&self, tid: &str, command: &str) -> Resp {
        self.post(
            "/checks",
            &serde_json::json!({"tid": tid, "command": command, "timeout_s": 300}),
        )
    }

    /// A check in a fresh workspace named after `tid`, asserting it was accepted.
    pub fn probe(&self, tid: &str, command: &str) -> Value {
        self.workspace(tid);
        let r = self.check(tid, command);
        assert_eq!(r.status, 200, "{}\n{}", r.raw, self.stderr());
        r.body
    }

    /// Every task cgroup directory of this launcher, over all hierarchies (its spares
    /// excepted, checked to hold no process).
    pub fn cgroup_dirs(&self) -> Vec<PathBuf> {
        let mut v = Vec::new();
        for ctrl in ["memory", "pids", "cpu", "freezer"] {
            let p = Path::new("/sys/fs/cgroup")
                .join(ctrl)
                .join(&self.cgroup_parent);
            if p.is_dir() {
                for e in std::fs::read_dir(&p).unwrap().flatten() {
                    if !e.file_type().unwrap().is_dir() {
                        continue;
                    }
                    // The launcher's spares are made ahead and belong to no run; they must
                    // hold no process.
                    if e.file_name().to_string_lossy().starts_with("spare.") {
                        let procs = std::fs::read_to_string(e.path().join("cgroup.procs"))
                            .unwrap_or_default();
                        assert!(procs.trim().is_empty(), "a spare cgroup holds {procs:?}");
                        continue;
                    }
                    v.push(e.path());
                }
            }
        }
        v
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        if self.child.is_some() {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.stop()));
        }
        for ctrl in ["memory", "pids", "cpu", "freezer"] {
            let p = Path::new("/sys/fs/cgroup")
                .join(ctrl)
                .join(&self.cgroup_parent);
            if let Ok(entries) = std::fs::read_dir(&p) {
                for e in entries.flatten() {
                    let _ = std::fs::remove_dir(e.path());
                }
            }
            let _ = std::fs::remove_dir(&p);
        }
    }
}

/// One blocking JSON exchange over the unix socket at `socket`, on a runtime of its own (the
/// launcher tests are synchronous and call this from several threads at once).
pub fn request(socket: &Path, method: &str, path: &str, body: Option<&Value>) -> Resp {
    let body = body.map(|b| b.to_string()).unwrap_or_default();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let r = rt
        .block_on(UnixClient::new(socket).with_timeout(Some(HANG_GUARD)).raw(
            method,
            path,
            &[("content-type", "application/json")],
            body,
        ))
        .unwrap_or_else(|e| panic!("{method} {path}: {e}"));
    let text = String::from_utf8_lossy(&r.body).into_owned();
    Resp {
        status: r.status,
        body: serde_json::from_str(&text).unwrap_or(Value::Null),
        raw: format!("{} {text}", r.status),
    }
}

/// Polls `f` until it returns `Some`, up to a generous hang guard.
pub fn eventually<T>(what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    for _ in 0..12_000 {
        if let Some(v) = f() {
            return v;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    panic!("never happened: {what}");
}

/// Live processes whose command line starts with `prefix` (argv joined by spaces), e.g.
/// `sleep 123` matches the sleep itself but not the shell or bwrap that mention it.
pub fn processes_with(prefix: &str) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.starts_with(prefix) {
            let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
            if stat
                .rsplit_once(") ")
                .is_some_and(|(_, r)| r.starts_with('Z'))
            {
                continue;
            }
            out.push(format!("{}: {cmd}", e.file_name().to_string_lossy()));
        }
    }
    out
}

/// Every process on the host whose command line (argv joined by spaces) contains `needle`
/// (this test process excepted), as `pid: cmdline`.
pub fn cmdlines_containing(needle: &str) -> Vec<String> {
    let me = std::process::id().to_string();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if e.file_name().to_string_lossy() == me {
            continue;
        }
        let Ok(cmd) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
        if cmd.contains(needle) {
            out.push(format!("{}: {cmd}", e.file_name().to_string_lossy()));
        }
    }
    out
}

/// The owner uid of `p` itself (not following a symlink).
pub fn owner_of(p: &Path) -> u32 {
    use std::os::unix::fs::MetadataExt;
    std::fs::symlink_metadata(p).unwrap().uid()
}

/// The `fakellm` binary of this workspace, built for the profile the tests run under.
pub fn fakellm_bin() -> PathBuf {
    workspace_bin("agentbox-tests", "fakellm").unwrap()
}

/// A TCP port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
