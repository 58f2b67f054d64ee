//! A service daemon's control socket: `run/<name>.sock` under the data dir, bound mode 0600
//! (only the service user and root may connect), announced, served until shutdown, and
//! removed afterwards. The gateway and the pool open theirs the same way; the launcher's is
//! root's and made differently (`launcher/src/daemon.rs`).

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use axum::Router;
use tokio::net::UnixListener;
use tokio_util::sync::CancellationToken;

/// `<data_dir>/run`, created if missing. A failure is printed under `program`'s name and
/// comes back as the exit code.
pub fn run_dir(program: &str, data_dir: &Path) -> Result<PathBuf, ExitCode> {
    let run_dir = data_dir.join("run");
    if let Err(e) = std::fs::create_dir_all(&run_dir) {
        eprintln!("{program}: cannot create {}: {e}", run_dir.display());
        return Err(ExitCode::FAILURE);
    }
    Ok(run_dir)
}

/// A bound control socket not yet served.
#[derive(Debug)]
pub struct ControlSocket {
    path: PathBuf,
    listener: UnixListener,
}

impl ControlSocket {
    /// Binds `path`, replacing a stale socket from a previous run (never anything else),
    /// mode 0600. A failure is printed under `program`'s name and comes back as the exit code.
    pub fn bind(program: &str, path: PathBuf) -> Result<Self, ExitCode> {
        match bind_socket(&path) {
            Ok(listener) => Ok(Self { path, listener }),
            Err(e) => {
                eprintln!("{program}: cannot listen on {}: {e}", path.display());
                Err(ExitCode::FAILURE)
            }
        }
    }

    /// Prints `listening on unix:<path>`, cancels `shutdown` on SIGTERM or SIGINT, serves
    /// `router` until `shutdown`, then removes the socket.
    pub async fn serve(self, router: Router, shutdown: CancellationToken) {
        // A closed stdout only loses the announcement; the socket serves all the same.
        let _ = crate::announce_listening(format_args!("unix:{}", self.path.display()));
        crate::cancel_on_shutdown_signal(&shutdown);
        crate::serve_unix(self.listener, router, shutdown).await;
        // Gone already (an operator's cleanup) is as good as removed.
        let _ = std::fs::remove_file(&self.path);
    }
}

fn bind_socket(path: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)?,
        Ok(_) => {
            return Err(std::io::Error::other(
                "exists and is not a socket; refusing to replace it",
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}
