//! `agentbox-pool`: one host's warm blackbox-server slots, leased to rollout managers over
//! `run/pool.sock` (the routes of `agentbox_api::pool`). A slot generation is a gateway task
//! plus a launcher slot sandbox ([`backend`]); a lease exposes it on a TCP port by forwarding
//! to its unix socket ([`forward`]); a release resets it to a fresh generation. The slot life
//! is [`slot`]'s state machine, the lease logic [`pool`], the HTTP surface [`routes`].

#![forbid(unsafe_code)]

pub mod backend;
pub mod error;
pub mod forward;
pub mod pool;
pub mod routes;
pub mod slot;
pub mod slot_socket;
#[cfg(test)]
mod testing;

use std::time::Duration;

use agentbox_policy::config::{Config, PoolConfig};

pub use crate::pool::{Pool, PoolOptions};

impl PoolOptions {
    /// From `[pool]`: `node_id` defaults to the host name, `node_ip` is the advertise host;
    /// `pool.sock` admits root, this process's uid and `service_user`'s.
    pub fn from_config(config: &Config, pool: &PoolConfig) -> PoolOptions {
        let hostname = nix::unistd::gethostname()
            .ok()
            .and_then(|h| h.into_string().ok())
            .unwrap_or_else(|| "localhost".to_owned());
        let mut control_uids = vec![nix::unistd::geteuid().as_raw()];
        if let Ok(Some(user)) = nix::unistd::User::from_name(&config.service_user) {
            control_uids.push(user.uid.as_raw());
        }
        PoolOptions {
            slots: pool.slots,
            node_id: pool.node_id.clone().unwrap_or_else(|| hostname.clone()),
            node_ip: pool.advertise_host.clone(),
            hostname,
            listen_host: pool.listen_host,
            advertise_host: pool.advertise_host.clone(),
            port_base: pool.port_base,
            health_interval: pool.health_interval,
            lease_ttl: pool.lease_ttl,
            retry_backoff: Duration::from_secs(1),
            control_uids,
        }
    }
}
