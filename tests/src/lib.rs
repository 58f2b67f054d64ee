//! Test support for agentbox: the scripted fake model server [`fakellm`] (the `agentbox-fakellm`
//! crate, re-exported here; also built as the
//! `fakellm` binary) and [`harness`] helpers the integration tests under `tests/tests/` share
//! (starting processes that die with the test, finding the real agent CLIs, HTTP over unix
//! sockets), and [`workload`], the realistic requests tests and benchmarks send.

#![forbid(unsafe_code)]

pub use agentbox_fakellm as fakellm;
pub mod harness;
pub mod workload;
