//! `agentbox`: the operator's command line. Everything lives in the library; this only hands
//! over the process arguments and environment.

#![forbid(unsafe_code)]

fn main() -> std::process::ExitCode {
    agentbox_cli::run(std::env::args_os(), &agentbox_policy::config::ProcessEnv)
}
