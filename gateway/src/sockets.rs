//! Creating and removing `sockets/<tid>/llm.sock` without ever following a symlink.
//!
//! The launcher bind-mounts `sockets/<tid>` into the agent's sandbox at `/run/gw`, so the
//! directory must be exactly the one we created: it is made with `mkdirat` under an `O_PATH`
//! handle of `sockets/`, re-opened through `policy::resolve` (which refuses a symlink in any
//! component), and the socket is bound through `/proc/self/fd/<dir>/llm.sock`, so the kernel
//! resolves the path through our handle rather than through names someone could swap.
//!
//! A directory left from a previous run (gateway restart) is reused, never recreated: a
//! running sandbox holds a bind mount of that very inode, and a new directory would cut it
//! off. Modes: `sockets/` and `sockets/<tid>` 0755 (only the service user writes there), the
//! socket 0666: the agent uid must be able to connect, and isolation between tasks comes from
//! the per-task mount and token, not from file modes.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use agentbox_policy::id::Tid;
use agentbox_policy::path::RelPath;
use agentbox_policy::resolve::{ResolveError, Root};
use rustix::fs::{self, AtFlags, Mode};
use rustix::io::Errno;
use std::os::unix::net::UnixListener;

/// The socket's file name inside `sockets/<tid>/`.
pub const SOCKET_NAME: &str = "llm.sock";

/// Why a task socket could not be created or removed.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// `sockets/<tid>` (or a component above it) is not what we created: a symlink, a file,
    /// another owner, another mount.
    #[error("refusing sockets/{tid}: {source}")]
    Unsafe {
        /// The task.
        tid: String,
        /// What the resolver found.
        source: ResolveError,
    },
    /// The directory exists but belongs to someone else.
    #[error("refusing sockets/{tid}: owned by uid {owner}, not {expected}")]
    Owner {
        /// The task.
        tid: String,
        /// Who owns it.
        owner: u32,
        /// Who should.
        expected: u32,
    },
    /// A system call failed.
    #[error("{op} sockets/{tid}: {source}")]
    Io {
        /// The task.
        tid: String,
        /// What we were doing.
        op: &'static str,
        /// The error.
        source: std::io::Error,
    },
}

/// `sockets/` under the data dir, opened once as a trusted root.
#[derive(Debug)]
pub struct SocketsDir {
    root: Root,
    euid: u32,
}

impl SocketsDir {
    /// Opens (creating if missing, mode 0711: traversed to a task's socket, never listed, since
    /// the names are task ids) `<data_dir>/sockets`.
    pub fn open(data_dir: &Path) -> Result<SocketsDir, std::io::Error> {
        let path = data_dir.join("sockets");
        match std::fs::create_dir(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        let root = Root::open(&path).map_err(std::io::Error::other)?;
        fs::fchmod(root_fd_for_chmod(&path)?, Mode::from_raw_mode(0o711))
            .map_err(std::io::Error::from)?;
        Ok(SocketsDir {
            root,
            euid: rustix::process::geteuid().as_raw(),
        })
    }

    /// The path of `sockets/` (for messages).
    pub fn path(&self) -> &Path {
        self.root.path()
    }

    /// Creates (or reuses) `sockets/<tid>/` and binds a fresh `llm.sock` in it, non-blocking,
    /// for the event loop that will serve it to register.
    pub fn bind(&self, tid: &Tid) -> Result<UnixListener, SocketError> {
        let name = tid.as_str();
        let io = |op: &'static str| {
            move |e: Errno| SocketError::Io {
                tid: name.to_owned(),
                op,
                source: e.into(),
            }
        };
        match fs::mkdirat(&self.root, name, Mode::from_raw_mode(0o755)) {
            Ok(()) | Err(Errno::EXIST) => {}
            Err(e) => return Err(io("create")(e)),
        }
        let dir = self.open_dir(tid)?;
        // A stale socket from a previous run: unlink it (never a directory: `unlinkat`
        // without AT_REMOVEDIR refuses those).
        match fs::unlinkat(&dir, SOCKET_NAME, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => return Err(io("remove stale socket in")(e)),
        }
        let path = proc_path(&dir);
        let std_listener =
            std::os::unix::net::UnixListener::bind(&path).map_err(|source| SocketError::Io {
                tid: name.to_owned(),
                op: "bind socket in",
                source,
            })?;
        std_listener
            .set_nonblocking(true)
            .map_err(|source| SocketError::Io {
                tid: name.to_owned(),
                op: "configure socket in",
                source,
            })?;
        fs::chmodat(
            &dir,
            SOCKET_NAME,
            Mode::from_raw_mode(0o666),
            AtFlags::empty(),
        )
        .map_err(io("chmod socket in"))?;
        // The directory's mode is ours to set whatever the umask was (and whoever made it).
        fs::chmodat(
            &self.root,
            name,
            Mode::from_raw_mode(0o755),
            AtFlags::empty(),
        )
        .map_err(io("chmod"))?;
        Ok(std_listener)
    }

    /// Removes `sockets/<tid>/llm.sock` and the directory. Missing is fine.
    pub fn remove(&self, tid: &Tid) -> Result<(), SocketError> {
        let name = tid.as_str();
        let dir = match self.open_dir(tid) {
            Ok(d) => d,
            Err(SocketError::Unsafe {
                source: ResolveError::NotFound { .. },
                ..
            }) => return Ok(()),
            Err(e) => return Err(e),
        };
        match fs::unlinkat(&dir, SOCKET_NAME, AtFlags::empty()) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => {
                return Err(SocketError::Io {
                    tid: name.to_owned(),
                    op: "remove socket in",
                    source: e.into(),
                });
            }
        }
        match fs::unlinkat(&self.root, name, AtFlags::REMOVEDIR) {
            // Not empty means someone put something there; leave it for the operator to see.
            Ok(()) | Err(Errno::NOENT) | Err(Errno::NOTEMPTY) => Ok(()),
            Err(e) => Err(SocketError::Io {
                tid: name.to_owned(),
                op: "remove",
                source: e.into(),
            }),
        }
    }

    /// Whether `sockets/<tid>/llm.sock` exists.
    pub fn socket_path(&self, tid: &Tid) -> PathBuf {
        self.root.path().join(tid.as_str()).join(SOCKET_NAME)
    }

    fn open_dir(&self, tid: &Tid) -> Result<OwnedFd, SocketError> {
        let name = tid.as_str();
        let unsafe_err = |source| SocketError::Unsafe {
            tid: name.to_owned(),
            source,
        };
        let rel = RelPath::parse(name).map_err(|e| SocketError::Io {
            tid: name.to_owned(),
            op: "name",
            source: std::io::Error::other(e),
        })?;
        let resolved = self.root.resolve_dir(&rel).map_err(unsafe_err)?;
        let owner = resolved.identity().uid;
        if owner != self.euid {
            return Err(SocketError::Owner {
                tid: name.to_owned(),
                owner,
                expected: self.euid,
            });
        }
        Ok(resolved.into_fd())
    }
}

/// `/proc/self/fd/<fd>/llm.sock`: a path the kernel resolves through our handle.
fn proc_path(dir: &impl AsFd) -> PathBuf {
    PathBuf::from(format!(
        "/proc/self/fd/{}/{SOCKET_NAME}",
        dir.as_fd().as_raw_fd()
    ))
}

/// An fd good for `fchmod` on the sockets dir (`O_PATH` handles cannot be chmod'ed).
fn root_fd_for_chmod(path: &Path) -> Result<OwnedFd, std::io::Error> {
    fs::open(
        path,
        fs::OFlags::RDONLY | fs::OFlags::DIRECTORY | fs::OFlags::NOFOLLOW | fs::OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(std::io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tid(s: &str) -> Tid {
        Tid::parse(s).unwrap()
    }

    #[test]
    fn bind_reuse_and_remove() {
        let data = tempfile::tempdir().unwrap();
        let dir = SocketsDir::open(data.path()).unwrap();
        let l = tokio_rt().block_on(async { dir.bind(&tid("t1")) }).unwrap();
        let sock = data.path().join("sockets/t1/llm.sock");
        let meta = std::fs::symlink_metadata(&sock).unwrap();
        use std::os::unix::fs::{FileTypeExt, PermissionsExt};
        assert!(meta.file_type().is_socket());
        assert_eq!(meta.permissions().mode() & 0o777, 0o666);
        drop(l);
        // A restart binds again in the same directory (same inode).
        let ino = std::fs::metadata(data.path().join("sockets/t1"))
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .unwrap();
        let _l = tokio_rt().block_on(async { dir.bind(&tid("t1")) }).unwrap();
        let ino2 = std::fs::metadata(data.path().join("sockets/t1"))
            .map(|m| std::os::unix::fs::MetadataExt::ino(&m))
            .unwrap();
        assert_eq!(ino, ino2);
        dir.remove(&tid("t1")).unwrap();
        assert!(!data.path().join("sockets/t1").exists());
        dir.remove(&tid("t1")).unwrap();
    }

    #[test]
    fn symlinked_task_dir_is_refused_and_nothing_is_created() {
        let data = tempfile::tempdir().unwrap();
        let elsewhere = tempfile::tempdir().unwrap();
        let dir = SocketsDir::open(data.path()).unwrap();
        std::os::unix::fs::symlink(elsewhere.path(), data.path().join("sockets/evil")).unwrap();
        let err = tokio_rt()
            .block_on(async { dir.bind(&tid("evil")) })
            .unwrap_err();
        assert!(matches!(err, SocketError::Unsafe { .. }), "{err}");
        assert_eq!(
            std::fs::read_dir(elsewhere.path()).unwrap().count(),
            0,
            "nothing created through the link"
        );
        // remove() does not follow it either.
        assert!(dir.remove(&tid("evil")).is_err());
        assert!(elsewhere.path().exists());
    }

    #[test]
    fn a_file_in_place_of_the_dir_is_refused() {
        let data = tempfile::tempdir().unwrap();
        let dir = SocketsDir::open(data.path()).unwrap();
        std::fs::write(data.path().join("sockets/f1"), b"x").unwrap();
        assert!(tokio_rt().block_on(async { dir.bind(&tid("f1")) }).is_err());
    }

    fn tokio_rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }
}
