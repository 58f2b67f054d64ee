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

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use agentbox_policy::id::{AgentBranch, Tid};
use agentbox_policy::path::{EqualsRoot, RelPath, RequestPath, RootPath};
use agentbox_policy::resolve::{Kind, ResolveError, Root};

use crate::error::{LauncherError, from_resolve};
use crate::walk::Owner;

/// The git binary (absolute: a `PATH` lookup is a choice someone else could make).
pub const GIT: &str = "/usr/bin/git";
/// How long one git command may run.
pub const GIT_TIMEOUT: Duration = Duration::from_secs(600);
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
    /// returns stdout, or the failure with stderr.
    pub async fn run(
        &self,
        cwd: &Path,
        env: &[(&str, &Path)],
        args: &[&std::ffi::OsStr],
    ) -> Result<Vec<u8>, LauncherError> {
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
        let out = match tokio::time::timeout(self.timeout, cmd.output()).await {
            Err(_) => return Err(LauncherError::Git(format!("git {what}: timed out"))),
            Ok(Err(e)) => return Err(LauncherError::Git(format!("git {what}: cannot run: {e}"))),
            Ok(Ok(out)) => out,
        };
        if out.status.success() {
            Ok(out.stdout)
        } else {
            Err(LauncherError::Git(format!(
                "git {what}: {}: {}",
                out.status,
                shown(&out.stderr)
            )))
        }
    }

    async fn rev_parse(&self, git_dir: &Path, spec: &str) -> Result<Option<String>, LauncherError> {
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
                    Err(LauncherError::Git(format!("rev-parse printed {sha:?}")))
                }
            }
            // --verify --quiet: a missing ref is exit 1 with no output.
            Err(LauncherError::Git(_)) => Ok(None),
            Err(other) => Err(other),
        }
    }

    /// Whether any worktree of the repository has `refname` checked out.
    async fn checked_out(&self, repo: &Repo, refname: &str) -> Result<bool, LauncherError> {
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
pub fn validate_ref(input: &str) -> Result<(), LauncherError> {
    let bad = |why: &str| {
        Err(LauncherError::InvalidRef(format!(
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

/// Reads a `.git` file (at most 4 KiB) through its already validated handle.
fn read_gitfile(found: &agentbox_policy::resolve::Resolved) -> Result<String, LauncherError> {
    use std::io::Read;
    use std::os::fd::{AsFd, AsRawFd};
    let shown = found.display_path().to_owned();
    // Re-open the O_PATH handle for reading: the object read is the one validated.
    let file = std::fs::File::open(format!("/proc/self/fd/{}", found.as_fd().as_raw_fd()))
        .map_err(|e| LauncherError::Unsafe(format!("{shown}: cannot read: {e}")))?;
    let mut text = String::new();
    file.take(4096)
        .read_to_string(&mut text)
        .map_err(|e| LauncherError::Unsafe(format!("{shown}: cannot read: {e}")))?;
    Ok(text)
}

/// Resolves a directory named by an absolute, normalized path inside `roots` without following
/// symlinks, and checks its owner.
fn validated_dir(
    roots: &[RootPath],
    path: &str,
    owner_uid: u32,
    what: &str,
) -> Result<PathBuf, LauncherError> {
    let req = RequestPath::parse(path)
        .map_err(|e| LauncherError::Unsafe(format!("{what} {path:?}: {e}")))?;
    let within = req
        .within(roots, EqualsRoot::Refuse)
        .map_err(|e| LauncherError::Unsafe(format!("{what} {path:?}: {e}")))?;
    let root = Root::open(within.root.as_path()).map_err(from_resolve)?;
    let dir = root.resolve_dir(&within.rel).map_err(from_resolve)?;
    if dir.identity().uid != owner_uid {
        return Err(LauncherError::Unsafe(format!(
            "{what} {path}: owned by uid {}, expected the service uid {owner_uid}",
            dir.identity().uid
        )));
    }
    Ok(PathBuf::from(path))
}

/// The git dir of a linked worktree whose `.git` file is `found` (in `top`), validated with
/// its common dir.
fn linked_git_dir(
    roots: &[RootPath],
    top: &Path,
    found: &agentbox_policy::resolve::Resolved,
    owner_uid: u32,
) -> Result<PathBuf, LauncherError> {
    let text = read_gitfile(found)?;
    let target = text
        .strip_suffix('\n')
        .unwrap_or(&text)
        .strip_prefix("gitdir: ")
        .filter(|t| !t.contains('\n'))
        .ok_or_else(|| {
            LauncherError::Unsafe(format!("{}/.git: not a gitdir file", top.display()))
        })?;
    if !target.starts_with('/') {
        return Err(LauncherError::Unsafe(format!(
            "{}/.git: relative gitdir {target:?} (a submodule checkout?) is not supported",
            top.display()
        )));
    }
    let git_dir = validated_dir(roots, target, owner_uid, "gitdir")?;
    // `commondir` (relative to the git dir, or absolute) is where refs, objects and config
    // live; git follows it, so it gets the same checks.
    let commondir = match std::fs::read_to_string(git_dir.join("commondir")) {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(LauncherError::Unsafe(format!(
                "{target}: no commondir: not a linked worktree"
            )));
        }
        Err(e) => return Err(LauncherError::Unsafe(format!("{target}/commondir: {e}"))),
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
    validated_dir(roots, &common, owner_uid, "commondir")?;
    Ok(git_dir)
}

/// Finds the repository containing `path`: walks up from `path` to (not including) its root,
/// opening each step without following symlinks; the first level with a `.git` directory is
/// the repository. Nothing is created. The top and its `.git` must be owned by `owner_uid`.
pub fn discover(roots: &[RootPath], path: &str, owner_uid: u32) -> Result<Repo, LauncherError> {
    let req = RequestPath::parse(path).map_err(|e| LauncherError::InvalidPath(e.to_string()))?;
    let within = req
        .within(roots, EqualsRoot::Refuse)
        .map_err(|e| LauncherError::InvalidPath(e.to_string()))?;
    let root = Root::open(within.root.as_path()).map_err(from_resolve)?;
    root.resolve_dir(&within.rel).map_err(from_resolve)?;
    let parts: Vec<&str> = within.rel.components().collect();
    for n in (1..=parts.len()).rev() {
        let mut dir = RelPath::empty();
        for p in parts.iter().take(n) {
            dir = dir
                .join(p)
                .map_err(|e| LauncherError::InvalidPath(e.to_string()))?;
        }
        let dotgit = dir
            .join(".git")
            .map_err(|e| LauncherError::InvalidPath(e.to_string()))?;
        match root.resolve(&dotgit) {
            Ok(found) => {
                let top_path = within.root.as_path().join(dir.as_str());
                match found.kind() {
                    Kind::Dir => {}
                    Kind::File => {
                        let top = root.resolve_dir(&dir).map_err(from_resolve)?;
                        if top.identity().uid != owner_uid || found.identity().uid != owner_uid {
                            return Err(LauncherError::Unsafe(format!(
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
                        return Err(LauncherError::Unsafe(format!(
                            "{}: .git is a {other}",
                            top_path.display()
                        )));
                    }
                }
                let top = root.resolve_dir(&dir).map_err(from_resolve)?;
                for (what, uid) in [
                    ("repository", top.identity().uid),
                    (".git", found.identity().uid),
                ] {
                    if uid != owner_uid {
                        return Err(LauncherError::Unsafe(format!(
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
            Err(e) => return Err(from_resolve(e)),
        }
    }
    Err(LauncherError::Missing(format!(
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
            index: dir.join("collect.index"),
            dir,
        }
    }
}

fn os(items: &[&str]) -> Vec<OsString> {
    items.iter().map(OsString::from).collect()
}

fn refs(v: &[OsString]) -> Vec<&std::ffi::OsStr> {
    v.iter().map(OsString::as_os_str).collect()
}

/// Copies `sha` of `repo` into a new bare shadow as `refs/heads/base` and checks it out into a
/// new workspace. The task directory must exist; shadow and workspace must not.
pub async fn snapshot(
    git: &Git,
    repo: &Repo,
    sha: &str,
    task: &TaskPaths,
) -> Result<(), LauncherError> {
    let mut init = os(&["init", "--quiet", "--bare", "--template="]);
    init.push(task.shadow.clone().into());
    git.run(&task.dir, &[], &refs(&init)).await?;
    let mut fetch = os(&[
        "fetch",
        "--quiet",
        "--no-tags",
        "--no-write-fetch-head",
        "--no-recurse-submodules",
        "--end-of-options",
    ]);
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

/// Commits the workspace tree onto `refs/heads/agent/<tid>` in the shadow, parent the snapshot
/// commit. Run only after the sandbox is dead and the workspace handed back.
pub async fn collect(git: &Git, tid: &Tid, task: &TaskPaths) -> Result<String, LauncherError> {
    let base = git
        .rev_parse(&task.shadow, BASE_REF)
        .await?
        .ok_or_else(|| LauncherError::Git(format!("{}: no {BASE_REF}", task.shadow.display())))?;
    match std::fs::remove_file(&task.index) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            return Err(LauncherError::Internal(format!(
                "{}: {e}",
                task.index.display()
            )));
        }
    }
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
        for nested in nested_repos(&task.workspace)? {
            let mut spec = OsString::from(":(exclude,literal)");
            spec.push(nested);
            add.push(spec);
        }
        git.run(&task.dir, &env, &refs(&add)).await?;
        let tree = git
            .run(&task.dir, &env, &refs(&os(&["write-tree"])))
            .await?;
        let tree = String::from_utf8_lossy(&tree).trim().to_owned();
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
        let commit = String::from_utf8_lossy(&commit).trim().to_owned();
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
        Ok::<String, LauncherError>(commit)
    }
    .await;
    let _ = std::fs::remove_file(&task.index);
    result
}

/// Most nested repositories a workspace may contain before collection gives up.
const MAX_NESTED_REPOS: usize = 1000;
/// Most entries looked at while searching for nested repositories.
const MAX_SCAN_ENTRIES: usize = 2_000_000;

/// The directories below `workspace` (relative, the top excluded) that contain a `.git`. Only
/// real directories are entered; symlinks are never followed.
fn nested_repos(workspace: &Path) -> Result<Vec<OsString>, LauncherError> {
    let mut found = Vec::new();
    let mut seen = 0_usize;
    let mut stack: Vec<PathBuf> = vec![PathBuf::new()];
    while let Some(rel) = stack.pop() {
        let entries = std::fs::read_dir(workspace.join(&rel))
            .map_err(|e| LauncherError::Internal(format!("scanning the workspace: {e}")))?;
        for entry in entries {
            let entry = entry
                .map_err(|e| LauncherError::Internal(format!("scanning the workspace: {e}")))?;
            seen += 1;
            if seen > MAX_SCAN_ENTRIES {
                return Err(LauncherError::Internal(
                    "workspace too large to collect".to_owned(),
                ));
            }
            let name = entry.file_name();
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            if name == ".git" {
                if !rel.as_os_str().is_empty() {
                    found.push(rel.clone().into_os_string());
                    if found.len() > MAX_NESTED_REPOS {
                        return Err(LauncherError::Internal(
                            "too many nested repositories".to_owned(),
                        ));
                    }
                }
                continue;
            }
            if is_dir {
                stack.push(rel.join(name));
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
) -> Result<String, LauncherError> {
    let refname = branch.refname();
    if git.rev_parse(&task.shadow, &refname).await?.is_none() {
        return Err(LauncherError::Missing(format!(
            "the task has no {branch} yet"
        )));
    }
    if git.checked_out(repo, &refname).await? {
        return Err(LauncherError::Conflict(format!(
            "{branch} is checked out in a worktree of {}",
            repo.top.display()
        )));
    }
    let mut fetch = os(&[
        "fetch",
        "--quiet",
        "--no-tags",
        "--no-write-fetch-head",
        "--no-recurse-submodules",
        "--end-of-options",
    ]);
    fetch.push(task.shadow.clone().into());
    fetch.push(format!("+{refname}:{refname}").into());
    git.run(&repo.git_dir, &[("GIT_DIR", &repo.git_dir)], &refs(&fetch))
        .await?;
    git.rev_parse(&repo.git_dir, &refname)
        .await?
        .ok_or_else(|| LauncherError::Git(format!("{refname} missing after fetch")))
}

/// Deletes `agent/<id>` from the repository (only that ref), refusing when it is checked out.
pub async fn delete_branch(
    git: &Git,
    repo: &Repo,
    branch: &AgentBranch,
) -> Result<String, LauncherError> {
    let refname = branch.refname();
    let Some(old) = git.rev_parse(&repo.git_dir, &refname).await? else {
        return Err(LauncherError::Missing(format!(
            "{branch} does not exist in {}",
            repo.top.display()
        )));
    };
    if git.checked_out(repo, &refname).await? {
        return Err(LauncherError::Conflict(format!(
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
pub async fn resolve_commit(git: &Git, repo: &Repo, spec: &str) -> Result<String, LauncherError> {
    validate_ref(spec)?;
    git.rev_parse(&repo.git_dir, &format!("{spec}^{{commit}}"))
        .await?
        .ok_or_else(|| LauncherError::InvalidRef(format!("{spec:?} does not name a commit")))
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let repo = discover(&roots, &format!("{r}/proj/sub/dir"), 0).unwrap();
        assert_eq!(repo.top, root.join("proj"));
        assert_eq!(repo.git_dir, root.join("proj/.git"));
        assert!(matches!(
            discover(&roots, &format!("{r}/proj"), 1).unwrap_err(),
            LauncherError::Unsafe(_)
        ));
        assert!(matches!(
            discover(&roots, &format!("{r}/wt"), 0).unwrap_err(),
            LauncherError::Unsafe(_)
        ));
        assert!(matches!(
            discover(&roots, &format!("{r}/link/sub"), 0).unwrap_err(),
            LauncherError::Unsafe(_)
        ));
        assert!(matches!(
            discover(&roots, &format!("{r}/missing"), 0).unwrap_err(),
            LauncherError::Missing(_)
        ));
        assert!(matches!(
            discover(&roots, r, 0).unwrap_err(),
            LauncherError::InvalidPath(_)
        ));
        assert!(matches!(
            discover(&roots, "/etc", 0).unwrap_err(),
            LauncherError::InvalidPath(_)
        ));
        assert!(matches!(
            discover(&roots, &format!("{r}/proj/"), 0).unwrap_err(),
            LauncherError::InvalidPath(_)
        ));
        // Walking up stops below the root: a .git in the root itself is not found.
        std::fs::create_dir_all(root.join(".git")).unwrap();
        std::fs::create_dir_all(root.join("plain")).unwrap();
        assert!(matches!(
            discover(&roots, &format!("{r}/plain"), 0).unwrap_err(),
            LauncherError::Missing(_)
        ));
    }
}
