//! The seccomp filters every sandbox runs under, compiled to classic BPF for bubblewrap's
//! `--add-seccomp-fd`.
//!
//! **Default deny.** An allowlist in the shape of Docker's default profile (moby
//! `profiles/seccomp/default.json`): what Docker grants a container that has no extra
//! capabilities, minus what we refuse on top of it, so a kernel interface added tomorrow stays
//! closed until someone reviews it. Refused beyond Docker: debugging or reading other processes
//! (`ptrace`, `process_vm_*`), io_uring (a second syscall table no filter sees), file handles
//! (`name_to_handle_at`), the clock (`adjtimex`, `clock_adjtime`), `modify_ldt`, and the thread
//! area calls only 32-bit code uses. The real Claude Code, opencode, Codex and OpenClaw do their
//! test tasks inside the launcher's sandbox under it (`tests/tests/seccomp_clients.rs`).
//!
//! **Arguments.** `clone` only without namespace flags, and `unshare`/`setns` not at all, so no
//! new user (or any other) namespace from inside; `socket` only for unix, IPv4 and IPv6 (not
//! netlink, packet, vsock, bluetooth...: Node's and Bun's interface listing gets `EPERM` from
//! netlink and they carry on); `personality` only to query or set the default;
//! `ioctl` only for the requests in [`ALLOWED_IOCTLS`]: terminals (attributes, window size,
//! process groups, pseudo-terminal allocation), descriptor requests (`FIONREAD`, `FIONBIO`,
//! `FIOCLEX`) and file cloning. Every other request is refused: `TIOCSTI` and `TIOCLINUX` (typing
//! into a terminal, CVE-2017-5226), line disciplines, namespace and pidfd queries, device and
//! filesystem control. Requests are compared on their low 32 bits, all the kernel reads.
//!
//! **Modes.** `openat`, `mkdirat`, `mknodat`, `fchmod`, `fchmodat`, `fchmodat2` (and on x86_64
//! `open`, `creat`, `mkdir`, `mknod`, `chmod`) are allowed only with neither the setuid nor the
//! setgid bit in their mode argument (`EPERM` otherwise; a directory's setgid bit too: the
//! hand-back strips it anyway, and no agent workload was seen to need it). A setuid file in a
//! workspace lets any local user who can reach it start a process as the run's agent uid
//! outside the sandbox, one that outlives the run and meets the next run that uid serves.
//! `openat2` carries its mode in memory a filter cannot read, and stays
//! allowed because OpenClaw needs it (`RESOLVE_BENEATH`, no fallback); but it can only create
//! an *empty* file with the bits, and the kernel clears both at the first write, truncation or
//! allocation by a process without `CAP_FSETID`, so no setuid or setgid program comes of it
//! (`tests/tests/launcher_sandbox.rs::no_setuid_or_setgid_program_while_the_run_lasts`).
//!
//! **Which errno.** A refusal answers `EPERM`, as Docker's does: the caller reports a permission
//! failure instead of misreading it. `ENOSYS` ("no such call in this kernel") only where libcs
//! and runtimes fall back on it to an interface we allow: `clone3` (glibc and musl fall back to
//! `clone`, whose flags a filter can read; `clone3`'s are in memory it cannot), `statmount` and
//! `listmount` (to `/proc/self/mountinfo`), the `lsm_*` self-attribute calls (to
//! `/proc/self/attr`), `file_setattr` (to its ioctl, refused as above), every number above the
//! highest this list was reviewed against (a newer libc probing a newer kernel's call), and the
//! x32 ABI. io_uring keeps `EPERM`: libuv (Node) falls back to its thread pool on any error from
//! `io_uring_setup`.
//!
//! **Architectures.** x86_64 and aarch64: anything else fails to compile here, rather than run
//! sandboxes under a list nobody checked for its syscall and ioctl numbers. A syscall made under a
//! foreign architecture (i386 `int 0x80`, arm32) kills the process (seccompiler's arch check);
//! x32 numbers (bit 30 set, which reach the same kernel entry points under other numbers) answer
//! `ENOSYS` from a hand-written prefix, which also answers the `ENOSYS` calls above.
//!
//! bwrap loads two filters ([`main_filter`], [`enosys_filter`]). The main one is complete on its
//! own; the second repeats the `ENOSYS` answers, so the errno never depends on which of two
//! refusing filters the kernel reports (the most recently loaded one).

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch, sock_filter,
};

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
compile_error!(
    "the sandbox's seccomp allowlist covers x86_64 and aarch64 only: review its syscall and \
     ioctl numbers for this architecture before running sandboxes here"
);

/// Why a filter could not be built (a bug: the lists are fixed).
#[derive(Debug, Clone, thiserror::Error)]
#[error("cannot build the seccomp filter: {0}")]
pub struct SeccompError(String);

#[cfg(target_arch = "x86_64")]
const ARCH: TargetArch = TargetArch::x86_64;
#[cfg(target_arch = "aarch64")]
const ARCH: TargetArch = TargetArch::aarch64;

#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: u32 = 0xc000_003e;
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: u32 = 0xc000_00b7;

const X32_SYSCALL_BIT: u32 = 0x4000_0000;

/// Syscalls from Linux 6.6 on, which the `libc` crate does not all name. Numbers from 424 on are
/// the same on every architecture.
mod nr {
    pub const CACHESTAT: i64 = 451;
    pub const FCHMODAT2: i64 = 452;
    pub const MAP_SHADOW_STACK: i64 = 453;
    pub const FUTEX_WAKE: i64 = 454;
    pub const FUTEX_WAIT: i64 = 455;
    pub const FUTEX_REQUEUE: i64 = 456;
    pub const STATMOUNT: i64 = 457;
    pub const LISTMOUNT: i64 = 458;
    pub const LSM_GET_SELF_ATTR: i64 = 459;
    pub const LSM_SET_SELF_ATTR: i64 = 460;
    pub const LSM_LIST_MODULES: i64 = 461;
    pub const MSEAL: i64 = 462;
    pub const SETXATTRAT: i64 = 463;
    pub const GETXATTRAT: i64 = 464;
    pub const LISTXATTRAT: i64 = 465;
    pub const REMOVEXATTRAT: i64 = 466;
    pub const FILE_GETATTR: i64 = 468;
    pub const FILE_SETATTR: i64 = 469;
}

/// The highest syscall number this list was reviewed against (Linux 6.17's `file_setattr`);
/// above it, `ENOSYS`. 467 (`open_tree_attr`, the mount API) is refused like `open_tree`.
const HIGHEST_REVIEWED: i64 = nr::FILE_SETATTR;

/// Syscalls allowed whatever their arguments: Docker's unconditional list (its 64-bit names),
/// minus the refusals in the module header and the [`mode_setters`], plus newer calls that only
/// do what an allowed older one does (the `*xattrat` family, `file_getattr`, the futex2 calls,
/// `cachestat`) or only restrict the caller (`mseal`, `map_shadow_stack`).
fn allowed_syscalls() -> Vec<i64> {
    use libc::*;
    let mut v = vec![
        SYS_accept,
        SYS_accept4,
        SYS_bind,
        SYS_brk,
        SYS_capget,
        SYS_capset,
        SYS_chdir,
        SYS_clock_getres,
        SYS_clock_gettime,
        SYS_clock_nanosleep,
        SYS_close,
        SYS_close_range,
        SYS_connect,
        SYS_copy_file_range,
        SYS_dup,
        SYS_dup3,
        SYS_epoll_create1,
        SYS_epoll_ctl,
        SYS_epoll_pwait,
        SYS_epoll_pwait2,
        SYS_eventfd2,
        SYS_execve,
        SYS_execveat,
        SYS_exit,
        SYS_exit_group,
        SYS_faccessat,
        SYS_faccessat2,
        SYS_fadvise64,
        SYS_fallocate,
        SYS_fanotify_mark,
        SYS_fchdir,
        SYS_fchown,
        SYS_fchownat,
        SYS_fcntl,
        SYS_fdatasync,
        SYS_fgetxattr,
        SYS_flistxattr,
        SYS_flock,
        SYS_fremovexattr,
        SYS_fsetxattr,
        SYS_fstat,
        SYS_fstatfs,
        SYS_fsync,
        SYS_ftruncate,
        SYS_futex,
        SYS_futex_waitv,
        SYS_getcpu,
        SYS_getcwd,
        SYS_getdents64,
        SYS_getegid,
        SYS_geteuid,
        SYS_getgid,
        SYS_getgroups,
        SYS_getitimer,
        SYS_getpeername,
        SYS_getpgid,
        SYS_getpid,
        SYS_getppid,
        SYS_getpriority,
        SYS_getrandom,
        SYS_getresgid,
        SYS_getresuid,
        SYS_getrlimit,
        SYS_get_robust_list,
        SYS_getrusage,
        SYS_getsid,
        SYS_getsockname,
        SYS_getsockopt,
        SYS_gettid,
        SYS_gettimeofday,
        SYS_getuid,
        SYS_getxattr,
        SYS_inotify_add_watch,
        SYS_inotify_init1,
        SYS_inotify_rm_watch,
        SYS_io_cancel,
        SYS_io_destroy,
        SYS_io_getevents,
        SYS_ioprio_get,
        SYS_ioprio_set,
        SYS_io_setup,
        SYS_io_submit,
        SYS_kill,
        SYS_landlock_add_rule,
        SYS_landlock_create_ruleset,
        SYS_landlock_restrict_self,
        SYS_lgetxattr,
        SYS_linkat,
        SYS_listen,
        SYS_listxattr,
        SYS_llistxattr,
        SYS_lremovexattr,
        SYS_lseek,
        SYS_lsetxattr,
        SYS_madvise,
        SYS_membarrier,
        SYS_memfd_create,
        SYS_memfd_secret,
        SYS_mincore,
        SYS_mlock,
        SYS_mlock2,
        SYS_mlockall,
        SYS_mmap,
        SYS_mprotect,
        SYS_mq_getsetattr,
        SYS_mq_notify,
        SYS_mq_open,
        SYS_mq_timedreceive,
        SYS_mq_timedsend,
        SYS_mq_unlink,
        SYS_mremap,
        SYS_msgctl,
        SYS_msgget,
        SYS_msgrcv,
        SYS_msgsnd,
        SYS_msync,
        SYS_munlock,
        SYS_munlockall,
        SYS_munmap,
        SYS_nanosleep,
        SYS_newfstatat,
        // Its mode lies in memory a filter cannot read (see the module header), but OpenClaw
        // opens its state with `RESOLVE_BENEATH` and has no fallback.
        SYS_openat2,
        SYS_pidfd_open,
        SYS_pidfd_send_signal,
        SYS_pipe2,
        SYS_pkey_alloc,
        SYS_pkey_free,
        SYS_pkey_mprotect,
        SYS_ppoll,
        SYS_prctl,
        SYS_pread64,
        SYS_preadv,
        SYS_preadv2,
        SYS_prlimit64,
        SYS_process_mrelease,
        SYS_pselect6,
        SYS_pwrite64,
        SYS_pwritev,
        SYS_pwritev2,
        SYS_read,
        SYS_readahead,
        SYS_readlinkat,
        SYS_readv,
        SYS_recvfrom,
        SYS_recvmmsg,
        SYS_recvmsg,
        SYS_remap_file_pages,
        SYS_removexattr,
        SYS_renameat,
        SYS_renameat2,
        SYS_restart_syscall,
        SYS_rseq,
        SYS_rt_sigaction,
        SYS_rt_sigpending,
        SYS_rt_sigprocmask,
        SYS_rt_sigqueueinfo,
        SYS_rt_sigreturn,
        SYS_rt_sigsuspend,
        SYS_rt_sigtimedwait,
        SYS_rt_tgsigqueueinfo,
        SYS_sched_getaffinity,
        SYS_sched_getattr,
        SYS_sched_getparam,
        SYS_sched_get_priority_max,
        SYS_sched_get_priority_min,
        SYS_sched_getscheduler,
        SYS_sched_rr_get_interval,
        SYS_sched_setaffinity,
        SYS_sched_setattr,
        SYS_sched_setparam,
        SYS_sched_setscheduler,
        SYS_sched_yield,
        SYS_seccomp,
        SYS_semctl,
        SYS_semget,
        SYS_semop,
        SYS_semtimedop,
        SYS_sendfile,
        SYS_sendmmsg,
        SYS_sendmsg,
        SYS_sendto,
        SYS_setfsgid,
        SYS_setfsuid,
        SYS_setgid,
        SYS_setgroups,
        SYS_setitimer,
        SYS_setpgid,
        SYS_setpriority,
        SYS_setregid,
        SYS_setresgid,
        SYS_setresuid,
        SYS_setreuid,
        SYS_setrlimit,
        SYS_set_robust_list,
        SYS_setsid,
        SYS_setsockopt,
        SYS_set_tid_address,
        SYS_setuid,
        SYS_setxattr,
        SYS_shmat,
        SYS_shmctl,
        SYS_shmdt,
        SYS_shmget,
        SYS_shutdown,
        SYS_sigaltstack,
        SYS_signalfd4,
        SYS_socketpair,
        SYS_splice,
        SYS_statfs,
        SYS_statx,
        SYS_symlinkat,
        SYS_sync,
        SYS_sync_file_range,
        SYS_syncfs,
        SYS_sysinfo,
        SYS_tee,
        SYS_tgkill,
        SYS_timer_create,
        SYS_timer_delete,
        SYS_timer_getoverrun,
        SYS_timer_gettime,
        SYS_timer_settime,
        SYS_timerfd_create,
        SYS_timerfd_gettime,
        SYS_timerfd_settime,
        SYS_times,
        SYS_tkill,
        SYS_truncate,
        SYS_umask,
        SYS_uname,
        SYS_unlinkat,
        SYS_utimensat,
        SYS_vmsplice,
        SYS_wait4,
        SYS_waitid,
        SYS_write,
        SYS_writev,
    ];
    v.extend([
        nr::CACHESTAT,
        nr::MAP_SHADOW_STACK,
        nr::FUTEX_WAKE,
        nr::FUTEX_WAIT,
        nr::FUTEX_REQUEUE,
        nr::MSEAL,
        nr::SETXATTRAT,
        nr::GETXATTRAT,
        nr::LISTXATTRAT,
        nr::REMOVEXATTRAT,
        nr::FILE_GETATTR,
    ]);
    // io_pgetevents, which the libc crate names on neither architecture.
    #[cfg(target_arch = "x86_64")]
    v.push(333);
    #[cfg(target_arch = "aarch64")]
    v.push(292);
    #[cfg(target_arch = "x86_64")]
    v.extend([
        SYS_access,
        SYS_alarm,
        SYS_arch_prctl,
        SYS_chown,
        SYS_dup2,
        SYS_epoll_create,
        SYS_epoll_wait,
        SYS_eventfd,
        SYS_fork,
        SYS_futimesat,
        SYS_getdents,
        SYS_getpgrp,
        SYS_inotify_init,
        SYS_lchown,
        SYS_link,
        SYS_lstat,
        SYS_pause,
        SYS_pipe,
        SYS_poll,
        SYS_readlink,
        SYS_rename,
        SYS_rmdir,
        SYS_select,
        SYS_signalfd,
        SYS_stat,
        SYS_symlink,
        SYS_time,
        SYS_unlink,
        SYS_utime,
        SYS_utimes,
        SYS_vfork,
    ]);
    v.sort_unstable();
    v.dedup();
    v
}

/// Syscalls answered `ENOSYS`, so the caller falls back (see the module header).
const ENOSYS_SYSCALLS: [i64; 7] = [
    libc::SYS_clone3,
    nr::STATMOUNT,
    nr::LISTMOUNT,
    nr::LSM_GET_SELF_ATTR,
    nr::LSM_SET_SELF_ATTR,
    nr::LSM_LIST_MODULES,
    nr::FILE_SETATTR,
];

/// The `ioctl` requests allowed (x86_64 and aarch64 share these numbers). Chosen from what the
/// agents, their runtimes (Node's libuv, Bun, Rust's tokio) and the tools they run (bash, git,
/// python, coreutils) issue: isatty and terminal modes, window size, job control and
/// pseudo-terminals (`openpty`, `login_tty`), non-blocking and close-on-exec flags, queued
/// bytes, and copy-on-write clones (`cp`, and Bun's file copy, which Claude Code uses).
pub const ALLOWED_IOCTLS: [libc::c_ulong; 27] = [
    // Terminal attributes (tcgetattr/tcsetattr, and the termios2 forms libraries use for
    // arbitrary baud rates), tcdrain, tcflow, tcflush.
    libc::TCGETS,
    libc::TCSETS,
    libc::TCSETSW,
    libc::TCSETSF,
    libc::TCGETS2,
    libc::TCSETS2,
    libc::TCSETSW2,
    libc::TCSETSF2,
    libc::TCSBRK,
    libc::TCXONC,
    libc::TCFLSH,
    // Window size.
    libc::TIOCGWINSZ,
    libc::TIOCSWINSZ,
    // Sessions and job control on the caller's own terminal.
    libc::TIOCGPGRP,
    libc::TIOCSPGRP,
    libc::TIOCGSID,
    libc::TIOCSCTTY,
    libc::TIOCNOTTY,
    // Pseudo-terminals (posix_openpt, grantpt, unlockpt, ptsname, openpty).
    libc::TIOCGPTN,
    libc::TIOCSPTLCK,
    libc::TIOCGPTPEER,
    // Bytes queued (FIONREAD is TIOCINQ and SIOCINQ; TIOCOUTQ is SIOCOUTQ).
    libc::FIONREAD,
    libc::TIOCOUTQ,
    // Descriptor flags.
    libc::FIONBIO,
    libc::FIOCLEX,
    libc::FIONCLEX,
    // Copy-on-write clones of files the caller can already read and write.
    libc::FICLONE,
];

/// Setuid and setgid.
const PRIVILEGE_BITS: u64 = 0o6000;

/// The syscalls that give a file its mode bits, with the index of their mode argument: allowed
/// only with neither [`PRIVILEGE_BITS`] set (`fchmodat2`, from Linux 6.6, like `fchmodat`).
fn mode_setters() -> Vec<(i64, u8)> {
    use libc::*;
    #[allow(unused_mut)]
    let mut v = vec![
        (SYS_openat, 3),
        (SYS_mkdirat, 2),
        (SYS_mknodat, 2),
        (SYS_fchmod, 1),
        (SYS_fchmodat, 2),
        (nr::FCHMODAT2, 2),
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([
        (SYS_open, 2),
        (SYS_creat, 1),
        (SYS_mkdir, 1),
        (SYS_mknod, 1),
        (SYS_chmod, 1),
    ]);
    v
}

const NAMESPACE_FLAGS: [u64; 7] = [
    libc::CLONE_NEWUSER as u64,
    libc::CLONE_NEWNS as u64,
    libc::CLONE_NEWPID as u64,
    libc::CLONE_NEWNET as u64,
    libc::CLONE_NEWUTS as u64,
    libc::CLONE_NEWIPC as u64,
    libc::CLONE_NEWCGROUP as u64,
];

fn cond(
    arg: u8,
    len: SeccompCmpArgLen,
    op: SeccompCmpOp,
    value: u64,
) -> Result<SeccompCondition, SeccompError> {
    SeccompCondition::new(arg, len, op, value).map_err(|e| SeccompError(e.to_string()))
}

fn rule(conditions: Vec<SeccompCondition>) -> Result<SeccompRule, SeccompError> {
    SeccompRule::new(conditions).map_err(|e| SeccompError(e.to_string()))
}

/// One rule per value: the syscall is allowed when argument `arg` equals any of them.
fn any_of(
    arg: u8,
    values: impl IntoIterator<Item = u64>,
) -> Result<Vec<SeccompRule>, SeccompError> {
    values
        .into_iter()
        .map(|v| {
            rule(vec![cond(
                arg,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                v,
            )?])
        })
        .collect()
}

fn compile(
    rules: BTreeMap<i64, Vec<SeccompRule>>,
    otherwise: SeccompAction,
    matched: SeccompAction,
) -> Result<BpfProgram, SeccompError> {
    let filter = SeccompFilter::new(rules, otherwise, matched, ARCH)
        .map_err(|e| SeccompError(e.to_string()))?;
    BpfProgram::try_from(filter).map_err(|e| SeccompError(e.to_string()))
}

fn errno(e: i32) -> Result<SeccompAction, SeccompError> {
    Ok(SeccompAction::Errno(
        u32::try_from(e).map_err(|e| SeccompError(e.to_string()))?,
    ))
}

fn unsigned(v: i32) -> Result<u64, SeccompError> {
    u64::try_from(v).map_err(|e| SeccompError(e.to_string()))
}

/// The main filter: the [`prefix`], then the allowlist (`EPERM` for the rest).
pub fn main_filter() -> Result<BpfProgram, SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in allowed_syscalls() {
        rules.insert(nr, Vec::new());
    }
    // clone(flags, ...) without any namespace flag. The kernel reads the low 32 bits of the
    // flags, where all of these are; the mask's zero upper half ignores the rest.
    let namespaces = NAMESPACE_FLAGS.iter().fold(0, |m, f| m | f);
    rules.insert(
        libc::SYS_clone,
        vec![rule(vec![cond(
            0,
            SeccompCmpArgLen::Qword,
            SeccompCmpOp::MaskedEq(namespaces),
            0,
        )?])?],
    );
    rules.insert(libc::SYS_ioctl, any_of(1, ALLOWED_IOCTLS.iter().copied())?);
    // A mode is a `mode_t`, 32 bits.
    for (nr, arg) in mode_setters() {
        rules.insert(
            nr,
            vec![rule(vec![cond(
                arg,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::MaskedEq(PRIVILEGE_BITS),
                0,
            )?])?],
        );
    }
    // The network namespace has only loopback anyway; the other families are kernel surface.
    rules.insert(
        libc::SYS_socket,
        any_of(
            0,
            [libc::AF_UNIX, libc::AF_INET, libc::AF_INET6]
                .into_iter()
                .map(unsigned)
                .collect::<Result<Vec<_>, _>>()?,
        )?,
    );
    // Query (0xffffffff) or set PER_LINUX (0): READ_IMPLIES_EXEC and ADDR_NO_RANDOMIZE weaken
    // the process.
    rules.insert(libc::SYS_personality, any_of(0, [0, 0xffff_ffff])?);
    let body = compile(rules, errno(libc::EPERM)?, SeccompAction::Allow)?;
    let mut program = prefix()?;
    program.extend(body);
    Ok(program)
}

/// The second filter: the [`ENOSYS_SYSCALLS`] answer `ENOSYS`, everything else passes (to the
/// main filter's verdict).
pub fn enosys_filter() -> Result<BpfProgram, SeccompError> {
    let rules: BTreeMap<i64, Vec<SeccompRule>> =
        ENOSYS_SYSCALLS.iter().map(|&nr| (nr, Vec::new())).collect();
    compile(rules, SeccompAction::Allow, errno(libc::ENOSYS)?)
}

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter {
        code,
        jt: 0,
        jf: 0,
        k,
    }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

fn word(v: i64) -> Result<u32, SeccompError> {
    u32::try_from(v).map_err(|e| SeccompError(e.to_string()))
}

fn offset(v: usize) -> Result<u8, SeccompError> {
    u8::try_from(v).map_err(|e| SeccompError(e.to_string()))
}

/// For the native architecture: x32 numbers, numbers above [`HIGHEST_REVIEWED`] and the
/// [`ENOSYS_SYSCALLS`] return `ENOSYS`; everything else (foreign architectures included, which
/// seccompiler's program kills) falls through to the seccompiler program, which reloads what it
/// needs.
fn prefix() -> Result<BpfProgram, SeccompError> {
    // Classic BPF opcodes (linux/filter.h); seccomp_data has nr at 0, arch at 4.
    const BPF_LD_W_ABS: u16 = 0x20;
    const BPF_JA: u16 = 0x05;
    const BPF_JEQ_K: u16 = 0x15;
    const BPF_JGT_K: u16 = 0x25;
    const BPF_JSET_K: u16 = 0x45;
    const BPF_RET_K: u16 = 0x06;
    const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
    let n = ENOSYS_SYSCALLS.len();
    // Layout: 0 load arch, 1 native?, 2 load nr, 3 x32?, 4 too new?, 5.. the list, then a jump
    // over the return, the return, and the seccompiler program at `body`.
    let ret = 6 + n;
    let body = ret + 1;
    let to = |from: usize, target: usize| offset(target - from - 1);
    let mut p = vec![
        stmt(BPF_LD_W_ABS, 4),
        jump(BPF_JEQ_K, AUDIT_ARCH, 0, to(1, body)?),
        stmt(BPF_LD_W_ABS, 0),
        jump(BPF_JSET_K, X32_SYSCALL_BIT, to(3, ret)?, 0),
        jump(BPF_JGT_K, word(HIGHEST_REVIEWED)?, to(4, ret)?, 0),
    ];
    for (i, &nr) in ENOSYS_SYSCALLS.iter().enumerate() {
        p.push(jump(BPF_JEQ_K, word(nr)?, to(5 + i, ret)?, 0));
    }
    p.push(stmt(BPF_JA, 1));
    p.push(stmt(
        BPF_RET_K,
        SECCOMP_RET_ERRNO | u32::try_from(libc::ENOSYS).map_err(|e| SeccompError(e.to_string()))?,
    ));
    debug_assert_eq!(p.len(), body);
    Ok(p)
}

/// Applies both filters to the calling thread (setting `no_new_privs` first), as bwrap does just
/// before it executes the sandboxed command: for running a program under exactly the sandbox's
/// syscall filter and nothing else of the sandbox (the tests' `seccomp-exec`, which shows that
/// the filter itself refuses what it must even to root).
pub fn apply_to_current_thread() -> Result<(), SeccompError> {
    for program in [main_filter()?, enosys_filter()?] {
        seccompiler::apply_filter(&program).map_err(|e| SeccompError(e.to_string()))?;
    }
    Ok(())
}

/// The main and the `ENOSYS` program, as bytes.
pub type ProgramBytes = (Vec<u8>, Vec<u8>);

/// Both programs as the bytes bwrap reads (`--add-seccomp-fd`, main first), built once per
/// process: the lists are fixed at compile time, and building them (seccompiler's rule tree
/// over the whole allowlist, then the BPF) was work every sandbox start repeated. A build that
/// failed fails every later call the same way.
pub fn program_bytes() -> Result<&'static ProgramBytes, SeccompError> {
    static PROGRAMS: std::sync::OnceLock<Result<ProgramBytes, SeccompError>> =
        std::sync::OnceLock::new();
    PROGRAMS
        .get_or_init(|| Ok((to_bytes(&main_filter()?), to_bytes(&enosys_filter()?))))
        .as_ref()
        .map_err(Clone::clone)
}

/// A program as the bytes the kernel (and bwrap) read: `struct sock_filter` in native order.
pub fn to_bytes(program: &[sock_filter]) -> Vec<u8> {
    let mut out = Vec::with_capacity(program.len() * 8);
    for ins in program {
        out.extend_from_slice(&ins.code.to_ne_bytes());
        out.push(ins.jt);
        out.push(ins.jf);
        out.extend_from_slice(&ins.k.to_ne_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny classic-BPF interpreter covering the opcodes our programs use, so the filters'
    /// decisions can be checked without loading them into the kernel.
    fn run(program: &[sock_filter], nr: u32, arch: u32, args: [u64; 6]) -> u32 {
        let mut data = Vec::new();
        data.extend_from_slice(&nr.to_ne_bytes());
        data.extend_from_slice(&arch.to_ne_bytes());
        data.extend_from_slice(&0u64.to_ne_bytes());
        for a in args {
            data.extend_from_slice(&a.to_ne_bytes());
        }
        let word = |off: u32| {
            let o = off as usize;
            u32::from_ne_bytes(data[o..o + 4].try_into().unwrap())
        };
        let (mut acc, mut pc) = (0u32, 0usize);
        loop {
            let ins = &program[pc];
            match ins.code & 0x07 {
                0x00 => {
                    acc = word(ins.k);
                    pc += 1;
                }
                0x04 => {
                    // ALU: only AND is used by seccompiler's masked comparisons.
                    assert_eq!(ins.code & 0xf0, 0x50, "alu op {:#x}", ins.code);
                    acc &= ins.k;
                    pc += 1;
                }
                0x05 => {
                    let op = ins.code & 0xf0;
                    if op == 0x00 {
                        pc += 1 + ins.k as usize;
                        continue;
                    }
                    let taken = match op {
                        0x10 => acc == ins.k,
                        0x20 => acc > ins.k,
                        0x30 => acc >= ins.k,
                        0x40 => acc & ins.k != 0,
                        other => panic!("jump op {other:#x}"),
                    };
                    pc += 1 + usize::from(if taken { ins.jt } else { ins.jf });
                }
                0x06 => return ins.k,
                other => panic!("class {other:#x}"),
            }
        }
    }

    const ALLOW: u32 = 0x7fff_0000;
    fn errno(e: i32) -> u32 {
        0x0005_0000 | e as u32
    }
    fn nr(n: i64) -> u32 {
        n as u32
    }

    /// What the kernel answers with both filters loaded, in bwrap's order (the enosys filter
    /// last): the action of highest precedence (KILL < ERRNO < ALLOW, compared as signed), and
    /// among equal actions the most recently loaded filter's.
    fn verdict(n: u32, args: [u64; 6]) -> u32 {
        verdict_as(n, AUDIT_ARCH, args)
    }
    fn verdict_as(n: u32, arch: u32, args: [u64; 6]) -> u32 {
        let main = run(&main_filter().unwrap(), n, arch, args);
        let second = run(&enosys_filter().unwrap(), n, arch, args);
        let action = |v: u32| (v & 0xffff_0000) as i32;
        if action(main) < action(second) {
            main
        } else {
            second
        }
    }

    #[test]
    fn every_number_gets_its_declared_answer() {
        let allowed = allowed_syscalls();
        let mut filtered = vec![
            libc::SYS_clone,
            libc::SYS_ioctl,
            libc::SYS_socket,
            libc::SYS_personality,
        ];
        filtered.extend(mode_setters().into_iter().map(|(n, _)| n));
        for n in 0..=HIGHEST_REVIEWED + 40 {
            if filtered.contains(&n) {
                continue;
            }
            let want = if n > HIGHEST_REVIEWED || ENOSYS_SYSCALLS.contains(&n) {
                errno(libc::ENOSYS)
            } else if allowed.contains(&n) {
                ALLOW
            } else {
                errno(libc::EPERM)
            };
            assert_eq!(verdict(nr(n), [0; 6]), want, "syscall {n}");
            // The main filter alone gives the same answer.
            assert_eq!(
                run(&main_filter().unwrap(), nr(n), AUDIT_ARCH, [0; 6]),
                want
            );
        }
        assert!(
            ENOSYS_SYSCALLS
                .iter()
                .all(|n| !allowed.contains(n) && *n <= HIGHEST_REVIEWED)
        );
    }

    #[test]
    fn escapes_and_snooping_are_refused() {
        use libc::*;
        let refused = [
            SYS_ptrace,
            SYS_process_vm_readv,
            SYS_process_vm_writev,
            SYS_kcmp,
            SYS_pidfd_getfd,
            SYS_process_madvise,
            SYS_bpf,
            SYS_perf_event_open,
            SYS_keyctl,
            SYS_add_key,
            SYS_request_key,
            SYS_io_uring_setup,
            SYS_io_uring_enter,
            SYS_io_uring_register,
            SYS_userfaultfd,
            SYS_unshare,
            SYS_setns,
            SYS_mount,
            SYS_umount2,
            SYS_pivot_root,
            SYS_chroot,
            SYS_fsopen,
            SYS_fsconfig,
            SYS_fsmount,
            SYS_fspick,
            SYS_move_mount,
            SYS_open_tree,
            467, // open_tree_attr
            SYS_mount_setattr,
            SYS_name_to_handle_at,
            SYS_open_by_handle_at,
            SYS_kexec_load,
            SYS_kexec_file_load,
            SYS_init_module,
            SYS_finit_module,
            SYS_delete_module,
            SYS_syslog,
            SYS_acct,
            SYS_quotactl,
            SYS_swapon,
            SYS_swapoff,
            SYS_reboot,
            SYS_sethostname,
            SYS_setdomainname,
            SYS_settimeofday,
            SYS_clock_settime,
            SYS_clock_adjtime,
            SYS_adjtimex,
            SYS_fanotify_init,
            SYS_get_mempolicy,
            SYS_set_mempolicy,
            SYS_mbind,
            SYS_migrate_pages,
            SYS_move_pages,
            SYS_vhangup,
        ];
        #[cfg(target_arch = "x86_64")]
        let arch_specific = vec![
            SYS_modify_ldt,
            SYS_ioperm,
            SYS_iopl,
            SYS_uselib,
            SYS_set_thread_area,
        ];
        #[cfg(target_arch = "aarch64")]
        let arch_specific: Vec<i64> = Vec::new();
        for n in refused.into_iter().chain(arch_specific) {
            assert_eq!(verdict(nr(n), [0; 6]), errno(EPERM), "syscall {n}");
        }
    }

    #[test]
    fn no_mode_with_setuid_or_setgid() {
        for (n, arg) in mode_setters() {
            let with = |mode: u64| {
                let mut args = [0; 6];
                args[usize::from(arg)] = mode;
                verdict(nr(n), args)
            };
            for mode in [
                0,
                0o644,
                0o755,
                0o1777,
                0o100644,
                0o010644,
                0xffff_0000_0000_01ff,
            ] {
                assert_eq!(with(mode), ALLOW, "syscall {n} mode {mode:o}");
            }
            for mode in [
                0o4755,
                0o2755,
                0o6755,
                0o4000,
                0o2000,
                0o104755,
                0xffff_0000_0000_0c00,
            ] {
                assert_eq!(with(mode), errno(libc::EPERM), "syscall {n} mode {mode:o}");
            }
        }
    }

    #[test]
    fn clone_without_namespaces_only() {
        let clone = |flags: u64| verdict(nr(libc::SYS_clone), [flags, 0, 0, 0, 0, 0]);
        assert_eq!(clone(libc::SIGCHLD as u64), ALLOW);
        let thread = libc::CLONE_VM
            | libc::CLONE_FS
            | libc::CLONE_FILES
            | libc::CLONE_SIGHAND
            | libc::CLONE_THREAD
            | libc::CLONE_SYSVSEM
            | libc::CLONE_SETTLS
            | libc::CLONE_PARENT_SETTID
            | libc::CLONE_CHILD_CLEARTID;
        assert_eq!(clone(thread as u64), ALLOW);
        for flag in NAMESPACE_FLAGS {
            assert_eq!(clone(flag | 17), errno(libc::EPERM), "{flag:#x}");
        }
        assert_eq!(
            verdict(nr(libc::SYS_clone3), [0; 6]),
            errno(libc::ENOSYS),
            "clone3 must send libc back to clone"
        );
    }

    #[test]
    fn ioctl_requests_outside_the_allowlist_are_refused() {
        let ioctl = |req: u64| verdict(nr(libc::SYS_ioctl), [0, req, 0, 0, 0, 0]);
        for req in ALLOWED_IOCTLS {
            assert_eq!(ioctl(req), ALLOW, "{req:#x}");
        }
        let ns_get_userns = 0xb701; // _IO(0xb7, 0x1): a namespace fd's owning user namespace
        for req in [
            libc::TIOCSTI,
            libc::TIOCLINUX,
            libc::TIOCSETD,
            libc::TIOCGETD,
            libc::TIOCCONS,
            libc::TIOCVHANGUP,
            libc::TIOCSSERIAL,
            libc::FIOASYNC,
            libc::FS_IOC_SETFLAGS,
            libc::FICLONERANGE,
            ns_get_userns,
            0,
        ] {
            assert_eq!(ioctl(req), errno(libc::EPERM), "{req:#x}");
        }
        // The kernel reads only the low 32 bits of the request, so the filter must too: high
        // bits neither dodge a refusal nor break an allowed request.
        assert_eq!(ioctl(libc::TIOCSTI | (1 << 32)), errno(libc::EPERM));
        assert_eq!(ioctl(libc::TCGETS | (1 << 32)), ALLOW);
    }

    #[test]
    fn socket_families_and_personality() {
        let socket = |fam: i32| verdict(nr(libc::SYS_socket), [fam as u64, 1, 0, 0, 0, 0]);
        for fam in [libc::AF_UNIX, libc::AF_INET, libc::AF_INET6] {
            assert_eq!(socket(fam), ALLOW, "{fam}");
        }
        for fam in [
            libc::AF_NETLINK,
            libc::AF_PACKET,
            libc::AF_VSOCK,
            libc::AF_BLUETOOTH,
            libc::AF_ALG,
            libc::AF_UNSPEC,
        ] {
            assert_eq!(socket(fam), errno(libc::EPERM), "{fam}");
        }
        let pers = |v: u64| verdict(nr(libc::SYS_personality), [v, 0, 0, 0, 0, 0]);
        assert_eq!(pers(0), ALLOW);
        assert_eq!(pers(0xffff_ffff), ALLOW);
        assert_eq!(pers(0x0040_0000), errno(libc::EPERM)); // READ_IMPLIES_EXEC
        assert_eq!(pers(0x0004_0000), errno(libc::EPERM)); // ADDR_NO_RANDOMIZE
    }

    #[test]
    fn x32_and_foreign_architectures() {
        assert_eq!(
            verdict(nr(libc::SYS_read) | X32_SYSCALL_BIT, [0; 6]),
            errno(libc::ENOSYS)
        );
        // i386 (on x86_64) or arm32 (on aarch64): killed, whatever the number.
        let foreign = if AUDIT_ARCH == 0xc000_003e {
            0x4000_0003
        } else {
            0x4000_0028
        };
        for n in [0, 1, 11, 120] {
            let v = run(&main_filter().unwrap(), n, foreign, [0; 6]);
            assert!(v == 0x8000_0000 || v == 0, "{n}: {v:#x}");
        }
    }

    #[test]
    fn bytes_are_eight_per_instruction() {
        let p = main_filter().unwrap();
        assert_eq!(to_bytes(&p).len(), p.len() * 8);
        assert!(p.len() < 4096, "the kernel's limit: {}", p.len());
    }

    #[test]
    fn the_cached_programs_are_the_built_ones() {
        let (main, enosys) = program_bytes().unwrap();
        assert_eq!(*main, to_bytes(&main_filter().unwrap()));
        assert_eq!(*enosys, to_bytes(&enosys_filter().unwrap()));
        assert!(std::ptr::eq(
            program_bytes().unwrap(),
            program_bytes().unwrap()
        ));
    }
}
