//! Inside the real sandbox, probed with `POST /checks` (bash as the agent uid under real bwrap,
//! seccomp and cgroups): the properties of the attack catalogue (research §10, items 12-22).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use agentbox_tests::harness::launcher::{
    self as common, AGENT_UID, Launcher, Options, SERVICE_UID, owner_of,
};
use serde_json::{Value, json};

fn out(v: &Value) -> &str {
    v["stdout"].as_str().unwrap()
}

#[test]
fn identity_capabilities_and_descriptors() {
    let l = Launcher::start(Options::default());
    let v = l.probe(
        "id1",
        "id -u; id -g; id -G; grep -E '^(CapInh|CapPrm|CapEff|CapBnd|CapAmb|NoNewPrivs|Seccomp):' /proc/self/status; \
         ls /proc/self/fd | sort -n | tr '\\n' ' '; echo; pwd; echo $HOME; env | sort",
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    let text = out(&v);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[0], AGENT_UID.to_string());
    assert_eq!(lines[1], "64000");
    assert_eq!(lines[2], "64000", "supplementary groups: {text}");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        assert!(
            text.contains(&format!("{cap}:\t0000000000000000")),
            "{cap} in {text}"
        );
    }
    assert!(text.contains("NoNewPrivs:\t1"), "{text}");
    assert!(text.contains("Seccomp:\t2"), "{text}");
    // `ls` opens the directory it lists as fd 3.
    assert!(text.contains("\n0 1 2 3 \n"), "fds: {text}");
    assert!(text.contains("/workspace\n/home/agent\n"), "{text}");
    assert!(
        !text.contains("ANTHROPIC"),
        "checks get no gateway settings: {text}"
    );
    assert!(
        !text.contains("RUST_LOG"),
        "the launcher's environment leaked: {text}"
    );
}

#[test]
fn network_is_loopback_only() {
    let l = Launcher::start(Options::default());
    let host = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = host.local_addr().unwrap().port();
    let v = l.probe(
        "net1",
        &format!(
            "if timeout 10 bash -c 'echo > /dev/tcp/127.0.0.1/{port}' 2>/dev/null; then echo host-reached; else echo host-unreachable; fi; \
             if timeout 10 bash -c 'echo > /dev/tcp/1.1.1.1/53' 2>/dev/null; then echo net-reached; else echo net-unreachable; fi; \
             echo ifaces $(tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '); \
             python3 -c 'import socket; socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 0)' 2>&1 | tail -1; \
             python3 -c 'import socket; socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)' 2>&1 | tail -1"
        ),
    );
    let text = out(&v);
    assert!(text.contains("host-unreachable"), "{text}");
    assert!(text.contains("net-unreachable"), "{text}");
    assert!(text.contains("\nifaces lo\n"), "interfaces: {text}");
    assert_eq!(
        text.matches("PermissionError").count(),
        2,
        "netlink/packet sockets: {text}"
    );
}

#[test]
fn host_files_are_invisible_and_the_root_read_only() {
    let l = Launcher::start(Options::default());
    let data = l.data.display().to_string();
    let v = l.probe(
        "fs1",
        &format!(
            "for p in /etc/shadow /root /home/user /var /run/gw /run/dbus {data} {data}/run/launcher.sock /sys/fs/cgroup/memory; do \
               if [ -e $p ]; then echo present $p; else echo absent $p; fi; done; \
             ls /run 2>&1; cat /etc/passwd; \
             touch /usr/x 2>/dev/null && echo wrote-usr; touch /opt/x 2>/dev/null && echo wrote-opt; \
             touch /etc/x 2>/dev/null && echo wrote-etc; touch /x 2>/dev/null && echo wrote-root; \
             touch /tmp/x && touch ~/x && touch /workspace/x && echo writable-ok; \
             mount -o remount,rw /usr 2>/dev/null && echo remounted; \
             unshare -Ur true 2>/dev/null && echo unshared; \
             python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); sys.exit(0 if l.syscall(101,0,1,0,0)==-1 else 1)' && echo ptrace-denied; \
             python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); sys.exit(0 if l.syscall(425,1,0)==-1 else 1)' && echo io-uring-denied; \
             python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); sys.exit(0 if l.syscall(323,0)==-1 else 1)' && echo userfaultfd-denied; \
             python3 -c 'import ctypes,sys; l=ctypes.CDLL(None,use_errno=True); sys.exit(0 if l.syscall(0x40000000+39)==-1 else 1)' && echo x32-denied; \
             python3 -c 'import fcntl,termios,sys; sys.exit(0)' && echo py-ok; \
             ps -e -o pid=,comm= | wc -l"
        ),
    );
    let text = out(&v);
    for line in text
        .lines()
        .filter(|l| l.starts_with("present") || l.starts_with("absent"))
    {
        assert!(line.starts_with("absent"), "{line}\n{text}");
    }
    assert!(text.contains("agent:x:64000:64000"), "{text}");
    assert!(!text.contains("root:x:0"), "host passwd leaked: {text}");
    for bad in [
        "wrote-usr",
        "wrote-opt",
        "wrote-etc",
        "wrote-root",
        "remounted",
        "unshared",
    ] {
        assert!(!text.contains(bad), "{bad}: {text}");
    }
    for good in [
        "writable-ok",
        "ptrace-denied",
        "io-uring-denied",
        "userfaultfd-denied",
        "x32-denied",
        "py-ok",
    ] {
        assert!(
            text.contains(good),
            "{good} missing: {text}\n{}",
            v["stderr"]
        );
    }
    // Only the sandbox's own processes are visible (bwrap's init, bash, ps, wc).
    let procs: usize = text.lines().last().unwrap().trim().parse().unwrap();
    assert!(procs <= 6, "{procs} processes visible: {text}");
}

#[test]
fn tmp_is_capped() {
    let l = Launcher::start_with(|o| o.tmp_mb = 4);
    let v = l.probe(
        "tmp1",
        "head -c 8M /dev/zero > /tmp/fill; echo rc=$?; stat -c %s /tmp/fill",
    );
    let text = out(&v);
    assert!(text.contains("rc=1"), "{text}");
    assert!(
        v["stderr"]
            .as_str()
            .unwrap()
            .contains("No space left on device"),
        "{v}"
    );
    let size: u64 = text.lines().last().unwrap().parse().unwrap();
    assert!(size <= 4 << 20, "{size}");
}

#[test]
fn fork_bomb_is_contained_by_the_pids_limit() {
    let l = Launcher::start_with(|o| o.pids = 32);
    // Bounded: 200 forks against a limit of 32 tasks; python itself needs no fork to report.
    let fork_200 = r#"
import os, signal, time
kids = []
err = None
for i in range(200):
    try:
        pid = os.fork()
    except OSError as e:
        err = e
        break
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
print("started", len(kids), err)
for k in kids:
    os.kill(k, signal.SIGKILL)
"#;
    let v = l.probe("fork1", &format!("python3 -c '{fork_200}'"));
    let text = out(&v);
    let started: usize = text
        .split_whitespace()
        .nth(1)
        .unwrap_or_else(|| panic!("{v}"))
        .parse()
        .unwrap();
    assert!(
        started < 32,
        "{started} processes started under pids.max 32: {v}"
    );
    assert!(text.contains("Resource temporarily unavailable"), "{v}");
}

#[test]
fn memory_hog_is_oom_killed_and_reported() {
    let l = Launcher::start_with(|o| {
        o.memory_mb = 64;
        o.tmp_mb = 256;
    });
    let v = l.probe(
        "oom1",
        "python3 -c 'x = bytearray(512 << 20); print(len(x))'",
    );
    assert_eq!(v["oom_killed"], true, "{v}");
    assert_eq!(v["exit_code"], 137, "{v}");
    assert_eq!(v["timed_out"], false);
    // The next check in a fresh cgroup is not marked.
    let v = l.probe("oom1", "true");
    assert_eq!(v["oom_killed"], false, "{v}");
}

#[test]
fn timeouts_kill_everything_including_setsid_survivors() {
    let l = Launcher::start(Options::default());
    let marker = format!("{}", 900_000 + std::process::id());
    let ws = l.workspace("to1");
    let r = l.post(
        "/checks",
        &json!({"tid": "to1", "command": format!("setsid nohup sleep {marker} >/dev/null 2>&1 & sleep 1000"), "timeout_s": 2}),
    );
    assert_eq!(r.status, 200, "{}", r.raw);
    assert_eq!(r.body["timed_out"], true, "{}", r.raw);
    assert_eq!(r.body["exit_code"], 137, "{}", r.raw);
    assert!(common::processes_with(&format!("sleep {marker}")).is_empty());
    assert!(l.cgroup_dirs().is_empty(), "{:?}", l.cgroup_dirs());
    assert_eq!(owner_of(&ws), SERVICE_UID);
}

#[test]
fn output_is_capped_and_workspace_handed_back() {
    let l = Launcher::start_with(|o| o.output_cap_kb = 4);
    let ws = l.workspace("cap1");
    let r = l.check(
        "cap1",
        "head -c 100000 /dev/zero | tr '\\0' a; echo err >&2; mkdir -p d; echo x > d/f; cp /bin/true d/suid; chmod 4755 d/suid 2>/dev/null; chmod 0757 d/suid; ln -s /etc/shadow d/link; mkfifo d/fifo; exit 3",
    );
    assert_eq!(r.status, 200, "{}", r.raw);
    assert_eq!(r.body["exit_code"], 3);
    assert_eq!(r.body["truncated"], true);
    assert_eq!(r.body["stdout"].as_str().unwrap().len(), 4096);
    assert_eq!(r.body["stderr"], "err\n");
    for p in ["d", "d/f", "d/suid", "d/link", "d/fifo"] {
        assert_eq!(owner_of(&ws.join(p)), SERVICE_UID, "{p}");
    }
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(ws.join("d/suid"))
            .unwrap()
            .permissions()
            .mode()
            & 0o7777,
        0o755
    );
    assert_eq!(owner_of(std::path::Path::new("/etc/shadow")), 0);
    // Check logs are removed once returned, so the service user can clean up the task.
    assert!(!l.data.join("tasks/cap1/logs").exists());
}

#[test]
fn venv_is_mounted_read_only() {
    let l = Launcher::start(Options::default());
    let venv = l.venv("py");
    l.workspace("venv1");
    let r = l.post(
        "/checks",
        &json!({"tid": "venv1", "command": "which python; python -c 'print(6*7)'; echo $VIRTUAL_ENV; touch /opt/venv/x 2>/dev/null && echo wrote", "venv": venv, "timeout_s": 60}),
    );
    assert_eq!(r.status, 200, "{}", r.raw);
    assert_eq!(
        r.body["stdout"], "/opt/venv/bin/python\n42\n/opt/venv\n",
        "{}",
        r.raw
    );
}

/// The staging mount points (`mnt/<tid>/…`, where the launcher binds each validated directory
/// before bwrap reads the path back) are on a tmpfs only the launcher's mount namespace has:
/// root-owned 0711, nothing on the host's mount table, and a check still sees its workspace
/// through it.
#[test]
fn staging_is_a_tmpfs_of_the_launchers_namespace_only() {
    use std::os::unix::fs::MetadataExt;
    let l = Launcher::start(Options::default());
    let v = l.probe("tf1", "echo seen > f && cat f");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(out(&v), "seen\n");
    let mnt = l.data.join("mnt");
    let mnt = mnt.to_str().unwrap();
    let theirs = std::fs::read_to_string(format!("/proc/{}/mountinfo", l.pid())).unwrap();
    let line = theirs
        .lines()
        .find(|line| line.split(' ').nth(4) == Some(mnt))
        .unwrap_or_else(|| panic!("no mount on {mnt} in the launcher's namespace:\n{theirs}"));
    assert!(line.contains(" - tmpfs "), "{line}");
    assert!(line.contains("mode=711"), "{line}");
    let ours = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(
        !ours.contains(mnt),
        "the host sees the staging tmpfs:\n{ours}"
    );
    let seen = std::fs::metadata(format!("/proc/{}/root{mnt}", l.pid())).unwrap();
    assert_eq!((seen.uid(), seen.mode() & 0o7777), (0, 0o711));
}

/// The staged mounts of a run live in a mount namespace of the run's own, made by the child
/// that execs bwrap: the launcher's namespace never holds one (so a start never copies and
/// parses the mounts of every other run in flight), the run's holds its own, attached on the
/// root-only `mnt/<tid>/…` paths bwrap reads back, and no `/sys` (shed before bwrap starts);
/// its mount points are gone once it ends.
#[test]
fn staged_mounts_live_in_the_runs_namespace_only() {
    let l = Launcher::start(Options::default());
    let (ws, _gw) = l.prepare_task("ns1");
    l.start_agent(
        "ns1",
        json!({"cmd": ["claude", "while [ ! -e go ]; do sleep 0.02; done; echo seen"]}),
    );
    let mnt = l.data.join("mnt");
    let staged = format!("{}/ns1/", mnt.display());
    // The launcher's direct child that is bwrap: the outer bwrap stays in the namespace the
    // child made.
    let bwrap = common::eventually("bwrap running", || {
        for task in std::fs::read_dir(format!("/proc/{}/task", l.pid()))
            .ok()?
            .flatten()
        {
            let children = std::fs::read_to_string(task.path().join("children")).ok()?;
            for pid in children.split_whitespace() {
                let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
                let info = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).ok()?;
                if comm.trim() == "bwrap" && info.contains(&staged) {
                    return Some(pid.to_owned());
                }
            }
        }
        None
    });
    let points = |pid: &str| -> Vec<String> {
        std::fs::read_to_string(format!("/proc/{pid}/mountinfo"))
            .unwrap()
            .lines()
            .filter_map(|line| line.split(' ').nth(4).map(str::to_owned))
            .collect()
    };
    let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/mnt")).unwrap();
    assert_ne!(ns(&bwrap), ns(&l.pid().to_string()));
    let launchers = points(&l.pid().to_string());
    let leaked: Vec<_> = launchers
        .iter()
        .filter(|p| p.starts_with(&staged))
        .collect();
    assert!(
        leaked.is_empty(),
        "staged mounts in the launcher's namespace: {leaked:?}"
    );
    let runs = points(&bwrap);
    for name in ["workspace", "gateway"] {
        assert!(
            runs.contains(&format!("{staged}{name}")),
            "{name}: {runs:#?}"
        );
    }
    let sys: Vec<_> = runs.iter().filter(|p| p.starts_with("/sys")).collect();
    assert!(
        sys.is_empty(),
        "host mounts under /sys left for bwrap: {sys:?}"
    );
    assert!(launchers.iter().any(|p| p.starts_with("/sys")));

    std::fs::write(ws.join("go"), "").unwrap();
    let v = l.wait_agent("ns1");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(out(&v), "seen\n");
    assert!(
        !mnt.join("ns1").exists(),
        "the run's mount points outlive it"
    );
}

/// While a run lasts no file in its workspace is a setuid or setgid program: the hand-over strips
/// what the service brought, the seccomp filter refuses both bits in every call whose mode it
/// can read, and the one it cannot (`openat2`, which OpenClaw needs) makes only an empty file,
/// whose bits the kernel clears at the first write or truncation by anyone without
/// `CAP_FSETID`. Otherwise any local user who can reach the workspace could start a process as
/// the agent uid outside the sandbox.
#[test]
fn no_setuid_or_setgid_program_while_the_run_lasts() {
    let l = Launcher::start(Options::default());
    let ws = l.workspace("suid1");
    std::fs::write(ws.join("brought"), b"#!/bin/sh\n").unwrap();
    std::fs::set_permissions(
        ws.join("brought"),
        std::os::unix::fs::PermissionsExt::from_mode(0o4755),
    )
    .unwrap();
    common::chown_tree(&ws, SERVICE_UID);
    let script = r#"cd /workspace
touch f; chmod 4755 f; echo "chmod=$?"; chmod g+s f; echo "chmodg=$?"
mkdir -m 2755 d; echo "mkdir=$?"
install -m 4755 /dev/null i; echo "install=$?"
python3 - <<'PY'
import ctypes, mmap, os, stat
def attempt(name, f):
    try:
        f()
        print(name + "=0")
    except OSError as e:
        print("%s=%d" % (name, e.errno))
attempt("open", lambda: os.close(os.open("o", os.O_CREAT | os.O_WRONLY, 0o4755)))
attempt("mkdir_py", lambda: os.mkdir("m", 0o2775))
attempt("mknod", lambda: os.mknod("p", stat.S_IFIFO | 0o4644))
attempt("fchmod", lambda: os.fchmod(os.open("f", os.O_RDONLY), 0o2755))
libc = ctypes.CDLL(None, use_errno=True)
def openat2(name, flags, mode):
    how = (ctypes.c_uint64 * 3)(flags | os.O_CREAT, mode, 0)
    fd = libc.syscall(437, -100, name, how, ctypes.c_size_t(24))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "openat2")
    return fd
# Empty, and setuid: allowed, and harmless.
attempt("openat2", lambda: os.close(openat2(b"e", os.O_WRONLY, 0o4755)))
# Given content by write, or by truncation and a shared mapping.
def written():
    fd = openat2(b"w", os.O_WRONLY, 0o6755)
    os.write(fd, open("/bin/true", "rb").read())
    os.close(fd)
attempt("written", written)
def mapped():
    fd = openat2(b"r", os.O_RDWR, 0o4755)
    os.ftruncate(fd, 4096)
    m = mmap.mmap(fd, 4096)
    m[:4] = b"\x7fELF"
    m.close()
    os.close(fd)
attempt("mapped", mapped)
PY
for x in brought f d i o m p e w r; do [ -e "$x" ] && stat -c "mode $x %a %s" "$x"; done; true"#;
    let v = l.check("suid1", script).body;
    assert_eq!(v["exit_code"], 0, "{v}");
    let text = out(&v);
    for expected in [
        "chmod=1",
        "chmodg=1",
        "mkdir=1",
        "install=1",
        "open=1",
        "mkdir_py=1",
        "mknod=1",
        "fchmod=1",
        "openat2=0",
        "written=0",
        "mapped=0",
    ] {
        assert!(text.contains(expected), "{expected}: {text}");
    }
    let modes: Vec<&str> = text.lines().filter(|l| l.starts_with("mode ")).collect();
    assert!(
        modes.iter().any(|m| m.starts_with("mode brought 755 ")),
        "{text}"
    );
    assert!(
        modes.iter().any(|m| m.starts_with("mode e 4755 0")),
        "{text}"
    );
    for line in &modes {
        let fields: Vec<&str> = line.split(' ').collect();
        let (mode, size) = (fields[2], fields[3]);
        assert!(
            mode.len() <= 3 || size == "0",
            "a setuid or setgid file with content in the run: {line}\n{text}"
        );
    }
    assert!(modes.iter().any(|m| m.starts_with("mode w 755 ")), "{text}");
    assert!(
        modes.iter().any(|m| m.starts_with("mode r 755 4096")),
        "{text}"
    );
}
