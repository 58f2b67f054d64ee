//! The seccomp filters every sandbox runs under, compiled to classic BPF for bubblewrap's
//! `--add-seccomp-fd`.
//!
//! A denylist (research §3, the union of Codex's and Flatpak's): the sandbox runs ordinary
//! developer tools, so an allowlist would break them, while this list removes the kernel
//! surface that only escapes and cross-process snooping need: debugging other processes,
//! io_uring, BPF, perf, keyrings, module and kexec loading, every mount API, new namespaces,
//! terminal injection (`TIOCSTI`/`TIOCLINUX`), and socket families other than unix and IP.
//!
//! Two filters, because one seccomp filter has a single "matched" action: the main one returns
//! `EPERM`; the second returns `ENOSYS` for `clone3` (its flags live in memory a filter cannot
//! read, and `ENOSYS` makes libc fall back to `clone`, whose flags the main filter checks). A
//! hand-written prefix on the main filter also refuses the x32 ABI (syscall numbers with bit 30
//! set), which would otherwise reach the same kernel entry points under other numbers; foreign
//! architectures (i386 via `int 0x80`) are killed by seccompiler's own architecture check.

use std::collections::BTreeMap;

use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule, TargetArch, sock_filter,
};

/// Why a filter could not be built (only on an unsupported architecture, or a bug).
#[derive(Debug, thiserror::Error)]
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

/// Syscalls refused whatever their arguments.
fn denied_syscalls() -> Vec<i64> {
    let mut v = vec![
        libc::SYS_ptrace,
        libc::SYS_process_vm_readv,
        libc::SYS_process_vm_writev,
        libc::SYS_io_uring_setup,
        libc::SYS_io_uring_enter,
        libc::SYS_io_uring_register,
        libc::SYS_userfaultfd,
        libc::SYS_bpf,
        libc::SYS_perf_event_open,
        libc::SYS_keyctl,
        libc::SYS_add_key,
        libc::SYS_request_key,
        libc::SYS_unshare,
        libc::SYS_setns,
        libc::SYS_mount,
        libc::SYS_umount2,
        libc::SYS_pivot_root,
        libc::SYS_chroot,
        libc::SYS_fsopen,
        libc::SYS_fsconfig,
        libc::SYS_fsmount,
        libc::SYS_fspick,
        libc::SYS_move_mount,
        libc::SYS_open_tree,
        libc::SYS_mount_setattr,
        libc::SYS_kexec_load,
        libc::SYS_kexec_file_load,
        libc::SYS_init_module,
        libc::SYS_finit_module,
        libc::SYS_delete_module,
        libc::SYS_syslog,
        libc::SYS_acct,
        libc::SYS_quotactl,
        libc::SYS_quotactl_fd,
        libc::SYS_pidfd_getfd,
        libc::SYS_name_to_handle_at,
        libc::SYS_open_by_handle_at,
        libc::SYS_lookup_dcookie,
        libc::SYS_swapon,
        libc::SYS_swapoff,
        libc::SYS_reboot,
        libc::SYS_settimeofday,
        libc::SYS_clock_settime,
        libc::SYS_clock_adjtime,
        libc::SYS_adjtimex,
        libc::SYS_vhangup,
        libc::SYS_mbind,
        libc::SYS_migrate_pages,
        libc::SYS_move_pages,
        libc::SYS_set_mempolicy,
    ];
    #[cfg(target_arch = "x86_64")]
    v.extend([
        libc::SYS_uselib,
        libc::SYS_modify_ldt,
        libc::SYS_ioperm,
        libc::SYS_iopl,
    ]);
    v.sort_unstable();
    v.dedup();
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

fn compile(rules: BTreeMap<i64, Vec<SeccompRule>>, errno: i32) -> Result<BpfProgram, SeccompError> {
    let errno = u32::try_from(errno).map_err(|e| SeccompError(e.to_string()))?;
    let filter = SeccompFilter::new(
        rules,
        SeccompAction::Allow,
        SeccompAction::Errno(errno),
        ARCH,
    )
    .map_err(|e| SeccompError(e.to_string()))?;
    BpfProgram::try_from(filter).map_err(|e| SeccompError(e.to_string()))
}

/// The main filter (`EPERM`), x32 prefix included.
pub fn main_filter() -> Result<BpfProgram, SeccompError> {
    use SeccompCmpArgLen::{Dword, Qword};
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    for nr in denied_syscalls() {
        rules.insert(nr, Vec::new());
    }
    // clone(flags, ...) with any namespace flag.
    let mut clone_rules = Vec::new();
    for flag in NAMESPACE_FLAGS {
        clone_rules.push(rule(vec![cond(
            0,
            Qword,
            SeccompCmpOp::MaskedEq(flag),
            flag,
        )?])?);
    }
    rules.insert(libc::SYS_clone, clone_rules);
    // ioctl(fd, TIOCSTI | TIOCLINUX): typing into the controlling terminal (CVE-2017-5226).
    rules.insert(
        libc::SYS_ioctl,
        vec![
            rule(vec![cond(1, Dword, SeccompCmpOp::Eq, libc::TIOCSTI)?])?,
            rule(vec![cond(1, Dword, SeccompCmpOp::Eq, libc::TIOCLINUX)?])?,
        ],
    );
    // socket(family, ...) outside AF_UNIX, AF_INET, AF_INET6 (AF_NETLINK, AF_PACKET, AF_VSOCK,
    // AF_BLUETOOTH...). The network namespace has only loopback anyway.
    let family = |f: i32| -> Result<SeccompCondition, SeccompError> {
        cond(
            0,
            Dword,
            SeccompCmpOp::Ne,
            u64::try_from(f).map_err(|e| SeccompError(e.to_string()))?,
        )
    };
    rules.insert(
        libc::SYS_socket,
        vec![rule(vec![
            family(libc::AF_UNIX)?,
            family(libc::AF_INET)?,
            family(libc::AF_INET6)?,
        ])?],
    );
    // personality() other than querying or setting the default: READ_IMPLIES_EXEC and
    // ADDR_NO_RANDOMIZE weaken the process.
    rules.insert(
        libc::SYS_personality,
        vec![rule(vec![
            cond(0, Dword, SeccompCmpOp::Ne, 0)?,
            cond(0, Dword, SeccompCmpOp::Ne, 0xffff_ffff)?,
        ])?],
    );
    let body = compile(rules, libc::EPERM)?;
    let mut program = x32_prefix();
    program.extend(body);
    Ok(program)
}

/// The second filter: `clone3` answers `ENOSYS`.
pub fn enosys_filter() -> Result<BpfProgram, SeccompError> {
    let mut rules: BTreeMap<i64, Vec<SeccompRule>> = BTreeMap::new();
    rules.insert(libc::SYS_clone3, Vec::new());
    compile(rules, libc::ENOSYS)
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

/// `if arch == native && nr & X32_SYSCALL_BIT { return ERRNO(ENOSYS) }`, then falls through
/// to the seccompiler program, which reloads what it needs.
fn x32_prefix() -> BpfProgram {
    // Classic BPF opcodes (linux/filter.h).
    const BPF_LD_W_ABS: u16 = 0x20;
    const BPF_JEQ_K: u16 = 0x15;
    const BPF_JSET_K: u16 = 0x45;
    const BPF_RET_K: u16 = 0x06;
    const SECCOMP_RET_ERRNO: u32 = 0x0005_0000;
    // seccomp_data: nr at 0, arch at 4.
    let enosys = SECCOMP_RET_ERRNO | u32::try_from(libc::ENOSYS).unwrap_or(38);
    vec![
        stmt(BPF_LD_W_ABS, 4),
        // Not native: skip the next three and let seccompiler kill it.
        jump(BPF_JEQ_K, AUDIT_ARCH, 0, 3),
        stmt(BPF_LD_W_ABS, 0),
        jump(BPF_JSET_K, X32_SYSCALL_BIT, 0, 1),
        stmt(BPF_RET_K, enosys),
    ]
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
            let class = ins.code & 0x07;
            match class {
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

    #[test]
    fn main_filter_decisions() {
        let p = main_filter().unwrap();
        let none = [0; 6];
        assert_eq!(run(&p, nr(libc::SYS_read), AUDIT_ARCH, none), ALLOW);
        for denied in [
            libc::SYS_ptrace,
            libc::SYS_mount,
            libc::SYS_bpf,
            libc::SYS_io_uring_setup,
            libc::SYS_unshare,
        ] {
            assert_eq!(
                run(&p, nr(denied), AUDIT_ARCH, none),
                errno(libc::EPERM),
                "{denied}"
            );
        }
        let clone = |flags: u64| run(&p, nr(libc::SYS_clone), AUDIT_ARCH, [flags, 0, 0, 0, 0, 0]);
        assert_eq!(clone(libc::SIGCHLD as u64), ALLOW);
        assert_eq!(clone((libc::CLONE_VM | libc::CLONE_THREAD) as u64), ALLOW);
        assert_eq!(clone(libc::CLONE_NEWUSER as u64 | 17), errno(libc::EPERM));
        assert_eq!(clone(libc::CLONE_NEWNET as u64), errno(libc::EPERM));
        let ioctl = |req: u64| run(&p, nr(libc::SYS_ioctl), AUDIT_ARCH, [0, req, 0, 0, 0, 0]);
        assert_eq!(ioctl(libc::TIOCSTI), errno(libc::EPERM));
        assert_eq!(ioctl(libc::TIOCGWINSZ), ALLOW);
        // The upper half of the request word is ignored by the kernel; a filter comparing all
        // 64 bits could be dodged with it.
        assert_eq!(ioctl(libc::TIOCSTI | (1 << 32)), errno(libc::EPERM));
        let socket = |fam: i32| {
            run(
                &p,
                nr(libc::SYS_socket),
                AUDIT_ARCH,
                [fam as u64, 1, 0, 0, 0, 0],
            )
        };
        assert_eq!(socket(libc::AF_UNIX), ALLOW);
        assert_eq!(socket(libc::AF_INET6), ALLOW);
        assert_eq!(socket(libc::AF_NETLINK), errno(libc::EPERM));
        assert_eq!(socket(libc::AF_PACKET), errno(libc::EPERM));
        assert_eq!(socket(libc::AF_VSOCK), errno(libc::EPERM));
        let pers = |v: u64| {
            run(
                &p,
                nr(libc::SYS_personality),
                AUDIT_ARCH,
                [v, 0, 0, 0, 0, 0],
            )
        };
        assert_eq!(pers(0), ALLOW);
        assert_eq!(pers(0xffff_ffff), ALLOW);
        assert_eq!(pers(0x0040_0000), errno(libc::EPERM));
        // x32 numbers and foreign architectures.
        assert_eq!(
            run(&p, nr(libc::SYS_read) | X32_SYSCALL_BIT, AUDIT_ARCH, none),
            errno(libc::ENOSYS)
        );
        let killed = run(&p, 1, 0x4000_0003, none);
        assert!(killed == 0x8000_0000 || killed == 0, "{killed:#x}");
    }

    #[test]
    fn enosys_filter_decisions() {
        let p = enosys_filter().unwrap();
        assert_eq!(
            run(&p, nr(libc::SYS_clone3), AUDIT_ARCH, [0; 6]),
            errno(libc::ENOSYS)
        );
        assert_eq!(run(&p, nr(libc::SYS_clone), AUDIT_ARCH, [0; 6]), ALLOW);
    }

    #[test]
    fn bytes_are_eight_per_instruction() {
        let p = enosys_filter().unwrap();
        assert_eq!(to_bytes(&p).len(), p.len() * 8);
    }
}
