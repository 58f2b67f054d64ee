//! Syscalls outside the sandbox's seccomp allowlist (issue 9, hole 11) are refused, and what
//! ordinary tools need still works: the same probes run inside the launcher's real sandbox and,
//! as root on the host, under the filters alone (`seccomp-exec`), where nothing but the filter
//! would stop them.
//!
//! Each refusal is probed with arguments the kernel itself would accept, or answer with a
//! different errno, so the expected answer can only come from the filter. Several are calls the
//! old denylist let through (`kcmp`, `get_mempolicy`, `process_madvise`, `statmount`, the
//! `TIOCSETD` and `NS_GET_USERNS` ioctls): default-deny is what refuses them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentbox_tests::harness::launcher::{Launcher, Options, SERVICE_UID, chown};

/// Prints one line per probe, `<name> <OK or errno name>`. The arguments are harmless if a call
/// got through (the probes also run as root outside any sandbox).
const PROBES: &str = r#"
import ctypes, errno, fcntl, os, platform, socket, subprocess, termios, threading
# Syscall numbers where x86_64 and aarch64 differ (from 424 on they are the same).
NR = {
    "x86_64": dict(ptrace=101, process_vm_readv=310, kcmp=312, keyctl=250, bpf=321,
                   perf_event_open=298, userfaultfd=323, get_mempolicy=239, adjtimex=159,
                   mount=165, personality=135, socket=41, clone=56, unshare=272),
    "aarch64": dict(ptrace=117, process_vm_readv=270, kcmp=272, keyctl=219, bpf=280,
                    perf_event_open=241, userfaultfd=282, get_mempolicy=236, adjtimex=171,
                    mount=40, personality=92, socket=198, clone=220, unshare=97),
}[platform.machine()]
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
L = ctypes.c_long

def show(name, r):
    e = ctypes.get_errno()
    print(name, "OK" if r >= 0 else errno.errorcode.get(e, str(e)), flush=True)

def sc(name, nr, *args):
    ctypes.set_errno(0)
    show(name, libc.syscall(L(nr), *args))

def ioctl(name, fd, req, arg=None):
    ctypes.set_errno(0)
    show(name, libc.ioctl(fd, L(req), arg))

def works(name, f):
    try:
        f()
        print(name, "OK", flush=True)
    except OSError as e:
        print(name, errno.errorcode.get(e.errno, str(e.errno)), flush=True)

pid = os.getpid()
master, slave = os.openpty()

# Refused: debugging and snooping on processes, kernel surface only escapes need.
sc("ptrace", NR["ptrace"], L(2), L(1), None, None)
sc("process_vm_readv", NR["process_vm_readv"], L(1), None, L(0), None, L(0), L(0))
sc("kcmp", NR["kcmp"], L(pid), L(pid), L(1), L(0), L(0))
sc("keyctl", NR["keyctl"], L(0), L(-3), L(0))
sc("bpf", NR["bpf"], L(0), None, L(0))
sc("perf_event_open", NR["perf_event_open"], None, L(0), L(-1), L(-1), L(0))
sc("io_uring_setup", 425, L(1), None)
sc("userfaultfd", NR["userfaultfd"], L(0))
sc("get_mempolicy", NR["get_mempolicy"], None, None, L(0), L(0), L(0))
sc("process_madvise", 440, L(-1), None, L(0), L(0), L(0))
sc("adjtimex", NR["adjtimex"], ctypes.create_string_buffer(512))
sc("mount", NR["mount"], b"none", b"/nonexistent-agentbox", b"tmpfs", L(0), None)
sc("personality_exec", NR["personality"], L(0x0400000))
sc("socket_netlink", NR["socket"], L(16), L(3), L(0))
sc("socket_alg", NR["socket"], L(38), L(5), L(0))
sc("socket_vsock", NR["socket"], L(40), L(1), L(0))
ioctl("ioctl_tiocsti", 0, 0x5412, b"x")
ioctl("ioctl_tioclinux", 0, 0x541C, b"\x0b")
ioctl("ioctl_tiocsetd", slave, 0x5423, ctypes.byref(ctypes.c_int(0)))
netns = os.open("/proc/self/ns/net", os.O_RDONLY)
ioctl("ioctl_ns_get_userns", netns, 0xb701)
# ENOSYS, so libc falls back: clone3 (to clone), statmount (to mountinfo), unknown numbers.
sc("clone3", 435, None, L(0))
sc("statmount", 457, None, None, L(0), L(0))
sc("unreviewed_470", 470, L(0), L(0), L(0))
sc("made_up_1000", 1000)
# No new namespaces from inside: clone with a namespace flag, unshare.
ctypes.set_errno(0)
child = libc.syscall(L(NR["clone"]), L(0x10000000 | 17), None, None, None, L(0))
if child == 0:
    os._exit(0)
if child > 0:
    os.waitpid(child, 0)
show("clone_newuser", child)
sc("unshare_newuser", NR["unshare"], L(0x10000000))

# Still works: processes, threads (glibc's clone3 falls back to clone), sockets, terminals.
works("fork_exec", lambda: subprocess.run(["/bin/true"], check=True))
def thread():
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
works("thread", thread)
def sockets():
    a, b = socket.socketpair()
    a.setblocking(False)
    b.send(b"x")
    fcntl.ioctl(a, termios.FIONREAD, b"\0\0\0\0")
    s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
    s.bind(("::1", 0))
    s.listen()
works("sockets", sockets)
def terminal():
    assert os.isatty(slave)
    termios.tcsetattr(slave, termios.TCSANOW, termios.tcgetattr(slave))
    fcntl.ioctl(slave, termios.TIOCSWINSZ, b"\x18\0\x50\0\0\0\0\0")
    fcntl.ioctl(slave, termios.TIOCGWINSZ, b"\0" * 8)
    os.ttyname(slave)
works("terminal", terminal)
"#;

const EXPECTED: &str = "\
ptrace EPERM
process_vm_readv EPERM
kcmp EPERM
keyctl EPERM
bpf EPERM
perf_event_open EPERM
io_uring_setup EPERM
userfaultfd EPERM
get_mempolicy EPERM
process_madvise EPERM
adjtimex EPERM
mount EPERM
personality_exec EPERM
socket_netlink EPERM
socket_alg EPERM
socket_vsock EPERM
ioctl_tiocsti EPERM
ioctl_tioclinux EPERM
ioctl_tiocsetd EPERM
ioctl_ns_get_userns EPERM
clone3 ENOSYS
statmount ENOSYS
unreviewed_470 ENOSYS
made_up_1000 ENOSYS
clone_newuser EPERM
unshare_newuser EPERM
fork_exec OK
thread OK
sockets OK
terminal OK
";

#[test]
fn syscalls_outside_the_allowlist_fail_inside_the_sandbox() {
    let l = Launcher::start(Options::default());
    let ws = l.workspace("seccomp");
    let probes = ws.join("probes.py");
    std::fs::write(&probes, PROBES).unwrap();
    chown(&probes, SERVICE_UID);
    let r = l.check(
        "seccomp",
        "/usr/bin/python3 /workspace/probes.py </dev/null",
    );
    assert_eq!(r.status, 200, "{}\n{}", r.raw, l.stderr());
    assert_eq!(r.body["exit_code"], 0, "{}", r.body);
    assert_eq!(r.body["stdout"].as_str().unwrap(), EXPECTED, "{}", r.body);
}

#[test]
fn syscalls_outside_the_allowlist_fail_under_the_filter_alone() {
    assert!(
        rustix::process::geteuid().is_root(),
        "runs as root, so that only the filter refuses"
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_seccomp-exec"))
        .args(["/usr/bin/python3", "-c", PROBES])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(text, EXPECTED);
}
