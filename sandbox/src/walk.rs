//! Handing a workspace tree to the agent uid and back, as root, without ever acting on
//! anything but the object that was checked.
//!
//! Root chowning a tree that someone else prepared is the classic way to chown `/etc/shadow`
//! (research §6), so the walk is fd-based throughout:
//! - directories are opened with `O_DIRECTORY|O_NOFOLLOW` relative to their parent's fd, and
//!   every other entry with `O_PATH|O_NOFOLLOW` (which never opens a FIFO for I/O, so it can
//!   not block, and opens a symlink itself rather than its target);
//! - a pass that changes things judges each entry by the `statx` of the handle it opened
//!   (directories reopened for reading through that handle, checked by `(dev, ino, type)`
//!   where a name was looked up twice), and changes ownership and mode through the handle
//!   (`AT_EMPTY_PATH`), never through a name that could have been swapped in between;
//! - hard-linked non-directories are refused: chowning one would also chown its other names,
//!   which may lie outside the workspace (the systemd-tmpfiles rule); device nodes are refused;
//!   nothing on another filesystem is touched;
//! - setuid, setgid and world-write bits are stripped, so no file leaves the walk as a privilege
//!   carrier for its new owner or a door for everyone;
//! - the open fds are bounded by the depth limit.
//!
//! Hand-over first scans the whole tree (entry count and depth bounded) and refuses it before
//! changing anything. Hand-back (after every agent process is dead) must leave nothing owned by
//! the agent uid, setuid/setgid or world-writable, whatever the agent built: it has no entry
//! limit (the agent could only create what its filesystem holds), and what it cannot hand back
//! safely it *removes*, by name relative to the held parent descriptor (removing a name never
//! changes the inode behind it, so this is safe whatever the name points to): hard-linked
//! non-directories not already the new owner's and harmless (chowning one would also chown its
//! other names, which may lie outside the workspace: the systemd-tmpfiles rule), device nodes,
//! and directories nested deeper than the depth limit (removed with two descriptors, by
//! hoisting their subdirectories up into the parent held at the limit). Only entries on another
//! filesystem, which the walk never touches, are left alone. The report lists at most
//! [`MAX_LISTED`] entries and counts the rest.
//!
//! [`visit`] is the read-only walk for measuring a tree its owner is still changing (the disk
//! watcher, the quota tagging): same descriptor rules, but what changes under it is skipped,
//! not an error, and depth is followed through file handles instead of descriptors.

use std::collections::HashSet;
use std::ffi::{CStr, CString};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};

use agentbox_policy::resolve::{Kind, PathIoError};
use rustix::fs::{self, AtFlags, FileType, Mode, OFlags, StatxFlags};
use rustix::io::Errno;

/// Who a tree is handed to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Owner {
    pub uid: u32,
    pub gid: u32,
}

/// Bounds on a walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WalkLimits {
    pub max_entries: u64,
    pub max_depth: usize,
}

impl Default for WalkLimits {
    fn default() -> Self {
        WalkLimits {
            max_entries: 2_000_000,
            max_depth: 256,
        }
    }
}

/// How many entries a report names; the rest are only counted.
pub const MAX_LISTED: usize = 32;

/// Mode bits no entry keeps: setuid, setgid, world-writable.
const DANGEROUS_BITS: u32 = 0o6002;

/// What a walk did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WalkReport {
    /// Entries visited, the top directory included.
    pub visited: u64,
    /// Entries whose owner or mode was changed.
    pub changed: u64,
    /// Entries (a subtree counts once) removed on hand-back because they could not be handed
    /// back safely.
    pub removed: u64,
    /// Entries removed or left alone on hand-back, with the reason (escaped relative paths);
    /// at most [`MAX_LISTED`].
    pub skipped: Vec<String>,
    /// Entries removed or left alone beyond those listed in `skipped`.
    pub unlisted: u64,
    /// What the tree occupied on disk when the walk found it, as [`crate::disk::measure`]
    /// counts it (allocated 512-byte blocks, each inode once, nothing on another filesystem),
    /// what the walk removed included: a hand-over's report is the workspace's usage at the
    /// start of the run and a hand-back's its usage at the end, with no walk of their own to
    /// measure them.
    pub bytes: u64,
}

impl WalkReport {
    /// `skipped` in one line, with the count of the unlisted ones; empty when nothing was.
    pub fn skipped_summary(&self) -> String {
        let mut s = self.skipped.join("; ");
        if self.unlisted > 0 {
            s.push_str(&format!("; and {} more", self.unlisted));
        }
        s
    }
}

/// Why a walk stopped.
#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    #[error("{path}: {reason}")]
    Refused { path: String, reason: &'static str },
    #[error("{path}: changed while being walked")]
    Changed { path: String },
    #[error("more than {0} entries")]
    TooManyEntries(u64),
    #[error(transparent)]
    Io(#[from] PathIoError),
    /// A hand-over that failed after it had begun changing owners (the tree changed between
    /// the scan and the second pass): part of the tree belongs to the new owner now.
    #[error("{0} (part of the tree was already handed over)")]
    Partial(Box<WalkError>),
}

impl WalkError {
    /// Whether the failed walk had changed anything, so the caller must hand the tree back.
    pub fn changed_anything(&self) -> bool {
        match self {
            WalkError::Partial(_) => true,
            WalkError::Refused { .. }
            | WalkError::Changed { .. }
            | WalkError::TooManyEntries(_)
            | WalkError::Io(_) => false,
        }
    }
}

/// What the walk does with an entry it must not touch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OnBad {
    Refuse,
    Skip,
}

/// Whether the walk only checks or also changes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Scan,
    Apply,
}

/// Hands the tree under `top` (a directory handle, `O_PATH` is fine) to `to`: refuses the
/// whole tree, changing nothing, if any entry is a hard link, a device node or on another
/// filesystem; then changes every entry's owner and strips setuid/setgid bits. An error of the
/// second pass is [`WalkError::Partial`].
pub fn hand_over(
    top: BorrowedFd<'_>,
    to: Owner,
    limits: WalkLimits,
) -> Result<WalkReport, WalkError> {
    walk(top, to, limits, Pass::Scan, OnBad::Refuse)?;
    walk(top, to, limits, Pass::Apply, OnBad::Refuse).map_err(|e| WalkError::Partial(Box::new(e)))
}

/// Hands the tree back to `to`: afterwards no entry is owned by anyone else, setuid/setgid
/// or world-writable, except entries on another filesystem (left alone and reported); what
/// cannot be handed back safely is removed and reported. `limits.max_entries` does not apply
/// (a hand-back cut short would leave the rest with the agent). Call only when nothing else
/// can write the tree: every agent process must be dead.
pub fn hand_back(
    top: BorrowedFd<'_>,
    to: Owner,
    limits: WalkLimits,
) -> Result<WalkReport, WalkError> {
    walk(top, to, limits, Pass::Apply, OnBad::Skip)
}

/// Removes the entry `name` of `dir` (a directory handle that is not `O_PATH`-only is not
/// needed: any handle works) and, for a directory, the whole tree below it, by name and without
/// following a symlink, with two descriptors whatever its depth (subdirectories are hoisted into
/// `dir` under fresh `.agentbox-removing-N` names and removed in turn). A missing entry is
/// fine. Call only when nothing else can write the tree (a rollout slot's directories once its
/// sandbox is dead).
pub fn remove_tree(dir: BorrowedFd<'_>, name: &str) -> Result<(), WalkError> {
    let cname = CString::new(name).map_err(|_| io(name, "remove", Errno::INVAL))?;
    let st = match stat_at(dir, &cname) {
        Ok(st) => st,
        Err(Errno::NOENT) => return Ok(()),
        Err(e) => return Err(io(name, "stat", e)),
    };
    let mut w = Walker::new(Owner { uid: 0, gid: 0 }, Pass::Apply, OnBad::Skip, st.dev);
    w.remove(dir, &cname, &st, name)
}

/// What the walk knows of an entry: one `statx`, never following a symlink.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stat {
    pub dev: u64,
    pub ino: u64,
    pub kind: Kind,
    pub nlink: u64,
    pub uid: u32,
    pub gid: u32,
    pub mode: u32,
    /// Allocated 512-byte blocks (what the entry occupies on disk; a sparse file's holes take
    /// none).
    pub blocks: u64,
}

fn stat_of(stx: &fs::Statx) -> Result<Stat, Errno> {
    let raw = u32::from(stx.stx_mode);
    let kind = match FileType::from_raw_mode(raw) {
        FileType::Directory => Kind::Dir,
        FileType::RegularFile => Kind::File,
        FileType::Symlink => Kind::Symlink,
        FileType::Socket => Kind::Socket,
        FileType::Fifo => Kind::Fifo,
        FileType::CharacterDevice => Kind::CharDev,
        FileType::BlockDevice => Kind::BlockDev,
        FileType::Unknown => return Err(Errno::INVAL),
    };
    Ok(Stat {
        dev: fs::makedev(stx.stx_dev_major, stx.stx_dev_minor),
        ino: stx.stx_ino,
        kind,
        nlink: u64::from(stx.stx_nlink),
        uid: stx.stx_uid,
        gid: stx.stx_gid,
        mode: raw & 0o7777,
        blocks: stx.stx_blocks,
    })
}

fn stat_at(dir: BorrowedFd<'_>, name: &CStr) -> Result<Stat, Errno> {
    let stx = fs::statx(
        dir,
        name,
        AtFlags::SYMLINK_NOFOLLOW,
        StatxFlags::BASIC_STATS,
    )?;
    stat_of(&stx)
}

fn stat_fd(fd: BorrowedFd<'_>) -> Result<Stat, Errno> {
    let stx = fs::statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS)?;
    stat_of(&stx)
}

/// One open directory and the names still to visit in it.
struct Frame {
    fd: OwnedFd,
    names: Vec<CString>,
    next: usize,
    path: String,
    depth: usize,
}

impl Frame {
    fn new(fd: OwnedFd, names: Vec<CString>, path: String, depth: usize) -> Frame {
        Frame {
            fd,
            names,
            next: 0,
            path,
            depth,
        }
    }
}

/// `op` failed at `path`.
fn io(path: &str, op: &'static str, source: Errno) -> WalkError {
    PathIoError::new(path, op, source).into()
}

fn read_names(dir: BorrowedFd<'_>, path: &str) -> Result<Vec<CString>, WalkError> {
    let mut reader = fs::Dir::read_from(dir).map_err(|e| io(path, "opendir", e))?;
    let mut names = Vec::new();
    while let Some(entry) = reader.read() {
        let entry = entry.map_err(|e| io(path, "readdir", e))?;
        let name = entry.file_name();
        if name.to_bytes() == b"." || name.to_bytes() == b".." {
            continue;
        }
        names.push(name.to_owned());
    }
    Ok(names)
}

fn child_path(parent: &str, name: &CStr) -> String {
    let shown = format!("{:?}", String::from_utf8_lossy(name.to_bytes()));
    let shown = shown.trim_matches('"');
    if parent.is_empty() {
        shown.to_owned()
    } else {
        format!("{parent}/{shown}")
    }
}

struct Walker {
    to: Owner,
    pass: Pass,
    on_bad: OnBad,
    root_dev: u64,
    report: WalkReport,
    /// Names given to hoisted directories, to keep them unique.
    hoisted: u64,
    /// Hard-linked inodes already counted in `report.bytes`.
    linked: HashSet<(u64, u64)>,
}

impl Walker {
    fn new(to: Owner, pass: Pass, on_bad: OnBad, root_dev: u64) -> Walker {
        Walker {
            to,
            pass,
            on_bad,
            root_dev,
            report: WalkReport::default(),
            hoisted: 0,
            linked: HashSet::new(),
        }
    }

    /// Counts what `st` occupies into `report.bytes`, a hard-linked inode once (also when the
    /// walk removed its other names before it met this one, leaving it one link).
    fn count(&mut self, st: &Stat) {
        if st.kind != Kind::Dir {
            let id = (st.dev, st.ino);
            let counted = if st.nlink > 1 {
                !self.linked.insert(id)
            } else {
                !self.linked.is_empty() && self.linked.contains(&id)
            };
            if counted {
                return;
            }
        }
        self.report.bytes = self
            .report
            .bytes
            .saturating_add(st.blocks.saturating_mul(512));
    }

    /// Whether nothing but this walk can change the tree: only a hand-back (every agent process
    /// is dead) and the removal of a dead slot's tree. A hand-over races the service user,
    /// who owns every name until the walk changes it.
    fn quiescent(&self) -> bool {
        match self.on_bad {
            OnBad::Skip => true,
            OnBad::Refuse => false,
        }
    }
    fn note(&mut self, path: &str, what: &str) {
        tracing::warn!(path, what, "while handing a workspace back");
        if self.report.skipped.len() < MAX_LISTED {
            self.report.skipped.push(format!("{path}: {what}"));
        } else {
            self.report.unlisted += 1;
        }
    }

    /// An entry the walk must not hand over: refused on hand-over; on hand-back left alone
    /// (`remove: None`) or removed by name from the directory `remove` holds.
    fn bad(
        &mut self,
        path: &str,
        reason: &'static str,
        remove: Option<(BorrowedFd<'_>, &CStr, &Stat)>,
    ) -> Result<(), WalkError> {
        match self.on_bad {
            OnBad::Refuse => Err(WalkError::Refused {
                path: path.to_owned(),
                reason,
            }),
            OnBad::Skip => {
                match remove {
                    None => self.note(path, &format!("left alone: {reason}")),
                    Some((dir, name, st)) => {
                        self.remove(dir, name, st, path)?;
                        self.report.removed += 1;
                        self.note(path, &format!("removed: {reason}"));
                    }
                }
                Ok(())
            }
        }
    }

    /// Removes the entry `name` of `dir` (a whole subtree for a directory), counting what lies
    /// below it into `report.bytes` (the caller counted `st`). Only names are removed, never an
    /// inode changed, so a name swapped in meanwhile costs its swapper that name and nothing
    /// else.
    fn remove(
        &mut self,
        dir: BorrowedFd<'_>,
        name: &CStr,
        st: &Stat,
        path: &str,
    ) -> Result<(), WalkError> {
        if st.kind != Kind::Dir {
            return match fs::unlinkat(dir, name, AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => Ok(()),
                Err(e) => Err(io(path, "unlink", e)),
            };
        }
        // A tree of any depth with two descriptors: empty one directory at a time, moving its
        // subdirectories up into `dir` under fresh names and queueing them.
        let mut queue: Vec<(CString, (u64, u64))> = vec![(name.to_owned(), (st.dev, st.ino))];
        while let Some((name, (dev, ino))) = queue.pop() {
            let fd = match fs::openat(
                dir,
                name.as_c_str(),
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            ) {
                Ok(fd) => fd,
                Err(Errno::NOENT) => continue,
                Err(Errno::NOTDIR | Errno::LOOP) => {
                    return Err(WalkError::Changed {
                        path: path.to_owned(),
                    });
                }
                Err(e) => return Err(io(path, "open", e)),
            };
            let opened = stat_fd(fd.as_fd()).map_err(|e| io(path, "stat", e))?;
            if opened.dev != dev || opened.ino != ino {
                return Err(WalkError::Changed {
                    path: path.to_owned(),
                });
            }
            for entry in read_names(fd.as_fd(), path)? {
                let est = match stat_at(fd.as_fd(), &entry) {
                    Ok(st) => st,
                    Err(Errno::NOENT) => continue,
                    Err(e) => return Err(io(path, "stat", e)),
                };
                if est.dev == self.root_dev {
                    self.count(&est);
                }
                if est.kind != Kind::Dir {
                    match fs::unlinkat(fd.as_fd(), entry.as_c_str(), AtFlags::empty()) {
                        Ok(()) | Err(Errno::NOENT) => continue,
                        Err(e) => return Err(io(path, "unlink", e)),
                    }
                }
                loop {
                    let hoisted = CString::new(format!(".agentbox-removing-{}", self.hoisted))
                        .map_err(|_| io(path, "rename", Errno::INVAL))?;
                    self.hoisted += 1;
                    match fs::renameat_with(
                        fd.as_fd(),
                        entry.as_c_str(),
                        dir,
                        hoisted.as_c_str(),
                        fs::RenameFlags::NOREPLACE,
                    ) {
                        Ok(()) => {
                            queue.push((hoisted, (est.dev, est.ino)));
                            break;
                        }
                        Err(Errno::EXIST) => continue,
                        Err(Errno::NOENT) => break,
                        Err(e) => return Err(io(path, "rename", e)),
                    }
                }
            }
            match fs::unlinkat(dir, name.as_c_str(), AtFlags::REMOVEDIR) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(io(path, "rmdir", e)),
            }
        }
        Ok(())
    }

    /// Changes owner and strips setuid/setgid through `fd`. `readable` says whether `fd` is a
    /// real (non-`O_PATH`) descriptor, on which `fchmod` works.
    /// An error names the operation that failed; the caller adds the path, which most entries
    /// never need formatted.
    fn apply(
        &mut self,
        fd: BorrowedFd<'_>,
        st: &Stat,
        readable: bool,
    ) -> Result<(), (&'static str, Errno)> {
        if self.pass == Pass::Scan {
            return Ok(());
        }
        let mut changed = false;
        if st.uid != self.to.uid || st.gid != self.to.gid {
            fs::chownat(
                fd,
                "",
                Some(fs::Uid::from_raw(self.to.uid)),
                Some(fs::Gid::from_raw(self.to.gid)),
                AtFlags::EMPTY_PATH,
            )
            .map_err(|e| ("chown", e))?;
            changed = true;
        }
        // A symlink's mode means nothing (and chmod through its magic link is not to be
        // trusted), so it is left as it is. The kernel clears some of the bits on chown, not
        // all (setgid without group execute stays), and chown never sets one, so the mode read
        // before it tells what is left to strip, unless its old owner could change the mode in
        // between: then look again.
        if st.kind != Kind::Symlink {
            let mode_now = if changed && !self.quiescent() {
                stat_fd(fd).map_err(|e| ("stat", e))?.mode
            } else {
                st.mode
            };
            if mode_now & DANGEROUS_BITS != 0 {
                let mode = Mode::from_raw_mode(mode_now & 0o7777 & !DANGEROUS_BITS);
                if readable {
                    fs::fchmod(fd, mode).map_err(|e| ("chmod", e))?;
                } else {
                    // fchmod refuses O_PATH handles; the magic link reaches the same inode
                    // without a name lookup anyone could race.
                    let proc_path = format!("/proc/self/fd/{}", fd.as_raw_fd());
                    fs::chmodat(fs::CWD, proc_path.as_str(), mode, AtFlags::empty())
                        .map_err(|e| ("chmod", e))?;
                }
                changed = true;
            }
        }
        if changed {
            self.report.changed += 1;
        }
        Ok(())
    }

    fn same(opened: &Stat, listed: &Stat) -> bool {
        opened.dev == listed.dev && opened.ino == listed.ino && opened.kind == listed.kind
    }
}

/// Opens `name` in `dir` (never following a symlink) and checks it is still the entry listed
/// as `listed`. An entry that vanished or turned into a symlink or a non-directory since it was
/// listed is `Changed`: the walk must not act on something other than what it judged.
pub(crate) fn open_listed(
    dir: BorrowedFd<'_>,
    name: &CStr,
    flags: OFlags,
    listed: &Stat,
    path: &str,
) -> Result<(OwnedFd, Stat), WalkError> {
    let changed = || WalkError::Changed {
        path: path.to_owned(),
    };
    let fd = match fs::openat(
        dir,
        name,
        flags | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(Errno::NOTDIR | Errno::LOOP | Errno::NOENT) => return Err(changed()),
        Err(e) => return Err(io(path, "open", e)),
    };
    let opened = stat_fd(fd.as_fd()).map_err(|e| io(path, "stat", e))?;
    if !Walker::same(&opened, listed) {
        return Err(changed());
    }
    Ok((fd, opened))
}

fn walk(
    top: BorrowedFd<'_>,
    to: Owner,
    limits: WalkLimits,
    pass: Pass,
    on_bad: OnBad,
) -> Result<WalkReport, WalkError> {
    let top_stat = stat_fd(top).map_err(|e| io(".", "stat", e))?;
    if top_stat.kind != Kind::Dir {
        return Err(WalkError::Refused {
            path: ".".to_owned(),
            reason: "not a directory",
        });
    }
    let top_fd = fs::openat(
        top,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| io(".", "open", e))?;
    let opened = stat_fd(top_fd.as_fd()).map_err(|e| io(".", "stat", e))?;
    if !Walker::same(&opened, &top_stat) {
        return Err(WalkError::Changed {
            path: ".".to_owned(),
        });
    }
    let mut w = Walker::new(to, pass, on_bad, top_stat.dev);
    w.report.visited = 1;
    w.count(&opened);
    w.apply(top_fd.as_fd(), &opened, true)
        .map_err(|(op, e)| io(".", op, e))?;
    let names = read_names(top_fd.as_fd(), ".")?;
    let mut stack = vec![Frame::new(top_fd, names, String::new(), 0)];
    while let Some(frame) = stack.last_mut() {
        // Taken, not cloned: each name is visited once.
        let Some(name) = frame.names.get_mut(frame.next).map(std::mem::take) else {
            stack.pop();
            continue;
        };
        frame.next += 1;
        w.report.visited += 1;
        if on_bad == OnBad::Refuse && w.report.visited > limits.max_entries {
            return Err(WalkError::TooManyEntries(limits.max_entries));
        }
        // Only errors, notes and directories need the path: most entries never format it.
        let path = |frame: &Frame| child_path(&frame.path, &name);
        let depth = frame.depth + 1;
        // The apply pass opens the entry first (`O_PATH`, which opens a symlink, FIFO or device
        // itself and never for I/O) and judges the handle's own stat: one name lookup, and what
        // it judged is what it changes. The scan only judges, by a stat of the name: opening the
        // entry would check an identity nothing acts on yet.
        let (handle, st) = match w.pass {
            Pass::Apply => match open_entry(frame.fd.as_fd(), &name) {
                Ok((fd, st)) => (Some(fd), st),
                // Vanished since it was listed: nothing left to hand over.
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(io(&path(frame), "open", e)),
            },
            Pass::Scan => match stat_at(frame.fd.as_fd(), &name) {
                Ok(st) => (None, st),
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(io(&path(frame), "stat", e)),
            },
        };
        if st.dev != w.root_dev {
            w.bad(&path(frame), "on another filesystem", None)?;
            continue;
        }
        w.count(&st);
        // This entry, for `Walker::bad` to remove when it refuses it.
        let entry = Some((frame.fd.as_fd(), name.as_c_str(), &st));
        match st.kind {
            Kind::Dir => {
                let path = path(frame);
                if depth > limits.max_depth {
                    w.bad(&path, "nested too deeply", entry)?;
                    continue;
                }
                let (fd, opened) = match handle {
                    // The handle's own directory, reopened for reading: no name is looked up
                    // again, so nothing can be swapped in.
                    Some(handle) => (
                        fs::openat(
                            &handle,
                            c".",
                            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                            Mode::empty(),
                        )
                        .map_err(|e| io(&path, "open", e))?,
                        st,
                    ),
                    None => open_listed(
                        frame.fd.as_fd(),
                        &name,
                        OFlags::RDONLY | OFlags::DIRECTORY,
                        &st,
                        &path,
                    )?,
                };
                w.apply(fd.as_fd(), &opened, true)
                    .map_err(|(op, e)| io(&path, op, e))?;
                let names = read_names(fd.as_fd(), &path)?;
                stack.push(Frame::new(fd, names, path, depth));
            }
            Kind::File | Kind::Symlink | Kind::Fifo | Kind::Socket => {
                if st.nlink > 1 {
                    // Already the new owner's and harmless: nothing to hand back.
                    let harmless = st.uid == to.uid
                        && st.gid == to.gid
                        && (st.kind == Kind::Symlink || st.mode & DANGEROUS_BITS == 0);
                    if on_bad == OnBad::Refuse || !harmless {
                        w.bad(&path(frame), "has more than one hard link", entry)?;
                    }
                    continue;
                }
                if let Some(handle) = handle {
                    w.apply(handle.as_fd(), &st, false)
                        .map_err(|(op, e)| io(&path(frame), op, e))?;
                }
            }
            Kind::CharDev | Kind::BlockDev => {
                w.bad(&path(frame), "is a device node", entry)?;
            }
        }
    }
    Ok(w.report)
}

/// Opens `name` in `dir` as an `O_PATH` handle, never following a symlink, and stats the handle.
fn open_entry(dir: BorrowedFd<'_>, name: &CStr) -> Result<(OwnedFd, Stat), Errno> {
    let fd = fs::openat(
        dir,
        name,
        OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    let st = stat_fd(fd.as_fd())?;
    Ok((fd, st))
}

/// One entry met by [`visit`].
#[derive(Debug)]
pub struct Seen<'a> {
    /// The directory holding the entry (for the top directory, the top itself).
    pub parent: BorrowedFd<'a>,
    /// Its name in `parent` (`.` for the top).
    pub name: &'a CStr,
    /// For a directory: the descriptor the walk lists it through (opened `O_RDONLY`, checked
    /// to be the entry listed).
    pub dir: Option<BorrowedFd<'a>>,
    /// The escaped path of `parent` relative to the top (for a top, its own path); see
    /// [`Seen::path`].
    pub parent_path: &'a str,
    pub stat: Stat,
}

impl Seen<'_> {
    /// Escaped, relative to the top (`.` for the top). Formatted on demand: most visits never
    /// need it.
    pub fn path(&self) -> String {
        if self.name == c"." {
            if self.parent_path.is_empty() {
                ".".to_owned()
            } else {
                self.parent_path.to_owned()
            }
        } else if self.parent_path.len() > MAX_SHOWN_PATH {
            self.parent_path.to_owned()
        } else {
            child_path(self.parent_path, self.name)
        }
    }
}

/// What [`visit`] could not see.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VisitReport {
    /// Entries shown to the visitor, the top included.
    pub visited: u64,
    /// Directories nested deeper than the depth limit that could not be visited later (their
    /// filesystem gives no file handles, or too many were waiting): neither shown nor
    /// entered.
    pub too_deep: u64,
    /// Entries that changed or vanished between listing and looking, or could not be looked
    /// at (skipped; a later visit sees them as they are then).
    pub skipped: u64,
    /// The walk stopped at `max_entries`: what is left was not seen.
    pub truncated: bool,
}

/// Where a path shown by [`visit`] stops growing (a tree may be nested without bound).
const MAX_SHOWN_PATH: usize = 256;
/// Most directories past the depth limit [`visit`] keeps for later; more are counted as
/// `too_deep` (no legitimate tree has that many, and each costs the launcher memory).
const MAX_DEFERRED: usize = 65_536;

/// Visits every entry under `top` (a directory handle; `O_PATH` is fine) read-only, with the
/// same rules as the hand-over (directories opened relative to their parent with `O_NOFOLLOW`
/// and checked by `(dev, ino, type)`, no symlink followed, nothing on another filesystem
/// entered), but made for a tree that its owner is changing meanwhile: an entry that vanished,
/// changed or cannot be looked at is skipped and counted, never an error. The cost is bounded:
/// at most `max_entries` entries are listed, after which the walk stops and says so, and at
/// most `max_depth` directory descriptors are open at once. A directory deeper than that is
/// not lost: its file handle is kept (`name_to_handle_at`, no descriptor) and it is visited
/// afterwards as a new top, reopened with `open_by_handle_at` and checked by `(dev, ino)`, so
/// depth costs neither descriptors nor a path lookup. Only a top that is not a directory or
/// cannot be opened is an error.
pub fn visit(
    top: BorrowedFd<'_>,
    limits: WalkLimits,
    mut visitor: impl FnMut(&Seen<'_>),
) -> Result<VisitReport, WalkError> {
    let io = |op, source| WalkError::from(PathIoError::new(".", op, source));
    let top_stat = stat_fd(top).map_err(|e| io("stat", e))?;
    if top_stat.kind != Kind::Dir {
        return Err(WalkError::Refused {
            path: ".".to_owned(),
            reason: "not a directory",
        });
    }
    let (top_fd, top_stat) = open_listed(
        top,
        c".",
        OFlags::RDONLY | OFlags::DIRECTORY,
        &top_stat,
        ".",
    )?;
    let mut report = VisitReport {
        visited: 1,
        ..VisitReport::default()
    };
    visitor(&Seen {
        parent: top_fd.as_fd(),
        name: c".",
        dir: Some(top_fd.as_fd()),
        parent_path: "",
        stat: top_stat,
    });
    let mut listed: u64 = 0;
    // Directories past the depth limit, to visit as tops of their own: handle, identity, path.
    let mut deferred: Vec<(handle::Handle, Stat, String)> = Vec::new();
    let first = top_fd
        .try_clone()
        .map_err(|e| io("dup", Errno::from_io_error(&e).unwrap_or(Errno::IO)))?;
    let mut next: Option<(OwnedFd, String)> = Some((first, String::new()));
    while let Some((fd, path)) = next.take() {
        match read_names_bounded(fd.as_fd(), limits.max_entries, &mut listed) {
            None => report.skipped += 1,
            Some(names) => {
                report.truncated |= listed >= limits.max_entries;
                let mut stack = vec![Frame::new(fd, names, path, 0)];
                visit_stack(
                    &mut stack,
                    limits,
                    top_stat.dev,
                    &mut listed,
                    &mut report,
                    &mut deferred,
                    &mut visitor,
                );
            }
        }
        while next.is_none() && !report.truncated {
            let Some((mut h, want, path)) = deferred.pop() else {
                break;
            };
            match handle::open_dir(top_fd.as_fd(), &mut h) {
                Ok(fd) if stat_fd(fd.as_fd()).is_ok_and(|st| Walker::same(&st, &want)) => {
                    report.visited += 1;
                    visitor(&Seen {
                        parent: fd.as_fd(),
                        name: c".",
                        dir: Some(fd.as_fd()),
                        parent_path: &path,
                        stat: want,
                    });
                    next = Some((fd, path));
                }
                // Gone, or no longer that directory.
                Ok(_) | Err(_) => report.skipped += 1,
            }
        }
    }
    Ok(report)
}

/// The depth-first part of [`visit`], from one top.
fn visit_stack(
    stack: &mut Vec<Frame>,
    limits: WalkLimits,
    dev: u64,
    listed: &mut u64,
    report: &mut VisitReport,
    deferred: &mut Vec<(handle::Handle, Stat, String)>,
    visitor: &mut impl FnMut(&Seen<'_>),
) {
    while let Some(frame) = stack.last_mut() {
        let Some(name) = frame.names.get_mut(frame.next).map(std::mem::take) else {
            stack.pop();
            continue;
        };
        frame.next += 1;
        let depth = frame.depth + 1;
        let Ok(st) = stat_at(frame.fd.as_fd(), &name) else {
            report.skipped += 1;
            continue;
        };
        if st.dev != dev {
            report.skipped += 1;
            continue;
        }
        if st.kind != Kind::Dir {
            report.visited += 1;
            visitor(&Seen {
                parent: frame.fd.as_fd(),
                name: &name,
                dir: None,
                parent_path: &frame.path,
                stat: st,
            });
            continue;
        }
        let path = if frame.path.len() > MAX_SHOWN_PATH {
            frame.path.clone()
        } else {
            child_path(&frame.path, &name)
        };
        if depth > limits.max_depth {
            match handle::of(frame.fd.as_fd(), &name) {
                Ok(h) if deferred.len() < MAX_DEFERRED => deferred.push((h, st, path)),
                Ok(_) | Err(_) => report.too_deep += 1,
            }
            continue;
        }
        let Ok((fd, opened)) = open_listed(
            frame.fd.as_fd(),
            &name,
            OFlags::RDONLY | OFlags::DIRECTORY,
            &st,
            &path,
        ) else {
            report.skipped += 1;
            continue;
        };
        report.visited += 1;
        visitor(&Seen {
            parent: frame.fd.as_fd(),
            name: &name,
            dir: Some(fd.as_fd()),
            parent_path: &frame.path,
            stat: opened,
        });
        if report.truncated {
            continue;
        }
        let Some(names) = read_names_bounded(fd.as_fd(), limits.max_entries, listed) else {
            report.skipped += 1;
            continue;
        };
        report.truncated |= *listed >= limits.max_entries;
        stack.push(Frame::new(fd, names, path, depth));
    }
}

/// File handles (`name_to_handle_at`/`open_by_handle_at`): a directory kept without a
/// descriptor and reopened later without a path. Reopening needs `CAP_DAC_READ_SEARCH`, which
/// the launcher keeps.
mod handle {
    use std::ffi::CStr;
    use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

    use rustix::io::Errno;

    /// `MAX_HANDLE_SZ` of `linux/exportfs.h`.
    const MAX_HANDLE_SZ: usize = 128;

    /// `struct file_handle` with room for the largest handle.
    #[repr(C)]
    pub struct Handle {
        bytes: u32,
        kind: i32,
        data: [u8; MAX_HANDLE_SZ],
    }

    fn last_errno() -> Errno {
        Errno::from_raw_os_error(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    }

    /// The handle of `name` in `dir` (a symlink is not followed).
    pub fn of(dir: BorrowedFd<'_>, name: &CStr) -> Result<Handle, Errno> {
        let mut h = Handle {
            bytes: MAX_HANDLE_SZ as u32,
            kind: 0,
            data: [0; MAX_HANDLE_SZ],
        };
        let mut mount_id: libc::c_int = 0;
        // SAFETY: `h` is a `struct file_handle` whose `handle_bytes` says how much room follows
        // the header (exactly what the array holds); `name` is NUL-terminated; both outlive the
        // call.
        let r = unsafe {
            libc::name_to_handle_at(
                dir.as_raw_fd(),
                name.as_ptr(),
                std::ptr::from_mut(&mut h).cast::<libc::file_handle>(),
                &raw mut mount_id,
                0,
            )
        };
        if r < 0 { Err(last_errno()) } else { Ok(h) }
    }

    /// Opens the directory `h` names on the filesystem of `mount` (`O_RDONLY`, never a
    /// symlink).
    pub fn open_dir(mount: BorrowedFd<'_>, h: &mut Handle) -> Result<OwnedFd, Errno> {
        // SAFETY: `h` is a handle filled by `name_to_handle_at`, alive for the call.
        let fd = unsafe {
            libc::open_by_handle_at(
                mount.as_raw_fd(),
                std::ptr::from_mut(h).cast::<libc::file_handle>(),
                libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return Err(last_errno());
        }
        // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }
}

/// The names in `dir`, adding to `listed` and stopping once it reaches `cap`; `None` if the
/// directory cannot be read.
fn read_names_bounded(dir: BorrowedFd<'_>, cap: u64, listed: &mut u64) -> Option<Vec<CString>> {
    let mut reader = fs::Dir::read_from(dir).ok()?;
    let mut names = Vec::new();
    while *listed < cap {
        let Some(entry) = reader.read() else {
            break;
        };
        let entry = entry.ok()?;
        let name = entry.file_name();
        if name.to_bytes() == b"." || name.to_bytes() == b".." {
            continue;
        }
        *listed += 1;
        names.push(name.to_owned());
    }
    Some(names)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
    use std::path::Path;

    const AGENT: Owner = Owner {
        uid: 64123,
        gid: 64124,
    };
    const SERVICE: Owner = Owner {
        uid: 64125,
        gid: 64126,
    };

    #[test]
    fn remove_tree_removes_a_deep_tree_and_follows_no_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir(&outside).unwrap();
        std::fs::write(outside.join("keep"), b"k").unwrap();
        let top = tmp.path().join("slot");
        let mut deep = top.clone();
        for i in 0..300 {
            deep = deep.join(format!("d{i}"));
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::write(deep.join("f"), b"x").unwrap();
        symlink(&outside, top.join("link")).unwrap();
        symlink(&outside, deep.join("link")).unwrap();
        let parent = open_dir(tmp.path());
        remove_tree(parent.as_fd(), "slot").unwrap();
        assert!(!top.exists());
        assert!(outside.join("keep").exists());
        let left: Vec<_> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, vec![std::ffi::OsString::from("outside")]);
        // Missing is fine.
        remove_tree(parent.as_fd(), "slot").unwrap();
    }

    /// An `O_PATH` handle of the directory `p`, as the walks take it.
    pub(crate) fn open_dir(p: &Path) -> OwnedFd {
        fs::open(
            p,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    fn owner(p: &Path) -> (u32, u32) {
        let m = std::fs::symlink_metadata(p).unwrap();
        (m.uid(), m.gid())
    }

    fn mkfifo(p: &Path) {
        fs::mknodat(fs::CWD, p, FileType::Fifo, Mode::from_raw_mode(0o644), 0).unwrap();
    }

    #[test]
    fn hands_over_and_back_without_following() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        let outside = tmp.path().join("secret");
        std::fs::write(&outside, b"x").unwrap();
        std::fs::create_dir_all(ws.join("a/b")).unwrap();
        std::fs::write(ws.join("a/b/f"), b"hi").unwrap();
        symlink(&outside, ws.join("link")).unwrap();
        symlink("/", ws.join("a/root")).unwrap();
        mkfifo(&ws.join("fifo"));
        let suid = ws.join("a/suid");
        std::fs::write(&suid, b"#!").unwrap();
        std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o6755)).unwrap();
        let sgid_noexec = ws.join("sgid");
        std::fs::write(&sgid_noexec, b"").unwrap();
        std::fs::set_permissions(&sgid_noexec, std::fs::Permissions::from_mode(0o2644)).unwrap();
        let weird = ws.join("new\nline\u{7f}");
        std::fs::write(&weird, b"").unwrap();

        let fd = open_dir(&ws);
        let report = hand_over(fd.as_fd(), AGENT, WalkLimits::default()).unwrap();
        assert_eq!(report.visited, 10);
        assert!(report.skipped.is_empty());
        for p in [
            "", "a", "a/b", "a/b/f", "link", "a/root", "fifo", "a/suid", "sgid",
        ] {
            assert_eq!(owner(&ws.join(p)), (AGENT.uid, AGENT.gid), "{p}");
        }
        assert_eq!(owner(&weird), (AGENT.uid, AGENT.gid));
        // The symlinks themselves changed, their targets did not.
        assert_eq!(owner(&outside), (0, 0));
        assert_eq!(owner(Path::new("/")), (0, 0));
        let mode = |p: &Path| std::fs::metadata(p).unwrap().mode() & 0o7777;
        assert_eq!(mode(&suid), 0o755);
        assert_eq!(mode(&sgid_noexec), 0o644);

        std::fs::set_permissions(ws.join("a"), std::fs::Permissions::from_mode(0o2755)).unwrap();
        let report = hand_back(fd.as_fd(), SERVICE, WalkLimits::default()).unwrap();
        assert!(report.skipped.is_empty());
        assert_eq!(owner(&ws.join("a/b/f")), (SERVICE.uid, SERVICE.gid));
        assert_eq!(owner(&ws.join("link")), (SERVICE.uid, SERVICE.gid));
        assert_eq!(mode(&ws.join("a")), 0o755);
        assert_eq!(owner(&outside), (0, 0));
    }

    /// The hand-over's report is the usage the disk watcher starts from: the same bytes a
    /// separate measurement finds, sparse holes free.
    #[test]
    fn hand_over_reports_what_a_measurement_finds() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        std::fs::create_dir_all(ws.join("a/b")).unwrap();
        std::fs::write(ws.join("a/b/f"), vec![7u8; 300_000]).unwrap();
        std::fs::write(ws.join("small"), b"x").unwrap();
        let sparse = std::fs::File::create(ws.join("sparse")).unwrap();
        sparse.set_len(64 << 20).unwrap();
        symlink("a/b/f", ws.join("link")).unwrap();
        let fd = open_dir(&ws);
        let report = hand_over(fd.as_fd(), AGENT, WalkLimits::default()).unwrap();
        let usage = crate::disk::measure(fd.as_fd(), WalkLimits::default()).unwrap();
        assert_eq!(report.bytes, usage.bytes);
        assert!(
            report.bytes >= 300_000 && report.bytes < 64 << 20,
            "{report:?}"
        );
    }

    #[test]
    fn hard_links_and_devices_refused_before_any_change() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        std::fs::create_dir_all(ws.join("d")).unwrap();
        let outside = tmp.path().join("outside");
        std::fs::write(&outside, b"x").unwrap();
        std::fs::hard_link(&outside, ws.join("d/zz-hardlink")).unwrap();
        std::fs::write(ws.join("a-first"), b"x").unwrap();
        let fd = open_dir(&ws);
        let err = hand_over(fd.as_fd(), AGENT, WalkLimits::default()).unwrap_err();
        assert!(err.to_string().contains("hard link"), "{err}");
        assert!(!err.changed_anything());
        assert_eq!(owner(&ws), (0, 0));
        assert_eq!(owner(&ws.join("a-first")), (0, 0));
        assert_eq!(owner(&outside), (0, 0));

        // Hand-back skips it and changes the rest.
        let report = hand_back(fd.as_fd(), SERVICE, WalkLimits::default()).unwrap();
        assert_eq!(report.skipped.len(), 1, "{report:?}");
        assert_eq!(owner(&outside), (0, 0));
        assert_eq!(owner(&ws.join("a-first")), (SERVICE.uid, SERVICE.gid));

        // ... by removing the name, which leaves the other name's inode as it was.
        assert!(!ws.join("d/zz-hardlink").exists());
        assert_eq!(std::fs::read(&outside).unwrap(), b"x");
        fs::mknodat(
            fs::CWD,
            ws.join("d/null"),
            FileType::CharacterDevice,
            Mode::from_raw_mode(0o666),
            fs::makedev(1, 3),
        )
        .unwrap();
        let err = hand_over(fd.as_fd(), AGENT, WalkLimits::default()).unwrap_err();
        assert!(err.to_string().contains("device node"), "{err}");
    }

    /// `top/d/d/...` (`depth` times), created; returns the deepest.
    pub(crate) fn nest(top: &Path, depth: usize) -> std::path::PathBuf {
        let deep = (0..depth).fold(top.to_path_buf(), |p, _| p.join("d"));
        std::fs::create_dir_all(&deep).unwrap();
        deep
    }

    #[test]
    fn bounds() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        nest(&ws, 5);
        let fd = open_dir(&ws);
        let limits = WalkLimits {
            max_entries: 100,
            max_depth: 3,
        };
        let err = hand_over(fd.as_fd(), AGENT, limits).unwrap_err();
        assert!(err.to_string().contains("too deeply"), "{err}");
        let report = hand_back(fd.as_fd(), SERVICE, limits).unwrap();
        assert_eq!(report.skipped.len(), 1);
        let limits = WalkLimits {
            max_entries: 3,
            max_depth: 10,
        };
        assert!(matches!(
            hand_over(fd.as_fd(), AGENT, limits).unwrap_err(),
            WalkError::TooManyEntries(3)
        ));
    }

    /// The hand-back's report is the watch mode's final usage: the same bytes a measurement
    /// just before it finds, hard links once and removed trees included.
    #[test]
    fn hand_back_reports_what_a_measurement_finds_before_it() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        std::fs::create_dir_all(ws.join("a")).unwrap();
        std::fs::write(ws.join("a/big"), vec![7u8; 300_000]).unwrap();
        let sparse = std::fs::File::create(ws.join("sparse")).unwrap();
        sparse.set_len(64 << 20).unwrap();
        symlink("a/big", ws.join("link")).unwrap();
        // Hard links: one pair harmless once handed back (kept), one setuid pair (its first
        // name is removed, after which the second has one link), one pair with a name in a
        // tree removed for its depth.
        std::fs::write(ws.join("a/plain"), vec![1u8; 50_000]).unwrap();
        std::fs::hard_link(ws.join("a/plain"), ws.join("plain-too")).unwrap();
        std::fs::write(ws.join("a/suid"), vec![2u8; 70_000]).unwrap();
        std::fs::set_permissions(ws.join("a/suid"), std::fs::Permissions::from_mode(0o4755))
            .unwrap();
        std::fs::hard_link(ws.join("a/suid"), ws.join("suid-too")).unwrap();
        let deep = nest(&ws.join("deep"), 7);
        std::fs::write(deep.join("f"), vec![3u8; 90_000]).unwrap();
        std::fs::write(ws.join("deep/d/d/d/d/g"), vec![4u8; 20_000]).unwrap();
        std::fs::hard_link(ws.join("deep/d/d/d/d/g"), ws.join("g-too")).unwrap();
        chown_agent_tree(&ws);
        // The harmless pair is the service's already.
        for p in ["a/plain", "plain-too"] {
            std::os::unix::fs::lchown(ws.join(p), Some(SERVICE.uid), Some(SERVICE.gid)).unwrap();
        }
        let fd = open_dir(&ws);
        let limits = WalkLimits {
            max_entries: 1_000,
            max_depth: 4,
        };
        let usage = crate::disk::measure(fd.as_fd(), limits).unwrap();
        assert_eq!(usage.too_deep, 0, "{usage:?}");
        let report = hand_back(fd.as_fd(), SERVICE, limits).unwrap();
        assert!(report.removed >= 2, "{report:?}");
        assert!(!ws.join("deep/d/d/d/d").exists());
        assert_eq!(report.bytes, usage.bytes, "{report:?} {usage:?}");
        assert!(
            usage.bytes >= 530_000 && usage.bytes < 64 << 20,
            "{usage:?}"
        );
    }

    /// What an agent can leave behind: nothing of it may survive hand-back as a setuid/setgid
    /// or world-writable entry, or as an entry the agent still owns.
    #[test]
    fn hand_back_leaves_no_privilege_carrier() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        std::fs::create_dir_all(&ws).unwrap();
        let plant = |p: &Path, mode: u32| {
            std::fs::write(p, b"#!/bin/sh\n").unwrap();
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
            std::os::unix::fs::lchown(p, Some(AGENT.uid), Some(AGENT.gid)).unwrap();
        };
        plant(&ws.join("suid"), 0o4755);
        plant(&ws.join("linked"), 0o6755);
        std::fs::hard_link(ws.join("linked"), ws.join("linked-too")).unwrap();
        std::fs::create_dir(ws.join("open")).unwrap();
        std::fs::set_permissions(ws.join("open"), std::fs::Permissions::from_mode(0o777)).unwrap();
        std::os::unix::fs::lchown(ws.join("open"), Some(AGENT.uid), Some(AGENT.gid)).unwrap();
        plant(&ws.join("open/ww"), 0o666);
        let mut deep = ws.join("deep");
        for _ in 0..8 {
            deep = deep.join("d");
        }
        std::fs::create_dir_all(&deep).unwrap();
        std::fs::create_dir_all(ws.join("deep/d/d/d/d/d/side")).unwrap();
        plant(&deep.join("suid"), 0o4755);
        plant(&ws.join("deep/d/d/d/d/d/side/suid"), 0o4755);
        // More hard links than the report may list.
        std::fs::create_dir(ws.join("many")).unwrap();
        for i in 0..200 {
            plant(&ws.join(format!("many/{i}")), 0o644);
            std::fs::hard_link(ws.join(format!("many/{i}")), ws.join(format!("many/{i}-b")))
                .unwrap();
        }
        chown_agent_tree(&ws);

        let fd = open_dir(&ws);
        let limits = WalkLimits {
            max_entries: 10,
            max_depth: 4,
        };
        let report = hand_back(fd.as_fd(), SERVICE, limits).unwrap();
        for (p, m) in every_entry(&ws) {
            assert_eq!((m.uid(), m.gid()), (SERVICE.uid, SERVICE.gid), "{p:?}");
            if !m.file_type().is_symlink() {
                assert_eq!(m.mode() & 0o6002, 0, "{p:?}");
            }
        }
        assert_eq!(
            std::fs::metadata(ws.join("suid")).unwrap().mode() & 0o7777,
            0o755
        );
        // The first name met is removed; the inode's last name is then an ordinary file.
        assert!(ws.join("linked").exists() != ws.join("linked-too").exists());
        assert!(!ws.join("deep/d/d/d/d").exists());
        assert!(ws.join("deep/d/d/d").is_dir());
        assert_eq!(report.skipped.len(), MAX_LISTED, "{report:?}");
        assert_eq!(report.removed, 1 + 1 + 200);
        assert_eq!(report.unlisted, report.removed - MAX_LISTED as u64);
        assert!(report.skipped_summary().ends_with("and 170 more"));
    }

    /// Every entry under `top` (`top` included, symlinks not followed), with its metadata.
    fn every_entry(top: &Path) -> Vec<(std::path::PathBuf, std::fs::Metadata)> {
        let entries = walkdir::WalkDir::new(top).into_iter().map(Result::unwrap);
        entries
            .map(|e| (e.path().to_path_buf(), e.metadata().unwrap()))
            .collect()
    }

    fn chown_agent_tree(top: &Path) {
        for (p, _) in every_entry(top) {
            std::os::unix::fs::lchown(&p, Some(AGENT.uid), Some(AGENT.gid)).unwrap();
        }
    }

    #[test]
    fn top_must_be_a_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("f");
        std::fs::write(&f, b"").unwrap();
        let fd = fs::open(&f, OFlags::PATH | OFlags::CLOEXEC, Mode::empty()).unwrap();
        assert!(matches!(
            hand_over(fd.as_fd(), AGENT, WalkLimits::default()).unwrap_err(),
            WalkError::Refused { .. }
        ));
    }
}
