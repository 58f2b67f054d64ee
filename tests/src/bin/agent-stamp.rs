//! `agent-stamp`: the stand-in agent of the launcher benchmark (`bench launcher`). Its first
//! act is to write `CLOCK_MONOTONIC` in nanoseconds to `/workspace/started`; the benchmark
//! reads the same clock just before it asks for the sandbox, so the difference is the time from
//! the request to the agent's first instruction. It ignores its arguments (the launcher passes
//! `claude`'s).

#![forbid(unsafe_code)]

use std::process::ExitCode;

fn main() -> ExitCode {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    let ns = i128::from(now.tv_sec) * 1_000_000_000 + i128::from(now.tv_nsec);
    match std::fs::write("/workspace/started", format!("{ns}\n")) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agent-stamp: /workspace/started: {e}");
            ExitCode::FAILURE
        }
    }
}
