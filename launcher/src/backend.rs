//! Local vLLM backends: one supervised server process per `[models.<id>] backend = "vllm"`,
//! started on demand by `POST /backends/{model}/start`, at most one at a time (a GPU box holds
//! one model), stopped by `POST /backends/vllm/stop`, on launcher shutdown, and found again
//! after a launcher crash.
//!
//! # Life of a backend
//! ```text
//! Stopped|Failed ──Launch──► Starting ──Healthy──► Healthy
//!                               │  │                  │  │
//!                               │  └──Stop──► Stopping ◄──Stop
//!                               │                │        │
//!                         Gone  ▼          Gone  ▼        ▼ Gone
//!                            Failed           Stopped   Failed
//! ```
//! `Starting` means spawned and polling `GET http://127.0.0.1:<port>/health` until it answers
//! 200; a process that exits first, or is not healthy within the start timeout (killed then),
//! ends `Failed` with the reason and the last line of its stderr. A stop requested at any
//! point wins: the process is then `Stopped`, whatever else happened meanwhile. Only the
//! supervisor task of a process applies `Healthy` and `Gone`; requests apply `Launch` and
//! `Stop`.
//!
//! # One at a time, and busy backends
//! A start or stop-all holds the switch lock from its first check to its end, so switches are
//! serialized without holding any lock across a process's life. Starting model B first stops
//! every other active backend, unless one is *busy*, i.e. an agent of its model may still run
//! (its sandbox exists): then the start answers 409 and nothing is stopped. Stop-all answers
//! 409 while any agent of any vLLM model runs. Starting a backend that is already healthy
//! answers 200 at once. An agent may be started while its backend is down or being switched
//! away; the busy rule protects agents that run, it does not make agents wait for backends.
//!
//! # The process
//! The configured `command` runs as the service user (the identity that already owns the data
//! directory and talks to the model through the gateway), never as root: a model server parses
//! prompts that agents write, so a bug in it must not be worth root. Its supplementary groups
//! are the service user's from the group database (GPU device nodes are often group-owned),
//! or none when the uid has no passwd entry. It leads its own session and process group, lives
//! in its own cgroup (`backend.<model>` beside the sandboxes' cgroups; no limits, the cgroup
//! only makes "every process it started" exact), and gets a cleared environment: `PATH`,
//! `HOME` (the service user's home, or `backends/<model>/home`), `USER`/`LOGNAME` when known,
//! `LANG`. Anything else a server needs (`CUDA_VISIBLE_DEVICES`, `HF_HOME`) belongs in the
//! command itself, e.g. `["env", "HF_HOME=/srv/hf", "vllm", "serve", ...]`, so the config
//! shows everything the server gets. Its working directory is `/`.
//!
//! stdout and stderr go to `$AGENTBOX_DATA/backends/<model>/{stdout,stderr}` (root-owned,
//! readable by the service group): when a file reaches `limits.output_cap_kb` it becomes
//! `<name>.1` and a fresh file starts, so at most twice the cap is kept and it is the latest
//! output; each start also moves the previous run's logs to `.1`.
//!
//! Stopping sends SIGTERM to the process group (vLLM frees the GPU cleanly on it), waits
//! [`STOP_GRACE`], then kills whatever is left in the cgroup.
//!
//! # Restart: stop, don't re-adopt
//! The parent-death signal kills a backend's leader when the launcher dies, and a restarted
//! launcher kills everything left in its cgroups, backend cgroups included; in addition each
//! running backend is recorded in `state/backends/<model>.json` (pid, start time, boot id), and
//! a restart kills the recorded process group if that very process still exists. Re-adopting
//! was rejected: the output pipes died with the old launcher (a server writing its log would
//! get `EPIPE`), a process that is not our child cannot be reaped or its exit status read, and
//! the restart already killed every agent that was using the backend. The cost is reloading the
//! model on the next start.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::{Read, Seek, SeekFrom};
use std::net::Ipv4Addr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::process::{ExitStatus, Stdio};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use agentbox_policy::config::{Backend, Config, ModelId};
use bytes::Bytes;
use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use agentbox_sandbox::cgroup::{Cgroups, TaskCgroup};
use agentbox_sandbox::proc::{self, ChildSetup, Sink};
use agentbox_sandbox::walk::Owner;

use crate::api::{BackendStartResult, BackendState, BackendStatus, BackendStopResult};
use crate::layout::{DataDir, DataError};

use crate::state::{BackendRecord, BackendStore};

/// Why a backend request failed. Mapped to HTTP in [`crate::error`].
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The backend exited, or did not become healthy in time, while starting.
    #[error("backend failed: {0}")]
    Failed(String),
    /// Another backend has running agents (or, for stop-all, any has).
    #[error("conflict: {0}")]
    InUse(String),
    /// A stop came in while this start waited.
    #[error("conflict: backend {0} was stopped while starting")]
    StoppedWhileStarting(ModelId),
    /// The launcher is shutting down.
    #[error("the launcher is shutting down")]
    ShuttingDown,
    /// The backend's directory in the data dir is refused or failed.
    #[error(transparent)]
    Data(#[from] DataError),
    /// A fresh log file could not be created.
    #[error("backends/{model}/{name}: {source}")]
    Log {
        model: ModelId,
        name: &'static str,
        #[source]
        source: Errno,
    },
    /// The model has no slot although validation said it is a vLLM model (a bug).
    #[error("no backend slot for {0}")]
    NoSlot(ModelId),
    /// A transition the state machine refuses (a bug).
    #[error(transparent)]
    Transition(#[from] BadBackendTransition),
}

/// How long a vLLM server may take to answer `/health` with 200 by default: loading a large
/// model and capturing CUDA graphs takes minutes.
pub const DEFAULT_START_TIMEOUT: Duration = Duration::from_secs(900);
/// Pause between failed health probes.
const HEALTH_INTERVAL: Duration = Duration::from_millis(250);
/// Bound on one health probe (connect, request, response head).
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a backend may take to exit after SIGTERM before everything in its cgroup is killed.
pub const STOP_GRACE: Duration = Duration::from_secs(10);
/// How long output capture may lag behind the death of every backend process.
const CAPTURE_GRACE: Duration = Duration::from_secs(10);
/// `PATH` of backend processes.
const PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// Bytes of the end of stderr read for a failure message, and the longest line kept.
const TAIL_BYTES: u64 = 4096;
const TAIL_LINE: usize = 300;

/// Where a backend is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendPhase {
    Stopped,
    Starting,
    Healthy,
    Stopping,
    Failed,
}

/// What happened to a backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendEvent {
    /// A start request is about to spawn the process.
    Launch,
    /// `GET /health` answered 200.
    Healthy,
    /// A stop was requested (stop-all, a switch, shutdown).
    Stop,
    /// The process and everything in its cgroup are gone (or it never started).
    Gone,
}

/// An event that makes no sense in the current phase (a bug in the caller).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("backend event {event:?} is not valid in phase {phase:?}")]
pub struct BadBackendTransition {
    pub phase: BackendPhase,
    pub event: BackendEvent,
}

impl BackendPhase {
    /// The phase after `event`.
    pub fn next(self, event: BackendEvent) -> Result<BackendPhase, BadBackendTransition> {
        use BackendEvent as E;
        use BackendPhase as P;
        match (self, event) {
            (P::Stopped | P::Failed, E::Launch) => Ok(P::Starting),
            (P::Starting, E::Healthy) => Ok(P::Healthy),
            (P::Starting | P::Healthy | P::Stopping, E::Stop) | (P::Stopping, E::Healthy) => {
                Ok(P::Stopping)
            }
            (P::Starting | P::Healthy, E::Gone) => Ok(P::Failed),
            (P::Stopping, E::Gone) => Ok(P::Stopped),
            (P::Stopped, E::Stop) => Ok(P::Stopped),
            (P::Failed, E::Stop) => Ok(P::Failed),
            (P::Starting | P::Healthy | P::Stopping, E::Launch)
            | (P::Healthy, E::Healthy)
            | (P::Stopped | P::Failed, E::Healthy | E::Gone) => {
                Err(BadBackendTransition { phase: self, event })
            }
        }
    }

    /// Whether a process may exist.
    pub fn is_active(self) -> bool {
        match self {
            BackendPhase::Starting | BackendPhase::Healthy | BackendPhase::Stopping => true,
            BackendPhase::Stopped | BackendPhase::Failed => false,
        }
    }

    /// Whether the phase only changes on a new request (no transition is under way).
    pub fn is_settled(self) -> bool {
        match self {
            BackendPhase::Stopped | BackendPhase::Healthy | BackendPhase::Failed => true,
            BackendPhase::Starting | BackendPhase::Stopping => false,
        }
    }

    /// The `state` of the API.
    pub fn state(self) -> BackendState {
        match self {
            BackendPhase::Stopped => BackendState::Stopped,
            BackendPhase::Starting => BackendState::Starting,
            BackendPhase::Healthy => BackendState::Healthy,
            BackendPhase::Stopping => BackendState::Stopping,
            BackendPhase::Failed => BackendState::Failed,
        }
    }

    /// The `state` string of the API.
    pub fn as_str(self) -> &'static str {
        self.state().as_str()
    }
}

impl fmt::Display for BackendPhase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Running agents per model; a backend with any is busy.
pub type Busy = BTreeMap<ModelId, usize>;

/// Who backend processes run as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendIdentity {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups.
    pub groups: Vec<u32>,
    /// The passwd name, for `USER` and `LOGNAME`.
    pub name: Option<String>,
    /// The passwd home, if it exists; else the backend gets `backends/<model>/home`.
    pub home: Option<PathBuf>,
}

impl BackendIdentity {
    /// The service user as the passwd and group databases describe it (uid and gid as given).
    pub fn lookup(service: Owner) -> BackendIdentity {
        use nix::unistd::{Gid, Uid, User, getgrouplist};
        let user = User::from_uid(Uid::from_raw(service.uid)).ok().flatten();
        let groups = user
            .as_ref()
            .and_then(|u| std::ffi::CString::new(u.name.as_bytes()).ok())
            .and_then(|name| getgrouplist(&name, Gid::from_raw(service.gid)).ok())
            .map(|gs| gs.into_iter().map(Gid::as_raw).collect())
            .unwrap_or_default();
        BackendIdentity {
            uid: service.uid,
            gid: service.gid,
            groups,
            name: user.as_ref().map(|u| u.name.clone()),
            home: user.map(|u| u.dir).filter(|d| d.is_dir()),
        }
    }
}

/// Fixed settings of the backend supervisor.
#[derive(Debug, Clone)]
pub struct BackendSettings {
    pub identity: BackendIdentity,
    pub start_timeout: Duration,
    /// Per log file, bytes.
    pub output_cap: u64,
}

/// One configured backend.
#[derive(Debug)]
struct Slot {
    port: u16,
    command: Vec<String>,
    phase: BackendPhase,
    pid: Option<u32>,
    error: Option<String>,
    /// Cancelled to stop the current process; a fresh one per launch.
    stop: CancellationToken,
    /// Follows `phase` for the requests that wait on it.
    watch: watch::Sender<BackendPhase>,
}

impl Slot {
    fn apply(&mut self, event: BackendEvent) -> Result<BackendPhase, BadBackendTransition> {
        let next = self.phase.next(event)?;
        self.phase = next;
        self.watch.send_replace(next);
        Ok(next)
    }

    /// Asks the current process to stop; returns whether it was starting or healthy.
    fn request_stop(&mut self, model: &ModelId) -> bool {
        let was_up = matches!(self.phase, BackendPhase::Starting | BackendPhase::Healthy);
        if let Err(e) = self.apply(BackendEvent::Stop) {
            tracing::error!(%model, error = %e, "invalid backend transition");
        }
        self.stop.cancel();
        was_up
    }
}

/// The data-directory side of a launch.
struct Prepared {
    /// `backends/<model>/`, where the logs are created and rotated.
    dir: OwnedFd,
    home: PathBuf,
    stdout: std::fs::File,
    stderr: std::fs::File,
}

/// A spawned backend handed to its supervisor.
struct Spawned {
    child: tokio::process::Child,
    pid: u32,
    cgroup: TaskCgroup,
    captures: Vec<tokio::task::JoinHandle<proc::Captured>>,
    dir: Arc<OwnedFd>,
}

/// Every vLLM backend of the catalogue.
#[derive(Debug)]
pub struct Backends {
    slots: Mutex<BTreeMap<ModelId, Slot>>,
    /// Held by a start or a stop-all from its first check to its end.
    switch: tokio::sync::Mutex<()>,
    store: BackendStore,
    settings: BackendSettings,
    tracker: TaskTracker,
    shutdown: CancellationToken,
}

impl Backends {
    /// One stopped slot per vLLM model of `config`. Supervisors are spawned on `tracker` and
    /// stop when `shutdown` is cancelled.
    pub fn new(
        config: &Config,
        store: BackendStore,
        settings: BackendSettings,
        tracker: TaskTracker,
        shutdown: CancellationToken,
    ) -> Backends {
        let mut slots = BTreeMap::new();
        for (id, model) in &config.models {
            match &model.backend {
                Backend::Vllm { port, command, .. } => {
                    slots.insert(
                        id.clone(),
                        Slot {
                            port: *port,
                            command: command.clone(),
                            phase: BackendPhase::Stopped,
                            pid: None,
                            error: None,
                            stop: CancellationToken::new(),
                            watch: watch::Sender::new(BackendPhase::Stopped),
                        },
                    );
                }
                Backend::Ollama { .. } | Backend::Remote { .. } | Backend::Router { .. } => {}
            }
        }
        Backends {
            slots: Mutex::new(slots),
            switch: tokio::sync::Mutex::new(()),
            store,
            settings,
            tracker,
            shutdown,
        }
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<ModelId, Slot>> {
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn event(&self, model: &ModelId, event: BackendEvent) -> Option<BackendPhase> {
        let mut slots = self.lock();
        let slot = slots.get_mut(model)?;
        match slot.apply(event) {
            Ok(p) => Some(p),
            Err(e) => {
                tracing::error!(%model, error = %e, "invalid backend transition");
                None
            }
        }
    }

    fn view(model: &ModelId, slot: &Slot, busy: &Busy) -> BackendStatus {
        BackendStatus {
            model: model.to_string(),
            state: slot.phase.state(),
            pid: slot.pid,
            port: slot.port,
            agents: busy.get(model).copied().unwrap_or(0),
            error: slot.error.clone(),
        }
    }

    /// Every backend, for `GET /status`.
    pub fn statuses(&self, busy: &Busy) -> Vec<BackendStatus> {
        self.lock()
            .iter()
            .map(|(id, slot)| Self::view(id, slot, busy))
            .collect()
    }

    /// `POST /backends/{model}/start` for a vLLM model of the catalogue: stops the other idle
    /// backends, starts this one and waits until it is healthy. `busy` is asked at decision
    /// time.
    pub async fn start(
        self: &Arc<Self>,
        model: &ModelId,
        data: &DataDir,
        cgroups: &Cgroups,
        busy: &(dyn Fn() -> Busy + Sync),
    ) -> Result<BackendStartResult, BackendError> {
        let _switch = self.switch.lock().await;
        let mut stopped: BTreeSet<String> = BTreeSet::new();
        loop {
            if self.shutdown.is_cancelled() {
                return Err(BackendError::ShuttingDown);
            }
            let busy_now = busy();
            let waits = {
                let mut slots = self.lock();
                let me = slots
                    .get(model)
                    .ok_or_else(|| BackendError::NoSlot(model.clone()))?;
                match me.phase {
                    BackendPhase::Healthy => {
                        return Ok(BackendStartResult {
                            backend: Self::view(model, me, &busy_now),
                            stopped: stopped.into_iter().collect(),
                        });
                    }
                    // Left behind by a start whose client went away: let it settle first.
                    BackendPhase::Starting | BackendPhase::Stopping => vec![me.watch.subscribe()],
                    BackendPhase::Stopped | BackendPhase::Failed => {
                        let others: Vec<ModelId> = slots
                            .iter()
                            .filter(|(id, s)| *id != model && s.phase.is_active())
                            .map(|(id, _)| id.clone())
                            .collect();
                        let in_use: Vec<String> = others
                            .iter()
                            .filter_map(|id| {
                                let n = busy_now.get(id).copied().unwrap_or(0);
                                (n > 0).then(|| format!("{id} ({n} running agent(s))"))
                            })
                            .collect();
                        if !in_use.is_empty() {
                            return Err(BackendError::InUse(format!(
                                "cannot start {model}: backend in use: {}",
                                in_use.join(", ")
                            )));
                        }
                        let mut waits = Vec::new();
                        for id in &others {
                            if let Some(slot) = slots.get_mut(id) {
                                if slot.request_stop(id) {
                                    tracing::info!(stopping = %id, starting = %model, "stopping an idle backend to make room");
                                    stopped.insert(id.to_string());
                                }
                                waits.push(slot.watch.subscribe());
                            }
                        }
                        waits
                    }
                }
            };
            if waits.is_empty() {
                break;
            }
            for mut rx in waits {
                // The sender lives as long as the slot, i.e. as long as `self`.
                let _ = rx.wait_for(|p| p.is_settled()).await;
            }
        }
        let prepared = self.prepare(model, data)?;
        let mut rx = self.launch(model, prepared, cgroups)?;
        let _ = rx.wait_for(|p| p.is_settled()).await;
        let busy_now = busy();
        let slots = self.lock();
        let me = slots
            .get(model)
            .ok_or_else(|| BackendError::NoSlot(model.clone()))?;
        match me.phase {
            BackendPhase::Healthy => Ok(BackendStartResult {
                backend: Self::view(model, me, &busy_now),
                stopped: stopped.into_iter().collect(),
            }),
            BackendPhase::Failed => Err(BackendError::Failed(format!(
                "{model}: {}",
                me.error.as_deref().unwrap_or("unknown error")
            ))),
            BackendPhase::Stopped | BackendPhase::Starting | BackendPhase::Stopping => {
                if self.shutdown.is_cancelled() {
                    Err(BackendError::ShuttingDown)
                } else {
                    Err(BackendError::StoppedWhileStarting(model.clone()))
                }
            }
        }
    }

    /// `POST /backends/vllm/stop`: every backend stopped, unless an agent of a vLLM model runs.
    pub async fn stop_all(
        &self,
        busy: &(dyn Fn() -> Busy + Sync),
    ) -> Result<BackendStopResult, BackendError> {
        let in_use: Vec<String> = {
            let busy_now = busy();
            let slots = self.lock();
            slots
                .keys()
                .filter_map(|id| {
                    let n = busy_now.get(id).copied().unwrap_or(0);
                    (n > 0).then(|| format!("{id} ({n} running agent(s))"))
                })
                .collect()
        };
        if !in_use.is_empty() {
            return Err(BackendError::InUse(format!(
                "vLLM agents are running: {}",
                in_use.join(", ")
            )));
        }
        let mut stopped = BTreeSet::new();
        // First without the switch lock, so a start in progress is aborted instead of waited
        // for; then again under it, for a start that was queued before this request.
        self.request_stop_all(&mut stopped);
        let _switch = self.switch.lock().await;
        for mut rx in self.request_stop_all(&mut stopped) {
            let _ = rx.wait_for(|p| p.is_settled()).await;
        }
        Ok(BackendStopResult {
            stopped: stopped.into_iter().collect(),
        })
    }

    fn request_stop_all(
        &self,
        stopped: &mut BTreeSet<String>,
    ) -> Vec<watch::Receiver<BackendPhase>> {
        let mut slots = self.lock();
        let mut waits = Vec::new();
        for (id, slot) in slots.iter_mut() {
            if slot.phase.is_active() {
                if slot.request_stop(id) {
                    stopped.insert(id.to_string());
                }
                waits.push(slot.watch.subscribe());
            }
        }
        waits
    }

    /// What a launch needs from the data directory (the backend's directory, home and fresh
    /// logs), prepared within the request: a refusal (a planted directory) is the request's
    /// error, and the slot does not change.
    fn prepare(&self, model: &ModelId, data: &DataDir) -> Result<Prepared, BackendError> {
        let gid = self.settings.identity.gid;
        let dir = data.backend_dir(model)?;
        let home = match &self.settings.identity.home {
            Some(h) => h.clone(),
            None => data.backend_home(model, &dir)?,
        };
        let log = |name: &'static str| {
            fresh_log(dir.as_fd(), name, gid).map_err(|source| BackendError::Log {
                model: model.clone(),
                name,
                source,
            })
        };
        let (stdout, stderr) = (log("stdout")?, log("stderr")?);
        Ok(Prepared {
            dir,
            home,
            stdout,
            stderr,
        })
    }

    /// `Launch`, then, in a task of its own, spawn, record and supervise: a request can be
    /// dropped at any await (its client went away), and a launch cut short would leave the
    /// slot starting forever. A failed spawn ends the slot `Failed` (or `Stopped`, if a stop
    /// came in meanwhile) with the reason.
    fn launch(
        self: &Arc<Self>,
        model: &ModelId,
        prepared: Prepared,
        cgroups: &Cgroups,
    ) -> Result<watch::Receiver<BackendPhase>, BackendError> {
        let (port, command, stop, rx) = {
            let mut slots = self.lock();
            let slot = slots
                .get_mut(model)
                .ok_or_else(|| BackendError::NoSlot(model.clone()))?;
            slot.apply(BackendEvent::Launch)?;
            slot.pid = None;
            slot.error = None;
            slot.stop = self.shutdown.child_token();
            (
                slot.port,
                slot.command.clone(),
                slot.stop.clone(),
                slot.watch.subscribe(),
            )
        };
        tracing::info!(%model, port, "starting backend");
        let me = Arc::clone(self);
        let model = model.clone();
        let cgroups = cgroups.clone();
        self.tracker.spawn(async move {
            match me.spawn(&model, &command, prepared, &cgroups).await {
                Ok(spawned) => {
                    if let Some(slot) = me.lock().get_mut(&model) {
                        slot.pid = Some(spawned.pid);
                    }
                    me.record(&model, spawned.pid, port).await;
                    me.supervise(model, port, spawned, stop).await;
                }
                Err(e) => me.finish(&model, Some(e)),
            }
        });
        Ok(rx)
    }

    /// Writes the backend's record (with fsyncs, off the async threads).
    async fn record(&self, model: &ModelId, pid: u32, port: u16) {
        let Some(start_ticks) = proc_start_ticks(pid) else {
            tracing::warn!(%model, pid, "cannot read the backend's start time; not recorded");
            return;
        };
        let record = BackendRecord {
            model: model.clone(),
            pid,
            start_ticks,
            boot_id: boot_id().unwrap_or_default(),
            port,
        };
        let store = self.store.clone();
        match tokio::task::spawn_blocking(move || store.save(&record)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(%model, error = %e, "cannot record the backend"),
            Err(e) => tracing::error!(%model, error = %e, "cannot record the backend"),
        }
    }

    /// The process is gone: `Gone`, with `failure` kept if the backend ends `Failed`.
    fn finish(&self, model: &ModelId, failure: Option<String>) {
        let mut slots = self.lock();
        let Some(slot) = slots.get_mut(model) else {
            return;
        };
        slot.pid = None;
        match slot.apply(BackendEvent::Gone) {
            Ok(BackendPhase::Failed) => {
                let why = failure.unwrap_or_else(|| "exited".to_owned());
                tracing::warn!(%model, error = %why, "backend failed");
                slot.error = Some(why);
            }
            Ok(phase) => tracing::info!(%model, %phase, "backend stopped"),
            Err(e) => tracing::error!(%model, error = %e, "invalid backend transition"),
        }
    }

    async fn spawn(
        &self,
        model: &ModelId,
        command: &[String],
        prepared: Prepared,
        cgroups: &Cgroups,
    ) -> Result<Spawned, String> {
        let Prepared {
            dir,
            home,
            stdout: out,
            stderr: err,
        } = prepared;
        let (program, args) = command
            .split_first()
            .ok_or_else(|| "the command is empty".to_owned())?;
        let id = &self.settings.identity;
        let cgroup = cgroups
            .create_unlimited(&cgroup_name(model))
            .await
            .map_err(|e| format!("cgroup: {e}"))?;
        let mut child = match spawn_process(program, args, &home, id, &cgroup.join_files()) {
            Ok(c) => c,
            Err(e) => {
                if let Err(e) = cgroup.remove() {
                    tracing::warn!(%model, error = %e, "cannot remove the backend's cgroup");
                }
                return Err(format!("cannot start {program:?}: {e}"));
            }
        };
        let Some(pid) = child.id() else {
            // Only absent after a successful wait, which nothing has done yet.
            return Err("the process has no pid".to_owned());
        };
        let dir = Arc::new(dir);
        let cap = self.settings.output_cap;
        let mut captures = Vec::new();
        if let Some(pipe) = child.stdout.take() {
            let d = Arc::clone(&dir);
            let log = RotatingLog::new(out, d, "stdout", id.gid, cap);
            captures.push(self.tracker.spawn(proc::capture(pipe, log, None)));
        }
        if let Some(pipe) = child.stderr.take() {
            let d = Arc::clone(&dir);
            let log = RotatingLog::new(err, d, "stderr", id.gid, cap);
            captures.push(self.tracker.spawn(proc::capture(pipe, log, None)));
        }
        Ok(Spawned {
            child,
            pid,
            cgroup,
            captures,
            dir,
        })
    }

    /// Waits for health (or exit, timeout, stop), then for exit or stop; ends the process and
    /// everything in its cgroup; settles the slot.
    async fn supervise(
        self: Arc<Self>,
        model: ModelId,
        port: u16,
        spawned: Spawned,
        stop: CancellationToken,
    ) {
        let Spawned {
            mut child,
            pid,
            cgroup,
            captures,
            dir,
        } = spawned;
        let timeout = self.settings.start_timeout;
        let mut failure: Option<String> = None;
        let mut exited: Option<std::io::Result<ExitStatus>> = None;
        let deadline = tokio::time::sleep(timeout);
        tokio::pin!(deadline);
        let mut last_probe = "no probe answered yet".to_owned();
        let healthy = loop {
            tokio::select! {
                biased;
                () = stop.cancelled() => break false,
                s = child.wait() => {
                    failure = Some(format!("exited before becoming healthy ({})", shown_status(&s)));
                    exited = Some(s);
                    break false;
                }
                () = &mut deadline => {
                    failure = Some(format!(
                        "not healthy within {}s (GET http://127.0.0.1:{port}/health: {last_probe}); killed",
                        timeout.as_secs()
                    ));
                    break false;
                }
                probe = probe_then_pause(port, self.settings.identity.uid) => match probe {
                    Ok(()) => break true,
                    Err(e) => last_probe = e,
                },
            }
        };
        if healthy {
            self.event(&model, BackendEvent::Healthy);
            tracing::info!(%model, pid, port, "backend healthy");
            tokio::select! {
                () = stop.cancelled() => {}
                s = child.wait() => {
                    failure = Some(format!("exited unexpectedly ({})", shown_status(&s)));
                    exited = Some(s);
                }
            }
        }
        if exited.is_none() {
            terminate(&mut child, &model).await;
        }
        // Workers outlive their leader unless killed.
        if let Err(e) = cgroup.kill_all().await {
            tracing::error!(%model, error = %e, "cannot kill the backend's processes");
        }
        if let Err(e) = cgroup.remove() {
            tracing::warn!(%model, error = %e, "cannot remove the backend's cgroup");
        }
        for h in captures {
            if tokio::time::timeout(CAPTURE_GRACE, h).await.is_err() {
                tracing::warn!(%model, "backend output capture did not finish");
            }
        }
        if let Err(e) = self.store.remove(&model) {
            tracing::error!(%model, error = %e, "cannot remove the backend's record");
        }
        if stop.is_cancelled() {
            // Shutdown cancels the token without a request having said so.
            self.event(&model, BackendEvent::Stop);
        }
        let failure = failure.map(|f| match stderr_tail(dir.as_fd()) {
            Some(line) => format!("{f}; stderr: {line:?}"),
            None => f,
        });
        self.finish(&model, failure);
    }

    /// After a restart: kills the process group of every recorded backend that still exists
    /// (the same process: same pid, start time and boot), and forgets the records. The
    /// launcher's cgroup sweep kills the rest of what ran in their cgroups.
    pub fn recover(&self) {
        let boot = boot_id().unwrap_or_default();
        for record in self.store.load_all() {
            let same = !boot.is_empty()
                && record.boot_id == boot
                && proc_start_ticks(record.pid) == Some(record.start_ticks);
            if same {
                tracing::warn!(model = %record.model, pid = record.pid, "stopping a backend left by a previous launcher");
                signal_group(record.pid, rustix::process::Signal::KILL);
            }
            if let Err(e) = self.store.remove(&record.model) {
                tracing::error!(model = %record.model, error = %e, "cannot remove the backend's record");
            }
        }
    }
}

/// The cgroup of a backend. `.` never appears in a tid, so it cannot collide with a sandbox's.
pub fn cgroup_name(model: &ModelId) -> String {
    format!("backend.{model}")
}

fn shown_status(s: &std::io::Result<ExitStatus>) -> String {
    match s {
        Ok(status) => status.to_string(),
        Err(e) => format!("cannot wait for it: {e}"),
    }
}

fn signal_group(pid: u32, signal: rustix::process::Signal) {
    if let Err(e) = proc::signal_group(pid, signal) {
        tracing::warn!(pid, error = %e, "cannot signal a backend");
    }
}

/// SIGTERM to the group, then, after [`STOP_GRACE`], SIGKILL to the group; the supervisor then
/// kills whatever is left in the cgroup.
async fn terminate(child: &mut tokio::process::Child, model: &ModelId) {
    if let Err(e) = proc::terminate_group(child, STOP_GRACE).await {
        tracing::error!(%model, error = %e, "cannot stop the backend");
        // At least the leader must go, or the wait below never ends.
        if let Err(e) = child.start_kill() {
            tracing::error!(%model, error = %e, "cannot kill the backend");
        }
        if let Err(e) = child.wait().await {
            tracing::error!(%model, error = %e, "cannot reap the backend");
        }
    }
}

/// One health probe, followed by a pause when it failed, so the caller can loop on it.
async fn probe_then_pause(port: u16, owner: u32) -> Result<(), String> {
    let r = probe_health(port, owner).await;
    if r.is_err() {
        tokio::time::sleep(HEALTH_INTERVAL).await;
    }
    r
}

/// `GET http://127.0.0.1:<port>/health` → `Ok` on 200, asked only of a listener that belongs
/// to `owner` (the uid the backend runs as): while the port is free any local user could bind
/// it and answer 200 for a backend that is not up.
async fn probe_health(port: u16, owner: u32) -> Result<(), String> {
    use http_body_util::Empty;
    use hyper_util::rt::TokioIo;
    let exchange = async {
        agentbox_http::loopback::check_owner((Ipv4Addr::LOCALHOST, port).into(), owner)
            .map_err(|e| e.to_string())?;
        let stream = tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port))
            .await
            .map_err(|e| agentbox_http::error_chain(&e))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake::<_, Empty<Bytes>>(TokioIo::new(stream))
                .await
                .map_err(|e| agentbox_http::error_chain(&e))?;
        let req = hyper::Request::get("/health")
            .header(hyper::header::HOST, format!("127.0.0.1:{port}"))
            .body(Empty::new())
            .map_err(|e| agentbox_http::error_chain(&e))?;
        // The connection is driven here rather than in a spawned task, so nothing outlives
        // the probe.
        tokio::pin!(conn);
        let resp = tokio::select! {
            r = sender.send_request(req) => r.map_err(|e| agentbox_http::error_chain(&e))?,
            r = &mut conn => {
                return Err(match r {
                    Ok(()) => "connection closed before a response".to_owned(),
                    Err(e) => agentbox_http::error_chain(&e),
                });
            }
        };
        if resp.status() == hyper::StatusCode::OK {
            Ok(())
        } else {
            Err(format!("answered {}", resp.status()))
        }
    };
    tokio::time::timeout(PROBE_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {}s", PROBE_TIMEOUT.as_secs())))
}

/// Spawns `program` as `id` in a session of its own, inside the cgroup whose join files are
/// given ([`TaskCgroup::join_files`]), through the sandbox engine's one child setup.
fn spawn_process(
    program: &str,
    args: &[String],
    home: &std::path::Path,
    id: &BackendIdentity,
    cgroup_join: &[PathBuf],
) -> Result<tokio::process::Child, proc::SpawnError> {
    let setup = ChildSetup::new(id.uid, id.gid)
        .groups(&id.groups)
        .new_session()
        .join_cgroup(cgroup_join)?;
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .env_clear()
        .env("PATH", PATH)
        .env("HOME", home)
        .env("LANG", "C.UTF-8")
        .current_dir("/")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(false);
    if let Some(name) = &id.name {
        cmd.env("USER", name).env("LOGNAME", name);
    }
    setup.spawn(cmd)
}

/// Moves `dir/name` to `dir/name.1` (replacing an older one) and creates a fresh, empty
/// `dir/name`, root:`gid` 0640, for writing. `dir` is root-only, so the names are ours.
fn fresh_log(dir: BorrowedFd<'_>, name: &str, gid: u32) -> Result<std::fs::File, Errno> {
    let old = format!("{name}.1");
    match rustix::fs::renameat(dir, name, dir, old.as_str()) {
        Ok(()) | Err(Errno::NOENT) => {}
        Err(e) => return Err(e),
    }
    let fd = rustix::fs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o640),
    )?;
    rustix::fs::fchown(
        &fd,
        Some(rustix::fs::Uid::ROOT),
        Some(rustix::fs::Gid::from_raw(gid)),
    )?;
    Ok(std::fs::File::from(fd))
}

/// A backend's output file: a fresh file is started (the old one becomes `name.1`) whenever
/// `cap` bytes are written, so at most twice the cap is kept, and it is the latest output.
struct RotatingLog {
    file: Option<tokio::fs::File>,
    dir: Arc<OwnedFd>,
    name: &'static str,
    gid: u32,
    cap: u64,
    written: u64,
}

impl RotatingLog {
    fn new(
        file: std::fs::File,
        dir: Arc<OwnedFd>,
        name: &'static str,
        gid: u32,
        cap: u64,
    ) -> RotatingLog {
        RotatingLog {
            file: Some(tokio::fs::File::from_std(file)),
            dir,
            name,
            gid,
            cap,
            written: 0,
        }
    }
}

impl Sink for RotatingLog {
    async fn write(&mut self, mut chunk: &[u8]) {
        while !chunk.is_empty() {
            let Some(f) = self.file.as_mut() else { break };
            if self.written >= self.cap {
                let _ = f.flush().await;
                self.file = match fresh_log(self.dir.as_fd(), self.name, self.gid) {
                    Ok(f) => Some(tokio::fs::File::from_std(f)),
                    Err(e) => {
                        tracing::warn!(log = self.name, error = %e, "cannot rotate backend output; dropping the rest");
                        None
                    }
                };
                self.written = 0;
                continue;
            }
            let room = usize::try_from(self.cap - self.written).unwrap_or(usize::MAX);
            let (now, rest) = chunk.split_at(room.min(chunk.len()));
            if let Err(e) = f.write_all(now).await {
                tracing::warn!(log = self.name, error = %e, "cannot write backend output");
            }
            self.written += now.len() as u64;
            chunk = rest;
        }
    }

    async fn finish(&mut self) {
        if let Some(f) = self.file.as_mut() {
            let _ = f.flush().await;
        }
    }
}

/// The last non-empty line of `dir/stderr` (at most [`TAIL_LINE`] characters), for failure
/// messages.
fn stderr_tail(dir: BorrowedFd<'_>) -> Option<String> {
    let fd = rustix::fs::openat(
        dir,
        "stderr",
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    )
    .ok()?;
    let mut file = std::fs::File::from(fd);
    let len = file.metadata().ok()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(TAIL_BYTES)))
        .ok()?;
    let mut buf = Vec::new();
    file.take(TAIL_BYTES).read_to_end(&mut buf).ok()?;
    let text = String::from_utf8_lossy(&buf);
    let line = text.lines().rev().find(|l| !l.trim().is_empty())?;
    Some(line.trim().chars().take(TAIL_LINE).collect())
}

/// Field 22 of `/proc/<pid>/stat`: when the process started, in clock ticks since boot.
pub fn proc_start_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses; it ends at the last ")".
    let (_, rest) = stat.rsplit_once(") ")?;
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// This boot's id.
fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use BackendEvent as E;
    use BackendPhase as P;

    #[test]
    fn life() {
        let p = P::Stopped.next(E::Launch).unwrap();
        assert_eq!(p, P::Starting);
        assert_eq!(p.next(E::Healthy).unwrap(), P::Healthy);
        assert_eq!(P::Healthy.next(E::Gone).unwrap(), P::Failed);
        assert_eq!(P::Starting.next(E::Gone).unwrap(), P::Failed);
        assert_eq!(P::Failed.next(E::Launch).unwrap(), P::Starting);
    }

    #[test]
    fn a_stop_wins() {
        for from in [P::Starting, P::Healthy] {
            let p = from.next(E::Stop).unwrap();
            assert_eq!(p, P::Stopping);
            // Health arriving after the stop, or the stop repeated, changes nothing.
            assert_eq!(p.next(E::Healthy).unwrap(), P::Stopping);
            assert_eq!(p.next(E::Stop).unwrap(), P::Stopping);
            assert_eq!(p.next(E::Gone).unwrap(), P::Stopped);
        }
        assert_eq!(P::Stopped.next(E::Stop).unwrap(), P::Stopped);
        assert_eq!(P::Failed.next(E::Stop).unwrap(), P::Failed);
    }

    #[test]
    fn invalid_transitions() {
        for (p, e) in [
            (P::Starting, E::Launch),
            (P::Healthy, E::Launch),
            (P::Stopping, E::Launch),
            (P::Healthy, E::Healthy),
            (P::Stopped, E::Healthy),
            (P::Stopped, E::Gone),
            (P::Failed, E::Gone),
        ] {
            assert!(p.next(e).is_err(), "{p:?} {e:?}");
        }
    }

    #[test]
    fn settled_and_active() {
        let all = [P::Stopped, P::Starting, P::Healthy, P::Stopping, P::Failed];
        let settled: Vec<_> = all.iter().filter(|p| p.is_settled()).collect();
        assert_eq!(settled, [&P::Stopped, &P::Healthy, &P::Failed]);
        let active: Vec<_> = all.iter().filter(|p| p.is_active()).collect();
        assert_eq!(active, [&P::Starting, &P::Healthy, &P::Stopping]);
    }

    #[test]
    fn start_time_of_this_process() {
        let me = std::process::id();
        let t = proc_start_ticks(me).unwrap();
        assert_eq!(proc_start_ticks(me), Some(t));
        assert!(boot_id().is_some_and(|b| b.len() >= 32));
    }

    #[test]
    fn logs_rotate_and_tail() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = rustix::fs::open(
            tmp.path(),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap();
        let gid = rustix::process::getgid().as_raw();
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let file = fresh_log(dir.as_fd(), "stderr", gid).unwrap();
        let dir = Arc::new(dir);
        let text = b"one\ntwo\nthree\nfour-is-long\n\n".as_slice();
        let log = RotatingLog::new(file, Arc::clone(&dir), "stderr", gid, 8);
        rt.block_on(proc::capture(text, log, None));
        // Files of at most 8 bytes; the last two are kept.
        let cur = std::fs::read_to_string(tmp.path().join("stderr")).unwrap();
        let old = std::fs::read_to_string(tmp.path().join("stderr.1")).unwrap();
        assert_eq!((old.as_str(), cur.as_str()), ("ur-is-lo", "ng\n\n"));
        assert_eq!(stderr_tail(dir.as_fd()).as_deref(), Some("ng"));
        // A fresh start keeps the previous file as `.1`.
        drop(fresh_log(dir.as_fd(), "stderr", gid).unwrap());
        assert_eq!(
            std::fs::read_to_string(tmp.path().join("stderr.1")).unwrap(),
            cur
        );
        assert_eq!(stderr_tail(dir.as_fd()), None);
    }
}
