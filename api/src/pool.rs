//! `agentbox-pool`'s API (`run/pool.sock`), exactly as it travels: one host's pool of warm
//! blackbox-server slots, leased to rollout managers. The payloads keep the field names of the
//! reference's node supervisor and lease records (Accio-Lab/Dressage,
//! `dressage/sandbox/local/bwrap/`), so the Ray layer (`integrations/ray/`) passes them on
//! unchanged and the paddock's sandbox provider reads them as it reads the reference's.
//!
//! | method | path | success |
//! |---|---|---|
//! | POST | `/acquire` [`AcquireRequest`] | 200 [`Lease`]; 503 `no_free_slot`, 409 `draining` |
//! | POST | `/release` [`LeaseRef`] | 200 [`ReleaseReply`] |
//! | POST | `/run_command` [`RunCommandRequest`] | 200 [`CommandReply`] |
//! | POST | `/read_file` [`ReadFileRequest`] | 200 [`FileReply`] |
//! | POST | `/write_file` [`WriteFileRequest`] | 200 [`WriteReply`] |
//! | POST | `/drain`, `/undrain` | 200 [`PoolStatus`] |
//! | GET | `/status` | 200 [`PoolStatus`] |
//!
//! Errors are the `{"error":{code,message}}` envelope of [`crate::error`]: an unknown or
//! inactive lease is 404 `lease_not_found`, a lease whose slot died is 410 `lease_lost`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// `POST /acquire`. A trajectory that holds an active lease gets the same lease back.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AcquireRequest {
    pub trajectory_id: String,
    /// Accepted and ignored, as in the reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_type: Option<String>,
    /// Accepted and ignored, as in the reference.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub env_args: Option<Value>,
}

/// A lease's life, in the reference's words.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum LeaseStatus {
    Active,
    Releasing,
    /// Its slot died while leased; commands on it fail, the trajectory acquires elsewhere.
    Lost,
}

/// A lease (`LeaseRecord.to_dict` of the reference).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Lease {
    /// `lease-<node_id[:12]>-<slot:04d>-gen<gen>-<trajectory_id[:32]>-<8 hex>`.
    pub lease_id: String,
    pub trajectory_id: String,
    pub node_id: String,
    pub node_ip: String,
    pub slot_id: u32,
    /// The TCP port on the pool's `advertise_host` forwarding to this slot's server.
    pub port: u16,
    /// `http://<advertise_host>:<port>`.
    pub sandbox_url: Option<String>,
    /// Seconds since the epoch.
    pub acquired_ts: f64,
    /// `acquired_ts + lease_ttl_s`, or `None` without a TTL.
    pub deadline_ts: Option<f64>,
    /// The slot's generation: +1 at every reset, so nothing of an earlier lease survives.
    pub generation: u64,
    pub status: LeaseStatus,
    /// `status == ACTIVE`.
    pub ready: bool,
}

/// `POST /release`, and the lease selector of the command and file routes: by trajectory
/// first, then by lease id (as the reference looks them up).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LeaseRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trajectory_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease_id: Option<String>,
    /// Why (`paddock_terminate`, `lease_ttl_expired`, ...); only on `/release`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// The answer of `/release`. `released` is always true; `already_released` for an unknown
/// lease; otherwise the slot is queued for its reset (`release_queued`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReleaseReply {
    pub released: bool,
    pub already_released: bool,
    #[serde(default)]
    pub release_queued: bool,
    #[serde(default)]
    pub already_releasing: bool,
    pub lease_id: Option<String>,
    pub trajectory_id: Option<String>,
    pub slot_id: Option<u32>,
    pub node_id: String,
    pub node_ip: String,
    /// Always false: a released slot is reset before anyone gets it again.
    pub slot_reusable: bool,
    pub generation: Option<u64>,
}

/// The command of `/run_command`: a shell string, or an argv joined with shell quoting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Command {
    Shell(String),
    Argv(Vec<String>),
}

/// `POST /run_command`: `/bin/sh -lc "cd <cwd> && <command>"` in the leased slot's sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RunCommandRequest {
    #[serde(flatten)]
    pub lease: LeaseRef,
    pub command: Command,
    /// Default `/workspace`; a relative one is under it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cwd: Option<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Seconds; `None`: the launcher's maximum.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stdin: Option<String>,
}

/// The answer of `/run_command` (the reference's keys).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommandReply {
    pub cmd: String,
    pub stdout: String,
    pub stderr: String,
    pub returncode: Option<i32>,
    pub timed_out: bool,
    pub lease_id: String,
    pub trajectory_id: String,
    pub slot_id: u32,
    pub node_id: String,
    pub node_ip: String,
}

/// `POST /read_file`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadFileRequest {
    #[serde(flatten)]
    pub lease: LeaseRef,
    pub path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
}

/// The answer of `/read_file`: the bytes as base64 (the Ray layer decodes them with the
/// caller's encoding, as the reference's `read_file(encoding=...)` does).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileReply {
    pub path: String,
    pub content_base64: String,
    pub size: u64,
    pub truncated: bool,
    pub lease_id: String,
    pub trajectory_id: String,
}

/// `POST /write_file`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteFileRequest {
    #[serde(flatten)]
    pub lease: LeaseRef,
    pub path: String,
    pub content_base64: String,
    #[serde(default)]
    pub append: bool,
}

/// The answer of `/write_file` (the reference's keys but `host_path`, which we never expose).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WriteReply {
    pub path: String,
    pub bytes: u64,
    pub append: bool,
    pub lease_id: String,
    pub trajectory_id: String,
}

/// A slot's life (the reference's supervisor states).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "SCREAMING_SNAKE_CASE")]
pub enum SlotState {
    Empty,
    Starting,
    Ready,
    Leased,
    Releasing,
    Restarting,
    Failed,
    Dead,
    Lost,
}

/// One slot in [`PoolStatus`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SlotView {
    pub slot_id: u32,
    pub status: SlotState,
    pub generation: u64,
    /// The TCP port it is exposed on while leased.
    pub port: Option<u16>,
    /// The launcher run (and gateway task) of this generation.
    pub tid: Option<String>,
    pub lease_id: Option<String>,
    pub trajectory_id: Option<String>,
    pub last_error: Option<String>,
}

/// `GET /status` (the reference's supervisor `health()` payload, plus `draining`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolStatus {
    pub node_id: String,
    pub node_ip: String,
    pub hostname: String,
    pub closed: bool,
    pub draining: bool,
    pub capacity: u32,
    pub ready: u32,
    pub leased: u32,
    pub releasing: u32,
    pub starting: u32,
    pub restarting: u32,
    pub failed: u32,
    pub dead: u32,
    pub lost: u32,
    pub empty: u32,
    pub last_error: Option<String>,
    pub slots: Vec<SlotView>,
}
