//! Child processes of a privileged daemon: the one `pre_exec` setup every spawn goes through
//! (through std's `fork`, [`ChildSetup::spawn`], or without copying the daemon,
//! [`ChildSetup::spawn_exec`], `proc/vfork.rs`), capped capture of a child's output, and
//! termination of a process group. Also the process settings a daemon's `main` needs `libc`
//! for: [`tune_malloc`] (the gateway and the bridge, whose own crates forbid `unsafe`).
//!
//! # The child setup
//! Between `fork` and `exec` a multithreaded process may only do async-signal-safe things: a
//! lock another thread held at the fork (the allocator's, for one) stays locked forever in the
//! child. So [`ChildSetup`] prepares everything before the fork (the cgroup join files are
//! opened, the group list converted, the parent's pid read) and the hook only makes raw
//! syscalls on those values. Failures are reported as the bare errno
//! (`io::Error::from_raw_os_error`, which does not allocate); std sends it to the parent, whose
//! `spawn` returns it. In order, the hook:
//! 1. writes `0` into each cgroup join file (needs root, so first);
//! 2. optionally enters a mount namespace of its own ([`ChildSetup::own_mounts`]): attaches
//!    the staged mounts there and sheds host mounts the program never needs (needs
//!    `CAP_SYS_ADMIN`, so before the uid change);
//! 3. optionally starts a session (own process group, no controlling terminal);
//! 4. sets the supplementary groups, then the real/effective/saved gid and uid, and keeps the
//!    process non-dumpable (untraceable by that uid) until exec;
//! 5. arms the parent-death signal (after the uid change, which clears it) and fails with
//!    `ESRCH` if the parent already died, since nobody would supervise the child;
//! 6. applies the resource limits;
//! 7. marks every descriptor above 2 close-on-exec, then clears the flag on the ones the
//!    program must inherit.
//!
//! std's own `uid`/`gid` switch would happen before the hook and leave it unable to write the
//! root-owned cgroup files, which is why the identity change lives here.

use std::ffi::CStr;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::process::ExitStatus;
use std::time::Duration;

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::process::{Gid, Pid, Resource, Rlimit, Signal, Uid};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWriteExt};

mod vfork;
pub use vfork::{Child, Exec};

/// Why a child could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// A cgroup join file could not be opened (before the fork).
    #[error("open {}: {source}", path.display())]
    JoinFile {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    /// `spawn` failed: the program could not be executed, or the child setup failed (the
    /// error is then the errno of the failing step).
    #[error("spawn {program}: {source}")]
    Spawn {
        program: String,
        #[source]
        source: io::Error,
    },
}

/// Everything the child does between fork and exec, prepared before the fork.
#[derive(Debug)]
pub struct ChildSetup {
    /// Held open until the spawn returns; the child writes into its copies.
    join: Vec<OwnedFd>,
    plan: Plan,
}

/// Who the child becomes and what it keeps: plain numbers and vectors, built before the fork
/// and only read after it.
#[derive(Debug)]
struct Plan {
    uid: Uid,
    gid: Gid,
    groups: Vec<Gid>,
    /// Whether the child switches to `uid`/`gid`/`groups` (false: it keeps the parent's).
    change_identity: bool,
    new_session: bool,
    limits: Vec<(Resource, Rlimit)>,
    keep: Vec<RawFd>,
    mounts: Option<OwnMounts>,
}

/// The child's own mount namespace ([`ChildSetup::own_mounts`]), as descriptor numbers and
/// static names: nothing to allocate in the child.
#[derive(Debug)]
struct OwnMounts {
    dir: RawFd,
    attach: Vec<(RawFd, &'static CStr)>,
    shed: Vec<&'static CStr>,
}

impl ChildSetup {
    /// A child that runs as `uid`:`gid` with no supplementary groups, in the caller's session,
    /// with no descriptor above 2 inherited.
    pub fn new(uid: u32, gid: u32) -> ChildSetup {
        ChildSetup {
            join: Vec::new(),
            plan: Plan {
                uid: Uid::from_raw(uid),
                gid: Gid::from_raw(gid),
                groups: Vec::new(),
                change_identity: true,
                new_session: false,
                limits: Vec::new(),
                keep: Vec::new(),
                mounts: None,
            },
        }
    }

    /// A child that keeps this process's uid, gid and groups (a daemon that is not root, such
    /// as blackbox-server in its sandbox, cannot set groups), with everything else as
    /// [`ChildSetup::new`].
    pub fn same_identity() -> ChildSetup {
        let mut setup = ChildSetup::new(
            rustix::process::getuid().as_raw(),
            rustix::process::getgid().as_raw(),
        );
        setup.plan.change_identity = false;
        setup
    }

    /// Supplementary groups.
    pub fn groups(mut self, groups: &[u32]) -> ChildSetup {
        self.plan.groups = groups.iter().copied().map(Gid::from_raw).collect();
        self
    }

    /// Joins the cgroup whose join files (`cgroup.procs`, or one `tasks`/`cgroup.procs` per v1
    /// controller) are given; they are opened now.
    pub fn join_cgroup(mut self, files: &[PathBuf]) -> Result<ChildSetup, SpawnError> {
        for path in files {
            let fd = rustix::fs::open(path, OFlags::WRONLY | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| SpawnError::JoinFile {
                    path: path.clone(),
                    source: e.into(),
                })?;
            self.join.push(fd);
        }
        Ok(self)
    }

    /// The child runs in a mount namespace of its own, a copy of the caller's in which every
    /// mount is made a slave (nothing done there propagates back). There it attaches each
    /// detached mount of `attach` (from `open_tree(OPEN_TREE_CLONE)`, see [`crate::stage`])
    /// on its name below `dir` (a handle on a directory the caller owns), then detaches each
    /// path of `shed` with everything below it (best effort: not being a mount point there is
    /// fine). The mounts are seen by the child and what it starts only, and vanish with them;
    /// the caller's namespace never holds them. The child ends in `/` (its working directory
    /// was `dir` for the attach).
    ///
    /// Why shed: bwrap copies its parent's mount table into the sandbox's namespace and
    /// rereads all of it for every mount it makes, about 45 µs per line per start here
    /// (BENCHMARKS.md); mounts the sandbox never binds are pure cost.
    ///
    /// The descriptors must stay open until the spawn returns.
    pub fn own_mounts(
        mut self,
        dir: RawFd,
        attach: &[(RawFd, &'static CStr)],
        shed: &[&'static CStr],
    ) -> ChildSetup {
        self.plan.mounts = Some(OwnMounts {
            dir,
            attach: attach.to_vec(),
            shed: shed.to_vec(),
        });
        self
    }

    /// The child leads a session and process group of its own (so [`terminate_group`] reaches
    /// everything it forks that does not leave the group).
    pub fn new_session(mut self) -> ChildSetup {
        self.plan.new_session = true;
        self
    }

    /// Soft and hard limit `value` for `resource`.
    pub fn rlimit(mut self, resource: Resource, value: u64) -> ChildSetup {
        self.plan.limits.push((
            resource,
            Rlimit {
                current: Some(value),
                maximum: Some(value),
            },
        ));
        self
    }

    /// Descriptors the program inherits (they must stay open until [`ChildSetup::spawn`]
    /// returns).
    pub fn keep(mut self, fds: &[RawFd]) -> ChildSetup {
        self.plan.keep.extend_from_slice(fds);
        self
    }

    /// Installs the hook on `cmd` and spawns it. Call from a long-lived thread (an async task
    /// on a runtime worker, not `spawn_blocking`): the parent-death signal fires when the
    /// *thread* that forked the child exits.
    pub fn spawn(
        self,
        mut cmd: tokio::process::Command,
    ) -> Result<tokio::process::Child, SpawnError> {
        let program = cmd.as_std().get_program().to_string_lossy().into_owned();
        let hook = Hook {
            join: self.join.iter().map(AsRawFd::as_raw_fd).collect(),
            plan: self.plan,
            parent: rustix::process::getpid(),
        };
        // SAFETY: the hook runs in the forked child before exec. `Hook::run` makes raw
        // syscalls on values prepared here, allocates nothing and takes no lock.
        unsafe {
            cmd.pre_exec(move || hook.run());
        }
        let child = crate::reaper::spawning(|| cmd.spawn(), tokio::process::Child::id)
            .map_err(|source| SpawnError::Spawn { program, source })?;
        // The parent's copies of the join files close here.
        drop(self.join);
        Ok(child)
    }
}

/// What the forked child sees: the plan, the join files' numbers and the parent to check.
struct Hook {
    join: Vec<RawFd>,
    plan: Plan,
    parent: Pid,
}

fn errno(e: Errno) -> io::Error {
    io::Error::from_raw_os_error(e.raw_os_error())
}

impl Hook {
    /// Runs in the child between fork and exec. Async-signal-safe: raw syscalls only, no
    /// allocation (an `io::Error` from an errno is a plain integer).
    fn run(&self) -> io::Result<()> {
        let plan = &self.plan;
        for &fd in &self.join {
            // SAFETY: opened before the fork and still open in this child.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            rustix::io::write(fd, b"0").map_err(errno)?;
        }
        if let Some(mounts) = &plan.mounts {
            mounts.enter().map_err(errno)?;
        }
        if plan.new_session {
            rustix::process::setsid().map_err(errno)?;
        }
        if plan.change_identity {
            rustix::thread::set_thread_groups(&plan.groups).map_err(errno)?;
            rustix::thread::set_thread_res_gid(plan.gid, plan.gid, plan.gid).map_err(errno)?;
            rustix::thread::set_thread_res_uid(plan.uid, plan.uid, plan.uid).map_err(errno)?;
            // Until exec, no process of the new uid may trace this one: under `spawn_exec` its
            // memory is the daemon's. The kernel marks it non-dumpable at the uid change only
            // while `fs.suid_dumpable` is 0; this holds whatever the setting (exec gives the
            // program a dumpable image of its own again).
            rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)
                .map_err(errno)?;
        }
        rustix::process::set_parent_process_death_signal(Some(Signal::KILL)).map_err(errno)?;
        if rustix::process::getppid() != Some(self.parent) {
            // The parent died between fork and here; nobody would supervise this child.
            return Err(io::Error::from_raw_os_error(libc::ESRCH));
        }
        for &(resource, limit) in &plan.limits {
            rustix::process::setrlimit(resource, limit).map_err(errno)?;
        }
        // SAFETY: close_range only changes descriptor flags of this process.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_close_range,
                3_u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            )
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        for &fd in &plan.keep {
            // SAFETY: opened before the fork and still open in this child.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            rustix::io::fcntl_setfd(fd, rustix::io::FdFlags::empty()).map_err(errno)?;
        }
        Ok(())
    }
}

impl OwnMounts {
    /// Runs in the child (see [`ChildSetup::own_mounts`]): raw syscalls on prepared values.
    fn enter(&self) -> Result<(), Errno> {
        use rustix::mount::{
            MountPropagationFlags, MoveMountFlags, UnmountFlags, mount_change, move_mount, unmount,
        };
        // SAFETY: opened before the spawn and still open in this child.
        let dir = unsafe { BorrowedFd::borrow_raw(self.dir) };
        // The unshare moves the working directory into the new namespace (a descriptor keeps
        // naming the old one's mount, which `move_mount` refuses as a target): the names
        // below are looked up from there, one component each, in a directory only root can
        // write.
        rustix::process::fchdir(dir)?;
        // SAFETY: only the mount namespace is unshared, in a child that runs a single thread
        // and holds no state about mounts.
        unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNS) }?;
        // Were any mount shared with the host (a caller outside its own namespace), the
        // attach and the shedding below would otherwise reach it.
        mount_change(
            c"/",
            MountPropagationFlags::DOWNSTREAM | MountPropagationFlags::REC,
        )?;
        for &(fd, name) in &self.attach {
            // SAFETY: opened before the spawn and still open in this child.
            let fd = unsafe { BorrowedFd::borrow_raw(fd) };
            move_mount(
                fd,
                c"",
                rustix::fs::CWD,
                name,
                MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
            )?;
        }
        for &path in &self.shed {
            // Best effort: a path that is no mount point here (EINVAL) or does not exist
            // costs nothing but the lines it would have saved.
            let _ = unmount(path, UnmountFlags::DETACH | UnmountFlags::NOFOLLOW);
        }
        rustix::process::chdir(c"/")
    }
}

/// Where captured output goes.
pub trait Sink: Send {
    /// Takes the next chunk (already cut to the capture's cap). A sink that cannot write
    /// drops the chunk: the child must never block on a full pipe.
    fn write(&mut self, chunk: &[u8]) -> impl Future<Output = ()> + Send;
    /// The pipe closed.
    fn finish(&mut self) -> impl Future<Output = ()> + Send;
}

impl Sink for tokio::fs::File {
    async fn write(&mut self, chunk: &[u8]) {
        if let Err(e) = self.write_all(chunk).await {
            tracing::warn!(error = %e, "cannot write captured output");
        }
    }

    async fn finish(&mut self) {
        let _ = self.flush().await;
    }
}

/// Output kept in memory (bound it with the capture's cap).
impl Sink for &mut Vec<u8> {
    async fn write(&mut self, chunk: &[u8]) {
        self.extend_from_slice(chunk);
    }

    async fn finish(&mut self) {}
}

/// What a capture saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Captured {
    /// Bytes given to the sink.
    pub kept: u64,
    /// Whether output beyond the cap was read and dropped.
    pub truncated: bool,
}

/// Copies `pipe` into `sink` until the pipe closes (or fails): at most `cap` bytes when a cap
/// is given; the rest is read and dropped, so the child never blocks on a full pipe.
pub async fn capture<R: AsyncRead + Unpin + Send, S: Sink>(
    mut pipe: R,
    mut sink: S,
    cap: Option<u64>,
) -> Captured {
    let mut buf = vec![0_u8; 64 * 1024];
    let mut seen = Captured::default();
    loop {
        let n = match pipe.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        let room = cap.map_or(usize::MAX, |c| {
            usize::try_from(c.saturating_sub(seen.kept)).unwrap_or(usize::MAX)
        });
        let keep = n.min(room);
        if keep < n {
            seen.truncated = true;
        }
        if let Some(chunk) = buf.get(..keep).filter(|c| !c.is_empty()) {
            sink.write(chunk).await;
            seen.kept += keep as u64;
        }
    }
    sink.finish().await;
    seen
}

/// Sends `signal` to the process group `pgid`; a group that is gone is not an error.
pub fn signal_group(pgid: u32, signal: Signal) -> Result<(), Errno> {
    let Some(pid) = i32::try_from(pgid).ok().and_then(Pid::from_raw) else {
        return Ok(());
    };
    match rustix::process::kill_process_group(pid, signal) {
        Ok(()) | Err(Errno::SRCH) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Ends a child that leads its own process group ([`ChildSetup::new_session`]): SIGTERM to the
/// group, up to `grace` for the leader to exit, then SIGKILL to the group; the leader is
/// reaped either way. Members that left the group (a second `setsid`) are the caller's (its
/// cgroup's) business.
pub async fn terminate_group(
    child: &mut tokio::process::Child,
    grace: Duration,
) -> io::Result<ExitStatus> {
    // `id()` is `None` only once the child has been reaped, and then there is nothing to do.
    let Some(pgid) = child.id() else {
        return child.wait().await;
    };
    signal_group(pgid, Signal::TERM).map_err(errno)?;
    if let Ok(status) = tokio::time::timeout(grace, child.wait()).await {
        return status;
    }
    tracing::warn!(pgid, "process group ignored SIGTERM; killing it");
    signal_group(pgid, Signal::KILL).map_err(errno)?;
    child.wait().await
}

/// What `/proc/<pid>/stat` says of a process that the supervision code needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStat {
    pub ppid: u32,
    pub zombie: bool,
    /// Start time in clock ticks since boot: with the pid, it names one process (pids recur).
    pub start: u64,
}

impl ProcStat {
    /// Parses `pid (comm) state ppid ... starttime ...`; comm may hold spaces and parentheses.
    fn parse(stat: &str) -> Option<ProcStat> {
        let (_, rest) = stat.rsplit_once(") ")?;
        let mut fields = rest.split(' ');
        let state = fields.next()?;
        let ppid = fields.next()?.parse().ok()?;
        // starttime is field 22; the state was field 3 and ppid 4.
        let start = fields.nth(17)?.parse().ok()?;
        Some(ProcStat {
            ppid,
            zombie: state == "Z",
            start,
        })
    }
}

/// The stat of process `pid`, if it exists.
pub(crate) fn stat_of(pid: u32) -> Option<ProcStat> {
    ProcStat::parse(&std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Every process `/proc` lists now, with its stat.
pub(crate) fn table() -> Vec<(u32, ProcStat)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| {
            let pid = e.file_name().to_str()?.parse::<u32>().ok()?;
            Some((pid, stat_of(pid)?))
        })
        .collect()
}

/// The live descendants of `pid` in `table`.
pub(crate) fn descendants_in(table: &[(u32, ProcStat)], pid: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut frontier = vec![pid];
    while let Some(p) = frontier.pop() {
        for &(child, _) in table
            .iter()
            .filter(|(c, s)| s.ppid == p && *c != pid && !s.zombie)
        {
            if !found.contains(&child) {
                found.push(child);
                frontier.push(child);
            }
        }
    }
    found
}

/// Every live descendant of `pid` (its children, theirs, ...), read from `/proc`: what a
/// process group misses when a descendant moved to a group or session of its own (an agent's
/// tool runner does). Collect it while `pid` still runs: once it dies its children are
/// reparented and no longer found (unless this process adopts them: [`crate::reaper`]).
#[must_use]
pub fn descendants(pid: u32) -> Vec<u32> {
    descendants_in(&table(), pid)
}

/// Sends `signal` to each of `pids`; one that is gone is skipped.
pub fn signal_each(pids: &[u32], signal: Signal) {
    for &p in pids {
        if let Some(pid) = i32::try_from(p).ok().and_then(Pid::from_raw)
            && let Err(e) = rustix::process::kill_process(pid, signal)
            && e != Errno::SRCH
        {
            tracing::warn!(pid = p, error = %e, "cannot signal");
        }
    }
}

/// The status a caller sees: the exit code, or `128 + signal` when killed.
pub fn exit_code(status: ExitStatus) -> Option<i32> {
    use std::os::unix::process::ExitStatusExt;
    status.code().or_else(|| status.signal().map(|s| 128 + s))
}

/// Moves this process into a mount namespace of its own whose `/` is a recursive slave: mounts
/// the host makes later still appear here, ours never propagate back. Call while the process
/// has a single thread.
pub fn isolate_mounts() -> rustix::io::Result<()> {
    use rustix::mount::{MountPropagationFlags, mount_change};
    use rustix::thread::{UnshareFlags, unshare_unsafe};
    // SAFETY: only the mount namespace is unshared, and (by the contract above) while the
    // process has a single thread; nothing in this process holds state about mounts that the
    // change would invalidate.
    unsafe { unshare_unsafe(UnshareFlags::NEWNS) }?;
    mount_change(
        "/",
        MountPropagationFlags::DOWNSTREAM | MountPropagationFlags::REC,
    )
}

/// Makes sure descriptors 0-2 are open (on `/dev/null` if not), so no descriptor opened later
/// lands on a standard stream number.
pub fn ensure_stdio() {
    for fd in 0..3 {
        // SAFETY: only inspects the flags of a descriptor number.
        let open = unsafe { libc::fcntl(fd, libc::F_GETFD) } != -1;
        if !open
            && let Ok(null) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/null")
        {
            // The lowest free number is `fd`, so this fills the hole; keep it open for good.
            std::mem::forget(null);
        }
    }
}

/// How a daemon asks glibc's malloc to keep less memory it no longer uses (see
/// [`tune_malloc`]). `None` leaves a setting at glibc's default.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MallocTuning {
    /// `M_ARENA_MAX`: at most this many heaps. glibc gives threads their own arena (up to eight
    /// per core), each of which keeps its own free memory.
    pub arena_max: Option<u32>,
    /// `M_MMAP_THRESHOLD`, bytes: blocks this large or larger are mapped on their own and
    /// unmapped when freed. Setting it also turns off glibc's dynamic threshold, which after
    /// the first large block is freed raises the threshold (up to 32 MiB) so that every later
    /// large block comes from the heap, where it stays as fragmentation once freed.
    pub mmap_threshold: Option<u32>,
}

impl MallocTuning {
    /// What the gateway and the bridge use: request bodies (~100 KB), their serialized
    /// translations and hyper's read buffers are mapped on their own and given back to the
    /// kernel when a request is done, instead of staying in the heaps as free memory
    /// (BENCHMARKS.md, "Peak memory at c=64"). The arena count is left alone: with the
    /// threshold fixed, one arena measured no lower than glibc's default.
    pub const PROXY: MallocTuning = MallocTuning {
        arena_max: None,
        mmap_threshold: Some(64 << 10),
    };
}

/// Which [`MallocTuning`] settings took effect.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MallocTuned {
    /// `M_ARENA_MAX` was set.
    pub arena_max: bool,
    /// `M_MMAP_THRESHOLD` was set.
    pub mmap_threshold: bool,
}

/// Applies `tuning` to glibc's malloc with `mallopt(3)`. A setting whose glibc variable is in
/// the environment (`MALLOC_ARENA_MAX`, `MALLOC_MMAP_THRESHOLD_`) is left alone: the
/// operator's choice wins. Call it first in `main`, before threads start, so every arena is
/// created under it. Elsewhere than glibc (musl has no `mallopt` settings) nothing is done.
pub fn tune_malloc(tuning: MallocTuning) -> MallocTuned {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let set = |param: libc::c_int, env: &str, value: Option<u32>| {
            let Some(v) = value.and_then(|v| libc::c_int::try_from(v).ok()) else {
                return false;
            };
            if std::env::var_os(env).is_some() {
                return false;
            }
            // SAFETY: `mallopt` takes two integers and changes allocator parameters under the
            // allocator's own lock; it is safe to call at any time, from any thread.
            unsafe { libc::mallopt(param, v) == 1 }
        };
        MallocTuned {
            arena_max: set(libc::M_ARENA_MAX, "MALLOC_ARENA_MAX", tuning.arena_max),
            mmap_threshold: set(
                libc::M_MMAP_THRESHOLD,
                "MALLOC_MMAP_THRESHOLD_",
                tuning.mmap_threshold,
            ),
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = tuning;
        MallocTuned::default()
    }
}

#[cfg(test)]
mod tests {
    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn malloc_tuning_takes_effect_and_refuses_values_past_c_int() {
        use super::{MallocTuned, MallocTuning, tune_malloc};
        assert_eq!(
            tune_malloc(MallocTuning::PROXY),
            MallocTuned {
                arena_max: false,
                mmap_threshold: true
            }
        );
        let both = MallocTuning {
            arena_max: Some(8),
            mmap_threshold: Some(128 << 10),
        };
        assert_eq!(
            tune_malloc(both),
            MallocTuned {
                arena_max: true,
                mmap_threshold: true
            }
        );
        // mallopt takes a C int: a value past it is not applied (nor wrapped to a negative).
        let too_big = MallocTuning {
            arena_max: Some(u32::MAX),
            mmap_threshold: Some(u32::MAX),
        };
        assert_eq!(tune_malloc(too_big), MallocTuned::default());
    }

    use super::*;
    use std::process::Stdio;

    /// A sink that keeps everything in memory.
    #[derive(Default)]
    struct Memory(Vec<u8>, bool);

    impl Sink for &mut Memory {
        async fn write(&mut self, chunk: &[u8]) {
            self.0.extend_from_slice(chunk);
        }
        async fn finish(&mut self) {
            self.1 = true;
        }
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// `/bin/sh -c script` with its stdout piped.
    fn sh(script: &str) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new("/bin/sh");
        cmd.args(["-c", script]).stdout(Stdio::piped());
        cmd
    }

    #[test]
    fn capture_caps_and_reports_truncation() {
        let rt = rt();
        let mut mem = Memory::default();
        let seen = rt.block_on(capture(&b"0123456789"[..], &mut mem, Some(4)));
        assert_eq!(
            seen,
            Captured {
                kept: 4,
                truncated: true
            }
        );
        assert_eq!((mem.0.as_slice(), mem.1), (&b"0123"[..], true));

        let mut mem = Memory::default();
        let seen = rt.block_on(capture(&b"0123"[..], &mut mem, Some(4)));
        assert!(!seen.truncated);
        assert_eq!(mem.0, b"0123");

        let mut mem = Memory::default();
        let big = vec![b'x'; 300_000];
        let seen = rt.block_on(capture(big.as_slice(), &mut mem, None));
        assert_eq!((seen.kept, seen.truncated), (300_000, false));
    }

    /// A child writing far more than a pipe holds is read to its end (it exits), not blocked.
    #[test]
    fn capture_drains_a_real_child() {
        let rt = rt();
        rt.block_on(async {
            let cmd = sh("head -c 1000000 /dev/zero");
            let mut child = ChildSetup::new(0, 0).spawn(cmd).unwrap();
            let pipe = child.stdout.take().unwrap();
            let mut mem = Memory::default();
            let seen = capture(pipe, &mut mem, Some(10)).await;
            assert_eq!((seen.kept, seen.truncated), (10, true));
            assert!(child.wait().await.unwrap().success());
        });
    }

    fn alive(pid: i32) -> bool {
        // A zombie is dead for our purposes: it runs nothing.
        match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
            Ok(stat) => stat
                .rsplit_once(") ")
                .is_some_and(|(_, rest)| !rest.starts_with('Z')),
            Err(_) => false,
        }
    }

    /// SIGTERM ignored by every member: the group is killed after the grace, nothing is left.
    #[test]
    fn group_kill_leaves_no_process() {
        let rt = rt();
        rt.block_on(async {
            let cmd = sh("trap '' TERM; (trap '' TERM; sleep 600) & echo $!; wait");
            let mut child = ChildSetup::new(0, 0).new_session().spawn(cmd).unwrap();
            let mut out = child.stdout.take().unwrap();
            let mut line = Vec::new();
            let mut byte = [0_u8; 1];
            while out.read(&mut byte).await.unwrap() == 1 && byte[0] != b'\n' {
                line.push(byte[0]);
            }
            let grandchild: i32 = String::from_utf8(line).unwrap().trim().parse().unwrap();
            let leader = i32::try_from(child.id().unwrap()).unwrap();
            assert!(alive(grandchild) && alive(leader));
            let started = std::time::Instant::now();
            let status = terminate_group(&mut child, Duration::from_millis(300))
                .await
                .unwrap();
            assert!(started.elapsed() >= Duration::from_millis(300));
            assert_eq!(exit_code(status), Some(128 + libc::SIGKILL));
            // The grandchild is reparented and reaped by init/the subreaper: give it a moment.
            let deadline = std::time::Instant::now() + Duration::from_secs(5);
            while alive(grandchild) && std::time::Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert!(!alive(grandchild), "the group member survived");
        });
    }

    /// A child that exits on SIGTERM is reaped without waiting for the grace.
    #[test]
    fn group_term_is_enough_for_a_polite_child() {
        let rt = rt();
        rt.block_on(async {
            let mut cmd = tokio::process::Command::new("/bin/sleep");
            cmd.arg("600");
            let mut child = ChildSetup::new(0, 0).new_session().spawn(cmd).unwrap();
            let started = std::time::Instant::now();
            let status = terminate_group(&mut child, Duration::from_secs(30))
                .await
                .unwrap();
            assert!(started.elapsed() < Duration::from_secs(10));
            assert_eq!(exit_code(status), Some(128 + libc::SIGTERM));
        });
    }

    /// The errno `spawn` reports for a setup that must fail.
    fn setup_errno(setup: ChildSetup) -> Option<i32> {
        match setup.spawn(tokio::process::Command::new("/bin/true")) {
            Err(SpawnError::Spawn { source, .. }) => source.raw_os_error(),
            Err(e) => panic!("{e:?}"),
            Ok(_) => panic!("the setup did not fail"),
        }
    }

    /// A failing step of the child setup comes back from `spawn` as its errno.
    #[test]
    fn child_setup_errors_are_reported() {
        let rt = rt();
        rt.block_on(async {
            // A join file that is not writable: opened read-only, the write fails with EBADF.
            let tmp = tempfile::tempdir().unwrap();
            let procs = tmp.path().join("cgroup.procs");
            std::fs::write(&procs, "").unwrap();
            let mut setup = ChildSetup::new(0, 0);
            setup.join.push(
                rustix::fs::open(&procs, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).unwrap(),
            );
            assert_eq!(setup_errno(setup), Some(libc::EBADF));

            // A kept descriptor that is not open: EBADF from fcntl.
            assert_eq!(
                setup_errno(ChildSetup::new(0, 0).keep(&[987_654])),
                Some(libc::EBADF)
            );

            // A missing join file is reported before any fork, naming the file.
            let err = ChildSetup::new(0, 0)
                .join_cgroup(&[tmp.path().join("missing")])
                .unwrap_err();
            assert!(matches!(err, SpawnError::JoinFile { .. }), "{err}");
        });
    }

    /// The identity change and the kept descriptors reach the program.
    #[test]
    fn identity_and_kept_descriptors() {
        let rt = rt();
        rt.block_on(async {
            let (keep_r, _keep_w) = rustix::pipe::pipe().unwrap();
            let (drop_r, _drop_w) = rustix::pipe::pipe().unwrap();
            let script = format!(
                "id -u; id -g; id -G; test -e /proc/self/fd/{k} && echo kept; test -e /proc/self/fd/{d} || echo closed",
                k = keep_r.as_raw_fd(),
                d = drop_r.as_raw_fd()
            );
            let cmd = sh(&script);
            let child = ChildSetup::new(64123, 64124)
                .groups(&[64125])
                .keep(&[keep_r.as_raw_fd()])
                .rlimit(Resource::Core, 0)
                .spawn(cmd)
                .unwrap();
            let out = child.wait_with_output().await.unwrap();
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                "64123\n64124\n64124 64125\nkept\nclosed\n"
            );
        });
    }

    /// `same_identity` changes nothing of who the child is: it keeps the caller's uid, gid and
    /// supplementary groups (`new` would have replaced the groups), so no step needs
    /// CAP_SETGID and an unprivileged daemon can use it.
    #[test]
    fn same_identity_keeps_uid_and_groups() {
        let rt = rt();
        rt.block_on(async {
            let cmd = sh("id -u; id -g; cat /proc/self/status | grep ^Groups:");
            let child = ChildSetup::same_identity()
                .new_session()
                .spawn(cmd)
                .unwrap();
            let out = child.wait_with_output().await.unwrap();
            let ours = std::fs::read_to_string("/proc/self/status").unwrap();
            let groups = ours.lines().find(|l| l.starts_with("Groups:")).unwrap();
            let expected = format!(
                "{}\n{}\n{groups}\n",
                rustix::process::getuid().as_raw(),
                rustix::process::getgid().as_raw()
            );
            assert_eq!(String::from_utf8_lossy(&out.stdout), expected);
        });
    }

    /// A descendant that left the group (its own session) is still found, and killed.
    #[test]
    fn descendants_include_those_that_left_the_group() {
        let rt = rt();
        rt.block_on(async {
            let cmd = sh("setsid sleep 600 & echo $!; wait");
            let mut child = ChildSetup::same_identity()
                .new_session()
                .spawn(cmd)
                .unwrap();
            let mut out = child.stdout.take().unwrap();
            let mut buf = [0_u8; 32];
            let n = tokio::io::AsyncReadExt::read(&mut out, &mut buf)
                .await
                .unwrap();
            let escaped: i32 = String::from_utf8_lossy(&buf[..n]).trim().parse().unwrap();
            let escaped = u32::try_from(escaped).unwrap();
            let mut tree = Vec::new();
            for _ in 0..100 {
                tree = descendants(child.id().unwrap());
                if tree.contains(&escaped) {
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            assert!(tree.contains(&escaped), "{escaped} not in {tree:?}");
            assert!(!tree.is_empty(), "no descendants found");
            terminate_group(&mut child, Duration::from_secs(2))
                .await
                .unwrap();
            signal_each(&tree, Signal::KILL);
            std::thread::sleep(Duration::from_millis(100));
            for p in tree {
                assert!(!alive(i32::try_from(p).unwrap()), "descendant {p} survived");
            }
        });
    }
}
