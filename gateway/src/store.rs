//! The gateway's state file (`state/gateway/gateway.json`): every task's usage and budget, so
//! a restart loses no money. The gateway keeps its own directory under `state/` because the
//! launcher (root) keeps its state beside it, in a directory the service user cannot touch. Written atomically (temp file, fsync, rename, fsync of the
//! directory), so a crash leaves either the old file or the new one, never half of either.
//!
//! What a crash (SIGKILL, power loss) costs: the writer runs after a settlement, at most once
//! per [`SAVE_INTERVAL`] (every settlement of that interval goes into one write), so the file
//! lags the ledger by at most the settlements of the last interval and the write under way;
//! requests in flight at the crash were only reserved, in memory, and are never billed. A task
//! can overshoot its budget by those, once per crash. Nothing is ever counted twice.
//! `tests/tests/faults.rs` pins this. Control operations (open, close, budget changes) are
//! written before they answer, whatever the interval.
//!
//! Why an interval: each write is two `fsync`s. Written after every settlement, they were
//! most of the gateway's kernel time under load (BENCHMARKS.md, "The state writer"); at 50 ms
//! they cost at most 20 writes a second, however many requests settle.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::ledger::Snapshot;

/// The current format version.
pub const VERSION: u32 = 1;

/// The shortest time between two writes of the state after settlements: the crash window.
pub const SAVE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

/// Where the state lives.
#[derive(Debug, Clone)]
pub struct Store {
    path: PathBuf,
    /// Saves share one temp file: the state writer and a control operation saving at once
    /// would rename it from under each other (the loser fails with `ENOENT`) or write into the
    /// file just renamed into place. One save at a time.
    saving: std::sync::Arc<std::sync::Mutex<()>>,
}

/// Why the state could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Reading or writing failed.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The file is not a state file we understand; refusing to start is safer than resetting
    /// every task's spend to zero.
    #[error("{path}: not a valid gateway state file: {source}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: serde_json::Error,
    },
    /// A newer gateway wrote it.
    #[error("{path}: state version {found} is newer than {VERSION}")]
    Version {
        /// The file.
        path: PathBuf,
        /// Its version.
        found: u32,
    },
}

impl Store {
    /// The store under `<data_dir>/state/gateway/` (created mode 0700 if missing; `state/`
    /// itself, if the gateway has to create it, 0755 so the launcher's directory can sit
    /// beside ours).
    pub fn open(data_dir: &Path) -> Result<Store, StoreError> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = data_dir.join("state").join("gateway");
        let io = |source| StoreError::Io {
            path: dir.clone(),
            source,
        };
        for (path, mode) in [(data_dir.join("state"), 0o755), (dir.clone(), 0o700)] {
            match std::fs::DirBuilder::new().mode(mode).create(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(e)),
            }
        }
        Ok(Store {
            path: dir.join("gateway.json"),
            saving: std::sync::Arc::default(),
        })
    }

    /// Loads the snapshot; a missing file is an empty state.
    pub fn load(&self) -> Result<Snapshot, StoreError> {
        let text = match std::fs::read(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(Snapshot {
                    version: VERSION,
                    ..Snapshot::default()
                });
            }
            Err(source) => {
                return Err(StoreError::Io {
                    path: self.path.clone(),
                    source,
                });
            }
        };
        let snap: Snapshot =
            serde_json::from_slice(&text).map_err(|source| StoreError::Corrupt {
                path: self.path.clone(),
                source,
            })?;
        if snap.version > VERSION {
            return Err(StoreError::Version {
                path: self.path.clone(),
                found: snap.version,
            });
        }
        Ok(snap)
    }

    /// Writes the snapshot atomically.
    pub fn save(&self, snap: &Snapshot) -> Result<(), StoreError> {
        let io = |source| StoreError::Io {
            path: self.path.clone(),
            source,
        };
        let bytes = serde_json::to_vec_pretty(snap).map_err(|e| io(std::io::Error::other(e)))?;
        // A panic while holding it left no state behind that the next save would trust.
        let _one_at_a_time = self
            .saving
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let tmp = self.path.with_extension("json.tmp");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode_0600()
            .open(&tmp)
            .map_err(io)?;
        f.write_all(&bytes).map_err(io)?;
        f.sync_all().map_err(io)?;
        drop(f);
        std::fs::rename(&tmp, &self.path).map_err(io)?;
        if let Some(dir) = self.path.parent() {
            std::fs::File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(io)?;
        }
        Ok(())
    }
}

trait Mode0600 {
    fn mode_0600(&mut self) -> &mut Self;
}

impl Mode0600 for std::fs::OpenOptions {
    fn mode_0600(&mut self) -> &mut Self {
        std::os::unix::fs::OpenOptionsExt::mode(self, 0o600)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{Budget, Spent, TaskRecord, TaskState};

    #[test]
    fn save_then_load() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::open(d.path()).unwrap();
        assert!(store.load().unwrap().tasks.is_empty());
        let mut s = Snapshot {
            version: VERSION,
            ..Snapshot::default()
        };
        s.tasks.insert(
            "a".into(),
            TaskRecord {
                model: "m".into(),
                token_sha256: "ab".into(),
                budget: Budget::default(),
                spent: Spent {
                    output_tokens: 9,
                    ..Spent::default()
                },
                state: TaskState::Closed,
            },
        );
        store.save(&s).unwrap();
        assert_eq!(store.load().unwrap(), s);
        assert!(!d.path().join("state/gateway/gateway.json.tmp").exists());
    }

    /// The state writer and control operations save concurrently: every save succeeds and
    /// the file is always whole.
    #[test]
    fn concurrent_saves_do_not_collide() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::open(d.path()).unwrap();
        let s = Snapshot {
            version: VERSION,
            ..Snapshot::default()
        };
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    for _ in 0..50 {
                        store.save(&s).unwrap();
                    }
                });
            }
        });
        assert_eq!(store.load().unwrap(), s);
    }

    #[test]
    fn corrupt_and_future_files_are_refused() {
        let d = tempfile::tempdir().unwrap();
        let store = Store::open(d.path()).unwrap();
        std::fs::write(d.path().join("state/gateway/gateway.json"), b"{not json").unwrap();
        assert!(matches!(store.load(), Err(StoreError::Corrupt { .. })));
        std::fs::write(
            d.path().join("state/gateway/gateway.json"),
            br#"{"version":99,"tasks":{}}"#,
        )
        .unwrap();
        assert!(matches!(
            store.load(),
            Err(StoreError::Version { found: 99, .. })
        ));
    }
}
