//! Rollout slots, the third run kind next to agents and checks: `launcher.blackbox_bin` in a
//! sandbox of its own (own agent uid, loopback-only network namespace, own pid namespace, the
//! per-run cgroup limits), with fresh on-disk workspace, home and `/tmp` under
//! `slots/<tid>/` ([`crate::layout`]), the gateway task socket at `/run/gw/llm.sock`, the
//! pinned agent CLIs read-only at `/opt/clients`, and `slots/<tid>/server/` bound at
//! `/run/bbs`, where the server creates `server.sock` (`BBS_UNIX_SOCKET`).
//!
//! Life: reserve the tid and a uid (and record both in `state/slots/`, so a restarted launcher
//! cleans up) → create the directories → stage them by descriptor → cgroup → bwrap → wait
//! (bounded) until the socket exists, or fail with the server's stderr, undoing everything →
//! supervise until the server exits, the timeout, `DELETE` or shutdown. A slot that ended keeps
//! its record and directories until `DELETE`, which removes every file of it, and only then
//! gives the uid back.
//!
//! `exec` runs `/bin/sh -lc` in a second sandbox of the same shape (`<tid>.exec`: a name no tid
//! can have, for its cgroup and staging), one at a time per slot, in a tracked task so a client
//! that hangs up cannot leave it running. File reads and writes are root acting inside the
//! slot's directories by descriptor: no symlink followed, regular files only, new files and
//! directories given to the slot's uid, writes renamed into place.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agentbox_policy::path::{EqualsRoot, RelPath, RequestPath, validate_root};
use base64::Engine;
use rustix::fs::{self as rfs, AtFlags, Mode, OFlags};
use rustix::io::Errno;

use super::{CAPTURE_GRACE, LaunchFailed, Launcher, exit_code_of, kill_leftovers, release_sandbox};
use crate::api::{
    RunState, SlotExecRequest, SlotExecResult, SlotFile, SlotReadRequest, SlotRequest, SlotStatus,
    SlotWriteRequest, SlotWriteResult,
};
use crate::error::LauncherError;
use crate::layout::{SlotDirs, create_file_in, read_tail_in};
use crate::state::Record;
use crate::task::{Entry, Event, Final, Outcome, Phase, RunKind, StopReason};
use crate::validate;
use agentbox_policy::id::Tid;
use agentbox_sandbox::bwrap::{self, CLIENTS_IN_SANDBOX, Mounts, Plan, Program, RunAs};
use agentbox_sandbox::cgroup::{Cgroups, TaskCgroup};
use agentbox_sandbox::disk;
use agentbox_sandbox::proc;
use agentbox_sandbox::stage::{Sources, Staged};
use agentbox_sandbox::walk::Owner;

/// How long the server may take to create its socket.
const SOCKET_WAIT: Duration = Duration::from_secs(60);
/// How often the socket is looked for.
const SOCKET_POLL: Duration = Duration::from_millis(25);
/// The socket's name in `slots/<tid>/server/` (`/run/bbs/` inside).
const SOCKET_NAME: &str = "server.sock";
/// The largest file `files/write` writes (the request body limit bounds it anyway).
const MAX_WRITE_BYTES: usize = 1 << 20;
/// The `BBS_*` variables the launcher sets itself; a request may not.
const RESERVED_BBS: &[&str] = &[
    "BBS_HOST",
    "BBS_PORT",
    "BBS_UNIX_SOCKET",
    "BBS_RUNTIME_ROOT",
    "BBS_ROUTER_URL",
    "BBS_ROUTER_TOKEN",
];
/// The agent CLIs inside a slot: the variable blackbox-server reads and the entry point in
/// `scripts/install-clients.sh`'s layout.
const CLIENT_BINS: &[(&str, &str)] = &[
    ("OPENCODE_BIN", "opencode"),
    ("OPENCLAW_BIN", "openclaw"),
    ("CLAUDE_CODE_BIN", "claude"),
    ("CODEX_BIN", "codex"),
];
/// The roots `files/*` may reach (relative paths are under the first).
const FILE_ROOTS: [FileRoot; 3] = [FileRoot::Workspace, FileRoot::Home, FileRoot::Tmp];

/// A directory of a slot that `files/*` may reach.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FileRoot {
    Workspace,
    Home,
    Tmp,
}

impl FileRoot {
    /// Where the sandbox sees it.
    fn inside(self) -> &'static str {
        match self {
            FileRoot::Workspace => "/workspace",
            FileRoot::Home => bwrap::HOME,
            FileRoot::Tmp => "/tmp",
        }
    }
}
/// Longest `BBS_*` value taken from a request.
const MAX_BBS_VALUE: usize = 4096;

/// An environment.
type Env = BTreeMap<String, String>;

/// What a running (or ended, not yet deleted) slot holds.
#[derive(Debug)]
pub struct SlotInfo {
    pub agent: Owner,
    /// The sandbox's leader (bwrap) on the host.
    pub pid: Option<u32>,
    dirs: SlotDirs,
    /// One `exec` at a time; `DELETE` takes it to wait for a running one.
    exec: tokio::sync::Mutex<()>,
}

/// A started slot sandbox, for its supervisor.
struct SlotRunning {
    child: proc::Child,
    cgroup: TaskCgroup,
    staged: Staged,
    captures: Vec<tokio::task::JoinHandle<proc::Captured>>,
    info: Arc<SlotInfo>,
}

/// What a start got as far as, so a failure can undo exactly that.
#[derive(Default)]
struct Parts {
    cgroup: Option<TaskCgroup>,
    staged: Option<Staged>,
    child: Option<proc::Child>,
    captures: Vec<tokio::task::JoinHandle<proc::Captured>>,
}

/// The inside paths of the agent CLIs (`OPENCODE_BIN`, ...).
fn client_bin(name: &str) -> String {
    format!("{CLIENTS_IN_SANDBOX}/node_modules/.bin/{name}")
}

/// The environment every slot sandbox (server and `exec`) starts from: the fixed sandbox
/// variables, `extra`, the agent CLIs on `PATH` and in their `*_BIN` variables.
fn base_env(extra: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    let mut env = bwrap::environment(extra, false, None, false);
    env.insert(
        "PATH".to_owned(),
        format!(
            "{CLIENTS_IN_SANDBOX}/node_modules/.bin:/opt/agentbox/bin:/usr/local/bin:/usr/bin:/bin"
        ),
    );
    for (var, name) in CLIENT_BINS {
        env.insert((*var).to_owned(), client_bin(name));
    }
    env
}

/// A slot's `env`: `BBS_*` settings other than [`RESERVED_BBS`], and the launcher's allowlist
/// for the rest. Returns (allowlisted, `BBS_*`).
fn slot_env(
    launcher: &Launcher,
    input: &BTreeMap<String, String>,
) -> Result<(Env, Env), LauncherError> {
    let mut bbs = BTreeMap::new();
    let mut rest = BTreeMap::new();
    for (k, v) in input {
        if k.starts_with("BBS_") {
            if RESERVED_BBS.contains(&k.as_str()) {
                return Err(LauncherError::InvalidEnv(format!(
                    "{k} is set by the launcher"
                )));
            }
            let ok_key = k
                .bytes()
                .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
            if !ok_key || k.len() > 128 || v.len() > MAX_BBS_VALUE || v.contains('\0') {
                return Err(LauncherError::InvalidEnv(format!(
                    "{:?}: a BBS_* key of A-Z, 0-9 and _ with a value of at most {MAX_BBS_VALUE} bytes and no NUL",
                    k.chars().take(64).collect::<String>()
                )));
            }
            bbs.insert(k.clone(), v.clone());
        } else {
            rest.insert(k.clone(), v.clone());
        }
    }
    let rest = validate::env(&launcher.config, &rest)?;
    for (var, _) in CLIENT_BINS {
        if rest.contains_key(*var) {
            return Err(LauncherError::InvalidEnv(format!(
                "{var} is set by the launcher"
            )));
        }
    }
    Ok((rest, bbs))
}

/// An inside path of `files/*` as (its root, components below it).
fn file_path(input: &str) -> Result<(FileRoot, RelPath), LauncherError> {
    let bad = |e: String| LauncherError::InvalidPath(e);
    let absolute = if input.starts_with('/') {
        input.to_owned()
    } else {
        format!("/workspace/{input}")
    };
    let path = RequestPath::parse(&absolute).map_err(|e| bad(e.to_string()))?;
    let roots = FILE_ROOTS
        .iter()
        .map(|r| validate_root(r.inside()))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    let within = path.within(&roots, EqualsRoot::Refuse).map_err(|e| {
        bad(format!(
            "{e} (a file under /workspace, {} or /tmp)",
            bwrap::HOME
        ))
    })?;
    let root = roots
        .iter()
        .zip(FILE_ROOTS)
        .find_map(|(r, root)| (r == within.root).then_some(root))
        .ok_or(LauncherError::Internal("file root vanished"))?;
    Ok((root, within.rel))
}

/// Opens `rel` below `top` one component at a time, never following a symlink: directories for
/// every component but the last (created for the slot's `owner` when `create`), and returns
/// the last directory with the final name.
fn walk_parents(
    top: &OwnedFd,
    rel: &RelPath,
    create: Option<Owner>,
) -> Result<(OwnedFd, String), LauncherError> {
    let comps: Vec<&str> = rel.components().collect();
    let (last, parents) = comps
        .split_last()
        .ok_or_else(|| LauncherError::InvalidPath("names a root, not a file".to_owned()))?;
    let refused = |what: String| LauncherError::Unsafe(what);
    let mut dir = top.try_clone().map_err(LauncherError::Dup)?;
    for c in parents {
        let open = |d: &OwnedFd| {
            rfs::openat(
                d,
                *c,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
        };
        let next = match open(&dir) {
            Ok(fd) => fd,
            Err(Errno::NOENT) if create.is_some() => {
                match rfs::mkdirat(&dir, *c, Mode::from_raw_mode(0o755)) {
                    Ok(()) | Err(Errno::EXIST) => {}
                    Err(e) => return Err(refused(format!("{rel}: mkdir {c}: {e}"))),
                }
                let fd = open(&dir).map_err(|e| refused(format!("{rel}: {c}: {e}")))?;
                if let Some(o) = create {
                    rfs::chownat(
                        &fd,
                        "",
                        Some(rfs::Uid::from_raw(o.uid)),
                        Some(rfs::Gid::from_raw(o.gid)),
                        AtFlags::EMPTY_PATH,
                    )
                    .map_err(|e| refused(format!("{rel}: chown {c}: {e}")))?;
                }
                fd
            }
            Err(Errno::NOENT) => {
                return Err(LauncherError::Missing(format!("{rel}: no directory {c}")));
            }
            Err(e) => {
                return Err(refused(format!(
                    "{rel}: {c} is not a directory reached without a symlink ({e})"
                )));
            }
        };
        dir = next;
    }
    Ok((dir, (*last).to_owned()))
}

/// The kind of `name` in `dir`, not following a symlink (`None`: missing).
fn kind_at(dir: &OwnedFd, name: &str) -> Result<Option<rfs::FileType>, LauncherError> {
    match rfs::statx(dir, name, AtFlags::SYMLINK_NOFOLLOW, rfs::StatxFlags::TYPE) {
        Ok(st) => Ok(Some(rfs::FileType::from_raw_mode(st.stx_mode.into()))),
        Err(Errno::NOENT) => Ok(None),
        Err(e) => Err(LauncherError::Unsafe(format!("{name}: {e}"))),
    }
}

impl Launcher {
    /// `POST /slots`: answered once the server's socket exists.
    pub async fn start_slot(
        self: &Arc<Self>,
        req: SlotRequest,
    ) -> Result<SlotStatus, LauncherError> {
        let tid = validate::tid(&req.tid)?;
        let token = validate::token(Some(&req.token))?
            .ok_or_else(|| LauncherError::InvalidToken("empty".to_owned()))?;
        let (allowed, bbs) = slot_env(self, &req.env)?;
        let timeout = req
            .timeout_s
            .map(|t| validate::timeout(t, self.config.launcher.limits.max_agent_timeout_s))
            .transpose()?;
        let gateway = self.data.gateway_dir(&tid)?.into_fd();
        let cgroups = self.ready_cgroups()?.clone();
        let stop = self.shutdown.child_token();
        let agent = self
            .agents
            .take()
            .ok_or_else(|| LauncherError::NoAgentUid(self.agents.describe()))?;
        {
            let mut reg = self.lock();
            let entry = Entry::new(RunKind::Slot, None, stop.clone(), 0, agent.uid);
            let reserved = reg
                .reserve(&tid, entry)
                .map_err(|phase| LauncherError::Conflict(format!("task {tid} is {phase}")));
            drop(reg);
            if reserved.is_err() {
                self.agents.give_back(agent);
            }
            reserved?;
        }
        let mut env = base_env(&allowed);
        env.extend(bbs);
        for (k, v) in [
            ("BBS_HOST", "127.0.0.1"),
            ("BBS_PORT", "23456"),
            ("BBS_UNIX_SOCKET", "/run/bbs/server.sock"),
            ("BBS_ROUTER_URL", "unix:/run/gw/llm.sock"),
            ("BBS_RUNTIME_ROOT", "/tmp/bbs-runtime"),
        ] {
            env.insert(k.to_owned(), v.to_owned());
        }
        env.insert("BBS_ROUTER_TOKEN".to_owned(), token.expose().to_owned());
        drop(token);
        // As for agents: the start runs in a tracked task of its own, so a client that goes
        // away cannot cut it short halfway.
        let (launched, outcome) = tokio::sync::oneshot::channel();
        let me = Arc::clone(self);
        let t = tid.clone();
        self.tracker.spawn(async move {
            match me.launch_slot(&t, agent, env, gateway, &cgroups, &stop).await {
                Ok(running) => {
                    {
                        let mut reg = me.lock();
                        if let Some(e) = reg.runs.get_mut(&t) {
                            e.slot = Some(Arc::clone(&running.info));
                        }
                    }
                    me.event(&t, Event::Spawned);
                    let _ = launched.send(Ok(()));
                    me.supervise_slot(t, running, timeout, stop).await;
                }
                Err(failed) => {
                    if failed.agent_free {
                        me.agents.give_back(agent);
                    } else {
                        tracing::error!(tid = %t, uid = agent.uid, "agent uid kept: the slot's directories were not removed");
                    }
                    if let Err(e) = me.slot_store.remove(&t) {
                        tracing::error!(tid = %t, error = %e, "cannot remove the slot's record");
                    }
                    {
                        let mut reg = me.lock();
                        // A DELETE waiting on the start sees it end; otherwise nothing is kept.
                        match reg.runs.get_mut(&t) {
                            Some(e) if matches!(e.phase, Phase::Stopping(_)) => {
                                e.outcome.error = Some(failed.error.to_string());
                                if let Err(err) = e.apply(Event::StartFailed) {
                                    tracing::error!(tid = %t, error = %err, "invalid run transition");
                                }
                            }
                            Some(_) | None => {
                                reg.runs.remove(&t);
                            }
                        }
                    }
                    let _ = launched.send(Err(failed.error));
                }
            }
        });
        outcome
            .await
            .map_err(|_| LauncherError::Internal("the launch task vanished"))??;
        self.slot_status_of(&tid)
    }

    async fn launch_slot(
        self: &Arc<Self>,
        tid: &Tid,
        agent: Owner,
        env: BTreeMap<String, String>,
        gateway: OwnedFd,
        cgroups: &Cgroups,
        stop: &tokio_util::sync::CancellationToken,
    ) -> Result<SlotRunning, LaunchFailed> {
        let record = Record {
            tid: tid.clone(),
            kind: RunKind::Slot,
            finished: None,
            outcome: Outcome::default(),
            workspace_gid: 0,
            agent_uid: Some(agent.uid),
        };
        let store = self.slot_store.clone();
        tokio::task::spawn_blocking(move || store.save(&record)).await??;
        let dirs = match self.data.create_slot(tid, agent) {
            Ok(d) => d,
            Err(e) => {
                let free = self.data.remove_slot(tid).is_ok();
                return Err(LaunchFailed {
                    error: e.into(),
                    agent_free: free,
                });
            }
        };
        let mut parts = Parts::default();
        let started = self
            .start_server(tid, agent, env, &gateway, cgroups, stop, &dirs, &mut parts)
            .await;
        match started {
            Ok(()) => {
                let (Some(child), Some(cgroup), Some(staged)) =
                    (parts.child.take(), parts.cgroup.take(), parts.staged.take())
                else {
                    return Err(LaunchFailed {
                        error: LauncherError::Internal("a started slot lacks a part"),
                        agent_free: false,
                    });
                };
                let pid = child.id();
                Ok(SlotRunning {
                    child,
                    cgroup,
                    staged,
                    captures: std::mem::take(&mut parts.captures),
                    info: Arc::new(SlotInfo {
                        agent,
                        pid,
                        dirs,
                        exec: tokio::sync::Mutex::new(()),
                    }),
                })
            }
            Err(error) => {
                let mut errors = self.undo_parts(tid, parts).await;
                // Why the server did not come up is in its stderr.
                let error = if let LauncherError::SlotFailed(msg) = error {
                    let tail = read_tail_in(&dirs.dir, "server.stderr", 4096);
                    LauncherError::SlotFailed(format!("{msg}; its stderr ends: {tail}"))
                } else {
                    error
                };
                drop(dirs);
                let removed = self.data.remove_slot(tid);
                if let Err(e) = &removed {
                    errors.push(e.to_string());
                }
                if !errors.is_empty() {
                    tracing::error!(%tid, errors = %errors.join("; "), "undoing a failed slot start");
                }
                Err(LaunchFailed {
                    error,
                    agent_free: removed.is_ok(),
                })
            }
        }
    }

    /// Kills and removes whatever a start or an `exec` got as far as; says what failed.
    async fn undo_parts(&self, tid: &Tid, mut parts: Parts) -> Vec<String> {
        let mut errors = Vec::new();
        if let Some(cg) = &parts.cgroup
            && let Err(e) = cg.kill_all().await
        {
            errors.push(format!("killing the sandbox: {e}"));
        }
        if let Some(child) = parts.child.as_mut() {
            let _ = child.wait().await;
        }
        for h in parts.captures.drain(..) {
            let _ = tokio::time::timeout(CAPTURE_GRACE, h).await;
        }
        if let Some(cg) = parts.cgroup.take()
            && let Err(e) = cg.remove()
        {
            errors.push(format!("removing the cgroup: {e}"));
        }
        if let Some(st) = parts.staged.take()
            && let Err(e) = st.release()
        {
            errors.push(format!("releasing the staged mounts: {e}"));
        }
        if !errors.is_empty() {
            tracing::warn!(%tid, errors = %errors.join("; "), "cleaning up a slot sandbox");
        }
        errors
    }

    /// Stages, spawns and waits for the socket; every part made is left in `parts`.
    #[allow(clippy::too_many_arguments)]
    async fn start_server(
        self: &Arc<Self>,
        tid: &Tid,
        agent: Owner,
        env: BTreeMap<String, String>,
        gateway: &OwnedFd,
        cgroups: &Cgroups,
        stop: &tokio_util::sync::CancellationToken,
        dirs: &SlotDirs,
        parts: &mut Parts,
    ) -> Result<(), LauncherError> {
        let clients = self.clients_dir()?;
        let out = create_file_in(&dirs.dir, "server.stdout")?;
        let err = create_file_in(&dirs.dir, "server.stderr")?;
        let staged = self.staging.stage(
            tid,
            Sources {
                workspace: dirs.workspace.as_fd(),
                gateway: Some(gateway.as_fd()),
                venv: None,
                home: Some(dirs.home.as_fd()),
                tmp: Some(dirs.tmp.as_fd()),
                server_dir: Some(dirs.server.as_fd()),
                clients: Some(clients.as_fd()),
            },
        )?;
        let mounts = self.slot_mounts(&staged, true)?;
        parts.staged = Some(staged);
        let cgroup = cgroups.create(tid.as_str(), self.limits()).await?;
        let join = cgroup.join_files();
        parts.cgroup = Some(cgroup);
        let plan = self.slot_plan(
            Program::Server {
                bin: self.config.launcher.blackbox_bin.clone(),
            },
            env,
            true,
        );
        let mut sandbox = bwrap::spawn(
            &plan,
            &mounts,
            &join,
            RunAs {
                uid: agent.uid,
                gid: agent.gid,
            },
            &self.bwrap,
            None,
            bwrap::Start::Now,
        )?;
        drop(plan);
        self.capture(&mut sandbox.child, out, err, &mut parts.captures);
        parts.child = Some(sandbox.child);
        let deadline = Instant::now() + SOCKET_WAIT;
        loop {
            if let Some(child) = parts.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(LauncherError::SlotFailed(format!(
                    "the server exited ({}) before creating its socket",
                    proc::exit_code(status)
                        .map_or_else(|| "by a signal".to_owned(), |c| format!("status {c}"))
                )));
            }
            if kind_at(&dirs.server, SOCKET_NAME)? == Some(rfs::FileType::Socket) {
                self.open_socket(dirs)?;
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(LauncherError::SlotFailed(format!(
                    "the server did not create {SOCKET_NAME} within {} s",
                    SOCKET_WAIT.as_secs()
                )));
            }
            tokio::select! {
                () = tokio::time::sleep(SOCKET_POLL) => {}
                () = stop.cancelled() => {
                    return Err(LauncherError::Conflict(format!("slot {tid} was stopped while starting")));
                }
            }
        }
    }

    /// Makes the server's socket connectable by the service user (group, 0660), through a
    /// handle of it (`slots/<tid>/server/` is the slot uid's: the name is never trusted).
    fn open_socket(&self, dirs: &SlotDirs) -> Result<(), LauncherError> {
        let fd = rfs::openat(
            &dirs.server,
            SOCKET_NAME,
            OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| LauncherError::SlotFailed(format!("opening the socket: {e}")))?;
        let st =
            rfs::fstat(&fd).map_err(|e| LauncherError::SlotFailed(format!("the socket: {e}")))?;
        if rfs::FileType::from_raw_mode(st.st_mode) != rfs::FileType::Socket {
            return Err(LauncherError::SlotFailed(
                "server.sock is not a socket".to_owned(),
            ));
        }
        rfs::chownat(
            &fd,
            "",
            None,
            Some(rfs::Gid::from_raw(self.service.gid)),
            AtFlags::EMPTY_PATH,
        )
        .map_err(|e| LauncherError::SlotFailed(format!("chown of the socket: {e}")))?;
        agentbox_sandbox::stage::chmod_fd(&fd, 0o660)
            .map_err(|e| LauncherError::SlotFailed(format!("chmod of the socket: {e}")))?;
        Ok(())
    }

    fn slot_mounts(&self, staged: &Staged, with_server: bool) -> Result<Mounts, LauncherError> {
        let dup = |fd: &OwnedFd| fd.try_clone().map_err(LauncherError::Dup);
        let m = &staged.mounts;
        Ok(Mounts {
            workspace: dup(&m.workspace)?,
            venv: None,
            gateway: m.gateway.as_ref().map(dup).transpose()?,
            home: m.home.as_ref().map(dup).transpose()?,
            tmp: m.tmp.as_ref().map(dup).transpose()?,
            clients: m.clients.as_ref().map(dup).transpose()?,
            server_dir: m
                .server_dir
                .as_ref()
                .filter(|_| with_server)
                .map(dup)
                .transpose()?,
            attach: m.attach.as_ref().map(dup).transpose()?,
        })
    }

    /// `launcher.clients_dir` (from the root-owned config) as a handle to stage.
    fn clients_dir(&self) -> Result<OwnedFd, LauncherError> {
        let path = &self.config.launcher.clients_dir;
        let config = |why: String| {
            LauncherError::Config(format!("launcher.clients_dir {}: {why}", path.display()))
        };
        let fd = rfs::open(
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| config(e.to_string()))?;
        // Bound as it is: the agent uids must be able to enter it (an install made with
        // `mktemp -d` is 0700 and would show up empty and unreadable).
        let st = rfs::fstat(&fd).map_err(|e| config(e.to_string()))?;
        if st.st_mode & 0o005 != 0o005 {
            return Err(config(format!(
                "mode {:o}: the agent uids cannot enter it (chmod o+rx)",
                st.st_mode & 0o7777
            )));
        }
        Ok(fd)
    }

    fn slot_plan(&self, program: Program, env: BTreeMap<String, String>, gateway: bool) -> Plan {
        let limits = &self.config.launcher.limits;
        Plan {
            program,
            env,
            with_venv: false,
            with_gateway: gateway,
            tmp_bytes: limits.tmp_mb.saturating_mul(1 << 20),
            home_bytes: limits.home_mb.saturating_mul(1 << 20),
            file_bytes: self.disk.bytes,
            claude_bin: self.config.launcher.claude_bin.clone(),
        }
    }

    fn capture(
        &self,
        child: &mut proc::Child,
        out: std::fs::File,
        err: std::fs::File,
        captures: &mut Vec<tokio::task::JoinHandle<proc::Captured>>,
    ) {
        let cap = Some(self.output_cap());
        if let Some(pipe) = child.stdout.take() {
            let sink = tokio::fs::File::from_std(out);
            captures.push(self.tracker.spawn(proc::capture(pipe, sink, cap)));
        }
        if let Some(pipe) = child.stderr.take() {
            let sink = tokio::fs::File::from_std(err);
            captures.push(self.tracker.spawn(proc::capture(pipe, sink, cap)));
        }
    }

    async fn supervise_slot(
        self: Arc<Self>,
        tid: Tid,
        running: SlotRunning,
        timeout: Option<Duration>,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let SlotRunning {
            mut child,
            cgroup,
            staged,
            captures,
            info,
        } = running;
        let timer = async move {
            match timeout {
                Some(t) => tokio::time::sleep(t).await,
                None => std::future::pending().await,
            }
        };
        // The slot's disk: everything under `slots/<tid>` (workspace, home, /tmp, what `exec`
        // and `files/write` add), watched as a run's workspace is; its root-owned logs (four,
        // each capped at the output cap) are allowed on top of `launcher.limits.disk_mb`.
        let allowance = self
            .disk
            .bytes
            .saturating_add(self.output_cap().saturating_mul(4));
        let watched = info.dirs.dir.try_clone();
        let walk_limits = self.walk_limits;
        // The server's processes, and those of the slot's commands (`exec`: a cgroup of their
        // own while one runs).
        let mut procs = vec![cgroup.procs_file()];
        if let Ok(cgroups) = self.ready_cgroups() {
            procs.push(cgroups.procs_file_of(&format!("{tid}.exec")));
        }
        let watcher = async move {
            match watched {
                Ok(fd) => disk::watch(fd, allowance, walk_limits, procs).await,
                Err(e) => {
                    tracing::error!(error = %e, "cannot watch a slot's disk");
                    std::future::pending().await
                }
            }
        };
        let status = tokio::select! {
            s = child.wait() => s,
            exceeded = watcher => {
                tracing::warn!(%tid, reason = %exceeded.reason, "slot over its disk limit: stopping it");
                self.stop_sandbox(&tid, StopReason::DiskExceeded, &cgroup, &mut child).await
            }
            () = timer => {
                self.stop_sandbox(&tid, StopReason::Timeout, &cgroup, &mut child).await
            }
            () = stop.cancelled() => {
                self.stop_sandbox(&tid, StopReason::Shutdown, &cgroup, &mut child).await
            }
        };
        let mut errors = Vec::new();
        let exit_code = exit_code_of(status, &mut errors);
        self.event(&tid, Event::ProcessGone);
        let oom_killed = kill_leftovers(&cgroup, &mut errors).await;
        // A slot's output is its server's log: whether it was truncated is not in its outcome.
        release_sandbox(cgroup, staged, captures, &mut errors).await;
        {
            let mut reg = self.lock();
            if let Some(e) = reg.runs.get_mut(&tid) {
                e.outcome.exit_code = exit_code;
                e.outcome.oom_killed = oom_killed;
                if !errors.is_empty() {
                    e.outcome.error = Some(errors.join("; "));
                }
                if let Err(err) = e.apply(Event::Done) {
                    tracing::error!(%tid, error = %err, "invalid run transition");
                }
            }
        }
        tracing::info!(%tid, ?exit_code, oom_killed, "slot ended");
    }

    fn slot_status_of(&self, tid: &Tid) -> Result<SlotStatus, LauncherError> {
        let (phase, outcome, info) = {
            let reg = self.lock();
            match reg.runs.get(tid) {
                Some(e) if e.kind == RunKind::Slot => (e.phase, e.outcome.clone(), e.slot.clone()),
                Some(_) | None => return Err(LauncherError::UnknownSlot(tid.to_string())),
            }
        };
        let stderr = info
            .as_ref()
            .map(|i| read_tail_in(&i.dirs.dir, "server.stderr", self.output_cap()))
            .unwrap_or_default();
        Ok(SlotStatus {
            tid: tid.to_string(),
            state: phase.state(),
            socket: self
                .data
                .slot_path(tid, "server")
                .join(SOCKET_NAME)
                .display()
                .to_string(),
            pid: info
                .as_ref()
                .and_then(|i| i.pid)
                .filter(|_| phase.sandbox_may_run()),
            exit_code: outcome.exit_code,
            oom_killed: outcome.oom_killed,
            timed_out: phase == Phase::Done(Final::TimedOut),
            stderr,
            error: outcome.error,
        })
    }

    /// `GET /slots/{tid}`.
    pub async fn slot_status(&self, tid: &str) -> Result<SlotStatus, LauncherError> {
        let tid = validate::tid(tid)?;
        self.slot_status_of(&tid)
    }

    /// `DELETE /slots/{tid}`: kills the sandbox (and a running `exec`), removes every file of
    /// the slot, gives its uid back; the final status.
    pub async fn delete_slot(self: &Arc<Self>, tid: &str) -> Result<SlotStatus, LauncherError> {
        let tid = validate::tid(tid)?;
        let mut rx = {
            let mut reg = self.lock();
            let entry = match reg.runs.get_mut(&tid) {
                Some(e) if e.kind == RunKind::Slot => e,
                Some(_) | None => return Err(LauncherError::UnknownSlot(tid.to_string())),
            };
            if entry.is_active()
                && let Err(e) = entry.apply(Event::Stop(StopReason::Deleted))
            {
                tracing::error!(%tid, error = %e, "invalid run transition");
            }
            entry.stop.cancel();
            entry.watch.subscribe()
        };
        let _ = rx.wait_for(|p| p.is_done()).await;
        let info = self.lock().runs.get(&tid).and_then(|e| e.slot.clone());
        if let Some(info) = &info {
            // A running exec was killed by the cancel; wait until it has cleaned up.
            let _exec = info.exec.lock().await;
        }
        let mut status = self.slot_status_of(&tid)?;
        if let Some(info) = info {
            let agent = info.agent;
            drop(info);
            let me = Arc::clone(self);
            let t = tid.clone();
            let removed = tokio::task::spawn_blocking(move || me.data.remove_slot(&t)).await?;
            match removed {
                Ok(()) => self.agents.give_back(agent),
                Err(e) => {
                    tracing::error!(%tid, uid = agent.uid, error = %e, "agent uid kept: the slot's files were not removed");
                    let msg = format!("removing the slot's files: {e}");
                    status.error = Some(match status.error.take() {
                        Some(prev) => format!("{prev}; {msg}"),
                        None => msg,
                    });
                }
            }
        }
        {
            let mut reg = self.lock();
            if reg.runs.get(&tid).is_some_and(|e| !e.is_active()) {
                reg.runs.remove(&tid);
            }
        }
        if let Err(e) = self.slot_store.remove(&tid) {
            tracing::error!(%tid, error = %e, "cannot remove the slot's record");
        }
        Ok(status)
    }

    /// The running slot `tid` (409 when it is not running).
    fn running_slot(
        &self,
        tid: &Tid,
    ) -> Result<(Arc<SlotInfo>, tokio_util::sync::CancellationToken), LauncherError> {
        let reg = self.lock();
        match reg.runs.get(tid) {
            Some(e) if e.kind == RunKind::Slot => match (&e.slot, e.phase.state()) {
                (Some(info), RunState::Running) => Ok((Arc::clone(info), e.stop.child_token())),
                (_, state) => Err(LauncherError::Conflict(format!("slot {tid} is {state}"))),
            },
            Some(_) | None => Err(LauncherError::UnknownSlot(tid.to_string())),
        }
    }

    /// `POST /slots/{tid}/exec`.
    pub async fn slot_exec(
        self: &Arc<Self>,
        tid: &str,
        req: SlotExecRequest,
    ) -> Result<SlotExecResult, LauncherError> {
        let tid = validate::tid(tid)?;
        validate::command(&req.command)?;
        let env = validate::env(&self.config, &req.env)?;
        let max = self.config.launcher.limits.max_check_timeout_s;
        let timeout = validate::timeout(req.timeout_s.unwrap_or(max), max)?;
        let stdin = validate::stdin(req.stdin.as_deref())?.map(str::to_owned);
        let cwd = match req.cwd.as_deref() {
            None => "/workspace".to_owned(),
            Some(c) => {
                let abs = if c.starts_with('/') {
                    c.to_owned()
                } else {
                    format!("/workspace/{c}")
                };
                RequestPath::parse(&abs).map_err(|e| LauncherError::InvalidPath(e.to_string()))?;
                abs
            }
        };
        let (info, stop) = self.running_slot(&tid)?;
        let cgroups = self.ready_cgroups()?.clone();
        let me = Arc::clone(self);
        let (done, result) = tokio::sync::oneshot::channel();
        self.tracker.spawn(async move {
            let _one = info.exec.lock().await;
            let r = if stop.is_cancelled() {
                Err(LauncherError::Conflict(format!("slot {tid} is stopping")))
            } else {
                let env = base_env(&env);
                me.run_exec(
                    &tid,
                    &info,
                    &cgroups,
                    req.command,
                    cwd,
                    env,
                    timeout,
                    stdin,
                    &stop,
                )
                .await
            };
            let _ = done.send(r);
        });
        result
            .await
            .map_err(|_| LauncherError::Internal("the exec task vanished"))?
    }

    #[allow(clippy::too_many_arguments)]
    async fn run_exec(
        self: &Arc<Self>,
        tid: &Tid,
        info: &SlotInfo,
        cgroups: &Cgroups,
        command: String,
        cwd: String,
        env: BTreeMap<String, String>,
        timeout: Duration,
        stdin: Option<String>,
        stop: &tokio_util::sync::CancellationToken,
    ) -> Result<SlotExecResult, LauncherError> {
        let name = format!("{tid}.exec");
        let started = Instant::now();
        let clients = self.clients_dir()?;
        let out = create_file_in(&info.dirs.dir, "exec.stdout")?;
        let err = create_file_in(&info.dirs.dir, "exec.stderr")?;
        let mut parts = Parts::default();
        let ran = async {
            let staged = self.staging.stage_named(
                &name,
                Sources {
                    workspace: info.dirs.workspace.as_fd(),
                    gateway: None,
                    venv: None,
                    home: Some(info.dirs.home.as_fd()),
                    tmp: Some(info.dirs.tmp.as_fd()),
                    server_dir: None,
                    clients: Some(clients.as_fd()),
                },
            )?;
            let mounts = self.slot_mounts(&staged, false)?;
            parts.staged = Some(staged);
            let cgroup = cgroups.create(&name, self.limits()).await?;
            let join = cgroup.join_files();
            parts.cgroup = Some(cgroup);
            let plan = self.slot_plan(Program::Shell { command, cwd }, env, false);
            let mut sandbox = bwrap::spawn(
                &plan,
                &mounts,
                &join,
                RunAs {
                    uid: info.agent.uid,
                    gid: info.agent.gid,
                },
                &self.bwrap,
                stdin.as_deref().map(str::as_bytes),
                bwrap::Start::Now,
            )?;
            self.capture(&mut sandbox.child, out, err, &mut parts.captures);
            let child = parts.child.insert(sandbox.child);
            let status = tokio::select! {
                s = child.wait() => Some(s),
                () = tokio::time::sleep(timeout) => None,
                () = stop.cancelled() => None,
            };
            Ok::<_, LauncherError>(status)
        }
        .await;
        let mut truncated = false;
        // Take the captures' results before the generic undo drops them.
        let caps: Vec<_> = parts.captures.drain(..).collect();
        if let Some(cg) = &parts.cgroup {
            let _ = cg.kill_all().await;
        }
        for h in caps {
            if let Ok(Ok(c)) = tokio::time::timeout(CAPTURE_GRACE, h).await {
                truncated |= c.truncated;
            }
        }
        let errors = self.undo_parts(tid, parts).await;
        let cap = self.output_cap();
        let stdout = read_tail_in(&info.dirs.dir, "exec.stdout", cap);
        let stderr = read_tail_in(&info.dirs.dir, "exec.stderr", cap);
        for n in ["exec.stdout", "exec.stderr"] {
            let _ = rfs::unlinkat(&info.dirs.dir, n, AtFlags::empty());
        }
        let status = ran?;
        if !errors.is_empty() {
            tracing::warn!(%tid, errors = %errors.join("; "), "after a slot exec");
        }
        let (returncode, timed_out) = match status {
            Some(Ok(s)) => (proc::exit_code(s), false),
            Some(Err(e)) => {
                return Err(LauncherError::SlotFailed(format!(
                    "waiting for the command: {e}"
                )));
            }
            None => (None, true),
        };
        Ok(SlotExecResult {
            stdout,
            stderr,
            returncode,
            timed_out,
            truncated,
            duration_s: started.elapsed().as_secs_f64(),
        })
    }

    /// The directory handle of `root`.
    fn file_root(info: &SlotInfo, root: FileRoot) -> &OwnedFd {
        match root {
            FileRoot::Workspace => &info.dirs.workspace,
            FileRoot::Home => &info.dirs.home,
            FileRoot::Tmp => &info.dirs.tmp,
        }
    }

    /// The slot `tid` (running or ended, not deleted) for file access.
    fn slot_info(&self, tid: &Tid) -> Result<Arc<SlotInfo>, LauncherError> {
        let reg = self.lock();
        match reg.runs.get(tid) {
            Some(e) if e.kind == RunKind::Slot => e
                .slot
                .clone()
                .ok_or_else(|| LauncherError::Conflict(format!("slot {tid} is {}", e.phase))),
            Some(_) | None => Err(LauncherError::UnknownSlot(tid.to_string())),
        }
    }

    /// `POST /slots/{tid}/files/read`.
    pub async fn slot_read(
        &self,
        tid: &str,
        req: SlotReadRequest,
    ) -> Result<SlotFile, LauncherError> {
        let tid = validate::tid(tid)?;
        let (root, rel) = file_path(&req.path)?;
        let cap = self.output_cap();
        let max = req.max_bytes.unwrap_or(cap).min(cap);
        let info = self.slot_info(&tid)?;
        let path = req.path.clone();
        tokio::task::spawn_blocking(move || {
            let top = Self::file_root(&info, root);
            let (dir, name) = walk_parents(top, &rel, None)?;
            let fd = rfs::openat(
                &dir,
                name.as_str(),
                OFlags::RDONLY
                    | OFlags::NOFOLLOW
                    | OFlags::NONBLOCK
                    | OFlags::NOCTTY
                    | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| match e {
                Errno::NOENT => LauncherError::Missing(format!("{rel}")),
                e => LauncherError::Unsafe(format!(
                    "{rel}: not a file reached without a symlink ({e})"
                )),
            })?;
            let st = rfs::fstat(&fd).map_err(|e| LauncherError::Unsafe(format!("{rel}: {e}")))?;
            if rfs::FileType::from_raw_mode(st.st_mode) != rfs::FileType::RegularFile {
                return Err(LauncherError::Unsafe(format!("{rel}: not a regular file")));
            }
            let size = u64::try_from(st.st_size).unwrap_or(0);
            let mut buf = Vec::new();
            std::fs::File::from(fd)
                .take(max)
                .read_to_end(&mut buf)
                .map_err(|e| LauncherError::Unsafe(format!("{rel}: read: {e}")))?;
            Ok(SlotFile {
                path,
                content_base64: base64::engine::general_purpose::STANDARD.encode(&buf),
                size,
                truncated: (buf.len() as u64) < size,
            })
        })
        .await?
    }

    /// `POST /slots/{tid}/files/write`.
    pub async fn slot_write(
        &self,
        tid: &str,
        req: SlotWriteRequest,
    ) -> Result<SlotWriteResult, LauncherError> {
        let tid = validate::tid(tid)?;
        let (root, rel) = file_path(&req.path)?;
        let content = base64::engine::general_purpose::STANDARD
            .decode(req.content_base64.as_bytes())
            .map_err(|e| LauncherError::BadRequest(format!("content_base64: {e}")))?;
        if content.len() > MAX_WRITE_BYTES {
            return Err(LauncherError::BadRequest(format!(
                "content exceeds {MAX_WRITE_BYTES} bytes"
            )));
        }
        let info = self.slot_info(&tid)?;
        let (path, append) = (req.path.clone(), req.append);
        tokio::task::spawn_blocking(move || {
            let owner = info.agent;
            let top = Self::file_root(&info, root);
            let (dir, name) = walk_parents(top, &rel, Some(owner))?;
            match kind_at(&dir, &name)? {
                None | Some(rfs::FileType::RegularFile) => {}
                Some(_) => {
                    return Err(LauncherError::Unsafe(format!("{rel}: not a regular file")));
                }
            }
            let unsafe_io = |what: &str, e: &dyn std::fmt::Display| {
                LauncherError::Unsafe(format!("{rel}: {what}: {e}"))
            };
            if append {
                let fd = rfs::openat(
                    &dir,
                    name.as_str(),
                    OFlags::WRONLY
                        | OFlags::APPEND
                        | OFlags::CREATE
                        | OFlags::NOFOLLOW
                        | OFlags::NONBLOCK
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o644),
                )
                .map_err(|e| unsafe_io("open", &e))?;
                let st = rfs::fstat(&fd).map_err(|e| unsafe_io("stat", &e))?;
                if rfs::FileType::from_raw_mode(st.st_mode) != rfs::FileType::RegularFile {
                    return Err(LauncherError::Unsafe(format!("{rel}: not a regular file")));
                }
                rfs::fchown(
                    &fd,
                    Some(rfs::Uid::from_raw(owner.uid)),
                    Some(rfs::Gid::from_raw(owner.gid)),
                )
                .map_err(|e| unsafe_io("chown", &e))?;
                std::fs::File::from(fd)
                    .write_all(&content)
                    .map_err(|e| unsafe_io("write", &e))?;
            } else {
                // A fresh file renamed over the name: a failure leaves no partial file. Its name
                // is this write's own: writes into one directory may run at once.
                static WRITES: AtomicU64 = AtomicU64::new(0);
                let tmp = format!(
                    ".agentbox-write-{}-{}",
                    std::process::id(),
                    WRITES.fetch_add(1, Ordering::Relaxed)
                );
                let _ = rfs::unlinkat(&dir, tmp.as_str(), AtFlags::empty());
                let fd = rfs::openat(
                    &dir,
                    tmp.as_str(),
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_raw_mode(0o644),
                )
                .map_err(|e| unsafe_io("create", &e))?;
                let written = rfs::fchown(
                    &fd,
                    Some(rfs::Uid::from_raw(owner.uid)),
                    Some(rfs::Gid::from_raw(owner.gid)),
                )
                .map_err(|e| unsafe_io("chown", &e))
                .and_then(|()| {
                    let mut f = std::fs::File::from(fd);
                    f.write_all(&content).map_err(|e| unsafe_io("write", &e))?;
                    f.sync_all().map_err(|e| unsafe_io("sync", &e))
                })
                .and_then(|()| {
                    rfs::renameat(&dir, tmp.as_str(), &dir, name.as_str())
                        .map_err(|e| unsafe_io("rename", &e))
                });
                if let Err(e) = written {
                    let _ = rfs::unlinkat(&dir, tmp.as_str(), AtFlags::empty());
                    return Err(e);
                }
            }
            Ok(SlotWriteResult {
                path,
                bytes: content.len() as u64,
                append,
            })
        })
        .await?
    }

    /// After a restart: every slot directory is removed (their sandboxes died with the cgroups
    /// the restart killed) and their records dropped; a uid whose files could not be removed
    /// stays taken.
    pub(super) fn recover_slots(&self) {
        let records = self.slot_store.load_all();
        for name in self.data.slot_names() {
            let Ok(tid) = Tid::parse(&name) else {
                tracing::warn!(name, "a foreign entry in slots/; left alone");
                continue;
            };
            tracing::warn!(%tid, "removing a slot of a previous launcher");
            if let Err(e) = self.data.remove_slot(&tid) {
                tracing::error!(%tid, error = %e, "cannot remove a slot of a previous launcher");
                if let Some(uid) = records
                    .iter()
                    .find(|r| r.tid == tid)
                    .and_then(|r| r.agent_uid)
                {
                    self.agents.keep(uid);
                }
            }
        }
        for r in records {
            if let Err(e) = self.slot_store.remove(&r.tid) {
                tracing::error!(tid = %r.tid, error = %e, "cannot remove a slot record");
            }
        }
    }
}
