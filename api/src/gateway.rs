//! The gateway's control API (`run/gateway.sock`), exactly as it travels.
//!
//! | method | path | success |
//! |---|---|---|
//! | POST | `/tasks` [`OpenTask`] | 201 [`TaskView`] |
//! | GET | `/tasks/{tid}` | 200 [`TaskView`] |
//! | DELETE | `/tasks/{tid}` | 200 [`TaskView`] (closed; the account is kept) |
//! | GET | `/status` | 200 [`GatewayStatus`] |

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// `POST /tasks`: opens `sockets/<tid>/llm.sock`, or re-opens a closed task keeping its spend.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OpenTask {
    /// The task id.
    pub tid: String,
    /// An agentbox model id from the catalogue.
    pub model: String,
    /// The task token the agent will present.
    pub token: String,
    /// Token and/or cost budget; omitted parts are unlimited.
    #[serde(default)]
    pub budget: Budget,
}

/// A task's budget; `None` parts are unlimited. The gateway also persists it in this shape.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    /// Tokens: input + output + cache creation + cache read.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// US dollars, from the catalogue's prices.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usd: Option<f64>,
}

/// Whether a task's socket is being served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TaskState {
    /// `sockets/<tid>/llm.sock` is served.
    Open,
    /// Closed by `DELETE`; usage kept, so re-opening continues the same account.
    Closed,
}

/// What a task has consumed.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct TaskUsage {
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub cache_read_input_tokens: u64,
    pub cache_creation_input_tokens: u64,
    /// The four above, in the budget's unit.
    pub total_tokens: u64,
    /// Requests sent upstream.
    pub requests: u64,
    /// Cost in USD, when the model has prices.
    pub cost_usd: f64,
}

/// What is left of the budget; `None` (JSON `null`) for an unlimited dimension.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Remaining {
    pub tokens: Option<u64>,
    pub usd: Option<f64>,
}

/// The worst case of the requests in flight, held until they settle.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Reserved {
    pub tokens: u64,
    pub usd: f64,
}

/// A task as the control socket reports it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskView {
    pub tid: String,
    pub model: String,
    pub state: TaskState,
    /// The task socket, while open.
    pub socket: Option<PathBuf>,
    pub usage: TaskUsage,
    pub budget: Budget,
    pub remaining: Remaining,
    pub reserved: Reserved,
    pub in_flight: u32,
}

/// `GET /status`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GatewayStatus {
    pub ok: bool,
    pub open_tasks: usize,
    /// Every known task, open or closed, by tid.
    pub tasks: Vec<TaskView>,
    /// Whether a bridge token is configured (remote models need it).
    pub bridge_token: bool,
    /// The catalogue's model ids.
    pub models: Vec<String>,
    /// The capabilities the gateway holds (none); `None` if they could not be read.
    #[serde(default)]
    pub capabilities: Option<crate::caps::Capabilities>,
    /// Open task sockets per event loop (`gateway.threads` of them): a task is placed on the
    /// least loaded loop when it opens and stays there. Empty from a gateway that predates it.
    #[serde(default)]
    pub event_loops: Vec<usize>,
}
