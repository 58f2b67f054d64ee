//! The bubblewrap sandbox: its argument list (pure, unit-tested), its environment, and the
//! spawn that joins the task cgroup and drops to the agent uid before bwrap runs.
//!
//! Identity (research §0.2, §4): bwrap started by root inherits every capability and maps the
//! sandbox uid to host root. So the child first writes itself into the task's cgroup (the files
//! of [`TaskCgroup::join_files`](crate::cgroup::TaskCgroup::join_files), which needs root), then
//! `setgroups([])`, `setresgid`, `setresuid` to the agent identity, and only then execs bwrap,
//! unprivileged; `--cap-drop ALL` stays as a fail-safe. All of that is [`crate::proc`]'s one
//! child setup, which runs in the forked child and allocates nothing.
//!
//! Descriptors: every inherited descriptor above 2 is marked close-on-exec, then exactly the
//! ones bwrap consumes are kept: the `--args` memfd (so the argument list, environment and task
//! token never appear in `/proc/<pid>/cmdline`), the synthetic `/etc/passwd`, `/etc/group` and
//! `/etc/hosts`, the two seccomp programs, the write end of the `--json-status-fd` pipe (how
//! a setup failure is told from the command exiting 1: [`StatusPipe`]), and `O_PATH` handles of the workspace, venv and
//! gateway directory for `--bind-fd`. bwrap reads such a handle back as a path and mounts the
//! path (checking device and inode afterwards), so the handles the launcher passes are those of
//! its staging mounts under root-only `mnt/<tid>/` ([`crate::stage`]), whose paths nobody else
//! can change: the mounted directory is the one that was validated and handed over, whatever
//! has been renamed since. bwrap closes each of them after use, so the sandboxed command starts
//! with 0-2 only.
//!
//! The root is an explicit allowlist (never `--ro-bind / /`): `/usr` read-only with the usual
//! merged-/usr symlinks, a few `/etc` entries, fresh `/proc`, `/dev`, size-capped tmpfs for
//! `/tmp` and the home, a tmpfs `/opt` holding the claude binary and the venv. Unix sockets of
//! the host (the launcher's, other tasks', D-Bus, Docker) are therefore simply absent, and
//! `--unshare-net` leaves only a loopback interface (abstract sockets are per network
//! namespace).

use std::collections::BTreeMap;
use std::ffi::{CStr, OsStr, OsString};
use std::io::{Seek, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use agentbox_policy::secret::Secret;
use rustix::fs::{MemfdFlags, OFlags, SealFlags};
use rustix::process::Resource;

use crate::proc::{self, ChildSetup};
use crate::seccomp;

/// The bubblewrap binary (root-owned, not writable by others; a `PATH` lookup could find one
/// the caller planted).
pub const BWRAP: &str = "/usr/bin/bwrap";
/// Where the claude binary appears inside agent sandboxes.
pub const CLAUDE_IN_SANDBOX: &str = "/opt/agentbox/bin/claude";
/// The gateway directory inside agent sandboxes.
pub const GATEWAY_DIR: &str = "/run/gw";
/// The agent's home inside the sandbox.
pub const HOME: &str = "/home/agent";
/// The user name of the agent identity inside the sandbox.
pub const AGENT_USER: &str = "agent";
/// Where a rollout slot's server binary appears.
pub const SERVER_IN_SANDBOX: &str = "/opt/agentbox/bin/blackbox-server";
/// Where the pinned agent CLIs (`launcher.clients_dir`) appear in a rollout slot.
pub const CLIENTS_IN_SANDBOX: &str = "/opt/clients";
/// The directory, bound out to the host, where a slot's server creates its unix socket.
pub const SERVER_SOCKET_DIR: &str = "/run/bbs";

/// Soft and hard `RLIMIT_NOFILE` of sandboxed processes.
const NOFILE: u64 = 4096;

/// What runs inside.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Program {
    /// `claude <args>`: the binary from `launcher.claude_bin`.
    Claude { args: Vec<String> },
    /// `bash -c <command>` (checks).
    Bash { command: String },
    /// A rollout slot's server: the binary `bin` (`launcher.blackbox_bin`), bound read-only at
    /// [`SERVER_IN_SANDBOX`] and run without arguments (it is configured by `BBS_*`).
    Server { bin: PathBuf },
    /// `/bin/sh -lc <command>` in `cwd` (an inside path: a command in a rollout slot).
    Shell { command: String, cwd: String },
}

/// Everything that decides a sandbox's argument list.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub program: Program,
    /// The complete environment (see [`environment`]).
    pub env: BTreeMap<String, String>,
    pub with_venv: bool,
    pub with_gateway: bool,
    pub tmp_bytes: u64,
    pub home_bytes: u64,
    /// `RLIMIT_FSIZE` of sandboxed processes: no file they write grows past it (the disk
    /// limit, so a single write cannot outrun the disk watcher by more).
    pub file_bytes: u64,
    pub claude_bin: PathBuf,
}

/// Descriptor numbers, as the child will see them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdNumbers {
    pub workspace: RawFd,
    pub venv: Option<RawFd>,
    pub gateway: Option<RawFd>,
    /// A home and `/tmp` of their own on disk (rollout slots) instead of fresh tmpfs.
    pub home: Option<RawFd>,
    pub tmp: Option<RawFd>,
    /// The directory bound at [`SERVER_SOCKET_DIR`].
    pub server_dir: Option<RawFd>,
    /// The agent CLIs, bound read-only at [`CLIENTS_IN_SANDBOX`].
    pub clients: Option<RawFd>,
    pub passwd: RawFd,
    pub group: RawFd,
    pub hosts: RawFd,
    pub seccomp_main: RawFd,
    pub seccomp_enosys: RawFd,
    /// The write end of the `--json-status-fd` pipe.
    pub status: RawFd,
    /// The host's `/etc/localtime`, copied (none: the host has none).
    pub localtime: Option<RawFd>,
    /// The read end of the start gate's pipe (`--block-fd`; none: the command runs at once).
    pub gate: Option<RawFd>,
}

/// The sandbox environment: fixed launcher variables, then the request's allowlisted ones (the
/// policy denylist guarantees those cannot override a launcher variable), then for agents the
/// gateway settings and the task token.
pub fn environment(
    allowlisted: &BTreeMap<String, String>,
    with_venv: bool,
    agent_token: Option<&Secret>,
    is_agent: bool,
) -> BTreeMap<String, String> {
    let mut env = BTreeMap::new();
    let mut set = |k: &str, v: &str| {
        env.insert(k.to_owned(), v.to_owned());
    };
    let path = if with_venv {
        "/opt/venv/bin:/opt/agentbox/bin:/usr/local/bin:/usr/bin:/bin"
    } else {
        "/opt/agentbox/bin:/usr/local/bin:/usr/bin:/bin"
    };
    set("PATH", path);
    set("HOME", HOME);
    set("USER", AGENT_USER);
    set("LOGNAME", AGENT_USER);
    set("SHELL", "/bin/bash");
    set("TMPDIR", "/tmp");
    set("LANG", "C.UTF-8");
    // Python's bytecode cache is keyed on the source's mtime in whole seconds and its size: an
    // edit within the second of a test run that keeps the size (`a - b` to `a + b`) leaves a
    // stale `.pyc` that a later check in the same workspace runs instead of the fix.
    set("PYTHONDONTWRITEBYTECODE", "1");
    if with_venv {
        set("VIRTUAL_ENV", "/opt/venv");
    }
    if is_agent {
        set("ANTHROPIC_UNIX_SOCKET", "/run/gw/llm.sock");
        set("ANTHROPIC_BASE_URL", "http://localhost");
        set("DISABLE_AUTOUPDATER", "1");
        set("DISABLE_TELEMETRY", "1");
        set("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "1");
        if let Some(token) = agent_token {
            set("ANTHROPIC_AUTH_TOKEN", token.expose());
        }
    }
    for (k, v) in allowlisted {
        env.entry(k.clone()).or_insert_with(|| v.clone());
    }
    env
}

/// The bwrap argument list (given to bwrap through `--args`, NUL-separated).
pub fn bwrap_args(plan: &Plan, fds: &FdNumbers) -> Vec<OsString> {
    let mut a: Vec<OsString> = Vec::new();
    let mut push = |items: &[&str]| a.extend(items.iter().map(OsString::from));
    push(&[
        "--unshare-all",
        // --unshare-all only *tries* a user namespace; without one bwrap would need setuid.
        "--unshare-user",
        "--disable-userns",
        "--assert-userns-disabled",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--hostname",
        "agentbox",
        "--ro-bind",
        "/usr",
        "/usr",
        "--symlink",
        "usr/bin",
        "/bin",
        "--symlink",
        "usr/sbin",
        "/sbin",
        "--symlink",
        "usr/lib",
        "/lib",
        "--symlink",
        "usr/lib64",
        "/lib64",
        "--ro-bind-try",
        "/etc/ssl",
        "/etc/ssl",
        "--ro-bind-try",
        "/etc/ca-certificates",
        "/etc/ca-certificates",
        "--ro-bind-try",
        "/etc/alternatives",
        "/etc/alternatives",
        "--ro-bind-try",
        "/etc/ld.so.cache",
        "/etc/ld.so.cache",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
    ]);
    let fd = |n: RawFd| n.to_string();
    let mut push_owned = |items: Vec<String>| a.extend(items.into_iter().map(OsString::from));
    push_owned(vec![
        "--ro-bind-data".into(),
        fd(fds.passwd),
        "/etc/passwd".into(),
        "--ro-bind-data".into(),
        fd(fds.group),
        "/etc/group".into(),
        "--ro-bind-data".into(),
        fd(fds.hosts),
        "/etc/hosts".into(),
    ]);
    match fds.tmp {
        Some(t) => push_owned(vec!["--bind-fd".into(), fd(t), "/tmp".into()]),
        None => push_owned(vec![
            "--perms".into(),
            "1777".into(),
            "--size".into(),
            plan.tmp_bytes.to_string(),
            "--tmpfs".into(),
            "/tmp".into(),
        ]),
    }
    match fds.home {
        Some(h) => push_owned(vec!["--bind-fd".into(), fd(h), HOME.into()]),
        None => push_owned(vec![
            "--perms".into(),
            "0700".into(),
            "--size".into(),
            plan.home_bytes.to_string(),
            "--tmpfs".into(),
            HOME.into(),
        ]),
    }
    if let Some(d) = fds.server_dir {
        push_owned(vec!["--bind-fd".into(), fd(d), SERVER_SOCKET_DIR.into()]);
    }
    push_owned(vec![
        // A tmpfs, so bind targets below it can be created (a target under read-only /usr
        // that does not exist on the host cannot).
        "--tmpfs".into(),
        "/opt".into(),
        "--bind-fd".into(),
        fd(fds.workspace),
        "/workspace".into(),
    ]);
    // A copy, not a bind: a bind's mount root in the sandbox's mountinfo would be the zone
    // file's host path (`/usr/share/zoneinfo/...`); bwrap's data files show a neutral
    // `/bindfileXXXXXX`.
    if let Some(t) = fds.localtime {
        push_owned(vec![
            "--ro-bind-data".into(),
            fd(t),
            "/etc/localtime".into(),
        ]);
    }
    if let Some(v) = fds.venv.filter(|_| plan.with_venv) {
        push_owned(vec!["--ro-bind-fd".into(), fd(v), "/opt/venv".into()]);
    }
    if let Some(g) = fds.gateway.filter(|_| plan.with_gateway) {
        push_owned(vec!["--bind-fd".into(), fd(g), GATEWAY_DIR.into()]);
    }
    match &plan.program {
        Program::Claude { .. } => {
            a.push("--ro-bind".into());
            a.push(plan.claude_bin.clone().into_os_string());
            a.push(CLAUDE_IN_SANDBOX.into());
        }
        Program::Server { bin } => {
            a.push("--ro-bind".into());
            a.push(bin.clone().into_os_string());
            a.push(SERVER_IN_SANDBOX.into());
        }
        Program::Bash { .. } | Program::Shell { .. } => {}
    }
    if let Some(c) = fds.clients {
        a.push("--ro-bind-fd".into());
        a.push(c.to_string().into());
        a.push(CLIENTS_IN_SANDBOX.into());
    }
    let mut push_owned = |items: Vec<String>| a.extend(items.into_iter().map(OsString::from));
    push_owned(vec![
        "--remount-ro".into(),
        "/opt".into(),
        // The root tmpfs itself (where /etc and the mount points live); the writable mounts
        // below it are separate and stay writable.
        "--remount-ro".into(),
        "/".into(),
        "--chdir".into(),
        match &plan.program {
            Program::Shell { cwd, .. } => cwd.clone(),
            Program::Claude { .. } | Program::Bash { .. } | Program::Server { .. } => {
                "/workspace".to_owned()
            }
        },
        "--clearenv".into(),
    ]);
    for (k, v) in &plan.env {
        push_owned(vec!["--setenv".into(), k.clone(), v.clone()]);
    }
    push_owned(vec![
        "--add-seccomp-fd".into(),
        fd(fds.seccomp_main),
        "--add-seccomp-fd".into(),
        fd(fds.seccomp_enosys),
        // bwrap writes `{"exit-code": N}` here only once the command was executed, which is
        // how a setup failure is told from the command's own exit status ([`StatusPipe`]).
        "--json-status-fd".into(),
        fd(fds.status),
    ]);
    if let Some(g) = fds.gate {
        push_owned(vec!["--block-fd".into(), fd(g)]);
    }
    a
}

/// The command bwrap runs, after `--`. bwrap takes it from its real argv only (whatever follows
/// `--` inside an `--args` file is dropped), so it is the one part of the sandbox description
/// visible in `/proc/<pid>/cmdline`; the environment and token stay in the `--args` memfd.
pub fn command_args(plan: &Plan) -> Vec<OsString> {
    let mut a: Vec<OsString> = vec!["--".into()];
    match &plan.program {
        Program::Claude { args } => {
            a.push(CLAUDE_IN_SANDBOX.into());
            a.extend(args.iter().map(OsString::from));
        }
        Program::Bash { command } => {
            a.extend(["/bin/bash", "-c"].map(OsString::from));
            a.push(command.into());
        }
        Program::Server { .. } => a.push(SERVER_IN_SANDBOX.into()),
        Program::Shell { command, .. } => {
            a.extend(["/bin/sh", "-lc"].map(OsString::from));
            a.push(command.into());
        }
    }
    a
}

/// The largest `/etc/localtime` copied into a sandbox (zone files are a few KiB).
const LOCALTIME_CAP: u64 = 256 * 1024;

/// The host's `/etc/localtime` (a root-owned system file), if it has one of a plausible size.
fn read_localtime() -> Option<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open("/etc/localtime").ok()?;
    let mut data = Vec::new();
    file.take(LOCALTIME_CAP + 1).read_to_end(&mut data).ok()?;
    (data.len() as u64 <= LOCALTIME_CAP).then_some(data)
}

/// The synthetic `/etc/passwd`, `/etc/group` and `/etc/hosts` (Node and many tools want an
/// entry for the current uid; nothing else about the host's users is shown).
pub fn identity_files(uid: u32, gid: u32) -> (String, String, String) {
    (
        format!("{AGENT_USER}:x:{uid}:{gid}:agentbox agent:{HOME}:/bin/bash\n"),
        format!("{AGENT_USER}:x:{gid}:\n"),
        "127.0.0.1\tlocalhost\n::1\tlocalhost\n".to_owned(),
    )
}

/// Why a sandbox could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error(transparent)]
    Seccomp(#[from] seccomp::SeccompError),
    #[error(transparent)]
    Process(#[from] proc::SpawnError),
}

fn io(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> SpawnError {
    let what = what.into();
    move |source| SpawnError::Io { what, source }
}

/// An in-memory file with `data`, positioned at its start, for bwrap to read.
fn memfd(name: &str, data: &[u8]) -> Result<OwnedFd, SpawnError> {
    let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC).map_err(|e| SpawnError::Io {
        what: format!("memfd {name}"),
        source: e.into(),
    })?;
    let mut file = std::fs::File::from(fd);
    file.write_all(data)
        .map_err(io(format!("writing memfd {name}")))?;
    file.rewind()
        .map_err(io(format!("rewinding memfd {name}")))?;
    Ok(OwnedFd::from(file))
}

/// The sandbox's standard input: a sealed in-memory file holding `data` (no write, grow,
/// shrink or further seal), opened read-only afresh so it starts at offset 0. The prompt travels
/// this way, never through an argument list (which every local user can read in
/// `/proc/<pid>/cmdline` while the run lasts).
fn stdin_file(data: &[u8]) -> Result<OwnedFd, SpawnError> {
    let fd = rustix::fs::memfd_create("stdin", MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
        .map_err(|e| SpawnError::Io {
            what: "memfd stdin".to_owned(),
            source: e.into(),
        })?;
    let mut file = std::fs::File::from(fd);
    file.write_all(data).map_err(io("writing memfd stdin"))?;
    let seals = SealFlags::SHRINK | SealFlags::GROW | SealFlags::WRITE | SealFlags::SEAL;
    rustix::fs::fcntl_add_seals(&file, seals).map_err(|e| SpawnError::Io {
        what: "sealing memfd stdin".to_owned(),
        source: e.into(),
    })?;
    let path = format!("/proc/self/fd/{}", file.as_raw_fd());
    rustix::fs::open(
        path.as_str(),
        OFlags::RDONLY | OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .map_err(|e| SpawnError::Io {
        what: "reopening memfd stdin".to_owned(),
        source: e.into(),
    })
}

/// The read end of bwrap's `--json-status-fd`. bwrap (its monitor process, outside the
/// sandbox) writes `{"child-pid": N, ...}` once the sandbox process exists and
/// `{"exit-code": N}` when the command ends, but only if the command was executed: a setup
/// failure (a mount, the seccomp filter, `execvp`) makes bwrap exit 1 without the second
/// record, just as the command exiting 1 would make it exit 1 with it. The sandboxed side
/// never holds the write end (bwrap closes it before any of its own setup).
#[derive(Debug)]
pub struct StatusPipe(OwnedFd);

/// What bwrap reported on its status descriptor.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BwrapStatus {
    /// The sandbox's first process, as the host sees it.
    pub child_pid: Option<i64>,
    /// The command's exit status; `None` if it never ran (or bwrap was killed before it could
    /// say).
    pub exit_code: Option<i32>,
}

/// The most the status pipe is read (bwrap writes two short records).
const STATUS_CAP: usize = 64 * 1024;

impl StatusPipe {
    /// Reads what bwrap wrote, without blocking (call after bwrap exited).
    pub fn read(&self) -> BwrapStatus {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        while buf.len() < STATUS_CAP {
            match rustix::io::read(&self.0, &mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        parse_status(&buf)
    }
}

/// The records of a `--json-status-fd` stream (concatenated JSON objects); anything that does
/// not parse ends the reading.
pub fn parse_status(bytes: &[u8]) -> BwrapStatus {
    let mut status = BwrapStatus::default();
    for record in serde_json::Deserializer::from_slice(bytes).into_iter::<serde_json::Value>() {
        let Ok(record) = record else {
            break;
        };
        if let Some(pid) = record.get("child-pid").and_then(serde_json::Value::as_i64) {
            status.child_pid = Some(pid);
        }
        if let Some(code) = record
            .get("exit-code")
            .and_then(serde_json::Value::as_i64)
            .and_then(|c| i32::try_from(c).ok())
        {
            status.exit_code = Some(code);
        }
    }
    status
}

/// A started sandbox.
#[derive(Debug)]
pub struct Sandbox {
    pub child: proc::Child,
    pub status: StatusPipe,
    /// Present when spawned with [`Start::Gated`]: the command waits for it.
    pub gate: Option<Gate>,
}

/// When the sandboxed command may run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Start {
    /// As soon as bwrap has built the sandbox.
    Now,
    /// Only once [`Gate::open`] is called: bwrap builds the namespaces, mounts, root and
    /// identity (most of a start's time), then blocks on `--block-fd` right before the seccomp
    /// filter and `execve`. The launcher hands the workspace over meanwhile.
    Gated,
}

/// The write end of a gated sandbox's `--block-fd` pipe.
///
/// bwrap goes on at the first byte *or at end of file*, so closing this end is as good as
/// opening the gate. Hence the only ways to let go of it: [`Gate::open`], or
/// [`Gate::close_after_kill`] once nothing in the sandbox is left to read it. Killing bwrap is
/// not enough for that: the sandbox's init, blocked on the gate, outlives it (tested); kill the
/// sandbox's cgroup. A gate dropped any other way (a bug, or an unwinding panic) keeps its
/// descriptor open for the life of the process, so the command never runs. If the process
/// dies, the gate closes with it: the launcher kills orphaned sandboxes when it starts again.
#[derive(Debug)]
#[must_use = "an unopened gate holds its sandbox's command back"]
pub struct Gate(Option<OwnedFd>);

impl Gate {
    /// Lets the command run. A sandbox that already died (bwrap failed, or was killed) is not an
    /// error here: its exit status tells.
    pub fn open(mut self) -> std::io::Result<()> {
        let Some(fd) = self.0.take() else {
            return Ok(());
        };
        match rustix::io::write(&fd, b"g") {
            Ok(_) | Err(rustix::io::Errno::PIPE) => Ok(()),
            Err(e) => {
                // Keep the descriptor (as dropping an unopened gate does): closing it would let
                // the command run after a failed open.
                self.0 = Some(fd);
                Err(e.into())
            }
        }
    }

    /// Closes the gate's pipe once every process of the sandbox is gone (its cgroup killed and
    /// bwrap waited for), when closing can no longer release anything.
    pub fn close_after_kill(mut self) {
        drop(self.0.take());
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        if let Some(fd) = self.0.take() {
            tracing::error!(
                "a sandbox's start gate was dropped unopened; its descriptor stays open so the command never runs"
            );
            // Deliberately leaked: see the type's documentation.
            let _ = std::os::fd::IntoRawFd::into_raw_fd(fd);
        }
    }
}

/// The descriptors of the directories bwrap mounts.
#[derive(Debug)]
pub struct Mounts {
    pub workspace: OwnedFd,
    pub venv: Option<OwnedFd>,
    pub gateway: Option<OwnedFd>,
    /// Rollout slots: their home, `/tmp` and server socket directory (see [`FdNumbers`]).
    pub home: Option<OwnedFd>,
    pub tmp: Option<OwnedFd>,
    pub server_dir: Option<OwnedFd>,
    pub clients: Option<OwnedFd>,
    /// Staged mounts ([`crate::stage`]): the descriptors above are detached mounts, and this
    /// is `mnt/<tid>`, where the child attaches each under its name in a mount namespace of
    /// its own before it execs bwrap. `None`: they are plain directories, bound as they are.
    pub attach: Option<OwnedFd>,
}

impl Mounts {
    /// Each mount with its name under `mnt/<tid>/`.
    fn named(&self) -> impl Iterator<Item = (RawFd, &'static CStr)> {
        use crate::stage;
        [
            (Some(&self.workspace), stage::WORKSPACE),
            (self.venv.as_ref(), stage::VENV),
            (self.gateway.as_ref(), stage::GATEWAY),
            (self.home.as_ref(), stage::HOME),
            (self.tmp.as_ref(), stage::TMP),
            (self.server_dir.as_ref(), stage::SERVER),
            (self.clients.as_ref(), stage::CLIENTS),
        ]
        .into_iter()
        .filter_map(|(fd, name)| Some((fd?.as_raw_fd(), name)))
    }
}

/// The host mounts a child with its own namespace detaches before bwrap starts: the sandbox
/// gets a `/proc` and `/dev` of its own and no `/sys` at all, and on a host with cgroup v1 `/sys`
/// carries a dozen mounts (twelve of the twenty lines here) that bwrap would otherwise copy
/// and reread for every mount it makes.
const SHED: [&CStr; 1] = [c"/sys"];

/// The identity the sandbox runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunAs {
    pub uid: u32,
    pub gid: u32,
}

/// Starts bwrap for `plan` as `run_as`, inside the cgroup whose join files are given
/// ([`TaskCgroup::join_files`](crate::cgroup::TaskCgroup::join_files); none: no cgroup),
/// with stdin from `stdin` (through [`stdin_file`]; none: `/dev/null`) and stdout/stderr
/// piped; returns it with its [`StatusPipe`] and, for [`Start::Gated`], its [`Gate`].
///
/// Must be called from a long-lived thread (an async task on a runtime worker, not
/// `spawn_blocking`): the parent-death signal set in the child fires when the *thread* that
/// forked it exits.
pub fn spawn(
    plan: &Plan,
    mounts: &Mounts,
    cgroup_join: &[PathBuf],
    run_as: RunAs,
    bwrap: &Path,
    stdin: Option<&[u8]>,
    start: Start,
) -> Result<Sandbox, SpawnError> {
    let stdin = match stdin {
        Some(data) => Some(stdin_file(data)?),
        None => None,
    };
    let (passwd, group, hosts) = identity_files(run_as.uid, run_as.gid);
    let (status_read, status_write) = rustix::pipe::pipe_with(
        rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK,
    )
    .map_err(|e| SpawnError::Io {
        what: "status pipe".to_owned(),
        source: e.into(),
    })?;
    // Only the read end may be non-blocking: bwrap writes its records with plain writes.
    rustix::fs::fcntl_setfl(&status_write, rustix::fs::OFlags::empty()).map_err(|e| {
        SpawnError::Io {
            what: "status pipe".to_owned(),
            source: e.into(),
        }
    })?;
    // Both ends close-on-exec: only the read end is kept in the child (and only there).
    let gate = match start {
        Start::Now => None,
        Start::Gated => Some(
            rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| {
                SpawnError::Io {
                    what: "gate pipe".to_owned(),
                    source: e.into(),
                }
            })?,
        ),
    };
    let passwd = memfd("passwd", passwd.as_bytes())?;
    let group = memfd("group", group.as_bytes())?;
    let hosts = memfd("hosts", hosts.as_bytes())?;
    let localtime = match read_localtime() {
        Some(data) => Some(memfd("localtime", &data)?),
        None => None,
    };
    let (main_bytes, enosys_bytes) = seccomp::program_bytes()?;
    let main = memfd("seccomp", main_bytes)?;
    let enosys = memfd("seccomp-enosys", enosys_bytes)?;
    let numbers = FdNumbers {
        workspace: mounts.workspace.as_raw_fd(),
        venv: mounts.venv.as_ref().map(AsRawFd::as_raw_fd),
        gateway: mounts.gateway.as_ref().map(AsRawFd::as_raw_fd),
        home: mounts.home.as_ref().map(AsRawFd::as_raw_fd),
        tmp: mounts.tmp.as_ref().map(AsRawFd::as_raw_fd),
        server_dir: mounts.server_dir.as_ref().map(AsRawFd::as_raw_fd),
        clients: mounts.clients.as_ref().map(AsRawFd::as_raw_fd),
        passwd: passwd.as_raw_fd(),
        group: group.as_raw_fd(),
        hosts: hosts.as_raw_fd(),
        seccomp_main: main.as_raw_fd(),
        seccomp_enosys: enosys.as_raw_fd(),
        status: status_write.as_raw_fd(),
        localtime: localtime.as_ref().map(AsRawFd::as_raw_fd),
        gate: gate.as_ref().map(|(read, _)| read.as_raw_fd()),
    };
    let mut args_bytes = Vec::new();
    for arg in bwrap_args(plan, &numbers) {
        args_bytes.extend_from_slice(arg.as_encoded_bytes());
        args_bytes.push(0);
    }
    let args = memfd("bwrap-args", &args_bytes)?;

    let mut keep: Vec<RawFd> = vec![
        numbers.workspace,
        numbers.passwd,
        numbers.group,
        numbers.hosts,
        numbers.seccomp_main,
        numbers.seccomp_enosys,
        numbers.status,
        args.as_raw_fd(),
    ];
    keep.extend(numbers.venv);
    keep.extend(numbers.gateway);
    keep.extend(numbers.home);
    keep.extend(numbers.tmp);
    keep.extend(numbers.server_dir);
    keep.extend(numbers.clients);
    keep.extend(numbers.localtime);
    keep.extend(numbers.gate);
    let mut setup = ChildSetup::new(run_as.uid, run_as.gid);
    if let Some(dir) = &mounts.attach {
        let attach: Vec<_> = mounts.named().collect();
        // A host path the sandbox binds below a shed one keeps it.
        let binds_below = |shed: &CStr| {
            let shed = Path::new(OsStr::from_bytes(shed.to_bytes()));
            match &plan.program {
                Program::Claude { .. } => plan.claude_bin.starts_with(shed),
                Program::Server { bin } => bin.starts_with(shed),
                Program::Bash { .. } | Program::Shell { .. } => false,
            }
        };
        let shed: Vec<&'static CStr> = SHED.into_iter().filter(|s| !binds_below(s)).collect();
        setup = setup.own_mounts(dir.as_raw_fd(), &attach, &shed);
    }
    let setup = setup
        .join_cgroup(cgroup_join)?
        .rlimit(Resource::Nofile, NOFILE)
        .rlimit(Resource::Core, 0)
        .rlimit(Resource::Fsize, plan.file_bytes)
        .keep(&keep);

    let mut exec = proc::Exec::new(bwrap)
        .arg("--args")
        .arg(args.as_raw_fd().to_string())
        .args(command_args(plan));
    if let Some(fd) = stdin {
        exec = exec.stdin(fd);
    }
    let (gate_read, gate) = match gate {
        Some((read, write)) => (Some(read), Some(Gate(Some(write)))),
        None => (None, None),
    };
    let child = setup.spawn_exec(exec)?;
    // The parent's copies of the descriptors close here; the child has its own (so the status
    // pipe reaches its end when bwrap exits).
    drop((
        passwd,
        group,
        hosts,
        main,
        enosys,
        args,
        status_write,
        localtime,
        gate_read,
    ));
    Ok(Sandbox {
        child,
        status: StatusPipe(status_read),
        gate,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(program: Program, venv: bool, gateway: bool) -> Plan {
        Plan {
            program,
            env: environment(&BTreeMap::new(), venv, None, gateway),
            with_venv: venv,
            with_gateway: gateway,
            tmp_bytes: 1 << 20,
            home_bytes: 2 << 20,
            file_bytes: 3 << 20,
            claude_bin: PathBuf::from("/opt/claude/bin/claude"),
        }
    }

    const FDS: FdNumbers = FdNumbers {
        workspace: 10,
        venv: Some(11),
        gateway: Some(12),
        home: None,
        tmp: None,
        server_dir: None,
        clients: None,
        passwd: 13,
        group: 14,
        hosts: 15,
        seccomp_main: 16,
        seccomp_enosys: 17,
        status: 18,
        localtime: Some(19),
        gate: None,
    };

    fn strings(a: &[OsString]) -> Vec<String> {
        a.iter().map(|s| s.to_str().unwrap().to_owned()).collect()
    }

    fn has_seq(args: &[String], seq: &[&str]) -> bool {
        args.windows(seq.len())
            .any(|w| w.iter().zip(seq).all(|(a, b)| a == b))
    }

    #[test]
    fn agent_args() {
        let p = plan(
            Program::Claude {
                args: vec!["-p".into(), "x y".into()],
            },
            true,
            true,
        );
        let a = strings(&bwrap_args(&p, &FDS));
        for seq in [
            &["--unshare-all", "--unshare-user"][..],
            &["--cap-drop", "ALL"],
            &["--ro-bind", "/usr", "/usr"],
            &["--bind-fd", "10", "/workspace"],
            &["--ro-bind-fd", "11", "/opt/venv"],
            &["--bind-fd", "12", "/run/gw"],
            &[
                "--ro-bind",
                "/opt/claude/bin/claude",
                "/opt/agentbox/bin/claude",
            ],
            &["--size", "1048576", "--tmpfs", "/tmp"],
            &[
                "--perms",
                "0700",
                "--size",
                "2097152",
                "--tmpfs",
                "/home/agent",
            ],
            &["--add-seccomp-fd", "16", "--add-seccomp-fd", "17"],
            &["--json-status-fd", "18"],
            &["--ro-bind-data", "19", "/etc/localtime"],
            &["--setenv", "ANTHROPIC_UNIX_SOCKET", "/run/gw/llm.sock"],
        ] {
            assert!(has_seq(&a, seq), "{seq:?} missing in {a:?}");
        }
        assert!(has_seq(&a, &["--remount-ro", "/"]), "{a:?}");
        assert!(!has_seq(&a, &["--ro-bind", "/", "/"]));
        // Copied, not bound: a bind's root would show the host's zone file path.
        assert!(!has_seq(&a, &["--ro-bind-try", "/etc/localtime"]));
        assert!(!a.iter().any(|s| s == "--share-net"));
        assert_eq!(
            strings(&command_args(&p)),
            ["--", "/opt/agentbox/bin/claude", "-p", "x y"]
        );
    }

    #[test]
    fn check_args_have_no_gateway_or_claude() {
        let p = plan(
            Program::Bash {
                command: "echo hi".into(),
            },
            false,
            false,
        );
        let a = strings(&bwrap_args(&p, &FDS));
        assert!(
            !a.iter()
                .any(|s| s == "/run/gw" || s == "/opt/venv" || s == CLAUDE_IN_SANDBOX)
        );
        assert_eq!(
            strings(&command_args(&p)),
            ["--", "/bin/bash", "-c", "echo hi"]
        );
        assert!(!a.iter().any(|s| s.starts_with("ANTHROPIC")));
    }

    #[test]
    fn slot_args_bind_home_tmp_socket_dir_clients_and_server() {
        let p = plan(
            Program::Server {
                bin: PathBuf::from("/usr/local/bin/blackbox-server"),
            },
            false,
            true,
        );
        let fds = FdNumbers {
            home: Some(20),
            tmp: Some(21),
            server_dir: Some(22),
            clients: Some(23),
            venv: None,
            ..FDS
        };
        let a = strings(&bwrap_args(&p, &fds));
        for seq in [
            &["--bind-fd", "20", "/home/agent"][..],
            &["--bind-fd", "21", "/tmp"],
            &["--bind-fd", "22", "/run/bbs"],
            &["--ro-bind-fd", "23", "/opt/clients"],
            &["--bind-fd", "12", "/run/gw"],
            &[
                "--ro-bind",
                "/usr/local/bin/blackbox-server",
                "/opt/agentbox/bin/blackbox-server",
            ],
            &["--chdir", "/workspace"],
        ] {
            assert!(has_seq(&a, seq), "{seq:?} missing in {a:?}");
        }
        // On-disk home and tmp replace the tmpfs ones.
        assert!(!has_seq(&a, &["--tmpfs", "/tmp"]), "{a:?}");
        assert!(!has_seq(&a, &["--tmpfs", "/home/agent"]), "{a:?}");
        assert!(!a.iter().any(|s| s == "--share-net"));
        assert_eq!(
            strings(&command_args(&p)),
            ["--", "/opt/agentbox/bin/blackbox-server"]
        );
        let sh = plan(
            Program::Shell {
                command: "pwd".into(),
                cwd: "/workspace/sub".into(),
            },
            false,
            false,
        );
        let a = strings(&bwrap_args(&sh, &fds));
        assert!(has_seq(&a, &["--chdir", "/workspace/sub"]), "{a:?}");
        assert_eq!(strings(&command_args(&sh)), ["--", "/bin/sh", "-lc", "pwd"]);
    }

    #[test]
    fn environment_layers() {
        let allowed = BTreeMap::from([("MAX_THINKING_TOKENS".to_owned(), "5".to_owned())]);
        let token = Secret::new("tok".to_owned()).unwrap();
        let env = environment(&allowed, true, Some(&token), true);
        assert_eq!(env["ANTHROPIC_AUTH_TOKEN"], "tok");
        assert_eq!(env["MAX_THINKING_TOKENS"], "5");
        assert!(env["PATH"].starts_with("/opt/venv/bin:"));
        assert_eq!(env["HOME"], HOME);
        let env = environment(&allowed, false, Some(&token), false);
        assert!(!env.contains_key("ANTHROPIC_AUTH_TOKEN"));
        assert!(!env.contains_key("VIRTUAL_ENV"));
        // No bytecode cache in the workspace, venv or not (agents and checks share it).
        assert_eq!(env["PYTHONDONTWRITEBYTECODE"], "1");
    }

    #[test]
    fn status_records() {
        // What bwrap 0.8-0.11 write: the child record (with namespace ids), then the exit.
        let ran = parse_status(
            b"{ \"child-pid\": 4242, \"cgroup-namespace\": 4026531835, \"ipc-namespace\": 1 }\n\
              { \"exit-code\": 3 }\n",
        );
        assert_eq!(
            ran,
            BwrapStatus {
                child_pid: Some(4242),
                exit_code: Some(3)
            }
        );
        let failed = parse_status(b"{ \"child-pid\": 4242 }\n");
        assert_eq!(failed.exit_code, None);
        assert_eq!(parse_status(b""), BwrapStatus::default());
        assert_eq!(parse_status(b"{ \"exit-co").exit_code, None);
    }

    #[test]
    fn identity() {
        let (p, g, h) = identity_files(64000, 64001);
        assert_eq!(
            p,
            "agent:x:64000:64001:agentbox agent:/home/agent:/bin/bash\n"
        );
        assert_eq!(g, "agent:x:64001:\n");
        assert!(h.contains("localhost"));
    }
}
