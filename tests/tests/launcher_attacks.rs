//! Attacks on the launcher from a hostile agent and hostile local users (issue 9): what an
//! agent leaves in its workspace, which identity it runs as, what of it the host can see. Each
//! test is the adversarial proof of one class, run as root against the real launcher.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use agentbox_tests::harness::launcher::{AGENT_UID, Launcher, Options, SERVICE_UID};
use serde_json::{Value, json};

/// Every entry under `top`, not following symlinks.
fn every_entry(top: &Path) -> Vec<(PathBuf, std::fs::Metadata)> {
    let mut out = Vec::new();
    let mut todo = vec![top.to_path_buf()];
    while let Some(p) = todo.pop() {
        let m = std::fs::symlink_metadata(&p).unwrap();
        if m.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                todo.push(e.unwrap().path());
            }
        }
        out.push((p, m));
    }
    out
}

fn start_agent(l: &Launcher, tid: &str, script: &str) -> Value {
    let r = l.post(
        "/agents",
        &json!({"tid": tid, "model": "m1", "cmd": ["claude", script], "timeout_s": 300,
                "token": "task-token-123"}),
    );
    assert_eq!(r.status, 201, "{}\n{}", r.raw, l.stderr());
    r.body
}

fn wait_agent(l: &Launcher, tid: &str) -> Value {
    let r = l.get(&format!("/agents/{tid}?wait=1"));
    assert_eq!(r.status, 200, "{}", r.raw);
    r.body
}

/// Hole 1: an agent plants a setuid file, a hard-linked setuid file, a world-writable
/// directory, a setuid file nested deeper than the walk's depth limit, and 100k hard-linked
/// entries. After hand-back nothing in the workspace is setuid/setgid, world-writable or the
/// agent's, and the report of what was removed stays short.
#[test]
fn hand_back_leaves_no_setuid_world_writable_or_agent_owned_entry() {
    let l = Launcher::start(Options {
        pids: 256,
        ..Options::default()
    });
    let ws = l.workspace("suid1");
    let _gw = l.gateway_socket("suid1");
    let script = r#"set -e
cp /bin/true suid; chmod 4755 suid
cp /bin/true linked; chmod 6755 linked; ln linked linked-too
mkdir open; chmod 777 open; : > open/ww; chmod 666 open/ww
d=deep; for i in $(seq 300); do d=$d/d; done
mkdir -p "$d"; cp /bin/true "$d/suid"; chmod 4755 "$d/suid"; chmod 777 "$d"
mkdir many
perl -e 'for $i (1..50000) { open F, ">many/$i" or die; close F; chmod 04755, "many/$i"; link "many/$i", "many/$i-b" or die }'
echo planted"#;
    start_agent(&l, "suid1", script);
    let v = wait_agent(&l, "suid1");
    assert_eq!(v["exit_code"], 0, "{v}");
    assert!(v["stdout"].as_str().unwrap().contains("planted"), "{v}");
    let mut bad = Vec::new();
    let entries = every_entry(&ws);
    for (p, m) in &entries {
        let wrong_owner = m.uid() != SERVICE_UID || m.gid() == AGENT_UID;
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
