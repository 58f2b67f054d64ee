//! Per-run disk limits on a workspace: a project quota where the filesystem enforces one,
//! otherwise a watcher that measures the tree and tells the caller to stop the run.
//!
//! Without a limit a sandbox fills the host's disk through its workspace (the only writable
//! place that is not a size-capped tmpfs). Two ways to bound it:
//! - **Project quota** ([`ProjectQuota`]): when the data dir's filesystem accounts *and*
//!   enforces project quotas (ext4 or xfs mounted with `prjquota`; asked with `quotactl_fd`
//!   `Q_XGETQSTATV`, never guessed from the mount table), every entry of the workspace is
//!   tagged with the run's project id (`FS_IOC_FSSETXATTR`, `PROJINHERIT` on directories so
//!   whatever the agent creates inherits it; an unprivileged process can neither change nor
//!   drop the tag, and the kernel refuses renames across projects), and the project gets a hard
//!   block limit. Writes past it fail with `EDQUOT`; nothing overshoots. The tags are removed
//!   and the limit cleared when the run ends, so the next run of the same project id starts at
//!   zero.
//! - **Watcher** ([`watch`]): measures the tree with the fd-relative, race-tolerant
//!   [`walk::visit`](crate::walk::visit) (never by path, since root walks a tree its owner is
//!   changing) and returns when it reaches the limit. It counts allocated blocks, not apparent
//!   sizes (a sparse file's holes cost nothing and count nothing), each inode once (hard links),
//!   directories too; an entry that vanishes mid-walk is skipped. Its cost is bounded: the walk
//!   lists at most `max_entries` (more is itself over the limit: inodes are disk too), holds
//!   at most `max_depth` descriptors (deeper directories are kept as file handles and walked
//!   afterwards, so nesting hides nothing; only on a filesystem without file handles is such a
//!   tree over the limit, unmeasured), and the pause between two walks grows with the time a
//!   walk takes, so a big tree is walked less often, never more than about a tenth of one
//!   core.
//!
//! A file the run unlinks while it holds it open is in no tree but still takes disk (and so
//! does an `O_TMPFILE`): given the run's `cgroup.procs` files, the watcher also counts every
//! file its processes hold open or mapped on the tree's filesystem with no name left
//! ([`held_unlinked`], through every thread's `/proc/<pid>/task/<tid>/fd` and
//! `/proc/<pid>/map_files`), each inode once. One it keeps only in flight in a unix socket
//! (`SCM_RIGHTS`, never received) is out of its sight; `RLIMIT_FSIZE` bounds each such file.
//!
//! The overshoot of the watcher is what the run writes within one pause; the caller also caps
//! each file with `RLIMIT_FSIZE` at the limit, so no single write outruns it by more.
//!
//! A tree that is already over the limit when the run starts is given what it occupies as its
//! limit (quota and watcher alike): it can be worked on and cleaned up, never grown.

use std::collections::HashSet;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentbox_policy::resolve::Kind;
use rustix::fs::OFlags;
use rustix::io::Errno;

use crate::walk::{self, WalkError, WalkLimits, WalkReport};

/// The shortest pause between two walks of the watcher.
pub const MIN_PAUSE: Duration = Duration::from_millis(100);
/// The longest.
pub const MAX_PAUSE: Duration = Duration::from_secs(10);
/// The pause is this many times the last walk's duration (within the bounds above): the
/// watcher walks at most a tenth of the time.
const PAUSE_FACTOR: u32 = 10;

/// How a limit is enforced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    ProjectQuota,
    Watcher,
}

/// What [`probe`] found out about a filesystem.
#[derive(Debug)]
pub struct Probe {
    /// `Some` when the filesystem enforces project quotas.
    pub quota: Option<ProjectQuota>,
    /// Why it is the mode it is, for `/status` and the log.
    pub detail: String,
}

impl Probe {
    pub fn mode(&self) -> Mode {
        match self.quota {
            Some(_) => Mode::ProjectQuota,
            None => Mode::Watcher,
        }
    }
}

/// Why a quota operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DiskError {
    #[error("{op}: {source}")]
    Quota {
        op: &'static str,
        #[source]
        source: Errno,
    },
    #[error("{path}: {op}: {source}")]
    Tag {
        path: String,
        op: &'static str,
        #[source]
        source: Errno,
    },
    #[error(transparent)]
    Walk(#[from] WalkError),
}

// The quota ABI (linux/quota.h, linux/dqblk_xfs.h, linux/fs.h); libc has no bindings for it.
const PRJQUOTA: u32 = 2;
const Q_GETQUOTA: u32 = 0x80_0007;
const Q_SETQUOTA: u32 = 0x80_0008;
const Q_XGETQSTATV: u32 = (b'X' as u32) << 8 | 8;
const QIF_BLIMITS: u32 = 1;
/// Quota block limits are in units of this many bytes (`QIF_DQBLKSIZE`).
const QIF_DQBLKSIZE: u64 = 1024;
const FS_QSTATV_VERSION1: i8 = 1;
const FS_QUOTA_PDQ_ACCT: u16 = 1 << 4;
const FS_QUOTA_PDQ_ENFD: u16 = 1 << 5;
const FS_XFLAG_PROJINHERIT: u32 = 0x200;
/// `_IOR('X', 31, struct fsxattr)` and `_IOW('X', 32, struct fsxattr)`.
const FS_IOC_FSGETXATTR: libc::c_ulong = 0x801c_581f;
const FS_IOC_FSSETXATTR: libc::c_ulong = 0x401c_5820;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct IfDqblk {
    bhardlimit: u64,
    bsoftlimit: u64,
    curspace: u64,
    ihardlimit: u64,
    isoftlimit: u64,
    curinodes: u64,
    btime: u64,
    itime: u64,
    valid: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct QFileStatV {
    ino: u64,
    nblks: u64,
    nextents: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct QuotaStatV {
    version: i8,
    pad1: u8,
    flags: u16,
    incoredqs: u32,
    uquota: QFileStatV,
    gquota: QFileStatV,
    pquota: QFileStatV,
    btimelimit: i32,
    itimelimit: i32,
    rtbtimelimit: i32,
    bwarnlimit: u16,
    iwarnlimit: u16,
    rtbwarnlimit: u16,
    pad3: u16,
    pad4: u32,
    pad2: [u64; 7],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct FsXattr {
    xflags: u32,
    extsize: u32,
    nextents: u32,
    projid: u32,
    cowextsize: u32,
    pad: [u8; 8],
}

/// `quotactl_fd(fd, QCMD(cmd, PRJQUOTA), id, addr)`.
fn quotactl<T>(fd: BorrowedFd<'_>, cmd: u32, id: u32, data: &mut T) -> Result<(), Errno> {
    let qcmd = (cmd << 8) | PRJQUOTA;
    // SAFETY: `data` is a live, exclusively borrowed `#[repr(C)]` value of the type the command
    // reads or writes (checked against the kernel headers above); `fd` is open for the call.
    let r = unsafe {
        libc::syscall(
            libc::SYS_quotactl_fd,
            fd.as_raw_fd(),
            qcmd,
            id,
            std::ptr::from_mut(data).cast::<libc::c_void>(),
        )
    };
    if r < 0 {
        Err(Errno::from_raw_os_error(
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        ))
    } else {
        Ok(())
    }
}

fn fsxattr(fd: BorrowedFd<'_>, request: libc::c_ulong, attr: &mut FsXattr) -> Result<(), Errno> {
    // SAFETY: `attr` is a live, exclusively borrowed `struct fsxattr`, the type both requests
    // take; `fd` is open for the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), request, std::ptr::from_mut(attr)) };
    if r < 0 {
        Err(Errno::from_raw_os_error(
            std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
        ))
    } else {
        Ok(())
    }
}

/// Asks the filesystem holding `dir` whether it accounts and enforces project quotas. The
/// answer comes from the kernel (`quotactl_fd` `Q_XGETQSTATV`, then `FS_IOC_FSGETXATTR` on
/// `dir`), so a mount option that says `prjquota` on a kernel without quota support still
/// yields the watcher.
pub fn probe(dir: BorrowedFd<'_>) -> Probe {
    let watcher = |detail: String| Probe {
        quota: None,
        detail,
    };
    let fd = match rustix::fs::openat(
        dir,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    ) {
        Ok(fd) => fd,
        Err(e) => return watcher(format!("cannot open the data dir: {e}")),
    };
    let mut st = QuotaStatV {
        version: FS_QSTATV_VERSION1,
        ..QuotaStatV::default()
    };
    if let Err(e) = quotactl(fd.as_fd(), Q_XGETQSTATV, 0, &mut st) {
        let why = match e {
            Errno::NOSYS => "the kernel has no quotactl_fd".to_owned(),
            Errno::SRCH | Errno::NOENT => "project quotas are not enabled on it".to_owned(),
            Errno::NOTSUP | Errno::INVAL => "its filesystem has no project quotas".to_owned(),
            e => format!("quotactl: {e}"),
        };
        return watcher(format!("no project quota on the data dir: {why}"));
    }
    let wanted = FS_QUOTA_PDQ_ACCT | FS_QUOTA_PDQ_ENFD;
    if st.flags & wanted != wanted {
        return watcher(format!(
            "project quotas on the data dir are not both accounted and enforced (flags {:#x})",
            st.flags
        ));
    }
    let mut attr = FsXattr::default();
    if let Err(e) = fsxattr(fd.as_fd(), FS_IOC_FSGETXATTR, &mut attr) {
        return watcher(format!("FS_IOC_FSGETXATTR on the data dir: {e}"));
    }
    Probe {
        quota: Some(ProjectQuota { fs: fd }),
        detail: "project quotas are enforced on the data dir's filesystem".to_owned(),
    }
}

/// Project quotas on the data dir's filesystem (found by [`probe`]).
#[derive(Debug)]
pub struct ProjectQuota {
    /// A descriptor on the filesystem, for `quotactl_fd`.
    fs: OwnedFd,
}

impl ProjectQuota {
    fn set_limit(&self, project: u32, bytes: u64) -> Result<(), DiskError> {
        let blocks = bytes.div_ceil(QIF_DQBLKSIZE);
        let mut q = IfDqblk {
            bhardlimit: blocks,
            bsoftlimit: blocks,
            valid: QIF_BLIMITS,
            ..IfDqblk::default()
        };
        quotactl(self.fs.as_fd(), Q_SETQUOTA, project, &mut q).map_err(|source| DiskError::Quota {
            op: "Q_SETQUOTA",
            source,
        })
    }

    /// The bytes the project occupies.
    pub fn usage(&self, project: u32) -> Result<u64, DiskError> {
        let mut q = IfDqblk::default();
        quotactl(self.fs.as_fd(), Q_GETQUOTA, project, &mut q).map_err(|source| {
            DiskError::Quota {
                op: "Q_GETQUOTA",
                source,
            }
        })?;
        Ok(q.curspace)
    }

    /// Tags every entry under `top` with `project` (directories also with `PROJINHERIT`) and
    /// limits the project to `limit` bytes or what the tree already occupies, whichever is more;
    /// returns that hard limit. Call after the hand-over, before anything of the run starts.
    pub fn assign(
        &self,
        top: BorrowedFd<'_>,
        project: u32,
        limit: u64,
        limits: WalkLimits,
    ) -> Result<u64, DiskError> {
        let fs_dev = device(self.fs.as_fd())?;
        if device(top)? != fs_dev {
            return Err(DiskError::Quota {
                op: "the workspace is on another filesystem than the data dir",
                source: Errno::XDEV,
            });
        }
        tag_tree(top, project, true, limits)?;
        let hard = limit.max(self.usage(project)?);
        self.set_limit(project, hard)?;
        Ok(hard)
    }

    /// After the run (every process dead): the bytes the project occupied, then the tags
    /// removed and the limit cleared.
    pub fn release(
        &self,
        top: BorrowedFd<'_>,
        project: u32,
        limits: WalkLimits,
    ) -> Result<u64, DiskError> {
        let used = self.usage(project)?;
        tag_tree(top, 0, false, limits)?;
        self.set_limit(project, 0)?;
        Ok(used)
    }
}

/// How close to its hard limit a project's usage counts as having reached it: a write that
/// failed with `EDQUOT` leaves the usage within a block or so of the limit, not on it.
pub const QUOTA_SLACK: u64 = 1 << 20;

/// Whether a project that occupies `used` bytes reached its hard limit `limit`.
pub fn quota_reached(used: u64, limit: u64) -> bool {
    used.saturating_add(QUOTA_SLACK) >= limit
}

fn device(fd: BorrowedFd<'_>) -> Result<u64, DiskError> {
    let st = rustix::fs::fstat(fd).map_err(|source| DiskError::Quota {
        op: "fstat",
        source,
    })?;
    Ok(st.st_dev)
}

/// Sets the project id of every directory and regular file under `top` (symlinks, sockets and
/// FIFOs take no data blocks and cannot be opened for the ioctl without risk), and
/// `PROJINHERIT` on directories when `inherit`. Files are opened `O_NONBLOCK` relative to
/// their directory and checked to be the entry listed, so a name swapped for a FIFO cannot
/// block root.
fn tag_tree(
    top: BorrowedFd<'_>,
    project: u32,
    inherit: bool,
    limits: WalkLimits,
) -> Result<(), DiskError> {
    let mut first: Option<DiskError> = None;
    let report = walk::visit(top, limits, |seen| {
        if first.is_some() {
            return;
        }
        let opened;
        let fd = match (seen.dir, seen.stat.kind) {
            (Some(dir), _) => dir,
            (None, Kind::File) => {
                match walk::open_listed(
                    seen.parent,
                    seen.name,
                    OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY,
                    &seen.stat,
                    &seen.path(),
                ) {
                    Ok((fd, _)) => {
                        opened = fd;
                        opened.as_fd()
                    }
                    // Gone or replaced: the next tag (or the inheritance) covers what is there.
                    Err(_) => return,
                }
            }
            (None, _) => return,
        };
        let tag = |op, source| DiskError::Tag {
            path: seen.path(),
            op,
            source,
        };
        let mut attr = FsXattr::default();
        if let Err(e) = fsxattr(fd, FS_IOC_FSGETXATTR, &mut attr) {
            first = Some(tag("FS_IOC_FSGETXATTR", e));
            return;
        }
        attr.projid = project;
        if seen.dir.is_some() && inherit {
            attr.xflags |= FS_XFLAG_PROJINHERIT;
        } else {
            attr.xflags &= !FS_XFLAG_PROJINHERIT;
        }
        if let Err(e) = fsxattr(fd, FS_IOC_FSSETXATTR, &mut attr) {
            first = Some(tag("FS_IOC_FSSETXATTR", e));
        }
    })?;
    if let Some(e) = first {
        return Err(e);
    }
    if report.truncated || report.too_deep > 0 {
        return Err(DiskError::Tag {
            path: ".".to_owned(),
            op: "tag",
            source: Errno::FBIG,
        });
    }
    Ok(())
}

/// What a workspace occupies, as [`measure`] saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Usage {
    /// Allocated bytes (blocks × 512), each inode once.
    pub bytes: u64,
    /// Entries seen.
    pub entries: u64,
    /// The walk stopped at its entry bound.
    pub truncated: bool,
    /// Directories nested deeper than the walk goes.
    pub too_deep: u64,
}

impl Usage {
    /// The usage a walk that changed the tree found it at (see [`WalkReport::bytes`]): a
    /// hand-back's report, after which a measurement of its own would walk the tree again.
    pub fn found_by(report: &WalkReport, limits: WalkLimits) -> Usage {
        Usage {
            bytes: report.bytes,
            entries: report.visited,
            truncated: report.visited > limits.max_entries,
            too_deep: 0,
        }
    }

    /// Why this usage is over `limit` bytes, if it is.
    pub fn over(&self, limit: u64, limits: WalkLimits) -> Option<String> {
        if self.bytes > limit {
            Some(format!(
                "the workspace occupies {} MiB, the limit is {} MiB",
                self.bytes >> 20,
                limit >> 20
            ))
        } else if self.truncated {
            Some(format!(
                "the workspace holds more than {} entries",
                limits.max_entries
            ))
        } else if self.too_deep > 0 {
            Some(format!(
                "the workspace nests directories deeper than {}",
                limits.max_depth
            ))
        } else {
            None
        }
    }
}

/// Measures the tree under `top` (see the module header for what counts).
pub fn measure(top: BorrowedFd<'_>, limits: WalkLimits) -> Result<Usage, WalkError> {
    let mut seen_links: HashSet<(u64, u64)> = HashSet::new();
    let mut bytes: u64 = 0;
    let report = walk::visit(top, limits, |seen| {
        let st = &seen.stat;
        if st.kind != Kind::Dir && st.nlink > 1 && !seen_links.insert((st.dev, st.ino)) {
            return;
        }
        bytes = bytes.saturating_add(st.blocks.saturating_mul(512));
    })?;
    Ok(Usage {
        bytes,
        entries: report.visited,
        truncated: report.truncated,
        too_deep: report.too_deep,
    })
}

/// The watcher found the tree over its limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exceeded {
    pub usage: Usage,
    pub reason: String,
}

/// Measures the tree under `top` now and then until it is over `limit` bytes (or its entry or
/// depth bound), and returns why. Never returns otherwise: the caller races it against the
/// run's end and drops it. A walk that fails (only the top can make it fail) is retried.
///
/// The first walk comes after [`MIN_PAUSE`], not at once: the caller has just measured the
/// tree (the launcher's hand-over walk) and set `limit` at or above what it found, and a walk
/// at once would take CPU from the sandbox's start for nothing.
///
/// With `procs` (the `cgroup.procs` files of the run's cgroups; one that does not exist yet
/// reads as empty), the files its processes hold on the tree's filesystem after unlinking them
/// count too ([`held_unlinked`]).
pub async fn watch(top: OwnedFd, limit: u64, limits: WalkLimits, procs: Vec<PathBuf>) -> Exceeded {
    let top = Arc::new(top);
    let procs = Arc::new(procs);
    loop {
        tokio::time::sleep(MIN_PAUSE).await;
        let started = Instant::now();
        let fd = Arc::clone(&top);
        let procs = Arc::clone(&procs);
        let measured = tokio::task::spawn_blocking(move || {
            let mut usage = measure(fd.as_fd(), limits)?;
            if !procs.is_empty()
                && let Ok(dev) = dev_of(fd.as_fd())
            {
                usage.bytes = usage.bytes.saturating_add(held_unlinked(&procs, dev));
            }
            Ok::<_, WalkError>(usage)
        })
        .await;
        let took = started.elapsed();
        match measured {
            Ok(Ok(usage)) => {
                if let Some(reason) = usage.over(limit, limits) {
                    return Exceeded { usage, reason };
                }
            }
            Ok(Err(e)) => tracing::warn!(error = %e, "cannot measure a workspace"),
            Err(e) => tracing::warn!(error = %e, "cannot measure a workspace"),
        }
        // MIN_PAUSE of it was slept at the top of the loop.
        tokio::time::sleep(pause_after(took).saturating_sub(MIN_PAUSE)).await;
    }
}

/// The device of an open file.
fn dev_of(fd: BorrowedFd<'_>) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let file = std::fs::File::from(fd.try_clone_to_owned()?);
    Ok(file.metadata()?.dev())
}

/// The bytes allocated to files on device `dev` that the processes listed in the `procs` files
/// (`cgroup.procs`) hold open or mapped with no name left (unlinked, or `O_TMPFILE`), each
/// inode once. Every thread's descriptor table is read (`/proc/<pid>/task/<tid>/fd`: a thread
/// made without `CLONE_FILES`, or a leader that exited, has its own or none), and the mappings
/// (`/proc/<pid>/map_files`: a file mapped, then closed). Reading another uid's takes
/// `CAP_SYS_PTRACE` (and `CAP_SYS_ADMIN` for the mappings); a process that has exited
/// meanwhile, or one that cannot be read, counts nothing.
pub fn held_unlinked(procs: &[PathBuf], dev: u64) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen: HashSet<u64> = HashSet::new();
    let mut bytes: u64 = 0;
    let mut count = |dir: &Path| {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            // `stat` of the link is the open (or mapped) file's: no open, no path resolved.
            let Ok(m) = std::fs::metadata(entry.path()) else {
                continue;
            };
            if m.nlink() == 0 && m.dev() == dev && m.file_type().is_file() && seen.insert(m.ino()) {
                bytes = bytes.saturating_add(m.blocks().saturating_mul(512));
            }
        }
    };
    for list in procs.iter().filter_map(|p| std::fs::read_to_string(p).ok()) {
        for pid in list.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let proc_dir = PathBuf::from(format!("/proc/{pid}"));
            if let Ok(threads) = std::fs::read_dir(proc_dir.join("task")) {
                for thread in threads.flatten() {
                    count(&thread.path().join("fd"));
                }
            }
            count(&proc_dir.join("map_files"));
        }
    }
    bytes
}

/// The pause after a walk that took `took`.
pub fn pause_after(took: Duration) -> Duration {
    took.saturating_mul(PAUSE_FACTOR)
        .clamp(MIN_PAUSE, MAX_PAUSE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::walk::tests::{nest, open_dir};
    use std::io::{Seek, SeekFrom, Write};

    /// A file this process holds open after unlinking it counts once, whatever number of
    /// descriptors hold it; one with a name does not (the walk counts it).
    #[test]
    fn files_held_without_a_name_are_counted_once() {
        use std::os::unix::fs::MetadataExt;
        let tmp = tempfile::tempdir().unwrap();
        let procs = tmp.path().join("cgroup.procs");
        std::fs::write(&procs, format!("{}\n", std::process::id())).unwrap();
        let procs = [procs];
        let named = tmp.path().join("named");
        let mut kept = std::fs::File::create(&named).unwrap();
        kept.write_all(&vec![1u8; 1 << 20]).unwrap();
        let dev = std::fs::metadata(tmp.path()).unwrap().dev();
        let before = held_unlinked(&procs, dev);
        let gone = tmp.path().join("gone");
        let mut held = std::fs::File::create(&gone).unwrap();
        held.write_all(&vec![1u8; 4 << 20]).unwrap();
        held.sync_all().unwrap();
        let again = std::fs::OpenOptions::new().read(true).open(&gone).unwrap();
        std::fs::remove_file(&gone).unwrap();
        let added = held_unlinked(&procs, dev).saturating_sub(before);
        assert!(added >= 4 << 20, "{before} + {added}");
        assert!(added < 5 << 20, "counted twice: {before} + {added}");
        drop((held, again, kept));
        assert!(held_unlinked(&procs, dev) <= before);
    }

    #[test]
    fn abi_sizes_match_the_kernel_headers() {
        assert_eq!(std::mem::size_of::<IfDqblk>(), 72);
        assert_eq!(std::mem::size_of::<FsXattr>(), 28);
        assert_eq!(std::mem::size_of::<QuotaStatV>(), 160);
    }

    #[test]
    fn counts_blocks_once_per_inode_not_apparent_size() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        std::fs::create_dir_all(ws.join("a/b")).unwrap();
        let fd = open_dir(&ws);
        let empty = measure(fd.as_fd(), WalkLimits::default()).unwrap();
        // A sparse file of 1 GiB apparent size occupies (almost) nothing.
        let mut sparse = std::fs::File::create(ws.join("sparse")).unwrap();
        sparse.seek(SeekFrom::Start(1 << 30)).unwrap();
        sparse.write_all(b"x").unwrap();
        drop(sparse);
        let u = measure(fd.as_fd(), WalkLimits::default()).unwrap();
        assert!(u.bytes - empty.bytes < 1 << 20, "{u:?}");
        // 4 MiB of data, then a hard link to it: counted once.
        std::fs::write(ws.join("a/b/data"), vec![7u8; 4 << 20]).unwrap();
        let one = measure(fd.as_fd(), WalkLimits::default()).unwrap();
        assert!(one.bytes >= empty.bytes + (4 << 20), "{one:?}");
        std::fs::hard_link(ws.join("a/b/data"), ws.join("a/link")).unwrap();
        let linked = measure(fd.as_fd(), WalkLimits::default()).unwrap();
        assert_eq!(linked.bytes, one.bytes);
        assert_eq!(linked.entries, one.entries + 1);
        assert!(linked.over(4 << 20, WalkLimits::default()).is_some());
        assert!(linked.over(64 << 20, WalkLimits::default()).is_none());
    }

    #[test]
    fn depth_costs_no_evasion_and_entries_are_bounded() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        let deep = nest(&ws, 20);
        std::fs::write(deep.join("hidden"), vec![1u8; 1 << 20]).unwrap();
        let fd = open_dir(&ws);
        let shallow = WalkLimits {
            max_entries: 1000,
            max_depth: 3,
        };
        // Past the depth limit the walk goes on through file handles: everything is counted.
        let u = measure(fd.as_fd(), shallow).unwrap();
        let full = measure(fd.as_fd(), WalkLimits::default()).unwrap();
        assert_eq!(u.too_deep, 0);
        assert_eq!(u, full);
        assert_eq!(u.entries, 22);
        assert!(u.bytes >= 1 << 20, "{u:?}");
        for i in 0..20 {
            std::fs::write(ws.join(format!("f{i}")), b"").unwrap();
        }
        let limits = WalkLimits {
            max_entries: 10,
            max_depth: 10,
        };
        let u = measure(fd.as_fd(), limits).unwrap();
        assert!(u.truncated);
        assert!(u.over(1 << 30, limits).unwrap().contains("entries"));
    }

    #[test]
    fn survives_a_tree_changing_under_it() {
        let tmp = tempfile::tempdir().unwrap();
        let ws = tmp.path().join("ws");
        std::fs::create_dir_all(&ws).unwrap();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let churn = {
            let ws = ws.clone();
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut i = 0u64;
                while !stop.load(std::sync::atomic::Ordering::SeqCst) {
                    let d = ws.join(format!("d{}", i % 50));
                    let _ = std::fs::create_dir_all(d.join("x/y"));
                    let _ = std::fs::write(d.join("x/f"), b"data");
                    let _ = std::fs::remove_dir_all(ws.join(format!("d{}", (i + 25) % 50)));
                    i += 1;
                }
            })
        };
        let fd = open_dir(&ws);
        for _ in 0..200 {
            measure(fd.as_fd(), WalkLimits::default()).unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
        churn.join().unwrap();
    }

    #[test]
    fn probe_answers_from_the_kernel() {
        let tmp = tempfile::tempdir().unwrap();
        let fd = open_dir(tmp.path());
        let p = probe(fd.as_fd());
        // Whatever this host has, the answer is one of the two modes with a reason.
        assert!(!p.detail.is_empty());
        if p.mode() == super::Mode::Watcher {
            assert!(p.quota.is_none());
        }
    }

    #[test]
    fn pause_grows_with_the_walk_and_stays_bounded() {
        assert_eq!(pause_after(Duration::ZERO), MIN_PAUSE);
        assert_eq!(
            pause_after(Duration::from_millis(50)),
            Duration::from_millis(500)
        );
        assert_eq!(pause_after(Duration::from_secs(60)), MAX_PAUSE);
    }
}
