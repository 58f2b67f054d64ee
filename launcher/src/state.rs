//! What must survive a launcher restart: one JSON record per agent run under
//! `state/agents/<tid>.json`, written atomically (temp file, fsync, rename, fsync of the
//! directory) so a crash leaves either the old or the new record, never a torn one.
//!
//! A record whose run was still active when the launcher died tells the restarted launcher to
//! hand the workspace back and report the run as `lost`. The task token is never written.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use agentbox_policy::id::Tid;
use serde::{Deserialize, Serialize};

use crate::task::{Final, Outcome, RunKind};

/// One persisted run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub tid: Tid,
    pub kind: RunKind,
    /// `None` while the run is active.
    pub finished: Option<Final>,
    pub outcome: Outcome,
    pub workspace_gid: u32,
}

/// Why a record could not be written.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct StateError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// The `state/agents` directory.
#[derive(Debug, Clone)]
pub struct StateStore {
    dir: PathBuf,
}

impl StateStore {
    /// Creates the directory (root, 0700) if needed.
    pub fn open(dir: &Path) -> Result<StateStore, StateError> {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(|source| StateError {
                path: dir.to_path_buf(),
                source,
            })?;
        Ok(StateStore {
            dir: dir.to_path_buf(),
        })
    }

    fn path(&self, tid: &Tid) -> PathBuf {
        self.dir.join(format!("{tid}.json"))
    }

    /// Writes `record` atomically.
    pub fn save(&self, record: &Record) -> Result<(), StateError> {
        let target = self.path(&record.tid);
        let tmp = self.dir.join(format!(".{}.json.tmp", record.tid));
        let err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| StateError { path, source }
        };
        let bytes = serde_json::to_vec_pretty(record).map_err(|e| StateError {
            path: target.clone(),
            source: std::io::Error::other(e),
        })?;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&tmp)
            .map_err(err(&tmp))?;
        file.write_all(&bytes).map_err(err(&tmp))?;
        file.sync_all().map_err(err(&tmp))?;
        drop(file);
        std::fs::rename(&tmp, &target).map_err(err(&target))?;
        std::fs::File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(err(&self.dir))?;
        Ok(())
    }

    /// Removes the record of `tid`, if any.
    pub fn remove(&self, tid: &Tid) -> Result<(), StateError> {
        match std::fs::remove_file(self.path(tid)) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(StateError {
                path: self.path(tid),
                source,
            }),
        }
    }

    /// Every readable record; unreadable ones are reported and skipped, so one corrupt file
    /// cannot keep the launcher from starting.
    pub fn load_all(&self) -> Vec<Record> {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for e in entries.flatten() {
            let path = e.path();
            let is_record = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with(".json") && !n.starts_with('.'));
            if !is_record {
                continue;
            }
            match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Record>(&b).map_err(|e| e.to_string()))
            {
                Ok(r) if path.file_stem().and_then(|s| s.to_str()) == Some(r.tid.as_str()) => {
                    out.push(r)
                }
                Ok(_) => {
                    tracing::warn!(path = %path.display(), "state record names another tid; skipped")
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable state record; skipped")
                }
            }
        }
        out.sort_by(|a, b| a.tid.cmp(&b.tid));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_corrupt_files() {
        let tmp = tempfile::tempdir().unwrap();
        let store = StateStore::open(&tmp.path().join("state/agents")).unwrap();
        let rec = Record {
            tid: Tid::parse("t1").unwrap(),
            kind: RunKind::Agent,
            finished: Some(Final::Exited),
            outcome: Outcome {
                exit_code: Some(3),
                ..Outcome::default()
            },
            workspace_gid: 7,
        };
        store.save(&rec).unwrap();
        store.save(&rec).unwrap();
        std::fs::write(tmp.path().join("state/agents/bad.json"), b"{").unwrap();
        let other = Record {
            tid: Tid::parse("t2").unwrap(),
            ..rec.clone()
        };
        std::fs::write(
            tmp.path().join("state/agents/t3.json"),
            serde_json::to_vec(&other).unwrap(),
        )
        .unwrap();
        assert_eq!(store.load_all(), vec![rec.clone()]);
        store.remove(&rec.tid).unwrap();
        store.remove(&rec.tid).unwrap();
        assert!(store.load_all().is_empty());
        let names: Vec<_> = std::fs::read_dir(tmp.path().join("state/agents"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert!(!names.iter().any(|n| n.ends_with(".tmp")), "{names:?}");
    }
}
