//! The child subreaper (`agentbox_sandbox::reaper`) for real: orphans that leave a child's
//! tree in a session of their own are adopted, found, killed and reaped, and the reaper never
//! takes the exit status of a child spawned on purpose, even when it runs while children are
//! spawned and exit. Adoption is process-wide, so these tests live in a binary of their own
//! and take one lock each.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use agentbox_sandbox::proc::ChildSetup;
use agentbox_sandbox::reaper;
use tokio::io::AsyncReadExt;

static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The lock, and adoption on.
async fn adopting() -> tokio::sync::MutexGuard<'static, ()> {
    let one = ONE_AT_A_TIME.lock().await;
    reaper::become_subreaper().unwrap();
    one
}

/// Runs `script` with `sh -c` through the child setup; its stdout, once it exited with 0.
async fn run(script: &str) -> String {
    let mut cmd = tokio::process::Command::new("/bin/sh");
    cmd.args(["-c", script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped());
    let mut child = ChildSetup::same_identity()
        .new_session()
        .spawn(cmd)
        .unwrap();
    let mut out = String::new();
    let mut stdout = child.stdout.take().unwrap();
    stdout.read_to_string(&mut out).await.unwrap();
    let status = child.wait().await.unwrap();
    assert!(status.success(), "{script}: {status}");
    out
}

/// `ppid` and state of `pid`, or `None` when it is gone.
fn stat(pid: u32) -> Option<(u32, String)> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut f = s.rsplit_once(") ")?.1.split(' ');
    let state = f.next()?.to_owned();
    Some((f.next()?.parse().ok()?, state))
}

fn alive(pid: u32) -> bool {
    stat(pid).is_some_and(|(_, state)| state != "Z")
}

#[tokio::test]
async fn an_orphan_in_a_session_of_its_own_is_adopted_killed_and_reaped() {
    let _one = adopting().await;
    // The shell exits at once; its background job is in a session of its own, so neither
    // the shell's group nor a scan of its descendants finds it.
    let out = run("setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo $!").await;
    let orphan: u32 = out.trim().parse().unwrap();
    assert_eq!(
        stat(orphan).map(|(ppid, _)| ppid),
        Some(std::process::id()),
        "the orphan was not adopted"
    );
    // A nested one: an adopted shell with a child of its own.
    let out = run(
        "setsid sh -c 'sleep 1000 >/dev/null & echo $!; exec >/dev/null; wait' 2>/dev/null & sleep 0.2",
    )
    .await;
    let grandchild: u32 = out.trim().parse().unwrap();
    assert!(alive(grandchild));

    let killed = reaper::kill_adopted(Duration::from_secs(5)).await;
    assert!(killed >= 3, "killed {killed}");
    for pid in [orphan, grandchild] {
        assert!(stat(pid).is_none(), "{pid} survived: {:?}", stat(pid));
    }
}

#[tokio::test]
async fn an_adopted_orphan_that_exits_is_reaped() {
    let _one = adopting().await;
    let out = run("setsid sleep 0.1 </dev/null >/dev/null 2>&1 & echo $!").await;
    let orphan: u32 = out.trim().parse().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(orphan) {
        assert!(Instant::now() < deadline, "the orphan never exited");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(reaper::reap_adopted(), 1);
    assert!(stat(orphan).is_none(), "left a zombie");
}

#[tokio::test]
async fn the_reaper_never_takes_a_spawned_childs_status() {
    let _one = adopting().await;
    // A child that exited and is not waited for yet is a zombie of ours, like an adopted
    // orphan that exited: it stays for its own waiter.
    let mut child = ChildSetup::same_identity()
        .spawn(tokio::process::Command::new("/bin/true"))
        .unwrap();
    let pid = child.id().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(pid) {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(reaper::reap_adopted(), 0);
    assert!(child.wait().await.unwrap().success());

    // The race, 1,000 times: a thread reaping without pause while children are spawned,
    // exit at once and are waited for.
    let stop = Arc::new(AtomicBool::new(false));
    let hammer = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut rounds = 0_u64;
            while !stop.load(Ordering::SeqCst) {
                reaper::reap_adopted();
                rounds += 1;
                // A lock released and taken straight back starves the spawner (std's mutex is
                // not fair); a spawn, exit and wait takes about a millisecond, so reaps still
                // fall inside it many times over.
                std::thread::sleep(Duration::from_micros(100));
            }
            rounds
        })
    };
    for i in 0..1000 {
        let mut child = ChildSetup::same_identity()
            .spawn(tokio::process::Command::new("/bin/true"))
            .unwrap();
        let status = child
            .wait()
            .await
            .unwrap_or_else(|e| panic!("spawn {i}: {e}"));
        assert!(status.success(), "spawn {i}: {status}");
    }
    stop.store(true, Ordering::SeqCst);
    assert!(hammer.join().unwrap() > 0);
}
