//! Where a slot's sandbox comes from: [`SlotBackend`] (start one generation, stop it, check
//! it, run commands and file operations in it), and [`Real`], the launcher and the gateway:
//! a generation is a fresh gateway task (new random token, the pool's router model, its token
//! budget) plus a launcher slot (`POST /slots`) whose server answers `GET /health` on its
//! unix socket. The pool's lease logic is written against the trait only.

use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use agentbox_api::gateway::{Budget, OpenTask};
use agentbox_api::launcher::{
    RunState, SlotExecRequest, SlotExecResult, SlotFile, SlotReadRequest, SlotRequest,
    SlotWriteRequest, SlotWriteResult,
};
use agentbox_api::{ClientError, GatewayClient, LauncherClient, RawResponse, UnixClient};
use agentbox_policy::config::ModelId;
use agentbox_policy::id::Tid;
use tokio_util::sync::CancellationToken;

use crate::forward::Forwarder;

/// How long a new server may take to answer `/health`.
pub const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);
/// How often `/health` is tried while a server starts.
const STARTUP_POLL: Duration = Duration::from_millis(200);
/// One health probe's bound.
const HEALTH_TIMEOUT: Duration = Duration::from_secs(2);

/// Every tid the pool makes starts so (and nothing else on the host should).
pub const TID_PREFIX: &str = "pool-";

/// A running generation of a slot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Started {
    /// The launcher run and gateway task of this generation.
    pub tid: Tid,
    /// The server's unix socket on the host.
    pub socket: PathBuf,
}

/// What a health check found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    /// The server answers.
    Alive,
    /// The sandbox is gone (the launcher says it is not running).
    Dead(String),
    /// The sandbox runs but `/health` failed (counted: twice in a row is dead).
    Unhealthy(String),
}

/// What a backend call failed with.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The launcher or gateway refused (4xx): the caller's input, passed on.
    #[error("{message}")]
    Refused {
        status: u16,
        code: String,
        message: String,
    },
    /// Anything else: unreachable daemon, 5xx, timeout, a server that never came up.
    #[error("{0}")]
    Failed(String),
}

impl BackendError {
    fn from_client(what: &str, e: ClientError) -> BackendError {
        match &e {
            ClientError::Api { status, error } if (400..500).contains(status) => {
                BackendError::Refused {
                    status: *status,
                    code: error.code.clone(),
                    message: format!("{what}: {}", error.message),
                }
            }
            ClientError::Api { .. }
            | ClientError::Status { .. }
            | ClientError::Decode { .. }
            | ClientError::Request(_)
            | ClientError::Transport { .. }
            | ClientError::Timeout { .. } => BackendError::Failed(format!("{what}: {e}")),
        }
    }
}

/// The slot operations the pool needs. Futures are `Send`: the pool runs them in tasks.
pub trait SlotBackend: Send + Sync + 'static {
    /// Starts generation `generation` of slot `slot` and waits until its server answers.
    /// On failure nothing of it is left (no task, no sandbox).
    fn start(
        &self,
        slot: u32,
        generation: u64,
    ) -> impl Future<Output = Result<Started, BackendError>> + Send;

    /// Stops a generation: its sandbox and directories gone, its gateway task closed.
    /// Stopping what is already gone succeeds.
    fn stop(&self, tid: &Tid) -> impl Future<Output = Result<(), BackendError>> + Send;

    /// Whether the generation's server is alive.
    fn health(&self, started: &Started) -> impl Future<Output = Health> + Send;

    /// `POST /slots/{tid}/exec`.
    fn exec(
        &self,
        tid: &Tid,
        req: &SlotExecRequest,
    ) -> impl Future<Output = Result<SlotExecResult, BackendError>> + Send;

    /// `POST /slots/{tid}/files/read`.
    fn read(
        &self,
        tid: &Tid,
        req: &SlotReadRequest,
    ) -> impl Future<Output = Result<SlotFile, BackendError>> + Send;

    /// `POST /slots/{tid}/files/write`.
    fn write(
        &self,
        tid: &Tid,
        req: &SlotWriteRequest,
    ) -> impl Future<Output = Result<SlotWriteResult, BackendError>> + Send;

    /// Exposes a leased slot on `addr` (the real thing: a TCP forwarder to its socket).
    ///
    /// # Errors
    /// When `addr` cannot be bound.
    fn expose(&self, addr: SocketAddr, started: &Started) -> std::io::Result<Forwarder> {
        Forwarder::open(addr, started.socket.clone())
    }
}

/// Random lowercase hex of `bytes` bytes.
///
/// # Errors
/// When the kernel's random source fails.
pub fn random_hex(bytes: usize) -> Result<String, BackendError> {
    let mut buf = vec![0u8; bytes];
    getrandom::fill(&mut buf).map_err(|e| BackendError::Failed(format!("no randomness: {e}")))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// The tid of generation `generation` of slot `slot`: unique per generation (and per pool
/// run, by the random tail), valid as a launcher run id and gateway task id.
///
/// # Errors
/// When the kernel's random source fails.
pub fn slot_tid(slot: u32, generation: u64) -> Result<Tid, BackendError> {
    let raw = format!("{TID_PREFIX}{slot}-g{generation}-{}", random_hex(4)?);
    Tid::parse(&raw).map_err(|e| BackendError::Failed(format!("slot tid {raw:?}: {e}")))
}

/// The launcher and the gateway.
#[derive(Debug, Clone)]
pub struct Real {
    launcher: LauncherClient,
    gateway: GatewayClient,
    model: ModelId,
    budget_tokens: Option<u64>,
    shutdown: CancellationToken,
}

impl Real {
    /// Over the two control sockets; `shutdown` cuts a start's health wait short.
    pub fn new(
        launcher: LauncherClient,
        gateway: GatewayClient,
        model: ModelId,
        budget_tokens: Option<u64>,
        shutdown: CancellationToken,
    ) -> Real {
        Real {
            launcher,
            gateway,
            model,
            budget_tokens,
            shutdown,
        }
    }

    /// What an earlier pool on this host left behind when it died without its shutdown (a
    /// crash, SIGKILL): launcher slots and open gateway tasks named `pool-*` are deleted and
    /// closed, so no sandbox and no metered task outlives the pool that made it. Returns how
    /// many of each.
    ///
    /// # Errors
    /// When the launcher's or the gateway's status cannot be read.
    pub async fn reap_orphans(&self) -> Result<(usize, usize), BackendError> {
        let ours = |tid: &str| tid.starts_with(TID_PREFIX);
        let status = self
            .launcher
            .status()
            .await
            .map_err(|e| BackendError::from_client("launcher GET /status", e))?;
        let mut slots = 0;
        for run in status.slots.iter().filter(|r| ours(&r.tid)) {
            let Ok(tid) = Tid::parse(&run.tid) else {
                continue;
            };
            match ignore_not_found(self.launcher.delete_slot(&tid).await.map(|_| ())) {
                Ok(()) => slots += 1,
                Err(e) => tracing::warn!(%tid, error = %e, "cannot delete an orphaned slot"),
            }
        }
        let tasks = self
            .gateway
            .status()
            .await
            .map_err(|e| BackendError::from_client("gateway GET /status", e))?;
        let mut closed = 0;
        for task in tasks
            .tasks
            .iter()
            .filter(|t| ours(&t.tid) && t.state == agentbox_api::gateway::TaskState::Open)
        {
            let Ok(tid) = Tid::parse(&task.tid) else {
                continue;
            };
            match ignore_not_found(self.gateway.close_task(&tid).await.map(|_| ())) {
                Ok(()) => closed += 1,
                Err(e) => tracing::warn!(%tid, error = %e, "cannot close an orphaned task"),
            }
        }
        Ok((slots, closed))
    }

    async fn wait_healthy(&self, started: &Started) -> Result<(), BackendError> {
        let deadline = tokio::time::Instant::now() + STARTUP_TIMEOUT;
        loop {
            if self.shutdown.is_cancelled() {
                return Err(BackendError::Failed("the pool is shutting down".into()));
            }
            if let Ok(r) = probe_health(&started.socket).await
                && r.status < 500
            {
                return Ok(());
            }
            let status = self
                .launcher
                .slot(&started.tid)
                .await
                .map_err(|e| BackendError::from_client("launcher GET /slots", e))?;
            if status.state != RunState::Running && status.state != RunState::Starting {
                return Err(BackendError::Failed(format!(
                    "the server exited before answering /health ({}): {}",
                    status.state.as_str(),
                    tail(&status.stderr)
                )));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(BackendError::Failed(format!(
                    "the server did not answer /health within {STARTUP_TIMEOUT:?}"
                )));
            }
            tokio::select! {
                () = self.shutdown.cancelled() => {}
                () = tokio::time::sleep(STARTUP_POLL) => {}
            }
        }
    }
}

/// The end of a server's stderr, for an error message.
fn tail(s: &str) -> &str {
    let mut start = s.len().saturating_sub(500);
    while !s.is_char_boundary(start) {
        start += 1;
    }
    s[start..].trim()
}

/// `GET /health` on a slot's server, through its socket itself ([`crate::slot_socket`]: never
/// through what the agent put in its place).
async fn probe_health(socket: &std::path::Path) -> Result<RawResponse, ClientError> {
    let pinned = crate::slot_socket::pin(socket).map_err(|e| ClientError::Transport {
        socket: socket.to_path_buf(),
        message: e.to_string(),
    })?;
    UnixClient::new(pinned.path())
        .with_timeout(Some(HEALTH_TIMEOUT))
        .raw("GET", "/health", &[], Vec::new())
        .await
}

fn ignore_not_found(r: Result<(), ClientError>) -> Result<(), ClientError> {
    match r {
        Err(e) if e.status() == Some(404) => Ok(()),
        other => other,
    }
}

impl SlotBackend for Real {
    async fn start(&self, slot: u32, generation: u64) -> Result<Started, BackendError> {
        let tid = slot_tid(slot, generation)?;
        let token = random_hex(32)?;
        self.gateway
            .open_task(&OpenTask {
                tid: tid.to_string(),
                model: self.model.to_string(),
                token: token.clone(),
                budget: Budget {
                    tokens: self.budget_tokens,
                    usd: None,
                },
            })
            .await
            .map_err(|e| BackendError::from_client("gateway POST /tasks", e))?;
        let status = match self
            .launcher
            .start_slot(&SlotRequest {
                tid: tid.to_string(),
                token,
                env: Default::default(),
                timeout_s: None,
            })
            .await
        {
            Ok(s) => s,
            Err(e) => {
                // The launcher may have created it before failing to answer: delete by id.
                let _ = self.stop(&tid).await;
                return Err(BackendError::from_client("launcher POST /slots", e));
            }
        };
        let started = Started {
            tid,
            socket: PathBuf::from(status.socket),
        };
        if let Err(e) = self.wait_healthy(&started).await {
            if let Err(stop) = self.stop(&started.tid).await {
                tracing::warn!(tid = %started.tid, error = %stop, "cannot clean up a failed start");
            }
            return Err(e);
        }
        Ok(started)
    }

    async fn stop(&self, tid: &Tid) -> Result<(), BackendError> {
        let slot = ignore_not_found(self.launcher.delete_slot(tid).await.map(|_| ()))
            .map_err(|e| BackendError::from_client("launcher DELETE /slots", e));
        // The task is closed even when the sandbox could not be deleted: no model call of
        // this generation may be metered after it ends.
        let task = ignore_not_found(self.gateway.close_task(tid).await.map(|_| ()))
            .map_err(|e| BackendError::from_client("gateway DELETE /tasks", e));
        slot.and(task)
    }

    async fn health(&self, started: &Started) -> Health {
        match self.launcher.slot(&started.tid).await {
            Ok(s) if s.state == RunState::Running => {}
            Ok(s) => {
                return Health::Dead(format!(
                    "the slot's sandbox is {}: {}",
                    s.state.as_str(),
                    tail(&s.stderr)
                ));
            }
            Err(e) if e.status() == Some(404) => {
                return Health::Dead("the launcher knows no such slot".into());
            }
            Err(e) => return Health::Unhealthy(format!("launcher GET /slots: {e}")),
        }
        match probe_health(&started.socket).await {
            Ok(r) if r.status < 500 => Health::Alive,
            Ok(r) => Health::Unhealthy(format!("/health answered {}", r.status)),
            Err(e) => Health::Unhealthy(format!("/health: {e}")),
        }
    }

    async fn exec(&self, tid: &Tid, req: &SlotExecRequest) -> Result<SlotExecResult, BackendError> {
        self.launcher
            .slot_exec(tid, req)
            .await
            .map_err(|e| BackendError::from_client("launcher exec", e))
    }

    async fn read(&self, tid: &Tid, req: &SlotReadRequest) -> Result<SlotFile, BackendError> {
        self.launcher
            .slot_read(tid, req)
            .await
            .map_err(|e| BackendError::from_client("launcher read", e))
    }

    async fn write(
        &self,
        tid: &Tid,
        req: &SlotWriteRequest,
    ) -> Result<SlotWriteResult, BackendError> {
        self.launcher
            .slot_write(tid, req)
            .await
            .map_err(|e| BackendError::from_client("launcher write", e))
    }
}
