//! Attacks on the launcher from a hostile agent and hostile local users (issue 9): what an
//! agent leaves in its workspace, which identity it runs as, what of it the host can see. Each
//! test is the adversarial proof of one class, run as root against the real launcher.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use agentbox_tests::harness::launcher::{
    AGENT_UID, AGENT_UID_COUNT, Launcher, Options, SERVICE_UID, eventually, processes_with,
};
use serde_json::{Value, json};

/// Every entry under `top` (`top` included, symlinks not followed), with its metadata.
fn every_entry(top: &Path) -> Vec<(PathBuf, std::fs::Metadata)> {
    let entries = walkdir::WalkDir::new(top).into_iter().map(Result::unwrap);
    entries
        .map(|e| (e.path().to_path_buf(), e.metadata().unwrap()))
        .collect()
}

fn start_agent(l: &Launcher, tid: &str, script: &str) -> Value {
    l.start_agent(
        tid,
        json!({"cmd": ["claude", script], "token": "task-token-123"}),
    )
}

/// Hole 1: an agent plants a setuid file, a hard-linked setuid file, a world-writable
/// directory, a setuid file nested deeper than the walk's depth limit, and 100k hard-linked
/// entries. After hand-back nothing in the workspace is setuid/setgid, world-writable or the
/// agent's, and the report of what was removed stays short. The setuid files are made the one
/// way the seccomp filter leaves (`openat2`, whose mode it cannot read; `chmod` and the rest
/// refuse the bits), so they are empty: writing to one would clear the bits.
#[test]
fn hand_back_leaves_no_setuid_world_writable_or_agent_owned_entry() {
    let l = Launcher::start_with(|o| o.pids = 256);
    let ws = l.workspace("suid1");
    let _gw = l.gateway_socket("suid1");
    let script = r#"set -e
# plant PATH MODE: an empty file made by openat2 with MODE
plant() { perl -MPOSIX -e 'my ($p, $how) = ($ARGV[0], pack("QQQ", 0101, oct($ARGV[1]), 0)); my $fd = syscall(437, -100, $p, $how, 24); die "openat2: $!" if $fd < 0; POSIX::close($fd)' "$1" "$2"; }
plant suid 4755
plant linked 6755; ln linked linked-too
mkdir open; chmod 777 open; : > open/ww; chmod 666 open/ww
d=deep; for i in $(seq 300); do d=$d/d; done
mkdir -p "$d"; plant "$d/suid" 4755; chmod 777 "$d"
mkdir many
perl -MPOSIX -e 'my $how = pack("QQQ", 0101, 04755, 0); for $i (1..50000) { my $p = "many/$i"; my $fd = syscall(437, -100, $p, $how, 24); die "openat2: $!" if $fd < 0; POSIX::close($fd); link $p, "$p-b" or die }'
echo planted"#;
    start_agent(&l, "suid1", script);
    let v = l.wait_agent("suid1");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert!(v["stdout"].as_str().unwrap().contains("planted"), "{v}");
    let mut bad = Vec::new();
    let entries = every_entry(&ws);
    for (p, m) in &entries {
        let agent_range = AGENT_UID..AGENT_UID + AGENT_UID_COUNT;
        let wrong_owner = m.uid() != SERVICE_UID || agent_range.contains(&m.gid());
        let dangerous = !m.file_type().is_symlink() && m.mode() & 0o6002 != 0;
        if wrong_owner || dangerous {
            bad.push(format!("{p:?} {}:{} {:o}", m.uid(), m.gid(), m.mode()));
        }
    }
    assert!(
        bad.is_empty(),
        "{} bad entries, e.g. {:?}",
        bad.len(),
        &bad[..bad.len().min(5)]
    );
    assert!(ws.join("suid").exists());
    // Whatever was removed is reported, briefly.
    let error = v["error"].as_str().unwrap_or("");
    assert!(error.contains("more"), "{error}");
    assert!(error.len() < 8192, "report of {} bytes", error.len());
}

/// Runs `cmd` on the host as `uid:gid` (no supplementary groups); whether it succeeded.
fn as_identity(uid: u32, gid: u32, cmd: &str) -> bool {
    std::process::Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={gid}"),
            "--clear-groups",
            "/bin/sh",
            "-c",
            cmd,
        ])
        .stderr(std::process::Stdio::null())
        .status()
        .unwrap()
        .success()
}

/// The uid, gid and host pid of the running agent whose script sleeps `marker`.
fn agent_identity(l: &Launcher, tid: &str, marker: &str) -> (u32, u32, u32) {
    let pid: u32 = eventually("the agent sleeps", || {
        processes_with(&format!("sleep {marker}"))
            .first()
            .map(|p| p.split(':').next().unwrap().parse().unwrap())
    });
    let st = std::fs::metadata(format!("/proc/{pid}")).unwrap();
    let out = l.get(&format!("/agents/{tid}")).body;
    let ids = out["stdout"].as_str().unwrap_or("").to_owned();
    assert!(ids.contains(&st.uid().to_string()), "{ids} vs {}", st.uid());
    (st.uid(), st.gid(), pid)
}

/// Hole 2: two agents running at the same time have different uids from the range, and the
/// identity of one can neither signal the other's process, read its environment, nor write
/// its files; a uid serves a new run only once its run was handed back.
#[test]
fn each_run_has_its_own_agent_uid() {
    let l = Launcher::start(Options::default());
    let marker = |n: u32| format!("{}", 700_000 + 10 * std::process::id() % 100_000 + n);
    let script = |n: u32| {
        format!(
            "echo \"ids $(id -u) $(id -g)\"; echo mine > own; chmod 644 own; exec sleep {}",
            marker(n)
        )
    };
    let mut ids = Vec::new();
    for (n, tid) in [(1, "uida"), (2, "uidb")] {
        l.workspace(tid);
        let _gw = l.gateway_socket(tid);
        start_agent(&l, tid, &script(n));
        ids.push(agent_identity(&l, tid, &marker(n)));
    }
    let ((ua, ga, _pa), (ub, gb, pb)) = (ids[0], ids[1]);
    let range = AGENT_UID..AGENT_UID + AGENT_UID_COUNT;
    assert!(range.contains(&ua) && range.contains(&ub), "{ua} {ub}");
    assert_ne!(ua, ub);
    assert_ne!(ga, gb);
    // What A's identity can do to B (A's identity is the host uid A's sandbox runs as).
    assert!(
        !as_identity(ua, ga, &format!("kill -0 {pb}")),
        "A signals B"
    );
    assert!(
        !as_identity(ua, ga, &format!("cat /proc/{pb}/environ >/dev/null")),
        "A reads B's environment"
    );
    let b_file = l.data.join("tasks/uidb/workspace/own");
    eventually("B wrote its file", || b_file.exists().then_some(()));
    assert!(
        !as_identity(ua, ga, &format!("echo x >> {}", b_file.display())),
        "A writes B's file"
    );
    // The check itself can fail: B's identity can signal its own process.
    assert!(as_identity(ub, gb, &format!("kill -0 {pb}")));

    // A third run while both run gets a third uid; once A is handed back, A's uid is free.
    l.workspace("uidc");
    let r = l.check("uidc", "id -u");
    let uc: u32 = r.body["stdout"].as_str().unwrap().trim().parse().unwrap();
    assert!(uc != ua && uc != ub && range.contains(&uc), "{uc}");
    let r = l.request("DELETE", "/agents/uida", None);
    assert_eq!(r.status, 200, "{}", r.raw);
    let r = l.check("uidc", "id -u");
    let reused: u32 = r.body["stdout"].as_str().unwrap().trim().parse().unwrap();
    assert_eq!(
        reused, ua,
        "the lowest free uid is A's, free once A was handed back"
    );
    assert_eq!(
        std::fs::metadata(l.data.join("tasks/uida/workspace/own"))
            .unwrap()
            .uid(),
        SERVICE_UID
    );
    let r = l.request("DELETE", "/agents/uidb", None);
    assert_eq!(r.status, 200, "{}", r.raw);
}
