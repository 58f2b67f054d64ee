//! What must survive a launcher restart: one JSON record per agent run under
//! `state/agents/<tid>.json`, written atomically (temp file, fsync, rename, fsync of the
//! directory) so a crash leaves either the old or the new record, never a torn one.
//!
//! Running vLLM backends are recorded the same way under `state/backends/<model>.json`.
//!
//! A record whose run was still active when the launcher died tells the restarted launcher to
//! hand the workspace back and report the run as `lost`. The task token is never written.

use std::io::Write;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use agentbox_policy::config::ModelId;
use agentbox_policy::id::Tid;
use serde::de::DeserializeOwned;
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
    /// The run's agent uid, so a restarted launcher knows whose files to take back (absent in
    /// records of launchers that had one agent uid for all runs).
    #[serde(default)]
    pub agent_uid: Option<u32>,
}

/// Why a record could not be written.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {source}")]
pub struct StateError {
    pub path: PathBuf,
    #[source]
    pub source: std::io::Error,
}

/// Writes `value` as `<dir>/<name>.json`: temp file, fsync, rename, fsync of the directory.
fn write_atomic<T: Serialize>(dir: &Path, name: &str, value: &T) -> Result<(), StateError> {
    let target = dir.join(format!("{name}.json"));
    let tmp = dir.join(format!(".{name}.json.tmp"));
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| StateError { path, source }
    };
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| StateError {
        path: target.clone(),
        source: std::io::Error::other(e),
    })?;
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&tmp)
        .map_err(err(&tmp))?;
    file.write_all(&bytes).map_err(err(&tmp))?;
    file.sync_all().map_err(err(&tmp))?;
    drop(file);
    std::fs::rename(&tmp, &target).map_err(err(&target))?;
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(err(dir))?;
    Ok(())
}

fn create_dir(dir: &Path) -> Result<(), StateError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| StateError {
            path: dir.to_path_buf(),
            source,
        })
}

fn remove_file(path: PathBuf) -> Result<(), StateError> {
    match std::fs::remove_file(&path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(StateError { path, source }),
    }
}

/// Every `*.json` file of `dir` (temp files excluded) parsed as `T`, with its file stem;
/// unreadable ones are reported and skipped, so one corrupt file cannot keep the launcher from
/// starting.
fn load_dir<T: DeserializeOwned>(dir: &Path) -> Vec<(String, T)> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        let path = e.path();
        let Some(stem) = path
            .file_name()
            .and_then(|n| n.to_str())
            .filter(|n| !n.starts_with('.'))
            .and_then(|n| n.strip_suffix(".json"))
            .map(str::to_owned)
        else {
            continue;
        };
        match std::fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|b| serde_json::from_slice::<T>(&b).map_err(|e| e.to_string()))
        {
            Ok(v) => out.push((stem, v)),
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "unreadable state record; skipped")
            }
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

/// The `state/agents` directory.
#[derive(Debug, Clone)]
pub struct StateStore {
    dir: PathBuf,
}

impl StateStore {
    /// Creates the directory (root, 0700) if needed.
    pub fn open(dir: &Path) -> Result<StateStore, StateError> {
        create_dir(dir)?;
        Ok(StateStore {
            dir: dir.to_path_buf(),
        })
    }

    fn path(&self, tid: &Tid) -> PathBuf {
        self.dir.join(format!("{tid}.json"))
    }

    /// Writes `record` atomically.
    pub fn save(&self, record: &Record) -> Result<(), StateError> {
        write_atomic(&self.dir, record.tid.as_str(), record)
    }

    /// Removes the record of `tid`, if any.
    pub fn remove(&self, tid: &Tid) -> Result<(), StateError> {
        remove_file(self.path(tid))
    }

    /// Every readable record.
    pub fn load_all(&self) -> Vec<Record> {
        load_dir::<Record>(&self.dir)
            .into_iter()
            .filter_map(|(stem, r)| {
                if stem == r.tid.as_str() {
                    Some(r)
                } else {
                    tracing::warn!(file = %stem, "state record names another tid; skipped");
                    None
                }
            })
            .collect()
    }
}

/// A running vLLM backend, as the launcher that started it recorded it: enough for a restarted
/// launcher to recognise the very process (not a later one that reused its pid) and stop it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BackendRecord {
    pub model: ModelId,
    /// The process, which leads its own session and process group.
    pub pid: u32,
    /// Its start time (`/proc/<pid>/stat` field 22, clock ticks since boot).
    pub start_ticks: u64,
    /// `/proc/sys/kernel/random/boot_id` at start: start times only compare within one boot.
    pub boot_id: String,
    pub port: u16,
}

/// The `state/backends` directory: one record per backend process that may be running.
#[derive(Debug, Clone)]
pub struct BackendStore {
    dir: PathBuf,
}

impl BackendStore {
    /// Creates the directory (root, 0700) if needed.
    pub fn open(dir: &Path) -> Result<BackendStore, StateError> {
        create_dir(dir)?;
        Ok(BackendStore {
            dir: dir.to_path_buf(),
        })
    }

    /// Writes `record` atomically.
    pub fn save(&self, record: &BackendRecord) -> Result<(), StateError> {
        write_atomic(&self.dir, record.model.as_str(), record)
    }

    /// Removes the record of `model`, if any.
    pub fn remove(&self, model: &ModelId) -> Result<(), StateError> {
        remove_file(self.dir.join(format!("{model}.json")))
    }

    /// Every readable record whose file is named after its model.
    pub fn load_all(&self) -> Vec<BackendRecord> {
        load_dir::<BackendRecord>(&self.dir)
            .into_iter()
            .filter_map(|(stem, r)| (stem == r.model.as_str()).then_some(r))
            .collect()
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
            agent_uid: Some(64003),
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
