//! The gateway's state: every task's usage and budget, so a restart loses no money. The
//! gateway keeps its own directory, `state/gateway/`, because the launcher (root) keeps its
//! state beside it, in a directory the service user cannot touch.
//!
//! Two slot files, `gateway.state.0` and `gateway.state.1`, written in turn and in place: a
//! save overwrites the slot that does not hold the newest record, with one `pwrite` and one
//! `fdatasync`, and never touches the other. A record is one header line,
//! `agentbox-gateway-state <seq> <len> <sum>`, then `len` bytes of the JSON snapshot (bytes
//! past them are a longer record's leftovers, ignored); `<sum>` is the xxh3-64, in hex, of
//! `"<seq> <len>\n"` and the body. A crash in the middle of a save leaves that slot failing
//! its checksum and the other one whole, so a load takes the whole record with the highest
//! `seq`: the old state or the new one, never half of either.
//! Both slots holding bytes and neither a whole record is not what one crash leaves; the
//! gateway refuses to start then, which is safer than resetting every task's spend to zero.
//!
//! Why slots and not a temp file renamed into place (the format before, `gateway.json`): that
//! is a new inode, its blocks, the directory's block and two `fsync`s on every save, most of
//! the save's cost (BENCHMARKS.md, "The gateway's state in two slots"). A `gateway.json` left
//! by an older gateway is read while no slot holds a record, and removed after the first save.
//!
//! What a crash (SIGKILL, power loss) costs: the writer runs after a settlement, at most once
//! per [`SAVE_INTERVAL`] (every settlement of that interval goes into one write), so the state
//! lags the ledger by at most the settlements of the last interval and the write under way;
//! requests in flight at the crash were only reserved, in memory, and are never billed. A task
//! can overshoot its budget by those, once per crash. Nothing is ever counted twice.
//! `tests/tests/faults.rs` pins this. Control operations (open, close, budget changes) are
//! written before they answer, whatever the interval; an open whose write fails is taken back.
//! A failed write is tried again every [`SAVE_RETRY`] until one succeeds.
//!
//! Why an interval: a write is an `fdatasync`, and under load settlements come much faster
//! than a disk wants them; at 50 ms there are at most 20 writes a second, however many
//! requests settle.

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use crate::ledger::Snapshot;

/// The current format version.
pub const VERSION: u32 = 1;

/// The shortest time between two writes of the state after settlements: the crash window.
pub const SAVE_INTERVAL: std::time::Duration = std::time::Duration::from_millis(50);

/// How long after a failed write (a full or failing disk) the writer tries again, whether or
/// not anything settles meanwhile.
pub const SAVE_RETRY: std::time::Duration = std::time::Duration::from_secs(1);

/// What every record's header line starts with.
pub const MAGIC: &str = "agentbox-gateway-state";

/// The slot files' names, in `state/gateway/`.
pub const SLOTS: [&str; 2] = ["gateway.state.0", "gateway.state.1"];

/// The state file of gateways before the slots.
const LEGACY: &str = "gateway.json";

/// The most of a slot (or of the old file) read: far past any real state (a task takes ~400
/// bytes), and a bound on what a damaged file can make the gateway allocate at start.
pub const STATE_MAX: u64 = 256 << 20;

/// The longest header line read: the magic, a `u64`, a length and 16 hex digits fit well
/// within it.
const HEADER_MAX: usize = 160;

/// Where the state lives.
#[derive(Debug, Clone)]
pub struct Store {
    dir: PathBuf,
    /// One save (or load) at a time: the slot to write and the sequence number are decided and
    /// advanced under it.
    slots: Arc<Mutex<Slots>>,
    /// Saves still to fail, for the tests of what a failed save leaves.
    #[cfg(test)]
    pub(crate) fail_saves: Arc<std::sync::atomic::AtomicU32>,
}

#[derive(Debug)]
struct Slots {
    files: [File; 2],
    /// The newest whole record's sequence number (0: none yet).
    seq: u64,
    /// The slot holding it; the next save goes to the other one.
    newest: Option<usize>,
    /// A `gateway.json` from before the slots is still there, to be removed after a save.
    legacy: bool,
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
    /// The state is not one we understand; refusing to start is safer than resetting every
    /// task's spend to zero.
    #[error("{path}: not a valid gateway state: {reason}")]
    Corrupt {
        /// The file (the state's directory when both slots are at fault).
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
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

/// What one slot holds.
enum SlotRecord<'a> {
    /// Nothing ever written.
    Empty,
    /// A whole record.
    Whole { seq: u64, body: &'a [u8] },
    /// Bytes that are not a whole record: a save cut short, or damage.
    Broken(String),
}

/// Reads the record in a slot's bytes.
fn parse_slot(bytes: &[u8]) -> SlotRecord<'_> {
    if bytes.is_empty() {
        return SlotRecord::Empty;
    }
    let head = &bytes[..bytes.len().min(HEADER_MAX)];
    let Some(nl) = head.iter().position(|&b| b == b'\n') else {
        return SlotRecord::Broken("no header line".into());
    };
    let Ok(line) = std::str::from_utf8(&head[..nl]) else {
        return SlotRecord::Broken("header is not UTF-8".into());
    };
    let mut words = line.split(' ');
    let (Some(MAGIC), Some(seq), Some(len), Some(sum), None) = (
        words.next(),
        words.next(),
        words.next(),
        words.next(),
        words.next(),
    ) else {
        return SlotRecord::Broken(format!("not a record header: {line:?}"));
    };
    let (Ok(seq), Ok(len)) = (seq.parse::<u64>(), len.parse::<usize>()) else {
        return SlotRecord::Broken(format!("not a record header: {line:?}"));
    };
    let rest = &bytes[nl + 1..];
    let Some(body) = rest.get(..len) else {
        return SlotRecord::Broken(format!("{} of {len} bytes", rest.len()));
    };
    if checksum(seq, body) != sum {
        return SlotRecord::Broken("checksum mismatch".into());
    }
    SlotRecord::Whole { seq, body }
}

/// A record's checksum: of its sequence number and length as well as its body, so a save cut
/// short after the new header's first bytes cannot pass the old body off under a new number.
/// It detects a torn write, not an attacker (the directory is the service user's own), so a
/// fast 64-bit hash: SHA-256 cost a save of 1,000 tasks (400 KB) a third more CPU than the
/// whole write (BENCHMARKS.md, "The gateway's state in two slots").
fn checksum(seq: u64, body: &[u8]) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(format!("{seq} {}\n", body.len()).as_bytes());
    h.update(body);
    format!("{:016x}", h.digest())
}

/// A snapshot's text, checked for a version this gateway understands.
fn parse_snapshot(path: &Path, text: &[u8]) -> Result<Snapshot, StoreError> {
    let snap: Snapshot = serde_json::from_slice(text).map_err(|e| StoreError::Corrupt {
        path: path.to_owned(),
        reason: e.to_string(),
    })?;
    if snap.version > VERSION {
        return Err(StoreError::Version {
            path: path.to_owned(),
            found: snap.version,
        });
    }
    Ok(snap)
}

fn empty() -> Snapshot {
    Snapshot {
        version: VERSION,
        ..Snapshot::default()
    }
}

impl Store {
    /// The store under `<data_dir>/state/gateway/` (created mode 0700 if missing; `state/`
    /// itself, if the gateway has to create it, 0755 so the launcher's directory can sit
    /// beside ours), its slot files created (0600) if missing, and the state it holds (see
    /// [`Store::load`]). The store knows where the newest record is, so a save never
    /// overwrites it.
    pub fn open(data_dir: &Path) -> Result<(Store, Snapshot), StoreError> {
        use std::os::unix::fs::DirBuilderExt;
        let dir = data_dir.join("state").join("gateway");
        let io = |path: &Path| {
            let path = path.to_owned();
            move |source| StoreError::Io { path, source }
        };
        for (path, mode) in [(data_dir.join("state"), 0o755), (dir.clone(), 0o700)] {
            match std::fs::DirBuilder::new().mode(mode).create(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(&path)(e)),
            }
        }
        let open_slot = |name: &str| {
            let path = dir.join(name);
            std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .mode(0o600)
                .custom_flags(rustix::fs::OFlags::NOFOLLOW.bits() as i32)
                .open(&path)
                .map_err(io(&path))
        };
        let files = [open_slot(SLOTS[0])?, open_slot(SLOTS[1])?];
        // The slots' names, when just created, last past a crash.
        sync_dir(&dir)?;
        let store = Store {
            slots: Arc::new(Mutex::new(Slots {
                files,
                seq: 0,
                newest: None,
                legacy: false,
            })),
            dir,
            #[cfg(test)]
            fail_saves: Arc::default(),
        };
        let snap = store.load()?;
        Ok((store, snap))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        // Every field is set only after the write it describes succeeded: a panic halfway
        // left nothing the next save would trust.
        self.slots.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Loads the newest whole record; with none, a `gateway.json` from before the slots; with
    /// neither, an empty state.
    pub fn load(&self) -> Result<Snapshot, StoreError> {
        let mut slots = self.lock();
        let mut newest: Option<(u64, usize, Vec<u8>)> = None;
        let mut broken = Vec::new();
        for (i, file) in slots.files.iter().enumerate() {
            let path = self.dir.join(SLOTS[i]);
            let bytes = read_capped(file, STATE_MAX).map_err(|source| StoreError::Io {
                path: path.clone(),
                source,
            })?;
            // The shared offset is the next read's start: back to the beginning.
            std::io::Seek::rewind(&mut &*file).map_err(|source| StoreError::Io {
                path: path.clone(),
                source,
            })?;
            let record = match &bytes {
                Some(b) => parse_slot(b),
                None => SlotRecord::Broken(format!("larger than {STATE_MAX} bytes")),
            };
            match record {
                SlotRecord::Empty => {}
                SlotRecord::Broken(why) => broken.push(format!("{}: {why}", SLOTS[i])),
                SlotRecord::Whole { seq, body } => {
                    if newest.as_ref().is_none_or(|(s, _, _)| seq > *s) {
                        newest = Some((seq, i, body.to_vec()));
                    }
                }
            }
        }
        if let Some((seq, i, body)) = newest {
            let snap = parse_snapshot(&self.dir.join(SLOTS[i]), &body)?;
            slots.seq = seq;
            slots.newest = Some(i);
            slots.legacy = self.dir.join(LEGACY).exists();
            return Ok(snap);
        }
        if broken.len() == SLOTS.len() {
            return Err(StoreError::Corrupt {
                path: self.dir.clone(),
                reason: format!("no whole record in either slot ({})", broken.join("; ")),
            });
        }
        // No save to a slot ever finished: the state from before the slots, or none.
        slots.seq = 0;
        slots.newest = None;
        let legacy = self.dir.join(LEGACY);
        match File::open(&legacy).and_then(|f| read_capped(&f, STATE_MAX)) {
            Ok(Some(text)) => {
                slots.legacy = true;
                parse_snapshot(&legacy, &text)
            }
            Ok(None) => Err(StoreError::Corrupt {
                path: legacy,
                reason: format!("larger than {STATE_MAX} bytes"),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                slots.legacy = false;
                Ok(empty())
            }
            Err(source) => Err(StoreError::Io {
                path: legacy,
                source,
            }),
        }
    }

    /// Writes the snapshot as the newest record, into the slot that does not hold the one
    /// before it.
    pub fn save(&self, snap: &Snapshot) -> Result<(), StoreError> {
        #[cfg(test)]
        {
            use std::sync::atomic::Ordering;
            let fail = self
                .fail_saves
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1));
            if fail.is_ok() {
                return Err(StoreError::Io {
                    path: self.dir.clone(),
                    source: std::io::Error::other("a failure the test asked for"),
                });
            }
        }
        // The body is written after room for the header, which goes in front of it once the
        // body's length and checksum are known: the record is one buffer, never copied.
        let mut record = vec![b' '; HEADER_MAX];
        serde_json::to_writer_pretty(&mut record, snap).map_err(|e| StoreError::Io {
            path: self.dir.clone(),
            source: std::io::Error::other(e),
        })?;
        let mut slots = self.lock();
        let seq = slots.seq + 1;
        let target = slots.newest.map_or(0, |i| 1 - i);
        let (room, body) = record.split_at_mut(HEADER_MAX);
        let header = format!("{MAGIC} {seq} {} {}\n", body.len(), checksum(seq, body));
        // At most 82 bytes (the magic, two 20-digit numbers, 16 hex digits, four separators).
        let start = HEADER_MAX - header.len();
        room[start..].copy_from_slice(header.as_bytes());
        let path = self.dir.join(SLOTS[target]);
        let file = &slots.files[target];
        file.write_all_at(&record[start..], 0)
            .and_then(|()| file.sync_data())
            .map_err(|source| StoreError::Io { path, source })?;
        slots.seq = seq;
        slots.newest = Some(target);
        if slots.legacy {
            // The slot now holds everything the old file did and more.
            let legacy = self.dir.join(LEGACY);
            match std::fs::remove_file(&legacy) {
                Ok(()) => sync_dir(&self.dir)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(StoreError::Io {
                        path: legacy,
                        source,
                    });
                }
            }
            slots.legacy = false;
        }
        Ok(())
    }
}

/// The rest of a file, or `None` when it holds more than `cap` bytes (no more than `cap + 1`
/// are read).
fn read_capped(mut file: &File, cap: u64) -> std::io::Result<Option<Vec<u8>>> {
    let mut bytes = Vec::new();
    std::io::Read::read_to_end(&mut std::io::Read::take(&mut file, cap + 1), &mut bytes)?;
    Ok((bytes.len() as u64 <= cap).then_some(bytes))
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|source| StoreError::Io {
            path: dir.to_owned(),
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::{Budget, Spent, TaskRecord, TaskState};

    fn snap(output_tokens: u64) -> Snapshot {
        let mut s = empty();
        s.tasks.insert(
            "a".into(),
            TaskRecord {
                model: "m".into(),
                token_sha256: "ab".into(),
                budget: Budget::default(),
                spent: Spent {
                    output_tokens,
                    ..Spent::default()
                },
                state: TaskState::Closed,
            },
        );
        s
    }

    fn slot(d: &Path, i: usize) -> PathBuf {
        d.join("state/gateway").join(SLOTS[i])
    }

    #[test]
    fn save_then_load() {
        let d = tempfile::tempdir().unwrap();
        let (store, state) = Store::open(d.path()).unwrap();
        assert_eq!(state, empty());
        store.save(&snap(9)).unwrap();
        assert_eq!(store.load().unwrap(), snap(9));
        assert_eq!(Store::open(d.path()).unwrap().1, snap(9));
        let names: Vec<_> = std::fs::read_dir(d.path().join("state/gateway"))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    /// Saves alternate between the slots, a reopened store goes on after the newest record,
    /// and a save never overwrites the newest record: the other slot always holds the one
    /// before it.
    #[test]
    fn saves_alternate_and_never_overwrite_the_newest() {
        let d = tempfile::tempdir().unwrap();
        let (mut store, _) = Store::open(d.path()).unwrap();
        for n in 1..=7u64 {
            store.save(&snap(n)).unwrap();
            let (newest, older) = if n % 2 == 1 { (0, 1) } else { (1, 0) };
            let read = |i| std::fs::read(slot(d.path(), i)).unwrap();
            let new_bytes = read(newest);
            let SlotRecord::Whole { seq, body } = parse_slot(&new_bytes) else {
                panic!("slot {newest} holds no record after save {n}");
            };
            assert_eq!(seq, n);
            assert_eq!(parse_snapshot(d.path(), body).unwrap(), snap(n));
            if n > 1 {
                let old_bytes = read(older);
                let SlotRecord::Whole { seq, body } = parse_slot(&old_bytes) else {
                    panic!("slot {older} lost its record at save {n}");
                };
                assert_eq!(seq, n - 1);
                assert_eq!(parse_snapshot(d.path(), body).unwrap(), snap(n - 1));
            }
            if n % 3 == 0 {
                store = Store::open(d.path()).unwrap().0;
            }
        }
        assert_eq!(Store::open(d.path()).unwrap().1, snap(7));
    }

    /// A save cut short at any byte (a crash while the slot was being written) loads as the
    /// state before it, and the next save succeeds; the whole record loads as itself.
    #[test]
    fn a_save_cut_at_any_byte_leaves_the_state_before_it() {
        // The record the cut save would have written, taken from a store of its own, at the
        // sequence number it would have had (3: slot 0, over the record of save 1).
        let other = tempfile::tempdir().unwrap();
        let (o, _) = Store::open(other.path()).unwrap();
        for n in [1, 2, 1000] {
            o.save(&snap(n)).unwrap();
        }
        let record = std::fs::read(slot(other.path(), 0)).unwrap();

        let d = tempfile::tempdir().unwrap();
        let (store, _) = Store::open(d.path()).unwrap();
        store.save(&snap(1)).unwrap();
        store.save(&snap(2)).unwrap();
        let before = std::fs::read(slot(d.path(), 0)).unwrap();
        for cut in 0..=record.len() {
            let mut torn = before.clone();
            if torn.len() < cut {
                torn.resize(cut, 0);
            }
            torn[..cut].copy_from_slice(&record[..cut]);
            std::fs::write(slot(d.path(), 0), &torn).unwrap();
            let want = if cut == record.len() {
                snap(1000)
            } else {
                snap(2)
            };
            let (reopened, state) = Store::open(d.path()).unwrap();
            assert_eq!(state, want, "cut at {cut}");
            // The slot that was being written is the next one written.
            if cut % 97 == 0 {
                reopened.save(&snap(5)).unwrap();
                assert_eq!(Store::open(d.path()).unwrap().1, snap(5));
                std::fs::write(slot(d.path(), 0), &before).unwrap();
                let s1 = std::fs::read(slot(other.path(), 1)).unwrap();
                // Slot 1 back to save 2's record (seq 2), as in `other`.
                std::fs::write(slot(d.path(), 1), s1).unwrap();
            }
        }
    }

    /// Neither slot whole while both hold bytes is not what one crash leaves: refuse, rather
    /// than start with every spend at zero.
    #[test]
    fn both_slots_broken_is_refused() {
        let d = tempfile::tempdir().unwrap();
        let (store, _) = Store::open(d.path()).unwrap();
        store.save(&snap(1)).unwrap();
        store.save(&snap(2)).unwrap();
        for i in 0..2 {
            let mut bytes = std::fs::read(slot(d.path(), i)).unwrap();
            let last = bytes.len() - 3;
            bytes[last] ^= 1;
            std::fs::write(slot(d.path(), i), bytes).unwrap();
        }
        let Err(StoreError::Corrupt { reason, .. }) = Store::open(d.path()) else {
            panic!("two damaged slots were accepted");
        };
        assert!(reason.contains("checksum"), "{reason}");
        // One damaged slot beside an empty one is a first save cut short: the empty state.
        let d = tempfile::tempdir().unwrap();
        Store::open(d.path()).unwrap();
        std::fs::write(slot(d.path(), 0), b"agentbox-gateway-state 1 9999 00\n{").unwrap();
        assert_eq!(Store::open(d.path()).unwrap().1, empty());
    }

    /// The state file of gateways before the slots is read, kept until a slot holds its
    /// content, then removed.
    #[test]
    fn a_gateway_json_from_before_the_slots_is_read_then_replaced() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("state/gateway")).unwrap();
        let legacy = d.path().join("state/gateway/gateway.json");
        std::fs::write(&legacy, serde_json::to_vec_pretty(&snap(41)).unwrap()).unwrap();
        let (store, state) = Store::open(d.path()).unwrap();
        assert_eq!(state, snap(41));
        assert!(legacy.exists(), "removed before anything replaced it");
        let mut next = store.load().unwrap();
        next.tasks.get_mut("a").unwrap().spent.output_tokens += 1;
        store.save(&next).unwrap();
        assert!(!legacy.exists());
        assert_eq!(Store::open(d.path()).unwrap().1, snap(42));
    }

    /// The state writer and control operations save concurrently: every save succeeds and
    /// the state is always whole.
    #[test]
    fn concurrent_saves_do_not_collide() {
        let d = tempfile::tempdir().unwrap();
        let (store, _) = Store::open(d.path()).unwrap();
        std::thread::scope(|scope| {
            for t in 0..8 {
                let store = &store;
                scope.spawn(move || {
                    for n in 0..50 {
                        store.save(&snap(t * 100 + n)).unwrap();
                    }
                });
            }
        });
        let last = Store::open(d.path()).unwrap().1;
        assert_eq!(last, store.load().unwrap());
    }

    #[test]
    fn reads_stop_past_the_cap() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("f");
        std::fs::write(&path, b"0123456789").unwrap();
        let f = File::open(&path).unwrap();
        assert_eq!(
            read_capped(&f, 10).unwrap().as_deref(),
            Some(&b"0123456789"[..])
        );
        let f = File::open(&path).unwrap();
        assert_eq!(read_capped(&f, 9).unwrap(), None);
        // A slot past the cap is a broken slot: beside a whole one, the whole one is loaded.
        let (store, _) = Store::open(d.path()).unwrap();
        store.save(&snap(3)).unwrap();
        let huge = File::options().write(true).open(slot(d.path(), 1)).unwrap();
        huge.set_len(STATE_MAX + 1).unwrap();
        assert_eq!(Store::open(d.path()).unwrap().1, snap(3));
    }

    #[test]
    fn corrupt_and_future_states_are_refused() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(d.path().join("state/gateway")).unwrap();
        let legacy = d.path().join("state/gateway/gateway.json");
        std::fs::write(&legacy, b"{not json").unwrap();
        assert!(matches!(
            Store::open(d.path()),
            Err(StoreError::Corrupt { .. })
        ));
        std::fs::write(&legacy, br#"{"version":99,"tasks":{}}"#).unwrap();
        assert!(matches!(
            Store::open(d.path()),
            Err(StoreError::Version { found: 99, .. })
        ));
        // The same in a slot: a whole record a newer gateway wrote.
        std::fs::remove_file(&legacy).unwrap();
        let (store, _) = Store::open(d.path()).unwrap();
        let mut future = snap(1);
        future.version = 99;
        store.save(&future).unwrap();
        assert!(matches!(
            Store::open(d.path()),
            Err(StoreError::Version { found: 99, .. })
        ));
    }
}
