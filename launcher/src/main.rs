//! `agentbox-launcher`: see [`agentbox_launcher::daemon`].

#![forbid(unsafe_code)]

use clap::Parser;

fn main() -> std::process::ExitCode {
    agentbox_launcher::daemon::main(agentbox_launcher::daemon::Args::parse())
}
