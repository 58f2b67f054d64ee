//! A leased slot's TCP endpoint: a listener on `listen_host:port` whose every connection is
//! copied byte for byte to the slot's unix socket, so the paddock reaches the server at
//! `sandbox_url` without the slot ever having a network. The listener exists only while the
//! lease does: [`Forwarder::close`] stops accepting and cuts the open connections, and
//! dropping a forwarder does the same (nothing outlives its lease, even on an error path).
//! Each connection reaches the slot's socket itself, never what its agent put in its place
//! ([`crate::slot_socket`]).

use std::net::SocketAddr;
use std::path::PathBuf;

use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// An open endpoint and its connections.
#[derive(Debug)]
pub struct Forwarder {
    cancel: CancellationToken,
    tasks: TaskTracker,
    addr: Option<SocketAddr>,
}

impl Forwarder {
    /// Binds `addr` and forwards every connection to `socket`.
    ///
    /// # Errors
    /// When `addr` cannot be bound (in use, not an address of this host).
    pub fn open(addr: SocketAddr, socket: PathBuf) -> std::io::Result<Forwarder> {
        let std_listener = std::net::TcpListener::bind(addr)?;
        std_listener.set_nonblocking(true)?;
        let listener = TcpListener::from_std(std_listener)?;
        let local = listener.local_addr()?;
        let cancel = CancellationToken::new();
        let tasks = TaskTracker::new();
        tasks.spawn(accept(listener, socket, cancel.clone(), tasks.clone()));
        Ok(Forwarder {
            cancel,
            tasks,
            addr: Some(local),
        })
    }

    /// A forwarder that forwards nothing (for backends without a real server).
    pub fn inert() -> Forwarder {
        Forwarder {
            cancel: CancellationToken::new(),
            tasks: TaskTracker::new(),
            addr: None,
        }
    }

    /// The bound address.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// Stops accepting, cuts every connection and waits until all of it is gone.
    pub async fn close(self) {
        self.cancel.cancel();
        self.tasks.close();
        self.tasks.wait().await;
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn accept(
    listener: TcpListener,
    socket: PathBuf,
    cancel: CancellationToken,
    tasks: TaskTracker,
) {
    loop {
        let accepted = tokio::select! {
            () = cancel.cancelled() => return,
            a = listener.accept() => a,
        };
        match accepted {
            Ok((tcp, peer)) => {
                tasks.spawn(connection(tcp, socket.clone(), cancel.clone(), peer));
            }
            Err(e) => {
                // EMFILE and friends: back off a little instead of spinning.
                tracing::warn!(error = %e, "accept failed on a slot endpoint");
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(std::time::Duration::from_millis(100)) => {}
                }
            }
        }
    }
}

async fn connection(
    mut tcp: TcpStream,
    socket: PathBuf,
    cancel: CancellationToken,
    peer: SocketAddr,
) {
    let _ = tcp.set_nodelay(true);
    let mut unix = match crate::slot_socket::connect(&socket).await {
        Ok(u) => u,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "slot socket unreachable; closing the connection");
            return;
        }
    };
    tokio::select! {
        () = cancel.cancelled() => {}
        r = tokio::io::copy_bidirectional(&mut tcp, &mut unix) => {
            if let Err(e) = r {
                tracing::debug!(%peer, error = %e, "slot connection ended");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn bytes_go_both_ways_and_close_cuts_connections() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("s.sock");
        let server = tokio::net::UnixListener::bind(&sock).unwrap();
        let echo = tokio::spawn(async move {
            let (mut s, _) = server.accept().await.unwrap();
            let mut buf = [0u8; 5];
            s.read_exact(&mut buf).await.unwrap();
            s.write_all(&buf).await.unwrap();
            // Keep the connection open: close() must cut it.
            let mut rest = Vec::new();
            let _ = s.read_to_end(&mut rest).await;
        });
        let fwd = Forwarder::open("127.0.0.1:0".parse().unwrap(), sock).unwrap();
        let addr = fwd.addr().unwrap();
        let mut c = TcpStream::connect(addr).await.unwrap();
        c.write_all(b"hello").await.unwrap();
        let mut buf = [0u8; 5];
        c.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"hello");
        fwd.close().await;
        let mut rest = Vec::new();
        assert_eq!(c.read_to_end(&mut rest).await.unwrap_or(0), 0);
        echo.await.unwrap();
        assert!(TcpStream::connect(addr).await.is_err());
    }

    /// The slot's agent replaced its server's socket with a symlink to another socket (the
    /// launcher's, in the attack): a connection to the lease port is closed without reaching
    /// it.
    #[tokio::test]
    async fn a_symlink_in_place_of_the_socket_reaches_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("launcher.sock");
        let victim = tokio::net::UnixListener::bind(&target).unwrap();
        let sock = dir.path().join("server.sock");
        std::os::unix::fs::symlink(&target, &sock).unwrap();
        let fwd = Forwarder::open("127.0.0.1:0".parse().unwrap(), sock).unwrap();
        let mut c = TcpStream::connect(fwd.addr().unwrap()).await.unwrap();
        let _ = c
            .write_all(b"GET /agents HTTP/1.1\r\nhost: x\r\n\r\n")
            .await;
        let reached = tokio::time::timeout(Duration::from_millis(300), victim.accept()).await;
        assert!(
            reached.is_err(),
            "the forwarder connected through the symlink"
        );
        let mut rest = Vec::new();
        let closed = tokio::time::timeout(Duration::from_secs(5), c.read_to_end(&mut rest)).await;
        assert!(closed.is_ok(), "the connection stays open");
        fwd.close().await;
    }
}
