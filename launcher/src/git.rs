//! The git helpers: snapshot a repository into a task, collect the agent's work onto
//! `agent/<tid>`, deliver that branch into the repository, delete an agent branch.
//!
//! Git executes code from configuration (`core.fsmonitor`, hooks, filters, `core.sshCommand`,
//! pagers...), so every invocation (research §8):
//! - runs as the service uid, never root (repositories must be owned by the service uid; root
//!   would also trip `safe.directory`), with `setgroups([])` done by std when dropping from root;
//! - gets a cleared environment with system and global config disabled (`GIT_CONFIG_NOSYSTEM=1`,
//!   `GIT_CONFIG_GLOBAL=/dev/null`, `HOME=/nonexistent`) and command-line overrides that beat
//!   repository config: hooks at `/dev/null`, no fsmonitor, no protocols but `file`, no
//!   submodule recursion, no auto-gc; `git -c` values also reach the `upload-pack` it spawns;
//! - never runs with an agent-writable directory as `GIT_DIR`: collection uses the trusted
//!   shadow as `GIT_DIR` and the workspace only as `GIT_WORK_TREE`, with a temporary index
//!   outside it, so a `.git/config` or hook the agent planted is just a file;
//! - copies objects by pack transfer (`fetch`, `clone --no-local`), never by hard link, so
//!   the task's shadow and workspace share no inode with the repository (CVE-2024-32020/32021);
//! - names refs only after validating them, always behind `--end-of-options` or as full
//!   refnames, and writes only `refs/heads/base` and `refs/heads/agent/<tid>` in the shadow and
//!   `refs/heads/agent/<tid>` in the repository; HEAD and work trees are never touched.
//!
//! Repositories are found by walking up from the request path to (not including) the
//! configured root it lies in, each step opened without following symlinks. A linked worktree
//! (`.git` is a file saying `gitdir: <abs path>`) is followed only when that git dir, and the
//! common dir its `commondir` names, lie inside the configured roots, are reached without a
//! symlink and belong to the service uid: git would otherwise read refs, objects and config
//! from wherever the file points. Relative `gitdir:` lines (submodule checkouts) are refused
//! rather than normalized.

use std::ffi::{CString, OsString};
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use agentbox_policy::id::{AgentBranch, Tid};
use agentbox_policy::path::{EqualsRoot, RelPath, RequestPath, RootPath};
use agentbox_policy::resolve::{Identity, Kind, ResolveError, Resolved, Root};
use agentbox_sandbox::proc;
use agentbox_sandbox::walk::Owner;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, StatxFlags};
use rustix::io::Errno;

/// Why a git helper failed. Mapped to HTTP in [`crate::error`].
#[derive(Debug, thiserror::Error)]
pub enum GitError {
    /// The request's path broke a string rule or lies outside the roots.
    #[error("invalid path: {0}")]
    InvalidPath(String),
    /// A ref the caller named is unacceptable.
    #[error("invalid ref: {0}")]
    InvalidRef(String),
    /// A valid ref that does not name a commit of the repository.
    #[error("invalid ref: {0}")]
    NoSuchCommit(String),
    /// A path on the way to the repository is refused or missing.
    #[error("{0}")]
    Resolve(#[from] ResolveError),
    /// The repository (or a git file in it) is refused: wrong owner or type, a linked
    /// worktree pointing somewhere it must not. Never carries the content of a file.
    #[error("refused: {0}")]
    Refused(String),
    /// No repository at or above the path.
    #[error("not found: {0}")]
    NoRepository(String),
    /// The branch to deliver or delete does not exist.
    #[error("not found: {0}")]
    BranchMissing(String),
    /// The branch is checked out in a worktree of the repository.
    #[error("conflict: {0}")]
    CheckedOut(String),
    /// git did not finish in time (it was killed).
    #[error("git {what}: timed out after {}s", after.as_secs())]
    Timeout { what: String, after: Duration },
    /// git could not be started.
    #[error("git {what}: cannot run: {source}")]
    Spawn {
        what: String,
        #[source]
        source: std::io::Error,
    },
    /// git exited unsuccessfully.
    #[error("git {what}: {status}: {stderr}")]
    Failed {
        what: String,
        /// The exit code, if it exited (not killed).
        code: Option<i32>,
        status: String,
        /// The end of its stderr, escaped.
        stderr: String,
    },
    /// git succeeded but printed something unexpected.
    #[error("git {what}: unexpected output")]
    BadOutput { what: String },
    /// The workspace could not be scanned for nested repositories or its index removed.
    #[error("workspace: {0}")]
    Workspace(String),
    /// A blocking helper thread failed.
    #[error("a blocking task failed: {0}")]
    Blocking(#[from] tokio::task::JoinError),
}

/// The git binary (absolute: a `PATH` lookup is a choice someone else could make).
pub const GIT: &str = "/usr/bin/git";
/// How long one git command may run.
pub const GIT_TIMEOUT: Duration = Duration::from_secs(600);
/// The most of a git command's stdout kept: every command we run prints an id or a short
/// list; more is an error, never a silently cut answer.
pub const STDOUT_MAX: u64 = 4 << 20;
/// The most of its stderr kept: its end, what an error shows (`shown`). git writes a line per
/// file for some workspace contents (an agent's `.gitattributes` can ask for CRLF warnings on
/// every file), so kept whole it could grow root's heap by gigabytes.
pub const STDERR_KEPT: usize = 64 << 10;

/// The end of a stream: at most [`STDERR_KEPT`] bytes (up to twice that between trims).
#[derive(Debug, Default)]
struct Tail(Vec<u8>);

impl proc::Sink for &mut Tail {
    async fn write(&mut self, chunk: &[u8]) {
        self.0.extend_from_slice(chunk);
        if self.0.len() > 2 * STDERR_KEPT {
            let cut = self.0.len() - STDERR_KEPT;
            self.0.drain(..cut);
        }
    }

    async fn finish(&mut self) {}
}
/// The ref in the shadow holding the snapshot commit.
pub const BASE_REF: &str = "refs/heads/base";

/// Overrides that beat any repository configuration.
const HARDENING: &[&str] = &[
    "core.hooksPath=/dev/null",
    "core.fsmonitor=false",
    "core.untrackedCache=false",
    "core.sshCommand=/bin/false",
    "core.askPass=/bin/false",
    "core.pager=cat",
    "core.autocrlf=false",
    "core.safecrlf=false",
    "core.symlinks=true",
    "credential.helper=",
    "protocol.allow=never",
    "protocol.file.allow=always",
    "transfer.fsckObjects=true",
    "fetch.recurseSubmodules=false",
    "submodule.recurse=false",
    "gc.auto=0",
    "maintenance.auto=false",
    "advice.detachedHead=false",
    "init.defaultBranch=base",
];

/// Runs git as the service identity.
#[derive(Debug, Clone)]
pub struct Git {
    pub run_as: Owner,
    pub binary: PathBuf,
    pub timeout: Duration,
}

/// A repository found by [`discover`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repo {
    /// The top-level directory (the work tree).
    pub top: PathBuf,
    /// Its `.git` directory.
    pub git_dir: PathBuf,
}

fn shown(bytes: &[u8]) -> String {
    let text = String::from_utf8_lossy(bytes);
    let tail: String = text
        .trim()
        .chars()
        .rev()
        .take(2000)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect();
    format!("{tail:?}")
}

impl Git {
    pub fn new(run_as: Owner) -> Git {
        Git {
            run_as,
            binary: PathBuf::from(GIT),
            timeout: GIT_TIMEOUT,
        }
    }

    /// Runs `git <hardening> <args>` in `cwd` with `env` added to the fixed environment;
    /// returns stdout, or the failure with stderr. Both are read as they come: at most
    /// [`STDOUT_MAX`] of stdout (past it, `BadOutput`), the last [`STDERR_KEPT`] of stderr.
    pub async fn run(
        &self,
        cwd: &Path,
        env: &[(&str, &Path)],
        args: &[&std::ffi::OsStr],
    ) -> Result<Vec<u8>, GitError> {
        let mut cmd = tokio::process::Command::new(&self.binary);
        cmd.env_clear()
            .env("PATH", "/usr/bin:/bin")
            .env("HOME", "/nonexistent")
            .env("LC_ALL", "C")
            .env("GIT_CONFIG_NOSYSTEM", "1")
            .env("GIT_CONFIG_GLOBAL", "/dev/null")
            .env("GIT_TERMINAL_PROMPT", "0")
            .env("GIT_ASKPASS", "/bin/false")
            .env("SSH_ASKPASS", "/bin/false")
            .env("GIT_NO_REPLACE_OBJECTS", "1")
            .env("GIT_ATTR_NOSYSTEM", "1")
            .env("GIT_AUTHOR_NAME", "agentbox")
            .env("GIT_AUTHOR_EMAIL", "agentbox@localhost")
            .env("GIT_COMMITTER_NAME", "agentbox")
            .env("GIT_COMMITTER_EMAIL", "agentbox@localhost");
        for (k, v) in env {
            cmd.env(k, v);
        }
        for h in HARDENING {
            cmd.arg("-c").arg(h);
        }
        cmd.args(args)
            .current_dir(cwd)
            .uid(self.run_as.uid)
            .gid(self.run_as.gid)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        let what = args
            .iter()
            .take(2)
            .map(|a| a.to_string_lossy())
            .collect::<Vec<_>>()
            .join(" ");
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(source) => return Err(GitError::Spawn { what, source }),
        };
        let (stdout, stderr) = (child.stdout.take(), child.stderr.take());
        let (mut out, mut err) = (Vec::new(), Tail::default());
        // The child is killed on drop: on a timeout, when this function returns.
        let finished = tokio::time::timeout(self.timeout, async {
            let read_out = async {
                match stdout {
                    Some(p) => proc::capture(p, &mut out, Some(STDOUT_MAX)).await,
                    None => proc::Captured::default(),
                }
            };
            let read_err = async {
                if let Some(p) = stderr {
                    proc::capture(p, &mut err, None).await;
                }
            };
            let (seen, (), status) = tokio::join!(read_out, read_err, child.wait());
            status.map(|s| (s, seen.truncated))
        })
        .await;
        let (status, cut) = match finished {
            Err(_) => {
                return Err(GitError::Timeout {
                    what,
                    after: self.timeout,
                });
            }
            Ok(Err(source)) => return Err(GitError::Spawn { what, source }),
            Ok(Ok(done)) => done,
        };
        if !status.success() {
            return Err(GitError::Failed {
                what,
                code: status.code(),
                status: status.to_string(),
                stderr: shown(&err.0),
            });
        }
        if cut {
            return Err(GitError::BadOutput { what });
        }
        Ok(out)
    }

    async fn rev_parse(&self, git_dir: &Path, spec: &str) -> Result<Option<String>, GitError> {
        let args: Vec<OsString> = vec![
            "rev-parse".into(),
            "--verify".into(),
            "--quiet".into(),
            "--end-of-options".into(),
            spec.into(),
        ];
        let refs: Vec<&std::ffi::OsStr> = args.iter().map(OsString::as_os_str).collect();
        match self.run(git_dir, &[("GIT_DIR", git_dir)], &refs).await {
            Ok(out) => {
                let sha = String::from_utf8_lossy(&out).trim().to_owned();
                if sha.len() >= 40 && sha.bytes().all(|b| b.is_ascii_hexdigit()) {
                    Ok(Some(sha))
                } else {
                    Err(GitError::BadOutput {
                        what: "rev-parse".to_owned(),
                    })
                }
            }
            // --verify --quiet: a missing ref is exit 1 with no output. Anything else (a
            // timeout, git failing to start, a broken repository) is an error, not a missing
            // ref.
            Err(GitError::Failed {
                code: Some(1),
                ref stderr,
                ..
            }) if stderr == "\"\"" => Ok(None),
            Err(other) => Err(other),
        }
    }

    /// Whether any worktree of the repository has `refname` checked out.
    async fn checked_out(&self, repo: &Repo, refname: &str) -> Result<bool, GitError> {
        let out = self
            .run(
                &repo.git_dir,
                &[("GIT_DIR", &repo.git_dir)],
                &["worktree".as_ref(), "list".as_ref(), "--porcelain".as_ref()],
            )
            .await?;
        let text = String::from_utf8_lossy(&out);
        Ok(text
            .lines()
            .any(|l| l.strip_prefix("branch ") == Some(refname)))
    }
}

/// A git revision a caller may name: a ref or a commit, optionally with `~N`/`^N` suffixes.
/// No leading `-` (option injection), no `:` (refspecs), no whitespace or control characters,
/// no `..` (ranges), no `@{` (reflog lookups).
pub fn validate_ref(input: &str) -> Result<(), GitError> {
    let bad = |why: &str| {
        Err(GitError::InvalidRef(format!(
            "{:?}: {why}",
            input.chars().take(80).collect::<String>()
        )))
    };
    if input.is_empty() || input.len() > 255 {
        return bad("must be 1-255 bytes");
    }
    if input.starts_with('-') {
        return bad("must not start with -");
    }
    if input.contains("..") || input.contains("@{") {
        return bad("ranges and reflog lookups are not allowed");
    }
    if !input
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"/._-~^".contains(&b))
    {
        return bad("only [A-Za-z0-9/._-~^] allowed");
    }
    Ok(())
}

/// Longest git file root reads (`.git`, `commondir`): they hold one path.
const GIT_FILE_CAP: u64 = 4096;

/// A short category for a refused path, without the path: the path may come from a file's
/// content, and errors never echo file contents.
fn why_refused(e: &ResolveError) -> &'static str {
    match e {
        ResolveError::NotFound { .. } => "it does not exist",
        ResolveError::Symlink { .. } | ResolveError::BadComponent { .. } => {
            "a symlink is in the way"
        }
        ResolveError::CrossesMount { .. } => "a mount is in the way",
        ResolveError::NotADirectory { .. } | ResolveError::WrongKind { .. } => "wrong file type",
        ResolveError::RootNotAbsolute { .. }
        | ResolveError::Changed { .. }
        | ResolveError::OtherRoot { .. }
        | ResolveError::Openat2Unavailable { .. }
        | ResolveError::Io(_) => "it cannot be opened safely",
    }
}

/// Reads a small regular file through its validated `O_PATH` handle: re-opened through the
/// handle's magic link (the object read is the one validated, no name is looked up) with
/// `O_NONBLOCK` (a FIFO swapped in could never block us; the type is checked on the opened
/// descriptor anyway), at most [`GIT_FILE_CAP`] bytes, owned by `owner_uid`. Errors name
/// `shown` and never the content.
fn read_small(found: &Resolved, owner_uid: u32, shown: &str) -> Result<String, GitError> {
    let refuse = |why: &str| GitError::Refused(format!("{shown}: {why}"));
    if found.kind() != Kind::File {
        return Err(refuse("not a regular file"));
    }
    if found.identity().uid != owner_uid {
        return Err(refuse("not owned by the service uid"));
    }
    let magic = format!("/proc/self/fd/{}", found.as_fd().as_raw_fd());
    let fd = rustix::fs::open(
        magic.as_str(),
        OFlags::RDONLY | OFlags::NONBLOCK | OFlags::NOCTTY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|_| refuse("cannot be opened"))?;
    let opened = Identity::of(fd.as_fd()).map_err(|_| refuse("cannot be inspected"))?;
    if opened.kind != Kind::File || !opened.same_object(found.identity()) {
        return Err(refuse("changed while being read"));
    }
    let mut bytes = Vec::new();
    std::fs::File::from(fd)
        .take(GIT_FILE_CAP + 1)
        .read_to_end(&mut bytes)
        .map_err(|_| refuse("cannot be read"))?;
    if bytes.len() as u64 > GIT_FILE_CAP {
        return Err(refuse("too large"));
    }
    String::from_utf8(bytes).map_err(|_| refuse("not UTF-8"))
}

/// A directory named by an absolute, normalized path inside `roots`, reached without a
/// symlink and owned by `owner_uid`, with the root it was resolved under.
struct ValidDir {
    root: Root,
    rel: RelPath,
}

/// Resolves a directory named in a git file. `named_in` says which file named it; the path
/// itself (file content) is not repeated in errors.
fn validated_dir(
    roots: &[RootPath],
    path: &str,
    owner_uid: u32,
    what: &str,
    named_in: &str,
) -> Result<ValidDir, GitError> {
    let refuse = |why: &str| GitError::Refused(format!("the {what} named in {named_in}: {why}"));
    let req = RequestPath::parse(path).map_err(|_| refuse("not an absolute, normal path"))?;
    let within = req
        .within(roots, EqualsRoot::Refuse)
        .map_err(|_| refuse("outside the repository roots"))?;
    let root = Root::open(within.root.as_path()).map_err(|e| refuse(why_refused(&e)))?;
    let dir = root
        .resolve_dir(&within.rel)
        .map_err(|e| refuse(why_refused(&e)))?;
    if dir.identity().uid != owner_uid {
        return Err(refuse("not owned by the service uid"));
    }
    Ok(ValidDir {
        root,
        rel: within.rel,
    })
}

/// The git dir of a linked worktree whose `.git` file is `found` (in `top`), validated with
/// its common dir.
fn linked_git_dir(
    roots: &[RootPath],
    top: &Path,
    found: &Resolved,
    owner_uid: u32,
) -> Result<PathBuf, GitError> {
    let dotgit = format!("{}/.git", top.display());
    let text = read_small(found, owner_uid, &dotgit)?;
    let target = text
        .strip_suffix('\n')
        .unwrap_or(&text)
        .strip_prefix("gitdir: ")
        .filter(|t| !t.contains('\n'))
        .ok_or_else(|| GitError::Refused(format!("{dotgit}: not a gitdir file")))?;
    if !target.starts_with('/') {
        return Err(GitError::Refused(format!(
            "{dotgit}: a relative gitdir (a submodule checkout?) is not supported"
        )));
    }
    let git_dir = validated_dir(roots, target, owner_uid, "gitdir", &dotgit)?;
    // `commondir` (relative to the git dir, or absolute) is where refs, objects and config
    // live; git follows it, so it gets the same checks, and is read like the `.git` file:
    // through the resolver, never a symlink, FIFO or device.
    let named_in = "the gitdir's commondir file";
    let commondir_rel = git_dir
        .rel
        .join("commondir")
        .map_err(|_| GitError::Refused(format!("{dotgit}: the gitdir is refused")))?;
    let commondir = match git_dir.root.resolve(&commondir_rel) {
        Ok(found) => read_small(&found, owner_uid, named_in)?,
        Err(ResolveError::NotFound { .. }) => {
            return Err(GitError::Refused(format!(
                "{dotgit}: the gitdir has no commondir: not a linked worktree"
            )));
        }
        Err(e) => {
            return Err(GitError::Refused(format!(
                "{named_in}: {}",
                why_refused(&e)
            )));
        }
    };
    let commondir = commondir.strip_suffix('\n').unwrap_or(&commondir);
    let common = if commondir.starts_with('/') {
        commondir.to_owned()
    } else {
        // The git dir was reached without a symlink, so `..` from it is lexical.
        let mut parts: Vec<&str> = target.split('/').filter(|p| !p.is_empty()).collect();
        for c in commondir.split('/') {
            match c {
                ".." => {
                    parts.pop();
                }
                "" | "." => {}
                other => parts.push(other),
            }
        }
        format!("/{}", parts.join("/"))
    };
    validated_dir(roots, &common, owner_uid, "common dir", named_in)?;
    Ok(PathBuf::from(target))
}

/// Finds the repository containing `path` (see [`discover_blocking`]) on a blocking thread:
/// it opens and reads files, and nothing it meets may stall an async worker.
pub async fn discover(roots: &[RootPath], path: &str, owner_uid: u32) -> Result<Repo, GitError> {
    let roots = roots.to_vec();
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || discover_blocking(&roots, &path, owner_uid)).await?
}

/// Finds the repository containing `path`: walks up from `path` to (not including) its root,
/// opening each step without following symlinks; the first level with a `.git` directory is
/// the repository. Nothing is created. The top and its `.git` must be owned by `owner_uid`.
pub fn discover_blocking(roots: &[RootPath], path: &str, owner_uid: u32) -> Result<Repo, GitError> {
    let req = RequestPath::parse(path).map_err(|e| GitError::InvalidPath(e.to_string()))?;
    let within = req
        .within(roots, EqualsRoot::Refuse)
        .map_err(|e| GitError::InvalidPath(e.to_string()))?;
    let root = Root::open(within.root.as_path())?;
    root.resolve_dir(&within.rel)?;
    let parts: Vec<&str> = within.rel.components().collect();
    for n in (1..=parts.len()).rev() {
        let mut dir = RelPath::empty();
        for p in parts.iter().take(n) {
            dir = dir
                .join(p)
                .map_err(|e| GitError::InvalidPath(e.to_string()))?;
        }
        let dotgit = dir
            .join(".git")
            .map_err(|e| GitError::InvalidPath(e.to_string()))?;
        match root.resolve(&dotgit) {
            Ok(found) => {
                let top_path = within.root.as_path().join(dir.as_str());
                match found.kind() {
                    Kind::Dir => {}
                    Kind::File => {
                        let top = root.resolve_dir(&dir)?;
                        if top.identity().uid != owner_uid || found.identity().uid != owner_uid {
                            return Err(GitError::Refused(format!(
                                "{}: not owned by the service uid {owner_uid}",
                                top_path.display()
                            )));
                        }
                        let git_dir = linked_git_dir(roots, &top_path, &found, owner_uid)?;
                        return Ok(Repo {
                            git_dir,
                            top: top_path,
                        });
                    }
                    other @ (Kind::Symlink
                    | Kind::Socket
                    | Kind::Fifo
                    | Kind::CharDev
                    | Kind::BlockDev) => {
                        return Err(GitError::Refused(format!(
                            "{}: .git is a {other}",
                            top_path.display()
                        )));
                    }
                }
                let top = root.resolve_dir(&dir)?;
                for (what, uid) in [
                    ("repository", top.identity().uid),
                    (".git", found.identity().uid),
                ] {
                    if uid != owner_uid {
                        return Err(GitError::Refused(format!(
                            "{}: {what} is owned by uid {uid}, expected the service uid {owner_uid}",
                            top_path.display()
                        )));
                    }
                }
                return Ok(Repo {
                    git_dir: top_path.join(".git"),
                    top: top_path,
                });
            }
            Err(ResolveError::NotFound { .. }) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Err(GitError::NoRepository(format!(
        "no git repository at or above {req}"
    )))
}

/// The paths of one task's git state.
#[derive(Debug, Clone)]
pub struct TaskPaths {
    pub dir: PathBuf,
    pub shadow: PathBuf,
    pub workspace: PathBuf,
    pub index: PathBuf,
}

impl TaskPaths {
    pub fn new(data: &Path, tid: &Tid) -> TaskPaths {
        let dir = data.join("tasks").join(tid.as_str());
        TaskPaths {
            shadow: dir.join("shadow.git"),
            workspace: dir.join("workspace"),
            index: dir.join(INDEX),
            dir,
        }
    }
}

/// `git fetch` of exactly the refspec that follows, nothing else.
const FETCH: &[&str] = &[
    "fetch",
    "--quiet",
    "--no-tags",
    "--no-write-fetch-head",
    "--no-recurse-submodules",
    "--end-of-options",
];

fn os(items: &[&str]) -> Vec<OsString> {
    items.iter().map(OsString::from).collect()
}

fn refs(v: &[OsString]) -> Vec<&std::ffi::OsStr> {
    v.iter().map(OsString::as_os_str).collect()
}

/// Copies `sha` of `repo` into a new bare shadow as `refs/heads/base` and checks it out into a
/// new workspace. The task directory must exist; shadow and workspace must not.
pub async fn snapshot(git: &Git, repo: &Repo, sha: &str, task: &TaskPaths) -> Result<(), GitError> {
    let mut init = os(&["init", "--quiet", "--bare", "--template="]);
    init.push(task.shadow.clone().into());
    git.run(&task.dir, &[], &refs(&init)).await?;
    let mut fetch = os(FETCH);
    fetch.push(repo.git_dir.clone().into());
    fetch.push(format!("{sha}:{BASE_REF}").into());
    git.run(&task.shadow, &[("GIT_DIR", &task.shadow)], &refs(&fetch))
        .await?;
    let mut clone = os(&[
        "clone",
        "--quiet",
        "--no-local",
        "--no-hardlinks",
        "--template=",
        "--branch",
        "base",
        "--end-of-options",
    ]);
    clone.push(task.shadow.clone().into());
    clone.push(task.workspace.clone().into());
    git.run(&task.dir, &[], &refs(&clone)).await?;
    // The agent cannot reach the shadow's path anyway; a remote naming it only confuses.
    git.run(
        &task.workspace,
        &[("GIT_DIR", &task.workspace.join(".git"))],
        &refs(&os(&["remote", "remove", "origin"])),
    )
    .await?;
    Ok(())
}

/// The name of the temporary index in `tasks/<tid>/`.
const INDEX: &str = "collect.index";

/// Removes `tasks/<tid>/collect.index` relative to the task directory's handle: `unlinkat`
/// never follows a symlink (one planted there is itself removed), and no path is re-resolved.
fn remove_index(task_dir: BorrowedFd<'_>) -> Result<(), GitError> {
    match rustix::fs::unlinkat(task_dir, INDEX, AtFlags::empty()) {
        Ok(()) | Err(Errno::NOENT) => Ok(()),
        Err(e) => Err(GitError::Workspace(format!("removing {INDEX}: {e}"))),
    }
}

/// Commits the workspace tree onto `refs/heads/agent/<tid>` in the shadow, parent the snapshot
/// commit. Run only after the sandbox is dead and the workspace handed back. `task_dir` is the
/// validated handle of `tasks/<tid>` (the service user owns it: root acts only through the
/// handle, never by path).
pub async fn collect(
    git: &Git,
    tid: &Tid,
    task: &TaskPaths,
    task_dir: OwnedFd,
) -> Result<String, GitError> {
    let base = git
        .rev_parse(&task.shadow, BASE_REF)
        .await?
        .ok_or_else(|| GitError::BadOutput {
            what: format!("rev-parse {BASE_REF}: missing in the shadow"),
        })?;
    let task_dir = Arc::new(task_dir);
    remove_index(task_dir.as_fd())?;
    let env = [
        ("GIT_DIR", task.shadow.as_path()),
        ("GIT_WORK_TREE", task.workspace.as_path()),
        ("GIT_INDEX_FILE", task.index.as_path()),
    ];
    let result = async {
        git.run(
            &task.dir,
            &env,
            &refs(&os(&["read-tree", "--end-of-options", &base])),
        )
        .await?;
        // Nested repositories cannot be added file by file (git stops at their boundary, and
        // one without a commit fails the whole add), so they are left out, by name.
        let mut add = os(&["add", "--all", "--", "."]);
        let scan_dir = Arc::clone(&task_dir);
        let nested = tokio::task::spawn_blocking(move || nested_repos(scan_dir.as_fd())).await??;
        for nested in nested {
            let mut spec = OsString::from(":(exclude,literal)");
            spec.push(nested);
            add.push(spec);
        }
        git.run(&task.dir, &env, &refs(&add)).await?;
        let tree = git
            .run(&task.dir, &env, &refs(&os(&["write-tree"])))
            .await?;
        let tree = String::from_utf8_lossy(&tree).trim().to_owned();
        // An agent that changed nothing leaves the snapshot itself, not an empty commit on
        // it, so nothing looks delivered that was not done.
        let base_tree = git
            .rev_parse(&task.shadow, &format!("{base}^{{tree}}"))
            .await?;
        let commit = if base_tree.as_deref() == Some(tree.as_str()) {
            base.clone()
        } else {
            let message = format!("agentbox: work of agent {tid}");
            let commit = git
                .run(
                    &task.dir,
                    &env,
                    &refs(&os(&[
                        "commit-tree",
                        "-p",
                        &base,
                        "-m",
                        &message,
                        "--end-of-options",
                        &tree,
                    ])),
                )
                .await?;
            String::from_utf8_lossy(&commit).trim().to_owned()
        };
        let branch = AgentBranch::for_tid(tid);
        git.run(
            &task.dir,
            &env,
            &refs(&os(&[
                "update-ref",
                "--end-of-options",
                &branch.refname(),
                &commit,
            ])),
        )
        .await?;
        Ok::<String, GitError>(commit)
    }
    .await;
    if let Err(e) = remove_index(task_dir.as_fd()) {
        tracing::warn!(%tid, error = %e, "cannot remove the collect index");
    }
    result
}

/// Most nested repositories a workspace may contain before collection gives up.
const MAX_NESTED_REPOS: usize = 1000;
/// Most entries looked at while searching for nested repositories.
const MAX_SCAN_ENTRIES: usize = 2_000_000;
/// Deepest directory level entered (one descriptor is open per level).
const MAX_SCAN_DEPTH: usize = 1024;

/// A directory still to read: its parent's handle and its name (opened when popped, so open
/// descriptors stay bounded by the depth, not the breadth).
struct Pending {
    parent: Arc<OwnedFd>,
    place: Arc<Place>,
    depth: usize,
}

/// A directory's place below the workspace: its parent's place and its own name, so the
/// directories waiting to be read share their prefixes. Each used to hold its whole path: an
/// agent's chain of 255 directories of 255-byte names with 100,000 subdirectories at the bottom
/// made root hold 6.5 GB.
struct Place {
    up: Option<Arc<Place>>,
    name: CString,
}

/// The path below the workspace of `place` (empty for the workspace itself).
fn path_of(place: Option<&Arc<Place>>) -> PathBuf {
    let mut names = Vec::new();
    let mut cur = place;
    while let Some(p) = cur {
        names.push(std::ffi::OsStr::from_bytes(p.name.to_bytes()));
        cur = p.up.as_ref();
    }
    names.iter().rev().collect()
}

/// The directories below `tasks/<tid>/workspace` (relative, the top excluded) that contain a
/// `.git`. Every directory is opened relative to its parent's handle with `O_NOFOLLOW` and
/// checked to be a directory on the workspace's filesystem; symlinks are never followed,
/// FIFOs and devices never opened. Blocking: call on a blocking thread.
fn nested_repos(task_dir: BorrowedFd<'_>) -> Result<Vec<OsString>, GitError> {
    let scan = |what: &str, e: Errno| GitError::Workspace(format!("scanning: {what}: {e}"));
    let flags = OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
    let top = rustix::fs::openat(task_dir, "workspace", flags, Mode::empty())
        .map_err(|e| scan("workspace", e))?;
    let dev_of = |fd: BorrowedFd<'_>| {
        rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS)
            .map(|st| rustix::fs::makedev(st.stx_dev_major, st.stx_dev_minor))
    };
    let dev = dev_of(top.as_fd()).map_err(|e| scan("workspace", e))?;
    let mut found = Vec::new();
    let mut seen = 0_usize;
    let mut stack: Vec<(OwnedFd, Option<Arc<Place>>, usize)> = vec![(top, None, 0)];
    let mut pending: Vec<Pending> = Vec::new();
    loop {
        let (dir, place, depth) = match stack.pop() {
            Some(d) => d,
            None => match pending.pop() {
                None => break,
                Some(p) => {
                    let shown = || path_of(Some(&p.place)).display().to_string();
                    let fd =
                        match rustix::fs::openat(&*p.parent, &p.place.name, flags, Mode::empty()) {
                            Ok(fd) => fd,
                            // Replaced by something else since it was listed: not a directory
                            // any more, nothing of ours to enter.
                            Err(Errno::NOTDIR | Errno::LOOP | Errno::NOENT) => continue,
                            Err(e) => return Err(scan(&shown(), e)),
                        };
                    if dev_of(fd.as_fd()).map_err(|e| scan(&shown(), e))? != dev {
                        continue;
                    }
                    (fd, Some(p.place), p.depth)
                }
            },
        };
        if depth > MAX_SCAN_DEPTH {
            return Err(GitError::Workspace(format!(
                "deeper than {MAX_SCAN_DEPTH} levels"
            )));
        }
        let dir = Arc::new(dir);
        let mut reader = rustix::fs::Dir::read_from(&*dir).map_err(|e| scan("opendir", e))?;
        while let Some(entry) = reader.read() {
            let entry = entry.map_err(|e| scan("readdir", e))?;
            let name = entry.file_name();
            if name.to_bytes() == b"." || name.to_bytes() == b".." {
                continue;
            }
            seen += 1;
            if seen > MAX_SCAN_ENTRIES {
                return Err(GitError::Workspace("too large to collect".to_owned()));
            }
            if name.to_bytes() == b".git" {
                if place.is_some() {
                    found.push(path_of(place.as_ref()).into_os_string());
                    if found.len() > MAX_NESTED_REPOS {
                        return Err(GitError::Workspace(
                            "too many nested repositories".to_owned(),
                        ));
                    }
                }
                continue;
            }
            let is_dir = match entry.file_type() {
                FileType::Directory => true,
                FileType::Unknown => {
                    rustix::fs::statx(&*dir, name, AtFlags::SYMLINK_NOFOLLOW, StatxFlags::TYPE)
                        .is_ok_and(|st| {
                            FileType::from_raw_mode(u32::from(st.stx_mode)) == FileType::Directory
                        })
                }
                FileType::RegularFile
                | FileType::Symlink
                | FileType::Fifo
                | FileType::Socket
                | FileType::CharacterDevice
                | FileType::BlockDevice => false,
            };
            if is_dir {
                pending.push(Pending {
                    parent: Arc::clone(&dir),
                    place: Arc::new(Place {
                        up: place.clone(),
                        name: name.to_owned(),
                    }),
                    depth: depth + 1,
                });
            }
        }
    }
    Ok(found)
}

/// Fetches exactly `agent/<tid>` from the shadow into the repository (forced: the branch
/// belongs to the task), without touching the repository's HEAD or work tree.
pub async fn deliver(
    git: &Git,
    repo: &Repo,
    branch: &AgentBranch,
    task: &TaskPaths,
) -> Result<String, GitError> {
    let refname = branch.refname();
    if git.rev_parse(&task.shadow, &refname).await?.is_none() {
        return Err(GitError::BranchMissing(format!(
            "the task has no {branch} yet"
        )));
    }
    if git.checked_out(repo, &refname).await? {
        return Err(GitError::CheckedOut(format!(
            "{branch} is checked out in a worktree of {}",
            repo.top.display()
        )));
    }
    let mut fetch = os(FETCH);
    fetch.push(task.shadow.clone().into());
    fetch.push(format!("+{refname}:{refname}").into());
    git.run(&repo.git_dir, &[("GIT_DIR", &repo.git_dir)], &refs(&fetch))
        .await?;
    git.rev_parse(&repo.git_dir, &refname)
        .await?
        .ok_or_else(|| GitError::BadOutput {
            what: format!("rev-parse {refname} after fetch: missing"),
        })
}

/// Deletes `agent/<id>` from the repository (only that ref), refusing when it is checked out.
pub async fn delete_branch(
    git: &Git,
    repo: &Repo,
    branch: &AgentBranch,
) -> Result<String, GitError> {
    let refname = branch.refname();
    let Some(old) = git.rev_parse(&repo.git_dir, &refname).await? else {
        return Err(GitError::BranchMissing(format!(
            "{branch} does not exist in {}",
            repo.top.display()
        )));
    };
    if git.checked_out(repo, &refname).await? {
        return Err(GitError::CheckedOut(format!(
            "{branch} is checked out in a worktree of {}",
            repo.top.display()
        )));
    }
    git.run(
        &repo.git_dir,
        &[("GIT_DIR", &repo.git_dir)],
        &refs(&os(&[
            "update-ref",
            "-d",
            "--end-of-options",
            &refname,
            &old,
        ])),
    )
    .await?;
    Ok(old)
}

/// Resolves `spec` to a commit of `repo`.
pub async fn resolve_commit(git: &Git, repo: &Repo, spec: &str) -> Result<String, GitError> {
    validate_ref(spec)?;
    git.rev_parse(&repo.git_dir, &format!("{spec}^{{commit}}"))
        .await?
        .ok_or_else(|| GitError::NoSuchCommit(format!("{spec:?} does not name a commit")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The API code a git error answers with.
    fn code(e: GitError) -> &'static str {
        crate::error::LauncherError::from(e).status_and_code().1
    }

    #[test]
    fn refs_validated() {
        for ok in [
            "HEAD",
            "main",
            "HEAD~1",
            "v1.0",
            "feature/x",
            "abc123",
            "HEAD^2",
        ] {
            validate_ref(ok).unwrap();
        }
        for bad in [
            "",
            "-x",
            "--upload-pack=touch /tmp/x",
            "a..b",
            "HEAD;id",
            "a:b",
            "a b",
            "HEAD@{1}",
            "x\n",
        ] {
            assert!(validate_ref(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn discovery() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("repos");
        std::fs::create_dir_all(root.join("proj/.git")).unwrap();
        std::fs::create_dir_all(root.join("proj/sub/dir")).unwrap();
        std::fs::create_dir_all(root.join("wt")).unwrap();
        std::fs::write(root.join("wt/.git"), "gitdir: /etc\n").unwrap();
        std::os::unix::fs::symlink(root.join("proj"), root.join("link")).unwrap();
        let roots = vec![agentbox_policy::path::validate_root(root.to_str().unwrap()).unwrap()];
        let r = root.to_str().unwrap();
        let repo = discover_blocking(&roots, &format!("{r}/proj/sub/dir"), 0).unwrap();
        assert_eq!(repo.top, root.join("proj"));
        assert_eq!(repo.git_dir, root.join("proj/.git"));
        // (the path asked for, the uid that must own the repository, the refusal's code)
        for (path, uid, expected) in [
            // Owned by root, not by uid 1.
            (format!("{r}/proj"), 1, "unsafe_path"),
            // A .git file pointing at /etc.
            (format!("{r}/wt"), 0, "unsafe_path"),
            // Through a symlink.
            (format!("{r}/link/sub"), 0, "unsafe_path"),
            (format!("{r}/missing"), 0, "not_found"),
            // The root itself, outside the roots, a trailing slash.
            (r.to_owned(), 0, "invalid_path"),
            ("/etc".to_owned(), 0, "invalid_path"),
            (format!("{r}/proj/"), 0, "invalid_path"),
        ] {
            let err = discover_blocking(&roots, &path, uid).unwrap_err();
            assert_eq!(code(err), expected, "{path} as uid {uid}");
        }
        // Walking up stops below the root: a .git in the root itself is not found.
        std::fs::create_dir_all(root.join(".git")).unwrap();
        std::fs::create_dir_all(root.join("plain")).unwrap();
        assert_eq!(
            code(discover_blocking(&roots, &format!("{r}/plain"), 0).unwrap_err()),
            "not_found"
        );
    }

    fn dir_fd(path: &Path) -> OwnedFd {
        rustix::fs::open(
            path,
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .unwrap()
    }

    /// A symlink planted as the index is removed itself; its target is untouched.
    #[test]
    fn index_removal_never_follows() {
        let tmp = tempfile::tempdir().unwrap();
        let task = tmp.path().join("task");
        std::fs::create_dir(&task).unwrap();
        let victim = tmp.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, task.join(INDEX)).unwrap();
        remove_index(dir_fd(&task).as_fd()).unwrap();
        assert!(std::fs::symlink_metadata(task.join(INDEX)).is_err());
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        // Nothing there is fine too.
        remove_index(dir_fd(&task).as_fd()).unwrap();
    }

    /// `tasks/<tid>` swapped for a symlink: the task directory is refused, so root never
    /// removes an index (or scans a workspace) elsewhere. By path, it would have.
    #[test]
    fn a_symlinked_task_dir_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let data = tmp.path().join("data");
        let service = Owner {
            uid: 64201,
            gid: 64202,
        };
        let d = crate::layout::DataDir::prepare(&data, service).unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir_all(elsewhere.join("workspace/x/.git")).unwrap();
        std::fs::write(elsewhere.join(INDEX), "keep").unwrap();
        std::os::unix::fs::symlink(&elsewhere, data.join("tasks/t1")).unwrap();
        let tid = Tid::parse("t1").unwrap();
        let err = d.task_dir(&tid).unwrap_err();
        assert_eq!(
            crate::error::LauncherError::from(err).status_and_code().1,
            "unsafe_path"
        );
        assert!(elsewhere.join(INDEX).exists());
    }

    /// The scan reports real nested repositories only: a symlinked `workspace` is refused,
    /// symlinks inside are not entered, FIFOs are never opened.
    #[test]
    fn nested_scan_by_descriptor() {
        let tmp = tempfile::tempdir().unwrap();
        let task = tmp.path().join("task");
        let ws = task.join("workspace");
        std::fs::create_dir_all(ws.join("sub/.git")).unwrap();
        std::fs::create_dir_all(ws.join("a/b/c/deep/.git")).unwrap();
        std::fs::create_dir_all(ws.join(".git")).unwrap();
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(outside.join("x/.git")).unwrap();
        std::os::unix::fs::symlink(&outside, ws.join("link")).unwrap();
        let st = std::process::Command::new("mkfifo")
            .arg(ws.join("fifo"))
            .status()
            .unwrap();
        assert!(st.success());
        let mut found = nested_repos(dir_fd(&task).as_fd()).unwrap();
        found.sort();
        assert_eq!(found, [OsString::from("a/b/c/deep"), OsString::from("sub")]);

        // The workspace itself a symlink (to a tree with a nested repository): refused.
        let task2 = tmp.path().join("task2");
        std::fs::create_dir(&task2).unwrap();
        std::os::unix::fs::symlink(&outside, task2.join("workspace")).unwrap();
        assert!(matches!(
            nested_repos(dir_fd(&task2).as_fd()),
            Err(GitError::Workspace(_))
        ));
    }

    /// What git prints is read within bounds: 20 MB on stdout is an error, not an answer
    /// held whole in root's heap; of 20 MB on stderr the end is kept, for the error.
    #[tokio::test]
    async fn git_output_is_bounded() {
        let tmp = tempfile::tempdir().unwrap();
        let flood = |name: &str, code: u8| {
            let path = tmp.path().join(name);
            std::fs::write(
                &path,
                format!("#!/bin/sh\nhead -c 20000000 /dev/zero | tr '\\0' e >&2 &\nhead -c 20000000 /dev/zero\nwait\necho the end >&2\nexit {code}\n"),
            )
            .unwrap();
            std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
                .unwrap();
            Git {
                run_as: Owner { uid: 0, gid: 0 },
                binary: path,
                timeout: Duration::from_secs(60),
            }
        };
        let err = flood("ok-git", 0)
            .run(tmp.path(), &[], &["status".as_ref()])
            .await
            .unwrap_err();
        assert!(matches!(err, GitError::BadOutput { .. }), "{err}");
        let err = flood("failing-git", 1)
            .run(tmp.path(), &[], &["status".as_ref()])
            .await
            .unwrap_err();
        let GitError::Failed { stderr, .. } = &err else {
            panic!("{err}");
        };
        assert!(
            stderr.len() < 3000 && stderr.ends_with("eethe end\""),
            "{stderr}"
        );
    }

    /// A timed-out git is a timeout (504 `git_timeout`), never a missing ref.
    #[tokio::test]
    async fn a_timeout_is_not_a_missing_ref() {
        let tmp = tempfile::tempdir().unwrap();
        let slow = tmp.path().join("slow-git");
        std::fs::write(&slow, "#!/bin/sh\nsleep 30\n").unwrap();
        std::fs::set_permissions(&slow, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let git = Git {
            run_as: Owner { uid: 0, gid: 0 },
            binary: slow,
            timeout: Duration::from_millis(200),
        };
        let err = git.rev_parse(tmp.path(), "HEAD").await.unwrap_err();
        assert!(matches!(err, GitError::Timeout { .. }), "{err}");
        let (status, code) = crate::error::LauncherError::from(err).status_and_code();
        assert_eq!((status.as_u16(), code), (504, "git_timeout"));

        // git failing otherwise (not "exit 1, nothing printed") is an error as well.
        let broken = tmp.path().join("broken-git");
        std::fs::write(&broken, "#!/bin/sh\necho fatal >&2; exit 128\n").unwrap();
        std::fs::set_permissions(&broken, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let git = Git {
            binary: broken,
            ..git
        };
        let err = git.rev_parse(tmp.path(), "HEAD").await.unwrap_err();
        assert!(
            matches!(
                err,
                GitError::Failed {
                    code: Some(128),
                    ..
                }
            ),
            "{err}"
        );
    }
}
