//! Helpers shared by the integration tests: processes that are killed with their whole process
//! group when the test ends, the `fakellm` process wrapper, locating the real agent CLIs, and
//! HTTP/SSE helpers (including plain HTTP/1.1 over a unix socket, which reqwest cannot do).

/// The process wrappers are their [`Service`] plus addresses and files: `pid`, `stderr`,
/// `describe`, `is_running`, `stop` and `kill` are the service's.
macro_rules! deref_to_service {
    ($($wrapper:ty),+) => {$(
        impl std::ops::Deref for $wrapper {
            type Target = Service;
            fn deref(&self) -> &Service {
                &self.service
            }
        }
        impl std::ops::DerefMut for $wrapper {
            fn deref_mut(&mut self) -> &mut Service {
                &mut self.service
            }
        }
    )+};
}

mod blackbox;
mod clients;
mod daemons;
mod fake;
mod http;
pub mod launcher;
pub mod pool;
mod process;
mod proxy;

pub use blackbox::{
    BlackboxProcess, Reply, assert_rollout_headers, claude_code_registration, codex_options,
    last_text, opencode_options, opencode_registration, processes_with, registration, scratch,
    settled, user, user_turn,
};
pub use clients::{
    claude_headless, claude_print_cmd, client_bin, clients_dir, readable_client,
    stream_json_result, workspace_root,
};
pub use daemons::{BridgeProcess, GatewayProcess, LauncherProcess, cargo, workspace_bin};
pub use fake::{FakeLlm, two_turn_write_script};
pub use http::{
    SseFrame, UnixResponse, anthropic_text, get_json, parse_sse, strs, unix_json, unix_request,
};
pub use process::{
    Captured, Service, is_alive, live_group_members, open_fds, run_captured, status_kib,
    wait_group_gone,
};
pub use proxy::BlackboxProxy;

use std::path::PathBuf;
use std::time::Duration;

/// What a harness helper can fail with; messages carry what a failing test needs to diagnose.
#[derive(Debug, thiserror::Error)]
pub enum HarnessError {
    /// A process could not be started.
    #[error("cannot start {what}: {source}")]
    Spawn {
        /// Which program.
        what: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A service did not print its ready line in time, or exited first.
    #[error(
        "{what} did not become ready within {timeout:?}: {reason}\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    )]
    NotReady {
        /// Which program.
        what: String,
        /// How long we waited.
        timeout: Duration,
        /// Why we stopped waiting.
        reason: String,
        /// Its stdout so far.
        stdout: String,
        /// Its stderr so far.
        stderr: String,
    },
    /// A command ran past its deadline and was killed.
    #[error(
        "{what} timed out after {timeout:?} and was killed\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
    )]
    Timeout {
        /// Which program.
        what: String,
        /// The deadline.
        timeout: Duration,
        /// Its stdout.
        stdout: String,
        /// Its stderr.
        stderr: String,
    },
    /// One of our binaries could not be built.
    #[error("cannot build: {0}")]
    Build(String),
    /// A cargo command failed.
    #[error("cargo {args} failed:\n{stderr}")]
    Cargo {
        /// Its arguments.
        args: String,
        /// What it printed on stderr.
        stderr: String,
    },
    /// The real agent CLIs could not be located or installed.
    #[error("real agent CLIs unavailable: {0}")]
    Clients(String),
    /// A file the harness needed could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A log line or response was not the JSON it should be.
    #[error("bad JSON in {what}: {source}")]
    Json {
        /// Where.
        what: String,
        /// The parse error.
        source: serde_json::Error,
    },
    /// A request was answered with another status than the helper expects.
    #[error("{what}: status {status}: {body}")]
    Status {
        /// The request.
        what: String,
        /// The status it got.
        status: u16,
        /// The body, as text.
        body: String,
    },
    /// An HTTP exchange over a unix socket failed.
    #[error(transparent)]
    Client(#[from] agentbox_api::ClientError),
    /// What a helper waited for did not come about in time.
    #[error("{what} not seen within {timeout:?}; last seen: {last}")]
    NotSeen {
        /// What was awaited.
        what: String,
        /// How long we waited.
        timeout: Duration,
        /// The last thing looked at, as text.
        last: String,
    },
}

/// A fresh temp dir (named `<prefix>…`) holding `name` with `contents`; the process wrappers
/// keep the dir alive as long as their process.
fn temp_file(
    prefix: &str,
    name: &str,
    contents: &str,
) -> Result<(tempfile::TempDir, PathBuf), HarnessError> {
    let dir = tempfile::Builder::new()
        .prefix(prefix)
        .tempdir()
        .map_err(|source| HarnessError::Io {
            path: std::env::temp_dir(),
            source,
        })?;
    let path = dir.path().join(name);
    std::fs::write(&path, contents).map_err(|source| HarnessError::Io {
        path: path.clone(),
        source,
    })?;
    Ok((dir, path))
}
