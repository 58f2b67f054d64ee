//! The hand-over race (attack catalogue §10 item 3): while sandboxes start, a thread swaps
//! `tasks/<tid>/workspace` with `renameat2(RENAME_EXCHANGE)` in a tight loop, alternately with a
//! symlink to a host directory of root-owned canary files and with a real directory the service
//! user does not own. Over 1,000 starts (checks and agents, which share the hand-over and the
//! mount): no canary changes owner or mode, every refused start is a clean `unsafe_path`, and
//! every sandbox that ran saw exactly the validated workspace at `/workspace` (device and inode
//! printed inside equal the real workspace's) and handed it back.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use agentbox_tests::harness::launcher::{Launcher, Options, SERVICE_UID, chown};
use rustix::fs::{AtFlags, Mode, OFlags, RenameFlags, StatxFlags};
use serde_json::json;

const TRIES: usize = 1000;
const TID: &str = "race";
/// A uid that is neither root, the service nor the agent.
const OTHER_UID: u32 = 4242;
/// What each sandbox runs: the identity of what it sees at /workspace, and its contents.
const PROBE: &str = "stat -c '%d:%i' /workspace; ls -A /workspace";

/// Handles on the watched objects, so they are found whatever their names are swapped to.
fn handles(paths: &[PathBuf]) -> Vec<(PathBuf, OwnedFd)> {
    paths
        .iter()
        .map(|p| {
            let fd = rustix::fs::open(
                p,
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .unwrap();
            (p.clone(), fd)
        })
        .collect()
}

/// (uid, gid, mode) of every watched object.
fn owners(watched: &[(PathBuf, OwnedFd)]) -> BTreeMap<PathBuf, (u32, u32, u32)> {
    watched
        .iter()
        .map(|(p, fd)| {
            let st =
                rustix::fs::statx(fd, "", AtFlags::EMPTY_PATH, StatxFlags::BASIC_STATS).unwrap();
            (p.clone(), (st.stx_uid, st.stx_gid, u32::from(st.stx_mode)))
        })
        .collect()
}

/// A directory full of canaries: root-owned files (one setuid, which a walk would strip), one
/// owned by another uid, a subdirectory with more.
fn canaries(dir: &Path) -> Vec<PathBuf> {
    std::fs::create_dir_all(dir.join("sub")).unwrap();
    let mut paths = vec![dir.to_path_buf(), dir.join("sub")];
    for i in 0..20 {
        let p = dir.join(format!("canary-{i}"));
        std::fs::write(&p, "canary").unwrap();
        paths.push(p);
    }
    let suid = dir.join("canary-suid");
    std::fs::write(&suid, "#!/bin/true\n").unwrap();
    std::fs::set_permissions(&suid, std::fs::Permissions::from_mode(0o4755)).unwrap();
    paths.push(suid);
    let other = dir.join("canary-other");
    std::fs::write(&other, "canary").unwrap();
    chown(&other, OTHER_UID);
    paths.push(other);
    let deep = dir.join("sub/canary-deep");
    std::fs::write(&deep, "canary").unwrap();
    paths.push(deep);
    paths
}

#[test]
fn swapping_the_workspace_never_redirects_a_chown_or_a_mount() {
    let l = Launcher::start(Options::default());
    let ws = l.workspace(TID);
    let _gw = l.gateway_socket(TID);
    std::fs::write(ws.join("inside"), "x").unwrap();
    chown(&ws.join("inside"), SERVICE_UID);
    let meta = std::fs::metadata(&ws).unwrap();
    let validated = format!("{}:{}", meta.dev(), meta.ino());
    // The real workspace, wherever its name is at the moment.
    let ws_handle = std::fs::File::open(&ws).unwrap();

    let task = l.data.join("tasks").join(TID);
    let host = l.base.join("host-canaries");
    let mut watched = canaries(&host);
    symlink(&host, task.join("link")).unwrap();
    watched.push(task.join("link"));
    // A real directory, root-owned: a swap target that passes every check but ownership.
    let foreign = task.join("foreign");
    watched.extend(canaries(&foreign));
    let watched = handles(&watched);
    let before = owners(&watched);

    let stop = Arc::new(AtomicBool::new(false));
    let swapper = {
        let stop = Arc::clone(&stop);
        let task = task.clone();
        std::thread::spawn(move || {
            let dir = rustix::fs::open(
                &task,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
            .unwrap();
            let mut swaps = 0_u64;
            while !stop.load(Ordering::Relaxed) {
                let decoy = if swaps.is_multiple_of(2) {
                    "link"
                } else {
                    "foreign"
                };
                // Swap in, swap back: the name is the decoy about half of the time.
                for _ in 0..2 {
                    rustix::fs::renameat_with(
                        dir.as_fd(),
                        "workspace",
                        dir.as_fd(),
                        decoy,
                        RenameFlags::EXCHANGE,
                    )
                    .unwrap();
                }
                swaps += 1;
            }
            swaps
        })
    };

    let (mut ran, mut refused) = (0_usize, 0_usize);
    for i in 0..TRIES {
        let (status, code, stdout) = if i.is_multiple_of(2) {
            let r = l.check(TID, PROBE);
            if r.status == 200 {
                assert_eq!(r.body["exit_code"], 0, "try {i}: {}", r.raw);
            }
            (r.status, r.code().to_owned(), r.body["stdout"].clone())
        } else {
            let r = l.post(
                "/agents",
                &json!({"tid": TID, "model": "m1", "cmd": ["claude", PROBE], "timeout_s": 300}),
            );
            if r.status == 201 {
                let done = l.get(&format!("/agents/{TID}?wait=1"));
                assert_eq!(done.body["state"], "exited", "try {i}: {}", done.raw);
                let deleted = l.request("DELETE", &format!("/agents/{TID}"), None);
                assert_eq!(deleted.status, 200, "try {i}: {}", deleted.raw);
                assert_eq!(done.body["exit_code"], 0, "try {i}: {}", done.raw);
                (200, String::new(), done.body["stdout"].clone())
            } else {
                (r.status, r.code().to_owned(), r.body.clone())
            }
        };
        match status {
            200 => {
                ran += 1;
                assert_eq!(
                    stdout.as_str().unwrap(),
                    format!("{validated}\ninside\n"),
                    "try {i}: the sandbox saw another directory at /workspace"
                );
            }
            400 => {
                refused += 1;
                assert_eq!(code, "unsafe_path", "try {i}: {stdout}");
            }
            other => panic!("try {i}: status {other}: {stdout}\n{}", l.stderr()),
        }
        assert_eq!(owners(&watched), before, "try {i}: a canary changed");
        let now = ws_handle.metadata().unwrap();
        assert_eq!(
            (now.uid(), now.gid()),
            (SERVICE_UID, SERVICE_UID),
            "try {i}: the workspace was not handed back"
        );
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = swapper.join().unwrap();
    assert_eq!(
        std::fs::metadata(&ws).unwrap().ino(),
        meta.ino(),
        "every swap was undone"
    );
    // Both outcomes happened, so both paths were raced (with a tight loop, each is all but
    // certain within 1,000 tries).
    assert!(ran > 0 && refused > 0, "ran {ran}, refused {refused}");
    eprintln!("{TRIES} tries: {ran} ran, {refused} refused, {swaps} swap cycles");
    assert!(l.cgroup_dirs().is_empty());
}
