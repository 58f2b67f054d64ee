//! Rollout slots (`/slots`): the real launcher as root, real bwrap, the real `blackbox-server`
//! as `launcher.blackbox_bin` and the real agent CLIs as `launcher.clients_dir`.
//!
//! Every test starts a slot, which answers 201 only once the server created its unix socket
//! (`BBS_UNIX_SOCKET`); the server learns that variable on branch `s6-rollout`, so until it is
//! merged these tests fail at `POST /slots` with `slot_failed` ("did not create server.sock").
//! The isolation tests look from inside through `POST /slots/{tid}/exec`, a sandbox of the slot's
//! own shape (uid, directories, no network), and at the server's sandbox from the host.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use agentbox_tests::harness::launcher::{
    AGENT_UID_COUNT, Launcher, Options, cmdlines_containing, eventually,
};
use agentbox_tests::harness::workspace_bin;
use base64::Engine;
use serde_json::{Value, json};

/// A launcher for slots whose agent uids are `first..first + AGENT_UID_COUNT`: each test
/// passes its own `first` (from 66000 on, 10 apart), so looking for processes by uid never
/// sees another test's slots.
fn launcher(first: u32) -> Launcher {
    launcher_with(first, |_| {})
}

/// [`launcher`] with more settings.
fn launcher_with(first: u32, more: impl FnOnce(&mut Options)) -> Launcher {
    // Caches made before `install-clients.sh` set the mode are 0700; the slot's agent uid
    // must be able to enter the directory the launcher binds.
    let clients = agentbox_tests::harness::clients_dir().unwrap();
    std::fs::set_permissions(
        &clients,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    Launcher::start_with(|o| {
        o.agent_uid = first;
        o.slot_server = Some(workspace_bin("agentbox-blackbox", "blackbox-server").unwrap());
        o.memory_mb = 1024;
        o.pids = 256;
        more(o);
    })
}

const TOKEN: &str = "slot-token-7f3a9c1e5b2d4680";

/// A started slot: its gateway socket (kept alive) and its `POST /slots` answer.
struct Slot {
    status: Value,
    _gateway: std::os::unix::net::UnixListener,
}

fn start(l: &Launcher, tid: &str) -> Slot {
    let gateway = l.gateway_socket(tid);
    let r = l.post("/slots", &json!({"tid": tid, "token": TOKEN}));
    assert_eq!(r.status, 201, "{}\n{}", r.raw, l.stderr());
    assert_eq!(r.body["state"], "running", "{}", r.raw);
    Slot {
        status: r.body,
        _gateway: gateway,
    }
}

fn exec(l: &Launcher, tid: &str, command: &str) -> Value {
    exec_with(l, tid, json!({"command": command}))
}

fn exec_with(l: &Launcher, tid: &str, body: Value) -> Value {
    let r = l.post(&format!("/slots/{tid}/exec"), &body);
    assert_eq!(r.status, 200, "{}\n{}", r.raw, l.stderr());
    r.body
}

/// Runs `command` and asserts it exited 0; its stdout.
fn exec_ok(l: &Launcher, tid: &str, command: &str) -> String {
    let r = exec(l, tid, command);
    assert_eq!(r["returncode"], 0, "{command}: {r}");
    r["stdout"].as_str().unwrap().to_owned()
}

fn delete(l: &Launcher, tid: &str) -> Value {
    let r = l.request("DELETE", &format!("/slots/{tid}"), None);
    assert_eq!(r.status, 200, "{}\n{}", r.raw, l.stderr());
    r.body
}

/// Pids of live processes whose real uid is `uid`.
fn processes_of(uid: u32) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(status) = std::fs::read_to_string(e.path().join("status")) else {
            continue;
        };
        let zombie = status
            .lines()
            .any(|l| l.starts_with("State:") && l.contains('Z'));
        let owned = status.lines().any(|l| {
            l.strip_prefix("Uid:")
                .and_then(|r| r.split_whitespace().next())
                .is_some_and(|u| u == uid.to_string())
        });
        if owned && !zombie {
            out.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    out
}

fn slot_uid(l: &Launcher, tid: &str) -> u32 {
    exec_ok(l, tid, "id -u").trim().parse().unwrap()
}

#[test]
fn slot_serves_health_over_its_socket() {
    let l = launcher(66010);
    let slot = start(&l, "s-health");
    let socket = PathBuf::from(slot.status["socket"].as_str().unwrap());
    assert!(socket.starts_with(l.data.join("slots")), "{}", slot.status);
    // Reachable by root and the service group only.
    let meta = std::fs::metadata(socket.parent().unwrap()).unwrap();
    assert_eq!(meta.mode() & 0o007, 0, "{:o}", meta.mode());
    let slots_meta = std::fs::metadata(l.data.join("slots")).unwrap();
    assert_eq!(slots_meta.mode() & 0o007, 0);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let r = rt
        .block_on(agentbox_api::UnixClient::new(&socket).raw("GET", "/health", &[], String::new()))
        .unwrap();
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));
    let st = l.get("/status");
    assert_eq!(st.body["slots"][0]["tid"], "s-health", "{}", st.raw);
    let g = l.get("/slots/s-health");
    assert_eq!(g.body["state"], "running", "{}", g.raw);
    assert!(g.body["pid"].as_u64().is_some(), "{}", g.raw);
    let fin = delete(&l, "s-health");
    assert_eq!(fin["state"], "killed", "{fin}");
    assert!(!socket.exists());
    assert_eq!(l.get("/slots/s-health").code(), "unknown_slot");
}

#[test]
fn slot_has_no_network_but_loopback() {
    let l = launcher(66020);
    let _slot = start(&l, "s-net");
    let dev = exec_ok(&l, "s-net", "cat /proc/net/dev");
    let ifaces: Vec<&str> = dev
        .lines()
        .skip(2)
        .filter_map(|line| line.split(':').next())
        .map(str::trim)
        .collect();
    assert_eq!(ifaces, ["lo"], "{dev}");
    for addr in ["10.0.0.1", "192.168.1.1", "1.1.1.1"] {
        let r = exec(
            &l,
            "s-net",
            &format!(
                "python3 -c 'import socket; s=socket.socket(); s.settimeout(3); s.connect((\"{addr}\", 80))'"
            ),
        );
        assert_ne!(r["returncode"], 0, "{addr} reachable: {r}");
        assert!(
            r["stderr"].as_str().unwrap().contains("unreachable"),
            "{addr}: {r}"
        );
    }
    delete(&l, "s-net");
}

#[test]
fn slot_cannot_reach_the_hosts_loopback() {
    let l = launcher(66030);
    let _slot = start(&l, "s-lo");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let r = exec(
        &l,
        "s-lo",
        &format!(
            "python3 -c 'import socket; s=socket.socket(); s.settimeout(3); s.connect((\"127.0.0.1\", {port}))'"
        ),
    );
    assert_ne!(r["returncode"], 0, "{r}");
    assert!(r["stderr"].as_str().unwrap().contains("refused"), "{r}");
    assert!(
        listener.accept().is_err(),
        "the host listener got a connection"
    );
    delete(&l, "s-lo");
}

#[test]
fn slots_cannot_see_or_reach_each_others_sockets() {
    let l = launcher(66040);
    let _a = start(&l, "s-a");
    let b = start(&l, "s-b");
    let b_socket = b.status["socket"].as_str().unwrap().to_owned();
    // No socket of any slot anywhere in its filesystem.
    assert_eq!(
        exec_ok(
            &l,
            "s-a",
            "find / -path /proc -prune -o -type s -print 2>/dev/null; true"
        ),
        ""
    );
    let r = exec(
        &l,
        "s-a",
        &format!(
            "ls -d {data}/slots; test -e {b_socket} && echo visible; \
             python3 -c 'import socket; s=socket.socket(socket.AF_UNIX); s.connect(\"{b_socket}\")'",
            data = l.data.display()
        ),
    );
    assert_ne!(r["returncode"], 0, "{r}");
    assert!(!r["stdout"].as_str().unwrap().contains("visible"), "{r}");
    assert!(
        r["stderr"].as_str().unwrap().contains("No such file"),
        "{r}"
    );
    // A slot's uid cannot reach the host's slots/ either (other slots' uids included).
    let a_uid = slot_uid(&l, "s-a");
    let probe = std::process::Command::new("setpriv")
        .args([
            format!("--reuid={a_uid}"),
            format!("--regid={a_uid}"),
            "--clear-groups".to_owned(),
            "test".to_owned(),
            "-e".to_owned(),
            b_socket.clone(),
        ])
        .status()
        .unwrap();
    assert!(!probe.success(), "slot s-a's uid sees {b_socket}");
    delete(&l, "s-a");
    delete(&l, "s-b");
}

#[test]
fn slots_cannot_see_or_signal_other_processes() {
    let l = launcher(66050);
    let _a = start(&l, "s-pa");
    let b = start(&l, "s-pb");
    let b_pid = b.status["pid"].as_u64().unwrap();
    let me = std::process::id();
    let out = exec_ok(
        &l,
        "s-pa",
        "for p in /proc/[0-9]*; do printf '%s ' \"${p#/proc/}\"; tr '\\0' ' ' < $p/cmdline; echo; done",
    );
    assert!(!out.contains("blackbox-server"), "{out}");
    assert!(!out.contains("agentbox-launcher"), "{out}");
    assert!(out.lines().count() <= 4, "{out}");
    for pid in [b_pid, u64::from(me), 1] {
        let r = exec(&l, "s-pa", &format!("kill -0 {pid}"));
        // pid 1 of the exec sandbox is bwrap's init, not the host's; the others are absent.
        if pid != 1 {
            assert_ne!(r["returncode"], 0, "pid {pid} signalled: {r}");
        }
    }
    // The server's sandbox shows the same isolation on the host: a pid namespace of its own.
    let host_ns = std::fs::read_link("/proc/self/ns/pid").unwrap();
    let children = eventually("the slot's sandbox children", || {
        let kids = std::fs::read_to_string(format!("/proc/{b_pid}/task/{b_pid}/children")).ok()?;
        let first = kids.split_whitespace().next()?.to_owned();
        Some(first)
    });
    let ns = std::fs::read_link(format!("/proc/{children}/ns/pid")).unwrap();
    assert_ne!(ns, host_ns);
    let net = std::fs::read_link(format!("/proc/{children}/ns/net")).unwrap();
    assert_ne!(net, std::fs::read_link("/proc/self/ns/net").unwrap());
    delete(&l, "s-pa");
    delete(&l, "s-pb");
}

#[test]
fn clients_are_there_read_only_and_runnable() {
    let l = launcher(66060);
    let _slot = start(&l, "s-cli");
    let out = exec_ok(
        &l,
        "s-cli",
        "for v in OPENCODE_BIN OPENCLAW_BIN CLAUDE_CODE_BIN CODEX_BIN; do \
           eval p=\\$$v; test -x \"$p\" || { echo \"$v=$p not executable\"; exit 1; }; echo \"$v=$p\"; done; \
           \"$OPENCODE_BIN\" --version",
    );
    assert!(out.contains("OPENCODE_BIN=/opt/clients/"), "{out}");
    let r = exec(&l, "s-cli", "touch /opt/clients/x");
    assert_ne!(r["returncode"], 0, "{r}");
    assert!(r["stderr"].as_str().unwrap().contains("Read-only"), "{r}");
    let r = exec(&l, "s-cli", "\"$CODEX_BIN\" --version");
    assert_eq!(r["returncode"], 0, "{r}");
    delete(&l, "s-cli");
}

#[test]
fn exec_runs_in_the_workspace_as_the_slot_uid_and_times_out() {
    let l = launcher(66070);
    let _slot = start(&l, "s-exec");
    let out = exec_ok(&l, "s-exec", "pwd; id -u; mkdir -p sub/dir");
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("/workspace"));
    let uid: u32 = lines.next().unwrap().parse().unwrap();
    let first = 66070;
    assert!((first..first + AGENT_UID_COUNT).contains(&uid), "{uid}");
    let r = exec_with(&l, "s-exec", json!({"command": "pwd", "cwd": "sub/dir"}));
    assert_eq!(r["stdout"], "/workspace/sub/dir\n", "{r}");
    let r = exec_with(
        &l,
        "s-exec",
        json!({"command": "cat", "stdin": "from stdin"}),
    );
    assert_eq!(r["stdout"], "from stdin", "{r}");
    let r = exec_with(
        &l,
        "s-exec",
        json!({"command": "sleep 4711 & sleep 4712", "timeout_s": 1}),
    );
    assert_eq!(r["timed_out"], true, "{r}");
    assert!(r["returncode"].is_null(), "{r}");
    eventually("the timed-out command is gone", || {
        agentbox_tests::harness::launcher::processes_with("sleep 471")
            .is_empty()
            .then_some(())
    });
    // The slot survives its command's timeout.
    assert_eq!(l.get("/slots/s-exec").body["state"], "running");
    let r = l.post(
        "/slots/s-exec/exec",
        &json!({"command": "true", "cwd": "../etc"}),
    );
    assert_eq!(r.code(), "invalid_path", "{}", r.raw);
    delete(&l, "s-exec");
}

fn b64(s: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(s)
}

#[test]
fn files_round_trip_and_refuse_symlinks_and_escapes() {
    let l = launcher(66080);
    let _slot = start(&l, "s-files");
    let uid = slot_uid(&l, "s-files");
    for path in ["deep/er/a.txt", "/home/agent/h.txt", "/tmp/t.txt"] {
        let w = l.post(
            "/slots/s-files/files/write",
            &json!({"path": path, "content_base64": b64(b"hello\n")}),
        );
        assert_eq!(w.status, 200, "{}", w.raw);
        assert_eq!(w.body["bytes"], 6);
        let r = l.post("/slots/s-files/files/read", &json!({"path": path}));
        assert_eq!(r.status, 200, "{}", r.raw);
        assert_eq!(r.body["content_base64"], b64(b"hello\n"), "{}", r.raw);
    }
    let a = l.post(
        "/slots/s-files/files/write",
        &json!({"path": "deep/er/a.txt", "content_base64": b64(b"more"), "append": true}),
    );
    assert_eq!(a.status, 200, "{}", a.raw);
    let r = l.post(
        "/slots/s-files/files/read",
        &json!({"path": "/workspace/deep/er/a.txt", "max_bytes": 3}),
    );
    assert_eq!(r.body["content_base64"], b64(b"hel"), "{}", r.raw);
    assert_eq!(r.body["truncated"], true);
    assert_eq!(r.body["size"], 10);
    // Written as the slot's uid, seen inside.
    let out = exec_ok(
        &l,
        "s-files",
        "stat -c %u deep deep/er deep/er/a.txt /home/agent/h.txt; cat deep/er/a.txt",
    );
    assert_eq!(out, format!("{uid}\n{uid}\n{uid}\n{uid}\nhello\nmore"));
    // Symlinks planted by the slot are not followed, for reading or writing.
    exec_ok(
        &l,
        "s-files",
        "ln -s /etc/passwd link; ln -s / rootlink; ln -s /home/agent homelink; mkfifo fifo",
    );
    for path in ["link", "rootlink/etc/passwd", "homelink/h.txt", "fifo"] {
        let r = l.post("/slots/s-files/files/read", &json!({"path": path}));
        assert_eq!(r.status, 400, "read {path}: {}", r.raw);
        assert_eq!(r.code(), "unsafe_path", "{}", r.raw);
        let w = l.post(
            "/slots/s-files/files/write",
            &json!({"path": path, "content_base64": b64(b"x")}),
        );
        assert_eq!(w.code(), "unsafe_path", "write {path}: {}", w.raw);
    }
    assert_eq!(
        exec_ok(&l, "s-files", "readlink link; test -p fifo && echo fifo"),
        "/etc/passwd\nfifo\n"
    );
    for path in [
        "/etc/passwd",
        "../x",
        "/workspace/../etc/passwd",
        "/",
        "/workspace",
        "a//b",
    ] {
        let r = l.post("/slots/s-files/files/read", &json!({"path": path}));
        assert_eq!(r.code(), "invalid_path", "read {path}: {}", r.raw);
        let w = l.post(
            "/slots/s-files/files/write",
            &json!({"path": path, "content_base64": b64(b"x")}),
        );
        assert_eq!(w.code(), "invalid_path", "write {path}: {}", w.raw);
    }
    let r = l.post("/slots/s-files/files/read", &json!({"path": "missing"}));
    assert_eq!(r.status, 404, "{}", r.raw);
    delete(&l, "s-files");
}

/// Writes into one directory at once each land whole under their own name: each write's
/// temporary file is its own (they all used one name per launcher, so one write could rename
/// another's half-written file over its target, and the other failed).
#[test]
fn concurrent_writes_into_one_directory_each_land_whole() {
    let l = launcher(66130);
    let _slot = start(&l, "s-writes");
    let content = |i: usize| format!("{i}:").repeat(5_000 + i * 500);
    std::thread::scope(|scope| {
        let writes: Vec<_> = (0..16)
            .map(|i| {
                let l = &l;
                scope.spawn(move || {
                    l.post(
                        "/slots/s-writes/files/write",
                        &json!({"path": format!("out/f{i}"), "content_base64": b64(content(i).as_bytes())}),
                    )
                })
            })
            .collect();
        for (i, w) in writes.into_iter().enumerate() {
            let w = w.join().unwrap();
            assert_eq!(w.status, 200, "write {i}: {}", w.raw);
        }
    });
    for i in 0..16 {
        let r = l.post(
            "/slots/s-writes/files/read",
            &json!({"path": format!("out/f{i}"), "max_bytes": 1 << 20}),
        );
        assert_eq!(r.status, 200, "{}", r.raw);
        assert!(
            r.body["content_base64"] == b64(content(i).as_bytes()),
            "out/f{i} holds another write's content: size {} truncated {}",
            r.body["size"],
            r.body["truncated"]
        );
    }
    let names = exec_ok(&l, "s-writes", "ls -A out | wc -l");
    assert_eq!(names.trim(), "16", "no temporary file left");
    delete(&l, "s-writes");
}

fn files_under(dir: &Path) -> Vec<String> {
    walkdir::WalkDir::new(dir)
        .min_depth(1)
        .into_iter()
        .flatten()
        .map(|e| e.path().display().to_string())
        .collect()
}

#[test]
fn delete_leaves_nothing_and_frees_the_uid() {
    let l = launcher(66090);
    let _slot = start(&l, "s-del");
    let uid = slot_uid(&l, "s-del");
    assert!(
        !processes_of(uid).is_empty(),
        "the server runs as the slot uid"
    );
    exec_ok(
        &l,
        "s-del",
        "mkdir -p a/b && echo x > a/b/f && echo y > /home/agent/.h && echo z > /tmp/t",
    );
    // The token travels in memfds only.
    assert_eq!(cmdlines_containing(TOKEN), Vec::<String>::new());
    let fin = delete(&l, "s-del");
    assert_eq!(fin["state"], "killed", "{fin}");
    assert!(fin["pid"].is_null(), "{fin}");
    assert_eq!(files_under(&l.data.join("slots")), Vec::<String>::new());
    // The staging mount points live on a tmpfs in the launcher's own mount namespace: look
    // through its root.
    let staging = PathBuf::from(format!("/proc/{}/root", l.pid()))
        .join(l.data.join("mnt").strip_prefix("/").unwrap());
    assert!(staging.is_dir(), "{}", staging.display());
    assert_eq!(files_under(&staging), Vec::<String>::new());
    assert_eq!(processes_of(uid), Vec::<String>::new());
    assert!(l.cgroup_dirs().is_empty(), "{:?}", l.cgroup_dirs());
    // The lowest free uid again.
    let _again = start(&l, "s-del2");
    assert_eq!(slot_uid(&l, "s-del2"), uid);
    delete(&l, "s-del2");
}

/// A slot is held to `launcher.limits.disk_mb` (plus its capped logs) like a run's workspace:
/// filling its `/tmp` (on disk, under `slots/<tid>`) stops it as `disk_exceeded`, and its files
/// go with DELETE.
#[test]
fn a_slot_that_fills_its_disk_is_stopped() {
    let l = launcher_with(66140, |o| o.disk_mb = 4);
    let _slot = start(&l, "s-disk");
    // 4 MiB + 4 logs of 64 KiB allowed; each file under the 4 MiB file-size limit.
    exec_ok(
        &l,
        "s-disk",
        "for i in 1 2 3; do head -c 3000000 /dev/zero > /tmp/fill$i; done",
    );
    let ended = eventually("the slot is stopped for its disk", || {
        let g = l.get("/slots/s-disk");
        (g.body["state"] == "disk_exceeded").then_some(g.body)
    });
    assert!(ended["pid"].is_null(), "{ended}");
    let fin = delete(&l, "s-disk");
    assert_eq!(fin["state"], "disk_exceeded", "{fin}");
    assert_eq!(files_under(&l.data.join("slots")), Vec::<String>::new());
}

#[test]
fn timeout_ends_the_slot_which_keeps_its_record_until_delete() {
    let l = launcher(66120);
    let _gw = l.gateway_socket("s-time");
    let r = l.post(
        "/slots",
        &json!({"tid": "s-time", "token": TOKEN, "timeout_s": 2}),
    );
    assert_eq!(r.status, 201, "{}\n{}", r.raw, l.stderr());
    let ended = eventually("the slot times out", || {
        let g = l.get("/slots/s-time");
        (g.body["state"] == "timed_out").then_some(g.body)
    });
    assert_eq!(ended["timed_out"], true, "{ended}");
    assert!(ended["pid"].is_null(), "{ended}");
    // Its files stay until DELETE, and the tid cannot be taken over meanwhile.
    assert!(l.data.join("slots/s-time/workspace").is_dir());
    let again = l.post("/slots", &json!({"tid": "s-time", "token": TOKEN}));
    assert_eq!(again.status, 409, "{}", again.raw);
    assert_eq!(
        l.post("/slots/s-time/exec", &json!({"command": "true"}))
            .status,
        409
    );
    let fin = delete(&l, "s-time");
    assert_eq!(fin["state"], "timed_out", "{fin}");
    assert_eq!(files_under(&l.data.join("slots")), Vec::<String>::new());
}

#[test]
fn bad_slot_requests_get_typed_errors() {
    let l = launcher(66100);
    let r = l.post("/slots", &json!({"tid": "s-nogw", "token": TOKEN}));
    assert_eq!(r.status, 404, "{}", r.raw);
    let _gw = l.gateway_socket("s-bad");
    for (env, code) in [
        (json!({"BBS_UNIX_SOCKET": "/x"}), "invalid_env"),
        (json!({"BBS_ROUTER_TOKEN": "t"}), "invalid_env"),
        (json!({"LD_PRELOAD": "/x"}), "invalid_env"),
    ] {
        let r = l.post(
            "/slots",
            &json!({"tid": "s-bad", "token": TOKEN, "env": env}),
        );
        assert_eq!(r.code(), code, "{}", r.raw);
    }
    let r = l.post("/slots", &json!({"tid": "S bad", "token": TOKEN}));
    assert_eq!(r.code(), "invalid_tid", "{}", r.raw);
    let r = l.post("/slots", &json!({"tid": "s-bad", "token": "a b"}));
    assert_eq!(r.code(), "invalid_token", "{}", r.raw);
    assert_eq!(l.get("/slots/nope").code(), "unknown_slot");
    assert_eq!(
        l.post("/slots/nope/exec", &json!({"command": "true"}))
            .code(),
        "unknown_slot"
    );
    let _slot = start(&l, "s-bad");
    let r = l.post("/slots", &json!({"tid": "s-bad", "token": TOKEN}));
    assert_eq!(r.status, 409, "{}", r.raw);
    // An agent of the same tid is refused too: a tid runs one thing at a time.
    l.workspace("s-bad");
    let r = l.post(
        "/checks",
        &json!({"tid": "s-bad", "command": "true", "timeout_s": 5}),
    );
    assert_eq!(r.status, 409, "{}", r.raw);
    delete(&l, "s-bad");
}

#[test]
fn a_restarted_launcher_cleans_up_the_slots_of_the_previous_one() {
    let mut l = launcher(66110);
    let _slot = start(&l, "s-crash");
    let uid = slot_uid(&l, "s-crash");
    exec_ok(&l, "s-crash", "echo x > f");
    l.crash();
    l.spawn();
    assert_eq!(files_under(&l.data.join("slots")), Vec::<String>::new());
    assert_eq!(processes_of(uid), Vec::<String>::new());
    assert_eq!(l.get("/slots/s-crash").code(), "unknown_slot");
    let _again = start(&l, "s-crash");
    assert_eq!(slot_uid(&l, "s-crash"), uid);
    delete(&l, "s-crash");
}
