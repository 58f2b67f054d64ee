//! Mount by descriptor: the directories a sandbox gets (workspace, gateway directory, venv) are
//! bind-mounted by the launcher from the validated descriptors onto root-only paths under
//! `$AGENTBOX_DATA/mnt/<tid>/`, and bwrap is handed descriptors of those mounts.
//!
//! Why: bwrap cannot mount a descriptor opened in another mount namespace, so `--bind-fd`
//! reads the descriptor's path back (`readlink /proc/self/fd/N`) and mounts that *path*, then
//! compares device and inode and dies on a mismatch ("Race condition binding dirfd"). With the
//! descriptor of `tasks/<tid>/workspace` itself, whoever can rename entries of `tasks/<tid>`
//! (the service user) could swap the name between validation and bwrap's mount: bwrap would
//! mount the swapped-in directory (or follow a swapped-in symlink to a host directory) before
//! its check killed the sandbox. Nothing would have run, but a directory other than the
//! validated one would have been mounted, and the start would fail. The race test
//! (`tests/race.rs`) hit exactly that.
//!
//! Here the launcher, as root, mounts `/proc/self/fd/<validated fd>` (the kernel follows the
//! magic link to the very object, no name is looked up), checks the new mount's root against
//! the descriptor by device and inode, and gives bwrap a descriptor of the mount. The path
//! bwrap reads back is `mnt/<tid>/<name>`: every component is root-owned and writable only by
//! root, so it names the validated directory for as long as the run lasts.
//!
//! The mounts live in the launcher's own mount namespace (see
//! [`crate::proc::isolate_mounts`]): they never show up on the host and vanish with the launcher.
//! [`Staging::on_tmpfs`] also puts the mount points themselves on a small tmpfs attached (by
//! descriptor) over `mnt/` in that namespace: a start's three to eight `mkdir`s and a stop's
//! `rmdir`s then cost no inode of the data dir's filesystem, where they were a fifth of the
//! launcher's CPU per run (ext4 without a journal scans past every recently deleted inode to
//! allocate one; BENCHMARKS.md). A restart finds an empty tmpfs; on disk it only removes the
//! empty mount-point directories an older launcher left behind.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use agentbox_policy::id::Tid;
use rustix::fs::{self, AtFlags, Mode, OFlags, StatxFlags};
use rustix::io::Errno;
use rustix::mount::UnmountFlags;

use crate::bwrap::Mounts;

/// The mount points, in `mnt/<tid>/`.
const WORKSPACE: &str = "workspace";
const GATEWAY: &str = "gateway";
const VENV: &str = "venv";
const HOME: &str = "home";
const TMP: &str = "tmp";
const SERVER: &str = "server";
const CLIENTS: &str = "clients";
const ALL: [&str; 7] = [WORKSPACE, GATEWAY, VENV, HOME, TMP, SERVER, CLIENTS];

/// `$AGENTBOX_DATA/mnt`, root-owned 0711: traversable by the agent uid (bwrap, running as it,
/// resolves the paths below), writable and listable by root only.
#[derive(Debug)]
pub struct Staging {
    path: PathBuf,
    fd: OwnedFd,
}

/// What a sandbox mounts, validated.
#[derive(Debug, Clone, Copy)]
pub struct Sources<'a> {
    pub workspace: BorrowedFd<'a>,
    pub gateway: Option<BorrowedFd<'a>>,
    pub venv: Option<BorrowedFd<'a>>,
    /// Rollout slots: home, `/tmp` and the server's socket directory on disk.
    pub home: Option<BorrowedFd<'a>>,
    pub tmp: Option<BorrowedFd<'a>>,
    pub server_dir: Option<BorrowedFd<'a>>,
    /// The agent CLIs (`launcher.clients_dir`), staged like the rest because the path may
    /// lie where the agent uid cannot look (the tests' cache is under `/root`).
    pub clients: Option<BorrowedFd<'a>>,
}

/// The staged mounts of one run; unmounted on [`Staged::release`] or drop.
#[derive(Debug)]
pub struct Staged {
    /// Descriptors of the mounts, for bwrap's `--bind-fd`.
    pub mounts: Mounts,
    dir: StagedDir,
}

/// `mnt/<tid>`: unmounts and removes everything below it when dropped, so a failure halfway
/// through staging leaves nothing mounted.
#[derive(Debug)]
struct StagedDir {
    path: PathBuf,
    /// The mount points created below it (each mounted on, unless staging failed there): what
    /// a release undoes, rather than every name a run could have.
    created: Vec<&'static str>,
    released: bool,
}

fn identity(fd: BorrowedFd<'_>) -> Result<(u64, u64), Errno> {
    let st = fs::statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS)?;
    Ok((fs::makedev(st.stx_dev_major, st.stx_dev_minor), st.stx_ino))
}

/// Why staging failed.
#[derive(Debug, thiserror::Error)]
pub enum StageError {
    /// A step on the staging directory failed.
    #[error("staging mounts: {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: Errno,
    },
    /// The mount's root is not the validated directory (something raced the bind).
    #[error("staging mounts: {name}: the mount is {got:?}, the validated directory {want:?}")]
    Mismatch {
        name: String,
        got: (u64, u64),
        want: (u64, u64),
    },
}

fn io(what: impl Into<String>) -> impl FnOnce(Errno) -> StageError {
    let what = what.into();
    move |source| StageError::Io { what, source }
}

/// The tmpfs [`Staging::on_tmpfs`] mounts: root-owned, traversable by the agent uids, holding
/// mount-point directories only.
const TMPFS_OPTIONS: [(&str, &str); 3] = [("mode", "0711"), ("size", "1m"), ("nr_inodes", "65536")];

impl Staging {
    /// The staging directory `path`, whose validated (root-owned, root-writable only) handle
    /// is `fd`.
    pub fn new(path: PathBuf, fd: OwnedFd) -> Staging {
        Staging { path, fd }
    }

    /// [`Staging::new`] on a fresh tmpfs attached over `fd` (the validated `mnt/`) through the
    /// mount API, by descriptor: no name is resolved, and the staging handle is the new
    /// mount's root itself. Whatever an earlier launcher left in the directory is removed
    /// first. Call only in the launcher's own mount namespace (the tmpfs is attached there).
    pub fn on_tmpfs(path: PathBuf, fd: OwnedFd) -> Result<Staging, StageError> {
        use rustix::mount::{
            FsMountFlags, FsOpenFlags, MountAttrFlags, MoveMountFlags, fsconfig_create,
            fsconfig_set_string, fsmount, fsopen, move_mount,
        };
        let on_disk = Staging::new(path, fd);
        on_disk.clean_all();
        let Staging { path, fd } = on_disk;
        let fs = fsopen("tmpfs", FsOpenFlags::FSOPEN_CLOEXEC).map_err(io("fsopen tmpfs"))?;
        for (key, value) in TMPFS_OPTIONS {
            fsconfig_set_string(&fs, key, value).map_err(io(format!("tmpfs {key}={value}")))?;
        }
        fsconfig_create(&fs).map_err(io("create tmpfs"))?;
        let root = fsmount(
            &fs,
            FsMountFlags::FSMOUNT_CLOEXEC,
            MountAttrFlags::MOUNT_ATTR_NOSUID
                | MountAttrFlags::MOUNT_ATTR_NODEV
                | MountAttrFlags::MOUNT_ATTR_NOEXEC,
        )
        .map_err(io("fsmount tmpfs"))?;
        move_mount(
            &root,
            "",
            &fd,
            "",
            MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH | MoveMountFlags::MOVE_MOUNT_T_EMPTY_PATH,
        )
        .map_err(io(format!("attach tmpfs on {}", path.display())))?;
        Ok(Staging { path, fd: root })
    }

    /// Mounts each source at `mnt/<tid>/<name>` and returns descriptors of the mounts. Any
    /// leftover of an earlier run of `tid` is removed first.
    pub fn stage(&self, tid: &Tid, sources: Sources<'_>) -> Result<Staged, StageError> {
        self.stage_named(tid.as_str(), sources)
    }

    /// [`Staging::stage`] under `mnt/<name>`, for a run that is not named by a tid alone (a
    /// rollout slot's command runs next to its server as `<tid>.exec`, a name no tid can have).
    pub fn stage_named(&self, tid: &str, sources: Sources<'_>) -> Result<Staged, StageError> {
        // A leftover of an earlier run (one whose release failed) is cleaned up first; the
        // usual case, no leftover, costs one `mkdir` rather than a clean-up of every name.
        match fs::mkdirat(&self.fd, tid, Mode::from_raw_mode(0o711)) {
            Ok(()) => {}
            Err(Errno::EXIST) => {
                self.clean(tid);
                fs::mkdirat(&self.fd, tid, Mode::from_raw_mode(0o711))
                    .map_err(io(format!("mkdir mnt/{tid}")))?;
            }
            Err(e) => return Err(io(format!("mkdir mnt/{tid}"))(e)),
        }
        let mut dir = StagedDir {
            path: self.path.join(tid),
            created: Vec::new(),
            released: false,
        };
        let tid_dir = fs::openat(&self.fd, tid, dir_flags(), Mode::empty())
            .map_err(io(format!("open mnt/{tid}")))?;
        // The umask must not take the agent uid's search permission away.
        chmod_fd(&tid_dir, 0o711).map_err(io(format!("chmod mnt/{tid}")))?;
        let mut mount = |name: &'static str, source| {
            dir.created.push(name);
            mount_one(&tid_dir, &dir.path, name, source)
        };
        let mounts = Mounts {
            workspace: mount(WORKSPACE, sources.workspace)?,
            gateway: sources.gateway.map(|g| mount(GATEWAY, g)).transpose()?,
            venv: sources.venv.map(|v| mount(VENV, v)).transpose()?,
            home: sources.home.map(|v| mount(HOME, v)).transpose()?,
            tmp: sources.tmp.map(|v| mount(TMP, v)).transpose()?,
            server_dir: sources.server_dir.map(|v| mount(SERVER, v)).transpose()?,
            clients: sources.clients.map(|v| mount(CLIENTS, v)).transpose()?,
        };
        Ok(Staged { mounts, dir })
    }

    /// Removes `mnt/<name>` and whatever is mounted below it (best effort: a leftover only
    /// costs a directory).
    fn clean(&self, name: &str) {
        let dir = self.path.join(name);
        for child in ALL {
            unmount_and_remove(&dir, child);
        }
        match fs::unlinkat(&self.fd, name, AtFlags::REMOVEDIR) {
            Ok(()) | Err(Errno::NOENT) => {}
            Err(e) => {
                tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a staging directory")
            }
        }
    }

    /// After a restart: removes every staging directory (the mounts themselves died with the
    /// previous launcher's mount namespace).
    pub fn clean_all(&self) {
        let Ok(entries) = std::fs::read_dir(&self.path) else {
            return;
        };
        for e in entries.flatten() {
            if let Some(name) = e.file_name().to_str() {
                self.clean(name);
            }
        }
    }
}

fn dir_flags() -> OFlags {
    OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

/// `chmod` through a handle (`O_PATH` is fine), via its magic link: no name lookup anyone
/// could race.
pub fn chmod_fd(fd: &OwnedFd, mode: u32) -> Result<(), Errno> {
    let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    fs::chmodat(
        fs::CWD,
        path.as_str(),
        Mode::from_raw_mode(mode),
        AtFlags::empty(),
    )
}

/// Creates `dir/name`, bind-mounts `source` there through its magic link, and returns a
/// descriptor of the mount's root after checking it is `source`.
fn mount_one(
    tid_dir: &OwnedFd,
    dir: &Path,
    name: &str,
    source: BorrowedFd<'_>,
) -> Result<OwnedFd, StageError> {
    fs::mkdirat(tid_dir, name, Mode::from_raw_mode(0o700)).map_err(io(format!("mkdir {name}")))?;
    let target = dir.join(name);
    let magic = format!("/proc/self/fd/{}", source.as_raw_fd());
    rustix::mount::mount_bind(magic.as_str(), &target).map_err(io(format!("bind {name}")))?;
    let fd = fs::openat(tid_dir, name, dir_flags(), Mode::empty())
        .map_err(io(format!("open {name}")))?;
    let want = identity(source).map_err(io(format!("stat {name}")))?;
    let got = identity(fd.as_fd()).map_err(io(format!("stat {name}")))?;
    if got != want {
        return Err(StageError::Mismatch {
            name: name.to_owned(),
            got,
            want,
        });
    }
    Ok(fd)
}

/// `umount2(dir/name, MNT_DETACH)` and `rmdir`; a directory that is not mounted on is just
/// removed. The path is root-only, so it names what we mounted.
fn unmount_and_remove(dir: &Path, name: &str) -> Option<String> {
    let target = dir.join(name);
    match rustix::mount::unmount(&target, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW) {
        Ok(()) | Err(Errno::INVAL | Errno::NOENT) => {}
        Err(e) => return Some(format!("unmount {}: {e}", target.display())),
    }
    match std::fs::remove_dir(&target) {
        Ok(()) => None,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => Some(format!("rmdir {}: {e}", target.display())),
    }
}

impl Staged {
    /// Unmounts everything and removes `mnt/<tid>`; says what could not be undone.
    pub fn release(mut self) -> Result<(), String> {
        self.dir.release()
    }
}

impl StagedDir {
    fn release(&mut self) -> Result<(), String> {
        if self.released {
            return Ok(());
        }
        self.released = true;
        let mut errors: Vec<String> = self
            .created
            .iter()
            .filter_map(|name| unmount_and_remove(&self.path, name))
            .collect();
        match std::fs::remove_dir(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => errors.push(format!("rmdir {}: {e}", self.path.display())),
        }
        if errors.is_empty() {
            Ok(())
        } else {
            Err(errors.join("; "))
        }
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if let Err(e) = self.release() {
            tracing::warn!(error = %e, "cannot release staged mounts");
        }
    }
}
