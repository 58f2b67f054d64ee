//! The privileged launcher (`agentbox-launcher`): validates requests on `run/launcher.sock`,
//! starts agent and check sandboxes with bubblewrap, runs the git helpers and supervises local
//! vLLM backends.
//!
//! # Layout
//! - [`daemon`]: command line, startup (config, identities, data dir, socket), shutdown.
//! - [`routes`]: the HTTP API and caller authorization (`SO_PEERCRED`).
//! - [`error`]: every failure and its one mapping to a status and `{"error": {code, message}}`.
//! - [`api`]: request and response shapes.
//! - [`validate`]: request fields against policy and config.
//! - [`launcher`]: runs (start, supervise, wait, delete), git helper entry points, restart.
//! - [`task`]: the run state machine and registry.
//! - [`backend`]: vLLM backends: their state machine, the supervised server process, health.
//! - [`layout`]: the data directory and per-task paths.
//! - [`git`]: snapshot, collect, deliver, delete-branch.
//! - [`state`]: what survives a restart.
//! - [`status`]: host readiness.
//!
//! The sandbox itself (fd walks, staged mounts, bwrap, seccomp, cgroups, child processes) is
//! the `agentbox-sandbox` engine crate, which holds every `unsafe` block; this crate has none.

#![forbid(unsafe_code)]

pub mod api;
pub mod backend;
pub mod daemon;
pub mod error;
pub mod git;
pub mod launcher;
pub mod layout;
pub mod routes;
pub mod state;
pub mod status;
pub mod task;
pub mod uids;
pub mod validate;

pub use launcher::Launcher;
pub use routes::router;
