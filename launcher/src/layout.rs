//! The data directory (`$AGENTBOX_DATA`) as the launcher sees it: created with the right
//! owners at startup, and every per-task path reached from one trusted directory handle without
//! following a symlink (`policy::resolve`).
//!
//! Owners: `run/` root:service-group 1770 (sticky: the gateway, running as the service user,
//! binds `run/gateway.sock` there, but cannot unlink or replace root's `launcher.sock`, so it can
//! never swap it for a link between the launcher's bind and chmod), `state/` root 0711 (the
//! launcher's own records under it stay root-only; the service user can only reach
//! `state/gateway/`, its own 0700 directory), `tasks/` and `sockets/` service-owned 0711 (the
//! service user creates `tasks/<tid>/workspace` and the gateway `sockets/<tid>`; bwrap, as the
//! agent uid, only traverses them; no other user may list them, since a task id is what reaches
//! a snapshot's history and workspace, `tasks/<tid>` 0711 likewise),
//! `tasks/<tid>/logs/` root:service-group 0750 with root-owned log files, so the service user can
//! read output but never swap a log for a link the launcher would then read as root.
//! `backends/` and `backends/<model>/` root:service-group 0750 with root-owned log files, for the
//! same reason; `backends/<model>/home/` service-owned 0700 is the home of a backend process
//! when the service user has no passwd entry. `mnt/` root 0711 holds the launcher's staging
//! mounts ([`agentbox_sandbox::stage`]). `slots/` root:service-group 0750 holds the rollout
//! slots: `slots/<tid>/` root:service-group 0750 with the slot's `workspace/`, `home/` and `tmp/`
//! (its agent uid's, 0700), `server/` (agent uid, service group, 02710: the server creates its
//! socket there, the service user may only reach it; other users and other slots' uids cannot
//! even traverse `slots/`) and root-owned logs. Everything below `slots/<tid>` is removed when
//! the slot is deleted.

use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use agentbox_policy::config::ModelId;
use agentbox_policy::id::Tid;
use agentbox_policy::path::RelPath;
use agentbox_policy::resolve::{Kind, Resolved, Root};
use rustix::fs::{self, AtFlags, Mode, OFlags};
use rustix::io::Errno;

use agentbox_policy::path::PathError;
use agentbox_policy::resolve::ResolveError;
use agentbox_sandbox::stage::chmod_fd;
use agentbox_sandbox::walk::Owner;

/// Why the data directory could not be prepared at startup.
#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error("{path}: {message}")]
    Bad { path: String, message: String },
}

/// `mkdirat` where an existing entry is fine: the resolve that follows checks what it is.
fn mkdir_or_existing(dir: impl AsFd, name: &str, mode: u32) -> Result<(), Errno> {
    match fs::mkdirat(dir, name, Mode::from_raw_mode(mode)) {
        Ok(()) | Err(Errno::EXIST) => Ok(()),
        Err(e) => Err(e),
    }
}

fn bad(path: impl AsRef<Path>, message: impl Into<String>) -> LayoutError {
    LayoutError::Bad {
        path: path.as_ref().display().to_string(),
        message: message.into(),
    }
}

/// Why an operation on the prepared data directory failed.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// A path could not be reached without a symlink, a mount crossing, or does not exist.
    #[error("{0}")]
    Resolve(#[from] ResolveError),
    /// Reached, but owned by the wrong identity or with the wrong mode.
    #[error("refused: {path}: {why}")]
    Refused { path: String, why: String },
    /// A step that should not fail did.
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: Errno,
    },
    /// A name the launcher built broke the path rules (a bug).
    #[error("bad name: {0}")]
    Name(#[from] PathError),
}

fn io(what: impl Into<String>) -> impl FnOnce(Errno) -> DataError {
    let what = what.into();
    move |source| DataError::Io { what, source }
}

fn refused(r: &Resolved, why: String) -> DataError {
    DataError::Refused {
        path: r.display_path().to_owned(),
        why,
    }
}

/// Which sandbox kind a log file belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogKind {
    Agent,
    Check,
}

impl LogKind {
    fn prefix(self) -> &'static str {
        match self {
            LogKind::Agent => "agent",
            LogKind::Check => "check",
        }
    }
}

/// Which stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

impl Stream {
    fn suffix(self) -> &'static str {
        match self {
            Stream::Stdout => "stdout",
            Stream::Stderr => "stderr",
        }
    }
}

/// A rollout slot's directories, as handles (`O_PATH`).
#[derive(Debug)]
pub struct SlotDirs {
    /// `slots/<tid>`: root's; the logs are created through it.
    pub dir: OwnedFd,
    pub workspace: OwnedFd,
    pub home: OwnedFd,
    pub tmp: OwnedFd,
    /// Where the server creates its socket.
    pub server: OwnedFd,
}

/// Creates the root-owned file `name` in `dir` (replacing an old one) for writing.
pub fn create_file_in(dir: &OwnedFd, name: &str) -> Result<std::fs::File, DataError> {
    match fs::unlinkat(dir, name, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => {}
        Err(e) => return Err(io(format!("unlink {name}"))(e)),
    }
    let fd = fs::openat(
        dir,
        name,
        OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::from_raw_mode(0o600),
    )
    .map_err(io(format!("create {name}")))?;
    Ok(std::fs::File::from(fd))
}

/// The last `cap` bytes of the root-owned file `name` in `dir`, as text; missing: empty.
pub fn read_tail_in(dir: &OwnedFd, name: &str, cap: u64) -> String {
    use std::io::{Seek, SeekFrom};
    let Ok(fd) = fs::openat(
        dir,
        name,
        OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NONBLOCK,
        Mode::empty(),
    ) else {
        return String::new();
    };
    let mut file = std::fs::File::from(fd);
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = file.seek(SeekFrom::Start(len.saturating_sub(cap)));
    let mut buf = Vec::new();
    let _ = file.take(cap).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

/// The prepared data directory.
#[derive(Debug)]
pub struct DataDir {
    root: Root,
    service: Owner,
}

fn rel(parts: &[&str]) -> Result<RelPath, PathError> {
    let mut r = RelPath::empty();
    for p in parts {
        r = r.join(p)?;
    }
    Ok(r)
}

fn chown_fd(fd: &OwnedFd, uid: u32, gid: u32) -> Result<(), Errno> {
    fs::chownat(
        fd,
        "",
        Some(fs::Uid::from_raw(uid)),
        Some(fs::Gid::from_raw(gid)),
        AtFlags::EMPTY_PATH,
    )
}

impl DataDir {
    /// Creates (if needed) and checks the data directory and its fixed subdirectories.
    pub fn prepare(path: &Path, service: Owner) -> Result<DataDir, LayoutError> {
        if !path.exists() {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o711)
                .create(path)
                .map_err(|e| bad(path, e.to_string()))?;
        }
        let root = Root::open(path).map_err(|e| bad(path, e.to_string()))?;
        let id = *root.identity();
        // Root only: in a directory the service user owned, it could rename root's `state/`,
        // `backends/` or `mnt/` away and put directories (or links) of its own in their place.
        if id.uid != 0 {
            return Err(bad(
                path,
                format!(
                    "owned by uid {}, expected root (the service user could swap root's directories in it)",
                    id.uid
                ),
            ));
        }
        if id.mode & 0o022 != 0 {
            return Err(bad(
                path,
                format!("mode {:o} is group- or world-writable", id.mode),
            ));
        }
        let dir = DataDir { root, service };
        // Root's data dir is 0711 (traversable, not listable: task ids are not for everyone),
        // whatever the umask made of it or an older version left.
        if id.uid == 0 && id.mode & 0o7777 != 0o711 {
            let fd = dir
                .root
                .as_fd()
                .try_clone_to_owned()
                .map_err(|e| bad(path, format!("dup: {e}")))?;
            chmod_fd(&fd, 0o711).map_err(|e| bad(path, format!("chmod: {e}")))?;
        }
        dir.ensure_dir("run", 0, service.gid, 0o1770)?;
        dir.ensure_dir("state", 0, 0, 0o711)?;
        dir.ensure_dir("state/gateway", service.uid, service.gid, 0o700)?;
        dir.ensure_dir("tasks", service.uid, service.gid, 0o711)?;
        dir.ensure_dir("sockets", service.uid, service.gid, 0o711)?;
        dir.ensure_dir("backends", 0, service.gid, 0o750)?;
        dir.ensure_dir("mnt", 0, 0, 0o711)?;
        dir.ensure_dir("slots", 0, service.gid, 0o750)?;
        Ok(dir)
    }

    /// Creates `path` (one or two components) if missing and gives it `uid`, `gid` and `mode`.
    /// The directory is created through a handle of its parent (which must have been ensured
    /// first), so no symlink swapped in for the parent is followed.
    fn ensure_dir(&self, path: &str, uid: u32, gid: u32, mode: u32) -> Result<(), LayoutError> {
        let shown = self.root.path().join(path);
        let resolve = |p: &str| {
            RelPath::parse(p)
                .map_err(|e| bad(&shown, e.to_string()))
                .and_then(|r| {
                    self.root
                        .resolve_dir(&r)
                        .map_err(|e| bad(&shown, e.to_string()))
                })
        };
        let (parent, name) = match path.rsplit_once('/') {
            Some((parent, name)) => (Some(resolve(parent)?), name),
            None => (None, path),
        };
        let at = parent.as_ref().map_or(self.root.as_fd(), AsFd::as_fd);
        mkdir_or_existing(at, name, mode).map_err(|e| bad(&shown, format!("mkdir: {e}")))?;
        let fd = resolve(path)?.into_fd();
        chown_fd(&fd, uid, gid).map_err(|e| bad(&shown, format!("chown: {e}")))?;
        chmod_fd(&fd, mode).map_err(|e| bad(&shown, format!("chmod: {e}")))?;
        Ok(())
    }

    pub fn path(&self) -> &Path {
        self.root.path()
    }

    pub fn root(&self) -> &Root {
        &self.root
    }

    pub fn service(&self) -> Owner {
        self.service
    }

    /// `run/launcher.sock`.
    pub fn socket_path(&self) -> PathBuf {
        self.path().join("run").join("launcher.sock")
    }

    /// `state/agents`, created on first use.
    pub fn agent_state_dir(&self) -> PathBuf {
        self.path().join("state").join("agents")
    }

    /// `mnt/`, root-owned and writable by root only, as an `O_PATH` handle.
    pub fn mnt_dir(&self) -> Result<OwnedFd, DataError> {
        let dir = self.root.resolve_dir(&rel(&["mnt"])?)?;
        let id = dir.identity();
        if id.uid != 0 || id.mode & 0o022 != 0 {
            return Err(refused(
                &dir,
                format!(
                    "must be root-owned and writable by root only (uid {}, mode {:o})",
                    id.uid, id.mode
                ),
            ));
        }
        Ok(dir.into_fd())
    }

    /// `state/backends`, created on first use.
    pub fn backend_state_dir(&self) -> PathBuf {
        self.path().join("state").join("backends")
    }

    /// `backends/<model>/` (created root:service-group 0750 if missing), as an `O_PATH` handle
    /// the backend's logs are created and rotated through. Only root can write there, so names
    /// inside it cannot be swapped.
    pub fn backend_dir(&self, model: &ModelId) -> Result<OwnedFd, DataError> {
        let backends = self.root.resolve_dir(&rel(&["backends"])?)?;
        mkdir_or_existing(&backends, model.as_str(), 0o750).map_err(io("mkdir backend dir"))?;
        let dir = self
            .root
            .resolve_dir(&rel(&["backends", model.as_str()])?)?;
        if dir.identity().uid != 0 {
            return Err(refused(
                &dir,
                format!("is owned by uid {}, expected root", dir.identity().uid),
            ));
        }
        let fd = dir.into_fd();
        chown_fd(&fd, 0, self.service.gid).map_err(io("chown backend dir"))?;
        chmod_fd(&fd, 0o750).map_err(io("chmod backend dir"))?;
        Ok(fd)
    }

    /// `backends/<model>/home/`, created service-owned 0700 if missing; its path (the backend
    /// process, as the service user, uses it by name).
    pub fn backend_home(&self, model: &ModelId, dir: &OwnedFd) -> Result<PathBuf, DataError> {
        mkdir_or_existing(dir, "home", 0o700).map_err(io("mkdir backend home"))?;
        let home = self
            .root
            .resolve_dir(&rel(&["backends", model.as_str(), "home"])?)?;
        let fd = home.into_fd();
        chown_fd(&fd, self.service.uid, self.service.gid).map_err(io("chown backend home"))?;
        Ok(self
            .path()
            .join("backends")
            .join(model.as_str())
            .join("home"))
    }

    /// `tasks/`, as a handle (to ask its filesystem about project quotas).
    pub fn tasks_dir(&self) -> Result<OwnedFd, DataError> {
        Ok(self.root.resolve_dir(&rel(&["tasks"])?)?.into_fd())
    }

    /// `tasks/<tid>/workspace`: a directory owned by the service uid, reached without a
    /// symlink or mount crossing.
    pub fn workspace(&self, tid: &Tid) -> Result<Resolved, DataError> {
        let r = self
            .root
            .resolve_dir(&rel(&["tasks", tid.as_str(), "workspace"])?)?;
        let id = r.identity();
        if id.uid != self.service.uid {
            return Err(refused(
                &r,
                format!(
                    "is owned by uid {}, expected the service uid {}",
                    id.uid, self.service.uid
                ),
            ));
        }
        Ok(r)
    }

    /// `tasks/<tid>/workspace` as a restarted launcher finds it: owned by the service uid or
    /// still by a uid of the agent range (`is_agent`: the launcher died before handing it
    /// back); anything else is refused.
    pub fn workspace_for_recovery(
        &self,
        tid: &Tid,
        is_agent: impl Fn(u32) -> bool,
    ) -> Result<OwnedFd, DataError> {
        let r = self
            .root
            .resolve_dir(&rel(&["tasks", tid.as_str(), "workspace"])?)?;
        let uid = r.identity().uid;
        if uid != self.service.uid && !is_agent(uid) {
            return Err(refused(&r, format!("is owned by uid {uid}")));
        }
        Ok(r.into_fd())
    }

    /// `sockets/<tid>`, which must hold the gateway's `llm.sock`.
    pub fn gateway_dir(&self, tid: &Tid) -> Result<Resolved, DataError> {
        let dir = rel(&["sockets", tid.as_str()])?;
        let resolved = self.root.resolve_dir(&dir)?;
        self.root
            .resolve_kind(&rel(&["sockets", tid.as_str(), "llm.sock"])?, Kind::Socket)?;
        Ok(resolved)
    }

    /// `slots/`, root-owned, as a handle.
    pub fn slots_dir(&self) -> Result<OwnedFd, DataError> {
        let dir = self.root.resolve_dir(&rel(&["slots"])?)?;
        if dir.identity().uid != 0 {
            return Err(refused(
                &dir,
                format!("is owned by uid {}, expected root", dir.identity().uid),
            ));
        }
        Ok(dir.into_fd())
    }

    /// `slots/<tid>/` and its fresh, empty directories for the slot's `agent` uid. Whatever an
    /// earlier slot of `tid` left there is removed first (the caller holds the tid).
    pub fn create_slot(&self, tid: &Tid, agent: Owner) -> Result<SlotDirs, DataError> {
        let slots = self.slots_dir()?;
        agentbox_sandbox::walk::remove_tree(slots.as_fd(), tid.as_str()).map_err(|e| {
            DataError::Refused {
                path: format!("slots/{tid}"),
                why: format!("cannot remove a leftover: {e}"),
            }
        })?;
        fs::mkdirat(&slots, tid.as_str(), Mode::from_raw_mode(0o750))
            .map_err(io("mkdir slot dir"))?;
        let dir = self
            .root
            .resolve_dir(&rel(&["slots", tid.as_str()])?)?
            .into_fd();
        chown_fd(&dir, 0, self.service.gid).map_err(io("chown slot dir"))?;
        chmod_fd(&dir, 0o750).map_err(io("chmod slot dir"))?;
        let sub = |name: &str, uid: u32, gid: u32, mode: u32| -> Result<OwnedFd, DataError> {
            fs::mkdirat(&dir, name, Mode::from_raw_mode(0o700))
                .map_err(io(format!("mkdir slot {name}")))?;
            let fd = self
                .root
                .resolve_dir(&rel(&["slots", tid.as_str(), name])?)?
                .into_fd();
            chown_fd(&fd, uid, gid).map_err(io(format!("chown slot {name}")))?;
            chmod_fd(&fd, mode).map_err(io(format!("chmod slot {name}")))?;
            Ok(fd)
        };
        let workspace = sub("workspace", agent.uid, agent.gid, 0o700)?;
        let home = sub("home", agent.uid, agent.gid, 0o700)?;
        let tmp = sub("tmp", agent.uid, agent.gid, 0o700)?;
        let server = sub("server", agent.uid, self.service.gid, 0o2710)?;
        Ok(SlotDirs {
            dir,
            workspace,
            home,
            tmp,
            server,
        })
    }

    /// `slots/<tid>/<name>` as a regular file reached without a symlink.
    pub fn slot_path(&self, tid: &Tid, name: &str) -> PathBuf {
        self.path().join("slots").join(tid.as_str()).join(name)
    }

    /// Removes `slots/<tid>` and everything below it (call once nothing of the slot runs).
    pub fn remove_slot(&self, tid: &Tid) -> Result<(), DataError> {
        let slots = self.slots_dir()?;
        agentbox_sandbox::walk::remove_tree(slots.as_fd(), tid.as_str()).map_err(|e| {
            DataError::Refused {
                path: format!("slots/{tid}"),
                why: format!("cannot remove: {e}"),
            }
        })
    }

    /// The names under `slots/` (a restarted launcher removes them all).
    pub fn slot_names(&self) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.path().join("slots")) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str().map(str::to_owned))
            .collect()
    }

    /// Whether `tasks/<tid>/shadow.git` exists (as a directory, reached without symlinks).
    pub fn has_shadow(&self, tid: &Tid) -> bool {
        rel(&["tasks", tid.as_str(), "shadow.git"])
            .ok()
            .is_some_and(|r| self.root.resolve_dir(&r).is_ok())
    }

    /// `tasks/<tid>`, reached without a symlink (the git helpers act inside it only through
    /// this handle).
    pub fn task_dir(&self, tid: &Tid) -> Result<Resolved, DataError> {
        Ok(self.root.resolve_dir(&rel(&["tasks", tid.as_str()])?)?)
    }

    /// Whether `dir` has an entry `name` (of any type; a symlink is not followed).
    pub fn has_entry(dir: &Resolved, name: &str) -> bool {
        fs::statx(dir, name, AtFlags::SYMLINK_NOFOLLOW, fs::StatxFlags::TYPE).is_ok()
    }

    /// `tasks/<tid>`, created (service-owned) if missing.
    pub fn ensure_task_dir(&self, tid: &Tid) -> Result<Resolved, DataError> {
        let tasks = self.root.resolve_dir(&rel(&["tasks"])?)?;
        match fs::mkdirat(&tasks, tid.as_str(), Mode::from_raw_mode(0o711)) {
            Ok(()) => {
                let r = self.root.resolve_dir(&rel(&["tasks", tid.as_str()])?)?;
                let fd = fs::openat(&r, ".", OFlags::PATH | OFlags::CLOEXEC, Mode::empty())
                    .map_err(io("reopen"))?;
                chown_fd(&fd, self.service.uid, self.service.gid).map_err(io("chown task dir"))?;
            }
            Err(Errno::EXIST) => {}
            Err(e) => return Err(io("mkdir task dir")(e)),
        }
        self.root
            .resolve_dir(&rel(&["tasks", tid.as_str()])?)
            .map_err(DataError::from)
    }

    fn logs_dir(&self, tid: &Tid) -> Result<Resolved, DataError> {
        let task = self.ensure_task_dir(tid)?;
        mkdir_or_existing(&task, "logs", 0o750).map_err(io("mkdir logs"))?;
        let logs = self
            .root
            .resolve_dir(&rel(&["tasks", tid.as_str(), "logs"])?)?;
        let id = logs.identity();
        if id.uid != 0 {
            return Err(refused(
                &logs,
                format!("is owned by uid {}, expected root", id.uid),
            ));
        }
        let fd = fs::openat(&logs, ".", OFlags::PATH | OFlags::CLOEXEC, Mode::empty())
            .map_err(io("reopen"))?;
        chown_fd(&fd, 0, self.service.gid).map_err(io("chown logs"))?;
        Ok(logs)
    }

    /// Fresh, empty, root-owned `logs/<kind>.stdout` and `.stderr` for writing.
    pub fn create_logs(
        &self,
        tid: &Tid,
        kind: LogKind,
    ) -> Result<(std::fs::File, std::fs::File), DataError> {
        let logs = self.logs_dir(tid)?;
        let open = |stream: Stream| -> Result<std::fs::File, DataError> {
            let name = format!("{}.{}", kind.prefix(), stream.suffix());
            match fs::unlinkat(&logs, name.as_str(), AtFlags::empty()) {
                Ok(()) | Err(Errno::NOENT) => {}
                Err(e) => return Err(io("unlink {name}")(e)),
            }
            let fd = fs::openat(
                &logs,
                name.as_str(),
                OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o640),
            )
            .map_err(io(format!("create {name}")))?;
            Ok(std::fs::File::from(fd))
        };
        Ok((open(Stream::Stdout)?, open(Stream::Stderr)?))
    }

    /// Reads up to `cap` bytes of a log, as text (invalid UTF-8 replaced). A missing log reads
    /// as empty.
    pub fn read_log(&self, tid: &Tid, kind: LogKind, stream: Stream, cap: u64) -> String {
        let name = format!("{}.{}", kind.prefix(), stream.suffix());
        let Ok(r) = rel(&["tasks", tid.as_str(), "logs", &name]) else {
            return String::new();
        };
        let Ok(resolved) = self.root.resolve_kind(&r, Kind::File) else {
            return String::new();
        };
        // The launcher's logs are root's, one name each. `tasks/<tid>` is the service user's:
        // it could put a `logs/` of its own there, holding a hard link to a file only root
        // may read (where `fs.protected_hardlinks` is off), which this read would hand it.
        let id = resolved.identity();
        if id.uid != 0 || id.nlink != 1 {
            tracing::warn!(%tid, log = %name, uid = id.uid, nlink = id.nlink, "not reading a log that is not the launcher's");
            return String::new();
        }
        let path = format!("/proc/self/fd/{}", resolved.as_fd().as_raw_fd());
        let Ok(fd) = fs::open(
            path.as_str(),
            OFlags::RDONLY | OFlags::CLOEXEC | OFlags::NONBLOCK,
            Mode::empty(),
        ) else {
            return String::new();
        };
        let mut buf = Vec::new();
        let _ = std::fs::File::from(fd).take(cap).read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// Removes the log files of `kind` (and the logs directory once empty), so the service user
    /// can remove `tasks/<tid>`.
    pub fn remove_logs(&self, tid: &Tid, kind: LogKind) {
        let Ok(r) = rel(&["tasks", tid.as_str(), "logs"]) else {
            return;
        };
        let Ok(logs) = self.root.resolve_dir(&r) else {
            return;
        };
        for stream in [Stream::Stdout, Stream::Stderr] {
            let name = format!("{}.{}", kind.prefix(), stream.suffix());
            let _ = fs::unlinkat(&logs, name.as_str(), AtFlags::empty());
        }
        if let Ok(r) = rel(&["tasks", tid.as_str()])
            && let Ok(task) = self.root.resolve_dir(&r)
        {
            // Fails while the other kind's logs are still there, which is what we want.
            let _ = fs::unlinkat(&task, "logs", AtFlags::REMOVEDIR);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, symlink};

    const SERVICE: Owner = Owner {
        uid: 64201,
        gid: 64202,
    };

    /// A data directory prepared in a fresh temp dir (kept alive by the first element).
    fn prepared() -> (tempfile::TempDir, PathBuf, DataDir) {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        let d = DataDir::prepare(&data, SERVICE).unwrap();
        (tmp, data, d)
    }

    #[test]
    fn prepares_owners_and_modes() {
        let (_tmp, data, d) = prepared();
        let meta = |p: &str| std::fs::metadata(data.join(p)).unwrap();
        // Created and re-asserted 0711 (documented; 0755 let anyone list the task ids).
        assert_eq!(meta("").mode() & 0o7777, 0o711);
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&data, std::fs::Permissions::from_mode(0o755)).unwrap();
        DataDir::prepare(&data, SERVICE).unwrap();
        assert_eq!(meta("").mode() & 0o7777, 0o711);
        assert_eq!(
            (
                meta("run").uid(),
                meta("run").gid(),
                meta("run").mode() & 0o7777
            ),
            (0, SERVICE.gid, 0o1770)
        );
        assert_eq!(meta("state").mode() & 0o7777, 0o711);
        assert_eq!(
            (
                meta("state/gateway").uid(),
                meta("state/gateway").mode() & 0o7777
            ),
            (SERVICE.uid, 0o700)
        );
        assert_eq!(meta("tasks").uid(), SERVICE.uid);
        // Traversed, never listed: their names are task ids, and a task id reaches a
        // snapshot's history and workspace.
        for listed_by_none in ["tasks", "sockets"] {
            assert_eq!(
                meta(listed_by_none).mode() & 0o7777,
                0o711,
                "{listed_by_none}"
            );
        }
        let tid = Tid::parse("t1").unwrap();
        d.ensure_task_dir(&tid).unwrap();
        assert_eq!(meta("tasks/t1").mode() & 0o7777, 0o711);
        assert_eq!(d.socket_path(), data.join("run/launcher.sock"));
        // Idempotent.
        DataDir::prepare(&data, SERVICE).unwrap();
    }

    #[test]
    fn world_writable_data_dir_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        std::fs::create_dir(&data).unwrap();
        std::fs::set_permissions(&data, std::os::unix::fs::PermissionsExt::from_mode(0o777))
            .unwrap();
        assert!(DataDir::prepare(&data, SERVICE).is_err());
    }

    /// A data dir the service user owns is refused: it could rename root's `state/` away and
    /// make its own, with links to wherever root should write.
    #[test]
    fn a_data_dir_of_the_service_user_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        std::fs::create_dir(&data).unwrap();
        std::os::unix::fs::chown(&data, Some(SERVICE.uid), Some(SERVICE.gid)).unwrap();
        let err = DataDir::prepare(&data, SERVICE).unwrap_err().to_string();
        assert!(err.contains("expected root"), "{err}");
        assert!(
            std::fs::read_dir(&data).unwrap().next().is_none(),
            "nothing made in it"
        );
    }

    #[test]
    fn workspace_rules() {
        let (_tmp, data, d) = prepared();
        let tid = Tid::parse("t1").unwrap();
        assert!(matches!(
            d.workspace(&tid).unwrap_err(),
            DataError::Resolve(ResolveError::NotFound { .. })
        ));
        let ws = data.join("tasks/t1/workspace");
        std::fs::create_dir_all(&ws).unwrap();
        assert!(matches!(
            d.workspace(&tid).unwrap_err(),
            DataError::Refused { .. }
        ));
        std::os::unix::fs::chown(&ws, Some(SERVICE.uid), Some(SERVICE.gid)).unwrap();
        d.workspace(&tid).unwrap();
        // A symlinked task directory is refused even though its target is fine.
        let tid2 = Tid::parse("t2").unwrap();
        symlink(data.join("tasks/t1"), data.join("tasks/t2")).unwrap();
        assert!(matches!(
            d.workspace(&tid2).unwrap_err(),
            DataError::Resolve(ResolveError::Symlink { .. })
        ));
    }

    #[test]
    fn logs_are_root_owned_and_not_followed() {
        let (tmp, data, d) = prepared();
        let tid = Tid::parse("t1").unwrap();
        let (mut out, _err) = d.create_logs(&tid, LogKind::Check).unwrap();
        std::io::Write::write_all(&mut out, b"hello").unwrap();
        assert_eq!(d.read_log(&tid, LogKind::Check, Stream::Stdout, 3), "hel");
        let logs = data.join("tasks/t1/logs");
        assert_eq!(std::fs::metadata(&logs).unwrap().uid(), 0);
        // A log replaced by a link to a secret reads as empty.
        let secret = tmp.path().join("secret");
        std::fs::write(&secret, b"s3cret").unwrap();
        std::fs::remove_file(logs.join("check.stdout")).unwrap();
        symlink(&secret, logs.join("check.stdout")).unwrap();
        assert_eq!(d.read_log(&tid, LogKind::Check, Stream::Stdout, 100), "");
        // A hard link to it (where protected_hardlinks would allow one), or a log of another
        // owner, in a logs/ the service user swapped in: empty too.
        std::fs::remove_file(logs.join("check.stdout")).unwrap();
        std::fs::hard_link(&secret, logs.join("check.stdout")).unwrap();
        assert_eq!(d.read_log(&tid, LogKind::Check, Stream::Stdout, 100), "");
        std::fs::remove_file(logs.join("check.stdout")).unwrap();
        std::fs::write(logs.join("check.stdout"), b"theirs").unwrap();
        std::os::unix::fs::chown(logs.join("check.stdout"), Some(SERVICE.uid), None).unwrap();
        assert_eq!(d.read_log(&tid, LogKind::Check, Stream::Stdout, 100), "");
        d.remove_logs(&tid, LogKind::Check);
        assert!(!logs.exists());
    }
}
