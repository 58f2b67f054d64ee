//! `agentbox.toml`: the one configuration file every daemon and the CLI read.
//!
//! Loading happens in two phases. A raw serde layer with `deny_unknown_fields` everywhere
//! mirrors the file exactly (the key names of `packaging/agentbox.example.toml` are a contract:
//! keys may be added, never renamed); then [`Config::from_raw`] validates it into typed values
//! so that no daemon ever sees, say, a `remote` model without a `base_url`. Every error names
//! the offending key by its full dotted path (`launcher.limits.pidz`), because an operator
//! reading a systemd journal has nothing else to go on.
//!
//! The process environment is reached only through [`HostEnv`], so tests never mutate the real
//! environment.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::env::validate_allowlist;
use crate::path::{RootPath, validate_root};

/// Where the configuration is looked up when no `--config` is given and `$AGENTBOX_CONFIG` is
/// unset.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/agentbox/agentbox.toml";

/// The data directory of a root install when the file does not name one.
pub const DEFAULT_DATA_DIR: &str = "/var/lib/agentbox";

/// Model ids appear in URL paths (`/backends/{model}/start`, `/check/{model}`) and in file
/// names, so they are kept to a conservative, path-safe alphabet.
const MODEL_ID_MAX: usize = 64;

/// Errors from reading or validating `agentbox.toml`.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read at all.
    #[error("cannot read config {path}: {source}")]
    Read {
        /// The file that was tried.
        path: PathBuf,
        /// Why reading failed.
        source: std::io::Error,
    },
    /// The file is not valid TOML, or its shape does not match (unknown key, wrong type,
    /// missing key).
    #[error("config {source_name}{}: {message}", fmt_key(key))]
    Parse {
        /// The file name (or `<string>`), for the message.
        source_name: String,
        /// The dotted path of the offending key, when known.
        key: Option<String>,
        /// 1-based line of the error, when known.
        line: Option<usize>,
        /// What is wrong.
        message: String,
    },
    /// The file parsed but a value breaks a rule.
    #[error("config {source_name}: {key}: {reason}")]
    Invalid {
        /// The file name (or `<string>`), for the message.
        source_name: String,
        /// The dotted path of the offending key.
        key: String,
        /// What is wrong with it.
        reason: String,
    },
}

fn fmt_key(key: &Option<String>) -> String {
    match key {
        Some(k) => format!(": {k}"),
        None => String::new(),
    }
}

impl ConfigError {
    /// The dotted key the error is about, if any.
    pub fn key(&self) -> Option<&str> {
        match self {
            ConfigError::Read { .. } => None,
            ConfigError::Parse { key, .. } => key.as_deref(),
            ConfigError::Invalid { key, .. } => Some(key),
        }
    }
}

/// What the loader needs from the host: environment variables and the effective uid.
pub trait HostEnv {
    /// The value of an environment variable, if set and valid UTF-8.
    fn var(&self, key: &str) -> Option<String>;
    /// The effective uid of this process.
    fn euid(&self) -> u32;
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl HostEnv for ProcessEnv {
    fn var(&self, key: &str) -> Option<String> {
        std::env::var(key).ok()
    }
    fn euid(&self) -> u32 {
        rustix::process::geteuid().as_raw()
    }
}

/// A fixed environment, for tests and for callers that already captured one.
#[derive(Debug, Clone, Default)]
pub struct FixedEnv {
    /// The variables.
    pub vars: BTreeMap<String, String>,
    /// The effective uid to report.
    pub euid: u32,
}

impl HostEnv for FixedEnv {
    fn var(&self, key: &str) -> Option<String> {
        self.vars.get(key).cloned()
    }
    fn euid(&self) -> u32 {
        self.euid
    }
}

/// The config file to read: `--config PATH` if given, then `$AGENTBOX_CONFIG`, then
/// [`DEFAULT_CONFIG_PATH`].
pub fn config_path(cli: Option<&Path>, env: &dyn HostEnv) -> PathBuf {
    if let Some(p) = cli {
        return p.to_path_buf();
    }
    match env.var("AGENTBOX_CONFIG") {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        Some(_) | None => PathBuf::from(DEFAULT_CONFIG_PATH),
    }
}

// === raw layer: exactly the file ===

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    data_dir: Option<String>,
    #[serde(default = "default_service_user")]
    service_user: String,
    #[serde(default = "default_agent_id")]
    agent_uid: u32,
    #[serde(default = "default_agent_id")]
    agent_gid: u32,
    #[serde(default = "default_agent_uid_count")]
    agent_uid_count: u32,
    #[serde(default)]
    launcher: RawLauncher,
    #[serde(default)]
    gateway: RawGateway,
    #[serde(default)]
    bridge: RawBridge,
    #[serde(default)]
    models: BTreeMap<String, RawModel>,
    pool: Option<RawPool>,
}

fn default_service_user() -> String {
    "agentbox".to_owned()
}
fn default_agent_id() -> u32 {
    64000
}

fn default_agent_uid_count() -> u32 {
    1000
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLauncher {
    #[serde(default)]
    repo_roots: Vec<String>,
    #[serde(default = "default_venv_root")]
    venv_root: String,
    #[serde(default = "default_claude_bin")]
    claude_bin: String,
    #[serde(default)]
    env_allowlist: Vec<String>,
    #[serde(default)]
    limits: Limits,
    #[serde(default = "default_blackbox_bin")]
    blackbox_bin: String,
    #[serde(default = "default_clients_dir")]
    clients_dir: String,
}

impl Default for RawLauncher {
    fn default() -> Self {
        RawLauncher {
            repo_roots: Vec::new(),
            venv_root: default_venv_root(),
            claude_bin: default_claude_bin(),
            env_allowlist: Vec::new(),
            limits: Limits::default(),
            blackbox_bin: default_blackbox_bin(),
            clients_dir: default_clients_dir(),
        }
    }
}

fn default_blackbox_bin() -> String {
    "/usr/local/bin/blackbox-server".to_owned()
}
fn default_clients_dir() -> String {
    "/opt/agentbox/clients".to_owned()
}

fn default_venv_root() -> String {
    "/opt/agentbox/venvs".to_owned()
}
fn default_claude_bin() -> String {
    "/usr/local/bin/claude".to_owned()
}

/// Sandbox limits (`[launcher.limits]`). Every value must be positive.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    /// Memory limit of one sandbox's cgroup, MiB.
    pub memory_mb: u64,
    /// Maximum number of processes in one sandbox's cgroup.
    pub pids: u64,
    /// CPU quota of one sandbox, in whole CPUs.
    pub cpus: u32,
    /// Size cap of the sandbox's `/tmp` tmpfs, MiB.
    pub tmp_mb: u64,
    /// Size cap of the sandbox's home tmpfs, MiB.
    pub home_mb: u64,
    /// Disk a run may occupy in its workspace, MiB (blocks, not apparent sizes): enforced by a
    /// project quota where the data dir's filesystem has one, else by a watcher that stops the
    /// run (`disk_exceeded`). Also each sandboxed process's largest file (`RLIMIT_FSIZE`).
    pub disk_mb: u64,
    /// Largest `timeout_s` an agent request may ask for.
    pub max_agent_timeout_s: u64,
    /// Largest `timeout_s` a check request may ask for.
    pub max_check_timeout_s: u64,
    /// Cap on each captured stdout/stderr file, KiB.
    pub output_cap_kb: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            memory_mb: 8192,
            pids: 512,
            cpus: 4,
            tmp_mb: 2048,
            home_mb: 1024,
            disk_mb: 10240,
            max_agent_timeout_s: 14400,
            max_check_timeout_s: 3600,
            output_cap_kb: 20480,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGateway {
    #[serde(default = "default_ollama_url")]
    ollama_url: String,
    #[serde(default = "default_bridge_url")]
    bridge_url: String,
    #[serde(default = "default_max_body_mb")]
    max_body_mb: u64,
    #[serde(default = "default_max_connections_per_task")]
    max_connections_per_task: u64,
    #[serde(default = "default_max_inflight_body_mb_per_task")]
    max_inflight_body_mb_per_task: u64,
    #[serde(default = "default_body_memory_mb")]
    body_memory_mb: u64,
    #[serde(default)]
    loopback_owner_uid: Option<u32>,
    #[serde(default)]
    threads: Option<u64>,
}

impl Default for RawGateway {
    fn default() -> Self {
        RawGateway {
            ollama_url: default_ollama_url(),
            bridge_url: default_bridge_url(),
            max_body_mb: default_max_body_mb(),
            max_connections_per_task: default_max_connections_per_task(),
            max_inflight_body_mb_per_task: default_max_inflight_body_mb_per_task(),
            body_memory_mb: default_body_memory_mb(),
            loopback_owner_uid: None,
            threads: None,
        }
    }
}

fn default_max_connections_per_task() -> u64 {
    64
}
fn default_max_inflight_body_mb_per_task() -> u64 {
    64
}
fn default_body_memory_mb() -> u64 {
    512
}

fn default_ollama_url() -> String {
    "http://127.0.0.1:11434".to_owned()
}
fn default_bridge_url() -> String {
    "http://127.0.0.1:8790".to_owned()
}
fn default_max_body_mb() -> u64 {
    32
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBridge {
    #[serde(default = "default_bridge_listen")]
    listen: String,
    #[serde(default = "default_token_env")]
    token_env: String,
    #[serde(default = "default_max_body_mb")]
    max_body_mb: u64,
    #[serde(default = "default_body_timeout_s")]
    body_timeout_s: u64,
    #[serde(default = "default_bridge_threads")]
    threads: u64,
}

impl Default for RawBridge {
    fn default() -> Self {
        RawBridge {
            listen: default_bridge_listen(),
            token_env: default_token_env(),
            max_body_mb: default_max_body_mb(),
            body_timeout_s: default_body_timeout_s(),
            threads: default_bridge_threads(),
        }
    }
}

fn default_bridge_threads() -> u64 {
    1
}

fn default_body_timeout_s() -> u64 {
    60
}

fn default_bridge_listen() -> String {
    "127.0.0.1:8790".to_owned()
}
fn default_token_env() -> String {
    "AGENTBOX_BRIDGE_TOKEN".to_owned()
}

/// `[pool]` as written. Absent: this host runs no `agentbox-pool`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPool {
    #[serde(default = "default_pool_slots")]
    slots: u32,
    model: String,
    #[serde(default = "default_pool_listen_host")]
    listen_host: String,
    #[serde(default = "default_pool_advertise_host")]
    advertise_host: String,
    #[serde(default = "default_pool_port_base")]
    port_base: u16,
    node_id: Option<String>,
    #[serde(default = "default_pool_health_interval_s")]
    health_interval_s: u64,
    #[serde(default = "default_pool_lease_ttl_s")]
    lease_ttl_s: u64,
    #[serde(default)]
    budget_tokens: u64,
}

fn default_pool_slots() -> u32 {
    8
}
fn default_pool_listen_host() -> String {
    "0.0.0.0".to_owned()
}
fn default_pool_advertise_host() -> String {
    "127.0.0.1".to_owned()
}
fn default_pool_port_base() -> u16 {
    31000
}
fn default_pool_health_interval_s() -> u64 {
    10
}
// The reference's `DRESSAGE_BLACKBOX_LEASE_TTL_SEC`.
fn default_pool_lease_ttl_s() -> u64 {
    2100
}

/// The raw model table: every key any backend may use, checked against the backend afterwards.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    backend: BackendKind,
    upstream_model: Option<String>,
    port: Option<u16>,
    command: Option<Vec<String>>,
    context_tokens: Option<u64>,
    max_output_tokens: Option<u64>,
    provider: Option<Provider>,
    base_url: Option<String>,
    key_env: Option<String>,
    price_input_per_mtok: Option<f64>,
    price_output_per_mtok: Option<f64>,
    price_cache_read_per_mtok: Option<f64>,
    price_cache_write_per_mtok: Option<f64>,
    #[serde(default)]
    allow_url_sources: bool,
    reasoning: Option<Reasoning>,
    forward_user_id: Option<bool>,
}

/// Which kind of backend serves a model (`backend = "..."`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// A local vLLM server started by the launcher.
    Vllm,
    /// A local Ollama server.
    Ollama,
    /// A remote provider reached through the llm-bridge.
    Remote,
    /// A rollout router (an OpenAI-compatible server, e.g. an RL trainer's): task sockets of
    /// such a model serve `POST /v1/chat/completions` only.
    Router,
}

impl BackendKind {
    /// The name used in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Vllm => "vllm",
            BackendKind::Ollama => "ollama",
            BackendKind::Remote => "remote",
            BackendKind::Router => "router",
        }
    }
}

/// The wire format a remote provider speaks (`provider = "..."`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Provider {
    /// OpenAI Chat Completions: the bridge translates.
    Openai,
    /// Anthropic Messages: the bridge passes through.
    Anthropic,
}

impl Provider {
    /// The name used in the file.
    pub fn as_str(self) -> &'static str {
        match self {
            Provider::Openai => "openai",
            Provider::Anthropic => "anthropic",
        }
    }
}

/// Where the bridge puts an Anthropic request's `thinking` when it translates it to chat
/// completions (`reasoning = "..."`, `provider = "openai"` models only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reasoning {
    /// Not sent: for models that reject reasoning settings (the default).
    #[default]
    None,
    /// `reasoning_effort`: OpenAI's reasoning models, vLLM, SGLang, Ollama.
    ReasoningEffort,
    /// `reasoning: {effort}`: OpenRouter.
    Reasoning,
}

// === validated layer: what daemons use ===

/// A validated `agentbox.toml`.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    /// Root of `run/`, `sockets/`, `tasks/` and `state/`. `$AGENTBOX_DATA` overrides the file.
    pub data_dir: PathBuf,
    /// The service user that owns `data_dir` and may call the control sockets.
    pub service_user: String,
    /// The first uid of the range sandboxed processes run as (each run its own uid); the
    /// range owns nothing on the host.
    pub agent_uid: u32,
    /// The first gid of the range; a run's gid is at the same offset as its uid.
    pub agent_gid: u32,
    /// How many uids (and gids) the range holds: at most this many runs at once.
    pub agent_uid_count: u32,
    /// `[launcher]`.
    pub launcher: LauncherConfig,
    /// `[gateway]`.
    pub gateway: GatewayConfig,
    /// `[bridge]`.
    pub bridge: BridgeConfig,
    /// The model catalogue, by agentbox model id.
    pub models: BTreeMap<ModelId, Model>,
    /// `[pool]`, when this host keeps rollout slots.
    pub pool: Option<PoolConfig>,
}

/// `[launcher]`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct LauncherConfig {
    /// The only places the git helpers may act in. Absolute, normalized, not nested in each
    /// other.
    pub repo_roots: Vec<RootPath>,
    /// Where request venvs must live.
    pub venv_root: RootPath,
    /// The Claude Code binary bound read-only into agent sandboxes.
    pub claude_bin: PathBuf,
    /// Environment keys a request may pass into a sandbox.
    pub env_allowlist: Vec<String>,
    /// Sandbox limits.
    pub limits: Limits,
    /// The `blackbox-server` a rollout slot runs, bound read-only into the slot.
    pub blackbox_bin: PathBuf,
    /// The pinned agent CLIs (`scripts/install-clients.sh`'s layout), bound read-only into
    /// every slot.
    pub clients_dir: PathBuf,
}

/// `[pool]`, validated: `agentbox-pool`'s warm slots on this host.
#[derive(Debug, Clone, PartialEq)]
pub struct PoolConfig {
    /// Warm slots kept on this host.
    pub slots: u32,
    /// The router model every slot's gateway task uses.
    pub model: ModelId,
    /// Where a leased slot's TCP port listens.
    pub listen_host: std::net::IpAddr,
    /// The host name or address in `sandbox_url`.
    pub advertise_host: String,
    /// Slot `n` is exposed on `port_base + n` while leased.
    pub port_base: u16,
    /// This host's id in leases; `None`: the host name.
    pub node_id: Option<String>,
    /// How often dead slots are looked for.
    pub health_interval: std::time::Duration,
    /// A lease not released by then is taken back; `None`: never.
    pub lease_ttl: Option<std::time::Duration>,
    /// Tokens per lease (one gateway task per slot generation); `None`: unlimited.
    pub budget_tokens: Option<u64>,
}

impl PoolConfig {
    /// The TCP port slot `slot` is exposed on (validated to fit for every slot).
    pub fn port_of(&self, slot: u32) -> Option<u16> {
        u16::try_from(u32::from(self.port_base) + slot).ok()
    }
}

/// `[gateway]`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct GatewayConfig {
    /// Ollama's base URL (its `/v1/messages` is used).
    pub ollama_url: url::Url,
    /// The llm-bridge's base URL, for remote models.
    pub bridge_url: url::Url,
    /// Largest request body accepted on a task socket, bytes.
    pub max_body_bytes: u64,
    /// Connections one task socket serves at once; the excess is answered 429 and closed.
    pub max_connections_per_task: usize,
    /// Request-body bytes one task may have buffered at once; the excess is answered 429.
    pub max_inflight_body_bytes_per_task: u64,
    /// Request-body bytes all tasks together may have buffered at once; the excess is
    /// answered 503.
    pub body_memory_bytes: u64,
    /// The uid that must own the loopback listeners of the bridge and of vLLM backends before
    /// a request (and the bridge token) is sent there; `None`: the gateway's own uid.
    pub loopback_owner_uid: Option<u32>,
    /// Event loops serving the task sockets (`gateway.threads`, 1-256); `None` (the default):
    /// one per core. Each is a single-threaded runtime and each task socket runs on one (the
    /// least loaded when it opens): a fifth less CPU per request than a work-stealing runtime
    /// (BENCHMARKS.md), and a task's CPU-heavy requests (a 32 MB body parsed) delay only the
    /// tasks on its shard.
    pub threads: Option<usize>,
}

/// `[bridge]`, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct BridgeConfig {
    /// The TCP address the bridge listens on.
    pub listen: SocketAddr,
    /// The environment variable holding the bridge's own bearer token.
    pub token_env: String,
    /// Largest request body accepted, bytes.
    pub max_body_bytes: u64,
    /// How long a client may take to send its request body (slow clients get 408).
    pub body_timeout: std::time::Duration,
    /// Threads serving requests (`bridge.threads`, 1-256): 1 (the default) is a single-threaded
    /// runtime, which spends about a third less CPU per call than tokio's multi-threaded one and
    /// adds half the latency to a streamed call (no cross-thread wake-up per frame), and still
    /// serves thousands of calls a second; more only for a host whose call rate needs more
    /// than one core. `BENCHMARKS.md` has the figures.
    pub threads: usize,
}

/// An agentbox model id: the table name in `[models.<id>]`.
///
/// `^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$`, and not made only of dots, because ids appear in URL
/// paths and file names.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize)]
#[serde(transparent)]
pub struct ModelId(String);

/// Why a model id was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid model id {0:?}: expected 1-64 of [A-Za-z0-9._-], starting with a letter or digit")]
pub struct ModelIdError(pub String);

impl ModelId {
    /// Checks `s` against the model id rule.
    pub fn parse(s: &str) -> Result<ModelId, ModelIdError> {
        let bytes = s.as_bytes();
        let ok_first = bytes.first().is_some_and(u8::is_ascii_alphanumeric);
        let ok_rest = bytes
            .iter()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if ok_first && ok_rest && bytes.len() <= MODEL_ID_MAX {
            Ok(ModelId(s.to_owned()))
        } else {
            Err(ModelIdError(s.to_owned()))
        }
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ModelId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for ModelId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        ModelId::parse(&s).map_err(serde::de::Error::custom)
    }
}

/// One catalogue entry, validated.
#[derive(Debug, Clone, PartialEq)]
pub struct Model {
    /// The agentbox id (the table name).
    pub id: ModelId,
    /// Context window, when configured.
    pub context_tokens: Option<u64>,
    /// Cap for `max_tokens` of requests to this model, when configured.
    pub max_output_tokens: Option<u64>,
    /// Prices for cost budgets; `None` means cost budgets cannot be used with this model.
    pub prices: Option<Prices>,
    /// Whether requests may carry media with URL sources (`allow_url_sources`, default false):
    /// the provider fetches them, so they can carry data out and cost what the gateway cannot
    /// see.
    pub allow_url_sources: bool,
    /// Where a translated request's `thinking` goes (`reasoning`, default none).
    pub reasoning: Reasoning,
    /// Whether the client's `metadata.user_id` (Claude Code's device, account and session
    /// ids) reaches the provider (`forward_user_id`, default false; remote models only).
    pub forward_user_id: bool,
    /// Where the model is served.
    pub backend: Backend,
}

/// Where a model is served, with exactly the settings that backend needs.
#[derive(Debug, Clone, PartialEq)]
pub enum Backend {
    /// A local vLLM server, started by the launcher on demand.
    Vllm {
        /// The model name sent upstream in place of whatever the agent asked for.
        upstream_model: String,
        /// vLLM listens on `127.0.0.1:<port>`.
        port: u16,
        /// argv of the server; `command[0]` is the program.
        command: Vec<String>,
    },
    /// The local Ollama server at `gateway.ollama_url`.
    Ollama {
        /// The model name sent upstream in place of whatever the agent asked for.
        upstream_model: String,
    },
    /// A remote provider behind the llm-bridge.
    Remote {
        /// The model name sent upstream in place of whatever the agent asked for.
        upstream_model: String,
        /// The provider's wire format.
        provider: Provider,
        /// The provider's base URL.
        base_url: url::Url,
        /// The environment variable (read by the bridge only) holding the provider key.
        key_env: String,
    },
    /// A rollout router: chat completions forwarded to `<base_url>/chat/completions`.
    Router {
        /// The model name sent upstream; `None` keeps the caller's (the router picks).
        upstream_model: Option<String>,
        /// The router's OpenAI-compatible base URL (`.../v1`).
        base_url: url::Url,
    },
}

impl Backend {
    /// The backend kind, as in the file.
    pub fn kind(&self) -> BackendKind {
        match self {
            Backend::Vllm { .. } => BackendKind::Vllm,
            Backend::Ollama { .. } => BackendKind::Ollama,
            Backend::Remote { .. } => BackendKind::Remote,
            Backend::Router { .. } => BackendKind::Router,
        }
    }

    /// The model name sent upstream; `None` only for a router model that keeps the caller's.
    pub fn upstream_model(&self) -> Option<&str> {
        match self {
            Backend::Vllm { upstream_model, .. }
            | Backend::Ollama { upstream_model }
            | Backend::Remote { upstream_model, .. } => Some(upstream_model),
            Backend::Router { upstream_model, .. } => upstream_model.as_deref(),
        }
    }
}

/// USD per million tokens.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prices {
    /// Uncached input tokens.
    pub input_per_mtok: f64,
    /// Output tokens.
    pub output_per_mtok: f64,
    /// Cache-read input tokens. Defaults to the input price: a budget may overestimate spend,
    /// never underestimate it.
    pub cache_read_per_mtok: f64,
    /// Cache-creation input tokens. Defaults to 1.25 × input, Anthropic's price for the default
    /// five-minute writes; hour-long writes cost more ([`Prices::cache_write_1h_per_mtok`]).
    pub cache_write_per_mtok: f64,
}

impl Prices {
    /// Cache-creation tokens written for an hour (`ttl = "1h"`): Anthropic charges twice the
    /// input price, so at least that, whatever the configured write price.
    pub fn cache_write_1h_per_mtok(&self) -> f64 {
        self.cache_write_per_mtok.max(2.0 * self.input_per_mtok)
    }

    /// The cost in USD of the given token counts (cache writes at the five-minute price).
    pub fn cost_usd(&self, input: u64, output: u64, cache_read: u64, cache_write: u64) -> f64 {
        // Token counts stay far below 2^53, so the float conversion is exact.
        #[allow(clippy::cast_precision_loss)]
        let per = |n: u64, price: f64| n as f64 * price / 1_000_000.0;
        per(input, self.input_per_mtok)
            + per(output, self.output_per_mtok)
            + per(cache_read, self.cache_read_per_mtok)
            + per(cache_write, self.cache_write_per_mtok)
    }
}

impl Config {
    /// Reads and validates the file at `path`, then applies `$AGENTBOX_DATA`.
    pub fn load(path: &Path, env: &dyn HostEnv) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Config::from_toml_str(&text, &path.display().to_string(), env)
    }

    /// Parses and validates TOML text; `source_name` names it in errors.
    pub fn from_toml_str(
        text: &str,
        source_name: &str,
        env: &dyn HostEnv,
    ) -> Result<Config, ConfigError> {
        let raw = parse_raw(text, source_name)?;
        Config::from_raw(raw, source_name, env)
    }

    /// Looks a model up by its agentbox id.
    pub fn model(&self, id: &str) -> Option<&Model> {
        let id = ModelId::parse(id).ok()?;
        self.models.get(&id)
    }

    fn from_raw(
        raw: RawConfig,
        source_name: &str,
        env: &dyn HostEnv,
    ) -> Result<Config, ConfigError> {
        let invalid = |key: &str, reason: String| ConfigError::Invalid {
            source_name: source_name.to_owned(),
            key: key.to_owned(),
            reason,
        };
        let root = |key: &str, value: &str| -> Result<PathBuf, ConfigError> {
            validate_root(value)
                .map(Into::into)
                .map_err(|e| invalid(key, e.to_string()))
        };

        let data_dir = match env.var("AGENTBOX_DATA").filter(|v| !v.is_empty()) {
            Some(over) => root("AGENTBOX_DATA (environment)", &over)?,
            None => match raw.data_dir {
                Some(d) => root("data_dir", &d)?,
                None => default_data_dir(env),
            },
        };

        if !is_user_name(&raw.service_user) {
            return Err(invalid(
                "service_user",
                format!("{:?} is not a valid user name", raw.service_user),
            ));
        }
        // Uid/gid 0 would make the sandbox root on the host; 65534 is `nobody`, shared with
        // unrelated services.
        if raw.agent_uid_count == 0 || raw.agent_uid_count > 1 << 20 {
            return Err(invalid(
                "agent_uid_count",
                format!("{} is not between 1 and {}", raw.agent_uid_count, 1 << 20),
            ));
        }
        for (key, first) in [("agent_uid", raw.agent_uid), ("agent_gid", raw.agent_gid)] {
            let Some(last) = first.checked_add(raw.agent_uid_count - 1) else {
                return Err(invalid(
                    "agent_uid_count",
                    format!("{key} + agent_uid_count overflows"),
                ));
            };
            // 65535 and u32::MAX are (uid_t)-1 (16 and 32 bit): "no change" to chown.
            for id in [0, 65534, 65535, u32::MAX] {
                if (first..=last).contains(&id) {
                    let what = if id == first { key } else { "agent_uid_count" };
                    return Err(invalid(
                        what,
                        format!("the agent range {first}-{last} contains {id}"),
                    ));
                }
            }
        }

        let launcher = validate_launcher(raw.launcher, &invalid, &root)?;
        let gateway = validate_gateway(&raw.gateway, &invalid)?;
        let bridge = BridgeConfig {
            listen: raw.bridge.listen.parse().map_err(|_| {
                invalid(
                    "bridge.listen",
                    format!("{:?} is not an ip:port address", raw.bridge.listen),
                )
            })?,
            token_env: env_name(&raw.bridge.token_env)
                .map_err(|r| invalid("bridge.token_env", r))?,
            max_body_bytes: mib("bridge.max_body_mb", raw.bridge.max_body_mb, &invalid)?,
            body_timeout: match raw.bridge.body_timeout_s {
                0 | 3601.. => {
                    return Err(invalid(
                        "bridge.body_timeout_s",
                        format!("{} is outside 1-3600", raw.bridge.body_timeout_s),
                    ));
                }
                s => std::time::Duration::from_secs(s),
            },
            threads: match usize::try_from(raw.bridge.threads) {
                Ok(n @ 1..=256) => n,
                Ok(_) | Err(_) => {
                    return Err(invalid(
                        "bridge.threads",
                        format!("{} is outside 1-256", raw.bridge.threads),
                    ));
                }
            },
        };

        let mut models = BTreeMap::new();
        let mut vllm_ports: BTreeMap<u16, ModelId> = BTreeMap::new();
        for (name, rm) in raw.models {
            let key = format!("models.{name}");
            let id = ModelId::parse(&name).map_err(|e| invalid(&key, e.to_string()))?;
            let model = validate_model(id.clone(), rm, &key, &invalid)?;
            if let Backend::Vllm { port, .. } = &model.backend
                && let Some(other) = vllm_ports.insert(*port, id.clone())
            {
                return Err(invalid(
                    &format!("{key}.port"),
                    format!("port {port} is already used by models.{other}"),
                ));
            }
            models.insert(id, model);
        }

        let pool = match raw.pool {
            Some(p) => Some(validate_pool(p, &models, &invalid)?),
            None => None,
        };

        Ok(Config {
            data_dir,
            service_user: raw.service_user,
            agent_uid: raw.agent_uid,
            agent_gid: raw.agent_gid,
            agent_uid_count: raw.agent_uid_count,
            launcher,
            gateway,
            bridge,
            models,
            pool,
        })
    }
}

fn parse_raw(text: &str, source_name: &str) -> Result<RawConfig, ConfigError> {
    let parse_err = |key: Option<String>, err: &toml::de::Error| ConfigError::Parse {
        source_name: source_name.to_owned(),
        key,
        line: err.span().map(|s| line_of(text, s.start)),
        message: match err.span() {
            Some(s) => format!("line {}: {}", line_of(text, s.start), err.message()),
            None => err.message().to_owned(),
        },
    };
    let de = toml::Deserializer::parse(text).map_err(|e| parse_err(None, &e))?;
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let key = (path != ".").then_some(path);
        parse_err(key, e.inner())
    })
}

fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset).map_or(0, |t| t.matches('\n').count()) + 1
}

fn default_data_dir(env: &dyn HostEnv) -> PathBuf {
    if env.euid() == 0 {
        return PathBuf::from(DEFAULT_DATA_DIR);
    }
    let abs = |v: Option<String>| v.filter(|p| p.starts_with('/')).map(PathBuf::from);
    if let Some(xdg) = abs(env.var("XDG_DATA_HOME")) {
        return xdg.join("agentbox");
    }
    match abs(env.var("HOME")) {
        Some(home) => home.join(".local/share/agentbox"),
        None => PathBuf::from(DEFAULT_DATA_DIR),
    }
}

fn validate_launcher(
    raw: RawLauncher,
    invalid: &dyn Fn(&str, String) -> ConfigError,
    root: &dyn Fn(&str, &str) -> Result<PathBuf, ConfigError>,
) -> Result<LauncherConfig, ConfigError> {
    let root_path = |key: &str, value: &str| -> Result<RootPath, ConfigError> {
        validate_root(value).map_err(|e| invalid(key, e.to_string()))
    };
    let mut repo_roots = Vec::with_capacity(raw.repo_roots.len());
    for (i, r) in raw.repo_roots.iter().enumerate() {
        repo_roots.push(root_path(&format!("launcher.repo_roots[{i}]"), r)?);
    }
    // Nested roots would make "which root is this repo under" ambiguous and usually mean a typo
    // that widens the allowlist.
    for (i, a) in repo_roots.iter().enumerate() {
        for b in repo_roots.iter().skip(i + 1) {
            if a.as_path().starts_with(b) || b.as_path().starts_with(a) {
                return Err(invalid(
                    "launcher.repo_roots",
                    format!("{a} and {b} overlap"),
                ));
            }
        }
    }
    let venv_root = root_path("launcher.venv_root", &raw.venv_root)?;
    let claude_bin = root("launcher.claude_bin", &raw.claude_bin)?;
    validate_allowlist(&raw.env_allowlist)
        .map_err(|e| invalid("launcher.env_allowlist", e.to_string()))?;
    let mut seen = BTreeSet::new();
    for k in &raw.env_allowlist {
        if !seen.insert(k) {
            return Err(invalid(
                "launcher.env_allowlist",
                format!("{k} is listed twice"),
            ));
        }
    }
    let l = &raw.limits;
    let positive = [
        ("memory_mb", l.memory_mb),
        ("pids", l.pids),
        ("cpus", u64::from(l.cpus)),
        ("tmp_mb", l.tmp_mb),
        ("home_mb", l.home_mb),
        ("disk_mb", l.disk_mb),
        ("max_agent_timeout_s", l.max_agent_timeout_s),
        ("max_check_timeout_s", l.max_check_timeout_s),
        ("output_cap_kb", l.output_cap_kb),
    ];
    for (k, v) in positive {
        if v == 0 {
            return Err(invalid(
                &format!("launcher.limits.{k}"),
                "must be greater than 0".to_owned(),
            ));
        }
    }
    if [l.memory_mb, l.tmp_mb, l.home_mb, l.disk_mb]
        .iter()
        .any(|&mb| mb > (1 << 24))
    {
        return Err(invalid(
            "launcher.limits",
            "sizes above 16 TiB are not plausible".to_owned(),
        ));
    }
    Ok(LauncherConfig {
        repo_roots,
        venv_root,
        claude_bin,
        env_allowlist: raw.env_allowlist,
        limits: raw.limits,
        blackbox_bin: root("launcher.blackbox_bin", &raw.blackbox_bin)?,
        clients_dir: root("launcher.clients_dir", &raw.clients_dir)?,
    })
}

fn validate_pool(
    raw: RawPool,
    models: &BTreeMap<ModelId, Model>,
    invalid: &dyn Fn(&str, String) -> ConfigError,
) -> Result<PoolConfig, ConfigError> {
    if raw.slots == 0 || raw.slots > 4096 {
        return Err(invalid(
            "pool.slots",
            format!("{} is outside 1-4096", raw.slots),
        ));
    }
    let model = ModelId::parse(&raw.model).map_err(|e| invalid("pool.model", e.to_string()))?;
    match models.get(&model).map(|m| m.backend.kind()) {
        Some(BackendKind::Router) => {}
        Some(other) => {
            return Err(invalid(
                "pool.model",
                format!(
                    "models.{model} is backend \"{}\"; slots need a \"router\" model",
                    other.as_str()
                ),
            ));
        }
        None => {
            return Err(invalid(
                "pool.model",
                format!("no model {model:?} in [models]"),
            ));
        }
    }
    let listen_host = raw.listen_host.parse().map_err(|_| {
        invalid(
            "pool.listen_host",
            format!("{:?} is not an IP address", raw.listen_host),
        )
    })?;
    // The advertised host goes into a URL other machines dial: it must be a host and nothing
    // more (no port, path or credentials).
    let host_ok = url::Url::parse(&format!("http://{}/", raw.advertise_host))
        .ok()
        .and_then(|u| {
            u.host_str()
                .map(|h| h.eq_ignore_ascii_case(&raw.advertise_host))
        })
        .unwrap_or(false);
    if !host_ok {
        return Err(invalid(
            "pool.advertise_host",
            format!("{:?} is not a host name or address", raw.advertise_host),
        ));
    }
    if raw.port_base == 0 || u32::from(raw.port_base) + raw.slots - 1 > u32::from(u16::MAX) {
        return Err(invalid(
            "pool.port_base",
            format!(
                "ports {}-{} do not fit in 1-65535",
                raw.port_base,
                u32::from(raw.port_base) + raw.slots - 1
            ),
        ));
    }
    if let Some(id) = &raw.node_id {
        let ok = !id.is_empty()
            && id.len() <= 64
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !ok {
            return Err(invalid(
                "pool.node_id",
                format!("{id:?} is not 1-64 of [A-Za-z0-9._-]"),
            ));
        }
    }
    if raw.health_interval_s == 0 || raw.health_interval_s > 3600 {
        return Err(invalid(
            "pool.health_interval_s",
            format!("{} is outside 1-3600", raw.health_interval_s),
        ));
    }
    Ok(PoolConfig {
        slots: raw.slots,
        model,
        listen_host,
        advertise_host: raw.advertise_host,
        port_base: raw.port_base,
        node_id: raw.node_id,
        health_interval: std::time::Duration::from_secs(raw.health_interval_s),
        lease_ttl: (raw.lease_ttl_s > 0).then(|| std::time::Duration::from_secs(raw.lease_ttl_s)),
        budget_tokens: (raw.budget_tokens > 0).then_some(raw.budget_tokens),
    })
}

fn validate_model(
    id: ModelId,
    rm: RawModel,
    key: &str,
    invalid: &dyn Fn(&str, String) -> ConfigError,
) -> Result<Model, ConfigError> {
    let k = |field: &str| format!("{key}.{field}");
    let backend_name = rm.backend.as_str();
    let forbid = |field: &str, present: bool| -> Result<(), ConfigError> {
        if present {
            Err(invalid(
                &k(field),
                format!("not used by backend \"{backend_name}\""),
            ))
        } else {
            Ok(())
        }
    };
    let require = |field: &str| {
        invalid(
            &k(field),
            format!("required for backend \"{backend_name}\""),
        )
    };

    let upstream_model = match rm.upstream_model {
        Some(m) if m.trim().is_empty() || m.chars().any(char::is_control) => {
            return Err(invalid(
                &k("upstream_model"),
                "must be a non-empty name without control characters".to_owned(),
            ));
        }
        Some(m) => Some(m),
        None => None,
    };
    let required_model = || {
        upstream_model
            .clone()
            .ok_or_else(|| require("upstream_model"))
    };

    let backend = match rm.backend {
        BackendKind::Vllm => {
            forbid("provider", rm.provider.is_some())?;
            forbid("base_url", rm.base_url.is_some())?;
            forbid("key_env", rm.key_env.is_some())?;
            let upstream_model = required_model()?;
            let port = rm.port.ok_or_else(|| require("port"))?;
            if port == 0 {
                return Err(invalid(&k("port"), "must be 1-65535".to_owned()));
            }
            let command = rm.command.ok_or_else(|| require("command"))?;
            if command.first().is_none_or(|c| c.is_empty())
                || command.iter().any(|a| a.contains('\0'))
            {
                return Err(invalid(
                    &k("command"),
                    "must be a non-empty argv without NUL bytes".to_owned(),
                ));
            }
            Backend::Vllm {
                upstream_model,
                port,
                command,
            }
        }
        BackendKind::Ollama => {
            forbid("port", rm.port.is_some())?;
            forbid("command", rm.command.is_some())?;
            forbid("provider", rm.provider.is_some())?;
            forbid("base_url", rm.base_url.is_some())?;
            forbid("key_env", rm.key_env.is_some())?;
            Backend::Ollama {
                upstream_model: required_model()?,
            }
        }
        BackendKind::Remote => {
            forbid("port", rm.port.is_some())?;
            forbid("command", rm.command.is_some())?;
            let upstream_model = required_model()?;
            let provider = rm.provider.ok_or_else(|| require("provider"))?;
            let base_url = rm.base_url.ok_or_else(|| require("base_url"))?;
            let base_url = http_url(&base_url).map_err(|r| invalid(&k("base_url"), r))?;
            let key_env = rm.key_env.ok_or_else(|| require("key_env"))?;
            let key_env = env_name(&key_env).map_err(|r| invalid(&k("key_env"), r))?;
            Backend::Remote {
                upstream_model,
                provider,
                base_url,
                key_env,
            }
        }
        BackendKind::Router => {
            forbid("port", rm.port.is_some())?;
            forbid("command", rm.command.is_some())?;
            forbid("provider", rm.provider.is_some())?;
            forbid("key_env", rm.key_env.is_some())?;
            let base_url = rm.base_url.ok_or_else(|| require("base_url"))?;
            let base_url = http_url(&base_url).map_err(|r| invalid(&k("base_url"), r))?;
            Backend::Router {
                upstream_model,
                base_url,
            }
        }
    };

    // Only the bridge reads these: a local backend gets the request as the agent sent it.
    let remote = matches!(backend, Backend::Remote { .. });
    forbid("forward_user_id", !remote && rm.forward_user_id.is_some())?;
    let translated = matches!(
        backend,
        Backend::Remote {
            provider: Provider::Openai,
            ..
        }
    );
    if !translated && rm.reasoning.is_some() {
        return Err(invalid(
            &k("reasoning"),
            "only used by backend \"remote\" with provider \"openai\"".to_owned(),
        ));
    }

    for (field, v) in [
        ("context_tokens", rm.context_tokens),
        ("max_output_tokens", rm.max_output_tokens),
    ] {
        if v == Some(0) {
            return Err(invalid(&k(field), "must be greater than 0".to_owned()));
        }
    }
    if let (Some(ctx), Some(out)) = (rm.context_tokens, rm.max_output_tokens)
        && out > ctx
    {
        return Err(invalid(
            &k("max_output_tokens"),
            format!("{out} exceeds context_tokens {ctx}"),
        ));
    }

    let price = |field: &str, v: Option<f64>| -> Result<Option<f64>, ConfigError> {
        match v {
            Some(p) if !p.is_finite() || p < 0.0 => Err(invalid(
                &k(field),
                format!("{p} is not a price (finite, >= 0)"),
            )),
            other => Ok(other),
        }
    };
    let input = price("price_input_per_mtok", rm.price_input_per_mtok)?;
    let output = price("price_output_per_mtok", rm.price_output_per_mtok)?;
    let cache_read = price("price_cache_read_per_mtok", rm.price_cache_read_per_mtok)?;
    let cache_write = price("price_cache_write_per_mtok", rm.price_cache_write_per_mtok)?;
    let prices = match (input, output) {
        (Some(i), Some(o)) => Some(Prices {
            input_per_mtok: i,
            output_per_mtok: o,
            cache_read_per_mtok: cache_read.unwrap_or(i),
            cache_write_per_mtok: cache_write.unwrap_or(i * 1.25),
        }),
        (None, None) => {
            if cache_read.is_some() || cache_write.is_some() {
                return Err(invalid(
                    &k("price_input_per_mtok"),
                    "cache prices need input and output prices".to_owned(),
                ));
            }
            None
        }
        (Some(_), None) => {
            return Err(invalid(
                &k("price_output_per_mtok"),
                "required with price_input_per_mtok".to_owned(),
            ));
        }
        (None, Some(_)) => {
            return Err(invalid(
                &k("price_input_per_mtok"),
                "required with price_output_per_mtok".to_owned(),
            ));
        }
    };

    Ok(Model {
        id,
        context_tokens: rm.context_tokens,
        max_output_tokens: rm.max_output_tokens,
        prices,
        allow_url_sources: rm.allow_url_sources,
        reasoning: rm.reasoning.unwrap_or_default(),
        forward_user_id: rm.forward_user_id.unwrap_or(false),
        backend,
    })
}

fn validate_gateway(
    raw: &RawGateway,
    invalid: &dyn Fn(&str, String) -> ConfigError,
) -> Result<GatewayConfig, ConfigError> {
    let max_body_bytes = mib("gateway.max_body_mb", raw.max_body_mb, invalid)?;
    let per_task = mib(
        "gateway.max_inflight_body_mb_per_task",
        raw.max_inflight_body_mb_per_task,
        invalid,
    )?;
    let body_memory = mib("gateway.body_memory_mb", raw.body_memory_mb, invalid)?;
    // A body of the largest allowed size must fit in both budgets, or it could never be read.
    let at_least = |(key, v): (&str, u64), (floor_key, floor): (&str, u64)| {
        if v < floor {
            return Err(invalid(key, format!("{v} is below {floor_key} ({floor})")));
        }
        Ok(())
    };
    let per_task_mb = raw.max_inflight_body_mb_per_task;
    at_least(
        ("gateway.max_inflight_body_mb_per_task", per_task_mb),
        ("gateway.max_body_mb", raw.max_body_mb),
    )?;
    at_least(
        ("gateway.body_memory_mb", raw.body_memory_mb),
        ("gateway.max_inflight_body_mb_per_task", per_task_mb),
    )?;
    let max_connections_per_task = match raw.max_connections_per_task {
        n @ 1..=65536 => usize::try_from(n).unwrap_or(usize::MAX),
        n => {
            return Err(invalid(
                "gateway.max_connections_per_task",
                format!("{n} is outside 1-65536"),
            ));
        }
    };
    Ok(GatewayConfig {
        ollama_url: http_url(&raw.ollama_url).map_err(|r| invalid("gateway.ollama_url", r))?,
        bridge_url: http_url(&raw.bridge_url)
            .and_then(one_address)
            .map_err(|r| invalid("gateway.bridge_url", r))?,
        max_body_bytes,
        max_connections_per_task,
        max_inflight_body_bytes_per_task: per_task,
        body_memory_bytes: body_memory,
        loopback_owner_uid: raw.loopback_owner_uid,
        threads: raw
            .threads
            .map(|n| match usize::try_from(n) {
                Ok(n @ 1..=256) => Ok(n),
                Ok(_) | Err(_) => Err(invalid("gateway.threads", format!("{n} is outside 1-256"))),
            })
            .transpose()?,
    })
}

fn mib(
    key: &str,
    v: u64,
    invalid: &dyn Fn(&str, String) -> ConfigError,
) -> Result<u64, ConfigError> {
    if v == 0 || v > 4096 {
        return Err(invalid(key, format!("{v} is outside 1-4096")));
    }
    Ok(v * 1024 * 1024)
}

fn http_url(s: &str) -> Result<url::Url, String> {
    let u = url::Url::parse(s).map_err(|e| format!("{s:?} is not a URL: {e}"))?;
    if !matches!(u.scheme(), "http" | "https") {
        return Err(format!("{s:?} must be http or https"));
    }
    if u.host().is_none() {
        return Err(format!("{s:?} has no host"));
    }
    // Credentials in a URL end up in logs; keys belong in `key_env`.
    if !u.username().is_empty() || u.password().is_some() {
        return Err(format!("{s:?} must not carry credentials"));
    }
    if u.query().is_some() || u.fragment().is_some() {
        return Err(format!("{s:?} must not have a query or fragment"));
    }
    Ok(u)
}

/// A URL whose listener the gateway checks before sending (the bridge's) is an IP address: a
/// name may resolve to loopback addresses the check does not know (`localhost` names both
/// 127.0.0.1 and ::1, and so may `localhost.` or an `/etc/hosts` alias), and the client may
/// connect to whichever a local user binds.
fn one_address(u: url::Url) -> Result<url::Url, String> {
    match u.host() {
        Some(url::Host::Ipv4(_) | url::Host::Ipv6(_)) => Ok(u),
        Some(url::Host::Domain(_)) | None => Err(format!(
            "{u} must name the bridge by its IP address (e.g. http://127.0.0.1:8790), not a name"
        )),
    }
}

fn env_name(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let ok = b
        .first()
        .is_some_and(|c| c.is_ascii_alphabetic() || *c == b'_')
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'_');
    if ok {
        Ok(s.to_owned())
    } else {
        Err(format!("{s:?} is not an environment variable name"))
    }
}

fn is_user_name(s: &str) -> bool {
    // The portable POSIX user name set, as useradd accepts it by default.
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 32
        && (b[0].is_ascii_lowercase() || b[0] == b'_')
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, b'_' | b'-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXAMPLE: &str = include_str!("../../packaging/agentbox.example.toml");

    fn root_env() -> FixedEnv {
        FixedEnv {
            vars: BTreeMap::new(),
            euid: 0,
        }
    }

    fn parse(text: &str) -> Result<Config, ConfigError> {
        Config::from_toml_str(text, "test.toml", &root_env())
    }

    fn err_key(text: &str) -> String {
        let e = parse(text).expect_err("config should be refused");
        e.key()
            .unwrap_or_else(|| panic!("error without key: {e}"))
            .to_owned()
    }

    /// Each `(prefix + body, key)`: the config is refused and the error names `key`.
    fn assert_err_keys(prefix: &str, cases: &[(&str, &str)]) {
        for (body, key) in cases {
            assert_eq!(err_key(&format!("{prefix}{body}")), *key, "{body:?}");
        }
    }

    #[test]
    fn example_config_loads_with_every_backend() {
        let c = parse(EXAMPLE).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/var/lib/agentbox"));
        assert_eq!(c.agent_uid, 64000);
        assert_eq!(c.agent_uid_count, 1000);
        assert_eq!(
            c.launcher.repo_roots,
            vec![validate_root("/srv/repos").unwrap()]
        );
        assert_eq!(c.launcher.limits, Limits::default());
        assert_eq!(c.gateway.max_body_bytes, 32 << 20);
        assert_eq!(c.gateway.threads, None, "one thread per core unless asked");
        assert_eq!(
            parse(&format!("{EXAMPLE}\n").replace("[bridge]", "threads = 1\n\n[bridge]"))
                .unwrap()
                .gateway
                .threads,
            Some(1)
        );
        assert_eq!(c.gateway.max_connections_per_task, 64);
        assert_eq!(c.gateway.max_inflight_body_bytes_per_task, 64 << 20);
        assert_eq!(c.gateway.body_memory_bytes, 512 << 20);
        assert_eq!(c.gateway.loopback_owner_uid, None);
        assert_eq!(
            c.bridge.listen,
            "127.0.0.1:8790".parse::<SocketAddr>().unwrap()
        );
        assert!(!c.model("sonnet").unwrap().allow_url_sources);
        let q = c.model("qwen-coder").unwrap();
        assert_eq!(
            q.backend,
            Backend::Vllm {
                upstream_model: "Qwen/Qwen3-Coder-30B-A3B-Instruct".into(),
                port: 8001,
                command: vec![
                    "vllm".into(),
                    "serve".into(),
                    "Qwen/Qwen3-Coder-30B-A3B-Instruct".into(),
                    "--port".into(),
                    "8001".into()
                ]
            }
        );
        assert_eq!(q.max_output_tokens, Some(8192));
        assert!(matches!(
            c.model("qwen-ollama").unwrap().backend,
            Backend::Ollama { .. }
        ));
        let g = c.model("gpt-5").unwrap();
        assert!(
            matches!(&g.backend, Backend::Remote { provider: Provider::Openai, key_env, .. } if key_env == "OPENAI_API_KEY")
        );
        let p = g.prices.unwrap();
        assert_eq!(
            (p.input_per_mtok, p.output_per_mtok, p.cache_read_per_mtok),
            (1.25, 10.0, 1.25)
        );
        assert!(matches!(
            c.model("sonnet").unwrap().backend,
            Backend::Remote {
                provider: Provider::Anthropic,
                ..
            }
        ));
        assert!(c.model("nope").is_none());
        assert!(c.model("../x").is_none());
        assert_eq!(g.reasoning, Reasoning::ReasoningEffort);
        assert!(!g.forward_user_id);
        assert_eq!(c.model("sonnet").unwrap().reasoning, Reasoning::None);
    }

    #[test]
    fn reasoning_and_forward_user_id_belong_to_remote_models() {
        let remote = |provider: &str, body: &str| {
            format!(
                "[models.m]\nbackend = \"remote\"\nprovider = \"{provider}\"\nbase_url = \"https://x\"\nupstream_model = \"u\"\nkey_env = \"K\"\n{body}"
            )
        };
        let m = parse(&remote(
            "openai",
            "reasoning = \"reasoning\"\nforward_user_id = true",
        ))
        .unwrap();
        let m = m.model("m").unwrap();
        assert_eq!(m.reasoning, Reasoning::Reasoning);
        assert!(m.forward_user_id);
        let m = parse(&remote("openai", "")).unwrap();
        assert_eq!(m.model("m").unwrap().reasoning, Reasoning::None);
        assert!(!m.model("m").unwrap().forward_user_id);
        assert!(
            parse(&remote("anthropic", "forward_user_id = true"))
                .unwrap()
                .model("m")
                .unwrap()
                .forward_user_id
        );
        assert_err_keys(
            "",
            &[
                (
                    &remote("anthropic", "reasoning = \"reasoning_effort\""),
                    "models.m.reasoning",
                ),
                (
                    &remote("openai", "reasoning = \"effort\""),
                    "models.m.reasoning",
                ),
                (
                    &remote("openai", "forward_user_id = \"yes\""),
                    "models.m.forward_user_id",
                ),
                (
                    "[models.m]\nbackend = \"ollama\"\nupstream_model = \"x\"\nreasoning = \"reasoning\"",
                    "models.m.reasoning",
                ),
                (
                    "[models.m]\nbackend = \"ollama\"\nupstream_model = \"x\"\nforward_user_id = false",
                    "models.m.forward_user_id",
                ),
            ],
        );
    }

    #[test]
    fn example_config_has_slots_a_router_and_a_pool() {
        let c = parse(EXAMPLE).unwrap();
        assert_eq!(
            c.launcher.blackbox_bin,
            PathBuf::from("/usr/local/bin/blackbox-server")
        );
        assert_eq!(
            c.launcher.clients_dir,
            PathBuf::from("/opt/agentbox/clients")
        );
        let r = c.model("rollout").unwrap();
        assert!(
            matches!(&r.backend, Backend::Router { upstream_model: None, base_url } if base_url.as_str() == "http://127.0.0.1:8000/v1")
        );
        assert_eq!(r.backend.upstream_model(), None);
        let p = c.pool.as_ref().unwrap();
        assert_eq!((p.slots, p.model.as_str()), (8, "rollout"));
        assert_eq!(p.listen_host.to_string(), "0.0.0.0");
        assert_eq!(p.advertise_host, "127.0.0.1");
        assert_eq!((p.port_base, p.port_of(7)), (31000, Some(31007)));
        assert_eq!(p.node_id, None);
        assert_eq!(p.health_interval, std::time::Duration::from_secs(10));
        assert_eq!(p.lease_ttl, Some(std::time::Duration::from_secs(2100)));
        assert_eq!(p.budget_tokens, None);
        assert_eq!(
            c.model("gpt-5").unwrap().backend.upstream_model(),
            Some("gpt-5")
        );
    }

    #[test]
    fn router_models_and_the_pool_are_checked() {
        let router = "[models.r]\nbackend = \"router\"\nbase_url = \"http://127.0.0.1:8000/v1\"\n";
        let c = parse(&format!("{router}upstream_model = \"Qwen\"")).unwrap();
        assert_eq!(c.model("r").unwrap().backend.upstream_model(), Some("Qwen"));
        assert!(c.pool.is_none());
        let ollama = "[models.o]\nbackend = \"ollama\"\nupstream_model = \"x\"\n";
        let pool = |body: &str| format!("{router}{ollama}[pool]\nmodel = \"r\"\n{body}");
        let p = parse(&pool(
            "lease_ttl_s = 0\nbudget_tokens = 5\nnode_id = \"n-1\"",
        ))
        .unwrap()
        .pool
        .unwrap();
        assert_eq!((p.lease_ttl, p.budget_tokens), (None, Some(5)));
        assert_eq!(p.node_id.as_deref(), Some("n-1"));
        assert_err_keys(
            "",
            &[
                ("[models.r]\nbackend = \"router\"", "models.r.base_url"),
                (&format!("{router}key_env = \"K\""), "models.r.key_env"),
                (&format!("{router}port = 1"), "models.r.port"),
                (
                    &format!("{router}provider = \"openai\""),
                    "models.r.provider",
                ),
                (
                    &format!("{router}reasoning = \"reasoning\""),
                    "models.r.reasoning",
                ),
                (
                    "[models.o]\nbackend = \"ollama\"",
                    "models.o.upstream_model",
                ),
                (&format!("{router}[pool]\nslots = 2"), "pool"),
                (&pool("slots = 0"), "pool.slots"),
                (
                    &format!("{router}{ollama}[pool]\nmodel = \"o\""),
                    "pool.model",
                ),
                (&format!("{router}[pool]\nmodel = \"nope\""), "pool.model"),
                (&pool("listen_host = \"any\""), "pool.listen_host"),
                (&pool("advertise_host = \"h:80\""), "pool.advertise_host"),
                (&pool("advertise_host = \"h/x\""), "pool.advertise_host"),
                (&pool("advertise_host = \"\""), "pool.advertise_host"),
                (&pool("port_base = 65530"), "pool.port_base"),
                (&pool("port_base = 0"), "pool.port_base"),
                (&pool("node_id = \"a b\""), "pool.node_id"),
                (&pool("health_interval_s = 0"), "pool.health_interval_s"),
                (&pool("slotz = 1"), "pool.slotz"),
                (
                    "[launcher]\nblackbox_bin = \"bin/bbs\"",
                    "launcher.blackbox_bin",
                ),
                (
                    "[launcher]\nclients_dir = \"/opt/../x\"",
                    "launcher.clients_dir",
                ),
            ],
        );
    }

    #[test]
    fn empty_file_gets_documented_defaults() {
        let c = parse("").unwrap();
        assert_eq!(c.service_user, "agentbox");
        assert_eq!(c.launcher.venv_root.as_str(), "/opt/agentbox/venvs");
        assert!(c.launcher.repo_roots.is_empty());
        assert!(c.models.is_empty());
        assert_eq!(c.gateway.ollama_url.as_str(), "http://127.0.0.1:11434/");
    }

    #[test]
    fn unknown_keys_are_named_by_full_path() {
        assert_err_keys(
            "",
            &[
                ("bogus = 1", "bogus"),
                ("[launcher]\nrepo_rootz = []", "launcher.repo_rootz"),
                ("[launcher.limits]\npidz = 3", "launcher.limits.pidz"),
                ("[gateway]\nmax_body = 3", "gateway.max_body"),
                ("[bridge]\nport = 3", "bridge.port"),
                (
                    "[models.m]\nbackend = \"ollama\"\nupstream_model = \"x\"\nprice = 1.0",
                    "models.m.price",
                ),
            ],
        );
        let e = parse("\n\n[launcher.limits]\npidz = 3").unwrap_err();
        assert!(e.to_string().contains("launcher.limits.pidz"), "{e}");
        assert!(e.to_string().contains("line 4"), "{e}");
    }

    #[test]
    fn wrong_types_and_bad_toml_are_errors() {
        assert_err_keys(
            "",
            &[
                ("agent_uid = \"x\"", "agent_uid"),
                ("[launcher.limits]\npids = -1", "launcher.limits.pids"),
                (
                    "[models.m]\nbackend = \"docker\"\nupstream_model = \"x\"",
                    "models.m.backend",
                ),
                (
                    "[models.m]\nbackend = \"ollama\"\nupstream_model = \"x\"\nallow_url_sources = \"yes\"",
                    "models.m.allow_url_sources",
                ),
            ],
        );
        assert!(matches!(
            parse("data_dir = "),
            Err(ConfigError::Parse { .. })
        ));
    }

    #[test]
    fn backend_specific_keys_are_checked() {
        let m = |body: &str| format!("[models.m]\nupstream_model = \"u\"\n{body}");
        assert_err_keys(
            &m(""),
            &[
                ("backend = \"vllm\"\ncommand = [\"vllm\"]", "models.m.port"),
                ("backend = \"vllm\"\nport = 8001", "models.m.command"),
                (
                    "backend = \"vllm\"\nport = 8001\ncommand = []",
                    "models.m.command",
                ),
                (
                    "backend = \"vllm\"\nport = 0\ncommand = [\"v\"]",
                    "models.m.port",
                ),
                ("backend = \"ollama\"\nport = 1", "models.m.port"),
                (
                    "backend = \"ollama\"\nprovider = \"openai\"",
                    "models.m.provider",
                ),
                (
                    "backend = \"remote\"\nbase_url = \"https://x\"\nkey_env = \"K\"",
                    "models.m.provider",
                ),
                (
                    "backend = \"remote\"\nprovider = \"openai\"\nkey_env = \"K\"",
                    "models.m.base_url",
                ),
                (
                    "backend = \"remote\"\nprovider = \"openai\"\nbase_url = \"https://x\"",
                    "models.m.key_env",
                ),
                (
                    "backend = \"remote\"\nprovider = \"openai\"\nbase_url = \"ftp://x\"\nkey_env = \"K\"",
                    "models.m.base_url",
                ),
                (
                    "backend = \"remote\"\nprovider = \"openai\"\nbase_url = \"https://u:p@x\"\nkey_env = \"K\"",
                    "models.m.base_url",
                ),
                (
                    "backend = \"remote\"\nprovider = \"openai\"\nbase_url = \"https://x\"\nkey_env = \"K-1\"",
                    "models.m.key_env",
                ),
                (
                    "backend = \"remote\"\nprovider = \"grok\"\nbase_url = \"https://x\"\nkey_env = \"K\"",
                    "models.m.provider",
                ),
                (
                    "backend = \"ollama\"\ncontext_tokens = 10\nmax_output_tokens = 20",
                    "models.m.max_output_tokens",
                ),
            ],
        );
        assert_eq!(
            err_key("[models.m]\nbackend = \"ollama\"\nupstream_model = \" \""),
            "models.m.upstream_model"
        );
    }

    #[test]
    fn prices_come_in_pairs_and_are_finite() {
        let m = |body: &str| {
            format!("[models.m]\nbackend = \"ollama\"\nupstream_model = \"u\"\n{body}")
        };
        assert_err_keys(
            &m(""),
            &[
                (
                    "price_input_per_mtok = 1.0",
                    "models.m.price_output_per_mtok",
                ),
                (
                    "price_output_per_mtok = 1.0",
                    "models.m.price_input_per_mtok",
                ),
                (
                    "price_input_per_mtok = -1.0\nprice_output_per_mtok = 1.0",
                    "models.m.price_input_per_mtok",
                ),
                (
                    "price_input_per_mtok = nan\nprice_output_per_mtok = 1.0",
                    "models.m.price_input_per_mtok",
                ),
                (
                    "price_cache_read_per_mtok = 1.0",
                    "models.m.price_input_per_mtok",
                ),
            ],
        );
        let c = parse(&m("price_input_per_mtok = 3.0\nprice_output_per_mtok = 15.0\nprice_cache_read_per_mtok = 0.3")).unwrap();
        let p = c.model("m").unwrap().prices.unwrap();
        assert_eq!(p.cache_read_per_mtok, 0.3);
        assert_eq!(p.cache_write_per_mtok, 3.75);
        let usd = p.cost_usd(1_000_000, 1_000_000, 1_000_000, 1_000_000);
        assert!((usd - (3.0 + 15.0 + 0.3 + 3.75)).abs() < 1e-9, "{usd}");
    }

    #[test]
    fn model_ids_are_path_safe() {
        for good in ["gpt-5", "qwen-coder", "claude-sonnet-4.5", "A_b", "x"] {
            assert!(ModelId::parse(good).is_ok(), "{good}");
        }
        for bad in [
            "",
            ".",
            "..",
            "-x",
            ".hidden",
            "a/b",
            "a b",
            "a\n",
            "é",
            &"a".repeat(65),
        ] {
            assert!(ModelId::parse(bad).is_err(), "{bad:?}");
        }
        assert_eq!(
            err_key("[models.\"a/b\"]\nbackend = \"ollama\"\nupstream_model = \"u\""),
            "models.a/b"
        );
    }

    #[test]
    fn duplicate_vllm_ports_are_refused() {
        let t = "[models.a]\nbackend = \"vllm\"\nupstream_model = \"u\"\nport = 9000\ncommand = [\"v\"]\n\
                 [models.b]\nbackend = \"vllm\"\nupstream_model = \"u\"\nport = 9000\ncommand = [\"v\"]";
        assert_eq!(err_key(t), "models.b.port");
    }

    #[test]
    fn paths_and_identities_are_validated() {
        assert_err_keys(
            "",
            &[
                ("data_dir = \"relative\"", "data_dir"),
                ("data_dir = \"/var/lib/../etc\"", "data_dir"),
                ("data_dir = \"/var/lib/agentbox/\"", "data_dir"),
                (
                    "[launcher]\nrepo_roots = [\"/srv/repos\", \"/srv//x\"]",
                    "launcher.repo_roots[1]",
                ),
                (
                    "[launcher]\nrepo_roots = [\"/srv/repos\", \"/srv/repos/a\"]",
                    "launcher.repo_roots",
                ),
                ("[launcher]\nvenv_root = \"venvs\"", "launcher.venv_root"),
                ("agent_uid = 0", "agent_uid"),
                ("agent_gid = 65534", "agent_gid"),
                ("agent_uid_count = 0", "agent_uid_count"),
                (
                    "agent_uid = 65000\nagent_uid_count = 600",
                    "agent_uid_count",
                ),
                (
                    "agent_gid = 4294967000\nagent_uid_count = 1000",
                    "agent_uid_count",
                ),
                ("service_user = \"Root Admin\"", "service_user"),
                ("[launcher.limits]\npids = 0", "launcher.limits.pids"),
                ("[launcher.limits]\ndisk_mb = 0", "launcher.limits.disk_mb"),
                ("[gateway]\nmax_body_mb = 0", "gateway.max_body_mb"),
                (
                    "[gateway]\nmax_inflight_body_mb_per_task = 16",
                    "gateway.max_inflight_body_mb_per_task",
                ),
                (
                    "[gateway]\nmax_inflight_body_mb_per_task = 128\nbody_memory_mb = 64",
                    "gateway.body_memory_mb",
                ),
                (
                    "[gateway]\nmax_connections_per_task = 0",
                    "gateway.max_connections_per_task",
                ),
                (
                    "[gateway]\nollama_url = \"localhost:11434\"",
                    "gateway.ollama_url",
                ),
                ("[bridge]\nlisten = \"localhost\"", "bridge.listen"),
                (
                    "[gateway]\nbridge_url = \"http://localhost:8790\"",
                    "gateway.bridge_url",
                ),
                (
                    "[gateway]\nbridge_url = \"http://localhost.:8790\"",
                    "gateway.bridge_url",
                ),
                ("[bridge]\ntoken_env = \"\"", "bridge.token_env"),
                ("[bridge]\nbody_timeout_s = 0", "bridge.body_timeout_s"),
                ("[bridge]\nthreads = 0", "bridge.threads"),
                ("[bridge]\nthreads = 257", "bridge.threads"),
                ("[gateway]\nthreads = 0", "gateway.threads"),
                ("[gateway]\nthreads = 257", "gateway.threads"),
            ],
        );
    }

    #[test]
    fn env_allowlist_refuses_injection_keys() {
        for key in ["LD_PRELOAD", "NODE_OPTIONS", "BASH_ENV", "GIT_DIR"] {
            let t = format!("[launcher]\nenv_allowlist = [\"{key}\"]");
            assert_eq!(err_key(&t), "launcher.env_allowlist", "{key}");
        }
        assert_eq!(
            err_key("[launcher]\nenv_allowlist = [\"A\", \"A\"]"),
            "launcher.env_allowlist"
        );
    }

    #[test]
    fn data_dir_override_and_defaults() {
        let mut env = root_env();
        env.vars.insert("AGENTBOX_DATA".into(), "/tmp/abx".into());
        let c = Config::from_toml_str("data_dir = \"/srv/data\"", "t", &env).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/tmp/abx"));
        env.vars.insert("AGENTBOX_DATA".into(), "tmp/abx".into());
        let e = Config::from_toml_str("", "t", &env).unwrap_err();
        assert_eq!(e.key(), Some("AGENTBOX_DATA (environment)"));

        let user = FixedEnv {
            vars: [("HOME".to_owned(), "/home/u".to_owned())].into(),
            euid: 1000,
        };
        let c = Config::from_toml_str("", "t", &user).unwrap();
        assert_eq!(c.data_dir, PathBuf::from("/home/u/.local/share/agentbox"));
        let xdg = FixedEnv {
            vars: [("XDG_DATA_HOME".to_owned(), "/x".to_owned())].into(),
            euid: 1000,
        };
        assert_eq!(
            Config::from_toml_str("", "t", &xdg).unwrap().data_dir,
            PathBuf::from("/x/agentbox")
        );
    }

    #[test]
    fn config_path_precedence() {
        let mut env = root_env();
        assert_eq!(config_path(None, &env), PathBuf::from(DEFAULT_CONFIG_PATH));
        env.vars.insert("AGENTBOX_CONFIG".into(), "/e.toml".into());
        assert_eq!(config_path(None, &env), PathBuf::from("/e.toml"));
        assert_eq!(
            config_path(Some(Path::new("/c.toml")), &env),
            PathBuf::from("/c.toml")
        );
    }

    #[test]
    fn load_reports_missing_file() {
        let e = Config::load(Path::new("/nonexistent/agentbox.toml"), &root_env()).unwrap_err();
        assert!(matches!(e, ConfigError::Read { .. }));
        assert!(e.to_string().contains("/nonexistent/agentbox.toml"));
    }
}
