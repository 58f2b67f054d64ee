//! What must survive a launcher restart.
//!
//! Runs (agents and checks under `state/agents/`, rollout slots under `state/slots/`) are kept
//! in one append-only journal per directory, `journal`: one JSON line per change (`put` a
//! record, `forget` a tid). A `save` returns only once its line is on the device (`fdatasync`),
//! and saves that arrive while a sync is under way share the next one (group commit): a save
//! costs one append and at most one `fdatasync` (a burst of 32 runs measured about one per two
//! saves), not a file creation, two fsyncs and a rename. A line torn
//! by a crash is skipped when the journal is read back; the journal is rewritten from the live
//! records (temp file, fsync, rename, fsync of the directory) at open and whenever it has grown
//! to several times their number, so it stays small and a reader never sees a half-rewritten
//! one. Records of launchers before the journal (`<tid>.json` files) are taken in at open.
//!
//! Running vLLM backends are recorded one file each under `state/backends/<model>.json`,
//! written atomically (temp file, fsync, rename, fsync of the directory): they change rarely.
//!
//! A record whose run was still active when the launcher died tells the restarted launcher to
//! hand the workspace back and report the run as `lost`. The task token is never written.

use std::collections::BTreeMap;
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
    let bytes = serde_json::to_vec_pretty(value).map_err(|e| StateError {
        path: dir.join(format!("{name}.json")),
        source: std::io::Error::other(e),
    })?;
    write_bytes_atomic(dir, &format!("{name}.json"), &bytes)
}

/// Writes `bytes` as `<dir>/<file>`: temp file, fsync, rename, fsync of the directory, so a
/// crash leaves the old file or the new one, never a torn one.
fn write_bytes_atomic(dir: &Path, file: &str, bytes: &[u8]) -> Result<(), StateError> {
    let target = dir.join(file);
    let tmp = dir.join(format!(".{file}.tmp"));
    let err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| StateError { path, source }
    };
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&tmp)
        .map_err(err(&tmp))?;
    out.write_all(bytes).map_err(err(&tmp))?;
    out.sync_all().map_err(err(&tmp))?;
    drop(out);
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

/// One change in a journal.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum Change {
    Put(Record),
    Forget(Tid),
}

/// The journal file's name in its directory.
const JOURNAL: &str = "journal";

/// The journal is rewritten once it holds this many lines and more than [`GROWTH`] times the
/// live records: a rewrite costs what the live records weigh, so it is paid at most once per
/// that many appends.
const MIN_LINES_BEFORE_REWRITE: usize = 256;
const GROWTH: usize = 4;

/// The run records of one directory (`state/agents` or `state/slots`): an append-only journal
/// with group commit (see the module header). Cheap to clone; clones share the journal.
#[derive(Debug, Clone)]
pub struct StateStore {
    journal: std::sync::Arc<Journal>,
}

#[derive(Debug)]
struct Journal {
    dir: PathBuf,
    /// The open file, the live records and the sequence numbers. Held only to append a line
    /// or read the counters, except for a rewrite (rare: see [`GROWTH`]).
    log: std::sync::Mutex<Log>,
    /// Held by the one thread syncing; the saves behind it find their line already synced or
    /// share the next sync.
    sync: std::sync::Mutex<()>,
}

#[derive(Debug)]
struct Log {
    file: std::sync::Arc<std::fs::File>,
    live: BTreeMap<Tid, Record>,
    /// Lines in the file.
    lines: usize,
    /// Sequence number of the last line appended; every line up to `synced` is on the device.
    appended: u64,
    synced: u64,
    /// `fdatasync`s made for saves since open (what group commit saves is saves − syncs).
    syncs: u64,
    /// An append failed, perhaps part-way: the next line starts with a newline of its own, so
    /// a partial line stays a line of its own (skipped when read back).
    torn: bool,
}

impl StateStore {
    /// Creates the directory (root, 0700) if needed, reads the journal (and any records of an
    /// older launcher) and rewrites it with the live records.
    pub fn open(dir: &Path) -> Result<StateStore, StateError> {
        create_dir(dir)?;
        let path = dir.join(JOURNAL);
        let mut live = BTreeMap::new();
        let mut legacy = Vec::new();
        for (stem, r) in load_dir::<Record>(dir) {
            if stem == r.tid.as_str() {
                legacy.push(stem);
                live.insert(r.tid.clone(), r);
            } else {
                tracing::warn!(file = %stem, "state record names another tid; skipped");
            }
        }
        match std::fs::read(&path) {
            Ok(bytes) => replay(&bytes, &path, &mut live),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(StateError { path, source }),
        }
        let file = rewrite(dir, &live)?;
        // Only once the journal holds them: a crash before this leaves both, which agree.
        for stem in &legacy {
            remove_file(dir.join(format!("{stem}.json")))?;
        }
        let lines = live.len();
        Ok(StateStore {
            journal: std::sync::Arc::new(Journal {
                dir: dir.to_path_buf(),
                log: std::sync::Mutex::new(Log {
                    file: std::sync::Arc::new(file),
                    live,
                    lines,
                    appended: 0,
                    synced: 0,
                    syncs: 0,
                    torn: false,
                }),
                sync: std::sync::Mutex::new(()),
            }),
        })
    }

    /// Records `record` (replacing the tid's previous one) and returns once it is on the
    /// device. Blocks: call it off the async threads.
    pub fn save(&self, record: &Record) -> Result<(), StateError> {
        let seq = self
            .journal
            .change(Change::Put(record.clone()), true, |live| {
                live.insert(record.tid.clone(), record.clone());
            })?;
        self.journal.sync_to(seq)
    }

    /// Forgets the record of `tid`, if any: one appended line, never a rewrite nor a sync, so
    /// the async threads may call it (it waits only if a save is rewriting the journal right
    /// then, which is rare). A forget lost to a crash brings back a finished run's record,
    /// which the next start restores as finished.
    pub fn remove(&self, tid: &Tid) -> Result<(), StateError> {
        let known = self.journal.lock().live.contains_key(tid);
        if !known {
            return Ok(());
        }
        self.journal
            .change(Change::Forget(tid.clone()), false, |live| {
                live.remove(tid);
            })
            .map(|_| ())
    }

    /// How many `fdatasync`s the saves since open have made (concurrent saves share one).
    pub fn syncs(&self) -> u64 {
        self.journal.lock().syncs
    }

    /// Every live record, in tid order.
    pub fn load_all(&self) -> Vec<Record> {
        self.journal.lock().live.values().cloned().collect()
    }
}

impl Journal {
    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        // The log is consistent after any panic (every change is written before the map is
        // touched), so a poisoned lock is taken as it is.
        self.log
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn path(&self) -> PathBuf {
        self.dir.join(JOURNAL)
    }

    /// Appends `change` (or, if `may_rewrite` and the journal has grown, rewrites it with the
    /// change applied) and applies it to the live records; returns the sequence number to
    /// sync to.
    fn change(
        &self,
        change: Change,
        may_rewrite: bool,
        apply: impl FnOnce(&mut BTreeMap<Tid, Record>),
    ) -> Result<u64, StateError> {
        let mut line = vec![b'\n'];
        serde_json::to_writer(&mut line, &change).map_err(|e| StateError {
            path: self.path(),
            source: std::io::Error::other(e),
        })?;
        line.push(b'\n');
        let mut log = self.lock();
        let grown = log.lines >= MIN_LINES_BEFORE_REWRITE
            && log.lines > GROWTH.saturating_mul(log.live.len().max(1));
        if may_rewrite && grown {
            let mut live = log.live.clone();
            apply(&mut live);
            // Synced by the rewrite itself: everything appended so far is in it.
            let file = rewrite(&self.dir, &live)?;
            log.file = std::sync::Arc::new(file);
            log.lines = live.len();
            log.live = live;
            log.torn = false;
            log.appended += 1;
            log.synced = log.appended;
            return Ok(log.appended);
        }
        let line = if log.torn { &line[..] } else { &line[1..] };
        if let Err(source) = (&*log.file).write_all(line) {
            log.torn = true;
            return Err(StateError {
                path: self.path(),
                source,
            });
        }
        log.torn = false;
        apply(&mut log.live);
        log.lines += 1;
        log.appended += 1;
        Ok(log.appended)
    }

    /// Returns once every line up to `seq` is on the device: at most one sync runs at a time,
    /// and the one that runs covers every line appended before it started.
    fn sync_to(&self, seq: u64) -> Result<(), StateError> {
        let _one = self
            .sync
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (file, upto) = {
            let log = self.lock();
            if log.synced >= seq {
                return Ok(());
            }
            (std::sync::Arc::clone(&log.file), log.appended)
        };
        file.sync_data().map_err(|source| StateError {
            path: self.path(),
            source,
        })?;
        let mut log = self.lock();
        log.synced = log.synced.max(upto);
        log.syncs += 1;
        Ok(())
    }
}

/// Applies the journal's lines to `live`; a line that does not parse (torn by a crash) is
/// reported and skipped.
fn replay(bytes: &[u8], path: &Path, live: &mut BTreeMap<Tid, Record>) {
    for (n, line) in bytes.split(|b| *b == b'\n').enumerate() {
        if line.is_empty() {
            continue;
        }
        match serde_json::from_slice::<Change>(line) {
            Ok(Change::Put(r)) => {
                live.insert(r.tid.clone(), r);
            }
            Ok(Change::Forget(tid)) => {
                live.remove(&tid);
            }
            Err(e) => tracing::warn!(
                path = %path.display(),
                line = n + 1,
                error = %e,
                "unreadable journal line; skipped"
            ),
        }
    }
}

/// Writes `live` as a fresh journal (temp file, fsync, rename, fsync of the directory) and
/// returns it open for appending.
fn rewrite(dir: &Path, live: &BTreeMap<Tid, Record>) -> Result<std::fs::File, StateError> {
    let mut bytes = Vec::new();
    for r in live.values() {
        serde_json::to_writer(&mut bytes, &Change::Put(r.clone())).map_err(|e| StateError {
            path: dir.join(JOURNAL),
            source: std::io::Error::other(e),
        })?;
        bytes.push(b'\n');
    }
    write_bytes_atomic(dir, JOURNAL, &bytes)?;
    let path = dir.join(JOURNAL);
    std::fs::OpenOptions::new()
        .append(true)
        .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
        .open(&path)
        .map_err(|source| StateError { path, source })
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

    fn record(tid: &str, exit_code: i32) -> Record {
        Record {
            tid: Tid::parse(tid).unwrap(),
            kind: RunKind::Agent,
            finished: Some(Final::Exited),
            outcome: Outcome {
                exit_code: Some(exit_code),
                ..Outcome::default()
            },
            workspace_gid: 7,
            agent_uid: Some(64003),
        }
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut n: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        n.sort();
        n
    }

    fn lines(dir: &Path) -> usize {
        std::fs::read(dir.join(JOURNAL))
            .unwrap()
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .count()
    }

    #[test]
    fn round_trip_across_reopen() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state/agents");
        let store = StateStore::open(&dir).unwrap();
        let (a, b) = (record("t1", 3), record("t2", 4));
        store.save(&a).unwrap();
        store.save(&b).unwrap();
        let a2 = record("t1", 5);
        store.save(&a2).unwrap();
        assert_eq!(store.load_all(), vec![a2.clone(), b.clone()]);
        store.remove(&b.tid).unwrap();
        store.remove(&b.tid).unwrap();
        assert_eq!(store.load_all(), vec![a2.clone()]);
        // Read back by another store, as a restarted launcher does.
        drop(store);
        let again = StateStore::open(&dir).unwrap();
        assert_eq!(again.load_all(), vec![a2]);
        assert_eq!(names(&dir), vec![JOURNAL.to_owned()]);
        assert_eq!(
            lines(&dir),
            1,
            "the reopened journal holds only the live record"
        );
    }

    #[test]
    fn a_torn_line_is_skipped_and_the_rest_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state/agents");
        let store = StateStore::open(&dir).unwrap();
        let (a, b) = (record("t1", 1), record("t2", 2));
        store.save(&a).unwrap();
        store.save(&b).unwrap();
        drop(store);
        // A crash in the middle of an append: half a line, no newline.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.join(JOURNAL))
            .unwrap();
        f.write_all(br#"{"put":{"tid":"t3","kind":"ag"#).unwrap();
        drop(f);
        let again = StateStore::open(&dir).unwrap();
        assert_eq!(again.load_all(), vec![a.clone(), b.clone()]);
        // The torn tail is gone, so later appends are whole lines.
        let c = record("t3", 3);
        again.save(&c).unwrap();
        drop(again);
        let third = StateStore::open(&dir).unwrap();
        assert_eq!(third.load_all(), vec![a, b, c]);
    }

    #[test]
    fn after_a_failed_append_the_next_line_stands_alone() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state/agents");
        let store = StateStore::open(&dir).unwrap();
        let (a, b, c) = (record("t1", 1), record("t2", 2), record("t3", 3));
        store.save(&a).unwrap();
        // What a write cut short (a full disk) leaves: part of a line, and the store told so.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(dir.join(JOURNAL))
            .unwrap();
        f.write_all(br#"{"put":{"tid":"t9""#).unwrap();
        drop(f);
        store.journal.lock().torn = true;
        store.save(&b).unwrap();
        store.save(&c).unwrap();
        drop(store);
        assert_eq!(StateStore::open(&dir).unwrap().load_all(), vec![a, b, c]);
    }

    #[test]
    fn records_of_an_older_launcher_are_taken_in() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state/agents");
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (record("t1", 1), record("t2", 2));
        std::fs::write(dir.join("t1.json"), serde_json::to_vec_pretty(&a).unwrap()).unwrap();
        // Corrupt, or named after another tid: skipped and left alone, as before.
        std::fs::write(dir.join("bad.json"), b"{").unwrap();
        std::fs::write(dir.join("t3.json"), serde_json::to_vec(&b).unwrap()).unwrap();
        let store = StateStore::open(&dir).unwrap();
        assert_eq!(store.load_all(), vec![a.clone()]);
        assert_eq!(names(&dir), vec!["bad.json", JOURNAL, "t3.json"]);
        drop(store);
        assert_eq!(StateStore::open(&dir).unwrap().load_all(), vec![a]);
    }

    #[test]
    fn the_journal_is_rewritten_as_it_grows() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state/agents");
        let store = StateStore::open(&dir).unwrap();
        let keep = record("keep", 0);
        store.save(&keep).unwrap();
        for round in 0..1000 {
            let r = record(&format!("r{}", round % 3), round);
            store.save(&r).unwrap();
            if round % 2 == 0 {
                store.remove(&r.tid).unwrap();
            }
            assert!(
                lines(&dir) <= MIN_LINES_BEFORE_REWRITE + 1,
                "round {round}: {} lines",
                lines(&dir)
            );
        }
        let live = store.load_all();
        drop(store);
        let again = StateStore::open(&dir).unwrap();
        assert_eq!(again.load_all(), live);
        assert!(live.contains(&keep));
        assert_eq!(names(&dir), vec![JOURNAL.to_owned()]);
    }

    #[test]
    fn concurrent_saves_all_land() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("state/agents");
        let store = StateStore::open(&dir).unwrap();
        let threads: Vec<_> = (0..32)
            .map(|i| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for round in 0..10 {
                        store.save(&record(&format!("t{i}"), round)).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        drop(store);
        let again = StateStore::open(&dir).unwrap();
        let got = again.load_all();
        assert_eq!(got.len(), 32);
        assert!(
            got.iter().all(|r| r.outcome.exit_code == Some(9)),
            "{got:?}"
        );
    }
}
