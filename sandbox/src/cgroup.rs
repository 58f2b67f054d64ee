//! Per-sandbox cgroups: memory, pids and CPU limits, killing every process of a task, and
//! reading whether the OOM killer struck.
//!
//! Both hierarchies are supported and chosen at startup from the filesystem type of the cgroup
//! mount: cgroup v2 (`<mount>/<parent>/<name>`, `cgroup.kill`, `memory.events`) and cgroup v1
//! (one directory per controller, `<mount>/{memory,pids,cpu,freezer}/<parent>/<name>`, kill by
//! freezing, signalling every member and thawing, `memory.oom_control`). `<parent>` is
//! `agentbox` by default; every directory below it belongs to this launcher, which is what lets
//! a restarted launcher kill orphans by listing it.
//!
//! Everything here is plain file I/O under configurable paths plus one [`Signaller`], so the
//! logic is unit-tested on a fake tree; the integration tests exercise the real hierarchy.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Filesystem magic numbers (`statfs.f_type`).
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;

/// How many freeze/kill rounds before giving up on emptying a cgroup.
const KILL_ROUNDS: usize = 500;
const KILL_PAUSE: Duration = Duration::from_millis(10);
/// Pause while only exiting processes are left; many of them make the give-up bound.
const EXIT_PAUSE: Duration = Duration::from_millis(1);
const EXIT_ROUNDS: usize = 5000;

/// CFS period used for the CPU quota, microseconds.
const CPU_PERIOD_US: u64 = 100_000;

/// Which hierarchy is in use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

impl fmt::Display for CgroupVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CgroupVersion::V1 => "v1",
            CgroupVersion::V2 => "v2",
        })
    }
}

/// A cgroup operation that failed.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cgroups unavailable: {0}")]
    Unavailable(String),
    #[error("{path}: {op}: {source}")]
    Io {
        path: PathBuf,
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}: processes still present after {KILL_ROUNDS} kill rounds and {EXIT_ROUNDS} waits")]
    Unkillable(PathBuf),
}

fn io_err(path: &Path, op: &'static str) -> impl FnOnce(std::io::Error) -> CgroupError {
    let path = path.to_path_buf();
    move |source| CgroupError::Io { path, op, source }
}

/// Sends SIGKILL to a process; a trait so the kill loop can be tested on a fake tree.
pub trait Signaller: Send + Sync + fmt::Debug {
    /// Kills `pid`; a process that is already gone is not an error.
    fn kill(&self, pid: i32) -> std::io::Result<()>;

    /// Whether `pid` is already on its way out, every thread of it (past the point where it
    /// could run user code or fork again).
    fn is_exiting(&self, _pid: i32) -> bool {
        false
    }
}

/// `PF_EXITING` in the flags of `/proc/<pid>/stat` (field 9).
const PF_EXITING: u64 = 0x4;

/// The real `kill(2)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct RealSignaller;

impl Signaller for RealSignaller {
    /// Every thread of `pid` must be exiting: a process whose main thread has exited can
    /// go on running in its other threads.
    fn is_exiting(&self, pid: i32) -> bool {
        let Ok(threads) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
            // Gone already.
            return true;
        };
        threads.flatten().all(|t| {
            let Ok(stat) = std::fs::read_to_string(t.path().join("stat")) else {
                return true;
            };
            // The command name may hold spaces and parentheses; the fields after it are fixed.
            stat.rsplit_once(") ")
                .and_then(|(_, rest)| rest.split_whitespace().nth(6))
                .and_then(|f| f.parse::<u64>().ok())
                .is_some_and(|flags| flags & PF_EXITING != 0)
        })
    }

    fn kill(&self, pid: i32) -> std::io::Result<()> {
        let Some(pid) = rustix::process::Pid::from_raw(pid) else {
            return Ok(());
        };
        match rustix::process::kill_process(pid, rustix::process::Signal::KILL) {
            Ok(()) | Err(rustix::io::Errno::SRCH) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
}

/// Where the per-task directories live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hierarchy {
    V1(V1Dirs),
    V2 {
        /// The mount point (for enabling controllers) and our parent directory below it.
        mount: PathBuf,
        parent: PathBuf,
    },
}

/// One directory per v1 controller, at one level: our parents, or one task's cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct V1Dirs {
    pub memory: PathBuf,
    pub pids: PathBuf,
    pub cpu: PathBuf,
    /// The freezer makes killing race-free against forking; optional.
    pub freezer: Option<PathBuf>,
}

impl V1Dirs {
    /// Every directory, the freezer's if there is one.
    pub fn all(&self) -> Vec<PathBuf> {
        let mut v = vec![self.memory.clone(), self.pids.clone(), self.cpu.clone()];
        v.extend(self.freezer.clone());
        v
    }

    /// The child `name` in each.
    fn join(&self, name: &str) -> V1Dirs {
        V1Dirs {
            memory: self.memory.join(name),
            pids: self.pids.join(name),
            cpu: self.cpu.join(name),
            freezer: self.freezer.as_ref().map(|f| f.join(name)),
        }
    }
}

/// The limits written into a task's cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CgroupLimits {
    pub memory_bytes: u64,
    pub pids: u64,
    pub cpus: u32,
}

/// The cgroups of this launcher.
#[derive(Debug, Clone)]
pub struct Cgroups {
    hierarchy: Hierarchy,
    signaller: Arc<dyn Signaller>,
}

fn fs_magic(path: &Path) -> Option<i64> {
    rustix::fs::statfs(path).ok().map(|s| {
        #[allow(clippy::useless_conversion, clippy::unnecessary_cast)]
        let t = s.f_type as i64;
        t
    })
}

fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    std::fs::write(path, value).map_err(io_err(path, "write"))
}

fn read_file(path: &Path) -> Result<String, CgroupError> {
    std::fs::read_to_string(path).map_err(io_err(path, "read"))
}

/// The value of `key` in a flat-keyed file such as `memory.events` or `memory.oom_control`.
fn keyed_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let mut parts = line.split_whitespace();
        (parts.next() == Some(key))
            .then(|| parts.next().and_then(|v| v.parse().ok()))
            .flatten()
    })
}

impl Cgroups {
    /// Detects the hierarchy mounted at `mount` (normally `/sys/fs/cgroup`): v2 when it is a
    /// cgroup2 filesystem, else v1 controllers in its subdirectories. `parent` is our
    /// directory name below each hierarchy.
    pub fn detect(
        mount: &Path,
        parent: &str,
        signaller: Arc<dyn Signaller>,
    ) -> Result<Cgroups, CgroupError> {
        agentbox_policy::path::validate_component(parent)
            .map_err(|e| CgroupError::Unavailable(format!("cgroup parent name: {e}")))?;
        match fs_magic(mount) {
            Some(CGROUP2_SUPER_MAGIC) => Ok(Cgroups {
                hierarchy: Hierarchy::V2 {
                    mount: mount.to_path_buf(),
                    parent: mount.join(parent),
                },
                signaller,
            }),
            Some(_) => {
                let controller = |name: &str| -> Option<PathBuf> {
                    let dir = mount.join(name);
                    (fs_magic(&dir) == Some(CGROUP_SUPER_MAGIC)).then(|| dir.join(parent))
                };
                let missing = |name: &str| {
                    CgroupError::Unavailable(format!(
                        "{} is not a cgroup v1 {name} hierarchy and {} is not cgroup2",
                        mount.join(name).display(),
                        mount.display()
                    ))
                };
                Ok(Cgroups {
                    hierarchy: Hierarchy::V1(V1Dirs {
                        memory: controller("memory").ok_or_else(|| missing("memory"))?,
                        pids: controller("pids").ok_or_else(|| missing("pids"))?,
                        cpu: controller("cpu").ok_or_else(|| missing("cpu"))?,
                        freezer: controller("freezer"),
                    }),
                    signaller,
                })
            }
            None => Err(CgroupError::Unavailable(format!(
                "{} cannot be read",
                mount.display()
            ))),
        }
    }

    /// A fixed hierarchy (tests).
    pub fn with_hierarchy(hierarchy: Hierarchy, signaller: Arc<dyn Signaller>) -> Cgroups {
        Cgroups {
            hierarchy,
            signaller,
        }
    }

    pub fn version(&self) -> CgroupVersion {
        match self.hierarchy {
            Hierarchy::V1(_) => CgroupVersion::V1,
            Hierarchy::V2 { .. } => CgroupVersion::V2,
        }
    }

    pub fn hierarchy(&self) -> &Hierarchy {
        &self.hierarchy
    }

    fn parents(&self) -> Vec<PathBuf> {
        match &self.hierarchy {
            Hierarchy::V1(dirs) => dirs.all(),
            Hierarchy::V2 { parent, .. } => vec![parent.clone()],
        }
    }

    /// Creates our parent directories and, on v2, enables the controllers for children.
    pub fn prepare(&self) -> Result<(), CgroupError> {
        for dir in self.parents() {
            std::fs::create_dir_all(&dir).map_err(io_err(&dir, "mkdir"))?;
        }
        if let Hierarchy::V2 { mount, parent } = &self.hierarchy {
            for dir in [mount, parent] {
                let path = dir.join("cgroup.subtree_control");
                write_file(&path, "+memory +pids +cpu")?;
            }
        }
        Ok(())
    }

    /// The controllers usable by tasks, for `GET /status`.
    pub fn controllers(&self) -> Vec<String> {
        match &self.hierarchy {
            Hierarchy::V1(dirs) => {
                let mut v = vec!["memory".to_owned(), "pids".to_owned(), "cpu".to_owned()];
                if dirs.freezer.is_some() {
                    v.push("freezer".to_owned());
                }
                v
            }
            Hierarchy::V2 { parent, .. } => read_file(&parent.join("cgroup.subtree_control"))
                .map(|t| t.split_whitespace().map(str::to_owned).collect())
                .unwrap_or_default(),
        }
    }

    /// The `cgroup.procs` file task `name`'s cgroup has (or will have) when created here.
    pub fn procs_file_of(&self, name: &str) -> PathBuf {
        self.task_dirs(name).members().join("cgroup.procs")
    }

    fn task_dirs(&self, name: &str) -> TaskDirs {
        match &self.hierarchy {
            Hierarchy::V1(dirs) => TaskDirs::V1(dirs.join(name)),
            Hierarchy::V2 { parent, .. } => TaskDirs::V2 {
                dir: parent.join(name),
            },
        }
    }

    /// Creates the cgroup of task `name` with `limits`. A leftover of the same name (a
    /// previous run that could not be removed) is emptied and removed first.
    pub async fn create(
        &self,
        name: &str,
        limits: CgroupLimits,
    ) -> Result<TaskCgroup, CgroupError> {
        let task = self.fresh(name).await?;
        task.write_limits(limits)?;
        Ok(task)
    }

    /// Creates the cgroup `name` without limits: a vLLM backend sizes itself, and its cgroup
    /// only makes "every process it started" exact for stopping it (workers included) and for
    /// finding it after a restart.
    pub async fn create_unlimited(&self, name: &str) -> Result<TaskCgroup, CgroupError> {
        self.fresh(name).await
    }

    async fn fresh(&self, name: &str) -> Result<TaskCgroup, CgroupError> {
        agentbox_policy::path::validate_component(name)
            .map_err(|e| CgroupError::Unavailable(format!("cgroup name: {e}")))?;
        let task = TaskCgroup {
            dirs: self.task_dirs(name),
            signaller: Arc::clone(&self.signaller),
        };
        if task.exists() {
            task.kill_all().await?;
            task.remove()?;
        }
        for dir in task.dirs.all() {
            std::fs::create_dir(&dir).map_err(io_err(&dir, "mkdir"))?;
        }
        Ok(task)
    }

    /// The task cgroup `name`, if its directory exists.
    pub fn open(&self, name: &str) -> Option<TaskCgroup> {
        agentbox_policy::path::validate_component(name).ok()?;
        let task = TaskCgroup {
            dirs: self.task_dirs(name),
            signaller: Arc::clone(&self.signaller),
        };
        task.exists().then_some(task)
    }

    /// The names of every task cgroup below our parent (in any controller).
    pub fn list(&self) -> Vec<String> {
        let mut names = std::collections::BTreeSet::new();
        for dir in self.parents() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir())
                    && let Some(n) = e.file_name().to_str()
                {
                    names.insert(n.to_owned());
                }
            }
        }
        names.into_iter().collect()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum TaskDirs {
    V1(V1Dirs),
    V2 { dir: PathBuf },
}

impl TaskDirs {
    fn all(&self) -> Vec<PathBuf> {
        match self {
            TaskDirs::V1(dirs) => dirs.all(),
            TaskDirs::V2 { dir } => vec![dir.clone()],
        }
    }

    /// The directory whose `cgroup.procs` lists every member.
    fn members(&self) -> &Path {
        match self {
            TaskDirs::V1(dirs) => &dirs.memory,
            TaskDirs::V2 { dir } => dir,
        }
    }
}

/// One task's cgroup.
#[derive(Debug, Clone)]
pub struct TaskCgroup {
    dirs: TaskDirs,
    signaller: Arc<dyn Signaller>,
}

impl TaskCgroup {
    fn exists(&self) -> bool {
        self.dirs.all().iter().any(|d| d.is_dir())
    }

    fn write_limits(&self, l: CgroupLimits) -> Result<(), CgroupError> {
        let quota = u64::from(l.cpus) * CPU_PERIOD_US;
        match &self.dirs {
            TaskDirs::V1(V1Dirs {
                memory, pids, cpu, ..
            }) => {
                write_file(
                    &memory.join("memory.limit_in_bytes"),
                    &l.memory_bytes.to_string(),
                )?;
                // Without swap accounting the file is absent; with it, swap is refused too.
                let memsw = memory.join("memory.memsw.limit_in_bytes");
                if memsw.exists() {
                    write_file(&memsw, &l.memory_bytes.to_string())?;
                }
                write_file(&pids.join("pids.max"), &l.pids.to_string())?;
                write_file(&cpu.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
                write_file(&cpu.join("cpu.cfs_quota_us"), &quota.to_string())?;
            }
            TaskDirs::V2 { dir } => {
                write_file(&dir.join("memory.max"), &l.memory_bytes.to_string())?;
                let swap = dir.join("memory.swap.max");
                if swap.exists() {
                    write_file(&swap, "0")?;
                }
                // One OOM kill takes the whole sandbox down, as one unit.
                let group = dir.join("memory.oom.group");
                if group.exists() {
                    write_file(&group, "1")?;
                }
                write_file(&dir.join("pids.max"), &l.pids.to_string())?;
                write_file(&dir.join("cpu.max"), &format!("{quota} {CPU_PERIOD_US}"))?;
            }
        }
        Ok(())
    }

    /// The files a new, still single-threaded process writes `0` into to join (one per v1
    /// controller).
    ///
    /// On v1 these are the `tasks` files: moving only the calling thread is the one migration
    /// the kernel performs without write-locking its global threadgroup lock, whose write side
    /// waits for an RCU grace period (about 10 ms on the test machine, on every sandbox start;
    /// see `BENCHMARKS.md`). A freshly forked child has a single thread, so moving that thread
    /// moves the whole process, and everything it starts is born inside. v2 has no per-thread
    /// membership for domain cgroups, so there it is `cgroup.procs`.
    pub fn join_files(&self) -> Vec<PathBuf> {
        let file = match self.dirs {
            TaskDirs::V1(_) => "tasks",
            TaskDirs::V2 { .. } => "cgroup.procs",
        };
        self.dirs.all().into_iter().map(|d| d.join(file)).collect()
    }

    /// The `cgroup.procs` file listing every process in the cgroup.
    pub fn procs_file(&self) -> PathBuf {
        self.dirs.members().join("cgroup.procs")
    }

    /// The pids currently in the cgroup.
    pub fn pids(&self) -> Result<Vec<i32>, CgroupError> {
        let path = self.dirs.members().join("cgroup.procs");
        match std::fs::read_to_string(&path) {
            Ok(text) => Ok(text.lines().filter_map(|l| l.trim().parse().ok()).collect()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(source) => Err(CgroupError::Io {
                path,
                op: "read",
                source,
            }),
        }
    }

    /// How many times the OOM killer killed a process of this cgroup.
    pub fn oom_kills(&self) -> u64 {
        let (path, key) = match &self.dirs {
            TaskDirs::V1(dirs) => (dirs.memory.join("memory.oom_control"), "oom_kill"),
            TaskDirs::V2 { dir } => (dir.join("memory.events"), "oom_kill"),
        };
        read_file(&path)
            .ok()
            .and_then(|t| keyed_value(&t, key))
            .unwrap_or(0)
    }

    /// Kills every process in the cgroup and waits until it is empty. Forks racing the kill
    /// are caught by freezing first (v1 freezer) or by the kernel (`cgroup.kill`, v2).
    pub async fn kill_all(&self) -> Result<(), CgroupError> {
        if let TaskDirs::V2 { dir } = &self.dirs {
            let kill = dir.join("cgroup.kill");
            if kill.exists() && !self.pids()?.is_empty() {
                write_file(&kill, "1")?;
            }
        }
        let (mut kill_rounds, mut exit_rounds) = (0, 0);
        while kill_rounds < KILL_ROUNDS && exit_rounds < EXIT_ROUNDS {
            let pids = self.pids()?;
            if pids.is_empty() {
                return Ok(());
            }
            // A sandbox's init outlives bwrap for a moment while the kernel tears its
            // namespaces down: nothing is left to stop, and freezing (which flips a kernel-wide
            // static key on v1) would only slow it.
            if pids.iter().all(|&p| self.signaller.is_exiting(p)) {
                exit_rounds += 1;
                tokio::time::sleep(EXIT_PAUSE).await;
                continue;
            }
            kill_rounds += 1;
            let freezer = match &self.dirs {
                TaskDirs::V1(dirs) => dirs.freezer.as_ref().filter(|f| f.is_dir()),
                TaskDirs::V2 { .. } => None,
            };
            if let Some(f) = freezer {
                write_file(&f.join("freezer.state"), "FROZEN")?;
                for _ in 0..100 {
                    if read_file(&f.join("freezer.state"))?.trim() == "FROZEN" {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                }
            }
            for pid in self.pids()? {
                if let Err(e) = self.signaller.kill(pid) {
                    tracing::warn!(pid, error = %e, "kill failed");
                }
            }
            if let Some(f) = freezer {
                write_file(&f.join("freezer.state"), "THAWED")?;
            }
            tokio::time::sleep(KILL_PAUSE).await;
        }
        if self.pids()?.is_empty() {
            Ok(())
        } else {
            Err(CgroupError::Unkillable(self.dirs.members().to_path_buf()))
        }
    }

    /// Removes the (empty) cgroup directories.
    pub fn remove(&self) -> Result<(), CgroupError> {
        for dir in self.dirs.all() {
            match std::fs::remove_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(CgroupError::Io {
                        path: dir,
                        op: "rmdir",
                        source,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Task cgroups made ahead of the runs that take them, all with the one set of limits every
/// run gets: a start that finds one ready makes no `mkdir` and writes no limit (on v1 that is
/// four directories and five files, a tenth of the launcher's own work per start; see
/// BENCHMARKS.md). Each is named `spare.<n>`, which no tid can be; a spare a crashed launcher
/// left is removed by the next one's sweep of the parent, like any other task cgroup.
#[derive(Debug)]
pub struct Spares {
    cgroups: Cgroups,
    limits: CgroupLimits,
    keep: usize,
    state: std::sync::Mutex<SpareState>,
}

#[derive(Debug, Default)]
struct SpareState {
    ready: Vec<TaskCgroup>,
    /// Being made by a [`Spares::refill`] now (counted so two refills never overshoot).
    making: usize,
    next: u64,
    /// After [`Spares::clear`]: refills make nothing.
    closed: bool,
}

/// The prefix of a spare's name: `.` is not a tid character.
pub const SPARE_PREFIX: &str = "spare.";

impl Spares {
    /// Keeps up to `keep` cgroups with `limits` ready below the parent of `cgroups`; none is
    /// made before the first [`Spares::refill`].
    pub fn new(cgroups: Cgroups, limits: CgroupLimits, keep: usize) -> Spares {
        Spares {
            cgroups,
            limits,
            keep,
            state: std::sync::Mutex::new(SpareState::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SpareState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A ready cgroup with the limits, if one is left.
    pub fn take(&self) -> Option<TaskCgroup> {
        self.lock().ready.pop()
    }

    /// Makes spares until `keep` are ready (blocking: directory and file writes on the cgroup
    /// filesystem). A spare that cannot be made completely is removed again.
    pub fn refill(&self) -> Result<(), CgroupError> {
        loop {
            let name = {
                let mut st = self.lock();
                if st.closed || st.ready.len() + st.making >= self.keep {
                    return Ok(());
                }
                st.making += 1;
                st.next += 1;
                format!("{SPARE_PREFIX}{}", st.next)
            };
            let made = self.make(&name);
            let mut st = self.lock();
            st.making -= 1;
            let task = made?;
            if st.closed {
                drop(st);
                return task.remove();
            }
            st.ready.push(task);
        }
    }

    fn make(&self, name: &str) -> Result<TaskCgroup, CgroupError> {
        let task = TaskCgroup {
            dirs: self.cgroups.task_dirs(name),
            signaller: Arc::clone(&self.cgroups.signaller),
        };
        let made = task
            .dirs
            .all()
            .iter()
            .try_for_each(|dir| std::fs::create_dir(dir).map_err(io_err(dir, "mkdir")))
            .and_then(|()| task.write_limits(self.limits));
        match made {
            Ok(()) => Ok(task),
            Err(e) => {
                let _ = task.remove();
                Err(e)
            }
        }
    }

    /// Removes the spares still ready, and makes no more (shutdown).
    pub fn clear(&self) -> Result<(), CgroupError> {
        let ready = {
            let mut st = self.lock();
            st.closed = true;
            std::mem::take(&mut st.ready)
        };
        ready.iter().try_for_each(TaskCgroup::remove)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// "Kills" by removing the pid from every fake `cgroup.procs`, and records the calls.
    #[derive(Debug, Default)]
    struct FakeKill {
        files: Mutex<Vec<PathBuf>>,
        killed: Mutex<Vec<i32>>,
    }

    impl Signaller for FakeKill {
        fn kill(&self, pid: i32) -> std::io::Result<()> {
            self.killed.lock().unwrap().push(pid);
            for f in self.files.lock().unwrap().iter() {
                let text = std::fs::read_to_string(f)?;
                let kept: Vec<&str> = text
                    .lines()
                    .filter(|l| l.trim() != pid.to_string())
                    .collect();
                std::fs::write(f, kept.join("\n"))?;
            }
            Ok(())
        }
    }

    /// `path` holds exactly `expected`.
    fn assert_file(path: &Path, expected: &str) {
        let text = std::fs::read_to_string(path).unwrap();
        assert_eq!(text, expected, "{}", path.display());
    }

    fn v1(tmp: &Path) -> Hierarchy {
        Hierarchy::V1(V1Dirs {
            memory: tmp.join("memory/agentbox"),
            pids: tmp.join("pids/agentbox"),
            cpu: tmp.join("cpu/agentbox"),
            freezer: Some(tmp.join("freezer/agentbox")),
        })
    }

    #[test]
    fn exiting_processes() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert!(!RealSignaller.is_exiting(me), "a live process");
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = i32::try_from(child.id()).unwrap();
        child.wait().unwrap();
        assert!(RealSignaller.is_exiting(pid), "a reaped process");
    }

    const LIMITS: CgroupLimits = CgroupLimits {
        memory_bytes: 64 << 20,
        pids: 32,
        cpus: 2,
    };

    #[tokio::test]
    async fn v1_limits_kill_and_remove() {
        let tmp = tempfile::tempdir().unwrap();
        let fake = Arc::new(FakeKill::default());
        let cg = Cgroups::with_hierarchy(v1(tmp.path()), fake.clone());
        cg.prepare().unwrap();
        // The real kernel creates the interface files; the fake tree needs them before the
        // writes that only happen when a file exists.
        let task = cg.create("t1", LIMITS).await.unwrap();
        let mem = tmp.path().join("memory/agentbox/t1");
        assert_file(&mem.join("memory.limit_in_bytes"), "67108864");
        assert_file(&tmp.path().join("pids/agentbox/t1/pids.max"), "32");
        assert_file(
            &tmp.path().join("cpu/agentbox/t1/cpu.cfs_quota_us"),
            "200000",
        );
        assert_eq!(
            task.join_files(),
            ["memory", "pids", "cpu", "freezer"]
                .map(|c| tmp.path().join(c).join("agentbox/t1/tasks"))
        );
        assert_eq!(cg.list(), vec!["t1".to_owned()]);

        std::fs::write(mem.join("cgroup.procs"), "11\n12\n").unwrap();
        fake.files.lock().unwrap().push(mem.join("cgroup.procs"));
        task.kill_all().await.unwrap();
        assert_eq!(*fake.killed.lock().unwrap(), vec![11, 12]);
        assert_file(
            &tmp.path().join("freezer/agentbox/t1/freezer.state"),
            "THAWED",
        );
        std::fs::write(
            mem.join("memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n",
        )
        .unwrap();
        assert_eq!(task.oom_kills(), 3);
        for f in [
            "memory.limit_in_bytes",
            "cgroup.procs",
            "memory.oom_control",
        ] {
            std::fs::remove_file(mem.join(f)).unwrap();
        }
        for d in ["pids", "cpu", "freezer"] {
            let dir = tmp.path().join(d).join("agentbox/t1");
            for e in std::fs::read_dir(&dir).unwrap() {
                std::fs::remove_file(e.unwrap().path()).unwrap();
            }
        }
        task.remove().unwrap();
        assert!(cg.open("t1").is_none());
        assert!(cg.list().is_empty());
    }

    #[tokio::test]
    async fn v2_limits_and_oom() {
        let tmp = tempfile::tempdir().unwrap();
        let h = Hierarchy::V2 {
            mount: tmp.path().to_path_buf(),
            parent: tmp.path().join("agentbox"),
        };
        let cg = Cgroups::with_hierarchy(h, Arc::new(FakeKill::default()));
        cg.prepare().unwrap();
        assert_file(
            &tmp.path().join("cgroup.subtree_control"),
            "+memory +pids +cpu",
        );
        let task = cg.create("t2", LIMITS).await.unwrap();
        let dir = tmp.path().join("agentbox/t2");
        assert_file(&dir.join("cpu.max"), "200000 100000");
        assert_file(&dir.join("memory.max"), "67108864");
        std::fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n",
        )
        .unwrap();
        assert_eq!(task.oom_kills(), 1);
        assert_eq!(cg.version(), CgroupVersion::V2);
        assert!(task.pids().unwrap().is_empty());
        task.kill_all().await.unwrap();
    }

    #[test]
    fn names_are_components() {
        let tmp = tempfile::tempdir().unwrap();
        let cg = Cgroups::with_hierarchy(v1(tmp.path()), Arc::new(FakeKill::default()));
        assert!(cg.open("../x").is_none());
        assert!(Cgroups::detect(tmp.path(), "a/b", Arc::new(RealSignaller)).is_err());
    }

    #[test]
    fn spares_are_made_ahead_with_the_limits_and_cleared() {
        let tmp = tempfile::tempdir().unwrap();
        let cg = Cgroups::with_hierarchy(v1(tmp.path()), Arc::new(FakeKill::default()));
        cg.prepare().unwrap();
        let spares = Spares::new(cg.clone(), LIMITS, 2);
        assert!(spares.take().is_none(), "nothing before the first refill");
        spares.refill().unwrap();
        assert_eq!(cg.list(), vec!["spare.1".to_owned(), "spare.2".to_owned()]);
        // A second refill with both ready makes nothing.
        spares.refill().unwrap();
        assert_eq!(cg.list().len(), 2);
        let task = spares.take().unwrap();
        let dir = tmp.path().join("memory/agentbox/spare.2");
        assert_file(&dir.join("memory.limit_in_bytes"), "67108864");
        assert_file(&tmp.path().join("pids/agentbox/spare.2/pids.max"), "32");
        assert_file(
            &tmp.path().join("cpu/agentbox/spare.2/cpu.cfs_quota_us"),
            "200000",
        );
        assert_eq!(
            task.join_files(),
            ["memory", "pids", "cpu", "freezer"]
                .map(|c| tmp.path().join(c).join("agentbox/spare.2/tasks"))
        );
        spares.refill().unwrap();
        assert_eq!(
            cg.list(),
            ["spare.1", "spare.2", "spare.3"].map(str::to_owned)
        );
        // The fake tree's limit files make the directories non-empty: empty them as the
        // kernel would on rmdir.
        let empty = |name: &str| {
            for c in ["memory", "pids", "cpu", "freezer"] {
                let d = tmp.path().join(c).join("agentbox").join(name);
                for e in std::fs::read_dir(&d).unwrap() {
                    std::fs::remove_file(e.unwrap().path()).unwrap();
                }
            }
        };
        empty("spare.1");
        empty("spare.3");
        spares.clear().unwrap();
        assert_eq!(cg.list(), vec!["spare.2".to_owned()], "the taken one stays");
        spares.refill().unwrap();
        assert!(spares.take().is_none(), "cleared: no more are made");
    }

    #[test]
    fn a_spare_that_cannot_be_made_is_not_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let cg = Cgroups::with_hierarchy(v1(tmp.path()), Arc::new(FakeKill::default()));
        cg.prepare().unwrap();
        // The pids controller's parent is gone: the second mkdir fails.
        std::fs::remove_dir(tmp.path().join("pids/agentbox")).unwrap();
        let spares = Spares::new(cg.clone(), LIMITS, 1);
        assert!(spares.refill().is_err());
        assert!(spares.take().is_none());
        assert!(cg.list().is_empty(), "{:?}", cg.list());
    }

    #[test]
    fn keyed_values() {
        assert_eq!(keyed_value("oom 2\noom_kill 5\n", "oom_kill"), Some(5));
        assert_eq!(keyed_value("oom_kill_disable 0\n", "oom_kill"), None);
    }
}
