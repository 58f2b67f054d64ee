//! The launcher's state and operations: starting and supervising sandbox runs (agents in the
//! background, checks within their request), answering and waiting on them, deleting them,
//! the git helpers, the vLLM backend routes, and recovery after a restart.
//!
//! Shared state is the [`Registry`] behind one `std::sync::Mutex`, locked only to read or apply
//! a transition, never across an `.await`. Every background task (supervisors, output capture)
//! is spawned on one `TaskTracker` and stopped through the launcher's shutdown token, which
//! every run's stop token descends from.
//!
//! A run, in order: reserve the tid (409 if active) → resolve the workspace (and venv, gateway
//! directory) without symlinks → hand the workspace to the agent uid (scan first, refuse before
//! changing anything) → stage the directories by descriptor under `mnt/<tid>` ([`agentbox_sandbox::stage`])
//! → create the cgroup with the limits → spawn bwrap inside it as the agent uid → supervise:
//! exit, timeout or stop (kill the whole cgroup) → kill survivors, read the OOM counter, remove
//! the cgroup, release the staging mounts → hand the workspace back to the service uid → for
//! agents with a snapshot, commit the tree onto `agent/<tid>` in the shadow → `Done`, persisted.
//!
//! vLLM backends ([`crate::backend`]) share the tracker and the shutdown token; the launcher
//! tells them which models have running agents.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use agentbox_policy::config::{Backend, Config, ModelId};
use agentbox_policy::id::{AgentBranch, Tid};
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::api::{
    AgentRequest, AgentStatus, BackendStartResult, BackendStopResult, CheckRequest, CheckResult,
    DeleteBranchRequest, DeleteBranchResult, DeliverRequest, DeliverResult, DiskMode, DiskStatus,
    HostStatus, LauncherStatus, RunSummary, SnapshotRequest, SnapshotResult,
};
use agentbox_sandbox::bwrap::{self, Mounts, Plan, Program, RunAs};
use agentbox_sandbox::cgroup::{CgroupLimits, Cgroups, Spares, TaskCgroup};
use agentbox_sandbox::disk::{self, ProjectQuota};
use agentbox_sandbox::proc;
use agentbox_sandbox::stage::{Sources, Staged, Staging};
use agentbox_sandbox::walk::{self, Owner, WalkLimits};

use crate::backend::{BackendIdentity, BackendSettings, Backends, Busy};
use crate::error::LauncherError;
use crate::git::{self, Git, TaskPaths};
use crate::layout::{DataDir, LogKind, Stream};
use crate::state::{BackendStore, Record, StateStore};
use crate::task::{Entry, Event, Final, Outcome, Phase, Registry, RunKind, StopReason};
use crate::uids::AgentIds;
use crate::validate;

mod slot;
pub use slot::SlotInfo;

/// How long output capture may lag behind the death of every sandboxed process.
const CAPTURE_GRACE: Duration = Duration::from_secs(30);

/// Everything the launcher needs from its configuration and command line.
#[derive(Debug)]
pub struct Settings {
    pub config: Config,
    /// The service identity: may call the launcher, owns workspaces and repositories.
    pub service: Owner,
    pub data: DataDir,
    /// `Err` with the reason when cgroups are unusable; runs are then refused.
    pub cgroups: Result<Cgroups, String>,
    pub bwrap: PathBuf,
    /// How long a vLLM backend may take to become healthy.
    pub backend_start_timeout: Duration,
}

/// The launcher.
#[derive(Debug)]
pub struct Launcher {
    config: Config,
    data: DataDir,
    service: Owner,
    agents: AgentIds,
    cgroups: Result<Cgroups, String>,
    bwrap: PathBuf,
    registry: Mutex<Registry>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
    waiters: AtomicUsize,
    store: StateStore,
    /// `state/slots`: the slots that may have directories (cleaned up after a restart).
    slot_store: StateStore,
    git: Git,
    walk_limits: WalkLimits,
    backends: Arc<Backends>,
    staging: Staging,
    disk: DiskLimit,
    /// Cgroups made ahead for agents and checks (`None` without cgroups).
    spares: Option<Arc<Spares>>,
}

/// `launcher.limits.disk_mb` and how this host enforces it.
#[derive(Debug)]
struct DiskLimit {
    bytes: u64,
    /// `Some` when the data dir's filesystem enforces project quotas.
    quota: Option<Arc<ProjectQuota>>,
    /// What the probe found, for `/status`.
    detail: String,
}

/// How one run's disk is bounded. A run may not make its workspace larger than the limit or
/// than it was when the run started, whichever is more (a workspace that came in over the
/// limit can still be worked on, and cleaned up, but not grown).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum DiskGuard {
    /// Its workspace is tagged with this project id, whose hard limit is `limit` bytes.
    Quota { project: u32, limit: u64 },
    /// A watcher stops the run once the workspace is over `allowance` bytes.
    Watch { allowance: u64 },
}

/// Counts a waiting `GET ?wait=1` for as long as it waits (dropped when the client goes away).
struct WaiterGuard<'a>(&'a AtomicUsize);

impl<'a> WaiterGuard<'a> {
    fn new(counter: &'a AtomicUsize) -> Self {
        counter.fetch_add(1, Ordering::SeqCst);
        WaiterGuard(counter)
    }
}

impl Drop for WaiterGuard<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What `start` hands to the supervisor.
struct Running {
    child: proc::Child,
    /// What bwrap says about its setup ([`bwrap::StatusPipe`]).
    status: bwrap::StatusPipe,
    cgroup: TaskCgroup,
    captures: Vec<tokio::task::JoinHandle<proc::Captured>>,
    workspace: OwnedFd,
    workspace_gid: u32,
    staged: Staged,
    agent: Owner,
    disk: DiskGuard,
}

/// A launch that failed, and whether the run's agent uid may be given back (nothing of the
/// workspace is left with it).
struct LaunchFailed {
    error: LauncherError,
    agent_free: bool,
}

impl<E: Into<LauncherError>> From<E> for LaunchFailed {
    fn from(e: E) -> Self {
        LaunchFailed {
            error: e.into(),
            agent_free: true,
        }
    }
}

/// A validated run request.
struct RunSpec {
    tid: Tid,
    kind: RunKind,
    /// Agents only.
    model: Option<ModelId>,
    program: Program,
    env: BTreeMap<String, String>,
    venv: Option<OwnedFd>,
    gateway: Option<OwnedFd>,
    timeout: Duration,
    /// The agent's standard input (the prompt); never in an argument list.
    stdin: Option<String>,
}

/// A sandbox's exit code from bwrap's wait; a failed wait is recorded in `errors`.
fn exit_code_of(
    status: std::io::Result<std::process::ExitStatus>,
    errors: &mut Vec<String>,
) -> Option<i32> {
    match status {
        Ok(s) => proc::exit_code(s),
        Err(e) => {
            errors.push(format!("waiting for the sandbox: {e}"));
            None
        }
    }
}

/// Kills what outlived bwrap in a sandbox's cgroup; whether the kernel OOM-killed anything in
/// it.
async fn kill_leftovers(cgroup: &TaskCgroup, errors: &mut Vec<String>) -> bool {
    if let Err(e) = cgroup.kill_all().await {
        errors.push(format!("killing leftovers: {e}"));
    }
    cgroup.oom_kills() > 0
}

/// What every ended sandbox gives back, agent run or slot: its cgroup, its staged mounts and
/// its output captures (each given [`CAPTURE_GRACE`]); whether any capture was truncated.
async fn release_sandbox(
    cgroup: TaskCgroup,
    staged: Staged,
    captures: Vec<tokio::task::JoinHandle<proc::Captured>>,
    errors: &mut Vec<String>,
) -> bool {
    if let Err(e) = cgroup.remove() {
        errors.push(format!("removing the cgroup: {e}"));
    }
    if let Err(e) = staged.release() {
        errors.push(format!("releasing the staged mounts: {e}"));
    }
    let mut truncated = false;
    for h in captures {
        match tokio::time::timeout(CAPTURE_GRACE, h).await {
            Ok(Ok(c)) => truncated |= c.truncated,
            Ok(Err(e)) => errors.push(format!("output capture: {e}")),
            Err(_) => errors.push("output capture did not finish".to_owned()),
        }
    }
    truncated
}

/// Refuses an agent range that holds the service identity or a user of the host.
fn check_agent_range(agents: &AgentIds, service: Owner) -> Result<(), LauncherError> {
    if agents.contains_uid(service.uid) || agents.contains_gid(service.gid) {
        return Err(LauncherError::Config(format!(
            "agent_uid/agent_uid_count: the agent range {} holds the service identity {}:{}",
            agents.describe(),
            service.uid,
            service.gid
        )));
    }
    // A host user in the range would share its uid with sandboxes. The packaged
    // `agentbox-agent` entry names the range's first uid and is expected.
    let passwd = std::fs::read_to_string("/etc/passwd").unwrap_or_default();
    for line in passwd.lines() {
        let mut f = line.split(':');
        let (Some(name), Some(_), Some(uid)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if let Ok(uid) = uid.parse::<u32>()
            && agents.contains_uid(uid)
            && !name.starts_with("agentbox-agent")
        {
            return Err(LauncherError::Config(format!(
                "agent_uid/agent_uid_count: the agent range {} holds the host user {name:?} ({uid})",
                agents.describe()
            )));
        }
    }
    Ok(())
}

/// How many cgroups are kept made ahead for starts ([`Spares`]).
const SPARE_CGROUPS: usize = 4;

/// The cgroup limits of every sandbox, from `launcher.limits`.
fn run_limits(config: &Config) -> CgroupLimits {
    let l = &config.launcher.limits;
    CgroupLimits {
        memory_bytes: l.memory_mb.saturating_mul(1 << 20),
        pids: l.pids,
        cpus: l.cpus,
    }
}

/// What [`Launcher::prepare`] made for a run, in the order it is undone.
struct Prepared {
    staged: Staged,
    log_kind: LogKind,
    cgroup: TaskCgroup,
}

/// A sandbox just spawned, with what it runs in and the tasks copying its output.
struct Started {
    sandbox: bwrap::Sandbox,
    cgroup: TaskCgroup,
    captures: Vec<tokio::task::JoinHandle<proc::Captured>>,
    staged: Staged,
    log_kind: LogKind,
}

/// Bounds a run's disk, on a blocking thread after the hand-over: under a project quota, tags
/// the (handed-over) workspace with the run's own agent uid as its project id; if that fails,
/// or the filesystem has no quota, the run gets the watcher, whose allowance is the larger of
/// the limit and the usage the hand-over found (`sizes`: limit, usage in bytes).
fn limit_disk(
    tid: &Tid,
    quota: Option<&ProjectQuota>,
    workspace: BorrowedFd<'_>,
    agent: Owner,
    (bytes, usage): (u64, u64),
    limits: WalkLimits,
) -> DiskGuard {
    if let Some(quota) = quota {
        let project = agent.uid;
        match quota.assign(workspace, project, bytes, limits) {
            Ok(limit) => return DiskGuard::Quota { project, limit },
            Err(e) => {
                // Whatever was tagged is untagged, so the run is not also counted against the
                // project.
                let _ = quota.release(workspace, project, limits);
                tracing::warn!(%tid, error = %e, "project quota: falling back to the watcher");
            }
        }
    }
    DiskGuard::Watch {
        allowance: bytes.max(usage),
    }
}

impl Launcher {
    /// Builds the launcher; call [`Launcher::recover`] before serving.
    pub fn new(settings: Settings) -> Result<Arc<Launcher>, LauncherError> {
        let store = StateStore::open(&settings.data.agent_state_dir())?;
        let slot_store = StateStore::open(&settings.data.path().join("state").join("slots"))?;
        let backend_store = BackendStore::open(&settings.data.backend_state_dir())?;
        let agents = AgentIds::new(&settings.config);
        check_agent_range(&agents, settings.service)?;
        // The daemon runs in a mount namespace of its own (`daemon::main`), so the tmpfs is
        // seen by the launcher and the sandboxes it starts only.
        let mnt = settings.data.path().join("mnt");
        let staging = match Staging::on_tmpfs(mnt.clone(), settings.data.mnt_dir()?) {
            Ok(s) => s,
            Err(e) => {
                tracing::warn!(error = %e, "staging mount points stay on the data dir's filesystem");
                Staging::new(mnt, settings.data.mnt_dir()?)
            }
        };
        let probe = disk::probe(settings.data.tasks_dir()?.as_fd());
        tracing::info!(mode = ?probe.mode(), detail = %probe.detail, "per-run disk limit");
        let disk = DiskLimit {
            bytes: settings
                .config
                .launcher
                .limits
                .disk_mb
                .saturating_mul(1 << 20),
            quota: probe.quota.map(Arc::new),
            detail: probe.detail,
        };
        let tracker = TaskTracker::new();
        let shutdown = CancellationToken::new();
        let spares = settings.cgroups.as_ref().ok().map(|c| {
            Arc::new(Spares::new(
                c.clone(),
                run_limits(&settings.config),
                SPARE_CGROUPS,
            ))
        });
        let backends = Backends::new(
            &settings.config,
            backend_store,
            BackendSettings {
                identity: BackendIdentity::lookup(settings.service),
                start_timeout: settings.backend_start_timeout,
                output_cap: settings
                    .config
                    .launcher
                    .limits
                    .output_cap_kb
                    .saturating_mul(1024),
            },
            tracker.clone(),
            shutdown.clone(),
        );
        Ok(Arc::new(Launcher {
            git: Git::new(settings.service),
            config: settings.config,
            data: settings.data,
            service: settings.service,
            agents,
            cgroups: settings.cgroups,
            bwrap: settings.bwrap,
            registry: Mutex::new(Registry::default()),
            tracker,
            shutdown,
            waiters: AtomicUsize::new(0),
            store,
            slot_store,
            walk_limits: WalkLimits::default(),
            backends: Arc::new(backends),
            staging,
            disk,
            spares,
        }))
    }

    pub fn service(&self) -> Owner {
        self.service
    }

    pub fn data(&self) -> &DataDir {
        &self.data
    }

    pub fn cgroups(&self) -> &Result<Cgroups, String> {
        &self.cgroups
    }

    pub fn bwrap(&self) -> &std::path::Path {
        &self.bwrap
    }

    /// Cancelled to stop serving and to stop every run.
    pub fn shutdown_token(&self) -> CancellationToken {
        self.shutdown.clone()
    }

    /// Stops every run (killing its sandbox, handing its workspace back) and waits for every
    /// background task.
    pub async fn shut_down(&self) {
        self.shutdown.cancel();
        self.tracker.close();
        self.tracker.wait().await;
        if let Some(spares) = &self.spares
            && let Err(e) = spares.clear()
        {
            tracing::warn!(error = %e, "cannot remove the spare cgroups");
        }
    }

    /// Tops the spare cgroups up in the background (after a start took one, at startup).
    fn refill_spares(&self) {
        let Some(spares) = self.spares.as_ref().map(Arc::clone) else {
            return;
        };
        self.tracker.spawn(async move {
            match tokio::task::spawn_blocking(move || spares.refill()).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => tracing::warn!(error = %e, "cannot make spare cgroups"),
                Err(e) => tracing::warn!(error = %e, "cannot make spare cgroups"),
            }
        });
    }

    fn lock(&self) -> MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn event(&self, tid: &Tid, event: Event) -> Option<Phase> {
        let mut reg = self.lock();
        let entry = reg.runs.get_mut(tid)?;
        match entry.apply(event) {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::error!(%tid, error = %e, "invalid run transition");
                None
            }
        }
    }

    /// The cgroups to start something in: refused while shutting down or when the host has
    /// none.
    fn ready_cgroups(&self) -> Result<&Cgroups, LauncherError> {
        if self.shutdown.is_cancelled() {
            return Err(LauncherError::ShuttingDown);
        }
        self.cgroups
            .as_ref()
            .map_err(|e| LauncherError::HostNotReady(e.clone()))
    }

    fn limits(&self) -> CgroupLimits {
        run_limits(&self.config)
    }

    fn output_cap(&self) -> u64 {
        self.config
            .launcher
            .limits
            .output_cap_kb
            .saturating_mul(1024)
    }

    /// Saves the run's record; the write (with its fsyncs) runs off the async threads, and is
    /// awaited, so records of one run are written in order.
    async fn persist(&self, tid: &Tid) {
        let record = {
            let reg = self.lock();
            let Some(e) = reg.runs.get(tid) else {
                return;
            };
            if e.kind != RunKind::Agent {
                return;
            }
            Record {
                tid: tid.clone(),
                kind: e.kind,
                finished: match e.phase {
                    Phase::Done(f) => Some(f),
                    Phase::Starting | Phase::Running | Phase::Stopping(_) | Phase::Finishing(_) => {
                        None
                    }
                },
                outcome: e.outcome.clone(),
                workspace_gid: e.workspace_gid,
                agent_uid: e.agent_uid,
            }
        };
        let store = self.store.clone();
        match tokio::task::spawn_blocking(move || store.save(&record)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(%tid, error = %e, "cannot persist run state"),
            Err(e) => tracing::error!(%tid, error = %e, "cannot persist run state"),
        }
    }

    // === runs ===

    /// `POST /agents`.
    pub async fn start_agent(
        self: &Arc<Self>,
        req: AgentRequest,
    ) -> Result<AgentStatus, LauncherError> {
        let tid = validate::tid(&req.tid)?;
        let model = validate::model(&self.config, &req.model)?.id.clone();
        let args = validate::cmd(&req.cmd)?;
        let env = validate::env(&self.config, &req.env)?;
        let timeout = validate::timeout(
            req.timeout_s,
            self.config.launcher.limits.max_agent_timeout_s,
        )?;
        let token = validate::token(req.token.as_deref())?;
        let stdin = validate::stdin(req.stdin.as_deref())?.map(str::to_owned);
        let venv = req
            .venv
            .as_deref()
            .map(|v| validate::venv(&self.config, v))
            .transpose()?;
        let gateway = self.data.gateway_dir(&tid)?.into_fd();
        let env = bwrap::environment(&env, venv.is_some(), token.as_ref(), true);
        let spec = RunSpec {
            tid: tid.clone(),
            kind: RunKind::Agent,
            model: Some(model),
            program: Program::Claude { args },
            env,
            venv,
            gateway: Some(gateway),
            timeout,
            stdin,
        };
        self.start(spec).await?;
        self.status_of(&tid)
    }

    /// `POST /checks`: runs to completion within the request. If the client goes away, the
    /// check still runs to its end (bounded by its timeout) and the workspace is handed back.
    pub async fn run_check(
        self: &Arc<Self>,
        req: CheckRequest,
    ) -> Result<CheckResult, LauncherError> {
        let tid = validate::tid(&req.tid)?;
        validate::command(&req.command)?;
        let timeout = validate::timeout(
            req.timeout_s,
            self.config.launcher.limits.max_check_timeout_s,
        )?;
        let venv = req
            .venv
            .as_deref()
            .map(|v| validate::venv(&self.config, v))
            .transpose()?;
        let env = bwrap::environment(&BTreeMap::new(), venv.is_some(), None, false);
        let spec = RunSpec {
            tid: tid.clone(),
            kind: RunKind::Check,
            model: None,
            program: Program::Bash {
                command: req.command,
            },
            env,
            venv,
            gateway: None,
            timeout,
            stdin: None,
        };
        let mut rx = self.start(spec).await?;
        // An error means the entry was dropped, which only a replaced run can do.
        let _ = rx.wait_for(|p| p.is_done()).await;
        let (phase, outcome) = {
            let reg = self.lock();
            let e = reg
                .runs
                .get(&tid)
                .ok_or(LauncherError::Internal("check vanished"))?;
            (e.phase, e.outcome.clone())
        };
        let cap = self.output_cap();
        let result = CheckResult {
            tid: tid.to_string(),
            exit_code: outcome.exit_code,
            oom_killed: outcome.oom_killed,
            timed_out: phase == Phase::Done(Final::TimedOut),
            disk_exceeded: outcome.disk_exceeded,
            setup_failed: outcome.setup_failed,
            stdout: self
                .data
                .read_log(&tid, LogKind::Check, Stream::Stdout, cap),
            stderr: self
                .data
                .read_log(&tid, LogKind::Check, Stream::Stderr, cap),
            truncated: outcome.truncated,
        };
        self.data.remove_logs(&tid, LogKind::Check);
        if let Some(err) = outcome.error {
            tracing::warn!(%tid, error = %err, "check finished with an error");
        }
        Ok(result)
    }

    async fn start(
        self: &Arc<Self>,
        spec: RunSpec,
    ) -> Result<watch::Receiver<Phase>, LauncherError> {
        let cgroups = self.ready_cgroups()?;
        let stop = self.shutdown.child_token();
        let agent = self
            .agents
            .take()
            .ok_or_else(|| LauncherError::NoAgentUid(self.agents.describe()))?;
        let rx = {
            let mut reg = self.lock();
            let entry = Entry::new(spec.kind, spec.model.clone(), stop.clone(), 0, agent.uid);
            let rx = entry.watch.subscribe();
            let reserved = reg
                .reserve(&spec.tid, entry)
                .map_err(|phase| LauncherError::Conflict(format!("task {} is {phase}", spec.tid)));
            drop(reg);
            if reserved.is_err() {
                self.agents.give_back(agent);
            }
            reserved?;
            rx
        };
        let tid = spec.tid.clone();
        let kind = spec.kind;
        let timeout = spec.timeout;
        let cgroups = cgroups.clone();
        // Launching runs in a task of its own: the request can be dropped at any await (the
        // client went away), and a launch cut short would leave the tid reserved forever and
        // the workspace with the agent uid. The request only waits for the outcome.
        let (launched, outcome) = tokio::sync::oneshot::channel();
        let me = Arc::clone(self);
        self.tracker.spawn(async move {
            match me.launch(spec, agent, &cgroups).await {
                Ok(running) => {
                    me.event(&tid, Event::Spawned);
                    me.persist(&tid).await;
                    // The requester may be gone; the run goes on regardless.
                    let _ = launched.send(Ok(()));
                    me.supervise(tid, kind, running, timeout, stop).await;
                }
                Err(failed) => {
                    // Nothing ran: forget the reservation rather than keep a "failed" run
                    // around.
                    me.lock().runs.remove(&tid);
                    if failed.agent_free {
                        me.agents.give_back(agent);
                    } else {
                        tracing::error!(%tid, uid = agent.uid, "agent uid kept: its workspace was not handed back");
                    }
                    let _ = launched.send(Err(failed.error));
                }
            }
        });
        outcome
            .await
            .map_err(|_| LauncherError::Internal("the launch task vanished"))??;
        Ok(rx)
    }

    async fn launch(
        self: &Arc<Self>,
        spec: RunSpec,
        agent: Owner,
        cgroups: &Cgroups,
    ) -> Result<Running, LaunchFailed> {
        let tid = &spec.tid;
        let ws = self.data.workspace(tid)?;
        let workspace_gid = ws.identity().gid;
        if let Some(e) = self.lock().runs.get_mut(tid) {
            e.workspace_gid = workspace_gid;
        }
        let workspace = ws.into_fd();
        let walk_fd = workspace.try_clone().map_err(LauncherError::Dup)?;
        let (limits, bytes, quota) = (
            self.walk_limits,
            self.disk.bytes,
            self.disk.quota.as_ref().map(Arc::clone),
        );
        let walk_tid = tid.clone();
        let handing_over = tokio::task::spawn_blocking(move || {
            let report = walk::hand_over(walk_fd.as_fd(), agent, limits)?;
            Ok::<_, walk::WalkError>(limit_disk(
                &walk_tid,
                quota.as_deref(),
                walk_fd.as_fd(),
                agent,
                (bytes, report.bytes),
                limits,
            ))
        });
        // While the hand-over (and the disk limit) takes its blocking hop, this task stages the
        // mounts, takes a cgroup, starts bwrap behind its gate and then creates the logs: bwrap builds
        // the namespaces, mounts and root (most of a start) and then waits right before it
        // executes the command. None of that depends on who owns the workspace's files, and the
        // command runs only once the gate opens, after the hand-over succeeded. The hand-over's
        // report is the usage the watcher needs; no third walk measures it.
        let started = match self.prepare(&spec, cgroups, workspace.as_fd()).await {
            Ok(p) => self.spawn_sandbox(&spec, agent, p).await,
            Err(e) => Err(e),
        };
        let handed = match handing_over.await {
            Ok(handed) => handed,
            Err(e) => {
                if let Ok(s) = started {
                    self.call_off(tid, s).await;
                }
                return Err(e.into());
            }
        };
        let disk = match handed {
            Ok(disk) => disk,
            Err(e) => {
                if let Ok(s) = started {
                    self.call_off(tid, s).await;
                }
                // The scan refuses before anything changes, but the tree can change under the
                // second pass (the service user still owns the names): whatever was already
                // given to the agent uid goes back, or the next request would find a foreign
                // workspace.
                let mut agent_free = true;
                if e.changed_anything()
                    && let Err(back) = self.hand_back(&workspace, workspace_gid).await
                {
                    tracing::error!(%tid, error = %back, "cannot hand the workspace back after a failed hand-over");
                    agent_free = false;
                }
                return Err(LaunchFailed {
                    error: LauncherError::HandOver(e),
                    agent_free,
                });
            }
        };
        let started = match started {
            Ok(mut s) => match s.sandbox.gate.take().map(bwrap::Gate::open).transpose() {
                Ok(_) => Ok(s),
                Err(source) => {
                    self.call_off(tid, s).await;
                    Err(LauncherError::Spawn(bwrap::SpawnError::Io {
                        what: "opening the start gate".to_owned(),
                        source,
                    }))
                }
            },
            Err(e) => Err(e),
        };
        match started {
            Ok(Started {
                sandbox,
                cgroup,
                captures,
                staged,
                log_kind: _,
            }) => Ok(Running {
                child: sandbox.child,
                status: sandbox.status,
                cgroup,
                captures,
                workspace,
                workspace_gid,
                staged,
                agent,
                disk,
            }),
            Err(error) => {
                let (released, back) = self.give_back(&workspace, disk, workspace_gid).await;
                if let Err(e) = released {
                    tracing::error!(%tid, error = %e, "cannot release the disk limit after a failed start");
                }
                if let Err(back) = &back {
                    tracing::error!(%tid, error = %back, "cannot hand the workspace back after a failed start");
                }
                Err(LaunchFailed {
                    error,
                    agent_free: back.is_ok(),
                })
            }
        }
    }

    /// What bwrap needs to start besides the workspace's hand-over: the staged mounts and a
    /// cgroup. The logs come after the spawn, while bwrap builds the sandbox (its output waits
    /// in the pipes meanwhile).
    async fn prepare(
        &self,
        spec: &RunSpec,
        cgroups: &Cgroups,
        workspace: BorrowedFd<'_>,
    ) -> Result<Prepared, LauncherError> {
        let tid = &spec.tid;
        let log_kind = match spec.kind {
            RunKind::Agent => LogKind::Agent,
            RunKind::Check => LogKind::Check,
            RunKind::Slot => return Err(LauncherError::Internal("slots start through start_slot")),
        };
        let sources = Sources {
            workspace,
            gateway: spec.gateway.as_ref().map(AsFd::as_fd),
            venv: spec.venv.as_ref().map(AsFd::as_fd),
            home: None,
            tmp: None,
            server_dir: None,
            clients: None,
        };
        let staged = self.staging.stage(tid, sources)?;
        // Spares are topped up when a run ends, not here: making one now would contend with
        // this sandbox's start for the cgroup locks.
        let cgroup = match self.spares.as_ref().and_then(|s| s.take()) {
            Some(c) => c,
            None => cgroups.create(tid.as_str(), self.limits()).await?,
        };
        Ok(Prepared {
            staged,
            log_kind,
            cgroup,
        })
    }

    /// Starts bwrap behind its gate, then creates the logs and the tasks copying the output
    /// into them. A failure after the spawn calls the start off.
    async fn spawn_sandbox(
        self: &Arc<Self>,
        spec: &RunSpec,
        agent: Owner,
        prepared: Prepared,
    ) -> Result<Started, LauncherError> {
        let Prepared {
            staged,
            log_kind,
            cgroup,
        } = prepared;
        let limits = &self.config.launcher.limits;
        let plan = Plan {
            program: spec.program.clone(),
            env: spec.env.clone(),
            with_venv: spec.venv.is_some(),
            with_gateway: spec.gateway.is_some(),
            tmp_bytes: limits.tmp_mb.saturating_mul(1 << 20),
            home_bytes: limits.home_mb.saturating_mul(1 << 20),
            file_bytes: self.disk.bytes,
            claude_bin: self.config.launcher.claude_bin.clone(),
        };
        let dup = |fd: &OwnedFd| fd.try_clone().map_err(LauncherError::Dup);
        let mounts = (|| {
            Ok::<_, LauncherError>(Mounts {
                workspace: dup(&staged.mounts.workspace)?,
                venv: staged.mounts.venv.as_ref().map(dup).transpose()?,
                gateway: staged.mounts.gateway.as_ref().map(dup).transpose()?,
                home: None,
                tmp: None,
                server_dir: None,
                clients: None,
                attach: staged.mounts.attach.as_ref().map(dup).transpose()?,
            })
        })();
        let run_as = RunAs {
            uid: agent.uid,
            gid: agent.gid,
        };
        let spawned = mounts.and_then(|mounts| {
            Ok(bwrap::spawn(
                &plan,
                &mounts,
                &cgroup.join_files(),
                run_as,
                &self.bwrap,
                spec.stdin.as_deref().map(str::as_bytes),
                bwrap::Start::Gated,
            )?)
        });
        let mut sandbox = match spawned {
            Ok(c) => c,
            Err(e) => {
                let _ = cgroup.remove();
                return Err(e);
            }
        };
        let (out_file, err_file) = match self.data.create_logs(&spec.tid, log_kind) {
            Ok(files) => files,
            Err(e) => {
                let started = Started {
                    sandbox,
                    cgroup,
                    captures: Vec::new(),
                    staged,
                    log_kind,
                };
                self.call_off(&spec.tid, started).await;
                return Err(e.into());
            }
        };
        let cap = self.output_cap();
        let mut captures = Vec::new();
        if let Some(out) = sandbox.child.stdout.take() {
            let sink = tokio::fs::File::from_std(out_file);
            captures.push(self.tracker.spawn(proc::capture(out, sink, Some(cap))));
        }
        if let Some(err) = sandbox.child.stderr.take() {
            let sink = tokio::fs::File::from_std(err_file);
            captures.push(self.tracker.spawn(proc::capture(err, sink, Some(cap))));
        }
        Ok(Started {
            sandbox,
            cgroup,
            captures,
            staged,
            log_kind,
        })
    }

    /// Undoes a start whose command must not run (its hand-over failed): every process of the
    /// sandbox killed and waited for before its gate closes (closing it would let the command
    /// run), then the cgroup removed, the mounts released and the fresh logs removed. A sandbox
    /// that cannot be killed keeps its gate shut for the life of the launcher.
    async fn call_off(&self, tid: &Tid, started: Started) {
        let Started {
            mut sandbox,
            cgroup,
            captures,
            staged,
            log_kind,
        } = started;
        let killed = cgroup.kill_all().await;
        if let Err(e) = sandbox.child.start_kill() {
            tracing::warn!(%tid, error = %e, "cannot kill bwrap of a start called off");
        }
        if let Err(e) = sandbox.child.wait().await {
            tracing::warn!(%tid, error = %e, "cannot reap bwrap of a start called off");
        }
        match (killed, sandbox.gate.take()) {
            (Ok(()), Some(gate)) => gate.close_after_kill(),
            (Ok(()), None) => {}
            (Err(e), gate) => {
                tracing::error!(%tid, error = %e, "cannot kill a sandbox whose start was called off; its gate stays shut");
                drop(gate);
            }
        }
        for c in captures {
            let _ = c.await;
        }
        if let Err(e) = cgroup.remove() {
            tracing::warn!(%tid, error = %e, "cannot remove the cgroup of a run that did not start");
        }
        if let Err(e) = staged.release() {
            tracing::warn!(%tid, error = %e, "cannot release the mounts of a run that did not start");
        }
        self.data.remove_logs(tid, log_kind);
    }

    /// After the sandbox is gone: the disk limit released and the workspace handed back. Returns
    /// whether the workspace reached its limit (the quota's usage; in watch mode what the
    /// hand-back found, so no walk of its own measures the tree) and the hand-back's outcome.
    async fn give_back(
        &self,
        workspace: &OwnedFd,
        guard: DiskGuard,
        gid: u32,
    ) -> (
        Result<bool, String>,
        Result<walk::WalkReport, LauncherError>,
    ) {
        match guard {
            DiskGuard::Quota { .. } => {
                let released = self.release_disk(workspace, guard).await;
                (released, self.hand_back(workspace, gid).await)
            }
            DiskGuard::Watch { allowance } => {
                let back = self.hand_back(workspace, gid).await;
                let over = match &back {
                    Ok(report) => Ok(disk::Usage::found_by(report, self.walk_limits)
                        .over(allowance, self.walk_limits)
                        .is_some()),
                    // What is left is measured as it is.
                    Err(_) => self.release_disk(workspace, guard).await,
                };
                (over, back)
            }
        }
    }

    /// Whether the workspace reached its limit (the quota's usage, or a measurement), and the
    /// project's tags and limit removed.
    async fn release_disk(&self, workspace: &OwnedFd, guard: DiskGuard) -> Result<bool, String> {
        let fd = workspace.try_clone().map_err(|e| e.to_string())?;
        let limits = self.walk_limits;
        match guard {
            DiskGuard::Quota { project, limit } => {
                let Some(quota) = self.disk.quota.clone() else {
                    return Err("the project quota vanished".to_owned());
                };
                let used =
                    tokio::task::spawn_blocking(move || quota.release(fd.as_fd(), project, limits))
                        .await
                        .map_err(|e| e.to_string())?
                        .map_err(|e| format!("removing the project quota: {e}"))?;
                Ok(disk::quota_reached(used, limit))
            }
            DiskGuard::Watch { allowance } => {
                let usage = tokio::task::spawn_blocking(move || disk::measure(fd.as_fd(), limits))
                    .await
                    .map_err(|e| e.to_string())?
                    .map_err(|e| format!("measuring the workspace: {e}"))?;
                Ok(usage.over(allowance, limits).is_some())
            }
        }
    }

    async fn hand_back(
        &self,
        workspace: &OwnedFd,
        gid: u32,
    ) -> Result<walk::WalkReport, LauncherError> {
        let fd = workspace.try_clone().map_err(LauncherError::Dup)?;
        let to = Owner {
            uid: self.service.uid,
            gid,
        };
        let limits = self.walk_limits;
        tokio::task::spawn_blocking(move || walk::hand_back(fd.as_fd(), to, limits))
            .await?
            .map_err(LauncherError::HandBack)
    }

    /// Stops a sandbox for `reason` (recorded first; the first reason wins) by killing its
    /// cgroup, and waits for bwrap.
    async fn stop_sandbox(
        &self,
        tid: &Tid,
        reason: StopReason,
        cgroup: &TaskCgroup,
        child: &mut proc::Child,
    ) -> std::io::Result<std::process::ExitStatus> {
        self.event(tid, Event::Stop(reason));
        if let Err(e) = cgroup.kill_all().await {
            tracing::error!(%tid, error = %e, "cannot kill the sandbox");
        }
        child.wait().await
    }

    async fn supervise(
        self: Arc<Self>,
        tid: Tid,
        kind: RunKind,
        running: Running,
        timeout: Duration,
        stop: CancellationToken,
    ) {
        let Running {
            mut child,
            status: bwrap_status,
            cgroup,
            captures,
            workspace,
            workspace_gid,
            staged,
            agent,
            disk,
        } = running;
        let watched = match disk {
            DiskGuard::Watch { allowance } => workspace.try_clone().ok().map(|fd| (fd, allowance)),
            DiskGuard::Quota { .. } => None,
        };
        let walk_limits = self.walk_limits;
        let procs = cgroup.procs_file();
        let watcher = async move {
            match watched {
                Some((fd, allowance)) => disk::watch(fd, allowance, walk_limits, vec![procs]).await,
                None => std::future::pending().await,
            }
        };
        let mut disk_exceeded = false;
        // Whether bwrap ended by itself (not killed by us): only then can it have failed to set
        // the sandbox up.
        let mut ended_alone = false;
        let status = tokio::select! {
            s = child.wait() => {
                ended_alone = true;
                s
            }
            exceeded = watcher => {
                tracing::warn!(%tid, reason = %exceeded.reason, "disk limit reached: stopping the run");
                disk_exceeded = true;
                self.stop_sandbox(&tid, StopReason::DiskExceeded, &cgroup, &mut child).await
            }
            () = tokio::time::sleep(timeout) => {
                self.stop_sandbox(&tid, StopReason::Timeout, &cgroup, &mut child).await
            }
            () = stop.cancelled() => {
                // DELETE records its own reason before cancelling; the first reason wins.
                self.stop_sandbox(&tid, StopReason::Shutdown, &cgroup, &mut child).await
            }
        };
        let mut errors: Vec<String> = Vec::new();
        let mut exit_code = exit_code_of(status, &mut errors);
        let reported = bwrap_status.read();
        self.event(&tid, Event::ProcessGone);
        // Whatever outlived bwrap (a setsid'd daemon) dies before the workspace goes back.
        let oom_killed = kill_leftovers(&cgroup, &mut errors).await;
        // bwrap reports the command's exit only if it executed the command; an OOM kill may
        // take bwrap's monitor itself, so that one is not called a setup failure.
        let setup_failed = ended_alone && reported.exit_code.is_none() && !oom_killed;
        if setup_failed {
            tracing::warn!(%tid, bwrap_exit = ?exit_code, "bwrap failed to set the sandbox up");
            errors.push(format!(
                "the sandbox could not be set up: bwrap exited {} before running the command (its message is in stderr)",
                exit_code.map_or_else(|| "by a signal".to_owned(), |c| c.to_string())
            ));
            exit_code = None;
        }
        let truncated = release_sandbox(cgroup, staged, captures, &mut errors).await;
        self.refill_spares();
        let (released, back) = self.give_back(&workspace, disk, workspace_gid).await;
        match released {
            Ok(over) => disk_exceeded |= over,
            Err(e) => errors.push(e),
        }
        let handed_back = match back {
            Ok(report) => {
                // Its processes are dead (the cgroup is empty) and the workspace holds nothing
                // of it any more: the uid may serve the next run.
                self.agents.give_back(agent);
                if !report.skipped.is_empty() {
                    errors.push(format!(
                        "not handed back as they were: {}",
                        report.skipped_summary()
                    ));
                }
                true
            }
            Err(e) => {
                tracing::error!(%tid, uid = agent.uid, "agent uid kept: its workspace was not handed back");
                errors.push(e.to_string());
                false
            }
        };
        let mut result_commit = None;
        if kind == RunKind::Agent && handed_back && self.data.has_shadow(&tid) {
            let paths = TaskPaths::new(self.data.path(), &tid);
            let collected = match self.data.task_dir(&tid) {
                Ok(dir) => git::collect(&self.git, &tid, &paths, dir.into_fd())
                    .await
                    .map_err(LauncherError::from),
                Err(e) => Err(e.into()),
            };
            match collected {
                Ok(c) => result_commit = Some(c),
                Err(e) => errors.push(format!("collecting the result: {e}")),
            }
        }
        {
            let mut reg = self.lock();
            if let Some(e) = reg.runs.get_mut(&tid) {
                e.outcome = Outcome {
                    exit_code,
                    oom_killed,
                    disk_exceeded,
                    setup_failed,
                    truncated,
                    result_commit,
                    error: (!errors.is_empty()).then(|| errors.join("; ")),
                };
                let done = if setup_failed {
                    Event::SetupFailed
                } else {
                    Event::Done
                };
                if let Err(err) = e.apply(done) {
                    tracing::error!(%tid, error = %err, "invalid run transition");
                }
            }
        }
        self.persist(&tid).await;
        tracing::info!(%tid, ?kind, ?exit_code, oom_killed, disk_exceeded, "sandbox run finished");
    }

    // === queries ===

    fn status_of(&self, tid: &Tid) -> Result<AgentStatus, LauncherError> {
        let (phase, outcome) = {
            let reg = self.lock();
            match reg.runs.get(tid) {
                Some(e) if e.kind == RunKind::Agent => (e.phase, e.outcome.clone()),
                Some(_) | None => return Err(LauncherError::UnknownTask(tid.to_string())),
            }
        };
        let cap = self.output_cap();
        Ok(AgentStatus {
            tid: tid.to_string(),
            state: phase.state(),
            exit_code: outcome.exit_code,
            oom_killed: outcome.oom_killed,
            timed_out: phase == Phase::Done(Final::TimedOut),
            disk_exceeded: outcome.disk_exceeded,
            setup_failed: outcome.setup_failed,
            stdout: self.data.read_log(tid, LogKind::Agent, Stream::Stdout, cap),
            stderr: self.data.read_log(tid, LogKind::Agent, Stream::Stderr, cap),
            truncated: outcome.truncated,
            result_commit: outcome.result_commit,
            error: outcome.error,
        })
    }

    /// `GET /agents/{tid}`, optionally waiting until the run is done. The wait ends when the
    /// client disconnects, because the server drops this future.
    pub async fn agent_status(&self, tid: &str, wait: bool) -> Result<AgentStatus, LauncherError> {
        let tid = validate::tid(tid)?;
        if wait {
            let mut rx = {
                let reg = self.lock();
                match reg.runs.get(&tid) {
                    Some(e) if e.kind == RunKind::Agent => e.watch.subscribe(),
                    Some(_) | None => return Err(LauncherError::UnknownTask(tid.to_string())),
                }
            };
            let _guard = WaiterGuard::new(&self.waiters);
            let shutdown = self.shutdown.clone();
            tokio::select! {
                _ = rx.wait_for(|p| p.is_done()) => {}
                () = shutdown.cancelled() => {}
            }
        }
        self.status_of(&tid)
    }

    /// `DELETE /agents/{tid}`: kills the run if active (every process of its cgroup), waits for
    /// the workspace to be handed back, then forgets the run.
    pub async fn delete_agent(&self, tid: &str) -> Result<AgentStatus, LauncherError> {
        let tid = validate::tid(tid)?;
        let mut rx = {
            let mut reg = self.lock();
            let entry = reg
                .runs
                .get_mut(&tid)
                .ok_or_else(|| LauncherError::UnknownTask(tid.to_string()))?;
            if entry.kind != RunKind::Agent {
                return Err(LauncherError::UnknownTask(tid.to_string()));
            }
            if entry.is_active() {
                if let Err(e) = entry.apply(Event::Stop(StopReason::Deleted)) {
                    tracing::error!(%tid, error = %e, "invalid run transition");
                }
                entry.stop.cancel();
            }
            entry.watch.subscribe()
        };
        let _ = rx.wait_for(|p| p.is_done()).await;
        let status = self.status_of(&tid)?;
        {
            let mut reg = self.lock();
            if reg.runs.get(&tid).is_some_and(|e| !e.is_active()) {
                reg.runs.remove(&tid);
            }
        }
        if let Err(e) = self.store.remove(&tid) {
            tracing::error!(%tid, error = %e, "cannot remove the run's state");
        }
        self.data.remove_logs(&tid, LogKind::Agent);
        Ok(status)
    }

    /// `GET /status`: the runs in progress, the number of waiting clients, the backends, and
    /// `host` (probed by the caller).
    pub fn status(&self, host: HostStatus) -> LauncherStatus {
        let reg = self.lock();
        let mut agents = Vec::new();
        let mut checks = Vec::new();
        let mut slots = Vec::new();
        let mut finished = 0;
        for (tid, e) in &reg.runs {
            if !e.is_active() {
                finished += 1;
                continue;
            }
            let item = RunSummary {
                tid: tid.to_string(),
                state: e.phase.state(),
            };
            match e.kind {
                RunKind::Agent => agents.push(item),
                RunKind::Check => checks.push(item),
                RunKind::Slot => slots.push(item),
            }
        }
        agents.sort_by(|a, b| a.tid.cmp(&b.tid));
        checks.sort_by(|a, b| a.tid.cmp(&b.tid));
        slots.sort_by(|a, b| a.tid.cmp(&b.tid));
        drop(reg);
        LauncherStatus {
            agents,
            checks,
            slots,
            finished,
            waiters: self.waiters.load(Ordering::SeqCst),
            backends: self.backends.statuses(&self.busy_models()),
            ready: host.ready,
            host,
            capabilities: agentbox_http::privs::current().ok(),
            disk: Some(DiskStatus {
                mode: match self.disk.quota {
                    Some(_) => DiskMode::ProjectQuota,
                    None => DiskMode::Watcher,
                },
                limit_mb: self.config.launcher.limits.disk_mb,
                detail: self.disk.detail.clone(),
            }),
        }
    }

    // === vLLM backends ===

    /// Running agents per model: an agent counts from its reservation until its sandbox is
    /// gone.
    fn busy_models(&self) -> Busy {
        let reg = self.lock();
        let mut busy = Busy::new();
        for e in reg.runs.values() {
            if e.kind == RunKind::Agent
                && e.phase.sandbox_may_run()
                && let Some(model) = &e.model
            {
                *busy.entry(model.clone()).or_default() += 1;
            }
        }
        busy
    }

    /// `POST /backends/{model}/start`.
    pub async fn start_backend(&self, model: &str) -> Result<BackendStartResult, LauncherError> {
        let m = validate::model(&self.config, model)?;
        match &m.backend {
            Backend::Vllm { .. } => {}
            Backend::Ollama { .. } | Backend::Remote { .. } | Backend::Router { .. } => {
                return Err(LauncherError::NotVllm(format!("{:?}", m.id.as_str())));
            }
        }
        let cgroups = self.ready_cgroups()?;
        Ok(self
            .backends
            .start(&m.id, &self.data, cgroups, &|| self.busy_models())
            .await?)
    }

    /// `POST /backends/vllm/stop`.
    pub async fn stop_backends(&self) -> Result<BackendStopResult, LauncherError> {
        Ok(self.backends.stop_all(&|| self.busy_models()).await?)
    }

    // === git helpers ===

    /// `POST /repo/snapshot`.
    pub async fn snapshot(&self, req: SnapshotRequest) -> Result<SnapshotResult, LauncherError> {
        let tid = validate::tid(&req.tid)?;
        let repo = git::discover(
            &self.config.launcher.repo_roots,
            &req.path,
            self.service.uid,
        )
        .await?;
        let spec = req.git_ref.as_deref().unwrap_or("HEAD");
        let sha = git::resolve_commit(&self.git, &repo, spec).await?;
        if self.lock().runs.get(&tid).is_some_and(Entry::is_active) {
            return Err(LauncherError::Conflict(format!("task {tid} is running")));
        }
        let task_dir = self.data.ensure_task_dir(&tid)?;
        let paths = TaskPaths::new(self.data.path(), &tid);
        for what in ["shadow.git", "workspace"] {
            if DataDir::has_entry(&task_dir, what) {
                return Err(LauncherError::Conflict(format!(
                    "tasks/{tid}/{what} already exists"
                )));
            }
        }
        git::snapshot(&self.git, &repo, &sha, &paths).await?;
        Ok(SnapshotResult {
            repo: repo.top.display().to_string(),
            sha,
        })
    }

    /// `POST /repo/deliver`.
    pub async fn deliver(&self, req: DeliverRequest) -> Result<DeliverResult, LauncherError> {
        let tid = validate::tid(&req.tid)?;
        let branch = AgentBranch::parse(&req.branch)
            .map_err(|e| LauncherError::InvalidBranch(e.to_string()))?;
        if branch.tid() != &tid {
            return Err(LauncherError::InvalidBranch(format!(
                "{branch} is not agent/{tid}"
            )));
        }
        let repo = git::discover(
            &self.config.launcher.repo_roots,
            &req.path,
            self.service.uid,
        )
        .await?;
        if !self.data.has_shadow(&tid) {
            return Err(LauncherError::Missing(format!(
                "task {tid} has no snapshot"
            )));
        }
        if self.lock().runs.get(&tid).is_some_and(Entry::is_active) {
            return Err(LauncherError::Conflict(format!("task {tid} is running")));
        }
        let paths = TaskPaths::new(self.data.path(), &tid);
        let sha = git::deliver(&self.git, &repo, &branch, &paths).await?;
        Ok(DeliverResult {
            repo: repo.top.display().to_string(),
            branch: branch.to_string(),
            sha,
        })
    }

    /// `POST /repo/delete-branch`.
    pub async fn delete_branch(
        &self,
        req: DeleteBranchRequest,
    ) -> Result<DeleteBranchResult, LauncherError> {
        let branch = AgentBranch::parse(&req.branch)
            .map_err(|e| LauncherError::InvalidBranch(e.to_string()))?;
        let repo = git::discover(
            &self.config.launcher.repo_roots,
            &req.path,
            self.service.uid,
        )
        .await?;
        let sha = git::delete_branch(&self.git, &repo, &branch).await?;
        Ok(DeleteBranchResult {
            repo: repo.top.display().to_string(),
            branch: branch.to_string(),
            sha,
        })
    }

    // === restart ===

    /// After a restart: removes leftover staging directories, stops recorded backends that
    /// still run, kills every process left in our cgroups (sandboxes and backends), then
    /// restores the persisted runs; a run that was still active is handed back and reported as
    /// `lost`.
    pub async fn recover(&self) {
        self.staging.clean_all();
        self.backends.recover();
        if let Ok(cg) = &self.cgroups {
            for name in cg.list() {
                if let Some(task) = cg.open(&name) {
                    let pids = task.pids().unwrap_or_default();
                    if !pids.is_empty() {
                        tracing::warn!(cgroup = %name, ?pids, "killing an orphaned sandbox");
                    }
                    if let Err(e) = task.kill_all().await {
                        tracing::error!(cgroup = %name, error = %e, "cannot kill an orphaned sandbox");
                    }
                    if let Err(e) = task.remove() {
                        tracing::error!(cgroup = %name, error = %e, "cannot remove an orphaned cgroup");
                    }
                }
            }
        }
        self.recover_slots();
        // After the orphaned cgroups were removed above, which would have taken them too.
        self.refill_spares();
        for record in self.store.load_all() {
            let tid = record.tid.clone();
            let (fin, outcome) = match record.finished {
                Some(f) => (f, record.outcome),
                None => {
                    let mut outcome = record.outcome;
                    let mut why = vec!["the launcher stopped while this run was active".to_owned()];
                    let mut handed_back = false;
                    match self
                        .data
                        .workspace_for_recovery(&tid, |uid| self.agents.contains_uid(uid))
                    {
                        Ok(ws) => {
                            if let (Some(_), Some(project)) = (&self.disk.quota, record.agent_uid)
                                && let Err(e) = self
                                    .release_disk(&ws, DiskGuard::Quota { project, limit: 0 })
                                    .await
                            {
                                why.push(e);
                            }
                            match self.hand_back(&ws, record.workspace_gid).await {
                                Ok(_) => handed_back = true,
                                Err(e) => why.push(e.to_string()),
                            }
                        }
                        Err(e) => why.push(format!("workspace: {e}")),
                    }
                    if !handed_back && let Some(uid) = record.agent_uid {
                        self.agents.keep(uid);
                    }
                    outcome.error = Some(why.join("; "));
                    (Final::Lost, outcome)
                }
            };
            self.lock().runs.insert(
                tid.clone(),
                Entry::finished(record.kind, fin, outcome, record.workspace_gid),
            );
            self.persist(&tid).await;
        }
    }
}
