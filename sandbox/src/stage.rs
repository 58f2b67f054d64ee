//! Mount by descriptor: the directories a sandbox gets (workspace, gateway directory, venv) are
//! cloned as detached mounts from the validated descriptors, and attached on root-only paths
//! under `$AGENTBOX_DATA/mnt/<tid>/` in a mount namespace of the sandbox's own; bwrap is
//! handed descriptors of those mounts.
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
//! Here the launcher, as root, clones each validated descriptor into a detached mount
//! (`open_tree(OPEN_TREE_CLONE)`: the kernel takes the very object the descriptor names, no
//! name is looked up, so its root *is* the validated directory) and creates its mount point
//! `mnt/<tid>/<name>`. The child that execs bwrap attaches the mounts there in a mount
//! namespace of its own, made just before ([`ChildSetup::own_mounts`]), and gives bwrap the
//! descriptors, now naming the attached mounts. The path bwrap reads back is
//! `mnt/<tid>/<name>`: every component is root-owned and writable only by root, so it names the
//! validated directory for as long as the run lasts.
//!
//! Why a namespace per run: the launcher's own namespace never holds a staged mount, so a
//! start copies and parses (bwrap rereads the mount table for every mount it makes, ~45 µs a
//! line here, BENCHMARKS.md) only its own few, not those of every run in flight; and the
//! mounts vanish with the run's processes, with nothing to unmount.
//!
//! The mount points live on a small tmpfs attached (by descriptor) over `mnt/` in the
//! launcher's own mount namespace ([`crate::proc::isolate_mounts`], [`Staging::on_tmpfs`]): a
//! start's three to eight `mkdir`s and a stop's `rmdir`s then cost no inode of the data dir's
//! filesystem, where they were a fifth of the launcher's CPU per run (ext4 without a journal
//! scans past every recently deleted inode to allocate one; BENCHMARKS.md). A restart finds an
//! empty tmpfs; on disk it only removes the empty mount-point directories an older launcher
//! left behind.
//!
//! [`ChildSetup::own_mounts`]: crate::proc::ChildSetup::own_mounts

use std::ffi::CStr;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use agentbox_policy::id::Tid;
use rustix::fs::{self, AtFlags, Mode, OFlags};
use rustix::io::Errno;
use rustix::mount::OpenTreeFlags;

use crate::bwrap::Mounts;

/// The mount points, in `mnt/<tid>/` (also what [`crate::bwrap::spawn`] attaches there).
pub(crate) const WORKSPACE: &CStr = c"workspace";
pub(crate) const GATEWAY: &CStr = c"gateway";
pub(crate) const VENV: &CStr = c"venv";
pub(crate) const HOME: &CStr = c"home";
pub(crate) const TMP: &CStr = c"tmp";
pub(crate) const SERVER: &CStr = c"server";
pub(crate) const CLIENTS: &CStr = c"clients";
const ALL: [&CStr; 7] = [WORKSPACE, GATEWAY, VENV, HOME, TMP, SERVER, CLIENTS];

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

/// The staged mounts of one run: detached until the run's child attaches them in its own
/// namespace (`mounts.attach` names the directory); their mount points are removed on
/// [`Staged::release`] or drop.
#[derive(Debug)]
pub struct Staged {
    /// Descriptors of the mounts, for bwrap's `--bind-fd`.
    pub mounts: Mounts,
    dir: StagedDir,
}

/// `mnt/<tid>`: removes everything below it when dropped, so a failure halfway through
/// staging leaves nothing behind.
#[derive(Debug)]
struct StagedDir {
    path: PathBuf,
    /// The mount points created below it: what a release undoes, rather than every name a
    /// run could have.
    created: Vec<&'static CStr>,
    released: bool,
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

    /// Clones each source into a detached mount, creates its mount point `mnt/<tid>/<name>`
    /// and returns the mounts' descriptors, with `mnt/<tid>` for the child to attach them in
    /// ([`crate::proc::ChildSetup::own_mounts`]). Any leftover of an earlier run of `tid` is
    /// removed first.
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
        let mut mount = |name: &'static CStr, source| {
            dir.created.push(name);
            mount_one(&tid_dir, name, source)
        };
        let mut mounts = Mounts {
            workspace: mount(WORKSPACE, sources.workspace)?,
            gateway: sources.gateway.map(|g| mount(GATEWAY, g)).transpose()?,
            venv: sources.venv.map(|v| mount(VENV, v)).transpose()?,
            home: sources.home.map(|v| mount(HOME, v)).transpose()?,
            tmp: sources.tmp.map(|v| mount(TMP, v)).transpose()?,
            server_dir: sources.server_dir.map(|v| mount(SERVER, v)).transpose()?,
            clients: sources.clients.map(|v| mount(CLIENTS, v)).transpose()?,
            attach: None,
        };
        mounts.attach = Some(tid_dir);
        Ok(Staged { mounts, dir })
    }

    /// Removes `mnt/<name>` and the mount points below it (best effort: a leftover only
    /// costs a directory).
    fn clean(&self, name: &str) {
        let dir = self.path.join(name);
        for child in ALL {
            remove_point(&dir, child);
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

/// Creates the mount point `mnt/<tid>/name` and returns a detached mount of `source` (not
/// recursive, like a plain bind: what is mounted below the directory stays out).
fn mount_one(
    tid_dir: &OwnedFd,
    name: &CStr,
    source: BorrowedFd<'_>,
) -> Result<OwnedFd, StageError> {
    let shown = name.to_string_lossy();
    fs::mkdirat(tid_dir, name, Mode::from_raw_mode(0o700)).map_err(io(format!("mkdir {shown}")))?;
    rustix::mount::open_tree(
        source,
        c"",
        OpenTreeFlags::OPEN_TREE_CLONE
            | OpenTreeFlags::OPEN_TREE_CLOEXEC
            | OpenTreeFlags::AT_EMPTY_PATH,
    )
    .map_err(io(format!("clone {shown}")))
}

/// `rmdir dir/name` (a missing one is fine). No mount of this launcher is ever attached in its
/// own namespace, so there is nothing to unmount first; were the directory a mount point in a
/// run's namespace still alive, the kernel detaches that mount there.
fn remove_point(dir: &Path, name: &CStr) -> Option<String> {
    let point = dir.join(name.to_string_lossy().as_ref());
    match std::fs::remove_dir(&point) {
        Ok(()) => None,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => Some(format!("rmdir {}: {e}", point.display())),
    }
}

impl Staged {
    /// Removes the mount points and `mnt/<tid>`; says what could not be undone. The mounts
    /// themselves went with the run's mount namespace (or, never attached, with their
    /// descriptors).
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
            .filter_map(|name| remove_point(&self.path, name))
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
