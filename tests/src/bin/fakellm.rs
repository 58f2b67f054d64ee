//! `fakellm` command line: parses arguments and runs the server from
//! [`agentbox_tests::fakellm`], whose module docs describe the script and the wire behaviour.

#![forbid(unsafe_code)]

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use agentbox_tests::fakellm::{Listen, Script, Server};
use clap::Parser;

/// A scripted fake model server (Anthropic Messages and OpenAI Chat Completions).
#[derive(Debug, Parser)]
#[command(name = "fakellm")]
struct Args {
    /// The JSON script deciding each reply.
    #[arg(long)]
    script: PathBuf,
    /// JSONL file every request is appended to.
    #[arg(long)]
    log: PathBuf,
    #[command(flatten)]
    listen: ListenArgs,
}

#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
struct ListenArgs {
    /// TCP address to listen on; port 0 picks one.
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Unix socket path to listen on.
    #[arg(long)]
    unix: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let listen = match (args.listen.listen, args.listen.unix) {
        (Some(addr), _) => Listen::Tcp(addr),
        (None, Some(path)) => Listen::Unix(path),
        (None, None) => {
            eprintln!("fakellm: give --listen or --unix");
            return ExitCode::from(2);
        }
    };
    let script = match Script::load(&args.script) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fakellm: {e}");
            return ExitCode::from(2);
        }
    };
    let server = match Server::bind(script, &args.log, &listen).await {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fakellm: {e}");
            return ExitCode::from(2);
        }
    };
    let mut out = std::io::stdout().lock();
    // Tests block on this line to learn the port; it must not sit in a buffer.
    if writeln!(out, "listening on {}", server.address())
        .and_then(|()| out.flush())
        .is_err()
    {
        eprintln!("fakellm: cannot write the address to stdout");
    }
    drop(out);
    match server.serve().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fakellm: {e}");
            ExitCode::FAILURE
        }
    }
}
