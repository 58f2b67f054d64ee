//! The per-task gateway (`agentbox-gateway`): every byte an agent sends to a model passes
//! here. One unix socket per task (`sockets/<tid>/llm.sock`, `/run/gw/llm.sock` inside the
//! sandbox) authenticates the task token, rewrites the model, strips server-side tools,
//! forwards to Ollama, vLLM or the llm-bridge, meters usage as it flows, and refuses with 403
//! once the budget is spent. A control socket (`run/gateway.sock`) opens and closes tasks.
//!
//! # Layout
//! - [`ledger`]: budgets, usage, reservations, persisted records (pure).
//! - [`estimate`]: local input-token estimates (`count_tokens`, reservations).
//! - [`sockets`]: creating `sockets/<tid>/llm.sock` without following symlinks.
//! - [`store`]: the state file, written atomically.
//! - [`gateway`]: the shared state and the task lifecycle (open, restore, close).
//! - [`control`]: the control socket's routes.
//! - [`shards`]: the event loops the task sockets run on, each task pinned to one.
//! - [`proxy`]: the per-task socket's routes, forwarding and metering.
//! - [`chat`]: `POST /v1/chat/completions` for rollout router models.
//! - [`error`]: both error types and their one mapping each to status and body.

#![forbid(unsafe_code)]

pub mod account;
pub mod chat;
pub mod control;
pub mod error;
pub mod estimate;
pub mod gateway;
pub mod ledger;
pub mod proxy;
pub mod shards;
pub mod sockets;
pub mod store;

pub use gateway::{Gateway, GatewayOptions};
