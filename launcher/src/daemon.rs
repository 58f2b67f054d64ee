//! The `agentbox-launcher` process: reads the config, resolves the service identity, prepares
//! the data directory and cgroups, recovers from a previous run, binds
//! `$AGENTBOX_DATA/run/launcher.sock` (mode 0660, root:service-group), prints
//! `listening on unix:<path>` once bound, and serves until SIGTERM or SIGINT; then it stops
//! every sandbox (handing workspaces back) and every vLLM backend before exiting.
//!
//! The launcher runs in a mount namespace of its own (a recursive slave of the host's), where
//! it stages the directories it hands to bwrap ([`agentbox_sandbox::stage`]).
//!
//! Exit codes: 0 after a clean shutdown, 78 (`EX_CONFIG`) for a bad config or an unknown
//! service user, 77 (`EX_NOPERM`) when not root, 1 for other startup failures.

use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use agentbox_http::privs::{self, Capability};
use agentbox_policy::config::{Config, ProcessEnv, config_path};
use agentbox_sandbox::cgroup::{Cgroups, RealSignaller};
use agentbox_sandbox::proc;
use agentbox_sandbox::walk::Owner;
use clap::Parser;

use crate::launcher::{Launcher, Settings};
use crate::layout::DataDir;

/// Command line.
#[derive(Debug, Parser)]
#[command(
    name = "agentbox-launcher",
    version,
    about = "The privileged agentbox launcher"
)]
pub struct Args {
    /// The config file (default: $AGENTBOX_CONFIG, then /etc/agentbox/agentbox.toml).
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Use this uid as the service identity instead of looking up `service_user` in the
    /// passwd database (for tests, and hosts where the service user has no passwd entry).
    /// Its gid is the primary gid of that uid's passwd entry, or the uid itself if none.
    #[arg(long)]
    pub service_uid: Option<u32>,
    /// The directory name of this launcher's cgroups below each hierarchy. Everything below it
    /// is treated as ours (orphans are killed at startup), so two launchers on one host need
    /// different names.
    #[arg(long, default_value = "agentbox")]
    pub cgroup_parent: String,
    /// Where the cgroup hierarchies are mounted.
    #[arg(long, default_value = "/sys/fs/cgroup")]
    pub cgroup_root: PathBuf,
    /// How long a vLLM backend may take to answer `GET /health` with 200 after it was started
    /// (loading a large model takes minutes); it is killed and reported failed after that.
    #[arg(long, default_value_t = crate::backend::DEFAULT_START_TIMEOUT.as_secs(), value_parser = clap::value_parser!(u64).range(1..))]
    pub backend_start_timeout_s: u64,
}

/// The capabilities the launcher keeps of root's full set (everything else leaves even the
/// bounding set, so no program it runs as root regains it). The packaged unit's
/// `CapabilityBoundingSet=` lists the same; `tests/tests/privileges.rs` checks the running
/// launcher holds exactly these, and every launcher test proves they are enough.
/// - `CAP_CHOWN`, `CAP_FOWNER`: hand workspaces over to the agent uid and back, strip
///   setuid bits, fix the data dir's owners and modes.
/// - `CAP_DAC_OVERRIDE`, `CAP_DAC_READ_SEARCH`: read and write inside the service user's and
///   the agents' directories (workspaces, shadow repositories) as root.
/// - `CAP_SETUID`, `CAP_SETGID`: start sandboxes as the agent uid, vLLM as the service user,
///   git as the repository owner (with their groups).
/// - `CAP_SYS_ADMIN`: its own mount namespace and the staged bind mounts handed to bwrap.
/// - `CAP_KILL`: signal and kill sandboxes and backends running as other uids.
/// - `CAP_SYS_PTRACE`: list what a run's processes hold open (`/proc/<pid>/fd`), so a file
///   unlinked while open still counts against the run's disk limit
///   (`agentbox_sandbox::disk::held_unlinked`).
pub const KEPT_CAPABILITIES: &[Capability] = &[
    Capability::CAP_CHOWN,
    Capability::CAP_FOWNER,
    Capability::CAP_DAC_OVERRIDE,
    Capability::CAP_DAC_READ_SEARCH,
    Capability::CAP_SETUID,
    Capability::CAP_SETGID,
    Capability::CAP_SYS_ADMIN,
    Capability::CAP_KILL,
    Capability::CAP_SYS_PTRACE,
];

const EX_CONFIG: u8 = 78;
const EX_NOPERM: u8 = 77;

/// Runs the launcher to completion.
pub fn main(args: Args) -> ExitCode {
    agentbox_http::init_logging();
    let env = ProcessEnv;
    let config = match Config::load(&config_path(args.config.as_deref(), &env), &env) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("agentbox-launcher: {e}");
            return ExitCode::from(EX_CONFIG);
        }
    };
    let service = match service_identity(&config, args.service_uid) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("agentbox-launcher: {e}");
            return ExitCode::from(EX_CONFIG);
        }
    };
    if !rustix::process::geteuid().is_root() {
        eprintln!("agentbox-launcher: must run as root");
        return ExitCode::from(EX_NOPERM);
    }
    // Before any thread starts: capability sets are per thread, inherited by later threads.
    if let Err(e) = privs::restrict_to(KEPT_CAPABILITIES) {
        eprintln!("agentbox-launcher: cannot drop capabilities: {e}");
        return ExitCode::from(EX_NOPERM);
    }
    // Before the runtime starts any thread: unshare applies to the calling thread only.
    if let Err(e) = proc::isolate_mounts() {
        eprintln!("agentbox-launcher: cannot create its mount namespace: {e}");
        return ExitCode::FAILURE;
    }
    proc::ensure_stdio();
    raise_nofile();
    let data = match DataDir::prepare(&config.data_dir, service) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("agentbox-launcher: data directory: {e}");
            return ExitCode::FAILURE;
        }
    };
    let cgroups = Cgroups::detect(
        &args.cgroup_root,
        &args.cgroup_parent,
        std::sync::Arc::new(RealSignaller),
    )
    .and_then(|c| c.prepare().map(|()| c))
    .map_err(|e| e.to_string());
    if let Err(e) = &cgroups {
        tracing::error!(error = %e, "cgroups unavailable; sandboxes will be refused");
    }
    let runtime = match agentbox_http::runtime("agentbox-launcher") {
        Ok(r) => r,
        Err(code) => return code,
    };
    let socket = data.socket_path();
    let settings = Settings {
        config,
        service,
        data,
        cgroups,
        bwrap: PathBuf::from(agentbox_sandbox::bwrap::BWRAP),
        backend_start_timeout: std::time::Duration::from_secs(args.backend_start_timeout_s),
    };
    runtime.block_on(async move {
        let launcher = match Launcher::new(settings) {
            Ok(l) => l,
            Err(e) => {
                eprintln!("agentbox-launcher: {e}");
                return ExitCode::FAILURE;
            }
        };
        launcher.recover().await;
        let listener = match bind(&socket, service.gid) {
            Ok(l) => l,
            Err(e) => {
                eprintln!(
                    "agentbox-launcher: cannot listen on {}: {e}",
                    socket.display()
                );
                return ExitCode::FAILURE;
            }
        };
        // A closed stdout only loses the announcement; the socket serves all the same.
        let _ = agentbox_http::announce_listening(format_args!("unix:{}", socket.display()));
        let shutdown = launcher.shutdown_token();
        // Waiting for the signal alongside the server (not in a spawned task) leaves nothing
        // running once serving ends.
        let serve = agentbox_http::serve_unix(
            listener,
            crate::routes::router(std::sync::Arc::clone(&launcher)),
            shutdown.clone(),
        );
        tokio::pin!(serve);
        tokio::select! {
            () = &mut serve => {}
            () = agentbox_http::shutdown_signal() => {
                shutdown.cancel();
                serve.await;
            }
        }
        launcher.shut_down().await;
        let _ = std::fs::remove_file(&socket);
        tracing::info!("stopped");
        ExitCode::SUCCESS
    })
}

fn service_identity(config: &Config, flag: Option<u32>) -> Result<Owner, String> {
    use nix::unistd::{Uid, User};
    let owner = match flag {
        Some(uid) => {
            let gid = User::from_uid(Uid::from_raw(uid))
                .ok()
                .flatten()
                .map_or(uid, |u| u.gid.as_raw());
            Owner { uid, gid }
        }
        None => match User::from_name(&config.service_user) {
            Ok(Some(u)) => Owner {
                uid: u.uid.as_raw(),
                gid: u.gid.as_raw(),
            },
            Ok(None) => {
                return Err(format!(
                    "service_user {:?} does not exist (create it, or pass --service-uid)",
                    config.service_user
                ));
            }
            Err(e) => {
                return Err(format!(
                    "cannot look up service_user {:?}: {e}",
                    config.service_user
                ));
            }
        },
    };
    if owner.uid == 0 {
        return Err("the service identity must not be root".to_owned());
    }
    if owner.uid == config.agent_uid || owner.gid == config.agent_gid {
        return Err("the service identity must differ from agent_uid/agent_gid".to_owned());
    }
    Ok(owner)
}

/// The workspace walks keep one descriptor per directory level open.
fn raise_nofile() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let raised = rustix::process::Rlimit {
        current: limit.maximum,
        maximum: limit.maximum,
    };
    if let Err(e) = setrlimit(Resource::Nofile, raised) {
        tracing::warn!(error = %e, "cannot raise RLIMIT_NOFILE");
    }
}

fn bind(path: &Path, group: u32) -> std::io::Result<tokio::net::UnixListener> {
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(std::io::Error::other("exists and is not a socket"));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::os::unix::fs::chown(path, Some(0), Some(group))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))?;
    Ok(listener)
}
