//! The event loops the task sockets run on: `gateway.threads` shards (one per core by default),
//! each a single-threaded tokio runtime on a thread of its own with its own upstream client,
//! and each task socket pinned to one shard, the one serving the fewest tasks when it opens.
//!
//! Why not one multi-threaded runtime: a request's pieces (the client's connection, the
//! detached upstream call, the upstream connection's task, the metered body) wake each other
//! many times per request, once per streamed frame, and under work stealing those wake-ups
//! cross threads (a futex wake and a context switch each). On one thread they do not: a fifth
//! less CPU per request (BENCHMARKS.md, "Reused body buffers, one event loop per task"). Why not
//! one thread for everything: a task's CPU-heavy request (a 32 MB body parsed) then delays
//! every other task's; with shards it delays only the tasks on its shard, and the tasks spread
//! over the cores. A task's own requests all run on its shard.
//!
//! The control socket and the state writer stay on the daemon's main runtime. Shard threads
//! end when [`Shards`] is dropped (or [`Shards::stop`] joins them): by then the gateway's
//! tracker has waited for every task socket.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// One event loop.
#[derive(Debug)]
struct Shard<T> {
    handle: Handle,
    /// What requests on this shard share (the upstream client lives here: its pooled
    /// connections are driven by tasks on this shard's runtime).
    state: Arc<T>,
    /// Task sockets this shard serves now.
    serving: Arc<AtomicUsize>,
}

/// The shards, started by [`Shards::start`].
#[derive(Debug)]
pub struct Shards<T> {
    shards: Vec<Shard<T>>,
    stop: CancellationToken,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

/// A shard chosen for one task socket: where to register its listener and spawn its server.
#[derive(Debug)]
pub struct Placement<T> {
    /// The shard's number (0-based), for logs and tests.
    pub index: usize,
    handle: Handle,
    state: Arc<T>,
    serving: Arc<AtomicUsize>,
}

impl<T> Placement<T> {
    /// What this shard's requests share.
    pub fn state(&self) -> &Arc<T> {
        &self.state
    }

    /// Registers a listener with this shard's reactor, so its readiness wakes this shard's
    /// thread and no other.
    pub fn register(
        &self,
        listener: std::os::unix::net::UnixListener,
    ) -> std::io::Result<tokio::net::UnixListener> {
        let _in_shard = self.handle.enter();
        tokio::net::UnixListener::from_std(listener)
    }

    /// Runs `serve` (a task socket's accept loop) on this shard, counted as one task it serves
    /// until the future ends.
    pub fn spawn(self, serve: impl std::future::Future<Output = ()> + Send + 'static) {
        self.serving.fetch_add(1, Ordering::Relaxed);
        let serving = self.serving;
        self.handle.spawn(async move {
            serve.await;
            serving.fetch_sub(1, Ordering::Relaxed);
        });
    }
}

/// Why the shards could not start.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    /// A runtime or its thread could not be created.
    #[error("cannot start gateway shard {index}: {source}")]
    Start {
        /// Which shard.
        index: usize,
        /// The error.
        source: std::io::Error,
    },
}

impl<T: Send + Sync + 'static> Shards<T> {
    /// Starts `count` shards (at least one), each with the state `make` gives it.
    pub fn start<E>(count: usize, mut make: impl FnMut() -> Result<T, E>) -> Result<Shards<T>, E>
    where
        E: From<ShardError>,
    {
        let stop = CancellationToken::new();
        let mut shards = Vec::new();
        let mut threads = Vec::new();
        for index in 0..count.max(1) {
            let start = |source| ShardError::Start { index, source };
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(start)?;
            let handle = runtime.handle().clone();
            let until = stop.clone();
            let thread = std::thread::Builder::new()
                .name(format!("gateway-shard-{index}"))
                .spawn(move || runtime.block_on(until.cancelled()))
                .map_err(start)?;
            threads.push(thread);
            shards.push(Shard {
                handle,
                state: Arc::new(make()?),
                serving: Arc::new(AtomicUsize::new(0)),
            });
        }
        Ok(Shards {
            shards,
            stop,
            threads: Mutex::new(threads),
        })
    }

    /// The shard serving the fewest task sockets now (the first of those tied).
    pub fn place(&self) -> Placement<T> {
        let (index, shard) = self
            .shards
            .iter()
            .enumerate()
            .min_by_key(|(_, s)| s.serving.load(Ordering::Relaxed))
            .unwrap_or_else(|| unreachable!("start makes at least one shard"));
        Placement {
            index,
            handle: shard.handle.clone(),
            state: shard.state.clone(),
            serving: shard.serving.clone(),
        }
    }

    /// How many shards there are.
    pub fn len(&self) -> usize {
        self.shards.len()
    }

    /// Always false: there is at least one shard.
    pub fn is_empty(&self) -> bool {
        self.shards.is_empty()
    }

    /// Task sockets each shard serves now.
    pub fn serving(&self) -> Vec<usize> {
        self.shards
            .iter()
            .map(|s| s.serving.load(Ordering::Relaxed))
            .collect()
    }

    /// Ends the shards' runtimes (whatever still runs there is dropped) and waits for their
    /// threads. Call it after the task sockets have drained.
    pub fn stop(&self) {
        self.stop.cancel();
        let threads =
            std::mem::take(&mut *self.threads.lock().unwrap_or_else(PoisonError::into_inner));
        for t in threads {
            if t.join().is_err() {
                tracing::error!("a gateway shard's thread panicked");
            }
        }
    }
}

impl<T> Drop for Shards<T> {
    fn drop(&mut self) {
        // The threads end on their own; joining is `stop`'s (a drop may run on a runtime).
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Never;
    impl From<ShardError> for Never {
        fn from(e: ShardError) -> Self {
            panic!("{e}")
        }
    }

    #[test]
    fn tasks_spread_over_shards_run_on_their_own_thread_and_are_uncounted_when_done() {
        let mut n = 0;
        let shards: Shards<usize> = Shards::start(3, || {
            n += 1;
            Ok::<_, Never>(n)
        })
        .unwrap();
        assert_eq!(shards.len(), 3);
        let mut stops = Vec::new();
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..6 {
            let p = shards.place();
            let stop = tokio::sync::oneshot::channel::<()>();
            stops.push(stop.0);
            let tx = tx.clone();
            let (index, state) = (p.index, **p.state());
            p.spawn(async move {
                let name = std::thread::current().name().map(str::to_owned);
                tx.send((index, state, name)).unwrap();
                let _ = stop.1.await;
            });
        }
        let mut seen: Vec<_> = (0..6).map(|_| rx.recv().unwrap()).collect();
        seen.sort();
        for (i, (index, state, name)) in seen.iter().enumerate() {
            assert_eq!(*index, i / 2, "two each, fewest first");
            assert_eq!(*state, index + 1, "each shard has the state made for it");
            assert_eq!(name.as_deref(), Some(&*format!("gateway-shard-{index}")));
        }
        assert_eq!(shards.serving(), vec![2, 2, 2]);
        // Shard 0's two end (placed first and fourth): the next task goes there.
        drop(stops.remove(3));
        drop(stops.remove(0));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while shards.serving() != vec![0, 2, 2] {
            assert!(
                std::time::Instant::now() < deadline,
                "{:?}",
                shards.serving()
            );
            std::thread::yield_now();
        }
        assert_eq!(shards.place().index, 0);
        shards.stop();
        // Stopped shards drop what still ran there.
        assert!(stops.iter().all(tokio::sync::oneshot::Sender::is_closed));
    }

    #[test]
    fn zero_asked_means_one() {
        let shards: Shards<()> = Shards::start(0, || Ok::<_, Never>(())).unwrap();
        assert_eq!(shards.len(), 1);
        shards.stop();
    }
}
