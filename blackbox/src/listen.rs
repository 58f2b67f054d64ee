//! The server's unix socket (`BBS_UNIX_SOCKET`): created fresh at the configured path, never
//! through a symlink, and made `0666`, because access to it is controlled by its directory: the
//! launcher creates that directory for the slot and binds it out to the host for the service
//! user only, so whoever can reach the socket file may talk to the server, as with a loopback
//! port inside the slot's network namespace.
//!
//! What is at the path before binding: nothing (bound), a socket owned by this uid (a stale
//! one a killed server left: removed, then bound), anything else (a symlink, a file, another
//! user's socket: refused, nothing touched). `bind(2)` itself never follows or replaces an
//! existing name, so a name that appears between the check and the bind fails the bind; the
//! mode is then set through an `O_PATH | O_NOFOLLOW` descriptor re-checked to be the socket
//! just bound (a socket of ours), never by path.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags};
use tokio::net::UnixListener;

/// Why the socket could not be set up (a startup error naming the path).
#[derive(Debug, thiserror::Error)]
pub enum ListenError {
    /// Something that is not a socket of ours is at the path.
    #[error(
        "BBS_UNIX_SOCKET={path:?}: the path exists and is not a socket of this user; refusing to replace it"
    )]
    Occupied {
        /// The path.
        path: PathBuf,
    },
    /// A system call failed.
    #[error("BBS_UNIX_SOCKET={path:?}: cannot {what}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// The error.
        source: io::Error,
    },
}

/// Binds a fresh unix socket at `path`, mode `0666` (see the module doc).
///
/// # Errors
/// [`ListenError::Occupied`] when something not ours is at the path; [`ListenError::Io`] when
/// a call fails.
pub fn bind_unix(path: &Path) -> Result<UnixListener, ListenError> {
    let io = |what: &'static str| {
        move |source: io::Error| ListenError::Io {
            path: path.to_owned(),
            what,
            source,
        }
    };
    let uid = rustix::process::geteuid().as_raw();
    match std::fs::symlink_metadata(path) {
        Ok(meta) => {
            if !(meta.file_type().is_socket() && meta.uid() == uid) {
                return Err(ListenError::Occupied {
                    path: path.to_owned(),
                });
            }
            // unlink(2) removes the name itself, never what a symlink would name.
            std::fs::remove_file(path).map_err(io("remove the stale socket"))?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("inspect the path")(e)),
    }
    let listener = UnixListener::bind(path).map_err(io("bind"))?;
    let fd = rustix::fs::open(
        path,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io("open the bound socket")(e.into()))?;
    let stat = rustix::fs::fstat(&fd).map_err(|e| io("inspect the bound socket")(e.into()))?;
    if FileType::from_raw_mode(stat.st_mode) != FileType::Socket || stat.st_uid != uid {
        return Err(ListenError::Occupied {
            path: path.to_owned(),
        });
    }
    // chmod through the descriptor's /proc link: the inode just checked, whatever the name
    // points to now.
    rustix::fs::chmod(
        format!("/proc/self/fd/{}", fd.as_raw_fd()),
        Mode::from_raw_mode(0o666),
    )
    .map_err(|e| io("set the socket's mode")(e.into()))?;
    Ok(listener)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[tokio::test]
    async fn binds_fresh_replaces_a_stale_socket_and_refuses_anything_else() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        let l = bind_unix(&sock).unwrap();
        let mode = std::fs::symlink_metadata(&sock).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o666);
        drop(l);
        // The stale socket of a killed server is ours: replaced.
        let _l = bind_unix(&sock).unwrap();

        let file = dir.path().join("f");
        std::fs::write(&file, b"x").unwrap();
        assert!(matches!(
            bind_unix(&file),
            Err(ListenError::Occupied { .. })
        ));
        assert_eq!(std::fs::read(&file).unwrap(), b"x");

        let target = dir.path().join("target");
        let link = dir.path().join("link.sock");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = bind_unix(&link).unwrap_err();
        assert!(matches!(err, ListenError::Occupied { .. }), "{err}");
        assert!(err.to_string().starts_with("BBS_UNIX_SOCKET="), "{err}");
        assert!(!target.exists(), "nothing created through the symlink");
        assert!(
            std::fs::symlink_metadata(&link)
                .unwrap()
                .file_type()
                .is_symlink()
        );
    }
}
