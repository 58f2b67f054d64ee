//! `ChildSetup::spawn_exec` (the `clone(CLONE_VM | CLONE_VFORK)` spawn) in a process of its
//! own, so every zombie child this process has is one of its spawns: failed spawns, dropped
//! children and hundreds of concurrent spawns (while other tasks write the shared heap) leave
//! none behind, each child runs its own arguments, and a child subreaper reaping without pause
//! never takes a spawned child's status. One test, in phases: a second test would spawn
//! children of its own in parallel.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use agentbox_sandbox::proc::{ChildSetup, Exec};
use agentbox_sandbox::reaper;

fn sh(script: &str) -> Exec {
    Exec::new(Path::new("/bin/sh")).args(["-c", script])
}

/// This process's zombie children, from `/proc`.
fn zombies() -> Vec<u32> {
    let me = std::process::id().to_string();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            continue;
        };
        let mut fields = rest.split(' ');
        if fields.next() == Some("Z") && fields.next() == Some(me.as_str()) {
            found.push(pid);
        }
    }
    found
}

/// No zombie child, allowing a moment for children that are still exiting to be reaped by
/// their waiters.
fn assert_no_zombies(phase: &str) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let z = zombies();
        if z.is_empty() {
            return;
        }
        assert!(Instant::now() < deadline, "{phase}: zombies left {z:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn spawns_leave_nothing_behind_and_keep_their_own_status() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        // Failed spawns: a missing program, a failing setup step, refused arguments.
        for _ in 0..20 {
            assert!(
                ChildSetup::same_identity()
                    .spawn_exec(Exec::new(Path::new("/nope/x")))
                    .is_err()
            );
            assert!(
                ChildSetup::same_identity()
                    .keep(&[987_654])
                    .spawn_exec(sh("true"))
                    .is_err()
            );
            assert!(
                ChildSetup::same_identity()
                    .spawn_exec(sh("true").arg(OsStr::from_bytes(b"a\0b")))
                    .is_err()
            );
        }
        assert_no_zombies("failed spawns");

        // Children dropped unwaited, running or already ended: a later spawn reaps them.
        for script in ["true", "sleep 0.2"] {
            drop(ChildSetup::same_identity().spawn_exec(sh(script)).unwrap());
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let next = ChildSetup::same_identity().spawn_exec(sh("true")).unwrap();
        assert!(next.wait_with_output().await.unwrap().status.success());
        assert_no_zombies("dropped children");

        // 300 spawns at once from two worker threads while a task churns the heap.
        let churn = tokio::spawn(async {
            let mut kept = Vec::new();
            for i in 0..50_000_u32 {
                kept.push(vec![u8::try_from(i % 251).unwrap(); 64]);
                if kept.len() > 512 {
                    kept.clear();
                }
                if i % 64 == 0 {
                    tokio::task::yield_now().await;
                }
            }
        });
        let mut tasks = Vec::new();
        for i in 0..300_u32 {
            tasks.push(tokio::spawn(async move {
                let child = ChildSetup::same_identity()
                    .spawn_exec(sh(&format!("echo {i}; exit {}", i % 100)))
                    .unwrap();
                let out = child.wait_with_output().await.unwrap();
                assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{i}\n"));
                assert_eq!(out.status.code(), Some(i32::try_from(i % 100).unwrap()));
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        churn.await.unwrap();
        assert_no_zombies("concurrent spawns");

        // A subreaper reaping without pause while 300 children are spawned and exit: each
        // child's status stays its own waiter's (the spawn records it under the reaper's lock).
        reaper::become_subreaper().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let reaping = {
            let stop = Arc::clone(&stop);
            std::thread::spawn(move || {
                let mut stolen = 0;
                while !stop.load(Ordering::SeqCst) {
                    stolen += reaper::reap_adopted();
                    // std's mutex is not fair: a lock taken straight back starves the spawn.
                    std::thread::sleep(Duration::from_micros(100));
                }
                stolen
            })
        };
        for i in 0..300_u32 {
            let mut child = ChildSetup::same_identity()
                .spawn_exec(sh(&format!("exit {}", i % 7)))
                .unwrap();
            let status = child.wait().await.unwrap();
            assert_eq!(status.code(), Some(i32::try_from(i % 7).unwrap()));
        }
        stop.store(true, Ordering::SeqCst);
        assert_eq!(
            reaping.join().unwrap(),
            0,
            "the reaper took a spawned child"
        );
        assert_no_zombies("with the reaper");
    });
}
