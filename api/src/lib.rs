//! The control API of agentbox as types, and the one client that speaks it.
//!
//! A ground crate: the launcher and the gateway serve these types, and the tests, the bench
//! and the operator CLI call them through [`client`], so nothing that only needs to *talk* to a
//! daemon links a daemon (the CLI never links the privileged crates). The JSON is a contract
//! (`../shared/design/agentbox.md` §4): fields are added, never renamed, and requests refuse
//! unknown fields so a misspelt key is an error, not a silent default.
//!
//! - [`launcher`] serves `run/launcher.sock`.
//! - [`gateway`] serves `run/gateway.sock`.
//! - [`pool`] is `agentbox-pool`'s `run/pool.sock` (leases of rollout slots).
//! - [`caps`] is how both daemons report the Linux capabilities they hold.
//! - [`error`] holds the `{"error":{"code","message"}}` envelope both daemons answer failures with.
//! - [`client`] speaks HTTP/1.1 over a unix socket (hyper + hyperlocal), typed per route, with raw
//!   access for tests that send malformed input on purpose.
#![forbid(unsafe_code)]

pub mod caps;
pub mod client;
pub mod error;
pub mod gateway;
pub mod launcher;
pub mod pool;

pub use client::{
    ClientError, GatewayClient, LauncherClient, PoolClient, RawResponse, UnixClient, error_chain,
};
pub use error::{ApiError, ErrorEnvelope};
