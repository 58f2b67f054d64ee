//! `seccomp-exec PROGRAM [ARGS...]`: executes PROGRAM under the sandbox's seccomp filters
//! (exactly the programs bwrap loads for a sandbox), nothing else changed. The tests use it to
//! prove the real agent CLIs complete their tasks under the allowlist
//! (`tests/tests/seccomp_clients.rs`).

#![forbid(unsafe_code)]

use std::os::unix::process::CommandExt;
use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    let Some(program) = args.next() else {
        eprintln!("usage: seccomp-exec PROGRAM [ARGS...]");
        return ExitCode::from(2);
    };
    if let Err(e) = agentbox_sandbox::seccomp::apply_to_current_thread() {
        eprintln!("seccomp-exec: {e}");
        return ExitCode::from(126);
    }
    let err = std::process::Command::new(&program).args(args).exec();
    eprintln!(
        "seccomp-exec: cannot run {}: {err}",
        program.to_string_lossy()
    );
    ExitCode::from(127)
}
