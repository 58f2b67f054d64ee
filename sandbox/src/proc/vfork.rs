//! Spawning without copying the daemon: `clone(CLONE_VM | CLONE_VFORK)` runs the child setup
//! and `execve` on a small stack of its own in the parent's address space, as glibc's
//! `posix_spawn` does, instead of std's `fork`.
//!
//! Why: `fork` in a multithreaded daemon copies its page tables, and every page the daemon
//! writes afterwards takes a copy-on-write fault whose TLB shoot-down interrupts the other
//! worker threads' cores; the launcher does that once per sandbox start, on the start's
//! critical path and, for a burst, on the CPU the sandboxes themselves need (BENCHMARKS.md).
//! With `CLONE_VM` nothing is copied; `CLONE_VFORK` suspends the calling thread until the
//! child has called `execve` (or exited), so the child may use the caller's stack frame for
//! what it reads and for the one word it writes back (the errno of a failed step).
//!
//! # What the child may do
//! It shares memory with every thread of the daemon, so beyond `fork`'s rules (no lock, no
//! allocation: [`Hook::run`](super::Hook) already keeps them) it must not write anything but
//! its own stack and [`Shared::error`]. Signals are the one way the daemon's code could run
//! in it: a handler would run on shared memory. So the caller blocks every signal around the
//! `clone` and the child puts every disposition back to the default before it unblocks them
//! (its handler table is its own copy: no `CLONE_SIGHAND`). The identity change is made with
//! per-thread syscalls (`rustix::thread::set_thread_res_uid`), never glibc's `setuid`, whose
//! broadcast to "all threads" would signal the daemon's.
//!
//! Sharing memory with a child that turns into another uid is safe only while that uid cannot
//! reach the child: a tracer (or `process_vm_writev`, `/proc/<pid>/mem`) would be writing the
//! daemon's memory. The setup makes the child non-dumpable right after the uid change
//! ([`Hook::run`](super::Hook) step 3), which refuses every such access to a process without
//! `CAP_SYS_PTRACE`, and the agent uid has no other process then anyway (one uid per run).
//! Being one memory, the daemon is non-dumpable from then on too (no core dumps of a root
//! daemon holding keys: intended). A process of the new uid can still stop the child with
//! SIGSTOP, which holds the spawning thread, as std's spawn (which waits for exec on a pipe)
//! would be held.
//!
//! The child is a [`Child`]: a pidfd (`CLONE_PIDFD`) the runtime polls for the exit and
//! `waitid(P_PIDFD)` reaps, so no other wait in the process (tokio's, or
//! [`crate::reaper`]'s, which skips children recorded at spawn) can take its status.

use std::ffi::{CString, OsStr, c_char, c_int, c_void};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{ExitStatus, Output};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Mutex, PoisonError};

use rustix::fs::{Mode, OFlags};
use rustix::io::Errno;
use rustix::process::{Signal, WaitIdOptions, WaitIdStatus};
use tokio::io::AsyncReadExt;
use tokio::io::unix::AsyncFd;
use tokio::net::unix::pipe;

use super::{ChildSetup, Hook, SpawnError};

/// The child's stack: enough for the setup's few frames in a debug build, with a guard page
/// below it. Only the pages it touches are ever backed.
const STACK_BYTES: usize = 256 * 1024;

/// A program to run through [`ChildSetup::spawn_exec`]: an absolute path, its arguments, and
/// its stdin. The environment is empty, the working directory `/`, stdout and stderr are
/// pipes ([`Child::stdout`], [`Child::stderr`]).
#[derive(Debug)]
pub struct Exec {
    program: CString,
    /// `argv[0]` (the program) first.
    argv: Vec<CString>,
    /// A byte string with a NUL inside, kept to be reported at spawn.
    bad_arg: bool,
    /// None: `/dev/null`.
    stdin: Option<OwnedFd>,
}

impl Exec {
    /// Runs `program`, which must be an absolute path (nothing is looked up in `PATH`).
    #[must_use]
    pub fn new(program: &Path) -> Exec {
        let (program, bad_arg) = match CString::new(program.as_os_str().as_bytes()) {
            Ok(p) => (p, !program.is_absolute()),
            Err(_) => (CString::default(), true),
        };
        Exec {
            argv: vec![program.clone()],
            program,
            bad_arg,
            stdin: None,
        }
    }

    /// One more argument.
    #[must_use]
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Exec {
        match CString::new(arg.as_ref().as_bytes()) {
            Ok(a) => self.argv.push(a),
            Err(_) => self.bad_arg = true,
        }
        self
    }

    /// More arguments.
    #[must_use]
    pub fn args<I: IntoIterator<Item = A>, A: AsRef<OsStr>>(self, args: I) -> Exec {
        args.into_iter().fold(self, Exec::arg)
    }

    /// The program's stdin (default `/dev/null`).
    #[must_use]
    pub fn stdin(mut self, fd: OwnedFd) -> Exec {
        self.stdin = Some(fd);
        self
    }
}

/// What the child reads (and, for [`Shared::error`], writes), on the suspended caller's stack.
struct Shared<'a> {
    hook: &'a Hook,
    program: *const c_char,
    argv: *const *const c_char,
    envp: *const *const c_char,
    root: *const c_char,
    /// The descriptors that become 0, 1 and 2.
    stdio: [RawFd; 3],
    /// The errno of the step that failed (0: `execve` succeeded).
    error: AtomicI32,
}

/// The child's stack: an anonymous mapping with a `PROT_NONE` guard page at its low end.
struct Stack {
    base: *mut c_void,
    len: usize,
}

impl Stack {
    fn new() -> io::Result<Stack> {
        // SAFETY: sysconf only reads a constant of the system.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        let len = STACK_BYTES + page;
        // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_STACK,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let stack = Stack { base, len };
        // SAFETY: the lowest page of the mapping made above.
        if unsafe { libc::mprotect(base, page, libc::PROT_NONE) } != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(stack)
    }

    /// The initial stack pointer (the stack grows down on x86_64 and aarch64).
    fn top(&self) -> *mut c_void {
        self.base.wrapping_byte_add(self.len)
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`; the child that used it has exec'd or exited.
        unsafe { libc::munmap(self.base, self.len) };
    }
}

/// The child, on its own stack. Returns only by `_exit`.
extern "C" fn child_main(arg: *mut c_void) -> c_int {
    // SAFETY: `arg` is the `Shared` on the caller's stack, alive while the caller is
    // suspended (CLONE_VFORK) until this child execs or exits.
    let shared = unsafe { &*arg.cast::<Shared<'_>>() };
    let errno = child_exec(shared);
    shared.error.store(errno.max(1), Ordering::SeqCst);
    // SAFETY: ends this child without running anything of the parent's (no atexit handlers,
    // no stdio flush on shared memory).
    unsafe { libc::_exit(127) }
}

/// The steps between clone and exec; returns the errno of the one that failed.
fn child_exec(s: &Shared<'_>) -> c_int {
    let errno = || {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EINVAL)
    };
    // Every disposition back to the default while all signals are still blocked, so no
    // handler of the daemon's ever runs here and nothing the daemon ignores stays ignored
    // (SIGPIPE, as std's children; glibc's internal signals too, which its `sigaction`
    // would refuse: hence the raw syscall). A zeroed kernel `sigaction` is SIG_DFL with no
    // flags and an empty mask.
    let default = [0_u64; 4];
    for sig in 1..=64_i64 {
        if sig == i64::from(libc::SIGKILL) || sig == i64::from(libc::SIGSTOP) {
            continue;
        }
        // SAFETY: the kernel reads a `struct sigaction` (at most 32 bytes) from `default`.
        unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                sig,
                default.as_ptr(),
                std::ptr::null_mut::<c_void>(),
                8_usize,
            );
        }
    }
    for (target, &fd) in (0..).zip(&s.stdio) {
        // SAFETY: descriptor operations on numbers that are open in this child.
        let rc = unsafe {
            if fd == target {
                libc::fcntl(fd, libc::F_SETFD, 0)
            } else {
                libc::dup2(fd, target)
            }
        };
        if rc == -1 {
            return errno();
        }
    }
    // SAFETY: a NUL-terminated path owned by the suspended caller.
    if unsafe { libc::chdir(s.root) } != 0 {
        return errno();
    }
    if let Err(e) = s.hook.run() {
        return e.raw_os_error().unwrap_or(libc::EINVAL);
    }
    // SAFETY: an empty set, then the mask the program starts with (std's children start with
    // none blocked); the pointers are NUL-terminated arrays the caller built.
    unsafe {
        let mut none: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut none);
        libc::pthread_sigmask(libc::SIG_SETMASK, &none, std::ptr::null_mut());
        libc::execve(s.program, s.argv, s.envp);
    }
    errno()
}

/// Pidfds of children dropped before they were reaped; each spawn reaps those that ended
/// since (tokio's `Child` has the same orphan queue).
static ORPHANS: Mutex<Vec<OwnedFd>> = Mutex::new(Vec::new());

fn reap_orphans() {
    let mut orphans = ORPHANS.lock().unwrap_or_else(PoisonError::into_inner);
    orphans.retain(|fd| matches!(reap(fd.as_fd(), false), Ok(None)));
}

/// `waitid(P_PIDFD)`: the exit status once the child has ended (`block`: wait for it).
fn reap(fd: std::os::fd::BorrowedFd<'_>, block: bool) -> io::Result<Option<ExitStatus>> {
    let options = if block {
        WaitIdOptions::EXITED
    } else {
        WaitIdOptions::EXITED | WaitIdOptions::NOHANG
    };
    loop {
        match rustix::process::waitid(rustix::process::WaitId::PidFd(fd), options) {
            Ok(status) => return Ok(status.map(exit_status)),
            Err(Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
}

/// The `wait` status std's `ExitStatus` is made of.
fn exit_status(status: WaitIdStatus) -> ExitStatus {
    let raw = if let Some(sig) = status.terminating_signal() {
        sig | if status.dumped() { 0x80 } else { 0 }
    } else {
        (status.exit_status().unwrap_or(0) & 0xff) << 8
    };
    ExitStatus::from_raw(raw)
}

impl ChildSetup {
    /// Runs `exec` with this setup through `clone(CLONE_VM | CLONE_VFORK)` (see the module
    /// header): the counterpart of [`ChildSetup::spawn`] for a daemon that starts children
    /// often. Call from a runtime worker thread (inside a tokio runtime, whose reactor polls
    /// the pidfd and the pipes), for the same parent-death reason.
    pub fn spawn_exec(self, exec: Exec) -> Result<Child, SpawnError> {
        let program = exec.program.to_string_lossy().into_owned();
        let fail = |source: io::Error| SpawnError::Spawn {
            program: program.clone(),
            source,
        };
        if exec.bad_arg {
            return Err(fail(io::Error::new(
                io::ErrorKind::InvalidInput,
                "the program is not an absolute path, or an argument holds a NUL byte",
            )));
        }
        reap_orphans();
        let stdin = match exec.stdin {
            Some(fd) => fd,
            None => rustix::fs::open("/dev/null", OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| fail(e.into()))?,
        };
        let pipe = || rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC);
        let (out_read, out_write) = pipe().map_err(|e| fail(e.into()))?;
        let (err_read, err_write) = pipe().map_err(|e| fail(e.into()))?;
        let stack = Stack::new().map_err(fail)?;
        let mut argv: Vec<*const c_char> = exec.argv.iter().map(|a| a.as_ptr()).collect();
        argv.push(std::ptr::null());
        let envp: [*const c_char; 1] = [std::ptr::null()];
        let hook = Hook {
            join: self.join.iter().map(AsRawFd::as_raw_fd).collect(),
            plan: self.plan,
            parent: rustix::process::getpid(),
        };
        let shared = Shared {
            hook: &hook,
            program: exec.program.as_ptr(),
            argv: argv.as_ptr(),
            envp: envp.as_ptr(),
            root: c"/".as_ptr(),
            stdio: [
                stdin.as_raw_fd(),
                out_write.as_raw_fd(),
                err_write.as_raw_fd(),
            ],
            error: AtomicI32::new(0),
        };
        let pidfd = crate::reaper::spawning(
            || clone_vfork(&shared, &stack).map_err(fail),
            |(pid, _)| Some(*pid),
        )?;
        // The child has exec'd or exited: its stack and our copies of its stdio may go.
        drop((stack, stdin, out_write, err_write));
        drop(self.join);
        let (pid, pidfd) = pidfd;
        let failed = shared.error.load(Ordering::SeqCst);
        if failed != 0 {
            // It exited at once (`_exit(127)`): reap it here.
            let _ = reap(pidfd.as_fd(), true);
            return Err(fail(io::Error::from_raw_os_error(failed)));
        }
        // SAFETY: an `OwnedFd` is open and returns the same number until it is dropped, which
        // happens only with (or after, by `into_inner`) the `AsyncFd`.
        let registered =
            unsafe { AsyncFd::register_with_interest(pidfd, tokio::io::Interest::READABLE) };
        let pidfd = match registered {
            Ok(fd) => fd,
            Err(e) => {
                // Not ours to wait for any more: the orphan queue reaps it once it ends.
                let (fd, source) = e.into_parts();
                ORPHANS
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(fd);
                return Err(fail(source));
            }
        };
        // From here a failure drops `child`, whose pidfd then goes on the orphan queue (the
        // program runs on with its output pipes closed).
        let mut child = Child {
            pid,
            pidfd: Some(pidfd),
            status: None,
            stdout: None,
            stderr: None,
        };
        child.stdout = Some(pipe::Receiver::from_owned_fd(out_read).map_err(fail)?);
        child.stderr = Some(pipe::Receiver::from_owned_fd(err_read).map_err(fail)?);
        Ok(child)
    }
}

/// The `clone` itself, with every signal blocked around it (see the module header).
fn clone_vfork(shared: &Shared<'_>, stack: &Stack) -> io::Result<(u32, OwnedFd)> {
    let mut pidfd: c_int = -1;
    // SAFETY: the masks are plain values; `child_main` gets a pointer to `shared`, which
    // outlives the call since CLONE_VFORK returns only once the child has exec'd or exited;
    // the stack is a fresh mapping the child alone uses.
    let pid = unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_SETMASK, &all, &mut old);
        let pid = libc::clone(
            child_main,
            stack.top(),
            libc::CLONE_VM | libc::CLONE_VFORK | libc::CLONE_PIDFD | libc::SIGCHLD,
            std::ptr::from_ref(shared).cast_mut().cast::<c_void>(),
            &mut pidfd as *mut c_int,
        );
        let failed = (pid == -1).then(io::Error::last_os_error);
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        if let Some(e) = failed {
            return Err(e);
        }
        pid
    };
    // SAFETY: CLONE_PIDFD stored a fresh (close-on-exec) descriptor that only we hold.
    let pidfd = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(pidfd) };
    Ok((pid.unsigned_abs(), pidfd))
}

/// A child started by [`ChildSetup::spawn_exec`]: the parts of `tokio::process::Child` a
/// supervisor uses, over a pidfd.
#[derive(Debug)]
pub struct Child {
    pid: u32,
    /// None once reaped.
    pidfd: Option<AsyncFd<OwnedFd>>,
    status: Option<ExitStatus>,
    pub stdout: Option<pipe::Receiver>,
    pub stderr: Option<pipe::Receiver>,
}

impl Child {
    /// The pid, until the child is reaped (as tokio's `Child::id`).
    #[must_use]
    pub fn id(&self) -> Option<u32> {
        self.status.is_none().then_some(self.pid)
    }

    /// Sends SIGKILL (through the pidfd, so never to a reused pid). A child that already
    /// ended is not an error.
    pub fn start_kill(&mut self) -> io::Result<()> {
        let Some(fd) = self.pidfd.as_ref() else {
            return Ok(());
        };
        match rustix::process::pidfd_send_signal(fd.get_ref(), Signal::KILL) {
            Ok(()) | Err(Errno::SRCH) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// The exit status if the child has ended (reaping it), else None.
    pub fn try_wait(&mut self) -> io::Result<Option<ExitStatus>> {
        if let Some(status) = self.status {
            return Ok(Some(status));
        }
        let Some(fd) = self.pidfd.as_ref() else {
            return Ok(self.status);
        };
        let status = reap(fd.get_ref().as_fd(), false)?;
        if let Some(status) = status {
            self.status = Some(status);
            self.pidfd = None;
        }
        Ok(status)
    }

    /// Waits for the child to end and reaps it. Cancel-safe: dropped before it returns, it
    /// has reaped nothing.
    pub async fn wait(&mut self) -> io::Result<ExitStatus> {
        loop {
            if let Some(status) = self.try_wait()? {
                return Ok(status);
            }
            let Some(fd) = self.pidfd.as_ref() else {
                return Err(io::Error::other("child neither running nor reaped"));
            };
            // A pidfd turns readable when its process ends.
            let mut ready = fd.readable().await?;
            let status = reap(ready.get_inner().as_fd(), false)?;
            match status {
                Some(status) => {
                    drop(ready);
                    self.status = Some(status);
                    self.pidfd = None;
                    return Ok(status);
                }
                None => ready.clear_ready(),
            }
        }
    }

    /// Reads stdout and stderr to their end and waits for the child.
    pub async fn wait_with_output(mut self) -> io::Result<Output> {
        async fn read_all(pipe: Option<pipe::Receiver>) -> io::Result<Vec<u8>> {
            let mut bytes = Vec::new();
            if let Some(mut pipe) = pipe {
                pipe.read_to_end(&mut bytes).await?;
            }
            Ok(bytes)
        }
        let (out, err) = (self.stdout.take(), self.stderr.take());
        let (stdout, stderr, status) = tokio::try_join!(read_all(out), read_all(err), self.wait())?;
        Ok(Output {
            status,
            stdout,
            stderr,
        })
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        if let Some(fd) = self.pidfd.take()
            && !matches!(reap(fd.get_ref().as_fd(), false), Ok(Some(_)))
        {
            ORPHANS
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push(fd.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rustix::process::Resource;

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    fn sh(script: &str) -> Exec {
        Exec::new(Path::new("/bin/sh")).args(["-c", script])
    }

    /// The `SigBlk`/`SigIgn`/`SigCgt` lines of a `/proc/<pid>/status`.
    fn signal_lines(status: &str) -> Vec<String> {
        status
            .lines()
            .filter(|l| {
                ["SigBlk:", "SigIgn:", "SigCgt:"]
                    .iter()
                    .any(|p| l.starts_with(p))
            })
            .map(str::to_owned)
            .collect()
    }

    /// The setup reaches the program (identity, kept descriptors, stdin), its output comes
    /// through both pipes, and its exit code through the pidfd.
    #[test]
    fn runs_the_setup_the_program_and_reports_its_status() {
        rt().block_on(async {
            let (keep_r, _keep_w) = rustix::pipe::pipe().unwrap();
            let (drop_r, _drop_w) = rustix::pipe::pipe().unwrap();
            let script = format!(
                "id -u; id -g; id -G; test -e /proc/self/fd/{k} && echo kept; \
                 test -e /proc/self/fd/{d} || echo closed; pwd; cat; echo oops >&2; exit 3",
                k = keep_r.as_raw_fd(),
                d = drop_r.as_raw_fd()
            );
            let stdin = rustix::fs::memfd_create("in", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
            rustix::io::write(&stdin, b"from stdin\n").unwrap();
            rustix::fs::seek(&stdin, rustix::fs::SeekFrom::Start(0)).unwrap();
            let child = ChildSetup::new(64123, 64124)
                .groups(&[64125])
                .keep(&[keep_r.as_raw_fd()])
                .rlimit(Resource::Core, 0)
                .spawn_exec(sh(&script).stdin(stdin))
                .unwrap();
            assert!(child.id().is_some());
            // The child changed uid in this process's memory: that memory stays out of the new
            // uid's reach (non-dumpable), whatever `fs.suid_dumpable` says.
            assert_eq!(
                rustix::process::dumpable_behavior().unwrap(),
                rustix::process::DumpableBehavior::NotDumpable
            );
            let out = child.wait_with_output().await.unwrap();
            assert_eq!(
                String::from_utf8_lossy(&out.stdout),
                "64123\n64124\n64124 64125\nkept\nclosed\n/\nfrom stdin\n"
            );
            assert_eq!(String::from_utf8_lossy(&out.stderr), "oops\n");
            assert_eq!(out.status.code(), Some(3));
        });
    }

    /// A program that cannot be run and a setup step that fails come back as their errno; an
    /// argument the kernel could not take is refused before any clone (that none leaves a
    /// zombie is `sandbox/tests/spawn_exec.rs`'s, a process of its own).
    #[test]
    fn failures_are_reported_and_leave_no_zombie() {
        rt().block_on(async {
            let errno = |r: Result<Child, SpawnError>| match r {
                Err(SpawnError::Spawn { source, .. }) => source.raw_os_error(),
                other => panic!("{other:?}"),
            };
            let missing = ChildSetup::same_identity().spawn_exec(Exec::new(Path::new("/nope/x")));
            assert_eq!(errno(missing), Some(libc::ENOENT));
            let bad_keep = ChildSetup::same_identity()
                .keep(&[987_654])
                .spawn_exec(sh("true"));
            assert_eq!(errno(bad_keep), Some(libc::EBADF));
            for exec in [
                Exec::new(Path::new("sh")),
                sh("true").arg(std::ffi::OsStr::from_bytes(b"a\0b")),
            ] {
                let refused = ChildSetup::same_identity().spawn_exec(exec).unwrap_err();
                assert!(refused.to_string().contains("absolute path"), "{refused}");
            }
        });
    }

    /// No handler, ignored signal or blocked signal of the daemon's reaches the program, and
    /// the caller's own mask is back as it was after the spawn.
    #[test]
    fn the_program_starts_with_default_signals_and_the_caller_keeps_its_mask() {
        rt().block_on(async {
            // A handler (tokio's) and an ignored signal (std ignores SIGPIPE in every Rust
            // program) in the daemon.
            let _usr1 =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::user_defined1())
                    .unwrap();
            let before = std::fs::read_to_string("/proc/thread-self/status").unwrap();
            assert!(
                signal_lines(&before)
                    .iter()
                    .any(|l| l.starts_with("SigCgt:") && !l.ends_with("0000000000000000")),
                "{before}"
            );
            let child = ChildSetup::same_identity()
                .spawn_exec(Exec::new(Path::new("/bin/cat")).arg("/proc/self/status"))
                .unwrap();
            let after = std::fs::read_to_string("/proc/thread-self/status").unwrap();
            assert_eq!(signal_lines(&before), signal_lines(&after));
            let out = child.wait_with_output().await.unwrap();
            assert!(out.status.success());
            let theirs = signal_lines(&String::from_utf8_lossy(&out.stdout));
            assert_eq!(
                theirs,
                [
                    "SigBlk:\t0000000000000000",
                    "SigIgn:\t0000000000000000",
                    "SigCgt:\t0000000000000000"
                ]
            );
        });
    }

    /// `start_kill` ends a running child, `wait` reports the signal; killing and waiting
    /// again are harmless.
    #[test]
    fn kill_and_wait() {
        rt().block_on(async {
            let mut child = ChildSetup::same_identity()
                .spawn_exec(sh("exec sleep 100"))
                .unwrap();
            assert!(child.try_wait().unwrap().is_none());
            child.start_kill().unwrap();
            let status = child.wait().await.unwrap();
            assert_eq!(status.signal(), Some(libc::SIGKILL));
            assert_eq!(child.id(), None);
            // Killing or waiting again is harmless.
            child.start_kill().unwrap();
            assert_eq!(child.wait().await.unwrap(), status);
        });
    }
}
