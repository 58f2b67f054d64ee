//! `blackbox-server`: drives one agent CLI inside a sandbox for an RL rollout manager, with an
//! in-process LLM proxy that tags every model call with session and turn headers.
//!
//! Empty until its issue lands it.

#![forbid(unsafe_code)]

pub mod proxy;
