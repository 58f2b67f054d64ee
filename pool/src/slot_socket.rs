//! Connecting to a slot server's unix socket without following what the slot's agent put there.
//!
//! The socket is `slots/<tid>/server/server.sock`, and `server/` belongs to the slot's agent uid
//! (its server creates the socket there). The agent can replace `server.sock` with a symlink to
//! any socket the pool's user reaches: the launcher's control socket, the gateway's, another
//! slot's. A connect by name follows it, and every byte sent to the lease port would then reach
//! that socket as the pool's user. So every connection (the forwarder's and the health
//! probes') opens the name with `O_PATH | O_NOFOLLOW` (the directories above it are root's, the
//! agent cannot swap them), refuses anything but a socket (a symlink opens as itself), and
//! connects through `/proc/self/fd/<n>`, which reaches that socket inode and nothing else.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, open};
use nix::sys::stat::{Mode, SFlag, fstat};
use tokio::net::UnixStream;

/// A slot socket opened by name once: connect through [`Pinned::path`] while it lives.
#[derive(Debug)]
pub struct Pinned {
    path: PathBuf,
    // Keeps `path` meaning this socket.
    _fd: OwnedFd,
}

impl Pinned {
    /// `/proc/self/fd/<n>` of the socket: a name only this process resolves, to this inode.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// Opens `socket` without following a symlink in its last component, and checks it is a
/// socket.
///
/// # Errors
/// When it cannot be opened, or is not a socket (a symlink, a file, a directory).
pub fn pin(socket: &Path) -> io::Result<Pinned> {
    let fd = open(
        socket,
        OFlag::O_PATH | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let kind = SFlag::from_bits_truncate(fstat(&fd)?.st_mode) & SFlag::S_IFMT;
    if kind != SFlag::S_IFSOCK {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a socket", socket.display()),
        ));
    }
    Ok(Pinned {
        path: PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())),
        _fd: fd,
    })
}

/// Connects to the socket at `socket` as [`pin`] finds it.
///
/// # Errors
/// As [`pin`], or when nothing listens on it.
pub async fn connect(socket: &Path) -> io::Result<UnixStream> {
    let pinned = pin(socket)?;
    UnixStream::connect(pinned.path()).await
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    /// A symlink put in place of the server's socket is refused, whatever it points to; the
    /// real socket connects.
    #[tokio::test]
    async fn only_the_socket_itself_is_reached() {
        let dir = tempfile::tempdir().unwrap();
        let other = dir.path().join("launcher.sock");
        let _other = tokio::net::UnixListener::bind(&other).unwrap();
        let swapped = dir.path().join("server.sock");
        std::os::unix::fs::symlink(&other, &swapped).unwrap();
        // By name, the link is followed.
        assert!(UnixStream::connect(&swapped).await.is_ok());
        let e = connect(&swapped).await.unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{e}");

        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        assert!(connect(&file).await.is_err());
        assert!(connect(&dir.path().join("missing")).await.is_err());

        let real = dir.path().join("real.sock");
        let server = tokio::net::UnixListener::bind(&real).unwrap();
        let client = connect(&real).await.unwrap();
        let (accepted, _) = server.accept().await.unwrap();
        assert_eq!(
            client.peer_addr().unwrap().as_pathname(),
            Some(real.as_path())
        );
        drop(accepted);
    }
}
