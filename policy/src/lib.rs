//! The rules every agentbox daemon enforces, as pure functions and small types with no network
//! and no daemon state, so they can be tested exhaustively and shared by launcher, gateway,
//! bridge and CLI.
//!
//! # Layout
//! - [`id`]: task ids (`tid`) and the `agent/<tid>` branch names of the git helpers.
//! - [`path`]: request paths: absolute, normalized, inside a configured root by components.
//! - [`resolve`]: opening a path under a trusted root without following any symlink, returning
//!   the handle and its identity for later re-checks.
//! - [`env`]: the environment allowlist for sandboxed processes.
//! - [`sanitize`]: the Anthropic Messages request sanitizer (model rewrite, server-side tools).
//! - [`secret`]: secrets that never print and compare in constant time.
//! - [`config`]: `agentbox.toml`, typed, with unknown keys refused.

#![forbid(unsafe_code)]

pub mod config;
pub mod env;
pub mod id;
mod newtype;
pub mod path;
pub mod resolve;
pub mod sanitize;
pub mod secret;
