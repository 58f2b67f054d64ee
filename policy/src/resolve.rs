//! Opening a path below a trusted root directory without following a symlink anywhere and
//! without crossing a mount, returning an `O_PATH` handle plus the identity of what was opened
//! so a caller can later confirm it still acts on the same object.
//!
//! Why: the launcher (root) chowns, bind-mounts and runs git on paths that an agent or a caller
//! may have prepared. A symlink or a mount placed in any component redirects that privileged
//! work to the host (runc CVE-2021-30465 and the libpathrs catalogue, research §6). So:
//!
//! - the trusted root is opened once with `O_PATH|O_DIRECTORY|O_NOFOLLOW` ([`Root::open`]);
//! - a relative [`RelPath`] is opened with `openat2(RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH |
//!   RESOLVE_NO_XDEV | RESOLVE_NO_MAGICLINKS)`, or, where the kernel lacks `openat2` (or
//!   [`Strategy::Fallback`] is forced), one component at a time with
//!   `openat(O_PATH|O_NOFOLLOW)` and a stat of each step (not a symlink, same mount as the root);
//! - everything is `O_PATH|O_CLOEXEC`: nothing is created, a FIFO is never opened for I/O (so
//!   it cannot block), and no handle leaks into a child process;
//! - [`Resolved::recheck`] re-resolves by name and compares `(dev, ino)` with the handle, which
//!   catches a directory swapped for a symlink or another directory after the first check.
//!
//! "Same mount" means the same mount id (`statx` `STATX_MNT_ID`) when the kernel reports it,
//! matching what `RESOLVE_NO_XDEV` enforces (a same-filesystem bind mount has the same `st_dev`,
//! so the device number alone would miss it); without a mount id the fallback compares `st_dev`.

use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{self, AtFlags, FileType, Mode, OFlags, ResolveFlags, StatxFlags};
use rustix::io::Errno;

use crate::path::{PathError, PathReason, RelPath, validate_component};

/// How many times an `openat2` that failed with `EAGAIN` (a concurrent rename or mount raced
/// the lookup) is retried before giving up.
const EAGAIN_RETRIES: usize = 32;

/// The type of a filesystem object.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Kind {
    Dir,
    File,
    Symlink,
    Socket,
    Fifo,
    CharDev,
    BlockDev,
}

impl Kind {
    fn from_mode(mode: u32) -> Option<Kind> {
        match FileType::from_raw_mode(mode) {
            FileType::Directory => Some(Kind::Dir),
            FileType::RegularFile => Some(Kind::File),
            FileType::Symlink => Some(Kind::Symlink),
            FileType::Socket => Some(Kind::Socket),
            FileType::Fifo => Some(Kind::Fifo),
            FileType::CharacterDevice => Some(Kind::CharDev),
            FileType::BlockDevice => Some(Kind::BlockDev),
            FileType::Unknown => None,
        }
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Kind::Dir => "directory",
            Kind::File => "regular file",
            Kind::Symlink => "symlink",
            Kind::Socket => "socket",
            Kind::Fifo => "fifo",
            Kind::CharDev => "character device",
            Kind::BlockDev => "block device",
        })
    }
}

/// What an open handle refers to, as the kernel reported it at stat time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Identity {
    pub dev: u64,
    pub ino: u64,
    /// `STATX_MNT_ID`, when the kernel reports it (Linux 5.8+).
    pub mnt_id: Option<u64>,
    pub uid: u32,
    pub gid: u32,
    pub kind: Kind,
    /// More than 1 on a non-directory means hard links exist elsewhere: chowning such a file
    /// would also chown those other names (the systemd-tmpfiles `hardlink_vulnerable` rule).
    pub nlink: u64,
    /// Permission bits only (`0o7777`, setuid/setgid/sticky included); the type is in `kind`.
    pub mode: u32,
}

impl Identity {
    /// Stats an open handle (an `O_PATH` handle works) with `statx`, or `fstat` where `statx`
    /// is unavailable.
    pub fn of(fd: BorrowedFd<'_>) -> Result<Identity, Errno> {
        let mask = StatxFlags::BASIC_STATS | StatxFlags::MNT_ID;
        match fs::statx(fd, "", AtFlags::EMPTY_PATH, mask) {
            Ok(stx) => {
                let mode = u32::from(stx.stx_mode);
                let mnt_id =
                    (stx.stx_mask & StatxFlags::MNT_ID.bits() != 0).then_some(stx.stx_mnt_id);
                Ok(Identity {
                    dev: fs::makedev(stx.stx_dev_major, stx.stx_dev_minor),
                    ino: stx.stx_ino,
                    mnt_id,
                    uid: stx.stx_uid,
                    gid: stx.stx_gid,
                    kind: Kind::from_mode(mode).ok_or(Errno::INVAL)?,
                    nlink: u64::from(stx.stx_nlink),
                    mode: mode & 0o7777,
                })
            }
            Err(Errno::NOSYS) => {
                let st = fs::fstat(fd)?;
                #[allow(clippy::useless_conversion)] // field widths differ between architectures
                let (dev, ino, nlink, mode) = (
                    u64::from(st.st_dev),
                    u64::from(st.st_ino),
                    u64::from(st.st_nlink),
                    u32::from(st.st_mode),
                );
                Ok(Identity {
                    dev,
                    ino,
                    mnt_id: None,
                    uid: st.st_uid,
                    gid: st.st_gid,
                    kind: Kind::from_mode(mode).ok_or(Errno::INVAL)?,
                    nlink,
                    mode: mode & 0o7777,
                })
            }
            Err(e) => Err(e),
        }
    }

    /// Whether two identities name the same filesystem object: same device and inode, and the
    /// same mount when both mount ids are known.
    pub fn same_object(&self, other: &Identity) -> bool {
        let mount_agrees = match (self.mnt_id, other.mnt_id) {
            (Some(a), Some(b)) => a == b,
            (None, _) | (_, None) => true,
        };
        self.dev == other.dev && self.ino == other.ino && mount_agrees
    }

    /// Whether `other` lies on the same mount as `self`, by mount id when both are known,
    /// otherwise by device.
    fn same_mount(&self, other: &Identity) -> bool {
        match (self.mnt_id, other.mnt_id) {
            (Some(a), Some(b)) => a == b,
            (None, _) | (_, None) => self.dev == other.dev,
        }
    }
}

/// Why a path could not be opened, or no longer names what it named.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("root {path} must be an absolute path")]
    RootNotAbsolute { path: String },
    #[error("{path}: a symlink is in the way")]
    Symlink { path: String },
    #[error("{path}: crosses a mount point")]
    CrossesMount { path: String },
    #[error("{path}: does not exist")]
    NotFound { path: String },
    #[error("{path}: a parent component is not a directory")]
    NotADirectory { path: String },
    #[error("{path}: is a {found}, expected a {expected}")]
    WrongKind {
        path: String,
        expected: Kind,
        found: Kind,
    },
    #[error("{path}: no longer names the object that was resolved")]
    Changed { path: String },
    #[error("{path}: was resolved under a different root")]
    OtherRoot { path: String },
    #[error("{path}: refused component: {source}")]
    BadComponent {
        path: String,
        #[source]
        source: PathError,
    },
    #[error("{path}: openat2 is not available on this kernel")]
    Openat2Unavailable { path: String },
    #[error(transparent)]
    Io(#[from] PathIoError),
}

/// A system call on a path failed: the path as shown, the call, its errno. The resolver's
/// and the sandbox walker's errors share it.
#[derive(Debug, thiserror::Error)]
#[error("{path}: {op}: {source}")]
pub struct PathIoError {
    pub path: String,
    pub op: &'static str,
    #[source]
    pub source: Errno,
}

impl PathIoError {
    /// `op` failed at `path` with `source`.
    pub fn new(path: impl Into<String>, op: &'static str, source: Errno) -> Self {
        PathIoError {
            path: path.into(),
            op,
            source,
        }
    }
}

/// Which resolution code path to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Strategy {
    /// `openat2`, falling back to the component walk when the kernel returns `ENOSYS`.
    #[default]
    Auto,
    /// `openat2` only; `ENOSYS` is an error. Lets tests prove the kernel path is exercised.
    Openat2,
    /// The component walk only; lets tests cover the code that old kernels would run.
    Fallback,
}

/// A trusted directory that every resolution starts from.
#[derive(Debug)]
pub struct Root {
    fd: OwnedFd,
    path: PathBuf,
    identity: Identity,
    strategy: Strategy,
}

impl Root {
    /// Opens a trusted root, e.g. the data dir or a configured repo root. The path comes from
    /// configuration, so symlinks in its parents are tolerated (`/var` may be one), but the last
    /// component must itself be a directory, not a symlink to one: otherwise whoever can
    /// replace that link chooses the root.
    pub fn open(path: impl AsRef<Path>) -> Result<Root, ResolveError> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        if !path.is_absolute() {
            return Err(ResolveError::RootNotAbsolute { path: shown });
        }
        let flags = OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = match fs::openat(fs::CWD, path, flags, Mode::empty()) {
            Ok(fd) => fd,
            // A trailing symlink with O_NOFOLLOW|O_DIRECTORY fails with ENOTDIR (or ELOOP):
            // look at the name again, without following, only to say what is there instead.
            Err(Errno::NOTDIR | Errno::LOOP) => {
                return Err(classify_not_dir(path, shown));
            }
            Err(e) => return Err(map_errno(e, shown, "open root")),
        };
        let identity = Identity::of(fd.as_fd())
            .map_err(|e| PathIoError::new(shown.as_str(), "stat root", e))?;
        if identity.kind != Kind::Dir {
            return Err(ResolveError::WrongKind {
                path: shown,
                expected: Kind::Dir,
                found: identity.kind,
            });
        }
        Ok(Root {
            fd,
            path: path.to_owned(),
            identity,
            strategy: Strategy::Auto,
        })
    }

    pub fn with_strategy(mut self, strategy: Strategy) -> Root {
        self.strategy = strategy;
        self
    }

    pub fn strategy(&self) -> Strategy {
        self.strategy
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    /// Opens `rel` below the root, whatever its type.
    pub fn resolve(&self, rel: &RelPath) -> Result<Resolved, ResolveError> {
        self.open_beneath(rel, None)
    }

    /// Opens `rel` below the root and requires a directory (`O_DIRECTORY` on the kernel path).
    pub fn resolve_dir(&self, rel: &RelPath) -> Result<Resolved, ResolveError> {
        self.open_beneath(rel, Some(Kind::Dir))
    }

    /// Opens `rel` below the root and requires the given type.
    pub fn resolve_kind(&self, rel: &RelPath, kind: Kind) -> Result<Resolved, ResolveError> {
        self.open_beneath(rel, Some(kind))
    }

    /// Re-opens the root by its path and confirms it is still the directory held open, e.g.
    /// after a restart of whatever manages it.
    pub fn recheck(&self) -> Result<(), ResolveError> {
        let again = Root::open(&self.path)?;
        if again.identity.same_object(&self.identity) {
            Ok(())
        } else {
            Err(ResolveError::Changed {
                path: self.path.display().to_string(),
            })
        }
    }

    fn shown(&self, rel: &str) -> String {
        if rel.is_empty() {
            self.path.display().to_string()
        } else {
            format!("{}/{rel}", self.path.display())
        }
    }

    fn open_beneath(&self, rel: &RelPath, expect: Option<Kind>) -> Result<Resolved, ResolveError> {
        let shown = self.shown(rel.as_str());
        // RelPath is valid by construction; checking again costs little and keeps this module
        // safe even if a bad RelPath were ever built by mistake.
        if rel.as_str().starts_with('/') {
            return Err(ResolveError::BadComponent {
                path: shown,
                source: PathError {
                    shown: crate::id::shown(rel.as_str()),
                    reason: PathReason::Absolute,
                },
            });
        }
        for component in rel.components() {
            validate_component(component).map_err(|source| ResolveError::BadComponent {
                path: shown.clone(),
                source,
            })?;
        }
        let want_dir = expect == Some(Kind::Dir);
        let fd = match self.strategy {
            Strategy::Fallback => self.walk(rel, want_dir)?,
            Strategy::Openat2 => match self.openat2(rel, want_dir, &shown)? {
                Some(fd) => fd,
                None => return Err(ResolveError::Openat2Unavailable { path: shown }),
            },
            Strategy::Auto => match self.openat2(rel, want_dir, &shown)? {
                Some(fd) => fd,
                None => self.walk(rel, want_dir)?,
            },
        };
        // Both code paths already guarantee what this checks; checking the final handle once
        // more is the last line if either were ever subtly wrong.
        let identity = self.checked_identity(fd.as_fd(), &shown)?;
        if let Some(expected) = expect
            && identity.kind != expected
        {
            return Err(ResolveError::WrongKind {
                path: shown,
                expected,
                found: identity.kind,
            });
        }
        Ok(Resolved {
            fd,
            rel: rel.clone(),
            identity,
            root: self.identity,
            shown,
        })
    }

    /// Stats an opened handle and refuses it if it is a symlink or on another mount than the
    /// root: what every component of the walk, and the final handle of either strategy, must
    /// pass.
    fn checked_identity(&self, fd: BorrowedFd<'_>, shown: &str) -> Result<Identity, ResolveError> {
        let identity = Identity::of(fd).map_err(|e| PathIoError::new(shown, "stat", e))?;
        if identity.kind == Kind::Symlink {
            return Err(ResolveError::Symlink {
                path: shown.to_owned(),
            });
        }
        if !self.identity.same_mount(&identity) {
            return Err(ResolveError::CrossesMount {
                path: shown.to_owned(),
            });
        }
        Ok(identity)
    }

    /// `Ok(None)` means the kernel has no `openat2`.
    fn openat2(
        &self,
        rel: &RelPath,
        want_dir: bool,
        shown: &str,
    ) -> Result<Option<OwnedFd>, ResolveError> {
        let name = if rel.is_empty() { "." } else { rel.as_str() };
        let mut flags = OFlags::PATH | OFlags::CLOEXEC;
        if want_dir {
            flags |= OFlags::DIRECTORY;
        }
        let how = ResolveFlags::NO_SYMLINKS
            | ResolveFlags::NO_MAGICLINKS
            | ResolveFlags::BENEATH
            | ResolveFlags::NO_XDEV;
        let mut tries = 0;
        loop {
            match fs::openat2(self.fd.as_fd(), name, flags, Mode::empty(), how) {
                Ok(fd) => return Ok(Some(fd)),
                Err(Errno::NOSYS) => return Ok(None),
                Err(Errno::AGAIN) if tries < EAGAIN_RETRIES => tries += 1,
                Err(e) => return Err(map_errno(e, shown.to_owned(), "openat2")),
            }
        }
    }

    /// The fallback: one `openat(O_PATH|O_NOFOLLOW)` per component, each checked before it is
    /// used as the parent of the next. `O_NOFOLLOW` with `O_PATH` opens a symlink itself rather
    /// than failing, so the stat sees it and refuses it.
    fn walk(&self, rel: &RelPath, want_dir: bool) -> Result<OwnedFd, ResolveError> {
        let mut current = fs::openat(
            self.fd.as_fd(),
            ".",
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| map_errno(e, self.shown(""), "reopen root"))?;
        let components: Vec<&str> = rel.components().collect();
        let mut so_far = String::new();
        for (index, component) in components.iter().enumerate() {
            if !so_far.is_empty() {
                so_far.push('/');
            }
            so_far.push_str(component);
            let shown = self.shown(&so_far);
            let next = fs::openat(
                current.as_fd(),
                *component,
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .map_err(|e| map_errno(e, shown.clone(), "openat"))?;
            let id = self.checked_identity(next.as_fd(), &shown)?;
            let last = index + 1 == components.len();
            if (!last || want_dir) && id.kind != Kind::Dir {
                return Err(if last {
                    ResolveError::WrongKind {
                        path: shown,
                        expected: Kind::Dir,
                        found: id.kind,
                    }
                } else {
                    ResolveError::NotADirectory { path: shown }
                });
            }
            current = next;
        }
        Ok(current)
    }
}

impl AsFd for Root {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

fn classify_not_dir(path: &Path, shown: String) -> ResolveError {
    match fs::statat(fs::CWD, path, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => match Kind::from_mode(st.st_mode) {
            Some(Kind::Symlink) => ResolveError::Symlink { path: shown },
            Some(found) => ResolveError::WrongKind {
                path: shown,
                expected: Kind::Dir,
                found,
            },
            None => PathIoError::new(shown, "open root", Errno::NOTDIR).into(),
        },
        Err(e) => map_errno(e, shown, "stat root"),
    }
}

fn map_errno(e: Errno, path: String, op: &'static str) -> ResolveError {
    match e {
        // With RESOLVE_NO_SYMLINKS, ELOOP is exactly "a symlink was met".
        Errno::LOOP => ResolveError::Symlink { path },
        // RESOLVE_NO_XDEV, or RESOLVE_BENEATH escaping; `..` never reaches here, so a mount.
        Errno::XDEV => ResolveError::CrossesMount { path },
        Errno::NOENT => ResolveError::NotFound { path },
        Errno::NOTDIR => ResolveError::NotADirectory { path },
        source => PathIoError { path, op, source }.into(),
    }
}

/// An opened object below a [`Root`]: an `O_PATH|O_CLOEXEC` handle, the relative path it was
/// reached by, and its identity when opened.
#[derive(Debug)]
pub struct Resolved {
    fd: OwnedFd,
    rel: RelPath,
    identity: Identity,
    root: Identity,
    shown: String,
}

impl Resolved {
    pub fn identity(&self) -> &Identity {
        &self.identity
    }

    pub fn kind(&self) -> Kind {
        self.identity.kind
    }

    pub fn rel(&self) -> &RelPath {
        &self.rel
    }

    /// Root path and relative path joined, for messages.
    pub fn display_path(&self) -> &str {
        &self.shown
    }

    pub fn into_fd(self) -> OwnedFd {
        self.fd
    }

    pub fn expect(&self, expected: Kind) -> Result<(), ResolveError> {
        if self.identity.kind == expected {
            Ok(())
        } else {
            Err(ResolveError::WrongKind {
                path: self.shown.clone(),
                expected,
                found: self.identity.kind,
            })
        }
    }

    pub fn expect_dir(&self) -> Result<(), ResolveError> {
        self.expect(Kind::Dir)
    }

    pub fn expect_file(&self) -> Result<(), ResolveError> {
        self.expect(Kind::File)
    }

    pub fn expect_socket(&self) -> Result<(), ResolveError> {
        self.expect(Kind::Socket)
    }

    /// Confirms the name still leads to this handle's object: resolves the relative path again
    /// under `root` with the same rules and compares `(dev, ino)` (and mount id). Any error,
    /// including a symlink or mount now in the way, means the caller must not act on the name.
    /// Returns a fresh identity of the handle (owner, mode and link count may have changed).
    pub fn recheck(&self, root: &Root) -> Result<Identity, ResolveError> {
        if !root.identity.same_object(&self.root) {
            return Err(ResolveError::OtherRoot {
                path: self.shown.clone(),
            });
        }
        let now = Identity::of(self.fd.as_fd())
            .map_err(|e| PathIoError::new(self.shown.as_str(), "stat", e))?;
        let again = root.resolve(&self.rel)?;
        if again.identity.same_object(&now) && again.identity.kind == now.kind {
            Ok(now)
        } else {
            Err(ResolveError::Changed {
                path: self.shown.clone(),
            })
        }
    }
}

impl AsFd for Resolved {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn both() -> [Strategy; 2] {
        [Strategy::Openat2, Strategy::Fallback]
    }

    #[test]
    fn resolves_plain_dirs_and_files() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("a/b")).unwrap();
        std::fs::write(tmp.path().join("a/b/f"), b"x").unwrap();
        for s in both() {
            let root = Root::open(tmp.path()).unwrap().with_strategy(s);
            let d = root.resolve_dir(&RelPath::parse("a/b").unwrap()).unwrap();
            d.expect_dir().unwrap();
            let f = root.resolve(&RelPath::parse("a/b/f").unwrap()).unwrap();
            f.expect_file().unwrap();
            assert!(f.expect_dir().is_err());
            assert_eq!(f.identity().nlink, 1);
            f.recheck(&root).unwrap();
            let me = root.resolve(&RelPath::empty()).unwrap();
            assert!(me.identity().same_object(root.identity()));
        }
    }

    #[test]
    fn symlink_refused_everywhere() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(tmp.path().join("a/b")).unwrap();
        symlink("b", tmp.path().join("a/l")).unwrap();
        for s in both() {
            let root = Root::open(tmp.path()).unwrap().with_strategy(s);
            for rel in ["a/l", "a/l/x"] {
                let err = root.resolve(&RelPath::parse(rel).unwrap()).unwrap_err();
                assert!(
                    matches!(err, ResolveError::Symlink { .. }),
                    "{s:?} {rel}: {err}"
                );
            }
        }
    }

    #[test]
    fn root_must_not_be_a_symlink() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::create_dir(tmp.path().join("d")).unwrap();
        symlink("d", tmp.path().join("l")).unwrap();
        std::fs::write(tmp.path().join("f"), b"").unwrap();
        assert!(matches!(
            Root::open(tmp.path().join("l")).unwrap_err(),
            ResolveError::Symlink { .. }
        ));
        assert!(matches!(
            Root::open(tmp.path().join("f")).unwrap_err(),
            ResolveError::WrongKind {
                found: Kind::File,
                ..
            }
        ));
        assert!(matches!(
            Root::open("relative").unwrap_err(),
            ResolveError::RootNotAbsolute { .. }
        ));
        assert!(matches!(
            Root::open(tmp.path().join("missing")).unwrap_err(),
            ResolveError::NotFound { .. }
        ));
        let root = Root::open(tmp.path().join("d")).unwrap();
        root.recheck().unwrap();
    }
}
