//! What every backend does with its agent CLI, written once: the runtime directory's files, an
//! environment without inherited credentials, the CLI spawned as the leader of its own process
//! group with its output copied to capped logs, a JSON-lines stream read with the offending
//! line quoted when it is not JSON, one-process-per-turn agents (Claude Code, Codex) run to
//! their end, long-running agents (opencode, OpenClaw) started, probed and stopped, and the
//! termination of a group together with what left it. A backend keeps only what is its own:
//! its config, its argv, and how its answer becomes chat messages.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use agentbox_sandbox::proc::{self, ChildSetup};
use rustix::process::Signal;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};
use tokio_util::task::TaskTracker;

use futures_util::future::BoxFuture;

use super::{Backend, BackendError, InitContext, TurnInput};
use crate::model::{
    AdapterResponse, BackendCapabilities, Message, Object, Role, RuntimeSystemPrompt,
};
use crate::proxy::LlmProxy;

/// The most of each of an agent's output streams kept in its log.
const LOG_CAP: u64 = 64 << 20;

/// The longest JSON line read (a tool result may carry a large file).
const MAX_LINE: u64 = 100 << 20;

/// The most of an agent's HTTP answer that is read (opencode's history comes back whole).
const ANSWER_CAP: usize = 64 << 20;

/// How much of an offending line or a log tail an error quotes.
pub(crate) const QUOTE: usize = 1000;

/// How long a process group gets between SIGTERM and SIGKILL.
pub(crate) const TERM_GRACE: Duration = Duration::from_secs(3);

/// The capabilities of every backend here: one user message per turn, a register-time system
/// prompt, pause/resume through the proxy.
pub const SINGLE_USER_MESSAGE: BackendCapabilities = BackendCapabilities {
    chat: true,
    abort: true,
    pause_resume: true,
    stream: false,
    multi_message_input: false,
    system_message: true,
    history_injection: false,
};

/// A backend as its module writes it (plain `async fn`s); [`Backend`] follows for every one.
pub(crate) trait Agent: Send + Sync + std::fmt::Debug {
    /// Starts the agent and waits until it is healthy (what it started is stopped on error).
    fn start(&self, ctx: &InitContext) -> impl Future<Output = Result<(), BackendError>> + Send;
    /// Runs one turn to its end.
    fn turn(
        &self,
        turn: TurnInput<'_>,
    ) -> impl Future<Output = Result<AdapterResponse, BackendError>> + Send;
    /// The agent's own session id, once it has one.
    fn session_id(&self) -> Option<String>;
}

/// How an agent is interrupted, probed and stopped: its own for a long-running agent
/// (opencode, OpenClaw), its turn process's for every [`PerTurn`] one.
pub(crate) trait Lifecycle: Send + Sync {
    /// Stops the agent's current work; whether there was some.
    fn abort(&self) -> impl Future<Output = bool> + Send;
    /// Whether the agent is alive and answering.
    fn healthy(&self) -> impl Future<Output = bool> + Send;
    /// Stops the agent and everything it started, within about `grace`.
    fn stop(&self, grace: Duration) -> impl Future<Output = ()> + Send;
}

/// The options of an agent that runs one process per turn (Claude Code, Codex): what makes a
/// [`PerTurn`] backend of them.
pub(crate) trait TurnOptions: Send + Sync {
    /// How its files, logs and errors name it.
    const CLI: Cli;
    /// Everything a turn needs, fixed at start.
    type Setup: Send;
}

/// An agent that runs one process per turn (Claude Code, Codex), over its options: aborting
/// ends the turn's process, health is its [`TurnProcess::healthy`], and stopping also waits
/// for its logs. A backend adds only its own start and turn (its [`Agent`]).
#[derive(Debug)]
pub(crate) struct PerTurn<O: TurnOptions> {
    /// The checked `backend_options`.
    pub(crate) options: O,
    /// Set at start.
    pub(crate) setup: Mutex<Option<O::Setup>>,
    /// The running turn's process.
    pub(crate) process: TurnProcess,
    /// The agent's own session id, once a turn gave it one (each backend says when).
    pub(crate) session: Mutex<Option<String>>,
}

impl<O: TurnOptions> PerTurn<O> {
    /// A backend for checked `options` (nothing starts until `initialize`).
    pub(crate) fn new(options: O) -> Self {
        PerTurn {
            options,
            setup: Mutex::new(None),
            process: TurnProcess::default(),
            session: Mutex::new(None),
        }
    }
}

impl<O: TurnOptions> Lifecycle for PerTurn<O> {
    async fn abort(&self) -> bool {
        self.process.end(O::CLI.name).await
    }

    async fn healthy(&self) -> bool {
        self.process.healthy()
    }

    async fn stop(&self, _grace: Duration) {
        self.process.close(O::CLI.name).await;
    }
}

impl<T: Agent + Lifecycle> Backend for T {
    fn capabilities(&self) -> BackendCapabilities {
        SINGLE_USER_MESSAGE
    }

    fn initialize<'a>(&'a self, ctx: &'a InitContext) -> BoxFuture<'a, Result<(), BackendError>> {
        Box::pin(async move {
            let started = self.start(ctx).await;
            if started.is_err() {
                self.stop(Duration::from_secs(5)).await;
            }
            started
        })
    }

    fn send_message<'a>(
        &'a self,
        turn: TurnInput<'a>,
    ) -> BoxFuture<'a, Result<AdapterResponse, BackendError>> {
        Box::pin(self.turn(turn))
    }

    fn abort_session(&self) -> BoxFuture<'_, bool> {
        Box::pin(self.abort())
    }

    fn health(&self) -> BoxFuture<'_, bool> {
        Box::pin(self.healthy())
    }

    fn backend_session_id(&self) -> Option<String> {
        Agent::session_id(self)
    }

    fn shutdown(&self, grace: Duration) -> BoxFuture<'_, ()> {
        Box::pin(self.stop(grace))
    }
}

pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What `initialize` left in `slot`, or the error of a backend used before it.
pub(crate) fn started<T: Clone>(slot: &Mutex<Option<T>>, who: &str) -> Result<T, BackendError> {
    lock(slot)
        .clone()
        .ok_or_else(|| BackendError::Process(format!("{who} has not been started.")))
}

/// `backend_options` read as `T`: an error names the backend and the offending key's path.
pub(crate) fn parse_options<T: serde::de::DeserializeOwned>(
    raw: &Object,
    who: &str,
) -> Result<T, BackendError> {
    serde_path_to_error::deserialize(Value::Object(raw.clone())).map_err(|e| {
        let path = e.path().to_string();
        invalid_options(who, &format!("{path}: {}", e.into_inner()))
    })
}

/// `Invalid <who> backend_options: <why>`.
pub(crate) fn invalid_options(who: &str, why: &str) -> BackendError {
    BackendError::InvalidOptions(format!("Invalid {who} backend_options: {why}"))
}

/// The HTTP client for an agent's server: a turn's request is silent until the agent loop
/// ends, so only the server's own turn deadline bounds it.
pub(crate) fn http_client() -> Result<reqwest::Client, BackendError> {
    agentbox_llm::client::Upstream::new(&agentbox_llm::client::ClientOptions {
        connect_timeout: Duration::from_secs(5),
        read_timeout: Duration::from_secs(7 * 24 * 3600),
        pool_idle_timeout: Duration::from_secs(60),
        tcp_nodelay: true,
        unix_socket: None,
    })
    .map(|u| u.client().clone())
    .map_err(|e| BackendError::Process(e.to_string()))
}

pub(crate) fn io_err(what: &str, path: &Path, e: &std::io::Error) -> BackendError {
    BackendError::Process(format!("{what} {}: {e}", path.display()))
}

/// The first `max` characters of `s`, marked when cut.
pub(crate) fn quote(s: &str, max: usize) -> String {
    let mut out: String = s.chars().take(max).collect();
    if out.len() < s.len() {
        out.push_str("...(truncated)");
    }
    out
}

/// `v` as text: a string as it is, anything else as JSON.
pub(crate) fn value_text(v: &Value) -> String {
    v.as_str().map_or_else(|| v.to_string(), str::to_owned)
}

/// The last `max` bytes of a log, as text (`None` when empty or unreadable).
pub(crate) async fn tail(path: &Path, max: usize) -> Option<String> {
    let data = tokio::fs::read(path).await.ok()?;
    let start = data.len().saturating_sub(max);
    let text = String::from_utf8_lossy(data.get(start..).unwrap_or(&[]))
        .trim()
        .to_owned();
    (!text.is_empty()).then_some(text)
}

/// `name` as a runnable file: a path as given, else the first hit on `PATH`.
pub(crate) fn resolve_executable(name: &str) -> Option<PathBuf> {
    let runnable = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| {
            use std::os::unix::fs::PermissionsExt;
            m.is_file() && m.permissions().mode() & 0o111 != 0
        })
    };
    if name.contains('/') {
        let p = PathBuf::from(name);
        return runnable(&p).then_some(p);
    }
    std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join(name))
            .find(|p| runnable(p))
    })
}

/// Creates every directory in `dirs`.
pub(crate) async fn create_dirs(dirs: &[PathBuf]) -> Result<(), BackendError> {
    for d in dirs {
        tokio::fs::create_dir_all(d)
            .await
            .map_err(|e| io_err("cannot create", d, &e))?;
    }
    Ok(())
}

/// Writes each `(name, text)` into `dir`.
pub(crate) async fn write_files(dir: &Path, files: &[(&str, String)]) -> Result<(), BackendError> {
    for (name, text) in files {
        let p = dir.join(name);
        tokio::fs::write(&p, text)
            .await
            .map_err(|e| io_err("cannot write", &p, &e))?;
    }
    Ok(())
}

/// Copies the registration's system prompt to its runtime file; its text.
pub(crate) async fn install_system_prompt(
    prompt: Option<&RuntimeSystemPrompt>,
) -> Result<Option<String>, BackendError> {
    let Some(prompt) = prompt else {
        return Ok(None);
    };
    let text = tokio::fs::read_to_string(&prompt.source_file)
        .await
        .map_err(|e| io_err("cannot read", Path::new(&prompt.source_file), &e))?;
    let target = PathBuf::from(&prompt.runtime_file);
    if let Some(parent) = target.parent() {
        tokio::fs::create_dir_all(parent)
            .await
            .map_err(|e| io_err("cannot create", parent, &e))?;
    }
    tokio::fs::write(&target, &text)
        .await
        .map_err(|e| io_err("cannot write", &target, &e))?;
    Ok(Some(text))
}

/// Removes from `cmd`'s environment every inherited variable whose name starts with one of
/// `prefixes` (another account's credentials, endpoints or state directories).
pub(crate) fn strip_inherited(cmd: &mut Command, prefixes: &[&str]) {
    for (k, _) in std::env::vars_os() {
        if let Some(k) = k.to_str()
            && prefixes.iter().any(|p| k.starts_with(p))
        {
            cmd.env_remove(k);
        }
    }
}

/// The one user message's text a turn of a one-prompt agent takes.
///
/// # Errors
/// Not exactly one message, not a user's, or empty.
pub(crate) fn single_prompt<'a>(
    messages: &'a [Message],
    who: &str,
) -> Result<&'a str, BackendError> {
    let [message] = messages else {
        return Err(BackendError::Protocol(format!(
            "{who} adapter expects exactly one input message."
        )));
    };
    if message.role != Role::User {
        return Err(BackendError::Protocol(format!(
            "{who} adapter only accepts a user message."
        )));
    }
    message
        .content
        .as_deref()
        .filter(|c| !c.trim().is_empty())
        .ok_or_else(|| {
            BackendError::Protocol(format!("{who} adapter requires non-empty user content."))
        })
}

/// Opens (appending) a log file.
async fn open_log(path: &Path) -> Result<tokio::fs::File, BackendError> {
    tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .await
        .map_err(|e| io_err("cannot open", path, &e))
}

/// An agent CLI, as its files, logs and errors name it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Cli {
    /// File names (`logs/<name>.stderr.log`, `run/<name>.pid`) and messages.
    pub name: &'static str,
    /// How the operator calls it (`claude code binary not found`).
    pub label: &'static str,
    /// What to do when it is missing (`Set CODEX_BIN or install Codex CLI.`).
    pub hint: &'static str,
}

/// A spawned agent: the leader of its own process group, stderr already copied to its log.
#[derive(Debug)]
pub(crate) struct Spawned {
    pub child: Child,
    pub pgid: Option<u32>,
    pub stdout: Option<ChildStdout>,
    pub stderr_log: PathBuf,
    pub stdout_log: PathBuf,
}

impl Cli {
    /// `bin` resolved, or the clear error a registration answers.
    pub fn require(&self, bin: &str) -> Result<PathBuf, BackendError> {
        resolve_executable(bin).ok_or_else(|| {
            BackendError::Process(format!(
                "{} binary not found. {} ({bin})",
                self.label, self.hint
            ))
        })
    }

    /// Spawns `cmd` (its stdin as the caller set it) in a new session under `runtime_dir`:
    /// its pid in `run/<name>.pid`, stderr appended to `logs/<name>.stderr.log` (capped) by a
    /// task of `logs`, stdout piped for the caller.
    pub async fn spawn(
        &self,
        mut cmd: Command,
        runtime_dir: &Path,
        logs: &TaskTracker,
    ) -> Result<Spawned, BackendError> {
        cmd.stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(true);
        let bin = cmd.as_std().get_program().to_string_lossy().into_owned();
        let mut child = ChildSetup::same_identity()
            .new_session()
            .spawn(cmd)
            .map_err(|e| {
                BackendError::Process(format!(
                    "{} could not be started. {} ({bin}: {e})",
                    self.label, self.hint
                ))
            })?;
        let pgid = child.id();
        if let Some(pid) = pgid {
            let p = runtime_dir.join("run").join(format!("{}.pid", self.name));
            if let Err(e) = tokio::fs::write(&p, pid.to_string()).await {
                tracing::warn!(error = %e, "cannot write {}", p.display());
            }
        }
        let log_dir = runtime_dir.join("logs");
        let stderr_log = log_dir.join(format!("{}.stderr.log", self.name));
        if let Some(err) = child.stderr.take() {
            let file = open_log(&stderr_log).await?;
            logs.spawn(proc::capture(err, file, Some(LOG_CAP)));
        }
        Ok(Spawned {
            stdout: child.stdout.take(),
            child,
            pgid,
            stderr_log,
            stdout_log: log_dir.join(format!("{}.stdout.log", self.name)),
        })
    }

    /// Leaves a task of `logs` copying what is left of `stdout` to its log.
    pub fn copy_rest(reader: BufReader<ChildStdout>, log: tokio::fs::File, logs: &TaskTracker) {
        logs.spawn(proc::capture(reader.into_inner(), log, Some(LOG_CAP)));
    }
}

/// An agent's stdout read line by line, each line also copied to its log.
#[derive(Debug)]
pub(crate) struct Lines {
    reader: BufReader<ChildStdout>,
    log: tokio::fs::File,
    name: &'static str,
}

impl Lines {
    /// Reads `spawned`'s stdout.
    pub async fn open(cli: &Cli, spawned: &mut Spawned) -> Result<Lines, BackendError> {
        let stdout = spawned
            .stdout
            .take()
            .ok_or_else(|| BackendError::Process(format!("{} has no stdout", cli.name)))?;
        Ok(Lines {
            reader: BufReader::new(stdout),
            log: open_log(&spawned.stdout_log).await?,
            name: cli.name,
        })
    }

    /// The next line (with its newline; `None` at the end); a line over the limit is an error
    /// quoting its start.
    pub async fn next_line(&mut self) -> Result<Option<Vec<u8>>, BackendError> {
        let mut line = Vec::new();
        let n = (&mut self.reader)
            .take(MAX_LINE + 1)
            .read_until(b'\n', &mut line)
            .await
            .map_err(|e| BackendError::Transport(format!("reading {}'s output: {e}", self.name)))?;
        if n == 0 {
            let _ = self.log.flush().await;
            return Ok(None);
        }
        let _ = self.log.write_all(&line).await;
        if n as u64 > MAX_LINE {
            let _ = self.log.flush().await;
            return Err(self.bad("a line over the size limit", &line));
        }
        Ok(Some(line))
    }

    /// The next JSON object on the stream (blank lines skipped; `None` at its end).
    ///
    /// # Errors
    /// A line that is not a JSON object: a protocol error quoting it, truncated.
    pub async fn next_object(&mut self) -> Result<Option<Value>, BackendError> {
        loop {
            let Some(line) = self.next_line().await? else {
                return Ok(None);
            };
            let text = String::from_utf8_lossy(&line);
            if text.trim().is_empty() {
                continue;
            }
            return match serde_json::from_str::<Value>(text.trim()) {
                Ok(v @ Value::Object(_)) => Ok(Some(v)),
                Ok(_) | Err(_) => {
                    let _ = self.log.flush().await;
                    Err(self.bad("a line that is not a JSON object", &line))
                }
            };
        }
    }

    fn bad(&self, why: &str, line: &[u8]) -> BackendError {
        let text = String::from_utf8_lossy(line);
        BackendError::Protocol(format!(
            "{} printed {why} on its JSON output: {:?}",
            self.name,
            quote(text.trim(), QUOTE)
        ))
    }

    /// Hands the rest of the stream to a copying task.
    pub fn copy_rest(self, logs: &TaskTracker) {
        Cli::copy_rest(self.reader, self.log, logs);
    }
}

/// Whether process group `pgid` still has a member.
fn group_alive(pgid: u32) -> bool {
    i32::try_from(pgid)
        .ok()
        .and_then(rustix::process::Pid::from_raw)
        .is_some_and(|p| rustix::process::test_kill_process_group(p).is_ok())
}

/// Ends process group `pgid`: SIGTERM, up to `grace` for it to go, then SIGKILL to what is
/// left and to `tree` (descendants found earlier that left the group: tool runners).
async fn end_group(pgid: u32, tree: &[u32], grace: Duration, who: &str) {
    if let Err(e) = proc::signal_group(pgid, Signal::TERM) {
        tracing::warn!(pgid, error = %e, "cannot signal {who}'s group");
    }
    let deadline = tokio::time::Instant::now() + grace;
    while group_alive(pgid) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    kill_leftovers(Some(pgid), tree, who);
}

/// The process of the turn in flight, for agents that run one process per turn: published
/// while it runs so abort and shutdown can end it, and a record of whether one was killed
/// behind our back (the agent is not trustworthy any more; health says so).
#[derive(Debug, Default)]
pub(crate) struct TurnProcess {
    /// The binary every turn runs, once initialize chose it.
    bin: Mutex<Option<String>>,
    active: Mutex<Option<u32>>,
    killed: AtomicBool,
    /// The tasks copying the processes' output.
    logs: TaskTracker,
}

/// How a turn's process ended, when it did not succeed.
#[derive(Debug)]
pub(crate) struct Exit {
    /// Its exit code (`None`: a signal).
    pub code: Option<i32>,
    /// The stderr log's tail.
    pub stderr: Option<String>,
    /// The stdout log's tail.
    pub stdout: Option<String>,
}

impl TurnProcess {
    /// Ends the running process's group and what left it; whether there was one.
    pub async fn end(&self, who: &str) -> bool {
        let Some(pgid) = lock(&self.active).take() else {
            return false;
        };
        let tree = proc::descendants(pgid);
        end_group(pgid, &tree, TERM_GRACE, who).await;
        true
    }

    /// Ends the running process and waits for its output to be copied (shutdown).
    pub async fn close(&self, who: &str) {
        self.end(who).await;
        close_logs(&self.logs, who).await;
    }

    /// Records the binary the turns run (at initialize).
    pub fn set_bin(&self, bin: &str) {
        *lock(&self.bin) = Some(bin.to_owned());
    }

    /// Whether the agent can run a turn: its binary (set once initialized) is runnable and no
    /// turn's process died of a signal we did not send.
    pub fn healthy(&self) -> bool {
        !self.killed.load(Ordering::SeqCst)
            && lock(&self.bin)
                .as_deref()
                .is_some_and(|b| resolve_executable(b).is_some())
    }

    /// Runs `cmd` to its end (`stdin` written then closed, else `/dev/null`), reading its
    /// stdout as JSON lines; `on_event` sees each event as it arrives. The events, or why the
    /// turn failed: a non-JSON line (quoted; the group is ended), a signal, or a non-zero exit
    /// (`explain` turns it into a message).
    pub async fn run<F, Fut>(
        &self,
        cli: &Cli,
        mut cmd: Command,
        runtime_dir: &Path,
        stdin: Option<&[u8]>,
        mut on_event: F,
        explain: impl FnOnce(&[Value], Exit) -> String,
    ) -> Result<Vec<Value>, BackendError>
    where
        F: FnMut(&Value) -> Fut,
        Fut: Future<Output = ()>,
    {
        cmd.stdin(if stdin.is_some() {
            std::process::Stdio::piped()
        } else {
            std::process::Stdio::null()
        });
        let mut spawned = cli.spawn(cmd, runtime_dir, &self.logs).await?;
        let mut published = Published::new(&self.active, spawned.pgid, cli.name);
        if let (Some(mut pipe), Some(bytes)) = (spawned.child.stdin.take(), stdin) {
            // The prompt goes on stdin: no argv limit, and no text taken for an option.
            if let Err(e) = pipe.write_all(bytes).await {
                tracing::warn!(error = %e, "cannot write the prompt to {}", cli.name);
            }
        }
        let mut lines = Lines::open(cli, &mut spawned).await?;
        let mut events = Vec::new();
        let bad = loop {
            match lines.next_object().await {
                Ok(Some(event)) => {
                    on_event(&event).await;
                    events.push(event);
                }
                Ok(None) => break None,
                Err(e) => break Some(e),
            }
        };
        if let Some(e) = bad {
            self.end(cli.name).await;
            let _ = spawned.child.wait().await;
            published.reaped = true;
            return Err(e);
        }
        let status = spawned
            .child
            .wait()
            .await
            .map_err(|e| BackendError::Process(format!("cannot wait for {}: {e}", cli.name)))?;
        published.reaped = true;
        // Taken out of the slot: someone on our side ended it.
        let ended_by_us = *lock(&self.active) != spawned.pgid;
        // Whatever it left in its group (a backgrounded tool) goes with it.
        kill_leftovers(spawned.pgid, &[], cli.name);
        if ended_by_us {
            return Err(BackendError::Transport(format!(
                "{} turn was aborted.",
                cli.name
            )));
        }
        if let Some(sig) = std::os::unix::process::ExitStatusExt::signal(&status) {
            self.killed.store(true, Ordering::SeqCst);
            return Err(BackendError::Process(format!(
                "{} was killed by signal {sig}",
                cli.name
            )));
        }
        let code = proc::exit_code(status);
        if code == Some(0) {
            return Ok(events);
        }
        // Let the stderr copy catch up before quoting it.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let exit = Exit {
            code,
            stderr: tail(&spawned.stderr_log, 2000).await,
            stdout: tail(&spawned.stdout_log, 2000).await,
        };
        let message = explain(&events, exit);
        tracing::warn!("{message}");
        Err(BackendError::Transport(message))
    }
}

/// The message of a non-zero exit: the code, the stream's error events, the logs' tails.
pub(crate) fn exit_message(name: &str, exit: &Exit, stream_errors: Option<String>) -> String {
    let mut parts = vec![match exit.code {
        Some(c) => format!("{name} exited with code {c}"),
        None => format!("{name} was killed"),
    }];
    if let Some(s) = stream_errors {
        parts.push(format!("stream error: {s}"));
    }
    if let Some(t) = &exit.stderr {
        parts.push(format!("stderr tail: {t}"));
    }
    if let Some(t) = &exit.stdout {
        parts.push(format!("stdout tail: {t}"));
    }
    parts.join("; ")
}

/// The running process's group, published for abort while the turn runs. Dropped after the
/// process was reaped, it only unpublishes; dropped before (the turn's future was abandoned:
/// a cancel, a deadline), it kills the group and what left it, since `kill_on_drop` would
/// reach only the leader.
struct Published<'a> {
    slot: &'a Mutex<Option<u32>>,
    pgid: Option<u32>,
    reaped: bool,
    name: &'static str,
}

impl<'a> Published<'a> {
    fn new(slot: &'a Mutex<Option<u32>>, pgid: Option<u32>, name: &'static str) -> Published<'a> {
        *lock(slot) = pgid;
        Published {
            slot,
            pgid,
            reaped: false,
            name,
        }
    }
}

impl Drop for Published<'_> {
    fn drop(&mut self) {
        {
            let mut slot = lock(self.slot);
            if *slot == self.pgid {
                *slot = None;
            }
        }
        if let (false, Some(pgid)) = (self.reaped, self.pgid) {
            let tree = proc::descendants(pgid);
            kill_leftovers(Some(pgid), &tree, self.name);
        }
    }
}

/// A long-running agent (a server the turns talk to over HTTP).
#[derive(Debug, Default)]
pub(crate) struct Daemon {
    running: tokio::sync::Mutex<Option<(Child, Option<u32>)>>,
}

impl Daemon {
    /// Keeps `spawned`'s process as the running agent.
    pub async fn keep(&self, spawned: Spawned) {
        *self.running.lock().await = Some((spawned.child, spawned.pgid));
    }

    /// The exit code if the process is gone (-1 when unknown or never started).
    pub async fn exited(&self) -> Option<i32> {
        let mut running = self.running.lock().await;
        match running.as_mut() {
            None => Some(-1),
            Some((child, _)) => match child.try_wait() {
                Ok(Some(status)) => Some(proc::exit_code(status).unwrap_or(-1)),
                Ok(None) => None,
                Err(_) => Some(-1),
            },
        }
    }

    /// Its process group.
    pub async fn pgid(&self) -> Option<u32> {
        self.running.lock().await.as_ref().and_then(|(_, p)| *p)
    }

    /// Why the turn failed if the process died under it: its exit code and stderr's tail
    /// (given a second to be reaped after its connection closed).
    pub async fn died(&self, cli: &Cli, stderr_log: &Path) -> Option<BackendError> {
        let deadline = Instant::now() + Duration::from_secs(1);
        let code = loop {
            match self.exited().await {
                Some(code) => break code,
                None if Instant::now() >= deadline => return None,
                None => tokio::time::sleep(Duration::from_millis(50)).await,
            }
        };
        let mut message = format!("{} exited with code {code}", cli.name);
        if let Some(t) = tail(stderr_log, 2000).await {
            message.push_str(&format!("; stderr tail: {t}"));
        }
        Some(BackendError::Process(message))
    }

    /// Polls `probe` every 100 ms until it holds; an exit or `deadline` first is an error
    /// (quoting stderr's tail).
    pub async fn wait_healthy<Fut: Future<Output = bool>>(
        &self,
        cli: &Cli,
        stderr_log: &Path,
        deadline: Instant,
        mut probe: impl FnMut() -> Fut,
    ) -> Result<(), BackendError> {
        loop {
            if let Some(code) = self.exited().await {
                let mut message = format!("{} exited early with code {code}", cli.name);
                if let Some(t) = tail(stderr_log, 2000).await {
                    message.push_str(&format!("; stderr tail: {t}"));
                }
                return Err(BackendError::Process(message));
            }
            if probe().await {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(BackendError::Process(format!(
                    "Timed out waiting for {} health check.",
                    cli.name
                )));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops it: SIGTERM to its group, up to `grace` (at most [`TERM_GRACE`]), then SIGKILL
    /// to what is left and to `tree` (its descendants, found while it still ran).
    pub async fn stop(&self, grace: Duration, tree: &[u32], who: &str) {
        let running = self.running.lock().await.take();
        if let Some((mut child, pgid)) = running {
            if let Err(e) = proc::terminate_group(&mut child, grace.min(TERM_GRACE)).await {
                tracing::warn!(error = %e, "cannot terminate {who}");
            }
            // Members that ignored SIGTERM while the leader exited share its group still.
            kill_leftovers(pgid, tree, who);
        }
    }
}

/// SIGKILL to what is left of an agent's process group `pgid` and to `tree`, its descendants
/// found earlier (tool runners that moved to groups of their own); `who` names the agent in
/// the log.
pub(crate) fn kill_leftovers(pgid: Option<u32>, tree: &[u32], who: &str) {
    if let Some(pgid) = pgid
        && let Err(e) = agentbox_sandbox::proc::signal_group(pgid, rustix::process::Signal::KILL)
    {
        tracing::warn!(pgid, error = %e, "cannot kill {who}'s group");
    }
    agentbox_sandbox::proc::signal_each(tree, rustix::process::Signal::KILL);
}

/// Closes `logs` (the tasks copying an agent's output) and waits up to 2 s for its pipes to end.
pub(crate) async fn close_logs(logs: &tokio_util::task::TaskTracker, who: &str) {
    logs.close();
    if tokio::time::timeout(Duration::from_secs(2), logs.wait())
        .await
        .is_err()
    {
        tracing::warn!("{who}'s output pipes stayed open after it stopped");
    }
}

/// The proxy's recorded refusals that explain a failed or finished turn: a context overflow,
/// or the rollout invalidated.
pub(crate) async fn proxy_errors(proxy: &LlmProxy) -> Result<(), BackendError> {
    if let Some(payload) = proxy.consume_context_overflow_error().await
        && let Some(e) = BackendError::from_context_overflow(&payload)
    {
        return Err(e);
    }
    if let Some(payload) = proxy.consume_rollout_invalidated_error().await {
        let code = payload
            .get("error")
            .and_then(Value::as_str)
            .unwrap_or("rollout_invalidated");
        let msg = payload
            .get("message")
            .and_then(Value::as_str)
            .unwrap_or("Dressage rollout was invalidated.");
        return Err(BackendError::Transport(format!(
            "Dressage proxy {code}: {msg}"
        )));
    }
    Ok(())
}

/// Reads an agent's HTTP answer (at most [`ANSWER_CAP`] bytes): its JSON, `None` when empty. A
/// non-success status is the proxy's context overflow (413), a max-steps refusal the agent
/// relayed (`configured_max_steps` when it names none), or a transport error quoting the
/// body; a body that is not JSON is a protocol error quoting it, truncated.
pub(crate) async fn read_answer(
    resp: reqwest::Response,
    what: &str,
    configured_max_steps: u64,
) -> Result<Option<Value>, BackendError> {
    let status = resp.status();
    let bytes = agentbox_llm::client::read_capped(resp, ANSWER_CAP)
        .await
        .map_err(|e| {
            BackendError::Transport(format!("{what}: {}", agentbox_http::error_chain(&e)))
        })?;
    let text = String::from_utf8_lossy(&bytes);
    if !status.is_success() {
        let payload = serde_json::from_slice::<Value>(&bytes).ok();
        if status.as_u16() == 413
            && let Some(e) = payload
                .as_ref()
                .and_then(BackendError::from_context_overflow)
        {
            return Err(e);
        }
        if let Some(e) = max_steps_in(payload.as_ref(), &text, configured_max_steps) {
            return Err(e);
        }
        return Err(BackendError::Transport(format!(
            "{what} returned {}: {}",
            status.as_u16(),
            quote(&text, QUOTE)
        )));
    }
    if bytes.is_empty() {
        return Ok(None);
    }
    serde_json::from_slice(&bytes).map(Some).map_err(|e| {
        BackendError::Protocol(format!(
            "{what} answered something that is not JSON ({e}): {:?}",
            quote(text.trim(), QUOTE)
        ))
    })
}

/// A max-steps refusal an agent relayed (structured, or only in its text).
fn max_steps_in(payload: Option<&Value>, text: &str, configured: u64) -> Option<BackendError> {
    if let Some(v) = payload
        && let Some(e) = structured_max_steps(v, configured)
    {
        return Some(e);
    }
    let lower = text.to_lowercase();
    if lower.contains("max_steps_exceeded") || lower.contains("turn exceeded max_steps") {
        return Some(BackendError::MaxSteps {
            message: "Turn exceeded max_steps.".into(),
            details: crate::error::obj(serde_json::json!({
                "max_steps": configured, "attempted_step": configured,
                "backend_message": quote(text, QUOTE), "raw_error_code": "max_steps_exceeded",
            })),
        });
    }
    None
}

/// A call's failure: a refused connection may be retried, anything else may not.
#[derive(Debug)]
pub(crate) enum CallError {
    Connect(String),
    Other(BackendError),
}

impl CallError {
    pub(crate) fn into_backend(self) -> BackendError {
        match self {
            CallError::Connect(m) => BackendError::Transport(m),
            CallError::Other(e) => e,
        }
    }
}

/// The code of a structured error answer (`error.code|type|error`, else `error_code`, `code`,
/// `finish_reason`), lowercased.
fn structured_code(v: &Value) -> Option<String> {
    let obj = v.as_object()?;
    if let Some(err) = obj.get("error").and_then(Value::as_object) {
        for k in ["code", "type", "error"] {
            if let Some(c) = err.get(k).filter(|c| !c.is_null()) {
                return Some(value_text(c).trim().to_lowercase());
            }
        }
    }
    ["error_code", "code", "finish_reason"]
        .iter()
        .find_map(|k| obj.get(*k).filter(|c| !c.is_null()))
        .map(|c| value_text(c).trim().to_lowercase())
}

fn structured_message(v: &Value) -> Option<String> {
    v.get("error")
        .and_then(|e| e.get("message"))
        .or_else(|| v.get("message"))
        .filter(|m| !m.is_null())
        .map(value_text)
}

/// A max-steps refusal in a structured answer.
pub(crate) fn structured_max_steps(v: &Value, configured: u64) -> Option<BackendError> {
    let code = structured_code(v)?;
    let message = structured_message(v);
    let is_max = code == "max_steps_exceeded"
        || code == "rate_limit_error"
            && message
                .as_deref()
                .is_some_and(|m| m.to_lowercase().contains("turn exceeded max_steps"));
    if !is_max {
        return None;
    }
    let details = v
        .get("error")
        .and_then(|e| e.get("details"))
        .or_else(|| v.get("details"))
        .and_then(Value::as_object);
    let int = |k: &str| details.and_then(|d| d.get(k)).and_then(Value::as_u64);
    let max_steps = int("max_steps").filter(|n| *n > 0).unwrap_or(configured);
    let attempted = int("attempted_step")
        .filter(|n| *n > 0)
        .unwrap_or(max_steps);
    Some(BackendError::MaxSteps {
        message: "Turn exceeded max_steps.".into(),
        details: crate::error::obj(serde_json::json!({
            "max_steps": max_steps, "attempted_step": attempted,
            "backend_message": message, "raw_error_code": code,
        })),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quotes_are_truncated_and_marked() {
        let long = "x".repeat(3000);
        let q = quote(&long, QUOTE);
        assert!(q.len() < 1100 && q.ends_with("...(truncated)"));
        assert_eq!(quote("short", QUOTE), "short");
    }

    #[test]
    fn a_single_prompt_is_one_non_empty_user_message() {
        let ok = [Message::text(Role::User, Some("hi".into()))];
        assert_eq!(single_prompt(&ok, "x").unwrap(), "hi");
        let empty = [Message::text(Role::User, Some("  ".into()))];
        assert!(single_prompt(&empty, "x").is_err());
        let two = [ok[0].clone(), ok[0].clone()];
        assert!(single_prompt(&two, "x").is_err());
        let assistant = [Message::text(Role::Assistant, Some("hi".into()))];
        assert!(single_prompt(&assistant, "x").is_err());
    }
}
