//! The gateway's shared state and the task lifecycle.
//!
//! One lock guards the task table; every critical section is a few field updates (no I/O, no
//! await). Task state is an explicit enum (`Open` ⇄ `Closed`); a closed task keeps its account,
//! so opening the same tid again continues its spend. Open tasks are restored from the state
//! file at start, their sockets re-bound in the same directories (running sandboxes hold bind
//! mounts of those). Each task's socket is served by a tracked task whose cancellation token is
//! a child of the gateway's, so shutdown stops them all.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use agentbox_api::gateway::{GatewayStatus, OpenTask, Remaining, Reserved, TaskUsage, TaskView};
use agentbox_http::loopback::LoopbackGuard;
use agentbox_http::{BodyBudget, BodyBudgets, ConnectionLimit};
use agentbox_llm::{ClientError, ClientOptions, Upstream, Url};
use agentbox_policy::config::{Config, HostEnv, Model, ModelId};
use agentbox_policy::id::Tid;
use agentbox_policy::secret::Secret;
use agentbox_wire::usage::MeteredUsage;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::net::UnixListener;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::account::{AccountError, Accounts, TaskAccount};
use crate::error::ControlError;
use crate::ledger::{Account, Budget, Reservation, Snapshot, TaskRecord, TaskState};
use crate::proxy::ProxyConfig;
use crate::shards::{Placement, ShardError, Shards};
use crate::sockets::{SocketError, SocketsDir};
use crate::store::{Store, StoreError, VERSION};

/// Everything the gateway needs from the config and the environment.
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    /// `$AGENTBOX_DATA`.
    pub data_dir: PathBuf,
    /// The model catalogue.
    pub models: BTreeMap<ModelId, Model>,
    /// Ollama's base URL.
    pub ollama_url: String,
    /// The bridge's base URL.
    pub bridge_url: String,
    /// The bridge's bearer token, for remote models.
    pub bridge_token: Option<Secret>,
    /// Largest request body.
    pub max_body_bytes: u64,
    /// How long a client may take to send its body.
    pub body_timeout: Duration,
    /// Uids allowed on the control socket besides root.
    pub control_uids: Vec<u32>,
    /// Connections one task socket serves at once.
    pub max_connections_per_task: usize,
    /// Request-body bytes one task may hold at once.
    pub max_inflight_body_bytes_per_task: u64,
    /// Request-body bytes all tasks together may hold at once.
    pub body_memory_bytes: u64,
    /// Who must own the bridge's and the vLLM backends' loopback listeners.
    pub loopback_owner_uid: u32,
    /// Event loops serving the task sockets (`gateway.threads`); `None`: one per core.
    pub threads: Option<usize>,
}

impl GatewayOptions {
    /// From the config; the bridge token comes from the variable `bridge.token_env` names, and
    /// the control socket admits root, this process's uid and `service_user`'s.
    pub fn from_config(config: &Config, env: &dyn HostEnv) -> Self {
        let mut control_uids = vec![env.euid()];
        if let Ok(Some(user)) = nix::unistd::User::from_name(&config.service_user) {
            control_uids.push(user.uid.as_raw());
        }
        GatewayOptions {
            data_dir: config.data_dir.clone(),
            models: config.models.clone(),
            ollama_url: config
                .gateway
                .ollama_url
                .as_str()
                .trim_end_matches('/')
                .to_owned(),
            bridge_url: config
                .gateway
                .bridge_url
                .as_str()
                .trim_end_matches('/')
                .to_owned(),
            bridge_token: env.var(&config.bridge.token_env).and_then(Secret::new),
            max_body_bytes: config.gateway.max_body_bytes,
            body_timeout: Duration::from_secs(60),
            control_uids,
            max_connections_per_task: config.gateway.max_connections_per_task,
            max_inflight_body_bytes_per_task: config.gateway.max_inflight_body_bytes_per_task,
            body_memory_bytes: config.gateway.body_memory_bytes,
            loopback_owner_uid: config.gateway.loopback_owner_uid.unwrap_or(env.euid()),
            threads: config.gateway.threads,
        }
    }
}

/// Why the gateway cannot start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The state file is unreadable or corrupt.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// `sockets/` cannot be opened.
    #[error("cannot open {path}: {source}")]
    Sockets {
        /// The directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The upstream HTTP client could not be built.
    #[error(transparent)]
    Client(#[from] ClientError),
    /// An event loop for the task sockets could not be started.
    #[error(transparent)]
    Shards(#[from] ShardError),
    /// A configured upstream, with the path the gateway calls, is not a usable URL.
    #[error("{key}: {reason}")]
    Endpoint {
        /// The setting it comes from.
        key: &'static str,
        /// What the URL parser said.
        reason: String,
    },
}

struct Task {
    model: ModelId,
    token_sha256: [u8; 32],
    account: Account,
    state: TaskState,
    /// Cancels this task's socket server while it is open.
    serving: Option<CancellationToken>,
}

/// The gateway.
pub struct Gateway {
    opts: GatewayOptions,
    sockets: SocketsDir,
    store: Store,
    /// The event loops the task sockets run on, each with what its requests share (upstream
    /// client, destinations, limits).
    shards: Shards<ProxyConfig>,
    /// The memory all tasks' request bodies share (`gateway.body_memory_mb`).
    body_memory: BodyBudget,
    tasks: Mutex<BTreeMap<Tid, Task>>,
    dirty: Notify,
    /// Held from snapshot to written file, so saves land in the order their snapshots were
    /// taken: a control operation's save is never overwritten by an older snapshot the state
    /// writer took before it.
    persisting: tokio::sync::Mutex<()>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    /// Serializes open/close so two calls for one tid cannot interleave their socket work.
    control: tokio::sync::Mutex<()>,
}

impl std::fmt::Debug for Gateway {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gateway")
            .field("data_dir", &self.opts.data_dir)
            .finish_non_exhaustive()
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

impl Gateway {
    /// Loads the state and prepares `sockets/`. Sockets are bound by [`Gateway::restore`].
    pub fn new(
        opts: GatewayOptions,
        shutdown: CancellationToken,
    ) -> Result<Arc<Gateway>, StartError> {
        let (store, snapshot) = Store::open(&opts.data_dir)?;
        let sockets = SocketsDir::open(&opts.data_dir).map_err(|source| StartError::Sockets {
            path: opts.data_dir.join("sockets"),
            source,
        })?;
        let tracker = TaskTracker::new();
        let threads = opts.threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        });
        let endpoint = |key: &'static str, base: &str, path: &str| {
            Url::parse(&format!("{base}{path}")).map_err(|e| StartError::Endpoint {
                key,
                reason: e.to_string(),
            })
        };
        let ollama_messages = endpoint("gateway.ollama_url", &opts.ollama_url, "/v1/messages")?;
        let bridge_messages = endpoint("gateway.bridge_url", &opts.bridge_url, "/v1/messages")?;
        let vllm_messages = endpoint("vllm", "http://127.0.0.1", "/v1/messages")?;
        let shards = Shards::start(threads, || {
            Ok::<_, StartError>(ProxyConfig {
                upstream: Upstream::new(&ClientOptions::default())?,
                ollama_messages: ollama_messages.clone(),
                bridge_messages: bridge_messages.clone(),
                vllm_messages: vllm_messages.clone(),
                bridge_token: opts.bridge_token.clone(),
                max_body_bytes: opts.max_body_bytes,
                body_timeout: opts.body_timeout,
                background: tracker.clone(),
                shutdown: shutdown.clone(),
                loopback: LoopbackGuard::new(opts.loopback_owner_uid),
            })
        })?;
        let mut tasks = BTreeMap::new();
        for (tid, rec) in snapshot.tasks {
            // A record we cannot interpret is skipped loudly rather than guessed at.
            let (Ok(tid), Ok(model)) = (Tid::parse(&tid), ModelId::parse(&rec.model)) else {
                tracing::error!(%tid, "skipping a state record with an invalid tid or model");
                continue;
            };
            let mut token_sha256 = [0u8; 32];
            if hex::decode_to_slice(&rec.token_sha256, &mut token_sha256).is_err() {
                tracing::error!(%tid, "skipping a state record with an invalid token hash");
                continue;
            }
            let account = Account {
                budget: rec.budget,
                spent: rec.spent,
                ..Account::default()
            };
            tasks.insert(
                tid,
                Task {
                    model,
                    token_sha256,
                    account,
                    state: rec.state,
                    serving: None,
                },
            );
        }
        Ok(Arc::new(Gateway {
            sockets,
            store,
            body_memory: BodyBudget::new(opts.body_memory_bytes),
            shards,
            tasks: Mutex::new(tasks),
            dirty: Notify::new(),
            persisting: tokio::sync::Mutex::new(()),
            shutdown,
            tracker,
            control: tokio::sync::Mutex::new(()),
            opts,
        }))
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<Tid, Task>> {
        // A panic while holding the lock leaves plain data behind; keep serving with it.
        self.tasks
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The options the gateway runs with.
    pub fn options(&self) -> &GatewayOptions {
        &self.opts
    }

    /// Re-binds the sockets of every task that was open when the gateway last stopped.
    /// Returns the tasks that could not be restored (they stay open in the state, unserved).
    pub fn restore(self: &Arc<Self>) -> Vec<(String, String)> {
        let open: Vec<Tid> = self
            .lock()
            .iter()
            .filter(|(_, t)| t.state == TaskState::Open)
            .map(|(k, _)| k.clone())
            .collect();
        let mut failed = Vec::new();
        for tid in open {
            match self.sockets.bind(&tid).and_then(|l| self.place(&tid, l)) {
                Ok((place, listener)) => self.serve(&tid, place, listener),
                Err(e) => {
                    tracing::error!(%tid, error = %e, "cannot restore task socket");
                    failed.push((tid.to_string(), e.to_string()));
                }
            }
        }
        failed
    }

    /// Chooses the shard a task's socket will be served on (the one with the fewest tasks, see
    /// [`crate::shards`]) and registers the listener with it.
    fn place(
        &self,
        tid: &Tid,
        listener: std::os::unix::net::UnixListener,
    ) -> Result<(Placement<ProxyConfig>, UnixListener), SocketError> {
        let place = self.shards.place();
        let listener = place.register(listener).map_err(|source| SocketError::Io {
            tid: tid.to_string(),
            op: "register socket in",
            source,
        })?;
        Ok((place, listener))
    }

    /// Serves a task's socket on the shard [`Gateway::place`] chose.
    fn serve(self: &Arc<Self>, tid: &Tid, place: Placement<ProxyConfig>, listener: UnixListener) {
        let token = self.shutdown.child_token();
        if let Some(t) = self.lock().get_mut(tid) {
            t.serving = Some(token.clone());
        }
        let account = TaskAccount::new(self.clone(), tid.clone());
        // Each task gets its own share of connections and body memory, so a task that floods
        // its socket is refused (429) while the others keep theirs.
        let bodies = BodyBudgets {
            client: BodyBudget::new(self.opts.max_inflight_body_bytes_per_task),
            server: self.body_memory.clone(),
        };
        let router = crate::proxy::router(
            place.state().clone(),
            account,
            bodies,
            self.opts.max_connections_per_task,
        );
        let limit = ConnectionLimit::new(self.opts.max_connections_per_task, over_limit_router());
        let shard = place.index;
        place.spawn(self.tracker.track_future(agentbox_http::serve_unix_limited(
            listener,
            router,
            Some(limit),
            token,
        )));
        tracing::info!(%tid, shard, "task socket open");
    }

    /// Task sockets each event loop serves now.
    pub fn shard_load(&self) -> Vec<usize> {
        self.shards.serving()
    }

    /// The end of a shutdown, after [`Gateway::run_persister`] has returned (the task sockets
    /// have drained, or their grace ran out): ends the task sockets' event loops and waits for
    /// their threads, then writes the state a last time. The connections that outlived the grace
    /// end here, and their bodies settle what they metered as they are dropped, so that write
    /// has them.
    ///
    /// # Errors
    /// When the last write fails.
    pub async fn stop_and_save(&self) -> Result<(), StoreError> {
        self.shards.stop();
        self.persist_now().await
    }

    /// `POST /tasks`: opens a task, or re-opens a closed one keeping its spend. Opening a task
    /// that is already open with the same model and token is a no-op; with other settings it
    /// is a conflict.
    pub async fn open_task(self: &Arc<Self>, req: OpenTask) -> Result<TaskView, ControlError> {
        let tid = Tid::parse(&req.tid).map_err(|e| ControlError::BadRequest(e.to_string()))?;
        let model_id =
            ModelId::parse(&req.model).map_err(|e| ControlError::BadRequest(e.to_string()))?;
        let model = self.opts.models.get(&model_id).ok_or_else(|| {
            ControlError::BadRequest(format!("model {model_id} is not in the catalogue"))
        })?;
        validate_token(&req.token)?;
        validate_budget(&req.budget, model)?;
        let token_sha256 = sha256(req.token.as_bytes());
        let _serial = self.control.lock().await;
        {
            let tasks = self.lock();
            if let Some(t) = tasks.get(&tid) {
                let same = t.model == model_id && bool::from(t.token_sha256.ct_eq(&token_sha256));
                match (t.state, same) {
                    (TaskState::Open, true) if t.serving.is_some() => {
                        return Ok(view(&tid, t, &self.sockets));
                    }
                    // Open in the state but unserved (its socket could not be restored at
                    // start): opening it again binds it anew.
                    (TaskState::Open, true) => {}
                    (TaskState::Open, false) => {
                        return Err(ControlError::Conflict(format!(
                            "task {tid} is already open with another model or token"
                        )));
                    }
                    (TaskState::Closed, _) if t.model != model_id => {
                        return Err(ControlError::Conflict(format!(
                            "task {tid} was opened with model {}; its spend cannot move to {model_id}",
                            t.model
                        )));
                    }
                    (TaskState::Closed, _) => {}
                }
            }
        }
        // Bind before recording: a refused socket path leaves no task behind.
        let (place, listener) = self.place(&tid, self.sockets.bind(&tid)?)?;
        let before = {
            let mut tasks = self.lock();
            let before = tasks
                .get(&tid)
                .map(|t| (t.state, t.token_sha256, t.account.budget));
            let task = tasks.entry(tid.clone()).or_insert_with(|| Task {
                model: model_id.clone(),
                token_sha256,
                account: Account::default(),
                state: TaskState::Open,
                serving: None,
            });
            task.token_sha256 = token_sha256;
            task.account.budget = req.budget;
            task.state = TaskState::Open;
            before
        };
        self.serve(&tid, place, listener);
        if let Err(e) = self.persist_now().await {
            // The caller is told the open failed, so it must not have happened: a task left
            // served would be billed and restored at every start with nobody to close it.
            self.undo_open(&tid, before);
            return Err(e.into());
        }
        let tasks = self.lock();
        tasks
            .get(&tid)
            .map(|t| view(&tid, t, &self.sockets))
            .ok_or_else(|| ControlError::NoTask(tid.to_string()))
    }

    /// `GET /tasks/{tid}`.
    pub fn task(&self, tid: &str) -> Result<TaskView, ControlError> {
        let tid = Tid::parse(tid).map_err(|e| ControlError::BadRequest(e.to_string()))?;
        let tasks = self.lock();
        tasks
            .get(&tid)
            .map(|t| view(&tid, t, &self.sockets))
            .ok_or_else(|| ControlError::NoTask(tid.to_string()))
    }

    /// `DELETE /tasks/{tid}`: stops serving, removes the socket, keeps the account.
    pub async fn close_task(&self, tid: &str) -> Result<TaskView, ControlError> {
        let tid = Tid::parse(tid).map_err(|e| ControlError::BadRequest(e.to_string()))?;
        let _serial = self.control.lock().await;
        let serving = {
            let mut tasks = self.lock();
            let t = tasks
                .get_mut(&tid)
                .ok_or_else(|| ControlError::NoTask(tid.to_string()))?;
            t.state = TaskState::Closed;
            t.serving.take()
        };
        if let Some(token) = serving {
            token.cancel();
        }
        let removed = self.sockets.remove(&tid);
        let saved = self.persist_now().await;
        if saved.is_err() {
            // Closed in memory: the persister writes it as soon as it can.
            self.dirty.notify_one();
        }
        removed?;
        saved?;
        tracing::info!(%tid, "task closed");
        self.task(tid.as_str())
    }

    /// Takes back an open whose state could not be saved: stops serving the socket, removes
    /// it, and puts the task back as it was (`before`), or forgets it if it was new.
    fn undo_open(&self, tid: &Tid, before: Option<(TaskState, [u8; 32], Budget)>) {
        let serving = {
            let mut tasks = self.lock();
            match before {
                None => tasks.remove(tid).and_then(|mut t| t.serving.take()),
                Some((state, token_sha256, budget)) => tasks.get_mut(tid).and_then(|t| {
                    t.state = state;
                    t.token_sha256 = token_sha256;
                    t.account.budget = budget;
                    t.serving.take()
                }),
            }
        };
        if let Some(token) = serving {
            token.cancel();
        }
        if let Err(e) = self.sockets.remove(tid) {
            tracing::error!(%tid, error = %e, "cannot remove the socket of an open taken back");
        }
        // The writer may have saved the open meanwhile: the state taken back is written too.
        self.dirty.notify_one();
        tracing::warn!(%tid, "open taken back: the state could not be saved");
    }

    /// `GET /status`.
    pub fn status(&self) -> GatewayStatus {
        let tasks = self.lock();
        let list: Vec<TaskView> = tasks
            .iter()
            .map(|(tid, t)| view(tid, t, &self.sockets))
            .collect();
        let open = list.iter().filter(|t| t.state == TaskState::Open).count();
        GatewayStatus {
            ok: true,
            open_tasks: open,
            tasks: list,
            bridge_token: self.opts.bridge_token.is_some(),
            models: self.opts.models.keys().map(ToString::to_string).collect(),
            capabilities: agentbox_http::privs::current().ok(),
            event_loops: self.shard_load(),
        }
    }

    fn snapshot(&self) -> Snapshot {
        let tasks = self.lock();
        Snapshot {
            version: VERSION,
            tasks: tasks
                .iter()
                .map(|(tid, t)| {
                    (
                        tid.to_string(),
                        TaskRecord {
                            model: t.model.to_string(),
                            token_sha256: hex::encode(t.token_sha256),
                            budget: t.account.budget,
                            spent: t.account.spent,
                            state: t.state,
                        },
                    )
                })
                .collect(),
        }
    }

    /// Writes the state now (control operations wait for it).
    pub async fn persist_now(&self) -> Result<(), StoreError> {
        let _in_order = self.persisting.lock().await;
        let snap = self.snapshot();
        let store = self.store.clone();
        match tokio::task::spawn_blocking(move || store.save(&snap)).await {
            Ok(r) => r,
            Err(e) => Err(StoreError::Io {
                path: self.opts.data_dir.join("state"),
                source: std::io::Error::other(e),
            }),
        }
    }

    /// Writes the state whenever usage changed, at most once per [`crate::store::SAVE_INTERVAL`]
    /// (the settlements of that interval share one write), until shutdown; then waits for the
    /// task sockets to drain. The last write is [`Gateway::stop_and_save`]'s.
    pub async fn run_persister(self: Arc<Self>) {
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => break,
                () = self.dirty.notified() => {}
            }
            let pause = match self.persist_now().await {
                Ok(()) => crate::store::SAVE_INTERVAL,
                Err(e) => {
                    // Nothing else may come to ask again (the last settlement of a quiet
                    // task), and the disk is behind memory until a write succeeds.
                    tracing::error!(error = %e, "cannot save gateway state; retrying");
                    self.dirty.notify_one();
                    crate::store::SAVE_RETRY
                }
            };
            // Settlements meanwhile leave their permit in `dirty`: the next write has them.
            tokio::select! {
                () = self.shutdown.cancelled() => break,
                () = tokio::time::sleep(pause) => {}
            }
        }
        self.tracker.close();
        self.tracker.wait().await;
    }
}

impl Accounts for Gateway {
    fn check_token(&self, tid: &Tid, presented: &[u8]) -> Result<(), AccountError> {
        let h = sha256(presented);
        let tasks = self.lock();
        let t = tasks.get(tid).ok_or(AccountError::TaskClosed)?;
        if t.state != TaskState::Open {
            return Err(AccountError::TaskClosed);
        }
        if bool::from(t.token_sha256.ct_eq(&h)) {
            Ok(())
        } else {
            Err(AccountError::Unauthorized)
        }
    }

    fn model_of(&self, tid: &Tid) -> Result<Model, AccountError> {
        let tasks = self.lock();
        let t = tasks.get(tid).ok_or(AccountError::TaskClosed)?;
        self.opts
            .models
            .get(&t.model)
            .cloned()
            .ok_or(AccountError::TaskClosed)
    }

    fn admit(&self, tid: &Tid, r: Reservation) -> Result<(), AccountError> {
        let mut tasks = self.lock();
        let t = tasks.get_mut(tid).ok_or(AccountError::TaskClosed)?;
        t.account.admit(r).map_err(AccountError::Budget)
    }

    fn settle(&self, tid: &Tid, r: Reservation, usage: &MeteredUsage) {
        {
            let mut tasks = self.lock();
            let Some(t) = tasks.get_mut(tid) else {
                return;
            };
            let prices = self.opts.models.get(&t.model).and_then(|m| m.prices);
            t.account.settle(r, usage, prices.as_ref());
        }
        tracing::debug!(%tid, input = usage.input_tokens, output = usage.output_tokens,
            cache_read = usage.cache_read_input_tokens, cache_creation = usage.cache_creation_input_tokens, "settled");
        self.dirty.notify_one();
    }
}

/// What a task's connections past `gateway.max_connections_per_task` get: 429, then closed.
fn over_limit_router() -> axum::Router {
    axum::Router::new().fallback(|| async { crate::error::ProxyError::TooManyConnections })
}

fn validate_token(token: &str) -> Result<(), ControlError> {
    // Tokens travel in headers: visible ASCII only, long enough not to be guessed.
    let ok_len = (16..=512).contains(&token.len());
    let ok_chars = token.bytes().all(|b| b.is_ascii_graphic());
    if ok_len && ok_chars {
        Ok(())
    } else {
        Err(ControlError::BadRequest(
            "token must be 16-512 visible ASCII characters".into(),
        ))
    }
}

fn validate_budget(b: &Budget, model: &Model) -> Result<(), ControlError> {
    if b.tokens == Some(0) {
        return Err(ControlError::BadRequest(
            "budget.tokens must be greater than 0".into(),
        ));
    }
    if let Some(usd) = b.usd {
        if !usd.is_finite() || usd <= 0.0 {
            return Err(ControlError::BadRequest(
                "budget.usd must be a positive number".into(),
            ));
        }
        if model.prices.is_none() {
            return Err(ControlError::BadRequest(format!(
                "model {} has no prices in the catalogue: use a token budget",
                model.id
            )));
        }
    }
    Ok(())
}

fn view(tid: &Tid, t: &Task, sockets: &SocketsDir) -> TaskView {
    let s = &t.account.spent;
    let (tokens, usd) = t.account.remaining();
    TaskView {
        tid: tid.to_string(),
        model: t.model.to_string(),
        state: t.state,
        socket: (t.state == TaskState::Open).then(|| sockets.socket_path(tid)),
        usage: TaskUsage {
            input_tokens: s.input_tokens,
            output_tokens: s.output_tokens,
            cache_read_input_tokens: s.cache_read_input_tokens,
            cache_creation_input_tokens: s.cache_creation_input_tokens,
            total_tokens: s.tokens(),
            requests: s.requests,
            cost_usd: s.cost_usd,
        },
        budget: t.account.budget,
        remaining: Remaining { tokens, usd },
        reserved: Reserved {
            tokens: t.account.reserved.tokens,
            usd: t.account.reserved.usd,
        },
        in_flight: t.account.in_flight,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::atomic::Ordering;

    use agentbox_policy::config::FixedEnv;

    use super::*;

    const TOKEN: &str = "task-token-0123456789abcdef";

    fn gateway(data: &std::path::Path) -> (Arc<Gateway>, CancellationToken) {
        let env = FixedEnv {
            vars: [("AGENTBOX_DATA".to_owned(), data.display().to_string())].into(),
            euid: rustix::process::geteuid().as_raw(),
        };
        let config = Config::from_toml_str(
            "[gateway]\nthreads = 1\n[models.local]\nbackend = \"ollama\"\nupstream_model = \"q\"\n",
            "test",
            &env,
        )
        .unwrap();
        let shutdown = CancellationToken::new();
        let gw =
            Gateway::new(GatewayOptions::from_config(&config, &env), shutdown.clone()).unwrap();
        (gw, shutdown)
    }

    fn open(tid: &str) -> OpenTask {
        OpenTask {
            tid: tid.into(),
            model: "local".into(),
            token: TOKEN.into(),
            budget: Budget::default(),
        }
    }

    fn saved(data: &std::path::Path) -> Snapshot {
        Store::open(data).unwrap().1
    }

    /// An open whose state cannot be saved is answered with an error, so it must not have
    /// happened: no task served, no socket, nothing to restore.
    #[tokio::test]
    async fn an_open_that_cannot_be_saved_is_taken_back() {
        let d = tempfile::tempdir().unwrap();
        let (gw, _stop) = gateway(d.path());
        gw.store.fail_saves.store(1, Ordering::SeqCst);
        assert!(gw.open_task(open("t1")).await.is_err());
        assert!(gw.task("t1").is_err(), "the task stayed");
        assert!(!d.path().join("sockets/t1/llm.sock").exists());
        // A task opened again after a close keeps its old state when the re-open fails.
        gw.open_task(open("t2")).await.unwrap();
        gw.close_task("t2").await.unwrap();
        gw.store.fail_saves.store(1, Ordering::SeqCst);
        assert!(gw.open_task(open("t2")).await.is_err());
        assert_eq!(gw.task("t2").unwrap().state, TaskState::Closed);
        assert!(!d.path().join("sockets/t2/llm.sock").exists());
        gw.open_task(open("t2")).await.unwrap();
        assert_eq!(saved(d.path()).tasks["t2"].state, TaskState::Open);
    }

    /// A task open in the state whose socket was not restored at start is served again when
    /// it is opened again, not answered with a socket nothing serves.
    #[tokio::test]
    async fn opening_an_unserved_task_again_serves_it() {
        let d = tempfile::tempdir().unwrap();
        let (gw, stop) = gateway(d.path());
        gw.open_task(open("t")).await.unwrap();
        stop.cancel();
        drop(gw);
        // The next gateway on the same data dir, before (or without) its restore.
        let (gw, _stop) = gateway(d.path());
        assert!(gw.lock()[&Tid::parse("t").unwrap()].serving.is_none());
        gw.open_task(open("t")).await.unwrap();
        assert!(gw.lock()[&Tid::parse("t").unwrap()].serving.is_some());
        tokio::net::UnixStream::connect(d.path().join("sockets/t/llm.sock"))
            .await
            .unwrap();
    }

    /// A failed write is tried again on its own: a quiet task's last settlement reaches the
    /// disk without another settlement to ask for it.
    #[tokio::test]
    async fn a_failed_save_is_retried() {
        let d = tempfile::tempdir().unwrap();
        let (gw, stop) = gateway(d.path());
        gw.open_task(open("t")).await.unwrap();
        let persister = tokio::spawn(gw.clone().run_persister());
        gw.store.fail_saves.store(2, Ordering::SeqCst);
        let tid = Tid::parse("t").unwrap();
        let r = Reservation::for_request(10, 10, None);
        gw.admit(&tid, r).unwrap();
        let usage = MeteredUsage {
            input_tokens: 7,
            output_tokens: 3,
            ..MeteredUsage::default()
        };
        Accounts::settle(&*gw, &tid, r, &usage);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while saved(d.path()).tasks["t"].spent.tokens() != 10 {
            assert!(std::time::Instant::now() < deadline, "never saved");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(gw.store.fail_saves.load(Ordering::SeqCst), 0);
        stop.cancel();
        persister.await.unwrap();
    }
}
