//! Hole 7 (issue 9): a sandbox must not fill the host's disk through its workspace. An agent
//! and a check each write far past `launcher.limits.disk_mb`; the launcher stops them (watcher)
//! or their writes fail (project quota), reports `disk_exceeded`, and the workspace holds
//! little more than the limit. `GET /status` names the enforcement mode.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use agentbox_tests::harness::launcher::{Launcher, Options};
use serde_json::{Value, json};

const LIMIT_MB: u64 = 16;

/// Bytes allocated under `top` (blocks, each inode once is not needed: the scripts make no
/// hard links).
fn allocated(top: &Path) -> u64 {
    let mut total = 0;
    let mut todo = vec![top.to_path_buf()];
    while let Some(p) = todo.pop() {
        let m = std::fs::symlink_metadata(&p).unwrap();
        total += m.blocks() * 512;
        if m.is_dir() {
            for e in std::fs::read_dir(&p).unwrap() {
                todo.push(e.unwrap().path());
            }
        }
    }
    total
}

/// 1 GiB in 4 MiB files (each below the limit, so only the total can be caught), then a
/// marker that must never be reached.
const FILL: &str = "for i in $(seq 256); do head -c 4194304 /dev/zero > fill-$i || exit 9; done; echo filled-everything";

fn launcher() -> Launcher {
    Launcher::start(Options {
        disk_mb: LIMIT_MB,
        ..Options::default()
    })
}

fn assert_bounded(ws: &Path, v: &Value) {
    let used = allocated(ws);
    // The limit, plus what the run wrote within one pause of the watcher.
    assert!(
        used < 512 << 20,
        "{} MiB left in the workspace: {v}",
        used >> 20
    );
    assert!(
        !v["stdout"]
            .as_str()
            .unwrap_or("")
            .contains("filled-everything"),
        "{v}"
    );
}

#[test]
fn status_names_the_disk_enforcement_mode() {
    let l = launcher();
    let v = l.get("/status").body;
    let mode = v["disk"]["mode"].as_str().unwrap_or("");
    assert!(mode == "watcher" || mode == "project_quota", "{v}");
    assert_eq!(v["disk"]["limit_mb"], LIMIT_MB, "{v}");
    assert!(
        !v["disk"]["detail"].as_str().unwrap_or("").is_empty(),
        "{v}"
    );
}

#[test]
fn an_agent_writing_past_the_disk_limit_is_stopped() {
    let l = launcher();
    let v = l.run_agent("disk1", json!({"cmd": ["claude", FILL]}));
    let ws = l.data.join("tasks/disk1/workspace");
    assert_eq!(v["disk_exceeded"], true, "{v}\n{}", l.stderr());
    let mode = l.get("/status").body["disk"]["mode"].clone();
    if mode == "watcher" {
        assert_eq!(v["state"], "disk_exceeded", "{v}");
    } else {
        assert_eq!(v["exit_code"], 9, "the quota made a write fail: {v}");
    }
    assert_bounded(&ws, &v);
}

#[test]
fn a_check_writing_past_the_disk_limit_is_stopped() {
    let l = launcher();
    let v = l.probe("disk2", FILL);
    assert_eq!(v["disk_exceeded"], true, "{v}\n{}", l.stderr());
    assert_ne!(v["exit_code"], 0, "{v}");
    assert_bounded(&l.data.join("tasks/disk2/workspace"), &v);
}

/// No single file grows past the limit (RLIMIT_FSIZE, or the quota), and a sparse file's
/// apparent size costs nothing.
#[test]
fn one_big_file_is_capped_and_sparse_files_are_free() {
    let l = launcher();
    let ws = l.workspace("disk3");
    let r = l.check("disk3", "head -c 64M /dev/zero > one; echo rc=$?");
    let v = r.body;
    assert_eq!(v["disk_exceeded"], true, "{v}\n{}", l.stderr());
    let one = std::fs::metadata(ws.join("one")).unwrap().len();
    assert!(one <= LIMIT_MB << 20, "a {one}-byte file: {v}");
    // Ten sparse files of 15 MiB: 150 MiB apparent, nothing allocated.
    let v = l.probe(
        "disk4",
        "for i in $(seq 10); do truncate -s 15M sparse-$i || exit 1; done; echo sparse-ok",
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    assert!(v["stdout"].as_str().unwrap().contains("sparse-ok"), "{v}");
    assert_eq!(v["disk_exceeded"], false, "sparse files are not disk: {v}");
}

/// A workspace that comes in over the limit may be worked on and cleaned up, not grown.
#[test]
fn a_workspace_over_the_limit_can_shrink_but_not_grow() {
    let l = launcher();
    let ws = l.workspace("disk5");
    std::fs::write(ws.join("big"), vec![1u8; (LIMIT_MB as usize + 8) << 20]).unwrap();
    agentbox_tests::harness::launcher::chown_tree(
        &ws,
        agentbox_tests::harness::launcher::SERVICE_UID,
    );
    let v = l.check("disk5", "cat big > /dev/null && echo read-ok").body;
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["disk_exceeded"], false, "{v}");
    let v = l.check("disk5", FILL).body;
    assert_eq!(v["disk_exceeded"], true, "{v}");
    assert_bounded(&ws, &v);
    let v = l.check("disk5", "rm -f big fill-* && echo cleaned").body;
    assert_eq!(v["exit_code"], 0, "{v}");
    assert!(!ws.join("big").exists());
}

/// The verdict after a run that ended before the watcher looked (its first walk waits 100 ms)
/// comes from the hand-back's own count: what the agent left counts, a hard-linked inode once,
/// and what the hand-back removes counts too.
#[test]
fn the_final_verdict_counts_what_the_run_left_once() {
    let l = launcher();
    // 10 MiB under two names: under the limit, though the names add up to 20 MiB.
    let v = l.probe(
        "disk6",
        "head -c 10M /dev/zero > a && ln a b && echo linked",
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["disk_exceeded"], false, "one inode, counted once: {v}");
    // 12 MiB under one name and 8 MiB hard-linked: over the limit, though the hand-back removes
    // a name of the linked file.
    let v = l.probe(
        "disk7",
        "head -c 12M /dev/zero > a && head -c 8M /dev/zero > b && ln b c && echo written",
    );
    assert_eq!(v["exit_code"], 0, "{v}");
    assert_eq!(v["disk_exceeded"], true, "{v}");
    let ws = l.data.join("tasks/disk7/workspace");
    assert!(ws.join("b").exists() != ws.join("c").exists(), "{v}");
}

/// Files unlinked while held open are in no tree the watcher walks but still take disk: 56 MiB
/// in seven of them, held for 30 s. They count against the limit (or, under a quota, their
/// writes fail), so the run cannot fill the data dir's filesystem through them.
#[test]
fn files_unlinked_while_open_count_against_the_limit() {
    const HOLD: &str = "for i in 3 4 5 6 7 8 9; do eval \"exec $i>held-$i\"; rm held-$i; \
        head -c 8388608 /dev/zero >&$i || exit 9; done; sleep 30; echo held-everything";
    let l = launcher();
    let v = l.probe("disk-held", HOLD);
    let mode = l.get("/status").body["disk"]["mode"].clone();
    if mode == "watcher" {
        assert_eq!(v["disk_exceeded"], true, "{v}\n{}", l.stderr());
    } else {
        assert_eq!(v["exit_code"], 9, "the quota made a write fail: {v}");
    }
    assert!(
        !v["stdout"]
            .as_str()
            .unwrap_or("")
            .contains("held-everything"),
        "{v}"
    );
}
